"""Every keyword of the ops with a dedicated rule is honoured, or refused at trace time (docs/keywords.md).

A dropped keyword is a silently wrong result (``F.embedding(ids, w, padding_idx=1)`` on a vocabulary-sharded
table once lost its ``padding_idx``). Each honoured keyword is compared with plain torch on the full tensors and,
where eager DTensor runs the call, with eager's placements and collectives (``run_case``); each refused one must
raise a ``DTensorOpError`` naming the op and the placements.

Keywords are grouped into one program per family and placements (one trace each: the file must stay fast); a
failing group is run again keyword by keyword, so that the failure names the keyword.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from thunder_dtensor.errors import DTensorOpError
from thunder_dtensor.testing import COMMS_ASSERTED, DTensorCase, device_type, make_full, mesh_1d, run_case

import pytest
import thunder
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

S0, S1, S2, R = [Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]


def run_keywords(
    programs: dict[str, Callable],
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Any],
    *,
    requires_grad: Sequence[bool] | None = None,
    **options: Any,
) -> None:
    """``run_case`` of one program returning every keyword's output; on a failure, each keyword again alone."""

    def group(*args: Any) -> tuple:
        return tuple(program(*args) for program in programs.values())

    def case(fn: Callable) -> DTensorCase:
        return DTensorCase(fn, list(inputs), list(placements), requires_grad=requires_grad)

    try:
        run_case(case(group), **options)
    except Exception as error:
        failing = []
        for name, program in programs.items():
            try:
                run_case(case(program), **options)
            except Exception as alone:
                failing.append(f"{name}: {type(alone).__name__}: {str(alone)[:400]}")
        raise AssertionError(
            "keywords not honoured:\n" + "\n".join(failing or [f"(the group only) {error}"])
        ) from error


def _dt(full: torch.Tensor, placements: Sequence[Any], requires_grad: bool = False) -> Any:
    return distribute_tensor(full, mesh_1d(), list(placements)).requires_grad_(requires_grad)


def assert_refused(fn: Callable, *inputs: Any, op: str, why: str = "") -> DTensorOpError:
    """``thunder.jit(fn)`` raises a DTensorOpError at trace time that names ``op``, the placements and a hint."""
    with pytest.raises(DTensorOpError) as info:
        thunder.jit(fn)(*inputs)
    message = str(info.value)
    assert op in message.splitlines()[0] and why in message, message
    assert "placements=" in message and "hint:" in message, message
    return info.value


# ---------------------------------------------------------------------------------------------------------
# Pointwise: torch.add / sub (alpha), div (rounding_mode), clamp (min, max), gelu (approximate), keywords by
# torch's parameter names, Tensor.where's own argument order
# ---------------------------------------------------------------------------------------------------------
POINTWISE = {
    "add alpha": lambda x, y, c: torch.add(x, y, alpha=2),
    "sub alpha": lambda x, y, c: torch.sub(x, y, alpha=-0.5),
    "add number alpha": lambda x, y, c: x.add(3.0, alpha=2),
    "div rounding_mode=floor": lambda x, y, c: torch.div(x, y + 2, rounding_mode="floor"),
    "div rounding_mode=trunc": lambda x, y, c: x.div(y + 2, rounding_mode="trunc"),
    "clamp min": lambda x, y, c: torch.clamp(x, min=-0.5),
    "clamp max": lambda x, y, c: x.clamp(max=0.25),
    "clamp tensor min max": lambda x, y, c: torch.clamp(x, min=y - 0.5, max=y + 0.5),
    "gelu approximate": lambda x, y, c: F.gelu(x, approximate="tanh"),
    "pow exponent=": lambda x, y, c: torch.pow(x, exponent=2),
    "where by keyword": lambda x, y, c: torch.where(condition=c, input=x, other=y),
    "Tensor.where(condition, other)": lambda x, y, c: x.where(c, y),
    "mul other=": lambda x, y, c: torch.mul(x, other=y),
    "neg input=": lambda x, y, c: torch.neg(input=x),
}


