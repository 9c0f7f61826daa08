"""A differential fuzzer: random Transformer-style DTensor programs, run several ways and compared.

Hand-written tests cover the op/placement pairs someone thought of; the bugs left are at the boundaries between
ops (a view of a transposed value, a lowered op feeding an eager one, ``from_local`` of a value the lowering
produced). :func:`generate_program` draws a seeded chain of 3-8 ops (linear, matmul, views, slicing, norms,
attention, reductions, in-place ops, redistribute, to_local/from_local round trips, embeddings and losses with
their keywords, values read from the data: ``.item()`` into a later op, comparisons into ``torch.where``, Python
``if`` on a tensor, ...) over inputs with random placements (Shard on any dim, Replicate, Partial; even and
uneven shards; 1-D and 2-D meshes; integer ids and targets) and random ``requires_grad``. :func:`run_program`
runs it as plain torch on the full tensors (the math), as eager DTensor (the placements, and whether the program
is legal at all), and under ``thunder.jit`` with the lowering on and off (and under thunderfx, for programs that
read values into Python), forward and backward, each compiled function called twice with the same specs and
other data (a value fixed at trace time fails the second call; a retrace where plain thunder has none fails), and
classifies every difference. Each program is one function whose source is generated from the op chain; the same
text is exec'd to run it and printed in a standalone reproducer.

Triage comes with each failure: whether eager DTensor itself differs from plain torch, whether thunder.jit alone
(plain full tensors) fails the same program (then the bug is upstream), and, with :func:`minimize`, the shortest
failing prefix of the chain with the steps and input placements it does not need removed. A read of data that
``thunder.jit`` refuses at trace time (``if x.sum() > 0:``) is expected where plain thunder refuses the plain
program too.

Run it with ``scripts/fuzz.py`` under torchrun (``make fuzz``); every rank draws the same programs and takes the
same path, checked after each program.
"""

from __future__ import annotations

import contextlib
import linecache
import math
import random
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

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
    "retrace",
    "rank-divergence",
    "fuzzer-error",
)

#: The thunder runs of a program: name -> ``dtensor_lowering`` of ``thunder.jit`` (None: thunderfx, which runs only
#: the programs with ``Program.thunderfx``: those that read values into Python, and a share of the others).
MODES: dict[str, bool | None] = {"lowering": True, "no-lowering": False, "thunderfx": None}
#: further ``thunder.jit`` options of the lowering mode (``scripts/fuzz.py --one-shot-bytes``: small all-reduces as
#: one all-gather and a sum, ``dtensor_one_shot_all_reduce_bytes``)
LOWERING_OPTIONS: dict[str, Any] = {}
#: each compiled function is called once per data set: the same specs (shapes, placements), other values
CALLS: tuple[int, ...] = (0, 1)

# Small shapes keep a program's four runs well under a second on two CPU cores.
_MAX_INPUT_NUMEL = 512
_MAX_NUMEL = 2048
_MAX_NDIM = 5
_MIN_OPS, _MAX_OPS = 3, 8
_TOLERANCES = {"float32": {"rtol": 1e-4, "atol": 1e-5}, "float64": {"rtol": 1e-7, "atol": 1e-7}}

# Input construction and the cotangent, shared by the runner (exec'd) and every reproducer (printed), so the
# reproducer builds exactly the DTensors the fuzzer ran.
HELPERS_SOURCE = '''
def make_input(mesh, shape, seed, placements, requires_grad, dtype=torch.float32, low=-1.0, int_high=0):
    """The seeded full tensor as a DTensor. A Partial mesh dim holds (coordinate + 1) / (1 + ... + n) of it.

    ``int_high``: an integer tensor (ids, targets) in [0, int_high) instead, never Partial."""
    full = make_full(shape, seed=seed, dtype=torch.int64 if int_high else dtype, low=low, int_high=int_high or 5)
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
    """The full cotangent distributed like ``out``; a Partial mesh dim gets Replicate (a cotangent is a full value).

    A ``_StridedShard`` placement is kept only where the DTensor made holds ``full``: torch distributes ``full`` to
    some of them (``(_StridedShard(1, sf=6),) * 2`` on a 2x2 mesh, fuzz seed 13002) as a DTensor whose value is
    another (its spec has no shard order), or one whose ``full_tensor()`` raises (a 48-element output placed
    ``(_StridedShard(0, sf=6), S(0))``, seed 15430: every rank fails torch's unpadding check), and the cotangent is
    then the replicated one. Where the output's own spec (its shard order included) holds ``full`` with the local
    shard made, the cotangent has that spec: eager compares specs, not placements only, and redistributed a
    cotangent placed as the output but without its shard order (seed 17148: ``x.grad`` then Replicate where the
    output's own ``ones_like`` gives ``Shard(1)``)."""
    placements = [Replicate() if p.is_partial() else p for p in out.placements]
    replicated = distribute_tensor(full, out.device_mesh, [Replicate()] * len(placements), src_data_rank=None)
    try:
        made = distribute_tensor(full, out.device_mesh, placements, src_data_rank=None)
    except Exception:  # placements distribute_tensor cannot make directly (_StridedShard): redistribute to them
        made = replicated.redistribute(out.device_mesh, placements)
    if not any(type(p).__name__ == "_StridedShard" for p in placements):
        return made
    candidates = [made]
    if tuple(out.placements) == tuple(placements) and out.is_contiguous() and out.dtype == made.dtype:
        candidates.insert(0, DTensor(made.to_local(), out._spec, requires_grad=False))
    for candidate in candidates:
        try:
            if torch.equal(candidate.full_tensor(), full):
                return candidate
        except RuntimeError:  # torch's own gather of the layout fails (seed 15430)
            pass
    return replicated
'''

_IMPORTS_SOURCE = """\
import torch
import torch.nn.functional as F

import thunder_dtensor  # noqa: F401  (before thunder)
import thunder
from thunder_dtensor.testing import init_distributed, make_full, mesh_1d, mesh_2d, same_placements
from thunder_dtensor.testing import table_gradient_placements_accepted
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


def _placement_object(p: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Replicate() if p == "R" else Partial() if p == "P" else Shard(int(p[1:]))


def _placements_source(placements: Sequence[str]) -> str:
    return "[" + ", ".join(_placement_source(p) for p in placements) + "]"


def _second_seed(seed: int) -> int:
    """The seed of a value's second data set (the second call of each compiled function)."""
    return (seed * 1103515245 + 12345) % (1 << 31)


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
    #: an integer input (ids, targets: int64 in [0, int_high)) where > 0; never Partial, never requires grad
    int_high: int = 0

    def data_seed(self, call: int) -> int:
        """The ``make_full`` seed of the data of ``call`` (0 or 1): same spec, other values."""
        return self.seed if call == 0 else _second_seed(self.seed)

    def describe(self) -> str:
        shape = ",".join(map(str, self.shape))
        kind = f":int<{self.int_high}" if self.int_high else ""
        return f"{self.name}[{shape}]:{'/'.join(self.placements)}{kind}{':rg' if self.requires_grad else ''}"


@dataclass(frozen=True)
class Step:
    """One op of the chain: its line(s) in the DTensor program and in the plain-torch one (None: identity there)."""

    kind: str
    line: str
    plain: str | None
    #: the running value's full shape after this step
    shape: tuple[int, ...] = ()
    #: a Python number the step reads from the data (``s1 = y.sum().item()``): returned by the program, compared
    defines: str = ""
    #: the inputs the step writes into (``F.embedding(..., max_norm=...)`` renormalizes the table's rows)
    writes: tuple[str, ...] = ()
    #: the embedding tables the step looks up in: a vocab-sharded one's gradient keeps the table's placements, Partial
    #: where eager's is (the package's decision; eager's is Replicate or Partial as it flows)
    tables: tuple[str, ...] = ()
    #: an expression, evaluated on the plain values before the step, that must hold for the program to be drawn:
    #: the values a comparison reads are far from its threshold, so that no rounding difference flips it
    margin: str = ""


