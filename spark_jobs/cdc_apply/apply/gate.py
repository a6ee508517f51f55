"""The quality gate: Great Expectations plus CDC reconciliation, run against
the audit branch before anything is published.

* a suite generated per table from its key and metadata columns;
* the user's suite for the table, if ``include/expectations/<namespace>.<table>.json``
  exists (a GX ExpectationSuite serialised as JSON, kept under version control);
* reconciliation of the batch against the branch (computed in Spark and
  reported with the same names in the failure message).

Cost follows the batch, not the table: row-wise expectations run on the rows
this batch wrote (``_cdc_batch_id``; every other row is byte-for-byte what
``main`` already holds and was checked when it was written), reconciliation
looks only at the batch's keys.  Table-wide expectations (row counts,
aggregates, uniqueness in a user suite) still read the whole branch: they
cannot be judged from a slice.

Every run writes GX Data Docs into ``$CDC_HOME/data_docs/<batch>/<table>/``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from cdc_apply.apply import compact
from cdc_apply.apply.compact import META_POS, quote
from cdc_apply.apply.gx_import import import_great_expectations, load_deferred
from cdc_apply.config import Settings
from cdc_apply.runtime.background import Background
from cdc_apply.runtime.session import described

log = logging.getLogger(__name__)


@dataclass
class GateResult:
    success: bool
    failed: list[str] = field(default_factory=list)
    data_docs: str | None = None
    checks: int = 0


def preload_great_expectations() -> None:
    """Start importing Great Expectations on a thread of its own.

    Its import (``gx_import``) is ~1.7 s of pure Python, a tenth of an hourly job; the driver
    spends most of a batch waiting on the JVM with the GIL released, so the
    import overlaps the write instead of following it.  Nothing depends on the
    thread: the gate's own ``import`` waits for a module another thread is
    still importing, and imports it itself if the thread failed.  Not a
    daemon: a job that ends before its gate waits for the import to finish
    rather than tearing down an interpreter that is still loading extensions."""

    def load() -> None:
        try:
            import_great_expectations()
        except Exception:  # the gate imports it again and reports what fails
            log.debug("preloading Great Expectations failed", exc_info=True)

    import concurrent.futures.thread  # noqa: F401  registers an exit hook, which a thread cannot once the main one has ended

    threading.Thread(target=load, name="preload-great-expectations").start()


def generated_expectations(key_columns: list[str]) -> list[Any]:
    """The expectations every table gets: keys present and unique, CDC columns set."""
    gx = import_great_expectations()

    ex = gx.expectations
    out: list[Any] = [ex.ExpectColumnValuesToNotBeNull(column=k) for k in key_columns]
    if len(key_columns) == 1:
        out.append(ex.ExpectColumnValuesToBeUnique(column=key_columns[0]))
    else:
        out.append(ex.ExpectCompoundColumnsToBeUnique(column_list=list(key_columns)))
    out.append(ex.ExpectColumnValuesToNotBeNull(column="_cdc_position"))
    out.append(ex.ExpectColumnValuesToBeInSet(column="_cdc_op", value_set=["c", "u", "r", "d"]))
    out.append(ex.ExpectColumnValuesToNotBeNull(column="_cdc_deleted"))
    return out


def user_suite_path(settings: Settings, identifier: str) -> Path:
    """``<CDC_EXPECTATIONS_DIR or include/expectations>/<namespace>.<table>.json``."""

    ns_table = identifier.split(".", 1)[1]
    return settings.expectations_dir / f"{ns_table}.json"


def _expectation_name(result: Any) -> str:
    cfg = result.expectation_config
    kwargs = {k: v for k, v in cfg.kwargs.items() if k in ("column", "column_list", "value_set", "min_value", "max_value", "regex")}
    return f"{cfg.type}({json.dumps(kwargs, default=str, sort_keys=True)})"


# Map expectations whose verdict needs every row, not each row on its own.
_POPULATION_MAP_EXPECTATIONS = {"expect_column_values_to_be_unique", "expect_compound_columns_to_be_unique"}


def is_row_wise(expectation_type: str) -> bool:
    """Whether an expectation judges each row on its own (so checking only the
    rows a batch wrote is enough)."""
    import_great_expectations()
    from great_expectations.expectations.expectation import (
        ColumnMapExpectation,
        ColumnPairMapExpectation,
        MulticolumnMapExpectation,
    )
    from great_expectations.expectations.registry import get_expectation_impl

    if expectation_type in _POPULATION_MAP_EXPECTATIONS:
        return False
    impl = get_expectation_impl(expectation_type)
    return issubclass(impl, (ColumnMapExpectation, ColumnPairMapExpectation, MulticolumnMapExpectation))


RESULT_FORMATS = ("BOOLEAN_ONLY", "SUMMARY")
"""Each suite runs first for its verdict alone; only a suite that fails runs
again for the counts and unexpected values its Data Docs show.  Under
``SUMMARY`` GX runs a Spark job per map expectation to collect unexpected
values even when it passes and the list is empty (bench/README, step 18)."""


def run_gx(settings: Settings, branch: DataFrame, identifier: str, key_columns: list[str], batch_id: str) -> GateResult:
    """Validate the audit branch: the generated suite and the user suite's
    row-wise expectations on the rows this batch wrote, the user suite's
    table-wide expectations on the whole branch.  Its Spark jobs are named
    ``<table>: gate``, whichever stage runs it."""
    with described(branch.sparkSession, f"{identifier}: gate"):
        return _run_gx(settings, branch, identifier, key_columns, batch_id)


def _run_gx(settings: Settings, branch: DataFrame, identifier: str, key_columns: list[str], batch_id: str) -> GateResult:
    gx = import_great_expectations()
    from great_expectations.expectations.expectation_configuration import (
        ExpectationConfiguration,
    )

    table = identifier.split(".")[-1]
    root = settings.home / "data_docs" / batch_id / identifier.replace(".", "_")
    root.mkdir(parents=True, exist_ok=True)
    ctx = gx.get_context(mode="file", project_root_dir=str(root))
    without_config_variables(ctx)
    try:
        ctx.variables.progress_bars = gx.data_context.types.base.ProgressBarsConfig(globally=False)
        ctx.variables.save()
    except Exception:  # progress bars are cosmetic
        pass
    # persist=False: GX's Spark engine would cache every frame it validates,
    # all columns, and never release it (a long-lived session, the Connect
    # server, kept each batch's rows in its cache); its queries read only the
    # columns they check from the branch's pinned snapshot instead
    ds = ctx.data_sources.add_or_update_spark(name="cdc_branch", persist=False)
    rows_suite = gx.ExpectationSuite(name=f"{table}_batch_rows")
    table_suite = gx.ExpectationSuite(name=f"{table}_whole_table")
    for e in generated_expectations(key_columns):
        rows_suite.add_expectation(e)
    user = user_suite_path(settings, identifier)
    if user.exists():
        load_deferred()  # a user's expectation may use them: loaded before GX runs it
        spec = json.loads(user.read_text())
        for e in spec.get("expectations", []):
            cfg = ExpectationConfiguration(type=e["type"], kwargs=e.get("kwargs", {}), meta=e.get("meta"))
            (rows_suite if is_row_wise(e["type"]) else table_suite).add_expectation_configuration(cfg)
    changed = branch.where(F.col("_cdc_batch_id") == F.lit(batch_id))
    runs = [(rows_suite, changed)] + ([(table_suite, branch)] if table_suite.expectations else [])
    failed, checks, success = [], 0, True
    for suite, df in runs:
        asset = ds.add_dataframe_asset(name=suite.name)
        bd = asset.add_batch_definition_whole_dataframe(batch_id)
        suite = ctx.suites.add_or_update(suite)
        vd = ctx.validation_definitions.add_or_update(gx.ValidationDefinition(name=f"{suite.name}_{batch_id}", data=bd, suite=suite))
        for result_format in RESULT_FORMATS:
            checkpoint = ctx.checkpoints.add_or_update(
                gx.Checkpoint(
                    name=f"{suite.name}_gate",
                    validation_definitions=[vd],
                    actions=[gx.checkpoint.UpdateDataDocsAction(name="data_docs")],
                    result_format=result_format,
                )
            )
            run = checkpoint.run(batch_parameters={"dataframe": df})
            if run.success:
                break
        success = success and bool(run.success)
        for vr in run.run_results.values():
            for r in vr.results:
                checks += 1
                if not r.success:
                    failed.append(_expectation_name(r))
    docs = root / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html"
    return GateResult(success=success and not failed, failed=failed, data_docs=str(docs) if docs.exists() else None, checks=checks)


def without_config_variables(ctx: Any) -> None:
    """Remove the new GX project's ``config_variables.yml``.  A file context
    reads and parses it again on every configuration lookup: ~60 times a
    run after the ~30 of making the project, ~0.05-0.1 s of a small
    batch's gate (bench/README, issue 20 step 41).  The project substitutes no variables, and GX
    treats a missing file as none (its instance id then lives in memory).
    The path is read unsubstituted: ``ctx.variables`` would parse it again."""
    path = ctx.config.config_variables_file_path
    if path:
        (Path(ctx.root_directory) / path).unlink(missing_ok=True)


class GateAhead:
    """The GX suites of each table, started as soon as its branch is written
    and run beside the rest of the write (its reconciliation, the next
    table's apply); the same job's validate stage takes the result
    (``result``) instead of running them again.  One table's suites at a
    time, in the order written: GX runs are not made to run side by side."""

    def __init__(self, settings: Settings, batch_id: str) -> None:
        self._settings, self._batch_id = settings, batch_id
        self._runs: dict[str, tuple[int, Background[GateResult]]] = {}
        self._last: Background[GateResult] | None = None

    def start(self, tr: Any, branch: DataFrame) -> None:
        """``tr``: the table's ``results.TableResult``, written; ``branch``:
        its branch head as the write left it (``tr.branch_snapshot``)."""
        before, settings, batch_id = self._last, self._settings, self._batch_id

        def run() -> GateResult:
            if before is not None:
                before.wait()
            with tr.timed("gate"):
                return run_gx(settings, branch, tr.table, tr.key_columns, batch_id)

        self._last = Background(branch.sparkSession, run, f"gate-{tr.table}")
        self._runs[tr.table] = (tr.branch_snapshot, self._last)

    def result(self, table: str, snapshot: int | None) -> GateResult | None:
        """The suites' result for ``table`` at ``snapshot``; None when they
        were not started for that head (then the caller runs them).  Raises
        what the run raised."""
        started = self._runs.pop(table, None)
        if started is None:
            return None
        head, run = started
        if head != snapshot:
            run.wait()
            return None
        return run.result()

    def close(self) -> None:
        """Wait for every run still going (a job must not end under one)."""
        for _, run in self._runs.values():
            run.wait()
        self._runs.clear()


def _rows(cond: Column) -> Column:
    """How many rows meet ``cond`` (0, not NULL, for none)."""
    return F.coalesce(F.sum(F.when(cond, 1).otherwise(0)), F.lit(0))


KEY_CHECKS = {
    "duplicated": "reconcile_key_unique(keys={})",
    "regressed": "reconcile_no_position_regression(rows={})",
    "deleted_present": "reconcile_deleted_keys_absent(rows={})",
    "upsert_missing": "reconcile_upserted_keys_present(rows={})",
}
"""``reconcile``'s checks over the batch's keys: the count each one sums -> the failed check's name."""


def reconcile(
    branch: DataFrame,
    base_live: int,
    live_after: int | Callable[[], int],
    folded: DataFrame,
    key_columns: list[str],
    counts: dict[str, int],
    main: DataFrame,
    key_filter: str | None = None,
) -> list[str]:
    """CDC reconciliation of the batch; returns the names of failed checks.

    ``base_live`` and ``live_after``: the live rows before and after the batch
    (counts of the whole table, each kept for the next batch); ``live_after``
    may be a count still running, asked for after the other checks.  Those
    join the batch's keys (broadcast while few) with the branch and ``main``,
    whose scans ``key_filter`` prunes to the batch's key ranges
    (``merge.key_ranges_filter``): they cost what the batch costs."""
    keys = [quote(k) for k in key_columns]
    batch_keys = folded.select(*keys)
    if counts.get("keys", 0) <= compact.BROADCAST_ROWS_MAX:
        batch_keys = F.broadcast(batch_keys)
    # the branch's rows of the batch's keys, each with how many rows its key has
    # there (a window over the key: the joins below are partitioned by it too)
    per_key = Window.partitionBy(*keys)
    if key_filter:  # redundant with the semi-joins below, but pushed into the scans
        branch, main = branch.where(key_filter), main.where(key_filter)
    b = (
        branch.join(batch_keys, key_columns, "left_semi")
        .select(*keys, F.col("_cdc_position").alias("b_pos"), F.col("_cdc_deleted").alias("b_del"))
        .withColumn("b_rows", F.count(F.lit(1)).over(per_key))
        .withColumn("b_nth", F.row_number().over(per_key.orderBy("b_pos")))
    )
    m = main.join(batch_keys, key_columns, "left_semi").select(*keys, F.col("_cdc_position").alias("m_pos"))
    f = folded.select(*keys, "_cdc_action", F.col(META_POS).alias("f_pos"))
    # every branch row of b has a batch key, and folded has each batch key once:
    # one pass over batch ⟕ branch ⟕ main judges every check but the live-row count
    bad = (
        f.join(b, key_columns, "left")
        .join(m, key_columns, "left")
        .agg(
            _rows((F.col("b_rows") > 1) & (F.col("b_nth") == 1)).alias("duplicated"),
            _rows(F.col("b_pos") < F.col("m_pos")).alias("regressed"),
            _rows((F.col("_cdc_action") == "delete") & (F.col("b_del") == F.lit(False))).alias("deleted_present"),
            _rows(
                (F.col("_cdc_action") == "upsert") & (F.col("b_del").isNull() | F.col("b_del") | (F.col("b_pos") != F.col("f_pos")))
            ).alias("upsert_missing"),
        )
        .collect()[0]
    )
    failed = []
    expected, got = base_live + counts["inserted"] - counts["deleted"], live_after if isinstance(live_after, int) else live_after()
    if got != expected:
        failed.append(f"reconcile_live_row_count(expected={expected}, got={got})")
    return failed + [name.format(bad[k]) for k, name in KEY_CHECKS.items() if bad[k]]
