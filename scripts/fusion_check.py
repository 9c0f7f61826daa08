"""Whole-program inductor and early collectives (issue 44, points 1 and 4): every bench workload under thunder's
torch.compile executor listed first (``fused``), with ``dtensor_issue_early=True`` (``early``) and with both
(``fused_early``: the early order must not cut inductor's regions), against the
default ``thunder.jit``, both front ends: the loss, every parameter's gradient (full values and placements) and
the collectives of a training step (the collective symbols of the executed forward and backward programs, inside
inductor's regions too: torch's ``CommDebugMode`` is a dispatch mode, which torch.compile refuses) must be the
default's; it prints how many inductor graphs each program became and its collectives (FSDP2's run in its hooks,
outside the programs: none are listed there).

    torchrun --nproc-per-node 2 scripts/fusion_check.py     # --workloads block:64,gpt:test,llama:test,fsdp:256
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import thunder_dtensor  # noqa: F401,E402  (before thunder)
from thunder_dtensor.testing import collectives_issued, init_distributed, shutdown_distributed  # noqa: E402

import thunder  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from thunder.executors.torch_compile import torch_compile_ex  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

BUILDERS = {
    "block": lambda size: __import__("bench").block_workload(int(size)),
    "gpt": lambda size: __import__("bench").gpt_workload(size),
    "llama": lambda size: __import__("bench").llama_workload(size),
    "fsdp": lambda size: __import__("bench").fsdp_workload(size),
}


#: the options of each variant (``default``: the default thunder.jit, the reference)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "fused": {"executors": None},  # (filled in: thunder's torch.compile executor first)
    "early": {"dtensor_issue_early": True},
    "fused_early": {"executors": None, "dtensor_issue_early": True},
}


def _compile(model: torch.nn.Module, frontend: str, variant: str) -> Any:
    options: dict[str, Any] = {"dtensor_lowering": True, **VARIANTS[variant]}
    if "executors" in options:
        options["executors"] = [torch_compile_ex, *thunder.get_default_executors()]
    if frontend == "jit":
        return thunder.jit(model, **options)
    from thunder.dynamo import thunderfx

    return thunderfx(model, **options)


def _programs(compiled: Any, frontend: str) -> list:
    """The executed forward and backward traces of ``compiled`` (of each thunder graph under thunderfx)."""
    jitted = [compiled]
    if frontend != "jit":
        jitted = [fn for info in compiled._backend.subgraph_infos for fn in info.thunder_compiled_fns]
    return [t for fn in jitted for t in (thunder.last_traces(fn)[-1], thunder.last_backward_traces(fn)[-1])]


def _graphs(traces: list) -> str:
    """How many inductor graphs (torch.compile regions) the forward and backward programs hold."""

    def regions(t: Any) -> int:
        return sum(1 for b in t.bound_symbols if re.match(r"TorchCompile\d+$", b.sym.name))

    return f"{sum(map(regions, traces[0::2]))} forward, {sum(map(regions, traces[1::2]))} backward"


def _step(workload: Any, frontend: str, variant: str) -> dict:
    """Two training steps (the second counted): loss, gradients (full values, placements), collectives."""
    model = workload.make_model()
    compiled = _compile(model, frontend, variant)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    workload.loss(compiled(*workload.inputs), workload.target).backward()  # first call: compiles
    for p in params:
        p.grad = None
    loss = workload.loss(compiled(*workload.inputs), workload.target)
    loss.backward()
    grads = []
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            grads.append((g.full_tensor(), tuple(g.placements)))
        else:
            grads.append((g, None))
    full_loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    return {
        "loss": full_loss.detach(),
        "grads": grads,
        "comms": collectives_issued(_programs(compiled, frontend)),
        "graphs": _graphs(_programs(compiled, frontend)),
    }


def _differences(default: dict, other: dict) -> list[str]:
    problems = []
    if not torch.allclose(default["loss"], other["loss"], rtol=1e-5, atol=1e-6):
        problems.append(f"loss {default['loss'].item()} vs {other['loss'].item()}")
    for i, ((gd, pd), (go, po)) in enumerate(zip(default["grads"], other["grads"])):
        if (gd is None) != (go is None) or pd != po:
            problems.append(f"gradient {i}: placements {pd} vs {po}")
        elif gd is not None and not torch.allclose(gd, go, rtol=1e-4, atol=1e-5):
            problems.append(f"gradient {i}: max difference {(gd - go).abs().max().item():.3g}")
    if default["comms"] != other["comms"]:
        problems.append(f"collectives {default['comms']} vs {other['comms']}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="block:64,gpt:test,llama:test,fsdp:256")
    parser.add_argument("--frontends", default="jit,thunderfx")
    parser.add_argument(
        "--variants", default="fused,early,fused_early", help="of: " + ", ".join(v for v in VARIANTS if v != "default")
    )
    args = parser.parse_args()
    init_distributed()
    failures = 0
    for item in args.workloads.split(","):
        name, size = item.split(":")
        workload = BUILDERS[name](size)
        for frontend in args.frontends.split(","):
            default = _step(workload, frontend, "default")
            for variant in args.variants.split(","):
                other = _step(workload, frontend, variant)
                problems = _differences(default, other)
                failures += bool(problems)
                if dist.get_rank() == 0:
                    verdict = "ok" if not problems else "DIFFERS: " + "; ".join(problems)
                    print(
                        f"{name}:{size} {frontend} {variant} ws={dist.get_world_size()}: {verdict} | collectives a "
                        f"step {other['comms']} | inductor graphs {other['graphs']}",
                        flush=True,
                    )
    shutdown_distributed()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
