"""Ops DTensor has no sharding rule for: decomposed, else run on replicated inputs (``ops/no_rule.py``).

The ops have no rule by construction: each test takes the op's rule out of DTensor while it runs
(``without_sharding_rule``), so a torch release that adds one changes nothing here, and the tests assert
what thunder_dtensor does (rewritten which way, or which error) with plain torch's values.
"""

import warnings

from thunder_dtensor import DTensorOpError
from thunder_dtensor.errors import DataDependentValueError
from thunder_dtensor.ops.no_rule import ReplicatedFallbackWarning
from thunder_dtensor.testing import (
    COMMS_ASSERTED,
    RUNS,
    DTensorCase,
    eager_error,
    make_full,
    mesh_1d,
    rewritten,
    run_case,
    without_sharding_rule,
)

import pytest
import thunder
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

aten = torch.ops.aten


def _dt(full, placements, requires_grad=True):
    return distribute_tensor(full, mesh_1d(), placements).requires_grad_(requires_grad)


def _prim_names(trace) -> set[str]:
    return {bsym.sym.name for bsym in trace.bound_symbols}


@pytest.mark.world_size(2)
def test_an_op_taken_out_of_dtensor_has_no_rule_until_put_back():
    """The construction the tests rest on: an op with a rule (``hardtanh`` has one in torch 2.13) fails in eager
    DTensor while its rule is out, and runs again afterwards."""
    case = DTensorCase(F.hardtanh, [make_full((4, 6), seed=1)], [[Shard(0)]], requires_grad=[False])
    assert eager_error(case, backward=False) is None
    with without_sharding_rule(aten.hardtanh.default):
        error = eager_error(case, backward=False)
        assert isinstance(error, NotImplementedError) and "does not have a sharding strategy" in str(error), error
    assert eager_error(case, backward=False) is None


def _check(case: DTensorCase, how: str, backward: bool = True, **kwargs):
    """Eager DTensor fails on the case (the construction holds); thunder_dtensor runs it rewritten, ``how`` the
    least preferred way an op ran, with plain torch's values and gradients."""
    assert eager_error(case, backward=backward) is not None, "eager DTensor runs the case: no rule was taken out"
    return run_case(case, backward=backward, compare_eager=False, expect=rewritten(how), **kwargs)


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
@pytest.mark.parametrize(
    "activation, backward_op",
    [
        (F.hardtanh, aten.hardtanh_backward.default),
        (F.relu6, aten.hardtanh_backward.default),
        (F.hardswish, aten.hardswish_backward.default),
        (F.hardsigmoid, aten.hardsigmoid_backward.default),
        (F.logsigmoid, aten.log_sigmoid_backward.default),
    ],
    ids=lambda f: f.__name__.split(".")[0],
)
def test_backward_without_a_sharding_strategy_is_decomposed(activation, backward_op, lowering):
    """A backward op without a sharding rule (torch 2.13 has none for ``hardtanh_backward`` & co.): torch's
    decomposition runs, on DTensor's rules for the ops it decomposes into."""

    def fn(x):
        return activation(x * 4.0)

    case = DTensorCase(fn, [make_full((4, 6), seed=1)], [[Shard(1)]])
    with without_sharding_rule(backward_op):
        result = _check(case, "decomposition", jit_kwargs={"dtensor_lowering": lowering})
    assert set(result.how_ops_ran.values()) == {"decomposition"}, result.how_ops_ran
    assert result.thunder_grads[0].placements == (Shard(1),)  # the decomposed backward keeps the sharding
    # the trace names it, lowered or not
    backward = str(thunder.last_backward_traces(result.jitted)[-1])
    assert "_decomposed_prim" in backward or "_vjp', 'decomposition')" in backward, backward


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
def test_op_without_a_decomposition_runs_replicated_and_warns_once(lowering):
    """``addbmm`` has no decomposition in torch's core-ATen table: without a sharding rule (torch 2.13 has none),
    it runs on replicated inputs, with a warning."""

    def fn(a, b, c):
        return torch.addbmm(a, b, c)

    fulls = [make_full((4, 10), seed=2), make_full((3, 4, 5), seed=3), make_full((3, 5, 10), seed=4)]
    case = DTensorCase(fn, fulls, [[Shard(0)], [Replicate()], [Replicate()]])
    with without_sharding_rule(aten.addbmm.default), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _check(case, "replicated fallback", jit_kwargs={"dtensor_lowering": lowering})
        # the same op and placements again: no second warning
        thunder.jit(fn, dtensor_lowering=lowering)(*(_dt(f, p) for f, p in zip(fulls, case.placements)))
    fallback_warnings = [w for w in caught if issubclass(w.category, ReplicatedFallbackWarning)]
    assert len(fallback_warnings) <= 1  # once per process (an earlier test may have warned already)
    if fallback_warnings:
        message = str(fallback_warnings[0].message)
        assert "Tensor_addbmm" in message and "S(0)" in message and "dtensor_replicated_fallback" in message
    assert result.how_ops_ran == {"Tensor_addbmm": "replicated fallback"}
    assert result.thunder_out[0].placements == (Replicate(),)
    assert result.thunder_grads[0].placements == (Shard(0),)  # gradients keep their input's placements
    assert "dtensor_Tensor_addbmm_replicated_prim" in _prim_names(thunder.last_traces(result.jitted)[0])
    # the executed traces name it (joint-lowered, the marker goes with the backward)
    executed = str(thunder.last_traces(result.jitted)[-1]) + str(thunder.last_backward_traces(result.jitted)[-1])
    if lowering:
        assert "'Tensor_addbmm', 'replicated fallback')" in executed, executed
        assert "all_gather" in executed  # the gather is in the trace
    else:
        assert "dtensor_Tensor_addbmm_replicated_prim" in executed


