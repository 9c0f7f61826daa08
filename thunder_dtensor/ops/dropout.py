"""Random family: dropout on DTensors.

The mask is drawn once, in the forward, by DTensor's own random-op machinery (every shard gets its slice
of one global random tensor, reproducible under ``torch.manual_seed``), and the backward reuses it; a
recomputing gradient would draw a different mask. ``inplace=True`` writes this value into the input
(``ops/inplace.py``, which registers ``F.dropout``'s dispatch for both).
"""

from __future__ import annotations

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor
from thunder_dtensor.ops.pointwise import dtensor_convert_element_type_prim, dtensor_mul_prim
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol, define_vjp

import torch
import torch.nn.functional as F


def _native_dropout(a, p: float):
    return torch.ops.aten.native_dropout(a, p, True)


#: (output, keep-mask): output = a * mask / (1 - p)
dtensor_native_dropout_prim = define_dtensor_prim("native_dropout", _native_dropout)


@define_vjp(dtensor_native_dropout_prim)
def _native_dropout_vjp(g, out, a, p):
    g_out, _ = g
    keep = dtensor_convert_element_type_prim(out[1], a.dtype)
    return (dtensor_mul_prim(dtensor_mul_prim(g_out, keep), 1.0 / (1.0 - p)),)


@define_dtensor_symbol
def dtensor_dropout(input, p=0.5, training=True, inplace=False):
    # F.dropout(x, inplace=True) is dispatched to an in-place symbol computed by this one (ops/inplace.py)
    ti.check(not inplace, lambda: "dtensor_dropout: inplace=True goes through the in-place symbol (ops/inplace.py)")
    ti.check(0.0 <= p <= 1.0, lambda: f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return dtensor_mul_prim(input, 0.0)
    out, _mask = dtensor_native_dropout_prim(input, p)
    return out


register_function_for_dtensor(F.dropout, dtensor_dropout)


@define_dtensor_symbol
def dtensor_torch_dropout(input, p, train):
    """``torch.dropout(x, p, train)``: the same op as ``F.dropout``, taken by ``dtensor_dropout`` so that
    ``train=False`` (or ``p=0``) returns the input as eager's kernel does: DTensor's propagation on fake tensors runs
    the Python decomposition instead and places the result ``Replicate`` where eager keeps a ``Partial`` (fuzz seed
    9190)."""
    return dtensor_dropout(input, p, train)


register_function_for_dtensor(torch.dropout, dtensor_torch_dropout)
