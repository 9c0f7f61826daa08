"""Writes into views, made functional where gradients flow through them (thunder 0.2.6 trace layout).

thunder 0.2.6 keeps an in-place op as a ``copy_`` into its destination and lets its alias pass
(``update_aliases``) rename every alias of the written tensor before later reads. At run time that gives the
right values, but its autodiff treats each renamed alias as the tensor from before the write: a write into a
view (``y[:, 1:].mul_(0.5)``) leaves ``y``'s gradient as if nothing had been written, and an operand written
into a view (``y[:, 1:].add_(b)``) gets no gradient when only ``y`` is read afterwards.

:func:`functionalize_writes_into_views` rewrites such a write, before thunder's alias pass, the way eager
autograd sees it: the new value of the view is computed out of place, scattered back through the chain of
views into a new value of the viewed tensor (``slice_scatter``, ``select_scatter``, ``diagonal_scatter``, or
the inverse view of a transpose / permute / reshape), and every later read of that tensor or of any view of
it (the written one, others taken before the write) reads the new value, views taken again from it. Each of
those ops has its own gradient, so values and gradients are eager's. A program input written this way is
also written at run time (one ``copy_`` of its new value), as eager writes it.

Only writes whose gradients matter are rewritten (grad mode on, and the viewed tensor or an operand requires
grad), and then every later write into the same tensor or its views; a write under ``no_grad`` (a KV cache)
keeps thunder's in-place form. The ops are emitted through a :class:`ViewWriteEmitter`, one per kind of
tensor: thunder's own symbols for plain tensors (``functionalize_writes_into_views_that_require_grad``, a
switchable thunder fix), the package's dtensor symbols for DTensors (``ops/inplace.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

from thunder_dtensor._integration.bootstrap import (
    BoundSymbol,
    OpTags,
    TensorProxy,
    dtypes,
    ltorch,
    prims,
    pyval,
)

import torch
from thunder.core.proxies import variableify
from thunder.core.pytree import tree_flatten, tree_map
from thunder.core.trace import TraceCtx, from_trace, tracectx

__all__ = ["ViewWriteEmitter", "functionalize_writes_into_views", "normalized_view_name", "plain_emitter"]

#: in-place ops whose new value's gradient never reads the destination's old value
_GRADIENT_READS_NO_VALUES = frozenset(
    {"add_", "sub_", "copy_", "setitem_", "fill_", "zero_", "neg_", "masked_fill_", "index_put_", "index_copy_"}
)
#: in-place ops whose new value does not read the destination
_VALUES_IGNORING_THE_DESTINATION = frozenset({"copy_", "fill_", "zero_"})
#: views of some of their input's elements (the others: all of them, rearranged)
_SUBSET_VIEWS = frozenset({"getitem", "narrow", "select", "unbind", "diagonal", "split", "chunk", "tensor_split"})
#: thunder symbols whose outputs never require grad
_NO_GRADIENT_SYMBOLS = frozenset({"detach", "stop_gradient"})
#: view names of torch and thunder that are the same view
_VIEW_NAME_ALIASES = {
    "__getitem__": "getitem",
    "swapaxes": "transpose",
    "swapdims": "transpose",
    "mT": "matrix_transpose",
    "moveaxis": "movedim",
    "split_with_sizes": "split",
}
_RESHAPES = frozenset(
    {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as", "contiguous", "to"}
)
_SPLITS = frozenset({"split", "chunk", "tensor_split"})


def normalized_view_name(name: str) -> str:
    """A view op's name as the scatter rules know it (``swapaxes`` is ``transpose``, ``mT`` is ``matrix_transpose``)."""
    return _VIEW_NAME_ALIASES.get(name, name)


