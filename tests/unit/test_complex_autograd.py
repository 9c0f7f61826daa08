"""Complex gradients follow torch's convention (``g * conj(f'(z))``); thunder 0.2.6's own rules drop the conj.

Each test fails on unpatched thunder 0.2.6 (``_integration.fix_complex_gradients`` not installed).
"""

import operator

import thunder_dtensor  # (first: makes thunder importable on torch >= 2.13)

import thunder
import torch
import torch.nn.functional as F


def rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """torchtitan's Llama 3 rotary embedding: pairs of channels as complex numbers, rotated by ``freqs_cis``."""
    x_complex = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_complex * freqs_cis).flatten(3)


def rope_inputs() -> list[torch.Tensor]:
    torch.manual_seed(0)
    batch, seq, heads, head_dim = 2, 3, 2, 4
    x = torch.randn(batch, seq, heads, head_dim, dtype=torch.bfloat16)
    angles = torch.randn(seq, head_dim // 2)
    freqs_cis = torch.polar(torch.ones_like(angles), angles).view(1, seq, 1, head_dim // 2)
    return [x, freqs_cis]


def assert_grads_match_torch(compiled, fn, inputs: list[torch.Tensor]) -> None:
    """Values and gradients of ``compiled`` equal plain torch autograd's, every input requiring grad."""
    expected_inputs = [t.clone().requires_grad_() for t in inputs]
    actual_inputs = [t.clone().requires_grad_() for t in inputs]
    expected = fn(*expected_inputs)
    cotangent = torch.randn_like(expected)
    actual = compiled(*actual_inputs)
    torch.testing.assert_close(actual, expected)
    expected_grads = torch.autograd.grad(expected, expected_inputs, cotangent)
    actual_grads = torch.autograd.grad(actual, actual_inputs, cotangent)
    for actual_grad, expected_grad in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(actual_grad, expected_grad)


def test_rope_grads_under_jit():
    assert_grads_match_torch(thunder.jit(rope), rope, rope_inputs())


def test_rope_grads_under_thunderfx():
    from thunder.dynamo import thunderfx

    compiled = thunderfx(rope)
    with thunder_dtensor.fixes_everywhere("thunderfx_graphs"):  # (a plain program: thunderfx's fix is opt-in)
        assert_grads_match_torch(compiled, rope, rope_inputs())
    # thunderfx leaves view_as_complex / view_as_real to inductor (thunder has only a torch fallback for them);
    # the complex multiplication, whose rule was wrong, runs in thunder
    (info,) = compiled._backend.subgraph_infos
    thunder_targets = {
        node.target
        for name, submodule in info.split_graph_module.named_children()
        if name.startswith("thunder_")
        for node in submodule.graph.nodes
    }
    assert operator.mul in thunder_targets


def test_complex_grads_of_other_rules():
    """The other corrected rules in one program: div, exp, sin, pow, acosh, matmul, linear, real / imag."""

    def fn(a, b, w, bias):
        h = torch.exp(a) / b + torch.sin(a) ** 2 + torch.acosh(2 * b)
        h = F.linear(h @ w, w, bias)
        return h.real * h.imag

    torch.manual_seed(0)
    inputs = [torch.randn(2, 3, dtype=torch.complex64) for _ in range(2)]
    inputs += [torch.randn(3, 3, dtype=torch.complex64), torch.randn(3, dtype=torch.complex64)]
    assert_grads_match_torch(thunder.jit(fn), fn, inputs)
