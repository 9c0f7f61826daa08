"""The executor that runs every dtensor prim; no other executor claims them."""

from __future__ import annotations

from thunder_dtensor import _integration as ti

__all__ = ["dtensor_ex"]

#: Registered as an "always" executor so dtensor prims run whatever executors the user passes to jit.
dtensor_ex = ti.OperatorExecutor("dtensor")
ti.register_executor(dtensor_ex)
ti.add_always_executor(dtensor_ex)
