"""One test per apply rule (docs/apply-semantics.md), on real Spark + Iceberg."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from tests.apply_harness import apply_events, event, live_rows
from tests.reference_model import apply_model

pytestmark = pytest.mark.spark
COLS = {"id": "int", "name": "string", "amount": "decimal(10,2)"}
_ns = itertools.count()


@pytest.fixture
def ns():
    return f"rules_{next(_ns)}"


def rows(spark, settings, ns):
    return {k[0]: (v["name"], v["amount"]) for k, v in live_rows(spark, settings, ns, "items", ["id"], COLS).items()}


def check_model(spark, settings, ns, batches):
    model = apply_model([e for b in batches for e in b], ["id"], list(COLS))
    got = live_rows(spark, settings, ns, "items", ["id"], COLS)
    assert {k: {c: v.get(c) for c in COLS} for k, v in model.items()} == {tuple(k): v for k, v in got.items()}


def test_last_write_wins_within_a_batch(spark, settings, ns):
    b = [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=1),
        event("u", 1, {"name": "b", "amount": "2.00"}, pos=3),
        event("u", 1, {"name": "x", "amount": "9.00"}, pos=2),
    ]
    r = apply_events(spark, settings, ns, b)
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"1": ("b", "2.00")}
    t = r.tables[0]
    assert t.counts["inserted"] == 1 and t.counts["superseded"] == 2
    check_model(spark, settings, ns, [b])


def test_insert_then_delete_leaves_nothing_and_delete_then_insert_keeps_insert(spark, settings, ns):
    apply_events(spark, settings, ns, [event("c", 9, {"name": "keep", "amount": "0.00"}, pos=1)])
    b = [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=10),
        event("d", 1, pos=11),
        event("d", 9, pos=12),
        event("c", 9, {"name": "new", "amount": "3.00"}, pos=13),
    ]
    r = apply_events(spark, settings, ns, b)
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"9": ("new", "3.00")}
    c = r.tables[0].counts
    assert (c["noop_deletes"], c["updated"], c["superseded"]) == (1, 1, 2)


def test_delete_of_unknown_key_is_a_counted_noop_and_blocks_late_insert(spark, settings, ns):
    r = apply_events(spark, settings, ns, [event("d", 5, pos=20)])
    assert r.tables[0].counts["noop_deletes"] == 1
    late = apply_events(spark, settings, ns, [event("c", 5, {"name": "zombie", "amount": "1.00"}, pos=10, file="/virtual/late")])
    # it fills the state the tombstone keeps (what a key change's new key would inherit), and stays dead
    assert (late.tables[0].counts["filled"], late.tables[0].counts["superseded"]) == (1, 0)
    assert rows(spark, settings, ns) == {}


def test_primary_key_change_moves_the_row(spark, settings, ns):
    apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    b = [event("d", 1, pos=5), event("c", 2, {"name": "a", "amount": "1.00"}, pos=5)]
    apply_events(spark, settings, ns, b)
    assert rows(spark, settings, ns) == {"2": ("a", "1.00")}


def test_partial_rows_keep_stored_values_and_null_sets_null(spark, settings, ns):
    apply_events(
        spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1), event("c", 2, {"name": "b", "amount": "2.00"}, pos=2)]
    )
    b = [event("u", 1, {"amount": "5.00"}, pos=3), event("u", 2, {"name": None}, pos=4), event("u", 2, {"amount": "7.00"}, pos=5)]
    apply_events(spark, settings, ns, b)
    assert rows(spark, settings, ns) == {"1": ("a", "5.00"), "2": (None, "7.00")}


def test_truncate_removes_rows_and_late_older_events(spark, settings, ns):
    first = [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1), event("c", 2, {"name": "b", "amount": "2.00"}, pos=2)]
    apply_events(spark, settings, ns, first)
    trunc = event("t", 0, pos=10)
    trunc.key_columns, trunc.after, trunc.before = [], {}, None
    b = [trunc, event("c", 3, {"name": "c", "amount": "3.00"}, pos=11), event("u", 2, {"name": "old", "amount": "0.00"}, pos=9)]
    r = apply_events(spark, settings, ns, b)
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"3": ("c", "3.00")}
    late = apply_events(spark, settings, ns, [event("c", 7, {"name": "late", "amount": "1.00"}, pos=8, file="/virtual/late")])
    assert late.tables[0].counts["superseded"] == 1
    assert rows(spark, settings, ns) == {"3": ("c", "3.00")}


def test_snapshot_read_is_an_upsert(spark, settings, ns):
    apply_events(spark, settings, ns, [event("r", 1, {"name": "snap", "amount": "1.00"}, pos=1)])
    apply_events(spark, settings, ns, [event("r", 1, {"name": "snap2", "amount": "2.00"}, pos=2)])
    assert rows(spark, settings, ns) == {"1": ("snap2", "2.00")}


def test_older_event_in_a_later_batch_never_regresses(spark, settings, ns):
    apply_events(spark, settings, ns, [event("u", 1, {"name": "new", "amount": "2.00"}, pos=20)])
    r = apply_events(spark, settings, ns, [event("u", 1, {"name": "old", "amount": "1.00"}, pos=10, file="/virtual/old")])
    assert r.tables[0].counts["superseded"] == 1
    assert rows(spark, settings, ns) == {"1": ("new", "2.00")}


def test_duplicates_in_and_across_batches_have_no_effect(spark, settings, ns):
    e = event("c", 1, {"name": "a", "amount": "1.00"}, pos=1, line=1)
    dup = event("c", 1, {"name": "a", "amount": "1.00"}, pos=1, line=2)
    r = apply_events(spark, settings, ns, [e, dup])
    assert r.tables[0].counts["duplicates"] == 1
    again = event("c", 1, {"name": "a", "amount": "1.00"}, pos=1, file="/virtual/again")
    r2 = apply_events(spark, settings, ns, [again])
    assert r2.tables[0].counts["duplicates"] == 1
    assert rows(spark, settings, ns) == {"1": ("a", "1.00")}


def test_rerunning_a_batch_is_a_noop(spark, settings, ns):
    b = [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1, file="/virtual/x")]
    apply_events(spark, settings, ns, b, batch_tag="same")
    snaps = spark.sql(f"SELECT count(*) FROM {settings.catalog_name}.{ns}.items.snapshots").collect()[0][0]
    r = apply_events(spark, settings, ns, b, batch_tag="same")
    assert r.tables[0].status == "skipped"
    assert spark.sql(f"SELECT count(*) FROM {settings.catalog_name}.{ns}.items.snapshots").collect()[0][0] == snaps


def test_accounting_adds_up(spark, settings, ns):
    b = [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=1, line=1),
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=1, line=2),
        event("u", 1, {"name": "b"}, pos=2),
        event("d", 2, pos=3),
        event("c", 3, {"name": "c", "amount": "1.00"}, pos=4),
    ]
    r = apply_events(spark, settings, ns, b)
    c = r.tables[0].counts
    assert sum(c[k] for k in ("inserted", "updated", "deleted", "noop_deletes", "superseded", "duplicates", "truncates")) == len(b)


def test_event_without_a_key_value_is_quarantined_and_changes_nothing(spark, settings, ns):
    """A configured key the messages do not carry (here: a delete names only
    ``id``, the key is ``name``): that event is quarantined as ``null-key``
    (file, line, reason) and deletes nothing; the table applies the rest
    (issue 23: a keyless message never blocks the table)."""
    apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)], primary_keys={"items": ["name"]})
    r = apply_events(
        spark, settings, ns, [event("u", 2, {"name": "b", "amount": "2.00"}, pos=2), event("d", 1, pos=3)], primary_keys={"items": ["name"]}
    )
    assert r.messages.get("quarantined:null-key") == 1, r.messages
    assert ("a", "1.00") in rows(spark, settings, ns).values()  # the keyless delete removed nothing


# --- the MERGE's key range (merge.key_range_condition) -----------------------

KEYED_KEYS = ["code", "amt", "day", "n"]


def keyed(op, key: tuple, v=None, *, pos):
    """An event of table ``keyed``: a composite key of every type that gets a range literal."""
    from cdc_apply.model import ChangeEvent, Column, Op

    cols = [
        Column("code", "string", False),
        Column("amt", "decimal(12,2)", False),
        Column("day", "date", False),
        Column("n", "bigint", False),
        Column("v", "string"),
    ]
    k = dict(zip(KEYED_KEYS, key))
    return ChangeEvent(
        format="debezium_postgres",
        database="db",
        schema="public",
        table="keyed",
        op=Op(op),
        key_columns=KEYED_KEYS,
        after={**k, "v": v} if op != "d" else {},
        before=k if op == "d" else None,
        position=f"{pos:020d}",
        columns=cols,
        file="",
        line=pos,
        commit_ts_us=1_700_000_000_000_000 + pos,
    )


def test_keys_of_every_literal_type_are_matched_through_the_range(spark, settings, ns):
    """The range's literals (quotes, backslashes, non-ASCII, empty text,
    negative and large decimals, bigint extremes, dates) must keep every
    batch key inside it: a key outside would not match its row, and the
    MERGE would insert it a second time (the gate's uniqueness check)."""
    keys = [
        ("O'Br\\ien", "-0.50", "2024-02-29", str(-(2**63))),
        ("ü", "9999999999.99", "1970-01-01", str(2**63 - 1)),
        ("", "0.00", "9999-12-31", "0"),
    ]
    cols = {"code": "string", "amt": "decimal(12,2)", "day": "date", "n": "bigint", "v": "string"}
    r1 = apply_events(spark, settings, ns, [keyed("c", k, "old", pos=i + 1) for i, k in enumerate(keys)])
    new_key = ("zz", "-9999999999.99", "0001-01-01", "7")
    b2 = [
        keyed("u", keys[0], "new0", pos=10),
        keyed("u", keys[1], "new1", pos=11),
        keyed("d", keys[2], pos=12),
        keyed("c", new_key, "new", pos=13),
    ]
    r2 = apply_events(spark, settings, ns, b2)
    assert (r1.status, r2.status) == ("complete", "complete"), r2.tables[0].message
    assert r2.tables[0].counts["updated"] == 2 and r2.tables[0].counts["deleted"] == 1 and r2.tables[0].counts["inserted"] == 1
    got = {k: v["v"] for k, v in live_rows(spark, settings, ns, "keyed", KEYED_KEYS, cols).items()}
    assert got == {keys[0]: "new0", keys[1]: "new1", new_key: "new"}
    assert spark.table(f"{settings.catalog_name}.{ns}.keyed").count() == 4  # 3 live rows + the tombstone, no duplicates


@pytest.mark.parametrize("mode", ["copy-on-write", "merge-on-read"])
def test_merge_reads_only_the_batch_key_range_in_either_write_mode(spark, settings, ns, mode):
    """Targets are copy-on-write; a table fed by small batches of scattered
    keys can be switched to merge-on-read (README, "Table layout"), and the
    apply then writes a position delete instead of rewriting the data file.
    Either way the MERGE's target scan carries the batch's key range, so
    data files outside it are not read."""
    from cdc_apply.apply import merge, tables

    apply_events(spark, settings, ns, [event("c", k, {"name": "a", "amount": "1.00"}, pos=k) for k in range(1, 4)])
    ident = f"{settings.catalog_name}.{ns}.items"
    assert tables.merge_mode(spark, ident) == "copy-on-write"
    apply_events(spark, settings, ns, [event("c", k, {"name": "b", "amount": "2.00"}, pos=k) for k in range(101, 104)], merge_mode=mode)
    apply_events(spark, settings, ns, [event("u", 102, {"name": "c", "amount": "3.00"}, pos=200)], merge_mode=mode)
    summary = spark.sql(f"SELECT summary FROM {ident}.snapshots WHERE summary['spark.merge-into.num-target-rows-updated'] = '1'").collect()
    written = [(s[0].get("added-position-deletes"), s[0].get("deleted-data-files")) for s in summary]
    assert written == ([("1", None)] if mode == "merge-on-read" else [(None, "1")]), summary
    assert rows(spark, settings, ns) == {
        "1": ("a", "1.00"),
        "2": ("a", "1.00"),
        "3": ("a", "1.00"),
        "101": ("b", "2.00"),
        "102": ("c", "3.00"),
        "103": ("b", "2.00"),
    }

    spec = tables.TableSpec(identifier=ident, key_columns=["id"], columns=COLS)
    spark.sql(  # one net change, shaped as compact.merge_source
        "SELECT CAST(id AS int) AS id, 'x' AS name, CAST(1 AS decimal(10,2)) AS amount, array('name') AS _cdc_present, 'upsert' AS _cdc_action, "
        "map('name', '9') AS _cdc_cpos, CAST(NULL AS string) AS _cdc_delpos, '9' AS _cdc_pos, 'u' AS _cdc_op, current_timestamp() AS _cdc_commit_ts, CAST(NULL AS string) AS _cdc_tx_id, "
        "'9' AS _cdc_cid, cast(map() AS map<string,string>) AS _cdc_inh, CAST(NULL AS string) AS _cdc_endcid FROM range(102, 103)"
    ).createOrReplaceTempView("_probe")
    plan = spark.sql("EXPLAIN " + merge.merge_sql(spec, "main", "_probe", "probe", {"id": (101, 103)})).collect()[0][0]
    scans = [line for line in plan.splitlines() if "BatchScan" in line and ident in line]
    assert scans and all("filters=id >= 101, id <= 103" in line for line in scans), plan
    assert "BETWEEN" not in merge.merge_sql(spec, "main", "_probe", "probe", None)


def test_the_reconciliation_reads_only_the_batch_key_range_new_keys_included(spark, settings, ns):
    """The reconciliation's scans of the branch and of main carry the ranges of
    the keys the batch writes, so a batch into a large table does not read
    its data files outside the batch: one range of its stored keys (the
    MERGE's), one of its new keys, which a single range around both would
    not prune when new keys come from a sequence far above the stored ones.
    A new key outside the stored range must still be found on the branch,
    or the gate refuses the batch (``reconcile_upserted_keys_present``)."""

    apply_events(spark, settings, ns, [event("c", k, {"name": "a", "amount": "1.00"}, pos=k) for k in range(1, 4)])
    apply_events(spark, settings, ns, [event("c", k, {"name": "b", "amount": "2.00"}, pos=k) for k in range(101, 104)])
    start = max((e["id"] for e in _sql_executions(spark)), default=-1)
    batch = [event("u", 102, {"name": "c", "amount": "3.00"}, pos=200), event("c", 500, {"name": "d", "amount": "4.00"}, pos=201)]
    r = apply_events(spark, settings, ns, batch)
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns)["500"] == ("d", "4.00") and rows(spark, settings, ns)["102"] == ("c", "3.00")
    ident = f"{settings.catalog_name}.{ns}.items"
    scans = _phase_scans(spark, start, ident, "reconcile", at_least=3)
    keyed = [line for line in scans if "filters=((id >= 102 AND id <= 102) OR (id >= 500 AND id <= 500))," in line]
    tombstones = [line for line in scans if "filters=(_cdc_deleted IS NULL OR _cdc_deleted = true)," in line]
    # the branch's and main's rows of the batch's keys are pruned; the live-row count reads the files that
    # may hold a tombstone, and takes the table's rows from its manifests (no scan without a filter)
    assert len(scans) == 3 and len(keyed) == 2 and len(tombstones) == 1, scans


