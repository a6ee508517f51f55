"""Lines of one table repeat the same Connect schema; once a schema's exact text
is known, only the payload is parsed.  The result (or the error) must be the
one of parsing the whole line, whatever the payload holds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cdc_apply.decode import debezium_common as dc

SCHEMA = {
    "type": "struct",
    "name": "srv.public.t.Envelope",
    "fields": [
        {"type": "struct", "field": "after", "optional": True, "fields": [{"type": "int64", "field": "id", "optional": False}]},
        {"type": "string", "field": "op", "optional": False},
        {"type": "struct", "field": "x", "optional": True, "parameters": {"payload": 'a ,"payload": b'}, "fields": []},
    ],
}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from([',"payload":', '{"schema":', "}", '"}']),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12
)
payload_texts = st.one_of(
    st.dictionaries(st.sampled_from(["op", "after", "before", "source", "payload", "ts_ms"]), values, max_size=5).map(
        lambda d: json.dumps(d, separators=(",", ":"))
    ),
    values.map(json.dumps),
    st.sampled_from(['{"op":"c"},"extra":1', '{"op":"c"', "", "null", '{"op":"c"} ', '{"op":1.50}', '{"a":1e400}']),
)


def parse(line: str, *, learn: str | bool):
    saved, unusable, shapes = dict(dc._KNOWN_SCHEMAS), set(dc._UNUSABLE_SCHEMAS), dict(dc._SHAPE_OF_KNOWN)
    dc._KNOWN_SCHEMAS.clear()
    dc._UNUSABLE_SCHEMAS.clear()
    dc._last_known = ("\0", {})
    try:
        if learn:  # the schema text is known from earlier lines of the table
            earlier = '{"schema":' + SCHEMA_TEXT + ',"payload":{"op":"r"}}'
            dc.parse_record(earlier)
            assert dc._KNOWN_SCHEMAS, "the schema was not remembered"
            if learn == "prefix":  # a second line makes it the last known: the next line is tested by its prefix
                dc.parse_record(earlier)
                assert dc._last_known[0] == '{"schema":' + SCHEMA_TEXT + ',"payload":'
        try:
            rec = dc.parse_record(line)
        except Exception as exc:
            return ("error", type(exc).__name__, str(exc))
        return ("record", repr(rec.payload), rec.schema, rec.key_payload, rec.has_key, rec.topic, rec.tombstone)
    finally:
        dc._KNOWN_SCHEMAS.clear()
        dc._KNOWN_SCHEMAS.update(saved)
        dc._UNUSABLE_SCHEMAS.clear()
        dc._UNUSABLE_SCHEMAS.update(unusable)
        dc._last_known = ("\0", {})
        dc._SHAPE_OF_KNOWN.clear()
        dc._SHAPE_OF_KNOWN.update(shapes)


@hsettings(max_examples=400, deadline=None)
@given(payload=payload_texts, tail=st.sampled_from(["", " ", "\t", "  \r"]), learn=st.sampled_from(["dict", "prefix"]))
def test_payload_only_parse_equals_the_whole_line(payload, tail, learn):
    line = '{"schema":' + SCHEMA_TEXT + ',"payload":' + payload + "}" + tail
    assert parse(line, learn=learn) == parse(line, learn=False)


def test_the_fast_path_is_taken_and_keeps_decimals_exact():
    dc._KNOWN_SCHEMAS.clear()
    line = '{"schema":' + SCHEMA_TEXT + ',"payload":{"op":"c","after":{"id":1,"v":0.1}}}'
    dc.parse_record(line)
    assert list(dc._KNOWN_SCHEMAS) == [SCHEMA_TEXT]
    schema_text, cut = dc._schema_text(line)
    assert dc._payload_only(line, cut, dc._KNOWN_SCHEMAS[schema_text]).payload["after"]["v"] == __import__("decimal").Decimal("0.1")
    dc._KNOWN_SCHEMAS.clear()


@pytest.mark.parametrize(
    "schema_text",
    [
        SCHEMA_TEXT.replace('"optional":true', '"optional":true,"default":1.5', 1),  # floats: parsed exactly by the full path
        '{"type":"struct","parameters":{"a":"1","payload":"2"}}',  # the first ',"payload":' is inside the schema
    ],
)
def test_schemas_that_cannot_be_cut_safely_are_not_remembered(schema_text):
    dc._KNOWN_SCHEMAS.clear()
    dc._UNUSABLE_SCHEMAS.clear()
    dc.parse_record('{"schema":' + schema_text + ',"payload":{"op":"r"}}')
    assert dc._KNOWN_SCHEMAS == {}
    assert len(dc._UNUSABLE_SCHEMAS) == 1  # checked once, not on every line of the table
    dc._UNUSABLE_SCHEMAS.clear()


def _floats_anywhere(o) -> bool:
    """The plain definition has_float is a faster walk of."""
    if isinstance(o, float):
        return True
    if isinstance(o, dict):
        return any(_floats_anywhere(v) for v in o.values())
    if isinstance(o, list):
        return any(_floats_anywhere(v) for v in o)
    return False


@hsettings(max_examples=500, deadline=None)
@given(doc=values)
def test_has_float_finds_a_float_at_any_depth(doc):
    from cdc_apply.decode.base import has_float

    assert has_float(doc) == _floats_anywhere(doc)
