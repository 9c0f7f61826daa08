"""thunderfx (thunder.dynamo) on DTensor programs: what is split off, and the pieces that make it work.

Whole tensor-parallel models under thunderfx are in test_tensor_parallel.py.
"""

from thunder_dtensor.testing import make_full, mesh_1d

import pytest
import thunder
import torch
from thunder.dynamo import thunderfx
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def _dt(full, placements):
    return distribute_tensor(full, mesh_1d(), placements).requires_grad_(True)


def test_op_without_thunder_mapping_is_split_out_with_a_reason():
    """An aten op called directly has no thunder symbol: thunderfx hands it to inductor, the rest to thunder."""

    def fn(x):
        return torch.ops.aten.sin.default(x * 2) + 1

    full = make_full((4, 6), seed=1)
    x, x_eager = _dt(full, [Shard(0)]), _dt(full, [Shard(0)])
    compiled = thunderfx(fn)
    out, expected = compiled(x), fn(x_eager)
    assert out.placements == expected.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), torch.sin(full * 2) + 1)
    out.sum().backward()
    expected.sum().backward()
    assert x.grad.placements == x_eager.grad.placements
    torch.testing.assert_close(x.grad.full_tensor(), 2 * torch.cos(full * 2))

    (info,) = compiled._backend.subgraph_infos
    assert [name for name, _ in info.split_graph_module.named_children()] == ["thunder_0", "inductor_1", "thunder_2"]
    (reason,) = info.split_reasons
    assert "aten.sin.default" in reason.info and "no thunder_dtensor mapping" in reason.info


@pytest.mark.parametrize("compile_fn", [thunder.jit, thunderfx], ids=["jit", "thunderfx"])
def test_placements_built_inside_compiled_code(compile_fn):
    """Placement constructors run whole in thunder's interpreter (they are pybind11 classes)."""

    def fn(x):
        return x.redistribute(x.device_mesh, [Replicate()]).redistribute(x.device_mesh, [Shard(1)]) * 2

    full = make_full((4, 6), seed=2)
    out = compile_fn(fn)(_dt(full, [Shard(0)]))
    assert out.placements == fn(_dt(full, [Shard(0)])).placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), full * 2)


def test_an_input_returned_as_it_is_before_a_graph_break_keeps_its_gradient():
    """``x.contiguous()`` of a contiguous leaf is ``x`` itself: dynamo's graph before the break at the ``if``
    returns it, and thunder's splitter called it non-differentiable (its example value has no ``grad_fn``),
    so the program's output did not require grad (fuzz seed 6125, silently: no gradient at all)."""

    def fn(x):
        y = x.contiguous()
        if y.mean() > 0.1:
            y = y * 2.0
        else:
            y = torch.relu(y)
        return y.clone()

    full = make_full((4, 6), seed=5)
    x = _dt(full, [Shard(1)]).requires_grad_()
    out = thunderfx(fn)(x)
    assert out.requires_grad
    expected_x = full.clone().requires_grad_()
    expected = fn(expected_x)
    torch.testing.assert_close(out.full_tensor(), expected)
    out.sum().backward()
    expected.sum().backward()
    eager_x = _dt(full, [Shard(1)]).requires_grad_()
    fn(eager_x).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), expected_x.grad)
    assert x.grad.placements == eager_x.grad.placements


def test_equal_specs_hit_the_cache_whether_shape_is_a_size_or_a_tuple():
    """Inductor builds DTensor specs with tuple shapes, eager with torch.Size: the prologue sees one spec."""
    full = make_full((4, 6), seed=3)
    sized = distribute_tensor(full, mesh_1d(), [Shard(0)])
    tupled = DTensor.from_local(sized.to_local(), mesh_1d(), [Shard(0)], shape=(4, 6), stride=(6, 1))
    assert type(sized._spec.tensor_meta.shape) is not type(tupled._spec.tensor_meta.shape)
    assert sized._spec == tupled._spec

    jitted = thunder.jit(lambda x: x * 3)
    for x in (sized, tupled, sized):
        torch.testing.assert_close(jitted(x).full_tensor(), full * 3)
    assert thunder.cache_misses(jitted) == 1 and thunder.cache_hits(jitted) == 2


