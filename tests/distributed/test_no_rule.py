"""Ops DTensor has no sharding rule for: decomposed, else run on replicated inputs (``ops/no_rule.py``).

Where eager DTensor runs a case (a later torch), thunder is compared with it instead of checking the
rewrite: a test never asserts that eager fails.
"""

import warnings

from thunder_dtensor import DTensorOpError
from thunder_dtensor.ops.no_rule import HOW_OPS_RAN, ReplicatedFallbackWarning
from thunder_dtensor.testing import COMMS_ASSERTED, DTensorCase, eager_error, make_full, mesh_1d, run_case

import pytest
import thunder
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def _dt(full, placements, requires_grad=True):
    return distribute_tensor(full, mesh_1d(), placements).requires_grad_(requires_grad)


def _prim_names(trace) -> set[str]:
    return {bsym.sym.name for bsym in trace.bound_symbols}


def _check(case: DTensorCase, **kwargs):
    """run_case against plain torch, and against eager DTensor where eager runs the case."""
    eager_fails = eager_error(case) is not None
    HOW_OPS_RAN.clear()
    result = run_case(case, compare_eager=not eager_fails, assert_comms=COMMS_ASSERTED, **kwargs)
    return eager_fails, result


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
@pytest.mark.parametrize(
    "activation",
    [F.hardtanh, F.relu6, F.hardswish, F.hardsigmoid, F.logsigmoid],
    ids=lambda f: f.__name__,
)
def test_backward_without_a_sharding_strategy_is_decomposed(activation, lowering):
    """torch 2.13's DTensor has no strategy for ``hardtanh_backward`` & co.: torch's decomposition runs."""

    def fn(x):
        return activation(x * 4.0)

    case = DTensorCase(fn, [make_full((4, 6), seed=1)], [[Shard(1)]])
    eager_fails, result = _check(case, jit_kwargs={"dtensor_lowering": lowering})
    if eager_fails:
        assert "decomposition" in HOW_OPS_RAN.values(), HOW_OPS_RAN
        assert "replicated fallback" not in HOW_OPS_RAN.values(), HOW_OPS_RAN
        assert result.thunder_grads[0].placements == (Shard(1),)  # the decomposed backward keeps the sharding
        # the trace names it, lowered or not
        backward = str(thunder.last_backward_traces(result.jitted)[-1])
        assert "_decomposed_prim" in backward or "_vjp', 'decomposition')" in backward, backward


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
def test_op_without_a_decomposition_runs_replicated_and_warns_once(lowering):
    def fn(a, b, c):
        return torch.addbmm(a, b, c)

    fulls = [make_full((4, 10), seed=2), make_full((3, 4, 5), seed=3), make_full((3, 5, 10), seed=4)]
    case = DTensorCase(fn, fulls, [[Shard(0)], [Replicate()], [Replicate()]])
    if eager_error(case) is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, result = _check(case, jit_kwargs={"dtensor_lowering": lowering})
            # the same op and placements again: no second warning
            thunder.jit(fn, dtensor_lowering=lowering)(*(_dt(f, p) for f, p in zip(fulls, case.placements)))
        fallback_warnings = [w for w in caught if issubclass(w.category, ReplicatedFallbackWarning)]
        assert len(fallback_warnings) <= 1  # once per process (an earlier test may have warned already)
        if fallback_warnings:
            message = str(fallback_warnings[0].message)
            assert "torch_addbmm" in message and "S(0)" in message and "dtensor_replicated_fallback" in message
        assert HOW_OPS_RAN == {"torch_addbmm": "replicated fallback"}
        assert result.thunder_out[0].placements == (Replicate(),)
        assert result.thunder_grads[0].placements == (Shard(0),)  # gradients keep their input's placements
        assert "dtensor_torch_addbmm_replicated_prim" in _prim_names(thunder.last_traces(result.jitted)[0])
        # the executed traces name it (joint-lowered, the marker goes with the backward)
        executed = str(thunder.last_traces(result.jitted)[-1]) + str(thunder.last_backward_traces(result.jitted)[-1])
        if lowering:
            assert "'torch_addbmm', 'replicated fallback')" in executed, executed
            assert "all_gather" in executed  # the gather is in the trace
        else:
            assert "dtensor_torch_addbmm_replicated_prim" in executed
    else:
        _check(case)


