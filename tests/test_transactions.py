"""Transaction-consistent publish (``publish: transactions``, apply/transactions.py)
on real Spark + Iceberg: a source transaction is applied whole or not yet,
whatever the files and batches it is split over; one held too long fails the
batch, naming it; tables that shared one publish together.

The property test's oracle is the pure-Python reference model applied to the
events of the transactions that are complete among the lines delivered so far
(and every event without transaction metadata): after *every* batch the tables
must equal it, so no reader ever sees half a transaction, and nothing is lost
once the rest arrives."""

from __future__ import annotations

import datetime as dt
import itertools
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cdc_apply.apply import transactions
from cdc_apply.apply.held import HELD_KEY
from cdc_apply.model import Skipped
from cdc_apply.results import BatchResult, Override, TableResult
from tests.apply_harness import apply_events, event, live_rows
from tests.reference_model import apply_model

pytestmark = pytest.mark.spark
COLS = {"id": "int", "name": "string", "amount": "decimal(10,2)"}
_ns = itertools.count()


def tx(e, group: str, order: int):
    e.tx_group, e.tx_order = group, order
    return e


def end(group: str, total: int, file: str, line: int) -> Skipped:
    """A Debezium END marker as the decoder gives it."""
    return Skipped("transaction-marker", file, line, detail=f"END {group}", tx_group=group, tx_total=total)


def state_of(spark, settings, ns, table):
    return {k[0]: (v["name"], v["amount"]) for k, v in live_rows(spark, settings, ns, table, ["id"], COLS).items()}


def test_a_transaction_split_over_two_batches_applies_whole_in_the_second(spark, settings):
    ns = f"tx_{next(_ns)}"
    a, b = f"/virtual/{ns}/a.jsonl", f"/virtual/{ns}/b.jsonl"
    # T1 spans orders and items and both files; T2 (items only) is whole in file a
    t1 = [
        tx(event("c", 1, {"name": "o1", "amount": "1.00"}, pos=10, file=a, line=1, table="orders"), "T1", 1),
        tx(event("c", 10, {"name": "i10", "amount": "2.00"}, pos=11, file=a, line=2, table="items"), "T1", 2),
        tx(event("u", 1, {"name": "o1b", "amount": "3.00"}, pos=12, file=b, line=1, table="orders"), "T1", 3),
    ]
    t2 = [tx(event("c", 11, {"name": "i11", "amount": "4.00"}, pos=5, file=a, line=3, table="items"), "T2", 1)]
    file_a = [t1[0], t1[1], t2[0], end("T2", 1, a, 4)]
    file_b = [t1[2], end("T1", 3, b, 2)]

    r1 = apply_events(spark, settings, ns, file_a, publish="transactions")
    assert r1.status == "complete", r1.message
    assert state_of(spark, settings, ns, "items") == {"11": ("i11", "4.00")}  # T2 only: no half of T1
    assert state_of(spark, settings, ns, "orders") == {}
    assert r1.messages["held"] == 2 and r1.messages["held:transaction-incomplete"] == 2 and r1.held_files == [a]
    assert r1.source_state[HELD_KEY][a]["lines"] == [[1, 2]] and "since" in r1.source_state[HELD_KEY][a]
    assert r1.publish_groups == []  # T2 touched one table

    # discovery offers file a again (it has held lines) with file b
    r2 = apply_events(spark, settings, ns, file_a + file_b, publish="transactions")
    assert r2.status == "complete", r2.message
    assert state_of(spark, settings, ns, "orders") == {"1": ("o1b", "3.00")}
    assert state_of(spark, settings, ns, "items") == {"10": ("i10", "2.00"), "11": ("i11", "4.00")}
    assert r2.messages["read"] == 4 and r2.messages.get("held", 0) == 0  # a's two held lines and b's two; nothing twice
    assert r2.publish_groups == [sorted(t.table for t in r2.tables)]
    assert HELD_KEY not in r2.source_state


