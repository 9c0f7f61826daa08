"""Hand-written limits of the bench's models: the same module code on this rank's shards, with explicit collectives.

Each limit is what a Megatron-style tensor-parallel program written by hand does: plain tensors (this rank's
shards of the full model's weights, cut as the model's ``parallelize_module`` plan cuts them) and the
collectives eager DTensor runs for that plan, no more: ``torch.distributed._functional_collectives``, each in a
small ``autograd.Function`` with the collective of its gradient (none where a replicated value's needs none).
Gradients come out with eager DTensor's values, placed as eager places them except where a limit says
otherwise (``grad_placements``; ``check_against``, run by the bench before timing). ``bench.py`` runs each
eagerly (``limit``) and ``torch.compile``d (``limit_compiled``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

SEQ = 1  # the sequence dim of (batch, seq, features) activations
#: how close a limit's loss and gradients must be to eager DTensor's (float32, other summation orders)
LIMIT_TOL = {"rtol": 1e-4, "atol": 1e-5}

# the "_single" names are torch >= 2.11's; older releases (torch 2.10, the GPU bench's) have the others only
_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def all_gather_dim(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` (a functional all-gather, waited on: a plain tensor)."""
    return funcol.wait_tensor(_gather(t.contiguous(), dim, group))


def reduce_scatter_dim(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's part along ``dim`` of the sum of every rank's ``t`` (a functional reduce-scatter, waited on)."""
    return funcol.wait_tensor(_scatter(t.contiguous(), "sum", dim, group))


class _SequenceCollective(torch.autograd.Function):
    """Sequence shards -> the whole sequence on every rank (``gather``), or partial sums over the whole sequence ->
    this rank's sequence shard of their sum (not ``gather``); the gradient takes the other collective back."""

    @staticmethod
    def forward(ctx, x, group, gather):  # noqa: ANN001, ANN205
        ctx.group, ctx.gather = group, gather
        return (all_gather_dim if gather else reduce_scatter_dim)(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return (reduce_scatter_dim if ctx.gather else all_gather_dim)(grad, SEQ, ctx.group), None, None


def _gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _SequenceCollective.apply(x, group, True)


def _reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _SequenceCollective.apply(x, group, False)


class _GatherReplicated(torch.autograd.Function):
    """All-gather along ``dim`` into a value every rank holds (eager's ``Shard(dim) -> Replicate``); the
    gradient, the same on every rank, is this rank's part of it (no collective)."""

    @staticmethod
    def forward(ctx, x, dim, group, rank, size):  # noqa: ANN001, ANN205
        ctx.dim, ctx.rank, ctx.size = dim, rank, size
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad.chunk(ctx.size, ctx.dim)[ctx.rank], None, None, None, None


class _SliceReplicated(torch.autograd.Function):
    """This rank's part along ``dim`` of a value every rank holds (eager's ``Replicate -> Shard(dim)``); the
    gradient is all-gathered back into the whole (eager's backward of that redistribution)."""

    @staticmethod
    def forward(ctx, x, dim, group, rank, size):  # noqa: ANN001, ANN205
        ctx.dim, ctx.group = dim, group
        return x.chunk(size, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None, None, None


class _SplitBias(torch.autograd.Function):
    """A replicated bias added to partial sums: each rank adds ``bias / size`` (as eager DTensor does), and its
    gradient is the whole one on every rank (eager's is ``Replicate``)."""

    @staticmethod
    def forward(ctx, bias, size):  # noqa: ANN001, ANN205
        return bias / size

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


class RowwiseToSeqShards(nn.Module):
    """A row-parallel linear (this rank's input columns) whose partial outputs are reduce-scattered over the
    sequence (``RowwiseParallel(output_layouts=Shard(1))``)."""

    def __init__(self, full: nn.Linear, group: Any, rank: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(size, 1)[rank].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        self.group, self.size = group, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else _SplitBias.apply(self.bias, self.size)
        return _reduce_scatter_seq(F.linear(x, self.weight, bias), self.group)


class ColwiseToReplicated(nn.Module):
    """A column-parallel linear on the whole sequence whose output columns are all-gathered for every rank
    (``ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())``: the sequence is gathered first)."""

    def __init__(self, weight: nn.Parameter, group: Any, rank: int, size: int) -> None:
        super().__init__()
        self.weight = weight
        self.group, self.rank, self.size = group, rank, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(_gather_seq(x, self.group), self.weight)
        return _GatherReplicated.apply(local, local.dim() - 1, self.group, self.rank, self.size)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary; tokens outside them look up zeros, and the partial embeddings are
    reduce-scattered over the sequence (``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``)."""

    def __init__(self, full: nn.Embedding, group: Any, rank: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(size, 0)[rank].clone())
        self.first = rank * self.weight.shape[0]
        self.group = group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return _reduce_scatter_seq(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


def _shard_colwise(linear: nn.Linear, rank: int, size: int) -> None:
    """``ColwiseParallel()``: this rank's output features (weight rows, bias entries)."""
    linear.weight = nn.Parameter(linear.weight.detach().chunk(size, 0)[rank].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().chunk(size, 0)[rank].clone())


def _gather_seq_first_arg(group: Any):  # noqa: ANN202
    """A forward pre-hook: ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())`` on
    the first argument."""

    def hook(_module: nn.Module, args: tuple) -> tuple:
        return (_gather_seq(args[0], group), *args[1:])

    return hook


class _LocalModelLimit:
    """The common part: parameters by name, the loss (the same on every rank) and the check against eager."""

    loss_is_partial = False

    def __init__(self, model: nn.Module, mesh: Any, loss: Any, grad_placements: dict | None = None) -> None:
        self.model, self.mesh, self._loss = model, mesh, loss
        #: where this program keeps a gradient other than as eager DTensor does (by parameter name)
        self.grad_placements = grad_placements or {}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)

    def loss(self, out: torch.Tensor, target: Any) -> torch.Tensor:
        return self._loss(out, target)

    def check_against(self, eager_model: nn.Module, eager_loss: torch.Tensor, limit_loss: torch.Tensor) -> None:
        """Loss and every gradient (whole values) equal eager DTensor's; each gradient is placed as eager's unless
        ``grad_placements`` says otherwise. Raises otherwise."""
        full_loss = eager_loss.full_tensor() if isinstance(eager_loss, DTensor) else eager_loss
        torch.testing.assert_close(limit_loss.detach(), full_loss.detach(), **LIMIT_TOL, msg=lambda m: f"loss: {m}")
        ours = dict(self.model.named_parameters())
        for name, p in eager_model.named_parameters():
            grad, expected = ours[name].grad, p.grad
            if isinstance(expected, DTensor):
                placements = self.grad_placements.get(name, expected.placements)
                grad = DTensor.from_local(grad, self.mesh, placements, run_check=False).full_tensor()
                expected = expected.full_tensor()
            torch.testing.assert_close(grad, expected, **LIMIT_TOL, msg=lambda m, n=name: f"{n}: {m}")


def limit_llama(full: nn.Module, mesh: Any, loss: Any) -> _LocalModelLimit:
    """torchtitan's ``apply_tp`` (``thunder_dtensor.testing.llama``, no loss parallelism) written by hand."""
    group, rank, size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    model = copy.deepcopy(full)
    model.tok_embeddings = VocabParallelEmbedding(full.tok_embeddings, group, rank, size)
    for block in model.layers.values():
        attention, ffn = block.attention, block.feed_forward
        for linear in (attention.wq, attention.wk, attention.wv, ffn.w1, ffn.w3):
            _shard_colwise(linear, rank, size)
        attention.wo = RowwiseToSeqShards(attention.wo, group, rank, size)
        ffn.w2 = RowwiseToSeqShards(ffn.w2, group, rank, size)
        attention.register_forward_pre_hook(_gather_seq_first_arg(group))
        ffn.register_forward_pre_hook(_gather_seq_first_arg(group))
    model.output = ColwiseToReplicated(
        nn.Parameter(full.output.weight.detach().chunk(size, 0)[rank].clone()), group, rank, size
    )
    # eager DTensor gives the vocabulary-sharded embedding a replicated (whole) gradient; by hand it stays sharded
    return _LocalModelLimit(model, mesh, loss, {"tok_embeddings.weight": (Shard(0),)})


class _SeqShardedPositions(nn.Module):
    """The position embedding's rows for this rank's positions (``PrepareModuleOutput(Replicate -> Shard(0))``)."""

    def __init__(self, full: nn.Embedding, group: Any, rank: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().clone())
        self.group, self.rank, self.size = group, rank, size

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return _SliceReplicated.apply(F.embedding(positions, self.weight), 0, self.group, self.rank, self.size)


def limit_gpt(full: nn.Module, mesh: Any, loss: Any) -> _LocalModelLimit:
    """``thunder_dtensor.testing.models.parallelize(..., sequence_parallel=True)`` written by hand (the output
    head shares the vocabulary-parallel embedding's rows)."""
    group, rank, size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    model = copy.deepcopy(full)
    model.tok_emb = VocabParallelEmbedding(full.tok_emb, group, rank, size)
    model.pos_emb = _SeqShardedPositions(full.pos_emb, group, rank, size)
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        for linear in (attn.wq, attn.wk, attn.wv, mlp.fc1):
            _shard_colwise(linear, rank, size)
        attn.wo = RowwiseToSeqShards(attn.wo, group, rank, size)
        mlp.fc2 = RowwiseToSeqShards(mlp.fc2, group, rank, size)
        attn.register_forward_pre_hook(_gather_seq_first_arg(group))
        mlp.register_forward_pre_hook(_gather_seq_first_arg(group))
    model.head = ColwiseToReplicated(model.tok_emb.weight, group, rank, size)
    return _LocalModelLimit(model, mesh, loss)
