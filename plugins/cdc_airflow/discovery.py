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


def discover(
    source: str,
    data_interval_end: dt.datetime | None,
    run_id: str,
    max_files: int | None = None,
    *,
    table_filter: str = "",
    dry_run: bool = False,
    override: str = "none",
    override_reason: str = "",
    operator: str | None = None,
) -> dict[str, Any]:
    from cdc_apply.archive.files import write_manifest
    from cdc_apply.batch import batch_id_for, pending_files
    from cdc_apply.config import Settings, get_source
    from cdc_apply.results import Override

    settings = Settings.from_env()
    src = get_source(settings, source)
    chosen = Override.parse(override, override_reason, operator)  # fails here, before any Spark, without a reason
    files = pending_files(settings, src, until=data_interval_end)
    if max_files:
        files = files[:max_files]
    safe_run = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_id)
    out = settings.home / "runs" / safe_run
    manifest = write_manifest(out / "files.json", files)
    result_file = str(out / "result.json")
    write_args = ["apply", "--stage", "write", "--source", source, "--files-from", str(manifest), "--result-file", result_file]
    if table_filter:
        write_args.append(f"--table-filter={table_filter}")
    if dry_run:
        write_args.append("--dry-run")
    if chosen is not None:
        write_args += ["--override", chosen.action, "--override-reason", chosen.reason, "--override-operator", chosen.operator]
    return {
        "source": source,
        "files": len(files),
        "bytes": sum(f.size for f in files),
        "manifest": str(manifest),
        "result_file": result_file,
        "write_args": write_args,
        "batch_id": batch_id_for(source, files) if files else None,
        "until": data_interval_end.isoformat() if data_interval_end else None,
    }


def written_tables(result_file: str) -> list[str]:
    """The tables the write stage left on audit branches: the gate's fan-out."""
    from cdc_apply.results import load_result

    if not Path(result_file).exists():
        return []
    return [t.table for t in load_result(result_file).tables if t.status == "written"]


def publish_table(result_file: str, table: str, outlet_events=None) -> dict[str, Any]:
    """Fast-forward main of one validated table; emit its Asset."""
    from airflow.sdk.exceptions import AirflowFailException

    from cdc_airflow.assets import TABLES_ALIAS, table_asset
    from cdc_apply.batch import publish_batch
    from cdc_apply.config import Settings
    from cdc_apply.results import load_result, save_table_result

    settings = Settings.from_env()
    result = load_result(result_file)
    publish_batch(settings, result, table=table)
    tr = result.table(table)
    save_table_result(result_file, tr)
    if tr.status == "failed":
        if tr.terminal:
            raise AirflowFailException(f"{table}: {tr.message}")
        raise RuntimeError(f"{table}: {tr.message}")
    if tr.status == "published" and outlet_events is not None:
        outlet_events[TABLES_ALIAS].add(
            table_asset(settings.catalog_name, table),
            extra={"batch_id": result.batch_id, "snapshot_id": tr.snapshot_id, "counts": tr.counts, "override": tr.override},
        )
    return {"table": table, "status": tr.status, "snapshot_id": tr.snapshot_id, "counts": tr.counts}


def finish(result_file: str) -> dict[str, Any]:
    """Record the attempt (every table and the batch) in the ledger; fail the
    task when the batch failed, without retry (retrying this task cannot help:
    the next run picks the files up again)."""
    from airflow.sdk.exceptions import AirflowFailException

    from cdc_apply.batch import finish_batch
    from cdc_apply.config import Settings
    from cdc_apply.results import load_result, save_result

    if not Path(result_file).exists():
        raise AirflowFailException(f"no result at {result_file}: the apply task did not write one (see its log)")
    result = finish_batch(Settings.from_env(), load_result(result_file))
    save_result(result_file, result)
    summary = {
        "batch_id": result.batch_id,
        "status": result.status,
        "messages": result.messages,
        "message": result.message,
        "tables": [{"table": t.table, "status": t.status, "counts": t.counts, "snapshot_id": t.snapshot_id, "data_docs": t.data_docs} for t in result.tables],
    }
    if result.status == "failed":
        raise AirflowFailException(f"batch {result.batch_id} failed: {result.message}")
    return summary


def report(found: dict[str, Any], finished: dict[str, Any]) -> None:
    import logging

    log = logging.getLogger("cdc_apply.report")
    log.info("discovered %s file(s) (%s bytes) for source %s until %s", found["files"], found["bytes"], found["source"], found["until"])
    log.info("batch %s: %s; messages %s; %s", finished.get("batch_id"), finished.get("status"), finished.get("messages"), finished.get("message") or "")
    for t in finished.get("tables", []):
        log.info("table %s: %s counts=%s snapshot=%s data_docs=%s", t["table"], t["status"], t["counts"], t["snapshot_id"], t["data_docs"])
