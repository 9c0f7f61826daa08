"""The patch registry (``thunder_dtensor/_integration/registry.py``): what the package changes in thunder and
torch is listed, checked against what it replaces, installed once, and can be undone."""

import pathlib
import types

import thunder_dtensor  # noqa: F401  (first: makes thunder importable on torch >= 2.13)
from thunder_dtensor._integration import registry

import pytest
import thunder
import torch

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_every_patch_is_listed_with_its_owner_kind_and_reason():
    patches = registry.installed()
    assert len(patches) > 40
    assert {p.kind for p in patches} == set(registry.PATCH_KINDS)
    for p in patches:
        assert p.owner in registry.installers() and p.reason and p.where.startswith(("thunder", "torch"))
    # nothing is patched twice by one installer (idempotence by key)
    slots = [(id(p.target), p.slot, p.in_table, p.owner) for p in patches]
    assert len(slots) == len(set(slots))


def test_patches_that_act_on_plain_programs_are_documented():
    text = DOCS.read_text()
    for owner, kind in registry.installers().items():
        if kind != "dtensor":
            assert f"`{owner.split('.')[-1]}`" in text, f"{owner} ({kind}) is not in docs/architecture.md"


_COUNT_AT_IMPORT = """
import json
import thunder_dtensor
from thunder_dtensor._integration import registry
patches = registry.installed()
grad = [p for p in patches if p.owner == "primitive.grad_rules"]
slots = [p for p in patches if p.owner != "primitive.grad_rules" and not p.during]
by_kind = [sum(p.kind == k for p in slots) for k in registry.PATCH_KINDS]
print(json.dumps([len(slots), len({p.owner for p in slots}), *by_kind, len(grad)]))
"""


def test_the_docs_counts_of_slots_are_the_registrys():
    """docs/architecture.md states how many slots import patches, by kind: the registry's listing in a fresh
    interpreter is the source (in this one, earlier tests have made prims, whose grad rules join on first use)."""
    import json
    import re
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _COUNT_AT_IMPORT], capture_output=True, text=True, check=True)
    slots, owners, *by_kind, grad_rules = json.loads(run.stdout.strip().splitlines()[-1])
    kinds = dict(zip(registry.PATCH_KINDS, by_kind))
    text = " ".join(DOCS.read_text().split())
    stated = re.search(r"after import: (\d+) slots from (\d+) installers, (\d+) `dtensor`, (\d+) `thunder-fix`", text)
    assert stated, "docs/architecture.md no longer states the slot counts"
    assert [int(n) for n in stated.groups()] == [slots, owners, kinds["dtensor"], kinds["thunder-fix"]]
    assert f"rules, {kinds['speedup']} `speedup`" in text
    assert f"{grad_rules} grad rules" in text


def test_an_installer_runs_once():
    before = list(registry.installed())
    thunder_dtensor._integration.run_interpreter_helpers_directly()
    thunder_dtensor._integration.make_placements_opaque()
    assert registry.installed() == before


def test_undo_restores_thunders_objects_and_reinstalling_patches_again():
    from thunder.core import interpreter

    owner = "speedups.run_interpreter_helpers_directly"
    mine = [p for p in registry.installed() if p.owner == owner]
    assert mine and all(p.kind == "speedup" for p in mine)
    handlers = interpreter._default_opcode_handler_map

    def fn(x, d):
        a, b = d["pair"]
        return x * a + b if "pair" in d else x

    x = torch.randn(3)
    expected = fn(x, {"pair": (2.0, 1.0)})
    registry.undo(owner)
    try:
        assert owner not in registry.installers()
        for p in mine:
            now = p.target[p.slot] if p.in_table else getattr(p.target, p.slot)
            assert now is p.original
        assert handlers["BINARY_SUBSCR"].__module__ == "thunder.core.interpreter"
        torch.testing.assert_close(thunder.jit(fn)(x, {"pair": (2.0, 1.0)}), expected)
    finally:
        thunder_dtensor._integration.run_interpreter_helpers_directly()
    assert [p.where for p in registry.installed() if p.owner == owner] == [p.where for p in mine]
    assert handlers["BINARY_SUBSCR"].__module__.startswith("thunder_dtensor")
    torch.testing.assert_close(thunder.jit(fn)(x, {"pair": (2.0, 1.0)}), expected)


def _layout_a_release_might_change() -> types.SimpleNamespace:
    def hook(trace, executors_list):
        return trace

    hook.__module__ = "thunder.common"
    return types.SimpleNamespace(first=hook, second=hook, table={})


