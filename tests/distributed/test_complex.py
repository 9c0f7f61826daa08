"""Complex DTensors: rotary embeddings through view_as_complex / complex mul / view_as_real, and properties.

Values and gradients against plain torch on the full tensors (the math) and placements against eager DTensor.
The dedicated grad rules are written for real tensors; complex calls take eager DTensor's own backward.
"""

from thunder_dtensor.testing import mesh_1d
from thunder_dtensor.testing.llama import apply_rotary, rotary_frequencies

import pytest
import thunder
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("x_placement", [Shard(1), Shard(2)], ids=["sequence", "heads"])
@pytest.mark.parametrize("freqs_placement", [Replicate(), Shard(0)], ids=["R", "S(0)"])
def test_rotary_embedding_on_dtensors(x_placement, freqs_placement):
    mesh = mesh_1d()
    torch.manual_seed(0)
    x, cotangent = torch.randn(2, 4, 4, 8), torch.randn(2, 4, 4, 8)
    freqs = rotary_frequencies(8, 4, 10000.0) * torch.polar(torch.ones(4, 4), torch.randn(4, 4))  # not unit norm
    x.requires_grad_(), freqs.requires_grad_()
    expected = apply_rotary(x, freqs)
    expected_grads = torch.autograd.grad(expected, (x, freqs), cotangent)
    results = {}
    for name, fn in {"eager": apply_rotary, "jit": thunder.jit(apply_rotary)}.items():
        dx = distribute_tensor(x.detach(), mesh, [x_placement]).requires_grad_()
        dfreqs = distribute_tensor(freqs.detach(), mesh, [freqs_placement]).requires_grad_()
        out = fn(dx, dfreqs)
        grads = torch.autograd.grad(out, (dx, dfreqs), distribute_tensor(cotangent, mesh, out.placements))
        results[name] = (out, grads)
    for name, (out, grads) in results.items():
        torch.testing.assert_close(_full(out), expected, msg=name)
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(_full(g), e, msg=name)
    (eager_out, eager_grads), (jit_out, jit_grads) = results["eager"], results["jit"]
    assert jit_out.placements == eager_out.placements
    assert [g.placements for g in jit_grads] == [g.placements for g in eager_grads]


PROPERTIES = {
    "mT": lambda x: x.mT * 2,
    "T": lambda x: x[0].T * 2,
    "real": lambda x: torch.view_as_complex(x[..., :2].contiguous()).real * 3,
    "imag": lambda x: torch.view_as_complex(x[..., :2].contiguous()).imag * 3,
}


@pytest.mark.parametrize("prop", PROPERTIES)
def test_tensor_properties_on_dtensors(prop):
    """``x.mT``, ``x.T``, ``z.real``, ``z.imag`` are properties, not methods: read on the DTensor."""
    fn, mesh = PROPERTIES[prop], mesh_1d()
    x = torch.randn(4, 4, 6)
    for placement in (Shard(0), Shard(1), Replicate()):
        dx = distribute_tensor(x, mesh, [placement]).requires_grad_()
        dx_eager = distribute_tensor(x, mesh, [placement]).requires_grad_()
        full_x = x.clone().requires_grad_()
        out, eager_out, full_out = thunder.jit(fn)(dx), fn(dx_eager), fn(full_x)
        torch.testing.assert_close(out.full_tensor(), full_out)
        assert out.placements == eager_out.placements
        cotangent = torch.randn(full_out.shape)
        full_out.backward(cotangent)
        for o in (out, eager_out):
            o.backward(distribute_tensor(cotangent, mesh, o.placements))
        torch.testing.assert_close(dx.grad.full_tensor(), full_x.grad)
        assert dx.grad.placements == dx_eager.grad.placements
