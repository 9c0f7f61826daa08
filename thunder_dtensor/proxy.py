"""``DTensorProxy``: how a DTensor appears in thunder's traces."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.errors import READ_AT_RUN_TIME_HINT, DataDependentIndexError, DataDependentValueError
from thunder_dtensor.spec import DTensorMeta

import torch

__all__ = ["DTensorProxy", "is_dtensor_proxy", "is_zero_cotangent_of", "proxify_dtensor", "proxy_for_value"]


class DTensorProxy(ti.TensorProxy):
    """A ``TensorProxy`` for a DTensor.

    Its ``shape`` is the global shape (as ``DTensor.shape`` is); the distribution lives in ``meta``: mesh,
    placements, stride and the local shape of this rank's shard. The meta is an immutable value, so proxies
    made with ``like=`` (cotangents, renamed copies) share it.
    """

    _DEFAULT_PREFIX = "dtensor_"

    def __init__(self, name: str | None = None, *, meta: DTensorMeta | None = None, like: Any = None, **kwargs: Any):
        if meta is None:
            ti.check(isinstance(like, DTensorProxy), lambda: "DTensorProxy needs meta= or like=<DTensorProxy>")
            meta = like.meta
        if like is None:
            kwargs.setdefault("shape", meta.shape)
            kwargs.setdefault("dtype", ti.dtypes.to_dtype(meta.dtype))
        super().__init__(name, like=like, **kwargs)
        ti.check(
            tuple(self._shape) == meta.shape,
            lambda: f"DTensorProxy shape {tuple(self._shape)} does not match its spec's global shape {meta.shape}",
        )
        self.meta: DTensorMeta = meta
        ti.use_dtensor_executors()  # the program being compiled traces a DTensor: its prims need our executors
        #: made by autodiff as the zero cotangent of a value nothing flows back to (ops/factories.py)
        self.is_zero_cotangent: bool = False
        #: a cotangent of a write into a view made functional (ops/inplace.py): "base" (the written tensor's
        #: cotangent with the written part zeroed) or "view" (what flowed back through the write's reads of it)
        self.written_view_cotangent: str | None = None

    @property
    def device_mesh(self) -> Any:
        return self.meta.mesh

    @property
    def placements(self) -> tuple:
        return self.meta.placements

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.meta.local_shape

    def stride(self, dim: int | None = None) -> tuple[int, ...] | int:
        """``DTensor.stride()``: the global stride of the spec (guarded by the prologue for program inputs,
        given by DTensor's sharding propagation for the values it computes), a constant of the trace."""
        stride = self.meta.stride
        return stride if dim is None else stride[dim]

    # Reading a DTensor's data into Python at trace time: refused where plain thunder refuses it for a
    # TensorProxy, with the op, the placements and what to do instead (see ops/scalars.py).
    def _refuse_read(self, conversion: str, error: type = DataDependentValueError) -> DataDependentValueError:
        return error(
            f"Tensor.{conversion}",
            (self,),
            {},
            f"{conversion[2:-2]}(x) reads the DTensor's data into a Python value, which a trace cannot fix",
            hint=READ_AT_RUN_TIME_HINT,
        )

    def __bool__(self) -> bool:
        raise self._refuse_read("__bool__")

    def __float__(self) -> float:
        raise self._refuse_read("__float__")

    def __int__(self) -> int:
        raise self._refuse_read("__int__")

    def __complex__(self) -> complex:
        raise self._refuse_read("__complex__")

    def __index__(self) -> int:
        raise self._refuse_read("__index__", DataDependentIndexError)

    def type_string(self) -> str:
        return f"DTensor {self.device.device_str()} {self.dtype.shortname()}{list(self._shape)} {self.meta.describe()}"

    def __repr__(self) -> str:
        return f'<DTensorProxy(name="{self.name}", dtype={self.dtype}, shape={self._shape}, {self.meta.describe()})>'

    def replace(self, **changes: Any) -> DTensorProxy:
        """A copy with new name / history / tags / requires_grad; the distribution cannot change here."""
        for key in ("shape", "dtype", "device"):
            ti.check(  # (mypy cannot infer the type of a lambda with a default argument)
                key not in changes or changes[key] == getattr(self, f"_{key}"),
                lambda key=key: f"DTensorProxy.replace cannot change {key}: the DTensor spec would no longer match",  # type: ignore[misc]
            )
        like = changes.get("like")
        meta = like.meta if isinstance(like, DTensorProxy) else self.meta
        return DTensorProxy(
            name=changes.get("name", self.name),
            meta=meta,
            device=self._device,
            requires_grad=changes.get("requires_grad", self._requires_grad),
            grad=changes.get("grad", self._grad),
            history=changes.get("history", self.history),
            tags=changes.get("tags", self.tags),
        )


def is_dtensor_proxy(x: Any) -> bool:
    return isinstance(x, DTensorProxy)


def proxy_for_value(
    x: Any, *, requires_grad: bool, spec: Any = None, name: str | None = None, history: tuple | None = None
) -> Any:
    """A proxy describing the torch value ``x`` (a DTensor or a tensor, real or fake); other values as they are.

    ``spec`` replaces a DTensor's own spec. Symbolic sizes (dynamo's dynamic shapes) read as their hints.
    """
    if ti.DISTRIBUTED_AVAILABLE and isinstance(x, ti.DTensor):
        local = ti.local_tensor(x)
        local_shape = tuple(ti.size_hint(s) for s in local.shape)
        local_stride = tuple(ti.size_hint(s) for s in local.stride())  # the prologue guards it
        return DTensorProxy(
            name,
            meta=DTensorMeta.from_spec(ti.dtensor_spec(x) if spec is None else spec, local_shape, local_stride),
            device=ti.devices.to_device(x.device),
            requires_grad=requires_grad,
            history=history,
        )
    if isinstance(x, torch.Tensor):
        return ti.TensorProxy(
            name,
            shape=tuple(ti.size_hint(s) for s in x.shape),
            dtype=ti.dtypes.to_dtype(x.dtype),
            device=ti.devices.to_device(x.device),
            requires_grad=requires_grad,
            history=history,
        )
    return x


def proxify_dtensor(x: Any, name: str | None = None, history: tuple | None = None) -> DTensorProxy | None:
    """thunder's proxy() hook: a DTensorProxy for a runtime DTensor, None for anything else."""
    if not ti.DISTRIBUTED_AVAILABLE or not isinstance(x, ti.DTensor):
        return None
    return proxy_for_value(x, requires_grad=x.requires_grad, name=name, history=history)


def is_zero_cotangent_of(x: Any, *, like: Any, known: Collection[str] = ()) -> bool:
    """``x`` is a zero cotangent autodiff made (ops/factories.py), or one of the values ``known`` (by name) to be
    zero, of ``like``'s shape and dtype: summed with ``like`` it adds nothing, and eager, which has no such term,
    gives the sum ``like``'s placements."""
    return (
        isinstance(x, DTensorProxy)
        and (x.is_zero_cotangent or x.name in known)
        and isinstance(like, DTensorProxy)
        and (x.shape, x.dtype) == (like.shape, like.dtype)
    )
