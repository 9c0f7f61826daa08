"""Where eager DTensor fails or differs, and the generic fallback.

Where eager DTensor fails today, a test checks thunder's documented behaviour; it never asserts that eager
fails: if eager runs the case (a CUDA mesh, a later torch), thunder is compared with it instead.
"""

from thunder_dtensor import DTensorOpError
from thunder_dtensor.testing import COMMS_ASSERTED, DTensorCase, eager_error, make_full, mesh_1d, run_case

import pytest
import thunder
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def _dt(full, placements, requires_grad=True):
    return distribute_tensor(full, mesh_1d(), placements).requires_grad_(requires_grad)


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]], ids=str)
def test_fused_sdpa_on_cpu_mesh_where_eager_fails(placements):
    """torch 2.13's eager DTensor has no strategy for the fused CPU kernel; thunder runs it on the local shards.

    If eager runs the case (a CUDA mesh, or a later torch), thunder is compared with it instead.
    """
    q, k, v = (make_full((2, 4, 6, 8), seed=s) for s in (1, 2, 3))

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    case = DTensorCase(attention, [q, k, v], [placements] * 3)
    eager_fails = eager_error(case) is not None
    result = run_case(case, compare_eager=not eager_fails, assert_comms=COMMS_ASSERTED)
    if eager_fails:
        assert result.thunder_out[0].placements == tuple(placements)  # attention ran on the local shards


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]], ids=str)
@pytest.mark.parametrize("split", ["chunk", "split"])
def test_chunk_and_split_backward_where_eager_fails(placements, split):
    """An unused piece: torch 2.13's eager backward mixes a plain zero gradient into a DTensor cat and fails;
    thunder's zero cotangent is a DTensor. If eager runs it (a later torch), thunder is compared with it."""

    def fn(x, w):
        a, _unused = x.chunk(2, dim=1) if split == "chunk" else torch.split(x, [4, 4], dim=1)
        return a * w

    x, w = make_full((6, 8), seed=1), make_full((6, 4), seed=2)
    case = DTensorCase(fn, [x, w], [placements, [Replicate()]])
    run_case(case, compare_eager=eager_error(case) is None, assert_comms=COMMS_ASSERTED)


def test_fallback_op_without_dedicated_prim():
    """torch.cumsum has no dedicated prim: the fallback runs it with eager semantics, fwd and bwd."""
    x = make_full((6, 8), seed=4)
    result = run_case(DTensorCase(lambda x: torch.cumsum(x, dim=1) * 2, [x], [[Shard(0)]]))
    assert result.thunder_out[0].placements == (Shard(0),)
    assert "dtensor_Tensor_cumsum_prim(" in str(thunder.last_traces(result.jitted)[0])
    # lowered: eager DTensor's local cumsum, and its backward from the joint program (no rerun of the cumsum)
    forward = str(thunder.last_traces(result.jitted)[-1])
    backward = str(thunder.last_backward_traces(result.jitted)[-1])
    assert "aten_cumsum(" in forward and "aten_cumsum(" not in backward.replace("aten_cumsum(t", "")
    assert "vjp_prim" not in backward


def test_op_eager_rejects_fails_at_trace_time_with_the_fallback_off():
    """An op with no sharding strategy and no decomposition (addbmm, in torch 2.13), with the replicated fallback
    turned off: the same kind of error as eager's, raised while tracing. If eager runs it (a later torch), thunder
    runs it too, with eager's values and placements. (With the fallback on it runs: test_no_rule.py.)"""
    fulls = [make_full((4, 10), seed=2), make_full((3, 4, 5), seed=3), make_full((3, 5, 10), seed=4)]
    placements = [[Shard(0)], [Replicate()], [Replicate()]]

    def fn(a, b, c):
        return torch.addbmm(a, b, c)

    case = DTensorCase(fn, fulls, placements, requires_grad=[False] * 3)
    eager = eager_error(case, backward=False)
    if eager is None:
        run_case(case, backward=False, assert_comms=COMMS_ASSERTED)
        return
    jfn = thunder.jit(fn, dtensor_replicated_fallback=False)
    with pytest.raises(DTensorOpError) as info:
        jfn(*(_dt(f, p, requires_grad=False) for f, p in zip(fulls, placements)))
    message = str(info.value)
    assert "addbmm" in message.splitlines()[0] and "placements=(Shard(dim=0),)" in message and "hint:" in message
    assert type(info.value.__cause__) is type(eager)  # eager DTensor's own rejection
    # raised by sharding propagation while tracing, not by running the program
    assert any(entry.name == "propagated_fakes" for entry in info.traceback)


