"""Step time and first-call time of tensor-parallel training steps: eager DTensor, torch.compile, thunder.

Run with ``torchrun --nproc-per-node 2 benchmarks/bench.py`` (gloo on CPU) or ``--nproc-per-node 1`` on one
GPU (NCCL, see scripts/gpu_bench.sh). Each workload is one optimizer-free training step (forward, loss,
backward; gradients set to None between steps) of a tensor-parallel model, run by every variant:

- ``eager``: the DTensor model as ``parallelize_module`` leaves it;
- ``torch.compile``: ``torch.compile(model)`` (inductor, compiled from a fresh, empty cache);
- ``thunder_off`` / ``thunder_on``: ``thunder.jit(model, dtensor_lowering=False / True)`` (per-prim eager
  DTensor ops vs the lowering to local ops and explicit collectives);
- ``thunder_on_early``: ``thunder_on`` with ``dtensor_issue_early=True`` (each collective issued as early as its
  inputs allow);
- ``thunder_on_tcex``: ``thunder_on`` with thunder's torch.compile executor listed first
  (``executors=[torch_compile_ex, *thunder.get_default_executors()]``): inductor compiles the lowered program,
  collectives included; ``thunder_on_tcex_loss``: the same with the loss inside the jitted function (the DTensor
  boundary: no eager DTensor op after the program);
- ``limit`` / ``limit_compiled``: the same math written by hand on local shards with explicit functional
  collectives (the block with a hand-written backward, the models in ``model_limits.py``), run eagerly and
  ``torch.compile``d; the faster of the two is the limit.

Method (docs: benchmarks/README.md): per workload and size, every variant's first call is timed (trace /
compile plus the first step), then each is warmed up, then the variants run in interleaved rounds
(A B C D A B C D ...). Each timed step starts after a barrier; its time is the maximum over ranks. The
report gives medians and ratios; absolute times of different runs on a shared machine are not comparable.
"""

from __future__ import annotations

import os
import tempfile
import time

_PROCESS_START = time.perf_counter()  # the reported wall time includes the imports

# a fresh, private inductor cache: each compiling variant's first call pays a full compile, as on a new machine
# (set before torch is imported: inductor reads it at import; each variant gets a folder of its own in it)
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="thunder_dtensor_bench_inductor_")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import thunder_dtensor  # noqa: E402  (before thunder: makes thunder importable on torch >= 2.13)
from thunder_dtensor.testing import device_type, init_distributed, mesh_1d, shutdown_distributed  # noqa: E402
from thunder_dtensor.testing.llama import Llama, LlamaConfig, apply_tp, llama_loss  # noqa: E402
from thunder_dtensor.testing.models import GPT, GPTConfig, loss_fn, parallelize  # noqa: E402

import thunder  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from model_limits import (  # noqa: E402  (benchmarks/, next to this file)
    LIMIT_TOL,
    SEQ,
    all_gather_dim,
    limit_gpt,
    limit_llama,
    reduce_scatter_dim,
)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VARIANTS = (
    "eager",
    "torch.compile",
    "thunder_off",
    "thunder_on",
    "thunder_on_early",
    "thunder_on_tcex",
    "thunder_on_tcex_loss",
    "limit",
    "limit_compiled",
)
#: the hand-written local program, run op by op and compiled: the limit is the faster of the two
LIMITS = ("limit", "limit_compiled")
BLOCK_TOKENS = 256
#: limit vs eager DTensor (fp32; the limit sums in a different order)