def test_a_changed_layout_fails_loudly_naming_the_slot_and_changes_nothing():
    target = _layout_a_release_might_change()
    original = target.first

    @registry.installer("dtensor", "a test patch")
    def install_against_the_wrong_signature() -> None:
        registry.patch(target, "first", lambda trace, executors: trace, expects=registry.expects_function("thunder"))
        registry.patch(target, "second", len, expects=registry.expects_function("thunder.common", "trace", "executors"))

    with pytest.raises(registry.IntegrationError, match=r"\.second: expected a function of thunder.common taking"):
        install_against_the_wrong_signature()
    # the installer's first patch was undone with it, and it is not counted as installed
    assert target.first is original
    assert not [p for p in registry.installed() if p.target is target]
    assert not [name for name in registry.installers() if name.endswith("install_against_the_wrong_signature")]


def test_table_entries_and_their_checks():
    target = _layout_a_release_might_change()

    @registry.installer("speedup", "a test patch")
    def install_table_entries() -> None:
        registry.patch(target.table, "new", 1, table="a test table", expects=registry.expects_absent)

    install_table_entries()
    try:
        (p,) = [p for p in registry.installed() if p.target is target.table]
        assert p.where == "a test table[new]" and target.table == {"new": 1} and p.kind == "speedup"
        with pytest.raises(RuntimeError, match="inside an @installer"):
            registry.patch(target.table, "other", 2, table="a test table", expects=registry.expects_absent)
    finally:
        registry.undo(p.owner)
    assert target.table == {}
    assert registry.expects_absent(1) == "no entry"
    assert registry.expects_identical(torch)(torch) is None and registry.expects_identical(torch)(thunder)


def test_scoped_entries_are_listed_in_place_only_inside_their_block_and_undone():
    table: dict = {}

    @registry.installer("speedup", "a test patch")
    def install_scoped() -> None:
        entries = registry.scoped_entries(table, {"rule": 1}, table_name="a test table", during="a test call")
        target.entries = entries

    target = types.SimpleNamespace()
    install_scoped()
    (p,) = [p for p in registry.installed() if p.target is table]
    try:
        assert "only during a test call" in str(p) and table == {}
        with target.entries:
            with target.entries:  # nested: the outer block's entry stays until the outer block ends
                assert table == {"rule": 1}
            assert table == {"rule": 1}
        assert table == {}
        with pytest.raises(RuntimeError, match="inside an @installer"):
            registry.scoped_entries(table, {"other": 2}, table_name="a test table", during="a test call")
        with target.entries:  # undone inside its block (a call in flight): the entry goes with the installer
            registry.undo(p.owner)
            assert table == {}
        assert table == {}
    finally:
        if p.owner in registry.installers():
            registry.undo(p.owner)
    assert not [q for q in registry.installed() if q.target is table]


def test_dtensors_rule_tables_are_changed_only_during_thunderfx_calls_and_listed():
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    scoped = [p for p in registry.installed() if p.target is propagator.op_strategy_funcs]
    assert scoped, "the thunderfx-scoped sharding rules are not listed"
    for p in scoped:
        assert p.during and p.where.startswith("torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator")
        assert p.slot not in propagator.op_strategy_funcs  # eager DTensor sees torch's tables as they are


def test_undo_is_all_or_nothing_and_names_the_installer_to_undo_first():
    target = _layout_a_release_might_change()
    first, second = target.first, target.second

    @registry.installer("speedup", "a test patch")
    def install_both() -> None:
        registry.patch(target, "first", lambda trace, executors_list: trace, expects=registry.expects_identical(first))
        registry.patch(
            target, "second", lambda trace, executors_list: trace, expects=registry.expects_identical(second)
        )

    @registry.installer("speedup", "a test patch over another")
    def wrap_second() -> None:
        registry.patch(target, "second", lambda trace, executors_list: trace, expects=lambda original: None)

    install_both()
    wrap_second()
    both = next(p.owner for p in registry.installed() if p.target is target)
    over = [p.owner for p in registry.installed() if p.target is target][-1]
    patched_first = target.first
    with pytest.raises(registry.IntegrationError, match=rf"{both} cannot be undone: .*\.second .*by {over}"):
        registry.undo(both)
    assert target.first is patched_first  # nothing was restored
    registry.undo(over)
    registry.undo(both)
    assert target.first is first and target.second is second
    assert not [p for p in registry.installed() if p.target is target]


