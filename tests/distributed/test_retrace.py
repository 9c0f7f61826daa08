"""A spec change between calls retraces; the same spec hits the cache."""

from thunder_dtensor.testing import make_full, mesh_1d, mesh_2d

import pytest
import thunder
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def fn(x, w):
    return x * w + w


def test_placements_change_retraces_and_stays_correct():
    jfn = thunder.jit(fn)
    x_full, w_full = make_full((8, 8), seed=0), make_full((8, 8), seed=1)
    expected = fn(x_full, w_full)
    mesh = mesh_1d()
    sequence = [[Shard(0)], [Replicate()], [Shard(1)], [Shard(0)]]
    for placements in sequence:
        x = distribute_tensor(x_full, mesh, placements)
        w = distribute_tensor(w_full, mesh, placements)
        out = jfn(x, w)
        assert out.placements == tuple(placements)
        torch.testing.assert_close(out.full_tensor(), expected)
    # three distinct specs traced, the fourth call reuses the first
    assert thunder.cache_misses(jfn) == 3
    assert thunder.cache_hits(jfn) == 1


def test_shape_change_retraces():
    jfn = thunder.jit(fn)
    mesh = mesh_1d()
    for n in (8, 12, 8):
        x_full, w_full = make_full((n, 4), seed=n), make_full((n, 4), seed=n + 1)
        x = distribute_tensor(x_full, mesh, [Shard(0)])
        w = distribute_tensor(w_full, mesh, [Shard(0)])
        torch.testing.assert_close(jfn(x, w).full_tensor(), fn(x_full, w_full))
    assert thunder.cache_misses(jfn) == 2 and thunder.cache_hits(jfn) == 1


@pytest.mark.world_size(4)
def test_mesh_change_retraces():
    jfn = thunder.jit(fn)
    x_full, w_full = make_full((8, 8), seed=0), make_full((8, 8), seed=1)
    for mesh, placements in ((mesh_1d(), [Shard(0)]), (mesh_2d(), [Shard(0), Shard(1)])):
        x = distribute_tensor(x_full, mesh, placements)
        w = distribute_tensor(w_full, mesh, placements)
        out = jfn(x, w)
        assert out.device_mesh == mesh
        torch.testing.assert_close(out.full_tensor(), fn(x_full, w_full))
    assert thunder.cache_misses(jfn) == 2
