"""Differential fuzzing: a fixed budget of random DTensor programs at world sizes 2 and 4.

Each seed's program (``thunder_dtensor/testing/fuzz.py``) runs as plain torch, eager DTensor and under
``thunder.jit`` with the lowering on and off (and thunderfx, for programs that read values into Python), each
compiled function called on two data sets; any difference fails the test with the smallest reproducer of each
distinct failure. ``make fuzz`` (``scripts/fuzz.py``) runs many more seeds.
"""

import dataclasses

import thunder_dtensor.testing.fuzz as fuzz_module
from thunder_dtensor.testing import mesh_1d, world_size
from thunder_dtensor.testing.fuzz import (
    InputSpec,
    Program,
    RanksDisagree,
    Step,
    _execute,
    fuzz,
    generate_program,
    mesh_shape_for,
    run_program,
)

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

#: seeds per world size (the 4-rank run has 2-D meshes too): about 15 s at 2 ranks and 9 s at 4 on two otherwise
#: idle CPU cores, the suite's 15-minute budget's share; `make fuzz` runs 300 per world size, and each stop runs
#: several hundred more (docs/architecture.md, "Fuzzing"). Chosen so that every kind in REQUIRED_KINDS is drawn
#: (test_the_budget_draws_each_kind_of_step) with few thunderfx compiles (about two programs' time each).
SEEDS = {2: range(0, 16), 4: [0, 1, 9]}

#: step kinds the budget must run, each in some program of SEEDS at either world size: values read from the data
#: (``.item()``, a number into a later op, a comparison into ``torch.where``, Python ``if`` on a tensor) and ops
#: with the keywords of the dedicated rules
REQUIRED_KINDS: tuple[frozenset[str], ...] = tuple(
    map(
        frozenset,
        (
            {"item"},
            {"number-op"},
            {"where"},
            {"if"},
            {"embedding"},
            {"cross_entropy", "nll_loss"},
            {"dropout"},
            {"softmax-dtype", "sum-dtype"},
        ),
    )
)
#: keywords the budget's programs must pass (in some program's source)
REQUIRED_KEYWORDS = ("padding_idx=", "ignore_index=", "reduction=")


#: open bugs this budget finds, by (world size, seed) -> a piece of the failure's text. Strict: each must still
#: fail this way (a fix removes its entry). Listed with their reproducers in docs/architecture.md, "Fuzzing".
KNOWN_OPEN: dict[tuple[int, int], str] = {}


#: seeds drawn with in-place writes into views at a raised rate (``view_writes``, which the budget above leaves at
#: 0 so that its programs stay as they were): each program writes into a view (slice, narrow, select, transpose)
#: with mul_, add_, copy_, index_put_ or masked_fill_; about 25 s at 2 ranks
VIEW_WRITE_SEEDS, VIEW_WRITES = [1, 2, 3, 5, 9, 10, 12, 13, 15, 16], 20.0
VIEW_WRITE_OPS = ("mul_", "add_", "copy_", "index_put_", "masked_fill_")


@pytest.mark.world_size(2, 4)
def test_fuzzed_programs_match_torch_and_eager():
    _assert_no_failures_of_ours(fuzz(SEEDS[world_size()], mesh="both"), KNOWN_OPEN)


@pytest.mark.world_size(2)
def test_fuzzed_writes_into_views_match_torch_and_eager():
    programs = [
        generate_program(seed, 2, mesh_shape_for(seed, 2), view_writes=VIEW_WRITES) for seed in VIEW_WRITE_SEEDS
    ]
    writes = [step.line for program in programs for step in program.steps if step.kind == "view-write"]
    assert all("view-write" in program.kinds for program in programs)
    assert all(any(f"v.{op}(" in line for line in writes) for op in VIEW_WRITE_OPS), writes
    _assert_no_failures_of_ours(fuzz(VIEW_WRITE_SEEDS, mesh="both", view_writes=VIEW_WRITES), {})


