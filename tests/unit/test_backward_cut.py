"""The cut between a forward and a backward fusion region keeps what torch's partitioner would not recompute
(``keep_what_backward_regions_materialize``): thunder 0.2.6 cut at the fewest bytes, so under its torch.compile
executor the backward recomputed a gelu whose output a weight gradient's matmul reads, and a layer norm for its
mean and rstd."""

from thunder_dtensor import fixes

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex

_SPEEDUPS = ("keep_what_backward_regions_materialize", "run_cpu_ops_with_torch_kernels")


def _block(x: torch.Tensor, norm_w: torch.Tensor, norm_b: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor):
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],), norm_w, norm_b)
    return (torch.nn.functional.gelu(h @ w1) @ w2 + x).pow(2).mean()


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 32), (32,), (32,), (32, 64), (64, 32)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def _backward_region_symbols(keep: bool) -> tuple[list[str], list[torch.Tensor]]:
    """Names of the symbols inside the backward's fusion regions, and the gradients, with the speed-up on
    (everywhere: the program holds no DTensor) or off."""
    inputs = _inputs()
    with fixes.enabled("run_cpu_ops_with_torch_kernels", everywhere=True):
        switch = fixes.enabled(_SPEEDUPS[0], everywhere=True) if keep else fixes.disabled(_SPEEDUPS[0])
        with switch:
            jitted = thunder.jit(_block, executors=[torch_compile_ex, *thunder.get_default_executors()])
            jitted(*inputs).backward()
    backward = thunder.last_backward_traces(jitted)[-1]
    regions = [b for b in backward.bound_symbols if b.sym.is_fusion]
    assert regions, "no fusion region in the backward"
    return [s.sym.name for r in regions for s in r.subsymbols], [t.grad for t in inputs]


def _eager_gradients() -> list[torch.Tensor]:
    inputs = _inputs()
    _block(*inputs).backward()
    return [t.grad for t in inputs]


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "thunders_cut"])
def test_backward_region_recomputes_neither_gelu_nor_the_norm_with_the_speedup(keep: bool):
    names, grads = _backward_region_symbols(keep)
    for got, want in zip(grads, _eager_gradients()):
        torch.testing.assert_close(got, want)
    recomputed = sorted({n for n in names if n.endswith(("gelu", "layer_norm")) and "backward" not in n})
    if keep:
        assert recomputed == [], names
    else:  # thunder's own cut: the forward gelu and norm run again in the backward region
        assert any("gelu" in n for n in recomputed) and any("layer_norm" in n for n in recomputed), names


def test_a_matmul_input_with_siblings_keeps_its_whole_symbol(monkeypatch: pytest.MonkeyPatch):
    """The layer norm's output (read by the weight gradient's matmul) kept alone, without the small-output rule:
    its mean and rstd are kept with it (recomputing the norm for them made the output's name twice: "Trying to add
    the name t254 to a trace, but that name is already used", found on the FSDP2 bench model)."""
    from thunder_dtensor._integration.fixes import speedups

    monkeypatch.setattr(speedups, "_SMALL_OUTPUT_RATIO", 10**12)
    names, grads = _backward_region_symbols(keep=True)
    for got, want in zip(grads, _eager_gradients()):
        torch.testing.assert_close(got, want)
    assert not [n for n in names if n.endswith("layer_norm")], names
