"""Attention family: scaled_dot_product_attention on DTensors.

Attention is independent per batch element and per head. When q, k and v share their placements and
shard only batch or head dims (what tensor-parallel attention produces), the fused kernel runs on the
local shards and the output keeps those placements: no communication, and it works on CPU meshes, where
eager DTensor has no registered sharding strategy for the fused CPU kernel (torch 2.13 derives one from the
kernel's decomposition for some calls, slowly, and has none for its backward). Any other layout is first
gathered to Replicate (the redistribution is visible in the trace), then attended locally; there eager's
derived strategy may place the output otherwise (a sequence-sharded q gives a sequence-sharded output),
with the same values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import register_function_for_dtensor
from thunder_dtensor.ops.no_rule import replicated_fallback_enabled, warn_replicated_fallback
from thunder_dtensor.ops.redistribute import dtensor_redistribute
from thunder_dtensor.ops.ring_attention import (
    AttentionLayout,
    RingRefusal,
    refuse_ring,
    ring_sdpa,
    sequence_mesh_dims,
    why_not_ring,
)
from thunder_dtensor.primitive import define_dtensor_prim, define_dtensor_symbol
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.sdpa_backends import check_sdpa_call
from thunder_dtensor.spec import contiguous_stride, dense_stride_like

import torch
import torch.nn.functional as F


def _local_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, rng_state=None):
    """Fused SDPA on the local shards of batch/head-sharded DTensors; the output has q's spec.

    With dropout, ``rng_state`` is the generator state the forward drew its mask from: the generic
    gradient's recomputation starts from it again, so it replays the forward's mask.
    """
    if rng_state is not None and not ti.is_fake(rng_state):
        ti.set_rng_state(rng_state, q.device)
    mask = attn_mask
    if isinstance(attn_mask, ti.DTensor):
        # a replicated mask is broadcast over q's sharded batch/head dims: its gradient sums over those shards
        grad_placements = [
            ti.Partial() if isinstance(qp, ti.Shard) and isinstance(mp, ti.Replicate) else mp
            for qp, mp in zip(q.placements, attn_mask.placements)
        ]
        mask = attn_mask.to_local(grad_placements=grad_placements)
    q_local, k_local, v_local = q.to_local(), k.to_local(), v.to_local()
    if q_local.numel() == 0:
        # An empty shard (more ranks than batch*heads): the fused kernels' backward leaves the mask's
        # gradient undefined there; the definition gives the zero gradient every other rank agrees on.
        out = _attention_by_definition(q_local, k_local, v_local, mask, is_causal, scale, enable_gqa)
    else:
        out = F.scaled_dot_product_attention(
            q_local,
            k_local,
            v_local,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    spec = ti.dtensor_spec(q)
    # q, k and v broadcast over their batch dims (a 3-D q against 4-D k and v, say); with grouped-query attention
    # the heads are q's
    if enable_gqa:
        batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])) + (q.shape[-3],)
    else:
        batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    shape = batch + (q.shape[-2], v.shape[-1])
    # the global stride describes the kernel's local layout (the CPU fused kernel's output is not contiguous)
    stride = contiguous_stride(shape) if out.is_contiguous() else dense_stride_like(shape, tuple(out.stride()))
    return ti.DTensor.from_local(out, spec.mesh, spec.placements, run_check=False, shape=shape, stride=stride)


def _attention_by_definition(q, k, v, mask, is_causal, scale, enable_gqa):
    if enable_gqa and 0 < k.shape[-3] < q.shape[-3]:  # each group of q's heads attends to one head of k and v
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(
            ~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(), float("-inf")
        )
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(-1) @ v


dtensor_local_sdpa_prim = define_dtensor_prim("local_sdpa", _local_sdpa)


def _rng_state_meta(q: DTensorProxy) -> ti.TensorProxy:
    state = ti.rng_state(cast(torch.device, ti.devices.to_torch_device(q.device)))  # only its shape: draws nothing
    return ti.TensorProxy(shape=tuple(state.shape), dtype=ti.dtypes.uint8, device=ti.devices.cpu)


#: the generator state a random op on ``q``'s device is about to draw from
dtensor_rng_state_prim = define_dtensor_prim(
    "rng_state", lambda q: ti.rng_state(q.device), meta=_rng_state_meta, differentiable=False
)


def _shards_only_batch_or_heads(t: DTensorProxy) -> bool:
    return all(isinstance(p, ti.Replicate) or (isinstance(p, ti.Shard) and p.dim < t.ndim - 2) for p in t.placements)


def attends_on_local_shards(q: Any, k: Any, v: Any, attn_mask: Any = None) -> bool:
    """Whether q, k and v (DTensors or their proxies) share placements that shard only batch or head dims, and
    ``attn_mask`` (if any) is either replicated and broadcast over them or sharded as q is.

    There (the layout tensor-parallel attention has) the output keeps those placements, as eager's CUDA rules do
    (on CPU, torch 2.13's derived strategy replicates head-sharded ones); any other layout is gathered first, and
    eager's derived placements may differ (see the module docstring). With fewer
    heads in k and v than in q (grouped-query attention, ``enable_gqa=True``), sharded heads attend locally only
    where each rank's q heads are exactly the group of its k / v heads.
    """
    tensors = (q, k, v)
    return (
        all(_is_distributed(t) for t in tensors)
        and q.placements == k.placements == v.placements
        and q.ndim == k.ndim == v.ndim
        and _shards_only_batch_or_heads(q)
        and all(_head_groups_stay_local(q, t) for t in (k, v))
        and _mask_is_local(attn_mask, q)
    )


def _head_groups_stay_local(q: Any, kv: Any) -> bool:
    """With ``kv`` having fewer heads than ``q`` (both sharded alike), whether every rank holds q's heads of exactly
    its own k / v heads: one mesh dim shards the heads, and its chunk of q's heads is the group-size multiple of
    its chunk of k's (torch's Shard chunks ``ceil(size / ranks)`` rows per rank)."""
    if q.ndim < 3 or q.shape[-3] == kv.shape[-3]:
        return True
    head_dim = q.ndim - 3
    sharding = [i for i, p in enumerate(q.placements) if isinstance(p, ti.Shard) and p.dim == head_dim]
    if not sharding:
        return True
    if len(sharding) > 1 or q.shape[-3] % kv.shape[-3] != 0:
        return False
    ranks = q.device_mesh.size(sharding[0])
    group = q.shape[-3] // kv.shape[-3]
    return -(-q.shape[-3] // ranks) == group * -(-kv.shape[-3] // ranks)


def _mask_is_local(mask: Any, q: Any) -> bool:
    if mask is None:
        return True
    if not _is_distributed(mask):
        return False
    # a replicated mask broadcast over batch and heads is the same on every shard
    if all(isinstance(p, ti.Replicate) for p in mask.placements):
        return mask.ndim <= 2 or all(s == 1 for s in mask.shape[:-2])
    return mask.placements == q.placements and tuple(mask.shape) == tuple(q.shape[:-1]) + (mask.shape[-1],)


def _is_distributed(t: Any) -> bool:
    return isinstance(t, DTensorProxy | ti.DTensor | AttentionLayout)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How :func:`dtensor_scaled_dot_product_attention` runs a call: ``local`` (the fused kernel on the local
    batch / head shards), ``ring`` (ring attention over the sequence shards), ``gather`` (on Replicate) or ``refuse``
    (a sequence-sharded call that ring attention cannot take and that may not be gathered). ``slice_kv``: replicated
    k and v are first sliced like q (no communication)."""

    route: str
    slice_kv: bool = False
    head_tail: bool = False
    refusal: RingRefusal | None = None


