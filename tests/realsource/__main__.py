"""The real-source soak from the command line::

    python -m tests.realsource --seeds 10 --scale 4 [--hours 4] [--first-seed 1] [--work DIR] [--state-read "key spans"]

Per seed: a real PostgreSQL workload captured by real Debezium, applied hour
by hour (in order) and with one hour delivered late; prints seeds, events,
rows compared, mismatches (classified, with examples) and minutes.  Exit
status 1 when any row differs from the source or any line is unaccounted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.realsource", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=int(os.environ.get("CDC_CONFORMANCE_SEEDS", "3")))
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--scale", type=float, default=float(os.environ.get("CDC_CONFORMANCE_SCALE", "1")))
    p.add_argument("--hours", type=int, default=int(os.environ.get("CDC_CONFORMANCE_HOURS", "4")))
    p.add_argument("--ops", type=int, default=45, help="statements per hour at scale 1")
    p.add_argument("--work", type=Path, help="folder for captures and CDC_HOME (default: a new temporary folder)")
    p.add_argument(
        "--state-read",
        choices=["whole", "key spans"],
        default="whole",
        help="how every batch's labelling reads the stored state: whole (as these small tables are read), "
        "or by the batch's key spans, as a small batch into a large table does (tests.apply_harness.state_read)",
    )
    args = p.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="cdc-realsource-"))
    root = Path(__file__).resolve().parents[2]
    os.environ["CDC_HOME"] = str(work / "cdc_home")
    os.environ.setdefault("CDC_JARS_DIR", str(root / ".cdc" / "jars"))
    os.environ.setdefault("CDC_SPARK_MASTER", "local[2]")
    from cdc_apply.config import Settings
    from cdc_apply.runtime.session import get_spark
    from tests.apply_harness import state_read
    from tests.realsource.conformance import (
        apply_in_order,
        apply_late_hour,
        capture_seed,
        mismatch_classes,
        rebuild_differences,
        report,
    )

    settings = Settings.from_env()
    spark = get_spark(settings, app_name="cdc-realsource")
    started = time.monotonic()
    totals = {"events": 0, "rows": 0, "mismatches": 0}
    all_mismatches, failed, all_classes = [], False, {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        t0 = time.monotonic()
        cap = capture_seed(
            seed, work / f"seed{seed}", hours=args.hours, ops=int(args.ops * args.scale), snapshot_rows=int(args.ops / 3 * args.scale)
        )
        with state_read(args.state_read):
            results = [
                apply_in_order(spark, settings, cap, f"rs_inorder_{seed}", work),
                apply_late_hour(spark, settings, cap, f"rs_late_{seed}", work, late=seed % (len(cap.hours) - 1)),
            ]
        results[0].problems += rebuild_differences(spark, settings, f"rs_inorder_{seed}", work)
        for res in results:
            classes = mismatch_classes(res, cap)
            for kind, ms in classes.items():
                all_classes.setdefault(kind, []).extend(ms)
            print(report(res, cap, classes), flush=True)
            totals["rows"] += res.rows_compared
            totals["mismatches"] += len(res.mismatches)
            all_mismatches += res.mismatches
            failed |= not res.ok
        totals["events"] += cap.lines
        print(
            f"seed {seed}: {cap.lines} events ({cap.ops}) in {cap.files} files from {cap.statements} statements; "
            f"capture {cap.seconds:.0f} s, seed {(time.monotonic() - t0) / 60:.1f} min",
            flush=True,
        )
    print(
        f"\n{args.seeds} seed(s), {totals['events']} events, {totals['rows']} rows compared, "
        f"{totals['mismatches']} mismatches, {(time.monotonic() - started) / 60:.1f} min"
    )
    for kind, ms in sorted(all_classes.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(ms):5d}  {kind}   e.g. {ms[0]}")
    spark.stop()
    put_away(work, owned=args.work is None, failed=failed)
    return 1 if failed else 0


def put_away(work: Path, *, owned: bool, failed: bool) -> None:
    """A folder the soak made itself (no ``--work``) holds ~0.5 GB of captures
    and tables a seed: removed after a clean run, kept for a look when a row
    differed (its path printed).  A ``--work`` folder is the caller's: kept."""
    if owned and not failed:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work folder kept: {work}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
