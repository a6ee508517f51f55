"""Real ``cdc`` CLI runs in subprocesses, each in its own process group (so a
SIGKILL takes its Spark JVM with it), on one state folder (CDC_HOME) at a
fixed path: a state saved with ``save`` and put back with ``restore`` keeps
the absolute paths the Iceberg metadata holds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRANSIENT, TERMINAL = 1, 2


@dataclass
class Run:
    code: int | None
    """exit code; None when killed (by the nemesis)"""
    out: str
    err: str
    seconds: float
    killed: bool = False

    @property
    def result(self) -> dict:
        try:
            return json.loads(self.out)
        except (json.JSONDecodeError, ValueError):
            return {}

    def tail(self) -> str:
        return f"exit {self.code} killed={self.killed} after {self.seconds:.1f}s\n{self.out[-1500:]}\n{self.err[-3000:]}"


@dataclass
class Folder:
    """A nemesis work folder: the archive, the sources file, the state folder."""

    work: Path
    source: str = "nem"
    env_extra: dict = field(default_factory=dict)

    @property
    def home(self) -> Path:
        return self.work / "home"

    @property
    def archive(self) -> Path:
        return self.work / "archive"

    @property
    def sources_file(self) -> Path:
        return self.work / "sources.yaml"

    def env(self) -> dict:
        return {
            **os.environ,
            "PYTHONPATH": f"{ROOT / 'spark_jobs'}:{ROOT}",
            "CDC_HOME": str(self.home),
            "CDC_ARCHIVE_DIR": str(self.archive),
            "CDC_SOURCES_FILE": str(self.sources_file),
            "CDC_JARS_DIR": os.environ.get("CDC_JARS_DIR", str(ROOT / ".cdc" / "jars")),
            "CDC_SPARK_MASTER": "local[1]",
            "CDC_SPARK_CONF_spark__ui__enabled": "false",
            **self.env_extra,
        }

    def fresh(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)
        self.home.mkdir(parents=True)

    def save(self, name: str) -> None:
        dest = self.work / f"saved_{name}"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(self.home, dest, symlinks=True)

    def restore(self, name: str) -> None:
        shutil.rmtree(self.home, ignore_errors=True)
        shutil.copytree(self.work / f"saved_{name}", self.home, symlinks=True)

    def start(self, args: list[str], point: str | None = None) -> subprocess.Popen:
        """Start ``cdc <args>`` (armed to kill itself at ``point``)."""
        cmd = (
            [sys.executable, "-m", "tests.nemesis.killpoint", point, "--", *args]
            if point
            else [sys.executable, "-m", "cdc_apply.cli", *args]
        )
        return subprocess.Popen(
            cmd, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )

    def run(self, args: list[str], point: str | None = None, kill_after: float | None = None, timeout: float = 900) -> Run:
        """One CLI run to its end, or SIGKILLed (its process group) ``kill_after`` seconds in."""
        t0 = time.time()
        proc = self.start(args, point)
        return finish(proc, t0, kill_after, timeout)


def finish(proc: subprocess.Popen, t0: float, kill_after: float | None = None, timeout: float = 900) -> Run:
    killed = False
    try:
        out, err = proc.communicate(timeout=kill_after if kill_after is not None else timeout)
    except subprocess.TimeoutExpired:
        killed = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
    if proc.returncode == -signal.SIGKILL:
        killed = True
    return Run(None if killed else proc.returncode, out, err, time.time() - t0, killed)


def reap(proc: subprocess.Popen) -> None:
    """Kill what is left of a process group this module started (JVM children of a killed driver)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
