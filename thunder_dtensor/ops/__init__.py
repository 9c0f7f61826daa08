"""dtensor ops by family; importing a family module registers its prims, grads and dispatch entries.

The generic fallback comes last: it wraps whatever thunder knows that no family claimed.
"""

from thunder_dtensor.ops import attention, dropout, embedding, factories, pointwise, redistribute
from thunder_dtensor.ops.fallback import register_fallbacks

register_fallbacks()

__all__ = ["attention", "dropout", "embedding", "factories", "pointwise", "redistribute"]
