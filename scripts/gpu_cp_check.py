"""Context parallelism on CUDA: ring attention on the efficient-attention kernel, and torch's ``context_parallel``
under eager, ``thunder.jit`` and thunderfx, each against the one-process model.

Run by ``scripts/gpu_check.sh`` under torchrun (NCCL, one rank per GPU; ``--backend gloo`` puts several ranks on
one GPU where its collectives allow). Prints one line per check and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import traceback

import thunder_dtensor  # noqa: F401  (before thunder)
from thunder_dtensor.testing import shutdown_distributed
from thunder_dtensor.testing.models import CausalAttention

import thunder
import torch
import torch.distributed as dist
import torch.nn.functional as F
from thunder.dynamo import thunderfx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

FAILURES: list[str] = []
DEVICE = "cuda"


@contextlib.contextmanager
def check(name: str):
    try:
        yield
    except Exception as e:  # every check runs; the summary says which failed
        FAILURES.append(name)
        if dist.get_rank() == 0:
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=3)
    else:
        if dist.get_rank() == 0:
            print(f"ok   {name}")


def ring(mesh, causal: bool, rotate: str) -> None:
    set_rotate_method(rotate)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device=DEVICE) for _ in range(3))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal)
    ref.square().sum().backward()
    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v))
    jitted = thunder.jit(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal))
    out = jitted(dq, dk, dv)
    out.square().sum().backward()
    assert out.placements == (Shard(2),), out.placements
    torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-4, atol=1e-4)
    for got, want in zip((dq, dk, dv), full):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-4, atol=1e-4)
    forward = str(thunder.last_traces(jitted)[-1])
    kernel = "efficient_attention" if DEVICE == "cuda" else "flash_attention_for_cpu"
    assert kernel in forward, f"the lowered forward does not run the {kernel} kernel"


def train_under_context_parallel(mesh, front: str) -> None:
    torch.manual_seed(0)
    ref = CausalAttention(dim=64, heads=4).to(DEVICE)
    x, target = torch.randn(2, 64, 64, device=DEVICE), torch.randn(2, 64, 64, device=DEVICE)
    F.mse_loss(ref(x), target).backward()
    expected = F.mse_loss(ref(x), target).item()
    model = copy.deepcopy(ref)
    model.zero_grad()
    compiled = {"eager": model, "jit": thunder.jit(model), "thunderfx": thunderfx(model)}[front]
    xs, ts = x.clone(), target.clone()
    with context_parallel(mesh, buffers=[xs, ts], buffer_seq_dims=[1, 1]):
        try:
            loss = F.mse_loss(compiled(xs), ts)
            loss.backward()
        finally:
            if front == "thunderfx" and dist.get_rank() == 0:  # where dynamo's graph was cut, and why
                for info in compiled._backend.subgraph_infos:
                    print("  split reasons:", [str(r)[:300] for r in info.split_reasons])
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert abs(total.item() / dist.get_world_size() - expected) < 1e-4, (total.item(), expected)
    for p, r in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g / dist.get_world_size(), r.grad, rtol=1e-4, atol=1e-4)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (eager fails there)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    dist.init_process_group(args.backend)
    if DEVICE == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    tag = f"[{args.backend} x{dist.get_world_size()}]"
    rotate_before = _cp_options.rotate_method
    for causal in (False, True):
        for rotate in ("allgather", "alltoall"):
            with check(f"{tag} ring attention causal={causal} rotate={rotate}"):
                ring(mesh, causal, rotate)
    _cp_options.rotate_method = rotate_before
    for front in ("eager", "jit", "thunderfx"):
        with check(f"{tag} context_parallel training step, {front}"):
            train_under_context_parallel(mesh, front)
    shutdown_distributed()
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
