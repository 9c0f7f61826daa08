"""Helpers that make a multi-rank test a few lines.

Multi-rank tests run under ``torchrun --nproc-per-node N -m pytest ...``: every rank runs the same tests in
the same order, with one process group for the session (gloo on CPU, NCCL on CUDA). The helpers build the
same full tensors on every rank, distribute them, and compare thunder's results with plain torch on the
full tensors (the math) and with eager DTensor (the placements, and the collectives of each kind: see
:data:`COMMS_ASSERTED`; the cases where the jit does more than eager are reported at the end of a session).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._python_dispatch

__all__ = [
    "COMMS_ASSERTED",
    "COMM_COMPARISONS",
    "CollectivesByGroup",
    "RUNS",
    "CaseResult",
    "CommComparison",
    "DTensorCase",
    "Outcome",
    "assert_jit_matches_eager",
    "assert_matches_full",
    "assert_no_more_comms",
    "collectives_issued",
    "comm_counts",
    "comm_report",
    "device_type",
    "eager_error",
    "init_distributed",
    "make_full",
    "mesh_1d",
    "mesh_2d",
    "raises",
    "rewritten",
    "run_case",
    "without_sharding_rule",
    "world_size",
    "write_comm_report",
]


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float = 120.0) -> None:
    """Join the torchrun process group once (gloo on CPU, NCCL on CUDA)."""
    if dist.is_initialized():
        return
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device_type() == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def shutdown_distributed() -> None:
    """Leave the process group once every rank is done with it, and exit once every rank has left it: a rank that
    tears gloo down while a peer still reads from it, or exits while a peer is still tearing down, can abort at
    exit (``terminate called without an active exception``; ``make demo``: 2 runs of 30 with the first
    barrier alone). The second wait is on torchrun's store, which outlives the process group."""
    if not dist.is_initialized():
        return
    from thunder_dtensor._integration import default_store

    store, size = default_store(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    left, deadline = store.add("thunder_dtensor_ranks_left", 1), time.monotonic() + 60.0
    while left < size and time.monotonic() < deadline:
        time.sleep(0.01)
        left = store.add("thunder_dtensor_ranks_left", 0)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


@functools.cache
def mesh_1d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type(), (world_size(),))


