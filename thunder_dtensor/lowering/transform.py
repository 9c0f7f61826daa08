"""The pass: one walk over the joint (forward + backward) trace that lowers each dtensor prim.

Each prim's traced graph (``tracing``) is emitted as symbols (``symbols``) in its place; a generic vjp's pair
is traced once as a joint function, its forward nodes emitted at the forward, the rest at the vjp. State per
DTensor proxy (its local value, actual spec, layout) lives in :class:`_Lowering`. A prim that cannot be lowered
stays as it is, between a wrap and an unwrap, and the trace says why.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.lowering.graph import (
    NotLowerable,
    ancestors,
    descendants,
    match_forward,
    output_nodes,
    placeholder_nodes,
    unused_collectives,
)
from thunder_dtensor.lowering.program import (
    all_reduces_in_one_shot,
    claimed,
    flatten_dtensor_composites,
    functional_all_reduces,
    inherit_backward_tag,
    is_backward,
    issue_collectives_early,
    pair_vjps,
    place_waits_late,
    unwrap_early,
)
from thunder_dtensor.lowering.symbols import (
    collective_symbol,
    issued_before,
    local_contiguous,
    local_op_symbol,
    output_proxies,
    remember_meta,
    unwrap_dtensor,
    wrap_dtensor,
)
from thunder_dtensor.lowering.tracing import (
    LocalInput,
    assumed_cotangent_info,
    contiguous_info,
    dtensor_info,
    eager_result_info,
    graph_key,
    trace_joint,
    trace_op,
    unwrapped_outputs,
    values_of,
)
from thunder_dtensor.primitive import (
    PRIMS,
    dtensor_rewritten_prim,
    is_generic_vjp,
    mesh_of_uneven_shards,
    propagate_on_fake_dtensors,
    without_unused_vjp_gradients,
)
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import DTensorMeta, contiguous_stride
from thunder_dtensor.thunder_equivalents import thunder_equivalent

import torch

#: the thunder compile option (``thunder.jit(fn, dtensor_lowering=False)``) that keeps the eager-prim path
LOWERING_OPTION = "dtensor_lowering"


def lowering_enabled() -> bool:
    value = ti.get_compile_option(LOWERING_OPTION, "lower DTensor ops to local ops plus explicit collectives")
    return True if value is None else bool(value)


#: the thunder compile option (``thunder.jit(fn, dtensor_issue_early=True)``) that issues each collective as early
#: as its inputs allow (``program.issue_collectives_early``); off by default (it reorders every lowered program)
ISSUE_EARLY_OPTION = "dtensor_issue_early"


def issue_early_enabled() -> bool:
    value = ti.get_compile_option(ISSUE_EARLY_OPTION, "issue each collective as early as its inputs allow")
    return bool(value)


#: the thunder compile option (``thunder.jit(fn, dtensor_one_shot_all_reduce_bytes=65536)``): each sum all-reduce
#: of at most that many bytes per rank runs as one all-gather and a local sum (``program.all_reduces_in_one_shot``);
#: off by default (the program then issues the collectives eager DTensor and c10d issue)
ONE_SHOT_OPTION = "dtensor_one_shot_all_reduce_bytes"


def one_shot_all_reduce_bytes() -> int:
    value = ti.get_compile_option(ONE_SHOT_OPTION, "sum all-reduces up to this many bytes as an all-gather and a sum")
    return int(value or 0)


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
        self.fake: dict[str, LocalInput] = {}  # local / plain proxy name -> exact local metadata (strides known)
        self.spec: dict[str, Any] = {}  # DTensor proxy name -> its actual spec, where it is not the annotation
        self.layout: dict[str, Any] = {}  # DTensor proxy name -> the spec its unwrapped local value is read with
        self.materialized: set[str] = set()  # DTensor proxies that exist as runtime DTensors
        self.eager_results: set[str] = set()  # DTensor outputs of kept prims: laid out as their specs say
        flat_inputs = ti.tree_flatten((trace.args, trace.kwargs))[0]
        self.guarded = {x.name for x in flat_inputs if isinstance(x, DTensorProxy)}  # local strides known
        # DTensor proxy name -> the local layout of the value it renames (update_aliases outputs): read as it is,
        # for a copy would cut a view off the memory an in-place write must reach
        self.renamed: dict[str, LocalInput] = {}
        self.pending_backward: dict[int, Callable[[], None]] = {}  # vjp bsym index -> its emission
        self.lowered = 0
        self.kept: dict[str, str] = {}  # prim name -> why it was not lowered

    # --- values -------------------------------------------------------------------------------------------
    def spec_of(self, x: DTensorProxy) -> Any:
        return self.spec.get(x.name, x.meta.spec)

    def local_info(self, x: DTensorProxy) -> LocalInput:
        """The metadata of ``x``'s local value: as made, or as an unwrap will read it."""
        if x.name in self.local:
            spec = self.layout.get(x.name) or self.spec_of(x)
            return dataclasses.replace(self.fake[self.local[x.name].name], spec=spec)
        if x.name in self.renamed:
            return self.renamed[x.name]
        if x.name in self.eager_results:
            return eager_result_info(x, self.spec_of(x))
        return dtensor_info(x, self.spec_of(x), x.meta.local_stride if x.name in self.guarded else None)

    def local_of(self, x: DTensorProxy) -> ti.TensorProxy:
        if x.name in self.local:
            return self.local[x.name]
        ti.check(x.name in self.materialized, lambda: f"lowering: {x.name} has no value")
        info = self.local_info(x)
        with ti.tracectx(self.trace):
            out = ti.TensorProxy(shape=info.shape, dtype=x.dtype, device=x.device, requires_grad=False)
        # unknown strides (autograd's cotangents, eager results) are made contiguous, or dense in the layout an
        # eager result's spec gives (``eager_result_info``); the spec is checked
        layout: bool | tuple[int, ...] = x.name not in self.guarded and x.name not in self.renamed
        if layout and info.stride != contiguous_stride(info.shape):
            layout = info.stride
        self.bsyms.append(unwrap_dtensor.bind(x, info.spec, layout, placements=_readable(info.spec), output=out))
        self.fake[out.name] = dataclasses.replace(info, spec=None)
        self.local[x.name] = out
        self.layout[x.name] = info.spec
        return out

    def plain_in(self, x: ti.TensorProxy) -> tuple[ti.TensorProxy, LocalInput]:
        """A plain tensor argument of a lowered op, with exact strides (made contiguous when unknown)."""
        if x.name in self.fake:
            return x, self.fake[x.name]
        with ti.tracectx(self.trace):
            out = ti.TensorProxy(like=x, requires_grad=False)
        self.bsyms.append(local_contiguous.bind(x, output=out))
        info = contiguous_info(x)
        self.fake[out.name] = info
        return out, info

    def materialize(self, x: Any, alias: bool = False) -> None:
        """``x`` as a runtime DTensor around its local value; ``alias``: the very value (a view stays a view)."""
        if isinstance(x, DTensorProxy) and x.name not in self.materialized:
            ti.check(x.name in self.local, lambda: f"lowering: {x.name} has no value")
            spec = self.spec_of(x)
            aliasing: dict[str, Any] = {"alias": True} if alias else {}  # (printed only where it holds)
            self.bsyms.append(
                wrap_dtensor.bind(self.local[x.name], spec, placements=_readable(spec), output=x, **aliasing)
            )
            self.materialized.add(x.name)

    def keep(self, bsym: ti.BoundSymbol, why: str | None = None) -> None:
        """Keep ``bsym`` as it is: its DTensor arguments must exist as DTensors, its outputs do."""
        record = PRIMS.get(bsym.sym.name)
        # the alias pass's renames hand their arguments on to in-place writes: each must be the memory it views
        aliases = record is not None and record.renames_arguments
        for a in bsym.flat_proxy_args:
            self.materialize(a, alias=aliases)
        if why is not None:
            self.kept[bsym.sym.name] = why
        self.bsyms.append(bsym)
        for o in bsym.flat_proxy_outs:
            if isinstance(o, DTensorProxy):
                self.materialized.add(o.name)
                if record is not None:  # a dtensor prim run as the eager op (not a cotangent's spec match, which
                    self.eager_results.add(o.name)  # the backward was traced for as a contiguous value)
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
        # (a joint's pending backward too: a forward lowered here, then kept because another rank could not lower
        # it, must not have its backward emitted later from the discarded forward; fuzz seed 18997 at 4 ranks hung)
        return len(self.bsyms), *state, dict(self.renamed), dict(self.pending_backward)

    def restore(self, saved: tuple) -> None:
        n, self.local, self.fake, self.spec, self.layout, self.materialized, self.renamed, pending = saved
        self.pending_backward = pending
        del self.bsyms[n:]

    # --- lowering one prim ----------------------------------------------------------------------------------
    def _inputs(self, flat: list) -> tuple[list, list[LocalInput], list[int]]:
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

    def _cotangent_info(self, c: Any) -> LocalInput:
        if isinstance(c, DTensorProxy):
            return self.local_info(c)
        return self.fake.get(c.name) or contiguous_info(c)

    def lower_forward(self, bsym: ti.BoundSymbol) -> None:
        runtime_fn = PRIMS[bsym.sym.name].runtime_fn
        flat, tree = ti.torch_tree_flatten((bsym.args, bsym.kwargs))
        infos = self._infos(flat)
        # which arguments require grad: torch's composite ops read it even under no_grad (a matmul of a 2-D
        # weight that requires grad and a 4-D input folds the input into a matrix, else it broadcasts a bmm), so
        # eager's decomposition, and the placements it gives, depend on it (fuzz seed 15420)
        requiring_grad = tuple(i for i, x in enumerate(flat) if _is_tensor_proxy(x) and x.requires_grad)

        def forward(*locals_: torch.Tensor) -> tuple:
            values = values_of(flat, infos, locals_)
            for i in requiring_grad:
                values[i] = values[i].requires_grad_()
            args, kwargs = ti.torch_tree_unflatten(values, tree)
            with torch.no_grad():
                outs = cast(Callable, runtime_fn)(*args, **kwargs)  # (a lowered prim has one)
            locals_out, specs = unwrapped_outputs(outs)
            return locals_out, specs, len(locals_out)

        key = graph_key("fwd", bsym.sym.name, flat, tree, infos, requiring_grad)
        traced = trace_op(key, forward, [i for _, i in infos])
        outputs = [o for o in ti.tree_flatten(bsym.output)[0] if _is_tensor_proxy(o)]
        _check_outputs(outputs, traced.specs[: traced.n_forward], bsym.sym.name)
        proxies, _, _ = self._inputs(flat)
        env = dict(zip(placeholder_nodes(traced.graph), proxies))
        out_nodes = output_nodes(traced.graph)
        self._emit(traced.graph, ancestors(out_nodes + unused_collectives(traced)[0]), env, bsym)
        self._bind_outputs(outputs, [env[n] for n in out_nodes], traced.specs)

    def _infos(self, flat: list) -> list[tuple[int, LocalInput]]:
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
        assumed = [assumed_cotangent_info(cotangents[i]) for i in cot_positions]
        first = trace_joint(name, flat, tree, infos, cot_positions, assumed, diff_indices)
        n = first.n_forward
        _check_outputs(outputs, first.specs[:n], name)
        proxies, _, _ = self._inputs(flat)
        placeholders = placeholder_nodes(first.graph)
        env = dict(zip(placeholders, proxies))
        out_nodes = output_nodes(first.graph)
        unused_forward, _ = unused_collectives(first)
        forward_nodes = ancestors(out_nodes[:n] + unused_forward)
        self._emit(first.graph, forward_nodes, env, fwd)
        values = [env[node] for node in out_nodes[:n]]
        if unused_forward and values:  # the forward's first output comes after them: they stay in the forward
            issued = [
                env[node] for node in unused_forward if node.target is torch.ops._c10d_functional.wait_tensor.default
            ]
            with ti.tracectx(self.trace):
                after = ti.TensorProxy(like=values[0], requires_grad=False)
            self.bsyms.append(issued_before.bind(values[0], *issued, output=after))
            self.fake[after.name] = self.fake[values[0].name]
            values[0] = after
        self._bind_outputs(outputs, values, first.specs[:n])
        grad_outputs = list(vjp.output)
        # arguments the vjp takes as thunder's recomputations in the backward (FSDP2's parameters, gathered again)
        vjp_flat = ti.torch_tree_flatten((vjp.args[0], vjp.args[1]))[0]
        recomputed = {
            i: a
            for i, a in enumerate(vjp_flat)
            if isinstance(a, ti.TensorProxy) and isinstance(flat[i], ti.TensorProxy) and a.name != flat[i].name
        }

        def emit_backward() -> None:
            actual = [self._cotangent_info(cotangents[i]) for i in cot_positions]
            traced, graph_env, fwd_nodes = first, env, forward_nodes
            if actual != assumed:
                traced = trace_joint(name, flat, tree, infos, cot_positions, actual, diff_indices)
                matched = match_forward(first, traced, env)
                if matched is None:  # the forward traced differently: emit it again (a recomputation)
                    graph_env, fwd_nodes = dict(zip(placeholder_nodes(traced.graph), proxies)), set()
                else:
                    graph_env, fwd_nodes = matched, set(matched)
            placeholders = placeholder_nodes(traced.graph)
            if recomputed:
                graph_env, fwd_nodes = self._read_recomputed(traced, graph_env, fwd_nodes, infos, recomputed)
            for node, c in zip(placeholders[len(infos) :], [cotangents[i] for i in cot_positions]):
                graph_env[node] = self.local_of(c) if isinstance(c, DTensorProxy) else self.plain_in(c)[0]
            nodes = output_nodes(traced.graph)
            unused_forward, unused_backward = unused_collectives(traced)
            needed = ancestors(nodes[traced.n_forward :] + unused_backward + unused_forward) - fwd_nodes
            self._emit(traced.graph, needed, graph_env, vjp)
            grads = [None if node is None else graph_env[node] for node in nodes[traced.n_forward :]]
            if any(g is None and p is not None for g, p in zip(grads, grad_outputs)):
                raise NotLowerable(f"{vjp.sym.name}: the traced backward leaves a needed gradient undefined")
            self._bind_outputs(grad_outputs, grads, traced.specs[traced.n_forward :])

        self.pending_backward[vjp_index] = emit_backward

    def _read_recomputed(
        self, traced: Any, env: dict, fwd_nodes: set, infos: list[tuple[int, LocalInput]], recomputed: dict
    ) -> tuple[dict, set]:
        """The backward of a joint reads the vjp's own arguments where they are thunder's recomputations of the
        forward's (``recomputed``: position -> proxy), and emits again the forward nodes that depend on them: the
        forward's values of those (FSDP2's gathered parameters, views of them) are not kept for the backward."""
        info_at = dict(infos)
        for i, proxy in recomputed.items():
            if not isinstance(proxy, DTensorProxy) or self.local_info(proxy) != info_at[i]:
                raise NotLowerable("a recomputed argument of the gradient is laid out otherwise than the forward's")
        placeholders = dict(zip(info_at, placeholder_nodes(traced.graph)))
        rebound = {placeholders[i]: proxy for i, proxy in recomputed.items()}
        stale = descendants(traced.graph, set(rebound))
        env = {node: value for node, value in env.items() if node not in stale}
        for node, proxy in rebound.items():
            env[node] = self.local_of(proxy)
        return env, fwd_nodes - stale

    def _emit(self, graph: Any, nodes: set, env: dict, origin: ti.BoundSymbol) -> None:
        """Bind a symbol per node (graph order); ``env`` maps nodes to proxies (or tuples of them)."""
        # the meshes whose dims the collectives may run over: the inputs', then the outputs' (a reduce-scatter of
        # plain gradients into sharded ones: FSDP2's)
        dtensors = [a for a in (*_flat_args(origin), *origin.flat_proxy_outs) if isinstance(a, DTensorProxy)]
        meshes = [self.spec_of(a).mesh for a in dtensors]
        for node in graph.nodes:
            if node not in nodes or node.op != "call_function" or node in env:
                continue
            if node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
                continue
            args, kwargs = _to_trace_arg(tuple(node.args), env), _to_trace_arg(dict(node.kwargs), env)
            output = output_proxies(self.trace, node.meta["val"])
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
            remember_meta(node.target, args, kwargs, node.meta["val"])
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
                self.fake[o.name] = LocalInput(None, tuple(v.shape), tuple(v.stride()), v.dtype, v.device)

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


