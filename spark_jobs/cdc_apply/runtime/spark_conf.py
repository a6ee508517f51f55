"""The one place Spark conf is made: the Iceberg catalog, the object store,
jars, and the driver defaults.  Local sessions, spark-submit jobs and the
Spark Connect server all take their conf from here, so a job behaves the same
whichever driver runs it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from pyspark.sql import SparkSession

from cdc_apply.config import JARS, S3_JARS, Settings, spark_home, uses_object_store
from cdc_apply.errors import ConfigError
from cdc_apply.runtime.class_archive import JAVA_OPTIONS
from cdc_apply.runtime.logs import spark_conf as quiet_spark

S3_FILE_IO = "org.apache.iceberg.aws.s3.S3FileIO"

# A spark-submit job's JVM lives for one batch (seconds to minutes) and shares
# few cores with the Python decode workers: the C2 compiler's threads compete
# with the work and its code arrives too late to pay off.  Measured on 2 cores
# (bench/README.md): a 1k-event hourly job 27.9 -> 22 s, a 200k-event job
# 58.6 -> 51.1 s.  A Connect server lives for days and keeps the default.
# C1 only also shrinks the JVM's default code cache from 240 MB to 48 MB, and
# a driver that outgrows it dies ("Out of space in CodeCache for adapters"):
# a session that ran a few dozen small batches did.  A job of many tables is
# such a driver, so it keeps the tiered default's 240 MB (reserved address
# space, committed only as code is compiled).
# To drop both: CDC_SPARK_CONF_spark__driver__extraJavaOptions= (empty).
DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"


def session_defaults(settings: Settings) -> dict[str, str]:
    """Sizing every driver the project starts gets (overridden by
    ``CDC_SPARK_CONF_*``, which ``iceberg_conf`` applies last)."""
    return {
        "spark.sql.shuffle.partitions": "8",
        "spark.default.parallelism": "4",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.adaptive.enabled": "true",
        # the driver JVM (and, on local[*], the executors): Spark's 1 GB default
        # runs out of heap on an hour of large archive files (see bench/README.md)
        "spark.driver.memory": settings.driver_memory,
        # a long-lived session (Spark Connect, a soak, a backfill of many
        # hours) keeps every query's plan for the UI: the apply's plans are
        # large, and 1,000 of them filled a 3 GB heap in a real-source soak
        "spark.sql.ui.retainedExecutions": "100",
        "spark.ui.retainedJobs": "200",
        "spark.ui.retainedStages": "200",
        # a plan's text (for the UI and errors) past 1 MB is cut, not built:
        # a cached frame prints the plan under it, and the apply caches in steps
        "spark.sql.maxPlanStringLength": "1000000",
        # PySpark's call-site capture for DataFrame errors, off: with it, every
        # Column function the apply builds (thousands a batch) also walks the
        # Python stack, tries to import IPython and makes ~6 Py4J calls to
        # record where it was called from.  300 expressions: 0.65-1.1 s
        # without, 2.2-3.1 s with; the hourly job 0.6 s faster (bench/README,
        # step 13).  An expression's error still names its failing function
        # and the action's Python traceback; only the "== DataFrame ==" call
        # site is gone.  To have it: CDC_SPARK_CONF_spark__python__sql__dataFrameDebugging__enabled=true
        "spark.python.sql.dataFrameDebugging.enabled": "false",
    }


SMALL_BATCH_MESSAGES = 10_000
"""A batch of at most this many messages runs as a small batch (``small_batch_conf``)."""
INTERPRETED_CONF = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
"""Spark evaluates the plan's operators and expressions as they are, without
generating Java for them.  A small batch's rows are too few to repay the code:
each batch's queries had Spark generate and compile ~160 classes (Janino), and
the JVM's JIT then compiles their methods and the compiler's own: the JIT took
about half of a warm small batch's CPU.  Interpreted, a warm 2k-event batch
took 6.25 s against 8.60 s, a 10k-event one 7.27 s against 9.81 s (medians of
five, bench/README step 31).  ``factoryMode`` is an internal key (Spark's own
tests run every expression both ways with it); its interpreted path is the
one Spark falls back to when generated code does not compile."""
SMALL_BATCH_CONF = {"spark.sql.adaptive.enabled": "false", "spark.sql.shuffle.partitions": "1", **INTERPRETED_CONF}
CODEGEN_CONF = {"spark.sql.codegen.wholeStage": "true", "spark.sql.codegen.factoryMode": "FALLBACK"}
"""Spark's defaults for the keys of ``INTERPRETED_CONF``: generated code."""
INTERPRETED_TABLE_ROWS_MAX = 250_000
"""A small batch applies a table of at most this many live rows interpreted
(``table_conf``).  Past it the table's own rows dominate the work: the
labelling, the MERGE and the reconciliation scan and join each of them, and
interpreted that costs more than generating the code.  A warm 2k-event batch
into 100k rows: 7.11 s interpreted against 8.85 s; into 1M rows: 11.99 s
against 10.40 s (medians, bench/README step 31)."""


