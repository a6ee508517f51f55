"""One command, every figure: ``python -m bench.run --scale tiny|small|full --out results.json``.

Writes the workload into a temporary folder with its own CDC_HOME (SQLite
catalog + warehouse) and sources file, builds the base tables, runs every
contender on the same files in this one run, prints a table and writes the
figures as JSON.  Targets are reported PASS / MISS, never asserted.
See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cdc_apply.runtime.spark_conf import jar_paths
from tests.servers import running_connect_server

from . import contenders as C
from . import workload as wl

PRESETS: dict[str, dict[str, Any]] = {
    # toy sizes: every contender and figure, well under 2 minutes
    "tiny": dict(
        events=2_000,
        base_rows=5_000,
        events_per_file=500,
        scale_events=2_000,
        scale_small_rows=5_000,
        scale_large_rows=50_000,
        hourly_events=1_000,
        rss_events=1_000,
        rss_runs=1,
        hourly_runs=1,
        pyiceberg_cap=2_000,
        pyiceberg_timeout=120,
        next_batches=2,
    ),
    "small": dict(
        events=100_000,
        base_rows=1_000_000,
        events_per_file=20_000,
        scale_events=100_000,
        scale_small_rows=1_000_000,
        scale_large_rows=10_000_000,
        hourly_events=1_000,
        rss_events=20_000,
        rss_runs=3,
        hourly_runs=3,
        pyiceberg_cap=100_000,
        pyiceberg_timeout=600,
        next_batches=4,
    ),
    "full": dict(
        events=1_000_000,
        base_rows=1_000_000,
        events_per_file=20_000,
        scale_events=100_000,
        scale_small_rows=1_000_000,
        scale_large_rows=10_000_000,
        hourly_events=1_000,
        rss_events=100_000,
        rss_runs=3,
        hourly_runs=3,
        pyiceberg_cap=100_000,
        pyiceberg_timeout=900,
        next_batches=4,
    ),
}

# name, figure key, comparison, threshold, description
TARGETS = [
    ("project_vs_textbook", ">=", 3.0, "project events/s / textbook events/s (spec: 1M events into 1M rows)"),
    (
        "project_vs_textbook_warm",
        ">=",
        3.0,
        "the same, each contender's second run of the session on the same files into a fresh table (the first run of a "
        "session pays the JVM's warm-up; the textbook runs after the project)",
    ),
    ("project_vs_pyiceberg", ">=", 50.0, "project events/s / pyiceberg upsert events/s"),
    ("project_vs_limit", ">=", 0.20, "project events/s / orjson decode limit events/s (one process per core)"),
    ("table_size_ratio", "<=", 1.3, "seconds into large table / seconds into small table (spec: 100k events, 10M vs 1M rows)"),
    (
        "hourly_overhead_ratio",
        "<=",
        2.5,
        "1k-event batch via the DAG's spark-submit (a driver per task) / bare spark-submit of an empty job",
    ),
    (
        "hourly_connect_ratio",
        "<=",
        2.5,
        "1k-event batch via the DAG's Spark Connect path (warm server: docker-compose's default) / bare spark-submit",
    ),
    ("hourly_connect_mor_ratio", "<=", 2.5, "the same, the source set to merge_mode: merge-on-read / bare spark-submit"),
    (
        "hourly_warm_ratio",
        "<=",
        2.5,
        "1k-event batch via the embedded default's DAG task on a local master (a client of the home's warm driver, "
        "after the batch that started it) / bare spark-submit",
    ),
    ("rss_ratio", "<=", 1.2, "peak RSS (whole process tree) of a 5x batch / of a 1x batch"),
    ("decode_speedup", ">=", 4.0, "decode stage (decode_batch + persist), exact decoder seconds / fast path seconds, same files"),
    ("decode_vs_payload_limit", ">=", 0.5, "fast decode stage events/s / payload-only limit events/s (aim: within 2x)"),
    (
        "project_vs_python_pipeline",
        ">=",
        1.0,
        "project events/s / Python-only pipeline (orjson decode + compaction + pyiceberg upsert) events/s",
    ),
    (
        "project_next_vs_python_pipeline",
        ">=",
        1.0,
        "the same with the project's next batch (as many events as the Python-only pipeline's, right after the main "
        "batch in the same session: a warm JVM, as the embedded default's warm driver runs an hourly DAG's batches)",
    ),
    (
        "project_steady_vs_python_pipeline",
        ">=",
        1.0,
        "the same with the median of the project's later batches of that size (the session's third and on: the "
        "steady state of the warm driver, which runs every hourly batch of a source in one JVM)",
    ),
]


def machine_facts(settings) -> dict[str, Any]:
    import orjson
    import psutil
    import pyiceberg
    import pyspark

    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30).stderr.splitlines()[0]
    except Exception as exc:  # pragma: no cover
        java = f"unknown ({exc})"
    jars = [p.name for p in jar_paths(settings)]
    return {
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "pyspark": pyspark.__version__,
        "pyiceberg": pyiceberg.__version__,
        "orjson": orjson.__version__,
        "iceberg_jar": next((j for j in jars if "iceberg" in j), None),
        "java": java,
        "spark_master": settings.spark_master,
    }


def _vs_bare(job: dict, bare: dict, **fields) -> dict:
    """A timed job against the bare spark-submit of the same run."""
    return {
        **fields,
        "job_seconds": round(job["seconds"], 3),
        "bare_seconds": round(bare["seconds"], 3),
        "ratio": round(job["seconds"] / bare["seconds"], 3),
    }


def _client_runs(batches: list, workdir: Path, master: str, url: str, tag: str) -> tuple[dict, list[dict], list[dict]]:
    """Spark Connect client jobs on ``url``: the first batch, then each next
    one beside a bare spark-submit (alternating, so a slow spell of the
    machine hits both)."""
    first = C.connect_job("bench", batches[0].paths, workdir, url, f"{tag}_first")
    warms, bares = [], []
    for i, batch in enumerate(batches[1:]):
        bares.append(C.spark_submit_bare(workdir, master))
        warms.append(C.connect_job("bench", batch.paths, workdir, url, f"{tag}_warm_{i}"))
    return first, warms, bares


def _client_figure(first: dict, warms: list[dict], bares: list[dict], events: int, measured: str) -> dict:
    """The median client batch after the first against the median bare spark-submit."""
    bare = _median_run(bares, "seconds")
    return _vs_bare(
        _median_run(warms, "seconds"),
        bare,
        job_runs=[round(w["seconds"], 2) for w in warms],
        bare_runs=[round(b["seconds"], 2) for b in bares],
        events=events,
        first_batch_seconds=round(first["seconds"], 3),
        first_batch_ratio=round(first["seconds"] / bare["seconds"], 3),
        measured=measured,
    )


WARM_SOURCE = "bench_w"
# the table-size figure's tables, applied large, small, small, large: a session still warming up (each batch of
# the first few is faster than the one before) then weighs on both sizes alike; each figure is the mean of its two
TABLE_SIZE_ORDER = ("bench_l", "bench_s", "bench_s2", "bench_l2")


def _is_large(table_size_source: str) -> bool:
    """Whether a table of the table-size figure is its large one."""
    return table_size_source.startswith("bench_l")


def _warm_round(spark, settings, seed_path: Path, base_rows: int, paths: list[str]) -> dict:
    """The project and the textbook again on the main batch's files, each into
    a fresh table of ``base_rows`` (the project's through its own source),
    in the same order: each contender's second run of the session.  The
    first run of a session pays the JVM's warm-up (the JIT, first plans); the
    textbook's first run comes after the project's and the decode stage, so
    it pays less of it."""
    C.project_setup(spark, settings, WARM_SOURCE, seed_path, base_rows)
    project = C.project_apply(spark, settings, WARM_SOURCE, paths)["seconds"]
    table = f"{settings.catalog_name}.textbook_w.{wl.TABLE}"
    C.textbook_setup(spark, table, seed_path, base_rows)
    textbook = C.textbook_apply(spark, table, paths)["seconds"]
    return {
        "project_seconds": round(project, 3),
        "textbook_seconds": round(textbook, 3),
        "ratio": round(textbook / project, 3),  # project events/s over textbook events/s: the same events
        "measured": "each contender's second run of the session on the main batch's files, into a fresh table, after the first runs",
    }


def _steady(spark, settings, batches: list) -> dict:
    """The project's later batches of the next batch's size, into the same
    table in the same session (the third batch of the session and on): the
    median, what the warm driver's hourly batches cost once its JVM has run a
    few.  ``seconds_each`` in the JSON keeps every batch."""
    runs = [C.project_apply(spark, settings, "bench", b.paths, group="project_steady:bench")["seconds"] for b in batches]
    mid = sorted(range(len(runs)), key=runs.__getitem__)[len(runs) // 2]
    events, size = C.file_stats(batches[mid].paths)
    return _rate(events, size, runs[mid]) | {
        "seconds_each": [round(r, 3) for r in runs],
        "measured": "the median of the session's third batch and on, each as large as the Python-only pipeline's",
    }


def _hourly_warm(settings, batches: list, workdir: Path, master: str) -> dict:
    """The embedded default's DAG task (``CDC_SPARK_REMOTE=local``): the first
    batch starts the home's warm driver (what the first hour after an idle
    end costs), the next ones attach to it."""
    from cdc_apply.runtime import warm_driver

    try:
        first, warms, bares = _client_runs(batches, workdir, master, warm_driver.LOCAL, "warm")
    finally:
        warm_driver.stop(settings, now=True)
    return _client_figure(
        first,
        warms,
        bares,
        batches[1].events,
        "`cdc apply --files-from` with CDC_SPARK_REMOTE=local, what a DAG task on a local master runs "
        "in its process: interpreter start, imports, the job on the home's warm driver; the median of the "
        "batches after the one that started the driver (first_batch_seconds), each beside a bare spark-submit",
    )


def _rate(events: int, nbytes: int, seconds: float) -> dict[str, float]:
    return {
        "events": events,
        "bytes": nbytes,
        "mb": round(nbytes / 1e6, 2),
        "seconds": round(seconds, 3),
        "events_per_s": round(events / seconds, 1),
        "mb_per_s": round(nbytes / 1e6 / seconds, 3),
    }


def _pick_capped(files: wl.WorkloadFiles, cap: int) -> list[str]:
    """Leading files of the batch up to ``cap`` events (at least one file)."""
    out, n = [], 0
    for p in files.paths:
        e, _ = C.file_stats([p])
        if out and n + e > cap:
            break
        out.append(p)
        n += e
    return out


def _status(value: float, op: str, threshold: float) -> str:
    return "PASS" if (value >= threshold if op == ">=" else value <= threshold) else "MISS"


def _median_run(runs: list[dict[str, Any]], figure: str) -> dict[str, Any]:
    """The run with the median ``figure`` (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r[figure])[(len(runs) - 1) // 2]


def rss_plan(
    workload: wl.Workload, data: Path, args: argparse.Namespace, hourly_files: wl.WorkloadFiles
) -> tuple[bool, list[tuple[wl.WorkloadFiles, wl.WorkloadFiles]]]:
    """The RSS runs' (1x, 5x) batches, and whether the 1x one is the hourly
    batch.  They continue ``workload``'s history after the hourly batch
    (applied to the same table in order 1x, 5x, 1x, 5x, ...), each run with
    files of its own: a batch is applied once, so a run given files applied
    before would measure a batch that does nothing."""
    reuse = args.rss_events == args.hourly_events and args.rss_runs == 1
    batches = []
    for i in range(args.rss_runs):
        r1_files = hourly_files if reuse else workload.write(data / f"rss1_{i}", args.rss_events, args.events_per_file)
        batches.append((r1_files, workload.write(data / f"rss5_{i}", args.rss_events * 5, args.events_per_file)))
    return reuse, batches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--out", default="results.json", help="JSON file of the figures")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--workdir", help="keep data, catalog and logs here (default: a temporary folder, removed)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--profile", action="store_true", help="cProfile the driver during the project's main batch")
    p.add_argument(
        "--merge-mode",
        choices=["auto", "copy-on-write", "merge-on-read"],
        help="merge_mode of the benchmark's sources (default: the project's, auto)",
    )
    p.add_argument(
        "--dag-driver-memory",
        help="add --driver-memory to the DAG job's spark-submit (hourly and RSS runs); "
        "default: none, exactly as the DAG submits (CDC_SPARK_DRIVER_MEMORY, default 3g)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=[
            "textbook",
            "warm_round",
            "pyiceberg",
            "table_size",
            "hourly",
            "hourly_connect",
            "hourly_warm",
            "rss",
            "decode",
            "project_next",
        ],
        help="leave a contender out (its figures are then missing)",
    )
    for k, v in PRESETS["tiny"].items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), help=f"override the preset's {k}")
    args = p.parse_args(argv)
    for k, v in PRESETS[args.scale].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    """SIGTERM as ``SystemExit``, so that ``main``'s ``finally`` runs."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.ERROR)
    t_start = time.perf_counter()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cdc-bench-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(f"[bench {time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)  # noqa: E731
    # a run stopped with SIGTERM (kill, a CI timeout) still removes its ~12 GB work folder below
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args, workdir, say, t_start)
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work folder kept: {workdir}")


def _run(args: argparse.Namespace, workdir: Path, say, t_start: float) -> int:
    # the table-size figure reuses the main batch's files when its sizes match, but applies them to tables of its
    # own, two of each size, after the main batch (the session's first, which pays its warm-up): TABLE_SIZE_ORDER
    reuse_scale = args.scale_events == args.events and args.scale_small_rows == args.base_rows
    sources = ["bench", *TABLE_SIZE_ORDER, WARM_SOURCE]
    env = C.prepare_home(workdir / "home", sources, args.merge_mode)
    from cdc_apply.config import Settings

    settings = Settings.from_env()
    out: dict[str, Any] = {
        "scale": args.scale,
        "params": {k: getattr(args, k) for k in PRESETS["tiny"]} | {"seed": args.seed, "merge_mode": args.merge_mode or "auto"},
        "machine": machine_facts(settings),
        "setup_seconds": {},
        "contenders": {},
        "notes": [],
    }
    m = out["machine"]
    say(
        f"machine: {m['cores']} cores, {m['memory_gb']} GB, Python {m['python']}, pyspark {m['pyspark']}, "
        f"pyiceberg {m['pyiceberg']}, {m['iceberg_jar']}, {m['java']}"
    )

    # -- workload -------------------------------------------------------------------
    t = time.perf_counter()
    data = workdir / "data"
    seed_path = wl.write_seed(data / "seed")
    main_wl = wl.Workload(seed=args.seed, base_rows=args.base_rows, insert_slot=1)
    main_files = main_wl.write(data / "main", args.events, args.events_per_file)
    # the project's next batch, as large as the Python-only pipeline's, in the same (now warm) session
    # and (next_batches > 1) more of them, whose median is the warm driver's steady state
    next_runs = [] if "project_next" in args.skip else range(args.next_batches)
    next_batches = [
        main_wl.write(data / ("main_next" if i == 0 else f"main_next_{i}"), min(args.events, args.pyiceberg_cap), args.events_per_file)
        for i in next_runs
    ]
    next_files = next_batches[0] if next_batches else None
    # the DAG's first spark-submit job (it writes the driver's class archive), then the timed one; both continue main's history
    hourly_first_files = main_wl.write(data / "hourly_first", args.hourly_events, args.events_per_file)
    hourly_files = main_wl.write(data / "hourly", args.hourly_events, args.events_per_file)
    # more timed hourly jobs, each its own batch, each beside a bare spark-submit of its own: medians
    hourly_more = (
        [main_wl.write(data / f"hourly_{i}", args.hourly_events, args.events_per_file) for i in range(1, args.hourly_runs)]
        if "hourly" not in args.skip
        else []
    )
    scale_files = (
        main_files
        if reuse_scale
        else wl.Workload(seed=args.seed + 1, base_rows=args.scale_small_rows, insert_slot=2).write(
            data / "scale", args.scale_events, args.events_per_file
        )
    )
    reuse_rss, rss_batches = rss_plan(main_wl, data, args, hourly_files)
    rss1, rss5 = rss_batches[0]
    # after the RSS batches, the warm driver's: the batch that starts it (reported), hourly_runs timed warm ones;
    # then, for one Connect server: its first batch (warms its JVM; reported), hourly_runs timed warm ones, then
    # two with the source set to merge-on-read (the first switches the table; the second is timed). Both sections
    # meet the table as the spark-submit jobs left it, but for the other's few copy-on-write batches.
    warm_batches = [main_wl.write(data / f"warm_{i}", args.hourly_events, args.events_per_file) for i in range(args.hourly_runs + 1)]
    connect_batches = [main_wl.write(data / f"connect_{i}", args.hourly_events, args.events_per_file) for i in range(args.hourly_runs + 3)]
    pyice_paths = _pick_capped(main_files, args.pyiceberg_cap)
    out["setup_seconds"]["generate_files"] = round(time.perf_counter() - t, 2)
    out["workload"] = {
        "main": main_files.as_dict(),
        **({"main_next": next_files.as_dict()} if next_files is not None else {}),
        **{f"main_next_{i}": b.as_dict() for i, b in enumerate(next_batches[1:], 1)},
        "hourly_first": hourly_first_files.as_dict(),
        "hourly": hourly_files.as_dict(),
        "scale": scale_files.as_dict(),
        "rss_1x": rss1.as_dict(),
        "rss_5x": rss5.as_dict(),
    }
    say(
        f"workload: {main_files.events} events, {main_files.bytes / 1e6:.1f} MB in {len(main_files.paths)} files, ops {main_files.ops}, "
        f"{main_files.pk_changes} PK changes ({out['setup_seconds']['generate_files']}s)"
    )

    # -- base tables ------------------------------------------------------------------
    from cdc_apply.runtime.session import get_spark

    spark = get_spark(settings, app_name="cdc-bench")
    C._job_group(spark, "bench")
    setup = out["setup_seconds"]
    setup["project_table"] = round(C.project_setup(spark, settings, "bench", seed_path, args.base_rows), 2)
    say(f"project table: {args.base_rows} rows ({setup['project_table']}s)")
    textbook_table = f"{settings.catalog_name}.textbook.{wl.TABLE}"
    if "textbook" not in args.skip:
        setup["textbook_table"] = round(C.textbook_setup(spark, textbook_table, seed_path, args.base_rows), 2)
        say(f"textbook table: {args.base_rows} rows ({setup['textbook_table']}s)")
    if "pyiceberg" not in args.skip:
        setup["pyiceberg_table"] = round(C.pyiceberg_setup(spark, settings, args.base_rows), 2)
        say(f"pyiceberg table: {args.base_rows} rows ({setup['pyiceberg_table']}s)")
    if "table_size" not in args.skip:
        for name in TABLE_SIZE_ORDER:
            rows = args.scale_large_rows if _is_large(name) else args.scale_small_rows
            setup[f"table_size_{name}"] = round(C.project_setup(spark, settings, name, seed_path, rows, via_seed=False), 2)
        say(f"table-size tables: {args.scale_small_rows} / {args.scale_large_rows} rows")

    res = out["contenders"]
    errors: dict[str, str] = out.setdefault("errors", {})

    @contextlib.contextmanager
    def section(name: str):
        """A contender that fails is reported (``errors`` in the JSON, ERROR in
        the table) and the run goes on with the others."""
        try:
            yield
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"[:3000]
            say(f"{name} FAILED: {errors[name][:500]}")

    main_events, main_bytes = C.file_stats(main_files.paths)

    # -- (4) decode limit ---------------------------------------------------------------
    lim = C.orjson_limit(main_files.paths, os.cpu_count() or 1)
    res["orjson_limit"] = _rate(lim["events"], lim["bytes"], lim["seconds"]) | {"processes": lim["processes"]}
    say(f"orjson limit: {res['orjson_limit']['events_per_s']:.0f} events/s")
    plim = C.payload_limit(main_files.paths, os.cpu_count() or 1)
    res["payload_limit"] = _rate(plim["events"], plim["bytes"], plim["seconds"]) | {"processes": plim["processes"]}
    say(f"payload-only limit: {res['payload_limit']['events_per_s']:.0f} events/s")

    # -- (1) the project ---------------------------------------------------------------
    prof = workdir / "project_cprofile.txt" if args.profile else None
    p = C.project_apply(spark, settings, "bench", main_files.paths, profile_to=prof)
    res["project"] = _rate(main_events, main_bytes, p["seconds"]) | {
        "target_rows": args.base_rows,
        "counts": p["tables"][0]["counts"] if p["tables"] else {},
    }
    try:
        out["project_profile"] = C.spark_jobs_profile(spark, "project:bench", p["seconds"])
    except Exception as exc:  # the profile is a bonus
        out["project_profile"] = {"error": str(exc)}
    if prof:
        out["project_profile"]["cprofile"] = prof.read_text()
    say(f"project: {res['project']['events_per_s']:.0f} events/s ({p['seconds']:.1f}s)")
    if next_files is not None:
        with section("project_next"):
            next_events, next_bytes = C.file_stats(next_files.paths)
            pn = C.project_apply(spark, settings, "bench", next_files.paths, group="project_next:bench")
            res["project_next"] = _rate(next_events, next_bytes, pn["seconds"]) | {
                "counts": pn["tables"][0]["counts"] if pn["tables"] else {}
            }
            if args.profile:
                out["project_next_profile"] = C.spark_jobs_profile(spark, "project_next:bench", pn["seconds"])
            say(f"project, next batch: {res['project_next']['events_per_s']:.0f} events/s ({pn['seconds']:.1f}s)")
            if len(next_batches) > 1:
                res["project_steady"] = _steady(spark, settings, next_batches[1:])
                if args.profile:  # every later batch's jobs together
                    out["project_steady_profile"] = C.spark_jobs_profile(spark, "project_steady:bench")
                say(
                    f"project, steady state: {res['project_steady']['events_per_s']:.0f} events/s ({res['project_steady']['seconds']:.1f}s)"
                )

    # -- the decode stage alone: exact decoder vs fast path ------------------------------
    if "decode" not in args.skip:
        with section("decode"):
            out["decode_stage"] = C.decode_stage(spark, main_files.paths, runs=2)
            d = out["decode_stage"]
            say(f"decode stage: exact {d['exact_seconds']:.1f}s, fast {d['fast_seconds']:.1f}s ({d['ratio']:.2f}x)")

    # -- (2) textbook --------------------------------------------------------------------
    if "textbook" not in args.skip:
        with section("textbook"):
            tb = C.textbook_apply(spark, textbook_table, main_files.paths)
            res["textbook"] = _rate(main_events, main_bytes, tb["seconds"]) | {"target_rows": args.base_rows}
            say(f"textbook: {res['textbook']['events_per_s']:.0f} events/s ({tb['seconds']:.1f}s)")
    if "warm_round" not in args.skip and "textbook" in res:
        with section("warm_round"):
            out["warm_round"] = _warm_round(spark, settings, seed_path, args.base_rows, main_files.paths)
            w = out["warm_round"]
            say(f"second runs, fresh tables: project {w['project_seconds']:.1f}s, textbook {w['textbook_seconds']:.1f}s")

    # -- (3) pyiceberg upsert --------------------------------------------------------------
    if "pyiceberg" not in args.skip:
        with section("pyiceberg"):
            pe, pb = C.file_stats(pyice_paths)
            pi = C.pyiceberg_apply(env, pyice_paths, args.pyiceberg_timeout, workdir)
            res["pyiceberg"] = _rate(pe, pb, pi["seconds"]) | {
                "capped_to_events": pe,
                "timed_out": pi["timed_out"],
                "target_rows": args.base_rows,
                "upsert_rows": pi.get("rows"),
                "rows_updated": pi.get("rows_updated"),
                "rows_inserted": pi.get("rows_inserted"),
                "deletes": pi.get("deletes"),
                "rows_after": pi.get("rows_after"),
                "decode_compact_seconds": round(pi["decode_seconds"], 3),
                "with_decode": _rate(pe, pb, pi["seconds"] + pi["decode_seconds"]),
            }
            if pe < main_events:
                out["notes"].append(
                    f"pyiceberg upsert measured on the first {pe} events ({len(pyice_paths)} files) of the batch (cap {args.pyiceberg_cap}); "
                    "its rate is compared with the project's rate on the whole batch"
                )
            if pi["timed_out"]:
                out["notes"].append(f"pyiceberg upsert did not finish within {args.pyiceberg_timeout}s: its rate is an upper bound")
            say(
                f"pyiceberg: {res['pyiceberg']['events_per_s']:.0f} events/s ({pi['seconds']:.1f}s{', TIMED OUT' if pi['timed_out'] else ''})"
            )

    # -- same batch into a small vs a large table -----------------------------------------
    if "table_size" not in args.skip:
        with section("table_size"):
            se, _sb = C.file_stats(scale_files.paths)
            secs = {n: C.project_apply(spark, settings, n, scale_files.paths)["seconds"] for n in TABLE_SIZE_ORDER}
            small_s = sum(v for n, v in secs.items() if not _is_large(n)) / 2
            large_s = sum(v for n, v in secs.items() if _is_large(n)) / 2
            out["table_size"] = {
                "events": se,
                "small_rows": args.scale_small_rows,
                "large_rows": args.scale_large_rows,
                "small_seconds": round(small_s, 3),
                "large_seconds": round(large_s, 3),
                "ratio": round(large_s / small_s, 3),
                "runs": {n: round(v, 3) for n, v in secs.items()},
                "order": list(TABLE_SIZE_ORDER),
            }
            with contextlib.suppress(Exception):  # the profiles are a bonus: where the large table's extra seconds go
                out["table_size"]["profiles"] = {n: C.spark_jobs_profile(spark, f"project:{n}", v)["by_statement"] for n, v in secs.items()}
            say(f"table size: {small_s:.1f}s into {args.scale_small_rows} rows, {large_s:.1f}s into {args.scale_large_rows} rows")

    # -- hourly batch through spark-submit vs bare spark-submit ---------------------------------
    # -- peak RSS: the DAG's job on a 1x and a 5x batch, each its own process tree --------------
    master = settings.spark_master
    job = first_job = None
    if "hourly" not in args.skip or "rss" not in args.skip:
        with section("hourly_first"):
            # as after a deployment: the first job writes the driver's class archive (cdc_apply/class_archive.py)
            first_job = C.spark_submit_job(
                "bench", hourly_first_files.paths, workdir, master, "hourly_first", sample_rss=False, driver_memory=args.dag_driver_memory
            )
            say(f"hourly: the first DAG job (writes the driver's class archive) {first_job['seconds']:.1f}s")
    if "hourly" not in args.skip:
        with section("hourly"):
            bare = C.spark_submit_bare(workdir, master)
            job = C.spark_submit_job(
                "bench",
                hourly_files.paths,
                workdir,
                master,
                "hourly",
                sample_rss=reuse_rss and "rss" not in args.skip,
                driver_memory=args.dag_driver_memory,
            )
            jobs, bares = [job], [bare]
            for i, more in enumerate(hourly_more, 1):  # alternating, so a slow spell of the machine hits both
                bares.append(C.spark_submit_bare(workdir, master))
                jobs.append(
                    C.spark_submit_job(
                        "bench", more.paths, workdir, master, f"hourly_{i}", sample_rss=False, driver_memory=args.dag_driver_memory
                    )
                )
            he, hb = C.file_stats(hourly_files.paths)
            out["hourly"] = _vs_bare(
                _median_run(jobs, "seconds"),
                _median_run(bares, "seconds"),
                job_runs=[round(j["seconds"], 2) for j in jobs],
                bare_runs=[round(b["seconds"], 2) for b in bares],
                events=he,
                bytes=hb,
                target_rows=f"the bench table ({args.base_rows} base rows) after the main batch",
                master=master,
                first_batch_seconds=round(first_job["seconds"], 3) if first_job else None,
                class_archive=job["class_archive"],
                first_batch_class_archive=first_job["class_archive"] if first_job else None,
            )
            say(
                f"hourly: job {out['hourly']['job_seconds']:.1f}s vs bare spark-submit {out['hourly']['bare_seconds']:.1f}s"
                f" (medians of {len(jobs)}: jobs {out['hourly']['job_runs']}, bare {out['hourly']['bare_runs']})"
            )
    if "rss" not in args.skip:
        with section("rss"):
            runs_1x, runs_5x = [], []
            for i, (files_1x, files_5x) in enumerate(rss_batches):
                runs_1x.append(
                    job
                    if (reuse_rss and job is not None)
                    else C.spark_submit_job("bench", files_1x.paths, workdir, master, f"rss_1x_{i}", driver_memory=args.dag_driver_memory)
                )
                runs_5x.append(
                    C.spark_submit_job("bench", files_5x.paths, workdir, master, f"rss_5x_{i}", driver_memory=args.dag_driver_memory)
                )
            r1, r5 = _median_run(runs_1x, "peak_rss_bytes"), _median_run(runs_5x, "peak_rss_bytes")
            out["rss"] = {
                "events_1x": rss1.events,
                "events_5x": rss5.events,
                "runs": len(rss_batches),
                "peak_rss_1x_mb": round(r1["peak_rss_bytes"] / 2**20, 1),
                "peak_rss_5x_mb": round(r5["peak_rss_bytes"] / 2**20, 1),
                "ratio": round(r5["peak_rss_bytes"] / r1["peak_rss_bytes"], 3),
                "runs_1x_mb": [round(r["peak_rss_bytes"] / 2**20, 1) for r in runs_1x],
                "runs_5x_mb": [round(r["peak_rss_bytes"] / 2**20, 1) for r in runs_5x],
                "split_1x_mb": r1["at_peak_mb"],
                "split_5x_mb": r5["at_peak_mb"],
                "seconds_1x": round(r1["seconds"], 2),
                "seconds_5x": round(r5["seconds"], 2),
                "runs_1x_seconds": [round(r["seconds"], 2) for r in runs_1x],
                "runs_5x_seconds": [round(r["seconds"], 2) for r in runs_5x],
                "measured": "the DAG's spark-submit job, one process tree per batch (launcher + JVM driver + Python driver + "
                "Python workers), summed RSS sampled every 0.1 s; the median of the runs (the JVM's heap sizing "
                "moves one run's peak by +-15 %)" + ("; the 1x batch is the hourly batch" if reuse_rss else ""),
                "driver_memory": args.dag_driver_memory or "as the DAG (CDC_SPARK_DRIVER_MEMORY, default 3g)",
            }
            say(
                f"rss: {out['rss']['peak_rss_1x_mb']} MB (1x) vs {out['rss']['peak_rss_5x_mb']} MB (5x), median of {len(rss_batches)} run(s) each"
            )

    spark.stop()

    # -- the embedded default's DAG task: a client of the home's warm driver, started by the first ------
    if "hourly_warm" not in args.skip:
        with section("hourly_warm"):
            out["hourly_warm"] = _hourly_warm(settings, warm_batches, workdir, master)
            h = out["hourly_warm"]
            say(
                f"hourly on the warm driver: the batch that started it {h['first_batch_seconds']:.1f}s, next {h['job_seconds']:.1f}s "
                f"vs bare spark-submit {h['bare_seconds']:.1f}s (medians of {len(h['job_runs'])}: {h['job_runs']}, bare {h['bare_runs']})"
            )

    # -- the same hourly batch size through the DAG's Spark Connect path (a long-lived server) ------
    if "hourly_connect" not in args.skip:
        with section("hourly_connect"):
            with running_connect_server(workdir / "connect_server.log") as url:
                first, warms, bares = _client_runs(connect_batches[:-2], workdir, master, url, "connect")
                mor_sources = workdir / "sources_merge_on_read.yaml"
                mor_sources.write_text(C.sources_yaml(["bench"], merge_mode="merge-on-read"))
                switch = C.connect_job("bench", connect_batches[-2].paths, workdir, url, "connect_mor_switch", mor_sources)
                mor = C.connect_job("bench", connect_batches[-1].paths, workdir, url, "connect_mor", mor_sources)
            bare = _median_run(bares, "seconds")
            out["hourly_connect"] = _client_figure(
                first,
                warms,
                bares,
                connect_batches[1].events,
                "`cdc apply --files-from` as a Spark Connect client (what a DAG task runs in its "
                "process with a spark_connect connection, docker-compose's default): interpreter start, "
                "imports, the job; the median of the server's batches after its first (first_batch_seconds), "
                "each beside a bare spark-submit",
            )
            say(
                f"hourly via Spark Connect: first batch {first['seconds']:.1f}s, next {out['hourly_connect']['job_seconds']:.1f}s "
                f"vs bare spark-submit {bare['seconds']:.1f}s (medians of {len(warms)}: {out['hourly_connect']['job_runs']}, "
                f"bare {out['hourly_connect']['bare_runs']})"
            )
            out["hourly_connect_mor"] = _vs_bare(
                mor,
                bare,
                events=connect_batches[-1].events,
                switch_batch_seconds=round(switch["seconds"], 3),
                switch_batch_schema_changes=switch["schema_changes"],
                measured="as hourly_connect, after it on the same server and table, with the source's "
                "merge_mode: merge-on-read (sources.yaml); the batch that switched the table is "
                "switch_batch_seconds, the next one is timed",
            )
            say(f"hourly via Spark Connect, merge-on-read: switching batch {switch['seconds']:.1f}s, next {mor['seconds']:.1f}s")

    # -- figures -------------------------------------------------------------------------------
    ratios: dict[str, float] = {}
    pr = res["project"]["events_per_s"]
    if "textbook" in res:
        ratios["project_vs_textbook"] = round(pr / res["textbook"]["events_per_s"], 3)
    if "pyiceberg" in res:
        ratios["project_vs_pyiceberg"] = round(pr / res["pyiceberg"]["events_per_s"], 3)
    ratios["project_vs_limit"] = round(pr / res["orjson_limit"]["events_per_s"], 4)
    if "pyiceberg" in res:
        ratios["project_vs_python_pipeline"] = round(pr / res["pyiceberg"]["with_decode"]["events_per_s"], 3)
    if "pyiceberg" in res and "project_next" in res:
        ratios["project_next_vs_python_pipeline"] = round(
            res["project_next"]["events_per_s"] / res["pyiceberg"]["with_decode"]["events_per_s"], 3
        )
    if "pyiceberg" in res and "project_steady" in res:
        ratios["project_steady_vs_python_pipeline"] = round(
            res["project_steady"]["events_per_s"] / res["pyiceberg"]["with_decode"]["events_per_s"], 3
        )
    if "decode_stage" in out:
        ratios["decode_speedup"] = out["decode_stage"]["ratio"]
        fast_rate = main_events / out["decode_stage"]["fast_seconds"]
        ratios["decode_vs_payload_limit"] = round(fast_rate / res["payload_limit"]["events_per_s"], 3)
    prof = out.get("project_profile") or {}
    if "jobs" in prof:
        out["spark_jobs_per_batch"] = prof["jobs"]
    for name, key in (
        ("table_size_ratio", "table_size"),
        ("hourly_overhead_ratio", "hourly"),
        ("hourly_connect_ratio", "hourly_connect"),
        ("hourly_connect_mor_ratio", "hourly_connect_mor"),
        ("hourly_warm_ratio", "hourly_warm"),
        ("rss_ratio", "rss"),
        ("project_vs_textbook_warm", "warm_round"),
    ):
        if key in out:  # the figure's own record in the JSON carries its ratio
            ratios[name] = out[key]["ratio"]
    out["ratios"] = ratios
    spec = {
        "project_vs_textbook": args.events >= 1_000_000 and args.base_rows >= 1_000_000,
        "project_vs_textbook_warm": args.events >= 1_000_000 and args.base_rows >= 1_000_000,
        "project_vs_pyiceberg": True,
        "project_vs_limit": True,
        "table_size_ratio": args.scale_events >= 100_000 and args.scale_small_rows >= 1_000_000 and args.scale_large_rows >= 10_000_000,
        "hourly_overhead_ratio": args.hourly_events >= 1_000,
        "hourly_connect_ratio": args.hourly_events >= 1_000,
        "hourly_connect_mor_ratio": args.hourly_events >= 1_000,
        "hourly_warm_ratio": args.hourly_events >= 1_000,
        "rss_ratio": True,
        "decode_speedup": True,
        "decode_vs_payload_limit": True,
        "project_vs_python_pipeline": args.pyiceberg_cap >= 100_000 and args.base_rows >= 1_000_000,
        "project_next_vs_python_pipeline": args.pyiceberg_cap >= 100_000 and args.base_rows >= 1_000_000,
        "project_steady_vs_python_pipeline": args.pyiceberg_cap >= 100_000 and args.base_rows >= 1_000_000,
    }
    out["targets"] = [
        {
            "name": name,
            "value": ratios[name],
            "op": op,
            "threshold": thr,
            "status": _status(ratios[name], op, thr),
            "at_spec_size": spec[name],
            "meaning": meaning,
        }
        for name, op, thr, meaning in TARGETS
        if name in ratios
    ]
    section_of = {
        "project_vs_textbook": "textbook",
        "project_vs_textbook_warm": "warm_round",
        "project_vs_pyiceberg": "pyiceberg",
        "table_size_ratio": "table_size",
        "hourly_overhead_ratio": "hourly",
        "hourly_connect_ratio": "hourly_connect",
        "hourly_connect_mor_ratio": "hourly_connect",
        "hourly_warm_ratio": "hourly_warm",
        "rss_ratio": "rss",
        "decode_speedup": "decode",
        "decode_vs_payload_limit": "decode",
        "project_vs_python_pipeline": "pyiceberg",
        "project_next_vs_python_pipeline": "project_next",
        "project_steady_vs_python_pipeline": "project_next",
    }
    for name, op, thr, meaning in TARGETS:
        if name not in ratios and section_of.get(name) in errors:
            out["targets"].append(
                {
                    "name": name,
                    "value": None,
                    "op": op,
                    "threshold": thr,
                    "status": "ERROR",
                    "at_spec_size": spec[name],
                    "meaning": meaning,
                    "error": errors[section_of[name]][:300],
                }
            )
    out["total_seconds"] = round(time.perf_counter() - t_start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(render(out))
    print(f"figures written to {Path(args.out).resolve()}")
    return 0


def render(out: dict[str, Any]) -> str:
    m, res, prm = out["machine"], out["contenders"], out["params"]
    lines = [
        "",
        f"CDC apply benchmark — scale {out['scale']}, seed {prm['seed']}",
        f"machine: {m['cores']} cores, {m['memory_gb']} GB RAM, {m['platform']}",
        f"versions: Python {m['python']}, pyspark {m['pyspark']}, pyiceberg {m['pyiceberg']}, orjson {m['orjson']}, "
        f"Iceberg {m['iceberg_jar']}, {m['java']}, master {m['spark_master']}",
        f"batch: {prm['events']} Debezium PostgreSQL events (schema+payload) into a {prm['base_rows']}-row table",
        "",
        f"{'contender':34} {'events':>9} {'MB':>9} {'seconds':>9} {'events/s':>11} {'MB/s':>9}",
    ]
    names = {
        "project": "project run_batch (end to end)",
        "project_next": "  its next batch (same session)",
        "project_steady": "  later ones (median: steady state)",
        "textbook": "textbook Spark read.json+MERGE",
        "pyiceberg": "pyiceberg delete+upsert",
        "orjson_limit": f"orjson decode limit ({res['orjson_limit']['processes']} procs)",
        "payload_limit": f"payload-only limit ({res['orjson_limit']['processes']} procs)",
    }
    for k in ("project", "project_next", "project_steady", "textbook", "pyiceberg", "orjson_limit", "payload_limit"):
        if k in res:
            r = res[k]
            flag = " (timed out: upper bound)" if r.get("timed_out") else ""
            lines.append(
                f"{names[k]:34} {r['events']:>9} {r['mb']:>9.1f} {r['seconds']:>9.2f} {r['events_per_s']:>11.1f} {r['mb_per_s']:>9.2f}{flag}"
            )
            if k == "pyiceberg" and "with_decode" in r:
                w = r["with_decode"]
                lines.append(
                    f"{'  + its Python decode/compact (1 proc)':34} {w['events']:>9} {w['mb']:>9.1f} {w['seconds']:>9.2f} {w['events_per_s']:>11.1f} {w['mb_per_s']:>9.2f}"
                )
    if "decode_stage" in out:
        d = out["decode_stage"]
        lines.append(
            f"decode stage (decode_batch + persist, median of {d['runs']}): exact decoder {d['exact_seconds']:.2f}s, fast path {d['fast_seconds']:.2f}s"
        )
    if "warm_round" in out:
        w = out["warm_round"]
        lines.append(
            f"second runs of the session, same files, fresh tables: project {w['project_seconds']:.2f}s, textbook {w['textbook_seconds']:.2f}s"
        )
    if "spark_jobs_per_batch" in out:
        lines.append(f"Spark jobs per batch (the project's main batch): {out['spark_jobs_per_batch']}")
    if "table_size" in out:
        t = out["table_size"]
        lines.append(
            f"table size: {t['events']} events -> {t['small_rows']} rows {t['small_seconds']:.2f}s, {t['large_rows']} rows {t['large_seconds']:.2f}s"
        )
    if "hourly" in out:
        h = out["hourly"]
        first = (
            f" (the first job, which writes the driver's class archive: {h['first_batch_seconds']:.2f}s)"
            if h.get("first_batch_seconds")
            else ""
        )
        lines.append(
            f"hourly: {h['events']}-event batch via spark-submit {h['job_seconds']:.2f}s{first}, bare spark-submit {h['bare_seconds']:.2f}s"
        )
    if "hourly_connect" in out:
        h = out["hourly_connect"]
        lines.append(
            f"hourly via Spark Connect: {h['events']}-event batch {h['job_seconds']:.2f}s (the server's first batch "
            f"{h['first_batch_seconds']:.2f}s), bare spark-submit {h['bare_seconds']:.2f}s"
        )
    if "hourly_connect_mor" in out:
        h = out["hourly_connect_mor"]
        lines.append(
            f"hourly via Spark Connect, source merge_mode merge-on-read: {h['events']}-event batch {h['job_seconds']:.2f}s "
            f"(the batch that switched the table {h['switch_batch_seconds']:.2f}s)"
        )
    if "hourly_warm" in out:
        h = out["hourly_warm"]
        lines.append(
            f"hourly on the warm driver (the embedded default): {h['events']}-event batch {h['job_seconds']:.2f}s (the batch "
            f"that started it {h['first_batch_seconds']:.2f}s), bare spark-submit {h['bare_seconds']:.2f}s"
        )
    if "rss" in out:
        r = out["rss"]
        lines.append(
            f"peak RSS (process tree, median of {r['runs']}): {r['events_1x']} events {r['peak_rss_1x_mb']:.0f} MB {r['runs_1x_mb']}, "
            f"{r['events_5x']} events {r['peak_rss_5x_mb']:.0f} MB {r['runs_5x_mb']}"
        )
    lines += ["", f"{'figure':24} {'value':>9} {'target':>9} {'status':>6}  {'spec size':9}  meaning"]
    for t in out["targets"]:
        if t["value"] is None:
            lines.append(
                f"{t['name']:24} {'-':>9} {t['op'] + ' ' + str(t['threshold']):>9} {t['status']:>6}  {'yes' if t['at_spec_size'] else 'no':9}  {t['error']}"
            )
            continue
        lines.append(
            f"{t['name']:24} {t['value']:>9.3f} {t['op'] + ' ' + str(t['threshold']):>9} {t['status']:>6}  {'yes' if t['at_spec_size'] else 'no':9}  {t['meaning']}"
        )
    for n in out["notes"]:
        lines.append(f"note: {n}")
    prof = out.get("project_profile") or {}
    if prof.get("by_statement"):
        lines += [
            "",
            f"where the project's {res['project']['seconds']:.1f}s went: {prof['jobs']} Spark jobs, {prof['seconds_with_jobs_running']:.1f}s with a job "
            f"running, {prof.get('driver_only_seconds', 0):.1f}s driver only (Python, planning, commits, GX); "
            f"{prof.get('executor_run_seconds', 0):.1f} task seconds, {prof.get('executor_cpu_seconds', 0):.1f} of them the task threads' CPU; "
            "top statements by job time (job time, task seconds, task threads' CPU seconds: a job whose tasks waited for cores, or for Python workers, "
            "shows less CPU than task time):",
        ]
        for what, v in list(prof["by_statement"].items())[:12]:
            lines.append(
                f"  {v['seconds']:8.2f}s {v['executor_run_seconds']:7.1f} task-s {v.get('executor_cpu_seconds', 0):7.1f} cpu-s "
                f"{v['jobs']:>3} job(s)  {what[:100]}"
            )
    lines.append(f"total run time {out['total_seconds']}s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
