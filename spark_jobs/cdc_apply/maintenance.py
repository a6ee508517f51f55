"""Table maintenance with Iceberg's own Spark procedures.

Per table of a source: purge tombstones older than their retention, compact
small files, rewrite position deletes, expire old snapshots, remove orphan
files.  A table with an open audit branch (a batch between write and
publish, or one that failed its gate and waits for an operator) is left
alone: maintenance never commits under an in-flight batch.

Retention and the ledger: the per-table ledger lives in snapshot summaries,
so expiring snapshots forgets which files the *table* saw before the
retention; discovery reads the rows of ``cdc_audit.batches`` (never deleted),
and a batch re-run after the retention is still a no-op by position.

The audit tables themselves (``batches``, ``quarantine``) get one small
commit per batch: without compaction every hourly run would read one more
file and one more manifest than the last (measured: reading the decoder state
took 1.1 s after 250 batches, 4.3 s after 1 000, growing linearly), so
:func:`maintain_audit` compacts them, rewrites their manifests and expires
their old snapshots; rows are never removed.  Keep
``snapshot_retention_days`` above the longest delay after which you would
re-run a batch, and ``tombstone_retention_days`` above the longest delivery
delay of the source (a late event older than a purged delete would resurrect
its row).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
from dataclasses import dataclass

from pyspark.sql import SparkSession

from .config import Settings, SourceConfig
from .errors import ConfigError
from .merge import MAINTENANCE_BRANCH

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    snapshot_days: float = 7.0
    tombstone_days: float = 7.0
    orphan_days: float = 3.0  # never below the longest write: files of running writes look orphaned
    retain_last: int = 20

    @classmethod
    def from_env(cls, snapshot_days: float | None = None, tombstone_days: float | None = None) -> "Retention":
        """Explicit values first, then ``CDC_SNAPSHOT_RETENTION_DAYS`` /
        ``CDC_TOMBSTONE_RETENTION_DAYS``, then the defaults (7 days each)."""

        def pick(value: float | None, env: str, default: float) -> float:
            if value is not None:
                days = float(value)
            else:
                text = os.environ.get(env, "").strip()
                try:
                    days = float(text) if text else default
                except ValueError:
                    raise ConfigError(f"{env}={text!r} is not a number of days") from None
            if days < 0:
                raise ConfigError(f"{env} must be >= 0 days, got {days}")
            return days

        return cls(
            snapshot_days=pick(snapshot_days, "CDC_SNAPSHOT_RETENTION_DAYS", cls.snapshot_days),
            tombstone_days=pick(tombstone_days, "CDC_TOMBSTONE_RETENTION_DAYS", cls.tombstone_days),
        )


def _ts(days: float) -> str:
    t = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def open_branches(spark: SparkSession, identifier: str) -> list[str]:
    return [r[0] for r in spark.sql(f"SELECT name FROM {identifier}.refs WHERE type = 'BRANCH' AND name <> 'main'").collect()]


LOCK_PREFIX = "cdc.maintenance-lock."
"""The maintenance branch's owners: one table property per process that takes
it, ``cdc.maintenance-lock.<host>:<pid>`` = ``{"started_at", "expires_at"}``,
set *before* the branch is created (so a branch always has its holder's) and
removed with the branch.  A branch whose owners are all dead (same host, pid
gone) or expired — or that has none (made before owners were recorded) — is a
lock left by a killed maintenance: the next apply or maintenance recovers it."""
LOCK_HOURS = 6.0


def _sql_string(text: str) -> str:
    from .tables import sql_string

    return sql_string(text)


def lock_key(host: str | None = None, pid: int | None = None) -> str:
    return f"{LOCK_PREFIX}{host or socket.gethostname()}:{pid or os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_lock_reason(props: dict[str, str], now: dt.datetime | None = None) -> str | None:
    """Why the maintenance branch's lock is stale (None: an owner is alive).
    ``props``: the table's properties."""
    now = now or dt.datetime.now(dt.timezone.utc)
    owners = {k[len(LOCK_PREFIX):]: v for k, v in props.items() if k.startswith(LOCK_PREFIX)}
    if not owners:
        return "no owner recorded (a lock from before owners were recorded)"
    gone = []
    for owner, value in owners.items():
        host, _, pid = owner.rpartition(":")
        try:
            expires = dt.datetime.fromisoformat(json.loads(value)["expires_at"])
        except (ValueError, KeyError, TypeError):
            expires = now
        if expires <= now:
            gone.append(f"{owner} expired at {expires.isoformat()}")
        elif host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid)):
            gone.append(f"{owner} is dead (no process {pid} on this host)")
        else:
            return None
    return "; ".join(gone)


def recover_stale_lock(spark: SparkSession, identifier: str) -> str | None:
    """Drop the maintenance branch when its lock is stale (logged as an
    error: a maintenance was killed); returns why, None when it is held."""
    from .tables import table_properties

    props = {k: v for k, v in table_properties(spark, identifier).items() if k != lock_key()}  # not our own, being taken
    reason = stale_lock_reason(props)
    if reason is None:
        return None
    log.error("%s: recovering the lock of a killed table maintenance (branch %r): %s", identifier, MAINTENANCE_BRANCH, reason)
    spark.sql(f"ALTER TABLE {identifier} DROP BRANCH IF EXISTS {MAINTENANCE_BRANCH}")
    stale = [k for k in props if k.startswith(LOCK_PREFIX)]
    if stale:
        spark.sql(f"ALTER TABLE {identifier} UNSET TBLPROPERTIES IF EXISTS ({', '.join(_sql_string(k) for k in stale)})")
    return reason


