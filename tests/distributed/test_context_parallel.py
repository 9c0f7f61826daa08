"""Context parallelism: sequence-sharded attention lowered to ring attention, and torch's ``context_parallel``.

On a CPU mesh eager DTensor cannot run any of this (torch 2.13 has no sharding strategy for the CPU flash
kernel, and ``context_parallel`` overrides only the CUDA kernels), so values and gradients are compared with
plain torch on full tensors and with the one-process model; where eager runs a case (a CUDA mesh, a later
torch), it is compared with eager as well.
"""

import contextlib
import copy

from thunder_dtensor import DTensorOpError, consistency
from thunder_dtensor.ops.no_rule import ReplicatedFallbackWarning
from thunder_dtensor.testing import (
    DTensorCase,
    device_type,
    eager_error,
    make_full,
    mesh_1d,
    run_case,
    world_size,
)
from thunder_dtensor.testing.llama import Llama, LlamaConfig, apply_tp, llama_loss
from thunder_dtensor.testing.models import CausalAttention
from thunder_dtensor.testing.training import COMPILERS, PARITY_TOL

import pytest
import thunder
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

ROTATIONS = {"allgather": "all_gather_into_tensor(", "alltoall": "all_to_all_single("}


@contextlib.contextmanager
def rotation(method: str):
    before = _cp_options.rotate_method
    set_rotate_method(method)
    try:
        yield
    finally:
        _cp_options.rotate_method = before


def _eager_runs(case: DTensorCase) -> bool:
    """Whether eager DTensor runs the case (forward and backward): never on a CPU mesh in torch 2.13 (see
    :func:`test_ring_placements_are_eagers_on_cpu`), so only a CUDA mesh pays for asking."""
    return device_type() == "cuda" and eager_error(case) is None


def _attention(causal: bool):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


# --- ring attention on sequence-sharded DTensors ----------------------------------------------------------------
@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("rotate", list(ROTATIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sequence_sharded_attention_is_a_ring(causal, rotate, monkeypatch):
    """Values and gradients equal plain attention; outputs and gradients stay sequence-sharded; the lowered
    programs show local flash-kernel calls and the rotation's collective, forward and backward. The ranks issue
    the same collectives: the opt-in rank-consistency check passes (it raised on the causal ring, whose
    ``issued_before`` only ranks that do not attend a step's chunk have, until it left that symbol out: it issues
    no communication)."""
    monkeypatch.setenv(consistency.ENV_VAR, "1")
    q, k, v = (make_full((2, 4, 16, 8), seed=s) for s in (1, 2, 3))
    case = DTensorCase(_attention(causal), [q, k, v], [[Shard(2)]] * 3)
    with rotation(rotate):
        result = run_case(case, compare_eager=_eager_runs(case))
    assert result.thunder_out[0].placements == (Shard(2),)
    assert all(g.placements == (Shard(2),) for g in result.thunder_grads)
    forward = str(thunder.last_traces(result.jitted)[-1])
    backward = str(thunder.last_backward_traces(result.jitted)[-1])
    assert "dtensor_ring_sdpa_prim" in str(thunder.last_traces(result.jitted)[0])
    for trace in (forward, backward):
        assert ROTATIONS[rotate] in trace and "scaled_dot_product_flash_attention_for_cpu" in trace
    if rotate == "allgather":  # dk / dv go back to their owners in one reduce-scatter
        assert "reduce_scatter_tensor(" in backward


def test_ring_placements_are_eagers_on_cpu():
    """On CPU eager DTensor runs the non-causal forward only (a strategy derived from the kernel's decomposition,
    ~10 s; its backward has none): the output and its placements are eager's."""
    if device_type() != "cpu":
        pytest.skip("the CPU kernel's case")
    q, k, v = (make_full((2, 4, 16, 8), seed=s) for s in (1, 2, 3))
    mesh = mesh_1d()
    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))
    eager = _attention(False)(dq, dk, dv)
    ours = thunder.jit(_attention(False))(dq, dk, dv)
    assert ours.placements == eager.placements == (Shard(2),)
    torch.testing.assert_close(ours.to_local(), eager.to_local(), **PARITY_TOL)


def test_ring_with_grouped_query_heads():
    """``enable_gqa``: two k / v heads serve four q heads, on sequence shards."""
    q, k, v = make_full((1, 4, 8, 8), seed=21), make_full((1, 2, 8, 8), seed=22), make_full((1, 2, 8, 8), seed=23)
    case = DTensorCase(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        [q, k, v],
        [[Shard(2)]] * 3,
    )
    with rotation("alltoall"):
        result = run_case(case, compare_eager=_eager_runs(case))
    assert "dtensor_ring_sdpa_prim" in str(thunder.last_traces(result.jitted)[0])


