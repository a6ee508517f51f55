"""Issue 22, as an operator meets it: one real ``airflow standalone``
(scheduler + api-server) for the module, the demo archive, a user suite the
demo's negative balance fails, and a headless Chromium for what a person
sees (the trigger form, a failed task's log, the Data Docs, the status page).

The runs, in order: the scheduled run fails its gate (next steps in the
failure, report still summarises, run note); a trigger with an override but
no reason fails once in discover (finish skipped, not a TypeError); a forced
run publishes (note, asset extras with string ids, logs at their level, no
library chatter); the form submitted with its defaults is a nothing-to-do
run.  Screenshots go to /tmp/ux-shots/."""

from __future__ import annotations

import json
import os
import re
import time
from urllib.parse import quote

import pytest

from tests.airflow_ui.harness import APT_LINE, Ui, browser_missing, write_failing_suite

pytestmark = [pytest.mark.airflow, pytest.mark.spark, pytest.mark.slow]

CUSTOMERS = "lake.pg_inventory.customers"
REASON = "negative balances are refunds; suite fix in review"


def needs_browser() -> None:
    why = browser_missing()
    if why:
        pytest.skip(f"no headless browser: {why} (Debian: {APT_LINE})")


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    root = tmp_path_factory.mktemp("airflow_ui")
    ui = Ui(root, CDC_EXPECTATIONS_DIR=str(write_failing_suite(root / "suites")))
    saved = os.environ.get("CDC_HOME")
    os.environ["CDC_HOME"] = ui.env["CDC_HOME"]
    try:
        write_demo_archive(Settings.from_env())  # before the scheduler starts: its first (scheduled) run applies it
        ui.start()
        yield ui
    finally:
        ui.stop()
        if saved is None:
            os.environ.pop("CDC_HOME", None)
        else:
            os.environ["CDC_HOME"] = saved


@pytest.fixture(scope="module")
def failed_run(ui):
    deadline = time.time() + 600
    while time.time() < deadline:
        runs = ui.api("GET", "/dags/cdc_apply/dagRuns?limit=10")["dag_runs"]
        if runs:
            break
        time.sleep(2)
    run = ui.wait(runs[0]["dag_run_id"])
    tis = ui.task_instances(run["dag_run_id"])
    states = {f"{t}[{i}]": (ti["state"], ti["try_number"]) for (t, i), ti in sorted(tis.items())}
    assert run["state"] == "failed" and ("table.validate", 0) in tis, f"{run}\ntask states (state, tries): {states}\n{ui.sa.tail()}"
    return run


def tried(ui, run_id: str, task_id: str, tries: int, marker: str, map_index: int = -1) -> int:
    """How many tries ran into ``marker`` (a freshly started standalone can
    lose a task's first try before it runs: the executor reports it failed
    while queued; that try is retried and is not the one counted)."""
    return sum(any(marker in e for e in events(ui.log(run_id, task_id, n, map_index))) for n in range(1, tries + 1))


def events(lines: list[dict], level: str | None = None) -> list[str]:
    return [str(line.get("event")) for line in lines if level is None or line.get("level") == level]


