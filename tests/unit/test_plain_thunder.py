"""With thunder_dtensor imported, plain-tensor programs behave exactly as in thunder."""

import subprocess
import sys

import thunder_dtensor  # (first: makes thunder importable on torch >= 2.13)
from thunder_dtensor.testing import assert_jit_matches_eager

import pytest
import thunder
import torch
from thunder.transforms import ConstantFolding


def test_named_tensor_shims_do_not_leak():
    # thunder 0.2.6 needs these at import time where torch removed them (some in 2.12, all in 2.13); afterwards
    # torch.Tensor is as torch made it: torch's own methods, or none, never a placeholder of this package
    for name in ("align_as", "align_to", "has_names", "refine_names", "rename"):
        method = vars(torch.Tensor).get(name)
        assert method is None or "thunder_dtensor" not in f"{getattr(method, '__module__', '')}{type(method)}"


def test_plain_program_uses_thunder_symbols_and_grads():
    def fn(x, w):
        return (x * w + x).exp().sum()

    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    jfn = thunder.jit(fn)
    out = jfn(x, w)
    out.backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    expected = fn(x2, w2)
    expected.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    initial = str(thunder.last_traces(jfn)[0])
    assert "ltorch.mul(x, w)" in initial and "ltorch.add(" in initial
    assert not [b for b in thunder.last_traces(jfn)[-1].bound_symbols if b.sym.name.startswith("dtensor")]
    # no trace of a plain program names this package (the cotangent meta it patches prints as thunder's prim)
    assert not [t for t in thunder.last_traces(jfn) + thunder.last_backward_traces(jfn) if "thunder_dtensor" in str(t)]


def test_plain_thunderfx_splits_as_thunder_does():
    """With the thunderfx fix switched on everywhere (plain thunderfx fails on torch 2.13 otherwise, as without the
    package: fx's lazy code generation inside thunder's interpreter), our splitter hooks leave plain graphs to
    thunder's decisions: supported ops in thunder, the rest to inductor."""
    from thunder.dynamo import thunderfx

    def fn(x):
        return torch.ops.aten.sin.default(x * 2) + x.cos()

    x = torch.randn(4, 5)
    compiled = thunderfx(fn)
    with thunder_dtensor.fixes_everywhere("thunderfx_graphs"):
        torch.testing.assert_close(compiled(x), fn(x))
    (info,) = compiled._backend.subgraph_infos
    assert [name for name, _ in info.split_graph_module.named_children()] == ["thunder_0", "inductor_1", "thunder_2"]
    (reason,) = info.split_reasons
    assert "didn't have any mapping in thunder" in reason.info  # thunder's own reason, not ours
    assert "dtensor" not in str(compiled.last_traces[0])


def test_constant_folding_with_package_imported():
    def fn(x):
        scale = torch.tensor([2.0])
        scale = (scale * 10) / 5
        return x * scale

    x = torch.randn(3)
    jfn = thunder.jit(fn, transforms=[ConstantFolding()])
    torch.testing.assert_close(jfn(x), x * 4.0)
    final = str(thunder.last_traces(jfn)[-1])
    assert "[4.0]" in final  # (2 * 10) / 5 was folded into a constant
    assert "ltorch.mul(scale" not in final


