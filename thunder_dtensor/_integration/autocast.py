"""Autocast around DTensor programs (thunder 0.2.6 layout; used by autocast.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from thunder_dtensor._integration.bootstrap import Symbol, dtypes
from thunder_dtensor._integration.registry import expects_function, installer, patch

import torch


# ---------------------------------------------------------------------------------------------------------
# Autocast (thunder 0.2.6 layout; used by autocast.py)
#
# thunder 0.2.6 applies ``torch.autocast`` while it traces: every ``Symbol.__call__`` first asks
# ``thunder.transforms.autocast.maybe_apply_autocast(sym)`` for a replacement, which applies rules keyed by
# symbol id (linear, matmul, conv, SDPA) while the compile data's autocast stack is active. That stack is
# pushed for an autocast the jitted function is *called* under (``thunder.jit``'s cache-info step, never
# popped) and by ``torch.autocast.__enter__`` *inside* it (interpreter lookaside). The traces then run
# under ``no_autocast``, so every cast must be explicit in the trace. Private torch name used here:
# ``torch.utils._python_dispatch.TorchDispatchMode`` (to see which casts torch's autocast inserts).
# ---------------------------------------------------------------------------------------------------------
@installer("dtensor", "torch.autocast around DTensor programs: its casts become dtensor prims in the trace")
def install_autocast_hook(replacement_for: Callable[[Symbol], Callable | None]) -> None:
    """Let ``replacement_for(sym)`` replace a symbol's call first; thunder's own autocast rules otherwise.

    Rebinds ``thunder.transforms.autocast.maybe_apply_autocast``, which ``Symbol.__call__`` imports at
    each call.
    """
    import thunder.transforms.autocast as thunder_autocast

    thunder_hook = thunder_autocast.maybe_apply_autocast

    def maybe_apply_autocast(sym: Symbol) -> Callable | None:
        replacement = replacement_for(sym)
        return replacement if replacement is not None else thunder_hook(sym)

    patch(
        thunder_autocast,
        "maybe_apply_autocast",
        maybe_apply_autocast,
        expects=expects_function("thunder.transforms.autocast", "sym"),
    )


def thunder_autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype thunder's autocast applies to ops on ``device_type`` now, or None (none active, or disabled).

    None also inside an autocast rule (thunder's ``disable_autocast``), where the ops a rule calls are not
    cast again.
    """
    import thunder.transforms.autocast as thunder_autocast
    from thunder.core.compile_data import get_compile_data

    cd = get_compile_data()
    if cd is None or cd.autocast_stack.is_empty() or not thunder_autocast.is_autocast_enabled():
        return None
    dtype = cd.autocast_stack.get_dtype_for_device_if_enabled(device_type)
    return None if dtype is None else dtypes.to_torch_dtype(dtypes.to_dtype(dtype))


def thunder_autocast_disabled() -> contextlib.AbstractContextManager:
    """thunder's own switch: symbols called meanwhile get no autocast rule (those a rule calls, say)."""
    import thunder.transforms.autocast as thunder_autocast

    return thunder_autocast.disable_autocast()


def interpreting_user_program() -> bool:
    """Whether thunder's interpreter is tracing the user's program now (not autodiff or a later transform).

    An autocast applies to the ops the program calls; the backward thunder's autodiff builds afterwards
    follows the forward's dtypes, as eager autograd does, even though the autocast stack stays pushed.
    """
    from thunder.core import interpreter

    return interpreter.get_interpretercompilectx_if_available() is not None


@contextlib.contextmanager
def recording_aten_calls() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Record ``(aten op, args, kwargs)`` of every op dispatched meanwhile (below autocast: its casts show)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[Any, tuple, dict]] = []

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            calls.append((func, args, kwargs))
            return func(*args, **kwargs)

    with _Recorder():
        yield calls
