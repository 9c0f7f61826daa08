"""torch's own test Transformer, parallelized by its own plan, trains under thunder like the one-process model.

The model and the plan are torch's (``torch.testing._internal.distributed._tensor.common_dtensor``:
``Transformer`` and ``Transformer.parallelize``), so this checks a sharding recipe that we did not write:
vocab-parallel token embedding tied to the column-parallel output head, a row-parallel positional embedding,
causal SDPA on column-parallel DTensor projections (not local tensors), GELU MLP, LayerNorm, and with
sequence parallelism SequenceParallel norms and PrepareModuleInput. Every step's loss and every parameter's
gradient are compared with the unsharded model trained in one process with plain torch, over 3 SGD steps.
"""

import copy

from thunder_dtensor.testing import mesh_1d, world_size
from thunder_dtensor.testing.training import COMPILERS, PARITY_TOL, assert_grads_match, thunder_program

import pytest
import thunder
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

STEPS = 3
LR = 1e-2
BATCH, SEQ = 2, 8  # SEQ divides by 4: sequence parallelism shards it over the ranks


def _args() -> ModelArgs:
    """Tiny, deterministic (no dropout), sizes the plan can shard over 2 and 4 ranks.

    One block: a second traces the same ops again (suite time). Heads (4), vocab (8: the tied embedding and
    head shard on it) and max_seq_len (16: the positional embedding shards on it) divide by 4. Weight tying
    stays on, as in torch's own training test.
    """
    args = ModelArgs(n_layers=1, vocab_size=8, max_seq_len=16, dim=16, n_heads=4, dropout_p=0.0)
    assert args.weight_tying
    for size in (args.n_heads, args.vocab_size, args.max_seq_len, SEQ):
        assert size % world_size() == 0, (size, world_size())
    return args


def _batch(step: int, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens and targets on every rank (the plan's inputs are Replicate)."""
    g = torch.Generator().manual_seed(300 + step)
    return tuple(torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=g) for _ in range(2))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("compiler", COMPILERS)
def test_torch_test_transformer_trains_like_single_process(compiler: str, sequence_parallel: bool) -> None:
    if world_size() == 4 and (compiler, sequence_parallel) not in {("jit", True), ("thunderfx", False)}:
        pytest.skip("at 4 ranks one plan per front end (suite time)")
    args = _args()
    torch.manual_seed(0)  # the same initial weights on every rank
    ref = Transformer(args)
    model = Transformer.parallelize(copy.deepcopy(ref), mesh_1d(), use_seq_parallel=sequence_parallel)
    assert model.output.weight is model.tok_embeddings.weight  # the plan keeps the tie
    compiled = COMPILERS[compiler](model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    what = f"{compiler} {'sp' if sequence_parallel else 'tp'}"
    for step in range(STEPS):
        tokens, targets = _batch(step, args)
        logits = compiled(tokens)
        # the head's ColwiseParallel(output_layouts=Replicate()) hands back the full logits as a local tensor
        assert not isinstance(logits, DTensor) and logits.shape == (BATCH, SEQ, args.vocab_size)
        loss = _loss(logits, targets)
        loss.backward()
        ref_loss = _loss(ref(tokens), targets)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, **PARITY_TOL)
        assert_grads_match(model, ref, f"{what} step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    # steps 2 and 3 reuse the program compiled for step 1
    program = thunder_program(compiled, compiler)
    assert thunder.cache_misses(program) == 1 and thunder.cache_hits(program) == STEPS - 1
    # nothing stays eager: attention without dropout and every view, forward and backward, are lowered
    executed = str(thunder.last_traces(program)[-1]) + str(thunder.last_backward_traces(program)[-1])
    assert "not lowered" not in executed, [line for line in executed.splitlines() if "not lowered" in line]