def test_vocab_parallel_embedding_grad_keeps_table_sharding():
    ids = make_full((4, 6), seed=6, dtype=torch.int64, int_high=10)
    table = make_full((10, 8), seed=7)
    result = run_case(
        DTensorCase(F.embedding, [ids, table], [[Replicate()], [Shard(0)]], requires_grad=[False, True]),
        compare_eager=False,
    )
    assert result.thunder_out[0].placements[0].is_partial()
    assert result.thunder_grads[1].placements == (Shard(0),)


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]], ids=str)
def test_dropout_mask_reused_in_backward(placements):
    p = 0.4
    x_full = make_full((8, 16), seed=8, low=0.5)  # no zeros: a zero output means dropped

    def fn(x):
        return F.dropout(x, p=p, training=True)

    outs = []
    for _ in range(2):
        torch.manual_seed(1234)
        x = _dt(x_full, placements)
        out = thunder.jit(fn)(x)
        g = make_full((8, 16), seed=9)
        out.backward(distribute_tensor(g, mesh_1d(), out.placements))
        full, grad = out.full_tensor(), x.grad.full_tensor()
        kept = full != 0
        assert 0 < kept.float().mean() < 1
        torch.testing.assert_close(full[kept], (x_full / (1 - p))[kept])
        torch.testing.assert_close(grad, torch.where(kept, g / (1 - p), 0.0))
        outs.append(full)
    torch.testing.assert_close(outs[0], outs[1])  # same seed, same mask
    x = _dt(x_full, placements)
    torch.testing.assert_close(thunder.jit(lambda x: F.dropout(x, p=p, training=False))(x).full_tensor(), x_full)


def test_sdpa_kernel_choice_is_checked_for_dtensor_attention():
    """Inside ``sdpa_kernel(...)`` DTensor attention is checked like plain attention (the DTensor op calls the
    check itself): a backend that can run it gives eager DTensor's values; one that cannot (efficient attention
    on CPU, which eager DTensor also fails to run) is refused at trace time, naming the backend."""
    from thunder_dtensor.sdpa_backends import SDPABackendError

    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (_dt(make_full((2, 4, 8, 16), seed=s), [Shard(1)], requires_grad=False) for s in range(3))

    def attention_under(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)  # (eager DTensor's MATH path rejects is_causal)

        return fn

    expected = attention_under(SDPBackend.MATH)(q, k, v)
    out = thunder.jit(attention_under(SDPBackend.MATH))(q, k, v)
    assert out.placements == expected.placements
    torch.testing.assert_close(out.full_tensor(), expected.full_tensor())
    with pytest.raises(RuntimeError):
        attention_under(SDPBackend.EFFICIENT_ATTENTION)(q, k, v)
    with pytest.raises(SDPABackendError, match="SDPBackend.EFFICIENT_ATTENTION"):
        thunder.jit(attention_under(SDPBackend.EFFICIENT_ATTENTION))(q, k, v)


def _named_results(x):
    """An attention-sink softmax and an MoE router on a DTensor: fields read by name (``name_the_fields_of_paired_
    results``; thunder alone raises ``AttributeError: values``)."""
    shifted = x - x.max(dim=-1, keepdim=True).values
    top = torch.topk(shifted, 2, dim=-1)
    ordered, order = torch.sort(x, dim=-1)
    return shifted.exp() * 2 + ordered * 3 + order + top.indices.sum(-1, keepdim=True) + x.max(-1, True).indices


@pytest.mark.parametrize("placements", [[Shard(0)], [Replicate()]], ids=str)
def test_named_results_of_max_topk_and_sort_on_dtensors(placements):
    case = DTensorCase(_named_results, [make_full((4, 6), seed=3)], [placements])
    run_case(case, assert_comms=COMMS_ASSERTED)


def test_a_program_returns_named_results_as_torch_does():
    """A DTensor program that returns ``x.max(dim)`` / ``topk`` / ``sort`` gives torch's named result type (its
    return statement printed the type's repr, ``max(values=..., indices=...)``, which the type cannot be called with:
    a TypeError on every such call; found by the op coverage run of max.reduction_with_dim)."""
    mesh = mesh_1d()
    full = make_full((4, 6), seed=5)
    x = distribute_tensor(full, mesh, [Shard(0)])
    programs = {
        "max": lambda t: t.max(1),
        "topk": lambda t: torch.topk(t, 2, dim=1),
        "sort": lambda t: t.sort(0),
        "nested": lambda t: (t.max(1, keepdim=True), t.sum()),
    }
    for name, fn in programs.items():
        out, expected = thunder.jit(fn)(x), fn(full)
        named, expected_named = (out[0], expected[0]) if name == "nested" else (out, expected)
        assert type(named) is type(expected_named), name
        torch.testing.assert_close(named.values.full_tensor(), expected_named.values, msg=name)
        torch.testing.assert_close(named.indices.full_tensor(), expected_named.indices, msg=name)
