"""``distribute_tensor`` inside a program: a plain tensor made a DTensor, as eager makes it.

``src_data_rank`` (default 0) keeps eager's single-device semantics: the first rank of each mesh dim scatters
the shards (``Shard``) or broadcasts the value (``Replicate``, ``Partial``) with c10d; that prim runs eager's
``distribute_tensor`` at run time, so its collectives are eager's. ``src_data_rank=None`` communicates
nothing (each rank keeps its own chunk of its own data): that prim is lowered to the local ops.

Eager makes a new autograd leaf (the gradient never reaches ``tensor``); inside a program thunder could not hand
that leaf's gradient back, so a ``tensor`` that requires grad is refused, and the result requires no grad.
The result's global stride is contiguous (eager takes ``tensor.stride()``, which thunder does not know for a
plain tensor; the tensor is made contiguous first, so the local shards agree with it).
"""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol, propagate_on_fake_dtensors
from thunder_dtensor.proxy import DTensorProxy

from torch.distributed.tensor import distribute_tensor

OP = "distribute_tensor"


def _distribute(tensor: Any, device_mesh: Any, placements: tuple, src_data_rank: int | None = 0) -> Any:
    return distribute_tensor(tensor.contiguous(), device_mesh, placements, src_data_rank=src_data_rank)


def _distribute_meta(tensor: Any, device_mesh: Any, placements: tuple, src_data_rank: int | None = 0) -> Any:
    # the spec and shards do not depend on the source rank: propagated without communication
    return propagate_on_fake_dtensors(
        "dtensor_distribute_tensor_local_prim", _distribute, (tensor, device_mesh, placements, None), {}
    )


#: src_data_rank given: eager's scatter / broadcast at run time
dtensor_distribute_tensor_prim = define_dtensor_prim(
    "distribute_tensor",
    _distribute,
    meta=_distribute_meta,
    differentiable=False,
    not_lowered="it scatters / broadcasts from src_data_rank with c10d (eager's collectives)",
)
#: src_data_rank=None: each rank's chunk of its own data, no communication (lowered)
dtensor_distribute_tensor_local_prim = define_dtensor_prim(
    "distribute_tensor_local",
    lambda tensor, device_mesh, placements: _distribute(tensor, device_mesh, placements, None),
    differentiable=False,
)


def _refuse(tensor: Any, why: str, hint: str, placements: Any = None) -> DTensorOpError:
    shown = "" if placements is None else f" (placements {tuple(placements)})"
    args = (tensor,) if isinstance(tensor, DTensorProxy) else ()
    return DTensorOpError(OP, args, {}, f"{why}{shown}", hint=hint)


@define_dtensor_symbol
def dtensor_distribute_tensor(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
    if device_mesh is None:
        raise _refuse(
            tensor,
            "no device_mesh given: eager would read the ambient mesh context, which a trace does not check",
            "pass device_mesh explicitly",
            placements,
        )
    placements = tuple(placements) if placements is not None else (ti.Replicate(),) * device_mesh.ndim
    if len(placements) != device_mesh.ndim:
        raise _refuse(
            tensor, f"{len(placements)} placements for a {device_mesh.ndim}-D mesh", "one per mesh dim", placements
        )
    reduce_ops = {p.reduce_op for p in placements if p.is_partial()}
    if len(reduce_ops) > 1:
        raise _refuse(tensor, "Partial placements with different reduce ops", "use one reduce op", placements)
    if isinstance(tensor, DTensorProxy):
        # eager returns a DTensor already placed so as is, and refuses any other
        if tensor.device_mesh != device_mesh or tuple(tensor.placements) != placements:
            raise _refuse(
                tensor,
                "of a DTensor on another mesh or with other placements (eager raises a ValueError)",
                "use x.redistribute(mesh, placements) to change a DTensor's placements",
                placements,
            )
        return tensor
    ti.check(isinstance(tensor, ti.TensorProxy), lambda: f"{OP} takes a tensor, got {type(tensor).__name__}")
    if tensor.requires_grad:
        raise _refuse(
            tensor,
            "of a tensor that requires grad: eager makes the result a new autograd leaf (no gradient reaches the "
            "tensor), whose gradient thunder cannot hand back from inside a program",
            "pass tensor.detach() (eager's gradients of every other input are the same), or distribute the tensor "
            "outside the program and pass the DTensor in",
            placements,
        )
    for p in placements:
        if not (p.is_replicate() or p.is_partial() or isinstance(p, ti.Shard) or ti.is_strided_shard(p)):
            raise _refuse(tensor, f"of an unsupported placement {p}", "use Shard, Replicate or Partial", placements)
    placements = tuple(
        ti.Shard(p.dim + tensor.ndim) if isinstance(p, ti.Shard) and not ti.is_strided_shard(p) and p.dim < 0 else p
        for p in placements
    )
    ti.check(
        src_data_rank is None or isinstance(src_data_rank, int),
        lambda: f"{OP}: src_data_rank must be an int or None, got {src_data_rank!r}",
    )
    if src_data_rank is None:
        return dtensor_distribute_tensor_local_prim(tensor, device_mesh, placements)
    return dtensor_distribute_tensor_prim(tensor, device_mesh, placements, src_data_rank)


register_function_for_dtensor(distribute_tensor, dtensor_distribute_tensor, always=True)
