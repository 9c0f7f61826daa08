"""FSDP2 (``fully_shard``) under ``thunder.jit``: plain and tensor-parallel parameters, HSDP, mixed precision,
resharding after forward and gradient accumulation without sync.

FSDP2 keeps each parameter sharded (dim 0) over the data-parallel ranks. In a module's forward pre-hook it
all-gathers the module's parameters at once (one collective per ``fully_shard`` group) and swaps in the
unsharded ones: plain tensors, or with tensor parallelism DTensors on the tp mesh. After the module's forward
it frees them (``reshard_after_forward``, except on the root) and gathers them again for the backward. After
the backward it reduce-scatters the group's gradients (averaged; in ``reduce_dtype``; HSDP then all-reduces
across replicas) into ``sharded_param.grad``, or, with ``set_requires_gradient_sync(False)``, keeps them
unsharded until a backward with sync on.

thunder's interpreter does not step into FSDP2's hooks (they key dicts by parameters, swap parameters on
modules, register autograd functions and stream waits). Their lookasides (``_integration.install_fsdp_support``)
put the same steps into the program instead:

* the pre-forward runs FSDP2's lazy init once, outside the program; then, per group,
  ``dtensor_fsdp_all_gather_prim`` of the group's sharded parameters (cast to ``param_dtype`` first), and
  what FSDP2 does to the inputs (the root's move to its accelerator, the mixed-precision policy's cast).
  Until the post-forward, reading a parameter of the group from its module (``self.weight``) gives the
  unsharded value; elsewhere it gives the sharded parameter, as in eager FSDP2;
* with ``reshard_after_forward`` the gathered values are marked for recomputation, so thunder's autodiff
  saves the sharded parameters for the backward and gathers again where the backward first needs them;
* the all-gather's gradient is ``dtensor_fsdp_reduce_scatter_prim`` of the group's trainable parameters;
  with gradient sync off it is ``dtensor_fsdp_accumulate_prim`` instead, which keeps the unsharded
  gradients (in ``reduce_dtype``) for the next reduce-scatter, and the parameters get no gradient; the
  first step with sync on again adds them (``dtensor_fsdp_reduce_scatter_with_kept_prim``);
* the prologue checks each group's gradient-sync switches, and whether kept gradients await, so a change
  retraces.

The all-gather and the reduce-scatter are written with functional ops and torch's functional collectives: the
lowering traces them into the program like any dtensor prim (the copies into and out of FSDP2's flat buffers
then fuse with the math around them, and one inductor graph spans the collectives). Only the accumulation and
the reduce-scatter that takes kept gradients, which read and write state outside the program, run eagerly.
The program's inputs stay the sharded parameters, so gradients land in ``param.grad`` as with FSDP2.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.guards import define_prologue_check
from thunder_dtensor.primitive import define_dtensor_prim
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import DTensorMeta, contiguous_stride

import torch

__all__ = [
    "dtensor_fsdp_accumulate_prim",
    "dtensor_fsdp_all_gather_prim",
    "dtensor_fsdp_reduce_scatter_prim",
    "dtensor_fsdp_reduce_scatter_with_kept_prim",
    "install",
]

_HINT = "compile the model with thunderfx (thunder.dynamo.thunderfx), which runs FSDP2's hooks eagerly"

#: id(sharded parameter) -> (a weak reference to it, id of its FSDP2 group, its index in the group)
_MANAGED: dict[int, tuple[weakref.ref, int, int]] = {}
#: FSDP2 group -> {parameter index: unsharded gradient} summed while gradient sync is off
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class _Gathered:
    """A group's all-gather in the trace being built; ``active`` while its module's forward runs (or, without
    resharding, until the program ends)."""

    outputs: tuple
    active: bool = True


@dataclasses.dataclass
class _TraceState:
    gathered: dict[int, _Gathered] = dataclasses.field(default_factory=dict)  # id(FSDP2 group) -> gather
    groups_of_state: dict[int, list[tuple[int, bool]]] = dataclasses.field(default_factory=dict)


_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trace being built -> _TraceState


def _trace_state() -> _TraceState:
    return _TRACES.setdefault(ti.get_tracectx(), _TraceState())


def _padded_rows(rows: int, world: int) -> int:
    """Rows of each rank's shard in FSDP2's flat buffers: ``torch.chunk`` sizes, padded to the first."""
    return -(-rows // world)


def _local_rows(rows: int, world: int, rank: int) -> int:
    chunk = _padded_rows(rows, world)
    return max(0, min(chunk, rows - rank * chunk))


# ---------------------------------------------------------------------------------------------------------
# the all-gather of one group: every parameter's shard, padded, in one flat buffer
# ---------------------------------------------------------------------------------------------------------
def _contiguous_proxy(spec: Any, device: Any, requires_grad: bool) -> DTensorProxy:
    """A proxy of ``spec`` whose local shard is contiguous (what the collectives below produce)."""
    local_shape = ti.local_shape_on(tuple(spec.tensor_meta.shape), spec.mesh, tuple(spec.placements))
    meta = DTensorMeta.from_spec(spec, local_shape, contiguous_stride(local_shape))
    return DTensorProxy(meta=meta, device=device, requires_grad=requires_grad)


def _with_dtype(spec: Any, dtype: torch.dtype) -> Any:
    return ti.respec(spec, tensor_meta=spec.tensor_meta._replace(dtype=dtype))


def _all_gather_meta(layout: ti.FSDPGroupLayout, *sharded: DTensorProxy) -> tuple:
    outputs: list[ti.TensorProxy] = []
    for param, s in zip(layout.params, sharded):
        dtype = cast(torch.dtype, layout.param_dtype or ti.dtypes.to_torch_dtype(s.dtype))  # a proxy has a dtype
        if param.unsharded_spec is not None:
            outputs.append(_contiguous_proxy(_with_dtype(param.unsharded_spec, dtype), s.device, s.requires_grad))
        else:
            thunder_dtype = ti.dtypes.to_dtype(dtype)
            outputs.append(
                ti.TensorProxy(shape=s.shape, dtype=thunder_dtype, device=s.device, requires_grad=s.requires_grad)
            )
    return tuple(outputs)


def _padded_to_rows(local: torch.Tensor, rows: int) -> torch.Tensor:
    """``local`` (at most ``rows`` rows) with zero rows appended up to ``rows``: ``torch.chunk``'s split, padded."""
    missing = rows - local.shape[0]
    if missing == 0:
        return local
    return torch.nn.functional.pad(local, (0, 0) * (local.dim() - 1) + (0, missing))