def _log(*args: Any) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device_type())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _all_ranks_ok(ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0], device=device_type())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _is0() -> bool:
    return dist.get_rank() == 0


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------------------------------
# Workload 1: the sequence-parallel LayerNorm + MLP block, and its hand-written limit
# ---------------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SPBlock(nn.Module):
    """x + MLP(LayerNorm(x)): the norm runs on sequence shards, the MLP colwise -> rowwise between them."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def sp_block_plan() -> dict:
    return {
        "norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def block_loss(out: torch.Tensor, _target: Any = None) -> torch.Tensor:
    return out.pow(2).mean()


class _LimitBlockFn(torch.autograd.Function):
    """The SP block on local shards; forward and backward by hand, with the collectives eager DTensor does.

    Forward: layer_norm(x_shard) -> all_gather(seq) -> colwise linear -> gelu -> rowwise linear ->
    reduce_scatter(seq) -> + bias + x. Backward: all_gather(seq) of the output's cotangent, the local matmul
    and gelu backward, reduce_scatter(seq) of the norm output's cotangent, layer_norm backward. Gradients get
    eager DTensor's placements: fc1 Shard(0), fc2 weight Shard(1), fc2 bias Replicate (each rank sums the
    gathered cotangent), norm weight and bias Partial(sum) (no collective, as eager).
    """

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w1, b1, w2, b2, group, eps):  # noqa: ANN001, ANN205
        hidden = x.shape[-1]
        z, mean, rstd = torch.ops.aten.native_layer_norm(x, [hidden], ln_w, ln_b, eps)
        zg = all_gather_dim(z, SEQ, group)
        a = F.linear(zg, w1, b1)
        g = F.gelu(a)
        y = reduce_scatter_dim(F.linear(g, w2), SEQ, group)
        ctx.save_for_backward(x, ln_w, ln_b, mean, rstd, zg, a, g, w1, w2)
        ctx.group = group
        return x + y + b2

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        x, ln_w, ln_b, mean, rstd, zg, a, g, w1, w2 = ctx.saved_tensors
        hidden = x.shape[-1]
        dyg = all_gather_dim(dout, SEQ, ctx.group)
        dyg2 = dyg.reshape(-1, hidden)
        db2 = dyg2.sum(0)
        dw2 = dyg2.t() @ g.reshape(-1, g.shape[-1])
        da = torch.ops.aten.gelu_backward(dyg @ w2, a)
        da2 = da.reshape(-1, da.shape[-1])
        dw1 = da2.t() @ zg.reshape(-1, hidden)
        db1 = da2.sum(0)
        dz = reduce_scatter_dim(da @ w1, SEQ, ctx.group)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        dx_norm, dln_w, dln_b = torch.ops.aten.native_layer_norm_backward(dz, x, [hidden], mean, rstd, ln_w, ln_b, mask)
        dx = dout + dx_norm if ctx.needs_input_grad[0] else None
        return dx, dln_w, dln_b, dw1, db1, dw2, db2, None, None


class LimitBlock:
    """Plain tensors: this rank's sequence shard of x and its shards of the weights (cut from the full block)."""

    #: each rank's loss is its part of eager DTensor's Partial mean
    loss_is_partial = True

    #: each parameter's gradient placement, the same as eager DTensor's (checked at start)
    GRAD_PLACEMENTS = {
        "norm.weight": Partial(),
        "norm.bias": Partial(),
        "mlp.fc1.weight": Shard(0),
        "mlp.fc1.bias": Shard(0),
        "mlp.fc2.weight": Shard(1),
        "mlp.fc2.bias": Replicate(),
    }

    def __init__(self, full: SPBlock, mesh: Any) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        rank, size = mesh.get_local_rank(), mesh.size()
        state = {k: v.detach() for k, v in full.named_parameters()}
        shards = {
            "norm.weight": state["norm.weight"],
            "norm.bias": state["norm.bias"],
            "mlp.fc1.weight": state["mlp.fc1.weight"].chunk(size, 0)[rank],
            "mlp.fc1.bias": state["mlp.fc1.bias"].chunk(size, 0)[rank],
            "mlp.fc2.weight": state["mlp.fc2.weight"].chunk(size, 1)[rank],
            "mlp.fc2.bias": state["mlp.fc2.bias"],
        }
        self.params = {k: nn.Parameter(v.clone().contiguous()) for k, v in shards.items()}
        self.eps = full.norm.eps
        self.numel = 0

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params.values())

    def __call__(self, x: DTensor) -> torch.Tensor:
        p = self.params
        local = x.to_local() if isinstance(x, DTensor) else x
        self.numel = x.numel()  # the global element count, for the mean
        return _LimitBlockFn.apply(
            local,
            p["norm.weight"],
            p["norm.bias"],
            p["mlp.fc1.weight"],
            p["mlp.fc1.bias"],
            p["mlp.fc2.weight"],
            p["mlp.fc2.bias"],
            self.group,
            self.eps,
        )

    def loss(self, out: torch.Tensor, _target: Any = None) -> torch.Tensor:
        """This rank's part of the mean: eager DTensor's loss is Partial(avg), no collective either."""
        return out.pow(2).sum() / self.numel

    def check_against(self, eager_model: nn.Module, eager_loss: torch.Tensor, limit_loss: torch.Tensor) -> None:
        """Loss and every gradient (full values and placements) equal eager DTensor's; raises otherwise."""
        total = limit_loss.detach().clone()
        dist.all_reduce(total, group=self.group)
        torch.testing.assert_close(total, _full(eager_loss).detach(), **LIMIT_TOL, msg=lambda m: f"loss: {m}")
        for name, p in eager_model.named_parameters():
            ours = self.params[name].grad
            if not isinstance(p.grad, DTensor) or p.grad.placements != (self.GRAD_PLACEMENTS[name],):
                raise AssertionError(f"{name}: eager's gradient placement {getattr(p.grad, 'placements', None)}")
            ours_full = DTensor.from_local(ours, self.mesh, [self.GRAD_PLACEMENTS[name]], run_check=False)
            torch.testing.assert_close(
                ours_full.full_tensor(), p.grad.full_tensor(), **LIMIT_TOL, msg=lambda m, n=name: f"{n}: {m}"
            )


# ---------------------------------------------------------------------------------------------------------
# Workload 4: FSDP2 over a stack of LayerNorm + MLP blocks, and its hand-written limit
# ---------------------------------------------------------------------------------------------------------


