"""Embedding family: token lookups, including a vocabulary-sharded table (vocab-parallel embedding).

With the table sharded on its vocabulary dim (``Shard(0)``, what RowwiseParallel does to an embedding and
what weight tying with a column-parallel output head gives), each rank looks up only the ids in its own
vocabulary range and contributes zeros for the rest: the output is a sum pending over that mesh dim, placed
:class:`~thunder_dtensor.spec.MaskPartial` as eager's ``_MaskPartial`` is, so that every later op places its
result as eager does (DTensor's rules reduce a masked partial before a pointwise op). ``padding_idx`` keeps the
gradient of its row zero on the rank that holds the row; ``scale_grad_by_freq`` counts only the ids of the
rank's own range. ``max_norm`` and ``sparse`` take eager DTensor's rules (a prim per op, as for other layouts).
On a 2-D mesh the table may also be sharded over its embedding dim on another mesh dim (the output is sharded
there too), and ids sharded over a mesh dim the table is replicated on make the table's gradient ``Partial``
there. Where DTensor's own rule looks up vocab-parallel in a table that is not vocab-sharded (``_masked_by_eager``),
the same lookup is made explicit, with eager's output and gradient placements: eager's ``_MaskPartial`` holds one
call's mask and cannot be kept by a trace.

``scale_grad_by_freq`` with sharded ids and a table that takes a gradient: eager DTensor scales each shard's
gradient by that shard's own counts of the ids, and sums the shards: a wrong weight gradient (fuzz seeds 1072,
5130, 5800, ...). The ids are made Replicate first, so the counts are the whole batch's, and the output is then
redistributed to the placements eager gives the lookup of the ids as they were. Its cotangent, sharded over the
batch, would be counted per shard the same way (seed 5147): it is made Replicate over the batch's dims first.
"""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import call_for_dtensor, register_function_for_dtensor
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.ops.fallback import fallback_prim
from thunder_dtensor.primitive import (
    define_dtensor_prim,
    define_dtensor_symbol,
    define_marker_prim,
    define_vjp,
    propagated_fakes,
)
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import MaskPartial, as_traced_placement, contiguous_stride

import torch
import torch.nn.functional as F


def _vocab_parallel_embedding(
    ids: Any, weight: Any, vocab_mesh_dims: tuple, padding_idx: int | None = None, scale_grad_by_freq: bool = False
) -> Any:
    # ids sharded over a mesh dim the table is replicated on: each rank's rows hold the gradient of its own ids,
    # a sum pending over that dim (eager's placement there); to_local's backward would call it Replicate
    grad_placements = [
        ti.Partial() if i not in vocab_mesh_dims and p.is_replicate() and not ids.placements[i].is_replicate() else p
        for i, p in enumerate(weight.placements)
    ]
    if any(weight.placements[d].is_replicate() for d in vocab_mesh_dims):  # (one mesh dim: _masked_by_eager)
        (vocab_mesh_dim,) = vocab_mesh_dims
        # eager's rule looks up this rank's Shard(0) rows of a replicated table (a free redistribution): the gradient
        # holds those rows, zeros elsewhere, a sum pending over the mesh dim (eager's Partial)
        chunked = [ti.Shard(0) if i == vocab_mesh_dim else p for i, p in enumerate(weight.placements)]
        (rows_here, *_), (start, *_) = ti.local_shape_and_offset(weight, chunked)
        grad_placements[vocab_mesh_dim] = ti.Partial()
        local_weight = weight.to_local(grad_placements=grad_placements)[start : start + rows_here]
    else:
        start = ti.local_offset(weight)[0]
        local_weight = weight.to_local(grad_placements=grad_placements)
        rows_here = local_weight.shape[0]
    local_ids = ids.to_local()
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
    placements = _lookup_placements(ids, weight, vocab_mesh_dims)
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

#: the lookup DTensor's rule makes vocab-parallel by itself (``_masked_by_eager``): the same lookup, its table
#: gradient eager's own backward op on the cotangent that flows (eager's placements: the rule chose the layout)
dtensor_masked_lookup_prim = define_dtensor_prim("masked_lookup", _vocab_parallel_embedding)


def _embedding_dense_backward(g: Any, ids: Any, rows: int, padding_idx: int, scale_grad_by_freq: bool) -> Any:
    return torch.ops.aten.embedding_dense_backward(g, ids, rows, padding_idx, scale_grad_by_freq)


dtensor_embedding_dense_backward_prim = define_dtensor_prim(
    "embedding_dense_backward", _embedding_dense_backward, differentiable=False
)


@define_vjp(dtensor_masked_lookup_prim)
def _masked_lookup_vjp(g, out, ids, weight, vocab_mesh_dims, padding_idx=None, scale_grad_by_freq=False):
    padding = -1 if padding_idx is None else padding_idx
    grad = dtensor_embedding_dense_backward_prim(g, ids, weight.shape[0], padding, scale_grad_by_freq)
    return (None, grad, None, None, None)


