"""Which programs are DTensor programs: the scope of everything this package changes in thunder.

A program is a DTensor program when the call being compiled has a DTensor among its arguments, is a module
with DTensor parameters or buffers (tensor parallelism, FSDP2) or a function whose closure holds one, is
called inside torch's ``context_parallel`` (its attention makes DTensors), runs inside a thunderfx call that
does, or traced a DTensor (its executors list then holds the dtensor executors). DTensor machinery and, by
default, the thunder fixes of :mod:`thunder_dtensor._integration.fixes` act within such programs only; every
other program compiles as thunder alone compiles it.

The answer for a call is computed when something first asks during that call's compilation (a call that hits
thunder's cache asks nothing) and kept for the rest of the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any, cast

from thunder_dtensor._integration.context_parallel import context_parallel_dispatch_enabled
from thunder_dtensor._integration.registry import expects_function, installer, patch

import torch

#: the executors of dtensor prims: a program's executors list gets them when it traces a DTensor
_DTENSOR_EXECUTORS: list[Any] = []


def add_dtensor_executor(executor: Any) -> None:
    """``executor`` runs dtensor prims: programs that trace a DTensor get it after their own executors, whatever
    executors the user passed (as thunder's always executors); other programs never see it."""
    _DTENSOR_EXECUTORS.append(executor)


def _compile_data() -> Any:
    from thunder.core.compile_data import get_compile_data

    return get_compile_data()


def _has_dtensor_executors(cd: Any) -> bool:
    # by identity: ``in`` would call each executor's ``__eq__`` (Python), on every call of a jitted function
    return bool(_DTENSOR_EXECUTORS) and any(ex is _DTENSOR_EXECUTORS[0] for ex in cd.executors_list)


def traced_a_dtensor(cd: Any = None) -> bool:
    """Whether the program being compiled (or ``cd``'s) traced a DTensor (its executors list has the dtensor
    executors)."""
    cd = cd if cd is not None else _compile_data()
    return cd is not None and _has_dtensor_executors(cd)


def use_dtensor_executors() -> None:
    """The program being compiled traces a DTensor: add the dtensor executors to its executors list (once), and
    the fixes' first executors where they act in DTensor programs."""
    from thunder.extend import add_executor_lists

    cd = _compile_data()
    if cd is not None and _DTENSOR_EXECUTORS and not _has_dtensor_executors(cd):
        cd.executors_list = add_executor_lists(cd.executors_list, _DTENSOR_EXECUTORS)
        _add_first_executors(cd, everywhere_only=False)


#: (fix, executor, ahead of torch.compile): put first among a program's default executors where the fix acts
_FIRST_EXECUTORS: list[tuple[str, Any, bool]] = []


def add_first_executor(fix: str, executor: Any, *, ahead_of_torch_compile: bool = False) -> None:
    """Where ``fix`` acts, ``executor`` goes first among the executors of a program that did not choose its own.
    ``ahead_of_torch_compile``: every op the executor claims with is in thunder's torch.compile executor's table,
    so where a program lists that executor before thunder's defaults, this one goes just before it: its
    gradient rules and ops are the program's, and the torch.compile regions still take them."""
    _FIRST_EXECUTORS.append((fix, executor, ahead_of_torch_compile))
    on_each_call("first_executors", _add_first_executors_acting_everywhere)


def _add_first_executors_acting_everywhere(cd: Any, args: tuple, kwargs: dict) -> None:
    _add_first_executors(cd, everywhere_only=True)


def _add_first_executors(cd: Any, *, everywhere_only: bool) -> None:
    for fix, executor, ahead_of_torch_compile in _FIRST_EXECUTORS:
        chosen = _switches.mode(fix)
        if (
            chosen == _switches.OFF
            or (everywhere_only and chosen != _switches.EVERYWHERE)
            or executor in cd.executors_list
        ):
            continue
        from thunder.executors.torch_compile import torch_compile_ex
        from thunder.extend import get_default_executors

        # where the program's list holds thunder's default executors (after thunder.jit's ad hoc executor, or the
        # user's own: ``[torch_compile_ex, *thunder.get_default_executors()]``), first among them
        executors, defaults = list(cd.executors_list), list(get_default_executors())
        for i in range(len(executors) - len(defaults) + 1):
            if executors[i : i + len(defaults)] == defaults:
                ahead = ahead_of_torch_compile and torch_compile_ex in executors[:i]
                at = executors.index(torch_compile_ex) if ahead else i
                cd.executors_list = (*executors[:at], executor, *executors[at:])
                break


def add_program_executor(executor: Any) -> None:
    """The program being compiled uses ``executor`` (a fix's): it joins its executors list, after its own."""
    from thunder.extend import add_executor_lists

    cd = _compile_data()
    if cd is not None and executor not in cd.executors_list:
        cd.executors_list = add_executor_lists(cd.executors_list, [executor])


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _module_holds_dtensors(module: torch.nn.Module) -> bool:
    """DTensor parameters or buffers, or FSDP2 modules: their parameters are plain tensors while unsharded,
    between a forward and its backward, which a pipeline schedule's micro-batches straddle."""
    if any(_is_dtensor(t) for t in (*module.parameters(), *module.buffers())):
        return True
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _captured(fn: types.FunctionType) -> Iterator[Any]:
    """What ``fn``'s closure holds (a step function closing over its model)."""
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue


def has_dtensor_inputs(fn: Any, args: tuple, kwargs: dict) -> bool:
    """A DTensor among ``args`` / ``kwargs``, or ``fn`` a module that holds DTensors (or FSDP2 modules), or a
    function whose closure holds a DTensor or such a module."""
    if not torch.distributed.is_available():
        return False
    if context_parallel_dispatch_enabled():  # inside torch's context_parallel: its attention makes DTensors
        return True
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    if any(_is_dtensor(v) for v in leaves):
        return True
    # a ThunderModule's user module, torch.compile's module (thunderfx's) or a function's own (its wrapper's)
    fn = getattr(fn, "_orig_mod", fn)
    module = getattr(fn, "_model", fn)
    if isinstance(module, torch.nn.Module):
        return _module_holds_dtensors(module)
    if callable(fn):
        with contextlib.suppress(ValueError):  # (a cycle of __wrapped__)
            fn = inspect.unwrap(fn)
    if isinstance(fn, types.FunctionType):
        return any(
            _is_dtensor(v) or (isinstance(v, torch.nn.Module) and _module_holds_dtensors(v)) for v in _captured(fn)
        )
    return False


def holds_dtensors(values: tuple) -> bool:
    """A DTensor among ``values``, or a module among them with DTensor parameters or buffers."""
    return has_dtensor_inputs(None, values, {}) or any(
        isinstance(v, torch.nn.Module) and _module_holds_dtensors(v) for v in values
    )


class _Call:
    """One call of a jitted function: its arguments, and the answer once asked."""

    __slots__ = ("answer", "args", "cd", "kwargs")
    answer: bool | None
    args: tuple
    cd: Any
    kwargs: dict

    def __init__(self, cd: Any, args: tuple, kwargs: dict) -> None:
        self.cd, self.args, self.kwargs, self.answer = cd, args, kwargs, None

    def has_dtensor_inputs(self) -> bool:
        if self.answer is None:
            self.answer = self.cd is not None and has_dtensor_inputs(self.cd.fn, self.args, self.kwargs)
        return self.answer


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("thunder_dtensor_call", default=None)
#: whether the program the latest jitted call chose (thunder runs it right after) is a DTensor program: read while
#: it runs, where no compile data or call is current (thunder's autograd bridge)
_RUNNING_A_DTENSOR_PROGRAM: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "thunder_dtensor_running", default=False
)