class FSDPBlock(nn.Module):
    """x + fc2(gelu(fc1(LayerNorm(x)))) on plain tensors: FSDP2 shards its parameters, not its activations."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class FSDPStack(nn.Module):
    def __init__(self, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([FSDPBlock(hidden) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _padded_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def _gather_block(shard: torch.Tensor, shapes: list, group: Any, world: int) -> list[torch.Tensor]:
    """The block's parameters whole, from each rank's flat shard (FSDP2's layout: dim-0 chunks, padded)."""
    gathered = shard.new_empty((world * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_into_tensor(gathered, shard, group=group)
    gathered = gathered.view(world, -1)
    params, offset = [], 0
    for shape in shapes:
        rows = _padded_rows(shape[0], world)
        n = rows * int(torch.Size(shape[1:]).numel())
        params.append(gathered[:, offset : offset + n].reshape(world * rows, *shape[1:])[: shape[0]])
        offset += n
    return params


def _reduce_scatter_block(grads: list[torch.Tensor], group: Any, world: int) -> torch.Tensor:
    """This rank's flat shard of the gradients, averaged over the ranks (FSDP2's reduce-scatter)."""
    columns = []
    for g in grads:
        padded = g.new_zeros((world * _padded_rows(g.shape[0], world), *g.shape[1:]))
        padded[: g.shape[0]].copy_(g)
        columns.append(padded.view(world, -1))
    flat = torch.cat(columns, dim=1).view(-1)
    out = flat.new_empty((flat.numel() // world,))
    dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.AVG, group=group)
    return out


class _LimitFSDPBlockFn(torch.autograd.Function):
    """One FSDP2 block by hand: all-gather of the flat shard, the block's math with a hand-written backward,
    the parameters freed after the forward and gathered again in the backward, one reduce-scatter."""

    @staticmethod
    def forward(ctx, x, shard, shapes, group, world, eps):  # noqa: ANN001, ANN205
        ln_w, ln_b, w1, b1, w2, b2 = _gather_block(shard, shapes, group, world)
        hidden = x.shape[-1]
        z, mean, rstd = torch.ops.aten.native_layer_norm(x, [hidden], ln_w, ln_b, eps)
        a = F.linear(z, w1, b1)
        g = F.gelu(a)
        ctx.save_for_backward(x, shard, mean, rstd, z, a, g)
        ctx.shapes, ctx.group, ctx.world = shapes, group, world
        return x + F.linear(g, w2, b2)

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        x, shard, mean, rstd, z, a, g = ctx.saved_tensors
        # gathered again, as FSDP2 does after resharding; from a (1, n) view of the shard: under torch.compile,
        # AOTAutograd's common-subexpression pass would otherwise merge this gather with the forward's, keeping
        # the whole parameters alive from the forward to the backward (8 collectives a step, not FSDP2's 12)
        ln_w, ln_b, w1, _b1, w2, _b2 = _gather_block(shard.unsqueeze(0), ctx.shapes, ctx.group, ctx.world)
        hidden = x.shape[-1]
        dw2, db2 = dout.t() @ g, dout.sum(0)
        da = torch.ops.aten.gelu_backward(dout @ w2, a)
        dw1, db1 = da.t() @ z, da.sum(0)
        dx, dln_w, dln_b = torch.ops.aten.native_layer_norm_backward(
            da @ w1, x, [hidden], mean, rstd, ln_w, ln_b, [True, True, True]
        )
        shard_grad = _reduce_scatter_block([dln_w, dln_b, dw1, db1, dw2, db2], ctx.group, ctx.world)
        return dx + dout, shard_grad, None, None, None, None


class LimitFSDP:
    """Each block's parameters as one flat shard per rank (FSDP2's layout), cut from the full model."""

    #: data parallel: each rank's loss is its own batch's, as eager FSDP2's
    loss_is_partial = False

    def __init__(self, full: FSDPStack, mesh: Any) -> None:
        self.group, self.world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.shapes, self.params, self.eps = [], [], full.blocks[0].norm.eps
        for block in full.blocks:
            tensors = [p.detach() for p in block.parameters()]  # norm, fc1, fc2: FSDP2's order too
            pieces = []
            for t in tensors:
                rows = _padded_rows(t.shape[0], self.world)
                padded = t.new_zeros((rows, *t.shape[1:]))
                mine = t[rank * rows : (rank + 1) * rows]
                padded[: mine.shape[0]].copy_(mine)
                pieces.append(padded.view(-1))
            self.shapes.append([tuple(t.shape) for t in tensors])
            self.params.append(nn.Parameter(torch.cat(pieces)))

    def parameters(self) -> list[nn.Parameter]:
        return self.params

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for shard, shapes in zip(self.params, self.shapes):
            x = _LimitFSDPBlockFn.apply(x, shard, shapes, self.group, self.world, self.eps)
        return x

    def loss(self, out: torch.Tensor, _target: Any = None) -> torch.Tensor:
        return out.pow(2).mean()

    def check_against(self, eager_model: nn.Module, eager_loss: torch.Tensor, limit_loss: torch.Tensor) -> None:
        """Loss and every gradient shard (this rank's rows) equal eager FSDP2's; raises otherwise."""
        torch.testing.assert_close(limit_loss.detach(), eager_loss.detach(), **LIMIT_TOL, msg=lambda m: f"loss: {m}")
        rank = dist.get_rank(self.group)
        for b, (block, flat, shapes) in enumerate(zip(eager_model.blocks, self.params, self.shapes)):
            offset = 0
            for (name, p), shape in zip(block.named_parameters(), shapes):
                rows = _padded_rows(shape[0], self.world)
                n = rows * int(torch.Size(shape[1:]).numel())
                mine = flat.grad[offset : offset + n].view(rows, *shape[1:])
                offset += n
                valid = max(0, min(rows, shape[0] - rank * rows))
                torch.testing.assert_close(
                    mine[:valid], p.grad.to_local(), **LIMIT_TOL, msg=lambda m, n=f"blocks.{b}.{name}": f"{n}: {m}"
                )


def fsdp_workload(size: str) -> Workload:
    hidden, blocks, tokens = FSDP_SIZES[size]
    _return_freed_memory_to_the_os()
    mesh, dev = mesh_1d(), device_type()
    torch.manual_seed(0)
    full = FSDPStack(hidden, blocks).to(dev)
    # data parallel: each rank its own batch
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(10 + dist.get_rank())).to(dev)

    def make_model() -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        model = copy.deepcopy(full)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return Workload(
        "fsdp",
        size,
        f"FSDP2 (per-block fully_shard + root), {blocks} LayerNorm+MLP blocks, H={hidden}, {tokens} tokens per rank",
        make_model,
        (x,),
        None,
        block_loss,
        lambda: LimitFSDP(full, mesh),
        measure_memory=True,
    )


def _return_freed_memory_to_the_os() -> None:
    """glibc keeps freed large blocks for reuse unless they were mmapped; a fixed mmap threshold of 64 KiB makes
    every tensor of that size or more its own mapping, so the RSS high-water mark follows the live tensors."""
    if device_type() != "cpu":
        return
    try:
        import ctypes

        m_mmap_threshold = -3
        ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 64 * 1024)
    except OSError:  # not glibc: the high-water mark then includes what the allocator keeps
        pass


def _rss_peak_reset() -> float | None:
    """Reset this process's RSS high-water mark (Linux); returns the current RSS in MiB (None elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _proc_status_mb("VmRSS")
    except OSError:
        return None


def _proc_status_mb(key: str) -> float | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return None


# ---------------------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One model at one size: builds identical parallelized copies, and the inputs of the step."""

    name: str
    size: str
    description: str
    make_model: Callable[[], nn.Module]
    inputs: tuple
    target: Any
    loss: Callable[[Any, Any], torch.Tensor]
    make_limit: Callable[[], Any] | None = None
    #: report each variant's peak memory during a step (CPU: RSS high-water mark over the warm-up steps)
    measure_memory: bool = False


def block_workload(hidden: int) -> Workload:
    mesh, dev = mesh_1d(), device_type()
    torch.manual_seed(0)
    full = SPBlock(hidden).to(dev)
    x_full = torch.randn(1, BLOCK_TOKENS, hidden, generator=torch.Generator().manual_seed(1)).to(dev)
    x = distribute_tensor(x_full, mesh, [Shard(1)])

    def make_model() -> nn.Module:
        return parallelize_module(copy.deepcopy(full), mesh, sp_block_plan())

    return Workload(
        "block",
        str(hidden),
        f"SP LayerNorm+MLP, H={hidden}, T={BLOCK_TOKENS}, batch 1",
        make_model,
        (x,),
        None,
        block_loss,
        lambda: LimitBlock(full, mesh),
    )


#: (config, batch) per size; "test" is the size of the test suite, the larger one has one block (first-call time)
GPT_SIZES = {
    "test": (GPTConfig(), 4),
    "large": (GPTConfig(dim=256, seq=64, heads=4, layers=1), 4),
}
LLAMA_SIZES = {
    "test": (LlamaConfig(layers=1), 2),  # tests/distributed/test_llama.py's size
    "large": (LlamaConfig(dim=256, seq=64, heads=8, kv_heads=4, ffn_hidden=768, layers=1), 2),
}
#: (hidden, blocks, tokens per rank) per size
FSDP_SIZES = {"256": (256, 4, 512), "512": (512, 6, 512)}
#: rough wall seconds of each workload size (first calls + rounds) on 2 idle CPU cores, for the time guard
EXPECTED_S = {
    ("block", "64"): 40.0,
    ("block", "256"): 25.0,
    ("block", "1024"): 30.0,
    ("gpt", "test"): 130.0,
    ("gpt", "large"): 75.0,
    ("llama", "test"): 55.0,
    ("llama", "large"): 55.0,
    ("fsdp", "256"): 60.0,
    ("fsdp", "512"): 90.0,
}
#: the order the sizes run in: if the time guard has to skip some, the ones that matter least go first
PRIORITY = [
    ("block", "64"),
    ("block", "1024"),
    ("gpt", "test"),
    ("llama", "test"),
    ("block", "256"),
    ("gpt", "large"),
    ("llama", "large"),
    ("fsdp", "256"),  # last: it makes glibc return freed memory to the OS (mallopt), which slows later steps
    ("fsdp", "512"),
]


def _model_and_tokens(model_cls: type, cfg: Any, batch: int, *, seed: int) -> tuple:
    """The full model (the same weights on every rank), input tokens and target tokens for a language model."""
    dev = device_type()
    torch.manual_seed(0)
    full = model_cls(cfg).to(dev)
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g).to(dev)
    targets = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g).to(dev)
    return full, inputs, targets


