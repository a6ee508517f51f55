"""Shared fixtures: one local SparkSession with the Iceberg runtime for the
whole test session, on a temporary CDC_HOME (catalog, warehouse, archive)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cdc_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("cdc_home")
    os.environ["CDC_HOME"] = str(home)
    os.environ.setdefault("CDC_JARS_DIR", str(ROOT / ".cdc" / "jars"))
    os.environ["CDC_SOURCES_FILE"] = str(ROOT / "include" / "sources.yaml")
    os.environ.setdefault("CDC_SPARK_MASTER", "local[2]")
    return home


@pytest.fixture(scope="session")
def settings(cdc_home):
    from cdc_apply.config import Settings

    return Settings.from_env()


@pytest.fixture(scope="session")
def spark(settings):
    from cdc_apply.runtime.session import get_spark

    session = get_spark(settings, app_name="cdc-tests")
    yield session
    session.stop()
