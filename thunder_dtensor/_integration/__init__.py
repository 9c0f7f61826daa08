"""Every touch of thunder's and torch's private APIs lives here, version-gated.

A new thunder or torch release should mean editing this package only. The rest of the package imports
``thunder`` and ``torch`` public names, or the names re-exported below, in three groups (``__all__``): thunder's
and torch's own names, adapters over their private layouts, and the installers the package's root calls. The
registry's own API (``patch``, ``expects_*``, ``undo``) is for this package's modules only.

What is patched, and why:

* torch >= 2.13 removed five named-tensor methods that thunder <= 0.2.6 lists for auto-registration, so
  ``import thunder`` fails. We add placeholders for the duration of the import only, then remove them
  from ``torch.Tensor`` and from thunder's tables again. Nothing of the package runs in a process that does
  not import it (there is no import hook): ``import thunder`` first fails there as it does without the package,
  and a later ``import thunder_dtensor`` raises an ``ImportError`` naming the fix.
* thunder 0.2.6 registers its own experimental DTensor dispatch wrappers when imported; we leave them (and
  every other entry of thunder's tables) as they are: DTensor calls are routed before thunder's tables are
  read (``route_dtensor_calls``), and ``thunder_symbol_of`` reads the single-device symbol inside a wrapper.
* thunder's core calls hooks of its own experimental DTensor path (proxy creation, prologue checks,
  backward cotangent checks). We point those hooks at this package instead (``install_thunder_hooks``),
  and give thunder's autodiff DTensor-aware ``add`` / ``zeros`` for cotangent sums and zero cotangents.
* ``prims.get_grad``'s meta builds DTensor cotangents with our spec rule (``set_cotangent_proxy_factory``).
* The interpreter's ``isinstance`` lookaside answers True for a DTensor's proxy against ``DTensor``
  (``make_isinstance_see_dtensor_proxies``), so tensor-parallel hooks take their DTensor branches.
* A torch call or Tensor method with a DTensorProxy argument is routed to this package's dispatch table by one
  interpreter lookaside and one method lookup (``route_dtensor_calls``); thunder's tables are not changed. The
  dtensor executors join a program's executors only when it traces a DTensor (``use_dtensor_executors``).
* Placement constructors and device mesh queries are called whole by the interpreter (``make_placements_opaque``).
* DTensor decides alike on every rank: ``Partial`` placements hash by value, not by a per-process string hash
  or an object's address, and the redistribution planner iterates its reduce ops sorted, so strategies and
  plans chosen among equal costs do not depend on set order (``make_dtensor_choices_alike_on_every_rank``).
* The prologue reads the hook dicts (``_forward_hooks`` & co.) of the module passed to ``thunder.jit`` from
  that module, not from its ``ThunderModule`` wrapper, whose own are empty: tensor-parallel styles on the
  root module otherwise fail with ``KeyError`` (``read_root_module_state_from_user_module``).
* In-place DTensor ops keep their DTensor proxies through thunder's alias updates, which run on the dtensor
  executor (``keep_dtensors_in_alias_updates``); their symbols are tagged as thunder's own in-place ones
  (``inplace_torchsymbol``).
* ``thunder.CacheEntry`` is built through a subclass that first shows each compiled program to a hook
  (``install_compiled_program_hook``: the opt-in rank-consistency check).
* A second subclass of ``thunder.CacheEntry`` hands each compiled program's ``backward_fn`` to the package, which
  calls it, or a backward compiled again from the joint trace for cotangents placed otherwise than traced
  (``wrap_compiled_backwards``, ``compile_joint_trace``: thunder.jit's steps after its grad transform).
* thunderfx's splitter asks this package about nodes with DTensors or a device mesh, skips thunder's
  translation to its experimental prims, passes the mesh through its example-input metadata, and gives
  thunder.jit graph modules already compiled to Python (``install_thunderfx_support``).
* thunder's autocast hook (``maybe_apply_autocast``, asked by every symbol call) first asks this package,
  so DTensor ops get autocast's casts as dtensor prims in the trace (``install_autocast_hook``); the autocast
  a jitted function is called under applies to that call only (``scope_ambient_autocast_to_each_call``).
* thunder 0.2.6's grad rules forget the conjugate for complex tensors; they are re-registered with it
  (``fix_complex_gradients``); thunder's torch.compile executors take complex ops into their regions, handing
  dynamo a copy of a complex view of a real tensor, which it cannot take as an input
  (``give_torch_compile_regions_whole_complex_tensors``); its
  autograd bridge gives no gradient where none came in (``no_gradient_in_no_gradient_out``).
* ``torch.nn.attention.sdpa_kernel`` runs as a trace-time no-op with a feasibility check
  (``install_sdpa_kernel_support``).
* What model libraries do inside a forward, which thunder 0.2.6 gets wrong for plain tensors too
  (``thunder_fixes``: gradient hooks on parameters, meta strides, torch custom ops, ``requires_grad`` of
  computed values, tensors saved for the backward then written in place, ...).
* FSDP2's forward hooks become lookasides that put its all-gathers and casts into the program, and reads of
  its parameters inside a module's forward give the unsharded values (``install_fsdp_support``).
* On CPU, ``gelu``, ``silu`` and ``layer_norm`` of plain tensors run and train with torch's kernels,
  ``view_as_complex`` / ``view_as_real`` are differentiated by each other, and causal attention trains with
  torch's CPU flash kernel: an executor first among thunder's default ones (``run_cpu_ops_with_torch_kernels``).
* thunder's interpreter runs ``x[k]``, ``k in x``, unpacking, global name lookups, bound-method calls and the
  merges of ``*args`` / ``**kwargs`` calls on exact builtin containers without interpreting its own helper
  functions, and disassembles each code object once (``run_interpreter_helpers_directly``: first-call time); an
  exception leaving an interpreted frame gets its traceback's frame without a busy wait
  (``make_exception_frames_without_a_busy_wait``);
  ``Symbol.bind`` reads each meta's signature once (``bind_symbols_with_cached_signatures``); thunder's
  autograd bridge makes its meta dummy tensors with ``empty`` (``make_autograd_dummies_without_random_numbers``);
  thunder's torch.compile executor compiles its regions with inductor, without dynamo
  (``compile_fused_regions_without_dynamo``); a fusion region that rematerialization rebuilds keeps the program's
  order (``keep_fused_regions_in_program_order``: memory and overlap), and the cut between a forward and a
  backward region keeps what torch's partitioner would not recompute (``keep_what_backward_regions_materialize``).
* DTensor computes a ``_StridedShard``'s local size and offsets on real tensors while the lowering traces on fake
  ones (``size_strided_shards_outside_tracing``: first-call time of 2-D meshes and flattened shards).

Private torch names used (checked on torch 2.13, the range ``TORCH_TESTED_RANGE`` gates):
``DTensor._spec`` / ``_local_tensor`` / ``_op_dispatcher`` (its sharding propagator's cache),
``torch.distributed.tensor._redistribute._gen_transform_infos`` (its cache),
``torch.distributed.tensor._dtensor_spec.DTensorSpec`` / ``TensorMeta`` (and ``DTensorSpec.shard_order``),
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, ``torch._subclasses.fake_tensor``
(``FakeTensorMode``, its exceptions and logger), ``torch._library.fake_class_registry.FakeScriptObject``,
``torch.utils._pytree``, ``torch._C._is_alias_of``, ``torch.utils._python_dispatch.TorchDispatchMode`` (autocast, the
lowering's ATen recorder) and ``autograd_would_have_decomposed``, ``torch._dispatch.python.no_python_dispatcher``,
``torch.fx.experimental.proxy_tensor`` (``make_fx``, ``disable_proxy_modes_tracing``),
``torch.distributed.distributed_c10d._resolve_process_group`` (a group's size by its name).
"""

