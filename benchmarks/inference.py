"""Tensor-parallel inference with a KV cache: first-token and per-token latency of greedy decoding.

Run with ``torchrun --nproc-per-node 2 benchmarks/inference.py`` (``make bench``). The model is a small Llama
(transformers, ``tp_plan="auto"``: attention and MLP column / row sharded, the embedding vocab-parallel, the
head gathering its output) with a static KV cache; each round prefills ``--prompt`` tokens, then decodes
``--new`` tokens one at a time, greedily (the loop ``generate()`` runs, written out so that each call is timed).
Contenders, all on the same sharded model and the same cache kind:

- ``eager``: transformers' eager TP;
- ``torch.compile``: the forward under ``torch.compile(mode="default")`` (static cache, as transformers' docs);
- ``thunder``: the forward under ``thunder.jit``; ``thunderfx``: under ``thunder.dynamo.thunderfx``;
- ``thunder_inductor``: ``thunder.jit`` with thunder's torch.compile executor listed first: inductor compiles the
  lowered step, collectives included, as one graph; ``thunderfx_inductor``: thunderfx with the same executor list;
- ``limit``: the same decoding hand-written on each rank's local shards (the weights the TP model holds, the
  model's own norms and rotary embedding, one all-reduce after each row-parallel projection and the embedding,
  one all-gather of the logits), run eagerly: what the program costs with nothing in between;
- ``..._one_shot``: the thunder contenders with ``dtensor_one_shot_all_reduce_bytes=65536`` (each all-reduce of a
  decode step, 1 KiB, and of the prefill, 64 KiB, runs as one all-gather and a local sum), and ``limit_one_shot``,
  the limit written with the same all-gather and sum: the limit of that program.

Every contender must produce the same tokens (checked each round). First token = the prefill call; per token =
the mean decode call. Medians over interleaved rounds (A B C ... A B C), each call timed between barriers, the
maximum over ranks; compile times (the first round) are reported separately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor.testing import shutdown_distributed

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

CONTENDERS = (
    "eager",
    "torch.compile",
    "thunder",
    "thunder_inductor",
    "thunderfx",
    "thunderfx_inductor",
    "limit",
    "thunder_one_shot",
    "thunder_inductor_one_shot",
    "thunderfx_one_shot",
    "thunderfx_inductor_one_shot",
    "limit_one_shot",
)
#: the ``_one_shot`` contenders' ``dtensor_one_shot_all_reduce_bytes``
ONE_SHOT_BYTES = 65536


def _config(args: argparse.Namespace):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.prompt + args.new + 8,
        tie_word_embeddings=False,
    )


def _load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config).eval()


class LocalLlama:
    """Greedy decoding on the local shards of a transformers TP Llama: local heads and MLP columns, the cache of
    the local kv heads, one all-reduce per row-parallel projection and for the vocab-parallel embedding."""

    def __init__(self, model: torch.nn.Module, max_len: int, one_shot: bool = False) -> None:
        self.model, self.config, self.one_shot = model, model.config, one_shot
        world, rank = dist.get_world_size(), dist.get_rank()

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        inner = model.model
        self.embed = local(inner.embed_tokens.weight)
        self.vocab_start = rank * self.embed.shape[0]
        self.layers = [
            {
                "norm1": layer.input_layernorm,
                "norm2": layer.post_attention_layernorm,
                **{n: local(getattr(layer.self_attn, n).weight) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                **{n: local(getattr(layer.mlp, n).weight) for n in ("gate_proj", "up_proj", "down_proj")},
            }
            for layer in inner.layers
        ]
        self.norm, self.rotary, self.head = inner.norm, inner.rotary_emb, local(model.lm_head.weight)
        self.head_dim = self.config.hidden_size // self.config.num_attention_heads
        self.heads = self.config.num_attention_heads // world
        self.kv_heads = self.config.num_key_value_heads // world
        shape = (1, self.kv_heads, max_len, self.head_dim)
        self.cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in self.layers]
        self.max_len = max_len

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks: c10d's all-reduce, or (``one_shot``) one all-gather and a local sum."""
        if not self.one_shot:
            dist.all_reduce(t)
            return t
        world = dist.get_world_size()
        gathered = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype)
        dist.all_gather_into_tensor(gathered, t.contiguous())
        return gathered.view(world, *t.shape).sum(0)

    def reset(self) -> None:
        for k, v in self.cache:
            k.zero_()
            v.zero_()

    def __call__(self, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        local_ids = ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.embed.shape[0])
        x = F.embedding(local_ids.masked_fill(outside, 0), self.embed).masked_fill(outside[..., None], 0)
        x = self.all_reduce(x)
        cos, sin = self.rotary(x, position[None])
        length = ids.shape[1]
        visible = torch.arange(self.max_len)[None, :] <= position[:, None]  # causal over the whole cache
        for layer, (k_cache, v_cache) in zip(self.layers, self.cache):
            h = layer["norm1"](x)
            q = F.linear(h, layer["q_proj"]).view(1, length, self.heads, self.head_dim).transpose(1, 2)
            k = F.linear(h, layer["k_proj"]).view(1, length, self.kv_heads, self.head_dim).transpose(1, 2)
            v = F.linear(h, layer["v_proj"]).view(1, length, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k_cache.index_copy_(2, position, k)
            v_cache.index_copy_(2, position, v)
            attn = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=visible, enable_gqa=True)
            out = F.linear(attn.transpose(1, 2).reshape(1, length, -1), layer["o_proj"])
            out = self.all_reduce(out)
            x = x + out
            h = layer["norm2"](x)
            out = F.linear(F.silu(F.linear(h, layer["gate_proj"])) * F.linear(h, layer["up_proj"]), layer["down_proj"])
            out = self.all_reduce(out)
            x = x + out
        logits = F.linear(self.norm(x[:, -1:]), self.head)
        gathered = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, logits)
        return torch.cat(gathered, dim=-1)


