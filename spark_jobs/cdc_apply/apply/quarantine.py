"""The quarantine table's rows of a batch (``cdc_audit.quarantine``): every
message that could not be applied, with its file, line, raw text and reason.

Three writers record a batch's rows, each for its own *scope* of reasons,
and each replaces only its own scope: the decode's quarantine
(``DECODED``), the refused tables' messages (``REFUSED_TABLES``) and a
table's events without a key value (``null_key``).  Disjoint, so a retry,
or another run of the batch, that rewrites one scope never deletes
another's rows (a decode's rewrite used to take the null-key rows with it).
"""

from __future__ import annotations

import logging
import time

from pyspark.sql import DataFrame, SparkSession

from cdc_apply.apply import branches
from cdc_apply.apply.tables import sql_string
from cdc_apply.errors import ConcurrentApply

log = logging.getLogger(__name__)

REFUSED_TABLE_PREFIX = "refused table "
NULL_KEY_PREFIX = "null key: "
REFUSED_TABLES = f"t.reason LIKE '{REFUSED_TABLE_PREFIX}%'"
DECODED = f"NOT (t.reason LIKE '{REFUSED_TABLE_PREFIX}%' OR t.reason LIKE '{NULL_KEY_PREFIX}%')"


def null_key(reason: str) -> str:
    """The scope of one table's null-key rows (``reason`` names the table)."""
    return f"t.reason = {sql_string(reason)}"


def write(spark: SparkSession, target: str, rows: DataFrame, batch_id: str, scope: str, attempts: int = 4) -> None:
    """Make the batch's quarantine rows of ``scope`` (a condition on the
    target's ``t.reason``) exactly ``rows``, in one MERGE: a retry of the batch
    replaces them, and two runs of one batch at once never double them (a
    delete then an append did: both deleted nothing, both appended).  The
    later commit fails Iceberg's conflict check and is retried, finding the
    rows there; after ``attempts`` it fails transient (ConcurrentApply)."""
    view = f"_cdc_quarantine_{abs(hash((batch_id, scope, time.time()))):x}"
    rows.createOrReplaceTempView(view)
    on = "t.batch_id = s.batch_id AND t.file <=> s.file AND t.line <=> s.line AND t.reason <=> s.reason AND t.raw <=> s.raw"
    mine = f"t.batch_id = {sql_string(batch_id)} AND {scope}"
    sql = f"MERGE INTO {target} t USING {view} s ON {on} WHEN NOT MATCHED THEN INSERT * WHEN NOT MATCHED BY SOURCE AND {mine} THEN DELETE"
    try:
        for attempt in range(1, attempts + 1):
            try:
                spark.sql(sql)
                return
            except Exception as exc:
                msg = branches.concurrent_apply_message(exc, target, batch_id, "(quarantine)")
                if msg is None:
                    raise
                if attempt == attempts:
                    raise ConcurrentApply(msg) from None
                log.warning(
                    "batch %s: quarantine write lost a commit race (attempt %d), retrying: %s",
                    batch_id,
                    attempt,
                    str(exc).splitlines()[0][:200],
                )
                time.sleep(0.5 * attempt)
    finally:
        spark.catalog.dropTempView(view)
