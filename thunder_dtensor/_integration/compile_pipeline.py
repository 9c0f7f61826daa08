"""The compile pipeline: the lowering's ATen recorder, executors and thunder's transform for execution
(thunder 0.2.6 layout; used by the lowering package)."""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from thunder_dtensor._integration.bootstrap import (
    _RECORDERS,
    BoundSymbol,
    OperatorExecutor,
    Symbol,
    TraceCtx,
    _trace_time_fake_mode,
    thunder,
    tree_flatten,
)
from thunder_dtensor._integration.registry import add_entry, expects_function, installer, patch

import torch

# ---------------------------------------------------------------------------------------------------------
# Lowering (thunder 0.2.6 layout; used by the lowering package)
# ---------------------------------------------------------------------------------------------------------
from thunder.core.compile_data import get_compile_option  # noqa: E402, F401  (re-exported for the lowering package)
from thunder.core.trace import TraceProvenance  # noqa: E402, F401  (re-exported for the lowering package)
from torch._dispatch.python import no_python_dispatcher  # noqa: E402
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


def trace_aten_graph(fn: Callable[..., list], inputs: list[tuple]) -> torch.fx.Graph:
    """The ATen graph of ``fn`` on fake tensors of ``inputs`` ((shape, stride, dtype, device) each), as
    ``make_fx(fn, tracing_mode="fake")`` records it. ``fn`` returns a list of tensors (or None); it may be
    called twice (the second time under ``make_fx``, when the light recorder stops).

    Both record without the Python dispatcher, a caller's too (``make_fx`` enables it for symbolic tracing only):
    eager DTensor runs ATen's own kernels of the CompositeImplicit ops, and torch's Python decompositions decide
    otherwise (matmul's folds a batch into one ``mm`` only when its input is contiguous, ATen's whenever the batch
    dims merge), so DTensor would place the result otherwise than eager does (fuzz seed 19748).
    """
    with no_python_dispatcher():
        return _record_aten_graph(fn, inputs)


def _record_aten_graph(fn: Callable[..., list], inputs: list[tuple]) -> torch.fx.Graph:
    mode = _trace_time_fake_mode()
    recorder = _AtenGraphRecorder()
    with mode:
        fakes = _empty_tensors(inputs)
    for i, fake in enumerate(fakes):
        recorder.record(fake, recorder.graph.placeholder(f"arg{i}_1"))
    _RECORDERS.append(recorder)
    try:
        with mode, recorder:
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


def nodes_traced_so_far() -> frozenset | None:
    """The nodes of the graph :func:`trace_aten_graph` is recording (its own recorder's, or ``make_fx``'s), now."""
    if _RECORDERS and _RECORDERS[-1].stopped is None:
        return frozenset(_RECORDERS[-1].graph.nodes)
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else frozenset(mode.tracer.graph.nodes)


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


