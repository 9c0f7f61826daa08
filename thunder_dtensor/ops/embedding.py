"""Embedding family: token lookups, including a vocabulary-sharded table (vocab-parallel embedding).

With the table sharded on its vocabulary dim (``Shard(0)``, what RowwiseParallel does to an embedding and
what weight tying with a column-parallel output head gives), each rank looks up only the ids in its own
vocabulary range and contributes zeros for the rest: the output is a sum pending over that mesh dim, placed
:class:`~thunder_dtensor.spec.MaskPartial` as eager's ``_MaskPartial`` is, so that every later op places its
result as eager does (DTensor's rules reduce a masked partial before a pointwise op). ``padding_idx`` keeps the
gradient of its row zero on the rank that holds the row; ``scale_grad_by_freq`` counts only the ids of the
rank's own range. ``max_norm`` and ``sparse`` take eager DTensor's rules (a prim per op, as for other layouts).

``scale_grad_by_freq`` with sharded ids and a table that takes a gradient: eager DTensor scales each shard's
gradient by that shard's own counts of the ids, and sums the shards: a wrong weight gradient (fuzz seeds 1072,
5130, 5800, ...). The ids are made Replicate first, so the counts are the whole batch's (the output is placed as
DTensor places a lookup of replicated ids, which is not eager's placement there).
"""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import dtensor_callable_for, register_function_for_dtensor
from thunder_dtensor.ops.fallback import fallback_prim
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import MaskPartial, contiguous_stride

import torch
import torch.nn.functional as F


def _vocab_parallel_embedding(
    ids: Any, weight: Any, vocab_mesh_dim: int, padding_idx: int | None = None, scale_grad_by_freq: bool = False
) -> Any:
    start = ti.local_offset(weight)[0]
    local_weight = weight.to_local()
    local_ids = ids.to_local()
    rows_here = local_weight.shape[0]
    outside = (local_ids < start) | (local_ids >= start + rows_here)
    # the padding row is a row of one rank's shard (padding_idx is normalized to [0, vocabulary) by the symbol)
    local_padding = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < rows_here else None
    if scale_grad_by_freq:
        # ids of other ranks look up an extra zero row, so that they do not count towards a local row's frequency
        table = torch.cat([local_weight, local_weight.new_zeros((1, local_weight.shape[1]))])
        rows = F.embedding(torch.where(outside, rows_here, local_ids - start), table, local_padding, None, 2.0, True)
    else:
        rows = F.embedding(torch.where(outside, 0, local_ids - start), local_weight, local_padding)
        rows = torch.where(outside.unsqueeze(-1), 0.0, rows)
    masked = MaskPartial("sum", tuple(weight.shape), 0)
    placements = [masked if i == vocab_mesh_dim else p for i, p in enumerate(ids.placements)]
    shape = tuple(ids.shape) + (weight.shape[1],)
    stride = contiguous_stride(shape)
    # (torch annotates ``shape`` as a torch.Size; it takes a tuple of ints)
    return ti.DTensor.from_local(
        rows,
        ids.device_mesh,
        placements,
        run_check=False,
        shape=shape,  # type: ignore[arg-type]
        stride=stride,
    )


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
    if mesh_dim is not None and max_norm is None and not sparse:
        if padding_idx is not None:  # F.embedding's own check and normalization of a negative index
            vocabulary = weight.shape[0]
            ti.check(
                -vocabulary <= padding_idx < vocabulary,
                lambda: f"embedding: padding_idx {padding_idx} is outside the vocabulary of {vocabulary} rows",
                exception_type=AssertionError,
            )
            padding_idx = padding_idx % vocabulary
        return dtensor_vocab_parallel_embedding_prim(ids, weight, mesh_dim, padding_idx, scale_grad_by_freq)
    sharded_ids = isinstance(ids, DTensorProxy) and not all(p.is_replicate() for p in ids.placements)
    if scale_grad_by_freq and sharded_ids and getattr(weight, "requires_grad", False):
        redistribute = dtensor_callable_for(ti.DTensor.redistribute)
        ids = redistribute(ids, ids.device_mesh, [ti.Replicate()] * ids.device_mesh.ndim)
    return fallback_prim(F.embedding)(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


register_function_for_dtensor(F.embedding, dtensor_embedding)
