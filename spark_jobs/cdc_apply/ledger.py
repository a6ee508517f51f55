"""What "applied" means — the one reader/writer of the batch ledger.

* Per table, the ledger is the Iceberg **snapshot summary** written by the same
  commit as the data (``cdc.*`` properties on every commit of a batch on the
  audit branch, published by fast-forward).  A table's applied files are the
  union of ``cdc.files`` over the ancestry of ``main``: the job uses this for
  its exactly-once check, so a re-run of a batch changes nothing.
* Per source, a batch is *complete* once every table it touched is published;
  a row in ``<audit namespace>.batches`` with ``table_name = '*'`` and
  ``status = 'complete'`` records it.  File discovery (the DAG, the CLI) reads
  those rows.  If the job dies between a table's publish and that row, the
  files are offered again and every table skips them through its own summary.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from cdc_apply.config import Settings
from cdc_apply.status import Status

PREFIX = "cdc."
BATCHES_TABLE = "batches"
QUARANTINE_TABLE = "quarantine"
# batch rows (table_name '*') whose files count as applied: 'skipped' is an
# operator's explicit decision to never apply them (see results.Override)
APPLIED_STATUSES = (Status.COMPLETE, Status.SKIPPED)
AUDIT_BRANCH_PREFIX = "audit_"


def audit_branch(batch_id: str) -> str:
    """The branch a batch writes to before the gate: ``audit_<batch id>``."""
    return f"{AUDIT_BRANCH_PREFIX}{batch_id}"

@dataclass
class TableLedger:
    files: dict[str, str] = field(default_factory=dict)  # path -> sha256
    batches: list[str] = field(default_factory=list)  # oldest first
    truncated_at: str | None = None
    last_position: str | None = None
    last_batch: str | None = None
    last_applied_at: str | None = None
    snapshot_id: int | None = None


def summary_properties(batch_id: str, files: Iterable[dict], *, position_max: str | None, truncated_at: str | None, counts: dict[str, int]) -> dict[str, str]:
    props = {
        "batch-id": batch_id,
        "files": json.dumps([{"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in files], separators=(",", ":")),
        "counts": json.dumps(counts, sort_keys=True, separators=(",", ":")),
        "applied-at": dt.datetime.now(dt.timezone.utc).isoformat(),
    }
    if position_max is not None:
        props["position-max"] = position_max
    if truncated_at is not None:
        props["truncated-at"] = truncated_at
    return {PREFIX + k: v for k, v in props.items()}


def ledger_from_summaries(summaries: list[dict[str, str]]) -> TableLedger:
    """Fold the summaries of main's ancestry (oldest first) into a TableLedger."""
    led = TableLedger()
    for s in summaries:
        batch = s.get(PREFIX + "batch-id")
        if not batch:
            continue
        for f in json.loads(s.get(PREFIX + "files", "[]")):
            led.files[f["path"]] = f["sha256"]
        if not led.batches or led.batches[-1] != batch:
            led.batches.append(batch)
        led.last_batch = batch
        led.last_applied_at = s.get(PREFIX + "applied-at", led.last_applied_at)
        pos = s.get(PREFIX + "position-max")
        if pos is not None and (led.last_position is None or pos > led.last_position):
            led.last_position = pos
        t = s.get(PREFIX + "truncated-at")
        if t is not None and (led.truncated_at is None or t > led.truncated_at):
            led.truncated_at = t
    return led


# -- pyiceberg side: light reads for discovery, status and the job -------------


def load_catalog(settings: Settings):
    from pyiceberg.catalog import load_catalog as _load

    if settings.sqlite_path is not None:
        settings.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
    return _load(settings.catalog_name, **settings.pyiceberg_properties())


def _summary_dict(snapshot) -> dict[str, str]:
    summary = snapshot.summary
    if summary is None:
        return {}
    out = dict(summary.additional_properties)
    return out


def read_table_ledger(settings: Settings, identifier: str, catalog=None) -> TableLedger | None:
    """The ledger of ``namespace.table`` on main; None when the table does not exist."""
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.table.snapshots import ancestors_of

    catalog = catalog or load_catalog(settings)
    try:
        table = catalog.load_table(identifier)
    except NoSuchTableError:
        return None
    current = table.current_snapshot()
    if current is None:
        return TableLedger()
    chain = list(ancestors_of(current, table.metadata))
    led = ledger_from_summaries([_summary_dict(s) for s in reversed(chain)])
    led.snapshot_id = current.snapshot_id
    return led


