"""Step time of a tensor-parallel MLP whose activation's backward DTensor has no sharding rule for.

``F.hardswish`` between a colwise and a rowwise linear: eager DTensor (torch 2.13) raises in the backward
(``aten.hardswish_backward`` has no sharding strategy), and so does anything tracing through its dispatch.
thunder_dtensor decomposes that backward with torch's own decomposition (``ops/no_rule.py``). Variants:

- ``eager`` / ``torch.compile``: eager DTensor, and torch.compile of it (reported as failing where they fail);
- ``thunder_on`` / ``thunder_off``: ``thunder.jit`` with the lowering on (default) / off;
- ``limit``: the same math written by hand on local shards (an ``autograd.Function`` with the one all-reduce
  of the rowwise output), the best a program can do on this machine.

Every variant that runs is first checked against the plain model on full tensors (loss and gradients). Step
times are the medians of interleaved rounds in one process; ratios are to the limit.

    torchrun --nproc-per-node 2 benchmarks/no_rule.py        # writes benchmarks/results/no_rule.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor.testing import init_distributed, mesh_1d, shutdown_distributed

import thunder
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

TOKENS = 256


class HardswishMLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.hardswish(self.fc1(x)))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


class _LimitMLP(torch.autograd.Function):
    """Local shards: fc1 rows and fc2 columns of this rank; one all-reduce of the rowwise output."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, group):  # noqa: ANN001, ANN205
        a = F.linear(x, w1, b1)
        h = F.hardswish(a)
        y = funcol.wait_tensor(funcol.all_reduce(F.linear(h, w2), "sum", group)) + b2
        ctx.save_for_backward(x, a, h, w2)
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, a, h, w2 = ctx.saved_tensors
        dw2 = dy.t() @ h
        db2 = dy.sum(0)
        da = torch.ops.aten.hardswish_backward(dy @ w2, a)
        dw1 = da.t() @ x
        db1 = da.sum(0)
        return None, dw1, db1, dw2, db2, None


class LimitMLP:
    def __init__(self, full: HardswishMLP, mesh: Any) -> None:
        rank, size = mesh.get_local_rank(), mesh.size()
        self.group = mesh.get_group()
        w = {k: v.detach() for k, v in full.named_parameters()}
        self.params = {
            "fc1.weight": w["fc1.weight"].chunk(size, 0)[rank],
            "fc1.bias": w["fc1.bias"].chunk(size, 0)[rank],
            "fc2.weight": w["fc2.weight"].chunk(size, 1)[rank],
            "fc2.bias": w["fc2.bias"],
        }
        self.params = {k: nn.Parameter(v.clone().contiguous()) for k, v in self.params.items()}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params.values())

    def __call__(self, x: DTensor) -> torch.Tensor:
        p = self.params
        return _LimitMLP.apply(x.to_local(), p["fc1.weight"], p["fc1.bias"], p["fc2.weight"], p["fc2.bias"], self.group)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every rank's gradient shards gathered to full tensors (fc2.bias is the same on every rank)."""
        out = {}
        for name, p in self.params.items():
            dim = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}.get(name)
            out[name] = p.grad if dim is None else funcol.wait_tensor(funcol.all_gather_tensor(p.grad, dim, self.group))
        return out


def plan() -> dict:
    # fc1's output stays a DTensor (as in plans that keep DTensors between layers), so the activation and its
    # backward run on DTensors; with use_local_output=True they would run on plain local tensors
    return {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel(input_layouts=Shard(-1))}


def _step(model: Any, x: Any) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    loss = loss_of(model(x))
    loss.backward()
    return loss


def _full_grads(model: Any) -> dict[str, torch.Tensor]:
    if isinstance(model, LimitMLP):
        return model.full_grads()
    module = getattr(model, "_orig_mod", getattr(model, "_model", model))  # torch.compile's, thunder.jit's wrappers
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in module.named_parameters()}


def run(hidden: int, rounds: int, steps: int) -> dict[str, Any]:
    mesh = mesh_1d()
    torch.manual_seed(0)
    full = HardswishMLP(hidden)
    x_full = torch.randn(TOKENS, hidden, generator=torch.Generator().manual_seed(1))
    x = distribute_tensor(x_full, mesh, [Replicate()])
    reference = copy.deepcopy(full)
    ref_loss = loss_of(reference(x_full))
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    def tp_model() -> nn.Module:
        return parallelize_module(copy.deepcopy(full), mesh, plan())

    makers = {
        "eager": tp_model,
        "torch.compile": lambda: torch.compile(tp_model()),
        "thunder_on": lambda: thunder.jit(tp_model()),
        "thunder_off": lambda: thunder.jit(tp_model(), dtensor_lowering=False),
        "limit": lambda: LimitMLP(full, mesh),
    }
    models, errors = {}, {}
    for name, make in makers.items():
        try:
            model = make()
            loss = _step(model, x)
            loss_value = loss.full_tensor() if isinstance(loss, DTensor) else loss
            torch.testing.assert_close(loss_value.detach(), ref_loss.detach(), rtol=1e-4, atol=1e-5)
            for n, g in _full_grads(model).items():
                torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
            models[name] = model
        except Exception as e:  # noqa: BLE001  (a failing variant is reported, not fatal)
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            why = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines or [""])[0]
            errors[name] = f"{type(e).__name__}: {why[:160]}"
        dist.barrier()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                _step(model, x)
            elapsed = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"hidden": hidden, "medians": medians, "errors": errors}


def to_markdown(results: list[dict], world: int) -> str:
    names = ("eager", "torch.compile", "thunder_off", "thunder_on", "limit")
    lines = [
        "# Ops without a sharding rule: a tensor-parallel MLP with `F.hardswish`",
        "",
        f"Written by `benchmarks/no_rule.py` ({world} CPU ranks, {TOKENS} tokens, colwise fc1 -> hardswish -> "
        "rowwise fc2, loss `out.pow(2).mean()`). Eager DTensor has no sharding strategy for "
        "`aten.hardswish_backward`; thunder_dtensor decomposes it. fc1 keeps its output a DTensor "
        "(`ColwiseParallel(use_local_output=False)`), so the activation runs on DTensors. Every variant that "
        "runs matched the plain "
        "model's loss and gradients first. Step time (forward + backward), median of interleaved rounds, "
        "as a ratio to the limit (the same math by hand on local shards); lower is better.",
        "",
        "| hidden | " + " | ".join(names) + " | limit step |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for r in results:
        limit = r["medians"].get("limit")
        cells = []
        for n in names:
            if n in r["errors"]:
                cells.append("fails")
            elif limit:
                cells.append(f"{r['medians'][n] / limit:.2f}")
            else:
                cells.append(f"{r['medians'][n] * 1e3:.1f} ms")
        lines.append(f"| {r['hidden']} | " + " | ".join(cells) + f" | {limit * 1e3:.1f} ms |")
    errors = {(r["hidden"], n): e for r in results for n, e in r["errors"].items()}
    if errors:
        lines += ["", "Failures:", ""] + [f"- hidden {h}, {n}: {e}" for (h, n), e in errors.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/no_rule.md")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    init_distributed()
    results = [run(int(h), args.rounds, args.steps) for h in args.sizes.split(",")]
    if dist.get_rank() == 0:
        text = to_markdown(results, dist.get_world_size())
        Path(args.out).write_text(text)
        print(text)
    shutdown_distributed()


if __name__ == "__main__":
    main()
