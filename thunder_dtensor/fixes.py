"""Where each of the package's fixes to thunder (and its speed-ups) acts: by default within DTensor programs only.

    import thunder_dtensor
    thunder_dtensor.fixes.listing()                          # every fix: kind, mode, what it does
    thunder_dtensor.fixes.enable("keep_named_members_in_order", everywhere=True)   # for every program
    thunder_dtensor.fixes.disable("run_cpu_ops_with_torch_kernels")                # nowhere
    with thunder_dtensor.fixes.enabled("all", everywhere=True): ...                # within a block (tests)

Environment defaults, read at import: ``THUNDER_DTENSOR_FIXES_EVERYWHERE`` / ``THUNDER_DTENSOR_FIXES_OFF``
(comma-separated names, or ``all``). docs/architecture.md lists each fix with its plain-thunder reproducer.
"""

from thunder_dtensor._integration.fixes.switches import (
    EVERYWHERE,
    FIXES,
    IN_DTENSOR_PROGRAMS,
    OFF,
    active,
    disable,
    disabled,
    enable,
    enabled,
    fixes_everywhere,
    listing,
    mode,
)

__all__ = [
    "EVERYWHERE",
    "FIXES",
    "IN_DTENSOR_PROGRAMS",
    "OFF",
    "active",
    "disable",
    "disabled",
    "enable",
    "enabled",
    "fixes_everywhere",
    "listing",
    "mode",
]
