"""Multi-rank tests: run with ``torchrun --nproc-per-node N -m pytest tests/distributed``."""

import os

import thunder_dtensor  # noqa: F401  (before thunder: makes thunder importable on torch >= 2.13)
from thunder_dtensor.testing import init_distributed, world_size

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "world_size(n): run only when the torchrun world size is n")


def pytest_collection_modifyitems(config, items):
    if "WORLD_SIZE" not in os.environ:
        skip = pytest.mark.skip(reason="multi-rank test: run under torchrun (see Makefile)")
        for item in items:
            item.add_marker(skip)
        return
    ws = int(os.environ["WORLD_SIZE"])
    # a single-GPU CUDA check runs the default (2-rank) tests on a 1-rank mesh
    any_size = os.environ.get("THUNDER_DTENSOR_TEST_ANY_WORLD_SIZE") == "1"
    for item in items:
        marker = item.get_closest_marker("world_size")
        sizes = marker.args if marker else (2,)
        if ws not in sizes and not (any_size and marker is None):
            item.add_marker(pytest.mark.skip(reason=f"runs at world size {sizes}, this run has {ws}"))


@pytest.fixture(scope="session", autouse=True)
def distributed():
    if "WORLD_SIZE" not in os.environ:
        yield None
        return
    init_distributed()
    yield world_size()
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
