"""thunderfx (``thunder.dynamo``): which nodes of a dynamo graph with DTensors thunder runs.

Dynamo records a tensor-parallel module as one graph: ``DTensor.from_local`` with the device mesh as a
graph input, DTensor ops, ``.redistribute`` and ``.to_local``. thunderfx's splitter asks, node by node,
whether thunder can run it, and hands unsupported stretches to inductor. For nodes that touch a DTensor
or the mesh this module answers: it runs the node's thunder symbol (our dispatchers) on proxies built
from dynamo's example values. A node DTensor rejects is split out with our error as the reason;
everything else stays in one thunder graph. Only the forward is tried: every dtensor prim has a grad rule
(the generic VJP when no dedicated one), so a forward that traces also differentiates.

The calls dynamo records for ``torch.nn.attention.sdpa_kernel(...)`` (``_backend_from_string``,
``_sdpa_kernel``), with or without DTensors, stay in the thunder graph too: there they record the chosen
backends at trace time and change nothing that runs (see ``sdpa_backends.py``), instead of splitting the
graph around the attention.
"""

from __future__ import annotations

import inspect
import operator
import weakref
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import METHOD_TABLE, dtensor_callable_for
from thunder_dtensor.ops.losses import replaces_per_rank_means
from thunder_dtensor.proxy import proxy_for_value
from thunder_dtensor.sdpa_backends import is_sdpa_kernel_node
from thunder_dtensor.signature import SignatureCache, Uncacheable, ambient_state, describe_value
from thunder_dtensor.spec import as_traced_placement

import torch

__all__ = ["dtensor_node_support", "is_dtensor_graph", "plain_node_support"]

#: graph -> whether a node of it touches a DTensor or a device mesh (asked once per node by the splitter)
_DTENSOR_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _touches_dtensor(node: torch.fx.Node) -> bool:
    values = [node.meta.get("example_value"), *(ti.fx_example_value(a) for a in node.all_input_nodes)]
    leaves, _ = ti.torch_tree_flatten(values)
    return any(isinstance(v, ti.DTensor | ti.DeviceMesh) or ti.is_opaque_script_object(v) for v in leaves)


def is_dtensor_graph(graph: torch.fx.Graph) -> bool:
    """Whether a dynamo graph has a DTensor or a device mesh in it: thunderfx's splitter and compiler treat
    other graphs exactly as thunder does."""
    known = _DTENSOR_GRAPHS.get(graph)
    if known is None:
        known = _DTENSOR_GRAPHS[graph] = any(_touches_dtensor(node) for node in graph.nodes)
    return known


def _thunder_callable(node: torch.fx.Node) -> Callable | None:
    """What thunder would call for ``node`` on DTensors: its route in the dispatch table, or a builtin operator
    (whose proxy methods route it)."""
    if node.op == "call_function":
        symbol = dtensor_callable_for(node.target)
        if symbol is not None:
            return symbol
        return node.target if inspect.isbuiltin(node.target) else None
    if node.op == "call_method":
        route = METHOD_TABLE.get(cast(str, node.target))  # (a call_method's target is the method's name)
        return None if route is None else route.dtensor_symbol
    return None


def _spec_as_traced(spec: Any) -> Any:
    """The spec thunder_dtensor traces for a value dynamo describes with ``spec``.

    Symbolic sizes (dynamic shapes) read as their hints. Eager's ``_MaskPartial`` (the vocab-parallel
    embedding's output, whose mask exists only after a real lookup) is our :class:`MaskPartial`, which DTensor's
    rules treat alike (see ``ops/embedding.py``).
    """
    spec = ti.spec_with_sizes(spec, spec.tensor_meta.shape, spec.tensor_meta.stride)
    placements = tuple(as_traced_placement(p) for p in spec.placements)
    return spec if placements == tuple(spec.placements) else ti.respec(spec, placements=placements)


