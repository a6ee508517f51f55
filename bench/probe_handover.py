"""Where the decode stage's time goes (issue 20, step 19), in one warm Spark session.

The fast path's outcome batches of ``--events`` bench events are built once
in this process, written to an Arrow IPC file, and handed to the JVM again by
``mapInArrow`` + persist + count (what ``decode_batch`` and the batch do),
with the change images (``after``/``before``) in four forms:

* ``maps``: today's ``map<string,string>`` of canonical text;
* ``typed``: a struct of the table's columns (the typed-images plan);
* ``json``: one JSON string per image;
* ``none``: no images at all (the lower bound of any form).

And, as a bound on decoding in the JVM instead of in Python (step 36): the
same files read by Spark's own JSON reader (``spark_json``: ``read.text`` +
``from_json`` of the line with the payload's schema, inferred once from the
first line), the images as ``map<string,string>`` of the fields cast to text,
the position formatted, persisted and counted.  It converts less than the
decoders do (decimals stay base64, timestamps numbers), so it is a lower
bound of a JVM decode stage.

The four forms' times are the JVM's share of the stage and what a change of
form could save there.  Beside them, from the same files: the fast path's
Python time per line in this process (best of ``--runs``), an empty
``mapInArrow`` job (the stage's fixed cost), and the decode stage itself
(``contenders.decode_stage``: exact decoder vs fast path)::

    .venv/bin/python -m bench.probe_handover --events 100000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from bench import contenders as C
from bench import workload as wl

FORMS = ("maps", "typed", "json", "none")


def fast_batches(paths: list[str]) -> tuple[list[pa.RecordBatch], float]:
    """The fast path's outcome batches of the files (the exact decoder's
    few outcomes left out), and its Python seconds per line."""
    from cdc_apply.decode import DecodeContext, fast_debezium, make_decoder
    from cdc_apply.decode.stage import fast_batch

    ctx = DecodeContext(source="bench", primary_keys={wl.TABLE: [wl.KEY]}, options={})
    files = [(p, (lambda p=p: Path(p).open("rb")), None) for p in paths]
    t0 = time.perf_counter()
    parts = list(fast_debezium.decode_files(make_decoder("debezium_postgres", ctx), files))
    batches = [fast_batch(part) for part in parts if isinstance(part, dict)]
    seconds = time.perf_counter() - t0
    lines = sum(b.num_rows for b in batches) + sum(len(part) for part in parts if isinstance(part, list))
    return batches, seconds / max(1, lines)


def _images_as(column: pa.Array, form: str, names: list[str]) -> pa.Array:
    if form == "none":
        return pa.nulls(len(column), column.type)
    rows = [None if m is None else dict(m) for m in column.to_pylist()]
    if form == "json":
        return pa.array([None if r is None else orjson.dumps(r).decode() for r in rows], pa.string())
    fields = [pa.array([None if r is None else r.get(n) for r in rows], pa.string()) for n in names]
    return pa.StructArray.from_arrays(fields, names=names, mask=pa.array([r is None for r in rows]))


def in_form(batch: pa.RecordBatch, form: str, names: list[str]) -> pa.RecordBatch:
    """``batch`` with its change images in ``form``."""
    if form == "maps":
        return batch
    cols = {n: batch.column(n) for n in batch.schema.names}
    for side in ("after", "before"):
        cols[side] = _images_as(cols[side], form, names)
    return pa.RecordBatch.from_arrays(list(cols.values()), names=list(cols))


def ddl_of(form: str, names: list[str]) -> str:
    from cdc_apply.decode.stage import OUTCOME_DDL

    images = "after map<string,string>, before map<string,string>"
    typed = "struct<" + ", ".join(f"`{n}`: string" for n in names) + ">"
    replacement = {"maps": images, "none": images, "json": "after string, before string", "typed": f"after {typed}, before {typed}"}
    return OUTCOME_DDL.replace(images, replacement[form])


def handed_over(spark: Any, send: Any, ddl: str, tasks: int) -> float:
    """Seconds of ``mapInArrow(send)`` over ``tasks`` tasks + persist + count."""
    t0 = time.perf_counter()
    df = spark.range(0, tasks, 1, tasks).mapInArrow(send, ddl).persist()
    df.count()
    seconds = time.perf_counter() - t0
    df.unpersist()
    return seconds


def replay(spark: Any, path: str, ddl: str, tasks: int) -> float:
    """``handed_over`` of the batches of the IPC file at ``path``, dealt to the tasks."""

    def send(chunks: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for chunk in chunks:
            for task in chunk.column("id").to_pylist():
                reader = pa.ipc.open_file(path)
                for i in range(task, reader.num_record_batches, tasks):
                    yield reader.get_batch(i)

    return handed_over(spark, send, ddl, tasks)


def empty_job(spark: Any, ddl: str, tasks: int) -> float:
    """``handed_over`` of nothing: the job's fixed cost."""

    def nothing(chunks: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for _ in chunks:
            pass
        return iter(())

    return handed_over(spark, nothing, ddl, tasks)


def spark_json(spark: Any, paths: list[str]) -> float:
    """Seconds of the files decoded by Spark's JSON reader into op, position
    and text images, persisted and counted (the ``spark_json`` bound)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructField, StructType

    with open(paths[0], encoding="utf-8") as fh:
        sample = [fh.readline() for _ in range(1000)]
    inferred = spark.read.json(spark.sparkContext.parallelize(sample)).schema["payload"].dataType
    image_type = inferred["after"].dataType  # (a sample of inserts leaves ``before`` untyped)
    payload = StructType([StructField(f.name, image_type if f.name == "before" else f.dataType) for f in inferred.fields])
    row = image_type.fieldNames()

    def image(side: str) -> Any:
        texts = F.array(*[F.col(f"p.{side}.`{c}`").cast("string") for c in row])
        return F.when(F.col(f"p.{side}").isNotNull(), F.map_from_arrays(F.array(*[F.lit(c) for c in row]), texts))

    t0 = time.perf_counter()
    lines = spark.read.text(paths)
    p = lines.select(F.from_json("value", f"struct<payload:{payload.simpleString()}>", {"mode": "FAILFAST"}).payload.alias("p"))
    out = p.select(
        F.col("p.op").alias("op"),
        F.format_string("%020d|%s", F.col("p.source.lsn"), F.col("p.source.txId")).alias("position"),
        image("after").alias("after"),
        image("before").alias("before"),
    ).persist()
    out.count()
    seconds = time.perf_counter() - t0
    out.unpersist()
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.probe_handover", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    work = C.scratch_dir("cdc-probe-handover-")
    C.prepare_home(work / "home", ["bench"])
    from cdc_apply.config import Settings
    from cdc_apply.decode.stage import parallelism
    from cdc_apply.runtime.session import get_spark

    files = wl.Workload(seed=7, base_rows=1_000_000).write(work / "data", args.events, max(1, args.events // 5))
    per_line = []
    for _ in range(args.runs):
        batches, seconds = fast_batches(files.paths)
        per_line.append(seconds)
    names = sorted({k for b in batches for m in b.column("after").to_pylist() if m for k, _ in m})
    spark = get_spark(Settings.from_env(), app_name="cdc-probe-handover")
    tasks = parallelism(spark)
    ipc = {}
    for form in FORMS:
        ipc[form] = str(work / f"{form}.arrow")
        shaped = [in_form(b, form, names) for b in batches]
        with pa.OSFile(ipc[form], "wb") as sink, pa.ipc.new_file(sink, shaped[0].schema) as writer:
            for b in shaped:
                writer.write_batch(b)
    seconds: dict[str, list[float]] = {form: [] for form in (*FORMS, "empty", "spark_json")}
    for run in range(args.runs + 1):  # the first round warms the session up and is not counted
        for form in FORMS if run % 2 == 0 else tuple(reversed(FORMS)):
            took = replay(spark, ipc[form], ddl_of(form, names), tasks)
            if run:
                seconds[form].append(took)
        took = empty_job(spark, ddl_of("maps", names), tasks)
        if run:
            seconds["empty"].append(took)
        took = spark_json(spark, files.paths)
        if run:
            seconds["spark_json"].append(took)
    out = {
        "events": files.events,
        "bytes": files.bytes,
        "tasks": tasks,
        "fast_path_python_us_per_line": round(min(per_line) * 1e6, 2),
        "replay_seconds": {k: round(statistics.median(v), 3) for k, v in seconds.items()},
        "replay_runs": {k: [round(x, 2) for x in v] for k, v in seconds.items()},
        "decode_stage": C.decode_stage(spark, files.paths, runs=args.runs),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"params": vars(args), **out}, indent=1))
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
