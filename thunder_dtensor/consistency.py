"""Opt-in check that every rank compiled the same sequence of DTensor ops (``THUNDER_DTENSOR_CHECK_COLLECTIVES=1``).

Every rank must issue the same collectives in the same order, or a job hangs. In a lowered program they
are explicit symbols, checked by kind, mesh dim, reduce op and dtype; where a prim runs as the eager DTensor
op (lowering off, or a prim the lowering keeps) they are implicit in it, so two ranks agree when their
programs hold the same dtensor prims, in the same order, on inputs and outputs of the same global specs.
Each rank traces its own program, though, and Python that branches on the rank (or on anything else that
differs per rank) at trace time gives ranks different programs.

With the variable set, each time thunder.jit finishes a program (forward and backward traces) every rank
describes its dtensor ops with global-level specs only (placements, global shape, dtype, mesh shape and dim
names; never local shapes, which legitimately differ with uneven shards, nor rank lists, which differ on a
sub-mesh), hashes the description and all-gathers the hash over the default process group, or, for a program
on one mesh of some ranks only (a pipeline stage's), over that mesh's groups. Only on a
mismatch are the full descriptions gathered, and every rank raises :class:`CollectiveMismatchError` naming
the first differing position and each rank's op there. Both gathers are made by every rank (the decision to
gather again is taken from the same gathered hashes), so no rank is left blocked in a collective.

Limits: every rank of the group gathered over must compile the program: every rank of the default group for
a program on the whole world or on several meshes, every rank of the mesh for a program on one mesh of some
ranks (not a program compiled on some ranks of its mesh only); programs with neither DTensor inputs nor dtensor
ops are not checked (a rank-0-only plain program must not block). A rank that hits thunder's cache while another
retraces is not detected (it gathers nothing).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.executor import dtensor_ex
from thunder_dtensor.lowering import COLLECTIVE_SYMBOLS, dtensor_comm_ex
from thunder_dtensor.proxy import DTensorProxy

__all__ = ["ENV_VAR", "CollectiveMismatchError", "check_compiled_program", "enabled", "program_ops"]

#: Set to ``1`` to check, at every compilation, that all ranks compiled the same DTensor ops.
ENV_VAR = "THUNDER_DTENSOR_CHECK_COLLECTIVES"


class CollectiveMismatchError(RuntimeError):
    """Ranks compiled different sequences of DTensor ops: running the program would hang or mix up data."""

    def __init__(self, position: str, ops_by_rank: dict[int, str]):
        lines = [f"ranks compiled different DTensor programs; first difference at {position}:"]
        lines += [f"  rank {rank}: {op}" for rank, op in sorted(ops_by_rank.items())]
        lines.append(
            "  hint: every rank must trace the same DTensor ops on the same placements; look for Python that "
            "branches on the rank (or on other per-rank values) inside the jitted function"
        )
        super().__init__("\n".join(lines))
        self.position = position
        self.ops_by_rank = ops_by_rank


_REDUCE_OPS = {"sum", "avg", "max", "min", "product", "premul_sum"}


def enabled() -> bool:
    """Read at every compilation, so setting the variable later in a process takes effect."""
    return os.environ.get(ENV_VAR, "") == "1"


def _describe_dtensor(p: DTensorProxy) -> str:
    mesh = p.device_mesh
    names = "" if mesh.mesh_dim_names is None else f" names={tuple(mesh.mesh_dim_names)}"
    placements = ", ".join(repr(pl) for pl in p.placements)
    return f"{p.dtype.shortname()}{list(p.shape)} ({placements}) mesh={mesh.device_type}{tuple(mesh.shape)}{names}"


def describe_op(bsym: ti.BoundSymbol) -> str:
    """One dtensor op as every rank should see it: the prim and the global specs of its DTensor ins and outs.

    A lowered collective is described by its kind, mesh dim, reduce op and dtype: its local shapes may
    differ per rank (uneven shards), its sequence may not.
    """
    if bsym.sym.name in COLLECTIVE_SYMBOLS:
        tensors = [a for a in bsym.flat_args if isinstance(a, ti.TensorProxy)]
        dtype = tensors[0].dtype.shortname() if tensors else ""
        reduce_op = next((a for a in bsym.args if isinstance(a, str) and a in _REDUCE_OPS), None)
        extra = "" if reduce_op is None else f", {reduce_op}"
        return f"{bsym.sym.name}(mesh_dim={bsym.kwargs.get('mesh_dim')}{extra}, {dtype})"
    ins = ", ".join(_describe_dtensor(a) for a in bsym.flat_args if isinstance(a, DTensorProxy))
    outs = ", ".join(_describe_dtensor(o) for o in bsym.flat_outs if isinstance(o, DTensorProxy))
    return f"{bsym.sym.name}({ins}) -> ({outs})"


#: lowered symbols left out: they issue no communication, and their presence or place legitimately differs by
#: rank. A wait only blocks until its collective is done (each is placed before the first use, and with uneven
#: shards a rank's local program may use the gathered value earlier); ``issued_before`` keeps in the forward the
#: collectives no forward output of this rank reads (a causal ring's step whose chunk this rank does not attend:
#: rank 0 has it, the last rank not). The order collectives are issued in is what must agree
_LEFT_OUT = frozenset({"wait_tensor", "issued_before"})


#: the lowered program's boundary: it issues no communication, and a rank's local program may put it elsewhere
#: among the collectives (an uneven shard's rank wraps a value before an all-gather another rank issues first:
#: fuzz seed 8443 under thunderfx), so it is compared as a set of global specs, not in order
_BOUNDARY = frozenset({"unwrap_dtensor", "wrap_dtensor", "local_contiguous"})


def program_ops(traces: Sequence[tuple[str, Any]]) -> list[str]:
    """The dtensor ops of ``(label, trace)`` pairs, each prefixed with its label: per trace, the communicating ops
    (collectives, prims run as eager DTensor ops) in execution order, then the boundary ops sorted."""
    ops: list[str] = []
    for label, trace in traces:
        if trace is None:
            continue
        boundary: list[str] = []
        for bsym in trace.bound_symbols:
            if bsym.sym.name in _LEFT_OUT:
                continue
            if getattr(bsym.sym, "executor", None) in (dtensor_ex, dtensor_comm_ex):
                in_boundary = bsym.sym.name in _BOUNDARY
                (boundary if in_boundary else ops).append(
                    f"{label}{' boundary' if in_boundary else ''}: {describe_op(bsym)}"
                )
        ops += sorted(boundary)
    return ops


def _all_gather(obj: Any, mesh: Any = None) -> dict[int, Any]:
    """``obj`` from every rank of ``mesh`` (or of the default process group), by global rank (a hook for tests).

    Over a mesh, one gather per mesh dim, each over that dim's group (groups the mesh made already; a new group
    would need every rank of the world): after the last, every rank of the mesh holds every rank's ``obj``. So
    ranks that compile different programs on disjoint sub-meshes (pipeline stages) are never paired."""
    import torch.distributed as dist

    gathered: dict[int, Any] = {dist.get_rank(): obj}
    groups = [None] if mesh is None else [mesh.get_group(dim) for dim in range(mesh.ndim)]
    for group in groups:
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, gathered, group=group)
        gathered = {rank: value for part in parts for rank, value in part.items()}
    return dict(sorted(gathered.items()))


def _first_difference(sequences: dict[int, list[str]]) -> tuple[str, dict[int, str]]:
    longest = max(len(s) for s in sequences.values())
    for i in range(longest):
        at_i = {rank: (s[i] if i < len(s) else "<end of program>") for rank, s in sequences.items()}
        if len(set(at_i.values())) > 1:
            labels = {op.split(":", 1)[0] for op in at_i.values() if op != "<end of program>"}
            return f"op #{i} of the program ({'/'.join(sorted(labels))})", at_i
    raise AssertionError("sequences differ in their hashes but not in their ops")


def check_ops_agree(ops: list[str], mesh: Any = None) -> None:
    """All-gather a hash of ``ops`` over ``mesh`` (or the default process group); on a mismatch, gather the ops
    and raise on every rank."""
    digest = hashlib.sha256("\n".join(ops).encode()).hexdigest()
    if len(set(_all_gather(digest, mesh).values())) == 1:
        return
    position, ops_by_rank = _first_difference(_all_gather(ops, mesh))
    raise CollectiveMismatchError(position, ops_by_rank)


def _sub_mesh(trace: Any) -> Any:
    """The one device mesh of the trace's DTensors where it holds only some ranks of the world (a pipeline
    stage's), else None: the default process group is then the one every rank compiling the program is in."""
    import torch.distributed as dist

    meshes = {
        p.device_mesh
        for bsym in trace.bound_symbols
        for p in (*bsym.flat_args, *bsym.flat_outs)
        if isinstance(p, DTensorProxy)
    }
    if len(meshes) != 1:
        return None
    (mesh,) = meshes
    return mesh if mesh.size() < dist.get_world_size() else None


def check_compiled_program(computation_trace: Any, backward_trace: Any) -> None:
    """thunder.jit's compile hook: with the variable set, check that all ranks compiled the same DTensor ops."""
    if not enabled():
        return
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    ops = program_ops((("forward", computation_trace), ("backward", backward_trace)))
    inputs, _ = ti.tree_flatten(computation_trace.args)
    if ops or any(isinstance(a, DTensorProxy) for a in inputs):
        check_ops_agree(ops, _sub_mesh(computation_trace))
