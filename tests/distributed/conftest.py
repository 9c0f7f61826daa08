"""Multi-rank tests: run with ``torchrun --nproc-per-node N -m pytest tests/distributed``."""

import os

import thunder_dtensor  # noqa: F401  (before thunder: makes thunder importable on torch >= 2.13)
from thunder_dtensor.testing import init_distributed, shutdown_distributed, world_size

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "world_size(n): run only when the torchrun world size is n")


def pytest_collection_modifyitems(config, items):
    if "WORLD_SIZE" not in os.environ:
        if any("tests/distributed" in str(item.path) for item in items):
            # skipping would report green without running anything
            pytest.exit(
                "tests/distributed are multi-rank tests: run them under torchrun, e.g. "
                "`torchrun --nproc-per-node 2 -m pytest tests/distributed` (and --nproc-per-node 4), "
                "or `make test`, which also runs tests/unit",
                returncode=pytest.ExitCode.USAGE_ERROR,
            )
        return
    ws = int(os.environ["WORLD_SIZE"])
    # a single-GPU CUDA check runs the default (2-rank) tests on a 1-rank mesh
    any_size = os.environ.get("THUNDER_DTENSOR_TEST_ANY_WORLD_SIZE") == "1"
    for item in items:
        marker = item.get_closest_marker("world_size")
        sizes = marker.args if marker else (2,)
        if ws not in sizes and not (any_size and marker is None):
            item.add_marker(pytest.mark.skip(reason=f"runs at world size {sizes}, this run has {ws}"))
        elif ws != 2 and 2 in sizes and getattr(getattr(item, "callspec", None), "params", {}).get("lowering") is False:
            # the suite's time: a test of both world sizes runs its lowering-off variant at 2 ranks only
            item.add_marker(pytest.mark.skip(reason="the lowering-off variant runs at world size 2"))
    # Known, not ours to fix here: after dynamo compiles an FSDP2 model with a vocab-parallel embedding,
    # a later dynamo compile of another vocab-parallel embedding on a 2x2 mesh fails in dynamo's own fake run
    # ("Mixing fake modes"), also after torch._dynamo.reset() and clearing DTensor's caches. The FSDP2 tests
    # therefore run last.
    items.sort(key=lambda item: "test_fsdp_tp.py" in str(item.path))


@pytest.fixture(scope="session", autouse=True)
def distributed():
    if "WORLD_SIZE" not in os.environ:
        yield None
        return
    init_distributed()
    yield world_size()
    shutdown_distributed()


# --- collectives report: cases where the jit does more collectives than eager DTensor (run_case records them) ---


def pytest_terminal_summary(terminalreporter):
    """Rank 0 prints the cases with more collectives than eager; ``THUNDER_DTENSOR_COMM_REPORT`` writes them all.

    The path may hold ``{world_size}`` so that the 2- and 4-rank runs write apart.
    """
    if "WORLD_SIZE" not in os.environ or os.environ.get("RANK", "0") != "0":
        return
    from thunder_dtensor.testing import COMM_COMPARISONS, comm_report, write_comm_report

    lines = comm_report()
    if lines:
        terminalreporter.section("collectives: jit vs eager DTensor")
        for line in lines:
            terminalreporter.write_line(line)
    path = os.environ.get("THUNDER_DTENSOR_COMM_REPORT")
    if path:
        written = write_comm_report(path)
        terminalreporter.write_line(f"{len(COMM_COMPARISONS)} collective comparisons written to {written}")


@pytest.fixture(autouse=True)
def fresh_compile_state():
    """Each test compiles from scratch: dynamo's recompilation counts and caches, DTensor's sharding cache."""
    from thunder_dtensor._integration import clear_sharding_propagation_cache

    import torch

    torch._dynamo.reset()
    clear_sharding_propagation_cache()
    yield
