"""The vocab-parallel embedding (a ``Shard(0)`` table, replicated ids): every keyword honoured, and its output
placed as eager's ``_MaskPartial`` so that every later op, and code that reads placements, sees eager's.

One placement differs from eager's by design: the table's gradient stays ``Shard(0)`` (each rank computes its
own rows' gradient), where eager's backward gives a ``Replicate`` gradient of the whole table on every rank.

Regressions: ``padding_idx`` was dropped (the padding row's gradient was summed like any other: OLMo2's
``pad_token_id``), and the output was a plain ``Partial(sum)``, which DTensor passes through ``* 8.0`` where
eager reduces it first; transformers' embedding wrapper then skipped its reduction under thunderfx (Gemma's
embedding scale: each rank kept only its own vocabulary's rows).
"""

from __future__ import annotations

from thunder_dtensor import thunderfx as thunderfx_support
from thunder_dtensor.spec import MaskPartial
from thunder_dtensor.testing import DTensorCase, make_full, mesh_1d, run_case, same_placements

import pytest
import thunder
import torch
import torch.nn.functional as F
from thunder.dynamo import thunderfx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

VOCAB, DIM = 16, 4
#: the table's gradient keeps its sharding (eager's is Replicate: see the module docstring)
_TABLE_GRADIENT = {1: (Shard(0),)}


def _ids(pad: int) -> torch.Tensor:
    """Ids over the whole vocabulary (every rank's range), with the pad id twice."""
    return torch.tensor([[pad, 9, 3, 15], [0, pad, 12, 7]])


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("padding_idx", [1, -4, 12], ids=lambda p: f"padding_idx={p}")
def test_padding_idx_row_gets_no_gradient(padding_idx):
    """Values, the table's gradient (zero on the padding row, on whichever rank holds it) and placements: plain
    torch's and eager DTensor's."""
    pad = padding_idx % VOCAB
    table = make_full((VOCAB, DIM), seed=1)
    result = run_case(
        DTensorCase(
            lambda ids, w: F.embedding(ids, w, padding_idx=padding_idx) * 1.0,
            [_ids(pad), table],
            [[Replicate()], [Shard(0)]],
            requires_grad=[False, True],
        ),
        own_grad_placements=_TABLE_GRADIENT,
    )
    grad = result.thunder_grads[1].full_tensor()
    assert torch.count_nonzero(grad[pad]) == 0 and torch.count_nonzero(grad) > 0


@pytest.mark.world_size(2, 4)
def test_padding_idx_under_thunderfx():
    table, pad = make_full((VOCAB, DIM), seed=2), 1
    ids = distribute_tensor(_ids(pad), mesh_1d(), [Replicate()])
    w = distribute_tensor(table, mesh_1d(), [Shard(0)]).requires_grad_()
    out = thunderfx(lambda ids, w: F.embedding(ids, w, padding_idx=pad))(ids, w)
    full_w = table.clone().requires_grad_()
    expected = F.embedding(_ids(pad), full_w, padding_idx=pad)
    torch.testing.assert_close(out.full_tensor(), expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), full_w.grad)
    assert torch.count_nonzero(w.grad.full_tensor()[pad]) == 0


#: ops after the lookup: eager keeps its masked partial through views and sums, and reduces it before other ops
AFTER_LOOKUP = {
    "itself": lambda e: e,
    "* 8.0": lambda e: e * 8.0,
    "/ 2": lambda e: e / 2,
    "neg": lambda e: -e,
    "+ 1": lambda e: e + 1,
    "view": lambda e: e.view(8, DIM),
    "transpose": lambda e: e.transpose(0, 1),
    "to(float64)": lambda e: e.to(torch.float64),
    "sum(-1)": lambda e: e.sum(-1),
    "mean": lambda e: e.mean(),
    "relu": lambda e: torch.relu(e),
    "slice": lambda e: e[:, :2],
    "unsqueeze": lambda e: e.unsqueeze(0),
}


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("name", AFTER_LOOKUP)
def test_placements_after_the_lookup_are_eagers(name):
    """``run_case`` compares each output's placements with eager DTensor's (a masked partial equals only a
    masked partial), and values and gradients with plain torch."""
    op = AFTER_LOOKUP[name]
    run_case(
        DTensorCase(
            lambda ids, w: op(F.embedding(ids, w)),
            [_ids(1), make_full((VOCAB, DIM), seed=3)],
            [[Replicate()], [Shard(0)]],
            requires_grad=[False, True],
        ),
        own_grad_placements=_TABLE_GRADIENT,
    )