@contextlib.contextmanager
def scoped_conf(spark: SparkSession, settings: Settings, conf: dict[str, str]) -> Iterator[None]:
    """``conf`` set on the session for the span of the block, but for the
    keys the user set with ``CDC_SPARK_CONF_*``; the session gets its own
    values back on exit (a shared session: Spark Connect, tests, the bench)."""
    conf = {k: v for k, v in conf.items() if k not in settings.extra_spark_conf}
    saved = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        restore(spark, saved)


def restore(spark: SparkSession, saved: dict[str, str | None]) -> None:
    """Put session values back as read by ``spark.conf.get(key, None)``: None unsets."""
    for k, old in saved.items():
        if old is None:
            spark.conf.unset(k)
        else:
            spark.conf.set(k, old)


@contextlib.contextmanager
def small_batch_conf(spark: SparkSession, settings: Settings, messages: int) -> Iterator[None]:
    """Run a batch of at most ``SMALL_BATCH_MESSAGES`` messages without
    adaptive execution, on one shuffle partition, and without generated code
    (``INTERPRETED_CONF``), in ``scoped_conf``.

    Why: adaptive execution runs each shuffle stage as a Spark job of its own
    and plans again between them; a 20-event batch ran 50 jobs, which is
    scheduling, not work (bench/README, step 18).  Safe for a large table: the
    batch's side of each join is small and the table's side is read, not
    shuffled (the labelling and the reconciliation broadcast the batch's keys;
    the MERGE broadcasts the batch's net changes: ``merge_conf``)."""
    with scoped_conf(spark, settings, SMALL_BATCH_CONF if messages <= SMALL_BATCH_MESSAGES else {}):
        yield


@contextlib.contextmanager
def table_conf(spark: SparkSession, settings: Settings, live_rows: int | None) -> Iterator[None]:
    """A table's apply inside a small batch (``small_batch_conf``) with
    generated code back on when the table holds more than
    ``INTERPRETED_TABLE_ROWS_MAX`` live rows, or an unknown number (None):
    interpreted, its scans and joins would cost more than the code saves.
    Outside a small batch, or under the user's own keys, nothing changes."""
    interpreted = all(spark.conf.get(k, None) == v for k, v in INTERPRETED_CONF.items())
    large = live_rows is None or live_rows > INTERPRETED_TABLE_ROWS_MAX
    with scoped_conf(spark, settings, CODEGEN_CONF if interpreted and large else {}):
        yield


NET_CHANGES_CACHE_CONF = {"spark.sql.inMemoryColumnarStorage.compressed": "false"}
"""The labelling caches the batch's net changes (``compact.cache_counted``)
without compressing the cache's columns.  Spark picks each column's encoding
by trying every scheme on every value, and their maps, texts and positions
hardly compress: at 500k events the cache was 262 MiB plain against 252 MiB
compressed, and built in 4.34-5.03 s against 5.18-5.61 s (warm rounds,
alternating).  In a 1M-event batch, 9 % of the task threads' CPU samples
were that trial (a JFR profile; bench/README, issue 20 step 47).  The decoded
batch keeps its compression: its file, table and status texts repeat, and
plain it took 20 % more memory for 8 % less time."""


