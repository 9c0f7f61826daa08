"""DTensor's own API inside a program: eager's values, placements and collectives, or a named refusal.

``distribute_tensor`` (every ``src_data_rank``), DTensor's factories (``torch.distributed.tensor.zeros`` & co.),
the keywords of ``redistribute`` / ``from_local`` / ``to_local`` / ``full_tensor``, and gradients handed in
with any placement eager accepts (``backward(gradient=...)``, ``torch.autograd.grad(..., grad_outputs=...)``):
the backward is traced again for the cotangents' placements (guards.BackwardForCotangentPlacements), so the
input gradients carry eager's placements and no collective eager does not issue runs. Collectives are counted
on a second call (or backward) with the same placements: the first one traces, and trace-time fake runs of
collectives are seen by ``CommDebugMode`` too.
"""

from __future__ import annotations

import gc
import inspect
import warnings
from collections.abc import Callable

from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.guards import CotangentPlacementWarning
from thunder_dtensor.testing import comm_counts, make_full, mesh_1d, mesh_2d, world_size

import pytest
import thunder
import torch
import torch.distributed as dist
import torch.distributed.tensor as dtensor_api
from thunder.dynamo import thunderfx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode


def _rank() -> int:
    return dist.get_rank()


def _counted(fn: Callable, *args) -> tuple:
    with CommDebugMode() as mode:
        out = fn(*args)
    return out, comm_counts(mode)


def _same_locals(actual, expected, what: str) -> None:
    """Placements, dtype, global shape and this rank's local values equal eager's (``empty``'s values aside)."""
    assert isinstance(actual, DTensor), f"{what}: {type(actual)}"
    assert actual.placements == expected.placements, f"{what}: {actual.placements} != eager {expected.placements}"
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), what
    torch.testing.assert_close(actual.to_local(), expected.to_local(), msg=lambda m: f"{what}: {m}")


# --- distribute_tensor ------------------------------------------------------------------------------------
@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("src_data_rank", [0, 1, None], ids=lambda r: f"src{r}")
def test_distribute_tensor_in_a_program(src_data_rank):
    """Each rank's data differs, so the source rank shows in the values: 0 and 1 scatter / broadcast from that rank
    (eager's c10d collectives), None keeps each rank's own chunk and communicates nothing."""
    mesh = mesh_1d()
    layouts = [[Shard(0)], [Replicate()], [Partial()], [Shard(1)]]

    def fn(t, x):
        return tuple(distribute_tensor(t * 1, mesh, p, src_data_rank=src_data_rank) * x for p in layouts)

    t = make_full((5, 4), seed=1) + 10 * _rank()  # 5 rows: uneven shards at 2 and 4 ranks
    x = distribute_tensor(make_full((5, 4), seed=2), mesh, [Replicate()])
    expected, eager_comms = _counted(fn, t, x)
    jitted = thunder.jit(fn)
    jitted(t, x)
    actual, jit_comms = _counted(jitted, t, x)
    for a, e, p in zip(actual, expected, layouts):
        _same_locals(a, e, f"distribute_tensor(..., {p}, src_data_rank={src_data_rank})")
    assert jit_comms == eager_comms, (jit_comms, eager_comms)
    if src_data_rank is None:
        assert jit_comms == {}
    else:  # Shard scatters; Replicate and Partial broadcast
        assert jit_comms == {"broadcast": 2, "scatter": 2}


def test_distribute_tensor_of_a_tensor_made_in_the_program():
    """A tensor the program makes (a constant of eager's code, the issue's reproducer) distributed there.

    (Under thunderfx dynamo itself breaks its graph at distribute_tensor's c10d calls, which then run eagerly
    between its graphs: thunder never sees them.)"""
    mesh = mesh_1d()

    def fn(e):
        return e * distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])

    e = distribute_tensor(make_full((4, 6), seed=3), mesh, [Replicate()])
    expected, eager_comms = _counted(fn, e)
    jitted = thunder.jit(fn)
    jitted(e)
    actual, comms = _counted(jitted, e)
    _same_locals(actual, expected, "distribute_tensor(torch.ones(4, 6), ...)")
    assert comms == eager_comms == {"scatter": 1}, comms