def _assert_no_failures_of_ours(summary, known_open: dict[tuple[int, int], str]) -> None:
    # failures whose bug is upstream (thunder.jit fails the plain program too and we raise a DTensorOpError;
    # eager DTensor is wrong and we give its values) are reported, with their reproducers, not failed on
    for result in summary.failed:
        if result.upstream:
            print(f"upstream ({result.upstream}): {result.headline()}")
    known = {seed: text for (ws, seed), text in known_open.items() if ws == world_size()}
    failing = {r.program.seed: r for r in summary.failed_here}
    for seed, text in known.items():
        result = failing.pop(seed, None)
        assert result is not None, f"seed {seed} no longer fails: remove it from KNOWN_OPEN"
        assert all(text in f.detail for f in result.failures), f"seed {seed} fails otherwise now: {result.headline()}"
        print(f"known open: {result.headline()}")
    if not failing:
        return
    lines = summary.report_lines()
    shown = set()
    for results in summary.signatures().values():
        smallest = results[0]
        if smallest.program.seed in shown or smallest.program.seed not in failing:
            continue
        shown.add(smallest.program.seed)
        lines += ["", smallest.headline(), smallest.reproducer()]
    pytest.fail("\n".join(lines), pytrace=False)


@pytest.mark.world_size(2)
def test_the_budget_draws_each_kind_of_step():
    """The budget keeps what the fuzzer reads from the data and the keywords it passes: a generator change that
    draws other programs for these seeds must choose seeds that still draw them (drawing costs no run)."""
    programs = [generate_program(seed, ws, mesh_shape_for(seed, ws)) for ws, seeds in SEEDS.items() for seed in seeds]
    kinds = {kind for program in programs for kind in program.kinds}
    missing = [sorted(group) for group in REQUIRED_KINDS if not group & kinds]
    assert not missing, f"no program of the budget draws a step of kind {missing}: choose other SEEDS"
    text = "\n".join(program.source() for program in programs)
    assert all(keyword in text for keyword in REQUIRED_KEYWORDS), [k for k in REQUIRED_KEYWORDS if k not in text]
    assert any("thunderfx" in program.modes for program in programs)


def _item_program() -> Program:
    """``y = x * x.sum().item()``: a number read from the data, taken by a later op (on a replicated input: eager
    DTensor's ``item()`` of a Partial sum is the rank's part, and the frozen function below is eager)."""
    steps = (
        Step("item", "s1 = y.sum().item()", "s1 = y.sum().item()", (4, 4), defines="s1"),
        Step("number-op", "y = y * s1", "y = y * s1", (4, 4)),
    )
    return Program(0, 2, (2,), "float32", (InputSpec("x", (4, 4), ("R",), True, 7),), steps, 11)


@pytest.mark.world_size(2)
def test_a_value_fixed_at_the_first_call_fails_the_second_call(monkeypatch):
    """Each compiled function is called on two data sets of the same specs: one that keeps the first call's
    values (what a number frozen into the trace does) matches on the first call and fails on the second."""

    def compile_frozen(mode, fn):
        first = []

        def frozen(*args):
            out, numbers = fn(*args)
            if not first:
                first.append((out.detach(), numbers))
                return out, numbers
            return first[0][0] + 0.0 * out, first[0][1]  # the first call's values, on this call's autograd graph

        return frozen

    monkeypatch.setattr(fuzz_module, "_READS_DATA", frozenset())  # thunder.jit's modes only: no thunderfx compile
    program = _item_program()
    assert program.modes == ("lowering", "no-lowering")
    assert run_program(program).outcome == "passed"
    monkeypatch.setattr(fuzz_module, "_compile", compile_frozen)
    result = run_program(program)
    assert result.outcome == "failed" and {f.mode for f in result.failures} == {"lowering", "no-lowering"}
    assert all(f.phase.startswith("2nd data: ") for f in result.failures), result.failures
    assert {f.phase for f in result.failures} >= {"2nd data: output", "2nd data: number s1"}


