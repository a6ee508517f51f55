"""Decode a batch of archive files inside Spark into canonical outcome rows.

Each Python task opens its files itself (local or object store) and streams
them a chunk at a time: a file's bytes never sit whole in the JVM or in a
worker, so memory does not grow with file size (Spark's ``binaryFile`` held
every file whole, twice over, and stops at 2 GB).  Reading the bytes ourselves
also keeps gzip damage and bad UTF-8 ours to report, line by line, instead of
failing the task.  Files are dealt to tasks by size (largest first), so the
cores finish together.  Decoding runs in Arrow batches (``mapInArrow``) with
orjson: no per-row Python UDF.  Decoders with driver-side messages (Qlik
metadata, split CES events) get a first pass that collects only those
messages; their state is then shipped to executors.

A small batch (``LOCAL_DECODE_BYTES``, an hourly one) takes the same steps in
the driver's own Python instead (``decode_here``): in a fresh driver, starting
Python workers cost more than decoding its few thousand lines.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import gc
import heapq
import pickle
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from cdc_apply.archive.lines import (
    Piece,
    Source,
    iter_lines,
    local_path,
    open_archive,
    plan_pieces,
)
from cdc_apply.config import S3Options, is_object_store_uri
from cdc_apply.decode import DecodeContext, Decoder, census, fast_debezium, make_decoder
from cdc_apply.model import (
    ChangeEvent,
    Held,
    Op,
    Outcome,
    Quarantined,
    RawMessage,
    Skipped,
)

# One row per outcome.  ``columns`` (an event's declared columns) is given on
# the first event of each table's declaration in an Arrow batch and null on
# the rest: only the set of declarations per table is read (``outcome_row``).
OUTCOME_DDL = (
    "status string, reason string, file string, line bigint, raw string, "
    "database string, schema_name string, table_name string, op string, "
    "key_columns array<string>, after map<string,string>, before map<string,string>, "
    "columns array<struct<name:string,type:string,nullable:boolean>>, "
    "position string, tx_id string, commit_ts timestamp, message_id string, notes array<string>, change_id string, "
    "tx_group string, tx_order bigint, tx_total bigint"
)
_COLUMN = pa.struct([("name", pa.string()), ("type", pa.string()), ("nullable", pa.bool_())])
ARROW_SCHEMA = pa.schema(
    [
        ("status", pa.string()),
        ("reason", pa.string()),
        ("file", pa.string()),
        ("line", pa.int64()),
        ("raw", pa.string()),
        ("database", pa.string()),
        ("schema_name", pa.string()),
        ("table_name", pa.string()),
        ("op", pa.string()),
        ("key_columns", pa.list_(pa.string())),
        ("after", pa.map_(pa.string(), pa.string())),
        ("before", pa.map_(pa.string(), pa.string())),
        ("columns", pa.list_(_COLUMN)),
        ("position", pa.string()),
        ("tx_id", pa.string()),
        ("commit_ts", pa.timestamp("us", tz="UTC")),
        ("message_id", pa.string()),
        ("notes", pa.list_(pa.string())),
        ("change_id", pa.string()),
        ("tx_group", pa.string()),
        ("tx_order", pa.int64()),
        ("tx_total", pa.int64()),
    ]
)
OUTCOME_SCHEMA = from_arrow_schema(ARROW_SCHEMA)
"""``OUTCOME_DDL`` as a Spark schema, made without the JVM's SQL parser
(~0.4 s of a fresh driver's first parse); ``tests/decode/test_decode_here.py``
checks that the two are equal."""
RAW_LIMIT = 1 << 20  # keep at most 1 MiB of a quarantined message's text
GROUP_BYTES = 128 << 20  # archive bytes a decode task aims at (Spark's own file split size)
PIECE_MIN_BYTES = 16 << 20  # a file is cut into pieces no smaller than this
T = TypeVar("T")
OUT_BATCH_ROWS = 10_000  # outcome rows per Arrow batch back to the JVM
LOCAL_DECODE_BYTES = 8 << 20
"""A batch of at most this many archive bytes (an hourly batch: 1k events
are ~4 MB) is decoded in the driver's own Python and handed to Spark as an
Arrow table (``decode_here``): in a fresh spark-submit driver, starting
Python workers and importing the decoders there was most of its decode
stage's ~2.5 s (bench/README.md, issue 20 step 34)."""


def _declared_once(o: ChangeEvent, seen: set) -> list[tuple[str, str, bool]] | None:
    """``o``'s column declaration as Arrow struct tuples the first time its
    table's declaration appears in the batch (``seen``), else None.  The
    events of one schema share their ``Column`` objects, so a repeat is
    mostly known by the objects' ids (all alive while the batch is built);
    equal declarations made of other objects are caught by value."""
    if o.columns is None:
        return None
    same_objects = (o.database, o.schema, o.table, *map(id, o.columns))
    if same_objects in seen:
        return None
    seen.add(same_objects)
    tuples = [(c.name, c.type, c.nullable) for c in o.columns]
    same_values = (o.database, o.schema, o.table, tuple(tuples))
    if same_values in seen:
        return None
    seen.add(same_values)
    return tuples


def outcome_row(o: Outcome, declared: set) -> tuple:
    """One outcome as a row of ``OUTCOME_DDL``, in ``ARROW_SCHEMA`` order.

    An event's ``columns`` is given only when its table's declaration is new
    to the batch (``declared``), else null: only their set per table is read
    (the table's columns), and eleven structs on every row were the bulk of
    a decoded row in the JVM."""
    if type(o) is ChangeEvent:
        return (
            "event",
            None,
            o.file,
            o.line,
            None,
            o.database,
            o.schema,
            o.table,
            o.op.value if isinstance(o.op, Op) else str(o.op),
            list(o.key_columns),
            o.after or {},
            o.before,
            _declared_once(o, declared),
            o.position,
            o.tx_id,
            o.commit_ts_us,
            o.message_id,
            list(o.notes) if o.notes else None,
            o.change_id,
            o.tx_group,
            o.tx_order,
            o.tx_total,
        )
    if isinstance(o, Skipped):
        values: dict[str, Any] = {
            "status": "skipped",
            "reason": o.reason,
            "position": o.position,
            "notes": [o.detail] if o.detail else None,
            "tx_group": o.tx_group,
            "tx_order": o.tx_order,
            "tx_total": o.tx_total,
        }
    elif isinstance(o, Held):
        values = {"status": "held", "reason": o.reason, "message_id": o.group}
    elif isinstance(o, Quarantined):
        values = {"status": "quarantined", "reason": o.reason, "raw": o.raw[:RAW_LIMIT]}
    else:  # pragma: no cover - a decoder bug
        raise TypeError(f"unknown outcome {o!r}")
    values = {**values, "file": o.file, "line": o.line}
    return tuple(values.get(name) for name in ARROW_SCHEMA.names)


def outcomes_batch(outcomes: Sequence[Outcome]) -> pa.RecordBatch:
    """Outcomes to one Arrow batch, column by column (a dict per row and
    ``from_pylist`` cost twice as much, a fifth of a decode task's time);
    each table's column declaration once per batch (``outcome_row``)."""
    declared: set = set()
    columns = list(zip(*(outcome_row(o, declared) for o in outcomes))) or [()] * len(ARROW_SCHEMA)
    return pa.RecordBatch.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, ARROW_SCHEMA)], schema=ARROW_SCHEMA)