#: steps that read values of the data into Python: their programs also run under thunderfx
_READS_DATA = frozenset({"item", "if"})
#: steps whose output may be a 0-dim value: the last step of a program
_FINAL_KINDS = frozenset({"cross_entropy", "nll_loss"})


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
    #: also run under thunderfx (every program that reads values into Python, and a share of the others)
    thunderfx: bool = False

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.steps)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.steps[-1].shape

    @property
    def numbers(self) -> tuple[str, ...]:
        """The Python numbers the program reads (``.item()``), returned beside ``y`` and compared as numbers."""
        return tuple(s.defines for s in self.steps if s.defines)

    @property
    def written(self) -> tuple[int, ...]:
        """The indices of the inputs a step writes into: their values after the call are compared too."""
        names = {n for s in self.steps for n in s.writes}
        return tuple(k for k, i in enumerate(self.inputs) if i.name in names)

    @property
    def tables(self) -> tuple[int, ...]:
        """The indices of the embedding tables whose gradients keep the tables' placements, Partial where eager's is
        (``table_gradient_placements_accepted``): vocab-sharded ones, and those of a lookup with
        ``scale_grad_by_freq=True`` (counted over the whole batch, on replicated ids: ``ops/embedding.py``; eager's
        own gradient there is ``Partial`` of per-shard counts, fuzz seeds 53 and 11296)."""
        names = {n for s in self.steps for n in s.tables}
        counted = {n for s in self.steps for n in s.tables if "scale_grad_by_freq=True" in s.line}
        return tuple(
            k for k, i in enumerate(self.inputs) if i.name in names and ("S0" in i.placements or i.name in counted)
        )

    @property
    def reads_data(self) -> bool:
        return any(s.kind in _READS_DATA for s in self.steps)

    @property
    def modes(self) -> tuple[str, ...]:
        return ("lowering", "no-lowering") + (("thunderfx",) if self.thunderfx or self.reads_data else ())

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
                text = s.line
            elif s.plain is None:
                text = "\n".join(f"# {line}" for line in s.line.splitlines()) + "  (DTensor only: the identity)"
            else:
                text = s.plain
            lines += [f"    {line}" for line in text.splitlines()]
        numbers = self.numbers
        lines.append(f"    return y, ({', '.join(numbers)},)" if numbers else "    return y")
        return "\n".join(lines) + "\n"

    def size_key(self) -> tuple[int, int, int]:
        """Smaller is a better reproducer: fewer ops, then fewer elements."""
        return (len(self.steps), sum(math.prod(i.shape) for i in self.inputs), self.seed)

    def describe(self) -> str:
        inputs = " ".join(i.describe() for i in self.inputs)
        reduced = f" (reduced from {self.reduced_from})" if self.reduced_from else ""
        fx = " +thunderfx" if "thunderfx" in self.modes else ""
        return (
            f"seed={self.seed}{reduced} mesh={self.mesh_shape} {self.dtype}{fx} | {inputs} | {' > '.join(self.kinds)}"
        )

    def reproducer(self, mode: str = "lowering", found: str = "") -> str:
        """A standalone script (run under torchrun) that builds the inputs and runs the failing compiled function
        on both data sets, checking what the fuzzer checks."""
        mesh = "mesh_1d()" if len(self.mesh_shape) == 1 else f"mesh_2d({self.mesh_shape[0]})"
        specs = "\n".join(
            f"    ({list(i.shape)}, ({i.data_seed(0)}, {i.data_seed(1)}), {_placements_source(i.placements)}, "
            f"{i.requires_grad}, {i.low}, {i.int_high}),  # {i.name}"
            for i in self.inputs
        )
        tol = _TOLERANCES[self.dtype]
        found_lines = "".join(f"\n    {line}" for line in found.splitlines())
        plain_fn = self.source(plain=True) if self.differs_in_plain else "fn_plain = fn\n"
        if MODES[mode] is None:
            compiled, fx_import, how = "thunderfx(fn)", "from thunder.dynamo import thunderfx\n", "thunderfx"
        else:
            options = ", ".join(f"{k}={v!r}" for k, v in _jit_options(mode).items())
            compiled, fx_import, how = f"thunder.jit(fn, {options})", "", f"mode {mode}"
        retrace_check = (
            ""
            if MODES[mode] is None
            else '\nprint("traces:", thunder.cache_misses(compiled), "(plain thunder.jit: 1 unless it retraces too)")'
            '\nassert thunder.cache_misses(compiled) == 1, "retraced for other data of the same specs"'
        )
        return f'''\
"""thunder_dtensor fuzz reproducer: seed {self.seed}, world size {self.world_size}, mesh {self.mesh_shape}, \
{self.dtype}, {how}.{f" Reduced from {self.reduced_from}." if self.reduced_from else ""}

Found:{found_lines}

Run: torchrun --nproc-per-node {self.world_size} repro.py
"""

import math

{_IMPORTS_SOURCE}{fx_import}{HELPERS_SOURCE}

{self.source()}

{plain_fn}
init_distributed()
mesh = {mesh}
DTYPE = torch.{self.dtype}
SPECS = [  # full shape, make_full seeds (first call, second call), placements, requires_grad, low, int_high
{specs}
]
NUMBERS = {list(self.numbers)!r}  # the numbers the program reads with .item(), returned beside its output
WRITTEN = {list(self.written)!r}  # the inputs it writes into (max_norm): compared after the call
TABLES = {list(self.tables)!r}  # vocab-sharded or counted tables: the gradient keeps their placements
COTANGENT_SEEDS = ({self.cotangent_seed}, {_second_seed(self.cotangent_seed)})
RTOL, ATOL = {tol["rtol"]}, {tol["atol"]}


def dtensors(call):
    return [
        make_input(mesh, shape, seeds[call], p, rg, dtype=DTYPE, low=low, int_high=ih)
        for shape, seeds, p, rg, low, ih in SPECS
    ]


def fulls(call):
    return [
        make_full(shape, seed=seeds[call], dtype=torch.int64 if ih else DTYPE, low=low, int_high=ih or 5)
        .requires_grad_(rg)
        for shape, seeds, _, rg, low, ih in SPECS
    ]


def split(result):
    return result if isinstance(result, tuple) else (result, ())


compiled = {compiled}
EAGER_WRONG = set()  # what eager DTensor computed wrong, on this data or earlier: its placements there are no reference
for call in range(2):  # one compiled function, two calls: the same specs, other data
    print(f"---- call {{call}} ----")
    inputs = dtensors(call)
    out, numbers = split(compiled(*inputs))
    # plain torch on the full tensors: what the values must be; eager DTensor: what the placements must be
    full_inputs = fulls(call)
    expected, expected_numbers = split(fn_plain(*full_inputs))
    eager_inputs = dtensors(call)
    try:
        eager, eager_numbers = split(fn(*eager_inputs))
    except Exception as error:
        eager = None
        print("eager DTensor raises:", repr(error))
    print("output placements: thunder", out.placements, "eager", eager.placements if eager is not None else "-")
    if eager is not None:
        eager_right = torch.allclose(eager.full_tensor(), expected.detach(), rtol=RTOL, atol=ATOL)
        print("eager DTensor matches plain torch:", eager_right)
        print("numbers: thunder", numbers, "eager", eager_numbers, "plain torch", expected_numbers)
        if not eager_right:
            EAGER_WRONG.add("output")
    torch.testing.assert_close(out.full_tensor(), expected.detach(), rtol=RTOL, atol=ATOL)
    for name, have, want in zip(NUMBERS, numbers, expected_numbers):
        close = math.isclose(have, want, rel_tol=RTOL, abs_tol=ATOL)
        assert type(have) is type(want) and close, f"{{name}}: {{have!r}} vs plain torch {{want!r}}"
    for i in WRITTEN:
        torch.testing.assert_close(inputs[i].full_tensor(), full_inputs[i].detach(), rtol=RTOL, atol=ATOL)
    if eager is not None and "output" not in EAGER_WRONG:
        assert same_placements(out.placements, eager.placements), "output placements differ from eager"
    if expected.requires_grad:
        cotangent = make_full(expected.shape, seed=COTANGENT_SEEDS[call], dtype=expected.dtype)
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
            torch.testing.assert_close(x.grad.full_tensor(), full.grad, rtol=RTOL, atol=ATOL)
            if eager is not None:
                print(f"grad {{i}} placements: thunder", x.grad.placements, "eager", eager_inputs[i].grad.placements)
                if not torch.allclose(eager_inputs[i].grad.full_tensor(), full.grad, rtol=RTOL, atol=ATOL):
                    EAGER_WRONG.add(f"grad {{i}}")
                if EAGER_WRONG & {{"output", f"grad {{i}}"}}:
                    print(f"  eager's gradient {{i}} or output is wrong here or on earlier data: not compared")
                    continue
                mine, theirs = x.grad.placements, eager_inputs[i].grad.placements
                same = same_placements(mine, theirs) or (
                    i in TABLES and table_gradient_placements_accepted(mine, theirs, x.placements)
                )
                assert same, f"grad {{i}} placements"{retrace_check}
print("no failure reproduced")
'''


# ---------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------


def _apart(a: Any, b: Any, scale: Any) -> bool:
    """Every element of ``a`` is farther from ``b`` than rounding could move it (relative to ``scale``): a
    comparison of them gives the same answer in float32 and float64, in any summation order."""
    a, b, scale = (torch.as_tensor(v).detach().double() for v in (a, b, scale))
    return bool(((a - b).abs() > 1e-4 * (1.0 + scale.abs().max())).all())


_PLAIN_GLOBALS: dict[str, Any] = {"torch": torch, "F": F, "apart": _apart}


def _full(spec: InputSpec, dtype: str, call: int = 0) -> torch.Tensor:
    from thunder_dtensor.testing import make_full

    if spec.int_high:
        return make_full(spec.shape, seed=spec.data_seed(call), dtype=torch.int64, int_high=spec.int_high)
    t = make_full(spec.shape, seed=spec.data_seed(call), dtype=getattr(torch, dtype), low=spec.low)
    return t.requires_grad_(spec.requires_grad)


def _factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(2, n) if n % a == 0]


def _dims(shape: Sequence[int]) -> str:
    return ", ".join(map(str, shape))


class _Unfit(Exception):
    """A step's margin does not hold, or a value is out of bounds: the candidate (or program) is not drawn."""


def _exec_plain(steps: Sequence[Step], env: dict[str, Any], *, final_ok: bool = False) -> list[tuple[int, ...]]:
    """Run ``steps``' plain lines in ``env`` (checking their margins and the values' bounds); each step's shape.

    ``final_ok``: the last step may give a 0-dim value (a loss).
    """
    shapes = []
    for k, st in enumerate(steps):
        if st.margin and not eval(st.margin, _PLAIN_GLOBALS, env):
            raise _Unfit(f"margin of {st.kind}")
        if st.plain is not None:
            exec(st.plain, _PLAIN_GLOBALS, env)
        y = env["y"]
        ndim_ok = 1 <= y.ndim <= _MAX_NDIM or (y.ndim == 0 and final_ok and k == len(steps) - 1)
        if not ndim_ok or not 0 < y.numel() <= _MAX_NUMEL or not bool(torch.isfinite(y).all()):
            raise _Unfit("out of bounds")
        if st.defines and not math.isfinite(env[st.defines]):
            raise _Unfit("a number that is not finite")
        shapes.append(tuple(y.shape))
    return shapes


def _inputs_env(inputs: Iterable[InputSpec], dtype: str, call: int) -> dict[str, Any]:
    env: dict[str, Any] = {i.name: _full(i, dtype, call) for i in inputs}
    return env


