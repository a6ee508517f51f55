"""The cdc_apply package as a zip for the Python workers of a cluster or a
Spark Connect server (rebuilt when a source file changed)."""

from __future__ import annotations

import zipfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The ``cdc_apply`` folder (this module lives in ``cdc_apply/runtime``)."""


def build_code_zip(dest_dir: Path) -> str:
    """Zip the cdc_apply package for Python workers (rebuilt when sources changed)."""
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    stamp = str(max((p.stat().st_mtime_ns for p in files), default=0))
    dest_dir.mkdir(parents=True, exist_ok=True)
    zpath = dest_dir / f"cdc_apply-{stamp}.zip"
    if not zpath.exists():
        tmp = zpath.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for p in files:
                z.write(p, p.relative_to(PACKAGE_DIR.parent).as_posix())
        tmp.replace(zpath)
    return str(zpath)
