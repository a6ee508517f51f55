"""Shared fixtures: one local SparkSession with the Iceberg runtime for the
whole test session, on a temporary CDC_HOME (catalog, warehouse, archive)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sample import FULL

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
    """The worker's session, its JVM with the C1-only JIT of a short-lived
    driver (``DRIVER_JAVA_OPTIONS``): CI runs three workers on two cores, so
    C2's compiler threads take their share of the cores from the tests.  15
    rule tests: 292 s of JVM CPU with C2, ~212 s without, the same wall time
    on an idle machine (bench/README, step 39).  The JIT tier changes no
    result; the product's own drivers keep their own choice."""
    from dataclasses import replace

    from cdc_apply.runtime.class_archive import JAVA_OPTIONS
    from cdc_apply.runtime.session import get_spark
    from cdc_apply.runtime.spark_conf import DRIVER_JAVA_OPTIONS

    conf = {JAVA_OPTIONS: DRIVER_JAVA_OPTIONS, **settings.extra_spark_conf}  # a CDC_SPARK_CONF_ of the user's wins
    session = get_spark(replace(settings, extra_spark_conf=conf), app_name="cdc-tests")
    yield session
    session.stop()


LONGEST_FIRST = [
    "tests/test_apply_rules.py",
    "tests/test_nemesis.py",
    "tests/test_spark_cluster.py",
    "tests/test_e2e_standalone.py",
    "tests/test_gate.py",
    "tests/airflow_ui/test_operator_ui.py",
    "tests/test_apply_property.py",
    "tests/test_benchmark_runs.py",
    "tests/test_e2e_dag_runner.py",
    "tests/test_history.py",
    "tests/test_warm_driver.py",
    "tests/test_transactions.py",
    "tests/test_realsource_postgres.py",
    "tests/test_probe_apply.py",
    "tests/test_spark_connect.py",
]
"""The test files that take longest, longest first (CI's sample at 5f7031b:
each file's test seconds from ``CDC_TEST_TIMINGS``).  ``./dev test`` hands
files to its workers in this order, then the rest as collected
(``--no-loadscope-reorder``): xdist's own order, by number of tests, started
the one-test benchmark last, and it ran alone for the suite's last 25
minutes."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files keep their own order
    if not FULL:
        skip = pytest.mark.skip(reason="the full suite's (CDC_TEST_FULL=1 ./dev test): CI's sample runs the path it repeats")
        for item in items:
            if "full" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append each test phase's outcome and seconds to ``$CDC_TEST_TIMINGS``
    as it ends: a run cut off by CI's time limit prints no ``--durations``
    table, and this file still says which tests took the time and which
    failed.  Written by the controller only (xdist's workers hand it every
    report)."""
    path = os.environ.get("CDC_TEST_TIMINGS")
    if not path or "PYTEST_XDIST_WORKER" in os.environ or (report.when != "call" and report.outcome == "passed" and report.duration < 1):
        return
    with open(path, "a", encoding="utf-8") as out:
        out.write(f"{report.duration:9.1f} {report.outcome:8} {report.when:8} {report.nodeid}\n")
