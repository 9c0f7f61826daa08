"""FSDP2 (``fully_shard``) over tensor-parallel modules under ``thunder.jit``.

FSDP2 keeps each parameter sharded over the data-parallel mesh dim and, in its forward pre-hook, swaps in
the unsharded parameter (an all-gather over dp; with tensor parallelism, a DTensor on the tp mesh with the
TP placements: ``FSDPParam.unsharded_param``). After the backward it reduce-scatters that parameter's
gradient over dp, averaged, into ``sharded_param.grad`` (the sharded parameter's spec).

thunder's interpreter does not step into FSDP2's hooks (they key dicts by parameters, swap parameters on
modules, register autograd functions and stream waits). Instead (``_integration.install_fsdp_support``):

* the pre-forward hook runs FSDP2's lazy init once, outside the program, and records which parameters
  FSDP2 manages; the post-forward hook does nothing (resharding, prefetching and streams change no value);
* reading an FSDP-managed parameter from its module (``self.weight``) yields ``dtensor_fsdp_unshard_prim``
  of the sharded parameter: the all-gather over dp, giving the DTensor FSDP2 computes with. Its gradient is
  ``dtensor_fsdp_reduce_scatter_prim``: the reduce-scatter over dp with FSDP2's averaging, in the sharded
  parameter's spec. The program's inputs stay the sharded parameters, so ``param.grad`` is FSDP2's.

One unshard per parameter and program (a parameter read twice is gathered once, its gradients summed
before the reduce-scatter, as in FSDP2). The unsharded values live until the backward uses them (FSDP2
with ``reshard_after_forward`` frees and re-gathers them): a memory difference, not a semantic one.
"""

from __future__ import annotations

import weakref
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.primitive import define_dtensor_prim, define_vjp
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import DTensorMeta, contiguous_stride

import torch
import torch.distributed as dist

__all__ = ["dtensor_fsdp_reduce_scatter_prim", "dtensor_fsdp_unshard_prim", "install"]

