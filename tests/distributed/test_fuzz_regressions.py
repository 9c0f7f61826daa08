"""Regression tests for what the program fuzzer (``thunder_dtensor/testing/fuzz.py``) found, one test per bug.

Each program is the fuzzer's reduced reproducer, written out; ``run_case`` checks values and gradients against
plain torch on full tensors and placements (outputs and gradients) against eager DTensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.ops.no_rule import HOW_OPS_RAN, ReplicatedFallbackWarning
from thunder_dtensor.testing import (
    DTensorCase,
    eager_error,
    make_full,
    mesh_1d,
    mesh_2d,
    raises,
    recorded_calls,
    run_case,
)

import pytest
import thunder
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

LOWERING = pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])


@pytest.mark.world_size(2, 4)
@LOWERING
def test_from_local_with_the_shape_and_stride_of_a_dtensor_in_the_program(lowering):
    """``DTensor.stride()`` inside the program (was: ``AttributeError: Unknown attribute stride``)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = (x * 2).transpose(0, 1)
        if isinstance(y, DTensor):  # (plain torch on the full tensors: the round trip is the value itself)
            y = DTensor.from_local(y.to_local(), y.device_mesh, y.placements, shape=y.shape, stride=y.stride())
        return y + 1

    for placements in ([Shard(0)], [Replicate()]):
        case = DTensorCase(fn, [make_full((8, 6), seed=1)], [placements], mesh=mesh_1d())
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2)
@LOWERING
@pytest.mark.parametrize("activation", ["sigmoid", "tanh", "silu", "relu", "gelu"])
def test_activation_gradient_of_a_partial_cotangent_is_reduced_as_eager_does(activation, lowering):
    """An activation's backward is its fused ATen op (pointwise, not linear): a Partial cotangent is reduced
    first, as in eager (was: the hand-written ``g * f'(x)`` kept the gradient Partial where eager's is Replicate).
    The fuzzer's program: ``sigmoid > rms_norm`` with a Partial norm weight."""
    act = getattr(F, activation) if activation != "tanh" else torch.tanh

    def fn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(act(x), (2,), weight, eps=1e-6)

    inputs = [make_full((4, 5, 2), seed=2), make_full((2,), seed=3)]
    case = DTensorCase(fn, inputs, [[Replicate()], [Partial()]], requires_grad=[True, False], mesh=mesh_1d())
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2)
@LOWERING
def test_redistribute_to_the_same_placements_redistributes_the_gradient_back(lowering):
    """``x.redistribute(mesh, x.placements)`` is eager's ``Redistribute`` all the same: its backward moves the
    gradient to the input's placements (was: the gradient kept the placements it arrived with)."""

    def fn(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):  # (plain torch on the full tensors: the value itself)
            x = x.redistribute(x.device_mesh, [Replicate()])
        return x.flatten(1) * other

    inputs = [make_full((5, 5, 8), seed=4), make_full((2, 5, 40), seed=5)]
    case = DTensorCase(fn, inputs, [[Replicate()], [Shard(1)]], requires_grad=[True, False], mesh=mesh_1d())
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2)
@LOWERING
def test_in_place_write_into_a_view(lowering):
    """Without grad the write reaches the viewed DTensor; with grad it runs with eager's values and gradients
    (was: refused, since thunder 0.2.6's autodiff gets it wrong; now made functional, a ``slice_scatter``)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:, :1].mul_(0.5)
        return y

    full = make_full((6, 4), seed=6)
    for placement in (Replicate(), Shard(0)):
        out = thunder.jit(fn, dtensor_lowering=lowering)(distribute_tensor(full, mesh_1d(), [placement]))
        torch.testing.assert_close(out.full_tensor(), fn(full))
        case = DTensorCase(fn, [full], [[placement]], mesh=mesh_1d())
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2, 4)
@LOWERING
def test_in_place_write_into_a_view_of_a_view(lowering):
    """A write into a view of a view reaches the viewed DTensor (was: lost with the lowering on: the value the
    alias pass renamed was made contiguous where it entered lowered code, a copy cut off from the memory)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = (x * 2).clone()
        y[:, 1:].t()[1:].mul_(0.5)
        y[1:][:, ::2].add_(1.5)
        return y * 3

    for placements in ([Replicate()], [Shard(0)], [Shard(1)]):
        case = DTensorCase(fn, [make_full((6, 7), seed=19)], [placements], requires_grad=[False], mesh=mesh_1d())
        try:
            run_case(case, jit_kwargs={"dtensor_lowering": lowering})
        except DTensorOpError as error:  # a view DTensor computes on gathered data is a copy: refused
            assert placements != [Replicate()] and "computed on gathered data" in str(error)


def _add_into_a_view_then_return_it(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[:, 1:].add_(0.5)
    return y  # (fuzzer seed 457: thunder 0.2.6 returns y as it was before the write, plain tensors too)


def _sub_into_a_view_then_read_both(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    v = y[:, 1:]
    v.sub_(0.25)
    return y.sum(1) + v.sum(1)


def _add_into_a_view_of_a_view_then_read_it(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    v = y[1:][:, ::2]
    v.add_(1.5)
    return v * y[1:, :1]


@pytest.mark.world_size(2, 4)
@LOWERING
@pytest.mark.parametrize(
    "program",
    [_add_into_a_view_then_return_it, _sub_into_a_view_then_read_both, _add_into_a_view_of_a_view_then_read_it],
)
def test_adding_a_number_into_a_view_that_requires_grad(program, lowering):
    """``add_`` / ``sub_`` of a number into a view that requires grad runs with eager's values and gradients
    (fuzzer seeds 125, 170, 182, 194 and 256 were refused). Such a write passes the gradient through unchanged,
    where thunder's autodiff, which treats the viewed tensor after the write as the one before it, is right;
    and the returned tensor is now the written one."""
    for placements in ([Replicate()], [Shard(0)], [Partial()]):
        case = DTensorCase(program, [make_full((4, 6), seed=17)], [placements], mesh=mesh_1d())
        try:
            run_case(case, jit_kwargs={"dtensor_lowering": lowering})
        except DTensorOpError as error:  # a view DTensor computes on gathered data is a copy: refused
            if placements == [Partial()] and _dtensor_adds_a_number_to_each_partial_addend(lambda x: x + 1):
                assert "to every rank's addend of a Partial(sum) value" in str(error)
            elif placements == [Partial()] and program is _add_into_a_view_of_a_view_then_read_it:
                # add_ into a view of a Partial(sum) product, which DTensor would have to reduce first: eager
                # DTensor refuses the write too
                assert "in-place operations that require placement changes" in str(error), error
                assert eager_error(case) is not None
            else:
                assert placements == [Shard(0)] and "computed on gathered data" in str(error)


def _dtensor_adds_a_number_to_each_partial_addend(program: Callable) -> bool:
    """Whether this torch's eager DTensor keeps ``program(Partial(sum))`` Partial (torch 2.10's ``+ 1``: a wrong
    sum)."""
    partial = distribute_tensor(torch.zeros(2), mesh_1d(), [Partial()])
    return program(partial).placements[0].is_partial()


@pytest.mark.world_size(2, 4)
@LOWERING
@pytest.mark.parametrize("program", [lambda x: x + 0.5, lambda x: x - 2, lambda x: 1 - x, lambda x: x.clone().add_(3)])
def test_a_number_added_to_a_partial_sum(program, lowering):
    """Where torch's DTensor reduces ``Partial(sum) + c`` first, the program matches eager; where it keeps it
    Partial (torch 2.10, whose eager sum is then off by ``(ranks - 1) * c``), it is refused at trace time."""
    case = DTensorCase(program, [make_full((4, 6), seed=30)], [[Partial()]], mesh=mesh_1d())
    if (
        eager_error(case) is not None
    ):  # torch 2.11's eager refuses add_ into a Partial: a DTensorOpError or torch's values
        try:
            run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})
        except DTensorOpError:
            pass
        return
    if not _dtensor_adds_a_number_to_each_partial_addend(program):
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})
        return
    with pytest.raises(DTensorOpError, match="to every rank's addend of a Partial"):
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})


def _scale_a_view(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[:, 1:].mul_(0.5)
    return y * 2


def _add_a_tensor_into_a_view(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[:, 1:].add_(b)
    return y * 2


@pytest.mark.world_size(2)
@LOWERING
@pytest.mark.parametrize("program", [_scale_a_view, _add_a_tensor_into_a_view])
def test_other_writes_into_a_view_that_requires_grad(program, lowering):
    """``mul_`` into a view (thunder 0.2.6: wrong gradients, plain tensors too) and ``add_`` of a tensor when only
    the viewed tensor is read afterwards (thunder 0.2.6: the tensor's gradient is lost) run with eager's values
    and gradients (were refused; fuzzer seeds with ``mul_`` into a view): the write is made functional."""
    inputs = [make_full((4, 6), seed=17), make_full((4, 5), seed=18)]
    for placements in ([Replicate()], [Shard(0)]):
        case = DTensorCase(program, inputs, [placements, placements], mesh=mesh_1d())
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2, 4)
@LOWERING
def test_matmul_decomposes_as_in_eager_when_an_operand_needs_no_gradient(lowering):
    """Fuzzer seed 360: ``o2 @ x.expand(3, 6, 3)`` with ``x`` Partial and requiring grad, ``o2`` not. torch's
    matmul folds the batch into one ``mm`` only when the smaller operand requires grad; the lowering traced
    it with a gradient for ``o2`` that nothing reads, so it folded, gathered ``x`` and gave Replicate where
    eager gives Partial (values right)."""

    def fn(x: torch.Tensor, o2: torch.Tensor) -> torch.Tensor:
        return o2 @ x.expand(3, 6, 3)

    inputs = [make_full((6, 3), seed=20), make_full((7, 6), seed=21)]
    case = DTensorCase(fn, inputs, [[Partial()], [Replicate()]], requires_grad=[True, False], mesh=mesh_1d())
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2, 4)
@LOWERING
def test_zero_cotangent_of_an_overwritten_value_adds_nothing(lowering):
    """Fuzzer seed 327: after ``y.add_(0.5)`` autodiff sums a zero cotangent (the overwritten value's) into
    ``y``'s gradient; that sum took the zeros' placements, ``S(1)``, where eager's gradient is ``S(2)``."""

    def fn(x: torch.Tensor, o1: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.add_(0.5)
        return torch.matmul(y.view(48, 4), o1)

    inputs = [make_full((6, 8, 4), seed=22, dtype=torch.float64), make_full((4, 8), seed=23, dtype=torch.float64)]
    case = DTensorCase(fn, inputs, [[Shard(1)], [Shard(0)]], requires_grad=[True, False], mesh=mesh_1d())
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2)
def test_attention_without_dropout_is_lowered():
    """CPU's fused attention is tagged random (for its dropout); called with ``dropout_p=0`` it draws nothing
    and is lowered (was: kept eager, and its gradient recomputed it)."""

    def fn(q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.0, is_causal=True)

    case = DTensorCase(fn, [make_full((2, 4, 8, 4), seed=7)], [[Shard(1)]], mesh=mesh_1d())
    result = run_case(case, compare_eager=False)
    executed = str(thunder.last_traces(result.jitted)[-1]) + str(thunder.last_backward_traces(result.jitted)[-1])
    assert "not lowered" not in executed, executed


@pytest.mark.world_size(2)
@LOWERING
def test_backward_specs_follow_the_gradients_that_flow(lowering):
    """thunder traces each grad rule on a stand-in cotangent with its primal's spec; the gradient that later
    flows in may be placed otherwise (Partial here). The backward is propagated again on the actual gradients
    (was: a stale Replicate label led the linear's backward to a Shard(0) gradient, and the view's backward
    then rejected an uneven unflatten that eager, receiving Partial, never meets)."""

    def fn(x: torch.Tensor, other: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = torch.cat([x, other], dim=0).view(42)
        return F.rms_norm(F.linear(y, w, b)[4:], (1,), eps=1e-6)

    inputs = [
        make_full((5, 6), seed=8),
        make_full((2, 6), seed=9),
        make_full((5, 42), seed=10),
        make_full((5,), seed=11),
    ]
    placements = [[Shard(0)], [Replicate()], [Shard(1)], [Partial()]]
    case = DTensorCase(fn, inputs, placements, requires_grad=[False, True, False, False], mesh=mesh_1d())
    if eager_error(case) is None:
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})
        return
    # torch 2.10's eager gives the linear's input gradient Shard(0), which its view rule then cannot unflatten:
    # the program is one eager rejects, so it either raises a DTensorOpError naming the view or matches torch
    try:
        run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})
    except DTensorOpError as error:
        assert "view" in str(error) and "Shard(dim=0)" in str(error), error


