"""The cdc_apply package as a zip for the Python workers of a cluster or a
Spark Connect server (rebuilt when a source file changed)."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The ``cdc_apply`` folder (this module lives in ``cdc_apply/runtime``)."""


def build_code_zip(dest_dir: Path) -> str:
    """Zip the cdc_apply package for Python workers (rebuilt when sources changed).

    Tasks of several sources start at once on one host and share the folder:
    each writes its own temporary file and renames it into place (atomic, and
    every writer's zip of the same sources is equally good)."""
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    stamp = str(max((p.stat().st_mtime_ns for p in files), default=0))
    dest_dir.mkdir(parents=True, exist_ok=True)
    zpath = dest_dir / f"cdc_apply-{stamp}.zip"
    if not zpath.exists():
        fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=f"{zpath.stem}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
                for p in files:
                    z.write(p, p.relative_to(PACKAGE_DIR.parent).as_posix())
            os.replace(tmp, zpath)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return str(zpath)
