"""Every touch of thunder's and torch's private APIs lives here, version-gated.

A new thunder or torch release should mean editing this file only. The rest of the package imports
``thunder`` and ``torch`` public names, or the names re-exported below.

What is patched, and why:

* torch >= 2.13 removed five named-tensor methods that thunder <= 0.2.6 lists for auto-registration, so
  ``import thunder`` fails. We add placeholders for the duration of the import only, then remove them
  from ``torch.Tensor`` and from thunder's tables again (also those ``thunder_dtensor_autoload`` added
  when thunder was imported first).
* thunder 0.2.6 registers its own experimental DTensor dispatch wrappers when imported; we undo them
  (``_remove_thunder_experimental_dtensor_registrations``) and refresh ConstantFolding's inverted map.
* thunder's core calls hooks of its own experimental DTensor path (proxy creation, prologue checks,
  backward cotangent checks). We point those hooks at this package instead (``install_thunder_hooks``),
  and give thunder's autodiff DTensor-aware ``add`` / ``zeros`` for cotangent sums and zero cotangents.
* ``prims.get_grad``'s meta builds DTensor cotangents with our spec rule (``set_cotangent_proxy_factory``).
* The interpreter's ``isinstance`` lookaside answers True for a DTensor's proxy against ``DTensor``
  (``make_isinstance_see_dtensor_proxies``), so tensor-parallel hooks take their DTensor branches.
* New torch functions / Tensor methods are added to thunder's map, method table and interpreter lookasides
  (``register_torch_function``, ``register_method``).
* Placement constructors and device mesh queries are called whole by the interpreter (``make_placements_opaque``).
* The prologue reads the hook dicts (``_forward_hooks`` & co.) of the module passed to ``thunder.jit`` from
  that module, not from its ``ThunderModule`` wrapper, whose own are empty: tensor-parallel styles on the
  root module otherwise fail with ``KeyError`` (``read_root_module_state_from_user_module``).
* In-place DTensor ops keep their DTensor proxies through thunder's alias updates, which run on the dtensor
  executor (``keep_dtensors_in_alias_updates``); their symbols are tagged as thunder's own in-place ones
  (``inplace_torchsymbol``).
* ``thunder.CacheEntry`` is built through a subclass that first shows each compiled program to a hook
  (``install_compiled_program_hook``: the opt-in rank-consistency check).
* thunderfx's splitter asks this package about nodes with DTensors or a device mesh, skips thunder's
  translation to its experimental prims, passes the mesh through its example-input metadata, and gives
  thunder.jit graph modules already compiled to Python (``install_thunderfx_support``).
* thunder's autocast hook (``maybe_apply_autocast``, asked by every symbol call) first asks this package,
  so DTensor ops get autocast's casts as dtensor prims in the trace (``install_autocast_hook``); the autocast
  a jitted function is called under applies to that call only (``scope_ambient_autocast_to_each_call``).
* thunder 0.2.6's grad rules forget the conjugate for complex tensors; they are re-registered with it
  (``fix_complex_gradients``).
* ``torch.nn.attention.sdpa_kernel`` runs as a trace-time no-op with a feasibility check
  (``install_sdpa_kernel_support``).
* FSDP2's forward hooks become lookasides and managed parameter reads become unshard prims
  (``install_fsdp_support``).
* thunder's interpreter runs ``x[k]``, ``k in x``, unpacking, global name lookups, bound-method calls and the
  merges of ``*args`` / ``**kwargs`` calls on exact builtin containers without interpreting its own helper
  functions, and disassembles each code object once (``run_interpreter_helpers_directly``: first-call time);
  ``Symbol.bind`` reads each meta's signature once (``bind_symbols_with_cached_signatures``).

Private torch names used (checked on torch 2.13, the range ``TORCH_TESTED_RANGE`` gates):
``DTensor._spec`` / ``_local_tensor`` / ``_op_dispatcher`` (its sharding propagator's cache),
``torch.distributed.tensor._redistribute._gen_transform_infos`` (its cache),
``torch.distributed.tensor._dtensor_spec.DTensorSpec`` / ``TensorMeta`` (and ``DTensorSpec.shard_order``),
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, ``torch._subclasses.fake_tensor``
(``FakeTensorMode``, its exceptions and logger), ``torch._library.fake_class_registry.FakeScriptObject``,
``torch.utils._pytree``, ``torch._C._is_alias_of``, ``torch.utils._python_dispatch.TorchDispatchMode`` (autocast, the
lowering's ATen recorder) and ``autograd_would_have_decomposed``, ``torch._dispatch.python.enable_python_dispatcher``,
``torch.fx.experimental.proxy_tensor`` (``make_fx``, ``disable_proxy_modes_tracing``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from looseversion import LooseVersion

TORCH_VERSION = LooseVersion(torch.__version__.split("+")[0])
#: the torch releases whose private names (listed above) this module was checked against
TORCH_TESTED_RANGE = (LooseVersion("2.13"), LooseVersion("2.14"))
if not (TORCH_TESTED_RANGE[0] <= TORCH_VERSION < TORCH_TESTED_RANGE[1]):
    raise ImportError(
        f"thunder_dtensor supports torch 2.13.x, found {torch.__version__}: the private torch names it uses "
        "(thunder_dtensor/_integration.py) are checked for that release only; update that file for this one"
    )

#: the patches to thunder that are not about DTensors, by kind, and the environment variable that turns a kind
#: off ("0"); docs/architecture.md, "Thunder fixes that are not about DTensors", lists each with its reproducer
PATCH_SWITCHES = {"thunder-fix": "THUNDER_DTENSOR_THUNDER_FIXES", "speedup": "THUNDER_DTENSOR_SPEEDUPS"}


def patch_kind_enabled(kind: str) -> bool:
    """Whether the patches of ``kind`` ("thunder-fix", "speedup") are installed in this process."""
    return os.environ.get(PATCH_SWITCHES[kind], "1") != "0"


#: Whether torch was built with ``torch.distributed``; the package imports without it.
DISTRIBUTED_AVAILABLE: bool = torch.distributed.is_available()

import thunder_dtensor_autoload as _autoload  # noqa: E402


@contextlib.contextmanager
def _named_tensor_shims() -> Iterator[dict[str, Callable]]:
    """Temporarily provide the named-tensor methods thunder 0.2.x references at import time."""
    missing = {
        name: _autoload.named_tensor_placeholder(name, torch.__version__)
        for name in _autoload.REMOVED_NAMED_TENSOR_METHODS
        if not hasattr(torch.Tensor, name)
    }
    for name, fn in missing.items():
        setattr(torch.Tensor, name, fn)
    try:
        yield missing
    finally:
        for name, fn in missing.items():
            if getattr(torch.Tensor, name, None) is fn:
                delattr(torch.Tensor, name)


def _drop_named_tensor_placeholders(placeholders: dict[str, Callable]) -> None:
    """Remove the placeholders from ``torch.Tensor`` and from the tables thunder filled with them."""
    if not placeholders:
        return
    import thunder.torch.default_torch_ops as default_ops
    from thunder.core import jit_ext
    from thunder.torch import _torch_to_thunder_function_map
    from thunder.torch.langctx import _method_name_to_fn_map

    dropped = set(placeholders.values())
    for name, fn in placeholders.items():
        if getattr(torch.Tensor, name, None) is fn:
            delattr(torch.Tensor, name)
        _torch_to_thunder_function_map.pop(fn, None)
        jit_ext._general_jit_lookaside_map.pop(fn, None)
        _method_name_to_fn_map.pop(name, None)
    ops = default_ops.torch_auto_registered_ops[torch.Tensor]
    ops[:] = [fn for fn in ops if fn not in dropped]


def _import_thunder() -> types.ModuleType:
    """thunder, imported with the named-tensor placeholders it needs on torch >= 2.13, then cleaned up.

    thunder may have been imported before this package (see ``thunder_dtensor_autoload``): the
    placeholders it was given then are removed here too.
    """
    placeholders = dict(_autoload.installed_placeholders)
    _autoload.installed_placeholders.clear()
    if "thunder" in sys.modules and hasattr(sys.modules["thunder"], "jit"):
        _drop_named_tensor_placeholders(placeholders)
        return sys.modules["thunder"]
    with _named_tensor_shims() as shims:
        import thunder

        placeholders.update(shims)
        _drop_named_tensor_placeholders(placeholders)
    return thunder


thunder = _import_thunder()
THUNDER_VERSION = LooseVersion(thunder.__version__)
if not (LooseVersion("0.2.6") <= THUNDER_VERSION < LooseVersion("0.3")):
    raise ImportError(
        f"thunder_dtensor supports lightning-thunder 0.2.6 to 0.2.x, found {thunder.__version__}; "
        "update thunder_dtensor/_integration.py for this release"
    )

import thunder.torch as ltorch  # noqa: E402


def _experimental_single_device_symbol(fn: Any) -> Any:
    """The single-device symbol inside one of thunder's experimental DTensor dispatch wrappers, else None."""
    code = getattr(fn, "__code__", None)
    if code is None or not getattr(fn, "__qualname__", "").startswith("dispatch_to_impl."):
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    cell = cells.get("single_device_symbol")
    return None if cell is None else cell.cell_contents


def _is_experimental_dtensor_symbol(fn: Any) -> bool:
    return str(getattr(fn, "id", "")).startswith("dtensor.")


def _remove_thunder_experimental_dtensor_registrations() -> None:
    """Undo what thunder's experimental DTensor path put in the torch-to-thunder map and method table.

    thunder 0.2.6 registers, when it is imported, wrappers for about ten torch functions that send DTensor
    calls to its own prims. We restore thunder's single-device symbols there (this package registers its
    own dispatchers afterwards) and drop its DTensor-only entries (``DTensor.from_local`` & co.).
    """
    from thunder.core import jit_ext
    from thunder.torch.langctx import _method_name_to_fn_map

    fn_map = ltorch._torch_to_thunder_function_map
    for torch_fn, impl in list(fn_map.items()):
        single = _experimental_single_device_symbol(impl)
        if single is not None:
            fn_map[torch_fn] = single
            jit_ext._general_jit_lookaside_map[torch_fn] = jit_ext.ensure_recursive_proxies(
                jit_ext.interpreter_needs_wrap(jit_ext.record_source_loc_in_symbol_header(single))
            )
        elif _is_experimental_dtensor_symbol(impl):
            del fn_map[torch_fn]
            jit_ext._general_jit_lookaside_map.pop(torch_fn, None)
    for name, impl in list(_method_name_to_fn_map.items()):
        single = _experimental_single_device_symbol(impl)
        if single is not None:
            _method_name_to_fn_map[name] = single


def _refresh_constant_folding_inverse_map() -> None:
    """ConstantFolding inverts the torch-to-thunder map once, at its import; it must hold thunder's symbols.

    Called after the experimental entries are undone and before this package adds its dispatchers.
    """
    import thunder.transforms.constant_folding as constant_folding

    inverse = constant_folding._thunder_to_torch_function_map
    inverse.clear()
    inverse.update({v: k for k, v in ltorch._torch_to_thunder_function_map.items()})


# ---------------------------------------------------------------------------------------------------------
# thunder internals used by the package (re-exported so other modules never reach into thunder directly)
# ---------------------------------------------------------------------------------------------------------
import thunder.core.devices as devices  # noqa: E402
import thunder.core.dtypes as dtypes  # noqa: E402
from thunder.core import prims  # noqa: E402
from thunder.core.baseutils import check  # noqa: E402
from thunder.core.compile_data import get_compile_data  # noqa: E402
from thunder.core.langctxs import Languages, langctx  # noqa: E402
from thunder.core.prims import OpTags, make_prim  # noqa: E402
from thunder.core.proxies import AnyProxy, NumberProxy, Proxy, TensorProxy, pyval, variableify  # noqa: E402
from thunder.core.pytree import tree_flatten, tree_map, tree_unflatten  # noqa: E402
from thunder.core.symbol import BoundSymbol, BoundSymbolTag, Symbol  # noqa: E402
from thunder.core.trace import TraceCtx, from_trace, get_tracectx, tracectx  # noqa: E402
from thunder.core.transforms import get_grad, put_grad, put_grads, register_grad  # noqa: E402
from thunder.extend import OperatorExecutor, add_always_executor, register_executor  # noqa: E402

if DISTRIBUTED_AVAILABLE:
    _remove_thunder_experimental_dtensor_registrations()
_refresh_constant_folding_inverse_map()

__all__ = [
    "AnyProxy",
    "BoundSymbol",
    "BoundSymbolTag",
    "DataDependentOutputException",
    "DISTRIBUTED_AVAILABLE",
    "Languages",
    "NumberProxy",
    "OpTags",
    "OperatorExecutor",
    "Proxy",
    "Symbol",
    "TensorProxy",
    "TraceCtx",
    "add_always_executor",
    "check",
    "devices",
    "dtypes",
    "from_trace",
    "get_grad",
    "get_tracectx",
    "langctx",
    "ltorch",
    "make_prim",
    "prims",
    "put_grad",
    "put_grads",
    "pyval",
    "register_executor",
    "register_grad",
    "thunder",
    "tracectx",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "variableify",
]

# ---------------------------------------------------------------------------------------------------------
# torch internals
# ---------------------------------------------------------------------------------------------------------
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException  # noqa: E402

#: what a fake run raises when the answer depends on the data: nothing is known about the op then
UNKNOWABLE_ON_FAKE_TENSORS = (DataDependentOutputException, DynamicOutputShapeException)

