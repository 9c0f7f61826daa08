"""Speed-ups (kind ``speedup``; ``THUNDER_DTENSOR_SPEEDUPS=0`` turns them off): module calls, partials and
thunder's own helpers run outside the interpreter, signatures read once; on CPU, gelu, silu and layer_norm train
with torch's kernels, complex views with each other as gradients, and causal attention with the CPU flash
kernel."""

from __future__ import annotations

import contextlib
import dis
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any, cast

from thunder_dtensor._integration.fixes.scoped_entries import add_scoped_lookaside
from thunder_dtensor._integration.fixes.switches import EVERYWHERE, IN_DTENSOR_PROGRAMS, active, mode, switched
from thunder_dtensor._integration.program_scope import add_first_executor, running_a_dtensor_program
from thunder_dtensor._integration.registry import (
    INTERPRETER_LOOKASIDES,
    OPCODE_HANDLERS,
    expects_function,
    expects_identical,
    installer,
    patch,
)

import torch


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


@installer("speedup", "module calls run their hook loop in Python; hooks and forward are interpreted")
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
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map
    call_impl = torch.nn.Module._wrapped_call_impl
    interpreted_call_impl = _interpretable_copy(cast(types.FunctionType, call_impl))
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
                    result: Any = interpreter._interpret_call(hook, module, wrapped_args, wrapped_kwargs)
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

    assert call_impl not in lookasides, "thunder has a lookaside for Module._wrapped_call_impl now"
    add_scoped_lookaside("dispatch_module_calls_outside_the_interpreter", call_impl, module_call)