def running_a_dtensor_program() -> bool:
    """Whether the program of the latest jitted call is a DTensor program: exact while that program runs (its
    forward); its backward, called later by torch's autograd, sees the latest call's answer instead."""
    return _RUNNING_A_DTENSOR_PROGRAM.get()


#: name -> handler(compile data, args, kwargs), run in this order as each call of a jitted function starts
#: (before thunder's cache lookup): one wrapper of thunder's slot serves every concern that needs the call's start
_CALL_START: dict[str, Callable[[Any, tuple, dict], None]] = {}


def on_each_call(name: str, handler: Callable[[Any, tuple, dict], None]) -> None:
    """Run ``handler(cd, args, kwargs)`` as each call of a jitted function starts (once per ``name``)."""
    _CALL_START[name] = handler


#: during a call of a thunderfx-compiled function: whether it runs a DTensor program, asked lazily
IN_THUNDERFX_DTENSOR_CALL: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "thunder_dtensor_in_call", default=None
)


def in_dtensor_program() -> bool:
    """Whether the program being compiled (or the thunderfx call running) is a DTensor program."""
    cd, call = _compile_data(), _CALL.get()
    if cd is None and call is not None:  # running this call's program (no compilation under way)
        cd = call.cd
    if cd is not None and _has_dtensor_executors(cd):
        return True
    if call is not None and call.cd is cd and call.has_dtensor_inputs():
        return True
    in_thunderfx_call = IN_THUNDERFX_DTENSOR_CALL.get()
    return in_thunderfx_call is not None and in_thunderfx_call()


