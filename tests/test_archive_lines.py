"""Archive files are streamed a chunk at a time (``lines.iter_lines``): the
messages, line numbers and damage reports must be exactly those of reading the
whole file at once, wherever the chunk boundaries fall."""

from __future__ import annotations

import gzip
import io
import itertools

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cdc_apply.archive.lines import iter_lines, open_archive, plan_pieces
from cdc_apply.decode.stage import decode_units, file_groups
from cdc_apply.model import RawMessage

LINE = st.one_of(
    st.text(alphabet=st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)), max_size=40).map(str.encode),
    st.sampled_from([b"", b"   ", b"\r", b'{"a": 1}\r', b"\xff\xfe not utf-8", b"caf\xc3\xa9", b"x" * 300]),
)


def whole_file(path: str, data: bytes) -> list:
    """The reference: split the decompressed bytes at once."""
    out = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw[:-1] if raw.endswith(b"\r") else raw
        if not raw.strip():
            continue
        try:
            out.append(RawMessage(path, number, raw.decode("utf-8")))
        except UnicodeDecodeError as exc:
            out.append((number, raw.decode("utf-8", "replace"), f"line is not UTF-8: {exc}"))
    return out


def gzip_members(data: bytes, cuts: list[int]) -> bytes:
    """``data`` as concatenated gzip members, cut at ``cuts``."""
    bounds = [0] + sorted(c % (len(data) + 1) for c in cuts) + [len(data)]
    return b"".join(gzip.compress(data[a:b]) for a, b in itertools.pairwise(bounds))