def _take_lock(spark: SparkSession, identifier: str) -> str | None:
    """Create the maintenance branch with this process as its owner; the
    reason it is held by another (live) one otherwise."""
    now = dt.datetime.now(dt.timezone.utc)
    owner = json.dumps({"started_at": now.isoformat(), "expires_at": (now + dt.timedelta(hours=LOCK_HOURS)).isoformat()})
    key = lock_key()
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({_sql_string(key)}={_sql_string(owner)})")
    for attempt in (1, 2):
        try:
            spark.sql(f"ALTER TABLE {identifier} CREATE BRANCH {MAINTENANCE_BRANCH}")
            return None
        except Exception as exc:  # the branch exists: another maintenance holds the table, or a killed one did
            if attempt == 1 and recover_stale_lock(spark, identifier) is not None:
                spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({_sql_string(key)}={_sql_string(owner)})")
                continue
            spark.sql(f"ALTER TABLE {identifier} UNSET TBLPROPERTIES IF EXISTS ({_sql_string(key)})")
            return f"maintenance branch {MAINTENANCE_BRANCH!r} exists (another maintenance runs): {str(exc)[:200]}"
    return None  # pragma: no cover


def maintain_table(spark: SparkSession, settings: Settings, identifier: str, retention: Retention = Retention()) -> dict:
    """Maintain one table under the maintenance branch (see merge.MAINTENANCE_BRANCH):
    never while a batch has an audit branch open, and no batch starts meanwhile."""
    report: dict = {"table": identifier}
    held = _take_lock(spark, identifier)
    if held is not None:
        report["skipped"] = held
        return report
    try:
        branches = [b for b in open_branches(spark, identifier) if b != MAINTENANCE_BRANCH]
        if branches:
            report["skipped"] = f"open audit branch(es) {branches}: a batch is in flight or waits for an operator"
            return report
        report.update(_procedures(spark, identifier, retention))
        return report
    finally:
        spark.sql(f"ALTER TABLE {identifier} DROP BRANCH IF EXISTS {MAINTENANCE_BRANCH}")
        spark.sql(f"ALTER TABLE {identifier} UNSET TBLPROPERTIES IF EXISTS ({_sql_string(lock_key())})")


def _call(spark: SparkSession, identifier: str, procedure: str, args: str = "") -> list:
    """``CALL <catalog>.system.<procedure>(table => '<catalog.ns.table>', ...)``."""
    catalog = identifier.split(".", 1)[0]
    return spark.sql(f"CALL {catalog}.system.{procedure}(table => '{identifier}'{', ' + args if args else ''})").collect()


def _compact(spark: SparkSession, identifier: str) -> dict:
    return _call(spark, identifier, "rewrite_data_files", "options => map('min-input-files', '2')")[0].asDict()


def _expire(spark: SparkSession, identifier: str, retention: Retention) -> dict:
    args = f"older_than => TIMESTAMP '{_ts(retention.snapshot_days)}', retain_last => {retention.retain_last}"
    return _call(spark, identifier, "expire_snapshots", args)[0].asDict()


def _procedures(spark: SparkSession, identifier: str, retention: Retention) -> dict:
    report: dict = {}
    purged = spark.sql(
        f"DELETE FROM {identifier} WHERE _cdc_deleted AND _cdc_applied_at < TIMESTAMP '{_ts(retention.tombstone_days)}'"
    )
    report["tombstones_purged"] = purged.collect() if purged.columns else None
    report["rewrite_data_files"] = _compact(spark, identifier)
    report["rewrite_position_delete_files"] = _call(spark, identifier, "rewrite_position_delete_files")[0].asDict()
    report["expire_snapshots"] = _expire(spark, identifier, retention)
    report["remove_orphan_files"] = len(_call(spark, identifier, "remove_orphan_files", f"older_than => TIMESTAMP '{_ts(retention.orphan_days)}'"))
    return report


def maintain_audit(spark: SparkSession, settings: Settings, retention: Retention = Retention()) -> list[dict]:
    """Compact the audit tables (data files and manifests) and expire their
    old snapshots.  Safe beside running batches: they only append, and a
    rewrite commits over concurrent appends (the ledger's append retries if
    it loses the race)."""
    from .ledger import BATCHES_TABLE, QUARANTINE_TABLE

    reports = []
    for name in (BATCHES_TABLE, QUARANTINE_TABLE):
        identifier = f"{settings.catalog_name}.{settings.audit_namespace}.{name}"
        if not spark.catalog.tableExists(identifier):
            continue
        report = {
            "table": identifier,
            "rewrite_data_files": _compact(spark, identifier),
            "rewrite_manifests": _call(spark, identifier, "rewrite_manifests")[0].asDict(),
            "expire_snapshots": _expire(spark, identifier, retention),
        }
        reports.append(report)
        log.info("maintenance: %s", report)
    return reports


def maintain_source(spark: SparkSession, settings: Settings, source: SourceConfig, retention: Retention = Retention()) -> list[dict]:
    ns = f"{settings.catalog_name}.{source.namespace}"
    if not spark.sql(f"SHOW NAMESPACES IN {settings.catalog_name} LIKE '{source.namespace}'").collect():
        return []
    tables = [r["tableName"] for r in spark.sql(f"SHOW TABLES IN {ns}").collect() if not r["isTemporary"]]
    reports = []
    for t in sorted(tables):
        if spark.sql(f"SHOW VIEWS IN {ns} LIKE '{t}'").collect():
            continue
        reports.append(maintain_table(spark, settings, f"{ns}.{t}", retention))
        log.info("maintenance: %s", reports[-1])
    return reports