def _lookup_placements(ids: Any, weight: Any, vocab_mesh_dims: tuple) -> list:
    """The vocab-parallel lookup's output placements: the masked sum on the vocabulary's mesh dims, the embedding dim
    sharded where the table's is (``Shard(1)``: the ids are replicated there), the ids' placements elsewhere."""
    out_dim = len(ids.shape)
    return [
        MaskPartial("sum", tuple(weight.shape), 0)
        if i in vocab_mesh_dims
        else ti.Shard(out_dim)
        if isinstance(w, ti.Shard) and w.dim == 1
        else p
        for i, (p, w) in enumerate(zip(ids.placements, weight.placements))
    ]


def _vocab_mesh_dims(ids: Any, weight: Any) -> tuple[int, ...] | None:
    """The mesh dims a vocab-parallel lookup runs over: the table ``Shard(0)`` there and the ids ``Replicate``; on
    every other mesh dim the table replicated or sharded over its embedding dim (``Shard(1)``, the ids replicated
    there: a 2-D mesh's table sharded both ways). A table ``(Shard(0), Shard(0))`` is sharded over its vocabulary
    on both mesh dims: each rank holds one block of rows, and the output is a masked sum over both (eager's rule
    places it so, and eager's lookup then fails: both placements share one mask buffer, "MaskBuffer has been
    materialized with conflicting data", fuzz seed 13174). None where the lookup is not vocab-parallel."""
    if (
        not (isinstance(ids, DTensorProxy) and isinstance(weight, DTensorProxy))
        or ids.device_mesh != weight.device_mesh
    ):
        return None
    vocab_dims = tuple(i for i, p in enumerate(weight.placements) if isinstance(p, ti.Shard) and p.dim == 0)
    if not vocab_dims or not all(ids.placements[d].is_replicate() for d in vocab_dims):
        return None
    for w, i in zip(weight.placements, ids.placements):
        column_sharded = isinstance(w, ti.Shard) and w.dim == 1 and i.is_replicate()
        if not (w.is_replicate() or column_sharded or (isinstance(w, ti.Shard) and w.dim == 0)):
            return None
    return vocab_dims


def _masked_by_eager(ids: Any, weight: Any) -> tuple[tuple[int, ...], Any, Any] | None:
    """Where eager's rule makes the lookup a masked one itself: (the mesh dims, the ids and table it looks up).

    DTensor may choose a vocab-parallel lookup for a table that is not vocab-sharded (a free ``Replicate ->
    Shard(0)`` on a mesh dim, seen on a 2x2 mesh: fuzz seeds 6121, 10371). Its output's ``_MaskPartial`` holds the
    mask of one call (its equality includes the mask buffer's identity), which a trace cannot keep. The same
    lookup is made explicit instead: the ids ``Replicate`` on that mesh dim, the table gathered on the others as
    eager's rule does inside the op, then the lookup (``dtensor_masked_lookup_prim``), whose output places as
    eager's does (checked) and whose table gradient is eager's backward op's, placements included.
    """
    both = isinstance(ids, DTensorProxy) and isinstance(weight, DTensorProxy)
    if not both or ids.device_mesh != weight.device_mesh:
        return None
    try:
        eager = _eager_lookup_placements(ids, weight)
    except DTensorOpError:
        return None  # the fallback prim raises DTensor's rejection
    masked = tuple(i for i, p in enumerate(eager) if isinstance(p, MaskPartial))
    vocab_sharded = all(isinstance(weight.placements[d], ti.Shard) and weight.placements[d].dim == 0 for d in masked)
    # several masked mesh dims: each with the table vocab-sharded (one replicated there: a single one)
    if not masked or not (vocab_sharded or (len(masked) == 1 and weight.placements[masked[0]].is_replicate())):
        return None
    # mesh dims where eager keeps the table sharded over its embedding dim and shards the output there, the ids
    # gathered (fuzz seed 18615: ids S(0) there; eager's lookup then masked with the ungathered ids' mask, and its
    # reduction raised "The shape of the mask [2] ... does not match the shape of the indexed tensor [4, 24]")
    out_dim = len(ids.shape)
    column = tuple(
        i
        for i, p in enumerate(eager)
        if i not in masked
        and isinstance(p, ti.Shard)
        and p.dim == out_dim
        and isinstance(weight.placements[i], ti.Shard)
        and weight.placements[i].dim == 1
    )
    kept = masked + column
    ids_placements = [ti.Replicate() if i in kept else p for i, p in enumerate(ids.placements)]
    table_placements = tuple(
        weight.placements[i] if i in kept else ti.Replicate() for i in range(weight.device_mesh.ndim)
    )
    ours = [
        MaskPartial("sum", tuple(weight.shape), 0) if i in masked else ti.Shard(out_dim) if i in column else p
        for i, p in enumerate(ids_placements)
    ]
    if tuple(ours) != eager:
        return None
    ids = call_for_dtensor(ti.DTensor.redistribute, ids, ids.device_mesh, ids_placements)
    if table_placements != tuple(weight.placements):
        weight = dtensor_table_as_looked_up_prim(weight, table_placements)
    return masked, ids, weight


