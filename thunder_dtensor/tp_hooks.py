"""Tensor-parallel module hooks as lookasides: thunder's interpreter does not step through them.

``parallelize_module`` installs hooks whose whole effect is known to this package: turn a module's inputs or
outputs into DTensors of given placements (``DTensor.from_local``), redistribute them, and unwrap them
(``to_local``). Interpreting that Python code bytecode by bytecode costs a tensor-parallel model most of its
first-call time, so each style function runs here, whole, on the proxies: the same checks and branches,
calling the same dtensor symbols the interpreted code reaches. A style function a user overrides in a
subclass is another function and is interpreted as before. Keyed by torch's own functions (torch 2.13),
through :func:`thunder_dtensor._integration.tensor_parallel_style_functions`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thunder_dtensor import _integration as ti
from thunder_dtensor.ops.redistribute import dtensor_from_local, dtensor_redistribute, dtensor_to_local
from thunder_dtensor.proxy import DTensorProxy


def _as_dtensor(x: Any, mesh: Any, placements: tuple) -> Any:
    """``x`` if it is a DTensor, else ``DTensor.from_local(x, mesh, placements, run_check=False)``."""
    return x if isinstance(x, DTensorProxy) else dtensor_from_local(x, mesh, placements, run_check=False)


def _to_local_if(use_local_output: Any, x: Any) -> Any:
    return dtensor_to_local(x) if use_local_output else x


def _sharded_linear_input(input_layouts: Any, desired_input_layouts: Any, mod: Any, inputs: Any, mesh: Any) -> Any:
    """``ColwiseParallel`` / ``RowwiseParallel`` input: annotate with ``input_layouts``, move to the desired ones."""
    x = _as_dtensor(inputs[0], mesh, input_layouts)
    if input_layouts != desired_input_layouts:
        x = dtensor_redistribute(x, placements=desired_input_layouts, async_op=True)
    return x


def _sharded_linear_output(output_layouts: Any, use_local_output: Any, mod: Any, outputs: Any, mesh: Any) -> Any:
    """``ColwiseParallel`` / ``RowwiseParallel`` output: to ``output_layouts`` (a collective if needed)."""
    if outputs.placements != output_layouts:
        outputs = dtensor_redistribute(outputs, placements=output_layouts, async_op=True)
    return _to_local_if(use_local_output, outputs)


def _sequence_parallel_input(sequence_sharding: Any, mod: Any, inputs: Any, mesh: Any) -> Any:
    x = inputs[0]
    if isinstance(x, DTensorProxy):
        if x.placements != sequence_sharding:
            x = dtensor_redistribute(x, placements=sequence_sharding, async_op=True)
        return x
    if isinstance(x, ti.TensorProxy):
        return dtensor_from_local(x, mesh, sequence_sharding, run_check=False)
    raise ValueError(f"expecting input of {mod} to be a torch.Tensor or DTensor, but got {x}")


def _sequence_parallel_output(use_local_output: Any, mod: Any, outputs: Any, mesh: Any) -> Any:
    return _to_local_if(use_local_output, outputs)


def _prepare_input_arg(style: Any, x: Any, mesh: Any, input_layout: Any, desired_layout: Any) -> Any:
    """``PrepareModuleInput``, one argument."""
    if input_layout is None:
        return x
    if not isinstance(x, DTensorProxy):
        if not isinstance(x, ti.TensorProxy):
            raise AssertionError("expecting input to be a torch.Tensor!")
        x = dtensor_from_local(x, mesh, (input_layout,), run_check=False)
    if desired_layout is not None and input_layout != desired_layout:
        x = dtensor_redistribute(x, placements=(desired_layout,))
    return _to_local_if(style.use_local_output, x)


def _prepare_module_input(style: Any, inputs: Any, mesh: Any) -> Any:
    """``PrepareModuleInput``: every positional input with a layout becomes a DTensor of its desired layout."""
    if style.input_layouts is None:
        return inputs
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if len(inputs) != len(style.input_layouts):
        raise ValueError("module inputs and input_layouts should have same length!")
    if style.desired_input_layouts is None:
        raise AssertionError("desired module inputs should not be None!")
    layouts = zip(inputs, style.input_layouts, style.desired_input_layouts)
    return tuple(_prepare_input_arg(style, x, mesh, layout, desired) for x, layout, desired in layouts)


def _prepare_module_output(style: Any, outputs: Any, mesh: Any) -> Any:
    """``PrepareModuleOutput``: every output with a layout becomes a DTensor of its desired layout."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    if len(outputs) != len(style.output_layouts):
        raise ValueError("module outputs and output_layouts should have same length!")
    prepared = []
    for out, layout, desired in zip(outputs, style.output_layouts, style.desired_output_layouts):
        if layout is None:
            prepared.append(out)
            continue
        x = _as_dtensor(out, mesh, (layout,))
        if layout != desired:
            x = dtensor_redistribute(x, placements=(desired,))
        prepared.append(_to_local_if(style.use_local_output, x))
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


#: torch's style function (by ``Class.function``) -> the same function on proxies
STYLE_LOOKASIDES: dict[str, Callable] = {
    "ColwiseParallel._prepare_input_fn": _sharded_linear_input,
    "ColwiseParallel._prepare_output_fn": _sharded_linear_output,
    "RowwiseParallel._prepare_input_fn": _sharded_linear_input,
    "RowwiseParallel._prepare_output_fn": _sharded_linear_output,
    "SequenceParallel._prepare_input_fn": _sequence_parallel_input,
    "SequenceParallel._prepare_output_fn": _sequence_parallel_output,
    "PrepareModuleInput._prepare_input_fn": _prepare_module_input,
    "PrepareModuleInput._prepare_input_arg": _prepare_input_arg,
    "PrepareModuleOutput._prepare_out_fn": _prepare_module_output,
}


#: the attributes of a style object its methods read: read through the interpreter (see register_lookaside)
STYLE_ATTRIBUTES = {
    "PrepareModuleInput": ("input_layouts", "desired_input_layouts", "use_local_output"),
    "PrepareModuleOutput": ("output_layouts", "desired_output_layouts", "use_local_output"),
}


@ti.installer("dtensor", "parallelize_module's hooks run whole, as lookasides (their prologue checks kept)")
def install() -> None:
    torch_functions = ti.tensor_parallel_style_functions()
    prepare_input_arg = torch_functions["PrepareModuleInput._prepare_input_arg"]

    def calls_torchs_prepare_input_arg(style: Any, *args: Any) -> bool:
        # the lookaside does the per-argument step itself: a subclass that overrides it is interpreted
        return type(style)._prepare_input_arg is prepare_input_arg

    for name, lookaside in STYLE_LOOKASIDES.items():
        applies = calls_torchs_prepare_input_arg if name == "PrepareModuleInput._prepare_input_fn" else None
        attributes = STYLE_ATTRIBUTES.get(name.split(".")[0], ())
        ti.register_lookaside(torch_functions[name], lookaside, applies=applies, self_attributes=attributes)
