"""Every test process imports thunder_dtensor before thunder (thunder 0.2.6 needs it on torch >= 2.13)."""

import thunder_dtensor  # noqa: F401
