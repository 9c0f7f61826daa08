"""In-place ops on DTensors: ``x.add_(y)``, ``x.copy_(y)``, ``x[i] = v``, ``F.relu(x, inplace=True)``, ...

thunder 0.2.6 keeps in-place ops in its traces the way it writes them for plain tensors: a torch symbol
tagged ``IN_PLACE`` computes the new value out of place, then ``prims.copy_`` writes it into the first
argument; thunder's alias pass (``thunder.core.update_aliases``) makes later reads use the written value,
its DCE keeps the copy (``DONT_DCE``), and its autodiff passes the gradient of the written value to the
copied one. DTensors take the same path, with dtensor prims in place of thunder's::

    t2 = dtensor_mul_(y, w)                              # tagged IN_PLACE
      # t0 = dtensor_snapshot_prim(y)                    # y's value for the backward (grad mode only)
      # t1 = dtensor_mul__prim(t0, w)                    # the new value
      # t2 = dtensor_copy__prim(t1, y, grad_enabled=True)  # written into y's local shard

* The new value (``dtensor_<op>__prim``) is eager's in-place op run on a copy of the destination, so its
  output spec, its collectives and its rejections are eager DTensor's for the in-place op: an in-place op
  eager rejects (one that would change the destination's placements, say ``partial.add_(1)``) fails at
  trace time with :class:`DTensorOpError`. Its gradient is eager's (the generic rule; ``add_``, ``sub_``
  and ``mul_`` have dedicated ones, which do not recompute the op's redistribution).
* ``dtensor_copy__prim(src, dst)`` is ``dst.copy_(src)`` on the runtime DTensors: the caller's DTensor (or
  the intermediate) is updated in place, with its placements. As eager, copying into a leaf that requires
  grad with grad mode on raises. It is also ``x.copy_(y)`` itself, with eager's redistribution of ``y``.
* The destination's old value is overwritten at run time, so under grad mode an op whose gradient reads it
  gets a snapshot first (eager saves the original ``self`` the same way); ops whose gradients never read
  values (``add_``, ``sub_``, ``zero_``, ``fill_``, setitem, ...) skip it.

A write into a view of a DTensor whose gradient matters (``y[:, 1:].mul_(w)``) is made functional before
thunder's alias pass (``_integration/functionalize.py``, with :data:`DTENSOR_VIEW_WRITES`): the view's new value,
scattered back into the viewed DTensor (``slice_scatter`` and friends, whose grad rules here are eager's backward of
such a write), and later reads see it. So is a write into a view DTensor computed on gathered data (a copy), with
gradients or without: eager loses it, the rewrite writes it back (plain torch's values).

Every in-place torch function / Tensor method in thunder's tables is covered this way (plus ``fill_``,
which thunder lacks), and so are functions with an ``inplace=`` flag (``F.relu``, ``nn.ReLU(inplace=True)``;
``F.dropout(x, inplace=True)`` writes the dropout family's own value, whose gradient reuses its mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import (
    DISPATCH_TABLE,
    call_for_dtensor,
    register_function_for_dtensor,
    register_method_for_dtensor,
    route_method,
    torch_function_of_symbol,
)
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.executor import dtensor_ex
from thunder_dtensor.ops.dropout import dtensor_dropout
from thunder_dtensor.ops.fallback import fallback_prim
from thunder_dtensor.ops.pointwise import (
    accumulate_cotangents as pointwise_accumulate_cotangents,
)
from thunder_dtensor.ops.pointwise import (
    dtensor_mul_prim,
    grad_for_operand,
    refusing_a_number_into_a_partial_sum,
)
from thunder_dtensor.primitive import (
    PRIMS,
    add_prim_record,
    define_dtensor_prim,
    define_marker_prim,
    define_vjp,
    propagate_on_fake_dtensors,
    propagated_fakes,
)
from thunder_dtensor.proxy import DTensorProxy

import torch

__all__ = ["INPLACE_SYMBOLS", "VALUE_PRIMS", "dtensor_copy__prim", "inplace_symbol"]

#: in-place op name (``add_``, ``setitem_``, ``functional_relu_``) -> its torch-level dtensor symbol
INPLACE_SYMBOLS: dict[str, ti.Symbol] = {}
#: in-place op name -> the prim computing its new value (``dtensor_add__prim``)
VALUE_PRIMS: dict[str, ti.Symbol] = {}

# In-place ops whose gradient never reads the destination's old value: no snapshot needed under grad mode.
_GRADIENT_READS_NO_VALUES = frozenset({"add_", "sub_", "zero_", "fill_", "neg_", "setitem_"})

# Random ops: the generic gradient recomputes the op, which would draw other numbers.
_RANDOM_NAME_PARTS = ("dropout", "rrelu")


# ---------------------------------------------------------------------------------------------------------
# The copy into the destination, and alias updates over DTensors
# ---------------------------------------------------------------------------------------------------------
def _copy_into(src: Any, dst: Any, *, grad_enabled: bool) -> Any:
    """``dst.copy_(src)``; like eager, a leaf that requires grad cannot be written with grad mode on."""
    if grad_enabled and dst.is_leaf and dst.requires_grad:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    return dst.copy_(src)


def _copy_on_fakes(src: Any, dst: Any) -> Any:
    return dst.copy_(src)


def _copy_meta(src: Any, dst: Any, *, grad_enabled: bool) -> Any:
    return propagate_on_fake_dtensors("dtensor_copy__prim", _copy_on_fakes, (src, dst), {})


def _define_copy_prim() -> ti.Symbol:
    # By hand rather than with define_dtensor_prim: the copy must carry DONT_DCE (its output is often unused)
    # and its runtime function writes into its argument, so it has no generic (recomputing) gradient.
    name = "dtensor_copy__prim"
    prim = ti.make_prim(f"thunder_dtensor.{name}", name, meta=_copy_meta, tags=(ti.OpTags.DONT_DCE,))
    op = dtensor_ex.register_operator(name, like=prim, fn=_copy_into)
    dtensor_ex.register_implementation(prim, op, checker=lambda *args, **kwargs: True)
    add_prim_record(prim, not_lowered="writes into its destination DTensor in place")
    return prim


dtensor_copy__prim = _define_copy_prim()


@define_vjp(dtensor_copy__prim)
def _copy_vjp(g, out, src, dst, *, grad_enabled):
    # The written value's gradient goes to the source (in the destination's spec, as eager's copy_ backward,
    # reduced to the source's shape and dtype); the destination's old value is overwritten and gets none.
    return grad_for_operand(g, src), None


def _update_aliases_meta(aliases: tuple) -> tuple:
    return tuple(
        DTensorProxy(like=a, requires_grad=a.requires_grad)
        if isinstance(a, DTensorProxy)
        else ti.TensorProxy(like=a, requires_grad=a.requires_grad)
        for a in aliases
    )


dtensor_update_aliases_prim = define_dtensor_prim(
    "update_aliases",
    lambda aliases: aliases,
    meta=_update_aliases_meta,
    differentiable=False,
    not_lowered="renames the written DTensors: the caller's stay the same objects (a leaf stays a leaf)",
    renames_arguments=True,
)


def _update_aliases_grad(aliases: tuple) -> tuple:
    # the same values under new names: gradients pass through unchanged
    updated = dtensor_update_aliases_prim(aliases)
    for new, old in zip(updated, aliases):
        ti.put_grad(old, ti.get_grad(new))
    return updated


ti.register_grad(dtensor_update_aliases_prim, _update_aliases_grad)


# ---------------------------------------------------------------------------------------------------------
# In-place symbols: new value (eager's in-place op on a copy), then the copy into the destination
# ---------------------------------------------------------------------------------------------------------
def _fresh_copy(a: Any) -> Any:
    # not a.clone(): eager's clone of a Partial DTensor reduces it (an all_reduce, and Replicate placements)
    return torch.empty_like(a).copy_(a)


#: A copy of a DTensor in its own placements, without communication (the snapshot of a destination).
dtensor_snapshot_prim = define_dtensor_prim("snapshot", _fresh_copy)


def _on_a_copy(torch_fn: Callable) -> Callable:
    """``torch_fn`` applied to a copy of its first argument; returns that copy (setitem itself returns None)."""

    def run(a: Any, *args: Any, **kwargs: Any) -> Any:
        out = _fresh_copy(a)
        torch_fn(out, *args, **kwargs)
        return out

    return run


def _is_basic_index(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, slice)) for k in keys)


def _setitem(a: Any, key: Any, value: Any) -> None:
    """``a[key] = value``, refusing what eager DTensor gets silently wrong.

    Eager slices a DTensor along a sharded dim by first redistributing it; the write then lands in that
    temporary, and ``a`` keeps its old values (torch 2.13). Such a write is refused instead.
    """
    if isinstance(a, ti.DTensor) and _is_basic_index(key):
        target = a[key]
        if target.numel() > 0 and not ti.local_shards_alias(target, a):
            raise RuntimeError(
                f"setitem with index {key!r} on placements {tuple(a.placements)}: eager DTensor indexes a sharded "
                "dim on a redistributed copy, so the write would not reach the tensor; index a dim that is not "
                "sharded, or redistribute the tensor first"
            )
    a[key] = value


def _gathered(view: DTensorProxy, source: DTensorProxy) -> bool:
    """Whether DTensor took ``view`` of ``source`` on gathered data: a mesh dim sharded in ``source`` is Replicate in
    ``view``, which is then a copy."""
    return any(
        (isinstance(p, ti.Shard) or ti.is_strided_shard(p)) and isinstance(q, ti.Replicate)
        for p, q in zip(source.placements, view.placements)
    )


def _setitem_(a: Any, key: Any, value: Any) -> Any:
    """``a[key] = value``. Where DTensor takes the view ``a[key]`` on gathered data (a basic index of a sharded dim),
    eager's write lands in that copy and ``a`` keeps its old values; here it is a write into the view (``copy_``,
    ``fill_``), which the functional rewrite writes back into ``a`` (plain torch's values), as for any write into
    such a view."""
    if isinstance(a, DTensorProxy) and _is_basic_index(key):
        view = call_for_dtensor(torch.Tensor.__getitem__, a, key)
        if view.device_mesh == a.device_mesh and _gathered(view, a):
            if isinstance(value, ti.TensorProxy):
                return INPLACE_SYMBOLS["copy_"](view, value)
            return INPLACE_SYMBOLS["fill_"](view, value)
    return INPLACE_SYMBOLS["setitem_"](a, key, value)


def _gathered_by(view: ti.BoundSymbol, a: Any) -> bool:
    """Whether DTensor ran the view on gathered data: a mesh dim sharded in its input is Replicate in ``a``,
    so ``a`` is a copy, and a write into it reaches the viewed DTensor only as the rewrite writes it back
    (eager DTensor loses it silently; fuzz seeds 1424, 5007, 5022, 5043: refused before, plain torch's values
    now)."""
    if not isinstance(a, DTensorProxy):
        return False
    source = next((x for x in view.flat_proxy_args if isinstance(x, DTensorProxy)), None)
    if source is None or source.device_mesh != a.device_mesh:
        return False
    return _gathered(a, source)


def inplace_symbol(name: str, torch_fn: Callable, meta: Callable | None = None) -> ti.Symbol:
    """The torch-level dtensor symbol for the in-place op ``name`` (one per name); ``torch_fn`` writes its 1st arg.

    ``meta`` replaces the value prim's fake run (``torch_fn`` on a copy), as in :func:`define_dtensor_prim`.
    """
    symbol = INPLACE_SYMBOLS.get(name)
    if symbol is not None:
        return symbol
    value_prim = VALUE_PRIMS[name] = define_dtensor_prim(name, _on_a_copy(torch_fn), meta=meta)
    return _define_inplace_symbol(name, value_prim, snapshot=name not in _GRADIENT_READS_NO_VALUES)


def _define_inplace_symbol(name: str, value_of: Callable, *, snapshot: bool) -> ti.Symbol:
    """The in-place symbol ``name``: the destination's new value ``value_of(a, *args, **kwargs)`` (dtensor symbols
    or prims), then the copy into it; ``snapshot``: the value's gradient reads the destination's old value."""

    def inplace(a, *args, **kwargs):
        grad_enabled = ti.grad_enabled_while_tracing()
        source = dtensor_snapshot_prim(a) if snapshot and grad_enabled and isinstance(a, DTensorProxy) else a
        return dtensor_copy__prim(value_of(source, *args, **kwargs), a, grad_enabled=grad_enabled)

    inplace.__name__ = f"dtensor_{name}"
    symbol = INPLACE_SYMBOLS[name] = ti.inplace_torchsymbol(inplace.__name__)(inplace)
    return symbol


def _add_or_sub_vjp(sign: int) -> Callable:
    """``a.add_(b, alpha=alpha)``: the gradient passes to ``a`` and, scaled by ``±alpha``, to ``b``.

    Dedicated rather than generic: the generic rule would recompute the op, redistribution of ``b`` included.
    """

    def vjp(g, out, a, b, *, alpha=1):
        scale = sign * (ti.pyval(alpha) if isinstance(alpha, ti.NumberProxy) else alpha)
        return g, grad_for_operand(g if scale == 1 else dtensor_mul_prim(g, scale), b)

    return vjp


def _mul_vjp(g, out, a, b):
    # ``a`` is the destination's value before the write (its snapshot under grad mode); eager's autograd records
    # the op above DTensor's redistribution of ``b``, so ``g * b`` is placed by DTensor from ``b`` as it was
    grad_b = grad_for_operand(dtensor_mul_prim(g, a), b) if isinstance(b, ti.TensorProxy) else None
    return grad_for_operand(dtensor_mul_prim(g, b), a), grad_b


for _name, _write in (("add_", torch.Tensor.add_), ("sub_", torch.Tensor.sub_)):
    inplace_symbol(_name, _write, meta=refusing_a_number_into_a_partial_sum(_name, _on_a_copy(_write)))
inplace_symbol("mul_", torch.Tensor.mul_)
define_vjp(VALUE_PRIMS["add_"])(_add_or_sub_vjp(1))
define_vjp(VALUE_PRIMS["sub_"])(_add_or_sub_vjp(-1))
define_vjp(VALUE_PRIMS["mul_"])(_mul_vjp)


def _copy_(a, src, non_blocking=False):
    return dtensor_copy__prim(src, a, grad_enabled=ti.grad_enabled_while_tracing())


_copy_.__name__ = "dtensor_copy_"
INPLACE_SYMBOLS["copy_"] = ti.inplace_torchsymbol("dtensor_copy_")(_copy_)


class _MaybeInPlace:
    """A function with an ``inplace`` flag (``F.relu(x, inplace=True)``): the in-place symbol when it is set.

    It is not a symbol itself, so that the in-place symbol is the one in the trace (thunder's alias pass
    looks for its tag there). The in-place symbol runs eager's in-place op on a copy, unless one is given.
    """

    def __init__(
        self, torch_fn: Callable, index: int, out_of_place: Callable, in_place: Callable | None = None
    ) -> None:
        self.torch_fn = torch_fn
        self.index = index
        self.out_of_place = out_of_place
        self.in_place = in_place or inplace_symbol(f"functional_{torch_fn.__name__}_", torch_fn)
        self.name = f"dtensor_{torch_fn.__name__}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "inplace" in kwargs:
            inplace = kwargs["inplace"]
            plain_args, plain_kwargs = args, {k: v for k, v in kwargs.items() if k != "inplace"}
        else:
            inplace = args[self.index] if len(args) > self.index else False
            plain_args, plain_kwargs = args[: self.index] + args[self.index + 1 :], kwargs
        if inplace:
            return self.in_place(*args, **kwargs)
        return self.out_of_place(*plain_args, **plain_kwargs)


def _is_in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def _is_random(name: str) -> bool:
    return any(part in name for part in _RANDOM_NAME_PARTS)


def register_inplace_ops() -> int:
    """Route every in-place torch function / Tensor method thunder knows to its in-place symbol on DTensors."""
    count = 0
    methods = ti.thunder_methods()
    for torch_fn, entry in list(ti.torch_to_thunder_map().items()):
        name = getattr(torch_fn, "__name__", "")
        if torch_fn is torch.Tensor.__setitem__:
            name = "setitem_"
        elif not _is_in_place_name(name) or _is_random(name):
            continue
        if torch_fn in DISPATCH_TABLE or ti.thunder_symbol_of(entry) is None:
            continue
        # torch.relu_(x) and x.relu_() are one op: one symbol, named after it, run as the Tensor method
        writer = _setitem if name == "setitem_" else getattr(torch.Tensor, name, torch_fn)
        symbol = INPLACE_SYMBOLS.get(name) or inplace_symbol(name, writer)
        route = register_function_for_dtensor(torch_fn, _setitem_ if name == "setitem_" else symbol)
        if name in methods:
            route_method(name, route)
        count += 1

    # Tensor.fill_: thunder has no symbol for it (plain programs keep failing the way they did)
    if torch.Tensor.fill_ not in DISPATCH_TABLE and "fill_" not in methods:
        register_method_for_dtensor("fill_", inplace_symbol("fill_", torch.Tensor.fill_))
        count += 1

    # Functions with an ``inplace`` flag: F.relu(x, inplace=True), hence nn.ReLU(inplace=True)
    for torch_fn, entry in list(ti.torch_to_thunder_map().items()):
        name = getattr(torch_fn, "__name__", "")
        if _is_random(name) or getattr(torch.nn.functional, name, None) is not torch_fn:
            continue
        existing = DISPATCH_TABLE.get(torch_fn)
        if existing is not None and isinstance(existing.dtensor_symbol, _MaybeInPlace):
            continue
        single = ti.thunder_symbol_of(entry)
        index = None if single is None else ti.inplace_argument_index(single)
        if index is None:
            continue
        if existing is not None:
            out_of_place = existing.dtensor_symbol
        else:

            def out_of_place(*args: Any, _torch_fn: Callable = torch_fn, **kwargs: Any) -> Any:
                return fallback_prim(_torch_fn)(*args, **kwargs)

        register_function_for_dtensor(torch_fn, _MaybeInPlace(torch_fn, index, out_of_place))
        count += 1
    return count + _register_inplace_dropout()


def _inplace_dropout_value(a: Any, p: float = 0.5, training: bool = True, inplace: bool = True) -> Any:
    return dtensor_dropout(a, p, training)


def _register_inplace_dropout() -> int:
    """``F.dropout(x, inplace=True)`` (``nn.Dropout(inplace=True)``): the new value is the dropout family's own
    (its gradient reuses the drawn mask; eager's in-place op on a copy would get the generic gradient, which
    draws another mask), written into ``x``."""
    existing = DISPATCH_TABLE.get(torch.nn.functional.dropout)
    if existing is None or isinstance(existing.dtensor_symbol, _MaybeInPlace):
        return 0
    in_place = _define_inplace_symbol("functional_dropout_", _inplace_dropout_value, snapshot=False)
    maybe = _MaybeInPlace(torch.nn.functional.dropout, 3, existing.dtensor_symbol, in_place=in_place)
    register_function_for_dtensor(torch.nn.functional.dropout, maybe)
    return 1


# ---------------------------------------------------------------------------------------------------------
# Writes into views whose gradients matter, made functional (``_integration/functionalize.py``)
# ---------------------------------------------------------------------------------------------------------
def _dtensor_view_name(bsym: ti.BoundSymbol) -> str | None:
    """The torch name of the view a dtensor bound symbol takes (``getitem``, ``t``, ``mT``), or None."""
    if not ti.may_return_views(bsym.sym):
        return None
    record = PRIMS.get(bsym.sym.name)
    torch_fn = record.runtime_fn if record is not None else torch_function_of_symbol(bsym.sym)
    name = getattr(torch_fn, "__name__", None) or bsym.sym.name.removeprefix("dtensor_").removesuffix("_prim")
    return ti.normalized_view_name(name)


def _in_placements_of(value: DTensorProxy, like: DTensorProxy) -> DTensorProxy:
    """``value`` in ``like``'s placements: a write keeps the written DTensor's placements (eager's in-place op),
    and its gradient is in them too, as eager's backward of the write gives it (a copy into ``like``'s layout; a
    redistribution's backward would hand the gradient back in ``value``'s placements: fuzz seed 5022)."""
    if tuple(value.placements) == tuple(like.placements):
        return value
    return _copied(value, like)


def _copied(src: Any, like: DTensorProxy) -> DTensorProxy:
    """``src`` as ``like.copy_(src)`` writes it (``like``'s spec; eager's copy_ gradient: the destination's
    placements, reduced to the source's shape and dtype), into a new DTensor.

    DTensor (torch 2.13) has no ``copy_`` strategy into a dim sharded over more ranks than it has rows (2 rows over
    4 ranks) from other placements (fuzz seed 10570, a write into a view of such a tensor): the value is then
    redistributed to ``like``'s placements (its gradient comes back in ``src``'s)."""
    try:
        propagated_fakes("dtensor_copy__prim", _copy_on_fakes, (src, like), {})
    except DTensorOpError as error:
        if "require placement changes" not in str(error) or not isinstance(src, DTensorProxy):
            raise
        moved = call_for_dtensor(ti.DTensor.redistribute, src, src.device_mesh, list(like.placements))
        return moved if moved.dtype == like.dtype else call_for_dtensor(torch.Tensor.to, moved, like.dtype)
    return dtensor_copy__prim(src, call_for_dtensor(torch.empty_like, like), grad_enabled=False)


def _write_into_input(destination: DTensorProxy, value: DTensorProxy) -> Any:
    return INPLACE_SYMBOLS["copy_"](destination, value)


def _refuse_write(bsym: ti.BoundSymbol, why: str) -> None:
    raise DTensorOpError(
        bsym.sym.name.removeprefix("dtensor_"),
        bsym.args,
        bsym.kwargs,
        f"an in-place write into a view of a DTensor that must be written back into the viewed DTensor out of "
        f"place (its gradient matters, or DTensor took a view of the chain on gathered data, a copy), through a "
        f"view that cannot be ({why})",
        hint="write out of place (torch.cat / torch.where), or run this part under torch.no_grad()",
    )


def _slice_key(ndim: int, dim: int, start: int | None, end: int | None, step: int) -> tuple:
    return (slice(None),) * (dim % ndim) + (slice(start, end, step),)


def _slice_of(t: Any, dim: int, start: int | None, end: int | None, step: int) -> Any:
    return t[_slice_key(t.ndim, dim, start, end, step)]


def _with_part_zeroed(view: Callable, scatter: Callable) -> Callable:
    """``g`` with the part ``view(g, *args)`` zeroed, as eager's backward of a write into a view computes it (a copy
    of the gradient, that view of it zeroed in place): its placements stay the gradient's (a Partial one too).
    Where DTensor takes that view on gathered data (a copy: zeroing it would change nothing), zeros are scattered
    into the gradient out of place instead (``scatter``), the result redistributed to the gradient's placements."""

    def zeroed(g: Any, *args: Any) -> Any:
        out = _fresh_copy(g)
        part = view(out, *args)
        if not ti.local_shards_alias(part, out):  # (in the gradient's placements, where a redistribution can)
            scattered = scatter(g, torch.zeros_like(part), *args)
            if any(p.is_partial() for p in g.placements) or tuple(scattered.placements) == tuple(g.placements):
                return scattered
            return scattered.redistribute(g.device_mesh, g.placements)
        part.zero_()
        return out

    return zeroed