def gpt_workload(size: str) -> Workload:
    cfg, batch = GPT_SIZES[size]
    # eager DTensor has no fused-SDPA strategy on a CPU mesh: attention as matmul + softmax there
    cfg = GPTConfig(**{**cfg.__dict__, "unfused_attention": device_type() == "cpu"})
    mesh = mesh_1d()
    full, idx, tgt = _model_and_tokens(GPT, cfg, batch, seed=2)
    desc = f"GPT SP, dim {cfg.dim}, seq {cfg.seq}, heads {cfg.heads}, layers {cfg.layers}, batch {batch}"
    if cfg.unfused_attention:
        desc += ", unfused attention"
    return Workload(
        "gpt",
        size,
        desc,
        lambda: parallelize(copy.deepcopy(full), mesh, sequence_parallel=True),
        (idx,),
        tgt,
        loss_fn,
        lambda: limit_gpt(full, mesh, loss_fn),
    )


def llama_workload(size: str) -> Workload:
    cfg, batch = LLAMA_SIZES[size]
    mesh = mesh_1d()
    full, tokens, labels = _model_and_tokens(Llama, cfg, batch, seed=3)
    desc = (
        f"Llama apply_tp, dim {cfg.dim}, seq {cfg.seq}, heads {cfg.heads}/{cfg.kv_heads}, "
        f"ffn {cfg.ffn_hidden}, layers {cfg.layers}, batch {batch}"
    )
    return Workload(
        "llama",
        size,
        desc,
        lambda: apply_tp(copy.deepcopy(full), mesh, loss_parallel=False),
        (tokens,),
        labels,
        llama_loss,
        lambda: limit_llama(full, mesh, llama_loss),
    )


WORKLOADS: dict[str, tuple[tuple[str, ...], Callable[[str], Workload]]] = {
    "block": (("64", "256", "1024"), lambda s: block_workload(int(s))),
    "gpt": (("test", "large"), gpt_workload),
    "llama": (("test", "large"), llama_workload),
    "fsdp": (tuple(FSDP_SIZES), fsdp_workload),
}


