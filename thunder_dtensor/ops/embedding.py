"""Embedding family: token lookups, including a vocabulary-sharded table (vocab-parallel embedding).

With the table sharded on its vocabulary dim (``Shard(0)``, what RowwiseParallel does to an embedding and
what weight tying with a column-parallel output head gives), each rank looks up only the ids in its own
vocabulary range and contributes zeros for the rest: the output is ``Partial(sum)`` on that mesh dim.
Eager DTensor gets the same values through a stateful ``MaskPartial`` placement; a plain Partial is
equivalent for every consumer and keeps specs plain values. Other layouts use eager DTensor's rules.
"""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor
from thunder_dtensor.ops.fallback import fallback_prim
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import contiguous_stride

import torch
import torch.nn.functional as F


def _vocab_parallel_embedding(ids: Any, weight: Any, vocab_mesh_dim: int, *args: Any) -> Any:
    start = ti.local_offset(weight)[0]
    local_weight = weight.to_local()
    local_ids = ids.to_local()
    outside = (local_ids < start) | (local_ids >= start + local_weight.shape[0])
    rows = F.embedding(torch.where(outside, 0, local_ids - start), local_weight, *args)
    rows = torch.where(outside.unsqueeze(-1), 0.0, rows)
    placements = [ti.Partial() if i == vocab_mesh_dim else p for i, p in enumerate(ids.placements)]
    shape = tuple(ids.shape) + (weight.shape[1],)
    stride = contiguous_stride(shape)
    return ti.DTensor.from_local(rows, ids.device_mesh, placements, run_check=False, shape=shape, stride=stride)


dtensor_vocab_parallel_embedding_prim = define_dtensor_prim("vocab_parallel_embedding", _vocab_parallel_embedding)


def _vocab_mesh_dim(ids: Any, weight: Any) -> int | None:
    if (
        not (isinstance(ids, DTensorProxy) and isinstance(weight, DTensorProxy))
        or ids.device_mesh != weight.device_mesh
    ):
        return None
    vocab_dims = [i for i, p in enumerate(weight.placements) if isinstance(p, ti.Shard) and p.dim == 0]
    others_replicated = all(isinstance(p, ti.Replicate) for i, p in enumerate(weight.placements) if i not in vocab_dims)
    if len(vocab_dims) != 1 or not others_replicated:
        return None
    dim = vocab_dims[0]
    return dim if isinstance(ids.placements[dim], ti.Replicate) else None


@define_dtensor_symbol
def dtensor_embedding(
    ids, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False
):
    mesh_dim = _vocab_mesh_dim(ids, weight)
    if mesh_dim is not None and max_norm is None and not scale_grad_by_freq and not sparse:
        return dtensor_vocab_parallel_embedding_prim(ids, weight, mesh_dim)
    return fallback_prim(F.embedding)(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


register_function_for_dtensor(F.embedding, ti.ltorch.embedding, dtensor_embedding)
