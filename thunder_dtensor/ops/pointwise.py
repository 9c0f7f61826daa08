"""Pointwise family: elementwise unary and binary ops, broadcasting and dtype conversion.

Each torch-level symbol (``dtensor_mul``) makes its operands agree first, with the two structural prims
``dtensor_convert_element_type_prim`` (type promotion) and ``dtensor_expand_prim`` (broadcasting), then
calls one elementwise prim on same-shape, same-dtype operands. Grad rules are written with dtensor prims,
so gradients carry the placements DTensor's propagation gives them, as in eager DTensor's backward.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor, register_method_for_dtensor
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol, define_vjp
from thunder_dtensor.proxy import DTensorProxy

import torch

ltorch = ti.ltorch


# ---------------------------------------------------------------------------------------------------------
# Structural prims: dtype conversion, broadcasting, and the reductions/views their grads need
# ---------------------------------------------------------------------------------------------------------
def _convert_execute(a: Any, dtype: Any) -> Any:
    return a.to(ti.dtypes.to_torch_dtype(dtype))


dtensor_convert_element_type_prim = define_dtensor_prim(
    "convert_element_type", lambda a, dtype: a.to(dtype), execute=_convert_execute
)


@define_vjp(dtensor_convert_element_type_prim)
def _convert_vjp(g, out, a, dtype):
    return (dtensor_convert_element_type_prim(g, a.dtype),)


def _torch_shape(shape: Any) -> tuple[int, ...]:
    return tuple(int(ti.pyval(s)) if isinstance(s, ti.NumberProxy) else int(s) for s in shape)


dtensor_expand_prim = define_dtensor_prim("expand", lambda a, shape: a.expand(shape))
dtensor_sum_prim = define_dtensor_prim("sum", lambda a, dims, keepdim: torch.sum(a, dims, keepdim=keepdim))
dtensor_reshape_prim = define_dtensor_prim("reshape", torch.reshape)


def sum_to_shape(g: DTensorProxy, shape: tuple[int, ...]) -> DTensorProxy:
    """Reduce a broadcast gradient back to ``shape``: sum over broadcast dims, as autograd's sum_to_size."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    lead = g.ndim - len(shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1]
    out = dtensor_sum_prim(g, dims, True) if dims else g
    return dtensor_reshape_prim(out, shape) if lead else out


@define_vjp(dtensor_expand_prim)
def _expand_vjp(g, out, a, shape):
    return (sum_to_shape(g, a.shape),)


@define_vjp(dtensor_sum_prim)
def _sum_vjp(g, out, a, dims, keepdim):
    if not keepdim:
        kept = list(a.shape)
        for d in dims:
            kept[d] = 1
        g = dtensor_reshape_prim(g, tuple(kept))
    return (dtensor_expand_prim(g, tuple(a.shape)),)


@define_vjp(dtensor_reshape_prim)
def _reshape_vjp(g, out, a, shape):
    return (dtensor_reshape_prim(g, tuple(a.shape)),)


# ---------------------------------------------------------------------------------------------------------
# Operand preparation (type promotion and broadcasting, with torch's rules)
# ---------------------------------------------------------------------------------------------------------
def _promotion_stand_in(x: Any) -> Any:
    if isinstance(x, ti.TensorProxy):
        return torch.empty((1,) * x.ndim, dtype=ti.dtypes.to_torch_dtype(x.dtype), device="meta")
    return ti.pyval(x) if isinstance(x, ti.NumberProxy) else x


def computation_dtype(*operands: Any) -> torch.dtype:
    """torch's promoted dtype of the operands (tensors by dtype and rank, Python scalars by kind)."""
    stand_ins = [_promotion_stand_in(x) for x in operands if x is not None]
    result = stand_ins[0] if len(stand_ins) == 1 else None
    if result is not None:
        return result.dtype if isinstance(result, torch.Tensor) else torch.tensor(result).dtype
    dtype = torch.result_type(stand_ins[0], stand_ins[1])
    for other in stand_ins[2:]:
        dtype = torch.result_type(torch.empty((), dtype=dtype, device="meta"), other)
    return dtype


def promote_operands(*operands: Any) -> list[Any]:
    """Convert DTensor operands to torch's promoted dtype of all the operands."""
    dtype = ti.dtypes.to_dtype(computation_dtype(*operands))
    return [
        dtensor_convert_element_type_prim(x, dtype) if isinstance(x, DTensorProxy) and x.dtype != dtype else x
        for x in operands
    ]


