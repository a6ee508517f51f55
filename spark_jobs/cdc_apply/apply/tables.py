"""Target tables: naming, schema from the messages, creation and safe evolution.

A target table holds the source columns plus CDC metadata columns.  Deleted
keys stay as *tombstones* (``_cdc_deleted = true``, the data columns keeping
the row just before the delete for a primary-key change's new key) so that a
late, older event cannot resurrect them; readers use the ``<table>_live``
view (or filter ``NOT _cdc_deleted``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession

from cdc_apply.apply import catalog_reads
from cdc_apply.apply.compact import quote, sql_string
from cdc_apply.config import validate_identifier
from cdc_apply.errors import ConfigError, SchemaIncompatible

META_COLUMNS = {
    "_cdc_position": "string",
    "_cdc_op": "string",
    "_cdc_deleted": "boolean",
    "_cdc_commit_ts": "timestamp",
    "_cdc_tx_id": "string",
    "_cdc_batch_id": "string",
    "_cdc_applied_at": "timestamp",
    "_cdc_col_pos": "map<string,string>",
    "_cdc_change_id": "string",
    "_cdc_inherited": "map<string,string>",
    "_cdc_deleted_by": "string",
}
"""``_cdc_col_pos``: the position that set each data column whose last setting
event is older than the row's ``_cdc_position`` (partial rows; empty for full
images): a late event may fill exactly those columns (compact, merge).
``_cdc_change_id``: the source's id of the change that began the row's life
(for a tombstone: the life its delete ended); ``_cdc_deleted_by``: a
tombstone's delete's; ``_cdc_inherited``: the columns a primary-key change's
new key took from the old key (-> the position they were taken at).
Together they let the two halves of a key change, and a chain of them, meet
across batches (compact.inherit_moved_columns, merge.refresh_inherited)."""
_BAD_COLUMN = re.compile(r"[`\x00-\x1f\x7f]")
_DECIMAL = re.compile(r"^decimal\((\d+),(\d+)\)$")
INT_TYPES = ["tinyint", "smallint", "int", "bigint"]
"""Spark integer types, narrowest first (the safe widenings)."""


def validate_column(name: str, table: str) -> str:
    if not name or len(name) > 128 or _BAD_COLUMN.search(name) or name.lower().startswith("_cdc_"):
        raise ConfigError(
            f"table {table}: column name {name!r} cannot be used (empty, too long, control characters, backticks or the reserved _cdc_ prefix)"
        )
    return name


def target_name(table: str) -> str:
    name = table.lower()
    try:
        return validate_identifier(name, "target table name")
    except ConfigError:
        raise ConfigError(f"source table {table!r} has no valid Iceberg name; rename it or add a mapping") from None


PRIMARY_KEY_PROPERTY = "cdc.primary-key"
SOURCE_TABLE_PROPERTY = "cdc.source-table"
"""The source table (JSON ``[database, schema, table]``) a target holds:
two source tables never share one target (``check_source_table``)."""
COMPLETE_PROPERTY = "cdc.created"
"""Set by the last step of :func:`create_table`: a table without it was
left half-made (a kill during creation) and is finished by the next run."""
PARTIAL_ROWS_PROPERTY = "cdc.partial-rows"
"""``false`` from creation until a batch writes a row with a column no event
set or with columns inherited in a primary-key change (``_cdc_col_pos`` at
``NEVER_SET``, ``_cdc_inherited``), or applies a truncate (which unsets the
columns a newer row had from before it); then ``true`` for good (set before that
batch writes, so a batch that fails later leaves it ``true``: safe).  Only
such rows can take values from a key change's old key later
(``merge.refresh_inherited``), so while it is ``false`` that refresh, two
scans of the table, is not needed.  A table created before the property
existed lacks it and is refreshed as before."""

LIVE_ROWS_PROPERTY = "cdc.live-rows"
"""``<snapshot id>:<n>``: the live rows of that snapshot (the head of the last
audit branch written), as its reconciliation counted them.  The next batch
cut from that snapshot takes its count before the batch from here instead of
a scan of the table; a batch cut from any other snapshot (a compaction, a
truncate, another writer since) scans as before."""

ROW_GROUP_PROPERTY = "write.parquet.row-group-size-bytes"
ROW_GROUP_BYTES = 16 << 20
"""Parquet row groups of every table the project creates (Iceberg's default:
128 MB).  A scan splits a data file only between row groups, so a table of
one file under 128 MB (1M ordinary rows: ~50-80 MB) was read by one task in
every labelling, MERGE and count, whatever the cores; in 16 MB row groups
an 83 MB file was read as 6 splits, in 0.85-1.02 s against 1.31-1.68 s on
2 cores, for the same file size (bench/README, issue 20 step 48).  Iceberg's
adaptive split size does not go below 16 MB, so smaller groups would add no
split."""


def created_properties(source: str, **more: str) -> str:
    """SQL: the ``TBLPROPERTIES`` list of a table the project creates (the
    target, its change log, its history) for ``source``, plus ``more``."""
    props = {
        "format-version": "2",
        "write.wap.enabled": "true",
        ROW_GROUP_PROPERTY: str(ROW_GROUP_BYTES),
        "cdc.source": source,
        **more,
    }
    return ", ".join(f"{sql_string(k)}={sql_string(v)}" for k, v in props.items())


def keep_row_groups(spark: SparkSession, identifier: str, properties: dict[str, str]) -> list[str]:
    """Give a table made before :data:`ROW_GROUP_BYTES` (its ``properties``
    lack the key) the row groups of a new one, for the files written from now
    on; a value someone set is kept.  Returns the change made, for the report."""
    if ROW_GROUP_PROPERTY in properties:
        return []
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({sql_string(ROW_GROUP_PROPERTY)}={sql_string(str(ROW_GROUP_BYTES))})")
    return [f"{ROW_GROUP_PROPERTY} (unset) -> {ROW_GROUP_BYTES}"]


def encode_key(columns: list[str]) -> str:
    """The ``cdc.primary-key`` property: a JSON list (a comma list read
    ``id,x`` back as two keys)."""
    return json.dumps(list(columns), ensure_ascii=False)


def decode_key(value: str | None) -> list[str]:
    """``encode_key``'s inverse; a legacy comma list is still read."""
    if not value:
        return []
    if value.startswith("["):
        return [str(k) for k in json.loads(value)]
    return [k for k in value.split(",") if k]