@pytest.mark.world_size(2, 4)
def test_the_replicated_fallback_can_be_turned_off():
    def fn(a, b, c):
        return torch.addbmm(a, b, c)

    fulls = [make_full((4, 10), seed=2), make_full((3, 4, 5), seed=3), make_full((3, 5, 10), seed=4)]
    placements = [[Shard(0)], [Replicate()], [Replicate()]]
    inputs = [_dt(f, p) for f, p in zip(fulls, placements)]
    with without_sharding_rule(aten.addbmm.default), pytest.raises(DTensorOpError) as info:
        thunder.jit(fn, dtensor_replicated_fallback=False)(*inputs)
    message = str(info.value)
    assert "addbmm" in message.splitlines()[0] and "placements=(Shard(dim=0),)" in message
    assert "hint:" in message and "dtensor_replicated_fallback=False" in message


@pytest.mark.world_size(2)
def test_the_replicated_fallback_stays_off_in_a_backward_traced_for_other_cotangents():
    """A backward traced again at its first call, for a cotangent placed otherwise than traced (``S(0)``, not the
    output's ``S(1)``), ran without the function's options: ``dtensor_replicated_fallback=False`` was ignored there
    and the matmul's vjp ran replicated, with its warning. It now raises inside that retrace, which falls back to
    the traced placements, as announced (``CotangentPlacementWarning``)."""
    from thunder_dtensor.guards import CotangentPlacementWarning

    mesh = mesh_1d()
    o = distribute_tensor(make_full((6, 4), seed=5), mesh, [Shard(0)]).requires_grad_()
    x = distribute_tensor(make_full((3, 4, 4), seed=6), mesh, [Shard(2)]).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = thunder.jit(lambda o, x: o @ x, dtensor_replicated_fallback=False)(o, x)
        assert y.placements == (Shard(1),)
        y.backward(distribute_tensor(make_full((3, 6, 4), seed=7), mesh, [Shard(0)]))
    kinds = [type(w.message) for w in caught]
    assert ReplicatedFallbackWarning not in kinds and CotangentPlacementWarning in kinds, kinds
    retrace = next(str(w.message) for w in caught if isinstance(w.message, CotangentPlacementWarning))
    assert "DTensorOpError" in retrace and "Tensor_matmul_vjp" in retrace, retrace
    full_x, full_o = make_full((3, 4, 4), seed=6).requires_grad_(), make_full((6, 4), seed=5).requires_grad_()
    (full_o @ full_x).backward(make_full((3, 6, 4), seed=7))
    torch.testing.assert_close(x.grad.full_tensor(), full_x.grad)
    torch.testing.assert_close(o.grad.full_tensor(), full_o.grad)


