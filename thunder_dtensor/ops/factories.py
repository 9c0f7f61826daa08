"""Factories: tensors made from a DTensor's spec (zeros_like & co.), autodiff's zero cotangents, and DTensor's
own factories (``torch.distributed.tensor.zeros / ones / full / empty / rand / randn`` with a mesh and
placements) inside a program.

DTensor's factories make each rank's local tensor directly (no communication). ``zeros`` / ``ones`` / ``full``
/ ``empty`` are lowered like any prim (the local factory call, traced with DTensor's own code). ``rand`` /
``randn`` draw from eager DTensor's RNG tracker, which exists for CUDA-like meshes only (eager raises on a cpu
mesh): they run as eager's factory at run time, and are refused on a cpu mesh. Every keyword is honoured or
refused by name: ``requires_grad=True`` (a new autograd leaf inside the program, whose gradient thunder cannot
hand back) and a ``layout`` other than ``torch.strided`` (eager refuses it too) are refused, as is a missing
``device_mesh`` (eager would read the ambient mesh context, which a trace does not guard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol, to_torch_value
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import DTensorMeta, contiguous_stride

import torch


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


def _like(name: str, torch_fn: Any) -> None:
    prim = define_dtensor_prim(name, torch_fn, differentiable=False)

    def like(a, *args, **kwargs):
        return prim(a, *args, **kwargs)

    like.__name__ = f"dtensor_{name}"
    register_function_for_dtensor(torch_fn, define_dtensor_symbol(like))


_like("zeros_like", torch.zeros_like)
_like("ones_like", torch.ones_like)
_like("full_like", torch.full_like)
_like("empty_like", torch.empty_like)
_like("rand_like", torch.rand_like)
_like("randn_like", torch.randn_like)


# --- DTensor's factories: torch.distributed.tensor.zeros(*size, device_mesh=..., placements=...) & co. ---------
def _size_of(size: tuple) -> tuple[int, ...]:
    """``*size`` as eager's factories take it: ints, or one sequence of them."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(to_torch_value(s)) for s in size)


def _factory_arguments(
    op: str, size: tuple, dtype: Any, layout: Any, requires_grad: bool, device_mesh: Any, placements: Any
) -> tuple:
    """``(size, torch dtype, mesh, placements)`` of a DTensor factory call, or a :class:`DTensorOpError` naming
    the keyword that cannot be honoured inside a program."""

    def refuse(why: str, hint: str) -> DTensorOpError:
        return DTensorOpError(op, (), {}, f"{why} (size {list(size)}, placements {placements})", hint=hint)

    if device_mesh is None:
        raise refuse(
            "no device_mesh given: eager would read the ambient mesh context, which a trace does not check",
            "pass device_mesh explicitly",
        )
    if requires_grad:
        raise refuse(
            "requires_grad=True makes a new autograd leaf inside the program; thunder differentiates with respect "
            "to the program's inputs and cannot hand that leaf's gradient back",
            "create the DTensor outside the program and pass it in (or drop requires_grad)",
        )
    if layout not in (None, torch.strided):
        raise refuse(f"layout {layout} (eager DTensor supports torch.strided only)", "use layout=torch.strided")
    placements = tuple(placements) if placements is not None else (ti.Replicate(),) * device_mesh.ndim
    if len(placements) != device_mesh.ndim:
        raise refuse(f"{len(placements)} placements for a {device_mesh.ndim}-D mesh", "give one placement per mesh dim")
    dtype = ti.dtypes.to_torch_dtype(dtype) if dtype is not None else torch.get_default_dtype()
    return size, dtype, device_mesh, placements


def _factory_prim(name: str, factory: Callable, *, random: bool = False) -> ti.Symbol:
    def run(size: tuple, *args: Any, dtype: Any, device_mesh: Any, placements: tuple) -> Any:
        return factory(
            size, *args, dtype=ti.dtypes.to_torch_dtype(dtype), device_mesh=device_mesh, placements=placements
        )

    run.__name__ = f"dtensor_factory_{name}"
    if not random:
        return define_dtensor_prim(f"factory_{name}", run, differentiable=False)

    def meta(size: tuple, *, dtype: Any, device_mesh: Any, placements: tuple) -> DTensorProxy:
        # the spec eager's factory gives, computed without drawing: a draw at trace time would advance eager's
        # RNG tracker
        # (a tuple for torch's torch.Size, as the spec's; ``make`` gave a dtype)
        tensor_meta = ti.TensorMeta(
            size,  # type: ignore[arg-type]
            contiguous_stride(size),
            cast(torch.dtype, ti.dtypes.to_torch_dtype(dtype)),
        )
        spec = ti.make_spec(device_mesh, placements, tensor_meta)
        local_shape = ti.local_shape_on(size, device_mesh, placements)
        # eager's factory allocates on the mesh's device type, at the current device of that type
        handle: Any = getattr(torch, device_mesh.device_type, None)
        index = handle.current_device() if hasattr(handle, "current_device") else None
        index = index if isinstance(index, int) else None
        # (torch's stub wants an int index; None, the current device, is what torch.device takes too)
        device = ti.devices.to_device(torch.device(device_mesh.device_type, index))  # type: ignore[arg-type]
        return DTensorProxy(meta=DTensorMeta.from_spec(spec, local_shape), device=device, requires_grad=False)

    return define_dtensor_prim(
        f"factory_{name}",
        run,
        meta=meta,
        differentiable=False,
        not_lowered="it draws random numbers with eager DTensor's RNG tracker",
    )


def _register_factory(name: str, factory: Callable, *, fill: bool = False, random: bool = False) -> None:
    prim = _factory_prim(name, factory, random=random)
    op = f"torch.distributed.tensor.{name}"

    def make(size, fill_value, dtype, layout, requires_grad, device_mesh, placements):
        size, dtype, mesh, placements = _factory_arguments(
            op, size, dtype, layout, requires_grad, device_mesh, placements
        )
        if random and mesh.device_type == "cpu":
            raise DTensorOpError(
                op,
                (),
                {},
                f"on a cpu mesh (size {list(size)}, placements {placements}): eager DTensor's random factories "
                "draw with its RNG tracker, which supports CUDA-like meshes only (eager raises an AssertionError)",
                hint=f"draw the full tensor with torch.{name}(...) and distribute_tensor it, or draw the local "
                "shard and wrap it with DTensor.from_local",
            )
        args = (to_torch_value(fill_value),) if fill else ()
        dtype = ti.dtypes.to_dtype(dtype)
        return prim(size, *args, dtype=dtype, device_mesh=mesh, placements=placements)

    if fill:

        def factory_symbol(
            size,
            fill_value,
            *,
            dtype=None,
            layout=torch.strided,
            requires_grad=False,
            device_mesh=None,
            placements=None,
        ):
            return make(_size_of((size,)), fill_value, dtype, layout, requires_grad, device_mesh, placements)

    else:  # (the factories' own signatures: mypy wants the variants of a conditional def alike)

        def factory_symbol(  # type: ignore[misc]
            *size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None
        ):
            return make(_size_of(size), None, dtype, layout, requires_grad, device_mesh, placements)

    factory_symbol.__name__ = f"dtensor_factory_{name}"
    register_function_for_dtensor(factory, define_dtensor_symbol(factory_symbol), always=True)


def _register_factories() -> None:
    import torch.distributed.tensor as dtensor_api

    for name in ("zeros", "ones", "empty"):
        _register_factory(name, getattr(dtensor_api, name))
    _register_factory("full", dtensor_api.full, fill=True)
    for name in ("rand", "randn"):
        _register_factory(name, getattr(dtensor_api, name), random=True)


_register_factories()