@pytest.mark.parametrize("mode", ["copy-on-write", "merge-on-read"])
def test_live_rows_counts_what_a_scan_of_the_live_rows_counts(spark, settings, ns, mode):
    """``tables.live_rows`` takes the table's rows from Iceberg's metadata and
    subtracts the tombstones: it must count exactly the rows whose
    ``_cdc_deleted`` is false, with rows whose flag is null, and with a
    merge-on-read delete that hides rows from the data files' record counts."""
    from cdc_apply.apply import tables

    ident = f"{settings.catalog_name}.{ns}.flags"
    spark.sql(
        f"CREATE TABLE {ident} (id bigint, _cdc_deleted boolean) USING iceberg "
        f"TBLPROPERTIES ('format-version'='2', 'write.delete.mode'='{mode}', 'write.update.mode'='{mode}')"
    )
    spark.sql(f"INSERT INTO {ident} VALUES (1, false), (2, false), (3, true), (4, CAST(NULL AS boolean)), (5, false)")
    spark.sql(f"INSERT INTO {ident} SELECT id, false FROM range(10, 20)")
    spark.sql(f"DELETE FROM {ident} WHERE id IN (2, 11)")
    spark.sql(f"UPDATE {ident} SET _cdc_deleted = true WHERE id = 12")
    table = spark.table(ident)
    assert tables.live_rows(table) == table.where("NOT _cdc_deleted").count() == 10


def test_a_batch_whose_changes_win_every_column_merges_without_reading_the_stored_values(spark, settings, ns, monkeypatch):
    """A batch in which every stored key's net change sets every column above
    the stored row's position (full row images of updates) takes its rows
    whole: under merge-on-read the MERGE reads the key and a few CDC columns
    of the table, not the stored values nor ``_cdc_col_pos`` (copy-on-write
    rewrites whole files anyway).  A batch with one change that leaves a
    column out, or deletes a stored row (its tombstone keeps the stored
    values), keeps the per-column MERGE.  A stored row that moved after the labelling fails
    the MERGE instead of being overwritten."""
    from cdc_apply.apply import merge, tables

    seen = []
    real = merge.merge_sql
    monkeypatch.setattr(merge, "merge_sql", lambda *a, **kw: seen.append(kw.get("whole_rows", False)) or real(*a, **kw))
    batches = [
        [event("c", k, {"name": "a", "amount": "1.00"}, pos=k) for k in (1, 2, 3)],
        [event("u", 1, {"name": "b", "amount": "2.00"}, pos=10), event("u", 3, {"name": "b", "amount": "2.00"}, pos=12)],
        [event("u", 1, {"name": "c"}, pos=20), event("u", 3, {"name": "c", "amount": "3.00"}, pos=21)],  # key 1 partial
        [event("d", 2, pos=25), event("u", 1, {"name": "d", "amount": "4.00"}, pos=30)],  # a tombstone keeps the stored values
        [event("c", 2, {"name": "again", "amount": "5.00"}, pos=40)],  # over a tombstone
    ]
    for b in batches:
        assert apply_events(spark, settings, ns, b).status == "complete"
    assert seen == [True, False, False, True]
    assert rows(spark, settings, ns) == {"1": ("d", "4.00"), "2": ("again", "5.00"), "3": ("c", "3.00")}
    check_model(spark, settings, ns, batches)

    ident = f"{settings.catalog_name}.{ns}.items"
    spec = tables.TableSpec(identifier=ident, key_columns=["id"], columns=COLS)
    spark.sql(  # a net change of key 1 labelled against a stored row that is not the stored one now
        "SELECT 1 AS id, 'x' AS name, CAST(9 AS decimal(10,2)) AS amount, array('name', 'amount') AS _cdc_present, 'upsert' AS _cdc_action, "
        f"map('name', '{99:020d}', 'amount', '{99:020d}') AS _cdc_cpos, CAST(NULL AS string) AS _cdc_delpos, '{99:020d}' AS _cdc_pos, "
        "'u' AS _cdc_op, current_timestamp() AS _cdc_commit_ts, CAST(NULL AS string) AS _cdc_tx_id, '99' AS _cdc_cid, "
        f"cast(map() AS map<string,string>) AS _cdc_inh, CAST(NULL AS string) AS _cdc_endcid, '{10:020d}' AS _cdc_stored_pos"
    ).createOrReplaceTempView("_probe")

    spark.sql(f"ALTER TABLE {ident} SET TBLPROPERTIES ('write.merge.mode'='merge-on-read')")  # copy-on-write reads whole files anyway

    def target_scan(whole: bool) -> str:
        plan = spark.sql("EXPLAIN " + real(spec, "main", "_probe", "probe", matched_only=True, whole_rows=whole)).collect()[0][0]
        return next(line for line in plan.splitlines() if "BatchScan" in line and ident in line)

    assert all(c in target_scan(False) for c in ("name", "amount", "_cdc_col_pos"))
    assert not any(c in target_scan(True) for c in ("name", "amount", "_cdc_col_pos")), target_scan(True)
    with pytest.raises(Exception, match="changed after its labelling"):
        spark.sql(real(spec, "main", "_probe", "probe", matched_only=True, whole_rows=True))
    assert rows(spark, settings, ns)["1"] == ("d", "4.00")


