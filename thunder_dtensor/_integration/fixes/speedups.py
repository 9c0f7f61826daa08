"""Speed-ups of thunder's interpreter and autograd bridge (kind ``speedup``; ``THUNDER_DTENSOR_SPEEDUPS=0`` turns
them off): module calls, partials and thunder's own helpers run outside the interpreter, signatures read once, the
bridge's dummies made without random numbers, thunder's torch.compile executor's regions, and DTensor's sizing of a
``_StridedShard`` while a program is traced. torch's CPU kernels are ``cpu_kernels.py``'s."""

from __future__ import annotations

import contextlib
import dis
import functools
import heapq
import math
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from thunder_dtensor._integration.bootstrap import DISTRIBUTED_AVAILABLE, outside_tracing_modes
from thunder_dtensor._integration.fixes.scoped_entries import add_scoped_lookaside
from thunder_dtensor._integration.fixes.switches import EVERYWHERE, IN_DTENSOR_PROGRAMS, active, mode, switched
from thunder_dtensor._integration.interpreter_calls import interpretable_copy, read_through_interpreter
from thunder_dtensor._integration.program_scope import running_a_dtensor_program
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
    interpreted_call_impl = interpretable_copy(cast(types.FunctionType, call_impl))
    wrap_const, unwrap = interpreter.wrap_const, interpreter.unwrap
    raised = interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED

    def hook_by_id(hooks: Any, hook_id: int) -> Any:
        return interpreter._interpret_call(lambda d, k: d[k], hooks, wrap_const(hook_id))

    def call_star(fn: Any, args: Any, kwargs: Any) -> Any:
        return interpreter._interpret_call(lambda f, a, k: f(*a, **k), fn, args, kwargs)

    def module_call(module: Any, *args: Any, **kwargs: Any) -> Any:
        if not _module_hook_state_is_plain(unwrap(module)):
            return interpreter._interpret_call(interpreted_call_impl, module, *args, **kwargs)
        forward = read_through_interpreter(module, "forward")
        if forward is raised:
            return forward
        user_module = unwrap(module)
        if not (user_module._forward_pre_hooks or user_module._forward_hooks):
            return interpreter._interpret_call(forward, *args, **kwargs)
        wrapped_args = interpreter.wrap_args(args)
        wrapped_kwargs = interpreter.wrap_kwargs(kwargs)
        if user_module._forward_pre_hooks:
            hooks = read_through_interpreter(module, "_forward_pre_hooks")
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
        hooks = read_through_interpreter(module, "_forward_hooks")
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
        func = read_through_interpreter(partial, "func")
        bound = read_through_interpreter(partial, "args")
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
#: builtin ``==`` implementations (identity, and str / int / float / bytes values, subclasses and enums with these
#: mixins included): no side effect, a plain bool or NotImplemented
_PLAIN_EQUALITIES = (object.__eq__, str.__eq__, int.__eq__, float.__eq__, bytes.__eq__)
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
    and prologues are the ones thunder's helpers give. ``k in`` a list or tuple is Python's own ``in`` where
    every ``==`` it makes is a builtin one (see ``search_plain_sequence``). Other types, interpretation
    without provenance tracking and a recorded interpreter history take thunder's path. Each code object is
    also disassembled once (:func:`_dis_disassembling_once_per_code`).
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

    def plainly_compared(value: Any) -> bool:
        equality = type(value).__eq__
        return any(equality is plain for plain in _PLAIN_EQUALITIES)

    def search_plain_sequence(container: Any, candidate: Any, negated: bool) -> Any:
        """``candidate in container`` (``not in`` if ``negated``) for a list or tuple whose items and candidate
        compare plainly, or None.

        thunder's sequence ``__contains__`` interprets ``any(i == k for i in s)`` (a generator frame and a
        comparison per item, about 20 ms for a pair on the first call of transformers' models); where every
        ``==`` involved is a builtin comparison or identity, Python's own ``in`` gives the same bool. The items
        are tracked first (thunder's wrapping, which may turn an input's items into proxies: those take thunder's
        path), and the result gets the provenance thunder gives a dict's ``in``."""
        if not plainly_compared(candidate.value):
            return None
        container.track_items()
        items = [wrapper.value for wrapper in container.item_wrappers or ()]
        if len(items) != len(container.value) or not all(map(plainly_compared, items)):
            return None
        record = interpreter.ProvenanceRecord(
            interpreter.PseudoInst.CONTAINS_OP, inputs=[container.provenance, candidate.provenance]
        )
        return interpreter.wrap((candidate.value in items) != negated, provenance=record)

    def contains(inst: Any, /, stack: Any, **kwargs: Any) -> Any:
        if not (top_is(stack, 1, _SEARCHED_CONTAINERS) and direct()):
            return thunder_contains(inst, stack=stack, **kwargs)
        container = stack.pop_wrapped()
        candidate = stack.pop_wrapped()
        found = None
        if type(container.value) in _UNPACKED_SEQUENCES:
            found = search_plain_sequence(container, candidate, negated=inst.arg == 1)
        if found is None:
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
        func = read_through_interpreter(wrapped, "__func__")
        if func is raised:
            return func
        receiver = read_through_interpreter(wrapped, "__self__")
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


