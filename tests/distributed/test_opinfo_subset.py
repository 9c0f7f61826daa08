"""A fast subset of the OpInfo sweep (the full one: `make op-coverage`, which writes docs/op_coverage.md).

Every sample eager DTensor passes must pass under thunder_dtensor, forward and backward.
"""

from thunder_dtensor.testing import mesh_1d
from thunder_dtensor.testing.opinfo import sweep

import pytest

SUBSET = (
    "add", "mul", "div", "exp", "tanh", "where", "sum", "mean", "amax", "var", "matmul", "bmm",
    "nn.functional.linear", "transpose", "reshape", "cat", "split", "softmax", "nn.functional.layer_norm",
    "nn.functional.gelu", "nn.functional.cross_entropy", "cumsum",
)  # fmt: skip


@pytest.mark.world_size(2)
def test_opinfo_subset_no_regression_against_eager():
    results = sweep(SUBSET, mesh_1d(), max_samples=2)
    assert len(results) >= len(SUBSET) - 1
    assert sum(r.samples for r in results) >= 30
    regressions = {r.name: r.first_error for r in results if r.regressions}
    assert not regressions, regressions
    assert sum(r.thunder_fwd for r in results) >= sum(r.eager_fwd for r in results)
