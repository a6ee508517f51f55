"""The `cdc` CLI in-process, on the test session's Spark: applying a
directory of archives without Airflow, then again (nothing new)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

pytestmark = pytest.mark.spark


def _sources(tmp_path, monkeypatch, *names: str, quarantine_max_share: float | None = None) -> None:
    """A sources file of Debezium PostgreSQL sources (table public.customers, key id), in use."""
    share = f"    quarantine_max_share: {quarantine_max_share}\n" if quarantine_max_share is not None else ""
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        "sources:\n"
        + "".join(
            f"  {name}:\n    format: debezium_postgres\n    namespace: {name}\n{share}    tables:\n      public.customers: {{primary_key: [id]}}\n"
            for name in names
        )
    )
    monkeypatch.setenv("CDC_SOURCES_FILE", str(sources))


def _demo_archive(folder):
    """The demo's three hours of changes, one file an hour."""
    from cdc_apply.archive.files import write_jsonl
    from cdc_apply.demo import demo_changes

    for hour, lines in demo_changes(dt.datetime(2026, 1, 1, tzinfo=dt.UTC)).items():
        write_jsonl(folder / f"{hour:%Y/%m/%d/%H}" / "customers.jsonl", lines)
    return folder


def _rows(spark, settings, namespace: str) -> set[tuple]:
    """Every stored row (tombstones too) without the batch-specific columns."""
    rows = spark.table(f"{settings.catalog_name}.{namespace}.customers").drop("_cdc_batch_id", "_cdc_applied_at").collect()
    return {tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in r) for r in rows}  # _cdc_col_pos is a map


