"""DTensors with Python scalars, and with plain torch.Tensors, behave as in eager DTensor."""

from thunder_dtensor import DTensorOpError
from thunder_dtensor.testing import COMMS_ASSERTED, DTensorCase, make_full, mesh_1d, run_case, same_placements

import pytest
import thunder
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

SCALAR_FNS = {
    "mul": lambda x: x * 2.5,
    "rmul": lambda x: 3 * x,
    "add": lambda x: x + 1,
    "rsub": lambda x: 1 - x,
    "div": lambda x: x / 4,
    "rdiv": lambda x: 2.0 / (x + 3),
    "pow": lambda x: x**2,
    "chain": lambda x: (x * 0.5 + 2) ** 3 - x / 7,
}


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("name", SCALAR_FNS)
@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]], ids=str)
def test_python_scalars(name, placements):
    run_case(DTensorCase(SCALAR_FNS[name], [make_full((8, 6), seed=3)], [placements]), assert_comms=COMMS_ASSERTED)


def test_int_dtensor_with_float_scalar_promotes_like_torch():
    x = make_full((8, 6), seed=4, dtype=torch.int64)
    result = run_case(DTensorCase(lambda x: x * 1.5 + x, [x], [[Shard(0)]], requires_grad=[False]), backward=False)
    assert result.thunder_out[0].dtype == torch.float32


def test_plain_tensor_operand_is_rejected_as_in_eager():
    """torch 2.13's eager DTensor rejects a plain tensor operand; thunder rejects it at trace time, saying how to
    fix it. If eager accepts it (a later torch), thunder must give eager's values and placements."""
    mesh = mesh_1d()
    x_full, plain = make_full((8, 6), seed=5), make_full((8, 6), seed=6)
    x = distribute_tensor(x_full, mesh, [Shard(0)])

    def fn(x, t):
        return x * t

    try:
        eager = fn(x, plain)
    except Exception as error:  # eager DTensor rejects the mix
        eager_failure = error
    else:
        eager_failure = None
        out = thunder.jit(fn)(x, plain)
        assert type(out) is type(eager)
        if isinstance(eager, DTensor):
            assert same_placements(out.placements, eager.placements)
            eager = eager.full_tensor()
            out = out.full_tensor()
        torch.testing.assert_close(out, eager)
        torch.testing.assert_close(out, fn(x_full, plain))
        return
    with pytest.raises(DTensorOpError) as info:
        thunder.jit(fn)(x, plain)
    message = str(info.value)
    assert "mul" in message
    assert "placements=(Shard(dim=0),)" in message
    assert "torch.Tensor f32[8, 6] (not a DTensor)" in message
    assert "hint:" in message and "DTensor.from_local" in message
    assert type(info.value.__cause__) is type(eager_failure)  # eager DTensor's own rejection


def test_zero_dim_plain_tensor_is_accepted_as_in_eager():
    mesh = mesh_1d()
    x_full = make_full((8, 6), seed=7)
    scale = torch.tensor(3.0, device=x_full.device)
    x = distribute_tensor(x_full, mesh, [Shard(0)])

    def fn(x, s):
        return x * s + 1

    eager = fn(x, scale)
    out = thunder.jit(fn)(x, scale)
    assert out.placements == eager.placements
    torch.testing.assert_close(out.full_tensor(), fn(x_full, scale))
