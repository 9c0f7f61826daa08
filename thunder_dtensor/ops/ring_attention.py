"""Ring attention: scaled_dot_product_attention with q, k and v sharded along the sequence (context parallelism).

Each rank keeps its sequence shard of q and attends it to every rank's k / v chunk in turn: one fused-kernel
call per chunk returns the chunk's output and log-sum-exp, and the partial results merge exactly
(``out = sum_i exp(lse_i - lse) * out_i``, ``lse = logsumexp_i lse_i``, in float32). The k / v chunks travel
by torch's functional collectives: one all-gather (torch's default rotation) or a ring of ``permute_tensor``
steps (all-to-all, ``set_rotate_method("alltoall")``). The backward is the same ring: per chunk the kernel's
backward with the global output and log-sum-exp, dq summed locally, dk / dv returned to their owners by a
reduce-scatter (all-gather rotation) or by travelling one more step around the ring (all-to-all).

Causal masks use the layout the sequence is in. Contiguous shards (what ``Shard(seq)`` says) skip the chunks
after a rank's own; torch's head-tail load balancer (inside ``context_parallel``; rank r holds chunks r and
2n-1-r of 2n) attends, after its own chunk, either the first half of a chunk from an earlier rank or, with
its second half, the whole chunk from a later one. The layout is read where the program is traced
(``_integration.context_parallel``), passed to the prim, and guarded by the prologue.

The prim is written on local tensors with torch's collectives inside; the lowering traces it like any other
dtensor prim, so the lowered trace shows each rotation's collective and the kernels between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.guards import define_prologue_check
from thunder_dtensor.primitive import define_dtensor_prim
from thunder_dtensor.proxy import DTensorProxy
from thunder_dtensor.spec import dense_stride_like

import torch

_HINT_MASK = (
    "ring attention takes causal masks only (is_causal=True); for another mask, redistribute q, k and v to "
    "Replicate (or shard batch / heads) before the attention"
)


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """What the ring does on this rank: fixed when the program is traced."""

    group_name: str
    rank: int
    size: int
    is_causal: bool
    scale: float | None
    head_tail: bool
    rotate: str

    def steps(self) -> list[str]:
        """Per ring step (the k / v chunk of rank ``rank - i``): how this rank's q attends it.

        ``causal``: its own chunk; ``full``: all of q to all of the chunk; ``kv_head``: all of q to the chunk's
        first half; ``q_tail``: q's second half to the whole chunk; ``skip``: nothing (a later chunk).
        """
        steps = []
        for i in range(self.size):
            source = (self.rank - i) % self.size
            if not self.is_causal:
                steps.append("full")
            elif i == 0:
                steps.append("causal")
            elif self.head_tail:
                steps.append("kv_head" if source < self.rank else "q_tail")
            else:
                steps.append("full" if source < self.rank else "skip")
        return steps


# --- one chunk: the fused kernels that return the log-sum-exp -------------------------------------------------
def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride in its last dim, which the fused kernels called directly assume (``F.sdpa`` checks
    it and picks another kernel; called directly, a transposed shard gave wrong values: fuzz seed 19523, a
    sequence-sharded ``x.mT`` attending to itself)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None) -> tuple:
    """(output, log-sum-exp) of attention of ``q`` to one k / v chunk."""
    q, k, v = _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v)
    if q.device.type == "cuda":
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[-2]]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _attend_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool, scale: float | None) -> tuple:
    """(dq, dk, dv) of one chunk, given the merged output and log-sum-exp (the exact split of the gradient)."""
    dout, q, k, v, out = (_last_dim_dense(t) for t in (dout, q, k, v, out))
    if q.device.type == "cuda":
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse.contiguous(), seed, seed, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


# --- k / v around the ring --------------------------------------------------------------------------------------
def _flatten(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, shapes: tuple[torch.Size, ...]) -> tuple[torch.Tensor, ...]:
    pieces = torch.split(flat, [s.numel() for s in shapes])
    return tuple(p.view(s) for p, s in zip(pieces, shapes))


def _next_rank(plan: RingPlan, t: torch.Tensor) -> torch.Tensor:
    """``t`` sent to the next rank of the ring; what the previous rank sent comes back."""
    # torch's permute_tensor as its all-to-all: everything to rank + 1, everything from rank - 1
    sends, receives = [0] * plan.size, [0] * plan.size
    sends[(plan.rank + 1) % plan.size] = receives[(plan.rank - 1) % plan.size] = t.numel()
    return ti.all_to_all(t, receives, sends, plan.group_name)


def _chunks(plan: RingPlan, tensors: tuple[torch.Tensor, ...]) -> Iterator[tuple[torch.Tensor, ...]]:
    """Step i's chunks: those of rank ``rank - i``, by one all-gather or one all-to-all per step."""
    flat, shapes = _flatten(tensors), tuple(t.shape for t in tensors)
    if plan.rotate == "allgather":
        gathered = ti.all_gather_dim0(flat, plan.group_name).chunk(plan.size)
        for i in range(plan.size):
            yield _unflatten(gathered[(plan.rank - i) % plan.size], shapes)
        return
    following: torch.Tensor | None = flat
    for i in range(plan.size):
        current = following
        assert current is not None
        # the next chunk is sent for before this one is attended: the rotation overlaps the attention (the
        # lowered program waits for it where it is first read)
        following = _next_rank(plan, current) if i + 1 < plan.size else None
        yield _unflatten(current, shapes)