if DISTRIBUTED_AVAILABLE:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DeviceMesh, DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard
else:  # pragma: no cover - exercised by the no-distributed test through a subprocess
    FakeTensorMode = DeviceMesh = DTensor = DTensorSpec = TensorMeta = None
    Partial = Placement = Replicate = Shard = _StridedShard = None


def is_strided_shard(placement: Any) -> bool:
    """A ``_StridedShard`` (private placement: a reshape of a transposed shard gives one)."""
    return _StridedShard is not None and isinstance(placement, _StridedShard)


def torch_tree_flatten(tree: Any) -> tuple[list, Any]:
    """torch's pytree flatten (DTensors are leaves), for run-time argument handling."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def torch_tree_unflatten(leaves: list, spec: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def dtensor_spec(x: Any) -> Any:
    """The ``DTensorSpec`` of a runtime DTensor (private attribute)."""
    return x._spec


def local_tensor(x: Any) -> torch.Tensor:
    """The local shard of a runtime DTensor, without autograd tracking through ``to_local``."""
    return x._local_tensor


def size_hint(s: Any) -> int:
    """A size as an int: a symbolic size (dynamo's dynamic shapes) reads as the value it was traced with."""
    return s.node.hint if isinstance(s, torch.SymInt) else int(s)


def spec_with_sizes(spec: Any, shape: Any, stride: Any) -> Any:
    """``spec`` with its global shape and stride replaced (as tuples of ints)."""
    meta = TensorMeta(tuple(size_hint(s) for s in shape), tuple(size_hint(s) for s in stride), spec.tensor_meta.dtype)
    return dataclasses.replace(spec, tensor_meta=meta)


@functools.lru_cache(maxsize=1024)
def canonical_spec_repr(spec: Any) -> str:
    """Everything of ``spec`` that shapes a traced program, as one string: the prologue compares it.

    ``repr(spec)`` is not enough: a ``DeviceMesh`` prints its shape, not its ranks, so meshes with the same
    ranks in another order read the same. Written out: the mesh's device type, full rank layout and dim
    names; each placement's repr (Shard dim, Partial reduce op, ``_StridedShard`` split factor); the shard
    order; the global shape and stride as tuples of ints (a spec made by inductor holds tuples where an
    eager one holds ``torch.Size``); the dtype.

    Memoised on the spec, so a cache hit costs one hash (cached by the spec) and one ``__eq__``. That is
    sound only because ``DTensorSpec.__eq__`` (torch 2.13) compares everything written here: the mesh by
    rank map, layout, device type and dim names; placements by value (type, dim, reduce op, split
    factor); shard order, shape, stride and dtype. tests/distributed/test_guards.py fails if it stops.
    """
    mesh, meta = spec.mesh, spec.tensor_meta
    placements = ", ".join(repr(p) for p in spec.placements)
    shard_order = getattr(spec, "shard_order", None)
    return (
        f"mesh={mesh.device_type}:{mesh.mesh.tolist()} names={mesh.mesh_dim_names} placements=({placements}) "
        f"shard_order={shard_order!r} shape={tuple(size_hint(s) for s in meta.shape)} "
        f"stride={tuple(size_hint(s) for s in meta.stride)} dtype={meta.dtype}"
    )


def dtensor_around(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor of ``spec`` wrapping ``local`` as is (trace-time stand-ins: no autograd, no checks)."""
    return DTensor(local, spec, requires_grad=False)


def dtensor_from_local_unchecked(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor of ``spec`` around ``local``, without communication (shape and stride from the spec)."""
    meta = spec.tensor_meta
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=meta.shape, stride=meta.stride)


def local_offset(dtensor: Any) -> tuple[int, ...]:
    """Where this rank's shard starts in the global tensor, per dim."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    spec = dtensor_spec(dtensor)
    # numbers known from the spec, not traced values (the lowering's tracing runs this under fake tensors)
    with outside_tracing_modes():
        offset = compute_local_shape_and_global_offset(spec.tensor_meta.shape, spec.mesh, spec.placements)[1]
    return tuple(int(o) for o in offset)


@contextlib.contextmanager
def outside_tracing_modes() -> Iterator[None]:
    """Leave any active fake tensor mode and make_fx (or recorder) tracing: for trace-time work on its own tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), unset_fake_temporarily(), _recording_suspended():
        yield


@contextlib.contextmanager
def _recording_suspended() -> Iterator[None]:
    """The light ATen recorder (``trace_aten_graph``) passes calls through without recording them meanwhile."""
    recorder = _RECORDERS[-1] if _RECORDERS else None
    if recorder is not None:
        recorder.suspended += 1
    try:
        yield
    finally:
        if recorder is not None:
            recorder.suspended -= 1


_DECOMPOSITIONS_WITHOUT_STRATEGY: dict | None = None


def decompositions_dtensor_lacks() -> dict:
    """torch's core-ATen decompositions of the aten ops DTensor has no sharding strategy, rule or handler for.

    Read from DTensor's sharding propagator (``op_strategy_funcs``, ``op_single_dim_strategy_funcs``,
    ``op_to_rules``) and op dispatcher (``_custom_op_handlers``), all private; computed once.
    """
    global _DECOMPOSITIONS_WITHOUT_STRATEGY
    if _DECOMPOSITIONS_WITHOUT_STRATEGY is None:
        from torch._decomp import core_aten_decompositions

        dispatcher = DTensor._op_dispatcher
        propagator = dispatcher.sharding_propagator
        handled = set(dispatcher._custom_op_handlers)
        for table in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"):
            handled |= set(getattr(propagator, table, {}))
        # the core-ATen table: its decompositions produce aten ops (the full table's refs produce prims.*,
        # which DTensor has no strategies for)
        table = core_aten_decompositions()
        _DECOMPOSITIONS_WITHOUT_STRATEGY = {op: fn for op, fn in table.items() if op not in handled}
    return _DECOMPOSITIONS_WITHOUT_STRATEGY


def writes_into_an_input(node: Any) -> bool:
    """Whether an fx node is an aten op whose schema mutates an argument that is a graph input."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return False
    for arg, value in zip(target._schema.arguments, node.args):
        if arg.is_write and isinstance(value, torch.fx.Node) and value.op == "placeholder":
            return True
    return False


def is_random_op(target: Any) -> bool:
    """Whether an fx node target draws random numbers (an aten op tagged ``nondeterministic_seeded``)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def clear_sharding_propagation_cache() -> None:
    """Drop DTensor's cached sharding and redistribution decisions.

    Some carry state: the placements of eager's vocab-parallel embedding (``_MaskPartial``) hold a mask
    buffer, which a fake run (dynamo's) fills with a fake tensor of its fake mode.
    """
    from torch.distributed.tensor import _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()


def is_fake(x: Any) -> bool:
    """Whether ``x`` is a fake tensor (a trace-time stand-in), or a DTensor around one."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(local_tensor(x) if isinstance(x, DTensor) else x, FakeTensor)


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the default random generator of ``device`` (what a random op draws from)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def fork_rng_of(values: list) -> Any:
    """``torch.random.fork_rng`` over the generators of the devices of ``values`` (tensors or DTensors)."""
    cuda = sorted({v.device.index or 0 for v in values if isinstance(v, torch.Tensor) and v.device.type == "cuda"})
    return torch.random.fork_rng(devices=cuda)


@functools.cache
def _trace_time_fake_mode() -> FakeTensorMode:
    """The one fake tensor mode of this package's trace-time runs.

    Creating a mode walks the whole Python stack (``FakeTensorMode`` records where it was made), which under
    thunder's interpreter is deep: about half a millisecond per fake run, a hundred times in a small model's
    first call. Re-entering one mode is supported by torch, and keeps every fake tensor this package caches in
    the same mode.
    """
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def fake_tensor_mode() -> Iterator[Any]:
    """Fake tensor mode for trace-time runs of torch ops.

    An op that fails there is reported by this package (as a ``DTensorOpError``); fake tensor's own log of
    the failing meta kernel is muted meanwhile.
    """
    with fake_tensor_logging_muted(), _trace_time_fake_mode() as mode:
        yield mode


# ---------------------------------------------------------------------------------------------------------
# Hooks into thunder's core
# ---------------------------------------------------------------------------------------------------------
def register_torch_function(torch_fn: Callable, thunder_impl: Callable, *, method_name: str | None = None) -> None:
    """Map ``torch_fn`` (and optionally a Tensor method) to ``thunder_impl`` for thunder's interpreter.

    thunder copies its torch-to-thunder map into the interpreter's lookaside table when it is imported, so a
    later registration has to update both.
    """
    from thunder.core import jit_ext
    from thunder.torch.langctx import register_method

    ltorch.register_function(torch_fn, thunder_impl)
    lookaside = jit_ext.ensure_recursive_proxies(
        jit_ext.interpreter_needs_wrap(jit_ext.record_source_loc_in_symbol_header(thunder_impl))
    )
    jit_ext._general_jit_lookaside_map[torch_fn] = lookaside
    # Tensor methods on proxies resolve to thunder_impl itself: keep the interpreter out of its internals,
    # as it keeps out of thunder's symbols.
    jit_ext._general_jit_lookaside_map[thunder_impl] = lookaside
    if method_name is not None:
        register_method(method_name, thunder_impl)


def _unwrapped(args: tuple, kwargs: dict) -> tuple:
    """The values of the interpreter's wrapped arguments."""
    return [getattr(a, "value", a) for a in args], {k: getattr(v, "value", v) for k, v in kwargs.items()}


def _is_public_functional_name(name: str) -> bool:
    """Not private (``_foreach_mul_``, ``_fused_adam_``) and not in place (``sigmoid_``): such calls keep
    thunder's own handling, since a functional prim would drop their writes."""
    return bool(name) and not name.startswith("_") and not name.endswith("_")


def _has_executor_lookaside(fn: Any) -> bool:
    """Whether an executor of this jit claims ``fn`` itself (thunder's own lookaside serves it then)."""
    from thunder.core import jit_ext

    ctx = jit_ext.get_jit_ctx()
    return fn in ctx._executor_lookasides or fn in ctx.ad_hoc_executor._lookasides


def route_unknown_torch_functions(
    symbol_for: Callable[[Callable], Callable], is_dtensor: Callable[[Any], bool]
) -> None:
    """A public, functional torch function thunder has no symbol for, called on a DTensor, becomes ``symbol_for(fn)``.

    thunder's ``jit_ext.general_jit_lookaside`` raises "not yet supported" for such an opaque torch function;
    with a DTensor among its arguments it is routed (and mapped, so later calls take thunder's own path).
    """
    from thunder.core import jit_ext

    original = jit_ext.general_jit_lookaside
    if getattr(original, "_thunder_dtensor", False):
        return

    known = jit_ext._general_jit_lookaside_map
    mapped = ltorch._torch_to_thunder_function_map

    def lookaside(fn: Any, *args: Any, **kwargs: Any) -> Any:
        # cheapest tests first: the interpreter asks this for every call it makes
        try:
            unknown = fn not in known and fn not in mapped
        except TypeError:  # unhashable
            unknown = False
        if (
            unknown
            and jit_ext.is_opaque(fn)
            and str(getattr(fn, "__module__", None) or "").startswith("torch")
            and _is_public_functional_name(getattr(fn, "__name__", ""))
            and "out" not in kwargs
            and not _has_executor_lookaside(fn)
            and any(is_dtensor(v) for v in tree_flatten(_unwrapped(args, kwargs))[0])
        ):
            register_torch_function(fn, symbol_for(fn))
            return jit_ext._general_jit_lookaside_map[fn]
        return original(fn, *args, **kwargs)

    lookaside._thunder_dtensor = True  # type: ignore[attr-defined]
    jit_ext.general_jit_lookaside = lookaside


def register_method(method_name: str, thunder_impl: Callable) -> None:
    """Put ``thunder_impl`` in thunder's Tensor-method table (``x.name(...)`` on proxies)."""
    from thunder.core import jit_ext
    from thunder.torch.langctx import register_method as thunder_register_method

    thunder_register_method(method_name, thunder_impl)
    jit_ext._general_jit_lookaside_map[thunder_impl] = jit_ext.ensure_recursive_proxies(
        jit_ext.interpreter_needs_wrap(jit_ext.record_source_loc_in_symbol_header(thunder_impl))
    )


def torch_to_thunder_map() -> dict[Callable, Callable]:
    return ltorch._torch_to_thunder_function_map


def thunder_methods() -> dict[str, Callable]:
    from thunder.torch.langctx import _method_name_to_fn_map

    return dict(_method_name_to_fn_map)


def thunder_method(name: str) -> Callable | None:
    return thunder_methods().get(name)


def accept_dtensor_proxies(symbol: Symbol) -> Symbol:
    """A copy of a thunder torch symbol without its "plain TensorProxy only" guard.

    For metadata queries (``dim``, ``numel``) whose logic only reads the global shape and dtype.
    """
    unguarded = getattr(symbol.meta, "__wrapped__", symbol.meta)
    return ltorch.torchsymbol(id=f"thunder_dtensor.{symbol.name}", allow_tensor_subclass_proxy=True)(unguarded)


class _ZerosBinder:
    """``ltorch.zeros`` as thunder's autodiff uses it (``.bind``), with DTensor outputs sent elsewhere."""

    def __init__(self, bind_dtensor_zeros: Callable) -> None:
        self._bind_dtensor_zeros = bind_dtensor_zeros

    def bind(self, *shape: Any, device: Any, dtype: Any, output: Any) -> BoundSymbol:
        bsym = self._bind_dtensor_zeros(output)
        return bsym if bsym is not None else ltorch.zeros.bind(*shape, device=device, dtype=dtype, output=output)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return ltorch.zeros(*args, **kwargs)


