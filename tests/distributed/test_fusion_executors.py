"""The lowered program is thunder's own symbols, so thunder's fusion executors can claim its local math.

The lowering emits each local ATen op that thunder has a symbol for as that symbol (thunder_equivalents.py).
With thunder's torch.compile executor listed, inductor compiles the local math and the functional collectives
in one region where nothing else cuts it (as torch.compile compiles a DTensor program), complex RoPE included;
the DTensor boundary stays outside its regions, the collectives are the default executors' (counted),
and values and gradients equal the default executors'. (`make bench` runs every bench model that way: its
`thunder_on_tcex` variant.)
"""

import copy
import functools

from thunder_dtensor.lowering import COLLECTIVE_SYMBOLS, symbol_name
from thunder_dtensor.testing import collectives_issued, mesh_1d
from thunder_dtensor.testing.llama import Llama, LlamaConfig, apply_rotary, apply_tp, rotary_frequencies
from thunder_dtensor.testing.training import full_value
from thunder_dtensor.thunder_equivalents import THUNDER_EQUIVALENTS

import pytest
import thunder
import torch
import torch.nn as nn
from thunder.core import dtypes
from torch._dynamo.utils import counters
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS = 2
BOUNDARY = {"unwrap_dtensor", "wrap_dtensor"}
#: local math a torch.compile region should hold (thunder's symbols, as the torch executor names them)
LOCAL_MATH = {"matmul", "linear", "add", "pow", "mean", "rsqrt", "reshape", "permute"}


