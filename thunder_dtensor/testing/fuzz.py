"""A differential fuzzer: random Transformer-style DTensor programs, run four ways and compared.

Hand-written tests cover the op/placement pairs someone thought of; the bugs left are at the boundaries between
ops (a view of a transposed value, a lowered op feeding an eager one, ``from_local`` of a value the lowering
produced). :func:`generate_program` draws a seeded chain of 3-8 ops (linear, matmul, views, slicing, norms,
attention, reductions, in-place ops, redistribute, to_local/from_local round trips, ...) over inputs with random
placements (Shard on any dim, Replicate, Partial; even and uneven shards; 1-D and 2-D meshes) and random
``requires_grad``. :func:`run_program` runs it as plain torch on the full tensors (the math), as eager DTensor
(the placements, and whether the program is legal at all), and under ``thunder.jit`` with the lowering on and
off, forward and backward, and classifies every difference. Each program is one function whose source is
generated from the op chain; the same text is exec'd to run it and printed in a standalone reproducer.

Triage comes with each failure: whether eager DTensor itself differs from plain torch, whether thunder.jit alone
(plain full tensors) fails the same program (then the bug is upstream), and, with :func:`minimize`, the shortest
failing prefix of the chain with the steps and input placements it does not need removed.

Run it with ``scripts/fuzz.py`` under torchrun (``make fuzz``); every rank draws the same programs and takes the
same path, checked after each program.
"""

from __future__ import annotations

import linecache
import math
import random
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "FAILURE_KINDS",
    "Failure",
    "FuzzSummary",
    "InputSpec",
    "Program",
    "ProgramResult",
    "Step",
    "device_mesh_for",
    "fuzz",
    "generate_program",
    "mesh_shape_for",
    "minimize",
    "parse_seeds",
    "run_program",
]

#: Failure kinds, in the order the summary lists them.
FAILURE_KINDS: tuple[str, ...] = (
    "thunder-raises-eager-runs",
    "unclear-error",
    "eager-error-reraised",
    "value-mismatch",
    "grad-mismatch",
    "placement-mismatch",
    "grad-placement-mismatch",
    "rank-divergence",
    "fuzzer-error",
)

#: The two thunder runs of every program: name -> ``dtensor_lowering``.
MODES: dict[str, bool] = {"lowering": True, "no-lowering": False}

# Small shapes keep a program's four runs well under a second on two CPU cores.
_MAX_INPUT_NUMEL = 512
_MAX_NUMEL = 2048
_MAX_NDIM = 5
_MIN_OPS, _MAX_OPS = 3, 8
_TOLERANCES = {"float32": {"rtol": 1e-4, "atol": 1e-5}, "float64": {"rtol": 1e-7, "atol": 1e-7}}

# Input construction and the cotangent, shared by the runner (exec'd) and every reproducer (printed), so the
# reproducer builds exactly the DTensors the fuzzer ran.
HELPERS_SOURCE = '''
def make_input(mesh, shape, seed, placements, requires_grad, dtype=torch.float32, low=-1.0):
    """The seeded full tensor as a DTensor. A Partial mesh dim holds (coordinate + 1) / (1 + ... + n) of it."""
    full = make_full(shape, seed=seed, dtype=dtype, low=low)
    if not any(p.is_partial() for p in placements):
        return distribute_tensor(full, mesh, placements, src_data_rank=None).requires_grad_(requires_grad)
    scale = 1.0
    for d, p in enumerate(placements):
        if p.is_partial():
            n = mesh.size(d)
            scale *= (mesh.get_local_rank(d) + 1) / (n * (n + 1) // 2)
    kept = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(full * scale, mesh, kept, src_data_rank=None).to_local()
    x = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
    return x.requires_grad_(requires_grad)


def cotangent_for(out, full):
    """The full cotangent distributed like ``out``; a Partial mesh dim gets Replicate (a cotangent is a full value)."""
    placements = [Replicate() if p.is_partial() else p for p in out.placements]
    try:
        return distribute_tensor(full, out.device_mesh, placements, src_data_rank=None)
    except Exception:  # placements distribute_tensor cannot make directly (_StridedShard): redistribute to them
        replicated = distribute_tensor(full, out.device_mesh, [Replicate()] * len(placements), src_data_rank=None)
        return replicated.redistribute(out.device_mesh, placements)
'''

_IMPORTS_SOURCE = """\
import torch
import torch.nn.functional as F

import thunder_dtensor  # noqa: F401  (before thunder)
import thunder
from thunder_dtensor.testing import init_distributed, make_full, mesh_1d, mesh_2d, same_placements
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
"""


# ---------------------------------------------------------------------------------------------------------
# Programs
# ---------------------------------------------------------------------------------------------------------


def _placement_source(p: str) -> str:
    if p == "R":
        return "Replicate()"
    if p == "P":
        return "Partial()"
    return f"Shard({int(p[1:])})"


def _placements_source(placements: Sequence[str]) -> str:
    return "[" + ", ".join(_placement_source(p) for p in placements) + "]"


@dataclass(frozen=True)
class InputSpec:
    """One program input: a seeded full tensor (``make_full``) and the placements it is distributed with."""

    name: str
    shape: tuple[int, ...]
    #: one per mesh dim: "R", "P" (Partial sum) or "S<dim>"
    placements: tuple[str, ...]
    requires_grad: bool
    seed: int
    #: the low end of the uniform values (0.5 for a divisor)
    low: float = -1.0

    def describe(self) -> str:
        shape = ",".join(map(str, self.shape))
        return f"{self.name}[{shape}]:{'/'.join(self.placements)}{':rg' if self.requires_grad else ''}"


