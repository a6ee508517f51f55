"""The DAG's Python tasks (the Spark work is in the submitted job).

Which files a DAG run applies:

* scheduled / backfill run: every not-yet-applied file whose hour is before
  the run's data-interval end (a late file is taken by the next run);
* manual trigger (no data interval): every not-yet-applied file.

The choice is written to a JSON file that the Spark job reads
(``--files-from``), so the job applies exactly what discovery saw.  After the
write stage, the gate runs per table (validate, publish); ``finish`` records
the attempt in the ledger whatever happened.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any


def take_turn(source: str, dag_id: str, run_id: str, ti: Any = None) -> Any:
    """The ``turn`` sensor's poke: done once this run holds the source's lease
    (cdc_airflow/lease.py); until then it says which run it waits for (in its
    log, and in XCom ``waiting_for`` for the run note if the wait times out)."""
    import logging

    from airflow.sdk import PokeReturnValue
    from airflow.sdk.exceptions import AirflowFailException

    from cdc_airflow.guidance import config_steps
    from cdc_airflow.lease import Holder, airflow_run_alive, take
    from cdc_apply.config import Settings, get_source
    from cdc_apply.errors import TerminalError

    settings = Settings.from_env()
    try:
        get_source(settings, source)  # a wrong source fails here, once, before it names a lease file
    except TerminalError as exc:
        raise AirflowFailException(config_steps(str(exc))) from None
    holder = take(settings.home, source, Holder(dag_id, run_id), airflow_run_alive)
    if holder is not None:
        logging.getLogger("cdc_apply.turn").info("source %s is being applied by %s: waiting for it to finish", source, holder.describe())
        if ti is not None:
            ti.xcom_push(key="waiting_for", value=holder.describe())
    return PokeReturnValue(is_done=holder is None)


def release_turn(source: str, dag_id: str, run_id: str) -> None:
    """Give the source's lease back (the run's last task, whatever happened)."""
    from cdc_airflow.lease import Holder, release
    from cdc_apply.config import Settings

    release(Settings.from_env().home, source, Holder(dag_id, run_id))


def discover(
    source: str,
    data_interval_end: dt.datetime | None,
    run_id: str,
    max_files: int | None = None,
    *,
    table_filter: str | None = "",
    dry_run: bool = False,
    override: str = "none",
    override_reason: str | None = "",
    operator: str | None = None,
) -> dict[str, Any]:
    """Raises AirflowFailException (no retry) on a configuration error: a
    wrong source, a bad table filter, an override without a reason."""
    from airflow.sdk.exceptions import AirflowFailException

    from cdc_airflow.guidance import config_steps
    from cdc_apply.errors import TerminalError

    try:
        return _discover(
            source,
            data_interval_end,
            run_id,
            max_files,
            table_filter=table_filter,
            dry_run=dry_run,
            override=override,
            override_reason=override_reason,
            operator=operator,
        )
    except TerminalError as exc:
        import logging

        logging.getLogger("cdc_apply.discover").error("%s", config_steps(str(exc)))
        raise AirflowFailException(config_steps(str(exc))) from None


def _discover(
    source, data_interval_end, run_id, max_files, *, table_filter, dry_run, override, override_reason, operator
) -> dict[str, Any]:
    import re

    from cdc_apply.archive.files import write_manifest
    from cdc_apply.batch import batch_id_for, held_files_gone_while_quiet, held_gone_batch_id, pending_files
    from cdc_apply.config import Settings, get_source
    from cdc_apply.errors import ConfigError
    from cdc_apply.results import Override

    settings = Settings.from_env()
    src = get_source(settings, source)
    if override not in (None, "", "none") and not (override_reason or "").strip():
        raise ConfigError(
            f"override={override!r} needs an override_reason (why; it goes to the ledger): set it in the trigger form or --conf"
        )
    chosen = Override.parse(override, override_reason, operator)  # fails here, before any Spark, without a reason
    table_filter = "" if (table_filter or "").strip() in ("", ".*") else table_filter.strip()
    try:
        re.compile(table_filter)
    except re.error as exc:
        raise ConfigError(f"table_filter {table_filter!r} is not a regular expression: {exc}") from None
    files = pending_files(settings, src, until=data_interval_end)
    if max_files:
        files = files[:max_files]
    # nothing new, but held messages whose file left the archive: the batch runs, to fail naming them (or be forced)
    gone = {} if files else held_files_gone_while_quiet(settings, src)[1]
    safe_run = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_id)
    out = settings.home / "runs" / safe_run
    manifest = write_manifest(out / "files.json", files)
    result_file = str(out / "result.json")
    write_args = ["apply", "--stage", "write+validate", "--source", source, "--files-from", str(manifest), "--result-file", result_file]
    if table_filter:
        write_args.append(f"--table-filter={table_filter}")
    if dry_run:
        write_args.append("--dry-run")
    if chosen is not None:
        write_args += ["--override", chosen.action, "--override-reason", chosen.reason, "--override-operator", chosen.operator]
    return {
        "source": source,
        "files": len(files),
        "held_files_gone": sorted(gone),
        "pending": len(files) or len(gone),  # 0: the apply task records nothing to do without starting a job
        "bytes": sum(f.size for f in files),
        "manifest": str(manifest),
        "result_file": result_file,
        "write_args": write_args,
        "batch_id": batch_id_for(source, files) if files else (held_gone_batch_id(source, gone) if gone else None),
        "until": data_interval_end.isoformat() if data_interval_end else None,
    }


def written_tables(result_file: str) -> list[str]:
    """The tables the write stage left on audit branches, and those whose
    gate it ran (each validate task reports its table's verdict): the
    gate's fan-out."""
    from cdc_apply.results import load_result

    if not Path(result_file).exists():
        return []
    return [t.table for t in load_result(result_file).tables if t.status == "written" or t.gate]


def publish_table(result_file: str, table: str, outlet_events=None) -> dict[str, Any]:
    """Fast-forward main of one validated table; emit its Asset."""
    import logging

    from airflow.sdk.exceptions import AirflowFailException

    from cdc_airflow.assets import TABLES_ALIAS, table_asset
    from cdc_apply.apply.transactions import GatePending
    from cdc_apply.batch import publish_batch
    from cdc_apply.config import Settings
    from cdc_apply.results import load_result, save_table_result

    settings = Settings.from_env()
    result = load_result(result_file)
    try:
        publish_batch(settings, result, table=table)
    except GatePending as exc:  # a table it shares source transactions with is still at its gate: look again soon
        import datetime as dt

        from airflow.sdk.exceptions import AirflowRescheduleException

        logging.getLogger("cdc_apply.publish").info("%s", exc)
        raise AirflowRescheduleException(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=15)) from None
    tr = result.table(table)
    save_table_result(result_file, tr)
    if tr.status == "failed":
        if tr.terminal:
            raise AirflowFailException(f"{table}: {tr.message}")
        raise RuntimeError(f"{table}: {tr.message}")
    if tr.status == "published" and outlet_events is not None:
        outlet_events[TABLES_ALIAS].add(
            table_asset(settings.catalog_name, table),
            extra={"batch_id": result.batch_id, "snapshot_id": _id(tr.snapshot_id), "counts": tr.counts, "override": tr.override},
        )
    return {"table": table, "status": tr.status, "snapshot_id": _id(tr.snapshot_id), "counts": tr.counts}