@pytest.mark.world_size(2, 4)
def test_reshape_of_an_unevenly_sharded_dim_runs_replicated():
    """DTensor refuses to unflatten an unevenly sharded dim; the plain reshape of the gathered tensor runs."""

    def fn(x):
        return x.reshape(5, 2) * 2.0

    case = DTensorCase(fn, [make_full((10,), seed=5)], [[Shard(0)]])
    # not an op without a rule but a rule that refuses these inputs, which cannot be taken out alone: a torch
    # whose rule accepts them fails this test (eager runs it, nothing is rewritten), which should then compare
    # with eager
    result = run_case(case, expect=rewritten("replicated fallback"))
    assert result.how_ops_ran == {"Tensor_reshape": "replicated fallback"}, result.how_ops_ran
    assert result.thunder_grads[0].placements == (Shard(0),)


def test_renorm_without_a_sharding_strategy_runs():
    """``renorm`` without a sharding rule (torch 2.13 has none): it runs decomposed, with plain torch's values."""

    def fn(x):
        return torch.renorm(x, 2, 0, 1.0)

    case = DTensorCase(fn, [make_full((6, 8), seed=5)], [[Shard(0)]], requires_grad=[False])
    with without_sharding_rule(aten.renorm.default):
        result = _check(case, "decomposition", backward=False)
    assert result.how_ops_ran == {"Tensor_renorm": "decomposition"}, result.how_ops_ran


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("reduce", [torch.amax, torch.amin], ids=lambda f: f.__name__)
def test_backward_of_a_partial_max_output_is_exact(reduce):
    """Eager's backward compares each rank's shard with its own unreduced extremum (nan / wrong gradients)."""
    x_full = make_full((4, 3), seed=6)

    def fn(x):
        return reduce(x) * 3.0

    run_case(DTensorCase(fn, [x_full], [[Shard(0)]]), compare_eager=False)


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("loss", [F.nll_loss, F.cross_entropy], ids=lambda f: f.__name__)
@pytest.mark.parametrize("variant", ["weight", "ignore_index", "plain"])
def test_mean_loss_over_a_batch_sharded_input_is_the_global_mean(loss, variant):
    """Eager DTensor averages per-rank means: wrong with class weights or ignored targets."""
    logits = make_full((8, 5), seed=7)
    target = make_full((8,), seed=8, dtype=torch.int64, int_high=5)
    target[:3] = 1  # rank 0 holds most of the ignored targets
    weight = make_full((5,), seed=9).abs() + 0.1

    def fn(x, t, w):
        kwargs = {"weight": {"weight": w}, "ignore_index": {"ignore_index": 1}, "plain": {}}[variant]
        return loss(x if loss is F.cross_entropy else F.log_softmax(x, dim=-1), t, **kwargs)

    result = run_case(
        DTensorCase(
            fn, [logits, target, weight], [[Shard(0)], [Shard(0)], [Replicate()]], requires_grad=[True, False, False]
        ),
        compare_eager=False,
    )
    assert result.thunder_grads[0].placements == (Shard(0),)


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("scaled", [False, True], ids=["returned", "scaled"])
def test_a_returned_mean_loss_is_the_global_mean_under_thunderfx(scaled):
    """thunderfx splits out a node thunder places otherwise than eager (the code dynamo recorded after it reads
    eager's placements) and runs it eagerly: for the mean loss, eager's average of per-rank means, wrong with
    ignored targets (fuzz seed 10741). A loss the graph only returns, or scales by a number, stays in thunder."""
    from thunder.dynamo import thunderfx

    logits_full = make_full((8, 5), seed=7)
    target_full = make_full((8,), seed=8, dtype=torch.int64, int_high=5)
    target_full[:3] = 1  # rank 0 holds most of the ignored targets

    def fn(x, t):
        loss = F.cross_entropy(x, t, ignore_index=1)
        return loss / 4 if scaled else loss

    def inputs():
        x = distribute_tensor(logits_full.clone(), mesh_1d(), [Shard(0)]).requires_grad_()
        return x, distribute_tensor(target_full, mesh_1d(), [Shard(0)])

    x_plain = logits_full.clone().requires_grad_()
    expected = fn(x_plain, target_full)
    expected.backward()
    eager = fn(*inputs())
    assert not torch.allclose(eager.full_tensor(), expected), "eager DTensor's mean is right here: no test"
    compiled = thunderfx(fn)
    for _ in range(2):
        x, t = inputs()
        out = compiled(x, t)
        torch.testing.assert_close(out.full_tensor(), expected.detach())
        out.full_tensor().backward()
        torch.testing.assert_close(x.grad.full_tensor(), x_plain.grad)
    assert not [r for info in compiled._backend.subgraph_infos for r in info.split_reasons]


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize(
    "fn, op, error, what",
    [
        (lambda x: torch.poisson(x), aten.poisson.default, DTensorOpError, "it draws random numbers"),
        (lambda x: torch.normal(x, 1.0), aten.normal.Tensor_float, DTensorOpError, "it draws random numbers"),
        (
            lambda x: torch.masked_select(x, x > 0.5),
            aten.masked_select.default,
            DataDependentValueError,
            "its output's shape depends on the data",
        ),
    ],
    ids=["poisson", "normal", "masked_select"],
)
def test_random_and_data_dependent_ops_raise(fn, op, error, what):
    """Without a sharding rule (torch 2.13 has none for these), a random op is not rewritten (its numbers would not
    be eager DTensor's) and an output shape that depends on the data cannot be traced: each raises, saying why."""
    x_full = make_full((4, 6), seed=10).abs()
    case = DTensorCase(fn, [x_full], [[Shard(0)]], requires_grad=[False])
    with without_sharding_rule(op):
        assert eager_error(case, backward=False) is not None, "eager DTensor runs the op: no rule was taken out"
        with pytest.raises(error) as info:
            thunder.jit(fn)(_dt(x_full, [Shard(0)], requires_grad=False))
    assert type(info.value) is error, type(info.value)
    assert what in str(info.value) and "placements=(Shard(dim=0),)" in str(info.value), str(info.value)