@pytest.mark.world_size(2, 4)
@LOWERING
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_of_a_partial_value_is_replicated_as_eager_does(approximate, lowering):
    """gelu is one op for DTensor (was: a decomposition into mul and erf kept a Partial input's output Partial
    where eager's gelu reduces it first; values were right)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=approximate)

    case = DTensorCase(fn, [make_full((4, 12), seed=12)], [[Partial()]], mesh=mesh_1d())
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2)
@LOWERING
def test_in_place_write_into_a_view_dtensor_computes_on_gathered_data_reaches_the_dtensor(lowering):
    """``y[:1]`` of a Shard(0) DTensor is gathered (a copy): eager DTensor loses a write into it, silently (a torch
    bug). thunder_dtensor first gave the same silent loss, then refused it at trace time; now the write is made
    functional and written back: plain torch's values, with grad mode on or off."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:1].mul_(0.5)
        return y

    full = make_full((6, 8), seed=13)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            x = distribute_tensor(full, mesh_1d(), [Shard(0)]).requires_grad_(grad)
            out = thunder.jit(fn, dtensor_lowering=lowering)(x)
        assert out.placements == (Shard(0),)  # a write keeps the written tensor's placements, as eager's
        torch.testing.assert_close(out.full_tensor(), fn(full))
    # and its gradient keeps them too, as eager's backward of a write gives it (seed 5022: Replicate, from the
    # backward of a redistribution back to the written tensor's placements)
    cotangent, plain = make_full((6, 8), seed=14), full.clone().requires_grad_()
    out.backward(distribute_tensor(cotangent, mesh_1d(), [Shard(0)]))
    fn(plain).backward(cotangent)
    assert x.grad.placements == (Shard(0),), x.grad.placements
    torch.testing.assert_close(x.grad.full_tensor(), plain.grad)


@pytest.mark.world_size(2, 4)
@LOWERING
def test_attention_output_stride_describes_its_local_layout(lowering):
    """CPU's fused attention returns a non-contiguous local output; its DTensor's global stride now says so,
    so a later ``flatten`` copies where it must (was: a contiguous stride, DTensor chose to view, and the view
    failed: "view size is not compatible with input tensor's size and stride")."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        q = x.transpose(1, 2)  # [batch, seq, heads, dim] -> [batch, heads, seq, dim], not contiguous
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).flatten(2)

    for placements in ([Shard(2)], [Shard(0)], [Replicate()], [Shard(1)]):
        case = DTensorCase(fn, [make_full((4, 8, 4, 4), seed=14)], [placements], mesh=mesh_1d())
        run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2, 4)
@LOWERING
@pytest.mark.parametrize("op", ["linear", "matmul"])
def test_one_dim_input_with_a_partial_result_keeps_torch_shape(op, lowering):
    """``F.linear`` / ``@`` of a 1-D DTensor whose result is Partial: torch 2.13's DTensor gives the output the
    global shape ``[1, N]`` (its local is ``[N]``; the backward then fails). The fuzzer found it (seeds 85 and
    281). The 1-D input now gets a batch dim of one for the call (``ops/matmul.py``): torch's shape ``[N]``, right
    values and gradients, eager's placements (the output Partial, the weight's gradient as eager's) and no
    gather (was: the call ran replicated, an all-gather of both operands; fuzz seed 7957)."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w) if op == "linear" else x @ w.mT

    full_x, full_w = make_full((6,), seed=15).requires_grad_(), make_full((4, 6), seed=16).requires_grad_()
    expected = fn(full_x, full_w)
    expected.backward(torch.ones_like(expected))
    mesh = mesh_1d()
    x = distribute_tensor(full_x.detach(), mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(full_w.detach(), mesh, [Shard(1)]).requires_grad_()
    eager_x, eager_w = (t.detach().clone().requires_grad_() for t in (x, w))
    jitted = thunder.jit(fn, dtensor_lowering=lowering)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedFallbackWarning)
        out = jitted(x, w)
    eager_out = fn(eager_x, eager_w)
    assert "_replicated_prim" not in str(thunder.last_traces(jitted)[0])
    assert tuple(out.shape) == tuple(expected.shape) == (4,)
    assert out.placements == eager_out.placements == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    out.backward(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    eager_out.sum().backward()  # (eager's own backward of its [1, 4] output: the placements it gives)
    torch.testing.assert_close(x.grad.full_tensor(), full_x.grad)
    torch.testing.assert_close(w.grad.full_tensor(), full_w.grad)
    assert (x.grad.placements, w.grad.placements) == (eager_x.grad.placements, eager_w.grad.placements)


@pytest.mark.world_size(4)
@LOWERING
def test_scalar_division_of_a_strided_shard_value(lowering):
    """``cat > view > / 3.0`` on a 2x2 mesh: the view's output is ``_StridedShard`` and DTensor's rule for the
    division reads the scalar operand's value, so the fake run is data-dependent; DTensor re-raised that as a
    ``RuntimeError``, which the prim's meta did not recognise (was: ``DTensorOpError: ... aten._local_scalar_dense``;
    the fuzzer's seed 27 at 4 ranks). The meta now runs such a rule on zeros, as for other data-dependent rules."""

    def fn(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return (torch.cat([other, x], dim=0).view(3, 48) / 3.0).sum(dim=-2)

    inputs = [make_full((2, 6, 8), seed=20), make_full((1, 6, 8), seed=21)]
    case = DTensorCase(fn, inputs, [[Replicate(), Replicate()], [Shard(1), Shard(2)]], mesh=mesh_2d(2))
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(4)
@LOWERING
def test_a_masked_lookup_dtensor_chose_leaves_no_mask_behind(lowering):
    """Fuzz seed 6121 (4 ranks): a table sharded on its embedding dim over the first mesh dim of a 2x2 mesh, ids
    sharded over the batch: eager DTensor chooses its masked (vocab-parallel) lookup on the second mesh dim, whose
    mask its sharding cache shares between every call of the lookup. Was: the trace's fake mask, left in it, met
    the run-time call's real one (the first call failed), and the gradient rule's recomputed lookup left its real
    mask behind for the next call with other ids (the second failed). Two calls, other data each."""

    def fn(x: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(x + F.embedding(ids, table), -3)

    placements = [[Shard(0), Shard(1)], [Shard(0), Replicate()], [Shard(1), Replicate()]]
    for call in range(2):
        inputs = [
            make_full((8, 8, 8), seed=40 + call, dtype=torch.float64),
            make_full((8, 8), seed=42 + call, dtype=torch.int64, int_high=4),
            make_full((4, 8), seed=44 + call, dtype=torch.float64),
        ]
        case = DTensorCase(fn, inputs, placements, requires_grad=[True, False, True], mesh=mesh_2d(2))
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@LOWERING
def test_alias_updates_compile_to_the_same_program_on_every_rank(lowering, monkeypatch):
    """Seed 5: a write into a clone whose views are read afterwards. thunder ordered the alias update's operands
    by iterating a set (each rank's own hash seed), so the ranks compiled different programs, and long fuzzer
    runs died of mismatched gloo collectives. The opt-in rank-consistency check compares the programs."""
    monkeypatch.setenv("THUNDER_DTENSOR_CHECK_COLLECTIVES", "1")

    def fn(x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.sub_(o)
        return torch.cat(y.split(6, dim=1)[::-1], dim=1)

    inputs = [make_full((6, 8, 7), seed=1, dtype=torch.float64), make_full((6, 8, 7), seed=2, dtype=torch.float64)]
    case = DTensorCase(fn, inputs, [[Replicate()], [Partial()]], mesh=mesh_1d())
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(4)
def test_a_to_local_empty_on_one_rank_is_lowered_on_every_rank(monkeypatch):
    """Seeds 78 and 144 at world size 4: a sharded dim of 3 rows gives rank 3 an empty local tensor. The lowering
    kept ``to_local`` / ``from_local`` eager when a *local* tensor was empty, so rank 3 compiled another program
    than the other ranks (the rank-consistency check says so). It now decides from global shapes only."""
    monkeypatch.setenv("THUNDER_DTENSOR_CHECK_COLLECTIVES", "1")

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x.expand(2, 3, 16).amax(dim=0, keepdim=True)
        if isinstance(y, DTensor):  # the identity on full tensors (plain torch)
            y = DTensor.from_local(y.to_local(), y.device_mesh, y.placements, shape=y.shape, stride=y.stride())
        return F.linear(y.transpose(0, 2), w)

    inputs = [make_full((3, 16), seed=1), make_full((5, 1), seed=2)]
    case = DTensorCase(fn, inputs, [[Shard(0)], [Replicate()]], mesh=mesh_1d())
    run_case(case, jit_kwargs={"dtensor_lowering": True})


@pytest.mark.world_size(4)
def test_waits_placed_differently_by_rank_do_not_fail_the_consistency_check(monkeypatch):
    """Seed 163 at world size 4 (2x2 mesh, uneven shards): each wait is placed before its value's first use, which
    differs by rank where a rank's local program un-pads a gathered value. The ranks issue the same collectives
    in the same order; only the collectives' issue order is compared now, not where the waits are."""
    monkeypatch.setenv("THUNDER_DTENSOR_CHECK_COLLECTIVES", "1")

    def fn(x, w1, b2, o3, w4):
        y = F.layer_norm(x, (2,)) - 1.5
        y = F.linear(y.reshape(10).split(5, dim=0)[0], w1, b2)
        return F.linear(torch.cat([y[..., ::2], o3], dim=-1), w4)

    shapes = [(5, 2), (3, 5), (3,), (3,), (2, 5)]
    inputs = [make_full(shape, seed=i) for i, shape in enumerate(shapes)]
    placements = [
        [Partial(), Shard(1)],
        [Partial(), Shard(1)],
        [Shard(0), Shard(0)],
        [Replicate(), Replicate()],
        [Shard(1), Shard(1)],
    ]
    case = DTensorCase(fn, inputs, placements, mesh=mesh_2d(2))
    run_case(case, jit_kwargs={"dtensor_lowering": True}, compare_eager=False)  # eager cannot flatten it


def test_thunderfx_graph_reading_the_mesh_after_a_graph_break():
    """Seed 2 at world size 2: after dynamo's break at ``if y.mean() > 0.1``, a node of the next graph reads
    ``y.device_mesh``; the check of its placements against eager's flattened the mesh with thunder's pytree."""
    from thunder.dynamo import thunderfx

    def fn(x):
        y = -x if x.mean() > 0.1 else x - 1.0
        t = y.to_local() * 2.0
        return DTensor.from_local(t, y.device_mesh, y.placements, shape=y.shape, stride=y.stride())

    full = make_full((8, 5), seed=1)
    x = distribute_tensor(full, mesh_1d(), [Shard(0)]).requires_grad_()
    out = thunderfx(fn)(x)
    plain = full.clone().requires_grad_()
    expected = -plain if plain.mean() > 0.1 else plain - 1.0
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), expected * 2.0)
    out.sum().backward()
    expected.mul(2.0).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), plain.grad)


def test_thunderfx_graph_whose_only_output_is_detached():
    """Seed 4 at world size 4: dynamo's graph before ``.item()`` is ``x.detach().sum()``; detach's generic grad
    rule put a kept no-op into an otherwise empty backward, which thunder's split of the joint trace rejected."""
    from thunder.dynamo import thunderfx

    def fn(x):
        s = x.detach().sum().item()
        return x * s, s

    full = make_full((4, 2, 16), seed=1)
    # replicated: dynamo runs .item() eagerly, and eager's item() of a Partial sum is the rank's own part
    x = distribute_tensor(full, mesh_1d(), [Replicate()]).requires_grad_()
    out, s = thunderfx(fn)(x)
    plain = full.clone().requires_grad_()
    expected, expected_s = fn(plain)
    assert s == pytest.approx(expected_s, rel=1e-5)
    torch.testing.assert_close(out.full_tensor(), expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), plain.grad)


