"""The dispatch table: a torch call reaches a dtensor symbol because an argument is a DTensorProxy.

thunder's own tables (its torch-to-thunder map, its Tensor-method table) keep thunder's entries, so a plain
program's calls never see this module. The package installs one interpreter lookaside and one method lookup
(``_integration.route_dtensor_calls``) that ask :func:`function_route` / :func:`method_route` first; a None
answer leaves the call to thunder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.primitive import PRIMS
from thunder_dtensor.proxy import DTensorProxy

__all__ = [
    "DISPATCH_TABLE",
    "METHOD_TABLE",
    "DTensorRoute",
    "call_for_dtensor",
    "register_function_for_dtensor",
    "register_method_for_dtensor",
]


@dataclasses.dataclass(frozen=True)
class DTensorRoute:
    """Where a torch callable (or Tensor method) goes when it is called on DTensors.

    ``always``: a function that exists for DTensors only (``distribute_tensor``, ``DTensor.from_local``, the
    DTensor factories), routed whatever its arguments (they are plain tensors, meshes or sizes).
    """

    dtensor_symbol: Callable
    always: bool = False


#: torch callable -> its route, for every registered function (ops, the generic fallback, in-place ops)
DISPATCH_TABLE: dict[Callable, DTensorRoute] = {}
#: Tensor method name -> its route (``x.mul(y)``, ``x * y``, ``x.float()``)
METHOD_TABLE: dict[str, DTensorRoute] = {}
#: dtensor callables that are not thunder Symbols (the interpreter calls those whole): the method lookup hands
#: them to the interpreter, which must not step into them
_PLAIN_CALLABLES: dict[int, Callable] = {}
#: dtensor symbol id -> the first torch function, in the table's order, whose DTensor calls reach that symbol
#: (autocast asks which torch function a symbol stands for); kept by :func:`_add_entry`
_TORCH_FUNCTION_OF_SYMBOL: dict[Any, Callable] = {}
#: makes the route of a torch function thunder has no symbol for, on its first call on a DTensor
_unknown_function_route: Callable[[Callable], Callable] | None = None


def _holds_dtensor(x: Any, depth: int = 0) -> bool:
    # a proxy, or a DTensor itself: the interpreter hands a lookaside a program input's list as the caller's
    # list of DTensors (its lookaside makes the proxies); in sequences and mappings, a few levels deep
    if isinstance(x, DTensorProxy) or (ti.DISTRIBUTED_AVAILABLE and isinstance(x, ti.DTensor)):
        return True
    if depth > 4:
        return False
    if isinstance(x, list | tuple):
        return any(_holds_dtensor(v, depth + 1) for v in x)
    if isinstance(x, dict):
        return any(_holds_dtensor(v, depth + 1) for v in x.values())
    return False


def has_dtensor_argument(args: Any, kwargs: dict) -> bool:
    """Whether a DTensorProxy is among the arguments (``torch.cat([x, y])``: inside a sequence too)."""
    return _holds_dtensor(args) or _holds_dtensor(kwargs)


def _remember(symbol: Callable) -> None:
    if not isinstance(symbol, ti.Symbol):
        _PLAIN_CALLABLES[id(symbol)] = symbol


def _add_entry(torch_fn: Callable, route: DTensorRoute) -> None:
    replaced = torch_fn in DISPATCH_TABLE
    DISPATCH_TABLE[torch_fn] = route
    if replaced:  # (rare: in-place ops wrap a family's entry) the index again, in the table's order
        _TORCH_FUNCTION_OF_SYMBOL.clear()
        for fn, other in DISPATCH_TABLE.items():
            if isinstance(other.dtensor_symbol, ti.Symbol):
                _TORCH_FUNCTION_OF_SYMBOL.setdefault(other.dtensor_symbol.id, fn)
    elif isinstance(route.dtensor_symbol, ti.Symbol):
        _TORCH_FUNCTION_OF_SYMBOL.setdefault(route.dtensor_symbol.id, torch_fn)
    _remember(route.dtensor_symbol)
    record = PRIMS.get(getattr(route.dtensor_symbol, "name", None))  # type: ignore[arg-type]  # (None: no entry)
    if record is not None:  # a prim the call reaches directly: its record lists the entry
        record.torch_functions.append(torch_fn)


def torch_function_of_symbol(symbol: ti.Symbol) -> Callable | None:
    """The first torch function whose DTensor calls reach ``symbol`` (None: no dispatch entry does)."""
    return _TORCH_FUNCTION_OF_SYMBOL.get(symbol.id)


def dtensor_symbol_of(torch_fn: Callable) -> Callable:
    """The dtensor callable a DTensor call of ``torch_fn`` runs."""
    return DISPATCH_TABLE[torch_fn].dtensor_symbol


def dtensor_callable_for(fn: Any) -> Callable | None:
    """What a call of ``fn`` with DTensor arguments runs (a torch function thunder has no symbol for gets its
    route now), or None: no route."""
    route = DISPATCH_TABLE.get(fn)
    if route is None and _unknown_function_route is not None and ti.is_unknown_torch_function(fn):
        route = DTensorRoute(_unknown_function_route(fn))
        _add_entry(fn, route)
    return None if route is None else route.dtensor_symbol


def call_for_dtensor(torch_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch_fn(*args, **kwargs)`` as a DTensor program calls it (its dtensor symbol), for rules that emit torch
    calls on DTensors themselves (``x.redistribute(...)``, ``torch.empty_like(x)``)."""
    symbol = dtensor_callable_for(torch_fn)
    ti.check(symbol is not None, lambda: f"{torch_fn} has no dtensor route")
    return cast(Callable, symbol)(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# The routes the interpreter asks (``_integration.route_dtensor_calls``)
# ---------------------------------------------------------------------------------------------------------
def may_route(fn: Any) -> bool:
    """A cheap test of every call the interpreter makes (raises ``TypeError`` for an unhashable ``fn``)."""
    return fn in DISPATCH_TABLE or _PLAIN_CALLABLES.get(id(fn)) is fn or ti.is_unknown_torch_function(fn)


def function_route(fn: Any, args: list, kwargs: dict) -> Callable | None:
    """The dtensor callable for this call, or None: thunder's own lookaside serves it."""
    route = DISPATCH_TABLE.get(fn)
    if route is not None:
        return route.dtensor_symbol if route.always or has_dtensor_argument(args, kwargs) else None
    if _PLAIN_CALLABLES.get(id(fn)) is fn:  # a dtensor callable a method lookup returned
        return fn
    if "out" not in kwargs and has_dtensor_argument(args, kwargs):
        return dtensor_callable_for(fn)
    return None


def method_route(name: str, args: tuple, kwargs: dict) -> Callable | None:
    route = METHOD_TABLE.get(name)
    if route is None or not has_dtensor_argument(args, kwargs):
        return None
    return route.dtensor_symbol


def route_unknown_functions(symbol_for: Callable[[Callable], Callable]) -> None:
    """A torch function thunder has no symbol for, first called on a DTensor, gets ``symbol_for(fn)``'s route."""
    global _unknown_function_route
    _unknown_function_route = symbol_for


# ---------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------
def register_function_for_dtensor(
    torch_fn: Callable, dtensor_symbol: Callable, *, is_method: bool = False, always: bool = False
) -> DTensorRoute:
    """Route ``torch_fn`` on DTensors to ``dtensor_symbol``; calls without DTensors stay thunder's.

    With ``is_method=True`` the Tensor method of the same name (``x.mul(y)``, and operators like ``x * y``
    that thunder resolves through its method table) is routed too. ``always``: a function for DTensors only
    (see :class:`DTensorRoute`).
    """
    route = DTensorRoute(dtensor_symbol, always)
    _add_entry(torch_fn, route)
    if is_method:
        method_name = torch_fn.__name__
        torch_method = getattr(__import__("torch").Tensor, method_name, None)
        if torch_method is not None:
            _add_entry(torch_method, route)
        METHOD_TABLE[method_name] = route
    return route


def route_method(method_name: str, route: DTensorRoute) -> None:
    """``x.<method_name>(...)`` on a DTensor takes ``route`` (shared with a torch function's, or its own)."""
    METHOD_TABLE[method_name] = route
    _remember(route.dtensor_symbol)


def register_method_for_dtensor(method_name: str, dtensor_symbol: Callable) -> DTensorRoute:
    """Route a Tensor method (``x.float()``, ``x.type_as(y)``, ``x.to_local()``) on DTensors, and the
    ``torch.Tensor`` (or ``DTensor``) attribute of that name called as a function."""
    import torch

    route = DTensorRoute(dtensor_symbol)
    route_method(method_name, route)
    for owner in (torch.Tensor, ti.DTensor) if ti.DISTRIBUTED_AVAILABLE else (torch.Tensor,):
        torch_method = getattr(owner, method_name, None)
        if torch_method is not None:
            _add_entry(torch_method, route)
            break
    return route
