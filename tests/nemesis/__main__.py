"""The nemesis, long: ``python -m tests.nemesis --kinds kill,race --trials 60 --seed 1 --work /tmp/nemesis``.

Kinds: kill (SIGKILL at every stage boundary, then at seeded random
instants), race (two applies, apply vs maintain, apply vs skip), hostile
(mutated messages of all five formats), identifiers (hostile names, and the
quoting property), faults (files rewritten, deleted, re-delivered; folder
unreadable; catalog locked).  Prints one line per trial and the figures;
exit 1 when a trial failed."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

KINDS = ("kill", "race", "hostile", "identifiers", "faults")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.nemesis", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default: all)")
    p.add_argument("--trials", type=int, default=20, help="trials per kind for kill and race; rounds for hostile, identifiers and faults")
    p.add_argument("--seed", type=int, default=1, help="seeds the workload, the kill instants and the mutations")
    p.add_argument("--work", type=Path, default=Path("/tmp/nemesis"), help="work folder (archive, state folders, report.json)")
    p.add_argument("--mutations", type=int, default=2000, help="mutated messages per format per hostile round")
    p.add_argument("--instants-only", action="store_true", help="kill: random instants only, no stage boundaries")
    p.add_argument("--single-batch", action="store_true", help="one batch instead of two (faster, no trials on stored rows)")
    return p


def _subprocess_kinds(args, kinds: list[str], report) -> None:
    from tests.nemesis import kills, races
    from tests.nemesis.baseline import prepare

    rnd = random.Random(args.seed)
    base = prepare(args.work / "cli", args.seed, split=not args.single_batch)
    print(f"baseline: {base.seconds} s per clean run; {sum(len(v) for v in base.expected['tables'].values())} rows", flush=True)
    if "kill" in kinds:
        for spec in kills.plan(base, rnd, args.trials, instants_only=args.instants_only):
            report(kills.run_one(base, spec))
    if "race" in kinds:
        for i in range(args.trials):
            race = races.RACES[i % len(races.RACES)]
            report(races.race_trial(base, race, rnd.choice(base.phases), stagger=rnd.choice([0.0, 0.0, rnd.uniform(0, 20)])))


def _inprocess_kinds(args, kinds: list[str], report) -> None:
    import os

    from tests.nemesis.runner import ROOT

    os.environ["CDC_HOME"] = str(args.work / "inproc")
    os.environ.setdefault("CDC_JARS_DIR", str(ROOT / ".cdc" / "jars"))  # else CDC_HOME/jars, which a work folder lacks
    from cdc_apply.config import Settings
    from cdc_apply.runtime.session import get_spark

    settings = Settings.from_env()
    spark = get_spark(settings, app_name="cdc-nemesis")
    rnd = random.Random(args.seed)
    for i in range(args.trials):
        if "hostile" in kinds:
            from tests.nemesis import hostile

            report(hostile.hostile_trial(spark, settings, args.work / "hostile" / str(i), rnd.randrange(2**31), args.mutations))
        if "identifiers" in kinds:
            from tests.nemesis import identifiers

            report(identifiers.identifier_trial(spark, settings, args.work / "ident" / str(i), rnd.randrange(2**31)))
    if "faults" in kinds:
        from tests.nemesis import faults

        for trial in faults.all_faults(spark, settings, args.work / "faults"):
            report(trial)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown kinds {sorted(unknown)}; choose from {KINDS}")
    args.work.mkdir(parents=True, exist_ok=True)
    trials = []
    out = args.work / "report.jsonl"

    def report(trial) -> None:
        trials.append(trial)
        print(trial.line(), flush=True)
        with out.open("a") as fh:
            fh.write(json.dumps({**trial.__dict__, "passed": trial.passed}, default=str) + "\n")

    t0 = time.time()
    if {"kill", "race"} & set(kinds):
        _subprocess_kinds(args, kinds, report)
    if {"hostile", "identifiers", "faults"} & set(kinds):
        _inprocess_kinds(args, kinds, report)
    print(f"\n{len(trials)} trials in {time.time() - t0:.0f} s")
    for kind in KINDS:
        mine = [t for t in trials if t.kind == kind]
        if mine:
            figures: dict[str, int] = {}
            for t in mine:
                for k, v in t.figures.items():
                    if isinstance(v, int):
                        figures[k] = figures.get(k, 0) + v
            void = sum(t.passed and t.void for t in mine)
            print(f"{kind:<12} {len(mine)} run, {sum(t.passed and not t.void for t in mine)} passed, {void} void  {figures}")
    return 0 if all(t.passed for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
