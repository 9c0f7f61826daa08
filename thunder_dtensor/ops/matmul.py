"""Matmul family: ``F.linear`` and ``matmul`` of a 1-D input.

DTensor's rules give ``F.linear`` / ``matmul`` of a 1-D first operand whose result is Partial the global shape
``[1, N]`` (torch 2.13: its decomposition adds a batch dim and drops it from the local result only). The generic
path (``ops/fallback.py``) refuses a rule that gets the shape wrong and runs the op replicated, gathering both
operands (fuzz seed 7957). Here a 1-D input gets a batch dim of one, which the result loses again: DTensor's
rules hold for the 2-D op, the placements are eager's (a Partial result, no gather), the shape is torch's. Every
other call is the generic path's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thunder_dtensor.dispatch import dtensor_symbol_of, register_function_for_dtensor
from thunder_dtensor.ops.fallback import FallbackSymbol
from thunder_dtensor.proxy import DTensorProxy

import torch
import torch.nn.functional as F


def _is_vector(x: Any) -> bool:
    return isinstance(x, DTensorProxy) and x.ndim == 1


class _VectorAsOneRow:
    """``torch_fn`` (``F.linear`` or ``matmul``), a 1-D first operand given a batch dim of one for the call."""

    def __init__(self, torch_fn: Callable, other_name: str) -> None:
        self.generic = FallbackSymbol(torch_fn)
        self.name = self.generic.name
        self.other_name = other_name  # the second operand's keyword

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("input")
        other = args[1] if len(args) > 1 else kwargs.get(self.other_name)
        if not (_is_vector(first) and getattr(other, "ndim", 0) >= 2) or "out" in kwargs:
            return self.generic(*args, **kwargs)
        rest = args[2:] if args else ()
        kwargs = {k: v for k, v in kwargs.items() if k not in ("input", self.other_name)}
        row = dtensor_symbol_of(torch.unsqueeze)(first, 0)
        out = self.generic(row, other, *rest, **kwargs)
        return dtensor_symbol_of(torch.squeeze)(out, -2)  # the row: [1, N], or [..., 1, N] for a batched other


register_function_for_dtensor(F.linear, _VectorAsOneRow(F.linear, "weight"))
register_function_for_dtensor(torch.matmul, _VectorAsOneRow(torch.matmul, "other"), is_method=True)
