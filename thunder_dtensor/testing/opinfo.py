"""A sweep over torch's OpInfo database on DTensors: thunder_dtensor beside eager DTensor, same samples.

Each sample's tensors become DTensors the way torch's own DTensor op tests make them: a tensor is sharded
on a dim whose size the mesh divides (the first such dim of the first tensor argument), every other
tensor is replicated. A sample passes when it runs and its outputs (and, for ops with autograd, the input
gradients) equal plain torch's on the full tensors.

Samples that draw random numbers (dropout in training, SDPA with ``dropout_p > 0``) are seeded alike for
every run; eager DTensor draws each shard's numbers its own way, so thunder_dtensor is compared with eager
DTensor (same seed), not with plain torch, and dropout outputs must look like dropout (not the identity).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

#: ops models use: pointwise, reductions, matmul, views, normalization, losses, attention, factories
MODEL_OPS: tuple[str, ...] = (
    # pointwise unary
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfinv", "exp", "exp2", "expm1", "floor",
    "frac", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin",
    "sinh", "sqrt", "square", "tan", "tanh", "trunc", "positive", "deg2rad", "rad2deg", "logit", "nan_to_num",
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.elu",
    "nn.functional.leaky_relu", "nn.functional.hardtanh", "nn.functional.mish", "nn.functional.softplus",
    "nn.functional.logsigmoid", "nn.functional.hardswish", "nn.functional.relu6", "nn.functional.celu",
    "nn.functional.selu", "nn.functional.hardsigmoid", "nn.functional.tanhshrink", "nn.functional.softsign",
    # pointwise binary / ternary
    "add", "sub", "mul", "div", "true_divide", "pow", "float_power", "maximum", "minimum", "fmax", "fmin",
    "fmod", "remainder", "atan2", "hypot", "eq", "ne", "lt", "le", "gt", "ge", "where", "clamp", "clamp_min",
    "clamp_max", "lerp", "addcmul", "addcdiv", "logical_and", "logical_or", "logical_not", "logical_xor",
    "masked_fill", "copysign", "xlogy", "rsub", "isnan", "isinf", "isfinite", "bitwise_and",
    # reductions
    "sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "prod", "norm",
    "logsumexp", "argmax", "argmin", "all", "any", "cumsum", "cumprod", "nansum", "linalg.vector_norm",
    "count_nonzero", "aminmax",
    # matmul
    "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "dot", "outer", "einsum", "nn.functional.linear",
    "nn.functional.bilinear", "inner", "tensordot",
    # views and data movement
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "expand",
    "contiguous", "split", "split_with_sizes", "chunk", "cat", "stack", "narrow", "select", "unbind", "t",
    "flip", "roll", "repeat", "tile", "movedim", "swapaxes", "view_as", "reshape_as", "expand_as",
    "index_select", "gather", "tril", "triu", "diagonal", "hstack", "vstack", "dstack", "clone", "fill",
    "zero_", "masked_select", "take_along_dim", "broadcast_to", "atleast_2d", "ravel",
    # normalization, softmax, losses, attention, embedding
    "softmax", "log_softmax", "nn.functional.softmax", "nn.functional.log_softmax", "nn.functional.layer_norm",
    "nn.functional.rms_norm", "nn.functional.group_norm", "nn.functional.normalize", "nn.functional.embedding",
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.mse_loss",
    "nn.functional.l1_loss", "nn.functional.smooth_l1_loss", "nn.functional.huber_loss",
    "nn.functional.binary_cross_entropy_with_logits", "nn.functional.kl_div", "nn.functional.cosine_similarity",
    "nn.functional.pad", "nn.functional.glu", "nn.functional.scaled_dot_product_attention",
    # random
    "nn.functional.dropout",
    # factories
    "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "new_empty", "empty_like",
)  # fmt: skip

#: OpInfos whose ``op`` is a ``wrapper_set_seed`` lambda (``torch.manual_seed`` inside the call). Under
#: thunder.jit that seeding walks into ``torch.cuda._lazy_call``, which (CUDA not initialised) records
#: ``traceback.format_stack()``: thunder's interpreter then interprets the formatting of its own, very deep,
#: Python stack line by line, which does not finish in any useful time (the "loop"/"hang" seen on SDPA and
#: dropout). The sweep calls the torch function itself and seeds outside the call instead.
_DIRECT_OPS: dict[str, Callable] = {
    "nn.functional.scaled_dot_product_attention": F.scaled_dot_product_attention,
    "nn.functional.dropout": F.dropout,
}

#: the seed set before every call of every sample (plain torch, eager DTensor, thunder_dtensor)
SEED = 42

#: a sample still running after this long is abandoned and recorded as skipped (a safety net: every sample
#: known to hang is skipped up front by ``_known_hang``); the hangs seen were deterministic, so every rank
#: abandons the same sample
SAMPLE_TIMEOUT_S = 120.0

#: ops whose outputs are random or uninitialised: only that they run is checked, not their values
_VALUES_UNCHECKED = ("new_empty", "empty_like")


@dataclasses.dataclass
class OpResult:
    name: str
    samples: int = 0
    eager_fwd: int = 0
    eager_bwd: int = 0
    thunder_fwd: int = 0
    thunder_bwd: int = 0
    bwd_samples: int = 0
    #: samples eager passes and thunder_dtensor fails (forward or backward)
    regressions: int = 0
    #: samples compared with eager DTensor under one seed instead of plain torch (random ops)
    random_samples: int = 0
    first_error: str = ""
    #: samples not run, with the reason
    skipped: list[str] = dataclasses.field(default_factory=list)
    #: one line per regression: the sample, what failed, the error
    regression_details: list[str] = dataclasses.field(default_factory=list)
    #: the OpInfo sample indices of those regressions
    regressed_samples: list[int] = dataclasses.field(default_factory=list)
    #: one line per sample plain torch runs and thunder_dtensor fails (forward or backward), with the error
    failure_details: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    #: how thunder_dtensor ran the samples it passes (forward): "sharding rule", "decomposition" or
    #: "replicated fallback" (the op's own, or its backward's, the last resort that ran)
    how: dict[str, int] = dataclasses.field(default_factory=dict)


def _shard_choice(t: torch.Tensor, world: int) -> list:
    from torch.distributed.tensor import Replicate, Shard

    if t.dtype != torch.bool:
        for d, s in enumerate(t.shape):
            if s > 1 and s % world == 0:
                return [Shard(d)]
    return [Replicate()]


def _to_dtensors(sample_args: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import Replicate, distribute_tensor

    first = [True]

    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        placements = _shard_choice(x, mesh.size()) if first[0] and x.ndim > 0 else [Replicate()]
        first[0] = False
        d = distribute_tensor(x.detach().clone(), mesh, placements)
        return d.requires_grad_(x.requires_grad)

    return pytree.tree_map(convert, sample_args)


def _plain_copy(sample_args: Any) -> Any:
    return pytree.tree_map(
        lambda x: x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x,
        sample_args,
    )


class _WrongGlobalShape:
    """A DTensor whose global shape is not its full tensor's (torch 2.13: ``F.linear`` of a 1-D input with a
    Partial result is ``[1, N]`` around ``[N]`` locals): equal to nothing, so the sample fails."""


def _full(x: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return x
    full = x.full_tensor()
    return full if tuple(full.shape) == tuple(x.shape) else _WrongGlobalShape()


def _close(actual: Any, expected: Any) -> bool:
    a_flat, _ = pytree.tree_flatten(pytree.tree_map(_full, actual))
    e_flat, _ = pytree.tree_flatten(pytree.tree_map(_full, expected))
    if len(a_flat) != len(e_flat):
        return False
    for a, e in zip(a_flat, e_flat):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != e.shape:
                return False
            if not torch.allclose(a.to(e.dtype), e, rtol=1e-4, atol=1e-5, equal_nan=True):
                return False
        elif a != e:
            return False
    return True


def _grads_close(grads: list | None, expected: list | None) -> bool:
    return (
        grads is not None
        and expected is not None
        and len(grads) == len(expected)
        and all(
            (g is None and e is None) or (g is not None and e is not None and _close(g, e))
            for g, e in zip(grads, expected)
        )
    )


def _grads(fn: Callable, args: Any, kwargs: Any) -> tuple[Any, list | None]:
    """``fn``'s output (seeded with ``SEED``) and the gradients of its inputs for all-ones cotangents."""
    torch.manual_seed(SEED)
    out = fn(*args, **kwargs)
    return out, _backward(out, args, kwargs)


