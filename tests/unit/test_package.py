"""Package-level guarantees: import order, stable prim names, declared versions."""

import contextlib
import enum
import os
import re
import subprocess
import sys

import thunder_dtensor  # noqa: F401
from thunder_dtensor import _integration
from thunder_dtensor.dispatch import DISPATCH_TABLE
from thunder_dtensor.ops.fallback import FALLBACK_PRIMS, FallbackSymbol, fallback_name, fallback_prim
from thunder_dtensor.primitive import DTENSOR_PRIMS

import pytest
import torch

_JIT_A_PROGRAM = "import torch; f = thunder.jit(lambda x: x * 2); assert f(torch.ones(2)).tolist() == [2.0, 2.0]"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


def test_thunder_dtensor_first_then_thunder_works():
    result = _python(f"import thunder_dtensor; import thunder; {_JIT_A_PROGRAM}")
    assert result.returncode == 0, result.stderr[-3000:]


_OURS_IN_PROCESS = (
    "import sys, torch\n"
    "home = lambda x: str(getattr(x, '__module__', None) or getattr(type(x), '__module__', '')).split('.')[0]\n"
    "ours = lambda x: home(x).startswith('thunder_dtensor')  # (pip's editable-install finder is not ours)\n"
    "assert not [m for m in sys.modules if m.startswith('thunder_dtensor')], 'a module of the package was loaded'\n"
    "assert not [f for f in sys.meta_path if ours(f)], 'an import hook of the package is installed'\n"
    "assert not [n for n, a in vars(torch.Tensor).items() if ours(a)], 'torch.Tensor has an attribute of ours'\n"
)


@pytest.mark.parametrize("imports", ["import torch", "import thunder", "import torch; import thunder"])
def test_a_process_that_does_not_import_the_package_sees_nothing_of_it(imports):
    """Installing the package changes nothing for a process that does not import it: no module of it loads, no
    import hook, nothing on ``torch.Tensor`` (and no entry point a plugin loader would call). On torch >= 2.13
    plain thunder 0.2.x fails to import, as it does without the package."""
    from importlib import metadata

    assert not [e for e in metadata.entry_points(group="torch.backends") if "thunder_dtensor" in e.value]
    snapshot = "import sys, torch; before = set(vars(torch.Tensor)); hooks = list(sys.meta_path)\n"
    code = f"{snapshot}try:\n    {imports}\nexcept Exception as e:\n    print('FAILED', type(e).__name__)\n"
    code += _OURS_IN_PROCESS + "assert sys.meta_path == hooks\n"
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    if "thunder" in imports and not hasattr(torch.Tensor, "align_as"):  # torch >= 2.13: thunder 0.2.x cannot import
        assert "FAILED AttributeError" in result.stdout


def test_thunder_first_then_the_package_names_the_fix():
    """A thunder that failed to import (torch >= 2.13) cannot be imported again in that process: importing the
    package then raises an ``ImportError`` with the one-line fix."""
    code = f"try:\n    import thunder\nexcept AttributeError:\n    pass\nimport thunder_dtensor\n{_JIT_A_PROGRAM}"
    result = _python(code)
    if hasattr(torch.Tensor, "align_as"):  # thunder imports by itself on this torch: the package takes it as it is
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        assert result.returncode != 0
        assert "ImportError" in result.stderr and _integration.IMPORT_ORDER_FIX in result.stderr


def test_fallback_prim_names_derive_from_the_torch_callable():
    fallbacks = [fn for fn, d in DISPATCH_TABLE.items() if isinstance(d.dtensor_symbol, FallbackSymbol)]
    assert len(fallbacks) > 300
    names = [fallback_name(fn) for fn in fallbacks]
    assert len(set(names)) == len(names), "two torch callables share a prim name"
    assert all(name.isidentifier() for name in names)
    assert fallback_name(torch.sum) == "torch_sum"
    assert fallback_name(torch.Tensor.sum) == "Tensor_sum"
    assert fallback_name(torch.nn.functional.linear) == "nn_functional_linear"
    # the family prims (dtensor_sum_to_size_prim, dtensor_mul_prim, ...) never collide with a fallback
    made_as_fallbacks = {prim.name for prim in FALLBACK_PRIMS.values()}  # (some are made at import: the scatters)
    family = {name for name in DTENSOR_PRIMS if not name.endswith("_vjp_prim")} - made_as_fallbacks
    assert not family & {f"dtensor_{n}_prim" for n in names}


