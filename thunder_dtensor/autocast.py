"""``torch.autocast`` around DTensor programs: the casts autocast makes appear in the trace as dtensor prims.

In eager torch, autocast sits above DTensor in the dispatcher: for an op on its lists it casts the op's
floating inputs (to the low-precision dtype for matmul-like ops, to float32 for losses and the like, to
the widest input dtype for "promote" ops such as ``cat``), and DTensor then runs the op on the cast
DTensors. Those casts are DTensor ops, so their gradients cast back.

thunder applies autocast while it traces (its rules are keyed by its single-device symbols, which our
dispatch replaces on DTensor arguments) and runs its traces under ``no_autocast``: every cast has to be
in the trace. So while thunder traces under an autocast, in either place thunder supports it (the jitted
function *called* under ``torch.autocast``, or ``torch.autocast`` *inside* it), each torch-level dtensor
symbol (one per torch function) asks torch which casts its autocast would make: the torch function runs on
fake plain tensors of the inputs' global shapes and dtypes under ``torch.autocast``, and the casts of its
inputs are recorded (:func:`autocast_policy`). The trace gets those casts as
``dtensor_convert_element_type_prim`` (its gradient casts back), then the op on the cast inputs. torch's
own op lists decide; none is kept here.

When the casts of the inputs do not reproduce what autocast does (a composite op whose *inner* ops autocast
casts, like ``einsum``'s matmuls), the op becomes a prim that runs it under ``torch.autocast`` itself
(``dtensor_autocast_<op>_<device>_<dtype>_prim``), with the generic backward.

A jitted function called under ``torch.autocast`` is also traced under it: the fake runs in dtensor prims'
metas would see an autocast their runtime (under ``no_autocast``) does not. Every dtensor symbol is then
called with torch's autocast off: the trace's explicit casts are the only ones.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.dispatch import torch_function_of_symbol
from thunder_dtensor.executor import dtensor_ex
from thunder_dtensor.ops.pointwise import dtensor_convert_element_type_prim
from thunder_dtensor.primitive import PRIMS, define_dtensor_prim, to_torch_value
from thunder_dtensor.proxy import DTensorProxy

import torch

__all__ = ["AutocastPolicy", "autocast_policy", "install", "torch_function_of"]

#: the device types thunder's autocast knows
_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class AutocastPolicy:
    """What torch's autocast does to one op call.

    ``casts``: (flat input index, dtype) for each input autocast casts. ``explicit``: whether casting those
    inputs and running the op without autocast runs the same aten ops with the same output dtypes (False
    for a composite op whose inner ops autocast casts).
    """

    casts: tuple[tuple[int, torch.dtype], ...]
    explicit: bool


# ---------------------------------------------------------------------------------------------------------
# Which torch function a dtensor symbol stands for
# ---------------------------------------------------------------------------------------------------------
def torch_function_of(sym: ti.Symbol) -> Callable | None:
    """The torch function a DTensor call of which ``sym`` traces, or None (an internal prim).

    A prim's comes from its record (its first dispatch entry: a fallback prim's torch function, say); a
    torch-level dtensor symbol's from the dispatch table.
    """
    record = PRIMS.get(sym.name)
    if record is not None:
        return record.torch_functions[0] if record.torch_functions else None
    return torch_function_of_symbol(sym)


# ---------------------------------------------------------------------------------------------------------
# Asking torch what its autocast does to a call
# ---------------------------------------------------------------------------------------------------------
def _stand_in(x: Any) -> Any:
    """A fake plain tensor for a tensor proxy (a DTensor's global shape), torch values for thunder's."""
    if isinstance(x, ti.TensorProxy):
        dtype, device = ti.dtypes.to_torch_dtype(x.dtype), ti.devices.to_torch_device(x.device)
        return torch.empty(tuple(int(s) for s in x.shape), dtype=dtype, device=device)
    return to_torch_value(x)


def _aten_program(calls: list, skipped: set[int]) -> list[str]:
    return [str(func) for n, (func, _, _) in enumerate(calls) if n not in skipped and func.namespace != "prim"]


def _output_dtypes(out: Any) -> list:
    return [getattr(o, "dtype", None) for o in ti.torch_tree_flatten(out)[0]]


def _probe(torch_fn: Callable, device_type: str, dtype: torch.dtype, leaves: list, spec: Any) -> AutocastPolicy | None:
    with ti.fake_tensor_mode():
        fakes = [_stand_in(x) for x in leaves]
        position = {id(f): i for i, f in enumerate(fakes) if isinstance(f, torch.Tensor)}
        args, kwargs = ti.tree_unflatten(fakes, spec)
        with ti.recording_aten_calls() as calls, torch.autocast(device_type, dtype=dtype):
            out = torch_fn(*args, **kwargs)
        casts: dict[int, torch.dtype] = {}
        input_casts: set[int] = set()
        for n, (func, cargs, ckwargs) in enumerate(calls):
            source: Any = cargs[0] if cargs else None
            if func is torch.ops.aten._to_copy.default and id(source) in position:
                target = ckwargs.get("dtype")
                if target is not None and target != source.dtype:
                    casts.setdefault(position[id(source)], target)
                    input_casts.add(n)
        # the same op on the cast inputs, without autocast: does it run the same program?
        recast = [torch.empty_like(f, dtype=casts[i]) if i in casts else f for i, f in enumerate(fakes)]
        args, kwargs = ti.tree_unflatten(recast, spec)
        with ti.recording_aten_calls() as plain_calls:
            plain_out = torch_fn(*args, **kwargs)
    explicit = _aten_program(calls, input_casts) == _aten_program(plain_calls, set()) and _output_dtypes(
        out
    ) == _output_dtypes(plain_out)
    return AutocastPolicy(tuple(sorted(casts.items())), explicit)


_policy_cache: dict[Any, AutocastPolicy | None] = {}
_POLICY_CACHE_SIZE = 4096


def _cache_key(torch_fn: Callable, device_type: str, dtype: torch.dtype, leaves: list, spec: Any) -> Any:
    def leaf_key(x: Any) -> Any:
        if isinstance(x, ti.TensorProxy):
            return ("tensor", x.dtype, tuple(int(s) for s in x.shape))
        return to_torch_value(x)

    key = (torch_fn, device_type, dtype, spec, tuple(leaf_key(x) for x in leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def autocast_policy(
    torch_fn: Callable, device_type: str, dtype: torch.dtype, leaves: list, spec: Any
) -> AutocastPolicy | None:
    """What ``torch.autocast(device_type, dtype)`` does to ``torch_fn`` on the flat inputs ``leaves``.

    Found by running ``torch_fn`` on fake plain tensors under autocast and recording the casts of its
    inputs (autocast dispatches above DTensor, so a DTensor call is cast the same way). None when the op
    does not run on plain tensors (a DTensor-only method such as ``redistribute``): autocast has no rule
    for those.
    """
    key = _cache_key(torch_fn, device_type, dtype, leaves, spec)
    if key is not None and key in _policy_cache:
        return _policy_cache[key]
    try:
        policy = _probe(torch_fn, device_type, dtype, leaves, spec)
    except Exception:
        policy = None
    if key is not None:
        if len(_policy_cache) >= _POLICY_CACHE_SIZE:
            _policy_cache.clear()
        _policy_cache[key] = policy
    return policy


# ---------------------------------------------------------------------------------------------------------
# The trace: explicit casts, or the op run under autocast
# ---------------------------------------------------------------------------------------------------------
def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, DTensorProxy):
        return dtensor_convert_element_type_prim(x, ti.dtypes.to_dtype(dtype))
    return ti.ltorch.to(x, dtype)  # a plain tensor beside DTensors (a 0-d one, say)


def _run_under_autocast(torch_fn: Callable, device_type: str, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(device_type, dtype=dtype):
        return torch_fn(*args, **kwargs)


#: prim name -> the prim that runs a symbol's torch function under an autocast (one per symbol, device, dtype)
_REGION_PRIMS: dict[str, ti.Symbol] = {}


def _region_prim(sym: ti.Symbol, torch_fn: Callable, device_type: str, dtype: torch.dtype) -> ti.Symbol:
    """The prim that runs ``torch_fn`` under ``torch.autocast`` (made on first use, named after the symbol)."""
    op = sym.name.removeprefix("dtensor_").removesuffix("_prim")
    name = f"autocast_{op}_{device_type}_{str(dtype).removeprefix('torch.')}"
    prim = _REGION_PRIMS.get(name)
    if prim is None:
        run = functools.partial(_run_under_autocast, torch_fn, device_type, dtype)
        prim = _REGION_PRIMS[name] = define_dtensor_prim(name, run)
    return prim


def _is_float_dtensor(x: Any) -> bool:
    return isinstance(x, DTensorProxy) and ti.dtypes.is_float_dtype(x.dtype)


def _call_with_autocast(sym: ti.Symbol, torch_fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``sym(*args, **kwargs)`` as torch's autocast would run its op: casts first, or under autocast."""
    leaves, spec = ti.tree_flatten((args, kwargs))
    first = next((x for x in leaves if _is_float_dtensor(x)), None)
    device_type = ti.devices.devicetype_string(first.device.devicetype) if first is not None else None
    dtype = ti.thunder_autocast_dtype(device_type) if device_type is not None else None
    # (a dtype only for a device type)
    policy = autocast_policy(torch_fn, cast(str, device_type), dtype, leaves, spec) if dtype is not None else None
    with ti.thunder_autocast_disabled():  # what the op calls is not cast again
        if policy is None or (policy.explicit and not policy.casts):
            return sym(*args, **kwargs)
        if not policy.explicit:
            return _region_prim(sym, torch_fn, cast(str, device_type), cast(torch.dtype, dtype))(*args, **kwargs)
        for i, target in policy.casts:
            leaves[i] = _cast(leaves[i], target)
        cast_args, cast_kwargs = ti.tree_unflatten(leaves, spec)
        return sym(*cast_args, **cast_kwargs)


def _is_dtensor_symbol(sym: ti.Symbol) -> bool:
    return (isinstance(sym.id, str) and sym.id.startswith("thunder_dtensor.")) or sym.executor is dtensor_ex


def _thunder_autocast_active() -> bool:
    return any(ti.thunder_autocast_dtype(d) is not None for d in _DEVICE_TYPES)


def replacement_for(sym: ti.Symbol) -> Callable | None:
    """How thunder calls ``sym`` now (thunder's autocast hook): None for as usual.

    A torch-level dtensor symbol called by the traced program under thunder's autocast gets autocast's
    casts; any dtensor symbol called under an ambient ``torch.autocast`` runs with it off.
    """
    if not _is_dtensor_symbol(sym):
        return None
    ambient = tuple(d for d in _DEVICE_TYPES if torch.is_autocast_enabled(d))
    torch_fn = None
    if _thunder_autocast_active() and ti.interpreting_user_program():
        torch_fn = torch_function_of(sym)
    if torch_fn is None and not ambient:
        return None

    @functools.wraps(sym)
    def call(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for device_type in ambient:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            if torch_fn is not None:
                return _call_with_autocast(sym, torch_fn, args, kwargs)
            with ti.thunder_autocast_disabled():
                return sym(*args, **kwargs)

    return call


def install() -> None:
    """Route thunder's autocast hook through :func:`replacement_for`; scope a caller's autocast to its call."""
    ti.install_autocast_hook(replacement_for)
    ti.scope_ambient_autocast_to_each_call()
