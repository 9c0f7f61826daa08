"""First-call work: the interpreter stays out of code the package knows; trace-time work is done per signature.

What is asserted: under ``thunder.jit`` the interpreter never steps into ``nn.Module``'s call machinery
(hooks with keyword arguments included), the tensor-parallel style functions or ``DTensor.from_local`` /
``to_local`` / ``redistribute`` (its log, recorded with ``record_interpreter_history``); values and gradients
still equal eager DTensor's, also for a ``PrepareModuleInput`` subclass that overrides a step (its own code is
interpreted). Sharding propagation
and lowering results are cached by call signature: a model with three identical layers works out exactly as
many distinct calls as the same model with two, and a different spec or local shape misses the cache and gets
its own (correct) result; thunder's executor passes take a lowered op's output metadata from its trace, and a
generic vjp's meta takes its gradients from the joint trace its lowering reuses. The lowering's light ATen
recorder gives the graphs ``make_fx`` gives, node for node.
"""

import copy

from thunder_dtensor import primitive
from thunder_dtensor.lowering import GRAPH_CACHE, LOCAL_META_CACHE
from thunder_dtensor.primitive import PROPAGATION_CACHE
from thunder_dtensor.testing import mesh_1d, world_size
from thunder_dtensor.testing.training import PARITY_TOL as TOL
from thunder_dtensor.testing.training import assert_grads_match

import pytest
import thunder
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def _layers(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(n)))


def _sp_plan(n: int, input_style: type = PrepareModuleInput) -> dict:
    """Sequence parallel: every style function with a lookaside is on the path."""
    plan = {}
    for i in range(n):
        plan |= {
            f"{i}.norm": SequenceParallel(),
            f"{i}.fc1": ColwiseParallel(input_layouts=Shard(1)),
            f"{i}.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
    plan[f"{n - 1}"] = PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
    )
    plan["0"] = input_style(input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=False)
    return plan


def _record_history() -> dict:
    return {"debug_options": thunder.DebugOptions(record_interpreter_history=True)}


def _interpreted_functions(jitted) -> set[str]:
    """Functions whose lines the interpreter stepped through (a call answered by a lookaside has none)."""
    log = thunder.last_interpreter_log(jitted)
    return {item["fn"] for item in log if isinstance(item, dict) and item.get("kind") == "Line"}


def _lowered_traces(ref: nn.Module, plan: dict, **jit_kwargs) -> list:
    """The lowered traces (forward and backward: the first stage after the lowering) of one training step."""
    model = parallelize_module(copy.deepcopy(ref), mesh_1d(), plan)
    jitted = thunder.jit(model, **jit_kwargs)
    jitted(torch.randn(2, 4 * world_size(), 16, generator=torch.Generator().manual_seed(1))).sum().backward()
    return [thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]]


def _train_step_matches_eager(ref: nn.Module, plan: dict, **jit_kwargs) -> set[str]:
    """One step under thunder.jit against eager DTensor (loss, gradients, placements); the interpreted functions."""
    mesh = mesh_1d()
    eager = parallelize_module(copy.deepcopy(ref), mesh, plan)
    jitted_model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    jitted = thunder.jit(jitted_model, **jit_kwargs)
    x = torch.randn(2, 4 * world_size(), 16, generator=torch.Generator().manual_seed(1))
    expected, actual = eager(x), jitted(x)
    torch.testing.assert_close(actual, expected, **TOL)
    expected.pow(2).mean().backward()
    actual.pow(2).mean().backward()
    assert_grads_match(jitted_model, eager, "jit vs eager DTensor", **TOL)
    for p, q in zip(jitted_model.parameters(), eager.parameters()):
        assert tuple(p.grad.placements) == tuple(q.grad.placements)
    return _interpreted_functions(jitted) if "debug_options" in jit_kwargs else set()


