"""Errors that name the op, its inputs' placements and a hint that fits the cause."""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti

import torch

__all__ = ["DTensorOpError", "DataDependentValueError", "describe_argument", "first_line", "structural_hint"]


def first_line(error: BaseException) -> str:
    """The first line of an error's message (empty if it has none): for one-line reasons."""
    return (str(error).splitlines() or [""])[0]


def _is_dtensor(x: Any) -> bool:
    """A DTensor: a traced one (a proxy) or a runtime one (an op that raises while the program runs)."""
    from thunder_dtensor.proxy import DTensorProxy

    return isinstance(x, DTensorProxy) or isinstance(x, ti.DTensor)


def describe_argument(x: Any) -> str:
    if isinstance(x, (ti.TensorProxy, torch.Tensor)):
        dtype = x.dtype.shortname() if isinstance(x, ti.TensorProxy) else str(x.dtype).removeprefix("torch.")
        if _is_dtensor(x):
            placed: Any = x  # a DTensorProxy or a runtime DTensor
            return f"DTensor {dtype}{list(x.shape)} placements={tuple(placed.placements)} mesh={placed.device_mesh}"
        return f"torch.Tensor {dtype}{list(x.shape)} (not a DTensor)"
    return repr(x)


def _tensors(args: tuple, kwargs: dict) -> list:
    flat, _ = ti.tree_flatten((args, kwargs))
    return [a for a in flat if isinstance(a, (ti.TensorProxy, torch.Tensor))]


def structural_hint(args: tuple, kwargs: dict) -> str | None:
    """The hint for causes visible from the inputs alone (plain tensors, several meshes), else None."""
    tensors = _tensors(args, kwargs)
    # eager DTensor accepts 0-dim plain tensors as scalars
    if any(not _is_dtensor(t) and t.ndim > 0 for t in tensors):
        return (
            "convert every torch.Tensor argument to a DTensor first, with DTensor.from_local(t, mesh, placements) "
            "or distribute_tensor(t, mesh, placements), as eager DTensor requires"
        )
    meshes: list[Any] = []
    for t in tensors:
        if _is_dtensor(t) and not any(t.device_mesh is m or _same_mesh(t.device_mesh, m) for m in meshes):
            meshes.append(t.device_mesh)
    if len(meshes) > 1:
        return (
            f"the inputs live on {len(meshes)} different device meshes ({', '.join(map(_mesh_layout, meshes))}); "
            "a DTensor op takes inputs of one mesh: create them on the same DeviceMesh (or move one with "
            "distribute_tensor(x.full_tensor(), mesh, placements))"
        )
    return None


def _mesh_layout(mesh: Any) -> str:
    return f"{mesh.device_type} ranks {mesh.mesh.tolist()}"


def _same_mesh(a: Any, b: Any) -> bool:
    return a == b and a.mesh.tolist() == b.mesh.tolist()


class DTensorOpError(RuntimeError):
    """A DTensor op that cannot run on the given inputs, reported at trace time.

    ``hint`` says what to do about this cause; without one, the hint follows from the inputs (plain
    tensors, several meshes) or points at redistribution in general.
    """

    def __init__(self, op_name: str, args: tuple, kwargs: dict, cause: BaseException | str, hint: str | None = None):
        lines = [f"{op_name}: {cause}"]
        lines += [f"  input {i}: {describe_argument(t)}" for i, t in enumerate(_tensors(args, kwargs))]
        structural = structural_hint(args, kwargs)
        hint = structural or hint
        if hint is None:
            hint = "redistribute the inputs to placements this op supports (DTensor.redistribute)"
        lines.append(f"  hint: {hint}")
        super().__init__("\n".join(lines))
        self.op_name = op_name
        self.hint = hint
        #: the inputs themselves are the cause (plain tensors among DTensors, several meshes): no rewrite helps
        self.structural = structural is not None


class DataDependentValueError(DTensorOpError, NotImplementedError):
    """A DTensor op whose result (a Python value, or an output's shape) depends on the data, which a trace cannot
    fix: raised at trace time where plain thunder raises for the same call on plain tensors (its
    ``NotImplementedError``, of which this is one)."""


class DataDependentIndexError(DataDependentValueError, TypeError):
    """``operator.index(x)`` of a DTensor: also the ``TypeError`` Python raises for an object that cannot be an
    index (what plain thunder's proxies raise), so code that probes for an index with ``except TypeError`` works."""


#: what a program can do instead of reading a DTensor's data into Python at trace time
READ_AT_RUN_TIME_HINT = (
    "read the value with x.item() (a number computed at run time, for arithmetic: a branch on it is refused "
    "too), or keep it a tensor (torch.where for a condition); thunderfx (thunder.dynamo) runs Python control "
    "flow on tensor values by splitting the graph"
)
