"""Context parallelism on CPU: per-rank peak memory and step time of an attention block at cp = 2.

Run with ``torchrun --nproc-per-node 2 benchmarks/context_parallel.py`` (``make bench``). The workload is one
training step (forward, loss, backward) of an attention block (qkv projection, SDPA, output projection) on one
long sequence, where attention dominates the step. Variants, each rank holding half of the sequence:

- ``thunder_ring``: ``thunder.jit(block)`` under torch's ``context_parallel`` (ring attention, k / v all-gathered:
  torch's default rotation; ``--rotate alltoall`` for the ring of all-to-alls);
- ``eager_gathered``: eager DTensor, q / k / v ``Shard(2)`` under ``sdpa_kernel(MATH)``: DTensor all-gathers k / v
  and runs the math attention (eager's only CPU path: its flash-kernel strategy has no backward);
- ``limit``: the same step hand-written on local shards with torch's own ring (``_templated_ring_attention`` and
  its backward, the CPU flash kernel), run eagerly;
- ``unsharded`` / ``unsharded_eager``: the whole sequence on one rank under ``thunder.jit`` (plain thunder runs
  SDPA's math decomposition on CPU: its scores are seq x seq) and eagerly (the CPU flash kernel): the memory
  references; their times are not cp = 2 times.

Non-causal attention: the only mask the eager variant runs. Peak memory is the high-water mark of the process's
heap in use (glibc ``mallinfo2``, sampled every 0.2 ms in a thread) during one step, above what was in use before
it. Step times are medians of interleaved rounds (each step after a barrier, the maximum over ranks).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading
import time
from pathlib import Path

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor.testing import shutdown_distributed

import thunder
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _templated_ring_attention,
    _templated_ring_attention_backward,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class Block(nn.Module):
    """Attention (qkv projection, SDPA, output projection) and, with ``mlp``, a feed-forward of 4 x ``dim`` after it,
    each with a residual (a transformer layer without norms)."""

    def __init__(self, dim: int, heads: int, mlp: bool = False) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) if mlp else None

    def heads_of(self, x: torch.Tensor) -> tuple:
        b, s, d = x.shape
        return self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)

    def merge(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = y.shape
        h = self.out(y.transpose(1, 2).reshape(b, s, -1))
        if self.mlp is None:
            return h
        h = h + x
        return h + self.mlp(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merge(F.scaled_dot_product_attention(*self.heads_of(x)), x)


class TorchRing(torch.autograd.Function):
    """torch's own ring attention on local shards, forward and backward (the limit)."""

    @staticmethod
    def forward(ctx, group, q, k, v):
        out, lse = _templated_ring_attention(group, 2, FLASH, query=q, key=k, value=v, is_causal=False)[:2]
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _templated_ring_attention_backward(
            ctx.group,
            2,
            FLASH_BACKWARD,
            grad_out=grad.contiguous(),
            grad_out_name="grad_out",
            query=q,
            key=k,
            value=v,
            out=out,
            logsumexp=lse,
            is_causal=False,
            dropout_p=0.0,
        )[:3]
        return None, dq, dk, dv


class HeapPeak:
    """The high-water mark of glibc's heap in use (small blocks and mmapped ones) while the block runs."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL("libc.so.6")
        fields = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]
        self.Info = type("mallinfo2", (ctypes.Structure,), {"_fields_": fields})
        self.libc.mallinfo2.restype = self.Info

    def in_use(self) -> int:
        info = self.libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def __enter__(self):
        self.base = self.peak = self.in_use()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.in_use())
            time.sleep(0.0002)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.in_use())

    @property
    def above_base_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rotate", default="allgather", choices=["allgather", "alltoall"])
    parser.add_argument("--mlp", action="store_true", help="a feed-forward of 4 x dim after the attention")
    parser.add_argument("--out", default="benchmarks/results/context_parallel")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    set_rotate_method(args.rotate)
    torch.manual_seed(0)
    block = Block(args.dim, args.heads, mlp=args.mlp)
    x = torch.randn(1, args.seq, args.dim)
    shard = x.chunk(n, dim=1)[rank].contiguous()  # (non-causal: the contiguous layout)
    jitted = thunder.jit(block)

    def thunder_ring() -> None:
        xs = x.clone()
        _cp_options.enable_load_balance = False
        with context_parallel(mesh, buffers=[xs], buffer_seq_dims=[1]):
            jitted(xs).square().mean().backward()

    def eager_gathered() -> None:
        q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in block.heads_of(shard))
        with sdpa_kernel([SDPBackend.MATH]):
            y = F.scaled_dot_product_attention(q, k, v)
        block.merge(y.to_local(), shard).square().mean().backward()

    def limit() -> None:
        q, k, v = (t.contiguous() for t in block.heads_of(shard))
        block.merge(TorchRing.apply(mesh.get_group(), q, k, v), shard).square().mean().backward()

    whole = thunder.jit(block)

    def unsharded() -> None:
        whole(x).square().mean().backward()

    def unsharded_eager() -> None:
        block(x).square().mean().backward()

    variants = {
        "thunder_ring": thunder_ring,
        "eager_gathered": eager_gathered,
        "limit": limit,
        "unsharded": unsharded,
        "unsharded_eager": unsharded_eager,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    memory: dict[str, float] = {}
    for name, step in variants.items():  # warm-up (traces, the first decomposition), then one step's peak heap
        step()
        block.zero_grad(set_to_none=True)
        dist.barrier()
        with HeapPeak() as heap:
            step()
        block.zero_grad(set_to_none=True)
        peak = torch.tensor(heap.above_base_mb)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        memory[name] = peak.item()
    for _ in range(args.rounds):
        for name, step in variants.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
            block.zero_grad(set_to_none=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    # the cp step's share of the whole step: the limit and eager also hold half the sequence per rank
    result = {
        "workload": f"{'transformer layer' if args.mlp else 'attention block'}, seq {args.seq}, dim {args.dim}, "
        f"{args.heads} heads, cp = {n}, "
        f"rotation {args.rotate}, non-causal",
        "median_step_s": median,
        "peak_heap_mb": memory,
        "thunder_ring_x_limit": median["thunder_ring"] / median["limit"],
        "thunder_ring_x_eager_gathered": median["thunder_ring"] / median["eager_gathered"],
        "peak_memory_cp_x_unsharded": memory["thunder_ring"] / memory["unsharded"],
        "peak_memory_cp_x_unsharded_eager": memory["thunder_ring"] / memory["unsharded_eager"],
        "limit_peak_memory_x_unsharded_eager": memory["limit"] / memory["unsharded_eager"],
        "rounds": args.rounds,
    }
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"{args.rotate}{'_mlp' if args.mlp else ''}.json"
        (out / name).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    shutdown_distributed()


if __name__ == "__main__":
    main()
