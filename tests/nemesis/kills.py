"""kill -9 of `cdc apply` (the CLI, and the DAG's staged path: write, validate,
publish, finish as separate processes) at every stage boundary and at
seeded random instants; then run again until success (the staged path: each
killed task retried as Airflow does) and compare with the clean run.  A rerun
that fails terminally or keeps failing is a defect: it would page a person."""

from __future__ import annotations

import random
import shutil
import time

from tests.nemesis.baseline import Baseline, apply_args, clean_run, phase_files, start_state
from tests.nemesis.killpoint import STAGE_POINTS
from tests.nemesis.runner import Folder, Run
from tests.nemesis.trial import Trial
from tests.nemesis.workload import SOURCE

RERUNS = 4  # the reruns a trial gets before "fails for ever"
DONE = ("complete", "nothing-to-do")


def _later_phases(base: Baseline, phase: str) -> None:
    for later in base.phases[base.phases.index(phase) + 1 :]:
        clean_run(base.folder, later)


def _landed(run: Run, trial: Trial) -> None:
    trial.notes.append("killed" if run.killed else f"ended before the kill (exit {run.code})")
    trial.figures["killed"] = int(run.killed)
    if not run.killed and run.code not in (0, None):  # the armed run broke on its own: the trial tests nothing
        trial.problems.append(f"the armed run failed before its kill point:\n{run.tail()}")


def rerun_until_done(folder: Folder, args: list[str], trial: Trial, reruns: int = RERUNS) -> bool:
    """Run ``args`` until it succeeds; a terminal exit, or no success in ``reruns``, is a problem."""
    for attempt in range(1, reruns + 1):
        run = folder.run(args)
        if run.code == 0 and run.result.get("status") in DONE:
            trial.figures["reruns"] = attempt
            return True
        if run.code == 2:
            trial.problems.append(f"rerun {attempt} failed terminally after the kill:\n{run.tail()}")
            return False
    trial.problems.append(f"no rerun of {reruns} succeeded (a person would be paged):\n{run.tail()}")
    return False


def cli_trial(base: Baseline, phase: str, point: str | None = None, delay: float | None = None) -> Trial:
    """Kill `cdc apply` of batch ``phase`` at ``point`` or ``delay`` seconds in; rerun; compare."""
    trial = Trial("kill", f"cli {phase} " + (f"at {point}" if point else f"at {delay:.1f}s"))
    t0 = time.time()
    start_state(base.folder, phase)
    _landed(base.folder.run(apply_args(phase), point=point, kill_after=delay), trial)
    if rerun_until_done(base.folder, apply_args(phase), trial):
        _later_phases(base, phase)
        trial.problems += base.check()
    trial.seconds = time.time() - t0
    return trial


def _stage_args(base: Baseline, stage: str, result_file: str, manifest: str, table: str | None) -> list[str]:
    if stage == "write":
        return ["apply", "--stage", "write", "--source", SOURCE, "--files-from", manifest, "--result-file", result_file]
    return ["apply", "--stage", stage, "--result-file", result_file] + (["--table", table] if table else [])


def _task(base: Baseline, trial: Trial, stage: str, args: list[str], armed: dict, retries: int = 3) -> bool:
    """One DAG task with Airflow's retries; the first attempt of the target stage is armed."""
    for _ in range(retries + 2 - 1):
        point = delay = None
        if armed.get("stage") == stage and not armed.get("fired"):
            point, delay, armed["fired"] = armed.get("point"), armed.get("delay"), True
        run = base.folder.run(args, point=point, kill_after=delay)
        if point or delay is not None:
            _landed(run, trial)
            continue
        if run.code == 0 and (stage != "finish" or run.result.get("status") == "complete"):
            return True
        if run.code == 2:
            trial.problems.append(f"{stage} failed terminally (no retry helps):\n{run.tail()}")
            return False
    trial.problems.append(f"{stage} failed {retries + 1} times (the task fails; a person is paged):\n{run.tail()}")
    return False


def staged_trial(
    base: Baseline, phase: str, stage: str, point: str | None = None, delay: float | None = None, per_table: bool = True
) -> Trial:
    """The DAG's path, one process per task, with the ``stage`` task killed
    once at ``point`` or after ``delay`` s and retried; then compare."""
    from cdc_apply.archive.files import write_manifest
    from cdc_apply.results import load_result

    trial = Trial("kill", f"staged {phase} {stage} " + (f"at {point}" if point else f"at {delay:.1f}s"))
    t0 = time.time()
    start_state(base.folder, phase)
    run_dir = base.folder.work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    manifest = str(write_manifest(run_dir / "files.json", phase_files(base.folder, phase)))
    result_file = str(run_dir / "result.json")
    armed = {"stage": stage, "point": point, "delay": delay}
    ok = _task(base, trial, "write", _stage_args(base, "write", result_file, manifest, None), armed)
    if ok:
        written = [t.table for t in load_result(result_file).tables if t.status == "written"]
        for table in written if per_table else [None]:
            ok = ok and _task(base, trial, "validate", _stage_args(base, "validate", result_file, manifest, table), armed)
            ok = ok and _task(base, trial, "publish", _stage_args(base, "publish", result_file, manifest, table), armed)
        ok = ok and _task(base, trial, "finish", _stage_args(base, "finish", result_file, manifest, None), armed)
    if ok:
        _later_phases(base, phase)
        trial.problems += base.check()
    trial.seconds = time.time() - t0
    return trial


def plan(base: Baseline, rnd: random.Random, trials: int, instants_only: bool = False) -> list[tuple]:
    """Every boundary of every stage first (CLI and staged), then random
    instants; ``instants_only``: random instants alone (a run after the
    boundaries were covered)."""
    out: list[tuple] = []
    for phase in base.phases:
        out += [("cli", phase, "all", p, None) for p in STAGE_POINTS["all"]]
        out += [("staged", phase, stage, p, None) for stage in ("write", "validate", "publish", "finish") for p in STAGE_POINTS[stage]]
    rnd.shuffle(out)
    boundaries = [] if instants_only else out[: max(trials - trials // 3, trials - len(out)) if trials < 2 * len(out) else len(out)]
    instants = []
    for _ in range(max(0, trials - len(boundaries))):
        phase = rnd.choice(base.phases)
        if rnd.random() < 0.5:
            instants.append(("cli", phase, "all", None, rnd.uniform(0.05, 0.95) * base.seconds[phase]))
        else:
            stage = rnd.choice(("write", "validate", "publish", "finish"))
            # publish and finish (pyiceberg, no JVM) end within ~1.5-2 s of their start here: a later instant never lands
            span = base.seconds[phase] * 0.8 if stage == "write" else 40.0 if stage == "validate" else 2.0
            instants.append(("staged", phase, stage, None, rnd.uniform(0.5, span)))
    return boundaries + instants


def run_one(base: Baseline, spec: tuple) -> Trial:
    path, phase, stage, point, delay = spec
    if path == "cli":
        return cli_trial(base, phase, point, delay)
    return staged_trial(base, phase, stage, point, delay)
