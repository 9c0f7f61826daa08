"""Differential fuzzing of thunder_dtensor: random DTensor programs vs plain torch and eager DTensor.

Run under torchrun (every rank runs every program; rank 0 prints)::

    torchrun --nproc-per-node 2 --local-ranks-filter 0 scripts/fuzz.py --seeds 0:200
    torchrun --nproc-per-node 4 --local-ranks-filter 0 scripts/fuzz.py --count 50 --start 1000 --mesh 2d

Each program runs as plain torch, eager DTensor and thunder.jit with the lowering on and off (and thunderfx, for
programs that read values into Python, and ``--thunderfx-share`` of the others), each compiled function called on
two data sets. Prints one line per failing program, followed by its standalone reproducer (``--no-repro``: the
line only; ``--repro-dir``: also written to files), then the summary: how many programs ran, passed, were rejected
by eager DTensor (and what thunder did), ran under thunderfx, had a read of data refused by thunder.jit as plain
thunder refuses it, failed, by failure kind, and each distinct failure signature with its smallest program.
Before the summary, each signature's smallest program is made smaller (``REDUCED`` lines and
reproducers: the shortest failing prefix, unneeded steps dropped, inputs made Replicate; ``--no-minimize`` skips
it; a few seconds per signature). Exits non-zero if any program failed for a bug of this package (failures
whose bug is upstream, in thunder.jit itself or in eager DTensor, are reported, not counted).
See ``thunder_dtensor/testing/fuzz.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys

import thunder_dtensor  # noqa: F401  (before thunder)
import thunder_dtensor.testing.fuzz as fuzz_module
from thunder_dtensor.testing import init_distributed, shutdown_distributed, world_size
from thunder_dtensor.testing.fuzz import ProgramResult, fuzz, parse_seeds

import torch.distributed as dist


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", help="START:STOP (STOP excluded), or one seed")
    parser.add_argument("--count", type=int, default=100, help="how many seeds, from --start (without --seeds)")
    parser.add_argument("--start", type=int, default=0, help="the first seed (without --seeds)")
    parser.add_argument("--time-limit-s", type=float, default=None, help="start no program after this many seconds")
    parser.add_argument("--mesh", choices=("1d", "2d", "both"), default="both", help="both: odd seeds 2-D if ws >= 4")
    parser.add_argument("--stop-on-failure", action="store_true", help="stop after the first failing program")
    parser.add_argument(
        "--thunderfx-share",
        type=float,
        default=0.0,
        help="the share of programs reading no values into Python that also run under thunderfx (those that read "
        "values always do); about two programs' time each",
    )
    parser.add_argument(
        "--view-writes",
        type=float,
        default=float(os.environ.get("THUNDER_DTENSOR_FUZZ_VIEW_WRITES", "0")),
        help="the weight of in-place writes into views among the op builders (others weigh 1 to 6; default 0, or "
        "THUNDER_DTENSOR_FUZZ_VIEW_WRITES: none drawn, every seed's program as before); e.g. 20 for one in three",
    )
    parser.add_argument(
        "--one-shot-bytes",
        type=int,
        default=0,
        help="run the lowering mode with dtensor_one_shot_all_reduce_bytes=N (sum all-reduces up to N bytes as one "
        "all-gather and a local sum); 0: the default ring all-reduces",
    )
    parser.add_argument("--no-repro", action="store_true", help="print the failing programs' lines only")
    parser.add_argument("--repro-dir", type=pathlib.Path, help="also write each reproducer to a file here")
    parser.add_argument(
        "--no-minimize", action="store_true", help="do not make each failure signature's smallest program smaller"
    )
    parser.add_argument(
        "--leave-out",
        default="",
        help="comma list of step kinds (e.g. sdpa: eager DTensor's CPU attention strategies can take minutes) whose "
        "programs are not run; counted in the summary",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per program, not only failing ones")
    return parser.parse_args()


def main() -> int:
    args = _args()
    seeds = parse_seeds(args.seeds) if args.seeds else range(args.start, args.start + args.count)
    init_distributed()
    # eager DTensor's notes on suboptimal redistributions and gloo's missing all_to_all: noise in a fuzz log
    for name in ("torch.distributed.tensor._redistribute", "torch.distributed.tensor._collective_utils"):
        logging.getLogger(name).setLevel(logging.ERROR)
    ws = world_size()
    rank0 = dist.get_rank() == 0
    if args.mesh == "2d" and ws < 4:
        if rank0:
            print(f"--mesh 2d needs a world size >= 4 (this run has {ws})", file=sys.stderr)
        return 2
    if args.repro_dir and rank0:
        args.repro_dir.mkdir(parents=True, exist_ok=True)
    if args.one_shot_bytes:
        fuzz_module.LOWERING_OPTIONS["dtensor_one_shot_all_reduce_bytes"] = args.one_shot_bytes

    def show_reproducer(text: str, file_name: str) -> None:
        """Write the reproducer into --repro-dir and print it (unless --no-repro)."""
        if args.repro_dir:
            path = args.repro_dir / file_name
            path.write_text(text)
            print(f"    reproducer: {path}", flush=True)
        if not args.no_repro:
            print("    ---- reproducer ----\n" + text + "    ---- end ----", flush=True)

    def report(result: ProgramResult) -> None:
        if not rank0:
            return
        if result.outcome != "failed":
            if args.verbose:
                print(f"{result.outcome.upper()} ({result.seconds:.1f}s) {result.program.describe()}", flush=True)
            return
        print(result.headline(), flush=True)
        for failure in result.failures:
            print(f"    {failure}", flush=True)
        if result.eager_error:
            print(f"    eager DTensor: {result.eager_error}", flush=True)
        show_reproducer(result.reproducer(), f"repro_ws{ws}_seed{result.program.seed}.py")

    summary = fuzz(
        seeds,
        mesh=args.mesh,
        time_limit_s=args.time_limit_s,
        stop_on_failure=args.stop_on_failure,
        on_result=report,
        minimize_failures=not args.no_minimize,
        thunderfx_share=args.thunderfx_share,
        view_writes=args.view_writes,
        leave_out=[k for k in args.leave_out.split(",") if k],
    )
    if rank0:
        for n, (signature, result) in enumerate(summary.minimized.items()):
            print(f"REDUCED {n}: {signature}\n    {result.program.describe()}", flush=True)
            show_reproducer(result.reproducer(signature), f"repro_ws{ws}_seed{result.program.seed}_reduced{n}.py")
        print("\n".join(summary.report_lines()), flush=True)
    shutdown_distributed()
    return 1 if summary.failed_here else 0


if __name__ == "__main__":
    sys.exit(main())