@dataclass(frozen=True)
class Step:
    """One op of the chain: its line in the DTensor program and in the plain-torch one (None: identity there)."""

    kind: str
    line: str
    plain: str | None
    #: the running value's full shape after this step
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Program:
    """A generated program; its function's source is generated from ``steps`` (the one source of truth)."""

    seed: int
    world_size: int
    mesh_shape: tuple[int, ...]
    dtype: str
    inputs: tuple[InputSpec, ...]
    steps: tuple[Step, ...]
    cotangent_seed: int
    #: set on a program :func:`minimize` made smaller: what it was reduced from
    reduced_from: str = ""

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.steps)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.steps[-1].shape

    @property
    def differs_in_plain(self) -> bool:
        """Some step is DTensor-only (redistribute, to_local/from_local): plain torch runs its own source."""
        return any(s.plain != s.line for s in self.steps)

    def source(self, *, plain: bool = False) -> str:
        """``def fn(...)`` (or ``fn_plain``: DTensor-only steps become comments, the identity on full tensors)."""
        name = "fn_plain" if plain else "fn"
        lines = [f"def {name}({', '.join(i.name for i in self.inputs)}):", f"    y = {self.inputs[0].name}"]
        for s in self.steps:
            if not plain:
                lines.append(f"    {s.line}")
            elif s.plain is None:
                lines.append(f"    # {s.line}  (DTensor only: the identity on full tensors)")
            else:
                lines.append(f"    {s.plain}")
        lines.append("    return y")
        return "\n".join(lines) + "\n"

    def size_key(self) -> tuple[int, int, int]:
        """Smaller is a better reproducer: fewer ops, then fewer elements."""
        return (len(self.steps), sum(math.prod(i.shape) for i in self.inputs), self.seed)

    def describe(self) -> str:
        inputs = " ".join(i.describe() for i in self.inputs)
        reduced = f" (reduced from {self.reduced_from})" if self.reduced_from else ""
        return f"seed={self.seed}{reduced} mesh={self.mesh_shape} {self.dtype} | {inputs} | {' > '.join(self.kinds)}"

    def reproducer(self, lowering: bool, found: str = "") -> str:
        """A standalone script (run under torchrun) that builds the inputs and runs the failing jit call."""
        mesh = "mesh_1d()" if len(self.mesh_shape) == 1 else f"mesh_2d({self.mesh_shape[0]})"
        specs = "\n".join(
            f"    ({list(i.shape)}, {i.seed}, {_placements_source(i.placements)}, {i.requires_grad}, {i.low}),"
            f"  # {i.name}"
            for i in self.inputs
        )
        tol = _TOLERANCES[self.dtype]
        found_lines = "".join(f"\n    {line}" for line in found.splitlines())
        plain_fn = self.source(plain=True) if self.differs_in_plain else "fn_plain = fn\n"
        return f'''\
"""thunder_dtensor fuzz reproducer: seed {self.seed}, world size {self.world_size}, mesh {self.mesh_shape}, \
{self.dtype}, dtensor_lowering={lowering}.{f" Reduced from {self.reduced_from}." if self.reduced_from else ""}

Found:{found_lines}

Run: torchrun --nproc-per-node {self.world_size} repro.py
"""

{_IMPORTS_SOURCE}{HELPERS_SOURCE}

{self.source()}

{plain_fn}
init_distributed()
mesh = {mesh}
DTYPE = torch.{self.dtype}
SPECS = [  # full shape, make_full seed, placements, requires_grad, low
{specs}
]


def dtensors():
    return [make_input(mesh, shape, seed, p, rg, dtype=DTYPE, low=low) for shape, seed, p, rg, low in SPECS]


inputs = dtensors()
out = thunder.jit(fn, dtensor_lowering={lowering})(*inputs)

# plain torch on the full tensors: what the values must be; eager DTensor: what the placements must be
full_inputs = [
    make_full(shape, seed=seed, dtype=DTYPE, low=low).requires_grad_(rg) for shape, seed, _, rg, low in SPECS
]
expected = fn_plain(*full_inputs)
eager_inputs = dtensors()
try:
    eager = fn(*eager_inputs)
except Exception as error:
    eager = None
    print("eager DTensor raises:", repr(error))
print("output placements: thunder", out.placements, "eager", eager.placements if eager is not None else "-")
if eager is not None:
    print("eager DTensor matches plain torch:", torch.allclose(eager.full_tensor(), expected.detach()))
torch.testing.assert_close(out.full_tensor(), expected.detach(), rtol={tol["rtol"]}, atol={tol["atol"]})
assert eager is None or same_placements(out.placements, eager.placements), "output placements differ from eager"
if expected.requires_grad:
    cotangent = make_full(expected.shape, seed={self.cotangent_seed}, dtype=DTYPE)
    expected.backward(cotangent)
    out.backward(cotangent_for(out, cotangent))
    if eager is not None:
        try:
            eager.backward(cotangent_for(eager, cotangent))
        except Exception as error:
            eager = None
            print("eager DTensor's backward raises:", repr(error))
    for i, (x, full) in enumerate(zip(inputs, full_inputs)):
        if full.grad is None:
            assert x.grad is None, f"input {{i}}: thunder gives a gradient, torch none"
            continue
        assert x.grad is not None, f"input {{i}}: thunder gives no gradient"
        torch.testing.assert_close(x.grad.full_tensor(), full.grad, rtol={tol["rtol"]}, atol={tol["atol"]})
        if eager is not None:
            print(f"grad {{i}} placements: thunder", x.grad.placements, "eager", eager_inputs[i].grad.placements)
            assert same_placements(x.grad.placements, eager_inputs[i].grad.placements), f"grad {{i}} placements"
print("no failure reproduced")
'''


# ---------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------

_PLAIN_GLOBALS: dict[str, Any] = {"torch": torch, "F": F}


def _full(spec: InputSpec, dtype: str) -> torch.Tensor:
    from thunder_dtensor.testing import make_full

    return make_full(spec.shape, seed=spec.seed, dtype=getattr(torch, dtype), low=spec.low)


def _factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(2, n) if n % a == 0]


def _dims(shape: Sequence[int]) -> str:
    return ", ".join(map(str, shape))


class _Generator:
    """Draws one program: each candidate step is run on the plain full tensors, and kept only if torch runs it.

    Running the candidates is what keeps every program valid for plain torch (a ``view`` of a transposed value,
    an in-place op on a view) without modelling strides here, and it gives each step's full shape.
    """

    def __init__(self, rng: random.Random, seed: int, world_size: int, mesh_shape: tuple[int, ...]):
        self.rng = rng
        self.seed = seed
        self.world_size = world_size
        self.mesh_shape = mesh_shape
        self.dtype = "float32" if rng.random() < 0.8 else "float64"
        self.grad_mode = rng.choices(["none", "all", "some"], weights=[2, 3, 5])[0]
        self.inputs: list[InputSpec] = []
        self.steps: list[Step] = []
        self.env: dict[str, Any] = {}
        self.pending: list[InputSpec] = []
        self.counter = 0

    # -- inputs ------------------------------------------------------------------------------------------

    def size(self) -> int:
        return self.rng.choice([2, 3, 4, 4, 5, 6, 6, 7, 8, 8])

    def placements(self, ndim: int) -> tuple[str, ...]:
        out = []
        for _ in self.mesh_shape:
            r = self.rng.random()
            if r < 0.45 and ndim > 0:
                out.append(f"S{self.rng.randrange(ndim)}")
            elif r < 0.8:
                out.append("R")
            else:
                out.append("P")
        return tuple(out)

    def requires_grad(self) -> bool:
        return {"none": False, "all": True}.get(self.grad_mode, self.rng.random() < 0.5)

    def new_input(self, prefix: str, shape: Sequence[int], low: float = -1.0) -> str:
        """An extra input (weight, bias, other operand) with its own placements; kept if the step is."""
        self.counter += 1
        name = f"{prefix}{self.counter}"
        spec = InputSpec(
            name, tuple(shape), self.placements(len(shape)), self.requires_grad(), self.rng.randrange(1 << 30), low
        )
        self.pending.append(spec)
        return name

    def first_input(self) -> None:
        while True:
            ndim = self.rng.choice([2, 2, 3, 3, 3, 4])
            shape = [self.size() for _ in range(ndim)]
            if self.rng.random() < 0.3:  # hidden sizes a Transformer splits into heads
                shape[-1] = self.rng.choice([8, 12, 16])
            if math.prod(shape) <= _MAX_INPUT_NUMEL:
                break
        spec = InputSpec("x", tuple(shape), self.placements(ndim), self.requires_grad(), self.rng.randrange(1 << 30))
        self.inputs.append(spec)
        self.env = {"x": _full(spec, self.dtype).requires_grad_(spec.requires_grad)}
        self.env["y"] = self.env["x"]

    # -- the running value -------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.env["y"].shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self, *, negative: bool = True) -> int:
        d = self.rng.randrange(self.ndim)
        return d - self.ndim if negative and self.rng.random() < 0.3 else d

    def evenly_sharded(self) -> bool:
        """Every dim divides over all ranks: shards are even whatever the placements (from_local infers shape)."""
        n = math.prod(self.mesh_shape)
        return all(s % n == 0 for s in self.shape)

    # -- candidates --------------------------------------------------------------------------------------

    def try_steps(self, steps: list[tuple[str, str, str | None]]) -> bool:
        env = dict(self.env)
        for spec in self.pending:
            env[spec.name] = _full(spec, self.dtype).requires_grad_(spec.requires_grad)
        shapes = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _, _, plain in steps:
                    if plain is not None:
                        exec(plain, _PLAIN_GLOBALS, env)
                    y = env["y"]
                    ok = 1 <= y.ndim <= _MAX_NDIM and y.numel() <= _MAX_NUMEL and y.numel() > 0
                    if not ok or not bool(torch.isfinite(y).all()):
                        raise ValueError("out of bounds")
                    shapes.append(tuple(y.shape))
        except Exception:
            self.pending.clear()
            return False
        self.env = env
        self.inputs += self.pending
        self.pending.clear()
        self.steps += [Step(k, line, plain, s) for (k, line, plain), s in zip(steps, shapes)]
        return True

    def build(self) -> Program | None:
        self.first_input()
        n_ops = self.rng.randint(_MIN_OPS, _MAX_OPS)
        builders, weights = zip(*_BUILDERS)
        for _ in range(200):
            if len(self.steps) >= n_ops:
                break
            builder = self.rng.choices(builders, weights=weights)[0]
            for _ in range(3):  # a view of a strided value, a broadcast shape: often valid on a redraw
                candidate = builder(self)
                if candidate is None or len(self.steps) + len(candidate) > _MAX_OPS:
                    self.pending.clear()
                    break
                if self.try_steps([(k, line, line if plain is _SAME else plain) for k, line, plain in candidate]):
                    break
        if len(self.steps) < _MIN_OPS:
            return None
        program = Program(
            self.seed,
            self.world_size,
            self.mesh_shape,
            self.dtype,
            tuple(self.inputs),
            tuple(self.steps),
            self.rng.randrange(1 << 30),
        )
        return program if _plain_runs_well(program) else None