def _table_as_looked_up(table: Any, placements: tuple) -> Any:
    return table.redistribute(table.device_mesh, placements)


#: the table redistributed as eager's lookup does inside the op, below autograd: its gradient is not redistributed
#: back (it keeps the placements the lookup's backward gives it, as eager's)
dtensor_table_as_looked_up_prim = define_dtensor_prim("table_as_looked_up", _table_as_looked_up)


@define_vjp(dtensor_table_as_looked_up_prim)
def _table_as_looked_up_vjp(g, out, table, placements):
    return (g, None)


def _lookup(ids: Any, weight: Any, padding_idx: Any, max_norm: Any, norm_type: Any, scale: bool, sparse: bool) -> Any:
    mesh_dims = _vocab_mesh_dims(ids, weight)
    lookup = dtensor_vocab_parallel_embedding_prim
    if mesh_dims is None and max_norm is None and not sparse:
        masked = _masked_by_eager(ids, weight)
        if masked is not None:
            (mesh_dims, ids, weight), lookup = masked, dtensor_masked_lookup_prim
    if mesh_dims is not None and max_norm is None and not sparse:
        if padding_idx is not None:  # F.embedding's own check and normalization of a negative index
            vocabulary = weight.shape[0]
            ti.check(
                -vocabulary <= padding_idx < vocabulary,
                lambda: f"embedding: padding_idx {padding_idx} is outside the vocabulary of {vocabulary} rows",
                exception_type=AssertionError,
            )
            padding_idx = padding_idx % vocabulary
        return lookup(ids, weight, mesh_dims, padding_idx, scale)
    return fallback_prim(F.embedding)(ids, weight, padding_idx, max_norm, norm_type, scale, sparse)


def _eager_lookup_placements(ids: Any, weight: Any) -> tuple:
    """The placements eager DTensor gives a lookup of ``ids`` in ``weight`` (its own rules, run on fakes)."""
    out = propagated_fakes("embedding_eager_placements", F.embedding, (ids, weight), {})
    return tuple(as_traced_placement(p) for p in out.placements)


def _unsharded_over_the_batch(g: Any, batch_ndim: int) -> Any:
    """``g`` with no mesh dim sharding one of its first ``batch_ndim`` dims (the ids' dims): Replicate there."""
    wanted = [
        ti.Replicate() if (isinstance(p, ti.Shard) or ti.is_strided_shard(p)) and p.dim < batch_ndim else p
        for p in g.placements
    ]
    return g if wanted == list(g.placements) else g.redistribute(g.device_mesh, wanted)


# A prim: the gradient's placements are known only when the backward's specs are propagated from the gradients that
# flow (guards.propagate_gradient_specs); a choice made while autodiff traces the rule would see stand-ins.
dtensor_unsharded_over_the_batch_prim = define_dtensor_prim(
    "unsharded_over_the_batch", _unsharded_over_the_batch, differentiable=False
)


def _counted_over_the_batch_vjp(g, out, a, batch_ndim):
    # the lookup's backward scales by each id's count among the ids it sees with the gradient: with the gradient
    # sharded over the batch, DTensor runs it per shard, each counting its own ids (fuzz seed 5147, eager too)
    return (dtensor_unsharded_over_the_batch_prim(g, batch_ndim),)


dtensor_counted_over_the_batch_prim = define_marker_prim(
    "counted_over_the_batch",
    _counted_over_the_batch_vjp,
    marks="a frequency-scaled lookup, whose cotangent must hold every id's rows",
)


@define_dtensor_symbol
def dtensor_embedding(
    ids, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False
):
    sharded_ids = isinstance(ids, DTensorProxy) and not all(p.is_replicate() for p in ids.placements)
    counted = scale_grad_by_freq and getattr(weight, "requires_grad", False) and isinstance(ids, DTensorProxy)
    if not counted:
        return _lookup(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if not sharded_ids:
        out = _lookup(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        return dtensor_counted_over_the_batch_prim(out, ids.ndim)
    # the counts must be the whole batch's: a lookup of replicated ids (the vocab-parallel one where the table is
    # vocab-sharded, fuzz seed 5832), placed as eager places the lookup of the ids as given
    eager_placements = _eager_lookup_placements(ids, weight)
    mesh = ids.device_mesh
    replicated = call_for_dtensor(ti.DTensor.redistribute, ids, mesh, [ti.Replicate()] * mesh.ndim)
    out = dtensor_counted_over_the_batch_prim(
        _lookup(replicated, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse), ids.ndim
    )
    # eager's placements where they are not a pending sum (the lookup's own masked sum cannot be made by a
    # redistribution; a table vocab-sharded on both mesh dims sums over both, eager's sharded ids over one)
    wanted = [o if e.is_partial() else e for o, e in zip(out.placements, eager_placements)]
    if wanted == list(out.placements):
        return out
    return call_for_dtensor(ti.DTensor.redistribute, out, out.device_mesh, wanted)


register_function_for_dtensor(F.embedding, dtensor_embedding)