def test_interpreter_does_not_step_into_module_calls_tp_hooks_or_dtensor_boundary():
    interpreted = _train_step_matches_eager(_layers(2), _sp_plan(2), **_record_history())
    assert "Block.forward" in interpreted  # the user's code is interpreted
    # the hooks' one-line lambdas are interpreted: through their closures the prologue reads the style's state
    stepped_into = sorted(
        name
        for name in interpreted
        if name.split(".")[-1] in ("_call_impl", "_wrapped_call_impl", "from_local", "to_local", "redistribute")
        or name.split(".")[0]
        in ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput")
        and not name.endswith("<lambda>")
    )
    assert not stepped_into, f"the interpreter stepped into {stepped_into}"


class _KwargBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_kwargs_hooks_run_outside_the_interpreter_and_match_eager():
    """``PrepareModuleInput`` with keyword-argument layouts registers a pre-hook that takes and returns kwargs."""
    torch.manual_seed(0)
    ref = _KwargBlock()
    plan = {
        "": PrepareModuleInput(input_kwarg_layouts={"x": Shard(1)}, desired_input_kwarg_layouts={"x": Replicate()}),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    }
    mesh = mesh_1d()
    eager = parallelize_module(copy.deepcopy(ref), mesh, plan)
    model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    assert model._forward_pre_hooks_with_kwargs
    jitted = thunder.jit(model, **_record_history())
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))  # this rank's sequence shard
    expected, actual = eager(x=x), jitted(x=x)
    torch.testing.assert_close(actual, expected, **TOL)
    expected.sum().backward()
    actual.sum().backward()
    assert_grads_match(model, eager, "jit vs eager DTensor", **TOL)
    interpreted = _interpreted_functions(jitted)
    assert not {"Module._call_impl", "Module._wrapped_call_impl"} & interpreted, interpreted


class _ScaledInput(PrepareModuleInput):
    """A user's style that overrides one step: the lookaside declines, torch's code (and this) is interpreted."""

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):  # noqa: A002
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout) * 2.0


def test_overridden_style_step_is_interpreted_and_matches_eager():
    interpreted = _train_step_matches_eager(_layers(1), _sp_plan(1, _ScaledInput), **_record_history())
    assert "_ScaledInput._prepare_input_arg" in interpreted
    assert "PrepareModuleInput._prepare_input_fn" in interpreted


def test_identical_layers_are_propagated_and_lowered_once():
    # the first layer (its input comes from the plan's input style) and the last (the output style) differ from
    # the others: a third layer adds nothing new to work out
    misses = {}
    for n in (2, 3):
        PROPAGATION_CACHE.clear()
        GRAPH_CACHE.clear()
        _train_step_matches_eager(_layers(n), _sp_plan(n))
        misses[n] = (PROPAGATION_CACHE.misses, GRAPH_CACHE.misses)
        assert PROPAGATION_CACHE.hits > 0 and GRAPH_CACHE.hits > 0
    assert misses[3] == misses[2], f"(propagation, lowering) misses for 2 layers and 3 layers: {misses}"


def test_executors_claim_lowered_ops_without_running_them_again():
    # each emitted op is bound to the executor operator that runs it, so thunder's claiming pass keeps it as it
    # is; where a fusion executor may take the ops (torch.compile's), they are left to thunder (which fuses them),
    # and their metas answer from the traced node's fake outputs: no fake op runs again either way
    from thunder.extend import get_executor

    LOCAL_META_CACHE.clear()
    bsyms = [b for t in _lowered_traces(_layers(2), _sp_plan(2)) for b in t.bound_symbols]
    local_ops = [b for b in bsyms if b.sym.name.startswith("aten_")]
    assert local_ops and all(b.sym.executor is not None and not b.subsymbols for b in local_ops)
    assert LOCAL_META_CACHE.hits == LOCAL_META_CACHE.misses == 0, LOCAL_META_CACHE

    LOCAL_META_CACHE.clear()
    executors = [get_executor("torchcompile"), get_executor("torch")]
    bsyms = [b for t in _lowered_traces(_layers(2), _sp_plan(2), executors=executors) for b in t.bound_symbols]
    fused = [s for b in bsyms if b.sym.name.startswith("TorchCompile") for s in b.subsymbols]
    assert any(s.sym.name.startswith("aten_") for s in fused), "the lowered local math was not fused"
    assert {"linear", "matmul"} & {s.sym.name for s in fused}, "the lowered matmuls (thunder's symbols) were not fused"
    assert LOCAL_META_CACHE.hits > len(LOCAL_META_CACHE) > 0
    assert LOCAL_META_CACHE.misses == 0, f"a lowered op's meta ran a fake op again: {LOCAL_META_CACHE}"