def _all_gather(layout: ti.FSDPGroupLayout, *sharded: Any) -> tuple:
    """Each parameter of the group unsharded: its TP shard as a DTensor on the tp mesh, or a plain tensor.

    Written with functional ops and a functional all-gather, so that the lowering traces it into the program
    (the copy into the flat buffer and the cuts out of the gathered one then fuse with the math around them).
    """
    world = layout.shard_size
    locals_ = [ti.local_tensor(s) for s in sharded]
    dtype = layout.param_dtype or locals_[0].dtype
    shapes = [_unsharded_local_shape(p, s) for p, s in zip(layout.params, sharded)]
    sizes = [_padded_rows(shape[0], world) * math.prod(shape[1:]) for shape in shapes]
    # this rank's shards, each padded to its chunk of rows, in one flat buffer
    pieces = [_padded_to_rows(local.to(dtype), _padded_rows(shape[0], world)) for local, shape in zip(locals_, shapes)]
    flat = torch.cat([piece.reshape(-1) for piece in pieces])
    gathered = ti.all_gather_dim0(flat, layout.shard_group.group_name) if world > 1 else flat
    gathered = gathered.view(world, -1)
    outputs, offset = [], 0
    for param, shape, n in zip(layout.params, shapes, sizes):
        full = gathered[:, offset : offset + n].reshape((world * _padded_rows(shape[0], world), *shape[1:]))
        full = full[: shape[0]]
        offset += n
        if param.unsharded_spec is not None:
            full = ti.dtensor_from_local_unchecked(full, _with_dtype(param.unsharded_spec, dtype))
        outputs.append(full)
    return tuple(outputs)


