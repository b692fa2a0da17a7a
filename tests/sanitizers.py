"""The GCC sanitizer runtimes the sanitizer tests need (test_asan_fuzz.py,
test_tsan.py): their paths, or None where this gcc lacks them."""
from __future__ import annotations

import os
import subprocess


def runtime(name: str) -> str | None:
    """Path of gcc's lib<NAME>.so (asan, tsan), or None if it is not installed."""
    try:
        path = subprocess.run(["gcc", f"-print-file-name=lib{name}.so"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None