@pytest.mark.world_size(2)
def test_ranks_whose_results_disagree_fail_by_name_instead_of_hanging():
    """Each rank decides DTensor's strategies on its own; where ranks chose differently (torch 2.13's CPU attention
    did, by hash seed: ``tests/unit/test_rank_agreement.py``), the fuzzer names it before gathering the output."""
    mesh, rank = mesh_1d(), dist.get_rank()

    def differs_by_rank(x):
        return x.redistribute(x.device_mesh, [Shard(0)] if rank == 0 else [Replicate()])

    run = _execute(differs_by_rank, lambda: [distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])], None)
    assert isinstance(run.error, RanksDisagree) and run.phase == "forward", run.error
    assert "rank 0: (Shard(dim=0),)" in str(run.error) and "rank 1: (Replicate(),)" in str(run.error)

    def raises_on_one_rank(x):  # that rank stopped while the other went on to gather its output: a hang
        if rank == 1:
            raise ValueError("only here")
        return x * 2

    run = _execute(raises_on_one_rank, lambda: [distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])], None)
    assert isinstance(run.error, RanksDisagree) and run.phase == "forward", run.error
    assert "rank 1: raised ValueError: only here" in str(run.error), run.error
    # (rank 0 met rank 1's agreement while agreeing on its eager call: the fuzzer's eager run stops after each)
    assert "rank 0: went on into an eager call;" in str(run.error), run.error


@pytest.mark.world_size(2)
def test_the_documented_mean_loss_rewrite_is_no_placement_failure():
    """Seed 7454 ends in a mean ``cross_entropy`` over a batch-sharded input: eager DTensor's ``Partial(avg)`` of
    per-rank means is ``Partial(sum)`` here on purpose (``ops/losses.py``); the fuzzer reported it as a placement
    mismatch. Other placements still have to be eager's."""
    program = generate_program(7454, 2, mesh_shape_for(7454, 2))
    assert program.kinds[-1] == "cross_entropy" and 'reduction="mean"' in program.steps[-1].line
    result = run_program(program)
    assert result.outcome == "passed", result.failures


@pytest.mark.world_size(2)
def test_eagers_placements_are_no_reference_on_data_where_its_wrong_rule_happens_to_be_right():
    """Seed 17556 under thunderfx: a frequency-scaled lookup (``scale_grad_by_freq``) in a column-sharded table,
    its output's gradient sharded over the ids. Eager sums the ranks' table gradients (``Partial``), each scaled by
    its own rank's id counts: wrong on the first data set, right on the second, where no id repeats across the
    shards. The fuzzer took eager's ``Partial`` there for the reference against thunder's right ``Replicate``. What
    eager gets wrong on either data set is no placement reference on the other."""
    program = generate_program(17556, 2, mesh_shape_for(17556, 2), thunderfx_share=1.0)
    assert "thunderfx" in program.modes and "scale_grad_by_freq=True" in program.source()
    result = run_program(program)
    table = f"grad {program.inputs[-1].name}"
    assert [table in wrong for wrong in result.eager_wrong] == [True, False], result.eager_wrong
    assert result.outcome == "passed", result.failures


@pytest.mark.world_size(2)
def test_eagers_cpu_placements_of_a_head_sharded_attention_are_no_reference(monkeypatch):
    """Seed 19710: attention on q, k, v equally sharded over heads, placed ``S(1)`` as thunder_dtensor (and eager's
    CUDA rules) keep it; the strategy torch 2.13 derives on CPU replicates it (measured by hand: it takes eager about
    12 s to derive, so the test stands a replicating attention in for it). The fuzzer compared the program's output
    placements with eager's ``R``; now values only. An attention eager places as its inputs stays compared."""
    import torch.nn.functional as F

    mesh = mesh_1d()
    for eager_output in ([Replicate()], [Shard(1)]):

        def attention_as_eager_places_it(q, k, v, *args, placements=eager_output, **kwargs):
            return distribute_tensor(torch.zeros(q.shape), mesh, placements)

        monkeypatch.setattr(F, "scaled_dot_product_attention", attention_as_eager_places_it)
        x = distribute_tensor(torch.randn(4, 2, 6, 8), mesh, [Shard(1)])
        eager = fuzz_module._EagerDerivations()
        eager.__torch_function__(F.scaled_dot_product_attention, (), (x, x, x))  # what the mode sees of the call
        assert eager.derived == (eager_output == [Replicate()]), eager_output