class _Generator:
    """Draws one program: each candidate step is run on the plain full tensors, and kept only if torch runs it.

    Running the candidates is what keeps every program valid for plain torch (a ``view`` of a transposed value,
    an in-place op on a view) without modelling strides here, and it gives each step's full shape. Candidates run
    on both data sets (:data:`CALLS`), so that margins and bounds hold for the second call too.
    """

    def __init__(
        self,
        rng: random.Random,
        seed: int,
        world_size: int,
        mesh_shape: tuple[int, ...],
        thunderfx_share: float = 0.0,
        view_writes: float = 0.0,
    ):
        self.rng = rng
        self.thunderfx_share = thunderfx_share
        self.view_writes = view_writes
        self.seed = seed
        self.world_size = world_size
        self.mesh_shape = mesh_shape
        self.dtype = "float32" if rng.random() < 0.8 else "float64"
        self.grad_mode = rng.choices(["none", "all", "some"], weights=[2, 3, 5])[0]
        self.inputs: list[InputSpec] = []
        self.steps: list[Step] = []
        #: the plain values, one namespace per data set
        self.envs: list[dict[str, Any]] = []
        self.pending: list[InputSpec] = []
        #: the Python numbers read so far (``.item()``), usable by later steps
        self.numbers: list[str] = []
        self.counter = 0
        self.n_ops = _MAX_OPS

    @property
    def env(self) -> dict[str, Any]:
        return self.envs[0]

    # -- inputs ------------------------------------------------------------------------------------------

    def size(self) -> int:
        return self.rng.choice([2, 3, 4, 4, 5, 6, 6, 7, 8, 8])

    def placements(self, ndim: int, *, partial: bool = True) -> tuple[str, ...]:
        out = []
        for _ in self.mesh_shape:
            r = self.rng.random()
            if r < 0.45 and ndim > 0:
                out.append(f"S{self.rng.randrange(ndim)}")
            elif r < 0.8 or not partial:
                out.append("R")
            else:
                out.append("P")
        return tuple(out)

    def requires_grad(self) -> bool:
        return {"none": False, "all": True}.get(self.grad_mode, self.rng.random() < 0.5)

    def new_input(
        self,
        prefix: str,
        shape: Sequence[int],
        low: float = -1.0,
        *,
        placements: Sequence[str] | None = None,
        requires_grad: bool | None = None,
    ) -> str:
        """An extra input (weight, bias, other operand) with its own placements; kept if the step is."""
        self.counter += 1
        name = f"{prefix}{self.counter}"
        placements = tuple(placements) if placements is not None else self.placements(len(shape))
        requires_grad = self.requires_grad() if requires_grad is None else requires_grad
        spec = InputSpec(name, tuple(shape), placements, requires_grad, self.rng.randrange(1 << 30), low)
        self.pending.append(spec)
        return name

    def new_int_input(self, prefix: str, shape: Sequence[int], high: int) -> str:
        """Integer ids or targets in [0, high), Replicate or Shard (never Partial), no gradient."""
        self.counter += 1
        name = f"{prefix}{self.counter}"
        placements = self.placements(len(shape), partial=False)
        spec = InputSpec(name, tuple(shape), placements, False, self.rng.randrange(1 << 30), int_high=high)
        self.pending.append(spec)
        return name

    def new_number(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

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
        self.envs = [_inputs_env([spec], self.dtype, call) for call in CALLS]
        for env in self.envs:
            env["y"] = env["x"]

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
        """Every dim of the running value, and of each value before it, divides over all ranks: shards are even
        whatever the placements (from_local infers shape). The values before count: a flatten keeps an uneven dim's
        shards uneven in a ``_StridedShard`` of an even-sized dim (fuzz seed 14320: ``[8, 7]`` placed ``S(1)``,
        flattened to ``[56]``, each rank's shard inferred as 14 elements; the ranks' collectives then disagreed in
        size and gloo aborted the run)."""
        n = math.prod(self.mesh_shape)
        shapes = [self.shape, self.inputs[0].shape, *(st.shape for st in self.steps)]
        return all(s % n == 0 for shape in shapes for s in shape)

    # -- candidates --------------------------------------------------------------------------------------

    def try_steps(self, steps: list[Step]) -> bool:
        envs = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for call, env in zip(CALLS, self.envs):
                    env = dict(env)
                    env.update(_inputs_env(self.pending, self.dtype, call))
                    shapes = _exec_plain(steps, env, final_ok=steps[-1].kind in _FINAL_KINDS)
                    envs.append(env)
                if len({tuple(e["y"].shape) for e in envs}) > 1:
                    raise _Unfit("the data decided the shape")
        except Exception:
            self.pending.clear()
            return False
        self.envs = envs
        self.inputs += self.pending
        self.pending.clear()
        self.steps += [replace(st, shape=s) for st, s in zip(steps, shapes)]
        self.numbers += [st.defines for st in steps if st.defines]
        return True

    def build(self) -> Program | None:
        self.first_input()
        self.n_ops = n_ops = self.rng.randint(_MIN_OPS, _MAX_OPS)
        # (last and of weight 0 unless asked: every seed draws the program it drew before writes into views existed)
        builders, weights = zip(*_BUILDERS, (_op_write_into_view, self.view_writes))
        for _ in range(200):
            if len(self.steps) >= n_ops or self.ndim == 0:  # a 0-dim value (a loss) ends the chain
                break
            builder = self.rng.choices(builders, weights=weights)[0]
            for _ in range(3):  # a view of a strided value, a broadcast shape: often valid on a redraw
                candidate = builder(self)
                if candidate is None or len(self.steps) + len(candidate) > _MAX_OPS:
                    self.pending.clear()
                    break
                if self.try_steps([c if isinstance(c, Step) else _step(*c) for c in candidate]):
                    break
        if len(self.steps) < _MIN_OPS:
            return None
        cotangent_seed = self.rng.randrange(1 << 30)
        also_thunderfx = self.rng.random() < self.thunderfx_share
        program = Program(
            self.seed,
            self.world_size,
            self.mesh_shape,
            self.dtype,
            tuple(self.inputs),
            tuple(self.steps),
            cotangent_seed,
            thunderfx=also_thunderfx,
        )
        return program if _plain_runs_well(program) else None


_SAME: Any = object()  # a step's plain line is its DTensor line


def _step(kind: str, line: str, plain: Any = _SAME, **extra: Any) -> Step:
    """A candidate step (its shape is filled in when it is kept)."""
    return Step(kind, line, line if plain is _SAME else plain, **extra)


def _plain_run(program: Program, dtype: str, call: int = 0) -> tuple[torch.Tensor, list, list]:
    """The plain program, step by step (margins checked): output, numbers read, input gradients (ones cotangent)."""
    env = _inputs_env(program.inputs, dtype, call)
    inputs = [env[i.name] for i in program.inputs]
    env["y"] = inputs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _exec_plain(program.steps, env, final_ok=program.steps[-1].kind in _FINAL_KINDS)
        out = env["y"]
        if out.requires_grad:
            out.backward(torch.ones_like(out))
    return out.detach(), [env[n] for n in program.numbers], [x.grad for x in inputs]


def _plain_runs_well(program: Program) -> bool:
    """Plain torch runs the program forward and backward on both data sets, finite and well conditioned (else:
    draw again), and the margins of its comparisons hold.

    Well conditioned: float32 agrees with float64 ten times tighter than the judge's tolerance, so that a
    mismatch in the judge is not rounding amplified (a norm over one element, a difference of near-equal sums).
    """
    try:
        for call in CALLS:
            out, numbers, grads = _plain_run(program, program.dtype, call)
            if not all(g is None or bool(torch.isfinite(g).all()) for g in grads):
                return False
            if program.dtype == "float32":
                out64, numbers64, grads64 = _plain_run(program, "float64", call)
                tight = {"rtol": 1e-5, "atol": 1e-6}
                pairs = [(out, out64)] + [(g, g64) for g, g64 in zip(grads, grads64) if g is not None]
                if any(_close(a.double(), b.double(), tight) for a, b in pairs):
                    return False
                if not all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(numbers, numbers64)):
                    return False
        return True
    except Exception:
        return False


# Each builder returns the candidate's steps as (kind, DTensor line, plain line or _SAME or None) or as a Step
# (``_step``: with a margin, a number it defines, inputs it writes), or None when the op does not apply to the
# running value.
_Candidate = list[tuple[str, str, Any] | Step] | None


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
        dim_src = f"({dims[0]}, {dims[1]})"
    else:
        dims = [g.dim()]
        dim_src = str(dims[0])
    if g.ndim - len(dims) < 1:
        keepdim = True
    if op == "amax" and _some_rank_may_hold_none(g, dims):
        # a dim of fewer elements than ranks may leave a rank an empty shard of it, and eager DTensor's amax then
        # raises on that rank only ("Expected reduction dim ... to have non-zero size") while the others wait in a
        # collective: the run hangs (fuzz seed 15429; thunder runs it, test_fuzz_regressions)
        op = "sum"
    return [(op, f"y = y.{op}(dim={dim_src}, keepdim={keepdim})", _SAME)]


def _op_sdpa(g: _Generator) -> _Candidate:
    """Attention, with its keywords: ``is_causal``, ``attn_mask`` (a float mask input), ``scale``, ``dropout_p=0``."""
    if g.ndim != 4:
        return None
    b, h, length, e = g.shape
    s = length if g.rng.random() < 0.6 else g.size()
    keywords = []
    r = g.rng.random()
    if r < 0.35:
        keywords.append("is_causal=True")
    elif r < 0.55:
        mask_shape = g.rng.choice([(length, s), (1, 1, length, s), (b, 1, length, s)])
        keywords.append(f"attn_mask={g.new_input('m', mask_shape)}")
    if g.rng.random() < 0.3:
        keywords.append(f"scale={g.rng.choice([0.5, 0.25])}")
    if g.rng.random() < 0.15:
        keywords.append("dropout_p=0.0")
    if g.rng.random() < 0.35 and s == length:
        q, k, v = "y", "y", "y"
    else:
        q, k = "y", g.new_input("k", (b, h, s, e))
        v = g.new_input("v", (b, h, s, e if g.rng.random() < 0.7 else g.size()))
    return [("sdpa", f"y = F.scaled_dot_product_attention({', '.join([q, k, v, *keywords])})", _SAME)]


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


def _view_to_write(g: _Generator) -> tuple[str, tuple[int, ...]] | None:
    """A view of the running value that an in-place op can write through (slice, narrow, select, transpose, or
    a transpose of a slice), and its shape."""
    d = g.rng.randrange(g.ndim)
    shape, size, k = list(g.shape), g.shape[d], g.rng.random()
    if k < 0.3 and size >= 2:
        a = g.rng.randrange(size - 1)
        b = g.rng.randint(a + 1, size)
        shape[d] = b - a
        return f"y[{':, ' * d}{a}:{b}]", tuple(shape)
    if k < 0.5 and size >= 2:
        start = g.rng.randrange(size - 1)
        length = g.rng.randint(1, size - start)
        shape[d] = length
        return f"y.narrow({d}, {start}, {length})", tuple(shape)
    if k < 0.7 and g.ndim >= 2:
        i = g.rng.randrange(size)
        del shape[d]
        return (f"y.select({d}, {i})" if g.rng.random() < 0.5 else f"y[{':, ' * d}{i}]"), tuple(shape)
    if g.ndim < 2:
        return None
    view = "y"
    if size >= 2 and g.rng.random() < 0.5:
        start = g.rng.randrange(1, size)
        view, shape[d] = f"y[{':, ' * d}{start}:]", size - start
    shape[0], shape[-1] = shape[-1], shape[0]
    return f"{view}.transpose(0, -1)", tuple(shape)


def _op_write_into_view(g: _Generator) -> _Candidate:
    """An in-place op into a view of (a clone of) the running value: ``mul_`` / ``add_`` of a tensor, ``copy_``,
    ``index_put_``, ``masked_fill_`` or ``mul_`` of a number; then the running value, and sometimes the view, read
    again. Drawn only where asked (``view_writes``)."""
    drawn = _view_to_write(g)
    if drawn is None:
        return None
    view, shape = drawn
    operand_shape = shape[g.rng.randrange(len(shape)) :] if shape and g.rng.random() < 0.3 else shape
    op = g.rng.choice(["mul_", "add_", "copy_", "index_put_", "masked_fill_", "mul_number"])
    if op in ("mul_", "add_", "copy_"):
        write = f"v.{op}({g.new_input('o', operand_shape)})"
    elif op == "index_put_" and shape:
        # every index gets the same row: repeated indices write the same value, as in torch
        ids = g.new_int_input("i", (g.rng.randint(1, 3),), shape[0])
        write = f"v.index_put_(({ids},), {g.new_input('o', shape[1:])})"
    elif op == "masked_fill_":
        write = f"v.masked_fill_({g.new_input('m', shape, requires_grad=False)} > 0, 0.25)"
    else:
        write = "v.mul_(0.5)"
    read = "; y = y * v.mean()" if g.rng.random() < 0.3 else ""
    return [("clone", "y = y.clone()", _SAME), ("view-write", f"v = {view}; {write}{read}", _SAME)]


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
    prefix: list[tuple[str, str, Any] | Step] = []
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


# -- values read from the data ------------------------------------------------------------------------------


def _number_use(g: _Generator, s: str) -> Step:
    """A step that takes the Python number ``s`` (read with ``.item()``) as a scalar argument."""
    near = f"apart(y, {s}, y)"  # a kink or jump at s: no element near it
    kind, line, margin = g.rng.choice(
        [
            ("number-op", f"y = y * {s}", ""),
            ("number-op", f"y = y + {s}", ""),
            ("number-op", f"y = {s} - y", ""),
            ("number-op", f"y = y / (abs({s}) + 1.0)", ""),
            ("number-op", f"y = torch.add(y, y, alpha={s})", ""),
            ("number-op", f"y = y * torch.full_like(y, {s})", ""),
            ("number-op", f"y = torch.clamp(y, max={s})", near),
            ("number-op", f"y = torch.clamp(y, min={s})", near),
            ("where", f"y = torch.where(y > {s}, y, 0.5 * y)", near),
            ("where", f"y = y.masked_fill(y > {s}, {s})", near),
        ]
    )
    return _step(kind, line, margin=margin)


