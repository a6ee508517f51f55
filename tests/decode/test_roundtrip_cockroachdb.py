"""Round trip: random synthetic changes -> CockroachDB writer (wrapped and
enriched) -> decode_all -> the same upserts/deletes, keys, values (canonical
text) and positions ordered like seq.  ``HYPOTHESIS_EXAMPLES`` sets the
number of examples."""

from __future__ import annotations

import datetime as dt
import os
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_apply.decode.base import DecodeContext, decode_all
from cdc_apply.decode.cockroachdb import CockroachDbDecoder, parse_hlc
from cdc_apply.model import ChangeEvent, Op, RawMessage, canonical_value, epoch_micros
from tests.formats import write_cockroachdb
from tests.formats.synthetic import SyntheticChange, example_row

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "50"))
UTC = dt.UTC
CTX = DecodeContext(primary_keys={"items": ["id"]})
TYPES = {  # what the decoder declares, per envelope (None: no column for a JSON null)
    "wrapped": {"id": "bigint", "name": "string", "amount": "decimal(38,2)", "updated_at": "string"},
    "enriched": {"id": "bigint", "name": "string", "amount": "decimal(10,2)", "updated_at": "timestamp"},
}

names = st.one_of(st.none(), st.text(max_size=12))
amounts = st.one_of(st.none(), st.integers(-(10**10) + 1, 10**10 - 1).map(lambda n: Decimal(n).scaleb(-2)))
stamps = st.one_of(
    st.none(),
    st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30), timezones=st.just(UTC)),
)


@st.composite
def rows(draw, key: int) -> dict[str, Any]:
    return {"id": key, "name": draw(names), "amount": draw(amounts), "updated_at": draw(stamps)}


@st.composite
def change_lists(draw) -> list[SyntheticChange]:
    n = draw(st.integers(0, 12))
    seq, tx = 0, 1
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    out = []
    for _ in range(n):
        seq += draw(st.integers(1, 1000))
        if out and draw(st.booleans()):
            tx += 1
            ts += dt.timedelta(microseconds=draw(st.integers(1, 10**9)))
        op = draw(st.sampled_from("curd"))
        key = draw(st.integers(-(2**63), 2**63 - 1) if draw(st.booleans()) else st.integers(1, 5))
        after = before = None
        if op in "cur":
            after = draw(rows(key))
        if op == "u":
            before = draw(rows(key))
        if op == "d":
            before = draw(st.one_of(st.none(), st.just({"id": key}), rows(key)))
        out.append(SyntheticChange(op=op, key={"id": key}, after=after, before=before, seq=seq, tx=tx, commit_ts=ts))
    return out


def decode(lines: list[str]) -> list[ChangeEvent]:
    outcomes = list(decode_all(CockroachDbDecoder(CTX), [RawMessage("rt.jsonl", i, t) for i, t in enumerate(lines, 1)]))
    assert all(isinstance(o, ChangeEvent) for o in outcomes), [o for o in outcomes if not isinstance(o, ChangeEvent)]
    return outcomes


def expected_text(envelope: str, col: str, value: Any) -> str | None:
    if value is None:
        return None
    if envelope == "wrapped" and col == "updated_at":
        return write_cockroachdb._ts_text(value)
    if col == "id":
        return str(value)
    return canonical_value(TYPES["enriched"][col], value)


def check(envelope: str, changes: list[SyntheticChange], events: list[ChangeEvent]) -> None:
    assert len(events) == len(changes)
    types = TYPES[envelope]
    for ch, ev in zip(changes, events):
        assert (ev.table, ev.key_columns) == ("items", ["id"])
        assert ev.commit_ts_us == epoch_micros(ch.commit_ts)
        assert parse_hlc(ev.position) == (epoch_micros(ch.commit_ts) * 1000, ch.seq)
        if envelope == "enriched":
            assert (ev.database, ev.schema) == ("shop", "public")
            assert ev.op.value == ch.op
            assert [(c.name, c.type) for c in ev.columns] == list(types.items())
        else:
            assert ev.op is {"c": Op.INSERT, "u": Op.UPDATE, "d": Op.DELETE, "r": Op.READ}[ch.op]
        if ch.op == "d":
            assert ev.after == {} and ev.before["id"] == str(ch.key["id"])
            continue
        assert ev.after == {col: expected_text(envelope, col, v) for col, v in ch.after.items()}
        if envelope == "wrapped":
            declared = {c.name: c.type for c in ev.columns}
            assert declared == {c: types[c] for c, v in ch.after.items() if v is not None}
            if ch.after["updated_at"] is not None:  # the text is the exact instant
                assert canonical_value("timestamp", ev.after["updated_at"]) == canonical_value("timestamp", ch.after["updated_at"])
    positions = [e.position for e in events]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)


@pytest.mark.parametrize("envelope", write_cockroachdb.ENVELOPES)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=change_lists())
def test_roundtrip(envelope: str, changes: list[SyntheticChange]) -> None:
    check(envelope, changes, decode(write_cockroachdb.write_messages(changes, envelope)))


def test_initial_scan_read() -> None:
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    changes = [
        SyntheticChange("r", {"id": 1}, example_row(1), None, 5, 1, ts),
        SyntheticChange("u", {"id": 1}, example_row(1, name="m"), example_row(1), 6, 2, ts),
    ]
    for envelope in write_cockroachdb.ENVELOPES:
        events = decode(write_cockroachdb.write_messages(changes, envelope))
        check(envelope, changes, events)
        assert [e.op for e in events] == [Op.READ, Op.UPDATE]


def test_writer_refuses_what_cockroachdb_cannot_express() -> None:
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    partial = SyntheticChange("u", {"id": 1}, {"id": 1, "name": "x"}, {"id": 1}, 1, 1, ts)
    truncate = SyntheticChange("t", {}, None, None, 2, 1, ts)
    for envelope in write_cockroachdb.ENVELOPES:
        with pytest.raises(NotImplementedError):
            write_cockroachdb.write_messages([partial], envelope)
        with pytest.raises(NotImplementedError):
            write_cockroachdb.write_messages([truncate], envelope)
    with pytest.raises(ValueError):
        write_cockroachdb.write_messages([SyntheticChange("c", {"id": 1}, example_row(1), None, 1, 1, ts)], "bare")


def test_processing_time_is_not_the_position() -> None:
    """Enriched top-level ts_ns decreases with seq in the writer; positions must not."""
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    changes = [SyntheticChange("c", {"id": i}, example_row(i), None, i, i, ts + dt.timedelta(seconds=i)) for i in range(1, 4)]
    events = decode(write_cockroachdb.write_messages(changes, "enriched"))
    assert [e.position for e in events] == sorted(e.position for e in events)
