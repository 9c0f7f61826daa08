"""DTensor's choices made alike on every rank: no iteration order that depends on the process.

Each rank decides its sharding strategies and redistribution plans on its own, so every rank must decide
alike, or ranks issue different collectives (a hang, or collectives paired with the wrong partner) and
output specs differ. torch 2.13 has choices that depend on set iteration order, which depends on each
process's string-hash seed (``PYTHONHASHSEED``, random per process by default) and on object addresses:

* ``Partial.__hash__`` hashes its reduce op's string, and ``_MaskPartial.__hash__`` the ``id()`` of its mask
  buffer. DTensor's decomposition-derived strategies enumerate candidate placements from a set of them
  (``DecompShardingStrategy._get_candidate_placements``), and equal-cost strategies are then chosen by that
  order. Found by the fuzzer: eager ``F.scaled_dot_product_attention`` on CPU with a ``Partial`` query gives
  ``Replicate()`` on one rank and ``Partial(sum)`` on the other, and the next collective hangs.
* The redistribution planner's graph search adds Replicate -> Partial steps for each reduce op in a set of
  strings that a cached planner keeps growing over the process, and breaks cost ties by insertion order.

The fixes keep every decision torch makes and only make the order process-independent: placements hash by
value (the same equality, so the same caches), and the planner iterates its reduce ops sorted.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

from thunder_dtensor._integration.bootstrap import DISTRIBUTED_AVAILABLE
from thunder_dtensor._integration.registry import expects_function, installer, patch


def stable_hash(value: Any) -> int:
    """``hash(value)``, the same in every process for a string too (a reduce op's name)."""
    return zlib.crc32(value.encode()) if isinstance(value, str) else hash(value)


def _partial_hash(self: Any) -> int:
    return 1 + stable_hash(self.reduce_op)


def _mask_partial_hash(self: Any) -> int:
    # equal masks share one buffer (``__eq__`` compares it by identity); leaving its id out keeps equal
    # placements' hashes equal and makes them process-independent
    return 1 + hash((stable_hash(self.reduce_op), self.offset_shape, self.offset_dim))


class SortedIterationSet(set):
    """A set that iterates its members sorted (by ``repr``): the same order in every process."""

    def __iter__(self) -> Iterator[Any]:
        return iter(sorted(set.__iter__(self), key=repr))


@installer("dtensor", "DTensor decides sharding strategies and redistribution plans alike on every rank")
def make_dtensor_choices_alike_on_every_rank() -> None:
    """Placements hash the same in every process, and the redistribution planner iterates its reduce ops sorted
    (module docstring: which of DTensor's choices depended on the process, and how it was found)."""
    if not DISTRIBUTED_AVAILABLE:
        return
    from torch.distributed.tensor import _redistribute, placement_types

    for cls, new_hash in (
        (placement_types.Partial, _partial_hash),
        (getattr(placement_types, "_MaskPartial", None), _mask_partial_hash),  # where torch 2.13 defines it
    ):
        if cls is not None and "__hash__" in vars(cls):
            patch(cls, "__hash__", new_hash, expects=expects_function("torch.distributed.tensor", "self"))

    planner = getattr(_redistribute, "DTensorRedistributePlanner", None)
    if planner is None:  # torch releases without the graph-based planner
        return
    original_init = planner.__init__

    def init_with_sorted_reduce_ops(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        reduce_ops = getattr(self, "partial_reduce_ops_in_target", None)
        if isinstance(reduce_ops, set):
            self.partial_reduce_ops_in_target = SortedIterationSet(reduce_ops)

    patch(
        planner, "__init__", init_with_sorted_reduce_ops, expects=expects_function("torch.distributed.tensor", "self")
    )
