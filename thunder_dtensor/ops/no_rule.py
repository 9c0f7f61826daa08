"""Ops DTensor has no sharding rule for: decomposed into ops that have one, else run on replicated inputs.

Eager DTensor raises mid-training on an op it has no sharding strategy for (``aten.hardtanh_backward``,
``aten.addbmm``, ...), or on inputs its rule gets wrong. A compiler sees the whole op, so when DTensor rejects
an op on well-formed inputs (one mesh, no plain tensors, shapes plain torch accepts), the call is rewritten at
trace time, in this order:

1. **Decomposed** (``dtensor_<op>_decomposed_prim``): the op is traced on plain tensors of the global shapes
   with ``make_fx`` and torch's own decomposition table, restricted to the aten ops DTensor has no strategy
   for. The resulting aten program runs on the DTensors, so every step gets DTensor's sharding rules (and
   the lowering, like any prim).
2. **Replicated** (``dtensor_<op>_replicated_prim``), the last resort: every DTensor input is redistributed to
   Replicate, the plain op runs on every rank, the outputs are Replicate DTensors. Always correct and often
   slow, so the trace names it and :class:`ReplicatedFallbackWarning` is issued once per op and input
   placements. ``thunder.jit(fn, dtensor_replicated_fallback=False)`` turns it off: the op then raises the
   ``DTensorOpError`` it raised before.

Random ops are never rewritten (their numbers would not be eager DTensor's): they raise. Ops whose output
shape depends on the data cannot be traced, so they raise too. Gradients follow the same order: a generic
vjp DTensor rejects is rewritten the same way (:func:`call_or_rewrite` is called from the generic grad rule).
Rewriting starts only where DTensor refused, or where its rules are known to compute an op wrongly (the
``distrust`` reason of :func:`call_or_rewrite`); ``ops/losses.py`` has the other such case.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.errors import DataDependentValueError, DTensorOpError, first_line
from thunder_dtensor.primitive import (
    PRIMS,
    WrongShapeError,
    call_backwards_with,
    define_dtensor_prim,
    is_runtime_number,
    propagated_fakes,
    to_torch_value,
)
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.signature import SignatureCache, call_signature, describe_value

import torch

__all__ = [
    "FALLBACK_OPTION",
    "HOW_OPS_RAN",
    "ReplicatedFallbackWarning",
    "call_or_rewrite",
    "replicated",
]

#: the thunder compile option that turns the replicated last resort off (then the op raises)
FALLBACK_OPTION = "dtensor_replicated_fallback"

#: op name -> how its rewritten calls ran ("decomposition" or "replicated fallback"), for reports and tests
HOW_OPS_RAN: dict[str, str] = {}

#: (op name, input placements) pairs already warned about
_WARNED: set[tuple[str, tuple]] = set()

#: the plain aten programs by op and call signature (global shapes, dtypes, devices, other arguments)
PLAIN_PROGRAM_CACHE = SignatureCache("plain programs")

_REWRITE_PRIMS: dict[str, ti.Symbol] = {}


class ReplicatedFallbackWarning(UserWarning):
    """An op ran on replicated inputs because DTensor has no sharding rule for it (correct, often slow)."""


class _NotRewritable(Exception):
    """Why a rewrite does not apply (it goes into the error the op raises)."""


def replicated_fallback_enabled() -> bool:
    value = ti.get_compile_option(FALLBACK_OPTION, "run ops DTensor has no sharding rule for on replicated inputs")
    return True if value is None else bool(value)


# ---------------------------------------------------------------------------------------------------------
# The op as a plain aten program
# ---------------------------------------------------------------------------------------------------------
def _tensor_description(x: Any) -> tuple | None:
    """Global shape, dtype and device of a tensor-like (proxy, DTensor or tensor); None for other values."""
    if isinstance(x, ti.TensorProxy):
        return (tuple(x.shape), ti.dtypes.to_torch_dtype(x.dtype), ti.devices.to_torch_device(x.device))
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device)
    return None


def _plain_program(name: str, source: Callable, decompose: bool, flat: list, tree: Any) -> Any:
    """``source`` traced on plain tensors of the inputs' global shapes: an fx GraphModule of aten ops.

    With ``decompose``, the aten ops DTensor has no strategy for are replaced by torch's decompositions.
    Raises :class:`_NotRewritable` when the op draws random numbers or its output shape depends on the data.
    """
    described = [_tensor_description(x) for x in flat]

    def describe(x: Any) -> Any:
        d = _tensor_description(x)
        if d is None and is_runtime_number(x):  # the program would hold its trace-time stand-in
            raise _NotRewritable(f"it reads {x.name}, a number read from the data at run time")
        return ("tensor", d) if d is not None else describe_value(to_torch_value(x))

    key = call_signature((name, decompose), flat, tree, describe)  # None: an argument without an exact description
    values = [to_torch_value(x) for x in flat]

    def build() -> Any:
        def run(*tensors: torch.Tensor) -> Any:
            it = iter(tensors)
            leaves = [next(it) if d is not None else v for d, v in zip(described, values)]
            args, kwargs = ti.torch_tree_unflatten(leaves, tree)
            return source(*args, **kwargs)

        table = ti.decompositions_dtensor_lacks() if decompose else {}
        with ti.outside_tracing_modes(), ti.fake_tensor_mode():  # fake inputs: nothing of the global size is allocated
            examples = [torch.empty(d[0], dtype=d[1], device=d[2]) for d in described if d is not None]
            try:
                gm = ti.make_fx(run, decomposition_table=table, tracing_mode="real")(*examples)
            except ti.UNKNOWABLE_ON_FAKE_TENSORS as e:
                raise _NotRewritable(f"its output shape depends on the data ({type(e).__name__})") from e
            except Exception as e:
                raise _NotRewritable(f"it fails on plain tensors ({type(e).__name__}: {str(e)[:160]})") from e
        writes = sorted({str(n.target) for n in gm.graph.nodes if ti.writes_into_an_input(n)})
        if writes:
            raise _NotRewritable(f"it writes into its inputs ({', '.join(writes)}), which a rewritten op would not")
        random = sorted({str(n.target) for n in gm.graph.nodes if ti.is_random_op(n.target)})
        if random:
            raise _NotRewritable(
                f"it draws random numbers ({', '.join(random)}), which eager DTensor would draw differently"
            )
        return gm

    if key is None:
        return build()
    result = PLAIN_PROGRAM_CACHE.get_or_compute(key, lambda: _or_reason(build))
    if isinstance(result, _NotRewritable):
        raise _NotRewritable(*result.args)
    return result


def _or_reason(build: Callable) -> Any:
    try:
        return build()
    except _NotRewritable as e:
        return e


#: the decomposed programs traces refer to (by the ``dtensor_program`` argument of a decomposed prim)
_PROGRAMS: list[Any] = []
_PROGRAM_IDS: dict[int, int] = {}


def _program_id(program: Any) -> int:
    """A stable number for ``program``, kept for the process: a trace binds its program at trace time."""
    key = id(program)
    if key not in _PROGRAM_IDS:
        _PROGRAM_IDS[key] = len(_PROGRAMS)
        _PROGRAMS.append(program)
    return _PROGRAM_IDS[key]


def _decomposed(*args: Any, dtensor_program: int, **kwargs: Any) -> Any:
    """Runs the decomposed aten program the trace was made with: each aten op goes through DTensor's dispatch."""
    flat, _ = ti.torch_tree_flatten((args, kwargs))
    return _PROGRAMS[dtensor_program](*[x for x in flat if isinstance(x, torch.Tensor)])