@pytest.mark.world_size(2, 4)
def test_the_replicated_fallback_can_be_turned_off():
    def fn(a, b, c):
        return torch.addbmm(a, b, c)

    fulls = [make_full((4, 10), seed=2), make_full((3, 4, 5), seed=3), make_full((3, 5, 10), seed=4)]
    case = DTensorCase(fn, fulls, [[Shard(0)], [Replicate()], [Replicate()]])
    if eager_error(case) is None:
        pytest.skip("eager DTensor runs addbmm here")
    inputs = [_dt(f, p) for f, p in zip(fulls, case.placements)]
    with pytest.raises(DTensorOpError) as info:
        thunder.jit(fn, dtensor_replicated_fallback=False)(*inputs)
    message = str(info.value)
    assert "addbmm" in message.splitlines()[0] and "placements=(Shard(dim=0),)" in message
    assert "hint:" in message and "dtensor_replicated_fallback=False" in message


@pytest.mark.world_size(2, 4)
def test_reshape_of_an_unevenly_sharded_dim_runs_replicated():
    """DTensor refuses to unflatten an unevenly sharded dim; the plain reshape of the gathered tensor runs."""

    def fn(x):
        return x.reshape(5, 2) * 2.0

    case = DTensorCase(fn, [make_full((10,), seed=5)], [[Shard(0)]])
    eager_fails, result = _check(case)
    if eager_fails:
        assert HOW_OPS_RAN.get("Tensor_reshape") == "replicated fallback", HOW_OPS_RAN
        assert result.thunder_grads[0].placements == (Shard(0),)


def test_renorm_without_a_sharding_strategy_runs():
    """``renorm`` has no strategy in torch 2.13: it runs rewritten, with plain torch's values."""

    def fn(x):
        return torch.renorm(x, 2, 0, 1.0)

    case = DTensorCase(fn, [make_full((6, 8), seed=5)], [[Shard(0)]], requires_grad=[False])
    eager_fails, _ = _check(case, backward=False)
    if eager_fails:
        assert set(HOW_OPS_RAN.values()) <= {"decomposition", "replicated fallback"} and HOW_OPS_RAN


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
@pytest.mark.parametrize(
    "fn, what",
    [
        (lambda x: torch.poisson(x), "random"),
        (lambda x: torch.normal(x, 1.0), "random"),
        (lambda x: torch.masked_select(x, x > 0.5), "depends on the data"),
    ],
    ids=["poisson", "normal", "masked_select"],
)
def test_random_and_data_dependent_ops_raise(fn, what):
    x_full = make_full((4, 6), seed=10).abs()
    case = DTensorCase(fn, [x_full], [[Shard(0)]], requires_grad=[False])
    if eager_error(case, backward=False) is None:
        pytest.skip("eager DTensor runs this op here")
    with pytest.raises(DTensorOpError) as info:
        thunder.jit(fn)(_dt(x_full, [Shard(0)], requires_grad=False))
    assert what in str(info.value) and "placements=(Shard(dim=0),)" in str(info.value)


@pytest.mark.world_size(2, 4)
def test_inputs_on_two_meshes_are_not_rewritten():
    """A cause in the inputs themselves is the user's to fix: the error stays, no fallback."""

    def fn(x, y):
        return torch.addbmm(x, y, y)

    x = _dt(make_full((4, 4), seed=11), [Shard(0)], requires_grad=False)
    y = make_full((2, 4, 4), seed=12)  # a plain tensor among DTensors
    with pytest.raises(DTensorOpError, match="convert every torch.Tensor"):
        thunder.jit(fn)(x, y)


@pytest.mark.world_size(2, 4)
def test_programs_eager_runs_are_not_rewritten():
    w_full, x_full = make_full((8, 6), seed=13), make_full((4, 6), seed=14)

    def fn(x, w):
        return F.gelu(F.linear(x, w)).sum(-1)

    HOW_OPS_RAN.clear()
    result = run_case(DTensorCase(fn, [x_full, w_full], [[Replicate()], [Shard(0)]]), assert_comms=COMMS_ASSERTED)
    assert HOW_OPS_RAN == {}
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

    if eager_error(DTensorCase(torch.addbmm, fulls, placements)) is not None:
        with pytest.raises(DTensorOpError, match="out= argument"):
            thunder.jit(addbmm_out)(a, b, c, out)

    def sigmoid_in_place(y):
        torch.sigmoid_(y)  # a torch function thunder has no symbol for, in place
        return y

    y = _dt(make_full((4, 6), seed=15), [Shard(0)], requires_grad=False)
    with pytest.raises(NotImplementedError):  # thunder's own error, as for plain tensors: no silent no-op
        thunder.jit(sigmoid_in_place)(y)