@pytest.mark.world_size(2)
def test_an_eager_call_raising_on_some_ranks_stops_every_rank_there():
    """Seed 20613: ``y.redistribute(S(1))`` of a ``[7, 7]`` value, then ``reshape(49)``. gloo's all-to-all fallback
    leaves rank 1 a shard eager's reshape cannot view; rank 0 went on into the next collective alone and gloo aborted
    the run. Every rank now stops at that call, and the compiled modes, which would run or replay eager's reshape on
    the same shards, are not run."""
    from thunder_dtensor.testing.fuzz import EagerRaisedOnSomeRanks

    program = generate_program(20613, 2, mesh_shape_for(20613, 2))
    assert "y.reshape(49)" in program.source()
    result = run_program(program)
    if "EagerRaisedOnSomeRanks" not in result.eager_error:  # a torch whose eager runs the program on every rank
        pytest.skip(f"eager DTensor: {result.eager_error or 'ran'}")
    assert result.outcome == "eager-rejected" and not result.mode_outcomes and not result.failures, result
    assert "rank 0: ran; rank 1: raised RuntimeError: view size is not compatible" in result.eager_error
    counts = fuzz_module.FuzzSummary(2, [result]).counts()
    assert counts["eager-rejected/not-compiled"] == 1 and counts["eager-rejected/thunder-DTensorOpError"] == 0
    with pytest.raises(EagerRaisedOnSomeRanks, match="raised on some ranks only"):  # and the ranks still pair up
        fuzz_module._stop_together(torch.add, (distribute_tensor(torch.ones(2), mesh_1d(), [Replicate()]),), {},
                                   RuntimeError("this rank's") if dist.get_rank() == 1 else None)  # fmt: skip


@pytest.mark.world_size(2)
def test_an_output_placed_as_torch_compile_places_it_is_triaged_as_torch_s():
    """Seed 8443 under thunderfx: ``F.dropout(y, p=0.0)`` of a ``Partial`` value is ``Replicate`` in dynamo's fake
    run (and under ``torch.compile(backend="aot_eager")``), ``Partial`` in eager; thunderfx runs that node as
    torch.compile does. The fuzzer reports the mismatch with torch.compile's placements as the evidence that the
    difference is torch's; any other placement stays this package's failure."""
    program = generate_program(8443, 2, mesh_shape_for(8443, 2), thunderfx_share=1.0)
    result = run_program(program)
    mismatch = [f for f in result.failures if f.kind == "placement-mismatch"]
    assert result.outcome == "failed" and mismatch and all(f.mode == "thunderfx" for f in mismatch), result.failures
    assert result.compiled_placements == "(R)" and mismatch[0].detail.startswith("output placements (R) vs eager")
    assert "torch.compile (aot_eager backend) places the output as thunderfx does" in result.upstream
    assert not dataclasses.replace(result, compiled_placements="(P(sum))").upstream


@pytest.mark.world_size(4)
@pytest.mark.parametrize("seed", [0, 20])
def test_ranks_with_uneven_shards_run_programs_whose_collectives_pair_up(seed):
    """Two hangs at 4 ranks with writes into views, each until gloo's timeout. Seed 0, under thunderfx: an index of
    one element, sharded (three ranks pad an empty shard before its all-gather), and an ``index_put_`` kept as eager
    DTensor ops, which redistribute: thunder's dataflow fusion partition moved the all-gather past those ops on the
    padding ranks only; the ops that may communicate now keep their order. Seed 20: ``y.mean().item()`` of a tensor
    sharded over 3 rows on 4 ranks; the lowering of one op failed on the empty shard's rank only, which kept it as
    the eager op while the others lowered it; every rank now decides alike (one agreement per such op)."""
    program = generate_program(seed, 4, mesh_shape_for(seed, 4), thunderfx_share=0.2, view_writes=20.0)
    assert "view-write" in program.kinds or "item" in program.kinds
    result = run_program(program)
    assert result.outcome != "failed", result.failures


