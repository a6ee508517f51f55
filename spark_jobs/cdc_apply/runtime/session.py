"""Build a SparkSession wired to the Iceberg catalog described by Settings."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pyspark.sql import DataFrame, Observation, SparkSession

from cdc_apply.config import Settings
from cdc_apply.runtime import warm_driver
from cdc_apply.runtime.code_zip import build_code_zip
from cdc_apply.runtime.spark_conf import iceberg_conf, jar_paths, session_conf

if TYPE_CHECKING:
    from pyspark.sql.connect.client.retries import RetryPolicy

_one_command = False
_unwatch: list[Callable[[], None]] = []
"""stops the watch on this process's warm driver (``remote_session``)"""
log = logging.getLogger(__name__)
WHILE_SERVED_SECONDS = 600
"""how long a warm driver's job retries a refused call while its server still runs (the client's default)"""


def one_command_process() -> None:
    """Say that this process runs one command and exits (the ``cdc`` CLI, the
    demo): a driver JVM it starts lives for one batch, as a spark-submit job's
    does, and gets the same C1-only JIT (``spark_conf.DRIVER_JAVA_OPTIONS``).
    A one-shot ``cdc apply`` of the demo archive: 37.6 -> 30.4 s (bench/README,
    step 29).  Not for a process that keeps its session for many batches
    (tests, the bench): there the C2 compiler pays off (two apply test files
    took 231 s with C1 only against 180 s)."""
    global _one_command
    _one_command = True


