"""Parsing and printing byte sizes. Pure functions; runs in every process."""

from __future__ import annotations

import re

from timeshare.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, what: str = "size") -> int:
    """Return ``value`` as a number of bytes: an int, or a string like "4GiB", "512MB", "1e9"."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number of bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{what} {value!r} is not a size; use bytes or a number with one of "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ConfigError(f"{what} must be a number of bytes or a string like '4GiB', got {value!r}")
    if n <= 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return n


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
