"""The archive: files of JSON lines (optionally gzip or zstd) written by a CDC sink.

Layout and interval mapping
---------------------------
Files live under ``<archive_dir>/<source>/``.  A file belongs to the hour
written in its path as object-store sinks write it —
``YYYY/MM/DD/HH/`` or ``dt=YYYY-MM-DD/hour=HH/`` — and, when the path carries
no hour, to the hour of its modification time (UTC).  A scheduled run applies
every not-yet-applied file whose hour is *before its interval's end*, so a file
that lands late is picked up by the next run and never lost.

Each file is fingerprinted (size + SHA-256): the ledger records the
fingerprint, and a file whose content changed after it was applied is refused.
"""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import io
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, Mapping, Union

from .model import RawMessage

if TYPE_CHECKING:
    from .storage import S3Options

_HOUR_PATTERNS = (
    re.compile(r"(?P<y>\d{4})/(?P<m>\d{2})/(?P<d>\d{2})/(?P<h>\d{2})(?:/|$)"),
    re.compile(r"dt=(?P<y>\d{4})-(?P<m>\d{2})-(?P<d>\d{2})/hour=(?P<h>\d{2})(?:/|$)"),
)
_PLAIN = (".json", ".jsonl", ".ndjson", ".txt")
SUFFIXES = tuple(p + c for c in ("", ".gz", ".zst") for p in _PLAIN)
"""What the listing reads: JSON lines, plain, gzip or zstd (the compressions
the sinks write: Kafka Connect's and CockroachDB's ``compression``)."""
UNREAD_COMPRESSIONS = (".bz2", ".xz", ".lz4", ".snappy", ".sz", ".br", ".zip", ".deflate", ".zstd", ".lzo")
"""A JSON-lines file compressed another way is refused loudly by the listing
(``refuse_unread``): skipping a file a sink wrote would lose it."""


def unread_compression(name: str) -> str | None:
    """The compression suffix of a file named as JSON lines under a
    compression the reader does not read (``x.ndjson.bz2`` -> ``.bz2``)."""
    lower = name.lower()
    for plain in _PLAIN:
        i = lower.rfind(plain + ".")
        if i >= 0 and lower[i + len(plain):] in UNREAD_COMPRESSIONS:
            return lower[i + len(plain):]
    return None


def refuse_unread(path: str) -> None:
    """Refuse (``UnreadableCompression``, terminal) a listed file whose
    compression is not read: leaving it out would lose its changes without
    a word, reading it would quarantine it as garbage."""
    from .errors import UnreadableCompression

    raise UnreadableCompression(
        f"archive file {path} is compressed as {unread_compression(path.rsplit('/', 1)[-1])!r}, which is not read: "
        "have the sink write plain, gzip (.gz) or zstd (.zst) files, or convert the file (nothing was applied)"
    )


@dataclass(frozen=True, order=True)
class ArchiveFile:
    hour: dt.datetime  # start of the hour the file belongs to (UTC)
    path: str
    size: int
    sha256: str

    def as_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    def manifest_entry(self) -> dict:
        """One entry of the ``--files-from`` manifest discovery writes."""
        return {**self.as_dict(), "hour": self.hour.isoformat()}

    @classmethod
    def from_manifest_entry(cls, entry: dict) -> "ArchiveFile":
        return cls(hour=dt.datetime.fromisoformat(entry["hour"]), path=entry["path"], size=int(entry["size"]), sha256=entry["sha256"])


def write_manifest(path: Path, files: list[ArchiveFile]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([f.manifest_entry() for f in files], indent=1))
    return path


def read_manifest(path: str | Path) -> list[ArchiveFile]:
    return [ArchiveFile.from_manifest_entry(e) for e in json.loads(Path(path).read_text())]


def hour_of(relative: str, mtime: dt.datetime | None = None) -> dt.datetime:
    """The hour a file belongs to: from its path below the source folder, else
    from its modification time (UTC; now when unknown)."""
    for pattern in _HOUR_PATTERNS:
        found = list(pattern.finditer(relative))
        if found:
            g = found[-1].groupdict()
            return dt.datetime(int(g["y"]), int(g["m"]), int(g["d"]), int(g["h"]), tzinfo=dt.timezone.utc)
    if mtime is None:
        mtime = dt.datetime.now(dt.timezone.utc)
    if mtime.tzinfo is None:
        mtime = mtime.replace(tzinfo=dt.timezone.utc)
    return mtime.astimezone(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)


def sha256_of(path: Path) -> str:
    """SHA-256 of a local file; ArchiveUnreadable (transient) names the file
    when it cannot be read."""
    from .errors import ArchiveUnreadable

    h = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise ArchiveUnreadable(f"archive file {path} cannot be read: {type(exc).__name__}: {exc.strerror or exc}") from exc
    return h.hexdigest()


