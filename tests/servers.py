"""Test servers started natively (no Docker): an S3-compatible object store
(s3proxy, in memory) and Apache Iceberg's REST catalog server (the
``RESTCatalogServer`` of Iceberg's REST test fixtures, S3FileIO on that store).

Both are Java programs fetched from Maven by coordinates on first use into
``$CDC_JARS_DIR/test-servers/`` (cached; Maven's local repository caches too),
bound to free ports, awaited until they answer on 127.0.0.1, and stopped (the
whole process group) when the ``with`` block ends, however it ends.

Credentials are made up per run and handed to the servers through their
environment only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ICEBERG_VERSION = "1.11.0"
JETTY_VERSION = "12.1.5"  # the jetty 12.1 line the 1.11 fixture is compiled against (ee10 + jetty-compression)
S3PROXY = "org.gaul:s3proxy:3.0.0:jar:jar-with-dependencies"
HOST = "127.0.0.1"

# S3-compatible servers that predate the AWS SDKs' default integrity checksums
# (SDK for Java 2.30+, for C++ as used by pyarrow) reject them: every client in
# the tests only computes checksums when the operation requires one.
SDK_CHECKSUM_ENV = {
    "AWS_REQUEST_CHECKSUM_CALCULATION": "WHEN_REQUIRED",
    "AWS_RESPONSE_CHECKSUM_VALIDATION": "WHEN_REQUIRED",
}

_REST_FIXTURE_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project>
  <modelVersion>4.0.0</modelVersion>
  <groupId>cdc.tests</groupId>
  <artifactId>iceberg-rest-fixture-classpath</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.iceberg</groupId><artifactId>iceberg-open-api</artifactId><version>{iceberg}</version><classifier>test-fixtures</classifier></dependency>
    <dependency><groupId>org.apache.iceberg</groupId><artifactId>iceberg-core</artifactId><version>{iceberg}</version></dependency>
    <dependency><groupId>org.apache.iceberg</groupId><artifactId>iceberg-core</artifactId><version>{iceberg}</version><classifier>tests</classifier></dependency>
    <dependency><groupId>org.apache.iceberg</groupId><artifactId>iceberg-aws</artifactId><version>{iceberg}</version></dependency>
    <dependency><groupId>org.apache.iceberg</groupId><artifactId>iceberg-aws-bundle</artifactId><version>{iceberg}</version></dependency>
    <dependency><groupId>org.eclipse.jetty.ee10</groupId><artifactId>jetty-ee10-servlet</artifactId><version>{jetty}</version></dependency>
    <dependency><groupId>org.eclipse.jetty.compression</groupId><artifactId>jetty-compression-server</artifactId><version>{jetty}</version></dependency>
    <dependency><groupId>org.eclipse.jetty.compression</groupId><artifactId>jetty-compression-gzip</artifactId><version>{jetty}</version></dependency>
    <dependency><groupId>org.xerial</groupId><artifactId>sqlite-jdbc</artifactId><version>3.50.3.0</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-simple</artifactId><version>2.0.17</version></dependency>
  </dependencies>
</project>
"""


class ServerError(RuntimeError):
    pass


def tools_missing() -> str | None:
    """Why the servers cannot be started here (None when they can)."""
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    return None