def _overwrite_all_of_it_through_a_transpose(x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y.transpose(0, -1).copy_(o)  # o, which needs no grad, broadcast over all of y
    return y


def _two_writes_into_views_then_a_mean_of_one(x, ids, table, o):
    y = x.clone()
    v = y[:, 2:].transpose(0, -1)
    v.mul_(0.5)
    y = y + F.embedding(ids, table)
    y = y.clone()
    v = y.transpose(0, -1)
    v.copy_(o)
    return y * v.mean() + 0.5


@pytest.mark.world_size(2)
@LOWERING
def test_a_write_over_all_of_a_tensor_keeps_it_requiring_grad(lowering):
    """Found with writes into views drawn (``--view-writes``), seed 32: a write over all of a tensor, through a
    transpose, of a value that needs no grad left the result without ``requires_grad`` (eager's result depends on
    the old value, with a zero gradient)."""
    overwrite = DTensorCase(
        _overwrite_all_of_it_through_a_transpose,
        [make_full((6, 8, 16), seed=40), make_full((8, 6), seed=41)],
        [[Shard(2)], [Replicate()]],
        requires_grad=[True, False],
        mesh=mesh_1d(),
    )
    run_case(overwrite, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2)
@LOWERING
def test_gradients_through_writes_into_views_have_eagers_placements(lowering):
    """Found with writes into views drawn (``--view-writes``), seed 56: the gradients of ``x`` and ``table`` came
    out Replicate where eager's are Partial(avg) and Shard(1). The scatter's backward now zeroes the written part
    of a copy of the gradient, as eager's does (it scattered zeros into it), and ``copy_``'s source is copied
    into the written view's placements with eager's ``copy_`` gradient. ``o``'s gradient was Partial(avg) where
    eager's is Replicate: eager's backward of a write into a view clones the view of the gradient, which reduces a
    Partial one (so does the functional form now)."""
    inputs = [make_full((8, 4, 7), seed=42), torch.randint(0, 5, (8, 4)), make_full((5, 7), seed=43)]
    two_writes = DTensorCase(
        _two_writes_into_views_then_a_mean_of_one,
        [*inputs, make_full((7, 4, 8), seed=44)],
        [[Shard(0)], [Replicate()], [Replicate()], [Replicate()]],
        requires_grad=[True, False, True, True],
        mesh=mesh_1d(),
    )
    run_case(two_writes, jit_kwargs={"dtensor_lowering": lowering})


def _fill_into_a_column_then_into_a_row(x, row_mask, column_mask):
    y = x.clone()
    v = y[:, 0]
    v.masked_fill_(column_mask > 0, 0.25)
    y = y.clone()
    v = y.select(0, 6)
    v.masked_fill_(row_mask > 0, 0.25)  # the mask is sharded: this part of the gradient comes out Shard(1)
    return y * v.mean()


@pytest.mark.world_size(2)
@LOWERING
def test_a_write_into_a_view_the_gradient_is_sharded_along(lowering):
    """Found with writes into views drawn (``--view-writes``), seed 75: the backward of the write into ``y[:, 0]``
    zeroes that column of a copy of the gradient, which came out Shard(1): DTensor takes the column on gathered
    data, a copy, so zeroing it changed nothing and ``x``'s gradient was wrong in that column. Zeros are now
    scattered into the gradient out of place where the part is not a view of its shards."""
    inputs = [make_full((7, 4), seed=45), make_full((4,), seed=46), make_full((7,), seed=47)]
    case = DTensorCase(
        _fill_into_a_column_then_into_a_row,
        inputs,
        [[Replicate()], [Shard(0)], [Replicate()]],
        requires_grad=[True, False, False],
        mesh=mesh_1d(),
    )
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


def _write_then_writes_into_views(x, o1, o2):
    y = x.clone()
    y.mul_(o1)  # y needs grad from here on (x does not)
    y = y.reshape(2, 4, -1, 6)
    y = y.clone()
    v = y[:, :, 0:2]
    v.mul_(0.5)
    y = y * v.mean()
    y = y.clone()
    v = y[0:1]
    v.copy_(o2)
    return y * v.mean()


@pytest.mark.world_size(2)
@LOWERING
def test_a_write_into_a_view_of_a_value_an_in_place_op_made_require_grad(lowering):
    """Found with writes into views drawn (``--view-writes``), seed 537: ``y.mul_(o1)`` makes ``y`` require grad,
    but the rewrite read that from the tensor before the write, so the writes into views of ``y`` were left to
    thunder's in-place form, whose gradients are wrong (``o1``'s off by 3%)."""
    inputs = [make_full((2, 8, 6), seed=48), make_full((2, 8, 6), seed=49), make_full((1, 4, 2, 6), seed=50)]
    for placements in ([Replicate()], [Partial()]):
        case = DTensorCase(
            _write_then_writes_into_views,
            inputs,
            [[Replicate()], placements, [Shard(2)]],
            requires_grad=[False, True, False],
            mesh=mesh_1d(),
        )
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})


def _scale_a_view_by_a_sharded_vector(x: torch.Tensor, o1: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    v = y.narrow(1, 0, 5)
    v.mul_(o1)
    return y * 2


@pytest.mark.world_size(2)
@LOWERING
def test_a_write_into_a_view_gives_the_gradient_the_cotangents_placements(lowering):
    """Found with writes into views drawn (``--view-writes``), seeds 1391 and 1434: ``v.mul_(o1)`` into a view of a
    Replicate ``y`` by a sharded ``o1``: eager's backward copies the write's gradient into a copy of ``y``'s
    cotangent, so ``x``'s gradient is Replicate; the functional form added the two parts and DTensor placed the
    sum ``Shard(2)`` (values right)."""
    inputs = [make_full((7, 6, 6), seed=51), make_full((6,), seed=52)]
    case = DTensorCase(
        _scale_a_view_by_a_sharded_vector,
        inputs,
        [[Replicate()], [Shard(0)]],
        requires_grad=[True, True],
        mesh=mesh_1d(),
    )
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2)
def test_collectives_are_issued_in_one_order_on_every_rank_under_thunderfx():
    """Fuzz seed 5076: with an index sharded unevenly (3 ids over 2 ranks) one rank pads its shard before the
    all-gather; thunderfx's dataflow fusion partition re-emitted that rank's all-gather after the values'
    all-reduce while the other rank kept the trace's order, and each rank waited for the other forever."""
    from thunder.dynamo import thunderfx

    def fn(x, ids, values):
        y = x.clone()
        y.index_put_((ids,), values)
        return y * 2

    fulls = [make_full((6, 4), seed=31), torch.tensor([4, 0, 2]), make_full((4,), seed=32)]
    expected = fn(*fulls)
    for call in range(2):
        x, ids = (
            distribute_tensor(fulls[0], mesh_1d(), [Replicate()]),
            distribute_tensor(fulls[1], mesh_1d(), [Shard(0)]),
        )
        half = distribute_tensor(fulls[2] / 2, mesh_1d(), [Replicate()]).to_local()
        values = DTensor.from_local(half, mesh_1d(), [Partial()])
        torch.testing.assert_close(thunderfx(fn)(x, ids, values).full_tensor(), expected, msg=f"call {call}")


def _add_a_partial_into_a_slice(x, o1, w2):  # seed 5153
    y = F.gelu(x).clone()
    y[0:1].add_(o1)
    return F.linear(y, w2).softmax(dim=0)


def _subtract_a_partial(x, o1):  # seed 5178
    y = (x * 2).clone()
    y.sub_(o1)
    return y.softmax(dim=1)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "program, shapes, placements",
    [
        (_add_a_partial_into_a_slice, [(5, 5, 3), (3,), (6, 3)], [[Replicate()], [Partial()], [Partial()]]),
        (_subtract_a_partial, [(4, 6, 8), (4, 6, 8)], [[Shard(2)], [Partial()]]),
    ],
    ids=["add_ into a view (Replicate)", "sub_ from a sharded tensor (Shard)"],
)
def test_an_in_place_operand_reduced_from_partial_gets_its_gradient_placed_as_eager_does(program, shapes, placements):
    """A Partial operand of an in-place op gets its gradient in eager's placement: Replicate through a write into a
    view (seed 5153: we gave Partial; eager's backward of the write clones the view of the gradient, which reduces
    a Partial one), and the gradient's own Shard for a write into the whole tensor (seed 5178)."""
    fulls = [make_full(s, seed=40 + i) for i, s in enumerate(shapes)]
    run_case(DTensorCase(program, fulls, placements, requires_grad=[True, True, False][: len(shapes)]))


def _scale_a_transpose_by_a_sharded_operand(x, o1):  # seed 5311
    y = x.clone()
    y.transpose(0, -1).mul_(o1)
    return torch.sigmoid(y).softmax(dim=2)


def _add_into_a_transpose_read_by_a_partial_matmul(x, o1, o2):  # seed 5340
    y = x.view(-1, 3, 8, 5).clone()
    v = y.transpose(0, -1)
    v.add_(o1)
    return (o2 @ (y * v.mean())).softmax(dim=2)


def _scale_a_transpose_by_a_partial_operand(x, o1, g2):  # seed 5472
    y = x[..., ::2].view(2, 2, 2).clone()
    y.transpose(0, -1).mul_(o1)
    return F.layer_norm(y.mean(dim=0), (2,), g2)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "program, shapes, placements, requires_grad",
    [
        (_scale_a_transpose_by_a_sharded_operand, [(8, 7, 6), (6, 7, 8)], [[Replicate()], [Shard(1)]], [True, True]),
        (
            _add_into_a_transpose_read_by_a_partial_matmul,
            [(6, 8, 5), (2,), (6, 8)],
            [[Shard(0)], [Shard(0)], [Partial()]],
            [False, True, True],
        ),
        (
            _scale_a_transpose_by_a_partial_operand,
            [(2, 8), (2, 2, 2), (2,)],
            [[Replicate()], [Partial()], [Partial()]],
            [True, True, True],
        ),
    ],
    ids=["whole-view write, sharded operand", "Partial cotangent of the written view", "Partial operand"],
)
def test_a_write_through_a_view_of_all_of_a_tensor_places_gradients_as_eager(
    program, shapes, placements, requires_grad
):
    """Writes through a transpose (all of the tensor): eager's backward of a write into a view (autograd's
    CopySlices) copies the write's gradient into a copy of the written tensor's cotangent, and runs the write's own
    backward on a clone of that view of it, which reduces a Partial cotangent. The functional form now does both (a
    scatter over all of the tensor, a clone of the written value's cotangent); before, the transposed write's
    gradient kept the write's placements (seed 5311: x's gradient Shard(1), eager's Replicate) or a Partial one
    reached the operand (seeds 5340, 5472)."""
    fulls = [make_full(s, seed=60 + i) for i, s in enumerate(shapes)]
    run_case(DTensorCase(program, fulls, placements, requires_grad=requires_grad, mesh=mesh_1d()))


def _scaled_lookup_in_a_vocab_sharded_table(x, ids, w):  # seed 5832
    return x + F.embedding(ids, w, padding_idx=-4, scale_grad_by_freq=True)


@pytest.mark.world_size(2)
def test_a_frequency_scaled_lookup_of_sharded_ids_in_a_vocab_sharded_table():
    """Seed 5832: the ids are made Replicate (the counts must be the whole batch's), and the lookup then took eager's
    vocab-parallel rule at run time, whose mask buffer the trace-time fake run had left filled with a fake mask in
    DTensor's sharding cache: the run failed comparing masks (and an eager call of the same lookup after it too).
    Now the vocab-parallel lookup takes the replicated ids, and its output is placed as eager places the lookup of
    the ids as given."""
    fulls = [make_full((5, 5, 8), seed=70), torch.randint(0, 4, (5, 5), generator=torch.Generator().manual_seed(71))]
    fulls.append(make_full((4, 8), seed=72))
    case = DTensorCase(
        _scaled_lookup_in_a_vocab_sharded_table,
        fulls,
        [[Shard(2)], [Shard(1)], [Shard(0)]],
        requires_grad=[True, False, True],
        mesh=mesh_1d(),
    )
    run_case(case, own_grad_placements={2: [Shard(0)]})
    ids = distribute_tensor(fulls[1], mesh_1d(), [Shard(1)])
    table = distribute_tensor(fulls[2], mesh_1d(), [Shard(0)])
    eager = F.embedding(ids, table, padding_idx=-4, scale_grad_by_freq=True)  # (eager after the trace)
    torch.testing.assert_close(eager.full_tensor(), F.embedding(fulls[1], fulls[2], padding_idx=-4))


