"""Only thunder_dtensor's executors run dtensor prims, collectives and the DTensor boundary, whatever
executors the user passes."""

import copy

from thunder_dtensor import DTensorProxy, dtensor_ex
from thunder_dtensor.lowering import COLLECTIVE_SYMBOLS, dtensor_comm_ex
from thunder_dtensor.primitive import DTENSOR_PRIMS
from thunder_dtensor.testing import make_full, mesh_1d

import pytest
import thunder
import torch
from thunder.extend import get_executor
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def _available_executors():
    names = ["torchcompile", "torch", "python", "nvfuser"]
    return [ex for ex in (get_executor(n) for n in names) if ex is not None]


def fn(x, w, b):
    return ((x * w + b).sigmoid() * 2.0 - x / 3).float()


def _touches_dtensor(bsym):
    return any(isinstance(p, DTensorProxy) for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs))


OURS = (dtensor_ex, dtensor_comm_ex)


@pytest.mark.parametrize("lowering", [True, False], ids=["lowered", "eager_prims"])
@pytest.mark.parametrize("executors", [None, "all"], ids=["default", "torchcompile+torch+python+nvfuser"])
def test_every_dtensor_bsym_runs_on_dtensor_executor(executors, lowering):
    mesh = mesh_1d()
    x = distribute_tensor(make_full((8, 8), seed=0), mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(make_full((8, 8), seed=1), mesh, [Replicate()]).requires_grad_()
    b = distribute_tensor(make_full((8,), seed=2), mesh, [Replicate()]).requires_grad_()
    kwargs = {} if executors is None else {"executors": _available_executors()}
    jfn = thunder.jit(fn, dtensor_lowering=lowering, **kwargs)
    out = jfn(x, w, b)
    out.sum().backward()

    for trace in (thunder.last_traces(jfn)[-1], thunder.last_backward_traces(jfn)[-1]):
        dtensor_bsyms = [b for b in trace.bound_symbols if "dtensor" in b.sym.name]
        assert dtensor_bsyms, "expected dtensor symbols in the execution trace"
        for bsym in dtensor_bsyms:
            assert bsym.sym.executor in OURS, f"{bsym.sym.name} runs on {bsym.sym.executor}"
        for bsym in trace.bound_symbols:
            # thunder's bookkeeping (unpack, del, return) has no executor; every other executor leaves DTensors alone
            if bsym.sym.executor not in (None, *OURS):
                assert not _touches_dtensor(bsym), f"{bsym.sym.name} on {bsym.sym.executor} touches a DTensor"
            if bsym.sym.name in COLLECTIVE_SYMBOLS:
                assert bsym.sym.executor is dtensor_comm_ex

    if lowering and executors == "all":  # thunder's torch.compile executor fuses the lowered local math
        fused = [b for b in thunder.last_traces(jfn)[-1].bound_symbols if b.sym.name.startswith("TorchCompile")]
        assert fused and any(s.sym.name in ("mul", "add") for b in fused for s in b.subsymbols)
        torch.testing.assert_close(out.full_tensor(), fn(*(t.full_tensor() for t in (x, w, b))))

    # no other executor claims a dtensor prim; a collective only thunder's torch.compile executor, whose regions the
    # torch executor runs (inductor compiles functional collectives), never where no fusion executor takes it (above)
    for ex in _available_executors():
        for name, prim in DTENSOR_PRIMS.items():
            assert prim.id not in ex.implmap, f"{ex.name} has an implementation of {name}"
        for name, sym in COLLECTIVE_SYMBOLS.items():
            assert ex.name in ("torchcompile", "torch") or sym.id not in ex.implmap, f"{ex.name} has {name}"


@pytest.mark.world_size(2)
def test_the_autograd_bridges_dummies_skip_random_numbers_in_dtensor_programs_only(monkeypatch):
    """The speed-up ``make_autograd_dummies_without_random_numbers`` acts while a DTensor program runs (its
    forward and backward), not in a plain program's, though both run after their call's compilation."""
    from thunder_dtensor._integration.fixes import speedups

    from thunder.executors import torch_autograd

    made = []
    bridge_torch = type(torch_autograd.torch)
    original = bridge_torch.__dict__["randn"]

    def noting(*size, **kwargs):
        made.append(speedups._dummies_without_random_numbers())
        return original(*size, **kwargs)

    monkeypatch.setattr(bridge_torch, "randn", staticmethod(noting))
    x = distribute_tensor(make_full((8, 4), seed=3), mesh_1d(), [Shard(0)]).requires_grad_()
    jitted = thunder.jit(lambda x: (x * 2).sum())
    for _ in range(2):
        jitted(x).backward()
    assert made == [True] * 4, made
    made.clear()
    plain = thunder.jit(lambda y: (y * 2).sum())
    for _ in range(2):
        plain(torch.randn(8, 4, requires_grad=True)).backward()
    assert made == [False] * 4, made


def _raises_key_error() -> None:
    raise KeyError("absent")


@pytest.mark.world_size(2)
def test_a_step_closing_over_a_sharded_module_is_a_dtensor_program_from_its_first_instruction(monkeypatch):
    """A training step that closes over its tensor-parallel model is a DTensor program as its call starts, before
    the trace reaches a parameter: the speed-ups act from the first instruction (here the stand-in frame of an
    exception raised and caught before the model runs); a step closing over a plain module is a plain program."""
    from thunder_dtensor._integration.fixes import speedups

    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    made = []
    original = speedups._stand_in_frame
    monkeypatch.setattr(speedups, "_stand_in_frame", lambda *where: made.append(where[3]) or original(*where))

    def step_of(model):
        def step(x):
            try:
                _raises_key_error()
            except KeyError:
                pass
            return model(x).sum()

        return step

    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 8)
    sharded = parallelize_module(copy.deepcopy(plain), mesh_1d(), ColwiseParallel(use_local_output=False))
    x = make_full((3, 4), seed=5)
    expected = step_of(plain)(x)
    torch.testing.assert_close(thunder.jit(step_of(plain))(x), expected)
    assert made == []  # thunder's own frames for a plain program
    out = thunder.jit(step_of(sharded))(x)
    assert made and made[0] == "_raises_key_error", made
    torch.testing.assert_close(out.full_tensor(), expected)
    # thunderfx's function is torch.compile's wrapper of the step: the closure is the wrapped function's
    from thunder_dtensor._integration.program_scope import has_dtensor_inputs

    assert has_dtensor_inputs(torch.compile(step_of(sharded)), (x,), {})
    assert not has_dtensor_inputs(torch.compile(step_of(plain)), (x,), {})
