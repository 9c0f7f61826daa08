"""What ``import thunder_dtensor`` costs a plain (DTensor-free) program: its first call and its cached calls.

The package notes each jitted call as it starts and asks its fix switches while thunder compiles (issue 40);
neither should cost a program without DTensors anything measurable. Each round runs one fresh process without
the package (thunder imported as ``scripts/plain_thunder.py`` does) and one with ``import thunder_dtensor``
first, alternating, and each process measures:

- ``first_*``: the first call of a small MLP's training step (forward and backward) and of a pointwise function:
  compilation plus one run;
- ``cached_*_us``: the median time of a cached call (the same function, same input shapes), over 20 blocks of
  200 calls: the per-call path (cache lookup, prologue, the compiled program);
- with the package, the cost of its one per-call wrapper, within the process (with and without it, interleaved).

    python benchmarks/plain_call_cost.py [--rounds 5] [--out benchmarks/results/plain_call_cost.md]

The report gives each measure's median over rounds per mode and the ratio with / without the package.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEASURES = ("first_mlp_s", "first_pointwise_s", "cached_mlp_us", "cached_pointwise_us")


def _cached_call_us(fn, *args) -> float:  # noqa: ANN001
    blocks = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(200):
            fn(*args)
        blocks.append((time.perf_counter() - start) / 200 * 1e6)
    return statistics.median(blocks)


def _call_wrapper_us(fn, *args) -> float:  # noqa: ANN001
    """The package's per-call wrapper (``program_scope.note_each_call``), timed in one process: the same function
    jitted without it (undone) and with it (installed again), called in interleaved blocks."""
    from thunder_dtensor._integration import program_scope, registry

    import thunder

    registry.undo("program_scope.note_each_call")
    without = thunder.jit(fn)
    program_scope.note_each_call()
    with_wrapper = thunder.jit(fn)
    without(*args), with_wrapper(*args)
    differences = []
    for _ in range(30):
        times = []
        for jitted in (without, with_wrapper):
            start = time.perf_counter()
            for _ in range(300):
                jitted(*args)
            times.append((time.perf_counter() - start) / 300 * 1e6)
        differences.append(times[1] - times[0])
    return statistics.median(differences)


def worker(mode: str) -> dict:
    """One fresh process's measures, thunder imported with or without the package."""
    if mode == "package":
        import thunder_dtensor  # noqa: F401
    else:
        sys.path.insert(0, str(ROOT / "scripts"))
        from plain_thunder import import_plain_thunder

        import_plain_thunder()
    import thunder
    import torch

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    jitted_mlp = thunder.jit(mlp)
    x = torch.randn(4, 16)

    def step(x: torch.Tensor) -> None:
        jitted_mlp(x).sum().backward()

    def pointwise(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sin(a) * b + a

    jitted_pointwise = thunder.jit(pointwise)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    results = {}
    start = time.perf_counter()
    step(x)
    results["first_mlp_s"] = time.perf_counter() - start
    start = time.perf_counter()
    jitted_pointwise(a, b)
    results["first_pointwise_s"] = time.perf_counter() - start
    results["cached_mlp_us"] = _cached_call_us(step, x)
    results["cached_pointwise_us"] = _cached_call_us(jitted_pointwise, a, b)
    if mode == "package":
        results["call_wrapper_us"] = _call_wrapper_us(pointwise, a, b)
    assert not [m for m in sys.modules if m.startswith("thunder_dtensor")] or mode == "package"
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plain_call_cost.md")
    parser.add_argument("--worker", choices=("plain", "package"), default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    runs: dict[str, list[dict]] = {"plain": [], "package": []}
    for _ in range(args.rounds):
        for mode in runs:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            command = [sys.executable, __file__, "--worker", mode]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    medians = {mode: {m: statistics.median(r[m] for r in rs) for m in MEASURES} for mode, rs in runs.items()}
    wrapper_us = statistics.median(r["call_wrapper_us"] for r in runs["package"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    lines = [
        "# A plain program's cost of `import thunder_dtensor`",
        "",
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; commit {commit.stdout.strip()}; {args.rounds} rounds,"
        " each a fresh process per mode, alternating; medians over rounds. `benchmarks/plain_call_cost.py`.",
        "",
        "| measure | without the package | with it | with / without |",
        "|---|---|---|---|",
    ]
    for m in MEASURES:
        plain, package = medians["plain"][m], medians["package"][m]
        lines.append(f"| {m} | {plain:.4g} | {package:.4g} | {package / plain:.3f} |")
    lines += [
        "",
        f"The package's per-call wrapper, timed within one process (the same function jitted with and without it,"
        f" interleaved): {wrapper_us:.2f} µs per call (median over rounds). Across processes, the cached-call"
        " times of a few tens of µs vary by more than that from process to process on a shared machine.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
