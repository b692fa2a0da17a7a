"""This CPU as the C core sees it: the features `native/cpu.c` detected (CPUID,
once per process, with the `TRACT_*` test overrides) and the flush modes the
region accessors can run with.

The layers above core (`tract doctor`, the vLLM connector's settings) take
these from here: `core/native.py`, where they are defined beside the error
translation, is the binding to the C library and only core imports it
(tests/test_layering.py).
"""
from __future__ import annotations

from tract_cli.core.native import CPU_FEATURES, FLUSH_MODES, cpu_features, flush_mode_supported

__all__ = ["CPU_FEATURES", "FLUSH_MODES", "cpu_features", "flush_mode_supported"]
