"""Version gates, importing thunder on torch >= 2.13, and the thunder / torch names the package uses."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from looseversion import LooseVersion

TORCH_VERSION = LooseVersion(torch.__version__.split("+")[0])
#: the torch releases this package is tested with (``make compat``; docs/architecture.md, "Versions"), as
#: pyproject.toml declares them
TORCH_TESTED_RANGE = (LooseVersion("2.10"), LooseVersion("2.15"))
#: set to "1" to import with a torch outside that range (``make compat`` checks a candidate release this way)
UNTESTED_TORCH_VARIABLE = "THUNDER_DTENSOR_UNTESTED_TORCH"
if (
    not (TORCH_TESTED_RANGE[0] <= TORCH_VERSION < TORCH_TESTED_RANGE[1])
    and os.environ.get(UNTESTED_TORCH_VARIABLE) != "1"
):
    raise ImportError(
        f"thunder_dtensor supports torch {TORCH_TESTED_RANGE[0]} to {TORCH_TESTED_RANGE[1]} (excluded), found "
        f"{torch.__version__}: the private torch names it uses (thunder_dtensor/_integration/) are checked for "
        "those releases only; check this one with `make compat TORCH=<version>` and update that package"
    )


#: Whether torch was built with ``torch.distributed``; the package imports without it.
DISTRIBUTED_AVAILABLE: bool = torch.distributed.is_available()

from thunder_dtensor._integration.registry import IntegrationError  # noqa: E402

#: the named-tensor methods lightning-thunder 0.2.x reads when it is imported (torch >= 2.13 has none of them)
REMOVED_NAMED_TENSOR_METHODS = ("align_as", "align_to", "has_names", "refine_names", "rename")

#: the one-line fix every import-order error names
IMPORT_ORDER_FIX = "import thunder_dtensor before thunder (`import thunder_dtensor` as the first import of the program)"


def named_tensor_placeholder(name: str, torch_version: str) -> Callable:
    """What thunder finds for a removed named-tensor method while it imports: a function that raises if called."""

    def removed(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError(f"torch.Tensor.{name} does not exist in torch {torch_version}")

    removed.__name__ = name
    removed.__qualname__ = f"Tensor.{name}"
    return removed


def python_function_apply(builtin: Any) -> Callable:
    """A Python function for ``classmethod(...)`` that calls torch's C ``Function.apply`` (thunder keys by it)."""

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return builtin.__get__(None, cls)(*args, **kwargs)

    return apply


@contextlib.contextmanager
def _named_tensor_shims() -> Iterator[dict[str, Callable]]:
    """Temporarily provide the named-tensor methods thunder 0.2.x references at import time."""
    missing = {
        name: named_tensor_placeholder(name, torch.__version__)
        for name in REMOVED_NAMED_TENSOR_METHODS
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


#: torch >= 2.14 implements ``autograd.Function.apply`` in C (a classmethod descriptor without ``__func__``);
#: thunder 0.2.6 reads ``Function.apply.__func__`` when it is imported, to key its custom-Function lookaside
FUNCTION_APPLY_IS_BUILTIN = not hasattr(torch.autograd.function.Function.apply, "__func__")
#: thunder's lookaside for ``MyFunction.apply(...)``, set aside at import where ``apply`` is builtin (see
#: ``thunder_fixes.call_custom_autograd_functions_with_builtin_apply``)
custom_function_apply_lookaside: list[Callable] = []


@contextlib.contextmanager
def _function_apply_shim() -> Iterator[None]:
    """While thunder imports on torch >= 2.14: ``Function.apply`` as a Python classmethod, which thunder keys its
    lookaside by; afterwards torch's own is back and thunder's lookaside is set aside under no key."""
    function = torch.autograd.function.Function
    if not FUNCTION_APPLY_IS_BUILTIN:
        yield
        return
    builtin = vars(function)["apply"]
    apply = python_function_apply(builtin)
    function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]  # (patching torch)
    try:
        yield
    finally:
        _restore_function_apply(builtin, apply)


def _restore_function_apply(builtin: Any, apply: Callable) -> None:
    """torch's ``Function.apply`` back in place; thunder's lookaside keyed by the stand-in set aside."""
    torch.autograd.function.Function.apply = builtin  # type: ignore[method-assign]  # (patching torch)
    from thunder.core import jit_ext

    lookaside = jit_ext._general_jit_lookaside_map.pop(apply, None)
    if lookaside is not None:
        custom_function_apply_lookaside.append(lookaside)


