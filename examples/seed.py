"""The seed example: ``x * w`` on a 1-D mesh, Shard(0), 16x16, forward and backward under thunder.jit.

Run with ``torchrun --nproc-per-node 2 examples/seed.py`` (or ``make demo``). Rank 0 prints the prologue,
computation and backward traces; every rank checks the result against plain torch on full tensors.
"""

import thunder_dtensor  # noqa: F401  (first: it makes thunder importable on torch >= 2.13)
from thunder_dtensor.testing import device_type, init_distributed, mesh_1d, shutdown_distributed

import thunder
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor


def fn(x, w):
    return x * w


def main() -> None:
    init_distributed()
    mesh = mesh_1d()
    torch.manual_seed(0)  # the same full tensors on every rank
    x_full = torch.randn(16, 16, device=device_type())
    w_full = torch.randn(16, 16, device=device_type())
    x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()

    jfn = thunder.jit(fn)
    out = jfn(x, w)
    out.backward(torch.ones_like(out))

    torch.testing.assert_close(out.full_tensor(), x_full * w_full)
    torch.testing.assert_close(x.grad.full_tensor(), w_full)
    torch.testing.assert_close(w.grad.full_tensor(), x_full)

    if dist.get_rank() == 0:
        for title, trace in (
            (
                "prologue: checks each input's DTensor spec, local shape and stride",
                thunder.last_prologue_traces(jfn)[-1],
            ),
            ("the DTensor program (dtensor prims on DTensor proxies)", thunder.last_traces(jfn)[0]),
            ("forward, as run: lowered to local ops (plus collectives), wrap / unwrap", thunder.last_traces(jfn)[-1]),
            ("backward, as run", thunder.last_backward_traces(jfn)[-1]),
        ):
            print(f"===== {title} =====")
            print(trace)
        print(f"output placements {out.placements}, x.grad placements {x.grad.placements}")
        print("seed example: values and gradients match plain torch on the full tensors")
    shutdown_distributed()


if __name__ == "__main__":
    main()