def test_a_source_merge_mode_is_kept_on_its_tables(spark, settings, ns):
    """``merge_mode`` in sources.yaml sets ``write.merge.mode`` when a table is
    created and puts it back when it differs; left out (``auto``), each batch
    that updates stored rows chooses."""
    ident = f"{settings.catalog_name}.{ns}.items"

    def mode():
        from cdc_apply.apply.tables import merge_mode

        return merge_mode(spark, ident)

    def last_update():
        main = f"(SELECT snapshot_id FROM {ident}.refs WHERE name = 'main')"
        s = spark.sql(f"SELECT summary FROM {ident}.snapshots WHERE snapshot_id = {main}").collect()[0][0]
        return s.get("added-position-deletes"), s.get("deleted-data-files")

    r = apply_events(
        spark, settings, ns, [event("c", k, {"name": "a", "amount": "1.00"}, pos=k) for k in (1, 2)], merge_mode="merge-on-read"
    )
    assert (r.tables[0].schema_changes, mode()) == (["created table"], "merge-on-read")
    r = apply_events(spark, settings, ns, [event("u", 1, {"name": "b"}, pos=10)], merge_mode="merge-on-read")
    assert (r.tables[0].schema_changes, last_update()) == ([], ("1", None))
    r = apply_events(spark, settings, ns, [event("u", 2, {"name": "c"}, pos=11)], merge_mode="copy-on-write")
    assert (r.tables[0].schema_changes, mode(), last_update()) == (
        ["write.merge.mode merge-on-read -> copy-on-write"],
        "copy-on-write",
        (None, "1"),
    )
    spark.sql(f"ALTER TABLE {ident} SET TBLPROPERTIES ('write.merge.mode'='merge-on-read')")  # by hand
    r = apply_events(spark, settings, ns, [event("u", 1, {"name": "d"}, pos=12)])  # auto: 1 key of 2 rows is many
    assert (r.tables[0].schema_changes, mode(), last_update()) == ([], "copy-on-write", (None, "1"))
    assert rows(spark, settings, ns) == {"1": ("d", "1.00"), "2": ("c", "1.00")}


def test_auto_merge_mode_writes_deletes_for_a_few_keys_and_rewrites_for_many(spark, settings, ns):
    """``merge_mode: auto`` (the default): a batch whose stored keys are at most
    ``MERGE_ON_READ_MAX_SHARE`` of the table's live rows is written
    merge-on-read (position deletes, no data file rewritten: the hourly batch
    into a large table); more keys are written copy-on-write.  Both results
    equal the same rows."""
    from cdc_apply.apply.tables import MERGE_ON_READ_MAX_SHARE

    ident = f"{settings.catalog_name}.{ns}.items"
    n = int(2 / MERGE_ON_READ_MAX_SHARE)  # a table where 2 keys are few and 3 are many
    apply_events(spark, settings, ns, [event("c", k, {"name": "a", "amount": "1.00"}, pos=k) for k in range(1, n + 1)])

    def written() -> tuple:
        s = spark.sql(f"SELECT summary FROM {ident}.snapshots WHERE summary['spark.merge-into.num-target-rows-updated'] IS NOT NULL")
        last = [r[0] for r in s.collect()][-1]
        return last.get("added-position-deletes"), last.get("deleted-data-files")

    apply_events(spark, settings, ns, [event("u", k, {"name": "few"}, pos=n + k) for k in (5, 6)])
    assert written() == ("2", None)
    apply_events(spark, settings, ns, [event("u", k, {"name": "many"}, pos=2 * n + k) for k in (7, 8, 9)])
    deletes, rewritten = written()
    assert deletes is None and int(rewritten) >= 1
    got = rows(spark, settings, ns)
    assert len(got) == n and {k: got[k][0] for k in ("4", "5", "6", "7", "9")} == {
        "4": "a",
        "5": "few",
        "6": "few",
        "7": "many",
        "9": "many",
    }


def test_an_unknown_merge_mode_is_refused_with_the_choices(settings, tmp_path):
    import dataclasses

    from cdc_apply.config import load_sources
    from cdc_apply.errors import ConfigError

    f = tmp_path / "sources.yaml"
    f.write_text("sources:\n  s:\n    format: debezium_postgres\n    merge_mode: merge-on-write\n")
    with pytest.raises(
        ConfigError, match=r"merge_mode of source 's' is 'merge-on-write'; use one of \['auto', 'copy-on-write', 'merge-on-read'\]"
    ):
        load_sources(dataclasses.replace(settings, sources_file=f))
    f.write_text("sources:\n  s:\n    format: debezium_postgres\n    merge_mode: merge-on-read\n")
    assert load_sources(dataclasses.replace(settings, sources_file=f))["s"].merge_mode == "merge-on-read"


def test_the_one_event_short_cut_folds_as_the_general_fold(spark, monkeypatch):
    """A key left with one applied event skips the fold's lambdas: it must
    give the general fold's rows, for a lone upsert, a lone delete, a
    partial row, a key whose other event is a duplicate, and keys with
    several events (folded in position order, whatever the delivery order)."""
    from cdc_apply.apply import compact

    rows = [
        # key, pos, file, line, op, after, label, stored_live
        (1, "p05", "f", 1, "u", {"id": "1", "a": "x"}, "apply", True),
        (2, "p06", "f", 2, "d", None, "apply", True),
        (3, "p07", "f", 3, "c", {"id": "3"}, "apply", False),
        (4, "p01", "f", 4, "u", {"id": "4", "a": "old"}, "apply", True),
        (4, "p02", "f", 5, "d", None, "apply", True),
        (4, "p03", "f", 6, "c", {"id": "4", "b": "new"}, "apply", True),
        (5, "p09", "f", 7, "u", {"id": "5", "a": "y"}, "apply", False),
        (5, "p08", "f", 8, "u", {"id": "5", "b": "z"}, "apply", False),
        (6, "p04", "f", 9, "u", {"id": "6"}, "duplicate", True),
        (7, "p10", "f", 10, "u", {"id": "7", "a": "w"}, "apply", True),
        (7, "p10", "f", 11, "u", {"id": "7", "a": "w"}, "duplicate", True),
        (8, "p11", "f", 12, "d", None, "conflict", True),
    ]
    per_key = collections.Counter(r[0] for r in rows)
    events = spark.createDataFrame(
        [(k, p, f, ln, op, after, None, f"tx{k}", label, per_key[k], f"{p}|{k}", None) for k, p, f, ln, op, after, label, _ in rows],
        "id bigint, _cdc_pos string, _cdc_file string, _cdc_line bigint, _cdc_op string, _cdc_after map<string,string>, "
        "_cdc_commit_ts timestamp, _cdc_tx_id string, _cdc_label string, _cdc_key_events bigint, "
        "_cdc_change_id string, _cdc_inh map<string,string>",
    )
    stored = spark.createDataFrame(
        sorted({(k, live, "p00" if live else None, 0) for k, *_, live in rows}),
        "id bigint, _cdc_stored_live boolean, _cdc_stored_pos string, _k_superseded bigint",
    )

    def folded() -> dict:
        net = compact.fold_per_key(compact.collapse_per_key(events, ["id"]).join(stored, "id"), ["id"])
        return {r["id"]: r.asDict() for r in compact.applied(net).collect()}

    short = folded()
    monkeypatch.setattr(compact, "_ONE_OR_FOLD", compact._FOLD)
    assert short == folded()
    assert short[1]["_cdc_vals"] == {"id": "1", "a": "x"} and short[1]["_cdc_delpos"] is None
    # a delete carries the state just before it (its tombstone keeps the stored row's values)
    assert short[2]["_cdc_action"] == "delete" and short[2]["_cdc_delpos"] is None and short[2]["_cdc_vals"] == {}
    assert short[2]["_cdc_pos"] == "p06" and short[2]["_cdc_endcid"] == "p06|2" and short[2]["_cdc_cid"] is None
    assert short[3]["_cdc_vals"] == {"id": "3"} and short[3]["_cdc_events"] == 1 and not short[3]["_cdc_stored_live"]
    assert short[4]["_cdc_vals"] == {"id": "4", "b": "new"} and short[4]["_cdc_delpos"] == "p02"
    assert short[5]["_cdc_vals"] == {"id": "5", "b": "z", "a": "y"} and short[5]["_cdc_pos"] == "p09"
    assert short[7]["_cdc_events"] == 1 and short[7]["_cdc_pos"] == "p10"
    assert 6 not in short and 8 not in short