def plan_attention(q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: Any, is_causal: Any) -> AttentionPlan:
    """The plan for q, k, v (proxies, DTensors or :class:`AttentionLayout` s). DTensor's sharding rule for the fused
    kernel under thunderfx asks the same plan, so dynamo's fake run places the output as the program will."""
    if not all(_is_distributed(t) for t in (q, k, v)):
        return AttentionPlan("gather")
    sliced_k, sliced_v = (_sliced_layout(t, q) for t in (k, v))
    if _shards_only_batch_or_heads(q) and _mask_is_local(attn_mask, q):
        if attends_on_local_shards(q, sliced_k, sliced_v, attn_mask):
            return AttentionPlan("local", slice_kv=True)
        return AttentionPlan("gather")
    if not sequence_mesh_dims(q):
        return AttentionPlan("gather")
    head_tail = bool(is_causal) and ti.head_tail_layout()
    refusal = why_not_ring(q, sliced_k, sliced_v, attn_mask, dropout_p, is_causal, head_tail)
    if refusal is None:
        return AttentionPlan("ring", slice_kv=True, head_tail=head_tail)
    # context parallelism asked for: a gather would defeat it; or the replicated fallback is off
    if not refusal.may_gather or ti.context_parallel_dispatch_enabled() or not replicated_fallback_enabled():
        return AttentionPlan("refuse", slice_kv=True, refusal=refusal)
    return AttentionPlan("gather", refusal=refusal)


