"""Hostile input: messages of all five formats mutated (truncated, bytes
flipped, invalid UTF-8, NUL, out-of-range numbers and dates, wrong types,
missing fields, unknown ops, 10,000-level nesting, a 20 MB line, CRLF, BOM)
mixed with the good messages they came from, plus empty, zero-byte-gzip and
truncated-gzip files.  The job must never die with a traceback for a data
reason; every line read is accounted for exactly (event + quarantined +
skipped + held = read; per table, every event lands in one count); the good
lines' table equals a clean run of the good lines alone.

Mutated copies are renamed to table ``mutts`` before mutation, so a mutated
message that is still valid lands there and never changes the good table."""

from __future__ import annotations

import datetime as dt
import gzip
import importlib
import json
import os
import random
import re
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from tests.formats.synthetic import SyntheticChange
from tests.nemesis.trial import Trial

FORMATS = {  # format -> writer module
    "debezium_postgres": "write_debezium_postgres",
    "debezium_sqlserver": "write_debezium_sqlserver",
    "sqlserver_ces": "write_sqlserver_ces",
    "qlik": "write_qlik",
    "cockroachdb": "write_cockroachdb",
}
EVENT_COUNTS = ("inserted", "updated", "deleted", "noop_deletes", "filled", "superseded", "duplicates", "conflicts", "truncates")
UTC = dt.UTC


def good_lines(fmt: str, rnd: random.Random, n: int) -> list[str]:
    """``n`` changes of table ``items`` in ``fmt`` (Qlik: its metadata message first)."""
    writer = importlib.import_module(f"tests.formats.{FORMATS[fmt]}")
    changes, t0 = [], dt.datetime(2026, 3, 1, 12, tzinfo=UTC)
    for seq in range(1, n + 1):
        key, ts = rnd.randint(1, 40), t0 + dt.timedelta(seconds=seq)
        op = rnd.choice("cuud")
        row = {"id": key, "name": rnd.choice(["a", None, "ü"]), "amount": Decimal(rnd.randint(-999, 999)).scaleb(-2), "updated_at": ts}
        if op == "d":
            changes.append(SyntheticChange("d", {"id": key}, None, {"id": key}, seq, seq, ts))
        else:
            changes.append(SyntheticChange(op, {"id": key}, row, {"id": key} if op == "u" else None, seq, seq, ts))
    # CockroachDB: the enriched envelope, whose messages name their key columns (source.primary_keys).  In the
    # wrapped envelope the key names come only from the sources file, so a line whose topic a mutation damaged
    # ("mu4ts") names a table without a configured key: a configuration refusal of the batch, by the rule for
    # configuration mismatches, since it cannot be told from a new table (README, Reliability)
    lines = writer.write_messages(changes, envelope="enriched") if fmt == "cockroachdb" else writer.write_messages(changes)
    return [writer.metadata_message(), *lines] if fmt == "qlik" and not lines[0].startswith('{"schemaId"') else lines


# -- mutations: each takes a line (text) and returns bytes ------------------------------------


def _walk(obj: Any, rnd: random.Random, depth: int = 0) -> tuple[Any, Any] | None:
    """A random (container, key) inside a parsed message; JSON text in strings is not entered."""
    slots = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj)) if isinstance(obj, list) else []
    if not slots:
        return None
    k, v = rnd.choice(slots)
    if isinstance(v, (dict, list)) and v and rnd.random() < 0.7:
        deeper = _walk(v, rnd, depth + 1)
        if deeper:
            return deeper
    return obj, k


def _structured(line: str, rnd: random.Random, how: str) -> bytes:
    try:
        obj = json.loads(line)
    except ValueError:
        return line.encode()
    for _ in range(5):  # a string holding JSON (CES data, Kafka values as text) is mutated inside, sometimes
        spot = _walk(obj, rnd)
        if spot is None:
            break
        container, key = spot
        value = container[key]
        if isinstance(value, str) and value[:1] in "{[" and rnd.random() < 0.6:
            container[key] = _structured(value, rnd, how).decode("utf-8", "replace")
            return json.dumps(obj).encode()
        if how == "missing" and isinstance(container, dict):
            del container[key]
        elif how == "wrong-type":
            container[key] = rnd.choice([[], {}, True, "x", 1.5, None, -1, "2026-13-45", {"a": [1]}])
        elif how == "unknown-op":
            for name in ("op", "operation", "__op", "header__change_oper"):
                if isinstance(container, dict) and name in container:
                    container[name] = rnd.choice(["zz", "", "C ", "delete", 7])
        elif how == "out-of-range":
            container[key] = rnd.choice([10**40, -(10**40), 1e308, "99999-12-31T00:00:00Z", "0000-00-00", 2**64, "NaN", "1e999"])
        break
    return json.dumps(obj).encode()


