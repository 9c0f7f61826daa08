"""thunder's hooks and tables: torch functions, methods, lookasides, autodiff's DTensor hooks, the
root module's state, in-place alias updates and the compiled-program hook (thunder 0.2.6 layout)."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor._integration.attribute_reads import on_attribute_read
from thunder_dtensor._integration.bootstrap import (
    BoundSymbol,
    DeviceMesh,
    DTensor,
    DTensorSpec,
    NumberProxy,
    OpTags,
    Partial,
    Placement,
    Proxy,
    Replicate,
    Shard,
    Symbol,
    TraceCtx,
    check,
    from_trace,
    get_compile_data,
    local_tensor,
    ltorch,
    prims,
    pyval,
    thunder,
    tracectx,
)
from thunder_dtensor._integration.fixes.switches import active, declare_fix
from thunder_dtensor._integration.functionalize import ViewWriteEmitter, functionalize_writes_into_views
from thunder_dtensor._integration.registry import (
    GRAD_RULES,
    JIT_LOOKASIDES,
    add_entry,
    expects_absent,
    expects_function,
    expects_identical,
    expects_instance,
    expects_qualified,
    installer,
    patch,
)

import torch


# ---------------------------------------------------------------------------------------------------------
# Hooks into thunder's core
# ---------------------------------------------------------------------------------------------------------
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


def is_unknown_torch_function(fn: Any) -> bool:
    """A public, functional, opaque torch function thunder has no symbol for (``jit_ext.general_jit_lookaside``
    raises "not yet supported" for it): on a DTensor, the generic fallback may run it."""
    from thunder.core import jit_ext

    return (
        jit_ext.is_opaque(fn)
        and fn not in jit_ext._general_jit_lookaside_map
        and fn not in ltorch._torch_to_thunder_function_map
        and str(getattr(fn, "__module__", None) or "").startswith("torch")
        and _is_public_functional_name(getattr(fn, "__name__", ""))
    )


@installer("dtensor", "a torch call or Tensor method with a DTensor argument reaches a dtensor symbol")
def route_dtensor_calls(
    may_route: Callable[[Any], bool],
    function_route: Callable[[Any, list, dict], Callable | None],
    method_route: Callable[[str, tuple, dict], Callable | None],
) -> None:
    """Dispatch on the proxy: thunder's tables keep thunder's entries, and two lookups ask this package first.

    * the interpreter's lookaside (``jit_ext.general_jit_lookaside``): for a callable ``may_route(fn)`` accepts
      (a cheap test: the interpreter asks for every call it makes), ``function_route(fn, args, kwargs)`` (the
      call's values) returns the dtensor callable that runs the call, or None to leave it to thunder;
    * the torch language context's method lookup (``x.mul(y)``, ``x * y`` on proxies): ``method_route(name,
      args, kwargs)``, likewise.

    Each route answers None unless an argument is a DTensorProxy (or the function exists only for DTensors), so
    a plain program's calls reach exactly what thunder has. An executor's own lookaside for ``fn`` still wins.
    """
    from thunder.core import jit_ext
    from thunder.torch.langctx import TorchCtx

    original_lookaside = jit_ext.general_jit_lookaside
    lookasides: dict[int, tuple[Callable, Callable]] = {}  # id(dtensor callable) -> (it, its lookaside)

    def lookaside_of(target: Callable) -> Callable:
        entry = lookasides.get(id(target))
        if entry is None or entry[0] is not target:
            wrapped = jit_ext.interpreter_needs_wrap(jit_ext.record_source_loc_in_symbol_header(target))
            entry = lookasides[id(target)] = (target, jit_ext.ensure_recursive_proxies(wrapped))
        return entry[1]

    def lookaside(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            candidate = may_route(fn)
        except TypeError:  # an unhashable callable: no route
            candidate = False
        if candidate and not _has_executor_lookaside(fn):
            target = function_route(fn, *_unwrapped(args, kwargs))
            if target is not None:
                return lookaside_of(target)
        return original_lookaside(fn, *args, **kwargs)

    expects = expects_function(("thunder.core.jit_ext", "thunder_dtensor"), "fn")  # thunder's, or a fix over it
    patch(jit_ext, "general_jit_lookaside", lookaside, expects=expects)

    original_get_method = TorchCtx.get_method

    def get_method(self: Any, id: str, *args: Any, **kwargs: Any) -> Callable:
        target = method_route(id, args, kwargs)
        return target if target is not None else original_get_method(self, id, *args, **kwargs)

    expects = expects_function(("thunder.torch.langctx", "thunder_dtensor"), "self", "id")  # thunder's, or ours over it
    patch(TorchCtx, "get_method", get_method, expects=expects)


def register_grad(symbol: Any, rule: Callable, *, owner: str = "primitive.grad_rules", kind: str = "dtensor") -> None:
    """thunder's ``register_grad`` for a symbol of this package's, through the registry (listed, undoable)."""
    from thunder.core import transforms
    from thunder.core.langctxs import Languages, langctx

    key = symbol.id if isinstance(symbol, Symbol) else symbol
    rule = langctx(Languages.TORCH)(rule)  # as thunder's register_grad: rules are written in torch's language
    why = "the grad rule of a symbol of this package's"
    add_entry(transforms._grad_fn_map, key, rule, table_name=GRAD_RULES, owner=owner, reason=why, kind=kind)


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
    return ltorch.torchsymbol(id=f"thunder_dtensor.{symbol.name}", allow_tensor_subclass_proxy=True)(
        cast(Callable, unguarded)  # (a torch symbol has a meta)
    )


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


@installer("dtensor", "thunder's hooks for its experimental DTensor path call this package instead")
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

    experimental = "thunder.torch.experimental"
    # thunder.core.proxies.proxy() imports this name at call time
    patch(thunder_dtensor_proxy, "proxify_dtensor", proxify, expects=expects_function(experimental, "x"))
    # jit_ext imported these names at module level: they are rebound there
    patch(jit_ext, "is_dtensor_proxy", is_dtensor_proxy, expects=expects_function(experimental, "x"))
    patch(jit_ext, "check_dtensor_spec_repr", spec_check_prim, expects=expects_instance(Symbol))
    patch(
        jit_ext,
        "handle_check_dtensor_spec_in_prologue",
        prologue_spec_check,
        expects=expects_function(experimental, "prim", "prologue_trace", "args"),
    )
    # autodiff imports this at call time
    patch(
        thunder_dtensor_utils,
        "check_dtensor_cotangent_metadata_in_backward",
        backward_cotangent_check,
        expects=expects_function(experimental, "bw_trace"),
    )
    patch(
        autodiff,
        "ltorch",
        _AutodiffTorchNamespace(cotangent_add, bind_dtensor_zeros),
        expects=expects_identical(ltorch),
        reason="autodiff sums cotangents and makes zero cotangents of DTensors as DTensors",
    )
    # thunder.__init__ imports this at call time: the joint forward-backward trace passes through our check
    grad_transform_on_trace = autodiff.grad_transform_on_trace

    @functools.wraps(grad_transform_on_trace)
    def checked_grad_transform_on_trace(trace: TraceCtx, *args: Any, **kwargs: Any) -> TraceCtx:
        return joint_trace_check(grad_transform_on_trace(trace, *args, **kwargs))

    patch(
        autodiff,
        "grad_transform_on_trace",
        checked_grad_transform_on_trace,
        expects=expects_function("thunder.transforms.autodiff", "trace"),
        reason="the joint forward-backward trace gets the gradients' DTensor specs",
    )


@installer("dtensor", "a DTensor's cotangent proxy has the cotangent's spec (a Partial value's is a full value)")
def set_cotangent_proxy_factory(make_cotangent: Callable) -> None:
    """Make ``prims.get_grad`` (the cotangent of a value) build DTensor cotangents with ``make_cotangent``.

    thunder's meta copies the value's proxy type and metadata; a Partial DTensor's cotangent, though, arrives
    as a full value. ``make_cotangent(a)`` returns the proxy to use, or None for thunder's default.
    """
    default_meta = prims.get_grad.meta

    @functools.wraps(default_meta)  # (traces print the symbol's module from its meta's: thunder's prims)
    def get_grad_meta(a: Any, /) -> Any:
        cotangent = make_cotangent(a)
        return default_meta(a) if cotangent is None else cotangent

    patch(prims.get_grad, "meta", get_grad_meta, expects=expects_function("thunder.core.prims", "a"), frozen=True)


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


@installer("dtensor", "isinstance(x, DTensor) is True for a DTensor's proxy in jitted code (TP hooks branch on it)")
def make_isinstance_see_dtensor_proxies(proxy_type: type) -> None:
    """Inside jitted code, ``isinstance(x, DTensor)`` is True for a DTensor's proxy, and ``isinstance(p,
    nn.Parameter)`` for a DTensor parameter's (``named_parameters()`` inside the program checks it).

    Tensor-parallel hooks branch on it (``if not isinstance(x, DTensor): x = DTensor.from_local(...)``);
    thunder's own isinstance lookaside answers as for a plain tensor.
    """
    from thunder.core import interpreter, jit_ext

    thunder_isinstance = jit_ext._general_jit_lookaside_map[isinstance]

    def dtensor_aware_isinstance(obj: Any, cls: Any) -> Any:
        value, classes = interpreter.unwrap(obj), interpreter.unwrap(cls)
        if isinstance(value, proxy_type):
            classes = tuple(interpreter.unwrap(c) for c in classes) if isinstance(classes, tuple) else (classes,)
            real = getattr(obj, "original_value", None)
            if isinstance(real, DTensor):  # read from outside: a DTensor parameter is an nn.Parameter, as in eager
                answer = isinstance(real, classes)
            elif any(isinstance(c, type) and issubclass(DTensor, c) for c in classes):
                answer = True
            else:
                return thunder_isinstance(obj, cls)
            record = interpreter.ProvenanceRecord(
                interpreter.PseudoInst.LOOKASIDE,
                inputs=[interpreter.wrap_const(isinstance).provenance, obj.provenance, cls.provenance],
            )
            return interpreter.wrap(answer, provenance=record)
        return thunder_isinstance(obj, cls)

    lookasides = jit_ext._general_jit_lookaside_map
    patch(
        lookasides,
        isinstance,
        dtensor_aware_isinstance,
        table=JIT_LOOKASIDES,
        expects=expects_function("thunder.core", "obj"),
    )


@installer("dtensor", "a DTensor proxy's conversions to Python values run whole in jitted code (they raise)")
def call_proxy_conversions_whole(proxy_type: type) -> None:
    """``bool(x)``, ``float(x)``, ... of a DTensor's proxy call the proxy's own method whole: it raises the error
    that names the op and the placements, which needs the real types (inside the interpreter a DTensor's proxy
    answers ``isinstance`` as the DTensor it stands for)."""
    from thunder.core import jit_ext

    for name in ("__bool__", "__float__", "__int__", "__complex__", "__index__"):
        method = vars(proxy_type)[name]
        patch(
            jit_ext._general_jit_lookaside_map,
            method,
            jit_ext.interpreter_needs_wrap(method),
            table=JIT_LOOKASIDES,
            expects=expects_absent,
        )


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


def _placement_classes() -> list[type]:
    """Every Python placement class defined so far (``Placement``'s subclasses, not the pybind11 bases they
    extend), the public three first."""
    found: list[type] = []

    def walk(cls: type) -> None:
        sub: type
        for sub in cls.__subclasses__():
            if not sub.__module__.startswith("torch._C") and sub not in found:
                found.append(sub)
            walk(sub)

    import torch.distributed.tensor._ops._math_ops  # noqa: F401  (defines _NormPartial)

    walk(Placement)
    return [Shard, Replicate, Partial, *(c for c in found if c not in (Shard, Replicate, Partial))]


@installer("dtensor", "placements are built, and device meshes queried, whole: stepping into them aborts or costs")
def make_placements_opaque() -> None:
    """Let jitted code build placements (``Shard(1)``, ``Replicate()``) and ask a device mesh about itself: the
    interpreter calls these whole.

    Placements are Python subclasses of pybind11 classes; stepping into their construction aborts the
    process. Dynamo graphs handed over by thunderfx spell every placement as such a call: every placement class,
    the private ones too (``_StridedShard``, which a flatten's output carries, aborted fuzz seed 11805 under
    thunderfx; ``_MaskPartial``, ``_NormPartial``). A mesh's queries (``mesh.size(0)``, ``mesh.get_group()``,
    ...) read fixed process-group state: stepping through their Python code costs first-call time and changes
    nothing in the program.
    """
    from thunder.core import jit_ext

    mesh_queries = ("size", "get_group", "get_local_rank", "get_coordinate", "get_rank", "get_all_groups")
    opaque = [*_placement_classes(), *(getattr(DeviceMesh, name) for name in mesh_queries)]
    for fn in opaque:
        patch(
            jit_ext._general_jit_lookaside_map,
            fn,
            jit_ext.interpreter_needs_wrap(fn),
            table=JIT_LOOKASIDES,
            expects=expects_absent,
        )


# ---------------------------------------------------------------------------------------------------------
# Hooks on the module passed to thunder.jit (thunder 0.2.6 layout)
# ---------------------------------------------------------------------------------------------------------
#: Per-instance state every ``nn.Module`` holds (hook dicts and the like), which ``ThunderModule`` therefore
#: holds too, for itself. thunder unpacks ``_parameters`` / ``_buffers`` / ``_modules`` by name and deletes
#: its own ``training``; every other such attribute of the jitted module must be read from the user's module.
_UNPACKED_BY_THUNDER = {"training", "_parameters", "_buffers", "_modules"}
_WRAPPER_SHADOWED_MODULE_STATE = frozenset(vars(torch.nn.Module())) - _UNPACKED_BY_THUNDER


def _has_parallel_style_hooks(module: torch.nn.Module) -> bool:
    """Hooks of torch's tensor-parallel styles on ``module``: its program makes DTensors before it traces one."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for hook in hooks.values():
            fn = getattr(hook, "func", hook)
            if getattr(fn, "__module__", "").startswith("torch.distributed.tensor.parallel"):
                return True
    return False


