"""Errors that name the op, its inputs' placements and a hint."""

from __future__ import annotations

from typing import Any

from thunder_dtensor import _integration as ti

__all__ = ["DTensorOpError", "describe_argument"]


def describe_argument(x: Any) -> str:
    from thunder_dtensor.proxy import DTensorProxy

    if isinstance(x, DTensorProxy):
        return f"DTensor {x.dtype.shortname()}{list(x.shape)} placements={x.placements} mesh={x.device_mesh}"
    if isinstance(x, ti.TensorProxy):
        return f"torch.Tensor {x.dtype.shortname()}{list(x.shape)} (not a DTensor)"
    return repr(x)


class DTensorOpError(RuntimeError):
    """A DTensor op that cannot run on the given inputs, reported at trace time."""

    def __init__(self, op_name: str, args: tuple, kwargs: dict, cause: BaseException | str):
        from thunder_dtensor.proxy import DTensorProxy

        flat, _ = ti.tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, ti.TensorProxy)]
        lines = [f"{op_name}: {cause}"]
        lines += [f"  input {i}: {describe_argument(t)}" for i, t in enumerate(tensors)]
        if any(not isinstance(t, DTensorProxy) for t in tensors):
            hint = (
                "convert every torch.Tensor argument to a DTensor first, with DTensor.from_local(t, mesh, placements) "
                "or distribute_tensor(t, mesh, placements), as eager DTensor requires"
            )
        else:
            hint = "redistribute the inputs to placements this op supports, e.g. x.redistribute(mesh, [Replicate()])"
        lines.append(f"  hint: {hint}")
        super().__init__("\n".join(lines))
        self.op_name = op_name
