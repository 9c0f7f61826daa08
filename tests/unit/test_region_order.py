"""A fusion region that thunder's rematerialization rebuilds keeps the program's order
(``keep_fused_regions_in_program_order``): thunder 0.2.6 re-sorts the whole region bottom-up, so that work no later
symbol reads (weight gradients; in an FSDP2 backward, the reduce-scatters) sinks to the region's end."""

from types import SimpleNamespace

from thunder_dtensor import fixes
from thunder_dtensor._integration import in_stable_topological_order

import pytest
import thunder
import torch
from thunder.executors.torch_compile import torch_compile_ex


def _bsym(name: str, reads: tuple[str, ...], writes: tuple[str, ...]) -> SimpleNamespace:
    proxies = lambda names: [SimpleNamespace(name=n) for n in names]  # noqa: E731
    return SimpleNamespace(label=name, flat_proxy_args=proxies(reads), flat_proxy_outs=proxies(writes))


def _labels(bsyms: list) -> list[str]:
    return [b.label for b in bsyms]


def test_symbols_in_dependence_order_keep_their_order():
    bsyms = [_bsym("a", ("x",), ("t0",)), _bsym("b", ("y",), ("t1",)), _bsym("c", ("t0", "t1"), ("t2",))]
    assert _labels(in_stable_topological_order(bsyms)) == ["a", "b", "c"]


def test_a_symbol_moves_only_as_far_as_its_inputs_require():
    # "r" (a recomputation put first) reads what "p" makes: it goes right after "p", the rest keeps its order
    bsyms = [
        _bsym("r", ("t1",), ("t5",)),
        _bsym("a", ("x",), ("t0",)),
        _bsym("p", ("t0",), ("t1",)),
        _bsym("q", ("x",), ("t2",)),
        _bsym("s", ("t5", "t2"), ("t3",)),
    ]
    assert _labels(in_stable_topological_order(bsyms)) == ["a", "p", "r", "q", "s"]


def test_a_dependence_cycle_is_refused():
    with pytest.raises(RuntimeError, match="cycle"):
        in_stable_topological_order([_bsym("a", ("t1",), ("t0",)), _bsym("b", ("t0",), ("t1",))])


def _mlp(x, w0, w1, w2):
    for w in (w0, w1, w2):
        x = torch.nn.functional.gelu(x @ w) + x
    return x.sum()


def _weight_gradient_positions() -> tuple[list[int], list[int]]:
    """Positions, in the backward's symbols (inside its regions), of the matmuls that make the weights' gradients
    and of the others (the inputs' gradients), for a 3-layer MLP under thunder's torch.compile executor."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(32, 32, generator=g, requires_grad=True) for _ in range(3)]
    jitted = thunder.jit(_mlp, executors=[torch_compile_ex, *thunder.get_default_executors()])
    jitted(torch.randn(8, 32, generator=g), *weights).backward()
    backward = thunder.last_backward_traces(jitted)[-1]
    returned = {p.name for p in backward.bound_symbols[-1].flat_proxy_args}
    symbols: list = []

    def visit(bsyms: list) -> None:
        for b in bsyms:
            if b.sym.is_fusion:
                visit(b.subsymbols)
            else:
                symbols.append(b)

    visit(backward.bound_symbols)
    matmuls = [(i, b) for i, b in enumerate(symbols) if b.sym.name == "matmul"]
    weight_grads = [i for i, b in matmuls if b.flat_proxy_outs[0].name in returned]
    others = [i for i, b in matmuls if b.flat_proxy_outs[0].name not in returned]
    assert len(weight_grads) == 3 and len(others) >= 2
    return weight_grads, others


def test_weight_gradients_stay_beside_their_layers_backward():
    with fixes.enabled("keep_fused_regions_in_program_order", everywhere=True):
        weight_grads, others = _weight_gradient_positions()
    assert weight_grads[0] < others[-1], (weight_grads, others)  # the last layer's, before the first layer's dX


def test_thunder_without_the_speedup_sinks_weight_gradients_to_the_regions_end():
    with fixes.disabled("keep_fused_regions_in_program_order"):
        weight_grads, others = _weight_gradient_positions()
    assert min(weight_grads) > max(others), (weight_grads, others)
