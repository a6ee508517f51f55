"""Archives on an object store (S3-compatible), read with pyarrow.

An object store is configured when ``CDC_S3_ENDPOINT`` is set (an
S3-compatible server: MinIO, s3proxy, ...) or ``CDC_WAREHOUSE`` /
``CDC_ARCHIVE_DIR`` is an ``s3://`` / ``s3a://`` URI (``config.uses_object_store``).

Two clients, one store:

* the Iceberg catalog (Spark and pyiceberg) reads and writes table files with
  its own FileIO: Iceberg's ``S3FileIO`` on the JVM (AWS SDK v2, from the
  ``iceberg-aws-bundle`` jar), pyarrow's S3 file system in pyiceberg;
* archives are listed and fingerprinted on the driver
  (:func:`list_object_files`) and read by the decode tasks' Python workers
  (``archive.open_archive``), all with pyarrow's S3 file system.

Credentials are never written here nor into the Spark conf: every client reads
the AWS default chain (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, profiles, instance roles).  Only the endpoint, the
addressing style and the region are passed on.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Any
from urllib.parse import urlsplit

from cdc_apply.archive.files import ArchiveFile, Known
from cdc_apply.config import S3_SCHEMES, S3Options, scheme_of


def split_uri(uri: str) -> tuple[str, str]:
    """``s3a://bucket/prefix/`` -> (``s3a``, ``bucket/prefix``)."""
    scheme = scheme_of(uri)
    if scheme not in S3_SCHEMES:
        raise ValueError(f"{uri!r} is not an s3://, s3a:// or s3n:// URI")
    rest = str(uri).split("://", 1)[1].strip("/")
    if not rest:
        raise ValueError(f"{uri!r} names no bucket")
    return scheme, rest


def s3_filesystem(options: S3Options | None = None) -> Any:
    """pyarrow's S3 file system for the configured store (credentials: the AWS
    default chain, read by the AWS SDK itself)."""
    from pyarrow import fs as pafs

    options = options or S3Options.from_env()
    kwargs: dict = {"force_virtual_addressing": not options.path_style}
    if options.endpoint:
        parts = urlsplit(options.endpoint if "://" in options.endpoint else f"https://{options.endpoint}")
        kwargs["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        kwargs["scheme"] = parts.scheme or "https"
    if options.region:
        kwargs["region"] = options.region
    return pafs.S3FileSystem(**kwargs)


def sha256_of_object(filesystem: Any, key: str) -> str:
    """SHA-256 of the object's bytes as stored (``compression=None``: pyarrow
    would otherwise gunzip a ``.gz`` object while reading it)."""
    from cdc_apply.errors import ArchiveUnreadable

    h = hashlib.sha256()
    try:
        with filesystem.open_input_stream(key, compression=None) as stream:
            while True:
                chunk = stream.read(1 << 20)
                if not chunk:
                    break
                h.update(chunk)
    except OSError as exc:
        raise ArchiveUnreadable(f"archive object {key} cannot be read: {type(exc).__name__}: {exc}") from exc
    return h.hexdigest()


def list_object_files(
    root: str, *, since: dt.datetime | None = None, until: dt.datetime | None = None, filesystem: Any = None, known: Known | None = None
) -> list[ArchiveFile]:
    """Archive files under an ``s3://`` / ``s3a://`` prefix whose hour is in
    [since, until), oldest first — the object-store twin of
    ``archive.list_files`` with the same rules: archive suffixes only, names
    starting with '.' or '_' skipped, the hour from ``YYYY/MM/DD/HH/`` or
    ``dt=YYYY-MM-DD/hour=HH/`` in the path below ``root``, else from the
    object's modification time.  ``path`` keeps ``root``'s scheme (what the
    ledger records); size and SHA-256 come from the object itself, or the SHA-256 from
    ``known`` (see ``archive.list_files``)."""
    from pyarrow import fs as pafs

    from cdc_apply.archive.files import SUFFIXES, ArchiveFile, hour_of, known_sha256, refuse_unread, unread_compression

    scheme, prefix = split_uri(root)
    filesystem = filesystem or s3_filesystem()
    if "/" not in prefix:
        # a bare bucket: list it, but a missing bucket is an empty archive
        info = filesystem.get_file_info(prefix)
        if info.type == pafs.FileType.NotFound:
            return []
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
    except OSError as exc:  # a listing that fails must fail the run, never shrink the file list
        from cdc_apply.errors import ArchiveUnreadable

        raise ArchiveUnreadable(f"archive prefix {root} cannot be listed: {type(exc).__name__}: {exc}") from exc
    out = []
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        name = info.base_name
        readable = name.endswith(SUFFIXES)
        if (not readable and not unread_compression(name)) or name.startswith((".", "_")):
            continue
        relative = info.path[len(prefix) :].lstrip("/")
        hour = hour_of(relative, info.mtime)
        if until is not None and hour >= until:
            continue
        if since is not None and hour < since:
            continue
        if not readable:
            refuse_unread(f"{scheme}://{info.path}")
        path, size = f"{scheme}://{info.path}", int(info.size)
        out.append(
            ArchiveFile(hour=hour, path=path, size=size, sha256=known_sha256(known, path, size) or sha256_of_object(filesystem, info.path))
        )
    return sorted(out)
