"""Plain-thunder fixes that model libraries need (transformers 5.x): each program fails on thunder 0.2.6 as
docs/architecture.md says (checked with the fixes switched off) and runs with eager's values with them on."""

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import thunder_dtensor  # noqa: F401  (first: makes thunder importable on torch >= 2.13)
from thunder_dtensor import _integration
from thunder_dtensor.testing import assert_jit_matches_eager

import pytest
import thunder
import torch


class _Layers(Sequence):
    """A Sequence whose iteration needs what its own ``__init__`` sets (transformers' per-layer config view)."""

    def __init__(self, count: int) -> None:
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> int:
        if index >= self._count:
            raise IndexError(index)
        return index


def _make_a_sequence(x: torch.Tensor) -> torch.Tensor:
    return x * len(_Layers(3)) + sum(_Layers(3))


def _chain_arguments(x: torch.Tensor) -> torch.Tensor:
    """What torch's ``context_parallel`` SDPA wrapper does with its arguments."""
    first, second = itertools.chain((x,), {"k": x * 2}.values())
    return first + second


class _Collector:
    """Set during a call and reset after it (transformers' output collector under a compiler)."""

    def __init__(self) -> None:
        self.collected = None


COLLECTOR = _Collector()


def _set_then_reset(x: torch.Tensor) -> torch.Tensor:
    COLLECTOR.collected = {"hidden_states": []}
    y = x * 2
    COLLECTOR.collected = None
    return y


class _LazyCache:
    """Allocated by the first call that uses it (transformers' ``StaticCache`` layer)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.length = 0
        self.ready = False


def _fill_a_lazy_cache(x: torch.Tensor, cache: _LazyCache) -> torch.Tensor:
    if not cache.ready:
        cache.device = x.device  # (a new attribute: the one write thunder alone records)
        cache.keys = torch.zeros_like(x)
        cache.length = x.shape[0]
        cache.ready = True
    cache.keys.add_(x)
    return cache.keys * 2


def _slice_longer_than_the_dim(x: torch.Tensor) -> torch.Tensor:
    """transformers' sliding-window mask: ``mask[:, -window:]`` with a window longer than the prompt."""
    return x[-7:, None, -5:-1] * 2


def _index_of_python_int_type(x: torch.Tensor) -> torch.Tensor:
    """transformers' sliding-window static cache: ``torch.tensor([-1], dtype=int)``."""
    return x.index_select(0, torch.tensor([-1], dtype=int) + x.shape[0])


class _ActivationsByName(dict):
    """transformers' ``ACT2FN``: a dict subclass whose ``__getitem__`` makes the module of the stored class."""

    def __getitem__(self, name):
        return super().__getitem__(name)()


_ACTIVATIONS = _ActivationsByName(silu=torch.nn.SiLU, gelu=torch.nn.GELU)