def test_distribute_tensor_refusals():
    mesh = mesh_1d()
    t = make_full((4, 6), seed=4)
    d = distribute_tensor(t, mesh, [Shard(0)])
    # a DTensor already placed so is returned as it is, as eager does
    same = thunder.jit(lambda d: distribute_tensor(d, mesh, [Shard(0)]) * 2)(d)
    _same_locals(same, d * 2, "a DTensor distributed to its own placements")
    cases = {
        "requires grad": (lambda t: distribute_tensor(t, mesh, [Shard(0)]), t.clone().requires_grad_()),
        "other placements": (lambda d: distribute_tensor(d, mesh, [Replicate()]), d),
        "no mesh": (lambda t: distribute_tensor(t, None, [Shard(0)]), t),
        "mixed partials": (lambda t: distribute_tensor(t, mesh_2d(), [Partial("sum"), Partial("max")]), t),
    }
    if world_size() % 2:
        del cases["mixed partials"]
    for name, (fn, arg) in cases.items():
        with pytest.raises(DTensorOpError, match="distribute_tensor") as info:
            thunder.jit(fn)(arg)
        assert "placements" in str(info.value) and "hint:" in str(info.value), name


# --- DTensor factories ------------------------------------------------------------------------------------
@pytest.mark.world_size(2, 4)
def test_dtensor_factories_in_a_program():
    """zeros / ones / full / empty with a mesh and placements (Partial included: each rank's local is the fill,
    so ones summed over ranks is the world size, as in eager), sizes as varargs or one sequence, a dtype."""
    mesh = mesh_1d()

    def fn(e):
        return (
            e + dtensor_api.zeros(5, 6, device_mesh=mesh, placements=[Shard(0)]),
            dtensor_api.ones((5, 6), device_mesh=mesh, placements=[Partial()]) * 2,
            dtensor_api.full((5, 6), 1.5, dtype=torch.float64, device_mesh=mesh, placements=[Shard(1)]),
            dtensor_api.ones([5, 6], device_mesh=mesh) + e,  # placements default to Replicate
            dtensor_api.empty(5, 6, dtype=torch.bfloat16, device_mesh=mesh, placements=[Shard(1)]),
        )

    e = distribute_tensor(make_full((5, 6), seed=5), mesh, [Replicate()])
    expected, eager_comms = _counted(fn, e)
    compiled = thunder.jit(fn)
    compiled(e)
    actual, comms = _counted(compiled, e)
    for i, (a, x) in enumerate(zip(actual[:-1], expected[:-1])):
        _same_locals(a, x, f"factory output {i}")
    empty, eager_empty = actual[-1], expected[-1]
    assert (empty.placements, empty.dtype, empty.shape) == (eager_empty.placements, torch.bfloat16, (5, 6))
    assert empty.to_local().shape == eager_empty.to_local().shape
    assert comms == eager_comms == {}


def test_dtensor_factory_keywords_refused_by_name():
    mesh = mesh_1d()
    # eager's random factories need its RNG tracker, which does not exist for cpu meshes: eager raises
    for name in ("randn", "rand"):
        factory = getattr(dtensor_api, name)
        if mesh.device_type == "cpu":
            with pytest.raises(AssertionError):
                factory(4, 6, device_mesh=mesh, placements=[Shard(0)])
            with pytest.raises(DTensorOpError, match=f"torch.distributed.tensor.{name}: on a cpu mesh"):
                thunder.jit(lambda factory=factory: factory(4, 6, device_mesh=mesh, placements=[Shard(0)]))()
    refused = {
        "requires_grad=True": dict(requires_grad=True, device_mesh=mesh),
        "layout torch.sparse_coo": dict(layout=torch.sparse_coo, device_mesh=mesh),
        "no device_mesh": dict(device_mesh=None),
        "placements for a": dict(device_mesh=mesh, placements=[Shard(0), Shard(1)]),
    }
    for why, kwargs in refused.items():
        with pytest.raises(DTensorOpError, match="torch.distributed.tensor.zeros") as info:
            thunder.jit(lambda kwargs=kwargs: dtensor_api.zeros(4, 6, **kwargs))()
        message = str(info.value)
        assert why.split()[0] in message and "placements" in message and "hint:" in message, message


# --- gradients handed in with any placement ---------------------------------------------------------------
def _matmul_partial(x, w):  # x S(1) @ w S(0): a Partial(sum) output
    return (x @ w) * 2


