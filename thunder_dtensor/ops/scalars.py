"""Values read into Python: ``x.item()`` of a DTensor, and the reads a trace cannot fix.

``x.item()`` is the global tensor's value, computed at run time from this call's data: the DTensor is made
Replicate (an all-reduce of a Partial value, an all-gather of a Shard one: collectives the trace shows) and
thunder's own ``item`` reads the local tensor, so the number is a run-time value of the trace as for plain
tensors under thunder (no retrace when it changes). Eager DTensor's ``item()`` of a Partial value returns this
rank's unreduced part (``x.sum().item()`` of a sharded ``x``); plain torch is the reference there.

A number read this way may flow into later DTensor ops (``x * s.item()``): they take it as an argument and run as
eager DTensor ops, which get it at run time (``primitive.is_runtime_number``). Every other read of a DTensor's
data into Python (``bool(x)``, ``float(x)``, ``torch.equal``, ``x.is_nonzero()``, ...) raises
:class:`~thunder_dtensor.errors.DataDependentValueError` at trace time, where plain thunder raises for the same
call on plain tensors (``DTensorProxy``'s conversions, and ``primitive._fake_outputs`` for ops).
"""

from __future__ import annotations

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_method_for_dtensor
from thunder_dtensor.ops.redistribute import dtensor_full_tensor
from thunder_dtensor.primitive import define_dtensor_symbol


@define_dtensor_symbol
def dtensor_item(a):
    ti.check(
        a.numel == 1,
        lambda: f"Tensor.item() of a DTensor with {a.numel} elements: it needs exactly one",
        exception_type=ValueError,
    )
    return ti.ltorch.item(dtensor_full_tensor(a))


register_method_for_dtensor("item", dtensor_item)
