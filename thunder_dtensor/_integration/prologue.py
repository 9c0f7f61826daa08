"""A DTensor program's prologue, compacted: module lookups shared, constant checks compared in one tuple.

thunder 0.2.6's prologue re-reads everything a program read from the jitted function's closure on every call. A
jitted Hugging Face forward reads hundreds of configuration numbers and strings and fetches each parameter,
buffer and submodule by its full path from the root module: in a 4-layer decode step that was 1.1 ms of Python
a call (94 ``get_submodule`` and 39 ``get_parameter`` walks, 413 value checks), more than a tenth of the step.
This pass rewrites the prologue trace (thunder 0.2.6's prims, before the python executor runs it) so that

* each module along those paths is reached once, by one ``getattr`` step from its parent (the steps torch's
  ``get_submodule`` takes), and every fetch takes its module from there; a root whose lookups are not
  torch's own (a ``ThunderModule`` with its cached lookups) is asked for each path as before;
* the number and string checks become one check at the prologue's end, which compares the read values with
  the traced ones as two tuples (thunder's per-value check, NaN included, where they differ).

What is read, and what is accepted, stay the same; only the order of checks against reads changes (a failing
check and a failing read both mean a cache miss). It runs on DTensor programs' prologues only.
"""

from __future__ import annotations

import dataclasses
from numbers import Number
from typing import cast

from thunder_dtensor._integration.bootstrap import (
    AnyProxy,
    BoundSymbol,
    Proxy,
    Symbol,
    TraceCtx,
    from_trace,
    prims,
    tracectx,
)


@dataclasses.dataclass(frozen=True)
class PrologueOps:
    """The executor operators a compacted prologue is written with (``guards.py`` defines them)."""

    walkable_root: Symbol  # root -> root, or None where its lookups are not torch's own
    submodule_step: Symbol  # (parent, name) -> parent.name, a module (None from None)
    fetch_submodule: Symbol  # (root, path, walked) -> the submodule
    fetch_parameter: Symbol  # (root, path, owner, name) -> the parameter
    fetch_buffer: Symbol  # (root, path, owner, name) -> the buffer
    check_constants: Symbol  # (numbers, expected, strings, expected)


_FETCHES = {
    prims.PrimIDs.UNPACK_SUBMODULE: "submodule",
    prims.PrimIDs.UNPACK_PARAMETER: "parameter",
    prims.PrimIDs.UNPACK_BUFFER: "buffer",
}


class _Walk:
    """The module nodes of one prologue: each (root, path) reached once, its ancestors first."""

    def __init__(self, ops: PrologueOps, emit: list[BoundSymbol]) -> None:
        self._ops, self._emit = ops, emit
        self._nodes: dict[tuple[str, str], Proxy] = {}

    def node(self, root: Proxy, path: str) -> Proxy:
        key = (root.name, path)
        found = self._nodes.get(key)
        if found is not None:
            return found
        out = AnyProxy(None, prefix="mod")
        if path == "":
            self._emit.append(self._ops.walkable_root.bind(root, output=out))
        else:
            parent, _, name = path.rpartition(".")
            self._emit.append(self._ops.submodule_step.bind(self.node(root, parent), name, output=out))
        self._nodes[key] = out
        return out


def _is_fetch(bsym: BoundSymbol) -> bool:
    return (
        bsym.sym.id in _FETCHES
        and len(bsym.args) == 2
        and isinstance(bsym.args[0], Proxy)
        and isinstance(bsym.args[1], str)
        and not bsym.kwargs
    )


def _constant_check(bsym: BoundSymbol) -> str | None:
    """ "number" or "string" for a check of a read value against a constant the pass can batch, else None."""
    if len(bsym.args) != 2 or not isinstance(bsym.args[0], Proxy) or isinstance(bsym.args[1], Proxy):
        return None
    if bsym.sym.id == prims.PrimIDs.CHECK_NUMBER_TYPE_AND_VALUE and isinstance(bsym.args[1], Number):
        return "number"
    if bsym.sym.id == prims.PrimIDs.CHECK_STRING_VALUE and _prints_as_itself(bsym.args[1]):
        return "string"
    return None


def _prints_as_itself(value: object) -> bool:
    """A string whose Python literal is the string between quotes, and no double quote: thunder 0.2.6 prints a
    tuple of strings escaping each one twice, so a batched newline, tab or backslash reads back as another string
    and a double quote does not parse (a module attribute holding a graph module's code, under thunderfx: every
    call failed its own check); such a string keeps thunder's own check."""
    return isinstance(value, str) and '"' not in value and repr(value)[1:-1] == value


def compact_prologue(trace: TraceCtx, ops: PrologueOps) -> TraceCtx:
    """``trace`` (a prologue) with its module lookups walked once and its constant checks in one (see above)."""
    new = from_trace(trace)
    bsyms: list[BoundSymbol] = []
    walk = _Walk(ops, bsyms)
    checked: dict[str, tuple[list, list]] = {"number": ([], []), "string": ([], [])}
    changed = False
    with tracectx(new):
        for bsym in cast(list[BoundSymbol], trace.bound_symbols):
            if _is_fetch(bsym):
                root, path = bsym.args
                fetched = _FETCHES[cast(prims.PrimIDs, bsym.sym.id)]
                if fetched == "submodule":
                    bsyms.append(ops.fetch_submodule.bind(root, path, walk.node(root, path), output=bsym.output))
                else:
                    owner, _, name = path.rpartition(".")
                    op = ops.fetch_parameter if fetched == "parameter" else ops.fetch_buffer
                    bsyms.append(op.bind(root, path, walk.node(root, owner), name, output=bsym.output))
                changed = True
                continue
            kind = _constant_check(bsym)
            if kind is not None:
                values, expected = checked[kind]
                values.append(bsym.args[0])
                expected.append(bsym.args[1])
                changed = True
                continue
            if bsym.sym.id == prims.PrimIDs.RETURN:
                bsyms.extend(_batched_check(ops, checked))
                checked = {}
            bsyms.append(bsym)
        if checked:  # (a prologue without a return statement)
            bsyms.extend(_batched_check(ops, checked))
    if not changed:
        return trace
    new.bound_symbols = cast(list, bsyms)
    return new


def _batched_check(ops: PrologueOps, checked: dict[str, tuple[list, list]]) -> list[BoundSymbol]:
    (numbers, expected_numbers), (strings, expected_strings) = checked["number"], checked["string"]
    if not numbers and not strings:
        return []
    args = (tuple(numbers), tuple(expected_numbers), tuple(strings), tuple(expected_strings))
    return [ops.check_constants.bind(*args, output=None)]


__all__ = ["PrologueOps", "compact_prologue"]
