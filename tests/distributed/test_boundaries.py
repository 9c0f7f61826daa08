"""Values crossing between lowered code and prims that stay eager carry eager's layouts.

A lowered program hands DTensors to the prims it keeps eager (forward values, saved values, cotangents) and
takes their results back (outputs, gradients). A DTensor's stride tells DTensor how its local tensor is laid
out (it views or copies by it), so each crossing must pair a local tensor with the stride eager would give
it. Each case here forces one op of a program to stay eager and feeds it, or takes from it, a non-contiguous
value (transposed, sliced, expanded), in both directions, forward and backward; values and gradients are
compared with plain torch on full tensors and placements with eager DTensor. Program outputs must hold the
local layout eager holds. Regression: torch's test Transformer (``.view`` after ``transpose(1, 2)``) failed in
the backward with "view size is not compatible with input tensor's size and stride".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from thunder_dtensor.primitive import PRIMS
from thunder_dtensor.testing import DTensorCase, make_full, mesh_1d, run_case

import pytest
import thunder
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

#: ways to make a non-contiguous value of a [6, 8] input
LAYOUTS: dict[str, Callable] = {
    "transposed": lambda t: t.transpose(0, 1),
    "sliced": lambda t: t[:, 2:],
    "expanded": lambda t: t[:, :1].expand(6, 8),
}

#: ops whose local result depends on the input's layout (a view or a copy) or that keep it
OPS: dict[str, Callable] = {
    "reshape": lambda t: t.reshape(-1),
    "unflatten": lambda t: t.unflatten(-1, (2, t.shape[-1] // 2)),
    "mul": lambda t: t * 1.5,
    "matmul": lambda t: torch.matmul(t, t.mT),
}


@contextlib.contextmanager
def kept_eager(fn: Callable, inputs: list, selected: Callable[[str], bool]) -> Iterator[list[str]]:
    """The program's dtensor prims ``selected`` by name stay eager (as an op the lowering cannot trace would)."""
    jfn = thunder.jit(fn)
    jfn(*inputs)
    names: set[str] = set()
    pending = list(thunder.last_traces(jfn)[0].bound_symbols)
    while pending:
        bsym = pending.pop()
        names.add(bsym.sym.name)
        pending.extend(bsym.subsymbols)
    names = sorted(n for n in names if n.startswith("dtensor_"))
    chosen = [n for n in names if n.endswith("_prim") and selected(n)]
    assert chosen, f"no prim selected among {names}"
    before = {name: PRIMS[name].not_lowered for name in chosen}
    for name in chosen:
        PRIMS[name].not_lowered = "kept eager by the test"
    try:
        yield chosen
    finally:
        for name, why in before.items():
            PRIMS[name].not_lowered = why


def _prim_name_has(word: str) -> Callable[[str], bool]:
    return lambda name: word in name and not name.startswith(("dtensor_to_local", "dtensor_from_local"))


def _cases() -> list:
    """Lowered into eager: every (layout, op, placement), at 4 ranks the uneven Shard(0) ones. Eager into lowered (the
    layout maker kept eager, whatever the op): each (layout, placement) once, the ops taken in turn (suite time)."""
    ops = list(OPS)
    lowered_into_eager = [
        pytest.param(
            layout, op, p, "lowered_into_eager", marks=[pytest.mark.world_size(*((2, 4) if p == "S0" else (2,)))]
        )
        for layout in LAYOUTS
        for op in OPS
        for p in ("S0", "S1", "R")
    ]
    eager_into_lowered = [
        pytest.param(layout, ops[(i + j) % len(ops)], p, "eager_into_lowered", marks=[pytest.mark.world_size(2)])
        for i, layout in enumerate(LAYOUTS)
        for j, p in enumerate(("S0", "S1", "R"))
    ]
    return lowered_into_eager + eager_into_lowered


PLACEMENTS = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}
#: float32 tolerances per op: matmul's gradient sums in an order that depends on the CPU's BLAS kernels (on an
#: AMD EPYC, the expanded case's gradient is 7.2e-5 from the float64 value under thunder and 2.2e-4 in plain
#: float32 torch: both are rounding, and they differ by 4.6e-5 at values of about 36)
TOLERANCES = {"matmul": {"rtol": 1e-5, "atol": 1e-4}}
#: the prim names (substrings) of the layout makers and of the ops above
LAYOUT_PRIM = {"transposed": "transpose", "sliced": "getitem", "expanded": "expand"}
OP_PRIM = {"reshape": "reshape", "unflatten": "unflatten", "mul": "_mul_prim", "matmul": "matmul"}