def source_identity(database: str | None, schema: str | None, table: str) -> str:
    return json.dumps([database, schema, table], ensure_ascii=False, separators=(",", ":"))


def describe_identity(identity: str) -> str:
    return ".".join(p for p in json.loads(identity) if p)


def qualification(identity: str) -> int:
    """How many of database and schema a source identity names."""
    return sum(p is not None for p in json.loads(identity)[:2])


def same_table(a: str, b: str) -> bool:
    """Two source identities that can name one table: the same table name,
    database and schema equal wherever both give them (a CockroachDB topic
    without ``full_table_name`` gives neither)."""
    pa, pb = json.loads(a), json.loads(b)
    return pa[2] == pb[2] and all(x is None or y is None or x == y for x, y in zip(pa[:2], pb[:2], strict=True))


def check_source_table(spark: SparkSession, identifier: str, identity: str, claim: bool = True) -> None:
    """Refuse (ConfigError) to write a source table into a target that holds
    another one; a target from before this property is claimed (``claim``).
    A less or more qualified name of the same table (``same_table``) is the
    same source table: the fuller name is kept."""
    have = table_properties(spark, identifier).get(SOURCE_TABLE_PROPERTY)
    if have is not None and have != identity and same_table(have, identity):
        if claim and qualification(identity) > qualification(have):
            spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({sql_string(SOURCE_TABLE_PROPERTY)}={sql_string(identity)})")
        return
    if have is None and claim:
        spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({sql_string(SOURCE_TABLE_PROPERTY)}={sql_string(identity)})")
    elif have is not None and have != identity:
        raise ConfigError(
            f"{identifier} holds source table {describe_identity(have)}; source table {describe_identity(identity)} "
            f"has the same name and is refused (two source tables never share a target): map it to its own target with "
            f"`tables: {{{describe_identity(identity)}: {{target: <name>}}}}` in the sources file"
        )


