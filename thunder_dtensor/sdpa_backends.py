"""``torch.nn.attention.sdpa_kernel(...)`` inside thunder programs (``thunder.jit`` and thunderfx).

Model code such as torchtitan's attention picks SDPA backends with a context manager::

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

The backends are a speed choice: their results agree within rounding. Inside a thunder program the context
therefore changes nothing that runs (no torch flag is set, nothing enters the trace); thunder's executors
pick the kernel. Two things it does do, at trace time:

* it records the chosen backends for the trace being built, so an op that runs eager kernels (the DTensor
  SDPA prim, say) can run them under the same choice: :func:`current_sdpa_backends`;
* it refuses a choice that cannot run at all, as eager would at run time: when none of the chosen backends
  can run the SDPA call on its device (only ``CUDNN_ATTENTION`` on a CPU tensor, only ``FLASH_ATTENTION``
  with dropout on CPU, ...), the SDPA call raises :class:`SDPABackendError`. torch's own kernel selector
  decides, on tiny stand-in tensors of the call's device, dtype and shapes.

On CPU (torch 2.13) only ``MATH`` and ``FLASH_ATTENTION`` (the CPU flash kernel: no dropout) exist;
``EFFICIENT_ATTENTION``, ``CUDNN_ATTENTION`` and ``OVERRIDEABLE`` alone always fail there.

Under thunderfx, dynamo records the context as ``_sdpa_kernel(backends, set_priority)`` calls (one to
enter, one restoring the previous flags) around the attention; those nodes stay in the thunder graph
(:func:`is_sdpa_kernel_node`) and have the same meaning there. The interpreter hooks are installed by
``_integration.install_sdpa_kernel_support``.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Literal, cast

from thunder_dtensor import _integration as ti

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "SDPABackendError",
    "SDPAKernelChoice",
    "TraceTimeSDPAKernel",
    "check_sdpa_call",
    "install_sdpa_kernel_support",
    "current_sdpa_backends",
    "current_sdpa_kernel",
    "is_sdpa_kernel_node",
    "set_sdpa_kernel",
]


class SDPABackendError(RuntimeError):
    """None of the backends chosen with ``sdpa_kernel`` can run a scaled_dot_product_attention call."""


@dataclasses.dataclass(frozen=True)
class SDPAKernelChoice:
    """Backends chosen with ``sdpa_kernel`` (deduplicated, in the given order) and whether that order is a priority."""

    backends: tuple[SDPBackend, ...]
    set_priority: bool = False

    def context(self) -> Any:
        """The eager context manager that makes this choice (to run eager kernels under it)."""
        return sdpa_kernel(list(self.backends), set_priority=self.set_priority)


#: the choice in effect at this point of each trace being built (absent: torch's own flags)
_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def current_sdpa_kernel() -> SDPAKernelChoice | None:
    """The ``sdpa_kernel`` choice in effect where the trace being built is now; None outside any such context."""
    trace = ti.get_tracectx()
    return None if trace is None else _CHOICES.get(trace)


def current_sdpa_backends() -> tuple[SDPBackend, ...] | None:
    """The SDPA backends chosen with ``sdpa_kernel`` where the trace being built is now, or None.

    None means that the program chose nothing there: torch's own flags apply.
    """
    choice = current_sdpa_kernel()
    return None if choice is None else choice.backends


def _store(choice: SDPAKernelChoice | None) -> None:
    trace = ti.get_tracectx()
    if trace is None:
        return
    if choice is None:
        _CHOICES.pop(trace, None)
    else:
        _CHOICES[trace] = choice


def _as_backend_list(backends: Any) -> list[SDPBackend]:
    """``sdpa_kernel``'s argument check and normalisation, as eager does it (same error type)."""
    if not isinstance(backends, list | SDPBackend):
        raise AssertionError(
            "Backend must be an instance of SDPBackend or a list of SDPBackend instances, "
            f"got {type(backends).__name__}"
        )
    return [backends] if isinstance(backends, SDPBackend) else list(backends)


def _choice(backends: Iterable[SDPBackend], set_priority: bool) -> SDPAKernelChoice | None:
    """The choice ``backends`` makes, or None where it leaves torch's flags as they are (dynamo's restore)."""
    chosen = tuple(dict.fromkeys(backends))
    if any(not isinstance(b, SDPBackend) for b in chosen):
        raise TypeError(f"sdpa_kernel: expected SDPBackend values, got {list(chosen)}")
    enabled = ti.sdpa_backends_enabled_globally(with_priority=set_priority)
    same = chosen == enabled if set_priority else set(chosen) == set(enabled)
    return None if same else SDPAKernelChoice(chosen, bool(set_priority))


def set_sdpa_kernel(backends: Iterable[SDPBackend], set_priority: bool = False) -> None:
    """What ``torch.nn.attention._sdpa_kernel`` does to torch's flags, done to the trace being built instead.

    dynamo spells a ``with sdpa_kernel(...)`` block as two such calls: the choice, then the previous flags.
    """
    _store(_choice(backends, set_priority))