def test_fallback_prim_names_do_not_depend_on_what_ran_first():
    """A fresh process creates fallback prims in the opposite order and gets the same names as this one."""
    fns = "[torch.sum, torch.Tensor.sum, torch.cumsum, torch.nn.functional.linear]"
    code = (
        "import thunder_dtensor, torch; from thunder_dtensor.ops.fallback import fallback_prim; "
        f"print([fallback_prim(f).name for f in {fns}[::-1]][::-1])"
    )
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    here = [fallback_prim(f).name for f in eval(fns)]
    # torch.sum and Tensor.sum are one ATen op: one prim, named after the method
    assert here == ["dtensor_Tensor_sum_prim", "dtensor_Tensor_sum_prim", "dtensor_Tensor_cumsum_prim"] + [
        "dtensor_nn_functional_linear_prim"
    ]
    assert fresh.stdout.strip() == str(here)


def test_a_function_and_its_method_share_one_prim_where_they_are_one_aten_op():
    """``torch.op(x, ...)`` is ``x.op(...)`` where both bind one native function taking ``self`` first: one prim.
    ``torch.where(condition, x, y)`` is not ``x.where(condition, y)``, and Python-level functions keep their own."""
    from thunder_dtensor.ops.fallback import one_native_op

    for name in ("sum", "cumsum", "transpose", "reshape", "matmul", "masked_select", "amax"):
        function, method = getattr(torch, name), getattr(torch.Tensor, name)
        assert one_native_op(function) is method and one_native_op(method) is method
        assert fallback_prim(function) is fallback_prim(method)
    assert one_native_op(torch.where) is torch.where  # condition first: another call
    assert one_native_op(torch.split) is torch.split  # a Python function (torch/functional.py)
    assert one_native_op(torch.nn.functional.linear) is torch.nn.functional.linear


def test_declared_torch_range_is_the_tested_one():
    low, high = _integration.TORCH_TESTED_RANGE
    if os.environ.get(_integration.UNTESTED_TORCH_VARIABLE) != "1":  # (make compat checks a candidate release)
        assert low <= _integration.TORCH_VERSION < high
    pyproject = open(__file__.rsplit("/tests/", 1)[0] + "/pyproject.toml").read()
    assert f'"torch>={low},<{high}"' in pyproject


def test_multi_rank_tests_without_torchrun_fail_with_an_instruction():
    """Plain pytest on tests/distributed must not report green skips: it stops and says how to run them."""
    import os

    root = __file__.rsplit("/tests/", 1)[0]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/distributed/test_seed.py", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=300, cwd=root, env=env,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout[-2000:]
    assert "torchrun --nproc-per-node 2 -m pytest tests/distributed" in result.stdout + result.stderr


def test_trace_time_fake_runs_share_one_mode_and_restore_the_fake_tensor_logger():
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level, disabled = logger.level, logger.disabled
    with _integration.fake_tensor_mode() as mode:
        assert logger.disabled  # fake tensor's own log of a failing kernel is muted while we run ops
        outer = torch.empty(2, 3)
        assert _integration.is_fake(outer)
        with _integration.fake_tensor_mode() as nested:
            assert nested is mode
            assert (outer + torch.empty(2, 3)).shape == (2, 3)  # tensors of nested runs mix: one mode
    assert (logger.level, logger.disabled) == (level, disabled)
    with _integration.fake_tensor_mode() as again:
        assert again is mode
    logger.disabled = True  # a user's own muting survives ours
    try:
        with _integration.fake_tensor_mode():
            pass
        assert logger.disabled
    finally:
        logger.disabled = disabled


