"""Apply a real Debezium capture as the hourly DAG does and compare every
table, row for row, with the source state PostgreSQL had.

``capture_seed`` runs ``capture.py`` in its own process (Debezium's JVM stays
out of the test process).  ``apply_in_order`` delivers hour after hour and
compares after each hour; ``apply_late_hour`` holds one hour folder back
until every later hour was applied (a late or re-delivered file) and compares
at the end.  Both go through ``batch.pending_files`` + ``batch.run_batch`` with
a source of their own (``include/sources.yaml`` format).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from cdc_apply.apply.held import HELD_KEY
from tests.realsource.capture import TABLE_KEYS, Capture, HourState

ROOT = Path(__file__).resolve().parents[2]
UTC = dt.UTC
HOUR = dt.timedelta(hours=1)


@dataclass(frozen=True)
class Mismatch:
    when: str
    table: str
    key: tuple
    column: str
    expected: Any
    got: Any

    def __str__(self) -> str:
        return f"{self.when} {self.table} {self.key} {self.column}: expected {short(self.expected)}, got {short(self.got)}"


@dataclass
class VariantResult:
    name: str
    batches: int = 0
    rows_compared: int = 0
    comparisons: int = 0
    skipped_torn: int = 0
    transactions_held: int = 0
    """Lines of transactions held because the hour's files had only part of them."""
    held_lines: dict[str, Any] = field(default_factory=dict)
    """The source state's held files after the last batch (``held.HELD_KEY``)."""
    messages: dict[str, int] = field(default_factory=dict)
    tombstone_lines: int = 0
    batch_seconds: list[float] = field(default_factory=list)
    tombstones_quarantined: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """batch-level failures: a failed batch, quarantined or held messages, unaccounted lines"""

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.problems

    def summary(self, limit: int = 20) -> str:
        lines = [
            f"{self.name}: {self.batches} batches, {self.comparisons} comparisons, {self.rows_compared} rows compared, "
            f"{len(self.mismatches)} mismatches, {self.tombstones_quarantined} of {self.tombstone_lines} tombstone lines quarantined, "
            f"messages {self.messages}, batch seconds {self.batch_seconds}"
        ]
        lines += [f"  problem: {p}" for p in self.problems[:limit]]
        lines += [f"  {m}" for m in self.mismatches[:limit]]
        if limit and len(self.mismatches) > limit:
            lines.append(f"  ... {len(self.mismatches) - limit} more")
        return "\n".join(lines)


def short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else f"{text[:n]}...({len(text)} chars)"


# ---------------------------------------------------------------- capture


def with_transactions(seed: int) -> bool:
    """Whether the seed's capture carries transaction metadata (its source then
    publishes by transactions, the default; the even seeds, without metadata,
    apply event by event whatever the setting)."""
    return seed % 2 == 1


