"""A model zoo: transformers' own tensor parallelism (``tp_plan="auto"``) on every architecture that has a plan.

Hand-picked models cover the mechanisms someone thought of; transformers ships about 160 tensor-parallel plans,
each with its own modules (soft-capped logits, fused projections, shared experts, attention sinks, MLA, ...).
:func:`discover` finds every causal-LM architecture of the installed transformers whose config has a
``base_model_tp_plan``, :func:`tiny_config` writes a tiny config of it (1 layer, hidden size 64, 4 heads, a
128-token vocabulary, 4 experts; no downloads), and :func:`run_arch` checks it under torchrun:

1. the one-process model (plain torch) trains 2 SGD steps on a batch that contains the pad id: the reference;
2. eager TP (``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``) must match it; if
   it does not, the architecture is "eager TP fails" and not held against thunder;
3. under each front end (``thunder.jit``, thunderfx) the TP model trains the same 2 steps: the loss, the logits
   and every gradient must match the reference, elementwise and by a relative-norm test;
4. for one architecture per family, greedy ``generate()`` with a compiled forward and transformers' default KV
   cache gives the reference's tokens.

A failure is then classified: the same check runs with plain thunder (the same front end) on the unsharded
one-process model; if it fails the same way, the failure is thunder's own, otherwise ours. Every rank runs the
same checks in the same order; each check's outcome is gathered so that all ranks agree on it (an exception on one
rank does not send the others down another path). There is no per-check timeout: one rank leaving a collective
early would leave the process group out of step for every later check, so a hang is left to the process group's
timeout. ``scripts/zoo.py`` (``make zoo``) prints the table; ``tests/distributed/test_zoo.py`` runs a subset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import re
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from thunder_dtensor import fixes_everywhere

import torch
import torch.distributed as dist

__all__ = [
    "CACHES",
    "FRONTENDS",
    "Arch",
    "Mismatch",
    "Outcome",
    "Reference",
    "Tolerances",
    "check_generate",
    "generate_tokens",
    "check_training",
    "discover",
    "format_table",
    "make_batch",
    "run_arch",
    "run_zoo",
    "tiny_config",
]

#: The front ends under test; "eager" is eager TP itself (checked first, against the one-process model).
FRONTENDS: tuple[str, ...] = ("jit", "thunderfx")

VOCAB = 128
BOS_ID, PAD_ID, EOS_ID = 0, 1, 2  # pad 1, as OLMo2's default: an id inside the vocabulary's first shard
BATCH, SEQ = 2, 16
STEPS = 2
LR = 0.1  # SGD: step 2's gradients are taken at different parameters

# Sizes every tiny config gets, where the config has the attribute: divisible by 2 and 4 ranks (heads, kv heads,
# experts, widths), one layer, every layer of it sparse (MoE) where the architecture has experts.
_SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "dense_intermediate_size": 128,
    "intermediate_size_mlp": 128,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "shared_experts_intermediate_size": 64,
    "num_hidden_layers": 1,
    "n_layer": 1,
    "num_layers": 1,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "first_k_dense_replace": 0,
    "num_dense_layers": 0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_layer_start_index": 0,
    "moe_layer_interval": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,  # shorter than the batch's sequence: the window matters
    "rotary_dim": 8,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "vocab_size_per_layer_input": VOCAB,  # Gemma 3n / 4's per-layer embeddings
    "hidden_size_per_layer_input": 16,
    "unpadded_vocab_size": VOCAB,
    "zero_expert_num": 2,  # LongCat's identity experts
    # Mamba / SSM layers: expand (2) x hidden = heads x head dim
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_d_head": 32,
    "mamba_head_dim": 32,
    "mamba_d_ssm": 128,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "tie_word_embeddings": None,  # None: the architecture's default
}

#: Per-architecture changes on top of :data:`_SIZES` (found by running the zoo: each says why).
OVERRIDES: dict[str, dict[str, Any]] = {
    # its rotary embedding reads rope parameters per layer type, and the default config has none
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # a layer of each kind is two layers: one input layer, one output layer, no recurrent block
    "dory": {
        "layer_types": ["sliding_attention", "full_attention"],
        "num_hidden_layers": 2,
        "n_input_layers": 1,
        "n_output_layers": 1,
        "n_recurrent_layers": 0,
    },
    "gemma3n_text": {"num_kv_shared_layers": 0},  # the default shares the KV of 15 layers
    "hrm_text": {"num_layers_per_stack": 1},  # 16 layers per stack by default
    # layer 0 Mamba with a dense MLP, layer 1 attention with experts (the default puts both every 2nd / 8th layer)
    "jamba": {
        "num_hidden_layers": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},  # the default has none
    # a partial rotary factor of 0.334 gives an odd rotary dim at head dim 16
    # and its sliding-window layers have twice the kv heads, which must not exceed the heads
    "mimo_v2_flash": {
        "num_attention_heads": 8,
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
            for kind in ("full_attention", "sliding_attention")
        },
    },
    "nemotron_h": {"n_groups": 1},  # 8 SSM groups by default, more than the tiny config's heads
    # its indexed attention needs the indexer's sizes, which the default leaves unset
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
}


# ----------------------------------------------------------------------------------------------------------------
# discovery
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """One ``model_type`` of the installed transformers; ``skip`` says why it is not run (None: it is)."""

    model_type: str
    config_class: str
    model_class: str | None
    family: str
    plan_size: int
    skip: str | None = None


def family_of(model_type: str) -> str:
    """The family a model type belongs to: its name without versions and variants (``qwen3_moe`` -> ``qwen``).

    ``gpt_neox`` / ``gpt_oss`` keep their second word: they share nothing but the prefix."""
    words = model_type.split("_")
    head = cast(re.Match[str], re.match(r"[a-z]*", words[0])).group() or words[0]  # (it matches the empty string)
    if head == "gpt" and len(words) > 1:
        return f"gpt_{words[1]}"
    return head


def discover() -> list[Arch]:
    """Every config class of the installed transformers with a non-empty ``base_model_tp_plan``, in name order.

    Run: those with a causal-LM class (``AutoModelForCausalLM``) whose config is their own, not a composite one.
    Skipped, with the reason: no causal-LM class (encoders, vision towers, a multimodal model's text part that
    only its multimodal model loads), or a composite (multimodal) config, whose text part has its own entry."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        try:
            config_class = CONFIG_MAPPING[model_type]
        except Exception:  # a config whose module cannot import here: not an architecture we can run
            continue
        plan = getattr(config_class, "base_model_tp_plan", None)
        if not plan:
            continue
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        skip = None
        if model_class is None:
            skip = "no causal-LM class (encoder, vision tower, or a text part only its multimodal model loads)"
        elif getattr(config_class, "sub_configs", None):
            subs = ", ".join(sorted(config_class.sub_configs))
            skip = f"multimodal (composite config: {subs}); a text model with a plan has its own entry"
        archs.append(Arch(model_type, config_class.__name__, model_class, family_of(model_type), len(plan), skip))
    return archs


