"""zstd archives (``.ndjson.zst``, CockroachDB's ``compression=zstd``) are
listed and read like gzip ones, damage included; a JSON-lines file under a
compression that is not read is refused by the listing, naming it — never
left out of the file list without a word."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import zstandard

from cdc_apply.archive import files, lines, listing
from cdc_apply.decode.cockroachdb import cloud_storage_table
from cdc_apply.errors import TerminalError, UnreadableCompression
from cdc_apply.model import RawMessage

LINES = [f'{{"n":{i},"pad":"{"x" * (i % 7)}"}}' for i in range(1, 301)]


def _zstd(lines: list[str], frames: int = 1) -> bytes:
    """``lines`` as zstd frames (a sink that appends writes several)."""
    c = zstandard.ZstdCompressor(write_checksum=True)
    cut = [len(lines) * i // frames for i in range(frames + 1)]
    return b"".join(c.compress(("\n".join(lines[a:b]) + "\n").encode()) for a, b in itertools.pairwise(cut))


def _read(data: bytes, chunk: int = lines.CHUNK_BYTES) -> list:
    return [(m.line, m.text) if isinstance(m, RawMessage) else m for m in lines.iter_lines("f.ndjson.zst", data, chunk_bytes=chunk)]


@pytest.mark.parametrize("frames", [1, 3])
@pytest.mark.parametrize("chunk", [7, lines.CHUNK_BYTES])
def test_zstd_lines_equal_the_plain_lines(frames, chunk):
    assert _read(_zstd(LINES, frames), chunk) == [(i, t) for i, t in enumerate(LINES, 1)]


def test_truncated_zstd_keeps_the_complete_lines_and_reports_the_tail():
    data = _zstd(LINES, 3)
    second_frame_end = len(_zstd(LINES[:200], 2))  # frames 1 and 2 of the same cut are the same bytes
    got = _read(data[: second_frame_end + 5])
    assert got[:-1] == [(i, t) for i, t in enumerate(LINES[:200], 1)]
    number, _raw, reason = got[-1]
    assert number == 201 and reason == "truncated zstd file: the stream ends before its end marker"


def test_corrupt_zstd_frame_yields_none_of_its_lines():
    data = bytearray(_zstd(LINES))
    data[len(data) // 2] ^= 0xFF
    got = _read(bytes(data))
    assert len(got) == 1 and got[0][0] == 1 and got[0][2].startswith("corrupt zstd file: ")


def test_zstd_files_are_not_cut_into_pieces(tmp_path):
    path = files.write_jsonl(tmp_path / "f.ndjson.zst", LINES, compress="zstd")
    assert lines.plan_pieces(str(path), piece_bytes=64) == []
    assert [m.text for m in lines.iter_lines(str(path), path.read_bytes())] == LINES


def _archive(root: Path) -> set[str]:
    """A cloud-storage sink's hour with zstd, gzip and plain files."""
    names = {
        "2026/01/01/00/a.ndjson.zst": "zstd",
        "2026/01/01/00/b.jsonl.zst": "zstd",
        "2026/01/01/00/c.ndjson.gz": True,
        "2026/01/01/00/d.ndjson": False,
    }
    for name, how in names.items():
        files.write_jsonl(root / name, ['{"x":1}'], compress=how)
    return {str((root / n).resolve()) for n in names}


def test_zstd_files_are_listed(tmp_path):
    expected = _archive(tmp_path / "src")
    assert {f.path for f in listing.list_files(tmp_path / "src")} == expected


def test_zstd_objects_are_listed_on_the_object_store(tmp_path):
    from pyarrow import fs as pafs

    from cdc_apply.archive.object_store import list_object_files

    expected = _archive(tmp_path / "bucket" / "src")
    store = pafs.SubTreeFileSystem("/", pafs.LocalFileSystem())
    got = list_object_files(f"s3://{tmp_path.as_posix().lstrip('/')}/bucket/src", filesystem=store)
    assert {f.path.removeprefix("s3:/") for f in got} == expected


@pytest.mark.parametrize("name", ["e.ndjson.bz2", "e.jsonl.lz4", "e.json.snappy", "E.NDJSON.XZ"])
def test_a_file_under_a_compression_not_read_is_refused_naming_it(tmp_path, name):
    _archive(tmp_path / "src")
    bad = tmp_path / "src/2026/01/01/00" / name
    bad.write_bytes(b"\x00\x01 not read")
    with pytest.raises(UnreadableCompression) as info:
        listing.list_files(tmp_path / "src")
    assert str(bad.resolve()) in str(info.value) and "gzip (.gz) or zstd (.zst)" in str(info.value)
    assert isinstance(info.value, TerminalError)  # the sink's configuration must change: no retry loop


def test_a_refused_compression_outside_the_listed_hours_does_not_block(tmp_path):
    import datetime as dt

    _archive(tmp_path / "src")
    (tmp_path / "src/2026/01/01/05").mkdir(parents=True)
    (tmp_path / "src/2026/01/01/05/late.ndjson.bz2").write_bytes(b"x")
    assert len(listing.list_files(tmp_path / "src", until=dt.datetime(2026, 1, 1, 1, tzinfo=dt.UTC))) == 4


def test_other_files_are_still_not_archive_files(tmp_path):
    _archive(tmp_path / "src")
    for name in ("README.md", "x.parquet", "_SUCCESS", ".tmp.ndjson.bz2", "schema.avsc", "2026.zst"):
        (tmp_path / "src/2026/01/01/00" / name).write_bytes(b"x")
    assert len(listing.list_files(tmp_path / "src")) == 4


def test_the_cloud_storage_file_name_names_the_table_under_zstd():
    ref = cloud_storage_table("/a/2025-04-24/202504241459289627550000000000000-56087568dba1e6b8-1-72-00000000-vehicles-1.ndjson.zst")
    assert ref is not None and ref.table == "vehicles"
