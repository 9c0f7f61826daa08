"""The compacted prologue's module lookups read nn.Module's dicts directly only where ``getattr`` would end there.

``guards._submodule_step_impl`` / ``_fetch_parameter_impl`` / ``_fetch_buffer_impl`` skip the failed attribute
lookup that reaches ``nn.Module.__getattr__`` (about 1 µs each). Every case where ``getattr`` answers otherwise
(an instance attribute, a class attribute or property, a class's own ``__getattr__``) must still give what
``getattr`` gives, as thunder's unpacking does; each case here is checked against that reference.
"""

from __future__ import annotations

from typing import Any

from thunder_dtensor import guards

import pytest
import torch


def _reference_submodule(parent: torch.nn.Module, name: str) -> Any:
    child = getattr(parent, name)
    if not isinstance(child, torch.nn.Module):
        raise AttributeError(name)
    return child


def _reference_parameter(owner: torch.nn.Module, name: str) -> Any:
    param = getattr(owner, name)
    if not isinstance(param, torch.nn.Parameter):
        raise AttributeError(name)
    return param


def _same(fast: Any, reference: Any, *args: Any) -> None:
    """``fast(*args)`` returns the very object ``reference(*args)`` returns, or both raise AttributeError."""
    try:
        expected = reference(*args)
    except AttributeError:
        with pytest.raises(AttributeError):
            fast(*args)
        return
    assert fast(*args) is expected


class _WithProperty(torch.nn.Module):
    @property
    def child(self) -> torch.nn.Module:  # a property shadows the submodule registered under the same name
        return self._modules["other"]


class _WithGetattr(torch.nn.Module):
    def __getattr__(self, name: str) -> Any:
        if name == "child":
            return self._modules["other"]
        return super().__getattr__(name)


def _parent(cls: type = torch.nn.Module) -> torch.nn.Module:
    parent = cls()
    parent.add_module("child", torch.nn.Linear(2, 2))
    parent.add_module("other", torch.nn.ReLU())
    parent.register_buffer("buf", torch.zeros(2))
    return parent


def test_a_plain_module_is_read_from_its_dicts():
    parent = _parent()
    step = guards._submodule_step_impl
    assert step(parent, "child") is parent._modules["child"]
    assert step(None, "child") is None
    weight = guards._fetch_parameter_impl(None, "child.weight", parent.child, "weight")
    assert weight is parent.child._parameters["weight"]
    assert guards._fetch_buffer_impl(None, "buf", parent, "buf") is parent._buffers["buf"]
    for name in ("missing", "buf"):  # no such attribute; a buffer is not a submodule
        _same(step, _reference_submodule, parent, name)
    _same(lambda o, n: guards._fetch_parameter_impl(None, "", o, n), _reference_parameter, parent.child, "missing")


def test_every_other_answer_of_getattr_is_kept():
    # an instance attribute set past nn.Module.__setattr__ shadows the registered submodule and parameter
    parent = _parent()
    replacement = torch.nn.Tanh()
    object.__setattr__(parent, "child", replacement)
    assert parent.child is replacement
    _same(guards._submodule_step_impl, _reference_submodule, parent, "child")
    shadow = torch.ones(2)
    object.__setattr__(parent, "buf", shadow)
    assert guards._fetch_buffer_impl(None, "buf", parent, "buf") is shadow
    linear = torch.nn.Linear(2, 2)
    object.__setattr__(linear, "weight", torch.nn.Parameter(torch.ones(2, 2)))
    _same(lambda o, n: guards._fetch_parameter_impl(None, "", o, n), _reference_parameter, linear, "weight")
    object.__setattr__(linear, "bias", torch.ones(2))  # a plain tensor: not a parameter, as torch's lookup says
    _same(lambda o, n: guards._fetch_parameter_impl(None, "", o, n), _reference_parameter, linear, "bias")
    # a class attribute (a property) of the same name, and a class's own __getattr__
    for cls in (_WithProperty, _WithGetattr):
        parent = cls()
        parent._modules["child"] = torch.nn.Linear(2, 2)  # (a property blocks add_module's name check)
        parent.add_module("other", torch.nn.ReLU())
        _same(guards._submodule_step_impl, _reference_submodule, parent, "child")
        assert guards._submodule_step_impl(parent, "child") is not parent._modules["child"]
    # a None slot (register_module(name, None)) is no module
    parent = _parent()
    parent.register_module("empty", None)
    _same(guards._submodule_step_impl, _reference_submodule, parent, "empty")