def test_import_without_torch_distributed():
    """torch built without distributed: importing works and plain thunder.jit still runs."""
    code = (
        "import torch\n"
        "torch.distributed.is_available = lambda: False\n"
        "import thunder_dtensor, thunder\n"
        "assert not thunder_dtensor.DISTRIBUTED_AVAILABLE\n"
        "assert not hasattr(thunder_dtensor, 'DTensorProxy')\n"
        "x = torch.arange(6.0)\n"
        "out = thunder.jit(lambda a: a * 2 + 1)(x)\n"
        "assert torch.equal(out, x * 2 + 1), out\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_thunder_tables_keep_thunder_entries():
    """DTensor calls are routed before thunder's tables are read: its torch-to-thunder map, its Tensor-method
    table and ConstantFolding's inverse map hold no dispatch entry of this package (thunder's own experimental
    DTensor wrappers stay where thunder put them)."""
    from thunder_dtensor.dispatch import DISPATCH_TABLE, METHOD_TABLE

    from thunder.torch import _torch_to_thunder_function_map
    from thunder.torch.langctx import _method_name_to_fn_map
    from thunder.transforms import constant_folding

    ours = {id(route.dtensor_symbol) for route in [*DISPATCH_TABLE.values(), *METHOD_TABLE.values()]}
    assert len(ours) > 300
    inverse = constant_folding._thunder_to_torch_function_map
    for table in (_torch_to_thunder_function_map, _method_name_to_fn_map, inverse):
        assert not [v for v in table.values() if id(v) in ours]
        assert not [k for k in table if id(k) in ours]
    mapped = _torch_to_thunder_function_map.values()
    wrapped = [fn for fn in mapped if "dispatch_to_impl" in getattr(fn, "__qualname__", "")]
    assert wrapped, "thunder 0.2.6 registers its experimental DTensor wrappers at import; we leave them"


def test_why_thunder_needs_the_named_tensor_shims():
    """Without this package's torch plugin, thunder 0.2.x imports only where torch has the named-tensor methods.

    On torch >= 2.12 it fails on ``align_as`` (what the shims supply); if a thunder or torch release changes
    that, the shims must have nothing left to do.
    """
    import os

    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    result = subprocess.run(
        [sys.executable, "-c", "import thunder"], capture_output=True, text=True, timeout=300, env=env
    )
    if result.returncode != 0:
        assert "align_as" in result.stderr, result.stderr[-2000:]
    else:
        assert all(hasattr(torch.Tensor, name) for name in ("align_as", "align_to", "rename"))


_PLAIN_PROGRAM = """
import functools, json, sys
import thunder_dtensor, thunder, torch
import thunder.core.symbol, thunder.core.transforms, thunder.core.prims

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
model.register_forward_pre_hook(functools.partial(lambda scale, mod, args: (args[0] * scale,), 0.5))
model[2].register_forward_hook(lambda mod, args, out: out + 1)

def fn(x, pair):
    a, b = pair
    y = model(x[:, :8] + a)
    return y.softmax(-1) * b["w"]

# the first-call speed-ups keep the trace; the CPU kernels executor (a step-time speed-up) changes it
thunder_dtensor.fixes.enable("all", everywhere=True)
thunder_dtensor.fixes.disable("run_cpu_ops_with_torch_kernels")
cpu_kernels = [n for n in thunder_dtensor._integration.installers() if n.endswith("run_cpu_ops_with_torch_kernels")]
jfn = thunder.jit(fn)
x = torch.randn(3, 10, requires_grad=True)
out = jfn(x, (torch.ones(8), {"w": torch.full((4,), 2.0)}))
out.sum().backward()
print(json.dumps({
    "out": out.tolist(),
    "grads": [x.grad.tolist()] + [p.grad.tolist() for p in model.parameters()],
    "trace": str(thunder.last_traces(jfn)[-1]).split("\\n", 1)[1],
    # one patch of each kind, as installed or not
    "speedup": thunder.core.symbol.inspect is not __import__("inspect") and bool(cpu_kernels),
    "thunder-fix": "complex" in thunder.core.transforms._grad_fn_map[thunder.core.prims.PrimIDs.LINEAR].__qualname__,
}))
"""


@pytest.mark.parametrize("kind", ["THUNDER_DTENSOR_SPEEDUPS", "THUNDER_DTENSOR_THUNDER_FIXES"])
def test_patches_that_are_not_about_dtensors_can_be_switched_off_and_keep_plain_values(kind):
    """The speed-ups and thunder fixes the package installs (docs/architecture.md lists them) are switched off
    by ``<kind>=0``; a plain program with module hooks, a partial, indexing and unpacking gives the same values,
    gradients and (speed-ups) the same final trace with them on and off."""
    import json
    import os

    processes = [  # on and off, at once
        subprocess.Popen(
            [sys.executable, "-c", _PLAIN_PROGRAM],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, kind: value},
        )
        for value in ("1", "0")
    ]
    runs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        runs.append(json.loads(stdout.strip().splitlines()[-1]))
    on, off = runs
    patch = "speedup" if kind == "THUNDER_DTENSOR_SPEEDUPS" else "thunder-fix"
    assert on[patch] and not off[patch]
    assert on["out"] == off["out"] and on["grads"] == off["grads"]
    if kind == "THUNDER_DTENSOR_SPEEDUPS":
        assert on["trace"] == off["trace"]


def test_custom_autograd_function_runs_its_own_backward():
    """A custom ``torch.autograd.Function`` under thunder.jit: eager's values and its own (here deliberately not
    the true) backward. On torch >= 2.14 ``Function.apply`` is C and this takes the registered thunder fix
    (``call_custom_autograd_functions_with_builtin_apply``); before, thunder's own lookaside."""

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3

    def fn(x):
        return Double.apply(x).sin()

    x2, g = assert_jit_matches_eager(fn, (4, 3))
    torch.testing.assert_close(x2.grad, 3 * torch.cos(2 * x2.detach()) * g)  # the custom backward, not the true one


