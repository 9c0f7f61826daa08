"""The seed program: x * w on a 1-D mesh, Shard(0), 16x16, forward, backward and traces."""

from thunder_dtensor import DTensorProxy
from thunder_dtensor.testing import DTensorCase, make_full, mesh_1d, run_case

import pytest
import thunder
import torch
from torch.distributed.tensor import Shard, distribute_tensor


def mul(x, w):
    return x * w


@pytest.mark.world_size(2, 4)
def test_seed_values_grads_and_placements():
    x, w = make_full((16, 16), seed=0), make_full((16, 16), seed=1)
    run_case(DTensorCase(mul, [x, w], [[Shard(0)], [Shard(0)]]))


def test_seed_traces_show_dtensors():
    mesh = mesh_1d()
    x = distribute_tensor(make_full((16, 16), seed=0), mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(make_full((16, 16), seed=1), mesh, [Shard(0)]).requires_grad_()
    jfn = thunder.jit(mul)
    out = jfn(x, w)
    out.backward(torch.ones_like(out))

    expected_annotation = f"DTensor {x.device} f32[16, 16] mesh={mesh}, placements=(Shard(dim=0),)"
    prologue = str(thunder.last_prologue_traces(jfn)[-1])
    computation = str(thunder.last_traces(jfn)[-1])
    backward = str(thunder.last_backward_traces(jfn)[-1])
    assert expected_annotation in prologue and expected_annotation in computation and expected_annotation in backward
    assert "check_dtensor_spec_repr(" in prologue
    assert "x._local_tensor" in prologue
    # the DTensor program, then what runs: the local shards multiplied, no collective (same placements)
    assert "dtensor_mul_prim(x, w)" in str(thunder.last_traces(jfn)[0])
    assert "unwrap_dtensor(x" in computation and "torch.mul(" in computation
    executed = [line for line in backward.splitlines() if not line.strip().startswith("#")]
    assert sum("torch.mul(" in line for line in executed) == 2  # g * w and g * x
    assert not any(name in computation + backward for name in ("all_gather", "all_reduce", "reduce_scatter"))

    # the computation trace's inputs are DTensorProxies carrying the local shape of this rank's shard
    trace_args = thunder.last_traces(jfn)[0].args
    assert all(isinstance(a, DTensorProxy) for a in trace_args)
    assert trace_args[0].local_shape == tuple(x.to_local().shape)
    assert trace_args[0].placements == (Shard(0),)
    assert trace_args[0].device_mesh == mesh
