"""Sizes and durations with units, parsed and printed the way users write them."""
from __future__ import annotations

import math
import re

from tract_cli.core.errors import UsageError

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parses '64G', '512MiB', '1.5GB', '4096' into bytes (K/M/G/T alone are binary)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise UsageError(f"cannot read size {text!r}",
                         "write a number with an optional unit, e.g. 8G, 512MiB, 1GB")
    value = float(m.group(1)) * _UNITS[unit]
    if value != int(value):
        raise UsageError(f"size {text!r} is not a whole number of bytes", "use a coarser unit")
    return int(value)


def format_size(n: int) -> str:
    """Formats bytes with a binary unit: 2 MiB, 7.88 MiB, 16 GiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


def format_duration(seconds: float) -> str:
    """A duration the way people read one: '850 ns', '71 µs', '1.23 ms', '3.42 s'
    (3 significant figures under a minute), '2 min 5 s', '3 h 12 min', '2 d 4 h'
    (whole units above); a negative one (a deadline already past) with a '-'."""
    if math.isnan(seconds):
        return "? s"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if math.isinf(seconds):
        return "∞"
    if seconds == 0:
        return "0 s"
    if seconds < 59.95:               # what 3 figures would still print in seconds
        for unit, scale in (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)):
            value = float(f"{seconds / scale:.3g}")
            if value < 1000 or unit == "s":
                return f"{value:g} {unit}"
    whole = round(seconds)
    if whole < 3600:
        return _two_units(whole, 60, "min", "s")
    minutes = round(seconds / 60)
    if minutes < 24 * 60:
        return _two_units(minutes, 60, "h", "min")
    return _two_units(round(seconds / 3600), 24, "d", "h")


def _two_units(count: int, per: int, big: str, small: str) -> str:
    """COUNT small units as '<n> BIG[ <m> SMALL]' (PER small units to a big one)."""
    hi, lo = divmod(count, per)
    return f"{hi} {big}" + (f" {lo} {small}" if lo else "")
