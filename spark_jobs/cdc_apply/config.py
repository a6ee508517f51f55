"""Typed settings, read from the environment with defaults under one
project-local folder (``.cdc/``).  Nothing here holds a secret: credentials for
object storage or a REST catalog come from the environment only.

Every setting fails fast with a message that names the variable to fix.
"""

from __future__ import annotations

import getpass
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cdc_apply.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ICEBERG_SPARK_RUNTIME = "org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:1.11.0"
SQLITE_JDBC = "org.xerial:sqlite-jdbc:3.50.3.0"
JARS = (ICEBERG_SPARK_RUNTIME, SQLITE_JDBC)
# Object storage: S3FileIO with its AWS SDK v2 for table files
# (runtime.spark_conf.extra_jar_coordinates adds it to spark.jars only when S3 is
# configured; ./dev setup fetches it).  Archives are read by pyarrow.
ICEBERG_AWS_BUNDLE = "org.apache.iceberg:iceberg-aws-bundle:1.11.0"
S3_JARS = (ICEBERG_AWS_BUNDLE,)

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def validate_identifier(name: str, what: str) -> str:
    """Identifiers that reach SQL (namespaces, tables, branches) must be plain."""
    if not isinstance(name, str) or not _IDENT.match(name):
        raise ConfigError(
            f"{what} {name!r} is not a valid identifier: use letters, digits and '_' "
            "(starting with a letter or '_', at most 128 characters)"
        )
    return name