def mutate(line: str, rnd: random.Random, big: bool = False) -> tuple[str, bytes]:
    """One mutation of ``line``: (its name, the bytes of the mutated line, without newline)."""
    raw = line.encode()
    how = rnd.choice(
        [
            "truncate",
            "flip",
            "utf8",
            "nul",
            "numbers",
            "dates",
            "missing",
            "wrong-type",
            "unknown-op",
            "out-of-range",
            "nesting",
            "crlf",
            "bom",
            "backslash",
        ]
        + (["huge"] if big else [])
    )
    if how == "truncate":
        return how, raw[: rnd.randrange(0, max(1, len(raw)))]
    if how == "flip":
        b = bytearray(raw)
        for _ in range(rnd.randint(1, 3)):
            i = rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
        return how, bytes(b).replace(b"\n", b" ")
    if how == "utf8":
        i = rnd.randrange(len(raw))
        return how, raw[:i] + rnd.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"]) + raw[i:]
    if how == "nul":
        i = rnd.randrange(len(raw))
        return how, raw[:i] + b"\x00" + raw[i:]
    if how == "numbers":
        return how, re.sub(
            rb"\d+", lambda m: rnd.choice([b"9" * 40, b"-" + m.group(0), b"1e400", m.group(0)]), raw, count=rnd.randint(1, 5)
        )
    if how == "dates":
        return how, re.sub(rb"2026-0\d-0\d", lambda m: rnd.choice([b"2026-13-45", b"99999-01-01", b"0000-00-00", b"-0001-01-01"]), raw)
    if how == "nesting":
        depth = rnd.choice([100, 10_000])
        return how, b"[" * depth + raw + b"]" * depth if rnd.random() < 0.5 else raw[:-1] + b',"deep":' + b"[" * depth + b"]" * depth + b"}"
    if how == "crlf":
        return how, raw + b"\r"
    if how == "bom":
        return how, b"\xef\xbb\xbf" + raw
    if how == "backslash":
        i = rnd.randrange(len(raw))
        return how, raw[:i] + b"\\" + raw[i:]
    if how == "huge":
        return how, raw[:-1] + b',"pad":"' + b"x" * (20 * 1024 * 1024) + b'"}'
    return how, _structured(line, rnd, how)


# -- one trial -------------------------------------------------------------------------------


def _sources_file(path: Path, source: str, fmt: str) -> None:
    tables = {t: {"primary_key": ["id"]} for t in ("items", "mutts")}
    path.write_text(json.dumps({"sources": {source: {"format": fmt, "namespace": source, "tables": tables, "quarantine_max_share": 1.0}}}))


def _run(spark, source: str, files: list[Path], sources_file: Path, fmt: str):
    from cdc_apply.archive.listing import list_files
    from cdc_apply.batch import run_batch
    from cdc_apply.config import Settings

    _sources_file(sources_file, source, fmt)
    os.environ["CDC_SOURCES_FILE"] = str(sources_file)
    settings = Settings.from_env()
    listed = [f for f in list_files(files[0].parents[1]) if Path(f.path) in files]
    return settings, run_batch(settings, source, listed, spark=spark)


def _live(spark, settings, source: str, table: str) -> list:
    ident = f"{settings.catalog_name}.{source}.{table}"
    if not spark.catalog.tableExists(ident):
        return []
    return sorted(map(str, spark.sql(f"SELECT * EXCEPT (_cdc_batch_id, _cdc_applied_at) FROM {ident}").collect()))