def test_the_accounting_is_gathered_by_the_job_that_caches_the_net_changes(spark):
    """``cache_counted`` counts in the job that builds the cache (an observed
    noop write): the same ``Accounting`` as a job of its own over the same
    rows, no more Spark jobs than caching alone, and the per-key counts
    left out of the cache."""
    from cdc_apply.apply import compact

    rows = [  # key, pos, line, op, after
        (1, "p05", 1, "u", {"id": "1", "a": "x"}),
        (1, "p06", 2, "u", {"id": "1", "b": "y"}),
        (1, "p06", 3, "u", {"id": "1", "b": "y"}),  # a re-delivery
        (2, "p01", 4, "u", {"id": "2", "a": "old"}),  # older than the stored row
        (3, "p07", 5, "d", None),
        (4, "p08", 6, "c", {"id": "4", "a": "new"}),
        (5, "p09", 7, "u", {"id": "5", "a": "p"}),
        (5, "p09", 8, "u", {"id": "5", "a": "q"}),  # a conflict
    ]
    events = spark.createDataFrame(
        [(k, p, "f", ln, op, after, None, "tx", f"{p}|{k}", None) for k, p, ln, op, after in rows],
        "id bigint, _cdc_pos string, _cdc_file string, _cdc_line bigint, _cdc_op string, _cdc_after map<string,string>, "
        "_cdc_commit_ts timestamp, _cdc_tx_id string, _cdc_change_id string, _cdc_inh map<string,string>",
    )
    state = spark.createDataFrame(
        [(1, "p00", False, {}), (2, "p03", False, {}), (3, "p02", False, {}), (5, "p00", True, {})],
        "id bigint, _cdc_position string, _cdc_deleted boolean, _cdc_col_pos map<string,string>",
    )
    net = compact.net_changes(events, state, ["id"], None, width=3)
    alone = compact.accounting(net, ["id"], ["id", "a", "b"])
    sc = spark.sparkContext

    def jobs_of(group: str, action):
        sc.setJobGroup(group, group)
        try:
            return action(), sc.statusTracker().getJobIdsForGroup(group)
        finally:
            for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
                sc.setLocalProperty(key, None)  # type: ignore[arg-type]

    # adaptive execution off for both: it submits each query stage as a job of its own, and how many depends on
    # which stage finishes first (CI once saw 5 against 4); the one job of each is what the test compares
    with _session_values(spark, {"spark.sql.adaptive.enabled": "false"}):
        plain = net.persist()
        _, writing = jobs_of("cache_alone", lambda: plain.write.format("noop").mode("overwrite").save())
        plain.unpersist()
        (cached, counted), caching = jobs_of("cache_counted", lambda: compact.cache_counted(net, ["id"], ["id", "a", "b"]))
    try:
        assert counted == alone
        assert counted.counts["duplicates"] == 1 and counted.counts["conflicts"] == 2 and counted.counts["superseded"] == 2
        assert len(caching) == len(writing), (caching, writing)  # as many as caching alone: none for the counts
        # the per-key counting columns (``_cdc_key_events``, ``_k_*``) stay out of the cache
        assert cached.is_cached and not [c for c in cached.columns if c == "_cdc_key_events" or c.startswith("_k_")]
        assert sorted(r["id"] for r in compact.applied(cached).collect()) == [1, 3, 4]
    finally:
        cached.unpersist()


def test_the_labelling_caches_its_net_changes_uncompressed_and_gives_the_session_its_conf_back(spark, settings, ns, monkeypatch):
    """A batch's net changes are cached with the columnar cache's compression
    off (``spark_conf.NET_CHANGES_CACHE_CONF``), for the labelling's span
    only: the session has its own value back after the batch, and a value the
    user set (``CDC_SPARK_CONF_*``) is kept throughout."""
    from cdc_apply.apply import compact
    from cdc_apply.runtime import spark_conf

    key = "spark.sql.inMemoryColumnarStorage.compressed"
    real, seen = compact.cache_counted, []

    def noting_the_conf(*args, **kwargs):  # the real caching, with the conf it runs under noted
        seen.append(spark.conf.get(key, None))
        return real(*args, **kwargs)

    monkeypatch.setattr(compact, "cache_counted", noting_the_conf)
    before = spark.conf.get(key, None)
    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    assert r.status == "complete", r.message
    assert seen == ["false"] and spark.conf.get(key, None) == before
    users = dataclasses.replace(settings, extra_spark_conf={**settings.extra_spark_conf, key: "true"})
    spark.conf.set(key, "true")  # as the session the user's key made
    try:
        r = apply_events(spark, users, ns, [event("u", 1, {"name": "b", "amount": "2.00"}, pos=2)])
        assert r.status == "complete", r.message
        assert seen == ["false", "true"] and spark.conf.get(key) == "true"
    finally:
        spark_conf.restore(spark, {key: before})
    rows = live_rows(spark, settings, ns, "items", ["id"], {"id": "int", "name": "string", "amount": "decimal(10,2)"})
    assert [(r["name"], r["amount"]) for r in rows.values()] == [("b", "2.00")]


def test_the_tables_a_batch_creates_are_written_in_row_groups_a_scan_can_split(spark, settings, ns):
    """The target and its change log are created with 16 MB Parquet row
    groups (``tables.ROW_GROUP_BYTES``): a table of one ~40 MB file is then
    scanned by several tasks, where Iceberg's default 128 MB row groups left
    a file under 128 MB to one task in every labelling, MERGE and count."""
    from pyspark.sql import functions as F

    from cdc_apply.apply import tables

    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    assert r.status == "complete", r.message
    target = f"{settings.catalog_name}.{ns}.items"
    for ident in (target, target + "_changes"):
        assert tables.table_properties(spark, ident)[tables.ROW_GROUP_PROPERTY] == str(tables.ROW_GROUP_BYTES), ident
    # ~40 MB of text that does not compress, written as one file by the table's own writer
    noise = F.concat(*[F.sha2(F.concat(F.col("id").cast("string"), F.lit(i)), 512) for i in range(2)])
    table = spark.table(target)
    filler = spark.range(2, 300_002, 1, 1).select(
        *[
            (noise if f.name == "name" else F.col("id") if f.name == "id" else F.lit(None)).cast(f.dataType).alias(f.name)
            for f in table.schema
        ]
    )
    filler.withColumn("_cdc_position", F.lit("0")).writeTo(target).append()
    # (with the file size: Iceberg 1.11 reads split_offsets as NULL when the projection lacks it)
    files = spark.sql(f"SELECT file_path, file_size_in_bytes, record_count, split_offsets FROM {target}.files").collect()
    big = max(files, key=lambda f: f.record_count)
    assert big.record_count == 300_000 and len(big.split_offsets) >= 2, big
    assert spark.table(target).rdd.getNumPartitions() >= 2


def test_a_table_made_before_the_row_groups_gets_them_at_its_next_batch_and_a_set_value_is_kept(spark, settings, ns):
    """A target and change log created without the row-group property (an
    earlier version of the project) get it at their next batch, once, noted
    in the batch's schema changes; a value set by hand stays."""
    from cdc_apply.apply import tables

    target = f"{settings.catalog_name}.{ns}.items"
    key = tables.ROW_GROUP_PROPERTY
    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    assert r.status == "complete", r.message
    for ident in (target, target + "_changes"):
        spark.sql(f"ALTER TABLE {ident} UNSET TBLPROPERTIES ('{key}')")
    r = apply_events(spark, settings, ns, [event("u", 1, {"name": "b", "amount": "2.00"}, pos=2)])
    assert r.status == "complete", r.message
    assert r.tables[0].schema_changes == [f"{key} (unset) -> {tables.ROW_GROUP_BYTES}"]
    for ident in (target, target + "_changes"):
        assert tables.table_properties(spark, ident)[key] == str(tables.ROW_GROUP_BYTES), ident
    spark.sql(f"ALTER TABLE {target} SET TBLPROPERTIES ('{key}'='134217728')")
    r = apply_events(spark, settings, ns, [event("u", 1, {"name": "c", "amount": "3.00"}, pos=3)])
    assert (r.status, r.tables[0].schema_changes) == ("complete", []), r.message
    assert tables.table_properties(spark, target)[key] == "134217728"
    assert rows(spark, settings, ns) == {"1": ("c", "3.00")}


def test_a_classic_observation_after_pyspark_took_the_process_for_a_connect_one(monkeypatch):
    """PySpark's ``Observation()`` returns Spark Connect's class once the
    process has made a Connect session (process-wide state); the accounting
    observes a classic session's frames with ``session.classic_observation``."""
    from pyspark.sql import Observation
    from pyspark.sql.connect.observation import Observation as ConnectObservation

    from cdc_apply.runtime import session

    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    assert isinstance(Observation(), ConnectObservation)
    assert type(session.classic_observation()) is Observation


def test_label_duplicates_counts_each_keys_events(spark):
    from cdc_apply.apply import compact

    df = spark.createDataFrame(
        [
            (k, p, f, ln, "u", {"a": "1"})
            for k, p, f, ln in [
                (1, "p1", "f", 1),
                (1, "p1", "f", 2),
                (1, "p2", "f", 3),
                (2, "p1", "f", 4),
                (None, "p1", "f", 5),
                (None, "p2", "f", 6),
            ]
        ],
        "id bigint, _cdc_pos string, _cdc_file string, _cdc_line bigint, _cdc_op string, _cdc_after map<string,string>",
    )
    got = sorted((r["_cdc_line"], r["id"], r["_cdc_label"], r["_cdc_key_events"]) for r in compact.label_duplicates(df, ["id"]).collect())
    assert got == [
        (1, 1, "apply", 3),
        (2, 1, "duplicate", 3),
        (3, 1, "apply", 3),
        (4, 2, "apply", 1),
        (5, None, "apply", 2),
        (6, None, "apply", 2),
    ]


BIGINTS = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@hyp_settings(max_examples=25, deadline=None)
@given(
    keys=st.lists(
        st.one_of(BIGINTS, st.integers(-40, 40), st.sampled_from([-(2**63), 2**63 - 1, 0, -1, 2**53 + 1])), min_size=1, max_size=40
    )
)
def test_key_spans_hold_every_key_of_the_batch(spark, keys):
    """Each key of the batch lies in one of ``merge.key_spans``' spans: a
    key outside them would lose its stored row to the labelling, and an
    older event would overwrite a newer row.  Spans are sorted and disjoint;
    nulls are no key."""
    from cdc_apply.apply import merge

    df = spark.createDataFrame([(k,) for k in keys] + [(None,)], "id bigint")
    spans = merge.key_spans(df, "id", "bigint")
    assert all(any(lo <= k <= hi for lo, hi in spans) for k in keys), spans
    assert all(lo <= hi < nxt for (lo, hi), (nxt, _) in itertools.pairwise(spans)), spans
    assert spans[0][0] == min(keys) and spans[-1][1] == max(keys)


