"""A small Llama 3 with torchtitan's features and torchtitan's tensor-parallel plan, for tests and examples.

Why not torchtitan itself: torchtitan 0.2.0 installs from the package registry, but ``import torchtitan``
imports its MoE kernels, which import triton (a GPU compiler, ~290 MB, not installed on CPU machines), so it
does not import cleanly on a fresh CPU machine. This model has each feature of torchtitan's Llama 3 that
matters to tracing and sharding:

- rotary embeddings through complex numbers: a complex64 ``freqs_cis`` buffer (``torch.polar``, not saved in
  the state dict), ``view_as_complex`` -> complex ``mul`` -> ``view_as_real``;
- grouped-query attention (fewer key/value heads than query heads, repeated to match), head count read from
  the local shapes so the same code runs whole or with heads sharded;
- ``nn.RMSNorm``, a SwiGLU feed-forward without biases, causal SDPA entered through
  ``torch.nn.attention.sdpa_kernel`` with torchtitan's backend list and ``set_priority=True``;
- :func:`apply_tp` is torchtitan's ``apply_tp`` plan (embedding rowwise to sequence shards, sequence-parallel
  norms, ``PrepareModuleInput`` before attention and feed-forward, colwise/rowwise projections, the output
  layer colwise, sharded over the vocabulary with ``loss_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["LlamaConfig", "Llama", "apply_tp", "llama_loss"]

#: torchtitan's order of preference for SDPA kernels
SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
]


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    seq: int = 8
    dim: int = 32
    heads: int = 8
    kv_heads: int = 4
    layers: int = 2
    ffn_hidden: int = 48
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def rotary_frequencies(head_dim: int, seq: int, theta: float) -> torch.Tensor:
    """``exp(i * position * frequency)`` as complex64, one row per position."""
    inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inverse)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x``'s last dim (batch, seq, heads, head_dim) by the position's complex frequency."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotation = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(pairs * rotation).flatten(3).type_as(x)


def repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """(batch, seq, kv_heads, head_dim) -> (batch, seq, kv_heads * repeats, head_dim)."""
    if repeats == 1:
        return x
    b, t, kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(b, t, kv_heads, repeats, head_dim).reshape(b, t, kv_heads * repeats, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.repeats = cfg.heads // cfg.kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: the local head counts when the projections are sharded over heads
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        k, v = repeat_kv(k, self.repeats), repeat_kv(v, self.repeats)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        freqs = rotary_frequencies(cfg.dim // cfg.heads, cfg.seq, cfg.rope_theta)
        self.register_buffer("freqs_cis", freqs, persistent=False)
        with torch.no_grad():  # non-trivial norm weights, so their sharding and gradients are visible
            for module in self.modules():
                if isinstance(module, nn.RMSNorm):
                    module.weight.uniform_(0.5, 1.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def llama_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross entropy: float logits, mean over every token."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def apply_tp(model: Llama, tp_mesh: torch.distributed.DeviceMesh, *, loss_parallel: bool) -> Llama:
    """torchtitan's tensor + sequence parallel plan for Llama 3, applied in place; returns ``model``."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    return model
