"""The operator-facing text and parsing of issue 22 that needs no server: run
headlines, next steps, job-line levels, the Data Docs rewrite, the source
choices.  (The same code under a real api-server: test_operator_ui.py.)"""

from __future__ import annotations

import re

from cdc_airflow.guidance import docs_url, headline, next_steps, retry_steps, transient
from cdc_airflow.spark import LevelByLine

TABLE = {"table": "lake.pg_inventory.customers", "counts": {"inserted": 4, "updated": 2, "deleted": 1, "superseded": 3}}


def test_headlines_tell_runs_apart():
    assert headline({"status": "nothing-to-do", "source": "pg_inventory"}) == "nothing to do: no pending files for pg_inventory"
    assert headline({"status": "complete", "tables": [{**TABLE, "status": "published"}]}) == "applied 7 change(s) to 1 table(s)"
    forced = {
        "status": "complete",
        "override": {"action": "force", "reason": "refunds", "operator": "ann"},
        "tables": [{**TABLE, "status": "published", "override": "FORCE by ann"}],
    }
    assert headline(forced) == "applied 7 change(s) to 1 table(s) - forced publish: refunds"
    failed = {
        "status": "failed",
        "tables": [{**TABLE, "status": "failed"}, {"table": "lake.pg_inventory.orders", "status": "published", "counts": {"inserted": 5}}],
    }
    assert headline(failed).startswith("FAILED: lake.pg_inventory.customers; applied 5 change(s) to 1 other table(s)")
    assert headline({"status": "written", "tables": [{**TABLE, "status": "written"}]}).startswith(
        "wrote 7 change(s) to 1 table(s) on their audit branches"
    )
    assert (
        headline({"status": "skipped", "source": "s", "files": [{}, {}], "override": {"reason": "bad export"}})
        == "skipped 2 file(s) of s: bad export"
    )


def test_a_lost_race_is_not_called_a_failed_gate():
    """A table that failed for a reason a retry fixes (another run published
    first) asks nothing of a person; a failed gate asks for a decision."""
    raced = {
        "status": "failed",
        "tables": [{**TABLE, "status": "failed", "terminal": False, "message": "ConcurrentApply: another run is applying batch b1"}],
    }
    assert transient(raced)
    head = headline(raced)
    assert "gate failed" not in head and "transient, nothing to decide" in head and "another run is applying batch b1" in head
    assert "force" not in retry_steps("pg_inventory") and '{"source": "pg_inventory"}' in retry_steps("pg_inventory")
    gate = {"status": "failed", "tables": [{**TABLE, "status": "failed", "terminal": True, "message": "GateFailed: ..."}]}
    assert not transient(gate) and headline(gate).endswith("(gate failed: fix and re-run, or force / skip with a reason)")
    mixed = {"status": "failed", "tables": [raced["tables"][0], {**gate["tables"][0], "table": "lake.pg_inventory.orders"}]}
    assert not transient(mixed)


def test_next_steps_give_form_values_and_cli():
    text = next_steps("pg_inventory", "b1")
    assert '{"source": "pg_inventory", "override": "force", "override_reason": ' in text
    assert '{"source": "pg_inventory", "override": "skip", "override_reason": ' in text
    assert "./dev cdc apply --source pg_inventory --override force --override-reason" in text and "batch_id = 'b1'" in text


