"""pytest plugins to run lightning-thunder's own test suite with and without this package (``make thunder-suite``).

``-p thunder_suite_plugin`` (``scripts`` on ``PYTHONPATH``) imports thunder as a process without this package
has it (``plain_thunder``). With ``THUNDER_SUITE_MODE=package`` the plugin imports ``thunder_dtensor`` first
instead, as a user of the package would.
"""

from __future__ import annotations

import os

MODE_VARIABLE = "THUNDER_SUITE_MODE"


if os.environ.get(MODE_VARIABLE, "plain") == "package":
    import thunder_dtensor  # noqa: F401
else:
    from plain_thunder import import_plain_thunder

    import_plain_thunder()