class RotaryBlock(nn.Module):
    """RMSNorm, a column-parallel projection, complex RoPE (torchtitan's, on the local heads), a row-parallel
    projection and the residual: the Llama's attention path without the attention, an all-reduce each way."""

    def __init__(self, dim: int = 16, heads: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("freqs_cis", rotary_frequencies(dim // heads, seq, 10000.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(self.norm(x))
        q = apply_rotary(q.view(b, s, -1, self.freqs_cis.shape[-1] * 2), self.freqs_cis)
        return x + self.wo(q.reshape(b, s, -1))


def _names(trace) -> list[str]:
    return [b.sym.name for b in trace.bound_symbols]


@pytest.mark.world_size(2)
def test_lowered_local_ops_are_thunder_symbols():
    cfg = LlamaConfig(layers=1)
    torch.manual_seed(0)
    model = apply_tp(Llama(cfg), mesh_1d(), loss_parallel=False)
    jitted = thunder.jit(model)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(7))
    jitted(tokens).float().pow(2).mean().backward()
    with_equivalent = {symbol_name(op) for op in THUNDER_EQUIVALENTS}
    for trace in (thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]):
        names = _names(trace)
        assert not [n for n in names if n.startswith("dtensor_") and n.endswith("_prim")], "not lowered"
        left = sorted({n for n in names if n.startswith("aten_")} & with_equivalent)
        assert not left, f"ATen ops emitted though thunder has a symbol for them: {left}"
        assert {"matmul", "mul", "add"} <= set(names), sorted(set(names))


@functools.cache
def _rotary_block() -> RotaryBlock:
    torch.manual_seed(0)
    return RotaryBlock()


_PLAN = {"wq": ColwiseParallel(), "wo": RowwiseParallel()}


def _train(executors: list | None, *, eager: bool = False) -> tuple:
    """Train the block 2 steps: eager DTensor, or ``thunder.jit`` with ``executors`` (None: the defaults)."""
    model = parallelize_module(copy.deepcopy(_rotary_block()), mesh_1d(), _PLAN)
    jitted = model if eager else thunder.jit(model, **({} if executors is None else {"executors": executors}))
    g = torch.Generator().manual_seed(7)
    losses, grads = [], []
    for _ in range(STEPS):
        x = torch.randn(2, 8, 16, generator=g)
        model.zero_grad(set_to_none=True)
        loss = jitted(x).pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append(
            {n: (full_value(p.grad), getattr(p.grad, "placements", None)) for n, p in model.named_parameters()}
        )
    return jitted, losses, grads


@pytest.mark.world_size(2)
def test_torch_compile_executor_compiles_the_local_math_and_the_collectives_together():
    from thunder.executors.torch_compile import torch_compile_ex

    _, losses, grads = _train(None)
    graphs = counters["stats"]["unique_graphs"]
    fused_jit, fused_losses, fused_grads = _train([torch_compile_ex, *thunder.get_default_executors()])
    # inductor compiled the regions directly (compile_fused_regions_without_dynamo): dynamo captured nothing
    assert counters["stats"]["unique_graphs"] == graphs
    _, eager_losses, eager_grads = _train(None, eager=True)
    for step in range(STEPS):  # the default executors: eager DTensor's values and placements
        torch.testing.assert_close(losses[step], eager_losses[step])
        for name, (grad, placements) in eager_grads[step].items():
            assert grads[step][name][1] == placements, name
            torch.testing.assert_close(grads[step][name][0], grad, msg=lambda m, n=name: f"{n}: {m}")
    for step in range(STEPS):  # thunder's torch.compile executor: the default executors' values
        torch.testing.assert_close(fused_losses[step], losses[step])
        for name, (grad, placements) in grads[step].items():
            fused_grad, fused_placements = fused_grads[step][name]
            assert fused_placements == placements, name
            torch.testing.assert_close(fused_grad, grad, msg=lambda m, n=name, s=step: f"{n} at step {s}: {m}")

    default_jit = thunder.jit(parallelize_module(copy.deepcopy(_rotary_block()), mesh_1d(), _PLAN))
    default_jit(torch.randn(2, 8, 16)).pow(2).mean().backward()
    defaults = (thunder.last_traces(default_jit)[-1], thunder.last_backward_traces(default_jit)[-1])
    fused = (thunder.last_traces(fused_jit)[-1], thunder.last_backward_traces(fused_jit)[-1])
    for trace, default in zip(fused, defaults):
        regions = [b for b in trace.bound_symbols if b.sym.name.startswith("TorchCompile")]
        inside = [s.sym.name for r in regions for s in r.subsymbols]
        outside = _names(trace)
        assert regions and "matmul" in inside, sorted(set(inside))
        # the collectives are in inductor's regions, each of them (the default's, counted); the DTensor boundary
        # never is; the real local math and the complex RoPE are: one region each way
        collectives = sorted(n for n in inside + outside if n in COLLECTIVE_SYMBOLS)
        assert collectives == sorted(n for n in _names(default) if n in COLLECTIVE_SYMBOLS), collectives
        assert collectives and not set(outside) & set(COLLECTIVE_SYMBOLS), sorted(set(outside))
        assert not set(inside) & BOUNDARY, sorted(set(inside))
        assert not set(outside) & LOCAL_MATH, sorted(set(outside) & LOCAL_MATH)
        assert len(regions) == 1, [r.sym.name for r in regions]
        assert any(
            dtypes.is_complex_dtype(a.dtype) for r in regions for s in r.subsymbols for a in s.flat_proxy_args
        ), "the complex RoPE is left out of the region"


def _scaled_twice(dx: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return dx * 2, torch.view_as_real(c * 3)


@pytest.mark.world_size(2)
def test_a_torch_compile_region_takes_a_complex_view_of_a_real_tensor():
    """Dynamo cannot take ``view_as_complex`` of a real tensor as an input: the region that multiplies one, fused
    with the DTensor's local math, is handed a copy."""
    from thunder.executors.torch_compile import torch_compile_ex

    g = torch.Generator().manual_seed(3)
    x, real = torch.randn(4, 6, generator=g), torch.randn(3, 8, generator=g)  # viewed as (3, 4, 2)
    jitted = thunder.jit(_scaled_twice, executors=[torch_compile_ex, *thunder.get_default_executors()])
    for step in range(2):
        dx = distribute_tensor(x + step, mesh_1d(), [Shard(0)]).requires_grad_()
        out, out_real = jitted(dx, torch.view_as_complex((real + step).view(3, 4, 2)))
        torch.testing.assert_close(out.full_tensor(), (x + step) * 2)
        torch.testing.assert_close(out_real, (real + step).view(3, 4, 2) * 3)
        out.sum().backward()
        torch.testing.assert_close(dx.grad.full_tensor(), torch.full_like(x, 2.0))
    (region,) = [b for b in thunder.last_traces(jitted)[-1].bound_symbols if b.sym.name.startswith("TorchCompile")]
    assert any(dtypes.is_complex_dtype(a.dtype) for a in region.args), str(region)
    assert thunder.cache_misses(jitted) == 1


class _SequenceParallelBlock(nn.Module):
    """x + fc2(gelu(fc1(LayerNorm(x)))), the norm on sequence shards: the gathered activations are saved for the
    backward (the bench's block workload)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


@pytest.mark.world_size(2)
def test_torch_compile_executor_does_not_recompute_collectives_in_the_backward():
    """thunder's rematerialization (run where a fusion executor is listed) moved the sequence all-gather, whose
    result the backward needs, into the backward as a second all-gather (issue 44: 3 all-gathers a step where the
    default issues 2; the test GPT 17 for 12). Collectives are never recomputed: the same collectives as the
    default executors, and the values and gradients of the default executors and of eager DTensor."""
    from thunder.executors.torch_compile import torch_compile_ex
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel

    torch.manual_seed(0)
    block = _SequenceParallelBlock()
    plan = {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),  # gathers the sequence
        "fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    x = distribute_tensor(torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(1)), mesh_1d(), [Shard(1)])
    results = []
    for executors in ("eager", None, [torch_compile_ex, *thunder.get_default_executors()]):
        model = parallelize_module(copy.deepcopy(block), mesh_1d(), plan)
        if executors == "eager":
            jitted = model
        else:
            jitted = thunder.jit(model, **({} if executors is None else {"executors": executors}))
        loss = jitted(x).pow(2).mean()
        loss.backward()
        grads = {n: (full_value(p.grad), p.grad.placements) for n, p in model.named_parameters()}
        traces = (
            () if executors == "eager" else (thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1])
        )
        results.append((collectives_issued(traces), full_value(loss), grads))
    (
        (_, eager_loss, eager_grads),
        (default_comms, default_loss, default_grads),
        (fused_comms, fused_loss, fused_grads),
    ) = results
    assert "all_gather_into_tensor" in default_comms and fused_comms == default_comms, (default_comms, fused_comms)
    for loss, grads in ((default_loss, default_grads), (fused_loss, fused_grads)):
        torch.testing.assert_close(loss, eager_loss)
        for name, (grad, placements) in eager_grads.items():
            assert grads[name][1] == placements, name
            torch.testing.assert_close(grads[name][0], grad, msg=lambda m, n=name: f"{n}: {m}")


def _regions(trace) -> int:
    return sum(1 for b in trace.bound_symbols if b.sym.name.startswith("TorchCompile"))


@pytest.mark.world_size(2)
def test_thunderfx_fuses_a_lowered_backward_into_one_graph():
    """thunderfx partitions with thunder's ``dataflow`` fusion, which never fuses a symbol tagged as backward
    with an untagged one: the ops a backward dtensor prim was lowered into lost the tag, and the block's fused
    backward was three inductor graphs around thunder's own GELU gradient. One graph each way, and eager DTensor's
    loss, gradients and placements (as the default executors give them)."""
    from thunder.dynamo import thunderfx
    from thunder.executors.torch_compile import torch_compile_ex
    from torch.distributed.tensor.parallel import SequenceParallel

    torch.manual_seed(0)
    block = _SequenceParallelBlock()
    plan = {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    x = distribute_tensor(torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(1)), mesh_1d(), [Shard(1)])
    results = []
    for executors in ("eager", None, [torch_compile_ex, *thunder.get_default_executors()]):
        model = parallelize_module(copy.deepcopy(block), mesh_1d(), plan)
        if executors == "eager":
            compiled = model
        else:
            compiled = thunderfx(model, **({} if executors is None else {"executors": executors}))
        loss = compiled(x).pow(2).mean()
        loss.backward()
        grads = {n: (full_value(p.grad), p.grad.placements) for n, p in model.named_parameters()}
        results.append((full_value(loss), grads, compiled))
    (eager_loss, eager_grads, _), (default_loss, default_grads, _), (fused_loss, fused_grads, fused) = results
    for loss, grads in ((default_loss, default_grads), (fused_loss, fused_grads)):  # eager DTensor's, both
        torch.testing.assert_close(loss, eager_loss)
        for name, (grad, placements) in eager_grads.items():
            assert grads[name][1] == placements, name
            torch.testing.assert_close(grads[name][0], grad, msg=lambda m, n=name: f"{n}: {m}")
    (jitted,) = [fn for info in fused._backend.subgraph_infos for fn in info.thunder_compiled_fns]
    assert _regions(thunder.last_traces(jitted)[-1]) == 1
    assert _regions(thunder.last_backward_traces(jitted)[-1]) == 1, str(thunder.last_backward_traces(jitted)[-1])


def _reduced_in_place(x: torch.Tensor) -> torch.Tensor:
    local = (x * 2).to_local()
    torch.distributed.all_reduce(local)  # as transformers' tensor parallelism reduces a row-parallel output
    return local + 1


@pytest.mark.world_size(2)
@pytest.mark.parametrize("one_shot", [False, True])
def test_an_all_reduce_on_a_process_group_runs_as_a_functional_collective_in_a_region_without_dynamo(one_shot):
    """thunder's ``torch.distributed.all_reduce`` (c10d, in place, on a process group object: how transformers'
    tensor parallelism reduces a row-parallel output) becomes the lowering's functional all-reduce (one all-gather
    and a sum with ``dtensor_one_shot_all_reduce_bytes``): the region holding it compiles without dynamo."""
    from thunder.executors.torch_compile import torch_compile_ex

    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    x = distribute_tensor(full, mesh_1d(), [Shard(0)])
    options = {"dtensor_one_shot_all_reduce_bytes": 1024} if one_shot else {}
    for executors in ([torch_compile_ex, *thunder.get_default_executors()], thunder.get_default_executors()):
        jitted = thunder.jit(_reduced_in_place, executors=executors, **options)
        graphs = counters["stats"]["unique_graphs"]
        for _ in range(2):
            torch.testing.assert_close(jitted(x), sum(full.chunk(2)) * 2 + 1)
        assert counters["stats"]["unique_graphs"] == graphs
        trace = thunder.last_traces(jitted)[-1]
        inside = [s for b in trace.bound_symbols for s in (b.subsymbols if b.sym.name.startswith("Torch") else [b])]
        names = [b.sym.name for b in inside]
        assert ("all_gather_into_tensor" in names) == one_shot and ("all_reduce" in names) != one_shot, str(trace)
        assert "wait_tensor" in names and not any("all_reduce_" in n for n in names), str(trace)


@pytest.mark.world_size(2)
def test_a_region_with_an_in_place_collective_is_compiled_by_torch_compile():
    """A region holding c10d's in-place ``all_reduce`` (on a process group object, as thunder traces
    ``torch.distributed.all_reduce``; with the lowering off it stays so) keeps ``torch.compile``, which rewrites it
    into a functional collective: inductor alone would be handed the process group
    (compile_fused_regions_without_dynamo refuses it)."""
    from thunder.executors.torch_compile import torch_compile_ex

    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    x = distribute_tensor(full, mesh_1d(), [Shard(0)])
    executors = [torch_compile_ex, *thunder.get_default_executors()]
    jitted = thunder.jit(_reduced_in_place, executors=executors, dtensor_lowering=False)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):
        expected = sum(full.chunk(2)) * 2 + 1
        torch.testing.assert_close(jitted(x), expected)
    assert counters["stats"]["unique_graphs"] > graphs
    regions = [b for b in thunder.last_traces(jitted)[-1].bound_symbols if b.sym.name.startswith("TorchCompile")]
    assert any("all_reduce" in s.sym.name for r in regions for s in r.subsymbols), regions