def widen(old: str, new: str, column: str) -> str:
    """The type that holds both; SchemaIncompatible when the change would lose data."""
    if old == new:
        return old
    if old in INT_TYPES and new in INT_TYPES:
        return INT_TYPES[max(INT_TYPES.index(old), INT_TYPES.index(new))]
    if {old, new} == {"float", "double"}:
        return "double"
    mo, mn = _DECIMAL.match(old), _DECIMAL.match(new)
    if mo and mn and mo.group(2) == mn.group(2):
        return old if int(mo.group(1)) >= int(mn.group(1)) else new
    raise SchemaIncompatible(f"column {column!r} changed type from {old} to {new}: not a safe widening")


@dataclass
class TableSpec:
    identifier: str  # catalog.namespace.table
    key_columns: list[str]
    columns: dict[str, str]  # source columns in order -> Spark type

    @property
    def short(self) -> str:
        """namespace.table: what procedures and the ledger (pyiceberg) name it by."""
        return self.identifier.split(".", 1)[1]

    @property
    def live_view(self) -> str:
        return f"{self.identifier}_live"


def resolve_columns(declared: list[list[tuple[str, str]]], table: str) -> tuple[dict[str, str], list[str]]:
    """Union of the column lists the batch's messages declare, widened."""
    columns: dict[str, str] = {}
    notes: list[str] = []
    for cols in declared:
        for name, typ in cols:
            validate_column(name, table)
            columns[name] = widen(columns[name], typ, name) if name in columns else typ
    return columns, notes


def namespace_exists(spark: SparkSession, namespace: str) -> bool:
    pyiceberg, name = catalog_reads.catalog_for(spark, namespace)
    if pyiceberg is not None:
        return bool(pyiceberg.namespace_exists(name))
    catalog, ns = namespace.split(".")
    return bool(spark.sql(f"SHOW NAMESPACES IN {catalog} LIKE '{ns}'").collect())


def table_exists(spark: SparkSession, identifier: str) -> bool:
    pyiceberg, name = catalog_reads.catalog_for(spark, identifier)
    if pyiceberg is not None:
        return bool(pyiceberg.table_exists(name))
    catalog, ns, table = identifier.split(".")
    if not namespace_exists(spark, f"{catalog}.{ns}"):
        return False
    return bool(spark.sql(f"SHOW TABLES IN {catalog}.{ns} LIKE '{table}'").collect())


def ensure_namespace(spark: SparkSession, namespace: str) -> None:
    """``CREATE NAMESPACE IF NOT EXISTS``, safe against a concurrent run: the
    JDBC catalog checks and then inserts, so a run that lost the race fails on
    the catalog's unique key (a raw ``UncheckedSQLException``, not Spark's
    already-exists).  A namespace that exists afterwards is what was asked for."""
    try:
        spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {namespace}")
    except Exception:
        if not namespace_exists(spark, namespace):
            raise


def create_table(spark: SparkSession, spec: TableSpec, source: str, merge_mode: str | None = None, identity: str | None = None) -> None:
    """Create the table, or finish one a killed run left half-made: every step
    is idempotent and :data:`COMPLETE_PROPERTY` is set last."""
    cols = [f"{quote(c)} {t}{' NOT NULL' if c in spec.key_columns else ''}" for c, t in spec.columns.items()]
    cols += [f"{c} {t}{' NOT NULL' if c == '_cdc_position' else ''}" for c, t in META_COLUMNS.items()]
    props = {PRIMARY_KEY_PROPERTY: encode_key(spec.key_columns), PARTIAL_ROWS_PROPERTY: "false"}
    if merge_mode:
        props["write.merge.mode"] = merge_mode
    if identity:
        props[SOURCE_TABLE_PROPERTY] = identity
    ensure_namespace(spark, spec.identifier.rsplit(".", 1)[0])
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {spec.identifier} ({', '.join(cols)}) USING iceberg "
        f"TBLPROPERTIES ({created_properties(source, **props)})"
    )
    finish_table(spark, spec)


def is_complete(spark: SparkSession, identifier: str) -> bool:
    return table_properties(spark, identifier).get(COMPLETE_PROPERTY) == "true"