def _alias_local(value: ti.TensorProxy, proxy: ti.TensorProxy) -> ti.BoundSymbol:
    """``proxy`` names ``value`` (thunder's own alias symbol, which executors run as the tensor itself)."""
    return ti.prims.shallow_copy.bind(value, output=proxy)


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
        (i, dtensor_info(x, x.meta.spec, x.meta.local_stride) if isinstance(x, DTensorProxy) else contiguous_info(x))
        for i, x in enumerate(flat)
        if _is_tensor_proxy(x)
    ]
    cot_positions = [i for i, c in enumerate(cotangents) if c is not None]
    assumed = [assumed_cotangent_info(cotangents[i]) for i in cot_positions]
    try:
        traced = trace_joint(name, flat, tree, infos, cot_positions, assumed, diff_indices)
    except NotLowerable:
        return None
    nodes = output_nodes(traced.graph)[traced.n_forward :]
    specs = traced.specs[traced.n_forward :]
    if len(nodes) != len(diff_indices):
        return None
    return tuple(
        None if node is None else node.meta["val"] if spec is None else ti.dtensor_around(node.meta["val"], spec)
        for node, spec in zip(nodes, specs)
    )


#: the outputs of the forward prims a compile kept (not lowered) that the current compile must keep too
_FORWARD_KEPT_AS_RAN: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "forward_kept_as_ran", default=frozenset()
)