class _AutodiffTorchNamespace(types.ModuleType):
    """Stands in for ``thunder.torch`` inside thunder's autodiff so DTensor cotangents stay DTensors.

    thunder's autodiff sums the cotangents of a value used several times with ``ltorch.add``, and makes
    the zero cotangent of an intermediate with no gradient with ``ltorch.zeros``: both single-device.
    Everything else is thunder.torch itself.
    """

    def __init__(self, add: Callable, bind_dtensor_zeros: Callable) -> None:
        super().__init__("thunder.torch")
        self.add = add
        self.zeros = _ZerosBinder(bind_dtensor_zeros)

    def __getattr__(self, name: str) -> Any:
        return getattr(ltorch, name)


def install_thunder_hooks(
    *,
    proxify: Callable,
    is_dtensor_proxy: Callable,
    spec_check_prim: Symbol,
    prologue_spec_check: Callable,
    backward_cotangent_check: Callable,
    cotangent_add: Callable,
    bind_dtensor_zeros: Callable,
    joint_trace_check: Callable,
) -> None:
    """Point thunder's DTensor hooks at this package (thunder 0.2.6 layout)."""
    import thunder.core.jit_ext as jit_ext
    import thunder.torch.experimental.dtensor_proxy as thunder_dtensor_proxy
    import thunder.torch.experimental.dtensor_utils as thunder_dtensor_utils
    import thunder.transforms.autodiff as autodiff

    # thunder.core.proxies.proxy() imports this name at call time.
    thunder_dtensor_proxy.proxify_dtensor = proxify
    # jit_ext imported these names at module level: rebind them there.
    jit_ext.is_dtensor_proxy = is_dtensor_proxy
    jit_ext.check_dtensor_spec_repr = spec_check_prim
    jit_ext.handle_check_dtensor_spec_in_prologue = prologue_spec_check
    # autodiff imports this at call time.
    thunder_dtensor_utils.check_dtensor_cotangent_metadata_in_backward = backward_cotangent_check
    autodiff.ltorch = _AutodiffTorchNamespace(cotangent_add, bind_dtensor_zeros)
    # thunder.__init__ imports this at call time: the joint forward-backward trace passes through our check
    grad_transform_on_trace = autodiff.grad_transform_on_trace

    @functools.wraps(grad_transform_on_trace)
    def checked_grad_transform_on_trace(trace: TraceCtx, *args: Any, **kwargs: Any) -> TraceCtx:
        return joint_trace_check(grad_transform_on_trace(trace, *args, **kwargs))

    autodiff.grad_transform_on_trace = checked_grad_transform_on_trace


def set_cotangent_proxy_factory(make_cotangent: Callable) -> None:
    """Make ``prims.get_grad`` (the cotangent of a value) build DTensor cotangents with ``make_cotangent``.

    thunder's meta copies the value's proxy type and metadata; a Partial DTensor's cotangent, though, arrives
    as a full value. ``make_cotangent(a)`` returns the proxy to use, or None for thunder's default.
    """
    default_meta = prims.get_grad.meta

    def get_grad_meta(a: Any, /) -> Any:
        cotangent = make_cotangent(a)
        return default_meta(a) if cotangent is None else cotangent

    object.__setattr__(prims.get_grad, "meta", get_grad_meta)


def using_symbolic_values() -> bool:
    """Whether the program is compiled with ``cache="symbolic values"`` (sizes and numbers as symbols)."""
    from thunder.core.compile_data import using_symbolic_values as thunders

    return thunders()


def static_number(x: NumberProxy) -> Any:
    """The value of a number a DTensor op's spec depends on, guarded by the prologue under symbolic values.

    A DTensor spec is concrete: a trace made for one value of the number must not run for another, so the
    number is constrained to its traced value (thunder then checks it in the prologue, as for a branch on it).
    """
    if using_symbolic_values() and not x.is_static_constrained():
        check(
            not x.is_dynamic(),
            lambda: f"a DTensor op needs the value of {x.name}, which is dynamic under cache='symbolic values'",
            exception_type=NotImplementedError,
        )
        x.make_static_constrained()
    return pyval(x)


_DTENSOR_PROGRAM_FLAG = "_thunder_dtensor_traced_dtensor_ops"


def note_dtensor_op_traced() -> None:
    """Record on the jitted function's compile data that its program has DTensor ops (see ``traced_dtensor_ops``)."""
    cd = get_compile_data()
    if cd is not None:
        setattr(cd, _DTENSOR_PROGRAM_FLAG, True)


def traced_dtensor_ops() -> bool:
    """Whether a program of the jitted function being compiled had DTensor ops (then or in an earlier trace)."""
    return bool(getattr(get_compile_data(), _DTENSOR_PROGRAM_FLAG, False))


def is_check_tensor_shape_and_metadata(prim: Any) -> bool:
    from thunder import clang

    return prim is clang.check_tensor_shape_and_metadata


def may_return_views(symbol: Any) -> bool:
    """Whether thunder's alias pass treats ``symbol`` as returning views of its first argument."""
    return symbol in ltorch._syms_returning_views or symbol in ltorch._syms_that_may_return_views


def mark_may_return_views(symbol: Symbol) -> None:
    """Make thunder's alias pass (``update_aliases``) treat ``symbol`` as one that may return a view."""
    ltorch._syms_that_may_return_views.add(symbol)


def make_spec(mesh: Any, placements: tuple, tensor_meta: Any) -> Any:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta)


def make_isinstance_see_dtensor_proxies(proxy_type: type) -> None:
    """Inside jitted code, ``isinstance(x, DTensor)`` is True for a DTensor's proxy.

    Tensor-parallel hooks branch on it (``if not isinstance(x, DTensor): x = DTensor.from_local(...)``);
    thunder's own isinstance lookaside answers as for a plain tensor.
    """
    from thunder.core import interpreter, jit_ext

    thunder_isinstance = jit_ext._general_jit_lookaside_map[isinstance]

    def dtensor_aware_isinstance(obj: Any, cls: Any) -> Any:
        value, classes = interpreter.unwrap(obj), interpreter.unwrap(cls)
        if isinstance(value, proxy_type):
            classes = tuple(interpreter.unwrap(c) for c in classes) if isinstance(classes, tuple) else (classes,)
            if any(isinstance(c, type) and issubclass(DTensor, c) for c in classes):
                record = interpreter.ProvenanceRecord(
                    interpreter.PseudoInst.LOOKASIDE,
                    inputs=[interpreter.wrap_const(isinstance).provenance, obj.provenance, cls.provenance],
                )
                return interpreter.wrap(True, provenance=record)
        return thunder_isinstance(obj, cls)

    jit_ext._general_jit_lookaside_map[isinstance] = dtensor_aware_isinstance