BROADCAST_THRESHOLD = "spark.sql.autoBroadcastJoinThreshold"
MERGE_BROADCAST_BYTES = 32 << 20
"""The MERGE of stored keys broadcasts the batch's net changes when Spark
estimates them at most this size (the cached fold: ~1.3 KB a key for the
benchmark's 13 columns, so ~25k keys).  Spark's own 10 MB threshold left a
9k-event batch's MERGE a sort-merge join of the whole table on one shuffle
partition (``small_batch_conf``): 10.5 s a batch against 8.7 s with it
(bench/README, step 19).  Past it the join shuffles: the broadcast is built
in the driver's heap, beside the cached batch."""
MERGE_RUNTIME_FILTER_CONF = {
    "spark.sql.optimizer.runtime.bloomFilter.enabled": "true",
    "spark.sql.optimizer.runtime.bloomFilter.creationSideThreshold": "1g",
    "spark.sql.optimizer.runtime.bloomFilter.applicationSideScanSizeThreshold": "1b",
}
"""Past the broadcast threshold, the MERGE of stored keys is a shuffle join
that sends every row of the table, with its data file's path, through the
shuffle to meet a few keys: a 100k-event batch into 1M rows shuffled 114-126
MB of the table for ~50k stored keys.  Spark's runtime Bloom filter, built
from the batch's keys, drops the other rows in the table's scan, before the
shuffle (5.7 MB then; 19.1 -> 18.2 s a batch, bench/README step 20).  Spark
injects one only for a table whose scan it estimates above 10 GB and a batch
below 10 MB.  For the MERGE's span: any table (a MERGE that shuffles has a
table side too large to broadcast) and a batch below 1 GB.  A filter's false
positives only join a row for nothing: the join stays exact.  A broadcast
MERGE (``MERGE_BROADCAST_BYTES``) and a copy-on-write one, whose join keeps
the table's other rows, get none."""
_BYTE_UNITS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}


def byte_size(text: str | None) -> int | None:
    """Spark's size text ('10485760b', '10m', '-1') in bytes; None when it is not one."""
    m = re.fullmatch(r"\s*(-?\d+)\s*([kmgtp]?)b?\s*", text or "", re.IGNORECASE)
    return None if m is None else int(m[1]) << _BYTE_UNITS[m[2].lower()]


def merge_conf(spark: SparkSession, settings: Settings) -> contextlib.AbstractContextManager[None]:
    """The MERGE's span with a broadcast threshold of at least
    ``MERGE_BROADCAST_BYTES`` and the runtime filter's bounds
    (``MERGE_RUNTIME_FILTER_CONF``), by ``scoped_conf``.  A session whose
    threshold is higher, or off (-1), or set by the user, keeps it."""
    current = byte_size(spark.conf.get(BROADCAST_THRESHOLD))  # Spark's default when unset (with a default of None: None)
    raise_it = current is not None and 0 <= current < MERGE_BROADCAST_BYTES
    conf = {BROADCAST_THRESHOLD: f"{MERGE_BROADCAST_BYTES}b"} if raise_it else {}
    return scoped_conf(spark, settings, conf | MERGE_RUNTIME_FILTER_CONF)


