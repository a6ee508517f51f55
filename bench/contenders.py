"""The contenders, each measured on the same archive files.

* ``project_*``   — this project's ``run_batch`` (decode -> compact -> MERGE on
  the audit branch -> Great Expectations gate -> publish), end to end;
* ``textbook_*``  — ``spark.read.json`` with schema inference, ``ROW_NUMBER()``
  per key ordered by ``source.lsn`` desc, ``MERGE INTO`` an Iceberg table
  created with defaults;
* ``pyiceberg_*`` — pyiceberg ``delete`` + ``upsert`` of the same batch
  compacted in Python beforehand (the Iceberg writes are the figure; the
  single-process Python decode + compaction is reported beside it), in a
  child process with a time limit;
* ``orjson_limit`` — the decode limit: ``orjson.loads`` of every line, one
  process per core;
* ``spark_submit_*`` — the DAG's Spark job through ``spark-submit`` with the
  conf / jars / py-files the DAG passes, and a bare ``spark-submit`` of an
  empty PySpark job;
  the DAG's job is also sampled for the peak RSS of its whole process tree
  (launcher, JVM, Python driver, Python workers).

Child entry point: ``python -m bench.contenders pyiceberg-child ...``.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import cProfile
import datetime as dt
import io
import json
import multiprocessing as mp
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from cdc_apply.config import Settings
from cdc_apply.runtime.session import JOB_DESCRIPTION
from cdc_apply.runtime.submit import spark_submit_bin, submit_spec

from . import workload as wl

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "spark_jobs", ROOT / "plugins"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


# -- environment ------------------------------------------------------------------


def sources_yaml(names: list[str], merge_mode: str | None = None) -> str:
    lines = ["sources:"]
    for n in names:
        lines += [
            f"  {n}:",
            "    format: debezium_postgres",
            f"    namespace: {n}",
            "    quarantine_max_share: 0.0",
            # the workload's changes carry Debezium's transaction block, but no transaction
            # topic is archived (no END markers): under publish: transactions every event would wait
            "    publish: events",
            *([f"    merge_mode: {merge_mode}"] if merge_mode else []),
            "    tables:",
            f"      {wl.SCHEMA_NAME}.{wl.TABLE}: {{primary_key: [{wl.KEY}]}}",
        ]
    return "\n".join(lines) + "\n"


def scratch_dir(prefix: str) -> Path:
    """A temporary folder for an A/B script's data and catalog, removed when
    the script exits: a 1M-row A/B leaves 3-8 GB, and a few of them filled
    this machine's disk."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, work, True)
    return work


