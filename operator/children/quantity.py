"""Kubernetes quantities, read exactly and written in the API server's canonical form."""

from __future__ import annotations

import re
from fractions import Fraction

_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?"
)
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: int | str) -> Fraction | None:
    """A Kubernetes quantity ("2", "1500m", "0.5", "1e3", "2Gi") as an exact number; None
    where it cannot be read."""
    m = _QUANTITY.fullmatch(str(value).strip())
    if m is None:
        return None
    number, suffix = Fraction(m[1]), m[2] or ""
    if suffix.endswith("i"):
        return number * 1024 ** ("KMGTPE".index(suffix[0]) + 1)
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return number * Fraction(10) ** int(suffix[1:])
    return number * Fraction(10) ** _DECIMAL[suffix]


def quantity(value: float) -> str:
    """A decimal value as the API server writes it back (4 -> "4", 0.5 -> "500m",
    2000 -> "2k"): applying the canonical form keeps a re-read from looking like drift."""
    scaled, suffixes = max(1, round(value * 1000)), ["m", "", "k", "M", "G", "T", "P", "E"]
    i = 0
    while scaled % 1000 == 0 and i < len(suffixes) - 1:
        scaled, i = scaled // 1000, i + 1
    return f"{scaled}{suffixes[i]}"