def applied_files(settings: Settings, source: str, catalog=None) -> dict[str, str]:
    """Files of the source's complete batches: path -> sha256."""
    return sha256_by_path(applied_file_records(settings, source, catalog))


def sha256_by_path(records: dict[str, tuple[int, str]]) -> dict[str, str]:
    """path -> sha256 of ``applied_file_records``' path -> (size, sha256)."""
    return {path: sha for path, (_, sha) in records.items()}


def applied_file_records(settings: Settings, source: str, catalog=None) -> dict[str, tuple[int, str]]:
    """Files of the source's complete batches: path -> (size, sha256)."""
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.expressions import And, EqualTo, In

    catalog = catalog or load_catalog(settings)
    try:
        table = catalog.load_table(f"{settings.audit_namespace}.{BATCHES_TABLE}")
    except NoSuchTableError:
        return {}
    rows = table.scan(
        row_filter=And(EqualTo("source", source), And(EqualTo("table_name", "*"), In("status", APPLIED_STATUSES))),
        selected_fields=("files",),
    ).to_arrow().to_pylist()
    out: dict[str, tuple[int, str]] = {}
    for r in rows:
        for f in r["files"] or []:
            out[f["path"]] = (f["size"], f["sha256"])
    return out


def latest_decoder_state(settings: Settings, source: str, catalog=None) -> dict[str, Any]:
    rows = [r for r in batch_rows(settings, source, catalog) if r["table_name"] == "*" and r["status"] == Status.COMPLETE and r["decoder_state"]]
    return json.loads(rows[-1]["decoder_state"]) if rows else {}


def batch_rows(settings: Settings, source: str | None = None, catalog=None) -> list[dict[str, Any]]:
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.expressions import AlwaysTrue, EqualTo

    catalog = catalog or load_catalog(settings)
    try:
        table = catalog.load_table(f"{settings.audit_namespace}.{BATCHES_TABLE}")
    except NoSuchTableError:
        return []
    flt = EqualTo("source", source) if source else AlwaysTrue()
    return sorted(table.scan(row_filter=flt).to_arrow().to_pylist(), key=lambda r: (r["started_at"] or dt.datetime.min, r["table_name"]))


# -- writes (pyiceberg: the publish stage needs no Spark) ------------------------

def _arrow_schemas():
    import pyarrow as pa

    files = pa.list_(pa.struct([("path", pa.string()), ("size", pa.int64()), ("sha256", pa.string())]))
    ts = pa.timestamp("us", tz="UTC")
    batches = pa.schema(
        [
            ("batch_id", pa.string()), ("source", pa.string()), ("table_name", pa.string()), ("status", pa.string()),
            ("files", files), ("position_min", pa.string()), ("position_max", pa.string()),
            ("counts", pa.map_(pa.string(), pa.int64())), ("failed_expectations", pa.list_(pa.string())),
            ("branch", pa.string()), ("snapshot_id", pa.int64()), ("message", pa.string()), ("data_docs", pa.string()),
            ("decoder_state", pa.string()), ("started_at", ts), ("ended_at", ts),
        ]
    )
    quarantine = pa.schema(
        [("batch_id", pa.string()), ("source", pa.string()), ("file", pa.string()), ("line", pa.int64()),
         ("reason", pa.string()), ("raw", pa.string()), ("recorded_at", ts)]
    )
    return batches, quarantine


def ensure_audit_tables(settings: Settings, catalog=None) -> None:
    catalog = catalog or load_catalog(settings)
    batches, quarantine = _arrow_schemas()
    catalog.create_namespace_if_not_exists(settings.audit_namespace)
    catalog.create_table_if_not_exists(f"{settings.audit_namespace}.{BATCHES_TABLE}", schema=batches, properties={"format-version": "2"})
    catalog.create_table_if_not_exists(f"{settings.audit_namespace}.{QUARANTINE_TABLE}", schema=quarantine, properties={"format-version": "2"})