def broadcast_operands(*operands: Any) -> list[Any]:
    """Expand DTensor operands to their common broadcast shape."""
    shape = tuple(torch.broadcast_shapes(*(tuple(x.shape) for x in operands if isinstance(x, DTensorProxy))))
    return [
        dtensor_expand_prim(x, shape) if isinstance(x, DTensorProxy) and tuple(x.shape) != shape else x
        for x in operands
    ]


def prepare_operands(*operands: Any) -> list[Any]:
    """Convert DTensor operands to the promoted dtype and broadcast them to a common shape.

    Python scalars stay scalars (DTensor ops take them as they are); plain tensors are left for the prim,
    which accepts them exactly when eager DTensor does.
    """
    return broadcast_operands(*promote_operands(*operands))


# ---------------------------------------------------------------------------------------------------------
# Elementwise binary ops
# ---------------------------------------------------------------------------------------------------------
# operator.* rather than torch.*: they also take a Python scalar as the first operand (``1 - x``).
dtensor_add_prim = define_dtensor_prim("add", operator.add)
dtensor_sub_prim = define_dtensor_prim("sub", operator.sub)
dtensor_mul_prim = define_dtensor_prim("mul", operator.mul)
dtensor_div_prim = define_dtensor_prim("div", operator.truediv)
dtensor_pow_prim = define_dtensor_prim("pow", operator.pow)
dtensor_maximum_prim = define_dtensor_prim("maximum", torch.maximum)
dtensor_minimum_prim = define_dtensor_prim("minimum", torch.minimum)


@define_vjp(dtensor_add_prim)
def _add_vjp(g, out, a, b):
    return g, g


@define_vjp(dtensor_sub_prim)
def _sub_vjp(g, out, a, b):
    return g, dtensor_neg_prim(g)


@define_vjp(dtensor_mul_prim)
def _mul_vjp(g, out, a, b):
    return dtensor_mul_prim(g, b), dtensor_mul_prim(g, a)


@define_vjp(dtensor_div_prim)
def _div_vjp(g, out, a, b):
    grad_a = dtensor_div_prim(g, b)
    grad_b = None
    if isinstance(b, ti.TensorProxy):
        # d(a/b)/db = -a / b^2 = -(a/b)/b
        grad_b = dtensor_neg_prim(dtensor_mul_prim(g, dtensor_div_prim(dtensor_div_prim(a, b), b)))
    return grad_a, grad_b


@define_vjp(dtensor_pow_prim)
def _pow_vjp(g, out, a, b):
    grad_a = grad_b = None
    if isinstance(a, ti.TensorProxy):
        if isinstance(b, ti.TensorProxy):
            exponent_minus_one = dtensor_sub_prim(b, 1)
            grad_a = dtensor_mul_prim(g, dtensor_mul_prim(b, dtensor_pow_prim(a, exponent_minus_one)))
        else:
            b_val = ti.pyval(b)
            grad_a = (
                dtensor_mul_prim(g, dtensor_mul_prim(dtensor_pow_prim(a, b_val - 1), b_val)) if b_val != 0 else None
            )
    if isinstance(b, ti.TensorProxy):
        log_a = dtensor_log_prim(a) if isinstance(a, ti.TensorProxy) else math.log(ti.pyval(a))
        grad_b = dtensor_mul_prim(g, dtensor_mul_prim(out, log_a))
    return grad_a, grad_b


def _select_grad(mask_true: Any, g: Any) -> Any:
    return dtensor_where_prim(mask_true, g, 0.0)


@define_vjp(dtensor_maximum_prim)
def _maximum_vjp(g, out, a, b):
    # ties split the gradient evenly, as torch does
    return _minmax_grads(g, a, b, dtensor_gt_prim)


@define_vjp(dtensor_minimum_prim)
def _minimum_vjp(g, out, a, b):
    return _minmax_grads(g, a, b, dtensor_lt_prim)


def _minmax_grads(g, a, b, strictly_better):
    half = dtensor_mul_prim(g, 0.5)
    tie = dtensor_eq_prim(a, b)
    grad_a = dtensor_where_prim(strictly_better(a, b), g, dtensor_where_prim(tie, half, 0.0))
    grad_b = dtensor_where_prim(strictly_better(b, a), g, dtensor_where_prim(tie, half, 0.0))
    return grad_a, grad_b


# Comparisons (no gradient) and where
dtensor_eq_prim = define_dtensor_prim("eq", operator.eq)
dtensor_ne_prim = define_dtensor_prim("ne", operator.ne)
dtensor_lt_prim = define_dtensor_prim("lt", operator.lt)
dtensor_le_prim = define_dtensor_prim("le", operator.le)
dtensor_gt_prim = define_dtensor_prim("gt", operator.gt)
dtensor_ge_prim = define_dtensor_prim("ge", operator.ge)
dtensor_where_prim = define_dtensor_prim("where", torch.where)