_SAME: Any = object()  # a step's plain line is its DTensor line


def _plain_run(program: Program, dtype: str) -> tuple[torch.Tensor, list]:
    fn_plain = _exec_function(program.source(plain=True), "fn_plain", dict(_PLAIN_GLOBALS), "<fuzz draw>")
    inputs = [_full(i, dtype).requires_grad_(i.requires_grad) for i in program.inputs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn_plain(*inputs)
        if out.requires_grad:
            out.backward(torch.ones_like(out))
    return out.detach(), [x.grad for x in inputs]


def _plain_runs_well(program: Program) -> bool:
    """Plain torch runs the program forward and backward, finite and well conditioned (else: draw again).

    Well conditioned: float32 agrees with float64 ten times tighter than the judge's tolerance, so that a
    mismatch in the judge is not rounding amplified (a norm over one element, a difference of near-equal sums).
    """
    try:
        out, grads = _plain_run(program, program.dtype)
        if not all(g is None or bool(torch.isfinite(g).all()) for g in grads):
            return False
        if program.dtype == "float32":
            out64, grads64 = _plain_run(program, "float64")
            tight = {"rtol": 1e-5, "atol": 1e-6}
            pairs = [(out, out64)] + [(g, g64) for g, g64 in zip(grads, grads64) if g is not None]
            return not any(_close(a.double(), b, tight) for a, b in pairs)
        return True
    except Exception:
        return False


# Each builder returns the candidate's steps as (kind, DTensor line, plain line or _SAME or None), or None when the
# op does not apply to the running value.
_Candidate = list[tuple[str, str, Any]] | None


def _op_linear(g: _Generator) -> _Candidate:
    n = g.rng.choice([2, 3, 4, 5, 6, 8, 12, 16])
    w = g.new_input("w", (n, g.shape[-1]))
    if g.rng.random() < 0.5:
        return [("linear", f"y = F.linear(y, {w}, {g.new_input('b', (n,))})", _SAME)]
    return [("linear", f"y = F.linear(y, {w})", _SAME)]


def _op_matmul(g: _Generator) -> _Candidate:
    if g.ndim < 2:
        return None
    n = g.size()
    r = g.rng.random()
    if r < 0.2:  # the other operand on the left
        o = g.new_input("o", (n, g.shape[-2]))
        return [("matmul", f"y = {o} @ y", _SAME)]
    batch = g.shape[:-2] if r < 0.45 else ()
    o = g.new_input("o", (*batch, g.shape[-1], n))
    line = f"y = y @ {o}" if g.rng.random() < 0.5 else f"y = torch.matmul(y, {o})"
    return [("matmul", line, _SAME)]


def _op_bmm(g: _Generator) -> _Candidate:
    if g.ndim != 3:
        return None
    o = g.new_input("o", (g.shape[0], g.shape[2], g.size()))
    return [("bmm", f"y = torch.bmm(y, {o})", _SAME)]


def _new_shape(g: _Generator) -> list[int] | None:
    """The shape after merging two adjacent dims or splitting one (what view/reshape do in a Transformer)."""
    shape = list(g.shape)
    splits = [(d, p) for d, s in enumerate(shape) for p in _factor_pairs(s)]
    if (g.rng.random() < 0.5 or g.ndim < 2) and splits and g.ndim < _MAX_NDIM:
        d, (a, b) = g.rng.choice(splits)
        new = shape[:d] + [a, b] + shape[d + 1 :]
    elif g.ndim >= 2:
        d = g.rng.randrange(g.ndim - 1)
        new = shape[:d] + [shape[d] * shape[d + 1]] + shape[d + 2 :]
    else:
        return None
    if g.rng.random() < 0.25:
        new[g.rng.randrange(len(new))] = -1
    return new


def _op_view(g: _Generator) -> _Candidate:
    new = _new_shape(g)
    return None if new is None else [("view", f"y = y.view({_dims(new)})", _SAME)]


def _op_reshape(g: _Generator) -> _Candidate:
    new = _new_shape(g)
    if new is None:
        return None
    return [("reshape", f"y = y.reshape({_dims(new)})", _SAME)]


def _op_transpose(g: _Generator) -> _Candidate:
    if g.ndim < 2:
        return None
    d0, d1 = g.rng.sample(range(g.ndim), 2)
    if g.rng.random() < 0.3:
        d1 -= g.ndim
    return [("transpose", f"y = y.transpose({d0}, {d1})", _SAME)]


def _op_permute(g: _Generator) -> _Candidate:
    if g.ndim < 3:
        return None
    perm = list(range(g.ndim))
    while perm == sorted(perm):
        g.rng.shuffle(perm)
    return [("permute", f"y = y.permute({_dims(perm)})", _SAME)]


def _op_mT(g: _Generator) -> _Candidate:
    return None if g.ndim < 2 else [("mT", "y = y.mT", _SAME)]


def _op_contiguous(g: _Generator) -> _Candidate:
    return [("contiguous", "y = y.contiguous()", _SAME)]


def _op_clone(g: _Generator) -> _Candidate:
    return [("clone", "y = y.clone()", _SAME)]


def _op_split(g: _Generator) -> _Candidate:
    d = g.dim()
    size = g.shape[d]
    if size < 2:
        return None
    if g.rng.random() < 0.5:
        s = g.rng.randint(1, size - 1)
        kind, pieces, call = "split", -(-size // s), f"y.split({s}, dim={d})"
    else:
        n = g.rng.randint(2, min(size, 4))
        kind, pieces, call = "chunk", -(-size // -(-size // n)), f"y.chunk({n}, dim={d})"
    r = g.rng.random()
    if r < 0.5:
        return [(kind, f"y = {call}[{g.rng.randrange(pieces)}]", _SAME)]
    if r < 0.75:
        return [(kind, f"y = torch.cat({call}, dim={d})", _SAME)]
    return [(kind, f"y = torch.cat({call}[::-1], dim={d})", _SAME)]


def _op_cat(g: _Generator) -> _Candidate:
    d = g.dim()
    shape = list(g.shape)
    shape[d] = g.rng.randint(1, 4)
    o = g.new_input("o", shape)
    pieces = f"[y, {o}]" if g.rng.random() < 0.5 else f"[{o}, y]"
    return [("cat", f"y = torch.cat({pieces}, dim={d})", _SAME)]


def _op_slice(g: _Generator) -> _Candidate:
    d = g.rng.randrange(g.ndim)
    size = g.shape[d]
    if size < 2:
        return None
    r = g.rng.random()
    if r < 0.3:
        piece = "::2"
    elif r < 0.5:
        piece = f"{g.rng.randrange(1, size)}:"
    elif r < 0.65:
        piece = f":{g.rng.randrange(1, size)}"
    else:
        a = g.rng.randrange(size - 1)
        b = g.rng.randint(a + 1, size)
        piece = f"{a}:{b}" + (":2" if g.rng.random() < 0.2 else "")
    index = f"..., {piece}" if d == g.ndim - 1 and g.rng.random() < 0.6 else ":, " * d + piece
    return [("slice", f"y = y[{index}]", _SAME)]


def _op_select(g: _Generator) -> _Candidate:
    if g.ndim < 2:
        return None
    d = g.rng.randrange(g.ndim)
    return [("select", f"y = y[{':, ' * d}{g.rng.randrange(g.shape[d])}]", _SAME)]


def _op_unflatten(g: _Generator) -> _Candidate:
    splits = [(d, p) for d, s in enumerate(g.shape) for p in _factor_pairs(s)]
    if not splits or g.ndim >= _MAX_NDIM:
        return None
    d, (a, b) = g.rng.choice(splits)
    if g.rng.random() < 0.4:
        d -= g.ndim
    sizes = (a, b) if g.rng.random() < 0.8 else (a, -1)
    return [("unflatten", f"y = y.unflatten({d}, ({sizes[0]}, {sizes[1]}))", _SAME)]


def _op_flatten(g: _Generator) -> _Candidate:
    if g.ndim < 2:
        return None
    start = g.rng.randrange(g.ndim - 1)
    end = g.rng.randrange(start + 1, g.ndim)
    if end == g.ndim - 1 and g.rng.random() < 0.5:
        return [("flatten", f"y = y.flatten({start})", _SAME)]
    return [("flatten", f"y = y.flatten({start}, {end})", _SAME)]


def _broadcast_shape(g: _Generator) -> list[int]:
    """A shape that broadcasts to the running value's: all of it, a suffix, or some dims of size 1."""
    shape = list(g.shape)
    r = g.rng.random()
    if r < 0.35:
        return shape
    if r < 0.7:
        return shape[g.rng.randrange(1, g.ndim) :] if g.ndim > 1 else shape
    return [1 if g.rng.random() < 0.5 else s for s in shape]


def _op_binary(g: _Generator) -> _Candidate:
    op = g.rng.choice(["+", "-", "*", "/"])
    shape = _broadcast_shape(g)
    if g.rng.random() < 0.1 and g.ndim < 4:  # the other operand broadcasts the running value up
        shape = [g.rng.randint(2, 3), *g.shape]
    o = g.new_input("o", shape, low=0.5 if op == "/" else -1.0)
    line = f"y = {o} {op} y" if op != "/" and g.rng.random() < 0.3 else f"y = y {op} {o}"
    return [({"+": "add", "-": "sub", "*": "mul", "/": "div"}[op], line, _SAME)]


def _op_scalar(g: _Generator) -> _Candidate:
    kind, line = g.rng.choice(
        [
            ("mul", "y = y * 2.0"),
            ("mul", "y = 0.5 * y"),
            ("add", "y = y + 0.5"),
            ("sub", "y = y - 1.5"),
            ("rsub", "y = 2.0 - y"),
            ("div", "y = y / 3.0"),
            ("neg", "y = -y"),
        ]
    )
    return [(f"{kind}-scalar" if kind != "neg" else kind, line, _SAME)]


def _op_activation(g: _Generator) -> _Candidate:
    kind, line = g.rng.choice(
        [
            ("relu", "y = F.relu(y)"),
            ("relu", "y = y.relu()"),
            ("gelu", "y = F.gelu(y)"),
            ("gelu", 'y = F.gelu(y, approximate="tanh")'),
            ("silu", "y = F.silu(y)"),
            ("tanh", "y = torch.tanh(y)"),
            ("sigmoid", "y = torch.sigmoid(y)"),
        ]
    )
    return [(kind, line, _SAME)]


def _op_softmax(g: _Generator) -> _Candidate:
    d = g.dim()
    kind, line = g.rng.choice(
        [
            ("softmax", f"y = y.softmax(dim={d})"),
            ("softmax", f"y = F.softmax(y, dim={d})"),
            ("log_softmax", f"y = F.log_softmax(y, dim={d})"),
        ]
    )
    return [(kind, line, _SAME)]


def _op_layer_norm(g: _Generator) -> _Candidate:
    normalized = g.shape[-2:] if g.ndim >= 2 and g.rng.random() < 0.25 else g.shape[-1:]
    if math.prod(normalized) < 2:  # a norm over one element is constant: its gradient is rounding noise
        return None
    shape_src = f"({_dims(normalized)},)" if len(normalized) == 1 else f"({_dims(normalized)})"
    if g.rng.random() < 0.75:
        weight = g.new_input("g", normalized)
        bias = g.new_input("b", normalized) if g.rng.random() < 0.6 else "None"
        return [("layer_norm", f"y = F.layer_norm(y, {shape_src}, {weight}, {bias})", _SAME)]
    return [("layer_norm", f"y = F.layer_norm(y, {shape_src})", _SAME)]


def _op_rms_norm(g: _Generator) -> _Candidate:
    d = g.shape[-1]
    if g.rng.random() < 0.75:
        return [("rms_norm", f"y = F.rms_norm(y, ({d},), {g.new_input('g', (d,))}, eps=1e-6)", _SAME)]
    return [("rms_norm", f"y = F.rms_norm(y, ({d},), eps=1e-6)", _SAME)]


def _op_reduce(g: _Generator) -> _Candidate:
    op = g.rng.choice(["sum", "mean", "amax"])
    keepdim = g.rng.random() < 0.5
    if g.ndim >= 3 and g.rng.random() < 0.25:
        dims = sorted(g.rng.sample(range(g.ndim), 2))
        dim_src, reduced = f"({dims[0]}, {dims[1]})", 2
    else:
        dim_src, reduced = str(g.dim()), 1
    if g.ndim - reduced < 1:
        keepdim = True
    return [(op, f"y = y.{op}(dim={dim_src}, keepdim={keepdim})", _SAME)]


def _op_sdpa(g: _Generator) -> _Candidate:
    if g.ndim != 4:
        return None
    b, h, length, e = g.shape
    causal = ", is_causal=True" if g.rng.random() < 0.4 else ""
    if g.rng.random() < 0.35:
        return [("sdpa", f"y = F.scaled_dot_product_attention(y, y, y{causal})", _SAME)]
    s = length if g.rng.random() < 0.6 else g.size()
    k = g.new_input("k", (b, h, s, e))
    v = g.new_input("v", (b, h, s, e if g.rng.random() < 0.7 else g.size()))
    return [("sdpa", f"y = F.scaled_dot_product_attention(y, {k}, {v}{causal})", _SAME)]


def _op_heads(g: _Generator) -> _Candidate:
    """[batch, seq, hidden] -> [batch, heads, seq, head_dim]: the step before attention."""
    if g.ndim != 3 or not _factor_pairs(g.shape[-1]):
        return None
    a, b = g.rng.choice(_factor_pairs(g.shape[-1]))
    return [("unflatten", f"y = y.unflatten(-1, ({a}, {b}))", _SAME), ("transpose", "y = y.transpose(1, 2)", _SAME)]


def _op_expand(g: _Generator) -> _Candidate:
    ones = [d for d, s in enumerate(g.shape) if s == 1]
    if ones:
        d = g.rng.choice(ones)
        new = [-1 if g.rng.random() < 0.3 else s for s in g.shape]
        new[d] = g.rng.randint(2, 4)
        return [("expand", f"y = y.expand({_dims(new)})", _SAME)]
    if g.ndim >= 4:
        return None
    return [("expand", f"y = y.expand({_dims([g.rng.randint(2, 3), *g.shape])})", _SAME)]


def _op_inplace(g: _Generator) -> _Candidate:
    r = g.rng.random()
    if r < 0.45:
        line = g.rng.choice(["y.mul_(2.0)", "y.add_(0.5)", "y.sub_(1.0)", "y.div_(2.0)", "y.relu_()"])
    elif r < 0.8:
        shape = g.shape[g.rng.randrange(g.ndim) :] if g.rng.random() < 0.5 else g.shape
        line = f"y.{g.rng.choice(['add_', 'sub_', 'mul_'])}({g.new_input('o', shape)})"
    else:  # into a view of the intermediate, or a view of a view
        d = g.rng.randrange(g.ndim)
        view, k = f"y[{':, ' * d}:1]", g.rng.random()
        if k < 0.25 and g.ndim >= 2:
            view += ".transpose(0, -1)"
        elif k < 0.5 and g.shape[d] >= 2:
            view = f"y[{':, ' * d}1:][..., ::2]"
        line = f"{view}.{g.rng.choice(['mul_(0.5)', 'add_(0.5)'])}"
    return [("clone", "y = y.clone()", _SAME), ("inplace", line, _SAME)]


def _random_placements_source(g: _Generator) -> str:
    placements = []
    for _ in g.mesh_shape:
        r = g.rng.random()
        placements.append(f"S{g.rng.randrange(g.ndim)}" if r < 0.55 else ("R" if r < 0.92 else "P"))
    return _placements_source(placements)


def _op_redistribute(g: _Generator) -> _Candidate:
    return [("redistribute", f"y = y.redistribute(y.device_mesh, {_random_placements_source(g)})", None)]


def _op_local_roundtrip(g: _Generator) -> _Candidate:
    """``to_local`` then ``DTensor.from_local`` with the same placements (with shape/stride, or inferred if even)."""
    prefix = []
    n = math.prod(g.mesh_shape)
    even_dims = [d for d, size in enumerate(g.shape) if size % n == 0]
    if not g.evenly_sharded() and g.rng.random() < 0.3:
        # placements known to shard evenly first, so that from_local may infer the global shape
        placements = [
            "R" if not even_dims or g.rng.random() < 0.4 else f"S{g.rng.choice(even_dims)}" for _ in g.mesh_shape
        ]
        prefix = [("redistribute", f"y = y.redistribute(y.device_mesh, {_placements_source(placements)})", None)]
    infer = (g.evenly_sharded() or bool(prefix)) and g.rng.random() < (0.8 if prefix else 0.5)
    shape = "" if infer else ", shape=y.shape, stride=y.stride()"
    kind = "from_local" if infer else "from_local(shape,stride)"
    if g.rng.random() < 0.5:
        return prefix + [(kind, f"y = DTensor.from_local(y.to_local(), y.device_mesh, y.placements{shape})", None)]
    # a positive scale is exact on any placement, Partial(sum/max/avg) included
    return prefix + [
        ("to_local", "t = y.to_local()", None),
        ("local-mul", "t = t * 2.0", "y = y * 2.0"),
        (kind, f"y = DTensor.from_local(t, y.device_mesh, y.placements{shape})", None),
    ]


_BUILDERS: list[tuple[Callable[[_Generator], _Candidate], float]] = [
    (_op_linear, 6),
    (_op_matmul, 3),
    (_op_bmm, 2),
    (_op_view, 5),
    (_op_reshape, 3),
    (_op_transpose, 4),
    (_op_permute, 2),
    (_op_mT, 2),
    (_op_contiguous, 1.5),
    (_op_clone, 1),
    (_op_split, 3),
    (_op_cat, 2),
    (_op_slice, 3),
    (_op_select, 1),
    (_op_unflatten, 4),
    (_op_flatten, 3),
    (_op_binary, 5),
    (_op_scalar, 4),
    (_op_activation, 4),
    (_op_softmax, 3),
    (_op_layer_norm, 2),
    (_op_rms_norm, 2),
    (_op_reduce, 3),
    (_op_sdpa, 4),
    (_op_heads, 3),
    (_op_expand, 2),
    (_op_inplace, 3),
    (_op_redistribute, 4),
    (_op_local_roundtrip, 4),
]


def generate_program(seed: int, world_size: int, mesh_shape: Sequence[int] | None = None) -> Program:
    """The program of ``seed``: a function of the seed, world size and mesh shape only (the same on every rank)."""
    mesh_shape = tuple(mesh_shape or (world_size,))
    if math.prod(mesh_shape) != world_size:
        raise ValueError(f"mesh {mesh_shape} does not have {world_size} ranks")
    rng = random.Random(f"thunder_dtensor.fuzz/{seed}/{world_size}/{mesh_shape}")
    for _ in range(50):
        program = _Generator(rng, seed, world_size, mesh_shape).build()
        if program is not None:
            return program
    raise RuntimeError(f"no valid program drawn for seed {seed}")


def _dtensor_globals() -> dict[str, Any]:
    from thunder_dtensor.testing import make_full

    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    namespace = dict(
        torch=torch,
        F=F,
        DTensor=DTensor,
        Partial=Partial,
        Replicate=Replicate,
        Shard=Shard,
        distribute_tensor=distribute_tensor,
        make_full=make_full,
    )
    exec(compile(HELPERS_SOURCE, "<thunder_dtensor.fuzz helpers>", "exec"), namespace)
    return namespace


def _exec_function(source: str, name: str, namespace: dict[str, Any], filename: str) -> Callable:
    # registered in linecache: tracebacks (and thunder's source lookups) see the generated lines
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def program_functions(program: Program) -> tuple[Callable, Callable]:
    """``fn`` (on DTensors) and ``fn_plain`` (on full tensors), exec'd from the program's generated source."""
    tag = f"<thunder_dtensor.fuzz seed {program.seed} ws {program.world_size} mesh {program.mesh_shape}"
    fn = _exec_function(program.source(), "fn", dict(run_globals()), tag + ">")
    fn_plain = _exec_function(program.source(plain=True), "fn_plain", dict(_PLAIN_GLOBALS), tag + " plain>")
    return fn, fn_plain


# ---------------------------------------------------------------------------------------------------------
# Running and judging
# ---------------------------------------------------------------------------------------------------------


#: appended to a failure where eager DTensor differs from plain torch too
_EAGER_WRONG = " (eager DTensor differs from plain torch too)"
#: appended to a value mismatch where thunder gives exactly eager DTensor's (wrong) values
_AS_EAGER = "; thunder gives eager DTensor's values"


@dataclass
class Failure:
    """One difference of one thunder run (``mode``) from plain torch or eager DTensor."""

    mode: str
    kind: str
    #: forward / output / backward / grads (where an error was raised), or output / grad <name> (a mismatch)
    phase: str
    detail: str

    @property
    def signature(self) -> str:
        """The failure without its mode, numbers blanked: programs that fail the same way share it."""
        detail = re.sub(r"Tensor-likes are not close!.*allowed\)", "values differ", self.detail)
        detail = re.sub(r"0x[0-9a-f]+", "0x_", detail)
        detail = re.sub(r"\d+", "N", detail)[:160]
        phase = "grad" if self.phase.startswith("grad ") else self.phase
        return f"{self.kind} [{phase}] {detail}"

    def __str__(self) -> str:
        return f"{self.mode}: {self.kind} [{self.phase}] {self.detail}"


@dataclass
class ProgramResult:
    program: Program
    #: passed / eager-rejected / failed
    outcome: str
    #: what eager DTensor raised ("" if it ran)
    eager_error: str
    #: per thunder mode: matched / raised-clearly / failed
    mode_outcomes: dict[str, str]
    failures: list[Failure]
    seconds: float
    #: for a failing program, how thunder.jit alone (plain full tensors, no DTensor) gets it wrong ("": right)
    plain_thunder: str = ""
    #: eager attended on mixed layouts, so only values were compared (see ``_AttentionLayouts``)
    values_only: bool = False

    @property
    def upstream(self) -> str:
        """Why this failure is not this package's bug ("" if it is), with the evidence the fuzzer gathered:

        * thunder.jit alone fails the plain program too, and thunder_dtensor refuses it with a
          :class:`DTensorOpError` (a clear error where thunder itself would be wrong);
        * eager DTensor differs from plain torch too, and thunder gives eager's values (a torch DTensor bug that
          thunder reproduces faithfully) or refuses the program with a :class:`DTensorOpError`.
        """
        if not self.failures:
            return ""
        if self.plain_thunder and all(
            f.kind == "thunder-raises-eager-runs" and f.detail.startswith("DTensorOpError") for f in self.failures
        ):
            return "thunder.jit fails the plain program too; thunder_dtensor raises a DTensorOpError"
        if all(f.kind == "value-mismatch" and f.detail.endswith(_AS_EAGER) for f in self.failures):
            return "eager DTensor differs from plain torch, and thunder gives eager's values (a torch bug)"
        if all(
            f.kind == "thunder-raises-eager-runs" and f.detail.startswith("DTensorOpError") and _EAGER_WRONG in f.detail
            for f in self.failures
        ):
            return "eager DTensor differs from plain torch (a torch bug); thunder_dtensor raises a DTensorOpError"
        return ""

    def signature(self, failure: Failure) -> str:
        """The failure's signature, marked where thunder.jit fails the plain program too (the bug is upstream)."""
        return failure.signature + (" | plain thunder.jit fails too" if self.plain_thunder else "")

    def signatures(self) -> dict[str, str]:
        """Failure signature -> the modes that show it ("lowering", "no-lowering" or "both")."""
        modes: dict[str, set] = {}
        for f in self.failures:
            modes.setdefault(self.signature(f), set()).add(f.mode)
        return {sig: "both" if len(m) > 1 else next(iter(m)) for sig, m in modes.items()}

    def key(self) -> tuple:
        """What every rank must agree on."""
        failures = tuple(sorted((f.mode, f.kind, f.phase) for f in self.failures))
        return (self.program.seed, self.outcome, failures, bool(self.plain_thunder))

    def headline(self) -> str:
        kinds = sorted({f"{f.mode}:{f.kind}" for f in self.failures})
        upstream = f" | plain thunder.jit: {self.plain_thunder}" if self.plain_thunder else ""
        return f"FAIL ({self.seconds:.1f}s) {self.program.describe()} | {', '.join(kinds)}{upstream}"

    def reproducer(self, signature: str | None = None) -> str:
        """The reproducer for the mode that fails first (with ``signature``, if given); lists every failure."""
        chosen = [f for f in self.failures if signature is None or self.signature(f) == signature] or self.failures
        lowering = MODES.get(chosen[0].mode, True) if chosen else True
        found = [str(f) for f in self.failures]
        if self.plain_thunder:
            found.append(f"plain thunder.jit on the full tensors: {self.plain_thunder}")
        return self.program.reproducer(lowering, "\n".join(found))


@dataclass
class _Run:
    """What one way of running a program (eager DTensor or a jit) gave."""

    error: BaseException | None = None
    phase: str = ""
    not_dtensor: str = ""
    out_full: torch.Tensor | None = None
    placements: tuple | None = None
    #: the output DTensor's global shape (which can disagree with its full tensor's: a torch bug)
    shape: tuple | None = None
    out_requires_grad: bool = False
    backward_ran: bool = False
    grads: list = field(default_factory=list)
    grad_placements: list = field(default_factory=list)
    #: eager ran attention on a layout whose placements eager derives on its own (see ``_AttentionLayouts``)
    derived_attention: bool = False


class _AttentionLayouts(torch.overrides.TorchFunctionMode):
    """Notes whether eager DTensor runs attention on q, k, v that are not equally batch/head-sharded.

    There eager's output placements come from a strategy it derives per call (on CPU from the fused kernel's
    decomposition, in a way that depends on the dispatch context; on CUDA from other kernels' rules), while
    thunder_dtensor attends on replicated inputs: the same values, other placements by design
    (docs/architecture.md, "Attention"). The fuzzer then checks values only.
    """

    def __init__(self) -> None:
        super().__init__()
        self.derived = False

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            from thunder_dtensor.ops.attention import attends_on_local_shards

            self.derived |= not attends_on_local_shards(*args[:3])
        return func(*args, **(kwargs or {}))


class RanksDisagree(RuntimeError):
    """The ranks' results have different placements: gathering them would hang or mix up collectives."""


def _check_ranks_agree(what: str, placements: Any) -> None:
    """All-gather ``placements`` (their reprs) and raise :class:`RanksDisagree` on every rank if they differ.

    Every rank gathers and decides from the same gathered list, so all raise or none does: a program whose
    ranks chose differently (each rank decides DTensor's strategies on its own) fails here, named, instead of
    hanging in the next collective.
    """
    gathered, _ = _agree(repr(placements))
    if len(set(gathered)) > 1:
        raise RanksDisagree(
            f"{what} placements differ by rank: " + "; ".join(f"rank {r}: {p}" for r, p in enumerate(gathered))
        )


def _describe_error(error: BaseException) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:240]}"


def _execute(fn: Callable, make_inputs: Callable[[], list], cotangent: torch.Tensor | None) -> _Run:
    """Run ``fn`` on fresh DTensor inputs; forward, full output, backward (with ``cotangent``), full gradients."""
    from torch.distributed.tensor import DTensor

    run = _Run()
    inputs = make_inputs()
    layouts = _AttentionLayouts()
    try:
        with layouts:
            out = fn(*inputs)
    except Exception as error:
        run.error, run.phase = error, "forward"
        return run
    finally:
        run.derived_attention = layouts.derived
    if not isinstance(out, DTensor):
        run.not_dtensor = type(out).__name__
        return run
    try:
        _check_ranks_agree("output", tuple(out.placements))
        run.placements = tuple(out.placements)
        run.shape = tuple(out.shape)
        run.out_requires_grad = out.requires_grad
        run.out_full = out.full_tensor().detach()
    except Exception as error:
        run.error, run.phase = error, "output"
        return run
    if cotangent is None or not out.requires_grad:
        return run
    try:
        out.backward(run_globals()["cotangent_for"](out, cotangent))
    except Exception as error:
        run.error, run.phase = error, "backward"
        return run
    try:
        _check_ranks_agree("gradient", [getattr(x.grad, "placements", None) for x in inputs])
        for x in inputs:
            g = x.grad
            run.grads.append(g.full_tensor() if isinstance(g, DTensor) else g)
            run.grad_placements.append(tuple(g.placements) if isinstance(g, DTensor) else None)
    except Exception as error:
        run.error, run.phase = error, "grads"
        return run
    run.backward_ran = True
    return run


_RUN_GLOBALS: dict[str, Any] = {}


def run_globals() -> dict[str, Any]:
    """The namespace of the helpers (``make_input``, ``cotangent_for``), built once per process."""
    if not _RUN_GLOBALS:
        _RUN_GLOBALS.update(_dtensor_globals())
    return _RUN_GLOBALS


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: dict) -> str:
    """Empty if equal within ``tol``, else the first lines of assert_close's message."""
    try:
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as error:
        return " ".join([line for line in str(error).strip().splitlines() if line.strip()][:3])
    return ""


