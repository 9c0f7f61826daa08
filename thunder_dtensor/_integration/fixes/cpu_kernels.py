"""A speed-up (kind ``speedup``): on CPU, gelu, silu and layer_norm of plain tensors train with torch's kernels,
complex views with each other as gradients, and causal attention with torch's CPU flash kernel: one executor, put
first among thunder's default executors in the programs where the switch ``run_cpu_ops_with_torch_kernels`` acts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from thunder_dtensor._integration.compile_pipeline import let_torch_executors_claim
from thunder_dtensor._integration.program_scope import add_first_executor
from thunder_dtensor._integration.registry import installer

import torch

# ---------------------------------------------------------------------------------------------------------
# Plain CPU tensors: gelu, silu and layer_norm forward and backward as torch's own kernels (thunder 0.2.6)
# ---------------------------------------------------------------------------------------------------------
#: the executor that runs them (first among thunder's default executors, CPU tensors only)
EAGER_KERNELS_EXECUTOR_NAME = "cpu_eager_kernels"


def _plain_on_cpu(dtype_ok: Callable[[Any], bool], a: Any, *args: Any, **kwargs: Any) -> bool:
    """Plain (not DTensor) CPU tensors only, ``a`` of a dtype ``dtype_ok`` accepts, every tensor argument on
    the same device."""
    from thunder.core.proxies import TensorProxy

    tensors = [x for x in (a, *args, *kwargs.values()) if isinstance(x, TensorProxy)]
    return (
        type(a) is TensorProxy
        and a.device.devicetype.name == "CPU"
        and dtype_ok(a.dtype)
        and all(type(x) is TensorProxy and x.device == a.device for x in tensors)
    )


def _on_cpu(a: Any, *args: Any, **kwargs: Any) -> bool:
    """Plain (not DTensor) floating-point CPU tensors only, every tensor argument on the same device."""
    from thunder.core import dtypes

    return _plain_on_cpu(dtypes.is_float_dtype, a, *args, **kwargs)


@functools.cache
def _eager_kernels_executor() -> Any:
    """An executor whose grad rules for ``gelu``, ``silu`` and ``layer_norm`` on CPU are torch's: the forward
    kernel, saving what eager autograd saves, and the backward kernel (``gelu_backward``, ``silu_backward``,
    ``native_layer_norm_backward``). thunder 0.2.6 differentiates their decompositions instead, which on CPU
    (no fusion executor) costs a pass over memory per elementwise op and saves several intermediates per op:
    a 4-block LayerNorm + GELU MLP trains 1.9x slower than eager with 1.8x its peak memory."""
    import thunder.torch as ltorch
    from thunder.core.proxies import TensorProxy
    from thunder.core.transforms import get_grad, put_grad
    from thunder.extend import OperatorExecutor

    ex = OperatorExecutor(EAGER_KERNELS_EXECUTOR_NAME)
    aten = torch.ops.aten

    def same(a: Any, *args: Any, **kwargs: Any) -> Any:
        return TensorProxy(like=a)

    def like_input(g: Any, a: Any, *args: Any) -> Any:  # a backward's meta: the gradient of its input ``a``
        return TensorProxy(like=a)

    def operator(name: str, meta: Callable, fn: Callable) -> Any:
        return _register_fusible_operator(ex, name, meta, fn, "torch_kernels")

    gelu = operator("cpu_gelu", same, lambda a, approximate: aten.gelu(a, approximate=approximate))
    gelu_backward = operator(
        "cpu_gelu_backward", like_input, lambda g, a, approximate: aten.gelu_backward(g, a, approximate=approximate)
    )

    # the grad rules take their symbol's signature: thunderfx's splitter matches their parameters to its meta's
    def gelu_grad(a: Any, /, *, approximate: str = "none") -> Any:
        out = gelu(a, approximate)
        put_grad(a, gelu_backward(get_grad(out), a, approximate))
        return out

    ex.register_implementation(
        ltorch.gelu,
        checker=_on_cpu,
        execution_transform=lambda a, /, *, approximate="none": gelu(a, approximate),
        grad_transform=gelu_grad,
    )

    silu = operator("cpu_silu", same, aten.silu)
    silu_backward = operator("cpu_silu_backward", like_input, aten.silu_backward)

    def silu_grad(a: Any, /, inplace: bool = False) -> Any:
        out = silu(a)
        put_grad(a, silu_backward(get_grad(out), a))
        return out

    ex.register_implementation(
        ltorch.silu, checker=_on_cpu, execution_transform=lambda a, /, inplace=False: silu(a), grad_transform=silu_grad
    )

    def layer_norm_meta(a: Any, shape: tuple, weight: Any, bias: Any, eps: float) -> tuple:
        stats = (*a.shape[: a.ndim - len(shape)], *([1] * len(shape)))
        return TensorProxy(like=a), TensorProxy(like=a, shape=stats), TensorProxy(like=a, shape=stats)

    def layer_norm_backward_meta(g: Any, a: Any, shape: tuple, mean: Any, rstd: Any, weight: Any, bias: Any) -> tuple:
        return (
            TensorProxy(like=a),
            None if weight is None else TensorProxy(like=weight),
            None if bias is None else TensorProxy(like=bias),
        )

    def run_layer_norm_backward(g, a, shape, mean, rstd, weight, bias):  # noqa: ANN001, ANN202
        mask = [True, weight is not None, bias is not None]
        return aten.native_layer_norm_backward(g, a, list(shape), mean, rstd, weight, bias, mask)

    layer_norm = operator(
        "cpu_native_layer_norm",
        layer_norm_meta,
        lambda a, shape, weight, bias, eps: aten.native_layer_norm(a, list(shape), weight, bias, eps),
    )
    layer_norm_backward = operator("cpu_native_layer_norm_backward", layer_norm_backward_meta, run_layer_norm_backward)

    def layer_norm_forward(
        a: Any, /, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
    ) -> Any:
        return layer_norm(a, tuple(normalized_shape), weight, bias, eps)[0]

    def layer_norm_grad(
        a: Any, /, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
    ) -> Any:
        shape = tuple(normalized_shape)
        out, mean, rstd = layer_norm(a, shape, weight, bias, eps)
        grads = layer_norm_backward(get_grad(out), a, shape, mean, rstd, weight, bias)
        for x, g in zip((a, weight, bias), grads):
            if x is not None:
                put_grad(x, g)
        return out

    ex.register_implementation(
        ltorch.layer_norm, checker=_on_cpu, execution_transform=layer_norm_forward, grad_transform=layer_norm_grad
    )
    _register_complex_views(ex)
    _register_cpu_flash_attention(ex)
    return ex


def _register_fusible_operator(
    ex: Any, name: str, meta: Callable, fn: Callable, group: str, *, costly: bool = False
) -> Any:
    """An operator of ``ex`` that also joins the torch executors' tables: thunder's torch.compile executor fuses
    it into its regions (inductor compiles torch's kernel, as torch.compile would), so ``ex`` can go before it
    in a program's list (:func:`run_cpu_ops_with_torch_kernels`) without cutting a region. ``costly``: tagged as
    a matmul, which thunder's rematerialization never recomputes in a backward region (it saves its outputs)."""
    from thunder.core.prims import OpTags

    op = ex.register_operator(name, meta=meta, fn=fn, tags=(OpTags.MATMUL_OP,) if costly else None)
    let_torch_executors_claim(
        op, fn, owner=f"cpu_kernels.{group}", reason=f"{name} fusible by torch.compile", kind="speedup"
    )
    return op


def _flash_attention_runs(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, **_: Any
) -> bool:
    """Whether torch's CPU flash-attention kernel takes this call as it is: 4-D plain CPU float tensors of
    the same batch and head counts and one head size, keys and values of one length, no mask, no dropout."""
    return (
        _on_cpu(query, key, value)
        and attn_mask is None
        and isinstance(dropout_p, int | float)
        and dropout_p == 0.0
        and query.ndim == key.ndim == value.ndim == 4
        and tuple(query.shape[:2]) == tuple(key.shape[:2]) == tuple(value.shape[:2])
        and query.shape[3] == key.shape[3] == value.shape[3] > 0
        and key.shape[2] == value.shape[2] > 0
        and query.shape[2] > 0
    )


def _with_unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _register_cpu_flash_attention(ex: Any) -> None:
    """``scaled_dot_product_attention`` of plain CPU tensors with torch's fused CPU kernel, forward and
    backward, where eager would pick it too (no mask, no dropout: a causal LLM's attention). thunder 0.2.6
    decomposes SDPA into matmuls, a softmax and a mask on CPU (its ``sdpa`` executor claims CUDA only):
    about 15 ops forward and 30 backward, and the full score matrix saved for the backward."""
    import thunder.torch as ltorch
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.transforms import get_grad, put_grad

    aten = torch.ops.aten

    def flash_meta(q: Any, k: Any, v: Any, is_causal: bool, scale: Any) -> tuple:
        stats = dtypes.float32 if q.dtype in (dtypes.bfloat16, dtypes.float16) else q.dtype
        return TensorProxy(like=q), TensorProxy(like=q, shape=tuple(q.shape[:3]), dtype=stats)

    def run_flash(q, k, v, is_causal, scale):  # noqa: ANN001, ANN202
        q, k, v = (_with_unit_last_stride(t) for t in (q, k, v))
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)

    def flash_backward_meta(g: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, is_causal: bool, scale: Any) -> tuple:
        return TensorProxy(like=q), TensorProxy(like=k), TensorProxy(like=v)

    def run_flash_backward(g, q, k, v, out, lse, is_causal, scale):  # noqa: ANN001, ANN202
        q, k, v = (_with_unit_last_stride(t) for t in (q, k, v))
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g.contiguous(), q, k, v, out, lse, 0.0, is_causal, scale=scale
        )

    flash = _register_fusible_operator(ex, "cpu_flash_attention", flash_meta, run_flash, "flash_attention", costly=True)
    flash_backward = _register_fusible_operator(
        ex, "cpu_flash_attention_backward", flash_backward_meta, run_flash_backward, "flash_attention"
    )

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):  # noqa: ANN001, ANN202
        return flash(query, key, value, is_causal, scale)[0]

    def sdpa_grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):  # noqa: ANN001, ANN202
        out, lse = flash(query, key, value, is_causal, scale)
        grads = flash_backward(get_grad(out), query, key, value, out, lse, is_causal, scale)
        for x, g in zip((query, key, value), grads):
            put_grad(x, g)
        return out

    ex.register_implementation(
        ltorch.scaled_dot_product_attention,
        checker=_flash_attention_runs,
        execution_transform=sdpa,
        grad_transform=sdpa_grad,
    )


