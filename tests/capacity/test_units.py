"""Size strings as people write them."""

from __future__ import annotations

import pytest

from kvgate.capacity.units import GIB, KIB, MIB, TIB, SizeError, format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GIB),
        ("16 GiB", 16 * GIB),
        ("80GB", 80 * 1000**3),
        ("1.5TiB", 3 * TIB // 2),
        ("512 MiB", 512 * MIB),
        ("64kib", 64 * KIB),
        ("123456789", 123456789),
        ("100B", 100),
        (" 2 gb ", 2 * 1000**3),
        ("0.5KiB", 512),
        (1024, 1024),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


def test_fractions_round_down_to_whole_bytes() -> None:
    assert parse_size("1.7B") == 1
    assert parse_size("0.1KB") == 100


@pytest.mark.parametrize("text", ["", "GiB", "24 G", "1e3", "-5GiB", "24 GiBs", "twelve", "1,5GiB"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(SizeError):
        parse_size(text)


def test_negative_int_is_refused() -> None:
    with pytest.raises(SizeError):
        parse_size(-1)


def test_ambiguous_unit_message_names_both_families() -> None:
    with pytest.raises(SizeError, match=r"KiB/MiB/GiB/TiB"):
        parse_size("24G")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (16 * GIB, "16 GiB"),
        (int(24 * GIB * 0.9), "21.6 GiB"),
        (131072, "128 KiB"),
        (1536, "1.5 KiB"),
        (100, "100 B"),
        (0, "0 B"),
        (2 * TIB, "2 TiB"),
        (-2 * GIB, "-2 GiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text
