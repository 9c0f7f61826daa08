"""Each fix to thunder acts where its switch says: by default within DTensor programs only, so a plain program
compiles as thunder alone compiles it (thunder's failure included); switched on everywhere, the same program
works; switched off, thunder's behaviour again. The reproducers are the smallest plain-thunder ones
(``test_thunder_fixes_for_models``)."""

import re
import traceback

from thunder_dtensor import _integration, fixes
from thunder_dtensor.errors import DataDependentValueError

import pytest
import test_thunder_fixes_for_models as reproducers
import thunder
import torch

#: fix -> (its plain-thunder reproducer, what thunder 0.2.6 alone raises on it)
FAILING_WITHOUT = {
    "give_meta_tensors_a_stride": (reproducers._meta_stride, "Unknown attribute stride"),
    "register_gradient_hooks_on_real_tensors": (
        reproducers._register_a_hook,
        "Unknown attribute register_post_accumulate_grad_hook",
    ),
    "tolerate_sequences_that_cannot_be_iterated": (reproducers._make_a_sequence, "object has no attribute '_count'"),
    "interpret_itertools_chain": (reproducers._chain_arguments, "KeyError: None"),
    "replay_the_state_the_program_leaves": (reproducers._set_then_reset, "trying to set .collected"),
    "run_torch_custom_ops": (reproducers._call_a_custom_op, "scaled_rows is not registered"),
    "clamp_slices_as_torch_does": (reproducers._slice_longer_than_the_dim, "start=-7 is not a valid index"),
    "take_python_types_as_tensor_dtypes": (reproducers._index_of_python_int_type, "had an unexpected type"),
    "take_grouped_query_attention_in_sdpa": (reproducers._grouped_query_attention, "unexpected keyword argument"),
    "skip_empty_vectors_in_cat": (reproducers._append_to_an_empty_cache, "Expected dimension in inclusive range"),
    "name_the_fields_of_paired_results": (reproducers._read_named_results, "values"),
    "read_dict_items_past_an_overriding_getitem": (reproducers._pick_an_activation_by_name, "missing 1 required"),
}
if not _integration.FUNCTION_APPLY_IS_BUILTIN:  # (torch >= 2.14 fails earlier, at any custom Function)
    FAILING_WITHOUT["name_opaque_arguments_of_traced_functions"] = (
        reproducers._custom_function_given_an_object,
        "expected str instance, method found",
    )


@pytest.mark.parametrize("name", sorted(FAILING_WITHOUT))
def test_a_fix_acts_on_plain_programs_only_when_switched_on_everywhere(name):
    program, thunders_error = FAILING_WITHOUT[name]
    assert fixes.mode(name) == fixes.IN_DTENSOR_PROGRAMS
    with pytest.raises(Exception, match=re.escape(thunders_error)):  # a plain program: thunder's own failure
        thunder.jit(program)(torch.randn(4, 3))
    with fixes.enabled(name, everywhere=True):
        torch.testing.assert_close(thunder.jit(program)(torch.randn(4, 3) * 0 + 1), program(torch.ones(4, 3)))
    with fixes.enabled("all", everywhere=True), fixes.disabled(name):  # only this one off: thunder's failure
        with pytest.raises(Exception, match=re.escape(thunders_error)):
            thunder.jit(program)(torch.randn(4, 3))


def test_a_silently_wrong_gradient_is_fixed_only_where_switched_on():
    """``v /= v.sum()`` after ``v`` was saved: thunder alone gives a wrong gradient, silently."""
    torch.manual_seed(0)
    x = torch.randn(4, 5)

    def gradient() -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        thunder.jit(reproducers._normalize_in_place)(leaf).sum().backward()
        return leaf.grad

    leaf = x.clone().requires_grad_()
    reproducers._normalize_in_place(leaf).sum().backward()
    assert (gradient() - leaf.grad).abs().max() > 1e-3  # plain program: thunder's gradient
    with fixes.enabled("keep_saved_tensors_from_in_place_writes", everywhere=True):
        torch.testing.assert_close(gradient(), leaf.grad)