@pytest.mark.world_size(2)  # the vocab-parallel and attention keywords also run at 4 ranks (suite time)
def test_pointwise_keywords():
    x, y = make_full((6, 4), seed=1), make_full((6, 4), seed=2)
    c = make_full((6, 4), seed=3) > 0
    run_keywords(POINTWISE, [x, y, c], [S0, R, S0], assert_comms=COMMS_ASSERTED)


def test_integral_alpha():
    a, b = (make_full((4, 6), seed=s, dtype=torch.int64) for s in (4, 5))
    run_keywords({"add alpha=3": lambda a, b: torch.add(a, b, alpha=3), "sub alpha=2": lambda a, b: a.sub(b, alpha=2)},
                 [a, b], [S0, R], backward=False)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Tensor.to (dtype, device, other, non_blocking, copy, memory_format) and the casts
# ---------------------------------------------------------------------------------------------------------
def _written_copy(x: Any, y: Any) -> Any:
    """``copy=True`` makes a fresh tensor even for the same dtype: a write into it leaves ``x`` alone."""
    c = x.to(torch.float32, copy=True)
    c.mul_(2.0)
    return c + x


TO = {
    "copy": _written_copy,
    "dtype=": lambda x, y: x.to(dtype=torch.float64),
    "device, dtype": lambda x, y: x.to(device_type(), torch.float64),
    "device=, non_blocking": lambda x, y: x.to(device=device_type(), dtype=torch.float64, non_blocking=True),
    "other": lambda x, y: x.to(y),
    "memory_format": lambda x, y: x.t().to(torch.float32, memory_format=torch.contiguous_format),
    "half(memory_format)": lambda x, y: x.half(memory_format=torch.preserve_format),
    "type_as": lambda x, y: x.type_as(y),
}


def test_to_keywords():
    x, y = make_full((4, 6), seed=6), make_full((4, 6), seed=7, dtype=torch.float64)
    run_keywords(TO, [x, y], [S0, S0], requires_grad=[True, False], assert_comms=COMMS_ASSERTED)


# ---------------------------------------------------------------------------------------------------------
# Dropout: p, training, inplace
# ---------------------------------------------------------------------------------------------------------
def _dropout_in_place(x: Any) -> Any:
    t = x * 1.0
    out = F.dropout(t, 0.5, True, True)  # positional inplace
    return out * 2.0, t


def _keyword_dropout_in_place(x: Any) -> Any:
    t = x * 1.0
    F.dropout(t, p=0.25, training=True, inplace=True)  # what nn.Dropout(inplace=True) calls
    return t


@pytest.mark.world_size(2)  # the vocab-parallel and attention keywords also run at 4 ranks (suite time)
@pytest.mark.parametrize("fn", [_dropout_in_place, _keyword_dropout_in_place], ids=lambda f: f.__name__)
def test_dropout_inplace(fn):
    """The input is written (eager's values, drawn from the same seed), and the gradient reuses the mask."""
    run_case(DTensorCase(fn, [make_full((8, 4), seed=8)], [S0]), random=True)


def test_dropout_training_and_p():
    run_keywords(
        {
            "training=False": lambda x: F.dropout(x, p=0.5, training=False),
            "p=0": lambda x: F.dropout(x, p=0.0),
            "p=1": lambda x: F.dropout(x, p=1.0),
            "inplace, training=False": lambda x: (lambda t: (F.dropout(t, 0.5, False, inplace=True), t)[1])(x * 1.0),
        },
        [make_full((4, 6), seed=9)],
        [S0],
    )


# ---------------------------------------------------------------------------------------------------------
# scaled_dot_product_attention: attn_mask, dropout_p, is_causal, scale, enable_gqa (eager DTensor has no CPU
# rule for the fused kernel: plain torch is the reference)
# ---------------------------------------------------------------------------------------------------------
ATTENTION = {
    "is_causal": lambda q, k, v, m, b: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "scale": lambda q, k, v, m, b: F.scaled_dot_product_attention(q, k, v, scale=0.3),
    "attn_mask float": lambda q, k, v, m, b: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
    "attn_mask bool, positional": lambda q, k, v, m, b: F.scaled_dot_product_attention(q, k, v, b),
    "dropout_p=1": lambda q, k, v, m, b: F.scaled_dot_product_attention(q, k, v, dropout_p=1.0),
}