from __future__ import annotations

from thunder_dtensor._integration.attribute_reads import read_attributes_through_handlers
from thunder_dtensor._integration.autocast import (
    install_autocast_hook,
    interpreting_user_program,
    recording_aten_calls,
    thunder_autocast_disabled,
    thunder_autocast_dtype,
)
from thunder_dtensor._integration.bootstrap import (
    DISTRIBUTED_AVAILABLE,
    FUNCTION_APPLY_IS_BUILTIN,
    IMPORT_ORDER_FIX,
    THUNDER_TESTED_NIGHTLY,
    THUNDER_TESTED_RANGE,
    THUNDER_VERSION,
    TORCH_TESTED_RANGE,
    TORCH_VERSION,
    UNKNOWABLE_ON_FAKE_TENSORS,
    UNTESTED_THUNDER_VARIABLE,
    UNTESTED_TORCH_VARIABLE,
    AnyProxy,
    BoundSymbol,
    BoundSymbolTag,
    DataDependentOutputException,
    DeviceMesh,
    DTensor,
    NumberProxy,
    OperatorExecutor,
    OpTags,
    Partial,
    Placement,
    Proxy,
    Replicate,
    Shard,
    Symbol,
    TensorMeta,
    TensorProxy,
    TraceCtx,
    any_rank_of_mesh,
    canonical_spec_repr,
    check,
    clear_sharding_propagation_cache,
    decompositions_dtensor_lacks,
    devices,
    dtensor_around,
    dtensor_from_local_unchecked,
    dtensor_spec,
    dtypes,
    fake_tensor_logging_muted,
    fake_tensor_mode,
    fork_rng_of,
    from_trace,
    get_grad,
    get_tracectx,
    is_fake,
    is_random_op,
    is_strided_shard,
    local_offset,
    local_shape_and_offset,
    local_tensor,
    ltorch,
    make_prim,
    outside_tracing_modes,
    prims,
    put_grad,
    pyval,
    respec,
    rng_state,
    set_rng_state,
    sharded_unevenly,
    size_hint,
    spec_with_sizes,
    spec_without_partials,
    thunder,
    thunder_is_tested,
    thunder_symbol_of,
    torch_tree_flatten,
    torch_tree_unflatten,
    tracectx,
    tree_flatten,
    tree_map,
    tree_unflatten,
    variableify,
    writes_into_an_input,
)
from thunder_dtensor._integration.collectives import (
    FunctionalReduceOp,
    all_gather_dim0,
    all_reduce_tensor,
    all_to_all,
    reduce_scatter_dim0,
)
from thunder_dtensor._integration.compile_pipeline import (
    TraceProvenance,
    below_autograd,
    claiming_operator,
    compile_joint_trace,
    current_cache_info,
    current_compile_context,
    default_store,
    get_compile_option,
    group_name,
    install_lowering,
    is_functional_collective,
    is_split_forward,
    keep_collectives_in_order_through_dataflow_fusion,
    let_torch_executors_claim,
    make_fx,
    mesh_group_names,
    no_ambient_autocast,
    nodes_traced_so_far,
    process_group_all_reduce,
    process_group_size,
    torch_tree_map,
    trace_aten_graph,
    under_compile_data,
)
from thunder_dtensor._integration.context_parallel import (
    context_parallel_dispatch_enabled,
    head_tail_layout,
    rotate_method,
)
from thunder_dtensor._integration.fixes.cpu_kernels import run_cpu_ops_with_torch_kernels
from thunder_dtensor._integration.fixes.scoped_entries import consult_scoped_entries
from thunder_dtensor._integration.fixes.speedups import (
    bind_symbols_with_cached_signatures,
    call_partials_outside_the_interpreter,
    compile_fused_regions_without_dynamo,
    dispatch_module_calls_outside_the_interpreter,
    in_stable_topological_order,
    keep_fused_regions_in_program_order,
    keep_what_backward_regions_materialize,
    make_autograd_dummies_without_random_numbers,
    make_exception_frames_without_a_busy_wait,
    run_interpreter_helpers_directly,
    size_strided_shards_outside_tracing,
    thunders_own_interpreter_paths,
)
from thunder_dtensor._integration.fixes.thunder_fixes import (
    answer_requires_grad_of_computed_values,
    call_custom_autograd_functions_with_builtin_apply,
    clamp_slices_as_torch_does,
    count_negative_padding_idx_from_the_end,
    fix_complex_gradients,
    functionalize_writes_into_views_that_require_grad,
    fused_sdp_choice,
    give_meta_tensors_a_stride,
    give_torch_compile_regions_whole_complex_tensors,
    install_sdpa_kernel_support,
    interpret_itertools_chain,
    is_missing_gradient,
    is_sdpa_kernel_fx_target,
    keep_named_members_in_order,
    keep_saved_tensors_from_in_place_writes,
    name_opaque_arguments_of_traced_functions,
    name_the_fields_of_paired_results,
    no_gradient_in_no_gradient_out,
    read_dict_items_past_an_overriding_getitem,
    refuse_branches_on_run_time_numbers,
    register_gradient_hooks_on_real_tensors,
    replay_the_state_the_program_leaves,
    run_torch_custom_ops,
    run_writes_into_graph_inputs_in_torch,
    scale_by_run_time_alphas,
    scope_ambient_autocast_to_each_call,
    sdpa_backends_enabled_globally,
    skip_empty_vectors_in_cat,
    sum_the_gradients_of_broadcast_cpu_scalars,
    take_autograd_function_apply_without_a_tensor_mask,
    take_grouped_query_attention_in_sdpa,
    take_python_types_as_tensor_dtypes,
    tolerate_sequences_that_cannot_be_iterated,
)
from thunder_dtensor._integration.fsdp import (
    FSDPGroupLayout,
    FSDPParamLayout,
    add_prologue_constraint,
    fsdp_gradient_switches,
    fsdp_group_layouts,
    fsdp_input_device,
    fsdp_lazy_init,
    fsdp_mixed_precision_casts,
    install_fsdp_support,
    interpret_call,
    is_interpreter_exception,
    local_shape_on,
    mark_recomputed_in_backward,
    unwrap_value,
    wrap_constant,
)
from thunder_dtensor._integration.functionalize import ViewWriteEmitter, normalized_view_name
from thunder_dtensor._integration.interpreter_calls import read_through_interpreter
from thunder_dtensor._integration.masks import (
    let_fake_masks_stand_in,
    note_trace_time_masks,
    release_recomputed_masks,
    release_trace_time_masks,
)
from thunder_dtensor._integration.program_scope import (
    add_dtensor_executor,
    note_each_call,
    use_dtensor_executors,
)
from thunder_dtensor._integration.prologue import PrologueOps, compact_prologue
from thunder_dtensor._integration.rank_agreement import make_dtensor_choices_alike_on_every_rank
from thunder_dtensor._integration.registry import (
    installed,
    installer,
    installers,
    undo_all,
)
from thunder_dtensor._integration.thunder_hooks import (
    accept_dtensor_proxies,
    bind_unpack_dtensor_spec,
    bind_unpack_local_tensor,
    call_proxy_conversions_whole,
    grad_enabled_while_tracing,
    inplace_argument_index,
    inplace_torchsymbol,
    install_compiled_program_hook,
    install_thunder_hooks,
    is_check_tensor_shape_and_metadata,
    is_unknown_torch_function,
    is_unpack_cotangents,
    keep_dtensors_in_alias_updates,
    local_shards_alias,
    make_isinstance_see_dtensor_proxies,
    make_placements_opaque,
    make_spec,
    mark_may_return_views,
    may_return_views,
    note_dtensor_op_traced,
    read_root_module_state_from_user_module,
    register_grad,
    route_dtensor_calls,
    set_cotangent_proxy_factory,
    static_number,
    thunder_methods,
    torch_to_thunder_map,
    torchsymbol,
    traced_dtensor_ops,
    using_symbolic_values,
    wrap_compiled_backwards,
)
from thunder_dtensor._integration.thunderfx import (
    fx_example_value,
    install_thunderfx_support,
    is_dynamo_dtensor_method_closure,
    is_opaque_script_object,
    scope_dtensor_entries_to_thunderfx_calls,
    trace_on_proxies,
)
from thunder_dtensor._integration.tp_lookasides import register_lookaside, tensor_parallel_style_functions

