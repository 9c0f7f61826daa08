"""A small GPT-style Transformer and its tensor-parallel / sequence-parallel plans, for tests and examples.

Token and position embeddings with weight tying, N blocks of LayerNorm -> causal SDPA attention ->
residual -> LayerNorm -> GELU MLP -> residual, a final norm and an output head. Attention reads the local
head count from its inputs, so the same code runs whole or with heads sharded over a mesh.

:class:`CausalAttention`: one causal attention layer alone (qkv projection, SDPA, output projection), the
smallest model of context parallelism (torch's ``context_parallel`` recipe).

:func:`writes_that_overlap`: writes into overlapping views and into the viewed tensor itself (plain tensors and
DTensors alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    heads: int = 4
    layers: int = 2
    dropout: float = 0.0
    #: attention written as matmul + softmax instead of fused SDPA (eager DTensor on CPU lacks a fused strategy)
    unfused_attention: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout
        self.unfused = cfg.unfused_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        heads = q.shape[-1] // self.head_dim  # the local head count under tensor parallelism
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.unfused:
            scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            y = F.dropout(scores.softmax(-1), self.dropout, self.training) @ v
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        y = y.transpose(1, 2).reshape(b, t, heads * self.head_dim)
        return self.wo(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc2(F.gelu(self.fc1(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tensor_parallel_plan(cfg: GPTConfig, *, sequence_parallel: bool) -> dict:
    """The parallelize_module plan: Megatron-style TP, optionally with sequence parallelism (SP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        plan = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        }
        for i in range(cfg.layers):
            plan |= {
                f"blocks.{i}.attn.wq": ColwiseParallel(),
                f"blocks.{i}.attn.wk": ColwiseParallel(),
                f"blocks.{i}.attn.wv": ColwiseParallel(),
                f"blocks.{i}.attn.wo": RowwiseParallel(),
                f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                f"blocks.{i}.mlp.fc2": RowwiseParallel(use_local_output=False),
                f"blocks.{i}.mlp": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate()),
            }
        return plan

    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        # the position embedding is (seq, dim): shard it on seq to add it to the sequence-sharded stream
        "pos_emb": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=False
        ),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(cfg.layers):
        plan |= {
            f"blocks.{i}.ln1": SequenceParallel(),
            f"blocks.{i}.attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            f"blocks.{i}.attn.wq": ColwiseParallel(),
            f"blocks.{i}.attn.wk": ColwiseParallel(),
            f"blocks.{i}.attn.wv": ColwiseParallel(),
            f"blocks.{i}.attn.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"blocks.{i}.ln2": SequenceParallel(),
            f"blocks.{i}.mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            f"blocks.{i}.mlp.fc1": ColwiseParallel(),
            f"blocks.{i}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
    return plan


def parallelize(model: GPT, mesh: torch.distributed.DeviceMesh, *, sequence_parallel: bool) -> GPT:
    """Apply the plan and re-tie the output head to the (now vocab-sharded) token embedding."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, tensor_parallel_plan(model.cfg, sequence_parallel=sequence_parallel))
    model.head.weight = model.tok_emb.weight
    return model


class CausalAttention(nn.Module):
    """qkv projection, causal SDPA over ``heads`` heads, output projection."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def writes_that_overlap(x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Two writes into overlapping views of ``x * 2``, then one into the viewed tensor itself: both views see it."""
    y = x * 2
    rows, cols = y[1:3], y[:, 2:]
    rows.mul_(b)
    cols.t()[0].add_(1.5)  # through a view of a view, overlapping the first write
    y.mul_(x)
    return rows * 2, cols, y
