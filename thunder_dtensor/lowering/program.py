"""Pure rewrites of a trace's list of bound symbols, before and after the pass.

Composite symbols that touch DTensors are opened; ``torch.distributed.all_reduce`` calls become the lowering's
functional all-reduce; each forward prim is paired with its generic vjp; the emitted ops are bound to the
operators that will run them; each collective's wait moves to its first reader; each unwrap of a DTensor moves
up to where that DTensor is defined; with ``dtensor_issue_early=True``, each collective is issued as early as its
inputs allow; with ``dtensor_one_shot_all_reduce_bytes=N``, small sum all-reduces become one all-gather and a
local sum.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.lowering.symbols import (
    collective_symbol,
    dtensor_comm_ex,
    dtensor_local_ex,
    issues_a_collective,
    local_contiguous,
    local_op_symbol,
)
from thunder_dtensor.primitive import PRIMS, is_generic_vjp
from thunder_dtensor.proxy import DTensorProxy

import torch


def is_backward(bsym: Any) -> bool:
    """Whether thunder's autodiff tagged ``bsym`` as part of the backward."""
    return ti.BoundSymbolTag.BACKWARD in bsym.tags  # type: ignore[attr-defined]  # (a tag registered at runtime)


def inherit_backward_tag(bsym: Any, replacements: Sequence) -> None:
    """Tag ``replacements`` (what ``bsym`` was opened or lowered into) as backward where ``bsym`` is.

    thunder's autodiff tags every symbol of the backward; its ``dataflow`` fusion partition (thunderfx's) never
    fuses a tagged symbol with an untagged one, so a lowered backward whose emitted ops lost the tag was cut into
    a region per stretch of thunder's own gradient ops (the block's fused backward under thunderfx: three graphs).
    """
    if is_backward(bsym):
        for b in replacements:
            b.tags.add(ti.BoundSymbolTag.BACKWARD)  # type: ignore[attr-defined]


def flatten_dtensor_composites(bsyms: list) -> list:
    """Top-level symbols, with composite symbols that touch DTensors replaced by their subsymbols."""
    out = []
    for bsym in bsyms:
        touches = any(isinstance(p, DTensorProxy) for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs))
        if touches and bsym.subsymbols and bsym.sym.name not in PRIMS and not bsym.sym.is_prim:
            opened = flatten_dtensor_composites(list(bsym.subsymbols))
            inherit_backward_tag(bsym, opened)
            out.extend(opened)
        else:
            out.append(bsym)
    return out


def _new_tensor(trace: Any, shape: Sequence[int], like: Any) -> Any:
    with ti.tracectx(trace):
        return ti.TensorProxy(shape=tuple(shape), dtype=like.dtype, device=like.device, requires_grad=False)


def functional_all_reduces(bsyms: list, trace: Any) -> list:
    """thunder's prim of ``torch.distributed.all_reduce`` on a process group (how transformers' tensor parallelism
    reduces a row-parallel output, on local tensors) as the lowering's functional ``all_reduce`` and its wait.

    The value is the same (the in-place write that follows, ``copy_``, stays); the program then holds no c10d call
    on a process group object: a fusion region compiles it without dynamo (``compile_fused_regions_without_dynamo``)
    and the waits move to their readers like the lowering's own. Composites holding such a call are opened (those
    holding none are kept whole).
    """
    all_reduce = collective_symbol(torch.ops._c10d_functional.all_reduce.default)
    wait = collective_symbol(torch.ops._c10d_functional.wait_tensor.default)
    out: list = []
    for bsym in bsyms:
        found = ti.process_group_all_reduce(bsym)
        if found is not None:
            tensor, reduce_op, group = found
            issued = _new_tensor(trace, tensor.shape, tensor)
            converted = [
                all_reduce.bind(tensor, reduce_op, group, mesh_dim=None, output=issued),
                wait.bind(issued, output=bsym.output),
            ]
        elif bsym.subsymbols and not bsym.sym.is_prim:
            converted = functional_all_reduces(list(bsym.subsymbols), trace)
            unchanged = len(converted) == len(bsym.subsymbols) and all(map(operator.is_, converted, bsym.subsymbols))
            if unchanged:
                out.append(bsym)
                continue
        else:
            out.append(bsym)
            continue
        inherit_backward_tag(bsym, converted)
        out.extend(converted)
    return out


