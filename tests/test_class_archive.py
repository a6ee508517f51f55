"""The driver's class archive (cdc_apply/class_archive.py), with a real JVM:
``java -version`` writes and reads a (small) archive exactly as a Spark
driver does.  The benchmark's test checks the same on spark-submit jobs."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from cdc_apply.runtime import class_archive as ca

OPTS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
KEY = ca.JAVA_OPTIONS


def java(conf: dict[str, str]) -> subprocess.CompletedProcess:
    """A JVM started with the job conf's driver options, as spark-submit starts one."""
    return subprocess.run([ca.java_binary(), *shlex.split(conf[KEY]), "-version"], capture_output=True, text=True, check=True)


def test_the_first_job_writes_the_archive_and_the_next_ones_start_from_it(tmp_path):
    earlier = tmp_path / "driver-classes-0123456789abcdef.jsa"  # of other jars: replaced
    earlier.write_bytes(b"x")
    with ca.driver_with_archive({KEY: OPTS, "other": "x"}, [], tmp_path, OPTS) as conf:
        assert conf["other"] == "x" and "-XX:ArchiveClassesAtExit=" in conf[KEY] and conf[KEY].startswith(OPTS)
        java(conf)
        assert list(tmp_path.glob("*.jsa")) == [earlier]  # put in place only after the job
    (archive,) = tmp_path.glob("*.jsa")
    assert archive == ca.archive_path(tmp_path, [], OPTS)
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.partial"))
    with ca.driver_with_archive({KEY: OPTS}, [], tmp_path, OPTS) as conf:
        assert conf[KEY] == f"{OPTS} -XX:SharedArchiveFile={archive}"
        assert "sharing" in java(conf).stderr
    with ca.driver_with_archive({KEY: OPTS}, [], tmp_path, OPTS, "-Xlog:cds*=off") as conf:  # the CDS warnings off (issue 22)
        assert conf[KEY] == f"{OPTS} -Xlog:cds*=off -XX:SharedArchiveFile={archive}"
        assert "sharing" in java(conf).stderr
    assert ca.loads(archive)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing"])
def test_an_archive_that_does_not_load_is_discarded(tmp_path, damage):
    """A job killed while its JVM writes the archive leaves a truncated file,
    from which every later JVM would abort: it is never put in place."""
    with ca.driver_with_archive({KEY: OPTS}, [], tmp_path, OPTS) as conf:
        java(conf)
        partial = tmp_path / conf[KEY].split("ArchiveClassesAtExit=")[1]
        data = partial.read_bytes()
        partial.unlink()
        if damage == "truncated":
            partial.write_bytes(data[: len(data) // 2])
            scratch = tmp_path.parent / f"{tmp_path.name}-jvm"  # its crash report goes there
            scratch.mkdir()
            assert (
                subprocess.run(
                    [ca.java_binary(), f"-XX:SharedArchiveFile={partial}", "-version"], capture_output=True, cwd=scratch
                ).returncode
                != 0
            )
        elif damage == "garbage":
            partial.write_bytes(b"not an archive")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert not list(Path.cwd().glob("hs_err_pid*.log"))  # the check's crash report stays out of the working folder
    with ca.driver_with_archive({KEY: OPTS}, [], tmp_path, OPTS) as conf:  # the next job tries again
        assert "-XX:ArchiveClassesAtExit=" in conf[KEY]


def test_a_job_that_fails_still_leaves_a_usable_archive(tmp_path):
    with pytest.raises(RuntimeError), ca.driver_with_archive({KEY: OPTS}, [], tmp_path, OPTS) as conf:
        java(conf)
        raise RuntimeError("the job failed after its JVM exited")
    assert ca.loads(ca.archive_path(tmp_path, [], OPTS))


def test_one_job_writes_it_at_a_time_and_a_stale_lock_is_taken_over(tmp_path):
    lock = ca.archive_path(tmp_path, [], OPTS).with_suffix(".lock")
    lock.touch()
    with ca.driver_with_archive({KEY: OPTS}, [], tmp_path, OPTS) as conf:
        assert conf == {KEY: OPTS}  # another job is writing it: run without
    assert lock.exists()
    old = time.time() - ca.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with ca.driver_with_archive({KEY: OPTS}, [], tmp_path, OPTS) as conf:
        assert "-XX:ArchiveClassesAtExit=" in conf[KEY]
    assert not lock.exists()


def test_java_options_set_by_the_user_are_left_as_given(tmp_path):
    for given in ({KEY: "-Xss4m"}, {KEY: ""}, {}):
        with ca.driver_with_archive(dict(given), [], tmp_path / "jvm", OPTS) as conf:
            assert conf == given
    assert not (tmp_path / "jvm").exists()


def test_another_jar_or_other_options_name_another_archive(tmp_path):
    jar = tmp_path / "x.jar"
    jar.write_bytes(b"1")
    first = ca.archive_path(tmp_path, [str(jar)], OPTS)
    assert ca.archive_path(tmp_path, [str(jar)], OPTS) == first
    assert ca.archive_path(tmp_path, [str(jar)], OPTS + " -Xss4m") != first
    assert ca.archive_path(tmp_path, [], OPTS) != first
    jar.write_bytes(b"22")
    assert ca.archive_path(tmp_path, [str(jar)], OPTS) != first


def test_a_folder_that_cannot_hold_the_archive_only_costs_the_archive(tmp_path):
    """The archive is an optimisation: a CDC_HOME where it cannot be written
    leaves the job's conf as it would be without it."""
    blocked = tmp_path / "jvm"
    blocked.write_text("a file where the folder should be")
    with ca.driver_with_archive({KEY: OPTS}, [], blocked, OPTS) as conf:
        assert conf == {KEY: OPTS}


def test_the_short_lived_drivers_jvm_keeps_the_tiered_code_cache():
    """C1 only (``DRIVER_JAVA_OPTIONS``) would shrink the JVM's code cache to
    48 MB, and a session of a few dozen small batches died of it ("Out of
    space in CodeCache for adapters"); the options keep the tiered 240 MB."""
    from cdc_apply.runtime.spark_conf import DRIVER_JAVA_OPTIONS

    def flags(options: str) -> dict[str, str]:
        out = subprocess.run(
            [ca.java_binary(), *shlex.split(options), "-XX:+PrintFlagsFinal", "-version"], capture_output=True, text=True, check=True
        ).stdout
        return {f[1]: f[3] for f in (line.split() for line in out.splitlines()) if len(f) >= 4 and f[2] == "="}

    assert int(flags("-XX:TieredStopAtLevel=1")["ReservedCodeCacheSize"]) < 100 * 2**20  # what the option alone gives
    short_lived = flags(DRIVER_JAVA_OPTIONS)
    assert short_lived["TieredStopAtLevel"] == "1" and int(short_lived["ReservedCodeCacheSize"]) >= int(flags("")["ReservedCodeCacheSize"])
