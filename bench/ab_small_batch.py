"""A/B of a small batch's fixed cost (issue 20, step 18), in one warm Spark session.

Variants, each its own project table of ``--base-rows`` rows fed the same
batches (same files: the ledger is per table), applied in alternating order:

* ``now``: the code as it is — a batch of at most ``SMALL_BATCH_MESSAGES``
  messages runs unadaptive on one shuffle partition
  (``runtime.spark_conf.small_batch_conf``), and the GX suites run for their
  verdict alone (``apply.gate.RESULT_FORMATS``);
* ``before``: both switched off (adaptive execution, the session's shuffle
  partitions, GX under ``SUMMARY``).

With ``--switch merge-broadcast`` (step 19) the variants are the MERGE's
broadcast threshold as the code raises it (``now``:
``runtime.spark_conf.MERGE_BROADCAST_BYTES``) and not raised (``before``).
With ``--switch merge-bloom`` (step 20): the MERGE's runtime Bloom filter
bounds (``runtime.spark_conf.MERGE_RUNTIME_FILTER_CONF``) or Spark's own.
With ``--switch reconcile-count`` (step 54): the reconciliation's live-row
count beside its key checks (``apply.table._write``), or before them.

Per batch: wall time of ``run_batch`` and the number of Spark jobs.  Targets
are not judged here: ``bench.run`` is the benchmark (its hourly figures are
this batch in a process of its own); this isolates the small batch's
choices::

    .venv/bin/python -m bench.ab_small_batch --base-rows 100000 --events 20 --runs 8
    .venv/bin/python -m bench.ab_small_batch --switch merge-broadcast --base-rows 1000000 --events 9000 --runs 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench import contenders as C
from bench import workload as wl

VARIANTS = ("now", "before")
SWITCHES = ("small-batch", "merge-broadcast", "merge-bloom", "reconcile-count")


class _Inline:
    """``runtime.background.Background`` run on the caller's thread, at once."""

    def __init__(self, _spark: Any, fn: Any, _name: str) -> None:
        self._value, self._error = None, None
        try:
            self._value = fn()
        except BaseException as exc:
            self._error = exc

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self) -> None:
        pass


def _switch(name: str, on: bool, now: dict[str, Any]) -> None:
    """The switched choices as the code has them (``now``) or off."""
    from cdc_apply.apply import gate
    from cdc_apply.runtime import spark_conf

    if name == "small-batch":
        spark_conf.SMALL_BATCH_MESSAGES = now["messages"] if on else 0
        gate.RESULT_FORMATS = now["formats"] if on else ("SUMMARY",)
    elif name == "reconcile-count":
        from cdc_apply.apply import table
        from cdc_apply.runtime.background import Background

        table.Background = Background if on else _Inline  # type: ignore[misc]
    elif name == "merge-broadcast":
        spark_conf.MERGE_BROADCAST_BYTES = now["broadcast"] if on else 0
    else:
        spark_conf.MERGE_RUNTIME_FILTER_CONF = now["bloom"] if on else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.ab_small_batch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-rows", type=int, default=100_000)
    p.add_argument("--events", type=int, default=20)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--out", default="")
    p.add_argument("--switch", choices=SWITCHES, default="small-batch", help="what the variants differ in")
    args = p.parse_args(argv)
    work = C.scratch_dir("cdc-ab-small-")
    C.prepare_home(work / "home", list(VARIANTS))
    from cdc_apply.apply import gate
    from cdc_apply.batch import run_batch
    from cdc_apply.config import Settings
    from cdc_apply.runtime import spark_conf
    from cdc_apply.runtime.session import get_spark

    settings = Settings.from_env()
    now = {
        "messages": spark_conf.SMALL_BATCH_MESSAGES,
        "formats": gate.RESULT_FORMATS,
        "broadcast": spark_conf.MERGE_BROADCAST_BYTES,
        "bloom": spark_conf.MERGE_RUNTIME_FILTER_CONF,
    }
    load = wl.Workload(seed=7, base_rows=args.base_rows, insert_slot=1)
    seed = wl.write_seed(work / "data" / "seed")
    # the first batch of each variant warms its table's path up and is not counted
    batches = [C.archive_files(load.write(work / "data" / f"b{i}", args.events, args.events).paths) for i in range(args.runs + 1)]
    spark = get_spark(settings, app_name="cdc-ab-small")
    for v in VARIANTS:
        print(f"[ab] {v}: {args.base_rows} rows ({C.project_setup(spark, settings, v, seed, args.base_rows):.1f}s)", flush=True)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for i, files in enumerate(batches):
        for v in VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS)):
            _switch(args.switch, v == "now", now)
            group = f"ab:{v}:{i}"
            C._job_group(spark, group)
            t0 = time.perf_counter()
            try:
                res = run_batch(settings, v, files, spark=spark)
            finally:
                _switch(args.switch, True, now)
            seconds = time.perf_counter() - t0
            C._job_group(spark, "ab")
            if res.status != "complete":
                raise RuntimeError(f"{v}: {res.status} {res.message}")
            time.sleep(1.0)  # the UI's listener catches up
            jobs = C.spark_jobs_profile(spark, group, seconds).get("jobs")
            phase = res.tables[0].seconds.get("reconcile") if res.tables else None
            print(f"[ab] batch {i} -> {v}: {seconds:.2f}s, {jobs} jobs, reconcile phase {phase}s", flush=True)
            if i:
                results[v].append({"seconds": round(seconds, 2), "spark_jobs": jobs, "reconcile_seconds": phase})
    summary = C.ab_summary(results)
    if args.out:
        Path(args.out).write_text(json.dumps({"params": vars(args), "summary": summary}, indent=1))
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