def record_batch(settings: Settings, result) -> None:
    """One ledger row per table attempt, plus the batch row (``table_name='*'``):
    'complete' marks the batch's files applied for discovery."""
    import pyarrow as pa

    catalog = load_catalog(settings)
    ensure_audit_tables(settings, catalog)
    now = dt.datetime.now(dt.timezone.utc)
    started = dt.datetime.fromisoformat(result.started_at) if result.started_at else now
    status = result.status if result.status in APPLIED_STATUSES else Status.FAILED
    if _already_recorded(catalog, settings, result.batch_id, started, status):
        import logging

        logging.getLogger(__name__).info("batch %s: already recorded (a retried finish): nothing appended", result.batch_id)
        return
    rows = []
    for t in result.tables:
        rows.append(
            {
                "batch_id": result.batch_id, "source": result.source, "table_name": t.table,
                "status": Status.FORCED if (t.override and t.status == Status.PUBLISHED) else t.status,
                "files": result.files, "position_min": t.position_min, "position_max": t.position_max,
                "counts": list((t.counts or {}).items()), "failed_expectations": t.failed_expectations,
                "branch": t.branch, "snapshot_id": t.snapshot_id, "message": t.override or t.message, "data_docs": t.data_docs,
                "decoder_state": None, "started_at": started, "ended_at": now,
            }
        )
    held = set(result.held_files)
    rows.append(
        {
            "batch_id": result.batch_id, "source": result.source, "table_name": "*", "status": status,
            "files": [f for f in result.files if f["path"] not in held], "position_min": None, "position_max": None,
            "counts": list((result.messages or {}).items()), "failed_expectations": list(result.failed_checks),
            "branch": None, "snapshot_id": None, "message": result.message, "data_docs": None,
            "decoder_state": json.dumps(result.source_state) if status == Status.COMPLETE else None, "started_at": started, "ended_at": now,
        }
    )
    batches, _ = _arrow_schemas()
    _append(catalog, f"{settings.audit_namespace}.{BATCHES_TABLE}", pa.Table.from_pylist(rows, schema=batches))


def _already_recorded(catalog, settings: Settings, batch_id: str | None, started: dt.datetime, status: str) -> bool:
    """Whether the batch is recorded complete (or skipped) already, or this
    very attempt (same start) was recorded with this status: ``finish`` run
    again (an Airflow retry after a kill) appends nothing, while a finish
    that completes an attempt recorded failed before still records it."""
    from pyiceberg.expressions import And, EqualTo

    table = catalog.load_table(f"{settings.audit_namespace}.{BATCHES_TABLE}")
    rows = table.scan(row_filter=And(EqualTo("batch_id", batch_id or ""), EqualTo("table_name", "*")), selected_fields=("status", "started_at")).to_arrow().to_pylist()
    return any(r["status"] in APPLIED_STATUSES or (r["started_at"] == started and r["status"] == status) for r in rows)


def recorded_statuses(catalog, settings: Settings, batch_id: str | None) -> set[str]:
    """The statuses the batch rows (``table_name = '*'``) of ``batch_id`` hold."""
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.expressions import And, EqualTo

    try:
        table = catalog.load_table(f"{settings.audit_namespace}.{BATCHES_TABLE}")
    except NoSuchTableError:
        return set()
    rows = table.scan(row_filter=And(EqualTo("batch_id", batch_id or ""), EqualTo("table_name", "*")), selected_fields=("status",)).to_arrow()
    return set(rows.column("status").to_pylist())


def published_tables(settings: Settings, namespace: str, batch_id: str, catalog=None) -> list[str]:
    """The tables of ``namespace`` whose main holds ``batch_id``: an operator's
    skip of a batch a run has published (in part) is refused."""
    catalog = catalog or load_catalog(settings)
    try:
        idents = [".".join(t) for t in catalog.list_tables(namespace)]
    except Exception:  # no such namespace: nothing written yet
        return []
    return [ident for ident in idents if published_snapshot(catalog, ident, batch_id) is not None]


def published_snapshot(catalog, identifier: str, batch_id: str) -> int | None:
    """The newest snapshot of main's ancestry written by ``batch_id`` (its
    ``cdc.batch-id``), None when main does not hold the batch: how a retried
    publish or finish recognises its own completed fast-forward."""
    from pyiceberg.table.snapshots import ancestors_of

    table = catalog.load_table(identifier)
    current = table.current_snapshot()
    if current is None:
        return None
    for snap in ancestors_of(current, table.metadata):
        if _summary_dict(snap).get(PREFIX + "batch-id") == batch_id:
            return snap.snapshot_id
    return None