_ZEROES_IN_PLACE = "zeroes part of a copy of the gradient in place, as eager's backward does"
dtensor_zero_slice_prim = define_dtensor_prim(
    "zero_slice",
    _with_part_zeroed(_slice_of, torch.slice_scatter),
    differentiable=False,
    not_lowered=_ZEROES_IN_PLACE,
)
dtensor_zero_select_prim = define_dtensor_prim(
    "zero_select",
    _with_part_zeroed(torch.select, torch.select_scatter),
    differentiable=False,
    not_lowered=_ZEROES_IN_PLACE,
)
dtensor_zero_diagonal_prim = define_dtensor_prim(
    "zero_diagonal",
    _with_part_zeroed(torch.diagonal, torch.diagonal_scatter),
    differentiable=False,
    not_lowered=_ZEROES_IN_PLACE,
)


def _written_view_cotangent(cotangent: Any, role: str) -> Any:
    """Mark ``cotangent`` as one part of a functional write's cotangent (see :func:`accumulate_cotangents`)."""
    if isinstance(cotangent, DTensorProxy):
        cotangent.written_view_cotangent = role
    return cotangent


def _slice_scatter_vjp(g, out, base, src, dim=0, start=None, end=None, step=1):
    # eager's backward of a write into a slice: the gradient with the slice zeroed, and the slice of it
    grad_src = call_for_dtensor(torch.Tensor.__getitem__, g, _slice_key(g.ndim, dim, start, end, step))
    return _written_view_cotangent(dtensor_zero_slice_prim(g, dim, start, end, step), "base"), grad_src


