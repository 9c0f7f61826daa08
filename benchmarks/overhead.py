"""Per-call overhead of jitted DTensor programs, in microseconds per DTensor input and per op.

Run with ``torchrun --nproc-per-node 2 benchmarks/overhead.py [--out DIR]``. Each program takes ``n`` replicated
DTensors of 8x8 (so kernels cost next to nothing and no collective runs), adds them, then applies ``k`` pointwise
ops (``n - 1 + k`` ops in all). It runs three ways, interleaved in rounds:

- ``local``: the same ops on the local shards in eager torch: torch's own cost per op, the floor;
- ``thunder_on``: ``thunder.jit`` (the lowering on), called with the DTensors;
- ``eager_dtensor``: the DTensor program run eagerly (context: DTensor's own dispatch per op).

A variant's overhead is its call time minus ``local``'s; a least-squares fit over the (n, k) grid splits it into
a fixed part per call, a part per DTensor input and a part per op. ``inference`` calls the program under
``torch.no_grad``; ``training`` calls it on inputs that require grad and runs the backward of its output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor.testing import init_distributed, mesh_1d, shutdown_distributed

import thunder
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, distribute_tensor

GRID_INPUTS = (1, 4, 16)
GRID_OPS = (2, 16, 64)
VARIANTS = ("local", "thunder_on", "eager_dtensor")


def program(k: int):  # noqa: ANN201
    def fn(*xs: torch.Tensor) -> torch.Tensor:
        y = xs[0]
        for x in xs[1:]:
            y = y + x
        for i in range(k):
            y = y * 1.001 if i % 2 == 0 else y - 0.5
        return y

    return fn


def _calls(variant: str, n: int, k: int, training: bool) -> Callable[[], None]:
    """One call of a variant on its own inputs: the program (and its backward when training)."""
    mesh = mesh_1d()
    fn = program(k)
    g = torch.Generator().manual_seed(n * 100 + k)
    fulls = [torch.randn(8, 8, generator=g) for _ in range(n)]
    dtensors = [distribute_tensor(t, mesh, [Replicate()]).requires_grad_(training) for t in fulls]
    locals_ = [d.to_local().detach().requires_grad_(training) for d in dtensors]
    if variant == "local":
        args, run = locals_, fn
    elif variant == "thunder_on":
        args, run = dtensors, thunder.jit(fn)
    else:
        args, run = dtensors, fn
    grad = torch.ones(8, 8)
    if variant != "local":
        grad = distribute_tensor(grad, mesh, [Replicate()])

    if training:

        def call() -> None:
            for a in args:
                a.grad = None
            run(*args).backward(grad)

    else:

        def call() -> None:
            with torch.no_grad():
                run(*args)

    return call


def measure(training: bool, rounds: int, calls_per_round: int) -> dict:
    results: dict = {}
    for n in GRID_INPUTS:
        for k in GRID_OPS:
            calls = {v: _calls(v, n, k, training) for v in VARIANTS}
            for call in calls.values():  # compile and warm up
                for _ in range(3):
                    call()
            per_round: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(rounds):
                for v, call in calls.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(calls_per_round):
                        call()
                    per_round[v].append((time.perf_counter() - t0) / calls_per_round * 1e6)
            results[f"{n},{k}"] = {v: statistics.median(ts) for v, ts in per_round.items()}
    return results


def fit(results: dict, variant: str) -> dict:
    """Least squares: overhead = fixed + per_input * n + per_op * (n - 1 + k), in microseconds (the program runs
    n - 1 adds and k more ops)."""
    rows, ys = [], []
    for key, times in results.items():
        n, k = (int(s) for s in key.split(","))
        rows.append([1.0, float(n), float(n - 1 + k)])
        ys.append(times[variant] - times["local"])
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(a, y).solution.squeeze(1).tolist()
    return {"fixed_us": coef[0], "per_dtensor_input_us": coef[1], "per_op_us": coef[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write overhead.json and overhead.md here")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls-per-round", type=int, default=20)
    parser.add_argument("--label", default="", help="a name for this run in the report (e.g. before / after)")
    args = parser.parse_args()
    init_distributed()
    report = {"label": args.label, "modes": {}}
    for mode, training in (("inference", False), ("training", True)):
        results = measure(training, args.rounds, args.calls_per_round)
        fits = {v: fit(results, v) for v in VARIANTS if v != "local"}
        report["modes"][mode] = {"call_us": results, "fit": fits}
    if dist.get_rank() == 0:
        lines = [f"# Per-call overhead{(' (' + args.label + ')') if args.label else ''}", ""]
        lines += ["| mode | variant | fixed µs per call | µs per DTensor input | µs per op |", "|---|---|---|---|---|"]
        for mode, entry in report["modes"].items():
            for v, f in entry["fit"].items():
                lines.append(
                    f"| {mode} | {v} | {f['fixed_us']:.1f} | {f['per_dtensor_input_us']:.1f} | {f['per_op_us']:.1f} |"
                )
        lines += ["", "Call time (µs) per (DTensor inputs n, ops k):", ""]
        lines += ["| mode | n, k | " + " | ".join(VARIANTS) + " |", "|---|---|" + "---|" * len(VARIANTS)]
        for mode, entry in report["modes"].items():
            for key, times in entry["call_us"].items():
                lines.append(f"| {mode} | {key} | " + " | ".join(f"{times[v]:.1f}" for v in VARIANTS) + " |")
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "overhead.json").write_text(json.dumps(report, indent=2))
            (args.out / "overhead.md").write_text(text)
    shutdown_distributed()


if __name__ == "__main__":
    main()
