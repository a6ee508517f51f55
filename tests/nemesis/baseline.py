"""The clean run every trial is compared with: the seeded workload applied in
two batches by the CLI (batch A = hour 0, which creates the tables; batch B =
the later hours, MERGEd onto stored rows).  Saves the state after A (trials
of batch B start from it) and the expected state after B."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

from tests.nemesis import state as st
from tests.nemesis.runner import Folder, Run
from tests.nemesis.workload import SOURCE, T0, sources_yaml, write_workload

SPLIT = T0 + dt.timedelta(hours=1)


def apply_args(phase: str) -> list[str]:
    """The CLI's `cdc apply` of batch A, B, or "all" (every file as one batch)."""
    return ["apply", "--source", SOURCE] + (["--until", SPLIT.isoformat()] if phase == "A" else [])


def start_state(folder: Folder, phase: str) -> None:
    """The state a trial of ``phase`` starts from: empty, or after batch A."""
    if phase == "B":
        folder.restore("after_a")
    else:
        folder.fresh()


def phase_files(folder: Folder, phase: str):
    """The files of batch A or B as the DAG's discovery chooses them (for the
    staged path's manifest): the source's pending files in the folder's
    current state, up to the split for A.  Pending, not listed by hour: a
    file an earlier batch held (a torn transaction) belongs to the next batch."""
    from cdc_apply.archive.listing import list_files

    run = folder.run(["pending", "--source", SOURCE] + (["--until", SPLIT.isoformat()] if phase == "A" else []))
    if run.code != 0:
        raise RuntimeError(f"`cdc pending` failed:\n{run.tail()}")
    pending = {line.split()[-1] for line in run.out.splitlines() if line.strip()}
    return [f for f in list_files(folder.archive / SOURCE) if f.path in pending]


@dataclass
class Baseline:
    folder: Folder
    expected: dict
    phases: tuple[str, ...]
    seconds: dict[str, float]

    def check(self, *, batches: bool = True) -> list[str]:
        """The trial's final state against the clean run."""
        return st.differences(self.expected, st.read_state(str(self.folder.home), SOURCE), batches=batches)


def clean_run(folder: Folder, phase: str) -> Run:
    run = folder.run(apply_args(phase))
    if run.code != 0 or run.result.get("status") != "complete":
        raise RuntimeError(f"the clean run of batch {phase} failed:\n{run.tail()}")
    return run


def prepare(work: Path, seed: int, *, split: bool = True) -> Baseline:
    """Write the workload under ``work`` and apply it cleanly: batches A then
    B (two CLI runs), or with ``split=False`` one batch "all" (one run: CI)."""
    folder = Folder(work)
    work.mkdir(parents=True, exist_ok=True)
    write_workload(folder.archive / SOURCE, seed)
    folder.sources_file.write_text(sources_yaml())
    folder.fresh()
    phases = ("A", "B") if split else ("all",)
    seconds = {}
    for phase in phases:
        seconds[phase] = clean_run(folder, phase).seconds
        if phase == "A":
            folder.save("after_a")
    expected = st.read_state(str(folder.home), SOURCE)
    bad = st.invariants(expected)
    if bad:
        raise RuntimeError(f"the clean run breaks the invariants: {bad}")
    (work / "expected.json").write_text(json.dumps(expected, indent=1))
    return Baseline(folder, expected, phases, seconds)
