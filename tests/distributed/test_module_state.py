"""Module state a forward writes under no_grad (a KV cache, a step counter, running statistics) keeps eager's values
after every call, on every rank, for plain and sharded modules, under ``thunder.jit`` and thunderfx: three calls,
then every buffer (full tensors) and the outputs against the same module run eagerly."""

from __future__ import annotations

import contextlib
import copy

from thunder_dtensor import fixes
from thunder_dtensor.testing import mesh_1d

import pytest
import thunder
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

WIDTH, SLOTS = 8, 6


class StatefulBlock(torch.nn.Module):
    """A linear layer with the three kinds of state a serving or training forward writes under no_grad: a cache
    written at a position (``index_copy_``), a counter reassigned (``self.steps = self.steps + 1``) and running
    statistics updated in place (``mul_`` / ``add_``), plus BatchNorm's own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.norm = torch.nn.BatchNorm1d(WIDTH)
        self.register_buffer("cache", torch.zeros(SLOTS, WIDTH))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("running", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(x))
        with torch.no_grad():
            self.cache.index_copy_(0, self.steps.view(1), h.detach().mean(0, keepdim=True))
            self.running.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
            self.steps = self.steps + 1
        return h * self.running + self.cache.sum(0)


def _sharded(module: StatefulBlock) -> StatefulBlock:
    """The weight sharded by rows, the cache by columns, the running statistics replicated (DTensor buffers);
    no BatchNorm (eager DTensor cannot run it with plain parameters)."""
    mesh = mesh_1d()
    module.norm = torch.nn.Identity()
    module.proj.weight = torch.nn.Parameter(distribute_tensor(module.proj.weight.detach(), mesh, [Shard(0)]))
    module.cache = distribute_tensor(module.cache, mesh, [Shard(1)])
    module.running = distribute_tensor(module.running, mesh, [Replicate()])
    return module


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compile(module: torch.nn.Module, frontend: str) -> torch.nn.Module:
    if frontend == "jit":
        return thunder.jit(module)
    from thunder.dynamo import thunderfx

    torch._dynamo.reset()
    return thunderfx(module)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("frontend", ["jit", "thunderfx"])
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_state_written_in_the_forward_keeps_eager_values(frontend, sharded, grad):
    """The plain module is a plain program: thunder's fixes act there when switched on everywhere (a root module's
    reassigned buffer is lost by thunder 0.2.6 alone, see ``test_fix_switches``)."""
    with contextlib.ExitStack() as scope:
        if not sharded:
            scope.enter_context(fixes.enabled("all", everywhere=True))
        _check_three_calls(frontend, sharded, grad)


def _check_three_calls(frontend: str, sharded: bool, grad: bool) -> None:
    torch.manual_seed(0)
    eager = StatefulBlock()
    compiled_module = copy.deepcopy(eager)
    if sharded:
        eager, compiled_module = _sharded(eager), _sharded(compiled_module)
    compiled = _compile(compiled_module, frontend)
    for step in range(3):
        x = torch.randn(4, WIDTH)
        x_dt = distribute_tensor(x, mesh_1d(), [Replicate()]) if sharded else x
        with torch.set_grad_enabled(grad):
            expected, actual = eager(x_dt), compiled(x_dt)
        torch.testing.assert_close(_full(actual), _full(expected), msg=f"call {step}")
        holder = compiled if frontend == "jit" else compiled_module  # (thunder.jit's module holds a reassigned buffer)
        held = dict(holder.named_buffers())
        for name, buffer in eager.named_buffers():
            got = held[name]
            assert isinstance(got, DTensor) == isinstance(buffer, DTensor), name
            if isinstance(buffer, DTensor):
                assert got.placements == buffer.placements, name
            torch.testing.assert_close(_full(got), _full(buffer), msg=f"call {step}, buffer {name}")