def reference(fmt: str, files: list[Path]) -> tuple[int, int]:
    """(non-blank lines, outcomes) of ``files`` as the plain-Python reference
    decoder (``decode_all``, the job's one semantics) reads them: the job's
    ``read`` must equal the outcomes (a line can give more than one: a Qlik
    primary-key change is a delete and an insert, a webhook batch one per
    element), and every non-blank line must have an outcome (a line a
    mutation truncated to nothing is blank: not a message)."""
    import functools

    from cdc_apply.archive.lines import iter_lines, open_archive
    from cdc_apply.decode import DecodeContext, make_decoder
    from cdc_apply.decode.base import decode_all
    from cdc_apply.model import Quarantined, RawMessage

    msgs, unread = [], []
    for f in files:
        for item in iter_lines(str(f), functools.partial(open_archive, str(f))):
            if isinstance(item, RawMessage):
                msgs.append(item)
            else:
                unread.append(Quarantined(item[2], item[1], str(f), item[0]))
    keys = {t: ["id"] for t in ("items", "mutts")}
    outcomes = list(decode_all(make_decoder(fmt, DecodeContext(source="ref", primary_keys=keys)), msgs)) + unread
    lines = {(m.file, m.line) for m in msgs if m.text.strip()} | {(q.file, q.line) for q in unread}
    missing = lines - {(o.file, o.line) for o in outcomes}
    if missing:
        raise AssertionError(f"lines without an outcome in the reference decode: {sorted(missing)[:5]}")
    return len(lines), len(outcomes)


def _account(result, trial: Trial, expected_read: int | None) -> None:
    m = result.messages or {}
    parts = sum(m.get(k, 0) for k in ("event", "quarantined", "skipped", "held"))
    if m.get("read") != parts:
        trial.problems.append(f"read {m.get('read')} != event + quarantined + skipped + held = {parts}: {m}")
    if expected_read is not None and m.get("read") != expected_read:
        trial.problems.append(f"{expected_read} outcomes in the reference decode of the lines written, {m.get('read')} read: {m}")
    in_tables = sum((t.counts or {}).get(k, 0) for t in result.tables if t.status != "refused" for k in EVENT_COUNTS)
    if result.status == "complete" and in_tables != m.get("event", 0):
        trial.problems.append(
            f"{m.get('event')} events, the tables account for {in_tables}: {[(t.table, t.status, t.counts) for t in result.tables]}"
        )


