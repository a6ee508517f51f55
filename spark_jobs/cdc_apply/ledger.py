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
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_apply.config import Settings
from cdc_apply.errors import AlreadyAppliedFileChanged, CdcError
from cdc_apply.status import Status

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table.snapshots import Snapshot

    from cdc_apply.results import BatchResult

log = logging.getLogger(__name__)

PREFIX = "cdc."
BATCHES_TABLE = "batches"
QUARANTINE_TABLE = "quarantine"
# batch rows (table_name '*') whose files count as applied: 'skipped' is an
# operator's explicit decision to never apply them (see results.Override)
APPLIED_STATUSES = (Status.COMPLETE, Status.SKIPPED)
DERIVED_PROPERTIES = frozenset({PREFIX + "changelog-of", PREFIX + "history-of"})
"""Table properties of tables derived from a CDC table (its change log,
its history): they have no live rows or tombstones to count."""
AUDIT_BRANCH_PREFIX = "audit_"
PUBLISH_TAG_PREFIX = "cdc_"
"""A publish tags its snapshot ``cdc_<batch id>`` (``fast_forward``): the
snapshot a source position reads (``asof.py``) survives snapshot expiry for
``Settings.asof_days`` (Iceberg's ``max-ref-age``: expiry drops the tag after it)."""


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
    commit_ts_max: str | None = None
    """The newest source commit time (ISO, UTC) of the changes main reflects."""