def capture_seed(seed: int, out: Path, *, hours: int = 4, ops: int = 60, snapshot_rows: int = 20) -> Capture:
    """Run the capture of one seed in a child process; its Debezium/JVM log goes to ``out/capture.log``.
    Odd seeds turn Debezium's transaction metadata on (``with_transactions``), even seeds keep its default."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "spark_jobs"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with (out / "capture.log").open("wb") as log:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.realsource.capture",
                "--seed",
                str(seed),
                "--hours",
                str(hours),
                "--ops",
                str(ops),
                "--snapshot-rows",
                str(snapshot_rows),
                "--out",
                str(out),
                *(["--transaction-metadata"] if with_transactions(seed) else []),
            ],
            cwd=out,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=900,  # Debezium writes logs/ in its cwd
        )
    if proc.returncode:
        tail = (out / "capture.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"capture of seed {seed} failed ({proc.returncode}); log {out / 'capture.log'}:\n{tail}")
    with (out / "capture.pkl").open("rb") as fh:
        return pickle.load(fh)


# ---------------------------------------------------------------- delivery and apply


def hour_files(cap: Capture, hour: dt.datetime) -> list[Path]:
    part = hour.strftime("%Y/%m/%d/%H")
    return sorted(p for p in cap.archive.rglob("*") if p.is_file() and f"/{part}/" in p.as_posix())


def deliver(cap: Capture, hour: dt.datetime, dest: Path) -> None:
    """Copy one hour's files into the source's archive folder."""
    for src in hour_files(cap, hour):
        target = dest / src.relative_to(cap.archive)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)


def count_lines(path: str | Path, only: list[list[int]] | None = None) -> tuple[int, int]:
    """(non-empty lines, ``null`` tombstone lines) of an archive file; with
    ``only`` ([first, last] line ranges), of those lines: a file re-read for
    the lines an earlier batch held."""
    opener = gzip.open if str(path).endswith(".gz") else open
    lines = nulls = 0
    with opener(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip() and (only is None or any(lo <= n <= hi for lo, hi in only)):
                lines += 1
                nulls += line.strip() == b"null"
    return lines, nulls


def source_settings(settings: Any, name: str, folder: Path) -> Any:
    """Settings whose sources file defines ``name``: Debezium PostgreSQL, keys from the messages."""
    path = folder / f"{name}.yaml"
    # The sink archives record values only, so keys come from the sources file (as include/sources.yaml does).
    tables = {f"public.{t}": {"primary_key": keys} for t, keys in TABLE_KEYS.items()}
    spec = {"format": "debezium_postgres", "namespace": name, "tables": tables, "quarantine_max_share": 1.0}
    path.write_text(yaml.safe_dump({"sources": {name: spec}}))
    return dataclasses.replace(settings, sources_file=path)


TOMBSTONE_REASON = "not a JSON object but NoneType"


def apply_pending(spark: Any, settings: Any, name: str, until: dt.datetime, res: VariantResult) -> None:
    """One hourly run: every pending file whose hour is before ``until``.  Checks
    that every line is accounted for; ``null`` tombstone lines that are
    quarantined are counted apart (``res.tombstones_quarantined``, a known defect)."""
    from cdc_apply.batch import pending_files, run_batch
    from cdc_apply.config import get_source

    files = pending_files(settings, get_source(settings, name), until=until)
    if not files:
        return
    held = res.held_lines  # files an earlier batch read in part: only their held lines are read again
    lines, nulls = map(sum, zip(*(count_lines(f.path, held[f.path]["lines"] if f.path in held else None) for f in files)))
    res.tombstone_lines += nulls
    result = run_batch(settings, name, files=files, spark=spark)
    res.held_lines = (result.source_state or {}).get(HELD_KEY, {}) if result.status == "complete" else held
    res.batches += 1
    res.batch_seconds.append(result.seconds)
    for k, v in result.messages.items():
        res.messages[k] = res.messages.get(k, 0) + v
    label = f"batch until {until:%H:00}"
    if result.status != "complete":
        res.problems.append(f"{label}: status {result.status}: {result.message}")
    for k, v in result.messages.items():
        if k == "held:transaction-incomplete" and v:  # a transaction torn by the hour's end: applied whole by the next
            res.transactions_held += v
        elif k.startswith(("quarantined:", "held:")) and v:
            if k.endswith(TOMBSTONE_REASON) and v == nulls:
                res.tombstones_quarantined += v
            else:
                res.problems.append(f"{label}: {v} message(s) {k}")
    if result.messages.get("read", 0) != lines:
        res.problems.append(f"{label}: {lines} lines in {len(files)} files, {result.messages.get('read', 0)} read")


def apply_in_order(spark: Any, settings: Any, cap: Capture, name: str, folder: Path) -> VariantResult:
    """Hour after hour, as the scheduled DAG: deliver, apply, compare with that hour's end."""
    s = source_settings(settings, name, folder)
    dest = Path(s.archive_dir) / name
    res = VariantResult(f"in-order seed {cap.seed}")
    for state in cap.hours:
        deliver(cap, state.hour, dest)
        apply_pending(spark, s, name, state.hour + HOUR, res)
        if state.torn and not cap.transaction_metadata:
            res.skipped_torn += 1
            continue
        # with transaction metadata the torn transaction is held whole: the hour equals the source before it
        compare(spark, s, name, state, f"after {state.hour:%H}:00", res)
    return res


def rebuild_differences(spark: Any, settings: Any, name: str, folder: Path) -> list[str]:
    """``cdc rebuild`` of a source ``apply_in_order`` applied: replayed from
    zero, one batch per hour, every table, change log and history compared
    with the live one; returns what differs (nothing when all are equal)."""
    from cdc_apply.config import get_source
    from cdc_apply.rebuild import rebuild

    s = dataclasses.replace(settings, sources_file=folder / f"{name}.yaml")
    reports = rebuild(spark, s, get_source(s, name))
    if not reports:
        return [f"rebuild of {name}: no table compared"]
    return [
        f"rebuild of {name}: {r['table']} differs: live {r['fingerprint_live']}, rebuilt {r['fingerprint_rebuilt']}, "
        f"only live {r.get('only_live')}, only rebuilt {r.get('only_rebuilt')}"
        for r in reports
        if not r["equal"]
    ]


