"""Train a tensor-parallel (or sequence-parallel) Transformer under thunder beside a one-process reference.

    torchrun --nproc-per-node 2 examples/tp_transformer.py              # tensor parallel, thunder.jit
    torchrun --nproc-per-node 2 examples/tp_transformer.py --sp         # sequence parallel
    torchrun --nproc-per-node 2 examples/tp_transformer.py --thunderfx  # through torch.compile (thunder.dynamo)
    torchrun --nproc-per-node 2 examples/tp_transformer.py --traces     # also print the traces

Every rank trains the sharded model; the reference is the same model, unsharded, trained in each process on
the same batches. Rank 0 prints both losses per step.
"""

import argparse
import copy

import thunder_dtensor  # noqa: F401  (first: it makes thunder importable on torch >= 2.13)
from thunder_dtensor.testing import device_type, init_distributed, mesh_1d, shutdown_distributed
from thunder_dtensor.testing.models import GPT, GPTConfig, loss_fn, parallelize

import thunder
import torch
import torch.distributed as dist
from thunder.dynamo import ThunderCompiler


def thunder_programs(backend: ThunderCompiler) -> list:
    """The thunder programs behind a thunderfx-compiled module; reports what was split off to inductor."""
    programs = []
    for info in backend.subgraph_infos:
        for reason in info.split_reasons:
            print(f"split off: {reason.info}")
        programs += info.thunder_compiled_fns
    return programs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", action="store_true", help="sequence parallel (default: tensor parallel)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--thunderfx", action="store_true", help="compile with thunderfx instead of thunder.jit")
    parser.add_argument(
        "--traces",
        action="store_true",
        help="print the prologue, the DTensor program, its lowered forward and backward",
    )
    parser.add_argument(
        "--no-lowering", action="store_true", help="run each DTensor op eagerly (dtensor_lowering=False)"
    )
    args = parser.parse_args()

    init_distributed()
    cfg = GPTConfig()
    torch.manual_seed(0)  # the same initial weights on every rank
    reference = GPT(cfg).to(device_type())
    model = parallelize(copy.deepcopy(reference), mesh_1d(), sequence_parallel=args.sp)
    options = {"dtensor_lowering": not args.no_lowering}
    backend = ThunderCompiler(**options)  # thunderfx: thunder as torch.compile's backend
    compiled = torch.compile(model, backend=backend) if args.thunderfx else thunder.jit(model, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    rank0 = dist.get_rank() == 0

    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g).to(device_type())
        tgt = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g).to(device_type())
        loss = loss_fn(compiled(idx), tgt)
        loss.backward()
        ref_loss = loss_fn(reference(idx), tgt)
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if rank0:
            print(f"step {step}: loss {loss.item():.6f}  reference {ref_loss.item():.6f}")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)  # the sharded model trains as the reference

    if rank0:
        # under thunderfx, thunder compiles the graph dynamo captured: one piece when nothing was split off
        programs = thunder_programs(backend) if args.thunderfx else [compiled]
        mode = "sequence" if args.sp else "tensor"
        misses = sum(thunder.cache_misses(p) for p in programs)
        print(f"{mode} parallel on {dist.get_world_size()} ranks; thunder compiled {misses} time(s)")
        if args.traces:
            for program in programs:
                for title, trace in (
                    (
                        "prologue: checks each input's DTensor spec, local shape and stride",
                        thunder.last_prologue_traces(program)[-1],
                    ),
                    ("the DTensor program (dtensor prims on DTensor proxies)", thunder.last_traces(program)[0]),
                    (
                        "forward, as run: local ops, collectives, wrap / unwrap at the boundary",
                        thunder.last_traces(program)[-1],
                    ),
                    ("backward, as run", thunder.last_backward_traces(program)[-1]),
                ):
                    print(f"===== {title} =====")
                    print(trace)
    shutdown_distributed()


if __name__ == "__main__":
    main()
