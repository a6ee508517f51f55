"""The quality gate: Great Expectations plus CDC reconciliation, run against
the audit branch before anything is published.

* a suite generated per table from its key and metadata columns;
* the user's suite for the table, if ``include/expectations/<namespace>.<table>.json``
  exists (a GX ExpectationSuite serialised as JSON, kept under version control);
* reconciliation of the batch against the branch (computed in Spark and
  reported with the same names in the failure message).

Every run writes GX Data Docs into ``$CDC_HOME/data_docs/<batch>/<table>/``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from .compact import META_POS, quote
from .config import PROJECT_ROOT, Settings

log = logging.getLogger(__name__)
EXPECTATIONS_DIR = PROJECT_ROOT / "include" / "expectations"


@dataclass
class GateResult:
    success: bool
    failed: list[str] = field(default_factory=list)
    data_docs: str | None = None
    checks: int = 0


def generated_expectations(key_columns: list[str]):
    import great_expectations as gx

    ex = gx.expectations
    out = [ex.ExpectColumnValuesToNotBeNull(column=k) for k in key_columns]
    if len(key_columns) == 1:
        out.append(ex.ExpectColumnValuesToBeUnique(column=key_columns[0]))
    else:
        out.append(ex.ExpectCompoundColumnsToBeUnique(column_list=list(key_columns)))
    out.append(ex.ExpectColumnValuesToNotBeNull(column="_cdc_position"))
    out.append(ex.ExpectColumnValuesToBeInSet(column="_cdc_op", value_set=["c", "u", "r", "d"]))
    out.append(ex.ExpectColumnValuesToNotBeNull(column="_cdc_deleted"))
    return out


def user_suite_path(identifier: str) -> Path:
    """``<CDC_EXPECTATIONS_DIR or include/expectations>/<namespace>.<table>.json``."""
    import os

    ns_table = identifier.split(".", 1)[1]
    return Path(os.environ.get("CDC_EXPECTATIONS_DIR") or str(EXPECTATIONS_DIR)) / f"{ns_table}.json"


def _expectation_name(result) -> str:
    cfg = result.expectation_config
    kwargs = {k: v for k, v in cfg.kwargs.items() if k in ("column", "column_list", "value_set", "min_value", "max_value", "regex")}
    return f"{cfg.type}({json.dumps(kwargs, default=str, sort_keys=True)})"


def run_gx(settings: Settings, df: DataFrame, identifier: str, key_columns: list[str], batch_id: str) -> GateResult:
    """Validate ``df`` (the branch's rows) with the generated and user suites."""
    import great_expectations as gx
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    table = identifier.split(".")[-1]
    root = settings.home / "data_docs" / batch_id / identifier.replace(".", "_")
    root.mkdir(parents=True, exist_ok=True)
    ctx = gx.get_context(mode="file", project_root_dir=str(root))
    try:
        ctx.variables.progress_bars = gx.data_context.types.base.ProgressBarsConfig(globally=False)
        ctx.variables.save()
    except Exception:  # progress bars are cosmetic
        pass
    ds = ctx.data_sources.add_or_update_spark(name="cdc_branch")
    asset = ds.add_dataframe_asset(name=table)
    bd = asset.add_batch_definition_whole_dataframe(f"{batch_id}")
    suite = gx.ExpectationSuite(name=f"{table}_cdc_generated")
    for e in generated_expectations(key_columns):
        suite.add_expectation(e)
    user = user_suite_path(identifier)
    if user.exists():
        spec = json.loads(user.read_text())
        for e in spec.get("expectations", []):
            suite.add_expectation_configuration(ExpectationConfiguration(type=e["type"], kwargs=e.get("kwargs", {}), meta=e.get("meta")))
    suite = ctx.suites.add_or_update(suite)
    vd = ctx.validation_definitions.add_or_update(gx.ValidationDefinition(name=f"{table}_{batch_id}", data=bd, suite=suite))
    checkpoint = ctx.checkpoints.add_or_update(
        gx.Checkpoint(name=f"{table}_gate", validation_definitions=[vd], actions=[gx.checkpoint.UpdateDataDocsAction(name="data_docs")])
    )
    run = checkpoint.run(batch_parameters={"dataframe": df})
    failed, checks = [], 0
    for vr in run.run_results.values():
        for r in vr.results:
            checks += 1
            if not r.success:
                failed.append(_expectation_name(r))
    docs = root / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html"
    return GateResult(success=run.success and not failed, failed=failed, data_docs=str(docs) if docs.exists() else None, checks=checks)


def reconcile(branch: DataFrame, base_live: int, folded: DataFrame, key_columns: list[str], counts: dict[str, int], main: DataFrame) -> list[str]:
    """CDC reconciliation of the batch; returns the names of failed checks."""
    failed = []
    live_after = branch.where(~F.col("_cdc_deleted")).count()
    expected = base_live + counts["inserted"] - counts["deleted"]
    if live_after != expected:
        failed.append(f"reconcile_live_row_count(expected={expected}, got={live_after})")
    keys = [quote(k) for k in key_columns]
    b = branch.select(*keys, F.col("_cdc_position").alias("b_pos"), F.col("_cdc_deleted").alias("b_del"))
    m = main.select(*keys, F.col("_cdc_position").alias("m_pos"))
    regressed = b.join(m, key_columns).where(F.col("b_pos") < F.col("m_pos")).count()
    if regressed:
        failed.append(f"reconcile_no_position_regression(rows={regressed})")
    f = folded.select(*keys, "_cdc_action", F.col(META_POS).alias("f_pos"))
    j = f.join(b, key_columns, "left")
    bad_delete = j.where((F.col("_cdc_action") == "delete") & (F.col("b_del") == F.lit(False))).count()
    if bad_delete:
        failed.append(f"reconcile_deleted_keys_absent(rows={bad_delete})")
    bad_upsert = j.where(
        (F.col("_cdc_action") == "upsert") & (F.col("b_del").isNull() | F.col("b_del") | (F.col("b_pos") != F.col("f_pos")))
    ).count()
    if bad_upsert:
        failed.append(f"reconcile_upserted_keys_present(rows={bad_upsert})")
    return failed
