"""Losses: the mean of a class-index ``nll_loss`` / ``cross_entropy`` over a batch-sharded input.

DTensor's rule gives such a loss ``Partial(avg)``: each rank's own weighted mean, averaged over ranks. That
is the global mean only when every rank's denominator (the summed class weights of its targets that are
not ``ignore_index``) is the same, which depends on the targets: with class weights or ``ignore_index``
padding eager DTensor returns a wrong loss, silently (an unevenly sharded batch it refuses). Here the loss is
the sum-reduced loss over that denominator, both ``Partial(sum)`` and computed by DTensor's own rules:
``loss(..., reduction="sum") / nll_loss(-1, target, weight, ignore_index, reduction="sum")`` (torch's mean,
label smoothing included, divides by exactly that sum), the count and the division in float32. Where eager
is right (no weights, no ignored target) this still changes its program: the output is ``Partial(sum)``
instead of ``Partial(avg)``, with one more all-reduce (of the count), since which targets are ignored is only
known at run time. Every other call is the generic per-op prim.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import dtensor_symbol_of, register_function_for_dtensor
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.ops.fallback import FallbackSymbol, fallback_name, fallback_prim
from thunder_dtensor.ops.pointwise import dtensor_convert_element_type_prim, dtensor_div_prim
from thunder_dtensor.primitive import define_dtensor_symbol, propagated_fakes
from thunder_dtensor.proxy import DTensorProxy

import torch
import torch.nn.functional as F

__all__ = ["exact_mean_placements", "mean_is_per_rank", "replaces_per_rank_means"]


def mean_is_per_rank(torch_fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether DTensor would return this loss as ``Partial(avg)`` of per-rank means (see the docstring), or
    rejects the mean on well-formed inputs (an unevenly sharded batch): the sum over the count is exact then too."""
    try:
        out = propagated_fakes(fallback_prim(torch_fn).name, torch_fn, args, kwargs)
    except DTensorOpError as error:
        return not error.structural
    return isinstance(out, ti.DTensor) and any(
        p.is_partial() and cast(ti.Partial, p).reduce_op == "avg" for p in out.placements
    )


def exact_mean_placements(eager: tuple) -> tuple | None:
    """The placements this module gives a mean loss eager DTensor places ``eager``: its ``Partial(avg)`` of
    per-rank means made the exact ``Partial(sum)``; None where eager has no such mean."""
    summed = tuple(ti.Partial("sum") if p.is_partial() and cast(ti.Partial, p).reduce_op == "avg" else p for p in eager)
    return summed if summed != tuple(eager) else None


def replaces_per_rank_means(torch_fn: Any, eager: tuple, ours: tuple) -> bool:
    """Whether ``ours`` (a call's output placements) are eager DTensor's ``eager`` for one of this module's
    losses but for its ``Partial(avg)`` of per-rank means, which this module makes the exact ``Partial(sum)``."""
    return torch_fn in (F.nll_loss, F.cross_entropy) and exact_mean_placements(eager) == tuple(ours)


def _to(x: Any, dtype: Any) -> Any:
    return x if x is None or x.dtype == dtype else dtensor_convert_element_type_prim(x, dtype)


def _class_index_mean_loss(torch_fn: Callable) -> Callable:
    signature = inspect.signature(torch_fn)
    generic = FallbackSymbol(torch_fn)

    def loss(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        target = a["target"]
        if (
            a["reduction"] != "mean"
            or a.get("size_average") is not None
            or a.get("reduce") is not None
            or not isinstance(a["input"], DTensorProxy)
            or not isinstance(target, ti.TensorProxy)
            or ti.dtypes.is_inexact_dtype(target.dtype)  # class probabilities: a mean over the batch
            or not mean_is_per_rank(torch_fn, args, kwargs)
        ):
            return generic(*args, **kwargs)
        total = generic(**{**a, "reduction": "sum"})
        # the count and the division in float32 at least, as torch's kernel accumulates and divides
        compute = ti.dtypes.float64 if total.dtype == ti.dtypes.float64 else ti.dtypes.float32
        minus_ones = dtensor_symbol_of(torch.full_like)(a["input"], -1.0, dtype=ti.dtypes.to_torch_dtype(compute))
        denominator = FallbackSymbol(F.nll_loss)(
            minus_ones, target, _to(a["weight"], compute), ignore_index=a["ignore_index"], reduction="sum"
        )
        return _to(dtensor_div_prim(_to(total, compute), denominator), total.dtype)

    loss.__name__ = f"dtensor_{fallback_name(torch_fn)}_mean"
    return loss


for _loss_fn in (F.nll_loss, F.cross_entropy):
    register_function_for_dtensor(_loss_fn, define_dtensor_symbol(_class_index_mean_loss(_loss_fn)))
