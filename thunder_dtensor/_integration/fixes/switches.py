"""One switch per fix: where each fix to thunder (and each speed-up) acts.

Every fix has a mode: ``"dtensor-programs"`` (the default: it acts while a DTensor program is compiled, see
:mod:`thunder_dtensor._integration.program_scope`), ``"everywhere"`` (every program in the process) or ``"off"``.
Each patched slot asks :func:`active` and otherwise behaves exactly as thunder's own code.

Modes are set for the process (:func:`enable`, :func:`disable`) or within a block (:func:`enabled`,
:func:`disabled`, for tests). The environment gives the defaults, read at import: ``THUNDER_DTENSOR_FIXES_
EVERYWHERE`` and ``THUNDER_DTENSOR_FIXES_OFF`` (comma-separated names, or ``all``); a kind switched off whole
(``THUNDER_DTENSOR_THUNDER_FIXES=0``, ``THUNDER_DTENSOR_SPEEDUPS=0``) is not even installed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

from thunder_dtensor._integration.program_scope import holds_dtensors, in_dtensor_program

IN_DTENSOR_PROGRAMS, EVERYWHERE, OFF = "dtensor-programs", "everywhere", "off"
MODES = (IN_DTENSOR_PROGRAMS, EVERYWHERE, OFF)
EVERYWHERE_VARIABLE = "THUNDER_DTENSOR_FIXES_EVERYWHERE"
OFF_VARIABLE = "THUNDER_DTENSOR_FIXES_OFF"


@dataclasses.dataclass(frozen=True)
class Fix:
    name: str
    kind: str  # "thunder-fix", "speedup", or "dtensor" (a DTensor-program patch that would act on plain ones)
    reason: str


#: every switchable fix, by name (the installer's function name)
FIXES: dict[str, Fix] = {}
_MODES: dict[str, str] = {}  # the process's modes (absent: the default)
_BLOCK: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("thunder_dtensor_fixes", default=None)


def _names_in(variable: str) -> set[str]:
    return {n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()}


def declare_fix(name: str, kind: str, reason: str) -> None:
    """Make ``name`` a switchable fix; its default mode comes from the environment."""
    FIXES[name] = Fix(name, kind, reason)
    if {name, "all"} & _names_in(OFF_VARIABLE) and kind != "dtensor":
        _MODES[name] = OFF
    elif {name, "all"} & _names_in(EVERYWHERE_VARIABLE):
        _MODES[name] = EVERYWHERE


def mode(name: str) -> str:
    block = _BLOCK.get()
    chosen = block.get(name) if block is not None else None
    return chosen or _MODES.get(name, IN_DTENSOR_PROGRAMS)


def active(name: str, *touched: Any) -> bool:
    """Whether fix ``name`` acts here (asked by the patched slots, while thunder compiles). ``touched``: values the
    slot is handed (a module whose parameters a program reads through a closure makes a DTensor program too)."""
    chosen = mode(name)
    if chosen == EVERYWHERE:
        return True
    if chosen == OFF:
        return False
    return in_dtensor_program() or (bool(touched) and holds_dtensors(touched))


def _resolve(names: tuple[str, ...]) -> list[str]:
    resolved = sorted(FIXES) if "all" in names else list(names)
    unknown = [n for n in resolved if n not in FIXES]
    if unknown:
        raise ValueError(f"unknown fixes {unknown}; thunder_dtensor.fixes.FIXES lists {sorted(FIXES)}")
    return resolved


def enable(*names: str, everywhere: bool = False) -> None:
    """For this process: the fixes ``names`` (or ``"all"``) act in DTensor programs, or with ``everywhere`` in
    every program."""
    for name in _resolve(names):
        _MODES[name] = EVERYWHERE if everywhere else IN_DTENSOR_PROGRAMS


def _switchable_off(names: tuple[str, ...]) -> list[str]:
    resolved = _resolve(names)
    if "all" in names:
        return [n for n in resolved if FIXES[n].kind != "dtensor"]
    needed = [n for n in resolved if FIXES[n].kind == "dtensor"]
    if needed:
        raise ValueError(f"{needed} are needed by DTensor programs: they can act everywhere, not nowhere")
    return resolved


def disable(*names: str) -> None:
    """For this process: the fixes ``names`` (or ``"all"``) act nowhere (thunder's own behaviour)."""
    for name in _switchable_off(names):
        _MODES[name] = OFF


@contextlib.contextmanager
def _block(names: tuple[str, ...], chosen: str) -> Iterator[None]:
    resolved = _resolve(names)
    token = _BLOCK.set({**(_BLOCK.get() or {}), **dict.fromkeys(resolved, chosen)})
    try:
        yield
    finally:
        _BLOCK.reset(token)


def enabled(*names: str, everywhere: bool = False) -> contextlib.AbstractContextManager[None]:
    """Within the block: as :func:`enable`."""
    return _block(names, EVERYWHERE if everywhere else IN_DTENSOR_PROGRAMS)


def disabled(*names: str) -> contextlib.AbstractContextManager[None]:
    """Within the block: as :func:`disable`."""
    return _block(tuple(_switchable_off(names)), OFF)


def fixes_everywhere(*names: str) -> contextlib.AbstractContextManager[None]:
    """Within the block, the fixes ``names`` (``"all"``) act on every program: ``enabled(*names, everywhere=True)``."""
    return enabled(*names, everywhere=True)


def listing() -> dict[str, tuple[str, str, str]]:
    """Each fix's kind, current mode and reason."""
    return {name: (fix.kind, mode(name), fix.reason) for name, fix in sorted(FIXES.items())}


def switched(name: str, fixed: Callable, original: Callable) -> Callable:
    """``fixed`` where fix ``name`` is active, else ``original`` (what the patched slot held)."""

    @functools.wraps(fixed)
    def call(*args: Any, **kwargs: Any) -> Any:
        return (fixed if active(name) else original)(*args, **kwargs)

    return call
