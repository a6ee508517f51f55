"""A/B of the write of a batch (issue 20, steps 1-2), in one Spark session.

Variants, each its own project table of ``--base-rows`` rows fed the same
batches (same files: the ledger is per table), applied in alternating order:

* ``cow_split`` / ``mor_split``: the write of this branch — keys new to the
  table appended, stored keys MERGEd (``merge.merge_changes`` with the
  labelling's counts);
* ``cow_merge`` / ``mor_merge``: the write before it, one MERGE of every key
  (the counts withheld);

``cow`` tables copy-on-write, ``mor`` merge-on-read (``write.merge.mode``,
``write.update.mode``, ``write.delete.mode``).  A suffix sets the Parquet
codec of the table and its change log (``CODECS``): ``cow_split_snappy``,
``cow_split_zstd1`` (zstd at level 1; Iceberg's default is zstd at
parquet-java's level 3).  Per batch: wall time of
``run_batch`` and the number of Spark jobs.  Targets are not judged here:
``bench.run`` is the benchmark; this isolates the write's choices::

    .venv/bin/python -m bench.ab_write --base-rows 1000000 --hourly 1000 --hourly-runs 3 --backfill 100000 --backfill-runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from bench import contenders as C
from bench import workload as wl

VARIANTS = ("cow_split", "cow_merge", "mor_split", "mor_merge")
MOR = ("write.merge.mode", "write.update.mode", "write.delete.mode")
CODECS = {
    "_snappy": {"write.parquet.compression-codec": "snappy"},
    "_zstd1": {"write.parquet.compression-codec": "zstd", "write.parquet.compression-level": "1"},
}


def _codec_props(variant: str) -> dict[str, str]:
    return next((props for suffix, props in CODECS.items() if variant.endswith(suffix)), {})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab_write", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-rows", type=int, default=1_000_000)
    p.add_argument("--hourly", type=int, default=1000)
    p.add_argument("--hourly-runs", type=int, default=3)
    p.add_argument("--backfill", type=int, default=100_000)
    p.add_argument("--backfill-runs", type=int, default=1)
    p.add_argument("--events-per-file", type=int, default=20_000)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    work = C.scratch_dir("cdc-ab-")
    C.prepare_home(work / "home", variants)
    from cdc_apply.apply import merge
    from cdc_apply.batch import run_batch
    from cdc_apply.config import Settings
    from cdc_apply.runtime.session import get_spark

    settings = Settings.from_env()
    real = merge.merge_changes

    def one_merge(*a: Any, **kw: Any) -> None:  # the write before issue 20's step 1
        kw.pop("new_keys", None), kw.pop("stored_keys", None)
        real(*a, **kw)

    wlh = wl.Workload(seed=7, base_rows=args.base_rows, insert_slot=1)
    seed = wl.write_seed(work / "data" / "seed")
    batches = [("hourly", wlh.write(work / "data" / f"h{i}", args.hourly, args.events_per_file)) for i in range(args.hourly_runs)]
    batches += [("backfill", wlh.write(work / "data" / f"b{i}", args.backfill, args.events_per_file)) for i in range(args.backfill_runs)]
    archived = [C.archive_files(f.paths) for _, f in batches]
    spark = get_spark(settings, app_name="cdc-ab")
    for v in variants:
        t = C.project_setup(spark, settings, v, seed, args.base_rows)
        if v.startswith("mor"):
            ident = C.project_table(settings, v)
            props = ", ".join(f"'{k}'='merge-on-read'" for k in MOR)
            spark.sql(f"ALTER TABLE {ident} SET TBLPROPERTIES ({props})")
        if _codec_props(v):
            ident = C.project_table(settings, v)
            props = ", ".join(f"'{k}'='{val}'" for k, val in _codec_props(v).items())
            for t_ident in (ident, ident + "_changes"):
                if spark.catalog.tableExists(t_ident):
                    spark.sql(f"ALTER TABLE {t_ident} SET TBLPROPERTIES ({props})")
        print(f"[ab] {v}: {args.base_rows} rows ({t:.1f}s)", flush=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for i, (kind, files) in enumerate(batches):
        order = variants if i % 2 == 0 else list(reversed(variants))
        for v in order:
            merge.merge_changes = one_merge if "_merge" in v else real  # type: ignore[assignment]
            group = f"ab:{v}:{i}"
            C._job_group(spark, group)
            t0 = time.perf_counter()
            try:
                res = run_batch(settings, v, archived[i], spark=spark)
            finally:
                merge.merge_changes = real  # type: ignore[assignment]
            seconds = time.perf_counter() - t0
            C._job_group(spark, "ab")
            if res.status != "complete":
                raise RuntimeError(f"{v}: {res.status} {res.message}")
            time.sleep(1.0)  # the UI's listener catches up
            prof = C.spark_jobs_profile(spark, group, seconds)
            load = os.getloadavg()[0]
            row = {
                "kind": kind,
                "events": files.events,
                "seconds": round(seconds, 2),
                "spark_jobs": prof.get("jobs"),
                "load": round(load, 1),
                "counts": res.tables[0].counts if res.tables else {},
                "by_statement": prof.get("by_statement"),
            }
            results.setdefault(f"{kind}:{v}", []).append(row)
            print(f"[ab] {kind} {files.events} events -> {v}: {seconds:.2f}s, {prof.get('jobs')} jobs, load {load:.1f}", flush=True)
    summary = C.ab_summary(results)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
