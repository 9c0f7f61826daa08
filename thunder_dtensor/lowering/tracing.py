"""Tracing one dtensor prim with DTensor's own dispatch, on fake local tensors.

The prim's torch function runs on ``DTensor`` wrappers (the prim's input specs) around fake local tensors,
recorded as an aten graph (``_integration.trace_aten_graph``): the local ops DTensor runs on the shards and
the collectives its redistribution planner issues. A generic vjp's pair is traced as one joint function
(forward, then ``torch.autograd.grad``). Graphs, and why an op cannot be lowered, are cached by call signature
(:data:`GRAPH_CACHE`): repeated layers trace once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.lowering.graph import (
    NotLowerable,
    Traced,
    check_graph,
    drop_identity_views,
    has_mutation,
    out_of_place,
)
from thunder_dtensor.primitive import PRIMS, forward_and_gradients, is_runtime_number, to_torch_value
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.signature import SignatureCache, call_signature, describe_value
from thunder_dtensor.spec import contiguous_stride, dense_stride_like

import torch


@dataclasses.dataclass(frozen=True)
class LocalInput:
    """How a tensor argument enters the traced function: its local value's metadata and, for DTensors, spec."""

    spec: Any  # DTensorSpec, or None for a plain tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def unwrapped_outputs(outs: Any) -> tuple[list, list]:
    """Flat tensor outputs as local tensors, and their specs (None for plain tensors)."""
    flat = [o for o in ti.torch_tree_flatten(outs)[0] if isinstance(o, torch.Tensor)]
    locals_, specs = [], []
    for o in flat:
        if isinstance(o, ti.DTensor):
            locals_.append(ti.local_tensor(o))
            specs.append(ti.dtensor_spec(o))
        else:
            locals_.append(o)
            specs.append(None)
    return locals_, specs


#: traced graphs (or why an op cannot be lowered) by op and call signature: repeated layers trace once
GRAPH_CACHE = SignatureCache("lowering")


def trace_op(key: Any, fn: Callable, inputs: list[LocalInput]) -> Traced:
    result = GRAPH_CACHE.get_or_compute(key, lambda: _trace_or_reason(fn, inputs))
    if isinstance(result, NotLowerable):
        raise NotLowerable(*result.args)
    return result


def _trace_or_reason(fn: Callable, inputs: list[LocalInput]) -> Traced | NotLowerable:
    try:
        return _trace_uncached(fn, inputs)
    except NotLowerable as e:
        return e


def _trace_uncached(fn: Callable, inputs: list[LocalInput]) -> Traced:
    specs: list = []
    n_forward: list[int] = []
    forward: list[frozenset | None] = [None]

    def traced(*locals_: torch.Tensor) -> list:
        outs, out_specs, count, *forward_nodes = fn(*locals_)
        specs[:] = out_specs  # (a second run, when the recorder hands the trace to make_fx, replaces the first)
        n_forward[:] = [count]
        forward[:] = forward_nodes or [None]
        return outs

    try:
        # the caller's autocast (thunder compiles inside the user's call) must not cast what is traced here
        with ti.fake_tensor_logging_muted(), ti.no_ambient_autocast():
            graph = ti.trace_aten_graph(traced, [(i.shape, i.stride, i.dtype, i.device) for i in inputs])
        if has_mutation(graph):  # in-place ops on fresh values (an op run on a copy): made out of place
            out_of_place(graph)
        drop_identity_views(graph)
    except NotLowerable:
        raise
    except Exception as e:
        raise NotLowerable(f"DTensor's dispatch could not be traced ({type(e).__name__}: {str(e)[:120]})") from e
    result = Traced(graph, n_forward[0], specs, forward[0])
    check_graph(result.graph)
    return result


def trace_joint(
    name: str,
    flat: list,
    tree: Any,
    infos: list[tuple[int, LocalInput]],
    cot_positions: list[int],
    cot_infos: list[LocalInput],
    diff_indices: tuple,
) -> Traced:
    """The (cached) joint trace of prim ``name`` on these arguments, cotangents and differentiated inputs:
    forward + ``torch.autograd.grad`` of its torch operation on DTensors around the local arguments."""

    def joint(*locals_: torch.Tensor) -> tuple:
        ins, cots = locals_[: len(infos)], locals_[len(infos) :]
        values = values_of(flat, infos, ins)
        cotangents = {i: value_of(info, cot) for i, info, cot in zip(cot_positions, cot_infos, cots)}
        runtime_fn = cast(Callable, PRIMS[name].runtime_fn)  # (a traced prim has one)
        forward_nodes: list = [None]

        @contextlib.contextmanager
        def noting_the_forward() -> Iterator[None]:
            yield
            forward_nodes[0] = ti.nodes_traced_so_far()

        outs, grads = forward_and_gradients(runtime_fn, values, tree, diff_indices, cotangents, noting_the_forward())
        fwd_locals, fwd_specs = unwrapped_outputs(outs)
        grad_locals: list[torch.Tensor | None] = []
        grad_specs: list[Any] = []
        for g in grads:
            grad_local, spec = (None, None) if g is None else (lambda r: (r[0][0], r[1][0]))(unwrapped_outputs(g))
            grad_locals.append(grad_local)
            grad_specs.append(spec)
        return fwd_locals + grad_locals, fwd_specs + grad_specs, len(fwd_locals), forward_nodes[0]

    key = graph_key("joint", name, flat, tree, infos, (tuple(cot_infos), diff_indices))
    return trace_op(key, joint, [i for _, i in infos] + cot_infos)