@functools.cache
def mesh_2d(rows: int = 2) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type(), (rows, world_size() // rows), mesh_dim_names=("dp", "tp"))


def make_full(
    shape: Sequence[int], *, seed: int, dtype: torch.dtype = torch.float32, low: float = -1.0, int_high: int = 5
) -> torch.Tensor:
    """The same full tensor on every rank (seeded), on this rank's device.

    Floats are uniform in [low, 1); integers in [0, int_high).
    """
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.rand(tuple(shape), generator=g) * (1.0 - low) + low
    else:
        t = torch.randint(0, int_high, tuple(shape), generator=g)
    return t.to(dtype=dtype, device=device_type())


def assert_jit_matches_eager(fn: Callable, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``thunder.jit(fn)`` of a plain random tensor gives eager's output and input gradient (for one random
    cotangent); returns eager's input and that cotangent, for checks of the gradient's own value."""
    import thunder

    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, expected = thunder.jit(fn)(x), fn(x2)
    g = torch.randn_like(expected)
    out.backward(g)
    expected.backward(g)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x2.grad)
    return x2, g


def assert_matches_full(actual: Any, expected_full: torch.Tensor, *, what: str = "", rtol=None, atol=None) -> None:
    """A DTensor (or a plain tensor) equals ``expected_full``, computed with plain torch on full tensors."""
    from torch.distributed.tensor import DTensor

    full = actual.full_tensor() if isinstance(actual, DTensor) else actual
    torch.testing.assert_close(full, expected_full, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@dataclass
class DTensorCase:
    """One function on DTensor inputs, given as full tensors plus placements."""

    fn: Callable
    full_inputs: Sequence[torch.Tensor]
    placements: Sequence[Sequence[Any]]
    requires_grad: Sequence[bool] | None = None
    mesh: Any = None
    kwargs: dict = field(default_factory=dict)


#: the ways a rewritten op runs (``thunder_dtensor.ops.no_rule.HOW_OPS_RAN``), most preferred first
REWRITES: tuple[str, ...] = ("decomposition", "replicated fallback")


@dataclass(frozen=True)
class Outcome:
    """What thunder_dtensor does with a case, declared by the test; :func:`run_case` (``expect=``) asserts it.

    - ``RUNS``: it runs on DTensor's sharding rules, no op rewritten, with plain torch's values (and eager
      DTensor's placements where the case is compared with eager, which must then run it too);
    - ``rewritten(how)``: it runs with an op rewritten (``ops/no_rule.py``: where eager DTensor has no rule, or
      one known to be wrong), ``how`` the least preferred way any op ran, with plain torch's values (and eager's
      placements where eager runs it);
    - ``raises(error, match)``: it raises ``error`` itself (not a subclass), whose message contains ``match``.
    """

    kind: str
    how: str | None = None
    error: type[Exception] | None = None
    match: str = ""

    def __str__(self) -> str:
        if self.kind == "rewritten":
            return f"rewritten ({self.how})"
        if self.kind == "raises":
            return f"raises {getattr(self.error, '__name__', self.error)}({self.match!r})"
        return self.kind


RUNS = Outcome("runs")


def rewritten(how: str) -> Outcome:
    """The case runs with an op rewritten, ``how`` ("decomposition" or "replicated fallback") the least
    preferred way any op of it ran."""
    assert how in REWRITES, how
    return Outcome("rewritten", how=how)


def raises(error: type[Exception], match: str) -> Outcome:
    """The case raises exactly ``error`` (a named error, not a subclass of it), with ``match`` in its message."""
    assert match, "name a fragment of the message: the error must be raised for the declared reason"
    return Outcome("raises", error=error, match=match)


def _how_ops_ran() -> dict[str, str]:
    from thunder_dtensor.ops.no_rule import HOW_OPS_RAN

    return dict(HOW_OPS_RAN)


def _assert_ran_as(expect: Outcome | None, how_ops_ran: dict[str, str], eager_failure: Exception | None) -> None:
    """The run matched ``expect``: no op rewritten for RUNS, else the declared way (None: anything that ran)."""
    if expect is None:
        if eager_failure is not None and not how_ops_ran:
            raise AssertionError(f"eager DTensor fails ({eager_failure!r}), thunder_dtensor runs it without a rewrite")
        return
    if expect.kind == "runs":
        assert eager_failure is None, (
            f"declared {expect}, but eager DTensor fails on the case ({eager_failure!r}): compare it with plain "
            "torch only (compare_eager=False), or declare what thunder_dtensor does instead"
        )
        assert not how_ops_ran, f"declared {expect}, but ops ran rewritten: {how_ops_ran}"
    elif expect.kind == "rewritten":
        assert how_ops_ran, f"declared {expect}, but no op ran rewritten"
        least = max(how_ops_ran.values(), key=REWRITES.index)
        assert least == expect.how, f"declared {expect}, but the ops ran: {how_ops_ran}"
    else:
        raise AssertionError(f"declared {expect}, but the case ran")


def _assert_raises(case: DTensorCase, expect: Outcome, jitted: Callable, inputs: list, backward: bool) -> CaseResult:
    """``jitted`` on the case (forward, then backward with ones) raises the declared error."""
    try:
        outs = [o for o in _as_tuple(jitted(*inputs, **case.kwargs)) if isinstance(o, torch.Tensor)]
        if backward and any(o.requires_grad for o in outs):
            outs = [o for o in outs if o.requires_grad]
            torch.autograd.backward(
                outs, [_cotangent_like(o, torch.ones(o.shape, dtype=o.dtype, device=o.device)) for o in outs]
            )
    except Exception as error:
        if type(error) is not expect.error or expect.match not in str(error):
            raise AssertionError(f"declared {expect}, but it raises {type(error).__name__}: {error}") from error
        from thunder_dtensor.errors import DTensorOpError

        if isinstance(error, DTensorOpError):  # names the op and the inputs' placements
            assert "input 0:" in str(error) and "placements=" in str(error), str(error)
        return CaseResult(None, None, [], [], jitted, error=error)
    raise AssertionError(f"declared {expect}, but the case ran (how ops ran: {_how_ops_ran() or 'no rewrite'})")


@dataclass
class CaseResult:
    thunder_out: Any
    eager_out: Any
    thunder_grads: list
    eager_grads: list
    jitted: Callable
    #: the collective comparisons made for this case (forward, then backward), empty where eager did not run
    comms: list = field(default_factory=list)
    #: the full cotangents the outputs were given in the backward (empty without a backward)
    cotangents: list = field(default_factory=list)
    #: op name -> how its calls ran where rewritten (``ops/no_rule.py``'s ``HOW_OPS_RAN``); empty: none was
    how_ops_ran: dict = field(default_factory=dict)
    #: the error the case raised, where it was declared to (``raises``)
    error: Exception | None = None


# ---------------------------------------------------------------------------------------------------------
# Collectives: jit vs eager DTensor, per kind, forward and backward
# ---------------------------------------------------------------------------------------------------------

#: The phases in which tests built on :func:`run_case` assert that the jit does no more collectives of any kind
#: than eager DTensor (callers pass it as ``assert_comms``). Both: the lowered backward comes from the joint
#: program (no forward op, and so no hidden collective, is rerun).
COMMS_ASSERTED: tuple[str, ...] = ("forward", "backward")

#: Every comparison :func:`run_case` made in this process, for the session report (see :func:`comm_report`).
COMM_COMPARISONS: list[CommComparison] = []

# CommDebugMode keys are functional or c10d op packets; one name per kind of collective
_COMM_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast",
    "scatter_": "scatter",
    "gather_": "gather",
    "reduce_": "reduce",
}


def collectives_issued(traces: Sequence[Any], groups: Sequence[str] | None = None) -> dict[str, int]:
    """The collectives executed programs (``traces``) issue, by symbol name, counted inside thunder's torch.compile
    regions too (torch's ``CommDebugMode`` is a dispatch mode, which torch.compile refuses); only those over the
    process groups named ``groups``, where given (a functional collective's last argument names its group)."""
    from thunder_dtensor.lowering import issues_a_collective

    counts: dict[str, int] = {}

    def visit(bsyms: Sequence[Any]) -> None:
        for b in bsyms:
            if issues_a_collective(b) and (groups is None or b.args[-1] in groups):
                counts[b.sym.name] = counts.get(b.sym.name, 0) + 1
            elif b.sym.name.startswith("TorchCompile"):
                visit(b.subsymbols)

    for trace in traces:
        visit(trace.bound_symbols)
    return dict(sorted(counts.items()))


class CollectivesByGroup(torch.utils._python_dispatch.TorchDispatchMode):
    """Collectives issued while it is on, by kind and process group (``counts[group name][kind]``).

    ``CommDebugMode`` counts by op only: where two meshes' collectives share a kind (FSDP2's and tensor
    parallelism's all-gathers), this tells them apart. Functional collectives name their group; c10d ops take it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _COMM_KINDS.get(func._opname) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind is not None:
            names = [a.name for a in func._schema.arguments]
            values = dict(zip(names, args)) | kwargs
            group = values.get("group_name")
            if group is None and values.get("process_group") is not None:  # c10d ops take it boxed
                group = dist.ProcessGroup.unbox(values["process_group"]).group_name
            by_kind = self.counts.setdefault(str(group), {})
            by_kind[kind] = by_kind.get(kind, 0) + 1
        return func(*args, **kwargs)

    def of(self, *group_names: str) -> dict[str, int]:
        """The counts by kind over these groups."""
        total: dict[str, int] = {}
        for name in group_names:
            for kind, n in self.counts.get(name, {}).items():
                total[kind] = total.get(kind, 0) + n
        return dict(sorted(total.items()))


def comm_counts(mode: Any) -> dict[str, int]:
    """Collectives a ``CommDebugMode`` saw, by kind (``all_gather``, ``reduce_scatter``, ``all_reduce``, ...)."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        kind = _COMM_KINDS.get(name, name)
        if n:
            counts[kind] = counts.get(kind, 0) + n
    return dict(sorted(counts.items()))


@dataclass(frozen=True)
class CommComparison:
    """One case's collectives in one phase ("forward" or "backward"): the jit's and eager DTensor's, by kind."""

    case: str
    phase: str
    world_size: int
    jit: dict
    eager: dict

    @property
    def excess(self) -> dict[str, tuple[int, int]]:
        """Kinds of which the jit does more than eager: kind -> (jit count, eager count)."""
        return {k: (n, self.eager.get(k, 0)) for k, n in self.jit.items() if n > self.eager.get(k, 0)}

    def as_dict(self) -> dict:
        return {
            "case": self.case,
            "phase": self.phase,
            "world_size": self.world_size,
            "jit": self.jit,
            "eager": self.eager,
            "excess": {k: {"jit": j, "eager": e} for k, (j, e) in self.excess.items()},
        }


def _compare_comms(label: str, phase: str, jit_mode: Any, eager_mode: Any) -> CommComparison:
    record = CommComparison(label, phase, world_size(), comm_counts(jit_mode), comm_counts(eager_mode))
    COMM_COMPARISONS.append(record)
    return record


def assert_no_more_comms(comparisons: Sequence[CommComparison], phases: Sequence[str]) -> None:
    """In each of ``phases``, the jit did no more collectives of any kind than eager DTensor."""
    for c in comparisons:
        if c.phase in phases and c.excess:
            raise AssertionError(f"{c.phase}: the jit does more collectives than eager: {c.jit} vs eager {c.eager}")


def comm_report(comparisons: Sequence[CommComparison] | None = None) -> list[str]:
    """Lines of a table of the cases in which the jit does more collectives than eager (empty if none)."""
    rows = [c for c in (COMM_COMPARISONS if comparisons is None else comparisons) if c.excess]
    if not rows:
        return []
    width = max(len(c.case) for c in rows)
    lines = [
        f"jit does more collectives than eager in {len(rows)} cases (world size {rows[0].world_size}):",
        f"{'case':<{width}}  {'phase':<8}  kind: jit vs eager",
    ]
    for c in rows:
        excess = ", ".join(f"{k}: {j} vs {e}" for k, (j, e) in c.excess.items())
        lines.append(f"{c.case:<{width}}  {c.phase:<8}  {excess}")
    return lines


def write_comm_report(path: str, comparisons: Sequence[CommComparison] | None = None) -> str:
    """Every comparison as JSON; ``{world_size}`` in ``path`` is replaced (2- and 4-rank runs write apart)."""
    import json

    records = COMM_COMPARISONS if comparisons is None else comparisons
    path = path.format(world_size=world_size())
    with open(path, "w") as f:
        json.dump(
            {
                "world_size": world_size(),
                "cases_with_more": sum(1 for c in records if c.excess),
                "comparisons": [c.as_dict() for c in records],
            },
            f,
            indent=1,
        )
    return path


_LABELS_USED: dict[str, int] = {}


def _case_label(case: DTensorCase) -> str:
    """The running pytest test's id (outside pytest, the function's name); ``#2``, ... for a test's later cases."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    label = current.rsplit(" (", 1)[0].rsplit("/", 1)[-1] if current else getattr(case.fn, "__name__", repr(case.fn))
    _LABELS_USED[label] = n = _LABELS_USED.get(label, 0) + 1
    return label if n == 1 else f"{label} #{n}"


def recorded_calls(monkeypatch: Any, owner: Any, name: str) -> list:
    """Record each call of ``owner.name`` (its first argument; the call still runs), for the rest of the test."""
    calls: list = []
    real = getattr(owner, name)

    def recording(first: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(first)
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def same_placements(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Placement equality, with eager's ``_MaskPartial`` (a per-call object: its mask buffer is part of its
    equality) equal to thunder_dtensor's :class:`~thunder_dtensor.spec.MaskPartial` of the same vocabulary.

    A masked partial is not a plain ``Partial``: DTensor's rules treat the two differently downstream.
    """
    from thunder_dtensor.spec import as_traced_placement

    return len(a) == len(b) and all(as_traced_placement(pa) == as_traced_placement(pb) for pa, pb in zip(a, b))


def table_gradient_placements_accepted(mine: Sequence[Any], eager: Sequence[Any], table: Sequence[Any]) -> bool:
    """Whether an embedding table's gradient is placed as the package decides, or as eager places it.

    A vocab-sharded table gets its gradient in the table's placements on each mesh dim, except ``Partial`` where
    eager's is ``Partial`` (the ids sharded over a mesh dim the table is replicated on: each rank holds its own ids'
    rows).
    """
    if same_placements(mine, eager):
        return True
    return len(mine) == len(table) == len(eager) and all(
        same_placements([m], [t]) or (m.is_partial() and e.is_partial()) for m, e, t in zip(mine, eager, table)
    )


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _case_inputs(case: DTensorCase, *, distributed: bool, backward: bool) -> list:
    """Fresh copies of the case's inputs: full tensors, or distributed with the case's placements."""
    from torch.distributed.tensor import distribute_tensor

    mesh = case.mesh if case.mesh is not None else mesh_1d()
    requires_grad = case.requires_grad or [t.is_floating_point() for t in case.full_inputs]
    out = []
    for t, placements, rg in zip(case.full_inputs, case.placements, requires_grad):
        x = (
            distribute_tensor(t.detach().clone(), mesh, list(placements))
            if distributed and placements is not None
            else t.detach().clone()
        )
        out.append(x.requires_grad_(rg and backward))
    return out


def _cotangent_like(out: Any, full: torch.Tensor) -> Any:
    """``full`` as the cotangent of ``out``: distributed like it, a Partial dim Replicated (a full value)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if isinstance(out, DTensor):
        placements = [Replicate() if p.is_partial() else p for p in out.placements]
        return distribute_tensor(full, out.device_mesh, placements)
    return full


@contextlib.contextmanager
def without_sharding_rule(*ops: Any) -> Iterator[None]:
    """DTensor has no sharding rule for the aten ops ``ops`` (``torch.ops.aten.addbmm.default``, ...) meanwhile.

    For tests of what happens where DTensor has none: the op is taken out of the sharding propagator's tables
    and handlers and out of its derivation of strategies from an op's decomposition, so eager DTensor raises
    its "does not have a sharding strategy" error, whether or not this torch release has a rule. DTensor's and
    this package's caches of propagation results are cleared on entry and on exit.
    """
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    tables = [dispatcher._custom_op_handlers] + [
        getattr(propagator, name)
        for name in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
        if hasattr(propagator, name)
    ]
    removed = [(table, op, table.pop(op)) for table in tables for op in ops if op in table]
    strategy: Any = None
    try:  # torch 2.13 derives a strategy from the op's decomposition where it has none
        from torch.distributed.tensor._decompositions import DecompShardingStrategy as strategy
    except ImportError:
        pass
    has_decomp = getattr(strategy, "__dict__", {}).get("has_decomp")
    if has_decomp is not None:
        blocked = frozenset(ops)
        strategy.has_decomp = staticmethod(lambda op: op not in blocked and has_decomp.__func__(op))
    _forget_sharding_decisions()
    try:
        yield
    finally:
        for table, op, rule in removed:
            table[op] = rule
        if has_decomp is not None:
            strategy.has_decomp = has_decomp
        _forget_sharding_decisions()


def _forget_sharding_decisions() -> None:
    """DTensor's cached sharding decisions and this package's: propagation results, the ops it decomposes, plain
    programs (a change of DTensor's rules changes each of them)."""
    from thunder_dtensor import _integration as ti
    from thunder_dtensor._integration import bootstrap
    from thunder_dtensor.ops.no_rule import PLAIN_PROGRAM_CACHE
    from thunder_dtensor.primitive import PROPAGATION_CACHE

    ti.clear_sharding_propagation_cache()
    bootstrap._DECOMPOSITIONS_WITHOUT_STRATEGY = None  # recomputed from DTensor's tables on the next use
    PROPAGATION_CACHE.clear()
    PLAIN_PROGRAM_CACHE.clear()


def eager_error(case: DTensorCase, *, backward: bool = True) -> Exception | None:
    """What eager DTensor raises on ``case`` (forward, then backward with ones), or None if it runs.

    Tests of what thunder does where eager fails branch on this instead of asserting that eager fails, so
    they compare with eager the day a torch release makes eager work.
    """
    from thunder_dtensor._integration import clear_sharding_propagation_cache

    clear_sharding_propagation_cache()
    inputs = _case_inputs(case, distributed=True, backward=backward)
    try:
        outs = [o for o in _as_tuple(case.fn(*inputs, **case.kwargs)) if isinstance(o, torch.Tensor)]
        if backward and any(o.requires_grad for o in outs):
            outs = [o for o in outs if o.requires_grad]
            torch.autograd.backward(
                outs, [_cotangent_like(o, torch.ones(o.shape, dtype=o.dtype, device=o.device)) for o in outs]
            )
    except Exception as error:
        return error
    return None


def run_case(
    case: DTensorCase,
    *,
    backward: bool = True,
    compare_eager: bool = True,
    rtol=None,
    atol=None,
    random: bool = False,
    seed: int = 1234,
    assert_comms: Sequence[str] = (),
    label: str | None = None,
    jit_kwargs: dict | None = None,
    own_grad_placements: dict[int, Sequence[Any]] | None = None,
    expect: Outcome | None = None,
) -> CaseResult:
    """Run ``case.fn`` under thunder.jit on DTensors and check it.

    Checks, on every rank: outputs and input gradients equal plain torch on the full tensors; and, when
    ``compare_eager``, output and gradient placements equal eager DTensor's on the same inputs, and the
    collectives of each kind, forward and backward, are compared with eager's (recorded in
    :data:`COMM_COMPARISONS`; asserted no more than eager's in the phases named by ``assert_comms``, e.g.
    :data:`COMMS_ASSERTED`).

    ``random``: the op draws random numbers (dropout), so plain torch on full tensors draws a different
    mask; eager DTensor and the jit both run after ``torch.manual_seed(seed)`` and values and gradients are
    compared with eager's instead.

    ``own_grad_placements``: input index -> the gradient placements thunder_dtensor gives by design where they
    differ from eager's (the vocab-parallel table's gradient stays ``Shard(0)``); asserted instead of eager's.

    ``expect``: what thunder_dtensor is declared to do with the case (:class:`Outcome`: ``RUNS``,
    ``rewritten(how)`` or ``raises(error, match)``), asserted; a case eager DTensor fails is then checked against
    plain torch only. Without it, a case eager DTensor fails must run rewritten (an error raised fails the test).
    """
    import contextlib

    import thunder
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    assert compare_eager or not random, "a random op's values are compared with eager DTensor's: compare_eager"
    label = label or _case_label(case)

    def fresh_inputs(distributed: bool) -> list:
        return _case_inputs(case, distributed=distributed, backward=backward)

    def reseed() -> None:
        if random:
            torch.manual_seed(seed)

    def counting() -> Any:
        return CommDebugMode() if compare_eager else contextlib.nullcontext()

    def full(x: Any) -> Any:
        return x.full_tensor() if isinstance(x, DTensor) else x

    from thunder_dtensor.ops.no_rule import HOW_OPS_RAN

    HOW_OPS_RAN.clear()
    jitted = thunder.jit(case.fn, **(jit_kwargs or {}))
    if expect is not None and expect.kind == "raises":
        return _assert_raises(case, expect, jitted, fresh_inputs(True), backward)

    plain = fresh_inputs(False)
    expected = _as_tuple(case.fn(*plain, **case.kwargs))

    eager_out: Any = None  # eager's outputs (a tuple), read only where eager ran
    eager_failure: Exception | None = None
    eager_fwd, jit_fwd = counting(), counting()
    if compare_eager:
        from thunder_dtensor._integration import clear_sharding_propagation_cache

        # eager's vocab-sharded embedding caches a stateful MaskPartial: start each eager run afresh
        clear_sharding_propagation_cache()
        eager_inputs = fresh_inputs(True)
        try:
            reseed()
            with eager_fwd:
                eager_out = _as_tuple(case.fn(*eager_inputs, **case.kwargs))
        except Exception as error:
            # eager DTensor rejects these placements: thunder_dtensor runs the case rewritten (decomposed, or on
            # replicated inputs: ops/no_rule.py), checked against plain torch, or raises, as declared (``expect``)
            assert not random, f"eager DTensor fails on a random case ({error!r}): no values to compare with"
            if expect is not None and expect.kind == "runs":
                _assert_ran_as(expect, {}, error)
            eager_failure, compare_eager, jit_fwd = error, False, contextlib.nullcontext()
        else:
            # trace outside the counting mode (trace-time runs on stand-ins must not count); the counted call hits
            # the cache
            jitted(*fresh_inputs(True), **case.kwargs)

    dt_inputs = fresh_inputs(True)
    reseed()
    with jit_fwd:
        actual = _as_tuple(jitted(*dt_inputs, **case.kwargs))
    comms: list[CommComparison] = []
    if compare_eager:
        assert thunder.cache_hits(jitted) >= 1, "the counted call retraced: a cache miss on the same input specs"
        comms.append(_compare_comms(label, "forward", jit_fwd, eager_fwd))
    reference = [full(e) for e in eager_out] if random else expected
    for i, (a, e) in enumerate(zip(actual, reference, strict=True)):
        assert_matches_full(a, e, what=f"output {i}", rtol=rtol, atol=atol)

    if compare_eager:
        for i, (a, e) in enumerate(zip(actual, eager_out)):
            if isinstance(e, DTensor):
                assert isinstance(a, DTensor), f"output {i}: eager gives a DTensor, thunder a {type(a)}"
                assert same_placements(a.placements, e.placements), (
                    f"output {i}: placements {a.placements} != eager {e.placements}"
                )

    thunder_grads: list = []
    eager_grads: list = []
    cotangents: list = []
    if backward and any(o.requires_grad for o in expected if isinstance(o, torch.Tensor)):
        cotangents = [make_full(e.shape, seed=1000 + i, dtype=e.dtype) for i, e in enumerate(expected)]
        torch.autograd.backward([e for e in expected], cotangents)

        # cotangents are distributed outside the counting modes: distribute_tensor communicates
        jit_cotangents = [_cotangent_like(a, c) for a, c in zip(actual, cotangents)]
        jit_bwd, eager_bwd = counting(), counting()
        with jit_bwd:
            torch.autograd.backward(list(actual), jit_cotangents)
        thunder_grads = [x.grad for x in dt_inputs]
        if not random:
            for i, (x, p) in enumerate(zip(dt_inputs, plain)):
                if p.grad is not None:
                    assert x.grad is not None, f"input {i}: thunder gave no gradient"
                    assert_matches_full(x.grad, p.grad, what=f"grad of input {i}", rtol=rtol, atol=atol)
                else:
                    assert x.grad is None, f"input {i}: thunder gave a gradient where torch gives none"
        if compare_eager:
            eager_cotangents = [_cotangent_like(e, c) for e, c in zip(eager_out, cotangents)]
            with eager_bwd:
                torch.autograd.backward(list(eager_out), eager_cotangents)
            eager_grads = [x.grad for x in eager_inputs]
            comms.append(_compare_comms(label, "backward", jit_bwd, eager_bwd))
            for i, (a, e) in enumerate(zip(thunder_grads, eager_grads)):
                if random:
                    assert (a is None) == (e is None), f"grad {i}: thunder gives {type(a)}, eager {type(e)}"
                    if e is not None:
                        assert_matches_full(a, full(e), what=f"grad of input {i} (vs eager)", rtol=rtol, atol=atol)
                if isinstance(e, DTensor):
                    assert isinstance(a, DTensor), f"grad {i}: eager gives a DTensor, thunder a {type(a)}"
                    expected_placements = (own_grad_placements or {}).get(i, e.placements)
                    assert same_placements(a.placements, expected_placements), (
                        f"grad {i}: placements {a.placements} != {expected_placements} (eager: {e.placements})"
                    )
    how_ops_ran = _how_ops_ran()
    _assert_ran_as(expect, how_ops_ran, eager_failure)
    assert_no_more_comms(comms, assert_comms)
    return CaseResult(actual, eager_out, thunder_grads, eager_grads, jitted, comms, cotangents, how_ops_ran)