def test_a_failed_gate_says_what_to_do_next_and_report_still_summarises(ui, failed_run):
    run_id = failed_run["dag_run_id"]
    tis = ui.task_instances(run_id)
    validate = tis[("table.validate", 0)]
    assert (
        validate["state"] == "failed" and tried(ui, run_id, "table.validate", validate["try_number"], "GateFailed", 0) == 1
    )  # terminal: not retried
    # finish records the attempt and fails the batch; report summarises it and fails the run (the last task decides it)
    assert tis[("finish", -1)]["state"] == "failed" and tis[("report", -1)]["state"] == "failed"
    errors = "\n".join(events(ui.log(run_id, "table.validate", validate["try_number"], 0), "error"))
    # the job's own ERROR line arrives as an error (not INFO), with the next step in the task's failure
    assert "GateFailed" in errors and "expect_column_values_to_be_between" in errors
    for step in ("fix and re-run", '"override": "force"', '"override": "skip"', "./dev cdc apply --source pg_inventory --override force"):
        assert step in errors, step
    report = ui.log(run_id, "report", tis[("report", -1)]["try_number"])
    assert any("FAILED: " + CUSTOMERS in e for e in events(report, "error")), events(report)
    assert any("Next step" in e for e in events(report, "error"))
    assert any(f"{ui.base}/cdc/docs/" in e for e in events(report))  # where the Data Docs are, as a link
    note = ui.wait_for(lambda: ui.api("GET", f"/dags/cdc_apply/dagRuns/{quote(run_id, safe='')}")["note"], what="the run note")
    assert note.startswith(f"FAILED: {CUSTOMERS}"), note

    needs_browser()
    page = ui.page(f"/dags/cdc_apply/runs/{quote(run_id, safe='')}/tasks/table.validate/mapped/0?try_number={validate['try_number']}")
    step = ui.wait_for(
        lambda: page.find_elements("xpath", "//*[contains(text(), 'Next step, one of')]"),
        timeout=90,
        what="the next step in the task's log in the UI",
    )
    page.execute_script("arguments[0].scrollIntoView({block: 'center'})", step[-1])
    time.sleep(1)
    ui.shot("failed-log-after")


