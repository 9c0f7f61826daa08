"""The program fuzzer's generator (``thunder_dtensor/testing/fuzz.py``): what it draws, without running it."""

import re

from thunder_dtensor.testing.fuzz import generate_program


def test_a_local_roundtrip_after_a_flatten_of_an_uneven_dim_passes_the_shape():
    """Fuzz seed 14320 (4 ranks, a 2x2 mesh): ``[8, 7]`` placed ``S(1)`` over 2 ranks, flattened to ``[56]`` (a
    ``_StridedShard``, still uneven), then ``DTensor.from_local`` without ``shape``: the generator took 56 for evenly
    sharded, each rank's global shape was inferred wrong, the ranks' collectives disagreed in size and gloo aborted
    the whole run. A value whose history holds an uneven dim now passes its shape and stride."""
    program = generate_program(14320, 4, (2, 2))
    assert "from_local" in program.source()
    assert "shape=y.shape, stride=y.stride()" in program.source()


def test_no_maximum_over_a_dim_with_fewer_elements_than_ranks():
    """Fuzz seed 15429 (4 ranks, a 2x2 mesh): ``amax`` over a dim of 2 elements sharded over 4 ranks. Two ranks hold
    none of it, and eager DTensor's ``amax`` raises on those only while the others wait in a collective: the run
    hung. The generator draws a sum there instead (other seeds' programs are as they were)."""
    program = generate_program(15429, 4, (2, 2))
    assert "amax" not in program.source() and "y.sum(dim=(0, 1)" in program.source()
    drawn = 0
    for seed in range(15000, 15200):
        program = generate_program(seed, 4, (2, 2))
        shape = program.inputs[0].shape
        for step in program.steps:
            match = re.search(r"y\.amax\(dim=\(?([-\d, ]+)\)?, keepdim", step.line)
            if match:
                drawn += 1
                dims = [int(d) % len(shape) for d in match.group(1).split(",") if d.strip()]
                assert all(shape[d] >= 4 for d in dims), (seed, step.line, shape)
            shape = step.shape or shape
    assert drawn > 0  # the maximum is still drawn where it is safe


def test_no_table_vocab_sharded_on_several_mesh_dims():
    """Fuzz seed 15502 (4 ranks, a 2x2 mesh): a table placed ``(S(0), S(0))``. Eager DTensor's masked lookup raised
    "MaskBuffer has been materialized with conflicting data" on three ranks while the fourth waited in a
    collective: the run hung. The generator shards a table's vocabulary on one mesh dim at most."""
    tables = 0
    for seed in range(15400, 15700):
        program = generate_program(seed, 4, (2, 2))
        for i in program.tables:
            tables += 1
            assert program.inputs[i].placements.count("S0") <= 1, (seed, program.describe())
    assert tables > 0


def test_no_whole_maximum_of_a_value_some_rank_may_hold_none_of():
    """Fuzz seed 18146 (4 ranks, a 2x2 mesh): ``y.amax().item()`` of ``[3, 2]`` placed ``(S(0), S(0))``: rank 3 holds
    none of it, eager DTensor's ``amax`` raised there only while the others waited in a collective, and the run
    ended. The generator reads a sum there instead (and an ``if`` tests a mean), where a dim has fewer elements than
    ranks; elsewhere the maximum is still drawn."""
    program = generate_program(18146, 4, (2, 2))
    assert "y.sum().item()" in program.source() and "amax" not in program.source()
    drawn = 0
    for seed in range(18000, 18400):
        program = generate_program(seed, 4, (2, 2))
        shape = program.inputs[0].shape
        for step in program.steps:
            if re.search(r"y\.am(ax|in)\(\)", step.line):
                drawn += 1
                assert all(size >= 4 for size in shape), (seed, step.line, shape)
            shape = step.shape or shape
    assert drawn > 0
