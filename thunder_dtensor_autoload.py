"""torch's plugin hook for thunder_dtensor: by default it only names the fix when thunder cannot import.

thunder 0.2.x reads five named-tensor methods that torch 2.13 removed, so ``import thunder`` fails there unless
``thunder_dtensor`` (which supplies them while thunder imports) comes first. torch calls :func:`install` on
every ``import torch`` (the package's ``torch.backends`` entry point), in every process of the environment, so
it must change nothing for a process that does not import this package, and it must never make ``import
torch`` fail:

* **By default**, and only where this torch lacks those methods and thunder is being imported without
  ``thunder_dtensor``: reading one of the methods raises an ``AttributeError`` that names the fix (import
  ``thunder_dtensor`` first, or opt in below) instead of torch's bare one. Nothing else changes: the methods
  stay missing (``hasattr`` is False), and thunder's import fails where it failed before.
* **Opt-in** (``THUNDER_DTENSOR_AUTOLOAD=1``): ``import thunder`` works in any order. After ``import torch``
  the first ``import thunder`` imports ``thunder_dtensor``, which imports thunder the way this torch needs
  (and so applies every patch of the package); if thunder itself is importing torch, the methods are supplied
  as placeholders that raise when called, which ``import thunder_dtensor`` later removes (and, on torch >= 2.14,
  ``autograd.Function.apply`` as a Python classmethod, which it restores).

The module is top-level and imports nothing heavy: torch is still initialising when it runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

#: the named-tensor methods thunder 0.2.x needs at import time (torch >= 2.13 has none of them)
REMOVED_NAMED_TENSOR_METHODS = ("align_as", "align_to", "has_names", "refine_names", "rename")

#: set to "1" to make ``import thunder`` import thunder_dtensor (and so work on torch >= 2.13) in any order
OPT_IN_VARIABLE = "THUNDER_DTENSOR_AUTOLOAD"

#: placeholders added while thunder was imported before thunder_dtensor (removed by thunder_dtensor)
installed_placeholders: dict[str, Any] = {}
#: torch >= 2.14 implements ``autograd.Function.apply`` in C, and thunder 0.2.x reads ``apply.__func__`` when it
#: is imported: (torch's apply, the Python stand-in) while thunder imports before thunder_dtensor (restored by it)
installed_function_apply: list[Any] = []


def python_function_apply(builtin: Any) -> Any:
    """A Python function for ``classmethod(...)`` that calls torch's C ``Function.apply`` (thunder keys by it)."""

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return builtin.__get__(None, cls)(*args, **kwargs)

    return apply


def named_tensor_placeholder(name: str, torch_version: str) -> Any:
    def removed(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError(f"torch.Tensor.{name} does not exist in torch {torch_version}")

    removed.__name__ = name
    removed.__qualname__ = f"Tensor.{name}"
    return removed


class _RemovedMethod:
    """What reading a removed named-tensor method raises while thunder imports without thunder_dtensor.

    Still an ``AttributeError`` (``hasattr`` stays False), with the fix in its message.
    """

    def __init__(self, name: str, torch_version: str) -> None:
        self.name, self.torch_version = name, torch_version

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        raise AttributeError(
            f"torch.Tensor.{self.name} was removed in torch {self.torch_version}, and lightning-thunder 0.2.x "
            f"reads it when it is imported: in a new process, import thunder_dtensor before thunder (it supplies "
            f"the method while thunder imports), or set {OPT_IN_VARIABLE}=1 to make `import thunder` do that in "
            "any order"
        )


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
    """Acts on the first ``import thunder`` (only that one) when thunder_dtensor is not imported yet."""

    def __init__(self, opted_in: bool) -> None:
        self.opted_in = opted_in

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "thunder":
            return None
        sys.meta_path.remove(self)
        if "thunder_dtensor" in sys.modules:  # thunder_dtensor is importing thunder: nothing to do
            return None
        if self.opted_in:
            return importlib.machinery.ModuleSpec("thunder", _ThunderViaThunderDTensor())
        _name_the_fix(sys.modules["torch"])
        return None  # thunder imports as it would without this package


def _missing_methods(tensor: Any) -> list[str]:
    # looked up along the MRO, descriptors unread: torch 2.10 / 2.11 define some on the C base class only
    return [name for name in REMOVED_NAMED_TENSOR_METHODS if not any(name in vars(k) for k in tensor.__mro__)]


def _name_the_fix(torch: Any) -> None:
    for name in _missing_methods(torch.Tensor):
        setattr(torch.Tensor, name, _RemovedMethod(name, getattr(torch, "__version__", "?")))


def install() -> None:
    """torch's plugin hook. Never raises: a failure here would make ``import torch`` fail."""
    try:
        _install()
    except Exception:  # noqa: BLE001 (the hook must never break torch's import)
        pass


def _install() -> None:
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    if tensor is None or "thunder_dtensor" in sys.modules or not _missing_methods(tensor):
        return  # this torch imports thunder as it is, or the package is already in charge
    opted_in = os.environ.get(OPT_IN_VARIABLE, "") == "1"
    if "thunder" in sys.modules:  # thunder is importing torch: it reads the methods in a moment
        if not opted_in:
            _name_the_fix(torch)
            return
        version = getattr(torch, "__version__", "?")
        for name in _missing_methods(tensor):
            installed_placeholders[name] = named_tensor_placeholder(name, version)
            setattr(tensor, name, installed_placeholders[name])
        function = torch.autograd.function.Function
        if not hasattr(function.apply, "__func__"):
            builtin = vars(function)["apply"]
            installed_function_apply[:] = [builtin, python_function_apply(builtin)]
            function.apply = classmethod(installed_function_apply[1])
    elif not any(isinstance(finder, _ThunderFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ThunderFinder(opted_in))
