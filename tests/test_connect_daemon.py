"""The Spark Connect server's Python daemon ends once it has had no worker
for the idle time (cdc_apply/runtime/connect_daemon.py); on a real server:
tests/test_spark_connect.py."""

from __future__ import annotations

from cdc_apply.runtime.connect_daemon import has_children, watch


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_the_idle_time_counts_from_the_last_check_that_saw_a_worker():
    clock = Clock()
    seen = iter([True, True, False, True] + [False] * 100)
    watch(7, idle_seconds=10, interval=1, busy=lambda pid: next(seen), now=clock.now, sleep=clock.sleep)
    assert clock.t == 14  # a worker at t=1, 2 and 4; then none from t=5: ends at 4 + 10


def test_children_are_found_by_the_parent_in_proc_stat_whatever_the_command_name(tmp_path):
    def process(pid: int, name: str, ppid: int) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194560\n")

    process(10, "python3", 1)
    process(11, "evil) R 10 (x", 1)  # a name holding ") R 10": the parent is read after the last ')'
    (tmp_path / "self").mkdir()  # not a process
    assert not has_children(10, proc=tmp_path)
    process(12, "python3", 10)
    assert has_children(10, proc=tmp_path)


def test_the_servers_executors_get_its_idle_time(monkeypatch):
    """On a cluster the executors run the daemon too: the server's command
    hands them the operator's idle time (Spark gives executors only the
    spark.executorEnv.* variables)."""
    from cdc_apply.config import Settings
    from cdc_apply.runtime.submit import connect_server_command

    monkeypatch.setenv("CDC_CONNECT_DAEMON_IDLE_SECONDS", "7")
    assert "spark.executorEnv.CDC_CONNECT_DAEMON_IDLE_SECONDS=7" in connect_server_command(Settings.from_env())
    monkeypatch.delenv("CDC_CONNECT_DAEMON_IDLE_SECONDS")
    assert not [a for a in connect_server_command(Settings.from_env()) if "CDC_CONNECT_DAEMON_IDLE_SECONDS" in a]
