"""dtensor ops by family; importing a family module registers its prims, grads and dispatch entries."""

from thunder_dtensor.ops import factories, pointwise  # noqa: F401
