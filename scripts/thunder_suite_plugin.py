"""pytest plugins to run lightning-thunder's own test suite with and without this package (``make thunder-suite``).

``-p thunder_suite_plugin`` (``scripts`` on ``PYTHONPATH``) imports thunder as a process without this package
has it: on
torch >= 2.13 thunder 0.2.x needs the removed named-tensor methods while it imports, so placeholders stand in
for them during that import only (what ``bootstrap`` does, and nothing else). With ``THUNDER_SUITE_MODE=package``
the plugin imports ``thunder_dtensor`` first instead, as a user of the package would.
"""

from __future__ import annotations

import os
import sys

import torch

MODE_VARIABLE = "THUNDER_SUITE_MODE"


def _import_plain_thunder() -> None:
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


if os.environ.get(MODE_VARIABLE, "plain") == "package":
    import thunder_dtensor  # noqa: F401
else:
    _import_plain_thunder()