def fast_batch(arrays: dict[str, pa.Array]) -> pa.RecordBatch:
    """The fast path's columns (``decode/fast_debezium.py``) as an outcome
    batch: the columns it does not fill are null."""
    rows = len(arrays["status"])
    return pa.RecordBatch.from_arrays(
        [arrays[f.name] if f.name in arrays else pa.nulls(rows, f.type) for f in ARROW_SCHEMA], schema=ARROW_SCHEMA
    )


class Decoded(NamedTuple):
    """What ``decode_batch`` gives: the outcome rows, the decoder state for
    the next batch, and the rows per (status, reason) and per table when the
    decode already knows them (``decode_here``: ``census.counted_here``;
    None: counting them is a Spark job's, ``census.counted``)."""

    frame: DataFrame
    state: dict
    counts: dict[tuple[str, str | None], int] | None = None
    tables: list | None = None


def _file_messages(path: str, source: Source, piece: Piece | None = None) -> Iterator[RawMessage | Quarantined]:
    for item in iter_lines(path, source, piece=piece):
        if isinstance(item, RawMessage):
            yield item
        else:
            line, raw, reason = item
            yield Quarantined(reason=reason, raw=raw, file=path, line=line)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic collector paused while a task decodes.  The decode
    makes no reference cycles (its objects are freed by reference counting
    as soon as a batch is sent), but the collector's passes over the up to
    ``OUT_BATCH_ROWS`` outcomes being gathered cost a quarter of a task's
    time.  Restored when the task ends, whatever happens."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def driver_messages(dec: Decoder, files: Iterable[tuple[str, Source, Piece | None]]) -> Iterator[RawMessage]:
    """The messages of the files that ``dec`` takes on the driver (``needs_driver``)."""
    for path, source, piece in files:
        for msg in _file_messages(path, source, piece):
            if isinstance(msg, RawMessage) and dec.needs_driver(msg):
                yield msg


