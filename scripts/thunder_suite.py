"""Run lightning-thunder's own CPU tests of plain programs with and without ``import thunder_dtensor`` first and
compare the outcomes test by test (issue 40: importing the package changes DTensor programs only).

    python scripts/thunder_suite.py [--files test_core test_grad ...] [--out DIR]

Each mode runs in its own pytest process over thunder's installed tests (``thunder/tests``), in parallel; the
plugin ``scripts/thunder_suite_plugin.py`` imports thunder as a process without the package has it, or the
package first. Exit status 1 when any test's outcome differs; the differing tests are printed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import torch  # noqa: F401  (find thunder without importing it)

#: thunder's test modules of plain programs that run on CPU without optional executors
DEFAULT_FILES = (
    "test_core", "test_grad", "test_update_aliases", "test_interpreter", "test_jit_general", "test_transforms",
    "test_extend", "test_inplace_copy", "test_autocast", "test_examine", "test_check_trace", "test_patterns",
    "test_pythonex", "test_torch_library_custom_op", "test_dynamo",
)  # fmt: skip
SCRIPTS = pathlib.Path(__file__).resolve().parent


def _thunder_tests() -> pathlib.Path:
    import importlib.util

    spec = importlib.util.find_spec("thunder")
    assert spec is not None and spec.origin is not None, "lightning-thunder is not installed"
    return pathlib.Path(spec.origin).parent / "tests"


def _outcomes(junit: pathlib.Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = kinds[0] if kinds else "passed"
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES))
    parser.add_argument("--out", default="thunder_suite_out")
    parser.add_argument("-k", default=None, help="pytest -k expression, for both modes")
    parser.add_argument("--plain-from", default=None, help="reuse the outcomes without the package from this --out")
    parser.add_argument("--plain-only", action="store_true", help="run only without the package (for --plain-from)")
    args = parser.parse_args()
    out = pathlib.Path(args.out).resolve()  # (pytest runs in thunder's install folder: --junitxml must be absolute)
    out.mkdir(parents=True, exist_ok=True)
    tests = _thunder_tests()
    paths = [str(tests / f"{name}.py") for name in args.files]
    runs = {}
    if args.plain_from:
        (out / "plain.xml").write_bytes((pathlib.Path(args.plain_from) / "plain.xml").read_bytes())
    modes = ("plain",) if args.plain_only else ("package",) if args.plain_from else ("plain", "package")
    for mode in modes:
        env = {**os.environ, "THUNDER_SUITE_MODE": mode, "PYTHONPATH": str(SCRIPTS), "PYTHONHASHSEED": "0"}
        command = [
            sys.executable, "-m", "pytest", "-p", "thunder_suite_plugin", "-p", "no:cacheprovider", "-q",
            "--timeout", "600", f"--junitxml={out / f'{mode}.xml'}", *paths,
        ]  # fmt: skip
        if args.k:
            command += ["-k", args.k]
        log = open(out / f"{mode}.log", "w")  # noqa: SIM115
        runs[mode] = subprocess.Popen(command, cwd=tests.parent.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
    for run in runs.values():
        run.wait()
    if args.plain_only:
        return 0
    plain, package = _outcomes(out / "plain.xml"), _outcomes(out / "package.xml")
    differing = sorted(n for n in plain.keys() | package.keys() if plain.get(n) != package.get(n))
    counts = {mode: {} for mode in ("plain", "package")}
    for mode, outcomes in (("plain", plain), ("package", package)):
        for outcome in outcomes.values():
            counts[mode][outcome] = counts[mode].get(outcome, 0) + 1
    print(f"thunder's own tests ({len(plain)} run): without the package {counts['plain']}; with it {counts['package']}")
    for name in differing:
        print(f"  differs: {name}: without {plain.get(name, 'not run')}, with {package.get(name, 'not run')}")
    print("same outcomes" if not differing else f"{len(differing)} tests differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
