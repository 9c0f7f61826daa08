"""A jitted program may build placements (dynamo graphs handed over by thunderfx spell each one as a constructor
call): the interpreter calls every placement class whole, the private ones too. Stepping into the construction
of one (a Python subclass of a pybind11 class) aborts the process: ``_StridedShard``, which a flatten's output
carries, did so under thunderfx (fuzz seed 11805)."""

import pytest
import thunder
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard


@pytest.mark.parametrize(
    "make",
    [
        lambda: Shard(1),
        lambda: Replicate(),
        lambda: Partial("max"),
        lambda: _StridedShard(0, split_factor=2),
    ],
    ids=["Shard", "Replicate", "Partial", "_StridedShard"],
)
def test_a_program_builds_a_placement(make):
    def fn(x: torch.Tensor) -> torch.Tensor:
        placement = make()
        return x * 2 if placement.is_shard() else x * 3

    x = torch.randn(3)
    torch.testing.assert_close(thunder.jit(fn)(x), fn(x))