def _pointwise_sharded(x, w):  # a Shard(0) output, linear in its gradient (a Partial one stays Partial)
    return x * w + x


def _through_redistribute(x, w):  # x Partial, redistributed: eager's Redistribute backward decides by the gradient
    return x.redistribute(x.device_mesh, [Replicate()]) * w


#: name -> (program, the same on plain tensors, input shapes, input placements)
PROGRAMS = {
    "matmul_partial": (_matmul_partial, _matmul_partial, [(6, 8), (8, 4)], [[Shard(1)], [Shard(0)]]),
    "pointwise_sharded": (_pointwise_sharded, _pointwise_sharded, [(8, 4), (8, 4)], [[Shard(0)], [Replicate()]]),
    "through_redistribute": (_through_redistribute, torch.mul, [(8, 4), (8, 4)], [[Partial()], [Replicate()]]),
}
COTANGENT_PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("avg")]


def _cotangent(full: torch.Tensor, placement, mesh) -> DTensor:
    """``full`` as a DTensor with ``placement``; a Partial one as rank-dependent shares that reduce to it."""
    if not placement.is_partial():
        return distribute_tensor(full, mesh, [placement])
    n, offset = mesh.size(), float(_rank()) - (mesh.size() - 1) / 2  # offsets sum to zero over ranks
    share = full / n if placement.reduce_op == "sum" else full
    return DTensor.from_local(share + offset * (1 if placement.reduce_op == "sum" else n), mesh, [placement])


def _inputs(full_inputs: list, placements: list, mesh) -> list:
    out = []
    for full, p in zip(full_inputs, placements):
        if p[0].is_partial():  # a Partial input: this rank's share of the full value
            out.append(DTensor.from_local(full / mesh.size(), mesh, p).requires_grad_())
        else:
            out.append(distribute_tensor(full, mesh, p).requires_grad_())
    return out


def _backward(outs, cotangents, how: str, inputs) -> list:
    if how == "backward":
        outs.backward(cotangents)
        return [x.grad for x in inputs]
    return list(torch.autograd.grad(outs, inputs, grad_outputs=cotangents))


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("program", PROGRAMS)
def test_gradients_handed_in_with_any_placement(program):
    """Each placement eager accepts for the output's gradient, through ``backward(gradient=...)`` and
    ``torch.autograd.grad(grad_outputs=...)`` alternately: input gradients equal plain torch's, with eager's
    placements, and (on a second backward with that placement) eager's collectives, no more."""
    fn, plain_fn, shapes, placements = PROGRAMS[program]
    mesh = mesh_1d()
    fulls = [make_full(s, seed=10 + i) for i, s in enumerate(shapes)]
    plain = [f.clone().requires_grad_() for f in fulls]
    expected_out = plain_fn(*plain)
    g_full = make_full(tuple(expected_out.shape), seed=20)
    expected_grads = torch.autograd.grad(expected_out, plain, g_full)
    jitted = thunder.jit(fn)
    for k, placement in enumerate(COTANGENT_PLACEMENTS):
        how = "backward" if k % 2 == 0 else "autograd.grad"
        what = f"{program}, gradient {placement} via {how}"
        eager_inputs = _inputs(fulls, placements, mesh)
        eager_out, g = fn(*eager_inputs), _cotangent(g_full, placement, mesh)  # (distributing g communicates)
        try:
            with CommDebugMode() as eager_mode:
                eager_grads = _backward(eager_out, g, how, eager_inputs)
        except Exception:  # eager rejects this gradient: the jit raises too, or gives plain torch's values
            inputs = _inputs(fulls, placements, mesh)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CotangentPlacementWarning)
                try:
                    grads = _backward(jitted(*inputs), _cotangent(g_full, placement, mesh), how, inputs)
                except Exception:
                    continue
            for a, ref in zip(grads, expected_grads):
                torch.testing.assert_close(a.full_tensor(), ref, msg=lambda m, what=what: f"{what}: {m}")
            continue
        warm = _inputs(fulls, placements, mesh)  # the first backward with this placement traces it
        _backward(jitted(*warm), _cotangent(g_full, placement, mesh), how, warm)
        inputs = _inputs(fulls, placements, mesh)
        out, g = jitted(*inputs), _cotangent(g_full, placement, mesh)
        with CommDebugMode() as jit_mode:
            grads = _backward(out, g, how, inputs)
        for i, (a, e, ref) in enumerate(zip(grads, eager_grads, expected_grads)):
            assert a.placements == e.placements, f"{what}: grad {i} {a.placements} != eager {e.placements}"
            torch.testing.assert_close(a.full_tensor(), ref, msg=lambda m, i=i, what=what: f"{what}: grad {i}: {m}")
        assert comm_counts(jit_mode) == comm_counts(eager_mode), (what, comm_counts(jit_mode), comm_counts(eager_mode))
    assert thunder.cache_misses(jitted) == 1


