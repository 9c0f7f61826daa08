"""dtensor ops by family; importing a family module registers its prims, grads and dispatch entries.

In-place ops wrap family symbols (``F.relu(x, inplace=True)`` is pointwise's relu otherwise; ``inplace``
imports ``pointwise`` first). The generic fallback comes last: it wraps whatever thunder knows that no
family claimed.
"""

from thunder_dtensor.ops import (
    attention,
    distribute,
    dropout,
    embedding,
    factories,
    inplace,
    losses,
    matmul,
    pointwise,
    redistribute,
    scalars,
)
from thunder_dtensor.ops.fallback import register_fallbacks

register_fallbacks()

__all__ = [
    "attention",
    "distribute",
    "dropout",
    "embedding",
    "factories",
    "inplace",
    "losses",
    "matmul",
    "pointwise",
    "redistribute",
    "scalars",
]