def _op_item(g: _Generator) -> _Candidate:
    """``s = <a reduction of y>.item()``: a run-time number (the global value, also of a Partial), often used next."""
    reduction = g.rng.choice(
        ["y.sum()", "y.mean()", "y.amax()", "y.amin()", "y.abs().mean()", "y.detach().sum()", "y[0].sum()"]
    )
    if reduction in ("y.amax()", "y.amin()") and _some_rank_may_hold_none(g):
        reduction = "y.sum()"
    s = g.new_number()
    steps: list[tuple[str, str, Any] | Step] = [_step("item", f"{s} = {reduction}.item()", defines=s)]
    if g.rng.random() < 0.6:
        steps.append(_number_use(g, s))
    return steps


def _some_rank_may_hold_none(g: _Generator, dims: Iterable[int] | None = None) -> bool:
    """Whether ``y`` has a dim (of ``dims``, default all) of fewer elements than ranks: sharded there, some rank holds
    an empty shard, and eager DTensor's ``amax`` / ``amin`` over it raises on that rank only while the others wait in
    a collective (fuzz seed 18146 at 4 ranks, the whole value: the run ended; 15429, over some dims: it hung)."""
    return any(g.shape[d] < math.prod(g.mesh_shape) for d in (range(g.ndim) if dims is None else dims))


def _op_use_number(g: _Generator) -> _Candidate:
    """A later op taking a number read earlier in the chain."""
    return [_number_use(g, g.rng.choice(g.numbers))] if g.numbers else None


def _op_where(g: _Generator) -> _Candidate:
    """A comparison into ``torch.where`` / ``masked_fill`` / a mask product: the data chooses, in a tensor."""
    t = g.rng.choice(["0.0", "0.25", "-0.3"])
    r = g.rng.random()
    if r < 0.3:
        o = g.new_input("o", _broadcast_shape(g))
        line = g.rng.choice([f"y = torch.where(y > {o}, y, {o})", f"y = torch.where({o} < y, {o}, 2.0 * y)"])
        return [_step("where", line, margin=f"apart(y, {o}, y)")]
    line = g.rng.choice(
        [
            f"y = torch.where(y > {t}, y, 0.1 * y)",
            f"y = torch.where(y < {t}, -y, y)",
            f"y = torch.where(y > {t}, y, 0.0)",
            f"y = y.masked_fill(y < {t}, 0.0)",
            f"y = y * (y > {t})",
            f"y = y * (y > {t}).to(y.dtype)",
        ]
    )
    return [_step("where", line, margin=f"apart(y, {t}, y)")]


#: the two branches of a Python ``if`` on the data
_BRANCHES = ["y = y * 2.0", "y = y - 1.0", "y = -y", "y = F.relu(y)", "y = torch.tanh(y)", "y = y.exp()"]


def _op_if(g: _Generator) -> _Candidate:
    """Python control flow on a value of the data: refused by thunder.jit (as plain thunder refuses it), run by
    thunderfx (dynamo splits the graph at the condition)."""
    conds = [
        ("y.sum() > 0", "apart(y.sum(), 0.0, y.abs().sum())"),
        ("y.mean() > 0.1", "apart(y.mean(), 0.1, y.abs().mean())"),
        ("y.amax() > 0.5", "apart(y.amax(), 0.5, y.abs().amax())"),
        ("(y.sum() < 0).item()", "apart(y.sum(), 0.0, y.abs().sum())"),
    ]
    if _some_rank_may_hold_none(g):
        conds[2] = ("y.mean() > 0.5", "apart(y.mean(), 0.5, y.abs().mean())")
    conds += [(f"{s} > 0", f"apart({s}, 0.0, {s})") for s in g.numbers]
    cond, margin = g.rng.choice(conds)
    a, b = g.rng.sample(_BRANCHES, 2)
    return [_step("if", f"if {cond}:\n    {a}\nelse:\n    {b}", margin=margin)]


# -- keyword arguments of the dedicated rules -------------------------------------------------------------------


def _op_embedding(g: _Generator) -> _Candidate:
    """A lookup in a (maybe vocab-sharded) table with ids of the running value's leading shape, with the keywords
    ``padding_idx``, ``max_norm`` (a write into the table: compared after the call), ``scale_grad_by_freq``."""
    if not 2 <= g.ndim <= 4 or math.prod(g.shape[:-1]) > 64:
        return None
    vocab = g.rng.choice([4, 5, 6, 8, 12, 16])
    ids = g.new_int_input("i", g.shape[:-1], vocab)
    placements = [
        "S0" if r < 0.45 else ("S1" if r < 0.6 else "R") for r in (g.rng.random() for _ in g.mesh_shape)
    ]  # vocab-parallel (Shard(0)) most often
    if placements.count("S0") > 1:
        # vocab-sharded on one mesh dim only: over several, eager DTensor's masked lookup shares one mask buffer
        # between them and may raise ("MaskBuffer has been materialized with conflicting data") on some ranks only
        # while the others wait in a collective, and the run hangs (fuzz seed 15502). thunder's lookup over several
        # mesh dims is tested in test_fuzz_regressions (test_a_lookup_in_a_table_sharded_over_its_vocabulary_on_*).
        first = placements.index("S0")
        placements = [p if p != "S0" or i == first else "R" for i, p in enumerate(placements)]
    w = g.new_input("w", (vocab, g.shape[-1]), placements=placements)
    writes: tuple
    keywords, writes = [], ()
    if g.rng.random() < 0.45:
        keywords.append(f"padding_idx={g.rng.randrange(-vocab, vocab)}")
    if g.rng.random() < 0.3:
        keywords.append("scale_grad_by_freq=True")
    if g.rng.random() < 0.12:
        keywords.append(f"max_norm={g.rng.choice([1.0, 1.5])}" + (", norm_type=1.0" if g.rng.random() < 0.3 else ""))
        writes = (w,)
    call = f"F.embedding({', '.join([ids, w, *keywords])})"
    r = g.rng.random()
    line = f"y = y + {call}" if r < 0.55 else (f"y = {call} * y" if r < 0.85 else f"y = {call}")
    return [_step("embedding", line, writes=writes, tables=(w,))]


def _op_loss(g: _Generator) -> _Candidate:
    """``cross_entropy`` / ``nll_loss`` of the running value (classes on dim 1) with ``weight=``, ``ignore_index``,
    ``label_smoothing`` and ``reduction``; a reduced (0-dim) loss ends the program."""
    if not 2 <= g.ndim <= 3 or g.shape[1] < 2:
        return None
    classes = g.shape[1]
    target = g.new_int_input("t", (g.shape[0], *g.shape[2:]), classes)
    kind = g.rng.choice(["cross_entropy", "nll_loss"])
    keywords = []
    if g.rng.random() < 0.35:
        keywords.append(f"weight={g.new_input('cw', (classes,), 0.5, requires_grad=False)}")
    if g.rng.random() < 0.4:
        keywords.append(f"ignore_index={g.rng.randrange(classes)}")
    if kind == "cross_entropy" and g.rng.random() < 0.4:
        keywords.append(f"label_smoothing={g.rng.choice([0.1, 0.25])}")
    final = len(g.steps) + 1 >= _MIN_OPS
    reduction = g.rng.choice(["mean", "sum", "none"]) if final else "none"
    if reduction != "mean" or g.rng.random() < 0.5:
        keywords.append(f'reduction="{reduction}"')
    logits = "y" if kind == "cross_entropy" or g.rng.random() < 0.4 else "F.log_softmax(y, dim=1)"
    return [_step(kind, f"y = F.{kind}({', '.join([logits, target, *keywords])})")]


def _the_mean_loss_rewrite(program: Program, got: tuple, eager: tuple) -> bool:
    """Whether ``got`` is eager's placements but for the documented rewrite of a mean class-index loss
    (``ops/losses.py``: ``Partial(sum)`` where eager's ``Partial(avg)`` averages per-rank means)."""
    from thunder_dtensor.ops.losses import exact_mean_placements
    from thunder_dtensor.testing import same_placements

    last = program.steps[-1]
    if last.kind not in _FINAL_KINDS or 'reduction="sum"' in last.line or 'reduction="none"' in last.line:
        return False
    exact = exact_mean_placements(eager)
    return exact is not None and same_placements(got, exact)


def _op_dropout(g: _Generator) -> _Candidate:
    line = g.rng.choice(
        [
            "y = F.dropout(y, p=0.3, training=False)",
            "y = F.dropout(y, 0.5, False)",
            "y = torch.dropout(y, 0.2, False)",
            "y = F.dropout(y, p=0.0)",
        ]
    )
    return [_step("dropout", line)]


def _op_dtype_keyword(g: _Generator) -> _Candidate:
    """``dtype=`` of softmax and reductions: computed in float64 (a float32 program's value becomes float64)."""
    d = g.dim()
    kind, line = g.rng.choice(
        [
            ("softmax-dtype", f"y = F.softmax(y, dim={d}, dtype=torch.float64)"),
            ("softmax-dtype", f"y = F.log_softmax(y, {d}, dtype=torch.float64)"),
            ("softmax-dtype", f"y = y.softmax({d}, dtype=torch.float64)"),
            ("sum-dtype", f"y = y.sum(dim={d}, dtype=torch.float64)"),
            ("sum-dtype", f"y = torch.sum(y, {d}, keepdim=True, dtype=torch.float64)"),
            ("sum-dtype", f"y = y.mean(dim={d}, dtype=torch.float64)"),
        ]
    )
    return [_step(kind, line)]


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
    (_op_item, 3),
    (_op_use_number, 2),
    (_op_where, 3),
    (_op_if, 2),
    (_op_embedding, 3),
    (_op_loss, 2.5),
    (_op_dropout, 1),
    (_op_dtype_keyword, 1.5),
]


def generate_program(
    seed: int,
    world_size: int,
    mesh_shape: Sequence[int] | None = None,
    *,
    thunderfx_share: float = 0.0,
    view_writes: float = 0.0,
) -> Program:
    """The program of ``seed``: a function of the seed, world size, mesh shape and ``view_writes`` only (the same on
    every rank).

    ``thunderfx_share``: the share of programs that read no values into Python that run under thunderfx too (those
    that read values always do); it changes no program's ops. thunderfx compiles cost about two programs' time.
    ``view_writes``: the weight of in-place writes into views among the op builders (others weigh 1 to 6); 0,
    the default, draws none and leaves every seed's program as it was.
    """
    mesh_shape = tuple(mesh_shape or (world_size,))
    if math.prod(mesh_shape) != world_size:
        raise ValueError(f"mesh {mesh_shape} does not have {world_size} ranks")
    rng = random.Random(f"thunder_dtensor.fuzz/{seed}/{world_size}/{mesh_shape}")
    for _ in range(50):
        program = _Generator(rng, seed, world_size, mesh_shape, thunderfx_share, view_writes).build()
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
#: appended to a value mismatch where thunder gives what thunder alone (thunder.jit, or thunderfx) gives for the
#: plain program on the full tensors: the bug is thunder's
_AS_PLAIN_THUNDER = "; thunder gives plain thunder's values for the plain program"
#: the phase prefix of what the second call of a compiled function (the second data set) found
_SECOND = "2nd data: "