# ---------------------------------------------------------------------------------------------------------
# Variants and the measurement
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Runner:
    """One variant of one workload: its step, its parameters (for ``p.grad = None``) and its results."""

    name: str
    step: Callable[[], torch.Tensor] | None = None
    params: list = field(default_factory=list)
    model: Any = None
    compiled: Any = None
    error: str | None = None
    first_call_s: float | None = None
    first_loss: float | None = None
    times: list = field(default_factory=list)
    #: main-thread CPU seconds of each timed step: compute and per-op overhead, without the time spent waiting
    cpu_times: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def warm_inductor_process_state() -> None:
    """Do now what inductor does once per process before its first compile: probe the CPU's vector ISA (it
    compiles small test programs: about 7 s on the 2-core machine) and start its compile workers. Called
    before any first call is timed, so every variant's first call meets the same state; otherwise the
    process's first inductor compile (torch.compile's, listed first) paid all of it for everyone."""
    if not torch.cuda.is_available():
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()


def _fresh_inductor() -> None:
    """The next compile starts from scratch: no dynamo state, no fx-graph or autograd cache hits, and an empty
    kernel cache of its own (a variant compiled before it in this process leaves it no compiled kernel)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import clear_caches

    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=_INDUCTOR_CACHE)
    clear_caches()
    inductor_config.fx_graph_cache = False
    inductor_config.fx_graph_remote_cache = False
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = False
    except (ImportError, AttributeError):
        pass


def build_runner(name: str, w: Workload) -> Runner:
    r = Runner(name)
    if name in LIMITS:
        limit = w.make_limit()

        def forward_and_loss() -> torch.Tensor:
            return limit.loss(limit(*w.inputs), w.target)

        if name == "limit_compiled":
            _fresh_inductor()
            forward_and_loss = torch.compile(forward_and_loss)
        r.model, r.params = limit, limit.parameters()
        r.step = lambda: _backward(forward_and_loss())
        return r
    model = w.make_model()

    def forward_and_loss(*inputs: Any) -> torch.Tensor:
        return w.loss(model(*inputs), w.target)

    compiles_the_loss = False  # the loss inside the program: no eager DTensor op after it
    if name == "eager":
        fn = model
    elif name == "torch.compile":
        _fresh_inductor()
        fn = torch.compile(model)
    elif name == "thunder_off":
        fn = thunder.jit(model, dtensor_lowering=False)
    elif name == "thunder_on":
        fn = thunder.jit(model, dtensor_lowering=True)
    elif name == "thunder_on_early":  # each collective issued as early as its inputs allow
        fn = thunder.jit(model, dtensor_lowering=True, dtensor_issue_early=True)
    elif name in ("thunder_on_tcex", "thunder_on_tcex_loss"):
        from thunder.executors.torch_compile import torch_compile_ex

        _fresh_inductor()
        compiles_the_loss = name == "thunder_on_tcex_loss"
        executors = [torch_compile_ex, *thunder.get_default_executors()]
        fn = thunder.jit(forward_and_loss if compiles_the_loss else model, dtensor_lowering=True, executors=executors)
    elif name == "thunderfx_off":
        from thunder.dynamo import thunderfx

        _fresh_inductor()
        fn = thunderfx(model, dtensor_lowering=False)
    elif name == "thunderfx_on":
        from thunder.dynamo import thunderfx

        _fresh_inductor()
        fn = thunderfx(model, dtensor_lowering=True)
    else:
        raise ValueError(f"unknown variant {name!r}")
    r.model, r.compiled, r.params = model, fn, [p for p in model.parameters() if p.requires_grad]
    loss = fn if compiles_the_loss else lambda *inputs: w.loss(fn(*inputs), w.target)
    r.step = lambda: _backward(loss(*w.inputs))
    return r


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) < 600 else text[:600] + " ..."


def timed_step(r: Runner) -> tuple[float, float, torch.Tensor | None, str | None]:
    """One step after a barrier; (this rank's seconds, its main thread's CPU seconds, the loss, an error string
    or None)."""
    r.zero_grad()
    dist.barrier()
    c0, t0 = time.thread_time(), time.perf_counter()
    try:
        loss = r.step()
        _sync()
    except Exception as e:  # a variant may fail; the run goes on
        if dist.get_rank() == 0 and os.environ.get("BENCH_TRACEBACKS"):
            traceback.print_exc()
        return time.perf_counter() - t0, time.thread_time() - c0, None, _error(e)
    return time.perf_counter() - t0, time.thread_time() - c0, loss, None


def _cuda_peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _cuda_peak_mb() -> float | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def first_calls(w: Workload, names: list[str]) -> list[Runner]:
    """Build every variant and time its first call (trace / compile + the first step, max over ranks)."""
    runners = []
    for name in names:
        if name in LIMITS and w.make_limit is None:
            continue
        try:
            r = build_runner(name, w)
            built = None
        except Exception as e:
            r, built = Runner(name), _error(e)
        if not _all_ranks_ok(built is None):
            built = built or "failed on another rank"
        _cuda_peak_reset()
        if built is None:
            seconds, _cpu, loss, err = timed_step(r)
        else:
            seconds, loss, err = 0.0, None, built
        if torch.cuda.is_available():
            r.extra["first_call_peak_mem_mb"] = _cuda_peak_mb()
        ok = _all_ranks_ok(err is None)
        (r.first_call_s,) = _max_over_ranks([seconds])
        if not ok:
            r.error = err or "failed on another rank"
            r.step = None
            _log(f"  {name:14s} FAILED: {r.error}")
        else:
            value = _full(loss.detach()).float()
            if name in LIMITS and r.model.loss_is_partial:  # this rank's part of eager's Partial loss: sum them
                value = value.clone()
                dist.all_reduce(value)
            r.first_loss = float(value)
            r.extra["loss_first"] = loss
            if name.startswith("thunder_"):
                r.extra["thunder"] = True
            _log(f"  {name:14s} first call {r.first_call_s:7.2f} s   loss {r.first_loss:.6f}")
        runners.append(r)
    return runners


def check_limit(runners: list[Runner]) -> None:
    """Each limit's loss and gradients equal eager's (from their first calls); else that limit is dropped."""
    by = {r.name: r for r in runners}
    eager = by.get("eager")
    for name in LIMITS:
        limit = by.get(name)
        if limit is None or limit.step is None:
            continue
        err = None
        if eager is None or eager.step is None:
            err = "not checked against eager (eager not run or failed)"
        else:
            try:
                limit.model.check_against(eager.model, eager.extra["loss_first"], limit.extra["loss_first"])
            except AssertionError as e:
                err = f"{name} differs from eager: {_error(e)}"
        if not _all_ranks_ok(err is None):
            limit.error, limit.step = err or f"{name} check failed on another rank", None
            _log(f"  {name:14s} DROPPED: {limit.error}")
        else:
            limit.extra["checked_against_eager"] = True
            _log(f"  {name:14s} loss and gradients equal eager's")


def measure(w: Workload, names: list[str], *, warmup: int, budget_s: float, min_rounds: int, max_rounds: int) -> dict:
    _log(f"\n== {w.name} {w.size}: {w.description}")
    runners = first_calls(w, names)
    check_limit(runners)
    for r in runners:
        r.extra.pop("loss_first", None)
    live = [r for r in runners if r.step is not None]

    # warm-up (and, on CUDA, each variant's peak memory of a step)
    warm_times: dict[str, list[float]] = {}
    for r in live:
        _cuda_peak_reset()
        resident = torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None
        gc.collect()
        rss_before = _rss_peak_reset() if w.measure_memory and not torch.cuda.is_available() else None
        times, err = [], None
        for _ in range(warmup):
            seconds, _cpu, _loss, err = timed_step(r)
            if not _all_ranks_ok(err is None):  # every rank leaves together: the collectives stay matched
                err = err or "failed on another rank"
                break
            times.append(seconds)
        if torch.cuda.is_available():
            r.extra["peak_mem_mb"] = _cuda_peak_mb()
            r.extra["resident_mem_mb"] = resident
        elif rss_before is not None:  # what a step adds to the process, at its peak; the max over ranks
            (r.extra["peak_step_mem_mb"],) = _max_over_ranks([(_proc_status_mb("VmHWM") or 0.0) - rss_before])
        if err:
            r.error, r.step = f"warm-up: {err}", None
            _log(f"  {r.name:14s} FAILED in warm-up: {r.error}")
            continue
        warm_times[r.name] = _max_over_ranks(times) if times else [0.0]
    live = [r for r in live if r.step is not None]

    # interleaved rounds, as many as the budget allows (the same count on every rank: times are maxed over ranks)
    per_round = sum(statistics.median(warm_times[r.name]) for r in live) + 0.002 * len(live)
    rounds = max(min_rounds, min(max_rounds, int(budget_s / max(per_round, 1e-6)))) if live else 0
    _log(f"  {rounds} interleaved rounds of {len(live)} variants (~{per_round * 1e3:.1f} ms per round)")
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for r in live:
                if r.step is None:
                    continue
                seconds, cpu_seconds, _loss, err = timed_step(r)
                if not _all_ranks_ok(err is None):
                    r.error, r.step = f"timed step: {err or 'failed on another rank'}", None
                    continue
                r.times.append(seconds)
                r.cpu_times.append(cpu_seconds)
    finally:
        gc.enable()
    for r in runners:
        if r.times:
            r.times = _max_over_ranks(r.times)
            r.cpu_times = _max_over_ranks(r.cpu_times)
        if r.compiled is not None and r.extra.get("thunder"):
            try:
                r.extra["cache_misses"] = thunder.cache_misses(r.compiled)
            except Exception:  # not a thunder program (thunderfx)
                pass

    results = {"workload": w.name, "size": w.size, "description": w.description, "rounds": rounds, "variants": {}}
    for r in runners:
        entry: dict[str, Any] = {"first_call_s": r.first_call_s, "error": r.error}
        if r.times:
            ms = sorted(t * 1e3 for t in r.times)
            entry |= {
                "median_ms": statistics.median(ms),
                "min_ms": ms[0],
                "p25_ms": ms[len(ms) // 4],
                "p75_ms": ms[(3 * len(ms)) // 4],
                "steps": len(ms),
                "times_ms": [round(t, 4) for t in (x * 1e3 for x in r.times)],
                "median_cpu_ms": statistics.median(t * 1e3 for t in r.cpu_times),
            }
        if r.first_loss is not None:
            entry["first_loss"] = r.first_loss
        entry |= {k: v for k, v in r.extra.items() if k != "thunder"}
        results["variants"][r.name] = entry
    _add_ratios(results)
    for r in runners:
        e = results["variants"][r.name]
        if "median_ms" in e:
            _log(
                f"  {r.name:14s} median {e['median_ms']:9.3f} ms  x eager {_fmt(e.get('ratio_to_eager'))}"
                f"  x torch.compile {_fmt(e.get('ratio_to_torch_compile'))}  x limit {_fmt(e.get('ratio_to_limit'))}"
            )
    # free this workload's models (and compiled programs) before the next one
    del runners, live
    gc.collect()
    return results


def _add_ratios(results: dict) -> None:
    v = results["variants"]
    eager_loss = v.get("eager", {}).get("first_loss")
    limits = [v[name]["median_ms"] for name in LIMITS if v.get(name, {}).get("median_ms")]
    if limits:  # the limit is the faster of the hand-written program run op by op and compiled
        results["limit_ms"] = min(limits)
    for name, base in (
        ("eager", "ratio_to_eager"),
        ("torch.compile", "ratio_to_torch_compile"),
        ("limit", "ratio_to_limit"),
    ):
        ref = results.get("limit_ms") if name == "limit" else v.get(name, {}).get("median_ms")
        if not ref:
            continue
        for e in v.values():
            if "median_ms" in e:
                e[base] = e["median_ms"] / ref
    compiled_cpu = v.get("torch.compile", {}).get("median_cpu_ms")
    for e in v.values():
        if compiled_cpu and e.get("median_cpu_ms"):
            e["cpu_ratio_to_torch_compile"] = e["median_cpu_ms"] / compiled_cpu
    if eager_loss is not None:
        for e in v.values():
            if e.get("first_loss") is not None:
                e["loss_diff_to_eager"] = abs(e["first_loss"] - eager_loss)


def _fmt(x: float | None, spec: str = "5.2f") -> str:
    return format(x, spec) if x is not None else "  -  "


# ---------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------


def machine_info() -> dict:
    def git(*args: str) -> str | None:
        try:
            root = Path(__file__).resolve().parent.parent
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return None

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": device_type(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "thunder": getattr(thunder, "__version__", None),
        "thunder_dtensor": getattr(thunder_dtensor, "__version__", None),
        "lowering_module_present": importlib.util.find_spec("thunder_dtensor.lowering") is not None,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }
    try:
        cpu_model = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if "model name" in ln
            ),
            None,
        )
        info["cpu_model"] = cpu_model
    except OSError:
        pass
    if torch.cuda.is_available():
        info |= {"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}
        info["nvfuser"] = importlib.util.find_spec("nvfuser") is not None
    return info


def write_markdown(report: dict, path: Path) -> None:
    m = report["machine"]
    lines = [
        "# thunder_dtensor benchmark: one training step (forward, loss, backward)",
        "",
        f"{m['date']}; world size {m['world_size']} ({m['backend']}, {m['device']}"
        + (f", {m['gpu']}" if m.get("gpu") else f", {m.get('cpu_model') or m['processor']}, {m['cpu_count']} cores")
        + f"); torch {m['torch']}, thunder {m['thunder']}; commit {str(m['git_commit'])[:10]}"
        + (" (dirty)" if m["git_dirty"] else "")
        + f"; wall time {report['wall_s']:.0f} s"
        + (f"; load average {m['load_average_at_start'][0]:.1f} at start" if m.get("load_average_at_start") else "")
        + ("; **--quick** (smoke test: few rounds)" if report["args"]["quick"] else ""),
        "",
        "Median step time over interleaved rounds (max over ranks per step); ratios < 1 are faster than the "
        "reference. First call = trace/compile + first step. Compare ratios within one run only. CPU ms: the "
        "step's main-thread CPU time (median, max over ranks): compute and per-op overhead, without the time "
        "spent waiting on collectives or the other rank.",
        "",
    ]
    cuda = m["device"] == "cuda"
    cpu_memory = any("peak_step_mem_mb" in e for r in report["results"] for e in r["variants"].values())
    header = (
        "| workload | size | variant | median step ms | x eager | x torch.compile | x limit | first call s "
        "| CPU ms | CPU x torch.compile |"
    )
    if cuda:
        header += " peak mem MB |"
    elif cpu_memory:
        header += " step peak RSS MB | x eager |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    notes = []
    for res in report["results"]:
        for name, e in res["variants"].items():
            row = [res["workload"], res["size"], name]
            if e.get("error"):
                notes.append(f"- {res['workload']} {res['size']} `{name}`: {e['error']}")
                first = _fmt(e.get("first_call_s"), ".2f") if e.get("first_call_s") else ""
                row += ["error", "", "", "", first, "", ""]
            else:
                row += [
                    _fmt(e.get("median_ms"), ".3f"),
                    _fmt(e.get("ratio_to_eager"), ".2f"),
                    _fmt(e.get("ratio_to_torch_compile"), ".2f"),
                    _fmt(e.get("ratio_to_limit"), ".2f") if "ratio_to_limit" in e else "",
                    _fmt(e.get("first_call_s"), ".2f"),
                    _fmt(e.get("median_cpu_ms"), ".3f"),
                    _fmt(e.get("cpu_ratio_to_torch_compile"), ".2f"),
                ]
            if cuda:
                row.append(_fmt(e.get("peak_mem_mb"), ".1f"))
            elif cpu_memory:
                peak, eager_peak = e.get("peak_step_mem_mb"), res["variants"].get("eager", {}).get("peak_step_mem_mb")
                ratio = peak / eager_peak if peak is not None and eager_peak else None
                row += [_fmt(peak, ".1f") if peak is not None else "", _fmt(ratio, ".2f") if ratio else ""]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Sizes:", ""]
    lines += [f"- {r['workload']} {r['size']}: {r['description']}; {r['rounds']} rounds" for r in report["results"]]
    if notes:
        lines += ["", "Errors:", "", *notes]
    if report.get("skipped"):
        lines += ["", "**Skipped** (raise --time-limit-s, or run them alone with --workloads / --sizes):", ""]
        lines += [f"- {s['workload']} {s['size']}: {s['reason']}" for s in report["skipped"]]
    path.write_text("\n".join(lines) + "\n")


def write_plot(report: dict, path: Path) -> None:
    """Grouped bars: step time / eager's, per workload and size, one bar per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(
            f"benchmarks: cannot write {path}: matplotlib is missing ({e}); "
            "install it with `pip install matplotlib` or the `bench` extra (`pip install -e .[bench]`)"
        ) from e
    groups = [(f"{r['workload']}\n{r['size']}", r["variants"]) for r in report["results"]]
    names = [n for n in (*VARIANTS, "thunderfx_off", "thunderfx_on") if any(n in v for _, v in groups)]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(groups) + 2), 4.5))
    labelled: set[str] = set()
    top = 1.0
    for i, name in enumerate(names):
        for j, (_, v) in enumerate(groups):
            x = j + (i - (len(names) - 1) / 2) * width
            e = v.get(name)
            if e is None:
                continue
            ratio = e.get("ratio_to_eager")
            if ratio is None:
                ax.text(x, 0.02, "err" if e.get("error") else "-", ha="center", va="bottom", fontsize=7, rotation=90)
                continue
            ax.bar(x, ratio, width, color=f"C{i}", label=None if name in labelled else name)
            ax.text(x, ratio, f"{ratio:.2f}", ha="center", va="bottom", fontsize=6)
            labelled.add(name)
            top = max(top, ratio)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    ax.set_ylabel("step time / eager DTensor (lower is faster)")
    m = report["machine"]
    ax.set_title(
        f"fwd+bwd step, {m['world_size']} rank(s), {m['device']} ({m['backend']}), torch {m['torch']}", fontsize=10
    )
    ax.legend(fontsize=8, ncol=min(len(names), 5), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: one size per workload, few rounds")
    p.add_argument("--workloads", default="block,gpt,llama", help="comma list of: " + ",".join(WORKLOADS))
    p.add_argument(
        "--sizes",
        default=None,
        help="comma list of sizes, e.g. 64,1024,large or block:256,gpt:test (default: all; --quick: the first)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma list of: " + ",".join(VARIANTS) + " (also thunderfx_off, thunderfx_on; not by default)",
    )
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results; --quick: a temp dir)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 3; --quick 1)")
    p.add_argument("--budget-s", type=float, default=None, help="timed seconds per workload and size (default 7)")
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=570.0,
        help="skip the workload sizes that would end past this many seconds (reported as skipped; default 570)",
    )
    p.add_argument("--min-rounds", type=int, default=None)
    p.add_argument("--max-rounds", type=int, default=None)
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.budget_s = args.budget_s if args.budget_s is not None else (0.5 if args.quick else 7.0)
    args.min_rounds = args.min_rounds if args.min_rounds is not None else (3 if args.quick else 10)
    args.max_rounds = args.max_rounds if args.max_rounds is not None else (3 if args.quick else 200)
    return args


