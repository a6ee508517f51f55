"""The embedded default's warm driver: one local Spark Connect server per
``$CDC_HOME``, started by the first job that needs it, shared by the jobs
running at once, and ending once no job has used it for
``CDC_WARM_DRIVER_IDLE_SECONDS`` (default 90 minutes: an hourly schedule
keeps it warm).

Why: a spark-submit job per Airflow task starts a JVM and warms it up over
the batch's ~15 Spark jobs, every hour: ~3x a bare spark-submit for a
1k-event batch, against ~2x as a client of a warm server
(bench/README.md, issue 20 step 35).

Jobs and servers agree through files under ``$CDC_HOME/warm-driver`` and
file locks only, so a job killed at any point leaves nothing to clean up:

- ``start.lock``, held briefly and exclusively: a job reads ``current`` (the
  port of the server new jobs attach to) and starts a server under it; a
  server's supervisor holds it while it decides to end.
- ``clients-<port>.lock``: every job attached to that server holds a shared
  lock on it until it ends (the kernel drops a killed job's lock).  The
  supervisor ends its server only once it takes this lock exclusively, under
  ``start.lock``, after taking the server out of ``current``: every job either
  attached before (and is waited for) or finds no server and starts one.
- ``server-<port>.json``: the supervisor's pid, the server's fingerprint
  (its command and environment) and log.  A job whose settings give another
  fingerprint starts a server of its own; the old one is no longer
  ``current`` and ends once its jobs have.

A server that ends under a job (it crashed, ran out of memory, or was
stopped with ``--now``) fails that job within seconds (``watch``), naming
the server's log, instead of leaving the Connect client to retry for the
ten minutes its default policy allows.

Only this user's jobs can use a server: it binds 127.0.0.1, and requires a
token made for it when it starts (Spark Connect's pre-shared key, passed
in the server's environment, not on its command line), which jobs read
from its record; the folder and records are the user's alone (0700/0600).
Without it, any local user could run code as this one through the server.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from cdc_apply.config import Settings
from cdc_apply.errors import SparkUnavailable

LOCAL = "local"
"""``CDC_SPARK_REMOTE=local``: attach to this home's warm driver (started on first use)."""
HOST = "127.0.0.1"
START_SECONDS = 180.0
"""how long a job waits for a new server to listen"""
KEEP_LOGS = 5
MODULE = "cdc_apply.runtime.warm_driver"
TOKEN_ENV = "SPARK_CONNECT_AUTHENTICATE_TOKEN"
"""the server's pre-shared key (Spark Connect reads it from its environment)"""
WATCH_SECONDS = 1.0
"""how often a job checks that its server still runs (``watch``)"""


@dataclass(frozen=True)
class Server:
    """One running server, as ``server-<port>.json`` records it."""

    port: int
    pid: int
    """the supervisor's (its server is its child)"""
    fingerprint: str
    started: float
    log: str
    token: str = ""
    """the pre-shared key jobs present (a secret: never printed)"""

    @property
    def url(self) -> str:
        """Where it listens, for messages (without the token)."""
        return f"sc://{HOST}:{self.port}"

    @property
    def client_url(self) -> str:
        """What a job connects to: with the token.  (PySpark sends a token
        without TLS only to the host named ``localhost``.)"""
        return f"sc://localhost:{self.port}/;token={self.token}" if self.token else self.url


_attached: dict[Path, tuple[int, Server]] = {}
"""this process's attachments: state folder -> (clients lock fd, server)"""
_lost: list[str] = []
"""what ended a server under this process's job (``lost``), at most one"""
_lost_lock = threading.Lock()


def state_dir(settings: Settings) -> Path:
    return settings.home / "warm-driver"