def _unsharded_local_shape(param: ti.FSDPParamLayout, sharded: Any) -> tuple[int, ...]:
    """This rank's shape of the unsharded parameter (its TP shard, or the whole tensor)."""
    if param.unsharded_local_shape is None:
        return tuple(int(s) for s in sharded.shape)
    return param.unsharded_local_shape


dtensor_fsdp_all_gather_prim = define_dtensor_prim(
    "fsdp_all_gather", _all_gather, meta=_all_gather_meta, differentiable=False
)


# ---------------------------------------------------------------------------------------------------------
# its gradient: one reduce-scatter of the group's trainable gradients (HSDP: then an all-reduce), averaged
# ---------------------------------------------------------------------------------------------------------
def _sharded_grad_spec(sharded_spec: Any) -> Any:
    """A sharded gradient's spec: the sharded parameter's (FSDP2's ``to_sharded_dtensor``), contiguous globally."""
    shape = tuple(sharded_spec.tensor_meta.shape)
    return ti.spec_with_sizes(sharded_spec, shape, contiguous_stride(shape))


def _reduce_scatter_meta(layout: ti.FSDPGroupLayout, indices: tuple, *grads: Any) -> tuple:
    return tuple(
        _contiguous_proxy(_sharded_grad_spec(layout.params[i].sharded_spec), g.device, requires_grad=False)
        for i, g in zip(indices, grads)
    )


def _unsharded_grad(param: ti.FSDPParamLayout, grad: Any) -> torch.Tensor:
    """The local unsharded gradient. A replicated weight's gradient may arrive ``Partial`` over tp
    (sequence-parallel norms), which the trace cannot know, since it labels a cotangent with its value's spec:
    as FSDP2 does, it is first brought to the unsharded parameter's placements."""
    spec = param.unsharded_spec
    if spec is not None:
        if tuple(grad.placements) != tuple(spec.placements):
            grad = grad.redistribute(grad.device_mesh, tuple(spec.placements))
        grad = ti.local_tensor(grad)
    return grad


def _reduce_dtype(layout: ti.FSDPGroupLayout, grads: Sequence[Any]) -> torch.dtype:
    return layout.reduce_dtype or grads[0].dtype


def _reduce_scatter_locals(layout: ti.FSDPGroupLayout, indices: tuple, locals_: list) -> tuple:
    """The group's sharded gradients from each rank's local unsharded ones: reduced over the data-parallel ranks
    (HSDP: then across replicas) and scattered (dim 0) like the sharded parameters. Functional ops and
    collectives, as the all-gather."""
    world, rank = layout.shard_size, layout.shard_rank
    dtype = _reduce_dtype(layout, locals_)
    shapes = [tuple(local.shape) for local in locals_]
    # rank r's rows of every gradient in row r, each padded to its chunk
    columns = [
        _padded_to_rows(local.to(dtype), world * _padded_rows(shape[0], world)).reshape(world, -1)
        for local, shape in zip(locals_, shapes)
    ]
    flat = torch.cat(columns, dim=1).reshape(-1)
    op: ti.FunctionalReduceOp = "sum" if layout.sum_then_divide else "avg"
    out = ti.reduce_scatter_dim0(flat, layout.shard_group.group_name, op) if world > 1 else flat
    if layout.replicate_group is not None:
        out = ti.all_reduce_tensor(out, layout.replicate_group.group_name, op)
    if layout.sum_then_divide:
        out = out / layout.divide_factor
    results, offset = [], 0
    # each gradient's chunk (n elements), cut to this rank's rows
    for i, shape, column in zip(indices, shapes, columns):
        n = column.shape[1]
        spec = _sharded_grad_spec(layout.params[i].sharded_spec)
        mine = out[offset : offset + n].view((_padded_rows(shape[0], world), *shape[1:]))
        mine = mine[: _local_rows(shape[0], world, rank)]
        offset += n
        results.append(ti.dtensor_from_local_unchecked(mine.to(spec.tensor_meta.dtype), spec))
    return tuple(results)


