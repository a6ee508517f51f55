"""A table's metadata read through pyiceberg (apply/catalog_reads) says what
Spark's own metadata (SHOW TBLPROPERTIES, the ``refs`` and ``snapshots``
tables, SHOW TABLES / NAMESPACES) says of the same table: each read is made
both ways on a real Iceberg table written by Spark."""

from __future__ import annotations

import pytest

from cdc_apply import ledger
from cdc_apply.apply import branches, catalog_reads, tables
from cdc_apply.errors import ConcurrentApply

NS = "catalog_reads"


@pytest.fixture(scope="module")
def table(spark, settings):
    """A table with properties, a main snapshot and an audit branch with two
    commits of one attempt on top of main; its TableSpec and the branch's start."""
    ledger.Ledger(settings).catalog  # noqa: B018  opens the pyiceberg catalog (ledger.OPENED_CATALOGS)
    ident = f"{settings.catalog_name}.{NS}.items"
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {settings.catalog_name}.{NS}")
    spark.sql(
        f"CREATE TABLE {ident} (id int, v string) USING iceberg TBLPROPERTIES ('format-version'='2', 'cdc.x'='1', 'write.merge.mode'='merge-on-read')"
    )
    spark.sql(f"INSERT INTO {ident} VALUES (1, 'a')")
    spec = tables.TableSpec(ident, ["id"], {"id": "int", "v": "string"})
    start = branches.reset_branch(spark, spec, "audit_x")
    for n in (2, 3):
        with branches.snapshot_properties(spark, {branches.ATTEMPT_PROPERTY: "attempt-1"}):
            spark.createDataFrame([(n, "b")], "id int, v string").writeTo(branches.branch_ref(spec, "audit_x")).append()
    return spec, start


def both_ways(monkeypatch, read):
    """``read()`` through pyiceberg, then through Spark (no catalog registered)."""
    via_pyiceberg = read()
    with monkeypatch.context() as m:
        m.setattr(ledger, "OPENED_CATALOGS", {})
        via_spark = read()
    return via_pyiceberg, via_spark


def test_the_batch_catalog_is_found_from_the_sessions_conf(spark, table):
    spec, _ = table
    assert catalog_reads.catalog_for(spark, spec.identifier)[0] is not None, "the ledger's catalog must serve the session's reads"


def test_a_catalog_of_another_warehouse_is_not_used(spark, settings, table, monkeypatch):
    spec, _ = table
    other = ledger.Ledger(settings).catalog
    monkeypatch.setattr(ledger, "OPENED_CATALOGS", {(settings.catalog_name, settings.catalog_uri, "file:///another/home/warehouse"): other})
    assert catalog_reads.catalog_for(spark, spec.identifier)[0] is None


def test_properties_are_the_tables_own(spark, table, monkeypatch):
    spec, _ = table
    got, spark_says = both_ways(monkeypatch, lambda: tables.table_properties(spark, spec.identifier))
    assert got["cdc.x"] == "1" and got["write.merge.mode"] == "merge-on-read"
    shown = {k: v for k, v in got.items() if k != "owner"}  # Spark hides its reserved owner property
    assert {k: spark_says[k] for k in shown} == shown
    assert {k for k in spark_says if k.startswith(("cdc.", "write."))} == {k for k in got if k.startswith(("cdc.", "write."))}


def test_branch_heads_match_the_refs_table(spark, table, monkeypatch):
    spec, _ = table
    names = ("audit_x", "main", "no_such_branch")
    got, spark_says = both_ways(monkeypatch, lambda: branches._branch_heads(spark, spec, names))
    assert got == spark_says and set(got) == {"audit_x", "main"} and got["audit_x"] != got["main"]


def test_own_head_walks_the_same_snapshots(spark, table, monkeypatch):
    spec, start = table
    got, spark_says = both_ways(monkeypatch, lambda: branches.own_head(spark, spec, "audit_x", "attempt-1", "b1", start))
    assert got == spark_says == branches._branch_heads(spark, spec, ("audit_x",))["audit_x"]
    for read in (lambda: branches.own_head(spark, spec, "audit_x", "attempt-2", "b1", start),):
        with pytest.raises(ConcurrentApply):
            read()
        with monkeypatch.context() as m, pytest.raises(ConcurrentApply):
            m.setattr(ledger, "OPENED_CATALOGS", {})
            read()


@pytest.mark.parametrize(
    "what, name, expected",
    [
        ("table", "items", True),
        ("table", "no_such_table", False),
        ("namespace", None, True),
        ("missing namespace", None, False),
    ],
)
def test_existence_agrees(spark, settings, table, monkeypatch, what, name, expected):
    cat = settings.catalog_name
    if what == "table":
        read = lambda: tables.table_exists(spark, f"{cat}.{NS}.{name}")  # noqa: E731
    elif what == "namespace":
        read = lambda: tables.namespace_exists(spark, f"{cat}.{NS}")  # noqa: E731
    else:
        read = lambda: tables.table_exists(spark, f"{cat}.no_such_ns.items")  # noqa: E731
    assert both_ways(monkeypatch, read) == (expected, expected)