@pytest.mark.world_size(4)
def test_gradient_placed_otherwise_on_a_2d_mesh():
    mesh = mesh_2d()
    fulls = [make_full((8, 8), seed=30), make_full((8, 8), seed=31)]
    placements = [[Shard(0), Shard(1)], [Replicate(), Shard(0)]]
    g_full = make_full((8, 8), seed=32)

    def cotangent():
        share = g_full / 2 + (float(mesh.get_local_rank(1)) - 0.5)
        return DTensor.from_local(
            distribute_tensor(share, mesh["dp"], [Shard(1)]).to_local(), mesh, [Shard(1), Partial()]
        )

    plain = [f.clone().requires_grad_() for f in fulls]
    expected = torch.autograd.grad(_matmul_partial(*plain), plain, g_full)
    eager_inputs = [distribute_tensor(f, mesh, p).requires_grad_() for f, p in zip(fulls, placements)]
    eager_out, g = _matmul_partial(*eager_inputs), cotangent()
    with CommDebugMode() as eager_mode:
        eager = torch.autograd.grad(eager_out, eager_inputs, g)
    jitted = thunder.jit(_matmul_partial)
    for _ in range(2):  # the second backward with these placements is counted
        inputs = [distribute_tensor(f, mesh, p).requires_grad_() for f, p in zip(fulls, placements)]
        out, g = jitted(*inputs), cotangent()
        with CommDebugMode() as jit_mode:
            grads = torch.autograd.grad(out, inputs, g)
    for a, e, ref in zip(grads, eager, expected):
        assert a.placements == e.placements
        torch.testing.assert_close(a.full_tensor(), ref)
    assert comm_counts(jit_mode) == comm_counts(eager_mode)


def _matmul_partial_with_torchs_gradients(seed: int) -> tuple:
    """``matmul_partial`` on a 1-D mesh: the program, its placements, the mesh, the full inputs and cotangent made
    from ``seed``, and plain torch's gradients of the full inputs for that cotangent."""
    fn, _, shapes, placements = PROGRAMS["matmul_partial"]
    fulls = [make_full(s, seed=seed + i) for i, s in enumerate(shapes)]
    g_full = make_full((6, 4), seed=seed + 2)
    plain = [f.clone().requires_grad_() for f in fulls]
    return fn, placements, mesh_1d(), fulls, g_full, torch.autograd.grad(fn(*plain), plain, g_full)


def test_gradient_placed_otherwise_under_thunderfx():
    fn, placements, mesh, fulls, g_full, expected = _matmul_partial_with_torchs_gradients(seed=40)
    eager_inputs = _inputs(fulls, placements, mesh)
    eager_out, g = fn(*eager_inputs), _cotangent(g_full, Partial(), mesh)
    with CommDebugMode() as eager_mode:
        eager = _backward(eager_out, g, "backward", eager_inputs)
    compiled = thunderfx(fn)
    for _ in range(2):
        inputs = _inputs(fulls, placements, mesh)
        out, g = compiled(*inputs), _cotangent(g_full, Partial(), mesh)
        with CommDebugMode() as fx_mode:
            grads = _backward(out, g, "backward", inputs)
    for a, e, ref in zip(grads, eager, expected):
        assert a.placements == e.placements == (Partial(),)
        torch.testing.assert_close(a.full_tensor(), ref)
    assert comm_counts(fx_mode) == comm_counts(eager_mode)


