"""What an operator reads first: short run summaries, the next step after a
failure (with the exact trigger-form values and CLI command), and where a
batch's Data Docs are in the Airflow UI.  Pure text functions over the
batch result's JSON, shared by the tasks' logs, their failure messages and
the run note (notes.py), so all three say the same thing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DAG_ID = "cdc_apply"
DOCS_PREFIX = "/cdc/docs"
"""where plugin.py mounts the Data Docs (ui.py)"""


def api_base_url() -> str:
    """The api-server's public address (``[api] base_url``), without a trailing slash."""
    url = os.environ.get("AIRFLOW__API__BASE_URL")
    if url is None:
        try:
            from airflow.configuration import conf

            url = conf.get("api", "base_url", fallback="")
        except Exception:  # no Airflow configuration here (the CLI)
            url = ""
    return (url or "").rstrip("/")


def docs_url(data_docs: str | None, home: str | Path | None = None) -> str | None:
    """``$CDC_HOME/data_docs/<batch>/<table>/gx/.../index.html`` -> its page in the UI."""
    if not data_docs:
        return None
    home = Path(home or os.environ.get("CDC_HOME") or ".").resolve()
    try:
        rel = Path(data_docs).resolve().relative_to(home / "data_docs")
    except ValueError:
        return None
    batch, table = rel.parts[0], rel.parts[1]
    return f"{api_base_url()}{DOCS_PREFIX}/{batch}/{table}/"


def changes(counts: dict[str, Any] | None) -> int:
    """Row changes a table's batch made: inserted + updated + deleted + filled
    (compact.accounting's buckets; superseded and no-op events change no row)."""
    counts = counts or {}
    return sum(int(counts.get(k) or 0) for k in ("inserted", "updated", "deleted", "filled"))


def trigger_conf(source: str, **extra: str) -> str:
    return json.dumps({"source": source, **extra})


def transient(result: dict[str, Any]) -> bool:
    """A failed batch whose failed tables all failed for a reason a retry
    fixes (a lost commit race, a catalog briefly away): no person decides."""
    failed = [t for t in result.get("tables") or [] if t.get("status") == "failed"]
    return bool(failed) and not any(t.get("terminal", True) for t in failed)


def retry_steps(source: str) -> str:
    """The way on after a transient failure."""
    return (
        f"Next step: none needed: the next hourly run (or a trigger of {DAG_ID} with {trigger_conf(source)}) "
        "applies the same files again from a fresh branch, exactly once"
    )


def next_steps(source: str, batch_id: str | None = None) -> str:
    """The three ways on after a failed gate, as form values and CLI commands."""
    reason = "<why: recorded in the ledger>"
    return "\n".join(
        [
            "Next step, one of:",
            f"  1. fix and re-run: fix the data upstream (a new archive file) or the suite in include/expectations/, then trigger {DAG_ID} "
            f"with {trigger_conf(source)} (or wait for the next hourly run); the same files are applied again from a fresh branch",
            f"  2. force: publish despite the failed checks: trigger {DAG_ID} with {trigger_conf(source, override='force', override_reason=reason)}"
            f' | CLI: ./dev cdc apply --source {source} --override force --override-reason "..."',
            f"  3. skip: never apply the pending files, mark them applied: trigger {DAG_ID} with {trigger_conf(source, override='skip', override_reason=reason)}"
            f' | CLI: ./dev cdc apply --source {source} --override skip --override-reason "..."',
        ]
        + (
            [
                f"  batch {batch_id}: SELECT table_name, status, failed_expectations, message FROM lake.cdc_audit.batches WHERE batch_id = '{batch_id}'"
            ]
            if batch_id
            else []
        )
    )


def config_steps(message: str) -> str:
    return f"configuration error (not retried): {message}\nNext step: fix the value (trigger form / --conf, include/sources.yaml or the CDC_* environment) and trigger {DAG_ID} again."


def table_line(t: dict[str, Any]) -> str:
    counts = t.get("counts") or {}
    shown = ", ".join(f"{k} {v}" for k, v in counts.items() if v and k != "keys")
    parts = [f"{t.get('table')}: {t.get('status')}", f"{changes(counts)} change(s)" + (f" ({shown})" if shown else "")]
    if t.get("snapshot_id"):
        parts.append(f"snapshot {t['snapshot_id']}")
    url = docs_url(t.get("data_docs"))
    if url:
        parts.append(f"Data Docs {url}")
    return "; ".join(parts)


def summary(result: dict[str, Any]) -> str:
    """A batch result in one line per table, the headline first."""
    lines = [headline(result)] + [table_line(t) for t in result.get("tables") or []]
    return "\n".join(lines)


def headline(result: dict[str, Any] | None) -> str:
    """One line: what the run did (the run note)."""
    if not result:
        return "no batch: see the failed task's log"
    status = result.get("status")
    tables = result.get("tables") or []
    override = result.get("override") or {}
    if status == "nothing-to-do":
        return f"nothing to do: no pending files for {result.get('source')}"
    if status == "skipped":
        return f"skipped {len(result.get('files') or [])} file(s) of {result.get('source')}: {override.get('reason', '')}".rstrip(": ")
    if status == "dry-run":
        return f"dry run: {sum((result.get('messages') or {}).values())} message(s) decoded, nothing written"
    applied = [t for t in tables if t.get("status") in ("published", "skipped")]
    n = sum(changes(t.get("counts")) for t in applied)
    if status == "failed":
        failed = [t for t in tables if t.get("status") == "failed"]
        head = f"FAILED: {', '.join(t.get('table') for t in failed) or 'the batch'}"
        if applied:
            head += f"; applied {n} change(s) to {len(applied)} other table(s)"
        if not failed:
            return head + f" - {(result.get('message') or '')[:300]}"
        if transient(result):
            why = next((t.get("message") for t in failed if t.get("message")), "") or ""
            return head + f" (transient, nothing to decide: the next run applies these files again) - {why[:300]}"
        return head + " (gate failed: fix and re-run, or force / skip with a reason)"
    written = [t for t in tables if t.get("status") in ("written", "validated")]
    if written and not applied:  # the write stage's result: nothing is published yet
        return f"wrote {sum(changes(t.get('counts')) for t in written)} change(s) to {len(written)} table(s) on their audit branches (published after the gate)"
    head = f"applied {n} change(s) to {len(applied)} table(s)"
    forced = [t for t in tables if t.get("override")]
    if forced or override.get("action") == "force":
        head += f" - forced publish: {override.get('reason') or forced[0].get('override')}"
    return head
