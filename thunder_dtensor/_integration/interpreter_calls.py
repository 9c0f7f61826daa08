"""Calling into thunder's interpreter from a lookaside (thunder 0.2.6): what the package's TP lookasides and the
interpreter speed-ups share."""

from __future__ import annotations

import types
from typing import Any


def read_through_interpreter(obj: Any, name: str) -> Any:
    """``obj.name`` read by the interpreter (``obj`` wrapped), so the prologue checks what was read."""
    from thunder.core import interpreter

    return interpreter._interpret_call(getattr, obj, interpreter.wrap_const(name))


def interpretable_copy(fn: types.FunctionType) -> types.FunctionType:
    """The same function under another identity: interpreting it interprets ``fn``'s code, which a lookaside on
    ``fn`` itself would prevent."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy
