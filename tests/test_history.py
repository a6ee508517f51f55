"""SCD type 2 history (``history: scd2``, apply/history.py): every version of a
key, checked against the reference model's history row for row, over random
workloads, batch splits, duplicates and reorderings; and the cases a reader
relies on, spelled out."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings

from tests.apply_harness import apply_events, as_text, event
from tests.reference_model import history_model
from tests.test_apply_property import COLS, EXAMPLES, _ns, deliver, stamp, workloads

pytestmark = [pytest.mark.spark, pytest.mark.slow]
HISTORY = {"items": "scd2"}


def stored_history(spark, settings, ns: str) -> list[dict]:
    """The history table's versions; none when the table was never made (a
    workload of truncates alone creates no table, so no history)."""
    from cdc_apply.apply.tables import table_exists

    ident = f"{settings.catalog_name}.{ns}.items_history"
    if not table_exists(spark, ident):
        return []
    rows = spark.sql(
        f"SELECT {as_text(COLS)}, _cdc_valid_from, _cdc_valid_to, _cdc_op, _cdc_closed_by, _cdc_current FROM {ident}"
    ).collect()
    return sorted(
        (
            {
                "key": (r["id"],),
                "values": {c: r[c] for c in COLS},
                "valid_from": r["_cdc_valid_from"],
                "valid_to": r["_cdc_valid_to"],
                "op": r["_cdc_op"],
                "closed_by": r["_cdc_closed_by"],
                "current": r["_cdc_current"],
            }
            for r in rows
        ),
        key=lambda v: (v["key"], v["valid_from"]),
    )


def model_history(events) -> list[dict]:
    out = []
    for v in history_model(events, ["id"], list(COLS)):
        out.append({**v, "values": {c: v["values"].get(c) for c in COLS}, "current": v["valid_to"] is None})
    return sorted(out, key=lambda v: (v["key"], v["valid_from"]))


@hsettings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads(partial=True, partial_moves=True))
def test_history_equals_the_reference_model_in_any_delivery_order(spark, settings, w):
    """Late events split the version they belong in, re-deliveries change
    nothing, key changes carry the old key's columns: in any order and split
    (the history is rebuilt per key from the whole change log, so rule 3's
    limit for the table does not apply to it)."""
    events, seed, nbatches = w
    ns = f"hist_{next(_ns)}"
    batches = stamp(deliver(events, seed, nbatches, log_order=False), ns)
    for batch in batches:
        result = apply_events(spark, settings, ns, batch, history=HISTORY)
        assert result.status == "complete", result.message
    assert stored_history(spark, settings, ns) == model_history([e for b in batches for e in b])


def test_a_version_between_two_truncates_delivered_apart_is_closed_by_the_first(spark, settings):
    """The property test's shrunk example, kept: a partial update of key 1 at
    20, truncates at 30 and 50, other keys around them, delivered in two
    batches in the order seed 0 deals them.  The first batch is the truncate
    at 30 alone, before the table exists: no change log records it, and the
    history takes it from the source's truncate watermark."""
    import dataclasses

    events = [
        event("c", 1, {"name": None, "amount": None}, pos=10),
        event("u", 1, {}, pos=20),
        dataclasses.replace(event("t", 0, pos=30), key_columns=[]),
        event("c", 3, {"name": "", "amount": None}, pos=40),
        dataclasses.replace(event("t", 0, pos=50), key_columns=[]),
        event("u", 2, {"name": "x y"}, pos=60),
        event("c", 2, {"name": "a", "amount": "-7229.11"}, pos=70),
    ]
    ns = f"hist_{next(_ns)}"
    batches = stamp(deliver(events, 0, 2, log_order=False), ns)
    for batch in batches:
        assert apply_events(spark, settings, ns, batch, history=HISTORY).status == "complete"
    assert stored_history(spark, settings, ns) == model_history([e for b in batches for e in b])


def _two_keys_lives() -> list:
    """Key 1 inserted (10), updated (30) and deleted (40); key 2 inserted (50)."""
    return [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=10),
        event("u", 1, {"name": "c", "amount": "3.00"}, pos=30),
        event("d", 1, pos=40),
        event("c", 2, {"name": "x", "amount": "9.00"}, pos=50),
    ]


def _versions(spark, settings, ns: str) -> list[tuple]:
    """The stored versions as (key, name, amount, from, to, op, closed by), positions by their last two digits."""
    return [
        (v["key"], v["values"]["name"], v["values"]["amount"], v["valid_from"][-2:], (v["valid_to"] or "")[-2:], v["op"], v["closed_by"])
        for v in stored_history(spark, settings, ns)
    ]


