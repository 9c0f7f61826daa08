"""Pointwise family: elementwise unary and binary ops, clamp, where, and dtype conversion.

One prim per torch op (``dtensor_mul_prim``, ``dtensor_clamp_prim``), called on the operands as the user
gave them: DTensor's own sharding propagation broadcasts and promotes them, at trace time in the meta and
at run time in the op, so nothing here re-implements those rules. Grad rules are written with dtensor
prims, so gradients carry the placements DTensor's propagation gives them, as in eager DTensor's backward;
like autograd's engine, a gradient is then summed to its operand's shape and cast to its dtype
(:func:`grad_for_operand`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor, register_method_for_dtensor
from thunder_dtensor.errors import DTensorOpError, first_line
from thunder_dtensor.primitive import (
    define_dtensor_prim,
    define_dtensor_symbol,
    define_vjp,
    is_runtime_number,
    propagate_on_fake_dtensors,
)
from thunder_dtensor.proxy import DTensorProxy, is_zero_cotangent_of

import torch

ltorch = ti.ltorch


# ---------------------------------------------------------------------------------------------------------
# Structural prims: dtype conversion and broadcasting, and autograd's reduction of broadcast gradients
# ---------------------------------------------------------------------------------------------------------
def _convert_execute(a: Any, dtype: Any) -> Any:
    return a.to(ti.dtypes.to_torch_dtype(dtype))


dtensor_convert_element_type_prim = define_dtensor_prim(
    "convert_element_type", lambda a, dtype: a.to(dtype), execute=_convert_execute
)


@define_vjp(dtensor_convert_element_type_prim)
def _convert_vjp(g, out, a, dtype):
    return (dtensor_convert_element_type_prim(g, a.dtype),)


dtensor_expand_prim = define_dtensor_prim("expand", lambda a, shape: a.expand(shape))
dtensor_sum_to_size_prim = define_dtensor_prim("sum_to_size", lambda a, shape: a.sum_to_size(shape))


@define_vjp(dtensor_expand_prim)
def _expand_vjp(g, out, a, shape):
    return (sum_to_shape(g, tuple(a.shape)),)


@define_vjp(dtensor_sum_to_size_prim)
def _sum_to_size_vjp(g, out, a, shape):
    return (dtensor_expand_prim(g, tuple(a.shape)),)


def sum_to_shape(g: DTensorProxy, shape: tuple[int, ...]) -> DTensorProxy:
    """Reduce a broadcast gradient back to ``shape`` (torch's ``sum_to_size``, run by DTensor)."""
    return g if tuple(g.shape) == tuple(shape) else dtensor_sum_to_size_prim(g, tuple(shape))


def grad_for_operand(grad: Any, operand: Any) -> Any:
    """An elementwise op's gradient for one operand, as autograd hands it over.

    The ops run on operands of different shapes and dtypes (DTensor broadcasts and promotes them itself);
    like autograd's engine, the gradient computed at the output's shape and dtype is summed over the
    broadcast dims (``sum_to_size``) and cast back to the operand's dtype. Non-tensor operands get none.
    """
    if not isinstance(operand, ti.TensorProxy) or grad is None:
        return None
    grad = sum_to_shape(grad, tuple(operand.shape))
    if grad.dtype != operand.dtype:
        grad = dtensor_convert_element_type_prim(grad, operand.dtype)
    return grad


# ---------------------------------------------------------------------------------------------------------
# Elementwise binary ops
# ---------------------------------------------------------------------------------------------------------
# operator.* rather than torch.*: they also take a Python scalar as the first operand (``1 - x``).
def refusing_a_number_into_a_partial_sum(name: str, torch_fn: Callable) -> Callable:
    """The meta of ``a + b`` / ``a - b`` (``add_``, ...): the fake run, refusing a number added to a Partial(sum).

    ``Partial(sum) + c`` is ``Replicate`` after a reduction (torch >= 2.12's rule). torch 2.10's rule keeps
    the output Partial(sum), so every rank adds ``c`` and the sum is off by ``(ranks - 1) * c``, in eager
    DTensor too: a wrong value, refused here at trace time instead.
    """
    prim_name = f"dtensor_{name}_prim"

    def meta(a: Any, b: Any, **kwargs: Any) -> Any:
        out = propagate_on_fake_dtensors(prim_name, torch_fn, (a, b), kwargs)
        number = next((x for x in (a, b) if isinstance(x, (int, float)) and not isinstance(x, bool)), 0)
        tensor = a if isinstance(a, DTensorProxy) else b
        if number and isinstance(tensor, DTensorProxy) and _keeps_a_partial_sum(tensor, out):
            raise DTensorOpError(
                prim_name,
                (a, b),
                kwargs,
                f"torch {torch.__version__}'s DTensor adds the number {number} to every rank's addend of a "
                "Partial(sum) value and keeps it Partial(sum): the sum would be off by (ranks - 1) times it",
                hint="reduce the value first (x.redistribute(mesh, [Replicate()])) or use torch >= 2.12, whose "
                "DTensor does that itself",
            )
        return out

    return meta


def _keeps_a_partial_sum(tensor: DTensorProxy, out: Any) -> bool:
    def is_sum(p: Any) -> bool:
        return isinstance(p, ti.Partial) and p.reduce_op == "sum"

    if not isinstance(out, DTensorProxy):
        return False
    return any(is_sum(p) and is_sum(q) for p, q in zip(tensor.placements, out.placements))


def _div_grads(g, out, a, b):
    grad_b = None
    if isinstance(b, ti.TensorProxy):  # d(a/b)/db = -a / b^2 = -(a/b)/b
        grad_b = dtensor_neg_prim(dtensor_mul_prim(g, dtensor_div_prim(dtensor_div_prim(a, b), b)))
    return dtensor_div_prim(g, b), grad_b


def _pow_grads(g, out, a, b):
    grad_a = grad_b = None
    if isinstance(a, ti.TensorProxy):
        if isinstance(b, ti.TensorProxy):
            grad_a = dtensor_mul_prim(g, dtensor_mul_prim(b, dtensor_pow_prim(a, dtensor_sub_prim(b, 1))))
        elif ti.pyval(b) != 0:
            b_val = ti.pyval(b)
            grad_a = dtensor_mul_prim(g, dtensor_mul_prim(dtensor_pow_prim(a, b_val - 1), b_val))
    if isinstance(b, ti.TensorProxy):
        log_a = dtensor_log_prim(a) if isinstance(a, ti.TensorProxy) else math.log(ti.pyval(a))
        grad_b = dtensor_mul_prim(g, dtensor_mul_prim(out, log_a))
    return grad_a, grad_b


def _minmax_grads(strictly_better: ti.Symbol) -> Callable:
    # the strictly better operand takes the gradient; ties split it evenly, as torch's maximum/minimum do
    def grads(g, out, a, b):
        tie_share = dtensor_where_prim(dtensor_eq_prim(a, b), dtensor_mul_prim(g, 0.5), 0.0)
        grad_a = dtensor_where_prim(strictly_better(a, b), g, tie_share)
        grad_b = dtensor_where_prim(strictly_better(b, a), g, tie_share)
        return grad_a, grad_b

    return grads


# where (the comparisons it is used with are binary ops, below)
dtensor_where_prim = define_dtensor_prim("where", torch.where)


@define_vjp(dtensor_where_prim)
def _where_vjp(g, out, cond, a, b):
    grad_a = dtensor_where_prim(cond, g, 0.0) if isinstance(a, ti.TensorProxy) else None
    grad_b = dtensor_where_prim(cond, 0.0, g) if isinstance(b, ti.TensorProxy) else None
    return None, grad_for_operand(grad_a, a), grad_for_operand(grad_b, b)


# ---------------------------------------------------------------------------------------------------------
# Torch-level symbols and their registration in the dispatch table
# ---------------------------------------------------------------------------------------------------------
def _refuse_out(name: str, args: tuple, out: Any) -> None:
    """``out=`` on a DTensor op: refused at trace time (thunder takes none for plain tensors either)."""
    if out is not None:
        raise DTensorOpError(
            f"dtensor_{name}",
            args,
            {"out": out},
            f"torch.{name}'s out= argument is not supported inside a thunder program (the result would not be "
            "written into it)",
            hint=f"assign the result instead: y = torch.{name}(...)",
        )


def _as_positional(name: str, params: tuple[str, ...], args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` of a call of ``torch.<name>(*params, *, out=None)`` as positional arguments.

    torch's own parameter names are taken as keywords (``torch.pow(x, exponent=2)``); ``out=`` is refused.
    """
    kwargs = dict(kwargs)
    out = kwargs.pop("out", None)
    unknown = [k for k in kwargs if k not in params[len(args) :]]
    if len(args) > len(params) or unknown:
        raise TypeError(f"{name}() got unexpected arguments: {len(args)} positional, keywords {unknown}")
    missing = [p for p in params[len(args) :] if p not in kwargs]
    if missing:
        raise TypeError(f"{name}() missing arguments: {missing}")
    args = tuple(args) + tuple(kwargs[p] for p in params[len(args) :])
    _refuse_out(name, args, out)
    return args


def _tensor_stand_in(x: Any) -> Any:
    """A tiny real tensor of ``x``'s dtype and dimensionality class (0-dim or not), or ``x`` itself."""
    if isinstance(x, ti.TensorProxy):
        return torch.empty((0,) if x.ndim else (), dtype=ti.dtypes.to_torch_dtype(x.dtype))
    return ti.pyval(x) if isinstance(x, ti.NumberProxy) else x


def _scaled_by_alpha(name: str, a: Any, b: Any, alpha: Any) -> Any:
    """``alpha * b`` for ``torch.add`` / ``torch.sub``; an ``alpha`` torch refuses for these dtypes is refused here.

    torch rejects a floating ``alpha`` for integral inputs and a bool one for non-bool results: it is asked, on
    empty tensors of the operands' dtypes.
    """
    if is_runtime_number(alpha):  # its value is known at run time only: torch checks it there
        return dtensor_mul(b, alpha)
    value = ti.pyval(alpha) if isinstance(alpha, ti.NumberProxy) else alpha
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1:
        return b
    try:
        getattr(torch, name)(_tensor_stand_in(a), _tensor_stand_in(b), alpha=value)
    except (RuntimeError, TypeError) as error:
        raise DTensorOpError(
            f"dtensor_{name}",
            (a, b),
            {"alpha": value},
            f"torch.{name} refuses alpha={value!r} for these operands: {first_line(error)}",
            hint="pass an alpha of the operands' kind (an integer for integral tensors, a bool for bool ones)",
        ) from error
    return dtensor_mul(b, alpha)


@define_dtensor_symbol
def dtensor_add(input, other, *, alpha=1, out=None):
    _refuse_out("add", (input, other), out)
    return dtensor_add_prim(input, _scaled_by_alpha("add", input, other, alpha))


@define_dtensor_symbol
def dtensor_sub(input, other, *, alpha=1, out=None):
    _refuse_out("sub", (input, other), out)
    return dtensor_sub_prim(input, _scaled_by_alpha("sub", input, other, alpha))


@define_dtensor_symbol
def dtensor_mul(input, other, *, out=None):
    _refuse_out("mul", (input, other), out)
    return dtensor_mul_prim(input, other)


@define_dtensor_symbol
def dtensor_true_divide(input, other, *, out=None):
    _refuse_out("true_divide", (input, other), out)
    return dtensor_div_prim(input, other)


@define_dtensor_symbol
def dtensor_div(input, other, *, rounding_mode=None, out=None):
    _refuse_out("div", (input, other), out)
    if rounding_mode is not None:  # floor / trunc division: eager DTensor's own rules
        from thunder_dtensor.ops.fallback import fallback_prim

        return fallback_prim(torch.div)(input, other, rounding_mode=rounding_mode)
    return dtensor_div_prim(input, other)


def _symbol_for(prim: ti.Symbol, name: str, params: tuple[str, ...] = ("input", "other")) -> ti.Symbol:
    """The torch-level symbol of one elementwise prim: DTensor itself promotes and broadcasts the operands.

    It takes torch's parameter names (``params``) as keywords too, and refuses ``out=``.
    """

    def call(*args, **kwargs):
        return prim(*_as_positional(name, params, args, kwargs))

    call.__name__ = f"dtensor_{name}"
    return define_dtensor_symbol(call)


# ---------------------------------------------------------------------------------------------------------
# Elementwise binary ops: one statement each
# ---------------------------------------------------------------------------------------------------------
def binary_op(
    name: str,
    torch_fn: Callable,
    grads: Callable | None = None,
    *,
    params: tuple[str, ...] = ("input", "other"),
    meta: Callable | None = None,
    symbol: ti.Symbol | None = None,
) -> ti.Symbol:
    """One elementwise binary op, everything about it: ``dtensor_<name>_prim`` (its meta DTensor's sharding
    propagation, or ``meta``; its execution ``torch_fn`` on DTensors, which broadcast and promote their operands
    themselves; lowered like any prim), its grad rule ``grads(g, out, a, b) -> (grad_a, grad_b)`` at the output's
    shape, each reduced to its operand's shape and dtype as autograd does (None: eager DTensor's own backward), its
    torch-level symbol (``symbol``, else one taking torch's ``params`` as keywords and refusing ``out=``) and its
    dispatch entries ``torch.<name>`` and ``Tensor.<name>`` (operators included)."""
    prim = define_dtensor_prim(name, torch_fn, meta=meta)
    if grads is not None:
        rule = grads

        @define_vjp(prim)
        def vjp(g, out, a, b):
            grad_a, grad_b = rule(g, out, a, b)
            return grad_for_operand(grad_a, a), grad_for_operand(grad_b, b)

    register_function_for_dtensor(getattr(torch, name), symbol or _symbol_for(prim, name, params), is_method=True)
    return prim


# operator.* rather than torch.*: they also take a Python scalar as the first operand (``1 - x``).
dtensor_add_prim: ti.Symbol = binary_op(
    "add",
    operator.add,
    lambda g, out, a, b: (g, g),
    meta=refusing_a_number_into_a_partial_sum("add", operator.add),
    symbol=dtensor_add,
)
dtensor_sub_prim: ti.Symbol = binary_op(
    "sub",
    operator.sub,
    lambda g, out, a, b: (g, dtensor_neg_prim(g)),
    meta=refusing_a_number_into_a_partial_sum("sub", operator.sub),
    symbol=dtensor_sub,
)
dtensor_mul_prim: ti.Symbol = binary_op(
    "mul", operator.mul, lambda g, out, a, b: (dtensor_mul_prim(g, b), dtensor_mul_prim(g, a)), symbol=dtensor_mul
)
dtensor_div_prim: ti.Symbol = binary_op("div", operator.truediv, _div_grads, symbol=dtensor_div)
dtensor_pow_prim: ti.Symbol = binary_op("pow", operator.pow, _pow_grads, params=("input", "exponent"))
# comparisons: no gradient flows back (eager's backward gives none)
dtensor_eq_prim = binary_op("eq", operator.eq)
dtensor_ne_prim = binary_op("ne", operator.ne)
dtensor_lt_prim = binary_op("lt", operator.lt)
dtensor_le_prim = binary_op("le", operator.le)
dtensor_gt_prim = binary_op("gt", operator.gt)
dtensor_ge_prim = binary_op("ge", operator.ge)
dtensor_maximum_prim = binary_op("maximum", torch.maximum, _minmax_grads(dtensor_gt_prim))
dtensor_minimum_prim = binary_op("minimum", torch.minimum, _minmax_grads(dtensor_lt_prim))


# ---------------------------------------------------------------------------------------------------------
# Elementwise unary ops: one statement each
# ---------------------------------------------------------------------------------------------------------
def unary_op(
    name: str,
    torch_fn: Callable,
    grad: Callable | None = None,
    *,
    functions: tuple[Callable, ...] | None = None,
    also: tuple[Callable, ...] = (),
) -> ti.Symbol:
    """One elementwise unary op, everything about it: ``dtensor_<name>_prim`` (its meta DTensor's sharding
    propagation, its execution ``torch_fn`` on DTensors, lowered like any prim), its grad rule ``grad(g, out, a)``
    (None: eager DTensor's own backward, traced), its torch-level symbol ``dtensor_<name>`` (``input=`` taken as
    a keyword, ``out=`` refused) and its dispatch entries: ``torch.<name>`` and ``Tensor.<name>`` (or each of
    ``functions`` with its method), and each function of ``also`` (``F.relu``)."""
    prim = define_dtensor_prim(name, torch_fn)
    if grad is not None:
        rule = grad
        define_vjp(prim)(lambda g, out, a: (rule(g, out, a),))
    symbol = _symbol_for(prim, name, ("input",))
    for fn in (getattr(torch, name),) if functions is None else functions:
        register_function_for_dtensor(fn, symbol, is_method=True)
    for fn in also:
        register_function_for_dtensor(fn, symbol)
    return prim


# Where eager's backward is a fused ATen op (derivatives.yaml: tanh_backward, sigmoid_backward,
# threshold_backward, silu_backward), the rule calls that op: DTensor's strategy for it decides the gradient's
# placements (a Partial cotangent is reduced first: the op is pointwise, not linear), not a hand decomposition
# into mul (which keeps Partial).
dtensor_tanh_backward_prim = define_dtensor_prim("tanh_backward", torch.ops.aten.tanh_backward.default)
dtensor_sigmoid_backward_prim = define_dtensor_prim("sigmoid_backward", torch.ops.aten.sigmoid_backward.default)
dtensor_threshold_backward_prim = define_dtensor_prim("threshold_backward", torch.ops.aten.threshold_backward.default)
dtensor_silu_backward_prim = define_dtensor_prim("silu_backward", torch.ops.aten.silu_backward.default)
dtensor_neg_prim: ti.Symbol = unary_op("neg", torch.neg, lambda g, out, a: dtensor_neg_prim(g))
dtensor_abs_prim = unary_op("abs", torch.abs, lambda g, out, a: dtensor_mul_prim(g, dtensor_sign_prim(a)))
dtensor_exp_prim = unary_op("exp", torch.exp, lambda g, out, a: dtensor_mul_prim(g, out))
dtensor_log_prim = unary_op("log", torch.log, lambda g, out, a: dtensor_div_prim(g, a))
dtensor_sqrt_prim = unary_op("sqrt", torch.sqrt, lambda g, out, a: dtensor_div_prim(g, dtensor_mul_prim(out, 2)))
dtensor_rsqrt_prim = unary_op(
    "rsqrt", torch.rsqrt, lambda g, out, a: dtensor_mul_prim(g, dtensor_mul_prim(dtensor_pow_prim(out, 3), -0.5))
)
dtensor_reciprocal_prim = unary_op(
    "reciprocal", torch.reciprocal, lambda g, out, a: dtensor_neg_prim(dtensor_mul_prim(g, dtensor_mul_prim(out, out)))
)
dtensor_tanh_prim = unary_op(
    "tanh", torch.tanh, lambda g, out, a: dtensor_tanh_backward_prim(g, out), also=(torch.nn.functional.tanh,)
)
dtensor_sigmoid_prim = unary_op(
    "sigmoid",
    torch.sigmoid,
    lambda g, out, a: dtensor_sigmoid_backward_prim(g, out),
    also=(torch.nn.functional.sigmoid,),
)
dtensor_sin_prim = unary_op("sin", torch.sin, lambda g, out, a: dtensor_mul_prim(g, dtensor_cos_prim(a)))
dtensor_cos_prim: ti.Symbol = unary_op(
    "cos", torch.cos, lambda g, out, a: dtensor_neg_prim(dtensor_mul_prim(g, dtensor_sin_prim(a)))
)
dtensor_erf_prim = unary_op(
    "erf",
    torch.erf,
    lambda g, out, a: dtensor_mul_prim(
        g, dtensor_mul_prim(dtensor_exp_prim(dtensor_neg_prim(dtensor_mul_prim(a, a))), 2.0 / math.sqrt(math.pi))
    ),
)
dtensor_sign_prim: ti.Symbol = unary_op("sign", torch.sign)
dtensor_relu_prim = unary_op(
    "relu", torch.relu, lambda g, out, a: dtensor_threshold_backward_prim(g, out, 0), also=(torch.nn.functional.relu,)
)
dtensor_silu_prim = unary_op(
    "silu",
    torch.nn.functional.silu,
    lambda g, out, a: dtensor_silu_backward_prim(g, a),
    functions=(),
    also=(torch.nn.functional.silu,),
)


def _where_method(self, condition, other):
    """``x.where(condition, y)`` is ``torch.where(condition, x, y)``."""
    return dtensor_where_prim(condition, self, other)


_where_method.__name__ = "dtensor_Tensor_where"


# clamp is one prim, not maximum/minimum: at ties torch gives the whole gradient to the input, none to a bound
dtensor_clamp_prim = define_dtensor_prim("clamp", torch.clamp)


@define_vjp(dtensor_clamp_prim)
def _clamp_vjp(g, out, a, min=None, max=None):
    # torch's clamp backward: the input where it lies within the bounds; a bound where it was applied
    # (with both tensor bounds and min > max, the result is max)
    within = None
    grad_min = grad_max = None
    if min is not None:
        within = dtensor_ge_prim(a, min)
    if max is not None:
        below_max = dtensor_le_prim(a, max)
        within = below_max if within is None else dtensor_logical_and_prim(within, below_max)
    grad_a = dtensor_where_prim(within, g, 0.0)
    if isinstance(min, ti.TensorProxy):
        applied = dtensor_lt_prim(a, min)
        if max is not None:
            applied = dtensor_logical_and_prim(applied, dtensor_lt_prim(min, max))
        grad_min = dtensor_where_prim(applied, g, 0.0)
    if isinstance(max, ti.TensorProxy):
        applied = dtensor_gt_prim(a, max)
        if min is not None:
            applied = dtensor_logical_or_prim(applied, dtensor_lt_prim(max, min))
        grad_max = dtensor_where_prim(applied, g, 0.0)
    return grad_for_operand(grad_a, a), grad_for_operand(grad_min, min), grad_for_operand(grad_max, max)


dtensor_logical_and_prim = define_dtensor_prim("logical_and", torch.logical_and, differentiable=False)
dtensor_logical_or_prim = define_dtensor_prim("logical_or", torch.logical_or, differentiable=False)


@define_dtensor_symbol
def dtensor_clamp(input, min=None, max=None, *, out=None):
    ti.check(min is not None or max is not None, lambda: "torch.clamp on a DTensor: give min, max or both")
    _refuse_out("clamp", (input, min, max), out)
    return dtensor_clamp_prim(input, min, max)


# gelu is one prim, and its gradient eager's fused ``gelu_backward``: DTensor's rules for the op itself decide
# the placements (a Partial input is reduced first: gelu is not linear), not a decomposition into mul / erf,
# which kept the output Partial.
dtensor_gelu_prim = define_dtensor_prim(
    "gelu", lambda a, approximate="none": torch.nn.functional.gelu(a, approximate=approximate)
)
dtensor_gelu_backward_prim = define_dtensor_prim(
    "gelu_backward", lambda g, a, approximate: torch.ops.aten.gelu_backward.default(g, a, approximate=approximate)
)


@define_vjp(dtensor_gelu_prim)
def _gelu_vjp(g, out, a, approximate="none"):
    return (dtensor_gelu_backward_prim(g, a, approximate),)


@define_dtensor_symbol
def dtensor_gelu(input, approximate="none"):
    ti.check(approximate in ("none", "tanh"), lambda: f"gelu: unknown approximate={approximate!r}")
    return dtensor_gelu_prim(input, approximate)


@define_dtensor_symbol
def dtensor_to_dtype(a, dtype):
    dtype = ti.dtypes.to_dtype(dtype)
    return a if a.dtype == dtype else dtensor_convert_element_type_prim(a, dtype)


def _is_dtype(x: Any) -> bool:
    return isinstance(x, (torch.dtype, ti.dtypes.dtype))


def _is_device(x: Any) -> bool:
    return isinstance(x, (str, int, torch.device, ti.devices.Device))


def _same_device(a: Any, device: Any) -> bool:
    """Whether ``device`` names ``a``'s device (an index left out names the current one, as in torch)."""
    have = cast(torch.device, ti.devices.to_torch_device(a.device))  # (a proxy has a device)
    want = cast(  # (a Device is a device)
        torch.device,
        ti.devices.to_torch_device(device) if isinstance(device, ti.devices.Device) else torch.device(device),
    )
    return want.type == have.type and (want.index is None or want.index == have.index)


def _to(a, *args, **kwargs):
    """``Tensor.to`` on a DTensor, in each of its forms: ``to(dtype, non_blocking, copy)``, ``to(device, dtype,
    non_blocking, copy)``, ``to(other, non_blocking, copy)``, each with ``memory_format=``.

    A dtype conversion is the conversion prim (``non_blocking`` changes nothing without a device move); with
    ``copy=True`` or a memory format it is eager's ``Tensor.to`` on the DTensor (a fresh tensor where eager makes
    one). A device move is refused: a DTensor's device is its mesh's.
    """
    args, kwargs = list(args), dict(kwargs)
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    if args and isinstance(args[0], ti.TensorProxy):
        other = args.pop(0)
        device, dtype = other.device, other.dtype
    elif args and _is_dtype(args[0]):
        dtype = args.pop(0)
    elif args and (args[0] is None or _is_device(args[0])):
        device = args.pop(0)
        if args and (args[0] is None or _is_dtype(args[0])):
            dtype = args.pop(0)
    if len(args) > 2 or any(not isinstance(x, bool) for x in args):
        raise TypeError(f"Tensor.to() got unexpected positional arguments {args}")
    flags = {**dict(zip(("non_blocking", "copy"), args)), **kwargs}
    unknown = set(flags) - {"non_blocking", "copy", "memory_format"}
    if unknown:
        raise TypeError(f"Tensor.to() got unexpected keyword arguments {sorted(unknown)}")
    if device is not None and not _same_device(a, device):
        raise DTensorOpError(
            "dtensor_to",
            (a,),
            {"device": device},
            f"a device move ({a.device} -> {device}) of a DTensor, whose device is its mesh's",
            hint="distribute the tensor on a mesh of that device (distribute_tensor(x.full_tensor(), mesh, "
            "placements)) outside the thunder program",
        )
    copy, memory_format = bool(flags.get("copy", False)), flags.get("memory_format")
    if not copy and memory_format in (None, torch.preserve_format):
        return a if dtype is None else dtensor_to_dtype(a, dtype)
    # a copy, or a layout: eager's Tensor.to (aten._to_copy) run by DTensor
    from thunder_dtensor.ops.fallback import FallbackSymbol

    dtype = ti.dtypes.to_torch_dtype(ti.dtypes.to_dtype(dtype if dtype is not None else a.dtype))
    options = {"copy": copy} | ({} if memory_format is None else {"memory_format": memory_format})
    return FallbackSymbol(torch.Tensor.to)(a, dtype, **options)


dtensor_to = define_dtensor_symbol(_to)


def _register() -> None:
    # true_divide is div; where and clamp take three operands
    register_function_for_dtensor(torch.true_divide, dtensor_true_divide, is_method=True)
    where = _symbol_for(dtensor_where_prim, "where", ("condition", "input", "other"))
    register_function_for_dtensor(torch.where, where, is_method=True)
    register_function_for_dtensor(torch.clamp, dtensor_clamp, is_method=True)
    register_function_for_dtensor(torch.nn.functional.gelu, dtensor_gelu)
    # operator methods that have no torch-namespace twin
    register_method_for_dtensor("to", dtensor_to)
    register_method_for_dtensor("float", _method_cast(torch.float32, "float"))
    register_method_for_dtensor("half", _method_cast(torch.float16, "half"))
    register_method_for_dtensor("bfloat16", _method_cast(torch.bfloat16, "bfloat16"))
    register_method_for_dtensor("type_as", define_dtensor_symbol(_type_as))
    # x.where(condition, y) is torch.where(condition, x, y): not the function's argument order
    register_method_for_dtensor("where", define_dtensor_symbol(_where_method))


def _method_cast(dtype: torch.dtype, name: str) -> ti.Symbol:
    """``x.float()`` & co.: a dtype conversion; with a ``memory_format``, ``x.to(dtype, memory_format=...)``."""

    def cast(a, memory_format=None):
        if memory_format in (None, torch.preserve_format):
            return dtensor_to_dtype(a, dtype)
        return _to(a, dtype, memory_format=memory_format)

    cast.__name__ = f"dtensor_{name}"
    return define_dtensor_symbol(cast)


def _type_as(a, other):
    """``x.type_as(y)``: ``y``'s dtype (and device type: a move is refused, as in ``Tensor.to``)."""
    return _to(a, other)


_register()


def accumulate_cotangents(a: Any, b: Any) -> Any:
    """How thunder's autodiff sums two cotangents of one value: dtensor add for DTensors, else thunder's.

    A zero cotangent autodiff made (a value overwritten in place, an unused output) adds nothing: eager has no
    such term, and adding it would give the sum the zeros' placements instead of the gradient's. (Where the
    zero is still a stand-in here, ``guards.propagate_gradient_specs`` drops it once it is known.)
    """
    if is_zero_cotangent_of(a, like=b):
        return b
    if is_zero_cotangent_of(b, like=a):
        return a
    if isinstance(a, DTensorProxy) or isinstance(b, DTensorProxy):
        return dtensor_add(a, b)
    return ltorch.add(a, b)
