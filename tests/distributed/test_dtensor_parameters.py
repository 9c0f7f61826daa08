"""A DTensor parameter inside a jitted program is a Parameter, as in eager: ``isinstance(p, nn.Parameter)``,
``named_parameters()`` (in the module's order), ``requires_grad``, and gradient hooks registered on it in the
forward (transformers' tensor parallelism does so), which fire with eager's gradients."""

from __future__ import annotations

from thunder_dtensor.testing import mesh_1d

import thunder
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    return parallelize_module(model, mesh_1d(), {"0": ColwiseParallel(output_layouts=Replicate())})


def _run(jit: bool) -> tuple[list, list, list]:
    model = _model()
    seen: list = []
    hooked: dict = {}

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, list]:
        facts = [
            (n, isinstance(p, nn.Parameter), isinstance(p, DTensor), p.requires_grad)
            for n, p in model.named_parameters()
        ]
        if not hooked:  # once, as transformers guards its registrations
            weight = model[0].weight
            weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.full_tensor()))
            weight.register_hook(lambda g: g * 2)
            hooked["done"] = True
        return model(x).square().sum(), facts

    run = thunder.jit(fn) if jit else fn
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    facts = []
    for _ in range(2):
        loss, facts = run(x)
        loss.backward()
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    return facts, seen, grads


def test_dtensor_parameters_are_parameters_with_hooks_in_the_program():
    (facts, seen, grads), (eager_facts, eager_seen, eager_grads) = _run(True), _run(False)
    assert facts == eager_facts
    assert [name for name, *_ in facts] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert len(seen) == len(eager_seen) == 2  # the post-accumulate hook fired in each backward
    for a, b in zip(seen, eager_seen):
        torch.testing.assert_close(a, b)
    for a, b in zip(grads, eager_grads):  # the weight's gradient doubled by the tensor hook, in both
        torch.testing.assert_close(a, b)
