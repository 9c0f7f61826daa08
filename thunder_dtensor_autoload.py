"""Makes ``import thunder`` work before ``import thunder_dtensor`` on torch >= 2.13.

thunder 0.2.x lists five named-tensor methods that torch 2.13 removed, so importing it fails unless
``thunder_dtensor`` (which supplies them while thunder imports) comes first. torch calls :func:`install`
when it is imported (its ``torch.backends`` plugin entry point; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns
that off). This module is top-level and imports nothing heavy: torch is still initialising when it runs.

* ``import torch`` then ``import thunder``: the import of thunder imports ``thunder_dtensor``, which imports
  thunder the way it needs on this torch.
* ``import thunder`` first (thunder is mid-import when it imports torch): the missing methods are supplied
  as placeholders that raise ``AttributeError`` when called, so thunder's import completes;
  ``import thunder_dtensor`` later removes them again.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

#: the named-tensor methods thunder 0.2.x needs at import time (torch >= 2.13 has none of them)
REMOVED_NAMED_TENSOR_METHODS = ("align_as", "align_to", "has_names", "refine_names", "rename")

#: placeholders added while thunder was imported before thunder_dtensor (removed by thunder_dtensor)
installed_placeholders: dict[str, Any] = {}


def named_tensor_placeholder(name: str, torch_version: str) -> Any:
    def removed(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError(f"torch.Tensor.{name} does not exist in torch {torch_version}")

    removed.__name__ = name
    removed.__qualname__ = f"Tensor.{name}"
    return removed


class _ThunderViaThunderDTensor(importlib.abc.Loader):
    """Loads thunder by importing thunder_dtensor, which imports thunder itself."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        import thunder_dtensor  # noqa: F401

        module = sys.modules["thunder"]
        self._thunder_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._thunder_spec  # the import system set ours: thunder keeps its own


class _ThunderFinder(importlib.abc.MetaPathFinder):
    """Intercepts the first ``import thunder`` (only that one) when thunder_dtensor is not imported yet."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "thunder":
            return None
        sys.meta_path.remove(self)
        if "thunder_dtensor" in sys.modules:  # thunder_dtensor is importing thunder: nothing to do
            return None
        return importlib.machinery.ModuleSpec("thunder", _ThunderViaThunderDTensor())


def install() -> None:
    """torch's plugin hook: prepare for thunder's import if this torch lacks what thunder 0.2.x needs."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    if tensor is None or all(hasattr(tensor, name) for name in REMOVED_NAMED_TENSOR_METHODS):
        return
    if "thunder" in sys.modules:  # thunder is importing torch: it will need the methods in a moment
        version = getattr(torch, "__version__", "?")
        for name in REMOVED_NAMED_TENSOR_METHODS:
            if not hasattr(tensor, name):
                installed_placeholders[name] = named_tensor_placeholder(name, version)
                setattr(tensor, name, installed_placeholders[name])
    elif not any(isinstance(finder, _ThunderFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ThunderFinder())