def test_data_docs_open_from_the_ui_without_network(ui, failed_run, monkeypatch):
    from cdc_airflow.guidance import docs_url
    from cdc_apply.results import load_result

    monkeypatch.setenv("AIRFLOW__API__BASE_URL", ui.base)  # as the workers have it

    found = ui.api(
        "GET", f"/dags/cdc_apply/dagRuns/{quote(failed_run['dag_run_id'], safe='')}/taskInstances/discover/xcomEntries/return_value"
    )["value"]
    found = found if isinstance(found, dict) else json.loads(found)
    table = load_result(found["result_file"]).table(CUSTOMERS)
    url = docs_url(table.data_docs, ui.env["CDC_HOME"])
    assert url and url.startswith(f"{ui.base}/cdc/docs/")
    assert ui.raw(url.removeprefix(ui.base), token=False).status_code == 401  # row values: signed-in users only
    r = ui.raw(url.removeprefix(ui.base))
    assert r.ok and "bootstrapTable" in r.text
    assert not re.findall(r"<(?:script|link|img)\b[^>]*(?:src|href)=\"https?://", r.text)  # nothing from a CDN
    assert "default-src 'self'" in r.headers["content-security-policy"]

    needs_browser()
    page = ui.page(url.removeprefix(ui.base))
    # bootstrap-table (bundled) renders the validation list: it stays empty when a script it needs is missing
    # (the rows' HTML read in the page, in one script: bootstrap-table may re-render them between two calls)
    rows = ui.wait_for(
        lambda: page.execute_script(
            "return Array.from(document.querySelectorAll('.tab-pane.active table tbody tr[data-index]')).map(r => r.innerHTML)"
        ),
        what="the validation list",
    )
    assert "Failed" in rows[0] or page.find_elements("css selector", ".tab-pane.active .fa-times")
    assert not [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    origins = page.execute_script("return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)")
    assert set(origins) <= {ui.base}, origins
    ui.shot("data-docs-after")
    # a row opens its validation (clicked in the page: bootstrap-table may have re-rendered the rows meanwhile)
    page.execute_script("document.querySelector('.tab-pane.active table tbody tr[data-index] td:nth-child(2)').click()")
    ui.wait_for(
        lambda: "validations/" in page.current_url and "balance" in page.find_element("tag name", "body").text, what="the validation page"
    )
    assert set(page.execute_script("return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)")) <= {ui.base}
    ui.shot("data-docs-validation-after")


def test_a_configuration_error_fails_once_in_discover_and_nothing_else_fails(ui, failed_run):
    # a source that is not in include/sources.yaml is refused at the trigger (the form offers the list)
    import requests

    r = requests.post(
        f"{ui.base}/api/v2/dags/cdc_apply/dagRuns",
        json={"logical_date": None, "conf": {"source": "pg_inventroy"}},
        headers={"Authorization": f"Bearer {ui.sa.token}"},
        timeout=90,
    )
    assert r.status_code == 400 and "pg_inventroy" in r.text, r.text
    run_id = ui.trigger({"source": "pg_inventory", "override": "force"})  # no reason
    run = ui.wait(run_id, timeout=600)
    assert run["state"] == "failed"
    tis = ui.task_instances(run_id)
    discover = tis[("discover", -1)]
    assert (
        discover["state"] == "failed" and tried(ui, run_id, "discover", discover["try_number"], "configuration error") == 1
    )  # not retried
    assert tis[("finish", -1)]["state"] == "skipped"  # nothing to finish: says so, no TypeError
    assert sorted(k for k, t in tis.items() if t["state"] == "failed") == [("discover", -1), ("report", -1)]
    assert any(
        "no batch: discover did not run or failed" in e
        for e in events(ui.log(run_id, "report", tis[("report", -1)]["try_number"]), "error")
    )
    assert tis[("report", -1)]["try_number"] == 1
    log = "\n".join(events(ui.log(run_id, "discover", discover["try_number"]), "error"))
    assert "override='force' needs an override_reason" in log and "Next step" in log, log
    note = ui.wait_for(lambda: ui.api("GET", f"/dags/cdc_apply/dagRuns/{quote(run_id, safe='')}")["note"], what="the run note")
    assert note.startswith("FAILED in discover: configuration error"), note


def test_a_forced_run_is_marked_and_its_ids_and_logs_are_right(ui, failed_run):
    from cdc_apply.config import Settings
    from cdc_apply.ledger import Ledger

    run_id = ui.trigger({"source": "pg_inventory", "override": "force", "override_reason": REASON})
    run = ui.wait(run_id)
    assert run["state"] == "success", ui.task_instances(run_id)
    note = ui.wait_for(lambda: ui.api("GET", f"/dags/cdc_apply/dagRuns/{quote(run_id, safe='')}")["note"], what="the run note")
    assert re.fullmatch(rf"applied \d+ change\(s\) to 1 table\(s\) - forced publish: {re.escape(REASON)}", note), note

    snapshot = Ledger(Settings.from_env()).catalog.load_table("pg_inventory.customers").current_snapshot().snapshot_id
    assert snapshot > 2**53  # an id the browser's JSON would round
    events_ = ui.api("GET", "/assets/events?limit=10")["asset_events"]
    extra = [e for e in events_ if e["uri"] == "iceberg://lake/pg_inventory/customers"][-1]["extra"]
    assert extra["snapshot_id"] == str(snapshot), extra
    publish = ui.api(
        "GET", f"/dags/cdc_apply/dagRuns/{quote(run_id, safe='')}/taskInstances/table.publish/xcomEntries/return_value?map_index=0"
    )["value"]
    publish = publish if isinstance(publish, dict) else json.loads(publish)
    assert publish["snapshot_id"] == str(snapshot)

    tis = ui.task_instances(run_id)
    apply_log = ui.log(run_id, "apply", tis[("apply", -1)]["try_number"])
    text = "\n".join(events(apply_log))
    assert any("operator override FORCE" in e for e in events(apply_log, "warning")), [
        x for x in apply_log if "override" in str(x.get("event"))
    ]
    assert " INFO SparkContext" not in text and "[warning][cds]" not in text  # Spark start-up and JVM chatter off
    assert any(e.startswith("batch ") or "change(s)" in e for e in events(apply_log, "info"))  # the short summary
    assert len([e for e in text.splitlines() if e.startswith("{")]) <= 1  # the result JSON on one line
    validate_log = ui.log(run_id, "table.validate", tis[("table.validate", 0)]["try_number"], 0)
    noise = [e for e in events(validate_log) if " great_expectations" in e and " INFO " in e]
    assert not noise, noise[:5]
    assert len(validate_log) < 120, len(validate_log)


def test_the_trigger_form_submits_with_its_defaults_and_offers_the_sources(ui, failed_run):
    needs_browser()
    from selenium.webdriver.common.by import By

    details = ui.api("GET", "/dags/cdc_apply/details")
    params = details["params"]
    assert params["table_filter"]["value"] == ".*" and params["override_reason"]["value"] is None
    assert params["source"]["schema"]["enum"] == ["pg_inventory", "sqlserver_shop", "ces_shop", "qlik_shop", "crdb_movr"]

    page = ui.page("/dags/cdc_apply")
    ui.wait_for(lambda: page.find_element(By.CSS_SELECTOR, "button[aria-label='Trigger Dag']"), what="the Trigger button").click()
    dialog = ui.wait_for(
        lambda: next(d for d in page.find_elements(By.CSS_SELECTOR, "[role='dialog']") if "Run Parameters" in d.text),
        what="the trigger form",
    )
    submit = ui.wait_for(
        lambda: next(b for b in dialog.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Trigger"),
        what="the form's Trigger button",
    )
    assert submit.is_enabled(), "the form cannot be submitted with its defaults"
    assert "pg_inventory (debezium_postgres)" in dialog.text  # the source is a choice, shown with its format
    ui.shot("form-after")
    before = {r["dag_run_id"] for r in ui.api("GET", "/dags/cdc_apply/dagRuns?limit=100")["dag_runs"]}
    submit.click()
    new = ui.wait_for(
        lambda: [r for r in ui.api("GET", "/dags/cdc_apply/dagRuns?limit=100")["dag_runs"] if r["dag_run_id"] not in before],
        what="the triggered run",
    )
    run = ui.wait(new[0]["dag_run_id"], timeout=600)
    assert run["state"] == "success" and run["conf"]["table_filter"] == ".*" and run["conf"]["source"] == "pg_inventory"
    note = ui.wait_for(lambda: ui.api("GET", f"/dags/cdc_apply/dagRuns/{quote(run['dag_run_id'], safe='')}")["note"], what="the run note")
    assert note == "nothing to do: no pending files for pg_inventory", note


def test_the_status_page_shows_each_table(ui, failed_run):
    assert ui.raw("/cdc/status.json", token=False).status_code == 401
    rows = {r["table"]: r for r in ui.raw("/cdc/status.json").json()}
    c = rows[CUSTOMERS]
    assert (c["live_rows"], c["tombstones"], c["pending_files"]) == (5, 1, 0)
    assert (c["held_messages"], c["held_files"], c["held_files_gone"]) == (0, 0, [])  # the demo's source holds nothing
    assert c["last_status"] == "forced" and c["last_batch"] and c["last_position"]
    assert c["last_failure"]["failed_expectations"][0].startswith("expect_column_values_to_be_between")
    assert isinstance(c["snapshot_id"], str)
    plugins = ui.api("GET", "/plugins")["plugins"]
    views = [v["name"] for p in plugins for v in p["external_views"]]
    assert "CDC tables" in views and "CDC Data Docs" in views  # in the UI's navigation

    needs_browser()
    page = ui.page("/cdc/status")
    row = ui.wait_for(lambda: page.find_element("css selector", f"tr[data-table='{CUSTOMERS}']"), what="the customers row")
    cells = [td.text for td in row.find_elements("tag name", "td")]
    assert cells[0] == CUSTOMERS and cells[7] == "0" and cells[8] == "5" and cells[9] == "1", cells
    assert "expect_column_values_to_be_between" in cells[11], cells
    ui.shot("status-after")
    page = ui.page("/plugin/cdc-status")  # the same page inside the Airflow UI (nav: CDC tables)
    ui.wait_for(lambda: page.find_elements("tag name", "iframe"), what="the embedded status page")
    time.sleep(2)
    ui.shot("status-in-ui-after")
