"""The lowered program is thunder's own symbols, so thunder's fusion executors can claim its local math.

The lowering emits each local ATen op that thunder has a symbol for as that symbol (thunder_equivalents.py):
with thunder's torch.compile executor listed, inductor fuses the local math of each block between the
collectives, which stay this package's. The Llama (complex RoPE, which torch.compile regions must leave out)
trains with the same values and gradients as under the default executors.
"""

import functools

from thunder_dtensor.lowering import COLLECTIVE_SYMBOLS, _symbol_name
from thunder_dtensor.testing import mesh_1d
from thunder_dtensor.testing.llama import Llama, LlamaConfig, apply_tp, llama_loss
from thunder_dtensor.thunder_equivalents import THUNDER_EQUIVALENTS

import pytest
import thunder
import torch

STEPS = 2
BOUNDARY = {"unwrap_dtensor", "wrap_dtensor", "local_contiguous"}
#: local math a torch.compile region should hold (thunder's symbols, as the torch executor names them)
LOCAL_MATH = {"matmul", "linear", "mul", "add", "pow", "mean", "rsqrt", "reshape", "permute", "softmax"}


def _train(executors: list | None) -> tuple:
    cfg = LlamaConfig(layers=1)
    torch.manual_seed(0)
    model = apply_tp(Llama(cfg), mesh_1d(), loss_parallel=False)
    jitted = thunder.jit(model, **({} if executors is None else {"executors": executors}))
    g = torch.Generator().manual_seed(7)
    losses, grads = [], []
    for _ in range(STEPS):
        tokens, labels = (torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g) for _ in range(2))
        model.zero_grad(set_to_none=True)
        loss = llama_loss(jitted(tokens), labels)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: (p.grad.full_tensor(), p.grad.placements) for n, p in model.named_parameters()})
    return jitted, losses, grads


@functools.cache
def _default_run() -> tuple:
    return _train(None)


def _names(trace) -> list[str]:
    return [b.sym.name for b in trace.bound_symbols]


@pytest.mark.world_size(2)
def test_lowered_local_ops_are_thunder_symbols():
    jitted, _, _ = _default_run()
    with_equivalent = {_symbol_name(op) for op in THUNDER_EQUIVALENTS if hasattr(op, "overloadpacket")}
    for trace in (thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]):
        names = _names(trace)
        assert not [n for n in names if n.startswith("dtensor_") and n.endswith("_prim")], "not lowered"
        left = sorted({n for n in names if n.startswith("aten_")} & with_equivalent)
        assert not left, f"ATen ops emitted though thunder has a symbol for them: {left}"
        assert {"matmul", "mul", "add"} <= set(names), sorted(set(names))


@pytest.mark.world_size(2)
def test_torch_compile_executor_fuses_the_local_math_of_each_block():
    from thunder.executors.torch_compile import torch_compile_ex

    _, losses, grads = _default_run()
    fused_jit, fused_losses, fused_grads = _train([torch_compile_ex, *thunder.get_default_executors()])
    for step in range(STEPS):
        torch.testing.assert_close(fused_losses[step], losses[step])
        for name, (grad, placements) in grads[step].items():
            fused_grad, fused_placements = fused_grads[step][name]
            assert fused_placements == placements, name
            torch.testing.assert_close(fused_grad, grad, msg=lambda m, n=name, s=step: f"{n} at step {s}: {m}")

    for trace in (thunder.last_traces(fused_jit)[-1], thunder.last_backward_traces(fused_jit)[-1]):
        regions = [b for b in trace.bound_symbols if b.sym.name.startswith("TorchCompile")]
        inside = {s.sym.name for r in regions for s in r.subsymbols}
        outside = set(_names(trace))
        assert regions and {"matmul", "mul", "add"} <= inside, sorted(inside)
        # collectives and the DTensor boundary are never fused; the local math is, apart from the complex RoPE
        assert not inside & (set(COLLECTIVE_SYMBOLS) | BOUNDARY), sorted(inside)
        assert not outside & LOCAL_MATH - {"mul"}, sorted(outside & LOCAL_MATH)
        complex_muls = [
            b
            for b in trace.bound_symbols
            if b.sym.name == "mul" and any(getattr(a, "dtype", None) == thunder.complex64 for a in b.flat_proxy_args)
        ]
        real_muls_outside = [b for b in trace.bound_symbols if b.sym.name == "mul" and b not in complex_muls]
        assert not real_muls_outside, [str(b) for b in real_muls_outside]