@pytest.mark.parametrize(
    "placements",
    [S0, pytest.param(S1, marks=pytest.mark.world_size(2, 4)), S2],
    ids=["batch", "heads", "sequence"],
)
def test_attention_keywords(placements):
    q, k, v = (make_full((2, 4, 6, 8), seed=s) for s in (10, 11, 12))
    mask, bool_mask = make_full((6, 6), seed=13), make_full((6, 6), seed=14) > -0.5
    inputs, layout = [q, k, v, mask, bool_mask], [placements] * 3 + [R, R]
    run_keywords(ATTENTION, inputs, layout, requires_grad=[True] * 3 + [False] * 2, compare_eager=False)


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("placements", [S0, S1], ids=["batch", "heads"])
def test_attention_enable_gqa(placements):
    """Two k / v heads for four q heads: sharded heads attend locally only where each rank holds the q heads of its
    own k / v head (two ranks); at four ranks, rank 1 holds q head 1 and k / v head 1, so the heads are gathered."""
    q, k, v = make_full((2, 4, 6, 8), seed=15), make_full((2, 2, 6, 8), seed=16), make_full((2, 2, 6, 8), seed=17)
    run_case(
        DTensorCase(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), [q, k, v], [placements] * 3
        ),
        compare_eager=False,
    )


# ---------------------------------------------------------------------------------------------------------
# Losses: weight, ignore_index, label_smoothing, reduction (and the legacy size_average / reduce)
# ---------------------------------------------------------------------------------------------------------
def _loss_inputs() -> list:
    logits, target, weight = (
        make_full((8, 5), seed=18),
        make_full((8,), seed=19, dtype=torch.int64),
        make_full((5,), seed=20, low=0.1),
    )
    target[:3] = 2  # rank 0 holds most of the ignored targets
    return [logits, target, weight]


MEAN_LOSSES = {
    "weight": lambda x, t, w: F.cross_entropy(x, t, weight=w),
    "ignore_index": lambda x, t, w: F.cross_entropy(x, t, ignore_index=2),
    "label_smoothing": lambda x, t, w: F.cross_entropy(x, t, label_smoothing=0.2),
    "weight, ignore_index, label_smoothing": lambda x, t, w: F.cross_entropy(
        x, t, w, ignore_index=2, label_smoothing=0.1
    ),
    "nll_loss weight, ignore_index": lambda x, t, w: F.nll_loss(F.log_softmax(x, -1), t, weight=w, ignore_index=2),
}


@pytest.mark.world_size(2)  # the vocab-parallel and attention keywords also run at 4 ranks (suite time)
def test_mean_loss_keywords():
    """The mean over a batch-sharded input is the global one (eager's per-rank means are wrong here: see
    ops/losses.py), so plain torch is the reference."""
    run_keywords(MEAN_LOSSES, _loss_inputs(), [S0, S0, R], requires_grad=[True, False, False], compare_eager=False)


OTHER_LOSSES = {
    "reduction=sum": lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=2, reduction="sum", label_smoothing=0.1),
    "reduction=none": lambda x, t, w: F.nll_loss(F.log_softmax(x, -1), t, w, ignore_index=2, reduction="none"),
    "size_average=False": lambda x, t, w: F.cross_entropy(x, t, size_average=False),
    "reduce=False": lambda x, t, w: F.cross_entropy(x, t, reduce=False),
}


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
def test_other_loss_keywords():
    run_keywords(OTHER_LOSSES, _loss_inputs(), [S0, S0, R], requires_grad=[True, False, False])


# ---------------------------------------------------------------------------------------------------------
# In-place ops: alpha, non_blocking, and the arguments of functions with an inplace flag
# ---------------------------------------------------------------------------------------------------------
def _written(write: Callable) -> Callable:
    """``write`` into a fresh value, then a read of the written value (and of ``x``: torch gives ``x`` a zero
    gradient where the write overwrites all it contributed, thunder none)."""

    def fn(x: Any, y: Any) -> Any:
        t = x * 1.0
        write(t, y)
        return t * 2.0 + x

    return fn