def all_reduces_in_one_shot(bsyms: list, trace: Any, max_bytes: int) -> list:
    """Each floating-point sum all-reduce of at most ``max_bytes`` (per rank) as one all-gather and a local sum of
    the gathered values (a "one-shot" all-reduce), in place of DTensor's and c10d's ring.

    A ring all-reduce takes ``2 (n - 1)`` steps, an all-gather ``n - 1``: where a message is small, its time is
    the steps' latency (on 2 CPU ranks over gloo, 0.45-0.9x the ring's time up to 64 KiB; above 256 KiB the
    gathered bytes cost more). Every rank sums the same gathered values in the same order: replicated values stay
    equal on every rank; on more than 2 ranks the order of the sum differs from the ring's (rounding). The wait
    must already be at its first reader (:func:`place_waits_late`): the sum is placed where the wait is.
    """
    all_reduce = collective_symbol(torch.ops._c10d_functional.all_reduce.default)
    gather = collective_symbol(torch.ops._c10d_functional.all_gather_into_tensor.default)
    wait = collective_symbol(torch.ops._c10d_functional.wait_tensor.default)
    view, total = local_op_symbol(torch.ops.aten.view.default), local_op_symbol(torch.ops.aten.sum.dim_IntList)
    read_by_waits_only: dict[str, bool] = {}
    for bsym in bsyms:
        for p in bsym.flat_proxy_args:
            read_by_waits_only[p.name] = read_by_waits_only.get(p.name, True) and bsym.sym.id is wait.id
    gathered: dict[str, tuple] = {}  # the all-reduce's result -> (the gathered values, ranks, the tensor's shape)
    out: list = []
    for bsym in bsyms:
        if bsym.sym.id is all_reduce.id and bsym.args[1] == "sum" and read_by_waits_only.get(bsym.output.name):
            tensor, _, group = bsym.args
            dtype = cast(torch.dtype, ti.dtypes.to_torch_dtype(tensor.dtype))
            if dtype.is_floating_point and tensor.numel * dtype.itemsize <= max_bytes:  # (an integer sum promotes)
                ranks, shape = ti.process_group_size(group), tuple(tensor.shape)
                flat = _new_tensor(trace, shape or (1,), tensor)
                result = _new_tensor(trace, (ranks * (shape or (1,))[0], *shape[1:]), tensor)
                emitted = [
                    local_contiguous.bind(tensor, output=flat) if shape else view.bind(tensor, [1], output=flat),
                    gather.bind(flat, ranks, group, mesh_dim=bsym.kwargs.get("mesh_dim"), output=result),
                ]
                inherit_backward_tag(bsym, emitted)
                out.extend(emitted)
                gathered[bsym.output.name] = (result, ranks, shape)
                continue
        if bsym.sym.id is wait.id and bsym.args[0].name in gathered:
            result, ranks, shape = gathered.pop(bsym.args[0].name)
            arrived, stacked = _new_tensor(trace, result.shape, result), _new_tensor(trace, (ranks, *shape), result)
            emitted = [
                wait.bind(result, output=arrived),
                view.bind(arrived, [ranks, *shape], output=stacked),
                total.bind(stacked, [0], output=bsym.output),
            ]
            inherit_backward_tag(bsym, emitted)
            out.extend(emitted)
            continue
        out.append(bsym)
    return out


