"""The generic fallback: any torch op thunder knows runs on DTensors the way eager DTensor runs it.

For every torch function and Tensor method in thunder's tables that no op family claimed, a DTensor call
becomes a prim named after the op (``torch.cumsum`` -> ``dtensor_cumsum_prim``), created on first use. Its
meta is DTensor's sharding propagation on fake DTensors (so an op eager DTensor rejects fails at trace
time, naming the op and the placements), it runs the torch op on the DTensors, and its gradient is
eager DTensor's own backward (:func:`thunder_dtensor.primitive.run_vjp`).

Metadata queries (``x.dim()``, ``x.numel()``) keep thunder's own logic, which only reads the global shape.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import DISPATCH_TABLE, DTensorDispatcher
from thunder_dtensor.primitive import DTENSOR_PRIMS, define_dtensor_prim

import torch

__all__ = ["fallback_prim", "register_fallbacks", "FALLBACK_PRIMS"]

#: torch function -> its fallback prim, for the ops that have been used on DTensors so far
FALLBACK_PRIMS: dict[Callable, ti.Symbol] = {}

_METADATA_METHODS = ("dim", "ndimension", "numel", "nelement", "is_floating_point", "is_complex", "element_size")
_NAMESPACE_PREFIXES = {
    torch: "",
    torch.Tensor: "method_",
    torch.nn.functional: "functional_",
    torch.special: "special_",
}


def _fallback_name(torch_fn: Callable) -> str:
    name = getattr(torch_fn, "__name__", "op").strip("_")
    for namespace, prefix in _NAMESPACE_PREFIXES.items():
        if getattr(namespace, getattr(torch_fn, "__name__", ""), None) is torch_fn:
            return prefix + name
    return "op_" + name


def fallback_prim(torch_fn: Callable) -> ti.Symbol:
    """The dtensor prim for ``torch_fn``, made on first use (one per torch function)."""
    prim = FALLBACK_PRIMS.get(torch_fn)
    if prim is None:
        name = _fallback_name(torch_fn)
        base, suffix = name, 2
        while f"dtensor_{name}_prim" in DTENSOR_PRIMS:
            name, suffix = f"{base}_{suffix}", suffix + 1
        prim = FALLBACK_PRIMS[torch_fn] = define_dtensor_prim(name, torch_fn)
    return prim


class _FallbackSymbol:
    """Calls the fallback prim of one torch function (created lazily, so unused ops cost nothing)."""

    def __init__(self, torch_fn: Callable) -> None:
        self.torch_fn = torch_fn
        self.name = f"dtensor_{_fallback_name(torch_fn)}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return fallback_prim(self.torch_fn)(*args, **kwargs)


def _is_in_place(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def _torch_callable_for_method(name: str) -> Callable | None:
    # the Tensor method itself: its signature can differ from torch.<name> (x.reshape(2, 3), x.view(-1))
    if name == "getitem":
        return operator.getitem
    return getattr(torch.Tensor, name, None)


def _is_ours(fn: Any) -> bool:
    return isinstance(fn, DTensorDispatcher) or str(getattr(fn, "id", "")).startswith("thunder_dtensor.")


def register_fallbacks() -> int:
    """Wrap every unclaimed entry of thunder's tables; returns how many were wrapped."""
    count = 0
    for torch_fn, single in list(ti.torch_to_thunder_map().items()):
        name = getattr(torch_fn, "__name__", "")
        if torch_fn in DISPATCH_TABLE or _is_ours(single) or _is_in_place(name):
            continue
        if name in _METADATA_METHODS and isinstance(single, ti.Symbol):
            dtensor_symbol: Any = ti.accept_dtensor_proxies(single)
        else:
            dtensor_symbol = _FallbackSymbol(torch_fn)
        dispatcher = DTensorDispatcher(single, dtensor_symbol)
        ti.register_torch_function(torch_fn, dispatcher)
        DISPATCH_TABLE[torch_fn] = dispatcher
        count += 1

    for method_name, single in list(ti.thunder_methods().items()):
        if _is_ours(single) or _is_in_place(method_name):
            continue
        torch_fn = _torch_callable_for_method(method_name)
        if torch_fn is None:
            continue
        existing = DISPATCH_TABLE.get(torch_fn)
        if existing is not None:
            dispatcher = DTensorDispatcher(single, existing.dtensor_symbol)
        elif method_name in _METADATA_METHODS and isinstance(single, ti.Symbol):
            dispatcher = DTensorDispatcher(single, ti.accept_dtensor_proxies(single))
        else:
            dispatcher = DTensorDispatcher(single, _FallbackSymbol(torch_fn))
        ti.register_method(method_name, dispatcher)
        count += 1
    return count