@dataclasses.dataclass(frozen=True)
class ViewWriteEmitter:
    """How the rewrite emits ops on one kind of tensor (plain tensors, DTensors).

    ``call(torch_fn, *args, **kwargs)``: the symbol a program's call of ``torch_fn`` on these tensors runs.
    ``view_name(bsym)``: the torch name of the view a bound symbol takes of its first argument, or None.
    ``write_into_input(input, value)``: writes ``value`` into the program input ``input`` at run time.
    ``snapshot(a)``: a copy of ``a`` for an op whose gradient reads the destination (None: the in-place
    symbols snapshot it themselves). ``keep_layout(value, like)``: ``value`` in ``like``'s layout (a DTensor's
    placements: a write keeps the written tensor's). ``copied(src, like)``: what ``like.copy_(src)`` makes of
    ``src`` (a DTensor's placements, with eager's gradient: None, a broadcast and a cast). ``refuse(bsym, why)``:
    raises where a write that needs the rewrite cannot be rewritten (None: thunder's in-place form stays).
    ``read_for_a_write(a)``: the written tensor as the write reads it (the views it writes through and the value it
    updates are taken from it), so that what flows back through those reads reaches the tensor as one cotangent
    (None: they read the tensor itself). ``copied_by(view, out)``: whether the view op made ``out`` as a copy (DTensor
    takes some views on gathered data): a write through it reaches the viewed tensor only rewritten, so it is
    rewritten whether gradients matter or not (None: views are views). ``written_value(v)``: the view's new value
    as the write's backward sees its cotangent (eager's backward of a write into a view runs on a copy of that view
    of the gradient, which for a DTensor reduces a Partial one; None: as it is).
    """

    call: Callable[..., Any]
    view_name: Callable[[BoundSymbol], str | None]
    write_into_input: Callable[[Any, Any], Any]
    snapshot: Callable[[Any], Any] | None = None
    keep_layout: Callable[[Any, Any], Any] | None = None
    copied: Callable[[Any, Any], Any] | None = None
    refuse: Callable[[BoundSymbol, str], None] | None = None
    read_for_a_write: Callable[[Any], Any] | None = None
    copied_by: Callable[[BoundSymbol, Any], bool] | None = None
    written_value: Callable[[Any], Any] | None = None


