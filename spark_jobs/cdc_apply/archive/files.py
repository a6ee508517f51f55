"""Archive files: the file model every stage shares.

Files live under ``<archive_dir>/<source>/``.  A file belongs to the hour
written in its path as object-store sinks write it --
``YYYY/MM/DD/HH/`` or ``dt=YYYY-MM-DD/hour=HH/`` -- and, when the path carries
no hour, to the hour of its modification time (UTC).  A scheduled run applies
every not-yet-applied file whose hour is *before its interval's end*, so a file
that lands late is picked up by the next run and never lost.

Each file is fingerprinted (size + SHA-256): the ledger records the
fingerprint, and a file whose content changed after it was applied is refused.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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
        if i >= 0 and lower[i + len(plain) :] in UNREAD_COMPRESSIONS:
            return lower[i + len(plain) :]
    return None


def refuse_unread(path: str) -> None:
    """Refuse (``UnreadableCompression``, terminal) a listed file whose
    compression is not read: leaving it out would lose its changes without
    a word, reading it would quarantine it as garbage."""
    from cdc_apply.errors import UnreadableCompression

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
    def from_manifest_entry(cls, entry: dict) -> ArchiveFile:
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
            return dt.datetime(int(g["y"]), int(g["m"]), int(g["d"]), int(g["h"]), tzinfo=dt.UTC)
    if mtime is None:
        mtime = dt.datetime.now(dt.UTC)
    if mtime.tzinfo is None:
        mtime = mtime.replace(tzinfo=dt.UTC)
    return mtime.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)


Known = Mapping[str, tuple[int, str]]
"""path -> (size, sha256) of files fingerprinted before (the applied ones)."""


def known_sha256(known: Known | None, path: str, size: int) -> str | None:
    """The recorded SHA-256 of ``path`` when its size is unchanged: an archive
    is not read again every hour just to learn it did not change."""
    entry = known.get(path) if known else None
    return entry[1] if entry is not None and entry[0] == size else None


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