def decode_file_contents(decoder: Decoder, files: Iterable[tuple[str, Source, Piece | None]], driver_done: bool) -> Iterator[Outcome]:
    """Executor-side decode of files or pieces of files (driver-side messages
    excluded when they were already absorbed on the driver)."""
    for path, source, piece in files:
        msgs = _file_messages(path, source, piece)
        if driver_done:
            msgs = (m for m in msgs if isinstance(m, Quarantined) or not decoder.needs_driver(m))
        yield from decoder.decode_file(msgs)


def _has_driver_pass(decoder: Decoder) -> bool:
    return type(decoder).needs_driver is not Decoder.needs_driver


def file_groups(items: Sequence[tuple[T, int]], slots: int, target_bytes: int = GROUP_BYTES) -> list[list[T]]:
    """Items (files or pieces, with their sizes) dealt to tasks, largest first
    onto the least loaded task: at least ``slots`` tasks (every core busy),
    about ``target_bytes`` each (many small files share a task), never more
    tasks than items.  The task count is a whole number of rounds of
    ``slots``, and the tasks come largest first (Spark starts them in that
    order): three equal tasks on two cores would keep one core working
    twice as long as the other."""
    if not items:
        return []
    total = sum(size for _, size in items)
    wanted = max(slots, -(-total // target_bytes))
    count = min(len(items), -(-wanted // slots) * slots)
    groups: list[list[T]] = [[] for _ in range(count)]
    load = [(0, i) for i in range(count)]
    for n in sorted(range(len(items)), key=lambda n: (-items[n][1], n)):
        used, i = heapq.heappop(load)
        groups[i].append(items[n][0])
        heapq.heappush(load, (used + items[n][1], i))
    return [groups[i] for _, i in sorted(load, key=lambda x: (-x[0], x[1]))]


def decode_units(files: Sequence[tuple[str, int]], slots: int) -> list[tuple[tuple[str, Piece | None], int]]:
    """What the decode tasks read, with sizes: whole files, except that a local
    plain file large next to a core's share of the batch is cut into pieces
    at line starts, so one big file is decoded on every core (and five equal
    files on two cores end together)."""
    total = sum(size for _, size in files)
    unit = max(PIECE_MIN_BYTES, total // (max(1, slots) * 4))
    out: list[tuple[tuple[str, Piece | None], int]] = []
    for path, size in files:
        parts = round(size / unit)
        pieces = plan_pieces(path, -(-size // parts)) if parts >= 2 and not is_object_store_uri(path) else []
        if len(pieces) >= 2:
            out += [((path, p), p.end - p.start) for p in pieces]
        else:
            out.append(((path, None), size))
    return out


def _file_tasks(spark: SparkSession, groups: list[list[tuple[str, Piece | None]]]) -> DataFrame:
    """One row (the group index) per task: the Python tasks open their files
    themselves, so a file's bytes never pass through the JVM."""
    return spark.range(0, len(groups), 1, max(1, len(groups)))


def _archive_sources(units: Iterable[tuple[str, Piece | None]], s3: S3Options) -> Iterator[tuple[str, Source, Piece | None]]:
    for path, piece in units:
        yield local_path(path), functools.partial(open_archive, path, s3), piece


def parallelism(spark: SparkSession) -> int:
    """Task slots to plan the decode for: the driver's default parallelism.
    A Spark Connect client has no SparkContext to ask: the server's plan of a
    ``range`` says how many splits it gets (its default parallelism), which
    costs an analysis round trip instead of a Spark job (~0.3 s a batch)."""
    from cdc_apply.runtime.session import is_remote

    if not is_remote(spark):
        return spark.sparkContext.defaultParallelism
    return planned_range_splits(spark) or range_partitions(spark)


_RANGE_SPLITS = re.compile(r"\bRange \(0, \d+, step=1, splits=(\d+)\)")


def planned_range_splits(spark: SparkSession) -> int | None:
    """The splits of ``range`` in the server's physical plan (None: a plan
    text this Spark prints otherwise)."""
    explain = getattr(spark.range(0, 1 << 16), "_explain_string", None)  # Spark Connect's DataFrame
    found = _RANGE_SPLITS.search(explain(mode="simple")) if explain is not None else None
    return int(found.group(1)) if found else None


def range_partitions(spark: SparkSession) -> int:
    """The partitions a ``range`` runs in, counted by a Spark job."""
    from pyspark.sql import functions as F

    row = spark.range(0, 1 << 16).select(F.spark_partition_id().alias("p")).agg(F.max("p")).first()
    return int(row[0]) + 1 if row is not None else 1


def decode_units_to_arrow(dec: Decoder, sources: Iterable[tuple[str, Source, Piece | None]], driver_done: bool) -> Iterator[pa.RecordBatch]:
    """Outcome batches of the files (or pieces) one decode task reads: the
    Debezium PostgreSQL fast path where it applies, else the decoder's own
    outcomes, ``OUT_BATCH_ROWS`` at a time."""
    if fast_debezium.supports(dec):
        with gc_paused():
            for part in fast_debezium.decode_files(dec, sources):
                yield fast_batch(part) if isinstance(part, dict) else outcomes_batch(part)
        return
    out: list[Outcome] = []
    with gc_paused():
        for outcome in decode_file_contents(dec, sources, driver_done):
            out.append(outcome)
            if len(out) >= OUT_BATCH_ROWS:
                yield outcomes_batch(out)
                out = []
    if out:
        yield outcomes_batch(out)


def decode_batch(spark: SparkSession, files: Sequence[tuple[str, int]], fmt: str, ctx: DecodeContext) -> Decoded:
    """Decode the files, given as (path, size), into a DataFrame of outcome
    rows (``OUTCOME_DDL``).

    Returns the DataFrame and the decoder state to persist for the next batch
    (``Decoded``).  A small batch is decoded here (``decode_here``), a larger one by Spark's
    Python tasks.  Long because the driver pass and the task closure share
    the pickled context built here.
    """
    if sum(size for _, size in files) <= LOCAL_DECODE_BYTES:
        return decode_here(spark, files, fmt, ctx)
    slots = parallelism(spark)
    groups = file_groups(decode_units(files, slots), slots)
    tasks = _file_tasks(spark, groups)
    s3 = S3Options.from_env()
    decoder = make_decoder(fmt, ctx)
    driver_outcomes: list[Outcome] = []
    if _has_driver_pass(decoder):
        blob_ctx = base64.b64encode(pickle.dumps((fmt, ctx, groups, s3))).decode()

        def pick_driver_messages(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            f, c, g, store = pickle.loads(base64.b64decode(blob_ctx))
            dec = make_decoder(f, c)
            for batch in batches:
                rows = [
                    {"file": msg.file, "line": msg.line, "text": msg.text}
                    for task in batch.column("id").to_pylist()
                    for msg in driver_messages(dec, _archive_sources(g[task], store))
                ]
                yield pa.RecordBatch.from_pylist(
                    rows, schema=pa.schema([("file", pa.string()), ("line", pa.int64()), ("text", pa.string())])
                )

        picked = tasks.mapInArrow(pick_driver_messages, "file string, line bigint, text string").orderBy("file", "line").collect()
        driver_outcomes = decoder.absorb([RawMessage(r.file, r.line, r.text) for r in picked])
    state = decoder.export_state()
    ctx_after = dataclasses.replace(ctx, state=state)
    blob = base64.b64encode(pickle.dumps((fmt, ctx_after, _has_driver_pass(decoder), groups, s3))).decode()

    def decode_partition(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        f, c, driver_done, g, store = pickle.loads(base64.b64decode(blob))
        dec = make_decoder(f, c)
        for batch in batches:
            for task in batch.column("id").to_pylist():
                yield from decode_units_to_arrow(dec, _archive_sources(g[task], store), driver_done)
        pa.default_memory_pool().release_unused()

    decoded = tasks.mapInArrow(decode_partition, OUTCOME_DDL)
    if driver_outcomes:
        extra = outcomes_frame(spark, driver_outcomes)
        decoded = decoded.unionByName(extra)
    return Decoded(decoded, state)


def decode_here(spark: SparkSession, files: Sequence[tuple[str, int]], fmt: str, ctx: DecodeContext) -> Decoded:
    """``decode_batch`` in this process: the same steps, in the same order
    (the driver-side messages first, in file and line order; then every
    file whole, by a decoder made from a copy of the context, as a task's
    is), the outcome rows handed to Spark as one Arrow table, counted by
    status and reason on the way (no Spark job to count them)."""
    s3 = S3Options.from_env()
    units: list[tuple[str, Piece | None]] = [(path, None) for path, _ in files]
    decoder = make_decoder(fmt, ctx)
    driver_outcomes: list[Outcome] = []
    if _has_driver_pass(decoder):
        picked = driver_messages(make_decoder(fmt, _copied(ctx)), _archive_sources(units, s3))
        driver_outcomes = decoder.absorb(sorted(picked, key=lambda m: (m.file, m.line)))
    state = decoder.export_state()
    dec = make_decoder(fmt, _copied(dataclasses.replace(ctx, state=state)))
    batches = list(decode_units_to_arrow(dec, _archive_sources(units, s3), _has_driver_pass(decoder)))
    if driver_outcomes:
        batches.append(outcomes_batch(driver_outcomes))
    return handed_over(spark, pa.Table.from_batches(batches, schema=ARROW_SCHEMA), state)


def handed_over(spark: SparkSession, table: pa.Table, state: dict) -> Decoded:
    """Outcome rows decoded in this process, handed to Spark as one Arrow
    table and counted by status and reason, and per table, on the way
    (``census.counted_here``): the batch then needs no Spark job to count
    them or to plan its tables."""
    counts, tables = census.counted_here(table)
    return Decoded(spark.createDataFrame(table, OUTCOME_SCHEMA), state, counts, tables)


def _copied(ctx: DecodeContext) -> DecodeContext:
    """A copy of the context as a task gets it (pickled): a decoder may keep
    and change what it is given."""
    copy: DecodeContext = pickle.loads(pickle.dumps(ctx))
    return copy


def outcomes_frame(spark: SparkSession, outcomes: Sequence[Outcome]) -> DataFrame:
    """Outcomes decoded on the driver as a DataFrame of ``OUTCOME_DDL``."""
    return spark.createDataFrame(pa.Table.from_batches([outcomes_batch(outcomes)]), OUTCOME_SCHEMA)


def outcomes_decoded(spark: SparkSession, outcomes: Sequence[Outcome]) -> Decoded:
    """Outcomes decoded on the driver, handed over and counted (``handed_over``; no decoder state)."""
    return handed_over(spark, pa.Table.from_batches([outcomes_batch(outcomes)]), {})
