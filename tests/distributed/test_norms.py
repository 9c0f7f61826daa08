"""layer_norm and rms_norm under every requires_grad pattern of input / weight / bias.

Frozen-parameter fine-tuning hits the output masks [True, False, False], [False, True, *] and the rest
(upstream DTensor once failed on exactly these). Inputs are sharded on batch or sequence dims, or
replicated; normalized_shape has 1 to 3 dims; elementwise_affine and bias on and off.
"""

import itertools

from thunder_dtensor.testing import DTensorCase, make_full, run_case, world_size

import pytest
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

SHAPE = (4, 6, 2, 3, 8)  # batch, sequence, then up to three normalized dims
PLACEMENTS = {"batch": [Shard(0)], "sequence": [Shard(1)], "replicated": [Replicate()]}


def _cases(with_bias: bool):
    cases = []
    for ndims, where in itertools.product((1, 2, 3), PLACEMENTS):
        # affine with bias: input / weight / bias each frozen or trainable (all 8 patterns)
        # affine without bias: input / weight (4 patterns); no affine: input trainable or not
        affine_patterns = list(itertools.product((True, False), repeat=3 if with_bias else 2))
        for pattern in affine_patterns:
            cases.append(("affine" + ("+bias" if with_bias else ""), ndims, where, pattern))
        if with_bias:
            for x_grad in (True, False):
                cases.append(("no_affine", ndims, where, (x_grad,)))
    return cases


def _ids(case):
    kind, ndims, where, pattern = case
    return f"{kind}-{ndims}d-{where}-" + "".join("T" if p else "F" for p in pattern)


def _run(norm, case):
    kind, ndims, where, pattern = case
    if world_size() == 4 and (where != "sequence" or not all(pattern)):
        # sequence 6 is uneven at 4 ranks: its case with every input requiring grad (suite time)
        pytest.skip("even shards, replicated inputs or frozen ones: the 2-rank run covers this case")
    normalized = SHAPE[-ndims:]
    x = make_full(SHAPE, seed=1)
    inputs, placements = [x], [PLACEMENTS[where]]
    if kind.startswith("affine"):
        inputs.append(make_full(normalized, seed=2, low=0.5))
        placements.append([Replicate()])
    if kind == "affine+bias":
        inputs.append(make_full(normalized, seed=3))
        placements.append([Replicate()])

    def fn(x, *params):
        if norm == "layer_norm":
            weight = params[0] if params else None
            bias = params[1] if len(params) > 1 else None
            return F.layer_norm(x, normalized, weight, bias, eps=1e-5)
        return F.rms_norm(x, normalized, params[0] if params else None, eps=1e-5)

    run_case(
        DTensorCase(fn, inputs, placements, requires_grad=list(pattern)), backward=any(pattern), atol=1e-5, rtol=1e-4
    )


LAYER_NORM_CASES = _cases(with_bias=True) + _cases(with_bias=False)
RMS_NORM_CASES = [c for c in _cases(with_bias=False) if c[0] != "no_affine"] + [
    ("no_affine", n, w, (g,)) for n in (1, 2, 3) for w in PLACEMENTS for g in (True, False)
]


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("case", LAYER_NORM_CASES, ids=_ids)
def test_layer_norm(case):
    _run("layer_norm", case)


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("case", RMS_NORM_CASES, ids=_ids)
def test_rms_norm(case):
    _run("rms_norm", case)
