"""thunderfx (thunder.dynamo, thunder 0.2.6 layout): its splitter, example inputs and DTensor sharding rules."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from thunder_dtensor._integration.bootstrap import (
    DISTRIBUTED_AVAILABLE,
    DeviceMesh,
    DTensor,
    TraceCtx,
    clear_sharding_propagation_cache,
    thunder,
    tracectx,
)
from thunder_dtensor._integration.fixes.switches import EVERYWHERE, declare_fix, mode
from thunder_dtensor._integration.program_scope import IN_THUNDERFX_DTENSOR_CALL as _IN_DTENSOR_CALL
from thunder_dtensor._integration.program_scope import has_dtensor_inputs
from thunder_dtensor._integration.registry import expects_function, installer, patch, scoped_entries

import torch


# ---------------------------------------------------------------------------------------------------------
# thunderfx (thunder.dynamo, thunder 0.2.6 layout)
# ---------------------------------------------------------------------------------------------------------
def is_opaque_script_object(x: Any) -> bool:
    """Whether ``x`` is what dynamo graphs hold for a device mesh or process group."""
    from torch._library.fake_class_registry import FakeScriptObject

    return isinstance(x, (FakeScriptObject, torch.ScriptObject))


#: what torch 2.10's dynamo records for ``x.redistribute(...)``, ``x.to_local(...)`` and ``DTensor.from_local(...)``:
#: a function made on the fly that makes the call with its non-tensor arguments baked in, by name and module
_DYNAMO_DTENSOR_CALL_CLOSURES = {
    "prim_redistribute": "torch._dynamo.variables.tensor",
    "prim_to_local": "torch._dynamo.variables.tensor",
    "prim from_local": "torch._dynamo.variables.torch",
}


def is_dynamo_dtensor_method_closure(target: Any) -> bool:
    """Whether an fx node's target is such a function (thunder interprets it: its body is the DTensor call)."""
    module = _DYNAMO_DTENSOR_CALL_CLOSURES.get(getattr(target, "__name__", None))  # type: ignore[arg-type]  # (None: no entry)
    return module is not None and getattr(target, "__module__", None) == module


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