def test_key_spans_leave_out_the_gap_between_stored_and_sequence_keys(spark):
    """A batch of a few stored keys and new keys far above them (a sequence)
    gets spans that skip the table between them; a decimal key the same;
    a text key one span."""
    from decimal import Decimal

    from cdc_apply.apply import merge

    df = spark.createDataFrame([(k,) for k in (*range(3, 40), *range(10**12, 10**12 + 5))], "id bigint")
    spans = merge.key_spans(df, "id", "bigint")
    assert spans[0][0] == 3 and spans[-1] == (10**12, 10**12 + 4) and not any(lo <= 10**6 <= hi for lo, hi in spans), spans
    dec = spark.createDataFrame([(Decimal("1.50"),), (Decimal("-2.25"),), (Decimal("70000.00"),)], "amt decimal(12,2)")
    spans = merge.key_spans(dec, "amt", "decimal(12,2)")
    assert spans[0] == (Decimal("-2.25"), Decimal("-2.25")) and spans[-1] == (Decimal("70000.00"), Decimal("70000.00")), spans
    text = spark.createDataFrame([("b",), ("a'",), ("zz",)], "code string")
    assert merge.key_spans(text, "code", "string") == [("a'", "zz")]


def test_a_small_batch_s_labelling_reads_the_stored_state_of_its_key_spans_only(spark, settings, ns, monkeypatch):
    """A batch small next to its table (table.PRUNE_STATE_*) reads the stored
    state of its keys' spans, so Iceberg skips the data files outside them:
    here the files of keys 1000-1003 and 10^6-10^6+3, between the batch's
    stored keys and its new one.  The batch still labels against the rows it reads: an older
    event of a stored key is superseded, a newer one applies, a new key far
    above the table is inserted."""

    from cdc_apply.apply import table

    monkeypatch.setattr(table, "PRUNE_STATE_MIN_RATIO", 0)
    monkeypatch.setattr(table, "KEY_SPANS_MIN_ROWS", 0)
    for base in (1, 1000, 10**6):  # one data file each
        apply_events(spark, settings, ns, [event("c", k, {"name": "a", "amount": "1.00"}, pos=50) for k in range(base, base + 4)])
    start = max((e["id"] for e in _sql_executions(spark)), default=-1)
    batch = [
        event("u", 1, {"name": "older"}, pos=40),
        event("u", 2, {"name": "newer"}, pos=60),
        event("c", 10**9, {"name": "new", "amount": "2.00"}, pos=61),
    ]
    r = apply_events(spark, settings, ns, batch)
    assert r.status == "complete", r.message
    c = r.tables[0].counts
    assert (c["superseded"], c["updated"], c["inserted"]) == (1, 1, 1), c
    got = rows(spark, settings, ns)
    assert (got["1"], got["2"], got[str(10**9)], len(got)) == (("a", "1.00"), ("newer", "1.00"), ("new", "2.00"), 13)
    ident = f"{settings.catalog_name}.{ns}.items"
    scans = _phase_scans(spark, start, ident, "label")
    assert scans and all("filters=((id >= 1 AND id <= 2) OR (id >= 1000000000 AND id <= 1000000000))," in s for s in scans), scans


@pytest.mark.parametrize("prune", [True, False], ids=["batch-keys-broadcast", "whole-stored-state"])
def test_labelling_is_the_same_with_or_without_pruning_the_stored_state(spark, settings, ns, monkeypatch, prune):
    """Batches small next to their table (table.PRUNE_STATE_*) compare with the
    stored rows of their own keys only; others with the whole stored state.
    Both must label alike: older, equal and newer events against stored
    rows, tombstones and keys not stored at all."""
    from cdc_apply.apply import table

    monkeypatch.setattr(table.compact, "BROADCAST_ROWS_MAX", 10**9 if prune else 0)
    monkeypatch.setattr(table, "PRUNE_STATE_MIN_RATIO", 0 if prune else 1)
    monkeypatch.setattr(table, "KEY_SPANS_MIN_ROWS", 0)  # and read only the stored state of the batch's key spans
    seen = []
    real = table.compact.label_against_target
    monkeypatch.setattr(table.compact, "label_against_target", lambda *a, **kw: seen.append(kw["prune_to"] is not None) or real(*a, **kw))
    first = [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=10),
        event("c", 2, {"name": "b", "amount": "2.00"}, pos=10),
        event("c", 3, {"name": "c", "amount": "3.00"}, pos=10),
        event("d", 3, pos=11),
        event("c", 4, {"name": "untouched", "amount": "4.00"}, pos=10),
    ]
    second = [
        event("u", 1, {"name": "older"}, pos=5, file="/virtual/2"),  # superseded by the stored row
        event("c", 2, {"name": "b", "amount": "2.00"}, pos=10, file="/virtual/2"),  # the stored position again
        event("c", 3, {"name": "zombie", "amount": "9.00"}, pos=9, file="/virtual/2"),  # older than the tombstone
        event("u", 2, {"name": "newer"}, pos=20, file="/virtual/2", line=2),
        event("c", 5, {"name": "fresh", "amount": "5.00"}, pos=1, file="/virtual/2"),  # not stored
    ]
    apply_events(spark, settings, ns, first)
    r = apply_events(spark, settings, ns, second)
    assert r.status == "complete", r.message
    c = r.tables[0].counts
    assert (c["superseded"], c["duplicates"], c["updated"], c["inserted"]) == (2, 1, 1, 1)
    assert rows(spark, settings, ns) == {"1": ("a", "1.00"), "2": ("newer", "2.00"), "4": ("untouched", "4.00"), "5": ("fresh", "5.00")}
    check_model(spark, settings, ns, [first, second])
    assert seen == [prune, prune]


def _moved(old, new, after, *, pos, file="", line=None):
    """The two halves of a primary-key change, as Debezium PostgreSQL emits them."""
    d = event("d", old, pos=pos, file=file, line=line)
    c = event("c", new, after, pos=pos, file=file, line=None if line is None else line + 1)
    d.change_id = c.change_id = f"lsn{pos}"
    return [d, c]


def test_key_change_inherits_unchanged_columns_from_the_stored_row(spark, settings, ns):
    """Issue 17: `UPDATE t SET id = 107 WHERE id = 7` on a row whose TOASTed
    value is unchanged: the insert carries the placeholder (not present)."""
    first = [event("c", 7, {"name": "big", "amount": "1.00"}, pos=1)]
    apply_events(spark, settings, ns, first)
    moved = _moved(7, 107, {"amount": "2.00"}, pos=5)  # name left out
    r = apply_events(spark, settings, ns, moved)
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"107": ("big", "2.00")}
    assert r.tables[0].counts["key_changes_inherited"] == 1 and r.tables[0].counts["partial_inserts"] == 0
    check_model(spark, settings, ns, [first, moved])


def test_key_change_inherits_from_earlier_events_of_the_batch_in_any_file_order(spark, settings, ns):
    b = [event("c", 7, {"name": "a", "amount": "1.00"}, pos=1), event("u", 7, {"name": "b"}, pos=2)]
    moved = _moved(7, 107, {}, pos=5)
    moved[1].file, moved[0].file = "/virtual/p0.jsonl", "/virtual/p1.jsonl"  # the halves in two partitions' files
    r = apply_events(spark, settings, ns, [moved[1], *b, moved[0]])
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"107": ("b", "1.00")}
    check_model(spark, settings, ns, [b + moved])


def test_an_insert_without_its_key_change_half_is_counted(spark, settings, ns):
    lone = event("c", 107, {"name": "x"}, pos=5)
    lone.change_id = "lsn5"
    r = apply_events(spark, settings, ns, [lone])
    assert r.status == "complete", r.message
    assert r.tables[0].counts["partial_inserts"] == 1
    assert rows(spark, settings, ns) == {"107": ("x", None)}


def test_late_full_event_fills_what_a_partial_update_left_out(spark, settings, ns):
    """Issue 17: the hour with the full row arrives after the hour with the
    placeholder update; the value is kept, whatever the delivery order."""
    later = [event("u", 1, {"amount": "5.00"}, pos=30)]
    earlier = [event("c", 1, {"name": "a", "amount": "1.00"}, pos=20, file="/virtual/late")]
    apply_events(spark, settings, ns, later)
    r = apply_events(spark, settings, ns, earlier)
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"1": ("a", "5.00")}
    assert r.tables[0].counts["filled"] == 1
    pos = spark.sql(f"SELECT _cdc_position, _cdc_col_pos FROM {settings.catalog_name}.{ns}.items").collect()[0]
    assert pos[0] == f"{30:020d}" and pos[1] == {"name": f"{20:020d}"}
    # re-delivered in a new file (an at-least-once sink): judged by position, nothing changes
    redelivered = [dataclasses.replace(e, file="/virtual/redelivered", line=i) for i, e in enumerate(earlier + later, start=1)]
    again = apply_events(spark, settings, ns, redelivered, batch_tag="again")
    assert again.tables[0].counts["duplicates"] + again.tables[0].counts["superseded"] == 2
    assert rows(spark, settings, ns) == {"1": ("a", "5.00")}
    check_model(spark, settings, ns, [later, earlier])


def test_a_stored_row_keeps_the_position_of_a_column_an_earlier_event_of_the_batch_set(spark, settings, ns):
    """A batch that updates a stored row twice, the last time without one
    column: the column keeps the first update's position in
    ``_cdc_col_pos``, below the row's, so a late event between the two
    still sets it (the MERGE's shortcut for changes newer than the stored
    row, ``merge.merge_sql``, must not take this change)."""
    b1 = [event("c", 1, {"name": "a", "amount": "1.00"}, pos=5), event("c", 2, {"name": "z", "amount": "1.00"}, pos=6)]
    apply_events(spark, settings, ns, b1)
    # key 2's delete keeps its stored values in the tombstone: the MERGE is not whole_rows
    b2 = [event("u", 1, {"name": "b", "amount": "2.00"}, pos=10), event("u", 1, {"amount": "3.00"}, pos=20), event("d", 2, pos=21)]
    assert apply_events(spark, settings, ns, b2).status == "complete"
    pos = spark.sql(f"SELECT _cdc_position, _cdc_col_pos FROM {settings.catalog_name}.{ns}.items WHERE id = 1").collect()[0]
    assert pos[0] == f"{20:020d}" and pos[1] == {"name": f"{10:020d}"}
    b3 = [event("u", 1, {"name": "late", "amount": "9.00"}, pos=15, file="/virtual/late")]
    assert apply_events(spark, settings, ns, b3).status == "complete"
    assert rows(spark, settings, ns) == {"1": ("late", "3.00")}
    check_model(spark, settings, ns, [b1, b2, b3])


