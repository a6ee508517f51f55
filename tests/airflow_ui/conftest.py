"""The plugin package (plugins/cdc_airflow) importable in these tests, as
Airflow makes it importable from its plugins folder."""

from __future__ import annotations

import sys
from pathlib import Path

PLUGINS = str(Path(__file__).resolve().parents[2] / "plugins")
if PLUGINS not in sys.path:
    sys.path.insert(0, PLUGINS)