def finish_table(spark: SparkSession, spec: TableSpec) -> None:
    """The steps of creation after CREATE TABLE, each safe to repeat: the key
    as identifier fields, a first (empty) snapshot so that audit branches can
    be created from main, the live view, then the completion mark."""
    spark.sql(f"ALTER TABLE {spec.identifier} SET IDENTIFIER FIELDS {', '.join(quote(k) for k in spec.key_columns)}")
    if not spark.sql(f"SELECT 1 FROM {spec.identifier}.refs WHERE name = 'main'").collect():
        spark.table(spec.identifier).limit(0).writeTo(spec.identifier).append()
    refresh_live_view(spark, spec)
    spark.sql(f"ALTER TABLE {spec.identifier} SET TBLPROPERTIES ({sql_string(COMPLETE_PROPERTY)}='true')")


def refresh_live_view(spark: SparkSession, spec: TableSpec) -> None:
    cols = ", ".join(quote(c) for c in spec.columns)
    spark.sql(f"CREATE OR REPLACE VIEW {spec.live_view} AS SELECT {cols} FROM {spec.identifier} WHERE NOT _cdc_deleted")


def table_properties(spark: SparkSession, identifier: str) -> dict[str, str]:
    """The table's own properties (Iceberg's ``properties``: Spark adds a few
    reserved ones, e.g. ``format``, that no caller reads)."""
    table = catalog_reads.load_table(spark, identifier)
    if table is not None:
        return dict(table.properties)
    return {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES {identifier}").collect()}


def merge_mode(spark: SparkSession, identifier: str, properties: dict[str, str] | None = None) -> str:
    """The table's ``write.merge.mode`` (Iceberg's default: copy-on-write);
    ``properties``: the table's, when the caller has read them."""
    return (properties if properties is not None else table_properties(spark, identifier)).get("write.merge.mode", "copy-on-write")


MERGE_ON_READ_MAX_SHARE = 0.10
"""``merge_mode: auto`` writes merge-on-read when the batch's stored keys are at
most this share of the table's live rows.  Measured into 1M rows (bench/README.md,
issue 20 step 10): 5 % of the rows 30.2 s against 38.3 s copy-on-write, 18 %
49.8 s against 53.5 s; the table read back through 50k position deletes was
0.05-0.15 s slower per full scan."""


def may_hold_partial_rows(properties: dict[str, str]) -> bool:
    """Whether a table (its properties) may hold rows a key change's old key
    can still fill (:data:`PARTIAL_ROWS_PROPERTY`; absent: it may)."""
    return properties.get(PARTIAL_ROWS_PROPERTY) != "false"


def mark_partial_rows(spark: SparkSession, identifier: str, properties: dict[str, str]) -> list[str]:
    """Record that the table may hold partial rows from now on (before the
    batch that writes the first one); returns the change made, for the report."""
    if properties.get(PARTIAL_ROWS_PROPERTY) in (None, "true"):
        return []
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({sql_string(PARTIAL_ROWS_PROPERTY)}='true')")
    return [f"{PARTIAL_ROWS_PROPERTY} false -> true"]


def counted_live_rows(properties: dict[str, str], snapshot_id: int | None) -> int | None:
    """The live rows of ``snapshot_id`` as the last reconciliation counted them
    (:data:`LIVE_ROWS_PROPERTY`); None when it counted another snapshot."""
    counted_snapshot = properties.get(LIVE_ROWS_PROPERTY, "").partition(":")[0]
    return recorded_live_rows(properties) if snapshot_id is not None and counted_snapshot == str(snapshot_id) else None


def recorded_live_rows(properties: dict[str, str]) -> int | None:
    """The live rows the last reconciliation counted (:data:`LIVE_ROWS_PROPERTY`),
    of whichever snapshot: the table's size, for a choice of how to run."""
    n = properties.get(LIVE_ROWS_PROPERTY, "").partition(":")[2]
    return int(n) if n.isdigit() else None


def live_rows(rows: DataFrame) -> int:
    """The rows of a table's snapshot that are not tombstones (``_cdc_deleted``
    false): all its rows, less those whose ``_cdc_deleted`` is true or null.
    Iceberg answers the first count from its manifests' record counts (while
    no delete file applies) and reads the second only from the data files
    whose column bounds admit a tombstone: a batch's tombstones are in the
    files it wrote, so a batch into a large table does not read all of it."""
    return rows.count() - rows.where("_cdc_deleted IS NULL OR _cdc_deleted").count()


def record_live_rows(spark: SparkSession, identifier: str, snapshot_id: int, n: int) -> None:
    """Keep a counted ``n`` live rows of ``snapshot_id`` for the next batch
    (a metadata-only commit: table properties, no snapshot)."""
    value = sql_string(f"{snapshot_id}:{n}")
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ({sql_string(LIVE_ROWS_PROPERTY)}={value})")


def auto_merge_mode(stored_keys: int, table_rows: int) -> str:
    """The cheaper write for this batch.  Copy-on-write rewrites every data
    file holding one of the batch's stored keys: a few keys scattered over a
    large table rewrite nearly all of it (an hourly batch), where merge-on-read
    writes a position delete per key.  Many keys touch most files either way,
    and then copy-on-write leaves no delete files for every later read to merge."""
    return "merge-on-read" if stored_keys <= table_rows * MERGE_ON_READ_MAX_SHARE else "copy-on-write"


def keep_merge_mode(spark: SparkSession, identifier: str, mode: str, properties: dict[str, str] | None = None) -> list[str]:
    """Set ``write.merge.mode`` when the table's differs from the source's
    (config.MERGE_MODES, validated); returns the change made, for the report."""
    have = merge_mode(spark, identifier, properties)
    if have == mode:
        return []
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ('write.merge.mode'={sql_string(mode)})")
    return [f"write.merge.mode {have} -> {mode}"]


def existing_schema(spark: SparkSession, identifier: str) -> tuple[dict[str, str], list[str]]:
    fields = spark.table(identifier).schema.fields
    cols = {f.name: f.dataType.simpleString() for f in fields if not f.name.startswith("_cdc_")}
    props = table_properties(spark, identifier)
    keys = decode_key(props.get(PRIMARY_KEY_PROPERTY))
    return cols, keys


def evolve(spark: SparkSession, spec: TableSpec) -> list[str]:
    """Add new columns and apply safe widenings; refuse anything else.

    Returns the changes made (for the job's report).  Columns the table has but
    the batch does not declare are kept (old sources may omit them).
    """
    have, keys = existing_schema(spark, spec.identifier)
    changes = []
    meta_have = {f.name for f in spark.table(spec.identifier).schema.fields if f.name.startswith("_cdc_")}
    for col, typ in META_COLUMNS.items():
        if col not in meta_have:  # a table made by an earlier version of the project
            spark.sql(f"ALTER TABLE {spec.identifier} ADD COLUMN {col} {typ}")
            changes.append(f"added CDC column {col}")
    if keys and [k.lower() for k in keys] != [k.lower() for k in spec.key_columns]:
        raise SchemaIncompatible(
            f"{spec.identifier}: primary key changed from {keys} to {spec.key_columns}; a key change needs a rebuild of the table"
        )
    lower = {c.lower(): c for c in have}
    merged = dict(have)
    for col, typ in spec.columns.items():
        existing = lower.get(col.lower())
        if existing is None:
            spark.sql(f"ALTER TABLE {spec.identifier} ADD COLUMN {quote(col)} {typ}")
            changes.append(f"added column {col} {typ}")
            merged[col] = typ
            continue
        old = have[existing]
        wide = widen(old, typ, col)
        if wide != old:
            spark.sql(f"ALTER TABLE {spec.identifier} ALTER COLUMN {quote(existing)} TYPE {wide}")
            changes.append(f"widened column {existing} {old} -> {wide}")
            merged[existing] = wide
    spec.columns = merged
    if changes:
        refresh_live_view(spark, spec)
    return changes


def stored_column_types(spark: SparkSession, catalog: str, namespace: str) -> dict[str, dict[str, str]]:
    """The source columns and Spark types of every table of a namespace, by
    table name: read once per batch on the driver, they type the messages
    archived without a schema."""
    if not spark.sql(f"SHOW NAMESPACES IN {catalog} LIKE '{namespace}'").collect():
        return {}
    out = {}
    for row in spark.sql(f"SHOW TABLES IN {catalog}.{namespace}").collect():
        name = row["tableName"]
        if row["isTemporary"] or name.endswith("_live"):
            continue
        fields = spark.table(f"{catalog}.{namespace}.{name}").schema.fields
        out[name] = {f.name: f.dataType.simpleString() for f in fields if not f.name.startswith("_cdc_")}
    return out