def selected(args: argparse.Namespace) -> list[tuple[str, str]]:
    chosen = []
    wanted = [s.strip() for s in args.sizes.split(",")] if args.sizes else None
    for name in (w.strip() for w in args.workloads.split(",") if w.strip()):
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        sizes = WORKLOADS[name][0]
        if wanted is not None:
            sizes = tuple(s for s in sizes if s in wanted or f"{name}:{s}" in wanted)
        elif args.quick:
            sizes = sizes[:1]
        chosen += [(name, s) for s in sizes]
    if not chosen:
        raise SystemExit("no workload / size selected")
    return chosen


def main(argv: list[str] | None = None) -> int:
    start = _PROCESS_START
    args = parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = (*VARIANTS, "thunderfx_off", "thunderfx_on")
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(known)}")
    init_distributed(timeout_s=300.0)
    warm_inductor_process_state()
    out = Path(args.out) if args.out else None
    if out is None:
        out = (
            Path(tempfile.gettempdir()) / "thunder_dtensor_bench_quick"
            if args.quick
            else Path(__file__).resolve().parent / "results"
        )
    report: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "results": [], "skipped": []}
    _log(f"benchmark: {report['machine']['world_size']} rank(s), {report['machine']['device']}, out {out}")
    slowdown = 1.0  # measured / expected seconds so far: how busy the machine is
    try:
        chosen = selected(args)
        for name, size in sorted(chosen, key=lambda c: PRIORITY.index(c) if c in PRIORITY else len(PRIORITY)):
            elapsed = time.perf_counter() - start
            expected = EXPECTED_S.get((name, size), 60.0) * slowdown
            # every rank takes the same decision (rank 0's clock)
            (go,) = _max_over_ranks([1.0 if elapsed + expected <= args.time_limit_s else 0.0] if _is0() else [0.0])
            if not go:
                why = f"time limit: {elapsed:.0f} s elapsed + ~{expected:.0f} s expected > {args.time_limit_s:.0f} s"
                report["skipped"].append({"workload": name, "size": size, "reason": why})
                _log(f"\n== {name} {size}: SKIPPED ({why})")
                continue
            t0 = time.perf_counter()
            w = WORKLOADS[name][1](size)
            report["results"].append(
                measure(
                    w,
                    names,
                    warmup=args.warmup,
                    budget_s=args.budget_s,
                    min_rounds=args.min_rounds,
                    max_rounds=args.max_rounds,
                )
            )
            report["results"][-1]["wall_s"] = time.perf_counter() - t0
            done = report["results"]
            expected_done = sum(EXPECTED_S.get((r["workload"], r["size"]), 60.0) for r in done)
            slowdown = max(0.5, sum(r["wall_s"] for r in done) / expected_done)
            del w
    finally:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
    report["results"].sort(key=lambda r: chosen.index((r["workload"], r["size"])))  # the natural order
    report["wall_s"] = time.perf_counter() - start
    report["machine"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        write_markdown(report, out / "results.md")
        write_plot(report, out / "results.png")
        print(f"\nwall time {report['wall_s']:.0f} s; wrote {out}/results.json, results.md, results.png")
        print((out / "results.md").read_text())
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
