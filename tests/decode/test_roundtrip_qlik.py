"""Round trip: random synthetic changes -> Qlik writer -> decode_all -> the same
ops, keys, values (canonical text), present columns, transactions, commit
times and positions ordered like seq.  ``HYPOTHESIS_EXAMPLES`` sets the number
of examples.

Qlik DATETIME is zone-less: the synthetic aware-UTC ``updated_at`` comes back as
its UTC wall clock typed ``timestamp_ntz``.  REFRESH (full load) rows precede
CDC in a real stream, so the generated lists put all 'r' changes first; they
carry no change sequence, transaction or timestamp."""

from __future__ import annotations

import datetime as dt
import os
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_apply.decode.base import decode_all
from cdc_apply.decode.qlik import REFRESH_SEQUENCE, QlikDecoder
from cdc_apply.model import ChangeEvent, Op, RawMessage, Skipped, canonical_value, epoch_micros
from tests.formats import write_qlik
from tests.formats.synthetic import KEY, SyntheticChange

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "50"))
UTC = dt.UTC
MISSING = object()
QLIK_COLUMNS = {"id": "int", "name": "string", "amount": "decimal(10,2)", "updated_at": "timestamp_ntz"}

names = st.one_of(st.none(), st.text(max_size=12), st.just(MISSING))
amounts = st.one_of(st.none(), st.integers(-(10**10) + 1, 10**10 - 1).map(lambda n: Decimal(n).scaleb(-2)), st.just(MISSING))
stamps = st.one_of(
    st.none(),
    st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30), timezones=st.just(UTC)),
    st.just(MISSING),
)


@st.composite
def rows(draw, key: int) -> dict[str, Any]:
    row = {"id": key, "name": draw(names), "amount": draw(amounts), "updated_at": draw(stamps)}
    return {k: v for k, v in row.items() if v is not MISSING}


@st.composite
def change_lists(draw) -> list[SyntheticChange]:
    n_refresh = draw(st.integers(0, 4))
    n_cdc = draw(st.integers(0, 12))
    seq, tx = 0, 1
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    out = []
    refresh_keys = draw(st.lists(st.integers(1, 9), min_size=n_refresh, max_size=n_refresh, unique=True))
    for key in refresh_keys:
        seq += 1
        out.append(SyntheticChange("r", {"id": key}, draw(rows(key)), None, seq, 0, ts))
    for _ in range(n_cdc):
        seq += draw(st.integers(1, 1000))
        if out and draw(st.booleans()):
            tx += 1
            ts += dt.timedelta(microseconds=draw(st.integers(1, 10**9)))
        op = draw(st.sampled_from("cud"))
        key = draw(st.integers(1, 5))
        after = draw(rows(key)) if op in "cu" else None
        before = draw(st.one_of(st.none(), rows(key))) if op in "ud" else None
        out.append(SyntheticChange(op, {"id": key}, after, before, seq, tx, ts))
    return out


def run(changes: list[SyntheticChange]) -> tuple[list[ChangeEvent], list[Skipped]]:
    lines = write_qlik.write_messages(changes)
    outcomes = list(decode_all(QlikDecoder(), [RawMessage("rt.jsonl", i, t) for i, t in enumerate(lines, 1)]))
    events = [o for o in outcomes if isinstance(o, ChangeEvent)]
    skipped = [o for o in outcomes if isinstance(o, Skipped)]
    assert len(events) + len(skipped) == len(outcomes), [o for o in outcomes if not isinstance(o, (ChangeEvent, Skipped))]
    return events, skipped


def expected_image(row: dict[str, Any]) -> dict[str, str | None]:
    out = {}
    for col, v in row.items():
        if col == "updated_at" and v is not None:
            v = v.astimezone(UTC).replace(tzinfo=None)
        out[col] = canonical_value(QLIK_COLUMNS[col], v)
    return out


def check(changes: list[SyntheticChange], events: list[ChangeEvent], skipped: list[Skipped]) -> None:
    assert [s.reason for s in skipped] == ["table-metadata"]
    assert len(events) == len(changes)
    for ch, ev in zip(changes, events):
        assert ev.op.value == ch.op
        assert (ev.schema, ev.table, ev.database) == ("dbo", "items", None)
        assert ev.key_columns == KEY
        assert [(c.name, c.type) for c in ev.columns] == list(QLIK_COLUMNS.items())
        if ch.op == "r":
            assert ev.commit_ts_us is None and ev.tx_id is None
            assert ev.position.startswith(REFRESH_SEQUENCE + "|")
        else:
            assert ev.commit_ts_us == epoch_micros(ch.commit_ts)
            assert ev.tx_id == f"{ch.tx:032x}"
        if ch.op == "d":
            assert ev.after == {}
            assert ev.before == expected_image({**(ch.before or {}), "id": ch.key["id"]})
        else:
            assert ev.after == expected_image({**ch.after, "id": ch.key["id"]})  # same values, same present columns
            if ch.op == "u" and ch.before is not None:
                # the columnMask (from after) also governs beforeData
                assert ev.before == {k: v for k, v in expected_image(ch.before).items() if k in ch.after} | {
                    k: None for k in ch.after if k not in ch.before
                }
    positions = [e.position for e in events]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change_lists())
def test_roundtrip_qlik(changes: list[SyntheticChange]) -> None:
    events, skipped = run(changes)
    check(changes, events, skipped)


def test_writer_refuses_truncate() -> None:
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    with pytest.raises(NotImplementedError):
        write_qlik.write_messages([SyntheticChange("t", {}, None, None, 1, 1, ts)])


def test_writer_mask_layout() -> None:
    assert write_qlik.mask({"id", "name", "updated_at"}) == "0B"  # the spec's example: ordinals 1, 2, 4
    assert write_qlik.mask(set(write_qlik.NAMES)) == "0F"


def test_pk_change_pair_orders_delete_before_create() -> None:
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    changes = [
        SyntheticChange("d", {"id": 1}, None, {"id": 1, "name": "a", "amount": None, "updated_at": None}, 7, 3, ts),
        SyntheticChange("c", {"id": 2}, {"id": 2, "name": "a", "amount": None, "updated_at": None}, None, 8, 3, ts),
    ]
    events, skipped = run(changes)
    check(changes, events, skipped)
    assert [e.op for e in events] == [Op.DELETE, Op.INSERT]
