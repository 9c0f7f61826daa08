"""Redistribute family: placement changes and the DTensor <-> local tensor boundary.

``x.redistribute(...)``, ``x.full_tensor()``, ``x.to_local()`` and ``DTensor.from_local(...)`` inside a
jitted function become dtensor prims, so tensor-parallel hooks (which call exactly these) trace. The
collective a redistribution needs is planned by DTensor at run time; its gradient is the reverse
redistribution, as in eager (a Partial input's gradient is Replicate).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol, define_vjp
from thunder_dtensor.proxy import DTensorProxy


def _redistribute(a: Any, placements: tuple) -> Any:
    return a.redistribute(a.device_mesh, placements)


dtensor_redistribute_prim = define_dtensor_prim("redistribute", _redistribute)


def grad_placements_for(placements: Sequence[Any]) -> tuple:
    """Where the gradient of a value with ``placements`` goes back to: Partial becomes Replicate."""
    return tuple(ti.Replicate() if p.is_partial() else p for p in placements)


def _strided_shard_input(args: tuple, kwargs: dict) -> bool:
    """A ``_StridedShard`` input (a reshaped transposed shard): its gradient must come back with the input's
    exact spec (its shard order), which eager's backward gives and a fresh redistribute to its placements does
    not (DTensor then gathers the pointwise ops that meet it: other placements than eager's)."""
    return any(ti.is_strided_shard(p) for p in args[0].placements)


@define_vjp(dtensor_redistribute_prim, generic_when=_strided_shard_input)
def _redistribute_vjp(g, out, a, placements):
    # Always the prim: g is labelled with out's spec, but eager's backward may deliver it placed otherwise
    # (a view's gradient sharded where out is replicated); eager's backward redistributes it to the input's.
    return (dtensor_redistribute_prim(g, grad_placements_for(a.placements)),)


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
    ti.check(
        device_mesh is None or device_mesh == a.device_mesh,
        lambda: "DTensor.redistribute to another mesh is not supported under thunder.jit",
    )
    placements = _normalize_placements(a, placements)
    if placements == tuple(a.placements) and not a.requires_grad:
        return a
    # eager's Redistribute runs (and its backward redistributes the gradient to the input's placements) even
    # when the placements are already the requested ones
    return dtensor_redistribute_prim(a, placements)


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


@define_dtensor_symbol
def dtensor_from_local(local, device_mesh=None, placements=None, *, run_check=False, shape=None, stride=None):
    ti.check(
        isinstance(local, ti.TensorProxy) and not isinstance(local, DTensorProxy),
        lambda: "DTensor.from_local takes a local torch.Tensor",
    )
    ti.check(device_mesh is not None, lambda: "DTensor.from_local under thunder.jit needs an explicit device_mesh")
    placements = tuple(placements) if placements is not None else (ti.Replicate(),) * device_mesh.ndim
    return dtensor_from_local_prim(
        local,
        device_mesh,
        placements,
        run_check=run_check,
        shape=None if shape is None else tuple(shape),
        stride=None if stride is None else tuple(stride),
    )


def _register() -> None:
    ti.register_torch_function(ti.DTensor.from_local, dtensor_from_local)
    for name, symbol in {
        "redistribute": dtensor_redistribute,
        "to_local": dtensor_to_local,
        "full_tensor": dtensor_full_tensor,
    }.items():
        ti.register_torch_function(getattr(ti.DTensor, name), symbol, method_name=name)


_register()
