"""dtensor ops by family; importing a family module registers its prims, grads and dispatch entries.

In-place ops come after the families (``F.relu(x, inplace=True)`` wraps pointwise's relu). The generic
fallback comes last: it wraps whatever thunder knows that no family claimed.
"""

from thunder_dtensor.ops import attention, dropout, embedding, factories, pointwise, redistribute
from thunder_dtensor.ops import inplace
from thunder_dtensor.ops.fallback import register_fallbacks

register_fallbacks()

__all__ = ["attention", "dropout", "embedding", "factories", "inplace", "pointwise", "redistribute"]
