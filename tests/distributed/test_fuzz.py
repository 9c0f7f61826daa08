"""Differential fuzzing: a fixed budget of random DTensor programs at world sizes 2 and 4.

Each seed's program (``thunder_dtensor/testing/fuzz.py``) runs as plain torch, eager DTensor and under
``thunder.jit`` with the lowering on and off; any difference fails the test with the smallest reproducer of
each distinct failure. ``make fuzz`` (``scripts/fuzz.py``) runs many more seeds.
"""

from thunder_dtensor.testing import mesh_1d, world_size
from thunder_dtensor.testing.fuzz import RanksDisagree, _execute, fuzz

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

#: seeds per world size (the 4-rank run has 2-D meshes too): about 15 s at 2 ranks and 9 s at 4 on two otherwise
#: idle CPU cores, the suite's 15-minute budget's share; `make fuzz` runs 300 per world size, and each stop runs
#: several hundred more (docs/architecture.md, "Fuzzing")
SEEDS = {2: range(0, 15), 4: range(0, 6)}


#: open bugs this budget finds, by (world size, seed) -> a piece of the failure's text. Strict: each must still
#: fail this way (a fix removes its entry). Listed with their reproducers in docs/architecture.md, "Fuzzing".
KNOWN_OPEN: dict[tuple[int, int], str] = {}


@pytest.mark.world_size(2, 4)
def test_fuzzed_programs_match_torch_and_eager():
    summary = fuzz(SEEDS[world_size()], mesh="both")
    # failures whose bug is upstream (thunder.jit fails the plain program too and we raise a DTensorOpError;
    # eager DTensor is wrong and we give its values) are reported, with their reproducers, not failed on
    for result in summary.failed:
        if result.upstream:
            print(f"upstream ({result.upstream}): {result.headline()}")
    known = {seed: text for (ws, seed), text in KNOWN_OPEN.items() if ws == world_size()}
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
def test_ranks_whose_results_disagree_fail_by_name_instead_of_hanging():
    """Each rank decides DTensor's strategies on its own; where ranks chose differently (torch 2.13's CPU attention
    did, by hash seed: ``tests/unit/test_rank_agreement.py``), the fuzzer names it before gathering the output."""
    mesh, rank = mesh_1d(), dist.get_rank()

    def differs_by_rank(x):
        return x.redistribute(x.device_mesh, [Shard(0)] if rank == 0 else [Replicate()])

    run = _execute(differs_by_rank, lambda: [distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])], None)
    assert isinstance(run.error, RanksDisagree) and run.phase == "output", run.error
    assert "rank 0: (Shard(dim=0),)" in str(run.error) and "rank 1: (Replicate(),)" in str(run.error)