def test_ring_attention_with_the_lowering_off():
    q, k, v = (make_full((2, 4, 8, 8), seed=s) for s in (4, 5, 6))
    result = run_case(
        DTensorCase(_attention(True), [q, k, v], [[Shard(2)]] * 3),
        compare_eager=False,
        jit_kwargs={"dtensor_lowering": False},
    )
    assert result.thunder_out[0].placements == (Shard(2),)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("other", [0, 1], ids=["batch", "heads"])
def test_ring_over_one_mesh_dim_with_batch_or_heads_on_the_other(other):
    """cp x dp / cp x tp: the ring runs over the sequence's mesh dim only."""
    q, k, v = (make_full((2, 4, 8, 8), seed=s) for s in (7, 8, 9))
    case = DTensorCase(_attention(True), [q, k, v], [[Shard(other), Shard(2)]] * 3, mesh=_mesh_2d())
    result = run_case(case, compare_eager=_eager_runs(case))
    assert result.thunder_out[0].placements == (Shard(other), Shard(2))


def _mesh_2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))


def test_attention_ring_cannot_take_is_gathered_with_a_warning():
    """A mask (or dropout) on sequence shards, outside context_parallel: gathered, said by the warning."""
    q, k, v = (make_full((2, 4, 8, 8), seed=s) for s in (10, 11, 12))
    mask = make_full((8, 8), seed=13)
    case = DTensorCase(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        [q, k, v, mask],
        [[Shard(2)]] * 3 + [[Shard(0)]],
        requires_grad=[True, True, True, False],
    )
    with pytest.warns(ReplicatedFallbackWarning, match="ring attention cannot take an attn_mask"):
        run_case(case, compare_eager=False)


# --- torch's context_parallel API -------------------------------------------------------------------------------
def _cp_mean_grads(model: nn.Module, group=None) -> list[torch.Tensor]:
    """The one-process gradients: each cp rank's are its tokens' share of a mean over all tokens."""
    grads = []
    for p in model.parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        dist.all_reduce(g, group=group)
        grads.append(g / dist.get_world_size(group))
    return grads


@pytest.mark.parametrize("compiler", list(COMPILERS))
@pytest.mark.parametrize("seq", [16, 6], ids=["load-balanced", "contiguous"])
def test_context_parallel_trains_like_one_process(compiler, seq):
    """torch's recipe (its buffers sharded in place, its SDPA wrapper) under both front ends, both rotations: the
    one-process losses and gradients. 16 tokens at 2 ranks take the head-tail load balancer; 6 do not divide into
    its 4 chunks, so the shards are contiguous and the causal ring skips later chunks."""
    torch.manual_seed(0)
    ref = CausalAttention()
    x, target = torch.randn(2, seq, 16), torch.randn(2, seq, 16)
    F.mse_loss(ref(x), target).backward()
    expected_loss = F.mse_loss(ref(x), target).item()
    mesh = mesh_1d()
    for rotate in ROTATIONS:
        model = copy.deepcopy(ref)
        model.zero_grad()
        compiled = COMPILERS[compiler](model)
        xs, ts = x.clone(), target.clone()
        with rotation(rotate), context_parallel(mesh, buffers=[xs, ts], buffer_seq_dims=[1, 1]):
            loss = F.mse_loss(compiled(xs), ts)
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert abs(total.item() / world_size() - expected_loss) < 1e-5, rotate
        for got, p in zip(_cp_mean_grads(model), ref.parameters()):
            torch.testing.assert_close(got, p.grad, **PARITY_TOL)
        if compiler == "jit":
            initial = str(thunder.last_traces(compiled)[0])
            assert f"head_tail={seq == 16}" in initial and f"rotate='{rotate}'" in initial


def test_a_rotation_change_retraces():
    mesh = mesh_1d()
    model = thunder.jit(CausalAttention())
    x = torch.randn(2, 16, 16)
    outs = []
    for rotate in ["allgather", "alltoall", "allgather"]:
        xs = x.clone()
        with rotation(rotate), context_parallel(mesh, buffers=[xs], buffer_seq_dims=[1]):
            outs.append(model(xs))
    assert thunder.cache_misses(model) == 2 and thunder.cache_hits(model) == 1
    torch.testing.assert_close(outs[0], outs[1])


def test_context_parallel_refuses_what_the_ring_cannot_take():
    """Inside context_parallel a mask is refused (a gather would defeat it), naming the op, placements, a hint."""
    mesh = mesh_1d()

    def masked(x):
        q = k = v = x.unflatten(-1, (2, 8)).transpose(1, 2)
        # (torch's wrapper makes every tensor argument a sequence-sharded DTensor: a local mask of 8 rows)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(1, 1, 8, 16, dtype=torch.bool))

    x = torch.randn(2, 16, 16)
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        with pytest.raises(
            DTensorOpError, match=r"(?s)ring attention.*attn_mask.*Shard\(dim=2\).*hint: ring attention"
        ):
            thunder.jit(masked)(x)


