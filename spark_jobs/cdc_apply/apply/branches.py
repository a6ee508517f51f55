"""Audit branches: every write of a batch goes to branch ``audit_<batch>``;
``main`` moves only by the ledger's fast-forward after the gate passed.  The
batch's ledger properties ride on every commit of the branch through
Iceberg's session snapshot properties (``spark.sql.iceberg.snapshot-property.*``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pyspark.sql import DataFrame, SparkSession

from cdc_apply.apply.maintenance_lock import MAINTENANCE_BRANCH, recover_stale_lock
from cdc_apply.apply.tables import TableSpec
from cdc_apply.errors import CdcError

_SNAPSHOT_PROPERTY = "spark.sql.iceberg.snapshot-property."


@contextlib.contextmanager
def snapshot_properties(spark: SparkSession, props: dict[str, str]) -> Iterator[None]:
    for k, v in props.items():
        spark.conf.set(_SNAPSHOT_PROPERTY + k, v)
    try:
        yield
    finally:
        for k in props:
            spark.conf.unset(_SNAPSHOT_PROPERTY + k)


def branch_ref(spec: TableSpec, branch: str) -> str:
    return f"{spec.identifier}.branch_{branch}"


def reset_branch(spark: SparkSession, spec: TableSpec, branch: str) -> None:
    """(Re)create the audit branch at main's current snapshot: a retry starts
    clean.  Refuses (transient: retried) while table maintenance runs."""
    spark.sql(f"ALTER TABLE {spec.identifier} DROP BRANCH IF EXISTS {branch}")
    spark.sql(f"ALTER TABLE {spec.identifier} CREATE BRANCH {branch}")
    if branch_snapshot(spark, spec, MAINTENANCE_BRANCH) is not None:
        if recover_stale_lock(spark, spec.identifier) is not None:  # a killed maintenance left it: logged, dropped
            return
        spark.sql(f"ALTER TABLE {spec.identifier} DROP BRANCH IF EXISTS {branch}")
        raise CdcError(f"{spec.identifier}: table maintenance is running (branch {MAINTENANCE_BRANCH!r}); the batch is retried after it")


def branch_snapshot(spark: SparkSession, spec: TableSpec, branch: str) -> int | None:
    rows = spark.sql(f"SELECT snapshot_id FROM {spec.identifier}.refs WHERE name = '{branch}'").collect()
    return rows[0][0] if rows else None


def read_branch(spark: SparkSession, spec: TableSpec, branch: str) -> DataFrame:
    return spark.sql(f"SELECT * FROM {spec.identifier} VERSION AS OF '{branch}'")


def ledger_commit(spark: SparkSession, spec: TableSpec, branch: str) -> None:
    """An empty append carrying the ledger properties, for a batch whose events
    were all superseded or duplicates: its files still count as applied."""
    spark.table(spec.identifier).limit(0).writeTo(branch_ref(spec, branch)).append()
