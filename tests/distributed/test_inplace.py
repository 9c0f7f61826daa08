"""In-place ops on DTensors: values, placements, collectives and gradients as eager DTensor's.

Intermediates go through ``run_case`` (plain torch on full tensors for values and gradients, eager DTensor for
placements and collectives). In-place ops on inputs are checked on the caller's DTensors: after the jitted
call they hold what plain torch computes, in eager DTensor's placements.
"""

from collections.abc import Callable, Sequence

from thunder_dtensor import DTensorOpError, DTensorProxy, dtensor_ex
from thunder_dtensor.testing import (
    COMMS_ASSERTED,
    DTensorCase,
    assert_matches_full,
    make_full,
    mesh_1d,
    run_case,
)
from thunder_dtensor.testing.models import writes_that_overlap

import pytest
import thunder
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

S0, S1, R = [Shard(0)], [Shard(1)], [Replicate()]


# ---------------------------------------------------------------------------------------------------------
# In-place ops on intermediates, forward and backward
# ---------------------------------------------------------------------------------------------------------
def add_(x, w):
    y = x * 2
    y.add_(w, alpha=0.5)
    return y * 3


def sub_scalar_(x, w):
    y = x * w
    y.sub_(1.5)
    return y * x


def mul_(x, w):
    y = x * 2
    y.mul_(w)  # mul_'s gradient reads y's old value, which the write overwrites
    return y * x


def div_(x, w):
    y = x + 1
    y.div_(w + 2)
    return y


def chain_(x, w):
    y = x * 2
    y.mul_(w).add_(1).clamp_(max=1.5)
    return y


def clamp_(x, w):
    y = x * w
    y.clamp_(min=-0.2, max=0.3)
    return y * x


def relu_variants(x, w):
    a, b, c = x * w, x + w, x - w
    F.relu(a, inplace=True)
    torch.relu_(b)
    c.relu_()
    return a + b * 2 + c * 3


def zero_and_fill_(x, w):
    y, z = x * w, x + w
    y.zero_()
    z.fill_(0.5)
    return y + z * x + w


def copy_(x, w):
    y = x * 2
    y.copy_(w[0].double())  # broadcast and converted: the gradient is reduced and cast back
    return y * x


INTERMEDIATES = {
    "add_": (add_, S0, S1),  # w redistributed to y's placements, as eager does
    "sub_scalar_": (sub_scalar_, S1, S1),
    "mul_": (mul_, S0, R),
    "div_": (div_, R, S0),
    "chain_": (chain_, S1, S0),
    "clamp_": (clamp_, S0, S0),
    "relu_variants": (relu_variants, S1, R),
    "zero_and_fill_": (zero_and_fill_, S0, R),
    "copy_": (copy_, S0, R),
}


@pytest.mark.parametrize("name", INTERMEDIATES)
def test_inplace_on_intermediates_matches_eager(name):
    fn, px, pw = INTERMEDIATES[name]
    x, w = make_full((4, 6), seed=0), make_full((4, 6), seed=1)
    run_case(DTensorCase(fn, [x, w], [px, pw]), assert_comms=COMMS_ASSERTED, label=f"inplace {name}")


def setitem_cols(x, w):
    y = x * 2
    y[:, 1:3] = w[:, :2] * 3
    return y * x


def setitem_rows(x, w):
    y = x * 2
    y[1:3] = w[:2] * 3
    return y * x


@pytest.mark.parametrize("fn, px, pw", [(setitem_cols, S0, S0), (setitem_rows, S1, R)], ids=["S0-cols", "S1-rows"])
def test_setitem_on_a_dim_that_is_not_sharded(fn, px, pw):
    x, w = make_full((4, 6), seed=2), make_full((4, 6), seed=3)
    run_case(DTensorCase(fn, [x, w], [px, pw]), assert_comms=COMMS_ASSERTED, label=f"setitem {fn.__name__}")


