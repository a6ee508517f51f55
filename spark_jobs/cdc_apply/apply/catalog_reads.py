"""A table's metadata (existence, properties, refs, snapshots) read through
pyiceberg instead of Spark SQL.

Why: a batch reads its tables' metadata ~45 times (branch heads, properties,
existence checks).  Through Spark each read is a query to parse and plan, and
a metadata table (``refs``, ``snapshots``) runs a Spark job; in a spark-submit
job's fresh JVM they took ~1.7 s of a 1k-event batch, and on Spark Connect
each is a round trip too (bench/README.md, issue 20 step 33).  Through
pyiceberg a read is a catalog lookup and one metadata file, a few ms.

The batch opens the ledger's pyiceberg catalog anyway (``ledger.Ledger``),
which keeps it under the Spark catalog it mirrors (name, URI, warehouse:
``ledger.OPENED_CATALOGS``).  A read looks the catalog up by what the *session's* conf says of
that catalog, so a process whose sessions change catalogs (the tests) never
reads another home's catalog.  Without an opened catalog (a Spark session
alone, e.g. table maintenance) the callers read through Spark as before.

Both read the same committed metadata: Spark's catalog runs without a table
cache (``runtime.spark_conf.iceberg_conf``), so neither sees a staler table
than the other.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from cdc_apply import ledger

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession


def catalog_for(spark: SparkSession, identifier: str) -> tuple[Catalog | None, tuple[str, ...]]:
    """The pyiceberg catalog the ledger opened for ``identifier``'s Spark
    catalog in this session (None: read through Spark), and the name's parts
    within it."""
    parts = split_identifier(identifier)
    if not ledger.OPENED_CATALOGS or parts is None or len(parts) < 2:
        return None, ()
    prefix = f"spark.sql.catalog.{parts[0]}"
    uri, warehouse = spark.conf.get(f"{prefix}.uri", None), spark.conf.get(f"{prefix}.warehouse", None)
    return ledger.opened_catalog(parts[0], uri, warehouse), tuple(parts[1:])


_PART = re.compile(r"`((?:[^`]|``)*)`|([^.`]+)")


def split_identifier(identifier: str) -> list[str] | None:
    """A Spark multi-part name's parts, backtick quotes undone
    (``lake.`my ns`.t`` -> ``["lake", "my ns", "t"]``); None when it is not one."""
    parts: list[str] = []
    pos = 0
    while (m := _PART.match(identifier, pos)) is not None:
        parts.append(m.group(1).replace("``", "`") if m.group(1) is not None else m.group(2))
        pos = m.end()
        if pos == len(identifier):
            return parts
        if identifier[pos] != ".":
            return None
        pos += 1
    return None


def load_table(spark: SparkSession, identifier: str) -> Any | None:
    """The table's current metadata through pyiceberg (None: the ledger opened no catalog for it)."""
    catalog, name = catalog_for(spark, identifier)
    return catalog.load_table(name) if catalog is not None else None


def snapshot_summaries(table: Any) -> dict[int, tuple[int | None, dict[str, str]]]:
    """Snapshot id -> (parent id, summary properties) of a pyiceberg table."""
    return {s.snapshot_id: (s.parent_snapshot_id, ledger.summary_dict(s)) for s in table.metadata.snapshots}
