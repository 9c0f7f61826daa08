"""Exact, hashable signatures of op calls, and the bounded caches that keep trace-time work per signature.

Sharding propagation (a prim's meta) and the lowering's per-op traces depend only on the op, its inputs'
specs and local metadata and its other arguments: a model whose layers repeat pays for each distinct call
once. A key must be exact (a call that could trace differently never shares one), so arguments are described
by type and value, in argument order, with the call's tree structure; an argument no exact description is
known for makes the call uncacheable instead.
"""

from __future__ import annotations

import collections
import enum
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from thunder_dtensor import _integration as ti

import torch

__all__ = ["SignatureCache", "Uncacheable", "ambient_state", "call_signature", "describe_value"]


class Uncacheable(TypeError):
    """An argument has no exact hashable description: the call is worked out afresh."""


#: types whose ``repr`` is their value, exactly
_EXACT_REPR_TYPES = (int, float, complex, str, bool, type(None), type(Ellipsis))
_EXACT_REPR_TORCH_TYPES = (torch.dtype, torch.device, torch.memory_format, torch.layout)


def describe_value(x: Any, special: Callable[[Any], Hashable | None] | None = None) -> Hashable:
    """An exact, hashable description of a non-tensor argument: equal descriptions, equal values.

    ``special`` describes the values it knows (None: not one of them), at every depth of a container.
    """
    if special is not None and (described := special(x)) is not None:
        return described
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(describe_value(v, special) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((describe_value(k, special), describe_value(v, special)) for k, v in x.items()))
    if isinstance(x, slice):
        return ("slice", *(describe_value(v, special) for v in (x.start, x.stop, x.step)))
    if isinstance(x, _EXACT_REPR_TYPES + _EXACT_REPR_TORCH_TYPES) or isinstance(x, enum.Enum):
        return (type(x).__qualname__, repr(x))
    if ti.DISTRIBUTED_AVAILABLE:
        if isinstance(x, ti.DeviceMesh):
            return _describe_mesh(x)
        if isinstance(x, ti.Placement):
            return (type(x).__qualname__, repr(x))
    if isinstance(x, (ti.dtypes.dtype, ti.devices.Device)):
        return (type(x).__qualname__, repr(x))
    raise Uncacheable(f"no exact description of a {type(x).__qualname__} argument")


#: id(mesh) -> (a weak reference to the mesh, its description); a mesh's ranks, shape, dimension names and
#: process groups never change, and describing one takes ~0.15 ms (process-group lookups), once per argument
_MESH_DESCRIPTIONS: dict[int, tuple[weakref.ref, Hashable]] = {}


def _describe_mesh(mesh: Any) -> Hashable:
    """A device mesh by its ranks, shape, names and process groups (equal meshes may differ in the last,
    which collectives are issued on); described once per mesh object."""
    entry = _MESH_DESCRIPTIONS.get(id(mesh))
    if entry is not None and entry[0]() is mesh:
        return entry[1]
    try:
        groups = ti.mesh_group_names(mesh)
    except Exception as e:  # a mesh without process groups here
        raise Uncacheable("a device mesh whose process groups are unknown") from e
    ranks = tuple(mesh.mesh.flatten().tolist())
    description = ("mesh", mesh.device_type, ranks, tuple(mesh.mesh.shape), mesh.mesh_dim_names, groups)
    key = id(mesh)
    _MESH_DESCRIPTIONS[key] = (weakref.ref(mesh, lambda _: _MESH_DESCRIPTIONS.pop(key, None)), description)
    return description


def call_signature(op: Hashable, leaves: Iterable, tree: Any, describe_leaf: Callable[[Any], Hashable]) -> Any:
    """The exact signature of a call: the op, its tree structure, each leaf described in order, and the ambient
    state (None: a leaf has no exact description, so the call is not cached)."""
    try:
        described = tuple(describe_leaf(x) for x in leaves)
    except Uncacheable:
        return None
    return (op, str(tree), described, ambient_state())


def ambient_state() -> Hashable:
    """Process state a fake run or trace of an op reads besides its arguments: default dtype and device,
    autocast, and the SDPA backends torch's flags enable (which kernel a traced attention calls)."""
    autocast = tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
    )
    backends = ti.sdpa_backends_enabled_globally(with_priority=True)
    return (torch.get_default_dtype(), torch.get_default_device(), autocast, backends)


class SignatureCache:
    """A least-recently-used map from call signatures to trace-time results, with hit / miss counts.

    Bounded, so a long-lived process that traces many different programs does not grow without limit.
    """

    def __init__(self, name: str, maxsize: int = 4096) -> None:
        self.name = name
        self.maxsize = maxsize
        self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def get_or_compute(
        self, key: Hashable | None, compute: Callable[[], Any], keep: Callable[[Any], bool] | None = None
    ) -> Any:
        """The value cached for ``key``, else ``compute()``: stored unless ``key`` is None, it raises, or
        ``keep(value)`` says not to."""
        if key is None:
            return compute()
        try:
            value = self._entries[key]
        except KeyError:
            self.misses += 1
            value = compute()
            if keep is None or keep(value):
                self._store(key, value)
            return value
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def remember(self, key: Hashable | None, value: Any) -> None:
        """Store ``value`` for ``key`` (None: not cacheable) where nothing is stored yet: an answer worked out
        elsewhere, so neither a hit nor a miss."""
        if key is not None and key not in self._entries:
            self._store(key, value)

    def _store(self, key: Hashable, value: Any) -> None:
        self._entries[key] = value
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"SignatureCache({self.name!r}: {len(self)} entries, {self.hits} hits, {self.misses} misses)"