def is_unpack_cotangents(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` unpacks the backward's cotangent sequence (thunder 0.2.6 naming)."""
    return bsym.sym.id == prims.PrimIDs.UNPACK_SEQUENCE and getattr(bsym.args[0], "name", None) == "cotangents"


def bind_unpack_dtensor_spec(dtensor: Proxy, output: Proxy) -> BoundSymbol:
    """A prologue line ``output = dtensor._spec``."""
    return prims.unpack_attr.bind(dtensor, "_spec", output=output)


def bind_unpack_local_tensor(dtensor: Proxy, output: Proxy) -> BoundSymbol:
    """A prologue line ``output = dtensor._local_tensor``."""
    return prims.unpack_attr.bind(dtensor, "_local_tensor", output=output)


def torchsymbol(name: str) -> Callable[[Callable], Symbol]:
    """A torch-level thunder symbol that accepts DTensorProxy inputs; it maps no torch function itself."""
    return ltorch.torchsymbol(id=f"thunder_dtensor.{name}", allow_tensor_subclass_proxy=True)


def make_placements_opaque() -> None:
    """Let jitted code build placements (``Shard(1)``, ``Replicate()``) and ask a device mesh about itself: the
    interpreter calls these whole.

    Placements are Python subclasses of pybind11 classes; stepping into their construction aborts the
    process. Dynamo graphs handed over by thunderfx spell every placement as such a call. A mesh's queries
    (``mesh.size(0)``, ``mesh.get_group()``, ...) read fixed process-group state: stepping through their
    Python code costs first-call time and changes nothing in the program.
    """
    from thunder.core import jit_ext

    mesh_queries = ("size", "get_group", "get_local_rank", "get_coordinate", "get_rank", "get_all_groups")
    opaque = [Shard, Replicate, Partial, *(getattr(DeviceMesh, name) for name in mesh_queries)]
    for fn in opaque:
        jit_ext._general_jit_lookaside_map[fn] = jit_ext.interpreter_needs_wrap(fn)


# ---------------------------------------------------------------------------------------------------------
# thunderfx (thunder.dynamo, thunder 0.2.6 layout)
# ---------------------------------------------------------------------------------------------------------
def is_opaque_script_object(x: Any) -> bool:
    """Whether ``x`` is what dynamo graphs hold for a device mesh or process group."""
    from torch._library.fake_class_registry import FakeScriptObject

    return isinstance(x, (FakeScriptObject, torch.ScriptObject))


def fx_example_value(arg: Any) -> Any:
    """Dynamo's example value of an fx node (``arg`` itself if it is not a node).

    A graph input that is a device mesh has an opaque stand-in as example value; the mesh itself is
    dynamo's recorded example for that input.
    """
    if not isinstance(arg, torch.fx.Node):
        return arg
    value = arg.meta.get("example_value")
    if is_opaque_script_object(value) and "grapharg" in arg.meta:
        return arg.meta["grapharg"].example
    return value


def trace_on_proxies(fn: Callable, make_inputs: Callable[[], tuple[tuple, dict]]) -> None:
    """Run ``fn`` once on proxies in a throwaway trace, as thunderfx's splitter tests an op.

    ``make_inputs`` builds the proxies inside the trace.
    """
    from thunder.common import CompileData, CompileStats
    from thunder.core.compile_data import compile_data_and_stats

    @compile_data_and_stats(CompileData(fn=lambda x: x, disable_preprocessing=True), CompileStats())
    @thunder._with_cache_info_ctx
    def run() -> None:
        cache_info = thunder._get_cache_info()
        cache_info["default_dtype"] = torch.get_default_dtype()
        cache_info["default_device"] = torch.get_default_device()
        with tracectx(TraceCtx()):
            args, kwargs = make_inputs()
            fn(*args, **kwargs)

    run()


def install_thunderfx_support(dtensor_node_support: Callable, plain_node_support: Callable) -> None:
    """Make thunderfx's splitter hand graphs with DTensors to thunder.jit whole.

    * ``dtensor_node_support(node)`` decides for every node that touches a DTensor or a device mesh
      (``None`` leaves the node to thunder): thunder's own check crashes on the mesh's ``FakeScriptObject``
      and looks methods like ``redistribute`` up on ``torch.Tensor`` only.
    * ``plain_node_support(node, thunder_options, thunder_check)`` answers for every other node, by asking
      ``thunder_check`` (thunder's own check, which traces the node's symbol and its gradient: ~0.1 s a node)
      or a cached answer for the same call signature.
    * ``translate_dtensor_ops`` is turned off: it rewrites older dynamo graphs to thunder's experimental
      DTensor prims, which this package removes. torch >= 2.13 graphs call ``DTensor.from_local``,
      ``.redistribute`` and ``.to_local`` directly, and the dispatch table covers those.
    * Example-input metadata (kept for thunderfx's reports) passes the device mesh through as it is.
    * Each graph module is compiled to Python before ``thunder.jit`` sees it: fx's lazy code generation,
      run inside thunder's interpreter, fails on a mesh argument.
    * DTensor's sharding-propagation cache is cleared once a graph is split: see ``splitter``.
    """
    import thunder.dynamo.compiler as fx_compiler
    import thunder.dynamo.splitter as fx_splitter
    import thunder.dynamo.utils as fx_utils

    thunder_node_support = fx_utils.is_node_supported_by_thunder

    def is_node_supported_by_thunder(node: torch.fx.Node, thunder_options: dict) -> tuple[bool, Any]:
        decision = dtensor_node_support(node)
        if decision is None:
            return plain_node_support(node, thunder_options, thunder_node_support)
        supported, reason = decision
        if supported:
            return True, None
        return False, fx_utils.SplitReason(fx_utils.SplitReasonType.MISSING_OP_SUPPORT, info=reason)

    thunder_example_meta = fx_utils.input_to_example_input_meta

    def input_to_example_input_meta(x: Any) -> Any:
        if is_opaque_script_object(x) or isinstance(x, DeviceMesh):
            return x
        return thunder_example_meta(x)

    thunder_splitter = fx_compiler._splitter

    def splitter(gm: torch.fx.GraphModule, thunder_jit: Callable, *args: Any, **kwargs: Any) -> Any:
        def jit_compiled_graph(graph_module: torch.fx.GraphModule, **options: Any) -> Any:
            fx_utils.recompile_graph(graph_module)
            return thunder_jit(graph_module, **options)

        try:
            return thunder_splitter(gm, jit_compiled_graph, *args, **kwargs)
        finally:
            # dynamo's fake run of the graph cached sharding decisions whose placements hold fake tensors of its
            # fake mode (the vocab-parallel embedding's mask): a later compile or eager call would reuse them
            clear_sharding_propagation_cache()

    fx_utils.is_node_supported_by_thunder = fx_splitter.is_node_supported_by_thunder = is_node_supported_by_thunder
    fx_utils.input_to_example_input_meta = input_to_example_input_meta
    fx_splitter.translate_dtensor_ops = lambda gm: None
    fx_compiler._splitter = splitter


def scope_sharding_rules_to_thunderfx_calls(rules: dict[Any, Callable]) -> None:
    """Give DTensor sharding rules for ops it has none for, only while a thunderfx program is called.

    Dynamo traces a thunderfx program by running it on fake DTensors, so each DTensor op needs DTensor's own
    sharding rule even where thunder's dtensor symbol has one (CPU's fused attention). Each rule (torch's
    public ``register_sharding`` form: acceptable (output placements, input placements) per mesh dim) is
    registered with DTensor's propagator for the duration of a call of a thunderfx-compiled object, and
    removed after it, so eager DTensor, ``thunder.jit`` and processes that never call thunderfx keep DTensor's
    own behaviour. An op torch already has a rule for keeps torch's (nothing registered).
    """
    if not DISTRIBUTED_AVAILABLE:
        return
    from thunder.dynamo.compiler import ThunderFXCompiledObject
    from torch.distributed.tensor.experimental import register_sharding

    propagator = DTensor._op_dispatcher.sharding_propagator
    missing = {op: rule for op, rule in rules.items() if op not in propagator.op_strategy_funcs}
    if not missing:
        return
    consulted = [False]  # a rule was asked during the current call: its decisions are in DTensor's cache

    def noting_use(strategy: Callable) -> Callable:
        def strategy_noting_use(*args: Any, **kwargs: Any) -> Any:
            consulted[0] = True
            return strategy(*args, **kwargs)

        return strategy_noting_use

    scoped: dict[Any, tuple] = {}
    for op, rule in missing.items():
        register_sharding(op)(rule)
        strategy = propagator.op_strategy_funcs.pop(op)
        scoped[op] = (noting_use(strategy), propagator.op_to_schema_info.pop(op, None))
    thunderfx_call = ThunderFXCompiledObject.__call__
    check(
        getattr(thunderfx_call, "__name__", "") == "__call__",
        lambda: "thunder.dynamo.compiler.ThunderFXCompiledObject.__call__ is not thunder 0.2.6's",
    )

    def call_with_sharding_rules(self: Any, *args: Any, **kwargs: Any) -> Any:
        added = [op for op in scoped if op not in propagator.op_strategy_funcs]
        for op in added:
            strategy, schema_info = scoped[op]
            propagator.op_strategy_funcs[op] = strategy
            if schema_info is not None:
                propagator.op_to_schema_info[op] = schema_info
        consulted[0] = False
        try:
            return thunderfx_call(self, *args, **kwargs)
        finally:
            for op in added:
                propagator.op_strategy_funcs.pop(op, None)
                propagator.op_to_schema_info.pop(op, None)
            if consulted[0]:  # (dynamo traced the attention) no decision made with a rule outlives the call
                clear_sharding_propagation_cache()

    call_with_sharding_rules.__name__ = "call_with_sharding_rules"
    ThunderFXCompiledObject.__call__ = call_with_sharding_rules


# ---------------------------------------------------------------------------------------------------------
# Hooks on the module passed to thunder.jit (thunder 0.2.6 layout)
# ---------------------------------------------------------------------------------------------------------
#: Per-instance state every ``nn.Module`` holds (hook dicts and the like), which ``ThunderModule`` therefore
#: holds too, for itself. thunder unpacks ``_parameters`` / ``_buffers`` / ``_modules`` by name and deletes
#: its own ``training``; every other such attribute of the jitted module must be read from the user's module.
_UNPACKED_BY_THUNDER = {"training", "_parameters", "_buffers", "_modules"}
_WRAPPER_SHADOWED_MODULE_STATE = frozenset(vars(torch.nn.Module())) - _UNPACKED_BY_THUNDER


def read_root_module_state_from_user_module() -> None:
    """Make the prologue read the jitted module's hook dicts from that module, not from its ``ThunderModule``.

    ``thunder.jit(module)`` interprets ``module.__call__``, whose ``_call_impl`` reads ``self._forward_hooks``
    & co. The prologue re-reads what the trace depends on (e.g. the ``use_local_output`` flag inside a
    tensor-parallel hook's closure) from ``get_thunder_module(module)``, the ``ThunderModule``; it forwards
    unknown attributes to the user's module, but hook dicts are its own (empty) ones, so the prologue fails
    (``KeyError``). thunder reads *callable* attributes of that module from the user's module instead; we
    mark the provenance of these state attributes the same way, so only the prologue's source object changes.
    """
    from thunder.core import interpreter, jit_ext

    thunder_getattr = jit_ext._general_jit_lookaside_map[getattr]
    if getattr(thunder_getattr, "_reads_root_module_state_from_user_module", False):
        return

    def getattr_lookaside(obj: Any, name: Any, *maybe_default: Any) -> Any:
        value = thunder_getattr(obj, name, *maybe_default)
        if (
            value is not interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED
            and isinstance(interpreter.unwrap(obj), torch.nn.Module)
            and interpreter.unwrap(name) in _WRAPPER_SHADOWED_MODULE_STATE
        ):
            record = value.provenance
            if (
                record.inst is interpreter.PseudoInst.LOAD_ATTR
                and record.inputs[0].ext_flag & jit_ext.EXT_FLAG_IS_MODULE
                and record.inputs[1].value == interpreter.unwrap(name)
            ):
                record.ext_flag |= jit_ext.EXT_FLAG_IS_CALLABLE
        return value

    getattr_lookaside._reads_root_module_state_from_user_module = True  # type: ignore[attr-defined]
    jit_ext._general_jit_lookaside_map[getattr] = getattr_lookaside


# ---------------------------------------------------------------------------------------------------------
# In-place ops (thunder 0.2.6 layout; used by ops/inplace.py)
#
# thunder 0.2.6 keeps in-place ops in its traces: a torch symbol tagged ``OpTags.IN_PLACE`` computes the new
# value and copies it into its first argument; ``thunder.core.update_aliases`` then inserts
# ``update_aliases`` lines so that later reads see the new value. Those lines are built for plain tensors.
# ---------------------------------------------------------------------------------------------------------
def inplace_torchsymbol(name: str) -> Callable[[Callable], Symbol]:
    """Like :func:`torchsymbol`, tagged ``IN_PLACE``: thunder's alias updates treat its first argument as written.

    thunder's decorator also records an out-of-place twin for its own tests (``_inplace_to_out_of_place``);
    a DTensor in-place symbol has none, so the entry is dropped again.
    """

    def decorate(fn: Callable) -> Symbol:
        make = ltorch.torchsymbol(
            id=f"thunder_dtensor.{name}", allow_tensor_subclass_proxy=True, tags=(OpTags.IN_PLACE,), out_of_place=fn
        )
        sym = make(fn)
        ltorch._inplace_to_out_of_place.pop(sym, None)
        return sym

    return decorate


def grad_enabled_while_tracing() -> bool:
    """Whether the function being traced runs with autograd on (thunder records it when jitting starts)."""
    from thunder.core.compile_data import get_compile_data

    cd = get_compile_data()
    return bool(cd.is_grad_enabled) if cd is not None else torch.is_grad_enabled()


def inplace_argument_index(symbol: Any) -> int | None:
    """Position of the ``inplace`` parameter of a thunder torch symbol (``relu(a, inplace=False)``), if any."""
    entry = ltorch._inplace_to_out_of_place.get(symbol) if isinstance(symbol, Symbol) else None
    if entry is None or entry[0] is not symbol or entry[1] < 0:
        return None
    return entry[1]


def keep_dtensors_in_alias_updates(
    is_dtensor_proxy: Callable, new_alias: Callable, update_aliases_prim: Symbol
) -> None:
    """Make thunder's alias updates keep DTensor proxies and run on the dtensor executor.

    * ``new_alias(p)`` makes the proxy for the updated alias of the DTensor proxy ``p``; thunder would make a
      plain ``TensorProxy``, losing the spec.
    * An ``update_aliases`` line over DTensors binds ``update_aliases_prim`` instead of thunder's prim, which
      the torch executor would run on DTensors.
    """
    import thunder.core.update_aliases as update_aliases

    thunder_new_alias = update_aliases._get_new_alias
    thunder_update_bsym = update_aliases._get_update_bsym

    def get_new_alias(alias: Any, trace: Any) -> Any:
        if not is_dtensor_proxy(alias.proxy):
            return thunder_new_alias(alias, trace)
        with tracectx(trace):
            return new_alias(alias.proxy)

    def get_update_bsym(group: Any, swap_map: dict, new_aliases: tuple) -> tuple:
        bsym, swap_map = thunder_update_bsym(group, swap_map, new_aliases)
        if any(is_dtensor_proxy(p) for p in bsym.flat_proxy_args):
            bsym = bsym.from_bsym(sym=update_aliases_prim)
        return bsym, swap_map

    thunder_involves_viewed_args = update_aliases._involves_viewed_args

    def involves_viewed_args(bsym: BoundSymbol, viewed: set) -> bool:
        # thunder skips the return: a DTensor written through one of its views and then returned itself would
        # be returned under its name from before the write, which the forward/backward split then drops
        if bsym.sym.id == prims.PrimIDs.RETURN:
            return any(is_dtensor_proxy(p) and variableify(p) in viewed for p in bsym.flat_proxy_args)
        return thunder_involves_viewed_args(bsym, viewed)

    update_aliases._get_new_alias = get_new_alias
    update_aliases._get_update_bsym = get_update_bsym
    update_aliases._involves_viewed_args = involves_viewed_args


def local_shards_alias(a: Any, b: Any) -> bool:
    """Whether two DTensors' local shards share memory (``a`` a view of ``b``), on real and fake tensors alike."""
    return torch._C._is_alias_of(local_tensor(a), local_tensor(b))


# ---------------------------------------------------------------------------------------------------------
# Compiled-program hook (thunder 0.2.6 layout; used by consistency.py)
# ---------------------------------------------------------------------------------------------------------
def install_compiled_program_hook(on_compiled: Callable[[Any, Any], None]) -> None:
    """Call ``on_compiled(computation_trace, backward_trace_or_None)`` each time thunder.jit finishes a program.

    thunder 0.2.6 ends each compilation by building a ``CacheEntry`` (a namedtuple in ``thunder``'s module)
    from the final traces, before the program first runs; we rebind that name to a subclass whose
    constructor calls the hook first. An exception from the hook fails the call that compiled, and nothing
    is cached. Installed once; the traces are those the entry runs (the forward as before its conversion
    to torch types, which changes no dtensor op).
    """
    base = thunder.CacheEntry
    if getattr(base, "_thunder_dtensor_compiled_hook", None) is not None:
        return
    fields = set(base._fields)
    if not {"computation_traces", "backward_traces"} <= fields:
        raise ImportError(f"thunder {thunder.__version__}: CacheEntry has fields {base._fields}; update _integration")

    class CacheEntry(base):
        __slots__ = ()
        _thunder_dtensor_compiled_hook = on_compiled

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            entry = super().__new__(cls, *args, **kwargs)
            backward = entry.backward_traces[-1] if entry.backward_traces else None
            on_compiled(entry.computation_traces[-1], backward)
            return entry

    thunder.CacheEntry = CacheEntry


# ---------------------------------------------------------------------------------------------------------
# Complex autograd (thunder 0.2.6 layout; installed by ``fix_complex_gradients``)
#
# torch differentiates complex functions with the conjugate Wirtinger convention: for a holomorphic ``f``
# the vector-Jacobian product is ``g * conj(f'(z))`` (``grad_a = g * b.conj()`` for ``a * b``). thunder
# 0.2.6's grad rules use ``g * f'(z)``, right for real tensors only, so every complex program gets wrong
# gradients: RoPE written with ``view_as_complex(x) * freqs_cis`` (torchtitan's Llama 3), complex ``exp``,
# ``matmul``... ``prims.real`` / ``prims.imag`` have no grad rule at all. Checked on thunder 0.2.6; the newest
# upstream source we could read (commit 47627ed) has the same rules, so the gate covers every release this file
# supports: narrow it once a fixed release exists. The replacement rules below are used only when an operand is
# complex; programs on real tensors keep thunder's rules and traces exactly.
# ---------------------------------------------------------------------------------------------------------
#: thunder releases whose grad rules ignore complex conjugation (0.2.6 checked; no fixed release known)
THUNDER_COMPLEX_GRADS_UNCONJUGATED = LooseVersion("0.2.6") <= THUNDER_VERSION < LooseVersion("0.3")

import cmath  # noqa: E402

from thunder.core.proxies import ComplexProxy  # noqa: E402


def _is_complex(x: Any) -> bool:
    if isinstance(x, TensorProxy):
        return dtypes.is_complex_dtype(x.dtype)
    return isinstance(x, (complex, ComplexProxy))


def _conj(x: Any) -> Any:
    """``x.conj()`` for tensors (a materialised copy, via torch's ``conj_physical``) and numbers; real ``x`` as is."""
    if not _is_complex(x):
        return x
    if isinstance(x, TensorProxy):
        conj_physical = ltorch._torch_to_thunder_function_map[torch.conj_physical]
        # this package routes the map entry through a DTensor dispatcher: call thunder's own symbol behind it
        return getattr(conj_physical, "single_device_symbol", conj_physical)(x)
    return pyval(x).conjugate()


def _log(x: Any) -> Any:
    """``log`` of a tensor or of a (complex) number: thunder's number ``log`` takes real numbers only."""
    return ltorch.log(x) if isinstance(x, TensorProxy) else cmath.log(pyval(x))


def _holomorphic_grad_rule(prim: Symbol, vjps: tuple[Callable, ...], real_rule: Callable) -> Callable:
    """A grad rule for the elementwise ``prim`` with torch's complex convention; ``real_rule`` for real operands.

    ``vjps[i](g, *conj_args, conj_out)`` is the real-valued rule's vjp for operand ``i`` (``g * f_i'``), but
    given the conjugated operands and output. For the functions below (real Taylor coefficients)
    ``f'(conj z) == conj(f'(z))``, so that is exactly ``g * conj(f_i'(z))``.
    """

    def rule(*args: Any) -> Any:
        if not any(_is_complex(a) for a in args):
            return real_rule(*args)
        out = prim(*args)
        g = get_grad(out)
        conj_args, conj_out = tuple(_conj(a) for a in args), _conj(out)
        for arg, vjp in zip(args, vjps):
            if isinstance(arg, TensorProxy):
                put_grad(arg, vjp(g, *conj_args, conj_out))
        return out

    return rule


def _sum_to_rank(t: TensorProxy, ndim: int) -> TensorProxy:
    """``t`` summed over its leading dims down to ``ndim`` dims (the batch dims an operand was broadcast over)."""
    extra = t.ndim - ndim
    return ltorch.sum(t, tuple(range(extra))) if extra > 0 else t


def _complex_matmul_grad(a: TensorProxy, b: TensorProxy, /) -> TensorProxy:
    """``prims.matmul`` on complex operands: ``grad_a = g @ b^H``, ``grad_b = a^H @ g``, 1-D operands as matrices."""
    out = prims.matmul(a, b)
    g = get_grad(out)
    a2 = ltorch.unsqueeze(a, 0) if a.ndim == 1 else a
    b2 = ltorch.unsqueeze(b, -1) if b.ndim == 1 else b
    g2 = ltorch.unsqueeze(g, -1) if b.ndim == 1 else g
    g2 = ltorch.unsqueeze(g2, -2) if a.ndim == 1 else g2
    grad_a = _sum_to_rank(ltorch.matmul(g2, _conj(b2).mT), a2.ndim)
    grad_b = _sum_to_rank(ltorch.matmul(_conj(a2).mT, g2), b2.ndim)
    put_grads((a, b), (ltorch.reshape(grad_a, a.shape), ltorch.reshape(grad_b, b.shape)))
    return out


def _complex_linear_grad(a: TensorProxy, w: TensorProxy, bias: None | TensorProxy) -> TensorProxy:
    """``prims.linear`` on complex operands: ``grad_a = g @ conj(w)``, ``grad_w = g^T @ conj(a)``, bias: ``sum g``."""
    out = prims.linear(a, w, bias)
    g = get_grad(out)
    g2 = ltorch.reshape(g, (-1, w.shape[0]))
    a2 = ltorch.reshape(a, (-1, w.shape[1]))
    put_grad(a, ltorch.reshape(ltorch.matmul(g2, _conj(w)), a.shape))
    put_grad(w, ltorch.matmul(g2.mT, _conj(a2)))
    if bias is not None:
        put_grad(bias, ltorch.reshape(ltorch.sum(g2, (0,)), bias.shape))
    return out


def _complex_or_real_rule(complex_rule: Callable, real_rule: Callable) -> Callable:
    """``complex_rule`` when a tensor operand is complex, else thunder's ``real_rule``."""

    def rule(*args: Any) -> Any:
        return (complex_rule if any(_is_complex(a) for a in args) else real_rule)(*args)

    return rule


def _real_grad(a: TensorProxy) -> TensorProxy:
    """``z.real``: the real cotangent becomes the real part of the complex gradient."""
    out = prims.real(a)
    put_grad(a, prims.convert_element_type(get_grad(out), a.dtype))
    return out


def _imag_grad(a: TensorProxy) -> TensorProxy:
    """``z.imag``: the real cotangent ``g`` becomes the complex gradient ``1j * g``."""
    out = prims.imag(a)
    put_grad(a, prims.convert_element_type(get_grad(out), a.dtype) * 1j)
    return out


def _conjugating_backward(backward: Callable, complex_derivative: Callable | None = None) -> Callable:
    """A ``backward_impls`` entry (``(*residuals, g) -> g * f'``) made ``g * conj(f')`` for a complex ``g``.

    These entries are linear in ``g`` with real-coefficient derivatives, so ``conj(backward(..., conj(g)))``
    is torch's vjp; ``complex_derivative(*residuals)`` replaces a formula that is right on reals only. A
    real ``g`` keeps thunder's rule untouched.
    """

    def conjugating(*residuals_and_g: Any) -> Any:
        *residuals, g = residuals_and_g
        if not _is_complex(g):
            return backward(*residuals, g)
        if complex_derivative is not None:
            return g * _conj(complex_derivative(*residuals))
        return _conj(backward(*residuals, _conj(g)))

    return conjugating


#: elementwise prims with a rule in thunder's grad map -> the vjp of each operand, given (g, *conj args, conj out)
_HOLOMORPHIC_VJPS: dict[str, tuple[Callable, ...]] = {
    "MUL": (lambda g, a, b, out: g * b, lambda g, a, b, out: g * a),
    "DIV": (lambda g, a, b, out: g / b, lambda g, a, b, out: -g * out / b),
    "EXP": (lambda g, a, out: g * out,),
    "LOG": (lambda g, a, out: g / a,),
    "SIN": (lambda g, a, out: g * ltorch.cos(a),),
    "COS": (lambda g, a, out: -g * ltorch.sin(a),),
    "TANH": (lambda g, a, out: g * (1 - out * out),),
    "RSQRT": (lambda g, a, out: -0.5 * g * out * out * out,),
    "RECIPROCAL": (lambda g, a, out: -g * out * out,),
    "POW": (lambda g, a, b, out: g * b * a ** (b - 1), lambda g, a, b, out: g * out * _log(a)),
}
#: unary prims whose vjp sits in thunder's ``backward_impls`` table and is holomorphic
_HOLOMORPHIC_BACKWARD_IMPLS = (
    "ACOS", "ASIN", "ASINH", "ATAN", "ATANH", "COSH", "SINH", "SQRT", "LOG10", "LOG1P", "LOG2", "EXP2",
    "EXPM1",
)  # fmt: skip
#: ... and those whose thunder formula is right on reals only: the complex derivative (torch's, with its branch cuts)
_COMPLEX_DERIVATIVES = {
    # sqrt(z*z - 1) != sqrt(z + 1) * sqrt(z - 1) off the real line
    "ACOSH": lambda z: ltorch.rsqrt(z + 1) * ltorch.rsqrt(z - 1),
}


def fix_complex_gradients() -> None:
    """Give thunder's autodiff torch's complex convention (see this section's header). Idempotent."""
    if not patch_kind_enabled("thunder-fix"):
        return
    if not THUNDER_COMPLEX_GRADS_UNCONJUGATED:
        return
    import thunder.core.transforms as transforms

    grad_map = transforms._grad_fn_map
    pids = prims.PrimIDs
    if getattr(grad_map.get(pids.MUL), "_thunder_dtensor_complex", False):
        return
    rules: dict[Any, Callable] = {
        getattr(pids, name): _holomorphic_grad_rule(getattr(prims, name.lower()), vjps, grad_map[getattr(pids, name)])
        for name, vjps in _HOLOMORPHIC_VJPS.items()
    }
    rules[pids.MATMUL] = _complex_or_real_rule(_complex_matmul_grad, grad_map[pids.MATMUL])
    rules[pids.LINEAR] = _complex_or_real_rule(_complex_linear_grad, grad_map[pids.LINEAR])
    rules[pids.REAL], rules[pids.IMAG] = _real_grad, _imag_grad
    for prim_id, rule in rules.items():
        register_grad(prim_id, rule)
        grad_map[prim_id]._thunder_dtensor_complex = True
    for name in (*_HOLOMORPHIC_BACKWARD_IMPLS, *_COMPLEX_DERIVATIVES):
        prim_id = getattr(pids, name)
        backward = transforms.backward_impls[prim_id]
        transforms.backward_impls[prim_id] = _conjugating_backward(backward, _COMPLEX_DERIVATIVES.get(name))


# ---------------------------------------------------------------------------------------------------------
# torch.nn.attention.sdpa_kernel inside thunder programs (thunder 0.2.6 interpreter; used by sdpa_backends.py)
#
# Private torch names used here: ``torch.nn.attention._sdpa_kernel`` / ``_sdpa_kernel_variadic`` /
# ``_backend_from_string`` / ``_cur_sdpa_kernel_backends`` (torch 2.13: what ``sdpa_kernel`` and dynamo's
# graphs call), ``torch._fused_sdp_choice`` (torch's SDPA kernel selector).
# ---------------------------------------------------------------------------------------------------------
def sdpa_backends_enabled_globally(with_priority: bool) -> tuple:
    """The SDPA backends torch's global flags enable now (in priority order with ``with_priority``)."""
    import torch.nn.attention as attention

    return tuple(attention._cur_sdpa_kernel_backends(with_priority=with_priority))


def fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """The SDPA kernel torch would pick for these (real) tensors under the flags in effect; raises if none can run."""
    return torch._fused_sdp_choice(*args, **kwargs)


def is_sdpa_kernel_fx_target(target: Any) -> bool:
    """Whether a dynamo graph's call target is one of the calls dynamo records for an ``sdpa_kernel`` context."""
    import torch.nn.attention as attention

    return target is attention._sdpa_kernel or target is attention._backend_from_string


def install_sdpa_kernel_support(*, context: type, set_backends: Callable, check_sdpa_call: Callable) -> None:
    """Make thunder's interpreter run ``sdpa_kernel(...)`` (and dynamo's spelling of it) at trace time only.

    thunder 0.2.6 steps into ``sdpa_kernel`` and fails on its ``dict.fromkeys``; and stepping in would set
    torch's global flags while tracing, with nothing in the trace. Instead:

    * ``sdpa_kernel(backends, set_priority)`` (and dynamo's ``_sdpa_kernel_variadic``) builds ``context``,
      whose ``__enter__`` / ``__exit__`` run whole (record / restore the choice for the trace being built);
    * ``_sdpa_kernel(backends, set_priority)``, what dynamo graphs call on entering and leaving the context,
      runs ``set_backends`` whole; ``_backend_from_string`` (the graphs' spelling of a backend) runs whole;
    * ``F.scaled_dot_product_attention`` first runs ``check_sdpa_call`` on its arguments, then what it ran
      before (thunder's symbol or the DTensor dispatcher): install this after the op registrations.
    """
    if not patch_kind_enabled("thunder-fix"):
        return
    import torch.nn.attention as attention
    import torch.nn.functional as F
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map
    sdpa = F.scaled_dot_product_attention
    if getattr(lookasides.get(sdpa), "_checks_sdpa_kernel_choice", False):
        return

    def variadic(*backends: Any) -> Any:
        return context(list(backends))

    opaque = {
        attention.sdpa_kernel: context,
        attention._sdpa_kernel_variadic: variadic,
        context.__enter__: context.__enter__,
        context.__exit__: context.__exit__,
        attention._sdpa_kernel: set_backends,
        attention._backend_from_string: attention._backend_from_string,
    }
    for fn, impl in opaque.items():
        lookasides[fn] = jit_ext.interpreter_needs_wrap(impl)

    run_sdpa = lookasides[sdpa]
    check = jit_ext.interpreter_needs_wrap(check_sdpa_call)

    def checked_sdpa(*args: Any, **kwargs: Any) -> Any:
        if check(*args, **kwargs) is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED:
            return interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED
        return run_sdpa(*args, **kwargs)

    checked_sdpa._checks_sdpa_kernel_choice = True  # type: ignore[attr-defined]
    lookasides[sdpa] = checked_sdpa


# ---------------------------------------------------------------------------------------------------------
# Autocast (thunder 0.2.6 layout; used by autocast.py)
#
# thunder 0.2.6 applies ``torch.autocast`` while it traces: every ``Symbol.__call__`` first asks
# ``thunder.transforms.autocast.maybe_apply_autocast(sym)`` for a replacement, which applies rules keyed by
# symbol id (linear, matmul, conv, SDPA) while the compile data's autocast stack is active. That stack is
# pushed for an autocast the jitted function is *called* under (``thunder.jit``'s cache-info step, never
# popped) and by ``torch.autocast.__enter__`` *inside* it (interpreter lookaside). The traces then run
# under ``no_autocast``, so every cast must be explicit in the trace. Private torch name used here:
# ``torch.utils._python_dispatch.TorchDispatchMode`` (to see which casts torch's autocast inserts).
# ---------------------------------------------------------------------------------------------------------
def install_autocast_hook(replacement_for: Callable[[Symbol], Callable | None]) -> None:
    """Let ``replacement_for(sym)`` replace a symbol's call first; thunder's own autocast rules otherwise.

    Rebinds ``thunder.transforms.autocast.maybe_apply_autocast``, which ``Symbol.__call__`` imports at
    each call. Installed once.
    """
    import thunder.transforms.autocast as thunder_autocast

    thunder_hook = thunder_autocast.maybe_apply_autocast
    if getattr(thunder_hook, "_thunder_dtensor_autocast", False):
        return

    def maybe_apply_autocast(sym: Symbol) -> Callable | None:
        replacement = replacement_for(sym)
        return replacement if replacement is not None else thunder_hook(sym)

    maybe_apply_autocast._thunder_dtensor_autocast = True  # type: ignore[attr-defined]
    thunder_autocast.maybe_apply_autocast = maybe_apply_autocast


def thunder_autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype thunder's autocast applies to ops on ``device_type`` now, or None (none active, or disabled).

    None also inside an autocast rule (thunder's ``disable_autocast``), where the ops a rule calls are not
    cast again.
    """
    import thunder.transforms.autocast as thunder_autocast
    from thunder.core.compile_data import get_compile_data

    cd = get_compile_data()
    if cd is None or cd.autocast_stack.is_empty() or not thunder_autocast.is_autocast_enabled():
        return None
    dtype = cd.autocast_stack.get_dtype_for_device_if_enabled(device_type)
    return None if dtype is None else dtypes.to_torch_dtype(dtypes.to_dtype(dtype))


def thunder_autocast_disabled() -> contextlib.AbstractContextManager:
    """thunder's own switch: symbols called meanwhile get no autocast rule (those a rule calls, say)."""
    import thunder.transforms.autocast as thunder_autocast

    return thunder_autocast.disable_autocast()


def interpreting_user_program() -> bool:
    """Whether thunder's interpreter is tracing the user's program now (not autodiff or a later transform).

    An autocast applies to the ops the program calls; the backward thunder's autodiff builds afterwards
    follows the forward's dtypes, as eager autograd does, even though the autocast stack stays pushed.
    """
    from thunder.core import interpreter

    return interpreter.get_interpretercompilectx_if_available() is not None


@contextlib.contextmanager
def recording_aten_calls() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Record ``(aten op, args, kwargs)`` of every op dispatched meanwhile (below autocast: its casts show)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[Any, tuple, dict]] = []

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            calls.append((func, args, kwargs))
            return func(*args, **kwargs)

    with _Recorder():
        yield calls


# ---------------------------------------------------------------------------------------------------------
# FSDP2 (``fully_shard``) under thunder.jit (torch 2.13 / thunder 0.2.6 layout; used by fsdp.py)
#
# thunder's interpreter must not step into FSDP2's module hooks: they key dicts by parameters (which are
# proxies while tracing: ``TypeError: unhashable type: 'DTensorProxy'`` in ``FSDPState._init_fqns``), swap
# parameters on modules, and register autograd functions and stream waits. Instead the hooks become
# lookasides, and a module attribute read that yields an FSDP-managed (sharded) parameter is handed to
# fsdp.py, which puts the unshard in the trace. Private torch names used here:
# ``torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState`` (``_pre_forward``, ``_post_forward``,
# ``_lazy_init``, ``_is_root``, ``_state_ctx.all_states``, ``_fsdp_param_groups``), ``FSDPParamGroup.fsdp_params``,
# ``FSDPParam`` (``sharded_param``, ``_unsharded_dtensor_spec``, ``fsdp_placement``, ``mesh_info``,
# ``param_dtype``, ``reduce_dtype``), ``_fsdp_common.FSDPMeshInfo`` / ``HSDPMeshInfo``, and
# ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FSDPParamLayout:
    """How FSDP2 shards one parameter, as far as the unshard / reduce-scatter in a thunder program needs it.

    ``unsharded_spec`` is the spec of the DTensor FSDP2 computes with (``FSDPParam.unsharded_param``: the
    tensor-parallel spec), or None for a plain (non-DTensor) parameter. ``dp_mesh_dim`` is the sharded
    parameter's mesh dim FSDP2 shards over; ``shard_dim`` the tensor dim it shards; ``supported`` is False
    (with ``why``) for the layouts fsdp.py does not handle (HSDP, mixed precision, ``Shard(d != 0)``).
    """

    unsharded_spec: Any
    dp_mesh_dim: int
    shard_dim: int
    supported: bool
    why: str = ""


def fsdp_state_hook_functions() -> tuple[Callable, Callable]:
    """The functions FSDP2 registers as forward pre-/post-hooks (bound to each ``FSDPState``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return FSDPState._pre_forward, FSDPState._post_forward


def fsdp_lazy_init(state: Any) -> None:
    """Run FSDP2's lazy init (what its first pre-forward does: root detection, shared state) if not done."""
    if state._is_root is None:
        state._lazy_init()


def fsdp_managed_params(state: Any) -> Iterator[tuple[torch.nn.Parameter, FSDPParamLayout]]:
    """Every parameter the FSDP2 states sharing ``state``'s context manage (the whole tree once lazily inited)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    states = state._state_ctx.all_states or [state]
    for s in states:
        for group in s._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                spec = fsdp_param._unsharded_dtensor_spec
                mesh_info = fsdp_param.mesh_info
                why = ""
                if isinstance(mesh_info, HSDPMeshInfo) or not isinstance(mesh_info, FSDPMeshInfo):
                    why = "only FSDP (fully_shard on a 1-D data-parallel mesh) is supported, not HSDP / DDP"
                elif fsdp_param.param_dtype is not None or fsdp_param.reduce_dtype is not None:
                    why = "FSDP2 mixed precision (MixedPrecisionPolicy param_dtype / reduce_dtype) is not supported"
                elif fsdp_param.fsdp_placement.dim != 0:
                    why = f"FSDP2 sharding on dim {fsdp_param.fsdp_placement.dim} is not supported (only dim 0)"
                elif spec is None:
                    why = "FSDP2 over plain (non-DTensor) parameters is not supported, only over tensor-parallel ones"
                layout = FSDPParamLayout(spec, 0, fsdp_param.fsdp_placement.dim, not why, why)
                yield fsdp_param.sharded_param, layout


def local_shape_on(shape: tuple, mesh: Any, placements: tuple) -> tuple[int, ...]:
    """This rank's local shape of a DTensor of global ``shape`` on ``mesh`` with ``placements``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(int(s) for s in compute_local_shape_and_global_offset(shape, mesh, placements)[0])


def install_fsdp_support(*, before_forward: Callable[[Any], None], parameter_read: Callable[[Any, Any], Any]) -> None:
    """Keep thunder's interpreter out of FSDP2's forward hooks; let ``parameter_read`` replace parameter reads.

    * FSDP2's forward pre-hook runs ``before_forward(state)`` whole (outside the interpreter) and changes
      nothing in the program; its forward post-hook does nothing (resharding, prefetching, stream waits and
      the pre-backward hook registration have no meaning inside a thunder program).
    * A module attribute read (``self.weight``) whose value is a tensor read from the module gives
      ``parameter_read(real_value, proxy)`` the chance to return another proxy (None: the read as it is).
    Installed once.
    """
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map
    previous_getattr = lookasides[getattr]
    if getattr(previous_getattr, "_thunder_dtensor_fsdp", False):
        return
    pre_forward, post_forward = fsdp_state_hook_functions()

    def pre_forward_lookaside(state: Any, module: Any, args: Any, kwargs: Any) -> None:
        before_forward(state)
        return None  # the hook leaves the module's inputs as they are

    def post_forward_lookaside(state: Any, module: Any, args: Any, output: Any) -> None:
        return None  # the hook leaves the module's output as it is

    lookasides[pre_forward] = jit_ext.interpreter_needs_wrap(pre_forward_lookaside)
    lookasides[post_forward] = jit_ext.interpreter_needs_wrap(post_forward_lookaside)

    def getattr_lookaside(obj: Any, name: Any, *maybe_default: Any) -> Any:
        value = previous_getattr(obj, name, *maybe_default)
        if value is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED or not isinstance(
            interpreter.unwrap(obj), torch.nn.Module
        ):
            return value
        proxy_value = interpreter.unwrap(value)
        real = getattr(value, "original_value", None)
        if not isinstance(proxy_value, TensorProxy) or not isinstance(real, torch.Tensor):
            return value

        try:
            replacement = parameter_read(real, proxy_value)
        except Exception as e:  # raised inside the program being traced, as an op's error would be
            return interpreter.do_raise(e)
        if replacement is None:
            return value
        record = interpreter.ProvenanceRecord(
            interpreter.PseudoInst.OPAQUE, inputs=[interpreter.wrap_const(parameter_read).provenance, value.provenance]
        )
        return interpreter.wrap(replacement, provenance=record)

    getattr_lookaside._thunder_dtensor_fsdp = True  # type: ignore[attr-defined]
    getattr_lookaside._reads_root_module_state_from_user_module = getattr(  # type: ignore[attr-defined]
        previous_getattr, "_reads_root_module_state_from_user_module", False
    )
    lookasides[getattr] = getattr_lookaside


def scope_ambient_autocast_to_each_call() -> None:
    """An autocast a jitted function was called under applies to that call only.

    thunder 0.2.6 pushes the caller's autocast onto the compile data's autocast stack at each call made under
    it and never pops it, so a later call without autocast retraces (the cache key differs) but still casts,
    on plain tensors and DTensors alike. Every push on that stack within a call is balanced except this one, so
    the stack is emptied as each call starts: ``thunder._with_cache_info_ctx``, which wraps each jitted
    function's ``get_computation_and_inputs`` when ``thunder.jit`` builds it, reaches the compile data through
    that function's ``weakref_cd`` closure cell.
    """
    if not patch_kind_enabled("thunder-fix"):
        return
    if getattr(thunder._with_cache_info_ctx, "_thunder_dtensor_scoped", False):
        return
    if not (LooseVersion("0.2.6") <= THUNDER_VERSION < LooseVersion("0.3")):
        return  # another layout: check the bug there before gating this in
    with_cache_info_ctx = thunder._with_cache_info_ctx

    def scoped(fn: Callable) -> Callable:
        wrapped = with_cache_info_ctx(fn)
        names = fn.__code__.co_freevars
        if "weakref_cd" not in names:
            return wrapped
        weakref_cd = fn.__closure__[names.index("weakref_cd")].cell_contents

        @functools.wraps(wrapped)
        def call(*args: Any, **kwargs: Any) -> Any:
            cd = weakref_cd()
            if cd is not None:
                cd.autocast_stack.stack.clear()
            return wrapped(*args, **kwargs)

        return call

    scoped._thunder_dtensor_scoped = True  # type: ignore[attr-defined]
    thunder._with_cache_info_ctx = scoped


# ---------------------------------------------------------------------------------------------------------
# Lowering (thunder 0.2.6 layout; used by lowering.py)
# ---------------------------------------------------------------------------------------------------------
from thunder.core.compile_data import get_compile_option  # noqa: E402, F401  (re-exported for lowering.py)
from thunder.core.trace import TraceProvenance  # noqa: E402, F401  (re-exported for lowering.py)
from torch._dispatch.python import enable_python_dispatcher  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, autograd_would_have_decomposed  # noqa: E402


class _NotRecordable(Exception):
    """A call the light recorder leaves to ``make_fx`` (which knows how to trace it)."""


class _AtenGraphRecorder(TorchDispatchMode):
    """Each ATen call that reaches it on fake tensors, as a node of an fx graph (as ``make_fx`` would record it).

    ``make_fx`` builds fx proxies, a tracer and a ``GraphModule`` with generated code around each trace; the
    lowering only reads the graph. For the common case (ATen ops on fake tensors the graph made) this records
    the same graph at about a third of the cost. Anything ``make_fx`` treats specially (tensor constants,
    ``torch.tensor`` literals, data-dependent ops, CompositeImplicit decompositions, non-tensor results) stops
    the recording and the call is traced by ``make_fx`` instead: the graphs stay ``make_fx``'s in every case.
    """

    def __init__(self) -> None:
        super().__init__()
        self.graph = torch.fx.Graph()
        self.node_of: dict[int, tuple[torch.Tensor, torch.fx.Node]] = {}  # id -> (tensor kept alive, its node)
        self.suspended = 0
        self.stopped: str | None = None

    def record(self, tensor: torch.Tensor, node: torch.fx.Node) -> None:
        self.node_of[id(tensor)] = (tensor, node)
        node.meta["val"] = tensor

    def node_for(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            entry = self.node_of.get(id(value))
            if entry is None or entry[0] is not value:
                raise self.stop("a tensor the graph did not make")
            return entry[1]
        if isinstance(value, (list, tuple)):
            return type(value)(self.node_for(v) for v in value)
        if isinstance(value, dict):
            return {k: self.node_for(v) for k, v in value.items()}
        return value

    def stop(self, why: str) -> _NotRecordable:
        self.stopped = why
        return _NotRecordable(why)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and not issubclass(t, FakeTensor) for t in types):
            return NotImplemented  # a tensor subclass (DTensor) dispatches first, then calls us on its shards
        if self.suspended or func is torch.ops.prim.device.default:
            return func(*args, **kwargs)
        if func in _CALLS_MAKE_FX_TRACES_SPECIALLY or torch.Tag.data_dependent_output in func.tags:
            raise self.stop(f"{func} is traced specially")
        if _has_implicit_decomposition(func) and autograd_would_have_decomposed(func, tree_flatten((args, kwargs))[0]):
            raise self.stop(f"{func} decomposes")
        node_args, node_kwargs = self.node_for(args), self.node_for(kwargs)
        out = func(*args, **kwargs)
        node = self.graph.call_function(func, node_args, node_kwargs)
        if isinstance(out, torch.Tensor):
            self.record(out, node)
        elif isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            node.meta["val"] = out
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    self.record(o, self.graph.call_function(operator.getitem, (node, i)))
        else:
            raise self.stop(f"{func} returned no tensor")
        return out


@functools.cache
def _has_implicit_decomposition(func: Any) -> bool:
    """Whether ``make_fx`` would decompose ``func`` (its CompositeImplicitAutograd kernel) when it reaches it."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


_CALLS_MAKE_FX_TRACES_SPECIALLY = {torch.ops.aten.lift_fresh.default, torch.ops.aten.is_nonzero.default}

#: the recorder of the trace being recorded (the innermost), for ``outside_tracing_modes``
_RECORDERS: list[_AtenGraphRecorder] = []


def trace_aten_graph(fn: Callable[..., list], inputs: list[tuple]) -> torch.fx.Graph:
    """The ATen graph of ``fn`` on fake tensors of ``inputs`` ((shape, stride, dtype, device) each), as
    ``make_fx(fn, tracing_mode="fake")`` records it. ``fn`` returns a list of tensors (or None); it may be
    called twice (the second time under ``make_fx``, when the light recorder stops)."""
    mode = _trace_time_fake_mode()
    recorder = _AtenGraphRecorder()
    with mode:
        fakes = _empty_tensors(inputs)
    for i, fake in enumerate(fakes):
        recorder.record(fake, recorder.graph.placeholder(f"arg{i}_1"))
    _RECORDERS.append(recorder)
    try:
        with enable_python_dispatcher(), mode, recorder:
            outs = fn(*fakes)
        if recorder.stopped is None:  # (a stop that the traced code caught still stops)
            recorder.graph.output([None if o is None else recorder.node_for(o) for o in outs])
    except Exception:
        if recorder.stopped is None:
            raise
    finally:
        _RECORDERS.pop()
    if recorder.stopped is None:
        return recorder.graph
    with torch.no_grad():  # make_fx takes real example inputs: allocated with the local (small) shapes
        examples = _empty_tensors(inputs)
    return make_fx(fn, tracing_mode="fake")(*examples).graph


def _empty_tensors(inputs: list[tuple]) -> list[torch.Tensor]:
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in inputs]


def torch_tree_map(fn: Callable, tree: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


@contextlib.contextmanager
def no_ambient_autocast() -> Iterator[None]:
    """torch's autocast off on every device type while a trace-time function runs (ops that autocast
    themselves still can, inside)."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def is_functional_collective(op: Any) -> bool:
    """Whether ``op`` (an OpOverload) is one of torch.distributed's functional collectives (or their wait)."""
    return getattr(op, "namespace", None) == "_c10d_functional"


def group_name(mesh: Any, dim: int) -> str:
    """The process group name of one mesh dim, as functional collectives name it."""
    return mesh.get_group(dim).group_name


def mesh_group_names(mesh: Any) -> tuple[str, ...]:
    """The process group name of every dim of a (real) device mesh."""
    return tuple(group_name(mesh, dim) for dim in range(mesh.ndim))


@contextlib.contextmanager
def fake_tensor_logging_muted() -> Iterator[None]:
    """Mute fake tensor's log of failing meta kernels while a trace-time run may fail (we report it).

    The logger is disabled rather than given another level: ``Logger.setLevel`` clears the level cache of every
    logger in the process (thousands under torch), twice per trace-time run.
    """
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


def let_torch_executors_claim(symbol: Symbol, fn: Callable) -> None:
    """Make a lowered local op claimable by thunder's torch executor and fusible by its torch.compile executor.

    thunder's ``torchcompile`` executor fuses only symbols in its table and compiles each region through the
    torch executor, so the op goes into both; collectives and the DTensor boundary never do.
    """
    from thunder.executors.torch_compile import torch_compile_ex
    from thunder.executors.torchex import ex as pytorch_ex
    from thunder.extend import ImplInfo

    op = pytorch_ex.register_operator(symbol.name, like=symbol, fn=fn)
    pytorch_ex.register_implementation(symbol, op, checker=lambda *args, **kwargs: True)
    torch_compile_ex._implmap[symbol.id] = ImplInfo()


def claiming_operator(bsym: BoundSymbol, executors: Sequence[Any]) -> Symbol | None:
    """The operator thunder's claiming pass would replace ``bsym`` with: that of the first executor in
    ``executors`` that can execute it, when that is an operator executor without an execution transform; None
    where a fusion executor could take it first (its fusion pass needs the symbol as it is) or none can."""
    from thunder.extend import FusionExecutor

    for ex in executors:
        if isinstance(ex, FusionExecutor) and bsym.sym.id in ex.implmap:
            return None
        if isinstance(ex, OperatorExecutor):
            impl = ex.implmap.get(bsym.sym.id)
            if impl is not None and impl.checker(*bsym.args, **bsym.kwargs):
                return impl.symbol if impl.execution_transform is None else None
    return None


def install_lowering(
    lower: Callable[[TraceCtx, Sequence[Any]], TraceCtx],
    enabled: Callable[[], bool],
    annotate: Callable[[TraceCtx, TraceCtx], None],
) -> None:
    """Run ``lower`` on the computation trace (the joint forward + backward one under autograd) just before
    thunder assigns executors to it.

    thunder 0.2.6's ``thunder.jit`` calls ``transform_for_execution`` (imported into ``thunder``'s namespace) on
    the prologue, then once on the computation trace, which autodiff has already made the joint trace; the
    forward / backward split comes after, so a transform here sees both halves and the split saves whatever
    the lowered forward computes for the backward. The prologue (run by the Python executor only) is skipped.
    """
    if getattr(thunder.transform_for_execution, "_thunder_dtensor_lowering", False):
        return
    if not (LooseVersion("0.2.6") <= THUNDER_VERSION < LooseVersion("0.3")):
        raise ImportError(f"thunder {thunder.__version__}: check where the lowering hooks in, then update _integration")
    original = thunder.transform_for_execution

    @functools.wraps(original)
    def transform_for_execution(trace: TraceCtx, executors_list: Any, *args: Any, **kwargs: Any) -> Any:
        is_prologue = tuple(executors_list) == (thunder.pythonex,)
        if not is_prologue and enabled():
            lowered = lower(trace, tuple(executors_list))
            if lowered is not trace:
                traces = original(lowered, executors_list, *args, **kwargs)
                annotate(lowered, traces[-1])
                return [lowered, *traces]
        return original(trace, executors_list, *args, **kwargs)

    transform_for_execution._thunder_dtensor_lowering = True  # type: ignore[attr-defined]
    thunder.transform_for_execution = transform_for_execution


# ---------------------------------------------------------------------------------------------------------
# Module calls (torch 2.13 ``nn.Module._call_impl`` layout, thunder 0.2.6 interpreter): first-call time
# ---------------------------------------------------------------------------------------------------------
def _read_through_interpreter(obj: Any, name: str) -> Any:
    """``obj.name`` read by the interpreter (``obj`` wrapped), so the prologue checks what was read."""
    from thunder.core import interpreter

    return interpreter._interpret_call(getattr, obj, interpreter.wrap_const(name))


def _module_hook_state_is_plain(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs only its own forward pre-hooks and forward hooks (with or without kwargs),
    none always-called, no backward hooks, no global hooks, no ``torch.jit`` tracing and no ``module.compile()``:
    the calls :func:`dispatch_module_calls_outside_the_interpreter` makes itself. Anything else is interpreted."""
    from torch.nn.modules import module as module_mod

    return (
        not torch._C._get_tracing_state()
        and module._compiled_call_impl is None
        and type(module)._call_impl is torch.nn.Module._call_impl
        and "_call_impl" not in module.__dict__
        and not (module._backward_hooks or module._backward_pre_hooks)
        and not module._forward_hooks_always_called
        and not (module_mod._global_backward_pre_hooks or module_mod._global_backward_hooks)
        and not (module_mod._global_forward_pre_hooks or module_mod._global_forward_hooks)
    )


def dispatch_module_calls_outside_the_interpreter() -> None:
    """``module(*args)`` under ``thunder.jit``: the hook loop runs in Python; hooks and ``forward`` are interpreted.

    thunder interprets ``nn.Module._wrapped_call_impl`` / ``_call_impl`` bytecode by bytecode for every module
    call. With hooks (every tensor-parallel module has two) that is the slow path's closure, dict unpacking and
    loops: most of a TP model's first-call time. This lookaside does what that code does for the common case
    (:func:`_module_hook_state_is_plain`): each forward pre-hook ``hook(module, args)`` (a non-None result
    replaces ``args``, a non-tuple one as ``(result,)``) or, registered with kwargs, ``hook(module, args,
    kwargs)`` (a non-None result is the new ``(args, kwargs)``), ``module.forward(*args, **kwargs)``, each
    forward hook ``hook(module, args, output)`` or ``hook(module, args, kwargs, output)`` (a non-None result
    replaces the output). The hooks and ``forward`` are read
    through the interpreter, from the module's hook dicts by hook id, so the prologue still checks what they read
    (e.g. a tensor-parallel hook's ``use_local_output``). Other cases interpret a copy of torch's function.
    """
    if not patch_kind_enabled("speedup"):
        return
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map
    call_impl = torch.nn.Module._wrapped_call_impl
    if call_impl in lookasides:
        return
    interpreted_call_impl = _interpretable_copy(call_impl)
    wrap_const, unwrap = interpreter.wrap_const, interpreter.unwrap
    raised = interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED

    def hook_by_id(hooks: Any, hook_id: int) -> Any:
        return interpreter._interpret_call(lambda d, k: d[k], hooks, wrap_const(hook_id))

    def call_star(fn: Any, args: Any, kwargs: Any) -> Any:
        return interpreter._interpret_call(lambda f, a, k: f(*a, **k), fn, args, kwargs)

    def module_call(module: Any, *args: Any, **kwargs: Any) -> Any:
        if not _module_hook_state_is_plain(unwrap(module)):
            return interpreter._interpret_call(interpreted_call_impl, module, *args, **kwargs)
        forward = _read_through_interpreter(module, "forward")
        if forward is raised:
            return forward
        user_module = unwrap(module)
        if not (user_module._forward_pre_hooks or user_module._forward_hooks):
            return interpreter._interpret_call(forward, *args, **kwargs)
        wrapped_args = interpreter.wrap_args(args)
        wrapped_kwargs = interpreter.wrap_kwargs(kwargs)
        if user_module._forward_pre_hooks:
            hooks = _read_through_interpreter(module, "_forward_pre_hooks")
            for hook_id in list(unwrap(hooks)):
                hook = hook_by_id(hooks, hook_id)
                if hook_id in user_module._forward_pre_hooks_with_kwargs:
                    result = interpreter._interpret_call(hook, module, wrapped_args, wrapped_kwargs)
                    if result is raised:
                        return result
                    if unwrap(result) is None:
                        continue
                    if not (isinstance(unwrap(result), tuple) and len(unwrap(result)) == 2):
                        return interpreter.do_raise(
                            RuntimeError(
                                "forward pre-hook must return None or a tuple of (new_args, new_kwargs), "
                                f"but got {unwrap(result)}."
                            )
                        )
                    interpreter.populate_item_wrappers(result)
                    wrapped_args, wrapped_kwargs = result.item_wrappers
                    continue
                result = interpreter._interpret_call(hook, module, wrapped_args)
                if result is raised:
                    return result
                if unwrap(result) is not None:
                    if not isinstance(unwrap(result), tuple):
                        result = interpreter.wrap_args((result,))
                    wrapped_args = result
        output = call_star(forward, wrapped_args, wrapped_kwargs)
        if output is raised or not user_module._forward_hooks:
            return output
        hooks = _read_through_interpreter(module, "_forward_hooks")
        for hook_id in list(unwrap(hooks)):
            hook = hook_by_id(hooks, hook_id)
            if hook_id in user_module._forward_hooks_with_kwargs:
                result = interpreter._interpret_call(hook, module, wrapped_args, wrapped_kwargs, output)
            else:
                result = interpreter._interpret_call(hook, module, wrapped_args, output)
            if result is raised:
                return result
            if unwrap(result) is not None:
                output = result
        return output

    lookasides[call_impl] = module_call


def tensor_parallel_style_functions() -> dict[str, Callable]:
    """torch's tensor-parallel style functions that its module hooks call, by ``Class.function`` (torch 2.13)."""
    from torch.distributed.tensor.parallel import style

    names = {
        "ColwiseParallel": ("_prepare_input_fn", "_prepare_output_fn"),
        "RowwiseParallel": ("_prepare_input_fn", "_prepare_output_fn"),
        "SequenceParallel": ("_prepare_input_fn", "_prepare_output_fn"),
        "PrepareModuleInput": ("_prepare_input_fn", "_prepare_input_arg"),
        "PrepareModuleOutput": ("_prepare_out_fn",),
    }
    # staticmethods come out of the class dict as plain functions; methods are plain functions there already
    return {f"{cls}.{fn}": getattr(getattr(style, cls), fn) for cls, fns in names.items() for fn in fns}


def _interpretable_copy(fn: types.FunctionType) -> types.FunctionType:
    """The same function under another identity: interpreting it interprets ``fn``'s code, which a lookaside on
    ``fn`` itself would prevent."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def register_lookaside(
    fn: Callable,
    lookaside: Callable,
    *,
    applies: Callable[..., bool] | None = None,
    self_attributes: tuple[str, ...] = (),
) -> None:
    """Calls of ``fn`` in jitted code run ``lookaside`` whole, on unwrapped values (proxies), instead.

    ``applies`` (given the same unwrapped arguments) can decline a call: ``fn``'s own code is interpreted then.
    ``self_attributes``: ``fn`` is a method whose object can change between calls (a style object a user
    edits); the lookaside gets, in place of that object, a namespace of these attributes read through the
    interpreter, so the prologue checks them as it would had ``fn`` been interpreted.
    """
    from thunder.core import interpreter, jit_ext

    wrapped = jit_ext.interpreter_needs_wrap(lookaside)
    interpreted = _interpretable_copy(fn)

    def run(*args: Any, **kwargs: Any) -> Any:
        if applies is not None:
            unwrapped = {k: interpreter.unwrap(v) for k, v in kwargs.items()}
            if not applies(*(interpreter.unwrap(a) for a in args), **unwrapped):
                return interpreter._interpret_call(interpreted, *args, **kwargs)
        if self_attributes:
            attributes = {}
            for name in self_attributes:
                value = _read_through_interpreter(args[0], name)
                if value is interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED:
                    return value
                attributes[name] = interpreter.unwrap(value)
            args = (interpreter.wrap_const(types.SimpleNamespace(**attributes)), *args[1:])
        return wrapped(*args, **kwargs)

    jit_ext._general_jit_lookaside_map[fn] = wrapped if applies is None and not self_attributes else run


def call_partials_outside_the_interpreter() -> None:
    """``functools.partial`` objects are called without interpreting thunder's own helper for them.

    thunder 0.2.6 calls a partial by interpreting ``p.func(*p.args, *args, **(p.keywords | kwargs))``: list
    building, unpacking and a dict merge, each stepped through by the interpreter (hundreds of instructions a
    call). Every hook ``parallelize_module`` installs calls a partial. This reads ``func`` and ``args`` through
    the interpreter (so the prologue checks the bound arguments as before) and makes the call directly; a
    partial with keywords goes the old way.
    """
    if not patch_kind_enabled("speedup"):
        return
    import functools

    from thunder.core import interpreter

    lookasides = interpreter._default_lookaside_map
    thunder_partial_call = lookasides[functools.partial.__call__]
    if getattr(thunder_partial_call, "_thunder_dtensor", False):
        return

    def partial_call(partial: Any, *args: Any, **kwargs: Any) -> Any:
        if type(interpreter.unwrap(partial)) is not functools.partial or interpreter.unwrap(partial).keywords:
            return thunder_partial_call(partial, *args, **kwargs)
        func = _read_through_interpreter(partial, "func")
        bound = _read_through_interpreter(partial, "args")
        if interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED in (func, bound):
            return interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED
        interpreter.populate_item_wrappers(bound)
        return interpreter._interpret_call(func, *bound.item_wrappers, *args, **kwargs)

    partial_call._thunder_dtensor = True  # type: ignore[attr-defined]
    lookasides[functools.partial.__call__] = partial_call


# ---------------------------------------------------------------------------------------------------------
# thunder's interpreted helpers (thunder 0.2.6 interpreter): first-call time
# ---------------------------------------------------------------------------------------------------------
#: the exact container types whose ``[]``, ``in`` and unpacking the interpreter dispatches directly
_SUBSCRIPTED_CONTAINERS = (dict, list, tuple)
_SEARCHED_CONTAINERS = (dict, list, tuple, set, frozenset, str)
_UNPACKED_SEQUENCES = (list, tuple)
#: whether the direct paths are taken (:func:`thunders_own_interpreter_paths` turns them off)
_DIRECT_PATHS = [True]


def _module_computing_once(module: types.ModuleType, name: str, compute: Callable, key_type: type) -> types.ModuleType:
    """``module``'s namespace as one of thunder's modules sees it, with ``name(x)`` computed once per ``x``
    (``compute(x)``, LRU) for a hashable ``x`` of ``key_type`` passed alone; other calls run ``module.name``."""
    original = getattr(module, name)
    cached = functools.lru_cache(maxsize=4096)(compute)

    def once(x: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(x, key_type):
            return original(x, *args, **kwargs)
        try:
            hash(x)
        except TypeError:
            return original(x)
        return cached(x)

    view = types.ModuleType(module.__name__)
    view.__dict__.update(module.__dict__)
    setattr(view, name, once)
    view._thunder_dtensor = True  # type: ignore[attr-defined]
    return view


def _dis_disassembling_once_per_code() -> types.ModuleType:
    """``dis`` as thunder's interpreter module sees it: a code object's instructions are computed once.

    thunder 0.2.6 disassembles a function's code every time it interprets a call of it (``_run_frame``); the
    instructions of a code object never change, and most calls are of a few dozen codes (its own helpers).
    """
    import dis

    return _module_computing_once(
        dis, "get_instructions", lambda code: tuple(dis.get_instructions(code)), types.CodeType
    )


def bind_symbols_with_cached_signatures() -> None:
    """thunder's ``Symbol.bind`` reads its meta's ``inspect.signature`` anew for every bound symbol (about
    10,000 times in a 4-block Llama's first call); a meta's signature does not change, so thunder's symbol
    module sees an ``inspect`` whose ``signature`` is computed once per (hashable) callable."""
    if not patch_kind_enabled("speedup"):
        return
    import inspect

    from thunder.core import symbol

    if not getattr(symbol.inspect, "_thunder_dtensor", False):
        symbol.inspect = _module_computing_once(inspect, "signature", inspect.signature, object)


@contextlib.contextmanager
def thunders_own_interpreter_paths() -> Iterator[None]:
    """Interpret as thunder does, through its helper frames (for comparing the two in tests)."""
    _DIRECT_PATHS[0] = False
    try:
        yield
    finally:
        _DIRECT_PATHS[0] = True


def run_interpreter_helpers_directly() -> None:
    """Under ``thunder.jit``, do directly what thunder's interpreter does by interpreting helpers of its own.

    thunder 0.2.6 runs many instructions by interpreting a small Python helper: ``x[k]`` interprets
    ``getitem_impl`` (``obj.__getitem__(index)``); a global name ``lambda d, k: d[k]`` (two frames, three for a
    builtin); ``k in x`` a helper that looks up ``hasattr`` / ``getattr`` as globals; unpacking ``a, b = t``
    an iterator class of its own, one ``next`` at a time; a call of a bound method ``_impl(fn, *args,
    **kwargs)`` (``fn.__func__(fn.__self__, ...)``, with a list and a dict merge, each a lambda frame). Each
    frame is set up and disassembled anew. These helpers ran about 80,000 of the 86,000 instructions interpreted
    in a 4-block Llama's first call.

    For exact builtin containers, and for bound methods, the helper's work ends in calls this does directly
    through the same dispatch (``_interpret_call``), on the same wrapped values: the container type's own
    ``__getitem__`` / ``__contains__`` / ``update`` / ``extend`` (which the interpreter hands to its
    provenance-tracking lookasides), the method's ``__func__`` with its ``__self__``. So values, provenance
    and prologues are the ones thunder's helpers give. Other types, interpretation without provenance tracking
    and a recorded interpreter history take thunder's path. Each code object is also disassembled once
    (:func:`_dis_disassembling_once_per_code`).
    """
    if not patch_kind_enabled("speedup"):
        return
    import inspect

    from thunder.core import interpreter

    handlers = interpreter._default_opcode_handler_map
    if getattr(handlers["BINARY_SUBSCR"], "_thunder_dtensor", False):
        return
    raised = interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED
    wrap_const, unwrap = interpreter.wrap_const, interpreter.unwrap
    thunder_subscript = handlers["BINARY_SUBSCR"]
    thunder_contains = handlers["CONTAINS_OP"]
    thunder_unpack = handlers["UNPACK_SEQUENCE"]
    thunder_globals_lookup = interpreter.globals_lookup
    thunder_call_dispatch = interpreter._call_dispatch
    thunder_dict_merge = handlers["DICT_MERGE"]
    thunder_list_extend = handlers["LIST_EXTEND"]

    def direct() -> bool:
        runtime = interpreter.get_interpreterruntimectx()
        return (
            _DIRECT_PATHS[0]
            and interpreter.get_interpretercompilectx()._with_provenance_tracking
            and not runtime._record_history
            and runtime.debug_log is None
        )

    def call_method(method: Callable, container: Any, *args: Any) -> Any:
        return interpreter._interpret_call(wrap_const(method), container, *args)

    def getitem(container: Any, key: Any) -> Any:
        """``container[key]`` (``key`` wrapped) as thunder's ``getitem_impl`` ends: the type's own ``__getitem__``."""
        return call_method(type(container.value).__getitem__, container, key)

    def top_is(stack: Any, depth: int, types_: tuple) -> bool:
        return len(stack) >= depth and type(unwrap(stack.getitem_wrapped(-depth))) in types_

    def subscript(inst: Any, /, stack: Any, **kwargs: Any) -> Any:
        if not (top_is(stack, 2, _SUBSCRIPTED_CONTAINERS) and direct()):
            return thunder_subscript(inst, stack=stack, **kwargs)
        key = stack.pop_wrapped()
        container = stack.pop_wrapped()
        value = getitem(container, key)
        if value is raised:
            return value
        return interpreter.check_and_append(stack, value)

    def contains(inst: Any, /, stack: Any, **kwargs: Any) -> Any:
        if not (top_is(stack, 1, _SEARCHED_CONTAINERS) and direct()):
            return thunder_contains(inst, stack=stack, **kwargs)
        container = stack.pop_wrapped()
        candidate = stack.pop_wrapped()
        found = call_method(type(container.value).__contains__, container, candidate)
        if found is not raised and inst.arg == 1:  # ``not in``, negated as thunder's handler does
            found = interpreter._interpret_call(lambda result: not result, found)
        if found is raised:
            return found
        stack.append(found)
        return None

    def unpack(inst: Any, /, stack: Any, **kwargs: Any) -> Any:
        if not (top_is(stack, 1, _UNPACKED_SEQUENCES) and direct()):
            return thunder_unpack(inst, stack=stack, **kwargs)
        sequence = stack.pop_wrapped()
        count, length = inst.arg, len(sequence.value)
        if length < count:
            return interpreter.do_raise(ValueError(f"not enough values to unpack (expected {count}, got {length})"))
        if length > count:
            return interpreter.do_raise(ValueError(f"too many values to unpack (expected {count})"))
        values = [getitem(sequence, wrap_const(i)) for i in range(count)]
        if raised in values:
            return raised
        for value in reversed(values):
            stack.append(value)
        return None

    def dict_merge(inst: Any, /, stack: Any, **kwargs: Any) -> Any:
        """``f(**mapping)``'s merge into the call's keyword dict (``b.update(a)`` in thunder's helper)."""
        if not (top_is(stack, 1, (dict,)) and top_is(stack, 2, (dict,)) and direct()):
            return thunder_dict_merge(inst, stack=stack, **kwargs)
        mapping, target = stack.getitem_wrapped(-1), stack.getitem_wrapped(-2)
        if target.value.keys() & mapping.value.keys():  # thunder's handler raises the duplicate-keyword error
            return thunder_dict_merge(inst, stack=stack, **kwargs)
        stack.pop_wrapped()
        merged = call_method(dict.update, target, mapping)
        return merged if merged is raised else None

    def list_extend(inst: Any, /, stack: Any, **kwargs: Any) -> Any:
        """``[*a]`` / ``f(*a)``'s extension of the list being built (``l1.extend(l2)`` in thunder's helper)."""
        if not (top_is(stack, 1, _UNPACKED_SEQUENCES) and top_is(stack, 1 + inst.arg, (list,)) and direct()):
            return thunder_list_extend(inst, stack=stack, **kwargs)
        extension = stack.pop_wrapped()
        extended = call_method(list.extend, stack.getitem_wrapped(-inst.arg), extension)
        return extended if extended is raised else None

    def globals_lookup(globals_dict: Any, name: Any) -> Any:
        if not (isinstance(globals_dict, interpreter.WrappedValue) and type(globals_dict.value) is dict and direct()):
            return thunder_globals_lookup(globals_dict, name)
        plain_name = unwrap(name)
        if plain_name in globals_dict.value:
            return getitem(globals_dict, name)
        builtins = globals_dict.value.get("__builtins__")
        if not (isinstance(builtins, types.ModuleType) or type(builtins) is dict):
            return thunder_globals_lookup(globals_dict, name)
        builtins = getitem(globals_dict, wrap_const("__builtins__"))
        if isinstance(builtins.value, types.ModuleType):
            value = interpreter._interpret_call(getattr, builtins, name)
        elif plain_name in builtins.value:
            value = getitem(builtins, name)
        else:
            value = raised
        if value is raised:
            return interpreter.do_raise(NameError(f"name '{plain_name}' is not defined"))
        return value

    def call_dispatch(compilectx: Any, runtimectx: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        method = unwrap(fn)
        if not (inspect.ismethod(method) and not hasattr(method, "__thunder_interpreter_orig_fn") and direct()):
            return thunder_call_dispatch(compilectx, runtimectx, fn, *args, **kwargs)
        wrapped = fn if isinstance(fn, interpreter.WrappedValue) else wrap_const(fn)
        func = _read_through_interpreter(wrapped, "__func__")
        if func is raised:
            return func
        receiver = _read_through_interpreter(wrapped, "__self__")
        if receiver is raised:
            return receiver
        return interpreter._interpret_call(func, receiver, *args, **kwargs)

    subscript._thunder_dtensor = True  # type: ignore[attr-defined]
    handlers["BINARY_SUBSCR"] = subscript
    handlers["CONTAINS_OP"] = contains
    handlers["UNPACK_SEQUENCE"] = unpack
    handlers["DICT_MERGE"] = dict_merge
    handlers["LIST_EXTEND"] = list_extend
    interpreter.globals_lookup = globals_lookup
    interpreter._call_dispatch = call_dispatch
    interpreter.dis = _dis_disassembling_once_per_code()