def below_autograd(op: Any) -> Callable:
    """``op`` called below the autograd dispatch key. The functional collectives carry a Python autograd
    kernel (``torch.library.register_autograd``, once ``torch.distributed._functional_collectives`` is
    imported) that every call passes through, grad mode off or not; the lowered program's local tensors never
    need autograd's tracking (thunder differentiates the program), so its collectives skip that kernel."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    return call


def group_name(mesh: Any, dim: int) -> str:
    """The process group name of one mesh dim, as functional collectives name it."""
    return mesh.get_group(dim).group_name


def process_group_size(name: str) -> int:
    """The number of ranks in the process group that functional collectives call ``name``."""
    return torch.distributed.distributed_c10d._resolve_process_group(name).size()  # type: ignore[arg-type]


def default_store() -> Any:
    """The default process group's key-value store (torchrun's, over TCP): it outlives the process group."""
    return torch.distributed.distributed_c10d._get_default_store()


def process_group_all_reduce(bsym: Any) -> tuple[Any, str, str] | None:
    """``(tensor, reduce op, group name)`` where ``bsym`` is thunder's prim of ``torch.distributed.all_reduce`` on
    a process group object, waited for (no ``async_op``), with a reduce op functional collectives name; else None."""
    import thunder.distributed.prims as dist_prims

    if bsym.sym.id is not dist_prims.PrimIDs.ALL_REDUCE:
        return None
    tensor, op, group, do_async, *_ = bsym.args
    reduce_op = op.name.lower()
    if do_async or reduce_op not in ("sum", "avg", "product", "min", "max"):
        return None
    return tensor, reduce_op, group.group_name


def mesh_group_names(mesh: Any) -> tuple[str, ...]:
    """The process group name of every dim of a (real) device mesh."""
    return tuple(group_name(mesh, dim) for dim in range(mesh.ndim))


def let_torch_executors_claim(
    symbol: Symbol,
    fn: Callable,
    *,
    owner: str = "compile_pipeline.let_torch_executors_claim",
    reason: str = "a local op of the lowering, claimable by torch's executors",
    kind: str = "dtensor",
) -> None:
    """Make an op (a lowered local op; ``owner``'s own operator) claimable by thunder's torch executor and fusible
    by its torch.compile executor.

    thunder's ``torchcompile`` executor fuses only symbols in its table and compiles each region through the
    torch executor, so the op goes into both. Functional collectives do too (inductor compiles them, as
    torch.compile does a DTensor program); the DTensor boundary (wrap / unwrap) never does.
    """
    from thunder.executors.torch_compile import torch_compile_ex
    from thunder.executors.torchex import ex as pytorch_ex
    from thunder.extend import ImplInfo

    op = pytorch_ex.register_operator(symbol.name, like=symbol, fn=fn)
    pytorch_ex.register_implementation(symbol, op, checker=lambda *args, **kwargs: True)
    # thunder's registration made the torch executor's entries: recorded (so listed and undoable) as ``owner``'s
    entries = (
        (pytorch_ex.opmap, symbol.name, pytorch_ex.opmap.pop(symbol.name), "thunder.executors.torchex.ex.opmap"),
        (pytorch_ex.implmap, symbol.id, pytorch_ex.implmap.pop(symbol.id), "thunder.executors.torchex.ex.implmap"),
        (torch_compile_ex.implmap, symbol.id, ImplInfo(), "thunder.executors.torch_compile.torch_compile_ex.implmap"),
    )
    for table, key, value, table_name in entries:
        add_entry(table, key, value, table_name=table_name, owner=owner, reason=reason, kind=kind)


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
            # (thunder's ImplInfo.checker may be None, "always executable" in its can_execute: that raises here)
            if impl is not None and impl.checker(*bsym.args, **bsym.kwargs):  # type: ignore[misc]
                return impl.symbol if impl.execution_transform is None else None
    return None


@installer("dtensor", "the lowering runs on the joint trace just before executors are assigned")
def install_lowering(
    lower: Callable[[TraceCtx, Sequence[Any]], TraceCtx],
    enabled: Callable[[], bool],
    annotate: Callable[[TraceCtx, TraceCtx], None],
    compact_prologue: Callable[[TraceCtx], TraceCtx],
) -> None:
    """Run ``lower`` on the computation trace (the joint forward + backward one under autograd) just before
    thunder assigns executors to it, and ``compact_prologue`` on a DTensor program's prologue.

    thunder 0.2.6's ``thunder.jit`` calls ``transform_for_execution`` (imported into ``thunder``'s namespace) on
    the prologue, then once on the computation trace, which autodiff has already made the joint trace; the
    forward / backward split comes after, so a transform here sees both halves and the split saves whatever
    the lowered forward computes for the backward. The prologue is the call whose executors are the Python
    executor alone.
    """
    from thunder_dtensor._integration.masks import release_trace_time_masks
    from thunder_dtensor._integration.program_scope import traced_a_dtensor

    original = thunder.transform_for_execution

    @functools.wraps(original)
    def transform_for_execution(trace: TraceCtx, executors_list: Any, *args: Any, **kwargs: Any) -> Any:
        is_prologue = tuple(executors_list) == (thunder.pythonex,)
        if is_prologue:
            prologue = compact_prologue(trace) if traced_a_dtensor() else trace
            return original(prologue, executors_list, *args, **kwargs)
        try:
            if enabled():
                lowered = lower(trace, tuple(executors_list))
                if lowered is not trace:
                    traces = original(lowered, executors_list, *args, **kwargs)
                    annotate(lowered, traces[-1])
                    return [lowered, *traces]
            return original(trace, executors_list, *args, **kwargs)
        finally:
            release_trace_time_masks()  # the compilation's trace-time runs are over

    patch(
        thunder,
        "transform_for_execution",
        transform_for_execution,
        expects=expects_function("thunder.common", "trace", "executors_list"),
    )


@installer("dtensor", "thunder's dataflow fusion keeps a lowered program's collectives in their order")
def keep_collectives_in_order_through_dataflow_fusion(is_collective: Callable[[BoundSymbol], bool]) -> None:
    """Make thunder's ``dataflow`` partition (thunderfx's default ``fusion_type``) keep the order in which a
    program issues its collectives (``is_collective``), or fall back to the ``consecutive`` partition.

    The dataflow partition re-emits a trace's symbols in an order of its own, the same rank by rank only where
    their programs are the same: with uneven shards a rank pads its shard before an all-gather, and that rank's
    all-gather fell behind the next all-reduce while the other rank kept them in order, and both waited for
    the other forever (fuzz seed 5076 under thunderfx; every fusion executor's pass partitions, on CPU
    ``torchcompile_cat`` fuses nothing and reorders all the same; fuzz seed 0 at 4 ranks with writes into views: a
    rank's all-gather moved past an eager DTensor op that redistributes). Collectives must be issued in the same
    order on every rank: where the dataflow order moves one past another, the trace's own order (the consecutive
    partition) is used. Programs without collectives are partitioned as thunder does.
    """
    import thunder.executors.data_dependent_partition as partition

    original = partition.dataflow_fusion

    @functools.wraps(original)
    def dataflow_fusion(trace: TraceCtx, merge_func: Callable) -> Any:
        groups = original(trace, merge_func)
        issued = [id(b) for b in cast(list[BoundSymbol], trace.bound_symbols) if is_collective(b)]
        if issued and [id(b) for group in groups for b in group if is_collective(b)] != issued:
            return partition.consecutive_fusion(trace, merge_func)
        return groups

    patch(
        partition,
        "dataflow_fusion",
        dataflow_fusion,
        expects=expects_function("thunder.executors.data_dependent_partition", "trace", "merge_func"),
    )


# ---------------------------------------------------------------------------------------------------------
# The backward compiled again (thunder 0.2.6 layout; used by guards.py for cotangents placed otherwise)
# ---------------------------------------------------------------------------------------------------------
def current_compile_context() -> tuple[Any, Any]:
    """The compile data and stats of the ``thunder.jit`` compilation in progress ((None, None) outside one)."""
    from thunder.core.compile_data import _compile_data

    return _compile_data.get()


def current_cache_info() -> dict | None:
    """A copy of what ``thunder.jit`` recorded about the call it is compiling (default dtype and device, grad mode,
    autocast: factories read it when traced); None outside a call."""
    try:
        return dict(thunder._get_cache_info())
    except LookupError:
        return None


@contextlib.contextmanager
def _call_recorded_as(cache_info: dict | None) -> Iterator[None]:
    token = thunder._cache_info_ctx.set(dict(cache_info or {}))
    try:
        yield
    finally:
        thunder._cache_info_ctx.reset(token)


@contextlib.contextmanager
def under_compile_data(compile_data: Any, compile_stats: Any) -> Iterator[None]:
    """Run under a jitted function's compile data (its options, ``get_compile_option``) outside its compile: a
    backward traced again when it is first called, for cotangents placed otherwise."""
    from thunder.core.compile_data import compile_data_and_stats

    with compile_data_and_stats(compile_data, compile_stats):
        yield


def compile_joint_trace(
    joint: TraceCtx, compile_data: Any, compile_stats: Any, cache_info: dict | None = None
) -> tuple[TraceCtx, TraceCtx]:
    """The forward and executable backward trace ``thunder.jit`` makes of a joint (forward + backward) trace.

    The steps thunder 0.2.6's ``thunder.jit`` runs after its grad transform, in its order, under the jitted
    function's compile data: executors claimed and waits sorted, ``transform_for_execution`` (the lowering
    included), transformer_engine's checkpointing where it is an executor, the forward / backward split,
    ``del_last_used`` and the function's post-optimization transforms on the backward. ``cache_info``: what
    :func:`current_cache_info` gave when the joint trace was made (a factory, ``torch.arange``, reads it again).
    """
    from thunder.distributed.utils import maybe_sort_waits
    from thunder.executors.passes import _transform_for_operator_executor_execution, del_last_used
    from thunder.transforms.autodiff import split_into_forward_and_backward

    with under_compile_data(compile_data, compile_stats), _call_recorded_as(cache_info):
        executors = compile_data.executors_list
        claimed = _transform_for_operator_executor_execution(joint, executors)
        sorted_waits, claimed = maybe_sort_waits(claimed)
        trace = thunder.transform_for_execution(
            claimed if sorted_waits else joint, executors_list=executors, use_del_last_used=False
        )[-1]
        if "transformer_engine" in {ex.name for ex in executors}:
            from thunder.executors.transformer_engineex import _te_activation_checkpointing_transform

            trace = _te_activation_checkpointing_transform(trace)  # type: ignore[misc]  # (None without TE)
        forward, backward = split_into_forward_and_backward(trace)
        backward = del_last_used(backward, clear_mutable_collections=True)
        for transform in compile_data.transforms or ():
            backward = transform.transform_trace_post_optimization(backward, executors_list=executors)
    return forward, backward


def is_split_forward(trace: TraceCtx) -> bool:
    """Whether ``trace`` is a forward trace made by thunder's forward / backward split (tagged so)."""
    from thunder.core.trace import TraceTag

    return TraceTag.AUGMENTED_FORWARD in trace.tags  # type: ignore[attr-defined]  # (a tag registered at runtime)
