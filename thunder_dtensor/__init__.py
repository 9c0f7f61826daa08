"""thunder_dtensor: DTensor programs under ``thunder.jit``.

``import thunder_dtensor`` (before or instead of ``import thunder`` on torch >= 2.13) makes thunder's jit
trace DTensor inputs as :class:`DTensorProxy`, check their specs in the prologue, and run their ops as
dtensor prims on this package's executor, forward and backward.
"""

from __future__ import annotations

import functools

from thunder_dtensor import _integration
from thunder_dtensor._integration import DISTRIBUTED_AVAILABLE, thunder

# each fix of thunder acts within DTensor programs unless switched (``thunder_dtensor.fixes``)
__all__ = ["DISTRIBUTED_AVAILABLE", "fixes", "fixes_everywhere", "thunder"]
_integration.note_each_call()  # what asks can tell a DTensor program (the scope of everything below)
_integration.read_attributes_through_handlers()  # one getattr lookaside; fixes below add handlers
_integration.consult_scoped_entries()  # lookasides and methods of the fixes, where they act
_integration.fix_complex_gradients()  # thunder 0.2.6's grad rules ignore complex conjugation (RoPE)
_integration.call_custom_autograd_functions_with_builtin_apply()  # torch >= 2.14: autograd.Function.apply is C
_integration.tolerate_sequences_that_cannot_be_iterated()  # a Sequence's own __init__ (transformers' configs)
_integration.interpret_itertools_chain()  # torch's context_parallel chains SDPA's arguments
_integration.replay_the_state_the_program_leaves()  # attributes set in the program (output collector, KV cache)
_integration.clamp_slices_as_torch_does()  # mask[:, -window:] with a window longer than the mask
_integration.take_python_types_as_tensor_dtypes()  # torch.tensor([-1], dtype=int)
_integration.take_grouped_query_attention_in_sdpa()  # F.scaled_dot_product_attention(..., enable_gqa=True)
_integration.count_negative_padding_idx_from_the_end()  # F.embedding(ids, w, padding_idx=-1)
_integration.skip_empty_vectors_in_cat()  # torch.cat([torch.tensor([]), x], dim=-2) (transformers' DynamicCache)
_integration.register_gradient_hooks_on_real_tensors()  # param.register_post_accumulate_grad_hook(...) in forward
_integration.give_meta_tensors_a_stride()  # torch.empty(shape, device="meta").stride()
_integration.keep_named_members_in_order()  # named_parameters() in a program, in the module's order
_integration.keep_saved_tensors_from_in_place_writes()  # v /= v.sum(): the backward reads v as it was
_integration.name_opaque_arguments_of_traced_functions()  # MyFunction.apply(x, process_group)
_integration.run_torch_custom_ops()  # torch.ops.ns.op(...) of a torch.library.custom_op
_integration.answer_requires_grad_of_computed_values()  # x.view(-1).requires_grad is True, as in eager
_integration.give_torch_compile_regions_whole_complex_tensors()  # dynamo cannot take a complex view as input
_integration.no_gradient_in_no_gradient_out()  # thunderfx: an unread graph output does not give zero gradients
_integration.take_autograd_function_apply_without_a_tensor_mask()  # thunderfx: torch 2.13's custom Functions
_integration.read_dict_items_past_an_overriding_getitem()  # ACT2FN[name](x): a dict subclass's own __getitem__
_integration.sum_the_gradients_of_broadcast_cpu_scalars()  # x.sum() * x on CPU: the scalar's gradient is summed
_integration.scale_by_run_time_alphas()  # torch.add(a, b, alpha=x.item())

