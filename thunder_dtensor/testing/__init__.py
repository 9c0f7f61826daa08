"""Helpers that make a multi-rank test a few lines.

Multi-rank tests run under ``torchrun --nproc-per-node N -m pytest ...``: every rank runs the same tests in
the same order, with one process group for the session (gloo on CPU, NCCL on CUDA). The helpers build the
same full tensors on every rank, distribute them, and compare thunder's results with plain torch on the
full tensors (the math) and with eager DTensor (the placements).
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DTensorCase",
    "assert_matches_full",
    "device_type",
    "init_distributed",
    "make_full",
    "mesh_1d",
    "mesh_2d",
    "run_case",
    "world_size",
]


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float = 120.0) -> None:
    """Join the torchrun process group once (gloo on CPU, NCCL on CUDA)."""
    if dist.is_initialized():
        return
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device_type() == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


@functools.cache
def mesh_1d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type(), (world_size(),))


@functools.cache
def mesh_2d(rows: int = 2) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type(), (rows, world_size() // rows), mesh_dim_names=("dp", "tp"))


def make_full(
    shape: Sequence[int], *, seed: int, dtype: torch.dtype = torch.float32, low: float = -1.0, int_high: int = 5
) -> torch.Tensor:
    """The same full tensor on every rank (seeded), on this rank's device.

    Floats are uniform in [low, 1); integers in [0, int_high).
    """
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.rand(tuple(shape), generator=g) * (1.0 - low) + low
    else:
        t = torch.randint(0, int_high, tuple(shape), generator=g)
    return t.to(dtype=dtype, device=device_type())


def assert_matches_full(actual: Any, expected_full: torch.Tensor, *, what: str = "", rtol=None, atol=None) -> None:
    """A DTensor (or a plain tensor) equals ``expected_full``, computed with plain torch on full tensors."""
    from torch.distributed.tensor import DTensor

    full = actual.full_tensor() if isinstance(actual, DTensor) else actual
    torch.testing.assert_close(full, expected_full, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@dataclass
class DTensorCase:
    """One function on DTensor inputs, given as full tensors plus placements."""

    fn: Callable
    full_inputs: Sequence[torch.Tensor]
    placements: Sequence[Sequence[Any]]
    requires_grad: Sequence[bool] | None = None
    mesh: Any = None
    kwargs: dict = field(default_factory=dict)


@dataclass
class CaseResult:
    thunder_out: Any
    eager_out: Any
    thunder_grads: list
    eager_grads: list
    jitted: Callable


def same_placements(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Placement equality, with Partial subclasses (eager's ``_MaskPartial``) equal to the Partial they are.

    A mask-carrying Partial is bookkeeping for how eager computed the partial values; the pending reduction
    (the ``reduce_op``) is what consumers see.
    """
    if len(a) != len(b):
        return False
    for pa, pb in zip(a, b):
        if pa.is_partial() and pb.is_partial():
            if pa.reduce_op != pb.reduce_op:
                return False
        elif pa != pb:
            return False
    return True


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def run_case(
    case: DTensorCase, *, backward: bool = True, compare_eager: bool = True, rtol=None, atol=None
) -> CaseResult:
    """Run ``case.fn`` under thunder.jit on DTensors and check it.

    Checks, on every rank: outputs and input gradients equal plain torch on the full tensors; and, when
    ``compare_eager``, output and gradient placements equal eager DTensor's on the same inputs.
    """
    import thunder
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh = case.mesh if case.mesh is not None else mesh_1d()
    requires_grad = case.requires_grad or [t.is_floating_point() for t in case.full_inputs]

    def fresh_inputs(distributed: bool) -> list:
        out = []
        for t, placements, rg in zip(case.full_inputs, case.placements, requires_grad):
            x = (
                distribute_tensor(t.detach().clone(), mesh, list(placements))
                if distributed and placements is not None
                else t.detach().clone()
            )
            out.append(x.requires_grad_(rg and backward))
        return out

    plain = fresh_inputs(False)
    expected = _as_tuple(case.fn(*plain, **case.kwargs))

    eager_out = None
    if compare_eager:
        from thunder_dtensor._integration import clear_sharding_propagation_cache

        # eager's vocab-sharded embedding caches a stateful MaskPartial: start each eager run afresh
        clear_sharding_propagation_cache()
        eager_inputs = fresh_inputs(True)
        try:
            eager_out = _as_tuple(case.fn(*eager_inputs, **case.kwargs))
        except Exception as eager_error:
            # eager DTensor rejects these placements: thunder must reject them too, at trace time
            from thunder_dtensor.errors import DTensorOpError

            try:
                thunder.jit(case.fn)(*fresh_inputs(True), **case.kwargs)
            except DTensorOpError as error:
                assert "input 0:" in str(error) and "placements=" in str(error), str(error)
                return CaseResult(None, eager_error, [], [], None)
            raise AssertionError(f"eager DTensor fails ({eager_error!r}) but thunder_dtensor did not raise") from None

    dt_inputs = fresh_inputs(True)
    jitted = thunder.jit(case.fn)
    actual = _as_tuple(jitted(*dt_inputs, **case.kwargs))
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_matches_full(a, e, what=f"output {i}", rtol=rtol, atol=atol)

    if compare_eager:
        for i, (a, e) in enumerate(zip(actual, eager_out)):
            if isinstance(e, DTensor):
                assert isinstance(a, DTensor), f"output {i}: eager gives a DTensor, thunder a {type(a)}"
                assert same_placements(a.placements, e.placements), (
                    f"output {i}: placements {a.placements} != eager {e.placements}"
                )

    thunder_grads: list = []
    eager_grads: list = []
    if backward and any(o.requires_grad for o in expected if isinstance(o, torch.Tensor)):
        cotangents = [make_full(e.shape, seed=1000 + i, dtype=e.dtype) for i, e in enumerate(expected)]
        torch.autograd.backward([e for e in expected], cotangents)

        def cotangent_like(out: Any, full: torch.Tensor) -> Any:
            # the cotangent of a Partial output is a full value: Replicate it
            if isinstance(out, DTensor):
                placements = [Replicate() if p.is_partial() else p for p in out.placements]
                return distribute_tensor(full, out.device_mesh, placements)
            return full

        torch.autograd.backward(list(actual), [cotangent_like(a, c) for a, c in zip(actual, cotangents)])
        thunder_grads = [x.grad for x in dt_inputs]
        for i, (x, p) in enumerate(zip(dt_inputs, plain)):
            if p.grad is not None:
                assert x.grad is not None, f"input {i}: thunder gave no gradient"
                assert_matches_full(x.grad, p.grad, what=f"grad of input {i}", rtol=rtol, atol=atol)
            else:
                assert x.grad is None, f"input {i}: thunder gave a gradient where torch gives none"
        if compare_eager:
            torch.autograd.backward(list(eager_out), [cotangent_like(e, c) for e, c in zip(eager_out, cotangents)])
            eager_grads = [x.grad for x in eager_inputs]
            for i, (a, e) in enumerate(zip(thunder_grads, eager_grads)):
                if isinstance(e, DTensor):
                    assert isinstance(a, DTensor), f"grad {i}: eager gives a DTensor, thunder a {type(a)}"
                    assert same_placements(a.placements, e.placements), (
                        f"grad {i}: placements {a.placements} != eager {e.placements}"
                    )
    return CaseResult(actual, eager_out, thunder_grads, eager_grads, jitted)
