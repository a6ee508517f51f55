"""Build a SparkSession wired to the Iceberg catalog described by Settings."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from .config import Settings


def iceberg_conf(settings: Settings) -> dict[str, str]:
    """Spark conf for the Iceberg catalog: shared by local sessions and spark-submit."""
    cat = f"spark.sql.catalog.{settings.catalog_name}"
    conf = {
        "spark.sql.extensions": "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
        cat: "org.apache.iceberg.spark.SparkCatalog",
        f"{cat}.warehouse": settings.warehouse,
        # no table cache: pyiceberg (publish, ledger) commits to the same tables
        f"{cat}.cache-enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.mapKeyDedupPolicy": "LAST_WIN",
    }
    if settings.catalog_type == "jdbc":
        conf[f"{cat}.type"] = "jdbc"
        conf[f"{cat}.uri"] = settings.catalog_uri
        conf[f"{cat}.jdbc.schema-version"] = "V1"
    else:
        conf[f"{cat}.type"] = "rest"
        conf[f"{cat}.uri"] = settings.catalog_uri
    from .storage import object_store_conf

    conf.update(object_store_conf(settings))
    conf.update(settings.extra_spark_conf)
    return conf


def get_spark(settings: Settings, app_name: str = "cdc-apply") -> SparkSession:
    """The active session if there is one (spark-submit, tests), else a new one."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    # Python workers must run the same interpreter (and packages) as the driver.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if settings.sqlite_path is not None:
        settings.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
    builder = SparkSession.builder
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.appName(app_name)
        # Not under spark-submit: we own master and jars. Under spark-submit the
        # submitter (Airflow's connection, --jars, --conf) decides them.
        builder = builder.master(settings.spark_master)
        builder = builder.config("spark.jars", ",".join(str(p) for p in settings.jar_paths()))
    defaults = {
        "spark.sql.shuffle.partitions": "8",
        "spark.default.parallelism": "4",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.adaptive.enabled": "true",
        "spark.driver.memory": "2g",
    }
    for key, value in {**defaults, **iceberg_conf(settings)}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
