"""Fixes to thunder that are not about DTensors (kind ``thunder-fix``; ``THUNDER_DTENSOR_THUNDER_FIXES=0``
turns them off): complex gradients, ``sdpa_kernel`` in jitted code, autocast scoped to each call, custom
``autograd.Function``s on torch >= 2.14, and what model libraries (transformers 5.x) do inside a forward.
docs/architecture.md, "Thunder fixes that are not about DTensors", gives each one's plain-tensor reproducer."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------------
# Complex autograd (thunder 0.2.6 layout; installed by ``fix_complex_gradients``)
#
# torch differentiates complex functions with the conjugate Wirtinger convention: for a holomorphic ``f``
# the vector-Jacobian product is ``g * conj(f'(z))`` (``grad_a = g * b.conj()`` for ``a * b``). thunder
# 0.2.6's grad rules use ``g * f'(z)``, right for real tensors only, so every complex program gets wrong
# gradients: RoPE written with ``view_as_complex(x) * freqs_cis`` (torchtitan's Llama 3), complex ``exp``,
# ``matmul``... ``prims.real`` / ``prims.imag`` have no grad rule at all. Checked on thunder 0.2.6; the newest
# upstream source we could read (commit 47627ed) has the same rules, so every release this package supports
# (0.2.x) gets the fix. The replacement rules below are used only when an operand is
# complex; programs on real tensors keep thunder's rules and traces exactly.
# ---------------------------------------------------------------------------------------------------------
import cmath  # noqa: E402
import contextlib
import functools
import operator
import re
import types
from collections.abc import Callable, Iterator
from typing import Any, cast

from thunder_dtensor._integration.attribute_reads import NOT_ANSWERED, on_attribute_read
from thunder_dtensor._integration.bootstrap import (
    FUNCTION_APPLY_IS_BUILTIN,
    OperatorExecutor,
    Symbol,
    TensorProxy,
    custom_function_apply_lookaside,
    dtypes,
    get_grad,
    ltorch,
    prims,
    put_grad,
    put_grads,
    pyval,
    thunder,
)
from thunder_dtensor._integration.fixes.scoped_entries import add_scoped_lookaside, add_scoped_method
from thunder_dtensor._integration.fixes.switches import EVERYWHERE, IN_DTENSOR_PROGRAMS, active, mode, switched
from thunder_dtensor._integration.functionalize import is_copy, written_destination
from thunder_dtensor._integration.program_scope import (
    add_program_executor,
    has_dtensor_inputs,
    on_each_call,
    running_a_dtensor_program,
    traced_a_dtensor,
)
from thunder_dtensor._integration.registry import (
    BACKWARD_IMPLS,
    GRAD_RULES,
    JIT_LOOKASIDES,
    PROVENANCE_LOOKASIDES,
    expects_absent,
    expects_function,
    expects_identical,
    expects_qualified,
    installer,
    patch,
)

import torch
from thunder.core.proxies import ComplexProxy  # noqa: E402


def _is_complex(x: Any) -> bool:
    if isinstance(x, TensorProxy):
        return dtypes.is_complex_dtype(x.dtype)
    return isinstance(x, (complex, ComplexProxy))


def _conj(x: Any) -> Any:
    """``x.conj()`` for tensors (a materialised copy, via torch's ``conj_physical``) and numbers; real ``x`` as is."""
    if not _is_complex(x):
        return x
    if isinstance(x, TensorProxy):
        return ltorch._torch_to_thunder_function_map[torch.conj_physical](x)
    return cast(complex, pyval(x)).conjugate()  # (a complex number)


def _log(x: Any) -> Any:
    """``log`` of a tensor or of a (complex) number: thunder's number ``log`` takes real numbers only."""
    return ltorch.log(x) if isinstance(x, TensorProxy) else cmath.log(cast(complex, pyval(x)))


def _holomorphic_grad_rule(prim: Symbol, vjps: tuple[Callable, ...], real_rule: Callable) -> Callable:
    """A grad rule for the elementwise ``prim`` with torch's complex convention; ``real_rule`` for real operands.

    ``vjps[i](g, *conj_args, conj_out)`` is the real-valued rule's vjp for operand ``i`` (``g * f_i'``), but
    given the conjugated operands and output. For the functions below (real Taylor coefficients)
    ``f'(conj z) == conj(f'(z))``, so that is exactly ``g * conj(f_i'(z))``.
    """

    def rule(*args: Any) -> Any:
        if not any(_is_complex(a) for a in args):
            return real_rule(*args)
        out = prim(*args)
        g = get_grad(out)
        conj_args, conj_out = tuple(_conj(a) for a in args), _conj(out)
        for arg, vjp in zip(args, vjps):
            if isinstance(arg, TensorProxy):
                put_grad(arg, vjp(g, *conj_args, conj_out))
        return out

    return rule


def _sum_to_rank(t: TensorProxy, ndim: int) -> TensorProxy:
    """``t`` summed over its leading dims down to ``ndim`` dims (the batch dims an operand was broadcast over)."""
    extra = t.ndim - ndim
    return ltorch.sum(t, tuple(range(extra))) if extra > 0 else t


def _complex_matmul_grad(a: TensorProxy, b: TensorProxy, /) -> TensorProxy:
    """``prims.matmul`` on complex operands: ``grad_a = g @ b^H``, ``grad_b = a^H @ g``, 1-D operands as matrices."""
    out = prims.matmul(a, b)
    g = get_grad(out)
    a2 = ltorch.unsqueeze(a, 0) if a.ndim == 1 else a
    b2 = ltorch.unsqueeze(b, -1) if b.ndim == 1 else b
    g2 = ltorch.unsqueeze(g, -1) if b.ndim == 1 else g
    g2 = ltorch.unsqueeze(g2, -2) if a.ndim == 1 else g2
    grad_a = _sum_to_rank(ltorch.matmul(g2, _conj(b2).mT), a2.ndim)
    grad_b = _sum_to_rank(ltorch.matmul(_conj(a2).mT, g2), b2.ndim)
    put_grads((a, b), (ltorch.reshape(grad_a, a.shape), ltorch.reshape(grad_b, b.shape)))
    return out


def _complex_linear_grad(a: TensorProxy, w: TensorProxy, bias: None | TensorProxy) -> TensorProxy:
    """``prims.linear`` on complex operands: ``grad_a = g @ conj(w)``, ``grad_w = g^T @ conj(a)``, bias: ``sum g``."""
    out = prims.linear(a, w, bias)
    g = get_grad(out)
    g2 = ltorch.reshape(g, (-1, w.shape[0]))
    a2 = ltorch.reshape(a, (-1, w.shape[1]))
    put_grad(a, ltorch.reshape(ltorch.matmul(g2, _conj(w)), a.shape))
    put_grad(w, ltorch.matmul(g2.mT, _conj(a2)))
    if bias is not None:
        put_grad(bias, ltorch.reshape(ltorch.sum(g2, (0,)), bias.shape))
    return out


def _complex_or_real_rule(complex_rule: Callable, real_rule: Callable) -> Callable:
    """``complex_rule`` when a tensor operand is complex, else thunder's ``real_rule``."""

    def rule(*args: Any) -> Any:
        return (complex_rule if any(_is_complex(a) for a in args) else real_rule)(*args)

    return rule


def _real_grad(a: TensorProxy) -> TensorProxy:
    """``z.real``: the real cotangent becomes the real part of the complex gradient."""
    out = prims.real(a)
    put_grad(a, prims.convert_element_type(get_grad(out), a.dtype))
    return out


def _imag_grad(a: TensorProxy) -> TensorProxy:
    """``z.imag``: the real cotangent ``g`` becomes the complex gradient ``1j * g``."""
    out = prims.imag(a)
    put_grad(a, prims.convert_element_type(get_grad(out), a.dtype) * 1j)
    return out


def _conjugating_backward(backward: Callable, complex_derivative: Callable | None = None) -> Callable:
    """A ``backward_impls`` entry (``(*residuals, g) -> g * f'``) made ``g * conj(f')`` for a complex ``g``.

    These entries are linear in ``g`` with real-coefficient derivatives, so ``conj(backward(..., conj(g)))``
    is torch's vjp; ``complex_derivative(*residuals)`` replaces a formula that is right on reals only. A
    real ``g`` keeps thunder's rule untouched.
    """

    def conjugating(*residuals_and_g: Any) -> Any:
        *residuals, g = residuals_and_g
        if not _is_complex(g):
            return backward(*residuals, g)
        if complex_derivative is not None:
            return g * _conj(complex_derivative(*residuals))
        return _conj(backward(*residuals, _conj(g)))

    return conjugating


#: elementwise prims with a rule in thunder's grad map -> the vjp of each operand, given (g, *conj args, conj out)
_HOLOMORPHIC_VJPS: dict[str, tuple[Callable, ...]] = {
    "MUL": (lambda g, a, b, out: g * b, lambda g, a, b, out: g * a),
    "DIV": (lambda g, a, b, out: g / b, lambda g, a, b, out: -g * out / b),
    "EXP": (lambda g, a, out: g * out,),
    "LOG": (lambda g, a, out: g / a,),
    "SIN": (lambda g, a, out: g * ltorch.cos(a),),
    "COS": (lambda g, a, out: -g * ltorch.sin(a),),
    "TANH": (lambda g, a, out: g * (1 - out * out),),
    "RSQRT": (lambda g, a, out: -0.5 * g * out * out * out,),
    "RECIPROCAL": (lambda g, a, out: -g * out * out,),
    "POW": (lambda g, a, b, out: g * b * a ** (b - 1), lambda g, a, b, out: g * out * _log(a)),
}
#: unary prims whose vjp sits in thunder's ``backward_impls`` table and is holomorphic
_HOLOMORPHIC_BACKWARD_IMPLS = (
    "ACOS", "ASIN", "ASINH", "ATAN", "ATANH", "COSH", "SINH", "SQRT", "LOG10", "LOG1P", "LOG2", "EXP2",
    "EXPM1",
)  # fmt: skip
#: ... and those whose thunder formula is right on reals only: the complex derivative (torch's, with its branch cuts)
_COMPLEX_DERIVATIVES = {
    # sqrt(z*z - 1) != sqrt(z + 1) * sqrt(z - 1) off the real line
    "ACOSH": lambda z: ltorch.rsqrt(z + 1) * ltorch.rsqrt(z - 1),
}


#: the grad rules of thunder 0.2.6 that fix_complex_gradients wraps, by prim (names in thunder.core.transforms)
_THUNDER_GRAD_RULES = {
    **{name: f"_{name.lower()}_prim_grad" for name in ("MUL", "DIV", "EXP", "LOG", "SIN", "COS", "TANH", "RSQRT")},
    "RECIPROCAL": "reciprocal_joint_forward_backward_rule",
    "POW": "_pow_grad",
    "MATMUL": "_matmul_prim_grad",
    "LINEAR": "_linear_prim_grad",
}


@installer("thunder-fix", "thunder's gradients of complex tensors take torch's convention (the conjugate)")
def fix_complex_gradients() -> None:
    """Give thunder's autodiff torch's complex convention (see this section's header)."""
    import thunder.core.transforms as transforms

    grad_map = transforms._grad_fn_map
    pids = prims.PrimIDs
    rules: dict[Any, Callable] = {
        getattr(pids, name): _holomorphic_grad_rule(getattr(prims, name.lower()), vjps, grad_map[getattr(pids, name)])
        for name, vjps in _HOLOMORPHIC_VJPS.items()
    }
    rules[pids.MATMUL] = _complex_or_real_rule(_complex_matmul_grad, grad_map[pids.MATMUL])
    rules[pids.LINEAR] = _complex_or_real_rule(_complex_linear_grad, grad_map[pids.LINEAR])
    rules[pids.REAL], rules[pids.IMAG] = _real_grad, _imag_grad
    fix = "fix_complex_gradients"
    expects: Callable[[Any], str | None]
    for prim_id, rule in rules.items():
        if prim_id in (pids.REAL, pids.IMAG):
            expects, original = expects_absent, _no_backward(prim_id)
        else:
            expects = expects_qualified(f"thunder.core.transforms.{_THUNDER_GRAD_RULES[prim_id.name]}")
            original = grad_map[prim_id]
        patch(grad_map, prim_id, switched(fix, rule, original), table=GRAD_RULES, expects=expects)
    for name in (*_HOLOMORPHIC_BACKWARD_IMPLS, *_COMPLEX_DERIVATIVES):
        prim_id = getattr(pids, name)
        backward = cast(Callable, transforms.backward_impls[prim_id])
        conjugating = switched(fix, _conjugating_backward(backward, _COMPLEX_DERIVATIVES.get(name)), backward)
        expects = expects_qualified("thunder.core.transforms.<lambda>")  # thunder's one-line derivative
        patch(transforms.backward_impls, prim_id, conjugating, table=BACKWARD_IMPLS, expects=expects)


def _no_backward(prim_id: Any) -> Callable:
    """What thunder 0.2.6 does for a prim without a grad rule (``real``, ``imag``), where the fix is not active."""

    def rule(*args: Any) -> Any:
        raise NotImplementedError(f"Backward for {prim_id} is not implemented")

    return rule


# ---------------------------------------------------------------------------------------------------------
# torch.nn.attention.sdpa_kernel inside thunder programs (thunder 0.2.6 interpreter; used by sdpa_backends.py)
#
# Private torch names used here: ``torch.nn.attention._sdpa_kernel`` / ``_sdpa_kernel_variadic`` /
# ``_backend_from_string`` / ``_cur_sdpa_kernel_backends`` (torch 2.13: what ``sdpa_kernel`` and dynamo's
# graphs call), ``torch._fused_sdp_choice`` (torch's SDPA kernel selector).
# ---------------------------------------------------------------------------------------------------------
def sdpa_backends_enabled_globally(with_priority: bool) -> tuple:
    """The SDPA backends torch's global flags enable now (in priority order with ``with_priority``)."""
    import torch.nn.attention as attention

    return tuple(attention._cur_sdpa_kernel_backends(with_priority=with_priority))


def fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """The SDPA kernel torch would pick for these (real) tensors under the flags in effect; raises if none can run."""
    return torch._fused_sdp_choice(*args, **kwargs)


def is_sdpa_kernel_fx_target(target: Any) -> bool:
    """Whether a dynamo graph's call target is one of the calls dynamo records for an ``sdpa_kernel`` context."""
    import torch.nn.attention as attention

    return target is attention._sdpa_kernel or target is attention._backend_from_string


@installer("thunder-fix", "sdpa_kernel(...) in jitted code runs at trace time only, with a feasibility check")
def install_sdpa_kernel_support(*, context: type[Any], set_backends: Callable, check_sdpa_call: Callable) -> None:
    """Make thunder's interpreter run ``sdpa_kernel(...)`` (and dynamo's spelling of it) at trace time only.

    thunder 0.2.6 steps into ``sdpa_kernel`` and fails on its ``dict.fromkeys``; and stepping in would set
    torch's global flags while tracing, with nothing in the trace. Instead:

    * ``sdpa_kernel(backends, set_priority)`` (and dynamo's ``_sdpa_kernel_variadic``) builds ``context``,
      whose ``__enter__`` / ``__exit__`` run whole (record / restore the choice for the trace being built);
    * ``_sdpa_kernel(backends, set_priority)``, what dynamo graphs call on entering and leaving the context,
      runs ``set_backends`` whole; ``_backend_from_string`` (the graphs' spelling of a backend) runs whole;
    * ``F.scaled_dot_product_attention`` first runs ``check_sdpa_call`` on its arguments, then what it ran
      before (thunder's own lookaside; a DTensor call is routed before it and its op runs the check itself).
    """
    import torch.nn.attention as attention
    import torch.nn.functional as F
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map
    sdpa = F.scaled_dot_product_attention

    def variadic(*backends: Any) -> Any:
        return context(list(backends))

    opaque = {
        attention.sdpa_kernel: context,
        attention._sdpa_kernel_variadic: variadic,
        context.__enter__: context.__enter__,
        context.__exit__: context.__exit__,
        attention._sdpa_kernel: set_backends,
        attention._backend_from_string: attention._backend_from_string,
    }
    fix = "install_sdpa_kernel_support"
    for fn, impl in opaque.items():
        assert fn not in lookasides, f"thunder has a lookaside for {fn} now: see {fix}"
        add_scoped_lookaside(fix, fn, jit_ext.interpreter_needs_wrap(impl))

    run_sdpa = lookasides[sdpa]
    check = jit_ext.interpreter_needs_wrap(check_sdpa_call)

    def checked_sdpa(*args: Any, **kwargs: Any) -> Any:
        if check(*args, **kwargs) is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED:
            return interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED
        return run_sdpa(*args, **kwargs)

    wrapper = expects_qualified("thunder.core.interpreter.interpreter_needs_wrap.<locals>.wrapping_wrapper")
    checked = switched(fix, checked_sdpa, run_sdpa)
    patch(lookasides, sdpa, checked, table=JIT_LOOKASIDES, expects=wrapper)  # thunder's own lookaside


@installer("thunder-fix", "an autocast a jitted function is called under applies to that call only")
def scope_ambient_autocast_to_each_call() -> None:
    """An autocast a jitted function was called under applies to that call only.

    thunder 0.2.6 pushes the caller's autocast onto the compile data's autocast stack at each call made under
    it and never pops it, so a later call without autocast retraces (the cache key differs) but still casts,
    on plain tensors and DTensors alike. Every push on that stack within a call is balanced except this one, so
    the stack is emptied as each call starts (a handler of ``program_scope.on_each_call``, which the package's
    one wrapper of ``thunder._with_cache_info_ctx`` runs with the call's compile data).
    """
    fix = "scope_ambient_autocast_to_each_call"

    def applies(cd: Any, args: tuple, kwargs: dict) -> bool:  # this runs before the call is noted
        chosen = mode(fix)
        return chosen == EVERYWHERE or (
            chosen == IN_DTENSOR_PROGRAMS and (traced_a_dtensor(cd) or has_dtensor_inputs(cd.fn, args, kwargs))
        )

    def forget_ambient_autocast(cd: Any, args: tuple, kwargs: dict) -> None:
        if cd.autocast_stack.stack and applies(cd, args, kwargs):
            cd.autocast_stack.stack.clear()

    on_each_call(fix, forget_ambient_autocast)


# ---------------------------------------------------------------------------------------------------------
# torch >= 2.14: ``autograd.Function.apply`` is implemented in C (thunder 0.2.6 reads ``apply.__func__``)
# ---------------------------------------------------------------------------------------------------------
@installer("thunder-fix", "MyFunction.apply(...) reaches thunder's custom-Function lookaside where apply is builtin")
def call_custom_autograd_functions_with_builtin_apply() -> None:
    """On torch >= 2.14 ``MyFunction.apply`` is a builtin method bound to the class, so thunder's interpreter
    finds no lookaside for it (thunder keys it by the Python ``apply.__func__`` of torch <= 2.13) and fails on a
    custom ``autograd.Function``. ``bootstrap`` sets thunder's lookaside aside while thunder imports; calls of
    a builtin ``apply`` bound to a ``Function`` subclass are routed to it here, with the class as thunder's
    lookaside takes it."""
    if not FUNCTION_APPLY_IS_BUILTIN:
        return
    from thunder.core import interpreter, jit_ext

    (thunder_apply,) = custom_function_apply_lookaside
    function = torch.autograd.function.Function
    builtin_apply = function.__dict__["apply"]
    previous = jit_ext.general_jit_lookaside

    def lookaside(fn: Any, *args: Any, **kwargs: Any) -> Any:
        owner = getattr(fn, "__self__", None)
        if (
            type(fn) is types.BuiltinMethodType
            and active("call_custom_autograd_functions_with_builtin_apply")
            and isinstance(owner, type)
            and issubclass(owner, function)
            and fn == builtin_apply.__get__(None, owner)  # apply itself, not another builtin of the class
        ):
            cls = interpreter.wrap_const(owner)
            return lambda *a, **k: thunder_apply(cls, *a, **k)
        return previous(fn, *args, **kwargs)

    expects = expects_function(("thunder", "thunder_dtensor"), "fn")
    patch(jit_ext, "general_jit_lookaside", lookaside, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# A Sequence argument that cannot be iterated yet (its own __init__ is being called)
# ---------------------------------------------------------------------------------------------------------
def _cannot_iterate(value: Any) -> bool:
    from collections.abc import Sequence

    if not isinstance(value, Sequence):
        return False
    try:
        for _ in value:
            pass
    except Exception:
        return True
    return False


@installer("thunder-fix", "a call whose Sequence argument cannot be iterated yet (its own __init__) is traced")
def tolerate_sequences_that_cannot_be_iterated() -> None:
    """thunder's interpreter iterates every ``Sequence`` argument of a call to look for tensors. A Sequence
    whose ``__init__`` is being called is one such argument before it holds anything, so ``len(self)`` fails
    (transformers' per-layer config view: ``AttributeError: '_PerLayerConfigView' object has no attribute
    '_config'``, every transformers 5.x model). Such an argument holds no tensor: the lookup is asked again
    without it."""
    from thunder.core import jit_ext

    previous = jit_ext.general_jit_lookaside

    def lookaside(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return previous(fn, *args, **kwargs)
        except Exception:  # the tensor search of thunder's lookup, before it has any effect
            if not active("tolerate_sequences_that_cannot_be_iterated"):
                raise
            readable = [a for a in args if not _cannot_iterate(getattr(a, "value", None))]
            if len(readable) == len(args):
                raise
            return previous(fn, *readable, **kwargs)

    expects = expects_function(("thunder", "thunder_dtensor"), "fn")
    patch(jit_ext, "general_jit_lookaside", lookaside, expects=expects)


def _chain(*iterables: Any) -> Iterator[Any]:
    for iterable in iterables:
        yield from iterable


@installer("thunder-fix", "itertools.chain over tensors is interpreted, not an opaque call thunder cannot name")
def interpret_itertools_chain() -> None:
    """thunder's interpreter treats ``itertools.chain(...)`` over tensors as an opaque torch call and fails to
    name it (``KeyError: None``: ``chain.__new__`` has no module). torch's ``context_parallel`` wraps
    ``F.scaled_dot_product_attention`` with code that chains the call's arguments. The chain is interpreted
    as the generator it is."""
    import itertools

    from thunder.core import interpreter, jit_ext

    assert itertools.chain not in jit_ext._general_jit_lookaside_map, "thunder has a lookaside for itertools.chain"

    def chain(*iterables: Any) -> Any:
        return interpreter._interpret_call(_chain, *iterables)

    add_scoped_lookaside("interpret_itertools_chain", itertools.chain, chain)


# ---------------------------------------------------------------------------------------------------------
# torch.cat's empty-vector rule
# ---------------------------------------------------------------------------------------------------------
def _is_empty_vector(t: Any) -> bool:
    return isinstance(t, TensorProxy) and tuple(t.shape) == (0,)


@installer("thunder-fix", "torch.cat skips empty 1-D tensors beside tensors of more dims, as torch does")
def skip_empty_vectors_in_cat() -> None:
    """torch's ``cat`` ignores a tensor of shape ``(0,)`` among tensors of more dims (a legacy rule: an empty
    vector is the neutral start of a concatenation); thunder 0.2.6 checks its dims like any other's and fails:
    ``IndexError: Expected dimension in inclusive range of -1 and 0: got -2``. transformers' default KV cache
    (``DynamicCache``) starts every layer from ``torch.tensor([])`` and appends with ``torch.cat(..., dim=-2)``,
    so ``generate()`` with a cache failed under ``thunder.jit``. The empty vectors are dropped after type
    promotion (they take part in it, as in torch) and before the dims are checked."""
    from thunder import clang

    original = clang.cat

    def cat(tensors: Any, dim: int) -> Any:
        if active("skip_empty_vectors_in_cat") and any(_is_empty_vector(t) for t in tensors):
            kept = [t for t in tensors if not _is_empty_vector(t)]
            if kept and any(t.ndim > 1 for t in kept):
                dtypes = {t.dtype for t in tensors}
                if len(dtypes) > 1:  # promote over all, as torch, then drop the empty ones
                    from thunder.core import utils

                    _, dtype = utils.elementwise_type_promotion(
                        *tensors, type_promotion_kind=utils.ELEMENTWISE_TYPE_PROMOTION_KIND.PRESERVE
                    )
                    kept = [t if t.dtype == dtype else clang.maybe_convert_to_dtype(t, dtype) for t in kept]
                return original(kept, dim)
        return original(tensors, dim)

    patch(clang, "cat", cat, expects=expects_function("thunder.clang", "tensors", "dim"))


# ---------------------------------------------------------------------------------------------------------
# Slices that reach before the start of a dim
# ---------------------------------------------------------------------------------------------------------
def _clamped(entry: slice, length: int) -> slice:
    """``entry`` with a start or stop before the dim's first element moved to it, as Python's and torch's slicing
    do (``x[-7:]`` of a length-6 dim is all of it)."""

    def clamp(bound: Any) -> Any:
        return 0 if isinstance(bound, int) and bound < -length else bound

    return slice(clamp(entry.start), clamp(entry.stop), entry.step)


def _with_clamped_slices(shape: tuple[int, ...], key: list) -> list:
    """``key`` (thunder's basic index: numbers, slices and None, one dim each but None) with each slice clamped
    to its dim."""
    clamped, dim = [], 0
    for entry in key:
        if entry is not None:
            if isinstance(entry, slice) and dim < len(shape):
                entry = _clamped(entry, shape[dim])
            dim += 1
        clamped.append(entry)
    return clamped


@installer("thunder-fix", "a slice whose start or stop reaches before a dim's start is clamped, as torch does")
def clamp_slices_as_torch_does() -> None:
    """``x[:, -7:]`` on a dim of length 6 is the whole dim in torch; thunder 0.2.6 raises ``RuntimeError: start=-7
    is not a valid index for length 6``. transformers slices its attention mask with the sliding window's
    length (``mask[:, -window:]``), longer than a short prompt: Mixtral's ``generate()`` with a cache failed."""
    from thunder import clang

    original = clang._basic_indexing

    def basic_indexing(a: Any, /, key: Any) -> Any:
        if active("clamp_slices_as_torch_does") and isinstance(key, list):
            key = _with_clamped_slices(tuple(a.shape), key)
        return original(a, key)

    patch(clang, "_basic_indexing", basic_indexing, expects=expects_function("thunder.clang", "a", "key"))


# ---------------------------------------------------------------------------------------------------------
# torch.tensor(..., dtype=int)
# ---------------------------------------------------------------------------------------------------------
#: the dtype torch gives a Python type passed as ``dtype=``
_DTYPE_OF_PYTHON_TYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


@installer("thunder-fix", "torch.tensor(data, dtype=int) takes a Python type as torch does")
def take_python_types_as_tensor_dtypes() -> None:
    """``torch.tensor([-1], dtype=int)`` is an int64 tensor in torch; thunder 0.2.6 raises ``ValueError: <class
    'int'> had an unexpected type <class 'type'>``. transformers' sliding-window static cache builds its index
    this way: Mixtral's ``generate()`` with ``cache_implementation="static"`` failed."""
    from thunder import clang

    original = clang.tensor_from_sequence

    def tensor_from_sequence(sequence: Any, *, dtype: Any = None, device: Any = None) -> Any:
        if active("take_python_types_as_tensor_dtypes") and dtype in _DTYPE_OF_PYTHON_TYPE:
            dtype = _DTYPE_OF_PYTHON_TYPE[dtype]
        return original(sequence, dtype=dtype, device=device)

    patch(clang, "tensor_from_sequence", tensor_from_sequence, expects=expects_function("thunder.clang", "sequence"))


# ---------------------------------------------------------------------------------------------------------
# scaled_dot_product_attention(..., enable_gqa=True)
# ---------------------------------------------------------------------------------------------------------
def _sdpa_with_grouped_heads(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Any:
    """SDPA where ``key`` / ``value`` may have fewer heads than ``query`` (a divisor of them): each k / v head
    serves ``heads // kv_heads`` consecutive query heads, as torch's ``enable_gqa``."""
    if enable_gqa and key.ndim >= 3 and query.shape[-3] != key.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = ltorch.repeat_interleave(key, groups, -3)
        value = ltorch.repeat_interleave(value, groups, -3)
    return ltorch.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


@installer("thunder-fix", "scaled_dot_product_attention takes enable_gqa, as torch's")
def take_grouped_query_attention_in_sdpa() -> None:
    """``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` (k / v with fewer heads than q) raises
    ``TypeError: ... unexpected keyword argument 'enable_gqa'`` in thunder 0.2.6. transformers passes it whenever
    no mask is given and the model groups its kv heads (a Llama prefill with a static cache): ``generate()`` failed.
    The kv heads are repeated to the query's (the gradient sums them back), then thunder's SDPA runs."""
    from thunder.core import jit_ext

    sdpa = torch.nn.functional.scaled_dot_product_attention
    grouped = jit_ext.interpreter_needs_wrap(_sdpa_with_grouped_heads)

    def lookaside(*args: Any, **kwargs: Any) -> Any:  # (wrapped values)
        if "enable_gqa" in kwargs and jit_ext.unwrap(kwargs["enable_gqa"]):
            return grouped(*args, **kwargs)
        kwargs.pop("enable_gqa", None)  # False: torch's default
        return jit_ext._general_jit_lookaside_map[sdpa](*args, **kwargs)  # thunder's (with the sdpa_kernel check)

    add_scoped_lookaside("take_grouped_query_attention_in_sdpa", sdpa, lookaside)


def _embedding_with_a_row_index(
    input: Any,
    weight: Any,
    padding_idx: Any = None,
    max_norm: Any = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Any:
    """``F.embedding`` with a negative ``padding_idx`` counted from the table's end, as torch's ``F.embedding`` does
    before it calls the op (refusing one before the table's start, as torch does)."""
    if padding_idx is not None and padding_idx < 0:
        if padding_idx < -weight.shape[0]:
            raise AssertionError("Padding_idx must be within num_embeddings")
        padding_idx = weight.shape[0] + padding_idx
    return ltorch.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


@installer("thunder-fix", "F.embedding counts a negative padding_idx from the table's end, as torch does")
def count_negative_padding_idx_from_the_end() -> None:
    """thunder 0.2.6 passes ``F.embedding(ids, w, padding_idx=-4)``'s index to its backward as it is, which then
    matches no row: the padding row gets a gradient, silently (fuzz seed 11296 under plain thunder.jit; torch's
    ``F.embedding`` first makes it ``w.shape[0] - 4``). DTensor lookups are the package's own rule."""
    from thunder.core import jit_ext

    add_scoped_lookaside(
        "count_negative_padding_idx_from_the_end",
        torch.nn.functional.embedding,
        jit_ext.interpreter_needs_wrap(_embedding_with_a_row_index),
    )


# ---------------------------------------------------------------------------------------------------------
# Attribute writes on a captured object that thunder recorded only in part
# ---------------------------------------------------------------------------------------------------------
@installer("thunder-fix", "the epilogue replays the state a program leaves, not a stale or a restoring write")
def replay_the_state_the_program_leaves() -> None:
    """thunder's interpreter records writes to objects the program reaches (an attribute, a module's
    ``_parameters``) and replays the last one it recorded in the epilogue. Two cases fail in thunder 0.2.6:

    * it records only some writes, so where a program sets an attribute and resets it (transformers' output
      collector: ``global_var = {}`` ... ``global_var = None``) it replays the first: ``AssertionError: trying
      to set .global_var of ... to object of type dict`` (every transformers 5.x model under ``thunder.jit``).
      The tracing ran the writes on the object itself: where the object now holds a plain constant that is not
      the recorded last write, that constant is the write replayed (thunder reads only its ``value`` there);
    * a write that puts back the value the program read from the same slot (transformers swaps a module's
      parameters for local tensors around a no-grad forward, then restores them) is replayed as a write of the
      module's ``_parameters``, which thunder does not support: ``NotImplementedError: Modifications of ...
      _parameters are not supported``. Such a key is left as it was: nothing to replay;
    * of an object's attributes it records the first write only (the later ones go to the traced copy of its
      ``__dict__`` unrecorded), so the others were silently lost: transformers' ``StaticCache`` layer sets
      ``device``, then its ``keys`` / ``values`` tensors and ``is_initialized`` in the prefill, and kept only
      ``device`` (every decode step then ran on an empty cache: wrong tokens). Every attribute the traced copy
      holds with a new value that thunder can write back (a tensor or number proxy, a number, None, a device,
      a tuple) is replayed;
    * a buffer of the root module reassigned in the program (``self.steps = self.steps + 1``) is written back
      under the name ``".steps"``, which no buffer has: the module kept the old value, silently.
    """
    from thunder.core import interpreter, jit_ext

    constants = (type(None), bool, int, float, str)
    from thunder.core.devices import Device
    from thunder.core.proxies import NumberProxy, TensorProxy

    replayable = (TensorProxy, NumberProxy, Device, tuple)
    store = interpreter.PseudoInst.STORE_SUBSCR

    def read_from_the_slot(value: Any, written: Any, name: Any) -> bool:
        history = getattr(value.value, "history", None)  # a proxy's provenance: where the program read it
        return (
            isinstance(history, interpreter.ProvenanceRecord)
            and history.inst is interpreter.PseudoInst.BINARY_SUBSCR
            and history.inputs[0] == written.provenance
            and history.inputs[1].inst is interpreter.PseudoInst.CONSTANT
            and history.inputs[1].value == name
        )

    def is_attribute_dict(written: Any) -> bool:
        provenance = written.provenance
        return (
            provenance.inst is interpreter.PseudoInst.LOAD_ATTR
            and provenance.inputs[1].inst is interpreter.PseudoInst.CONSTANT
            and provenance.inputs[1].value == "__dict__"
        )

    def read_from_the_object(current: Any, written: Any, name: str) -> bool:
        history = getattr(current, "history", None)
        owner = written.provenance.inputs[0]
        return (
            isinstance(history, interpreter.ProvenanceRecord)
            and history.inst in (interpreter.PseudoInst.LOAD_ATTR, interpreter.PseudoInst.BINARY_SUBSCR)
            and history.inputs[0] in (owner, written.provenance)
            and history.inputs[1].inst is interpreter.PseudoInst.CONSTANT
            and history.inputs[1].value == name
        )

    def unrecorded_attribute_writes(written: Any, held: dict, recorded: dict) -> list[tuple[str, Any]]:
        original = written.original_value
        if original is written.nothing or not isinstance(original, dict):
            return []
        writes = []
        for name, current in held.items():
            if name in recorded or (name in original and original[name] is current):
                continue
            if read_from_the_object(current, written, name):
                continue
            if isinstance(current, replayable) or (
                isinstance(current, (int, float, type(None))) and original.get(name, object()) != current
            ):
                writes.append((name, current))
        return writes

    def name_root_buffers_plainly(bsym: Any) -> Any:
        if bsym.sym.id != prims.PrimIDs.PACK_BUFFER or not str(bsym.args[1]).startswith("."):
            return bsym
        module, name, value = bsym.args
        return bsym.from_bsym(args=(module, name[1:], value))

    def process(ctx: Any, epilogue_trace: Any) -> Any:
        if not active("replay_the_state_the_program_leaves"):
            return original(ctx, epilogue_trace)
        for written in list(ctx._additional_outputs):
            records, held = ctx._additional_outputs[written], written.value
            if not isinstance(held, dict):
                continue
            last = {}
            for inst, *args in records:
                if inst == store:
                    _, key, value = args
                    last[key.value] = (key, value)
            for name, (key, value) in last.items():
                current = held.get(name, value.value)
                if read_from_the_slot(value, written, name):
                    records[:] = [r for r in records if not (r[0] == store and r[2].value == name)]
                elif current is not value.value and isinstance(current, constants):
                    replayed = types.SimpleNamespace(value=current)
                    records.append((store, written, key, replayed))
            if is_attribute_dict(written):
                for name, current in unrecorded_attribute_writes(written, held, last):
                    records.append(
                        (store, written, types.SimpleNamespace(value=name), types.SimpleNamespace(value=current))
                    )
            if not records:
                del ctx._additional_outputs[written]
        result = original(ctx, epilogue_trace)
        epilogue_trace.bound_symbols[:] = [name_root_buffers_plainly(b) for b in epilogue_trace.bound_symbols]
        return result

    original = jit_ext.process_recorded_modifications
    patch(
        jit_ext,
        "process_recorded_modifications",
        process,
        expects=expects_function("thunder.core.jit_ext", "ctx", "epilogue_trace"),
    )


# ---------------------------------------------------------------------------------------------------------
# Gradient hooks registered on a parameter (or another program input) inside the program
# ---------------------------------------------------------------------------------------------------------
#: Tensor methods that register a gradient hook: run on the real tensor while tracing, once, as eager does
GRADIENT_HOOK_METHODS = ("register_hook", "register_post_accumulate_grad_hook")


@installer("thunder-fix", "a gradient hook registered on a parameter inside the program is registered on it")
def register_gradient_hooks_on_real_tensors() -> None:
    """``param.register_post_accumulate_grad_hook(hook)`` (or ``register_hook``) inside a jitted program raises
    ``AttributeError: Unknown attribute register_post_accumulate_grad_hook`` in thunder 0.2.6: its proxies have
    no such method. transformers' tensor parallelism registers gradient all-reduces this way on the first
    forward (Qwen3's q_norm / k_norm). Where the tensor is one the program reads from outside (a parameter,
    an argument), the registration runs on that tensor at trace time, as eager's first call does; the hook
    then fires in the backward, where autograd accumulates the parameter's gradient. A hook on a value the
    program computes still raises (it has no tensor to hold the hook)."""
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map

    def gradient_hook_method(obj: Any, name: Any, *maybe_default: Any) -> Any:
        real = getattr(obj, "original_value", None)
        if (
            interpreter.unwrap(name) in GRADIENT_HOOK_METHODS
            and isinstance(interpreter.unwrap(obj), TensorProxy)
            and isinstance(real, torch.Tensor)
            and active("register_gradient_hooks_on_real_tensors")
        ):
            method = getattr(real, interpreter.unwrap(name))
            record = interpreter.ProvenanceRecord(
                interpreter.PseudoInst.LOAD_ATTR, inputs=[obj.provenance, interpreter.wrap_const(name).provenance]
            )
            return interpreter.wrap(method, provenance=record)
        return NOT_ANSWERED

    def run_on_the_tensor(method: Callable) -> Callable:
        def register(tensor: Any, hook: Any) -> Any:  # wrapped values: the proxy's tensor is its original value
            real = interpreter.unwrap(tensor)
            if isinstance(real, TensorProxy):
                real = getattr(tensor, "original_value", None)
            if not isinstance(real, torch.Tensor):
                error = AttributeError(f"{method.__name__} on a tensor the program computes is not supported")
                return interpreter.do_raise(error)
            handle = method(real, interpreter.unwrap(hook))  # outside the interpreter, as eager runs it
            inputs = [interpreter.wrap_const(method).provenance, tensor.provenance, hook.provenance]
            return interpreter.wrap(
                handle, provenance=interpreter.ProvenanceRecord(interpreter.PseudoInst.OPAQUE, inputs)
            )

        return register

    on_attribute_read("register_gradient_hooks_on_real_tensors", gradient_hook_method, when="instead")
    for name in GRADIENT_HOOK_METHODS:
        method = getattr(torch.Tensor, name)
        assert method not in lookasides, f"thunder has a lookaside for {name} now"
        add_scoped_lookaside("register_gradient_hooks_on_real_tensors", method, run_on_the_tensor(method))


# ---------------------------------------------------------------------------------------------------------
# The stride of a tensor on the meta device made inside the program
# ---------------------------------------------------------------------------------------------------------
def _meta_stride(a: TensorProxy, dim: int | None = None) -> Any:
    if a.device.devicetype is not thunder.core.devices.DeviceType.META:
        raise AttributeError(
            f"stride() of {a.name}, a tensor on {a.device} that the program computes: thunder does not trace "
            "strides (only a meta-device tensor's, which a factory made contiguous, is known)"
        )
    stride: list[int]
    stride, step = [], 1
    for size in reversed(a.shape):  # contiguous: the last dim moves fastest (a size-0 or 1 dim counts as 1)
        stride.insert(0, step)
        step *= max(int(size), 1)
    return tuple(stride) if dim is None else stride[dim]


@installer("thunder-fix", "stride() of a tensor a factory made on the meta device is its contiguous stride")
def give_meta_tensors_a_stride() -> None:
    """``torch.empty(shape, device="meta").stride()`` in a jitted program raises ``AttributeError: Unknown
    attribute stride`` in thunder 0.2.6: thunder's tensors have no strides. transformers' tensor parallelism
    computes ``DTensor.from_local``'s ``stride=`` argument this way. A factory makes a contiguous tensor, and
    a meta tensor holds nothing else, so ``stride()`` of a meta-device tensor is its contiguous stride; on
    another device it raises, naming the tensor (a DTensor's global stride is its spec's, see the proxy)."""
    from thunder.core import jit_ext
    from thunder.torch.langctx import _method_name_to_fn_map

    fix = "give_meta_tensors_a_stride"
    assert "stride" not in _method_name_to_fn_map, f"thunder maps Tensor.stride now: see {fix}"
    add_scoped_method(fix, "stride", _meta_stride)
    add_scoped_lookaside(fix, _meta_stride, jit_ext.interpreter_needs_wrap(_meta_stride))  # not interpreted


# ---------------------------------------------------------------------------------------------------------
# named_parameters() / named_buffers() inside the program, in the module's order
# ---------------------------------------------------------------------------------------------------------
@installer("thunder-fix", "named_parameters() / named_buffers() in a program yield in the module's order")
def keep_named_members_in_order() -> None:
    """thunder 0.2.6 answers ``module.named_parameters()`` inside a program from a set of the names, so the
    order is the set's, not the module's: ``list(model.named_parameters())`` in a jitted ``nn.Sequential(
    nn.Linear(4, 6), nn.LayerNorm(6))`` starts with ``1.bias``; a program that zips them with another list
    (transformers' weight tying, an optimizer's groups) pairs the wrong tensors. The replacement yields the
    names in the module's order (and strips a ``prefix=`` as torch adds it), each read through the interpreter
    as thunder does. A name the program itself has set to None (transformers' rowwise style sets
    ``module._parameters["bias"] = None`` in the forward) is left out, as torch leaves out None members."""
    import inspect

    from thunder.core import interpreter, jit_ext

    def named_members(model: Any, named: Callable, get: Callable, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(named).bind(*args, **kwargs)
        bound.apply_defaults()
        prefix = bound.arguments.get("prefix", "")
        names = [name for name, _ in named(*args, **kwargs)]

        def members(names: list) -> Iterator:  # interpreted: each member is read as the program would
            for name in names:
                try:
                    member = get(name[len(prefix) + 1 :] if prefix else name)
                except AttributeError:  # None (or gone) by now in the program: torch lists only present members
                    continue
                yield name, member

        record = interpreter.ProvenanceRecord(
            interpreter.PseudoInst.LOOKASIDE, inputs=[interpreter.wrap_const(named).provenance]
        )
        return interpreter._interpret_call(members, interpreter.wrap(names, provenance=record))

    expects = expects_function("thunder.core.jit_ext", "model", "named_member_method", "get_member_method")
    original = jit_ext._get_torch_nn_module_named_members_lookaside

    def in_order(model: Any, named: Callable, get: Callable, *args: Any, **kwargs: Any) -> Any:
        # a module read through a closure makes its program a DTensor program before any DTensor is traced
        if active("keep_named_members_in_order", interpreter.unwrap(model)):
            return named_members(model, named, get, *args, **kwargs)
        return original(model, named, get, *args, **kwargs)

    patch(jit_ext, "_get_torch_nn_module_named_members_lookaside", in_order, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# A tensor saved for the backward that an in-place op of the forward then overwrites
# ---------------------------------------------------------------------------------------------------------
def _is_thunder_copy(bsym: Any) -> bool:
    return bsym.sym.id == prims.PrimIDs.COPY_ or bsym.sym.name == "copy_"


def clone_saved_tensors_before_overwrites(forward_trace: Any) -> Any:
    """``forward_trace`` saving, for each tensor that a later ``copy_`` of the forward overwrites, a copy taken
    just before the write (the backward reads the value the tensor had when it was saved)."""
    from thunder.core.trace import from_trace, tracectx
    from thunder.executors import torchex

    *body, ret = forward_trace.bound_symbols
    outputs, (saved, others) = ret.args
    position = {p.name: i for i, p in enumerate(saved) if isinstance(p, TensorProxy)}
    kept = list(saved)
    bsyms: list = []
    trace = from_trace(forward_trace)
    trace.names, trace.name_ctr = forward_trace.names, forward_trace.name_ctr
    for bsym in body:
        destination = bsym.args[1] if _is_thunder_copy(bsym) and len(bsym.args) > 1 else None
        i = position.get(getattr(destination, "name", None))  # type: ignore[arg-type]  # (None: no entry)
        if i is not None and kept[i] is saved[i]:
            scope: list = []
            with tracectx(trace):
                trace.push_scope(scope)
                kept[i] = torchex.clone(destination)
                trace.pop_scope()
            bsyms += scope
        bsyms.append(bsym)
    if all(a is b for a, b in zip(kept, saved)):
        return forward_trace
    trace.bound_symbols = [*bsyms, ret.from_bsym(args=(outputs, (tuple(kept), others)))]
    forward_trace.name_ctr = trace.name_ctr
    return trace


@installer("thunder-fix", "a tensor saved for the backward is kept as it was when an in-place op overwrites it")
def keep_saved_tensors_from_in_place_writes() -> None:
    """``v = x * 2; v /= v.sum(-1, keepdim=True)`` under ``thunder.jit`` gives ``x`` a wrong gradient in thunder
    0.2.6 (off by up to 1.2 here; Mixtral's and Qwen3-MoE's routers, ``top_k /= top_k.sum(...)``, get wrong
    router gradients the same way, under thunder.jit and thunderfx). thunder saves ``v`` for the division's
    backward, then runs the in-place write as a ``copy_`` into ``v``'s memory, so the backward reads the
    divided values. The split of forward and backward now saves a copy taken just before such a write."""
    import thunder.transforms.autodiff as autodiff

    split = autodiff.split_into_forward_and_backward

    def split_keeping_saved_values(joint_trace: Any) -> Any:
        forward_trace, backward_trace = split(joint_trace)
        if backward_trace is None:
            return forward_trace, backward_trace
        return clone_saved_tensors_before_overwrites(forward_trace), backward_trace

    expects = expects_function("thunder.transforms.autodiff", "joint_trace")
    keeping = switched("keep_saved_tensors_from_in_place_writes", split_keeping_saved_values, split)
    patch(autodiff, "split_into_forward_and_backward", keeping, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# A custom autograd.Function given an object whose ``name`` is not a string (a ProcessGroup)
# ---------------------------------------------------------------------------------------------------------
@installer("thunder-fix", "a custom autograd.Function may take an object whose name is a method (a ProcessGroup)")
def name_opaque_arguments_of_traced_functions() -> None:
    """thunder names each argument of a custom ``autograd.Function``'s forward trace after ``proxy(arg).name``;
    an object thunder does not proxy stays itself, and if it has a ``name()`` method (torch.distributed's
    ``ProcessGroup``: transformers' MoE experts call ``_AllReduceForward.apply(x, tp_group)``) the trace cannot
    be printed: ``TypeError: sequence item 1: expected str instance, method found``. Such an argument gets a
    generated name."""
    from thunder.core import codeutils
    from thunder.core.proxies import ProxyInterface, proxy

    def from_name_and_args(name: str, args: Any) -> Any:
        signature = codeutils.SigInfo(name)
        for i, arg in enumerate(args):
            named = arg if isinstance(arg, ProxyInterface) else proxy(arg)
            arg_name = getattr(named, "name", None)
            signature.args.append((arg_name if isinstance(arg_name, str) else f"opaque_argument_{i}", None))
        return signature

    def expects(original: Any) -> str | None:
        return expects_function("thunder.core.codeutils", "name", "args")(getattr(original, "__func__", original))

    naming = switched(
        "name_opaque_arguments_of_traced_functions", from_name_and_args, codeutils.SigInfo.from_name_and_args
    )
    patch(codeutils.SigInfo, "from_name_and_args", staticmethod(naming), expects=expects)


# ---------------------------------------------------------------------------------------------------------
# torch custom ops (torch.library.custom_op) called in a program
# ---------------------------------------------------------------------------------------------------------
def _differentiable_inputs(args: tuple) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]


def _floating_proxies(args: Any) -> list:
    """The arguments a custom op's gradients are for, in order (as :func:`_differentiable_inputs` at run time)."""
    return [a for a in args if isinstance(a, TensorProxy) and dtypes.is_float_dtype(a.dtype)]


def _custom_op_vjp(op: Any) -> Callable:
    """The backward of ``op``: torch's autograd of the op itself, its forward recomputed (the op's own
    ``register_autograd`` rule when it has one, else torch's error)."""

    def vjp(*args: Any) -> tuple:
        *inputs, grad = args
        wrt = _differentiable_inputs(tuple(inputs))
        with torch.enable_grad():
            leaves = [a.detach().requires_grad_() if i in wrt else a for i, a in enumerate(inputs)]
            out = op(*leaves)
            grads = torch.autograd.grad(out, [leaves[i] for i in wrt], grad, allow_unused=True)
        return tuple(torch.zeros_like(inputs[i]) if g is None else g for i, g in zip(wrt, grads))

    return vjp


@installer("thunder-fix", "a torch custom op (torch.library.custom_op) in a program runs, forward and backward")
def run_torch_custom_ops() -> None:
    """``torch.ops.ns.op(...)`` of a ``torch.library.custom_op`` in a jitted program raises ``RuntimeError:
    ns.op is not registered. Register its custom_op output with thunder.torch.register_custom_op`` in thunder
    0.2.6, which has no such public function (transformers' MoE experts call ``transformers::
    grouped_mm_fallback``). On its first call such an op becomes a thunder operator: its meta is the op's
    fake implementation, it runs as the op, and its backward is torch's autograd of the op (its own
    ``register_autograd`` rule), its forward recomputed. Keyword arguments are passed by position (the grad
    rule takes them so); an op without a fake implementation still raises thunder's error, and the backward
    of an op with several outputs raises torch's."""
    from thunder_dtensor._integration.thunder_hooks import register_grad as register_own_grad

    from thunder.core import interpreter, jit_ext
    from thunder.torch.custom_op import _get_meta_function_from

    executor = OperatorExecutor("torch_custom_ops")  # joins the executors of a program that calls such an op
    lookasides = jit_ext._general_jit_lookaside_map
    previous = lookasides[torch._ops.OpOverloadPacket.__call__]
    symbols: dict[Any, Any] = {}  # the op packet -> its symbol (thunder's torch map is left as it is)

    def make_symbol(packet: Any, opdef: Any) -> Any:
        name = packet._qualified_op_name.replace("::", "_")
        forward = executor.register_operator(name, meta=_get_meta_function_from(opdef), fn=packet)

        def vjp_meta(*args: Any) -> tuple:
            *inputs, _ = args
            return tuple(TensorProxy(like=a) for a in _floating_proxies(inputs))

        backward = executor.register_operator(f"{name}_vjp", meta=vjp_meta, fn=_custom_op_vjp(packet))

        def grad_rule(*args: Any) -> Any:
            out = forward(*args)
            grads = backward(*args, get_grad(out))
            for a, g in zip(_floating_proxies(args), grads):
                put_grad(a, g)
            return out

        register_own_grad(forward, grad_rule, owner="thunder_fixes.run_torch_custom_ops", kind="thunder-fix")
        return forward

    def call(packet_wrapper: Any, *args: Any, **kwargs: Any) -> Any:
        import inspect

        from torch._library.custom_ops import OPDEFS

        packet = interpreter.unwrap(packet_wrapper)
        opdef = OPDEFS.get(getattr(packet, "_qualified_op_name", ""))
        if opdef is None or opdef._abstract_fn is None or packet in ltorch._torch_to_thunder_function_map:
            return previous(packet_wrapper, *args, **kwargs)
        if packet not in symbols:
            symbols[packet] = make_symbol(packet, opdef)
        add_program_executor(executor)
        bound = inspect.signature(opdef._init_fn).bind(*args, **kwargs)  # positional, as the grad rule takes them
        bound.apply_defaults()
        output = symbols[packet](*(interpreter.unwrap(a) for a in bound.args))
        record = interpreter.ProvenanceRecord(interpreter.PseudoInst.LOOKASIDE, inputs=[packet_wrapper.provenance])
        return interpreter.wrap(output, provenance=record)

    expects = expects_function("thunder.core.jit_ext", "wrapped_opoverload_packet")
    call = switched("run_torch_custom_ops", call, previous)
    patch(lookasides, torch._ops.OpOverloadPacket.__call__, call, table=JIT_LOOKASIDES, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# ``x.requires_grad`` of a value the program computes
# ---------------------------------------------------------------------------------------------------------
#: thunder symbols whose outputs never require grad, whatever their inputs
_NO_GRADIENT_SYMBOLS = frozenset({"detach", "stop_gradient"})


def computed_requires_grad(trace: Any, proxy: Any) -> bool:
    """Whether ``proxy`` requires grad as autograd would have it: computed (in ``trace``, as traced so far) under
    grad mode from a value that requires grad, and of a floating or complex dtype."""
    grad_enabled = torch.is_grad_enabled()  # the caller's mode: thunder records changes as symbols
    needs: set[str] = set()
    for bsym in trace.bound_symbols:
        if bsym.sym.id == "set_grad_enabled" or bsym.sym.name == "_set_grad_enabled_with_warning":
            grad_enabled = bool(pyval(bsym.args[0]))
            continue
        if not grad_enabled or bsym.sym.name in _NO_GRADIENT_SYMBOLS:
            continue
        if any(isinstance(a, TensorProxy) and (a.requires_grad or a.name in needs) for a in bsym.flat_proxy_args):
            needs.update(
                o.name
                for o in bsym.flat_proxy_outs
                if isinstance(o, TensorProxy) and (dtypes.is_float_dtype(o.dtype) or dtypes.is_complex_dtype(o.dtype))
            )
    return proxy.name in needs


@installer("thunder-fix", "x.requires_grad of a value the program computes is autograd's answer, not False")
def answer_requires_grad_of_computed_values() -> None:
    """Inside a jitted program thunder 0.2.6 answers ``x.requires_grad`` with False for every value the program
    computes (``x.view(-1).requires_grad``, ``F.linear(x, w).requires_grad``, ... where eager says True), so code
    that branches on it takes eager's no-grad path: transformers' MoE tensor parallelism skips its
    gradient all-reduce (``_AllReduceBackward.apply`` returns its input unless it requires grad) and Mixtral's
    gradients come out wrong. A read of ``requires_grad`` on a computed value is answered from the trace so
    far (grad mode, inputs, dtype), as autograd would; an input's own flag is kept."""
    from thunder.core import interpreter, jit_ext

    def computed_requires_grad_read(obj: Any, name: Any, value: Any) -> Any:
        if interpreter.unwrap(name) != "requires_grad" or value is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED:
            return value
        if not active("answer_requires_grad_of_computed_values"):
            return value
        proxy = interpreter.unwrap(obj)
        if not isinstance(proxy, TensorProxy) or interpreter.unwrap(value) or proxy.requires_grad:
            return value
        if not computed_requires_grad(jit_ext.get_jit_ctx().computation_trace, proxy):
            return value
        record = interpreter.ProvenanceRecord(
            interpreter.PseudoInst.LOOKASIDE, inputs=[interpreter.wrap_const(getattr).provenance, obj.provenance]
        )
        return interpreter.wrap(True, provenance=record)

    on_attribute_read("answer_requires_grad_of_computed_values", computed_requires_grad_read, when="after")


# ---------------------------------------------------------------------------------------------------------
# torch.compile regions and complex tensors
# ---------------------------------------------------------------------------------------------------------
def _writes_a_complex_tensor(bsym: Any) -> bool:
    """A ``copy_`` or an in-place op into a complex tensor: a region's input may be a copy (below)."""
    writes = is_copy(bsym) or written_destination(bsym) is not None
    return writes and any(isinstance(v, TensorProxy) and dtypes.is_complex_dtype(v.dtype) for v in bsym.flat_proxy_args)


def _complex_views_of_real_tensors(args: tuple) -> list[int]:
    """Positions of the complex tensors in ``args`` whose storage a real tensor owns (``view_as_complex``)."""
    return [
        i
        for i, a in enumerate(args)
        if isinstance(a, torch.Tensor) and a.is_complex() and a._base is not None and not a._base.is_complex()
    ]


def _taking_complex_views_as_copies(compiled: Callable) -> Callable:
    """``compiled`` (a region with complex inputs), handed a copy of each complex input that is a view of a real
    tensor: dynamo cannot take one as an input."""

    @functools.wraps(compiled)
    def call(*args: Any) -> Any:
        views = _complex_views_of_real_tensors(args)
        if views:
            args = tuple(a.clone() if i in views else a for i, a in enumerate(args))
        return compiled(*args)

    return call


@installer("thunder-fix", "torch.compile executors take complex tensors into their regions as dynamo can")
def give_torch_compile_regions_whole_complex_tensors() -> None:
    """thunder's torch.compile executors compile each region with dynamo, which cannot take a complex view of a
    real tensor as an input: ``torch.compile(lambda c: c * 2)(torch.view_as_complex(torch.randn(4, 4).view(4, 2,
    2)))`` fails with ``InternalTorchDynamoError: Tensor must have a last dimension of size 2`` (torch 2.13), so
    RoPE written with ``view_as_complex`` (torchtitan's Llama 3) failed at its first call once
    ``torch_compile_ex`` was listed. A region whose inputs hold a complex tensor hands dynamo a copy of each one
    that is a view of a real tensor (none in a RoPE fused whole: its complex frequencies are a complex tensor's
    own), so the complex ops join the regions: a Llama step is one forward and one backward graph, not three
    each. The executors still refuse thunder's ``view_as_complex`` / ``view_as_real`` (the executor after them
    has their gradient rules; the ops they claim them as are fusible) and writes into complex tensors (a copy
    would lose them)."""
    import thunder.executors.torch_compile as torch_compile_module
    from thunder.executors.torch_compile import TorchCompileExecutor

    can_execute, make_compiled = TorchCompileExecutor.can_execute, torch_compile_module.make_compiled
    refused = {ltorch.view_as_complex.id, ltorch.view_as_real.id}  # type: ignore[attr-defined]

    def claiming_what_dynamo_takes(self: Any, bsym: Any) -> bool:
        return bsym.sym.id not in refused and not _writes_a_complex_tensor(bsym) and can_execute(self, bsym)

    def compiled_taking_complex_views_as_copies(
        bsyms: Any, sorted_unique_inputs: Any, sorted_unique_outputs: Any, **kwargs: Any
    ) -> Callable:
        compiled = make_compiled(bsyms, sorted_unique_inputs, sorted_unique_outputs, **kwargs)
        takes_complex = any(
            isinstance(a, TensorProxy) and dtypes.is_complex_dtype(a.dtype) for a in sorted_unique_inputs
        )
        return _taking_complex_views_as_copies(compiled) if takes_complex else compiled

    fix = "give_torch_compile_regions_whole_complex_tensors"
    inherited = expects_qualified("thunder.extend.Executor.can_execute", "self", "bsym")
    claiming = switched(fix, claiming_what_dynamo_takes, can_execute)
    patch(TorchCompileExecutor, "can_execute", claiming, expects=inherited)
    patch(
        torch_compile_module,
        "make_compiled",
        switched(fix, compiled_taking_complex_views_as_copies, make_compiled),
        expects=expects_qualified(
            "thunder.executors.torch_compile.make_compiled", "bsyms", "sorted_unique_inputs", "sorted_unique_outputs"
        ),
    )


# ---------------------------------------------------------------------------------------------------------
# Writes into views of tensors that require grad
# ---------------------------------------------------------------------------------------------------------
def _plain_tensor(p: Any) -> bool:
    return type(p) is TensorProxy  # (DTensor proxies are the package's own, rewritten with its own emitter)


@installer("thunder-fix", "a write into a view of a tensor that requires grad gets eager's values and gradients")
def functionalize_writes_into_views_that_require_grad() -> None:
    """thunder 0.2.6 differentiates a write into a view as if the viewed tensor kept its old value:
    ``y = x.clone(); y[:, 1:].mul_(0.5); return y * 3`` gives ``x`` the gradient 3 everywhere (eager: 1.5 in the
    written columns), and ``y[:, 1:].add_(b); return y * 2`` gives ``b`` no gradient. Before thunder's alias
    pass, such a write becomes an out-of-place update of the viewed tensor (``_integration/functionalize.py``),
    each later read of it or of its views reading the update; installed last, around the package's pass."""
    from thunder_dtensor._integration.functionalize import functionalize_writes_into_views, plain_emitter

    import thunder.core.update_aliases as update_aliases

    emitter = plain_emitter()
    name = "functionalize_writes_into_views_that_require_grad"

    def emitter_for(p: Any) -> Any:
        return emitter if _plain_tensor(p) else None

    for holder in (update_aliases, thunder):  # thunder.__init__ calls it by the name it imported
        previous = holder.insert_alias_updates

        def insert_alias_updates(trace: Any, alias_tensor_indices: list, _previous: Callable = previous) -> Any:
            if active(name):
                trace = functionalize_writes_into_views(trace, emitter_for)
            return _previous(trace, alias_tensor_indices)

        expects = expects_function(("thunder.core.update_aliases", "thunder_dtensor._integration"))
        patch(holder, "insert_alias_updates", insert_alias_updates, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# Branches on numbers the program computes
# ---------------------------------------------------------------------------------------------------------
@installer("thunder-fix", "bool() of a number computed at run time (x.item()) is refused, not taken as False")
def refuse_branches_on_run_time_numbers(refusal: Callable[[Any, str | None], Exception]) -> None:
    """A number the program reads from a tensor (``s = x.sum().item()``) has no value at trace time; thunder 0.2.6
    compares it all the same and converts the comparison to ``bool`` as ``bool(None)``: ``if s > 0:`` takes the
    ``else`` branch on every call, silently (no check of the branch is kept). Where active, a conversion of such a
    number to ``bool`` keeps it without a value, and ``bool()`` of it in the program raises ``refusal(number)`` at
    trace time (a branch a trace cannot take)."""
    from thunder.core import jit_ext
    from thunder.core.proxies import NumberProxy, numberproxy

    name = "refuse_branches_on_run_time_numbers"
    convert_meta = prims.convert_element_type.meta

    @functools.wraps(convert_meta)  # (traces print the symbol's module from its meta's: thunder's prims)
    def convert_element_type_meta(a: Any, /, dtype: Any) -> Any:
        if isinstance(a, NumberProxy) and a.value is None and active(name):
            return numberproxy(dtype, None, constraint=a.constraint)
        return convert_meta(a, dtype)

    expects = expects_function("thunder.core.prims", "a", "dtype")
    patch(prims.convert_element_type, "meta", convert_element_type_meta, expects=expects, frozen=True)

    @jit_ext.interpreter_needs_wrap
    def refuse(number: Any) -> bool:
        raise refusal(number, None)

    def bool_lookaside(wrapped: Any) -> Any:
        value = getattr(wrapped, "value", None)
        if isinstance(value, NumberProxy) and value.value is None:
            return refuse(wrapped)
        return jit_ext._general_jit_lookaside_map[bool](wrapped)  # thunder's

    add_scoped_lookaside(name, bool, bool_lookaside)

    # thunder's own ops branch on their number arguments in Python while they trace (``if p == 0`` in dropout):
    # ``bool()`` of a number without a value there is refused too, naming the op that branched
    number_to_bool = NumberProxy.__bool__

    def refusing_bool(self: Any) -> bool:
        if self.value is None and active(name):
            raise refusal(self, _thunder_function_branching())
        return number_to_bool(self)

    patch(NumberProxy, "__bool__", refusing_bool, expects=expects_function("thunder.core.proxies", "self"))


def _thunder_function_branching() -> str | None:
    """The thunder function (``thunder.torch.dropout``) whose Python converted a number to ``bool``, if any."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("thunder.torch", "thunder.clang", "thunder.core.prims")):
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


# ---------------------------------------------------------------------------------------------------------
# add / sub with an alpha computed at run time
# ---------------------------------------------------------------------------------------------------------
@installer("thunder-fix", "torch.add / torch.sub take an alpha computed at run time (x.item()), not alpha=1")
def scale_by_run_time_alphas() -> None:
    """``torch.add(a, b, alpha=s)`` with ``s = x.item()``: thunder 0.2.6's ``add`` and ``sub`` scale ``b`` only
    ``if alpha != 1``, which a number without a value at trace time answers False: the program adds ``b``
    unscaled on every call, silently (the trace keeps no check). Where active, such an alpha always scales."""
    from thunder.core.proxies import NumberProxy

    fix = "scale_by_run_time_alphas"
    for symbol in (ltorch.add, ltorch.sub):
        original = cast(Callable, symbol.meta)

        def scaling(a: Any, b: Any, /, *, alpha: Any = 1, _original: Callable = original) -> Any:
            if isinstance(alpha, NumberProxy) and alpha.value is None and active(fix, a, b):
                return _original(a, b * alpha)
            return _original(a, b, alpha=alpha)

        functools.update_wrapper(scaling, original)  # (traces print the symbol's module from its meta's)
        patch(symbol, "meta", scaling, expects=expects_function("thunder.torch", "a", "b"), frozen=True)


# ---------------------------------------------------------------------------------------------------------
# thunder's autograd bridge: no gradient in, no gradient out
# ---------------------------------------------------------------------------------------------------------
def _zeros_like_output(output: Any) -> Callable[[], Any] | None:
    """What torch's autograd would put in place of a missing gradient of ``output`` (``zeros_like``), made from its
    metadata only (the bridge must not hold its own outputs: a reference cycle through ``grad_fn``). A DTensor's
    zeros are placed as the cotangent the backward was traced for (a Partial placement read as Replicate), not
    as the output: under thunderfx a graph's output that only ``.item()`` reads gets no gradient, and its zeros
    placed Partial made the backward trace again for them and the input's gradient come out placed otherwise
    than eager's, which never differentiates that read (fuzz seed 13185)."""
    from thunder_dtensor._integration.bootstrap import DTensor, Replicate, dtensor_spec, local_tensor

    if isinstance(output, DTensor):
        spec, local = dtensor_spec(output), local_tensor(output)
        shape, stride, dtype, device = tuple(local.shape), tuple(local.stride()), local.dtype, local.device
        placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)

        def zeros() -> Any:
            made = DTensor.from_local(
                torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_(),
                spec.mesh,
                placements,
                run_check=False,
                shape=spec.shape,
                stride=spec.stride,
            )
            setattr(made, _NO_GRADIENT_CAME, True)
            return made

        return zeros
    if isinstance(output, torch.Tensor):
        shape, stride, dtype, device = tuple(output.shape), tuple(output.stride()), output.dtype, output.device
        return lambda: torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
    return None


#: set on the zeros the bridge makes for an output that got no gradient (``is_missing_gradient``)
_NO_GRADIENT_CAME = "_thunder_dtensor_no_gradient_came"


def is_missing_gradient(cotangent: Any) -> bool:
    """Whether ``cotangent`` is the zeros the bridge made for an output autograd gave no gradient: eager never runs
    the backward of that output's ops, so a backward traced again may leave them out (``guards``)."""
    return getattr(cotangent, _NO_GRADIENT_CAME, False) is True


@installer("thunder-fix", "a compiled program none of whose outputs gets a gradient gives its inputs none")
def no_gradient_in_no_gradient_out() -> None:
    """torch's autograd calls a node whose outputs got no gradient when another path reaches it (thunderfx: a
    graph's output that the graph after a break takes as an input but does not read, whose backward gives it
    ``None``), and an autograd Function sees zeros there unless it asks otherwise. thunder's bridge
    (``ThunderFunction``) then ran its backward on zeros and handed its inputs zero gradients where torch's own
    nodes give none: ``x.grad`` a tensor of zeros instead of ``None`` (fuzz seed 7460; an optimizer with weight
    decay updates such a parameter, eager does not). In DTensor programs the bridge (without thunder.jit's split,
    as thunderfx runs it) asks torch not to make the zeros: with no gradient at all it gives its inputs none, else
    it makes the zeros itself."""
    from thunder.executors.torch_autograd import ThunderFunction

    forward, backward = ThunderFunction.forward, ThunderFunction.backward
    n_leading = 7  # the bridge's arguments before its flat outputs' tensors: (..., flat_output, *flat_args)

    def forward_noting_outputs(ctx: Any, *args: Any) -> Any:
        out = forward(ctx, *args)
        side_channel, flat_output, flat_args = args[2], args[n_leading - 1], args[n_leading:]
        chosen = mode("no_gradient_in_no_gradient_out")
        if side_channel is None and (
            chosen == EVERYWHERE or (chosen == IN_DTENSOR_PROGRAMS and running_a_dtensor_program())
        ):
            ctx.set_materialize_grads(False)
            ctx.thunder_dtensor_zeros = [_zeros_like_output(o) for o in flat_output]
            ctx.thunder_dtensor_inputs = len(flat_args)
        return out

    def backward_without_gradient(ctx: Any, *grads: Any) -> Any:
        zeros = getattr(ctx, "thunder_dtensor_zeros", None)
        if zeros is not None:
            if all(g is None for g in grads):
                return (None,) * (n_leading + ctx.thunder_dtensor_inputs)
            grads = tuple(make() if g is None and make is not None else g for g, make in zip(grads, zeros))
        return backward(ctx, *grads)

    bridge = "thunder.executors.torch_autograd.ThunderFunction"
    patch(
        ThunderFunction,
        "forward",
        staticmethod(forward_noting_outputs),
        expects=expects_qualified(f"{bridge}.forward", "ctx", "return_none_instead_of_grads"),
    )
    patch(
        ThunderFunction,
        "backward",
        staticmethod(backward_without_gradient),
        expects=expects_qualified(f"{bridge}.backward", "ctx"),
    )


# ---------------------------------------------------------------------------------------------------------
# thunderfx's splitter (thunder 0.2.6 ``thunder/dynamo``): in-place writes into a graph's inputs
# ---------------------------------------------------------------------------------------------------------
#: ``x[i] = v``, ``x += y``, ...: dynamo records these as calls of ``operator``'s functions
_IN_PLACE_OPERATORS = frozenset(
    getattr(operator, name)
    for name in (
        "setitem",
        "iadd",
        "isub",
        "imul",
        "itruediv",
        "ifloordiv",
        "imod",
        "ipow",
        "imatmul",
        "iand",
        "ior",
        "ixor",
        "ilshift",
        "irshift",
    )
)


def _written_in_place(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose tensor ``node`` writes in place (``x.add_(...)``, ``torch.Tensor.index_add_(x, ...)``,
    ``x[i] = v``, ``x += y``), or None."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function" and node.target not in _IN_PLACE_OPERATORS:
        schema = getattr(node.target, "_schema", None)
        name = schema.name.split("::")[-1] if schema is not None else getattr(node.target, "__name__", "")
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "") + "_"  # (``setitem``, ``iadd``, ...: in place by what they are)
    else:
        return None
    if not (name.endswith("_") and not name.endswith("__")) or not node.args:
        return None
    written = node.args[0]
    return written if isinstance(written, torch.fx.Node) else None


def _example_tensor(node: torch.fx.Node) -> torch.Tensor | None:
    value = node.meta.get("example_value")
    value = getattr(value, "_local_tensor", value)  # a DTensor's local stand-in shares its storage
    return value if isinstance(value, torch.Tensor) else None


def _placeholders(node: torch.fx.Node) -> list[torch.fx.Node]:
    return list(node.graph.find_nodes(op="placeholder"))


def _viewed_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of ``node`` whose tensor ``node``'s tensor shares storage with (``node`` made a view of it, or
    wrote into it), or None."""
    tensor = _example_tensor(node)
    if tensor is None:
        return None
    return next(
        (
            arg
            for arg in node.all_input_nodes
            if (source := _example_tensor(arg)) is not None and torch._C._is_alias_of(tensor, source)  # type: ignore[attr-defined]  # (not in torch's stubs)
        ),
        None,
    )


def _storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node that made the storage ``node``'s tensor is a view of (``node`` itself if it made it)."""
    while (parent := _viewed_input(node)) is not None:
        node = parent
    return node


def write_from_outside_its_region(node: torch.fx.Node, supported: Callable[[torch.fx.Node], bool]) -> str | None:
    """Why ``node`` must run outside thunder: it writes in place into a tensor that requires grad afterwards and
    that its thunder region would take as an input (a graph input, or one made before a node thunderfx splits out,
    ``supported(n)`` False); else None."""
    written = _written_in_place(node)
    value = None if written is None else written.meta.get("example_value")
    if written is None or not isinstance(value, torch.Tensor) or not value.requires_grad:  # (a DTensor's own flag)
        return None
    root = _storage_root(written)
    where = None
    if root.op == "placeholder":
        where = f"the graph input {root.name}"
    else:
        between = root
        while between is not node and where is None:
            if between.op.startswith("call_") and not supported(between):
                where = f"{root.name}, " + ("which" if between is root else f"made before {between.name}, which")
                where += " runs outside thunder"
            between = between.next
    if where is None:
        return None
    return (
        f"{node.format_node()} writes in place into {where}, which then requires grad: a thunder region cannot give "
        "its input the autograd history of a write (the gradient through it would be lost); the write runs in torch"
    )


def _writers_through_views(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """The in-place writes into ``node``'s tensor, directly or through views of it made after it."""
    for user in node.users:
        if _written_in_place(user) is node:
            yield user
        elif _viewed_input(user) is not None:
            yield from _writers_through_views(user)


@functools.lru_cache(maxsize=2)  # the graph being split
def _nodes_in_unsupported_contexts(graph: torch.fx.Graph) -> Any:
    """The nodes thunderfx's splitter sends to torch for their context (autocast regions, ...), once per graph."""
    import thunder.dynamo.splitter as fx_splitter

    return fx_splitter.get_nodes_in_unsupported_ctx_regions(cast(torch.fx.GraphModule, graph.owning_module))


@installer("thunder-fix", "thunderfx: an in-place write into a graph input that then requires grad runs in torch")
def run_writes_into_graph_inputs_in_torch() -> None:
    """thunderfx hands a graph that writes in place into one of its inputs (a tensor made before a graph break:
    ``out = torch.zeros_like(x)``, break, ``out.index_add_(0, idx, y)``) to thunder, whose region is an autograd
    Function: it copies the new value into the input, but the input cannot take the write's autograd history, so
    the gradient through the write is lost, silently (Hugging Face's GPT-OSS experts under thunderfx: every
    gradient below the last MoE layer wrong, relative norm 0.4-1: ``out.add_(bias)`` into the output of a torch
    custom op that thunderfx split out; ``out.add_(x * 2)`` after a graph break returns a tensor without a
    gradient). Where this acts, such a write (its tensor requires grad afterwards, and it was made outside the
    write's thunder region: a graph input, or before a node that runs outside thunder) is split out of thunder's
    region with a reason, and torch's compiler, which replays input mutations under autograd, runs it.
    Installed after the DTensor splitter's own wrapper, so that it asks before any cached answer."""
    import thunder.dynamo.splitter as fx_splitter
    import thunder.dynamo.utils as fx_utils

    fix = "run_writes_into_graph_inputs_in_torch"
    node_check = expects_function(("thunder.dynamo", "thunder_dtensor"), "node")
    for module in (fx_utils, fx_splitter):
        asks_thunder = module.is_node_supported_by_thunder

        def supported(node: torch.fx.Node, options: dict, _asks_thunder: Callable = asks_thunder) -> Any:
            written = _written_in_place(node)
            # the view a split-out write writes through is made in torch too: torch refuses a write into a view
            # that a thunder region (which runs without grad) gave back
            writers = [node] if written is not None else list(_writers_through_views(node))
            # a DTensor program: the call's (see program_scope), or a graph with a DTensor among its inputs
            if writers and active(fix, *(p.meta.get("example_value") for p in _placeholders(node))):
                outside = _nodes_in_unsupported_contexts(node.graph)
                for writer in writers:
                    reason = write_from_outside_its_region(
                        writer, lambda n: n is node or (n not in outside and _asks_thunder(n, options)[0])
                    )
                    if reason is not None:
                        if writer is not node:
                            reason = f"{node.name} is a view that a write split out of thunder writes into: {reason}"
                        return False, fx_utils.SplitReason(fx_utils.SplitReasonType.UNSUPPORTED_NODE, info=reason)
            return _asks_thunder(node, options)

        patch(module, "is_node_supported_by_thunder", supported, expects=node_check)


# ---------------------------------------------------------------------------------------------------------
# torch's named results (``torch.return_types``): ``x.max(dim=-1).values``
# ---------------------------------------------------------------------------------------------------------
#: a named result as Python prints it (``torch.return_types.max(\nvalues=t0,\nindices=t1)``), which its type
#: cannot be called with: it takes one sequence
_PRINTED_NAMED_RESULT = re.compile(r"torch\.return_types\.(\w+)\(\n((?:\w+=[^\n]*?,\n)*\w+=[^\n]*?)\)")


def callable_named_results(code: str) -> str:
    """``code`` (a trace's printed Python) with each named result printed as a call its type takes:
    ``torch.return_types.max((t0, t1))``. Their fields are tensors (printed as names), so none nests another."""

    def as_call(match: re.Match) -> str:
        values = [field.split("=", 1)[1] for field in match.group(2).split(",\n")]
        return f"torch.return_types.{match.group(1)}(({', '.join(values)},))"

    return _PRINTED_NAMED_RESULT.sub(as_call, code)


@installer("thunder-fix", "max(dim) / topk / sort / frexp give torch's named results (.values, .indices)")
def name_the_fields_of_paired_results() -> None:
    """thunder 0.2.6 gives ``torch.max(x, dim)``, ``torch.topk``, ``torch.sort`` and ``torch.frexp`` (and their
    Tensor methods) as plain tuples, so ``x.max(dim=-1, keepdim=True).values`` raises ``AttributeError: values``:
    every Hugging Face MoE router or attention-sink softmax that reads ``.values`` / ``.indices`` (GPT-OSS,
    MiMo-V2-Flash, DeepSeek-V3.2, ...). Where this acts, the interpreter hands the program torch's named result
    (``torch.return_types.max`` ...) around the same proxies: fields by name, indexing and unpacking as before.
    The outermost wrapper of the interpreter's lookaside (installed last), so that a DTensor call's result is
    named too."""
    import thunder.torch as ltorch
    from thunder.core import interpreter, jit_ext

    fix = "name_the_fields_of_paired_results"
    named = {
        "max": (torch.max, torch.Tensor.max, ltorch.torch_max, torch.return_types.max),
        "topk": (torch.topk, torch.Tensor.topk, ltorch.topk, torch.return_types.topk),
        "sort": (torch.sort, torch.Tensor.sort, ltorch.sort, torch.return_types.sort),
        "frexp": (torch.frexp, torch.Tensor.frexp, ltorch.frexp, torch.return_types.frexp),
    }
    result_types: dict[Any, Any] = {fn: entry[-1] for entry in named.values() for fn in entry[:-1]}
    original_lookaside = jit_ext.general_jit_lookaside
    raised = interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED

    def naming(inner: Callable, result_type: Any) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = inner(*args, **kwargs)
            value = interpreter.unwrap(result) if result is not raised else None
            if type(value) is not tuple or len(value) != result_type.n_fields:
                return result  # an exception, or max's one-tensor overloads
            record = interpreter.ProvenanceRecord(interpreter.PseudoInst.OPAQUE, inputs=[result.provenance])
            return interpreter.wrap(result_type(value), provenance=record)

        return call

    def lookaside(fn: Any, *args: Any, **kwargs: Any) -> Any:
        inner = original_lookaside(fn, *args, **kwargs)
        try:
            result_type = result_types.get(fn)
        except TypeError:  # an unhashable callable
            result_type = None
        if result_type is None or inner is None or not active(fix):
            return inner
        return naming(inner, result_type)

    expects = expects_function(("thunder.core.jit_ext", "thunder_dtensor"), "fn")  # thunder's, or a wrapper of it
    patch(jit_ext, "general_jit_lookaside", lookaside, expects=expects)

    from thunder.torch.langctx import TorchCtx

    original_get_method = TorchCtx.get_method

    def get_method(self: Any, id: str, *args: Any, **kwargs: Any) -> Callable:
        method = original_get_method(self, id, *args, **kwargs)
        if id in named:  # a DTensor's method: the dtensor callable that runs it
            with contextlib.suppress(TypeError):  # (an unhashable callable)
                result_types.setdefault(method, named[id][-1])
        return method

    expects = expects_function(("thunder.torch.langctx", "thunder_dtensor"), "self", "id")
    patch(TorchCtx, "get_method", get_method, expects=expects)

    # a program that returns a named result prints it in its return statement (the epilogue's, a DTensor
    # program's): as a call the type takes
    from thunder.core import codeutils

    original_prettyprint = codeutils.prettyprint

    @functools.wraps(original_prettyprint)
    def prettyprint(x: Any, **kwargs: Any) -> str:
        printed = original_prettyprint(x, **kwargs)
        return callable_named_results(printed) if "torch.return_types." in printed else printed

    printing = switched(fix, prettyprint, original_prettyprint)
    patch(codeutils, "prettyprint", printing, expects=expects_function("thunder.core.codeutils", "x"))


# ---------------------------------------------------------------------------------------------------------
# dynamo's custom autograd.Function (``torch.ops.higher_order.autograd_function_apply``), torch >= 2.13 form
# ---------------------------------------------------------------------------------------------------------
def _dropping_the_context(graph_module: Any) -> Callable:
    """``graph_module`` called as thunder's lookaside calls a Function's body: with a leading context argument."""

    forward = graph_module.forward  # (not ``graph_module(...)``: module-call machinery that reads its code)

    def body(ctx: Any, *args: Any) -> Any:
        return forward(*args)

    return body


@installer("thunder-fix", "thunderfx: a custom autograd.Function in a dynamo graph of torch >= 2.13 is traced")
def take_autograd_function_apply_without_a_tensor_mask() -> None:
    """thunder 0.2.6 reads a custom ``autograd.Function`` in a dynamo graph (``torch.ops.higher_order.
    autograd_function_apply(fwd, bwd, *args, **kwargs)``) in torch's older form: an ``args_tensor_mask``
    keyword, and forward and backward bodies that take a context first. torch 2.13's dynamo records
    ``non_differentiable_idx`` and ``saved_for_backward_idx`` instead, and bodies without the context, so
    thunderfx failed on every graph with such a Function (``KeyError: 'args_tensor_mask'``): the MLA attention
    of DeepSeek-V2/V3/V3.2, AXK1/2 and dots3 under transformers' tensor parallelism. Where this acts, the newer
    form is handed to thunder's lookaside as the older one: every argument kept, each body called without the
    context it is given, and a lone output given back as the one-tuple the newer graph indexes. A Function that
    marks an input dirty (``dirty_idx``) is refused with a clear error."""
    from thunder.core import interpreter, jit_ext

    fix = "take_autograd_function_apply_without_a_tensor_mask"
    apply_op = torch.ops.higher_order.autograd_function_apply
    lookasides = jit_ext._general_jit_lookaside_map
    thunders = lookasides[apply_op]
    wrap_const, unwrap = interpreter.wrap_const, interpreter.unwrap

    def older_form(fwd: Any, bwd: Any, *fwd_args: Any, **fwd_kwargs: Any) -> Any:
        if "args_tensor_mask" in fwd_kwargs:
            return thunders(fwd, bwd, *fwd_args, **fwd_kwargs)
        if unwrap(fwd_kwargs.get("dirty_idx", wrap_const([]))):
            return interpreter.do_raise(
                NotImplementedError(
                    "autograd_function_apply: a custom autograd.Function that marks an input dirty "
                    "(ctx.mark_dirty) is not supported by thunder; hint: return a new tensor instead of writing "
                    "into an input"
                )
            )
        kwargs = {**fwd_kwargs, "args_tensor_mask": wrap_const([True] * len(fwd_args))}
        fwd, bwd = (wrap_const(_dropping_the_context(unwrap(body))) for body in (fwd, bwd))
        result = thunders(fwd, bwd, *fwd_args, **kwargs)
        if result is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED or isinstance(unwrap(result), tuple):
            return result
        # thunder's op returns a lone output bare; the newer form's graph reads the outputs as a tuple
        record = interpreter.ProvenanceRecord(interpreter.PseudoInst.OPAQUE, inputs=[result.provenance])
        return interpreter.wrap((unwrap(result),), provenance=record)

    expects = expects_qualified("thunder.core.jit_ext._general_jit_torch_ops_higher_order_autograd_function_apply")
    patch(lookasides, apply_op, switched(fix, older_form, thunders), table=JIT_LOOKASIDES, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# dict.__getitem__ of a dict subclass that overrides it (transformers' ACT2FN)
# ---------------------------------------------------------------------------------------------------------
@installer("thunder-fix", "super().__getitem__(key) in a dict subclass's own __getitem__ reads the dict's item")
def read_dict_items_past_an_overriding_getitem() -> None:
    """thunder 0.2.6 interprets ``dict.__getitem__`` on a wrapped mapping as ``mapping[key]``, which runs the
    subclass's own ``__getitem__`` again: transformers' ``ACT2FN`` (a ``ClassInstantier``, whose ``__getitem__``
    returns ``super().__getitem__(key)`` instantiated) gave a new module where the stored class was expected
    ("value for silu out of sync", or the module called without its input): every model that picks its
    activation with ``ACT2FN[name](x)`` inside its forward (Qwen3-Next, Jamba, Bamba, Falcon-H1, ... : 12 of the
    zoo's 21 ``thunder.jit`` failures). Where this acts, the item is read with ``dict.__getitem__`` itself (which,
    as CPython's, still asks a subclass's ``__missing__``)."""
    from thunder.core import interpreter

    lookasides = interpreter._default_provenance_tracking_lookaside_map
    thunders = cast(Callable, lookasides[dict.__getitem__])

    def getitem(self: Any, key: Any) -> Any:
        mapping = self.value
        if not isinstance(mapping, dict) or type(mapping).__getitem__ is dict.__getitem__:
            return thunders(self, key)
        try:
            stored = dict.__getitem__(mapping, key.value)
        except Exception as e:
            return interpreter.do_raise(e)
        from thunder.core.proxies import Proxy

        interpreter.populate_single_dict_item_wrapper(stored, self, key if isinstance(key.value, Proxy) else key.value)
        return self.item_wrappers[key.value]

    expects = expects_qualified("thunder.core.interpreter.MutMappingWrapperMethods.__getitem__", "self", "key")
    replacement = switched("read_dict_items_past_an_overriding_getitem", getitem, thunders)
    patch(lookasides, dict.__getitem__, replacement, table=PROVENANCE_LOOKASIDES, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# The gradient of a CPU scalar tensor used beside larger tensors
# ---------------------------------------------------------------------------------------------------------
@installer("thunder-fix", "a CPU scalar tensor an op broadcast gets its gradient summed to its own shape")
def sum_the_gradients_of_broadcast_cpu_scalars() -> None:
    """thunder 0.2.6 takes a 0-dim CPU tensor in an elementwise op as a number: it is not broadcast (no
    ``broadcast_in_dim``, whose grad rule would sum the gradient back), so the op's grad rule puts a gradient of
    the result's shape for it, which nothing reduces. ``x.sum() * x`` then gets a wrong gradient, silently (the
    scalar's unreduced ``[4, 5]`` gradient is "expanded" to ``x``'s own shape by the sum's rule), and
    ``x[:, :2].sum() * x`` or ``torch.topk(x, 2)[0].sum() * x`` fail ("expand: attempting to expand a
    dimension of length 5"; Hunyuan-V4's router under both front ends). Where this acts, a gradient put for a CPU
    scalar tensor is summed over its dims (and given the scalar's dtype): what the broadcast's rule does for any
    other tensor. A gradient of another shape for a 0-dim tensor is never right, so only such puts change."""
    import thunder.core.transforms as transforms
    from thunder.core import utils

    thunders = transforms.put_grad

    def put_reduced_grad(grad_for: Any, grad: Any) -> Any:
        if (
            isinstance(grad, TensorProxy)
            and grad.ndim > 0
            and type(grad_for) is TensorProxy
            and utils.is_cpu_scalar_tensor(grad_for)
        ):
            grad = prims.sum(grad, tuple(range(grad.ndim)))
            if grad.dtype != grad_for.dtype:
                grad = prims.convert_element_type(grad, grad_for.dtype)
        return thunders(grad_for, grad)

    replacement = switched("sum_the_gradients_of_broadcast_cpu_scalars", put_reduced_grad, thunders)
    patch(transforms, "put_grad", replacement, expects=expects_identical(prims.put_grad))
