"""torch's context-parallel state (``torch.distributed.tensor.experimental``), read at trace time.

``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` shards its buffers along the sequence with the
head-tail load balancer when it can, and turns on DTensor's context-parallel dispatch for the attention inside;
``set_rotate_method`` picks how k / v travel around the ring. Ring attention in a thunder program follows the
same state: it is read here, where the program is traced, and the prologue checks it on every call.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

RotateMethod = Literal["allgather", "alltoall"]


def _attention_module() -> Any:
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def context_parallel_dispatch_enabled() -> bool:
    """Whether torch's context-parallel attention dispatch is on (inside ``context_parallel`` or the module API)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    return torch.ops.aten._scaled_dot_product_flash_attention.default in handlers


def head_tail_layout() -> bool:
    """Whether sequence shards are in the load balancer's head-tail order (rank r holds chunks r and 2n-1-r).

    torch's ring attention reads its global option for this whenever its dispatch is on; outside that
    dispatch a sequence-sharded DTensor is what its placements say, contiguous chunks.
    """
    return context_parallel_dispatch_enabled() and bool(_attention_module()._cp_options.enable_load_balance)


def rotate_method() -> RotateMethod:
    """The k / v rotation ``set_rotate_method`` chose (torch's default: one all-gather)."""
    attention = _attention_module()
    return "alltoall" if attention._cp_options.rotate_method == attention._RotateMethod.ALL_TO_ALL else "allgather"
