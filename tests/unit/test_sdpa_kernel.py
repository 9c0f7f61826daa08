"""``torch.nn.attention.sdpa_kernel(...)`` in model code under thunder.jit and thunderfx (plain tensors)."""

import warnings

import thunder_dtensor  # (first: makes thunder importable on torch >= 2.13)
from thunder_dtensor.sdpa_backends import (
    SDPABackendError,
    SDPAKernelChoice,
    TraceTimeSDPAKernel,
    current_sdpa_backends,
    current_sdpa_kernel,
    set_sdpa_kernel,
)

import pytest
import thunder
import torch
import torch.nn.functional as F
from thunder.core.trace import TraceCtx, tracectx
from thunder.dynamo import thunderfx
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

#: torchtitan's list
TITAN_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
]
SINGLE_BACKENDS = [
    SDPBackend.MATH,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.OVERRIDEABLE,
]


def _global_sdpa_flags() -> tuple:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())


class Attention(nn.Module):
    """torchtitan's shape of attention: the backend list around the SDPA call (twice: plain, then with priority)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        with sdpa_kernel(TITAN_BACKENDS):
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
            h = F.scaled_dot_product_attention(h, k, v)
        return self.proj(h.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("compiler", ["jit", "thunderfx"])
def test_attention_module_matches_torch_and_thunderfx_does_not_split(compiler):
    torch.manual_seed(0)
    model = Attention()
    reference = Attention()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    flags = _global_sdpa_flags()

    compiled = thunder.jit(model) if compiler == "jit" else thunderfx(model)
    with thunder_dtensor.fixes_everywhere("thunderfx_graphs"):  # (a plain program: thunderfx's fix is opt-in)
        out = compiled(x)
        out.backward(torch.ones_like(out))
    expected = reference(x_ref)
    expected.backward(torch.ones_like(expected))

    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
    assert _global_sdpa_flags() == flags  # the context set no torch flag (neither while tracing nor running)
    if compiler == "thunderfx":
        infos = compiled._backend.subgraph_infos
        assert len(infos) == 1
        assert infos[0].split_reasons == []  # no _sdpa_kernel / _backend_from_string node split off
        pieces = [name for name, _ in infos[0].split_graph_module.named_children()]
        assert len(infos[0].thunder_compiled_fns) == 1 and pieces == ["thunder_0"], pieces
    else:
        assert str(thunder.last_traces(compiled)[-1]).count("scaled_dot_product_attention") >= 2


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_single_backends_on_cpu_refused_exactly_where_eager_refuses(dropout_p):
    """On CPU eager runs MATH always, FLASH_ATTENTION without dropout, and no other backend alone."""
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))
    flags = _global_sdpa_flags()
    for backend in SINGLE_BACKENDS:
        fn = _attention_under(backend, dropout_p)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns why it skipped each kernel
                expected, eager_error = fn(q, k, v), None
        except RuntimeError as e:
            expected, eager_error = None, e
        if eager_error is None:
            out = thunder.jit(fn)(q, k, v)
            if dropout_p == 0.0:
                torch.testing.assert_close(out, expected)
            continue
        with pytest.raises(SDPABackendError) as raised:
            thunder.jit(fn)(q, k, v)
        message = str(raised.value)
        assert f"SDPBackend.{backend.name}" in message and "on cpu" in message, message
        assert "Hint: add SDPBackend.MATH" in message, message
        assert _global_sdpa_flags() == flags
    # eager's CPU kernels: the cases above ran both ways
    assert {b for b in SINGLE_BACKENDS if _eager_runs(b, dropout_p)} == (
        {SDPBackend.MATH, SDPBackend.FLASH_ATTENTION} if dropout_p == 0.0 else {SDPBackend.MATH}
    )


def _attention_under(backend: SDPBackend, dropout_p: float):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    return fn


def _eager_runs(backend: SDPBackend, dropout_p: float) -> bool:
    q = torch.randn(1, 1, 2, 4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _attention_under(backend, dropout_p)(q, q, q)
    except RuntimeError:
        return False
    return True


def test_choice_is_scoped_like_eager():
    """Refusal follows the choice in effect at the SDPA call: nested blocks, after the block, dynamo's spelling."""
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))

    def after_block(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            pass
        return F.scaled_dot_product_attention(q, k, v)

    def nested(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            with sdpa_kernel([SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, k, v)

    def inner_refused(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

    def raises_inside(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            raise ValueError("from inside the block")

    def dynamo_spelling(q, k, v, restore_first):
        # what dynamo's graph (hence thunderfx's thunder graph) calls for the block: the choice, then the
        # previous flags
        attention = torch.nn.attention
        attention._sdpa_kernel([attention._backend_from_string("CUDNN_ATTENTION")], False)
        if restore_first:
            attention._sdpa_kernel(SINGLE_BACKENDS, False)
        return F.scaled_dot_product_attention(q, k, v)

    expected = F.scaled_dot_product_attention(q, k, v)
    for fn in (after_block, nested):
        torch.testing.assert_close(thunder.jit(fn)(q, k, v), expected)
    torch.testing.assert_close(thunder.jit(dynamo_spelling)(q, k, v, True), expected)
    for fn in (inner_refused, lambda q, k, v: dynamo_spelling(q, k, v, False)):
        with pytest.raises(SDPABackendError):
            thunder.jit(fn)(q, k, v)
    with pytest.raises(ValueError, match="from inside the block"):
        thunder.jit(raises_inside)(q, k, v)


def test_thunderfx_refuses_at_compile_time():
    """Under thunderfx dynamo's own fake run already applies the flags and refuses, before thunder sees the graph."""
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))

    def fn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    with pytest.raises(Exception, match="No viable backend|none of these backends"):
        thunderfx(fn)(q, k, v)


def test_current_sdpa_backends_records_the_choice_per_trace():
    assert current_sdpa_backends() is None  # no trace
    trace = TraceCtx()
    with tracectx(trace):
        assert current_sdpa_backends() is None
        outer = TraceTimeSDPAKernel(TITAN_BACKENDS + [SDPBackend.MATH])
        with outer:
            assert current_sdpa_backends() == tuple(TITAN_BACKENDS)  # deduplicated, in the given order
            with TraceTimeSDPAKernel(SDPBackend.MATH, set_priority=True):
                assert current_sdpa_kernel() == SDPAKernelChoice((SDPBackend.MATH,), True)
            assert current_sdpa_kernel() == SDPAKernelChoice(tuple(TITAN_BACKENDS), False)
            with tracectx(TraceCtx()):
                assert current_sdpa_backends() is None  # another trace has its own
        assert current_sdpa_backends() is None
        # dynamo's spelling: the choice, then torch's flags as they were, which is no choice
        set_sdpa_kernel([SDPBackend.CUDNN_ATTENTION])
        assert current_sdpa_backends() == (SDPBackend.CUDNN_ATTENTION,)
        set_sdpa_kernel([b for b in SINGLE_BACKENDS if b != SDPBackend.MATH] + [SDPBackend.MATH])
        assert current_sdpa_backends() is None
    with pytest.raises(AssertionError, match="SDPBackend"):
        TraceTimeSDPAKernel((SDPBackend.MATH,))  # eager's check: a list or one backend