@dataclass
class Failure:
    """One difference of one thunder run (``mode``) from plain torch or eager DTensor."""

    mode: str
    kind: str
    #: forward / output / backward / grads (where an error was raised), or output / grad <name> / number <name> /
    #: input <name> (a mismatch); prefixed with "2nd data: " where the second call found it
    phase: str
    detail: str

    @property
    def signature(self) -> str:
        """The failure without its mode, numbers blanked: programs that fail the same way share it."""
        detail = re.sub(r"Tensor-likes are not close!.*allowed\)", "values differ", self.detail)
        detail = re.sub(r"0x[0-9a-f]+", "0x_", detail)
        detail = re.sub(r"\d+", "N", detail)[:160]
        phase = re.sub(r"\b(grad|number|input) \S+", r"\1", self.phase)
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
    #: per thunder mode: matched / raised-clearly / refused-like-plain-thunder (a read of data thunder.jit refuses
    #: where plain thunder refuses the plain program too) / rejected-like-eager (thunderfx) / failed
    mode_outcomes: dict[str, str]
    failures: list[Failure]
    seconds: float
    #: for a failing thunder.jit mode, how thunder.jit alone (plain full tensors, no DTensor) gets it wrong ("": right)
    plain_thunder: str = ""
    #: eager derived or misplaced placements, so only values were compared (see ``_EagerDerivations``)
    values_only: bool = False
    #: for a failing thunderfx run, how thunderfx alone gets the plain program wrong ("": right)
    plain_thunderfx: str = ""
    #: for a thunderfx run that raises, how dynamo alone (``torch.compile`` with the eager backend) fails the DTensor
    #: program ("": it runs it)
    dynamo_alone: str = ""
    #: for a thunderfx output placed otherwise than eager's: the output placements ``torch.compile`` (dynamo and
    #: AOTAutograd, the ``aot_eager`` backend: no thunder) gives the DTensor program ("": not asked, or none)
    compiled_placements: str = ""
    #: per data set, what eager DTensor computed otherwise than plain torch ("output", "grad <name>", ...)
    eager_wrong: tuple[frozenset[str], ...] = ()

    def _plain(self, failure: Failure) -> str:
        return self.plain_thunderfx if failure.mode == "thunderfx" else self.plain_thunder

    def _upstream(self, f: Failure) -> str:
        if f.mode == "thunderfx" and f.kind == "thunder-raises-eager-runs" and self.dynamo_alone:
            return "dynamo alone (torch.compile, eager backend) fails the DTensor program too (a torch bug)"
        if f.mode == "thunderfx" and f.kind == "placement-mismatch" and self._placed_as_torch_compile(f):
            return "torch.compile (aot_eager backend) places the output as thunderfx does, unlike eager (a torch bug)"
        if f.kind == "thunder-raises-eager-runs" and f.detail.startswith("DTensorOpError"):
            if self._plain(f):
                return "thunder fails the plain program too; thunder_dtensor raises a DTensorOpError"
            if _EAGER_WRONG in f.detail:
                return "eager DTensor differs from plain torch (a torch bug); thunder_dtensor raises a DTensorOpError"
        if f.kind in ("value-mismatch", "grad-mismatch"):
            if f.detail.endswith(_AS_EAGER):
                return "eager DTensor differs from plain torch, and thunder gives eager's values (a torch bug)"
            if f.detail.endswith(_AS_PLAIN_THUNDER):
                return "thunder alone gives the same wrong values for the plain program (a thunder bug)"
        return ""

    def _placed_as_torch_compile(self, f: Failure) -> bool:
        return bool(self.compiled_placements) and f.detail.startswith(f"output placements {self.compiled_placements} ")

    @property
    def upstream(self) -> str:
        """Why this failure is not this package's bug ("" if it is), with the evidence the fuzzer gathered, for
        every failure of the program:

        * thunder alone fails the plain program too, and thunder_dtensor refuses it with a
          :class:`DTensorOpError` (a clear error where thunder itself would be wrong);
        * eager DTensor differs from plain torch too, and thunder gives eager's values (a torch DTensor bug that
          thunder reproduces faithfully) or refuses the program with a :class:`DTensorOpError`;
        * thunder alone gives the same wrong values for the plain program (``if`` on an ``.item()`` number is
          decided at trace time by plain thunder too);
        * thunderfx raises where dynamo alone (``torch.compile(fn, backend="eager")``) fails the DTensor program too;
        * thunderfx places the output as ``torch.compile(fn, backend="aot_eager")`` does, where eager places it
          otherwise: dynamo recorded the graph after a node for its own fake run's placements (fuzz seed 8443:
          ``F.dropout(y, p=0.0)`` of a ``Partial`` value, ``Replicate`` under fake tensors), and thunderfx runs such
          a node as torch.compile does (``thunderfx.dtensor_node_support``).
        """
        reasons = [self._upstream(f) for f in self.failures]
        return "; ".join(dict.fromkeys(reasons)) if reasons and all(reasons) else ""

    def signature(self, failure: Failure) -> str:
        """The failure's signature, marked where thunder alone fails the plain program too (the bug is upstream)."""
        signature = failure.signature
        if failure.mode == "thunderfx" and failure.kind == "thunder-raises-eager-runs" and self.dynamo_alone:
            signature += " | dynamo alone fails too"
        if not self._plain(failure):
            return signature
        return signature + f" | plain {'thunderfx' if failure.mode == 'thunderfx' else 'thunder.jit'} fails too"

    def signatures(self) -> dict[str, str]:
        """Failure signature -> the modes that show it (one mode, or "both" / "all" for several)."""
        modes: dict[str, set] = {}
        for f in self.failures:
            modes.setdefault(self.signature(f), set()).add(f.mode)
        names = {1: None, 2: "both"}
        return {sig: names.get(len(m), "all") or next(iter(m)) for sig, m in modes.items()}

    def key(self) -> tuple:
        """What every rank must agree on."""
        failures = tuple(sorted((f.mode, f.kind, f.phase) for f in self.failures))
        plain = (bool(self.plain_thunder), bool(self.plain_thunderfx), bool(self.dynamo_alone))
        return (self.program.seed, self.outcome, failures, plain)

    def headline(self) -> str:
        kinds = sorted({f"{f.mode}:{f.kind}" for f in self.failures})
        upstream = f" | plain thunder.jit: {self.plain_thunder}" if self.plain_thunder else ""
        upstream += f" | plain thunderfx: {self.plain_thunderfx}" if self.plain_thunderfx else ""
        upstream += f" | dynamo alone: {self.dynamo_alone}" if self.dynamo_alone else ""
        if self.compiled_placements:
            upstream += f" | torch.compile (aot_eager) places the output {self.compiled_placements}"
        return f"FAIL ({self.seconds:.1f}s) {self.program.describe()} | {', '.join(kinds)}{upstream}"

    def reproducer(self, signature: str | None = None) -> str:
        """The reproducer for the mode that fails first (with ``signature``, if given); lists every failure."""
        chosen = [f for f in self.failures if signature is None or self.signature(f) == signature] or self.failures
        mode = chosen[0].mode if chosen and chosen[0].mode in MODES else "lowering"
        found = [str(f) for f in self.failures]
        if self.plain_thunder:
            found.append(f"plain thunder.jit on the full tensors: {self.plain_thunder}")
        if self.plain_thunderfx:
            found.append(f"plain thunderfx on the full tensors: {self.plain_thunderfx}")
        if self.dynamo_alone:
            found.append(f"dynamo alone (torch.compile(fn, backend='eager')) on the DTensors: {self.dynamo_alone}")
        if self.compiled_placements:
            found.append(f"torch.compile(fn, backend='aot_eager') places the output {self.compiled_placements}")
        return self.program.reproducer(mode, "\n".join(found))


@dataclass
class _Run:
    """What one way of running a program (eager DTensor or a compiled function) gave, for one data set."""

    error: BaseException | None = None
    phase: str = ""
    not_dtensor: str = ""
    out_full: torch.Tensor | None = None
    placements: tuple | None = None
    #: the output DTensor's global shape (which can disagree with its full tensor's: a torch bug)
    shape: tuple | None = None
    out_requires_grad: bool = False
    #: the Python numbers the program read (returned beside its output)
    numbers: list = field(default_factory=list)
    #: the full values, after the forward, of the inputs the program writes into
    inputs_after: list = field(default_factory=list)
    backward_ran: bool = False
    grads: list = field(default_factory=list)
    grad_placements: list = field(default_factory=list)
    #: eager derived placements on its own (attention on mixed layouts) or misplaced a reshape (``_EagerDerivations``)
    derived_placements: bool = False


@dataclass
class _Reference:
    """Plain torch on the full tensors of one data set: what every run's values must be."""

    out: torch.Tensor
    numbers: list
    grads: list
    #: None where the output does not require grad (then there is no backward)
    cotangent: torch.Tensor | None
    #: the values, after the call, of the inputs the program writes into
    inputs_after: list


class _EagerDerivations(torch.overrides.TorchFunctionMode):
    """Notes where eager DTensor's placements are not a reference for thunder's: where eager derives them on its own
    for attention, or where it misplaces a reshape.

    Attention: on q, k, v that are not equally batch/head-sharded, or with a mask neither replicated over them nor
    sharded as q is, eager's output placements come from a strategy it derives per call (on CPU from the fused
    kernel's decomposition, in a way that depends on the dispatch context; on CUDA from other kernels' rules), while
    thunder_dtensor attends on replicated inputs: the same values, other placements by design
    (docs/architecture.md, "Attention"). Such an attention runs in eager on replicated inputs (below). Where they
    are equally head-sharded, the strategy eager derives on CPU replicates them, where thunder_dtensor (and eager's
    CUDA rules) keep the heads sharded.

    Reshape: a reshape whose output's ``full_tensor()`` is not its input's reshaped (a torch bug thunder_dtensor runs
    replicated, ``primitive._reshape_misplaced``): eager went on from other values than the program's, even where a
    later op hides it (a mean over a row it permuted, fuzz seed 17372), so its later placements are another program's.

    The fuzzer then checks values only.
    """

    def __init__(self) -> None:
        from thunder_dtensor.ops.attention import attends_on_local_shards
        from thunder_dtensor.primitive import RESHAPES

        super().__init__()
        self.derived = False
        # (imported here, once per run, not per torch call: this module imports without the package)
        self._attends_on_local_shards, self._reshapes = attends_on_local_shards, RESHAPES

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        local = False  # an attention on equally batch/head-sharded q, k, v
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            q, k, v = args[:3]
            local = self._attends_on_local_shards(q, k, v, mask)
            if not local:
                self.derived = True
                # eager's placements are no reference here, and DTensor's CPU strategy search for such a layout ran
                # for minutes (fuzz seeds 17222, 18367, 18489): eager attends on replicated inputs, the same values
                args, kwargs = _replicated((args, kwargs))
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            _stop_together(func, args, kwargs, error)
            raise
        _stop_together(func, args, kwargs, None)
        if local and getattr(out, "placements", None) != args[0].placements:
            # head-sharded q, k, v on a CPU mesh: torch 2.13's strategy derived from the CPU kernel's decomposition
            # replicates them (fuzz seed 19710), where its CUDA kernels' rules and thunder_dtensor keep the heads
            self.derived = True
        if func in self._reshapes and not self.derived and _misplaces(args[0] if args else None, out):
            self.derived = True
        return out