class TraceTimeSDPAKernel:
    """``sdpa_kernel(backends, set_priority)`` inside a thunder program: records the choice, sets no torch flag."""

    def __init__(self, backends: list[SDPBackend] | SDPBackend, set_priority: bool = False) -> None:
        self.backends = _as_backend_list(backends)
        self.set_priority = set_priority
        self._previous: list[SDPAKernelChoice | None] = []

    def __enter__(self) -> dict:
        self._previous.append(current_sdpa_kernel())
        _store(_choice(self.backends, self.set_priority))
        return {}  # what eager's context yields

    def __exit__(self, *exc_info: Any) -> Literal[False]:
        _store(self._previous.pop())
        return False


def _stand_in(x: Any) -> Any:
    """A real tensor with ``x``'s device, dtype, shape and requires_grad, backed by one row of memory.

    What torch's kernel selector reads (shapes, dtype, device, last-dim stride 1), at no memory cost. Under
    an autocast of the program, floating tensors have its dtype, as eager's autocast casts SDPA's inputs.
    """
    if isinstance(x, ti.NumberProxy):
        return ti.pyval(x)
    if isinstance(x, ti.TensorProxy):
        shape = tuple(cast(int, ti.pyval(s)) if isinstance(s, ti.NumberProxy) else int(s) for s in x.shape)
        # (a tensor proxy has a dtype and a device)
        dtype = cast(torch.dtype, ti.dtypes.to_torch_dtype(x.dtype))
        device = cast(torch.device, ti.devices.to_torch_device(x.device))
        requires_grad = bool(x.requires_grad)
    elif isinstance(x, torch.Tensor):
        shape, dtype, device, requires_grad = tuple(x.shape), x.dtype, x.device, x.requires_grad
    else:
        return x
    autocast_dtype = ti.thunder_autocast_dtype(device.type)
    if autocast_dtype is not None and dtype.is_floating_point:
        dtype = autocast_dtype
    row = torch.empty(shape[-1:], dtype=dtype, device=device)
    row.requires_grad_(requires_grad and (dtype.is_floating_point or dtype.is_complex))
    return row.expand(shape) if shape else row


def _kernel_error(args: tuple, kwargs: dict) -> RuntimeError | None:
    """What torch's kernel selector raises for this call under the flags in effect now, or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the selector warns why each kernel was not chosen
            ti.fused_sdp_choice(*args, **kwargs)
    except RuntimeError as e:
        return e
    return None


def _describe(backends: tuple[SDPBackend, ...]) -> str:
    return "[" + ", ".join(f"SDPBackend.{b.name}" for b in backends) + "]"


def check_sdpa_call(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: Any = 0.0,
    is_causal: Any = False,
    scale: Any = None,
    enable_gqa: Any = False,
) -> None:
    """Refuse, at trace time, an SDPA call none of the backends chosen with ``sdpa_kernel`` can run.

    Nothing to check outside such a context. torch's kernel selector decides, on stand-ins of the call's
    arguments; a call it rejects with torch's own flags too is left to the SDPA op to report.
    """
    choice = current_sdpa_kernel()
    if choice is None:
        return
    try:
        with torch.set_grad_enabled(ti.grad_enabled_while_tracing()):
            q, k, v, mask = (_stand_in(t) for t in (query, key, value, attn_mask))
            options = {
                "attn_mask": mask,
                "dropout_p": _stand_in(dropout_p),
                "is_causal": _stand_in(is_causal),
                "scale": _stand_in(scale),
                "enable_gqa": _stand_in(enable_gqa),
            }
    except (RuntimeError, TypeError, ValueError):
        return  # a device this process cannot allocate on: nothing to ask torch
    if _kernel_error((q, k, v), options) is not None:
        return  # not the backends' fault
    with choice.context():
        error = _kernel_error((q, k, v), options)
    if error is None:
        return
    device = q.device
    reason = str(error).strip().splitlines()[0].rstrip(".")
    on_cpu = device.type == "cpu"
    hint = (
        "on CPU only SDPBackend.MATH and SDPBackend.FLASH_ATTENTION (the CPU flash kernel, without dropout) exist"
        if on_cpu
        else f"check which kernels support this dtype ({q.dtype}), head dim ({q.shape[-1]}) and options on {device}"
    )
    raise SDPABackendError(
        f"scaled_dot_product_attention inside sdpa_kernel({_describe(choice.backends)}): none of these backends "
        f"can run it on {device} (query {q.dtype} {list(q.shape)}, dropout_p={options['dropout_p']}); torch says: "
        f"{reason}. Hint: add SDPBackend.MATH to the list (it runs everywhere); {hint}. thunder treats sdpa_kernel "
        "as a no-op where a chosen backend can run, since the backends agree within rounding."
    ) from error


def is_sdpa_kernel_node(node: torch.fx.Node) -> bool:
    """Whether a dynamo graph node is part of a ``sdpa_kernel`` block (``_sdpa_kernel``, ``_backend_from_string``)."""
    return node.op == "call_function" and ti.is_sdpa_kernel_fx_target(node.target)


def install_sdpa_kernel_support() -> None:
    """Hook the above into thunder's interpreter (it wraps thunder's SDPA lookaside for plain tensors; the DTensor
    op calls :func:`check_sdpa_call` itself, ops/attention.py)."""
    ti.install_sdpa_kernel_support(
        context=TraceTimeSDPAKernel, set_backends=set_sdpa_kernel, check_sdpa_call=check_sdpa_call
    )