@pytest.mark.world_size(4)
def test_a_reduction_over_an_empty_shard_is_traced_alike_on_every_rank():
    """Fuzz seed 6176 at 4 ranks: 5 rows sharded over 4 ranks are shards of 2, 2, 1 and 0 rows. DTensor's rule for
    ``amax`` held on ranks 0-2, but its fake run failed on rank 3's empty shard, so rank 3 alone traced the
    replicated fallback: the ranks' collectives did not pair up (a hang; eager DTensor raises on rank 3 alone). A
    fake run on uneven shards now ends in one agreement of the ranks, and every rank takes the op alike."""
    full = make_full((5, 4), seed=80)
    x = distribute_tensor(full, mesh_1d(), [Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        out = thunder.jit(lambda x: (x * 2).amax() + 1)(x)
    torch.testing.assert_close(out.full_tensor(), (full * 2).amax() + 1)


def _linear_redistribute_linear_permute_linear(x, w1, b2, w3, b4, w5):
    y = F.linear(x, w1, b2).view(8, 2, 3, 5)
    if isinstance(y, DTensor):  # (plain torch on the full tensors: the identity)
        y = y.redistribute(y.device_mesh, [Partial()])
    return F.linear(F.linear(y, w3, b4).permute(1, 2, 3, 0), w5)


@pytest.mark.world_size(2)
def test_a_thunderfx_backward_traced_again_for_other_cotangent_placements_runs_eagers_placements():
    """Seed 8082 under thunderfx: a region's backward was traced for cotangents ``Shard(2)`` and got ``Shard(3)``;
    the backward traced for them came with a forward that scheduled the same symbols in another order, which the
    symbol-by-symbol comparison took for another forward: the cotangents were redistributed instead (a
    ``CotangentPlacementWarning``), and four gradients were placed otherwise than eager's (values right). The
    forwards are now matched by dataflow."""
    from thunder_dtensor.guards import CotangentPlacementWarning

    from thunder.dynamo import thunderfx

    fn = _linear_redistribute_linear_permute_linear
    shapes = [(8, 6, 6), (5, 6), (5,), (2, 5), (2,), (6, 8)]
    placements = [[Shard(1)], [Replicate()], [Partial()], [Replicate()], [Shard(0)], [Shard(1)]]
    fulls = [make_full(shape, seed=90 + i) for i, shape in enumerate(shapes)]

    def dtensors() -> list:
        made = []
        for full, p in zip(fulls, placements):
            if p[0].is_partial():  # each rank holds a part: rank r has (r + 1) / (1 + 2) of the value
                local = full * (mesh_1d().get_local_rank(0) + 1) / 3
                made.append(DTensor.from_local(local, mesh_1d(), p, shape=full.shape, stride=full.stride()))
            else:
                made.append(distribute_tensor(full, mesh_1d(), p))
        return [x.requires_grad_() for x in made]

    compiled = thunderfx(fn)
    plain = [f.clone().requires_grad_() for f in fulls]
    expected = fn(*plain)
    expected.backward(torch.ones_like(expected))
    for call in range(2):
        inputs, eager_inputs = dtensors(), dtensors()
        with warnings.catch_warnings():
            warnings.simplefilter("error", CotangentPlacementWarning)
            out = compiled(*inputs)
            eager = fn(*eager_inputs)
            assert out.placements == eager.placements
            torch.testing.assert_close(out.full_tensor(), expected.detach())
            cotangent = distribute_tensor(torch.ones_like(expected), mesh_1d(), [Replicate()])
            out.backward(cotangent)
        eager.backward(cotangent)
        for i, (x, e, p) in enumerate(zip(inputs, eager_inputs, plain)):
            torch.testing.assert_close(x.grad.full_tensor(), p.grad, msg=f"call {call}, gradient {i}")
            assert x.grad.placements == e.grad.placements, f"call {call}, gradient {i}"


def _dropout_off_of_a_partial_value(x, w, b, o):
    y = F.linear(x, w, b)
    return (torch.dropout(y, 0.2, False) + torch.dropout(y, 0.0, True)) / o


@pytest.mark.world_size(2, 4)
@LOWERING
def test_torch_dropout_that_draws_nothing_keeps_a_partial_value_as_eager(lowering):
    """Fuzz seed 9190 at 4 ranks: ``torch.dropout(y, 0.2, False)`` of a ``Partial`` value is the value itself in
    eager (its kernel returns the input), but DTensor's propagation on fake tensors runs the Python decomposition and
    placed it ``Replicate``: with the lowering, the output was ``_StridedShard`` where eager's is ``Partial(sum)``
    (values right). ``torch.dropout`` now takes ``F.dropout``'s rule."""
    fulls = [make_full((4, 12), seed=100), make_full((6, 12), seed=101), make_full((6,), seed=102)]
    fulls.append(make_full((6,), seed=103, low=0.5))
    placements = [[Replicate()], [Partial()], [Replicate()], [Shard(0)]]
    case = DTensorCase(
        _dropout_off_of_a_partial_value, fulls, placements, requires_grad=[True, False, True, False], mesh=mesh_1d()
    )
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(4)
@LOWERING
def test_a_write_whose_cotangents_meet_a_shard_and_a_partial_value_is_summed(lowering):
    """Fuzz seed 9885 (4 ranks, a 2x2 mesh): ``mul_`` by a partial operand into a view of a transposed clone. The
    functional write's two cotangents met as ``(S(0), P)`` (the written tensor's) and ``(R, S(1))`` (what flowed
    back through its reads); copying the second into the first's placements needs ``S(1) -> P`` on the second mesh
    dim, which DTensor cannot do (the backward raised). It is gathered there first. Eager DTensor's own backward
    raises the same way on this program (torch 2.13): where it does, the case is held to plain torch alone."""

    def fn(x: torch.Tensor, o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x.transpose(0, 1).clone()
        y.narrow(0, 0, 2).mul_(o)
        return torch.tanh(F.linear(y, w)).mean(dim=-2)

    inputs = [make_full((2, 2), seed=50), make_full((2, 2), seed=51), make_full((6, 2), seed=52)]
    placements = [[Shard(1), Replicate()], [Replicate(), Partial()], [Shard(1), Partial()]]
    case = DTensorCase(fn, inputs, placements, requires_grad=[True, False, True], mesh=mesh_2d(2))
    run_case(case, jit_kwargs={"dtensor_lowering": lowering}, compare_eager=eager_error(case) is None)


def _bias_gradient_through_a_gathering_reshape(x, w1, b2, w3, b4, o7, o8):
    y = F.linear(F.linear(x, w1, b2), w3, b4).reshape(-1, 6, 96)
    return torch.cat([torch.cat([o7, y], dim=-1), o8], dim=1)


@pytest.mark.world_size(4)
@LOWERING
def test_a_vjp_decides_how_it_runs_for_the_cotangent_that_flows(lowering, monkeypatch):
    """Fuzz seed 10357 (4 ranks, a 2x2 mesh): the bias placed ``(S(0), S(0))`` got its gradient ``(S(0), S(0))``
    where eager's is ``(R, R)`` (values right). The reshape's output is ``_StridedShard``; thunder's autodiff traced
    its vjp on a cotangent placed like it, which DTensor rejects, so the vjp ran replicated and handed the gradient
    back in the primal's placements. The cotangent that flows is ``(R, R)`` (the concatenations gathered), on
    which DTensor's own vjp runs: each generic vjp now decides how it runs again for the cotangent that flows.

    Compiled from empty caches, the program reads no fake tensor back: DTensor sizes a ``_StridedShard`` from an
    ``arange`` it reads with ``tolist``, which under the lowering's fake tensors made unbacked symbols (0.1-0.25 s
    apiece: 73 reads, most of the 13 s compile) until ``size_strided_shards_outside_tracing``
    (``tests/unit/test_strided_shard_sizes.py``: the read it removes)."""
    from thunder_dtensor._integration import clear_sharding_propagation_cache
    from thunder_dtensor.lowering import GRAPH_CACHE, LOCAL_META_CACHE
    from thunder_dtensor.primitive import PROPAGATION_CACHE

    from torch._subclasses.fake_tensor import FakeTensor

    shapes = [(3, 6, 6, 2), (3, 2), (3,), (16, 3), (16,), (3, 6, 1), (3, 1, 97)]
    inputs = [make_full(shape, seed=110 + i) for i, shape in enumerate(shapes)]
    placements = [
        [Shard(1), Replicate()],
        [Replicate(), Shard(0)],
        [Replicate(), Replicate()],
        [Shard(0), Replicate()],
        [Shard(0), Shard(0)],
        [Shard(0), Replicate()],
        [Shard(1), Partial()],
    ]
    requires_grad = [False, False, False, False, True, False, False]
    case = DTensorCase(
        _bias_gradient_through_a_gathering_reshape, inputs, placements, requires_grad=requires_grad, mesh=mesh_2d(2)
    )
    for cache in (PROPAGATION_CACHE, GRAPH_CACHE, LOCAL_META_CACHE):
        cache.clear()
    clear_sharding_propagation_cache()
    reads = recorded_calls(monkeypatch, FakeTensor, "tolist")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedFallbackWarning)  # no vjp of this program runs replicated
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})
    assert not reads, f"{len(reads)} fake tensors read back while the program was compiled"


def _lookup_transposed_and_strided(ids, table):
    return F.embedding(ids, table).transpose(2, -2)[::2]


def _lookup_scaled(ids, table):
    return F.embedding(ids, table) * 3


_EMBEDDING_DIM_SHARDED = ([Shard(1), Replicate()], [Shard(1), Replicate()])
_VOCAB_SHARDED_IDS_SHARDED = ([Shard(0), Replicate()], [Replicate(), Shard(0)])


@pytest.mark.world_size(4)
@LOWERING
@pytest.mark.parametrize(
    "fn, placements, table_gradient",
    [
        (_lookup_transposed_and_strided, _EMBEDDING_DIM_SHARDED, None),
        (_lookup_scaled, _EMBEDDING_DIM_SHARDED, None),
        (_lookup_scaled, _VOCAB_SHARDED_IDS_SHARDED, [Partial(), Shard(0)]),
    ],
    ids=["masked_by_eager_then_strided", "masked_by_eager", "vocab_sharded_ids_sharded"],
)
def test_vocab_parallel_lookups_on_a_2d_mesh(fn, placements, table_gradient, lowering):
    """Fuzz seed 10371 (4 ranks, a 2x2 mesh), a table placed ``(S(1), R)`` and ids ``(S(1), R)``: DTensor's rule
    looks up ``Shard(0)`` rows on the second mesh dim (free from ``Replicate``), a ``_MaskPartial`` output holding
    the mask of its own call. The trace kept the trace-time one, which the next unwrap compared unequal to the
    run's (lowered: ``Can not redistribute from MaskP(...) to MaskP(...)``). The lookup is now the vocab-parallel
    prim on the ids and table placed as eager's rule places them (the table gathered on the first mesh dim, its
    gradient left as the lookup's backward gives it: eager's ``(P, P)``). Eager's own run of the first program
    raises (its mask no longer fits the transposed, strided value): there it is held to plain torch alone.

    Found on the way, a silently wrong gradient: with the ids sharded over a mesh dim the table is replicated on
    (a vocab-sharded table, batch-sharded ids), each rank's table gradient held its own ids' rows and was called
    ``Replicate``; it is ``Partial`` there, as eager's. A vocab-sharded table's gradient keeps ``Shard(0)`` on the
    vocabulary's mesh dim (the package's decision; eager's is table-sized there, ``Partial`` here)."""
    inputs = [make_full((5, 6), seed=120, dtype=torch.int64, int_high=8), make_full((8, 4), seed=121)]
    case = DTensorCase(fn, inputs, list(placements), requires_grad=[False, True], mesh=mesh_2d(2))
    run_case(
        case,
        jit_kwargs={"dtensor_lowering": lowering},
        compare_eager=eager_error(case) is None,
        own_grad_placements=None if table_gradient is None else {1: table_gradient},
    )


def _counted_lookup_with_padding(ids, table):
    return F.embedding(ids, table, padding_idx=2, scale_grad_by_freq=True) * 2


@pytest.mark.world_size(4)
@LOWERING
def test_a_lookup_in_a_table_sharded_over_its_vocabulary_and_its_embedding_dim(lowering):
    """Fuzz seed 10443 (4 ranks, a 2x2 mesh): a table placed ``(S(0), S(1))`` (the vocabulary over one mesh dim, the
    embedding dim over the other), frequency-scaled with a padding row. The jit ran eager's masked lookup, whose
    backward raised an empty ``AssertionError`` on the fuzzer's program (after a write into a view); here the jit
    placed the table's gradient ``(R, S(1))``, neither eager's nor the table's. Such a table is now the
    vocab-parallel lookup's (its output ``Shard`` over the embedding dim where the table is ``Shard(1)``), its
    gradient in the table's placements (the package's decision; eager's is ``(P, S(1))`` here)."""
    inputs = [make_full((6,), seed=130, dtype=torch.int64, int_high=8), make_full((8, 4), seed=131)]
    placements = [[Replicate(), Replicate()], [Shard(0), Shard(1)]]
    case = DTensorCase(_counted_lookup_with_padding, inputs, placements, requires_grad=[False, True], mesh=mesh_2d(2))
    run_case(
        case,
        jit_kwargs={"dtensor_lowering": lowering},
        compare_eager=eager_error(case) is None,
        own_grad_placements={1: [Shard(0), Shard(1)]},
    )