@pytest.mark.parametrize("lowering", [True, False])
def test_a_generic_vjp_and_its_lowering_trace_the_backward_once(monkeypatch, lowering):
    # with the lowering on, a generic vjp's meta takes its gradients' specs from the joint trace the lowering
    # then reuses; with it off, the vjp's own fake run answers (and nothing is traced for the lowering)
    runs = []
    fake_outputs = primitive._fake_outputs

    def counted(name, *args):
        runs.append(name)
        return fake_outputs(name, *args)

    monkeypatch.setattr(primitive, "_fake_outputs", counted)
    PROPAGATION_CACHE.clear()
    GRAPH_CACHE.clear()
    _train_step_matches_eager(_layers(2), _sp_plan(2), dtensor_lowering=lowering)
    vjp_runs = [name for name in runs if primitive.is_generic_vjp(name)]
    if lowering:
        assert not vjp_runs, f"generic vjps ran their own fake run: {vjp_runs}"
        assert GRAPH_CACHE.hits > 0 and GRAPH_CACHE.misses == len(GRAPH_CACHE), GRAPH_CACHE
    else:
        assert vjp_runs and GRAPH_CACHE.misses == 0, GRAPH_CACHE


def _graph_structure(graph) -> list:
    """Each live node's kind, target, arguments (earlier nodes by position) and value's metadata.

    Only the inputs and what the outputs are computed from (all the lowering emits): DTensor's sharding
    propagation runs ops on fakes too, which a recording shows only when its decision was not cached yet.
    """
    output = next(n for n in graph.nodes if n.op == "output")
    live, stack = set(), [output]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    nodes = [n for n in graph.nodes if n in live or n.op == "placeholder"]
    position = {node: i for i, node in enumerate(nodes)}

    def describe(value):
        return (tuple(value.shape), value.stride(), value.dtype) if isinstance(value, torch.Tensor) else None

    return [
        (
            n.op,
            n.target,
            torch.fx.map_arg((n.args, n.kwargs), lambda a: ("node", position[a])),
            describe(n.meta.get("val")),
        )
        for n in nodes
    ]


def test_recorded_graphs_are_the_graphs_make_fx_records(monkeypatch):
    # the lowering's light ATen recorder must give make_fx's graph, node for node, on a training step with every
    # kind of lowered op (the sequence-parallel plan: redistributions, norms, linears, their joint backward)
    from thunder_dtensor import _integration as ti
    from thunder_dtensor._integration import compile_pipeline

    make_fx, trace_aten_graph = ti.make_fx, ti.trace_aten_graph
    compared, handed_to_make_fx = [], []

    def counted_make_fx(fn, **kwargs):
        handed_to_make_fx.append(fn)
        return make_fx(fn, **kwargs)

    def compared_with_make_fx(fn, inputs):
        graph = trace_aten_graph(fn, inputs)
        expected = make_fx(fn, tracing_mode="fake")(*[torch.empty_strided(*i[:2], dtype=i[2]) for i in inputs])
        compared.append((_graph_structure(graph), _graph_structure(expected.graph)))
        return graph

    monkeypatch.setattr(compile_pipeline, "make_fx", counted_make_fx)  # (trace_aten_graph's own fallback)
    monkeypatch.setattr(ti, "trace_aten_graph", compared_with_make_fx)
    GRAPH_CACHE.clear()
    _train_step_matches_eager(_layers(2), _sp_plan(2))
    assert len(compared) == GRAPH_CACHE.misses > 5
    for recorded, expected in compared:
        assert recorded == expected
    assert not handed_to_make_fx, f"{len(handed_to_make_fx)} of {len(compared)} traces were left to make_fx"