def _unsharded_grads(layout: ti.FSDPGroupLayout, indices: tuple, grads: tuple) -> list:
    return [_unsharded_grad(layout.params[i], g) for i, g in zip(indices, grads)]


def _reduce_scatter(layout: ti.FSDPGroupLayout, indices: tuple, *grads: Any) -> tuple:
    """The group's sharded gradients (see :func:`_reduce_scatter_locals`)."""
    return _reduce_scatter_locals(layout, indices, _unsharded_grads(layout, indices, grads))


dtensor_fsdp_reduce_scatter_prim = define_dtensor_prim(
    "fsdp_reduce_scatter", _reduce_scatter, meta=_reduce_scatter_meta, differentiable=False
)


def _reduce_scatter_with_kept(layout: ti.FSDPGroupLayout, indices: tuple, *grads: Any) -> tuple:
    """As :func:`_reduce_scatter`, of the gradients plus those kept while gradient sync was off (taken)."""
    group = layout.group()
    kept = _PENDING.pop(group, {}) if group is not None else {}
    locals_ = _unsharded_grads(layout, indices, grads)
    locals_ = [kept[i] + local if i in kept else local for i, local in zip(indices, locals_)]
    return _reduce_scatter_locals(layout, indices, locals_)


dtensor_fsdp_reduce_scatter_with_kept_prim = define_dtensor_prim(
    "fsdp_reduce_scatter_with_kept",
    _reduce_scatter_with_kept,
    meta=_reduce_scatter_meta,
    differentiable=False,
    not_lowered="it adds the gradients FSDP2 kept while gradient sync was off (state outside the program)",
)


def _has_kept_gradients(layout: ti.FSDPGroupLayout) -> bool:
    group = layout.group()
    return group is not None and bool(_PENDING.get(group))


def _gradient_state(layout: ti.FSDPGroupLayout) -> tuple:
    """The group's gradient-sync switches, and whether gradients kept while sync was off await the next
    reduce-scatter: the program is traced for both, and the prologue checks them (a change retraces)."""
    switches = ti.fsdp_gradient_switches(layout)
    return (*switches, bool(switches[0]) and _has_kept_gradients(layout))


def _accumulate_meta(layout: ti.FSDPGroupLayout, indices: tuple, *grads: Any) -> None:
    return None


def _accumulate(layout: ti.FSDPGroupLayout, indices: tuple, *grads: Any) -> None:
    """Keep the group's unsharded gradients (summed, in ``reduce_dtype``) for the next reduce-scatter."""
    group = layout.group()
    if group is None:
        return None
    dtype = _reduce_dtype(layout, grads)
    pending = _PENDING.setdefault(group, {})
    for i, g in zip(indices, grads):
        local = _unsharded_grad(layout.params[i], g)
        pending[i] = pending[i] + local if i in pending else local.to(dtype, copy=True)
    return None


dtensor_fsdp_accumulate_prim = define_dtensor_prim(
    "fsdp_accumulate",
    _accumulate,
    meta=_accumulate_meta,
    differentiable=False,
    tags=(ti.OpTags.DONT_DCE,),
    not_lowered="keeps FSDP2's unsharded gradients while gradient sync is off",
)