def iceberg_conf(settings: Settings) -> dict[str, str]:
    """Spark conf for the Iceberg catalog (and its object store), with the
    user's ``CDC_SPARK_CONF_*`` last."""
    cat = f"spark.sql.catalog.{settings.catalog_name}"
    conf = {
        "spark.sql.extensions": "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
        cat: "org.apache.iceberg.spark.SparkCatalog",
        f"{cat}.warehouse": settings.warehouse,
        # no table cache: pyiceberg (publish, ledger) commits to the same tables
        f"{cat}.cache-enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.mapKeyDedupPolicy": "LAST_WIN",
    }
    if settings.catalog_type == "jdbc":
        conf[f"{cat}.type"] = "jdbc"
        conf[f"{cat}.uri"] = settings.catalog_uri
        conf[f"{cat}.jdbc.schema-version"] = "V1"
    else:
        conf[f"{cat}.type"] = "rest"
        conf[f"{cat}.uri"] = settings.catalog_uri
    conf.update(object_store_conf(settings))
    conf.update(settings.extra_spark_conf)
    return conf


def object_store_conf(settings: Settings) -> dict[str, str]:
    """Spark conf for an S3 warehouse (Iceberg S3FileIO); empty for local files."""
    if not uses_object_store(settings):
        return {}
    cat = f"spark.sql.catalog.{settings.catalog_name}"
    conf: dict[str, str] = {}
    # Iceberg catalog: table files through S3FileIO (default AWS credential chain).
    if settings.warehouse_on_object_store:
        conf[f"{cat}.io-impl"] = S3_FILE_IO
    if settings.s3.endpoint:
        conf[f"{cat}.s3.endpoint"] = settings.s3.endpoint
    conf[f"{cat}.s3.path-style-access"] = "true" if settings.s3.path_style else "false"
    if settings.s3.region:
        conf[f"{cat}.client.region"] = settings.s3.region
    return conf


def driver_conf(settings: Settings, *, short_lived: bool = True) -> dict[str, str]:
    """Conf of a driver JVM the project starts: one batch's spark-submit
    (``short_lived``) or a Spark Connect server."""
    conf = {
        **session_defaults(settings),
        "spark.pyspark.python": settings.worker_python,
        "spark.pyspark.driver.python": settings.worker_python,
    }
    return {**conf, **short_lived_options(short_lived), **quiet_spark(settings.log_verbose), **iceberg_conf(settings)}


def short_lived_options(short_lived: bool) -> dict[str, str]:
    """The JVM options of a driver that lives for one batch (``DRIVER_JAVA_OPTIONS``), else none."""
    return {JAVA_OPTIONS: DRIVER_JAVA_OPTIONS} if short_lived else {}


def session_conf(settings: Settings, *, own_short_lived_driver: bool) -> dict[str, str]:
    """Conf of a session ``get_spark`` builds; ``own_short_lived_driver``: it
    starts the driver JVM of a process that runs one command and exits."""
    return {**session_defaults(settings), **short_lived_options(own_short_lived_driver), **iceberg_conf(settings)}


def extra_jar_coordinates(settings: Settings) -> tuple[str, ...]:
    """Maven coordinates of the jars the object store needs on top of
    ``config.JARS`` (fetched by ``./dev setup`` into CDC_JARS_DIR):
    iceberg-aws-bundle for S3FileIO.  A jar already on Spark's own class path
    (``pyspark/jars``, as the Docker image installs iceberg-aws-bundle) is not
    added again."""
    if not uses_object_store(settings):
        return ()
    spark_jars = spark_home() / "jars"
    out = []
    for coord in S3_JARS:
        _, artifact, version = coord.split(":")
        if spark_jars.is_dir() and (spark_jars / f"{artifact}-{version}.jar").exists():
            continue
        out.append(coord)
    return tuple(out)


def jar_paths(settings: Settings) -> list[Path]:
    """The jars every driver needs, from ``settings.jars_dir``; a missing one
    is a configuration error that says how to fetch it."""
    paths = []
    for coord in JARS + extra_jar_coordinates(settings):
        _, artifact, version = coord.split(":")
        path = settings.jars_dir / f"{artifact}-{version}.jar"
        if not path.exists():
            raise ConfigError(
                f"missing jar {path}: run `./dev setup` (it fetches {coord} with Maven) or set CDC_JARS_DIR to a folder holding it"
            )
        paths.append(path)
    return paths