def _decoder(name: str, model: torch.nn.Module, max_len: int) -> Callable[[torch.Tensor, int], tuple]:
    """``decode(prompt, new) -> (tokens, [seconds per call])`` for one contender."""
    if name in ("limit", "limit_one_shot"):
        local = LocalLlama(model, max_len, one_shot=name == "limit_one_shot")

        def step_limit(ids: torch.Tensor, position: torch.Tensor, cache: object) -> torch.Tensor:
            return local(ids, position)

        step, reset = step_limit, local.reset
    else:
        from transformers import StaticCache

        forward = model.forward
        base, one_shot = name.removesuffix("_one_shot"), name.endswith("_one_shot")
        options = {"dtensor_one_shot_all_reduce_bytes": ONE_SHOT_BYTES} if one_shot else {}
        if base in ("thunder_inductor", "thunderfx_inductor"):
            from thunder.executors.torch_compile import torch_compile_ex

            options["executors"] = [torch_compile_ex, *thunder.get_default_executors()]
        if name == "torch.compile":
            forward = torch.compile(forward, mode="default")
        elif base in ("thunder", "thunder_inductor"):
            forward = thunder.jit(forward, **options)
        elif base in ("thunderfx", "thunderfx_inductor"):
            from thunder.dynamo import thunderfx

            forward = thunderfx(forward, **options)

        def step_model(ids: torch.Tensor, position: torch.Tensor, cache: object) -> torch.Tensor:
            out = forward(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=position)
            return out.logits[:, -1:]

        step, reset = step_model, None

    def decode(prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, list[float]]:
        cache = None if reset is not None else StaticCache(config=model.config, max_cache_len=max_len)
        if reset is not None:
            reset()
        ids, position, tokens, seconds = prompt, torch.arange(prompt.shape[1]), [], []
        with torch.no_grad():
            for _ in range(new):
                dist.barrier()
                start = time.perf_counter()
                token = step(ids, position, cache).argmax(-1)
                seconds.append(time.perf_counter() - start)
                tokens.append(token)
                ids, position = token, position[-1:] + 1
        return torch.cat(tokens, dim=1), seconds

    return decode


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32, help="decode steps after the prefill")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", default="benchmarks/results/inference")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    where = [tempfile.mkdtemp(prefix="thunder_dtensor_inference_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(_config(args)).save_pretrained(where[0])
    dist.barrier()
    names = args.contenders.split(",")
    # each dynamo contender (torch.compile, the thunderfx ones) compiles the same forward code for its own model, a
    # prefill and a decode entry each: past dynamo's default of 8 entries a code object, the rest would run eagerly
    torch._dynamo.config.recompile_limit = 64
    max_len = args.prompt + args.new + 1
    decoders = {name: _decoder(name, _load(where[0]), max_len) for name in names}
    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))

    first_call: dict[str, float] = {}
    first: dict[str, list[float]] = {n: [] for n in names}
    per_token: dict[str, list[float]] = {n: [] for n in names}
    reference = None
    for round_ in range(args.rounds + 1):
        for name in names:
            tokens, seconds = decoders[name](prompt, args.new + 1)
            seconds = _max_over_ranks(seconds)
            if reference is None:
                reference = tokens
            if not torch.equal(tokens, reference):
                raise AssertionError(f"{name} decoded {tokens.tolist()}, eager {reference.tolist()}")
            if round_ == 0:  # compiles: the first call of each program
                first_call[name] = sum(seconds)
                continue
            first[name].append(seconds[0])
            per_token[name].append(statistics.mean(seconds[1:]))

    median_first = {n: statistics.median(v) for n, v in first.items()}
    median_token = {n: statistics.median(v) for n, v in per_token.items()}
    result = {
        "config": vars(args),
        "world_size": dist.get_world_size(),
        "torch": torch.__version__,
        "first_token_ms": {n: 1e3 * v for n, v in median_first.items()},
        "per_token_ms": {n: 1e3 * v for n, v in median_token.items()},
        "first_round_s": first_call,
        "per_token_x_eager": {n: median_token[n] / median_token["eager"] for n in names if "eager" in names},
        "per_token_x_torch_compile": {
            n: median_token[n] / median_token["torch.compile"] for n in names if "torch.compile" in names
        },
        "per_token_x_limit": {n: median_token[n] / median_token["limit"] for n in names if "limit" in names},
        "first_token_x_eager": {n: median_first[n] / median_first["eager"] for n in names if "eager" in names},
        # the noise: the lowest and highest per-token ratio to torch.compile over the interleaved rounds
        "per_token_x_torch_compile_range": {
            n: [f(a / b for a, b in zip(per_token[n], per_token["torch.compile"])) for f in (min, max)]
            for n in names
            if "torch.compile" in names
        },
    }
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"tp{dist.get_world_size()}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    shutdown_distributed()


if __name__ == "__main__":
    main()
