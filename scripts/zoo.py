"""The model zoo: transformers' own tensor parallelism (``tp_plan="auto"``) on a tiny config of every architecture
of the installed transformers that has a plan, under ``thunder.jit`` and thunderfx, against the one-process model.

Run under torchrun (every rank runs every check; rank 0 prints a line per check, then the table)::

    torchrun --nproc-per-node 2 --local-ranks-filter 0 scripts/zoo.py                 # everything (make zoo)
    torchrun --nproc-per-node 2 --local-ranks-filter 0 scripts/zoo.py --archs llama,gemma2 --frontends jit
    python scripts/zoo.py --list                                                       # what would run, no torchrun

``--out table.md`` writes the markdown table, ``--out table.json`` every row as JSON. Exits non-zero if a check
failed for a bug of this package (failures that plain thunder has on the unsharded model too, and architectures
whose eager TP already differs from the one-process model, are reported, not counted). See
``thunder_dtensor/testing/zoo.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor.testing import init_distributed, shutdown_distributed
from thunder_dtensor.testing.zoo import (
    FRONTENDS,
    Arch,
    Outcome,
    discover,
    format_table,
    generation_archs,
    outcomes_to_json,
    run_zoo,
)

import torch.distributed as dist


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", help="comma-separated model types (default: every one with a TP plan)")
    parser.add_argument(
        "--frontends",
        default=",".join(FRONTENDS),
        help=f"comma-separated, of {', '.join(FRONTENDS)}; 'none': eager TP against the one-process model only",
    )
    parser.add_argument(
        "--generate",
        choices=("family", "all", "none"),
        default="family",
        help="which architectures check greedy generate(): one per family (default), all, none",
    )
    parser.add_argument("--max-new-tokens", type=int, default=3, help="generate()'s new tokens")
    parser.add_argument(
        "--no-train",
        action="store_true",
        help="check only generate(), on the architectures --generate picks (fills a table's generate column)",
    )
    parser.add_argument("--out", type=pathlib.Path, help="write the table: .json for JSON rows, else markdown")
    parser.add_argument("--list", action="store_true", help="list the architectures (and why some are skipped)")
    parser.add_argument(
        "--from-json",
        nargs="+",
        type=pathlib.Path,
        metavar="JSON",
        help="run nothing: the table of rows written by earlier runs' --out X.json (several runs: merged in order)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="the process group's collective timeout")
    return parser.parse_args()


def _select(archs: list[Arch], names: str | None) -> list[Arch]:
    if not names:
        return archs
    by_name = {a.model_type: a for a in archs}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown architectures (see --list): {', '.join(unknown)}")
    return [by_name[n] for n in wanted]


def _list(archs: list[Arch]) -> None:
    with_generate = generation_archs(archs)
    for arch in archs:
        what = "train, generate" if arch.model_type in with_generate else "train"
        if arch.skip:
            what = f"skipped: {arch.skip}"
        print(f"{arch.model_type:36} {arch.family:12} {arch.model_class or '-':36} {what}")
    runnable = sum(a.skip is None for a in archs)
    print(f"{len(archs)} with a TP plan, {runnable} run, {len(with_generate)} families (one generate() each)")


def _write(path: pathlib.Path, outcomes: list[Outcome], archs: list[Arch]) -> None:
    """The table (markdown), or every row (``.json``); rewritten after each check, so that a run cut short leaves
    what it did."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(outcomes_to_json(outcomes), indent=1) + "\n")
    else:
        path.write_text(format_table(outcomes, archs) + "\n")


def main() -> int:
    args = _args()
    archs = _select(discover(), args.archs)
    if args.list:
        _list(archs)
        return 0
    if args.from_json:
        outcomes = [Outcome(**row) for path in args.from_json for row in json.loads(path.read_text())]
        print(format_table(outcomes, archs))
        if args.out:
            _write(args.out, outcomes, archs)
        return 0
    frontends = [f.strip() for f in args.frontends.split(",") if f.strip() and f.strip() != "none"]
    if any(f not in FRONTENDS for f in frontends):
        raise SystemExit(f"--frontends: each of {', '.join(FRONTENDS)}")
    init_distributed(timeout_s=args.timeout_s)
    rank0 = dist.get_rank() == 0
    started = time.perf_counter()

    done: list[Outcome] = []

    def report(outcome: Outcome) -> None:
        if rank0:
            extra = f" ({outcome.seconds:.0f}s)" if outcome.seconds else ""
            print(outcome.describe() + extra, flush=True)
            done.append(outcome)
            if args.out:
                _write(args.out, done, archs)

    outcomes = run_zoo(
        archs, frontends, args.generate, max_new_tokens=args.max_new_tokens, report=report, train=not args.no_train
    )
    if rank0:
        table = format_table(outcomes, archs)
        print("\n" + table)
        print(f"\n{dist.get_world_size()} ranks, {time.perf_counter() - started:.0f} s")
        if args.out:
            _write(args.out, outcomes, archs)
            print(f"written to {args.out}")
    shutdown_distributed()
    return 1 if any(o.verdict == "ours" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
