"""Runtime guards: the prologue's spec checks and the backward's cotangent-spec check."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

from thunder_dtensor import _integration as ti
from thunder_dtensor.executor import dtensor_ex
from thunder_dtensor.lowering import forward_prims_kept, is_backward, keeping_forward_prims_as_ran
from thunder_dtensor.primitive import vjp_call_deciding_again, without_unused_vjp_gradients
from thunder_dtensor.proxy import DTensorProxy, is_zero_cotangent_of
from thunder_dtensor.spec import DTensorMeta

import torch

__all__ = [
    "CotangentPlacementWarning",
    "backward_for_cotangent_placements",
    "check_dtensor_spec_repr",
    "dtensor_cotangent_to_spec_prim",
    "dtensor_input_key",
    "propagate_gradient_specs",
]


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


# --- check_dtensor_spec_repr: the prologue's check of one DTensor input ------------------------------------
# A DTensor input is accepted only when everything that shapes the traced program is what it was traced for:
# the spec (mesh with its full rank layout and dim names, placements, shard order, global shape and stride,
# dtype; see ``canonical_spec_repr``), requires_grad, and the local shard's shape and stride. thunder's own
# check of the DTensor (global shape, device, dtype, requires_grad) stays, and runs after this one.
DTensorInputKey = tuple  # (canonical spec repr, requires_grad, local shape, local stride)


def dtensor_input_key(dtensor: Any, spec: Any = None, local: Any = None) -> DTensorInputKey:
    """What the prologue compares for a runtime DTensor input: one tuple, one comparison.

    ``spec`` and ``local`` are the DTensor's spec and local shard (the prologue reads them as attributes).
    The spec's part is memoised (a dict probe); the local shape stays a ``torch.Size``, which compares equal
    to the traced tuple.
    """
    spec = ti.dtensor_spec(dtensor) if spec is None else spec
    local = ti.local_tensor(dtensor) if local is None else local
    return (ti.canonical_spec_repr(spec), dtensor.requires_grad, local.shape, local.stride())


def traced_input_key(dtensor: DTensorProxy) -> DTensorInputKey:
    """The key a DTensor input proxy was traced for (the prologue's expected value)."""
    meta = dtensor.meta
    ti.check(meta.local_stride is not None, lambda: f"DTensor input {dtensor.name} has no recorded local stride")
    # local_stride is not None (checked above)
    return (
        meta.spec_repr(),
        bool(dtensor.requires_grad),
        tuple(meta.local_shape),
        tuple(cast(tuple, meta.local_stride)),
    )


def _check_dtensor_spec_repr_meta(dtensor: Any, spec: Any, local: Any, expected: DTensorInputKey) -> None:
    ti.check(isinstance(expected, tuple), lambda: f"expected a DTensor input key tuple, got {type(expected)}")


def _check_dtensor_spec_repr_impl(dtensor: Any, spec: Any, local: Any, expected: DTensorInputKey) -> None:
    actual = dtensor_input_key(dtensor, spec, local)
    if actual != expected:
        fields = ("spec", "requires_grad", "local shape", "local stride")
        diff = "; ".join(f"{f}: traced {e}, called with {a}" for f, e, a in zip(fields, expected, actual) if e != a)
        raise RuntimeError(f"DTensor input changed ({diff})")


def _prologue_prim(name: str, meta: Callable, impl: Callable, tags: tuple) -> tuple[ti.Symbol, ti.Symbol]:
    """A prologue prim and the executor operator that runs it.

    The prologue runs only thunder's python executor plus "always" executors, and keeps a symbol that already
    names its executor: the prologue therefore records the executor operator directly.
    """
    prim = ti.make_prim(f"thunder_dtensor.{name}", name, meta=meta, tags=tags)
    operator = dtensor_ex.register_operator(name, like=prim, fn=impl)
    dtensor_ex.register_implementation(prim, operator, checker=_always)
    return prim, operator


def define_prologue_check(name: str, meta: Callable, impl: Callable) -> tuple[ti.Symbol, ti.Symbol]:
    """A check prim (never removed as dead code) and the executor operator that runs it (see ``_prologue_prim``)."""
    return _prologue_prim(name, meta, impl, (ti.OpTags.DONT_DCE,))


check_dtensor_spec_repr, _run_check_dtensor_spec_repr = define_prologue_check(
    "check_dtensor_spec_repr", _check_dtensor_spec_repr_meta, _check_dtensor_spec_repr_impl
)


def add_prologue_spec_checks(prim: Any, prologue_trace: ti.TraceCtx, args: tuple) -> bool:
    """thunder's prologue hook: expand our DTensor input constraint into one check of the input's key.

    The prologue reads ``x._spec`` and ``x._local_tensor`` and compares one tuple. thunder records the
    constraint as ``(prim, proxy, runtime spec)``; the expected key comes from the proxy, which was made
    from that runtime DTensor (its local stride included).

    Under ``cache="symbolic values"`` thunder records only its own shape-and-metadata check, with symbolic
    sizes. A DTensor program's specs are concrete, though: there a DTensor input gets the same check as
    under constant values, and a plain tensor input a check of its concrete shape (``DTensor.from_local`` of
    it, or an op mixing it in, traced specs from that shape). thunder's own check still runs after ours.
    """
    if ti.using_symbolic_values() and ti.is_check_tensor_shape_and_metadata(prim):
        (tensor,) = args
        if isinstance(tensor, DTensorProxy):
            _add_spec_check(prologue_trace, tensor, tensor.meta.spec)
        elif ti.traced_dtensor_ops():
            _run_check_concrete_shape(tensor, tuple(int(cast(int, ti.pyval(s))) for s in tensor._shape))
        return False
    if ti.is_check_tensor_shape_and_metadata(prim) and isinstance(args[0], DTensorProxy):
        # thunder's check of shape, device, dtype and requires_grad: the DTensor's own check below compares all
        # of them (its spec holds the global shape, dtype and mesh device type), so one check per input is run
        return True
    if prim is not check_dtensor_spec_repr:
        return False
    dtensor, _runtime_spec = args
    _add_spec_check(prologue_trace, dtensor, _runtime_spec)
    return True


def _add_spec_check(prologue_trace: ti.TraceCtx, dtensor: Any, _runtime_spec: Any) -> None:
    ti.check(isinstance(dtensor, DTensorProxy), lambda: f"expected a DTensorProxy, got {type(dtensor)}")
    spec = ti.AnyProxy(_runtime_spec, prefix="dtensor_spec")
    prologue_trace.bound_symbols.append(ti.bind_unpack_dtensor_spec(dtensor, spec))
    local = ti.TensorProxy(
        prefix="local", shape=dtensor.local_shape, dtype=dtensor.dtype, device=dtensor.device, requires_grad=False
    )
    prologue_trace.bound_symbols.append(ti.bind_unpack_local_tensor(dtensor, local))
    _run_check_dtensor_spec_repr(dtensor, spec, local, traced_input_key(dtensor))


def _check_concrete_shape_meta(t: Any, expected: tuple) -> None:
    ti.check(isinstance(expected, tuple), lambda: f"expected a shape tuple, got {type(expected)}")


def _check_concrete_shape_impl(t: Any, expected: tuple) -> None:
    if tuple(t.shape) != expected:
        raise RuntimeError(f"tensor input changed shape: traced {expected}, called with {tuple(t.shape)}")


#: under cache="symbolic values", a plain tensor input of a DTensor program keeps its traced shape
check_concrete_shape, _run_check_concrete_shape = define_prologue_check(
    "check_concrete_shape", _check_concrete_shape_meta, _check_concrete_shape_impl
)


# --- the prologue's module lookups and constant checks, made cheap (``_integration.compact_prologue``) -------
# thunder's prologue fetches each parameter, buffer and submodule a program reads by its full path from the
# jitted module (``obj.get_parameter('model.layers.0.mlp.up_proj.weight')``: a walk from the root for every
# one) and checks every number and string it read with a call of its own. A compacted prologue walks each
# module of those paths once (the same ``getattr`` steps torch's lookups take, from a root whose lookups are
# torch's own; any other root, a ThunderModule's cached lookups for one, is asked as before) and compares all
# the numbers and strings in one tuple comparison at its end, falling back to thunder's per-value semantics
# (types, NaN) only when the tuples differ.
_TORCH_LOOKUPS = (torch.nn.Module.get_submodule, torch.nn.Module.get_parameter, torch.nn.Module.get_buffer)


def _bound_directly(*args: Any) -> None:
    raise NotImplementedError("bound directly into prologue traces")


def _prologue_lookup(name: str, impl: Callable) -> ti.Symbol:
    """The operator of a prologue lookup, bound directly into prologue traces (dead code where unused)."""
    return _prologue_prim(name, _bound_directly, impl, ())[1]


def _walkable_root_impl(root: Any) -> Any:
    """``root`` when its lookups are torch's own, so a walk of its attributes finds what they find; else None."""
    cls = type(root)
    if isinstance(root, torch.nn.Module) and (cls.get_submodule, cls.get_parameter, cls.get_buffer) == _TORCH_LOOKUPS:
        return root
    return None


#: module class -> {name: whether ``getattr(module, name)`` ends in ``nn.Module.__getattr__`` for an instance
#: without ``name`` in its ``__dict__``}: no class attribute or descriptor of that name in the class's MRO, torch's
#: ``__getattr__`` and ``object.__getattribute__``. Decided once per class and name (a class changed after its
#: first call keeps its verdict, as dynamo's guards keep theirs); holds the classes, as long-lived as their modules.
_ENDS_IN_MODULE_GETATTR: dict[type, dict[str, bool]] = {}


def _ends_in_module_getattr(module: Any, name: str) -> bool:
    """Whether ``getattr(module, name)`` is answered by ``nn.Module.__getattr__`` from the module's dicts, after a
    failed attribute lookup (an ``AttributeError`` raised and caught: about 1 µs, 54 submodules and 39 parameters
    in a 4-layer HF decode step's prologue). Where it is, the prologue reads those dicts itself."""
    if name in module.__dict__:
        return False
    cls = type(module)
    verdicts = _ENDS_IN_MODULE_GETATTR.get(cls)
    if verdicts is None:
        verdicts = _ENDS_IN_MODULE_GETATTR[cls] = {}
    verdict = verdicts.get(name)
    if verdict is None:
        verdict = verdicts[name] = (
            cls.__getattribute__ is torch.nn.Module.__getattribute__
            and getattr(cls, "__getattr__", None) is torch.nn.Module.__getattr__
            and not any(name in vars(k) for k in cls.__mro__)
        )
    return verdict


def _submodule_step_impl(parent: Any, name: str) -> Any:
    """One step of ``get_submodule``'s walk (None where the walk does not apply)."""
    if parent is None:
        return None
    if _ends_in_module_getattr(parent, name):  # nn.Module.__getattr__'s order: parameters, buffers, modules
        state = parent.__dict__
        child = state["_modules"].get(name)
        if child is not None and name not in state["_parameters"] and name not in state["_buffers"]:
            return child  # (``_modules`` holds modules, or None)
    child = getattr(parent, name)  # AttributeError where torch's hasattr check raises it
    if not isinstance(child, torch.nn.Module):
        raise AttributeError(f"`{name}` is not an nn.Module")
    return child


def _fetch_submodule_impl(root: Any, path: str, walked: Any) -> Any:
    return walked if walked is not None else root.get_submodule(path)


def _fetch_parameter_impl(root: Any, path: str, owner: Any, name: str) -> Any:
    if owner is None:
        return root.get_parameter(path)
    if _ends_in_module_getattr(owner, name):
        param = owner.__dict__["_parameters"].get(name)
        if param is not None:
            return param  # (``_parameters`` holds parameters, or None; it is searched first)
    param = getattr(owner, name)
    if not isinstance(param, torch.nn.Parameter):
        raise AttributeError(f"`{name}` is not an nn.Parameter")
    return param


def _fetch_buffer_impl(root: Any, path: str, owner: Any, name: str) -> Any:
    if owner is None:
        return root.get_buffer(path)
    buffers = owner.__dict__["_buffers"]
    if name not in buffers:
        raise AttributeError(f"`{name}` is not a buffer")
    if _ends_in_module_getattr(owner, name) and name not in owner.__dict__["_parameters"]:
        return buffers[name]
    return getattr(owner, name)


def _check_constants_meta(numbers: tuple, expected_numbers: tuple, strings: tuple, expected_strings: tuple) -> None:
    ti.check(len(numbers) == len(expected_numbers) and len(strings) == len(expected_strings), lambda: "unpaired")


def _check_constants_impl(numbers: tuple, expected_numbers: tuple, strings: tuple, expected_strings: tuple) -> None:
    """thunder's ``check_number_type_and_value`` and ``check_string_value`` of many values, in one comparison.

    Equal tuples of equal types pass (a tuple compares items by identity, then ``==``); otherwise each value is
    checked as thunder checks it (a NaN equals a NaN of the same type)."""
    if (
        numbers == expected_numbers
        and strings == expected_strings
        and tuple(map(type, numbers)) == tuple(map(type, expected_numbers))
    ):
        return
    for n, v in zip(numbers, expected_numbers):
        if not (type(n) == type(v) and (n == v or (n != n and v != v))):  # noqa: E721  (thunder's own check)
            raise RuntimeError(f"Expected {n} to be equal to and have the type of {v}")
    for s, v in zip(strings, expected_strings):
        if s != v:
            raise RuntimeError(f"Expected '{s}' to be equal to '{v}'")


walkable_root = _prologue_lookup("walkable_root", _walkable_root_impl)
submodule_step = _prologue_lookup("submodule_step", _submodule_step_impl)
fetch_submodule = _prologue_lookup("fetch_submodule", _fetch_submodule_impl)
fetch_parameter = _prologue_lookup("fetch_parameter", _fetch_parameter_impl)
fetch_buffer = _prologue_lookup("fetch_buffer", _fetch_buffer_impl)
_, check_constants = define_prologue_check("check_constants", _check_constants_meta, _check_constants_impl)

#: the operators a compacted prologue is written with
PROLOGUE_OPS = ti.PrologueOps(
    walkable_root=walkable_root,
    submodule_step=submodule_step,
    fetch_submodule=fetch_submodule,
    fetch_parameter=fetch_parameter,
    fetch_buffer=fetch_buffer,
    check_constants=check_constants,
)


# --- the backward's cotangents: traced for one spec, they may arrive with another -------------------------
def _cotangent_meta(ct: DTensorProxy, spec: Any) -> DTensorProxy:
    return DTensorProxy(like=ct)


def _cotangent_impl(ct: Any, spec: Any) -> Any:
    if not isinstance(ct, ti.DTensor):
        # autograd materialises an unused output's cotangent as plain zeros when that output is an input
        # returned as is (``torch.atleast_2d([x, y])``): read a plain cotangent as the full value
        ct = ti.DTensor.from_local(ct, spec.mesh, [ti.Replicate()] * spec.mesh.ndim, run_check=False)
    if ti.dtensor_spec(ct) == spec:
        return ct
    # Same global value, other placements: move it to the placements the backward was traced for.
    # DTensor does not redistribute to Partial publicly; Replicate -> Partial is local arithmetic: a sum
    # over n equal shares of v/n is v (avg, max and min of equal values are the value itself).
    staged = tuple(ti.Replicate() if p.is_partial() else p for p in spec.placements)
    ct = ct.redistribute(spec.mesh, staged) if tuple(ct.placements) != staged else ct
    if staged == tuple(spec.placements):
        return ct
    local = ct.to_local()
    for mesh_dim, p in enumerate(spec.placements):
        if p.is_partial() and p.reduce_op == "sum":
            local = local / spec.mesh.size(mesh_dim)
    return ti.dtensor_from_local_unchecked(local, spec)


dtensor_cotangent_to_spec_prim = ti.make_prim(
    "thunder_dtensor.dtensor_cotangent_to_spec_prim", "dtensor_cotangent_to_spec_prim", meta=_cotangent_meta
)
# Bound directly into backward traces that may already have been through executor selection.
_run_dtensor_cotangent_to_spec = dtensor_ex.register_operator(
    "dtensor_cotangent_to_spec_prim", like=dtensor_cotangent_to_spec_prim, fn=_cotangent_impl
)
dtensor_ex.register_implementation(dtensor_cotangent_to_spec_prim, _run_dtensor_cotangent_to_spec, checker=_always)


def match_cotangent_specs(backward_trace: ti.TraceCtx) -> ti.TraceCtx:
    """Insert a spec match for each DTensor cotangent right after the backward unpacks them."""
    new_trace = ti.from_trace(backward_trace)
    swap: dict = {}
    bsyms: list = []
    for bsym in cast(list[ti.BoundSymbol], backward_trace.bound_symbols):
        if swap:
            bsym = bsym.from_bsym_swap_proxies(swap)
        bsyms.append(bsym)
        if not ti.is_unpack_cotangents(bsym):
            continue
        for ct in bsym.flat_outs:
            if isinstance(ct, DTensorProxy):
                with ti.tracectx(new_trace):
                    matched = DTensorProxy(like=ct)
                bsyms.append(_run_dtensor_cotangent_to_spec.bind(ct, ct.meta.spec, output=matched))
                swap[ti.variableify(ct)] = matched
    new_trace.bound_symbols = bsyms
    return new_trace


def _term_beside_a_zero_cotangent(bsym: ti.BoundSymbol, zeros: set[str]) -> DTensorProxy | None:
    """The other term of a sum of two cotangents one of which is a zero autodiff made (a value nothing flows back
    to, such as an alias update's unused output), or a value computed from zero cotangents only (``zeros``).
    ``accumulate_cotangents`` drops such a term when it sees it, but where the zero was still a stand-in while
    the rules were traced, the sum meets it only here: kept, it gave the sum the zeros' placements instead of
    the gradient's (fuzz seed 13228)."""
    summed = bsym.sym.name == "dtensor_add" and len(bsym.args) == 2 and bsym.kwargs.get("alpha", 1) == 1
    if not summed or not isinstance(bsym.output, DTensorProxy):
        return None
    a, b = bsym.args
    # (a zero of the other term's shape and dtype: the sum has that shape, nothing broadcasts)
    for zero, term in ((a, b), (b, a)):
        if is_zero_cotangent_of(zero, like=term, known=zeros):
            return term
    return None


def propagate_gradient_specs(joint_trace: ti.TraceCtx, zero_cotangents: frozenset[str] = frozenset()) -> ti.TraceCtx:
    """Re-propagate the backward's specs from the gradients that actually flow, as eager's backward does.

    thunder's autodiff traces each grad rule, in forward order, on a stand-in for its output's cotangent
    (``make_cotangent_proxy``: the primal's spec), then swaps the stand-in for the gradient the later ops'
    rules computed, whose spec is DTensor's own and may differ (a Partial value's gradient is often Partial,
    a sharded one comes out of a matmul's backward). The rule's outputs keep the specs traced for the
    stand-in, and the executor pass re-runs the metas on the swapped inputs without updating them: the trace
    is inconsistent (a stale spec, or a rejection eager never meets). Here each backward step that reads a
    DTensor is traced again on its actual inputs, in order, and its outputs replaced where their specs change.

    ``zero_cotangents``: cotangents (``prims.get_grad`` outputs) that are zeros standing in for a gradient
    autograd did not give. A backward is linear in its cotangents, so what it computes from zero cotangents only
    is zero; summed into a gradient, such a value is dropped, as eager, which never runs those ops' backward, has
    no such term (fuzz seed 14347: the zeros of a mean read by ``.item()`` ran ``abs().mean()``'s backward, and
    summing that sharded zero into a Partial gradient reduce-scattered it). Dead code elimination then drops
    the steps that computed it.
    """
    new_trace = ti.from_trace(joint_trace)
    swap: dict = {}
    bsyms: list = []
    from_cotangents: set[str] = set(zero_cotangents)  # values computed from cotangents (the linear part)
    zeros: set[str] = set(zero_cotangents)  # ... from zero cotangents only
    # each generic vjp asks for the gradients read later only, as eager's autograd does: a gradient nobody reads
    # (a weight that does not require grad) changes torch's decomposition, which DTensor may then reject for the
    # cotangent that flows (fuzz seed 20757: a matmul's, replicated, its gradient placed unlike eager's)
    for bsym in without_unused_vjp_gradients(cast(list[ti.BoundSymbol], joint_trace.bound_symbols)):
        if swap:
            bsym = bsym.from_bsym_swap_proxies(swap)
        stands_for = _propagate_step(bsym, new_trace, bsyms, swap, zeros)
        if not zero_cotangents:
            continue
        if bsym.sym.id == ti.prims.PrimIDs.GET_GRAD:
            from_cotangents.update(o.name for o in bsym.flat_proxy_outs)
            continue
        read = [a.name for a in bsym.flat_proxy_args if a.name in from_cotangents]
        for o in bsym.flat_proxy_outs if stands_for is None else stands_for:
            if read:
                from_cotangents.add(o.name)
                if all(n in zeros for n in read):
                    zeros.add(o.name)
    if not swap:  # every spec was right (every program without a DTensor backward): the trace as it was
        return joint_trace
    new_trace.bound_symbols = bsyms
    return new_trace


def _propagate_step(bsym: ti.BoundSymbol, new_trace: ti.TraceCtx, bsyms: list, swap: dict, zeros: set[str]) -> Any:
    """One step of :func:`propagate_gradient_specs`: ``bsym``, or what it is traced again as, appended to
    ``bsyms``, its outputs replaced in ``swap`` where their specs change. Returns the proxies that stand for its
    outputs from here on, or None where they are its own."""
    if (
        not is_backward(bsym)
        or bsym.sym.id in (ti.prims.PrimIDs.GET_GRAD, ti.prims.PrimIDs.PUT_GRAD)
        or not any(isinstance(o, DTensorProxy) for o in bsym.flat_outs)
        or not any(isinstance(a, DTensorProxy) for a in bsym.flat_proxy_args)
    ):
        bsyms.append(bsym)
        return None
    kept = _term_beside_a_zero_cotangent(bsym, zeros)
    if kept is not None:  # the sum is that term: its placements flow on, as eager's (which has no zero term)
        swap[ti.variableify(bsym.output)] = kept
        return [kept]
    # a generic vjp decides again how it runs (the vjp, decomposed, replicated) for the cotangent that flows
    deciding_again = vjp_call_deciding_again(bsym.sym.name)
    with ti.tracectx(new_trace):
        new_trace.push_scope([])
        if deciding_again is not None:
            out = deciding_again(*bsym.args)
        else:
            out = bsym.sym(*bsym.args, **bsym.kwargs)
        retraced = new_trace.pop_scope()
    old_outs, new_outs = ti.tree_flatten(bsym.output)[0], ti.tree_flatten(out)[0]
    ti.check(  # (mypy cannot infer the type of a lambda with a default argument)
        len(old_outs) == len(new_outs),
        lambda name=bsym.sym.name: f"{name} changed its outputs when retraced",  # type: ignore[misc]
    )
    changed = [
        (o, n)
        for o, n in zip(old_outs, new_outs)
        if isinstance(o, DTensorProxy) and (o.meta.spec, o.local_shape) != (n.meta.spec, n.local_shape)
    ]
    if not changed and [b.sym.name for b in retraced] == [bsym.sym.name]:
        bsyms.append(bsym)
        return None
    for b in retraced:
        b.tags |= bsym.tags
    bsyms.extend(retraced)
    for o, n in zip(old_outs, new_outs):
        if isinstance(o, ti.Proxy) and isinstance(n, ti.Proxy):
            swap[ti.variableify(o)] = n
    return [n for n in new_outs if isinstance(n, ti.Proxy)]


def make_cotangent_proxy(a: Any) -> DTensorProxy | None:
    """The cotangent proxy of a DTensor value (None for other values: thunder's default applies)."""
    if not isinstance(a, DTensorProxy):
        return None
    return DTensorProxy(meta=a.meta.as_cotangent(), device=a.device, requires_grad=a.requires_grad)


# --- the backward, traced again for the placements its cotangents arrive with -------------------------------
# thunder traces a program's backward once, with each DTensor output's cotangent placed as ``make_cotangent_proxy``
# says (the output's placements, Partial read as Replicate). ``out.backward(gradient=g)``,
# ``torch.autograd.grad(..., grad_outputs=...)`` and eager code downstream of the program may hand in a
# cotangent placed otherwise (a Partial one, a Shard one for a replicated output). Eager's backward then runs
# each op on those placements: other gradient placements, other collectives. Redistributing the cotangent to
# the traced placements would give eager's values with a collective eager does not issue. Instead the joint
# (forward + backward) trace is taken again with the cotangents' actual specs, its specs re-propagated and
# compiled as thunder.jit compiled it; its forward must be the one that ran (the same symbols on the same
# values, in any order), so its backward reads the values that forward saved. Each such backward is kept, by the
# cotangents' placements, for the program's later calls.


class CotangentPlacementWarning(UserWarning):
    """A backward could not be traced for its cotangents' placements: they were redistributed to the traced ones
    (eager's values; the gradients' placements and collectives may differ from eager's)."""


def _unpacked(trace: ti.TraceCtx, collection: str) -> list | None:
    """The outputs of the backward trace's ``... = <collection>`` unpacking (None where it has none)."""
    for bsym in trace.bound_symbols:
        if bsym.sym.id == ti.prims.PrimIDs.UNPACK_SEQUENCE and getattr(bsym.args[0], "name", None) == collection:
            return list(bsym.output)
    return None


def _is_joint(trace: ti.TraceCtx) -> bool:
    """Whether ``trace`` is a joint forward + backward trace (its return names the forward's outputs apart)."""
    if not trace.bound_symbols or trace.bound_symbols[-1].sym.id != ti.prims.PrimIDs.RETURN:
        return False
    returned = trace.bound_symbols[-1].args[0] if trace.bound_symbols[-1].args else None
    return isinstance(returned, dict) and "fw_flat_out" in returned


_NOT_COMPARED = {ti.prims.PrimIDs.DEL, ti.prims.PrimIDs.RETURN, ti.prims.PrimIDs.COMMENT}


def _same_value(x: Any, y: Any) -> bool:
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:
        return False


def _forward_names(ran: ti.TraceCtx, again: ti.TraceCtx) -> dict[str, str] | None:
    """``again``'s proxy names -> ``ran``'s, where the two forward traces compute the same: each symbol of
    ``again`` is matched to one of ``ran`` with the same name, the same non-proxy arguments and inputs that are
    matched values (deletions aside); None where some symbol has no match.

    Matched by dataflow, not position: the two compiles may schedule independent symbols in another order (a
    thunderfx region's forward did, when its backward was traced for other cotangent placements)."""
    first = [b for b in cast(list[ti.BoundSymbol], ran.bound_symbols) if b.sym.id not in _NOT_COMPARED]
    second = [b for b in cast(list[ti.BoundSymbol], again.bound_symbols) if b.sym.id not in _NOT_COMPARED]
    if len(first) != len(second):
        return None
    # the inputs by position; every other value by the symbol that makes it
    ran_inputs = [x for x in ti.tree_flatten((ran.args, ran.kwargs))[0] if isinstance(x, ti.Proxy)]
    again_inputs = [y for y in ti.tree_flatten((again.args, again.kwargs))[0] if isinstance(y, ti.Proxy)]
    if len(ran_inputs) != len(again_inputs):
        return None
    names = {y.name: x.name for x, y in zip(ran_inputs, again_inputs)}
    ran_names = {x.name: y.name for x, y in zip(ran_inputs, again_inputs)}  # and back: one to one
    if len(names) != len(ran_names):
        return None

    def pairing(flat_a: list, flat_b: list) -> list[tuple[str, str]] | None:
        """The name pairs matching ``flat_b`` to ``flat_a`` adds (consistent with those made), or None."""
        new: dict[str, str] = {}
        new_back: dict[str, str] = {}
        for x, y in zip(flat_a, flat_b):
            if not (isinstance(x, ti.Proxy) and isinstance(y, ti.Proxy)):
                if isinstance(x, ti.Proxy) or isinstance(y, ti.Proxy) or not _same_value(x, y):
                    return None
                continue
            if names.get(y.name, new.get(y.name, x.name)) != x.name:
                return None
            if ran_names.get(x.name, new_back.get(x.name, y.name)) != y.name:
                return None
            new[y.name], new_back[x.name] = x.name, y.name
        return list(new.items())

    unmatched: dict[str, list[ti.BoundSymbol]] = {}
    for a in first:
        unmatched.setdefault(a.sym.name, []).append(a)

    def first_match(candidates: list[ti.BoundSymbol], flat_b: list) -> tuple[int, list[tuple[str, str]]] | None:
        for k, a in enumerate(candidates):
            flat_a = [*a.flat_args, *a.flat_outs]
            pairs = pairing(flat_a, flat_b) if len(flat_a) == len(flat_b) else None
            if pairs is not None:
                return k, pairs
        return None

    for b in second:
        candidates = unmatched.get(b.sym.name, [])
        match = first_match(candidates, [*b.flat_args, *b.flat_outs])
        if match is None:
            return None
        del candidates[match[0]]
        for again_name, ran_name in match[1]:
            names[again_name], ran_names[ran_name] = ran_name, again_name
    return names


def joint_for_cotangent_specs(
    joint: ti.TraceCtx, specs: dict[str, Any], zero_cotangents: frozenset[str] = frozenset()
) -> ti.TraceCtx:
    """``joint`` with the cotangents named in ``specs`` (``prims.get_grad`` outputs) given those specs, and the
    backward's specs propagated from them (:func:`propagate_gradient_specs`, where ``zero_cotangents`` are zeros
    standing in for gradients autograd did not give)."""
    trace = ti.from_trace(joint)
    swap: dict = {}
    bsyms: list = []
    for bsym in cast(list[ti.BoundSymbol], joint.bound_symbols):
        if swap:
            bsym = bsym.from_bsym_swap_proxies(swap)
        out = bsym.output
        if bsym.sym.id == ti.prims.PrimIDs.GET_GRAD and isinstance(out, DTensorProxy) and out.name in specs:
            spec = specs[out.name]
            local_shape = ti.local_shape_on(tuple(out.shape), spec.mesh, tuple(spec.placements))
            with ti.tracectx(trace):
                placed = DTensorProxy(
                    meta=DTensorMeta.from_spec(spec, local_shape), device=out.device, requires_grad=out.requires_grad
                )
            bsym = bsym.from_bsym(output=placed)
            swap[ti.variableify(out)] = placed
        bsyms.append(bsym)
    trace.bound_symbols = bsyms
    return propagate_gradient_specs(trace, zero_cotangents)


def _readable_placements(placements: tuple) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


class BackwardForCotangentPlacements:
    """A compiled program's backward, called with the cotangents autograd hands in; where a DTensor cotangent's
    placements differ from the traced ones, the backward traced for them (made once per placements, kept)."""

    def __init__(
        self,
        backward_fn: Callable,
        backward_trace: ti.TraceCtx,
        forward_trace: ti.TraceCtx,
        joint: ti.TraceCtx,
        compile_context: tuple[Any, Any, dict | None],
        backward_traces: list,
        kept_forward: frozenset[str] = frozenset(),
    ) -> None:
        self.backward_fn = backward_fn
        cotangents = _unpacked(backward_trace, "cotangents") or []
        #: (position, name, traced spec) of each DTensor cotangent
        self.traced = tuple((i, c.name, c.meta.spec) for i, c in enumerate(cotangents) if isinstance(c, DTensorProxy))
        self.saved = [getattr(p, "name", None) for p in _unpacked(backward_trace, "C0") or ()]
        self.saved_other = [getattr(p, "name", None) for p in _unpacked(backward_trace, "C1") or ()]
        self.forward_trace = forward_trace
        self.joint = joint
        #: the forward prims the lowering kept (their outputs' names): kept again, so the forward compiles alike
        self.kept_forward = kept_forward
        # held, not weakly: a program's output outlives a jitted function dropped after its call
        # (``thunder.jit(fn)(x).sum().backward()``), and this backward still traces with its compile data. (The
        # compile data holds the cache that holds this backward: a cycle, which the garbage collector frees.)
        self._compile_data, self._compile_stats, self._cache_info = compile_context
        self.backward_traces = backward_traces
        #: placements of the cotangents placed otherwise -> (backward, saved tensors' order, others' order), or None
        self.variants: dict = {}

    def __call__(self, saved_for_backward: list, cotangents: list) -> Any:
        key = None
        missing: tuple = ()
        for i, _, spec in self.traced:
            c = cotangents[i]
            if ti.is_missing_gradient(c):
                missing = (*missing, (i, None))
            elif isinstance(c, ti.DTensor):
                actual = ti.dtensor_spec(c)
                if actual.placements != spec.placements and actual.mesh == spec.mesh:
                    key = (*(key or ()), (i, tuple(actual.placements)))
        if key is None:
            return self.backward_fn(saved_for_backward, cotangents)
        # traced again anyway: the zeros standing in for gradients autograd did not give are traced as zeros, so
        # what the backward computes from them alone is left out, as eager leaves it (``propagate_gradient_specs``)
        key = (*key, *missing)
        if key not in self.variants:
            self.variants[key] = self._compile(key)
        variant = self.variants[key]
        if variant is None:  # warned: the traced backward redistributes the cotangents it was not traced for
            return self.backward_fn(saved_for_backward, cotangents)
        backward_fn, order, other_order = variant
        saved, other = saved_for_backward
        reordered = [[saved[j] for j in order], [other[j] for j in other_order]]
        for collection in (saved, other, saved_for_backward):
            if isinstance(collection, list):  # as the traced backward empties them (thunder checks it)
                collection.clear()
        return backward_fn(reordered, cotangents)

    def _compile(self, key: tuple) -> tuple | None:
        by_position = {i: (name, spec) for i, name, spec in self.traced}
        specs, zeros = {}, set()
        for i, placements in key:
            name, spec = by_position[i]
            if placements is None:  # a zero standing in for a gradient autograd did not give
                zeros.add(name)
            else:
                specs[name] = ti.make_spec(spec.mesh, placements, spec.tensor_meta)
        try:
            # under the function's options (dtensor_replicated_fallback=False was ignored here)
            with ti.under_compile_data(self._compile_data, self._compile_stats):
                joint = joint_for_cotangent_specs(self.joint, specs, frozenset(zeros))
            with keeping_forward_prims_as_ran(self.kept_forward):
                forward, backward = ti.compile_joint_trace(
                    joint, self._compile_data, self._compile_stats, self._cache_info
                )
            ti.check(backward is not None, lambda: "the joint trace has no backward")
            names = _forward_names(self.forward_trace, forward)
            ti.check(names is not None, lambda: "its forward is not the forward that ran")
            names = cast(dict[str, str], names)  # not None: checked above
            order = self._positions(_unpacked(backward, "C0") or [], names, self.saved)
            other_order = self._positions(_unpacked(backward, "C1") or [], names, self.saved_other)
            backward_fn = backward.python_callable()
        except Exception as e:
            traced = ", ".join(_readable_placements(spec.placements) for _, _, spec in self.traced)
            actual = ", ".join(_readable_placements(p) for _, p in key if p is not None)
            warnings.warn(
                f"the backward was traced for DTensor cotangents placed {traced}; autograd gave {actual}, and "
                f"tracing the backward for them failed ({type(e).__name__}: {e}): they are redistributed to the "
                "traced placements (eager's values; the gradients' placements and collectives may differ from "
                "eager's)",
                CotangentPlacementWarning,
                stacklevel=2,
            )
            return None
        self.backward_traces.append(backward)
        return backward_fn, order, other_order

    @staticmethod
    def _positions(needed: list, names: dict[str, str], saved: list) -> list[int]:
        positions = []
        for p in needed:
            ran = names.get(p.name)
            ti.check(  # (mypy cannot infer the type of a lambda with a default argument)
                ran in saved,
                lambda p=p: f"its backward reads {p.name}, which the forward that ran did not save",  # type: ignore[misc]
            )
            positions.append(saved.index(ran))
        return positions


def backward_for_cotangent_placements(entry: Any) -> Callable | None:
    """The backward a compiled program keeps (``_integration.wrap_compiled_backwards``): its own, called through
    :class:`BackwardForCotangentPlacements` when it has DTensor cotangents; None (its own, as is) otherwise."""
    if not entry.backward_traces:
        return None
    backward_trace = entry.backward_traces[-1]
    cotangents = _unpacked(backward_trace, "cotangents") or []
    if not any(isinstance(c, DTensorProxy) for c in cotangents):
        return None
    joint = next((t for t in entry.computation_traces if _is_joint(t)), None)
    forward = next((t for t in entry.computation_traces if ti.is_split_forward(t)), None)
    cd, cs = ti.current_compile_context()
    if joint is None or forward is None or cd is None:
        return None
    return BackwardForCotangentPlacements(
        entry.backward_fn,
        backward_trace,
        forward,
        joint,
        (cd, cs, ti.current_cache_info()),
        entry.backward_traces,
        forward_prims_kept(joint),
    )