def test_dynamic_batch_size_under_tensor_parallel():
    """A new batch size makes dynamo recompile with a symbolic batch dim: thunder still gets the whole graph."""
    import copy

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    compiled = thunderfx(parallelize_module(copy.deepcopy(reference), mesh_1d(), plan))
    for batch in (4, 2, 3):
        x = make_full((batch, 8), seed=batch)
        torch.testing.assert_close(compiled(x), reference(x))
    infos = compiled._backend.subgraph_infos
    assert len(infos) == 2  # static shapes first, then one dynamic-batch graph for both later sizes
    assert any(
        isinstance(p.meta.get("example_value"), torch.SymInt)
        for p in infos[1].original_graph_module.graph.find_nodes(op="placeholder")
    )
    for info in infos:
        assert info.split_reasons == [], [r.info for r in info.split_reasons]
        assert [name for name, _ in info.split_graph_module.named_children()] == ["thunder_0"]


def test_an_inductor_region_compiled_on_one_rank_is_never_run_on_another():
    """A node thunderfx hands to inductor runs DTensor's rule inside torch's AOTAutograd, whose graph slices the
    replicated operand at this rank's offset. torch's AOTAutograd cache keys a DTensor by its spec alone (torch
    2.13: pytorch#188390; the fix there adds the device, the same "cpu" on every rank of a CPU mesh), so with
    caches on disk a rank loaded the graph another rank compiled: that rank's shard, silently (fuzz seed 7038,
    ``flatten > linear`` of a 1-D input). The ranks compile here one after another into one fresh cache."""
    import os
    import shutil
    import tempfile
    from unittest import mock

    import torch.distributed as dist

    def fn(x, y):
        return torch.ops.aten.mul.Tensor(x, y) * 2  # an aten op called directly: split off to inductor

    full_x, full_y = make_full((4, 6), seed=6), make_full((4, 6), seed=7)
    # made by all ranks (distribute_tensor communicates); no grad: the cache keeps an inference graph at once
    x, y = (distribute_tensor(full, mesh_1d(), [p]) for full, p in ((full_x, Shard(0)), (full_y, Replicate())))
    cache_dir = [tempfile.mkdtemp(prefix="thunder_dtensor_inductor_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(cache_dir)
    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache_dir[0]}):
        for turn in range(dist.get_world_size()):
            if dist.get_rank() == turn:
                compiled = thunderfx(fn)
                out = compiled(x, y)  # no collective: y's shard is a local slice
                (info,) = compiled._backend.subgraph_infos
                assert any(name.startswith("inductor") for name, _ in info.split_graph_module.named_children())
            dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(cache_dir[0], ignore_errors=True)
    torch.testing.assert_close(out.full_tensor(), fn(full_x, full_y))


def test_a_graph_output_read_by_nothing_gives_its_inputs_no_gradient():
    """Before a graph break, ``y = x * 2`` is an output of the first graph (the ``if`` reads it); the graph after
    the break takes it as an input and does not read it, so its backward gives it ``None``. torch's autograd still
    calls the first graph's node, and thunder's bridge ran its backward on zeros: ``x.grad`` was zeros where torch
    gives ``None`` (fuzz seed 7460; an optimizer with weight decay would then move ``x``). A second output that is
    read (``z``) still gets its gradient, and the unread one's missing gradient counts as zeros there."""

    def unread(x, w):
        y = x * 2
        if y.amax() > 0.5:
            y = torch.relu(y)
        return w * 3

    def partly_read(x, w):
        y, z = x * 2, x.sin()
        if y.amax() > 0.5:
            y = torch.relu(y)
        return w * z

    full_x, full_w = make_full((4, 6), seed=8), make_full((4, 6), seed=9)
    for fn in (unread, partly_read):
        x, w = _dt(full_x, [Shard(0)]), _dt(full_w, [Replicate()])
        out = thunderfx(fn)(x, w)
        out.backward(distribute_tensor(torch.ones(4, 6), mesh_1d(), out.placements))
        plain_x, plain_w = full_x.clone().requires_grad_(), full_w.clone().requires_grad_()
        fn(plain_x, plain_w).sum().backward()
        eager_x, eager_w = _dt(full_x, [Shard(0)]), _dt(full_w, [Replicate()])
        eager = fn(eager_x, eager_w)
        eager.backward(distribute_tensor(torch.ones(4, 6), mesh_1d(), eager.placements))
        for got, want, placed in ((x, plain_x, eager_x), (w, plain_w, eager_w)):
            assert (got.grad is None) == (want.grad is None) == (placed.grad is None), fn.__name__
            if want.grad is not None:
                torch.testing.assert_close(got.grad.full_tensor(), want.grad)
                assert got.grad.placements == placed.grad.placements
