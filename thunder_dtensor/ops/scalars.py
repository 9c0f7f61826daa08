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
call on plain tensors (``DTensorProxy``'s conversions, and ``primitive._fake_outputs`` for ops). So does a
branch on a number read at run time (``if s > 0:``), which thunder alone takes as ``bool(None)``: the ``else``
branch, silently (:func:`branch_refusal`, the thunder fix ``refuse_branches_on_run_time_numbers``).

Under thunderfx, ``.item()`` ends dynamo's graph and runs as eager DTensor's, on the graph's output: eager's
rank-local part of a Partial value. While a thunderfx program is called, DTensor's ``item()`` reads the global
value instead (:func:`global_item`), as ``thunder.jit`` does.
"""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_method_for_dtensor
from thunder_dtensor.errors import DataDependentValueError
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


def global_item(op: Any, args: tuple, kwargs: dict) -> Any:
    """``x.item()`` of an eager DTensor as its global value (DTensor's handler for ``aten._local_scalar_dense``):
    a Partial or Shard DTensor is made Replicate first (an all-reduce / all-gather), where eager DTensor reads the
    local tensor as it is."""
    (x,) = args
    if not all(p.is_replicate() for p in x.placements):
        x = x.redistribute(x.device_mesh, [ti.Replicate()] * x.device_mesh.ndim)
    return op(x.to_local(), **kwargs)


def branch_refusal(number: Any, where: str | None = None) -> DataDependentValueError:
    """The error for ``bool(s)`` of a number the program reads from a tensor's data at run time (``if s > 0:``);
    ``where``: the thunder function whose own Python branched on it (``thunder.torch.dropout``), if not the
    program."""
    what = "the program" if where is None else f"thunder's {where}"
    return DataDependentValueError(
        "bool" if where is None else where,
        (),
        {},
        f"bool() of {number.name} in {what}: a number computed from a tensor's data (x.item()) whose value is "
        "known at run time only: a trace cannot take a branch on it",
        hint="keep the condition a tensor and choose with torch.where, or compile with thunderfx (thunder.dynamo), "
        "which runs the branch in Python between graphs",
    )