def test_an_installer_called_again_with_other_arguments_raises():
    target = types.SimpleNamespace(slot=len)

    @registry.installer("speedup", "a test patch")
    def install(value: object) -> None:
        registry.patch(target, "slot", value, expects=registry.expects_identical(len))

    install(abs)
    try:
        install(abs)  # the same arguments: installed already, nothing to do
        with pytest.raises(registry.IntegrationError, match="installed already, with other arguments"):
            install(max)
        assert target.slot is abs
    finally:
        registry.undo(next(p.owner for p in registry.installed() if p.target is target))
    assert target.slot is len


def test_undo_puts_back_what_the_class_itself_held():
    """A classmethod is restored as the classmethod object (``getattr`` gives a new bound method each time)."""

    class Holder:
        @classmethod
        def make(cls) -> str:
            return cls.__name__

    class Child(Holder):
        pass

    held = vars(Holder)["make"]

    @registry.installer("speedup", "a test patch")
    def install() -> None:
        registry.patch(Holder, "make", classmethod(lambda cls: "patched"), expects=lambda original: None)
        registry.patch(Child, "make", classmethod(lambda cls: "child"), expects=lambda original: None)

    install()
    assert Child.make() == "child" and Holder.make() == "patched"
    registry.undo(next(p.owner for p in registry.installed() if p.target is Holder))
    assert vars(Holder)["make"] is held and "make" not in vars(Child) and Child.make() == "Child"


def test_layout_checks_name_what_they_expect_and_errors_name_the_declared_versions():
    target = _layout_a_release_might_change()
    name = f"thunder.common.{target.first.__qualname__}"
    check = registry.expects_qualified(name, "trace")
    assert check(target.first) is None
    assert check(len) == f"{name}(trace, ...)"
    assert registry.expects_qualified(name, "executors")(target.first) == f"{name}(executors, ...)"

    @registry.installer("dtensor", "a test patch")
    def install_over_another_function() -> None:
        registry.patch(target, "first", len, expects=registry.expects_qualified("thunder.common.other_hook"))

    with pytest.raises(registry.IntegrationError) as error:
        install_over_another_function()
    message = str(error.value)
    assert "expected thunder.common.other_hook, found thunder.common" in message
    assert registry.declared_versions() in message and "lightning-thunder 0.2.6" in message
    assert not hasattr(registry, "expects_any")  # no patch of the package accepts whatever a slot holds


_INSTALLER_CALLERS = """
import sys

callers = []


def note(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "install" and frame.f_code.co_filename.endswith("registry.py"):
        modules, f = [], frame.f_back
        while f is not None:  # every module body on the stack, as its file
            if f.f_code.co_name == "<module>" and "thunder_dtensor" in f.f_code.co_filename:
                modules.append(f.f_code.co_filename.split("thunder_dtensor")[-1])
            f = f.f_back
        callers.append((frame.f_locals["record"].name, modules))


sys.setprofile(note)
import thunder_dtensor  # noqa: E402

sys.setprofile(None)
print(repr(callers))
"""


def test_installers_run_from_the_packages_root_only():
    """No module installs anything as it is imported: every installer runs inside the body of
    ``thunder_dtensor/__init__.py`` alone (directly, or in a feature module's ``install()`` called there)."""
    import ast
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _INSTALLER_CALLERS], capture_output=True, text=True, check=True)
    callers = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert len(callers) > 30
    elsewhere = [(name, modules) for name, modules in callers if modules != ["/__init__.py"]]
    assert not elsewhere, elsewhere


def test_thunders_getattr_lookaside_is_wrapped_once_with_handlers_in_their_stated_order():
    from thunder_dtensor._integration import attribute_reads

    wrappers = [p for p in registry.installed() if p.in_table and p.slot is getattr]
    assert [p.owner for p in wrappers] == ["attribute_reads.read_attributes_through_handlers"]
    instead, after = attribute_reads._ORDERED
    assert instead == (attribute_reads._INSTEAD["register_gradient_hooks_on_real_tensors"],)
    assert after == tuple(attribute_reads._AFTER[n] for n in attribute_reads.ATTRIBUTE_READ_HANDLERS[1:])
    with pytest.raises(ValueError, match="not among ATTRIBUTE_READ_HANDLERS"):
        attribute_reads.on_attribute_read("unlisted", lambda obj, name, value: value, when="after")