def _interpretable_copy(fn: types.FunctionType) -> types.FunctionType:
    """The same function under another identity: interpreting it interprets ``fn``'s code, which a lookaside on
    ``fn`` itself would prevent."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


@installer("speedup", "functools.partial objects are called without interpreting thunder's helper for them")
def call_partials_outside_the_interpreter() -> None:
    """``functools.partial`` objects are called without interpreting thunder's own helper for them.

    thunder 0.2.6 calls a partial by interpreting ``p.func(*p.args, *args, **(p.keywords | kwargs))``: list
    building, unpacking and a dict merge, each stepped through by the interpreter (hundreds of instructions a
    call). Every hook ``parallelize_module`` installs calls a partial. This reads ``func`` and ``args`` through
    the interpreter (so the prologue checks the bound arguments as before) and makes the call directly; a
    partial with keywords goes the old way.
    """
    import functools

    from thunder.core import interpreter

    lookasides = interpreter._default_lookaside_map
    thunder_partial_call = lookasides[functools.partial.__call__]

    def partial_call(partial: Any, *args: Any, **kwargs: Any) -> Any:
        if type(interpreter.unwrap(partial)) is not functools.partial or interpreter.unwrap(partial).keywords:
            return thunder_partial_call(partial, *args, **kwargs)
        func = _read_through_interpreter(partial, "func")
        bound = _read_through_interpreter(partial, "args")
        if interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED in (func, bound):
            return interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED
        interpreter.populate_item_wrappers(bound)
        return interpreter._interpret_call(func, *bound.item_wrappers, *args, **kwargs)

    expects = expects_function("thunder.core.interpreter", "partial_object")
    partial_call = switched("call_partials_outside_the_interpreter", partial_call, thunder_partial_call)
    patch(lookasides, functools.partial.__call__, partial_call, table=INTERPRETER_LOOKASIDES, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# thunder's interpreted helpers (thunder 0.2.6 interpreter): first-call time
# ---------------------------------------------------------------------------------------------------------
#: the exact container types whose ``[]``, ``in`` and unpacking the interpreter dispatches directly
_SUBSCRIPTED_CONTAINERS = (dict, list, tuple)
_SEARCHED_CONTAINERS = (dict, list, tuple, set, frozenset, str)
_UNPACKED_SEQUENCES = (list, tuple)
#: whether the direct paths are taken (:func:`thunders_own_interpreter_paths` turns them off)
_DIRECT_PATHS = [True]


def _module_computing_once(
    module: types.ModuleType, name: str, compute: Callable, key_type: type, fix: str
) -> types.ModuleType:
    """``module``'s namespace as one of thunder's modules sees it, with ``name(x)`` computed once per ``x``
    (``compute(x)``, LRU) for a hashable ``x`` of ``key_type`` passed alone, where ``fix`` is active; other calls
    run ``module.name``."""
    original = getattr(module, name)
    cached = functools.lru_cache(maxsize=4096)(compute)

    def once(x: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(x, key_type) or not active(fix):
            return original(x, *args, **kwargs)
        try:
            hash(x)
        except TypeError:
            return original(x)
        return cached(x)

    view = types.ModuleType(module.__name__)
    view.__dict__.update(module.__dict__)
    setattr(view, name, once)
    return view


def _dis_disassembling_once_per_code() -> types.ModuleType:
    """``dis`` as thunder's interpreter module sees it: a code object's instructions are computed once.

    thunder 0.2.6 disassembles a function's code every time it interprets a call of it (``_run_frame``); the
    instructions of a code object never change, and most calls are of a few dozen codes (its own helpers).
    """
    import dis

    return _module_computing_once(
        dis,
        "get_instructions",
        lambda code: tuple(dis.get_instructions(code)),
        types.CodeType,
        "run_interpreter_helpers_directly",
    )


@installer("speedup", "Symbol.bind reads each meta's signature once")
def bind_symbols_with_cached_signatures() -> None:
    """thunder's ``Symbol.bind`` reads its meta's ``inspect.signature`` anew for every bound symbol (about
    10,000 times in a 4-block Llama's first call); a meta's signature does not change, so thunder's symbol
    module sees an ``inspect`` whose ``signature`` is computed once per (hashable) callable."""
    import inspect

    from thunder.core import symbol

    view = _module_computing_once(
        inspect, "signature", inspect.signature, object, "bind_symbols_with_cached_signatures"
    )
    patch(symbol, "inspect", view, expects=expects_identical(inspect))


@contextlib.contextmanager
def thunders_own_interpreter_paths() -> Iterator[None]:
    """Interpret as thunder does, through its helper frames (for comparing the two in tests)."""
    _DIRECT_PATHS[0] = False
    try:
        yield
    finally:
        _DIRECT_PATHS[0] = True


@installer("speedup", "the interpreter runs x[k], k in x, unpacking and name lookups without its helper frames")
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
    import inspect

    from thunder.core import interpreter

    handlers = interpreter._default_opcode_handler_map
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
            and active("run_interpreter_helpers_directly")
            and interpreter.get_interpretercompilectx()._with_provenance_tracking
            and not runtime._record_history
            and runtime.debug_log is None
        )

    def call_method(method: Callable, container: Any, *args: Any) -> Any:
        # (thunder annotates ``fn`` as a callable; it takes a wrapped one too)
        return interpreter._interpret_call(wrap_const(method), container, *args)  # type: ignore[arg-type]

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

    module = "thunder.core.interpreter"
    opcode_handler = expects_function(module, "inst")
    for opcode, handler in (
        ("BINARY_SUBSCR", subscript),
        ("CONTAINS_OP", contains),
        ("UNPACK_SEQUENCE", unpack),
        ("DICT_MERGE", dict_merge),
        ("LIST_EXTEND", list_extend),
    ):
        patch(handlers, opcode, handler, table=OPCODE_HANDLERS, expects=opcode_handler)
    patch(interpreter, "globals_lookup", globals_lookup, expects=expects_function(module, "globals_dict", "name"))
    patch(interpreter, "_call_dispatch", call_dispatch, expects=expects_function(module, "compilectx", "runtimectx"))
    patch(interpreter, "dis", _dis_disassembling_once_per_code(), expects=expects_identical(dis))


# ---------------------------------------------------------------------------------------------------------
# Plain CPU tensors: gelu, silu and layer_norm forward and backward as torch's own kernels (thunder 0.2.6)
# ---------------------------------------------------------------------------------------------------------
#: the executor that runs them (first among thunder's default executors, CPU tensors only)
EAGER_KERNELS_EXECUTOR_NAME = "cpu_eager_kernels"


def _plain_on_cpu(dtype_ok: Callable[[Any], bool], a: Any, *args: Any, **kwargs: Any) -> bool:
    """Plain (not DTensor) CPU tensors only, ``a`` of a dtype ``dtype_ok`` accepts, every tensor argument on
    the same device."""
    from thunder.core.proxies import TensorProxy

    tensors = [x for x in (a, *args, *kwargs.values()) if isinstance(x, TensorProxy)]
    return (
        type(a) is TensorProxy
        and a.device.devicetype.name == "CPU"
        and dtype_ok(a.dtype)
        and all(type(x) is TensorProxy and x.device == a.device for x in tensors)
    )


def _on_cpu(a: Any, *args: Any, **kwargs: Any) -> bool:
    """Plain (not DTensor) floating-point CPU tensors only, every tensor argument on the same device."""
    from thunder.core import dtypes

    return _plain_on_cpu(dtypes.is_float_dtype, a, *args, **kwargs)


@functools.cache
def _eager_kernels_executor() -> Any:
    """An executor whose grad rules for ``gelu``, ``silu`` and ``layer_norm`` on CPU are torch's: the forward
    kernel, saving what eager autograd saves, and the backward kernel (``gelu_backward``, ``silu_backward``,
    ``native_layer_norm_backward``). thunder 0.2.6 differentiates their decompositions instead, which on CPU
    (no fusion executor) costs a pass over memory per elementwise op and saves several intermediates per op:
    a 4-block LayerNorm + GELU MLP trains 1.9x slower than eager with 1.8x its peak memory."""
    import thunder.torch as ltorch
    from thunder.core.proxies import TensorProxy
    from thunder.core.transforms import get_grad, put_grad
    from thunder.extend import OperatorExecutor

    ex = OperatorExecutor(EAGER_KERNELS_EXECUTOR_NAME)
    aten = torch.ops.aten

    def same(a: Any, *args: Any, **kwargs: Any) -> Any:
        return TensorProxy(like=a)

    def like_input(g: Any, a: Any, *args: Any) -> Any:  # a backward's meta: the gradient of its input ``a``
        return TensorProxy(like=a)

    gelu = ex.register_operator("cpu_gelu", meta=same, fn=lambda a, approximate: aten.gelu(a, approximate=approximate))
    gelu_backward = ex.register_operator(
        "cpu_gelu_backward",
        meta=like_input,
        fn=lambda g, a, approximate: aten.gelu_backward(g, a, approximate=approximate),
    )

    # the grad rules take their symbol's signature: thunderfx's splitter matches their parameters to its meta's
    def gelu_grad(a: Any, /, *, approximate: str = "none") -> Any:
        out = gelu(a, approximate)
        put_grad(a, gelu_backward(get_grad(out), a, approximate))
        return out

    ex.register_implementation(
        ltorch.gelu,
        checker=_on_cpu,
        execution_transform=lambda a, /, *, approximate="none": gelu(a, approximate),
        grad_transform=gelu_grad,
    )

    silu = ex.register_operator("cpu_silu", meta=same, fn=aten.silu)
    silu_backward = ex.register_operator("cpu_silu_backward", meta=like_input, fn=aten.silu_backward)

    def silu_grad(a: Any, /, inplace: bool = False) -> Any:
        out = silu(a)
        put_grad(a, silu_backward(get_grad(out), a))
        return out

    ex.register_implementation(
        ltorch.silu, checker=_on_cpu, execution_transform=lambda a, /, inplace=False: silu(a), grad_transform=silu_grad
    )

    def layer_norm_meta(a: Any, shape: tuple, weight: Any, bias: Any, eps: float) -> tuple:
        stats = (*a.shape[: a.ndim - len(shape)], *([1] * len(shape)))
        return TensorProxy(like=a), TensorProxy(like=a, shape=stats), TensorProxy(like=a, shape=stats)

    def layer_norm_backward_meta(g: Any, a: Any, shape: tuple, mean: Any, rstd: Any, weight: Any, bias: Any) -> tuple:
        return (
            TensorProxy(like=a),
            None if weight is None else TensorProxy(like=weight),
            None if bias is None else TensorProxy(like=bias),
        )

    def run_layer_norm_backward(g, a, shape, mean, rstd, weight, bias):  # noqa: ANN001, ANN202
        mask = [True, weight is not None, bias is not None]
        return aten.native_layer_norm_backward(g, a, list(shape), mean, rstd, weight, bias, mask)

    layer_norm = ex.register_operator(
        "cpu_native_layer_norm",
        meta=layer_norm_meta,
        fn=lambda a, shape, weight, bias, eps: aten.native_layer_norm(a, list(shape), weight, bias, eps),
    )
    layer_norm_backward = ex.register_operator(
        "cpu_native_layer_norm_backward", meta=layer_norm_backward_meta, fn=run_layer_norm_backward
    )

    def layer_norm_forward(
        a: Any, /, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
    ) -> Any:
        return layer_norm(a, tuple(normalized_shape), weight, bias, eps)[0]

    def layer_norm_grad(
        a: Any, /, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
    ) -> Any:
        shape = tuple(normalized_shape)
        out, mean, rstd = layer_norm(a, shape, weight, bias, eps)
        grads = layer_norm_backward(get_grad(out), a, shape, mean, rstd, weight, bias)
        for x, g in zip((a, weight, bias), grads):
            if x is not None:
                put_grad(x, g)
        return out

    ex.register_implementation(
        ltorch.layer_norm, checker=_on_cpu, execution_transform=layer_norm_forward, grad_transform=layer_norm_grad
    )
    _register_complex_views(ex)
    _register_cpu_flash_attention(ex)
    return ex


def _flash_attention_runs(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, **_: Any
) -> bool:
    """Whether torch's CPU flash-attention kernel takes this call as it is: 4-D plain CPU float tensors of
    the same batch and head counts and one head size, keys and values of one length, no mask, no dropout."""
    return (
        _on_cpu(query, key, value)
        and attn_mask is None
        and isinstance(dropout_p, int | float)
        and dropout_p == 0.0
        and query.ndim == key.ndim == value.ndim == 4
        and tuple(query.shape[:2]) == tuple(key.shape[:2]) == tuple(value.shape[:2])
        and query.shape[3] == key.shape[3] == value.shape[3] > 0
        and key.shape[2] == value.shape[2] > 0
        and query.shape[2] > 0
    )


def _with_unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _register_cpu_flash_attention(ex: Any) -> None:
    """``scaled_dot_product_attention`` of plain CPU tensors with torch's fused CPU kernel, forward and
    backward, where eager would pick it too (no mask, no dropout: a causal LLM's attention). thunder 0.2.6
    decomposes SDPA into matmuls, a softmax and a mask on CPU (its ``sdpa`` executor claims CUDA only):
    about 15 ops forward and 30 backward, and the full score matrix saved for the backward."""
    import thunder.torch as ltorch
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.transforms import get_grad, put_grad

    aten = torch.ops.aten

    def flash_meta(q: Any, k: Any, v: Any, is_causal: bool, scale: Any) -> tuple:
        stats = dtypes.float32 if q.dtype in (dtypes.bfloat16, dtypes.float16) else q.dtype
        return TensorProxy(like=q), TensorProxy(like=q, shape=tuple(q.shape[:3]), dtype=stats)

    def run_flash(q, k, v, is_causal, scale):  # noqa: ANN001, ANN202
        q, k, v = (_with_unit_last_stride(t) for t in (q, k, v))
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)

    def flash_backward_meta(g: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, is_causal: bool, scale: Any) -> tuple:
        return TensorProxy(like=q), TensorProxy(like=k), TensorProxy(like=v)

    def run_flash_backward(g, q, k, v, out, lse, is_causal, scale):  # noqa: ANN001, ANN202
        q, k, v = (_with_unit_last_stride(t) for t in (q, k, v))
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g.contiguous(), q, k, v, out, lse, 0.0, is_causal, scale=scale
        )

    flash = ex.register_operator("cpu_flash_attention", meta=flash_meta, fn=run_flash)
    flash_backward = ex.register_operator(
        "cpu_flash_attention_backward", meta=flash_backward_meta, fn=run_flash_backward
    )

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):  # noqa: ANN001, ANN202
        return flash(query, key, value, is_causal, scale)[0]

    def sdpa_grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):  # noqa: ANN001, ANN202
        out, lse = flash(query, key, value, is_causal, scale)
        grads = flash_backward(get_grad(out), query, key, value, out, lse, is_causal, scale)
        for x, g in zip((query, key, value), grads):
            put_grad(x, g)
        return out

    ex.register_implementation(
        ltorch.scaled_dot_product_attention,
        checker=_flash_attention_runs,
        execution_transform=sdpa,
        grad_transform=sdpa_grad,
    )


def _complex_on_cpu(a: Any, *args: Any, **kwargs: Any) -> bool:
    """A plain (not DTensor) complex CPU tensor."""
    from thunder.core import dtypes

    return _plain_on_cpu(dtypes.is_complex_dtype, a, *args, **kwargs)


def _complex_viewable_on_cpu(a: Any, *args: Any, **kwargs: Any) -> bool:
    """A plain (not DTensor) CPU tensor of a real dtype that has a complex counterpart (not bfloat16)."""
    from thunder.core import dtypes

    return _on_cpu(a) and a.dtype in (dtypes.float16, dtypes.float32, dtypes.float64)


def _register_complex_views(ex: Any) -> None:
    """``view_as_complex`` / ``view_as_real`` (a complex RoPE) differentiated by each other, as torch's autograd
    does. thunder 0.2.6 registers them automatically, with a backward that runs
    ``torch.autograd.functional.vjp`` on every call: about 90 µs against 2 µs for the view, four times per
    Llama block's step."""
    import thunder.torch as ltorch
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.transforms import get_grad, put_grad

    def complex_meta(a: Any) -> Any:
        return TensorProxy(like=a, shape=tuple(a.shape[:-1]), dtype=dtypes.corresponding_complex_dtype(a.dtype))

    def real_meta(a: Any) -> Any:
        return TensorProxy(like=a, shape=(*a.shape, 2), dtype=dtypes.corresponding_real_dtype(a.dtype))

    as_complex = ex.register_operator("cpu_view_as_complex", meta=complex_meta, fn=torch.view_as_complex)
    as_real = ex.register_operator("cpu_view_as_real", meta=real_meta, fn=torch.view_as_real)
    # torch's own backward formulas: a gradient may be non-contiguous, or (complex) an unresolved conjugate
    as_complex_backward = ex.register_operator(
        "cpu_view_as_complex_backward", meta=real_meta, fn=lambda g: torch.view_as_real(g.contiguous().resolve_conj())
    )
    as_real_backward = ex.register_operator(
        "cpu_view_as_real_backward", meta=complex_meta, fn=lambda g: torch.view_as_complex(g.contiguous())
    )

    def view_as_complex_grad(a: Any, /) -> Any:
        out = as_complex(a)
        put_grad(a, as_complex_backward(get_grad(out)))
        return out

    def view_as_real_grad(a: Any, /) -> Any:
        out = as_real(a)
        put_grad(a, as_real_backward(get_grad(out)))
        return out

    ex.register_implementation(
        ltorch.view_as_complex,  # type: ignore[attr-defined]  # (thunder registers it at import)
        checker=_complex_viewable_on_cpu,
        execution_transform=as_complex,
        grad_transform=view_as_complex_grad,
    )
    ex.register_implementation(
        ltorch.view_as_real,  # type: ignore[attr-defined]  # (thunder registers it at import)
        checker=_complex_on_cpu,
        execution_transform=as_real,
        grad_transform=view_as_real_grad,
    )


@installer("speedup", "gelu, silu, layer_norm, complex views and causal SDPA on CPU train with torch's kernels")
def run_cpu_ops_with_torch_kernels() -> None:
    """Put an executor first among thunder's default executors in a program's list (where this fix is active)
    that claims ``gelu``, ``silu`` and ``layer_norm`` of plain CPU tensors, forward and backward, with torch's
    kernels (see :func:`_eager_kernels_executor`), and ``view_as_complex`` / ``view_as_real`` with each other as
    gradients (:func:`_register_complex_views`), and attention without mask or dropout with torch's CPU flash
    kernel (:func:`_register_cpu_flash_attention`). A program whose ``executors=`` list leaves out thunder's
    defaults keeps it; other devices and DTensors are not claimed (nvFuser fuses the decompositions on GPUs)."""
    add_first_executor("run_cpu_ops_with_torch_kernels", _eager_kernels_executor())


# ---------------------------------------------------------------------------------------------------------
# thunder's autograd bridge (thunder 0.2.6 ``executors/torch_autograd.py``): per-call time
# ---------------------------------------------------------------------------------------------------------
class _TorchWithEmptyMetaTensors(types.ModuleType):
    """``torch`` as thunder's autograd bridge sees it, with ``randn(..., device="meta")`` made by ``empty``.

    A meta tensor has no values, so the two are the same tensor; torch's meta ``randn`` runs its Python
    reference implementation (about 36 µs against 2 µs), and the bridge makes one in each training call's
    forward (the dummy linking its two autograd Functions) and one in its backward. Other names are torch's,
    each looked up once and kept (the bridge reads ``torch.Tensor`` once per output and saved tensor)."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)
        return value

    @staticmethod
    def randn(*size: Any, **kwargs: Any) -> torch.Tensor:
        if (
            kwargs.get("device") == "meta"
            and set(kwargs) <= {"device", "dtype", "requires_grad"}
            and _dummies_without_random_numbers()
        ):
            return torch.empty(*size, **kwargs)
        return torch.randn(*size, **kwargs)


def _dummies_without_random_numbers() -> bool:
    """The bridge makes its dummies while a compiled program runs, after the call's compilation: the program
    is a DTensor program when the latest jitted call's is (its backward may see a later call's answer: either
    way the dummy is the same valueless meta tensor, and a meta ``randn`` draws no random numbers)."""
    chosen = mode("make_autograd_dummies_without_random_numbers")
    return chosen == EVERYWHERE or (chosen == IN_DTENSOR_PROGRAMS and running_a_dtensor_program())


@installer("speedup", "thunder's autograd bridge makes its meta dummy tensors with empty, not randn")
def make_autograd_dummies_without_random_numbers() -> None:
    """Each ``thunder.jit`` training call makes two one-element meta tensors with ``torch.randn`` (see
    :class:`_TorchWithEmptyMetaTensors`): the module that does so sees a ``torch`` whose meta ``randn`` is
    ``empty``."""
    from thunder.executors import torch_autograd

    patch(torch_autograd, "torch", _TorchWithEmptyMetaTensors("torch"), expects=expects_identical(torch))
