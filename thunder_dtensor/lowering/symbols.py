"""The symbols of a lowered program and the two executors that run them.

One symbol per local ATen op (run as that single ATen call; thunder's fusion executors may claim it), one per
``_c10d_functional`` collective (``mesh_dim`` is printed, not passed on; thunder's torch.compile executor may
claim it too, so that one inductor graph spans the collectives), and the DTensor boundary: unwrap, wrap, a
contiguous copy of a plain tensor. Their metas run the op itself on fake tensors (torch's own shape
rules), answered from :data:`LOCAL_META_CACHE` when the pass recorded the traced node's outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.primitive import PRIMS, to_torch_value
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.signature import SignatureCache, call_signature, describe_value
from thunder_dtensor.spec import DTensorMeta, contiguous_stride

import torch

#: local ATen ops (one ATen call each); a dtensor executor, so they run whatever executors the user passes
dtensor_local_ex = ti.OperatorExecutor("dtensor_local")


ti.add_dtensor_executor(dtensor_local_ex)


#: collectives and the DTensor boundary (wrap / unwrap); thunder's fusion executors may take the collectives (and the
#: contiguous copy of a plain tensor), never the boundary
dtensor_comm_ex = ti.OperatorExecutor("dtensor_comm")


ti.add_dtensor_executor(dtensor_comm_ex)


def _fake_of(x: Any) -> Any:
    if isinstance(x, ti.TensorProxy):
        dtype, device = ti.dtypes.to_torch_dtype(x.dtype), ti.devices.to_torch_device(x.device)
        return torch.empty(tuple(x.shape), dtype=dtype, device=device)
    return to_torch_value(x)


#: a lowered op's fake outputs by call signature: its meta runs at emission and again as executors claim it
LOCAL_META_CACHE = SignatureCache("lowered op metas")


def _meta_key(overload: Any, args: tuple, kwargs: dict) -> Any:
    def describe(x: Any) -> Any:
        return ("tensor", tuple(x.shape), x.dtype, x.device) if isinstance(x, ti.TensorProxy) else describe_value(x)

    flat, tree = ti.tree_flatten((args, kwargs))
    return call_signature(overload, flat, tree, describe)


def _meta_by_fake_run(overload: Any) -> Callable:
    """The meta of a lowered op: the op itself on fake tensors (torch's own shape rules)."""

    def fake_run(args: tuple, kwargs: dict) -> Any:
        with ti.fake_tensor_mode():
            fake_args, fake_kwargs = ti.tree_map(_fake_of, (args, kwargs))
            fake_kwargs.pop("mesh_dim", None)
            return overload(*fake_args, **fake_kwargs)

    def meta(*args: Any, **kwargs: Any) -> Any:
        val = LOCAL_META_CACHE.get_or_compute(_meta_key(overload, args, kwargs), lambda: fake_run(args, kwargs))
        return output_proxies(cast(ti.TraceCtx, ti.get_tracectx()), val)  # (a meta runs inside a trace)

    return meta


def remember_meta(overload: Any, args: tuple, kwargs: dict, val: Any) -> None:
    """Keep the traced node's fake outputs as the meta's answer for this call: the executors' claim of the
    emitted op then runs no fake op again (its output shapes and dtypes are the traced ones)."""
    LOCAL_META_CACHE.remember(_meta_key(overload, args, kwargs), val)


def symbol_name(overload: Any) -> str:
    packet = overload.overloadpacket
    namespace = packet._qualified_op_name.split("::")[0]
    suffix = "" if overload._overloadname == "default" else f"_{overload._overloadname}"
    return f"{namespace}_{packet.__name__}{suffix}"


@functools.cache
def local_op_symbol(overload: Any) -> ti.Symbol:
    """The trace symbol of one ATen op on local tensors: run as that single ATen call."""
    name = symbol_name(overload)
    sym = ti.make_prim(f"thunder_dtensor.local.{name}", name, meta=_meta_by_fake_run(overload))
    # the arguments are bound as torch takes them (torch dtypes, devices): the call is the ATen op itself
    op = dtensor_local_ex.register_operator(name, like=sym, fn=overload)
    dtensor_local_ex.register_implementation(sym, op, checker=lambda *a, **k: True)
    ti.let_torch_executors_claim(sym, overload)  # plain local math: thunder's fusion executors may take it
    return sym


#: every collective symbol made so far, by name
COLLECTIVE_SYMBOLS: dict[str, ti.Symbol] = {}


@functools.cache
def collective_symbol(overload: Any) -> ti.Symbol:
    """The trace symbol of one ``_c10d_functional`` op; ``mesh_dim`` is printed, not passed on."""
    name = symbol_name(overload).removeprefix("_c10d_functional_")
    # never dead code: another rank may be receiving what this one sends, even where no result here is read; and
    # never recomputed in the backward: thunder's rematerialization (with a fusion executor listed, the torch.compile
    # one) moves ops it deems cheap from the forward to the backward, and took all-gathers for such (a third more
    # all-gathers a step in the test GPT); its one tag for "do not recompute" is REDUCTION_OP, which it alone reads
    sym = ti.make_prim(
        f"thunder_dtensor.comm.{name}",
        name,
        meta=_meta_by_fake_run(overload),
        tags=(ti.OpTags.DONT_DCE, ti.OpTags.REDUCTION_OP),
    )
    collective = ti.below_autograd(overload)

    def run(*args: Any, mesh_dim: int | None = None, **kwargs: Any) -> Any:
        return collective(*args, **kwargs)

    run.__name__ = name
    op = dtensor_comm_ex.register_operator(name, like=sym, fn=run)
    dtensor_comm_ex.register_implementation(sym, op, checker=lambda *a, **k: True)

    def traceable(*args: Any, mesh_dim: int | None = None, **kwargs: Any) -> Any:
        return overload(*args, **kwargs)

    traceable.__name__ = name
    # inductor compiles functional collectives natively (as torch.compile does DTensor programs): with thunder's
    # torch.compile executor listed, a region runs on across them and inductor fuses the local math around them
    ti.let_torch_executors_claim(sym, traceable)
    COLLECTIVE_SYMBOLS[name] = sym
    return sym


def issues_a_collective(bsym: ti.BoundSymbol) -> bool:
    """Whether ``bsym`` issues one of the lowering's collectives (its wait communicates nothing)."""
    return bsym.sym.name in COLLECTIVE_SYMBOLS and bsym.sym.name != "wait_tensor"


def may_communicate(bsym: ti.BoundSymbol) -> bool:
    """Whether running ``bsym`` may issue a collective: one of the lowering's, or a dtensor prim the lowering kept
    (it runs the eager DTensor op, whose redistributions communicate)."""
    return issues_a_collective(bsym) or bsym.sym.name in PRIMS


def _unwrap(x: Any, spec: Any, layout: bool | tuple[int, ...], *, placements: str = "") -> torch.Tensor:
    """``layout``: False reads the local tensor as it is (its strides are guarded), True makes it contiguous, and
    a tuple of strides makes it dense in that layout (an eager result whose spec says how eager lays it out)."""
    actual = ti.dtensor_spec(x)
    # autograd handed in other placements: the value, placed as traced (a layout of its own is fine: see below)
    if actual is not spec and (actual.mesh != spec.mesh or actual.placements != spec.placements):
        x = x.redistribute(spec.mesh, spec.placements)
    local = ti.local_tensor(x)
    if layout is True:
        return local.contiguous()
    if layout and not _laid_out_as(local, layout):
        return torch.empty_strided(local.shape, layout, dtype=local.dtype, device=local.device).copy_(local)
    return local


def _laid_out_as(t: torch.Tensor, stride: tuple[int, ...]) -> bool:
    """Whether ``t`` has ``stride`` on every dim where a stride matters (size above 1), as ``is_contiguous``."""
    return all(n <= 1 or s == e for n, s, e in zip(t.shape, t.stride(), stride))


def _wrap(local: torch.Tensor, spec: Any, *, placements: str = "", alias: bool = False) -> Any:
    if not alias and not local.is_contiguous() and _contiguous_globally(spec):
        # a lowered view (a slice of a gathered buffer) where eager's shard of a contiguous DTensor is contiguous:
        # eager ops after the boundary (a flatten's view) and the user's may rely on it (fuzz seed 10754); not
        # where the DTensor is an alias that a write must reach through (``alias``: fuzz seed 11599)
        local = local.contiguous()
    return ti.dtensor_around(local, spec)


def _contiguous_globally(spec: Any) -> bool:
    meta = spec.tensor_meta
    return meta is not None and tuple(meta.stride) == contiguous_stride(tuple(meta.shape))


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def _unwrap_meta(x: DTensorProxy, spec: Any, layout: bool | tuple[int, ...], *, placements: str = "") -> ti.TensorProxy:
    shape = ti.local_shape_on(tuple(x.shape), spec.mesh, tuple(spec.placements))
    return ti.TensorProxy(shape=shape, dtype=x.dtype, device=x.device, requires_grad=False)


def _wrap_meta(local: ti.TensorProxy, spec: Any, *, placements: str = "", alias: bool = False) -> DTensorProxy:
    return DTensorProxy(meta=DTensorMeta.from_spec(spec, tuple(local.shape)), device=local.device, requires_grad=False)


def _contiguous_meta(t: ti.TensorProxy) -> ti.TensorProxy:
    return ti.TensorProxy(like=t, requires_grad=False)


def _boundary_symbol(name: str, fn: Callable, meta: Callable) -> ti.Symbol:
    sym = ti.make_prim(f"thunder_dtensor.comm.{name}", name, meta=meta)
    op = dtensor_comm_ex.register_operator(name, like=sym, fn=fn)
    dtensor_comm_ex.register_implementation(sym, op, checker=lambda *a, **k: True)
    return sym


#: the local shard of a runtime DTensor, in the traced spec (made contiguous, or dense in the spec's layout, where
#: strides are unknown)
unwrap_dtensor = _boundary_symbol("unwrap_dtensor", _unwrap, _unwrap_meta)


#: a DTensor of the given spec around a local result (no communication, no autograd)
wrap_dtensor = _boundary_symbol("wrap_dtensor", _wrap, _wrap_meta)


#: a plain tensor of unknown strides entering lowered code (plain math: a fusion region may hold it)
local_contiguous = _boundary_symbol("local_contiguous", _contiguous, _contiguous_meta)
ti.let_torch_executors_claim(local_contiguous, _contiguous)


def _after(value: torch.Tensor, *issued: Any) -> torch.Tensor:
    return value


def _after_meta(value: ti.TensorProxy, *issued: Any) -> ti.TensorProxy:
    return ti.TensorProxy(like=value)


#: ``value``, once the collectives whose results are ``issued`` have run: a collective no forward output reads
#: (a ring step whose chunk this rank does not attend; other ranks receive what it sends) stays in the forward,
#: where the same collective is on a rank that reads it (thunder's split would otherwise move it to the backward)
issued_before = _boundary_symbol("issued_before", _after, _after_meta)


def output_proxies(trace: ti.TraceCtx, val: Any) -> Any:
    def proxy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ti.TensorProxy(
                shape=tuple(v.shape),
                dtype=ti.dtypes.to_dtype(v.dtype),
                device=ti.devices.to_device(v.device),
                requires_grad=False,
            )
        ti.check(v is None or isinstance(v, (int, float, bool)), lambda: f"lowering: output {v!r}")
        return v

    with ti.tracectx(trace):
        if isinstance(val, (tuple, list)):
            return tuple(proxy(v) for v in val)
        return proxy(val)