def test_cache_is_exact_a_different_spec_or_local_shape_misses():
    mesh = mesh_1d()
    full = torch.randn(4 * world_size(), 2 * world_size(), generator=torch.Generator().manual_seed(2))

    def run(placements, t=full):
        x = distribute_tensor(t, mesh, placements)
        before = (PROPAGATION_CACHE.misses, GRAPH_CACHE.misses)
        out = thunder.jit(lambda a: (a * 3).sum(0))(x)  # a new jit each time: only the caches are shared
        after = (PROPAGATION_CACHE.misses, GRAPH_CACHE.misses)
        expected = (x * 3).sum(0)  # eager DTensor
        assert isinstance(out, DTensor) and out.placements == expected.placements
        torch.testing.assert_close(out.full_tensor(), (t * 3).sum(0))
        return out, (after[0] - before[0], after[1] - before[1])

    run([Shard(0)])
    out, new_misses = run([Shard(0)])
    assert new_misses == (0, 0), f"the same signature worked out again: {new_misses}"
    out1, new_misses = run([Shard(1)])
    assert new_misses[0] > 0 and new_misses[1] > 0, "a different spec hit the cache"
    assert out.placements != out1.placements  # Partial(sum) vs Shard(0): not the cached answer
    uneven = torch.randn(4 * world_size() + 1, 2 * world_size(), generator=torch.Generator().manual_seed(3))
    _, new_misses = run([Shard(0)], uneven)
    assert new_misses[0] > 0 and new_misses[1] > 0, "a different local shape hit the cache"


@pytest.mark.world_size(2)
def test_signature_descriptions_are_exact():
    from thunder_dtensor.signature import SignatureCache, Uncacheable, describe_value

    assert len({describe_value(v) for v in (1, 1.0, True, "1", (1,), [1], None)}) == 7
    assert describe_value(Shard(0)) != describe_value(Shard(1))
    assert describe_value(mesh_1d()) == describe_value(mesh_1d())
    assert describe_value(slice(1, None)) != describe_value(slice(1, 0))
    with pytest.raises(Uncacheable):
        describe_value(slice(0, object()))  # a slice's parts are described too (an fx node's repr is its name)
    with pytest.raises(Uncacheable):
        describe_value(object())
    cache = SignatureCache("test", maxsize=2)
    for key in "abc":
        cache.get_or_compute(key, lambda k=key: k.upper())
    assert len(cache) == 2 and cache.misses == 3
    assert cache.get_or_compute("c", lambda: "not called") == "C" and cache.hits == 1
    assert cache.get_or_compute(None, lambda: "uncached") == "uncached" and len(cache) == 2


def test_meshes_over_the_same_ranks_but_other_process_groups_keep_their_own_collectives():
    """Equal meshes (same ranks) may hold different process groups: a cached result must not carry the other's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    ranks = list(range(world_size()))
    meshes = [DeviceMesh.from_group(dist.new_group(ranks), "cpu") for _ in range(2)]
    assert meshes[0] == meshes[1]
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))
    for mesh in meshes:
        group = mesh.get_group(0).group_name
        jitted = thunder.jit(
            lambda t, mesh=mesh: DTensor.from_local(t, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        )
        out = jitted(x)
        assert out.device_mesh is mesh
        assert f"'{group}'" in str(thunder.last_traces(jitted)[-1]), f"the all-gather is not on group {group}"
        torch.testing.assert_close(out.to_local(), torch.cat([x] * world_size()))
