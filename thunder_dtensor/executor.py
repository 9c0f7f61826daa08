"""The executor that runs every dtensor prim; no other executor claims them."""

from __future__ import annotations

from thunder_dtensor import _integration as ti

__all__ = ["dtensor_ex"]

#: joins the executors of a program that traces a DTensor (whatever executors the user passes to jit), and of
#: no other program
dtensor_ex = ti.OperatorExecutor("dtensor")
ti.add_dtensor_executor(dtensor_ex)
