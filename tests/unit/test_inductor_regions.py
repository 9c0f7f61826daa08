"""thunder's torch.compile executor, in programs where ``compile_fused_regions_without_dynamo`` acts, compiles each
region with inductor directly: no dynamo frame, inductor's code for each layout of the region's inputs, and
thunder's own path (``torch.compile``) for what that cannot take."""

from thunder_dtensor import fixes
from thunder_dtensor._integration.fixes import speedups

import thunder
import torch
from torch._dynamo.utils import counters


def _region_math(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (a @ b).relu() + 1, (a * 2).sum(0)


def _frames() -> int:
    """Graphs dynamo has captured in this process."""
    return counters["stats"]["unique_graphs"]


def _region(fn=_region_math) -> speedups._InductorRegion:
    return speedups._InductorRegion(fn, torch.compile(fn, fullgraph=True))


def test_a_region_compiles_once_per_layout_of_its_inputs_without_dynamo():
    torch._dynamo.reset()
    region, g = _region(), torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)
    frames = _frames()
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(region(a, b), _region_math(a, b))
        assert len(region.compiled) == 1 and not region.use_dynamo
        # a transposed input: inductor's code asserts its strides, so the region compiles for it too
        at = torch.randn(4, 6, generator=g).t()
        torch.testing.assert_close(region(at, b), _region_math(at, b))
        torch.testing.assert_close(region(a, b), _region_math(a, b))
    assert len(region.compiled) == 2 and not region.use_dynamo
    assert _frames() == frames, "dynamo captured a graph"


def test_a_region_taking_a_number_or_many_layouts_runs_torch_compile():
    torch._dynamo.reset()

    def scaled(a: torch.Tensor, s: float) -> torch.Tensor:
        return a * s

    region, a = _region(scaled), torch.randn(3, 4)
    with torch.no_grad():
        for s in (2.0, 3.0):  # a number would be a constant of inductor's graph: dynamo guards it
            torch.testing.assert_close(region(a, s), a * s)
    assert region.use_dynamo and not region.compiled

    region = _region()
    with torch.no_grad():
        for n in range(1, speedups._LAYOUTS_PER_REGION + 3):
            a, b = torch.randn(n, 4), torch.randn(4, 5)
            torch.testing.assert_close(region(a, b), _region_math(a, b))
    assert region.use_dynamo and len(region.compiled) == speedups._LAYOUTS_PER_REGION


def test_what_make_fx_cannot_trace_runs_torch_compile():
    torch._dynamo.reset()

    def data_dependent(a: torch.Tensor) -> torch.Tensor:
        return a[a > 0].sum() + a.nonzero().shape[0]

    region, a = _region(data_dependent), torch.randn(5, 3)
    with torch.no_grad():
        torch.testing.assert_close(region(a), data_dependent(a))
    assert region.use_dynamo


def _jitted_plain_program():
    from thunder.executors.torch_compile import torch_compile_ex

    jitted = thunder.jit(_region_math, executors=[torch_compile_ex, *thunder.get_default_executors()])
    a, b = torch.randn(6, 4), torch.randn(4, 5)
    for _ in range(2):
        torch.testing.assert_close(jitted(a, b), _region_math(a, b))


def test_plain_programs_keep_dynamo_unless_the_speedup_acts_everywhere():
    torch._dynamo.reset()
    frames = _frames()
    _jitted_plain_program()
    assert _frames() > frames, "a plain program's region no longer went through torch.compile"
    torch._dynamo.reset()
    frames = _frames()
    with fixes.enabled("compile_fused_regions_without_dynamo", everywhere=True):
        _jitted_plain_program()
    assert _frames() == frames
