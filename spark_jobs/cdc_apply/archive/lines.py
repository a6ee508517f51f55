"""Reading archive files as numbered lines: plain, gzip or zstd (also
concatenated members / frames, and damaged ones), local or on an object
store, whole or in pieces cut at line starts."""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from cdc_apply.model import RawMessage

if TYPE_CHECKING:
    from cdc_apply.config import S3Options


CHUNK_BYTES = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"
GZIP_MAGIC = b"\x1f\x8b"  # gzip is recognised by its first two bytes, not by the file name
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # zstd likewise, by its frame magic number


def compression_of(head: bytes) -> str | None:
    """``'gzip'``, ``'zstd'`` or None (plain), from a file's first bytes."""
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head[:4] == ZSTD_MAGIC:
        return "zstd"
    return None


def open_archive(path: str, s3: S3Options | None = None) -> BinaryIO:
    """A binary stream of an archive file's stored bytes: a local path (or
    ``file:`` URI), or an ``s3://`` / ``s3a://`` object read with pyarrow
    (``s3``: the store's endpoint and region, from the driver)."""
    from cdc_apply.archive.object_store import s3_filesystem, split_uri
    from cdc_apply.config import S3Options, is_object_store_uri

    if is_object_store_uri(path):
        return s3_filesystem(s3 or S3Options.from_env()).open_input_stream(split_uri(path)[1], compression=None)
    return open(local_path(path), "rb")


def local_path(uri: str) -> str:
    """``file:/x`` and ``file:///x`` -> ``/x``; anything else unchanged."""
    return uri[len("file:") :] if uri.startswith("file:") and not uri.startswith("file://") else uri.removeprefix("file://")


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of a plain (not compressed) file, cut at line starts, and
    the number of its first line: a large file is decoded by several tasks."""

    start: int
    end: int
    first_line: int


def plan_pieces(path: str, piece_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[Piece]:
    """Cut a local plain file into pieces of about ``piece_bytes``, each
    starting at a line start, numbered from the newlines before it: one pass
    that only counts (no parsing).  ``[]`` for a gzip or zstd file, which
    cannot be cut without decompressing it."""
    cuts = [(0, 1)]  # (line start, its line number)
    newlines = pos = 0
    target = piece_bytes
    with open(local_path(path), "rb") as f:
        if compression_of(f.read(4)):
            return []
        f.seek(0)
        while chunk := f.read(chunk_bytes):
            while target - 1 < pos + len(chunk):
                i = chunk.find(b"\n", max(0, target - 1 - pos))
                if i < 0:
                    break
                start = pos + i + 1
                cuts.append((start, newlines + chunk.count(b"\n", 0, i + 1) + 1))
                target = start + piece_bytes
            newlines += chunk.count(b"\n")
            pos += len(chunk)
    cuts = [c for c in cuts if c[0] < pos] or [(0, 1)]
    ends = [start for start, _ in cuts[1:]] + [pos]
    return [Piece(start, end, first) for (start, first), end in zip(cuts, ends)]


Source = bytes | Callable[[], BinaryIO]
"""A file's stored bytes, or a function opening them (a compressed file is read twice)."""
_GZIP = 16 + zlib.MAX_WBITS
_MEMBER_END = None  # marks a gzip member / zstd frame whose checks came out right


def iter_lines(
    path: str, source: Source, chunk_bytes: int = CHUNK_BYTES, piece: Piece | None = None
) -> Iterator[RawMessage | tuple[int, str, str]]:
    """Split a file into messages, 1-based line numbers, reading it in chunks
    (memory holds a chunk and the line being read, never the whole file).

    gzip and zstd are recognised by their magic bytes and checked in a first
    pass, because they prove a member (frame) intact only at its end: a corrupt member yields none
    of its lines (they may be garbage), a truncated stream yields the lines
    before the cut.  The unreadable rest is one ``(line, raw, reason)`` tuple,
    which the caller quarantines.  Lines that are not UTF-8 are reported the
    same way.  ``piece``: only that piece of a plain file (``plan_pieces``).
    """
    open_stream = (lambda: io.BytesIO(source)) if isinstance(source, (bytes, bytearray)) else source
    if piece is not None:
        with open_stream() as stream:
            stream.seek(piece.start)
            yield from _split(path, _chunks_upto(stream, chunk_bytes, piece.end - piece.start), first_line=piece.first_line)
        return
    with open_stream() as stream:
        head = stream.read(chunk_bytes)
        while 0 < len(head) < 4:  # the zstd magic needs four bytes; a read may return fewer
            more = stream.read(chunk_bytes)
            if not more:
                break
            head += more
        codec = compression_of(head)
        if codec is None:
            yield from _split(path, _chunks(head, stream, chunk_bytes))
            return
        good, damage = _gzip_extent(_chunks(head, stream, chunk_bytes), codec)
    with open_stream() as stream:
        yield from _split(path, _readable(_inflate(_chunks(stream.read(chunk_bytes), stream, chunk_bytes), codec), good), damage)


