"""Backward: values and placements equal eager DTensor's, including the cases thunder's own path fails."""

from thunder_dtensor.testing import DTensorCase, make_full, run_case

import pytest
import thunder
from torch.distributed.tensor import Partial, Replicate, Shard


def used_several_times(x, w):
    return x * w + x * x - w


def chain(x, w):
    h = x * w
    for _ in range(3):
        h = h * w + x
    return h


def broadcasting(x, b):
    return (x + b) * b


def mixed_ops(x, w):
    return (x.exp() * w).tanh() / (w.sigmoid() + 1) - x.relu().sqrt()


PLACEMENTS = [[Shard(0)], [Shard(1)], [Replicate()]]


# (8, 12) shards evenly at 2 and 4 ranks: the 2-rank run covers these
@pytest.mark.parametrize("fn", [used_several_times, chain, mixed_ops], ids=lambda f: f.__name__)
@pytest.mark.parametrize("px", PLACEMENTS, ids=str)
@pytest.mark.parametrize("pw", PLACEMENTS, ids=str)
def test_grads_match_eager(fn, px, pw):
    x, w = make_full((8, 12), seed=0, low=0.1), make_full((8, 12), seed=1, low=0.1)
    run_case(DTensorCase(fn, [x, w], [px, pw]))


@pytest.mark.parametrize("pb", [[Replicate()], [Shard(0)]], ids=str)
@pytest.mark.parametrize("px", [[Shard(0)], [Shard(1)], [Replicate()]], ids=str)
def test_broadcast_grads_reduce_like_eager(px, pb):
    x, b = make_full((6, 8), seed=2), make_full((8,), seed=3)
    run_case(DTensorCase(broadcasting, [x, b], [px, pb]))


def test_partial_input_grad():
    """A Partial(sum) input: the function sees the reduced value; grads match eager's placements."""
    x, w = make_full((4, 6), seed=4), make_full((4, 6), seed=5)
    run_case(DTensorCase(lambda x, w: x * w + x, [x, w], [[Partial()], [Replicate()]]))


def test_last_backward_traces_prints_backward():
    from thunder_dtensor.testing import mesh_1d

    from torch.distributed.tensor import distribute_tensor

    x, w = make_full((8, 8), seed=0), make_full((8, 8), seed=1)
    result = run_case(DTensorCase(chain, [x, w], [[Shard(0)], [Shard(0)]]))
    backward = str(thunder.last_backward_traces(result.jitted)[-1])
    assert "def backward_fn" in backward
    # lowered: local ops (thunder's own symbols), gradients wrapped as DTensors of their specs
    assert "torch.mul(" in backward and "torch.add(" in backward and "wrap_dtensor" in backward
    assert "placements=(Shard(dim=0),)" in backward
    # with the lowering off, the dtensor prims themselves
    jfn = thunder.jit(chain, dtensor_lowering=False)
    inputs = [distribute_tensor(t, mesh_1d(), [Shard(0)]).requires_grad_() for t in (x, w)]
    jfn(*inputs).sum().backward()
    backward = str(thunder.last_backward_traces(jfn)[-1])
    assert "dtensor_mul_prim" in backward and "dtensor_add_prim" in backward
    assert "DTensor" in backward


def _count_matmuls_in_backward(fn, inputs) -> int:
    """aten matmul kernels run by the backward of ``fn`` (the forward runs outside the count)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
                CountMatmuls.count += 1
            return func(*args, **(kwargs or {}))

    out = fn(*inputs)
    with CountMatmuls():
        out.backward(torch.ones_like(out))
    return CountMatmuls.count


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
def test_frozen_inputs_get_no_gradient_computed(lowering):
    """The issue's program: with w frozen, the backward computes no gradient for it (no matmul for it)."""
    from thunder_dtensor.testing import mesh_1d

    import torch.nn.functional as F
    from torch.distributed.tensor import distribute_tensor

    def fn(x, w, g):
        return F.gelu(F.layer_norm(F.linear(x, w), (32,), g)).sum()

    full = [make_full((8, 16), seed=1), make_full((32, 16), seed=2), make_full((32,), seed=3)]
    placements = [[Shard(0)], [Shard(0)], [Replicate()]]
    counts = {}
    for frozen in (False, True):
        # values and gradients against plain torch, placements against eager
        run_case(DTensorCase(fn, full, placements, requires_grad=[True, not frozen, False]))
        inputs = [
            distribute_tensor(t.clone(), mesh_1d(), p).requires_grad_(rg)
            for t, p, rg in zip(full, placements, [True, not frozen, False])
        ]
        jfn = thunder.jit(fn, dtensor_lowering=lowering)
        counts[frozen] = _count_matmuls_in_backward(jfn, inputs)
        backward = str(thunder.last_backward_traces(jfn)[-1])
        vjps = [line for line in backward.splitlines() if "linear_vjp_prim(" in line and "#" not in line]
        if lowering:  # the joint program's backward: one matmul for x's gradient, one more for w's
            assert not vjps, backward
            assert counts[frozen] == (1 if frozen else 2), counts
        else:
            # the vjp differentiates w.r.t. flat input 0 (x) only when w is frozen, (0, 1) otherwise
            (linear_vjp,) = vjps
            assert linear_vjp.rstrip().endswith("(0,))" if frozen else "(0, 1))"), linear_vjp
        assert inputs[1].grad is None if frozen else inputs[1].grad is not None
    # eager's backward for x alone: one matmul; the generic vjp also recomputes the forward's (one more)
    assert counts[True] < counts[False], counts