def _silu_of_model_plus_gelu(model: torch.nn.Module):
    def fn(x):
        return torch.nn.functional.silu(model(x)) + torch.nn.functional.gelu(x)

    return fn


def test_cpu_activations_and_norms_train_with_torchs_kernels():
    """On CPU, gelu, silu and layer_norm of plain tensors run and train with torch's kernels (the speed-up
    ``run_cpu_ops_with_torch_kernels``): eager's values and gradients, in fp32 and bf16."""
    import thunder

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 16)
        ).to(dtype)

        fn = _silu_of_model_plus_gelu(model)

        x = torch.randn(4, 16, dtype=dtype, requires_grad=True)
        jfn = thunder.jit(fn)
        out = jfn(x)
        out.sum().backward()
        grads = [x.grad, *(p.grad for p in model.parameters())]
        x.grad = None
        model.zero_grad(set_to_none=True)
        expected = fn(x)
        expected.sum().backward()
        tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out, expected, **tol)
        for g, e in zip(grads, [x.grad, *(p.grad for p in model.parameters())], strict=True):
            torch.testing.assert_close(g, e, **tol)
        forward, backward = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
        for op in ("cpu_native_layer_norm(", "cpu_gelu(", "cpu_silu("):
            assert op in forward, op
        for op in ("cpu_native_layer_norm_backward(", "cpu_gelu_backward(", "cpu_silu_backward("):
            assert op in backward, op
    # thunderfx's splitter differentiates each op through the rules' signatures: nothing is split off
    from thunder.dynamo import thunderfx

    compiled = thunderfx(fn)
    with thunder_dtensor.fixes_everywhere("thunderfx_graphs"):  # (a plain program: thunderfx's fix is opt-in)
        compiled(x).sum().backward()
    assert [r.info for info in compiled._backend.subgraph_infos for r in info.split_reasons] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_trains_with_torchs_flash_kernel(dtype):
    """``scaled_dot_product_attention`` of CPU tensors without mask or dropout (a causal LLM's, its q, k, v
    transposed views) runs and trains with torch's CPU flash kernel, eager's values and gradients; with a mask
    (which the kernel's backward does not differentiate) thunder's own decomposition stays."""
    import thunder
    import torch.nn.functional as F

    def causal(q, k, v):
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3).transpose(1, 2)

    def masked(q, k, v):
        mask = torch.ones(3, 3, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for fn, flash in ((causal, True), (masked, False)):
        g = torch.Generator().manual_seed(0)
        qkv = [torch.randn(2, 5, 3, 8, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]
        qkv2 = [t.detach().clone().requires_grad_() for t in qkv]
        jfn = thunder.jit(fn)
        out, expected = jfn(*qkv), fn(*qkv2)
        cot = torch.randn(out.shape, generator=g, dtype=dtype)
        out.backward(cot)
        expected.backward(cot)
        torch.testing.assert_close(out, expected, **tol)
        for actual, eager in zip(qkv, qkv2, strict=True):
            torch.testing.assert_close(actual.grad, eager.grad, **tol)
        forward, backward = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
        assert ("cpu_flash_attention(" in forward) is flash, forward
        assert ("cpu_flash_attention_backward(" in backward) is flash, backward


def test_torch_compile_regions_take_torchs_cpu_kernels_whole():
    """With thunder's torch.compile executor listed first (``[torch_compile_ex, *defaults]``), the CPU kernels
    executor goes just before it and its ops join the regions: attention trains with torch's flash kernel
    inside the region (its output saved for the backward, not recomputed there), layer_norm and gelu with
    torch's kernels; one region each way, eager's values and gradients. (Before, the torch.compile executor
    took them first and thunder differentiated their decompositions: the test Llama's fused program had 29
    inductor kernels to compile against torch.compile's 21, its first call 1.4-1.6x torch.compile's.)"""
    import thunder
    import torch.nn.functional as F
    from thunder.executors.torch_compile import torch_compile_ex
    from thunder.extend import get_default_executors

    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8)

    def fn(q, k, v):
        q, k, v = (norm(z).transpose(1, 2) for z in (q, k, v))
        return F.gelu(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2))

    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(2, 5, 3, 8, generator=g, requires_grad=True) for _ in range(3)]
    qkv2 = [t.detach().clone().requires_grad_() for t in qkv]
    jfn = thunder.jit(fn, executors=[torch_compile_ex, *get_default_executors()])
    out = jfn(*qkv)
    grads = torch.autograd.grad(out, [*qkv, *norm.parameters()], torch.ones_like(out))
    expected = fn(*qkv2)
    eager_grads = torch.autograd.grad(expected, [*qkv2, *norm.parameters()], torch.ones_like(expected))
    torch.testing.assert_close(out, expected)
    for actual, eager in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(actual, eager)
    forward, backward = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    assert forward.count("= TorchCompile") == 1 and backward.count("= TorchCompile") == 1, (forward, backward)
    for op in ("cpu_flash_attention(", "cpu_native_layer_norm(", "cpu_gelu("):
        assert op in forward, op
    for op in ("cpu_flash_attention_backward(", "cpu_native_layer_norm_backward(", "cpu_gelu_backward("):
        assert op in backward, op
    assert "cpu_flash_attention(" not in backward, "the attention was recomputed in the backward"