def _all_gather_grad_rule(layout: ti.FSDPGroupLayout, *sharded: DTensorProxy) -> tuple:
    outputs = dtensor_fsdp_all_gather_prim(layout, *sharded)
    indices = tuple(i for i, s in enumerate(sharded) if s.requires_grad)
    if not indices:
        return outputs
    cotangents = tuple(ti.get_grad(outputs[i]) for i in indices)
    reduce_grads, *_, with_kept = _gradient_state(layout)
    if not reduce_grads:
        dtensor_fsdp_accumulate_prim(layout, indices, *cotangents)
        return outputs
    reduce_scatter = dtensor_fsdp_reduce_scatter_with_kept_prim if with_kept else dtensor_fsdp_reduce_scatter_prim
    grads = reduce_scatter(layout, indices, *cotangents)
    for i, grad in zip(indices, grads):
        ti.put_grad(sharded[i], grad)
    return outputs


ti.register_grad(dtensor_fsdp_all_gather_prim, _all_gather_grad_rule)


# ---------------------------------------------------------------------------------------------------------
# the prologue's check of each group's gradient-sync switches (switching them retraces)
# ---------------------------------------------------------------------------------------------------------
def _check_switches_meta(layout: Any, expected: tuple) -> None:
    ti.check(isinstance(expected, tuple), lambda: f"expected a tuple of switches, got {type(expected)}")


def _check_switches_impl(layout: Any, expected: tuple) -> None:
    actual = _gradient_state(layout)
    if actual != expected:
        raise RuntimeError(f"FSDP2 gradient-sync state of {layout} changed: traced {expected}, now {actual}")


_check_fsdp_switches, _run_check_fsdp_switches = define_prologue_check(
    "check_fsdp_gradient_switches", _check_switches_meta, _check_switches_impl
)


# ---------------------------------------------------------------------------------------------------------
# the hooks (see _integration.install_fsdp_support)
# ---------------------------------------------------------------------------------------------------------
def _read_attribute_path(module: Any, path: str) -> Any:
    """``module.a.b.weight`` for ``path`` 'a.b.weight', each read by thunder's interpreter (the prologue checks
    them). One interpreted ``getattr`` a step: interpreting a Python loop over the path cost 40-230 ms a
    parameter (thunder's interpreter runs a list's iteration as Python code)."""
    value = module
    for name in path.split("."):
        value = ti.read_through_interpreter(value, name)
        if ti.is_interpreter_exception(value):
            return value
    return value


def _map_tensors(value: Any, fn: Any) -> Any:
    """``fn`` applied to every tensor in nested tuples, lists and dicts (run by thunder's interpreter)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """FSDP2's mixed-precision cast of forward inputs / outputs."""
    return _map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def _prepare_inputs(args: tuple, kwargs: dict, device: Any, dtype: Any) -> tuple[tuple, dict]:
    """What FSDP2's pre-forward does to the inputs: the root's move to its accelerator, the policy's cast."""
    if device is not None:
        args, kwargs = _map_tensors(args, lambda t: t.to(device)), _map_tensors(kwargs, lambda t: t.to(device))
    if dtype is not None:
        args, kwargs = _cast_floating(args, dtype), _cast_floating(kwargs, dtype)
    return args, kwargs


def _refuse(layout: ti.FSDPGroupLayout, sharded: tuple, why: str) -> DTensorOpError:
    return DTensorOpError(f"fsdp_all_gather of {layout}", tuple(sharded), {}, f"FSDP2 {why} is not supported", _HINT)


