"""The lowering: DTensor programs run as local ops plus explicit collectives, forward and backward.

What is asserted: the lowered traces show each collective with its mesh dim and no dtensor prim, while the
first trace keeps the DTensor program; a steady-state call dispatches no DTensor op (a TorchDispatchMode
counts aten ops with DTensor arguments); the backward reruns no forward op; collectives come in the same
order on every rank, uneven shards included; ``dtensor_lowering=False`` keeps the eager-prim path. Values are
compared with plain torch on the full tensors, collectives and gradient placements with eager DTensor.
"""

import copy

from thunder_dtensor.testing import mesh_1d, world_size
from thunder_dtensor.testing.models import GPT, GPTConfig, loss_fn, parallelize
from thunder_dtensor.testing.training import PARITY_TOL as TOL
from thunder_dtensor.testing.training import assert_grads_match

import pytest
import thunder
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


class DTensorOps(TorchDispatchMode):
    """Records every aten op called with a DTensor argument (DTensor's own dispatch would follow)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0]):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def _tp_mlp(ref: nn.Module) -> nn.Module:
    return parallelize_module(copy.deepcopy(ref), mesh_1d(), {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _symbols(trace) -> list[str]:
    return [b.sym.name for b in trace.bound_symbols]


def _collectives(trace) -> list[str]:
    return [f"{b.sym.name}@{b.kwargs.get('mesh_dim')}" for b in trace.bound_symbols if b.sym.name in COLLECTIVES]


def test_tp_mlp_traces_show_collectives_and_run_no_dtensor_op():
    ref = _mlp()
    model = _tp_mlp(ref)
    jitted = thunder.jit(model)
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):  # compile, then a cached call
        out = jitted(x)
        out.sum().backward()
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    # the DTensor program first, its lowered form last
    assert any(name.startswith("dtensor_") for name in _symbols(thunder.last_traces(jitted)[0]))
    for trace in (forward, backward):
        assert not [n for n in _symbols(trace) if n.startswith("dtensor_") and n.endswith("_prim")], str(trace)
    # rowwise output: Partial -> Replicate; colwise input gradient: Partial -> Replicate (mesh dim 0)
    assert _collectives(forward) == ["all_reduce@0"], str(forward)
    assert _collectives(backward) == ["all_reduce@0"], str(backward)
    # no forward op rerun: 2 matmuls forward, 4 backward (input and weight gradients of each linear), emitted
    # as thunder's own symbols (which every executor can claim), not as ATen calls
    assert _symbols(forward).count("matmul") + _symbols(forward).count("linear") == 2, str(forward)
    assert _symbols(backward).count("matmul") == 4, str(backward)
    assert not [n for n in _symbols(forward) + _symbols(backward) if n in ("aten_mm", "aten_addmm")]

    model.zero_grad(set_to_none=True)
    with DTensorOps() as fwd_ops:
        out = jitted(x)
    assert fwd_ops.ops == [], fwd_ops.ops
    with DTensorOps() as bwd_ops:
        out.sum().backward()
    # what autograd itself does with the DTensor parameters' gradients (accumulation into .grad), nothing else
    assert set(bwd_ops.ops) <= {"aten.detach.default"}, bwd_ops.ops

    expected = ref(x.detach())
    expected.sum().backward()
    torch.testing.assert_close(out, expected, **TOL)
    assert_grads_match(model, ref, "tp mlp")


def test_lowering_off_keeps_the_eager_prims():
    ref = _mlp()
    model = _tp_mlp(ref)
    jitted = thunder.jit(model, dtensor_lowering=False)
    x = torch.randn(4, 16)
    jitted(x).sum().backward()
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    assert not _collectives(forward) and not _collectives(backward)
    assert "dtensor_nn_functional_linear_prim" in _symbols(forward)
    ref(x).sum().backward()
    assert_grads_match(model, ref, "tp mlp, lowering off")


def _chain(x, w, b):
    y = x.redistribute(x.device_mesh, [Replicate()]) * w  # all_gather of an uneven shard
    z = (y @ b).sum(0, keepdim=True)
    return z + x.sum()


@pytest.mark.world_size(2, 4)
def test_uneven_shards_issue_collectives_in_the_same_order_on_every_rank():
    mesh = mesh_1d()
    torch.manual_seed(0)
    rows = 2 * world_size() + 1  # uneven: the last rank holds fewer rows
    full = [torch.randn(rows, 6), torch.randn(rows, 6), torch.randn(6, 8)]
    placements = [[Shard(0)], [Replicate()], [Shard(1)]]
    args = [distribute_tensor(t, mesh, p).requires_grad_() for t, p in zip(full, placements)]
    eager_args = [distribute_tensor(t, mesh, p).requires_grad_() for t, p in zip(full, placements)]
    jitted = thunder.jit(_chain)
    cotangent = torch.randn(1, 8)
    # compile first (tracing runs DTensor's dispatch on fake tensors, whose collectives the mode would count)
    warm = jitted(*args)
    warm.backward(distribute_tensor(cotangent, mesh, warm.placements))
    for a in args:
        a.grad = None
    with CommDebugMode() as jit_comms:
        out = jitted(*args)
        out.backward(distribute_tensor(cotangent, mesh, out.placements))
    with CommDebugMode() as eager_comms:
        eager_out = _chain(*eager_args)
        eager_out.backward(distribute_tensor(cotangent, mesh, eager_out.placements))
    plain = [t.clone().requires_grad_() for t in full]
    expected = _chain_plain(*plain)
    expected.backward(cotangent)
    torch.testing.assert_close(out.full_tensor(), expected, **TOL)
    for a, e, p in zip(args, eager_args, plain):
        torch.testing.assert_close(a.grad.full_tensor(), p.grad, **TOL)
        assert a.grad.placements == e.grad.placements
    for op, n in jit_comms.get_comm_counts().items():
        assert n <= eager_comms.get_comm_counts().get(op, 0), (op, n, eager_comms.get_comm_counts())
    mine = (_collectives(thunder.last_traces(jitted)[-1]), _collectives(thunder.last_backward_traces(jitted)[-1]))
    assert mine[0], "the forward gathers the uneven shard"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(seq == mine for seq in everyone), everyone


def _chain_plain(x, w, b):
    return ((x * w) @ b).sum(0, keepdim=True) + x.sum()


# sequence parallel: its plan has every hook kind of the TP plan plus the sequence-dim redistributions (suite time)
@pytest.mark.parametrize("sequence_parallel", [True], ids=["sp"])
def test_gpt_steady_state_runs_no_dtensor_op(sequence_parallel):
    cfg = GPTConfig(layers=1)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = parallelize(copy.deepcopy(ref), mesh_1d(), sequence_parallel=sequence_parallel)
    jitted = thunder.jit(model)
    g = torch.Generator().manual_seed(1)
    idx, tgt = (
        torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g),
        torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g),
    )
    for _ in range(2):
        loss_fn(jitted(idx), tgt).backward()
        model.zero_grad(set_to_none=True)
    forward = thunder.last_traces(jitted)[-1]
    eager_prims = [b.sym.name for b in forward.bound_symbols if b.sym.name.startswith("dtensor_")]
    assert not eager_prims, f"not lowered: {eager_prims}\n{forward}"
    with DTensorOps() as fwd_ops:
        logits = jitted(idx)
    assert fwd_ops.ops == [], fwd_ops.ops
    loss = loss_fn(logits, tgt)
    loss.backward()
    ref_loss = loss_fn(ref(idx), tgt)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_match(model, ref, "gpt")


def _read_by(trace, index: int) -> set[int]:
    """The indices of the symbols of ``trace`` that the symbol at ``index`` transitively reads."""
    producer = {p.name: i for i, b in enumerate(trace.bound_symbols) for p in b.flat_proxy_outs}
    seen, todo = set(), [index]
    while todo:
        i = todo.pop()
        for p in trace.bound_symbols[i].flat_proxy_args:
            j = producer.get(p.name)
            if j is not None and j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


def test_issue_early_option_issues_each_collective_before_the_work_it_does_not_read():
    """``dtensor_issue_early=True``: in the backward of a TP MLP the input gradient's all-reduce is issued before
    the matmuls it does not read (the weight gradients), so on NCCL they overlap it; values, gradients and
    collectives are the default's."""
    ref = _mlp()
    x = torch.randn(4, 16, requires_grad=True)
    models, outs, matmuls_before = [], [], []
    for early in (False, True):
        model = _tp_mlp(ref)
        jitted = thunder.jit(model, dtensor_issue_early=early)
        out = jitted(x)
        out.sum().backward()
        models.append(model)
        outs.append(out)
        forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
        assert _collectives(forward) == ["all_reduce@0"] and _collectives(backward) == ["all_reduce@0"]
        (at,) = [i for i, b in enumerate(backward.bound_symbols) if b.sym.name == "all_reduce"]
        read = _read_by(backward, at)
        before = [i for i, b in enumerate(backward.bound_symbols[:at]) if b.sym.name == "matmul"]
        matmuls_before.append([i for i in before if i not in read])
    assert matmuls_before[1] == [], str(backward)
    assert len(matmuls_before[0]) > 0  # the default order computes a weight gradient before it
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for (name, p_early), (_, p_default) in zip(models[1].named_parameters(), models[0].named_parameters()):
        assert p_early.grad.placements == p_default.grad.placements, name
        torch.testing.assert_close(p_early.grad.full_tensor(), p_default.grad.full_tensor(), rtol=0, atol=0)
    expected = ref(x.detach())
    torch.testing.assert_close(outs[1], expected, **TOL)


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("limit, kind", [(0, "all_reduce"), (256, "all_gather_into_tensor"), (255, "all_reduce")])
def test_one_shot_option_sums_small_all_reduces_from_one_all_gather(limit, kind):
    """``dtensor_one_shot_all_reduce_bytes``: each sum all-reduce of at most that many bytes per rank (here the
    row-parallel output and the column-parallel input gradient, 4 x 16 floats: 256 bytes) is one all-gather and a
    local sum, in the forward and the backward; larger ones stay all-reduces. Values and gradients are plain
    torch's either way."""
    ref = _mlp()
    x = torch.randn(4, 16, requires_grad=True)
    model = _tp_mlp(ref)
    jitted = thunder.jit(model, dtensor_one_shot_all_reduce_bytes=limit)
    out = jitted(x)
    out.sum().backward()
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    for trace in (forward, backward):
        assert _collectives(trace) == [f"{kind}@0"], str(trace)
        assert ("aten_sum_dim_IntList" in _symbols(trace)) == (kind != "all_reduce"), str(trace)
    expected = ref(x.detach())
    expected.sum().backward()
    torch.testing.assert_close(out, expected, **TOL)
    assert_grads_match(model, ref, "tp mlp")