@pytest.mark.world_size(4)
def test_a_lookup_in_a_table_sharded_both_ways_under_thunderfx():
    """Fuzz seed 10519 (4 ranks, a 2x2 mesh, thunderfx): a table placed ``(S(1), S(0))``: thunderfx's splitter
    compiled the lookup's region with inductor, whose tangent coercion met eager's ``_MaskPartial`` (``Attempting
    to use FunctionalTensor on its own``). The lookup is the vocab-parallel prim now, which thunder takes."""
    from thunder.dynamo import thunderfx

    full_ids, full_table = make_full((5,), seed=140, dtype=torch.int64, int_high=5), make_full((5, 2), seed=141)
    reference = full_table.clone().requires_grad_()
    expected = _counted_lookup_with_padding(full_ids, reference)
    expected.backward(torch.ones_like(expected))
    compiled = thunderfx(_counted_lookup_with_padding)
    for call in range(2):
        ids = distribute_tensor(full_ids, mesh_2d(2), [Replicate(), Replicate()])
        table = distribute_tensor(full_table, mesh_2d(2), [Shard(1), Shard(0)]).requires_grad_()
        out = compiled(ids, table)
        torch.testing.assert_close(out.full_tensor(), expected.detach(), msg=f"call {call}")
        ones = distribute_tensor(torch.ones(out.shape), mesh_2d(2), [Replicate(), Replicate()])
        out.backward(ones.redistribute(mesh_2d(2), [Replicate() if p.is_partial() else p for p in out.placements]))
        torch.testing.assert_close(table.grad.full_tensor(), reference.grad, msg=f"call {call}")


def _write_into_a_row_of_an_uneven_shard(x, o):
    y = x.clone()
    v = y[0:1]
    v.mul_(o)
    return y * v.mean()


@pytest.mark.world_size(4)
@LOWERING
def test_a_write_into_a_view_of_a_dim_sharded_over_more_ranks_than_rows(lowering):
    """Fuzz seed 10570 (4 ranks): ``x`` of 2 rows placed ``Shard(0)`` over 4 ranks, a write into a view of one row
    of its clone. The functional write's new value is put back in the clone's placements by a ``copy_``, and
    DTensor (torch 2.13) has no ``copy_`` strategy into a dim sharded over more ranks than it has rows from another
    placement (a ``DTensorOpError`` in both modes, where eager ran, with other values than plain torch's). Such a
    value is redistributed to the destination's placements instead."""
    inputs = [make_full((2, 4), seed=150), make_full((1, 4), seed=151)]
    case = DTensorCase(
        _write_into_a_row_of_an_uneven_shard,
        inputs,
        [[Shard(0)], [Replicate()]],
        requires_grad=[True, True],
        mesh=mesh_1d(),
    )
    run_case(case, jit_kwargs={"dtensor_lowering": lowering}, compare_eager=False)


def _flattened_after_a_gather(x, w, b):
    y = F.linear(x, w, b)
    y = y.redistribute(y.device_mesh, [Shard(0)]) if isinstance(y, DTensor) else y
    y = y.flatten(0)
    s = y[0].sum().item()
    return s - y, s


@pytest.mark.world_size(4)
def test_a_lowered_shard_handed_to_eager_dtensor_is_contiguous_where_its_dtensor_is():
    """Fuzz seed 10754 (4 ranks): the lowered redistribution of a linear's output to ``Shard(0)`` cut each rank's
    rows out of a gathered buffer (a non-contiguous slice); a ``.item()`` then ends the lowered segment, and eager
    DTensor's ``flatten`` of the wrapped shard (a ``view``) raised. A shard wrapped back into a DTensor whose global
    layout is contiguous is made contiguous, as eager's shards are."""
    fulls = [make_full((8, 4), seed=160), make_full((6, 4), seed=161), make_full((6,), seed=162)]
    expected, expected_number = _flattened_after_a_gather(*fulls)
    compiled = thunder.jit(_flattened_after_a_gather, dtensor_lowering=True)
    for _ in range(2):
        inputs = [
            distribute_tensor(full, mesh_1d(), [placement])
            for full, placement in zip(fulls, [Replicate(), Replicate(), Shard(0)])
        ]
        inputs[1] = DTensor.from_local(inputs[1].to_local() / 4, mesh_1d(), [Partial()])
        out, number = compiled(*inputs)
        torch.testing.assert_close(out.full_tensor(), expected)
        assert number == pytest.approx(expected_number, rel=1e-5)


def _flattened_and_unflattened(x):
    return x.flatten(0).unflatten(0, (8, 14))


@pytest.mark.world_size(2)
@LOWERING
def test_a_reshape_dtensor_places_on_the_wrong_elements_runs_replicated(lowering):
    """Fuzz seed 10924 (2 ranks), a torch DTensor bug: ``unflatten(0, (8, 14))`` of the ``_StridedShard(dim=0,
    sf=7)`` that flattening a ``Shard(1)`` ``[7, 16]`` gives is placed ``_StridedShard(dim=1, sf=7)``, which names
    other elements than each rank holds (eager DTensor's values are wrong, silently; the package's were eager's).
    A reshape of a strided shard has its placements checked at trace time by DTensor's own reassembly (the output
    spec's ``full_tensor()`` of the ranks' reshaped element ids against the input's), and where they disagree it
    runs replicated, with a warning."""
    full = torch.arange(112.0).reshape(7, 16)
    expected = _flattened_and_unflattened(full)
    eager = _flattened_and_unflattened(distribute_tensor(full, mesh_1d(), [Shard(1)]))
    assert not torch.equal(eager.full_tensor(), expected), "eager DTensor is right here: no test"
    compiled = thunder.jit(_flattened_and_unflattened, dtensor_lowering=lowering)
    HOW_OPS_RAN.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        out = compiled(distribute_tensor(full, mesh_1d(), [Shard(1)]))
    assert HOW_OPS_RAN == {"Tensor_unflatten": "replicated fallback"}, HOW_OPS_RAN
    torch.testing.assert_close(out.full_tensor(), expected)
    # the flatten before it is right (each rank's rows, in order) and is kept
    flat = thunder.jit(lambda x: x.flatten(0), dtensor_lowering=lowering)(
        distribute_tensor(full, mesh_1d(), [Shard(1)])
    )
    assert "_StridedShard" in str(flat.placements)
    torch.testing.assert_close(flat.full_tensor(), full.flatten(0))


def _write_through_a_column(x, o1, o2, o3):
    y = x.amax(dim=0).clone()
    y[:, 0:2].add_(o1)
    y = torch.cat([o2, y.transpose(0, 1)], dim=-2).transpose(0, -1).clone()
    y.select(1, 0).copy_(o3)
    return y


@pytest.mark.world_size(2)
def test_a_write_into_a_column_view_reaches_the_tensor_it_views():
    """Fuzz seed 11599 (2 ranks), a silently wrong value: the column ``y.select(1, 0)`` of a lowered (2, 3) value,
    wrapped back into a DTensor for the eager ``copy_`` that writes into it, was made contiguous at the boundary
    (as shards of contiguous DTensors are, seed 10754), so the write went into a copy and ``y`` kept its old
    column. A DTensor the alias pass hands on to a write is wrapped around the very view."""
    fulls = [make_full((5, 2, 2), seed=170), make_full((2, 2), seed=171), make_full((1, 2), seed=172)]
    fulls.append(make_full((2,), seed=173))
    expected = _write_through_a_column(*fulls)
    compiled = thunder.jit(_write_through_a_column, dtensor_lowering=True)
    for _ in range(2):
        mesh = mesh_1d()
        x, o1 = distribute_tensor(fulls[0], mesh, [Shard(0)]), distribute_tensor(fulls[1], mesh, [Shard(1)])
        o2, o3 = (DTensor.from_local(full / 2, mesh, [Partial()]) for full in fulls[2:])
        out = compiled(x, o1, o2, o3)
        torch.testing.assert_close(out.full_tensor(), expected)


def _whole_extremum(op: str) -> Callable:
    return lambda x: getattr(x * 1.0, op)()


