"""Defining a dtensor prim: its meta, its execution and its grad rule, registered in one place.

A dtensor prim wraps one torch operation on DTensors. Its meta runs that operation on fake DTensors, so
the output spec comes from DTensor's own sharding propagation (and an input combination DTensor rejects
fails here, at trace time, with the same cause). Its execution, on :data:`dtensor_ex`, runs the same
operation on the runtime DTensors. Its grad rule is written with other dtensor prims, next to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.errors import (
    READ_AT_RUN_TIME_HINT,
    DataDependentValueError,
    DTensorOpError,
    first_line,
    structural_hint,
)
from thunder_dtensor.executor import dtensor_ex
from thunder_dtensor.proxy import DTensorProxy, proxy_for_value
from thunder_dtensor.signature import SignatureCache, call_signature, describe_value
from thunder_dtensor.spec import contiguous_stride, dense_stride_like

import torch

__all__ = [
    "call_backwards_with",
    "define_dtensor_prim",
    "define_vjp",
    "propagate_on_fake_dtensors",
    "propagated_fakes",
    "to_torch_value",
    "is_runtime_number",
    "DTENSOR_PRIMS",
    "PRIMS",
    "PrimRecord",
    "vjp_call_deciding_again",
]


@dataclasses.dataclass
class PrimRecord:
    """Everything the package knows about one dtensor prim, in one place (:data:`PRIMS`, by prim name).

    Its meta and execution are the symbol's own (the meta runs the prim's torch op on fake DTensors, unless
    the prim gives another); the rest is what passes over whole programs (autodiff, the lowering, autocast)
    read about it.
    """

    symbol: ti.Symbol
    #: the torch operation on DTensors: what the prim runs, and what the lowering traces with DTensor's dispatch
    runtime_fn: Callable | None = None
    #: the grad rule thunder's autodiff uses for it: the generic one (eager DTensor's own backward) until a
    #: dedicated rule replaces it (``define_vjp``); None for prims no gradient flows through
    grad_rule: Callable | None = None
    #: the generic grad rule, kept when a dedicated one replaces it (complex tensors and ``generic_when`` use it)
    generic_grad_rule: Callable | None = None
    #: this prim is the generic vjp of another: its gradients are narrowed to those a backward reads
    is_generic_vjp: bool = False
    #: a generic vjp's call (``vjp(args, kwargs, cotangents, diff_indices)``) that decides again how it runs (the
    #: vjp itself, decomposed, or replicated) for the cotangents given: see :func:`vjp_call_deciding_again`
    decide_again: Callable | None = None
    #: why it is never lowered (it exists to run eager DTensor code, or nothing, at run time); None: lowered
    not_lowered: str | None = None
    #: it returns its DTensor arguments themselves under new names (the alias pass's renames): the lowering reads
    #: each output with its argument's local layout
    renames_arguments: bool = False
    #: (the op it computes, how: "decomposition" or "replicated fallback") for a prim DTensor had no rule for
    rewritten: tuple[str, str] | None = None
    #: its outputs' global shapes are checked against the op's on plain tensors (a plain torch op on DTensors)
    shape_checked: bool = False
    #: the torch functions whose DTensor calls reach it directly (its dispatch entries), by which autocast asks
    #: torch what it would cast
    torch_functions: list[Callable] = dataclasses.field(default_factory=list)


#: every dtensor prim's record, by prim name
PRIMS: dict[str, PrimRecord] = {}


class _SymbolsByName(Mapping):
    """A read-only view, prim name -> symbol: the public ``DTENSOR_PRIMS`` (introspection, docs and tests)."""

    def __getitem__(self, name: str) -> ti.Symbol:
        return PRIMS[name].symbol

    def __iter__(self) -> Iterator[str]:
        return iter(PRIMS)

    def __len__(self) -> int:
        return len(PRIMS)


#: Every dtensor prim by name (a view of :data:`PRIMS`).
DTENSOR_PRIMS: Mapping[str, ti.Symbol] = _SymbolsByName()


def add_prim_record(symbol: ti.Symbol, **facts: Any) -> PrimRecord:
    """Record a dtensor prim (:func:`define_dtensor_prim` does; the in-place copy, made otherwise, too)."""
    ti.check(symbol.name not in PRIMS, lambda: f"{symbol.name} is already defined")
    record = PRIMS[symbol.name] = PrimRecord(symbol, **facts)
    return record


def is_runtime_number(x: Any) -> bool:
    """A number the program reads from its data (``x.item()``): it has a value only at run time.

    Such a number is an argument of the prims that read it, never a constant of the trace: trace-time work
    (sharding propagation) runs on stand-ins for it and refuses what depends on its value
    (:func:`propagated_fakes`); the lowering and the rewrites, which would bake it into a graph, keep those
    prims as eager DTensor ops, which get the number at run time.
    """
    return isinstance(x, ti.NumberProxy) and ti.pyval(x) is None


#: the values a run-time number stands in as at trace time, by its Python type: two runs that differ in the
#: stand-in tell whether an op's output metadata depends on the number (:func:`propagated_fakes`)
_RUNTIME_NUMBER_STAND_INS: dict[type, tuple[Any, Any]] = {bool: (True, False), int: (1, 3), float: (1.5, 2.5)}
_STAND_IN_CHOICE = [0]


def eager_local_stride(x: DTensorProxy) -> tuple[int, ...] | None:
    """The strides of eager's local shard of ``x``: dense in the order of the global stride where that is dense and
    not row-major (DTensor derives the global stride from its local tensor's); None: contiguous, as torch lays out a
    fresh tensor (torch's strides, which differ from :func:`contiguous_stride` around an empty dim: a rank's empty
    shard laid out otherwise than the others' made its program differ, fuzz seed 20 at 4 ranks hung).

    A fake run takes view-or-copy decisions off the local tensor (a transposed value's ``.mT`` is a contiguous view
    in eager): a contiguous stand-in under a transposed spec made ``o @ x.transpose(2, 1)`` fail DTensor's view rule,
    and the op was rewritten and placed otherwise than eager's (fuzz seed 17166)."""
    shape, stride = tuple(x.shape), tuple(x.meta.stride)
    if stride == contiguous_stride(shape) or stride != dense_stride_like(shape, stride):
        return None
    return dense_stride_like(tuple(x.local_shape), stride)


def _stand_in_number(x: Any) -> Any:
    pytype = x.python_type
    kind = next((t for t in (bool, int, float) if issubclass(pytype, t)), float)
    if pytype is complex:
        return complex(_RUNTIME_NUMBER_STAND_INS[float][_STAND_IN_CHOICE[0]], 0.5)
    return _RUNTIME_NUMBER_STAND_INS[kind][_STAND_IN_CHOICE[0]]


def to_torch_value(x: Any) -> Any:
    """Map thunder's dtype/device values and number proxies to what torch functions take (a number read at run
    time: its trace-time stand-in, see :func:`is_runtime_number`)."""
    if isinstance(x, ti.dtypes.dtype):
        return ti.dtypes.to_torch_dtype(x)
    if isinstance(x, ti.devices.Device):
        return ti.devices.to_torch_device(x)
    if isinstance(x, ti.NumberProxy):
        return _stand_in_number(x) if is_runtime_number(x) else ti.static_number(x)
    return x


def _laid_out_as_eager(x: DTensorProxy, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a shard of ``x``) with the strides of eager's shard (:func:`eager_local_stride`)."""
    stride = eager_local_stride(x)
    if stride is None or tuple(local.stride()) == stride:
        return local
    return torch.empty_strided(tuple(local.shape), stride, dtype=local.dtype, device=local.device).copy_(local)


def _stand_in(x: Any, fill: Callable = torch.empty) -> Any:
    """A torch value standing in for a proxy: ``torch.empty`` under fake mode, or real zeros (see below)."""
    if isinstance(x, DTensorProxy):
        device = ti.devices.to_torch_device(x.device)
        local = _laid_out_as_eager(x, fill(x.local_shape, dtype=x.meta.dtype, device=device))
        return ti.dtensor_around(local, x.meta.spec)
    if isinstance(x, ti.TensorProxy):
        dtype, device = ti.dtypes.to_torch_dtype(x.dtype), ti.devices.to_torch_device(x.device)
        return fill(x.shape, dtype=dtype, device=device)
    return to_torch_value(x)


def _spec_on_mesh(spec: Any, input_meshes: list) -> Any:
    """``spec`` on the op's own (real) device mesh object.

    An output must carry the mesh of its inputs: under thunderfx, dynamo's fake tracing leaves DTensor's
    sharding cache holding specs whose mesh is an opaque stand-in that compares equal to the real one, and
    meshes over the same ranks but different process groups compare equal too.
    """
    real = next((m for m in input_meshes if m is spec.mesh), None)
    if real is None:
        real = next((m for m in input_meshes if m == spec.mesh), None)
    if real is None:
        ti.check(
            not ti.is_opaque_script_object(spec.mesh),
            lambda: f"no input of the op is on the output's device mesh {spec.mesh}",
        )
        return spec
    return spec if real is spec.mesh else ti.respec(spec, mesh=real)


def _to_proxy(x: Any, requires_grad: bool, input_meshes: list) -> Any:
    if ti.DISTRIBUTED_AVAILABLE and isinstance(x, ti.DTensor):
        spec = _spec_on_mesh(ti.dtensor_spec(x), input_meshes)
        return proxy_for_value(x, requires_grad=requires_grad, spec=spec)
    return proxy_for_value(x, requires_grad=requires_grad)


def _runs_on_fake(torch_fn: Callable, args: tuple, kwargs: dict, stand_in: Callable) -> Exception | None:
    """Run ``torch_fn`` on fake stand-ins of the proxies; the exception it raises, or None."""
    try:
        with ti.fake_tensor_mode():
            fake_args, fake_kwargs = ti.tree_map(stand_in, (args, kwargs))
            torch_fn(*fake_args, **fake_kwargs)
    except Exception as e:
        return e
    return None


def _runtime_like_stand_in(x: Any, fill: Callable = torch.empty) -> Any:
    """:func:`_stand_in` that requires grad where the proxy does, as the value it stands for does at run time
    (a CompositeImplicit op such as matmul picks its decomposition, and so DTensor's rules, by it)."""
    t = _stand_in(x, fill)
    if isinstance(x, ti.TensorProxy) and x.requires_grad and ti.dtypes.is_inexact_dtype(x.dtype):
        t.requires_grad_()
    return t


def _plain_stand_in(x: Any) -> Any:
    """A plain tensor of the proxy's global shape: the op without any distribution."""
    if isinstance(x, DTensorProxy):
        return torch.empty(x.shape, dtype=x.meta.dtype, device=ti.devices.to_torch_device(x.device))
    return _stand_in(x)


def _replicated_stand_in(replicate: set[int]) -> Callable:
    """Stand-ins in which the DTensor proxies with the given ids are Replicate on their mesh."""

    def stand_in(x: Any) -> Any:
        if isinstance(x, DTensorProxy) and id(x) in replicate:
            spec = ti.make_spec(x.device_mesh, (ti.Replicate(),) * x.device_mesh.ndim, x.meta.spec.tensor_meta)
            device = ti.devices.to_torch_device(x.device)
            return ti.dtensor_around(torch.empty(x.shape, dtype=x.meta.dtype, device=device), spec)
        return _stand_in(x)

    return stand_in


def suggest_fix(torch_fn: Callable, args: tuple, kwargs: dict) -> str | None:
    """A hint for an op DTensor rejected, found by asking DTensor (on fake tensors) what it would accept.

    If the op fails on plain tensors of the global shapes too, the placements are not the cause. Otherwise
    the first redistribution eager accepts is suggested: one input to Replicate, else all of them.
    """
    tensors = [a for a in ti.tree_flatten((args, kwargs))[0] if isinstance(a, ti.TensorProxy)]
    plain_error = _runs_on_fake(torch_fn, args, kwargs, _plain_stand_in)
    if plain_error is not None and not isinstance(plain_error, ti.UNKNOWABLE_ON_FAKE_TENSORS):
        shapes = ", ".join(f"input {i}: {list(t.shape)}" for i, t in enumerate(tensors))
        return (
            f"the op fails on plain tensors of these global shapes too ({shapes}: "
            f"{type(plain_error).__name__}: {first_line(plain_error)}); fix the shapes or arguments, "
            "the placements are not the cause"
        )
    sharded = [
        (i, t)
        for i, t in enumerate(tensors)
        if isinstance(t, DTensorProxy) and any(not p.is_replicate() for p in t.placements)
    ]
    candidates = [[entry] for entry in sharded] + ([sharded] if len(sharded) > 1 else [])
    unknowable = None
    for candidate in candidates:
        error = _runs_on_fake(torch_fn, args, kwargs, _replicated_stand_in({id(t) for _, t in candidate}))
        names = " and ".join(f"input {i}" for i, _ in candidate)
        redistribute = f"x.redistribute(mesh, [Replicate()] * {candidate[0][1].device_mesh.ndim})"
        if error is None:
            return f"eager DTensor accepts this op with {names} replicated: {redistribute} before the call"
        if isinstance(error, ti.UNKNOWABLE_ON_FAKE_TENSORS) and unknowable is None:
            unknowable = (
                f"try {names} replicated ({redistribute}); the op's output shape depends on the data, so "
                "DTensor's acceptance could not be checked at trace time"
            )
    if unknowable is not None:
        return unknowable
    return (
        "DTensor has no sharding strategy for this op on these inputs, replicated or not: run it on local "
        "tensors (x.to_local() / x.full_tensor()) and wrap the result with DTensor.from_local"
    )


#: sharding propagation's results (fake outputs) by prim and call signature: repeated layers propagate once
PROPAGATION_CACHE = SignatureCache("sharding propagation")


def _describe_proxy(x: Any) -> tuple:
    """What a fake stand-in of ``x`` is made of (:func:`_stand_in`): spec, local shape, dtype, device."""
    if isinstance(x, DTensorProxy):
        mesh = describe_value(x.device_mesh)  # its process groups too: DeviceMesh equality leaves them out
        return ("dtensor", x.meta.spec, mesh, tuple(x.local_shape), x.meta.dtype, x.device, x.requires_grad)
    return ("tensor", tuple(x.shape), x.dtype, x.device, x.requires_grad)


def _propagation_key(op_name: str, flat: list, tree: Any) -> Any:
    """The exact signature of a fake run (None: not cacheable)."""

    def describe(x: Any) -> Any:
        if isinstance(x, ti.TensorProxy):
            return _describe_proxy(x)
        if is_runtime_number(x):
            return ("number read at run time", x.python_type.__name__)
        return describe_value(to_torch_value(x))

    return call_signature(op_name, flat, tree, describe)


def propagate_on_fake_dtensors(op_name: str, torch_fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``torch_fn`` on fake DTensors shaped like the proxies; return proxies for its outputs.

    The fake outputs are cached by call signature (:data:`PROPAGATION_CACHE`); each call gets fresh proxies.
    """
    flat, _ = ti.tree_flatten((args, kwargs))
    requires_grad = any(isinstance(a, ti.TensorProxy) and a.requires_grad for a in flat)
    out = propagated_fakes(op_name, torch_fn, args, kwargs)
    input_meshes = [a.device_mesh for a in flat if isinstance(a, DTensorProxy)]
    input_meshes += [a for a in flat if ti.DISTRIBUTED_AVAILABLE and isinstance(a, ti.DeviceMesh)]
    return ti.tree_map(lambda o: _to_proxy(o, requires_grad, input_meshes), out)


def propagated_fakes(op_name: str, torch_fn: Callable, args: tuple, kwargs: dict) -> Any:
    """The fake outputs of ``torch_fn`` on fake DTensors shaped like the proxies (cached by call signature).

    Raises :class:`DTensorOpError` where DTensor rejects the op. Creates no proxies, so it can ask whether a
    prim would trace before the prim is called (a failing prim call leaves thunder's trace scopes open).
    """
    flat, tree = ti.tree_flatten((args, kwargs))
    if ti.using_symbolic_values():  # the prologue then guards concrete shapes (guards.add_prologue_spec_checks)
        ti.note_dtensor_op_traced()
    key = _propagation_key(op_name, flat, tree)
    compute = _fake_outputs_of_call
    if any(is_runtime_number(x) for x in flat):
        compute = _fake_outputs_independent_of_runtime_numbers

    def cached() -> Any:
        return PROPAGATION_CACHE.get_or_compute(
            key, lambda: compute(op_name, torch_fn, args, kwargs), keep=_only_fake_tensors
        )

    mesh = mesh_of_uneven_shards(flat)
    if mesh is None:
        return cached()
    # every rank must decide alike whether the op runs: on uneven shards a fake run can fail on one rank's local
    # shapes only (a reduction over an empty shard), and the ranks would then trace programs whose collectives do
    # not pair up (fuzz seed 6176 at 4 ranks: a hang); each such call ends in one agreement of the ranks
    try:
        out, error = cached(), None
    except DTensorOpError as e:
        out, error = None, e
    failed_elsewhere = ti.any_rank_of_mesh(error is not None, mesh)
    if error is not None:
        raise error
    if failed_elsewhere:
        raise DTensorOpError(
            op_name,
            args,
            kwargs,
            "DTensor's rules fail on another rank's local shard of these uneven shards (an empty one, say); every "
            "rank takes the op the way the failing rank must",
        )
    return out


def mesh_of_uneven_shards(flat: list) -> Any:
    """The device mesh of the DTensor inputs where one of them is sharded unevenly (its local shapes differ from
    rank to rank: every rank computes every rank's, so all decide alike), else None."""
    inputs = [x for x in flat if isinstance(x, DTensorProxy)]
    if not inputs or any(x.device_mesh != inputs[0].device_mesh for x in inputs):
        return None
    return inputs[0].device_mesh if any(ti.sharded_unevenly(x.meta.spec) for x in inputs) else None


def _output_metadata(out: Any) -> list:
    """What the trace fixes of an op's outputs: each tensor's shape, dtype and spec; other values themselves."""
    leaves, _ = ti.torch_tree_flatten(out)
    return [
        (tuple(x.shape), x.dtype, ti.dtensor_spec(x) if isinstance(x, ti.DTensor) else None)
        if isinstance(x, torch.Tensor)
        else x
        for x in leaves
    ]


def _fake_outputs_independent_of_runtime_numbers(op_name: str, torch_fn: Callable, args: tuple, kwargs: dict) -> Any:
    """The fake outputs of a call that reads a number known only at run time, run with two stand-ins for it:
    where the output's shape, dtype or placements differ between them, the trace cannot fix them (a
    data-dependent shape), and the op is refused at trace time instead of fixing the stand-in's."""
    out = _fake_outputs_of_call(op_name, torch_fn, args, kwargs)
    _STAND_IN_CHOICE[0] = 1
    try:
        again = _fake_outputs_of_call(op_name, torch_fn, args, kwargs)
    finally:
        _STAND_IN_CHOICE[0] = 0
    if _output_metadata(out) != _output_metadata(again):
        raise DataDependentValueError(
            op_name,
            args,
            kwargs,
            "its output's shape, dtype or placements depend on a number read from the data at run time "
            "(an x.item() among its arguments), which a trace cannot fix",
            hint="keep shapes independent of tensor values under thunder.jit; thunderfx (thunder.dynamo) runs "
            "such code by splitting the graph, as for plain tensors",
        )
    return out


def _fake_outputs_of_call(op_name: str, torch_fn: Callable, args: tuple, kwargs: dict) -> Any:
    if is_generic_vjp(op_name):
        # the joint trace the lowering needs anyway answers without a fake run of its own (None: no answer)
        from thunder_dtensor.lowering import joint_gradients  # (the lowering builds on this module)

        gradients = joint_gradients(op_name, args)
        if gradients is not None:
            return gradients
    return _fake_outputs(op_name, torch_fn, args, kwargs)


def _only_fake_tensors(out: Any) -> bool:
    """Whether every tensor in ``out`` is fake: results of the real-zeros run (below) are not kept."""
    leaves, _ = ti.torch_tree_flatten(out)
    return all(ti.is_fake(x) for x in leaves if isinstance(x, torch.Tensor))


class WrongShapeError(DTensorOpError):
    """DTensor's rules accept the op but give it a global shape torch does not (eager returns that shape too)."""

    #: why the op runs replicated (``no_rule``): DTensor's rules accept it and compute it wrongly
    distrust = "DTensor's sharding rules give it a wrong output shape (a torch DTensor bug)"


class MisplacedViewError(WrongShapeError):
    """DTensor's rules accept a reshape and give it placements that say each rank holds other elements than it
    does (eager computes those wrong values too)."""

    distrust = "DTensor's sharding rule places the reshaped elements on other ranks than hold them (a torch bug)"


#: the reshapes whose output is the input's elements in row-major order (a view where strides allow)
RESHAPES = frozenset(
    {
        torch.reshape,
        torch.flatten,
        torch.unflatten,
        torch.Tensor.view,
        torch.Tensor.reshape,
        torch.Tensor.flatten,
        torch.Tensor.unflatten,
        torch.Tensor.view_as,
        torch.Tensor.reshape_as,
    }
)
#: above this many elements the reshape's placements are not checked (an index tensor of that size per rank)
_CHECKED_RESHAPE_NUMEL = 1 << 20


def reshape_can_misplace(spec: Any) -> bool:
    """Whether ``spec`` has a ``_StridedShard`` or a dim sharded over several mesh dims: the placements a reshape
    can misplace (a plain shard of one dim over one mesh dim keeps its meaning through a reshape DTensor accepts)."""
    dims = [p.dim for p in spec.placements if p.is_shard() or ti.is_strided_shard(p)]
    return any(ti.is_strided_shard(p) for p in spec.placements) or len(dims) != len(set(dims))


def _reshape_misplaced(torch_fn: Callable, args: tuple, out: Any) -> str:
    """How DTensor's placements for a reshape of a strided or multiply sharded value say each rank holds other
    elements than it does ("" where they agree, or where this is not checked).

    A torch DTensor bug found by the fuzzer: ``unflatten(0, (8, 14))`` of a ``_StridedShard(dim=0, sf=7)`` of 112
    elements is placed ``_StridedShard(dim=1, sf=7)`` (seed 10924), and on a 2x2 mesh ``reshape(4, 16)`` of a
    ``[64]`` placed ``(S(0), _StridedShard(0, sf=4))`` is placed ``(S(0), _StridedShard(1, sf=4))`` (seed 18148):
    each rank's local tensor is then read as elements it does not hold.

    DTensor's own reassembly is the judge, replayed at trace time: each rank's local tensor is given distinct
    element ids, reshaped locally as eager does, and the output spec's ``full_tensor()`` must equal the input
    spec's ``full_tensor()`` reshaped. Every rank traces the same program and decides from the global spec, so
    each runs the same collectives; the verdict, from replicated values, is the same on every rank."""
    x = args[0] if args else None
    if torch_fn not in RESHAPES or not isinstance(x, DTensorProxy):
        return ""
    outs = [t for t in ti.torch_tree_flatten(out)[0] if isinstance(t, ti.DTensor)]
    if len(outs) != 1:
        return ""
    before, after = x.meta.spec, ti.dtensor_spec(outs[0])
    numel = math.prod(tuple(x.shape))
    if not (reshape_can_misplace(before) or reshape_can_misplace(after)):
        return ""
    if numel > _CHECKED_RESHAPE_NUMEL or numel != math.prod(tuple(outs[0].shape)):
        return ""
    held = _distinct_element_ids(x, numel)
    if held is None:  # this rank is not in the mesh: it takes no part in the mesh's collectives
        return ""
    if _mesh_dim_kinds(before) != _mesh_dim_kinds(after):
        return _redistributing_reshape_misplaced(x, held, tuple(outs[0].shape), before, after)
    local_out_shape = tuple(ti.local_tensor(outs[0]).shape)
    local_out = torch.full((math.prod(local_out_shape),), -1, dtype=held.dtype, device=held.device)
    kept = min(held.numel(), local_out.numel())  # (a rank whose count differs must still join the collectives)
    local_out[:kept] = held.reshape(-1)[:kept]
    try:
        with torch.no_grad():
            want = ti.dtensor_around(held, ti.spec_without_partials(before)).full_tensor()
            got = ti.dtensor_around(local_out.reshape(local_out_shape), ti.spec_without_partials(after)).full_tensor()
    except Exception as e:  # torch's reassembly itself fails for some strided specs (fuzz seed 15430): on every rank
        return f"output placements {tuple(after.placements)} that DTensor cannot reassemble ({first_line(e)})"
    want = want.reshape(tuple(outs[0].shape))
    if got.shape == want.shape and torch.equal(got, want):
        return ""
    first = int((got.reshape(-1) != want.reshape(-1)).nonzero()[0]) if got.shape == want.shape else 0
    return (
        f"output placements {tuple(after.placements)} for a reshape of {tuple(before.placements)}: its shards "
        f"reassemble into other elements than the input's, reshaped (first at flat index {first})"
    )


def _mesh_dim_kinds(spec: Any) -> tuple[str, ...]:
    """Which mesh dims hold a sum pending, a replica or a shard: a reshape that changes them has redistributed its
    input first (a Partial reduce-scattered, a shard gathered), and each rank's output is not its shard reshaped."""
    return tuple("partial" if p.is_partial() else "replicate" if p.is_replicate() else "shard" for p in spec.placements)


def _redistributing_reshape_misplaced(
    x: DTensorProxy, held: torch.Tensor, shape: tuple[int, ...], before: Any, after: Any
) -> str:
    """:func:`_reshape_misplaced` where DTensor redistributes the input before reshaping it: eager's reshape itself
    is replayed on the element ids, laid out as eager's shard, and its output must hold the input's ids reshaped
    (a Partial input's ids are summed, alike on both sides). Fuzz seed 19376 (2x2 mesh): the cotangent of an
    ``unflatten``, ``[2, 2]`` placed ``(S(0), Partial())`` with a transposed stride, goes back to ``[4]`` placed
    ``(S(0), _StridedShard(0, sf=1))``: DTensor reduce-scatters the Partial, right, and the replay of a local
    reshape alone read that as misplaced (the gradient then ran replicated, placed otherwise than eager's)."""
    local = _laid_out_as_eager(x, held.to(torch.float64))  # (exact ids; a Partial's reduce-scatter sums them)
    try:
        with torch.no_grad():
            source = ti.dtensor_around(local, before)
            out = source.reshape(shape)
            want, got = source.full_tensor().reshape(shape), out.full_tensor()
    except Exception as e:  # on every rank: each decides from the global specs
        return f"output placements {tuple(after.placements)} that DTensor cannot reassemble ({first_line(e)})"
    if tuple(out.placements) != tuple(after.placements):
        return f"output placements {tuple(after.placements)}, which eager's reshape of the ids does not give"
    if torch.equal(got, want):
        return ""
    return (
        f"output placements {tuple(after.placements)} for a reshape of {tuple(before.placements)}, redistributed "
        "first: its shards reassemble into other elements than the input's, reshaped"
    )


def _distinct_element_ids(x: DTensorProxy, numel: int) -> torch.Tensor | None:
    """This rank's local tensor of ``x`` filled with ids no rank holding other elements uses (ranks that differ
    only along replicated or partial mesh dims hold the same ids, as they hold the same elements)."""
    spec = x.meta.spec
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return None
    key = 0
    for mesh_dim, placement in enumerate(spec.placements):
        if placement.is_shard() or ti.is_strided_shard(placement):
            key = key * spec.mesh.size(mesh_dim) + coordinate[mesh_dim]
    device = ti.devices.to_torch_device(x.device)
    local_numel = math.prod(tuple(x.local_shape))
    return (torch.arange(local_numel, device=device) + key * numel).reshape(tuple(x.local_shape))


def _shapes_unlike_torch(torch_fn: Callable, args: tuple, kwargs: dict, out: Any) -> str:
    """How the DTensor outputs' global shapes differ from the op's outputs on plain tensors ("" if they do not).

    A torch DTensor bug found by the fuzzer: ``F.linear`` / ``matmul`` of a 1-D input with a Partial result is a
    DTensor of global shape ``[1, N]`` (its decomposition squeezes in place). No answer if the plain op fails.
    """
    try:
        with ti.fake_tensor_mode(), torch.no_grad():
            plain_args, plain_kwargs = ti.tree_map(_plain_stand_in, (args, kwargs))
            plain = torch_fn(*plain_args, **plain_kwargs)
    except Exception:
        return ""
    got = [tuple(t.shape) for t in ti.torch_tree_flatten(out)[0] if isinstance(t, ti.DTensor)]
    want = [tuple(t.shape) for t in ti.torch_tree_flatten(plain)[0] if isinstance(t, torch.Tensor)]
    if len(got) != len(want) or got == want:
        return ""
    return f"output shapes {got}, where torch gives {want} on plain tensors of the global shapes"


def _caused_by(error: BaseException | None, kind: type | tuple) -> bool:
    """Whether ``error`` or an exception it was raised from is a ``kind``."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _fake_outputs(op_name: str, torch_fn: Callable, args: tuple, kwargs: dict) -> Any:
    def rejected(e: Exception) -> DTensorOpError:
        # DTensor's own rejection, reported with our context and a hint that fits its cause
        if structural_hint(args, kwargs):
            return DTensorOpError(op_name, args, kwargs, f"{type(e).__name__}: {e}")
        plain_error = _runs_on_fake(torch_fn, args, kwargs, _plain_stand_in)
        if isinstance(plain_error, ti.UNKNOWABLE_ON_FAKE_TENSORS):  # nonzero, unique, masked_select, x[mask]
            return DataDependentValueError(
                op_name,
                args,
                kwargs,
                f"its output's shape depends on the data ({type(plain_error).__name__}), which a trace cannot fix; "
                f"plain thunder refuses it on plain tensors too (DTensor: {type(e).__name__}: {first_line(e)})",
                hint="compute it on local tensors outside the jitted function (x.full_tensor() or x.to_local()), "
                "or keep shapes fixed (torch.where with a mask instead of selecting with it)",
            )
        return DTensorOpError(
            op_name, args, kwargs, f"{type(e).__name__}: {e}", hint=suggest_fix(torch_fn, args, kwargs)
        )

    # as at run time, where a prim that is not lowered runs under no_grad on inputs that may require grad
    try:
        with ti.fake_tensor_mode(), torch.no_grad():
            fake_args, fake_kwargs = ti.tree_map(_runtime_like_stand_in, (args, kwargs))
            out = torch_fn(*fake_args, **fake_kwargs)
    except Exception as e:
        # DTensor's propagation re-raises what it hit as a RuntimeError: the cause decides
        if not _caused_by(e, ti.DataDependentOutputException):
            raise rejected(e) from e
        # A few sharding rules read data (vocab-sharded embedding masks ids, a _StridedShard scalar operand):
        # run those on real zeros. Every rank traces the same program, so any collective this runs is matched
        # on all ranks.
        try:
            with torch.no_grad():
                zero_args, zero_kwargs = ti.tree_map(lambda x: _runtime_like_stand_in(x, torch.zeros), (args, kwargs))
                out = torch_fn(*zero_args, **zero_kwargs)
        except Exception as zeros_error:
            raise rejected(zeros_error) from zeros_error
        read = [type(x).__name__ for x in ti.torch_tree_flatten(out)[0] if not isinstance(x, torch.Tensor)]
        if read:  # a Python value read from the data: the zeros' value would become a constant of the trace
            raise DataDependentValueError(
                op_name,
                args,
                kwargs,
                f"it reads the data into a Python value ({', '.join(read)}), which a trace cannot fix; plain "
                "thunder refuses it on plain tensors too",
                hint=READ_AT_RUN_TIME_HINT,
            ) from e
    ti.note_trace_time_masks(out)  # a masked lookup's mask, emptied when the compilation ends
    if type(out).__module__ == "torch.return_types":  # structseq outputs (torch.max(x, dim), ...) trace as tuples
        out = tuple(out)
    record = PRIMS.get(op_name)
    checked = record is not None and record.shape_checked
    wrong = _shapes_unlike_torch(torch_fn, args, kwargs, out) if checked else ""
    if wrong:
        raise WrongShapeError(
            op_name,
            args,
            kwargs,
            f"DTensor's sharding rules give {wrong} (a torch DTensor bug; eager DTensor returns the wrong shape)",
            hint="redistribute the inputs to Replicate first, or give a 1-D input a batch dim (x.unsqueeze(0))",
        )
    misplaced = _reshape_misplaced(torch_fn, args, out) if checked else ""
    if misplaced:
        raise MisplacedViewError(
            op_name,
            args,
            kwargs,
            f"DTensor's sharding rules give {misplaced} (a torch DTensor bug; eager DTensor computes wrong values)",
            hint="redistribute the input to Replicate first",
        )
    return out


#: a collective's failure (a peer gone, a timeout): no fault of the op's placements or layouts
_COMMUNICATION_ERRORS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(torch.distributed, "DistError", None),) if isinstance(e, type) and issubclass(e, BaseException)
)


def _reporting_eager_errors(op_name: str, runtime_fn: Callable) -> Callable:
    """``runtime_fn`` as the program runs it: eager DTensor raising there (the trace's fake run passed) is reported
    with the op, its inputs' placements and a hint, where torch's message names neither. The fake run sees specs,
    not the local shards' strides: fuzz seed 19425 flattens a value redistributed from ``S(2)`` to ``S(0)``, whose
    local shard from gloo's all-to-all fallback is not viewable, and eager's ``flatten`` raises "view size is not
    compatible" (eager DTensor raises the same)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return runtime_fn(*args, **kwargs)
        except DTensorOpError:
            raise
        except RuntimeError as e:
            if isinstance(e, _COMMUNICATION_ERRORS):
                raise
            raise DTensorOpError(
                f"{op_name} (eager DTensor, as the program ran)",
                args,
                kwargs,
                f"{type(e).__name__}: {e}",
                hint="eager DTensor raises this at run time for these placements and the local shards' layouts, "
                "which the trace's fake run does not see (a shard's strides: of a redistribute's result, or of "
                "DTensor.from_local after a local op); thunder.jit's lowering (dtensor_lowering=True, the default) "
                "runs the op on local shards instead; or make the input contiguous (x.contiguous()) or "
                "redistribute it (e.g. to Replicate) before the op",
            ) from e

    run.__name__ = getattr(runtime_fn, "__name__", op_name)
    return run


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


def define_dtensor_prim(
    name: str,
    torch_fn: Callable,
    *,
    meta: Callable | None = None,
    execute: Callable | None = None,
    differentiable: bool = True,
    tags: tuple = (),
    not_lowered: str | None = None,
    renames_arguments: bool = False,
) -> ti.Symbol:
    """Create ``dtensor_<name>_prim`` and register its execution on the dtensor executor.

    ``torch_fn`` is the torch operation on DTensors; by default it is both the meta's fake run and the
    runtime implementation. ``meta`` and ``execute`` override them where the two differ (a prim that
    takes thunder dtypes, say). A differentiable prim starts with the generic grad rule (see
    :func:`run_vjp`); ``define_vjp`` replaces it with a dedicated one. ``not_lowered`` (a reason) keeps the
    prim out of the lowering: it then always runs as the eager DTensor op. ``renames_arguments``: see
    :class:`PrimRecord`.
    """
    prim_name = f"dtensor_{name}_prim"
    ti.check(prim_name not in PRIMS, lambda: f"{prim_name} is already defined")
    runtime_fn = execute or torch_fn

    def _meta(*args: Any, **kwargs: Any) -> Any:
        if meta is not None:
            return meta(*args, **kwargs)
        return propagate_on_fake_dtensors(prim_name, torch_fn, args, kwargs)

    _meta.__name__ = prim_name
    prim = ti.make_prim(f"thunder_dtensor.{prim_name}", prim_name, meta=_meta, tags=tags)
    op = dtensor_ex.register_operator(
        prim_name, like=prim, fn=_reporting_eager_errors(prim_name, runtime_fn), tags=list(tags)
    )
    dtensor_ex.register_implementation(prim, op, checker=_always)
    record = add_prim_record(prim, runtime_fn=runtime_fn, not_lowered=not_lowered, renames_arguments=renames_arguments)
    if differentiable:
        _register_generic_vjp(record, name)
    else:  # no gradient flows through it (factories, guards, vjps)
        ti.register_grad(prim, prim)
    return prim


def _no_op(*args: Any) -> None:
    return None


def _kept_no_op(name: str, why: str) -> ti.Symbol:
    """A prim that computes nothing and that dead-code elimination keeps (it says something in the trace)."""
    return define_dtensor_prim(
        name, _no_op, meta=_no_op, differentiable=False, tags=(ti.OpTags.DONT_DCE,), not_lowered=why
    )


#: a backward step that computes nothing and is never removed (see the generic grad rule)
_undefined_gradients = _kept_no_op("undefined_gradients", "a kept no-op (a backward that computes no gradient)")

#: put by the lowering after the local ops of a rewritten prim, so that the executed trace still names it:
#: ``dtensor_rewritten_prim((), 'Tensor_addbmm', 'replicated fallback')`` (unlowered, the prim's own name says it)
dtensor_rewritten_prim = _kept_no_op("rewritten", "a kept no-op that names a rewritten op")


def _is_differentiable(x: Any) -> bool:
    # Not filtered on requires_grad: thunder's intermediate proxies do not carry it reliably (a value made by
    # a single-device op from a trainable one may say False); thunder drops gradients nobody needs.
    return isinstance(x, ti.TensorProxy) and ti.dtypes.is_inexact_dtype(x.dtype)


def _is_program_input(proxy: Any) -> bool:
    """Whether ``proxy`` is an argument of the program being differentiated (the joint trace keeps its args)."""
    trace = ti.get_tracectx()
    flat = ti.tree_flatten((trace.args, trace.kwargs))[0] if trace is not None else ()
    return any(isinstance(a, ti.Proxy) and a.name == proxy.name for a in flat)


def put_gradient(operand: Any, grad: Any) -> None:
    """Give a dtensor prim's operand its gradient (``prims.put_grad``), the one place the rules hand them over.

    A plain tensor (a 0-dim one: DTensor takes it as a scalar) gets a DTensor gradient, as in eager DTensor's
    backward (a ``Partial(sum)`` one for a scale multiplied into a sharded value). Where that plain tensor is a
    program input, the DTensor gradient is its ``.grad``, as eager's. Where a plain op made it (``s.exp()``),
    thunder's grad rule of that op takes the gradient as a plain tensor of the operand's kind: it gets the
    gradient's full value (the Partial sum reduced), so the plain ops' backward runs on plain tensors.
    """
    if isinstance(grad, DTensorProxy) and not isinstance(operand, DTensorProxy) and not _is_program_input(operand):
        from thunder_dtensor.dispatch import dtensor_callable_for  # (the dispatcher imports this module)

        full_tensor = dtensor_callable_for(ti.DTensor.full_tensor)
        ti.check(full_tensor is not None, lambda: "DTensor.full_tensor has no dtensor symbol registered")
        grad = cast(Callable, full_tensor)(grad)
    ti.put_grad(operand, grad)


def _cotangent_or_none(out: Any) -> Any:
    if isinstance(out, ti.TensorProxy) and ti.dtypes.is_inexact_dtype(out.dtype):
        return ti.get_grad(out)
    return None


def forward_and_gradients(
    torch_fn: Callable,
    flat: list,
    tree: Any,
    diff_indices: tuple,
    cotangents: Mapping[int, Any],
    forward_context: Any = None,
) -> tuple[list, tuple]:
    """The generic vjp, the one implementation: ``torch_fn``'s tensor outputs on the arguments ``flat`` (torch's
    pytree ``tree``) and torch autograd's gradients w.r.t. the arguments at ``diff_indices``, for ``cotangents``
    (output position -> cotangent). :func:`run_vjp` runs it on DTensors (fake at trace time, real in the
    backward); the lowering traces it on DTensors around fake local tensors (``lowering.tracing.trace_joint``).
    ``forward_context`` wraps the forward only (``run_vjp``'s recomputation leaves the generators as they were).
    """
    with torch.enable_grad(), forward_context or contextlib.nullcontext():
        leaves = {i: flat[i].detach().requires_grad_() for i in diff_indices}
        fargs, fkwargs = ti.torch_tree_unflatten([leaves.get(i, x) for i, x in enumerate(flat)], tree)
        outs = [o for o in ti.torch_tree_flatten(torch_fn(*fargs, **fkwargs))[0] if isinstance(o, torch.Tensor)]
    pairs = [(outs[i], c) for i, c in cotangents.items() if i < len(outs) and c is not None and outs[i].requires_grad]
    if not pairs or not leaves:
        ti.release_recomputed_masks(outs)
        return outs, tuple(None for _ in diff_indices)
    grads = torch.autograd.grad(
        [o for o, _ in pairs], [leaves[i] for i in diff_indices], [c for _, c in pairs], allow_unused=True
    )
    ti.release_recomputed_masks(outs)  # (a masked lookup's mask: no reduction of these outputs releases it)
    return outs, tuple(grads)


def run_vjp(torch_fn: Callable, args: tuple, kwargs: dict, cotangents: tuple, diff_indices: tuple) -> tuple:
    """Gradients of ``torch_fn(*args, **kwargs)`` w.r.t. the flat inputs at ``diff_indices``.

    Runs torch autograd on DTensors (:func:`forward_and_gradients`): on fake DTensors at trace time (the
    gradients' specs), on the runtime DTensors in the backward. The gradients are eager DTensor's, placements
    included, because they are computed by eager DTensor's own backward. The forward is recomputed: the price
    of generality.
    """
    flat, tree = ti.torch_tree_flatten((args, kwargs))
    by_output = dict(enumerate(cotangents))
    # Some inputs cannot be differentiated (a loss's class weights): torch says so when they require grad,
    # in the forward. Drop those, one at a time from the last, and give them no gradient.
    for dropped in range(len(diff_indices) + 1):
        kept = diff_indices[: len(diff_indices) - dropped] if dropped else diff_indices
        try:
            # the recomputation leaves the random generators as they were: eager's backward draws no numbers (a
            # random op replays its forward's draw from a generator state it takes as an argument: see attention)
            _, grads = forward_and_gradients(torch_fn, flat, tree, kept, by_output, ti.fork_rng_of(flat))
            break
        except RuntimeError as e:
            if "not differentiable with respect to argument" not in str(e) or not kept:
                raise
    by_index = dict(zip(kept, grads))
    return tuple(by_index.get(i) for i in diff_indices)


def _is_partial_extremum(placement: Any) -> bool:
    return placement.is_partial() and getattr(placement, "reduce_op", "sum") in ("max", "min")


#: full reductions to an extremum whose backward compares the input with the output
_EXTREMUM_REDUCTIONS = ("amin", "amax")


def _backward_distrusted(inputs: list, outs: list, op_name: str = "") -> str | None:
    """Why eager DTensor's backward of the op ``op_name`` with these outputs gives wrong gradients, or None.

    A 0-dim output that is ``Partial(max)`` / ``Partial(min)`` (``amax`` of a whole sharded tensor, an
    inf-norm) holds each rank's own extremum until reduced; torch's backward compares the input with that
    saved value, which DTensor does not reduce first when it is 0-dim, so every rank finds its own extremum
    and the gradient is wrong (nan / inf where no element matches). A reduction over some dims is right, and
    an op that only passes such a value on (a clone of an input that is already partial) is too.

    ``amin`` / ``amax`` of a whole input that is ``Partial(sum)`` on one mesh dim and sharded on another
    (fuzz seed 13001, a 2x2 mesh): eager's gradient is nan everywhere (its backward's mask compares values
    that are not the reduced ones, and a rank without a match divides by a count of 0), measured for both
    ops and both shard dims; the same input on a 1-D mesh, or replicated on the other dim, is right.
    """
    if op_name.rsplit("_", 1)[-1] in _EXTREMUM_REDUCTIONS and any(
        isinstance(o, DTensorProxy) and o.ndim == 0 for o in outs
    ):
        for x in inputs:
            placements = tuple(x.placements) if isinstance(x, DTensorProxy) else ()
            partial_sum = any(p.is_partial() and not _is_partial_extremum(p) for p in placements)
            if partial_sum and any(p.is_shard() for p in placements):
                return (
                    f"eager DTensor's backward of {op_name} over an input placed {placements} gives nan "
                    "gradients (its mask compares unreduced values)"
                )
    if any(isinstance(x, DTensorProxy) and any(p.is_partial() for p in x.placements) for x in inputs):
        return None
    for o in outs:
        if isinstance(o, DTensorProxy) and o.ndim == 0:
            bad = [p for p in o.placements if _is_partial_extremum(p)]
            if bad:
                return (
                    f"eager DTensor's backward compares the input with the unreduced {bad[0]} output, "
                    "which gives each rank its own extremum (wrong gradients)"
                )
    return None


def _reshape_gradient_misplaced(runtime_fn: Any, inputs: list, cotangents: tuple) -> str | None:
    """Why eager DTensor's gradient of a reshape is wrong for these cotangents, or None.

    The backward reshapes the cotangent to the input's shape, and DTensor's rule can name other elements than each
    rank holds for a reshape of a strided shard (:func:`_reshape_misplaced`), as for a forward reshape: fuzz seed
    17382, ``softmax(x).reshape(2, 6, -1).unflatten(2, (6, 4)) * g`` with ``g`` placed ``S(0)``, where the cotangent
    ``S(3)`` goes back to ``x``'s shape placed ``_StridedShard(3, sf=6)`` and every gradient of ``x`` was wrong."""
    if runtime_fn not in RESHAPES or not inputs or len(cotangents) != 1:
        return None
    x, cotangent = inputs[0], cotangents[0]
    if not isinstance(x, DTensorProxy) or not isinstance(cotangent, DTensorProxy):
        return None
    if not any(p.is_shard() or ti.is_strided_shard(p) for p in cotangent.placements):
        return None
    args = (cotangent, tuple(x.shape))
    try:
        out = propagated_fakes("reshape (a reshape's gradient)", torch.reshape, args, {})
    except DTensorOpError:
        return None
    misplaced = _reshape_misplaced(torch.reshape, args, out)
    if not misplaced:
        return None
    return f"eager DTensor's gradient of a reshape takes {misplaced} (a torch bug: wrong gradients)"


def is_generic_vjp(name: str) -> bool:
    """Whether ``name`` is a generic vjp prim (or its executor operator, which has the prim's name)."""
    record = PRIMS.get(name)
    return record is not None and record.is_generic_vjp


@dataclasses.dataclass
class _BackwardCall:
    call_or_rewrite: Callable | None = None
    replicated: Callable | None = None


#: how a generic vjp is called (:func:`call_backwards_with`)
_BACKWARD_CALL = _BackwardCall()


def call_backwards_with(call_or_rewrite: Callable, replicated: Callable) -> None:
    """How generic vjps are called: ``ops/no_rule.py`` (which builds on this module) gives its policy, a
    backward DTensor has no rule for being decomposed, else replicated. Set at import, before any tracing."""
    _BACKWARD_CALL.call_or_rewrite, _BACKWARD_CALL.replicated = call_or_rewrite, replicated


def _reporting_eager_backward_errors(op_name: str, vjp: Callable) -> Callable:
    """``vjp`` as run in the backward: eager DTensor's own backward of ``op_name`` raising there (its fake run
    at trace time passed) is reported with the op, its inputs' and cotangents' placements and a hint, where
    torch's message names neither (fuzz seed 13001: a ``view`` of a cotangent whose local layout DTensor's
    backward of ``unflatten`` cannot view, as eager's own backward raises)."""

    def run(args: tuple, kwargs: dict, cotangents: tuple, diff_indices: tuple) -> tuple:
        try:
            return vjp(args, kwargs, cotangents, diff_indices)
        except DTensorOpError:
            raise
        except RuntimeError as e:
            raise DTensorOpError(
                f"{op_name} backward (eager DTensor's autograd, on the inputs and then the cotangents below)",
                (args, cotangents),
                kwargs,
                f"{type(e).__name__}: {e}",
                hint=f"eager DTensor's autograd raises this for these placements and layouts (the trace's fake run "
                f"did not); where thunder.jit's lowering (dtensor_lowering=True, the default) lowers {op_name}, it "
                f"differentiates it on local shards instead; or redistribute its input (DTensor.redistribute, "
                f"e.g. to Replicate) before {op_name}",
            ) from e

    return run


def _register_generic_vjp(record: PrimRecord, name: str) -> None:
    prim, runtime_fn = record.symbol, cast(Callable, record.runtime_fn)  # (a differentiable prim has one)
    vjp_source = functools.partial(run_vjp, runtime_fn)
    vjp_prim = define_dtensor_prim(
        f"{name}_vjp", vjp_source, execute=_reporting_eager_backward_errors(name, vjp_source), differentiable=False
    )
    PRIMS[vjp_prim.name].is_generic_vjp = True

    def vjp(*vjp_args: Any, distrust: str | None = None, quiet: bool = False) -> Any:
        # a backward DTensor has no rule for is decomposed, else replicated, as a forward op is (the policy is
        # ops/no_rule.py's, which builds on this module: it hands it over as it is imported)
        call_or_rewrite, replicated = _BACKWARD_CALL.call_or_rewrite, _BACKWARD_CALL.replicated
        ti.check(
            call_or_rewrite is not None and replicated is not None,
            lambda: "ops/no_rule.py gives how generic vjps are called",
        )
        return cast(Callable, call_or_rewrite)(
            vjp_prim,
            f"{name}_vjp",
            vjp_source,
            vjp_args,
            {},
            replicated_source=functools.partial(run_vjp, cast(Callable, replicated)(runtime_fn)),
            differentiable=False,
            distrust=distrust,
            quiet=quiet,
        )

    def vjp_per_input_if_rejected(
        args: tuple, kwargs: dict, cotangents: tuple, diff_indices: tuple, *, distrust: str | None, quiet: bool
    ) -> tuple:
        groups = [diff_indices]
        if (
            len(diff_indices) > 1
            and distrust is None
            and not _traces(vjp_prim.name, vjp_source, (args, kwargs, cotangents, diff_indices))
        ):
            # thunder asks for every input's gradient, read or not; torch decomposes by which inputs require grad
            # (matmul folds differently), so DTensor may reject the joint call where eager, asked for the
            # gradients it needs, runs: one call per input, and the backward's pruning drops the unread ones
            groups = [(i,) for i in diff_indices]
        return tuple(
            g for group in groups for g in vjp(args, kwargs, cotangents, group, distrust=distrust, quiet=quiet)
        )

    def distrusted(flat_inputs: list, outs: list, cotangents: tuple) -> str | None:
        # why eager's backward of this op is wrong for these outputs and cotangents (None: it is trusted)
        return _backward_distrusted(flat_inputs, outs, name) or _reshape_gradient_misplaced(
            runtime_fn, flat_inputs, cotangents
        )

    def grad_rule(*args: Any, **kwargs: Any) -> Any:
        out = prim(*args, **kwargs)
        # torch's pytree, as run_vjp uses at run time (thunder's orders dict keys differently)
        flat_inputs, _ = ti.torch_tree_flatten((args, kwargs))
        diff_indices = tuple(i for i, x in enumerate(flat_inputs) if _is_differentiable(x))
        if not diff_indices:
            return out
        outs = [o for o in ti.tree_flatten(out)[0] if isinstance(o, ti.TensorProxy)]
        cotangents = tuple(_cotangent_or_none(o) for o in outs)
        if all(c is None for c in cotangents):  # e.g. a comparison: nothing flows back
            return out
        distrust = distrusted(flat_inputs, outs, cotangents)
        # provisional: decided on stand-ins for the cotangents, again on those that flow (``decide_again``)
        grads = vjp_per_input_if_rejected(args, kwargs, cotangents, diff_indices, distrust=distrust, quiet=True)
        if all(grad is None for grad in grads):
            # torch's backward leaves every gradient undefined (a norm with ord=0), yet its output requires
            # grad: a kept no-op gives thunder a backward, so `backward()` runs and leaves `.grad` None
            _undefined_gradients(*(c for c in cotangents if c is not None))
        for i, grad in zip(diff_indices, grads):
            if grad is not None:
                put_gradient(flat_inputs[i], grad)
        return out

    def decide_again(args: tuple, kwargs: dict, cotangents: tuple, diff_indices: tuple) -> Any:
        # the forward's outputs say whether eager's backward is distrusted (a scratch scope: nothing is recorded)
        trace = ti.get_tracectx()
        ti.check(trace is not None, lambda: "a vjp decides again while a trace is being made")
        assert trace is not None  # (for mypy)
        trace.push_scope([])
        try:
            outs = [o for o in ti.tree_flatten(prim(*args, **kwargs))[0] if isinstance(o, ti.TensorProxy)]
        finally:
            trace.pop_scope()
        flat_inputs, _ = ti.torch_tree_flatten((args, kwargs))
        # per input where the joint call is rejected, as the grad rule decided on stand-ins (fuzz seed 20757: a
        # matmul's cotangent placed S(0) over an uneven batch, which only a call with the weight's gradient folds)
        distrust = distrusted(flat_inputs, outs, cotangents)
        return vjp_per_input_if_rejected(args, kwargs, cotangents, diff_indices, distrust=distrust, quiet=False)

    ti.register_grad(prim, grad_rule)
    record.grad_rule = record.generic_grad_rule = grad_rule
    PRIMS[vjp_prim.name].decide_again = decide_again


def vjp_call_deciding_again(name: str) -> Callable | None:
    """For a generic vjp prim, or the decomposed / replicated prim it was rewritten into: its call that decides
    again how it runs, given its four arguments; None for other symbols.

    The grad rule decides on a stand-in for the cotangent placed as the primal output. The cotangent that flows
    may be placed otherwise (``guards.propagate_gradient_specs`` traces each backward step again on it): DTensor
    may then accept a vjp it rejected (a gathered reshape's gradient, fuzz seed 10357: the replicated rewrite
    placed it as the primal, eager as the cotangent) or reject one it accepted.
    """
    record = PRIMS.get(name)
    if record is None:
        return None
    if record.rewritten is not None:
        record = PRIMS.get(f"dtensor_{record.rewritten[0]}_prim")
    return record.decide_again if record is not None else None


def _traces(op_name: str, torch_fn: Callable, args: tuple) -> bool:
    """Whether DTensor accepts ``torch_fn(*args)`` on fake DTensors (asked before a prim call, which cannot undo)."""
    try:
        propagated_fakes(op_name, torch_fn, args, {})
    except DTensorOpError:
        return False
    return True


def prune_unused_vjp_gradients(backward_trace: ti.TraceCtx) -> ti.TraceCtx:
    """Make each generic vjp compute only the gradients the backward uses.

    A generic vjp computes the gradients of all its differentiable inputs in one torch autograd call, so
    dead-code elimination cannot drop one of them: a frozen weight's gradient (a matmul, say) would still be
    computed. Walking the backward from its return, this narrows each vjp's ``diff_indices`` to the outputs
    that are read later (and drops a vjp nothing reads), as eager's autograd skips inputs that need no grad.
    """
    new_trace = ti.from_trace(backward_trace)
    new_trace.bound_symbols = without_unused_vjp_gradients(backward_trace.bound_symbols)
    return new_trace


def without_unused_vjp_gradients(bsyms: list) -> list:
    """``bsyms`` with each generic vjp narrowed to the gradients read later (see ``prune_unused_vjp_gradients``).

    The lowering needs this before it traces a joint: torch's decompositions depend on which inputs require
    grad (``matmul`` folds its batch into ``mm`` only when the smaller operand does), so a gradient nobody
    reads would change the local program, and the placements, from eager's.
    """
    used: set = set()
    kept: list = []
    for bsym in reversed(bsyms):
        if is_generic_vjp(bsym.sym.name):  # the prim, or its dtensor_ex operator after claiming
            args, kwargs, cotangents, diff_indices = bsym.args
            outs = tuple(bsym.output)
            needed = [i for i, o in enumerate(outs) if isinstance(o, ti.Proxy) and ti.variableify(o) in used]
            if not needed:
                continue
            if len(needed) < len(outs):
                narrowed = {
                    "args": (args, kwargs, cotangents, tuple(diff_indices[i] for i in needed)),
                    "output": tuple(outs[i] for i in needed),
                }
                # the prim the executor operator was claimed from is its subsymbol: narrow it alike
                subsymbols = [sub.from_bsym(**narrowed) for sub in bsym.subsymbols]
                bsym = bsym.from_bsym(**narrowed, subsymbols=subsymbols)
        used.update(ti.variableify(a) for a in bsym.flat_proxy_args)
        kept.append(bsym)
    return kept[::-1]


def _has_complex_tensor(args: tuple, kwargs: dict) -> bool:
    flat, _ = ti.tree_flatten((args, kwargs))
    return any(isinstance(x, ti.TensorProxy) and ti.dtypes.is_complex_dtype(x.dtype) for x in flat)


def define_vjp(
    prim: ti.Symbol, *, generic_when: Callable[[tuple, dict], bool] | None = None
) -> Callable[[Callable], Callable]:
    """Register the decorated ``vjp(g, out, *args, **kwargs) -> grads`` as ``prim``'s grad rule.

    ``grads`` holds one entry per positional argument (None where there is no gradient). The rule is
    written with dtensor prims, so gradients get the placements DTensor's propagation gives them, as in
    eager DTensor's backward. For several outputs, ``g`` is the tuple of their cotangents.

    Dedicated rules are written for real tensors: a call with a complex tensor keeps the generic rule, whose
    gradients are torch's (conjugate Wirtinger derivatives) by construction. ``generic_when(args, kwargs)``
    names further calls that keep the generic rule (eager's own backward, traced).
    """

    def register(vjp: Callable) -> Callable:
        record = PRIMS[prim.name]
        generic = record.generic_grad_rule

        def grad_rule(*args: Any, **kwargs: Any) -> Any:
            keep_generic = _has_complex_tensor(args, kwargs) or (
                generic_when is not None and generic_when(args, kwargs)
            )
            if generic is not None and keep_generic:
                return generic(*args, **kwargs)
            out = prim(*args, **kwargs)
            g = ti.tree_map(_cotangent_or_none, out) if isinstance(out, (tuple, list)) else ti.get_grad(out)
            grads = vjp(g, out, *args, **kwargs)
            for arg, grad in zip(args, grads):
                if isinstance(arg, ti.TensorProxy) and grad is not None:
                    put_gradient(arg, grad)
            return out

        ti.register_grad(prim, grad_rule)
        record.grad_rule = grad_rule
        return vjp

    return register


def define_dtensor_symbol(fn: Callable) -> ti.Symbol:
    """A torch-level dtensor symbol (``dtensor_mul``): it decomposes into dtensor prims in the trace.

    An output that is one of the inputs (``x.float()`` on a float DTensor) becomes a dtensor alias: thunder
    would otherwise insert its single-device ``shallow_copy``, which loses the DTensor.
    """

    @functools.wraps(fn)
    def with_fresh_outputs(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        inputs = {id(a) for a in ti.tree_flatten((args, kwargs))[0] if isinstance(a, DTensorProxy)}
        return ti.tree_map(lambda o: dtensor_alias_prim(o) if id(o) in inputs else o, out)

    return ti.torchsymbol(fn.__name__)(with_fresh_outputs)


dtensor_alias_prim = define_dtensor_prim("alias", lambda a: a.view_as(a))


def _view_of_all(a: Any, *parameters: Any) -> Any:
    return a.view_as(a)


def define_marker_prim(name: str, vjp: Callable, *, marks: str) -> ti.Symbol:
    """A prim that is a view of all of its first argument (no data moves), there to give that value a gradient rule
    of its own (``vjp(g, out, a, *parameters)``); its other arguments are the rule's parameters. Never lowered:
    ``marks`` says what it marks."""
    prim = define_dtensor_prim(name, _view_of_all, not_lowered=f"marks {marks} (a view of all of it: no data moves)")
    define_vjp(prim)(vjp)
    return prim


@define_vjp(dtensor_alias_prim)
def _alias_vjp(g, out, a):
    return (g,)
