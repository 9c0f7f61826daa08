"""THUNDER_DTENSOR_CHECK_COLLECTIVES=1: ranks that compile different DTensor programs fail clearly, never hang."""

from thunder_dtensor import consistency
from thunder_dtensor.testing import make_full, mesh_1d, recorded_calls, world_size

import pytest
import thunder
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


@pytest.fixture
def gathers(monkeypatch):
    """The check's gathers, recorded (they still run)."""
    return recorded_calls(monkeypatch, consistency, "_all_gather")


def mul_sum(x, w):
    return (x * w).sum(0)


@pytest.mark.world_size(2, 4)
def test_uneven_shards_agree(monkeypatch, gathers):
    """(5, 3) Shard(0): local shapes differ per rank, the programs agree; values and grads are right."""
    monkeypatch.setenv(consistency.ENV_VAR, "1")
    x_full, w_full = make_full((5, 3), seed=0), make_full((5, 3), seed=1)
    x = distribute_tensor(x_full, mesh_1d(), [Shard(0)]).requires_grad_()
    w = distribute_tensor(w_full, mesh_1d(), [Shard(0)]).requires_grad_()
    local_rows = [None] * world_size()
    dist.all_gather_object(local_rows, x.to_local().shape[0])
    assert len(set(local_rows)) > 1, local_rows

    jfn = thunder.jit(mul_sum)
    out = jfn(x, w)
    ct = make_full((3,), seed=2)
    out.backward(distribute_tensor(ct, mesh_1d(), [Replicate()]))
    xr, wr = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    expected = mul_sum(xr, wr)
    expected.backward(ct)
    torch.testing.assert_close(out.full_tensor(), expected)
    torch.testing.assert_close(x.grad.full_tensor(), xr.grad)
    torch.testing.assert_close(w.grad.full_tensor(), wr.grad)

    # one compilation, one hash gathered (forward and backward ops together), nothing more
    assert len(gathers) == 1 and isinstance(gathers[0], str)
    ops = consistency.program_ops(
        (("forward", thunder.last_traces(jfn)[-1]), ("backward", thunder.last_backward_traces(jfn)[-1]))
    )
    # lowered: the boundary with global specs (never local shapes) and any collective by kind and mesh dim
    assert any(op.startswith("forward boundary: unwrap_dtensor(f32[5, 3] (Shard(dim=0))") for op in ops), ops
    assert any(op.startswith("backward: ") for op in ops), ops


@pytest.mark.world_size(2)
def test_a_boundary_a_rank_places_elsewhere_among_its_collectives_agrees(monkeypatch, gathers):
    """Fuzz seed 8443 under thunderfx: a (5, 21) value redistributed to ``Shard(0)`` (3 rows and 2), then a read of
    row 0. Rank 0 wrapped the redistributed DTensor after its all-gather, rank 1 before it: the same collectives in
    the same order, but the check compared the boundary's place too and raised on a program that runs. The
    boundary issues no communication: it is compared by its global specs, in any order."""
    from thunder.dynamo import thunderfx

    monkeypatch.setenv(consistency.ENV_VAR, "1")
    mesh = mesh_1d()

    def fn(x, w):
        y = x.view(5, 21).redistribute(mesh, [Shard(0)])
        return torch.nn.functional.linear(y, w), y[0].sum().item()

    x_full, w_full = make_full((5, 3, 7), seed=0), make_full((4, 21), seed=1)
    x, w = (distribute_tensor(t, mesh, [Replicate()]) for t in (x_full, w_full))
    out, first_row = thunderfx(fn)(x, w)
    torch.testing.assert_close(out.full_tensor(), x_full.view(5, 21) @ w_full.T)
    assert first_row == pytest.approx(x_full.view(5, 21)[0].sum().item())
    assert out.placements == (Shard(0),) and gathers, (out.placements, gathers)


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
def test_rank_dependent_trace_raises_on_every_rank(monkeypatch, gathers, lowering):
    """Rank 0 alone redistributes at trace time: every rank raises, naming the op on each rank; none hangs."""
    monkeypatch.setenv(consistency.ENV_VAR, "1")
    mesh = mesh_1d()

    def diverging(x):
        if dist.get_rank() == 0:
            x = x.redistribute(mesh, [Replicate()])
        return x * 2

    x = distribute_tensor(make_full((4, 3), seed=3), mesh, [Shard(0)])
    with pytest.raises(consistency.CollectiveMismatchError) as info:
        thunder.jit(diverging, dtensor_lowering=lowering)(x)
    message = str(info.value)
    if lowering:  # rank 0 gathers where the others go on: the collective itself is named
        assert "first difference at op #0 of the program (forward" in message, message
        assert "rank 0: forward: all_gather_into_tensor(mesh_dim=0, f32)" in message, message
    else:
        assert "first difference at op #0 of the program (forward)" in message, message
        assert "rank 0: forward: dtensor_redistribute" in message and "(Replicate())" in message, message
        assert "rank 1: forward: dtensor_mul_prim(f32[4, 3] (Shard(dim=0))" in message, message
    assert len(gathers) == 2  # the hash, then the ops: on every rank, so nobody waits
    dist.barrier()  # every rank got here: no rank is left in a collective


def test_off_without_the_variable(monkeypatch):
    """Without the variable the check gathers nothing, even for a program that differs by rank."""
    monkeypatch.delenv(consistency.ENV_VAR, raising=False)

    def no_gather(obj):
        raise AssertionError("the rank-consistency check gathered without THUNDER_DTENSOR_CHECK_COLLECTIVES=1")

    monkeypatch.setattr(consistency, "_all_gather", no_gather)
    x = distribute_tensor(make_full((4, 3), seed=4), mesh_1d(), [Shard(0)])
    rank_scale = float(dist.get_rank() + 1)  # a per-rank constant: no collective, only a different trace
    out = thunder.jit(lambda x: x * rank_scale)(x)
    torch.testing.assert_close(out.to_local(), x.to_local() * rank_scale)