@pytest.mark.world_size(4)
@LOWERING
@pytest.mark.parametrize("op", ["amin", "amax"])
def test_the_extremum_of_a_partial_and_sharded_input_gets_torchs_gradient(lowering, op):
    """Fuzz seed 13001 (4 ranks, a 2x2 mesh): ``amin`` / ``amax`` of a whole input placed ``(Partial(sum),
    Shard(d))``. Eager DTensor's backward gives nan everywhere (its mask compares values that are not the reduced
    ones; a rank without a match divides by a count of 0), and under thunderfx, where the extremum is an output
    of a graph, the nan reached the input's gradient. Its vjp now runs replicated, warned: torch's gradient."""
    case = DTensorCase(_whole_extremum(op), [make_full((2, 8), seed=70)], [[Partial(), Shard(0)]], mesh=mesh_2d(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)  # (warned once per op and placements)
        result = run_case(case, jit_kwargs={"dtensor_lowering": lowering}, compare_eager=False)
    backward = str(thunder.last_backward_traces(result.jitted)[-1])
    assert f"{op}_vjp" in backward and "replicated" in backward


def _extremum_read_as_a_number(x):
    y = x * 1.0
    return y * 2.0, y.amin().item()


@pytest.mark.world_size(4)
def test_the_extremum_of_a_partial_and_sharded_input_read_as_a_number_under_thunderfx():
    """The same under thunderfx: ``.item()`` ends dynamo's graph, so the extremum is a graph output whose (zero)
    cotangent runs its backward: it was nan, and so was every element of the input's gradient."""
    from thunder.dynamo import thunderfx

    mesh = mesh_2d(2)
    full = make_full((2, 8), seed=71)
    share = (mesh.get_local_rank(0) + 1) / 3  # the Partial(sum) dim: shares 1/3 and 2/3
    local = distribute_tensor(full * share, mesh, [Replicate(), Shard(0)], src_data_rank=None).to_local()
    x = DTensor.from_local(local, mesh, [Partial(), Shard(0)], shape=full.shape, stride=full.stride())
    x.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        out, number = thunderfx(_extremum_read_as_a_number)(x)
        out.sum().backward()
    assert number == pytest.approx(full.min().item())
    torch.testing.assert_close(out.full_tensor(), full * 2.0)
    torch.testing.assert_close(x.grad.full_tensor(), torch.full_like(full, 2.0))


def _where_read_as_a_number(x, o):
    y = torch.where(x > o, x, o)
    return y, y.mean().item()


@pytest.mark.world_size(4)
def test_an_output_read_only_as_a_number_leaves_the_gradients_placements_as_eagers_under_thunderfx():
    """Fuzz seed 13185 (4 ranks, a 2x2 mesh, thunderfx): ``.item()`` ends dynamo's graph, so the mean is an output
    of the graph, placed ``Partial(avg)``, that gets no gradient. The zeros made in its place were placed as the
    output, Partial, so the backward was traced again for them, and the input's gradient came out ``(S(0),
    S(1))`` against eager's ``(R, S(1))``. The zeros are now placed as the cotangent the backward was traced for."""
    from thunder.dynamo import thunderfx

    mesh, placements = mesh_2d(2), [Replicate(), Shard(1)]  # (a 1-D mesh kept eager's placements)
    full_x, full_o = make_full((6, 2), seed=72), make_full((1, 1), seed=73)
    reference = full_x.clone().requires_grad_()
    expected, expected_number = _where_read_as_a_number(reference, full_o)
    cotangent = make_full((6, 2), seed=74)
    expected.backward(cotangent)
    compiled = thunderfx(_where_read_as_a_number)
    for call in range(2):
        inputs = [distribute_tensor(full_x, mesh, placements).requires_grad_() for _ in range(2)]
        o = distribute_tensor(full_o, mesh, [Replicate(), Replicate()])
        out, number = compiled(inputs[0], o)
        eager, _ = _where_read_as_a_number(inputs[1], o)
        assert number == pytest.approx(expected_number, rel=1e-5), f"call {call}"
        torch.testing.assert_close(out.full_tensor(), expected.detach(), msg=f"call {call}")
        for y in (out, eager):
            y.backward(distribute_tensor(cotangent, mesh, y.placements))
        torch.testing.assert_close(inputs[0].grad.full_tensor(), reference.grad, msg=f"call {call}")
        assert inputs[0].grad.placements == inputs[1].grad.placements, f"call {call}"


def _written_clone_read_through_views(x, o3):
    y = x.clone()
    y.sub_(o3)
    return y.transpose(0, 1)[2:5]


def _scaled_written_clone_read_through_views(x, o2, o3):
    return _written_clone_read_through_views(x * o2, o3)


@pytest.mark.world_size(4)
@LOWERING
@pytest.mark.parametrize(
    ("fn", "shapes", "placements", "requires_grad"),
    [
        (_written_clone_read_through_views, [(3, 8)] * 2, [[Partial(), Shard(0)], [Replicate()] * 2], [False, True]),
        (
            _scaled_written_clone_read_through_views,
            [(3, 8), (8,), (3, 8)],
            [[Partial(), Shard(0)], [Replicate()] * 2, [Replicate(), Shard(1)]],
            [False, True, False],
        ),
    ],
    ids=["written", "scaled_then_written"],
)
def test_a_written_value_read_through_views_gives_eagers_gradient_placements(
    fn, shapes, placements, requires_grad, lowering
):
    """Fuzz seed 13228 (4 ranks, a 2x2 mesh): a clone written in place, then read through a transpose and a slice.
    Each step's alias update has an output nothing reads, whose zero cotangent was still a stand-in while the
    rules were traced, so the sum of cotangents of the written value kept it: the gradient came out placed as
    the zeros, ``(S(1), S(0))`` against eager's ``(R, S(0))`` (and ``(S(0), P)`` against ``(P, P)``)."""
    inputs = [make_full(shape, seed=80 + i) for i, shape in enumerate(shapes)]
    case = DTensorCase(fn, inputs, placements, requires_grad=requires_grad, mesh=mesh_2d(2))
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


def _counted_lookup(ids, table):
    return F.embedding(ids, table, padding_idx=-4, scale_grad_by_freq=True)


@pytest.mark.world_size(4)
@LOWERING
@pytest.mark.parametrize("fn", [_counted_lookup, F.embedding], ids=["counted", "plain"])
@pytest.mark.parametrize("ids_placements", [[Replicate(), Replicate()], [Replicate(), Shard(0)]], ids=["R_R", "R_S0"])
def test_a_lookup_in_a_table_sharded_over_its_vocabulary_on_both_mesh_dims(fn, ids_placements, lowering):
    """Fuzz seed 13174 (4 ranks, a 2x2 mesh): a table placed ``(S(0), S(0))``, each rank one block of its rows.
    Eager's rule masks the lookup over both mesh dims, and eager then fails (both placements share one mask
    buffer: "MaskBuffer has been materialized with conflicting data"; with sharded ids an ``IndexError``); the
    jit raised eager's error for a frequency-scaled lookup, which looks up replicated ids. The vocab-parallel
    lookup now runs over both mesh dims: plain torch's values and gradient, the gradient in the table's
    placements (the package's rule for a vocab-sharded table)."""
    inputs = [make_full((14, 4), seed=90, dtype=torch.int64, int_high=12), make_full((12, 6), seed=91)]
    placements = [ids_placements, [Shard(0), Shard(0)]]
    case = DTensorCase(fn, inputs, placements, requires_grad=[False, True], mesh=mesh_2d(2))
    result = run_case(
        case,
        jit_kwargs={"dtensor_lowering": lowering},
        compare_eager=eager_error(case) is None,
        # (sharded ids, not counted: eager's rule masks over one mesh dim, its gradient placements are eager's)
        own_grad_placements=None if fn is F.embedding and ids_placements[1].is_shard() else {1: [Shard(0), Shard(0)]},
    )
    assert "MaskBuffer" not in str(thunder.last_traces(result.jitted)[-1])


def _norm_then_branch_on_its_maximum(x, g):
    y = x.transpose(1, 0)
    if isinstance(y, DTensor):  # (plain torch on the full tensors: the value itself)
        y = y.redistribute(y.device_mesh, [Shard(2), Shard(1)])
    y = F.rms_norm(F.log_softmax(y.unflatten(1, (4, 2)), dim=3), (6,), g, eps=1e-6)
    return torch.tanh(y) if y.amax() > 0.5 else -y


@pytest.mark.world_size(4)
def test_a_backward_for_other_cotangent_placements_keeps_the_forward_prims_that_ran_unlowered():
    """Fuzz seed 14325 (4 ranks, a 2x2 mesh, thunderfx): the bool read breaks dynamo's graph, and the first graph's
    backward, traced for a cotangent ``(R, S(1))``, gets ``(S(0), S(1))``. Traced again for it, the ``rms_norm`` its
    compile had kept as the eager op was lowered: not the forward that ran, so the cotangent was redistributed
    (warned) and the norm weight's gradient placed ``(R, P)`` against eager's ``(P, P)``. The prims the forward
    kept are kept again: eager's placements, no warning."""
    from thunder_dtensor.guards import CotangentPlacementWarning

    from thunder.dynamo import thunderfx

    mesh = mesh_2d(2)
    full_x, full_g = make_full((8, 2, 6), seed=100), make_full((6,), seed=101)
    cotangent = make_full((2, 4, 2, 6), seed=102)
    references = [full_x.clone().requires_grad_(), full_g.clone().requires_grad_()]
    expected = _norm_then_branch_on_its_maximum(*references)
    expected.backward(cotangent)

    def inputs() -> list:
        share = (mesh.get_local_rank(0) + 1) / 3  # the Partial(sum) dim: shares 1/3 and 2/3
        local = distribute_tensor(full_g * share, mesh, [Replicate(), Shard(0)], src_data_rank=None).to_local()
        g = DTensor.from_local(local, mesh, [Partial(), Shard(0)], shape=full_g.shape, stride=full_g.stride())
        return [distribute_tensor(full_x, mesh, [Replicate(), Replicate()]).requires_grad_(), g.requires_grad_()]

    compiled, ours, eagers = thunderfx(_norm_then_branch_on_its_maximum), inputs(), inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CotangentPlacementWarning)
        out = compiled(*ours)
        eager = _norm_then_branch_on_its_maximum(*eagers)
        torch.testing.assert_close(out.full_tensor(), expected.detach())
        for y in (out, eager):
            y.backward(distribute_tensor(cotangent, mesh, [Replicate() if p.is_partial() else p for p in y.placements]))
    for i, (mine, theirs, reference) in enumerate(zip(ours, eagers, references)):
        torch.testing.assert_close(mine.grad.full_tensor(), reference.grad, msg=f"grad {i}")
        assert mine.grad.placements == theirs.grad.placements, f"grad {i}"


def _where_over_a_transposed_view(x, o3):
    y = x.unflatten(1, (2, 4)).transpose(2, -2)
    y = torch.where(y > y.mean().item(), y, 0.5 * y)
    return (2.0 - y) @ o3


def _transposed_view_case(requires_grad: bool) -> DTensorCase:
    inputs = [make_full((2, 8), seed=110), make_full((2, 3), seed=111)]
    placements = [[Partial(), Shard(0)], [Partial(), Replicate()]]
    return DTensorCase(
        _where_over_a_transposed_view, inputs, placements, requires_grad=[requires_grad, False], mesh=mesh_2d(2)
    )


@pytest.mark.world_size(4)
def test_an_eager_result_is_read_in_the_layout_its_spec_gives():
    """Fuzz seed 13001 (a 2x2 mesh): the comparison with a number read from the data runs as the eager op (not
    lowered), and its result is transposed like its input. The lowering read it contiguous, so the ``where``
    after it recorded a contiguous global stride where eager's is transposed, and the matmul's ``reshape``
    decomposed otherwise: output ``(P(sum), R)`` against eager's ``(P(sum), S(0))``. An eager result is now read
    dense in the layout its spec's global stride gives (copied there only if it is not)."""
    run_case(_transposed_view_case(requires_grad=False))


@pytest.mark.world_size(4)
def test_eager_dtensors_own_backward_error_names_the_op_and_its_placements():
    """Fuzz seeds 13001 and 14542 with the lowering off: eager DTensor's own backward of ``unflatten`` raises torch's
    ``view size is not compatible`` (eager's autograd too), and the backward re-raised it bare, naming no op. It
    is now a ``DTensorOpError`` that names the op's backward, the placements and a hint; with the lowering the
    program is differentiated on local shards and gives plain torch's gradient."""
    case = _transposed_view_case(requires_grad=True)
    error = eager_error(case)
    if error is None:  # a torch release fixed eager's backward: then thunder runs it as eager does
        run_case(case, jit_kwargs={"dtensor_lowering": False})
    else:
        assert "view size is not compatible" in str(error), error
        result = run_case(
            case, jit_kwargs={"dtensor_lowering": False}, expect=raises(DTensorOpError, "Tensor_unflatten backward")
        )
        assert "view size is not compatible" in str(result.error) and "hint:" in str(result.error)
    run_case(case, compare_eager=error is None)


def _linear_after_a_mean_read_as_a_number(x, w2, b3, o4):
    y = (x * 2.0).flatten(1, 2).mT
    s1 = y.abs().mean().item()
    y = F.linear(y, w2, b3)[::2]
    return F.log_softmax(torch.bmm(y, o4), dim=2), s1


def _placed(full: torch.Tensor, mesh, placements: list) -> DTensor:
    """``full`` placed on the 2x2 mesh: a ``Partial(sum)`` mesh dim holds shares 1/3 and 2/3 of it."""
    share = 1.0
    for d, p in enumerate(placements):
        if p.is_partial():
            share *= (mesh.get_local_rank(d) + 1) / 3
    kept = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(full * share, mesh, kept, src_data_rank=None).to_local()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


@pytest.mark.world_size(4)
def test_a_gradient_autograd_did_not_give_adds_no_term_to_a_backward_traced_again():
    """Fuzz seed 14347 (4 ranks, a 2x2 mesh, thunderfx): the mean ``.item()`` reads is an output of the first graph
    that gets no gradient, and the next graph's ``linear`` hands the first graph's backward a cotangent placed
    ``(S(2), P(sum))`` where it was traced for ``(R, S(0))``, so the backward is traced again. The zeros standing in
    for the mean's gradient still ran ``abs().mean()``'s backward, and summing that sharded zero into the Partial
    gradient reduce-scattered it: ``x.grad`` placed ``(S(1), S(0))`` against eager's ``(S(1), P(sum))``. Traced
    again, what the backward computes from such zeros alone is left out, as eager never runs it."""
    from thunder.dynamo import thunderfx

    mesh = mesh_2d(2)
    fulls = [
        make_full(s, seed=120 + i, dtype=torch.float64) for i, s in enumerate([(5, 4, 4, 6), (4, 16), (4,), (3, 4, 8)])
    ]
    placements = [[Replicate(), Shard(0)], [Shard(1), Partial()], [Partial(), Partial()], [Shard(1), Replicate()]]
    requires_grad = [True, False, True, True]
    cotangent = make_full((3, 6, 8), seed=130, dtype=torch.float64)
    references = [f.clone().requires_grad_(rg) for f, rg in zip(fulls, requires_grad)]
    expected, expected_number = _linear_after_a_mean_read_as_a_number(*references)
    expected.backward(cotangent)

    def inputs() -> list:
        return [_placed(f, mesh, p).requires_grad_(rg) for f, p, rg in zip(fulls, placements, requires_grad)]

    compiled, ours, eagers = thunderfx(_linear_after_a_mean_read_as_a_number), inputs(), inputs()
    out, number = compiled(*ours)
    eager, _ = _linear_after_a_mean_read_as_a_number(*eagers)
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    assert number == pytest.approx(expected_number)
    assert out.placements == eager.placements
    for y in (out, eager):
        y.backward(distribute_tensor(cotangent, mesh, [Replicate() if p.is_partial() else p for p in y.placements]))
    for i, (mine, theirs, reference) in enumerate(zip(ours, eagers, references)):
        if reference.grad is None:
            assert mine.grad is None and theirs.grad is None, f"grad {i}"
            continue
        torch.testing.assert_close(mine.grad.full_tensor(), reference.grad, msg=f"grad {i}")
        assert mine.grad.placements == theirs.grad.placements, f"grad {i}: {mine.grad.placements} vs eager's"


def _weight_times_a_concatenation(x, o1, o2):
    return o2 @ torch.cat([o1, x.expand(3, 3, 2, 12)], dim=1)


@pytest.mark.world_size(4)
@LOWERING
def test_a_lowered_op_decomposes_as_eager_does_for_inputs_that_require_grad(lowering):
    """Fuzz seed 15420 (a 2x2 mesh): torch's ``matmul`` of a 2-D weight that requires grad and a 4-D input folds the
    input into a matrix, even under no_grad, and otherwise broadcasts a batched matmul; eager's placements follow
    (``(S(2), S(0))`` here). The lowering traced the forward op on inputs that did not require grad, so its
    decomposition was the other one: ``(S(3), P(sum))``. The forward is now traced with the inputs' requires_grad.
    (Eager's backward of it raises: the forward only is compared.)"""
    mesh = mesh_2d(2)
    fulls = [make_full((3, 2, 12), seed=140), make_full((3, 2, 2, 12), seed=141), make_full((4, 2), seed=142)]
    placements = [[Shard(2), Replicate()], [Replicate(), Shard(3)], [Shard(0), Shard(1)]]

    def inputs() -> list:
        x, o1, o2 = (distribute_tensor(f, mesh, p) for f, p in zip(fulls, placements))
        return [x, o1, o2.requires_grad_()]

    expected = _weight_times_a_concatenation(*fulls)
    eager = _weight_times_a_concatenation(*inputs())
    out = thunder.jit(_weight_times_a_concatenation, dtensor_lowering=lowering)(*inputs())
    torch.testing.assert_close(out.full_tensor(), expected)
    assert out.placements == eager.placements, f"{out.placements} vs eager's {eager.placements}"