# --- the ring ---------------------------------------------------------------------------------------------------
def _merge(out: Any, lse: Any, new_out: torch.Tensor, new_lse: torch.Tensor) -> tuple:
    new_out = new_out.to(torch.promote_types(new_lse.dtype, new_out.dtype))
    if out is None:
        return new_out, new_lse
    merged = torch.logaddexp(lse, new_lse)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + new_out * torch.exp(new_lse - merged).unsqueeze(-1)
    return out, merged


def _merge_tail(out: torch.Tensor, lse: torch.Tensor, new_out: torch.Tensor, new_lse: torch.Tensor) -> tuple:
    half = out.shape[-2] // 2
    tail_out, tail_lse = _merge(out[..., half:, :], lse[..., half:], new_out, new_lse)
    return torch.cat([out[..., :half, :], tail_out], dim=-2), torch.cat([lse[..., :half], tail_lse], dim=-1)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan) -> tuple:
    """This rank's attention output (q's dtype) and log-sum-exp over every rank's k / v."""
    half = q.shape[-2] // 2
    out: Any = None
    lse: Any = None
    for step, (k_i, v_i) in zip(plan.steps(), _chunks(plan, (k, v))):
        if step == "skip":
            continue
        if step == "q_tail":  # (after step 0, which attends: out and lse are set)
            out, lse = _merge_tail(out, lse, *_attend(q[..., half:, :], k_i, v_i, False, plan.scale))
            continue
        if step == "kv_head":
            k_i, v_i = k_i[..., :half, :], v_i[..., :half, :]
        out, lse = _merge(out, lse, *_attend(q, k_i, v_i, step == "causal", plan.scale))
    assert out is not None and lse is not None  # step 0 always attends
    # the fused kernels' output layout (heads inside the sequence), which dynamo's fake runs predict for SDPA
    return _kernel_layout(out.to(q.dtype)), lse


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-3, -2).contiguous().transpose(-3, -2) if t.ndim >= 4 else t.contiguous()