def _proxy_for(value: Any) -> Any:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return value.node.hint
    if not isinstance(value, torch.Tensor):
        return value
    spec = _spec_as_traced(ti.dtensor_spec(value)) if isinstance(value, ti.DTensor) else None
    return proxy_for_value(value, requires_grad=value.requires_grad, spec=spec)


def _proxy_inputs(node: torch.fx.Node) -> tuple[tuple, dict]:
    def convert(arg: Any) -> Any:
        leaves, spec = ti.torch_tree_flatten(ti.fx_example_value(arg))
        return ti.torch_tree_unflatten([_proxy_for(v) for v in leaves], spec)

    return torch.fx.map_arg(node.args, convert), torch.fx.map_arg(node.kwargs, convert)


#: ops thunder runs through its automatic torch fallback (torch's kernel and torch's backward) that thunderfx
#: would split off for inductor; kept in the thunder graph so a model using them (complex rotary embeddings on
#: local tensors) stays one thunder program
_KEPT_TORCH_FALLBACKS = (torch.view_as_complex, torch.view_as_real)


def dtensor_node_support(node: torch.fx.Node) -> tuple[bool, str | None] | None:
    """``(supported, reason)`` for a node with a DTensor or device mesh in it; ``None`` for any other node.

    A node of an ``sdpa_kernel`` block is supported (a trace-time no-op, validated at the attention call), and
    so is a call of one of ``_KEPT_TORCH_FALLBACKS`` (on plain tensors too).
    """
    if is_sdpa_kernel_node(node) or (node.op == "call_function" and node.target in _KEPT_TORCH_FALLBACKS):
        return True, None
    if node.op not in ("call_function", "call_method") or not _touches_dtensor(node):
        return None
    if node.op == "call_function" and ti.is_dynamo_dtensor_method_closure(node.target):
        # torch 2.10's spelling of from_local / redistribute / to_local: a function of dynamo's that makes the
        # call; thunder interprets it, and the call reaches the dispatch table as written
        return True, None
    fn = _thunder_callable(node)
    if fn is None:
        return False, f"node {node.name} ({node.target}) on DTensors has no thunder_dtensor mapping"
    try:
        out = ti.trace_on_proxies(fn, lambda: _proxy_inputs(node))
    except Exception as e:  # the reason thunderfx records for the split
        return False, f"node {node.name} ({node.target}) on DTensors failed under thunder_dtensor: {e}"
    unlike = _placements_unlike_eager(node, out)
    if unlike and not _returns_an_exact_mean(node, out):
        # dynamo recorded the code after this node for eager's placements: eager runs the node
        return False, f"node {node.name} ({node.target}): thunder_dtensor places {unlike}"
    return True, None


#: what a returned loss may pass through on its way out (scaled by a number: ``loss / accumulation_steps``)
_SCALINGS = frozenset({operator.mul, operator.truediv, operator.neg, torch.mul, torch.div, torch.neg})
_SCALING_METHODS = frozenset({"mul", "div", "neg", "__mul__", "__rmul__", "__truediv__", "__neg__"})


def _only_returned(node: torch.fx.Node) -> bool:
    """Whether every use of ``node`` is the graph's output, directly or through scalings by numbers."""

    def scales_it(user: torch.fx.Node) -> bool:
        scaling = user.target in _SCALINGS if user.op == "call_function" else user.target in _SCALING_METHODS
        others = [a for a in (*user.args, *user.kwargs.values()) if a is not node]
        return (
            user.op in ("call_function", "call_method")
            and scaling
            and all(isinstance(a, int | float) for a in others)
            and _only_returned(user)
        )

    return bool(node.users) and all(user.op == "output" or scales_it(user) for user in node.users)


def _returns_an_exact_mean(node: torch.fx.Node, out: Any) -> bool:
    """A class-index mean loss that the graph only returns (scaled by a number, perhaps), placed as
    ``ops/losses.py`` places it: the exact ``Partial(sum)`` where eager DTensor averages per-rank means (silently
    wrong wherever the ranks' counts of counted targets differ: ``ignore_index`` padding, class weights). No code
    dynamo recorded reads its placements, so it stays in thunder's graph; split out, it would run eager's mean."""
    if node.op != "call_function" or not _only_returned(node):
        return False
    eager, ours = _output_placements(node, out)
    return len(eager) == len(ours) == 1 and replaces_per_rank_means(node.target, eager[0], ours[0])