@pytest.mark.world_size(4)
def test_the_cotangent_handed_in_holds_the_full_value_it_was_made_from():
    """Fuzz seed 13002 (a 2x2 mesh): ``x.flatten(0)`` of ``(S(1), S(1))`` is placed ``(_StridedShard(0, sf=6),) * 2``
    with a shard order. torch distributes a full tensor to those placements as a DTensor without one, whose value
    is another: eager's backward (and thunder's with the lowering off) then differentiated that other value, and
    the fuzzer reported a gradient wrong against plain torch. The cotangent is now checked and replicated there."""
    from thunder_dtensor.testing import make_full, mesh_2d

    cotangent_for = fuzz_module.run_globals()["cotangent_for"]
    mesh = mesh_2d(2)
    out = distribute_tensor(make_full((6, 8), seed=1), mesh, [Shard(1), Shard(1)]).flatten(0)
    full = make_full((48,), seed=2)
    naive = distribute_tensor(full, mesh, [Replicate(), Replicate()]).redistribute(mesh, out.placements)
    assert not torch.equal(naive.full_tensor(), full)  # torch's redistribution (if fixed, this check can go)
    torch.testing.assert_close(cotangent_for(out, full).full_tensor(), full, rtol=0, atol=0)
    sharded = distribute_tensor(make_full((6, 8), seed=3), mesh, [Shard(0), Shard(1)])  # a layout torch makes right
    assert cotangent_for(sharded, make_full((6, 8), seed=4)).placements == sharded.placements


@pytest.mark.world_size(4)
def test_a_strided_cotangent_has_the_outputs_own_spec():
    """Two seeds whose output is placed ``_StridedShard``. torch distributes a full tensor to those placements as a
    DTensor whose spec has no shard order, where the output's has one. Fuzz seed 15430 (a 2x2 mesh, the output
    ``view(48)`` of a ``[6, 8]`` value placed ``(S(1), S(0))``): that DTensor's ``full_tensor()`` fails torch's
    unpadding check on every rank, and the fuzzer's check raised it as the backward's error, for eager and thunder
    alike. Fuzz seed 17148 (1-D, ``view(64)`` of a ``[4, 16]`` value placed ``S(1)``): eager compares specs and
    redistributed the cotangent to Replicate, so its gradient was Replicate where the output's own ``ones_like`` gives
    ``Shard(1)`` (thunder's). The cotangent now carries the output's own spec where that holds the full value."""
    from thunder_dtensor.testing import make_full, mesh_1d, mesh_2d

    cotangent_for = fuzz_module.run_globals()["cotangent_for"]
    mesh = mesh_2d(2)
    out = distribute_tensor(make_full((6, 8), seed=1), mesh, [Shard(1), Shard(0)]).view(48)
    assert [type(p).__name__ for p in out.placements] == ["_StridedShard", "Shard"], out.placements
    full = make_full((48,), seed=2)
    with pytest.raises(RuntimeError):  # torch's own (if fixed, this check can go)
        distribute_tensor(full, mesh, out.placements, src_data_rank=None).full_tensor()
    cotangent = cotangent_for(out, full)
    assert cotangent._spec == out._spec
    torch.testing.assert_close(cotangent.full_tensor(), full, rtol=0, atol=0)

    x = distribute_tensor(make_full((4, 16), seed=3), mesh_1d(), [Shard(1)]).requires_grad_()
    out = torch.sigmoid((-x).view(64))
    full = make_full((64,), seed=4)
    cotangent = cotangent_for(out, full)
    assert cotangent._spec == out._spec and distribute_tensor(full, mesh_1d(), out.placements)._spec != out._spec
    torch.testing.assert_close(cotangent.full_tensor(), full, rtol=0, atol=0)
    out.backward(cotangent)
    assert x.grad.placements == (Shard(1),)
