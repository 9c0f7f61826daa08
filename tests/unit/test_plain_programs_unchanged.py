"""Importing thunder_dtensor changes DTensor programs only: plain programs compile to the same traces, with the
same executors, values and gradients, as in a process where thunder was imported without the package.

thunder 0.2.x cannot import on torch >= 2.13 by itself; the process "without the package" gives it, for the
duration of its import only, the named-tensor placeholders (and on torch >= 2.14 the Python ``Function.apply``)
it reads, as ``thunder_dtensor`` does, and imports nothing of this package.

The thunder fixes and speed-ups are switched off in the process with the package (``THUNDER_DTENSOR_THUNDER_FIXES=0``,
``THUNDER_DTENSOR_SPEEDUPS=0``): they are about plain programs by design; what is checked here is that the
DTensor machinery itself (dispatch, executors, hooks) leaves plain programs alone.
"""

import json
import os
import re
import subprocess
import sys

import pytest

_PROGRAMS = r"""
import json, os, re, sys
import torch

if os.environ["MODE"] in ("package", "undone"):
    import thunder_dtensor  # noqa: F401
    import thunder
    if os.environ["MODE"] == "undone":
        from thunder.core.transforms import _grad_fn_map

        assert [k for k in _grad_fn_map if str(k).startswith("thunder_dtensor.")]  # the grad rules of our prims
        thunder_dtensor._integration.undo_all()
        assert thunder_dtensor._integration.installed() == []
else:
    from plain_thunder import import_plain_thunder  # (scripts/, on PYTHONPATH)

    import_plain_thunder()
    import thunder
    assert not [m for m in sys.modules if m.startswith("thunder_dtensor")]

from thunder.dynamo import thunderfx

def text(trace):
    return re.sub(r"\(took \d+ milliseconds\)", "", re.sub(r"_\d{6,}", "_<id>", str(trace)))

def tensors(x):
    return [t.detach().tolist() for t in (x if isinstance(x, (list, tuple)) else [x])]

def pointwise(x, w):
    return ((x * w + x).exp() / 3).sum(-1)

def views_and_writes(x, w):
    y = x.clone()
    y[:, 1:] = y[:, 1:] * 2
    z = y.view(-1, 2).transpose(0, 1).reshape(-1)
    return (z[::2] * w.flatten()[:z[::2].numel()]).cumsum(0)

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 6))

def module_call(x, w):
    return torch.nn.functional.cross_entropy(mlp(x * w), torch.tensor([1, 0, 5, 2]))

def attention(x, w):
    q = (x * w).view(1, 2, 4, 3)
    return torch.nn.functional.scaled_dot_product_attention(q, q.sin(), q.cos(), is_causal=True).softmax(-1)

results = {}
for name, fn in [("pointwise", pointwise), ("views_and_writes", views_and_writes), ("module_call", module_call),
                 ("attention", attention)]:
    for frontend in ("jit", "thunderfx"):
        torch.manual_seed(1)
        shape = (4, 6)
        x = torch.randn(shape, requires_grad=True)
        w = torch.randn(shape, requires_grad=True)
        mlp.zero_grad(set_to_none=True)
        compiled = thunder.jit(fn) if frontend == "jit" else thunderfx(fn)
        try:
            out = compiled(x, w)
            out.sum().backward()
        except Exception as e:  # thunder's own failure: the same with and without the package
            results[f"{name}/{frontend}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[-1][:300]}"}
            continue
        params = [p.grad for p in mlp.parameters() if p.grad is not None]
        record = {"out": tensors(out), "grads": tensors([x.grad, w.grad, *params])}
        if frontend == "jit":
            traces = thunder.last_traces(compiled) + thunder.last_backward_traces(compiled)
            record["traces"] = [text(t) for t in [thunder.last_prologue_traces(compiled)[-1], *traces]]
            record["executors"] = [re.sub(r"_\d+$", "", e.name) for e in thunder.compile_data(compiled).executors_list]
        else:
            infos = compiled._backend.subgraph_infos
            record["splits"] = [r.info for info in infos for r in info.split_reasons]
            record["traces"] = [text(t) for t in compiled.last_traces]
        results[f"{name}/{frontend}"] = record
import thunder.extend
from thunder.core.transforms import _grad_fn_map
from thunder.executors.torchex import ex as torch_executor

# thunder's tables as they stand after the programs ran (the same with and without the package, undone)
results["tables"] = {
    "grad rules": sorted(map(str, _grad_fn_map)),
    "torch executor": sorted(map(str, [*torch_executor.opmap, *torch_executor.implmap])),
    "executors": sorted(map(str, thunder.extend._executor_map)),
}
print("RESULTS", json.dumps(results))
"""


_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")


def _start(mode: str) -> subprocess.Popen:
    env = {**os.environ, "MODE": mode, "PYTHONHASHSEED": "0"}  # thunder iterates sets: the same order in both
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SCRIPTS, env.get("PYTHONPATH")]))
    for switch in ("THUNDER_DTENSOR_THUNDER_FIXES", "THUNDER_DTENSOR_SPEEDUPS"):
        env.pop(switch, None)
    if mode == "package":
        env.update(THUNDER_DTENSOR_THUNDER_FIXES="0", THUNDER_DTENSOR_SPEEDUPS="0")
    return subprocess.Popen(
        [sys.executable, "-c", _PROGRAMS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _results(process: subprocess.Popen) -> dict:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    line = next(line for line in stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """The three processes run at once: thunder alone, the package (fix kinds off), the package undone."""
    started = {mode: _start(mode) for mode in ("plain", "package", "undone")}
    return {mode: _results(process) for mode, process in started.items()}


def test_undo_all_leaves_thunder_as_a_fresh_process_has_it(runs):
    """With every patch on (thunder fixes and speed-ups too), ``undo_all()`` puts every slot back: plain
    programs then compile to the traces, executors, values and gradients of a process without the package."""
    assert runs["undone"] == runs["plain"]


@pytest.mark.parametrize(
    "case",
    [f"{n}/{f}" for n in ("pointwise", "views_and_writes", "module_call", "attention") for f in ("jit", "thunderfx")],
)
def test_plain_program_is_compiled_as_without_the_package(runs, case):
    plain, package = runs["plain"][case], runs["package"][case]
    assert package.get("error") == plain.get("error")
    if "error" in plain:
        return
    assert package["out"] == plain["out"]
    assert package["grads"] == plain["grads"]
    assert package.get("executors") == plain.get("executors")
    assert package.get("splits") == plain.get("splits")
    assert len(package["traces"]) == len(plain["traces"])
    for ours, theirs in zip(package["traces"], plain["traces"]):
        assert ours == theirs, "\n".join(_first_difference(ours, theirs))


def _first_difference(a: str, b: str) -> list[str]:
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines())):
        if x != y:
            return [f"line {i}:", f"  with the package:    {x}", f"  without the package: {y}"]
    return [re.sub(r"\s+", " ", "lengths differ")]
