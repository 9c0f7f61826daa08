"""A spec derived from another keeps what it does not change: its shard order and its reading of ``_StridedShard``.

A tensor dim sharded over several mesh dims holds other elements on each rank when the order differs, so a spec
rebuilt from mesh, placements and meta alone (the default order) would describe another layout. The specs here
live on a fake eight-rank process group (no peer is needed: nothing is communicated).
"""

import thunder_dtensor  # noqa: F401
import thunder_dtensor._integration as ti
from thunder_dtensor.fsdp import _with_dtype
from thunder_dtensor.spec import DTensorMeta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

ShardOrderEntry = pytest.importorskip("torch.distributed.tensor._dtensor_spec").__dict__.get("ShardOrderEntry")
_StridedShard = pytest.importorskip("torch.distributed.tensor.placement_types").__dict__.get("_StridedShard")
pytestmark = pytest.mark.skipif(ShardOrderEntry is None, reason="this torch's DTensorSpec has no shard order")

META = TensorMeta(torch.Size([8, 8]), (8, 1), torch.float32)


@pytest.fixture(scope="module")
def mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2, 2, 2))
    finally:
        dist.destroy_process_group()


def _reversed_order(mesh) -> DTensorSpec:
    """(P, S(0), S(0)) with tensor dim 0 split over mesh dim 2 first, then mesh dim 1 (not the default)."""
    order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(2, 1)),)
    return DTensorSpec(mesh, (Partial(), Shard(0), Shard(0)), META, shard_order=order)


def test_a_partial_values_cotangent_keeps_its_shard_order(mesh):
    spec = _reversed_order(mesh)
    assert spec.shard_order != DTensorSpec(mesh, spec.placements, META).shard_order  # the case is not the default
    cotangent = DTensorMeta(spec, (2, 8)).as_cotangent().spec
    assert cotangent.placements == (Replicate(), Shard(0), Shard(0))
    assert cotangent.shard_order == spec.shard_order


def test_a_spec_in_another_dtype_keeps_its_shard_order(mesh):
    spec = _reversed_order(mesh)
    in_bf16 = _with_dtype(spec, torch.bfloat16)
    assert in_bf16.tensor_meta.dtype == torch.bfloat16
    assert (in_bf16.placements, in_bf16.shard_order) == (spec.placements, spec.shard_order)


@pytest.mark.skipif(_StridedShard is None, reason="this torch has no _StridedShard")
def test_a_strided_shard_read_as_a_plain_shard_is_read_so_in_its_cotangent(mesh):
    spec = DTensorSpec(
        mesh, (Partial(), Replicate(), _StridedShard(0, split_factor=2)), META, use_strided_shard_as_shard_order=False
    )
    cotangent = DTensorMeta(spec, (4, 8)).as_cotangent().spec
    assert cotangent.placements == (Replicate(), Replicate(), _StridedShard(0, split_factor=2))
    assert cotangent.use_strided_shard_as_shard_order is False
    assert cotangent.shard_order == spec.shard_order
    # what the spec rebuilt from its placements reads instead
    assert ti.make_spec(mesh, cotangent.placements, META).use_strided_shard_as_shard_order is True
