"""A fast subset of the OpInfo sweep (the full one: `make op-coverage`, which writes docs/op_coverage.md).

Every sample eager DTensor passes must pass under thunder_dtensor, forward and backward; random samples
(dropout, SDPA with dropout) are compared with eager DTensor under one seed.
"""

from thunder_dtensor.testing import mesh_1d
from thunder_dtensor.testing.opinfo import looks_like_dropout, summary, sweep

import pytest
import torch

SDPA = "nn.functional.scaled_dot_product_attention"
DROPOUT = "nn.functional.dropout"

SUBSET = (
    "add", "mul", "div", "exp", "tanh", "where", "sum", "mean", "amax", "var", "matmul", "bmm",
    "nn.functional.linear", "transpose", "reshape", "cat", "split", "softmax", "nn.functional.layer_norm",
    "nn.functional.gelu", "nn.functional.cross_entropy", "cumsum", SDPA, DROPOUT,
)  # fmt: skip

#: the variants torch 2.13's OpInfo database has of SUBSET's ops ("" the unnamed one), each a result of its own
#: ("div.trunc_rounding"): the sweep must give exactly these, so an op or variant a torch release drops or renames
#: fails the test instead of shrinking it
VARIANTS = {
    "div": ("no_rounding_mode", "trunc_rounding", "floor_rounding"),
    "softmax": ("", "with_dtype"),
    "split": ("", "list_args"),
    "var": ("", "unbiased"),
    "bmm": ("", "triton_optimized"),
}
SUBSET_RESULTS = frozenset(f"{name}.{v}" if v else name for name in SUBSET for v in VARIANTS.get(name, ("",)))

MAX_SAMPLES = 4

#: SDPA's samples are the slowest to trace; dropout's first ones are mostly deterministic: chosen samples
SAMPLE_INDICES = {
    # 3-D q sharded on batch (eager: no communication); the same with dropout_p=0.5; 4-D causal (eager fails);
    # 4-D with dropout_p=0.5; q broadcast over heads (4-D k, v); a float attn_mask
    SDPA: (4, 6, 8, 14, 20, 24),
    # p=0.5 in training on [5, 5]; p=1; p=0.5 in training on [5]; p=0.5 on [5] in eval; defaults on a 0-d tensor
    DROPOUT: (2, 4, 8, 9, 18),
}


@pytest.mark.world_size(2)
def test_opinfo_subset_no_regression_against_eager():
    results = {r.name: r for r in sweep(SUBSET, mesh_1d(), max_samples=MAX_SAMPLES, sample_indices=SAMPLE_INDICES)}
    assert set(results) == SUBSET_RESULTS, {
        "missing": sorted(SUBSET_RESULTS - set(results)),
        "unexpected": sorted(set(results) - SUBSET_RESULTS),
    }
    assert all(r.samples for r in results.values()), {name: r.skipped for name, r in results.items() if not r.samples}
    totals = summary(list(results.values()))
    assert totals["samples"] >= 90, totals
    regressions = {
        (name, index): detail
        for name, r in results.items()
        for index, detail in zip(r.regressed_samples, r.regression_details)
    }
    assert not regressions, regressions
    # random samples: compared with eager under one seed, and the outputs are dropouts, not the identity
    dropout = results[DROPOUT]
    assert dropout.random_samples == 3 and dropout.samples == len(SAMPLE_INDICES[DROPOUT])
    assert dropout.thunder_fwd == dropout.eager_fwd == dropout.samples, dropout
    assert dropout.thunder_bwd == dropout.eager_bwd == dropout.bwd_samples, dropout
    sdpa = results[SDPA]
    assert sdpa.random_samples == 2 and sdpa.samples == len(SAMPLE_INDICES[SDPA])


@pytest.mark.world_size(2)
def test_dropout_check_rejects_the_identity_and_wrong_masks():
    x = torch.arange(1.0, 21.0)
    kept = torch.arange(20) % 3 != 0
    out = torch.where(kept, x * 2, 0.0)
    grad = torch.where(kept, 2.0, 0.0)
    assert looks_like_dropout(out, [grad], x, 0.5)
    assert not looks_like_dropout(x, None, x, 0.5)  # the identity
    assert not looks_like_dropout(x * 2, None, x, 0.5)  # nothing dropped on 20 elements
    assert not looks_like_dropout(torch.where(kept, x * 3, 0.0), None, x, 0.5)  # wrong scale
    assert not looks_like_dropout(out, [torch.full_like(x, 2.0)], x, 0.5)  # gradient ignores the mask


#: ops DTensor has no sharding rule for (forward or backward), or computes wrongly: decomposed, run replicated,
#: or given a rule of ours (losses, the backward of Partial(max) outputs); the full sweep: docs/op_coverage.md
NO_RULE_SUBSET = (
    "nn.functional.hardtanh", "nn.functional.hardswish", "nn.functional.logsigmoid", "nn.functional.relu6",
    "addbmm", "nn.functional.bilinear", "amax", "nn.functional.nll_loss", "logsumexp",
)  # fmt: skip

#: eager DTensor's wrong answers: amax of a 1-D / 4-D sharded tensor (nan gradients), nll_loss means with class
#: weights or ignored targets (averaged per-rank means); logsumexp of a 0-dim tensor (a rejected 0-dim reduction)
NO_RULE_SAMPLES = {"amax": (4, 13), "nn.functional.nll_loss": (0, 35, 36, 37, 38, 60), "logsumexp": (0, 1, 2, 3)}


@pytest.mark.world_size(2)  # 4 ranks: `make op-coverage` (the suite's time budget)
def test_ops_without_a_sharding_rule_pass_every_sample():
    results = sweep(NO_RULE_SUBSET, mesh_1d(), max_samples=6, sample_indices=NO_RULE_SAMPLES)
    assert {r.name for r in results} == set(NO_RULE_SUBSET) and all(r.samples for r in results)
    for r in results:
        assert r.thunder_fwd == r.samples and r.thunder_bwd == r.bwd_samples, (r.name, r.failure_details)
    totals = summary(results)
    assert totals["regressions"] == 0, totals
    # where eager fails, thunder decomposes or runs replicated; counted per sample by how it ran
    assert totals["eager_bwd"] < totals["thunder_bwd"], totals
    assert totals["fwd_by_decomposition"] >= 10 and totals["fwd_by_replicated_fallback"] >= 10, totals
