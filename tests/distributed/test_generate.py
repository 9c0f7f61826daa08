"""Tensor-parallel inference: transformers' ``generate()`` with a KV cache on models loaded with ``tp_plan="auto"``,
the forward under ``thunder.jit`` (as transformers' docs compile it) or thunderfx, gives the one-process model's
tokens, greedy and sampling (a fixed seed on every rank); with ``StaticCache`` prefill and decode are two programs
however many tokens are generated. The unsharded model under plain thunder (its fixes switched on everywhere) gives
them too. ``scripts/generate_check.py`` (``make generate-check``) runs every case (Llama, Qwen3, Mixtral; both front
ends; both caches; 2 and 4 ranks); this file keeps the suite's time."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest

pytest.importorskip("transformers", reason="transformers is the optional `hf` extra")

from thunder_dtensor import fixes_everywhere  # noqa: E402
from thunder_dtensor.testing import zoo  # noqa: E402

import thunder  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

#: tokens generated per cache: a static cache's decode program is reused across steps (three tokens: two decode
#: calls); a dynamic cache traces a program per length, so two tokens keep the suite's time
NEW_TOKENS = {"static": 3, "dynamic": 2}
SEED = 7


@pytest.fixture(scope="module")
def models_dir() -> str:
    where = [tempfile.mkdtemp(prefix="thunder_dtensor_generate_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    return where[0]


@functools.cache
def _prepared(arch: str, where: str, cache: str) -> tuple[str, torch.Tensor, torch.Tensor]:
    """The tiny model (saved once) and the one-process model's tokens, greedy and sampled."""
    path = os.path.join(where, arch)
    with zoo.quiet():
        if not os.path.exists(os.path.join(path, "config.json")):
            zoo.save_tiny(arch, path)
        reference = zoo.load(path, False)
        prompt = zoo.make_prompt()
        greedy = zoo.generate_tokens(reference, prompt, NEW_TOKENS[cache], cache)
        sampled = zoo.generate_tokens(reference, prompt, NEW_TOKENS[cache], cache, seed=SEED)
    return path, greedy, sampled


def _generate_twice(model: torch.nn.Module, frontend: str, cache: str, greedy, sampled) -> None:
    prompt = zoo.make_prompt()
    with zoo.quiet():
        zoo.check_generate(model, frontend, prompt, greedy, cache)
        zoo.check_generate(model, frontend, prompt, sampled, cache, seed=SEED)


CASES = [
    ("llama", "jit", "static"),
    ("llama", "jit", "dynamic"),
    ("llama", "thunderfx", "static"),
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("arch, frontend, cache", CASES)
def test_generate_with_a_kv_cache_gives_the_one_process_tokens(models_dir, arch, frontend, cache):
    path, greedy, sampled = _prepared(arch, models_dir, cache)
    model = zoo.load(path, True)
    _generate_twice(model, frontend, cache, greedy, sampled)
    if frontend == "jit":
        misses = thunder.cache_misses(model.forward)
        # static: prefill and decode, for both generations; dynamic: a program per cache length, shared by both
        assert misses == (2 if cache == "static" else NEW_TOKENS[cache]), misses
    else:
        zoo._thunder_ran(model.forward, frontend)  # raises where dynamo's graphs all ran without thunder


@pytest.mark.world_size(2)
def test_generate_with_one_shot_all_reduces(models_dir):
    """``dtensor_one_shot_all_reduce_bytes``: transformers' own all-reduces (``torch.distributed.all_reduce`` of the
    row-parallel outputs) and the vocab-parallel embedding's each run as one all-gather and a local sum; the tokens
    are the one-process model's, and prefill and decode are still two programs."""
    path, greedy, sampled = _prepared("llama", models_dir, "static")
    model = zoo.load(path, True)
    prompt = zoo.make_prompt()
    options = {"dtensor_one_shot_all_reduce_bytes": 1 << 16}
    with zoo.quiet():
        zoo.check_generate(model, "jit", prompt, greedy, "static", options=options)
        zoo.check_generate(model, "jit", prompt, sampled, "static", seed=SEED, options=options)
    assert thunder.cache_misses(model.forward) == 2
    decode = [b.sym.name for b in thunder.last_traces(model.forward)[-1].bound_symbols]
    assert "all_reduce" not in decode and "all_reduce_" not in decode, decode
    layers = model.config.num_hidden_layers
    assert decode.count("all_gather_into_tensor") == 2 * layers + 2, decode  # + the embedding's, the logits' gather


@pytest.mark.world_size(4)
def test_generate_at_four_ranks(models_dir):
    """thunderfx here for the suite's time (4 ranks on 2 cores: ``thunder.jit``'s two traces take a minute)."""
    path, greedy, sampled = _prepared("llama", models_dir, "static")
    model = zoo.load(path, True)
    _generate_twice(model, "thunderfx", "static", greedy, sampled)
    zoo._thunder_ran(model.forward, "thunderfx")


@pytest.mark.world_size(2)
def test_the_unsharded_model_under_plain_thunder(models_dir):
    """What plain thunder failed on (the empty vector the dynamic cache starts from, the static cache's attributes
    set in the prefill, ``enable_gqa``) are thunder fixes: on everywhere, the one-process model generates too."""
    path, greedy, sampled = _prepared("llama", models_dir, "static")
    with fixes_everywhere("all"):
        _generate_twice(zoo.load(path, False), "jit", "static", greedy, sampled)