def _import_thunder() -> types.ModuleType:
    """thunder, imported with the named-tensor placeholders it needs on torch >= 2.13, then cleaned up.

    A thunder imported before this package (where this torch lets it) is used as it is; one whose import failed
    before (torch >= 2.13 without this package) leaves half its modules behind and cannot be imported again in
    this process: that raises an ``ImportError`` naming the fix.
    """
    if "thunder" in sys.modules and hasattr(sys.modules["thunder"], "jit"):
        return sys.modules["thunder"]
    leftovers = [name for name in sys.modules if name.startswith("thunder.")]
    if leftovers:
        raise ImportError(
            f"lightning-thunder failed to import earlier in this process ({len(leftovers)} of its modules are left "
            f"half-initialised), as it does by itself on torch {torch.__version__}, which removed the named-tensor "
            f"methods thunder 0.2.x reads when it is imported: in a new process, {IMPORT_ORDER_FIX}"
        )
    with _named_tensor_shims() as shims, _function_apply_shim():
        import thunder

        _drop_named_tensor_placeholders(shims)
    return thunder


thunder = _import_thunder()
THUNDER_VERSION = LooseVersion(thunder.__version__)
#: the lightning-thunder releases this package is tested with (pyproject.toml declares them, docs/architecture.md
#: "Versions" gives the table): 0.2.6 and its patch releases, and the one 0.2.7 nightly measured
THUNDER_TESTED_RANGE = (LooseVersion("0.2.6"), LooseVersion("0.2.7"))
THUNDER_TESTED_NIGHTLY = LooseVersion("0.2.7.dev20260201")
#: set to "1" to import with a thunder outside those (``make compat THUNDER=...`` checks a candidate so)
UNTESTED_THUNDER_VARIABLE = "THUNDER_DTENSOR_UNTESTED_THUNDER"


def thunder_is_tested(version: LooseVersion) -> bool:
    """Whether ``version`` of lightning-thunder is one the package passes on (another nightly of 0.2.7 may change
    any slot it patches, so only the measured one counts)."""
    return THUNDER_TESTED_RANGE[0] <= version < THUNDER_TESTED_RANGE[1] or version == THUNDER_TESTED_NIGHTLY