@define_vjp(dtensor_where_prim)
def _where_vjp(g, out, cond, a, b):
    grad_a = dtensor_where_prim(cond, g, 0.0) if isinstance(a, ti.TensorProxy) else None
    grad_b = dtensor_where_prim(cond, 0.0, g) if isinstance(b, ti.TensorProxy) else None
    return None, grad_a, grad_b


# ---------------------------------------------------------------------------------------------------------
# Elementwise unary ops
# ---------------------------------------------------------------------------------------------------------
dtensor_neg_prim = define_dtensor_prim("neg", torch.neg)
dtensor_abs_prim = define_dtensor_prim("abs", torch.abs)
dtensor_exp_prim = define_dtensor_prim("exp", torch.exp)
dtensor_log_prim = define_dtensor_prim("log", torch.log)
dtensor_sqrt_prim = define_dtensor_prim("sqrt", torch.sqrt)
dtensor_rsqrt_prim = define_dtensor_prim("rsqrt", torch.rsqrt)
dtensor_reciprocal_prim = define_dtensor_prim("reciprocal", torch.reciprocal)
dtensor_tanh_prim = define_dtensor_prim("tanh", torch.tanh)
dtensor_sigmoid_prim = define_dtensor_prim("sigmoid", torch.sigmoid)
dtensor_sin_prim = define_dtensor_prim("sin", torch.sin)
dtensor_cos_prim = define_dtensor_prim("cos", torch.cos)
dtensor_erf_prim = define_dtensor_prim("erf", torch.erf)
dtensor_sign_prim = define_dtensor_prim("sign", torch.sign)
dtensor_relu_prim = define_dtensor_prim("relu", torch.relu)
dtensor_silu_prim = define_dtensor_prim("silu", torch.nn.functional.silu)


def _unary_vjp(prim: ti.Symbol, rule: Callable) -> None:
    define_vjp(prim)(lambda g, out, a: (rule(g, out, a),))


_unary_vjp(dtensor_neg_prim, lambda g, out, a: dtensor_neg_prim(g))
_unary_vjp(dtensor_abs_prim, lambda g, out, a: dtensor_mul_prim(g, dtensor_sign_prim(a)))
_unary_vjp(dtensor_exp_prim, lambda g, out, a: dtensor_mul_prim(g, out))
_unary_vjp(dtensor_log_prim, lambda g, out, a: dtensor_div_prim(g, a))
_unary_vjp(dtensor_sqrt_prim, lambda g, out, a: dtensor_div_prim(g, dtensor_mul_prim(out, 2)))
_unary_vjp(
    dtensor_rsqrt_prim,
    lambda g, out, a: dtensor_mul_prim(g, dtensor_mul_prim(dtensor_pow_prim(out, 3), -0.5)),
)
_unary_vjp(dtensor_reciprocal_prim, lambda g, out, a: dtensor_neg_prim(dtensor_mul_prim(g, dtensor_mul_prim(out, out))))
_unary_vjp(
    dtensor_tanh_prim,
    lambda g, out, a: dtensor_mul_prim(g, dtensor_sub_prim(1, dtensor_mul_prim(out, out))),
)
_unary_vjp(
    dtensor_sigmoid_prim,
    lambda g, out, a: dtensor_mul_prim(g, dtensor_mul_prim(out, dtensor_sub_prim(1, out))),
)
_unary_vjp(dtensor_sin_prim, lambda g, out, a: dtensor_mul_prim(g, dtensor_cos_prim(a)))
_unary_vjp(dtensor_cos_prim, lambda g, out, a: dtensor_neg_prim(dtensor_mul_prim(g, dtensor_sin_prim(a))))
_unary_vjp(
    dtensor_erf_prim,
    lambda g, out, a: dtensor_mul_prim(
        g, dtensor_mul_prim(dtensor_exp_prim(dtensor_neg_prim(dtensor_mul_prim(a, a))), 2.0 / math.sqrt(math.pi))
    ),
)
_unary_vjp(dtensor_relu_prim, lambda g, out, a: dtensor_where_prim(dtensor_gt_prim(out, 0), g, 0.0))


def _silu_grad(g, out, a):
    sig = dtensor_sigmoid_prim(a)
    # d/da a*s(a) = s(a) * (1 + a * (1 - s(a)))
    return dtensor_mul_prim(
        g, dtensor_mul_prim(sig, dtensor_add_prim(dtensor_mul_prim(a, dtensor_sub_prim(1, sig)), 1))
    )