def ring_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, plan: RingPlan) -> tuple:
    """(dq, dk, dv) of :func:`ring_forward`; dk / dv summed over every rank's q and returned to their owners.

    All-to-all: each chunk's gradient travels with it, one step behind, so one chunk's is held at a time;
    all-gather: the gradients of every chunk go back in one reduce-scatter.
    """
    half = q.shape[-2] // 2
    accumulate = torch.promote_types(q.dtype, torch.float32)
    dq: Any = None  # (step 0 attends: its dq starts the sum)
    owed: list[torch.Tensor] = []  # (all-gather) each step's chunk gradient, flat
    travelling = None  # (all-to-all) the gradient of the chunk now here, summed over the ranks it has visited
    for step, (k_i, v_i) in zip(plan.steps(), _chunks(plan, (k, v))):
        if step == "skip":
            dk_i, dv_i = (torch.zeros(t.shape, dtype=accumulate, device=q.device) for t in (k_i, v_i))
        elif step == "q_tail":  # q's second half attended the whole chunk
            dq_t, dk_i, dv_i = _attend_backward(
                dout[..., half:, :], q[..., half:, :], k_i, v_i, out[..., half:, :], lse[..., half:], False, plan.scale
            )
            dq = torch.cat([dq[..., :half, :], dq[..., half:, :] + dq_t.to(accumulate)], dim=-2)
        elif step == "kv_head":  # all of q attended the chunk's first half
            dq_t, dk_t, dv_t = _attend_backward(
                dout, q, k_i[..., :half, :], v_i[..., :half, :], out, lse, False, plan.scale
            )
            dq = dq + dq_t.to(accumulate)
            dk_i, dv_i = (torch.cat([g, torch.zeros_like(g)], dim=-2) for g in (dk_t, dv_t))
        else:
            dq_t, dk_i, dv_i = _attend_backward(dout, q, k_i, v_i, out, lse, step == "causal", plan.scale)
            dq = dq_t.to(accumulate) if dq is None else dq + dq_t.to(accumulate)
        flat = _flatten((dk_i.to(accumulate), dv_i.to(accumulate)))
        if plan.rotate == "allgather":
            owed.append(flat)
        else:
            travelling = flat if travelling is None else _next_rank(plan, travelling) + flat
    shapes = (k.shape, v.shape)
    if plan.rotate == "allgather":  # step i's chunk is rank (rank - i)'s: laid out by owner, reduce-scattered
        by_owner = torch.cat([owed[(plan.rank - owner) % plan.size] for owner in range(plan.size)])
        dk, dv = _unflatten(ti.reduce_scatter_dim0(by_owner, plan.group_name), shapes)
    else:
        assert travelling is not None
        dk, dv = _unflatten(_next_rank(plan, travelling), shapes)  # the last chunk here was rank + 1's
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan) -> torch.Tensor:
        out, lse = ring_forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        return (*ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan), None)


# --- the prim on DTensors -------------------------------------------------------------------------------------
def _ring_sdpa(
    q: Any,
    k: Any,
    v: Any,
    *,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    cp_mesh_dim: int,
    head_tail: bool,
    rotate: str,
) -> Any:
    mesh = q.device_mesh
    q_local, k_local, v_local = q.to_local(), k.to_local(), v.to_local()
    if enable_gqa and k_local.shape[-3] != q_local.shape[-3]:  # each k / v head serves a group of q heads
        group = q_local.shape[-3] // k_local.shape[-3]
        k_local, v_local = (t.repeat_interleave(group, dim=-3) for t in (k_local, v_local))
    plan = RingPlan(
        group_name=ti.group_name(mesh, cp_mesh_dim),
        rank=mesh.get_local_rank(cp_mesh_dim),
        size=mesh.size(cp_mesh_dim),
        is_causal=is_causal,
        scale=scale,
        head_tail=head_tail,
        rotate=rotate,
    )
    out = _RingAttention.apply(q_local, k_local, v_local, plan)
    shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    return ti.DTensor.from_local(
        out, mesh, q.placements, run_check=False, shape=torch.Size(shape), stride=dense_stride_like(shape, out.stride())
    )


dtensor_ring_sdpa_prim = define_dtensor_prim("ring_sdpa", _ring_sdpa)


