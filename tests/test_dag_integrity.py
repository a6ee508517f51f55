"""Every DAG file imports without errors, has no cycles, and follows the rules
we rely on (retries set, max_active_runs=1 for cdc_apply)."""

from __future__ import annotations

import os

import pytest

from tests.airflow_env import ROOT

pytestmark = pytest.mark.airflow


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    import os
    import sys

    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("af_home")))
    sys.path.insert(0, str(ROOT / "plugins"))
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(ROOT / "dags"))


@pytest.fixture
def cdc_home(monkeypatch, tmp_path):
    """A CDC_HOME of the test's own, and the jars the submit spec names."""
    monkeypatch.setenv("CDC_HOME", str(tmp_path))
    monkeypatch.setenv("CDC_JARS_DIR", os.environ.get("CDC_JARS_DIR", str(ROOT / ".cdc" / "jars")))
    return tmp_path


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert "cdc_apply" in dagbag.dags


def test_cdc_apply_shape(dagbag):
    dag = dagbag.dags["cdc_apply"]
    assert dag.max_active_runs == 1
    assert set(dag.params.keys()) >= {"source", "table_filter", "max_files", "dry_run", "override", "override_reason"}
    down = {t.task_id: t.downstream_task_ids for t in dag.tasks}
    # turn -> discover -> apply -> tables -> [per table: validate -> publish] -> finish -> report
    assert down["turn"] == {"discover"} and dag.task_dict["turn"].mode == "reschedule"  # one run of a source at a time
    assert "apply" in down["discover"] and "tables" in down["apply"]
    assert down["tables"] == {"table.validate", "table.publish"}  # the mapped group expands over its output
    assert down["table.validate"] == {"table.publish"}
    assert down["table.publish"] == {"finish"}
    assert down["finish"] == {"report"}
    assert dag.task_dict["finish"].trigger_rule == "all_done"  # the ledger records failed attempts too
    assert [o.name for o in dag.task_dict["table.publish"].outlets] == ["cdc_tables"]  # the table assets' alias
    for task in dag.tasks:  # the turn sensor too: a try the executor loses must not fail the run (its timeout is never retried)
        assert task.retries >= 1, task.task_id
    assert dag.task_dict["report"].trigger_rule == "all_done"  # it gives the source's turn back, whatever happened
    # topological sort raises on cycles
    assert next(t.task_id for t in dag.topological_sort()) == "turn"


def test_cdc_maintenance_shape(dagbag):
    dag = dagbag.dags["cdc_maintenance"]
    assert dag.max_active_runs == 1 and dag.schedule == "@daily"
    assert set(dag.params.keys()) >= {"source", "snapshot_retention_days", "tombstone_retention_days"}


def test_maintenance_runs_as_often_as_the_operator_sets(monkeypatch, dagbag):
    """A table read often wants its merge-on-read files folded more than
    daily (bench/README.md, issue 20 step 15): CDC_MAINTENANCE_SCHEDULE."""
    monkeypatch.setenv("CDC_MAINTENANCE_SCHEDULE", "0 */6 * * *")
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags" / "cdc_maintenance.py"))
    assert bag.import_errors == {}
    assert bag.dags["cdc_maintenance"].schedule == "0 */6 * * *"


def test_submit_spec_tunes_the_short_lived_jvm(monkeypatch, cdc_home, dagbag):
    """The DAG's jobs get C1-only JIT (one JVM per batch, see bench/README.md);
    a CDC_SPARK_CONF_ override replaces it, here with nothing."""
    from cdc_apply.config import Settings
    from cdc_apply.runtime.spark_conf import DRIVER_JAVA_OPTIONS
    from cdc_apply.runtime.submit import submit_spec

    assert (
        submit_spec(Settings.from_env(), os.environ).conf["spark.driver.extraJavaOptions"]
        == DRIVER_JAVA_OPTIONS
        == "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
    )
    monkeypatch.setenv("CDC_SPARK_CONF_spark__driver__extraJavaOptions", "")
    assert submit_spec(Settings.from_env(), os.environ).conf["spark.driver.extraJavaOptions"] == ""


