"""Helpers for tests that train a parallelized model and compare it with the same model in one process."""

from __future__ import annotations

from typing import Any, cast

import thunder
import torch
import torch.nn as nn
from thunder.dynamo import thunderfx
from torch.distributed.tensor import DTensor

__all__ = ["COMPILERS", "PARITY_TOL", "assert_grads_match", "full_value", "thunder_program"]

#: the front ends a model is compiled with
COMPILERS = {"jit": thunder.jit, "thunderfx": thunderfx}
#: losses and gradients of a parallelized model against the one-process model's (fp32)
PARITY_TOL = {"rtol": 1e-4, "atol": 2e-5}


def full_value(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_grads_match(model: nn.Module, ref: nn.Module, what: str, **tol: float) -> None:
    """Every parameter's gradient equals the reference's (full values; DTensor or not); None exactly where its is."""
    tol = tol or PARITY_TOL
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if r.grad is None:
            assert p.grad is None, f"{what}: {name} has a gradient, the reference none"
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient"
        expected = full_value(r.grad)
        # (mypy cannot infer the type of a lambda with a default argument)
        torch.testing.assert_close(
            full_value(p.grad),
            expected,
            **cast(dict[str, Any], tol),  # rtol / atol
            msg=lambda m, n=name: f"{what}: {n}: {m}",  # type: ignore[misc]
        )


def thunder_program(compiled: Any, compiler: str) -> Any:
    """The thunder-compiled program behind ``compiled``; for thunderfx, after checking nothing was split off.

    Under thunderfx the model must be one dynamo graph (no graph breaks) handed to thunder whole: no split
    reasons, no piece left to inductor.
    """
    if compiler == "jit":
        return compiled
    infos = compiled._backend.subgraph_infos
    assert len(infos) == 1, f"{len(infos)} dynamo graphs: the model should compile without graph breaks"
    (info,) = infos
    assert info.split_reasons == [], [r.info for r in info.split_reasons]
    pieces = [name for name, _ in info.split_graph_module.named_children()]
    assert pieces == ["thunder_0"], pieces
    (program,) = info.thunder_compiled_fns
    return program
