"""torch's functional collectives on plain tensors, by process group name, waited for.

Called where a dtensor prim's own torch function communicates outside DTensor's redistribution (ring attention,
FSDP2's flat buffers): run eagerly they return the result; traced by the lowering they record the
``_c10d_functional`` op and its ``wait_tensor``, which the lowered program then issues like DTensor's own. Names and
signatures differ across torch releases (``all_gather_single`` / ``reduce_scatter_single`` from 2.13).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

#: the reduce ops functional collectives take, by name
FunctionalReduceOp = Literal["sum", "avg", "product", "min", "max"]


def _funcol() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


def _waited(t: torch.Tensor) -> torch.Tensor:
    funcol = _funcol()
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t  # (traced: already waited)


def all_gather_dim0(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's ``t``, concatenated along dim 0."""
    funcol = _funcol()
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return _waited(gather(t, 0, group_name))


def reduce_scatter_dim0(t: torch.Tensor, group_name: str, op: FunctionalReduceOp = "sum") -> torch.Tensor:
    """This rank's chunk (dim 0) of every rank's ``t`` reduced with ``op``."""
    funcol = _funcol()
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return _waited(scatter(t, op, 0, group_name))


def all_reduce_tensor(t: torch.Tensor, group_name: str, op: FunctionalReduceOp = "sum") -> torch.Tensor:
    """Every rank's ``t`` reduced with ``op`` (a new tensor)."""
    return _waited(_funcol().all_reduce(t, op, group_name))


def all_to_all(t: torch.Tensor, receives: list[int], sends: list[int], group_name: str) -> torch.Tensor:
    """``t`` split by ``sends`` to each rank; what each rank sends here, ``receives`` elements from each."""
    return _waited(_funcol().all_to_all_single(t, receives, sends, group_name))
