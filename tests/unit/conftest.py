"""Unit tests of thunder fixes run them on plain programs: there they act only when switched on everywhere."""

from thunder_dtensor import fixes

import pytest

#: test modules whose programs are plain and test the fixes themselves (the switches' own tests are not here)
_FIXES_EVERYWHERE_IN = {
    "test_autocast_scope",
    "test_complex_autograd",
    "test_package",
    "test_plain_thunder",
    "test_root_module_hooks",
    "test_sdpa_kernel",
    "test_thunder_fixes_for_models",
    "test_writes_into_views",
}


@pytest.fixture(autouse=True)
def _fixes_everywhere(request):
    if request.module.__name__.rsplit(".", 1)[-1] in _FIXES_EVERYWHERE_IN:
        with fixes.enabled("all", everywhere=True):
            yield
    else:
        yield