def _append(catalog, identifier: str, data, attempts: int = 5) -> None:
    """Append, on a freshly loaded table each try: a commit that lost the race
    (e.g. to the maintenance's compaction of the audit tables) was not made."""
    import time

    from pyiceberg.exceptions import CommitFailedException

    for attempt in range(1, attempts + 1):
        try:
            catalog.load_table(identifier).append(data)
            return
        except CommitFailedException:
            if attempt == attempts:
                raise
            time.sleep(0.2 * attempt)


def fast_forward(catalog, identifier: str, branch: str, expected_head: int | None = None) -> int:
    """Move main to the head of ``branch`` if main is its ancestor, drop the
    branch and the audit branches earlier failed attempts left behind (this
    batch re-applied their files); one atomic catalog commit.  Returns main's
    new snapshot id."""
    import logging

    from pyiceberg.table.snapshots import ancestors_of

    from cdc_apply.errors import CdcError

    table = catalog.load_table(identifier)
    ref = table.metadata.refs.get(branch)
    if ref is None:
        done = published_snapshot(catalog, identifier, branch.removeprefix(AUDIT_BRANCH_PREFIX))
        if done is not None:  # an earlier attempt fast-forwarded and died before saving its result
            logging.getLogger(__name__).warning("%s: batch of branch %r is already on main (snapshot %s): published by an earlier attempt", identifier, branch, done)
            return done
        raise CdcError(f"{identifier}: audit branch {branch!r} does not exist (already published, or never written)")
    if expected_head is not None and ref.snapshot_id != expected_head:
        raise CdcError(
            f"ConcurrentApply: another run is applying batch {branch.removeprefix(AUDIT_BRANCH_PREFIX)} to {identifier} at the same time "
            f"(branch {branch!r} moved from this run's snapshot {expected_head} to {ref.snapshot_id}); retry"
        )
    head = table.snapshot_by_id(ref.snapshot_id)
    main = table.current_snapshot()
    if main is not None and main.snapshot_id not in {s.snapshot_id for s in ancestors_of(head, table.metadata)}:
        raise CdcError(f"{identifier}: main moved since branch {branch!r} was created; the batch will be re-applied on the new main")
    stale = sorted(name for name in table.metadata.refs if name.startswith(AUDIT_BRANCH_PREFIX) and name != branch)
    update = table.manage_snapshots().set_current_snapshot(snapshot_id=head.snapshot_id).remove_branch(branch)
    for name in stale:
        update = update.remove_branch(name)
    update.commit()
    if stale:
        logging.getLogger(__name__).info("%s: dropped audit branches of earlier failed attempts %s", identifier, stale)
    return head.snapshot_id


def drop_branches(settings: Settings, namespace: str, branch: str, catalog=None) -> list[str]:
    """Drop ``branch`` from every table of ``namespace`` that has it; returns those tables."""
    catalog = catalog or load_catalog(settings)
    try:
        idents = [".".join(t) for t in catalog.list_tables(namespace)]
    except Exception:  # no such namespace: nothing written yet
        return []
    dropped = []
    for ident in idents:
        table = catalog.load_table(ident)
        if branch in table.metadata.refs:
            table.manage_snapshots().remove_branch(branch).commit()
            dropped.append(ident)
    return dropped


def not_yet_applied(files: list[Any], applied: Mapping[str, str], scope: str) -> list[Any]:
    """The files (``ArchiveFile``s) not in ``applied`` (path -> SHA-256), in
    order.  An applied file whose content changed since is refused, naming
    it: archives are immutable, and applying it again would double changes."""
    from cdc_apply.errors import AlreadyAppliedFileChanged

    changed = [f.path for f in files if f.path in applied and applied[f.path] != f.sha256]
    if changed:
        raise AlreadyAppliedFileChanged(
            f"{scope}: {len(changed)} already-applied file(s) changed on disk since they were applied: {changed[:5]}. "
            "Archives are immutable: restore the original file, or move the new content to a new file name."
        )
    return [f for f in files if f.path not in applied]
