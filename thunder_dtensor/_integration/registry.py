"""The one way this package changes a slot of thunder or torch: recorded, checked against what it replaces, undoable.

An *installer* is a function decorated with :func:`installer`; inside it, each :func:`patch` replaces one slot
(a module or class attribute, or a key of one of thunder's tables) and records, with the installer as owner,
the slot, its kind (``dtensor``: needed for DTensor programs; ``thunder-fix``: a fix to thunder that is not
about DTensors; ``speedup``: interpreter speed-ups), a one-line reason, and what was there before. Each patch
states what it expects to replace (:func:`expects_function`, :func:`expects_absent`, ...): when thunder or
torch changed that slot, installing fails loudly here, naming the slot, instead of patching something else
silently.

An installer runs once per process (its qualified name is its key; a second call with the same arguments returns
at once, one with other arguments raises); ``thunder-fix`` and ``speedup`` installers do nothing when their
environment switch is ``0`` (:data:`PATCH_SWITCHES`); each of them is also a switchable fix
(:mod:`thunder_dtensor._integration.fixes.switches`) that acts within DTensor programs unless chosen otherwise.
:func:`installed` lists what is patched; :func:`undo` puts an installer's slots back, all or none (tests, and
a failed installer's partial work); :func:`undo_all` every
installer's, latest first.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import os
import types
from collections.abc import Callable, Iterable
from typing import Any

#: the kinds of patches; docs/architecture.md lists the non-``dtensor`` ones with their plain-thunder reproducers
PATCH_KINDS = ("dtensor", "thunder-fix", "speedup")

#: the patches to thunder that are not about DTensors, by kind, and the environment variable that turns a kind
#: off ("0"); docs/architecture.md, "Thunder fixes that are not about DTensors", lists each with its reproducer
PATCH_SWITCHES = {"thunder-fix": "THUNDER_DTENSOR_THUNDER_FIXES", "speedup": "THUNDER_DTENSOR_SPEEDUPS"}


def patch_kind_enabled(kind: str) -> bool:
    """Whether the patches of ``kind`` are installed in this process (``dtensor`` ones always are)."""
    switch = PATCH_SWITCHES.get(kind)
    return switch is None or os.environ.get(switch, "1") != "0"


#: names of thunder's tables that patches replace entries of (``patch(..., table=...)``)
JIT_LOOKASIDES = "thunder.core.jit_ext._general_jit_lookaside_map"
INTERPRETER_LOOKASIDES = "thunder.core.interpreter._default_lookaside_map"
PROVENANCE_LOOKASIDES = "thunder.core.interpreter._default_provenance_tracking_lookaside_map"
OPCODE_HANDLERS = "thunder.core.interpreter._default_opcode_handler_map"
GRAD_RULES = "thunder.core.transforms._grad_fn_map"
BACKWARD_IMPLS = "thunder.core.transforms.backward_impls"
TENSOR_METHODS = "thunder.torch.langctx._method_name_to_fn_map"
EXECUTORS = "thunder.extend._executor_map"


class IntegrationError(RuntimeError):
    """thunder or torch is not laid out as this package expects: update ``thunder_dtensor/_integration``."""


_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced slot."""

    owner: str  # the installer
    kind: str
    reason: str
    target: Any  # the module, class or table holding the slot
    slot: Any  # an attribute name, or a table key
    in_table: bool
    table_name: str  # the table's name, for listings ("" for attributes)
    frozen: bool  # set with object.__setattr__ (a frozen dataclass's field: a thunder Symbol's meta)
    original: Any  # what was there (``_ABSENT``: nothing)
    replacement: Any
    during: str = ""  # a scoped entry: in the table only while this runs (else always in place)

    @property
    def where(self) -> str:
        holder = self.table_name or _qualified_name(self.target)
        slot = self.slot if isinstance(self.slot, str) else None
        slot = (
            slot or getattr(self.slot, "__qualname__", None) or getattr(self.slot, "__name__", None) or repr(self.slot)
        )
        return f"{holder}[{slot}]" if self.in_table else f"{holder}.{slot}"

    def __str__(self) -> str:
        during = f", only during {self.during}" if self.during else ""
        return f"{self.where} ({self.kind}, {self.owner}{during}): {self.reason}"


@dataclasses.dataclass(frozen=True)
class _Installer:
    name: str
    kind: str
    reason: str
    arguments: tuple = ()  # what the run that installed it was called with (ids of the objects, in order)