def _pick_an_activation_by_name(x: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's gated norm, Jamba's mixer: ``ACT2FN[config.hidden_act](x)`` inside the forward."""
    return _ACTIVATIONS["silu"](x) * _ACTIVATIONS["gelu"](x)


def _read_named_results(x: torch.Tensor) -> torch.Tensor:
    """An attention-sink softmax and an MoE router: ``x.max(dim=-1, keepdim=True).values``, ``torch.topk(...)
    .indices``, and the tuple uses that named results keep (indexing, unpacking). (thunder's own gradient of
    ``topk(...).values`` and ``max(x, dim).values`` reduced to a number fails: "expand: ...", with or without
    names.)"""
    shifted = x - x.max(dim=-1, keepdim=True).values
    top = torch.topk(shifted, 2, dim=-1)
    ordered, order = x.sort(dim=0)
    return shifted.exp() * 2 + top.indices.sum() + top[1].sum() + ordered * order + torch.max(x, 1).indices.sum()


def _grouped_query_attention(x: torch.Tensor) -> torch.Tensor:
    """Four query heads over two kv heads (transformers' SDPA without a mask)."""
    q, k, v = x.view(1, 4, 1, 3), x[:2].reshape(1, 2, 1, 3), x[2:].reshape(1, 2, 1, 3) * 2
    return torch.nn.functional.scaled_dot_product_attention(
        q.expand(1, 4, 5, 3), k.expand(1, 2, 5, 3), v.expand(1, 2, 5, 3), is_causal=True, enable_gqa=True
    )


def _embed_with_a_negative_padding_idx(x: torch.Tensor) -> torch.Tensor:
    """``padding_idx=-1``: the table's last row, whose gradient stays zero (thunder alone gave it one, silently)."""
    ids = torch.tensor([[0, 3, 1], [3, 2, 3]])
    return torch.nn.functional.embedding(ids, x, padding_idx=-1)


def _append_to_an_empty_cache(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``DynamicCache``: each layer starts from ``torch.tensor([])``."""
    return torch.cat([torch.tensor([], dtype=torch.float64), x.view(1, 4, 3)], dim=-2)


def _branch_on_a_read_number(x: torch.Tensor) -> torch.Tensor:
    """A branch on a number read from the data: thunder alone takes ``else`` on every call."""
    return x * 2 if x.sum().item() > 0 else x * 3


def _add_scaled_by_a_read_number(x: torch.Tensor) -> torch.Tensor:
    """``alpha`` read from the data: thunder alone adds (and subtracts) unscaled on every call, silently."""
    s = x.amax().item()
    return torch.add(x, x * 3, alpha=s) + torch.sub(x, x * 5, alpha=s) + x.clone().add_(x, alpha=s)


def _dropout_at_a_read_rate(x: torch.Tensor) -> torch.Tensor:
    """thunder's own dropout branches on its rate (``if p == 0``) while it traces."""
    return torch.nn.functional.dropout(x, p=x.amax().item() / 10)


def _meta_stride(x: torch.Tensor) -> torch.Tensor:
    meta = torch.empty((x.shape[0], 6), device="meta")
    return x * meta.stride()[0] + meta.shape[1]


_LINEAR = torch.nn.Linear(3, 2)


def _register_a_hook(x: torch.Tensor) -> torch.Tensor:
    _LINEAR.weight.register_post_accumulate_grad_hook(lambda p: None)
    return _LINEAR(x)


_SEQUENTIAL = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
_NAMES = ["0.weight", "0.bias", "1.weight", "1.bias"]  # eager's order


def _named_parameters(x: torch.Tensor) -> torch.Tensor:
    names = [name for name, _ in _SEQUENTIAL.named_parameters()]
    if names != _NAMES:
        raise AssertionError(f"named_parameters() in the order {names}")
    return x * len(names)


def test_named_parameters_in_the_module_order():
    x = torch.randn(4, 3)
    torch.testing.assert_close(thunder.jit(_named_parameters)(x), x * 4)

    def pairs(x: torch.Tensor) -> tuple:
        return tuple(_SEQUENTIAL.named_parameters(prefix="model")), tuple(_SEQUENTIAL.named_buffers())

    (jitted, _), (eager, _) = thunder.jit(pairs)(x), pairs(x)
    assert [name for name, _ in jitted] == [name for name, _ in eager]
    for (_, a), (_, b) in zip(jitted, eager):
        assert a.shape == b.shape


class _DropsItsBias(torch.nn.Linear):
    """transformers' rowwise style under no_grad: the bias is set to None inside the forward, and restored."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self._parameters["bias"]
        self._parameters["bias"] = None
        names = [name for name, _ in self.named_parameters()]
        out = super().forward(x) * len(names)
        self._parameters["bias"] = bias
        return out


def test_named_parameters_leave_out_a_parameter_the_program_set_to_none():
    module = _DropsItsBias(3, 2)
    x = torch.randn(4, 3)
    with torch.no_grad():
        torch.testing.assert_close(thunder.jit(module)(x), module(x))  # one name: weight
    assert module.bias is not None


def _scale_by_a_sum(x: torch.Tensor) -> torch.Tensor:
    """A CPU scalar tensor (a sum) times the tensor it came from: thunder alone gets its gradient wrong, silently."""
    return x.sum() * x + x / x.sum()


def _scale_by_the_top_values(x: torch.Tensor) -> torch.Tensor:
    """Hunyuan-V4's router: a sum of ``topk`` values scales the scores (thunder alone: "expand: ...")."""
    return torch.topk(x, 2)[0].sum() * x - x[:, :2].sum()


def _normalize_in_place(x: torch.Tensor) -> torch.Tensor:
    top, _ = torch.topk(x * 2, 2, dim=-1)
    top /= top.sum(-1, keepdim=True)  # (Mixtral's router)
    return top


def test_a_tensor_saved_for_the_backward_then_written_in_place():
    """The backward reads the value a tensor had when it was saved, not what a later in-place op wrote."""

    def scaled(x: torch.Tensor) -> torch.Tensor:
        v = x * 2
        v *= v.sum(-1, keepdim=True)
        return v

    for fn in (_normalize_in_place, scaled):
        assert_jit_matches_eager(fn, (4, 5))


def _scale_a_view_in_place(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[:, 1:].mul_(0.5)
    return y * 3


def _add_into_a_view(x: torch.Tensor) -> torch.Tensor:
    b = x[:, :2] * 4  # (an operand that requires grad)
    y = x.clone()
    y[:, 1:].add_(b)
    return y * 2


def test_writes_into_views_of_tensors_that_require_grad():
    """thunder 0.2.6 differentiates a write into a view as if the viewed tensor kept its old value: ``mul_``
    gives wrong gradients, and the tensor added into a view gets none (``_integration/functionalize.py``)."""
    for fn in (_scale_a_view_in_place, _add_into_a_view):
        assert_jit_matches_eager(fn, (4, 3))


_SWAPPED = torch.nn.Linear(3, 2)


def _swap_a_parameter_and_restore_it(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # (transformers' local-parameter inference path)
        original = _SWAPPED._parameters["weight"]
        _SWAPPED._parameters["weight"] = original * 2
        try:
            y = _SWAPPED(x)
        finally:
            _SWAPPED._parameters["weight"] = original
    return y


def test_a_parameter_swapped_and_restored_in_the_program():
    weight = _SWAPPED.weight
    x = torch.randn(4, 3)
    jitted = thunder.jit(_swap_a_parameter_and_restore_it)
    for _ in range(2):
        torch.testing.assert_close(jitted(x), _swap_a_parameter_and_restore_it(x))
        assert _SWAPPED.weight is weight


class _Scaling:
    factor = 3.0

    def name(self) -> str:  # (torch.distributed's ProcessGroup has a name() method too)
        return "scaling"


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scaling):
        ctx.factor = scaling.factor
        return x * scaling.factor

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


_SCALING = _Scaling()


def _custom_function_given_an_object(x: torch.Tensor) -> torch.Tensor:
    return _Scale.apply(x, _SCALING).sin()


def test_a_custom_function_given_an_object_with_a_name_method():
    assert_jit_matches_eager(_custom_function_given_an_object, (4, 3))


@torch.library.custom_op("thunder_dtensor_tests::scaled_rows", mutates_args=())
def _scaled_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * scale[:, None]


@_scaled_rows.register_fake
def _(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_rows_backward(ctx, g):
    x, scale = ctx.saved_tensors
    return g * scale[:, None], (g * x).sum(1)


_scaled_rows.register_autograd(
    _scaled_rows_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs)
)


def _call_a_custom_op(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.thunder_dtensor_tests.scaled_rows(x.sin(), scale=x[:, 0].exp()).cos()


def test_a_torch_custom_op_forward_and_backward():
    assert_jit_matches_eager(_call_a_custom_op, (4, 3))


_FLAGS: dict = {}


def _branch_on_requires_grad(x: torch.Tensor) -> torch.Tensor:
    h = x.view(-1)
    _FLAGS["view"] = h.requires_grad
    with torch.no_grad():
        _FLAGS["no_grad"] = (h * 2).requires_grad
    _FLAGS["argmax"] = h.argmax().requires_grad
    return h * 3 if h.requires_grad else h * 0  # (transformers' _AllReduceBackward.apply branches like this)


def test_requires_grad_of_computed_values():
    x = torch.randn(2, 3, requires_grad=True)
    out = thunder.jit(_branch_on_requires_grad)(x)
    assert _FLAGS == {"view": True, "no_grad": False, "argmax": False}
    torch.testing.assert_close(out, x.detach().view(-1) * 3)


def test_a_sequence_built_in_the_program():
    x = torch.randn(2, 3)
    torch.testing.assert_close(thunder.jit(_make_a_sequence)(x), _make_a_sequence(x))


def test_itertools_chain_over_tensors():
    x = torch.randn(2, 3)
    torch.testing.assert_close(thunder.jit(_chain_arguments)(x), _chain_arguments(x))


def test_an_attribute_set_then_reset_stays_reset():
    x = torch.randn(2, 3)
    jitted = thunder.jit(_set_then_reset)
    for _ in range(2):  # the second call runs the compiled program and its epilogue
        torch.testing.assert_close(jitted(x), x * 2)
        assert COLLECTOR.collected is None


def test_attributes_a_program_sets_on_an_object_are_all_kept():
    cache, eager_cache = _LazyCache(), _LazyCache()
    jitted = thunder.jit(_fill_a_lazy_cache)
    for _ in range(3):  # the first call allocates and sets; the next ones write into the cache's tensor
        x = torch.randn(4, 3)
        torch.testing.assert_close(jitted(x, cache), _fill_a_lazy_cache(x, eager_cache))
        assert (cache.ready, cache.length, cache.device) == (True, 4, torch.device("cpu"))
        torch.testing.assert_close(cache.keys, eager_cache.keys)
    assert thunder.cache_misses(jitted) == 2  # before and after the allocation


def test_a_slice_reaching_before_the_start_of_a_dim():
    assert_jit_matches_eager(_slice_longer_than_the_dim, (4, 3))


def test_a_python_type_as_a_tensor_dtype():
    assert_jit_matches_eager(_index_of_python_int_type, (4, 3))


def test_an_activation_picked_by_name_from_a_dict_subclass():
    assert_jit_matches_eager(_pick_an_activation_by_name, (4, 3))


def test_named_results_of_max_topk_and_sort_forward_and_backward():
    assert_jit_matches_eager(_read_named_results, (4, 3))


def test_a_program_returns_named_results_of_torchs_type():
    """The return statement of a program returning ``x.max(dim)`` printed its repr, which the type cannot be
    called with (``TypeError: structseq() missing required argument 'sequence'``)."""
    x = torch.randn(4, 3)
    for fn in (lambda t: t.max(1), lambda t: (torch.topk(t, 2, dim=0), t * 2), lambda t: {"s": t.sort(1)}):
        out, expected = thunder.jit(fn)(x), fn(x)
        torch.testing.assert_close(out, expected)
        assert type(out) is type(expected)


def test_grouped_query_attention_forward_and_backward():
    assert_jit_matches_eager(_grouped_query_attention, (4, 3))


def test_a_negative_padding_idx_counts_from_the_end_of_the_table():
    x, _ = assert_jit_matches_eager(_embed_with_a_negative_padding_idx, (4, 3))
    assert torch.count_nonzero(x.grad[3]) == 0
    ids = torch.tensor([[0, 3, 1]])
    before_the_start = thunder.jit(lambda i, w: torch.nn.functional.embedding(i, w, padding_idx=-5))
    for fn in (before_the_start, lambda i, w: torch.nn.functional.embedding(i, w, padding_idx=-5)):  # as torch
        with pytest.raises(AssertionError, match="Padding_idx must be within num_embeddings"):
            fn(ids, torch.randn(4, 3))


def test_cat_skips_an_empty_vector_as_torch_does():
    x = torch.randn(4, 3)
    out = thunder.jit(_append_to_an_empty_cache)(x)
    torch.testing.assert_close(out, _append_to_an_empty_cache(x))
    assert out.dtype == torch.float64  # the empty vector still takes part in type promotion


def test_stride_of_a_meta_tensor_made_in_the_program():
    x = torch.randn(4, 3)
    torch.testing.assert_close(thunder.jit(_meta_stride)(x), _meta_stride(x))


def test_gradient_hooks_registered_in_the_program_fire_with_eager_gradients():
    """``register_post_accumulate_grad_hook`` on a parameter and ``register_hook`` on an input, inside the
    program, as transformers' tensor parallelism does on its first forward (guarded, so once): the hooks are
    registered on the real tensors and fire in the backward with eager's gradients."""

    def run(jit: bool) -> tuple[list, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        linear = torch.nn.Linear(3, 2)
        x = torch.randn(4, 3, requires_grad=True)
        seen: list = []
        hooked: dict = {}

        def fn(x: torch.Tensor) -> torch.Tensor:
            if not hooked:  # as transformers guards it
                linear.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
                x.register_hook(lambda g: g * 2)
                hooked["done"] = True
            return linear(x).square().sum()

        run_fn = thunder.jit(fn) if jit else fn
        for _ in range(2):
            run_fn(x).backward()
        return seen, x.grad, linear.weight.grad

    (seen, x_grad, w_grad), (seen_eager, x_grad_eager, w_grad_eager) = run(True), run(False)
    assert len(seen) == len(seen_eager) == 2
    for a, b in zip(seen, seen_eager):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(x_grad, x_grad_eager)
    torch.testing.assert_close(w_grad, w_grad_eager)


_UNPATCHED = """
import json, sys
sys.path.insert(0, {here!r})
import thunder_dtensor, thunder, torch
import test_thunder_fixes_for_models as t
errors = {{}}
for name in (
    "_make_a_sequence", "_set_then_reset", "_meta_stride", "_register_a_hook", "_named_parameters",
    "_swap_a_parameter_and_restore_it", "_custom_function_given_an_object", "_call_a_custom_op", "_chain_arguments",
    "_append_to_an_empty_cache", "_slice_longer_than_the_dim", "_index_of_python_int_type",
    "_grouped_query_attention", "_read_named_results", "_pick_an_activation_by_name",
):
    try:
        thunder.jit(getattr(t, name))(torch.randn(4, 3))
        errors[name] = None
    except Exception as e:
        errors[name] = f"{{type(e).__name__}}: {{e}}"
cache = t._LazyCache()
filled = thunder.jit(t._fill_a_lazy_cache)
filled(torch.ones(4, 3), cache)
errors["_fill_a_lazy_cache"] = "kept" if cache.ready else "lost"
torch.manual_seed(0)
x = torch.randn(4, 5, requires_grad=True)
x2 = x.detach().clone().requires_grad_()
thunder.jit(t._normalize_in_place)(x).sum().backward()
t._normalize_in_place(x2).sum().backward()
errors["_normalize_in_place"] = (x.grad - x2.grad).abs().max().item()
x = torch.randn(4, 5, requires_grad=True)
x2 = x.detach().clone().requires_grad_()
thunder.jit(t._scale_by_a_sum)(x).sum().backward()
t._scale_by_a_sum(x2).sum().backward()
errors["_scale_by_a_sum"] = (x.grad - x2.grad).abs().max().item()
try:
    thunder.jit(t._scale_by_the_top_values)(torch.randn(4, 5, requires_grad=True)).sum().backward()
    errors["_scale_by_the_top_values"] = None
except Exception as e:
    errors["_scale_by_the_top_values"] = f"{{type(e).__name__}}: {{e}}"
for name in ("_scale_a_view_in_place", "_add_into_a_view", "_embed_with_a_negative_padding_idx"):
    x = torch.randn(4, 3, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    thunder.jit(getattr(t, name))(x).sum().backward()
    getattr(t, name)(x2).sum().backward()
    errors[name] = (x.grad - x2.grad).abs().max().item()
x = torch.rand(4, 3) + 0.5
scaled = t._add_scaled_by_a_read_number
errors["_add_scaled_by_a_read_number"] = (thunder.jit(scaled)(x) - scaled(x)).abs().max().item()
x = torch.randn(2, 3, requires_grad=True)
zero = torch.equal(thunder.jit(t._branch_on_requires_grad)(x), x.detach().view(-1) * 0)
errors["_branch_on_requires_grad"] = "no-grad branch taken" if zero else "eager's branch"
print(json.dumps(errors))
"""


def test_each_program_fails_on_thunder_without_the_fixes():
    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, "-c", _UNPATCHED.format(here=here)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "THUNDER_DTENSOR_THUNDER_FIXES": "0", "PYTHONHASHSEED": "0"},  # (a set's order)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert "object has no attribute '_count'" in errors["_make_a_sequence"]
    assert "KeyError: None" in errors["_chain_arguments"]
    assert "Expected dimension in inclusive range of -1 and 0: got -2" in errors["_append_to_an_empty_cache"]
    assert "start=-7 is not a valid index for length 4" in errors["_slice_longer_than_the_dim"]
    assert "<class 'int'> had an unexpected type" in errors["_index_of_python_int_type"]
    assert "unexpected keyword argument 'enable_gqa'" in errors["_grouped_query_attention"]
    assert errors["_read_named_results"] == "AttributeError: values"
    assert "missing 1 required positional argument" in errors["_pick_an_activation_by_name"]
    assert errors["_fill_a_lazy_cache"] == "lost"  # silently: keys, length and ready were not written back
    assert errors["_add_scaled_by_a_read_number"] > 0.1  # silently: alpha taken as 1
    assert "trying to set .collected" in errors["_set_then_reset"]
    assert "Unknown attribute stride" in errors["_meta_stride"]
    assert "Unknown attribute register_post_accumulate_grad_hook" in errors["_register_a_hook"]
    assert "named_parameters() in the order" in errors["_named_parameters"]
    assert errors["_normalize_in_place"] > 1e-3  # a wrong gradient, silently
    assert errors["_scale_by_a_sum"] > 1e-2  # a wrong gradient, silently
    assert "expand: attempting to expand a dimension of length 5" in errors["_scale_by_the_top_values"]
    assert errors["_scale_a_view_in_place"] > 1.0  # 3 where eager's is 1.5
    assert errors["_add_into_a_view"] > 1.0  # b's gradient (8 per element) lost
    assert errors["_embed_with_a_negative_padding_idx"] > 1.0  # the padding row's gradient (3), silently
    # (torch >= 2.14: thunder fails earlier, at any custom Function without the builtin-apply fix)
    custom_function = (
        "KeyError: None" if _integration.FUNCTION_APPLY_IS_BUILTIN else "expected str instance, method found"
    )
    assert custom_function in errors["_custom_function_given_an_object"]
    assert "scaled_rows is not registered" in errors["_call_a_custom_op"]
    assert errors["_branch_on_requires_grad"] == "no-grad branch taken"  # eager takes the other
    assert (
        "_parameters" in errors["_swap_a_parameter_and_restore_it"]
        and "not supported" in errors["_swap_a_parameter_and_restore_it"]
    )