def trace_on_proxies(fn: Callable, make_inputs: Callable[[], tuple[tuple, dict]]) -> Any:
    """Run ``fn`` once on proxies in a throwaway trace, as thunderfx's splitter tests an op; its output.

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
            return fn(*args, **kwargs)

    return run()


SCOPED_THUNDERFX_REASON = (
    "thunderfx's splitter and compiler as this package runs them (each graph compiled to Python before thunder.jit "
    "sees it, node decisions cached by call signature, complex views and sdpa_kernel kept in thunder's graph)"
)


def _differentiable_outputs(graph_module: torch.fx.GraphModule, given: list[bool]) -> list[bool]:
    """Which outputs of a split graph are differentiable: thunder's splitter counts those whose example value has
    a ``grad_fn``, so an input returned as it is (``x.contiguous()`` of a contiguous leaf before a graph break)
    was marked non-differentiable and the program's output lost its gradient (fuzz seed 6125 under thunderfx).
    An output whose example value requires grad is differentiable too."""
    outputs = [n for node in graph_module.graph.nodes if node.op == "output" for n in node.all_input_nodes]
    if len(outputs) != len(given):
        return given
    return [
        bool(g) or bool(getattr(n.meta.get("example_value"), "requires_grad", False)) for g, n in zip(given, outputs)
    ]


def _compiled_for_this_rank(torch_inductor: Callable) -> Callable:
    """``torch_inductor`` (``torch._inductor.compile``) with torch's AOTAutograd cache off while it compiles.

    A region of a DTensor graph is desugared by AOTAutograd into local ops that bake in this rank's place on the
    mesh (the offset of a replicated operand's slice), but that cache keys a DTensor input by its spec alone, the
    same on every rank (torch 2.13, pytorch#188390; its fix adds the device, which is ``cpu`` on every rank of a
    CPU mesh). With caches on disk, a rank loaded the graph another rank had compiled and computed that rank's
    shard, silently (fuzz seed 7038). Inductor's own graph cache still serves: its key is the desugared graph,
    offsets included.
    """
    from torch._functorch import config as functorch_config

    def compile_region(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # an unknown name raises here: a torch that renamed these options fails loudly, not silently
        with functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
            return torch_inductor(graph_module, example_inputs)

    return compile_region


@installer("dtensor", "thunderfx's splitter hands graphs with DTensors to thunder.jit whole")
def install_thunderfx_support(
    dtensor_node_support: Callable,
    plain_node_support: Callable,
    is_dtensor_graph: Callable[[Any], bool],
) -> None:
    """Make thunderfx's splitter hand graphs with DTensors to thunder.jit whole. Only graphs of a DTensor
    program are touched: a graph with a DTensor or a mesh in it (``is_dtensor_graph(graph)``), or any graph
    dynamo makes during a call of a thunderfx-compiled function for which ``has_dtensor_inputs(fn, args, kwargs)``
    (DTensor arguments, or a module with DTensor parameters: FSDP2's graphs hold its gathered plain
    parameters). Every other graph is split and compiled exactly as thunder does it.

    * ``dtensor_node_support(node)`` decides for every node that touches a DTensor or a device mesh
      (``None`` leaves the node to thunder): thunder's own check crashes on the mesh's ``FakeScriptObject``
      and looks methods like ``redistribute`` up on ``torch.Tensor`` only.
    * ``plain_node_support(node, thunder_options, thunder_check)`` answers for every other node of a DTensor
      graph, by asking
      ``thunder_check`` (thunder's own check, which traces the node's symbol and its gradient: ~0.1 s a node)
      or a cached answer for the same call signature.
    * ``translate_dtensor_ops`` is turned off: it rewrites older dynamo graphs to thunder's experimental
      DTensor prims, which this package removes. torch >= 2.13 graphs call ``DTensor.from_local``,
      ``.redistribute`` and ``.to_local`` directly, and the dispatch table covers those.
    * Example-input metadata (kept for thunderfx's reports) passes the device mesh through as it is.
    * Each graph module (and each graph submodule of it) is compiled to Python before ``thunder.jit`` sees it:
      fx's lazy code generation, run inside thunder's interpreter, fails on a mesh argument and on its own
      ``dict.keys()`` (``object of type 'MappingKeysView' has no len()``).
    * DTensor's sharding-propagation cache is cleared once a graph is split: see ``splitter``.
    * The regions it hands to inductor are compiled without torch's AOTAutograd cache: see
      ``_compiled_for_this_rank``.
    """
    import thunder.dynamo.compiler as fx_compiler
    import thunder.dynamo.splitter as fx_splitter
    import thunder.dynamo.utils as fx_utils

    thunder_node_support = fx_utils.is_node_supported_by_thunder
    declare_fix("thunderfx_graphs", "dtensor", SCOPED_THUNDERFX_REASON)

    def of_dtensor_program(graph: torch.fx.Graph) -> bool:
        in_dtensor_call = _IN_DTENSOR_CALL.get()
        return (
            mode("thunderfx_graphs") == EVERYWHERE
            or is_dtensor_graph(graph)
            or (in_dtensor_call is not None and in_dtensor_call())
        )

    def is_node_supported_by_thunder(node: torch.fx.Node, thunder_options: dict) -> tuple[bool, Any]:
        if not of_dtensor_program(node.graph):
            return thunder_node_support(node, thunder_options)
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
            for module in graph_module.modules():  # its own code and its graph submodules' (a checkpoint's body)
                if isinstance(module, torch.fx.GraphModule):
                    fx_utils.recompile_graph(module)
            if options.get("is_differentiable_outputs") is not None:
                options["is_differentiable_outputs"] = _differentiable_outputs(
                    graph_module, options["is_differentiable_outputs"]
                )
            return thunder_jit(graph_module, **options)

        if not of_dtensor_program(gm.graph):
            return thunder_splitter(gm, thunder_jit, *args, **kwargs)
        torch_inductor, *rest = args
        try:
            return thunder_splitter(gm, jit_compiled_graph, _compiled_for_this_rank(torch_inductor), *rest, **kwargs)
        finally:
            # dynamo's fake run of the graph cached sharding decisions whose placements hold fake tensors of its
            # fake mode (the vocab-parallel embedding's mask): a later compile or eager call would reuse them
            clear_sharding_propagation_cache()

    dynamo = "thunder.dynamo"
    node_check = expects_function(dynamo, "node")
    patch(fx_utils, "is_node_supported_by_thunder", is_node_supported_by_thunder, expects=node_check)
    patch(fx_splitter, "is_node_supported_by_thunder", is_node_supported_by_thunder, expects=node_check)
    example_meta = expects_function(dynamo, "input")
    patch(fx_utils, "input_to_example_input_meta", input_to_example_input_meta, expects=example_meta)
    patch(
        fx_splitter,
        "translate_dtensor_ops",
        lambda gm: None,
        expects=expects_function(dynamo, "gm"),
        reason="dynamo graphs are not rewritten to thunder's experimental DTensor prims (this package removes them)",
    )
    patch(fx_compiler, "_splitter", splitter, expects=expects_function(dynamo, "gm", "thunder_jit"))

    compiled_call = fx_compiler.ThunderFXCompiledObject.__call__

    def call_noting_dtensors(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = _IN_DTENSOR_CALL.get()
        answer: list[bool] = []

        def in_dtensor_call() -> bool:  # asked only when dynamo compiles a graph during the call: once, then kept
            if not answer:
                answer.append((outer is not None and outer()) or has_dtensor_inputs(self._func, args, kwargs))
            return answer[0]

        token = _IN_DTENSOR_CALL.set(in_dtensor_call)
        try:
            return compiled_call(self, *args, **kwargs)
        finally:
            _IN_DTENSOR_CALL.reset(token)

    wrapped_call = expects_function((dynamo, "thunder_dtensor"), "self")  # thunder's, or our wrapper of it
    patch(fx_compiler.ThunderFXCompiledObject, "__call__", call_noting_dtensors, expects=wrapped_call)


@installer("dtensor", "DTensor's rule tables take our entries only while a thunderfx program is called")
def scope_dtensor_entries_to_thunderfx_calls(rules: dict[Any, Callable], item_handler: Callable[..., Any]) -> None:
    """Give DTensor entries of its rule tables only while a thunderfx-compiled object is called (one wrapper of the
    call, both scoped entries in it), so eager DTensor, ``thunder.jit`` and processes that never call thunderfx
    keep DTensor's own behaviour:

    * ``rules``: sharding rules for ops DTensor has none for. Dynamo traces a thunderfx program by running it on
      fake DTensors, so each DTensor op needs DTensor's own sharding rule even where thunder's dtensor symbol has
      one (CPU's fused attention). Each rule is in torch's public ``register_sharding`` form (acceptable (output
      placements, input placements) per mesh dim); an op torch already has a rule for keeps torch's.
    * ``item_handler``: DTensor's handler of ``aten._local_scalar_dense`` (``x.item()``). ``.item()`` ends
      dynamo's graph, so it runs as eager DTensor's on the graph's output, and eager DTensor reads the local tensor
      whatever its placements: a Partial value's unreduced part on each rank (torch's strategy for the op is
      Replicate only, but its propagator skips the op). ``thunder.jit`` reads the global value; so does thunderfx
      with the handler.
    """
    if not DISTRIBUTED_AVAILABLE:
        return
    from thunder.dynamo.compiler import ThunderFXCompiledObject
    from torch.distributed.tensor.experimental import register_sharding

    propagator = DTensor._op_dispatcher.sharding_propagator
    missing = {op: rule for op, rule in rules.items() if op not in propagator.op_strategy_funcs}
    consulted = [False]  # a rule was asked during the current call: its decisions are in DTensor's cache

    def noting_use(strategy: Callable) -> Callable:
        def strategy_noting_use(*args: Any, **kwargs: Any) -> Any:
            consulted[0] = True
            return strategy(*args, **kwargs)

        return strategy_noting_use

    strategies, schema_infos = {}, {}
    for op, rule in missing.items():  # torch's registration makes the entries; they are put in per call
        register_sharding(op)(rule)
        strategies[op] = noting_use(propagator.op_strategy_funcs.pop(op))
        schema_info = propagator.op_to_schema_info.pop(op, None)
        if schema_info is not None:
            schema_infos[op] = schema_info
    during = "a call of a thunderfx-compiled object"
    entries = [
        scoped_entries(
            getattr(propagator, table),
            table_entries,
            table_name=f"torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.{table}",
            during=during,
        )
        for table, table_entries in (("op_strategy_funcs", strategies), ("op_to_schema_info", schema_infos))
        if table_entries
    ]
    entries.append(
        scoped_entries(
            DTensor._op_dispatcher._custom_op_handlers,
            {torch.ops.aten._local_scalar_dense.default: item_handler},
            table_name="torch.distributed.tensor.DTensor._op_dispatcher._custom_op_handlers",
            during=during,
        )
    )
    thunderfx_call = ThunderFXCompiledObject.__call__

    def call_with_dtensor_entries(self: Any, *args: Any, **kwargs: Any) -> Any:
        consulted[0] = False
        try:
            with contextlib.ExitStack() as stack:
                for scoped in entries:
                    stack.enter_context(scoped)
                return thunderfx_call(self, *args, **kwargs)
        finally:
            if consulted[0]:  # (dynamo traced the attention) no decision made with a rule outlives the call
                clear_sharding_propagation_cache()

    call = expects_function("thunder.dynamo", "self")
    patch(ThunderFXCompiledObject, "__call__", call_with_dtensor_entries, expects=call)