def jars_dir() -> Path:
    base = Path(os.environ.get("CDC_JARS_DIR") or ROOT / ".cdc" / "jars")
    path = base / "test-servers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _mvn(args: list[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(["mvn", "-q", "-B", *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise ServerError(f"mvn {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def s3proxy_jar() -> Path:
    _group, artifact, version, _type, classifier = S3PROXY.split(":")
    path = jars_dir() / f"{artifact}-{version}-{classifier}.jar"
    if not path.exists():
        _mvn(["dependency:copy", f"-Dartifact={S3PROXY}", f"-DoutputDirectory={path.parent}"])
    return path


def rest_fixture_classpath() -> list[Path]:
    """The REST fixture's runtime class path: Iceberg publishes only the fixture
    classes (``iceberg-open-api:<v>:test-fixtures``), so Maven resolves their
    dependencies from a generated POM; Hadoop's Configuration comes from
    pyspark's own hadoop-client jars."""
    folder = jars_dir() / f"iceberg-rest-fixture-{ICEBERG_VERSION}"
    stamp = folder / ".complete"
    if not stamp.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "pom.xml").write_text(_REST_FIXTURE_POM.format(iceberg=ICEBERG_VERSION, jetty=JETTY_VERSION))
            _mvn(["dependency:copy-dependencies", f"-DoutputDirectory={folder}"], cwd=Path(tmp))
        stamp.write_text("ok\n")
    from cdc_apply.config import pip_spark_home

    spark_jars = pip_spark_home() / "jars"
    hadoop = sorted(spark_jars.glob("hadoop-client-api-*.jar")) + sorted(spark_jars.glob("hadoop-client-runtime-*.jar"))
    if len(hadoop) < 2:
        raise ServerError(f"hadoop-client-api/runtime jars not found in {spark_jars}")
    return sorted(folder.glob("*.jar")) + hadoop


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    log: Path

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout)


@contextlib.contextmanager
def _java(name: str, args: list[str], env: dict[str, str], workdir: Path) -> Iterator[Process]:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["java", "-Xmx512m", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            start_new_session=True,
        )
    p = Process(name, proc, log)
    try:
        yield p
    finally:
        p.stop()


