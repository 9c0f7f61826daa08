"""The lowering's table of ATen overloads -> thunder calls (``thunder_equivalents``): every argument is passed on.

A table entry that drops an argument of its ATen overload is a silently wrong lowered program (the lowering checks
only the counterpart's output shapes and dtypes). Here each entry is called with every argument of its overload's
schema varied (:data:`SAMPLES`: each non-tensor argument takes at least two values, a default counting as one) and
compared with the ATen op itself on the same tensors: values, dtype and shape equal, or, where the sample says so,
the entry refuses (``NoEquivalent``: the lowering emits the ATen op itself). A call ATen rejects must be refused
too. A new entry without samples fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import thunder_dtensor  # noqa: F401  (first: makes thunder importable on torch >= 2.13)
from thunder_dtensor.thunder_equivalents import THUNDER_EQUIVALENTS, NoEquivalent

import pytest
import thunder
import torch

aten = torch.ops.aten


def _t(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, low: float = -1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g) * (1.0 - low) + low).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(0, 6, shape, generator=g, dtype=dtype)


X, Y = _t(3, 4, seed=1), _t(3, 4, seed=2)
POSITIVE = _t(3, 4, seed=3, low=0.1)
INTS, INTS2 = _t(3, 4, seed=4, dtype=torch.int64), _t(3, 4, seed=5, dtype=torch.int64)
IDS = torch.tensor([[1, 3, 1, 0], [5, 1, 2, 3]])  # repeats, and the padding index 1
G = _t(2, 4, 3, seed=6)

#: the key of a sample the entry must refuse: the value is a word of its ``NoEquivalent`` message
REFUSED = "refused"

#: ATen overload -> calls, each a dict argument name -> value (positional or keyword as the schema says)
SAMPLES: dict[Any, list[dict[str, Any]]] = {
    aten.alias.default: [{"self": X}],
    aten.view.default: [{"self": X, "size": [4, 3]}, {"self": X, "size": [12]}],
    aten._unsafe_view.default: [{"self": X, "size": [2, 6]}, {"self": X, "size": [12]}],
    aten.reshape.default: [{"self": X, "shape": [6, 2]}, {"self": X.t(), "shape": [12]}],
    aten.t.default: [{"self": X}],
    aten.transpose.int: [
        {"self": _t(2, 3, 4), "dim0": 0, "dim1": 1},
        {"self": _t(2, 3, 4), "dim0": -1, "dim1": 0},
    ],
    aten.permute.default: [{"self": _t(2, 3, 4), "dims": [2, 0, 1]}, {"self": _t(2, 3, 4), "dims": [1, 0, 2]}],
    aten.expand.default: [
        {"self": _t(3, 1), "size": [3, 4]},
        {"self": _t(3, 1), "size": [2, 3, 5], "implicit": True},
    ],
    aten.unsqueeze.default: [{"self": X, "dim": 0}, {"self": X, "dim": -1}],
    aten.squeeze.dim: [{"self": _t(3, 1, 4), "dim": 1}, {"self": _t(3, 1, 4), "dim": 0}],
    aten.split.Tensor: [{"self": X, "split_size": 2}, {"self": X, "split_size": 3, "dim": 1}],
    aten.split_with_sizes.default: [
        {"self": X, "split_sizes": [1, 2]},
        {"self": X, "split_sizes": [3, 1], "dim": 1},
    ],
    aten.cat.default: [{"tensors": [X, Y]}, {"tensors": [X, Y], "dim": 1}],
    aten.clone.default: [
        {"self": X.t()},
        {"self": X.t(), "memory_format": torch.contiguous_format},
        {"self": X.t(), "memory_format": torch.preserve_format},
        {"self": _t(2, 3, 4, 5), "memory_format": torch.channels_last, REFUSED: "memory_format"},
    ],
    aten._to_copy.default: [
        {"self": X},
        {"self": X, "dtype": torch.float64},
        {"self": X, "dtype": torch.int32},
        {"self": X, "layout": torch.strided},
        {"self": X, "device": "cpu"},
        {"self": X, "device": "meta", REFUSED: "device move"},
        {"self": X, "pin_memory": True, REFUSED: "pin_memory"},
        {"self": X, "pin_memory": False},
        {"self": X, "dtype": torch.float64, "non_blocking": True},
        {"self": X.t(), "memory_format": torch.contiguous_format, REFUSED: "memory format"},
        {"self": X.t(), "memory_format": torch.preserve_format},
    ],
    aten.mm.default: [{"self": X, "mat2": _t(4, 5)}],
    aten.bmm.default: [{"self": _t(2, 3, 4), "mat2": _t(2, 4, 5)}],
    aten.addmm.default: [
        {"self": _t(5), "mat1": X, "mat2": _t(4, 5)},
        {"self": _t(5), "mat1": X, "mat2": _t(4, 5), "beta": 0.5, REFUSED: "addmm"},
        {"self": _t(5), "mat1": X, "mat2": _t(4, 5), "alpha": 2.0, REFUSED: "addmm"},
        {"self": _t(3, 5), "mat1": X, "mat2": _t(4, 5), REFUSED: "addmm"},
    ],
    aten.sum.dim_IntList: [
        {"self": X, "dim": [1]},
        {"self": X, "dim": [0, 1], "keepdim": True},
        {"self": X, "dim": [0], "dtype": torch.float64},
        {"self": INTS, "dim": [1]},
        {"self": INTS, "dim": [1], "dtype": torch.int32},
        {"self": X, "dim": []},
        {"self": X, "dim": None, "keepdim": True, REFUSED: "keepdim"},
    ],
    aten.sum.default: [{"self": X}, {"self": X, "dtype": torch.float64}, {"self": INTS}],
    aten.mean.dim: [
        {"self": X, "dim": [1]},
        {"self": X, "dim": [0], "keepdim": True},
        {"self": X, "dim": [1], "dtype": torch.float64},
        {"self": X.bfloat16(), "dim": [1], "dtype": torch.float32},
        {"self": X, "dim": [], REFUSED: "every dim"},
    ],
    aten._softmax.default: [
        {"self": X, "dim": 1, "half_to_float": False},
        {"self": X, "dim": 0, "half_to_float": False},
        {"self": X.half(), "dim": 1, "half_to_float": True, REFUSED: "half_to_float"},
    ],
    aten.scalar_tensor.default: [
        {"s": 2.5},
        {"s": 3, "dtype": torch.int64},
        {"s": 3, "layout": torch.strided},
        {"s": 1.5, "device": "cpu"},
        {"s": 1.5, "pin_memory": True, REFUSED: "pin_memory"},
        {"s": 1.5, "pin_memory": False},
    ],
    aten.embedding.default: [
        {"weight": _t(6, 3), "indices": IDS},
        {"weight": _t(6, 3), "indices": IDS, "padding_idx": 1},
        {"weight": _t(6, 3), "indices": IDS, "scale_grad_by_freq": True, REFUSED: "scale_grad_by_freq"},
        {"weight": _t(6, 3), "indices": IDS, "sparse": True, REFUSED: "sparse"},
    ],
    aten.embedding_dense_backward.default: [
        {"grad_output": G, "indices": IDS, "num_weights": 6, "padding_idx": -1, "scale_grad_by_freq": False},
        {"grad_output": G, "indices": IDS, "num_weights": 7, "padding_idx": 1, "scale_grad_by_freq": False},
        {"grad_output": G, "indices": IDS, "num_weights": 6, "padding_idx": -1, "scale_grad_by_freq": True},
    ],
    aten.where.self: [{"condition": X > 0, "self": X, "other": Y}],
    aten.pow.Tensor_Scalar: [{"self": POSITIVE, "exponent": 2}, {"self": POSITIVE, "exponent": 0.5}],
    aten.pow.Tensor_Tensor: [{"self": POSITIVE, "exponent": Y}],
    aten.gelu.default: [{"self": X}, {"self": X, "approximate": "tanh"}],
}

for _name in ("add", "sub"):
    SAMPLES[getattr(aten, _name).Tensor] = [
        {"self": X, "other": Y},
        {"self": X, "other": Y, "alpha": 2},
        {"self": X, "other": Y, "alpha": 0.5},
    ]
    SAMPLES[getattr(aten, _name).Scalar] = [
        {"self": X, "other": 2.0},
        {"self": X, "other": 2.0, "alpha": 3},
        {"self": INTS, "other": 2, "alpha": 2},
    ]
for _name in ("mul", "div", "lt", "le", "gt", "ge", "eq", "ne"):
    SAMPLES[getattr(aten, _name).Tensor] = [{"self": X, "other": Y}]
    SAMPLES[getattr(aten, _name).Scalar] = [{"self": X, "other": 0.5}, {"self": X, "other": -2}]
for _name in ("bitwise_or", "bitwise_and", "bitwise_xor"):
    SAMPLES[getattr(aten, _name).Tensor] = [{"self": INTS, "other": INTS2}]
    SAMPLES[getattr(aten, _name).Scalar] = [{"self": INTS, "other": 3}, {"self": INTS, "other": 6}]
for _name in ("abs", "neg", "exp", "tanh", "sigmoid", "sin", "cos", "relu", "silu", "erf"):
    SAMPLES[getattr(aten, _name).default] = [{"self": X}]
for _name in ("log", "sqrt", "rsqrt", "reciprocal"):
    SAMPLES[getattr(aten, _name).default] = [{"self": POSITIVE}]
SAMPLES[aten.logical_not.default] = [{"self": X > 0}]
SAMPLES[aten.bitwise_not.default] = [{"self": INTS}]


def _call(overload: Any, sample: dict[str, Any]) -> tuple[tuple, dict]:
    """The sample as the lowering's fx graphs pass it: positional arguments in schema order (an omitted one before
    a given one takes its default), keyword-only ones as keywords, trailing defaults omitted."""
    arguments = overload._schema.arguments
    sample = {k: v for k, v in sample.items() if k != REFUSED}
    unknown = set(sample) - {a.name for a in arguments}
    assert not unknown, f"{overload}: no arguments {unknown}"
    positional = [a for a in arguments if not a.kwarg_only]
    given = [i for i, a in enumerate(positional) if a.name in sample]
    args = tuple(
        sample[a.name] if a.name in sample else a.default_value for a in positional[: (max(given) + 1 if given else 0)]
    )
    kwargs = {a.name: sample[a.name] for a in arguments if a.kwarg_only and a.name in sample}
    return args, kwargs


def _run_equivalents(fn: Callable, calls: list[tuple[tuple, dict]]) -> list:
    """``fn`` (the table's entry) called once per ``(args, kwargs)`` on TensorProxies, in one ``thunder.jit`` program
    of the calls' tensors; the outputs, per call."""
    tensors: list[torch.Tensor] = []

    def slot(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return _Slot(len(tensors) - 1)
        return [slot(x) for x in v] if isinstance(v, list) else v

    slotted = [([slot(a) for a in args], {k: slot(v) for k, v in kwargs.items()}) for args, kwargs in calls]

    def program(*ts: torch.Tensor) -> Any:
        def value(v: Any) -> Any:
            if isinstance(v, _Slot):
                return ts[v.index]
            return [value(x) for x in v] if isinstance(v, list) else v

        return [fn(*[value(a) for a in args], **{k: value(v) for k, v in kwargs.items()}) for args, kwargs in slotted]

    return thunder.jit(program)(*tensors)


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _label(overload: Any) -> str:
    return str(overload).removeprefix("aten.")


def test_every_entry_has_samples():
    missing = [_label(op) for op in THUNDER_EQUIVALENTS if op not in SAMPLES]
    assert not missing, f"table entries without SAMPLES (add calls that vary each argument): {missing}"


@pytest.mark.parametrize("overload", list(SAMPLES), ids=_label)
def test_samples_vary_every_argument(overload):
    """Each non-tensor argument of the overload takes at least two values over its samples (a default is one)."""
    for argument in overload._schema.arguments:
        if argument.type.isSubtypeOf(torch.TensorType.get()) or "Tensor" in str(argument.type):
            assert all(argument.name in s for s in SAMPLES[overload]), f"{argument.name} missing from a sample"
            continue
        values = {repr(s.get(argument.name, argument.default_value)) for s in SAMPLES[overload]}
        assert len(values) >= 2, f"{overload}: argument {argument.name} takes only {values} in SAMPLES"


@pytest.mark.parametrize("overload", list(SAMPLES), ids=_label)
def test_entry_passes_every_argument_on_or_refuses(overload):
    """Each call computes what the ATen op computes with these arguments (all of an entry's calls in one program),
    or refuses where the sample says so."""
    fn = THUNDER_EQUIVALENTS[overload]
    accepted = []
    for i, sample in enumerate(SAMPLES[overload]):
        args, kwargs = _call(overload, sample)
        try:
            expected = overload(*args, **kwargs)
        except RuntimeError:
            expected = None
        if REFUSED in sample or expected is None:  # a call ATen rejects must be refused too
            with pytest.raises(NoEquivalent, match=sample.get(REFUSED, "")):
                _run_equivalents(fn, [(args, kwargs)])
        else:
            accepted.append((i, args, kwargs, expected))
    outputs = _run_equivalents(fn, [(args, kwargs) for _, args, kwargs, _ in accepted])
    for (i, _, _, expected), actual in zip(accepted, outputs, strict=True):
        expected, actual = _as_list(expected), _as_list(actual)
        assert len(actual) == len(expected), f"sample {i}"
        for a, e in zip(actual, expected):
            assert (a.dtype, a.shape, a.device) == (e.dtype, e.shape, e.device), f"sample {i}: {a} vs ATen's {e}"
            torch.testing.assert_close(a, e, msg=lambda m, i=i: f"sample {i} ({sorted(SAMPLES[overload][i])}): {m}")