def test_the_gradient_of_a_broadcast_cpu_scalar_is_summed_only_where_switched_on():
    """``x.sum() * x``: thunder alone gives the scalar a gradient of ``x``'s shape, which nothing sums (a wrong
    gradient, silently); with the fix, torch's gradient. ``topk(x, 2)[0].sum() * x``: thunder alone fails."""
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    name = "sum_the_gradients_of_broadcast_cpu_scalars"

    def gradient(fn, jit: bool) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        (thunder.jit(fn) if jit else fn)(leaf).sum().backward()
        return leaf.grad

    expected = gradient(reproducers._scale_by_a_sum, jit=False)
    assert (gradient(reproducers._scale_by_a_sum, jit=True) - expected).abs().max() > 1e-2  # plain: thunder's
    with pytest.raises(RuntimeError, match="expand: attempting to expand a dimension"):
        gradient(reproducers._scale_by_the_top_values, jit=True)
    with fixes.enabled(name, everywhere=True):
        torch.testing.assert_close(gradient(reproducers._scale_by_a_sum, jit=True), expected)
        top = reproducers._scale_by_the_top_values
        torch.testing.assert_close(gradient(top, jit=True), gradient(top, jit=False))
        # a scalar of another dtype: its gradient comes back in its own dtype
        half = x.to(torch.bfloat16)
        scale = torch.tensor(0.5, requires_grad=True)
        thunder.jit(lambda h, s: (h * s).float().sum())(half, scale).backward()
        assert scale.grad.dtype == torch.float32 and scale.grad.shape == ()
        torch.testing.assert_close(scale.grad, half.float().sum(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("program", [reproducers._scale_a_view_in_place, reproducers._add_into_a_view])
def test_writes_into_views_get_eager_gradients_only_where_switched_on(program):
    """A write into a view of a tensor that requires grad: thunder alone gives wrong gradients, silently."""
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    name = "functionalize_writes_into_views_that_require_grad"

    def gradient(fn) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        fn(leaf).sum().backward()
        return leaf.grad

    eager = gradient(program)
    assert (gradient(thunder.jit(program)) - eager).abs().max() > 1.0  # plain program: thunder's gradient
    with fixes.enabled(name, everywhere=True):
        torch.testing.assert_close(gradient(thunder.jit(program)), eager)
    with fixes.enabled("all", everywhere=True), fixes.disabled(name):  # only this one off: thunder's gradient
        assert (gradient(thunder.jit(program)) - eager).abs().max() > 1.0


def test_a_silently_lost_attribute_write_is_fixed_only_where_switched_on():
    """A lazily allocated cache: thunder alone writes back only the first attribute the program sets."""

    def ready_after_a_call() -> bool:
        cache = reproducers._LazyCache()
        thunder.jit(reproducers._fill_a_lazy_cache)(torch.ones(4, 3), cache)
        return cache.ready

    assert not ready_after_a_call()  # plain program: thunder's behaviour
    with fixes.enabled("replay_the_state_the_program_leaves", everywhere=True):
        assert ready_after_a_call()


def test_a_silent_branch_on_a_run_time_number_is_refused_only_where_switched_on():
    """``if x.sum().item() > 0:``: thunder alone takes the comparison of a number without a value as False."""
    program = reproducers._branch_on_a_read_number
    x = torch.ones(4, 3)
    torch.testing.assert_close(thunder.jit(program)(x), x * 3)  # plain program: thunder's else branch, silently
    assert torch.equal(program(x), x * 2)
    with fixes.enabled("refuse_branches_on_run_time_numbers", everywhere=True):
        with pytest.raises(DataDependentValueError, match="a trace cannot take a branch on it"):
            thunder.jit(program)(x)


def test_an_alpha_read_from_the_data_scales_only_where_switched_on():
    """``torch.add(x, y, alpha=x.amax().item())``: thunder alone takes the unknown alpha as 1, silently."""
    program = reproducers._add_scaled_by_a_read_number
    x = torch.rand(4, 3) + 0.5
    s = x.amax().item()
    unscaled = (x + x * 3) + (x - x * 5) + (x + x)
    torch.testing.assert_close(thunder.jit(program)(x), unscaled)  # plain program: thunder's behaviour
    with fixes.enabled("scale_by_run_time_alphas", everywhere=True):
        torch.testing.assert_close(thunder.jit(program)(x), program(x))
        torch.testing.assert_close(program(x), (x + s * x * 3) + (x - s * x * 5) + (x + s * x))


def test_a_branch_of_thunders_own_on_a_run_time_number_is_refused_naming_the_op():
    """thunder's ``dropout`` compares its rate with 0 in Python: with a rate read from the data (no value while
    it traces) that comparison is a guess; switched on, it is refused, naming thunder's function."""
    with fixes.enabled("refuse_branches_on_run_time_numbers", everywhere=True):
        with pytest.raises(DataDependentValueError, match=r"thunder's thunder\.torch\.dropout"):
            thunder.jit(reproducers._dropout_at_a_read_rate)(torch.rand(4, 3))


def _fails_inside(x):
    raise ValueError("raised inside the jitted program")


def _calls_a_failing_function(x):
    return _fails_inside(x) + 1


def test_stand_in_frames_of_exceptions_read_as_thunders():
    """``make_exception_frames_without_a_busy_wait``: the traceback of an exception raised inside a jitted
    program names the same functions, files and lines as with thunder's own frames, call after call (one
    stand-in frame per place is kept)."""

    def where_it_raised() -> list[tuple[str, str, int | None]]:
        with pytest.raises(ValueError, match="raised inside the jitted program") as raised:
            thunder.jit(_calls_a_failing_function)(torch.ones(2))
        return [(f.name, f.filename, f.lineno) for f in traceback.extract_tb(raised.value.__traceback__)]

    thunders = where_it_raised()  # a plain program: thunder's own frames
    with fixes.enabled("make_exception_frames_without_a_busy_wait", everywhere=True):
        ours, again = where_it_raised(), where_it_raised()
    assert ours == thunders == again
    lines = {name: line for name, _, line in ours}
    assert lines["_fails_inside"] == _fails_inside.__code__.co_firstlineno + 1
    assert lines["_calls_a_failing_function"] == _calls_a_failing_function.__code__.co_firstlineno + 1


@torch.library.custom_op("thunder_dtensor_tests::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_twice.register_fake(torch.empty_like)
_twice.register_autograd(lambda ctx, grad: grad * 2)


def _add_into_a_split_out_result(x, b):
    out = torch.ops.thunder_dtensor_tests.twice(x)  # no thunder mapping: thunderfx runs it in torch
    out.add_(b)  # so the thunder region after it takes `out` as an input and writes into it
    return (out * out).sum()


def _write_after_a_graph_break(x, b):
    out = torch.zeros_like(x)  # made by the graph before the break: an input of the graph after it
    torch._dynamo.graph_break()
    out += x * b  # (``operator.iadd``)
    out[0] = x[1] * 3  # (``operator.setitem``)
    torch._dynamo.graph_break()  # the next graph reads `out` as the write left it
    return (out * out).sum() + x.sum()


def _copy_into_a_view_of_a_split_out_result(x, b):
    out = torch.ops.thunder_dtensor_tests.twice(x)
    out[:, :2].copy_(b[:2].expand(3, 2))  # (DeepSeek's MLA: key_states[..., :d].copy_(k_nope)); the view goes too
    return (out * out).sum()


@pytest.mark.parametrize(
    "program", [_add_into_a_split_out_result, _write_after_a_graph_break, _copy_into_a_view_of_a_split_out_result]
)
def test_a_write_into_a_thunderfx_region_input_is_run_in_torch_only_where_switched_on(program):
    """``run_writes_into_graph_inputs_in_torch``: a thunder region writes in place into one of its inputs (the
    result of a custom op thunderfx runs in torch; a tensor made before a graph break); thunder's region cannot
    give that input the write's autograd history, so the gradients miss the write, silently (Hugging Face's
    GPT-OSS experts; here ``b`` gets none). With the fix the write runs in torch. ``thunderfx_graphs`` (the
    DTensor programs' splitter, switched on everywhere) lets plain thunderfx split these graphs at all (thunder
    0.2.6 alone fails on them: ``object of type 'MappingKeysView' has no len()``)."""
    from thunder.dynamo import thunderfx

    x, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    expected = torch.autograd.grad(program(x, b), (x, b))

    def gradients(*names: str) -> tuple[torch.Tensor, ...]:
        torch._dynamo.reset()
        with fixes.enabled("thunderfx_graphs", *names, everywhere=True):
            return torch.autograd.grad(thunderfx(program)(x, b), (x, b), allow_unused=True)

    try:
        lost = [g is None or not torch.allclose(g, e) for g, e in zip(gradients(), expected)]
    except RuntimeError:  # or torch refuses what thunder's region handed it (a leaf written in place, ...)
        lost = [True]
    assert any(lost), "thunder alone no longer gets this write wrong"
    for actual, wanted in zip(gradients("run_writes_into_graph_inputs_in_torch"), expected):
        torch.testing.assert_close(actual, wanted)


class _ScaledProduct(torch.autograd.Function):
    """Two outputs, a saved tensor pair and a number kept on the context."""

    @staticmethod
    def forward(ctx, x, w, scale):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return x * w * scale, x + 1

    @staticmethod
    def backward(ctx, grad, grad_shifted):
        x, w = ctx.saved_tensors
        return grad * w * ctx.scale + grad_shifted, (grad * x).sum(0) * ctx.scale, None


class _DoubledWithArgmax(torch.autograd.Function):
    """A lone differentiable output beside a non-differentiable one."""

    @staticmethod
    def forward(ctx, x):
        index = x.argmax(-1)
        ctx.mark_non_differentiable(index)
        return x * 2, index

    @staticmethod
    def backward(ctx, grad, grad_index):
        return grad * 2


def _custom_functions(x, w):
    product, shifted = _ScaledProduct.apply(x.sin(), w, 0.5)
    doubled, index = _DoubledWithArgmax.apply(product)
    return (product * 3).sum() + (shifted * shifted).sum() + doubled.sum() + index.sum()


def test_custom_autograd_functions_in_dynamo_graphs_only_where_switched_on():
    """``take_autograd_function_apply_without_a_tensor_mask``: torch 2.13's dynamo records a custom Function in
    a form thunder 0.2.6 does not read (``KeyError: 'args_tensor_mask'``); with the fix, values and gradients are
    eager's (several outputs, saved tensors, a number on the context, a non-differentiable output)."""
    from thunder.dynamo import thunderfx

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    expected = _custom_functions(x, w)
    expected_grads = torch.autograd.grad(expected, (x, w))

    def run(*names: str) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        torch._dynamo.reset()
        with fixes.enabled("thunderfx_graphs", *names, everywhere=True):
            out = thunderfx(_custom_functions)(x, w)
            return out, torch.autograd.grad(out, (x, w))

    with pytest.raises(Exception, match="args_tensor_mask"):
        run()
    out, grads = run("take_autograd_function_apply_without_a_tensor_mask")
    torch.testing.assert_close(out, expected)
    for actual, wanted in zip(grads, expected_grads):
        torch.testing.assert_close(actual, wanted)


def test_switches_name_their_fixes():
    listing = fixes.listing()
    assert {kind for kind, _, _ in listing.values()} == {"dtensor", "thunder-fix", "speedup"}
    with pytest.raises(ValueError, match="unknown fixes"):
        fixes.enable("no_such_fix")
    with pytest.raises(ValueError, match="needed by DTensor programs"):
        fixes.disable("thunderfx_graphs")
    with fixes.enabled("keep_named_members_in_order", everywhere=True):
        assert fixes.mode("keep_named_members_in_order") == fixes.EVERYWHERE
        with fixes.disabled("keep_named_members_in_order"):
            assert not fixes.active("keep_named_members_in_order")
    assert fixes.mode("keep_named_members_in_order") == fixes.IN_DTENSOR_PROGRAMS
    assert not fixes.active("keep_named_members_in_order")  # no program is being compiled


def test_the_cpu_kernels_executor_goes_first_among_thunders_defaults_only():
    """Where its fix acts, ``cpu_eager_kernels`` joins a program's list just before thunder's default executors
    (after thunder.jit's ad hoc one, or a user's own executors put before the defaults; before thunder's
    torch.compile executor where that is one of them), and a list without the defaults stays the user's;
    thunder's default executors themselves never change."""
    from thunder.extend import get_default_executors, get_executor

    defaults = list(get_default_executors())
    assert "cpu_eager_kernels" not in [e.name for e in defaults]

    def names(executors):
        jitted = thunder.jit(lambda x: torch.nn.functional.gelu(x), executors=executors)
        torch.testing.assert_close(jitted(torch.ones(3)), torch.nn.functional.gelu(torch.ones(3)))
        return [e.name for e in thunder.compile_data(jitted).executors_list if not e.name.startswith("__ad_hoc")]

    default_names = [e.name for e in defaults]
    assert "cpu_eager_kernels" not in names(None)  # a plain program, the fix in its default mode
    with fixes.enabled("run_cpu_ops_with_torch_kernels", everywhere=True):
        assert names(None)[: len(defaults) + 1] == ["cpu_eager_kernels", *default_names]
        python = get_executor("python")
        assert names([python, *defaults])[: len(defaults) + 2] == ["python", "cpu_eager_kernels", *default_names]
        # thunder's torch.compile executor fuses every op it claims with: it goes just before it
        from thunder.executors.torch_compile import torch_compile_ex

        fused = names([torch_compile_ex, *defaults])
        assert fused[: len(defaults) + 2] == ["cpu_eager_kernels", torch_compile_ex.name, *default_names]
        assert "cpu_eager_kernels" not in names([get_executor("torch")])
