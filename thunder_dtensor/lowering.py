"""Lowering: a DTensor program becomes local-tensor ops plus explicit collectives, at trace time.

One whole-program transform over the joint (forward + backward) trace, run just before thunder assigns
executors. For each dtensor prim, DTensor's own dispatch is traced on fake local tensors (``DTensor`` wrappers
around them with the prim's input specs; ``_integration.trace_aten_graph``, the graph ``make_fx`` would record,
at less cost): what comes out is the aten ops DTensor runs
on the local shards and the ``_c10d_functional`` collectives its redistribution planner issues. Those become
trace symbols: thunder's own symbol where thunder has one of the same meaning (``thunder_equivalents``: any
thunder executor can claim and fuse it), else ``aten_<op>`` (one ATen call), and the collectives with their
mesh dim. Nothing of the sharding logic is written here: the decisions are DTensor's.

The backward does not rerun the forward. A prim with the generic grad rule appears twice in the joint trace:
forward (``dtensor_X_prim``) and backward (``dtensor_X_vjp_prim``, which would recompute it). The pair is
traced once as one joint function (forward, then ``torch.autograd.grad``); the nodes the forward outputs
need go to the forward's place, the rest to the backward's, reading the forward's values (thunder's split
saves them). Dedicated grad rules are written with dtensor prims and lower like any forward prim.

At the program's boundary, DTensor inputs (and autograd's cotangents) are unwrapped (``_local_tensor``),
outputs and gradients wrapped with their trace-time specs. A prim that cannot be lowered (random ops, ops
that mutate, data-dependent outputs) runs as before, the eager DTensor op, between a wrap and an unwrap, and
the trace says why. ``thunder.jit(fn, dtensor_lowering=False)`` keeps today's path for the whole program.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.primitive import (
    GRADIENT_SOURCES,
    PRIMS,
    dtensor_rewritten_prim,
    is_generic_vjp,
    is_runtime_number,
    propagate_on_fake_dtensors,
    to_torch_value,
    without_unused_vjp_gradients,
)
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.signature import SignatureCache, call_signature, describe_value
from thunder_dtensor.spec import DTensorMeta, contiguous_stride
from thunder_dtensor.thunder_equivalents import thunder_equivalent

import torch

__all__ = ["LOWERING_OPTION", "lower_dtensor_program", "lowering_enabled", "dtensor_local_ex", "dtensor_comm_ex"]

#: the thunder compile option (``thunder.jit(fn, dtensor_lowering=False)``) that keeps the eager-prim path
LOWERING_OPTION = "dtensor_lowering"

#: local ATen ops (one ATen call each); a dtensor executor, so they run whatever executors the user passes
dtensor_local_ex = ti.OperatorExecutor("dtensor_local")
ti.add_dtensor_executor(dtensor_local_ex)

#: collectives and the DTensor boundary (wrap / unwrap); no fusion executor has these symbols
dtensor_comm_ex = ti.OperatorExecutor("dtensor_comm")
ti.add_dtensor_executor(dtensor_comm_ex)


class NotLowerable(Exception):
    """This prim runs as the eager DTensor op; the message says why (it goes into the trace)."""


def lowering_enabled() -> bool:
    value = ti.get_compile_option(LOWERING_OPTION, "lower DTensor ops to local ops plus explicit collectives")
    return True if value is None else bool(value)


# ---------------------------------------------------------------------------------------------------------
# Symbols of the lowered program
# ---------------------------------------------------------------------------------------------------------
def _fake_of(x: Any) -> Any:
    if isinstance(x, ti.TensorProxy):
        dtype, device = ti.dtypes.to_torch_dtype(x.dtype), ti.devices.to_torch_device(x.device)
        return torch.empty(tuple(x.shape), dtype=dtype, device=device)
    return to_torch_value(x)


#: a lowered op's fake outputs by call signature: its meta runs at emission and again as executors claim it
LOCAL_META_CACHE = SignatureCache("lowered op metas")


def _meta_key(overload: Any, args: tuple, kwargs: dict) -> Any:
    def describe(x: Any) -> Any:
        return ("tensor", tuple(x.shape), x.dtype, x.device) if isinstance(x, ti.TensorProxy) else describe_value(x)

    flat, tree = ti.tree_flatten((args, kwargs))
    return call_signature(overload, flat, tree, describe)


def _meta_by_fake_run(overload: Any) -> Callable:
    """The meta of a lowered op: the op itself on fake tensors (torch's own shape rules)."""

    def fake_run(args: tuple, kwargs: dict) -> Any:
        with ti.fake_tensor_mode():
            fake_args, fake_kwargs = ti.tree_map(_fake_of, (args, kwargs))
            fake_kwargs.pop("mesh_dim", None)
            return overload(*fake_args, **fake_kwargs)

    def meta(*args: Any, **kwargs: Any) -> Any:
        val = LOCAL_META_CACHE.get_or_compute(_meta_key(overload, args, kwargs), lambda: fake_run(args, kwargs))
        return _output_proxies(ti.get_tracectx(), val)

    return meta


def _remember_meta(overload: Any, args: tuple, kwargs: dict, val: Any) -> None:
    """Keep the traced node's fake outputs as the meta's answer for this call: the executors' claim of the
    emitted op then runs no fake op again (its output shapes and dtypes are the traced ones)."""
    LOCAL_META_CACHE.remember(_meta_key(overload, args, kwargs), val)


def _symbol_name(overload: Any) -> str:
    packet = overload.overloadpacket
    namespace = packet._qualified_op_name.split("::")[0]
    suffix = "" if overload._overloadname == "default" else f"_{overload._overloadname}"
    return f"{namespace}_{packet.__name__}{suffix}"


@functools.cache
def local_op_symbol(overload: Any) -> ti.Symbol:
    """The trace symbol of one ATen op on local tensors: run as that single ATen call."""
    name = _symbol_name(overload)
    sym = ti.make_prim(f"thunder_dtensor.local.{name}", name, meta=_meta_by_fake_run(overload))
    # the arguments are bound as torch takes them (torch dtypes, devices): the call is the ATen op itself
    op = dtensor_local_ex.register_operator(name, like=sym, fn=overload)
    dtensor_local_ex.register_implementation(sym, op, checker=lambda *a, **k: True)
    ti.let_torch_executors_claim(sym, overload)  # plain local math: thunder's fusion executors may take it
    return sym


#: every collective symbol made so far, by name
COLLECTIVE_SYMBOLS: dict[str, ti.Symbol] = {}


@functools.cache
def collective_symbol(overload: Any) -> ti.Symbol:
    """The trace symbol of one ``_c10d_functional`` op; ``mesh_dim`` is printed, not passed on."""
    name = _symbol_name(overload).removeprefix("_c10d_functional_")
    sym = ti.make_prim(f"thunder_dtensor.comm.{name}", name, meta=_meta_by_fake_run(overload))
    collective = ti.below_autograd(overload)

    def run(*args: Any, mesh_dim: int | None = None, **kwargs: Any) -> Any:
        return collective(*args, **kwargs)

    run.__name__ = name
    op = dtensor_comm_ex.register_operator(name, like=sym, fn=run)
    dtensor_comm_ex.register_implementation(sym, op, checker=lambda *a, **k: True)
    COLLECTIVE_SYMBOLS[name] = sym
    return sym


def _unwrap(x: Any, spec: Any, contiguous: bool, *, placements: str = "") -> torch.Tensor:
    actual = ti.dtensor_spec(x)
    # autograd handed in other placements: the value, placed as traced (a layout of its own is fine: see below)
    if actual is not spec and (actual.mesh != spec.mesh or actual.placements != spec.placements):
        x = x.redistribute(spec.mesh, spec.placements)
    local = ti.local_tensor(x)
    return local.contiguous() if contiguous else local


def _wrap(local: torch.Tensor, spec: Any, *, placements: str = "") -> Any:
    return ti.dtensor_around(local, spec)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def _unwrap_meta(x: DTensorProxy, spec: Any, contiguous: bool, *, placements: str = "") -> ti.TensorProxy:
    shape = ti.local_shape_on(tuple(x.shape), spec.mesh, tuple(spec.placements))
    return ti.TensorProxy(shape=shape, dtype=x.dtype, device=x.device, requires_grad=False)


def _wrap_meta(local: ti.TensorProxy, spec: Any, *, placements: str = "") -> DTensorProxy:
    return DTensorProxy(meta=DTensorMeta.from_spec(spec, tuple(local.shape)), device=local.device, requires_grad=False)


def _contiguous_meta(t: ti.TensorProxy) -> ti.TensorProxy:
    return ti.TensorProxy(like=t, requires_grad=False)


def _boundary_symbol(name: str, fn: Callable, meta: Callable) -> ti.Symbol:
    sym = ti.make_prim(f"thunder_dtensor.comm.{name}", name, meta=meta)
    op = dtensor_comm_ex.register_operator(name, like=sym, fn=fn)
    dtensor_comm_ex.register_implementation(sym, op, checker=lambda *a, **k: True)
    return sym


#: the local shard of a runtime DTensor, in the traced spec (``contiguous=True`` where strides are unknown)
unwrap_dtensor = _boundary_symbol("unwrap_dtensor", _unwrap, _unwrap_meta)
#: a DTensor of the given spec around a local result (no communication, no autograd)
wrap_dtensor = _boundary_symbol("wrap_dtensor", _wrap, _wrap_meta)
#: a plain tensor of unknown strides entering lowered code
local_contiguous = _boundary_symbol("local_contiguous", _contiguous, _contiguous_meta)


# ---------------------------------------------------------------------------------------------------------
# Tracing one prim with DTensor's own dispatch
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Input:
    """How a tensor argument enters the traced function: its local value's metadata and, for DTensors, spec."""

    spec: Any  # DTensorSpec, or None for a plain tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _unwrapped_outputs(outs: Any) -> tuple[list, list]:
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


@dataclasses.dataclass
class _Traced:
    graph: Any  # torch.fx.Graph
    n_forward: int  # the first outputs are the forward's, the rest gradients (None where undefined)
    specs: list  # output specs (None for plain tensors and undefined gradients)


#: traced graphs (or why an op cannot be lowered) by op and call signature: repeated layers trace once
GRAPH_CACHE = SignatureCache("lowering")


def _trace(key: Any, fn: Callable, inputs: list[_Input]) -> _Traced:
    result = GRAPH_CACHE.get_or_compute(key, lambda: _trace_or_reason(fn, inputs))
    if isinstance(result, NotLowerable):
        raise NotLowerable(*result.args)
    return result


def _trace_or_reason(fn: Callable, inputs: list[_Input]) -> _Traced | NotLowerable:
    try:
        return _trace_uncached(fn, inputs)
    except NotLowerable as e:
        return e


def _trace_uncached(fn: Callable, inputs: list[_Input]) -> _Traced:
    specs: list = []
    n_forward: list[int] = []

    def traced(*locals_: torch.Tensor) -> list:
        outs, out_specs, count = fn(*locals_)
        specs[:] = out_specs  # (a second run, when the recorder hands the trace to make_fx, replaces the first)
        n_forward[:] = [count]
        return outs

    try:
        # the caller's autocast (thunder compiles inside the user's call) must not cast what is traced here
        with ti.fake_tensor_logging_muted(), ti.no_ambient_autocast():
            graph = ti.trace_aten_graph(traced, [(i.shape, i.stride, i.dtype, i.device) for i in inputs])
        if _has_mutation(graph):  # in-place ops on fresh values (an op run on a copy): made out of place
            _out_of_place(graph)
        _drop_identity_views(graph)
    except NotLowerable:
        raise
    except Exception as e:
        raise NotLowerable(f"DTensor's dispatch could not be traced ({type(e).__name__}: {str(e)[:120]})") from e
    result = _Traced(graph, n_forward[0], specs)
    _check_graph(result.graph)
    return result


def _has_mutation(graph: Any) -> bool:
    return any(
        isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in graph.nodes
        if n.op == "call_function"
    )


def _functional_variant(op: Any) -> Any:
    """``aten.add.Tensor`` for ``aten.add_.Tensor`` (same arguments, a fresh result), or None."""
    packet = op.overloadpacket
    name = packet.__name__
    if not name.endswith("_") or name.startswith("_"):
        return None
    namespace = getattr(torch.ops, packet._qualified_op_name.split("::")[0])
    functional = getattr(getattr(namespace, name[:-1], None), op._overloadname, None)
    if functional is None or len(functional._schema.arguments) != len(op._schema.arguments):
        return None
    return functional


def _is_view(node: Any) -> bool:
    """Whether ``node``'s result aliases an input (a view, or an in-place op's written argument)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns)


def _out_of_place(graph: Any) -> None:
    """Rewrite in-place ops on values the graph made itself (not views, not viewed) as out-of-place ones.

    DTensor runs an in-place op by mutating the local shard; the lowering's values are immutable, so each
    later read of the written value reads the new result instead. Anything else raises :class:`NotLowerable`.
    """
    current: dict = {}
    for node in list(graph.nodes):
        if current and node.op in ("call_function", "output"):
            node.args = torch.fx.node.map_arg(node.args, lambda a: current.get(a, a))
            node.kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: current.get(a, a))
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.is_mutable or ti.is_functional_collective(node.target):
            continue
        written = [i for i, a in enumerate(node.target._schema.arguments) if a.alias_info and a.alias_info.is_write]
        functional = _functional_variant(node.target)
        base = node.args[0] if node.args else None
        if written != [0] or functional is None or not isinstance(base, torch.fx.Node):
            raise NotLowerable(f"in-place op {node.target}")
        viewed = any(_is_view(u) and not u.target._schema.is_mutable for u in base.users)  # in-place users: rewritten
        if base.op != "call_function" or _is_view(base) or viewed:
            raise NotLowerable(f"in-place op {node.target} on an input or a view")
        with graph.inserting_before(node):
            fresh = graph.call_function(functional, node.args, node.kwargs)
        fresh.meta = dict(node.meta)
        node.replace_all_uses_with(fresh)
        graph.erase_node(node)
        current[base] = fresh
        for old, new in list(current.items()):
            if new is base:
                current[old] = fresh


def _tensor_for_a_number(node: Any) -> bool:
    """make_fx may pass a 0-dim tensor (a traced ``.item()``) where the schema takes a Scalar."""
    for argument, value in zip(node.target._schema.arguments, node.args):
        if isinstance(value, torch.fx.Node) and not isinstance(argument.type, torch.TensorType):
            if isinstance(value.meta.get("val"), torch.Tensor) and "Tensor" not in str(argument.type):
                return True
    return False


def _without_dropout(node: Any) -> bool:
    """An attention kernel (tagged random for its dropout) called with ``dropout_p=0`` draws no random numbers."""
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", argument.default_value)
            return isinstance(value, (int, float)) and value == 0
    return False


def _check_graph(graph: Any) -> None:
    for node in graph.nodes:
        if node.op == "get_attr":
            raise NotLowerable("DTensor's dispatch made a tensor constant")
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            raise NotLowerable(f"DTensor's dispatch called {target}")
        if ti.is_functional_collective(target):
            values = [a.meta.get("val") for a in node.all_input_nodes]
            if any(isinstance(v, torch.Tensor) and v.is_complex() for v in values):
                # torch.distributed's c10d API views complex tensors as real; the functional op does not
                raise NotLowerable("a collective on a complex tensor")
            continue
        if _tensor_for_a_number(node):
            raise NotLowerable(f"{target} takes a traced tensor where its schema takes a number")
        if torch.Tag.nondeterministic_seeded in target.tags and not _without_dropout(node):
            raise NotLowerable(f"random op {target} (its generator state is eager DTensor's)")
        if target._schema.is_mutable:
            raise NotLowerable(f"in-place op {target}")


# ---------------------------------------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------------------------------------
def _is_tensor_proxy(x: Any) -> bool:
    return isinstance(x, ti.TensorProxy)


def _flat_args(bsym: ti.BoundSymbol) -> list:
    return ti.torch_tree_flatten((bsym.args, bsym.kwargs))[0]


class _Lowering:
    """State of one pass over a trace.

    Each DTensor proxy has a local value (once a lowered op made it or an unwrap read it) and an *actual*
    spec: the one eager DTensor would give it. They differ from the proxy's annotation only in the backward,
    where thunder's autodiff labels a gradient with its primal's spec while DTensor's backward may place it
    otherwise (a view's gradient sharded where its input was replicated). Lowered ops are traced on the
    actual specs, so the lowered program does what eager DTensor does, collectives included.
    """

    def __init__(self, trace: ti.TraceCtx) -> None:
        self.trace = ti.from_trace(trace)
        self.bsyms: list = []
        self.local: dict[str, ti.TensorProxy] = {}  # DTensor proxy name -> its local proxy
        self.fake: dict[str, _Input] = {}  # local / plain proxy name -> exact local metadata (strides known)
        self.spec: dict[str, Any] = {}  # DTensor proxy name -> its actual spec, where it is not the annotation
        self.layout: dict[str, Any] = {}  # DTensor proxy name -> the spec its unwrapped local value is read with
        self.materialized: set[str] = set()  # DTensor proxies that exist as runtime DTensors
        flat_inputs = ti.tree_flatten((trace.args, trace.kwargs))[0]
        self.guarded = {x.name for x in flat_inputs if isinstance(x, DTensorProxy)}  # local strides known
        # DTensor proxy name -> the local layout of the value it renames (update_aliases outputs): read as it is,
        # for a copy would cut a view off the memory an in-place write must reach
        self.renamed: dict[str, _Input] = {}
        self.pending_backward: dict[int, Callable[[], None]] = {}  # vjp bsym index -> its emission
        self.lowered = 0
        self.kept: dict[str, str] = {}  # prim name -> why it was not lowered

    # --- values -------------------------------------------------------------------------------------------
    def spec_of(self, x: DTensorProxy) -> Any:
        return self.spec.get(x.name, x.meta.spec)

    def local_info(self, x: DTensorProxy) -> _Input:
        """The metadata of ``x``'s local value: as made, or as an unwrap will read it."""
        if x.name in self.local:
            spec = self.layout.get(x.name) or self.spec_of(x)
            return dataclasses.replace(self.fake[self.local[x.name].name], spec=spec)
        if x.name in self.renamed:
            return self.renamed[x.name]
        return _dtensor_info(x, self.spec_of(x), x.meta.local_stride if x.name in self.guarded else None)

    def local_of(self, x: DTensorProxy) -> ti.TensorProxy:
        if x.name in self.local:
            return self.local[x.name]
        ti.check(x.name in self.materialized, lambda: f"lowering: {x.name} has no value")
        info = self.local_info(x)
        with ti.tracectx(self.trace):
            out = ti.TensorProxy(shape=info.shape, dtype=x.dtype, device=x.device, requires_grad=False)
        # unknown strides (autograd's cotangents, eager results) are made contiguous; the spec is checked
        contiguous = x.name not in self.guarded and x.name not in self.renamed
        self.bsyms.append(unwrap_dtensor.bind(x, info.spec, contiguous, placements=_readable(info.spec), output=out))
        self.fake[out.name] = dataclasses.replace(info, spec=None)
        self.local[x.name] = out
        self.layout[x.name] = info.spec
        return out

    def plain_in(self, x: ti.TensorProxy) -> tuple[ti.TensorProxy, _Input]:
        """A plain tensor argument of a lowered op, with exact strides (made contiguous when unknown)."""
        if x.name in self.fake:
            return x, self.fake[x.name]
        with ti.tracectx(self.trace):
            out = ti.TensorProxy(like=x, requires_grad=False)
        self.bsyms.append(local_contiguous.bind(x, output=out))
        info = _contiguous_info(x)
        self.fake[out.name] = info
        return out, info

    def materialize(self, x: Any) -> None:
        if isinstance(x, DTensorProxy) and x.name not in self.materialized:
            ti.check(x.name in self.local, lambda: f"lowering: {x.name} has no value")
            spec = self.spec_of(x)
            self.bsyms.append(wrap_dtensor.bind(self.local[x.name], spec, placements=_readable(spec), output=x))
            self.materialized.add(x.name)

    def keep(self, bsym: ti.BoundSymbol, why: str | None = None) -> None:
        """Keep ``bsym`` as it is: its DTensor arguments must exist as DTensors, its outputs do."""
        for a in bsym.flat_proxy_args:
            self.materialize(a)
        if why is not None:
            self.kept[bsym.sym.name] = why
        self.bsyms.append(bsym)
        for o in bsym.flat_proxy_outs:
            if isinstance(o, DTensorProxy):
                self.materialized.add(o.name)
        record = PRIMS.get(bsym.sym.name)
        if record is not None and record.renames_arguments:
            for before, after in zip(bsym.flat_proxy_args, bsym.flat_proxy_outs):
                if not (isinstance(before, DTensorProxy) and isinstance(after, DTensorProxy)):
                    continue
                if before.name in self.local or before.name in self.guarded or before.name in self.renamed:
                    self.renamed[after.name] = self.local_info(before)  # its layout is known: the same one
        # a generic vjp was traced for its output's cotangent spec, which the gradient it gets may not have
        overridden = any(isinstance(a, DTensorProxy) and a.name in self.spec for a in bsym.flat_proxy_args)
        if overridden or is_generic_vjp(bsym.sym.name):
            self._propagate_actual_specs(bsym)

    def _propagate_actual_specs(self, bsym: ti.BoundSymbol) -> None:
        """An eager op given other placements than annotated places its outputs as eager would: ask DTensor."""
        record = PRIMS.get(bsym.sym.name)
        fn = record.runtime_fn if record is not None else None
        if fn is None:
            return

        def actual(x: Any) -> Any:
            if isinstance(x, DTensorProxy) and x.name in self.spec:
                return _with_spec(x, self.spec[x.name])
            return x

        try:
            with ti.tracectx(self.trace):
                args, kwargs = ti.tree_map(actual, (bsym.args, bsym.kwargs))
                outs = propagate_on_fake_dtensors(bsym.sym.name, fn, args, kwargs)
        except Exception:  # the unwrap's run-time check still places the value as traced
            return
        for proxy, out in zip(ti.tree_flatten(bsym.output)[0], ti.tree_flatten(outs)[0]):
            if isinstance(proxy, DTensorProxy) and isinstance(out, DTensorProxy) and out.meta.spec != proxy.meta.spec:
                self.spec[proxy.name] = out.meta.spec

    def snapshot(self) -> tuple:
        state = (dict(self.local), dict(self.fake), dict(self.spec), dict(self.layout), set(self.materialized))
        return len(self.bsyms), *state, dict(self.renamed)

    def restore(self, saved: tuple) -> None:
        n, self.local, self.fake, self.spec, self.layout, self.materialized, self.renamed = saved
        del self.bsyms[n:]

    # --- lowering one prim ----------------------------------------------------------------------------------
    def _inputs(self, flat: list) -> tuple[list, list[_Input], list[int]]:
        """Local proxies and metadata of the tensor arguments, and their positions in ``flat``."""
        proxies, infos, positions = [], [], []
        for i, x in enumerate(flat):
            if isinstance(x, DTensorProxy):
                info = self.local_info(x)
                proxies.append(self.local_of(x))
                infos.append(info)
                positions.append(i)
            elif _is_tensor_proxy(x):
                local, info = self.plain_in(x)
                proxies.append(local)
                infos.append(info)
                positions.append(i)
        return proxies, infos, positions

    def _cotangent_info(self, c: Any) -> _Input:
        if isinstance(c, DTensorProxy):
            return self.local_info(c)
        return self.fake.get(c.name) or _contiguous_info(c)

    def lower_forward(self, bsym: ti.BoundSymbol) -> None:
        runtime_fn = PRIMS[bsym.sym.name].runtime_fn
        flat, tree = ti.torch_tree_flatten((bsym.args, bsym.kwargs))
        infos = self._infos(flat)

        def forward(*locals_: torch.Tensor) -> tuple:
            values = _values(flat, infos, locals_)
            args, kwargs = ti.torch_tree_unflatten(values, tree)
            with torch.no_grad():
                outs = runtime_fn(*args, **kwargs)
            locals_out, specs = _unwrapped_outputs(outs)
            return locals_out, specs, len(locals_out)

        traced = _trace(_key("fwd", bsym.sym.name, flat, tree, infos), forward, [i for _, i in infos])
        outputs = [o for o in ti.tree_flatten(bsym.output)[0] if _is_tensor_proxy(o)]
        _check_outputs(outputs, traced.specs[: traced.n_forward], bsym.sym.name)
        proxies, _, _ = self._inputs(flat)
        env = dict(zip(_placeholders(traced.graph), proxies))
        out_nodes = _output_nodes(traced.graph)
        self._emit(traced.graph, _ancestors(out_nodes), env, bsym)
        self._bind_outputs(outputs, [env[n] for n in out_nodes], traced.specs)

    def _infos(self, flat: list) -> list[tuple[int, _Input]]:
        """(position, local metadata) of each tensor argument, without emitting anything."""
        infos = []
        for i, x in enumerate(flat):
            if isinstance(x, DTensorProxy):
                infos.append((i, self.local_info(x)))
            elif _is_tensor_proxy(x):
                infos.append((i, self.fake.get(x.name) or self._cotangent_info(x)))
        return infos

    def lower_joint(self, fwd: ti.BoundSymbol, vjp: ti.BoundSymbol, vjp_index: int) -> None:
        """Trace forward + backward as one function; emit the forward part now, the backward at the vjp.

        The cotangents' actual specs are known only when the backward is reached: the forward is emitted from
        a trace with the specs thunder assumed (the outputs' cotangent specs); if the actual ones differ, the
        joint is traced again with them and its forward nodes are matched, in order, with those emitted.
        """
        name = fwd.sym.name
        flat, tree = ti.torch_tree_flatten((fwd.args, fwd.kwargs))
        _, _, cotangents, diff_indices = vjp.args
        infos = self._infos(flat)
        positions = [i for i, _ in infos]
        ti.check(all(i in positions for i in diff_indices), lambda: "lowering: a gradient of a non-tensor")
        outputs = [o for o in ti.tree_flatten(fwd.output)[0] if _is_tensor_proxy(o)]
        cot_positions = [i for i, c in enumerate(cotangents) if c is not None]
        assumed = [_assumed_cotangent_info(cotangents[i]) for i in cot_positions]
        first = _trace_joint(name, flat, tree, infos, cot_positions, assumed, diff_indices)
        n = first.n_forward
        _check_outputs(outputs, first.specs[:n], name)
        proxies, _, _ = self._inputs(flat)
        placeholders = _placeholders(first.graph)
        env = dict(zip(placeholders, proxies))
        out_nodes = _output_nodes(first.graph)
        forward_nodes = _ancestors(out_nodes[:n])
        self._emit(first.graph, forward_nodes, env, fwd)
        self._bind_outputs(outputs, [env[node] for node in out_nodes[:n]], first.specs[:n])
        grad_outputs = list(vjp.output)

        def emit_backward() -> None:
            actual = [self._cotangent_info(cotangents[i]) for i in cot_positions]
            traced, graph_env, fwd_nodes = first, env, forward_nodes
            if actual != assumed:
                traced = _trace_joint(name, flat, tree, infos, cot_positions, actual, diff_indices)
                matched = _match_forward(first, traced, env)
                if matched is None:  # the forward traced differently: emit it again (a recomputation)
                    graph_env, fwd_nodes = dict(zip(_placeholders(traced.graph), proxies)), set()
                else:
                    graph_env, fwd_nodes = matched, set(matched)
            placeholders = _placeholders(traced.graph)
            for node, c in zip(placeholders[len(infos) :], [cotangents[i] for i in cot_positions]):
                graph_env[node] = self.local_of(c) if isinstance(c, DTensorProxy) else self.plain_in(c)[0]
            nodes = _output_nodes(traced.graph)
            self._emit(traced.graph, _ancestors(nodes[traced.n_forward :]) - fwd_nodes, graph_env, vjp)
            grads = [None if node is None else graph_env[node] for node in nodes[traced.n_forward :]]
            if any(g is None and p is not None for g, p in zip(grads, grad_outputs)):
                raise NotLowerable(f"{vjp.sym.name}: the traced backward leaves a needed gradient undefined")
            self._bind_outputs(grad_outputs, grads, traced.specs[traced.n_forward :])

        self.pending_backward[vjp_index] = emit_backward

    def _emit(self, graph: Any, nodes: set, env: dict, origin: ti.BoundSymbol) -> None:
        """Bind a symbol per node (graph order); ``env`` maps nodes to proxies (or tuples of them)."""
        meshes = [self.spec_of(a).mesh for a in _flat_args(origin) if isinstance(a, DTensorProxy)]
        for node in graph.nodes:
            if node not in nodes or node.op != "call_function" or node in env:
                continue
            if node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
                continue
            args, kwargs = _to_trace_arg(tuple(node.args), env), _to_trace_arg(dict(node.kwargs), env)
            output = _output_proxies(self.trace, node.meta["val"])
            if ti.is_functional_collective(node.target):
                sym = collective_symbol(node.target)
                if node.target is not torch.ops._c10d_functional.wait_tensor.default:
                    kwargs = {**kwargs, "mesh_dim": _mesh_dim(node, meshes)}
            else:
                equivalent = self._emit_thunder_equivalent(node, args, kwargs)
                if equivalent is not None:
                    env[node] = equivalent
                    self._record_fakes(equivalent, node.meta["val"])
                    continue
                sym = local_op_symbol(node.target)
            _remember_meta(node.target, args, kwargs, node.meta["val"])
            self.bsyms.append(sym.bind(*args, output=output, **kwargs))
            env[node] = output
            self._record_fakes(output, node.meta["val"])
        self.lowered += 1
        record = PRIMS.get(origin.sym.name)
        rewritten = record.rewritten if record is not None else None
        if rewritten is not None:  # its local ops do not say that DTensor had no rule for the op
            self.bsyms.append(dtensor_rewritten_prim.bind((), *rewritten, output=None))

    def _emit_thunder_equivalent(self, node: Any, args: tuple, kwargs: dict) -> Any:
        """Emit the thunder call that means what ``node``'s ATen op does (``thunder_equivalents``); its
        outputs, or None (nothing emitted) where there is none or its outputs are not the recorded ones."""
        fn = thunder_equivalent(node.target)
        if fn is None:
            return None
        emitted: list = []
        with ti.tracectx(self.trace):
            self.trace.push_scope(emitted)
            try:
                out = fn(*args, **kwargs)
            except Exception:  # NoEquivalent, or thunder refuses these arguments: the ATen op is as good
                return None
            finally:
                self.trace.pop_scope()
        if not _same_outputs(out, node.meta["val"]):
            return None
        self.bsyms.extend(emitted)
        return out

    def _record_fakes(self, output: Any, val: Any) -> None:
        outs, _ = ti.torch_tree_flatten(output)
        vals, _ = ti.torch_tree_flatten(val)
        for o, v in zip(outs, vals):
            if isinstance(o, ti.TensorProxy) and isinstance(v, torch.Tensor):
                self.fake[o.name] = _Input(None, tuple(v.shape), tuple(v.stride()), v.dtype, v.device)

    def _bind_outputs(self, outputs: list, values: list, specs: list) -> None:
        """The trace's output proxies of a lowered prim take the local values (and actual specs) of its graph's."""
        for proxy, value, spec in zip(outputs, values, specs):
            if proxy is None:
                continue
            if isinstance(proxy, DTensorProxy):
                self.local[proxy.name] = value
                if spec != proxy.meta.spec:
                    self.spec[proxy.name] = spec
            else:  # a plain tensor output (to_local): later symbols read the proxy itself
                self.bsyms.append(_alias_local(value, proxy))
                self.fake[proxy.name] = self.fake[value.name]


def _readable(spec: Any) -> str:
    """The placements of ``spec`` as the trace prints them (the spec itself prints as an opaque name)."""
    return ", ".join(repr(p) for p in spec.placements)


def _with_spec(x: DTensorProxy, spec: Any) -> DTensorProxy:
    """A stand-in proxy of ``x``'s global value with another spec (for a fake run)."""
    shape = ti.local_shape_on(tuple(x.shape), spec.mesh, tuple(spec.placements))
    return DTensorProxy(meta=DTensorMeta.from_spec(spec, shape), device=x.device, requires_grad=x.requires_grad)


def _assumed_cotangent_info(cotangent: Any) -> _Input:
    """The cotangent thunder traced the backward for: its output's cotangent spec, contiguous."""
    if isinstance(cotangent, DTensorProxy):
        return _dtensor_info(cotangent, cotangent.meta.spec, None)
    return _contiguous_info(cotangent)


def _dtensor_info(x: DTensorProxy, spec: Any, local_stride: tuple[int, ...] | None) -> _Input:
    """A DTensor argument's local metadata under ``spec``: ``local_stride`` where known, else contiguous.

    A contiguous local value goes with a contiguous global stride: a DTensor's stride says how its local
    tensor is laid out (DTensor decides view or copy by it), so a spec that kept another value's stride
    around a contiguous local would make DTensor view where it must copy.
    """
    dtype, device = x.meta.dtype, ti.devices.to_torch_device(x.device)
    if local_stride is not None:
        return _Input(spec, x.local_shape, local_stride, dtype, device)
    shape = ti.local_shape_on(tuple(x.shape), spec.mesh, tuple(spec.placements))
    return _Input(contiguous_spec(spec), shape, contiguous_stride(shape), dtype, device)


def contiguous_spec(spec: Any) -> Any:
    """``spec`` with the row-major global stride (the layout of a DTensor around a contiguous local tensor)."""
    shape = tuple(spec.tensor_meta.shape)
    stride = contiguous_stride(shape)
    return spec if tuple(spec.tensor_meta.stride) == stride else ti.spec_with_sizes(spec, shape, stride)


def _contiguous_info(x: ti.TensorProxy) -> _Input:
    """A plain tensor argument whose strides nothing fixes: it is made contiguous where it enters lowered code."""
    shape, dtype, device = tuple(x.shape), ti.dtypes.to_torch_dtype(x.dtype), ti.devices.to_torch_device(x.device)
    return _Input(None, shape, contiguous_stride(shape), dtype, device)


def joint_gradients(vjp_name: str, vjp_args: tuple) -> tuple | None:
    """A generic vjp's gradients as fake values, from the joint trace its lowering will use (kept in
    :data:`GRAPH_CACHE`): the vjp's meta and its lowering then trace DTensor's backward of the op once, not twice.

    The trace is made with the local metadata the lowering will most likely see: the proxies' local strides
    (a program input's are guarded; sharding propagation recorded the others) and contiguous cotangents. Where
    the lowering sees other metadata its exact key misses and it traces afresh. None where the lowering would
    not trace this call (lowering off, the op kept eager, an empty tensor) or the trace fails: the vjp's own
    fake run answers then, and raises DTensor's rejection as before.
    """
    record = PRIMS.get(vjp_name.removesuffix("_vjp_prim") + "_prim")
    if not lowering_enabled() or record is None or _not_lowered(record) is not None:
        return None
    name = record.symbol.name
    args, kwargs, cotangents, diff_indices = vjp_args
    flat, tree = ti.torch_tree_flatten((args, kwargs))
    if any(_is_tensor_proxy(x) and 0 in tuple(x.shape) for x in (*flat, *cotangents)):
        return None
    infos = [
        (i, _dtensor_info(x, x.meta.spec, x.meta.local_stride) if isinstance(x, DTensorProxy) else _contiguous_info(x))
        for i, x in enumerate(flat)
        if _is_tensor_proxy(x)
    ]
    cot_positions = [i for i, c in enumerate(cotangents) if c is not None]
    assumed = [_assumed_cotangent_info(cotangents[i]) for i in cot_positions]
    try:
        traced = _trace_joint(name, flat, tree, infos, cot_positions, assumed, diff_indices)
    except NotLowerable:
        return None
    nodes = _output_nodes(traced.graph)[traced.n_forward :]
    specs = traced.specs[traced.n_forward :]
    if len(nodes) != len(diff_indices):
        return None
    return tuple(
        None if node is None else node.meta["val"] if spec is None else ti.dtensor_around(node.meta["val"], spec)
        for node, spec in zip(nodes, specs)
    )


def _trace_joint(
    name: str,
    flat: list,
    tree: Any,
    infos: list[tuple[int, _Input]],
    cot_positions: list[int],
    cot_infos: list[_Input],
    diff_indices: tuple,
) -> _Traced:
    """The (cached) joint trace of prim ``name`` on these arguments, cotangents and differentiated inputs:
    forward + ``torch.autograd.grad`` of its torch operation on DTensors around the local arguments."""

    def joint(*locals_: torch.Tensor) -> tuple:
        ins, cots = locals_[: len(infos)], locals_[len(infos) :]
        leaves: dict[int, torch.Tensor] = {}
        values = [to_torch_value(x) for x in flat]
        with torch.enable_grad():
            for (i, info), local in zip(infos, ins):
                value = _value(info, local)
                if i in diff_indices:
                    value = value.detach().requires_grad_()
                    leaves[i] = value
                values[i] = value
            args, kwargs = ti.torch_tree_unflatten(values, tree)
            out = PRIMS[name].runtime_fn(*args, **kwargs)
            outs = [o for o in ti.torch_tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        fwd_locals, fwd_specs = _unwrapped_outputs(outs)
        pairs = [(outs[i], _value(info, cot)) for i, info, cot in zip(cot_positions, cot_infos, cots)]
        pairs = [(o, c) for o, c in pairs if o.requires_grad]
        grads: list = [None] * len(diff_indices)
        if pairs and leaves:
            grads = list(
                torch.autograd.grad(
                    [o for o, _ in pairs], [leaves[i] for i in diff_indices], [c for _, c in pairs], allow_unused=True
                )
            )
        grad_locals, grad_specs = [], []
        for g in grads:
            local, spec = (None, None) if g is None else (lambda r: (r[0][0], r[1][0]))(_unwrapped_outputs(g))
            grad_locals.append(local)
            grad_specs.append(spec)
        return fwd_locals + grad_locals, fwd_specs + grad_specs, len(fwd_locals)

    key = _key("joint", name, flat, tree, infos, (tuple(cot_infos), diff_indices))
    return _trace(key, joint, [i for _, i in infos] + cot_infos)


GRADIENT_SOURCES.append(joint_gradients)


def _match_forward(first: _Traced, again: _Traced, env: dict) -> dict | None:
    """Map the forward nodes of ``again`` onto those of ``first`` (already emitted, values in ``env``).

    Both traced the same forward on the same inputs; only the cotangents differ. The forward nodes must
    match one to one in graph order (same op, same arguments): otherwise None.
    """
    old_fwd = _ancestors(_output_nodes(first.graph)[: first.n_forward])
    new_fwd = _ancestors(_output_nodes(again.graph)[: again.n_forward])
    to_old = dict(zip(_placeholders(again.graph), _placeholders(first.graph)))
    old_calls = [n for n in first.graph.nodes if n in old_fwd and n.op == "call_function"]
    new_calls = [n for n in again.graph.nodes if n in new_fwd and n.op == "call_function"]
    if len(old_calls) != len(new_calls):
        return None
    for old, new in zip(old_calls, new_calls):
        renamed = torch.fx.node.map_arg((new.args, new.kwargs), lambda x: to_old.get(x, x))
        if old.target != new.target or renamed != (old.args, old.kwargs):
            return None
        to_old[new] = old
    return {new: env[old] for new, old in to_old.items() if old in env}


def _key(kind: str, name: str, flat: list, tree: Any, infos: list[tuple[int, _Input]], extra: Any = ()) -> Any:
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


def _same_view(before: Any, after: Any) -> bool:
    """Whether two tensors of one storage are the same view of it (shape, strides, offset, dtype, lazy bits)."""
    return (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.shape == after.shape
        and before.stride() == after.stride()
        and before.storage_offset() == after.storage_offset()
        and before.dtype == after.dtype
        and before.is_conj() == after.is_conj()  # _conj is a view that only flips a bit
        and before.is_neg() == after.is_neg()
    )


def _is_pure_view(node: Any) -> bool:
    return node.op == "call_function" and _is_view(node) and not node.target._schema.is_mutable and bool(node.args)


def _drop_identity_views(graph: Any) -> None:
    """Reads of a view that gives back a tensor it was taken from read that tensor: ``detach``, ``alias``, a
    ``view`` to the same shape, the second ``t`` of a transpose pair. The graph's values are immutable (in-place
    ops were made out of place), so the view is that value; the views left without readers are not emitted."""
    for node in graph.nodes:
        if not _is_pure_view(node):
            continue
        source = node.args[0]
        while isinstance(source, torch.fx.Node):
            if _same_view(source.meta.get("val"), node.meta.get("val")):
                node.replace_all_uses_with(source)
                break
            if not _is_pure_view(source):
                break
            source = source.args[0]


def _claimed(bsyms: list, executors: Sequence[Any]) -> list:
    """Emitted ops (the symbols of the lowering's two executors) bound to the operators that will run them (see
    ``lower_dtensor_program``)."""
    out = []
    for bsym in bsyms:
        emitted = bsym.sym.id in dtensor_local_ex.implmap or bsym.sym.id in dtensor_comm_ex.implmap
        op = ti.claiming_operator(bsym, executors) if emitted else None
        out.append(bsym if op is None else op.bind(*bsym.args, output=bsym.output, **bsym.kwargs))
    return out


def place_waits_late(bsyms: list) -> list:
    """Move each collective's ``wait_tensor`` to just before the first symbol that reads its result.

    Collectives are still issued in trace order on every rank; only the waits move, so the communication
    overlaps the computation between the collective and the first use of its result.
    """
    out: list = []
    pending: dict[str, ti.BoundSymbol] = {}  # the wait's result's name -> the wait
    for bsym in bsyms:
        if bsym.sym.name == "wait_tensor":
            pending[bsym.flat_proxy_outs[0].name] = bsym
            continue
        if pending:
            reads = {a.name for a in bsym.flat_proxy_args}
            for name in [n for n in pending if n in reads]:
                out.append(pending.pop(name))
        out.append(bsym)
    assert not pending or out[-1].sym.id == ti.prims.PrimIDs.RETURN, "a wait after the return"
    out[-1:-1] = list(pending.values())
    return out


def _alias_local(value: ti.TensorProxy, proxy: ti.TensorProxy) -> ti.BoundSymbol:
    """``proxy`` names ``value`` (thunder's own alias symbol, which executors run as the tensor itself)."""
    return ti.prims.shallow_copy.bind(value, output=proxy)


def _value(info: _Input, local: torch.Tensor) -> Any:
    return local if info.spec is None else ti.dtensor_around(local, info.spec)


def _values(flat: list, infos: list[tuple[int, _Input]], locals_: tuple) -> list:
    values = [to_torch_value(x) for x in flat]
    for (i, info), local in zip(infos, locals_):
        values[i] = _value(info, local)
    return values


def _placeholders(graph: Any) -> list:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _output_nodes(graph: Any) -> list:
    (out,) = [n for n in graph.nodes if n.op == "output"]
    return list(out.args[0])


def _ancestors(nodes: list) -> set:
    seen: set = set()
    stack = [n for n in nodes if n is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _to_trace_arg(a: Any, env: dict) -> Any:
    """An fx argument as a trace argument: nodes become their proxies, fx's immutable lists plain ones."""
    if isinstance(a, (list, tuple)):
        return (
            type(a).__mro__[1](_to_trace_arg(v, env) for v in a)
            if type(a) not in (list, tuple)
            else type(a)(_to_trace_arg(v, env) for v in a)
        )
    if isinstance(a, dict):
        return {k: _to_trace_arg(v, env) for k, v in a.items()}
    if isinstance(a, torch.fx.Node):
        return env[a]
    return a


def _output_proxies(trace: ti.TraceCtx, val: Any) -> Any:
    def proxy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ti.TensorProxy(
                shape=tuple(v.shape),
                dtype=ti.dtypes.to_dtype(v.dtype),
                device=ti.devices.to_device(v.device),
                requires_grad=False,
            )
        ti.check(v is None or isinstance(v, (int, float, bool)), lambda: f"lowering: output {v!r}")
        return v

    with ti.tracectx(trace):
        if isinstance(val, (tuple, list)):
            return tuple(proxy(v) for v in val)
        return proxy(val)


def _same_outputs(proxies: Any, val: Any) -> bool:
    """``proxies`` (a thunder call's outputs) are ``val`` (an ATen call's): as many, same shapes and dtypes."""
    outs, vals = ti.torch_tree_flatten(proxies)[0], ti.torch_tree_flatten(val)[0]
    if len(outs) != len(vals):
        return False
    for o, v in zip(outs, vals):
        if isinstance(v, torch.Tensor):
            if not isinstance(o, ti.TensorProxy) or tuple(o.shape) != tuple(v.shape):
                return False
            if ti.dtypes.to_torch_dtype(o.dtype) != v.dtype or ti.devices.to_torch_device(o.device) != v.device:
                return False
        elif isinstance(o, ti.Proxy) or o != v:
            return False
    return True


def _mesh_dim(node: Any, meshes: list) -> int | None:
    group_name = node.args[-1] if not node.kwargs.get("group_name") else node.kwargs["group_name"]
    for mesh in meshes:
        for dim in range(mesh.ndim):
            if ti.group_name(mesh, dim) == group_name:
                return dim
    return None


def _check_outputs(proxies: list, specs: list, name: str) -> None:
    """The traced op's outputs are the trace's: as many, DTensors where the trace has DTensors, same shapes.

    Placements may differ (see :class:`_Lowering`): the traced ones are eager's, and are kept.
    """
    if len(proxies) != len(specs):
        raise NotLowerable(f"{name}: the traced op has {len(specs)} tensor outputs, the trace {len(proxies)}")
    for p, spec in zip(proxies, specs):
        if p is None:
            continue
        if isinstance(p, DTensorProxy):
            if spec is None or tuple(spec.shape) != tuple(p.shape):
                raise NotLowerable(f"{name}: the traced output {spec} is not the trace's {p.meta.describe()}")
        elif spec is not None:
            raise NotLowerable(f"{name}: the traced op returns a DTensor where the trace has a tensor")


def _pair_vjps(bsyms: list) -> dict[int, int]:
    """Forward prim index -> index of its generic vjp (the one taking the same arguments)."""
    forwards: dict[tuple, list[int]] = {}
    for i, bsym in enumerate(bsyms):
        if bsym.sym.name in PRIMS and not is_generic_vjp(bsym.sym.name):
            forwards.setdefault(_call_key(bsym.sym.name, bsym.args, bsym.kwargs), []).append(i)
    pairs: dict[int, int] = {}
    for j, bsym in enumerate(bsyms):
        if is_generic_vjp(bsym.sym.name):
            args, kwargs = bsym.args[0], bsym.args[1]
            name = bsym.sym.name.removesuffix("_vjp_prim") + "_prim"
            candidates = [i for i in forwards.get(_call_key(name, args, kwargs), []) if i < j and i not in pairs]
            if candidates:
                pairs[candidates[-1]] = j
    return pairs


def _call_key(name: str, args: Any, kwargs: Any) -> tuple:
    flat = ti.torch_tree_flatten((args, kwargs))[0]
    return (name, tuple(x.name if isinstance(x, ti.Proxy) else repr(x) for x in flat))


def _flatten(bsyms: list) -> list:
    """Top-level symbols, with composite symbols that touch DTensors replaced by their subsymbols."""
    out = []
    for bsym in bsyms:
        touches = any(isinstance(p, DTensorProxy) for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs))
        if touches and bsym.subsymbols and bsym.sym.name not in PRIMS and not bsym.sym.is_prim:
            out.extend(_flatten(list(bsym.subsymbols)))
        else:
            out.append(bsym)
    return out


def _is_empty_dtensor(p: Any) -> bool:
    """A DTensor with no elements. Only global shapes decide: a local tensor (``to_local``'s output,
    ``from_local``'s input) can be empty on one rank only (uneven shards), and every rank must lower alike,
    or their programs (their collectives included) differ."""
    return isinstance(p, DTensorProxy) and 0 in tuple(p.shape)


def _not_lowered(record: Any) -> str | None:
    """Why the prim of ``record`` is never lowered, or None."""
    if record.not_lowered is not None:
        return record.not_lowered
    return "no torch function to trace" if record.runtime_fn is None else None


def lower_dtensor_program(trace: ti.TraceCtx, executors: Sequence[Any] = ()) -> ti.TraceCtx:
    """The lowered trace (see the module docstring); ``trace`` itself if it has no dtensor prims.

    Each emitted op is bound to the operator of the executor that will run it (``executors``: the program's, in
    priority order), as thunder's claiming pass would: that pass then keeps it as it is, instead of calling it
    again. Ops a fusion executor could take (``torch.compile``'s, when listed) are left for thunder to assign.
    """
    bsyms = _flatten(list(trace.bound_symbols))
    if not any(b.sym.name in PRIMS for b in bsyms):
        return trace
    bsyms = without_unused_vjp_gradients(bsyms)  # a joint traces with eager's requires_grad pattern
    state = _Lowering(trace)
    pairs = _pair_vjps(bsyms)
    for i, bsym in enumerate(bsyms):
        if i in state.pending_backward:
            saved = state.snapshot()
            try:
                state.pending_backward.pop(i)()
                continue
            except NotLowerable as e:  # the forward part stays lowered; this gradient recomputes it, eagerly
                state.restore(saved)
                state.keep(bsym, str(e))
                continue
        record = PRIMS.get(bsym.sym.name)
        if record is None:
            state.keep(bsym)
            continue
        why = _not_lowered(record)
        if why is not None:
            state.keep(bsym, why)
            continue
        if record.is_generic_vjp:
            state.keep(bsym, "its forward was not lowered (the gradient recomputes it)")
            continue
        saved = state.snapshot()
        try:
            if any(_is_empty_dtensor(p) for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs)):
                raise NotLowerable("an empty tensor (thunder's backward of empty values)")
            if i in pairs:
                state.lower_joint(bsym, bsyms[pairs[i]], pairs[i])
            else:
                state.lower_forward(bsym)
        except NotLowerable as e:
            state.restore(saved)
            state.keep(bsym, str(e))
    new_trace = state.trace
    new_trace.bound_symbols = place_waits_late(_claimed(state.bsyms, executors))
    new_trace._dtensor_not_lowered = state.kept  # type: ignore[attr-defined]  (see annotate_not_lowered)
    new_trace.set_provenance(ti.TraceProvenance(f"DTensor lowering ({state.lowered} prims lowered)"))
    return new_trace


def annotate_not_lowered(lowered: ti.TraceCtx, executed: ti.TraceCtx) -> None:
    """Say in the executed trace why each eager-run dtensor prim was not lowered (executors drop headers)."""
    reasons = getattr(lowered, "_dtensor_not_lowered", {})
    for k, bsym in enumerate(executed.bound_symbols):
        why = reasons.get(bsym.sym.name)
        if why is not None:
            executed.bound_symbols[k] = bsym.from_bsym(header=f"not lowered (runs eager DTensor): {why}")
