"""The dispatch table: torch calls on DTensors go to dtensor symbols, all other calls stay thunder's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.primitive import PRIMS
from thunder_dtensor.proxy import DTensorProxy

__all__ = ["DTensorDispatcher", "register_function_for_dtensor", "register_method_for_dtensor"]

#: torch function -> its dispatcher, for every registered function (used by docs and tests).
DISPATCH_TABLE: dict[Callable, DTensorDispatcher] = {}


def _add_entry(torch_fn: Callable, dispatcher: DTensorDispatcher) -> None:
    DISPATCH_TABLE[torch_fn] = dispatcher
    record = PRIMS.get(getattr(dispatcher.dtensor_symbol, "name", None))
    if record is not None:  # a prim the call reaches directly: its record lists the entry
        record.torch_functions.append(torch_fn)


def has_dtensor_argument(args: tuple, kwargs: dict) -> bool:
    flat, _ = ti.tree_flatten((args, kwargs))
    return any(isinstance(a, DTensorProxy) for a in flat)


class DTensorDispatcher:
    """Calls ``dtensor_symbol`` when any argument is a DTensorProxy, ``single_device_symbol`` otherwise.

    It takes the single-device symbol's place in thunder's torch-to-thunder map and method table. Calls
    without DTensors reach exactly the symbol thunder had there.
    """

    def __init__(self, single_device_symbol: Callable, dtensor_symbol: Callable) -> None:
        self.single_device_symbol = single_device_symbol
        self.dtensor_symbol = dtensor_symbol
        self.__name__ = getattr(single_device_symbol, "__name__", "dtensor_dispatch")
        self.__qualname__ = self.__name__
        self.__doc__ = getattr(single_device_symbol, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if has_dtensor_argument(args, kwargs):
            return self.dtensor_symbol(*args, **kwargs)
        return self.single_device_symbol(*args, **kwargs)

    def __repr__(self) -> str:
        return f"DTensorDispatcher({self.__name__} -> {self.dtensor_symbol.name})"


def register_function_for_dtensor(
    torch_fn: Callable,
    single_device_symbol: Callable,
    dtensor_symbol: Callable,
    is_method: bool = False,
) -> DTensorDispatcher:
    """Route ``torch_fn`` on DTensors to ``dtensor_symbol``; plain-tensor calls keep thunder's behaviour.

    With ``is_method=True`` the Tensor method of the same name (``x.mul(y)``, and operators like ``x * y``
    that thunder resolves through the method table) is routed too.
    """
    dispatcher = DTensorDispatcher(single_device_symbol, dtensor_symbol)
    ti.register_torch_function(torch_fn, dispatcher)
    _add_entry(torch_fn, dispatcher)
    if is_method:
        method_name = torch_fn.__name__
        torch_method = getattr(__import__("torch").Tensor, method_name, None)
        if torch_method is not None:
            ti.register_torch_function(torch_method, dispatcher, method_name=method_name)
            _add_entry(torch_method, dispatcher)
    return dispatcher


def register_method_for_dtensor(method_name: str, dtensor_symbol: Callable) -> DTensorDispatcher:
    """Route a Tensor method that has no torch-namespace twin (``x.float()``, ``x.type_as(y)``)."""
    import torch

    single_device = ti.thunder_method(method_name)
    ti.check(single_device is not None, lambda: f"thunder has no Tensor method {method_name!r} to extend")
    dispatcher = DTensorDispatcher(single_device, dtensor_symbol)
    torch_method = getattr(torch.Tensor, method_name)
    ti.register_torch_function(torch_method, dispatcher, method_name=method_name)
    _add_entry(torch_method, dispatcher)
    return dispatcher
