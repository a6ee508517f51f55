"""Feed canonical events straight into the apply path (no files, no decoder)
and read the result back: the seam the rule tests and property tests use."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Iterator

from cdc_apply.archive.files import ArchiveFile
from cdc_apply.batch import BatchResult, apply_decoded, finish_batch, publish_batch, write_and_validate
from cdc_apply.config import SourceConfig
from cdc_apply.decode.stage import outcomes_decoded
from cdc_apply.model import ChangeEvent, Outcome

_counter = itertools.count()


@contextlib.contextmanager
def state_read(how: str) -> Iterator[None]:
    """Run the batches of the block reading the stored state ``how``:
    ``whole`` as shipped (the small tables of tests read it whole), or
    ``key spans``, as a small batch into a large table does
    (``table.PRUNE_STATE_MIN_RATIO``, ``table.KEY_SPANS_MIN_ROWS``): the
    stored rows of the batch's key spans, semi-joined with its keys."""
    from cdc_apply.apply import table

    saved = table.PRUNE_STATE_MIN_RATIO, table.KEY_SPANS_MIN_ROWS
    if how == "key spans":
        table.PRUNE_STATE_MIN_RATIO, table.KEY_SPANS_MIN_ROWS = 0, 0
    try:
        yield
    finally:
        table.PRUNE_STATE_MIN_RATIO, table.KEY_SPANS_MIN_ROWS = saved


def apply_events(
    spark,
    settings,
    namespace: str,
    outcomes: list[Outcome],
    *,
    primary_keys=None,
    quarantine_max_share=1.0,
    batch_tag: str | None = None,
    override=None,
    merge_mode: str = "auto",
    changelog: bool = True,
    history: dict[str, str] | None = None,
    stages: tuple[str, ...] = ("validate", "publish"),
    publish: str = "events",
    decoder_state: dict | None = None,
    fmt: str = "debezium_postgres",
    counted_by_decode: bool = True,
) -> BatchResult:
    """Apply one batch of outcomes; each distinct ``file`` is a batch file.
    ``decoder_state``: the source state the batch starts from (default: the
    ledger's latest, as a real batch).  ``counted_by_decode``: the batch
    gets its rows' counts and tables from the decode, as a small batch's
    decode gives them; False leaves them to a Spark job, as a large batch's."""
    source = SourceConfig(
        name=namespace,
        format=fmt,
        namespace=namespace,
        primary_keys=primary_keys or {},
        quarantine_max_share=quarantine_max_share,
        merge_mode=merge_mode,
        changelog=changelog,
        history=history or {},
        publish=publish,
    )
    tag = batch_tag or f"b{next(_counter)}"
    for o in outcomes:  # events without a file belong to a file of this batch
        if not o.file:
            o.file = f"/virtual/{namespace}/{tag}.jsonl"
    paths = sorted({o.file for o in outcomes}) or [f"/virtual/{namespace}/empty"]
    import datetime as dt

    files = [
        ArchiveFile(hour=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), path=p, size=0, sha256=hashlib.sha256(p.encode()).hexdigest())
        for p in paths
    ]
    result = BatchResult(
        batch_id=f"{namespace}_{tag}",
        source=namespace,
        status="complete",
        files=[f.as_dict() for f in files],
        override=override.__dict__ if override else None,
    )
    # counted as the decode of a small batch counts its rows (``decode_here``): no Spark job
    decoded = outcomes_decoded(spark, outcomes)
    known = (decoded.counts, decoded.tables) if counted_by_decode else (None, None)
    if "validate" in stages:  # as a job that validates: each table's GX suites start when its branch is written
        write_and_validate(spark, settings, source, result, files, decoded.frame, decoder_state, None, in_write_job=False, known=known)
    else:
        apply_decoded(spark, settings, source, result, files, decoded.frame, decoder_state, known=known)
    if "publish" not in stages:
        return result
    publish_batch(settings, result)
    return finish_batch(settings, result)


def as_text(columns: dict[str, str]) -> str:
    """A select list rendering ``columns`` as canonical text (NULL stays NULL)."""
    return ", ".join(
        f"CASE WHEN `{c}` IS NULL THEN NULL ELSE "
        + (f"date_format(`{c}`, 'yyyy-MM-dd HH:mm:ss.SSSSSS')" if t.startswith("timestamp") else f"CAST(`{c}` AS string)")
        + f" END AS `{c}`"
        for c, t in columns.items()
    )


def live_rows(
    spark, settings, namespace: str, table: str, key_cols: list[str], columns: dict[str, str]
) -> dict[tuple, dict[str, str | None]]:
    """The table's live rows with values rendered as canonical text."""
    ident = f"{settings.catalog_name}.{namespace}.{table}"
    if not spark.catalog.tableExists(ident):
        return {}
    out = {}
    for r in spark.sql(f"SELECT {as_text(columns)} FROM {ident} WHERE NOT _cdc_deleted").collect():
        d = r.asDict()
        out[tuple(d[k] for k in key_cols)] = d
    return out


def event(op, key, after=None, *, pos, file="", line=None, table="items", before=None, columns=None) -> ChangeEvent:
    from cdc_apply.model import Column, Op

    cols = columns or [Column("id", "int", False), Column("name", "string"), Column("amount", "decimal(10,2)")]
    if line is None:
        line = next(_counter)
    return ChangeEvent(
        format="debezium_postgres",
        database="db",
        schema="public",
        table=table,
        op=Op(op),
        key_columns=["id"],
        after=({"id": str(key), **(after or {})} if op not in ("d", "t") else {}),
        before=({"id": str(key)} if op == "d" else before),
        position=f"{pos:020d}",
        columns=cols,
        file=file,
        line=line,
        commit_ts_us=1_700_000_000_000_000 + pos,
    )
