"""Issue 23 probe, archive side: listing faults fail the run (never a shorter
file list), an unreadable file is a named transient error, a UTF-8 byte
order mark is an encoding marker (stripped, never a quarantined change)."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cdc_apply.archive import files, lines, listing
from cdc_apply.errors import ArchiveUnreadable, CdcError, TerminalError

BOM = b"\xef\xbb\xbf"


def _two_hours(root: Path) -> tuple[Path, Path]:
    early = files.write_jsonl(root / "2026/01/01/00" / "a.jsonl", ['{"x":1}'])
    late = files.write_jsonl(root / "2026/01/01/01" / "b.jsonl", ['{"x":2}'])
    return early, late


def test_unreadable_hour_folder_fails_the_listing_as_a_real_non_root_user(tmp_path):
    """A real mode-000 folder, listed by the unprivileged user ``nobody``
    (root ignores modes): the listing fails naming the folder."""
    if not Path("/usr/bin/setpriv").exists():
        pytest.skip("setpriv is needed to list as a non-root user")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="cdc_unreadable_")) / "arch"  # /tmp/pytest-of-root is 0700
    _two_hours(base)
    # the package under test, copied where `nobody` can read it (a checkout may sit in a 0700 folder)
    code_dir = base.parent / "code"
    shutil.copytree(
        Path(__file__).resolve().parents[1] / "spark_jobs" / "cdc_apply",
        code_dir / "cdc_apply",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for p in [base.parent, *base.parent.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    os.chmod(base / "2026/01/01/00", 0)
    code = (
        "import sys; from cdc_apply.archive import listing\n"
        "try:\n    listing.list_files(sys.argv[1])\nexcept Exception as e:\n"
        "    print(type(e).__name__, e); sys.exit(3)\n"
        "print('listed'); sys.exit(0)\n"
    )
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code, str(base)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(code_dir)},
        cwd="/",
    )
    os.chmod(base / "2026/01/01/00", 0o755)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ArchiveUnreadable" in proc.stdout and "2026/01/01/00" in proc.stdout and "Permission denied" in proc.stdout


def test_listing_error_is_transient_and_names_the_folder(tmp_path, monkeypatch):
    base = tmp_path / "arch"
    early, _ = _two_hours(base)
    real = os.scandir

    def scandir(path="."):
        if Path(path) == early.parent:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ArchiveUnreadable, match=str(early.parent)) as info:
        listing.list_files(base)
    assert isinstance(info.value, CdcError) and not isinstance(info.value, TerminalError)


def test_cdc_pending_fails_with_exit_1_instead_of_listing_the_later_hour(tmp_path, monkeypatch, capsys):
    from cdc_apply import cli

    monkeypatch.setenv("CDC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CDC_ARCHIVE_DIR", str(tmp_path / "archive"))
    sources = tmp_path / "sources.yaml"
    sources.write_text("sources:\n  unread:\n    format: debezium_postgres\n")
    monkeypatch.setenv("CDC_SOURCES_FILE", str(sources))
    early, late = _two_hours(tmp_path / "archive" / "unread")
    real = os.scandir
    monkeypatch.setattr(
        os,
        "scandir",
        lambda p=".": (_ for _ in ()).throw(PermissionError(13, "Permission denied", str(p))) if Path(p) == early.parent else real(p),
    )
    assert cli.main(["pending", "--source", "unread"]) == 1
    out = capsys.readouterr()
    assert str(late) not in out.out and "cannot be listed" in out.err and str(early.parent) in out.err


def test_unreadable_file_is_a_named_transient_error(tmp_path, monkeypatch):
    f = files.write_jsonl(tmp_path / "a.jsonl", ['{"x":1}'])
    real_open = Path.open
    monkeypatch.setattr(
        Path,
        "open",
        lambda self, *a, **k: (
            (_ for _ in ()).throw(PermissionError(13, "Permission denied", str(self))) if self == f else real_open(self, *a, **k)
        ),
    )
    with pytest.raises(ArchiveUnreadable, match=f"archive file {f} cannot be read"):
        listing.sha256_of(f)


def test_a_dangling_link_fails_the_listing_naming_it(tmp_path):
    """A link to a file that is gone is an archive file that cannot be read,
    not a file that is not there (found by the nemesis' file faults: it was
    left out of the listing and the batch completed without it)."""
    hour = tmp_path / "2026" / "01" / "01" / "00"
    hour.mkdir(parents=True)
    files.write_jsonl(hour / "a.jsonl", ['{"x":1}'])
    (hour / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    (hour / "README.md").symlink_to(tmp_path / "gone.md")  # not an archive file name: not ours to judge
    with pytest.raises(ArchiveUnreadable, match=f"archive file {hour / 'b.jsonl'} cannot be read: it is a link to .*gone.jsonl"):
        listing.list_files(tmp_path)
    (hour / "b.jsonl").unlink()
    assert [Path(f.path).name for f in listing.list_files(tmp_path)] == ["a.jsonl"]


@pytest.mark.parametrize("compress", [False, True])
def test_utf8_bom_is_stripped_not_quarantined(compress):
    payload = BOM + b'{"a":1}\n{"b":2}\n'
    data = gzip.compress(payload) if compress else payload
    items = list(lines.iter_lines("f.jsonl", data))
    assert [(m.line, m.text) for m in items] == [(1, '{"a":1}'), (2, '{"b":2}')]


def test_bom_only_at_the_start_of_the_file_is_an_encoding_marker():
    """Inside a file a BOM is content (and the decoder judges it)."""
    items = list(lines.iter_lines("f.jsonl", b'{"a":1}\n' + BOM + b'{"b":2}\n'))
    assert items[1].text == '\ufeff{"b":2}'


class _FailingStore:
    """A pyarrow file system whose listing or reads fail as a store's would."""

    def __init__(self, fail_listing: bool):
        from pyarrow import fs as pafs

        self.inner = pafs.SubTreeFileSystem("/", pafs.LocalFileSystem())  # keys without a leading slash, as on a store
        self.fail_listing = fail_listing

    def get_file_info(self, what):
        if self.fail_listing and not isinstance(what, str):
            raise OSError("When listing objects under key 'src/2026/01/01/00': AWS Error ACCESS_DENIED")
        return self.inner.get_file_info(what)

    def open_input_stream(self, key, compression=None):
        raise OSError(f"When reading information for key '{key}': AWS Error ACCESS_DENIED")


@pytest.mark.parametrize("fail_listing", [True, False], ids=["listing", "read"])
def test_object_store_faults_are_named_transient_errors(tmp_path, fail_listing):
    from cdc_apply.archive.object_store import list_object_files

    _two_hours(tmp_path / "bucket" / "src")
    with pytest.raises(ArchiveUnreadable, match="cannot be listed" if fail_listing else "cannot be read"):
        list_object_files(f"s3://{tmp_path.as_posix().lstrip('/')}/bucket/src", filesystem=_FailingStore(fail_listing))
