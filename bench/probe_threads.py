"""Where a batch's CPU goes, by thread (issue 20, step 30), in one warm Spark session.

The Spark UI's task times count only the task threads, and a task waiting for
a core counts as running.  This probe applies ``--runs`` batches of the
bench's workload (``--events`` each) to a project table of ``--base-rows``
rows and prints, per batch: its wall time and Spark jobs; per phase its job
time, task seconds and the task threads' CPU seconds (``spark_jobs_profile``);
the CPU seconds of every thread of the process tree (this driver, the JVM,
its Python workers) by group, read from ``/proc`` before and after the batch;
and how many classes Spark generated and compiled so far (its
``CodeGenerator`` counters), which the JIT compiles again::

    .venv/bin/python -m bench.probe_threads --base-rows 1000000 --events 300000 --runs 2

Linux only (``/proc/<pid>/task/<tid>/comm`` names the threads).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil

from bench import contenders as C
from bench import workload as wl

JVM_THREAD_GROUPS = (
    ("Executor task", "JVM task threads"),
    ("C1 Compiler", "JIT compiler threads"),
    ("C2 Compiler", "JIT compiler threads"),
    ("GC Thread", "GC threads"),
    ("G1 ", "GC threads"),
    ("VM Thread", "GC threads"),
)


def _thread_group(process_kind: str, comm: str) -> str:
    if process_kind != "jvm":
        return process_kind
    return next((group for prefix, group in JVM_THREAD_GROUPS if comm.startswith(prefix)), "other JVM threads")


def cpu_by_thread_group() -> Counter[str]:
    """Cumulative CPU seconds (user + system) of this process tree's threads, by group."""
    me = psutil.Process()
    out: Counter[str] = Counter()
    for proc in [me, *me.children(recursive=True)]:
        try:
            kind = "the Python driver" if proc.pid == me.pid else "jvm" if "java" in proc.name() else "Python workers"
            for t in proc.threads():
                try:
                    comm = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
                except OSError:  # the thread ended meanwhile
                    continue
                out[_thread_group(kind, comm)] += t.user_time + t.system_time
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def codegen_counters(spark) -> dict[str, int]:
    """Spark's ``CodeGenerator`` histograms' counts (classes compiled so far) from the driver's metrics servlet."""
    with urllib.request.urlopen(spark.sparkContext.uiWebUrl + "/metrics/json/", timeout=30) as r:
        histograms = json.loads(r.read()).get("histograms", {})
    return {k.split("CodeGenerator.")[-1]: v.get("count", 0) for k, v in histograms.items() if "CodeGenerator." in k}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-rows", type=int, default=1_000_000)
    p.add_argument("--events", type=int, default=300_000)
    p.add_argument("--events-per-file", type=int, default=20_000)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    from cdc_apply.batch import run_batch
    from cdc_apply.config import Settings
    from cdc_apply.runtime.session import get_spark

    work = C.scratch_dir("cdc-probe-threads-")
    C.prepare_home(work / "home", ["p"])
    settings = Settings.from_env()
    load = wl.Workload(seed=7, base_rows=args.base_rows, insert_slot=1)
    seed = wl.write_seed(work / "data" / "seed")
    batches = [C.archive_files(load.write(work / "data" / f"b{i}", args.events, args.events_per_file).paths) for i in range(args.runs)]
    spark = get_spark(settings, app_name="cdc-probe-threads")
    print(f"[probe] table of {args.base_rows} rows: {C.project_setup(spark, settings, 'p', seed, args.base_rows):.1f}s", flush=True)
    for i, files in enumerate(batches):
        group = f"probe:{i}"
        C._job_group(spark, group)
        before, t0 = cpu_by_thread_group(), time.perf_counter()
        res = run_batch(settings, "p", files, spark=spark)
        seconds, cpu = time.perf_counter() - t0, cpu_by_thread_group()
        C._job_group(spark, "probe")
        if res.status != "complete":
            raise RuntimeError(f"batch {i}: {res.status} {res.message}")
        time.sleep(2)  # the UI's listener catches up with the last jobs
        prof = C.spark_jobs_profile(spark, group, seconds)
        print(
            f"[probe] batch {i}: {seconds:.2f}s, {prof['jobs']} jobs, {prof['executor_run_seconds']:.1f} task-s, "
            f"{prof['executor_cpu_seconds']:.1f} task CPU-s",
            flush=True,
        )
        for what, v in list(prof["by_statement"].items())[:10]:
            print(f"    {v['seconds']:6.1f}s {v['executor_run_seconds']:6.1f} task-s {v['executor_cpu_seconds']:6.1f} CPU-s  {what[:80]}")
        used = {k: round(cpu[k] - before.get(k, 0.0), 1) for k in cpu}
        print(f"    CPU seconds by thread: {dict(sorted(used.items(), key=lambda kv: -kv[1]))}, in all {sum(used.values()):.1f}")
        print(f"    Spark's generated classes so far: {codegen_counters(spark)}", flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