def _backward(out: Any, args: Any, kwargs: Any) -> list | None:
    """The full gradients of the inputs that require grad, for all-ones (full-valued) cotangents; None without."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.requires_grad]
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not leaves or not outs:
        return None
    from torch.distributed.tensor import DTensor

    def ones_like(o: torch.Tensor) -> torch.Tensor:
        if isinstance(o, DTensor):  # a full-valued cotangent
            from torch.distributed.tensor import Replicate, distribute_tensor

            placements = [Replicate() if p.is_partial() else p for p in o.placements]
            return distribute_tensor(torch.ones(o.shape, dtype=o.dtype, device=o.device), o.device_mesh, placements)
        return torch.ones_like(o)

    grads = torch.autograd.grad(outs, leaves, [ones_like(o) for o in outs], allow_unused=True)
    return [None if g is None else _full(g) for g in grads]


def _random_p(name: str, sample: Any) -> float | None:
    """The drop probability of a sample that draws random numbers; None for a deterministic sample."""
    if name == "nn.functional.dropout":
        p = sample.args[0] if sample.args else sample.kwargs.get("p", 0.5)
        training = sample.args[1] if len(sample.args) > 1 else sample.kwargs.get("training", True)
        return p if training and 0.0 < p < 1.0 else None
    if name == "nn.functional.scaled_dot_product_attention":
        p = sample.kwargs.get("dropout_p", 0.0)
        return p if p > 0.0 else None
    return None


def looks_like_dropout(out: Any, grads: list | None, x: torch.Tensor, p: float) -> bool:
    """Every element dropped (0) or kept and scaled by 1/(1-p), not the identity; the gradient uses that mask.

    With 16 or more elements both some dropped and some kept elements are required (seeded: deterministic).
    """
    out, x = _full(out), x.detach()
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return False
    out = out.detach()
    kept = torch.isclose(out, x / (1.0 - p), rtol=1e-5, atol=1e-6) & (x != 0)
    dropped = out == 0
    if not bool((kept | dropped).all()) or torch.equal(out, x):
        return False
    if x.numel() >= 16 and not (bool(kept.any()) and bool((dropped & (x != 0)).any())):
        return False
    if grads is not None:  # d out / d x: 1/(1-p) where kept, 0 where dropped (undecidable where x == 0)
        g, known = grads[0], x != 0
        if g is None:
            return False
        expected = torch.where(kept, torch.full_like(x, 1.0 / (1.0 - p)), torch.zeros_like(x))
        return bool(torch.allclose(g[known], expected[known], rtol=1e-5, atol=1e-6))
    return True


@dataclasses.dataclass
class _Outcome:
    out: Any = None
    grads: list | None = None
    #: why the forward (then there is no backward either) or only the backward failed to run
    fwd_error: str = ""
    bwd_error: str = ""
    #: how thunder_dtensor ran it (see ``OpResult.how``)
    how: str = "sharding rule"


#: the ways an op runs, from the most to the least preferred
HOW = ("sharding rule", "decomposition", "replicated fallback")


def _how_it_ran() -> str:
    """The least preferred way any op of the last trace ran (``thunder_dtensor.ops.no_rule.HOW_OPS_RAN``)."""
    from thunder_dtensor.ops.no_rule import HOW_OPS_RAN

    return max(HOW_OPS_RAN.values(), key=HOW.index, default=HOW[0])


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:160]}"


def _run(kind: str, fn: Callable, sample: Any, mesh: Any) -> _Outcome:
    import thunder

    args, kwargs = _to_dtensors(((sample.input, *sample.args), sample.kwargs), mesh)

    def call(*a: Any, **k: Any) -> Any:
        return fn(*a, **k)

    from thunder_dtensor.ops.no_rule import HOW_OPS_RAN

    HOW_OPS_RAN.clear()
    try:
        torch.manual_seed(SEED)
        out = (thunder.jit(call) if kind == "thunder" else call)(*args, **kwargs)
    except Exception as e:
        needs_grad = any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves((args, kwargs)))
        if kind != "thunder" or not needs_grad:
            return _Outcome(fwd_error=_error(e))
        # thunder traces the backward with the forward: an error of the backward's trace surfaces here.
        # The forward alone (no input requires grad) tells which of the two fails.
        detached = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        try:
            torch.manual_seed(SEED)
            out = thunder.jit(call)(*detached[0], **detached[1])
        except Exception:
            return _Outcome(fwd_error=_error(e))
        return _Outcome(out, bwd_error=_error(e), how=_how_it_ran())
    try:
        return _Outcome(out, _backward(out, args, kwargs), how=_how_it_ran())
    except Exception as e:
        return _Outcome(out, bwd_error=_error(e), how=_how_it_ran())


def _judge(
    name: str, outcome: _Outcome, expected: Any, expected_grads: list | None, has_bwd: bool
) -> tuple[bool, bool | None, str]:
    """(forward passes, backward passes or None without autograd, why not)."""
    if outcome.fwd_error:
        return False, False if has_bwd else None, outcome.fwd_error
    fwd = name in _VALUES_UNCHECKED or _close(outcome.out, expected)
    if not has_bwd:
        return fwd, None, "" if fwd else "wrong values"
    bwd = not outcome.bwd_error and (name in _VALUES_UNCHECKED or _grads_close(outcome.grads, expected_grads))
    if outcome.grads is None and not outcome.bwd_error:
        wrong_grads = f"no output requires grad (plain torch's input gradients: {str(expected_grads)[:60]})"
    else:
        wrong_grads = "wrong gradients"
    why = "wrong values" if not fwd else outcome.bwd_error or ("" if bwd else wrong_grads)
    return fwd, bwd, why


def _describe(index: int, sample: Any) -> str:
    def short(x: Any) -> Any:
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}" if isinstance(x, torch.Tensor) else x

    args = pytree.tree_map(short, (sample.input, *sample.args))
    kwargs = pytree.tree_map(short, sample.kwargs)
    return f"sample {index}: args={args} kwargs={kwargs}"


def _known_hang(name: str, sample: Any) -> str | None:
    """Why a sample cannot be run at all (it never finishes, in eager DTensor too), or None."""
    if name != "unflatten" or len(sample.args) < 2:
        return None
    sizes = sample.args[1]
    if sample.input.numel() == 0 and 0 in sizes and any(s not in (0, 1) for s in sizes):
        # e.g. f32[4, 0].unflatten(1, (2, 0, 0, 0)): torch.distributed.tensor._ops._view_ops.view_groups
        # never terminates (a 0-size group never matches), eager DTensor and our trace-time propagation alike
        return "eager DTensor hangs: view_groups loops forever on a zero-size unflatten (torch bug)"
    return None


class _SampleTimeout(BaseException):
    """Raised in the main thread when a sample exceeds ``SAMPLE_TIMEOUT_S``."""


@contextlib.contextmanager
def _time_limit(seconds: float, fired: list[bool]) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (main thread, POSIX); ``fired[0]`` says whether it did, since
    thunder's interpreter turns the interrupt into an ordinary error that ``_run`` records."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        fired[0] = True
        raise _SampleTimeout(f"sample ran longer than {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def select_opinfos(names: Iterable[str]) -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    wanted = set(names)
    return [op for op in op_db if op.name in wanted]


def sweep(
    names: Iterable[str],
    mesh: Any,
    *,
    max_samples: int | None = None,
    sample_indices: Mapping[str, Sequence[int]] | None = None,
    progress: bool = False,
) -> list[OpResult]:
    """Run every selected OpInfo (all its variants) on its float32 samples: the first ``max_samples`` (or all),
    or for an op named in ``sample_indices`` the samples at those indices.

    Per sample: plain torch on the full tensors, eager DTensor, thunder_dtensor, each seeded with ``SEED``.
    Deterministic samples must match plain torch; random ones (see ``_random_p``) must match eager DTensor
    (or, where eager DTensor fails, plain torch) and, for dropout, look like dropout.
    """
    results: dict[str, OpResult] = {}
    start = time.perf_counter()
    for op in select_opinfos(names):
        if progress:
            print(f"[{time.perf_counter() - start:6.1f}s] {op.name} {op.variant_test_name}", flush=True)
        op_start = time.perf_counter()
        key = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        result = results.setdefault(key, OpResult(key))
        if not op.supports_dtype(torch.float32, "cpu"):
            continue
        fn = _DIRECT_OPS.get(op.name, op.op)
        try:
            samples = list(op.sample_inputs(mesh.device_type, torch.float32, requires_grad=op.supports_autograd))
        except Exception:
            continue
        indices = (sample_indices or {}).get(op.name, range(len(samples))[:max_samples])
        for index in indices:
            sample = samples[index]
            hang = _known_hang(op.name, sample)
            if hang:
                result.skipped.append(f"{_describe(index, sample)}: {hang}")
                continue
            plain_args, plain_kwargs = _plain_copy(((sample.input, *sample.args), sample.kwargs))
            try:
                expected, expected_grads = _grads(fn, plain_args, plain_kwargs)
            except Exception:
                continue
            has_bwd = expected_grads is not None
            fired = [False]
            try:
                with _time_limit(SAMPLE_TIMEOUT_S, fired):
                    eager = _run("eager", fn, sample, mesh)
                    ours = _run("thunder", fn, sample, mesh)
            except _SampleTimeout:
                pass
            if fired[0]:
                result.skipped.append(f"{_describe(index, sample)}: timed out after {SAMPLE_TIMEOUT_S:.0f} s")
                _barrier(mesh)
                continue
            result.samples += 1
            result.bwd_samples += has_bwd
            p = _random_p(op.name, sample)
            if p is None:
                e_fwd, e_bwd, _ = _judge(key, eager, expected, expected_grads, has_bwd)
                t_fwd, t_bwd, error = _judge(key, ours, expected, expected_grads, has_bwd)
            else:
                result.random_samples += 1
                e_fwd = not eager.fwd_error  # eager DTensor is the reference here: it passes when it runs
                e_bwd = (e_fwd and not eager.bwd_error) if has_bwd else None
                reference = eager if e_fwd else _Outcome(expected, expected_grads)
                t_fwd, t_bwd, error = _judge(key, ours, reference.out, reference.grads, has_bwd)
                if op.name == "nn.functional.dropout":
                    e_ok = e_fwd and looks_like_dropout(eager.out, eager.grads, sample.input, p)
                    t_ok = t_fwd and looks_like_dropout(ours.out, ours.grads, sample.input, p)
                    e_fwd, t_fwd = e_fwd and e_ok, t_fwd and t_ok
                    e_bwd, t_bwd = (bool(e_bwd) and e_ok, bool(t_bwd) and t_ok) if has_bwd else (None, None)
                    error = error or ("" if t_ok else "not a dropout of the input")
            result.eager_fwd += e_fwd
            result.thunder_fwd += t_fwd
            if t_fwd:
                result.how[ours.how] = result.how.get(ours.how, 0) + 1
            result.eager_bwd += bool(e_bwd)
            result.thunder_bwd += bool(t_bwd)
            regression = (e_fwd and not t_fwd) or (bool(e_bwd) and not t_bwd)
            result.regressions += regression
            if regression:
                phase = "forward" if e_fwd and not t_fwd else "backward"
                result.regression_details.append(f"{_describe(index, sample)}: {phase}: {error}")
                result.regressed_samples.append(index)
            if not t_fwd or (has_bwd and not t_bwd):
                phase = "forward" if not t_fwd else "backward"
                random = (
                    " (random: compared with plain torch, eager DTensor fails)" if p is not None and not e_fwd else ""
                )
                result.failure_details.append(f"{_describe(index, sample)}: {phase}{random}: {error}")
            if error and not result.first_error:
                result.first_error = error
        result.seconds += time.perf_counter() - op_start
    return [r for r in results.values() if r.samples or r.skipped]


def _barrier(mesh: Any) -> None:
    """Line the ranks up again after an abandoned sample."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier(group=mesh.get_group())