def test_apply_a_directory_then_nothing_to_do(spark, settings, tmp_path, monkeypatch, capsys):
    from cdc_apply import cli

    _sources(tmp_path, monkeypatch, "cli_dir")
    folder = _demo_archive(tmp_path / "archives")

    assert cli.main(["apply", "--source", "cli_dir", "--dir", str(folder)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "complete" and len(result["files"]) == 3
    assert [(t["table"], t["status"]) for t in result["tables"]] == [(f"{settings.catalog_name}.cli_dir.customers", "published")]
    live = spark.sql(f"SELECT id FROM {settings.catalog_name}.cli_dir.customers WHERE NOT _cdc_deleted").collect()
    assert sorted(r["id"] for r in live) == [1, 2, 4, 5, 6]

    assert cli.main(["apply", "--source", "cli_dir", "--dir", str(folder)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "nothing-to-do"

    # an applied file that changed is refused here too, as discovery refuses it
    changed = sorted(folder.rglob("*.jsonl"))[0]
    changed.write_text(changed.read_text() + changed.read_text().splitlines()[0] + "\n")
    assert cli.main(["apply", "--source", "cli_dir", "--dir", str(folder)]) == cli.EXIT_TERMINAL
    err = capsys.readouterr().err
    assert "1 already-applied file(s) changed on disk" in err and str(changed.resolve()) in err


def test_discovery_reads_only_new_files_and_refuses_changed_applied_ones(spark, settings, tmp_path, monkeypatch):
    """Applied files are checked by size (a listing), not read again every
    hour; a size change is refused by name; a same-size rewrite is caught
    with CDC_VERIFY_APPLIED=sha256."""
    import dataclasses

    from cdc_apply import batch
    from cdc_apply.archive import listing
    from cdc_apply.archive.files import write_jsonl
    from cdc_apply.config import get_source
    from cdc_apply.demo import demo_changes
    from cdc_apply.errors import AlreadyAppliedFileChanged

    _sources(tmp_path, monkeypatch, "verify")
    s = dataclasses.replace(settings, sources_file=tmp_path / "sources.yaml", archive_dir=str(tmp_path / "archive"))
    folder = tmp_path / "archive" / "verify"
    hours = demo_changes(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    applied = [write_jsonl(folder / f"{h:%Y/%m/%d/%H}" / "customers.jsonl", lines) for h, lines in hours.items()]
    assert batch.run_batch(s, "verify", spark=spark).status == "complete"
    new = write_jsonl(folder / "2026/01/02/00" / "customers.jsonl", next(iter(hours.values())))

    read: list[str] = []
    real = listing.sha256_of
    monkeypatch.setattr(listing, "sha256_of", lambda p: read.append(str(p)) or real(p))
    src = get_source(s, "verify")
    assert [f.path for f in batch.pending_files(s, src)] == [str(new)] and read == [str(new)]

    original = applied[0].read_bytes()
    applied[0].write_bytes(original + b"\n")  # grew: refused, by name
    with pytest.raises(AlreadyAppliedFileChanged, match=str(applied[0])):
        batch.pending_files(s, src)
    applied[0].write_bytes(original.replace(b'"op":"c"', b'"op":"u"', 1))  # same size, other content
    assert len(applied[0].read_bytes()) == len(original) and applied[0].read_bytes() != original
    assert [f.path for f in batch.pending_files(s, src)] == [str(new)]  # the size check cannot see it
    with pytest.raises(AlreadyAppliedFileChanged, match=str(applied[0])):
        batch.pending_files(dataclasses.replace(s, verify_applied="sha256"), src)


def test_damaged_archives_quarantine_their_unreadable_lines_and_apply_the_rest(spark, settings, tmp_path, monkeypatch, capsys):
    """A truncated gzip file, a corrupt gzip member and a line that is not
    UTF-8: each unreadable part is one quarantine row (file, line, reason);
    the readable lines apply exactly as the same lines in clean files do."""
    import gzip
    import zlib

    from cdc_apply import cli
    from cdc_apply.demo import demo_changes

    _sources(tmp_path, monkeypatch, "damaged", "clean", quarantine_max_share=1.0)
    h0, h1, h2 = (lines for _, lines in sorted(demo_changes(dt.datetime(2026, 1, 1, tzinfo=dt.UTC)).items()))
    damaged, clean = tmp_path / "damaged", tmp_path / "clean"

    whole = gzip.compress(("\n".join(h0) + "\n").encode())
    (damaged / "00").mkdir(parents=True)
    (damaged / "00" / "a.jsonl.gz").write_bytes(whole[: len(whole) - 40])  # cut inside the last line's deflate data
    corrupt = bytearray(gzip.compress(("\n".join(h1[2:]) + "\n").encode()))
    corrupt[-8] ^= 0xFF  # the member's CRC no longer matches its lines
    (damaged / "01").mkdir()
    (damaged / "01" / "b.jsonl.gz").write_bytes(gzip.compress(("\n".join(h1[:2]) + "\n").encode()) + bytes(corrupt))
    (damaged / "02").mkdir()
    (damaged / "02" / "c.jsonl").write_bytes(("\n".join(h2[:2]) + "\n").encode() + b'{"not utf-8": "\xff"}\n' + h2[2].encode() + b"\n")

    assert cli.main(["apply", "--source", "damaged", "--dir", str(damaged)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "complete", result
    q = spark.sql(
        f"SELECT file, line, reason FROM {settings.catalog_name}.{settings.audit_namespace}.quarantine WHERE batch_id = '{result['batch_id']}'"
    ).collect()
    got = sorted((r["file"].rsplit("/", 1)[-1], r["line"], r["reason"].split(":")[0]) for r in q)
    readable_h0 = zlib.decompressobj(31).decompress(whole[: len(whole) - 40]).decode().split("\n")[:-1]  # what zlib can read
    assert 0 < len(readable_h0) < len(h0)
    assert got == [
        ("a.jsonl.gz", len(readable_h0) + 1, "truncated gzip file"),
        ("b.jsonl.gz", 3, "corrupt gzip file"),
        ("c.jsonl", 3, "line is not UTF-8"),
    ]
    assert result["messages"]["read"] == len(readable_h0) + 1 + 2 + 1 + 3 + 1

    (clean / "00").mkdir(parents=True)
    (clean / "00" / "a.jsonl").write_text("\n".join(readable_h0) + "\n")
    (clean / "01").mkdir()
    (clean / "01" / "b.jsonl").write_text("\n".join(h1[:2]) + "\n")
    (clean / "02").mkdir()
    (clean / "02" / "c.jsonl").write_text("\n".join(h2) + "\n")
    assert cli.main(["apply", "--source", "clean", "--dir", str(clean)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "complete"
    assert _rows(spark, settings, "damaged") == _rows(spark, settings, "clean") != set()


def test_files_cut_into_pieces_apply_exactly_like_whole_files(spark, settings, tmp_path, monkeypatch, capsys):
    """With the piece floor lowered, every demo file is decoded by several
    tasks: same messages, same line numbers, same rows as whole files."""
    from cdc_apply import cli
    from cdc_apply.decode import stage as decode_stage

    _sources(tmp_path, monkeypatch, "whole", "cut")
    folder = _demo_archive(tmp_path / "archives")

    assert cli.main(["apply", "--source", "whole", "--dir", str(folder)]) == 0
    whole = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(decode_stage, "PIECE_MIN_BYTES", 1_000)
    monkeypatch.setattr(decode_stage, "LOCAL_DECODE_BYTES", -1)  # by Spark's tasks, which take pieces
    sizes = [(str(p), p.stat().st_size) for p in sorted(folder.rglob("*.jsonl"))]
    assert len(decode_stage.decode_units(sizes, 2)) > 2 * len(sizes)  # really cut
    assert cli.main(["apply", "--source", "cut", "--dir", str(folder)]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["status"] == whole["status"] == "complete"
    assert cut["messages"] == whole["messages"] and cut["messages"]["read"] == 13
    assert _rows(spark, settings, "cut") == _rows(spark, settings, "whole") != set()


def _java_commands(proc) -> list[list[str]]:
    """The command lines of the JVMs a running process starts, until it ends."""
    import time

    import psutil

    seen: dict[int, list[str]] = {}
    while proc.poll() is None:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            break
        javas: dict[int, tuple[int, list[str]]] = {}
        for child in children:
            try:
                cmd, parent = child.cmdline(), child.ppid()
            except psutil.Error:  # ended while looked at
                continue
            if cmd and cmd[0].endswith("/java"):
                javas[child.pid] = (parent, cmd)
        for pid, (parent, cmd) in javas.items():
            # a JVM's fork (Hadoop's shell probes) shows the JVM's own command line until it execs
            if parent not in javas and parent not in seen:
                seen[pid] = cmd
        time.sleep(0.1)
    return list(seen.values())


def test_the_cdc_command_starts_a_short_lived_driver_and_a_kept_session_does_not(settings, tmp_path):
    """`cdc` runs one command and exits: the driver JVM it starts gets a
    spark-submit job's C1-only JIT (``session.one_command_process``), as a
    JVM option, not only as Spark conf.  A session kept for many batches (the
    bench's, a Connect server's) keeps the C2 compiler, which pays off there."""
    import os
    import shlex
    import subprocess
    import sys

    from cdc_apply.runtime.spark_conf import DRIVER_JAVA_OPTIONS, session_conf

    env = {k: v for k, v in os.environ.items() if not k.startswith("CDC_SPARK_CONF_")} | {"CDC_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdc_apply.cli", "maintain", "--source", "pg_inventory"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    javas = _java_commands(proc)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert len(javas) == 1, javas
    java = javas[0]
    main_class = java.index("org.apache.spark.deploy.SparkSubmit")
    assert set(shlex.split(DRIVER_JAVA_OPTIONS)) <= set(java[:main_class]), java  # options of the JVM itself
    # a kept session's conf has none (the tests' own session is given C1 by tests/conftest.py, for CI's cores)
    assert "spark.driver.extraJavaOptions" not in session_conf(settings, own_short_lived_driver=False)
