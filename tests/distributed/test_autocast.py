"""``torch.autocast`` around tensor- and sequence-parallel models under thunder.jit and thunderfx.

Eager DTensor under the same autocast is the reference: output dtypes and values, every parameter
gradient (dtype, placements, values), and the loss of the unsharded model under autocast. Both places
thunder supports an autocast in are covered: around the call ("outside") and in the model code
("inside"), each with bfloat16 and float16 (torch 2.13's CPU autocast supports both). One compiled model
covers both places (a thunder.jit compile of a parallelized model takes seconds): its forward runs the TP
MLP under an autocast of its own, nested in the one around the call, which the SP block runs under.
"""

import copy

from thunder_dtensor.testing import device_type, mesh_1d, same_placements

import pytest
import thunder
import torch
import torch.nn as nn
import torch.nn.functional as F
from thunder.dynamo import thunderfx
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

#: values computed in a 16-bit float (thunder decomposes GELU on local tensors into separately rounded steps)
TOL = {"rtol": 2e-2, "atol": 2e-2}
COMPILERS = {"jit": thunder.jit, "thunderfx": thunderfx}


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Model(nn.Module):
    """A sequence-parallel block (LayerNorm on sequence shards, MLP, residual), then a tensor-parallel MLP.

    The TP MLP runs under ``torch.autocast(dtype=tp_dtype)`` in the model code, if ``tp_dtype`` is given.
    """

    def __init__(self, tp_dtype: torch.dtype | None, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.norm, self.sp_mlp, self.tp_mlp = nn.LayerNorm(dim), MLP(dim, hidden), MLP(dim, hidden)
        self.tp_dtype = tp_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.sp_mlp(self.norm(x))
        if self.tp_dtype is None:
            return self.tp_mlp(x)
        with torch.autocast(device_type(), dtype=self.tp_dtype):
            return self.tp_mlp(x)


PLAN = {
    "norm": SequenceParallel(),
    "sp_mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
    "sp_mlp.fc1": ColwiseParallel(),
    "sp_mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    # the TP MLP: Colwise then Rowwise, local tensors between and after
    "tp_mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),
    "tp_mlp.fc2": RowwiseParallel(),
}


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _output_and_loss(fn, x: torch.Tensor, outside: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(device_type(), dtype=outside):
        out = fn(x)
    return out, _loss(out)


#: (dtype of the autocast around the call, of the one in the model around its TP MLP), per front end
CASES = {"jit": (torch.bfloat16, torch.float16), "thunderfx": (torch.float16, torch.bfloat16)}


@pytest.mark.parametrize("compiler", COMPILERS)
def test_tp_and_sp_model_match_eager_dtensor_under_autocast(compiler):
    x_full = torch.randn(2, 4, 8, device=device_type(), generator=torch.Generator().manual_seed(1))
    x = distribute_tensor(x_full, mesh_1d(), [Shard(1)])
    outside, inside = CASES[compiler]
    what = f"{compiler}, autocast {outside} around the call, {inside} in the model"
    torch.manual_seed(0)
    ref = Model(inside).to(device_type())
    eager = parallelize_module(copy.deepcopy(ref), mesh_1d(), PLAN)
    expected, expected_loss = _output_and_loss(eager, x, outside)
    expected_loss.backward()
    model = parallelize_module(copy.deepcopy(ref), mesh_1d(), PLAN)
    out, loss = _output_and_loss(COMPILERS[compiler](model), x, outside)
    loss.backward()

    assert out.dtype == expected.dtype == inside, what
    torch.testing.assert_close(out, expected, **TOL, msg=lambda m, w=what: f"{w}: output: {m}")
    for (name, p), (_, e) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        assert p.grad.dtype == e.grad.dtype == torch.float32, f"{what}: {name}: {p.grad.dtype}"
        assert same_placements(p.grad.placements, e.grad.placements), f"{what}: {name}"
        torch.testing.assert_close(
            p.grad.full_tensor(), e.grad.full_tensor(), **TOL, msg=lambda m, w=what, n=name: f"{w}: {n}: {m}"
        )
    _, plain_loss = _output_and_loss(ref, x_full, outside)
    torch.testing.assert_close(loss, plain_loss, **TOL, msg=lambda m, w=what: f"{w}: loss: {m}")


def _ops(a, w, t):
    """One op of each autocast policy on DTensors."""
    h = a @ w  # lower precision
    e = torch.einsum("ij,jk->ik", a, w)  # composite: autocast casts its inner matmul, not its inputs
    c = torch.cat([h, t])  # promote: to the widest input dtype
    loss = F.mse_loss(h, t)  # float32
    return h, e, c, loss


def _ops_inside(a, w, t):
    with torch.autocast(device_type(), dtype=torch.float16):
        return _ops(a, w, t)


def test_autocast_policies_of_dtensor_ops_are_explicit_casts_in_the_trace():
    """Each op follows torch's autocast policy exactly (values, dtypes, placements, gradients) in both places.

    The casts are dtensor prims in the trace; the composite op runs under autocast in a prim of its own.
    """
    mesh = mesh_1d()
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=g).to(device_type()) for s in ((4, 8), (8, 6), (4, 6))]

    def run(fn, outside):
        a, w, t = (distribute_tensor(f, mesh, p) for f, p in zip(fulls, ([Shard(0)], [Replicate()], [Shard(0)])))
        a.requires_grad_(), w.requires_grad_()
        with torch.autocast(device_type(), dtype=torch.bfloat16, enabled=outside):
            outs = fn(a, w, t)
        sum(o.float().sum() for o in outs).backward()
        return outs, (a.grad, w.grad)

    for outside, fn, dtype in ((True, _ops, torch.bfloat16), (False, _ops_inside, torch.float16)):
        expected, expected_grads = run(fn, outside)
        jfn = thunder.jit(fn)
        outs, grads = run(jfn, outside)
        assert [o.dtype for o in outs] == [o.dtype for o in expected] == [dtype] * 2 + [torch.float32] * 2
        for name, o, e in zip(
            ("matmul", "einsum", "cat", "mse_loss", "a.grad", "w.grad"), outs + grads, expected + expected_grads
        ):
            assert isinstance(o, DTensor) and same_placements(o.placements, e.placements), name
            assert o.dtype == e.dtype, name
            torch.testing.assert_close(
                o.full_tensor(), e.full_tensor(), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
        names = {bsym.sym.name for bsym in thunder.last_traces(jfn)[0].bound_symbols}
        assert "dtensor_convert_element_type_prim" in names, names
        region = f"dtensor_autocast_torch_einsum_{device_type()}_{str(dtype).removeprefix('torch.')}_prim"
        assert region in names, names