def test_complex_views_train_with_each_other_as_gradients():
    """``view_as_complex`` / ``view_as_real`` of CPU tensors (a complex RoPE, and a complex leaf) differentiate
    by each other, with eager's values and gradients, non-contiguous cotangents included, and none of thunder's
    per-call ``torch.autograd.functional.vjp`` fallbacks in the backward."""
    import thunder

    freqs = torch.polar(torch.ones(8, 2), torch.randn(8, 2, generator=torch.Generator().manual_seed(0)))

    def rope(x):  # the Llama's rotary embedding, then a transpose: the cotangent reaches it non-contiguous
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs.reshape(1, 8, 1, 2)).flatten(3).transpose(1, 2)

    x, g = assert_jit_matches_eager(rope, (2, 8, 4, 4))
    z = torch.randn(3, 5, dtype=torch.complex64, requires_grad=True)
    z2 = z.detach().clone().requires_grad_()

    def scaled(z):  # a complex leaf through view_as_real, its cotangent a transposed real tensor
        return torch.view_as_real(z * (1 + 2j)).transpose(0, 2)

    jfn = thunder.jit(scaled)
    out = jfn(z)
    cot = torch.randn_like(out)
    out.backward(cot)
    scaled(z2).backward(cot)
    torch.testing.assert_close(out, scaled(z2))
    torch.testing.assert_close(z.grad, z2.grad)
    jrope = thunder.jit(rope)
    jrope(x).backward(g)
    for jitted in (jrope, jfn):
        backward = str(thunder.last_backward_traces(jitted)[-1])
        assert "_vjp(" not in backward
        assert "cpu_view_as_real_backward(" in backward
    assert "cpu_view_as_complex(" in str(thunder.last_traces(jrope)[-1])
    assert "cpu_view_as_complex_backward(" in str(thunder.last_backward_traces(jrope)[-1])


_ALIAS_ORDER_PROGRAM = """
import thunder_dtensor, thunder, torch
def fn(x, o):
    y = x.clone()
    y.sub_(o)
    return torch.cat(y.split(6, dim=1)[::-1], dim=1)
jfn = thunder.jit(fn)
jfn(torch.randn(6, 8, 7, requires_grad=True), torch.randn(6, 8, 7))
print(str(thunder.last_traces(jfn)[-1]).split("\\n", 1)[1])
"""


def test_alias_updates_do_not_depend_on_the_hash_seed():
    """thunder orders the operands of an ``update_aliases`` line by iterating a set, so the program (in a DTensor
    program: the order of its collectives) followed each process's hash seed, which differs between ranks; the
    fuzzer's runs died of mismatched gloo collectives. With the fix the traces are the same under any seed (these
    two seeds give different orders without it). It acts within DTensor programs; this plain program takes it
    when it is switched on everywhere, and shows thunder's own order otherwise."""
    import os

    def start(seed: str, everywhere: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONHASHSEED": seed, "THUNDER_DTENSOR_FIXES_EVERYWHERE": everywhere}
        command = [sys.executable, "-c", _ALIAS_ORDER_PROGRAM]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    processes = {(seed, on): start(seed, on) for seed in ("1", "2") for on in ("alias_group_order", "")}
    traces = {}
    for key, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        traces[key] = stdout
    assert "update_aliases" in traces["1", "alias_group_order"]
    assert traces["1", "alias_group_order"] == traces["2", "alias_group_order"]
    assert traces["1", ""] != traces["2", ""]  # thunder's own order, without the fix
