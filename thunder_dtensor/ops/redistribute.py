"""Redistribute family: placement changes and the DTensor <-> local tensor boundary.

``x.redistribute(...)``, ``x.full_tensor()``, ``x.to_local()`` and ``DTensor.from_local(...)`` inside a
jitted function become dtensor prims, so tensor-parallel hooks (which call exactly these) trace. The
collective a redistribution needs is planned by DTensor; its gradient is eager's ``Redistribute`` backward
(``dtensor_redistribute_backward_prim``): back to the input's placements, a Partial input's gradient
Replicate unless the gradient itself is Partial there. Every keyword is honoured or refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor, register_method_for_dtensor
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol, define_vjp
from thunder_dtensor.proxy import DTensorProxy

import torch


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    return None if dtype is None else ti.dtypes.to_torch_dtype(dtype)


def _redistribute(
    a: Any, placements: tuple, *, async_op: bool = False, forward_dtype: Any = None, backward_dtype: Any = None
) -> Any:
    # the dtype keywords exist from torch 2.13 on: passed only when given (an older torch refuses them, as eager)
    dtypes = {k: _torch_dtype(v) for k, v in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype))}
    dtypes = {k: v for k, v in dtypes.items() if v is not None}
    return a.redistribute(a.device_mesh, placements, async_op=async_op, **dtypes)


dtensor_redistribute_prim = define_dtensor_prim("redistribute", _redistribute)


def _redistribute_backward(g: Any, placements: tuple, op_dtype: Any = None, out_dtype: Any = None) -> Any:
    """Eager's ``Redistribute`` backward: ``g`` (cast to ``op_dtype`` for the collective) back to the input's
    ``placements``, except that a Partial input's gradient is Replicate where ``g`` is not that same Partial (a
    replicated gradient is not made partial again, and no redistribution makes one Partial another: a
    ``Partial(sum)`` gradient of a vocab-parallel lookup's ``MaskPartial`` result, fuzz seed 16465), then cast
    to ``out_dtype``."""
    op_dtype, out_dtype = _torch_dtype(op_dtype), _torch_dtype(out_dtype)
    if op_dtype is not None and g.dtype != op_dtype:
        g = g.to(op_dtype)
    target = tuple(ti.Replicate() if p.is_partial() and q != p else p for q, p in zip(g.placements, placements))
    out = g.redistribute(g.device_mesh, target)
    return out if out_dtype is None or out.dtype == out_dtype else out.to(out_dtype)


dtensor_redistribute_backward_prim = define_dtensor_prim(
    "redistribute_backward", _redistribute_backward, differentiable=False
)


def _strided_shard_input(args: tuple, kwargs: dict) -> bool:
    """A ``_StridedShard`` input (a reshaped transposed shard): its gradient must come back with the input's
    exact spec (its shard order), which eager's backward gives and a fresh redistribute to its placements does
    not (DTensor then gathers the pointwise ops that meet it: other placements than eager's)."""
    return any(ti.is_strided_shard(p) for p in args[0].placements)


@define_vjp(dtensor_redistribute_prim, generic_when=_strided_shard_input)
def _redistribute_vjp(g, out, a, placements, *, async_op=False, forward_dtype=None, backward_dtype=None):
    # Always the prim: g is labelled with out's spec, but eager's backward may deliver it placed otherwise
    # (a view's gradient sharded where out is replicated, a Partial cotangent); the prim decides on g's actual
    # placements, as eager's backward does. The collective runs at backward_dtype (else the input's dtype).
    op_dtype = backward_dtype if backward_dtype is not None else a.dtype
    dtypes = () if op_dtype == g.dtype and a.dtype == g.dtype else (op_dtype, a.dtype)
    return (dtensor_redistribute_backward_prim(g, tuple(a.placements), *dtypes),)


def _refuse(op: str, a: Any, why: str, hint: str) -> DTensorOpError:
    return DTensorOpError(op, (a,), {}, why, hint=hint)


def _normalize_placements(a: DTensorProxy, placements: Sequence[Any] | None) -> tuple:
    placements = tuple(a.placements if placements is None else placements)
    ti.check(
        len(placements) == a.device_mesh.ndim,
        lambda: f"redistribute: {len(placements)} placements for a {a.device_mesh.ndim}-D mesh",
    )
    return tuple(ti.Shard(p.dim + a.ndim) if isinstance(p, ti.Shard) and p.dim < 0 else p for p in placements)


@define_dtensor_symbol
def dtensor_redistribute(
    a, device_mesh=None, placements=None, *, async_op=False, forward_dtype=None, backward_dtype=None
):
    if device_mesh is not None and device_mesh != a.device_mesh:
        raise _refuse(
            "DTensor.redistribute",
            a,
            f"to another device mesh ({device_mesh}), which eager DTensor does not support either",
            "redistribute on the input's own mesh; move between meshes with "
            "distribute_tensor(x.full_tensor(), other_mesh, placements)",
        )
    if placements is None:
        raise _refuse("DTensor.redistribute", a, "no placements given (eager requires them)", "pass placements")
    placements = _normalize_placements(a, placements)
    for current, wanted in zip(a.placements, placements):
        if wanted.is_partial() and current != wanted:
            raise _refuse(
                "DTensor.redistribute",
                a,
                f"to {wanted} from {current}: eager DTensor reserves redistributing to Partial for its own use",
                "redistribute to Replicate or Shard placements",
            )
    ti.check(isinstance(async_op, bool), lambda: f"DTensor.redistribute: async_op must be a bool, got {async_op!r}")
    # async_op: lowered, every collective's wait already sits where its result is first read; kept eager, it is
    # passed on. The dtypes go to the prim only when given, so that the common call's trace stays short.
    kwargs = {"async_op": True} if async_op else {}
    if forward_dtype is not None:
        kwargs["forward_dtype"] = ti.dtypes.to_dtype(forward_dtype)
    if backward_dtype is not None:
        kwargs["backward_dtype"] = ti.dtypes.to_dtype(backward_dtype)
    same_dtype = forward_dtype is None or ti.dtypes.to_dtype(forward_dtype) == a.dtype
    if placements == tuple(a.placements) and not a.requires_grad and same_dtype:
        return a
    # eager's Redistribute runs (and its backward redistributes the gradient to the input's placements) even
    # when the placements are already the requested ones
    return dtensor_redistribute_prim(a, placements, **kwargs)


@define_dtensor_symbol
def dtensor_full_tensor(a, *, grad_placements=None):
    replicated = dtensor_redistribute(a, None, [ti.Replicate()] * a.device_mesh.ndim)
    return dtensor_to_local(replicated, grad_placements=grad_placements)


# to_local / from_local move no data: their generic (recomputing) gradient is eager's backward, cheaply.
dtensor_to_local_prim = define_dtensor_prim(
    "to_local", lambda a, grad_placements=None: a.to_local(grad_placements=grad_placements)
)
dtensor_from_local_prim = define_dtensor_prim(
    "from_local", lambda *args, **kwargs: ti.DTensor.from_local(*args, **kwargs)
)


@define_dtensor_symbol
def dtensor_to_local(a, *, grad_placements=None):
    return dtensor_to_local_prim(a, grad_placements=None if grad_placements is None else tuple(grad_placements))


def _check_local(local: Any, device_mesh: Any, placements: tuple, shape: Any = None, stride: Any = None) -> Any:
    # eager's run_check, on the local tensor itself: every rank's metadata compared, a Replicate dim's data
    # broadcast from the dim's first rank (in place, as eager writes into the tensor it is given)
    ti.DTensor.from_local(local, device_mesh, placements, run_check=True, shape=shape, stride=stride)
    return local


def _check_local_meta(local: Any, device_mesh: Any, placements: tuple, shape: Any = None, stride: Any = None) -> Any:
    return ti.TensorProxy(like=local)


#: ``DTensor.from_local(..., run_check=True)``'s check: eager code (c10d's object gather and broadcast) at run
#: time; its gradient passes through, as eager's backward of from_local communicates nothing for the check
dtensor_from_local_check_prim = define_dtensor_prim(
    "from_local_check",
    _check_local,
    meta=_check_local_meta,
    not_lowered="run_check compares metadata and broadcasts with c10d (eager's collectives)",
)


@define_vjp(dtensor_from_local_check_prim)
def _check_local_vjp(g, out, local, device_mesh, placements, shape=None, stride=None):
    return (g,)


@define_dtensor_symbol
def dtensor_from_local(
    local, device_mesh=None, placements=None, *, run_check=False, shape=None, stride=None, grad_placements=None
):
    if not isinstance(local, ti.TensorProxy) or isinstance(local, DTensorProxy):
        raise DTensorOpError(
            "DTensor.from_local",
            (local,) if isinstance(local, DTensorProxy) else (),
            {},
            f"takes a local torch.Tensor, got {type(local).__name__}",
            hint="pass the local shard (x.to_local() of a DTensor)",
        )
    if device_mesh is None:
        raise DTensorOpError(
            "DTensor.from_local",
            (),
            {},
            "no device_mesh given (eager would read the ambient mesh context, which a trace does not check)",
            hint="pass device_mesh explicitly",
        )
    placements = tuple(placements) if placements is not None else (ti.Replicate(),) * device_mesh.ndim
    shape = None if shape is None else tuple(shape)
    stride = None if stride is None else tuple(stride)
    if run_check:
        local = dtensor_from_local_check_prim(local, device_mesh, placements, shape, stride)
    kwargs = {"run_check": False, "shape": shape, "stride": stride}
    if grad_placements is not None:  # (a keyword of torch >= 2.13's from_local: passed only when given)
        kwargs["grad_placements"] = tuple(grad_placements)
    return dtensor_from_local_prim(local, device_mesh, placements, **kwargs)


def _register() -> None:
    register_function_for_dtensor(ti.DTensor.from_local, dtensor_from_local, always=True)
    for name, symbol in {
        "redistribute": dtensor_redistribute,
        "to_local": dtensor_to_local,
        "full_tensor": dtensor_full_tensor,
    }.items():
        register_method_for_dtensor(name, symbol)


_register()
