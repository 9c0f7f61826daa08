"""Writes into views of tensors that require grad (``functionalize_writes_into_views_that_require_grad``, on
everywhere here): values, every input's gradient and the inputs written at run time are eager's."""

from collections.abc import Callable

import thunder_dtensor  # noqa: F401  (first: makes thunder importable on torch >= 2.13)
from thunder_dtensor.testing.models import writes_that_overlap

import pytest
import thunder
import torch

#: views to write through, on a (4, 6) value: name -> the view of ``y``
VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "slice": lambda y: y[:, 1:4],
    "narrow": lambda y: y.narrow(0, 1, 2),
    "select": lambda y: y.select(1, 2),
    "index": lambda y: y[2],
    "view": lambda y: y.view(2, 12),
    "transpose": lambda y: y.transpose(0, 1),
    "unflatten": lambda y: y.unflatten(1, (2, 3)),
    "diagonal": lambda y: y.diagonal(1),
    "slice_of_transpose": lambda y: y.t()[1:, ::2],
    "select_of_unflatten": lambda y: y.unflatten(1, (3, 2))[:, 1],
}

#: in-place writes into a view ``v``, given an operand ``b`` that requires grad (shaped like the view)
WRITES: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "mul_": lambda v, b: v.mul_(b),
    "mul_number": lambda v, b: v.mul_(0.5),
    "add_": lambda v, b: v.add_(b, alpha=2.0),
    "copy_": lambda v, b: v.copy_(b),
    "masked_fill_": lambda v, b: v.masked_fill_(b.detach() > 0, 0.25),
    "index_put_": lambda v, b: v.index_put_((torch.tensor([0, 1]),), b.detach()[0] * 3),
    "setitem": lambda v, b: v.__setitem__(..., b * 3),
}


def _program(view: Callable, write: Callable) -> Callable:
    def program(x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        before = y[1:, :2]  # a view taken before the write, read after it
        v = view(y)
        write(v, b)
        return y * 3, v * v, before + 1

    return program


def _compare(program: Callable, *inputs: torch.Tensor) -> None:
    """Outputs and every input's gradient (for one random cotangent per output) under thunder.jit and eager."""
    ours = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    eager = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out, expected = thunder.jit(program)(*ours), program(*eager)
    cotangents = [torch.randn_like(e) for e in expected]
    for a, e in zip(out, expected):
        torch.testing.assert_close(a, e)
    differentiable = [i for i, t in enumerate(inputs) if t.requires_grad]
    got = torch.autograd.grad(out, [ours[i] for i in differentiable], cotangents, allow_unused=True)
    wanted = torch.autograd.grad(expected, [eager[i] for i in differentiable], cotangents, allow_unused=True)
    for i, a, e in zip(differentiable, got, wanted):
        # (no gradient and a gradient of zeros are the same gradient: an input the writes overwrite entirely)
        a = torch.zeros_like(inputs[i]) if a is None else a
        e = torch.zeros_like(inputs[i]) if e is None else e
        torch.testing.assert_close(a, e, msg=lambda m, i=i: f"input {i}'s gradient: {m}")


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("view", VIEWS)
def test_a_write_into_a_view_has_eager_values_and_gradients(view, write):
    torch.manual_seed(0)
    shape = VIEWS[view](torch.empty(4, 6)).shape
    _compare(
        _program(VIEWS[view], WRITES[write]),
        torch.randn(4, 6, requires_grad=True),
        torch.randn(shape, requires_grad=True),
    )


def test_writes_that_overlap_and_a_write_into_the_viewed_tensor():
    torch.manual_seed(1)
    _compare(
        writes_that_overlap,
        torch.randn(4, 6, requires_grad=True),
        torch.randn(2, 6, requires_grad=True),
    )


def _write_into_an_input(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    x[:, 1:].mul_(b)
    return x * 2


def test_an_input_written_through_a_view_is_written_at_run_time():
    """``x`` needs no grad, ``b`` does: ``x`` is updated in place as in eager, ``b`` gets eager's gradient."""
    torch.manual_seed(2)
    x, b = torch.randn(3, 4), torch.randn(3, 3, requires_grad=True)
    ours, eager = x.clone(), x.clone()
    b2 = b.detach().clone().requires_grad_()
    out, expected = thunder.jit(_write_into_an_input)(ours, b), _write_into_an_input(eager, b2)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(ours, eager)  # the caller's tensor
    assert not torch.equal(ours, x)
    g = torch.randn_like(out)
    out.backward(g)
    expected.backward(g)
    torch.testing.assert_close(b.grad, b2.grad)


def _write_without_grad(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    with torch.no_grad():
        y[:, 1:].mul_(0.5)
    return y * 3  # (not y itself: thunder 0.2.6 returns a tensor written through a view as it was)


def test_a_write_under_no_grad_keeps_thunders_in_place_form():
    x = torch.randn(3, 4, requires_grad=True)
    jitted = thunder.jit(_write_without_grad)
    torch.testing.assert_close(jitted(x), _write_without_grad(x))
    names = {b.sym.name for b in thunder.last_traces(jitted)[-1].bound_symbols}
    assert "slice_scatter" not in names, names
    written = {b.sym.name for b in thunder.last_traces(jitted)[0].bound_symbols}
    assert "mul_" in written, written


def _write_into_a_detached_view(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y.detach()[:, 1:].mul_(0.5)  # the values change; autograd does not see the write
    return y * 3


def test_a_write_into_a_detached_view_changes_values_not_gradients():
    torch.manual_seed(3)
    x = torch.randn(3, 4, requires_grad=True)
    _compare(lambda x: (_write_into_a_detached_view(x),), x)


def test_a_write_into_a_view_under_thunderfx():
    from thunder.dynamo import thunderfx

    torch.manual_seed(4)
    program = _program(VIEWS["slice"], WRITES["add_"])
    x, b = torch.randn(4, 6, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out, expected = thunderfx(program)(x, b), program(x2, b2)
    cotangents = [torch.randn_like(e) for e in expected]
    for a, e in zip(out, expected):
        torch.testing.assert_close(a, e)
    got = torch.autograd.grad(out, (x, b), cotangents)
    for a, e in zip(got, torch.autograd.grad(expected, (x2, b2), cotangents)):
        torch.testing.assert_close(a, e)


def _write_into_a_view_of_what_an_earlier_write_made_require_grad(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = x.clone()  # needs no grad, until ...
    y.mul_(b)  # ... an in-place op with an operand that does
    y[:, 1:].mul_(0.5)
    return y * 3


def test_a_tensor_requires_grad_after_an_in_place_op_with_an_operand_that_does():
    torch.manual_seed(5)
    program = _write_into_a_view_of_what_an_earlier_write_made_require_grad
    _compare(lambda x, b: (program(x, b),), torch.randn(3, 4), torch.randn(3, 4, requires_grad=True))