def _graph_ops(graph) -> list:
    """Each node's kind and target (placeholders are named after the function's parameters by make_fx)."""
    return [(n.op, None if n.op == "placeholder" else n.target, len(n.args)) for n in graph.nodes]


def test_aten_recorder_gives_make_fx_graphs_and_leaves_special_calls_to_make_fx():
    inputs = [((4, 3), (3, 1), torch.float32, torch.device("cpu")), ((3,), (1,), torch.float32, torch.device("cpu"))]
    examples = [torch.empty_strided(shape, stride, dtype=dtype) for shape, stride, dtype, _ in inputs]

    def plain(x, b):  # views, a reduction, a multi-output op, an in-place op on a fresh value
        y = (x + b).t().sum(0)
        first, _ = torch.split(x, 2)
        return [y.mul_(2), first, None]

    recorded = _integration.trace_aten_graph(plain, inputs)
    expected = _integration.make_fx(plain, tracing_mode="fake")(*examples).graph
    assert _graph_ops(recorded) == _graph_ops(expected)
    assert all("val" in n.meta for n in recorded.nodes if n.op != "output")

    def with_literal(x, b):  # torch.tensor(...) is a constant make_fx interns: the recorder hands it over
        return [x * torch.tensor(2.0)]

    graph = _integration.trace_aten_graph(with_literal, inputs)
    assert torch.ops.aten.lift_fresh_copy.default in [n.target for n in graph.nodes]
    assert any(n.op == "get_attr" for n in graph.nodes)


def test_aten_recorder_decomposes_as_aten_does_not_as_the_python_dispatcher_would():
    # an input expanded along its last dim: ATen's matmul folds its batch dims into one mm (they merge), torch's
    # Python decomposition, which the Python dispatcher runs, broadcasts a bmm instead; eager DTensor runs
    # ATen's, and a traced decomposition that differs places the result otherwise (fuzz seed 19748)
    from torch._dispatch.python import enable_python_dispatcher

    inputs = [
        ((4, 5, 1), (5, 1, 1), torch.float32, torch.device("cpu")),
        ((12, 4), (4, 1), torch.float32, torch.device("cpu")),
    ]

    def linear_of_expanded(y, w):
        return [torch.nn.functional.linear(y.expand(-1, -1, 4), w)]

    expected = _integration.make_fx(linear_of_expanded, tracing_mode="fake")(
        *[torch.empty_strided(shape, stride) for shape, stride, _, _ in inputs]
    ).graph
    assert torch.ops.aten.mm.default in [n.target for n in expected.nodes]
    for ambient in (contextlib.nullcontext, enable_python_dispatcher):  # (a caller's Python dispatcher too)
        with ambient():
            recorded = _integration.trace_aten_graph(linear_of_expanded, inputs)
        assert _graph_ops(recorded) == _graph_ops(expected), ambient


_OFFSET = 0.25  # a global read by the jitted program below


class _Mode(enum.Enum):  # members compare by identity
    SLOW = 1
    FAST = 2