def get_spark(settings: Settings, app_name: str = "cdc-apply", *, pool: str | None = None) -> SparkSession:
    """The active session if there is one (spark-submit, tests), else a new
    one: on the Spark Connect server of ``CDC_SPARK_REMOTE`` (its jobs in
    the server's scheduler ``pool``, by default one named ``app_name``), or
    a driver of our own."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if settings.spark_remote:
        return remote_session(settings, pool=pool or app_name)
    # Python workers must run the same interpreter (and packages) as the driver.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if settings.sqlite_path is not None:
        settings.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
    builder = SparkSession.builder
    own_driver = "PYSPARK_GATEWAY_PORT" not in os.environ
    if own_driver:
        builder = builder.appName(app_name)
        # Not under spark-submit: we own master and jars. Under spark-submit the
        # submitter (Airflow's connection, --jars, --conf) decides them.
        builder = builder.master(settings.spark_master)
        builder = builder.config("spark.jars", ",".join(str(p) for p in jar_paths(settings)))
    for key, value in session_conf(settings, own_short_lived_driver=own_driver and _one_command).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def remote_session(settings: Settings, *, pool: str | None = None) -> SparkSession:
    """A session on the Spark Connect server at ``settings.spark_remote``,
    with this version of the cdc_apply package added for its Python workers.

    ``pool``: the fair-scheduler pool its jobs run in (Spark copies a
    session's ``spark.*`` conf onto the jobs it starts).  The server shares
    its cores fairly between pools (``submit.connect_server_command``); the
    DAG gives each source its own, so one source's backfill does not queue
    the others' hourly batches behind its stages.

    The server owns the catalog conf (``cdc connect-server`` starts it from
    the same settings); a server wired to another catalog or warehouse than
    this job's pyiceberg side is refused before anything is written."""
    from cdc_apply.errors import ConfigError, SparkUnavailable

    url = settings.spark_remote
    if url is None:
        raise ConfigError("remote_session needs CDC_SPARK_REMOTE")
    local = url == warm_driver.LOCAL  # this home's warm driver
    if local:
        url = warm_driver.attach(settings)
    try:
        check_listening(url)
        spark = SparkSession.builder.remote(url).getOrCreate()
        server = {key: spark.conf.get(key, None) for key in _catalog_keys(settings)}
    except Exception as exc:  # grpc's errors carry the cause (refused, DNS, TLS)
        cause = str(exc).splitlines()[0][:300]
        if local:
            raise SparkUnavailable(
                f"cannot reach this home's warm driver at {shown(url)}: {cause}; `cdc warm-driver status` shows it and its log "
                "(a retry starts a new one if it ended; CDC_WARM_DRIVER_IDLE_SECONDS=0 spark-submits a driver per job instead)"
            ) from exc
        raise SparkUnavailable(
            f"cannot reach the Spark Connect server at CDC_SPARK_REMOTE={shown(url)}: {cause}; "
            "is it running? (`cdc connect-server` starts one with the same CDC_* settings; unset CDC_SPARK_REMOTE "
            "to start a driver per job)"
        ) from exc
    expected = {key: value for key, value in iceberg_conf(settings).items() if key in server}
    wrong = {key: (server[key], value) for key, value in expected.items() if server[key] != value}
    if wrong:
        spark.stop()
        detail = "; ".join(f"{key}: server {got!r}, this job {want!r}" for key, (got, want) in wrong.items())
        raise ConfigError(
            f"the Spark Connect server at {shown(url)} is wired to another catalog than this job ({detail}): "
            "start the server with the same CDC_CATALOG_* / CDC_WAREHOUSE settings as the jobs"
        )
    if pool:
        spark.conf.set("spark.scheduler.pool", pool)
    spark.addArtifacts(build_code_zip(settings.home / "dist"), pyfile=True)
    if local:
        spark.client.set_retry_policies([_while_served()])  # type: ignore[operator]  # (a Connect session's)
        _unwatch.append(warm_driver.watch(lambda reason: _fail_now(spark, reason)))
    return spark


def _while_served() -> RetryPolicy:
    """The Connect client's retry policy for a job on this home's warm
    driver: its default (a refused or broken call is retried for ten
    minutes), with short waits, and no retry at all once the server is gone.

    Why: the client releases a query's results on a thread pool of its own,
    each release retried by the same policy, and closing the client waits
    for that pool.  A server killed while a release was under way kept a
    job for ten minutes after the kill (its retries, then the close), where
    it should fail within seconds.  Localhost has no network to wait out:
    while the server serves, a wait of 2 s is long enough."""
    from pyspark.sql.connect.client.retries import DefaultPolicy

    class WhileServed(DefaultPolicy):
        def can_retry(self, exception: BaseException) -> bool:
            return super().can_retry(exception) and warm_driver.lost() is None

    # waits of 0.05, 0.2 and 0.8 s (the default's first three), then 2 s each: ten minutes in all
    return WhileServed(max_retries=3 + WHILE_SERVED_SECONDS // 2, max_backoff=2000)


def shown(url: str) -> str:
    """A Spark Connect URL for messages: its token left out."""
    return re.sub(r";token=[^;]*", ";token=…", url)


def _fail_now(spark: SparkSession, reason: str) -> None:
    """The warm driver ended under this job: say so, and close the client,
    whose waiting call then fails at once instead of being retried against
    a server that is gone."""
    log.error("%s", reason)
    with contextlib.suppress(Exception):
        spark.client.close()  # type: ignore[operator]  # (a Connect session's)


JOB_DESCRIPTION = "spark.job.description"


def is_remote(spark: SparkSession) -> bool:
    """A Spark Connect session (no SparkContext, no JVM in this process)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def classic_observation() -> Observation:
    """An ``Observation`` (randomly named) for a classic session's frames.
    ``Observation()`` returns Spark Connect's class once this process has
    made a Connect session (PySpark tells by process-wide state), and a
    classic frame refuses that one."""
    observation = object.__new__(Observation)
    observation.__init__()  # type: ignore[misc]
    return observation


def cut_off(cached: DataFrame) -> tuple[DataFrame, Callable[[], object]]:
    """A small cached frame's rows, cut off from the plan that made them (a
    local checkpoint, built now from the cache by one job), and how to let
    them go.

    Why: every later query on a frame re-reads the plan under it.  A frame
    descending from a cached one is analysed over all of that plan, and
    Spark looks for cached parts in it (on Spark Connect the client sends
    the whole plan again, and the server analyses it anew).  A batch's net
    changes stand on the decode, the labelling's windows, its join with the
    table and the fold: a 3-event batch's reconciliation took 1.1-1.2 s
    over them, 0.5 s over a checkpoint of them (bench/README, issue 20 step
    40).  For small frames only: a checkpoint keeps the rows deserialised,
    which for a large batch is hundreds of MB more heap than the cache
    (step 28).  An executor lost meanwhile loses its part and fails the
    batch (Spark says a checkpoint block was not found), which then runs
    again whole, as after any failure."""
    checkpoint = cached.localCheckpoint(eager=True)
    if is_remote(cached.sparkSession):  # the server frees it with the client's frame
        return checkpoint, lambda: None
    blocks = checkpoint._jdf.queryExecution().logical().rdd()  # the checkpoint's LogicalRDD holds its blocks
    return checkpoint, lambda: blocks.unpersist(False)


@contextlib.contextmanager
def described(spark: SparkSession, text: str) -> Iterator[None]:
    """Name the Spark jobs the block starts, on this thread (and threads it
    starts): the Spark UI lists them as ``text`` instead of a call site such
    as ``sql at <unknown>:0``, so a slow batch shows which phase of which
    table its time went to.  A Spark Connect session is left as it is (its
    UI names each operation already)."""
    if is_remote(spark):
        yield
        return
    sc = spark.sparkContext
    before = sc.getLocalProperty(JOB_DESCRIPTION)
    sc.setLocalProperty(JOB_DESCRIPTION, text)
    try:
        yield
    finally:
        sc.setLocalProperty(JOB_DESCRIPTION, before)  # type: ignore[arg-type]  # None unsets it


def stop_remote_session() -> None:
    """Release this process's Spark Connect session on the server (its
    artifacts and state) instead of leaving it to the server's idle timeout.
    A driver of our own is left alone: spark-submit and tests own it."""
    while _unwatch:
        _unwatch.pop()()
    active = SparkSession.getActiveSession()
    if active is not None and is_remote(active):
        active.stop()
    warm_driver.detach()


def check_listening(url: str, timeout: float = 10.0) -> None:
    """Fail at once when nothing listens at the URL: the Connect client
    itself retries a refused connection for minutes before it gives up."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url.split(";")[0].replace("sc://", "http://", 1))
    with socket.create_connection((parsed.hostname or "localhost", parsed.port or 15002), timeout=timeout):
        pass


def _catalog_keys(settings: Settings) -> list[str]:
    cat = f"spark.sql.catalog.{settings.catalog_name}"
    return [cat, f"{cat}.type", f"{cat}.uri", f"{cat}.warehouse"]
