"""Round trip: random synthetic changes -> Debezium writer -> decode_all ->
the same ops, keys, values (canonical text), present columns, and positions
ordered like seq.  ``HYPOTHESIS_EXAMPLES`` sets the number of examples."""

from __future__ import annotations

import datetime as dt
import os
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_apply.decode.base import decode_all
from cdc_apply.decode.debezium_postgres import DebeziumPostgresDecoder
from cdc_apply.decode.debezium_sqlserver import DebeziumSqlServerDecoder
from cdc_apply.model import ChangeEvent, RawMessage, Skipped, canonical_value, epoch_micros
from tests.formats import write_debezium_postgres, write_debezium_sqlserver
from tests.formats.synthetic import COLUMNS, KEY, SyntheticChange

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "50"))
UTC = dt.UTC
MISSING = object()

names = st.one_of(st.none(), st.text(max_size=12).filter(lambda s: s != write_debezium_postgres.PLACEHOLDER), st.just(MISSING))
amounts = st.one_of(st.none(), st.integers(-(10**10) + 1, 10**10 - 1).map(lambda n: Decimal(n).scaleb(-2)))
stamps = st.one_of(
    st.none(),
    st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30), timezones=st.just(UTC)),
)


@st.composite
def rows(draw, key: int) -> dict[str, Any]:
    row = {"id": key, "name": draw(names), "amount": draw(amounts), "updated_at": draw(stamps)}
    return {k: v for k, v in row.items() if v is not MISSING}


@st.composite
def change_lists(draw, ops: str) -> list[SyntheticChange]:
    n = draw(st.integers(0, 12))
    seq, tx = 0, 1
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    out = []
    for _ in range(n):
        seq += draw(st.integers(1, 1000))
        if out and draw(st.booleans()):
            tx += 1
            ts += dt.timedelta(microseconds=draw(st.integers(1, 10**9)))
        op = draw(st.sampled_from(ops))
        key = draw(st.integers(1, 5))
        after = before = None
        if op in "cur":
            after = draw(rows(key))
        if op in "ud":
            before = draw(st.one_of(st.none(), rows(key))) if op == "d" else draw(rows(key))
        out.append(SyntheticChange(op=op, key={} if op == "t" else {"id": key}, after=after, before=before, seq=seq, tx=tx, commit_ts=ts))
    return out


def run(decoder_cls, writer, changes: list[SyntheticChange]) -> tuple[list[ChangeEvent], list[Skipped]]:
    lines = writer.write_messages(changes)
    outcomes = list(decode_all(decoder_cls(), [RawMessage("rt.jsonl", i, t) for i, t in enumerate(lines, 1)]))
    events = [o for o in outcomes if isinstance(o, ChangeEvent)]
    skipped = [o for o in outcomes if isinstance(o, Skipped)]
    assert len(events) + len(skipped) == len(outcomes), [o for o in outcomes if not isinstance(o, (ChangeEvent, Skipped))]
    return events, skipped


def check(changes: list[SyntheticChange], events: list[ChangeEvent], skipped: list[Skipped]) -> None:
    assert len(events) == len(changes)
    assert [s.reason for s in skipped] == ["kafka-tombstone"] * sum(c.op == "d" for c in changes)
    for ch, ev in zip(changes, events):
        assert ev.op.value == ch.op
        assert ev.table == "items" and ev.database == "shop"
        assert ev.commit_ts_us == epoch_micros(ch.commit_ts)
        if ch.op == "t":
            assert ev.key_columns == [] and ev.after == {}
            continue
        assert ev.key_columns == KEY
        assert [(c.name, c.type) for c in ev.columns] == list(COLUMNS.items())
        if ch.op == "d":
            assert ev.after == {} and ev.before["id"] == str(ch.key["id"])
        else:
            expected = {col: canonical_value(COLUMNS[col], v) for col, v in ch.after.items()}
            assert ev.after == expected  # same values and the same present columns
    positions = [e.position for e in events]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change_lists("curdt"))
def test_roundtrip_postgres(changes: list[SyntheticChange]) -> None:
    events, skipped = run(DebeziumPostgresDecoder, write_debezium_postgres, changes)
    check(changes, events, skipped)
    assert [e.tx_id for e in events] == [str(c.tx) for c in changes]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change_lists("curd"))
def test_roundtrip_sqlserver(changes: list[SyntheticChange]) -> None:
    events, skipped = run(DebeziumSqlServerDecoder, write_debezium_sqlserver, changes)
    check(changes, events, skipped)
    # one transaction run <-> one commit LSN <-> one tx_id
    for (a, ea), (b, eb) in zip(zip(changes, events), zip(changes[1:], events[1:])):
        assert (a.tx == b.tx) == (ea.tx_id == eb.tx_id)


def test_writers_refuse_what_the_format_cannot_express() -> None:
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    partial_amount = SyntheticChange("u", {"id": 1}, {"id": 1, "name": "x"}, {"id": 1}, 1, 1, ts)
    with pytest.raises(NotImplementedError):
        write_debezium_postgres.write_messages([partial_amount])
    with pytest.raises(NotImplementedError):
        write_debezium_sqlserver.write_messages([partial_amount])
    with pytest.raises(NotImplementedError):
        write_debezium_sqlserver.write_messages([SyntheticChange("t", {}, None, None, 1, 1, ts)])


def test_pk_change_pair_orders_delete_before_create() -> None:
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    changes = [
        SyntheticChange("d", {"id": 1}, None, {"id": 1, "name": "a", "amount": None, "updated_at": None}, 7, 3, ts),
        SyntheticChange("c", {"id": 2}, {"id": 2, "name": "a", "amount": None, "updated_at": None}, None, 8, 3, ts),
    ]
    for dec, writer in ((DebeziumPostgresDecoder, write_debezium_postgres), (DebeziumSqlServerDecoder, write_debezium_sqlserver)):
        events, skipped = run(dec, writer, changes)
        check(changes, events, skipped)