def _select_scatter_vjp(g, out, base, src, dim, index):
    grad_base = _written_view_cotangent(dtensor_zero_select_prim(g, dim, index), "base")
    return grad_base, call_for_dtensor(torch.select, g, dim, index)


def _diagonal_scatter_vjp(g, out, base, src, offset=0, dim1=0, dim2=1):
    grad_src = call_for_dtensor(torch.diagonal, g, offset, dim1, dim2)
    return _written_view_cotangent(dtensor_zero_diagonal_prim(g, offset, dim1, dim2), "base"), grad_src


# the written tensor as a write into a view of it reads it: what flows back through the reads gathers here, to be
# summed with the scatter's cotangent as eager sums it
dtensor_read_for_a_write_prim = define_marker_prim(
    "read_for_a_write",
    lambda g, out, a: (_written_view_cotangent(g, "view"),),
    marks="the cotangent of a write's reads",
)


def _written_value_vjp(g, out, a):
    # eager's backward of a write into a view (autograd's CopySlices) runs the write's own backward on a clone of
    # that view of the gradient: DTensor's clone reduces a Partial gradient (fuzz seeds 5340, 5433: the operand's
    # gradient Replicate, as eager's, not Partial)
    return (call_for_dtensor(torch.clone, g),)


dtensor_written_value_prim = define_marker_prim(
    "written_value", _written_value_vjp, marks="the new value of a written view"
)


