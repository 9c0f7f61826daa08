"""One wrapper of thunder's ``getattr`` lookaside, with an ordered list of handlers.

Four concerns change what an attribute read in a traced program gives (gradient-hook methods of parameters,
``requires_grad`` of computed values, a jitted module's hook dicts, FSDP2's parameter reads). Each used to wrap
the lookaside over the previous one, in whatever order the installers happened to run. Now the slot is wrapped
once (:func:`read_attributes_through_handlers`), and each concern adds a handler under its name
(:func:`on_attribute_read`); :data:`ATTRIBUTE_READ_HANDLERS` states the order they run in:

* an ``instead`` handler may answer the read before thunder does (:data:`NOT_ANSWERED`: it does not); the first
  that answers wins, else thunder's own lookaside reads the attribute;
* then every ``after`` handler, in order, sees the value so far and returns it or a replacement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from thunder_dtensor._integration.registry import JIT_LOOKASIDES, expects_function, installer, patch

#: the handlers' names in the order they run: ``instead`` handlers first, then ``after`` handlers
ATTRIBUTE_READ_HANDLERS: tuple[str, ...] = (
    "register_gradient_hooks_on_real_tensors",  # instead: a parameter's gradient-hook methods are its own
    "answer_requires_grad_of_computed_values",  # after: x.view(-1).requires_grad as autograd answers it
    "read_root_module_state_from_user_module",  # after: a jitted module's hook dicts come from the user's module
    "fsdp_parameter_reads",  # after: FSDP2's parameters read inside a forward are the unsharded values
)

#: what an ``instead`` handler returns when it leaves the read to the next one (and, last, to thunder)
NOT_ANSWERED = object()

_INSTEAD: dict[str, Callable[..., Any]] = {}
_AFTER: dict[str, Callable[..., Any]] = {}
#: the handlers in their stated order, rebuilt as one is added
_ORDERED: list[tuple[Callable[..., Any], ...]] = [(), ()]


def on_attribute_read(name: str, handler: Callable[..., Any], *, when: Literal["instead", "after"]) -> None:
    """Run ``handler`` on each attribute read of a traced program, at its place in :data:`ATTRIBUTE_READ_HANDLERS`.

    ``instead``: ``handler(obj, name, *maybe_default)`` answers the read or returns :data:`NOT_ANSWERED`;
    ``after``: ``handler(obj, name, value)`` returns ``value`` or what the program reads instead. The arguments
    are the interpreter's wrapped values."""
    if name not in ATTRIBUTE_READ_HANDLERS:
        raise ValueError(f"{name!r} is not among ATTRIBUTE_READ_HANDLERS: add it there, at its place")
    (_INSTEAD if when == "instead" else _AFTER)[name] = handler
    _ORDERED[0] = tuple(_INSTEAD[n] for n in ATTRIBUTE_READ_HANDLERS if n in _INSTEAD)
    _ORDERED[1] = tuple(_AFTER[n] for n in ATTRIBUTE_READ_HANDLERS if n in _AFTER)


@installer("dtensor", "one wrapper of thunder's getattr lookaside runs the package's attribute-read handlers in order")
def read_attributes_through_handlers() -> None:
    """Wrap thunder's ``getattr`` lookaside once (the package's root, before any installer adds a handler);
    the handlers of :func:`on_attribute_read` do the work."""
    from thunder.core import interpreter, jit_ext

    lookasides = jit_ext._general_jit_lookaside_map
    thunder_getattr = lookasides[getattr]
    raised = interpreter.INTERPRETER_SIGNALS.EXCEPTION_RAISED

    def getattr_lookaside(obj: Any, name: Any, *maybe_default: Any) -> Any:
        instead, after = _ORDERED
        for handler in instead:
            value = handler(obj, name, *maybe_default)
            if value is not NOT_ANSWERED:
                break
        else:
            value = thunder_getattr(obj, name, *maybe_default)
        for handler in after:
            if value is raised:
                return value
            value = handler(obj, name, value)
        return value

    patch(
        lookasides,
        getattr,
        getattr_lookaside,
        table=JIT_LOOKASIDES,
        expects=expects_function(("thunder.core",), "obj", "name"),  # thunder's own
    )