def _fmt(placements: Sequence[Any] | None) -> str:
    return "(" + ", ".join(map(str, placements or ())) + ")"


def _eager_mismatches(program: Program, eager: _Run, expected: torch.Tensor, expected_grads: list) -> set[str]:
    """Where eager DTensor's own values differ from plain torch ("output", "grad <name>"): for triage only."""
    tol = _TOLERANCES[program.dtype]
    wrong = set()
    wrong_values = eager.out_full is not None and _close(eager.out_full, expected.detach(), tol)
    if wrong_values or (eager.shape is not None and eager.shape != tuple(expected.shape)):
        wrong.add("output")
    for spec, want, have in zip(program.inputs, expected_grads, eager.grads if eager.backward_ran else ()):
        if want is not None and have is not None and _close(have, want, tol):
            wrong.add(f"grad {spec.name}")
    return wrong


def _judge(
    mode: str,
    program: Program,
    eager: _Run,
    got: _Run,
    expected: torch.Tensor,
    expected_grads: list,
    backward: bool,
) -> tuple[str, list[Failure]]:
    """A thunder run against plain torch (values) and eager DTensor (placements; whether it may raise)."""
    from thunder_dtensor.errors import DTensorOpError
    from thunder_dtensor.testing import same_placements

    eager_ran = eager.error is None and not eager.not_dtensor
    if got.not_dtensor:
        return "failed", [Failure(mode, "placement-mismatch", "output", f"the output is a {got.not_dtensor}")]
    tol = _TOLERANCES[program.dtype]
    failures = []
    eager_wrong = _eager_mismatches(program, eager, expected, expected_grads)
    also = _EAGER_WRONG
    if got.out_full is not None:  # the forward ran (a later error is judged below, after the forward's results)
        mismatch = _close(got.out_full, expected.detach(), tol)
        if mismatch:
            detail = mismatch + (also if "output" in eager_wrong else "")
            if "output" in eager_wrong and eager.out_full is not None and not _close(got.out_full, eager.out_full, tol):
                detail += _AS_EAGER
            failures.append(Failure(mode, "value-mismatch", "output", detail))
        if got.shape is not None and got.shape != tuple(expected.shape):
            detail = f"output global shape {list(got.shape)} vs torch {list(expected.shape)}"
            detail += also if "output" in eager_wrong else ""
            failures.append(Failure(mode, "value-mismatch", "output", detail))
        # eager's placements are the reference only where its values are right
        eager_reference = eager.placements is not None and "output" not in eager_wrong and not eager.derived_attention
        if eager_reference and not same_placements(got.placements, eager.placements):
            detail = f"output placements {_fmt(got.placements)} vs eager {_fmt(eager.placements)}"
            failures.append(Failure(mode, "placement-mismatch", "output", detail))
    if isinstance(got.error, RanksDisagree):
        return "failed", [*failures, Failure(mode, "rank-divergence", got.phase, _describe_error(got.error))]
    if got.error is not None:
        detail = _describe_error(got.error)
        if eager_ran:
            failures.append(
                Failure(mode, "thunder-raises-eager-runs", got.phase, detail + (also if eager_wrong else ""))
            )
        elif isinstance(got.error, DTensorOpError):
            return ("failed", failures) if failures else ("raised-clearly", [])
        else:
            # eager's own error passed through: no placements, no hint, but not from deep inside either
            same = eager.error is not None and _describe_error(eager.error) == detail
            failures.append(Failure(mode, "eager-error-reraised" if same else "unclear-error", got.phase, detail))
        return "failed", failures
    if backward:
        if not got.out_requires_grad:
            failures.append(Failure(mode, "grad-mismatch", "output", "the output does not require grad"))
        for i, spec in enumerate(program.inputs if got.backward_ran else ()):
            want, have = expected_grads[i], got.grads[i]
            where = f"grad {spec.name}"
            if want is None or have is None:
                if (want is None) != (have is None):
                    detail = "thunder gives no gradient" if have is None else "thunder gives a gradient, torch none"
                    failures.append(Failure(mode, "grad-mismatch", where, detail))
                continue
            mismatch = _close(have, want, tol)
            if mismatch:
                detail = mismatch + (also if where in eager_wrong else "")
                failures.append(Failure(mode, "grad-mismatch", where, detail))
            eager_reference = where not in eager_wrong and not eager.derived_attention
            if eager.backward_ran and eager.grad_placements[i] is not None and eager_reference:
                mine, theirs = got.grad_placements[i], eager.grad_placements[i]
                if mine is None or not same_placements(mine, theirs):
                    detail = f"gradient placements {_fmt(mine)} vs eager {_fmt(theirs)}"
                    failures.append(Failure(mode, "grad-placement-mismatch", where, detail))
    return ("failed" if failures else "matched"), failures