def test_one_shot_option_sums_a_scalar_and_leaves_integer_sums_alone():
    """A 0-dim partial sum (a sharded tensor's total, replicated) is gathered as a vector of one element a rank; an
    integer sum stays an all-reduce (a local ``sum`` would promote its dtype)."""
    full = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    x = distribute_tensor(full, mesh_1d(), [Shard(0)])
    total = thunder.jit(lambda d: d.sum().full_tensor() * 2, dtensor_one_shot_all_reduce_bytes=8)
    torch.testing.assert_close(total(x), full.sum() * 2, **TOL)
    assert _collectives(thunder.last_traces(total)[-1]) == ["all_gather_into_tensor@0"]
    count = thunder.jit(lambda d: (d > 0).sum().full_tensor(), dtensor_one_shot_all_reduce_bytes=8)
    assert torch.equal(count(x), (full > 0).sum())
    assert _collectives(thunder.last_traces(count)[-1]) == ["all_reduce@0"]


@pytest.mark.world_size(2)
def test_the_unwrap_of_an_eager_result_gives_the_layout_the_lowering_traced():
    """An eager result is read dense in its spec's layout (``eager_result_info``): the unwrap hands its local tensor
    on where it is laid out so, and copies it there where it is not (autograd, or a redistribution, may give
    another layout). Its value never changes."""
    from thunder_dtensor.lowering.symbols import _unwrap

    mesh = mesh_1d()
    full = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(4, 6, 2)
    transposed = distribute_tensor(full, mesh, [Shard(0)]).transpose(1, 2)  # local [2, 2, 6], strides (12, 1, 2)
    spec_stride = transposed.to_local().stride()
    same = _unwrap(transposed, transposed._spec, spec_stride)
    assert same is transposed.to_local() or same.data_ptr() == transposed.to_local().data_ptr()
    contiguous = DTensor.from_local(transposed.to_local().contiguous(), mesh, [Shard(0)], run_check=False)
    copied = _unwrap(contiguous, contiguous._spec, spec_stride)
    assert copied.stride() == spec_stride
    torch.testing.assert_close(copied, transposed.to_local())
    assert _unwrap(transposed, transposed._spec, True).is_contiguous()