@installer("dtensor", "the prologue reads a jitted module's hook dicts from the user's module")
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

    why = "the prologue reads a jitted module's hook dicts from the user's module, not its ThunderModule"
    declare_fix("read_root_module_state_from_user_module", "dtensor", why)

    def hook_dict_read(obj: Any, name: Any, value: Any) -> Any:
        if (
            value is not interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED
            and isinstance(interpreter.unwrap(obj), torch.nn.Module)
            and interpreter.unwrap(name) in _WRAPPER_SHADOWED_MODULE_STATE
            and (
                active("read_root_module_state_from_user_module", interpreter.unwrap(obj))
                or _has_parallel_style_hooks(interpreter.unwrap(obj))
            )
        ):
            record = value.provenance
            if (
                record.inst is interpreter.PseudoInst.LOAD_ATTR
                and record.inputs[0].ext_flag & jit_ext.EXT_FLAG_IS_MODULE
                and record.inputs[1].value == interpreter.unwrap(name)
            ):
                record.ext_flag |= jit_ext.EXT_FLAG_IS_CALLABLE
        return value

    on_attribute_read("read_root_module_state_from_user_module", hook_dict_read, when="after")


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
        # (thunder annotates ``tags`` as a list and ``out_of_place`` as a Symbol; it reads any sequence and callable)
        make = ltorch.torchsymbol(
            id=f"thunder_dtensor.{name}",
            allow_tensor_subclass_proxy=True,
            tags=(OpTags.IN_PLACE,),  # type: ignore[arg-type]
            out_of_place=fn,  # type: ignore[arg-type]
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


@installer("dtensor", "thunder's alias updates keep DTensor proxies and run on the dtensor executor")
def keep_dtensors_in_alias_updates(
    is_dtensor_proxy: Callable, new_alias: Callable, update_aliases_prim: Symbol, view_writes: ViewWriteEmitter
) -> None:
    """Make thunder's alias updates keep DTensor proxies and run on the dtensor executor.

    * A write into a view of a DTensor whose gradient matters is made functional first, its ops emitted by
      ``view_writes`` (:mod:`thunder_dtensor._integration.functionalize`): thunder's autodiff would give it
      wrong gradients.

    * ``new_alias(p)`` makes the proxy for the updated alias of the DTensor proxy ``p``; thunder would make a
      plain ``TensorProxy``, losing the spec.
    * An ``update_aliases`` line over DTensors binds ``update_aliases_prim`` instead of thunder's prim, which
      the torch executor would run on DTensors.
    * A return of DTensors gets the alias updates an ordinary line gets (thunder skips the return's).
    """
    import thunder.core.update_aliases as update_aliases

    thunder_new_alias = update_aliases._get_new_alias
    thunder_update_bsym = update_aliases._get_update_bsym

    def get_new_alias(alias: Any, trace: Any) -> Any:
        if not is_dtensor_proxy(alias.proxy):
            return thunder_new_alias(alias, trace)
        with tracectx(trace):
            return new_alias(alias.proxy)

    thunder_new_aliases = update_aliases._get_new_aliases
    why = "thunder's alias updates iterate each alias group in the order of its proxies' names"
    declare_fix("alias_group_order", "dtensor", why)

    def in_name_order(group: Any) -> list:
        # thunder passes each alias group as a set: its order (so the order of the update's operands and of
        # everything the program does with them, collectives included) follows the process's hash seed, which
        # differs between ranks: ranks then ran the same program with its collectives in different orders
        # (gloo: "Received data size doesn't match expected size"). In a DTensor program, both thunder
        # functions that iterate a group see it in the order of its proxies' names, the same on every rank.
        if not active("alias_group_order"):
            return group
        return sorted(group, key=lambda alias: alias.proxy.name)

    def get_new_aliases(aliases: Any, trace: Any) -> tuple:
        return thunder_new_aliases(in_name_order(aliases), trace)

    def get_update_bsym(group: Any, swap_map: dict, new_aliases: tuple) -> tuple:
        bsym, swap_map = thunder_update_bsym(in_name_order(group), swap_map, new_aliases)
        if any(is_dtensor_proxy(p) for p in bsym.flat_proxy_args):
            bsym = bsym.from_bsym(sym=update_aliases_prim)
        return bsym, swap_map

    thunder_insert_alias_updates = update_aliases.insert_alias_updates
    return_through_updates = Symbol(name="return", meta=None, id="thunder_dtensor.return_through_alias_updates")

    def insert_alias_updates(trace: TraceCtx, alias_tensor_indices: list) -> TraceCtx:
        trace = functionalize_writes_into_views(trace, lambda p: view_writes if is_dtensor_proxy(p) else None)
        # thunder skips the return: a DTensor written through one of its views and then returned itself would
        # be returned under its name from before the write, which the forward/backward split then drops. A
        # return of DTensors goes through the pass as an ordinary line (so an update of the aliases it reads is
        # put before it) and comes out as the return again.
        returns_dtensors = [
            b.sym.id == prims.PrimIDs.RETURN and any(is_dtensor_proxy(a) for a in b.flat_proxy_args)
            for b in cast(list[BoundSymbol], trace.bound_symbols)
        ]
        if not any(returns_dtensors):
            return thunder_insert_alias_updates(trace, alias_tensor_indices)
        disguised = from_trace(trace)
        disguised.bound_symbols = [
            b.from_bsym(sym=return_through_updates) if is_return else b
            for b, is_return in zip(cast(list[BoundSymbol], trace.bound_symbols), returns_dtensors)
        ]
        updated = thunder_insert_alias_updates(disguised, alias_tensor_indices)
        if updated is disguised:  # nothing is written in place: thunder returns the trace as it was
            return trace
        python_return = next(b.sym for b, is_return in zip(trace.bound_symbols, returns_dtensors) if is_return)
        updated.bound_symbols = [
            b.from_bsym(sym=python_return) if b.sym is return_through_updates else b
            for b in cast(list[BoundSymbol], updated.bound_symbols)
        ]
        return updated

    module = "thunder.core.update_aliases"
    patch(update_aliases, "_get_new_alias", get_new_alias, expects=expects_function(module, "alias", "trace"))
    patch(
        update_aliases,
        "_get_new_aliases",
        get_new_aliases,
        expects=expects_function(module, "aliases", "trace"),
        reason="alias groups in the order of their names, the same on every rank (thunder iterates a set)",
    )
    patch(
        update_aliases,
        "_get_update_bsym",
        get_update_bsym,
        expects=expects_function(module, "group", "swap_map", "new_aliases"),
    )
    returned_with_the_write = "a DTensor written through a view and returned itself is returned with the write"
    for holder in (update_aliases, thunder):  # thunder.__init__ calls it by the name it imported
        patch(
            holder,
            "insert_alias_updates",
            insert_alias_updates,
            expects=expects_qualified(f"{module}.insert_alias_updates", "computation_trace", "alias_tensor_indices"),
            reason=returned_with_the_write,
        )


def local_shards_alias(a: Any, b: Any) -> bool:
    """Whether two DTensors' local shards share memory (``a`` a view of ``b``), on real and fake tensors alike."""
    return torch._C._is_alias_of(local_tensor(a), local_tensor(b))  # type: ignore[attr-defined]  # (not in torch's stubs)


# ---------------------------------------------------------------------------------------------------------
# Compiled-program hook (thunder 0.2.6 layout; used by consistency.py)
# ---------------------------------------------------------------------------------------------------------
@installer("dtensor", "each compiled program is shown to a hook first (the opt-in rank-consistency check)")
def install_compiled_program_hook(on_compiled: Callable[[Any, Any], None]) -> None:
    """Call ``on_compiled(computation_trace, backward_trace_or_None)`` each time thunder.jit finishes a program.

    thunder 0.2.6 ends each compilation by building a ``CacheEntry`` (a namedtuple in ``thunder``'s module)
    from the final traces, before the program first runs; we rebind that name to a subclass whose
    constructor calls the hook first. An exception from the hook fails the call that compiled, and nothing
    is cached. Installed once; the traces are those the entry runs (the forward as before its conversion
    to torch types, which changes no dtensor op).
    """
    base: Any = thunder.CacheEntry  # (a namedtuple class)

    class CacheEntry(base):
        __slots__ = ()

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            entry = super().__new__(cls, *args, **kwargs)
            backward = entry.backward_traces[-1] if entry.backward_traces else None
            on_compiled(entry.computation_traces[-1], backward)
            return entry

    def namedtuple_with_traces(original: Any) -> str | None:
        fields = set(getattr(original, "_fields", ()))
        return None if {"computation_traces", "backward_traces"} <= fields else "a namedtuple with *_traces fields"

    patch(thunder, "CacheEntry", CacheEntry, expects=namedtuple_with_traces)


@installer("dtensor", "a compiled program's backward is called through the package (cotangents placed otherwise)")
def wrap_compiled_backwards(wrap: Callable[[Any], Callable | None]) -> None:
    """Replace each compiled program's ``backward_fn`` by ``wrap(cache_entry)`` (kept where that is None).

    Like :func:`install_compiled_program_hook`, through a subclass of thunder 0.2.6's ``CacheEntry`` whose
    constructor makes the entry, then (while the compile data is still current) asks ``wrap`` for the backward
    the entry keeps. thunder calls an entry's ``backward_fn(saved_for_backward, cotangents)`` from its
    autograd function; the wrapper takes the same arguments.
    """
    base: Any = thunder.CacheEntry  # (a namedtuple class)

    class CacheEntry(base):
        __slots__ = ()

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            entry = super().__new__(cls, *args, **kwargs)
            wrapped = wrap(entry) if entry.backward_fn is not None else None
            return entry if wrapped is None else entry._replace(backward_fn=wrapped)

    def namedtuple_with_a_backward(original: Any) -> str | None:
        fields = set(getattr(original, "_fields", ()))
        return None if {"backward_fn", "backward_traces"} <= fields else "a namedtuple with a backward_fn field"

    patch(thunder, "CacheEntry", CacheEntry, expects=namedtuple_with_a_backward)
