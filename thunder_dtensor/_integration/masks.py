"""Eager's masked lookup (``_MaskPartial``) at trace time: the mask a trace-time run makes is a stand-in.

DTensor's vocabulary-sharded lookup (``embedding``, and ``gather``) masks the ids outside a rank's rows and keeps
that mask in a buffer of the ``_MaskPartial`` placement it puts on the output, to zero those rows when the output
is reduced. The placement (and its buffer) comes from DTensor's sharding cache: every call of the op with the
same specs shares it, trace-time runs on fake tensors included. The buffer is materialized by the lookup (an
equality check where it holds a mask already) and released by the reduction (emptied at refcount zero).

A trace runs each op on its own, more than once (its forward, its gradient rule, the lowering's trace): a
materialized fake mask then meets another fake one (an equality of fakes is unknowable: a trace-time error), a
second reduction finds the buffer emptied by the first, and a mask left at the end of the trace meets the
run-time call's real one (fuzz seed 6121 at 4 ranks: a 2-D mesh where DTensor chose the masked lookup on one
mesh dim). So a fake mask replaces whatever the buffer holds and is never released by a reduction, a real mask
replaces a fake one (refcount 1), and when a compilation ends every buffer its trace-time runs reached is emptied
(also one a run of real zeros filled). A run-time lookup then finds the buffer as eager leaves it.
"""

from __future__ import annotations

from typing import Any

from thunder_dtensor._integration.bootstrap import DISTRIBUTED_AVAILABLE, DTensor, dtensor_spec, is_fake
from thunder_dtensor._integration.registry import expects_function, installer, patch

import torch

#: the mask buffers trace-time runs reached, by id: emptied when the compilation ends
_TRACE_TIME_MASKS: dict[int, Any] = {}


def note_trace_time_masks(values: Any) -> None:
    """Remember the mask buffers in the placements of ``values`` (DTensors or specs: the outputs of a
    trace-time run, fake or of real zeros), for :func:`release_trace_time_masks`."""
    for x in torch.utils._pytree.tree_leaves(values):
        spec = dtensor_spec(x) if isinstance(x, DTensor) else x
        for placement in getattr(spec, "placements", None) or ():
            buffer = getattr(placement, "mask_buffer", None)
            if buffer is not None:
                _TRACE_TIME_MASKS[id(buffer)] = buffer


def release_trace_time_masks() -> None:
    """Empty the mask buffers trace-time runs reached: a compilation is over, none of its runs holds a mask."""
    for buffer in _TRACE_TIME_MASKS.values():
        buffer.data, buffer.refcount = None, 0
    _TRACE_TIME_MASKS.clear()


def release_recomputed_masks(outs: list) -> None:
    """Release, once, each mask of a recomputed forward's outputs (a gradient rule's recomputation): nothing
    reduces those outputs, and a mask left materialized would meet the next call's (eager's lookup checks)."""
    seen: set[int] = set()
    for x in outs:
        for placement in x.placements if isinstance(x, DTensor) else ():
            buffer = getattr(placement, "mask_buffer", None)
            if buffer is not None and id(buffer) not in seen and buffer.refcount > 0:
                seen.add(id(buffer))
                buffer.release_mask()


@installer("dtensor", "a trace-time masked lookup's fake mask stands in: replaced, not compared nor released")
def let_fake_masks_stand_in() -> None:
    """``MaskBuffer.materialize_mask`` and ``release_mask`` (torch 2.10+) for fake masks (module docstring):
    real masks over real ones keep torch's own checks."""
    if not DISTRIBUTED_AVAILABLE:
        return
    from torch.distributed.tensor._ops._mask_buffer import MaskBuffer

    materialize, release = MaskBuffer.materialize_mask, MaskBuffer.release_mask

    def materialize_mask(self: Any, mask: Any) -> None:
        if is_fake(mask):  # a trace-time run's stand-in
            _TRACE_TIME_MASKS[id(self)] = self
            self.data, self.refcount = mask, self.refcount + 1
        elif self.data is not None and is_fake(self.data):  # a run-time mask where a trace left a stand-in
            self.data, self.refcount = mask, 1
        else:
            materialize(self, mask)

    def release_mask(self: Any) -> None:
        if self.data is None or not is_fake(self.data):
            release(self)

    expected = expects_function("torch.distributed.tensor", "self")
    patch(MaskBuffer, "materialize_mask", materialize_mask, expects=expected)
    patch(MaskBuffer, "release_mask", release_mask, expects=expected)
