"""Archive and warehouse on S3-compatible storage, catalog over Iceberg REST.

Started natively by the test (tests/servers.py): s3proxy (an S3-compatible
server, in memory) and Apache Iceberg's REST catalog server with S3FileIO on
it.  The demo's Debezium PostgreSQL archive is uploaded under
``s3a://<bucket>/archive/pg_inventory/``; the job runs in a subprocess (its own
SparkSession: the session fixture of conftest binds one catalog per test
session) with nothing but environment variables pointing it at the store and
the catalog, then the table is read back with pyiceberg over REST + S3.
Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from tests import servers

pytestmark = [pytest.mark.spark, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
BUCKET = "cdc-lake"
SOURCE = "pg_inventory"
ARCHIVE = f"s3a://{BUCKET}/archive"
WAREHOUSE = f"s3://{BUCKET}/warehouse"
START = dt.datetime(2026, 1, 1, 0, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    missing = servers.tools_missing()
    if missing:
        pytest.skip(f"object-store test needs java and mvn: {missing}")
    work = tmp_path_factory.mktemp("object_store")
    with servers.s3_server(work) as s3:
        s3.create_bucket(BUCKET)
        with servers.rest_catalog(work, s3, WAREHOUSE) as rest:
            local = work / "archive"
            _write_demo_archive(local / SOURCE)
            uploaded = s3.upload_tree(local, ARCHIVE)
            assert len(uploaded) == 3, uploaded
            env = _job_env(work / "cdc_home", s3, rest)
            yield {"s3": s3, "rest": rest, "env": env, "work": work, "uploaded": uploaded}


def _write_demo_archive(folder: Path) -> None:
    from cdc_apply.archive.files import write_jsonl
    from cdc_apply.demo import demo_changes

    for hour, lines in demo_changes(START).items():
        write_jsonl(folder / f"{hour:%Y/%m/%d/%H}" / "customers-0000.jsonl.gz", lines, compress=True)


def _job_env(home: Path, s3: servers.S3Server, rest: servers.RestCatalog) -> dict[str, str]:
    """The job's whole configuration: environment variables, credentials included."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_", "AWS_", "PYSPARK_"))}
    env.update(
        {
            "CDC_HOME": str(home),
            "CDC_JARS_DIR": os.environ.get("CDC_JARS_DIR", str(ROOT / ".cdc" / "jars")),
            "CDC_SOURCES_FILE": str(ROOT / "include" / "sources.yaml"),
            "CDC_SPARK_MASTER": "local[2]",
            "CDC_CATALOG_TYPE": "rest",
            "CDC_CATALOG_URI": rest.uri,
            "CDC_WAREHOUSE": WAREHOUSE,
            "CDC_ARCHIVE_DIR": ARCHIVE,
            **s3.client_env,  # CDC_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION
        }
    )
    return env