def test_late_delete_nulls_only_what_it_precedes(spark, settings, ns):
    b1 = [event("c", 1, {"name": "a", "amount": "1.00"}, pos=10), event("u", 1, {"amount": "3.00"}, pos=30)]
    b2 = [event("d", 1, pos=20, file="/virtual/late")]
    apply_events(spark, settings, ns, b1)
    apply_events(spark, settings, ns, b2)
    assert rows(spark, settings, ns) == {"1": (None, "3.00")}
    check_model(spark, settings, ns, [b1, b2])


def test_different_events_at_one_position_are_refused_not_picked(spark, settings, ns):
    """Issue 17: equal positions are a duplicate only when the content is the same."""
    b = [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=10),
        event("u", 1, {"name": "b", "amount": "1.00"}, pos=10),
        event("c", 2, {"name": "z", "amount": "2.00"}, pos=10),
        event("c", 2, {"name": "z", "amount": "2.00"}, pos=10, file="/virtual/again"),
    ]
    r = apply_events(spark, settings, ns, b)
    assert r.status == "failed"
    t = r.tables[0]
    assert t.counts["conflicts"] == 2 and t.counts["duplicates"] == 1 and t.terminal
    assert any(f.startswith("equal_position_conflict(events=2") and "key (1,)" in f for f in t.failed_expectations), t.failed_expectations


def test_a_chain_of_key_changes_in_one_batch_carries_the_values_through(spark, settings, ns):
    """Seen in a real Debezium capture: 1015 -> 1017 -> 1019 in one transaction,
    each insert carrying the unavailable placeholder for the TOASTed value."""
    first = [event("c", 7, {"name": "big", "amount": "1.00"}, pos=1)]
    apply_events(spark, settings, ns, first)
    chain = _moved(7, 8, {"amount": "2.00"}, pos=5) + _moved(8, 9, {}, pos=6)
    r = apply_events(spark, settings, ns, list(reversed(chain)))
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"9": ("big", "2.00")}
    assert r.tables[0].counts["key_changes_inherited"] == 2 and r.tables[0].counts["partial_inserts"] == 0
    check_model(spark, settings, ns, [first, chain])


# A primary-key change whose halves, or whose old key's earlier events, reach
# different batches (a transaction cut by an hour boundary, an hour delivered
# late).  The reference model says what the new key must hold; the apply does
# not hold it yet: the stored rows do not remember which key change made them
# (docs/apply-semantics.md rule 3, "a known gap").  strict: each test fails the
# run once the gap is closed, so the marker cannot outlive the fix.


def test_key_change_whose_insert_half_arrives_first(spark, settings, ns):
    first = [event("c", 7, {"name": "big", "amount": "1.00"}, pos=1)]
    d, c = _moved(7, 107, {"amount": "2.00"}, pos=5)  # name left out (unchanged TOAST)
    batches = [first, [c], [d]]  # the hour holding the delete half is delivered late
    for b in batches:
        assert apply_events(spark, settings, ns, b).status == "complete"
    check_model(spark, settings, ns, batches)


def test_key_change_whose_delete_half_arrives_first(spark, settings, ns):
    first = [event("c", 7, {"name": "big", "amount": "1.00"}, pos=1)]
    d, c = _moved(7, 107, {"amount": "2.00"}, pos=5)
    batches = [first, [d], [c]]  # the hour ends between the two halves
    for b in batches:
        assert apply_events(spark, settings, ns, b).status == "complete"
    check_model(spark, settings, ns, batches)


def test_a_chain_of_key_changes_takes_a_late_value_of_its_first_key(spark, settings, ns):
    """Seen in the real-source soak (seed 4, an hour delivered late): 7 -> 107
    and 107 -> 207 in two hours, then the hour that created 7 with its value."""
    batches = [
        _moved(7, 107, {"amount": "2.00"}, pos=5),
        _moved(107, 207, {"amount": "3.00"}, pos=7),
        [event("c", 7, {"name": "big", "amount": "1.00"}, pos=1)],
    ]
    for b in batches:
        assert apply_events(spark, settings, ns, b).status == "complete"
    check_model(spark, settings, ns, batches)
    assert rows(spark, settings, ns) == {"207": ("big", "3.00")}


def test_key_change_before_a_late_update_of_its_old_key(spark, settings, ns):
    first = [event("c", 7, {"name": "big", "amount": "1.00"}, pos=1)]
    late = [event("u", 7, {"name": "bigger"}, pos=3)]
    moved = _moved(7, 107, {"amount": "2.00"}, pos=5)
    batches = [first, moved, late]  # the hour holding the update is delivered after the key change's
    for b in batches:
        assert apply_events(spark, settings, ns, b).status == "complete"
    check_model(spark, settings, ns, batches)


def _batch_snapshots(spark, ident, batch_id):
    return [
        (r["operation"], r["summary"])
        for r in spark.sql(
            f"SELECT operation, summary FROM {ident}.snapshots WHERE summary['cdc.batch-id'] = '{batch_id}' ORDER BY committed_at"
        ).collect()
    ]


def test_new_keys_are_appended_and_stored_keys_merged_in_one_batch(spark, settings, ns):
    """Issue 20: keys the table holds (live or as a tombstone) go through the
    MERGE; keys new to it are appended (no data file read or rewritten) —
    tombstones of new keys, partial rows of new keys and a new key inserted
    then deleted included — and the result is the reference model's."""
    ident = f"{settings.catalog_name}.{ns}.items"
    b1 = [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=1),
        event("c", 2, {"name": "b", "amount": "2.00"}, pos=2),
        event("d", 2, pos=3),
        event("c", 3, {"name": "c", "amount": "3.00"}, pos=4),
    ]
    apply_events(spark, settings, ns, b1)
    b2 = [
        event("u", 1, {"name": "a2"}, pos=10),  # stored live: partial update
        event("c", 2, {"name": "revived", "amount": "2.50"}, pos=11),  # stored tombstone: revived
        event("c", 10, {"name": "new", "amount": "10.00"}, pos=12),  # new, full
        event("c", 11, {"name": "half"}, pos=13),  # new, partial: amount never set
        event("c", 12, {"name": "gone", "amount": "1.00"}, pos=14),  # new, inserted then deleted
        event("d", 12, pos=15),
        event("d", 13, pos=16),  # new, delete only: a tombstone
        event("u", 10, {"amount": "11.00"}, pos=17),  # new, two events folded
    ]
    r = apply_events(spark, settings, ns, b2)
    assert r.status == "complete", r.message
    c = r.tables[0].counts
    assert (c["inserted"], c["updated"], c["noop_deletes"], c["keys"]) == (3, 1, 2, 6), c
    assert rows(spark, settings, ns) == {
        "1": ("a2", "1.00"),
        "2": ("revived", "2.50"),
        "3": ("c", "3.00"),
        "10": ("new", "11.00"),
        "11": ("half", None),
    }
    stored = {
        r_["id"]: (r_["_cdc_deleted"], r_["_cdc_position"], r_["_cdc_col_pos"], r_["_cdc_batch_id"])
        for r_ in spark.sql(f"SELECT * FROM {ident}").collect()
    }
    assert len(stored) == 7 and spark.table(ident).count() == 7  # no key twice
    assert stored[11] == (False, f"{13:020d}", {"amount": ""}, r.batch_id)  # never set: lower than any position, may be filled
    # a tombstone keeps the state just before its delete (rule 3): 12's insert, nothing for 13
    assert stored[12][:3] == (True, f"{15:020d}", {"name": f"{14:020d}", "amount": f"{14:020d}"})
    assert stored[13][:3] == (True, f"{16:020d}", {"name": "", "amount": ""})
    assert stored[10][:3] == (False, f"{17:020d}", {"name": f"{12:020d}"})
    assert stored[1][:3] == (False, f"{10:020d}", {"amount": f"{1:020d}"})
    # one MERGE of the 2 stored keys, then one append of the 4 new keys (tombstones included), nothing else
    snaps = _batch_snapshots(spark, ident, r.batch_id)
    assert [op for op, _ in snaps] == ["overwrite", "append"], snaps
    assert snaps[1][1]["added-records"] == "4" and "deleted-data-files" not in snaps[1][1], snaps
    assert snaps[1][1]["added-data-files"] == "1", snaps  # a few new keys: one file, not one per shuffle partition
    assert snaps[0][1]["spark.merge-into.num-target-rows-updated"] == "2", snaps
    # a late event fills the column the new key's partial row never set; a late insert of the new tombstone stays out
    b3 = [
        event("c", 11, {"name": "old", "amount": "7.00"}, pos=5, file="/virtual/late"),
        event("c", 13, {"name": "zombie", "amount": "1.00"}, pos=6, file="/virtual/late"),
    ]
    r3 = apply_events(spark, settings, ns, b3)
    assert r3.status == "complete", r3.message
    assert rows(spark, settings, ns)["11"] == ("half", "7.00") and "13" not in rows(spark, settings, ns)
    check_model(spark, settings, ns, [b1, b2, b3])


