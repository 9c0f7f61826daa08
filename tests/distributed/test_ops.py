"""Every op of the op database, on a sweep of placements, at world sizes 2 and 4 (uneven shards included).

Values and gradients are compared with plain torch on the full tensors (random ops: with eager DTensor on
the same seed); placements with eager DTensor where eager can run the case, and collectives of each kind,
forward and backward, too: the jit may do no more than eager in the phases of ``COMMS_ASSERTED``; the rest
is reported at the end of the session (see ``conftest.py``). Each case's declared outcome (runs, rewritten,
raises: ``op_db.py``) is asserted.
"""

import zlib

from thunder_dtensor.errors import DataDependentValueError, DTensorOpError
from thunder_dtensor.testing import (
    COMM_COMPARISONS,
    COMMS_ASSERTED,
    RUNS,
    CommComparison,
    DTensorCase,
    assert_no_more_comms,
    comm_report,
    make_full,
    raises,
    rewritten,
    run_case,
    world_size,
)

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from .op_db import OP_DB, all_cases, case_id, placements_id


def _needs_four_ranks(case) -> bool:
    """Cases the 4-rank run adds to the 2-rank one: a shard uneven at 4 ranks, or a Partial input; of those, every
    other one by a stable hash of its id (the suite's time; `make op-coverage` sweeps every op at 4 ranks)."""
    if zlib.crc32(case_id(case).encode()) % 2:
        return False
    entry, placements = case
    for shape, input_placements in zip(entry.shapes, placements):
        for p in input_placements:
            if p.is_partial() or (isinstance(p, Shard) and shape[p.dim] % 4 != 0):
                return True
    return False


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("case", all_cases(), ids=case_id)
def test_op(case):
    if world_size() == 4 and not _needs_four_ranks(case):
        pytest.skip("even shards and replicated inputs: the 2-rank run covers this case")
    entry, placements = case
    dtypes = entry.dtypes or [None] * len(entry.shapes)
    inputs = [
        make_full(shape, seed=10 * i + 1, low=entry.low, int_high=entry.int_high, **({"dtype": dt} if dt else {}))
        for i, (shape, dt) in enumerate(zip(entry.shapes, dtypes))
    ]
    if entry.make_inputs is not None:
        inputs = entry.make_inputs(inputs)
    grads = (
        entry.grad if isinstance(entry.grad, (list, tuple)) else [entry.grad and t.is_floating_point() for t in inputs]
    )
    result = run_case(
        DTensorCase(entry.fn, inputs, placements, requires_grad=list(grads), kwargs=entry.kwargs),
        backward=any(grads),
        compare_eager=entry.eager,
        rtol=entry.rtol,
        atol=entry.atol,
        random=entry.random,
        assert_comms=COMMS_ASSERTED,
        expect=entry.outcome(placements, world_size()),
    )
    if entry.check is not None:
        entry.check(result, inputs)


def test_collectives_are_counted_and_compared():
    """The comparison sees real collectives (not trace-time ones) and raises only in the asserted phases."""
    x, w = make_full((6, 8), seed=1), make_full((8, 4), seed=2)
    # row-sharded operands of mm: eager all-gathers w once in the forward, once in the backward
    result = run_case(DTensorCase(torch.mm, [x, w], [[Shard(0)], [Shard(0)]]), assert_comms=COMMS_ASSERTED)
    forward, backward = result.comms
    assert (forward.phase, forward.eager, forward.jit) == ("forward", {"all_gather": 1}, {"all_gather": 1})
    assert (
        backward.phase == "backward"
        and backward.eager.get("all_gather", 0) >= 1
        and backward.jit.get("all_gather", 0) >= 1
    )
    assert COMM_COMPARISONS[-2:] == [forward, backward]

    more = CommComparison("case", "backward", 2, {"all_gather": 2, "all_reduce": 1}, {"all_gather": 1})
    assert more.excess == {"all_gather": (2, 1), "all_reduce": (1, 0)}
    assert_no_more_comms([more], ("forward",))  # reported, not asserted
    with pytest.raises(AssertionError, match="backward: the jit does more collectives"):
        assert_no_more_comms([more], ("forward", "backward"))
    assert comm_report([more, forward])[0] == "jit does more collectives than eager in 1 cases (world size 2):"


def test_declared_outcomes_name_cases():
    """Every case an entry's ``outcomes`` names exists (a misspelt key would leave its case declared RUNS)."""
    for entry in OP_DB:
        ids = {placements_id(combo) for combo in entry.cases()}
        unknown = {key for key in entry.outcomes if key.split("@")[0] not in ids}
        assert not unknown, f"{entry.name}: no case has the placements {unknown} (cases: {sorted(ids)})"
        assert all(key.split("@")[1:] in ([], ["2"], ["4"]) for key in entry.outcomes), entry.outcomes


def test_a_case_that_does_otherwise_than_declared_fails():
    """The declared outcome is asserted: a case that runs fails as rewritten or raising, a rewritten one as RUNS,
    a raising one as another error or another message."""
    x = make_full((6, 1, 8), seed=1)

    def squeeze(t):
        return t.squeeze(1) * 2

    runs = DTensorCase(squeeze, [x], [[Replicate()]], requires_grad=[False])
    for wrong in (rewritten("replicated fallback"), raises(DTensorOpError, "placements")):
        with pytest.raises(AssertionError, match="declared"):
            run_case(runs, backward=False, expect=wrong)
    refused = DTensorCase(squeeze, [x], [[Shard(1)]], requires_grad=[False])  # eager refuses; replicated fallback
    for wrong in (RUNS, rewritten("decomposition")):
        with pytest.raises(AssertionError, match="declared"):
            run_case(refused, backward=False, expect=wrong)
    data_dependent = DTensorCase(lambda t: torch.masked_select(t, t > 0), [x], [[Shard(0)]], requires_grad=[False])
    for wrong in (raises(DTensorOpError, "depends on the data"), raises(DataDependentValueError, "no such words")):
        with pytest.raises(AssertionError, match="declared"):
            run_case(data_dependent, backward=False, expect=wrong)
