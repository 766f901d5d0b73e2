"""Formatting of sizes and durations for people (binary sizes, SI durations)."""

from __future__ import annotations

import math

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_SECONDS_SCALE = {"s": 1.0, "ms": 1e3, "us": 1e6}


def significant(value: float, digits: int) -> str:
    """`value` rounded to `digits` significant figures, without exponent notation."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(digits - 1 - magnitude, 0)
    rounded = round(value, digits - 1 - magnitude)
    return f"{rounded:,.{decimals}f}"


def format_bytes_binary(num_bytes: float) -> str:
    """Largest binary unit that keeps the value >= 1, to 3 significant figures (625 MiB)."""
    value = float(num_bytes)
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{significant(value, 3)} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float, unit: str) -> str:
    """Seconds in the given unit with one decimal (141.5 us, 70.7 ms), or 3 significant figures
    below 10 so that small figures keep their precision (0.196 ms)."""
    value = seconds * _SECONDS_SCALE[unit]
    text = f"{value:,.1f}" if abs(value) >= 10 else significant(value, 3)
    return f"{text} {unit}"
