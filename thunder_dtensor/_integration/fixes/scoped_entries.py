"""Lookasides and Tensor methods that exist only where a fix is active: thunder's own tables are not changed.

A fix that gives the interpreter a lookaside for a callable thunder has none for (or a Tensor method thunder
maps otherwise) registers it here with its name; thunder's lookup is asked first by :func:`consult_scoped_entries`
only for those callables, and only while the fix is active. Elsewhere the call is traced exactly as thunder
traces it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thunder_dtensor._integration.fixes.switches import active
from thunder_dtensor._integration.registry import expects_function, installer, patch

#: callable -> (fix, the lookaside thunder's jit lookup returns for it while the fix is active)
SCOPED_LOOKASIDES: dict[Any, tuple[str, Callable]] = {}
#: Tensor method name -> (fix, the symbol the torch language context returns for it while the fix is active)
SCOPED_METHODS: dict[str, tuple[str, Callable]] = {}


def add_scoped_lookaside(fix: str, fn: Any, lookaside: Callable) -> None:
    """While ``fix`` is active, the interpreter calls ``lookaside`` (thunder's jit-lookaside convention: wrapped
    values) for ``fn``."""
    SCOPED_LOOKASIDES[fn] = (fix, lookaside)


def add_scoped_method(fix: str, name: str, symbol: Callable) -> None:
    SCOPED_METHODS[name] = (fix, symbol)


@installer("dtensor", "thunder's jit lookup and Tensor-method lookup first ask the fixes that are active")
def consult_scoped_entries() -> None:
    from thunder.core import jit_ext
    from thunder.torch.langctx import TorchCtx

    original_lookaside = jit_ext.general_jit_lookaside

    def lookaside(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            entry = SCOPED_LOOKASIDES.get(fn)
        except TypeError:  # unhashable
            entry = None
        if entry is not None and active(entry[0]):
            return entry[1]
        return original_lookaside(fn, *args, **kwargs)

    expects = expects_function(("thunder.core.jit_ext", "thunder_dtensor"), "fn")  # thunder's, or a fix over it
    patch(jit_ext, "general_jit_lookaside", lookaside, expects=expects)

    original_get_method = TorchCtx.get_method

    def get_method(self: Any, id: str, *args: Any, **kwargs: Any) -> Callable:
        entry = SCOPED_METHODS.get(id)
        if entry is not None and active(entry[0]):
            return entry[1]
        return original_get_method(self, id, *args, **kwargs)

    patch(TorchCtx, "get_method", get_method, expects=expects_function("thunder.torch.langctx", "self", "id"))
