"""Round trip: random synthetic changes -> CES writer (optionally split into
segments, lines shuffled, some redelivered) -> decode_all + dedupe_ids -> the
same ops, keys, values (canonical text) and positions ordered like seq.
``HYPOTHESIS_EXAMPLES`` sets the number of examples."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_apply.decode.sqlserver_ces import SqlServerCesDecoder, decode_all_deduped
from cdc_apply.model import ChangeEvent, Held, Quarantined, RawMessage, Skipped, canonical_value, epoch_micros
from tests.formats import write_sqlserver_ces
from tests.formats.synthetic import COLUMNS, KEY, SyntheticChange, example_row

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "50"))
UTC = dt.UTC

names = st.one_of(st.none(), st.text(max_size=40))
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
        seq += draw(st.integers(1, 10**6))
        if out and draw(st.booleans()):
            tx += 1
            ts += dt.timedelta(microseconds=draw(st.integers(1, 10**9)))
        op = draw(st.sampled_from("cud"))
        key = draw(st.integers(1, 5))
        after = draw(rows(key)) if op in "cu" else None
        before = None
        if op == "u" or op == "d":
            before = draw(st.one_of(st.none(), rows(key)))
        out.append(SyntheticChange(op=op, key={"id": key}, after=after, before=before, seq=seq, tx=tx, commit_ts=ts))
    return out


def expected_text(col: str, value: Any) -> str | None:
    """Canonical text; timestamps rendered here because model.canonical_value's
    strftime drops the zero padding of years < 1000 (reported to the lead)."""
    if COLUMNS[col] == "timestamp" and value is not None:
        return value.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")
    return canonical_value(COLUMNS[col], value)


def check(changes: list[SyntheticChange], outcomes: list[Any], n_lines: int) -> None:
    assert not [o for o in outcomes if isinstance(o, (Quarantined, Held))], outcomes
    assert len(outcomes) == n_lines  # one outcome per line: event, split-segment or duplicate
    events = sorted((o for o in outcomes if isinstance(o, ChangeEvent)), key=lambda e: e.position)
    assert all(o.reason in ("split-segment", "duplicate-id") for o in outcomes if isinstance(o, Skipped))
    ordered = sorted(changes, key=lambda c: c.seq)
    assert [e.op.value for e in events] == [c.op for c in ordered]
    positions = [e.position for e in events]
    assert len(set(positions)) == len(positions)
    for ch, ev in zip(ordered, events):
        assert ev.key_columns == KEY
        assert [(c.name, c.type) for c in ev.columns] == list(COLUMNS.items())
        assert ev.commit_ts_us == epoch_micros(ch.commit_ts)
        if ch.op == "d":
            assert ev.after == {} and ev.before["id"] == str(ch.key["id"])
            if ch.before:
                assert ev.before == {col: expected_text(col, v) for col, v in ch.before.items()}
        else:
            expected = {col: expected_text(col, v) for col, v in ch.after.items()}
            assert ev.after == expected
    # one transaction run <-> one tx_id
    for (a, ea), (b, eb) in zip(zip(ordered, events), zip(ordered[1:], events[1:])):
        assert (a.tx == b.tx) == (ea.tx_id == eb.tx_id)


def decode_lines(lines: list[str]) -> list[Any]:
    msgs = [RawMessage(f"part-{i % 3}.jsonl", i, text) for i, text in enumerate(lines, 1)]
    return decode_all_deduped(SqlServerCesDecoder(), msgs)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    changes=change_lists(),
    split_every=st.one_of(st.none(), st.integers(40, 400)),
    style=st.sampled_from(["splitindex", "segmentindex"]),
    seed=st.integers(0, 2**32),
    redeliver=st.integers(0, 3),
)
def test_roundtrip(changes: list[SyntheticChange], split_every: int | None, style: str, seed: int, redeliver: int) -> None:
    lines = write_sqlserver_ces.write_messages(changes, split_every=split_every, style=style)
    rnd = random.Random(seed)
    if lines:
        lines += [rnd.choice(lines) for _ in range(redeliver)]  # at-least-once delivery
    rnd.shuffle(lines)
    check(changes, decode_lines(lines), len(lines))


def test_split_actually_splits_and_positions_follow_seq() -> None:
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    changes = [SyntheticChange("c", {"id": i}, example_row(i), None, seq=10 * i, tx=1 + i // 2, commit_ts=ts) for i in range(1, 5)]
    lines = write_sqlserver_ces.write_messages(changes, split_every=100)
    assert len(lines) > len(changes)
    assert {json.loads(line)["splittotalcnt"] for line in lines} - {0}
    out = decode_lines(list(reversed(lines)))
    check(changes, out, len(lines))


def test_writer_refuses_what_ces_cannot_express() -> None:
    ts = dt.datetime(2026, 1, 1, tzinfo=UTC)
    partial = SyntheticChange("u", {"id": 1}, {"id": 1, "name": "x"}, None, 1, 1, ts)
    for change in (
        partial,
        SyntheticChange("t", {}, None, None, 1, 1, ts),
        SyntheticChange("r", {"id": 1}, example_row(1), None, 1, 1, ts),
    ):
        with pytest.raises(NotImplementedError):
            write_sqlserver_ces.write_messages([change])
