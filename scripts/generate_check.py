"""Tensor-parallel generation, the whole matrix: transformers' ``generate()`` on tiny models loaded with
``tp_plan="auto"``, for each architecture, front end (eager TP, ``thunder.jit``, thunderfx), KV cache (dynamic,
static, none), greedy and sampling (a fixed seed), against the one-process model's tokens; with ``--unsharded``
the one-process model under plain thunder (its fixes on everywhere) too. Prints a line per case with the number of
programs ``thunder.jit`` compiled. The suite runs a subset (tests/distributed/test_generate.py).

    torchrun --nproc-per-node 2 scripts/generate_check.py --archs llama,qwen3,mixtral
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor import fixes_everywhere
from thunder_dtensor.testing import shutdown_distributed, zoo

import thunder
import torch.distributed as dist

#: the real Mixtral's config has no sliding window (transformers' sliding-window static cache counts in a Python int:
#: a program per step; ``--keep-windows`` keeps the zoo's window to see it)
OVERRIDES = {"mixtral": {"sliding_window": None}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", default="llama,qwen3,mixtral")
    parser.add_argument("--frontends", default="jit,thunderfx")
    parser.add_argument("--caches", default="dynamic,static")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--unsharded", action="store_true", help="also the one-process model under plain thunder")
    parser.add_argument("--keep-windows", action="store_true", help="the zoo's sliding windows (Mixtral)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    where = [tempfile.mkdtemp(prefix="thunder_dtensor_generate_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    failures = 0
    for arch in args.archs.split(","):
        path = os.path.join(where[0], arch)
        with zoo.quiet():
            zoo.save_tiny(arch, path, None if args.keep_windows else OVERRIDES.get(arch))
            prompt = zoo.make_prompt()
            for cache in args.caches.split(","):
                one_process = zoo.load(path, False)
                expected = {
                    seed: zoo.generate_tokens(one_process, prompt, args.new_tokens, cache, seed) for seed in (None, 7)
                }
                for frontend in ("eager", *args.frontends.split(",")):
                    for sharded in (True, False) if args.unsharded and frontend != "eager" else (True,):
                        model = zoo.load(path, sharded)
                        started = time.perf_counter()
                        try:
                            with fixes_everywhere("all") if not sharded else contextlib.nullcontext():
                                for seed, tokens in expected.items():
                                    zoo.check_generate(model, frontend, prompt, tokens, cache, seed)
                            outcome = "ok"
                        except Exception as error:  # noqa: BLE001  (a row of the table)
                            outcome, failures = f"FAILS {type(error).__name__}: {str(error)[:300]}", failures + 1
                        programs = thunder.cache_misses(model.forward) if frontend == "jit" else "-"
                        if dist.get_rank() == 0:
                            print(
                                f"{arch:8} {frontend:9} {cache:7} {'tp' if sharded else 'unsharded':9} "
                                f"greedy+sampled: {outcome} | programs {programs} | "
                                f"{time.perf_counter() - started:.0f} s",
                                flush=True,
                            )
    shutdown_distributed()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
