"""The fixes to thunder that are not about DTensors, and the speed-ups: a layer of their own, each fix switchable.

:mod:`.switches` says where each acts (by default within DTensor programs only); the installers live in
``thunder_fixes`` (what thunder 0.2.6 gets wrong for plain tensors too) and ``speedups`` (first-call and per-call
time, and torch's CPU kernels).
"""