def prepare_home(home: Path, sources: list[str], merge_mode: str | None = None) -> dict[str, str]:
    """A fresh CDC_HOME (own SQLite catalog and warehouse) and a sources file
    (``merge_mode`` for every source; None: the project's default); returns
    the environment variables, also set in ``os.environ``.  A home left by
    an earlier run (a kept ``--workdir``) is emptied first: its catalog would
    count the run's files as applied."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    sf = home / "sources.yaml"
    sf.write_text(sources_yaml(sources, merge_mode))
    env = {
        "CDC_HOME": str(home),
        "CDC_SOURCES_FILE": str(sf),
        "CDC_JARS_DIR": os.environ.get("CDC_JARS_DIR") or str(ROOT / ".cdc" / "jars"),
        "CDC_SPARK_MASTER": os.environ.get("CDC_SPARK_MASTER") or "local[*]",
        "CDC_EXPECTATIONS_DIR": str(home / "expectations"),  # no user suites: the generated gate only
    }
    for k in ("CDC_ARCHIVE_DIR", "CDC_WAREHOUSE", "CDC_CATALOG_URI", "CDC_CATALOG_TYPE", "CDC_CATALOG_NAME"):
        os.environ.pop(k, None)
    os.environ.update(env)
    return env


def archive_files(paths: list[str]):
    """ArchiveFile records (size + SHA-256: discovery's work, not timed)."""
    from cdc_apply.archive.listing import fingerprint

    return sorted(fingerprint(Path(p)) for p in paths)


def file_stats(paths: list[str]) -> tuple[int, int]:
    """(events, bytes) of archive files: one event per non-empty line."""
    events = total = 0
    for p in paths:
        data = Path(p).read_bytes()
        total += len(data)
        events += sum(1 for line in data.split(b"\n") if line.strip())
    return events, total


# -- the project ------------------------------------------------------------------


def project_table(settings, source: str) -> str:
    return f"{settings.catalog_name}.{source}.{wl.TABLE}"


def _job_group(spark, group: str) -> None:
    """Tag the following Spark jobs with a group, without a job description
    (so the UI keeps each statement's own description and call site)."""
    sc = spark.sparkContext
    sc.setLocalProperty("spark.jobGroup.id", group)
    sc.setLocalProperty(JOB_DESCRIPTION, None)


def project_apply(
    spark, settings, source: str, paths: list[str], *, profile_to: Path | None = None, group: str | None = None
) -> dict[str, Any]:
    """``run_batch`` on exactly these files; wall time of the whole call.  Its
    Spark jobs carry ``group`` (default ``project:<source>``), for
    ``spark_jobs_profile``."""
    from cdc_apply.batch import run_batch

    files = archive_files(paths)
    prof = cProfile.Profile() if profile_to else None
    _job_group(spark, group or f"project:{source}")
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    result = run_batch(settings, source, files, spark=spark)
    if prof:
        prof.disable()
    seconds = time.perf_counter() - t0
    _job_group(spark, "bench")
    if result.status != "complete":
        raise RuntimeError(f"project batch on {source} ended {result.status}: {result.message}")
    if not result.tables or any(t.status == "skipped" for t in result.tables):
        # a figure of a batch that applied nothing would be a fast lie
        raise RuntimeError(f"project batch on {source} applied nothing (its files were applied before): {result.message}")
    out = {
        "seconds": seconds,
        "status": result.status,
        "batch_id": result.batch_id,
        "messages": result.messages,
        "tables": [{"table": t.table, "status": t.status, "counts": t.counts} for t in result.tables],
    }
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(
            r"cdc_apply|great_expectations/checkpoint|pyiceberg/table/__init__", 40
        )
        profile_to.write_text(s.getvalue())
        out["cprofile_file"] = str(profile_to)
    return out


def project_setup(spark, settings, source: str, seed_path: Path, base_rows: int, *, via_seed: bool = True) -> float:
    """Create the project's table and fill it with keys ``1..base_rows``.

    ``via_seed``: apply the one-event seed batch (key 1) through ``run_batch``,
    so schema, CDC columns and properties are the project's own and the whole
    path is warmed up; otherwise call the project's ``tables.create_table``
    directly (same table, no batch: faster).  The remaining keys are
    bulk-appended by Spark with their CDC metadata columns (no JSON)."""
    from cdc_apply.batch import run_batch

    t0 = time.perf_counter()
    first = 1
    if not via_seed:
        try:
            from cdc_apply.apply import tables

            ident = project_table(settings, source)
            spec = tables.TableSpec(identifier=ident, key_columns=[wl.KEY], columns=dict(wl.SPARK_TYPES))
            tables.create_table(spark, spec, source)
        except Exception as exc:  # the core changed: fall back to the seed batch
            print(f"[bench] tables.create_table failed ({type(exc).__name__}: {exc}); creating {source} through a seed batch", flush=True)
            via_seed = True
    if via_seed:
        res = run_batch(settings, source, archive_files([str(seed_path)]), spark=spark)
        if res.status != "complete":
            raise RuntimeError(f"seed batch for {source}: {res.status} {res.message}")
        first = 2
    if base_rows >= first:
        ident = project_table(settings, source)
        meta = {
            "_cdc_position": f"'{wl.base_position()}'",
            "_cdc_op": "'r'",
            "_cdc_deleted": "false",
            "_cdc_commit_ts": f"timestamp_micros({wl._EPOCH_US_START})",
            "_cdc_tx_id": "'1'",
            "_cdc_batch_id": "'bench-base'",
            "_cdc_applied_at": "current_timestamp()",
            "_cdc_col_pos": "cast(map() AS map<string,string>)",  # full images: every column at the row's position
            "_cdc_change_id": "CAST(NULL AS string)",  # snapshot rows: no key change began them
            "_cdc_inherited": "cast(map() AS map<string,string>)",
            "_cdc_deleted_by": "CAST(NULL AS string)",
        }
        _append_typed(spark, ident, wl.base_rows_frame(spark, first, base_rows + 1), meta)
        _record_live_rows(spark, ident)
    return time.perf_counter() - t0


def _record_live_rows(spark, ident: str) -> None:
    """Keep the table's live rows as a batch's reconciliation would have
    (``tables.record_live_rows``): a table the project built holds its last
    count, so its next batch does not count them again; the appended base
    rows would otherwise leave the seed batch's count of one row, and the
    benchmark's first batch would pay a scan no hourly batch pays."""
    from cdc_apply.apply import branches, tables
    from cdc_apply.apply.table import read_snapshot

    spec = tables.TableSpec(identifier=ident, key_columns=[wl.KEY], columns=dict(wl.SPARK_TYPES))
    head = branches.branch_snapshot(spark, spec, "main")
    tables.record_live_rows(spark, ident, head, tables.live_rows(read_snapshot(spark, spec, head)))


def _append_typed(spark, ident: str, df, extra: dict[str, str]) -> None:
    from pyspark.sql import functions as F

    cols = []
    for f in spark.table(ident).schema.fields:
        expr = F.col(f"`{f.name}`") if f.name in df.columns else F.expr(extra[f.name])
        cols.append(expr.cast(f.dataType).alias(f.name))
    df.select(*cols).writeTo(ident).append()


# -- the textbook Spark pattern ---------------------------------------------------


def textbook_source(spark, paths: list[str]):
    """spark.read.json (schema inference) -> latest event per key by LSN."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType
    from pyspark.sql.window import Window

    raw = spark.read.json(paths)
    p = raw.select("payload.*")
    after = p.schema["after"].dataType
    before = p.schema["before"].dataType
    key = F.col(f"after.{wl.KEY}")
    if isinstance(before, StructType) and wl.KEY in before.fieldNames():
        key = F.coalesce(key, F.col(f"before.{wl.KEY}"))
    data_cols = [c for c in after.fieldNames() if c != wl.KEY]
    ev = p.select(
        F.col("op").alias("_op"), F.col("source.lsn").alias("_lsn"), key.alias(wl.KEY), *[F.col(f"after.{c}").alias(c) for c in data_cols]
    )
    w = Window.partitionBy(wl.KEY).orderBy(F.col("_lsn").desc())
    return ev.withColumn("_rn", F.row_number().over(w)).where("_rn = 1").drop("_rn"), [wl.KEY] + data_cols


def textbook_merge(spark, table: str, paths: list[str]) -> None:
    src, cols = textbook_source(spark, paths)
    src.createOrReplaceTempView("_textbook_src")
    sets = ", ".join(f"t.`{c}` = s.`{c}`" for c in cols if c != wl.KEY)
    spark.sql(f"""
        MERGE INTO {table} t USING _textbook_src s ON t.`{wl.KEY}` = s.`{wl.KEY}`
        WHEN MATCHED AND s._op = 'd' THEN DELETE
        WHEN MATCHED THEN UPDATE SET {sets}
        WHEN NOT MATCHED AND s._op <> 'd' THEN INSERT ({", ".join(f"`{c}`" for c in cols)}) VALUES ({", ".join(f"s.`{c}`" for c in cols)})
    """)
    spark.catalog.dropTempView("_textbook_src")


def textbook_setup(spark, table: str, seed_path: Path, base_rows: int) -> float:
    """Table created with defaults from the inferred schema of the seed file,
    seed merged (warms the path), then keys 2..N appended in the inferred types."""
    t0 = time.perf_counter()
    ns = table.rsplit(".", 1)[0]
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {ns}")
    src, cols = textbook_source(spark, [str(seed_path)])
    src.select(*[f"`{c}`" for c in cols]).limit(0).writeTo(table).using("iceberg").create()
    textbook_merge(spark, table, [str(seed_path)])
    if base_rows > 1:
        from pyspark.sql import functions as F
        from pyspark.sql.types import LongType, StringType

        base = wl.base_rows_frame(spark, 2, base_rows + 1)
        fixed = []
        for f in spark.table(table).schema.fields:
            c = F.col(f"`{f.name}`")
            src_type = wl.SPARK_TYPES[f.name]
            if src_type.startswith("timestamp") and isinstance(f.dataType, LongType):
                c = F.unix_micros(c.cast("timestamp"))  # MicroTimestamp: micros in the JSON
            elif src_type.startswith("timestamp") and isinstance(f.dataType, StringType):
                c = F.date_format(c, "yyyy-MM-dd'T'HH:mm:ss.SSSSSS'Z'")  # ZonedTimestamp: ISO text
            elif src_type.startswith("decimal") and isinstance(f.dataType, StringType):
                scale = int(src_type.split(",")[1].rstrip(")"))  # base64 of the unscaled value, as in the JSON
                c = F.base64(F.unhex(F.hex(F.expr(f"CAST(`{f.name}` * {10**scale} AS bigint)"))))
            fixed.append(c.cast(f.dataType).alias(f.name))
        base.select(*fixed).writeTo(table).append()
    return time.perf_counter() - t0


def textbook_apply(spark, table: str, paths: list[str]) -> dict[str, Any]:
    _job_group(spark, "textbook")
    t0 = time.perf_counter()
    textbook_merge(spark, table, paths)
    seconds = time.perf_counter() - t0
    _job_group(spark, "bench")
    return {"seconds": seconds}


# -- pyiceberg upsert -------------------------------------------------------------

PYICEBERG_TABLE = "pyice"


def pyiceberg_setup(spark, settings, base_rows: int) -> float:
    """A table with the project's data types (no CDC columns), key 1..N, by Spark."""
    t0 = time.perf_counter()
    ident = f"{settings.catalog_name}.{PYICEBERG_TABLE}.{wl.TABLE}"
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {settings.catalog_name}.{PYICEBERG_TABLE}")
    cols = ", ".join(f"`{n}` {t}{' NOT NULL' if n == wl.KEY else ''}" for n, t in wl.SPARK_TYPES.items())
    spark.sql(f"CREATE TABLE {ident} ({cols}) USING iceberg TBLPROPERTIES ('format-version'='2')")
    spark.sql(f"ALTER TABLE {ident} SET IDENTIFIER FIELDS `{wl.KEY}`")
    _append_typed(spark, ident, wl.base_rows_frame(spark, 1, base_rows + 1), {})
    return time.perf_counter() - t0


def _decimal(b64: str | None, scale: int) -> Decimal | None:
    if b64 is None:
        return None
    return Decimal(int.from_bytes(base64.b64decode(b64), "big", signed=True)).scaleb(-scale)


def compact_in_python(paths: list[str]) -> tuple[list[dict], list[int], int]:
    """Net change per key (last by LSN): (upsert rows, deleted keys, events)."""
    last: dict[int, tuple[int, str, dict | None]] = {}
    events = 0
    for p in paths:
        for line in Path(p).read_bytes().split(b"\n"):
            if not line.strip():
                continue
            events += 1
            pl = orjson.loads(line)["payload"]
            op, lsn = pl["op"], pl["source"]["lsn"]
            row = pl["after"] if op != "d" else None
            key = (row or pl["before"])[wl.KEY]
            if key not in last or lsn >= last[key][0]:
                last[key] = (lsn, op, row)
    rows, deletes = [], []
    for key, (_, op, row) in last.items():
        if op == "d":
            deletes.append(key)
            continue
        rows.append(
            {
                **row,
                "amount": _decimal(row["amount"], 2),
                "tax_rate": _decimal(row["tax_rate"], 4),
                "created_at": dt.datetime(1970, 1, 1) + dt.timedelta(microseconds=row["created_at"]),
                "updated_at": dt.datetime.fromisoformat(row["updated_at"].replace("Z", "+00:00")),
            }
        )
    return rows, deletes, events


def pyiceberg_child(args: argparse.Namespace) -> int:
    import pyarrow as pa
    from pyiceberg.expressions import In

    from cdc_apply.config import Settings
    from cdc_apply.ledger import Ledger

    paths = json.loads(Path(args.files_json).read_text())
    t_decode = time.perf_counter()
    rows, deletes, events = compact_in_python(paths)
    table = Ledger(Settings.from_env()).catalog.load_table(f"{PYICEBERG_TABLE}.{wl.TABLE}")
    arrow = pa.Table.from_pylist(rows, schema=table.schema().as_arrow())
    decode_seconds = time.perf_counter() - t_decode
    print(
        json.dumps({"phase": "ready", "rows": len(rows), "deletes": len(deletes), "events": events, "decode_seconds": decode_seconds}),
        flush=True,
    )
    t0 = time.perf_counter()
    if deletes:
        table.delete(In(wl.KEY, deletes))
    res = table.upsert(arrow, join_cols=[wl.KEY])
    seconds = time.perf_counter() - t0
    live = table.refresh().scan(selected_fields=(wl.KEY,)).to_arrow().num_rows
    print(
        json.dumps(
            {
                "phase": "done",
                "seconds": seconds,
                "rows_updated": res.rows_updated,
                "rows_inserted": res.rows_inserted,
                "rows": len(rows),
                "deletes": len(deletes),
                "events": events,
                "decode_seconds": decode_seconds,
                "rows_after": live,
            }
        ),
        flush=True,
    )
    return 0


def pyiceberg_apply(env: dict[str, str], paths: list[str], timeout: float, workdir: Path) -> dict[str, Any]:
    """Run the pyiceberg child; only delete + upsert are timed (by the child).
    On timeout the child is killed and the figure is an upper bound."""
    files_json = workdir / "pyiceberg_files.json"
    files_json.write_text(json.dumps(paths))
    cmd = [sys.executable, "-m", "bench.contenders", "pyiceberg-child", "--files-json", str(files_json)]
    proc = subprocess.Popen(
        cmd,
        cwd=workdir,
        env={**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "spark_jobs"), os.environ.get("PYTHONPATH", "")])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready_at = None
    lines: list[dict] = []

    def reader() -> None:
        nonlocal ready_at
        for line in proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                msg = json.loads(line)
                lines.append(msg)
                if msg.get("phase") == "ready":
                    ready_at = time.perf_counter()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    start = time.perf_counter()
    while proc.poll() is None:
        now = time.perf_counter()
        if ready_at is not None and now - ready_at > timeout:
            proc.kill()
            proc.wait()
            break
        if ready_at is None and now - start > max(600.0, timeout):
            proc.kill()
            proc.wait()
            raise RuntimeError("pyiceberg child did not get ready (decode/compaction too slow)")
        time.sleep(0.2)
    th.join(timeout=5)
    done = [m for m in lines if m.get("phase") == "done"]
    ready = [m for m in lines if m.get("phase") == "ready"]
    if done:
        return {**done[0], "timed_out": False}
    if ready and proc.returncode is not None and ready_at is not None and time.perf_counter() - ready_at >= timeout:
        return {
            "seconds": timeout,
            "timed_out": True,
            "events": ready[0]["events"],
            "rows": ready[0]["rows"],
            "deletes": ready[0]["deletes"],
            "decode_seconds": ready[0]["decode_seconds"],
        }
    raise RuntimeError(f"pyiceberg child failed (rc={proc.returncode}): {proc.stderr.read()[-3000:]}")


