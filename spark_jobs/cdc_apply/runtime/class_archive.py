"""A class-data-sharing archive for the DAG's short-lived driver JVMs.

Each spark-submit job starts a JVM that loads and verifies the same ~15k
classes (Spark SQL, Iceberg, Parquet) before its first batch can run, and
that is most of a small hourly job's fixed cost.  The JVM can dump the
classes it loaded into an archive when it exits (``-XX:ArchiveClassesAtExit``,
JDK 13+) and map them from that archive on its next start
(``-XX:SharedArchiveFile``): measured on this project's 1k-event hourly job,
29 -> 23 s (bench/README.md, step 20).

The first job after a change of JDK, Spark, jars or JVM options writes the
archive (its exit takes ~13-15 s longer, once); the following jobs use it.  The
archive is only put in place after a JVM has started from it: a truncated
archive makes the JVM abort (a job killed while writing it leaves one), so it
is tried first and discarded if it does not load.  One job at a time writes
it (a lock file); the others run without it meanwhile.  A new archive
replaces the earlier ones (~190 MB each).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from cdc_apply.config import spark_home

STALE_LOCK_SECONDS = 3600
"""a lock older than this was left by a job that did not finish: taken over"""

JAVA_OPTIONS = "spark.driver.extraJavaOptions"


def java_binary() -> str:
    """The java spark-submit launches: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").is_file():
        return str(Path(home, "bin", "java"))
    return shutil.which("java") or "java"


def archive_path(directory: Path, jars: list[str], java_options: str) -> Path:
    """The archive for this JDK, Spark, jars and JVM options: any change of
    them names another file, so a stale archive is never used."""
    h = hashlib.sha256()
    java = Path(os.path.realpath(java_binary()))
    release = java.parent.parent / "release"
    parts = [str(java), release.read_text() if release.is_file() else "", java_options]
    spark_jars = spark_home() / "jars"
    files = sorted(spark_jars.glob("*.jar")) + [Path(j) for j in jars]
    for f in [java, *files]:
        st = f.stat() if f.exists() else None
        parts.append(f"{f}:{st.st_size if st else -1}:{st.st_mtime_ns if st else -1}")
    h.update("\n".join(parts).encode())
    return directory / f"driver-classes-{h.hexdigest()[:16]}.jsa"


def loads(archive: Path) -> bool:
    """Does a JVM start from this archive (and share classes from it)?

    Run in a scratch folder: a JVM that aborts on a damaged archive writes
    its crash report (hs_err_pid*.log) into its working folder."""
    with tempfile.TemporaryDirectory() as scratch:
        try:
            p = subprocess.run(
                [java_binary(), f"-XX:SharedArchiveFile={archive}", "-version"], capture_output=True, text=True, timeout=120, cwd=scratch
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return p.returncode == 0 and "sharing" in p.stderr


def _take_lock(lock: Path) -> bool:
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            try:
                if time.time() - lock.stat().st_mtime < STALE_LOCK_SECONDS:
                    return False
                lock.unlink()
            except FileNotFoundError:
                pass
    return False


@contextlib.contextmanager
def driver_with_archive(
    conf: dict[str, str], jars: list[str], directory: Path, default_options: str, extra_options: str = ""
) -> Iterator[dict[str, str]]:
    """The conf of one spark-submit job, its driver set to use the class
    archive, or to write it if there is none yet.

    Only when the driver's Java options are the project's default
    (``default_options``): options set by the user (``CDC_SPARK_CONF_``) are
    left exactly as given.  Put in place after the job, whatever its
    outcome, if a JVM starts from it.  ``extra_options`` go with the archive
    option (logs.jvm_options: the CDS warnings off)."""
    options = conf.get(JAVA_OPTIONS)
    if options != default_options:
        yield conf
        return
    archive = archive_path(directory, jars, options)
    if archive.is_file():
        yield {**conf, JAVA_OPTIONS: " ".join(o for o in (options, extra_options, f"-XX:SharedArchiveFile={archive}") if o)}
        return
    lock = archive.with_suffix(".lock")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        locked = _take_lock(lock)
    except OSError:  # e.g. a read-only CDC_HOME: the job runs as it would without the archive
        locked = False
    if not locked:
        yield conf  # or another job is writing it
        return
    partial = archive.with_suffix(".partial")
    try:
        partial.unlink(missing_ok=True)
        yield {**conf, JAVA_OPTIONS: " ".join(o for o in (options, extra_options, f"-XX:ArchiveClassesAtExit={partial}") if o)}
    finally:
        try:
            if partial.is_file() and loads(partial):
                os.replace(partial, archive)
                for old in directory.glob("driver-classes-*.jsa"):  # of an earlier JDK, Spark, jars or options
                    if old != archive:
                        old.unlink(missing_ok=True)  # a JVM that maps it keeps its pages
            else:
                partial.unlink(missing_ok=True)
        finally:
            lock.unlink(missing_ok=True)
