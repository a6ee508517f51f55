"""The per-column fast converters (``RowShape.fast``) are a short cut of
``convert_value``: for every value of every column type they either give
exactly its text, with no note, or step aside (``SLOW``)."""

from __future__ import annotations

import base64
import datetime as dt

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_apply.decode import debezium_common as dc
from cdc_apply.decode.debezium_common import PLACEHOLDER, PLACEHOLDER_B64
from cdc_apply.model import DecodeError

FIELDS = {
    "tiny": {"type": "int8"},
    "small": {"type": "int16"},
    "int": {"type": "int32"},
    "big": {"type": "int64"},
    "flag": {"type": "boolean"},
    "text": {"type": "string"},
    "uuid": {"type": "string", "name": "io.debezium.data.Uuid"},
    "bits": {"type": "bytes", "name": "io.debezium.data.Bits"},
    "blob": {"type": "bytes"},
    "dbl": {"type": "float64"},
    "dec": {
        "type": "bytes",
        "name": "org.apache.kafka.connect.data.Decimal",
        "parameters": {"scale": "2", "connect.decimal.precision": "6"},
    },
    "dec0": {
        "type": "bytes",
        "name": "org.apache.kafka.connect.data.Decimal",
        "parameters": {"scale": "0", "connect.decimal.precision": "38"},
    },
    "decp": {"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal", "parameters": {"scale": "3"}},
    "ms": {"type": "int64", "name": "io.debezium.time.Timestamp"},
    "us": {"type": "int64", "name": "io.debezium.time.MicroTimestamp"},
    "ns": {"type": "int64", "name": "io.debezium.time.NanoTimestamp"},
    "zoned": {"type": "string", "name": "io.debezium.time.ZonedTimestamp"},
    "day": {"type": "int32", "name": "io.debezium.time.Date"},
}
SPECS = {name: dc.field_spec({"field": name, "optional": True, **f}) for name, f in FIELDS.items()}
SHAPE = dc.RowShape.of(list(SPECS.values()))


def b64_int(n: int, width: int | None = None) -> str:
    size = width if width is not None else max(1, (n.bit_length() + 8) // 8)
    return base64.b64encode(n.to_bytes(size, "big", signed=True)).decode()


iso = st.builds(
    lambda d, frac, z: d.strftime("%Y-%m-%dT%H:%M:%S") + frac + z,
    st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59)),
    st.sampled_from(["", ".1", ".12", ".123", ".1234", ".12345", ".123456", ".1234567", ".123456789"]),
    st.sampled_from(["Z", "z", "+00:00", "+05:30", "", " Z", "Z "]),
)
raws = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-40_000_000_000_000, 260_000_000_000_000_000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [PLACEHOLDER, PLACEHOLDER_B64, "", "AA==", "not base64!", "2026-02-30T10:00:00Z", "2026-11-24T24:00:00Z", "٢٠٢٦-11-24T10:00:00Z"]
    ),
    st.integers(-(10**40), 10**40).map(b64_int),
    st.integers(-(10**6), 10**6).map(b64_int),
    st.sampled_from([s * (10**p + d) for s in (1, -1) for p in (6, 38) for d in (-1, 0)]).map(b64_int),  # decimal edges
    st.sampled_from([-129, -128, 127, 128, -32769, 32767, 32768, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1]),
    iso,
    st.lists(st.sampled_from([PLACEHOLDER, 1]), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=3000, deadline=None)
@given(column=st.sampled_from(sorted(SPECS)), raw=raws)
def test_fast_converter_equals_convert_value(column, raw):
    spec = SPECS[column]
    fast = SHAPE.fast[column](raw)
    if fast is dc.SLOW:
        return
    notes: list[str] = []
    slow = dc.convert_value(spec, raw, notes)  # must not raise where the fast path answered
    assert fast == slow and type(fast) is str
    assert notes == []


@pytest.mark.parametrize(
    ("column", "raw", "text"),
    [
        ("big", 9223372036854775807, "9223372036854775807"),
        ("text", "hello", "hello"),
        ("bits", "AQ==", "AQ=="),
        ("flag", False, "false"),
        ("dec", b64_int(-12345), "-123.45"),
        ("dec0", b64_int(7), "7"),
        ("us", 1_700_000_000_123_456, "2023-11-14 22:13:20.123456"),
        ("ms", -1, "1969-12-31 23:59:59.999000"),
        ("zoned", "2026-11-24T10:00:00.5Z", "2026-11-24 10:00:00.500000"),
    ],
)
def test_common_values_take_the_fast_path(column, raw, text):
    """The values a workload is made of do not fall back (the point of it)."""
    assert SHAPE.fast[column](raw) == text


@pytest.mark.parametrize(
    ("column", "raw"),
    [
        ("text", PLACEHOLDER),
        ("bits", PLACEHOLDER_B64),
        ("dec", PLACEHOLDER_B64),
        ("dec", b64_int(10**6)),  # does not fit decimal(6,2)
        ("ns", 1_000_000_001),  # sub-microsecond digits: convert_value notes them
        ("tiny", 128),
        ("big", True),
        ("zoned", "2026-11-24T10:00:00+01:00"),
        ("day", 19000),  # no fast path for dates: convert_value's
        ("text", None),
    ],
)
def test_values_that_need_convert_value_step_aside(column, raw):
    assert SHAPE.fast[column](raw) is dc.SLOW


def test_a_bad_value_keeps_convert_values_error():
    row = {"dec": "not base64!"}
    with pytest.raises(DecodeError, match="column dec: invalid base64 decimal"):
        dc.convert_row(row, SHAPE.specs, [], "after", SHAPE.fast)
    with pytest.raises(DecodeError, match=r"after\.nope is not declared"):
        dc.convert_row({"nope": 1}, SHAPE.specs, [], "after", SHAPE.fast)
