"""Listing a source's archive: local folders here, object stores through
``object_store``; both give the same ``ArchiveFile`` list, oldest first."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cdc_apply.archive.files import SUFFIXES, ArchiveFile, Known, hour_of, known_sha256, refuse_unread, unread_compression


def sha256_of(path: Path) -> str:
    """SHA-256 of a local file; ArchiveUnreadable (transient) names the file
    when it cannot be read."""
    from cdc_apply.errors import ArchiveUnreadable

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

    from cdc_apply.errors import ArchiveUnreadable

    def fail(exc: OSError) -> None:
        raise ArchiveUnreadable(f"archive folder {exc.filename} cannot be listed: {type(exc).__name__}: {exc.strerror or exc}") from exc

    for folder, _, names in os.walk(root, onerror=fail):
        for name in names:
            yield Path(folder) / name


def list_files(
    root: str | Path, *, until: dt.datetime | None = None, since: dt.datetime | None = None, known: Known | None = None
) -> list[ArchiveFile]:
    """Archive files under ``root`` whose hour is in [since, until), oldest first.
    ``s3://`` / ``s3a://`` roots are listed on the object store (same rules).
    Files in ``known`` with their recorded size keep their recorded SHA-256;
    every other file is read and hashed."""
    from cdc_apply.archive.object_store import list_object_files
    from cdc_apply.config import is_object_store_uri

    if is_object_store_uri(root):
        return list_object_files(str(root), since=since, until=until, known=known)
    root = Path(str(root).removeprefix("file://"))
    if not root.exists():
        return []
    out = []
    for path in walk_files(root):
        if path.name.startswith((".", "_")):
            continue
        readable = path.name.endswith(SUFFIXES)
        if not readable and not unread_compression(path.name):
            continue
        if not path.is_file():
            refuse_dangling(path)
            continue  # a folder, pipe or socket named like an archive file
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


def archive_file_exists(path: str, filesystem: Any = None) -> bool:
    """Whether the archive still has the file ``path`` (as ``list_files``
    recorded it: a local path, or an object-store URI).  A store that cannot
    be asked fails (ArchiveUnreadable): never taken for a file that is gone."""
    from cdc_apply.config import is_object_store_uri

    if not is_object_store_uri(path):
        return Path(path).exists()
    from pyarrow import fs as pafs

    from cdc_apply.archive.object_store import s3_filesystem, split_uri
    from cdc_apply.errors import ArchiveUnreadable

    try:
        info = (filesystem or s3_filesystem()).get_file_info(split_uri(path)[1])
        return bool(info.type != pafs.FileType.NotFound)
    except OSError as exc:
        raise ArchiveUnreadable(f"archive object {path} cannot be looked up: {type(exc).__name__}: {exc}") from exc


def refuse_dangling(path: Path) -> None:
    """A link whose target is gone fails the listing (ArchiveUnreadable,
    naming both): ``is_file()`` is false for it, and leaving it out would
    apply later hours without the file it stands for."""
    import os

    from cdc_apply.errors import ArchiveUnreadable

    if path.is_symlink() and not path.exists():
        raise ArchiveUnreadable(
            f"archive file {path} cannot be read: it is a link to {os.readlink(path)!r}, which does not exist "
            "(restore the target, or remove the link if the file was never meant to be applied)"
        )


def local_hour(path: Path, root: Path | None = None) -> dt.datetime:
    """The hour of a local file: from its path below ``root`` (below its
    source folder: the last ``YYYY/MM/DD/HH`` wins), else its mtime."""
    relative = path.relative_to(root) if root is not None else path
    return hour_of(relative.as_posix(), dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.UTC))


def fingerprint(path: Path) -> ArchiveFile:
    """An ArchiveFile for one local file (its hour from its path or mtime)."""
    return ArchiveFile(hour=local_hour(path), path=str(path.resolve()), size=path.stat().st_size, sha256=sha256_of(path))