def pair_vjps(bsyms: list) -> dict[int, int]:
    """Forward prim index -> index of its generic vjp (the one taking the same arguments, or recomputations of them:
    FSDP2's parameters, gathered again in the backward, reach a tensor-parallel linear's vjp so)."""
    forwards: dict[tuple, list[int]] = {}
    for i, bsym in enumerate(bsyms):
        if bsym.sym.name in PRIMS and not is_generic_vjp(bsym.sym.name):
            forwards.setdefault(_call_key(bsym.sym.name, bsym.args, bsym.kwargs), []).append(i)
    recomputed = recomputed_in_backward(bsyms)
    pairs: dict[int, int] = {}
    for j, bsym in enumerate(bsyms):
        if is_generic_vjp(bsym.sym.name):
            args, kwargs = bsym.args[0], bsym.args[1]
            name = bsym.sym.name.removesuffix("_vjp_prim") + "_prim"
            key = _call_key(name, args, kwargs, recomputed)
            candidates = [i for i in forwards.get(key, []) if i < j and i not in pairs]
            if candidates:
                pairs[candidates[-1]] = j
    return pairs


def recomputed_in_backward(bsyms: list) -> dict[str, str]:
    """Name of each value thunder's autodiff recomputes in the backward -> the forward value it recomputes.

    thunder copies a producer tagged for recomputation into the backward and names its outputs ``bw_<name>``."""
    produced = {p.name for b in bsyms for p in b.flat_proxy_outs}
    recompute = ti.BoundSymbolTag.RECOMPUTE_IN_BACKWARD  # type: ignore[attr-defined]  # (registered at runtime)
    backward = ti.BoundSymbolTag.BACKWARD  # type: ignore[attr-defined]
    names: dict[str, str] = {}
    for b in bsyms:
        tags = getattr(b, "tags", ())
        if recompute in tags and backward in tags:
            for p in b.flat_proxy_outs:
                if p.name.startswith("bw_") and p.name.removeprefix("bw_") in produced:
                    names[p.name] = p.name.removeprefix("bw_")
    return names


def _call_key(name: str, args: Any, kwargs: Any, renamed: dict[str, str] | None = None) -> tuple:
    flat = ti.torch_tree_flatten((args, kwargs))[0]
    renamed = renamed or {}
    return (name, tuple(renamed.get(x.name, x.name) if isinstance(x, ti.Proxy) else repr(x) for x in flat))


def claimed(bsyms: list, executors: Sequence[Any]) -> list:
    """Emitted ops (the symbols of the lowering's two executors) bound to the operators that will run them (see
    ``lower_dtensor_program``)."""
    out = []
    # collectives and the boundary run on ``dtensor_comm`` wherever no fusion executor takes them (the torch
    # executor has them too, only for the torch.compile executor's regions, which it runs)
    comm_executors = [ex for ex in executors if ex.name != "torch"]
    for bsym in bsyms:
        comm = bsym.sym.id in dtensor_comm_ex.implmap
        emitted = comm or bsym.sym.id in dtensor_local_ex.implmap
        op = ti.claiming_operator(bsym, comm_executors if comm else executors) if emitted else None
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
        if pending:  # a wait on a pending wait's result (code that waits twice) first places that one
            reads = {a.name for a in bsym.flat_proxy_args}
            for name in [n for n in pending if n in reads]:
                out.append(pending.pop(name))
        if bsym.sym.name == "wait_tensor":
            pending[bsym.flat_proxy_outs[0].name] = bsym
            continue
        out.append(bsym)
    assert not pending or out[-1].sym.id == ti.prims.PrimIDs.RETURN, "a wait after the return"
    out[-1:-1] = list(pending.values())
    return out


#: tags of symbols nothing is moved across by :func:`issue_collectives_early` (random draws keep their order;
#: a write or a check must see what it saw)
_BARRIER_TAGS = ("RANDOM_OP", "IN_PLACE", "DONT_DCE", "CTX_MANAGER_ENTER_EXIT_OP")
_BARRIER_WORDS = ("rand", "dropout", "bernoulli", "uniform", "normal", "exponential", "multinomial", "poisson", "seed")


