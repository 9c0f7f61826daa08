"""thunder imported as a process without thunder_dtensor has it, for comparisons with and without the package.

On torch >= 2.13 thunder 0.2.x needs the removed named-tensor methods (and, on torch >= 2.14, a Python
``Function.apply``) while it imports: placeholders stand in for them during that import only, what the package's
``bootstrap`` does and nothing else. Used by ``thunder_suite_plugin`` and
``tests/unit/test_plain_programs_unchanged.py`` (``scripts`` on ``PYTHONPATH``); it lives outside the package so
that importing it loads nothing of the package.
"""

from __future__ import annotations

import sys

import torch


def import_plain_thunder() -> None:
    """Import thunder as a process without thunder_dtensor has it (placeholders only while it imports)."""
    names = ("align_as", "align_to", "has_names", "refine_names", "rename")
    missing = [n for n in names if not hasattr(torch.Tensor, n)]

    def placeholder(name: str):  # noqa: ANN202
        def removed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise AttributeError(name)

        removed.__name__, removed.__qualname__ = name, f"Tensor.{name}"
        return removed

    for name in missing:
        setattr(torch.Tensor, name, placeholder(name))
    function = torch.autograd.function.Function
    builtin_apply = None if hasattr(function.apply, "__func__") else vars(function)["apply"]
    if builtin_apply is not None:

        def apply(cls, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            return builtin_apply.__get__(None, cls)(*args, **kwargs)

        function.apply = classmethod(apply)
    import thunder  # noqa: F401

    for name in missing:
        delattr(torch.Tensor, name)
    if builtin_apply is not None:
        function.apply = builtin_apply
    assert not [m for m in sys.modules if m.startswith("thunder_dtensor")]