#: thunder's and torch's own names (classes, modules, tables, version facts) the package uses
__all__ = [
    "AnyProxy",
    "PrologueOps",
    "compact_prologue",
    "BoundSymbol",
    "BoundSymbolTag",
    "check",
    "DataDependentOutputException",
    "DeviceMesh",
    "devices",
    "DISTRIBUTED_AVAILABLE",
    "DTensor",
    "dtypes",
    "from_trace",
    "FUNCTION_APPLY_IS_BUILTIN",
    "get_compile_option",
    "get_grad",
    "get_tracectx",
    "IMPORT_ORDER_FIX",
    "ltorch",
    "make_fx",
    "make_prim",
    "NumberProxy",
    "OperatorExecutor",
    "OpTags",
    "Partial",
    "Placement",
    "prims",
    "Proxy",
    "put_grad",
    "pyval",
    "Replicate",
    "Shard",
    "Symbol",
    "TensorMeta",
    "TensorProxy",
    "thunder",
    "THUNDER_TESTED_NIGHTLY",
    "THUNDER_TESTED_RANGE",
    "THUNDER_VERSION",
    "TORCH_TESTED_RANGE",
    "TORCH_VERSION",
    "TraceCtx",
    "tracectx",
    "TraceProvenance",
    "tree_flatten",
    "tree_unflatten",
    "UNKNOWABLE_ON_FAKE_TENSORS",
    "UNTESTED_THUNDER_VARIABLE",
    "UNTESTED_TORCH_VARIABLE",
    "variableify",
    "ViewWriteEmitter",
]