def _id(value: int | None) -> str | None:
    """A 64-bit Iceberg id as a string: the UI's JSON would round it to another number."""
    return None if value is None else str(value)


def finish(result_file: str | None) -> dict[str, Any]:
    """Record the attempt (every table and the batch) in the ledger; fail the
    task when the batch failed, without retry (retrying this task cannot help:
    the next run picks the files up again).  Skipped when discover failed:
    no batch was started, so there is nothing to record."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from cdc_airflow.guidance import headline, next_steps, retry_steps, transient
    from cdc_apply.batch import finish_batch
    from cdc_apply.config import Settings
    from cdc_apply.results import load_result, save_result

    if result_file is None:
        raise AirflowSkipException("nothing to finish: discover failed before a batch started (its log says why)")
    if not Path(result_file).exists():
        raise AirflowFailException(f"no result at {result_file}: the apply task did not write one (see its log)")
    result = finish_batch(Settings.from_env(), load_result(result_file))
    save_result(result_file, result)
    summary = {
        "batch_id": result.batch_id,
        "status": result.status,
        "messages": result.messages,
        "message": result.message,
        "override": result.override,
        "tables": [
            {
                "table": t.table,
                "status": t.status,
                "counts": t.counts,
                "snapshot_id": _id(t.snapshot_id),
                "data_docs": t.data_docs,
                "override": t.override,
                "terminal": t.terminal,
                "message": t.message,
            }
            for t in result.tables
        ],
    }
    if result.status == "failed":
        import logging

        steps = retry_steps(result.source) if transient(summary) else next_steps(result.source, result.batch_id)
        text = f"{headline(summary)}\nbatch {result.batch_id}: {result.message}\n{steps}"
        logging.getLogger("cdc_apply.finish").error("%s", text)
        raise AirflowFailException(text)
    return summary


def report(found: dict[str, Any] | None) -> None:
    """What the run did, in a few lines at their level: the batch's headline,
    one line per table (changes, snapshot, Data Docs), and on a failure the
    next step.  Runs whatever happened upstream (its trigger rule), so a
    failed run is summarised too; it then fails as well (the last task
    decides the run's state), saying so."""
    import json
    import logging

    from airflow.sdk.exceptions import AirflowFailException

    from cdc_airflow.guidance import headline, next_steps, retry_steps, summary, transient

    log = logging.getLogger("cdc_apply.report")
    if not found:
        log.error(
            "no batch: discover did not run or failed (a configuration error, or waiting for the source's turn timed out; the failed task's log says which)"
        )
        raise AirflowFailException("the run failed before discover chose a batch: no batch was started")
    log.info(
        "discovered %s file(s) (%s bytes) for source %s until %s", found["files"], found["bytes"], found["source"], found["until"] or "now"
    )
    path = Path(found["result_file"])
    if not path.exists():
        log.error("no batch result at %s: the apply task did not write one (see its log)", path)
        raise AirflowFailException("the run failed before the batch wrote its result (see the apply task)")
    from cdc_apply.results import load_result

    folded = json.loads(load_result(path).to_json())  # the per-table stages folded in
    if any(t.get("status") == "failed" for t in folded.get("tables", [])) or folded.get("status") == "failed":
        folded["status"] = "failed"
        log.error("%s", summary(folded))
        log.error("%s", retry_steps(found["source"]) if transient(folded) else next_steps(found["source"], folded.get("batch_id")))
        raise AirflowFailException(f"{headline(folded)} (summary and next step above)")
    log.info("%s", summary(folded))
