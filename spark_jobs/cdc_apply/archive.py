"""The archive: files of JSON lines (optionally gzip) written by a CDC sink.

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
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from .model import RawMessage

_HOUR_PATTERNS = (
    re.compile(r"(?P<y>\d{4})/(?P<m>\d{2})/(?P<d>\d{2})/(?P<h>\d{2})(?:/|$)"),
    re.compile(r"dt=(?P<y>\d{4})-(?P<m>\d{2})-(?P<d>\d{2})/hour=(?P<h>\d{2})(?:/|$)"),
)
SUFFIXES = (".json", ".jsonl", ".ndjson", ".json.gz", ".jsonl.gz", ".ndjson.gz", ".txt", ".txt.gz")


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
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    for path in root.rglob("*"):
        if not path.is_file() or not path.name.endswith(SUFFIXES) or path.name.startswith((".", "_")):
            continue
        hour = local_hour(path, root)
        if until is not None and hour >= until:
            continue
        if since is not None and hour < since:
            continue
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


def iter_lines(path: str, content: bytes) -> Iterator[RawMessage | tuple[int, str, str]]:
    """Split a file's bytes into messages, 1-based line numbers.

    gzip is recognised by its magic bytes.  A truncated or corrupt gzip stream
    yields every complete line before the damage, then one ``(line, raw,
    reason)`` tuple for the damaged tail, which the caller quarantines.  Lines
    that are not UTF-8 are reported the same way.
    """
    data = content
    tail_error = None
    if content[:2] == b"\x1f\x8b":
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        chunks = []
        try:
            pos = 0
            while pos < len(content):
                chunks.append(d.decompress(content[pos : pos + (1 << 20)]))
                pos += 1 << 20
                if d.eof and d.unused_data:
                    # concatenated gzip members
                    rest = d.unused_data
                    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    chunks.append(d.decompress(rest))
            if not d.eof:
                tail_error = "truncated gzip file: the stream ends before its end marker"
        except zlib.error as exc:
            tail_error = f"corrupt gzip file: {exc}"
        data = b"".join(chunks)
    lines = data.split(b"\n")
    complete = lines if tail_error is None else lines[:-1]
    for number, raw in enumerate(complete, start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw.strip():
            continue
        try:
            yield RawMessage(path, number, raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            yield (number, raw.decode("utf-8", "replace"), f"line is not UTF-8: {exc}")
    if tail_error is not None:
        yield (len(lines), lines[-1].decode("utf-8", "replace"), tail_error)


def write_jsonl(path: Path, lines: list[str], *, compress: bool = False) -> Path:
    """Write an archive file (used by the demo, tests and the benchmark)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = ("\n".join(lines) + "\n").encode()
    if compress:
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path
