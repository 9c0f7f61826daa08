"""Pure queries and rewrites of one traced FX graph: DTensor's dispatch of one op on fake local tensors.

Nothing here reads a trace or thunder's state: each function takes a ``torch.fx.Graph`` (or two traced ones)
and answers or rewrites it, so each is tested alone (``tests/unit/test_lowering_rewrites.py``).
:class:`NotLowerable` says why a graph cannot become lowered code; the op then runs as eager DTensor.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, cast

from thunder_dtensor import _integration as ti

import torch


class NotLowerable(Exception):
    """This prim runs as the eager DTensor op; the message says why (it goes into the trace)."""


@dataclasses.dataclass
class Traced:
    graph: Any  # torch.fx.Graph
    n_forward: int  # the first outputs are the forward's, the rest gradients (None where undefined)
    specs: list  # output specs (None for plain tensors and undefined gradients)
    forward: frozenset | None = None  # a joint's nodes once its forward had run (None: not recorded)


def has_mutation(graph: Any) -> bool:
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


def out_of_place(graph: Any) -> None:
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
        # (in-place users are rewritten; a view's target is an OpOverload)
        viewed = any(_is_view(u) and not cast(torch._ops.OpOverload, u.target)._schema.is_mutable for u in base.users)
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


def check_graph(graph: Any) -> None:
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


def drop_identity_views(graph: Any) -> None:
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


def placeholder_nodes(graph: Any) -> list:
    return [n for n in graph.nodes if n.op == "placeholder"]


def output_nodes(graph: Any) -> list:
    (out,) = [n for n in graph.nodes if n.op == "output"]
    return list(out.args[0])


def ancestors(nodes: list) -> set:
    seen: set = set()
    stack = [n for n in nodes if n is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def descendants(graph: Any, nodes: set) -> set:
    """The nodes of ``graph`` that read any of ``nodes``, directly or through others (``nodes`` not included)."""
    reached: set = set()
    for node in graph.nodes:
        if any(n in nodes or n in reached for n in node.all_input_nodes):
            reached.add(node)
    return reached


def unused_collectives(traced: Traced) -> tuple[list, list]:
    """Collectives (and their waits) whose results reach no output: (those of the forward, those of the backward).

    Every rank still issues them: the other ranks receive what this one sends (a ring step whose chunk this
    rank does not attend), so each goes where the same collective goes on a rank that reads it: the forward's
    are those traced while the forward ran (a joint records them; a forward alone has no backward).
    """
    graph = traced.graph
    used = ancestors(output_nodes(graph))
    unused = [
        n for n in graph.nodes if n.op == "call_function" and ti.is_functional_collective(n.target) and n not in used
    ]
    if traced.forward is None:
        return unused, []
    return [n for n in unused if n in traced.forward], [n for n in unused if n not in traced.forward]


def match_forward(first: Traced, again: Traced, env: dict) -> dict | None:
    """Map the forward nodes of ``again`` onto those of ``first`` (already emitted, values in ``env``).

    Both traced the same forward on the same inputs; only the cotangents differ. The forward nodes must
    match one to one in graph order (same op, same arguments): otherwise None.
    """
    old_fwd = ancestors(output_nodes(first.graph)[: first.n_forward])
    new_fwd = ancestors(output_nodes(again.graph)[: again.n_forward])
    to_old = dict(zip(placeholder_nodes(again.graph), placeholder_nodes(first.graph)))
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