def _sum_written_view_cotangents(base: Any, view: Any) -> Any:
    """The two parts of a functional write's cotangent summed as eager's backward sums them: it copies what flowed
    back through the write's reads into the written part of a copy of the written tensor's cotangent, so the sum
    has that cotangent's placements (an add would take whatever placements DTensor's rule for the add picks).

    DTensor cannot redistribute a shard to a partial value (``S(n) -> P``): where the copy needs that on a mesh
    dim, the view's part is gathered there first (fuzz seed 9885 at 4 ranks: a ``mul_`` by a partial operand into
    a transposed clone, the base's cotangent ``(S(0), P)``, the reads' ``(R, S(1))``)."""
    if isinstance(base, ti.DTensor) and isinstance(view, ti.DTensor) and base.device_mesh == view.device_mesh:
        gathered = [
            ti.Replicate() if b.is_partial() and v.is_shard() else v for b, v in zip(base.placements, view.placements)
        ]
        if gathered != list(view.placements):
            view = view.redistribute(view.device_mesh, gathered)
    return torch.add(base, torch.empty_like(base).copy_(view))


# A prim: the backward's specs are propagated again from the gradients that flow (guards.propagate_gradient_specs),
# and its meta follows them where a choice made while autodiff traces the rules would not.
dtensor_sum_written_view_cotangents_prim = define_dtensor_prim(
    "sum_written_view_cotangents",
    _sum_written_view_cotangents,
    differentiable=False,
    not_lowered="eager's copy of a write's gradient into the cotangent's placements (a Partial one too)",
)