@pytest.mark.parametrize(
    "identifier, parts",
    [
        ("lake.ns.t", ["lake", "ns", "t"]),
        ("lake.`rebuild_pg`.`customers`", ["lake", "rebuild_pg", "customers"]),
        ("`lake`.`a.b`.`x``y`", ["lake", "a.b", "x`y"]),
        ("lake.ns.", None),
        ("lake.`ns", None),
        ("lake.`ns`x", None),
    ],
)
def test_spark_names_are_split_as_spark_reads_them(identifier, parts):
    assert catalog_reads.split_identifier(identifier) == parts


def test_a_quoted_name_reads_the_same_table(spark, settings, table):
    spec, _ = table
    quoted = f"{settings.catalog_name}.`{NS}`.`items`"
    assert catalog_reads.catalog_for(spark, quoted)[1] == (NS, "items")
    assert tables.table_properties(spark, quoted) == tables.table_properties(spark, spec.identifier)
    assert tables.table_exists(spark, quoted)


@pytest.mark.parametrize("empty", [False, True], ids=["table-with-rows", "empty-table"])
def test_a_run_whose_branch_another_run_committed_on_meanwhile_does_not_own_it(spark, settings, empty):
    """Two runs of one batch share its audit branch.  Run B resets the branch
    and run A commits on it right after B's CREATE BRANCH, before B reads
    where the branch began; then B commits on top.  B's start is main's head,
    so the branch does not hold B's commits alone: ``own_head`` refuses it.
    On an empty table the branch's first snapshot is then A's, and B's
    reset refuses at once.  Before the fix B took A's commit for its start
    and published both runs' rows (the nemesis's two-applies race)."""
    ident = f"{settings.catalog_name}.{NS}.raced_{int(empty)}"
    spark.sql(f"CREATE TABLE {ident} (id int, v string) USING iceberg TBLPROPERTIES ('format-version'='2')")
    if not empty:
        spark.sql(f"INSERT INTO {ident} VALUES (1, 'a')")
    spec = tables.TableSpec(ident, ["id"], {"id": "int", "v": "string"})
    main = branches.branch_snapshot(spark, spec, "main")

    def commit(attempt: str, key: int) -> None:
        with branches.snapshot_properties(spark, {branches.ATTEMPT_PROPERTY: attempt}):
            spark.createDataFrame([(key, attempt)], "id int, v string").writeTo(branches.branch_ref(spec, "audit_r")).append()

    sql = spark.sql
    raced = []

    def racing_sql(text: str, *args, **kwargs):
        out = sql(text, *args, **kwargs)
        if "CREATE BRANCH" in text and not raced:
            raced.append(text)
            commit("run-a", 2)  # run A's write lands between B's CREATE BRANCH and the rest of B's reset
        return out

    spark.sql = racing_sql
    try:
        if empty:  # the branch's first snapshot is A's: B refuses at once
            with pytest.raises(ConcurrentApply):
                branches.reset_branch(spark, spec, "audit_r")
            return
        start = branches.reset_branch(spark, spec, "audit_r")
    finally:
        del spark.sql
    assert raced and start == main
    commit("run-b", 3)
    with pytest.raises(ConcurrentApply):
        branches.own_head(spark, spec, "audit_r", "run-b", "b1", start)


def test_a_branch_cut_after_another_run_published_the_batch_refuses_its_write(spark, settings):
    """Run B reads main's ledger, run A publishes the batch, B cuts its branch
    from the new main (``branches.reset_branch_for``): B refuses when main
    now holds one of its files or, for a batch whose file had held lines
    (in no ledger's files, held.py), the batch itself.  A branch cut from
    the main B read, or from a main that moved by another batch, is B's to write."""
    import datetime as dt

    from cdc_apply.archive.files import ArchiveFile

    ident = f"{settings.catalog_name}.{NS}.published_meanwhile"
    spark.sql(f"CREATE TABLE {ident} (id int, v string) USING iceberg TBLPROPERTIES ('format-version'='2')")
    spark.sql(f"INSERT INTO {ident} VALUES (1, 'a')")
    spec = tables.TableSpec(ident, ["id"], {"id": "int", "v": "string"})
    led = ledger.Ledger(settings)
    read = led.table_ledger(spec.short)
    f = ArchiveFile(hour=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), path="/archive/h1.jsonl", size=1, sha256="0" * 64)
    assert branches.reset_branch_for(spark, spec, "audit_b1", [f], read, settings, "b1") == read.snapshot_id

    def publish(batch: str, files: list[dict]) -> None:
        with branches.snapshot_properties(spark, ledger.summary_properties(batch, files, position_max=None, truncated_at=None, counts={})):
            spark.sql(f"INSERT INTO {ident} VALUES (2, 'b')")

    publish("other", [{"path": "/archive/h0.jsonl", "size": 1, "sha256": "1" * 64}])
    assert branches.reset_branch_for(spark, spec, "audit_b1", [f], read, settings, "b1") != read.snapshot_id  # moved by another batch
    publish("b1", [])  # the batch, its file held in part
    with pytest.raises(ConcurrentApply, match="batch b1"):
        branches.reset_branch_for(spark, spec, "audit_b1", [f], read, settings, "b1")
    publish("b2", [f.as_dict()])
    with pytest.raises(ConcurrentApply, match=r"h1\.jsonl"):
        branches.reset_branch_for(spark, spec, "audit_b2", [f], read, settings, "b2")
