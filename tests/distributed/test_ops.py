"""Every op of the op database, on a sweep of placements, at world sizes 2 and 4 (uneven shards included).

Values and gradients are compared with plain torch on the full tensors; placements with eager DTensor
where eager can run the case.
"""

from thunder_dtensor.testing import DTensorCase, make_full, run_case

import pytest

from .op_db import all_cases, case_id


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("case", all_cases(), ids=case_id)
def test_op(case):
    entry, placements = case
    dtypes = entry.dtypes or [None] * len(entry.shapes)
    inputs = [
        make_full(shape, seed=10 * i + 1, low=entry.low, int_high=entry.int_high, **({"dtype": dt} if dt else {}))
        for i, (shape, dt) in enumerate(zip(entry.shapes, dtypes))
    ]
    grads = (
        entry.grad if isinstance(entry.grad, (list, tuple)) else [entry.grad and t.is_floating_point() for t in inputs]
    )
    run_case(
        DTensorCase(entry.fn, inputs, placements, requires_grad=list(grads), kwargs=entry.kwargs),
        backward=any(grads),
        compare_eager=entry.eager,
        rtol=entry.rtol,
        atol=entry.atol,
    )