_unary_vjp(dtensor_silu_prim, _silu_grad)


# ---------------------------------------------------------------------------------------------------------
# Torch-level symbols and their registration in the dispatch table
# ---------------------------------------------------------------------------------------------------------
def _binary(prim: ti.Symbol, a: Any, b: Any) -> Any:
    a, b = prepare_operands(a, b)
    return prim(a, b)


@define_dtensor_symbol
def dtensor_add(a, b, *, alpha=1):
    if alpha != 1:
        b = dtensor_mul(b, alpha)
    return _binary(dtensor_add_prim, a, b)


@define_dtensor_symbol
def dtensor_sub(a, b, *, alpha=1):
    if alpha != 1:
        b = dtensor_mul(b, alpha)
    return _binary(dtensor_sub_prim, a, b)


@define_dtensor_symbol
def dtensor_mul(a, b):
    return _binary(dtensor_mul_prim, a, b)


@define_dtensor_symbol
def dtensor_true_divide(a, b):
    return _binary(dtensor_div_prim, a, b)


@define_dtensor_symbol
def dtensor_div(a, b, *, rounding_mode=None):
    if rounding_mode is not None:  # floor / trunc division: eager DTensor's own rules
        from thunder_dtensor.ops.fallback import fallback_prim

        return fallback_prim(torch.div)(a, b, rounding_mode=rounding_mode)
    return _binary(dtensor_div_prim, a, b)


@define_dtensor_symbol
def dtensor_pow(a, b):
    return _binary(dtensor_pow_prim, a, b)


@define_dtensor_symbol
def dtensor_maximum(a, b):
    return _binary(dtensor_maximum_prim, a, b)


@define_dtensor_symbol
def dtensor_minimum(a, b):
    return _binary(dtensor_minimum_prim, a, b)


def _comparison(prim: ti.Symbol, name: str) -> ti.Symbol:
    def comparison(a, b):
        return _binary(prim, a, b)

    comparison.__name__ = f"dtensor_{name}"
    return define_dtensor_symbol(comparison)


@define_dtensor_symbol
def dtensor_where(cond, a, b):
    cond, a, b = _where_operands(cond, a, b)
    return dtensor_where_prim(cond, a, b)


def _where_operands(cond, a, b):
    # the condition takes part in broadcasting, not in type promotion
    return broadcast_operands(cond, *promote_operands(a, b))


@define_dtensor_symbol
def dtensor_clamp(a, min=None, max=None):
    ti.check(min is not None or max is not None, lambda: "torch.clamp on a DTensor: give min, max or both")
    out = a
    if min is not None:
        out = (
            dtensor_maximum_prim(*prepare_operands(out, min))
            if isinstance(min, ti.TensorProxy)
            else _clamp_scalar(out, min, dtensor_lt_prim)
        )
    if max is not None:
        out = (
            dtensor_minimum_prim(*prepare_operands(out, max))
            if isinstance(max, ti.TensorProxy)
            else _clamp_scalar(out, max, dtensor_gt_prim)
        )
    return out


def _clamp_scalar(a, bound, outside):
    # where(a outside bound, bound, a): the gradient flows where a is inside, as torch.clamp's does
    return dtensor_where_prim(outside(a, bound), bound, a)


def _unary(prim: ti.Symbol, name: str) -> ti.Symbol:
    def unary(a):
        return prim(a)

    unary.__name__ = f"dtensor_{name}"
    return define_dtensor_symbol(unary)


@define_dtensor_symbol
def dtensor_gelu(a, approximate="none"):
    if approximate == "tanh":
        # 0.5 * a * (1 + tanh(sqrt(2/pi) * (a + 0.044715 a^3)))
        inner = dtensor_mul_prim(
            dtensor_add_prim(a, dtensor_mul_prim(dtensor_pow_prim(a, 3), 0.044715)), math.sqrt(2.0 / math.pi)
        )
        return dtensor_mul_prim(dtensor_mul_prim(a, 0.5), dtensor_add_prim(dtensor_tanh_prim(inner), 1))
    ti.check(approximate == "none", lambda: f"gelu: unknown approximate={approximate!r}")
    # 0.5 * a * (1 + erf(a / sqrt(2)))
    return dtensor_mul_prim(
        dtensor_mul_prim(a, 0.5), dtensor_add_prim(dtensor_erf_prim(dtensor_mul_prim(a, 1.0 / math.sqrt(2.0))), 1)
    )


