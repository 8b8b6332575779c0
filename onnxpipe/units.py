"""Quantities with units: read "16 GiB" / "460 GB/s" / "9.2 TFLOP/s" / "5 us", and print them back readably."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

__all__ = ["UNITS", "UnitError", "parse_quantity", "format_bytes", "format_rate", "format_flops", "format_seconds", "format_ms", "plural"]

#: Unit name -> factor to the base unit (B, B/s, FLOP/s, s), per kind of quantity.
UNITS: Mapping[str, Mapping[str, float]] = {
    "bytes": {"B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30},
    "bandwidth": {"B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "MiB/s": 2.0**20, "GiB/s": 2.0**30, "Gbit/s": 1e9 / 8},
    # OP/s spellings for integer throughput (datasheets quote INT8 in TOPS).
    "flops": {"FLOP/s": 1.0, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "OP/s": 1.0, "GOP/s": 1e9, "TOP/s": 1e12},
    "time": {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9},
}

_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(\S*)\s*$")


class UnitError(ValueError):
    """A value that is not a number with a unit of the expected kind; the caller adds where it came from."""


def _unit_list(kind: str) -> str:
    names = list(UNITS[kind])
    return ", ".join(names[:-1]) + " or " + names[-1]


def parse_quantity(value: object, kind: str) -> float:
    """A number in base units from a plain number or a "NUMBER UNIT" string of the given kind."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UnitError(f"expected a number with a unit ({_unit_list(kind)}), got {value!r}")
    if isinstance(value, str):
        match = _QUANTITY.match(value)
        if match is None:
            raise UnitError(f"expected a number with a unit ({_unit_list(kind)}), got {value!r}")
        number, unit = float(match.group(1)), match.group(2)
        if unit and unit not in UNITS[kind]:
            raise UnitError(f"bad unit {unit!r}; use {_unit_list(kind)}")
        value = number * UNITS[kind].get(unit, 1.0)
    if not math.isfinite(value):
        raise UnitError(f"expected a finite number, got {value!r}")
    return float(value)


def _scaled(value: float, steps: tuple[tuple[float, str], ...]) -> str:
    """`value` in the smallest of `steps` (largest first) whose three significant digits stay below 1000:
    the choice is made on the rounded figure, so 999.6 KiB reads "0.976 MiB" and 1023.9 KiB "1 MiB", never "1e+03 KiB"."""
    ordered = steps[::-1]
    for i, (factor, unit) in enumerate(ordered):
        shown = float(f"{value / factor:.3g}")
        if abs(shown) < 1000 or i == len(ordered) - 1:
            return f"{value / factor:.3g} {unit}" if abs(shown) < 1000 else f"{value / factor:.0f} {unit}"
    raise AssertionError("unreachable: the last unit always returns")


def format_bytes(n: float) -> str:
    """Bytes in binary units, e.g. "8 GiB"."""
    return _scaled(n, ((2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1.0, "B")))


def format_rate(bytes_per_second: float) -> str:
    """Bandwidth in decimal units, e.g. "460 GB/s"."""
    return _scaled(bytes_per_second, ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s"), (1.0, "B/s")))


def format_flops(rate: float, dtype: str = "float32") -> str:
    """Compute rate, e.g. "15.7 TFLOP/s"; integer dtypes in OP/s, e.g. "24.5 TOP/s"."""
    unit = "OP/s" if dtype.startswith("int") else "FLOP/s"
    return _scaled(rate, ((1e12, "T" + unit), (1e9, "G" + unit), (1e6, "M" + unit), (1e3, "k" + unit), (1.0, unit)))


def format_seconds(seconds: float) -> str:
    """Duration, e.g. "5 us"."""
    return _scaled(seconds, ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")))


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds, the unit left to the caller's text: three decimals, and three significant digits below
    0.1 ms, so that a plan served on a thousand devices does not read 0.000 (0.37 us prints "0.000370")."""
    ms = seconds * 1e3
    if ms == 0 or not math.isfinite(ms) or abs(ms) >= 0.1:
        return f"{ms:.3f}"
    return f"{ms:.{min(12, 2 - math.floor(math.log10(abs(ms))))}f}"


def plural(count: int, noun: str, many: str | None = None) -> str:
    """"1 stage", "2 stages", "1 micro-batch", "4 micro-batches": a count with its noun in the right number."""
    return f"{count} {noun if count == 1 else many or (noun + 'es' if noun.endswith(('ch', 'sh', 's', 'x')) else noun + 's')}"