def _split(
    path: str, chunks: Iterable[bytes], damage: str | None = None, first_line: int = 1
) -> Iterator[RawMessage | tuple[int, str, str]]:
    number = first_line - 1
    partial: list[bytes] = []  # the line being read, when it spans chunks
    for chunk in chunks:
        cut = chunk.find(b"\n")
        if cut < 0:
            partial.append(chunk)
            continue
        partial.append(chunk[:cut])
        lines = chunk[cut + 1 :].split(b"\n")
        lines[0:0] = [b"".join(partial)]
        partial = [lines.pop()]
        for raw in lines:
            number += 1
            item = _message(path, number, raw)
            if item is not None:
                yield item
    tail = b"".join(partial)
    if damage is not None:
        yield (number + 1, tail.decode("utf-8", "replace"), damage)
        return
    item = _message(path, number + 1, tail)
    if item is not None:
        yield item


def _message(path: str, number: int, raw: bytes) -> RawMessage | tuple[int, str, str] | None:
    if number == 1 and raw.startswith(UTF8_BOM):  # an encoding marker, not part of the first message
        raw = raw[len(UTF8_BOM) :]
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if not raw.strip():
        return None
    try:
        return RawMessage(path, number, raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return (number, raw.decode("utf-8", "replace"), f"line is not UTF-8: {exc}")


def line_message(path: str, number: int, raw: bytes) -> RawMessage | tuple[int, str, str] | None:
    """One line's bytes (without its newline) as ``iter_lines`` reads them:
    a message, a ``(line, raw, reason)`` for text that is not UTF-8, or None
    for a blank line (for readers that scan the buffers themselves)."""
    return _message(path, number, raw)


def _chunks(first: bytes, stream: BinaryIO, size: int) -> Iterator[bytes]:
    chunk = first
    while chunk:
        yield chunk
        chunk = stream.read(size)


def _chunks_upto(stream: BinaryIO, size: int, limit: int) -> Iterator[bytes]:
    while limit > 0 and (chunk := stream.read(min(size, limit))):
        limit -= len(chunk)
        yield chunk


class _Truncated(Exception):
    pass


def _decompressor(codec: str) -> Any:
    if codec == "gzip":
        return zlib.decompressobj(_GZIP)
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


def _damage_errors() -> tuple[type[Exception], ...]:
    """What a corrupt gzip member or zstd frame raises."""
    try:
        import zstandard
    except ImportError:  # pragma: no cover - pinned in requirements.txt
        return (zlib.error,)
    return (zlib.error, zstandard.ZstdError)


def _stream_errors() -> tuple[type[Exception], ...]:
    """A stream cut short, or what a corrupt member raises."""
    return (_Truncated, *_damage_errors())


def _inflate(chunks: Iterable[bytes], codec: str = "gzip") -> Iterator[bytes | None]:
    """Decompressed blocks of a gzip or zstd stream (concatenated members /
    frames too), and ``_MEMBER_END`` after each member that checked out.
    Raises ``zlib.error`` / ``ZstdError`` on corruption, ``_Truncated`` when
    the stream stops inside a member."""
    d, fed = _decompressor(codec), False
    for chunk in chunks:
        data = chunk
        while data:
            fed = True
            yield d.decompress(data)
            if not d.eof:
                break
            yield _MEMBER_END
            data, d, fed = d.unused_data, _decompressor(codec), False
    if fed:
        raise _Truncated


def _gzip_extent(chunks: Iterable[bytes], codec: str = "gzip") -> tuple[int | None, str | None]:
    """(readable bytes, reason) of a damaged gzip / zstd stream, (None, None) if intact:
    up to the cut of a truncated one, up to the start of a corrupt member."""
    total = verified = 0
    try:
        for block in _inflate(chunks, codec):
            if block is _MEMBER_END:
                verified = total
            else:
                total += len(block)
    except _Truncated:
        return total, f"truncated {codec} file: the stream ends before its end marker"
    except _damage_errors() as exc:
        return verified, f"corrupt {codec} file: {exc}"
    return None, None


def _readable(blocks: Iterable[bytes | None], limit: int | None) -> Iterator[bytes]:
    """The decompressed bytes, stopped at ``limit`` (None: all of them)."""
    left = limit
    try:
        for block in blocks:
            if block is _MEMBER_END or not block:
                continue
            if left is not None:
                block = block[:left]
                left -= len(block)
            yield block
            if left == 0:
                return
    except _stream_errors():
        if limit is None:  # pragma: no cover - the first pass read the same bytes
            raise