# -- the decode limit -------------------------------------------------------------


def _parse_file(path: str) -> tuple[int, int]:
    data = Path(path).read_bytes()
    n = 0
    for line in data.split(b"\n"):
        if line:
            msg = orjson.loads(line)
            n += msg["payload"]["op"] is not None
    return n, len(data)


def _noop(_: int) -> int:
    return 0


def orjson_limit(paths: list[str], processes: int, parse=_parse_file, warm=_noop) -> dict[str, Any]:
    """orjson.loads of every line (or ``parse`` of every file), one process per core (pool start not timed)."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(processes) as pool:
        pool.map(warm, range(processes))
        # largest files first: better balance over the processes
        order = sorted(paths, key=lambda p: -Path(p).stat().st_size)
        t0 = time.perf_counter()
        parts = pool.map(parse, order, chunksize=1)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "events": sum(p[0] for p in parts), "bytes": sum(p[1] for p in parts), "processes": processes}


def _payload_file(path: str) -> tuple[int, int]:
    """The typed payload decode alone (the decode fast path's msgspec Structs,
    ``decode/fast_debezium.py``) of every line, from the read buffer: the
    first line of the schema is learnt through the exact decoder."""
    import functools

    from cdc_apply.decode import DecodeContext, make_decoder
    from cdc_apply.decode import fast_debezium as fd

    fast = fd.FastPostgres(make_decoder("debezium_postgres", DecodeContext()))
    n = 0
    for buf, number, start, end in fd.spans(path, functools.partial(Path(path).open, "rb"), None):
        plan, cut = fast._plan_of(buf, start, end)
        if plan is None:
            fast.line(path, number, buf, start, end)
        else:
            plan.payload.decode(memoryview(buf)[cut : end - 1])
        n += 1
    return n, Path(path).stat().st_size


def _import_fast_path(_: int) -> int:
    import cdc_apply.decode.fast_debezium  # noqa: F401 - imports are not timed

    return 0


def payload_limit(paths: list[str], processes: int) -> dict[str, Any]:
    """The payload-only limit: ``_payload_file`` on every file, one process per core."""
    return orjson_limit(paths, processes, parse=_payload_file, warm=_import_fast_path)


def decode_stage(spark, paths: list[str], runs: int) -> dict[str, Any]:
    """The project's decode stage alone (``decode_batch`` + the persist the
    batch does), exact decoder vs fast path on the same files, alternating,
    ``runs`` times each; medians."""
    from cdc_apply.decode import DecodeContext
    from cdc_apply.decode.stage import decode_batch

    files = [(p, Path(p).stat().st_size) for p in paths]
    seconds: dict[str, list[float]] = {"exact": [], "fast": []}
    rows = 0
    for _ in range(runs):
        for mode in ("exact", "fast"):
            ctx = DecodeContext(source="bench", primary_keys={wl.TABLE: ["id"]}, options={"decode": mode})
            t = time.perf_counter()
            df = decode_batch(spark, files, "debezium_postgres", ctx).frame
            df = df.persist()
            rows = df.count()
            seconds[mode].append(time.perf_counter() - t)
            df.unpersist()
    med = {m: sorted(v)[len(v) // 2] for m, v in seconds.items()}
    return {
        "rows": rows,
        "exact_seconds": round(med["exact"], 3),
        "fast_seconds": round(med["fast"], 3),
        "runs": runs,
        "exact_runs": [round(x, 2) for x in seconds["exact"]],
        "fast_runs": [round(x, 2) for x in seconds["fast"]],
        "ratio": round(med["exact"] / med["fast"], 3),
    }


# -- spark-submit ------------------------------------------------------------------


def _run_sampled(cmd: list[str], env: dict[str, str], log: Path, *, sample_rss: bool = False, interval: float = 0.1) -> dict[str, Any]:
    # cwd: the log's folder (a JVM crash writes hs_err_pid*.log into the cwd)
    """Run a command to its end; wall seconds and (optionally) the peak RSS of
    its whole process tree (spark-submit launcher, JVM, Python driver, workers)."""
    import psutil

    t0 = time.perf_counter()
    peak, split = 0, {}
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=log.parent, env=env, stdout=fh, stderr=subprocess.STDOUT)
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            if sample_rss:
                total, parts = _tree_rss(ps)
                if total > peak:
                    peak, split = total, parts
            time.sleep(interval)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        text = log.read_text(errors="replace")
        oom = "java.lang.OutOfMemoryError" in text
        raise RuntimeError(
            f"{Path(cmd[0]).name} exited {proc.returncode}{' (java.lang.OutOfMemoryError in the JVM)' if oom else ''}; log {log}"
        )
    out: dict[str, Any] = {"seconds": seconds}
    if sample_rss:
        out.update(peak_rss_bytes=peak, at_peak_mb={k: round(v / 2**20, 1) for k, v in split.items()})
    return out


def spark_submit_job(
    source: str, paths: list[str], workdir: Path, master: str, tag: str, *, sample_rss: bool = True, driver_memory: str | None = None
) -> dict[str, Any]:
    """``spark-submit spark_jobs/apply_batch.py apply --source S --files-from M``
    as the DAG's ``apply`` task runs it (conf / jars / py-files from
    ``submit_spec()``, manifest written as discovery writes it): the write
    and the gate in one job, as the DAG's ``--stage write+validate``, plus
    the publish and finish the DAG runs as pyiceberg tasks without Spark;
    wall time of the whole submit, and peak RSS of its process tree."""
    s = submit_spec(Settings.from_env(), os.environ)
    manifest = workdir / f"{tag}_files.json"
    manifest.write_text(json.dumps(wl.manifest_entries(paths), indent=1))
    result_file = workdir / f"{tag}_result.json"
    env = {**os.environ, **s.env, "PYSPARK_PYTHON": sys.executable}
    with s.job_conf() as conf:  # as the DAG's operator: the driver's class archive
        cmd = [spark_submit_bin(), "--master", master] + (["--driver-memory", driver_memory] if driver_memory else [])
        for k, v in conf.items():
            cmd += ["--conf", f"{k}={v}"]
        cmd += [
            "--jars",
            ",".join(s.jars),
            "--py-files",
            s.py_files,
            "--name",
            f"cdc_apply_{source}",
            str(ROOT / "spark_jobs" / "apply_batch.py"),
            "apply",
            "--source",
            source,
            "--files-from",
            str(manifest),
            "--result-file",
            str(result_file),
            "--max-files=0",
        ]
        run = _run_sampled(cmd, env, workdir / f"{tag}_spark_submit.log", sample_rss=sample_rss)
        opts = conf.get("spark.driver.extraJavaOptions") or ""
        run["class_archive"] = "used" if "SharedArchiveFile=" in opts else "written" if "ArchiveClassesAtExit=" in opts else "none"
    result = json.loads(result_file.read_text())
    if result.get("status") != "complete":
        raise RuntimeError(f"{tag} job ended {result.get('status')}: {result.get('message')}")
    return {**run, "status": result["status"]}


EMPTY_JOB = """from pyspark.sql import SparkSession
spark = SparkSession.builder.appName("empty").getOrCreate()
spark.stop()
"""


def spark_submit_bare(workdir: Path, master: str) -> dict[str, Any]:
    job = workdir / "empty_job.py"
    job.write_text(EMPTY_JOB)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    return _run_sampled([spark_submit_bin(), "--master", master, str(job)], env, workdir / "bare_spark_submit.log")


# -- Spark Connect: the DAG's tasks on a long-lived driver -------------------------------------


def connect_job(source: str, paths: list[str], workdir: Path, url: str, tag: str, sources_file: Path | None = None) -> dict[str, Any]:
    """What a DAG task does with a ``spark_connect`` connection: the job
    (``cdc apply --files-from M``) as a Spark Connect client of the server;
    wall time of the whole process (interpreter start, imports, the job)."""
    manifest = workdir / f"{tag}_files.json"
    manifest.write_text(json.dumps(wl.manifest_entries(paths), indent=1))
    result_file = workdir / f"{tag}_result.json"
    cmd = [
        sys.executable,
        "-m",
        "cdc_apply.cli",
        "apply",
        "--source",
        source,
        "--files-from",
        str(manifest),
        "--result-file",
        str(result_file),
    ]
    env = {**os.environ, "CDC_SPARK_REMOTE": url, **({"CDC_SOURCES_FILE": str(sources_file)} if sources_file else {})}
    run = _run_sampled(cmd, env, workdir / f"{tag}_connect.log")
    result = json.loads(result_file.read_text())
    if result.get("status") != "complete":
        raise RuntimeError(f"{tag} job ended {result.get('status')}: {result.get('message')}")
    return {**run, "schema_changes": [c for t in result.get("tables", []) for c in t.get("schema_changes", [])]}


# -- peak RSS of a process tree ------------------------------------------------------


def _tree_rss(proc) -> tuple[int, dict[str, int]]:
    """Summed RSS of a process and its descendants, and the split by kind."""
    import psutil

    total = 0
    split: dict[str, int] = {}
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, split
    for p in procs:
        try:
            rss = p.memory_info().rss
            name = p.name()
            cmd = " ".join(p.cmdline()[:4])
        except psutil.Error:
            continue
        kind = (
            "jvm"
            if "java" in name
            else (
                "python_workers"
                if "pyspark.daemon" in cmd or "pyspark.worker" in cmd
                else "python_driver"
                if p.pid == proc.pid
                else "other"
            )
        )
        split[kind] = split.get(kind, 0) + rss
        total += rss
    return total, split


# -- Spark profile (stage/job timings through the UI's REST API) ---------------------


def spark_jobs_profile(spark, group: str, wall_seconds: float | None = None) -> dict[str, Any]:
    """Where the time of one job group went, from the Spark UI's REST API:
    jobs with their durations, attributed to the SQL execution (statement or
    DataFrame action and its Python call site) that ran them; the time with at
    least one Spark job running vs driver-only time (Python, planning, catalog
    commits, GX bookkeeping)."""
    url = spark.sparkContext.uiWebUrl
    if not url:
        return {"error": "Spark UI disabled"}
    app = spark.sparkContext.applicationId

    def get(path: str):
        with urllib.request.urlopen(f"{url}/api/v1/applications/{app}/{path}", timeout=60) as r:
            return json.loads(r.read())

    def ts(s: str | None) -> float | None:
        if not s:
            return None
        return dt.datetime.strptime(s.replace("GMT", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()

    jobs = [j for j in get("jobs") if j.get("jobGroup") == group]
    stages = {s["stageId"]: s for s in get("stages")}
    try:
        execs = get("sql?details=false&offset=0&length=100000")
    except Exception:
        execs = []
    job_exec: dict[int, dict] = {}
    for e in execs:
        for j in e.get("successJobIds", []) + e.get("failedJobIds", []) + e.get("runningJobIds", []):
            job_exec[j] = e
    rows, intervals = [], []
    for j in jobs:
        start, end = ts(j.get("submissionTime")), ts(j.get("completionTime"))
        if start and end:
            intervals.append((start, end))
        st = [stages[i] for i in j.get("stageIds", []) if i in stages]
        e = job_exec.get(j["jobId"])
        what = " ".join(((e or {}).get("description") or j.get("name") or "?").split())[:160]
        rows.append(
            {
                "job": j["jobId"],
                "what": what,
                "callsite": j.get("name"),
                "seconds": round((end - start), 3) if start and end else 0.0,
                "tasks": j.get("numTasks"),
                "executor_run_seconds": round(sum(x.get("executorRunTime", 0) for x in st) / 1000, 3),
                "executor_cpu_seconds": round(sum(x.get("executorCpuTime", 0) for x in st) / 1e9, 3),
                "input_mb": round(sum(x.get("inputBytes", 0) for x in st) / 1e6, 2),
                "shuffle_write_mb": round(sum(x.get("shuffleWriteBytes", 0) for x in st) / 1e6, 2),
                "gc_seconds": round(sum(x.get("jvmGcTime", 0) for x in st) / 1000, 3),
                "spilled_mb": round(sum(x.get("diskBytesSpilled", 0) for x in st) / 1e6, 2),
            }
        )
    busy, cur = 0.0, None
    for a, b in sorted(intervals):
        if cur is None or a > cur[1]:
            if cur:
                busy += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur:
        busy += cur[1] - cur[0]
    by_what: dict[str, dict[str, float]] = {}
    for r in rows:
        d = by_what.setdefault(r["what"], {"jobs": 0, "seconds": 0.0, "executor_run_seconds": 0.0, "executor_cpu_seconds": 0.0})
        d["jobs"] += 1
        d["seconds"] += r["seconds"]
        d["executor_run_seconds"] += r["executor_run_seconds"]
        d["executor_cpu_seconds"] += r["executor_cpu_seconds"]
    out = {
        "jobs": len(rows),
        "job_seconds_total": round(sum(r["seconds"] for r in rows), 3),
        "seconds_with_jobs_running": round(busy, 3),
        "by_statement": dict(
            sorted(((k, {kk: round(vv, 3) for kk, vv in v.items()}) for k, v in by_what.items()), key=lambda kv: -kv[1]["seconds"])
        ),
        "longest_jobs": sorted(rows, key=lambda r: -r["seconds"])[:15],
        "executor_run_seconds": round(sum(r["executor_run_seconds"] for r in rows), 3),
        "executor_cpu_seconds": round(sum(r["executor_cpu_seconds"] for r in rows), 3),
        "gc_seconds": round(sum(r["gc_seconds"] for r in rows), 3),
        "spilled_mb": round(sum(r["spilled_mb"] for r in rows), 2),
    }
    if wall_seconds:
        out["wall_seconds"] = round(wall_seconds, 3)
        out["driver_only_seconds"] = round(wall_seconds - busy, 3)
    return out


def ab_summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """An A/B script's medians per variant (``seconds``, ``spark_jobs`` of each run), printed."""
    import statistics

    summary = {
        k: {
            "median_s": statistics.median(r["seconds"] for r in rs),
            "median_jobs": statistics.median(r["spark_jobs"] for r in rs),
            "runs": rs,
        }
        for k, rs in results.items()
    }
    for k, s in summary.items():
        print(f"[ab] {k}: median {s['median_s']:.2f}s, {s['median_jobs']} jobs, over {len(s['runs'])}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.contenders")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("pyiceberg-child")
    b.add_argument("--files-json", required=True)
    b.set_defaults(func=pyiceberg_child)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
