"""FSDP2 (``fully_shard``) under thunder.jit (torch 2.13 / thunder 0.2.6 layout; used by fsdp.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from thunder_dtensor._integration.bootstrap import TensorProxy
from thunder_dtensor._integration.registry import JIT_LOOKASIDES, expects_absent, expects_function, installer, patch

import torch


# ---------------------------------------------------------------------------------------------------------
# FSDP2 (``fully_shard``) under thunder.jit (torch 2.13 / thunder 0.2.6 layout; used by fsdp.py)
#
# thunder's interpreter must not step into FSDP2's module hooks: they key dicts by parameters (which are
# proxies while tracing: ``TypeError: unhashable type: 'DTensorProxy'`` in ``FSDPState._init_fqns``), swap
# parameters on modules, and register autograd functions and stream waits. Instead the hooks become
# lookasides, and a module attribute read that yields an FSDP-managed (sharded) parameter is handed to
# fsdp.py, which puts the unshard in the trace. Private torch names used here:
# ``torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState`` (``_pre_forward``, ``_post_forward``,
# ``_lazy_init``, ``_is_root``, ``_state_ctx.all_states``, ``_fsdp_param_groups``), ``FSDPParamGroup.fsdp_params``,
# ``FSDPParam`` (``sharded_param``, ``_unsharded_dtensor_spec``, ``fsdp_placement``, ``mesh_info``,
# ``param_dtype``, ``reduce_dtype``), ``_fsdp_common.FSDPMeshInfo`` / ``HSDPMeshInfo``, and
# ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FSDPParamLayout:
    """How FSDP2 shards one parameter, as far as the unshard / reduce-scatter in a thunder program needs it.

    ``unsharded_spec`` is the spec of the DTensor FSDP2 computes with (``FSDPParam.unsharded_param``: the
    tensor-parallel spec), or None for a plain (non-DTensor) parameter. ``dp_mesh_dim`` is the sharded
    parameter's mesh dim FSDP2 shards over; ``shard_dim`` the tensor dim it shards; ``supported`` is False
    (with ``why``) for the layouts fsdp.py does not handle (HSDP, mixed precision, ``Shard(d != 0)``).
    """

    unsharded_spec: Any
    dp_mesh_dim: int
    shard_dim: int
    supported: bool
    why: str = ""


def fsdp_state_hook_functions() -> tuple[Callable, Callable]:
    """The functions FSDP2 registers as forward pre-/post-hooks (bound to each ``FSDPState``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return FSDPState._pre_forward, FSDPState._post_forward


def fsdp_lazy_init(state: Any) -> None:
    """Run FSDP2's lazy init (what its first pre-forward does: root detection, shared state) if not done."""
    if state._is_root is None:
        state._lazy_init()


def fsdp_managed_params(state: Any) -> Iterator[tuple[torch.nn.Parameter, FSDPParamLayout]]:
    """Every parameter the FSDP2 states sharing ``state``'s context manage (the whole tree once lazily inited)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    states = state._state_ctx.all_states or [state]
    for s in states:
        for group in s._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                spec = fsdp_param._unsharded_dtensor_spec
                mesh_info = fsdp_param.mesh_info
                why = ""
                if isinstance(mesh_info, HSDPMeshInfo) or not isinstance(mesh_info, FSDPMeshInfo):
                    why = "only FSDP (fully_shard on a 1-D data-parallel mesh) is supported, not HSDP / DDP"
                elif fsdp_param.param_dtype is not None or fsdp_param.reduce_dtype is not None:
                    why = "FSDP2 mixed precision (MixedPrecisionPolicy param_dtype / reduce_dtype) is not supported"
                elif fsdp_param.fsdp_placement.dim != 0:
                    why = f"FSDP2 sharding on dim {fsdp_param.fsdp_placement.dim} is not supported (only dim 0)"
                elif spec is None:
                    why = "FSDP2 over plain (non-DTensor) parameters is not supported, only over tensor-parallel ones"
                layout = FSDPParamLayout(spec, 0, fsdp_param.fsdp_placement.dim, not why, why)
                yield fsdp_param.sharded_param, layout


def local_shape_on(shape: tuple, mesh: Any, placements: tuple) -> tuple[int, ...]:
    """This rank's local shape of a DTensor of global ``shape`` on ``mesh`` with ``placements``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(int(s) for s in compute_local_shape_and_global_offset(shape, mesh, placements)[0])


@installer("dtensor", "FSDP2's forward hooks run as lookasides; its managed parameters' reads become unshard prims")
def install_fsdp_support(*, before_forward: Callable[[Any], None], parameter_read: Callable[[Any, Any], Any]) -> None:
    """Keep thunder's interpreter out of FSDP2's forward hooks; let ``parameter_read`` replace parameter reads.

    * FSDP2's forward pre-hook runs ``before_forward(state)`` whole (outside the interpreter) and changes
      nothing in the program; its forward post-hook does nothing (resharding, prefetching, stream waits and
      the pre-backward hook registration have no meaning inside a thunder program).
    * A module attribute read (``self.weight``) whose value is a tensor read from the module gives
      ``parameter_read(real_value, proxy)`` the chance to return another proxy (None: the read as it is).
    """
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map
    previous_getattr = lookasides[getattr]
    pre_forward, post_forward = fsdp_state_hook_functions()

    def pre_forward_lookaside(state: Any, module: Any, args: Any, kwargs: Any) -> None:
        before_forward(state)
        return None  # the hook leaves the module's inputs as they are

    def post_forward_lookaside(state: Any, module: Any, args: Any, output: Any) -> None:
        return None  # the hook leaves the module's output as it is

    pre = jit_ext.interpreter_needs_wrap(pre_forward_lookaside)
    post = jit_ext.interpreter_needs_wrap(post_forward_lookaside)
    patch(lookasides, pre_forward, pre, table=JIT_LOOKASIDES, expects=expects_absent)
    patch(lookasides, post_forward, post, table=JIT_LOOKASIDES, expects=expects_absent)

    def getattr_lookaside(obj: Any, name: Any, *maybe_default: Any) -> Any:
        value = previous_getattr(obj, name, *maybe_default)
        if value is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED or not isinstance(
            interpreter.unwrap(obj), torch.nn.Module
        ):
            return value
        proxy_value = interpreter.unwrap(value)
        real = getattr(value, "original_value", None)
        if not isinstance(proxy_value, TensorProxy) or not isinstance(real, torch.Tensor):
            return value

        try:
            replacement = parameter_read(real, proxy_value)
        except Exception as e:  # raised inside the program being traced, as an op's error would be
            return interpreter.do_raise(e)
        if replacement is None:
            return value
        record = interpreter.ProvenanceRecord(
            interpreter.PseudoInst.OPAQUE, inputs=[interpreter.wrap_const(parameter_read).provenance, value.provenance]
        )
        return interpreter.wrap(replacement, provenance=record)

    expects = expects_function(("thunder", "thunder_dtensor"), "obj", "name")  # thunder's, or ours over it
    patch(lookasides, getattr, getattr_lookaside, table=JIT_LOOKASIDES, expects=expects)
