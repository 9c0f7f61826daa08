"""Where a training step's time goes: compute on the main thread, waiting in collectives, the DTensor boundary.

Run with ``torchrun --nproc-per-node 2 --local-ranks-filter 0 benchmarks/breakdown.py [--out DIR]``. It builds
``make bench``'s workloads and variants (``benchmarks/bench.py``), warms them up, and then:

- times interleaved rounds of steps, as the bench does: the step's wall time and its main-thread CPU time
  (``time.thread_time``), medians, max over ranks;
- profiles a few more steps of each variant with ``torch.profiler`` and counts, per step: the time spent in
  ``_c10d_functional::wait_tensor`` (blocked on a collective: the peer's arrival plus gloo's own latency),
  the collectives issued (``c10d::`` ops, barriers excluded), the ATen calls (every level: a measure of
  per-op dispatch), the time in DTensor's ``__torch_dispatch__`` (``PythonSubclass``: eager DTensor ops
  outside the compiled program, the loss and the gradients' accumulation into DTensor parameters), and the
  inductor graphs run (calls of compiled graphs, forward and backward: each costs its wrappers and guards).

Profiled times are inflated by the profiler; compare them between variants of one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402  (first: it sets the private inductor cache before torch is imported)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

DEFAULT_CASES = (
    "block:64",
    "block:256",
    "block:1024",
    "gpt:test",
    "gpt:large",
    "llama:test",
    "llama:large",
    "fsdp:256",
    "fsdp:512",
)
#: torch.compile, the default thunder.jit, the fused program with the loss inside (issue 44), the compiled limit
DEFAULT_VARIANTS = ("torch.compile", "thunder_on", "thunder_on_tcex_loss", "limit_compiled")
PROFILED_STEPS = 5
COLUMNS = (
    ("step_ms", "step ms"),
    ("cpu_ms", "main-thread CPU ms"),
    ("wait_ms", "waiting in collectives ms (profiled)"),
    ("collectives", "collectives"),
    ("wait_per_collective_us", "µs waited per collective"),
    ("aten_calls", "ATen calls (all levels)"),
    ("dtensor_dispatch_ms", "DTensor dispatch ms (profiled)"),
    ("inductor_graphs", "inductor graphs run"),
)
COUNTS = ("collectives", "aten_calls", "wait_per_collective_us", "inductor_graphs")


def _profile(r: bench.Runner) -> dict:
    """Per-step counts and times of ``PROFILED_STEPS`` profiled steps of ``r`` (this rank)."""
    from torch._inductor.output_code import CompiledFxGraph

    graphs_run, call = [0], CompiledFxGraph.__call__

    def counted(self: CompiledFxGraph, inputs: object) -> object:
        graphs_run[0] += 1
        return call(self, inputs)

    CompiledFxGraph.__call__ = counted  # type: ignore[method-assign]  # (this script only, while profiling)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_STEPS):
                r.zero_grad()
                dist.barrier()
                r.step()
    finally:
        CompiledFxGraph.__call__ = call  # type: ignore[method-assign]
    wait_us = collectives = aten = dispatch_us = 0.0
    for e in prof.events():
        if e.name == "_c10d_functional::wait_tensor":
            wait_us += e.cpu_time_total
        elif e.name.startswith("c10d::") and "barrier" not in e.name:
            collectives += 1
        elif e.name.startswith("aten::"):
            aten += 1
        elif e.name == "PythonSubclass":
            dispatch_us += e.cpu_time_total
    n = PROFILED_STEPS
    return {
        "wait_ms": wait_us / n / 1e3,
        "collectives": collectives / n,
        "aten_calls": aten / n,
        "dtensor_dispatch_ms": dispatch_us / n / 1e3,
        "inductor_graphs": graphs_run[0] / n,
    }


def breakdown(w: bench.Workload, variants: list[str], rounds: int) -> dict:
    runners = []
    for name in variants:
        if name in bench.LIMITS and w.make_limit is None:
            continue
        r = bench.build_runner(name, w)
        for _ in range(3):
            bench.timed_step(r)
        runners.append(r)
    timed: dict[str, list[tuple[float, float]]] = {r.name: [] for r in runners}
    for i in range(rounds):
        for r in runners if i % 2 == 0 else runners[::-1]:
            seconds, cpu, _loss, err = bench.timed_step(r)
            if err is not None:
                raise RuntimeError(f"{w.name} {w.size} {r.name}: {err}")
            timed[r.name].append((seconds, cpu))
    out = {}
    for r in runners:
        row = {
            "step_ms": statistics.median(s for s, _ in timed[r.name]) * 1e3,
            "cpu_ms": statistics.median(c for _, c in timed[r.name]) * 1e3,
            **_profile(r),
        }
        keys = sorted(row)
        row = dict(zip(keys, bench._max_over_ranks([float(row[k]) for k in keys])))
        row["wait_per_collective_us"] = row["wait_ms"] * 1e3 / row["collectives"] if row["collectives"] else 0.0
        out[r.name] = row
    return out


def _markdown(report: dict) -> str:
    lines = [
        "# Where a step's time goes",
        "",
        f"{report['machine']}; {report['rounds']} interleaved rounds per case, then {PROFILED_STEPS} profiled "
        "steps per variant; every number is the max over ranks. Step and CPU: medians of the timed rounds. "
        "Waiting: time blocked in `wait_tensor`; collectives: `c10d::` ops; ATen calls: every dispatcher level; "
        "DTensor dispatch: eager DTensor ops outside the compiled program (the loss, gradient accumulation); "
        "inductor graphs: compiled graphs called a step.",
        "",
        "| workload | size | variant | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for case, rows in report["cases"].items():
        name, size = case.split(":")
        for variant, row in rows.items():
            cells = " | ".join(f"{row[key]:.0f}" if key in COUNTS else f"{row[key]:.2f}" for key, _ in COLUMNS)
            lines.append(f"| {name} | {size} | {variant} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help="workload:size, comma-separated")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="write breakdown.json and breakdown.md here")
    args = parser.parse_args()
    bench.init_distributed(timeout_s=300.0)
    commit = str(bench.machine_info().get("git_commit"))[:10]
    report = {
        "machine": f"world size {dist.get_world_size()}, torch {torch.__version__}, commit {commit}",
        "rounds": args.rounds,
        "cases": {},
    }
    for case in args.cases.split(","):
        name, size = case.split(":")
        w = bench.WORKLOADS[name][1](size)
        report["cases"][case] = breakdown(w, args.variants.split(","), args.rounds)
        bench._log(f"{case}: " + ", ".join(f"{v} {row['step_ms']:.2f} ms" for v, row in report["cases"][case].items()))
    if dist.get_rank() == 0:
        text = _markdown(report)
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "breakdown.json").write_text(json.dumps(report, indent=2))
            (args.out / "breakdown.md").write_text(text)
    bench.shutdown_distributed()


if __name__ == "__main__":
    main()