def _layer_indices(default: dict[str, Any]) -> list[int] | None:
    """Which of the default config's layers the tiny one keeps: the first layer of each kind (``layer_types``,
    ``layers_block_type``), and a sparse (MoE) one where ``mlp_layer_types`` has one and no kept layer is
    sparse, so that a hybrid architecture keeps each of its mechanisms. None: the config has no per-layer kinds
    (then one layer, sparse where the architecture has experts: see :data:`_SIZES`)."""
    chosen: set[int] = set()
    for name in ("layer_types", "layers_block_type"):
        kinds = default.get(name)
        if isinstance(kinds, list):
            chosen.update(kinds.index(kind) for kind in dict.fromkeys(kinds))
    mlp = default.get("mlp_layer_types")
    if isinstance(mlp, list):
        sparse = [i for i, kind in enumerate(mlp) if kind != "dense"]
        if sparse and all(mlp[i] == "dense" for i in chosen if i < len(mlp)):
            chosen.add(sparse[0])
    return sorted(chosen) or None


# per-layer lists whose entries are layer indices, not values per layer
_INDEX_LISTS = ("full_attn_idxs", "moe_layers", "attn_layer_indices", "local_layer_ids", "ple_layer_ids")


def _per_layer_kwargs(default: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """The default config's per-layer fields cut down to the layers in ``keep`` (renumbered from 0)."""
    kinds = default.get("layer_types") or default.get("layers_block_type") or default.get("mlp_layer_types")
    n_default = len(cast(list, kinds))  # (called where _layer_indices found per-layer kinds)
    kwargs: dict[str, Any] = {}
    for name, value in default.items():
        if not isinstance(value, list):
            continue
        if name in _INDEX_LISTS:
            kwargs[name] = [new for new, old in enumerate(keep) if old in value]
        elif len(value) == n_default:
            kwargs[name] = [value[i] for i in keep]
    per_layer = default.get("per_layer_config")
    if isinstance(per_layer, dict):
        renumbered = {}
        for new, old in enumerate(keep):
            for key, overrides in per_layer.items():
                if int(key) == old:
                    renumbered[new] = {k: _SIZES.get(k, v) if isinstance(v, int) else v for k, v in overrides.items()}
        kwargs["per_layer_config"] = renumbered
    if "num_hidden_layers" in default:
        kwargs["num_hidden_layers"] = len(keep)
    return kwargs


def tiny_config(model_type: str, overrides: dict[str, Any] | None = None) -> Any:
    """A tiny config of ``model_type``: :data:`_SIZES` where the config has the attribute, the first layer of
    each kind (see :func:`_layer_indices`; else one layer), then :data:`OVERRIDES`. Built through the config's
    constructor, so that fields it derives follow; every dropout is 0 so that training is deterministic.
    ``overrides`` go last (the CI subset keeps one layer of a two-layer architecture)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class().to_dict()
    kwargs = {k: v for k, v in _SIZES.items() if k in default and v is not None}
    if "kv_lora_rank" in default and "head_dim" in kwargs:  # MLA: head_dim is the rope dim or the q/k head dim
        rope, nope = default.get("qk_rope_head_dim"), default.get("qk_nope_head_dim")
        if default["head_dim"] == rope:
            kwargs["head_dim"] = _SIZES["qk_rope_head_dim"]
        elif rope is not None and nope is not None and default["head_dim"] == rope + nope:
            kwargs["head_dim"] = _SIZES["qk_rope_head_dim"] + _SIZES["qk_nope_head_dim"]
    for name, value in default.items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            kwargs[name] = 0.0
    keep = _layer_indices(default)
    if keep is not None:
        kwargs.update(_per_layer_kwargs(default, keep))
    kwargs.update(OVERRIDES.get(model_type, {}))
    kwargs.update(overrides or {})
    return config_class(**kwargs)


def generation_archs(archs: Iterable[Arch]) -> set[str]:
    """One architecture per family checks ``generate()``: the family's first runnable one in name order."""
    chosen: dict[str, str] = {}
    for arch in sorted(archs, key=lambda a: a.model_type):
        if arch.skip is None:
            chosen.setdefault(arch.family, arch.model_type)
    return set(chosen.values())


# ----------------------------------------------------------------------------------------------------------------
# the checks
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerances:
    """How close the TP model's values must be to the one-process model's.

    The gradient bounds hold eager TP to about a tenth of them (float32 rounding of sharded reductions; measured
    over the whole zoo). A lost all-reduce, a dropped ``padding_idx`` or a wrong scale moves a gradient's relative
    norm by 1e-2 or more; the elementwise test catches a wrong slice of a large tensor that the norm would hide.
    """

    loss_rtol: float = 1e-5
    loss_atol: float = 1e-5
    logits_rtol: float = 1e-4
    logits_atol: float = 1e-4
    grad_rtol: float = 1e-3
    grad_atol: float = 1e-5
    grad_rel_norm: float = 5e-4


class Mismatch(AssertionError):
    """A value of the model under test differs from the one-process model's: ``test`` names which."""

    def __init__(self, test: str, detail: str) -> None:
        super().__init__(f"{test}: {detail}")
        self.test = test
        self.detail = detail


@dataclass
class Reference:
    """The one-process model's trajectory: per step the loss, the logits and every parameter's gradient; and
    greedy ``generate()``'s tokens."""

    losses: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    tokens: torch.Tensor | None = None


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``: random tokens (no special ids) with the pad id inside one row and at the end of
    the other, where the labels are -100. The same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    ids[0, SEQ // 3] = PAD_ID
    ids[1, -4:] = PAD_ID
    labels = ids.masked_fill(ids == PAD_ID, -100)
    return ids, labels


def make_prompt(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, 6), generator=generator)


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def _forward_kwargs(frontend: str) -> dict[str, Any]:
    # a training step needs no KV cache: none under thunder.jit (the cache would only add the cache's writes to the
    # program; generate() checks the cache). thunderfx runs the model's default (plain thunderfx fails on the
    # one-process Mixtral without the cache, in thunder's alias pass)
    return {} if frontend == "thunderfx" else {"use_cache": False}


def compile_step(model: torch.nn.Module, frontend: str) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """``(ids, labels) -> (loss, logits)`` of ``model``, run eagerly or under a thunder front end."""
    kwargs = _forward_kwargs(frontend)

    def loss_and_logits(ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=ids, labels=labels, **kwargs)
        return out.loss, out.logits

    return _compile(loss_and_logits, frontend)


def _compile(fn: Callable, frontend: str, **options: Any) -> Callable:
    """``fn`` under ``frontend`` ("eager", "jit", "thunderfx"), with thunder's compile ``options``."""
    if frontend == "eager":
        return fn
    import thunder

    if frontend == "jit":
        return thunder.jit(fn, **options)
    if frontend == "thunderfx":
        from thunder.dynamo import thunderfx

        torch._dynamo.reset()  # each case compiles afresh (dynamo's recompilation limit is per code object)
        return thunderfx(fn, **options)
    raise ValueError(f"unknown front end {frontend!r}")


def _agree(error: BaseException | None, where: str) -> None:
    """Every rank learns whether any rank failed ``where``; all raise the first failing rank's error, so that all
    take the same path afterwards."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else _describe(error)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs is None:
            continue
        if error is not None and theirs == mine:
            raise error
        kind, test, message = theirs
        if kind == "Mismatch":
            raise Mismatch(test, f"{message} (rank {rank})")
        raise RemoteError(kind, f"{message} (on rank {rank})")


class RemoteError(RuntimeError):
    """Another rank's exception, by its type's name and message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _describe(error: BaseException) -> tuple[str, str, str]:
    """(type name, which test, message): what the table shows of a failure, and what two failures are compared by."""
    if isinstance(error, Mismatch):
        return "Mismatch", error.test, error.detail
    kind = error.kind if isinstance(error, RemoteError) else type(error).__name__
    message = " ".join(str(error).split())
    return kind, "error", message


def _compare(what: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    if actual.shape != expected.shape:
        raise Mismatch(what, f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    diff = (actual.double() - expected.double()).abs()
    bad = diff > atol + rtol * expected.double().abs()
    if bool(bad.any()):
        where = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise Mismatch(
            what,
            f"{int(bad.sum())} of {bad.numel()} elements differ, max abs diff {float(diff.max()):.3g} "
            f"(first at {where}: {float(actual[where]):.6g} vs {float(expected[where]):.6g})",
        )


def _rel_norm(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||; 0 for two zero tensors, inf for a nonzero one against zero."""
    num = float((actual.double() - expected.double()).norm())
    den = float(expected.double().norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


@dataclass
class TrainStats:
    """What a passing training check measured: the worst gradient relative norm (and whose), and notes (thunderfx:
    how dynamo's graphs were split)."""

    worst_rel_norm: float = 0.0
    worst_param: str = ""
    notes: str = ""


def _compare_step(
    step: int,
    loss: torch.Tensor,
    logits: torch.Tensor,
    grads: dict[str, torch.Tensor | None],
    reference: Reference,
    tol: Tolerances,
    stats: TrainStats,
) -> None:
    _compare(f"step {step}: loss", loss.detach().reshape(()), reference.losses[step], tol.loss_rtol, tol.loss_atol)
    _compare(f"step {step}: logits", logits.detach(), reference.logits[step], tol.logits_rtol, tol.logits_atol)
    expected_grads = reference.grads[step]
    if set(grads) != set(expected_grads):
        missing, extra = sorted(set(expected_grads) - set(grads)), sorted(set(grads) - set(expected_grads))
        raise Mismatch(f"step {step}: parameters", f"missing {missing}, unexpected {extra}")
    for name, expected in expected_grads.items():
        actual = grads[name]
        what = f"step {step}: grad {name}"
        if actual is None or expected is None:
            # a parameter the loss does not reach: no gradient (or an all-zero one) on both sides
            present = actual if actual is not None else expected
            if present is not None and bool(present.any()):
                raise Mismatch(what, "a gradient on one side only" + (" (expected None)" if expected is None else ""))
            continue
        rel = _rel_norm(actual, expected)
        if rel > tol.grad_rel_norm:
            raise Mismatch(what, f"relative norm of the difference {rel:.3g} > {tol.grad_rel_norm:g}")
        _compare(what, actual, expected, tol.grad_rtol, tol.grad_atol)
        if rel > stats.worst_rel_norm:
            stats.worst_rel_norm, stats.worst_param = rel, name


def _train(
    model: torch.nn.Module, step_fn: Callable, batch: tuple[torch.Tensor, torch.Tensor], steps: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]]:
    """``steps`` SGD steps of ``model``, calling ``step_fn`` (its loss and logits, maybe compiled); yields each
    step's full loss, logits and gradients (DTensors gathered, on every rank in the same order) before the
    optimizer step."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = batch
    for step in range(steps):
        torch.manual_seed(step)  # training-mode randomness (PhiMoE's sparse mixer, ...): the same draws each run
        loss, logits = step_fn(ids, labels)
        loss.backward()
        grads = {name: _full(p.grad) for name, p in model.named_parameters() if p.requires_grad}
        yield step, cast(torch.Tensor, _full(loss)).detach(), cast(torch.Tensor, _full(logits)).detach(), grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def record_reference(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int = STEPS) -> Reference:
    """The one-process model's (plain torch, eager) losses, logits and gradients over ``steps`` SGD steps."""
    reference = Reference()
    for _, loss, logits, grads in _train(model, compile_step(model, "eager"), batch, steps):
        reference.losses.append(loss.clone())
        reference.logits.append(logits.clone())
        reference.grads.append({k: None if g is None else g.detach().clone() for k, g in grads.items()})
    return reference


def check_training(
    model: torch.nn.Module,
    frontend: str,
    batch: tuple[torch.Tensor, torch.Tensor],
    reference: Reference,
    tol: Tolerances = Tolerances(),
) -> TrainStats:
    """Train ``model`` (TP or not) under ``frontend`` as many steps as ``reference`` has, comparing each step with
    it; raises :class:`Mismatch` at the first difference. The ranks agree after every step."""
    stats = TrainStats()
    step_fn = compile_step(model, frontend)
    for step, loss, logits, grads in _train(model, step_fn, batch, len(reference.losses)):
        error = None
        try:
            _compare_step(step, loss, logits, grads, reference, tol, stats)
        except Mismatch as mismatch:
            error = mismatch
        _agree(error, f"step {step}")
    if frontend != "eager":
        stats.notes = _thunder_ran(step_fn, frontend)
    return stats


def _thunder_ran(compiled: Any, frontend: str) -> str:
    """Raise if thunder compiled nothing (a front end silently running eager would pass every check); for thunderfx,
    say how dynamo's graphs were split."""
    if frontend == "jit":
        import thunder

        if thunder.cache_misses(compiled) < 1:
            raise Mismatch("thunder ran", "thunder.jit compiled nothing")
        return ""
    infos = compiled._backend.subgraph_infos
    thunder_fns = sum(len(info.thunder_compiled_fns or ()) for info in infos)
    if thunder_fns == 0:
        raise Mismatch("thunder ran", f"thunderfx: {len(infos)} dynamo graph(s), none compiled by thunder")
    reasons = [r for info in infos for r in (info.split_reasons or ())]
    split = sorted({_split_op(r) for r in reasons})
    note = f"{len(infos)} graph(s), {thunder_fns} thunder region(s)"
    return note + (f"; split off: {', '.join(split)}" if split else "")


def _split_op(reason: Any) -> str:
    """The op a thunderfx split reason names (its node's target)."""
    info = getattr(reason, "info", None) or str(reason)
    match = re.search(r"target: (.*?)(?: is not| only has| has been|, see|$)", info)
    target = match.group(1) if match else info
    target = re.sub(r"<(built-in )?(function|method) (\S+?)(?: of .*)?>", r"\3", target)
    return target[:60]


#: the KV caches ``generate()`` is checked with: transformers' default (``DynamicCache``, grown by ``torch.cat``),
#: ``StaticCache`` (preallocated, written with ``index_copy_``) and none (every step recomputes the prefix)
CACHES = ("dynamic", "static", "none")


def generate_tokens(
    model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, cache: str = "dynamic", seed: int | None = None
) -> torch.Tensor:
    """``model.generate()``: greedy, or sampling from the whole distribution after ``torch.manual_seed(seed)``
    (the same on every rank, so every rank draws the same tokens); with the KV cache ``cache`` (:data:`CACHES`)."""
    model.eval()
    kwargs: dict[str, Any] = {"use_cache": False} if cache == "none" else {}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    if seed is not None:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    else:
        kwargs["do_sample"] = False
    return model.generate(  # type: ignore[operator]  # (a transformers model's)
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        pad_token_id=PAD_ID,
        **kwargs,
    )


_COMPILED_FOR_GENERATE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def check_generate(
    model: torch.nn.Module,
    frontend: str,
    prompt: torch.Tensor,
    expected: torch.Tensor,
    cache: str = "dynamic",
    seed: int | None = None,
    options: dict | None = None,
) -> None:
    """``generate()`` of ``model`` with its forward under ``frontend`` (as transformers' docs compile it; thunder's
    compile ``options``) and the KV cache ``cache`` must give ``expected``."""
    if frontend != "eager" and model not in _COMPILED_FOR_GENERATE:  # (one compiled forward per model)
        model.forward = _compile(model.forward, frontend, **(options or {}))
        _COMPILED_FOR_GENERATE.add(model)
    error = None
    try:
        tokens = generate_tokens(model, prompt, expected.shape[-1] - prompt.shape[-1], cache, seed)
        if not torch.equal(tokens, expected):
            raise Mismatch("generate", f"tokens {tokens.tolist()}, expected {expected.tolist()}")
    except Mismatch as mismatch:
        error = mismatch
    _agree(error, "generate")


# ----------------------------------------------------------------------------------------------------------------
# one architecture, and the whole zoo
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One row of the table: ``arch`` under ``frontend`` ("eager" is eager TP), check "train" or "generate".

    ``status``: "ok", "fails" (under a thunder front end), "eager TP fails" (transformers' TP differs from the
    one-process model or raises: not held against thunder), "one-process fails" (transformers itself on the tiny
    config) or "setup fails" (the tiny config cannot be built or saved). For a failure, ``alone`` says what plain
    thunder (the same front end) does on the unsharded model, and ``verdict`` whose bug it is."""

    arch: str
    frontend: str
    check: str
    status: str
    test: str = ""
    error: str = ""
    alone: str = ""
    verdict: str = ""
    seconds: float = 0.0
    rel_norm: float | None = None
    worst_param: str = ""
    notes: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        """One line: what failed and how, for an assertion message or a log."""
        where = f"{self.arch} [{self.frontend}] {self.check}"
        if self.ok:
            return f"{where}: ok"
        text = f"{where}: {self.status}: {self.test}: {self.error}"
        if self.alone:
            text += f" | plain thunder, unsharded: {self.alone} ({self.verdict})"
        return text


def _attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """Run ``fn`` on every rank; (its result, None), or (None, the failure every rank agrees on)."""
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # a check's failure is a row of the table, not the end of the run
        error = exc
    try:
        _agree(error, "")
    except Exception as agreed:
        return None, agreed
    return result, None


def _normalized(message: str) -> str:
    return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?(e-?\d+)?", "#", message)[:80]


def same_failure(a: BaseException, b: BaseException) -> bool:
    """Two failures are the same if they fail the same test (for a mismatch) or raise the same type of error with
    the same message up to numbers."""
    (kind_a, test_a, msg_a), (kind_b, test_b, msg_b) = _describe(a), _describe(b)
    if kind_a != kind_b or test_a != test_b:
        return False
    return kind_a == "Mismatch" or _normalized(msg_a) == _normalized(msg_b)


def _short(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _fill(outcome: Outcome, error: BaseException) -> Outcome:
    kind, test, message = _describe(error)
    outcome.test = test
    outcome.error = _short(message if kind == "Mismatch" else f"{kind}: {message}")
    return outcome


def load(path: str, tensor_parallel: bool) -> torch.nn.Module:
    """The saved tiny model, in float32: one-process, or sharded by transformers' own TP over all ranks."""
    from transformers import AutoModelForCausalLM

    if not tensor_parallel:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
    with _reused_device_meshes():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)


_MESHES: dict[tuple, Any] = {}


@contextlib.contextmanager
def _reused_device_meshes() -> Iterator[None]:
    """Each TP load builds two 4-D device meshes (8 process groups) that nothing frees; with gloo every group
    keeps three threads, and a zoo of hundreds of loads ends up with thousands of them, most runnable, slowing
    every check. A mesh of the same shape, device and dim names is equal to a new one (DTensor compares meshes by
    value), so loads after the first reuse it."""
    build = dist.init_device_mesh

    def reuse(device_type: str, mesh_shape: tuple[int, ...], **kwargs: Any) -> Any:
        key = (device_type, tuple(mesh_shape), tuple(kwargs.get("mesh_dim_names") or ()), dist.get_world_size())
        if key not in _MESHES or len(kwargs) > 1:
            mesh = build(device_type, mesh_shape, **kwargs)
            if len(kwargs) > 1:  # anything beyond the dim names: not a mesh to share
                return mesh
            _MESHES[key] = mesh
        return _MESHES[key]

    dist.init_device_mesh = reuse
    try:
        yield
    finally:
        dist.init_device_mesh = build


def save_tiny(model_type: str, path: str, overrides: dict[str, Any] | None = None) -> None:
    """Rank 0 writes the seeded tiny model of ``model_type`` to ``path`` (which every rank reads); where it fails
    (a config transformers refuses), every rank raises its error (a barrier alone left the others waiting for
    it until the collective timeout, which ended a zoo run)."""
    error = None
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        try:
            AutoModelForCausalLM.from_config(tiny_config(model_type, overrides)).save_pretrained(path)
        except Exception as failed:
            error = failed
    _agree(error, f"saving the tiny {model_type}")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' and thunder's warnings and logs off: a zoo run prints its table, not thousands of notes."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    loggers = [logging.getLogger(n) for n in ("torch.distributed.tensor._redistribute", "torch._dynamo", "thunder")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run_arch(
    model_type: str,
    path: str,
    frontends: Sequence[str] = FRONTENDS,
    generate: bool = False,
    tol: Tolerances = Tolerances(),
    max_new_tokens: int = 3,
    report: Callable[[Outcome], None] | None = None,
    train: bool = True,
) -> list[Outcome]:
    """All checks of one architecture (see the module's docstring), its tiny model saved at ``path``; every rank
    calls this with the same arguments. Returns the rows, in order; ``report`` sees each as it is made.
    ``train=False`` checks only ``generate()`` (to fill a table's generate column without retraining)."""
    outcomes: list[Outcome] = []

    def add(outcome: Outcome) -> Outcome:
        outcomes.append(outcome)
        if report is not None:
            report(outcome)
        return outcome

    started = time.perf_counter()
    _, error = _attempt(lambda: save_tiny(model_type, path))
    if error is not None:
        add(_fill(Outcome(model_type, "-", "train", "setup fails", seconds=time.perf_counter() - started), error))
        return outcomes
    batch, prompt = make_batch(), make_prompt()

    def make_reference() -> Reference:
        reference = record_reference(load(path, False), batch)
        if generate:
            reference.tokens = generate_tokens(load(path, False), prompt, max_new_tokens)
        return reference

    reference, error = _attempt(make_reference)
    if error is not None:
        add(_fill(Outcome(model_type, "-", "train", "one-process fails", seconds=time.perf_counter() - started), error))
        return outcomes

    checks = (["train"] if train else []) + (["generate"] if generate else [])

    def run(check: str, frontend: str, tensor_parallel: bool) -> TrainStats | None:
        model = load(path, tensor_parallel)
        if tensor_parallel and not any(_is_dtensor(p) for p in model.parameters()):
            raise Mismatch("sharded", "transformers' TP left every parameter unsharded")
        if check == "train":
            return check_training(model, frontend, batch, reference, tol)
        check_generate(model, frontend, prompt, reference.tokens)
        return None

    for frontend in ("eager", *frontends):
        for check in checks:
            started = time.perf_counter()
            stats, error = _attempt(functools.partial(run, check, frontend, True))
            outcome = Outcome(model_type, frontend, check, "ok")
            if isinstance(stats, TrainStats):
                outcome.rel_norm, outcome.notes = stats.worst_rel_norm, stats.notes
                outcome.worst_param = stats.worst_param
            if error is not None:
                _fill(outcome, error)
                outcome.status = "eager TP fails" if frontend == "eager" else "fails"
                if frontend != "eager":
                    with fixes_everywhere("all"):  # thunder as the TP model meets it: with the scoped fixes on
                        _, alone_error = _attempt(functools.partial(run, check, frontend, False))
                    if alone_error is None:
                        outcome.alone, outcome.verdict = "passes", "ours"
                    elif same_failure(alone_error, error):
                        outcome.alone, outcome.verdict = "fails the same way", "thunder's own"
                    else:
                        kind, test, message = _describe(alone_error)
                        outcome.alone = _short(f"fails differently: {test}: {kind}: {message}", 200)
                        outcome.verdict = "ours"
            outcome.seconds = time.perf_counter() - started
            add(outcome)
            if frontend == "eager" and error is not None:
                # eager TP is what the front ends are held to: without it there is nothing to compare them with
                return outcomes
    return outcomes


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def run_zoo(
    archs: Sequence[Arch],
    frontends: Sequence[str] = FRONTENDS,
    generate: str = "family",
    tol: Tolerances = Tolerances(),
    max_new_tokens: int = 3,
    report: Callable[[Outcome], None] | None = None,
    train: bool = True,
) -> list[Outcome]:
    """:func:`run_arch` for each runnable architecture (``generate``: "family" for one per family, "all" or
    "none"; ``train=False``: only those that check ``generate()``, and only that); skipped ones get a row saying
    why. Every rank calls this with the same arguments."""
    with_generate = {a.model_type for a in archs} if generate == "all" else set()
    if generate == "family":
        with_generate = generation_archs(archs)
    where: list[Any] = [tempfile.mkdtemp(prefix="thunder_dtensor_zoo_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    outcomes: list[Outcome] = []
    with quiet():
        for arch in archs:
            if arch.skip is not None:
                outcome = Outcome(arch.model_type, "-", "-", "skipped", error=arch.skip)
                outcomes.append(outcome)
                if report is not None:
                    report(outcome)
                continue
            if not train and arch.model_type not in with_generate:
                continue
            path = os.path.join(where[0], arch.model_type)
            outcomes += run_arch(
                arch.model_type, path, frontends, arch.model_type in with_generate, tol, max_new_tokens, report, train
            )
            dist.barrier()
            if dist.get_rank() == 0:
                _remove(path)
    return outcomes


def _remove(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------------------------


def _cell(outcome: Outcome | None) -> str:
    if outcome is None:
        return ""
    if outcome.ok:
        if outcome.rel_norm is not None:
            return f"ok ({outcome.rel_norm:.1e})"
        return "ok"
    text = f"**{outcome.status}**: {outcome.test}: {outcome.error}"
    return text.replace("|", "\\|").replace("\n", " ")


def format_table(outcomes: Sequence[Outcome], archs: Sequence[Arch] = ()) -> str:
    """The markdown table: a row per architecture and front end (training; generate where checked; what plain
    thunder does on the unsharded model where a check failed), then the counts."""
    families = {a.model_type: a.family for a in archs}
    rows: dict[tuple[str, str], dict[str, Outcome]] = {}
    for outcome in outcomes:
        rows.setdefault((outcome.arch, outcome.frontend), {})[outcome.check] = outcome
    lines = [
        "| arch | family | front end | training: ok (worst grad rel-norm) / which test / error | generate "
        "| plain thunder, unsharded | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for (arch, frontend), by_check in rows.items():
        train = by_check.get("train") or by_check.get("-")
        gen = by_check.get("generate")
        alone = "; ".join(
            f"{o.check}: {o.alone} → {o.verdict}" for o in (train, gen) if o is not None and o.alone
        ).replace("|", "\\|")
        notes = train.notes if train is not None else ""
        if train is not None and train.status == "skipped":
            cell = f"skipped: {train.error}"
        else:
            cell = _cell(train)
        lines.append(
            f"| {arch} | {families.get(arch, family_of(arch))} | {frontend} | {cell} | {_cell(gen)} | {alone} "
            f"| {notes} |"
        )
    lines += ["", summarize(outcomes)]
    return "\n".join(lines)


def summarize(outcomes: Sequence[Outcome]) -> str:
    """Counts: architectures run and skipped; per front end how many passed every check; failures by verdict."""
    archs = {o.arch for o in outcomes}
    skipped = {o.arch for o in outcomes if o.status == "skipped"}
    eager_fails = {o.arch for o in outcomes if o.status == "eager TP fails"}
    setup = {o.arch for o in outcomes if o.status in ("setup fails", "one-process fails")}
    runnable = archs - skipped - eager_fails - setup
    lines = [
        f"{len(archs)} architectures: {len(skipped)} skipped, {len(setup)} whose tiny one-process model fails, "
        f"{len(eager_fails)} where eager TP fails or differs, {len(runnable)} checked under the front ends."
    ]
    frontends = sorted({o.frontend for o in outcomes} - {"-", "eager"})
    for frontend in frontends:
        mine = [o for o in outcomes if o.frontend == frontend]
        passed = {o.arch for o in mine} - {o.arch for o in mine if not o.ok}
        ours = {o.arch for o in mine if o.verdict == "ours"}
        thunders = {o.arch for o in mine if o.verdict == "thunder's own"}
        lines.append(
            f"{frontend}: {len(passed)} of {len({o.arch for o in mine})} pass every check; failures ours: "
            f"{len(ours)} ({', '.join(sorted(ours))}); thunder's own: {len(thunders)} ({', '.join(sorted(thunders))})"
        )
    return "\n".join(lines)


def outcomes_to_json(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(o) for o in outcomes]