def test_the_same_batch_with_publish_events_applies_the_half(spark, settings):
    ns = f"tx_{next(_ns)}"
    a = f"/virtual/{ns}/a.jsonl"
    half = [tx(event("c", 1, {"name": "o1", "amount": "1.00"}, pos=10, file=a, line=1, table="orders"), "T1", 1)]
    r = apply_events(spark, settings, ns, half, publish="events")
    assert r.status == "complete" and state_of(spark, settings, ns, "orders") == {"1": ("o1", "1.00")}


def test_a_transaction_held_too_long_fails_the_batch_and_force_applies_it(spark, settings):
    ns = f"tx_{next(_ns)}"
    a = f"/virtual/{ns}/a.jsonl"
    half = [tx(event("c", 1, {"name": "o1", "amount": "1.00"}, pos=10, file=a, line=1, table="orders"), "T9", 1), end("T9", 2, a, 2)]
    first = apply_events(spark, settings, ns, half, publish="transactions")
    assert first.status == "complete" and first.messages["held"] == 2 and state_of(spark, settings, ns, "orders") == {}
    old = dict(first.source_state)
    old[HELD_KEY] = {a: {**old[HELD_KEY][a], "since": (dt.datetime.now(dt.UTC) - dt.timedelta(hours=7)).isoformat()}}
    late = apply_events(spark, settings, ns, half, publish="transactions", decoder_state=old)
    assert late.status == "failed" and late.failed_checks == ["transaction_hold_age(max_hours=6.0, transactions=1)"]
    assert "transaction T9: 1 of 2 event(s) read (1 event(s) not read), held since" in late.message
    assert "--override force" in late.message and "publish: events" in late.message
    assert state_of(spark, settings, ns, "orders") == {}
    forced = apply_events(
        spark,
        settings,
        ns,
        half,
        publish="transactions",
        decoder_state=old,
        override=Override("force", "the rest was lost upstream", "ops"),
    )
    assert forced.status == "complete", forced.message
    assert state_of(spark, settings, ns, "orders") == {"1": ("o1", "1.00")}
    assert forced.source_state[transactions.FORCED_KEY] == ["T9"]
    # its missing event turns up later (released from quarantine): readers saw T9 in part, so it applies at once
    b = f"/virtual/{ns}/b.jsonl"
    rest = [tx(event("u", 1, {"name": "o1b", "amount": "2.00"}, pos=11, file=b, line=1, table="orders"), "T9", 2)]
    after = apply_events(spark, settings, ns, rest, publish="transactions", decoder_state=forced.source_state)
    assert after.status == "complete" and after.messages.get("held", 0) == 0, after.to_json()
    assert state_of(spark, settings, ns, "orders") == {"1": ("o1b", "2.00")}
    assert after.source_state[transactions.FORCED_KEY] == ["T9"]


def test_a_failed_gate_holds_back_the_tables_that_shared_a_transaction_with_it(spark, settings, tmp_path):
    import dataclasses
    import json

    ns = f"tx_{next(_ns)}"
    settings = dataclasses.replace(settings, expectations_dir=tmp_path)
    (tmp_path / f"{ns}.orders.json").write_text(
        json.dumps({"expectations": [{"type": "expect_column_values_to_be_between", "kwargs": {"column": "amount", "min_value": 0}}]})
    )
    a = f"/virtual/{ns}/a.jsonl"
    batch = [
        tx(event("c", 1, {"name": "o1", "amount": "-1.00"}, pos=10, file=a, line=1, table="orders"), "T1", 1),  # fails the suite
        tx(event("c", 10, {"name": "i10", "amount": "2.00"}, pos=11, file=a, line=2, table="items"), "T1", 2),
        end("T1", 2, a, 3),
        event("c", 20, {"name": "lone", "amount": "5.00"}, pos=12, file=a, line=4, table="lone"),  # no transaction metadata
    ]
    r = apply_events(spark, settings, ns, batch, publish="transactions")
    by = {t.table.rsplit(".", 1)[1]: t for t in r.tables}
    assert r.status == "failed" and r.publish_groups == [sorted([by["items"].table, by["orders"].table])]
    assert by["orders"].status == "failed" and by["orders"].failed_expectations
    assert by["items"].status == "failed" and by["items"].terminal and "held back" in by["items"].message
    assert by["lone"].status == "published"  # a table that shared no transaction publishes on its own
    assert state_of(spark, settings, ns, "items") == {} and state_of(spark, settings, ns, "orders") == {}
    assert state_of(spark, settings, ns, "lone") == {"20": ("lone", "5.00")}