@define_dtensor_symbol
def dtensor_to_dtype(a, dtype):
    dtype = ti.dtypes.to_dtype(dtype)
    return a if a.dtype == dtype else dtensor_convert_element_type_prim(a, dtype)


def _to(a, *args, **kwargs):
    """``Tensor.to`` on a DTensor: dtype conversion (device moves are not supported on DTensors here)."""
    dtype = kwargs.get("dtype")
    for x in args:
        if isinstance(x, (torch.dtype, ti.dtypes.dtype)):
            dtype = x
        elif isinstance(x, ti.TensorProxy):
            dtype = x.dtype
        else:
            ti.check(False, lambda x=x: f"Tensor.to on a DTensor: only dtype conversion is supported, got {x!r}")
    return a if dtype is None else dtensor_to_dtype(a, dtype)


dtensor_to = define_dtensor_symbol(_to)


def _register() -> None:
    binary = {
        torch.add: (ltorch.add, dtensor_add),
        torch.sub: (ltorch.sub, dtensor_sub),
        torch.mul: (ltorch.mul, dtensor_mul),
        torch.true_divide: (ltorch.true_divide, dtensor_true_divide),
        torch.div: (ltorch.div, dtensor_div),
        torch.pow: (ltorch.pow, dtensor_pow),
        torch.maximum: (ltorch.maximum, dtensor_maximum),
        torch.minimum: (ltorch.minimum, dtensor_minimum),
        torch.where: (ltorch.where, dtensor_where),
        torch.clamp: (ltorch.clamp, dtensor_clamp),
    }
    for name, prim in {
        "eq": dtensor_eq_prim,
        "ne": dtensor_ne_prim,
        "lt": dtensor_lt_prim,
        "le": dtensor_le_prim,
        "gt": dtensor_gt_prim,
        "ge": dtensor_ge_prim,
    }.items():
        binary[getattr(torch, name)] = (getattr(ltorch, name), _comparison(prim, name))

    unary_prims = {
        "neg": dtensor_neg_prim,
        "abs": dtensor_abs_prim,
        "exp": dtensor_exp_prim,
        "log": dtensor_log_prim,
        "sqrt": dtensor_sqrt_prim,
        "rsqrt": dtensor_rsqrt_prim,
        "reciprocal": dtensor_reciprocal_prim,
        "tanh": dtensor_tanh_prim,
        "sigmoid": dtensor_sigmoid_prim,
        "sin": dtensor_sin_prim,
        "cos": dtensor_cos_prim,
        "erf": dtensor_erf_prim,
        "sign": dtensor_sign_prim,
        "relu": dtensor_relu_prim,
    }
    unary = {name: _unary(prim, name) for name, prim in unary_prims.items()}
    for name, symbol in unary.items():
        binary[getattr(torch, name)] = (getattr(ltorch, name), symbol)

    for torch_fn, (single, dtensor_symbol) in binary.items():
        register_function_for_dtensor(torch_fn, single, dtensor_symbol, is_method=True)

    silu = _unary(dtensor_silu_prim, "silu")
    register_function_for_dtensor(torch.nn.functional.silu, ltorch.silu, silu)
    register_function_for_dtensor(torch.nn.functional.gelu, ltorch.gelu, dtensor_gelu)
    # F.relu / F.sigmoid / F.tanh are the same ops as their torch-namespace twins
    for name in ("relu", "sigmoid", "tanh"):
        register_function_for_dtensor(getattr(torch.nn.functional, name), getattr(ltorch, name), unary[name])
    # operator methods that have no torch-namespace twin
    register_method_for_dtensor("to", dtensor_to)
    register_method_for_dtensor("float", _method_cast(torch.float32, "float"))
    register_method_for_dtensor("half", _method_cast(torch.float16, "half"))
    register_method_for_dtensor("bfloat16", _method_cast(torch.bfloat16, "bfloat16"))
    register_method_for_dtensor("type_as", define_dtensor_symbol(_type_as))


def _method_cast(dtype: torch.dtype, name: str) -> ti.Symbol:
    def cast(a):
        return dtensor_to_dtype(a, dtype)

    cast.__name__ = f"dtensor_{name}"
    return define_dtensor_symbol(cast)


def _type_as(a, other):
    return dtensor_to_dtype(a, other.dtype)


_register()


def accumulate_cotangents(a: Any, b: Any) -> Any:
    """How thunder's autodiff sums two cotangents of one value: dtensor add for DTensors, else thunder's."""
    if isinstance(a, DTensorProxy) or isinstance(b, DTensorProxy):
        return dtensor_add(a, b)
    return ltorch.add(a, b)
