"""The program fuzzer's generator (``thunder_dtensor/testing/fuzz.py``): what it draws, without running it."""

from thunder_dtensor.testing.fuzz import generate_program


def test_a_local_roundtrip_after_a_flatten_of_an_uneven_dim_passes_the_shape():
    """Fuzz seed 14320 (4 ranks, a 2x2 mesh): ``[8, 7]`` placed ``S(1)`` over 2 ranks, flattened to ``[56]`` (a
    ``_StridedShard``, still uneven), then ``DTensor.from_local`` without ``shape``: the generator took 56 for evenly
    sharded, each rank's global shape was inferred wrong, the ranks' collectives disagreed in size and gloo aborted
    the whole run. A value whose history holds an uneven dim now passes its shape and stride."""
    program = generate_program(14320, 4, (2, 2))
    assert "from_local" in program.source()
    assert "shape=y.shape, stride=y.stride()" in program.source()