class ScaledReLU(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(x * 2) * x


def test_nn_relu_inplace_module():
    # not run_case: its CommDebugMode's module tracker wraps module outputs in a hook function, and eager
    # rejects writing into those in place
    module, full, cotangent = ScaledReLU(), make_full((4, 6), seed=4), make_full((4, 6), seed=5)
    plain = full.clone().requires_grad_()
    module(plain).backward(cotangent)
    eager, x = _distribute([full, full], [S1, S1], [True, True])
    eager_out, out = module(eager), thunder.jit(module)(x)
    assert_matches_full(out, module(full), what="output")
    assert out.placements == eager_out.placements
    eager_out.backward(distribute_tensor(cotangent, mesh_1d(), S1))
    out.backward(distribute_tensor(cotangent, mesh_1d(), S1))
    assert_matches_full(x.grad, plain.grad, what="grad")
    assert x.grad.placements == eager.grad.placements


# ---------------------------------------------------------------------------------------------------------
# Writes into views of DTensors that require grad: made functional, with eager's values and gradients
# ---------------------------------------------------------------------------------------------------------
#: views of a (4, 6) value, each with placements of the value under which DTensor keeps the view sharded (a view
#: DTensor computes on gathered data is a copy: writes into it are refused, ``test_fuzz_regressions.py``)
VIEWS = {
    "slice": (lambda y: y[:, 1:4], S0),
    "narrow": (lambda y: y.narrow(0, 1, 2), S1),
    "select": (lambda y: y.select(1, 2), S0),
    "index": (lambda y: y[2], S1),
    "view": (lambda y: y.view(2, 12), S0),
    "transpose": (lambda y: y.transpose(0, 1), S0),
    "unflatten": (lambda y: y.unflatten(1, (2, 3)), S0),
    "diagonal": (lambda y: y.diagonal(1), R),
    "slice_of_transpose": (lambda y: y.t()[1:], S0),
    "select_of_unflatten": (lambda y: y.unflatten(1, (3, 2))[:, 1], S0),
}

#: writes into a view ``v`` with an operand ``b`` shaped like it (which requires grad) and integer ids ``i``
VIEW_WRITES = {
    "mul_": lambda v, b, i: v.mul_(b),
    "add_": lambda v, b, i: v.add_(b, alpha=2.0),
    "copy_": lambda v, b, i: v.copy_(b),
    "masked_fill_": lambda v, b, i: v.masked_fill_(b > 0, 0.25),
    "index_put_": lambda v, b, i: v.index_put_((i,), b[0] * 3),
    "setitem": lambda v, b, i: v.__setitem__(slice(None), b * 3),
}


def _write_into_a_view(view: Callable, write: Callable) -> Callable:
    def program(x, b, i):
        y = x * 2
        before = y[1:, :2]  # a view taken before the write, read after it
        v = view(y)
        write(v, b, i)
        return y * 3, v * v, before + 1  # the viewed value, the written view, the other view

    return program


def _view_write_case(view: str, write: str) -> DTensorCase:
    take, placements = VIEWS[view]
    x = make_full((4, 6), seed=90)
    b, ids = make_full(tuple(take(x).shape), seed=91), torch.tensor([0, 1])
    if write == "index_put_" and placements == S0 and take(x).ndim == 2 and view == "slice":
        placements = R  # rows indexed along the sharded dim: eager DTensor refuses the in-place op (so do we)
    program = _write_into_a_view(take, VIEW_WRITES[write])
    return DTensorCase(program, [x, b, ids], [placements, R, R], requires_grad=[True, True, False])


@pytest.mark.parametrize("write", VIEW_WRITES)
def test_writes_into_a_slice_that_requires_grad(write):
    # eager DTensor's backward of index_put_ fails (torch 2.13: "got mixed torch.Tensor and DTensor"): values and
    # gradients against plain torch only
    compare_eager = write != "index_put_"
    run_case(_view_write_case("slice", write), compare_eager=compare_eager, label=f"write {write} into a slice")


@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
@pytest.mark.parametrize("view", [v for v in VIEWS if v != "slice"])
def test_writes_into_views_that_require_grad(view, lowering):
    for write in ("mul_", "copy_"):
        run_case(_view_write_case(view, write), jit_kwargs={"dtensor_lowering": lowering}, label=f"{write} into {view}")


def test_writes_that_overlap_and_a_write_into_the_viewed_dtensor():
    case = DTensorCase(writes_that_overlap, [make_full((4, 6), seed=92), make_full((2, 6), seed=93)], [R, S0])
    run_case(case, assert_comms=COMMS_ASSERTED, label="overlapping writes into views")


def test_writes_into_views_under_thunderfx():
    from thunder.dynamo import thunderfx

    program = _write_into_a_view(VIEWS["slice"][0], VIEW_WRITES["mul_"])
    full_x, full_b = make_full((4, 6), seed=94), make_full((4, 3), seed=95)
    plain = [full_x.clone().requires_grad_(), full_b.clone().requires_grad_()]
    x, b = _distribute([full_x, full_b], [S0, R], [True, True])
    expected, outs = program(*plain, None), thunderfx(program)(x, b, None)
    cotangents = [make_full(tuple(e.shape), seed=96 + i) for i, e in enumerate(expected)]
    torch.autograd.backward(expected, cotangents)
    torch.autograd.backward(outs, [distribute_tensor(c, mesh_1d(), o.placements) for c, o in zip(cotangents, outs)])
    for i, (out, e) in enumerate(zip(outs, expected)):
        assert_matches_full(out, e.detach(), what=f"output {i}")
    assert_matches_full(x.grad, plain[0].grad, what="x's gradient")
    assert_matches_full(b.grad, plain[1].grad, what="b's gradient")


def _write_into_a_detached_view(x):
    y = x * 2
    y.detach()[:, 1:].mul_(0.5)  # the values change; autograd does not see the write
    return y * 3


def test_a_write_into_a_detached_view_changes_values_not_gradients():
    run_case(DTensorCase(_write_into_a_detached_view, [make_full((4, 6), seed=99)], [S0]), label="detached view")


@pytest.mark.parametrize("write", VIEW_WRITES)
def test_a_write_into_a_gathered_view_reaches_the_viewed_dtensor(write):
    """A slice along a sharded dim is a copy in eager DTensor, and eager loses a write into it; the rewrite writes it
    back into the viewed DTensor: plain torch's values and gradients (was: refused, and ``copy_`` not even that:
    fuzz seeds 5007 and 5043 gave eager's lost write, silently). Eager is no reference here."""
    program = _write_into_a_view(lambda y: y[1:3], VIEW_WRITES[write])
    fulls = [make_full((4, 6), seed=97), make_full((2, 6), seed=98), torch.tensor([0, 1])]
    case = DTensorCase(program, fulls, [S0, R, R], requires_grad=[True, True, False])
    run_case(case, compare_eager=False, label=f"{write} into a gathered view")


# ---------------------------------------------------------------------------------------------------------
# In-place ops on inputs: the caller's DTensors are updated
# ---------------------------------------------------------------------------------------------------------
def _distribute(fulls: Sequence[torch.Tensor], placements: Sequence, requires_grad: Sequence[bool]) -> list:
    mesh = mesh_1d()
    return [
        distribute_tensor(t.clone(), mesh, list(p)).requires_grad_(rg)
        for t, p, rg in zip(fulls, placements, requires_grad)
    ]


def check_inplace_on_inputs(
    fn: Callable, fulls: Sequence[torch.Tensor], placements: Sequence, requires_grad: Sequence[bool], calls: int = 2
) -> Callable:
    """``fn`` writes into its inputs: after each jitted call the caller's DTensors hold plain torch's values,
    in eager DTensor's placements; output and gradients match plain torch (values) and eager (placements)."""
    dts = _distribute(fulls, placements, requires_grad)
    jfn = thunder.jit(fn)
    for call in range(calls):  # the second call runs the cached program: it writes again
        # plain torch and eager start from the caller's current values (checked equal to theirs below)
        current = [d.full_tensor().detach() for d in dts]
        plain = [t.clone().requires_grad_(rg) for t, rg in zip(current, requires_grad)]
        eager = _distribute(current, placements, requires_grad)
        for d in dts:
            d.grad = None
        expected, eager_out, out = fn(*plain), fn(*eager), jfn(*dts)
        assert_matches_full(out, expected.detach(), what=f"output, call {call}")
        assert out.placements == eager_out.placements
        for i, (d, p, e) in enumerate(zip(dts, plain, eager)):
            assert_matches_full(d.detach(), p.detach(), what=f"caller's input {i} after call {call}")
            assert d.placements == e.placements == tuple(placements[i])
        if any(requires_grad):
            cotangent = make_full(expected.shape, seed=100 + call)
            expected.backward(cotangent)
            eager_out.backward(distribute_tensor(cotangent, eager_out.device_mesh, eager_out.placements))
            out.backward(distribute_tensor(cotangent, out.device_mesh, out.placements))
            for i, (d, p, e, rg) in enumerate(zip(dts, plain, eager, requires_grad)):
                if not rg:  # written in place, so no longer a leaf in plain torch and eager: no .grad to read
                    assert d.grad is None
                    continue
                assert_matches_full(d.grad, p.grad, what=f"grad of input {i}, call {call}")
                assert d.grad.placements == e.grad.placements
    assert thunder.cache_hits(jfn) == calls - 1
    return jfn


def write_then_read_other(x, w):
    x.add_(1)  # the written input is not read again: the write must still happen
    return w * 2


def write_then_read(x, w):
    x.mul_(w)  # w's gradient reads x's old value
    return x * 2 + w


def copy_into(x, w):
    x.copy_(w)
    return x * w


def zero_fill_setitem(x, w, z):
    x.zero_()
    z.fill_(0.25)
    w[:, 1:3] = z[:, :2]
    return x + w


def relu_inplace(x, w):
    F.relu(x, inplace=True)
    return x * w


def write_into_a_view_of_the_input(x, w):
    x[:, 1:].mul_(w[:, 1:])  # x needs no grad, w does: its gradient reads x's old values, which the write replaces
    return x * 2 + w


@pytest.mark.parametrize(
    "fn, placements, requires_grad",
    [
        (write_then_read_other, [S0, S1], [False, True]),
        (write_then_read, [S1, S1], [False, True]),
        (copy_into, [S0, R], [False, True]),  # w (Replicate) written into x (Shard(0)): no communication
        (zero_fill_setitem, [S0, S0, R], [False, False, False]),
        (relu_inplace, [R, S0], [False, True]),
        (write_into_a_view_of_the_input, [S0, S0], [False, True]),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_inplace_on_inputs_updates_callers_dtensors(fn, placements, requires_grad):
    fulls = [make_full((4, 6), seed=10 + i) for i in range(len(placements))]
    check_inplace_on_inputs(fn, fulls, placements, requires_grad)


def sgd_step(p, g, buf):
    buf.mul_(0.9).add_(g, alpha=0.1)
    p.sub_(0.05 * buf)
    p.add_(g, alpha=-0.01)


def sgd_step_no_grad_inside(p, g, buf):
    with torch.no_grad():
        sgd_step(p, g, buf)
    return p * 1


@pytest.mark.parametrize("no_grad_inside", [False, True], ids=["no_grad-outside", "no_grad-inside"])
def test_optimizer_style_update_of_parameters(no_grad_inside):
    """p requires grad (a parameter); under no_grad the jitted update writes it, with no collective."""
    fulls = [make_full((8, 6), seed=s) for s in (20, 21, 22)]
    plain_p, plain_g, plain_buf = (t.clone() for t in fulls)
    p, g, buf = _distribute(fulls, [S0, S0, S0], [True, False, False])
    fn = sgd_step_no_grad_inside if no_grad_inside else sgd_step
    jfn = thunder.jit(fn)
    for step in range(2):
        sgd_step(plain_p, plain_g, plain_buf)
        with CommDebugMode() as comms:
            if no_grad_inside:
                jfn(p, g, buf)
            else:
                with torch.no_grad():
                    jfn(p, g, buf)
        assert comms.get_total_counts() == 0
        assert_matches_full(p.detach(), plain_p, what=f"parameter after step {step}")
        assert_matches_full(buf, plain_buf, what=f"momentum buffer after step {step}")
        assert p.is_leaf and p.requires_grad and p.placements == (Shard(0),)
    assert thunder.cache_hits(jfn) == 1


def test_inplace_on_leaf_that_requires_grad_raises_as_in_eager():
    def fn(p):
        p.add_(1)
        return p * 2

    full = make_full((4, 6), seed=30)
    eager, p = _distribute([full, full], [S0, S0], [True, True])
    message = "a leaf Variable that requires grad is being used in an in-place operation"
    with pytest.raises(RuntimeError, match=message):
        fn(eager)
    with pytest.raises(RuntimeError, match=message):
        thunder.jit(fn)(p)
    assert_matches_full(p.detach(), full, what="the leaf is left unchanged")


# ---------------------------------------------------------------------------------------------------------
# What eager DTensor rejects fails at trace time; what it redistributes, the jit redistributes alike
# ---------------------------------------------------------------------------------------------------------
def _partial(full: torch.Tensor) -> DTensor:
    return DTensor.from_local(full.clone(), mesh_1d(), [Partial()], run_check=False)


def _inputs(kinds: str, seed: int) -> list:
    """DTensors of shape (4, 6): ``P`` Partial(sum), ``R`` Replicate, ``0``/``1`` Shard(0)/Shard(1), ``i`` int."""
    out = []
    for i, kind in enumerate(kinds):
        full = make_full((4, 6), seed=seed + i)
        if kind == "P":
            out.append(_partial(full))
        elif kind == "i":
            out.append(distribute_tensor(full.long(), mesh_1d(), S0))
        else:
            out.append(distribute_tensor(full, mesh_1d(), {"R": R, "0": S0, "1": S1}[kind]))
    return out


def set_row_to_scalar(x):
    x[0] = 1.0
    return x * 1


REJECTED = {
    # an in-place op whose result would need other placements than the destination's
    "partial.add_(1)": (lambda x: x.add_(1) * 1, "P", "add_", "Partial(sum)"),
    "partial.clamp_(min=0)": (lambda x: x.clamp_(min=0) * 1, "P", "clamp_", "Partial(sum)"),
    # torch's own in-place rule: no float result into an int tensor
    "int.add_(float)": (lambda x, y: x.add_(y) * 1, "i0", "add_", "Shard(dim=0)"),
    # no sharding strategy for fill_.Tensor (a Python scalar assigned to a slice)
    "replicate[0] = 1.0": (set_row_to_scalar, "R", "setitem_", "Replicate()"),
}


@pytest.mark.parametrize("name", REJECTED)
def test_eager_rejections_raise_dtensor_op_error_at_trace_time(name):
    fn, kinds, op, placement = REJECTED[name]
    with pytest.raises((RuntimeError, NotImplementedError)):
        fn(*_inputs(kinds, seed=40))  # eager DTensor
    inputs = _inputs(kinds, seed=40)
    before = [x.to_local().clone() for x in inputs]
    with pytest.raises(DTensorOpError) as info:
        thunder.jit(fn)(*inputs)
    message = str(info.value)
    assert op in message.splitlines()[0], message
    assert f"placements=({placement},)" in message, message
    for x, local in zip(inputs, before):  # nothing ran
        torch.testing.assert_close(x.to_local(), local)


def _set_rows(x, v):
    x[1:3] = v
    return x * 1


def _set_rows_of_a_copy(x, v):
    y = x.clone()
    y[1:3] = v
    y[0] = 0.5
    return y * 2


@pytest.mark.parametrize(
    "fn, requires_grad", [(_set_rows, False), (_set_rows_of_a_copy, False), (_set_rows_of_a_copy, True)]
)
def test_setitem_along_a_sharded_dim_writes_the_tensor(fn, requires_grad):
    """Eager slices a sharded dim on a redistributed copy, so ``x[1:3] = v`` silently leaves x unchanged (it was
    refused here); it is now a write into that view, which the functional rewrite writes back: plain torch's
    values, in the input too, and its gradients."""
    full, v_full = make_full((4, 6), seed=50), make_full((2, 6), seed=51)
    x = distribute_tensor(full, mesh_1d(), S0)
    eager_x, eager_v = distribute_tensor(full, mesh_1d(), S0), distribute_tensor(v_full, mesh_1d(), R)
    if fn is _set_rows:  # (eager has no rule for ``y[0] = 0.5`` on a sharded dim: aten.fill_.Tensor)
        fn(eager_x, eager_v)
        torch.testing.assert_close(eager_x.full_tensor(), full)  # eager: the write is lost (torch 2.13)
    x, v = x.requires_grad_(requires_grad), distribute_tensor(v_full, mesh_1d(), R).requires_grad_(requires_grad)
    plain_x, plain_v = full.clone().requires_grad_(requires_grad), v_full.clone().requires_grad_(requires_grad)
    expected, out = fn(plain_x, plain_v), thunder.jit(fn)(x, v)
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    torch.testing.assert_close(x.full_tensor(), plain_x.detach())
    assert tuple(x.placements) == tuple(S0)
    if requires_grad:
        expected.backward(torch.ones_like(expected))
        out.backward(torch.ones_like(out))
        torch.testing.assert_close(x.grad.full_tensor(), plain_x.grad)
        torch.testing.assert_close(v.grad.full_tensor(), plain_v.grad)


REDISTRIBUTING = {
    "replicate.add_(shard)": (lambda x, y: x.add_(y), "R0"),  # all_gather of y
    "shard.mul_(partial)": (lambda x, y: x.mul_(y), "0P"),  # reduce_scatter of y
    "partial.mul_(replicate)": (lambda x, y: x.mul_(y), "PR"),  # stays Partial, no collective
    "replicate.copy_(shard)": (lambda x, y: x.copy_(y), "R0"),  # all_gather of y
    "partial.copy_(replicate)": (lambda x, y: x.copy_(y), "PR"),
}


@pytest.mark.parametrize("name", REDISTRIBUTING)
def test_redistributing_inplace_ops_match_eager(name):
    op, kinds = REDISTRIBUTING[name]

    def fn(x, y):
        op(x, y)
        return x * 1

    eager = _inputs(kinds, seed=60)
    with CommDebugMode() as eager_comms:
        op(*eager)
    jfn = thunder.jit(fn)
    jfn(*_inputs(kinds, seed=60))  # traced outside the counting mode; the counted call hits the cache
    inputs = _inputs(kinds, seed=60)
    with CommDebugMode() as comms:
        jfn(*inputs)
    assert comms.get_comm_counts() == eager_comms.get_comm_counts()
    assert inputs[0].placements == eager[0].placements
    assert_matches_full(inputs[0], eager[0].full_tensor(), what="written input")


# ---------------------------------------------------------------------------------------------------------
# Traces, executors, and plain tensors
# ---------------------------------------------------------------------------------------------------------
def test_trace_shows_inplace_symbols_and_dtensor_executor_runs_them():
    x, w = _distribute([make_full((4, 6), seed=70), make_full((4, 6), seed=71)], [S0, S0], [False, True])
    jfn = thunder.jit(write_then_read, dtensor_lowering=False)
    jfn(x, w).sum().backward()
    initial = str(thunder.last_traces(jfn)[0])
    assert "dtensor_mul_(x, w)" in initial, initial
    execution = thunder.last_traces(jfn)[-1]
    names = [b.sym.name for b in execution.bound_symbols]
    assert "dtensor_copy__prim" in names and "dtensor_update_aliases_prim" in names, names
    for trace in (execution, thunder.last_backward_traces(jfn)[-1]):
        for bsym in trace.bound_symbols:
            touches = any(isinstance(p, DTensorProxy) for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs))
            if touches and bsym.sym.executor is not None:
                assert bsym.sym.executor is dtensor_ex, f"{bsym.sym.name} runs on {bsym.sym.executor}"
    # lowered: the write into the caller's DTensor stays the eager copy_, and the trace says why
    lowered = thunder.jit(write_then_read)
    lowered(x, w)
    execution = thunder.last_traces(lowered)[-1]
    (copy,) = [b for b in execution.bound_symbols if b.sym.name == "dtensor_copy__prim"]
    assert "not lowered" in str(copy.header) and "in place" in str(copy.header), copy.header


def test_plain_tensor_inplace_is_thunders():
    def fn(x):
        y = x * 2
        y.add_(1)
        y[0] = 5.0
        return y

    x = torch.randn(3, 4)
    jfn = thunder.jit(fn)
    torch.testing.assert_close(jfn(x), fn(x))
    initial = str(thunder.last_traces(jfn)[0])
    assert "ltorch.add_(" in initial and "ltorch.setitem_(" in initial and "dtensor" not in initial
    assert "dtensor" not in str(thunder.last_traces(jfn)[-1])
    with pytest.raises(AttributeError, match="fill_"):  # thunder has no fill_; the package adds it for DTensors
        thunder.jit(lambda t: t.fill_(1.0))(x)


# ---------------------------------------------------------------------------------------------------------
# Uneven shards (4 ranks, 6 rows: 2, 2, 2, 0)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.world_size(4)
def test_uneven_shards():
    x, w = make_full((6, 5), seed=80), make_full((6, 5), seed=81)
    run_case(DTensorCase(chain_, [x, w], [S0, S0]), assert_comms=COMMS_ASSERTED, label="inplace chain_ uneven")
    check_inplace_on_inputs(write_then_read, [x, w], [S0, R], [False, True])
