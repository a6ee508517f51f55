from decimal import Decimal

import pytest

from cdc_apply.model import DecodeError, canonical_value


@pytest.mark.parametrize(
    "typ,value,expected",
    [
        ("int", 5, "5"),
        ("decimal(10,2)", "1.5", "1.50"),
        ("decimal(10,2)", Decimal("-12345678.90"), "-12345678.90"),
        ("timestamp", "2026-01-01T10:00:00.123456789+02:00", "2026-01-01 08:00:00.123456"),
        ("timestamp_ntz", "2026-01-01T10:00:00", "2026-01-01 10:00:00.000000"),
        ("boolean", 1, "true"),
        ("string", {"b": 1, "a": 2}, '{"a":2,"b":1}'),
        ("binary", b"\x00\x01", "AAE="),
        ("date", "2026-02-03", "2026-02-03"),
    ],
)
def test_canonical_value(typ, value, expected):
    assert canonical_value(typ, value) == expected


@pytest.mark.parametrize(
    "typ,value",
    [("tinyint", 300), ("decimal(4,2)", "123.45"), ("decimal(10,2)", "1.234"), ("int", "x"), ("boolean", "maybe")],
)
def test_canonical_value_rejects(typ, value):
    with pytest.raises(DecodeError):
        canonical_value(typ, value)


def test_wide_decimals_are_exact():
    assert canonical_value("decimal(38,0)", Decimal("9" * 38)) == "9" * 38
    assert canonical_value("decimal(38,10)", "-" + "9" * 28 + "." + "1" * 10) == "-" + "9" * 28 + "." + "1" * 10
    with pytest.raises(DecodeError):
        canonical_value("decimal(38,0)", "1" + "0" * 38)


def test_old_years_keep_their_padding():
    assert canonical_value("timestamp", "0999-01-02T03:04:05Z") == "0999-01-02 03:04:05.000000"
    assert canonical_value("timestamp_ntz", "0010-01-02T03:04:05") == "0010-01-02 03:04:05.000000"