def _wait_http(p: Process, url: str, ok: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise ServerError(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status in ok:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code in ok:
                return
            last = exc
        except OSError as exc:
            last = exc
        time.sleep(0.25)
    raise ServerError(f"{p.name} did not answer {url} within {timeout:.0f}s ({last}):\n{p.tail()}")


def _java_env(extra: dict[str, str]) -> dict[str, str]:
    # The servers see no AWS_* or CATALOG_* variable of the caller: only ours.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CATALOG_", "CDC_", "JAVA_TOOL_OPTIONS"))}
    env.update(extra)
    return env


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    region: str
    process: Process
    client_env: dict[str, str] = field(default_factory=dict)
    """What a client of this store needs in its environment (credentials included)."""

    def filesystem(self):
        """pyarrow's S3 file system on this server (allowed to create buckets)."""
        from pyarrow import fs as pafs

        return pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=self.region,
            endpoint_override=self.endpoint.split("://", 1)[1],
            scheme="http",
            force_virtual_addressing=False,
            allow_bucket_creation=True,
        )

    def create_bucket(self, bucket: str) -> None:
        self.filesystem().create_dir(bucket)

    def upload_tree(self, local: Path, uri_prefix: str) -> list[str]:
        """Copy every file below ``local`` to ``s3[a]://bucket/prefix/...``; returns the URIs."""
        fs = self.filesystem()
        scheme, rest = uri_prefix.split("://", 1)
        rest = rest.strip("/")
        uris = []
        for path in sorted(p for p in Path(local).rglob("*") if p.is_file()):
            key = f"{rest}/{path.relative_to(local).as_posix()}"
            with fs.open_output_stream(key, compression=None) as out:
                out.write(path.read_bytes())
            uris.append(f"{scheme}://{key}")
        return uris


@contextlib.contextmanager
def s3_server(workdir: Path, *, timeout: float = 90) -> Iterator[S3Server]:
    """s3proxy on a free 127.0.0.1 port, in-memory storage, SigV2/V4 auth with
    fresh credentials."""
    # Apply the SDK checksum setting to this (test) process too: pyarrow's
    # bundled AWS SDK reads it when a file system is created.
    for key, value in SDK_CHECKSUM_ENV.items():
        os.environ.setdefault(key, value)
    jar = s3proxy_jar()
    port = free_port()
    endpoint = f"http://{HOST}:{port}"
    access_key, secret_key, region = f"cdc{secrets.token_hex(6)}", secrets.token_urlsafe(24), "us-east-1"
    conf = workdir / "s3proxy.properties"
    conf.write_text(
        "\n".join(
            [
                f"s3proxy.endpoint={endpoint}",
                "s3proxy.authorization=aws-v2-or-v4",
                f"s3proxy.identity={access_key}",
                f"s3proxy.credential={secret_key}",
                "s3proxy.ignore-unknown-headers=true",
                "jclouds.provider=transient-nio2",
                "jclouds.identity=unused",
                "jclouds.credential=unused",
                "",
            ]
        )
    )
    conf.chmod(0o600)
    env = _java_env({})
    with _java("s3proxy", ["-jar", str(jar), "--properties", str(conf)], env, workdir) as proc:
        # anonymous GET / answers 403 once the server is up
        _wait_http(proc, endpoint + "/", {200, 403}, timeout)
        client_env = {
            "CDC_S3_ENDPOINT": endpoint,
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_REGION": region,
            **SDK_CHECKSUM_ENV,
        }
        yield S3Server(endpoint, access_key, secret_key, region, proc, client_env)


@dataclass
class RestCatalog:
    uri: str
    warehouse: str
    process: Process


@contextlib.contextmanager
def rest_catalog(workdir: Path, s3: S3Server, warehouse: str, *, timeout: float = 90) -> Iterator[RestCatalog]:
    """Iceberg's REST catalog server (in-memory SQLite JDBC catalog behind it)
    with S3FileIO on ``s3``; configured by its CATALOG_* environment (see
    RCKUtils.environmentCatalogConfig: ``__`` -> '-', ``_`` -> '.')."""
    classpath = os.pathsep.join(str(p) for p in rest_fixture_classpath())
    port = free_port()
    env = _java_env(
        {
            "CATALOG_WAREHOUSE": warehouse,
            "CATALOG_URI": "jdbc:sqlite:file::memory:?cache=shared",
            "CATALOG_JDBC_USER": "user",
            "CATALOG_JDBC_PASSWORD": "password",
            "CATALOG_IO__IMPL": "org.apache.iceberg.aws.s3.S3FileIO",
            "CATALOG_S3_ENDPOINT": s3.endpoint,
            "CATALOG_S3_PATH__STYLE__ACCESS": "true",
            "CATALOG_CLIENT_REGION": s3.region,
            "CATALOG_REST_PORT": str(port),  # -> rest.port, read by RESTCatalogServer
            "REST_PORT": str(port),
            "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_REGION": s3.region,
            **SDK_CHECKSUM_ENV,
        }
    )
    with _java("iceberg-rest", ["-cp", classpath, "org.apache.iceberg.rest.RESTCatalogServer"], env, workdir) as proc:
        uri = f"http://{HOST}:{port}"
        _wait_http(proc, uri + "/v1/config", {200}, timeout)
        yield RestCatalog(uri, warehouse, proc)


if __name__ == "__main__":  # manual check: python tests/servers.py
    with tempfile.TemporaryDirectory() as tmp, s3_server(Path(tmp)) as s3:
        s3.create_bucket("lake")
        with rest_catalog(Path(tmp), s3, "s3://lake/warehouse") as rest:
            print("s3", s3.endpoint, "rest", rest.uri, file=sys.stderr)


@contextlib.contextmanager
def running_connect_server(
    log: Path, *, port: int | None = None, env: Mapping[str, str] | None = None, timeout: float = 180
) -> Iterator[str]:
    """``cdc connect-server`` on 127.0.0.1 (``port``, or a free one) with the
    settings of ``env`` (default: this process's) until the block ends; yields
    its sc:// URL once it listens.  The tests' and the benchmark's: a
    deployment runs the command as a service (docker-compose's spark-connect)."""
    from cdc_apply.runtime.session import check_listening

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    url = f"sc://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cdc_apply.cli", "connect-server", "--port", str(port)],
            env=dict(os.environ if env is None else env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"connect-server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
                try:
                    check_listening(url, timeout=1)
                    break
                except OSError:
                    if time.time() > deadline:
                        raise RuntimeError(f"connect-server never listened:\n{log.read_text()[-3000:]}") from None
                    time.sleep(0.5)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