def summary_properties(
    batch_id: str, files: Iterable[dict], *, position_max: str | None, truncated_at: str | None, counts: dict[str, int]
) -> dict[str, str]:
    props = {
        "batch-id": batch_id,
        "files": json.dumps([{"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in files], separators=(",", ":")),
        "counts": json.dumps(counts, sort_keys=True, separators=(",", ":")),
        "applied-at": dt.datetime.now(dt.UTC).isoformat(),
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
        for pos in (s.get(PREFIX + "position-max"), s.get(PREFIX + "watermark")):
            if pos is not None and (led.last_position is None or pos > led.last_position):
                led.last_position = pos
        ts = s.get(PREFIX + "commit-ts-max")
        if ts is not None and (led.commit_ts_max is None or ts > led.commit_ts_max):
            led.commit_ts_max = ts
        t = s.get(PREFIX + "truncated-at")
        if t is not None and (led.truncated_at is None or t > led.truncated_at):
            led.truncated_at = t
    return led


def watermark_properties(prior: TableLedger | None, position_max: str | None, commit_us_max: int | None) -> dict[str, str]:
    """The source watermark a batch's commits reflect once published: the
    highest position (``cdc.watermark``) and source commit time
    (``cdc.commit-ts-max``, ISO UTC) of main before it and of the batch
    (``asof.py`` reads them).  Recorded at write time: the publish only
    fast-forwards onto the main it was written on.  ``commit_us_max``: the
    batch's latest commit time in microseconds since the epoch, as Spark's
    ``unix_micros`` gives it (a timestamp collected to Python would be the
    driver's local wall time: PySpark's ``TimestampType.fromInternal``)."""
    props: dict[str, str] = {}
    positions = [p for p in (prior.last_position if prior else None, position_max) if p is not None]
    if positions:
        props[PREFIX + "watermark"] = max(positions)
    commit_ts_max = None if commit_us_max is None else iso_utc_micros(commit_us_max)
    stamps = [t for t in (prior.commit_ts_max if prior else None, commit_ts_max) if t is not None]
    if stamps:
        props[PREFIX + "commit-ts-max"] = max(stamps)
    return props


def iso_utc_micros(us: int) -> str:
    """Microseconds since the epoch as ``iso_utc_text``."""
    return iso_utc_text(dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=us))


def iso_utc_text(t: dt.datetime) -> str:
    """An aware time as the fixed-width ISO UTC text of ``cdc.commit-ts-max``
    (text order is time order; ``strftime`` drops the zero padding of years
    below 1000)."""
    u = t.astimezone(dt.UTC)
    return f"{u.year:04d}-{u.month:02d}-{u.day:02d}T{u.hour:02d}:{u.minute:02d}:{u.second:02d}.{u.microsecond:06d}Z"


def publish_tag(branch: str) -> str:
    """The tag a publish of audit branch ``audit_<batch>`` puts on its snapshot."""
    return PUBLISH_TAG_PREFIX + branch.removeprefix(AUDIT_BRANCH_PREFIX)


# -- pure: summaries, fingerprints ---------------------------------------------


def summary_dict(snapshot: Snapshot) -> dict[str, str]:
    """A snapshot's summary properties as a plain dict (none: empty)."""
    summary = snapshot.summary
    if summary is None:
        return {}
    return dict(summary.additional_properties)


def sha256_by_path(records: dict[str, tuple[int, str]]) -> dict[str, str]:
    """path -> sha256 of ``applied_file_records``' path -> (size, sha256)."""
    return {path: sha for path, (_, sha) in records.items()}


def applied_file_records_of(rows: list[dict[str, Any]]) -> dict[str, tuple[int, str]]:
    """``Ledger.applied_file_records`` from batch rows a caller already read
    (``Ledger.batch_rows``): the files of the complete and skipped batches."""
    out: dict[str, tuple[int, str]] = {}
    for r in rows:
        if r["table_name"] == "*" and r["status"] in APPLIED_STATUSES:
            for f in r["files"] or []:
                out[f["path"]] = (f["size"], f["sha256"])
    return out


def not_yet_applied(files: list[Any], applied: Mapping[str, str], scope: str) -> list[Any]:
    """The files (``ArchiveFile``s) not in ``applied`` (path -> SHA-256), in
    order.  An applied file whose content changed since is refused, naming
    it: archives are immutable, and applying it again would double changes."""
    changed = [f.path for f in files if f.path in applied and applied[f.path] != f.sha256]
    if changed:
        raise AlreadyAppliedFileChanged(
            f"{scope}: {len(changed)} already-applied file(s) changed on disk since they were applied: {changed[:5]}. "
            "Archives are immutable: restore the original file, or move the new content to a new file name."
        )
    return [f for f in files if f.path not in applied]


def _arrow_schemas() -> tuple[Any, Any]:
    """The pyarrow schemas of the batches and quarantine tables."""
    import pyarrow as pa

    files = pa.list_(pa.struct([("path", pa.string()), ("size", pa.int64()), ("sha256", pa.string())]))
    ts = pa.timestamp("us", tz="UTC")
    batches = pa.schema(
        [
            ("batch_id", pa.string()),
            ("source", pa.string()),
            ("table_name", pa.string()),
            ("status", pa.string()),
            ("files", files),
            ("position_min", pa.string()),
            ("position_max", pa.string()),
            ("counts", pa.map_(pa.string(), pa.int64())),
            ("failed_expectations", pa.list_(pa.string())),
            ("branch", pa.string()),
            ("snapshot_id", pa.int64()),
            ("message", pa.string()),
            ("data_docs", pa.string()),
            ("decoder_state", pa.string()),
            ("started_at", ts),
            ("ended_at", ts),
        ]
    )
    quarantine = pa.schema(
        [
            ("batch_id", pa.string()),
            ("source", pa.string()),
            ("file", pa.string()),
            ("line", pa.int64()),
            ("reason", pa.string()),
            ("raw", pa.string()),
            ("recorded_at", ts),
        ]
    )
    return batches, quarantine


# -- the ledger of a catalog -------------------------------------------------------


def _eq(column: str, value: Any) -> Any:
    """``column = value`` as a pyiceberg row filter.  (pyiceberg's predicates
    are pydantic models whose generated signature mypy reads as keyword-only;
    at run time the term and the literal are positional.)"""
    from pyiceberg.expressions import EqualTo

    return EqualTo(column, value)  # type: ignore[call-arg, arg-type]


def _isin(column: str, values: Iterable[str]) -> Any:
    from pyiceberg.expressions import In

    return In(column, tuple(values))  # type: ignore[call-arg, arg-type]


_SPARK_NAMES = {
    "boolean": "boolean",
    "int": "int",
    "long": "bigint",
    "float": "float",
    "double": "double",
    "date": "date",
    "timestamptz": "timestamp",
    "timestamp": "timestamp_ntz",
    "string": "string",
    "uuid": "string",
    "binary": "binary",
}
"""Iceberg's primitive types (pyiceberg's names) by the name Spark reads them as."""


def stored_column_types(catalog: Any, namespace: str) -> dict[str, dict[str, str]] | None:
    """``apply.tables.stored_column_types`` read with pyiceberg (``catalog``),
    without Spark: a job reads them while its session starts.  None when a
    column has a type not named here (the caller then asks Spark)."""
    from pyiceberg.exceptions import NoSuchNamespaceError

    try:
        identifiers = catalog.list_tables(namespace)
    except NoSuchNamespaceError:
        return {}
    out = {}
    for ident in identifiers:
        name = ident[-1]
        if name.endswith("_live"):
            continue
        columns = {}
        for f in catalog.load_table(ident).schema().fields:
            if not f.name.startswith("_cdc_"):
                spark_type = _spark_type(f.field_type)
                if spark_type is None:
                    return None
                columns[f.name] = spark_type
        out[name] = columns
    return out


def _spark_type(t: Any) -> str | None:
    """The Spark type name (``DataType.simpleString``) of a pyiceberg type."""
    from pyiceberg.types import DecimalType, FixedType, ListType, MapType, StructType

    if isinstance(t, DecimalType):
        return f"decimal({t.precision},{t.scale})"
    if isinstance(t, FixedType):
        return "binary"
    if isinstance(t, ListType):
        element = _spark_type(t.element_type)
        return element and f"array<{element}>"
    if isinstance(t, MapType):
        key, value = _spark_type(t.key_type), _spark_type(t.value_type)
        return key and value and f"map<{key},{value}>"
    if isinstance(t, StructType):
        fields = [(f.name, _spark_type(f.field_type)) for f in t.fields]
        return None if any(ft is None for _, ft in fields) else f"struct<{','.join(f'{n}:{ft}' for n, ft in fields)}>"
    return _SPARK_NAMES.get(str(t))


class DecoderStateAhead:
    """The source's latest decoder state, read from the ledger on a thread of
    its own while the Spark session starts.

    A job's first ledger read imports pyiceberg and opens the catalog, ~1 s
    of Python that would otherwise wait for the session and then hold up the
    decode.  Opening the catalog creates its tables in a new one, which
    Spark's catalog creates too: a job lets Spark at the catalog only once
    the thread has opened it (``catalog_opened``).  A read that failed on
    the thread (the catalog locked, an import race) is made again by
    ``state``'s caller, who then sees the error."""

    def __init__(self, settings: Settings, source: str, types_of: str | None = None) -> None:
        self._settings, self._source, self._types_of = settings, source, types_of
        self._opened = threading.Event()
        self._got: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._read, name="read-decoder-state")
        self._thread.start()

    def _read(self) -> None:
        try:
            led = Ledger(self._settings)
            led.catalog  # noqa: B018  opens it (creates a new catalog's tables)
            self._opened.set()
            self._got["state"] = led.latest_decoder_state(self._source)
            if self._types_of is not None:
                self._got["types"] = stored_column_types(led.catalog, self._types_of)
        except Exception:
            log.debug("reading the decoder state ahead failed; read again when needed", exc_info=True)
        finally:
            self._opened.set()

    def catalog_opened(self) -> None:
        """Wait until the thread has opened the catalog, or failed to."""
        self._opened.wait()

    def state(self) -> dict[str, Any]:
        self._thread.join()
        return self._got["state"] if "state" in self._got else Ledger(self._settings).latest_decoder_state(self._source)

    def stored_types(self) -> dict[str, dict[str, str]] | None:
        """The column types of namespace ``types_of``'s tables
        (``stored_column_types``), None when not read (the caller asks
        Spark)."""
        self._thread.join()
        return self._got.get("types")


OPENED_CATALOGS: dict[tuple[str, str | None, str | None], Catalog] = {}
"""The catalogs ledgers of this process opened, by the Spark catalog each
mirrors (name, URI, warehouse): ``apply.catalog_reads`` reads a batch's table
metadata through them instead of Spark queries."""
_OPENED_LOCK = threading.Lock()


def opened_catalog(name: str, uri: str | None, warehouse: str | None) -> Catalog | None:
    with _OPENED_LOCK:
        return OPENED_CATALOGS.get((name, uri, warehouse))


class Ledger:
    """The ledger of one catalog, read and written with pyiceberg (no Spark:
    discovery and publish run without a JVM).  It holds its catalog, loaded
    once on first use."""

    def __init__(self, settings: Settings, catalog: Catalog | None = None) -> None:
        self.settings = settings
        self._catalog = catalog

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            if self.settings.sqlite_path is not None:
                self.settings.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
            self._catalog = load_catalog(self.settings.catalog_name, **self.settings.pyiceberg_properties())
            with _OPENED_LOCK:  # the batch's metadata reads go through it too (apply.catalog_reads)
                OPENED_CATALOGS[(self.settings.catalog_name, self.settings.catalog_uri, self.settings.warehouse)] = self._catalog
        return self._catalog

    @property
    def batches_table(self) -> str:
        return f"{self.settings.audit_namespace}.{BATCHES_TABLE}"

    @property
    def quarantine_table(self) -> str:
        return f"{self.settings.audit_namespace}.{QUARANTINE_TABLE}"

    # -- reads: discovery, status, the job ------------------------------------

    def table_ledger(self, identifier: str, snapshot_id: int | None = None) -> TableLedger | None:
        """The ledger of ``namespace.table`` on main (or as of ``snapshot_id``:
        that snapshot's ancestry); None when the table does not exist."""
        from pyiceberg.exceptions import NoSuchTableError
        from pyiceberg.table.snapshots import ancestors_of

        try:
            table = self.catalog.load_table(identifier)
        except NoSuchTableError:
            return None
        current = table.current_snapshot() if snapshot_id is None else table.snapshot_by_id(snapshot_id)
        if current is None:
            return TableLedger()
        chain = list(ancestors_of(current, table.metadata))
        led = ledger_from_summaries([summary_dict(s) for s in reversed(chain)])
        led.snapshot_id = current.snapshot_id
        return led

    def applied_files(self, source: str) -> dict[str, str]:
        """Files of the source's complete batches: path -> sha256."""
        return sha256_by_path(self.applied_file_records(source))

    def applied_file_records(self, source: str) -> dict[str, tuple[int, str]]:
        """Files of the source's complete batches: path -> (size, sha256)."""
        from pyiceberg.exceptions import NoSuchTableError
        from pyiceberg.expressions import And

        try:
            table = self.catalog.load_table(self.batches_table)
        except NoSuchTableError:
            return {}
        rows = (
            table.scan(
                row_filter=And(_eq("source", source), And(_eq("table_name", "*"), _isin("status", APPLIED_STATUSES))),
                selected_fields=("table_name", "status", "files"),
            )
            .to_arrow()
            .to_pylist()
        )
        return applied_file_records_of(rows)

    def latest_decoder_state(self, source: str, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The source state the last complete batch carried on (``rows``: the
        source's ``batch_rows``, when the caller has read them)."""
        done = [
            r
            for r in (self.batch_rows(source) if rows is None else rows)
            if r["table_name"] == "*" and r["status"] == Status.COMPLETE and r["decoder_state"]
        ]
        return json.loads(done[-1]["decoder_state"]) if done else {}

    def batch_rows(self, source: str | None = None) -> list[dict[str, Any]]:
        from pyiceberg.exceptions import NoSuchTableError
        from pyiceberg.expressions import AlwaysTrue

        try:
            table = self.catalog.load_table(self.batches_table)
        except NoSuchTableError:
            return []
        flt = _eq("source", source) if source else AlwaysTrue()
        rows = table.scan(row_filter=flt).to_arrow().to_pylist()
        return sorted(rows, key=lambda r: (r["started_at"] or dt.datetime.min, r["table_name"]))

    def published_snapshot(self, identifier: str, batch_id: str) -> int | None:
        """The newest snapshot of main's ancestry written by ``batch_id`` (its
        ``cdc.batch-id``), None when main does not hold the batch: how a retried
        publish or finish recognises its own completed fast-forward."""
        from pyiceberg.table.snapshots import ancestors_of

        table = self.catalog.load_table(identifier)
        current = table.current_snapshot()
        if current is None:
            return None
        for snap in ancestors_of(current, table.metadata):
            if summary_dict(snap).get(PREFIX + "batch-id") == batch_id:
                return snap.snapshot_id
        return None

    def recorded_statuses(self, batch_id: str | None) -> set[str]:
        """The statuses the batch rows (``table_name = '*'``) of ``batch_id`` hold."""
        from pyiceberg.exceptions import NoSuchTableError
        from pyiceberg.expressions import And

        try:
            table = self.catalog.load_table(self.batches_table)
        except NoSuchTableError:
            return set()
        rows = table.scan(row_filter=And(_eq("batch_id", batch_id or ""), _eq("table_name", "*")), selected_fields=("status",)).to_arrow()
        return set(rows.column("status").to_pylist())

    def published_tables(self, namespace: str, batch_id: str) -> list[str]:
        """The tables of ``namespace`` whose main holds ``batch_id``: an
        operator's skip of a batch a run has published (in part) is refused."""
        try:
            idents = [".".join(t) for t in self.catalog.list_tables(namespace)]
        except Exception:  # no such namespace: nothing written yet
            return []
        return [ident for ident in idents if self.published_snapshot(ident, batch_id) is not None]

    # -- writes (the publish stage needs no Spark) -----------------------------

    def ensure_audit_tables(self) -> None:
        batches, quarantine = _arrow_schemas()
        self._ensure_audit_namespace()
        self.catalog.create_table_if_not_exists(self.batches_table, schema=batches, properties={"format-version": "2"})
        self.catalog.create_table_if_not_exists(self.quarantine_table, schema=quarantine, properties={"format-version": "2"})

    def _ensure_audit_namespace(self) -> None:
        """Create the audit namespace, safe against a concurrent run: the SQL
        catalog checks and then inserts, so the run that lost the race fails on
        the catalog's unique key (SQLAlchemy's ``IntegrityError``, not pyiceberg's
        already-exists).  A namespace that exists afterwards is what was asked for."""
        namespace = self.settings.audit_namespace
        try:
            self.catalog.create_namespace_if_not_exists(namespace)
        except Exception:
            if not self.catalog.namespace_exists(namespace):
                raise

    def record_batch(self, result: BatchResult) -> None:
        """One ledger row per table attempt, plus the batch row (``table_name='*'``):
        'complete' marks the batch's files applied for discovery."""
        import pyarrow as pa

        self.ensure_audit_tables()
        now = dt.datetime.now(dt.UTC)
        started = dt.datetime.fromisoformat(result.started_at) if result.started_at else now
        status = result.status if result.status in APPLIED_STATUSES else Status.FAILED
        if self._already_recorded(result.batch_id, started, status):
            log.info("batch %s: already recorded (a retried finish): nothing appended", result.batch_id)
            return
        rows = [_table_row(result, t, started, now) for t in result.tables]
        held = set(result.held_files)
        rows.append(
            {
                "batch_id": result.batch_id,
                "source": result.source,
                "table_name": "*",
                "status": status,
                "files": [f for f in result.files if f["path"] not in held],
                "position_min": None,
                "position_max": None,
                "counts": list((result.messages or {}).items()),
                "failed_expectations": list(result.failed_checks),
                "branch": None,
                "snapshot_id": None,
                "message": result.message,
                "data_docs": None,
                "decoder_state": json.dumps(result.source_state) if status == Status.COMPLETE else None,
                "started_at": started,
                "ended_at": now,
            }
        )
        batches, _ = _arrow_schemas()
        self._append(self.batches_table, pa.Table.from_pylist(rows, schema=batches))

    def _already_recorded(self, batch_id: str | None, started: dt.datetime, status: str) -> bool:
        """Whether the batch is recorded complete (or skipped) already, or this
        very attempt (same start) was recorded with this status: ``finish`` run
        again (an Airflow retry after a kill) appends nothing, while a finish
        that completes an attempt recorded failed before still records it."""
        from pyiceberg.expressions import And

        table = self.catalog.load_table(self.batches_table)
        flt = And(_eq("batch_id", batch_id or ""), _eq("table_name", "*"))
        rows = table.scan(row_filter=flt, selected_fields=("status", "started_at")).to_arrow().to_pylist()
        return any(r["status"] in APPLIED_STATUSES or (r["started_at"] == started and r["status"] == status) for r in rows)

    def _append(self, identifier: str, data: Any, attempts: int = 5) -> None:
        """Append, on a freshly loaded table each try: a commit that lost the race
        (e.g. to the maintenance's compaction of the audit tables) was not made."""
        from pyiceberg.exceptions import CommitFailedException

        for attempt in range(1, attempts + 1):
            try:
                self.catalog.load_table(identifier).append(data)
                return
            except CommitFailedException:
                if attempt == attempts:
                    raise
                time.sleep(0.2 * attempt)

    def fast_forward(self, identifier: str, branch: str, expected_head: int | None = None) -> int:
        """Move main to the head of ``branch`` if main is its ancestor, tag it
        ``cdc_<batch>`` (``publish_tag``), drop the branch and the audit
        branches earlier failed attempts left behind (this batch re-applied
        their files); one atomic catalog commit.  Returns main's new snapshot id."""
        from pyiceberg.table.snapshots import ancestors_of

        table = self.catalog.load_table(identifier)
        ref = table.metadata.refs.get(branch)
        if ref is None:
            done = self.published_snapshot(identifier, branch.removeprefix(AUDIT_BRANCH_PREFIX))
            if done is not None:  # an earlier attempt fast-forwarded and died before saving its result
                log.warning(
                    "%s: batch of branch %r is already on main (snapshot %s): published by an earlier attempt", identifier, branch, done
                )
                return done
            raise CdcError(f"{identifier}: audit branch {branch!r} does not exist (already published, or never written)")
        if expected_head is not None and ref.snapshot_id != expected_head:
            raise CdcError(
                f"ConcurrentApply: another run is applying batch {branch.removeprefix(AUDIT_BRANCH_PREFIX)} to {identifier} at the same time "
                f"(branch {branch!r} moved from this run's snapshot {expected_head} to {ref.snapshot_id}); retry"
            )
        head = table.snapshot_by_id(ref.snapshot_id)
        if head is None:
            raise CdcError(f"{identifier}: the head {ref.snapshot_id} of branch {branch!r} is not in the table's metadata")
        main = table.current_snapshot()
        if main is not None and main.snapshot_id not in {s.snapshot_id for s in ancestors_of(head, table.metadata)}:
            raise CdcError(f"{identifier}: main moved since branch {branch!r} was created; the batch will be re-applied on the new main")
        stale = sorted(name for name in table.metadata.refs if name.startswith(AUDIT_BRANCH_PREFIX) and name != branch)
        update = table.manage_snapshots().set_current_snapshot(snapshot_id=head.snapshot_id).remove_branch(branch)
        if publish_tag(branch) not in table.metadata.refs:  # the source watermark's snapshot, kept from expiry (asof.py)
            update = update.create_tag(head.snapshot_id, publish_tag(branch), max_ref_age_ms=int(self.settings.asof_days * 86_400_000))
        for name in stale:
            update = update.remove_branch(name)
        update.commit()
        if stale:
            log.info("%s: dropped audit branches of earlier failed attempts %s", identifier, stale)
        return head.snapshot_id

    def drop_branches(self, namespace: str, branch: str) -> list[str]:
        """Drop ``branch`` from every table of ``namespace`` that has it; returns those tables."""
        try:
            idents = [".".join(t) for t in self.catalog.list_tables(namespace)]
        except Exception:  # no such namespace: nothing written yet
            return []
        dropped = []
        for ident in idents:
            table = self.catalog.load_table(ident)
            if branch in table.metadata.refs:
                table.manage_snapshots().remove_branch(branch).commit()
                dropped.append(ident)
        return dropped


def _table_row(result: BatchResult, t: Any, started: dt.datetime, now: dt.datetime) -> dict[str, Any]:
    """The ledger row of one table's attempt."""
    return {
        "batch_id": result.batch_id,
        "source": result.source,
        "table_name": t.table,
        "status": Status.FORCED if (t.override and t.status == Status.PUBLISHED) else t.status,
        "files": result.files,
        "position_min": t.position_min,
        "position_max": t.position_max,
        "counts": list((t.counts or {}).items()),
        "failed_expectations": t.failed_expectations,
        "branch": t.branch,
        "snapshot_id": t.snapshot_id,
        "message": t.override or t.message,
        "data_docs": t.data_docs,
        "decoder_state": None,
        "started_at": started,
        "ended_at": now,
    }