INPLACE = {
    "add_ alpha": _written(lambda t, y: t.add_(y, alpha=2)),
    "sub_ alpha": _written(lambda t, y: t.sub_(y, alpha=0.5)),
    "copy_ non_blocking": _written(lambda t, y: t.copy_(y + 1.0, non_blocking=True)),
    "relu inplace": _written(lambda t, y: F.relu(t, inplace=True)),
    "leaky_relu negative_slope": _written(lambda t, y: F.leaky_relu(t, 0.2, True)),
    "threshold threshold, value": _written(lambda t, y: F.threshold(t, 0.1, 20.0, inplace=True)),
    "elu alpha": _written(lambda t, y: F.elu(t, alpha=0.5, inplace=True)),
    "clamp_ min max": _written(lambda t, y: t.clamp_(min=-0.2, max=0.3)),
}


@pytest.mark.world_size(2)  # the vocab-parallel and attention keywords also run at 4 ranks (suite time)
def test_inplace_keywords():
    x, y = make_full((4, 6), seed=21), make_full((4, 6), seed=22)
    run_keywords(INPLACE, [x, y], [S0, R], assert_comms=COMMS_ASSERTED)


def test_keywords_reach_rewritten_gradients():
    """hardtanh's backward has no DTensor rule: its gradient is decomposed (ops/no_rule.py) with min_val / max_val
    (eager fails there: plain torch is the reference)."""
    run_keywords(
        {
            "hardtanh min_val max_val": lambda x: F.hardtanh(x, min_val=-0.3, max_val=0.4),
            "hardtanh inplace": lambda x: (lambda t: (F.hardtanh(t, -0.3, 0.4, inplace=True), t * 2)[1])(x * 1.0),
        },
        [make_full((4, 6), seed=23)],
        [S1],
        compare_eager=False,
    )


# ---------------------------------------------------------------------------------------------------------
# Embedding: padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
# ---------------------------------------------------------------------------------------------------------
def _ids() -> torch.Tensor:
    return torch.tensor([[1, 3, 1, 0], [5, 1, 7, 3]])  # repeats, and the padding index 1


EMBEDDING = {
    "padding_idx": lambda i, w: F.embedding(i, w, padding_idx=1),
    "padding_idx negative": lambda i, w: F.embedding(i, w, padding_idx=-7),
    "scale_grad_by_freq": lambda i, w: F.embedding(i, w, scale_grad_by_freq=True),
}


@pytest.mark.parametrize("placements", [R, S1], ids=["replicated", "dim-sharded"])
def test_embedding_keywords(placements):
    run_keywords(EMBEDDING, [_ids(), make_full((8, 6), seed=24)], [R, placements], requires_grad=[False, True])


@pytest.mark.world_size(2, 4)
def test_vocab_parallel_embedding_padding_idx():
    """The table's gradient keeps its Shard(0) by design (eager's is Replicate: ops/embedding.py)."""
    run_case(
        DTensorCase(
            lambda i, w: F.embedding(i, w, padding_idx=1) * 1.0, [_ids(), make_full((8, 6), seed=25)], [R, S0],
            requires_grad=[False, True],
        ),
        own_grad_placements={1: (Shard(0),)},
    )  # fmt: skip


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("padding_idx", [None, 1], ids=["no padding", "padding"])
def test_vocab_parallel_embedding_scale_grad_by_freq(padding_idx):
    """Ids of other ranks' ranges must not count towards a local row's frequency (row 0 of each shard)."""
    run_case(
        DTensorCase(
            lambda i, w: F.embedding(i, w, padding_idx, scale_grad_by_freq=True) * 1.0,
            [_ids(), make_full((8, 6), seed=26)], [R, S0], requires_grad=[False, True],
        ),
        own_grad_placements={1: (Shard(0),)},
    )  # fmt: skip


