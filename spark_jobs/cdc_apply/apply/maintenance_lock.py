"""The maintenance lock: table maintenance holds branch ``cdc_maintenance``
while it commits to main.  A batch and maintenance each create their branch
first and look for the other's second, so (catalog commits being serialised)
at least one of them sees the other.  A lock left by a killed maintenance is
recognised by its owner and expiry and recovered, never left for a person."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket

from pyspark.sql import SparkSession

from cdc_apply.apply.tables import sql_string, table_properties

log = logging.getLogger(__name__)

MAINTENANCE_BRANCH = "cdc_maintenance"

LOCK_PREFIX = "cdc.maintenance-lock."
"""The maintenance branch's owners: one table property per process that takes
it, ``cdc.maintenance-lock.<host>:<pid>`` = ``{"started_at", "expires_at"}``,
set *before* the branch is created (so a branch always has its holder's) and
removed with the branch.  A branch whose owners are all dead (same host, pid
gone) or expired — or that has none (made before owners were recorded) — is a
lock left by a killed maintenance: the next apply or maintenance recovers it."""
LOCK_HOURS = 6.0


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
    now = now or dt.datetime.now(dt.UTC)
    owners = {k[len(LOCK_PREFIX) :]: v for k, v in props.items() if k.startswith(LOCK_PREFIX)}
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
    props = {k: v for k, v in table_properties(spark, identifier).items() if k != lock_key()}  # not our own, being taken
    reason = stale_lock_reason(props)
    if reason is None:
        return None
    log.error("%s: recovering the lock of a killed table maintenance (branch %r): %s", identifier, MAINTENANCE_BRANCH, reason)
    spark.sql(f"ALTER TABLE {identifier} DROP BRANCH IF EXISTS {MAINTENANCE_BRANCH}")
    stale = [k for k in props if k.startswith(LOCK_PREFIX)]
    if stale:
        spark.sql(f"ALTER TABLE {identifier} UNSET TBLPROPERTIES IF EXISTS ({', '.join(sql_string(k) for k in stale)})")
    return reason


def take_lock(spark: SparkSession, identifier: str) -> str | None:
    """Create the maintenance branch with this process as its owner; the
    reason it is held by another (live) one otherwise."""
    now = dt.datetime.now(dt.UTC)
    owner = json.dumps({"started_at": now.isoformat(), "expires_at": (now + dt.timedelta(hours=LOCK_HOURS)).isoformat()})
    key = lock_key()
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({sql_string(key)}={sql_string(owner)})")
    for attempt in (1, 2):
        try:
            spark.sql(f"ALTER TABLE {identifier} CREATE BRANCH {MAINTENANCE_BRANCH}")
            return None
        except Exception as exc:  # the branch exists: another maintenance holds the table, or a killed one did
            if attempt == 1 and recover_stale_lock(spark, identifier) is not None:
                spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({sql_string(key)}={sql_string(owner)})")
                continue
            spark.sql(f"ALTER TABLE {identifier} UNSET TBLPROPERTIES IF EXISTS ({sql_string(key)})")
            return f"maintenance branch {MAINTENANCE_BRANCH!r} exists (another maintenance runs): {str(exc)[:200]}"
    return None  # pragma: no cover


def release_lock(spark: SparkSession, identifier: str) -> None:
    """Drop the maintenance branch and this process's owner property."""
    spark.sql(f"ALTER TABLE {identifier} DROP BRANCH IF EXISTS {MAINTENANCE_BRANCH}")
    spark.sql(f"ALTER TABLE {identifier} UNSET TBLPROPERTIES IF EXISTS ({sql_string(lock_key())})")