@hsettings(max_examples=300, deadline=None)
@given(
    lines=st.lists(LINE, max_size=30),
    final_newline=st.booleans(),
    chunk=st.integers(1, 64),
    compress=st.booleans(),
    cuts=st.lists(st.integers(0, 10_000), max_size=3),
)
def test_streamed_lines_equal_the_whole_file_read(lines, final_newline, chunk, compress, cuts):
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    stored = gzip_members(data, cuts) if compress else data
    got = list(iter_lines("f.jsonl", lambda: io.BytesIO(stored), chunk_bytes=chunk))
    assert got == whole_file("f.jsonl", data)
    assert list(iter_lines("f.jsonl", stored)) == got  # bytes in, one chunk


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_truncated_gzip_keeps_the_complete_lines_and_reports_the_tail(chunk):
    lines = [f'{{"n": {i}, "pad": "{"p" * 50}"}}'.encode() for i in range(200)]
    stored = gzip.compress(b"\n".join(lines) + b"\n")
    cut = stored[: len(stored) // 2]
    got = list(iter_lines("f.jsonl.gz", lambda: io.BytesIO(cut), chunk_bytes=chunk))
    *messages, tail = got
    assert [m.text.encode() for m in messages] == lines[: len(messages)]
    assert [m.line for m in messages] == list(range(1, len(messages) + 1))
    assert 0 < len(messages) < 200
    number, raw, reason = tail
    assert number == len(messages) + 1
    assert lines[len(messages)].startswith(raw.encode())  # the partial line, as far as it was readable
    assert reason == "truncated gzip file: the stream ends before its end marker"


def test_corrupt_gzip_member_yields_none_of_its_lines():
    lines = [f'{{"n": {i}}}'.encode() for i in range(5000)]
    stored = bytearray(gzip.compress(b"\n".join(lines) + b"\n", compresslevel=1))
    stored[len(stored) // 2 : len(stored) // 2 + 64] = b"\x00" * 64
    got = list(iter_lines("f.jsonl.gz", lambda: io.BytesIO(bytes(stored)), chunk_bytes=4096))
    # gzip proves a member intact only at its end: none of the damaged member's lines
    assert got == [(1, "", got[0][2])] and got[0][2].startswith("corrupt gzip file: ")


def test_corrupt_member_loses_only_its_own_lines():
    first = [f'{{"n": {i}}}'.encode() for i in range(100)]
    second = [f'{{"m": {i}}}'.encode() for i in range(5000)]
    bad = bytearray(gzip.compress(b"\n".join(second) + b"\n", compresslevel=1))
    bad[len(bad) // 2 : len(bad) // 2 + 64] = b"\x00" * 64
    stored = gzip.compress(b"\n".join(first) + b"\n") + bytes(bad)
    *messages, (number, raw, reason) = iter_lines("f.jsonl.gz", lambda: io.BytesIO(stored), chunk_bytes=4096)
    assert [m.text.encode() for m in messages] == first
    assert (number, raw) == (101, "") and reason.startswith("corrupt gzip file: ")


def test_garbage_after_a_gzip_member_is_corruption_not_silence():
    stored = gzip.compress(b'{"a": 1}\n') + b"not gzip"
    got = list(iter_lines("f.gz", stored))
    assert got[0] == RawMessage("f.gz", 1, '{"a": 1}')
    assert got[1][0] == 2 and got[1][2].startswith("corrupt gzip file: ")


def test_open_archive_reads_local_paths_and_file_uris(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n')
    for name in (str(path), f"file:{path}", f"file://{path}"):
        with open_archive(name) as stream:
            assert stream.read() == b'{"a": 1}\n'


def test_file_groups_keep_every_core_busy_and_pack_small_files():
    assert file_groups([], 2) == []
    assert file_groups([("a", 10)], 4) == [["a"]]  # never more tasks than files
    big = file_groups([("a", 100), ("b", 60), ("c", 50), ("d", 10)], 2)
    assert sorted(map(sorted, big)) == [["a", "d"], ["b", "c"]]  # largest first onto the least loaded
    small = file_groups([(str(i), 1_000) for i in range(1_000)], 2, target_bytes=100_000)
    assert len(small) == 10 and sorted(p for g in small for p in g) == sorted(str(i) for i in range(1_000))


def _makespan(groups: list[list[str]], sizes: dict[str, int], slots: int) -> int:
    """When the last core finishes, tasks started in order on the first free core (Spark's local scheduling)."""
    cores = [0] * slots
    for g in groups:
        cores[cores.index(min(cores))] += sum(sizes[p] for p in g)
    return max(cores)


@pytest.mark.parametrize(("pieces", "slots"), [(10, 2), (7, 2), (12, 4), (30, 2), (5, 3)])
def test_file_groups_end_on_every_core_together(pieces, slots):
    """A 100k-event batch (five 77 MB files, cut into ten pieces) was dealt
    to three tasks of 153, 115 and 115 MB on two cores: one core decoded
    230 MB while the other waited after 153.  Whole rounds of tasks, largest
    first, end within one piece of an even split."""
    mb = 1 << 20
    sizes = {f"p{i}": 38 * mb for i in range(pieces)}
    groups = file_groups(list(sizes.items()), slots, target_bytes=128 * mb)
    assert len(groups) % slots == 0 or len(groups) == pieces
    assert _makespan(groups, sizes, slots) <= -(-pieces // slots) * 38 * mb


@hsettings(max_examples=300, deadline=None)
@given(lines=st.lists(LINE, max_size=40), final_newline=st.booleans(), piece=st.integers(1, 200), chunk=st.integers(1, 64))
def test_pieces_cover_the_file_line_for_line(tmp_path_factory, lines, final_newline, piece, chunk):
    """A large plain file is decoded in pieces by several tasks: the pieces,
    read one after another, give exactly the messages and line numbers of the
    whole file."""
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    path = tmp_path_factory.mktemp("pieces") / "f.jsonl"
    path.write_bytes(data)
    pieces = plan_pieces(str(path), piece, chunk_bytes=chunk)
    assert pieces[0].start == 0 and pieces[-1].end == len(data)
    assert all(a.end == b.start for a, b in itertools.pairwise(pieces))
    assert all(p.start == 0 or data[p.start - 1 : p.start] == b"\n" for p in pieces)  # each starts a line
    got = [m for p in pieces for m in iter_lines(str(path), lambda: open(path, "rb"), chunk_bytes=chunk, piece=p)]
    assert got == whole_file(str(path), data)


def test_gzip_and_small_files_are_not_cut(tmp_path):
    gz = tmp_path / "a.jsonl"
    gz.write_bytes(gzip.compress(b'{"a": 1}\n' * 10_000))
    assert plan_pieces(str(gz), 100) == []
    small = tmp_path / "b.jsonl"
    small.write_bytes(b'{"a": 1}\n' * 10)
    assert [(p.start, p.end, p.first_line) for p in plan_pieces(str(small), 1_000)] == [(0, 90, 1)]


def test_a_big_plain_file_is_cut_so_every_core_decodes(tmp_path):
    line = b'{"pad": "' + b"x" * 1_000 + b'"}\n'
    big = tmp_path / "big.jsonl"
    big.write_bytes(line * 40_000)  # ~40 MB
    packed = tmp_path / "big.jsonl.gz"
    packed.write_bytes(gzip.compress(line * 40_000, compresslevel=1))
    size = big.stat().st_size
    units = decode_units([(str(big), size)], slots=2)
    assert len(units) == round(size / (16 << 20)) == 2  # pieces no smaller than PIECE_MIN_BYTES
    assert sum(n for _, n in units) == size and all(piece is not None for (_, piece), _ in units)
    assert decode_units([(str(big), size)], slots=1) == units  # the floor, not the core count, decides here
    assert decode_units([(str(packed), size)], slots=2) == [((str(packed), None), size)]  # gzip: whole
    assert decode_units([("s3a://bucket/big.jsonl", size)], slots=2) == [(("s3a://bucket/big.jsonl", None), size)]  # remote: whole
    small = [(f"/nowhere/{i}.jsonl", 1 << 20) for i in range(8)]
    assert decode_units(small, slots=2) == [((p, None), n) for p, n in small]  # small files are never opened to plan