def _complex_on_cpu(a: Any, *args: Any, **kwargs: Any) -> bool:
    """A plain (not DTensor) complex CPU tensor."""
    from thunder.core import dtypes

    return _plain_on_cpu(dtypes.is_complex_dtype, a, *args, **kwargs)


def _complex_viewable_on_cpu(a: Any, *args: Any, **kwargs: Any) -> bool:
    """A plain (not DTensor) CPU tensor of a real dtype that has a complex counterpart (not bfloat16)."""
    from thunder.core import dtypes

    return _on_cpu(a) and a.dtype in (dtypes.float16, dtypes.float32, dtypes.float64)


def _register_complex_views(ex: Any) -> None:
    """``view_as_complex`` / ``view_as_real`` (a complex RoPE) differentiated by each other, as torch's autograd
    does. thunder 0.2.6 registers them automatically, with a backward that runs
    ``torch.autograd.functional.vjp`` on every call: about 90 µs against 2 µs for the view, four times per
    Llama block's step."""
    import thunder.torch as ltorch
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.transforms import get_grad, put_grad

    def complex_meta(a: Any) -> Any:
        return TensorProxy(like=a, shape=tuple(a.shape[:-1]), dtype=dtypes.corresponding_complex_dtype(a.dtype))

    def real_meta(a: Any) -> Any:
        return TensorProxy(like=a, shape=(*a.shape, 2), dtype=dtypes.corresponding_real_dtype(a.dtype))

    # torch's own backward formulas: a gradient may be non-contiguous, or (complex) an unresolved conjugate
    fns = {
        "cpu_view_as_complex": (complex_meta, torch.view_as_complex),
        "cpu_view_as_real": (real_meta, torch.view_as_real),
        "cpu_view_as_complex_backward": (real_meta, lambda g: torch.view_as_real(g.contiguous().resolve_conj())),
        "cpu_view_as_real_backward": (complex_meta, lambda g: torch.view_as_complex(g.contiguous())),
    }
    # thunder's torch.compile executor may fuse each, with the complex math around it, into its regions
    ops = {name: _register_fusible_operator(ex, name, meta, fn, "complex_views") for name, (meta, fn) in fns.items()}
    as_complex, as_real, as_complex_backward, as_real_backward = ops.values()

    def view_as_complex_grad(a: Any, /) -> Any:
        out = as_complex(a)
        put_grad(a, as_complex_backward(get_grad(out)))
        return out

    def view_as_real_grad(a: Any, /) -> Any:
        out = as_real(a)
        put_grad(a, as_real_backward(get_grad(out)))
        return out

    ex.register_implementation(
        ltorch.view_as_complex,  # type: ignore[attr-defined]  # (thunder registers it at import)
        checker=_complex_viewable_on_cpu,
        execution_transform=as_complex,
        grad_transform=view_as_complex_grad,
    )
    ex.register_implementation(
        ltorch.view_as_real,  # type: ignore[attr-defined]  # (thunder registers it at import)
        checker=_complex_on_cpu,
        execution_transform=as_real,
        grad_transform=view_as_real_grad,
    )


@installer("speedup", "gelu, silu, layer_norm, complex views and causal SDPA on CPU train with torch's kernels")
def run_cpu_ops_with_torch_kernels() -> None:
    """Put an executor first among thunder's default executors in a program's list (where this fix is active)
    that claims ``gelu``, ``silu`` and ``layer_norm`` of plain CPU tensors, forward and backward, with torch's
    kernels (see :func:`_eager_kernels_executor`), and ``view_as_complex`` / ``view_as_real`` with each other as
    gradients (:func:`_register_complex_views`), and attention without mask or dropout with torch's CPU flash
    kernel (:func:`_register_cpu_flash_attention`). A program whose ``executors=`` list leaves out thunder's
    defaults keeps it; other devices and DTensors are not claimed (nvFuser fuses the decompositions on GPUs)."""
    add_first_executor("run_cpu_ops_with_torch_kernels", _eager_kernels_executor(), ahead_of_torch_compile=True)