def graph_key(kind: str, name: str, flat: list, tree: Any, infos: list[tuple[int, LocalInput]], extra: Any = ()) -> Any:
    """The graph cache key: op, the call's structure and, in order, every tensor argument's local metadata and
    spec and every other argument's value (None: not cacheable)."""
    by_position = dict(infos)

    def describe(position_and_value: tuple[int, Any]) -> Any:
        i, x = position_and_value
        if i in by_position:
            info = by_position[i]
            # equal specs may sit on meshes with other process groups, which the traced collectives name
            return (info, None if info.spec is None else describe_value(info.spec.mesh))
        if is_runtime_number(x):  # a traced graph would hold its trace-time stand-in
            raise NotLowerable(f"it reads {x.name}, a number read from the data at run time")
        value = to_torch_value(x)
        if isinstance(value, torch.Tensor):
            raise NotLowerable("a tensor constant among the arguments")
        return describe_value(value)

    return call_signature((kind, name, extra), list(enumerate(flat)), tree, describe)


def value_of(info: LocalInput, local: torch.Tensor) -> Any:
    return local if info.spec is None else ti.dtensor_around(local, info.spec)


def values_of(flat: list, infos: list[tuple[int, LocalInput]], locals_: tuple) -> list:
    values = [to_torch_value(x) for x in flat]
    for (i, info), local in zip(infos, locals_):
        values[i] = value_of(info, local)
    return values


def dtensor_info(x: DTensorProxy, spec: Any, local_stride: tuple[int, ...] | None) -> LocalInput:
    """A DTensor argument's local metadata under ``spec``: ``local_stride`` where known, else contiguous.

    A contiguous local value goes with a contiguous global stride: a DTensor's stride says how its local
    tensor is laid out (DTensor decides view or copy by it), so a spec that kept another value's stride
    around a contiguous local would make DTensor view where it must copy.
    """
    dtype, device = x.meta.dtype, cast(torch.device, ti.devices.to_torch_device(x.device))
    if local_stride is not None:
        return LocalInput(spec, x.local_shape, local_stride, dtype, device)
    shape = ti.local_shape_on(tuple(x.shape), spec.mesh, tuple(spec.placements))
    return LocalInput(contiguous_spec(spec), shape, contiguous_stride(shape), dtype, device)


def eager_result_info(x: DTensorProxy, spec: Any) -> LocalInput:
    """The local metadata an eager DTensor result is read with: dense in the layout its spec's global stride gives.

    An op run as eager DTensor lays its local result out as its inputs were (a comparison of a transposed value
    is transposed), and its spec's global stride says so. Reading it contiguous would record a contiguous global
    stride where eager's is not, and a later op (a matmul's reshape) could decompose otherwise than eager's and
    place its result otherwise (fuzz seed 13001). Where the global stride is not dense, the value is read
    contiguous.
    """
    shape, stride = tuple(spec.tensor_meta.shape), tuple(spec.tensor_meta.stride)
    if stride == contiguous_stride(shape) or stride != dense_stride_like(shape, stride):
        return dtensor_info(x, spec, None)
    local_shape = ti.local_shape_on(shape, spec.mesh, tuple(spec.placements))
    return dtensor_info(x, spec, dense_stride_like(local_shape, stride))


def contiguous_spec(spec: Any) -> Any:
    """``spec`` with the row-major global stride (the layout of a DTensor around a contiguous local tensor)."""
    shape = tuple(spec.tensor_meta.shape)
    stride = contiguous_stride(shape)
    return spec if tuple(spec.tensor_meta.stride) == stride else ti.spec_with_sizes(spec, shape, stride)


def contiguous_info(x: ti.TensorProxy) -> LocalInput:
    """A plain tensor argument whose strides nothing fixes: it is made contiguous where it enters lowered code."""
    shape = tuple(x.shape)
    dtype, device = ti.dtypes.to_torch_dtype(x.dtype), ti.devices.to_torch_device(x.device)
    return LocalInput(None, shape, contiguous_stride(shape), cast(torch.dtype, dtype), cast(torch.device, device))


def assumed_cotangent_info(cotangent: Any) -> LocalInput:
    """The cotangent thunder traced the backward for: its output's cotangent spec, contiguous."""
    if isinstance(cotangent, DTensorProxy):
        return dtensor_info(cotangent, cotangent.meta.spec, None)
    return contiguous_info(cotangent)
