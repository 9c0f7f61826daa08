"""Hooks on the module passed to ``thunder.jit`` (plain tensors): values inside them are read from that module.

thunder 0.2.6 alone fails here in the prologue (``KeyError``): it read the hook dicts of its ``ThunderModule``
wrapper instead of the user's module (``_integration.read_root_module_state_from_user_module``).
"""

import functools

import thunder_dtensor  # noqa: F401  (first: makes thunder importable on torch >= 2.13)

import thunder
import torch


def _scale_output(module, args, output, *, scale):
    return output * scale


def _shift_input(module, args, *, shift):
    return (args[0] + shift,)


def _add_kwarg_offset(module, args, kwargs, output, *, offset):
    return output + offset


def _hooked_linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    m.register_forward_pre_hook(functools.partial(_shift_input, shift=2))
    m.register_forward_hook(functools.partial(_scale_output, scale=3))
    m.register_forward_hook(functools.partial(_add_kwarg_offset, offset=0.5), with_kwargs=True)
    return m


def test_root_hooks_with_captured_values_run_once_and_train():
    model, ref = _hooked_linear(), _hooked_linear()
    jitted = thunder.jit(model)
    for step in range(2):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        out, expected = jitted(x), ref(x)
        torch.testing.assert_close(out, expected)  # each hook applied exactly once
        out.sum().backward()
        expected.sum().backward()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, r.grad)
    assert (thunder.cache_misses(jitted), thunder.cache_hits(jitted)) == (1, 1)
    prologue = str(thunder.last_prologue_traces(jitted)[-1])
    assert "module0._forward_hooks" in prologue and "module._forward_hooks" not in prologue


def test_root_hook_value_change_retraces_and_wrapper_hooks_stay_outside():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3).requires_grad_(False)
    handle = m.register_forward_hook(functools.partial(_scale_output, scale=3))
    jitted = thunder.jit(m)
    x = torch.randn(2, 4)
    torch.testing.assert_close(jitted(x), m(x))
    handle.remove()
    m.register_forward_hook(functools.partial(_scale_output, scale=5))
    torch.testing.assert_close(jitted(x), m(x))  # the new hook's value, not the cached program's
    assert thunder.cache_misses(jitted) == 2

    # a hook on the ThunderModule itself runs around the compiled program, once, as on any nn.Module
    jitted.register_forward_hook(lambda module, args, output: output + 1)
    torch.testing.assert_close(jitted(x), m(x) + 1)
    assert thunder.cache_misses(jitted) == 2
