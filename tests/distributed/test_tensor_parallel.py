"""Tensor-parallel and sequence-parallel Transformers under thunder.jit and thunderfx train like the unsharded model.

The model (thunder_dtensor.testing.models.GPT) is parallelized with parallelize_module using
ColwiseParallel, RowwiseParallel (use_local_output True and False), SequenceParallel, PrepareModuleInput
and PrepareModuleOutput. Every step's loss and every parameter's gradient are compared with the same model
trained in one process without DTensor; collectives are counted against eager DTensor.
"""

import copy

from thunder_dtensor.testing import device_type, mesh_1d, mesh_2d
from thunder_dtensor.testing.models import GPT, GPTConfig, loss_fn, parallelize
from thunder_dtensor.testing.training import COMPILERS, assert_grads_match, thunder_program
from thunder_dtensor.testing.training import PARITY_TOL as TOL

import pytest
import thunder
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

STEPS = 5
LR = 1e-2


def _batch(step: int, batch: int, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    return idx.to(device_type()), tgt.to(device_type())


def _reference(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)  # the same initial weights on every rank
    return GPT(cfg).to(device_type())


# 4 ranks: the Llama tests train TP + SP at 4 ranks (tests/distributed/test_llama.py) (suite time)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_training_matches_single_process(sequence_parallel, compiler):
    cfg = GPTConfig()
    ref = _reference(cfg)
    model = parallelize(copy.deepcopy(ref), mesh_1d(), sequence_parallel=sequence_parallel)
    jitted = COMPILERS[compiler](model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=LR), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(STEPS):
        idx, tgt = _batch(step, 4, cfg)
        loss = loss_fn(jitted(idx), tgt)
        loss.backward()
        ref_loss = loss_fn(ref(idx), tgt)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL)
        assert_grads_match(model, ref, f"step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    # steps 2 to 5 reuse the program compiled for step 1
    program = thunder_program(jitted, compiler)
    assert thunder.cache_misses(program) == 1
    assert thunder.cache_hits(program) == STEPS - 1


@pytest.mark.world_size(4)
# thunder.jit on a 2x2 mesh: the FSDP2 + TP test (test_fsdp_tp.py) covers it (suite time)
@pytest.mark.parametrize("compiler", ["thunderfx"])
def test_2d_mesh_data_parallel_by_tensor_parallel(compiler):
    """dp x tp = 2 x 2: each dp rank trains on its half of the batch; gradients are averaged over dp."""
    cfg = GPTConfig(layers=1)
    mesh = mesh_2d()
    dp_group, dp_rank, dp_size = mesh.get_group("dp"), mesh.get_local_rank("dp"), mesh.size(0)
    ref = _reference(cfg)
    model = parallelize(copy.deepcopy(ref), mesh["tp"], sequence_parallel=False)
    jitted = COMPILERS[compiler](model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=LR), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(STEPS):
        idx, tgt = _batch(step, 4, cfg)
        half = slice(dp_rank * 2, dp_rank * 2 + 2)
        loss = loss_fn(jitted(idx[half]), tgt[half])
        loss.backward()
        for p in model.parameters():  # data-parallel gradient averaging (what DDP does)
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=dp_group)
            local.div_(dp_size)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=dp_group)
        ref_loss = loss_fn(ref(idx), tgt)
        ref_loss.backward()
        torch.testing.assert_close(global_loss / dp_size, ref_loss, **TOL)
        assert_grads_match(model, ref, f"step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    program = thunder_program(jitted, compiler)
    assert thunder.cache_misses(program) == 1 and thunder.cache_hits(program) == STEPS - 1


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def _step_counts(fn, model_input, tgt) -> tuple[dict, dict]:
    forward, backward = CommDebugMode(), CommDebugMode()
    with forward:
        loss = loss_fn(fn(model_input), tgt)
    with backward:
        loss.backward()
    return _counts(forward), _counts(backward)


# Collectives per training step of the 1-layer model, measured with CommDebugMode (eager DTensor counts the
# same). TP forward: all-reduces of the vocab-parallel embedding and the two row-parallel outputs, and the
# gather of the vocab-sharded logits; backward: all-reduces of column-parallel input gradients. SP turns
# the all-reduces into reduce-scatters and all-gathers.
EXPECTED_COMMS = {
    False: ({"all_reduce": 3, "all_gather_into_tensor": 1}, {"all_reduce": 5}),
    True: (
        {"reduce_scatter_tensor": 3, "all_gather_into_tensor": 4},
        {"reduce_scatter_tensor": 3, "all_gather_into_tensor": 4},
    ),
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_collectives_no_more_than_eager(sequence_parallel):
    # (2 ranks only: at 4 the op database counts every op's collectives against eager's)
    # eager DTensor has no fused-SDPA strategy on CPU: both run attention as matmul + softmax here.
    # (thunder.jit only: under CommDebugMode, a dispatch mode, dynamo runs the frame eagerly instead.)
    cfg = GPTConfig(layers=1, unfused_attention=True)
    eager = parallelize(_reference(cfg), mesh_1d(), sequence_parallel=sequence_parallel)
    jitted = thunder.jit(parallelize(_reference(cfg), mesh_1d(), sequence_parallel=sequence_parallel))
    idx, tgt = _batch(0, 4, cfg)
    loss_fn(jitted(idx), tgt).backward()  # compile first: the counted step is a cache hit
    thunder_counts = _step_counts(jitted, idx, tgt)
    assert thunder.cache_hits(jitted) == 1
    eager_counts = _step_counts(eager, idx, tgt)
    assert eager_counts == EXPECTED_COMMS[sequence_parallel]
    assert thunder_counts == EXPECTED_COMMS[sequence_parallel]
    for ours, theirs in zip(thunder_counts, eager_counts):
        assert all(ours.get(kind, 0) <= n for kind, n in theirs.items()) and set(ours) <= set(theirs)


FROZEN_PATTERNS = {
    "only_output_head": lambda name: name.startswith("head") or name.startswith("tok_emb"),  # tied weights
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("pattern", FROZEN_PATTERNS)
def test_frozen_parameter_patterns(pattern):
    trainable = FROZEN_PATTERNS[pattern]
    cfg = GPTConfig(layers=1, unfused_attention=True)
    ref = _reference(cfg)
    model = parallelize(copy.deepcopy(ref), mesh_1d(), sequence_parallel=True)
    eager = parallelize(copy.deepcopy(ref), mesh_1d(), sequence_parallel=True)
    for m in (ref, model, eager):
        for name, p in m.named_parameters():
            p.requires_grad_(trainable(name))
    jitted = thunder.jit(model)
    idx, tgt = _batch(0, 4, cfg)
    loss = loss_fn(jitted(idx), tgt)
    loss.backward()
    ref_loss = loss_fn(ref(idx), tgt)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_match(model, ref, pattern)
    # one more step, counted, against eager DTensor on the same frozen model
    for m in (model, eager):
        m.zero_grad()
    ours, theirs = _step_counts(jitted, idx, tgt), _step_counts(eager, idx, tgt)
    for o, t in zip(ours, theirs):
        assert all(o.get(kind, 0) <= t.get(kind, 0) for kind in set(o) | set(t)), (ours, theirs)


@pytest.mark.world_size(2)
def test_dropout_under_tensor_parallel():
    cfg = GPTConfig(layers=1, dropout=0.2)
    idx, tgt = _batch(0, 4, cfg)
    ref = _reference(cfg)
    model = parallelize(copy.deepcopy(ref), mesh_1d(), sequence_parallel=True)
    initial = copy.deepcopy(model.state_dict())
    jitted = thunder.jit(model)

    def train_losses(seed: int) -> list[float]:
        model.load_state_dict(initial)  # in place: same specs, so the compiled program is reused
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        torch.manual_seed(seed)
        losses = []
        for _ in range(3):
            loss = loss_fn(jitted(idx), tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    first, second = train_losses(7), train_losses(7)
    assert first == second  # the same seed gives the same masks, hence the same losses
    assert train_losses(8) != first  # and dropout is really on in training
    assert thunder.cache_misses(jitted) == 1

    model.load_state_dict(initial)
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(loss_fn(jitted(idx), tgt), loss_fn(ref(idx), tgt), **TOL)
