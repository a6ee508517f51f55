"""Lay Debezium's records out as a Kafka Connect file / object-store sink does.

One topic per table (``<prefix>.<schema>.<table>``), a simulated Kafka
partition per record chosen by a hash of the key JSON (so one key's records
stay in order in one partition, as Kafka keeps them), and per topic,
partition and hour a file ``<topic>/YYYY/MM/DD/HH/<topic>+<partition>+<start
offset>.json[.gz]`` holding the record values, one JSON per line.  A file is
closed (rolled) after ``roll_every`` records; some partitions write gzip.  A
Kafka tombstone (null value after a delete) is the line ``null``.
"""

from __future__ import annotations

import datetime as dt
import gzip
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


@dataclass
class _OpenFile:
    path: Path
    handle: IO[bytes]
    count: int = 0


@dataclass
class ArchiveSink:
    root: Path
    partitions: int = 3
    roll_every: int = 25
    gzip_partitions: frozenset[int] = frozenset({1})
    hour: dt.datetime = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    files: dict[tuple[str, int], _OpenFile] = field(default_factory=dict)
    written: list[tuple[dt.datetime, Path]] = field(default_factory=list)
    lines: int = 0

    def partition_of(self, key: str | None) -> int:
        return zlib.crc32((key or "").encode()) % self.partitions

    def write(self, topic: str, key: str | None, value: str | None) -> None:
        """One record: its value JSON (``null`` for a tombstone) as one line."""
        part = self.partition_of(key)
        offset = self.offsets.get((topic, part), 0)
        f = self.files.get((topic, part))
        if f is None:
            folder = self.root / topic / self.hour.strftime("%Y/%m/%d/%H")
            folder.mkdir(parents=True, exist_ok=True)
            gz = part in self.gzip_partitions
            path = folder / f"{topic}+{part}+{offset:010d}.json{'.gz' if gz else ''}"
            handle = gzip.open(path, "wb") if gz else path.open("wb")
            f = self.files[(topic, part)] = _OpenFile(path, handle)
            self.written.append((self.hour, path))
        f.handle.write((value if value is not None else "null").encode() + b"\n")
        f.count += 1
        self.lines += 1
        self.offsets[(topic, part)] = offset + 1
        if f.count >= self.roll_every:
            self._close(topic, part)

    def _close(self, topic: str, part: int) -> None:
        f = self.files.pop((topic, part))
        f.handle.close()

    def close_hour(self) -> None:
        """Close every open file and move on to the next hour."""
        for topic, part in list(self.files):
            self._close(topic, part)
        self.hour += dt.timedelta(hours=1)
