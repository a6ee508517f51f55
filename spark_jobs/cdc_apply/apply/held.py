"""Files with held messages: applied in part, re-read for the rest.

A message is *held* when it cannot be decoded yet but will be later (a CES
split group missing a segment, Qlik data waiting for its metadata message).
Its file stays out of the batch's ledger row, so discovery offers it again;
every other line of the file was accounted for (applied, skipped,
quarantined) by the batch that held it.  This module keeps that exact:

* the source state (``cdc_audit.batches.decoder_state``, carried to the next
  batch) records, per held file, its SHA-256 and the line ranges that were
  held (``HELD_KEY``);
* the next batch that reads the file keeps only the outcomes of those lines
  (``only_held_lines``): a released message is applied once, nothing else of
  the file is counted or quarantined a second time;
* no table records a file in its snapshot summary (``cdc.files``) while the
  file still has held lines (``job._apply_table``), so a table written from
  the file's other lines still takes the events released from it later.

A held file must not change while it is partly applied (archives are
immutable): a different SHA-256 is refused like a changed applied file.  Nor
may it go away: its held messages would then wait for ever, unseen, so a
batch that finds one gone fails, naming it (``gone``), until it is restored
or an operator gives its messages up.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_apply.errors import AlreadyAppliedFileChanged

HELD_KEY = "_cdc_held"
"""Source-state key: path -> {"sha256": ..., "lines": [[first, last], ...], "since": ...}."""
HELD_SINCE = "since"
"""Key of a held file's record: when it was first held (ISO, UTC); hold ages count from it."""


def line_ranges(lines: Iterable[int]) -> list[list[int]]:
    """Sorted line numbers as inclusive [first, last] runs (a file held whole is one run)."""
    out: list[list[int]] = []
    for n in sorted(set(lines)):
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return out


def prior_in_batch(state: dict[str, Any], files: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """The batch's files that an earlier batch held in part (path -> record);
    refuses one whose content changed since."""
    held = state.get(HELD_KEY) or {}
    out = {}
    for f in files:
        rec = held.get(f.path)
        if rec is None:
            continue
        if rec["sha256"] != f.sha256:
            raise AlreadyAppliedFileChanged(
                f"file {f.path} changed (sha256 {rec['sha256'][:12]} -> {f.sha256[:12]}) while messages of it were "
                "held and the rest applied: archives are immutable; restore the original file"
            )
        out[f.path] = rec
    return out


def messages(record: dict[str, Any]) -> int:
    """The number of held messages (lines) of a held-file record."""
    return sum(hi - lo + 1 for lo, hi in record["lines"])


def unread(state: dict[str, Any], files: Iterable[Any]) -> list[str]:
    """The held files a batch of ``files`` does not read."""
    read = {f.path for f in files}
    return [p for p in state.get(HELD_KEY) or {} if p not in read]


def forget(state: dict[str, Any], paths: Iterable[str]) -> list[str]:
    """Drop the records of these held files: the ledger holds them as applied
    (an operator's skip marked them so, held lines and all), or an operator's
    force gave up their messages (``gone``); returns the paths dropped."""
    records = state.get(HELD_KEY) or {}
    done = sorted(set(records) & set(paths))
    if done:
        state[HELD_KEY] = {p: rec for p, rec in records.items() if p not in done}
    return done


def gone(state: dict[str, Any], files: Iterable[Any], exists: Callable[[str], bool]) -> dict[str, dict[str, Any]]:
    """The held files (path -> record) that the batch does not read and the
    archive no longer has (``exists``: ``archive.listing.archive_file_exists``).
    A held file the batch leaves out but the archive still has (outside the
    batch's hours, past its ``max_files``) waits for a later batch."""
    records = state.get(HELD_KEY) or {}
    return {p: records[p] for p in unread(state, files) if not exists(p)}


def summary(state: dict[str, Any], applied: Iterable[str], exists: Callable[[str], bool]) -> dict[str, Any]:
    """What a source holds, for the status an operator reads (``cdc status``,
    the UI's table page): held messages and files, the oldest ``since``, and
    the held files gone from the archive (``gone``: the next batch fails).
    ``applied``: the ledger's applied files (``forget``)."""
    state = dict(state)
    forget(state, applied)
    records = state.get(HELD_KEY) or {}
    return {
        "held_messages": sum(messages(rec) for rec in records.values()),
        "held_files": len(records),
        "held_since": min((rec[HELD_SINCE] for rec in records.values() if HELD_SINCE in rec), default=None),
        "held_files_gone": sorted(gone(state, [], exists)),
    }


def only_held_lines(spark: SparkSession, decoded: DataFrame, prior: dict[str, dict[str, Any]]) -> DataFrame:
    """Outcome rows of ``decoded`` without the lines of partly applied files
    that an earlier batch already accounted for (a no-op without such files)."""
    if not prior:
        return decoded
    ranges = spark.createDataFrame(
        [(path, lo, hi) for path, rec in prior.items() for lo, hi in rec["lines"]], "_h_file string, _h_lo bigint, _h_hi bigint"
    )
    # one pass over the decode (a union of two filters would run it twice); a
    # file's ranges are disjoint, so a row matches at most one of them
    joined = decoded.join(
        F.broadcast(ranges),
        (decoded["file"] == ranges["_h_file"]) & decoded["line"].between(ranges["_h_lo"], ranges["_h_hi"]),
        "left",
    )
    kept = joined.where(~F.col("file").isin(list(prior)) | F.col("_h_file").isNotNull())
    return kept.drop("_h_file", "_h_lo", "_h_hi")


def carry(
    state: dict[str, Any], files: Iterable[Any], held_lines: dict[str, list[int]], now: str | None = None
) -> dict[str, dict[str, Any]]:
    """The held-file record for the next batch: this batch's held lines, plus
    the earlier records of held files this batch did not read.  Each record
    keeps since when its file has been held (``since``, ISO UTC: the
    maximum hold age of transactions is measured from it)."""
    files = list(files)
    read = {f.path for f in files}
    sha = {f.path: f.sha256 for f in files}
    prior = state.get(HELD_KEY) or {}
    out = {p: rec for p, rec in prior.items() if p not in read}
    now = now or dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    for path, lines in held_lines.items():
        out[path] = {"sha256": sha[path], "lines": line_ranges(lines), HELD_SINCE: (prior.get(path) or {}).get(HELD_SINCE, now)}
    return out