@contextlib.contextmanager
def keeping_forward_prims_as_ran(outputs: frozenset[str]) -> Iterator[None]:
    """Compile with the forward prims that make ``outputs`` kept, as in the forward that ran.

    A backward traced again for other cotangent placements (``guards.BackwardForCotangentPlacements``) must read
    what the forward that ran saved: its joint's forward must compile to that forward. Whether a prim is lowered
    can depend on the cotangent its joint is traced with (fuzz seed 14325: an ``rms_norm`` kept for one, lowered
    for another), so the prims kept then are kept again."""
    token = _FORWARD_KEPT_AS_RAN.set(outputs)
    try:
        yield
    finally:
        _FORWARD_KEPT_AS_RAN.reset(token)


def forward_prims_kept(joint: ti.TraceCtx) -> frozenset[str]:
    """The outputs of the forward dtensor prims the lowering of ``joint`` (a joint trace it lowered) kept."""
    return getattr(joint, "_dtensor_kept_forward", frozenset())


def _lower_symbol(state: _Lowering, bsyms: list, pairs: dict, i: int) -> None:
    """Lower ``bsyms[i]`` into ``state`` (or keep it as it is, saying why)."""
    bsym = bsyms[i]
    if i in state.pending_backward:
        # (a failure: the forward part stays lowered; this gradient recomputes it, eagerly)
        _lower_agreed(state, bsym, state.pending_backward.pop(i))
        return
    record = PRIMS.get(bsym.sym.name)
    if record is None:
        state.keep(bsym)
        return
    kept_as_ran = _FORWARD_KEPT_AS_RAN.get()
    if kept_as_ran and not is_backward(bsym) and any(o.name in kept_as_ran for o in bsym.flat_proxy_outs):
        state.keep(bsym, "kept as in the forward that ran (a backward traced for other cotangent placements)")
        return
    why = _not_lowered(record)
    if why is not None:
        state.keep(bsym, why)
        return
    if record.is_generic_vjp:
        state.keep(bsym, "its forward was not lowered (the gradient recomputes it)")
        return

    def lower() -> None:
        if any(_is_empty_dtensor(p) for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs)):
            raise NotLowerable("an empty tensor (thunder's backward of empty values)")
        if i in pairs:
            state.lower_joint(bsym, bsyms[pairs[i]], pairs[i])
        else:
            state.lower_forward(bsym)

    _lower_agreed(state, bsym, lower)