def accumulate_cotangents(a: Any, b: Any) -> Any:
    """How thunder's autodiff sums two cotangents of one value (``pointwise.accumulate_cotangents``), except the
    two parts of a write into a view made functional: the written tensor's cotangent with the written part zeroed
    (a scatter's rule) and what flowed back through the write's reads of it (``dtensor_read_for_a_write_prim``)."""
    roles = (getattr(a, "written_view_cotangent", None), getattr(b, "written_view_cotangent", None))
    if roles == ("base", "view"):
        return dtensor_sum_written_view_cotangents_prim(a, b)
    if roles == ("view", "base"):
        return dtensor_sum_written_view_cotangents_prim(b, a)
    return pointwise_accumulate_cotangents(a, b)


# Dedicated rules: the generic one runs the scatter's backward on replicated inputs (DTensor has no sharding rule
# for the pair), gathering every sharded gradient; these are eager's formulas, each op sharded as DTensor shards it.
for _scatter, _vjp in (
    (torch.slice_scatter, _slice_scatter_vjp),
    (torch.select_scatter, _select_scatter_vjp),
    (torch.diagonal_scatter, _diagonal_scatter_vjp),
):
    define_vjp(fallback_prim(_scatter))(_vjp)


#: how writes into views of DTensors are made functional: the package's dtensor symbols
DTENSOR_VIEW_WRITES = ti.ViewWriteEmitter(
    call=call_for_dtensor,
    view_name=_dtensor_view_name,
    write_into_input=_write_into_input,
    keep_layout=_in_placements_of,
    copied=_copied,
    refuse=_refuse_write,
    read_for_a_write=dtensor_read_for_a_write_prim,
    copied_by=_gathered_by,
    written_value=dtensor_written_value_prim,
)


def dtensor_alias_proxy(p: DTensorProxy) -> DTensorProxy:
    """The proxy thunder's alias updates make for a DTensor's: a DTensor proxy again (the package's root hands
    this to ``keep_dtensors_in_alias_updates``)."""
    return DTensorProxy(like=p, requires_grad=p.requires_grad)


register_inplace_ops()
