"""Lookasides for torch's tensor-parallel hooks (used by ``thunder_dtensor.tp_hooks``)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor._integration.interpreter_calls import interpretable_copy, read_through_interpreter
from thunder_dtensor._integration.registry import JIT_LOOKASIDES, expects_absent, patch


def tensor_parallel_style_functions() -> dict[str, Callable]:
    """torch's tensor-parallel style functions that its module hooks call, by ``Class.function`` (torch 2.13)."""
    from torch.distributed.tensor.parallel import style

    names = {
        "ColwiseParallel": ("_prepare_input_fn", "_prepare_output_fn"),
        "RowwiseParallel": ("_prepare_input_fn", "_prepare_output_fn"),
        "SequenceParallel": ("_prepare_input_fn", "_prepare_output_fn"),
        "PrepareModuleInput": ("_prepare_input_fn", "_prepare_input_arg"),
        "PrepareModuleOutput": ("_prepare_out_fn",),
    }
    # staticmethods come out of the class dict as plain functions; methods are plain functions there already
    return {f"{cls}.{fn}": getattr(getattr(style, cls), fn) for cls, fns in names.items() for fn in fns}


def register_lookaside(
    fn: Callable,
    lookaside: Callable,
    *,
    applies: Callable[..., bool] | None = None,
    self_attributes: tuple[str, ...] = (),
) -> None:
    """Calls of ``fn`` in jitted code run ``lookaside`` whole, on unwrapped values (proxies), instead.

    ``applies`` (given the same unwrapped arguments) can decline a call: ``fn``'s own code is interpreted then.
    Called inside an installer (it patches thunder's lookaside table).
    ``self_attributes``: ``fn`` is a method whose object can change between calls (a style object a user
    edits); the lookaside gets, in place of that object, a namespace of these attributes read through the
    interpreter, so the prologue checks them as it would had ``fn`` been interpreted.
    """
    from thunder.core import interpreter, jit_ext

    wrapped = jit_ext.interpreter_needs_wrap(lookaside)
    interpreted = interpretable_copy(cast(types.FunctionType, fn))  # (a Python function)

    def run(*args: Any, **kwargs: Any) -> Any:
        if applies is not None:
            unwrapped = {k: interpreter.unwrap(v) for k, v in kwargs.items()}
            if not applies(*(interpreter.unwrap(a) for a in args), **unwrapped):
                return interpreter._interpret_call(interpreted, *args, **kwargs)
        if self_attributes:
            attributes = {}
            for name in self_attributes:
                value = read_through_interpreter(args[0], name)
                if value is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED:
                    return value
                attributes[name] = interpreter.unwrap(value)
            args = (interpreter.wrap_const(types.SimpleNamespace(**attributes)), *args[1:])
        return wrapped(*args, **kwargs)

    lookaside_of_fn = wrapped if applies is None and not self_attributes else run
    patch(jit_ext._general_jit_lookaside_map, fn, lookaside_of_fn, table=JIT_LOOKASIDES, expects=expects_absent)