def jitted_function_compile_data(fn: Callable) -> Callable[[], Any] | None:
    """The ``weakref_cd`` closure cell of a jitted function's ``get_computation_and_inputs`` (None for others)."""
    names = fn.__code__.co_freevars
    if "weakref_cd" not in names:  # not a jitted function's (thunderfx's splitter tests ops through it too)
        return None
    return cast(tuple[types.CellType, ...], fn.__closure__)[names.index("weakref_cd")].cell_contents


def _nested_code(code: types.CodeType) -> Iterator[types.CodeType]:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const
            yield from _nested_code(const)


def wraps_jitted_functions_with_compile_data(original: Any) -> str | None:
    """thunder 0.2.6's ``_with_cache_info_ctx(fn)``, which ``thunder.jit`` applies to a function of its own that
    holds the compile data as the closure cell ``weakref_cd`` (or a wrapper of ours over it)."""
    import thunder

    wanted = expects_function(("thunder", "thunder_dtensor"), "fn")(original)
    jit_closures = {code.co_name: code.co_freevars for code in _nested_code(thunder.jit.__code__)}
    if wanted is None and "weakref_cd" in jit_closures.get("get_computation_and_inputs", ()):
        return None
    return "thunder's _with_cache_info_ctx(fn), applied by thunder.jit to get_computation_and_inputs (weakref_cd)"


@installer("dtensor", "each call of a jitted function is noted, so that what asks can tell a DTensor program")
def note_each_call() -> None:
    """``thunder._with_cache_info_ctx``, which wraps each jitted function's ``get_computation_and_inputs`` when
    ``thunder.jit`` builds it, notes each call's compile data and arguments for :func:`in_dtensor_program`
    (no work unless something asks), after running the handlers of :func:`on_each_call`."""
    import thunder

    with_cache_info_ctx = thunder._with_cache_info_ctx

    def noting(fn: Callable) -> Callable:
        wrapped = with_cache_info_ctx(fn)
        weakref_cd = jitted_function_compile_data(fn)
        if weakref_cd is None:
            return wrapped

        @functools.wraps(wrapped)
        def call(*args: Any, **kwargs: Any) -> Any:
            cd = weakref_cd()
            if cd is not None:
                for handler in _CALL_START.values():
                    handler(cd, args, kwargs)
            token = _CALL.set(_Call(cd, args, kwargs))
            try:
                found = wrapped(*args, **kwargs)
            finally:
                _CALL.reset(token)
            _RUNNING_A_DTENSOR_PROGRAM.set(cd is not None and _has_dtensor_executors(cd))
            return found

        return call

    patch(thunder, "_with_cache_info_ctx", noting, expects=wraps_jitted_functions_with_compile_data)


from thunder_dtensor._integration.fixes import switches as _switches  # noqa: E402  (it reads this module's names)