@pytest.mark.world_size(2, 4)
def test_inputs_on_two_meshes_are_not_rewritten():
    """A cause in the inputs themselves is the user's to fix: the error stays, no fallback."""

    def fn(x, y):
        return torch.addbmm(x, y, y)

    x = _dt(make_full((4, 4), seed=11), [Shard(0)], requires_grad=False)
    y = make_full((2, 4, 4), seed=12)  # a plain tensor among DTensors
    with without_sharding_rule(aten.addbmm.default), pytest.raises(DTensorOpError, match="convert every torch.Tensor"):
        thunder.jit(fn)(x, y)


@pytest.mark.world_size(2, 4)
def test_programs_eager_runs_are_not_rewritten():
    w_full, x_full = make_full((8, 6), seed=13), make_full((4, 6), seed=14)

    def fn(x, w):
        return F.gelu(F.linear(x, w)).sum(-1)

    case = DTensorCase(fn, [x_full, w_full], [[Replicate()], [Shard(0)]])
    result = run_case(case, assert_comms=COMMS_ASSERTED, expect=RUNS)  # no op rewritten
    names = _prim_names(thunder.last_traces(result.jitted)[0])
    assert not any("_decomposed_" in n or "_replicated_" in n for n in names), names


@pytest.mark.world_size(2, 4)
def test_writes_are_never_rewritten():
    """A rewritten op is functional: an in-place call or an ``out=`` argument keeps its error (no lost write)."""
    fulls = [make_full((4, 10), seed=2), make_full((3, 4, 5), seed=3), make_full((3, 5, 10), seed=4)]
    placements = [[Shard(0)], [Replicate()], [Replicate()]]
    a, b, c = (_dt(f, p, requires_grad=False) for f, p in zip(fulls, placements))
    out = _dt(torch.zeros(4, 10), [Shard(0)], requires_grad=False)

    def addbmm_out(a, b, c, o):
        torch.addbmm(a, b, c, out=o)
        return o

    with without_sharding_rule(aten.addbmm.default, aten.addbmm.out), pytest.raises(DTensorOpError, match="out= arg"):
        thunder.jit(addbmm_out)(a, b, c, out)

    def sigmoid_in_place(y):
        torch.sigmoid_(y)  # a torch function thunder has no symbol for, in place
        return y

    y = _dt(make_full((4, 6), seed=15), [Shard(0)], requires_grad=False)
    with pytest.raises(NotImplementedError):  # thunder's own error, as for plain tensors: no silent no-op
        thunder.jit(sigmoid_in_place)(y)
