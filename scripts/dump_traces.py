"""Write every trace of one training step of each of the suite's models to a folder, to compare two trees.

Run under torchrun (``torchrun --nproc-per-node 2 scripts/dump_traces.py OUT``): the models of
``scripts/kept_eager.py`` (GPT TP / SP, Llama 3 TP, torch's test Transformer TP / SP), with the lowering on
and off; rank 0 writes each prologue, computation and backward trace thunder kept (every pass) as its own
file, with what differs between runs of the same code removed (pass timings, object addresses). A refactor
that changes no behaviour leaves ``diff -r OLD NEW`` empty.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor.testing import init_distributed, shutdown_distributed

import thunder
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import kept_eager  # noqa: E402

_VOLATILE = (
    (re.compile(r" \(took \d+ milliseconds\)"), ""),
    (re.compile(r" at 0x[0-9a-f]+"), " at 0x?"),
)


def _stable(text: str) -> str:
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    args = parser.parse_args()
    init_distributed()
    rank0 = dist.get_rank() == 0
    written = 0
    for lowering in (True, False):
        kept_eager.JIT_OPTIONS.clear()
        kept_eager.JIT_OPTIONS["dtensor_lowering"] = lowering
        for label, run in kept_eager.models().items():
            jfn = run()
            kinds = {
                "prologue": thunder.last_prologue_traces(jfn),
                "computation": thunder.last_traces(jfn),
                "backward": thunder.last_backward_traces(jfn),
            }
            if not rank0:
                continue
            folder = args.out / f"{re.sub(r'[^A-Za-z0-9]+', '_', label).strip('_')}_lowering_{lowering}"
            folder.mkdir(parents=True, exist_ok=True)
            for kind, traces in kinds.items():
                for i, trace in enumerate(traces):
                    (folder / f"{kind}_{i:02d}.py").write_text(_stable(str(trace)))
                    written += 1
    if rank0:
        print(f"{written} traces written to {args.out}")
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
