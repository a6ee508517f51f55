"""A throw-away PostgreSQL 15 server (the Debian packages' initdb + pg_ctl)
in a temporary folder, with logical decoding on: what Debezium captures."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PG_BIN = Path(os.environ.get("CDC_PG_BIN", "/usr/lib/postgresql/15/bin"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One running server: ``dsn`` for psycopg, ``port`` for Debezium."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.data = folder / "data"
        self.user, self.password, self.database = "cdc", "cdc", "shop"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} password={self.password} dbname={self.database}"

    def _run(self, *args: str) -> None:
        proc = subprocess.run([*self._as_user(), *args], capture_output=True, text=True, env=self._env())
        if proc.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")

    def _env(self) -> dict[str, str]:
        return {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "TZ": "UTC"}

    def start(self) -> None:
        if not (PG_BIN / "initdb").exists():
            raise RuntimeError(f"no PostgreSQL at {PG_BIN} (apt-get install postgresql-15, or set CDC_PG_BIN)")
        pwfile = self.folder / "pw"
        pwfile.write_text(self.password)
        if os.geteuid() == 0:  # initdb refuses root: the server runs as the packages' postgres user
            import pwd

            owner = pwd.getpwnam(os.environ.get("CDC_PG_USER", "postgres"))
            for path in (self.folder, pwfile):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        self._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data),
            "-U",
            self.user,
            f"--pwfile={pwfile}",
            "-A",
            "md5",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        )
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.folder}'",
            "wal_level": "logical",
            "max_replication_slots": "4",
            "max_wal_senders": "4",
            "timezone": "'UTC'",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "64MB",
        }
        with (self.data / "postgresql.conf").open("a") as fh:
            fh.writelines(f"{k} = {v}\n" for k, v in conf.items())
        with (self.data / "pg_hba.conf").open("a") as fh:
            fh.write("host replication all 127.0.0.1/32 md5\n")
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "server.log"), "-w", "-t", "60", "start")
        import psycopg

        with psycopg.connect(self.dsn.replace(f"dbname={self.database}", "dbname=postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {self.database}")

    def _as_user(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        return ["runuser", "-u", os.environ.get("CDC_PG_USER", "postgres"), "--"]

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run(
                [*self._as_user(), str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                capture_output=True,
                env=self._env(),
            )


@contextmanager
def postgres() -> Iterator[PostgresServer]:
    """Start a server on a free 127.0.0.1 port; stop it and remove it at the end, even on failure."""
    folder = Path(tempfile.mkdtemp(prefix="cdc-pg-"))
    server = PostgresServer(folder, free_port())
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