def resolved(stream: str, pos: int, file: str, line: int) -> Skipped:
    """A CockroachDB resolved message as the decoder gives it (tx_group: its stream)."""
    return Skipped("resolved-watermark", file, line, detail="resolved", position=f"{pos:020d}", tx_group=stream)


def test_cockroachdb_applies_up_to_the_lowest_resolved_timestamp_of_its_partitions(spark, settings):
    ns = f"tx_{next(_ns)}"
    a, b = f"/virtual/{ns}/a.jsonl", f"/virtual/{ns}/b.jsonl"
    file_a = [
        event("c", 1, {"name": "k1", "amount": "1.00"}, pos=10, file=a, line=1),
        event("c", 2, {"name": "k2", "amount": "2.00"}, pos=20, file=a, line=2),
        event("c", 3, {"name": "k3", "amount": "3.00"}, pos=30, file=a, line=3),
        resolved("movr.items/0", 25, a, 4),
        resolved("movr.items/1", 15, a, 5),  # the slower partition: the feed is resolved to 15
    ]
    r1 = apply_events(spark, settings, ns, file_a, publish="transactions", fmt="cockroachdb")
    assert r1.status == "complete", r1.message
    assert state_of(spark, settings, ns, "items") == {"1": ("k1", "1.00")}
    assert r1.messages["held:after-the-resolved-timestamp"] == 2
    assert r1.source_state["_cdc_resolved"] == {"movr.items/0": f"{25:020d}", "movr.items/1": f"{15:020d}"}
    file_b = [
        event("u", 1, {"name": "k1b", "amount": "1.50"}, pos=38, file=b, line=1),
        resolved("movr.items/1", 40, b, 2),
        resolved("movr.items/0", 35, b, 3),
    ]
    r2 = apply_events(spark, settings, ns, file_a + file_b, publish="transactions", fmt="cockroachdb")
    assert r2.status == "complete", r2.message
    assert state_of(spark, settings, ns, "items") == {"1": ("k1", "1.00"), "2": ("k2", "2.00"), "3": ("k3", "3.00")}  # 38 > 35: held
    assert r2.held_files == [b] and r2.messages["read"] == 5  # a's two held lines, b's three


def test_cockroachdb_without_resolved_timestamps_fails_after_the_hold_age_and_force_applies(spark, settings):
    ns = f"tx_{next(_ns)}"
    a = f"/virtual/{ns}/a.jsonl"
    lines = [event("c", 1, {"name": "k1", "amount": "1.00"}, pos=10, file=a, line=1)]
    first = apply_events(spark, settings, ns, lines, publish="transactions", fmt="cockroachdb")
    assert first.status == "complete" and first.messages["held"] == 1 and state_of(spark, settings, ns, "items") == {}
    old = dict(first.source_state)
    old[HELD_KEY] = {a: {**old[HELD_KEY][a], "since": (dt.datetime.now(dt.UTC) - dt.timedelta(hours=7)).isoformat()}}
    late = apply_events(spark, settings, ns, lines, publish="transactions", fmt="cockroachdb", decoder_state=old)
    assert late.status == "failed" and late.failed_checks == ["resolved_watermark_age(max_hours=6.0, files=1)"]
    assert "watermark none: no resolved timestamp read yet" in late.message and "WITH resolved" in late.message
    forced = apply_events(
        spark,
        settings,
        ns,
        lines,
        publish="transactions",
        fmt="cockroachdb",
        decoder_state=old,
        override=Override("force", "no resolved", "ops"),
    )
    assert forced.status == "complete" and state_of(spark, settings, ns, "items") == {"1": ("k1", "1.00")}


def _result(statuses: dict[str, tuple[str, bool]], groups: list[list[str]]) -> BatchResult:
    r = BatchResult(batch_id="s_b1", source="s", status="complete", publish_groups=groups)
    r.tables = [TableResult(table=t, status=s, terminal=term) for t, (s, term) in statuses.items()]
    return r