#: id(sharded parameter) -> (a weak reference to it, its FSDP2 layout); filled by the pre-forward hook
_MANAGED: dict[int, tuple[weakref.ref, ti.FSDPParamLayout]] = {}
#: per trace being built: sharded parameter proxy name -> its unsharded proxy (one all-gather per parameter)
_UNSHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _padded_rows(rows: int, dp: int) -> int:
    """Rows of each rank's shard in FSDP2's all-gather buffer: ``torch.chunk`` sizes, padded to the first."""
    return -(-rows // dp)


# ---------------------------------------------------------------------------------------------------------
# the unshard: all-gather over the data-parallel mesh dim
# ---------------------------------------------------------------------------------------------------------
def _contiguous_proxy(spec: Any, device: Any, requires_grad: bool) -> DTensorProxy:
    """A proxy of ``spec`` whose local shard is contiguous (what the collectives below produce)."""
    local_shape = ti.local_shape_on(tuple(spec.tensor_meta.shape), spec.mesh, tuple(spec.placements))
    meta = DTensorMeta.from_spec(spec, local_shape, contiguous_stride(local_shape))
    return DTensorProxy(meta=meta, device=device, requires_grad=requires_grad)


def _unsharded_meta(sharded: DTensorProxy, tp_mesh: Any, tp_placements: tuple, dp_mesh_dim: int) -> DTensorProxy:
    spec = ti.make_spec(tp_mesh, tuple(tp_placements), sharded.meta.spec.tensor_meta)
    return _contiguous_proxy(spec, sharded.device, sharded.requires_grad)


def _unshard(sharded: Any, tp_mesh: Any, tp_placements: tuple, dp_mesh_dim: int) -> Any:
    """The sharded parameter's dp shards gathered (dim 0) into this rank's TP shard, as a DTensor on ``tp_mesh``."""
    spec = ti.dtensor_spec(sharded)
    mesh, meta = spec.mesh, spec.tensor_meta
    dp = mesh.size(dp_mesh_dim)
    rows = ti.local_shape_on(meta.shape, tp_mesh, tuple(tp_placements))[0]
    chunk = _padded_rows(rows, dp)
    local = ti.local_tensor(sharded)
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    gathered = local.new_empty((chunk * dp, *local.shape[1:]))
    dist.all_gather_single(gathered, padded, group=mesh.get_group(dp_mesh_dim))
    tp_spec = ti.make_spec(tp_mesh, tuple(tp_placements), meta)
    return ti.dtensor_from_local_unchecked(gathered[:rows], tp_spec)


dtensor_fsdp_unshard_prim = define_dtensor_prim(
    "fsdp_unshard", _unshard, meta=_unsharded_meta, not_lowered="FSDP2 collectives on its own buffers (c10d)"
)


# ---------------------------------------------------------------------------------------------------------
# its gradient: reduce-scatter over the data-parallel mesh dim, averaged (FSDP2's default on fp32)
# ---------------------------------------------------------------------------------------------------------
def _sharded_grad_spec(grad_spec: Any, mesh: Any, placements: tuple) -> Any:
    """The sharded gradient's spec: the sharded parameter's (FSDP2's ``to_sharded_dtensor``), contiguous globally."""
    shape = tuple(grad_spec.tensor_meta.shape)
    return ti.spec_with_sizes(
        ti.make_spec(mesh, tuple(placements), grad_spec.tensor_meta), shape, contiguous_stride(shape)
    )


def _reduce_scatter_meta(
    g: DTensorProxy, tp_placements: tuple, mesh: Any, placements: tuple, dp_mesh_dim: int
) -> DTensorProxy:
    return _contiguous_proxy(_sharded_grad_spec(g.meta.spec, mesh, placements), g.device, requires_grad=False)


def _reduce_scatter(g: Any, tp_placements: tuple, mesh: Any, placements: tuple, dp_mesh_dim: int) -> Any:
    """The mean over dp of each rank's TP-shard gradient, scattered (dim 0) like the sharded parameter.

    As FSDP2 does, the gradient is first brought to the unsharded parameter's placements: a replicated
    weight's gradient may arrive ``Partial`` over tp (sequence-parallel norms), which the trace cannot know,
    since it labels a cotangent with its value's spec.
    """
    if tuple(g.placements) != tuple(tp_placements):
        g = g.redistribute(g.device_mesh, tuple(tp_placements))
    local = ti.local_tensor(g).contiguous()
    dp = mesh.size(dp_mesh_dim)
    rows = local.shape[0]
    chunk = _padded_rows(rows, dp)
    padded = local.new_zeros((chunk * dp, *local.shape[1:]))
    padded[:rows].copy_(local)
    out = local.new_empty((chunk, *local.shape[1:]))
    dist.reduce_scatter_single(out, padded, op=dist.ReduceOp.AVG, group=mesh.get_group(dp_mesh_dim))
    mine = max(0, min(chunk, rows - mesh.get_local_rank(dp_mesh_dim) * chunk))
    return ti.dtensor_from_local_unchecked(out[:mine], _sharded_grad_spec(ti.dtensor_spec(g), mesh, placements))


dtensor_fsdp_reduce_scatter_prim = define_dtensor_prim(
    "fsdp_reduce_scatter",
    _reduce_scatter,
    meta=_reduce_scatter_meta,
    differentiable=False,
    not_lowered="FSDP2 collectives on its own buffers (c10d)",
)


@define_vjp(dtensor_fsdp_unshard_prim)
def _unshard_vjp(g, out, sharded, tp_mesh, tp_placements, dp_mesh_dim):
    placements = tuple(sharded.placements)
    return (dtensor_fsdp_reduce_scatter_prim(g, tuple(tp_placements), sharded.device_mesh, placements, dp_mesh_dim),)


# ---------------------------------------------------------------------------------------------------------
# the hooks (see _integration.install_fsdp_support)
# ---------------------------------------------------------------------------------------------------------
def _before_forward(state: Any) -> None:
    """FSDP2's pre-forward, as far as a thunder program needs it: lazy init, and which parameters it manages."""
    ti.fsdp_lazy_init(state)
    for key in [key for key, (ref, _) in _MANAGED.items() if ref() is None]:
        del _MANAGED[key]
    for param, layout in ti.fsdp_managed_params(state):
        _MANAGED[id(param)] = (weakref.ref(param), layout)


def _parameter_read(real: torch.Tensor, proxy: Any) -> Any:
    """The unsharded parameter for a read of an FSDP2-managed parameter from its module; None for other reads."""
    entry = _MANAGED.get(id(real))
    if entry is None or entry[0]() is not real:
        return None
    layout = entry[1]
    if not layout.supported or not isinstance(proxy, DTensorProxy):
        hint = "compile the model with thunderfx (thunder.dynamo.thunderfx), which runs FSDP2's hooks eagerly"
        raise DTensorOpError("fsdp_unshard", (proxy,), {}, layout.why or "the parameter is not a DTensor", hint=hint)
    trace = ti.get_tracectx()
    cache = _UNSHARDED.setdefault(trace, {})
    unsharded = cache.get(proxy.name)
    if unsharded is None:
        spec = layout.unsharded_spec
        unsharded = dtensor_fsdp_unshard_prim(proxy, spec.mesh, tuple(spec.placements), layout.dp_mesh_dim)
        cache[proxy.name] = unsharded
    return unsharded


def install() -> None:
    """Make ``thunder.jit`` run FSDP2 modules (see the module docstring)."""
    ti.install_fsdp_support(before_forward=_before_forward, parameter_read=_parameter_read)