def _replicated(t: torch.Tensor) -> torch.Tensor:
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim) if isinstance(t, DTensor) else t


def _program(layout: str, op: str) -> Callable:
    make_layout, apply_op = LAYOUTS[layout], OPS[op]

    def program(x: torch.Tensor) -> torch.Tensor:
        y = make_layout(x * 2.0)  # lowered (mul), then a non-contiguous value
        # replicated at the end: eager's gradient placements follow the cotangent's, which is then a plain one
        # (a _StridedShard output's cotangent, distributed anew, leads eager's backward elsewhere). Regression:
        # the transposed Shard(0) value reshaped to 1-D is a _StridedShard; its gradient came back Replicate
        # where eager's is Shard(0) (redistribute's gradient lost the input's shard order)
        return _replicated(apply_op(y).sin())

    return program


@pytest.mark.parametrize("layout,op,placement,direction", _cases())
def test_non_contiguous_values_cross_between_lowered_and_eager_prims(layout, op, placement, direction):
    """Forward values, saved values, cotangents and gradients cross with eager's layouts, both ways."""
    fn = _program(layout, op)
    full = make_full((6, 8), seed=3)
    case = DTensorCase(fn, [full], [PLACEMENTS[placement]], mesh=mesh_1d())
    x = distribute_tensor(full, mesh_1d(), PLACEMENTS[placement]).requires_grad_()
    # lowered_into_eager: the op after the layout change stays eager; eager_into_lowered: the layout maker does
    word = OP_PRIM[op] if direction == "lowered_into_eager" else LAYOUT_PRIM[layout]
    with kept_eager(fn, [x], _prim_name_has(word)) as kept:
        result = run_case(case, label=f"{layout}/{op}/{placement}/{direction}", **TOLERANCES.get(op, {}))
        executed = "\n".join(str(t) for t in (thunder.last_traces(result.jitted)[-1],))
        assert "not lowered (runs eager DTensor): kept eager by the test" in executed, kept


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("placement", ["S0", "S1", "R"])
def test_program_outputs_hold_eagers_local_layout(layout, placement):
    """A non-contiguous program output is a DTensor with eager's stride around eager's local layout."""
    full = make_full((6, 8), seed=4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return LAYOUTS[layout](x * 2.0)

    for lowering in (True, False):
        x = distribute_tensor(full, mesh_1d(), PLACEMENTS[placement])
        out = thunder.jit(fn, dtensor_lowering=lowering)(x)
        eager = fn(x)
        assert out.placements == eager.placements, (lowering, out.placements, eager.placements)
        assert out.stride() == eager.stride(), (lowering, out.stride(), eager.stride())
        assert out.to_local().stride() == eager.to_local().stride(), (lowering, out.to_local().stride())
        torch.testing.assert_close(out.full_tensor(), fn(full))


@pytest.mark.world_size(2, 4)
def test_torch_transformer_attention_layout_chain():
    """The pattern of torch's test Transformer's attention and the smallest program that failed like it."""

    def unflatten_chain(x: torch.Tensor) -> torch.Tensor:
        return (-x).unflatten(-1, (4, 4)).transpose(1, 2).view(2, 2, 4, 8, 4)

    def attention(x: torch.Tensor, wq: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = torch.nn.functional.linear(x, wq).view(bsz, seq, 4, 4).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return torch.nn.functional.linear(o.transpose(1, 2).contiguous().view(bsz, seq, -1), wo)

    mesh = mesh_1d()
    run_case(DTensorCase(unflatten_chain, [make_full((4, 8, 16), seed=0)], [[Replicate()]], mesh=mesh))
    inputs = [make_full((2, 8, 16), seed=1), make_full((16, 16), seed=2), make_full((16, 16), seed=3)]
    # eager DTensor has no sharding rule for CPU's fused attention: values and gradients against plain torch
    for placements in ([[Replicate()], [Shard(0)], [Shard(1)]], [[Shard(1)], [Replicate()], [Replicate()]]):
        for lowering in (True, False):
            case = DTensorCase(attention, inputs, placements, mesh=mesh)
            run_case(case, compare_eager=False, jit_kwargs={"dtensor_lowering": lowering})