def _lower_agreed(state: _Lowering, bsym: ti.BoundSymbol, lower: Callable[[], None]) -> None:
    """Run ``lower``; where it raises :class:`NotLowerable`, keep ``bsym`` as it is instead.

    On uneven shards every rank decides alike: tracing DTensor's dispatch on one rank's local shapes can fail there
    only (an empty shard), and a prim lowered on some ranks and kept on others makes programs whose collectives
    (the lowered ones, the eager op's, the trace-time agreements of sharding propagation) do not pair up (fuzz seed
    20 at 4 ranks: a hang). One agreement per such prim.
    """
    saved = state.snapshot()
    error: NotLowerable | None = None
    try:
        lower()
    except NotLowerable as e:
        error = e
    mesh = mesh_of_uneven_shards(list(bsym.flat_proxy_args))
    if mesh is not None and ti.any_rank_of_mesh(error is not None, mesh) and error is None:
        error = NotLowerable("it cannot be lowered on another rank's local shard of these uneven shards")
    if error is not None:
        state.restore(saved)
        state.keep(bsym, str(error))


def lower_dtensor_program(trace: ti.TraceCtx, executors: Sequence[Any] = ()) -> ti.TraceCtx:
    """The lowered trace (see the module docstring); ``trace`` itself if it has no dtensor prims.

    Each emitted op is bound to the operator of the executor that will run it (``executors``: the program's, in
    priority order), as thunder's claiming pass would: that pass then keeps it as it is, instead of calling it
    again. Ops a fusion executor could take (``torch.compile``'s, when listed) are left for thunder to assign.
    """
    bsyms = flatten_dtensor_composites(list(trace.bound_symbols))
    if not any(b.sym.name in PRIMS for b in bsyms):
        return trace
    bsyms = without_unused_vjp_gradients(bsyms)  # a joint traces with eager's requires_grad pattern
    state = _Lowering(trace)
    bsyms = functional_all_reduces(bsyms, state.trace)
    pairs = pair_vjps(bsyms)
    for i, bsym in enumerate(bsyms):
        emitted_from = len(state.bsyms)
        _lower_symbol(state, bsyms, pairs, i)
        # what a backward symbol lowers to is backward too (thunder's dataflow fusion partition reads the tag)
        inherit_backward_tag(bsym, state.bsyms[emitted_from:])
    new_trace = state.trace
    bsyms = place_waits_late(issue_collectives_early(state.bsyms) if issue_early_enabled() else state.bsyms)
    one_shot_bytes = one_shot_all_reduce_bytes()
    if one_shot_bytes > 0:
        bsyms = all_reduces_in_one_shot(bsyms, new_trace, one_shot_bytes)
    new_trace.bound_symbols = unwrap_early(claimed(bsyms, executors))
    new_trace._dtensor_not_lowered = state.kept  # type: ignore[attr-defined]  # (see annotate_not_lowered)
    # on the trace lowered, under its own names: the joint a backward for other cotangents is traced from
    trace._dtensor_kept_forward = frozenset(  # type: ignore[attr-defined]  # (see forward_prims_kept)
        o.name for b in state.bsyms if b.sym.name in PRIMS and not is_backward(b) for o in b.flat_proxy_outs
    )
    new_trace.set_provenance(ti.TraceProvenance(f"DTensor lowering ({state.lowered} prims lowered)"))
    return new_trace


def annotate_not_lowered(lowered: ti.TraceCtx, executed: ti.TraceCtx) -> None:
    """Say in the executed trace why each eager-run dtensor prim was not lowered (executors drop headers)."""
    reasons = getattr(lowered, "_dtensor_not_lowered", {})
    for k, bsym in enumerate(cast(list[ti.BoundSymbol], executed.bound_symbols)):
        why = reasons.get(bsym.sym.name)
        if why is not None:
            executed.bound_symbols[k] = bsym.from_bsym(header=f"not lowered (runs eager DTensor): {why}")
