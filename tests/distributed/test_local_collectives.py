"""Model-library code that leaves DTensors for local tensors and calls collectives itself (transformers' MoE
experts): custom ``autograd.Function``s given a ProcessGroup that ``dist.all_reduce`` in the forward (in place)
or in the backward, between ``to_local()`` and ``DTensor.from_local``, under ``thunder.jit``: eager's values
and gradients."""

from __future__ import annotations

from thunder_dtensor.testing import make_full, mesh_1d

import thunder
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()  # (transformers': the incoming gradient itself, all-reduced in place)
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _program(x: DTensor, w: DTensor) -> DTensor:
    mesh = x.device_mesh
    local = x.to_local()
    shared = local * 3  # its gradient flows to the custom Function and to the sum below
    reduced = _AllReduceBackward.apply(shared.view(-1), mesh.get_group()).view(shared.shape)
    summed = _AllReduceForward.apply(reduced * w.to_local() + shared, mesh.get_group())
    return DTensor.from_local(summed.sin(), mesh, [Replicate()], run_check=False)


def _run(fn) -> list[torch.Tensor]:
    mesh = mesh_1d()
    x = distribute_tensor(make_full((4, 6), seed=40), mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(make_full((4, 6), seed=41), mesh, [Shard(1)]).requires_grad_()
    out = fn(x, w)
    out.to_local().sum().backward()
    return [out.full_tensor(), x.grad.full_tensor(), w.grad.full_tensor()]


def test_custom_functions_calling_collectives_on_local_tensors():
    for got, expected in zip(_run(thunder.jit(_program)), _run(_program)):
        torch.testing.assert_close(got, expected)