def test_backward_traced_for_a_placement_is_kept_and_a_failure_warns(monkeypatch):
    """The backward traced for new placements is traced once; the traced placements keep the traced backward;
    where tracing fails, a named warning says so and the cotangent is redistributed (eager's values)."""
    fn, placements, mesh, fulls, g_full, expected = _matmul_partial_with_torchs_gradients(seed=50)
    jitted = thunder.jit(fn)
    for placement in (Partial(), Replicate(), Partial(), Replicate()):
        inputs = _inputs(fulls, placements, mesh)
        grads = _backward(jitted(*inputs), _cotangent(g_full, placement, mesh), "autograd.grad", inputs)
        for a, ref in zip(grads, expected):
            torch.testing.assert_close(a.full_tensor(), ref)
    assert len(thunder.last_backward_traces(jitted)) == 2
    assert thunder.cache_misses(jitted) == 1

    from thunder_dtensor import _integration

    def fails(*args, **kwargs):
        raise RuntimeError("a test's failure")

    monkeypatch.setattr(_integration, "compile_joint_trace", fails)
    jitted = thunder.jit(fn)
    inputs = _inputs(fulls, placements, mesh)
    out = jitted(*inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = _backward(out, _cotangent(g_full, Shard(0), mesh), "autograd.grad", inputs)
    assert any(
        issubclass(w.category, CotangentPlacementWarning) and "a test's failure" in str(w.message) for w in caught
    )
    for a, ref in zip(grads, expected):
        torch.testing.assert_close(a.full_tensor(), ref)


# --- keywords of redistribute / from_local / to_local / full_tensor -----------------------------------------
def test_a_backward_for_other_placements_outlives_the_jitted_function():
    """``thunder.jit(fn)(*inputs)`` drops the jitted function after the call; the output's backward, called with a
    cotangent placed otherwise than traced, still traces its backward for that placement (it held the compile
    data weakly: "the jitted function's compile data is gone", and the cotangent was redistributed, with a
    warning, once the garbage collector had run; found by a 2x2-mesh program compiled twice in one process)."""
    fn, placements, mesh, fulls, g_full, expected = _matmul_partial_with_torchs_gradients(seed=60)
    eager_inputs = _inputs(fulls, placements, mesh)
    eager = _backward(fn(*eager_inputs), _cotangent(g_full, Partial(), mesh), "autograd.grad", eager_inputs)
    inputs = _inputs(fulls, placements, mesh)
    out = thunder.jit(fn)(*inputs)
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CotangentPlacementWarning)
        grads = _backward(out, _cotangent(g_full, Partial(), mesh), "autograd.grad", inputs)
    for a, e, ref in zip(grads, eager, expected):
        assert a.placements == e.placements
        torch.testing.assert_close(a.full_tensor(), ref)


def _compare(fn: Callable, make_inputs: Callable, what: str) -> None:
    """Forward and backward (ones as the gradient of each output's full tensor) against eager: values,
    placements, dtypes, gradients and collectives (counted on a second call)."""

    def run(f):
        inputs = make_inputs()
        with CommDebugMode() as fwd:
            out = f(*inputs)
        full = out.full_tensor() if isinstance(out, DTensor) else out
        with CommDebugMode() as bwd:
            full.float().sum().backward()
        return out, inputs, comm_counts(fwd), comm_counts(bwd)

    out, inputs, fwd, bwd = run(fn)
    jitted = thunder.jit(fn)
    run(jitted)
    j_out, j_inputs, j_fwd, j_bwd = run(jitted)
    if isinstance(out, DTensor):
        _same_locals(j_out, out, what)
    else:
        torch.testing.assert_close(j_out, out)
    for i, (a, e) in enumerate(zip(j_inputs, inputs)):
        assert type(a.grad) is type(e.grad) and a.grad.dtype == e.grad.dtype, (what, i)
        if isinstance(e.grad, DTensor):
            _same_locals(a.grad, e.grad, f"{what}: grad {i}")
        else:
            torch.testing.assert_close(a.grad, e.grad)
    assert (j_fwd, j_bwd) == (fwd, bwd), (what, j_fwd, fwd, j_bwd, bwd)


