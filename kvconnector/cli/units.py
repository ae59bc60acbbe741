"""Byte sizes as people type them on command lines (`--capacity 8GiB`, `--budget 512M`)."""

from __future__ import annotations

import re

# Bare letters and IEC suffixes are binary; KB/MB/GB/TB are decimal, as their names say.
_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in '8GiB', '512M', '2MB', '4096'; ValueError naming anything else or a size <= 0."""
    match = _SIZE.fullmatch(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(f"not a size: {text!r} (expected e.g. 8GiB, 512M, 2MB or 4096)")
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def format_size(n: int) -> str:
    """Bytes as people read them: '2 MiB', '640 KiB', '23.4 GiB', '3 B'."""
    if n < 1024:
        return f"{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    power = min(len(units), (n.bit_length() - 1) // 10)  # 1024 ** power <= n
    value = f"{n / (1 << 10 * power):.1f}".rstrip("0").rstrip(".")
    return f"{value} {units[power - 1]}"
