"""The trigger form's choices, read from the sources file the job reads
(``$CDC_SOURCES_FILE``, default include/sources.yaml) when the DAG is parsed."""

from __future__ import annotations

import os
from pathlib import Path

from airflow.sdk import Param

SOURCES_FILE = Path(__file__).resolve().parents[2] / "include" / "sources.yaml"


def source_choices(path: str | Path | None = None) -> dict[str, str]:
    """name -> label (``pg_inventory (debezium_postgres)``); empty when the
    file cannot be read (discover then reports the file's problem)."""
    import yaml

    path = Path(path or os.environ.get("CDC_SOURCES_FILE") or SOURCES_FILE)
    try:
        sources = (yaml.safe_load(path.read_text()) or {}).get("sources") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return {}
    return {str(name): f"{name} ({(spec or {}).get('format', '?')})" for name, spec in sources.items()}


def source_param(default: str) -> Param:
    """A drop-down of the configured sources (free text if none can be read)."""
    choices = source_choices()
    if not choices:
        return Param(default, type="string", description="source name from include/sources.yaml")
    if default not in choices:
        default = next(iter(choices))
    return Param(default, type="string", enum=list(choices), values_display=choices, description="a source of include/sources.yaml")