def test_a_batch_of_only_new_keys_is_one_append_and_of_only_stored_keys_one_merge(spark, settings, ns):
    ident = f"{settings.catalog_name}.{ns}.items"
    r1 = apply_events(spark, settings, ns, [event("c", k, {"name": "a", "amount": "1.00"}, pos=k) for k in range(1, 4)])
    assert [op for op, _ in _batch_snapshots(spark, ident, r1.batch_id)] == ["append"]
    r2 = apply_events(spark, settings, ns, [event("u", 2, {"name": "b"}, pos=10), event("d", 3, pos=11)])
    assert [op for op, _ in _batch_snapshots(spark, ident, r2.batch_id)] == ["overwrite"]
    assert rows(spark, settings, ns) == {"1": ("a", "1.00"), "2": ("b", "1.00")}


def test_a_foreign_commit_between_a_runs_writes_fails_it_as_concurrent(spark, settings, ns, monkeypatch):
    """The append of new keys validates nothing at commit: a run whose
    branch holds another run's commit between its own (two runs of one batch)
    fails transient, saying so, and a retry applies the batch once."""
    from cdc_apply.apply import branches, merge

    apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    real_append = merge.append_new_keys

    def other_run_commits_first(spark_, spec, branch, source, batch_id, rows):
        key = "spark.sql.iceberg.snapshot-property." + branches.ATTEMPT_PROPERTY
        mine = spark_.conf.get(key)
        spark_.conf.set(key, "another-run")
        try:
            branches.ledger_commit(spark_, spec, branch)
        finally:
            spark_.conf.set(key, mine)
        real_append(spark_, spec, branch, source, batch_id, rows)

    monkeypatch.setattr(merge, "append_new_keys", other_run_commits_first)
    batch = [event("u", 1, {"name": "b"}, pos=10), event("c", 2, {"name": "n", "amount": "2.00"}, pos=11)]
    r = apply_events(spark, settings, ns, batch, batch_tag="race")
    assert r.status == "failed" and not r.tables[0].terminal
    assert "another run is applying batch" in r.tables[0].message, r.tables[0].message
    monkeypatch.setattr(merge, "append_new_keys", real_append)
    r2 = apply_events(spark, settings, ns, batch, batch_tag="race")
    assert r2.status == "complete", r2.message
    assert rows(spark, settings, ns) == {"1": ("b", "1.00"), "2": ("n", "2.00")}
    assert spark.table(f"{settings.catalog_name}.{ns}.items").count() == 2


def _partial_rows_property(spark, settings, ns):
    return spark.sql(f"SHOW TBLPROPERTIES {settings.catalog_name}.{ns}.items ('cdc.partial-rows')").collect()[0]["value"]


def test_the_key_change_refresh_runs_only_once_a_table_may_hold_partial_rows(spark, settings, ns):
    """Only a row with inherited or never-set columns can take a key change's
    old key's values later (merge.refresh_inherited): a table of full images
    never pays its scans; the first partial row marks the table before it is
    written, and from then on every batch with tombstones refreshes."""
    full = [
        event("c", 7, {"name": "big", "amount": "1.00"}, pos=1),
        event("c", 8, {"name": "small", "amount": "2.00"}, pos=2),
        *_moved(8, 108, {"name": "small", "amount": "2.50"}, pos=3),  # both halves full
        event("d", 7, pos=4),
    ]
    r = apply_events(spark, settings, ns, full)
    assert r.status == "complete", r.message
    assert "key_changes_refreshed" not in r.tables[0].counts
    assert _partial_rows_property(spark, settings, ns) == "false"
    moved = _moved(108, 208, {"amount": "3.00"}, pos=6)  # name left out: 208 inherits it, a partial row
    late = [event("u", 108, {"name": "smaller", "amount": "2.75"}, pos=5)]  # the old key's last value, delivered late
    batches = [full, moved, late]
    r = apply_events(spark, settings, ns, moved)
    assert r.status == "complete", r.message
    assert _partial_rows_property(spark, settings, ns) == "true"
    r = apply_events(spark, settings, ns, late)
    assert r.status == "complete", r.message
    assert r.tables[0].counts["key_changes_refreshed"] == 1
    check_model(spark, settings, ns, batches)
    assert rows(spark, settings, ns) == {"208": ("smaller", "3.00")}


def _truncate(pos):
    t = event("t", 0, pos=pos)
    t.key_columns, t.after, t.before = [], {}, None
    return t


@pytest.mark.parametrize("late", [False, True], ids=["truncate-in-the-batch", "truncate-in-an-earlier-batch"])
def test_a_key_change_inherits_nothing_from_events_a_truncate_emptied(spark, settings, ns, late):
    """Found by the property test (reference model): the insert half of a key
    change took the old key's values from an event older than a truncate
    between them, instead of keeping the new key's own."""
    old = event("c", 2, {"name": "gone", "amount": "9.00"}, pos=6)
    rest = [event("u", 3, {"amount": "5.00"}, pos=12), *_moved(2, 3, {}, pos=13)]  # the insert carries the key only
    batches = [[old, _truncate(11), *rest]] if not late else [[_truncate(11)], [old, *rest]]
    for b in batches:
        r = apply_events(spark, settings, ns, b)
        assert r.status == "complete", r.message
    check_model(spark, settings, ns, batches)
    assert rows(spark, settings, ns) == {"3": (None, "5.00")}


def _classes_compiled(spark) -> int:
    """How many classes Spark has generated and compiled in this JVM (its ``CodeGenerator`` metrics)."""
    return spark._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME().getCount()


@pytest.mark.parametrize("merge_mode", ["auto", "merge-on-read"])
def test_a_truncate_leaves_the_columns_a_key_change_awaits_from_its_late_delete_half(spark, settings, ns, merge_mode):
    """Found by the property test (reference model), stop 58: the insert half
    of a key change (2 -> 3) carrying its key alone is applied first; the
    next batch brings a truncate older than the change, the old key's update
    after the truncate and the delete half.  The truncate took the new key's
    never-set columns for set before it, so the delete half could no longer
    fill them: the new key lost the old key's name."""
    delete_half, insert_half = _moved(2, 3, {}, pos=90)
    batches = [
        [insert_half, event("u", 3, {"amount": None}, pos=40)],
        [_truncate(60), event("u", 2, {"name": "ü", "amount": None}, pos=80), delete_half],
    ]
    for b in batches:
        r = apply_events(spark, settings, ns, b, merge_mode=merge_mode)
        assert r.status == "complete", r.message
    check_model(spark, settings, ns, batches)
    assert rows(spark, settings, ns) == {"3": ("ü", None)}


@pytest.mark.parametrize("case", ["small", "large", "user-set", "large-table"])
def test_a_small_batch_runs_unadaptive_on_one_partition_and_the_session_gets_its_conf_back(spark, settings, ns, monkeypatch, case):
    """Inside a batch of at most SMALL_BATCH_MESSAGES messages (seen by its GX
    run, the last thing the batch does under it): adaptive execution off, one
    shuffle partition, no generated code but for a table past
    INTERPRETED_TABLE_ROWS_MAX live rows; a larger batch and a
    key the user set keep the session's values; after the batch the session
    has its own back."""
    from cdc_apply.apply import gate
    from cdc_apply.runtime import spark_conf

    keys = ("spark.sql.adaptive.enabled", "spark.sql.shuffle.partitions", "spark.sql.codegen.wholeStage", "spark.sql.codegen.factoryMode")
    before = {k: spark.conf.get(k) for k in keys}
    assert before == dict(zip(keys, ("true", "8", "true", "FALLBACK"), strict=True))
    seen = []
    run_gx = gate.run_gx

    def watched(*args, **kwargs):
        seen.append({k: spark.conf.get(k) for k in keys})
        return run_gx(*args, **kwargs)

    monkeypatch.setattr(gate, "run_gx", watched)
    if case == "large":
        monkeypatch.setattr(spark_conf, "SMALL_BATCH_MESSAGES", 2)
    if case == "large-table":  # a new table's 0 rows are past it
        monkeypatch.setattr(spark_conf, "INTERPRETED_TABLE_ROWS_MAX", -1)
    if case == "user-set":
        settings = dataclasses.replace(settings, extra_spark_conf={**settings.extra_spark_conf, "spark.sql.shuffle.partitions": "8"})
    b = [event("c", i, {"name": f"n{i}", "amount": f"{i}.00"}, pos=i) for i in (1, 2, 3)] + [
        event("u", 1, {"name": "m", "amount": "5.00"}, pos=4)
    ]
    r = apply_events(spark, settings, ns, b)
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"1": ("m", "5.00"), "2": ("n2", "2.00"), "3": ("n3", "3.00")}
    small = {"spark.sql.adaptive.enabled": "false", "spark.sql.shuffle.partitions": "1"}
    interpreted = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
    expected = {
        "small": {**small, **interpreted},
        "large": before,
        "user-set": {**small, "spark.sql.shuffle.partitions": "8", **interpreted},
        "large-table": {**before, **small},
    }[case]
    assert seen == [expected]
    assert {k: spark.conf.get(k) for k in keys} == before


def test_spark_generates_no_code_under_the_interpreted_conf(spark, settings):
    """``INTERPRETED_CONF`` does what the small batches take it for: a query
    new to the session compiles no class under it, and does under Spark's
    defaults (``CODEGEN_CONF``).  Fails if a Spark version drops or renames
    the keys (an unknown key is set without a word)."""
    import uuid

    from cdc_apply.runtime import spark_conf

    def compiled_by_a_new_query() -> int:
        tag = uuid.uuid4().int % 1_000_000  # a literal of its own: no generated class cached for it
        before = _classes_compiled(spark)
        spark.range(50).selectExpr(f"id * {tag} + 7 AS x", "id").where(f"x % 3 = {tag % 3}").collect()
        return _classes_compiled(spark) - before

    with spark_conf.scoped_conf(spark, settings, spark_conf.INTERPRETED_CONF):
        assert compiled_by_a_new_query() == 0
    with spark_conf.scoped_conf(spark, settings, spark_conf.CODEGEN_CONF):
        assert compiled_by_a_new_query() > 0