def apply_late_hour(spark: Any, settings: Any, cap: Capture, name: str, folder: Path, late: int) -> VariantResult:
    """Hour ``late``'s folder appears only after every later hour was applied; compare at the end."""
    s = source_settings(settings, name, folder)
    dest = Path(s.archive_dir) / name
    res = VariantResult(f"late hour {late:02d} seed {cap.seed}")
    for i, state in enumerate(cap.hours):
        if i == late:
            continue
        deliver(cap, state.hour, dest)
        apply_pending(spark, s, name, state.hour + HOUR, res)
    deliver(cap, cap.hours[late].hour, dest)
    apply_pending(spark, s, name, cap.final.hour + HOUR, res)
    compare(spark, s, name, cap.final, f"final (hour {late:02d} late)", res)
    return res


# ---------------------------------------------------------------- comparison


def read_live(spark: Any, settings: Any, namespace: str, table: str, keys: list[str]) -> dict[tuple, dict[str, Any]] | None:
    """Live rows (``NOT _cdc_deleted``), timestamps as aware UTC datetimes."""
    ident = f"{settings.catalog_name}.{namespace}.{table}"
    if not spark.catalog.tableExists(ident):
        return None
    df = spark.table(ident)
    cols = [f for f in df.schema.fields if not f.name.startswith("_cdc_")]
    sel = ", ".join(
        f"unix_micros(CAST(`{f.name}` AS timestamp)) AS `{f.name}`" if f.dataType.typeName().startswith("timestamp") else f"`{f.name}`"
        for f in cols
    )
    ts_cols = {f.name for f in cols if f.dataType.typeName().startswith("timestamp")}
    out = {}
    for r in spark.sql(f"SELECT {sel} FROM {ident} WHERE NOT _cdc_deleted").collect():
        d = r.asDict()
        for c in ts_cols:
            if d[c] is not None:
                d[c] = dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(microseconds=d[c])
        out[tuple(d[k] for k in keys)] = d
    return out


def as_expected(expected: Any, got: Any, pg_type: str) -> Any:
    """``got`` in the Python type of the source value (typed as the project maps it)."""
    if got is None:
        return None
    if pg_type == "jsonb" or pg_type == "json":
        return json.loads(got, parse_float=Decimal) if isinstance(got, str) else got
    if isinstance(expected, Decimal) or pg_type == "numeric":
        try:
            return Decimal(str(got))
        except ArithmeticError:
            return got
    if isinstance(got, (bytearray, memoryview)):
        return bytes(got)
    return got


def compare(spark: Any, settings: Any, namespace: str, state: HourState, when: str, res: VariantResult) -> None:
    """Every table of ``state`` against the live Iceberg rows; every difference a ``Mismatch``."""
    res.comparisons += 1
    for table, expected_rows in state.tables.items():
        keys = TABLE_KEYS[table]
        types = state.types.get(table, {})
        got_rows = read_live(spark, settings, namespace, table, keys)
        if got_rows is None:
            if expected_rows:
                res.mismatches.append(Mismatch(when, table, (), "<table>", f"{len(expected_rows)} rows", "no table"))
            continue
        got_keyed = {tuple(as_expected(None, v, types.get(k, "")) for k, v in zip(keys, key)): row for key, row in got_rows.items()}
        for key, exp in sorted(expected_rows.items(), key=lambda kv: repr(kv[0])):
            res.rows_compared += 1
            got = got_keyed.get(key)
            if got is None:
                res.mismatches.append(Mismatch(when, table, key, "<row>", "live row", "missing"))
                continue
            for col, value in exp.items():
                g = as_expected(value, got.get(col), types.get(col, ""))
                if g != value or (col not in got and value is not None):
                    res.mismatches.append(Mismatch(when, table, key, col, value, g if col in got else "<no column>"))
        for key in sorted(set(got_keyed) - set(expected_rows), key=repr):
            res.mismatches.append(Mismatch(when, table, key, "<row>", "no row", "live row (resurrected or never deleted)"))


# ---------------------------------------------------------------- explaining mismatches

PLACEHOLDERS = ("__debezium_unavailable_value", "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ==")


@dataclass(frozen=True)
class Message:
    op: str
    lsn: int
    tx: int | None
    file: str
    line: int
    placeholders: frozenset[str]
    text: str