def walk_files(root: Path) -> Iterator[Path]:
    """Every file below ``root``.  A folder that cannot be listed fails the
    listing (ArchiveUnreadable, naming it): ``Path.rglob`` skips it silently,
    and a shorter file list would apply later hours without its files."""
    import os

    from .errors import ArchiveUnreadable

    def fail(exc: OSError) -> None:
        raise ArchiveUnreadable(f"archive folder {exc.filename} cannot be listed: {type(exc).__name__}: {exc.strerror or exc}") from exc

    for folder, _, names in os.walk(root, onerror=fail):
        for name in names:
            yield Path(folder) / name


Known = Mapping[str, tuple[int, str]]
"""path -> (size, sha256) of files fingerprinted before (the applied ones)."""


def known_sha256(known: Known | None, path: str, size: int) -> str | None:
    """The recorded SHA-256 of ``path`` when its size is unchanged: an archive
    is not read again every hour just to learn it did not change."""
    entry = known.get(path) if known else None
    return entry[1] if entry is not None and entry[0] == size else None


def list_files(root: str | Path, *, until: dt.datetime | None = None, since: dt.datetime | None = None, known: Known | None = None) -> list[ArchiveFile]:
    """Archive files under ``root`` whose hour is in [since, until), oldest first.
    ``s3://`` / ``s3a://`` roots are listed on the object store (same rules).
    Files in ``known`` with their recorded size keep their recorded SHA-256;
    every other file is read and hashed."""
    from .storage import is_object_store_uri, list_object_files

    if is_object_store_uri(root):
        return list_object_files(str(root), since=since, until=until, known=known)
    root = Path(str(root).removeprefix("file://"))
    if not root.exists():
        return []
    out = []
    for path in walk_files(root):
        if not path.is_file() or path.name.startswith((".", "_")):
            continue
        readable = path.name.endswith(SUFFIXES)
        if not readable and not unread_compression(path.name):
            continue
        hour = local_hour(path, root)
        if until is not None and hour >= until:
            continue
        if since is not None and hour < since:
            continue
        if not readable:
            refuse_unread(str(path))
        resolved, size = str(path.resolve()), path.stat().st_size
        out.append(ArchiveFile(hour=hour, path=resolved, size=size, sha256=known_sha256(known, resolved, size) or sha256_of(path)))
    return sorted(out)


def local_hour(path: Path, root: Path | None = None) -> dt.datetime:
    """The hour of a local file: from its path below ``root`` (below its
    source folder: the last ``YYYY/MM/DD/HH`` wins), else its mtime."""
    relative = path.relative_to(root) if root is not None else path
    return hour_of(relative.as_posix(), dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.timezone.utc))


def fingerprint(path: Path) -> ArchiveFile:
    """An ArchiveFile for one local file (its hour from its path or mtime)."""
    return ArchiveFile(hour=local_hour(path), path=str(path.resolve()), size=path.stat().st_size, sha256=sha256_of(path))


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


def open_archive(path: str, s3: "S3Options | None" = None) -> BinaryIO:
    """A binary stream of an archive file's stored bytes: a local path (or
    ``file:`` URI), or an ``s3://`` / ``s3a://`` object read with pyarrow
    (``s3``: the store's endpoint and region, from the driver)."""
    from .storage import S3Options, is_object_store_uri, s3_filesystem, split_uri

    if is_object_store_uri(path):
        return s3_filesystem(s3 or S3Options.from_env()).open_input_stream(split_uri(path)[1], compression=None)
    return open(local_path(path), "rb")


def local_path(uri: str) -> str:
    """``file:/x`` and ``file:///x`` -> ``/x``; anything else unchanged."""
    return uri[len("file:"):] if uri.startswith("file:") and not uri.startswith("file://") else uri.removeprefix("file://")


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


Source = Union[bytes, Callable[[], BinaryIO]]
"""A file's stored bytes, or a function opening them (a compressed file is read twice)."""
_GZIP = 16 + zlib.MAX_WBITS
_MEMBER_END = None  # marks a gzip member / zstd frame whose checks came out right


def iter_lines(path: str, source: Source, chunk_bytes: int = CHUNK_BYTES, piece: Piece | None = None) -> Iterator[RawMessage | tuple[int, str, str]]:
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


def _split(path: str, chunks: Iterable[bytes], damage: str | None = None, first_line: int = 1) -> Iterator[RawMessage | tuple[int, str, str]]:
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
        raw = raw[len(UTF8_BOM):]
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if not raw.strip():
        return None
    try:
        return RawMessage(path, number, raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return (number, raw.decode("utf-8", "replace"), f"line is not UTF-8: {exc}")


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
    except (_Truncated, *_damage_errors()):
        if limit is None:  # pragma: no cover - the first pass read the same bytes
            raise


def write_jsonl(path: Path, lines: list[str], *, compress: bool | str = False) -> Path:
    """Write an archive file (used by the demo, tests and the benchmark);
    ``compress``: True or ``'gzip'``, or ``'zstd'``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = ("\n".join(lines) + "\n").encode()
    if compress == "zstd":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(payload))
    elif compress:
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path