class _ScaledVocabParallelEmbedding(torch.nn.Module):
    """transformers' ``EmbeddingParallel(shard_dim=0)`` on Gemma's scaled embedding: the lookup times the
    scale, then a reduction only if the result is not already Replicate, then the local tensor."""

    def __init__(self, table: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.mesh = mesh_1d()
        self.weight = torch.nn.Parameter(distribute_tensor(table, self.mesh, [Shard(0)]))
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = DTensor.from_local(ids, self.mesh, [Replicate()], run_check=False)
        out = F.embedding(ids, self.weight) * self.scale
        if out.placements != (Replicate(),):
            out = out.redistribute(placements=[Replicate()])
        return out.to_local()


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("frontend", ["jit", "thunderfx"])
def test_scaled_vocab_parallel_embedding(frontend):
    table = make_full((VOCAB, DIM), seed=4)
    module = _ScaledVocabParallelEmbedding(table, 8.0)
    compiled = thunder.jit(module) if frontend == "jit" else thunderfx(module)
    full_w = table.clone().requires_grad_()
    for pad in (1, 2):  # two calls: the second one reuses the compiled program
        out = compiled(_ids(pad))
        expected = F.embedding(_ids(pad), full_w) * 8.0
        torch.testing.assert_close(out, expected)
        cotangent = make_full(expected.shape, seed=5 + pad)
        out.backward(cotangent)
        expected.backward(cotangent)
        torch.testing.assert_close(module.weight.grad.full_tensor(), full_w.grad)


class _Captured(Exception):
    pass


def _dynamo_graphs(fn, *args) -> list:
    """The fx graphs dynamo records for ``fn(*args)``, with its example values (eager DTensor's placements).

    Nothing runs: eager's own masked partial fails some of these programs (a view of it, then a reduction)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        raise _Captured

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert isinstance(info.value.inner_exception, _Captured), info.value
    return graphs


def _dtensor_nodes(graphs: list) -> list:
    return [
        node
        for gm in graphs
        for node in gm.graph.nodes
        if node.op in ("call_function", "call_method")
        and any(isinstance(v, DTensor) for v in torch.utils._pytree.tree_leaves(node.meta.get("example_value")))
    ]


def _model_program(ids, w):
    """Lookups, masked-partial-keeping and reducing ops, a wrapper that reads placements, a backward path."""
    e = F.embedding(ids, w)
    h = e.view(2 * 4, DIM).transpose(0, 1) * 8.0
    if h.placements != (Replicate(),):
        h = h.redistribute(placements=[Replicate()])
    return (h.sum(0) + F.embedding(ids, w, padding_idx=1).mean()).to_local()


def test_thunder_places_every_dynamo_node_as_eager_does():
    """Node by node, the placements thunder_dtensor gives each DTensor value of a dynamo graph (tracing the node
    on proxies of dynamo's example inputs, as thunderfx's splitter does) are those dynamo recorded: eager's."""
    ids = distribute_tensor(_ids(1), mesh_1d(), [Replicate()])
    w = distribute_tensor(make_full((VOCAB, DIM), seed=6), mesh_1d(), [Shard(0)])
    nodes = _dtensor_nodes(_dynamo_graphs(_model_program, ids, w))
    assert len(nodes) >= 8
    masked = 0
    for node in nodes:
        supported, reason = thunderfx_support.dtensor_node_support(node)
        assert supported, reason
        values = [v for v in torch.utils._pytree.tree_leaves(node.meta["example_value"]) if isinstance(v, DTensor)]
        masked += any(type(p).__name__ == "_MaskPartial" for v in values for p in v.placements)
    assert masked >= 3  # the lookups, and the views that keep eager's masked partial


def test_a_node_placed_otherwise_than_eager_is_left_to_eager(monkeypatch):
    """The check can fail: with the old plain ``Partial(sum)`` output (which the multiply after the lookup would
    keep a partial sum where eager reduces it), the splitter leaves the lookup to eager, and only the lookup."""
    from thunder_dtensor.ops import embedding
    from thunder_dtensor.primitive import PROPAGATION_CACHE

    monkeypatch.setattr(embedding, "MaskPartial", lambda *args: Partial())
    PROPAGATION_CACHE.clear()
    try:
        ids = distribute_tensor(_ids(1), mesh_1d(), [Replicate()])
        w = distribute_tensor(make_full((VOCAB, DIM), seed=7), mesh_1d(), [Shard(0)])
        answers = {
            str(node.target): thunderfx_support.dtensor_node_support(node)
            for node in _dtensor_nodes(_dynamo_graphs(lambda ids, w: (F.embedding(ids, w) * 8.0).to_local(), ids, w))
        }
    finally:
        PROPAGATION_CACHE.clear()
    refused = {target: reason for target, (ok, reason) in answers.items() if not ok}
    assert len(refused) == 1 and len(answers) == 2, answers
    assert all("where eager DTensor places it" in reason for reason in refused.values()), refused


def test_mask_partial_is_a_plain_value():
    """Equal by reduce op, vocabulary shape and dim, with one hash in every process; never equal to a plain
    ``Partial`` (DTensor's rules must tell them apart), and equal to eager's ``_MaskPartial`` in tests."""
    a, b = MaskPartial("sum", (VOCAB, DIM), 0), MaskPartial("sum", torch.Size([VOCAB, DIM]), 0)
    assert a == b and hash(a) == hash(b) and a != Partial() and Partial() != a
    assert a != MaskPartial("sum", (VOCAB + 1, DIM), 0)
    eager = F.embedding(
        distribute_tensor(_ids(1), mesh_1d(), [Replicate()]),
        distribute_tensor(make_full((VOCAB, DIM), seed=8), mesh_1d(), [Shard(0)]),
    )
    assert same_placements(eager.placements, (a,)) and not same_placements(eager.placements, (Partial(),))