def summary(results: list[OpResult]) -> dict[str, int]:
    """Totals over a sweep: ops, samples, forward / backward passes of eager and thunder_dtensor, regressions."""
    return {
        "ops": len(results),
        "samples": sum(r.samples for r in results),
        "random_samples": sum(r.random_samples for r in results),
        "eager_fwd": sum(r.eager_fwd for r in results),
        "thunder_fwd": sum(r.thunder_fwd for r in results),
        "bwd_samples": sum(r.bwd_samples for r in results),
        "eager_bwd": sum(r.eager_bwd for r in results),
        "thunder_bwd": sum(r.thunder_bwd for r in results),
        "regressions": sum(r.regressions for r in results),
        "skipped": sum(len(r.skipped) for r in results),
        "thunder_failures": sum(len(r.failure_details) for r in results),
        **{f"fwd_by_{how.replace(' ', '_')}": sum(r.how.get(how, 0) for r in results) for how in HOW},
    }


def to_markdown(results: list[OpResult], world_size: int, *, max_samples: int | None = None) -> str:
    """The sweep's section of ``docs/op_coverage.md`` for one world size."""
    s = summary(results)
    which = "every sample of each op" if max_samples is None else f"the first {max_samples} samples of each op"
    how = ", ".join(f"{s['fwd_by_' + h.replace(' ', '_')]} by {h}" for h in HOW)
    lines = [
        f"## OpInfo sweep, {world_size} ranks",
        "",
        f"torch's OpInfo samples (float32, {which}) as DTensors on a {world_size}-rank CPU mesh "
        "(the first tensor sharded on a dim the mesh divides, the others replicated), run with eager DTensor "
        "and with thunder_dtensor. A sample passes when it runs and matches plain torch on the full tensors "
        "(a DTensor's global shape included), "
        "forward and, for ops with autograd, the input gradients. Samples plain torch fails are not counted. "
        "Samples that draw random numbers (dropout "
        f"in training, SDPA with `dropout_p > 0`; {s['random_samples']} samples) run under one seed and are "
        "compared with eager DTensor (plain torch where eager DTensor fails); dropout outputs must also be a "
        "dropout of the input (each element dropped or scaled by 1/(1-p), not the identity).",
        "",
        f"**{s['ops']} ops, {s['samples']} samples.** Forward: eager {s['eager_fwd']}, thunder_dtensor "
        f"{s['thunder_fwd']} ({how}). Backward ({s['bwd_samples']} samples): eager {s['eager_bwd']}, "
        f"thunder_dtensor {s['thunder_bwd']}. Samples eager passes and thunder_dtensor fails: {s['regressions']}. "
        f"Samples thunder_dtensor fails: {s['thunder_failures']}.",
        "",
        "How a sample ran is the least preferred way any op of its forward or backward took: DTensor's "
        "sharding rule, a decomposition into ops that have one, or the replicated fallback.",
        "",
    ]
    details = [f"- `{r.name}` {d}" for r in sorted(results, key=lambda r: r.name) for d in r.regression_details]
    if details:
        lines += ["Samples eager DTensor passes and thunder_dtensor fails:", "", *details, ""]
    failures = [f"- `{r.name}` {d}" for r in sorted(results, key=lambda r: r.name) for d in r.failure_details]
    if failures:
        lines += ["Samples thunder_dtensor fails:", "", *failures, ""]
    skipped = [f"- `{r.name}` {d}" for r in sorted(results, key=lambda r: r.name) for d in r.skipped]
    if skipped:
        lines += ["Samples not run:", "", *skipped, ""]
    lines += [
        "| op | samples | eager fwd | thunder fwd | eager bwd | thunder bwd | how (rule / decomposed / replicated) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r.name):
        bwd = (f"{r.eager_bwd}/{r.bwd_samples}", f"{r.thunder_bwd}/{r.bwd_samples}") if r.bwd_samples else ("-", "-")
        fwd = f"{r.eager_fwd}/{r.samples} | {r.thunder_fwd}/{r.samples}"
        ways = " / ".join(str(r.how.get(h, 0)) for h in HOW)
        lines.append(f"| `{r.name}` | {r.samples} | {fwd} | {bwd[0]} | {bwd[1]} | {ways} |")
    return "\n".join(lines) + "\n"
