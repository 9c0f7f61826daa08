"""DTensors with Python scalars, and with plain torch.Tensors, behave as in eager DTensor."""

import warnings

from thunder_dtensor import DTensorOpError
from thunder_dtensor.guards import CotangentPlacementWarning
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


def _scaled_by_a_learned_scalar(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x * s


def _scaled_by_a_function_of_a_learned_scalar(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A temperature kept as a plain 0-dim parameter (not parallelized): plain ops on it, then DTensor ops."""
    t = (torch.arange(1.0, 4.0) * s).sum()  # a CPU scalar times a vector: thunder alone does not sum its gradient
    return x * s.exp() * (t * t)


def _scaled_by_a_learned_scalar_and_a_function_of_it(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x * s.exp() + s


@pytest.mark.world_size(2)
@pytest.mark.parametrize("placements", [[Shard(1)], [Replicate()]], ids=str)
@pytest.mark.parametrize(
    "fn",
    [
        _scaled_by_a_learned_scalar,
        _scaled_by_a_function_of_a_learned_scalar,
        _scaled_by_a_learned_scalar_and_a_function_of_it,
    ],
)
def test_a_zero_dim_plain_tensor_that_requires_grad_gets_torch_gradient(fn, placements):
    """A plain 0-dim tensor that requires grad, used with DTensors: its gradient has torch's value. Used by a
    DTensor op directly, it is eager's DTensor gradient (``Partial(sum)``); where plain ops made the scalar the
    DTensor op took (``s.exp()``), thunder's backward of those ops runs on its full value (was: an
    ``AssertionError`` from the torch executor: a DTensor cotangent in a plain op), and ``s.grad`` is a plain
    tensor holding it (eager's is a ``Partial`` DTensor of the same sum); used both ways, its gradient is the sum
    of the two, a DTensor."""
    x_full, s_full = make_full((4, 6), seed=11), torch.tensor(0.7)
    x = distribute_tensor(x_full, mesh_1d(), placements).requires_grad_()
    s = s_full.clone().requires_grad_()
    jitted = thunder.jit(fn)
    out = jitted(x, s)
    plain_x, plain_s = x_full.clone().requires_grad_(), s_full.clone().requires_grad_()
    expected = fn(plain_x, plain_s)
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    with warnings.catch_warnings():
        # the eager sum hands in a Replicate cotangent: the backward is traced again for it (``torch.arange`` in the
        # program reads the call's recorded default dtype and device again: was a LookupError, and a redistribution)
        warnings.simplefilter("error", CotangentPlacementWarning)
        out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), plain_x.grad)
    if fn is _scaled_by_a_learned_scalar:  # eager's gradient: a DTensor
        eager_x, eager_s = x_full.clone(), s_full.clone().requires_grad_()
        fn(distribute_tensor(eager_x, mesh_1d(), placements), eager_s).sum().backward()
        assert isinstance(s.grad, DTensor) and same_placements(s.grad.placements, eager_s.grad.placements)
        torch.testing.assert_close(s.grad.full_tensor(), plain_s.grad)
    elif fn is _scaled_by_a_function_of_a_learned_scalar:
        assert type(s.grad) is torch.Tensor
        torch.testing.assert_close(s.grad, plain_s.grad)
    else:
        assert isinstance(s.grad, DTensor)
        torch.testing.assert_close(s.grad.full_tensor(), plain_s.grad)


def _alpha_read_from_a_dtensor(x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    s = x.amax().item()
    return x * 2, torch.add(b, b * 3, alpha=s), torch.sub(b, b * 5, alpha=s), b.clone().add_(b, alpha=s)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
def test_plain_tensors_scaled_by_an_alpha_read_from_a_dtensor(lowering):
    """``torch.add(b, c, alpha=x.amax().item())`` on plain tensors in a DTensor program: thunder's own ``add``
    took the alpha, which has no value while it traces, as 1 (plain ``b + c``, silently; the thunder fix
    ``scale_by_run_time_alphas``). Two calls, other data: the alpha is read at run time each call."""
    jitted = thunder.jit(_alpha_read_from_a_dtensor, dtensor_lowering=lowering)
    for seed in (60, 61):
        full, b = make_full((4, 6), seed=seed), make_full((3,), seed=seed + 10)
        expected = _alpha_read_from_a_dtensor(full, b)
        out = jitted(distribute_tensor(full, mesh_1d(), [Shard(1)]), b)
        torch.testing.assert_close(out[0].full_tensor(), expected[0])
        for got, want in zip(out[1:], expected[1:]):
            assert not isinstance(got, DTensor)
            torch.testing.assert_close(got, want)
    assert thunder.cache_misses(jitted) == 1