def fingerprint(command: list[str], env: dict[str, str]) -> str:
    """What makes two servers interchangeable: the command (port left out)
    and the environment its driver and Python workers read their settings from."""
    keep = {
        k: v
        for k, v in env.items()
        if k.startswith(("CDC_", "AWS_", "SPARK_", "PYSPARK_", "JAVA_"))
        and k not in ("CDC_SPARK_REMOTE", "CDC_WARM_DRIVER_IDLE_SECONDS", TOKEN_ENV)
    }
    text = json.dumps([command, sorted(keep.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _server_command(settings: Settings) -> tuple[list[str], dict[str, str]]:
    """The server's command with a ``{port}`` placeholder, and its environment:
    its driver's other ports (the Spark UI's, the RPC and block manager's)
    on 127.0.0.1 too, unless ``SPARK_LOCAL_IP`` says otherwise (a local
    master needs none of them reachable from other hosts)."""
    from cdc_apply.runtime.submit import connect_server_command, connect_server_env

    cmd = connect_server_command(settings, host=HOST, port=0)
    port_arg = "spark.connect.grpc.binding.port=0"
    env = {"SPARK_LOCAL_IP": HOST, **connect_server_env()}
    return [a if a != port_arg else "spark.connect.grpc.binding.port={port}" for a in cmd], env


@contextlib.contextmanager
def _locked(path: Path, mode: int = fcntl.LOCK_EX) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


def _write_json(path: Path, data: object) -> None:
    """Atomically, readable by this user only (a server's record holds its token)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        fh.write(json.dumps(data))
    os.replace(tmp, path)


def read_server(folder: Path, port: int) -> Server | None:
    try:
        return Server(**json.loads((folder / f"server-{port}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def current_server(folder: Path) -> Server | None:
    """The server new jobs attach to, if any."""
    try:
        port = int((folder / "current").read_text())
    except (OSError, ValueError):
        return None
    return read_server(folder, port)


def _record_ports(folder: Path) -> list[int]:
    """The ports of the servers with a record (``server-<port>.json``)."""
    return [int(p.stem.split("-", 1)[1]) for p in folder.glob("server-*.json")]


def servers(folder: Path) -> list[Server]:
    """Every server with a record: the current one and those still finishing their jobs."""
    found = (read_server(folder, port) for port in _record_ports(folder))
    return sorted((s for s in found if s is not None and _supervisor_alive(s.pid)), key=lambda s: s.started)


def _supervisor_alive(pid: int) -> bool:
    try:
        return MODULE in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _listening(port: int) -> bool:
    """Whether the server's port takes a connection (``session.check_listening``'s
    probe, as a bool: session imports this module, so this one cannot import it)."""
    try:
        with socket.create_connection((HOST, port), timeout=2):
            return True
    except OSError:
        return False


def attach(settings: Settings) -> str:
    """The URL of this home's warm driver, started if none with these settings
    runs; this process holds it (the server does not end) until ``detach()``
    or its exit."""
    folder = state_dir(settings)
    if folder in _attached:
        return _attached[folder][1].client_url
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)  # (a folder made before the records held tokens)
    command, env = _server_command(settings)
    fp = fingerprint(command, env)
    with _locked(folder / "start.lock"):
        server = current_server(folder)
        if server is None or server.fingerprint != fp or not _supervisor_alive(server.pid) or not _listening(server.port):
            server = _start(settings, folder, command, env, fp)
        fd = os.open(folder / f"clients-{server.port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
    _attached[folder] = (fd, server)
    return server.client_url


def detach() -> None:
    """Release this process's hold on its warm drivers (they end once idle)."""
    while _attached:
        _, (fd, _server) = _attached.popitem()
        os.close(fd)
    with _lost_lock:
        _lost.clear()  # (read by the job's error handling before it detaches)


def _gone(server: Server) -> str | None:
    """How an attached server is gone, or None while it serves."""
    if not _supervisor_alive(server.pid):
        return "its supervisor ended"
    if not _listening(server.port):
        return "it stopped listening"
    return None


def _log_tail(path: str | Path, chars: int = 3000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - chars))
            return fh.read().decode(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"


def watch(on_end: Callable[[str], None], interval: float = WATCH_SECONDS) -> Callable[[], None]:
    """Check the servers this process is attached to every ``interval``
    seconds, on a daemon thread; if one ends while attached, call
    ``on_end`` once with what happened (``lost()`` then says it too).
    Returns the function that stops the watch (before a job detaches)."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(interval):
            said = lost()
            if said is not None and not done.is_set():
                on_end(said)
                return

    threading.Thread(target=run, name="warm-driver-watch", daemon=True).start()
    return done.set


def lost() -> str | None:
    """What ended a warm driver under this process's job, if one did: checked
    now, so a job whose own call fails first (before the watch's next look)
    still learns that its server is gone, and the Connect client's retries
    stop (``session._while_served``)."""
    with _lost_lock:
        if not _lost:
            for _, server in list(_attached.values()):
                why = _gone(server)
                if why is not None:
                    _lost.append(
                        f"the warm driver {server.url} ended during this job ({why}): the job is failed, "
                        f"and a retry starts a new one; its log {server.log} ends:\n{_log_tail(server.log)}"
                    )
                    break
        return _lost[-1] if _lost else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _start(settings: Settings, folder: Path, command: list[str], env: dict[str, str], fp: str) -> Server:
    """Start a supervised server (under start.lock) and wait until it listens."""
    _tidy(folder)
    port = _free_port()
    log = folder / f"server-{port}-{int(time.time())}.log"
    argv = [sys.executable, "-m", MODULE, "--folder", str(folder), "--port", str(port)]
    argv += ["--idle-seconds", str(settings.warm_driver_idle_seconds), "--", *(a.replace("{port}", str(port)) for a in command)]
    token = secrets.token_urlsafe(32)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            env={**env, TOKEN_ENV: token},
            cwd=folder,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(port=port, pid=proc.pid, fingerprint=fp, started=time.time(), log=str(log), token=token)
    _write_json(folder / f"server-{port}.json", asdict(server))
    deadline = time.monotonic() + START_SECONDS
    while not _listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            raise SparkUnavailable(f"the warm driver (a local Spark Connect server) did not start; its log, {log}, ends:\n{_log_tail(log)}")
        time.sleep(0.3)
    (folder / "current").write_text(str(port))
    return server


def _tidy(folder: Path) -> None:
    """Remove the records of supervisors that died without cleaning up
    (killed), and all but the newest logs of servers that ended (a crash's
    log stays for the operator).  Under start.lock."""
    live = {f"server-{s.port}-" for s in servers(folder)}
    for port in _record_ports(folder):
        if f"server-{port}-" not in live:
            (folder / f"server-{port}.json").unlink(missing_ok=True)
            (folder / f"clients-{port}.lock").unlink(missing_ok=True)
    ended = [p for p in folder.glob("server-*.log") if not any(p.name.startswith(prefix) for prefix in live)]
    for p in sorted(ended, key=lambda p: p.stat().st_mtime)[:-KEEP_LOGS]:
        p.unlink(missing_ok=True)


def stop(settings: Settings, *, now: bool = False, timeout: float = 300.0) -> list[Server]:
    """Take the current server out of use and wait for every server to end:
    each finishes its running jobs first, unless ``now``.  Returns the
    servers still running at the timeout."""
    folder = state_dir(settings)
    if not folder.is_dir():
        return []
    with _locked(folder / "start.lock"):
        (folder / "current").unlink(missing_ok=True)
    running = servers(folder)
    if now:
        for s in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running and time.monotonic() < deadline:
        time.sleep(0.5)
        running = [s for s in running if _supervisor_alive(s.pid)]
    return running


def status(settings: Settings) -> list[dict[str, object]]:
    """Each running server: port, pid, since, whether new jobs attach to it, how many jobs hold it."""
    folder = state_dir(settings)
    if not folder.is_dir():
        return []
    current = current_server(folder)
    out = []
    for s in servers(folder):
        out.append(
            {
                "url": s.url,
                "supervisor_pid": s.pid,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(s.started)),
                "current": current is not None and current.port == s.port,
                "jobs_attached": _holders(folder / f"clients-{s.port}.lock"),
                "log": s.log,
            }
        )
    return out


def _holders(lock: Path) -> int:
    """How many processes hold a lock on the file: /proc/locks' granted
    locks (``->`` marks a waiting one) on its device and inode."""
    try:
        st = lock.stat()
        text = Path("/proc/locks").read_text()
    except OSError:
        return 0
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return sum(1 for line in text.splitlines() if "->" not in line and file_id in line.split()[5:6])


# -- the supervisor: ``python -m cdc_apply.runtime.warm_driver`` -----------------------------


def _die_with_parent() -> None:
    """The server gets SIGTERM when its supervisor dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def supervise(folder: Path, port: int, idle_seconds: float, command: list[str], interval: float | None = None) -> int:
    """Run the server until it exits, is asked to stop (SIGTERM), or
    ``_end_reason`` finds it unused; then end it and remove its records."""
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)  # one thread: preexec_fn is safe
    asked: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: asked.append("asked to stop"))
    interval = interval or min(5.0, max(0.5, idle_seconds / 10))
    last_used = time.monotonic()
    reason = "supervisor error"
    try:
        while not asked:
            try:
                reason = f"the server exited {server.wait(timeout=interval)}"
                break
            except subprocess.TimeoutExpired:
                pass
            verdict = _end_reason(folder, port, idle_seconds, time.monotonic() - last_used)
            if verdict == BUSY:
                last_used = time.monotonic()
            elif verdict:
                reason = verdict
                break
        else:
            reason = asked[0]
    finally:
        print(f"warm driver on port {port} ending: {reason}", file=sys.stderr, flush=True)
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        with _locked(folder / "start.lock"):
            if _ours(current_server(folder), port):
                (folder / "current").unlink(missing_ok=True)
            if _ours(read_server(folder, port), port):
                (folder / f"server-{port}.json").unlink(missing_ok=True)
                (folder / f"clients-{port}.lock").unlink(missing_ok=True)
    return 1 if reason.startswith("the server exited") else 0


BUSY = "busy"


def _ours(server: Server | None, port: int) -> bool:
    """Whether a record names this supervisor's server (a later server may reuse the port)."""
    return server is not None and server.port == port and server.pid == os.getpid()


def _end_reason(folder: Path, port: int, idle_seconds: float, idle_for: float) -> str | None:
    """Why the server ends now (it is then out of ``current``), ``BUSY`` while
    a job holds it, or None.  Under start.lock, so no job attaches meanwhile."""
    with _locked(folder / "start.lock"):
        is_current = _ours(current_server(folder), port)
        fd = os.open(folder / f"clients-{port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return BUSY
        finally:
            os.close(fd)
        if not is_current:
            return "no longer current (stopped, or a job with other settings started another)"
        if idle_for < idle_seconds:
            return None
        (folder / "current").unlink(missing_ok=True)
        return f"no job for {idle_seconds:g}s"


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="supervise one warm driver (started by attach())")
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--idle-seconds", type=float, required=True)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return supervise(args.folder, args.port, args.idle_seconds, command)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
