"""Object storage (S3-compatible) for the archive and the warehouse.

The embedded default uses local files and needs nothing here: every function
returns "nothing to add" unless an object store is configured, i.e.

* ``CDC_S3_ENDPOINT`` is set (an S3-compatible server: MinIO, s3proxy, ...), or
* ``CDC_WAREHOUSE`` or ``CDC_ARCHIVE_DIR`` is an ``s3://`` / ``s3a://`` URI.

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
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .config import Settings, spark_home

S3_SCHEMES = ("s3", "s3a", "s3n")
S3_FILE_IO = "org.apache.iceberg.aws.s3.S3FileIO"

# -- what is configured ----------------------------------------------------------


def scheme_of(uri: str | os.PathLike | None) -> str:
    """The URI scheme in lower case ('' for a plain path)."""
    text = str(uri or "")
    if "://" not in text:
        return ""
    return text.split("://", 1)[0].lower()


def is_object_store_uri(uri: str | os.PathLike | None) -> bool:
    return scheme_of(uri) in S3_SCHEMES


def s3_endpoint() -> str | None:
    """``CDC_S3_ENDPOINT`` (e.g. http://127.0.0.1:9000); None for AWS itself."""
    value = os.environ.get("CDC_S3_ENDPOINT", "").strip()
    return value or None


def s3_path_style() -> bool:
    """``S3Options.path_style`` of the configured store."""
    return S3Options.from_env().path_style


def s3_region() -> str | None:
    value = os.environ.get("AWS_REGION", "").strip()
    return value or None


def warehouse_on_object_store(settings: Settings) -> bool:
    return is_object_store_uri(settings.warehouse)


def archive_on_object_store(settings: Settings) -> bool:
    return is_object_store_uri(settings.archive_dir)


def uses_object_store(settings: Settings) -> bool:
    return s3_endpoint() is not None or warehouse_on_object_store(settings) or archive_on_object_store(settings)


# -- Spark -------------------------------------------------------------------------


def object_store_conf(settings: Settings) -> dict[str, str]:
    """Spark conf for an S3 warehouse (Iceberg S3FileIO); empty for local
    files.  ``CDC_SPARK_CONF_*`` still overrides any of these
    (spark_session.iceberg_conf applies it last)."""
    if not uses_object_store(settings):
        return {}
    cat = f"spark.sql.catalog.{settings.catalog_name}"
    endpoint = s3_endpoint()
    path_style = "true" if s3_path_style() else "false"
    region = s3_region()
    conf: dict[str, str] = {}

    # Iceberg catalog: table files through S3FileIO (default AWS credential chain).
    if warehouse_on_object_store(settings):
        conf[f"{cat}.io-impl"] = S3_FILE_IO
    if endpoint:
        conf[f"{cat}.s3.endpoint"] = endpoint
    conf[f"{cat}.s3.path-style-access"] = path_style
    if region:
        conf[f"{cat}.client.region"] = region
    return conf


def extra_jar_coordinates(settings: Settings) -> tuple[str, ...]:
    """Maven coordinates of the jars the object store needs on top of
    ``config.JARS`` (fetched by ``./dev setup`` into CDC_JARS_DIR):
    iceberg-aws-bundle for S3FileIO.  A jar already on Spark's own class path
    (``pyspark/jars``, as the Docker image installs iceberg-aws-bundle) is not
    added again."""
    from .config import S3_JARS

    if not uses_object_store(settings):
        return ()
    spark_jars = _spark_jars_dir()
    out = []
    for coord in S3_JARS:
        _, artifact, version = coord.split(":")
        if spark_jars is not None and (spark_jars / f"{artifact}-{version}.jar").exists():
            continue
        out.append(coord)
    return tuple(out)


def _spark_jars_dir() -> Path | None:
    path = spark_home() / "jars"
    return path if path.is_dir() else None


# -- archives on the object store (driver side, pyarrow) ---------------------------


def split_uri(uri: str) -> tuple[str, str]:
    """``s3a://bucket/prefix/`` -> (``s3a``, ``bucket/prefix``)."""
    scheme = scheme_of(uri)
    if scheme not in S3_SCHEMES:
        raise ValueError(f"{uri!r} is not an s3://, s3a:// or s3n:// URI")
    rest = str(uri).split("://", 1)[1].strip("/")
    if not rest:
        raise ValueError(f"{uri!r} names no bucket")
    return scheme, rest


@dataclass(frozen=True)
class S3Options:
    """Where the object store is, as the driver sees it (``CDC_S3_ENDPOINT``,
    ``AWS_REGION``): shipped to executors, whose environment may lack them.
    Credentials are not in it: each process reads the AWS default chain."""

    endpoint: str | None = None
    region: str | None = None

    @property
    def path_style(self) -> bool:
        """Path-style addressing (http://host/bucket/key) with a custom endpoint,
        as S3-compatible servers expect; virtual-hosted style on AWS itself."""
        return self.endpoint is not None

    @classmethod
    def from_env(cls) -> "S3Options":
        return cls(endpoint=s3_endpoint(), region=s3_region())


def s3_filesystem(options: S3Options | None = None):
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


def sha256_of_object(filesystem, key: str) -> str:
    """SHA-256 of the object's bytes as stored (``compression=None``: pyarrow
    would otherwise gunzip a ``.gz`` object while reading it)."""
    from .errors import ArchiveUnreadable

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


def list_object_files(root: str, *, since: dt.datetime | None = None, until: dt.datetime | None = None, filesystem=None, known=None):
    """Archive files under an ``s3://`` / ``s3a://`` prefix whose hour is in
    [since, until), oldest first — the object-store twin of
    ``archive.list_files`` with the same rules: archive suffixes only, names
    starting with '.' or '_' skipped, the hour from ``YYYY/MM/DD/HH/`` or
    ``dt=YYYY-MM-DD/hour=HH/`` in the path below ``root``, else from the
    object's modification time.  ``path`` keeps ``root``'s scheme (what the
    ledger records); size and SHA-256 come from the object itself, or the SHA-256 from
    ``known`` (see ``archive.list_files``)."""
    from pyarrow import fs as pafs

    from .archive import SUFFIXES, ArchiveFile, hour_of, known_sha256, refuse_unread, unread_compression

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
        from .errors import ArchiveUnreadable

        raise ArchiveUnreadable(f"archive prefix {root} cannot be listed: {type(exc).__name__}: {exc}") from exc
    out = []
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        name = info.base_name
        readable = name.endswith(SUFFIXES)
        if (not readable and not unread_compression(name)) or name.startswith((".", "_")):
            continue
        relative = info.path[len(prefix):].lstrip("/")
        hour = hour_of(relative, info.mtime)
        if until is not None and hour >= until:
            continue
        if since is not None and hour < since:
            continue
        if not readable:
            refuse_unread(f"{scheme}://{info.path}")
        path, size = f"{scheme}://{info.path}", int(info.size)
        out.append(ArchiveFile(hour=hour, path=path, size=size, sha256=known_sha256(known, path, size) or sha256_of_object(filesystem, info.path)))
    return sorted(out)
