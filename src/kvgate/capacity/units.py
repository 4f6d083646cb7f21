"""Byte sizes as people write them ("24GiB", "80 GB", "1.5TiB") and back."""

from __future__ import annotations

import math
import re

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

# Why both families: GPU vendors sell "80GB" (decimal) cards while nvidia-smi and
# PyTorch report binary units; a budget off by 7% is a real difference at this scale.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
}

_SIZE_RE = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)\s*$")


class SizeError(ValueError):
    """A size string that cannot be read."""


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a plain byte count or a number with a unit.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB,
    TiB) powers of 1024; case does not matter. Fractions are rounded down to whole
    bytes. A bare "G" or "M" is refused, because it is ambiguous between the two.
    """
    if isinstance(text, bool):
        raise SizeError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise SizeError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE_RE.match(text)
    if match is None:
        raise SizeError(f"not a size: {text!r} (examples: 24GiB, 80GB, 1.5TiB, 123456789)")
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise SizeError(
            f"unknown unit {match['unit']!r} in {text!r}: use B, KB/MB/GB/TB (powers of "
            "1000) or KiB/MiB/GiB/TiB (powers of 1024)"
        )
    return math.floor(float(match["number"]) * _UNITS[unit])


def format_bytes(n: int | float) -> str:
    """A short binary-unit rendering for messages and tables: ``21.6 GiB``."""
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if value >= size:
            return f"{sign}{_trim(value / size)} {unit}"
    return f"{sign}{_trim(value)} B"


def _trim(x: float) -> str:
    # Two decimals at most, and none for whole numbers: "16 GiB", not "16.00 GiB".
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return text or "0"