def _norms_around_a_maximum(x, g1, b2, w3, b4):
    y = F.rms_norm(x, (7,), eps=1e-6).amax(dim=(0, 1), keepdim=False)
    y = F.layer_norm(torch.cat(y.chunk(4, dim=0)[::-1], dim=0), (7,), g1, b2)
    return F.linear(y, w3, b4).split(6, dim=-1)[1]


@pytest.mark.world_size(4)
@LOWERING
def test_a_maximum_over_a_dim_some_ranks_hold_none_of(lowering):
    """Fuzz seed 15429 (a 2x2 mesh): ``x``'s dim 1 has 2 elements over 4 shards, so two ranks hold none of it. Eager
    DTensor's ``amax`` over it raises ``IndexError`` on those ranks only, while the others wait in a collective: the
    fuzzer's run hung (its generator no longer draws such a maximum). thunder runs the program on every rank with
    plain torch's values and gradients (eager cannot be compared)."""
    inputs = [make_full(s, seed=150 + i) for i, s in enumerate([(3, 2, 7), (7,), (7,), (12, 7), (12,)])]
    placements = [[Shard(1), Shard(1)], [Shard(0), Shard(0)], [Shard(0), Shard(0)], [Replicate(), Shard(1)]]
    case = DTensorCase(_norms_around_a_maximum, inputs, [*placements, [Shard(0), Replicate()]], mesh=mesh_2d(2))
    run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})


def _counted_lookup_then_linear(x, i1, w2, w3, b4):
    y = F.embedding(i1, w2, padding_idx=-2, scale_grad_by_freq=True)
    return F.linear(y, w3, b4).view(-1)[0:13]


@pytest.mark.world_size(2)
@LOWERING
def test_a_partial_gradient_of_a_vocab_parallel_lookup_goes_back_replicated(lowering):
    """Fuzz seed 16465 (2 ranks; 15446 and 14551 on a 2x2 mesh are the same): a frequency-scaled lookup of sharded
    ids in a vocab-sharded table is made on replicated ids (a ``MaskPartial`` result) and redistributed to eager's
    placements. The ``linear`` after it gives that redistribution a ``Partial(sum)`` gradient, and its backward
    tried to make it the input's ``MaskPartial(sum)``, which no redistribution does: a ``DTensorOpError`` where
    eager runs. A Partial input's gradient is now Replicate where the gradient is not that same Partial."""
    inputs = [
        make_full((7, 7), seed=160),
        make_full((7,), seed=161, dtype=torch.int64, int_high=8),
        make_full((8, 7), seed=162),
        make_full((2, 7), seed=163),
        make_full((2,), seed=164),
    ]
    placements = [[Partial()], [Shard(0)], [Shard(0)], [Shard(0)], [Shard(0)]]
    case = DTensorCase(_counted_lookup_then_linear, inputs, placements, requires_grad=[True, False, True, True, True])
    # the vocab-sharded table's gradient stays Shard(0) by design (eager's is a pending sum of it)
    run_case(case, jit_kwargs={"dtensor_lowering": lowering}, own_grad_placements={2: [Shard(0)]})


def _attention_with_a_mask(x, mask):
    return F.scaled_dot_product_attention(x, x, x, attn_mask=mask, scale=0.25)


@pytest.mark.world_size(2)
@LOWERING
def test_attention_with_a_mask_sharded_otherwise_than_q_is_compared_by_values(lowering):
    """Fuzz seed 16372: attention on replicated q, k, v with a mask sharded over its size-1 head dim. thunder gathers
    the mask and attends on Replicate (the rule for mixed layouts, docs/architecture.md); eager derives a strategy of
    its own (the mask's gradient Replicate, ours Shard(1) as the mask is). The fuzzer took the layout for a local one
    because it looked at q, k and v only, and reported the placements; it now asks the rule's own predicate, mask
    included, and compares values only there, as for every other mixed layout."""
    from thunder_dtensor.testing.fuzz import _EagerDerivations

    x_full = make_full((2, 2, 6, 4), seed=170)
    for mask_shape, mask_placements, derived in (
        ((2, 1, 6, 6), [Shard(1)], True),
        ((2, 1, 6, 6), [Shard(0)], True),
        ((6, 6), [Replicate()], False),
    ):
        fulls = [x_full, make_full(mask_shape, seed=171)]
        case = DTensorCase(_attention_with_a_mask, fulls, [[Replicate()], mask_placements])
        run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})
        layouts = _EagerDerivations()
        x, mask = (
            distribute_tensor(f, mesh_1d(), p).requires_grad_() for f, p in zip(fulls, [[Replicate()], mask_placements])
        )
        with layouts:
            out = _attention_with_a_mask(x, mask)
        assert layouts.derived == derived, mask_placements
        # a derived layout attends on replicated inputs in the fuzzer's eager run (DTensor's CPU strategy search for
        # such layouts ran for minutes: seeds 17222, 18367, 18489); the values are eager's own either way
        # (eager's own strategy places the batch-sharded mask's output S(0))
        assert not derived or all(p.is_replicate() for p in out.placements), out.placements
        torch.testing.assert_close(out.full_tensor(), _attention_with_a_mask(*fulls))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_thunderfx_attention_of_a_replicated_q_to_sequence_sharded_keys(is_causal):
    """Fuzz seed 17115: under thunderfx, attention of a replicated q (``o * q``) to keys sharded along the sequence
    (``S(2)``) and replicated values. DTensor's sharding rule the package gives the fused CPU kernel (only while
    dynamo traces) offered every layout thunder attends in, sequence shards included, and DTensor chose the free one:
    q and v sliced to ``S(2)``, the output ``S(2)``. thunder's rule gathers such a call (``R``), so the splitter
    handed the node to eager, which attended each rank's own keys only: wrong values, no error. The rule now offers
    the layout thunder's plan takes (here Replicate): the whole graph stays thunder's, with plain torch's values."""
    from thunder.dynamo import thunderfx

    def fn(q, o, k, v):
        return F.scaled_dot_product_attention(o * q, k, v, is_causal=is_causal)

    mesh = mesh_1d()
    fulls = [
        make_full(shape, seed=180 + i) for i, shape in enumerate([(5, 4, 2, 2), (4, 2, 2), (5, 4, 2, 2), (5, 4, 2, 2)])
    ]
    placements = [[Replicate()], [Replicate()], [Shard(2)], [Replicate()]]
    inputs = [distribute_tensor(f, mesh, p).requires_grad_() for f, p in zip(fulls, placements)]
    compiled = thunderfx(fn)
    out = compiled(*inputs)
    references = [f.clone().requires_grad_() for f in fulls]
    expected = fn(*references)
    torch.testing.assert_close(out.full_tensor(), expected)
    (info,) = compiled._backend.subgraph_infos
    assert [name for name, _ in info.split_graph_module.named_children()] == ["thunder_0"], info.split_reasons
    cotangent = make_full(tuple(expected.shape), seed=189)
    expected.backward(cotangent)
    out.backward(distribute_tensor(cotangent, mesh, out.placements))
    for x, reference in zip(inputs, references):
        torch.testing.assert_close(x.grad.full_tensor(), reference.grad)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("mask_placements", [[Replicate()], [Shard(0)]], ids=["mask_R", "mask_S0"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_thunderfx_attention_with_a_mask(mask_placements, requires_grad):
    """Fuzz seed 18595 (4 ranks): under thunderfx, attention with an ``attn_mask`` on inputs that do not require grad
    (inference: torch picks CPU's fused kernel) raised in dynamo's fake run, whatever the placements: the sharding
    rule the package gives that kernel named placements for q, k and v only, and DTensor counts the mask among its
    inputs ("input_specs(3) != strategies(4: 3 args + 1 kwargs)"). The fuzzer then ran ``torch.compile`` alone on
    the program to tell whose failure it was, and its attention strategy search stalled the run. The rule now
    places the mask too (replicated, as thunder attends with a mask)."""
    from thunder.dynamo import thunderfx

    mesh = mesh_1d()
    fulls = [make_full((2, 2, 6, 4), seed=230), make_full((2, 1, 6, 6), seed=231)]
    placements = [[Replicate()], mask_placements]
    inputs = [distribute_tensor(f, mesh, p).requires_grad_(requires_grad) for f, p in zip(fulls, placements)]
    out = thunderfx(_attention_with_a_mask)(*inputs)
    references = [f.clone().requires_grad_(requires_grad) for f in fulls]
    expected = _attention_with_a_mask(*references)
    torch.testing.assert_close(out.full_tensor(), expected)
    if not requires_grad:
        return
    cotangent = make_full(tuple(expected.shape), seed=232)
    expected.backward(cotangent)
    out.backward(distribute_tensor(cotangent, mesh, out.placements))
    for x, reference in zip(inputs, references):
        torch.testing.assert_close(x.grad.full_tensor(), reference.grad)


def _weight_times_a_transposed_value(x, o):
    return (o @ x.transpose(2, 1).mT.mT).flatten(0, 1)


@pytest.mark.world_size(2)
@LOWERING
@pytest.mark.parametrize("x_placements", [[Partial()], [Replicate()], [Shard(0)]], ids=["P", "R", "S0"])
def test_a_matmul_of_a_transposed_value_decomposes_as_eager_does(x_placements, lowering, monkeypatch):
    """Fuzz seed 17166: ``o @ x.transpose(2, 1)`` with inputs that require grad. Eager's matmul folds the batch of the
    transposed value (its ``.mT`` is a contiguous view) and, for a Partial ``x``, reduces it: Replicate. The fake run
    that decides the prim's spec stood in a contiguous local shard under the transposed spec, DTensor's view rule
    refused the fold, and the op was rewritten (decomposed): ``Partial(sum)``, in both modes. Stand-ins are now laid
    out as eager's shards are (dense in the order of the global stride)."""
    inputs = [make_full((2, 7, 4), seed=190), make_full((8, 4), seed=191)]
    case = DTensorCase(_weight_times_a_transposed_value, inputs, [x_placements, [Replicate()]])
    import thunder_dtensor.ops.no_rule as no_rule

    rewrites = recorded_calls(monkeypatch, no_rule, "_record")
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})
    assert not rewrites, f"rewritten: {rewrites}"


def _softmax_reshaped_times_a_sharded_weight(x, g):
    return F.softmax(x, dim=3).reshape(2, 6, -1).unflatten(2, (6, 4)) * g


@pytest.mark.world_size(2)
@LOWERING
@pytest.mark.parametrize("x_placements", [[Replicate()], [Shard(3)]], ids=["R", "S3"])
def test_the_gradient_of_a_reshape_dtensor_misplaces_is_computed_replicated(x_placements, lowering):
    """Fuzz seed 17382: the cotangent ``S(3)`` of ``unflatten(2, (6, 4))`` goes back through the reshapes to ``x``'s
    shape, where DTensor places it ``_StridedShard(3, sf=6)``, naming other elements than each rank holds (a torch
    bug, the one a forward reshape is checked for): the softmax's backward then read the wrong elements, and every
    gradient of ``x`` was wrong, in eager and in both modes. Such a reshape's backward is now distrusted and runs
    replicated (compared with plain torch only: eager's gradient is wrong)."""
    inputs = [make_full((2, 6, 2, 12), seed=200), make_full((4,), seed=201)]
    case = DTensorCase(_softmax_reshaped_times_a_sharded_weight, inputs, [x_placements, [Shard(0)]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})


def _two_reshapes(x):
    return x.reshape(96).reshape(-1, 48)


def _row_means_of_reshapes(x):
    return _two_reshapes(x)[1:].mean(dim=-1, dtype=torch.float64).tanh()


@pytest.mark.world_size(2)
@LOWERING
def test_a_reshape_whose_misplacement_a_mean_hides_runs_replicated(lowering):
    """Fuzz seed 17372: ``reshape(96).reshape(-1, 48)`` of a ``[8, 12]`` placed ``S(1)``: the second reshape is placed
    ``_StridedShard(1, sf=8)``, whose ``full_tensor()`` permutes each row (a torch bug). thunder runs it replicated;
    the program's row means hid eager's error, so the fuzzer took eager's later placements for the reference (its
    gradient ``Replicate``, thunder's ``x``'s own ``S(1)``) and reported a mismatch. The fuzzer now notes an eager
    reshape that misplaces and compares values only after it (``test_the_fuzzer_notes_an_eager_reshape_that_...``)."""
    full = torch.arange(96.0, dtype=torch.float64).reshape(8, 12)
    eager = _two_reshapes(distribute_tensor(full, mesh_1d(), [Shard(1)]))
    assert not torch.equal(eager.full_tensor(), _two_reshapes(full)), "eager DTensor is right here: no test"
    HOW_OPS_RAN.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        out = thunder.jit(_two_reshapes, dtensor_lowering=lowering)(distribute_tensor(full, mesh_1d(), [Shard(1)]))
        assert HOW_OPS_RAN == {"Tensor_reshape": "replicated fallback"}, HOW_OPS_RAN
        torch.testing.assert_close(out.full_tensor(), _two_reshapes(full))
        case = DTensorCase(_row_means_of_reshapes, [make_full((8, 12), seed=210, dtype=torch.float64)], [[Shard(1)]])
        result = run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})
    assert tuple(result.thunder_grads[0].placements) == (Shard(1),), result.thunder_grads[0].placements


