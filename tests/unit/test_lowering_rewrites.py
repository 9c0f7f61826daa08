"""The lowering's pure rewrites, one at a time, in one process: FX graph rewrites (``lowering/graph.py``) on
graphs ``make_fx`` records, and the symbol-list rewrites (``lowering/program.py``) on small made-up traces."""

import types

import thunder_dtensor  # noqa: F401  (first: makes thunder importable on torch >= 2.13)
from thunder_dtensor.lowering import graph as fx_rewrites
from thunder_dtensor.lowering import program

import pytest
import torch
from thunder.core import devices, dtypes, prims
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten


def _graph(fn, *shapes):
    return make_fx(fn)(*(torch.randn(s) for s in shapes)).graph


def _calls(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


def _run(graph, *args):
    return torch.fx.GraphModule(torch.nn.Module(), graph)(*args)


# --- FX graph rewrites -----------------------------------------------------------------------------------------
def test_out_of_place_rewrites_writes_to_fresh_values_and_later_reads_read_the_result():
    def fn(x):
        y = x * 2
        y.add_(1)
        y.mul_(3)
        return y + x

    g = _graph(fn, (4,))
    assert fx_rewrites.has_mutation(g)
    fx_rewrites.out_of_place(g)
    assert not fx_rewrites.has_mutation(g)
    assert _calls(g) == [aten.mul.Tensor, aten.add.Tensor, aten.mul.Tensor, aten.add.Tensor]
    x = torch.randn(4)
    torch.testing.assert_close(_run(g, x), fn(x.clone()))


def test_out_of_place_refuses_writes_to_inputs_and_to_views():
    with pytest.raises(fx_rewrites.NotLowerable, match="on an input or a view"):
        fx_rewrites.out_of_place(_graph(lambda x: x.add_(1), (4,)))

    def through_a_view(x):
        y = x * 2
        v = y.view(2, 2)
        y.add_(1)
        return v

    with pytest.raises(fx_rewrites.NotLowerable, match="on an input or a view"):
        fx_rewrites.out_of_place(_graph(through_a_view, (4,)))


def test_drop_identity_views_reads_the_viewed_value_and_keeps_real_views():
    def fn(x):
        a = x.detach() * 2  # detach: the value itself
        b = x.view(4, 3) + 1  # a view to the same shape: the value itself
        c = x.t().t() * 3  # the second t of a pair: the value itself
        d = x.view(12) * 4  # another shape: a real view
        return a, b, c, d

    g = _graph(fn, (4, 3))
    (x,) = fx_rewrites.placeholder_nodes(g)
    fx_rewrites.drop_identity_views(g)
    readers = {n.target: n.args[0] for n in g.nodes if n.op == "call_function" and n.target is not aten.view.default}
    assert readers[aten.add.Tensor] is x
    consumers_of_x = [n for n in g.nodes if n.op == "call_function" and x in n.args and "mul" in str(n.target)]
    assert len(consumers_of_x) == 2  # detach's and the t pair's readers read x; the reshaping view is kept
    (reshape,) = [n for n in g.nodes if n.target is aten.view.default and list(n.args[1]) == [12]]
    assert any(reshape in n.args for n in g.nodes if n.op == "call_function")
    g.eliminate_dead_code()
    inputs = torch.randn(4, 3)
    for got, want in zip(_run(g, inputs), fn(inputs)):
        torch.testing.assert_close(got, want)


def test_check_graph_names_what_it_cannot_lower():
    fx_rewrites.check_graph(_graph(lambda x: x * 2, (3,)))  # plain local math passes
    with pytest.raises(fx_rewrites.NotLowerable, match="random op"):
        fx_rewrites.check_graph(_graph(lambda x: x + torch.rand_like(x), (3,)))


def _traced(fn, n_forward, *shapes):
    return fx_rewrites.Traced(_graph(fn, *shapes), n_forward, [None] * n_forward)


def test_match_forward_maps_the_same_forward_and_refuses_another():
    def joint(x, cot):
        y = x.sin()
        return y, y.cos() * cot

    def other(x, cot):
        y = x.cos()
        return y, y * cot

    first = _traced(joint, 1, (3,), (3,))
    again = _traced(joint, 1, (3,), (3,))
    old_x, old_cot = fx_rewrites.placeholder_nodes(first.graph)
    env = {old_x: "x-local", old_cot: "cot-local"}
    (old_sin,) = [n for n in first.graph.nodes if n.target is aten.sin.default]
    env[old_sin] = "sin-local"
    matched = fx_rewrites.match_forward(first, again, env)
    (new_sin,) = [n for n in again.graph.nodes if n.target is aten.sin.default]
    assert matched[new_sin] == "sin-local"
    assert matched[fx_rewrites.placeholder_nodes(again.graph)[0]] == "x-local"
    assert fx_rewrites.match_forward(first, _traced(other, 1, (3,), (3,)), env) is None


# --- symbol-list rewrites ------------------------------------------------------------------------------------
def _proxies(*names):
    with tracectx(TraceCtx()):
        return [TensorProxy(name, shape=(2,), device=devices.cpu, dtype=dtypes.float32) for name in names]


def _bsym(name, args=(), outs=(), *, kwargs=None, sym_id=None, call_args=None):
    sym = types.SimpleNamespace(name=name, id=sym_id or name)
    return types.SimpleNamespace(
        sym=sym,
        args=tuple(args) if call_args is None else call_args,
        kwargs=kwargs or {},
        flat_proxy_args=list(args),
        flat_proxy_outs=list(outs),
    )


def test_place_waits_late_moves_each_wait_to_its_first_reader():
    x, c, w, y, z = _proxies("x", "c", "w", "y", "z")
    issue = _bsym("all_reduce", [x], [c])
    wait = _bsym("wait_tensor", [c], [w])
    unrelated = _bsym("mul", [x], [y])
    reader = _bsym("add", [w, y], [z])
    ret = _bsym("return", [z], sym_id=prims.PrimIDs.RETURN)
    assert program.place_waits_late([issue, wait, unrelated, reader, ret]) == [issue, unrelated, wait, reader, ret]


def test_place_waits_late_puts_an_unread_wait_before_the_return():
    x, c, w, y = _proxies("x", "c", "w", "y")
    issue, wait = _bsym("all_gather", [x], [c]), _bsym("wait_tensor", [c], [w])
    other, ret = _bsym("mul", [x], [y]), _bsym("return", [y], sym_id=prims.PrimIDs.RETURN)
    assert program.place_waits_late([issue, wait, other, ret]) == [issue, other, wait, ret]


def test_pair_vjps_pairs_each_generic_vjp_with_the_latest_earlier_forward_of_the_same_call():
    a, b, o1, o2, g1, g2 = _proxies("a", "b", "o1", "o2", "g1", "g2")
    fwd_ab = _bsym("dtensor_add_prim", [a, b], [o1])
    fwd_ab_again = _bsym("dtensor_add_prim", [a, b], [o2])
    fwd_ba = _bsym("dtensor_add_prim", [b, a], [o2], call_args=(b, a))
    # a generic vjp's arguments: (the forward's args, its kwargs, cotangents, differentiated positions)
    vjp_ab = _bsym("dtensor_add_vjp_prim", [a, b, g1], [g2], call_args=((a, b), {}, (g1,), (0, 1)))
    vjp_ab_2 = _bsym("dtensor_add_vjp_prim", [a, b, g2], [g1], call_args=((a, b), {}, (g2,), (0, 1)))
    bsyms = [fwd_ab, fwd_ba, fwd_ab_again, vjp_ab, vjp_ab_2]
    # the later vjp of (a, b) takes the other (earlier) forward of (a, b); (b, a) has no vjp
    assert program.pair_vjps(bsyms) == {2: 3, 0: 4}
    # a vjp before any forward of its call pairs with nothing
    assert program.pair_vjps([vjp_ab, fwd_ab]) == {}


def test_pair_vjps_pairs_a_vjp_that_takes_thunders_recomputations_of_the_forwards_arguments():
    """FSDP2's gathered parameters are recomputed in the backward (thunder names the copies ``bw_<name>``); a
    tensor-parallel linear's vjp takes those and still pairs with its forward. A ``bw_`` name that no tagged
    recomputation made pairs with nothing."""
    from thunder_dtensor import _integration as ti

    x, w, bw_w, o, g, gx, gw = _proxies("x", "w", "bw_w", "o", "g", "gx", "gw")
    gather = _bsym("dtensor_fsdp_all_gather_prim", [x], [w])
    fwd = _bsym("dtensor_add_prim", [x, w], [o])
    regather = _bsym("dtensor_fsdp_all_gather_prim", [x], [bw_w])
    vjp = _bsym("dtensor_add_vjp_prim", [x, bw_w, g], [gx, gw], call_args=((x, bw_w), {}, (g,), (0, 1)))
    assert program.pair_vjps([gather, fwd, regather, vjp]) == {}  # untagged: not a recomputation
    regather.tags = {ti.BoundSymbolTag.BACKWARD, ti.BoundSymbolTag.RECOMPUTE_IN_BACKWARD}
    assert program.recomputed_in_backward([gather, fwd, regather, vjp]) == {"bw_w": "w"}
    assert program.pair_vjps([gather, fwd, regather, vjp]) == {1: 3}


def _all_reduce_name():
    from thunder_dtensor.lowering.symbols import collective_symbol

    import torch

    return collective_symbol(torch.ops._c10d_functional.all_reduce.default).name  # registered as a collective


def test_issue_collectives_early_moves_each_collective_and_what_it_reads_ahead_of_unrelated_work():
    x, y, a, b, c, d, e, w1, w2, z = _proxies("x", "y", "a", "b", "c", "d", "e", "w1", "w2", "z")
    all_reduce = _all_reduce_name()
    unrelated = _bsym("sin", [y], [a])  # needed by no collective
    feeds_first = _bsym("mul", [x], [b])
    first = _bsym(all_reduce, [b], [c])
    wait_first = _bsym("wait_tensor", [c], [w1])
    feeds_second = _bsym("add", [w1, x], [d])  # reads the first collective's result
    second = _bsym(all_reduce, [d], [e])
    wait_second = _bsym("wait_tensor", [e], [w2])
    reader = _bsym("add", [w2, a], [z])
    ret = _bsym("return", [z], sym_id=prims.PrimIDs.RETURN)
    bsyms = [unrelated, feeds_first, first, wait_first, feeds_second, second, wait_second, reader, ret]
    assert program.issue_collectives_early(bsyms) == [
        feeds_first,
        first,
        wait_first,
        feeds_second,
        second,
        unrelated,
        wait_second,
        reader,
        ret,
    ]


def test_issue_collectives_early_moves_nothing_across_a_random_op_or_an_effect():
    x, y, a, b, c, r = _proxies("x", "y", "a", "b", "c", "r")
    all_reduce = _all_reduce_name()
    before = _bsym("sin", [y], [a])
    draw = _bsym("uniform", [], [r])  # a random draw: its place in the RNG's sequence stays
    feeds = _bsym("mul", [x], [b])
    collective = _bsym(all_reduce, [b], [c])
    check = _bsym("check_tensor_metadata", [x], [])  # outputs nothing: there for its effect
    bsyms = [before, draw, feeds, collective, check]
    assert program.issue_collectives_early(bsyms) == bsyms
    assert program.issue_collectives_early([before, feeds, collective]) == [feeds, collective, before]


def test_issue_collectives_early_keeps_the_arguments_unpacked_first():
    """A collective's inputs move ahead of other work, but not ahead of the other arguments' unpacking: an
    unpacking between stretches of local math cut the fused forward of the test Llama into seven inductor
    graphs (with thunder's torch.compile executor listed)."""
    x, w, b, c = _proxies("x", "w", "b", "c")
    all_reduce = _all_reduce_name()
    unpack_w = _bsym("unpack_trivial", [], [w])
    unpack_x = _bsym("unpack_trivial", [], [x])
    feeds = _bsym("mul", [x], [b])
    collective = _bsym(all_reduce, [b], [c])
    assert program.issue_collectives_early([unpack_w, unpack_x, feeds, collective]) == [
        unpack_w,
        unpack_x,
        feeds,
        collective,
    ]