if DISTRIBUTED_AVAILABLE:
    from thunder_dtensor import dispatch, guards, ops

    # dispatch on the proxy: calls with a DTensor argument reach the dispatch table, thunder's tables stay thunder's
    _integration.route_dtensor_calls(dispatch.may_route, dispatch.function_route, dispatch.method_route)
    from thunder_dtensor.dispatch import register_function_for_dtensor, register_method_for_dtensor
    from thunder_dtensor.errors import DTensorOpError
    from thunder_dtensor.executor import dtensor_ex
    from thunder_dtensor.guards import check_dtensor_spec_repr
    from thunder_dtensor.primitive import (
        DTENSOR_PRIMS,
        define_dtensor_prim,
        define_dtensor_symbol,
        define_vjp,
        prune_unused_vjp_gradients,
    )
    from thunder_dtensor.proxy import DTensorProxy, is_dtensor_proxy, proxify_dtensor
    from thunder_dtensor.spec import DTensorMeta

    # in DTensor's tables only while a thunderfx call runs: the sharding rules torch lacks, and the handler of
    # x.item() (it runs as eager DTensor's, dynamo's graph ends there): the global value, as jit's
    _integration.scope_dtensor_entries_to_thunderfx_calls(
        ops.attention.THUNDERFX_SHARDING_RULES, ops.scalars.global_item
    )
    # in-place DTensor ops keep their DTensor proxies through thunder's alias updates
    _integration.keep_dtensors_in_alias_updates(
        is_dtensor_proxy,
        ops.inplace.dtensor_alias_proxy,
        ops.inplace.dtensor_update_aliases_prim,
        ops.inplace.DTENSOR_VIEW_WRITES,
    )
    _integration.install_thunder_hooks(
        proxify=proxify_dtensor,
        is_dtensor_proxy=is_dtensor_proxy,
        spec_check_prim=check_dtensor_spec_repr,
        prologue_spec_check=guards.add_prologue_spec_checks,
        backward_cotangent_check=lambda trace: prune_unused_vjp_gradients(guards.match_cotangent_specs(trace)),
        cotangent_add=ops.inplace.accumulate_cotangents,
        bind_dtensor_zeros=ops.factories.bind_zero_cotangent,
        joint_trace_check=guards.propagate_gradient_specs,
    )
    _integration.set_cotangent_proxy_factory(guards.make_cotangent_proxy)
    _integration.make_isinstance_see_dtensor_proxies(DTensorProxy)
    _integration.make_placements_opaque()
    _integration.call_proxy_conversions_whole(DTensorProxy)  # bool(x) of a DTensor raises naming its placements
    _integration.refuse_branches_on_run_time_numbers(ops.scalars.branch_refusal)  # if x.item() > 0: refused
    _integration.make_dtensor_choices_alike_on_every_rank()  # ranks choose strategies and plans alike
    _integration.let_fake_masks_stand_in()  # a trace-time masked lookup's fake mask stands in (see _integration.masks)
    _integration.read_root_module_state_from_user_module()
    _integration.dispatch_module_calls_outside_the_interpreter()  # first-call time: hook loops run in Python
    _integration.call_partials_outside_the_interpreter()  # and the partials every TP hook calls
    _integration.run_interpreter_helpers_directly()  # and x[k], k in x, unpacking, names: no helper frames
    _integration.make_exception_frames_without_a_busy_wait()  # an interpreted raise costs no GIL switch interval
    _integration.bind_symbols_with_cached_signatures()  # a symbol's meta signature is read once
    _integration.run_cpu_ops_with_torch_kernels()  # CPU gelu/silu/layer_norm/complex views/SDPA: torch's kernels
    _integration.make_autograd_dummies_without_random_numbers()  # per-call time: no meta randn per training call
    _integration.compile_fused_regions_without_dynamo()  # and torch.compile executor regions skip dynamo's frame
    _integration.keep_fused_regions_in_program_order()  # rematerialization does not reorder a region (memory)
    _integration.keep_what_backward_regions_materialize()  # nor recompute what a backward matmul reads
    _integration.size_strided_shards_outside_tracing()  # a _StridedShard's size: no fake tolist while tracing

    from thunder_dtensor import tp_hooks

    tp_hooks.install()  # parallelize_module's hooks run whole, as lookasides

    from thunder_dtensor import consistency

    # every rank compiled the same DTensor ops (opt-in: THUNDER_DTENSOR_CHECK_COLLECTIVES=1)
    _integration.install_compiled_program_hook(consistency.check_compiled_program)
    # a cotangent placed otherwise than traced gets the backward traced for its placements, as eager's backward
    _integration.wrap_compiled_backwards(guards.backward_for_cotangent_placements)

    from thunder_dtensor.thunderfx import dtensor_node_support, is_dtensor_graph, plain_node_support

    _integration.install_thunderfx_support(dtensor_node_support, plain_node_support, is_dtensor_graph)

    from thunder_dtensor import autocast

    autocast.install()  # torch.autocast around DTensor programs: its casts become dtensor prims in the trace

    __all__ += [
        "DTENSOR_PRIMS",
        "DTensorMeta",
        "DTensorOpError",
        "DTensorProxy",
        "check_dtensor_spec_repr",
        "define_dtensor_prim",
        "define_dtensor_symbol",
        "define_vjp",
        "dtensor_ex",
        "register_function_for_dtensor",
        "register_method_for_dtensor",
    ]

from thunder_dtensor import fixes  # noqa: E402  (the switches: enable, disable, enabled, ...)
from thunder_dtensor.fixes import fixes_everywhere  # noqa: E402
from thunder_dtensor.sdpa_backends import install_sdpa_kernel_support  # noqa: E402  (sdpa_kernel(...) in jitted code)

install_sdpa_kernel_support()  # sdpa_kernel(...) in jitted code (DTensor attention runs the same check itself)

if DISTRIBUTED_AVAILABLE:
    from thunder_dtensor import fsdp

    fsdp.install()  # FSDP2 (fully_shard) under thunder.jit: its hooks stay out of the interpreter

    from thunder_dtensor import lowering

    # DTensor programs become local ops plus explicit collectives (thunder.jit(fn, dtensor_lowering=False): not)
    # and a DTensor program's prologue walks each module once and checks its constants in one comparison
    _integration.install_lowering(
        lowering.lower_dtensor_program,
        lowering.lowering_enabled,
        lowering.annotate_not_lowered,
        functools.partial(_integration.compact_prologue, ops=guards.PROLOGUE_OPS),
    )
    # every rank issues them (and the dtensor prims run eagerly, which may redistribute) in one order, also through
    # thunderfx's dataflow fusion partition
    _integration.keep_collectives_in_order_through_dataflow_fusion(lowering.may_communicate)

# a write into a view of a plain tensor that requires grad gets eager's gradients (installed after the alias
# pass's DTensor wrapper, which rewrites DTensor writes the same way, so that it wraps that one)
_integration.functionalize_writes_into_views_that_require_grad()
# thunderfx: a write into a graph input that then requires grad runs in torch, not in a thunder region that would
# lose its gradient (installed after the DTensor splitter's wrapper, so that it asks before any cached answer)
_integration.run_writes_into_graph_inputs_in_torch()
# x.max(dim=-1).values, torch.topk(...).indices: torch's named results (outermost of the interpreter's lookaside)
_integration.name_the_fields_of_paired_results()