def _replicated(tree: Any) -> Any:
    """``tree`` with each DTensor redistributed to Replicate on its mesh."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils._pytree import tree_map_only

    return tree_map_only(DTensor, lambda x: x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim), tree)


def _misplaces(x: Any, out: Any) -> bool:
    """Whether an eager reshape's output DTensor holds other values than its input's, reshaped (every rank gets the
    same answer: both sides are gathered)."""
    from thunder_dtensor.primitive import reshape_can_misplace

    from torch.distributed.tensor import DTensor

    if not (isinstance(x, DTensor) and isinstance(out, DTensor)) or x.numel() != out.numel():
        return False
    if not (reshape_can_misplace(x._spec) or reshape_can_misplace(out._spec)):
        return False  # (plain shards keep their meaning: no collective for them)
    with torch.no_grad():
        want, got = x.full_tensor().reshape(out.shape), out.full_tensor()
    return not torch.equal(want.isnan(), got.isnan()) or not torch.equal(want.nan_to_num(), got.nan_to_num())


class RanksDisagree(RuntimeError):
    """The ranks' results have different placements: gathering them would hang or mix up collectives."""


class EagerRaisedOnSomeRanks(RuntimeError):
    """An eager DTensor call raised on some ranks only (a shard that the all-to-all fallback left unviewable on one
    rank, fuzz seeds 18153 and 20613): every rank stops at that call, so none waits in a later collective alone."""


class _ForwardEnded(Exception):
    """Another rank's forward ended (it raised outside a torch call, or its program took fewer calls) while this
    rank agreed on a call: that round was the forward's agreement (``gathered``), for every rank."""

    def __init__(self, gathered: list) -> None:
        super().__init__("another rank's forward ended")
        self.gathered = gathered


def _stop_together(func: Callable, args: tuple, kwargs: dict, error: BaseException | None) -> None:
    """After an eager call on DTensors, the ranks' agreement on whether it raised: where some ranks raised and others
    did not, every rank raises :class:`EagerRaisedOnSomeRanks` naming each rank's outcome.

    (Before it, the ranks that went on met the first collective of the next call alone, and gloo aborted the run.)
    A rank whose forward ended meets this round in :func:`_check_ranks_agree`; both read the same gathered list.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    if not any(isinstance(leaf, DTensor) for leaf in tree_leaves((args, kwargs))):
        return
    gathered, _ = _agree(("call", None if error is None else _describe_error(error)))
    if any(kind != "call" for kind, _ in gathered):
        raise _ForwardEnded(gathered)
    outcomes = [outcome for _, outcome in gathered]
    if all(o is None for o in outcomes) or all(o is not None for o in outcomes):
        return
    name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
    each = "; ".join(f"rank {r}: {'ran' if o is None else 'raised ' + o}" for r, o in enumerate(outcomes))
    raise EagerRaisedOnSomeRanks(f"eager DTensor's {name} raised on some ranks only: {each}")


def _check_ranks_agree(what: str, state: Any, error: BaseException | None = None) -> None:
    """All-gather each rank's ``state`` (its repr, or its error) and raise on every rank if any rank raised or
    the states differ.

    Every rank decides from the same gathered list, so all stop or none does: a rank that raised while another
    went on would leave that one waiting in the next collective (the run hangs, then times out). Where every
    rank raised, each re-raises its own ``error``; otherwise all raise :class:`RanksDisagree`, which names each
    rank's state (each rank decides DTensor's strategies on its own, and a shard's shape can differ by rank).
    An eager run's ranks that were still agreeing on a call (:func:`_stop_together`) count as neither.
    """
    if isinstance(error, _ForwardEnded):
        gathered = error.gathered
    else:
        gathered, _ = _agree(("raised", _describe_error(error)) if error is not None else ("ran", repr(state)))
    if error is not None and all(kind == "raised" for kind, _ in gathered):
        raise error
    if len(set(gathered)) > 1:
        states = "; ".join(f"rank {r}: {_rank_state(kind, k)}" for r, (kind, k) in enumerate(gathered))
        raise RanksDisagree(f"{what} differs by rank: {states}")


def _rank_state(kind: str, text: str | None) -> str:
    if kind == "ran":
        return str(text)
    if kind == "raised":
        return f"raised {text}"
    return "went on into an eager call" + (f" that raised {text}" if text else "")


def _describe_error(error: BaseException) -> str:
    inner = getattr(error, "inner_exception", None)  # dynamo's BackendCompilerFailed: the backend's own error
    if isinstance(inner, BaseException):
        return f"{type(error).__name__} from {_describe_error(inner)}"
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:240]}"


def _execute(
    fn: Callable,
    make_inputs: Callable[[], list],
    cotangent: torch.Tensor | None,
    written: Sequence[int] = (),
    *,
    eager: bool = True,
) -> _Run:
    """Run ``fn`` on fresh DTensor inputs; forward, full output, backward (with ``cotangent``), full gradients.

    ``fn`` returns its output DTensor, or ``(output, numbers)``; ``written``: the inputs whose values after the
    forward are recorded too. ``eager``: ``fn`` is the eager program (its attention layouts are noted; a compiled
    function runs without the torch function mode that notes them, which dynamo would trace).
    """
    from torch.distributed.tensor import DTensor

    run = _Run()
    inputs = make_inputs()
    layouts = _EagerDerivations()
    out: Any = None
    raised: BaseException | None = None
    try:
        with layouts if eager else contextlib.nullcontext():
            out = fn(*inputs)
    except Exception as error:
        raised = error
    finally:
        run.derived_placements = layouts.derived
    if isinstance(out, tuple):
        out, numbers = out
        run.numbers = list(numbers)
    try:
        _check_ranks_agree("forward", getattr(out, "placements", type(out).__name__), raised)
    except Exception as error:
        run.error, run.phase = error, "forward"
        return run
    if not isinstance(out, DTensor):
        run.not_dtensor = type(out).__name__
        return run
    try:
        run.placements = tuple(out.placements)
        run.shape = tuple(out.shape)
        run.out_requires_grad = out.requires_grad
        run.out_full = out.full_tensor().detach()
        run.inputs_after = [inputs[k].full_tensor().detach() for k in written]
    except Exception as error:
        run.error, run.phase = error, "output"
        return run
    if cotangent is None or not out.requires_grad:
        return run
    raised = None
    try:
        out.backward(run_globals()["cotangent_for"](out, cotangent))
    except Exception as error:
        raised = error
    try:
        _check_ranks_agree("backward", "ran", raised)
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


def _number_differs(have: Any, want: Any, tol: dict) -> str:
    """Empty if ``have`` is the Python number ``want`` (same type, equal within ``tol``), else how it differs."""
    if type(have) is not type(want):
        return f"a {type(have).__name__} ({have!r}) where plain torch gives a {type(want).__name__} ({want!r})"
    if math.isclose(have, want, rel_tol=tol["rtol"], abs_tol=tol["atol"]):
        return ""
    return f"{have!r} vs plain torch {want!r}"


def _reference(program: Program, fn_plain: Callable, call: int) -> _Reference:
    from thunder_dtensor.testing import make_full

    inputs = [_full(i, program.dtype, call) for i in program.inputs]
    result = fn_plain(*inputs)
    out, numbers = result if isinstance(result, tuple) else (result, ())
    cotangent = None
    if out.requires_grad and out.is_floating_point():
        seed = program.cotangent_seed if call == 0 else _second_seed(program.cotangent_seed)
        cotangent = make_full(out.shape, seed=seed, dtype=out.dtype)
        out.backward(cotangent)
    after = [inputs[k].detach() for k in program.written]
    return _Reference(out.detach(), list(numbers), [x.grad for x in inputs], cotangent, after)


def _eager_mismatches(program: Program, eager: _Run, ref: _Reference) -> set[str]:
    """Where eager DTensor's own values differ from plain torch ("output", "grad <name>", "number <name>",
    "input <name>"): for triage only."""
    tol = _TOLERANCES[program.dtype]
    wrong = set()
    wrong_values = eager.out_full is not None and _close(eager.out_full, ref.out, tol)
    if wrong_values or (eager.shape is not None and eager.shape != tuple(ref.out.shape)):
        wrong.add("output")
    for name, want, have in zip(program.numbers, ref.numbers, eager.numbers):
        if _number_differs(have, want, tol):  # eager's item() of a Partial value: this rank's unreduced part
            wrong.add(f"number {name}")
    for k, want, have in zip(program.written, ref.inputs_after, eager.inputs_after):
        if _close(have, want, tol):
            wrong.add(f"input {program.inputs[k].name}")
    for spec, want, have in zip(program.inputs, ref.grads, eager.grads if eager.backward_ran else ()):
        if want is not None and have is not None and _close(have, want, tol):
            wrong.add(f"grad {spec.name}")
    return wrong


def _judge(
    mode: str,
    program: Program,
    eager: _Run,
    eager_wrong: set[str],
    got: _Run,
    ref: _Reference,
    call: int,
    eager_wrong_on_any_call: frozenset[str] = frozenset(),
) -> tuple[str, list[Failure]]:
    """A thunder run against plain torch (values) and eager DTensor (placements; whether it may raise).

    Outcome "refused": thunder.jit raised a ``DataDependentValueError`` where eager ran (``run_program`` asks
    plain thunder whether it refuses the plain program too). ``eager_wrong_on_any_call``: what eager computed
    wrong on either data set. Its placements there are no reference on the other either: they come from the same
    rules, which may give plain torch's values on some data only (fuzz seed 17556: a counted table's gradient,
    summed over ranks with each rank's counts, is right where no id repeats across the shards).
    """
    from thunder_dtensor.errors import DataDependentValueError, DTensorOpError
    from thunder_dtensor.testing import same_placements, table_gradient_placements_accepted

    untrusted = eager_wrong | eager_wrong_on_any_call  # (this data's, and the other's)

    at = "" if call == 0 else _SECOND
    eager_ran = eager.error is None and not eager.not_dtensor
    if got.not_dtensor:
        return "failed", [Failure(mode, "placement-mismatch", at + "output", f"the output is a {got.not_dtensor}")]
    tol = _TOLERANCES[program.dtype]
    failures = []
    also = _EAGER_WRONG

    def mismatch(kind: str, where: str, detail: str, as_eager: bool) -> None:
        if where in eager_wrong:
            detail += also + (_AS_EAGER if as_eager else "")
        failures.append(Failure(mode, kind, at + where, detail))

    if got.out_full is not None:  # the forward ran (a later error is judged below, after the forward's results)
        differs = _close(got.out_full, ref.out, tol)
        if differs:
            mismatch(
                "value-mismatch",
                "output",
                differs,
                eager.out_full is not None and not _close(got.out_full, eager.out_full, tol),
            )
        if got.shape is not None and got.shape != tuple(ref.out.shape):
            mismatch(
                "value-mismatch",
                "output",
                f"output global shape {list(got.shape)} vs torch {list(ref.out.shape)}",
                False,
            )
        for k, (name, want) in enumerate(zip(program.numbers, ref.numbers)):
            have = got.numbers[k] if k < len(got.numbers) else None
            differs = _number_differs(have, want, tol)
            if differs:
                theirs = eager.numbers[k] if k < len(eager.numbers) else None
                mismatch("value-mismatch", f"number {name}", differs, not _number_differs(have, theirs, tol))
        for k, want, have in zip(program.written, ref.inputs_after, got.inputs_after):
            differs = _close(have, want, tol)
            if differs:
                name = program.inputs[k].name
                theirs = eager.inputs_after[program.written.index(k)] if eager.inputs_after else None
                mismatch(
                    "value-mismatch",
                    f"input {name}",
                    f"after the call: {differs}",
                    theirs is not None and not _close(have, theirs, tol),
                )
        # eager's placements are the reference only where its values are right
        eager_reference = eager.placements is not None and "output" not in untrusted and not eager.derived_placements
        # (not None: the forward ran, and eager_reference)
        if (
            eager_reference
            and not same_placements(cast(tuple, got.placements), cast(tuple, eager.placements))
            and not _the_mean_loss_rewrite(program, cast(tuple, got.placements), cast(tuple, eager.placements))
        ):
            detail = f"output placements {_fmt(got.placements)} vs eager {_fmt(eager.placements)}"
            failures.append(Failure(mode, "placement-mismatch", at + "output", detail))
    if isinstance(got.error, RanksDisagree):
        return "failed", [*failures, Failure(mode, "rank-divergence", at + got.phase, _describe_error(got.error))]
    if got.error is not None:
        detail = _describe_error(got.error)
        if eager_ran:
            if isinstance(got.error, DataDependentValueError) and got.phase == "forward" and MODES[mode] is not None:
                return "refused", [Failure(mode, "thunder-raises-eager-runs", at + got.phase, detail)]
            failures.append(
                Failure(mode, "thunder-raises-eager-runs", at + got.phase, detail + (also if eager_wrong else ""))
            )
        elif isinstance(got.error, DTensorOpError):
            return ("failed", failures) if failures else ("raised-clearly", [])
        elif MODES[mode] is None:  # thunderfx: dynamo's own fake run of the program fails as eager does
            return ("failed", failures) if failures else ("rejected-like-eager", [])
        else:
            # eager's own error passed through: no placements, no hint, but not from deep inside either
            same = eager.error is not None and _describe_error(eager.error) == detail
            failures.append(Failure(mode, "eager-error-reraised" if same else "unclear-error", at + got.phase, detail))
        return "failed", failures
    if ref.cotangent is not None:
        if not got.out_requires_grad:
            failures.append(Failure(mode, "grad-mismatch", at + "output", "the output does not require grad"))
        # eager's gradient placements are the reference only where eager ran the program itself: where its forward
        # values are wrong (a write into a view it took of gathered data is lost), it differentiated another program
        forward_wrong = any(not w.startswith("grad ") for w in untrusted)
        for i, spec in enumerate(program.inputs if got.backward_ran else ()):
            want, have = ref.grads[i], got.grads[i]
            where = f"grad {spec.name}"
            if want is None or have is None:
                if (want is None) != (have is None):
                    detail = "thunder gives no gradient" if have is None else "thunder gives a gradient, torch none"
                    failures.append(Failure(mode, "grad-mismatch", at + where, detail))
                continue
            differs = _close(have, want, tol)
            if differs:
                theirs = eager.grads[i] if eager.backward_ran else None
                mismatch("grad-mismatch", where, differs, theirs is not None and not _close(have, theirs, tol))
            eager_reference = not forward_wrong and where not in untrusted and not eager.derived_placements
            if eager.backward_ran and eager.grad_placements[i] is not None and eager_reference:
                mine, theirs = got.grad_placements[i], eager.grad_placements[i]
                # a vocab-parallel lookup's table gradient keeps the table's placements (the package's decision)
                own = tuple(_placement_object(p) for p in spec.placements) if i in program.tables else None
                accepted = mine is not None and (
                    same_placements(mine, theirs)
                    or (own is not None and table_gradient_placements_accepted(mine, theirs, own))
                )
                if not accepted:
                    detail = f"gradient placements {_fmt(mine)} vs eager {_fmt(theirs)}"
                    failures.append(Failure(mode, "grad-placement-mismatch", at + where, detail))
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


def _compile(mode: str, fn: Callable) -> Callable:
    """``fn`` compiled the way ``mode`` runs it: thunder.jit with the lowering on or off, or thunderfx."""
    if MODES[mode] is None:
        from thunder.dynamo import thunderfx

        return thunderfx(fn)
    import thunder

    return thunder.jit(fn, **_jit_options(mode))


def _jit_options(mode: str) -> dict[str, Any]:
    """``thunder.jit``'s options in a mode of ``thunder.jit`` (the lowering on or off, :data:`LOWERING_OPTIONS`)."""
    return {"dtensor_lowering": MODES[mode], **(LOWERING_OPTIONS if MODES[mode] else {})}


