"""PySpark's worker daemon for the Spark Connect server, ending itself once
it has had no worker for a while.

Why: Spark 4.1 starts one daemon per Connect session (its worker factory is
keyed by the session's artifact id) and keeps it until the server stops
(SPARK-54055, fixed after 4.1). Every DAG task is a new session, so a server
taking hourly batches gained a ~60 MB daemon per batch (bench/README.md,
issue 20 step 15). A daemon whose workers are all gone has nothing to do: this
one then exits, and should its session run Python again, Spark starts a
daemon anew ("Assuming that daemon unexpectedly quit, attempting to restart").

``spark.python.daemon.module`` names this module (``submit.connect_server_command``);
Spark runs it as ``python -m cdc_apply.runtime.connect_daemon pyspark.worker``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

IDLE_SECONDS_ENV = "CDC_CONNECT_DAEMON_IDLE_SECONDS"
DEFAULT_IDLE_SECONDS = 120.0
PROC = Path("/proc")


def has_children(pid: int, proc: Path = PROC) -> bool:
    """Whether any process has ``pid`` as its parent (the daemon's forked workers)."""
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            return True
    return False


def watch(
    pid: int,
    idle_seconds: float,
    interval: float,
    busy: Callable[[int], bool] = has_children,
    now: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once ``pid`` has had no child for ``idle_seconds`` (checked every ``interval``)."""
    since = now()
    while True:
        sleep(interval)
        if busy(pid):
            since = now()
        elif now() - since >= idle_seconds:
            return


def _end_when_idle(idle_seconds: float) -> None:
    if not (PROC / "self").exists():  # no way to see the workers (not Linux): never end a daemon that may have some
        return
    pid = os.getpid()
    watch(pid, idle_seconds, interval=min(30.0, max(idle_seconds / 4, 0.5)))
    os.kill(pid, signal.SIGTERM)  # the daemon's own handler ends it and its process group


if __name__ == "__main__":
    idle = float(os.environ.get(IDLE_SECONDS_ENV) or DEFAULT_IDLE_SECONDS)
    threading.Thread(target=_end_when_idle, args=(idle,), name="cdc-daemon-idle", daemon=True).start()
    from pyspark import daemon

    daemon.manager()