def test_a_late_event_splits_the_version_it_belongs_in_and_a_rerun_adds_nothing(spark, settings):
    ns = f"hist_{next(_ns)}"
    first = _two_keys_lives()
    apply_events(spark, settings, ns, first, history=HISTORY, batch_tag="one")
    late = [event("u", 1, {"name": "b"}, pos=20, file=f"/virtual/{ns}/late.jsonl")]
    result = apply_events(spark, settings, ns, late, history=HISTORY, batch_tag="late")
    assert result.status == "complete", result.message
    assert _versions(spark, settings, ns) == [
        (("1",), "a", "1.00", "10", "20", "c", "u"),
        (("1",), "b", "1.00", "20", "30", "u", "u"),  # the late partial update: its version sits between, amount carried
        (("1",), "c", "3.00", "30", "40", "u", "d"),
        (("2",), "x", "9.00", "50", "", "c", None),
    ]
    before = stored_history(spark, settings, ns)
    again = apply_events(spark, settings, ns, late, history=HISTORY, batch_tag="again")  # the same file once more
    assert again.status == "complete", again.message
    assert stored_history(spark, settings, ns) == before


def test_a_rerun_after_the_change_log_s_publish_writes_the_history_from_the_published_log(spark, settings):
    """Killed between the change log's publish and the history's: the rerun
    finds the batch's changes in the change log's main (nothing to log
    again) and writes the history from there.  Found by the nemesis's kill
    at its first fast-forward: the change log read as a table inside the
    history's MERGE failed Spark's planning (``No plan for
    TableReference``), on every rerun: a person would have been paged."""
    from cdc_apply import ledger
    from cdc_apply.apply import changelog

    ns = f"hist_{next(_ns)}"
    first = _two_keys_lives()
    r = apply_events(spark, settings, ns, first, history=HISTORY, batch_tag="one", stages=("validate",))
    assert r.tables[0].status == "validated", r.tables[0].message
    changelog.publish(ledger.Ledger(settings), r.tables[0])  # the kill lands after this
    again = apply_events(spark, settings, ns, first, history=HISTORY, batch_tag="one")
    assert again.status == "complete", again.tables[0].message
    assert _versions(spark, settings, ns) == [
        (("1",), "a", "1.00", "10", "30", "c", "u"),
        (("1",), "c", "3.00", "30", "40", "u", "d"),
        (("2",), "x", "9.00", "50", "", "c", None),
    ]


def test_a_truncate_closes_every_current_version(spark, settings):
    from cdc_apply.model import ChangeEvent, Op

    ns = f"hist_{next(_ns)}"
    events = [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=10),
        event("c", 2, {"name": "b", "amount": "2.00"}, pos=20),
        ChangeEvent("x", "db", "public", "items", Op.TRUNCATE, [], {}, f"{30:020d}"),
        event("c", 2, {"name": "B"}, pos=40),
    ]
    apply_events(spark, settings, ns, events, history=HISTORY)
    got = [
        (v["key"], v["values"]["name"], v["values"]["amount"], v["closed_by"], v["current"]) for v in stored_history(spark, settings, ns)
    ]
    assert got == [(("1",), "a", "1.00", "t", False), (("2",), "b", "2.00", "t", False), (("2",), "B", None, None, True)]


def test_history_is_configured_per_table_and_needs_the_change_log(settings, tmp_path):
    import dataclasses

    from cdc_apply.config import load_sources
    from cdc_apply.errors import ConfigError

    f = tmp_path / "sources.yaml"
    s = dataclasses.replace(settings, sources_file=f)
    f.write_text("sources:\n  s:\n    format: debezium_postgres\n    tables:\n      public.items: {history: scd2}\n")
    assert load_sources(s)["s"].history == {"public.items": "scd2"}
    f.write_text("sources:\n  s:\n    format: debezium_postgres\n    tables:\n      public.items: {history: scd3}\n")
    with pytest.raises(ConfigError, match=r"history of table 'public.items' of source 's' is 'scd3'; use scd2"):
        load_sources(s)
    f.write_text("sources:\n  s:\n    format: debezium_postgres\n    changelog: false\n    tables:\n      public.items: {history: scd2}\n")
    with pytest.raises(ConfigError, match=r"built from the change log; remove changelog: false"):
        load_sources(s)


def test_history_turned_on_later_builds_every_key_the_change_log_holds(spark, settings):
    ns = f"hist_{next(_ns)}"
    before = [event("c", 1, {"name": "a", "amount": "1.00"}, pos=10), event("u", 1, {"name": "b"}, pos=20)]
    apply_events(spark, settings, ns, before, batch_tag="off")  # change log only
    result = apply_events(spark, settings, ns, [event("c", 2, {"name": "x", "amount": "2.00"}, pos=30)], history=HISTORY, batch_tag="on")
    assert result.status == "complete", result.message
    got = [(v["key"], v["values"]["name"], v["values"]["amount"], v["current"]) for v in stored_history(spark, settings, ns)]
    assert got == [(("1",), "a", "1.00", False), (("1",), "b", "1.00", True), (("2",), "x", "2.00", True)]