def test_redistribute_keywords_are_honoured():
    mesh = mesh_1d()
    full = make_full((8, 4), seed=60)

    def sharded():
        return [distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()]

    def partial():
        return [DTensor.from_local(full / mesh.size(), mesh, [Partial()]).requires_grad_()]

    cases = {
        "forward_dtype": (lambda x: x.redistribute(mesh, [Replicate()], forward_dtype=torch.float64) * 2, sharded),
        "backward_dtype": (lambda x: x.redistribute(mesh, [Replicate()], backward_dtype=torch.bfloat16), sharded),
        "async_op": (lambda x: x.redistribute(mesh, [Replicate()], async_op=True) * 2, sharded),
        "partial to replicate": (lambda x: x.redistribute(mesh, [Replicate()]) * 3, partial),
        "partial kept": (lambda x: (x.redistribute(mesh, [Partial()]) * 3).redistribute(mesh, [Replicate()]), partial),
    }
    if "forward_dtype" not in inspect.signature(DTensor.redistribute).parameters:  # torch < 2.13
        del cases["forward_dtype"], cases["backward_dtype"]
    for what, (fn, make_inputs) in cases.items():
        _compare(fn, make_inputs, what)
    x = distribute_tensor(full, mesh, [Shard(0)])
    refused = {
        "no placements given": lambda x: x.redistribute(mesh),
        "reserves redistributing to Partial": lambda x: x.redistribute(mesh, [Partial()]),
    }
    for why, fn in refused.items():
        with pytest.raises(DTensorOpError, match=why) as info:
            thunder.jit(fn)(x)
        assert "DTensor.redistribute" in str(info.value) and "placements=" in str(info.value)


def test_from_local_to_local_and_full_tensor_keywords_are_honoured():
    mesh = mesh_1d()
    n = mesh.size()
    rows = [3] + [2] * (n - 1)  # uneven local shards, described by shape= and stride=
    full = make_full((sum(rows), 4), seed=61)
    start = sum(rows[: _rank()])
    mine = full[start : start + rows[_rank()]]
    shape, stride = tuple(full.shape), full.stride()

    def local_of_rank():  # differs per rank: run_check broadcasts the first rank's for Replicate
        return [(make_full((4, 4), seed=62) + _rank()).requires_grad_()]

    def local_shard():
        return [mine.clone().requires_grad_()]

    def sharded():
        return [distribute_tensor(make_full((8, 4), seed=63), mesh, [Shard(0)]).requires_grad_()]

    cases = {
        "from_local run_check": (
            lambda t: DTensor.from_local(t * 1, mesh, [Replicate()], run_check=True) * 2,
            local_of_rank,
        ),
        "from_local shape and stride": (
            lambda t: DTensor.from_local(t * 2, mesh, [Shard(0)], shape=shape, stride=stride),
            local_shard,
        ),
        "to_local grad_placements": (lambda x: (x * 2).to_local(grad_placements=[Partial()]) * 3, sharded),
        "full_tensor grad_placements": (lambda x: x.full_tensor(grad_placements=[Partial()]) * 3, sharded),
    }
    if "grad_placements" in inspect.signature(DTensor.from_local).parameters:  # torch >= 2.13
        cases["from_local grad_placements"] = (
            lambda t: DTensor.from_local(t * 1, mesh, [Replicate()], grad_placements=[Partial()]).sum(),
            local_of_rank,
        )
    for what, (fn, make_inputs) in cases.items():
        _compare(fn, make_inputs, what)
    with pytest.raises(DTensorOpError, match="DTensor.from_local: no device_mesh given"):
        thunder.jit(lambda t: DTensor.from_local(t, None, [Replicate()]))(mine)


def test_containers_of_dtensors_as_program_inputs_are_routed():
    """A list or dict of DTensors passed to the program reaches the dtensor ops (the interpreter hands the routed
    lookaside the caller's DTensors, not proxies): eager's values and placements."""
    mesh = mesh_1d()
    full = make_full((4, 6), seed=3)
    a = distribute_tensor(full, mesh, [Shard(0)])
    b = distribute_tensor(full * 2, mesh, [Replicate()])

    def fn(pair, named):
        return torch.cat(pair, dim=-1) * named["scale"]

    expected = fn([a, a], {"scale": b.sum()})
    out = thunder.jit(fn)([a, a], {"scale": b.sum()})
    assert out.placements == expected.placements
    torch.testing.assert_close(out.full_tensor(), expected.full_tensor())
    torch.testing.assert_close(out.full_tensor(), torch.cat([full, full], dim=-1) * (full * 2).sum())