class _KeyedModel(torch.nn.Module):
    """Module attributes, a ``ModuleDict`` (a dict subclass's reads go thunder's way), containers, unpacking,
    a bound method called as a value, calls with ``*args`` / ``**kwargs``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
        self.register_buffer("scale", torch.tensor(1.5))

    def shifted(self, y: torch.Tensor, *shifts: float, factor: float = 1.0) -> torch.Tensor:
        return (y + sum(shifts)) * factor

    def forward(self, x: torch.Tensor, table: dict, items: list, pair: tuple, modes: tuple) -> torch.Tensor:
        y = self.blocks["a"](x) * table["a"] + items[-1] * pair[0]
        if "b" in table and 3 not in items and "zz" not in "xyz" and pair[1] in {1, 2}:
            y = y + len(items[1:]) + abs(pair[1])
        if "double" in modes and None not in (modes[0], _OFFSET) and _Mode.FAST in [_Mode.SLOW, _Mode.FAST]:
            y = y * 2  # ``modes`` is read by ``in`` alone: the prologue must still check it
        first, second = pair
        *_, last = items
        try:
            y = y * table["missing"]
        except KeyError:
            y = y - _OFFSET
        shift = self.shifted
        y = shift(y, *items[:2], **{"factor": second}) + first * last
        return torch.nn.functional.relu(self.blocks["b"](y)) * self.scale


def test_interpreter_helpers_run_directly_trace_what_thunders_own_paths_trace(monkeypatch):
    """``x[k]``, ``k in x``, unpacking, global names, bound-method and ``*args`` calls skip thunder's helper
    frames and change nothing else: the same prologue and computation traces, the same results, and the
    prologue still checks the values read."""
    import thunder
    from thunder.core import interpreter

    frames = [0]
    run_frame = interpreter._setup_frame_and_run_python_function

    def counting(*args, **kwargs):
        frames[0] += 1
        return run_frame(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_setup_frame_and_run_python_function", counting)
    torch.manual_seed(0)
    model, x = _KeyedModel(), torch.randn(2, 4)
    args = ({"a": 2.0, "b": 1}, [1.0, 2.0, 4.0], (3.0, 2), ("double", "other"))
    expected = model(x, *args)

    def jit_and_trace():
        jitted = thunder.jit(model)
        frames[0] = 0
        out = jitted(x, *args)
        traces = [thunder.last_prologue_traces(jitted)[-1], thunder.last_traces(jitted)[0]]
        traces = [re.sub(r"# Constructed by .*", "", str(t)) for t in traces]  # without the time taken
        return jitted, out, traces, frames[0]

    with _integration.thunders_own_interpreter_paths():
        _, thunders_out, thunders_traces, thunders_frames = jit_and_trace()
    jitted, out, traces, direct_frames = jit_and_trace()
    torch.testing.assert_close(thunders_out, expected)
    torch.testing.assert_close(out, expected)
    assert traces == thunders_traces
    assert direct_frames < thunders_frames / 2, (direct_frames, thunders_frames)
    # values read through the direct paths are still inputs the prologue checks
    changed = ({"a": 3.0, "b": 1}, [1.0, 2.0, 5.0], (3.0, 1), ("double", "other"))
    torch.testing.assert_close(jitted(x, *changed), model(x, *changed))
    assert thunder.cache_misses(jitted) == 2
    single = (*changed[:3], ("single", "other"))
    torch.testing.assert_close(jitted(x, *single), model(x, *single))
    assert thunder.cache_misses(jitted) == 3


def test_a_search_of_a_plain_sequence_interprets_no_frame_of_its_own(monkeypatch):
    """``k in`` a list or tuple whose items and ``k`` compare by builtin ``==`` or identity (str, numbers, None,
    enum members) is Python's own ``in``: thunder interprets a generator of comparisons per search (about a
    dozen frames each), 12-19% of the first call of transformers' one-layer TP models at 2 ranks."""
    import thunder
    from thunder.core import interpreter

    frames = [0]
    run_frame = interpreter._setup_frame_and_run_python_function

    def counting(*args, **kwargs):
        frames[0] += 1
        return run_frame(*args, **kwargs)

    def searching(x, modes):
        if "double" in modes and _Mode.FAST in [_Mode.SLOW, _Mode.FAST] and 3 not in (1, 2.5, None, b"3"):
            x = x * 2
        return x

    def indexing(x, modes):
        if modes[0] == "double" and _Mode.FAST is [_Mode.SLOW, _Mode.FAST][1] and (1, 2.5, None, b"3")[0] != 3:
            x = x * 2
        return x

    monkeypatch.setattr(interpreter, "_setup_frame_and_run_python_function", counting)
    counts = {}
    for fn in (searching, indexing):
        frames[0] = 0
        torch.testing.assert_close(thunder.jit(fn)(torch.ones(2), ("double", "other")), torch.full((2,), 2.0))
        counts[fn.__name__] = frames[0]
    assert counts["searching"] == counts["indexing"], counts