@dataclass
class _PlainRun:
    """thunder alone (thunder.jit or thunderfx) on the plain program and the full tensors of the first data set."""

    #: how it gets the program wrong ("" if it is right)
    problem: str = ""
    #: it refused the program at trace time (plain thunder's ``NotImplementedError`` for a read of data)
    refused: bool = False
    #: what it raised ("" if it ran), with the plain function's name and addresses made like the DTensor program's
    error: str = ""
    out: torch.Tensor | None = None
    numbers: list = field(default_factory=list)
    grads: list = field(default_factory=list)


def _plain_check(kind: str, fn_plain: Callable, program: Program, ref: _Reference) -> _PlainRun:
    """How thunder alone (``kind``: "jit" or "thunderfx") gets the plain program wrong: then the bug is not in
    DTensor code. thunder as the DTensor program meets it: with the package's scoped fixes of thunder on."""
    from thunder_dtensor import fixes_everywhere

    with fixes_everywhere("all"):
        return _plain_check_with_fixes(kind, fn_plain, program, ref)


def _plain_check_with_fixes(kind: str, fn_plain: Callable, program: Program, ref: _Reference) -> _PlainRun:
    run = _PlainRun()
    tol = _TOLERANCES[program.dtype]
    inputs = [_full(i, program.dtype) for i in program.inputs]
    try:
        result = _compile("thunderfx" if kind == "thunderfx" else "lowering", fn_plain)(*inputs)
    except Exception as error:
        run.refused = isinstance(error, NotImplementedError | TypeError)
        run.problem = f"raises {_describe_error(error)}"
        run.error = _error_like_plain(error)
        return run
    out, numbers = result if isinstance(result, tuple) else (result, ())
    run.out, run.numbers = out.detach(), list(numbers)
    if _close(run.out, ref.out, tol) or any(_number_differs(a, b, tol) for a, b in zip(run.numbers, ref.numbers)):
        run.problem = "values differ"
    if ref.cotangent is not None:
        try:
            out.backward(ref.cotangent)
        except Exception as error:
            run.problem = run.problem or f"the backward raises {_describe_error(error)}"
            return run
        run.grads = [x.grad for x in inputs]
        for want, x in zip(ref.grads, inputs):
            if (want is None) != (x.grad is None) or (
                want is not None and _close(cast(torch.Tensor, x.grad), want, tol)
            ):
                run.problem = run.problem or "gradients differ"
    return run


def _error_like_plain(error: BaseException) -> str:
    """The error's description with what differs between the DTensor program and the plain one blanked."""
    return re.sub(r"0x[0-9a-f]+", "0x_", _describe_error(error).replace("fn_plain", "fn"))


def _dynamo_alone(fn: Callable, make_inputs: Callable[[], list]) -> str:
    """How dynamo with no thunder (``torch.compile(fn, backend="eager")``) fails the DTensor program's forward ("": it
    runs it): a thunderfx error it shares is torch's."""
    try:
        torch.compile(fn, backend="eager")(*make_inputs())
    except Exception as error:
        return f"raises {_describe_error(error)}"
    return ""


def _compiled_placements(fn: Callable, make_inputs: Callable[[], list]) -> str:
    """The output placements ``torch.compile(fn, backend="aot_eager")`` (no thunder) gives the DTensor program, as
    the fuzzer writes them ("": it fails, or gives no DTensor)."""
    from torch.distributed.tensor import DTensor

    try:
        out = torch.compile(fn, backend="aot_eager")(*make_inputs())
    except Exception:
        return ""
    out = out[0] if isinstance(out, tuple) else out
    return _fmt(out.placements) if isinstance(out, DTensor) else ""


def _plain_cache_misses(fn_plain: Callable, program: Program) -> int:
    """How often thunder.jit alone traces the plain program for the two data sets (it may retrace too)."""
    import thunder

    jitted = thunder.jit(fn_plain)
    for call in CALLS:
        try:
            jitted(*[_full(i, program.dtype, call) for i in program.inputs])
        except Exception:
            return 0
    return thunder.cache_misses(jitted)


def _as_plain_thunder(failure: Failure, program: Program, got: _Run, plain: _PlainRun) -> None:
    """Mark a first-call value mismatch where thunder gives exactly what thunder alone gives the plain program."""
    if failure.kind not in ("value-mismatch", "grad-mismatch") or failure.phase.startswith(_SECOND):
        return
    if failure.detail.endswith(_AS_EAGER) or not plain.problem or plain.out is None:
        return
    tol = _TOLERANCES[program.dtype]
    where, _, name = failure.phase.partition(" ")
    if where == "output":
        same = got.out_full is not None and not _close(got.out_full, plain.out, tol)
    elif where == "number":
        k = program.numbers.index(name)
        same = (
            k < len(got.numbers)
            and k < len(plain.numbers)
            and not _number_differs(got.numbers[k], plain.numbers[k], tol)
        )
    elif where == "grad" and got.backward_ran and plain.grads:
        k = [i.name for i in program.inputs].index(name)
        mine, theirs = got.grads[k], plain.grads[k]
        same = mine is not None and theirs is not None and not _close(mine, theirs, tol)
    else:
        same = False
    if same:
        failure.detail += _AS_PLAIN_THUNDER


def _refused_like_plain(
    mode: str, program: Program, got: _Run, found: list[Failure], plain: Callable[[str], _PlainRun]
) -> bool:
    """A program that reads data which thunder.jit fails at trace time with plain thunder's own error for the plain
    program (``if`` on an ``.item()`` of a comparison: "static NumberProxy needs to have value"): thunder's refusal."""
    if MODES[mode] is None or not program.reads_data or got.error is None or got.phase != "forward":
        return False
    if [f.kind for f in found] != ["thunder-raises-eager-runs"]:
        return False
    return plain("jit").error == _error_like_plain(got.error)


def _agreed(wrong: set[str]) -> set[str]:
    """The union over the ranks (eager's ``item()`` of a Partial value differs by rank): every rank judges alike."""
    gathered, _ = _agree(sorted(wrong))
    return set().union(*map(set, gathered))