#: small functions over thunder's and torch's private layouts: what the package calls instead of them
__all__ += [
    "normalized_view_name",
    "accept_dtensor_proxies",
    "add_dtensor_executor",
    "add_prologue_constraint",
    "FunctionalReduceOp",
    "all_gather_dim0",
    "all_reduce_tensor",
    "all_to_all",
    "below_autograd",
    "bind_unpack_dtensor_spec",
    "bind_unpack_local_tensor",
    "canonical_spec_repr",
    "claiming_operator",
    "clear_sharding_propagation_cache",
    "note_trace_time_masks",
    "release_trace_time_masks",
    "release_recomputed_masks",
    "let_fake_masks_stand_in",
    "sharded_unevenly",
    "compile_joint_trace",
    "current_cache_info",
    "under_compile_data",
    "context_parallel_dispatch_enabled",
    "current_compile_context",
    "decompositions_dtensor_lacks",
    "dtensor_around",
    "dtensor_from_local_unchecked",
    "dtensor_spec",
    "fake_tensor_logging_muted",
    "fake_tensor_mode",
    "fork_rng_of",
    "fsdp_gradient_switches",
    "fsdp_group_layouts",
    "fsdp_input_device",
    "fsdp_lazy_init",
    "fsdp_mixed_precision_casts",
    "FSDPGroupLayout",
    "FSDPParamLayout",
    "fused_sdp_choice",
    "fx_example_value",
    "grad_enabled_while_tracing",
    "group_name",
    "head_tail_layout",
    "inplace_argument_index",
    "inplace_torchsymbol",
    "installer",
    "interpret_call",
    "interpreting_user_program",
    "is_check_tensor_shape_and_metadata",
    "is_dynamo_dtensor_method_closure",
    "is_fake",
    "is_functional_collective",
    "is_interpreter_exception",
    "is_missing_gradient",
    "is_opaque_script_object",
    "is_random_op",
    "is_sdpa_kernel_fx_target",
    "is_split_forward",
    "is_strided_shard",
    "is_unknown_torch_function",
    "is_unpack_cotangents",
    "let_torch_executors_claim",
    "any_rank_of_mesh",
    "local_offset",
    "local_shape_and_offset",
    "local_shape_on",
    "local_shards_alias",
    "local_tensor",
    "make_spec",
    "mark_may_return_views",
    "mark_recomputed_in_backward",
    "may_return_views",
    "mesh_group_names",
    "process_group_all_reduce",
    "process_group_size",
    "default_store",
    "no_ambient_autocast",
    "nodes_traced_so_far",
    "note_dtensor_op_traced",
    "outside_tracing_modes",
    "read_through_interpreter",
    "recording_aten_calls",
    "reduce_scatter_dim0",
    "register_grad",
    "register_lookaside",
    "rng_state",
    "rotate_method",
    "sdpa_backends_enabled_globally",
    "set_rng_state",
    "size_hint",
    "respec",
    "spec_with_sizes",
    "spec_without_partials",
    "static_number",
    "tensor_parallel_style_functions",
    "thunder_autocast_disabled",
    "thunder_autocast_dtype",
    "thunder_is_tested",
    "thunder_methods",
    "thunder_symbol_of",
    "thunders_own_interpreter_paths",
    "torch_to_thunder_map",
    "torch_tree_flatten",
    "torch_tree_map",
    "torch_tree_unflatten",
    "torchsymbol",
    "trace_aten_graph",
    "trace_on_proxies",
    "traced_dtensor_ops",
    "tree_map",
    "unwrap_value",
    "use_dtensor_executors",
    "using_symbolic_values",
    "wrap_constant",
    "writes_into_an_input",
]

