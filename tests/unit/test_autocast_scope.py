"""An autocast a jitted function is called under applies to that call only (thunder 0.2.6 kept it for later calls)."""

import thunder_dtensor  # noqa: F401

import thunder
import torch


def test_autocast_of_one_call_does_not_leak_into_later_calls():
    f = thunder.jit(lambda a, b: a @ b)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(a, b).dtype == torch.bfloat16
    out = f(a, b)  # retraced without autocast
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, a @ b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(a, b).dtype == torch.bfloat16
    assert f(a, b).dtype == torch.float32
    assert thunder.cache_misses(f) == 2 and thunder.cache_hits(f) == 2