def _cdc(env: dict[str, str], *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cdc_apply.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _manifest(stack) -> Path:
    """Discovery's manifest (what the DAG passes with --files-from), listed
    and fingerprinted on the object store by storage.list_object_files."""
    from cdc_apply.archive.object_store import list_object_files

    files = list_object_files(f"{ARCHIVE}/{SOURCE}", filesystem=stack["s3"].filesystem())
    from cdc_apply.archive.files import write_manifest

    return write_manifest(stack["work"] / "manifest.json", files)


def _catalog(stack):
    from pyiceberg.catalog import load_catalog

    s3 = stack["s3"]
    return load_catalog(
        "lake",
        type="rest",
        uri=stack["rest"].uri,
        warehouse=WAREHOUSE,
        **{
            "s3.endpoint": s3.endpoint,
            "s3.path-style-access": "true",
            "s3.region": s3.region,
            "s3.access-key-id": s3.access_key,
            "s3.secret-access-key": s3.secret_key,
        },
    )


def test_list_object_files_maps_hours_and_fingerprints(stack):
    import hashlib

    from cdc_apply.archive.listing import archive_file_exists
    from cdc_apply.archive.object_store import list_object_files

    fs = stack["s3"].filesystem()
    files = list_object_files(f"{ARCHIVE}/{SOURCE}", filesystem=fs)
    assert [f.path for f in files] == stack["uploaded"]
    assert [f.hour for f in files] == [START + dt.timedelta(hours=h) for h in range(3)]
    for f in files:
        key = f.path.split("://", 1)[1]
        data = fs.open_input_stream(key, compression=None).read()
        assert f.size == len(data) and f.sha256 == hashlib.sha256(data).hexdigest()
    later = list_object_files(
        f"{ARCHIVE}/{SOURCE}", since=START + dt.timedelta(hours=1), until=START + dt.timedelta(hours=2), filesystem=fs
    )
    assert [f.hour for f in later] == [START + dt.timedelta(hours=1)]
    assert list_object_files(f"{ARCHIVE}/no_such_source", filesystem=fs) == []
    # what a batch asks of a held file it does not read (held.gone): still there, or gone
    assert archive_file_exists(files[0].path, filesystem=fs)
    assert not archive_file_exists(files[0].path + ".gone", filesystem=fs)
    # applied objects of unchanged size keep their recorded fingerprint (not downloaded again); a resized one is read
    first, second = files[0], files[1]
    known = {first.path: (first.size, "recorded"), second.path: (second.size + 1, "recorded")}
    again = {f.path: f.sha256 for f in list_object_files(f"{ARCHIVE}/{SOURCE}", filesystem=fs, known=known)}
    assert again[first.path] == "recorded" and again[second.path] == second.sha256


def test_apply_from_s3_archive_into_rest_catalog_on_s3(stack):
    env = stack["env"]
    manifest = _manifest(stack)
    proc = _cdc(env, "apply", "--source", SOURCE, "--files-from", str(manifest))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert result["status"] == "complete", result
    assert [t["status"] for t in result["tables"]] == ["published"], result["tables"]
    assert [f["path"] for f in result["files"]] == stack["uploaded"]

    # read back with pyiceberg: REST catalog + S3 FileIO
    table = _catalog(stack).load_table(f"{SOURCE}.customers")
    assert table.metadata_location.startswith(f"{WAREHOUSE}/"), table.metadata_location
    rows = {r["id"]: r for r in table.scan().to_arrow().to_pylist()}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert sorted(i for i, r in rows.items() if not r["_cdc_deleted"]) == [1, 2, 4, 5, 6]
    assert rows[3]["_cdc_deleted"] is True and rows[3]["_cdc_op"] == "d"
    assert rows[1]["first_name"] == "Anne-Marie" and rows[1]["balance"] == Decimal("12.34")
    assert rows[4]["first_name"] == "Dee" and rows[4]["balance"] == Decimal("100.00")
    assert rows[6]["first_name"] == "Faye" and rows[2]["balance"] == Decimal("21.50")
    summary = table.current_snapshot().summary.additional_properties
    assert [f["path"] for f in json.loads(summary["cdc.files"])] == stack["uploaded"]
    data_files = [t.file.file_path for t in table.scan().plan_files()]
    assert data_files and all(p.startswith(f"{WAREHOUSE}/") for p in data_files), data_files

    # the same files again: nothing new on main (the ledger knows s3a:// paths)
    snapshot = table.current_snapshot().snapshot_id
    again = _cdc(env, "apply", "--source", SOURCE, "--files-from", str(manifest))
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-6000:]
    assert _catalog(stack).load_table(f"{SOURCE}.customers").current_snapshot().snapshot_id == snapshot

    # pyiceberg through the project's own settings (Settings.pyiceberg_properties)
    status = _cdc(env, "status", "--source", SOURCE, timeout=120)
    assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-3000:]
    (line,) = json.loads(status.stdout[status.stdout.index("[") :])
    assert (line["table"], line["rows"], line["tombstones"]) == (f"{SOURCE}.customers", 5, 1)


def test_discovery_lists_the_s3_archive(stack):
    """`cdc pending` (discovery, as the DAG's discover task does) on an s3a://
    CDC_ARCHIVE_DIR.  Runs after the apply above: nothing is pending then, so
    list a fresh source folder instead."""
    s3 = stack["s3"]
    fs = s3.filesystem()
    key = f"{BUCKET}/archive/fresh_source/2026/01/02/05/changes-0001.jsonl"
    with fs.open_output_stream(key, compression=None) as out:
        out.write(b'{"x": 1}\n')
    sources = stack["work"] / "sources.yaml"
    sources.write_text("sources:\n  fresh_source:\n    format: debezium_postgres\n    namespace: fresh_source\n")
    env = {**stack["env"], "CDC_SOURCES_FILE": str(sources)}
    proc = _cdc(env, "pending", "--source", "fresh_source", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"s3a://{key}" in proc.stdout and "2026-01-02T05" in proc.stdout, proc.stdout