_PATCHES: list[Patch] = []
_DONE: dict[str, _Installer] = {}  # installers that ran to the end, by name
_CURRENT: contextvars.ContextVar[_Installer | None] = contextvars.ContextVar("thunder_dtensor_installer", default=None)


def installer(kind: str, reason: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Make ``fn`` an installer of patches of ``kind``: it runs once per process (keyed by its name), not at
    all when its kind is switched off, and a failure undoes what it had patched."""
    if kind not in PATCH_KINDS:
        raise ValueError(f"unknown patch kind {kind!r}")

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        name = (
            f"{fn.__module__}.{fn.__qualname__}".removeprefix("thunder_dtensor.")
            .removeprefix("_integration.")
            .removeprefix("fixes.")
        )
        record = _Installer(name, kind, reason)

        @functools.wraps(fn)
        def install(*args: Any, **kwargs: Any) -> None:
            arguments = _identities(args, kwargs)
            done = _DONE.get(record.name)
            if done is not None:
                if done.arguments != arguments:
                    raise IntegrationError(
                        f"{record.name} is installed already, with other arguments: undo({record.name!r}) first"
                    )
                return
            if not patch_kind_enabled(kind):
                return
            run = dataclasses.replace(record, arguments=arguments)
            token = _CURRENT.set(run)
            try:
                fn(*args, **kwargs)
            except BaseException:
                undo(record.name)
                raise
            finally:
                _CURRENT.reset(token)
            _DONE[record.name] = run

        install.patch_kind = kind  # type: ignore[attr-defined]
        if kind != "dtensor":  # a fix to thunder or a speed-up: switchable, by its function's name
            from thunder_dtensor._integration.fixes.switches import declare_fix

            declare_fix(fn.__name__, kind, reason)
        return install

    return decorate


def _identities(args: tuple, kwargs: dict) -> tuple:
    """What an installer was called with, by identity (its arguments are functions and classes)."""
    return tuple(id(a) for a in args) + tuple((k, id(v)) for k, v in sorted(kwargs.items()))


def declared_versions() -> str:
    """The releases the package declares (pyproject.toml), for error messages."""
    from thunder_dtensor._integration.bootstrap import THUNDER_TESTED_NIGHTLY, THUNDER_TESTED_RANGE, TORCH_TESTED_RANGE

    low, high = TORCH_TESTED_RANGE
    thunders = f"{THUNDER_TESTED_RANGE[0]} (and the nightly {THUNDER_TESTED_NIGHTLY})"
    return f"lightning-thunder {thunders} and torch {low} to {high} (excluded)"


def patch(
    target: Any,
    slot: Any,
    replacement: Any,
    *,
    expects: Callable[[Any], str | None],
    reason: str | None = None,
    kind: str | None = None,
    table: str | None = None,
    frozen: bool = False,
) -> Any:
    """Replace ``target.slot`` (``target[slot]`` when ``table`` names the mapping ``target``) by ``replacement``;
    returns what was there.

    ``expects(original)`` returns None when the slot holds what this patch was written against, else what it
    expected (see the ``expects_*`` helpers): then :class:`IntegrationError` is raised and nothing is changed.
    ``reason`` and ``kind`` default to the installer's; ``frozen``: the target is a frozen dataclass. What was
    there is returned as reading it gives it (a bound method, an inherited attribute); undoing puts back what the
    target itself held.
    """
    current = _CURRENT.get()
    if current is None:
        raise RuntimeError("patch() is called inside an @installer function only")
    original = target.get(slot, _ABSENT) if table else _own_attribute(target, slot)
    record = Patch(
        current.name,
        kind or current.kind,
        reason or current.reason,
        target,
        slot,
        table is not None,
        table or "",
        frozen,
        original,
        None,
    )
    seen = target.get(slot, _ABSENT) if table else getattr(target, slot, _ABSENT)  # what a caller would call
    problem = expects(seen)
    if problem is not None:
        raise IntegrationError(
            f"{record.where}: expected {problem}, found {_describe(seen)}; thunder_dtensor's {current.name} was "
            f"written for {declared_versions()}: update thunder_dtensor/_integration for this release"
        )
    _set(record, replacement)
    _PATCHES.append(dataclasses.replace(record, replacement=replacement))
    return None if seen is _ABSENT else seen


def add_entry(
    table: Any, key: Any, value: Any, *, table_name: str, owner: str, reason: str, kind: str = "dtensor"
) -> None:
    """A new entry, keyed by something of this package's (a dtensor prim's id), of one of thunder's tables,
    made after import (prims are made on first use): recorded under ``owner`` as a patch, so :func:`installed`
    lists it and undoing ``owner`` (or :func:`undo_all`) removes it. The key is absent from the table, or an
    entry ``owner`` made (a prim's generic grad rule replaced by its own)."""
    mine = next((p for p in _PATCHES if p.target is table and p.in_table and p.slot == key), None)
    if mine is None and key in table:
        raise IntegrationError(f"{table_name}[{key!r}]: expected no entry, found {_describe(table[key])}")
    if mine is not None and mine.owner != owner:
        raise IntegrationError(f"{table_name}[{key!r}] belongs to {mine.owner}, not {owner}")
    record = Patch(owner, kind, reason, table, key, True, table_name, False, _ABSENT, value)
    table[key] = value
    if mine is None:
        _PATCHES.append(record)
    else:
        _PATCHES[_PATCHES.index(mine)] = record
    _DONE.setdefault(owner, _Installer(owner, kind, reason))


class ScopedEntries:
    """Entries of a table that are in it only inside ``with entries:`` (see :func:`scoped_entries`)."""

    def __init__(self, records: list[Patch]) -> None:
        self._records = records
        self._added: list[list[Patch]] = []

    def __enter__(self) -> ScopedEntries:
        """Put in each entry whose key is absent (one the owner of the table made in the meantime stays)."""
        added = [p for p in self._records if p.slot not in p.target]
        for p in added:
            _set(p, p.replacement)
        self._added.append(added)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._added.pop():
            if _current(p) is p.replacement:
                _set(p, _ABSENT)


def scoped_entries(table: Any, entries: dict[Any, Any], *, table_name: str, during: str) -> ScopedEntries:
    """Entries of ``table`` (one of torch's or thunder's) put in only while a ``with`` block of the returned
    value runs (``during`` says when, for listings), and taken out after it: recorded under the current
    installer, so :func:`installed` lists them and undoing the installer (or :func:`undo_all`) removes them
    wherever a call left them. Each key is absent from the table now."""
    current = _CURRENT.get()
    if current is None:
        raise RuntimeError("scoped_entries() is called inside an @installer function only")
    records = []
    for key, value in entries.items():
        if key in table:
            raise IntegrationError(f"{table_name}[{key!r}]: expected no entry, found {_describe(table[key])}")
        record = Patch(current.name, current.kind, current.reason, table, key, True, table_name, False, _ABSENT, value)
        records.append(dataclasses.replace(record, during=during))
    _PATCHES.extend(records)
    return ScopedEntries(records)


def add_executor(executor: Any, *, always: bool = False) -> None:
    """Register ``executor`` with thunder (``get_executor(name)``), and with ``always`` among its always executors
    (every program's), as patches: undoing them takes it out again."""
    import thunder.extend as extend

    patch(extend._executor_map, executor.name, executor, table=EXECUTORS, expects=expects_absent)
    if always:
        always_executors = [*extend._always_executors, executor]
        patch(extend, "_always_executors", always_executors, expects=expects_instance(list))


def _set(p: Patch, value: Any) -> None:
    if value is _ABSENT:
        if p.in_table:
            del p.target[p.slot]
        else:
            delattr(p.target, p.slot)
    elif p.in_table:
        p.target[p.slot] = value
    elif p.frozen:
        object.__setattr__(p.target, p.slot, value)
    else:
        setattr(p.target, p.slot, value)


def installed(kind: str | None = None) -> list[Patch]:
    """The patches in place, in installation order (of ``kind`` only, when given)."""
    return [p for p in _PATCHES if kind is None or p.kind == kind]


def installers() -> dict[str, str]:
    """The installers that ran, by name, with their kind."""
    return {name: record.kind for name, record in _DONE.items()}


def _own_attribute(target: Any, slot: str) -> Any:
    """What ``target`` itself holds under ``slot`` (a classmethod object, not the bound method ``getattr``
    makes; ``_ABSENT`` for an inherited attribute, so that undoing deletes ours and the base's shows again)."""
    try:
        return vars(target).get(slot, _ABSENT)
    except TypeError:  # no __dict__
        return getattr(target, slot, _ABSENT)


def _current(p: Patch) -> Any:
    return p.target.get(p.slot, _ABSENT) if p.in_table else _own_attribute(p.target, p.slot)


def _moved(p: Patch) -> bool:
    """``p``'s slot holds something else than ``p`` put there (a scoped entry may also be out of its table)."""
    current = _current(p)
    return current is not p.replacement and not (p.during and current is _ABSENT)


def undo(owner: str) -> None:
    """Put back every slot ``owner`` patched (in reverse order), so that calling it again installs afresh.

    All or nothing: when a slot holds something else than ``owner`` put there (a later installer wrapped it),
    :class:`IntegrationError` names it and nothing is restored (undo that installer first, or :func:`undo_all`).
    """
    mine = [p for p in _PATCHES if p.owner == owner]
    moved = [p.where for p in mine if _moved(p)]
    if moved:
        later = sorted({q.owner for q in _PATCHES if q.owner != owner and any(q.where == w for w in moved)})
        raise IntegrationError(
            f"{owner} cannot be undone: {', '.join(moved)} was replaced again after it patched it"
            + (f" (by {', '.join(later)}: undo those first)" if later else "")
        )
    for p in reversed(mine):
        if not (p.during and _current(p) is _ABSENT):
            _set(p, p.original)
        _PATCHES.remove(p)
    _DONE.pop(owner, None)


def undo_all() -> None:
    """Undo every installer, the latest first (each finds its slots as it left them)."""
    owners: list[str] = []
    for p in _PATCHES:
        if p.owner not in owners:
            owners.append(p.owner)
    for owner in reversed(owners):
        undo(owner)
    _DONE.clear()


# ---------------------------------------------------------------------------------------------------------
# What a slot is expected to hold (each returns None when it does, else a description of what was expected)
# ---------------------------------------------------------------------------------------------------------
def _qualified_name(target: Any) -> str:
    if isinstance(target, types.ModuleType):
        return target.__name__
    if hasattr(target, "__qualname__"):
        return f"{target.__module__}.{target.__qualname__}"
    return f"{type(target).__module__}.{getattr(target, 'name', type(target).__name__)}"  # a thunder Symbol


def _describe(x: Any) -> str:
    if x is _ABSENT:
        return "nothing"
    if callable(x):
        try:
            return f"{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', repr(x))}{inspect.signature(x)}"
        except (TypeError, ValueError):
            return repr(x)
    return repr(x)[:120]


def _parameters(fn: Any) -> tuple[str, ...] | None:
    """The parameter names of ``fn``; None when unknown or when it takes ``*args`` first (a generic wrapper)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if parameters and parameters[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return None
    return tuple(p.name for p in parameters)


def expects_function(module: str | tuple[str, ...], *parameters: str) -> Callable[[Any], str | None]:
    """A function (or callable object) defined in ``module`` or a submodule of it (or of one of several) whose
    parameters begin with ``parameters``: the function this patch wraps, as the release it was written for has
    it (a wrapper taking ``*args`` first passes the parameter check)."""
    modules = (module,) if isinstance(module, str) else module

    def check(original: Any) -> str | None:
        wanted = f"a function of {' or '.join(modules)} taking ({', '.join(parameters)}, ...)"
        if original is _ABSENT or not callable(original):
            return wanted
        where = str(getattr(original, "__module__", None) or getattr(type(original), "__module__", ""))
        if not any(where == m or where.startswith(m + ".") for m in modules):
            return wanted
        names = _parameters(original)
        if names is not None and names[: len(parameters)] != parameters:
            return wanted
        return None

    return check


def expects_qualified(name: str, *parameters: str) -> Callable[[Any], str | None]:
    """The function whose ``module.qualname`` is ``name`` (its parameters beginning with ``parameters``): the one
    function of the release this patch was written against, by name."""

    def check(original: Any) -> str | None:
        wanted = f"{name}({', '.join(parameters)}, ...)" if parameters else name
        found = f"{getattr(original, '__module__', None)}.{getattr(original, '__qualname__', None)}"
        if original is _ABSENT or found != name:
            return wanted
        names = _parameters(original)
        return wanted if names is not None and names[: len(parameters)] != parameters else None

    return check


def expects_absent(original: Any) -> str | None:
    """Nothing is there yet (a new entry of one of thunder's tables)."""
    return None if original is _ABSENT else "no entry"


def expects_absent_or(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """Nothing yet, or what ``check`` accepts (an entry thunder may or may not have made)."""
    return lambda original: None if original is _ABSENT else check(original)


def expects_instance(*classes: type) -> Callable[[Any], str | None]:
    """An instance of one of ``types``."""
    names = " or ".join(t.__name__ for t in classes)
    return lambda original: None if isinstance(original, classes) else f"an instance of {names}"


def expects_identical(expected: Any) -> Callable[[Any], str | None]:
    """That very object (a slot whose content was read elsewhere first)."""
    return lambda original: None if original is expected else _describe(expected)


def slots_of(patches: Iterable[Patch]) -> list[str]:
    """``where`` of each patch (for listings and tests)."""
    return [p.where for p in patches]
