"""The generic fallback: any torch op thunder knows runs on DTensors the way eager DTensor runs it.

For every torch function and Tensor method in thunder's tables that no op family claimed, a DTensor call
becomes a prim named after the op (``torch.cumsum`` -> ``dtensor_torch_cumsum_prim``), created on first
use. Its meta is DTensor's sharding propagation on fake DTensors (so an op eager DTensor rejects fails at trace
time, naming the op and the placements), it runs the torch op on the DTensors, and its gradient is
eager DTensor's own backward (:func:`thunder_dtensor.primitive.run_vjp`).

Metadata queries (``x.dim()``, ``x.numel()``) keep thunder's own logic, which only reads the global shape.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import (
    DISPATCH_TABLE,
    METHOD_TABLE,
    DTensorRoute,
    register_function_for_dtensor,
    route_method,
    route_unknown_functions,
)
from thunder_dtensor.ops.no_rule import call_or_rewrite, replicated
from thunder_dtensor.primitive import PRIMS, define_dtensor_prim

import torch

__all__ = ["FallbackSymbol", "fallback_name", "fallback_prim", "register_fallbacks", "FALLBACK_PRIMS"]

#: torch function -> its fallback prim, for the ops that have been used on DTensors so far
FALLBACK_PRIMS: dict[Callable, ti.Symbol] = {}

_METADATA_METHODS = ("dim", "ndimension", "numel", "nelement", "is_floating_point", "is_complex", "element_size")
#: where a torch callable is looked up, in this order, and the prefix its prim name gets
_NAMESPACES: tuple[tuple[Any, str], ...] = (
    (torch, "torch"),
    (torch.Tensor, "Tensor"),
    (torch.nn.functional, "nn_functional"),
    (torch.special, "special"),
    (torch.linalg, "linalg"),
    (torch.fft, "fft"),
)


def fallback_name(torch_fn: Callable) -> str:
    """The prim name of ``torch_fn``: its namespace and name (``torch.sum`` -> ``torch_sum``).

    Derived from the callable alone, so a program's trace reads the same on every rank and in every process,
    whatever ran first; the namespace prefix keeps these names apart from the op families' prims.
    """
    if isinstance(torch_fn, str):  # thunder's map also holds a few ops by name
        return torch_fn.replace(".", "_")
    if hasattr(torch_fn, "prim_name"):
        return torch_fn.prim_name
    name = getattr(torch_fn, "__name__", "op")
    prefix = next((p for namespace, p in _NAMESPACES if getattr(namespace, name, None) is torch_fn), None)
    if prefix is None:
        prefix = (getattr(torch_fn, "__module__", None) or "op").strip("_").replace(".", "_")
    if name.startswith("__") and name.endswith("__"):
        name = "dunder_" + name.strip("_")
    return f"{prefix}_{name}"


#: torch functions whose thunder symbol returns (or may return) a view of its input
VIEW_FUNCTIONS: set[Callable] = set()

#: torch functions whose output carries no gradient by definition: their prims have no grad rule (a generic one
#: would put a kept no-op into a backward that has nothing else, which thunder's split of a joint trace rejects)
NO_GRADIENT_FUNCTIONS: frozenset[Callable] = frozenset({torch.detach, torch.Tensor.detach})


@functools.cache
def one_native_op(torch_fn: Callable) -> Callable:
    """The callable whose prim serves ``torch_fn``: ``torch.<op>`` and ``Tensor.<op>`` that are one ATen op (C
    bindings of one native function, every overload of which takes ``self`` first, so that ``torch.op(x, ...)``
    is ``x.op(...)``, and one symbol in thunder's tables) share the method's prim; anything else keeps its own.
    """
    name = getattr(torch_fn, "__name__", None)
    if not isinstance(name, str) or getattr(torch, name, None) is not torch_fn:
        return torch_fn
    method = getattr(torch.Tensor, name, None)
    if type(method).__name__ != "method_descriptor" or type(torch_fn).__name__ != "builtin_function_or_method":
        return torch_fn
    table = ti.torch_to_thunder_map()
    if torch_fn not in table or method not in table:
        return torch_fn
    if ti.thunder_symbol_of(table[torch_fn]) is not ti.thunder_symbol_of(table[method]):
        return torch_fn
    packet = getattr(torch.ops.aten, name, None)
    overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    if not overloads or any(not o._schema.arguments or o._schema.arguments[0].name != "self" for o in overloads):
        return torch_fn  # (torch.where(condition, x, y) is x.where(condition, y): not the same call)
    return cast(Callable, method)


def fallback_prim(torch_fn: Callable) -> ti.Symbol:
    """The dtensor prim for ``torch_fn``, made on first use: one per ATen op (:func:`one_native_op`).

    The prim of a view op is a view op for thunder's alias pass too: an in-place write into a view of a
    DTensor (``y[:, :1].mul_(0.5)``) then updates the viewed DTensor's later reads, as for plain tensors.
    """
    prim = FALLBACK_PRIMS.get(torch_fn)
    if prim is None:
        op = one_native_op(torch_fn)
        prim = FALLBACK_PRIMS.get(op)
        if prim is None:
            prim = FALLBACK_PRIMS[op] = define_dtensor_prim(
                fallback_name(op), op, differentiable=op not in NO_GRADIENT_FUNCTIONS
            )
            PRIMS[prim.name].shape_checked = True
            if op in VIEW_FUNCTIONS or torch_fn in VIEW_FUNCTIONS:
                ti.mark_may_return_views(prim)
        FALLBACK_PRIMS[torch_fn] = prim
        record = PRIMS[prim.name]
        for fn in (op, torch_fn):
            if fn not in record.torch_functions:
                record.torch_functions.append(fn)
    return prim


class FallbackSymbol:
    """Calls the fallback prim of one torch function (created lazily, so unused ops cost nothing)."""

    def __init__(self, torch_fn: Callable) -> None:
        self.torch_fn = torch_fn
        self.name = f"dtensor_{fallback_name(torch_fn)}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        op = one_native_op(self.torch_fn)
        if op is not self.torch_fn and not args and "input" in kwargs:  # torch.op(input=x): the method's self
            args, kwargs = (kwargs["input"],), {k: v for k, v in kwargs.items() if k != "input"}
        # where DTensor has no sharding rule: the op decomposed, else on replicated inputs (ops/no_rule.py)
        return call_or_rewrite(
            fallback_prim(op),
            fallback_name(op),
            op,
            args,
            kwargs,
            replicated_source=replicated(op),
            differentiable=True,
        )


def _is_in_place(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def _torch_callable_for_method(name: str) -> Callable | None:
    # the Tensor method itself: its signature can differ from torch.<name> (x.reshape(2, 3), x.view(-1))
    if name == "getitem":
        return operator.getitem
    attribute = getattr(torch.Tensor, name, None)
    if attribute is None or callable(attribute):
        return attribute
    return _property_getter(name)  # x.mT, x.real: a property, read as a one-argument function


@functools.cache
def _property_getter(name: str) -> Callable:
    def get(tensor: torch.Tensor) -> Any:
        return getattr(tensor, name)

    get.__name__ = get.__qualname__ = name
    get.prim_name = f"Tensor_{name}"  # type: ignore[attr-defined]
    return get


def _is_ours(fn: Any) -> bool:
    return str(getattr(fn, "id", "")).startswith("thunder_dtensor.")


def register_fallbacks() -> int:
    """A route for every torch function and Tensor method of thunder's tables that no op family claimed;
    returns how many. A torch function thunder does not know gets its route when first called on a DTensor."""
    route_unknown_functions(FallbackSymbol)
    count = 0
    torch_fn: Callable | None  # (None below: a method without a torch function)
    for torch_fn, entry in list(ti.torch_to_thunder_map().items()):
        name = getattr(torch_fn, "__name__", "")
        single = ti.thunder_symbol_of(entry)
        if torch_fn in DISPATCH_TABLE or single is None or _is_ours(single) or _is_in_place(name):
            continue
        if ti.may_return_views(single):
            VIEW_FUNCTIONS.add(torch_fn)
        if name in _METADATA_METHODS and isinstance(single, ti.Symbol):
            dtensor_symbol: Any = ti.accept_dtensor_proxies(single)
        else:
            dtensor_symbol = FallbackSymbol(torch_fn)
        register_function_for_dtensor(torch_fn, dtensor_symbol)
        count += 1

    for method_name, entry in list(ti.thunder_methods().items()):
        single = ti.thunder_symbol_of(entry)
        if method_name in METHOD_TABLE or single is None or _is_ours(single) or _is_in_place(method_name):
            continue
        torch_fn = _torch_callable_for_method(method_name)
        if torch_fn is None:
            continue
        if ti.may_return_views(single):
            VIEW_FUNCTIONS.add(torch_fn)
        existing = DISPATCH_TABLE.get(torch_fn)
        if existing is not None:
            route_method(method_name, existing)
        elif method_name in _METADATA_METHODS and isinstance(single, ti.Symbol):
            route_method(method_name, DTensorRoute(ti.accept_dtensor_proxies(single)))
        else:
            route_method(method_name, DTensorRoute(FallbackSymbol(torch_fn)))
        count += 1
    return count
