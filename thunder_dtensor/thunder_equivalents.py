"""The lowered program's local ATen ops as thunder's own symbols, where thunder has one of the same meaning.

The lowering records what DTensor runs on the local shards as ATen calls. Emitted as ``aten_*`` symbols, only
the lowering's executor and thunder's torch executor know them: nvFuser (thunder's fusion executor on GPUs)
claims thunder's symbols and their prims, never ATen overloads. So each ATen op with a thunder counterpart is
emitted as that counterpart (``ltorch.reshape`` for ``aten.view``, ``ltorch.matmul`` for ``aten.mm``, ...),
which every thunder executor can claim and fuse. Collectives, the DTensor boundary and ATen ops without a
counterpart (fused attention kernels, ``native_layer_norm`` and the backward kernels) stay as they are.

Only counterparts that thunder's torch executor runs as one torch call are listed: on CPU (no fusion
executor) the program runs the same kernels as before. The lowering checks each emitted counterpart's
outputs (count, shapes, dtypes) against the recorded ATen call's and emits the ATen op where they differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thunder_dtensor import _integration as ti

import torch

__all__ = ["NoEquivalent", "THUNDER_EQUIVALENTS", "thunder_equivalent"]

aten = torch.ops.aten
lt = ti.ltorch


class NoEquivalent(Exception):
    """These arguments have no counterpart call: the ATen op is emitted instead."""


def _no_memory_format(memory_format: Any) -> None:
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        raise NoEquivalent(f"memory_format={memory_format}")


def _sum(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    if dim is None or len(dim) == 0:  # ATen's empty list reduces every dim
        if keepdim:
            raise NoEquivalent("keepdim over every dim")
        return lt.sum(x, dtype=dtype)
    return lt.sum(x, dim, keepdim, dtype=dtype)


def _mean(x: Any, dim: Any, keepdim: bool = False, *, dtype: Any = None) -> Any:
    if dim is None or len(dim) == 0:
        raise NoEquivalent("mean over every dim")
    return lt.mean(x, dim, keepdim, dtype=dtype)


def _addmm(bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    # DTensor's linear: ``addmm(bias, x, w.t())`` is ``linear(x, w, bias)``, one kernel in every executor
    if beta != 1 or alpha != 1 or bias.ndim != 1 or a.ndim != 2 or b.ndim != 2:
        raise NoEquivalent("addmm other than a linear layer's")
    return lt.linear(a, lt.t(b), bias)


def _clone(x: Any, *, memory_format: Any = None) -> Any:
    _no_memory_format(memory_format)
    return lt.clone(x) if memory_format in (None, torch.preserve_format) else lt.contiguous(x)


def _to_copy(
    x: Any,
    *,
    dtype: Any = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    non_blocking: bool = False,
    memory_format: Any = None,
) -> Any:
    # non_blocking only matters for a device move, which is refused
    if layout not in (None, torch.strided) or memory_format not in (None, torch.preserve_format):
        raise NoEquivalent("a layout or memory format")
    if pin_memory:
        raise NoEquivalent("pin_memory")
    if device is not None and torch.device(device) != ti.devices.to_torch_device(x.device):
        raise NoEquivalent("a device move")
    if dtype is None:
        return lt.clone(x)
    return lt.to(x, dtype, copy=True)


def _softmax(x: Any, dim: int, half_to_float: bool) -> Any:
    if half_to_float:
        raise NoEquivalent("half_to_float")
    return lt.softmax(x, dim)


def _scalar_tensor(
    value: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None
) -> Any:
    if layout not in (None, torch.strided):
        raise NoEquivalent("a layout")
    if pin_memory:
        raise NoEquivalent("pin_memory")
    return lt.full((), value, device=device, dtype=dtype if dtype is not None else torch.get_default_dtype())


def _embedding(weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False, sparse=False):  # noqa: ANN001, ANN202
    # the lookup's values do not depend on padding_idx (only its gradient does: embedding_dense_backward below)
    if scale_grad_by_freq or sparse:
        raise NoEquivalent("scale_grad_by_freq or sparse")
    return lt.embedding(indices, weight, padding_idx=None if padding_idx == -1 else padding_idx)


def _embedding_dense_backward(grad: Any, indices: Any, num_weights: int, padding_idx: int, scale: bool) -> Any:
    return lt.embedding_backward(grad, indices, num_weights, padding_idx, scale, False)


def _expand(x: Any, size: Any, *, implicit: bool = False) -> Any:
    # ``implicit`` only records that broadcasting asked for the expansion: the result is the same
    return lt.expand(x, size)


def _split(x: Any, size: Any, dim: int = 0) -> Any:
    return tuple(lt.split(x, size, dim))


def _pointwise(fn: Callable) -> Callable:
    """Tensor-tensor and tensor-number ATen overloads (``add.Tensor``, ``add.Scalar``): thunder's one symbol.

    ``alpha`` is keyword-only in ``add.Tensor`` and positional in ``add.Scalar``: both are taken.
    """

    def call(a: Any, b: Any, alpha: Any = None) -> Any:
        return fn(a, b) if alpha is None or alpha == 1 else fn(a, b, alpha=alpha)

    return call


#: ATen overload -> the thunder call of the same meaning (args and kwargs as the ATen op takes them). Every argument
#: of the overload's schema is passed on, or the call raises (``NoEquivalent``) and the ATen op is emitted:
#: ``tests/unit/test_thunder_equivalents.py`` calls each entry with every argument varied and compares with ATen.
THUNDER_EQUIVALENTS: dict[Any, Callable] = {
    # views and layout
    aten.alias.default: ti.prims.shallow_copy,
    aten.view.default: lt.reshape,
    aten._unsafe_view.default: lt.reshape,
    aten.reshape.default: lt.reshape,
    aten.t.default: lt.t,
    aten.transpose.int: lt.transpose,
    aten.permute.default: lt.permute,
    aten.expand.default: _expand,
    aten.unsqueeze.default: lt.unsqueeze,
    aten.squeeze.dim: lt.squeeze,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.cat.default: lt.cat,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    # matmul
    aten.mm.default: lt.matmul,
    aten.bmm.default: lt.matmul,
    aten.addmm.default: _addmm,
    # reductions and normalization
    aten.sum.dim_IntList: _sum,
    aten.sum.default: _sum,
    aten.mean.dim: _mean,
    aten._softmax.default: _softmax,
    # factories and embeddings
    aten.scalar_tensor.default: _scalar_tensor,
    aten.embedding.default: _embedding,
    aten.embedding_dense_backward.default: _embedding_dense_backward,
    aten.where.self: lt.where,
    aten.pow.Tensor_Scalar: lt.pow,
    aten.pow.Tensor_Tensor: lt.pow,
    aten.gelu.default: lambda x, approximate="none": lt.gelu(x, approximate=approximate),
}

for _name in ("add", "sub"):
    for _overload in ("Tensor", "Scalar"):
        THUNDER_EQUIVALENTS[getattr(getattr(aten, _name), _overload)] = _pointwise(getattr(lt, _name))
for _name in ("mul", "div", "lt", "le", "gt", "ge", "eq", "ne", "bitwise_or", "bitwise_and", "bitwise_xor"):
    for _overload in ("Tensor", "Scalar"):
        if hasattr(getattr(aten, _name), _overload):
            THUNDER_EQUIVALENTS[getattr(getattr(aten, _name), _overload)] = getattr(lt, _name)
for _name in (
    "abs", "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "relu", "silu", "reciprocal",
    "logical_not", "bitwise_not", "erf",
):  # fmt: skip
    THUNDER_EQUIVALENTS[getattr(aten, _name).default] = getattr(lt, _name)


def thunder_equivalent(overload: Any) -> Callable | None:
    """The thunder call that means what ``overload`` does, or None."""
    return THUNDER_EQUIVALENTS.get(overload)
