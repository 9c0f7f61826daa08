"""Which dtensor prims stay eager in the lowered programs of the suite's models, and why.

Run under torchrun (``torchrun --nproc-per-node 2 scripts/kept_eager.py``): one training step of each model
(the test GPT tensor- and sequence-parallel, the test Llama 3 with torchtitan's plan, torch's own test
Transformer tensor- and sequence-parallel) under ``thunder.jit``, then the executed forward and backward
traces are read for the ``# not lowered (runs eager DTensor): <why>`` lines the lowering writes above every
prim it keeps eager. Rank 0 prints one line per model and kept prim; ``--fail-on-kept`` exits non-zero if
any prim of a model (other than those listed in ``EXPECTED``) stays eager.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Callable

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor.testing import device_type, init_distributed, mesh_1d, shutdown_distributed
from thunder_dtensor.testing.llama import Llama, LlamaConfig, apply_tp, llama_loss
from thunder_dtensor.testing.models import GPT, GPTConfig, loss_fn, parallelize

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F

#: prims that stay eager by design in these models (none today)
EXPECTED: dict[str, str] = {}
#: options each model's thunder.jit gets (scripts/dump_traces.py sets the lowering on and off)
JIT_OPTIONS: dict[str, object] = {}
_NOT_LOWERED = re.compile(r"# not lowered \(runs eager DTensor\): (.*)\n\s*(.*)")


def kept_prims(jfn: Callable) -> dict[str, str]:
    """prim name -> why, from the executed forward and backward traces of ``jfn``'s last call."""
    traces = [thunder.last_traces(jfn)[-1], thunder.last_backward_traces(jfn)[-1]]
    kept: dict[str, str] = {}
    for trace in traces:
        for why, line in _NOT_LOWERED.findall(str(trace)):
            name = re.search(r"(dtensor_\w+_prim)", line)
            kept[name.group(1) if name else line.strip()] = why
    return kept


def _tokens(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    idx, tgt = (torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2))
    return idx.to(device_type()), tgt.to(device_type())


def _step(model: torch.nn.Module, loss: Callable, idx: torch.Tensor, tgt: torch.Tensor) -> Callable:
    jfn = thunder.jit(model, **JIT_OPTIONS)
    loss(jfn(idx), tgt).backward()
    return jfn


def _full_logits_loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(0, 1))


def models() -> dict[str, Callable[[], Callable]]:
    mesh = mesh_1d()

    def gpt(sequence_parallel: bool) -> Callable:
        cfg = GPTConfig()
        torch.manual_seed(0)
        model = parallelize(GPT(cfg).to(device_type()), mesh, sequence_parallel=sequence_parallel)
        return _step(model, loss_fn, *_tokens(cfg.vocab, 2, cfg.seq))

    def llama() -> Callable:
        cfg = LlamaConfig(layers=1)
        torch.manual_seed(0)
        model = apply_tp(Llama(cfg).to(device_type()), mesh, loss_parallel=False)
        return _step(model, llama_loss, *_tokens(cfg.vocab, 2, cfg.seq))

    def torch_transformer(sequence_parallel: bool) -> Callable:
        from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

        args = ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0)
        torch.manual_seed(0)
        model = Transformer(args).to(device_type())
        model = Transformer.parallelize(copy.deepcopy(model), mesh, sequence_parallel)
        return _step(model, _full_logits_loss, *_tokens(args.vocab_size, 2, args.max_seq_len))

    return {
        "GPT TP": lambda: gpt(False),
        "GPT SP": lambda: gpt(True),
        "Llama 3 TP (torchtitan plan)": llama,
        "torch test Transformer TP": lambda: torch_transformer(False),
        "torch test Transformer SP": lambda: torch_transformer(True),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-on-kept", action="store_true")
    args = parser.parse_args()
    init_distributed()
    rank0 = dist.get_rank() == 0
    unexpected = 0
    for label, run in models().items():
        kept = kept_prims(run())
        if rank0:
            print(f"{label}: {len(kept)} prim(s) kept eager")
            for name, why in sorted(kept.items()):
                print(f"  {name}: {why}")
        unexpected += sum(1 for name in kept if name not in EXPECTED)
    shutdown_distributed()
    return 1 if args.fail_on_kept and unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