def format_trial(spark, work: Path, fmt: str, seed: int, mutations: int, big: bool = False) -> Trial:
    """Good and mutated lines of ``fmt`` in a few files (one gzip), plus the
    special files, applied as one batch; the damaged gzip files as a second."""
    trial = Trial("hostile", f"{fmt} seed {seed}")
    t0, rnd = time.time(), random.Random(seed)
    tag = f"h{seed % 10**8}_{fmt[:6]}"
    good = good_lines(fmt, rnd, 60)
    head = good[:1] if fmt == "qlik" else []
    # the copies to mutate are other messages of other transactions: a garbage twin must not share a
    # good line's transaction (with publish: transactions its failed table would hold the good one back)
    mutts = [re.sub(r'("transactionId":\s*")', r"\1f", g.replace("items", "mutts")) for g in good]
    lines: list[bytes] = [g.encode() for g in good]
    kinds: dict[str, int] = {}
    for i in range(mutations):
        how, raw = mutate(rnd.choice(mutts[1:] if head else mutts), rnd, big=big and i == 0)
        kinds[how] = kinds.get(how, 0) + 1
        lines.append(raw)
    body = lines[len(head) :]
    rnd.shuffle(body)
    lines = [g.encode() for g in head] + ([mutts[0].encode()] if head else []) + body
    root = work / tag / "2026/03/01/12"
    root.mkdir(parents=True, exist_ok=True)
    cut = len(lines) // 2
    files = [root / "a.jsonl", root / "b.jsonl.gz", root / "c_empty.jsonl", root / "d_zero.jsonl.gz", root / "e_crlf_bom.jsonl"]
    files[0].write_bytes(b"\n".join(lines[:cut]) + b"\n")
    files[1].write_bytes(gzip.compress(b"\n".join(lines[cut:]) + b"\n"))
    files[2].write_bytes(b"")
    files[3].write_bytes(b"")
    crlf = [g.encode() for g in head] + [g.encode() for g in good[len(head) :][:5]]
    files[4].write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(crlf) + b"\r\n")
    lines_read, written = reference(fmt, files)
    trial.figures["mutated"] = mutations
    trial.notes.append(f"{len(lines) + len(crlf)} lines written, {lines_read} not blank, {written} outcomes")
    try:
        settings, result = _run(spark, tag, files, work / f"{tag}.yaml", fmt)
    except Exception as exc:  # a traceback for a data reason
        trial.problems.append(f"the batch died: {type(exc).__name__}: {str(exc)[:1500]}")
        trial.seconds = time.time() - t0
        return trial
    _account(result, trial, written)
    trial.figures["accounted"] = mutations if not trial.problems else 0
    trial.figures["quarantined"] = result.messages.get("quarantined", 0)
    items = [t for t in result.tables if t.table.endswith(".items")]
    if not items or items[0].status != "published":
        trial.problems.append(f"the good table was not published: {[(t.table, t.status, t.message) for t in result.tables]}")
    # the good lines alone, in a clean source: the good table must be the same
    clean = work / f"{tag}c" / "2026/03/01/12"
    clean.mkdir(parents=True, exist_ok=True)
    (clean / "a.jsonl").write_text("\n".join(good + crlf_text(head, good)) + "\n")
    settings, _ = _run(spark, tag + "c", [clean / "a.jsonl"], work / f"{tag}c.yaml", fmt)
    want, got = _live(spark, settings, tag + "c", "items"), _live(spark, settings, tag, "items")
    if want != got:
        trial.problems.append(
            f"the good table differs from the good lines applied alone: {len(want)} vs {len(got)} rows; "
            f"first difference {sorted(set(want) ^ set(got))[:2]}"
        )
    _damaged_gzip(spark, work, tag, fmt, good, trial)
    trial.notes.append(", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    trial.seconds = time.time() - t0
    return trial


def crlf_text(head: list[str], good: list[str]) -> list[str]:
    """The CRLF file's lines again (duplicates of good lines: they change nothing)."""
    return good[len(head) :][:5]


def _damaged_gzip(spark, work: Path, tag: str, fmt: str, good: list[str], trial: Trial) -> None:
    """A truncated gzip file and a gzip file with a corrupt member: one
    quarantine row for the unreadable part, never a crash."""
    root = work / tag / "2026/03/01/13"
    root.mkdir(parents=True, exist_ok=True)
    whole = gzip.compress(("\n".join(good) + "\n").encode())
    files = [root / "t_truncated.jsonl.gz", root / "u_corrupt.jsonl.gz"]
    files[0].write_bytes(whole[: len(whole) * 2 // 3])
    bad = bytearray(whole)
    bad[len(bad) // 2] ^= 0xFF
    files[1].write_bytes(gzip.compress(b"") + bytes(bad))
    try:
        _, result = _run(spark, tag, files, work / f"{tag}.yaml", fmt)
    except Exception as exc:
        trial.problems.append(f"the damaged gzip batch died: {type(exc).__name__}: {str(exc)[:1500]}")
        return
    _account(result, trial, None)
    reasons = result.messages.get("quarantined", 0)
    if reasons < 2:
        trial.problems.append(f"damaged gzip files not quarantined (one row each expected): {result.messages}")


def hostile_trial(spark, settings, work: Path, seed: int, mutations: int) -> Trial:
    """Every format once, ``mutations`` mutated messages each (one 20 MB line in one format)."""
    rnd = random.Random(seed)
    big = rnd.choice(list(FORMATS))
    out = Trial("hostile", f"all formats seed {seed}")
    for fmt in FORMATS:
        t = format_trial(spark, work, fmt, rnd.randrange(2**31), mutations, big=fmt == big)
        out.problems += [f"{fmt}: {p}" for p in t.problems]
        out.notes.append(f"{fmt}: {t.notes[-1] if t.notes else ''}")
        for k, v in t.figures.items():
            out.figures[k] = out.figures.get(k, 0) + v
        out.seconds += t.seconds
    return out
