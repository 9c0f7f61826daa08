"""Factories: tensors made from a DTensor's spec (zeros_like & co.), and autodiff's zero cotangents."""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import DTensorMeta

import torch

ltorch = ti.ltorch


def _zeros_with_spec(spec: Any, local_shape: tuple, device: Any) -> Any:
    local = torch.zeros(local_shape, dtype=spec.tensor_meta.dtype, device=ti.devices.to_torch_device(device))
    return ti.dtensor_from_local_unchecked(local, spec)


def _zeros_meta(spec: Any, local_shape: tuple, device: Any) -> DTensorProxy:
    return DTensorProxy(meta=DTensorMeta.from_spec(spec, local_shape), device=device)


#: zeros with a given spec: zero on every shard, so right for Shard, Replicate and Partial placements alike
dtensor_zeros_prim = define_dtensor_prim(
    "zeros", _zeros_with_spec, meta=_zeros_meta, execute=_zeros_with_spec, differentiable=False
)


def bind_zero_cotangent(output: Any) -> ti.BoundSymbol | None:
    """thunder's autodiff needs a zero cotangent for ``output``: a DTensor of its spec when it is one."""
    if not isinstance(output, DTensorProxy):
        return None
    output.is_zero_cotangent = True  # summed into another cotangent, it adds nothing (ops/pointwise.py)
    return dtensor_zeros_prim.bind(output.meta.spec, output.local_shape, output.device, output=output)


def _like(name: str, torch_fn: Any, single: Any) -> None:
    prim = define_dtensor_prim(name, torch_fn, differentiable=False)

    def like(a, *args, **kwargs):
        return prim(a, *args, **kwargs)

    like.__name__ = f"dtensor_{name}"
    register_function_for_dtensor(torch_fn, single, define_dtensor_symbol(like))


_like("zeros_like", torch.zeros_like, ltorch.zeros_like)
_like("ones_like", torch.ones_like, ltorch.ones_like)
_like("full_like", torch.full_like, ltorch.full_like)
_like("empty_like", torch.empty_like, ltorch.empty_like)
_like("rand_like", torch.rand_like, ltorch.rand_like)
_like("randn_like", torch.randn_like, ltorch.randn_like)