def _is_barrier(bsym: Any) -> bool:
    if issues_a_collective(bsym) or bsym.sym.name == "wait_tensor":  # (tagged never-dead, but movable by data)
        return False
    tags = {getattr(t, "name", t) for t in (getattr(bsym.sym, "tags", None) or ())}
    name = bsym.sym.name
    return (
        not bsym.flat_proxy_outs  # there for its effect (a check, a write)
        or bool(tags.intersection(_BARRIER_TAGS))
        or (name.endswith("_") and not name.endswith("__"))  # an in-place op
        or any(word in name for word in _BARRIER_WORDS)
        or name in ("get_grad", "put_grad")  # a joint trace's forward and backward stay apart
        or bsym.sym.id == ti.prims.PrimIDs.RETURN
    )


def issue_collectives_early(bsyms: list) -> list:
    """Each collective issued as early as its inputs allow: the symbols it depends on, then it, ahead of the
    computation it does not need (collectives keep their order).

    Within each stretch between barriers (random ops, in-place ops, symbols with effects only, a joint trace's
    ``get_grad`` / ``put_grad``, the return), the collectives are taken in order, each preceded by the symbols
    of that stretch it transitively reads that are not placed yet; the rest of the stretch follows in its order.
    Only data order changes, so values do not. With the waits placed late (:func:`place_waits_late`), a
    collective then overlaps everything between its issue and its first reader: on NCCL, where a collective
    runs on its own stream, that is time hidden; on gloo, whose collectives complete on their own threads, some
    loopback latency (``benchmarks/bench.py``'s ``thunder_on_early`` variant: 0.93-1.01x the default's step
    time).
    """
    out: list = []
    stretch: list = []
    for bsym in bsyms:
        if _is_barrier(bsym):
            out.extend(_collectives_first(stretch))
            out.append(bsym)
            stretch = []
        else:
            stretch.append(bsym)
    out.extend(_collectives_first(stretch))
    return out


def _collectives_first(stretch: list) -> list:
    if not any(issues_a_collective(b) for b in stretch):
        return stretch
    producer = {p.name: i for i, b in enumerate(stretch) for p in b.flat_proxy_outs}
    # the program's arguments stay unpacked first, together: each unwrap moves up to its unpacking
    # (unwrap_early), and an unpacking left between stretches of local math would cut a fusion region there
    placed = [b.sym.name.startswith("unpack_") for b in stretch]
    out: list = [b for b, unpacks in zip(stretch, placed) if unpacks]
    for k, bsym in enumerate(stretch):
        if not issues_a_collective(bsym):
            continue
        needed, todo = set(), [k]
        while todo:
            i = todo.pop()
            if i in needed or placed[i]:
                continue
            needed.add(i)
            todo.extend(producer[p.name] for p in stretch[i].flat_proxy_args if p.name in producer)
        for i in sorted(needed):
            placed[i] = True
            out.append(stretch[i])
    out.extend(b for i, b in enumerate(stretch) if not placed[i])
    return out


def unwrap_early(bsyms: list) -> list:
    """Move each ``unwrap_dtensor`` that makes no copy to just after the symbol that defines its DTensor (for the
    program's inputs and parameters: the unpacking at the top).

    An unwrap is a view of the DTensor's local tensor: moving it costs nothing and changes no value. Left where
    the lowering emitted it (before the first op reading the local tensor), every parameter's unwrap sits
    between two stretches of local math, and a fusion executor (thunder's torch.compile executor) cuts its
    region there: a decode step of a 2-layer TP Llama became 16 inductor graphs instead of one.
    """
    waiting: dict[str, list] = {}
    for bsym in bsyms:
        if bsym.sym.name == "unwrap_dtensor" and not bsym.args[2]:  # (x, spec, layout): no copy
            waiting.setdefault(bsym.flat_proxy_args[0].name, []).append(bsym)
    if not waiting:
        return bsyms
    moved = {id(b) for group in waiting.values() for b in group}
    defined = {p.name for b in bsyms for p in b.flat_proxy_outs}
    out = [b for name in list(waiting) if name not in defined for b in waiting.pop(name)]  # the trace's arguments
    for bsym in bsyms:
        if id(bsym) in moved:
            continue
        out.append(bsym)
        for p in bsym.flat_proxy_outs:
            out.extend(waiting.pop(p.name, ()))
    return out