def _output_placements(node: torch.fx.Node, out: Any) -> tuple[list[tuple], list[tuple]]:
    """The placements dynamo recorded for each DTensor output of ``node`` (eager DTensor's) and those of ``out``
    (the node traced by thunder_dtensor)."""
    eager = [v for v in ti.torch_tree_flatten(node.meta.get("example_value"))[0] if isinstance(v, ti.DTensor)]
    # torch's pytree: a value thunder's cannot flatten (a node reading ``x.device_mesh``) is a leaf
    ours = [p for p in ti.torch_tree_flatten(out)[0] if isinstance(p, ti.TensorProxy) and hasattr(p, "placements")]
    return (
        [tuple(as_traced_placement(p) for p in e.placements) for e in eager],
        [tuple(o.placements) for o in ours],
    )


def _placements_unlike_eager(node: torch.fx.Node, out: Any) -> str:
    """How the placements of ``out`` (the node's outputs traced by thunder_dtensor) differ from those dynamo
    recorded for it (eager DTensor's), "" where they agree.

    Dynamo runs the program's Python on eager's placements (``if x.placements[0].is_partial(): ...``), so the
    graph after a node holds only for eager's placements; a node thunder would place otherwise stays eager.
    """
    eager, ours = _output_placements(node, out)
    if len(eager) != len(ours):
        return ""  # no one-to-one reading of the outputs (a method returning self, say): nothing to compare
    for i, (expected, placed) in enumerate(zip(eager, ours)):
        if expected != placed:
            return f"output {i} {placed} where eager DTensor places it {expected}"
    return ""


#: thunder's answer for nodes without DTensors, by call signature: a repeated layer's nodes are checked once
PLAIN_NODE_CACHE = SignatureCache("thunderfx node support")


def _describe_node_argument(a: Any) -> Any:
    """What thunder's check of a node sees of an argument: example values' metadata, other values as they are.

    A submodule argument (``get_attr``: a checkpointed or ``autograd.Function`` body, which thunder's check looks
    into) has no such description."""
    return describe_value(a, special=_describe_fx_node)


def _describe_fx_node(a: Any) -> Any:
    if not isinstance(a, torch.fx.Node):
        return None
    if a.op == "get_attr":
        raise Uncacheable("a submodule argument")
    leaves, tree = ti.torch_tree_flatten(a.meta.get("example_value"))
    return ("node", str(tree), tuple(_describe_example(v) for v in leaves))


def _describe_example(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        shape, stride = tuple(v.shape), tuple(v.stride())
        if not all(type(n) is int for n in (*shape, *stride)):
            raise Uncacheable("a symbolic shape")
        return ("tensor", shape, stride, v.dtype, v.device, v.requires_grad)
    return describe_value(v)


def _plain_node_key(node: torch.fx.Node, thunder_options: dict) -> Any:
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return None  # thunder's check looks into the operator's body
    try:
        target = node.target
        hash(target)
        args = (_describe_node_argument(list(node.args)), _describe_node_argument(dict(node.kwargs)))
        options = describe_value(thunder_options.get("disable_torch_autograd"))
    except Uncacheable:
        return None
    except TypeError:  # an unhashable target
        return None
    return (node.op, target, args, options, ambient_state())


def plain_node_support(node: torch.fx.Node, thunder_options: dict, thunder_check: Callable) -> Any:
    """thunder's own answer for a node without DTensors, cached by the node's call signature (only a yes: a
    no's reason names its node)."""
    key = _plain_node_key(node, thunder_options)
    return PLAIN_NODE_CACHE.get_or_compute(key, lambda: thunder_check(node, thunder_options), keep=lambda d: d[0])
