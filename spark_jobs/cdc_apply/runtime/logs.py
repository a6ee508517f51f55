"""How the job logs: the project's own lines at their real level, third-party
chatter (Great Expectations' registry, py4j, pyiceberg, Spark's start-up INFO,
the JVM's class-data-sharing warnings) off by default.

One setting turns the chatter back on: ``CDC_LOG_VERBOSE=1``
(``Settings.log_verbose``; passed on to the Spark job like every ``CDC_``
variable).  The format puts the level second so that the Airflow task
(plugins/cdc_airflow/spark.py) logs each line of the job at that level: the
UI's level filter then finds the job's ERROR lines.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
NOISY_LOGGERS = ("great_expectations", "py4j", "pyiceberg", "urllib3", "botocore", "s3transfer", "fsspec", "matplotlib")
"""Loggers kept at WARNING unless verbose: a clean gate's log was 339 lines of them."""


def configure(verbose: bool = False) -> None:
    """The job's logging: INFO for the project, WARNING for the noisy libraries."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def spark_conf(verbose: bool = False) -> dict[str, str]:
    """Driver conf that keeps Spark's own INFO out of the job's log (unless verbose)."""
    return {} if verbose else {"spark.log.level": "WARN"}


def jvm_options(verbose: bool = False) -> str:
    """JVM options that silence the class-data-sharing warnings (thousands of
    "Skipping ..." lines when the archive is written) unless verbose."""
    return "" if verbose else "-Xlog:cds*=off"