def index_messages(cap: Capture) -> tuple[dict[tuple[str, tuple], list[Message]], dict[tuple[str, int, int | None], Message]]:
    """Every record of the capture by (table, key); and the (table, lsn, txId)
    of every delete (a create at the same LSN and transaction is the new key of
    a primary-key change)."""
    by_key: dict[tuple[str, tuple], list[Message]] = {}
    deletes: dict[tuple[str, int, int | None], Message] = {}
    for path in sorted(p for p in cap.archive.rglob("*") if p.is_file()):
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for n, text in enumerate(fh, 1):
                if text.strip() == "null":
                    continue
                payload = json.loads(text)["payload"]
                if "source" not in payload:  # a BEGIN / END marker (transaction metadata)
                    continue
                src = payload["source"]
                table = src["table"]
                row = payload.get("after") or payload.get("before") or {}
                if table not in TABLE_KEYS or not row:
                    continue
                key = tuple(row.get(k) for k in TABLE_KEYS[table])
                after = payload.get("after") or {}
                ph = frozenset(c for c, v in after.items() if v in PLACEHOLDERS or v == [PLACEHOLDERS[0]])
                msg = Message(payload["op"], int(src["lsn"]), src.get("txId"), str(path.relative_to(cap.archive)), n, ph, text.strip())
                by_key.setdefault((table, key), []).append(msg)
                if payload["op"] == "d":
                    deletes[(table, msg.lsn, msg.tx)] = msg
    return by_key, deletes


PK_CHANGE_TOAST = "primary-key change: the new key's create carries the unavailable placeholder, the unchanged TOAST value is lost"
PLACEHOLDER_LATE = "unchanged-value placeholder applied before an older full image that arrived later (out-of-order partial row)"


def explain(m: Mismatch, by_key: dict, deletes: dict) -> str:
    """The mismatch class, from the Debezium messages of the key."""
    msgs = by_key.get((m.table, m.key), [])
    if m.column == "<row>":
        return f"{m.table}: {m.got}"
    if m.got is None and m.expected is not None:
        if any(x.op == "c" and m.column in x.placeholders and (m.table, x.lsn, x.tx) in deletes for x in msgs):
            return PK_CHANGE_TOAST
        if any(m.column in x.placeholders for x in msgs):
            return PLACEHOLDER_LATE
        return f"{m.table}.{m.column}: NULL instead of a value"
    return f"{m.table}.{m.column}: wrong value"


def raw_example(m: Mismatch, by_key: dict, deletes: dict, limit: int = 240) -> list[str]:
    """The key's messages (and the delete of the old key of a primary-key
    change), long values cut, for a report."""
    out = []
    msgs = by_key.get((m.table, m.key), [])
    msgs = msgs + [deletes[(m.table, x.lsn, x.tx)] for x in msgs if x.op == "c" and (m.table, x.lsn, x.tx) in deletes]
    for x in sorted(msgs, key=lambda x: (x.lsn, x.op != "d")):
        payload = json.loads(x.text)["payload"]
        cut = {
            k: (
                {c: (v[:24] + "..." if isinstance(v, str) and len(v) > 24 else v) for c, v in payload[k].items()}
                if payload.get(k)
                else payload.get(k)
            )
            for k in ("before", "after")
        }
        src = {k: payload["source"].get(k) for k in ("lsn", "txId", "snapshot")}
        out.append(f"{x.file}:{x.line} op={x.op} source={src} before={cut['before']} after={cut['after']}"[: limit * 3])
    return out


def mismatch_classes(res: VariantResult, cap: Capture) -> dict[str, list[Mismatch]]:
    """The mismatches by class, named from the Debezium messages of their key."""
    by_key, deletes = index_messages(cap)
    classes: dict[str, list[Mismatch]] = {}
    for m in res.mismatches:
        classes.setdefault(explain(m, by_key, deletes), []).append(m)
    return classes


def report(res: VariantResult, cap: Capture, classes: dict[str, list[Mismatch]]) -> str:
    by_key, deletes = index_messages(cap)
    lines = [res.summary(limit=0)]
    for kind, ms in sorted(classes.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {len(ms)} x {kind}\n    e.g. {ms[0]}")
        lines += [f"      {r}" for r in raw_example(ms[0], by_key, deletes)]
    lines += [f"  problem: {p}" for p in res.problems]
    return "\n".join(lines)
