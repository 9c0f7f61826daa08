"""Runtime guards: the prologue's spec checks and the backward's cotangent-spec check."""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.executor import dtensor_ex
from thunder_dtensor.proxy import DTensorProxy

__all__ = ["check_dtensor_spec_repr", "check_dtensor_local_metadata", "dtensor_cotangent_to_spec_prim"]


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


# --- check_dtensor_spec_repr: the prologue's check of mesh, placements, global shape, stride and dtype -----
def _check_dtensor_spec_repr_meta(spec: ti.AnyProxy, expected: str) -> None:
    ti.check(isinstance(expected, str), lambda: f"expected a spec repr string, got {type(expected)}")


def _check_dtensor_spec_repr_impl(spec: Any, expected: str) -> None:
    actual = ti.canonical_spec_repr(spec)  # memoised: one dict probe per call
    if actual != expected:
        raise RuntimeError(f"DTensor spec changed: traced for {expected}, called with {actual}")


check_dtensor_spec_repr = ti.make_prim(
    "thunder_dtensor.check_dtensor_spec_repr",
    "check_dtensor_spec_repr",
    meta=_check_dtensor_spec_repr_meta,
    tags=(ti.OpTags.DONT_DCE,),
)
# The prologue runs only thunder's python executor plus "always" executors, and keeps a symbol that already
# names its executor: the prologue therefore records these executor operators directly.
_run_check_dtensor_spec_repr = dtensor_ex.register_operator(
    "check_dtensor_spec_repr", like=check_dtensor_spec_repr, fn=_check_dtensor_spec_repr_impl
)
dtensor_ex.register_implementation(check_dtensor_spec_repr, _run_check_dtensor_spec_repr, checker=_always)


# --- check_dtensor_local_metadata: the local shard's shape, dtype and device ------------------------------
def _check_local_meta(local: ti.TensorProxy, shape: tuple, dtype: Any, device: str) -> None:
    ti.check(isinstance(local, ti.TensorProxy), lambda: f"expected a tensor proxy, got {type(local)}")


def _check_local_impl(local: Any, shape: tuple, dtype: Any, device: str) -> None:
    if tuple(local.shape) != shape or local.dtype != dtype or str(local.device) != device:
        raise RuntimeError(
            f"DTensor local tensor changed: traced for {shape} {dtype} {device}, "
            f"called with {tuple(local.shape)} {local.dtype} {local.device}"
        )


check_dtensor_local_metadata = ti.make_prim(
    "thunder_dtensor.check_dtensor_local_metadata",
    "check_dtensor_local_metadata",
    meta=_check_local_meta,
    tags=(ti.OpTags.DONT_DCE,),
)
_run_check_dtensor_local_metadata = dtensor_ex.register_operator(
    "check_dtensor_local_metadata", like=check_dtensor_local_metadata, fn=_check_local_impl
)
dtensor_ex.register_implementation(check_dtensor_local_metadata, _run_check_dtensor_local_metadata, checker=_always)


def add_prologue_spec_checks(prim: Any, prologue_trace: ti.TraceCtx, args: tuple) -> bool:
    """thunder's prologue hook: expand our DTensor input constraint into spec and local-tensor checks."""
    if prim is not check_dtensor_spec_repr:
        return False
    dtensor, _runtime_spec = args
    ti.check(isinstance(dtensor, DTensorProxy), lambda: f"expected a DTensorProxy, got {type(dtensor)}")
    spec = ti.AnyProxy(_runtime_spec, prefix="dtensor_spec")
    prologue_trace.bound_symbols.append(ti.bind_unpack_dtensor_spec(dtensor, spec))
    _run_check_dtensor_spec_repr(spec, dtensor.meta.spec_repr())

    local = ti.TensorProxy(
        prefix="local", shape=dtensor.local_shape, dtype=dtensor.dtype, device=dtensor.device, requires_grad=False
    )
    prologue_trace.bound_symbols.append(ti.bind_unpack_local_tensor(dtensor, local))
    torch_device = str(ti.devices.to_torch_device(dtensor.device))
    _run_check_dtensor_local_metadata(local, dtensor.local_shape, ti.dtypes.to_torch_dtype(dtensor.dtype), torch_device)
    return True


# --- the backward's cotangents: traced for one spec, they may arrive with another -------------------------
def _cotangent_meta(ct: DTensorProxy, spec: Any) -> DTensorProxy:
    return DTensorProxy(like=ct)


def _cotangent_impl(ct: Any, spec: Any) -> Any:
    if ti.dtensor_spec(ct) == spec:
        return ct
    # Same global value, other placements: move it to the placements the backward was traced for.
    # DTensor does not redistribute to Partial publicly; Replicate -> Partial is local arithmetic: a sum
    # over n equal shares of v/n is v (avg, max and min of equal values are the value itself).
    staged = tuple(ti.Replicate() if p.is_partial() else p for p in spec.placements)
    ct = ct.redistribute(spec.mesh, staged) if tuple(ct.placements) != staged else ct
    if staged == tuple(spec.placements):
        return ct
    local = ct.to_local()
    for mesh_dim, p in enumerate(spec.placements):
        if p.is_partial() and p.reduce_op == "sum":
            local = local / spec.mesh.size(mesh_dim)
    return ti.dtensor_from_local_unchecked(local, spec)


dtensor_cotangent_to_spec_prim = ti.make_prim(
    "thunder_dtensor.dtensor_cotangent_to_spec_prim", "dtensor_cotangent_to_spec_prim", meta=_cotangent_meta
)
# Bound directly into backward traces that may already have been through executor selection.
_run_dtensor_cotangent_to_spec = dtensor_ex.register_operator(
    "dtensor_cotangent_to_spec_prim", like=dtensor_cotangent_to_spec_prim, fn=_cotangent_impl
)
dtensor_ex.register_implementation(dtensor_cotangent_to_spec_prim, _run_dtensor_cotangent_to_spec, checker=_always)


def match_cotangent_specs(backward_trace: ti.TraceCtx) -> ti.TraceCtx:
    """Insert a spec match for each DTensor cotangent right after the backward unpacks them."""
    new_trace = ti.from_trace(backward_trace)
    swap: dict = {}
    bsyms = []
    for bsym in backward_trace.bound_symbols:
        if swap:
            bsym = bsym.from_bsym_swap_proxies(swap)
        bsyms.append(bsym)
        if not ti.is_unpack_cotangents(bsym):
            continue
        for ct in bsym.flat_outs:
            if isinstance(ct, DTensorProxy):
                with ti.tracectx(new_trace):
                    matched = DTensorProxy(like=ct)
                bsyms.append(_run_dtensor_cotangent_to_spec.bind(ct, ct.meta.spec, output=matched))
                swap[ti.variableify(ct)] = matched
    new_trace.bound_symbols = bsyms
    return new_trace


def make_cotangent_proxy(a: Any) -> DTensorProxy | None:
    """The cotangent proxy of a DTensor value (None for other values: thunder's default applies)."""
    if not isinstance(a, DTensorProxy):
        return None
    return DTensorProxy(meta=a.meta.as_cotangent(), device=a.device, requires_grad=a.requires_grad)