def _plain_call(torch_fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return ltorch._torch_to_thunder_function_map[torch_fn](*args, **kwargs)


_PLAIN_VIEW_SYMBOLS: dict[Any, str] = {}


def _plain_view_name(bsym: BoundSymbol) -> str | None:
    if not _PLAIN_VIEW_SYMBOLS:
        for sym in (*ltorch._syms_returning_views, *ltorch._syms_that_may_return_views):
            _PLAIN_VIEW_SYMBOLS[sym.id] = normalized_view_name(sym.name)
    return _PLAIN_VIEW_SYMBOLS.get(bsym.sym.id)


def _plain_write_into_input(destination: Any, value: Any) -> Any:
    return ltorch.copy_(destination, value)


def plain_emitter() -> ViewWriteEmitter:
    """The emitter for plain tensors: thunder's own torch symbols."""
    return ViewWriteEmitter(
        call=_plain_call,
        view_name=_plain_view_name,
        write_into_input=_plain_write_into_input,
        snapshot=lambda a: ltorch.clone(a),
    )


# ---------------------------------------------------------------------------------------------------------
# Scattering a view's new value back into the tensor it views
# ---------------------------------------------------------------------------------------------------------
def _argument(bsym: BoundSymbol, index: int, name: str, default: Any) -> Any:
    """Argument ``name`` of a view call, given at position ``index`` (the viewed tensor is 0) or by keyword."""
    value = bsym.args[index] if len(bsym.args) > index else bsym.kwargs.get(name, default)
    return value if value is None or isinstance(value, (tuple, list)) else pyval(value)


def _basic_key_steps(key: Any, ndim: int) -> list[tuple] | None:
    """``a[key]`` for a basic key as single-dim steps: ``("select", dim, i)``, ``("slice", dim, start, stop, step)``
    and ``("unsqueeze", dim)``, in the coordinates of the step's input; None for an advanced key (a copy)."""
    keys = key if isinstance(key, tuple) else (key,)
    if not all(k is None or k is Ellipsis or isinstance(k, (int, slice)) for k in keys):
        return None
    if any(
        isinstance(k, slice) and not all(v is None or isinstance(v, int) for v in (k.start, k.stop, k.step))
        for k in keys
    ):
        return None
    indexing = sum(1 for k in keys if k is not None and k is not Ellipsis)
    if keys.count(Ellipsis) > 1 or indexing > ndim:
        return None
    if Ellipsis in keys:
        at = keys.index(Ellipsis)
        keys = keys[:at] + (slice(None),) * (ndim - indexing) + keys[at + 1 :]
    steps: list[tuple] = []
    dim = 0
    for k in keys:
        if k is None:
            steps.append(("unsqueeze", dim))
            dim += 1
        elif isinstance(k, int):
            steps.append(("select", dim, k))
        else:
            if (k.start, k.stop, k.step) not in ((None, None, None), (0, None, None), (None, None, 1), (0, None, 1)):
                steps.append(("slice", dim, k.start, k.stop, 1 if k.step is None else k.step))
            dim += 1
    return steps


def _take_step(emit: ViewWriteEmitter, a: Any, step: tuple) -> Any:
    kind, dim = step[0], step[1]
    if kind == "select":
        return emit.call(torch.select, a, dim, step[2])
    if kind == "unsqueeze":
        return emit.call(torch.unsqueeze, a, dim)
    return emit.call(torch.Tensor.__getitem__, a, (slice(None),) * dim + (slice(step[2], step[3], step[4]),))


def _undo_step(emit: ViewWriteEmitter, base: Any, src: Any, step: tuple) -> Any:
    kind, dim = step[0], step[1]
    if kind == "select":
        return emit.call(torch.select_scatter, base, src, dim, step[2])
    if kind == "unsqueeze":
        return emit.call(torch.squeeze, src, dim)
    return emit.call(torch.slice_scatter, base, src, dim, step[2], step[3], step[4])


def _scatter_getitem(emit: ViewWriteEmitter, base: Any, src: Any, key: Any) -> Any:
    steps = cast(list[tuple], _basic_key_steps(key, base.ndim))
    inputs = [base]
    for step in steps[:-1]:  # the intermediate views the later steps scatter into
        inputs.append(_take_step(emit, inputs[-1], step))
    for step, step_input in zip(reversed(steps), reversed(inputs)):
        src = _undo_step(emit, step_input, src, step)
    return src


def _split_start(view: BoundSymbol, index: int, dim: int) -> int:
    outputs = view.output
    return sum(int(o.shape[dim]) for o in outputs[:index])


def _inverse_permutation(dims: Any, ndim: int) -> list[int]:
    order = [int(d) % ndim for d in (dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims)]
    inverse = [0] * ndim
    for position, d in enumerate(order):
        inverse[d] = position
    return inverse


def scatter_rule_missing(name: str | None, view: BoundSymbol, base: Any, src: Any) -> str | None:
    """Why a write into ``view`` (named ``name``) cannot be scattered back into ``base``; None: it can."""
    if name is None:
        return "not a view"
    if name == "getitem":
        return None if _basic_key_steps(view.args[1], base.ndim) is not None else "advanced indexing makes a copy"
    if name == "narrow":
        start = _argument(view, 2, "start", 0)
        return None if isinstance(start, int) else "narrow at a tensor position"
    if name in ("to", "view") and (src.dtype != base.dtype or src.device != base.device):
        return f"{name} to another dtype or device"
    if name in (
        "select", "unbind", "diagonal", "transpose", "t", "matrix_transpose", "permute", "movedim", *_RESHAPES,
        *_SPLITS,
    ):  # fmt: skip
        return None
    return f"{name} has no inverse here"


def _unsharded_dim(t: Any) -> int:
    """A dim of ``t`` no placement shards (a DTensor's; 0 for a plain tensor, or where every dim is sharded)."""
    sharded = {getattr(p, "dim", None) for p in getattr(t, "placements", ())}
    return next((d for d in range(t.ndim) if d not in sharded), 0)


def _scatter(emit: ViewWriteEmitter, name: str, view: BoundSymbol, index: int, base: Any, src: Any) -> Any:
    """``base`` with the view ``view`` (its output ``index``) of it replaced by ``src``: a new tensor."""
    if name == "getitem":
        return _scatter_getitem(emit, base, src, view.args[1])
    if name == "narrow":
        dim, start, length = (_argument(view, i, n, None) for i, n in ((1, "dim"), (2, "start"), (3, "length")))
        start = start % base.shape[dim] if start < 0 else start
        return emit.call(torch.slice_scatter, base, src, dim, start, start + length)
    if name == "select":
        return emit.call(torch.select_scatter, base, src, _argument(view, 1, "dim", 0), _argument(view, 2, "index", 0))
    if name == "unbind":
        return emit.call(torch.select_scatter, base, src, _argument(view, 1, "dim", 0), index)
    if name in _SPLITS:
        dim = _argument(view, 2, "dim", 0) % base.ndim
        start = _split_start(view, index, dim)
        return emit.call(torch.slice_scatter, base, src, dim, start, start + int(src.shape[dim]))
    if name == "diagonal":
        offset, dim1, dim2 = (
            _argument(view, i, n, d) for i, n, d in ((1, "offset", 0), (2, "dim1", 0), (3, "dim2", 1))
        )
        return emit.call(torch.diagonal_scatter, base, src, offset, dim1, dim2)
    if name == "transpose":
        return emit.call(torch.transpose, src, _argument(view, 1, "dim0", 0), _argument(view, 2, "dim1", 1))
    if name == "t":
        return emit.call(torch.transpose, src, 0, 1) if base.ndim == 2 else src
    if name == "matrix_transpose":
        return emit.call(torch.transpose, src, -2, -1)
    if name == "permute":
        return emit.call(torch.permute, src, _inverse_permutation(view.args[1:], base.ndim))
    if name == "movedim":
        return emit.call(torch.movedim, src, _argument(view, 2, "destination", 0), _argument(view, 1, "source", 0))
    return emit.call(torch.reshape, src, tuple(base.shape))  # a reshape of all its elements


# ---------------------------------------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------------------------------------
def is_copy(bsym: BoundSymbol) -> bool:
    """thunder's ``copy_`` (the prim, the torch symbol) or ours."""
    return bsym.sym.id == prims.PrimIDs.COPY_ or bsym.sym.name in ("copy_", "dtensor_copy__prim")


def written_destination(bsym: BoundSymbol) -> TensorProxy | None:
    """The tensor an in-place bound symbol writes (its first argument, which its last subsymbol copies into)."""
    if not bsym.subsymbols or not is_copy(bsym.subsymbols[-1]):
        return None
    if not (bsym.sym.tags and OpTags.IN_PLACE in bsym.sym.tags) and bsym.sym.name != "copy_":
        return None
    args = bsym.flat_proxy_args
    copy = bsym.subsymbols[-1]
    if not args or not isinstance(args[0], TensorProxy) or len(copy.args) < 2 or copy.args[1] is not args[0]:
        return None
    return args[0]


def _is_floating(p: TensorProxy) -> bool:
    return dtypes.is_float_dtype(p.dtype) or dtypes.is_complex_dtype(p.dtype)


@dataclasses.dataclass
class _Derivation:
    view: BoundSymbol  # the view's bound symbol as the program took it
    parent: str  # the viewed tensor's name (as the program names it)
    index: int  # which output of the view op (split, unbind)
    name: str  # the view's normalized name


class _Rewrite:
    """One pass over a computation trace: see :func:`functionalize_writes_into_views`."""

    def __init__(self, trace: TraceCtx, emitter_for: Callable[[TensorProxy], ViewWriteEmitter | None]) -> None:
        self.trace = trace
        self.emitter_for = emitter_for
        self.out = from_trace(trace)
        self.out.names, self.out.name_ctr = trace.names, trace.name_ctr
        self.bsyms: list[BoundSymbol] = []
        self.proxies: dict[str, TensorProxy] = {}
        self.inputs = {p.name for p in tree_flatten((trace.args, trace.kwargs))[0] if isinstance(p, TensorProxy)}
        self.needs_grad = {
            p.name
            for p in tree_flatten((trace.args, trace.kwargs))[0]
            if isinstance(p, TensorProxy) and p.requires_grad
        }
        self.grad_enabled = torch.is_grad_enabled()  # the caller's mode: thunder records changes as symbols
        self.derivation: dict[str, _Derivation] = {}
        self.root_of: dict[str, str] = {}
        self.members: dict[str, set[str]] = {}
        self.alias_of: dict[str, str] = {}  # an in-place op's output -> the tensor it wrote
        self.version: dict[str, int] = {}  # root -> how many rewritten writes it had (functional groups only)
        self.current: dict[str, tuple[TensorProxy, int]] = {}
        self.detached: set[str] = set()  # detached views: the write reaches their base's memory, not its gradient
        self.changed = False

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def _resolve(self, name: str) -> str:
        while name in self.alias_of:
            name = self.alias_of[name]
        return name

    def _root(self, name: str) -> str:
        return self.root_of.get(name, name)

    def _emit(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        scope: list[BoundSymbol] = []
        with tracectx(self.out):
            self.out.push_scope(scope)
            try:
                result = fn(*args, **kwargs)
            finally:
                self.out.pop_scope()
        for bsym in scope:
            self._append(bsym)
        return result

    def _append(self, bsym: BoundSymbol) -> None:
        self.bsyms.append(bsym)
        if bsym.sym.name in ("_set_grad_enabled_with_warning", "set_grad_enabled") and bsym.args:
            self.grad_enabled = bool(pyval(bsym.args[0]))
            return
        if not self.grad_enabled or bsym.sym.name in _NO_GRADIENT_SYMBOLS or self._view_name(bsym) == "detach":
            return
        if any(isinstance(a, TensorProxy) and a.name in self.needs_grad for a in bsym.flat_proxy_args):
            self.needs_grad.update(
                o.name for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy) and _is_floating(o)
            )

    def _current(self, name: str) -> TensorProxy:
        """The value the program's tensor ``name`` has now, its views taken again from a rewritten write's result."""
        root = self._root(name)
        version = self.version.get(root)
        if version is None:
            return self.proxies[name]
        held, at = self.current.get(name, (self.proxies[name], 0))
        if at == version or name == root:
            return held
        d = self.derivation[name]
        value = self._take_again(d, self._current(d.parent))
        self.current[name] = (value, version)
        return value

    def _take_again(self, d: _Derivation, parent: TensorProxy) -> TensorProxy:
        """The view ``d`` taken again, of ``parent``."""
        taken = self._emit(d.view.sym, parent, *d.view.args[1:], **d.view.kwargs)
        return taken[d.index] if isinstance(taken, (tuple, list)) else taken

    def _chain(self, name: str) -> list[_Derivation]:
        chain = []
        while name in self.derivation:
            chain.append(self.derivation[name])
            name = self.derivation[name].parent
        return chain

    # -- one bound symbol ----------------------------------------------------------------------------------
    def _note(self, bsym: BoundSymbol) -> None:
        for p in bsym.flat_proxy_outs:
            if isinstance(p, TensorProxy):
                self.proxies.setdefault(p.name, p)
        for p in bsym.flat_proxy_args:
            if isinstance(p, TensorProxy):
                self.proxies.setdefault(p.name, p)

    def _view_name(self, bsym: BoundSymbol) -> str | None:
        args = bsym.flat_proxy_args
        if not args or not isinstance(args[0], TensorProxy):
            return None
        emitter = self.emitter_for(args[0])
        return emitter.view_name(bsym) if emitter is not None else None

    def _record_view(self, bsym: BoundSymbol) -> None:
        name = self._view_name(bsym)
        if name is None:
            return
        if name == "detach":  # autograd does not see a write into it: thunder's in-place form is eager's
            self.detached.update(o.name for o in bsym.flat_proxy_outs)
            return
        args = bsym.flat_proxy_args
        parent = self._resolve(args[0].name)
        root = self._root(parent)
        outputs = bsym.output if isinstance(bsym.output, (tuple, list)) else (bsym.output,)
        for index, out in enumerate(outputs):
            if isinstance(out, TensorProxy) and out.name != parent:
                self.derivation[out.name] = _Derivation(bsym, parent, index, name)
                self.root_of[out.name] = root
                self.members.setdefault(root, set()).add(out.name)
                if root in self.version:  # taken from the current value: current
                    self.current[out.name] = (out, self.version[root])

    def _needs_rewrite(self, bsym: BoundSymbol, destination: str, emitter: ViewWriteEmitter) -> bool:
        root = self._root(destination)
        if root in self.version:
            return True
        if root in self.detached or not self.members.get(
            root
        ):  # a tensor no view was taken of: thunder's in-place form is right
            return False
        chain = self._chain(destination)
        outputs_of = [d.view.output if isinstance(d.view.output, (tuple, list)) else (d.view.output,) for d in chain]
        through_a_copy = emitter.copied_by is not None and any(
            emitter.copied_by(d.view, outputs[d.index]) for d, outputs in zip(chain, outputs_of)
        )
        copy = bsym.subsymbols[-1]
        grad_enabled = bool(pyval(copy.kwargs.get("grad_enabled", self.grad_enabled)))
        if not grad_enabled and not through_a_copy:
            return False
        operands = [a for a in bsym.flat_proxy_args[1:] if isinstance(a, TensorProxy)]
        tracked = [self._current(destination), self._current(root)]
        if not through_a_copy and not any(p.name in self.needs_grad for p in (*tracked, *operands)):
            return False
        for d, outputs in zip(chain, outputs_of):
            why = scatter_rule_missing(d.name, d.view, self.proxies[d.parent], outputs[d.index])
            if why is not None:
                if emitter.refuse is not None:
                    emitter.refuse(bsym, f"{d.view.sym.name}: {why}")
                return False
        return True

    def _read_for_a_write(self, destination: str, emitter: ViewWriteEmitter) -> dict[str, TensorProxy]:
        """The current values of the write's destination and of the views between it and its root, each taken
        again from ``emitter.read_for_a_write`` of the root (empty without one: they are read as they are)."""
        if emitter.read_for_a_write is None:
            return {}
        root = self._root(destination)
        values = {root: self._emit(emitter.read_for_a_write, self._current(root))}
        names, name = [], destination
        while name in self.derivation:
            names.append(name)
            name = self.derivation[name].parent
        for name in reversed(names):
            d = self.derivation[name]
            values[name] = self._take_again(d, values[d.parent])
        return values

    def _rewrite_write(self, bsym: BoundSymbol, destination: str, swap: dict, emitter: ViewWriteEmitter) -> None:
        root = self._root(destination)
        self.version.setdefault(root, 0)
        read = self._read_for_a_write(destination, emitter)
        target = read[destination] if destination in read else self._current(destination)
        value_swap = dict(swap)
        written = bsym.flat_proxy_args[0]
        name = bsym.sym.name.removeprefix("dtensor_")
        if emitter.snapshot is not None and root in self.inputs and name not in _GRADIENT_READS_NO_VALUES:
            # the input is written below, before the backward reads what the new value's gradient saved
            value_swap[variableify(written)] = self._emit(emitter.snapshot, target)
        else:
            value_swap[variableify(written)] = target
        *compute, copy = bsym.subsymbols
        for sub in compute:
            self._append(sub.from_bsym_swap_proxies(value_swap))
        value: Any = tree_map(
            lambda x: value_swap.get(variableify(x), x) if isinstance(x, TensorProxy) else x, copy.args[0]
        )
        if emitter.copied is not None and not compute:  # ``copy_``: the source as the destination holds it
            value = self._emit(emitter.copied, value, target)
        if tuple(value.shape) != tuple(target.shape):
            value = self._emit(emitter.call, torch.Tensor.expand, value, tuple(target.shape))
        if value.dtype != target.dtype:
            value = self._emit(emitter.call, torch.Tensor.to, value, dtypes.to_torch_dtype(target.dtype))
        if emitter.written_value is not None:
            value = self._emit(emitter.written_value, value)
        for d in self._chain(destination):
            taken = d.parent != root and d.parent in read  # (the root's own cotangent: the scatter's part)
            base = read[d.parent] if taken else self._current(d.parent)
            value = self._emit(_scatter, emitter, d.name, d.view, d.index, base, value)
        before = self._current(root)
        whole = all(d.name not in _SUBSET_VIEWS for d in self._chain(destination))
        if whole and before.name in self.needs_grad and before.ndim > 0 and self._scatters_a_whole_write(name, emitter):
            # all of it written (``y.t().mul_(w)``), as a scatter over all of it: eager's backward copies the write's
            # gradient into a copy of the written tensor's (autograd's CopySlices), so the gradient keeps that one's
            # placements, which the scatter's rule gives (fuzz seed 5311); a value that does not read the old one
            # (``y.t().copy_(c)``) still depends on it in eager (a zero gradient, requires_grad), as the scatter does
            value = self._emit(emitter.call, torch.slice_scatter, before, value, _unsharded_dim(before))
        if emitter.keep_layout is not None:
            value = self._emit(emitter.keep_layout, value, before)
        self.version[root] += 1
        self.current[root] = (value, self.version[root])
        if root in self.inputs:
            self._emit(emitter.write_into_input, self.proxies[root], value)
        self.alias_of[self._out_name(bsym)] = destination
        self.changed = True

    @staticmethod
    def _scatters_a_whole_write(name: str, emitter: ViewWriteEmitter) -> bool:
        """Whether a write through views of all of a tensor that needs grad becomes a scatter over all of it: where
        it ignores the old value, and where gradients have placements to keep (``read_for_a_write``: DTensors)."""
        return name in _VALUES_IGNORING_THE_DESTINATION or emitter.read_for_a_write is not None

    @staticmethod
    def _out_name(bsym: BoundSymbol) -> str:
        out = bsym.flat_proxy_outs
        return out[0].name if out else ""

    def _swap_reads(self, read: Sequence[Any]) -> dict:
        swap: dict = {}
        for p in read:
            if not isinstance(p, TensorProxy):
                continue
            name = self._resolve(p.name)
            if self._root(name) in self.version:
                now = self._current(name)
                if now is not p:
                    swap[variableify(p)] = now
        return swap

    def _return(self, bsym: BoundSymbol) -> BoundSymbol:
        # only the returned values: thunder's ``flat_args`` entry names the inputs themselves
        if not bsym.args or not isinstance(bsym.args[0], dict) or "output" not in bsym.args[0]:
            swap = self._swap_reads(bsym.flat_proxy_args)
            return bsym.from_bsym_swap_proxies(swap) if swap else bsym
        outputs = bsym.args[0]["output"]
        swap = self._swap_reads(tree_flatten(outputs)[0])
        if not swap:
            return bsym
        swapped = tree_map(lambda x: swap.get(variableify(x), x) if isinstance(x, TensorProxy) else x, outputs)
        return bsym.from_bsym(args=({**bsym.args[0], "output": swapped}, *bsym.args[1:]))

    def run(self) -> TraceCtx:
        *body, last = cast(list[BoundSymbol], self.trace.bound_symbols)
        for bsym in body:
            self._note(bsym)
            swap = self._swap_reads(bsym.flat_proxy_args)
            destination = written_destination(bsym)
            if destination is not None:
                name = self._resolve(destination.name)
                emitter = self.emitter_for(destination)
                if emitter is not None and self._needs_rewrite(bsym, name, emitter):
                    self._rewrite_write(bsym, name, swap, emitter)
                    continue
            self._append(bsym.from_bsym_swap_proxies(swap) if swap else bsym)
            if destination is not None and self._out_name(bsym):  # its output is the written tensor
                written = self._resolve(destination.name)
                self.alias_of[self._out_name(bsym)] = written
                if self._out_name(bsym) in self.needs_grad:  # later reads of it read the written value
                    self.needs_grad.update((written, self._root(written)))
            self._record_view(bsym)
        is_return = last.sym.id == prims.PrimIDs.RETURN or last.sym.name == "return"
        self.bsyms.append(self._return(last) if is_return else last)
        if not self.changed:
            return self.trace
        self.out.bound_symbols = cast(list, self.bsyms)
        self.trace.name_ctr = self.out.name_ctr
        return self.out


def functionalize_writes_into_views(
    trace: TraceCtx, emitter_for: Callable[[TensorProxy], ViewWriteEmitter | None]
) -> TraceCtx:
    """``trace`` with each write into a view whose gradient matters made functional (see the module's doc).

    ``emitter_for(proxy)`` gives the emitter for the tensors a write touches, or None: leave them to thunder.
    Returns ``trace`` itself where nothing is rewritten.
    """
    if not any(written_destination(b) is not None for b in cast(list[BoundSymbol], trace.bound_symbols)):
        return trace
    return _Rewrite(trace, emitter_for).run()