def test_load_balancer_length_that_does_not_divide_is_refused():
    """The module API with the load balancer forced on and 6 tokens (3 per rank, not 2 chunks each)."""
    from torch.distributed.tensor.experimental._attention import (
        _disable_context_parallel_dispatcher,
        _enable_context_parallel_dispatcher,
    )

    mesh = mesh_1d()
    q, k, v = (distribute_tensor(make_full((1, 2, 6, 8), seed=s), mesh, [Shard(2)]) for s in (1, 2, 3))
    before = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = True
    _enable_context_parallel_dispatcher()
    try:
        with pytest.raises(DTensorOpError, match=r"(?s)load balancer's 4 chunks.*hint: inside context_parallel"):
            thunder.jit(_attention(True))(q, k, v)
    finally:
        _disable_context_parallel_dispatcher()
        _cp_options.enable_load_balance = before


@pytest.mark.world_size(4)
def test_q_and_kv_on_different_cp_meshes_are_refused():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    q = distribute_tensor(make_full((1, 2, 8, 8), seed=1), mesh["a"], [Shard(2)])
    k, v = (distribute_tensor(make_full((1, 2, 8, 8), seed=s), mesh["b"], [Shard(2)]) for s in (2, 3))
    with pytest.raises(
        DTensorOpError,
        match=r"(?s)ring attention.*different meshes.*hint: the inputs live on 2 different device meshes",
    ):
        thunder.jit(_attention(False))(q, k, v)


# --- models -----------------------------------------------------------------------------------------------------
def _llama_steps(model, ref, cfg, compiler, cp_mesh, *, steps: int = 3, cp_group=None) -> None:
    compiled = COMPILERS[compiler](model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(steps):
        g = torch.Generator().manual_seed(40 + step)
        tokens = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g)
        labels = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g)
        expected = llama_loss(ref(tokens), labels)
        expected.backward()
        buffers = [tokens.clone(), labels.clone(), model.freqs_cis]
        with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers[:2])):
            loss = llama_loss(compiled(buffers[0]), buffers[1])
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=cp_group)
        torch.testing.assert_close(total / dist.get_world_size(cp_group), expected.detach(), **PARITY_TOL)
        for got, (name, r) in zip(_cp_mean_grads(model, cp_group), ref.named_parameters()):
            torch.testing.assert_close(got, r.grad, **PARITY_TOL, msg=lambda m, n=name, i=step: f"step {i}: {n}: {m}")
        for p in model.parameters():  # every cp rank steps with the whole gradient, as FSDP over cp would give
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(local, group=cp_group)
            local /= dist.get_world_size(cp_group)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_llama_with_context_parallelism(compiler):
    """torchtitan's recipe: tokens, labels and the rotary table sharded along the sequence, cp = 2."""
    cfg = LlamaConfig(layers=1, seq=16)
    torch.manual_seed(0)
    ref = Llama(cfg)
    _llama_steps(copy.deepcopy(ref), ref, cfg, compiler, mesh_1d())


@pytest.mark.world_size(4)
@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_llama_with_context_and_tensor_parallelism(compiler):
    """cp x tp = 2 x 2: torchtitan's tensor-parallel plan on the tp dim, the ring on the cp dim."""
    cfg = LlamaConfig(layers=1, seq=16)
    torch.manual_seed(0)
    ref = Llama(cfg)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = apply_tp(copy.deepcopy(ref), mesh["tp"], loss_parallel=False)
    _llama_steps(model, ref, cfg, compiler, mesh["cp"], cp_group=mesh.get_group("cp"))


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_torch_transformer_with_a_long_sequence(compiler):
    """torch's test Transformer, 64 tokens at cp = 2. Its positions are ``arange(local length)``: the recipe shards
    its (frozen) position table with the tokens, as torchtitan shards its rotary table."""
    args = ModelArgs(n_layers=1, vocab_size=32, max_seq_len=64, dim=16, n_heads=4, dropout_p=0.0)
    torch.manual_seed(0)
    ref = Transformer(args)
    ref.pos_embeddings.weight.requires_grad_(False)
    model = copy.deepcopy(ref)
    compiled = COMPILERS[compiler](model)
    g = torch.Generator().manual_seed(7)
    tokens, labels = (torch.randint(0, 32, (2, 64), generator=g) for _ in range(2))
    expected = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten())
    expected.backward()
    buffers = [tokens.clone(), labels.clone(), model.pos_embeddings.weight]
    with context_parallel(mesh_1d(), buffers=buffers, buffer_seq_dims=[1, 1, 0]):
        loss = F.cross_entropy(compiled(buffers[0]).flatten(0, 1), buffers[1].flatten())
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total / world_size(), expected.detach(), **PARITY_TOL)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    for got, r in zip(_cp_mean_grads(nn.ParameterList([p for p in model.parameters() if p.requires_grad])), trainable):
        torch.testing.assert_close(got, r.grad, **PARITY_TOL)
