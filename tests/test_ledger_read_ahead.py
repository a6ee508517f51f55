"""The decoder state read ahead on a thread (``ledger.DecoderStateAhead``)
is the ledger's own read; a read that failed on the thread is made again by
the caller, who then sees its error; and the wait for the catalog to be
opened ends whether the thread opened it or failed to."""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from cdc_apply import ledger
from cdc_apply.results import BatchResult
from cdc_apply.status import Status


def _record(settings, source: str, state: dict, started: dt.datetime) -> None:
    ledger.Ledger(settings).record_batch(
        BatchResult(
            batch_id=f"{source}_{started:%H%M%S}",
            source=source,
            status=Status.COMPLETE,
            source_state=state,
            started_at=started.isoformat(),
        )
    )


def test_the_state_read_ahead_is_the_latest_complete_batchs(settings):
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    _record(settings, "ahead_a", {"n": 1}, t0)
    _record(settings, "ahead_a", {"n": 2}, t0 + dt.timedelta(hours=1))
    _record(settings, "ahead_b", {"n": 3}, t0 + dt.timedelta(hours=2))
    assert ledger.DecoderStateAhead(settings, "ahead_a").state() == {"n": 2}
    assert ledger.DecoderStateAhead(settings, "ahead_none").state() == {}


def test_a_read_that_failed_on_the_thread_is_made_again_and_its_error_seen(settings, monkeypatch):
    _record(settings, "ahead_c", {"n": 4}, dt.datetime(2026, 1, 2, tzinfo=dt.UTC))
    real = ledger.Ledger.latest_decoder_state
    calls: list[str] = []

    def on_thread_fails(self, source):
        calls.append(threading.current_thread().name)
        if threading.current_thread().name == "read-decoder-state":
            raise OSError("catalog locked")
        return real(self, source)

    monkeypatch.setattr(ledger.Ledger, "latest_decoder_state", on_thread_fails)
    ahead = ledger.DecoderStateAhead(settings, "ahead_c")
    ahead.catalog_opened()
    assert ahead.state() == {"n": 4}
    assert calls == ["read-decoder-state", threading.current_thread().name]

    def always_fails(self, source):
        raise OSError("catalog locked")

    monkeypatch.setattr(ledger.Ledger, "latest_decoder_state", always_fails)
    with pytest.raises(OSError, match="catalog locked"):
        ledger.DecoderStateAhead(settings, "ahead_c").state()


def test_the_wait_for_the_catalog_ends_when_the_thread_cannot_open_it(settings, monkeypatch):
    _record(settings, "ahead_d", {"n": 5}, dt.datetime(2026, 1, 3, tzinfo=dt.UTC))
    real = ledger.Ledger.catalog

    def on_thread_fails(self):
        if threading.current_thread().name == "read-decoder-state":
            raise OSError("catalog unreachable")
        return real.fget(self)

    monkeypatch.setattr(ledger.Ledger, "catalog", property(on_thread_fails))
    ahead = ledger.DecoderStateAhead(settings, "ahead_d")
    waiting = threading.Thread(target=ahead.catalog_opened, daemon=True)
    waiting.start()
    waiting.join(timeout=60)
    assert not waiting.is_alive(), "the wait for the catalog outlived the thread that failed to open it"
    assert ahead.state() == {"n": 5}


@pytest.mark.spark
def test_the_stored_column_types_read_ahead_are_the_ones_spark_reads(spark, settings):
    """Schemaless Debezium messages are typed by the stored tables' column
    types, read with pyiceberg on the thread: they must be Spark's names,
    type for type, for the project's own tables and every type Spark writes."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import NestedField, TimeType

    from cdc_apply.apply import tables
    from tests.apply_harness import apply_events, event

    ns, cat = "ahead_types", settings.catalog_name
    assert apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.50"}, pos=1)]).status == "complete"
    spark.sql(
        f"CREATE TABLE {cat}.{ns}.every_type (b boolean, i int, sm smallint, l bigint, f float, d double, n decimal(12,2), "
        "dt date, ts timestamp, tsn timestamp_ntz, s string, bin binary, arr array<string>, m map<string,bigint>, "
        "st struct<x:int,y:decimal(5,1)>, _cdc_position string) USING iceberg"
    )
    by_spark = tables.stored_column_types(spark, cat, ns)
    ahead = ledger.DecoderStateAhead(settings, "ahead_types", ns).stored_types()
    assert ahead == by_spark
    assert {"items", "items_changes", "every_type"} <= set(ahead)
    assert ledger.DecoderStateAhead(settings, "ahead_types", "ahead_no_such_ns").stored_types() == {}
    ledger.Ledger(settings).catalog.create_table((ns, "clock"), schema=Schema(NestedField(1, "t", TimeType(), required=False)))
    assert ledger.DecoderStateAhead(settings, "ahead_types", ns).stored_types() is None  # a type not named: the job asks Spark
    assert ledger.DecoderStateAhead(settings, "ahead_types").stored_types() is None  # not asked for