@define_dtensor_symbol
def dtensor_scaled_dot_product_attention(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    # inside sdpa_kernel(...): refused at trace time if none of the chosen backends can run it (as for plain SDPA)
    check_sdpa_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    plan = plan_attention(q, k, v, attn_mask, dropout_p, is_causal)
    if plan.slice_kv:
        # replicated k / v next to a batch-, head- or sequence-sharded q: their matching slice (no communication)
        k, v = (_slice_like(t, q) for t in (k, v))
    if plan.route == "local":
        return dtensor_local_sdpa_prim(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            rng_state=_rng_state_if_random(q, dropout_p),
        )
    if plan.route == "ring":
        return ring_sdpa(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, head_tail=plan.head_tail)
    if plan.refusal is not None:
        if plan.route == "refuse":
            raise refuse_ring(q, k, v, plan.refusal)
        warn_replicated_fallback(
            "scaled_dot_product_attention", (q, k, v), {}, f"ring attention cannot take {plan.refusal.why}"
        )
    # any other layout (a sharded head_dim, mixed placements): gather to Replicate, attend locally
    replicated = [_replicate(t) for t in (q, k, v)]
    mask = _replicate(attn_mask) if isinstance(attn_mask, DTensorProxy) else attn_mask
    ti.check(
        all(isinstance(t, DTensorProxy) for t in replicated),
        lambda: "scaled_dot_product_attention: q, k and v must all be DTensors (as eager DTensor requires)",
    )
    return dtensor_local_sdpa_prim(
        *replicated,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        rng_state=_rng_state_if_random(replicated[0], dropout_p),
    )


def _rng_state_if_random(q: DTensorProxy, dropout_p: Any) -> Any:
    return dtensor_rng_state_prim(q) if dropout_p != 0.0 else None


def _slices_like(t: Any, q: Any) -> bool:
    """Whether ``t`` is Replicate and ``q`` shards only dims ``t`` has at the same size (``t`` then takes ``q``'s
    placements by a local slice)."""
    if not _is_distributed(t) or t.placements == q.placements or t.ndim != q.ndim:
        return False
    if any(not isinstance(p, ti.Replicate) for p in t.placements):
        return False
    return not any(isinstance(p, ti.Shard) and t.shape[p.dim] != q.shape[p.dim] for p in q.placements)


def _sliced_layout(t: Any, q: Any) -> Any:
    """``t`` as the plan sees it after :func:`_slice_like`."""
    return AttentionLayout(tuple(q.placements), tuple(t.shape), t.device_mesh) if _slices_like(t, q) else t


def _slice_like(t: DTensorProxy, q: DTensorProxy) -> DTensorProxy:
    """A Replicate ``t`` with ``q``'s placements, where ``q`` shards dims ``t`` has at the same size."""
    return dtensor_redistribute(t, None, list(q.placements)) if _slices_like(t, q) else t


def _replicate(t: Any) -> Any:
    if not isinstance(t, DTensorProxy) or all(isinstance(p, ti.Replicate) for p in t.placements):
        return t
    return dtensor_redistribute(t, None, [ti.Replicate()] * t.device_mesh.ndim)


register_function_for_dtensor(F.scaled_dot_product_attention, dtensor_scaled_dot_product_attention)


def cpu_fused_attention_shardings(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """DTensor's sharding choices for CPU's fused attention kernel, which DTensor has no rule for.

    What :func:`dtensor_scaled_dot_product_attention` does with these inputs (:func:`plan_attention`), said to
    DTensor: where it attends on local batch / head shards or by ring attention, q's shards (the output keeps them);
    anything else is replicated first. Used only while dynamo traces a thunderfx program
    (``_integration.scope_dtensor_entries_to_thunderfx_calls``), whose fake run of the attention needs an output
    spec; the program thunder builds runs the rule above. The choices follow the plan, not the cheapest layout: a
    sequence shard offered for q, k and v that ring attention would not take let DTensor choose it (free for a
    replicated q next to a sequence-sharded k), and a node split off for eager then attended each rank's keys only
    (fuzz seed 17115: wrong values under thunderfx).
    """
    replicate = ti.Replicate()
    # inputs in the kernel's schema order: query, key, value, dropout_p, is_causal, then the keywords attn_mask,
    # scale (a mask passed needs a placement of its own: fuzz seed 18595 failed DTensor's count of inputs)
    mask = [replicate, None] if attn_mask is not None else []
    choices = [([replicate, replicate], [replicate, replicate, replicate, None, None, *mask])]
    if attn_mask is not None or dropout_p != 0.0:
        return choices
    q, k, v = (AttentionLayout.of_spec(spec) for spec in (query, key, value))
    plan = plan_attention(q, k, v, None, 0.0, is_causal)
    if plan.route == "refuse" and plan.refusal is not None:
        raise refuse_ring(q, k, v, plan.refusal)
    if plan.route in ("local", "ring"):
        for shard in dict.fromkeys(p for p in q.placements if isinstance(p, ti.Shard)):
            choices.append(([shard, shard], [shard, shard, shard, None, None]))
    return choices


#: sharding rules torch lacks, put in DTensor's tables only during thunderfx calls (by the package's root)
THUNDERFX_SHARDING_RULES = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: cpu_fused_attention_shardings
}