def test_docs_url_points_into_the_plugin(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.example:8081/")
    page = tmp_path / "data_docs" / "b1" / "lake_ns_t" / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html"
    assert docs_url(str(page), tmp_path) == "http://airflow.example:8081/cdc/docs/b1/lake_ns_t/"
    assert docs_url("/elsewhere/index.html", tmp_path) is None and docs_url(None, tmp_path) is None


class Recorder:
    def __init__(self):
        self.lines = []

    def __getattr__(self, level):
        return lambda msg, *args, **kw: self.lines.append((level, msg % args if args else msg))


def test_job_lines_are_logged_at_their_own_level():
    rec = Recorder()
    log = LevelByLine(rec, verbose=False)
    for line in [
        "2026-11-25 03:00:00,123 INFO cdc_apply: batch b1: 12 messages",
        "2026-11-25 03:00:01,000 WARNING cdc_apply: batch b1: operator override FORCE by ann: refunds",
        "plain output",
        "26/11/25 03:00:02 WARN NativeCodeLoader: Unable to load native-hadoop library",
        "2026-11-25 03:00:03,000 ERROR cdc_apply: lake.x: GateFailed: ...",
        "Next step, one of:",
        '{"batch_id":"b1"}',
        "Traceback (most recent call last):",
        'File "x.py", line 1, in <module>',
    ]:
        log.info(line)
    assert [lvl for lvl, _ in rec.lines] == [
        "info",
        "warning",
        "info",
        "debug",
        "error",
        "error",
        "info",
        "error",
        "error",
    ]  # NativeCodeLoader: chatter
    log.info("Identified spark driver id: %s", "d1")  # the hook's own lines stay INFO
    assert rec.lines[-1] == ("info", "Identified spark driver id: d1")
    for chatter in [
        "26/11/25 03:57:03 INFO SparkContext: Running Spark version 4.1.3",
        "Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties",
        "26/11/25 03:56:58 WARN NativeCodeLoader: Unable to load native-hadoop library for your platform",
    ]:
        log.info(chatter)
        assert rec.lines[-1] == ("debug", chatter)
    log.info("26/11/25 03:57:05 WARN MemoryStore: Not enough space to cache rdd_1_0")  # a warning that matters stays one
    assert rec.lines[-1][0] == "warning"
    log.info("Identified spark driver id: %s", "d1")
    assert rec.lines[-1] == ("info", "Identified spark driver id: d1")


GX_PAGE = """<html><head>
<link rel="stylesheet" href="https://cdn.example/bootstrap/4.3.1/css/bootstrap.min.css" integrity="sha384-x" crossorigin="anonymous"/>
<script src="https://cdn.example/npm/vega@5"></script>
<script src="https://cdn.example/jquery-3.7.1.min.js"></script>
</head><body><img src="https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/logo-long.png?d=1&dataContextId=abc">
<a href="https://greatexpectations.io">GX</a></body></html>"""


def test_data_docs_pages_load_nothing_from_a_cdn():
    from cdc_airflow.ui import STATIC, VENDOR, rewrite_docs_html

    out = rewrite_docs_html(GX_PAGE, "/cdc/static/vendor", "/cdc/docs/b1/t")
    assert '<link rel="stylesheet" href="/cdc/static/vendor/css/bootstrap.min.css"/>' in out and "integrity" not in out
    assert '<script src="/cdc/static/vendor/jquery.min.js"></script>' in out and "vega@5 not loaded" in out
    assert '<img src="/cdc/docs/b1/t/static/images/logo-long.png">' in out  # no tracking request either
    assert not re.findall(r"<(?:script|link|img)\b[^>]*(?:src|href)=\"https?://", out)
    assert '<a href="https://greatexpectations.io">' in out  # links stay links
    assert all((STATIC / "vendor" / f).is_file() for f in VENDOR.values())


def test_the_form_offers_the_configured_sources(tmp_path, monkeypatch):
    from cdc_airflow.form import source_choices, source_param

    assert source_choices()["pg_inventory"] == "pg_inventory (debezium_postgres)"
    p = source_param("nope")
    assert p.value == "pg_inventory" and p.schema["enum"][0] == "pg_inventory"
    monkeypatch.setenv("CDC_SOURCES_FILE", str(tmp_path / "missing.yaml"))
    assert source_param("x").schema == {"type": "string"}  # free text when the file cannot be read


def test_a_run_that_timed_out_waiting_for_its_turn_names_the_holder_in_its_note():
    from cdc_airflow.notes import run_note

    holder = "run 'backfill__2026-01-01T01:00:00+00:00' of DAG 'cdc_apply' (holding it since 2026-11-26T07:10:30+00:00)"
    assert run_note(None, None, holder) == f"FAILED waiting for the source's turn (task turn): it was still held by {holder}"
    assert run_note(None, None) == "FAILED before discover finished: see its log"
    assert run_note(None, "configuration error: x\nmore", holder).startswith("FAILED in discover: configuration error: x")
