"""Concurrency: two applies of one batch started together, an apply racing
`cdc maintain`, an apply racing an operator's `--override skip`.  Exactly one
takes effect per batch, a loser fails *transient* (exit 1) saying what
happened in words, a retry converges to the clean run's state (or, for skip,
to the batch skipped: tables as before it, its files marked applied)."""

from __future__ import annotations

import time

from tests.nemesis import state as st
from tests.nemesis.baseline import Baseline, apply_args, start_state
from tests.nemesis.kills import _later_phases, rerun_until_done
from tests.nemesis.runner import finish
from tests.nemesis.trial import Trial
from tests.nemesis.workload import SOURCE

CLEAR = (
    "another run is applying batch",
    "recorded skipped by an operator",
    "main moved since branch",
    "table maintenance is running",
    "does not exist",
)
RACES = ("two-applies", "apply-vs-maintain", "apply-vs-skip")


def _together(base: Baseline, commands: list[list[str]], stagger: float) -> list:
    procs, t0 = [], time.time()
    for i, args in enumerate(commands):
        if i:
            time.sleep(stagger)
        procs.append(base.folder.start(args))
    return [finish(p, t0) for p in procs]


def _judge(runs: list, trial: Trial) -> None:
    for run in runs:
        if run.code == 2 and "cannot be skipped" in run.err:  # the skip lost to a published apply: refused, as it must be
            continue
        if run.code == 2:
            trial.problems.append(f"a racer failed terminally (a retry must be allowed):\n{run.tail()}")
        elif run.code not in (0, 1):
            trial.problems.append(f"a racer died:\n{run.tail()}")
        elif run.code == 1:
            text = (
                (run.result.get("message") or "")
                + " "
                + " ".join(t.get("message") or "" for t in run.result.get("tables", []))
                + run.err[-2000:]
            )
            if not any(c in text for c in CLEAR):  # a raw Py4JJavaError / IllegalArgumentException alone is not a reason
                trial.problems.append(f"a loser failed without saying why in words:\n{run.tail()}")
    trial.figures["exit codes"] = sorted(r.code for r in runs)  # type: ignore[assignment]


def race_trial(base: Baseline, race: str, phase: str, stagger: float = 0.0) -> Trial:
    trial = Trial("race", f"{race} {phase} stagger {stagger:.1f}s")
    t0 = time.time()
    start_state(base.folder, phase)
    before = st.read_state(str(base.folder.home), SOURCE)["tables"]
    skip = [*apply_args(phase), "--override", "skip", "--override-reason", "nemesis race"]
    other = {"two-applies": apply_args(phase), "apply-vs-maintain": ["maintain", "--source", SOURCE], "apply-vs-skip": skip}[race]
    runs = _together(base, [apply_args(phase), other], stagger)
    _judge(runs, trial)
    if not rerun_until_done(base.folder, apply_args(phase), trial):
        trial.seconds = time.time() - t0
        return trial
    got = st.read_state(str(base.folder.home), SOURCE)
    skipped = [b for b in got["batches"] if b[1] == "skipped"]
    if race == "apply-vs-skip" and skipped:
        trial.notes.append("the skip won")
        trial.problems += st.invariants(got)
        applied = [b for b in got["batches"] if b[1] == "complete" and b[0] == skipped[0][0]]
        if applied:
            trial.problems.append(f"batch {skipped[0][0]} recorded both skipped and complete")
        if {t: r for t, r in got["tables"].items() if r} != {t: r for t, r in before.items() if r}:  # a skipped batch changes no row
            trial.problems.append(
                "the skip won, yet the tables changed: " + str([t for t in got["tables"] if got["tables"][t] != before.get(t)])
            )
    else:
        _later_phases(base, phase)
        trial.problems += base.check()
    trial.seconds = time.time() - t0
    return trial