def test_disassembly_and_meta_signatures_are_computed_once():
    import dis
    import inspect

    from thunder.core import interpreter, symbol

    def f(a: int, b: int = 2) -> int:
        return a + b

    first = interpreter.dis.get_instructions(f.__code__)
    assert first is interpreter.dis.get_instructions(f.__code__)
    assert [i.opname for i in first] == [i.opname for i in dis.get_instructions(f.__code__)]
    assert interpreter.dis.Instruction is dis.Instruction
    signature = symbol.inspect.signature(f)
    assert signature is symbol.inspect.signature(f)
    assert signature == inspect.signature(f)
    assert str(symbol.inspect.signature(lambda x, *, y=1: x)) == "(x, *, y=1)"


def test_one_record_per_prim_holds_its_facts():
    """Every dtensor prim has one record (``primitive.PRIMS``): runtime op, grad rules, lowering policy,
    renames, shape check, dispatch entries. ``primitive`` itself imports no op family."""
    import ast
    import pathlib

    from thunder_dtensor import primitive
    from thunder_dtensor.ops.inplace import dtensor_copy__prim, dtensor_update_aliases_prim
    from thunder_dtensor.ops.pointwise import dtensor_mul_prim

    assert len(primitive.PRIMS) == len(DTENSOR_PRIMS) > 50
    for name, record in primitive.PRIMS.items():
        assert record.symbol.name == name and DTENSOR_PRIMS[name] is record.symbol
    mul = primitive.PRIMS[dtensor_mul_prim.name]
    assert mul.runtime_fn is not None and mul.not_lowered is None and not mul.is_generic_vjp
    assert mul.generic_grad_rule is not None and mul.grad_rule is not mul.generic_grad_rule  # a dedicated rule
    assert primitive.PRIMS["dtensor_mul_vjp_prim"].is_generic_vjp
    assert primitive.PRIMS[dtensor_update_aliases_prim.name].renames_arguments
    assert "in place" in primitive.PRIMS[dtensor_copy__prim.name].not_lowered
    cumsum = primitive.PRIMS[fallback_prim(torch.cumsum).name]
    assert cumsum.shape_checked and cumsum.torch_functions == [torch.Tensor.cumsum, torch.cumsum]
    source = pathlib.Path(primitive.__file__).read_text()
    imported = [n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m and m.startswith("thunder_dtensor.ops")]


def test_declared_thunder_range_is_the_tested_one():
    """pyproject.toml declares exactly the lightning-thunder releases the package passes on (0.2.6 and the 0.2.7
    nightly measured), and the import refuses others (an older 0.2.7 nightly too) unless asked to try."""
    from looseversion import LooseVersion

    low, high = _integration.THUNDER_TESTED_RANGE
    nightly = _integration.THUNDER_TESTED_NIGHTLY
    if os.environ.get(_integration.UNTESTED_THUNDER_VARIABLE) != "1":
        assert _integration.thunder_is_tested(_integration.THUNDER_VERSION)
    tested = _integration.thunder_is_tested
    assert tested(LooseVersion("0.2.6")) and tested(LooseVersion("0.2.6.post1")) and tested(nightly)
    assert not tested(LooseVersion("0.2.7.dev20251201")) and not tested(LooseVersion("0.2.7"))
    assert not tested(LooseVersion("0.2.5"))
    pyproject = open(__file__.rsplit("/tests/", 1)[0] + "/pyproject.toml").read()
    assert f'"lightning-thunder>={low},<={nightly}"' in pyproject and str(high) in str(nightly)


def test_the_op_coverage_header_is_generated_from_the_records():
    """docs/op_coverage.md's family table and prim list are what the dispatch tables and prim records say in a
    fresh interpreter (``scripts/op_coverage.py --header-only`` rewrites them): nothing there is kept by hand."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    code = "import sys; sys.path.insert(0, 'scripts'); import op_coverage; sys.stdout.write(op_coverage.header())"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    text = (root / "docs" / "op_coverage.md").read_text()
    assert text.split("<!-- sweep ws=", 1)[0] == run.stdout
    assert "| pointwise |" in run.stdout and "`F.relu`" in run.stdout and "`dtensor_mul_prim`" in run.stdout