@functools.cache
def replicated(torch_fn: Callable) -> Callable:
    """``torch_fn`` on replicated inputs: DTensors gathered to Replicate, the plain op, Replicate outputs.

    Differentiable under eager DTensor's autograd: a gradient comes back with its input's placements. One
    function per ``torch_fn`` (the replicated prim is made with the first).
    """

    @functools.wraps(torch_fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        flat, tree = ti.torch_tree_flatten((args, kwargs))
        mesh = next(x.device_mesh for x in flat if isinstance(x, ti.DTensor))
        replicate = [ti.Replicate()] * mesh.ndim
        plain = [x.redistribute(mesh, replicate).to_local() if isinstance(x, ti.DTensor) else x for x in flat]
        plain_args, plain_kwargs = ti.torch_tree_unflatten(plain, tree)
        out = torch_fn(*plain_args, **plain_kwargs)
        if type(out).__module__ == "torch.return_types":
            out = tuple(out)

        def wrap(o: Any) -> Any:
            return ti.DTensor.from_local(o, mesh, replicate, run_check=False) if isinstance(o, torch.Tensor) else o

        return ti.torch_tree_map(wrap, out)

    return run


# ---------------------------------------------------------------------------------------------------------
# The rewrites, as prims of their own (so the trace names them)
# ---------------------------------------------------------------------------------------------------------
def _rewrite_prim(op_name: str, how: str, torch_fn: Callable, differentiable: bool) -> ti.Symbol:
    name = f"{op_name}_{'decomposed' if how == 'decomposition' else 'replicated'}"
    prim = _REWRITE_PRIMS.get(name)
    if prim is None:
        prim = _REWRITE_PRIMS[name] = define_dtensor_prim(name, torch_fn, differentiable=differentiable)
        PRIMS[prim.name].rewritten = (op_name, how)
    return prim


def _check_traces(prim: ti.Symbol, torch_fn: Callable, args: tuple, kwargs: dict) -> None:
    """Raise the prim's ``DTensorOpError`` before calling it, if DTensor rejects it (the result is cached)."""
    propagated_fakes(prim.name, torch_fn, args, kwargs)


def _placements(args: tuple, kwargs: dict) -> tuple:
    flat, _ = ti.tree_flatten((args, kwargs))
    return tuple(tuple(map(str, x.placements)) for x in flat if isinstance(x, DTensorProxy))


def call_or_rewrite(
    prim: ti.Symbol,
    name: str,
    source: Callable,
    args: tuple,
    kwargs: dict,
    *,
    replicated_source: Callable,
    differentiable: bool,
    distrust: str | None = None,
    quiet: bool = False,
) -> Any:
    """``prim(*args, **kwargs)``; if DTensor rejects it, the decomposed op, else the replicated last resort.

    ``source`` is the op as a torch function (traced on plain tensors to decompose it) and
    ``replicated_source`` the op on replicated inputs; ``name`` names the rewritten prims and identifies the
    op in caches, so it must always come with the same ``source``. ``distrust`` (a reason) says DTensor's
    rules accept the op but compute it wrongly: it then runs replicated without trying the others. ``quiet``:
    a provisional call (a vjp on a stand-in cotangent, decided again later), neither warned about nor recorded.
    """
    flat, tree = ti.torch_tree_flatten((args, kwargs))
    reasons = []
    if distrust is not None:
        original = DTensorOpError(prim.name, args, kwargs, distrust, hint="redistribute the input to Replicate first")
        reasons.append("not decomposed: the decomposed op would run under the same rules")
    else:
        try:
            _check_traces(prim, source, args, kwargs)
            return prim(*args, **kwargs)
        except DTensorOpError as error:
            # plain tensors among DTensors, several meshes: the user's to fix; a result that depends on the data:
            # no rewrite can trace it
            if error.structural or isinstance(error, DataDependentValueError):
                raise
            original = error
            if isinstance(error, WrongShapeError):  # DTensor's rules accept the op and get it wrong
                distrust = error.distrust
                reasons.append("not decomposed: the decomposed op would run under the same rules")
    if kwargs.get("out") is not None:
        reasons.append("not rewritten: an out= argument, which a rewritten op would not write into")
        raise _with_reasons(original, reasons) from original.__cause__  # DTensor's own rejection
    plain_checked = False  # the plain program traced: not random, no data-dependent shape, no write into an input
    try:
        if distrust is not None:
            raise _NotRewritable(reasons.pop())
        program = _program_id(_plain_program(name, source, True, flat, tree))
        plain_checked = True
        decomposed = _rewrite_prim(name, "decomposition", _decomposed, differentiable)
        program_kwargs = {**kwargs, "dtensor_program": program}
        _check_traces(decomposed, _decomposed, args, program_kwargs)
        out = decomposed(*args, **program_kwargs)
        if not quiet:
            _record(name, "decomposition")
        return out
    except (_NotRewritable, DTensorOpError) as e:
        reasons.append(f"not decomposable: {first_line(e)}")

    if not replicated_fallback_enabled():
        reasons.append(f"the replicated fallback is off ({FALLBACK_OPTION}=False)")
        raise _with_reasons(original, reasons) from original.__cause__  # DTensor's own rejection
    try:
        if not plain_checked:  # decomposing changes none of what the check looks for
            _plain_program(name, source, False, flat, tree)
        fallback = _rewrite_prim(name, "replicated fallback", replicated_source, differentiable)
        _check_traces(fallback, replicated_source, args, kwargs)
        out = fallback(*args, **kwargs)
    except (_NotRewritable, DTensorOpError) as e:
        if isinstance(e.__cause__, ti.UNKNOWABLE_ON_FAKE_TENSORS):
            reasons.append(
                "not run replicated: its output shape depends on the data, which a trace cannot hold "
                "(thunder fails on it for plain tensors too): compute it outside the jitted function"
            )
        else:
            reasons.append(f"not run replicated: {first_line(e)}")
        raise _with_reasons(original, reasons) from original.__cause__  # DTensor's own rejection
    if not quiet:
        _record(name, "replicated fallback")
        warn_replicated_fallback(
            fallback.name, args, kwargs, distrust or f"DTensor has no sharding rule for {name} on these inputs"
        )
    return out


def warn_replicated_fallback(op_name: str, args: tuple, kwargs: dict, why: str) -> None:
    """:class:`ReplicatedFallbackWarning`, once per op and input placements: ``op_name`` runs gathered (``why``)."""
    placements = _placements(args, kwargs)
    if (op_name, placements) in _WARNED:
        return
    _WARNED.add((op_name, placements))
    warnings.warn(
        f"{op_name}: inputs with placements {', '.join(map(str, placements))}: {why}, so it runs on "
        f"replicated inputs (all-gathered on every rank): correct but slow. Redistribute the inputs to "
        f"placements DTensor supports, or pass {FALLBACK_OPTION}=False to thunder.jit to raise instead.",
        ReplicatedFallbackWarning,
        stacklevel=3,
    )


def _record(name: str, how: str) -> None:
    if HOW_OPS_RAN.get(name) != "replicated fallback":  # an op's calls report the least preferred way
        HOW_OPS_RAN[name] = how


def _with_reasons(error: DTensorOpError, reasons: list[str]) -> DTensorOpError:
    error.args = (error.args[0] + "".join(f"\n  rewrite: {r}" for r in reasons),) + error.args[1:]
    return error


call_backwards_with(call_or_rewrite, replicated)  # a generic vjp's backward op is decomposed or replicated too
