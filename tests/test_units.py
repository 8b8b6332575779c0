"""Printed quantities: the unit is chosen on the rounded figure, so no unit's edge prints an exponent
("1e+03 KiB") or four digits, and a count's noun takes its number ("1 stage", "2 micro-batches")."""

from __future__ import annotations

import math
import re

import pytest

from onnxpipe.units import format_bytes, format_flops, format_ms, format_rate, format_seconds, plural

BINARY = [("B", 1.0), ("KiB", 2.0**10), ("MiB", 2.0**20), ("GiB", 2.0**30), ("TiB", 2.0**40)]
FORMATTERS = {
    "bytes": (format_bytes, BINARY),
    "rate": (format_rate, [("B/s", 1.0), ("KB/s", 1e3), ("MB/s", 1e6), ("GB/s", 1e9), ("TB/s", 1e12)]),
    "flops": (format_flops, [("FLOP/s", 1.0), ("kFLOP/s", 1e3), ("MFLOP/s", 1e6), ("GFLOP/s", 1e9), ("TFLOP/s", 1e12)]),
    "seconds": (format_seconds, [("ns", 1e-9), ("us", 1e-6), ("ms", 1e-3), ("s", 1.0)]),
}


@pytest.mark.parametrize("unit,factor", BINARY)
def test_binary_edges_of_every_unit(unit: str, factor: float) -> None:
    larger = {u: BINARY[i + 1][0] for i, (u, _) in enumerate(BINARY[:-1])}.get(unit)
    assert format_bytes(factor) == f"1 {unit}"
    assert format_bytes(999.4 * factor) == f"999 {unit}"
    if larger is None:  # the largest unit has no next one: four digits, still no exponent
        assert format_bytes(999.5 * factor) == f"1000 {unit}" and format_bytes(1500 * factor) == f"1500 {unit}"
        return
    # 999.5 .. 1023.x round to 1000 in this unit: the next one reads them
    assert format_bytes(999.5 * factor) == f"0.976 {larger}"
    assert format_bytes(1000 * factor) == f"0.977 {larger}"
    assert format_bytes(1023 * factor) == f"0.999 {larger}"
    assert format_bytes(1023.9 * factor) == f"1 {larger}"
    assert format_bytes(1024 * factor) == f"1 {larger}"


@pytest.mark.parametrize("kind", FORMATTERS)
def test_decimal_edges_and_no_exponent_anywhere(kind: str) -> None:
    fmt, units = FORMATTERS[kind]
    factors = dict(units)
    for (unit, factor), (larger, _) in zip(units, units[1:]):
        assert fmt(factor) == f"1 {unit}"
        assert fmt(999.4 * factor) == f"999 {unit}"
        if kind != "bytes":
            assert fmt(999.6 * factor) == f"1 {larger}"  # (999.5 itself is a float tie: either side reads right)
    # every value from the smallest unit to well past the largest: three digits below 1000, read back within rounding
    for exponent in range(0, 900):
        value = units[0][1] * 10 ** (exponent / 60)
        text = fmt(value)
        match = re.fullmatch(r"(\d+(?:\.\d+)?) (\S+)", text)
        assert match and "e" not in match.group(1), text
        number, unit = float(match.group(1)), match.group(2)
        assert number < 1000 or unit == units[-1][0], text
        assert math.isclose(number * factors[unit], value, rel_tol=5e-3), text


def test_plural() -> None:
    assert [plural(1, "stage"), plural(2, "stage"), plural(0, "stage")] == ["1 stage", "2 stages", "0 stages"]
    assert [plural(1, "micro-batch"), plural(4, "micro-batch")] == ["1 micro-batch", "4 micro-batches"]
    assert plural(3, "copy", "copies") == "3 copies"


def test_milliseconds_keep_three_digits_however_small() -> None:
    """The CLI's milliseconds: three decimals, and three significant digits below 0.1 ms (a plan served on a thousand
    devices read 0.000 ms where its bottleneck was 0.37 us); plain decimals throughout, as its lines are parsed."""
    assert [format_ms(s) for s in (81.5e-3, 0.648e-3, 0.1e-3, 0.0)] == ["81.500", "0.648", "0.100", "0.000"]
    assert [format_ms(s) for s in (0.0999e-3, 20.07e-6, 0.37e-6, 1.5e-12)] == ["0.0999", "0.0201", "0.000370", "0.00000000150"]
    for exponent in range(-90, 30):
        value = 10 ** (exponent / 10) * 1e-3
        text = format_ms(value)
        assert re.fullmatch(r"\d+\.\d+", text), text
        assert math.isclose(float(text), value * 1e3, rel_tol=5e-3), text