def _phase_scans(spark, after: int, ident: str, phase: str, at_least: int = 1) -> list[str]:
    """The Iceberg scans of ``ident`` in the plans of the SQL executions after
    ``after`` that a batch's ``phase`` ran (``<table>: <phase>``)."""
    import time

    scans: list[str] = []
    for _ in range(50):  # the UI's listener is asynchronous
        execs = [e for e in _sql_executions(spark, plans=True) if e["id"] > after and e.get("description") == f"{ident}: {phase}"]
        scans = [
            line for e in execs for line in e.get("planDescription", "").splitlines() if line.startswith(f"IcebergScan(table={ident},")
        ]
        if len(scans) >= at_least and all(e.get("status") != "RUNNING" for e in execs):
            break
        time.sleep(0.2)
    return scans


def _sql_executions(spark, *, plans: bool = False) -> list[dict]:
    """The session's SQL executions, from the Spark UI's REST API."""
    import json
    import urllib.request

    url = f"{spark.sparkContext.uiWebUrl}/api/v1/applications/{spark.sparkContext.applicationId}/sql"
    with urllib.request.urlopen(
        f"{url}?details={str(plans).lower()}&planDescription={str(plans).lower()}&offset=0&length=100000", timeout=30
    ) as r:
        return json.loads(r.read())


def test_a_batchs_spark_jobs_are_named_by_table_and_phase(spark, settings, ns):
    """The Spark UI lists a batch's work as ``<table>: <phase>`` (and the
    source's decode as ``<source>: decode``), not ``sql at <unknown>:0``:
    an operator reading a slow batch there sees which phase of which table
    took the time.  The name is given back after the batch.  (A small
    batch's decode counts its rows itself and runs no job: this batch's
    rows are counted by Spark, as a large batch's are.)"""
    import time

    sc = spark.sparkContext
    before = max((e["id"] for e in _sql_executions(spark)), default=-1)
    b = [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1), event("u", 1, {"name": "b", "amount": "2.00"}, pos=2)]
    r = apply_events(spark, settings, ns, b, counted_by_decode=False)
    assert r.status == "complete", r.message
    table = r.tables[0].table
    wanted = {f"{ns}: decode", *(f"{table}: {p}" for p in ("changelog", "label", "merge", "reconcile", "gate"))}
    for _ in range(50):  # the UI's listener is asynchronous
        named = {e.get("description") for e in _sql_executions(spark) if e["id"] > before}
        if wanted <= named:
            break
        time.sleep(0.2)
    assert wanted <= named, sorted(str(n) for n in named)
    assert sc.getLocalProperty("spark.job.description") is None


def _merge_plans(spark, after_id: int) -> list[str]:
    """Physical plans of the MERGE statements the session ran after SQL
    execution ``after_id`` (the UI's listener is asynchronous, so it is polled)."""
    import time

    plans: list[str] = []
    for _ in range(50):
        execs = _sql_executions(spark, plans=True)
        plans = [e["planDescription"] for e in execs if e["id"] > after_id and "MergeRows" in e.get("planDescription", "")]
        if plans and all(e.get("status") != "RUNNING" for e in execs):
            return plans
        time.sleep(0.2)
    return plans


@contextlib.contextmanager
def _session_values(spark, values: dict[str, str | None], restored: tuple[str, ...] = ()):
    """The session with ``values`` (None: unset) for the block; those keys and
    ``restored`` get their values back after it."""
    from cdc_apply.runtime import spark_conf

    saved = {k: spark.conf.get(k, None) for k in [*values, *restored]}
    for k, v in values.items():
        if v is None:
            spark.conf.unset(k)
        else:
            spark.conf.set(k, v)
    try:
        yield
    finally:
        spark_conf.restore(spark, saved)


def _second_batch_merge_plans(spark, settings, ns) -> list[str]:
    """Apply three inserts, then an update and a delete of stored keys (a
    MERGE); check the rows and return that MERGE's physical plans."""
    first = [event("c", i, {"name": f"n{i}", "amount": f"{i}.00"}, pos=i) for i in (1, 2, 3)]
    assert apply_events(spark, settings, ns, first).status == "complete"
    start = max((e["id"] for e in _sql_executions(spark)), default=-1)
    second = [event("u", 1, {"name": "m", "amount": "5.00"}, pos=4), event("d", 2, pos=5)]
    r = apply_events(spark, settings, ns, second)
    assert r.status == "complete", r.message
    assert rows(spark, settings, ns) == {"1": ("m", "5.00"), "3": ("n3", "3.00")}
    plans = _merge_plans(spark, start)
    assert plans, "no MERGE ran in the second batch"
    return plans


@pytest.mark.parametrize("case", ["default", "below", "off", "user-set"])
def test_the_merge_broadcasts_a_small_batchs_net_changes_and_the_session_gets_its_threshold_back(spark, settings, ns, monkeypatch, case):
    """A session whose broadcast threshold is below MERGE_BROADCAST_BYTES
    (Spark's default of 10 MB, which is below a 9k-event batch's net
    changes; or 1 byte, so that the plan shows it) runs the MERGE under
    MERGE_BROADCAST_BYTES: the stored rows are joined with the broadcast net
    changes, not sorted and shuffled; a threshold that is off (-1), or set
    by the user, is kept.  After the batch the session has its own value
    back (unset stays unset)."""
    from cdc_apply.apply import merge
    from cdc_apply.runtime import spark_conf

    key = spark_conf.BROADCAST_THRESHOLD
    session_value = {"default": None, "off": "-1"}.get(case, "1b")
    with _session_values(spark, {key: session_value}):
        if case == "user-set":
            settings = dataclasses.replace(settings, extra_spark_conf={**settings.extra_spark_conf, key: session_value})
        seen = []
        merge_changes = merge.merge_changes

        def watched(*args, **kwargs):
            seen.append(spark.conf.get(key, None))
            return merge_changes(*args, **kwargs)

        monkeypatch.setattr(merge, "merge_changes", watched)
        plans = _second_batch_merge_plans(spark, settings, ns)
        raised = case in ("default", "below")
        expected = f"{spark_conf.MERGE_BROADCAST_BYTES}b" if raised else session_value
        assert seen == [expected, expected]
        assert spark.conf.get(key, None) == session_value
        join = "BroadcastHashJoin" if raised else "SortMergeJoin"
        assert all(join in p for p in plans), plans


@pytest.mark.parametrize("bounds", ["merge", "spark"])
def test_a_shuffled_merge_filters_the_tables_rows_by_the_batchs_keys_before_the_shuffle(spark, settings, ns, monkeypatch, bounds):
    """A MERGE that shuffles (here: the session's broadcast threshold off,
    which the MERGE keeps) reads the table through a runtime Bloom filter of
    the batch's keys (MERGE_RUNTIME_FILTER_CONF): its plan filters the
    table's scan by ``might_contain``.  Under Spark's own bounds (a table
    above 10 GB) it does not.  The rows are right either way and the
    session has its values back."""
    from cdc_apply.runtime import spark_conf

    if bounds == "spark":
        monkeypatch.setattr(spark_conf, "MERGE_RUNTIME_FILTER_CONF", {})
    filter_keys = list(spark_conf.MERGE_RUNTIME_FILTER_CONF)
    before = {k: spark.conf.get(k, None) for k in filter_keys}
    with _session_values(spark, {spark_conf.BROADCAST_THRESHOLD: "-1"}, tuple(filter_keys)):
        plans = _second_batch_merge_plans(spark, settings, ns)
        assert {k: spark.conf.get(k, None) for k in filter_keys} == before
        assert spark.conf.get(spark_conf.BROADCAST_THRESHOLD) == "-1"
        assert all("SortMergeJoin" in p for p in plans), plans
        assert all(("might_contain" in p) == (bounds == "merge") for p in plans), plans


@pytest.mark.parametrize(
    ("text", "size"),
    [("10485760b", 10 << 20), ("10m", 10 << 20), ("32MB", 32 << 20), ("-1", -1), ("1g", 1 << 30), (" 7 ", 7), ("ten", None), (None, None)],
)
def test_spark_size_texts_are_read_as_spark_reads_them(text, size):
    from cdc_apply.runtime.spark_conf import byte_size

    assert byte_size(text) == size


_COLS = ("a", "b", "c")
_POSITIONS = st.sampled_from(["0003", "0005", "0007"])


@st.composite
def _net_change(draw):
    """A net change as ``merge.new_col_pos`` reads it: the columns it carries,
    where each was set when not by its last event, its last delete."""
    present = draw(st.lists(st.sampled_from(_COLS), unique=True))
    cpos = {c: draw(_POSITIONS) for c in draw(st.lists(st.sampled_from(present), unique=True))} if present else {}
    return {"present": present, "cpos": cpos, "delpos": draw(st.none() | _POSITIONS), "pos": draw(_POSITIONS)}


@hyp_settings(max_examples=15, deadline=None)
@given(changes=st.lists(_net_change(), min_size=1, max_size=12))
def test_a_new_rows_column_positions_follow_the_rule_with_or_without_the_shortcut(spark, changes):
    """``new_col_pos`` (a new row's ``_cdc_col_pos``) against the rule read
    row by row in Python: each data column's position is where it was set
    (``_cdc_cpos``, else the change's own position when carried, else the
    key's last delete, else never set), kept only below the row's position.
    The changes that carry every column set by their last event take the
    shortcut (an empty map without building one); the rest build the map."""
    from cdc_apply.apply import merge
    from cdc_apply.apply.compact import NEVER_SET

    data = [(i, ch["present"], ch["cpos"], ch["delpos"], ch["pos"]) for i, ch in enumerate(changes)]
    df = spark.createDataFrame(data, "i int, _cdc_present array<string>, _cdc_cpos map<string,string>, _cdc_delpos string, _cdc_pos string")
    got = {r["i"]: r["m"] for r in df.selectExpr("i", f"{merge.new_col_pos(list(_COLS), '')} AS m").collect()}
    for i, ch in enumerate(changes):
        set_at = {c: (ch["cpos"].get(c, ch["pos"]) if c in ch["present"] else ch["delpos"]) or NEVER_SET for c in _COLS}
        assert got[i] == {c: p for c, p in set_at.items() if p < ch["pos"]}, ch
