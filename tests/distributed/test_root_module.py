"""Tensor-parallel hooks on the module passed to ``thunder.jit`` itself (its root), not on a submodule.

``parallelize_module(nn.Linear(16, 16), mesh, ColwiseParallel())`` puts the style's hooks on the jitted
module; the prologue re-reads values inside them (``use_local_output``) on every call, from the user's module.
Each case trains a few steps under thunder.jit beside the same parallelized module run eagerly (eager
DTensor) and the unsharded module in one process: losses, outputs, input and parameter gradients (values
and placements) equal; frozen parameters get no gradient anywhere.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass

from thunder_dtensor.testing import make_full, mesh_1d, same_placements

import pytest
import thunder
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TOL = {"rtol": 1e-4, "atol": 2e-5}
STEPS = 3
H = 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@dataclass
class RootCase:
    """A module, the plans applied to its root (in order), and how its input and output are laid out.

    ``input_shard``: the placement this rank's input is a local piece of (None: every rank gets the full
    input). ``output_local``: the placement a local (non-DTensor) output is a piece of (None: the output is a
    DTensor, or the full value). ``data_parallel``: plain (non-DTensor) parameters see only this rank's
    part of the batch, so their gradients are summed over ranks before the step (what DDP does).
    """

    make: Callable[[], nn.Module]
    plans: tuple
    input_shape: tuple[int, ...]
    input_shard: Shard | None = None
    output_local: Shard | Replicate | None = None
    frozen: tuple[str, ...] = ()
    adamw: bool = False
    data_parallel: bool = False


def _linear() -> nn.Module:
    return nn.Linear(H, H)


CASES = {
    "colwise": RootCase(_linear, (ColwiseParallel(),), (4, H), output_local=Shard(-1)),
    "rowwise-local": RootCase(_linear, (RowwiseParallel(),), (4, H), input_shard=Shard(-1), output_local=Replicate()),
    "rowwise-dtensor-frozen-bias": RootCase(
        _linear, (RowwiseParallel(use_local_output=False),), (4, H), input_shard=Shard(-1), frozen=("bias",)
    ),
    "sequence-parallel-layernorm": RootCase(
        lambda: nn.LayerNorm(H), (SequenceParallel(),), (2, 4, H), input_shard=Shard(1), frozen=("weight",)
    ),
    "prepare-input": RootCase(
        _linear,
        (PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_output=True),),
        (4, H),
        input_shard=Shard(0),
    ),
    "prepare-output": RootCase(
        _linear,
        (PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate()),),
        (4, H),
        input_shard=Shard(0),
        frozen=("bias",),
        data_parallel=True,
    ),
    # a plan dict whose root entry ("") is a PrepareModuleInput, beside plans for the submodules
    "mlp-plan-and-root-input": RootCase(
        MLP,
        (
            {
                "": PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()),
                "up": ColwiseParallel(),
                "down": RowwiseParallel(),
            },
        ),
        (4, H),
        input_shard=Shard(0),
        output_local=Replicate(),
        frozen=("up.bias", "down.weight"),
        adamw=True,
    ),
}


def _local_piece(full: torch.Tensor, placement: Shard | None) -> torch.Tensor:
    if placement is None:
        return full.clone()
    return full.chunk(dist.get_world_size(), dim=placement.dim)[dist.get_rank()].clone()


def _full(out, output_local):
    """The full value of a module output (differentiable): DTensors gathered, local pieces put together."""
    if isinstance(out, DTensor):
        return out.full_tensor()
    if output_local is None:
        return out
    return DTensor.from_local(out, mesh_1d(), [output_local], run_check=False).full_tensor()


def _gathered(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _parallelized(ref: nn.Module, case: RootCase) -> nn.Module:
    module = copy.deepcopy(ref)
    for plan in case.plans:
        parallelize_module(module, mesh_1d(), plan)
    for name in case.frozen:  # after parallelizing: parallelize_module makes new Parameters
        module.get_parameter(name).requires_grad_(False)
    return module


def _assert_same_grad(actual, expected, what: str) -> None:
    if expected is None:
        assert actual is None, f"{what}: a gradient where eager gives none"
        return
    assert actual is not None, f"{what}: no gradient"
    assert isinstance(actual, DTensor) == isinstance(expected, DTensor), f"{what}: {type(actual)} vs {type(expected)}"
    if isinstance(expected, DTensor):
        assert same_placements(actual.placements, expected.placements), (
            f"{what}: placements {actual.placements} != eager {expected.placements}"
        )
    torch.testing.assert_close(_gathered(actual), _gathered(expected), **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_root_module_trains_like_eager_and_single_process(name):
    case = CASES[name]
    torch.manual_seed(0)  # the same initial weights on every rank
    ref = case.make()
    for p in case.frozen:
        ref.get_parameter(p).requires_grad_(False)
    eager = _parallelized(ref, case)
    model = _parallelized(ref, case)
    jitted = thunder.jit(model)

    def optimizer(m: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in m.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-2) if case.adamw else torch.optim.SGD(params, lr=0.1)

    opts = [optimizer(m) for m in (model, eager, ref)]
    for step in range(STEPS):
        x_full = make_full(case.input_shape, seed=10 + step)
        target = make_full(case.input_shape, seed=20 + step)
        x, x_eager, x_ref = (
            _local_piece(x_full, case.input_shard).requires_grad_(),
            _local_piece(x_full, case.input_shard).requires_grad_(),
            x_full.clone().requires_grad_(),
        )
        out, out_eager, out_ref = jitted(x), eager(x_eager), ref(x_ref)
        assert isinstance(out, DTensor) == isinstance(out_eager, DTensor), f"step {step}: {type(out)} vs eager"
        if isinstance(out_eager, DTensor):
            assert same_placements(out.placements, out_eager.placements), (out.placements, out_eager.placements)
        else:
            assert out.shape == out_eager.shape
        losses = [((_full(o, case.output_local) - target) ** 2).sum() for o in (out, out_eager)]
        losses.append(((out_ref - target) ** 2).sum())
        for loss in losses:
            loss.backward()
        loss, loss_eager, loss_ref = losses
        torch.testing.assert_close(loss, loss_ref, **TOL)
        torch.testing.assert_close(loss, loss_eager, **TOL)

        _assert_same_grad(x.grad, x_eager.grad, f"step {step}: input")
        torch.testing.assert_close(x.grad, _local_piece(x_ref.grad, case.input_shard), **TOL)
        named_ref = dict(ref.named_parameters())
        for (pname, p), (_, pe) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
            _assert_same_grad(p.grad, pe.grad, f"step {step}: {pname}")
            if case.data_parallel and p.grad is not None and not isinstance(p.grad, DTensor):
                for grad in (p.grad, pe.grad):
                    dist.all_reduce(grad)
            r = named_ref[pname]
            if r.grad is None:
                assert p.grad is None and not p.requires_grad, f"step {step}: {pname} should be frozen"
            else:
                torch.testing.assert_close(_gathered(p.grad), r.grad, **TOL, msg=lambda m, n=pname: f"{n}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # the hooks' values are re-read from the user's module by the prologue of steps 2 and 3, which reuse step 1's
    assert thunder.cache_misses(jitted) == 1
    assert thunder.cache_hits(jitted) == STEPS - 1


def test_root_hook_values_are_guarded():
    """A value inside a root hook's closure is re-read on every call: changing it retraces, as eager sees it."""
    style = PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate(), use_local_output=True)
    torch.manual_seed(0)
    ref = nn.Linear(H, H).requires_grad_(False)  # inference: forward-only traces
    model = parallelize_module(copy.deepcopy(ref), mesh_1d(), style).requires_grad_(False)
    jitted = thunder.jit(model)
    x_full = make_full((4, H), seed=3)
    x = _local_piece(x_full, Shard(0))
    expected = ref(x_full)

    out = jitted(x)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, expected, **TOL)
    jitted(x)
    assert (thunder.cache_misses(jitted), thunder.cache_hits(jitted)) == (1, 1)

    style.use_local_output = False  # the hook's closure holds the style object: eager now returns a DTensor
    assert isinstance(model(x), DTensor)
    out = jitted(x)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    torch.testing.assert_close(out.full_tensor(), expected, **TOL)
    assert (thunder.cache_misses(jitted), thunder.cache_hits(jitted)) == (2, 1)