#: what the package's root calls, in its order (each an @installer of the registry), and the registry's listing
__all__ += [
    "answer_requires_grad_of_computed_values",
    "bind_symbols_with_cached_signatures",
    "call_custom_autograd_functions_with_builtin_apply",
    "clamp_slices_as_torch_does",
    "call_partials_outside_the_interpreter",
    "call_proxy_conversions_whole",
    "compile_fused_regions_without_dynamo",
    "in_stable_topological_order",
    "keep_fused_regions_in_program_order",
    "keep_what_backward_regions_materialize",
    "size_strided_shards_outside_tracing",
    "consult_scoped_entries",
    "dispatch_module_calls_outside_the_interpreter",
    "fix_complex_gradients",
    "functionalize_writes_into_views_that_require_grad",
    "give_meta_tensors_a_stride",
    "give_torch_compile_regions_whole_complex_tensors",
    "install_autocast_hook",
    "install_compiled_program_hook",
    "install_fsdp_support",
    "install_lowering",
    "keep_collectives_in_order_through_dataflow_fusion",
    "install_sdpa_kernel_support",
    "install_thunder_hooks",
    "install_thunderfx_support",
    "installed",
    "installers",
    "interpret_itertools_chain",
    "no_gradient_in_no_gradient_out",
    "keep_dtensors_in_alias_updates",
    "keep_named_members_in_order",
    "keep_saved_tensors_from_in_place_writes",
    "make_autograd_dummies_without_random_numbers",
    "make_dtensor_choices_alike_on_every_rank",
    "make_exception_frames_without_a_busy_wait",
    "make_isinstance_see_dtensor_proxies",
    "make_placements_opaque",
    "name_opaque_arguments_of_traced_functions",
    "name_the_fields_of_paired_results",
    "note_each_call",
    "read_attributes_through_handlers",
    "read_dict_items_past_an_overriding_getitem",
    "read_root_module_state_from_user_module",
    "refuse_branches_on_run_time_numbers",
    "register_gradient_hooks_on_real_tensors",
    "replay_the_state_the_program_leaves",
    "route_dtensor_calls",
    "run_cpu_ops_with_torch_kernels",
    "run_interpreter_helpers_directly",
    "run_torch_custom_ops",
    "run_writes_into_graph_inputs_in_torch",
    "scale_by_run_time_alphas",
    "scope_ambient_autocast_to_each_call",
    "skip_empty_vectors_in_cat",
    "sum_the_gradients_of_broadcast_cpu_scalars",
    "take_autograd_function_apply_without_a_tensor_mask",
    "take_grouped_query_attention_in_sdpa",
    "count_negative_padding_idx_from_the_end",
    "take_python_types_as_tensor_dtypes",
    "scope_dtensor_entries_to_thunderfx_calls",
    "set_cotangent_proxy_factory",
    "tolerate_sequences_that_cannot_be_iterated",
    "undo_all",
    "wrap_compiled_backwards",
]
