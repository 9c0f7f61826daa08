"""FSDP2 (``fully_shard``) under thunder.jit (torch 2.13 / thunder 0.2.6 layout; used by fsdp.py)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from thunder_dtensor._integration.attribute_reads import on_attribute_read
from thunder_dtensor._integration.bootstrap import TensorProxy
from thunder_dtensor._integration.registry import JIT_LOOKASIDES, expects_absent, installer, patch

import torch


# ---------------------------------------------------------------------------------------------------------
# FSDP2 (``fully_shard``) under thunder.jit (torch 2.13 / thunder 0.2.6 layout; used by fsdp.py)
#
# thunder's interpreter must not step into FSDP2's module hooks: they key dicts by parameters (which are
# proxies while tracing: ``TypeError: unhashable type: 'DTensorProxy'`` in ``FSDPState._init_fqns``), swap
# parameters on modules, and register autograd functions and stream waits. Instead the hooks become
# lookasides that hand the state to fsdp.py, and a module attribute read that yields an FSDP-managed
# (sharded) parameter is handed to fsdp.py too, which answers with the unsharded value while its module's
# forward runs. Private torch names used here: ``torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState``
# (``_pre_forward``, ``_post_forward``, ``_lazy_init``, ``_is_root``, ``_fsdp_param_groups``, ``_mp_policy``,
# ``_device``, ``_modules``),
# ``FSDPParamGroup`` (``fsdp_params``, ``mesh_info``, ``post_forward_mesh_info``, ``reduce_grads``,
# ``all_reduce_grads``, ``reshard_after_backward``, ``gradient_divide_factor``,
# ``force_sum_reduction_for_comms``, ``_all_reduce_hook``, ``_module_fqn``), ``FSDPParam`` (``sharded_param``,
# ``_unsharded_dtensor_spec``, ``fsdp_placement``, ``mesh_info``, ``param_dtype``, ``reduce_dtype``,
# ``orig_dtype``, ``offload_to_cpu``, ``_module_info``), ``_fsdp_common.FSDPMeshInfo`` / ``HSDPMeshInfo``
# (``shard_process_group``, ``shard_mesh_size``, ``shard_mesh_rank``, ``replicate_process_group``,
# ``replicate_mesh_size``), and ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FSDPParamLayout:
    """One parameter of an FSDP2 group, as the all-gather and reduce-scatter in a thunder program need it.

    ``unsharded_spec`` is the spec of the DTensor FSDP2 computes with (``FSDPParam.unsharded_param``: the
    tensor-parallel spec), or None for a plain (non-DTensor) parameter; ``sharded_spec`` the sharded
    parameter's (its gradient's). ``path`` names the parameter from the module ``fully_shard`` was applied
    to (what the program reads). ``unsharded_local_shape`` is this rank's shape of the unsharded parameter's
    local tensor (None for a plain parameter): worked out here, for DTensor's shape rule cannot run where the
    lowering traces the all-gather.
    """

    path: str
    sharded_spec: Any
    unsharded_spec: Any
    unsharded_local_shape: tuple[int, ...] | None


class FSDPGroupLayout:
    """An FSDP2 parameter group (the parameters of one ``fully_shard`` call): one all-gather, one reduce-scatter.

    ``shard_group`` is the process group FSDP2 shards over (its size and this rank's index in it);
    ``replicate_group`` the one HSDP replicates over (an all-reduce of the reduce-scattered gradients), or
    None. ``param_dtype`` / ``reduce_dtype`` are the mixed-precision policy's (None: the parameter's own).
    ``reshard_after_forward``: the unsharded parameters are freed after the module's forward and gathered
    again in the backward (FSDP2 never does that for the root). ``divide_factor``: what the summed
    gradients are divided by (the data-parallel size unless set). ``unsupported`` says why this group cannot
    run under thunder.jit (empty when it can). ``group`` is a weak reference to FSDP2's group, whose
    gradient-sync switches are read at each call.

    A plain class, not a dataclass: traces hold it as one opaque constant (thunder prints a dataclass field
    by field).
    """

    __slots__ = (
        "divide_factor",
        "group",
        "name",
        "param_dtype",
        "params",
        "reduce_dtype",
        "replicate_group",
        "reshard_after_forward",
        "shard_group",
        "shard_rank",
        "shard_size",
        "sum_then_divide",
        "unsupported",
    )
    # the slots' types (annotations only: no class attributes)
    divide_factor: float
    group: weakref.ref[Any]
    name: str
    param_dtype: torch.dtype | None
    params: tuple[FSDPParamLayout, ...]
    reduce_dtype: torch.dtype | None
    replicate_group: Any
    reshard_after_forward: bool
    shard_group: Any
    shard_rank: int
    shard_size: int
    sum_then_divide: bool
    unsupported: str

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            object.__setattr__(self, name, fields.pop(name))
        if fields:
            raise TypeError(f"unknown FSDPGroupLayout fields {sorted(fields)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FSDPGroupLayout is immutable")

    def __repr__(self) -> str:
        return f"FSDPGroup({self.name or '<root>'!r}, {len(self.params)} params)"


def fsdp_state_hook_functions() -> tuple[Callable, Callable]:
    """The functions FSDP2 registers as forward pre-/post-hooks (bound to each ``FSDPState``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return FSDPState._pre_forward, FSDPState._post_forward


def fsdp_lazy_init(state: Any) -> None:
    """Run FSDP2's lazy init (what its first pre-forward does: root detection, shared state) if not done."""
    if state._is_root is None:
        state._lazy_init()


def fsdp_input_device(state: Any) -> torch.device | None:
    """The device the root state moves forward inputs to (FSDP2 does so on accelerators), or None."""
    if not state._is_root or state._device.type == "cpu":
        return None
    return state._device


def fsdp_mixed_precision_casts(state: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """What the state's ``MixedPrecisionPolicy`` casts floating-point forward inputs and outputs to (or None)."""
    policy = state._mp_policy
    inputs = policy.param_dtype if policy.cast_forward_inputs else None
    return inputs, policy.output_dtype


def _unsupported_features(group: Any) -> str:
    """The FSDP2 features of ``group`` a thunder program cannot honour, in words (empty: none)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    why = []
    if not isinstance(group.mesh_info, FSDPMeshInfo):
        why.append("replicate() / a DDP mesh (only fully_shard's FSDP and HSDP meshes are supported)")
    post = group.post_forward_mesh_info
    if post is not None and post.shard_process_group is not group.mesh_info.shard_process_group:
        why.append("reshard_after_forward=<int> (resharding to a smaller group after forward)")
    if group._all_reduce_hook is not None:
        why.append("set_all_reduce_hook")
    for fsdp_param in group.fsdp_params:
        if fsdp_param.fsdp_placement.dim != 0:
            why.append(f"sharding on dim {fsdp_param.fsdp_placement.dim} (shard_placement_fn; only dim 0)")
        if fsdp_param.offload_to_cpu:
            why.append("CPUOffloadPolicy")
        if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
            why.append("all-gather extensions (fsdp_pre_all_gather, e.g. float8 weights)")
    dtypes = {p.param_dtype or p.orig_dtype for p in group.fsdp_params}
    if len(dtypes) > 1:
        why.append(f"parameters of several dtypes in one group ({sorted(map(str, dtypes))})")
    return "; ".join(dict.fromkeys(why))


def fsdp_group_layouts(state: Any) -> Iterator[tuple[FSDPGroupLayout, tuple[torch.nn.Parameter, ...]]]:
    """Each FSDP2 group of ``state`` (its module's ``fully_shard`` call), with its sharded parameters."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    modules = state._modules
    names: dict[int, str] = {}  # id(parameter) -> its path from the modules fully_shard was applied to
    for module in modules:
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
    for group in state._fsdp_param_groups:
        params, sharded = [], []
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param
            path = names.get(id(param))
            if path is None:  # not reachable from the module as an attribute path: read it from its owner
                info = fsdp_param._module_info
                path = next(n for n, m in modules[0].named_modules() if m is info.module) + "." + info.param_name
                path = path.lstrip(".")
            spec = fsdp_param._unsharded_dtensor_spec
            local_shape = None if spec is None else local_shape_on(spec.shape, spec.mesh, spec.placements)
            params.append(FSDPParamLayout(path, param._spec, spec, local_shape))
            sharded.append(param)
        mesh_info = group.mesh_info
        hsdp = isinstance(mesh_info, HSDPMeshInfo)
        shard_size = getattr(mesh_info, "shard_mesh_size", 1)
        replicate_size = mesh_info.replicate_mesh_size if hsdp else 1
        first = group.fsdp_params[0]
        force_sum = bool(group.force_sum_reduction_for_comms)
        factor = group.gradient_divide_factor
        layout = FSDPGroupLayout(
            name=group._module_fqn or "",
            params=tuple(params),
            shard_group=getattr(mesh_info, "shard_process_group", None),
            shard_size=shard_size,
            shard_rank=getattr(mesh_info, "shard_mesh_rank", 0),
            replicate_group=mesh_info.replicate_process_group if hsdp else None,
            param_dtype=first.param_dtype,
            reduce_dtype=first.reduce_dtype,
            reshard_after_forward=group.post_forward_mesh_info is not None,
            divide_factor=float(factor) if factor is not None else float(shard_size * replicate_size),
            sum_then_divide=force_sum or factor is not None,
            unsupported=_unsupported_features(group),
            group=weakref.ref(group),
        )
        yield layout, tuple(sharded)


def fsdp_gradient_switches(layout: FSDPGroupLayout) -> tuple[bool, bool, bool]:
    """The group's switches set between calls: ``(reduce_grads, all_reduce_grads, reshard_after_backward)``
    (``set_requires_gradient_sync``, ``set_requires_all_reduce``, ``set_reshard_after_backward``)."""
    group = layout.group()
    if group is None:
        return (True, True, True)
    return (bool(group.reduce_grads), bool(group.all_reduce_grads), bool(group.reshard_after_backward))


def local_shape_on(shape: tuple, mesh: Any, placements: tuple) -> tuple[int, ...]:
    """This rank's local shape of a DTensor of global ``shape`` on ``mesh`` with ``placements``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(int(s) for s in compute_local_shape_and_global_offset(shape, mesh, placements)[0])


@installer("dtensor", "FSDP2's forward hooks run as lookasides; its managed parameters' reads become unsharded values")
def install_fsdp_support(
    *,
    before_forward: Callable[[Any, Any, Any, Any], Any],
    after_forward: Callable[[Any, Any], Any],
    parameter_read: Callable[[Any, Any], Any],
) -> None:
    """Keep thunder's interpreter out of FSDP2's forward hooks; let ``parameter_read`` replace parameter reads.

    * FSDP2's forward pre-hook becomes ``before_forward(state, module, args, kwargs)`` and its post-hook
      ``after_forward(state, output)``; both get the interpreter's wrapped values (so they can put ops in the
      program) and return the hook's wrapped result (None: the inputs / output as they are).
    * A module attribute read (``self.weight``) whose value is a tensor read from the module gives
      ``parameter_read(real_value, proxy)`` the chance to return another proxy (None: the read as it is).
    """
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map
    pre_forward, post_forward = fsdp_state_hook_functions()

    def pre_forward_lookaside(state: Any, module: Any, args: Any, kwargs: Any) -> Any:
        try:
            return before_forward(state, module, args, kwargs)
        except Exception as e:  # raised inside the program being traced, as an op's error would be
            return interpreter.do_raise(e)

    def post_forward_lookaside(state: Any, module: Any, args: Any, output: Any) -> Any:
        try:
            return after_forward(state, output)
        except Exception as e:
            return interpreter.do_raise(e)

    patch(lookasides, pre_forward, pre_forward_lookaside, table=JIT_LOOKASIDES, expects=expects_absent)
    patch(lookasides, post_forward, post_forward_lookaside, table=JIT_LOOKASIDES, expects=expects_absent)

    def parameter_read_lookaside(obj: Any, name: Any, value: Any) -> Any:
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

    on_attribute_read("fsdp_parameter_reads", parameter_read_lookaside, when="after")


def interpret_call(fn: Callable, *args: Any) -> Any:
    """Run ``fn`` on the interpreter's wrapped values inside the program being traced (its ops are recorded)."""
    from thunder.core import interpreter

    return interpreter._interpret_call(fn, *args)


def wrap_constant(value: Any) -> Any:
    from thunder.core import interpreter

    return interpreter.wrap_const(value)


def unwrap_value(value: Any) -> Any:
    from thunder.core import interpreter

    return interpreter.unwrap(value)


def is_interpreter_exception(value: Any) -> bool:
    from thunder.core import interpreter

    return value is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED


def add_prologue_constraint(check: Any, *args: Any) -> None:
    """Make the prologue of the program being traced run ``check(*args)`` (a failing check: a cache miss).

    Outside thunder's jit (thunderfx's splitter trying an op on its own) there is no prologue: nothing to do."""
    from thunder.core import jit_ext

    try:
        ctx = jit_ext.get_jit_ctx()
    except LookupError:
        return
    ctx.add_constraint((check, *args))


def mark_recomputed_in_backward(proxy: Any) -> None:
    """Have thunder's autodiff recompute ``proxy``'s producer in the backward instead of saving ``proxy``."""
    from thunder.core.proxies import ProxyTag

    proxy.tags.add(ProxyTag.RECOMPUTE_IN_BACKWARD)  # type: ignore[attr-defined]  # (a tag registered at runtime)