def _gather_group(layout: ti.FSDPGroupLayout, sharded: tuple, module: Any, state: _TraceState) -> None:
    """Put the group's all-gather in the program (at its module's pre-forward), once per forward of the module."""
    key = id(layout.group())
    for i, param in enumerate(sharded):
        _MANAGED[id(param)] = (weakref.ref(param), key, i)
    gathered = state.gathered.get(key)
    if gathered is not None and gathered.active:  # already unsharded (a module without resharding, run again)
        return
    if layout.unsupported:
        raise _refuse(layout, sharded, layout.unsupported)
    switches = _gradient_state(layout)
    if not switches[1] and layout.replicate_group is not None:
        raise _refuse(layout, sharded, "set_requires_all_reduce(False) (HSDP without the all-reduce)")
    if not switches[2]:
        raise _refuse(layout, sharded, "set_reshard_after_backward(False) (parameters kept unsharded between steps)")
    proxies = []
    for param in layout.params:
        value = _read_attribute_path(module, param.path)
        if ti.is_interpreter_exception(value):
            raise RuntimeError(f"FSDP2 parameter {param.path} of {layout} cannot be read from its module")
        proxies.append(ti.unwrap_value(value))
    if not all(isinstance(p, DTensorProxy) for p in proxies):
        raise _refuse(layout, tuple(proxies), "over parameters that are not DTensors")
    outputs = dtensor_fsdp_all_gather_prim(layout, *proxies)
    if layout.reshard_after_forward:  # freed after the forward, gathered again where the backward needs them
        for out in outputs:
            ti.mark_recomputed_in_backward(out)
    state.gathered[key] = _Gathered(tuple(outputs))
    ti.add_prologue_constraint(_run_check_fsdp_switches, layout, switches)


def _before_forward(state_value: Any, module: Any, args: Any, kwargs: Any) -> Any:
    """FSDP2's pre-forward in a thunder program: lazy init, each group's all-gather, the inputs' cast."""
    fsdp_state = ti.unwrap_value(state_value)
    ti.fsdp_lazy_init(fsdp_state)
    for key in [key for key, (ref, _, _) in _MANAGED.items() if ref() is None]:
        del _MANAGED[key]
    trace_state = _trace_state()
    groups = []
    for layout, sharded in ti.fsdp_group_layouts(fsdp_state):
        _gather_group(layout, sharded, module, trace_state)
        groups.append((id(layout.group()), layout.reshard_after_forward))
    trace_state.groups_of_state[id(fsdp_state)] = groups
    device, dtype = ti.fsdp_input_device(fsdp_state), ti.fsdp_mixed_precision_casts(fsdp_state)[0]
    if device is None and dtype is None:
        return ti.wrap_constant(None)
    return ti.interpret_call(_prepare_inputs, args, kwargs, ti.wrap_constant(device), ti.wrap_constant(dtype))


def _after_forward(state_value: Any, output: Any) -> Any:
    """FSDP2's post-forward in a thunder program: resharding (later reads give the sharded parameters), the
    output's cast."""
    fsdp_state = ti.unwrap_value(state_value)
    trace_state = _trace_state()
    for key, reshard in trace_state.groups_of_state.get(id(fsdp_state), ()):
        if reshard and key in trace_state.gathered:
            trace_state.gathered[key].active = False
    dtype = ti.fsdp_mixed_precision_casts(fsdp_state)[1]
    if dtype is None:
        return ti.wrap_constant(None)
    return ti.interpret_call(_cast_floating, output, ti.wrap_constant(dtype))


def _parameter_read(real: torch.Tensor, proxy: Any) -> Any:
    """The unsharded value for a read of an FSDP2-managed parameter while its module's forward runs; None
    (the sharded parameter, as eager FSDP2 has it) elsewhere."""
    entry = _MANAGED.get(id(real))
    if entry is None or entry[0]() is not real:
        return None
    _, key, index = entry
    gathered = _trace_state().gathered.get(key)
    if gathered is None or not gathered.active:
        return None
    return gathered.outputs[index]


def install() -> None:
    """Make ``thunder.jit`` run FSDP2 modules (see the module docstring)."""
    ti.install_fsdp_support(
        before_forward=_before_forward, after_forward=_after_forward, parameter_read=_parameter_read
    )
