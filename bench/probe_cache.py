"""What keeping a batch's rows costs the JVM, by how they are kept (issue 20, step 27).

The batch keeps two frames for its many passes: the decoded outcomes and the
net changes, each with ``persist`` (Spark's in-memory columnar cache).  This
probe hands the same rows to the JVM by ``mapInArrow`` (one prebuilt Arrow
batch yielded over and over, so Python costs next to nothing) and times, per
form of the change images (``map<string,string>`` as today, an array of texts,
typed columns):

* the rows alone (``mapInArrow`` and an aggregate over the key);
* ``persist`` + count, then a shuffle by the key read back from the cache;
* ``localCheckpoint``, then the same shuffle read back from it.

::

    .venv/bin/python -m bench.probe_cache --rows 1000000 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import decimal
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

BATCH_ROWS = 10_000
NAMES = ["id", "qty", "store", "flag", "price", "tax", "created", "updated", "name", "note"]
DDL = {
    "map": "op string, position string, file string, line bigint, after map<string,string>",
    "array": "op string, position string, file string, line bigint, vals array<string>, present bigint",
    "typed": "op string, position string, file string, line bigint, id bigint, qty int, store int, flag boolean, "
    "price decimal(12,2), tax decimal(12,2), created timestamp_ntz, updated timestamp_ntz, name string, note string, present bigint",
}
KEY = {"map": "after['id']", "array": "vals[0]", "typed": "id"}


def batches() -> dict[str, pa.RecordBatch]:
    """One Arrow batch of ``BATCH_ROWS`` bench-like changes per form."""
    ids = list(range(BATCH_ROWS))
    ints = [i % 1000 for i in ids]
    decs = [decimal.Decimal(i % 100000) / 100 for i in ids]
    stamps = [dt.datetime(2024, 1, 1) + dt.timedelta(seconds=i) for i in ids]
    typed = [
        pa.array(ids, pa.int64()),
        pa.array(ints, pa.int32()),
        pa.array(ints, pa.int32()),
        pa.array([i % 2 == 0 for i in ids]),
        pa.array(decs, pa.decimal128(12, 2)),
        pa.array(decs, pa.decimal128(12, 2)),
        pa.array(stamps, pa.timestamp("us")),
        pa.array(stamps, pa.timestamp("us")),
        pa.array([f"customer name {i}" for i in ids]),
        pa.array([f"note text {i % 97} xx" for i in ids]),
    ]
    common = {
        "op": pa.array(["u"] * BATCH_ROWS),
        "position": pa.array([f"{i:020d}" for i in ids]),
        "file": pa.array(["/archive/2026/11/29/part-0001.jsonl"] * BATCH_ROWS),
        "line": pa.array(ids, pa.int64()),
    }
    k = len(NAMES)
    offsets = pa.array(np.arange(0, (BATCH_ROWS + 1) * k, k, dtype=np.int32))
    row_major = pa.array(np.arange(k * BATCH_ROWS).reshape(k, BATCH_ROWS).T.ravel())
    texts = pa.concat_arrays([c.cast(pa.string()) for c in typed]).take(row_major)
    full = pa.array([(1 << k) - 1] * BATCH_ROWS, pa.int64())
    return {
        "map": pa.RecordBatch.from_arrays(
            [*common.values(), pa.MapArray.from_arrays(offsets, pa.array(NAMES * BATCH_ROWS), texts)], names=[*common, "after"]
        ),
        "array": pa.RecordBatch.from_arrays(
            [*common.values(), pa.ListArray.from_arrays(offsets, texts), full], names=[*common, "vals", "present"]
        ),
        "typed": pa.RecordBatch.from_arrays([*common.values(), *typed, full], names=[*common, *NAMES, "present"]),
    }


def timed(action: Callable[[], Any]) -> tuple[Any, float]:
    """``action()``'s result and the seconds it took."""
    start = time.perf_counter()
    result = action()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="the first round warms the JVM up")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import StorageLevel
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.memory", "3g")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    seed = spark.range(2).repartition(2)
    repeat = max(1, args.rows // BATCH_ROWS // 2)  # per task, two tasks
    for rnd in range(args.rounds):
        for form, batch in batches().items():

            def rows(it: Iterator[pa.RecordBatch], batch: pa.RecordBatch = batch) -> Iterator[pa.RecordBatch]:
                for _ in it:
                    pass
                for _ in range(repeat):
                    yield batch

            df, key = seed.mapInArrow(rows, DDL[form]), F.expr(KEY[form])
            _, alone = timed(lambda: df.select(F.max(key)).collect())  # noqa: B023
            cached = df.persist(StorageLevel.MEMORY_AND_DISK)
            _, persist = timed(cached.count)
            _, from_cache = timed(lambda: cached.repartition(8, key).select(F.max(key)).collect())  # noqa: B023
            cached.unpersist(blocking=True)
            kept, checkpoint = timed(lambda: df.localCheckpoint(eager=True))  # noqa: B023
            _, from_checkpoint = timed(lambda: kept.repartition(8, key).select(F.max(key)).collect())  # noqa: B023
            print(
                f"round {rnd} {form:5s} rows alone {alone:5.2f}s | persist {persist:5.2f}s, shuffle from it {from_cache:5.2f}s"
                f" | localCheckpoint {checkpoint:5.2f}s, shuffle from it {from_checkpoint:5.2f}s",
                flush=True,
            )
    spark.stop()


if __name__ == "__main__":
    main()