def run_program(program: Program, mesh: Any = None) -> ProgramResult:
    """Run ``program`` as plain torch, eager DTensor and each of its modes (thunder.jit with and without the
    lowering, thunderfx), each compiled function called on both data sets; judge."""
    from thunder_dtensor._integration import clear_sharding_propagation_cache

    start = time.perf_counter()
    mesh = mesh if mesh is not None else device_mesh_for(program.mesh_shape)
    dtype = getattr(torch, program.dtype)
    helpers = run_globals()
    fn, fn_plain = program_functions(program)
    written = program.written

    def inputs_of(call: int) -> Callable[[], list]:
        return lambda: [
            helpers["make_input"](
                mesh, i.shape, i.data_seed(call), [eval(_placement_source(p), helpers) for p in i.placements],
                i.requires_grad, dtype=dtype, low=i.low, int_high=i.int_high,
            )
            for i in program.inputs
        ]  # fmt: skip

    plain_runs: dict[str, _PlainRun] = {}

    def plain(kind: str) -> _PlainRun:
        if kind not in plain_runs:
            plain_runs[kind] = _plain_check(kind, fn_plain, program, refs[0])
        return plain_runs[kind]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replicated fallback's warnings, thunder's
        refs = [_reference(program, fn_plain, call) for call in CALLS]
        # once per program (the compiled runs share eager's decisions: the same inputs' sharding is the same);
        # eager's CPU attention strategy, found through decompositions, can take seconds to propagate
        clear_sharding_propagation_cache()
        eagers = [_execute(fn, inputs_of(0), refs[0].cotangent, written)]
        eagers.append(eagers[0] if eagers[0].error else _execute(fn, inputs_of(1), refs[1].cotangent, written))
        eager_wrong = [_agreed(_eager_mismatches(program, e, r)) for e, r in zip(eagers, refs)]
        eager_wrong_on_any_call = frozenset().union(*eager_wrong)
        mode_outcomes: dict[str, str] = {}
        failures: list[Failure] = []
        first_runs: dict[str, _Run] = {}
        for mode in program.modes:
            if isinstance(eagers[0].error, EagerRaisedOnSomeRanks):
                # every mode runs eager's ops on the same shards (lowering off, thunderfx) or replays them at trace
                # time (the lowering's reshape check): they would diverge as eager did, where no agreement stops them
                continue
            if MODES[mode] is None and isinstance(eagers[0].error, RanksDisagree):
                # dynamo's own fake run follows eager's rules on each rank's shards, so it diverges as eager did, in
                # the middle of the program's collectives (fuzz seed 6176 at 4 ranks: a run's crash)
                continue
            try:
                compiled = _compile(mode, fn)
                for call in CALLS:  # one compiled function, both data sets
                    got = _execute(compiled, inputs_of(call), refs[call].cotangent, written, eager=False)
                    first_runs.setdefault(mode, got)
                    outcome, found = _judge(
                        mode, program, eagers[call], eager_wrong[call], got, refs[call], call, eager_wrong_on_any_call
                    )
                    if outcome == "refused":  # a read of data: expected where plain thunder refuses it too
                        if plain("jit").refused:
                            outcome, found = "refused-like-plain-thunder", []
                        else:
                            outcome = "failed"
                            found[0].detail += " (plain thunder.jit runs the plain program)"
                    elif outcome == "failed" and _refused_like_plain(mode, program, got, found, plain):
                        outcome, found = "refused-like-plain-thunder", []
                    # the next call's collectives: on every rank or on none (a number read of a Partial value
                    # can be judged differently by rank; the outcomes' comparison after the program names that)
                    if _agree(None, outcome != "matched")[1]:
                        break
                if outcome == "matched" and MODES[mode] is not None:
                    import thunder

                    traces = thunder.cache_misses(compiled)
                    if traces != 1 and traces > (plain_traces := _plain_cache_misses(fn_plain, program)):
                        detail = (
                            f"{traces} traces for two calls with the same specs (plain thunder.jit: {plain_traces})"
                        )
                        outcome, found = "failed", [Failure(mode, "retrace", _SECOND + "call", detail)]
            except Exception as error:  # the harness itself: reported, not hidden
                outcome, found = "failed", [Failure(mode, "fuzzer-error", "judge", _describe_error(error))]
            mode_outcomes[mode] = outcome
            failures += found
        if isinstance(eagers[0].error, RanksDisagree):  # eager DTensor in this process decides alike on every rank
            failures.append(Failure("eager", "rank-divergence", eagers[0].phase, _describe_error(eagers[0].error)))
        plain_thunder = plain_thunderfx = dynamo_alone = compiled_placements = ""
        # dynamo runs the DTensor program (its collectives): on every rank, or on none, whichever rank failed so
        thunderfx_kinds = {f.kind for f in failures if f.mode == "thunderfx"}
        gathered, _ = _agree(sorted(thunderfx_kinds & {"thunder-raises-eager-runs", "placement-mismatch"}))
        thunderfx_kinds = set().union(*map(set, gathered))
        if "thunder-raises-eager-runs" in thunderfx_kinds:
            dynamo_alone = _dynamo_alone(fn, inputs_of(0))
        if "placement-mismatch" in thunderfx_kinds:
            compiled_placements = _compiled_placements(fn, inputs_of(0))
        if failures:
            for f in failures:
                if f.mode in first_runs:
                    _as_plain_thunder(
                        f, program, first_runs[f.mode], plain("thunderfx" if MODES[f.mode] is None else "jit")
                    )
            if any(MODES.get(f.mode, False) is not None for f in failures):
                plain_thunder = plain("jit").problem
            if any(f.mode == "thunderfx" for f in failures):
                plain_thunderfx = plain("thunderfx").problem
        if any(MODES[mode] is None for mode in program.modes):
            torch._dynamo.reset()  # the programs' compiled graphs, one per program: not kept

    eager = eagers[0]
    eager_error = "" if eager.error is None else f"[{eager.phase}] {_describe_error(eager.error)}"
    if eager.not_dtensor:
        eager_error = f"[output] the output is a {eager.not_dtensor}"
    outcome = "failed" if failures else ("eager-rejected" if eager_error else "passed")
    seconds = time.perf_counter() - start
    values_only = any(e.derived_placements for e in eagers)
    return ProgramResult(
        program,
        outcome,
        eager_error,
        mode_outcomes,
        failures,
        seconds,
        plain_thunder,
        values_only,
        plain_thunderfx,
        dynamo_alone,
        compiled_placements,
        tuple(frozenset(w) for w in eager_wrong),
    )


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
    #: the seeds whose programs have a step the run leaves out (``leave_out``): not run
    left_out: list[int] = field(default_factory=list)

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
        counts["thunderfx"] = sum("thunderfx" in r.mode_outcomes for r in self.results)
        counts["refused-like-plain-thunder"] = sum(
            "refused-like-plain-thunder" in r.mode_outcomes.values() for r in self.results
        )
        for r in self.results:
            if r.outcome == "eager-rejected" and not r.mode_outcomes:  # eager raised on some ranks only
                counts["eager-rejected/not-compiled"] += 1
            elif r.outcome == "eager-rejected":
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
        if self.left_out:
            stopped += f" ({len(self.left_out)} programs left out)"
        return (
            f"fuzz summary (world size {self.world_size}, {self.seconds:.0f}s){stopped}: ran={len(self.results)} "
            f"passed={c['passed']} (values only, eager's placements derived or misplaced: {c['values-only']}) "
            f"eager-rejected={c['eager-rejected']} "
            f"(thunder DTensorOpError={c['eager-rejected/thunder-DTensorOpError']}, "
            f"thunder ran and matched={c['eager-rejected/thunder-ran-and-matched']}, "
            f"not compiled, eager raised on some ranks only={c['eager-rejected/not-compiled']}) "
            f"(thunderfx ran {c['thunderfx']}; thunder.jit refused a read of data as plain thunder does: "
            f"{c['refused-like-plain-thunder']}) failed={c['failed']} "
            f"(upstream={len(self.failed) - len(self.failed_here)}) | "
            f"writes into views: {sum('view-write' in r.program.kinds for r in self.results)} programs, "
            f"{sum('view-write' in r.program.kinds for r in self.failed_here)} failed here | "
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
    """Step indices that only go together: a clone and the in-place op after it, to_local ... from_local, a number
    read and the op after it that takes it."""
    groups, i = [], 0
    while i < len(steps):
        if steps[i].kind == "clone" and i + 1 < len(steps) and steps[i + 1].kind in ("inplace", "view-write"):
            size = 2
        elif steps[i].defines and i + 1 < len(steps) and re.search(rf"\b{steps[i].defines}\b", steps[i + 1].line):
            size = 2  # a number read and the op that takes it
        elif steps[i].kind == "to_local":
            size = 3
        else:
            size = 1
        groups.append(list(range(i, min(i + size, len(steps)))))
        i += size
    return groups


def _rebuild(program: Program, steps: Sequence[Step], inputs: Sequence[InputSpec] | None = None) -> Program | None:
    """``program`` with other steps (or inputs): re-run on plain tensors for the shapes; None where torch rejects it
    (or a margin no longer holds).

    Inputs no step names any more are dropped.
    """
    if not steps:
        return None
    text = "\n".join(st.line for st in steps)
    specs = program.inputs if inputs is None else tuple(inputs)
    used = tuple(i for k, i in enumerate(specs) if k == 0 or re.search(rf"\b{i.name}\b", text))
    env = _inputs_env(used, program.dtype, 0)
    env["y"] = env[used[0].name]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shapes = _exec_plain(steps, env, final_ok=steps[-1].kind in _FINAL_KINDS)
    except Exception:
        return None
    rebuilt = tuple(replace(st, shape=shape) for st, shape in zip(steps, shapes))
    reduced_from = program.reduced_from or f"{len(program.steps)} ops"
    candidate = replace(program, inputs=used, steps=rebuilt, reduced_from=reduced_from)
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
    thunderfx_share: float = 0.0,
    view_writes: float = 0.0,
    leave_out: Collection[str] = (),
) -> FuzzSummary:
    """Generate and run the programs of ``seeds`` on every rank (call under torchrun, after init_distributed).

    After each program the ranks compare their outcomes (all_gather_object): a difference is a
    ``rank-divergence`` failure and ends the run, as do the time limit (any rank past it) and, if asked, a failure.
    ``minimize_failures``: then the smallest program of each failure signature is made smaller (:func:`minimize`;
    a few seconds per signature, not counted in the time limit). ``thunderfx_share``, ``view_writes``: see
    :func:`generate_program`. ``leave_out``: step kinds (``sdpa``) whose programs are generated but not run
    (eager DTensor's CPU attention strategies can take minutes a program); listed in the summary.
    """
    from thunder_dtensor.testing import world_size

    ws = world_size()
    summary = FuzzSummary(ws)
    start = time.perf_counter()
    for seed in seeds:
        mesh_shape = mesh_shape_for(seed, ws, mesh)
        try:
            program = generate_program(seed, ws, mesh_shape, thunderfx_share=thunderfx_share, view_writes=view_writes)
            if set(program.kinds) & set(leave_out):  # (every rank draws the same program: skipped alike)
                summary.left_out.append(seed)
                continue
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
        elif any(f.kind == "rank-divergence" for f in result.failures):
            # a rank that raised may have left collectives the others issued unmatched (seed 5900: eager DTensor
            # failed a view on one rank only): the next program's collectives would pair with them
            summary.stopped = f"the ranks diverged in seed {seed}'s program; later seeds need a fresh run"
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
