"""Defining a dtensor prim: its meta, its execution and its grad rule, registered in one place.

A dtensor prim wraps one torch operation on DTensors. Its meta runs that operation on fake DTensors, so
the output spec comes from DTensor's own sharding propagation (and an input combination DTensor rejects
fails here, at trace time, with the same cause). Its execution, on :data:`dtensor_ex`, runs the same
operation on the runtime DTensors. Its grad rule is written with other dtensor prims, next to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from thunder_dtensor import _integration as ti
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.executor import dtensor_ex
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import DTensorMeta

__all__ = [
    "define_dtensor_prim",
    "define_vjp",
    "propagate_on_fake_dtensors",
    "to_torch_value",
    "DTENSOR_PRIMS",
]

#: Every dtensor prim by name, for introspection, docs and tests.
DTENSOR_PRIMS: dict[str, ti.Symbol] = {}


def to_torch_value(x: Any) -> Any:
    """Map thunder's dtype/device values and number proxies to what torch functions take."""
    if isinstance(x, ti.dtypes.dtype):
        return ti.dtypes.to_torch_dtype(x)
    if isinstance(x, ti.devices.Device):
        return ti.devices.to_torch_device(x)
    if isinstance(x, ti.NumberProxy):
        return ti.pyval(x)
    return x


def _to_fake(x: Any) -> Any:
    if isinstance(x, DTensorProxy):
        return x.meta.fake_dtensor(ti.devices.to_torch_device(x.device), requires_grad=False)
    if isinstance(x, ti.TensorProxy):
        return torch.empty(x.shape, dtype=ti.dtypes.to_torch_dtype(x.dtype), device=ti.devices.to_torch_device(x.device))
    return to_torch_value(x)


def _to_proxy(x: Any, requires_grad: bool) -> Any:
    if ti.DISTRIBUTED_AVAILABLE and isinstance(x, ti.DTensor):
        local = ti.local_tensor(x)
        meta = DTensorMeta.from_spec(ti.dtensor_spec(x), tuple(local.shape))
        return DTensorProxy(meta=meta, device=ti.devices.to_device(x.device), requires_grad=requires_grad)
    if isinstance(x, torch.Tensor):
        return ti.TensorProxy(
            shape=tuple(x.shape),
            dtype=ti.dtypes.to_dtype(x.dtype),
            device=ti.devices.to_device(x.device),
            requires_grad=requires_grad,
        )
    return x


def propagate_on_fake_dtensors(op_name: str, torch_fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``torch_fn`` on fake DTensors shaped like the proxies; return proxies for its outputs."""
    flat, _ = ti.tree_flatten((args, kwargs))
    requires_grad = any(isinstance(a, ti.TensorProxy) and a.requires_grad for a in flat)
    with ti.fake_tensor_mode():
        fake_args, fake_kwargs = ti.tree_map(_to_fake, (args, kwargs))
        try:
            out = torch_fn(*fake_args, **fake_kwargs)
        except Exception as e:  # DTensor's own rejection, reported with our context
            raise DTensorOpError(op_name, args, kwargs, f"{type(e).__name__}: {e}") from e
    return ti.tree_map(lambda o: _to_proxy(o, requires_grad), out)


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


def define_dtensor_prim(
    name: str,
    torch_fn: Callable,
    *,
    meta: Callable | None = None,
    execute: Callable | None = None,
) -> ti.Symbol:
    """Create ``dtensor_<name>_prim`` and register its execution on the dtensor executor.

    ``torch_fn`` is the torch operation on DTensors; by default it is both the meta's fake run and the
    runtime implementation. ``meta`` and ``execute`` override them where the two differ (a prim that
    takes thunder dtypes, say).
    """
    prim_name = f"dtensor_{name}_prim"
    runtime_fn = execute or torch_fn

    def _meta(*args: Any, **kwargs: Any) -> Any:
        if meta is not None:
            return meta(*args, **kwargs)
        return propagate_on_fake_dtensors(prim_name, torch_fn, args, kwargs)

    _meta.__name__ = prim_name
    prim = ti.make_prim(f"thunder_dtensor.{prim_name}", prim_name, meta=_meta)
    op = dtensor_ex.register_operator(prim_name, like=prim, fn=runtime_fn)
    dtensor_ex.register_implementation(prim, op, checker=_always)
    DTENSOR_PRIMS[prim_name] = prim
    return prim


def define_vjp(prim: ti.Symbol) -> Callable[[Callable], Callable]:
    """Register the decorated ``vjp(g, out, *args, **kwargs) -> grads`` as ``prim``'s grad rule.

    ``grads`` holds one entry per positional argument (None where there is no gradient). The rule is
    written with dtensor prims, so gradients get the placements DTensor's propagation gives them, as in
    eager DTensor's backward.
    """

    def register(vjp: Callable) -> Callable:
        def grad_rule(*args: Any, **kwargs: Any) -> Any:
            out = prim(*args, **kwargs)
            g = ti.get_grad(out)
            grads = vjp(g, out, *args, **kwargs)
            for arg, grad in zip(args, grads):
                if isinstance(arg, ti.TensorProxy) and grad is not None:
                    ti.put_grad(arg, grad)
            return out

        ti.register_grad(prim, grad_rule)
        return vjp

    return register


def tensor_args(args: Sequence[Any]) -> list[ti.TensorProxy]:
    return [a for a in args if isinstance(a, ti.TensorProxy)]


def define_dtensor_symbol(fn: Callable) -> ti.Symbol:
    """A torch-level dtensor symbol (``dtensor_mul``): it decomposes into dtensor prims in the trace.

    An output that is one of the inputs (``x.float()`` on a float DTensor) becomes a dtensor alias: thunder
    would otherwise insert its single-device ``shallow_copy``, which loses the DTensor.
    """

    @functools.wraps(fn)
    def with_fresh_outputs(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        inputs = {id(a) for a in ti.tree_flatten((args, kwargs))[0] if isinstance(a, DTensorProxy)}
        return ti.tree_map(lambda o: dtensor_alias_prim(o) if id(o) in inputs else o, out)

    return ti.torchsymbol(fn.__name__)(with_fresh_outputs)


dtensor_alias_prim = define_dtensor_prim("alias", lambda a: a.view_as(a))


@define_vjp(dtensor_alias_prim)
def _alias_vjp(g, out, a):
    return (g,)
