"""``size_strided_shards_outside_tracing``: DTensor sizes a ``_StridedShard`` with real tensors under fake tracing.

torch 2.13 computes a ``_StridedShard``'s local size and offsets by splitting a ``torch.arange`` and reading it back
with ``tolist``; under a fake tensor mode (the lowering's tracing) that read makes unbacked symbols, slowly. The
speed-up answers the same numbers without reading a fake tensor; plain (eager) calls are untouched.
"""

import thunder_dtensor  # noqa: F401  (installs the speed-up)
from thunder_dtensor import fixes
from thunder_dtensor.testing import recorded_calls

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
_StridedShard = getattr(placement_types, "_StridedShard", None)
SPEEDUP = "size_strided_shards_outside_tracing"


@pytest.mark.skipif(_StridedShard is None, reason="this torch has no _StridedShard")
@pytest.mark.parametrize(("size", "split_factor", "chunks"), [(7, 2, 2), (12, 3, 2), (5, 4, 3), (1, 2, 4)])
def test_sizes_and_offsets_under_a_fake_mode_are_eagers_without_reading_fake_tensors(
    monkeypatch, size, split_factor, chunks
):
    placement = _StridedShard(0, split_factor=split_factor)
    mode = placement_types._StridedShardOffsetMode
    eager = {
        (rank, m): placement.local_shard_size_and_offset(size, chunks, rank, m) for rank in range(chunks) for m in mode
    }
    reads = recorded_calls(monkeypatch, FakeTensor, "tolist")

    def under_fake_mode() -> dict:
        with FakeTensorMode(shape_env=ShapeEnv()), torch.no_grad():  # as the lowering traces
            return {
                (rank, m): placement.local_shard_size_and_offset(size, chunks, rank, m)
                for rank in range(chunks)
                for m in mode
            }

    with fixes.enabled(SPEEDUP, everywhere=True):
        assert under_fake_mode() == eager
    assert not reads
    with fixes.disabled(SPEEDUP):
        under_fake_mode()  # (its offsets are unbacked symbols)
    assert reads, "torch no longer reads a fake tensor here: the speed-up has nothing left to do"
