"""thunder's cache options with DTensor programs: every call gets eager's values and specs.

A DTensor program's specs are concrete (placements, global and local shapes), so no cache option may reuse a
program traced for other specs. ``"constant values"`` (the default) guards every DTensor input's spec and
every tensor's shape. Under ``"symbolic values"`` thunder keeps plain tensors' sizes and numbers symbolic and
reuses one trace for other shapes; a DTensor program's prologue instead checks each DTensor input's spec, each
tensor input's concrete shape, and each number a DTensor op reads, so a change retraces (a documented
difference: plain-tensor programs keep thunder's reuse). ``"no caching"`` traces every call. ``"same input"``
is refused by thunder 0.2.6 itself, for plain tensors as for DTensors.
Regression: ``DTensor.from_local`` under ``"symbolic values"`` returned a stale spec for a new local shape.
"""

from __future__ import annotations

import warnings

from thunder_dtensor.testing import make_full, mesh_1d

import pytest
import thunder
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

CACHES = ["constant values", "symbolic values", "no caching"]


def _jit(fn, cache: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "symbolic values" warns that it is experimental
        return thunder.jit(fn, cache=cache)


def _expected_misses(cache: str, distinct: int, calls: int) -> int:
    return calls if cache == "no caching" else distinct


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("cache", CACHES)
def test_from_local_of_a_new_local_shape_gets_a_new_spec(cache):
    mesh = mesh_1d()
    ws = mesh.size()
    jfn = _jit(lambda t: DTensor.from_local(t, mesh, [Shard(0)]) * 2, cache)
    sizes = (8, 16, 8)
    for n in sizes:
        local = make_full((n, n), seed=n)
        out = jfn(local)
        assert out.shape == (ws * n, n) and out.placements == (Shard(0),)
        torch.testing.assert_close(out.to_local(), local * 2)
        assert out.full_tensor().shape == (ws * n, n)  # a stale spec fails here ("narrow ... changed size")
    assert thunder.cache_misses(jfn) == _expected_misses(cache, 2, 3)
    assert thunder.cache_hits(jfn) == 3 - thunder.cache_misses(jfn)


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("cache", CACHES)
def test_dtensor_inputs_of_new_specs_retrace(cache):
    mesh = mesh_1d()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).redistribute(mesh, [Replicate()])

    jfn = _jit(fn, cache)
    calls = [(8, Shard(0)), (16, Shard(0)), (8, Shard(1)), (8, Shard(0)), (7, Shard(0))]  # 7: uneven shards
    for n, placement in calls:
        full = make_full((n, n), seed=n)
        out = jfn(distribute_tensor(full, mesh, [placement]))
        assert out.placements == (Replicate(),)
        torch.testing.assert_close(out.full_tensor(), full * 2)
    assert thunder.cache_misses(jfn) == _expected_misses(cache, 4, 5)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("cache", CACHES)
def test_numbers_a_dtensor_op_reads_are_guarded(cache):
    """A scalar baked into a lowered op, and a size a view reads, retrace when they change."""
    mesh = mesh_1d()

    def fn(x: torch.Tensor, scale: float, rows: int) -> torch.Tensor:
        return (x * scale).view(rows, -1)

    jfn = _jit(fn, cache)
    full = make_full((8, 8), seed=1)
    for scale, rows in ((2.0, 4), (3.0, 4), (3.0, 16), (2.0, 4)):
        out = jfn(distribute_tensor(full, mesh, [Replicate()]), scale, rows)
        torch.testing.assert_close(out.full_tensor(), (full * scale).view(rows, -1))
    assert thunder.cache_misses(jfn) == _expected_misses(cache, 3, 4)


@pytest.mark.world_size(2)
def test_same_input_is_refused_as_for_plain_tensors():
    """thunder 0.2.6 does not implement "same input"; a DTensor program says the same, not something else."""
    x = distribute_tensor(make_full((8, 8), seed=1), mesh_1d(), [Shard(0)])
    with pytest.raises(NotImplementedError, match="SAME_INPUT") as plain:
        thunder.jit(lambda t: t * 2, cache="same input")(torch.ones(2))
    with pytest.raises(NotImplementedError, match="SAME_INPUT") as dtensor:
        thunder.jit(lambda t: t * 2, cache="same input")(x)
    assert str(plain.value) == str(dtensor.value)


@pytest.mark.world_size(2)
def test_plain_tensor_programs_keep_thunders_symbolic_reuse():
    """Nothing changes for programs without DTensors: one trace serves both shapes."""
    jfn = _jit(lambda t: t * 2, "symbolic values")
    for n in (4, 6):
        torch.testing.assert_close(jfn(torch.ones(n)), torch.full((n,), 2.0))
    assert thunder.cache_misses(jfn) == 1