if not thunder_is_tested(THUNDER_VERSION) and os.environ.get(UNTESTED_THUNDER_VARIABLE) != "1":
    raise ImportError(
        f"thunder_dtensor supports lightning-thunder {THUNDER_TESTED_RANGE[0]} (below {THUNDER_TESTED_RANGE[1]}) and "
        f"the nightly {THUNDER_TESTED_NIGHTLY}, found {thunder.__version__}: install one of them (pip install "
        f'"lightning-thunder=={THUNDER_TESTED_RANGE[0]}"), or check this release with `make compat THUNDER=<version>` '
        "and update thunder_dtensor/_integration/"
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


def thunder_symbol_of(entry: Any) -> Any:
    """thunder's single-device symbol for an entry of its torch-to-thunder map or Tensor-method table: the entry
    itself, or the symbol inside one of thunder 0.2.6's experimental DTensor wrappers (which it registers for
    about ten functions at import, and which this package leaves in place); None for an entry of that
    experimental path that exists for DTensors only (``DTensor.from_local`` & co., routed by this package)."""
    single = _experimental_single_device_symbol(entry)
    if single is not None:
        return single
    return None if _is_experimental_dtensor_symbol(entry) else entry


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
from thunder.core.pytree import tree_flatten, tree_unflatten  # noqa: E402
from thunder.core.pytree import tree_map as _tree_map  # noqa: E402
from thunder.core.symbol import BoundSymbol, BoundSymbolTag, Symbol  # noqa: E402
from thunder.core.trace import TraceCtx, from_trace, get_tracectx, tracectx  # noqa: E402
from thunder.core.transforms import get_grad, put_grad, put_grads, register_grad  # noqa: E402
from thunder.extend import OperatorExecutor, add_always_executor, register_executor  # noqa: E402

#: thunder's ``tree_map``: a ``functools.partial`` of optree's, whose generic signature mypy cannot solve through it
tree_map: Callable[..., Any] = _tree_map

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
    "thunder_symbol_of",
    "check",
    "devices",
    "dtypes",
    "from_trace",
    "get_compile_data",
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
    # (the names exist, as None, where torch.distributed does not: mypy sees the branch above's classes)
    FakeTensorMode = DeviceMesh = DTensor = DTensorSpec = TensorMeta = None  # type: ignore[misc, assignment]
    Partial = Placement = Replicate = Shard = _StridedShard = None  # type: ignore[misc, assignment]


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
    # (tuples of ints where torch annotates a torch.Size: they compare and hash alike)
    meta = TensorMeta(
        tuple(size_hint(s) for s in shape),  # type: ignore[arg-type]
        tuple(size_hint(s) for s in stride),
        spec.tensor_meta.dtype,
    )
    return respec(spec, tensor_meta=meta)


def respec(spec: Any, **changes: Any) -> Any:
    """``spec`` with the given fields (``mesh``, ``placements``, ``tensor_meta``) replaced and the rest kept: its
    shard order and how it reads a ``_StridedShard`` (as a shard order or as a plain strided shard, which
    DTensor's view rules choose). A spec built anew from mesh, placements and meta (:func:`make_spec`) takes the
    default of both, another layout where a tensor dim is sharded over several mesh dims in another order."""
    return dataclasses.replace(spec, **changes)


def spec_without_partials(spec: Any) -> Any:
    """``spec`` with each ``Partial`` mesh dim replicated, all else kept: a Partial value's cotangent, and the
    spec a trace-time replay reassembles held elements with (:func:`thunder_dtensor.primitive._reshape_misplaced`
    must not sum the ranks' copies)."""
    if not any(p.is_partial() for p in spec.placements):
        return spec
    return respec(spec, placements=tuple(Replicate() if p.is_partial() else p for p in spec.placements))


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
    return local_shape_and_offset(dtensor)[1]


def local_shape_and_offset(dtensor: Any, placements: Any = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard of ``dtensor`` placed ``placements`` (default: its own): its shape and where it starts."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    spec = dtensor_spec(dtensor)
    placements = spec.placements if placements is None else tuple(placements)
    # numbers known from the spec, not traced values (the lowering's tracing runs this under fake tensors)
    with outside_tracing_modes():
        shape, offset = compute_local_shape_and_global_offset(spec.tensor_meta.shape, spec.mesh, placements)
    return tuple(int(n) for n in shape), tuple(int(o) for o in offset)


@functools.lru_cache(maxsize=4096)
def sharded_unevenly(spec: Any) -> bool:
    """Whether a DTensor of ``spec`` has local shapes that differ from rank to rank (every rank computes every
    rank's, so all answer alike); False where this torch lacks the helper. Cached: asked for every traced op."""
    import itertools

    from torch.distributed.tensor import _utils

    compute = getattr(_utils, "_compute_local_shape_and_global_offset", None)
    if compute is None:
        return False
    mesh_shape = tuple(spec.mesh.shape)
    shapes = {
        tuple(compute(spec.tensor_meta.shape, mesh_shape, list(coordinate), spec.placements, skip_offset=True)[0])
        for coordinate in itertools.product(*(range(n) for n in mesh_shape))
    }
    return len(shapes) > 1


def any_rank_of_mesh(flag: bool, mesh: Any) -> bool:
    """Whether ``flag`` holds on any rank of ``mesh`` (a trace-time agreement: every rank of the mesh must call it
    at the same point of its trace). A mesh that is not the whole world is not asked (``flag`` itself)."""
    import torch.distributed as dist

    if not dist.is_initialized() or mesh.size() != dist.get_world_size():
        return flag
    with outside_tracing_modes():
        device = "cpu" if dist.get_backend() == "gloo" else mesh.device_type
        votes = torch.tensor([int(flag)], device=device)
        dist.all_reduce(votes)
    return bool(votes.item())


@contextlib.contextmanager
def outside_tracing_modes() -> Iterator[None]:
    """Leave any active fake tensor mode and make_fx (or recorder) tracing: for trace-time work on its own tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), unset_fake_temporarily(), _recording_suspended():
        yield


#: the lowering's ATen recorders in use, innermost last (compile_pipeline.trace_aten_graph)
_RECORDERS: list = []


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
        for table in ("op_strategy_funcs", "op_to_rules"):  # (a renamed table: decompositions of ops with rules)
            if not hasattr(propagator, table):
                raise IntegrationError(
                    f"DTensor's sharding propagator has no {table}: update thunder_dtensor/_integration"
                )
            handled |= set(getattr(propagator, table))
        handled |= set(getattr(propagator, "op_single_dim_strategy_funcs", {}))  # (torch >= 2.12 has it)
        # the core-ATen table: its decompositions produce aten ops (the full table's refs produce prims.*,
        # which DTensor has no strategies for)
        decompositions = core_aten_decompositions()
        _DECOMPOSITIONS_WITHOUT_STRATEGY = {op: fn for op, fn in decompositions.items() if op not in handled}
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
    buffer, which a lookup whose output is never reduced leaves filled (with a real tensor, or a fake one of a
    dynamo run), and the next fake run of the same lookup then fails comparing its mask with it. torch >= 2.13
    also keeps a C++ cache of the same decisions.
    """
    from torch.distributed.tensor import _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    clear_native_cache = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native_cache is not None:
        clear_native_cache()


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
    the failing meta kernel is muted meanwhile. Dynamo's tracing context (thunderfx's splitter checks nodes
    while dynamo compiles) is set aside: its fake mode is dynamo's, and torch 2.10 refuses a second one.
    """
    outside_dynamo = torch._guards.tracing(None) if torch._guards.TracingContext.try_get() else contextlib.nullcontext()
    with outside_dynamo, fake_tensor_logging_muted(), _trace_time_fake_mode() as mode:
        yield mode