def pip_spark_home() -> Path:
    """The folder of the pip-installed PySpark (its bin/, jars/)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def spark_home(env: Mapping[str, str] | None = None) -> Path:
    """The Spark that spark-submit runs, as its launcher finds it: SPARK_HOME
    when set, else the pip-installed PySpark."""
    env = os.environ if env is None else env
    return Path(env["SPARK_HOME"]) if env.get("SPARK_HOME") else pip_spark_home()


def _env_number(name: str, default: float, *, zero: bool = False, unit: str = "days") -> float:
    """A number of days (or another ``unit``) from the environment
    (``default`` when unset), refused once, naming the variable, when it is
    not a number or is negative (or zero, unless ``zero`` allows it)."""
    text = _env(name, "").strip()
    try:
        number = float(text) if text else default
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of {unit} (default {default:g})") from None
    if number < 0 or (number == 0 and not zero):
        raise ConfigError(f"{name} must be {'>= 0' if zero else 'above 0'} {unit}, got {number:g}")
    return number


def _env(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


S3_SCHEMES = ("s3", "s3a", "s3n")


def scheme_of(uri: str | os.PathLike | None) -> str:
    """The URI scheme in lower case ('' for a plain path)."""
    text = str(uri or "")
    if "://" not in text:
        return ""
    return text.split("://", 1)[0].lower()


def is_object_store_uri(uri: str | os.PathLike | None) -> bool:
    return scheme_of(uri) in S3_SCHEMES


@dataclass(frozen=True)
class S3Options:
    """Where the object store is, as the driver sees it (``CDC_S3_ENDPOINT``,
    e.g. http://127.0.0.1:9000, None for AWS itself; ``AWS_REGION``): shipped
    to executors, whose environment may lack them.  Credentials are not in
    it: each process reads the AWS default chain."""

    endpoint: str | None = None
    region: str | None = None

    @property
    def path_style(self) -> bool:
        """Path-style addressing (http://host/bucket/key) with a custom endpoint,
        as S3-compatible servers expect; virtual-hosted style on AWS itself."""
        return self.endpoint is not None

    @classmethod
    def from_env(cls) -> S3Options:
        return cls(endpoint=_env("CDC_S3_ENDPOINT", "") or None, region=_env("AWS_REGION", "") or None)


@dataclass(frozen=True)
class Settings:
    """Where things live.  Defaults: everything under ``$CDC_HOME`` (``.cdc/``)."""

    home: Path
    archive_dir: str
    """Root of the change archives; each source reads ``<archive_dir>/<source>/``."""
    warehouse: str
    """Iceberg warehouse location (a path, file:// or s3a:// URI)."""
    catalog_name: str
    """One name for the catalog on both sides (Spark and pyiceberg)."""
    catalog_type: str
    """'jdbc' (SQLite file, the embedded default) or 'rest'."""
    catalog_uri: str
    """JDBC URL (jdbc:sqlite:...) or REST endpoint (http://...)."""
    jars_dir: Path
    sources_file: Path
    spark_master: str
    spark_remote: str | None = None
    """A Spark Connect server (``sc://host:port``) that jobs attach to instead
    of starting their own driver (see ``cdc connect-server``), or ``local``:
    this home's warm driver, started on first use (runtime/warm_driver.py)."""
    audit_namespace: str = "cdc_audit"
    extra_spark_conf: dict[str, str] = field(default_factory=dict)
    verify_applied: str = "size"
    """How discovery checks that applied files did not change: 'size' (a
    listing; their SHA-256 is read only when the size differs) or 'sha256'
    (every applied file is read again on every run)."""
    s3: S3Options = field(default_factory=S3Options)
    driver_memory: str = "3g"
    """``CDC_SPARK_DRIVER_MEMORY``: heap of every driver JVM the project starts."""
    asof_days: float = 7.0
    """``CDC_ASOF_RETENTION_DAYS``: how long a publish's ``cdc_<batch>`` tag keeps
    its snapshot through expiry for ``cdc as-of`` (every version's data files
    stay that long: with copy-on-write, an hourly batch's rewrite per hour)."""
    log_verbose: bool = False
    """``CDC_LOG_VERBOSE=1``: library chatter back in the job's log (runtime/logs.py)."""
    worker_python: str = field(default_factory=lambda: sys.executable)
    """``CDC_PYSPARK_PYTHON``: the Python of the driver and its workers (the
    executors' interpreter path on a cluster)."""
    expectations_dir: Path = PROJECT_ROOT / "include" / "expectations"
    """``CDC_EXPECTATIONS_DIR``: the users' Great Expectations suites."""
    warm_driver_idle_seconds: float = 5400.0
    """``CDC_WARM_DRIVER_IDLE_SECONDS``: a warm driver ends after this long
    without a job (90 min: an hourly schedule keeps it warm); 0 turns it off,
    and the DAG's tasks on a local master spark-submit a driver each."""

    @classmethod
    def from_env(cls) -> Settings:
        home = Path(_env("CDC_HOME", str(PROJECT_ROOT / ".cdc"))).resolve()
        catalog_type = _env("CDC_CATALOG_TYPE", "jdbc").lower()
        if catalog_type not in ("jdbc", "rest"):
            raise ConfigError(f"CDC_CATALOG_TYPE={catalog_type!r}: use 'jdbc' or 'rest'")
        default_uri = f"jdbc:sqlite:{home / 'catalog.db'}" if catalog_type == "jdbc" else ""
        catalog_uri = _env("CDC_CATALOG_URI", default_uri)
        if not catalog_uri:
            raise ConfigError("CDC_CATALOG_URI must be set for CDC_CATALOG_TYPE=rest (e.g. http://127.0.0.1:8181)")
        if catalog_type == "jdbc" and not catalog_uri.startswith("jdbc:sqlite:") and not catalog_uri.startswith("jdbc:postgresql:"):
            raise ConfigError(f"CDC_CATALOG_URI={catalog_uri!r}: a jdbc catalog needs jdbc:sqlite:<path> or jdbc:postgresql://...")
        verify_applied = _env("CDC_VERIFY_APPLIED", "size").lower()
        if verify_applied not in ("size", "sha256"):
            raise ConfigError(f"CDC_VERIFY_APPLIED={verify_applied!r}: use 'size' or 'sha256'")
        spark_remote = _env("CDC_SPARK_REMOTE", "") or None
        if spark_remote is not None and not spark_remote.startswith("sc://") and spark_remote != "local":
            raise ConfigError(
                f"CDC_SPARK_REMOTE={spark_remote!r}: a Spark Connect URL looks like sc://host:15002, or 'local' for this "
                "home's warm driver (unset it to start a driver per job)"
            )
        extra = {}
        for key, value in os.environ.items():
            if key.startswith("CDC_SPARK_CONF_"):
                # CDC_SPARK_CONF_spark__sql__shuffle__partitions=4 -> spark.sql.shuffle.partitions
                extra[key[len("CDC_SPARK_CONF_") :].replace("__", ".")] = value
        settings = cls(
            home=home,
            archive_dir=_env("CDC_ARCHIVE_DIR", str(home / "archive")),
            warehouse=_env("CDC_WAREHOUSE", (home / "warehouse").as_uri()),
            catalog_name=validate_identifier(_env("CDC_CATALOG_NAME", "lake"), "CDC_CATALOG_NAME"),
            catalog_type=catalog_type,
            catalog_uri=catalog_uri,
            jars_dir=Path(_env("CDC_JARS_DIR", str(home / "jars"))),
            sources_file=Path(_env("CDC_SOURCES_FILE", str(PROJECT_ROOT / "include" / "sources.yaml"))),
            spark_master=_env("CDC_SPARK_MASTER", "local[*]"),
            spark_remote=spark_remote,
            audit_namespace=validate_identifier(_env("CDC_AUDIT_NAMESPACE", "cdc_audit"), "CDC_AUDIT_NAMESPACE"),
            extra_spark_conf=extra,
            verify_applied=verify_applied,
            s3=S3Options.from_env(),
            driver_memory=_env("CDC_SPARK_DRIVER_MEMORY", "3g"),
            asof_days=_env_number("CDC_ASOF_RETENTION_DAYS", 7.0),
            log_verbose=_env("CDC_LOG_VERBOSE", "").strip().lower() in {"1", "true", "yes", "on"},
            worker_python=_env("CDC_PYSPARK_PYTHON", sys.executable),
            expectations_dir=Path(_env("CDC_EXPECTATIONS_DIR", str(PROJECT_ROOT / "include" / "expectations"))),
            warm_driver_idle_seconds=_env_number("CDC_WARM_DRIVER_IDLE_SECONDS", 5400.0, zero=True, unit="seconds"),
        )
        return settings

    # -- derived ---------------------------------------------------------------
    @property
    def sqlite_path(self) -> Path | None:
        if self.catalog_type == "jdbc" and self.catalog_uri.startswith("jdbc:sqlite:"):
            return Path(self.catalog_uri[len("jdbc:sqlite:") :])
        return None

    @property
    def warehouse_on_object_store(self) -> bool:
        return is_object_store_uri(self.warehouse)

    @property
    def archive_on_object_store(self) -> bool:
        return is_object_store_uri(self.archive_dir)

    def pyiceberg_properties(self) -> dict[str, str]:
        """Properties for pyiceberg.catalog.load_catalog, matching Spark's catalog."""
        if self.catalog_type == "jdbc":
            if self.sqlite_path is None:
                raise ConfigError("pyiceberg reads a jdbc catalog only over SQLite here")
            props = {"type": "sql", "uri": f"sqlite:///{self.sqlite_path}", "warehouse": self.warehouse}
        else:
            props = {"type": "rest", "uri": self.catalog_uri, "warehouse": self.warehouse}
        for key, env in (
            ("s3.endpoint", "CDC_S3_ENDPOINT"),
            ("s3.access-key-id", "AWS_ACCESS_KEY_ID"),
            ("s3.secret-access-key", "AWS_SECRET_ACCESS_KEY"),
        ):
            if os.environ.get(env):
                props[key] = os.environ[env]
        if self.s3.region:
            props["s3.region"] = self.s3.region
        if uses_object_store(self):
            props["s3.path-style-access"] = "true" if self.s3.path_style else "false"
        return props


# ------------------------------------------------------------------------------
# Sources: which archive folder holds which format, and table keys.


MERGE_MODES = ("auto", "copy-on-write", "merge-on-read")
ORDERINGS = ("log", "arrival")
PUBLISH_MODES = ("transactions", "events")
NO_TRANSACTIONS = {
    # formats whose messages never say when a source transaction is complete (apply/transactions.py)
    "sqlserver_ces": "CES events carry their transaction's commit LSN but nothing says how many events it has or which is its last",
}
TRANSACTIONS_BY_DEFAULT = ("debezium_postgres", "debezium_sqlserver", "qlik")
"""CockroachDB publishes by transactions only when asked: its resolved
timestamps are a changefeed option, without which every event would wait."""


@dataclass(frozen=True)
class SourceConfig:
    name: str
    format: str
    namespace: str
    """Iceberg namespace the source's tables are written to."""
    primary_keys: dict[str, list[str]] = field(default_factory=dict)
    quarantine_max_share: float = 0.05
    """Fail the batch when more than this share of its messages is quarantined."""
    merge_mode: str = "auto"
    """``write.merge.mode`` of the source's tables: ``auto`` chooses per batch
    (``tables.auto_merge_mode``: merge-on-read when the batch updates few of
    the table's rows, copy-on-write otherwise); ``copy-on-write`` /
    ``merge-on-read`` keep every table at that mode."""
    ordering: str = "log"
    """How events of a key are ordered: ``log`` (the source's log position, e.g.
    CockroachDB's HLC ``mvcc_timestamp`` / ``updated``) or ``arrival`` (archive
    file path, then line: for changefeeds without timestamps; see README)."""
    changelog: bool = True
    """Append every decoded change of a table to ``<namespace>.<table>_changes``
    (``apply/changelog.py``), published with the table; ``changelog: false`` turns it off."""
    history: dict[str, str] = field(default_factory=dict)
    """Source table -> ``scd2`` for tables that keep an SCD type 2 history
    ``<namespace>.<table>_history`` (``apply/history.py``), derived from the change log."""
    publish: str = "events"
    """``transactions``: readers never see part of a source transaction (events of
    one not complete among the lines read are held, and tables that shared one
    publish together; ``apply/transactions.py``); ``events``: every decoded
    event applies at once.  Default: ``transactions`` where the format allows it."""
    max_hold_hours: float = 6.0
    """``publish: transactions``: the batch fails, naming them, once a
    transaction has been held this long (its END marker or last event never
    came: not archived, or quarantined)."""
    envelope: str | None = None
    """CockroachDB only: ``row`` reads a key without a value as an
    ``envelope=row`` delete (it is otherwise refused as ``key_only``)."""
    forced_transactions: frozenset[str] = frozenset()
    """Never from the sources file: a rebuild's replay (``rebuild.py``) lets
    these source transactions through as they are, as an operator's *force*
    did on the live source (``transactions.FORCED_KEY``), where the replay's
    own clock would hold them."""

    def decode_options(self) -> dict[str, str]:
        """The options decoders read (``DecodeContext.options``)."""
        return {"ordering": self.ordering, **({"envelope": self.envelope} if self.envelope else {})}

    columns: dict[str, dict[str, str]] = field(default_factory=dict)
    """Declared column types by table (``columns:`` next to ``primary_key``):
    Spark type names or Debezium semantic names; they type messages archived
    without a schema (JsonConverter ``schemas.enable=false``)."""
    targets: dict[str, str] = field(default_factory=dict)
    """Source table (``db.schema.table``, ``schema.table`` or ``table``) -> target
    table name, for names that collide or are not valid Iceberg names."""

    def lookup(self, mapping: Mapping[str, Any], database: str | None, schema: str | None, table: str) -> Any:
        """The entry of ``mapping`` for a source table, most specific name first."""
        for cand in (f"{database}.{schema}.{table}", f"{schema}.{table}", table):
            if cand in mapping:
                return mapping[cand]
        return None

    def archive_path(self, settings: Settings) -> str:
        return f"{settings.archive_dir.rstrip('/')}/{self.name}"


def load_sources(settings: Settings) -> dict[str, SourceConfig]:
    """Every source of the sources file, checked whole: a configuration error
    names the file, the source and what to fix.  Long because it checks each
    key of a source in the file's order, one refusal message each."""
    from cdc_apply.model import Format

    path = settings.sources_file
    if not path.exists():
        raise ConfigError(f"sources file {path} does not exist: create it or point CDC_SOURCES_FILE at one")
    raw: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    sources = {}
    for name, spec in (raw.get("sources") or {}).items():
        validate_identifier(name, f"source name in {path}")
        if not isinstance(spec, dict) or "format" not in spec:
            raise ConfigError(f"{path}: source {name!r} needs a 'format' (one of {[f.value for f in Format]})")
        try:
            fmt = Format(spec["format"]).value
        except ValueError:
            raise ConfigError(
                f"{path}: source {name!r} has unknown format {spec['format']!r}; use one of {[f.value for f in Format]}"
            ) from None
        keys, columns, targets, history = {}, {}, {}, {}
        for table, tspec in (spec.get("tables") or {}).items():
            pk = (tspec or {}).get("primary_key")
            target = (tspec or {}).get("target")
            if target is not None:
                targets[str(table)] = validate_identifier(str(target).lower(), f"{path}: target of table {table!r} of source {name!r}")
            if (tspec or {}).get("history") is not None:
                history[str(table)] = _history(path, name, str(table), tspec["history"], spec.get("changelog", True))
            if pk is None and (target is not None or str(table) in history):
                continue
            if not pk or not isinstance(pk, list):
                raise ConfigError(f"{path}: table {table!r} of source {name!r} needs primary_key: [col, ...] (and/or target: <name>)")
            keys[str(table)] = [str(c) for c in pk]
            if (tspec or {}).get("columns") is not None:
                columns[str(table)] = _declared_columns(path, name, str(table), tspec["columns"])
        merge_mode = spec.get("merge_mode", "auto")
        if merge_mode not in MERGE_MODES:
            raise ConfigError(f"{path}: merge_mode of source {name!r} is {merge_mode!r}; use one of {list(MERGE_MODES)} (or leave it out)")
        ordering = spec.get("ordering", "log")
        if ordering not in ORDERINGS:
            raise ConfigError(
                f"{path}: ordering of source {name!r} is {ordering!r}; use one of {list(ORDERINGS)} (or leave it out for log)"
            )
        if ordering != "log" and fmt != "cockroachdb":
            raise ConfigError(
                f"{path}: ordering of source {name!r}: only a cockroachdb source can be applied in arrival order; leave it out"
            )
        envelope = spec.get("envelope")
        if envelope is not None and (fmt != "cockroachdb" or envelope != "row"):
            raise ConfigError(
                f"{path}: envelope of source {name!r} is {envelope!r}: only a cockroachdb source takes it, and only "
                "'row' (key_only changefeeds carry no row image: recreate them with envelope=wrapped or enriched)"
            )
        changelog = spec.get("changelog", True)
        if not isinstance(changelog, bool):
            raise ConfigError(f"{path}: changelog of source {name!r} is {changelog!r}; use true or false (or leave it out: true)")
        publish = spec.get("publish", "transactions" if fmt in TRANSACTIONS_BY_DEFAULT else "events")
        if publish not in PUBLISH_MODES:
            raise ConfigError(f"{path}: publish of source {name!r} is {publish!r}; use one of {list(PUBLISH_MODES)} (or leave it out)")
        if publish == "transactions" and fmt in NO_TRANSACTIONS:
            raise ConfigError(
                f"{path}: source {name!r} asks for publish: transactions, which format {fmt} cannot give: {NO_TRANSACTIONS[fmt]}; "
                "use publish: events (or leave it out)"
            )
        if publish == "transactions" and fmt == "cockroachdb" and spec.get("ordering", "log") != "log":
            raise ConfigError(
                f"{path}: source {name!r} asks for publish: transactions and ordering: arrival; the resolved watermark "
                "is a timestamp, arrival positions are not: use ordering: log (or publish: events)"
            )
        try:
            max_hold = float(spec.get("transaction_max_hold_hours", 6.0))
        except (TypeError, ValueError):
            max_hold = -1.0
        if not max_hold > 0:
            raise ConfigError(
                f"{path}: transaction_max_hold_hours of source {name!r} is {spec.get('transaction_max_hold_hours')!r}; use a number of hours > 0"
            )
        share = float(spec.get("quarantine_max_share", 0.05))
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"{path}: quarantine_max_share of source {name!r} must be between 0 and 1")
        sources[name] = SourceConfig(
            name=name,
            format=fmt,
            namespace=validate_identifier(spec.get("namespace", name), f"namespace of source {name!r}"),
            primary_keys=keys,
            targets=targets,
            quarantine_max_share=share,
            merge_mode=merge_mode,
            ordering=ordering,
            envelope=envelope,
            changelog=changelog,
            columns=columns,
            history=history,
            publish=publish,
            max_hold_hours=max_hold,
        )
    return sources


def _history(path: Path, source: str, table: str, kind: Any, changelog: Any) -> str:
    """A table's ``history:`` option: ``scd2`` (apply/history.py), which is
    derived from the change log."""
    if kind != "scd2":
        raise ConfigError(f"{path}: history of table {table!r} of source {source!r} is {kind!r}; use scd2 (or leave it out)")
    if changelog is False:
        raise ConfigError(
            f"{path}: table {table!r} of source {source!r} asks for history: scd2, which is built from the change log; "
            "remove changelog: false from the source"
        )
    return "scd2"


def _declared_columns(path: Path, source: str, table: str, spec: Any) -> dict[str, str]:
    """``columns: {col: type, ...}`` of a table, each type a Spark type name
    (``int``, ``decimal(12,2)``, ``timestamp_ntz``, ...) or a Debezium semantic
    name (``io.debezium.time.MicroTimestamp`` or ``MicroTimestamp``, ...)."""
    from cdc_apply.model import SEMANTIC_TYPES, is_supported_type

    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{path}: columns of table {table!r} of source {source!r} must be a mapping {{column: type, ...}}")
    out = {}
    for col, typ in spec.items():
        typ = str(typ).replace(" ", "").lower() if not str(typ).startswith(("io.", "org.")) and str(typ) not in SEMANTIC_TYPES else str(typ)
        if not (is_supported_type(typ) or typ in SEMANTIC_TYPES):
            raise ConfigError(
                f"{path}: column {col!r} of table {table!r} of source {source!r} has unknown type {typ!r}; use a Spark type "
                "(boolean, tinyint, smallint, int, bigint, float, double, decimal(p,s), string, binary, date, timestamp, timestamp_ntz) "
                "or a Debezium semantic type (e.g. io.debezium.time.MicroTimestamp, io.debezium.time.Date, io.debezium.time.MicroTime)"
            )
        out[str(col)] = typ
    return out


def get_source(settings: Settings, name: str) -> SourceConfig:
    sources = load_sources(settings)
    if name not in sources:
        raise ConfigError(f"unknown source {name!r}; {settings.sources_file} defines {sorted(sources)}")
    return sources[name]


def uses_object_store(settings: Settings) -> bool:
    """An object store is configured: ``CDC_S3_ENDPOINT`` is set, or the
    warehouse or the archive is an ``s3://`` / ``s3a://`` URI."""
    return settings.s3.endpoint is not None or settings.warehouse_on_object_store or settings.archive_on_object_store


@dataclass(frozen=True)
class Retention:
    snapshot_days: float = 7.0
    tombstone_days: float = 7.0
    orphan_days: float = 3.0  # never below the longest write: files of running writes look orphaned
    retain_last: int = 20

    @classmethod
    def from_env(cls, snapshot_days: float | None = None, tombstone_days: float | None = None) -> Retention:
        """Explicit values first, then ``CDC_SNAPSHOT_RETENTION_DAYS`` /
        ``CDC_TOMBSTONE_RETENTION_DAYS``, then the defaults (7 days each)."""

        def pick(value: float | None, env: str, default: float) -> float:
            if value is None:
                return _env_number(env, default, zero=True)
            if float(value) < 0:
                raise ConfigError(f"{env} must be >= 0 days, got {float(value):g}")
            return float(value)

        return cls(
            snapshot_days=pick(snapshot_days, "CDC_SNAPSHOT_RETENTION_DAYS", cls.snapshot_days),
            tombstone_days=pick(tombstone_days, "CDC_TOMBSTONE_RETENTION_DAYS", cls.tombstone_days),
        )


def operator_name() -> str:
    """Who runs this (recorded with an override): CDC_OPERATOR, the Airflow
    DAG owner, else the OS user."""
    for var in ("CDC_OPERATOR", "AIRFLOW_CTX_DAG_OWNER"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        return getpass.getuser()
    except Exception:  # no user database entry (containers)
        return "unknown"
