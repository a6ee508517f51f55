"""Issue 23 probe, pure parts: SQL string literals and the primary-key property
against hostile identifiers (hypothesis), and quarantine reason classes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cdc_apply.apply.tables import decode_key, encode_key, sql_string
from cdc_apply.results import reason_class

HOSTILE = st.one_of(
    st.sampled_from(["k', 'injected'='yes", "id,x", "a`b", "x;y", "a.b", "a b", "\\", "'", "\\'", "ключ", "é,'\\\"", "x" * 300]),
    st.text(alphabet=st.sampled_from(list("'\"`;.,\\ ()[]{}=aé漢\u2028")), min_size=0, max_size=300),
    st.text(max_size=50),
)


@given(st.lists(HOSTILE, min_size=1, max_size=5))
def test_primary_key_property_round_trips_any_names(keys):
    assert decode_key(encode_key(keys)) == keys


def test_legacy_comma_property_is_still_read():
    assert decode_key("a,b") == ["a", "b"] and decode_key("") == [] and decode_key(None) == []


@pytest.mark.parametrize(
    "reason, cls",
    [
        ("DecodeError: malformed JSON: unexpected character: line 1 column 5 (char 4)", "malformed-json"),
        ("line is not UTF-8: 'utf-8' codec can't decode byte 0xff in position 3", "line-is-not-utf-8"),
        ("truncated gzip file: the stream ends before its end marker", "truncated-gzip-file"),
        ("KeyError: 'op'", "keyerror"),
        ("DecodeError: field 'op' is a list, not a string", "field-is-a-list-not-a-string"),
        (None, "other"),
    ],
)
def test_reason_class(reason, cls):
    assert reason_class(reason) == cls


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_reason_class_ignores_offsets_and_values(a, b):
    assert reason_class(f"DecodeError: malformed JSON: line {a} column {b}") == "malformed-json"


@pytest.mark.spark
@hsettings(max_examples=60, deadline=None)
@given(HOSTILE)
def test_sql_string_is_read_back_exactly_by_spark(spark, text):
    assert spark.sql(f"SELECT {sql_string(text)} AS v").collect()[0]["v"] == text


# -- 13. what a source can send vs garbage (model.canonical_value, decoders) -----------------------


@pytest.mark.parametrize(
    "typ, value, expected",
    [
        ("boolean", True, "true"),
        ("boolean", "TRUE", "true"),
        ("boolean", "t", "true"),
        ("boolean", 0, "false"),
        ("boolean", "0", "false"),
        ("int", "42", "42"),
        ("int", "-7", "-7"),
        ("int", "+7", "7"),
        ("bigint", 5.0, "5"),
        ("int", None, None),
    ],
)
def test_values_a_source_sends_are_accepted(typ, value, expected):
    from cdc_apply.model import canonical_value

    assert canonical_value(typ, value) == expected


@pytest.mark.parametrize(
    "typ, value",
    [
        ("boolean", "yes"),
        ("boolean", "no"),
        ("boolean", "y"),
        ("boolean", 2),
        ("boolean", 1.0),
        ("int", "1_000"),
        ("int", "\u0661\u0662"),
        ("int", "1.5"),
        ("int", True),
        ("int", str(2**31)),
        ("bigint", str(2**63)),
        ("int", ""),
    ],
)
def test_garbage_values_are_refused(typ, value):
    from cdc_apply.model import DecodeError, canonical_value

    with pytest.raises(DecodeError):
        canonical_value(typ, value)


def _pg_insert(after: dict, lsn: int) -> str:
    import datetime as dt

    from cdc_apply.demo import pg_message

    return pg_message("c", lsn, 1, dt.datetime(2026, 1, 1, tzinfo=dt.UTC), None, after)


@pytest.mark.parametrize(
    "after, lsn, reason",
    [
        ({"id": 1, "first_name": "a", "last_name": "b", "email": "e", "balance": None, "updated_at": None}, 2**64, "does not fit 64 bits"),
        (
            {"id": 1, "first_name": None, "last_name": "b", "email": "e", "balance": None, "updated_at": None},
            100,
            "null in a non-optional column",
        ),
    ],
    ids=["lsn-2^64", "null-in-not-null"],
)
def test_debezium_garbage_is_quarantined(after, lsn, reason):
    from cdc_apply.decode import make_decoder
    from cdc_apply.decode.base import DecodeContext
    from cdc_apply.model import Quarantined, RawMessage

    out = make_decoder("debezium_postgres", DecodeContext(source="s")).decode(RawMessage("f", 1, _pg_insert(after, lsn)))
    assert len(out) == 1 and isinstance(out[0], Quarantined) and reason in out[0].reason, out


def test_a_null_in_a_delete_before_image_is_kept():
    """PostgreSQL's default replica identity gives only the key in a delete's
    before image: nulls there are not garbage."""
    import datetime as dt

    from cdc_apply.decode import make_decoder
    from cdc_apply.decode.base import DecodeContext
    from cdc_apply.demo import pg_message
    from cdc_apply.model import ChangeEvent, RawMessage

    before = {"id": 1, "first_name": None, "last_name": None, "email": None, "balance": None, "updated_at": None}
    out = make_decoder("debezium_postgres", DecodeContext(source="s")).decode(
        RawMessage("f", 1, pg_message("d", 100, 1, dt.datetime(2026, 1, 1, tzinfo=dt.UTC), before, None))
    )
    assert isinstance(out[0], ChangeEvent)


# -- 10. one check_identifier for every decoder -------------------------------------------------------


def test_every_decoder_uses_the_one_identifier_check():
    from cdc_apply.decode import base, cockroachdb, debezium_common, qlik, sqlserver_ces

    assert (
        debezium_common.check_identifier
        is qlik.check_identifier
        is sqlserver_ces.check_identifier
        is cockroachdb.check_identifier
        is base.check_identifier
    )


@pytest.mark.parametrize("name", ["a`b", "x" * 129, "a\x00b", "", "  ", 5, None, "a\u2028b"])
def test_identifier_check_refuses_names_sql_cannot_hold(name):
    from cdc_apply.decode.base import check_identifier
    from cdc_apply.model import DecodeError

    with pytest.raises(DecodeError):
        check_identifier(name, "column")


@given(HOSTILE.filter(lambda n: n.strip() and len(n) <= 128 and not any(c in n for c in "`\u2028\x00") and n.isprintable()))
def test_identifier_check_accepts_quoted_hostile_names(name):
    from cdc_apply.decode.base import check_identifier

    assert check_identifier(name, "column") == name


def test_a_batch_id_is_the_digest_of_its_files_in_hour_order():
    """A batch's id never changes between releases: the ledger and the audit
    branches know a failed batch by it, and its retry must find them."""
    import datetime as dt
    import hashlib

    from cdc_apply.archive.files import ArchiveFile
    from cdc_apply.batch import batch_id_for, held_gone_batch_id

    late = ArchiveFile(dt.datetime(2026, 1, 1, 5, tzinfo=dt.UTC), "a/late.jsonl", 3, "c" * 64)
    early = ArchiveFile(dt.datetime(2026, 1, 1, 4, tzinfo=dt.UTC), "z/early.jsonl", 5, "d" * 64)
    lines = f"z/early.jsonl:{'d' * 64}\na/late.jsonl:{'c' * 64}"  # by hour, not by path
    assert batch_id_for("src", [late, early]) == "src_" + hashlib.sha256(lines.encode()).hexdigest()[:16]
    lost = {"z/early.jsonl": {"sha256": "d" * 64}, "a/late.jsonl": {"sha256": "c" * 64}}
    by_path = f"a/late.jsonl:{'c' * 64}\nz/early.jsonl:{'d' * 64}"
    assert held_gone_batch_id("src", lost) == "src_" + hashlib.sha256(by_path.encode()).hexdigest()[:16]
