"""Byte sizes for people: ``parse_bytes('512MiB')`` and ``human_bytes(536870912)``.

A low-level module with no project imports. Neighbours: ``cli.common`` wraps ``parse_bytes``
as an argparse type; ``controller.config`` reads ``residual_budget`` with it.
"""

from __future__ import annotations

import re

#: Binary (KiB = 1024) and decimal (kB = 1000) units, matched case-insensitively.
_UNITS = {"": 1, "b": 1,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str) -> int:
    """Return the number of bytes ``text`` names: '512MiB' -> 536870912, '3GB' -> 3000000000.

    A plain integer is bytes; a fraction is rounded down to whole bytes ('1.5 KiB' -> 1536).
    Raises ``ValueError`` for anything else (negative, unknown unit, empty, not a string).
    """
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r} (expected a string such as 512MiB)")
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 2GiB, 3GB; "
                         f"units B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)")
    number, unit = m.group(1), m.group(2).lower()
    if "." not in number:  # integers stay exact, however large
        return int(number) * _UNITS[unit]
    size = float(number) * _UNITS[unit]
    if size == float("inf"):  # hundreds of digits: no size, and int() would overflow
        raise ValueError(f"not a size: {text!r} (too large)")
    return int(size)


def human_bytes(n: int | float | None) -> str:
    """Return ``n`` bytes in the largest binary unit below 1024 ('512.0 MiB'); None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
