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

The package, each part readable alone: ``symbols`` (the lowered program's symbols and their executors),
``graph`` (pure queries and rewrites of one traced FX graph), ``tracing`` (tracing one prim, or a forward and
its vjp jointly, with DTensor's dispatch), ``program`` (pure rewrites of a trace's symbol list: vjp pairing,
wait placement) and ``transform`` (the pass itself).
"""

from thunder_dtensor.lowering.graph import NotLowerable
from thunder_dtensor.lowering.program import is_backward, place_waits_late
from thunder_dtensor.lowering.symbols import (
    COLLECTIVE_SYMBOLS,
    LOCAL_META_CACHE,
    collective_symbol,
    dtensor_comm_ex,
    dtensor_local_ex,
    issues_a_collective,
    local_op_symbol,
    may_communicate,
    symbol_name,
)
from thunder_dtensor.lowering.tracing import GRAPH_CACHE, contiguous_spec
from thunder_dtensor.lowering.transform import (
    LOWERING_OPTION,
    annotate_not_lowered,
    forward_prims_kept,
    joint_gradients,
    keeping_forward_prims_as_ran,
    lower_dtensor_program,
    lowering_enabled,
)

__all__ = [
    "COLLECTIVE_SYMBOLS",
    "GRAPH_CACHE",
    "LOCAL_META_CACHE",
    "LOWERING_OPTION",
    "NotLowerable",
    "annotate_not_lowered",
    "collective_symbol",
    "contiguous_spec",
    "dtensor_comm_ex",
    "dtensor_local_ex",
    "forward_prims_kept",
    "is_backward",
    "issues_a_collective",
    "joint_gradients",
    "keeping_forward_prims_as_ran",
    "local_op_symbol",
    "lower_dtensor_program",
    "lowering_enabled",
    "may_communicate",
    "place_waits_late",
    "symbol_name",
]
