"""Hugging Face transformers' own tensor parallelism (``from_pretrained(..., distributed_config=
DistributedConfig(tp_plan="auto"))``) under ``thunder.jit`` and thunderfx: three AdamW steps with the
one-process model's losses, logits and every gradient. Tiny configs are saved locally (no downloads); the
tests skip without the ``hf`` extra (``pip install -e ".[hf]"``)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is the optional `hf` extra")

from thunder_dtensor.testing import world_size  # noqa: E402

import thunder  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,  # (every layer the same: one keeps the suite's time budget)
    num_attention_heads=4,
    num_key_value_heads=4,  # divisible by 2 and 4 ranks
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
CONFIGS: dict[str, Callable] = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(head_dim=16, **_COMMON),  # q_norm / k_norm: gradient hooks
    # experts: local tensors, autograd.Functions calling dist.all_reduce, a torch custom op (grouped_mm)
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_COMMON),
}


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, str]:
    """Each tiny model saved once by rank 0 (seeded), in a directory every rank reads."""
    where = [tempfile.mkdtemp(prefix="thunder_dtensor_hf_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    paths = {name: f"{where[0]}/{name}" for name in CONFIGS}
    if dist.get_rank() == 0:
        for name, config in CONFIGS.items():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config()).save_pretrained(paths[name])
    dist.barrier()
    return paths


def _load(path: str, tensor_parallel: bool) -> torch.nn.Module:
    config = DistributedConfig(tp_plan="auto", tp_size=world_size()) if tensor_parallel else None
    kwargs = {"distributed_config": config} if tensor_parallel else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _forward(model: torch.nn.Module, ids: torch.Tensor, frontend: str) -> Any:
    # thunder.jit: no KV cache (thunder 0.2.6 cannot trace its first torch.cat); thunderfx: the model's default
    # (without the cache, plain thunderfx fails on the one-process Mixtral in thunder's alias pass)
    return model(input_ids=ids, labels=ids, **({"use_cache": False} if frontend == "jit" else {}))


def _compile(model: torch.nn.Module, frontend: str) -> Callable:
    def loss_and_logits(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = _forward(model, ids, frontend)
        return out.loss, out.logits

    if frontend == "thunderfx":
        from thunder.dynamo import thunderfx

        return thunderfx(loss_and_logits)
    if frontend == "eager":
        return loss_and_logits
    return thunder.jit(loss_and_logits)


def _cases() -> list:
    # the suite's time budget: 2 ranks only (every case passed at 4 ranks by hand, docs/tensor_parallel.md);
    # Qwen3 and Mixtral under thunderfx (dynamo runs their hooks itself) were measured, not kept in the suite
    return [
        (name, frontend)
        for name in CONFIGS
        for frontend in ("jit", "thunderfx", "eager")
        if (name, frontend) not in {("qwen3", "thunderfx"), ("mixtral", "thunderfx")}
    ]


@pytest.mark.parametrize("name, frontend", _cases())
def test_tensor_parallel_model_trains_as_the_one_process_model(checkpoints, name, frontend):
    """Eager is the baseline the tolerance is set by: after an AdamW step float32 rounding differs by up to
    ~5e-5 (plain thunder.jit on the one-process Qwen3 differs from eager by 2e-5); a lost gradient all-reduce
    (Qwen3's q_norm / k_norm hooks) is off by 3e-3 to 1e-2."""
    reference, parallel = _load(checkpoints[name], False), _load(checkpoints[name], True)
    assert any(isinstance(p, DTensor) for p in parallel.parameters())
    compiled = _compile(parallel, frontend)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, parallel)]
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 16))
    for step in range(3):
        expected = _forward(reference, ids, frontend)
        expected.loss.backward()
        loss, logits = compiled(ids)
        loss.backward()
        torch.testing.assert_close(_full(loss), expected.loss, msg=f"step {step}: loss")
        torch.testing.assert_close(_full(logits), expected.logits, rtol=1e-4, atol=1e-4, msg=f"step {step}: logits")
        for (param_name, p), q in zip(reference.named_parameters(), parallel.parameters()):
            what = f"step {step}: {param_name}.grad"
            torch.testing.assert_close(_full(q.grad), p.grad, rtol=1e-3, atol=1e-4, msg=lambda m, w=what: f"{w}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_greedy_generate_with_a_jitted_forward(checkpoints):
    """``generate()`` calls the jitted forward under no_grad, where transformers swaps each parallel module's
    DTensor parameters for local tensors and back (a module-state write thunder now leaves alone) and
    all-reduces row-parallel outputs in place: the one-process model's tokens. Each new length retraces."""
    reference, parallel = _load(checkpoints["llama"], False), _load(checkpoints["llama"], True)
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (1, 5))
    expected = reference.generate(ids, max_new_tokens=2, do_sample=False, use_cache=False)
    parallel.forward = thunder.jit(parallel.forward)
    tokens = parallel.generate(ids, max_new_tokens=2, do_sample=False, use_cache=False)
    assert torch.equal(tokens, expected), (tokens, expected)
