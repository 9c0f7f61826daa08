"""Immutable distribution metadata carried by a ``DTensorProxy``."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

from thunder_dtensor import _integration as ti

import torch

__all__ = ["DTensorMeta", "MaskPartial", "as_traced_placement", "contiguous_stride", "dense_stride_like"]


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (a DTensor built from a fresh local result is contiguous globally)."""
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return tuple(stride)


def dense_stride_like(shape: tuple[int, ...], like: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides of ``shape`` with its dims laid out in the order of the strides ``like`` (outermost first).

    The global stride of a DTensor whose local tensor has strides ``like``: DTensor reads a view-or-copy
    decision off the global stride, so it must describe the same layout as the local tensor's.
    """
    order = sorted(range(len(shape)), key=lambda d: (-like[d], d))
    stride = [0] * len(shape)
    size = 1
    for d in reversed(order):
        stride[d] = size
        size *= max(shape[d], 1)
    return tuple(stride)


@dataclasses.dataclass(frozen=True)
class DTensorMeta:
    """A DTensor's spec (mesh, placements, global shape, stride, dtype) plus this rank's local shard.

    The spec is torch's own ``DTensorSpec``, a hashable value; it is what the prologue checks and what
    sharding propagation consumes. ``local_stride`` is known for values read from a runtime DTensor (program
    inputs, which the prologue guards) and None where nothing fixes it (cotangent specs, zeros).
    """

    spec: Any
    local_shape: tuple[int, ...]
    local_stride: tuple[int, ...] | None = None

    @classmethod
    def from_spec(
        cls, spec: Any, local_shape: tuple[int, ...], local_stride: tuple[int, ...] | None = None
    ) -> DTensorMeta:
        ti.check(spec.tensor_meta is not None, lambda: f"DTensor spec without tensor metadata: {spec}")
        stride = None if local_stride is None else tuple(int(s) for s in local_stride)
        return cls(spec, tuple(int(s) for s in local_shape), stride)

    @property
    def mesh(self) -> Any:
        return self.spec.mesh

    @property
    def placements(self) -> tuple:
        return tuple(self.spec.placements)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.spec.tensor_meta.shape)

    @property
    def stride(self) -> tuple[int, ...]:
        return tuple(self.spec.tensor_meta.stride)

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.tensor_meta.dtype

    def describe(self) -> str:
        return f"mesh={self.mesh}, placements={self.placements}"

    def spec_repr(self) -> str:
        """The string the prologue compares with the runtime spec: mesh (device type, ranks, dim names),
        placements, shard order, global shape, stride and dtype (see ``canonical_spec_repr``)."""
        return ti.canonical_spec_repr(self.spec)

    def as_cotangent(self) -> DTensorMeta:
        """The spec of this value's cotangent: a Partial value's cotangent is a full (Replicate) value.

        This matches eager DTensor, whose gradients of Partial values are Replicate.
        """
        if not any(p.is_partial() for p in self.placements):
            return self
        return DTensorMeta(ti.spec_without_partials(self.spec), self.local_shape)


class MaskPartial(ti.Partial):
    """The placement of a vocab-parallel embedding's output: a sum pending over a mesh dim, each rank holding
    the rows of the ids in its vocabulary range and zeros elsewhere.

    Eager DTensor calls it ``_MaskPartial`` and keeps the ids' mask in a buffer on the placement, which makes
    eager's placement a per-call object. Ours is a plain value (equal by reduce op, vocabulary shape and dim;
    the masking is done by the embedding prim itself), and its reductions are the plain ``Partial``'s. It must
    not be a plain ``Partial``: DTensor's sharding rules pass a plain ``Partial(sum)`` through linear ops
    (``x * 8.0``), but reduce a masked one first (only views and reductions keep it), and code written for
    eager reads the placements that result (transformers' embedding wrapper skips its own reduction when it
    sees ``Replicate``).
    """

    # set in __init__ (the placement is frozen); annotations only
    offset_shape: torch.Size
    offset_dim: int

    def __init__(self, reduce_op: str = "sum", offset_shape: tuple[int, ...] = (), offset_dim: int = 0) -> None:
        super().__init__(reduce_op)
        object.__setattr__(self, "offset_shape", torch.Size(int(n) for n in offset_shape))
        object.__setattr__(self, "offset_dim", int(offset_dim))

    def _key(self) -> tuple:
        return (self.reduce_op, tuple(self.offset_shape), self.offset_dim)

    def __eq__(self, other: object) -> bool:
        return type(other) is MaskPartial and other._key() == self._key()

    def __hash__(self) -> int:
        # the same in every process (a string's own hash is seeded per process)
        return hash((zlib.crc32(self.reduce_op.encode()), tuple(self.offset_shape), self.offset_dim))

    def __repr__(self) -> str:
        shape = tuple(self.offset_shape)
        return f"MaskPartial(reduce_op={self.reduce_op}, offset_shape={shape}, offset_dim={self.offset_dim})"

    def __str__(self) -> str:
        return f"MP({self.reduce_op})"

    def __reduce__(self) -> tuple:
        return (MaskPartial, self._key())

    def __deepcopy__(self, memo: dict) -> MaskPartial:
        return self


def as_traced_placement(placement: Any) -> Any:
    """The placement thunder_dtensor traces for a placement of eager's: eager's ``_MaskPartial`` is
    :class:`MaskPartial`; any other placement is itself."""
    if placement.is_partial() and type(placement).__name__ == "_MaskPartial":
        return MaskPartial(placement.reduce_op, placement.offset_shape, placement.offset_dim)
    return placement