def test_the_fuzzer_notes_an_eager_reshape_that_misplaces():
    """The fuzzer's eager watch marks a run whose reshape DTensor misplaces (its placements are then no reference),
    and leaves a right one unmarked (the flatten before it, whose elements stay where they are)."""
    from thunder_dtensor.testing.fuzz import _EagerDerivations

    for fn, misplaced in ((_two_reshapes, True), (lambda x: x.reshape(96), False)):
        watch = _EagerDerivations()
        with watch:
            fn(distribute_tensor(torch.arange(96.0).reshape(8, 12), mesh_1d(), [Shard(1)]))
        assert watch.derived == misplaced


def _flattened_reshaped_chunks_times(x, o):
    y = x.flatten(0).reshape(4, 16).unflatten(-1, (8, 2))
    return torch.bmm(torch.cat(y.chunk(2, dim=-1)[::-1], dim=-1), o)


@pytest.mark.world_size(4)
@LOWERING
def test_a_reshape_dtensor_misplaces_on_a_2d_mesh_runs_replicated(lowering):
    """Fuzz seed 18148 (4 ranks, 2x2 mesh): ``x.flatten(0).reshape(4, 16)`` of a ``[8, 8]`` placed ``(S(0), S(1))``.
    The flatten gives ``(S(0), _StridedShard(0, sf=4))``, right; the reshape is placed ``(S(0), _StridedShard(1,
    sf=4))``, which names other elements than each rank holds (a torch bug): half the ``bmm``'s values and every
    gradient of its other operand were wrong, in eager and both modes. The check of a reshape's placements was for
    1-D meshes only; DTensor's reassembly, replayed, serves any mesh."""
    mesh = mesh_2d()
    full = torch.arange(64.0).reshape(8, 8)
    eager = distribute_tensor(full, mesh, [Shard(0), Shard(1)]).flatten(0).reshape(4, 16)
    assert not torch.equal(eager.full_tensor(), full.reshape(4, 16)), "eager DTensor is right here: no test"
    fulls = [make_full((8, 8), seed=220), make_full((4, 2, 6), seed=221)]
    case = DTensorCase(
        _flattened_reshaped_chunks_times, fulls, [[Shard(0), Shard(1)], [Shard(1), Replicate()]], mesh=mesh
    )
    HOW_OPS_RAN.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})
    assert HOW_OPS_RAN.get("Tensor_reshape") == "replicated fallback", HOW_OPS_RAN


def _plus_a_lookup(x, ids, table):
    return x + F.embedding(ids, table, padding_idx=3)


@pytest.mark.world_size(4)
@LOWERING
def test_a_lookup_in_a_table_sharded_both_ways_with_ids_sharded_where_it_is_column_sharded(lowering):
    """Fuzz seed 18615 (2x2 mesh): ids ``(S(0), R)``, a table ``(S(1), S(0))`` (its embedding dim sharded over the
    first mesh dim, its vocabulary over the second). Eager's rule gathers the ids over the first mesh dim, keeps the
    table's column shards and masks over the second, but its mask is the ungathered ids': the reduction of the masked
    sum raised an IndexError, in eager and both modes (thunder ran eager's rule). The package's explicit masked lookup
    now covers a table eager keeps column-sharded on another mesh dim (the ids gathered there): plain torch's values
    and gradients."""
    mesh = mesh_2d()
    fulls = [
        make_full((4, 48), seed=240),
        make_full((4,), seed=241, dtype=torch.int64, int_high=6),
        make_full((6, 48), seed=242),
    ]
    placements = [[Shard(1), Shard(1)], [Shard(0), Replicate()], [Shard(1), Shard(0)]]
    case = DTensorCase(_plus_a_lookup, fulls, placements, requires_grad=[True, False, True], mesh=mesh)
    run_case(case, compare_eager=eager_error(case) is None, jit_kwargs={"dtensor_lowering": lowering})


def _softmax_then_a_branch_then_an_inplace_scale(x):
    y = F.softmax(x * (x > -0.3).to(x.dtype), dim=1).transpose(0, 1).clone()
    y = y - 1.0 if (y.sum() < 0).item() else torch.tanh(y)
    y = y.clone()
    y.mul_(2.0)
    return y


@pytest.mark.world_size(4)
def test_a_joint_kept_on_every_rank_emits_no_backward_on_any():
    """Fuzz seed 18997 (2x2 mesh, thunderfx; the run hung): a ``[3, 16]`` placed ``(S(1), Partial())``, so uneven
    shards after the transpose. In the graph after the ``.item()`` break, one rank could not lower the ``clone``'s
    snapshot (an in-place copy into its input) and another could; the ranks agreed to keep it, and the lowering
    restored its state, but not the joint's backward the second rank had queued: that rank later lowered the
    backward of the discarded forward while the first ran the eager one, and their trace-time agreements no longer
    paired up. The restore now includes the queued backwards."""
    from thunder.dynamo import thunderfx

    mesh = mesh_2d()
    full = make_full((3, 16), seed=250).requires_grad_()
    share = (mesh.get_local_rank(1) + 1) / 3  # the Partial mesh dim's two shares of the value: 1/3 and 2/3
    local = distribute_tensor(full.detach() * share, mesh, [Shard(1), Replicate()], src_data_rank=None).to_local()
    x = DTensor.from_local(local, mesh, [Shard(1), Partial()], shape=full.shape, stride=full.stride())
    x = x.detach().requires_grad_()
    expected = _softmax_then_a_branch_then_an_inplace_scale(full)
    out = thunderfx(_softmax_then_a_branch_then_an_inplace_scale)(x)
    torch.testing.assert_close(out.full_tensor(), expected)
    cotangent = make_full(tuple(expected.shape), seed=251)
    expected.backward(cotangent)
    out.backward(distribute_tensor(cotangent, mesh, [Replicate(), Replicate()]).redistribute(mesh, out.placements))
    torch.testing.assert_close(x.grad.full_tensor(), full.grad)


def _redistributed_to_rows_then_flattened(x):
    return x.redistribute(x.device_mesh, [Shard(0)]).flatten(0)


@pytest.mark.world_size(2)
def test_an_eager_op_raising_as_the_program_runs_names_the_op_and_placements():
    """Fuzz seed 19425: ``flatten`` of a ``[8, 4, 3]`` redistributed from ``S(2)`` to ``S(0)``. gloo has no
    all-to-all, and the fallback leaves each rank a shard that cannot be viewed: eager DTensor's ``flatten`` raises
    "view size is not compatible", and so did the eager prims' program as it ran (the trace's fake run sees specs,
    not the shards' strides), with torch's message alone. It now names the op, the placements and a hint; the
    lowering runs the program on local shards, with plain torch's values."""
    mesh = mesh_1d()
    full = torch.arange(96.0).reshape(8, 4, 3)
    x = distribute_tensor(full, mesh, [Shard(2)])
    out = thunder.jit(_redistributed_to_rows_then_flattened, dtensor_lowering=True)(x)
    assert torch.equal(out.full_tensor(), full.flatten(0))
    try:
        _redistributed_to_rows_then_flattened(x)
    except RuntimeError as eager:
        with pytest.raises(DTensorOpError) as error:
            thunder.jit(_redistributed_to_rows_then_flattened, dtensor_lowering=False)(x)
        message = str(error.value)
        assert message.startswith("dtensor_Tensor_flatten_prim (eager DTensor, as the program ran)"), message
        assert str(eager) in message and "placements=(Shard(dim=0),)" in message and "lowering" in error.value.hint
    else:  # a torch whose eager DTensor runs it
        out = thunder.jit(_redistributed_to_rows_then_flattened, dtensor_lowering=False)(x)
        assert torch.equal(out.full_tensor(), full.flatten(0))


def _select_unflatten_transpose_matmul_norm(x, o1, o2, g3, b4):
    y = x[6].unflatten(0, (2, 2)).transpose(0, -1) @ o1
    return F.layer_norm(torch.cat([y[1], o2], dim=0), (5,), g3, b4)


@pytest.mark.world_size(4)
@LOWERING
def test_a_reshape_dtensor_redistributes_first_is_not_taken_for_a_misplaced_one(lowering):
    """Fuzz seed 19376 (2x2 mesh): the ``unflatten``'s cotangent, ``[2, 2]`` placed ``(S(0), Partial())`` with a
    transposed stride, goes back to ``[4]`` placed ``(S(0), _StridedShard(0, sf=1))``: DTensor reduce-scatters the
    Partial first, which is right. The check of a reshape's placements replayed a local reshape alone, read the
    redistribution as a misplacement and ran the gradient replicated: ``x.grad`` placed ``(R, R)`` against eager's
    ``(S(1), P(sum))``. Eager's own reshape is replayed where it redistributes."""
    mesh = mesh_2d()
    shapes = [(8, 4), (2, 2), (3,), (5,), (5,)]
    fulls = [make_full(shape, seed=260 + i) for i, shape in enumerate(shapes)]
    placements = [
        [Replicate(), Shard(0)],
        [Shard(0), Shard(1)],
        [Replicate(), Shard(0)],
        [Replicate(), Shard(0)],
        [Shard(0), Replicate()],
    ]
    case = DTensorCase(_select_unflatten_transpose_matmul_norm, fulls, placements, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedFallbackWarning)
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})


def _transposed_self_attention(x):
    y = x.mT
    return F.scaled_dot_product_attention(y, y, y)


@pytest.mark.world_size(2)
@LOWERING
def test_attention_of_a_transposed_sequence_sharded_value(lowering):
    """Fuzz seed 19523: ``x.mT`` of a ``[8, 2, 2, 8]`` placed ``S(3)`` is sequence-sharded, so it attends by the
    ring (k / v gathered), which calls the CPU fused kernel directly: that kernel assumes a unit stride in the last
    dim, which ``F.scaled_dot_product_attention`` checks and the transposed shard has not. Values and gradients were
    wrong in both modes, silently; eager was right."""
    case = DTensorCase(_transposed_self_attention, [make_full((8, 2, 2, 8), seed=270)], [[Shard(3)]])
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})


@pytest.mark.world_size(2)
@LOWERING
def test_a_gradient_nobody_reads_leaves_the_matmul_backward_as_eager_runs_it(lowering):
    """Fuzz seed 20757: ``o @ x`` with ``o`` not requiring grad, its cotangent placed ``S(0)`` over an uneven batch
    (3 rows on 2 ranks). Asked for ``o``'s gradient too, torch folds the batch into one matmul, whose backward
    DTensor cannot flatten: the vjp ran replicated (with a warning), and ``x.grad`` was placed ``Partial`` or as
    ``x`` where eager's is ``S(0)``. Each vjp now asks for the gradients read later only, as eager's autograd."""

    def fn(o: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (o @ x) * g

    inputs = [make_full((6, 4), seed=40), make_full((3, 4, 4), seed=41), make_full((3, 6, 4), seed=42)]
    placements = [[Shard(0)], [Shard(2)], [Shard(0)]]
    case = DTensorCase(fn, inputs, placements, requires_grad=[False, True, False], mesh=mesh_1d())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedFallbackWarning)
        run_case(case, jit_kwargs={"dtensor_lowering": lowering})


def _linear_of_an_expanded_activation(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(y.expand(-1, -1, 4), w)


@pytest.mark.world_size(2)
@LOWERING
def test_a_linear_of_an_expanded_partial_activation_is_placed_as_eager_places_it(lowering):
    """Fuzz seed 19748 (4 ranks; here its 1-D form): ``F.linear`` of a value expanded along its last dim, placed
    ``Partial(avg)``, with a ``Partial(sum)`` weight. Eager's matmul folds the batch into one ``mm`` and reduces
    the smaller weight: ``Partial(avg)``. The lowering traced DTensor's dispatch under the Python dispatcher, whose
    matmul decomposition does not fold a value whose last dim is expanded: a broadcast ``bmm`` whose reduced
    activation gave ``Partial(sum)`` (values right)."""
    inputs = [make_full((4, 5, 1), seed=280), make_full((12, 4), seed=281)]
    placements = [[Partial("avg")], [Partial()]]
    # (a weight that requires grad makes both decompositions fold)
    case = DTensorCase(
        _linear_of_an_expanded_activation, inputs, placements, requires_grad=[False, False], mesh=mesh_1d()
    )
    run_case(case, jit_kwargs={"dtensor_lowering": lowering})