# --- when the ring applies ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """What the attention rules read of q, k or v: a DTensor's placements, global shape and mesh, taken from DTensor's
    own spec of it (DTensor's sharding rule for the fused kernel plans with these, as thunder's rule does with
    proxies)."""

    placements: tuple
    shape: tuple
    device_mesh: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of_spec(cls, spec: Any) -> AttentionLayout:
        return cls(tuple(spec.placements), tuple(spec.shape), spec.mesh)

    def __repr__(self) -> str:
        return f"DTensor {list(self.shape)} placed {self.placements}"


def sequence_mesh_dims(t: Any) -> list[int]:
    """The mesh dims that shard ``t``'s sequence dim (SDPA's second-to-last)."""
    return [i for i, p in enumerate(t.placements) if isinstance(p, ti.Shard) and p.dim % t.ndim == t.ndim - 2]


_HINT_LAYOUT = "shard q, k and v alike along the sequence on one mesh dim, or redistribute them to Replicate"
_HINT_LOAD_BALANCER = (
    "inside context_parallel, pass sequences whose length divides into 2 x cp chunks, or turn the load "
    "balancer off (_cp_options.enable_load_balance = False)"
)


@dataclasses.dataclass(frozen=True)
class RingRefusal:
    """Why ring attention cannot run a sequence-sharded call, what to do about it, and whether a gather may
    stand in for it (never across meshes: eager DTensor refuses operands on different meshes)."""

    why: str
    hint: str = _HINT_LAYOUT
    may_gather: bool = True


def why_not_ring(
    q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: Any, is_causal: bool, head_tail: bool
) -> RingRefusal | None:
    """Why ring attention cannot run this sequence-sharded call (None: it can)."""
    if attn_mask is not None:
        return RingRefusal("an attn_mask (ring attention takes is_causal=True, no mask)", _HINT_MASK)
    if dropout_p != 0.0:
        return RingRefusal("dropout (ring attention runs without it)")
    if not all(isinstance(t, DTensorProxy | AttentionLayout) for t in (q, k, v)):
        return RingRefusal("q, k and v are not all DTensors")
    if not (q.device_mesh == k.device_mesh == v.device_mesh):
        return RingRefusal("q, k and v on different meshes (one cp mesh for all three)", may_gather=False)
    if not (q.placements == k.placements == v.placements):
        return RingRefusal("q, k and v have different placements (shard all three alike along the sequence)")
    if q.ndim != k.ndim or q.ndim < 3:
        return RingRefusal("q, k and v have different ranks")
    seq_dims = sequence_mesh_dims(q)
    if len(seq_dims) != 1:
        return RingRefusal("the sequence is sharded over more than one mesh dim")
    if any(
        isinstance(p, ti.Partial) or (isinstance(p, ti.Shard) and p.dim % q.ndim == q.ndim - 1) for p in q.placements
    ):
        return RingRefusal("a partial or head_dim-sharded input")
    ranks = q.device_mesh.size(seq_dims[0])
    if is_causal and q.shape[-2] != k.shape[-2]:
        return RingRefusal("a causal mask with different q and k / v sequence lengths")
    for t in (q, k, v):
        if t.shape[-2] % ranks:
            return RingRefusal(f"a sequence length {t.shape[-2]} that does not divide into {ranks} equal shards")
    if is_causal and head_tail and q.shape[-2] % (2 * ranks):
        why = f"a sequence length {q.shape[-2]} that does not divide into the load balancer's {2 * ranks} chunks"
        return RingRefusal(f"{why} (2 per rank)", _HINT_LOAD_BALANCER)
    return None


def ring_sdpa(
    q: DTensorProxy, k: DTensorProxy, v: DTensorProxy, *, is_causal: bool, scale: Any, enable_gqa: bool, head_tail: bool
) -> Any:
    """Ring attention over q's sequence-sharding mesh dim, in the layout (``head_tail``, read by the caller from
    torch's state) and the rotation torch's state says; the prologue checks both."""
    rotate = ti.rotate_method()
    ti.add_prologue_constraint(_run_check_context_parallel_state, head_tail if is_causal else None, rotate)
    return dtensor_ring_sdpa_prim(
        q,
        k,
        v,
        is_causal=bool(is_causal),
        scale=scale,
        enable_gqa=bool(enable_gqa),
        cp_mesh_dim=sequence_mesh_dims(q)[0],
        head_tail=head_tail,
        rotate=rotate,
    )


def refuse_ring(q: Any, k: Any, v: Any, refusal: RingRefusal) -> DTensorOpError:
    return DTensorOpError(
        "scaled_dot_product_attention (ring attention)", (q, k, v), {}, f"cannot take {refusal.why}", refusal.hint
    )


def _check_context_parallel_state_meta(head_tail: bool | None, rotate: str) -> None:
    ti.check(rotate in ("allgather", "alltoall"), lambda: f"unknown rotation {rotate!r}")


def _check_context_parallel_state_impl(head_tail: bool | None, rotate: str) -> None:
    """The prologue's check: the layout (for causal rings) and rotation the program was traced for."""
    if head_tail is not None and ti.head_tail_layout() != head_tail:
        raise RuntimeError(f"context-parallel layout changed (traced head_tail={head_tail})")
    if ti.rotate_method() != rotate:
        raise RuntimeError(f"context-parallel rotation changed (traced {rotate})")


_check_context_parallel_state, _run_check_context_parallel_state = define_prologue_check(
    "check_context_parallel_state", _check_context_parallel_state_meta, _check_context_parallel_state_impl
)