@pytest.mark.world_size(2)
@pytest.mark.parametrize("ids_placements", [[Shard(0)], [Shard(1)]], ids=["ids S0", "ids S1"])
def test_embedding_scale_grad_by_freq_counts_every_shards_ids(ids_placements):
    """Eager DTensor scales each shard's gradient by that shard's own counts and sums the shards (fuzz seeds 1072,
    5130, 5800, ...: a wrong weight gradient, silently); the ids are made Replicate first: plain torch's gradient.
    Eager is no reference here."""
    fulls = [_ids(), make_full((8, 6), seed=28)]
    case = DTensorCase(EMBEDDING["scale_grad_by_freq"], fulls, [ids_placements, R], requires_grad=[False, True])
    run_case(case, compare_eager=False)


def _scaled_lookup_plus(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x + F.embedding(ids, w, scale_grad_by_freq=True)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("table", [R, S0], ids=["replicated table", "vocab-sharded table"])
def test_embedding_scale_grad_by_freq_counts_every_id_when_the_gradient_is_sharded_over_the_batch(table):
    """Fuzz seed 5147: replicated ids, but the gradient arrives sharded over the batch (the sum with a sharded
    ``x``): DTensor runs the lookup's backward per shard, each counting its own ids (eager too: a wrong weight
    gradient, silently). The cotangent is made Replicate over the ids' dims first: plain torch's gradient."""
    fulls = [make_full((2, 4, 6), seed=29), _ids(), make_full((8, 6), seed=30)]
    case = DTensorCase(_scaled_lookup_plus, fulls, [S0, R, table], requires_grad=[True, False, True])
    run_case(case, compare_eager=False)


# ---------------------------------------------------------------------------------------------------------
# Refused keywords: a DTensorOpError at trace time, naming the op and the placements
# ---------------------------------------------------------------------------------------------------------
def _x(seed: int = 27, **kwargs: Any) -> Any:
    return _dt(make_full((4, 6), seed=seed, **kwargs), S0)


REFUSED = {
    "add out=": (lambda x, y: torch.add(x, y, out=y), "dtensor_add", "out="),
    "mul out=": (lambda x, y: torch.mul(x, y, out=y), "dtensor_mul", "out="),
    "pow out=": (lambda x, y: torch.pow(x, 2, out=y), "dtensor_pow", "out="),
    "neg out=": (lambda x, y: torch.neg(x, out=y), "dtensor_neg", "out="),
    "clamp out=": (lambda x, y: torch.clamp(x, min=0.0, out=y), "dtensor_clamp", "out="),
    "to device": (lambda x, y: x.to("meta"), "dtensor_to", "device move"),
    "to device=": (lambda x, y: x.to(device="meta", copy=True), "dtensor_to", "device move"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_keywords(name):
    fn, op, why = REFUSED[name]
    assert_refused(fn, _x(), _x(28), op=op, why=why)


@pytest.mark.parametrize("alpha", [2.5, True], ids=["float alpha, integral inputs", "bool alpha"])
def test_alpha_torch_refuses(alpha):
    """torch refuses a floating alpha for integral tensors and a bool one for non-bool results; so does the trace."""
    dtype = torch.int64 if isinstance(alpha, float) else torch.float32
    assert_refused(lambda a, b: torch.add(a, b, alpha=alpha), _x(dtype=dtype), _x(28, dtype=dtype), op="dtensor_add")


def test_embedding_max_norm_and_sparse_are_refused():
    """max_norm (with norm_type) renormalises the table in place, sparse asks for a sparse gradient: eager DTensor
    has a rule for neither (torch 2.13), and the trace refuses both."""
    ids, table = _dt(_ids(), R), _dt(make_full((8, 6), seed=29), R, requires_grad=True)
    op = "dtensor_nn_functional_embedding"
    assert_refused(lambda i, w: F.embedding(i, w, max_norm=1.0, norm_type=1.0), ids, table, op=op)
    assert_refused(lambda i, w: F.embedding(i, w, sparse=True), ids, table, op=op)