@functools.lru_cache(maxsize=4096)
def _stand_in(filename: str, firstlineno: int, lineno: int, name: str, qualname: str) -> tuple[Any, types.FrameType]:
    """A Python frame that reads as function ``qualname`` of ``filename`` at line ``lineno``: the frame of a
    generator named so, suspended at a ``yield`` on that line (a suspended frame has no ``f_back``), kept with its
    generator. No thread: thunder's helper thread ran its teardown beside the interpreter. The frame holds no
    state of the interpreted call, so one serves every exception at the same place."""
    if lineno <= firstlineno:
        source = "def stand_in(): yield\n"
    else:
        source = "def stand_in():\n" + "\n" * (lineno - firstlineno - 1) + "    yield\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, filename, "exec"), namespace)
    fn = namespace["stand_in"]
    fn.__code__ = fn.__code__.replace(co_firstlineno=firstlineno, co_name=name, co_qualname=qualname)
    generator = fn()
    next(generator)
    return generator, generator.gi_frame


def _stand_in_frame(filename: str, firstlineno: int, lineno: int, name: str, qualname: str) -> types.FrameType:
    return _stand_in(filename, firstlineno, lineno, name, qualname)[1]


@installer("speedup", "an exception leaving an interpreted frame gets its stand-in Python frame without a busy wait")
def make_exception_frames_without_a_busy_wait() -> None:
    """thunder 0.2.6 gives an exception that leaves an interpreted frame a real Python frame for its traceback,
    made on a new thread that the interpreter waits for in a loop holding the GIL, so each one takes a GIL switch
    interval (5 ms): a third of a one-layer Hugging Face model's first call, whose code raises and catches a few
    hundred exceptions (``getattr`` defaults, ``try`` / ``except`` lookups). :func:`_stand_in` makes a frame
    that reads the same (file, function, line) without a thread, once per place."""
    from thunder.core import interpreter

    frame_class = interpreter.InterpreterFrame
    thunders = frame_class.get_or_make_python_frame

    def stand_in(frame: Any) -> types.FrameType:
        code = frame.code
        lineno = frame.positions.lineno if frame.positions is not None else None
        return _stand_in_frame(
            code.co_filename, code.co_firstlineno, lineno or code.co_firstlineno, code.co_name, frame.qualname
        )

    expects = expects_function("thunder.core.interpreter", "self")
    replacement = switched("make_exception_frames_without_a_busy_wait", stand_in, thunders)
    patch(frame_class, "get_or_make_python_frame", replacement, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# thunder's autograd bridge (thunder 0.2.6 ``executors/torch_autograd.py``): per-call time
# ---------------------------------------------------------------------------------------------------------
class _TorchAsSeenBy(types.ModuleType):
    """``torch`` as one of thunder's modules sees it (a subclass replaces some names): every other name is
    torch's, looked up once and kept."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)
        return value


class _TorchWithEmptyMetaTensors(_TorchAsSeenBy):
    """``torch`` as thunder's autograd bridge sees it, with ``randn(..., device="meta")`` made by ``empty``.

    A meta tensor has no values, so the two are the same tensor; torch's meta ``randn`` runs its Python
    reference implementation (about 36 µs against 2 µs), and the bridge makes one in each training call's
    forward (the dummy linking its two autograd Functions) and one in its backward. Other names are torch's,
    each looked up once and kept (the bridge reads ``torch.Tensor`` once per output and saved tensor)."""

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


# ---------------------------------------------------------------------------------------------------------
# thunder's torch.compile executor (thunder 0.2.6 ``executors/torch_compile.py``): per-call time
# ---------------------------------------------------------------------------------------------------------
#: layouts one region compiles for before it hands its calls to ``torch.compile`` (whose guards recompile)
_LAYOUTS_PER_REGION = 4


def _layout(args: tuple) -> tuple | None:
    """The shapes and strides of ``args`` (what inductor's code asserts on entry), or None when one is not a
    plain tensor (a number would be a constant of the graph)."""
    layout = []
    for a in args:
        if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
            return None
        layout.append((a.shape, a.stride()))
    return tuple(layout)


class _InductorRegion:
    """One region of thunder's torch.compile executor, compiled by inductor without dynamo.

    The region is a straight-line program of torch calls that thunder has already traced, specialized and
    guarded (its prologue checks the program's inputs), so dynamo's frame evaluation, its guards and its own
    wrapper around each call buy nothing: on a tensor-parallel Llama step (one forward and one backward region)
    they cost about 0.2 ms of main-thread CPU a call. The region is traced once to ATen (``make_fx`` on fake
    tensors: no collective runs) and compiled by ``torch._inductor.compile`` for the shapes and strides of its
    first call (the only thing inductor's code asserts that thunder's prologue does not check: a program input's
    strides); another layout compiles again, up to ``_LAYOUTS_PER_REGION``. A region that takes a number, that
    cannot be traced this way, that calls an in-place c10d collective, or that has had that many layouts runs
    ``torch.compile`` as thunder does."""

    def __init__(self, fn: Callable, by_dynamo: Callable) -> None:
        self.fn, self.by_dynamo = fn, by_dynamo
        self.compiled: dict[tuple, Callable] = {}
        self.use_dynamo = False

    def __call__(self, *args: Any) -> Any:
        if not self.use_dynamo:
            layout = _layout(args)
            compiled = self.compiled.get(layout) if layout is not None else None
            if compiled is None and layout is not None and len(self.compiled) < _LAYOUTS_PER_REGION:
                compiled = self._compile(args)
                if compiled is not None:
                    self.compiled[layout] = compiled
            if compiled is not None:
                return compiled(*args)
            self.use_dynamo = True
        return self.by_dynamo(*args)

    def _compile(self, args: tuple) -> Callable | None:
        from torch._inductor import compile as inductor_compile
        from torch.fx.experimental.proxy_tensor import make_fx

        try:
            graph = make_fx(self.fn, tracing_mode="fake")(*args)
            if any(_calls_a_process_group_op(node) for node in graph.graph.nodes):
                return None
            return inductor_compile(graph, list(args))
        except Exception:  # what dynamo can take and this cannot: thunder's own path, as before
            return None


def _calls_a_process_group_op(node: Any) -> bool:
    """Whether ``node`` calls one of c10d's in-place collectives on a process group object (thunder's own
    ``torch.distributed.all_reduce``, which transformers' tensor parallelism calls on local tensors): dynamo
    rewrites them into functional collectives, ``make_fx`` keeps them as they are."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "c10d"


class _TorchCompilingRegionsDirectly(_TorchAsSeenBy):
    """``torch`` as thunder's torch.compile executor sees it: ``compile`` of a region, in a program where
    :func:`compile_fused_regions_without_dynamo` acts, is an :class:`_InductorRegion` (keyword options other
    than ``fullgraph``, a ``mode`` say, keep ``torch.compile``). Other names are torch's."""

    @staticmethod
    def compile(fn: Callable, **options: Any) -> Callable:
        by_dynamo = torch.compile(fn, **options)
        plain = options.get("mode") is None and set(options) <= {"mode", "fullgraph"}
        if plain and active("compile_fused_regions_without_dynamo"):
            return _InductorRegion(fn, by_dynamo)
        return by_dynamo


@installer("speedup", "thunder's torch.compile executor compiles its regions with inductor, without dynamo")
def compile_fused_regions_without_dynamo() -> None:
    """Each region of thunder's torch.compile executor (``executors=[torch_compile_ex, ...]``: the whole lowered
    forward or backward, collectives included) is compiled by inductor directly (:class:`_InductorRegion`): the
    executor's module sees a ``torch`` whose ``compile`` makes one."""
    from thunder.executors import torch_compile

    patch(torch_compile, "torch", _TorchCompilingRegionsDirectly("torch"), expects=expects_identical(torch))


# ---------------------------------------------------------------------------------------------------------
# Fusion regions keep the program's order (thunder 0.2.6 ``thunder.core.rematerialization`` layout)
# ---------------------------------------------------------------------------------------------------------
def in_stable_topological_order(bsyms: Sequence[Any]) -> list:
    """``bsyms`` moved only as far as their data dependences require: each symbol as early as its inputs allow,
    ready ones taken in their order in ``bsyms`` (a list already in dependence order comes back unchanged)."""
    producer = {p.name: i for i, b in enumerate(bsyms) for p in b.flat_proxy_outs}
    waiting_on: list[int] = []
    readers: list[list[int]] = [[] for _ in bsyms]
    for i, b in enumerate(bsyms):
        inputs = {producer[p.name] for p in b.flat_proxy_args if producer.get(p.name, i) != i}
        waiting_on.append(len(inputs))
        for j in inputs:
            readers[j].append(i)
    ready = [i for i, n in enumerate(waiting_on) if n == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        i = heapq.heappop(ready)
        ordered.append(bsyms[i])
        for j in readers[i]:
            waiting_on[j] -= 1
            if waiting_on[j] == 0:
                heapq.heappush(ready, j)
    if len(ordered) != len(bsyms):
        raise RuntimeError("in_stable_topological_order: the symbols' data dependences have a cycle")
    return ordered


@installer("speedup", "a fusion region that rematerialization rebuilds keeps the program's order of its symbols")
def keep_fused_regions_in_program_order() -> None:
    """thunder's rematerialization, run by each fusion executor's pass, rebuilds a region that takes recomputed
    producers in with a bottom-up topological sort of the whole region: each symbol as late as its readers
    allow. Work no later symbol reads (weight gradients, FSDP2's reduce-scatters) then sinks to the region's end,
    and whatever depends only on the region's inputs (FSDP2's all-gathers) rises to its start. In a lowered FSDP2
    backward under thunder's torch.compile executor that held every block's gathered parameters and unsharded
    gradients at once (1.9x eager FSDP2's peak memory at H=512) and issued the reduce-scatters after all the
    compute. The region now keeps the program's order: the recomputed symbols first, then the region's own, each
    moved only where its inputs require (:func:`in_stable_topological_order`)."""
    from thunder.core import rematerialization

    original = rematerialization.apply_rematerialization_for_consumer

    def in_program_order(producer: Any, consumer: Any, cut: Any) -> Any:
        rebuilt: Any = original(producer, consumer, cut)
        if rebuilt is consumer:
            return rebuilt
        own = {id(b) for b in consumer.subsymbols}
        position = {id(b): k for k, b in enumerate(producer.subsymbols)}
        recomputed = sorted((b for b in rebuilt.subsymbols if id(b) not in own), key=lambda b: position.get(id(b), -1))
        return rebuilt.from_bsym(subsymbols=in_stable_topological_order([*recomputed, *consumer.subsymbols]))

    expects = expects_function("thunder.core.rematerialization", "producer", "consumer", "cut")
    kept = switched("keep_fused_regions_in_program_order", in_program_order, original)
    patch(rematerialization, "apply_rematerialization_for_consumer", kept, expects=expects)


# ---------------------------------------------------------------------------------------------------------
# What a backward region keeps from its forward (thunder 0.2.6 ``rematerialization.find_cut``)
# ---------------------------------------------------------------------------------------------------------
#: a producer output at least this many times smaller than its symbol's tensor inputs is kept, not recomputed
_SMALL_OUTPUT_RATIO = 4


def _numel(proxy: Any) -> int:
    return math.prod(int(s) for s in proxy.shape)


def _read_through_views(value: Any, made_in_consumer: dict[str, Any]) -> Any:
    """The value ``value`` is a view of, following the consumer's own shape ops back (a reshape of a reshape of
    a forward value: that forward value)."""
    from thunder.core.prims import OpTags
    from thunder.core.proxies import TensorProxy
    from thunder.core.symbol import has_tags

    while value.name in made_in_consumer:
        source = made_in_consumer[value.name]
        tensors = [a for a in source.flat_proxy_args if isinstance(a, TensorProxy)]
        if len(tensors) != 1 or not has_tags(source, {OpTags.SHAPE_OP}):
            break
        value = tensors[0]
    return value


def values_to_keep_for_the_consumer(producer: Any, consumer: Any) -> tuple:
    """The producer region's values that a consumer region should read rather than recompute, as torch's own
    partitioner bans their recomputation: (1) what a matmul of the consumer reads (through views) is written to
    memory in the consumer either way, so recomputing it only adds work and, under inductor, a kernel of its own
    (a gelu recomputed for the weight gradient of the linear after it); (2) an output at least
    ``_SMALL_OUTPUT_RATIO`` times smaller than its symbol's tensor inputs (a norm's mean and rstd) costs little to
    keep and a pass over the inputs to recompute. A symbol with several outputs has all of them kept once one is:
    recomputing it for the others would make the kept one a second time."""
    from thunder.core.prims import OpTags
    from thunder.core.proxies import TensorProxy
    from thunder.core.symbol import has_tags

    maker = {o.name: b for b in producer.subsymbols for o in b.flat_proxy_outs if isinstance(o, TensorProxy)}
    made_in_consumer = {o.name: b for b in consumer.subsymbols for o in b.flat_proxy_outs}
    kept_makers: dict[int, Any] = {}
    for bsym in consumer.subsymbols:
        if not has_tags(bsym, {OpTags.MATMUL_OP}):
            continue
        for arg in bsym.flat_proxy_args:
            if isinstance(arg, TensorProxy):
                source = _read_through_views(arg, made_in_consumer)
                if source.name not in made_in_consumer and source.name in maker:
                    kept_makers[id(maker[source.name])] = maker[source.name]
    for bsym in producer.subsymbols:
        inputs = sum(_numel(a) for a in bsym.flat_proxy_args if isinstance(a, TensorProxy))
        outputs = [o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)]
        if any(_numel(o) * _SMALL_OUTPUT_RATIO < inputs for o in outputs):
            kept_makers[id(bsym)] = bsym
    kept = {o.name: o for b in kept_makers.values() for o in b.flat_proxy_outs if isinstance(o, TensorProxy)}
    return tuple(kept.values())


@installer("speedup", "a backward region reads what torch's partitioner would not recompute from the forward")
def keep_what_backward_regions_materialize() -> None:
    """thunder's rematerialization (each fusion executor's pass) cuts the forward region from the backward one at
    the fewest bytes, recomputing whatever is cheaper to pass on that way: under thunder's torch.compile executor
    the backward recomputed a block's gelu (for the next linear's weight gradient, a matmul: the value is written
    out again) and its layer norm (for the norm's mean and rstd). Each such recomputation is work in every step
    and, under inductor, often a kernel of its own to compile. The cut now keeps what
    :func:`values_to_keep_for_the_consumer` names, as torch's partitioner does (the forward region outputs them),
    and cuts the rest at the fewest bytes as before."""
    from thunder.core import rematerialization

    original = rematerialization.find_cut

    def keeping(external_producer_outputs: Any, producer: Any, consumer: Any) -> Any:
        already = {p.name for p in external_producer_outputs if p is not None}
        kept = tuple(p for p in values_to_keep_for_the_consumer(producer, consumer) if p.name not in already)
        return original((*external_producer_outputs, *kept), producer, consumer)

    expects = expects_function("thunder.core.rematerialization", "external_producer_outputs", "producer", "consumer")
    patch(
        rematerialization,
        "find_cut",
        switched("keep_what_backward_regions_materialize", keeping, original),
        expects=expects,
    )


# ---------------------------------------------------------------------------------------------------------
# A ``_StridedShard``'s local size (torch 2.13 ``distributed/tensor/placement_types.py``): first-call time
# ---------------------------------------------------------------------------------------------------------
def _plain_ints(*numbers: Any) -> bool:
    return all(type(n) is int for n in numbers)


@installer("speedup", "a _StridedShard's local size and offsets are computed on real tensors while a program is traced")
def size_strided_shards_outside_tracing() -> None:
    """torch computes a ``_StridedShard``'s local size and offsets (``local_shard_size_and_offset``, which its
    redistribution planner and sharding strategies ask) by splitting a ``torch.arange`` and reading it back with
    ``tolist``. The lowering traces DTensor's dispatch on fake tensors, so there each read made unbacked symbols,
    each with a captured traceback: 0.1-0.25 s a call, 20 s of one 2x2-mesh program's 25 s of tracing. The answer
    depends only on the integer arguments, so with integers it runs outside the tracing modes, as in eager."""
    if not DISTRIBUTED_AVAILABLE:
        return
    from torch.distributed.tensor import placement_types

    strided = getattr(placement_types, "_StridedShard", None)
    torchs = vars(strided).get("local_shard_size_and_offset") if strided is not None else None
    if torchs is None:  # a release that sizes it otherwise
        return

    def on_real_tensors(self: Any, curr_local_size: Any, num_chunks: Any, rank: Any, *args: Any, **kwargs: Any) -> Any:
        if _plain_ints(curr_local_size, num_chunks, rank):
            with outside_tracing_modes():
                return torchs(self, curr_local_size, num_chunks, rank, *args, **kwargs)
        return torchs(self, curr_local_size, num_chunks, rank, *args, **kwargs)

    expects = expects_function("torch.distributed.tensor", "self", "curr_local_size", "num_chunks", "rank")
    replacement = switched("size_strided_shards_outside_tracing", on_real_tensors, torchs)
    patch(strided, "local_shard_size_and_offset", replacement, expects=expects)
