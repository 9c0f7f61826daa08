"""The model zoo's CI subset: transformers' own tensor parallelism (``from_pretrained(..., distributed_config=
DistributedConfig(tp_plan="auto"))``) on tiny configs of architectures chosen for the mechanisms they cover, under
``thunder.jit`` (and thunderfx for Gemma2, GPT-OSS and GLM-4-MoE-Lite), against the one-process model (plain
torch): 2 SGD steps on a batch that contains the pad id, the loss, the logits and every gradient (elementwise and
by relative norm). ``make zoo`` (``scripts/zoo.py``) runs every architecture under both front ends, and greedy
``generate()``; this file keeps the suite's time: one layer each, the one-process reference computed once per
architecture for all front ends. Tiny configs are written locally (no downloads); the file skips without the
``hf`` extra (``pip install -e ".[hf]"``)."""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is the optional `hf` extra")

from thunder_dtensor.testing import zoo  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

# model type -> the mechanism of transformers' TP it brings (beyond the Llama plan every other one builds on)
CI_ARCHS: dict[str, str] = {
    "llama": "the base plan: colwise q/k/v and gate/up, rowwise o and down, vocab-parallel embedding with a "
    "padding_idx, lm_head colwise_gather_output; GQA",
    "qwen3": "q_norm / k_norm as replicated_with_grad_allreduce: gradient all-reduce hooks registered inside the "
    "forward",
    "mixtral": "MoE experts: packed_colwise (_StridedShard) gate_up, rowwise down, moe_tp_experts' _AllReduceBackward "
    "/ _AllReduceForward Functions, the grouped_mm custom op, the router's in-place top-k renormalization",
    "gemma2": "logit soft-capping (attention and final), the vocab-parallel embedding scaled by a normalizer, a tied "
    "lm_head, sliding-window attention",
    "phi3": "fused qkv_proj and gate_up_proj as colwise_gather_output, rowwise_split_input o_proj / down_proj",
    "qwen2_moe": "a shared expert with a sigmoid gate (replicated) beside sharded experts; sharded q/k/v biases",
    "olmo2": "q/k RMSNorm over the whole projection: colwise_gather_output q/k/v, rowwise_split_input o_proj",
    "gpt_neox": "parallel residual, biases everywhere (Shard(0) colwise, Replicate rowwise added after the "
    "all-reduce), a fused query_key_value, partial rotary",
    "cohere": "parallel attention / MLP residual, LayerNorm without bias, logit_scale, a tied lm_head",
    "codegen": "embedding_rowwise (the vocab-parallel embedding by its own name), a fused qkv_proj split into mp_num "
    "groups, parallel attention / MLP, GPT-J rotary",
    "arcee": "a plan without the embedding and lm_head (plain tensors around DTensor layers), an MLP without a gate "
    "(up_proj and down_proj only)",
    "cohere2": "sliding-window and global layers interleaved, parallel residual, LayerNorm without bias",
}

# one layer of the architectures whose zoo config keeps two (a sliding-window and a full-attention one): the
# sliding one, which has every mechanism above, for the suite's time
ONE_LAYER: dict[str, dict[str, Any]] = {
    "gemma2": {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]},
}

# thunderfx on these only, for the suite's time; `make zoo` runs thunderfx (and generate()) on every architecture.
# gemma2: the scaled vocab-parallel embedding, whose placements thunderfx's graph must see as eager's. gpt_oss (not
# under thunder.jit: its router's `topk(...).values` fails in thunder itself): the experts' grouped-mm custom op is
# split out of thunder's region and the bias is added in place into its result, a write thunder's region would lose
# the gradient of (`run_writes_into_graph_inputs_in_torch`). glm4_moe_lite: MLA attention, whose TP plan calls a
# custom autograd.Function (torch 2.13's dynamo form: `take_autograd_function_apply_without_a_tensor_mask`) and
# copies into views of a new tensor made outside thunder's region (the views are made in torch too)
THUNDERFX_ARCHS = ("gemma2", "gpt_oss", "glm4_moe_lite")


# Known failures of ours, open while others fix them: (arch, front end) -> reason. strict: a fix turns them red.
KNOWN: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def zoo_dir() -> str:
    where = [tempfile.mkdtemp(prefix="thunder_dtensor_zoo_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    return where[0]


@functools.cache
def _prepared(arch: str, where: str) -> tuple[str, zoo.Reference]:
    """The tiny model saved once (rank 0, seeded) and the one-process model's trajectory, shared by every front
    end (every rank calls this in the same order: the save ends in a barrier)."""
    path = os.path.join(where, arch)
    with zoo.quiet():
        zoo.save_tiny(arch, path, ONE_LAYER.get(arch))
        reference = zoo.record_reference(zoo.load(path, False), zoo.make_batch())
    return path, reference


def _tensor_parallel(path: str) -> torch.nn.Module:
    model = zoo.load(path, True)
    assert any(isinstance(p, DTensor) for p in model.parameters()), "transformers' TP sharded nothing"
    return model


def _cases(frontends: tuple[str, ...], archs: Any) -> list:
    return [
        pytest.param(arch, frontend, marks=[pytest.mark.xfail(reason=KNOWN[arch, frontend], strict=True)])
        if (arch, frontend) in KNOWN
        else (arch, frontend)
        for arch in archs
        for frontend in frontends
    ]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("arch, frontend", _cases(("eager", "jit"), CI_ARCHS) + _cases(("thunderfx",), THUNDERFX_ARCHS))
def test_tensor_parallel_model_trains_as_the_one_process_model(zoo_dir, arch, frontend):
    """2 SGD steps: loss (rtol 1e-5), logits (1e-4) and every gradient (relative norm of the difference < 5e-4,
    and elementwise rtol 1e-3 / atol 1e-5) against the one-process model. "eager" is transformers' TP without
    thunder: the baseline the bounds are set by (its worst relative norm over the whole zoo is about 5e-5, a lost
    all-reduce or a dropped padding_idx 1e-2 or more)."""
    path, reference = _prepared(arch, zoo_dir)
    with zoo.quiet():
        stats = zoo.check_training(_tensor_parallel(path), frontend, zoo.make_batch(), reference)
    assert stats.worst_rel_norm <= zoo.Tolerances().grad_rel_norm


@pytest.mark.world_size(2)
def test_the_checks_catch_a_dropped_padding_idx(zoo_dir):
    """The checks can fail: the TP model's embedding without its padding_idx (the forward is the same: the pad
    row is zero) gives the pad row a gradient, which the gradient checks report by name."""
    path, reference = _prepared("llama", zoo_dir)
    model = _tensor_parallel(path)
    model.model.embed_tokens.padding_idx = None
    with zoo.quiet(), pytest.raises(zoo.Mismatch, match=r"step 0: grad model\.embed_tokens\.weight: relative norm"):
        zoo.check_training(model, "eager", zoo.make_batch(), reference)


@pytest.mark.world_size(2)
def test_a_tiny_model_that_cannot_be_made_fails_on_every_rank(zoo_dir):
    """Rank 0 makes the tiny model; where transformers refuses it, every rank raises (the others used to wait at
    a barrier until the collective timeout, which ended a zoo run)."""
    with pytest.raises(Exception, match="no_such_architecture"):  # rank 0 its own error, the others a RemoteError
        zoo.save_tiny("no_such_architecture", os.path.join(zoo_dir, "none"))
    dist.barrier()  # every rank got here