def mesh_shape_for(seed: int, world_size: int, mesh: str = "both") -> tuple[int, ...]:
    """The mesh a seed runs on: ``1d``, ``2d`` (2 x ws/2, needs ws >= 4) or ``both`` (odd seeds 2-D, if ws >= 4)."""
    two_d = (2, world_size // 2)
    if mesh == "1d" or (mesh == "both" and (world_size < 4 or seed % 2 == 0)):
        return (world_size,)
    if world_size < 4 or world_size % 2:
        raise ValueError(f"a 2-D mesh needs an even world size >= 4, not {world_size}")
    return two_d


def device_mesh_for(mesh_shape: Sequence[int]) -> Any:
    from thunder_dtensor.testing import mesh_1d, mesh_2d

    return mesh_1d() if len(mesh_shape) == 1 else mesh_2d(mesh_shape[0])


def run_program(program: Program, mesh: Any = None) -> ProgramResult:
    """Run ``program`` four ways (plain torch, eager DTensor, thunder.jit with and without the lowering); judge."""
    from thunder_dtensor._integration import clear_sharding_propagation_cache

    import thunder

    start = time.perf_counter()
    mesh = mesh if mesh is not None else device_mesh_for(program.mesh_shape)
    dtype = getattr(torch, program.dtype)
    helpers = run_globals()
    fn, fn_plain = program_functions(program)

    def make_inputs() -> list:
        return [
            helpers["make_input"](
                mesh, i.shape, i.seed, [eval(_placement_source(p), helpers) for p in i.placements], i.requires_grad,
                dtype=dtype, low=i.low,
            )
            for i in program.inputs
        ]  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replicated fallback's warnings, thunder's
        full_inputs = [_full(i, program.dtype).requires_grad_(i.requires_grad) for i in program.inputs]
        expected = fn_plain(*full_inputs)
        backward = expected.requires_grad and expected.is_floating_point()
        cotangent = None
        if backward:
            from thunder_dtensor.testing import make_full

            cotangent = make_full(expected.shape, seed=program.cotangent_seed, dtype=dtype)
            expected.backward(cotangent)
        expected_grads = [x.grad for x in full_inputs]

        # once per program (the jit runs share eager's decisions: the same inputs' sharding is the same); eager's
        # CPU attention strategy, found through decompositions, can take seconds to propagate
        clear_sharding_propagation_cache()
        eager = _execute(fn, make_inputs, cotangent)
        mode_outcomes: dict[str, str] = {}
        failures: list[Failure] = []
        for mode, lowering in MODES.items():
            try:
                got = _execute(thunder.jit(fn, dtensor_lowering=lowering), make_inputs, cotangent)
                outcome, found = _judge(mode, program, eager, got, expected, expected_grads, backward)
            except Exception as error:  # the harness itself: reported, not hidden
                outcome, found = "failed", [Failure(mode, "fuzzer-error", "judge", _describe_error(error))]
            mode_outcomes[mode] = outcome
            failures += found

        if isinstance(eager.error, RanksDisagree):  # eager DTensor in this process decides alike on every rank too
            failures.append(Failure("eager", "rank-divergence", eager.phase, _describe_error(eager.error)))
        plain_thunder = ""
        if failures:
            plain_thunder = _plain_thunder_check(fn_plain, program, expected, expected_grads, cotangent)

    eager_error = "" if eager.error is None else f"[{eager.phase}] {_describe_error(eager.error)}"
    if eager.not_dtensor:
        eager_error = f"[output] the output is a {eager.not_dtensor}"
    outcome = "failed" if failures else ("eager-rejected" if eager_error else "passed")
    seconds = time.perf_counter() - start
    return ProgramResult(
        program, outcome, eager_error, mode_outcomes, failures, seconds, plain_thunder, eager.derived_attention
    )


def _plain_thunder_check(
    fn_plain: Callable, program: Program, expected: torch.Tensor, expected_grads: list, cotangent: torch.Tensor | None
) -> str:
    """How thunder.jit alone gets the plain program wrong ("" if it does not): then the bug is not in DTensor code."""
    import thunder

    tol = _TOLERANCES[program.dtype]
    inputs = [_full(i, program.dtype).requires_grad_(i.requires_grad) for i in program.inputs]
    try:
        out = thunder.jit(fn_plain)(*inputs)
    except Exception as error:
        return f"raises {_describe_error(error)}"
    if _close(out.detach(), expected.detach(), tol):
        return "values differ"
    if cotangent is not None:
        try:
            out.backward(cotangent)
        except Exception as error:
            return f"the backward raises {_describe_error(error)}"
        for want, x in zip(expected_grads, inputs):
            if (want is None) != (x.grad is None) or (want is not None and _close(x.grad, want, tol)):
                return "gradients differ"
    return ""


# ---------------------------------------------------------------------------------------------------------
# Many programs
# ---------------------------------------------------------------------------------------------------------


@dataclass
class FuzzSummary:
    """Counts, failure kinds, the ops of failing programs, and one smallest reproducer per failure signature."""

    world_size: int
    results: list[ProgramResult] = field(default_factory=list)
    stopped: str = ""
    seconds: float = 0.0
    #: failure signature -> its smallest program made smaller (when the fuzz run was asked to)
    minimized: dict[str, ProgramResult] = field(default_factory=dict)

    @property
    def failed(self) -> list[ProgramResult]:
        return [r for r in self.results if r.outcome == "failed"]

    @property
    def failed_here(self) -> list[ProgramResult]:
        """The failing programs whose bug is this package's (not upstream: see ``ProgramResult.upstream``)."""
        return [r for r in self.failed if not r.upstream]

    def counts(self) -> Counter:
        counts: Counter = Counter(r.outcome for r in self.results)
        counts["values-only"] = sum(r.outcome == "passed" and r.values_only for r in self.results)
        for r in self.results:
            if r.outcome == "eager-rejected":
                ran = any(o == "matched" for o in r.mode_outcomes.values())
                counts[
                    "eager-rejected/thunder-ran-and-matched" if ran else "eager-rejected/thunder-DTensorOpError"
                ] += 1
        return counts

    def kinds(self) -> Counter:
        """Failing (program, mode) pairs per kind."""
        return Counter(pair for r in self.failed for pair in {(f.mode, f.kind) for f in r.failures})

    def signatures(self) -> dict[str, list[ProgramResult]]:
        """Failure signature -> the programs that show it, smallest first."""
        out: dict[str, list[ProgramResult]] = {}
        for r in self.failed:
            for sig in r.signatures():
                out.setdefault(sig, []).append(r)
        for rs in out.values():
            rs.sort(key=lambda r: r.program.size_key())
        return dict(sorted(out.items(), key=lambda kv: -len(kv[1])))

    def summary_line(self) -> str:
        c = self.counts()
        kinds = Counter(f"{kind}" for (_, kind) in self.kinds().elements())
        by_kind = ", ".join(f"{k}={kinds[k]}" for k in FAILURE_KINDS if kinds[k]) or "none"
        stopped = f" (stopped: {self.stopped})" if self.stopped else ""
        return (
            f"fuzz summary (world size {self.world_size}, {self.seconds:.0f}s){stopped}: ran={len(self.results)} "
            f"passed={c['passed']} (values only, after attention on mixed layouts: {c['values-only']}) "
            f"eager-rejected={c['eager-rejected']} "
            f"(thunder DTensorOpError={c['eager-rejected/thunder-DTensorOpError']}, "
            f"thunder ran and matched={c['eager-rejected/thunder-ran-and-matched']}) failed={c['failed']} "
            f"(upstream={len(self.failed) - len(self.failed_here)}) | "
            f"failing runs by kind: {by_kind}"
        )

    def report_lines(self, *, max_signatures: int = 40) -> list[str]:
        """The summary: per-mode kinds, op kinds of failing programs, and each signature's smallest program."""
        lines = [self.summary_line()]
        if not self.failed:
            return lines
        per_mode = ", ".join(f"{mode}:{kind}={n}" for (mode, kind), n in sorted(self.kinds().items()))
        lines.append(f"  failing runs by mode and kind: {per_mode}")
        ops_failed = Counter(k for r in self.failed for k in set(r.program.kinds))
        ops_all = Counter(k for r in self.results for k in set(r.program.kinds))
        lines.append(
            "  ops in failing programs (failing/all programs with it): "
            + ", ".join(f"{k}={n}/{ops_all[k]}" for k, n in ops_failed.most_common())
        )
        sigs = self.signatures()
        lines.append(f"  {len(sigs)} distinct failure signatures:")
        for sig, rs in list(sigs.items())[:max_signatures]:
            common = set(rs[0].program.kinds).intersection(*(set(r.program.kinds) for r in rs))
            modes = Counter(r.signatures()[sig] for r in rs)
            lines.append(f"  [{len(rs)} programs; {', '.join(f'{m} {n}' for m, n in modes.most_common())}] {sig}")
            lines.append(f"      ops in all of them: {', '.join(sorted(common)) or '-'}")
            lines.append(f"      smallest: {rs[0].program.describe()}")
            if sig in self.minimized:
                lines.append(f"      reduced:  {self.minimized[sig].program.describe()}")
        return lines


def parse_seeds(text: str) -> range:
    """``START:STOP`` (or a single seed)."""
    if ":" in text:
        start, stop = text.split(":", 1)
        return range(int(start), int(stop))
    return range(int(text), int(text) + 1)


def _agree(key: Any, flag: bool = False) -> tuple[list, bool]:
    """Every rank's ``key`` (all_gather_object), and whether any rank raised ``flag``: the ranks' agreement step."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [key], flag
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (key, flag))
    return [k for k, _ in gathered], any(f for _, f in gathered)


def _step_groups(steps: Sequence[Step]) -> list[list[int]]:
    """Step indices that only go together: a clone and the in-place op after it, to_local ... from_local."""
    groups, i = [], 0
    while i < len(steps):
        if steps[i].kind == "clone" and i + 1 < len(steps) and steps[i + 1].kind == "inplace":
            size = 2
        elif steps[i].kind == "to_local":
            size = 3
        else:
            size = 1
        groups.append(list(range(i, min(i + size, len(steps)))))
        i += size
    return groups


def _rebuild(program: Program, steps: Sequence[Step], inputs: Sequence[InputSpec] | None = None) -> Program | None:
    """``program`` with other steps (or inputs): re-run on plain tensors for the shapes; None where torch rejects it.

    Inputs no step names any more are dropped.
    """
    if not steps:
        return None
    text = "\n".join(st.line for st in steps)
    specs = program.inputs if inputs is None else tuple(inputs)
    used = tuple(i for k, i in enumerate(specs) if k == 0 or re.search(rf"\b{i.name}\b", text))
    env: dict[str, Any] = {i.name: _full(i, program.dtype).requires_grad_(i.requires_grad) for i in used}
    env["y"] = env[used[0].name]
    rebuilt = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for st in steps:
                if st.plain is not None:
                    exec(st.plain, _PLAIN_GLOBALS, env)
                rebuilt.append(replace(st, shape=tuple(env["y"].shape)))
    except Exception:
        return None
    reduced_from = program.reduced_from or f"{len(program.steps)} ops"
    candidate = replace(program, inputs=used, steps=tuple(rebuilt), reduced_from=reduced_from)
    return candidate if _plain_runs_well(candidate) else None


def minimize(result: ProgramResult, signature: str | None = None, *, max_runs: int = 24) -> ProgramResult:
    """A smaller program that still fails with ``signature`` (default: the first failure's), for the reproducer.

    First the shortest failing prefix of the chain (where the failure starts), then steps dropped one group at a
    time, then inputs made Replicate and not requiring grad; at most ``max_runs`` runs. Call on every rank: the
    ranks agree after each run, and stop where they do not.
    """
    signature = signature or result.signature(result.failures[0])
    best = result
    runs = 0

    def still_fails(candidate: Program | None) -> bool:
        nonlocal best, runs
        if candidate is None or runs >= max_runs:
            return False
        runs += 1
        r = run_program(candidate)
        keys, _ = _agree(r.key())
        if len(set(keys)) > 1:
            runs = max_runs  # the ranks diverged: keep what all of them agreed on
            return False
        if signature not in r.signatures():
            return False
        best = r
        return True

    steps = best.program.steps
    groups = _step_groups(steps)
    for k in range(1, len(groups)):
        if still_fails(_rebuild(best.program, [steps[i] for g in groups[:k] for i in g])):
            break
    progress = True
    while progress and runs < max_runs:
        progress = False
        steps = best.program.steps
        groups = _step_groups(steps)
        for j in range(len(groups) - 1):
            if still_fails(_rebuild(best.program, [steps[i] for gi, g in enumerate(groups) if gi != j for i in g])):
                progress = True
                break
    for idx in range(len(best.program.inputs)):
        spec = best.program.inputs[idx]
        simpler = [
            replace(spec, placements=("R",) * len(spec.placements)) if set(spec.placements) != {"R"} else None,
            replace(spec, requires_grad=False) if spec.requires_grad else None,
        ]
        for new in simpler:
            if new is not None:
                inputs = list(best.program.inputs)
                inputs[idx] = new
                still_fails(_rebuild(best.program, best.program.steps, inputs))
    return best


def fuzz(
    seeds: Iterable[int],
    *,
    mesh: str = "both",
    time_limit_s: float | None = None,
    stop_on_failure: bool = False,
    on_result: Callable[[ProgramResult], None] | None = None,
    minimize_failures: bool = False,
) -> FuzzSummary:
    """Generate and run the programs of ``seeds`` on every rank (call under torchrun, after init_distributed).

    After each program the ranks compare their outcomes (all_gather_object): a difference is a
    ``rank-divergence`` failure and ends the run, as do the time limit (any rank past it) and, if asked, a failure.
    ``minimize_failures``: then the smallest program of each failure signature is made smaller (:func:`minimize`;
    a few seconds per signature, not counted in the time limit).
    """
    from thunder_dtensor.testing import world_size

    ws = world_size()
    summary = FuzzSummary(ws)
    start = time.perf_counter()
    for seed in seeds:
        mesh_shape = mesh_shape_for(seed, ws, mesh)
        try:
            program = generate_program(seed, ws, mesh_shape)
            result = run_program(program)
        except Exception as error:  # the harness itself: recorded as a failure of its own
            program = Program(seed, ws, mesh_shape, "float32", (InputSpec("x", (1,), ("R",), False, 0),), (), 0)
            failure = Failure("all", "fuzzer-error", "harness", _describe_error(error))
            result = ProgramResult(program, "failed", "", {}, [failure], 0.0)
        over_time = time_limit_s is not None and time.perf_counter() - start > time_limit_s
        keys, over_time = _agree(result.key(), over_time)
        if len(set(keys)) > 1:
            detail = "; ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
            result.failures.append(Failure("all", "rank-divergence", "agreement", detail))
            result.outcome = "failed"
            summary.stopped = "the ranks diverged"
        summary.results.append(result)
        if on_result is not None:
            on_result(result)
        if summary.stopped:
            break
        if stop_on_failure and result.outcome == "failed":
            summary.stopped = f"first failure (seed {seed})"
            break
        if over_time:
            summary.stopped = f"time limit {time_limit_s}s"
            break
    summary.seconds = time.perf_counter() - start
    if minimize_failures and summary.stopped != "the ranks diverged":
        for sig, results in summary.signatures().items():
            summary.minimized[sig] = minimize(results[0], sig)
    return summary
