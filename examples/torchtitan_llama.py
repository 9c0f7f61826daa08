"""torchtitan's recipe under thunder: Llama 3, torchtitan's own ``apply_tp``, then thunder.jit or thunderfx.

    torchrun --nproc-per-node 2 examples/torchtitan_llama.py [--thunderfx] [--loss-parallel] [--steps 3]

Uses torchtitan's Llama 3 when torchtitan is installed (``pip install torchtitan==0.2.0``), else the package's
copy of its features (``thunder_dtensor.testing.llama``). Each step prints the loss beside the one-process
model's and the largest gradient difference over all parameters.

On a machine without triton, ``import torchtitan`` fails in its MoE kernels (GPU code Llama 3 does not use);
this script stands in an empty module for them, so torchtitan's Llama 3 runs on CPU.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import types
from contextlib import nullcontext

import thunder_dtensor  # noqa: F401  (before thunder: makes thunder DTensor-aware)
from thunder_dtensor.testing import init_distributed, mesh_1d, shutdown_distributed

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F
from thunder.dynamo import thunderfx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def torchtitan_llama(vocab: int, seq: int) -> tuple[torch.nn.Module, object] | None:
    """torchtitan's Llama 3 (small) and its apply_tp, or None without torchtitan."""
    if importlib.util.find_spec("torchtitan") is None:
        return None
    if importlib.util.find_spec("triton") is None:
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = None
        sys.modules["torchtitan.models.moe.kernels"] = kernels
    from torchtitan.models.llama3.infra.parallelize import apply_tp
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(
        dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=vocab, max_seq_len=seq, multiple_of=16
    )
    model = Transformer(args)
    model.init_weights()

    def parallelize(m: torch.nn.Module, mesh: object, loss_parallel: bool) -> None:
        apply_tp(m, mesh, loss_parallel=loss_parallel, enable_float8_tensorwise_tp=False)

    return model, parallelize


def package_llama(vocab: int, seq: int) -> tuple[torch.nn.Module, object]:
    from thunder_dtensor.testing.llama import Llama, LlamaConfig, apply_tp

    def parallelize(m: torch.nn.Module, mesh: object, loss_parallel: bool) -> None:
        apply_tp(m, mesh, loss_parallel=loss_parallel)

    return Llama(LlamaConfig(vocab=vocab, seq=seq)), parallelize


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--thunderfx", action="store_true", help="thunder as torch.compile's backend")
    parser.add_argument("--loss-parallel", action="store_true", help="logits sharded over the vocabulary")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    init_distributed()
    vocab, seq = 64, 8
    torch.manual_seed(0)  # the same initial weights on every rank
    built = torchtitan_llama(vocab, seq)
    source = "torchtitan" if built is not None else "thunder_dtensor.testing.llama"
    ref, parallelize = built if built is not None else package_llama(vocab, seq)
    model = copy.deepcopy(ref)
    parallelize(model, mesh_1d(), args.loss_parallel)
    compiled = thunderfx(model) if args.thunderfx else thunder.jit(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rank0 = dist.get_rank() == 0
    if rank0:
        front = "thunderfx" if args.thunderfx else "thunder.jit"
        print(f"{source} Llama 3, apply_tp (loss_parallel={args.loss_parallel}), {front}")
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        tokens, labels = (torch.randint(0, vocab, (2, seq), generator=g) for _ in range(2))
        with loss_parallel() if args.loss_parallel else nullcontext():
            loss = cross_entropy(compiled(tokens), labels)
            loss.backward()
        ref_loss = cross_entropy(ref(tokens), labels)
        ref_loss.backward()
        worst = max((full(p.grad) - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
        if rank0:
            print(
                f"step {step}: loss {full(loss).item():.6f} (one process {ref_loss.item():.6f}), "
                f"largest gradient difference {worst:.2e}"
            )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    shutdown_distributed()


if __name__ == "__main__":
    main()