def test_tables_that_shared_a_transaction_publish_together():
    # a group-mate still at its gate: wait
    r = _result({"l.s.a": ("validated", True), "l.s.b": ("written", True), "l.s.c": ("failed", True)}, [["l.s.a", "l.s.b"]])
    with pytest.raises(transactions.GatePending, match=r"l\.s\.a publishes with l\.s\.b"):
        transactions.check_group(r, r.table("l.s.a"))
    # a failed group-mate: held back, as terminal as the mate's failure
    for terminal in (True, False):
        r = _result({"l.s.a": ("validated", True), "l.s.b": ("failed", terminal)}, [["l.s.a", "l.s.b"]])
        transactions.check_group(r, r.table("l.s.a"))
        a = r.table("l.s.a")
        assert a.status == "failed" and a.terminal is terminal and "held back" in a.message and "l.s.b" in a.message
    # alone (no group, or only an unrelated failure): unchanged
    r = _result({"l.s.a": ("validated", True), "l.s.c": ("failed", True)}, [])
    transactions.check_group(r, r.table("l.s.a"))
    assert r.table("l.s.a").status == "validated"


def test_the_dags_publish_of_a_table_waits_while_a_group_mate_is_at_its_gate(settings, tmp_path):
    """The mapped publish task of a table whose group-mate is still being
    validated is rescheduled (no worker slot held, no retry spent); once the
    mate failed, it fails as held back, as terminal as the mate."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException

    from cdc_airflow.tasks import publish_table

    path = tmp_path / "result.json"
    path.write_text(_result({"l.s.a": ("validated", True), "l.s.b": ("written", True)}, [["l.s.a", "l.s.b"]]).to_json())
    with pytest.raises(AirflowRescheduleException):
        publish_table(str(path), "l.s.a")
    path.write_text(_result({"l.s.a": ("validated", True), "l.s.b": ("failed", True)}, [["l.s.a", "l.s.b"]]).to_json())
    with pytest.raises(AirflowFailException, match="held back"):
        publish_table(str(path), "l.s.a")


def test_overdue_counts_from_the_oldest_held_file():
    now = dt.datetime(2026, 1, 1, 12, tzinfo=dt.UTC)
    inc = [transactions.Incomplete("T", 1, None, ("/a", "/b"))]
    held = {"/a": {"since": "2026-01-01T07:00:00+00:00"}, "/b": {"since": "2026-01-01T11:00:00+00:00"}}
    assert list(transactions.overdue(inc, held, 4.0, now)) == ["T"]
    assert transactions.overdue(inc, held, 6.0, now) == {}
    assert transactions.overdue(inc, {}, 0.1, now) == {}  # first held by this batch: no age yet
    assert "its END marker / last event not read" in inc[0].reason()


@st.composite
def workloads(draw):
    """Transactions over two tables (some without metadata: ``None``), each
    event in a random file, files in a random order split into batches."""
    n_tx = draw(st.integers(1, 5))
    events, pos = [], itertools.count(1)
    n_files = draw(st.integers(1, 4))
    for t in range(n_tx):
        size = draw(st.integers(1, 3))
        group = None if draw(st.integers(0, 4)) == 0 else f"T{t}"
        for o in range(1, size + 1):
            op = draw(st.sampled_from(["c", "u", "d"]))
            key = draw(st.integers(1, 4))
            table = draw(st.sampled_from(["orders", "items"]))
            e = event(op, key, {"name": f"t{t}e{o}", "amount": f"{o}.00"}, pos=next(pos), table=table)
            e.file = f"f{draw(st.integers(0, n_files - 1))}"
            events.append(tx(e, group, o) if group else e)
        if group and draw(st.integers(0, 4)) > 0:  # the END marker (sometimes never archived), in some file
            events.append(end(group, size, f"f{draw(st.integers(0, n_files - 1))}", 0))
    order = draw(st.permutations([f"f{i}" for i in range(n_files)]))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, n_files - 1)), max_size=n_files - 1)))
    batches = [order[i:j] for i, j in zip([0, *cuts], [*cuts, n_files], strict=True) if order[i:j]]
    return events, batches


@hsettings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads())
def test_readers_never_see_half_a_transaction(spark, settings, workload):
    events, batches = workload
    ns = f"txp_{next(_ns)}"
    by_file: dict[str, list] = {}
    for e in events:
        by_file.setdefault(e.file, []).append(e)
    for f, outs in by_file.items():  # real line numbers per file
        for i, o in enumerate(outs, 1):
            o.file, o.line = f"/virtual/{ns}/{f}.jsonl", i
    delivered: list = []
    pending: set[str] = set()
    for batch in batches:
        paths = [f"/virtual/{ns}/{f}.jsonl" for f in batch if f in by_file]
        for f in batch:
            delivered += by_file.get(f, [])
        offered = sorted(set(paths) | pending)  # discovery offers held files again
        if not offered:
            continue
        r = apply_events(spark, settings, ns, [o for o in delivered if o.file in offered], publish="transactions")
        assert r.status == "complete", r.message
        pending = set(r.held_files)
        seen = {}
        for o in delivered:
            if o.tx_group is not None and getattr(o, "tx_order", None) is not None and hasattr(o, "op"):
                seen.setdefault(o.tx_group, set()).add(o.tx_order)
        totals = {o.tx_group: o.tx_total for o in delivered if isinstance(o, Skipped) and o.tx_total is not None}
        complete = {g for g, orders in seen.items() if g in totals and len(orders) == totals[g]}
        applied = [o for o in delivered if hasattr(o, "op") and (o.tx_group is None or o.tx_group in complete)]
        for table in ("orders", "items"):
            model = apply_model([e for e in applied if e.table == table], ["id"], list(COLS))
            want = {k[0]: (v["name"], v["amount"]) for k, v in model.items()}
            assert state_of(spark, settings, ns, table) == want, (table, sorted(complete))


def test_publish_is_configured_per_source_with_transactions_where_the_format_allows_it(settings, tmp_path):
    import dataclasses

    from cdc_apply.config import load_sources
    from cdc_apply.errors import ConfigError

    f = tmp_path / "sources.yaml"
    s = dataclasses.replace(settings, sources_file=f)

    def source(**spec):
        f.write_text(yaml.safe_dump({"sources": {"s": spec}}))
        return load_sources(s)["s"]

    assert (source(format="debezium_postgres").publish, source(format="qlik").publish) == ("transactions", "transactions")
    assert (source(format="sqlserver_ces").publish, source(format="cockroachdb").publish) == ("events", "events")
    assert source(format="cockroachdb", publish="transactions").publish == "transactions"  # with resolved timestamps
    with pytest.raises(ConfigError, match=r"publish: transactions and ordering: arrival"):
        source(format="cockroachdb", publish="transactions", ordering="arrival")
    assert source(format="debezium_sqlserver", publish="events").publish == "events"
    assert source(format="qlik", transaction_max_hold_hours=0.5).max_hold_hours == 0.5
    with pytest.raises(ConfigError, match=r"asks for publish: transactions, which format sqlserver_ces cannot give: .*commit LSN"):
        source(format="sqlserver_ces", publish="transactions")
    with pytest.raises(ConfigError, match=r"publish of source 's' is 'atomic'; use one of \['transactions', 'events'\]"):
        source(format="qlik", publish="atomic")
    with pytest.raises(ConfigError, match=r"transaction_max_hold_hours of source 's' is 'soon'"):
        source(format="qlik", transaction_max_hold_hours="soon")


def test_a_held_file_gone_from_the_archive_fails_the_batch_naming_it_until_force_gives_its_messages_up(
    spark, settings, tmp_path, monkeypatch, capsys
):
    """A file whose held messages are not applied yet is deleted (say, by an
    archive's lifecycle rule): its messages would wait unseen for ever, so
    every batch fails naming it, until it is restored or an operator's force
    gives them up, counted in the batch's messages."""
    import shutil

    from cdc_apply import cli, ledger
    from cdc_apply.batch import GIVEN_UP
    from cdc_apply.config import Settings, get_source
    from tests.nemesis.workload import sources_yaml, write_workload

    name = "held_gone"
    (tmp_path / "sources.yaml").write_text(sources_yaml(name, name))
    monkeypatch.setenv("CDC_SOURCES_FILE", str(tmp_path / "sources.yaml"))
    s = Settings.from_env()
    root = Path(get_source(s, name).archive_path(s))
    write_workload(root, seed=11, hours=2, per_hour=6)  # hour 0's last items transaction ends in hour 1's file
    hour1 = root / "2026/01/01/01"
    shutil.move(hour1, tmp_path / "later")

    def apply(*extra: str) -> tuple[int, dict]:
        code = cli.main(["apply", "--source", name, *extra])
        return code, json.loads(capsys.readouterr().out)

    code, first = apply()
    assert code == 0 and first["status"] == "complete" and first["held_files"], first
    held_count = first["messages"]["held"]
    shutil.move(tmp_path / "later", hour1)

    # the held file still in the archive but outside the batch's hours: it waits, nothing fails
    code, later_only = apply("--since", "2026-01-01T01:00:00+00:00", "--dry-run")
    assert code == 0 and later_only["status"] == "dry-run", later_only

    def status() -> dict:
        assert cli.main(["status", "--source", name]) == 0
        rows = json.loads(capsys.readouterr().out)
        held_of = [{k: v for k, v in r.items() if k.startswith("held_")} for r in rows]
        assert rows and all(h == held_of[0] for h in held_of)  # the source's, on each of its tables' rows
        return held_of[0]

    assert cli.main(["pending", "--source", name]) == 0
    pending = capsys.readouterr().out.splitlines()
    for path in first["held_files"]:  # pending, saying why, and still ending with the path (scripts, the nemesis, read it there)
        assert [line for line in pending if line.split()[-1] == path and "held message(s), since " in line], pending
    holding = status()  # per table row, the source's held messages
    assert (holding["held_messages"], holding["held_files"], holding["held_files_gone"]) == (held_count, len(first["held_files"]), [])
    for path in first["held_files"]:
        Path(path).unlink()
    assert status()["held_files_gone"] == sorted(first["held_files"])
    for _ in range(2):  # not once: every batch, until someone acts
        code, gone = apply()
        assert code != 0 and gone["status"] == "failed", gone
        assert gone["failed_checks"] == [f"held_file_gone(files={len(first['held_files'])}, messages={held_count})"]
        assert all(p in gone["message"] for p in first["held_files"]) and "--override force" in gone["message"]
        assert gone["tables"] == []  # nothing written

    code, forced = apply("--override", "force", "--override-reason", "deleted by the bucket's lifecycle rule")
    assert code == 0 and forced["status"] == "complete", forced
    assert forced["messages"][GIVEN_UP] == held_count
    assert "let through" in forced["message"] and "held_file_gone" in forced["message"]
    state = ledger.Ledger(settings).latest_decoder_state(name)
    assert not set(first["held_files"]) & set(state.get(HELD_KEY, {}))
    code, after = apply()  # the workload's last transaction never ends: its file is re-read, held again, nothing fails
    assert code == 0 and after["status"] == "complete" and GIVEN_UP not in after["messages"] and not after["failed_checks"], after


def test_a_held_file_gone_while_nothing_else_is_pending_fails_the_run_not_nothing_to_do(spark, settings, tmp_path, monkeypatch, capsys):
    """A quiet source (no new file) whose held file leaves the archive: no
    batch would read it again and none would start, so each run (the CLI's,
    and the DAG's discover + apply + finish) fails naming it instead of
    ending *nothing to do*, until a force gives its messages up."""
    import shutil

    from airflow.sdk.exceptions import AirflowFailException  # first: importing Airflow puts its plugins folder on the path

    from cdc_airflow.tasks import discover, finish
    from cdc_apply import cli, ledger
    from cdc_apply.batch import GIVEN_UP
    from cdc_apply.config import Settings, get_source
    from tests.nemesis.workload import sources_yaml, write_workload

    name = "held_gone_quiet"
    (tmp_path / "sources.yaml").write_text(sources_yaml(name, name))
    monkeypatch.setenv("CDC_SOURCES_FILE", str(tmp_path / "sources.yaml"))
    s = Settings.from_env()
    root = Path(get_source(s, name).archive_path(s))
    write_workload(root, seed=13, hours=2, per_hour=6)
    shutil.move(root / "2026/01/01/01", tmp_path / "later")  # the hour that ends hour 0's transaction never comes

    def apply(*extra: str) -> tuple[int, dict]:
        code = cli.main(["apply", "--source", name, *extra])
        # the result is the last line: with Airflow imported, its log lines go to the same stream
        return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    code, first = apply()
    assert code == 0 and first["status"] == "complete" and first["held_files"], first
    held_count = first["messages"]["held"]
    for path in first["held_files"]:
        Path(path).unlink()
    check = f"held_file_gone(files={len(first['held_files'])}, messages={held_count})"

    # the CLI: without the check this run ends "nothing-to-do"
    code, gone = apply()
    assert code != 0 and gone["status"] == "failed" and gone["failed_checks"] == [check], gone
    assert all(p in gone["message"] for p in first["held_files"]) and "--override force" in gone["message"]

    # the DAG: discover offers the batch, its apply job fails naming the files, its finish fails the run
    found = discover(name, None, "manual__quiet", None)
    assert found["files"] == 0 and found["pending"] == len(first["held_files"]) and found["held_files_gone"] == sorted(first["held_files"])
    assert cli.main(found["write_args"]) != 0
    capsys.readouterr()
    with pytest.raises(AirflowFailException, match="held"):
        finish(found["result_file"])
    failed = [r for r in ledger.Ledger(settings).batch_rows(name) if r["batch_id"] == found["batch_id"]]
    assert failed and {r["status"] for r in failed} == {"failed"}

    code, forced = apply("--override", "force", "--override-reason", "the capture was dropped; its archive expired")
    assert code == 0 and forced["status"] == "complete" and forced["messages"] == {GIVEN_UP: held_count}, forced
    assert not ledger.Ledger(settings).latest_decoder_state(name).get(HELD_KEY)
    code, quiet = apply()
    assert code == 0 and quiet["status"] == "nothing-to-do", quiet
    assert discover(name, None, "manual__after", None)["pending"] == 0


def test_a_held_file_an_operator_skipped_is_no_longer_held(spark, settings, tmp_path, monkeypatch, capsys):
    """An operator's skip marks the batch's files applied, a held file among
    them: its held lines are given up with it, so no status counts them as
    held and the file may then leave the archive without failing a batch."""
    import shutil

    from cdc_apply import cli
    from tests.nemesis.workload import sources_yaml, write_workload

    name = "held_skipped"
    root = tmp_path / "archive"
    write_workload(root, seed=12, hours=2, per_hour=6)
    (tmp_path / "sources.yaml").write_text(sources_yaml(name, name))
    monkeypatch.setenv("CDC_SOURCES_FILE", str(tmp_path / "sources.yaml"))
    hour1 = root / "2026/01/01/01"
    shutil.move(hour1, tmp_path / "later")

    def apply(*extra: str) -> dict:
        cli.main(["apply", "--source", name, "--dir", str(root), *extra])
        return json.loads(capsys.readouterr().out)

    first = apply()
    assert first["status"] == "complete" and first["held_files"], first
    shutil.move(tmp_path / "later", hour1)
    skipped = apply("--override", "skip", "--override-reason", "replayed elsewhere")
    assert skipped["status"] == "skipped" and set(first["held_files"]) <= {f["path"] for f in skipped["files"]}, skipped
    assert cli.main(["status", "--source", name]) == 0
    holding = json.loads(capsys.readouterr().out)[0]
    assert (holding["held_messages"], holding["held_files"]) == (0, 0), holding
    for path in first["held_files"]:
        Path(path).unlink()
    lines = (hour1 / "part-0.jsonl").read_text().splitlines()
    (hour1 / "part-9.jsonl").write_text(next(line for line in lines if '"op": "c"' in line or '"op":"c"' in line) + "\n")
    after = apply()  # a new file: a batch runs, and the skipped held file gone is no failure
    assert after["status"] == "complete" and not after["failed_checks"], after