def test_every_driver_builds_expressions_without_capturing_call_sites(monkeypatch, cdc_home, dagbag):
    """PySpark's call-site capture costs a stack walk and Py4J calls per
    Column function (spark_conf.session_defaults): off for the DAG's jobs, a
    Connect server and a local session alike; an override turns it back on."""
    from cdc_apply.config import Settings
    from cdc_apply.runtime.spark_conf import driver_conf, session_defaults
    from cdc_apply.runtime.submit import submit_spec

    key = "spark.python.sql.dataFrameDebugging.enabled"
    settings = Settings.from_env()
    assert submit_spec(settings, os.environ).conf[key] == "false"
    assert driver_conf(settings, short_lived=False)[key] == session_defaults(settings)[key] == "false"
    monkeypatch.setenv("CDC_SPARK_CONF_spark__python__sql__dataFrameDebugging__enabled", "true")
    assert submit_spec(Settings.from_env(), os.environ).conf[key] == "true"


def test_operator_conf_of_its_own_is_submitted_as_given(monkeypatch, cdc_home, dagbag):
    """A task's own Java options reach spark-submit exactly as given, with no
    class archive written or waited for; without them the driver writes the
    archive.  The operator's conf is its own again afterwards (a retry in the
    same process starts from it)."""
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    from cdc_airflow.spark import CdcSparkSubmitOperator

    submitted: list[dict] = []
    monkeypatch.setattr(SparkSubmitOperator, "execute", lambda self, context: submitted.append(dict(self.conf)))
    monkeypatch.setattr(CdcSparkSubmitOperator, "_spark_connect_url", lambda self: None)

    own = {"spark.driver.extraJavaOptions": "-Xss4m", "spark.sql.shuffle.partitions": "3"}
    op = CdcSparkSubmitOperator(task_id="own", application="x.py", conf=dict(own))
    op.execute({"params": {}})
    assert submitted[-1]["spark.driver.extraJavaOptions"] == "-Xss4m"
    assert submitted[-1]["spark.sql.shuffle.partitions"] == "3"
    assert op.conf == own
    assert not (cdc_home / "jvm").exists()  # no lock taken, no archive planned

    op = CdcSparkSubmitOperator(task_id="default", application="x.py")
    op.execute({"params": {}})
    assert "-XX:ArchiveClassesAtExit=" in submitted[-1]["spark.driver.extraJavaOptions"]
    assert op.conf == {}
    assert list((cdc_home / "jvm").glob("*.lock")) == []  # released after the job


def test_the_embedded_defaults_spark_tasks_attach_to_the_warm_driver(monkeypatch, cdc_home, dagbag):
    """Which driver a Spark task's job runs on, by spark_default: a local
    master attaches it to the home's warm driver, unless that is turned off
    or the task has Spark conf of its own; a cluster master spark-submits; a
    spark_connect connection names its server."""
    from cdc_airflow.spark import CdcSparkSubmitOperator

    def runs_on(**kwargs):
        return CdcSparkSubmitOperator(task_id="t", application="x.py", **kwargs)._spark_connect_url()

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark", "host": "local[*]"}')
    monkeypatch.delenv("CDC_WARM_DRIVER_IDLE_SECONDS", raising=False)
    assert runs_on() == "local"
    assert runs_on(conf={"spark.sql.shuffle.partitions": "3"}) is None
    monkeypatch.setenv("CDC_WARM_DRIVER_IDLE_SECONDS", "0")
    assert runs_on() is None
    monkeypatch.delenv("CDC_WARM_DRIVER_IDLE_SECONDS")
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark", "host": "spark://spark-master", "port": 7077}')
    assert runs_on() is None
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark_connect", "host": "spark-connect", "port": 15002}')
    assert runs_on().startswith("sc://spark-connect:15002")


def test_only_a_one_command_process_tunes_its_own_driver_jvm(monkeypatch, cdc_home):
    """get_spark's conf: C1-only JIT for the driver of a process that runs
    one command and exits (``cdc``, the demo); none for a session that is
    kept (tests, the bench) or under spark-submit; a CDC_SPARK_CONF_ override
    wins."""
    from cdc_apply.config import Settings
    from cdc_apply.runtime.spark_conf import DRIVER_JAVA_OPTIONS, session_conf

    key = "spark.driver.extraJavaOptions"
    monkeypatch.delenv("CDC_SPARK_CONF_spark__driver__extraJavaOptions", raising=False)
    assert session_conf(Settings.from_env(), own_short_lived_driver=True)[key] == DRIVER_JAVA_OPTIONS
    assert key not in session_conf(Settings.from_env(), own_short_lived_driver=False)
    monkeypatch.setenv("CDC_SPARK_CONF_spark__driver__extraJavaOptions", "-Xss4m")
    assert session_conf(Settings.from_env(), own_short_lived_driver=True)[key] == "-Xss4m"
