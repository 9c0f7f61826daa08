"""The op database for the multi-rank op tests: adding an op to the tests is one entry here.

Each entry gives a function on tensors, its inputs' shapes, and which placements to sweep. The test
(`test_ops.py`) distributes the same full inputs with each placement combination, runs the function under
thunder.jit, and compares values and gradients with plain torch on the full tensors, and placements with
eager DTensor where eager can run the case.

Each case declares what thunder_dtensor does with it, and the test asserts exactly that (``run_case(expect=...)``):
``RUNS`` (on DTensor's sharding rules, no op rewritten: every case unless its entry's ``expect`` or ``outcomes``
says otherwise), ``rewritten(how)`` (eager DTensor fails on it; the op runs decomposed or on replicated inputs,
``ops/no_rule.py``) or ``raises(error, match)`` (a named error of ``thunder_dtensor.errors``). A case that starts
to behave otherwise (a torch release gives DTensor a rule, a rewrite stops applying) fails until its declaration
is updated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from thunder_dtensor.errors import DataDependentValueError
from thunder_dtensor.testing import RUNS, CaseResult, Outcome, raises, rewritten

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard


@dataclass
class OpEntry:
    name: str
    fn: Callable
    shapes: Sequence[tuple]
    #: per input: "all" (every Shard dim + Replicate), "replicate", or an explicit list of placements
    sweep: Sequence = ("all",)
    dtypes: Sequence[torch.dtype] | None = None
    grad: Sequence[bool] | bool = True
    #: eager DTensor can run this op on these placements (compare placements with it)
    eager: bool = True
    #: also try a Partial(sum) first input
    partial: bool = False
    low: float = -1.0
    #: integer inputs are drawn from [0, int_high)
    int_high: int = 5
    #: sweep all inputs together over the first input's choices (q, k, v of attention)
    together: int = 0
    kwargs: dict = field(default_factory=dict)
    rtol: float | None = None
    atol: float | None = None
    #: turns the drawn full inputs into the entry's (e.g. quantised so that values tie); may assert on them
    make_inputs: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
    #: draws random numbers (dropout): values and gradients are compared with eager DTensor's on the same seed
    random: bool = False
    #: extra assertions on the run_case result, given the full inputs
    check: Callable[[CaseResult, list[torch.Tensor]], None] | None = None
    #: what thunder_dtensor does with the entry's cases (asserted), unless ``outcomes`` names a case
    expect: Outcome = RUNS
    #: the cases that do otherwise, by their placements as in the case id ("S(1)", "S(0)-R-R"), at every world size,
    #: or at one with "@4" (uneven shards); test_ops.py checks that every key names a case
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def outcome(self, combo: tuple, world_size: int) -> Outcome:
        """What thunder_dtensor does with the case of these placements at this world size."""
        key = placements_id(combo)
        return self.outcomes.get(f"{key}@{world_size}", self.outcomes.get(key, self.expect))

    def placement_choices(self, i: int, ndim: int) -> list:
        spec = self.sweep[i] if i < len(self.sweep) else "replicate"
        if spec == "all":
            return [[Shard(d)] for d in range(ndim)] + [[Replicate()]]
        if spec == "replicate":
            return [[Replicate()]]
        return [list(p) for p in spec]

    def cases(self) -> list[tuple]:
        """Sweep one input at a time over its choices (others Replicate), plus all inputs on their first choice."""
        choices = [self.placement_choices(i, len(s)) for i, s in enumerate(self.shapes)]
        if self.together:
            rest = tuple([Replicate()] for _ in self.shapes[self.together :])
            return [tuple(option for _ in range(self.together)) + rest for option in choices[0]]
        combos = {tuple(str(c[0]) for c in choices): tuple(c[0] for c in choices)}
        for i, options in enumerate(choices):
            for option in options:
                combo = tuple(option if j == i else [Replicate()] for j in range(len(choices)))
                combos.setdefault(tuple(map(str, combo)), combo)
        if self.partial:
            combo = ([Partial()],) + tuple([Replicate()] for _ in choices[1:])
            combos.setdefault(tuple(map(str, combo)), combo)
        return list(combos.values())


def _causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _masked_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _quantised(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    # steps of 0.25 on [-1, 1]: equal values (ties) at many elements, zeros among them
    return [torch.round(t * 4) / 4 for t in inputs]


def _ties(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """maximum / minimum: the operands tie at some elements (torch splits the gradient 0.5 / 0.5 there)."""
    x, y = _quantised(inputs)
    ties = x == y
    assert ties.any() and not ties.all(), "the inputs must tie at some elements, not all"
    return [x, y]


def _clamp_ties(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """x, min, max (or x, min) with x == min and x == max at some elements: torch gives x the gradient there."""
    x, *bounds = _quantised(inputs)
    bounds = [-bounds[0].abs()] + [b.abs() for b in bounds[1:]]
    for bound in bounds:
        assert (x == bound).any(), "x must equal each bound at some elements"
    return [x, *bounds]


def _dropout_check(p: float) -> Callable[[CaseResult, list[torch.Tensor]], None]:
    """The mask is real (some dropped, the rest scaled by 1/(1-p)), in the output and in x's gradient.

    ``fn(x, *rest)`` is ``dropout(x) * rest...``; inputs drawn with ``low > 0`` so a zero output means dropped.
    """

    def check(result: CaseResult, inputs: list[torch.Tensor]) -> None:
        x, rest = inputs[0], inputs[1:]
        scale = torch.ones_like(x)
        for t in rest:
            scale = scale * t
        out = result.thunder_out[0].full_tensor()
        kept = out != 0
        dropped = 1 - kept.float().mean().item()
        assert 0 < dropped < 1 and abs(dropped - p) < 0.25, f"dropped {dropped:.2f} of the elements at p={p}"
        torch.testing.assert_close(out, torch.where(kept, x * scale / (1 - p), 0.0))
        g = result.cotangents[0]
        torch.testing.assert_close(result.thunder_grads[0].full_tensor(), torch.where(kept, g * scale / (1 - p), 0.0))

    return check


HEADS = [[Shard(0)], [Shard(1)], [Replicate()]]  # batch, heads, replicated
B, H, S, D = 2, 4, 6, 8

#: eager DTensor refuses the case; thunder_dtensor runs the op on replicated inputs (gathered), with a warning
REPLICATED = rewritten("replicated fallback")

OP_DB: list[OpEntry] = [
    # --- pointwise --------------------------------------------------------------------------------
    OpEntry("add", torch.add, [(6, 8), (6, 8)], partial=True),
    OpEntry("sub", torch.sub, [(6, 8), (8,)]),
    OpEntry("mul", torch.mul, [(6, 8), (6, 8)], partial=True),
    OpEntry("div", torch.div, [(6, 8), (6, 8)], low=0.5),
    OpEntry("pow", lambda x: torch.pow(x, 3), [(6, 8)]),
    OpEntry("pow_tensor", torch.pow, [(6, 8), (6, 8)], low=0.5),
    OpEntry("neg", torch.neg, [(6, 8)], partial=True),
    OpEntry("abs", torch.abs, [(6, 8)]),
    OpEntry("exp", torch.exp, [(6, 8)]),
    OpEntry("log", torch.log, [(6, 8)], low=0.5),
    OpEntry("sqrt", torch.sqrt, [(6, 8)], low=0.5),
    OpEntry("rsqrt", torch.rsqrt, [(6, 8)], low=0.5),
    OpEntry("tanh", torch.tanh, [(6, 8)]),
    OpEntry("sigmoid", torch.sigmoid, [(6, 8)]),
    OpEntry("erf", torch.erf, [(6, 8)]),
    OpEntry("sin", torch.sin, [(6, 8)]),
    OpEntry("cos", torch.cos, [(6, 8)]),
    OpEntry("reciprocal", torch.reciprocal, [(6, 8)], low=0.5),
    OpEntry("sign", torch.sign, [(6, 8)], make_inputs=_quantised),  # zeros included
    OpEntry("maximum", torch.maximum, [(6, 8), (6, 8)], sweep=("all", "all"), make_inputs=_ties),
    OpEntry("minimum", torch.minimum, [(6, 8), (8,)], make_inputs=_ties),  # broadcast
    OpEntry("clamp", lambda x: torch.clamp(x, -0.5, 0.5), [(6, 8)]),
    OpEntry(
        "clamp_tensor", torch.clamp, [(6, 8), (6, 8), (6, 8)], sweep=("all", "all", "all"), make_inputs=_clamp_ties
    ),
    OpEntry("clamp_tensor_min", lambda x, lo: x.clamp(min=lo), [(6, 8), (8,)], make_inputs=_clamp_ties),
    OpEntry("clamp_min", lambda x: x.clamp(min=0.1), [(6, 8)]),
    OpEntry("where", lambda x, y: torch.where(x > 0, x, y), [(6, 8), (6, 8)]),
    OpEntry("comparisons", lambda x, y: (x > y).float() + (x <= y).float() * 2 + (x == x).float(), [(6, 8), (6, 8)]),
    OpEntry("relu", F.relu, [(6, 8)]),
    OpEntry("gelu", F.gelu, [(6, 8)]),
    OpEntry("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), [(6, 8)]),
    OpEntry("silu", F.silu, [(6, 8)]),
    OpEntry("to_dtype", lambda x: x.to(torch.float64) * 2, [(6, 8)]),
    OpEntry("type_as", lambda x, y: x.type_as(y), [(6, 8), (6, 8)], dtypes=[torch.float32, torch.float64]),
    OpEntry("half", lambda x: x.half().float(), [(6, 8)]),
    OpEntry("type_promotion", lambda x, y: x * y, [(6, 8), (6, 8)], dtypes=[torch.float32, torch.float64]),
    OpEntry("broadcast", lambda x, b: x * b + b, [(4, 6, 8), (6, 1)]),
    # --- reductions -------------------------------------------------------------------------------
    OpEntry("sum", torch.sum, [(6, 8)], partial=True),
    OpEntry("sum_dim", lambda x: x.sum(dim=1), [(6, 8)]),
    OpEntry("sum_keepdim", lambda x: x.sum(dim=(0, 2), keepdim=True), [(4, 6, 8)]),
    OpEntry("mean", lambda x: x.mean(dim=-1), [(6, 8)]),
    OpEntry("mean_all", torch.mean, [(6, 8)]),
    OpEntry("amax", lambda x: x.amax(dim=1, keepdim=True), [(6, 8)]),
    OpEntry("var", lambda x: x.var(dim=1, keepdim=True), [(6, 8)]),
    OpEntry("var_unbiased_false", lambda x: torch.var(x, dim=0, unbiased=False), [(6, 8)]),
    # --- matmul -----------------------------------------------------------------------------------
    OpEntry("matmul", torch.matmul, [(6, 8), (8, 4)], sweep=("all", "all")),
    OpEntry("mm", torch.mm, [(6, 8), (8, 4)], sweep=("all", "all")),
    OpEntry("bmm", torch.bmm, [(4, 6, 8), (4, 8, 2)], sweep=("all", "all")),
    OpEntry("matmul_3d", torch.matmul, [(4, 6, 8), (8, 2)], sweep=("all", "all")),
    OpEntry("linear", F.linear, [(6, 8), (4, 8)], sweep=("all", "all")),
    # a 3-D input of 2 rows sharded over 4 ranks: eager cannot flatten it for the matmul
    OpEntry(
        "linear_bias",
        F.linear,
        [(2, 6, 8), (4, 8), (4,)],
        sweep=("all", "all", "all"),
        outcomes={"S(0)-S(0)-S(0)@4": REPLICATED, "S(0)-R-R@4": REPLICATED},
    ),
    # --- views ------------------------------------------------------------------------------------
    OpEntry("view", lambda x: x.view(6, 4, 2), [(6, 8)]),
    OpEntry("reshape", lambda x: x.reshape(-1), [(6, 8)], outcomes={"S(0)@4": REPLICATED}),  # uneven: eager refuses
    OpEntry("transpose", lambda x: x.transpose(0, 1) * 2, [(6, 8)]),
    OpEntry("t", lambda x: x.t() * 2, [(6, 8)]),
    OpEntry("permute", lambda x: x.permute(2, 0, 1) * 2, [(4, 6, 8)]),
    OpEntry("unsqueeze", lambda x: x.unsqueeze(1) * 2, [(6, 8)]),
    # eager refuses to squeeze away a sharded dim (of size 1: one rank holds it, the other nothing)
    OpEntry("squeeze", lambda x: x.squeeze(1) * 2, [(6, 1, 8)], outcomes={"S(1)": REPLICATED}),
    OpEntry("flatten", lambda x: torch.flatten(x, 1) * 2, [(4, 6, 8)], outcomes={"S(1)@4": REPLICATED}),  # uneven
    OpEntry("expand", lambda x: x.expand(4, 6, 8) * 1, [(6, 8)]),
    OpEntry("contiguous", lambda x: x.transpose(0, 1).contiguous() * 2, [(6, 8)]),
    OpEntry("split", lambda x: [t * (i + 1) for i, t in enumerate(torch.split(x, [2, 6], dim=1))], [(6, 8)]),
    OpEntry("chunk", lambda x: [t * (i + 1) for i, t in enumerate(x.chunk(2, dim=-1))], [(6, 8)]),
    OpEntry("cat", lambda x, y: torch.cat([x, y], dim=1), [(6, 8), (6, 4)], sweep=("all", "all")),
    OpEntry("stack", lambda x, y: torch.stack([x, y], dim=0), [(6, 8), (6, 8)]),
    OpEntry("slice", lambda x: x[:, 1:5] * 2, [(6, 8)]),
    OpEntry("select", lambda x: x[2] * 2, [(6, 8)]),
    # --- softmax, norms, embedding, attention, losses ------------------------------------------------
    OpEntry("softmax", lambda x: torch.softmax(x, dim=-1), [(6, 8)]),
    OpEntry("log_softmax", lambda x: F.log_softmax(x, dim=1), [(6, 8)]),
    OpEntry("layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b), [(2, 6, 8), (8,), (8,)]),
    # the normalized dim sharded: eager refuses the in-place add_ of its decomposition (a placement change)
    OpEntry("rms_norm", lambda x, w: F.rms_norm(x, (8,), w), [(2, 6, 8), (8,)], outcomes={"S(2)-R": REPLICATED}),
    # what dynamo records for F.rms_norm / nn.RMSNorm
    OpEntry(
        "torch_rms_norm",
        lambda x, w: torch.rms_norm(x, (8,), w, 1e-5),
        [(2, 6, 8), (8,)],
        outcomes={"S(2)-R": REPLICATED},
    ),
    OpEntry("view_as_complex_real", lambda x: torch.view_as_real(torch.view_as_complex(x) * 2j), [(2, 6, 8, 2)]),
    OpEntry(
        "embedding",
        lambda idx, w: F.embedding(idx, w),
        [(4, 6), (10, 8)],
        dtypes=[torch.int64, torch.float32],
        sweep=("all", [[Replicate()], [Shard(1)]]),
        grad=[False, True],
        int_high=10,
    ),
    # vocab-parallel: our output is Partial(sum) (eager: MaskPartial, equal as a placement) and the table's
    # gradient keeps the table's Shard(0) (eager: a full Replicate gradient): values are compared
    OpEntry(
        "embedding_vocab_parallel",
        lambda idx, w: F.embedding(idx, w),
        [(4, 6), (10, 8)],
        dtypes=[torch.int64, torch.float32],
        sweep=("replicate", [[Shard(0)]]),
        grad=[False, True],
        int_high=10,
        eager=False,
    ),
    OpEntry("sdpa_causal", _causal_sdpa, [(B, H, S, D)] * 3, sweep=(HEADS,), together=3, eager=False),
    OpEntry("sdpa_mask", _masked_sdpa, [(B, H, S, D)] * 3 + [(S, S)], sweep=(HEADS,), together=3, eager=False),
    OpEntry("dropout_eval", lambda x: F.dropout(x, p=0.3, training=False) * 2, [(6, 8)]),
    OpEntry("dropout_p0", lambda x: F.dropout(x, p=0.0) * 2, [(6, 8)]),
    OpEntry(
        "dropout",
        lambda x: F.dropout(x, p=0.4, training=True),
        [(8, 16)],
        low=0.5,
        random=True,
        check=_dropout_check(0.4),
    ),
    OpEntry(
        "dropout_mul",
        lambda x, w: F.dropout(x, p=0.4, training=True) * w,
        [(8, 16), (8, 16)],
        low=0.5,
        random=True,
        check=_dropout_check(0.4),
    ),
    *(
        OpEntry(
            name + suffix,
            fn,
            [(6, 10), (6,)],
            dtypes=[torch.float32, torch.int64],
            grad=[True, False],
            int_high=10,
            **options,
        )
        for name, fn in (
            ("cross_entropy", lambda x, t: F.cross_entropy(x, t)),
            ("nll_loss", lambda x, t: F.nll_loss(F.log_softmax(x, -1), t)),
        )
        for suffix, options in (
            ("", {"sweep": ([[Shard(1)], [Replicate()]], "replicate")}),
            # batch-sharded: eager's Partial(avg) of per-rank means is right only when every rank's denominator
            # is the same (no class weights, no ignored targets); ours is the global sum over the global count
            # (ops/losses.py): Partial(sum), one more all-reduce
            ("_batch_sharded", {"sweep": ([[Shard(0)]], [[Shard(0)], [Replicate()]]), "eager": False}),
        )
    ),
    # --- data-dependent output shapes: no trace can hold one (plain thunder refuses them too) -----------------
    OpEntry(
        "masked_select",
        lambda x: torch.masked_select(x, x > 0),
        [(6, 8)],
        expect=raises(DataDependentValueError, "its output's shape depends on the data"),
    ),
    # --- factories --------------------------------------------------------------------------------
    OpEntry("zeros_like", lambda x: x + torch.zeros_like(x), [(6, 8)]),
    OpEntry("ones_like", lambda x: x * torch.ones_like(x), [(6, 8)]),
    OpEntry("full_like", lambda x: x * torch.full_like(x, 3.0), [(6, 8)]),
]


def all_cases() -> list[tuple[OpEntry, tuple]]:
    return [(entry, combo) for entry in OP_DB for combo in entry.cases()]


def placements_id(combo: tuple) -> str:
    """A case's placements as its id writes them: "S(0)-R" (an input's placements on a 2-D mesh run together)."""
    return "-".join("".join(str(p) for p in c) for c in combo)


def case_id(case: tuple[OpEntry, tuple]) -> str:
    entry, combo = case
    return entry.name + "-" + placements_id(combo)


__all__ = ["OP_DB", "OpEntry", "all_cases", "case_id", "itertools", "placements_id"]
