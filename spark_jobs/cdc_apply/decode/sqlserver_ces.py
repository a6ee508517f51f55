"""SQL Server 2025 Change Event Streaming (CES) decoder: CloudEvents as JSON.

Spec: ``/work/shared/formats/sqlserver-ces-cloudevents.txt``.  One archived
line is one CloudEvent ``{specversion, type, source, id, logicalid, time,
datacontenttype, operation, <split attributes>, data}``; ``data`` is a *string*
holding ``{"eventsource": {db, schema, tbl, cols[{name, type, index}],
pkkey[{columnname, value}], transaction{commitlsn, beginlsn, sequencenumber,
committime}}, "eventrow": {"old": "<json>", "current": "<json>"}}`` (the row
images are JSON objects wrapped in strings once more).  ``operation`` INS / UPD
/ DEL -> Op c / u / d.  CES has no snapshot, no truncate and no partial rows.

Position (fixed width, string order == log order)::

    <commit LSN: 20 lowercase hex digits>|<sequencenumber: 20 decimal digits>

e.g. ``0000002c00000300017c|00000000000000000001``.  The commit LSN is taken
from ``eventsource.transaction.commitlsn`` in any of the spellings
``0000002C00000300017C``, ``0x0000002C00000300017C`` or
``0000002C:00000300:017C`` (VLF:block:slot, zero-filled to 8:8:4).  The
sequence number is the tie-breaker of the changes of one commit.  Without
``eventsource.transaction`` (the spec's own three examples have none) the
position is read from ``logicalid`` = ``<guid>:<commit LSN, 20 hex
digits>:<sequence, 20 digits>`` (it orders the examples insert < update <
delete); a message with neither quarantines.  When both are present the
transaction wins and a ``logicalid`` that disagrees with it is flagged in
``notes`` (the event is kept: the transaction object is the documented data
schema, the logicalid's layout is only read off the examples).  A
``logicalid`` of another shape is only a split-group id.  ``tx_id`` is the
commit LSN (one per transaction); ``commit_ts_us`` is
``transaction.committime`` (text without a zone is read as UTC), else the
CloudEvent ``time``.  ``change_id`` is the CloudEvent ``id``: the two events
of a primary-key change (below) share it.

Values arrive as strings and are cast by the column's SQL type from ``cols``
(see ``spark_type``) through ``canonical_value``; a value that does not fit
quarantines the message.  Choices the spec leaves open:

* tinyint is 0..255 in SQL Server, so it maps to Spark ``smallint``;
* binary / varbinary / image / rowversion: ``0x`` + an even number of hex
  digits (SQL Server's literal form) is read as hex, anything else must be
  strict base64 (SQL Server's JSON form); canonical text is base64;
* datetime / datetime2 / smalldatetime -> ``timestamp_ntz`` (an offset in the
  value quarantines); datetimeoffset -> ``timestamp`` (the offset is required,
  SQL Server's ``... +01:00`` with a space is accepted); digits beyond
  microseconds are truncated with a note;
* row images are full rows: a column declared in ``cols`` but absent from the
  image is NULL (SQL Server's JSON omits NULLs), listed in ``notes``; a column
  in the image that ``cols`` does not declare quarantines;
* values of 1 MiB or more are flagged in ``notes`` (the source truncates them);
* an unknown SQL type becomes ``string`` with a note.

Keys: ``pkkey`` column names (else ``DecodeContext.configured_key``; neither ->
quarantine).  pkkey values are cross-checked with the row image (``current``,
or ``old`` for DEL; a DEL with ``old`` = ``{}`` takes its key from pkkey).  An
UPD whose ``old`` image has another key becomes a delete of the old key plus an
insert of the new one at the same position; an UPD without ``old`` whose pkkey
differs from ``current`` quarantines (we cannot tell which key is old).

Split messages (one logical event over several CloudEvents sharing
``logicalid``): the examples spell the attributes ``splitindex`` /
``splittotalcnt`` (``0``/``0`` when not split; a group of *n* may number its
segments 0..n-1 or 1..n, mixing both quarantines), the attribute list
``segmentindex`` / ``finalsegment`` (0-based, complete when 0..final are all
there).  Segments are driver-side: ``absorb`` groups them by (source,
logicalid), concatenates ``data`` in index order and decodes the whole.  The
event carries the first segment's file / line / id; the other segments are
``Skipped('split-segment')``.  An incomplete group is ``Held('incomplete-split')``
per segment (the file is read again next batch).  Duplicate delivery is
tolerated: a segment whose (source, id) was seen is ``Skipped('duplicate-id')``;
one with another id but the same index and identical data is
``Skipped('duplicate-segment')``; the same index with *different* data, or
segments disagreeing on operation / type / count, quarantine the whole group.
Groups resolved (reassembled, or quarantined) are remembered across batches in
``ctx.state['sqlserver_ces']['applied_splits']`` (the last
``APPLIED_SPLITS_MAX`` (source, logicalid) pairs): a segment re-sent after its
message was resolved in an earlier batch is ``Skipped('duplicate-segment')``
instead of an incomplete group that would keep its file pending for ever.

Duplicate ids: ``decode_message`` is stateless (Spark decodes on several
executors), so it only records the CloudEvent ``id`` in
``ChangeEvent.message_id``.  ``dedupe_ids`` turns the 2nd and later message with
one id into ``Skipped('duplicate-id')``; callers of ``decode_all`` use it
(``decode_all_deduped``), and the apply layer also drops same-(key, position)
duplicates, which covers redeliveries across executors and batches.  ``source``
is not part of ChangeEvent, so ``dedupe_ids`` keys on the id alone: one decode
run covers one configured source, and CES ids are GUIDs.
"""

from __future__ import annotations

import base64
import binascii
import copy
import datetime as dt
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal, overload

import orjson

from cdc_apply.decode.base import (
    DecodeContext,
    Decoder,
    check_identifier,
    decode_all,
    quarantine,
)
from cdc_apply.model import (
    ChangeEvent,
    Column,
    DecodeError,
    Format,
    Held,
    Op,
    Outcome,
    Quarantined,
    RawMessage,
    Skipped,
    canonical_value,
    decimal_type,
    epoch_micros,
    pad_decimal,
    parse_iso_datetime,
)

OPERATIONS = {"INS": Op.INSERT, "UPD": Op.UPDATE, "DEL": Op.DELETE}
EVENT_TYPE_PREFIX = "com.microsoft.SQL.CES.DML."
LARGE_VALUE = 1 << 20  # CES truncates column values over 1 MB

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HEX = re.compile(r"^[0-9a-fA-F]*$")
_SQL_TYPE = re.compile(r"^([a-z][a-z0-9_ ]*?)\s*(?:\(\s*([^)]*?)\s*\))?$")
_LOGICALID = re.compile(r"^.+:([0-9A-Fa-f]{20}):([0-9]{20})$")
STATE_KEY = "sqlserver_ces"
APPLIED_SPLITS_MAX = 10_000  # resolved split groups remembered across batches (a bounded memory)
_NOT_SPLIT = re.compile(r'"splittotalcnt"\s*:\s*[01]\s*[,}]')  # inside data the quotes are escaped
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_DATETIME = re.compile(r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2})(:\d{2})?(?:\.(\d{1,9}))?\s*(Z|z|[+-]\d{2}:?\d{2})?$")

_STRING_TYPES = {"char", "varchar", "nchar", "nvarchar", "text", "ntext", "sysname", "xml", "json", "uniqueidentifier", "time"}
_BINARY_TYPES = {"binary", "varbinary", "image", "rowversion", "timestamp"}
_SAME_INT = {"bigint": "bigint", "int": "int", "smallint": "smallint", "tinyint": "smallint"}


# --------------------------------------------------------------------------
# Small pure helpers


def spark_type(sql_type: Any) -> tuple[str, bool]:
    """SQL Server type text from ``cols[].type`` -> (Spark SQL type, known)."""
    if not isinstance(sql_type, str):
        raise DecodeError(f"column type must be a string, got {sql_type!r}")
    m = _SQL_TYPE.match(sql_type.strip().lower())
    if not m:
        return "string", False
    base, args = m.group(1).strip(), m.group(2)
    if base in _SAME_INT:
        return _SAME_INT[base], True
    if base == "bit":
        return "boolean", True
    if base in ("decimal", "numeric"):
        parts = [p.strip() for p in args.split(",")] if args else []
        if not all(p.isdigit() for p in parts) or len(parts) > 2:
            raise DecodeError(f"unreadable decimal type {sql_type!r}")
        precision = int(parts[0]) if parts else 18
        scale = int(parts[1]) if len(parts) > 1 else 0
        return decimal_type(precision, scale), True
    if base == "money":
        return "decimal(19,4)", True
    if base == "smallmoney":
        return "decimal(10,4)", True
    if base == "float":
        if args and args.isdigit() and int(args) <= 24:
            return "float", True  # float(1..24) is real
        return "double", True
    if base == "real":
        return "float", True
    if base == "date":
        return "date", True
    if base in ("datetime", "datetime2", "smalldatetime"):
        return "timestamp_ntz", True
    if base == "datetimeoffset":
        return "timestamp", True
    if base in _STRING_TYPES:
        return "string", True
    if base in _BINARY_TYPES:
        return "binary", True
    return "string", False


def normalise_lsn(value: Any) -> str:
    """A commit LSN as 20 lowercase hex digits (string order == LSN order)."""
    if not isinstance(value, str):
        raise DecodeError(f"commitlsn must be a string, got {value!r}")
    text = value.strip()
    if text[:2] in ("0x", "0X"):
        text = text[2:]
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3 or any(not p or not _HEX.match(p) for p in parts) or any(len(p) > w for p, w in zip(parts, (8, 8, 4))):
            raise DecodeError(f"commitlsn {value!r} is not VLF:block:slot hex")
        text = parts[0].zfill(8) + parts[1].zfill(8) + parts[2].zfill(4)
    if len(text) != 20 or not _HEX.match(text):
        raise DecodeError(f"commitlsn {value!r} is not a 20-hex-digit LSN")
    return text.lower()


def logicalid_position(logicalid: Any) -> tuple[str, int] | None:
    """(commit LSN, sequence number) of a ``<guid>:<20 hex>:<20 digits>``
    logicalid; None for any other shape (then it is only a group id)."""
    m = _LOGICALID.match(logicalid) if isinstance(logicalid, str) else None
    return (m.group(1).lower(), int(m.group(2))) if m else None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise DecodeError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and value.strip().isdigit():
        n = int(value.strip())
    else:
        raise DecodeError(f"{what} must be an integer, got {value!r}")
    if n < 0:
        raise DecodeError(f"{what} must not be negative, got {n}")
    return n


def _timestamp_text(value: Any, spark: str, column: str, notes: list[str]) -> str | None:
    """SQL Server datetime text -> canonical timestamp(_ntz) text, strictly."""
    if not isinstance(value, str):
        raise DecodeError(f"{value!r} is not a date-time text")
    m = _DATETIME.match(value.strip())
    if not m:
        raise DecodeError(f"{value!r} is not a date-time")
    date, hm, sec, frac, offset = m.groups()
    frac = frac or ""
    if frac[6:].strip("0"):
        notes.append(f"column {column}: sub-microsecond digits of {value!r} truncated")
    if spark == "timestamp_ntz" and offset:
        raise DecodeError(f"{value!r} has a zone offset but the column has no time zone")
    if spark == "timestamp" and not offset:
        raise DecodeError(f"{value!r} lacks the zone offset of a datetimeoffset")
    if offset and offset not in ("Z", "z") and ":" not in offset:
        offset = offset[:3] + ":" + offset[3:]
    iso = f"{date}T{hm}{sec or ':00'}.{frac[:6].ljust(6, '0')}{offset or ''}"
    try:
        stamp = dt.datetime.fromisoformat(iso)
        if stamp.tzinfo is not None:
            stamp = stamp.astimezone(dt.UTC).replace(tzinfo=None)
    except (ValueError, OverflowError) as exc:
        raise DecodeError(f"{value!r} is not a valid date-time: {exc}") from exc
    # isoformat, not strftime: strftime drops the zero padding of years < 1000
    return stamp.isoformat(sep=" ", timespec="microseconds")


def _binary_text(value: Any) -> str | None:
    if not isinstance(value, str):
        raise DecodeError(f"{value!r} is not binary text")
    text = value.strip()
    if text[:2] in ("0x", "0X") and _HEX.match(text[2:]) and len(text) % 2 == 0:
        return canonical_value("binary", bytes.fromhex(text[2:]))
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"{value[:40]!r} is neither 0x-hex nor base64") from exc
    return text


def cast_value(sql_type: str, spark: str, value: Any, column: str, notes: list[str]) -> str | None:
    """One row value (a string in CES) -> canonical text for ``spark``."""
    if value is None:
        return None
    try:
        if isinstance(value, str) and len(value) >= LARGE_VALUE:
            notes.append(f"column {column}: value of {len(value)} characters may be truncated by the source")
        if spark in ("timestamp", "timestamp_ntz"):
            return _timestamp_text(value, spark, column, notes)
        if spark == "date" and not (isinstance(value, str) and _DATE.match(value.strip())):
            raise DecodeError(f"{value!r} is not a date")
        if spark == "binary":
            return _binary_text(value)
        return canonical_value(spark, value)
    except DecodeError as exc:
        raise DecodeError(f"column {column} ({sql_type}): {exc}") from exc


def _json_object(text: Any, what: str) -> dict[str, Any]:
    """A JSON object wrapped in a string; floats parse as Decimal (exact)."""
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        return text
    if not isinstance(text, str):
        raise DecodeError(f"{what} must be a JSON string, got {type(text).__name__}")
    try:
        obj = json.loads(text, parse_float=Decimal)
    except ValueError as exc:
        raise DecodeError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise DecodeError(f"{what} is not a JSON object")
    return obj


@overload
def _str_attr(env: dict[str, Any], name: str, *, required: Literal[True] = True) -> str: ...
@overload
def _str_attr(env: dict[str, Any], name: str, *, required: bool) -> str | None: ...
def _str_attr(env: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = env.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise DecodeError(f"CloudEvent attribute {name!r} missing or not a non-empty string")
    if _CONTROL.search(value):
        raise DecodeError(f"CloudEvent attribute {name!r} contains a control character")
    return value


# --------------------------------------------------------------------------
# Envelope and split attributes


@dataclass(frozen=True)
class Segment:
    """Split attributes of one CloudEvent (``style`` names the spelling)."""

    style: str  # 'split' (splitindex/splittotalcnt) or 'segment' (segmentindex/finalsegment)
    index: int
    total: int | None = None
    final: bool | None = None

    @property
    def is_split(self) -> bool:
        if self.style == "split":
            return (self.total or 0) > 1
        return not (self.index == 0 and self.final)


def parse_envelope(msg: RawMessage) -> dict[str, Any]:
    try:
        env = orjson.loads(msg.text)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"malformed JSON envelope: {exc}") from exc
    if not isinstance(env, dict):
        raise DecodeError("CloudEvent is not a JSON object")
    return env


def segment_of(env: dict[str, Any]) -> Segment | None:
    """The message's split attributes (None when it carries neither spelling)."""
    split = seg = None
    if "splitindex" in env or "splittotalcnt" in env:
        index = _int(env.get("splitindex"), "splitindex")
        total = _int(env.get("splittotalcnt"), "splittotalcnt")
        if total > 1 and index > total:
            raise DecodeError(f"splitindex {index} beyond splittotalcnt {total}")
        if total <= 1 and index > total:
            raise DecodeError(f"splitindex {index} with splittotalcnt {total}")
        split = Segment("split", index, total=total)
    if "segmentindex" in env or "finalsegment" in env:
        final = env.get("finalsegment")
        if not isinstance(final, bool):
            raise DecodeError(f"finalsegment must be a boolean, got {final!r}")
        seg = Segment("segment", _int(env.get("segmentindex"), "segmentindex"), final=final)
    if split and seg and split.is_split != seg.is_split:
        raise DecodeError("splitindex/splittotalcnt and segmentindex/finalsegment disagree")
    return split or seg


# --------------------------------------------------------------------------
# Decoder


class SqlServerCesDecoder(Decoder):
    """CES CloudEvents (JSON) -> canonical changes; split segments on the driver."""

    format = Format.SQLSERVER_CES

    def __init__(self, ctx: DecodeContext | None = None) -> None:
        ctx = ctx or DecodeContext()
        # own copy: absorbing must not mutate the caller's (ledger's) state dict
        super().__init__(DecodeContext(source=ctx.source, primary_keys=ctx.primary_keys, state=copy.deepcopy(ctx.state)))
        st = self.ctx.state.setdefault(STATE_KEY, {})
        if not isinstance(st, dict) or not isinstance(st.setdefault("applied_splits", []), list):
            raise ValueError(f"decoder state {STATE_KEY!r} is not an object with an applied_splits list")
        self._applied_splits = {tuple(pair) for pair in st["applied_splits"]}

    def _remember_split(self, source: str, logicalid: str) -> None:
        """Record a resolved split group; the oldest are forgotten past ``APPLIED_SPLITS_MAX``."""
        if (source, logicalid) in self._applied_splits:
            return
        kept = self.ctx.state[STATE_KEY]["applied_splits"]
        kept.append([source, logicalid])
        self._applied_splits.add((source, logicalid))
        while len(kept) > APPLIED_SPLITS_MAX:
            self._applied_splits.discard(tuple(kept.pop(0)))

    def export_state(self) -> dict[str, Any]:
        return copy.deepcopy(self.ctx.state)

    @classmethod
    def sniff(cls, text: str) -> bool:
        return '"specversion"' in text and EVENT_TYPE_PREFIX.rstrip(".") in text

    # -- executor side -------------------------------------------------------
    def decode_message(self, msg: RawMessage) -> list[Outcome]:
        env = parse_envelope(msg)
        seg = segment_of(env)
        if seg is not None and seg.is_split:  # not absorbed: wait for the driver pass
            return [Held("incomplete-split", file=msg.file, line=msg.line, group=env.get("logicalid"))]
        data = env.get("data")
        if data is None:
            raise DecodeError("CloudEvent has no data")
        if not isinstance(data, str):
            raise DecodeError(f"data must be a string holding JSON, got {type(data).__name__}")
        return self.decode_event(env, data, msg)

    def decode_event(self, env: dict[str, Any], data_text: str, msg: RawMessage) -> list[Outcome]:
        """Decode one (possibly reassembled) event whose ``data`` is ``data_text``.

        Long because it checks the CloudEvents attributes in the order the
        spec lists them, one check each."""
        _str_attr(env, "specversion")
        if not str(env["specversion"]).startswith("1."):
            raise DecodeError(f"unsupported CloudEvents specversion {env['specversion']!r}")
        ev_type = _str_attr(env, "type")
        if not ev_type.startswith(EVENT_TYPE_PREFIX):
            raise DecodeError(f"unsupported CloudEvent type {ev_type!r} (expected {EVENT_TYPE_PREFIX}*)")
        _str_attr(env, "source")
        message_id = _str_attr(env, "id")
        op_text = env.get("operation")
        op = OPERATIONS.get(op_text.strip().upper()) if isinstance(op_text, str) else None
        if op is None:
            raise DecodeError(f"unknown operation {op_text!r} (expected INS, UPD or DEL)")
        try:
            data = orjson.loads(data_text)
        except orjson.JSONDecodeError as exc:
            raise DecodeError(f"data is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise DecodeError("data is not a JSON object")
        source = data.get("eventsource")
        if not isinstance(source, dict):
            raise DecodeError("data has no eventsource object")
        row = data.get("eventrow", data.get("eventdata"))  # the spec's prose once says eventdata
        if not isinstance(row, dict):
            raise DecodeError("data has no eventrow object")

        database = check_identifier(source.get("db"), "eventsource.db")
        schema = check_identifier(source.get("schema"), "eventsource.schema")
        table = check_identifier(source.get("tbl"), "eventsource.tbl")
        notes: list[str] = []
        cols = self._columns(source.get("cols"), notes)
        position, tx_id, commit_ts_us = self._position(source.get("transaction"), env, notes)
        key_columns, pk_values = self._key(source.get("pkkey"), cols, database, schema, table, notes)

        old = self._image(_json_object(row.get("old"), "eventrow.old"), cols, "old", notes)
        current = self._image(_json_object(row.get("current"), "eventrow.current"), cols, "current", notes)

        def event(
            ev_op: Op, after: dict[str, str | None], before: dict[str, str | None] | None, extra: tuple[str, ...] = ()
        ) -> ChangeEvent:
            return ChangeEvent(
                format=self.format.value,
                database=database,
                schema=schema,
                table=table,
                op=ev_op,
                key_columns=list(key_columns),
                after=after,
                before=before,
                position=position,
                columns=[Column(n, s, nullable=n not in key_columns) for n, (_, s) in cols.items()],
                tx_id=tx_id,
                commit_ts_us=commit_ts_us,
                file=msg.file,
                line=msg.line,
                message_id=message_id,
                notes=notes + list(extra),
                change_id=message_id,
            )

        if op is Op.DELETE:
            before = old if old else {}
            self._match_key(before, pk_values, key_columns, "old", fill=True)
            return [event(Op.DELETE, {}, before)]
        if not current:
            raise DecodeError(f"{op_text} without a current row image")
        if op is Op.INSERT:
            self._match_key(current, pk_values, key_columns, "current")
            extra = ("INS carries an old image; ignored",) if old else ()
            return [event(Op.INSERT, current, None, extra)]
        self._require_key(current, key_columns, "current")
        if old:
            self._require_key(old, key_columns, "old")
            old_key, new_key = (tuple(img[k] for k in key_columns) for img in (old, current))
            if old_key != new_key:
                if pk_values and tuple(pk_values[k] for k in key_columns) not in (old_key, new_key):
                    raise DecodeError(f"pkkey {pk_values} matches neither the old nor the current key")
                note = ("primary-key change: delete of the old key + insert of the new key",)
                return [event(Op.DELETE, {}, old, note), event(Op.INSERT, current, None, note)]
        try:
            self._match_key(current, pk_values, key_columns, "current")
        except DecodeError as exc:
            raise DecodeError(f"{exc} (a primary-key update without an old image?)") from exc
        return [event(Op.UPDATE, current, old or None)]

    # -- pieces --------------------------------------------------------------
    @staticmethod
    def _columns(cols: Any, notes: list[str]) -> dict[str, tuple[str, str]]:
        """name -> (SQL type, Spark type), in ``index`` order."""
        if not isinstance(cols, list) or not cols:
            raise DecodeError("eventsource.cols missing or empty")
        seen_index: set[int] = set()
        specs: list[tuple[int, str, Any, str]] = []  # (index, name, SQL type as given, Spark type)
        for c in cols:
            if not isinstance(c, dict):
                raise DecodeError(f"eventsource.cols entry is not an object: {c!r}")
            name = check_identifier(c.get("name"), "column name")
            index = _int(c.get("index"), f"index of column {name}")
            if index in seen_index:
                raise DecodeError(f"column index {index} declared twice")
            seen_index.add(index)
            sql = c.get("type")
            spark, known = spark_type(sql)
            if not known:
                notes.append(f"column {name}: unknown SQL type {sql!r} kept as string")
            specs.append((index, name, sql, spark))
        out: dict[str, tuple[str, str]] = {}
        for _, name, sql, spark in sorted(specs):
            if name in out:
                raise DecodeError(f"column {name} declared twice")
            out[name] = (sql, spark)
        return out

    @staticmethod
    def _position(tx: Any, env: dict[str, Any], notes: list[str]) -> tuple[str, str, int | None]:
        """(position, tx id, commit time): from the transaction, else the logicalid."""
        from_id = logicalid_position(env.get("logicalid"))
        if isinstance(tx, dict):
            lsn = normalise_lsn(tx.get("commitlsn"))
            if tx.get("beginlsn") is not None:
                normalise_lsn(tx["beginlsn"])  # validated only
            seq = _int(tx.get("sequencenumber"), "transaction.sequencenumber")
            if from_id is not None and from_id != (lsn, seq):
                notes.append(
                    f"logicalid position {from_id[0]}|{from_id[1]} disagrees with eventsource.transaction "
                    f"{lsn}|{seq}; the transaction is used"
                )
        elif from_id is not None:
            lsn, seq = from_id
        else:
            raise DecodeError(
                f"eventsource.transaction missing and logicalid {env.get('logicalid')!r} is not "
                "<guid>:<commit LSN, 20 hex digits>:<sequence, 20 digits>: nothing orders the change"
            )
        position = f"{lsn}|{pad_decimal(seq, 20)}"
        stamp = (tx.get("committime") if isinstance(tx, dict) else None) or env.get("time")
        commit_ts_us = None
        if stamp is not None:
            if not isinstance(stamp, str):
                raise DecodeError(f"committime must be a string, got {stamp!r}")
            try:
                commit_ts_us = epoch_micros(parse_iso_datetime(stamp))
            except ValueError as exc:
                raise DecodeError(f"committime {stamp!r} is not a timestamp: {exc}") from exc
        return position, lsn, commit_ts_us

    def _key(
        self, pkkey: Any, cols: dict[str, tuple[str, str]], database: str, schema: str, table: str, notes: list[str]
    ) -> tuple[list[str], dict[str, str]]:
        """Key column names and, from pkkey, their canonical values."""
        if pkkey:
            if not isinstance(pkkey, list):
                raise DecodeError("eventsource.pkkey is not an array")
            values: dict[str, str] = {}
            for entry in pkkey:
                if not isinstance(entry, dict):
                    raise DecodeError(f"pkkey entry is not an object: {entry!r}")
                name = check_identifier(entry.get("columnname"), "pkkey columnname")
                if name not in cols:
                    raise DecodeError(f"pkkey column {name} is not declared in cols")
                if name in values:
                    raise DecodeError(f"pkkey column {name} listed twice")
                value = cast_value(*cols[name], entry.get("value"), name, notes)
                if value is None:
                    raise DecodeError(f"pkkey column {name} has no value")
                values[name] = value
            return list(values), values
        configured = self.ctx.configured_key(database, schema, table)
        if not configured:
            raise DecodeError(f"{database}.{schema}.{table}: no pkkey and no configured primary key")
        missing = [k for k in configured if k not in cols]
        if missing:
            raise DecodeError(f"configured key columns {missing} are not columns of {schema}.{table}")
        return list(configured), {}

    @staticmethod
    def _image(raw: dict[str, Any], cols: dict[str, tuple[str, str]], what: str, notes: list[str]) -> dict[str, str | None]:
        """A row image: every declared column (absent -> NULL, noted); {} stays {}."""
        if not raw:
            return {}
        unknown = sorted(k for k in raw if k not in cols)
        if unknown:
            raise DecodeError(f"eventrow.{what} has columns not declared in cols: {unknown}")
        out: dict[str, str | None] = {}
        absent = []
        for name, (sql, spark) in cols.items():
            if name not in raw:
                absent.append(name)
            out[name] = cast_value(sql, spark, raw.get(name), name, notes)
        if absent:
            notes.append(f"eventrow.{what}: absent columns {absent} read as NULL")
        return out

    @staticmethod
    def _require_key(image: dict[str, str | None], key_columns: list[str], what: str) -> None:
        missing = [k for k in key_columns if image.get(k) is None]
        if missing:
            raise DecodeError(f"eventrow.{what} has no value for key column(s) {missing}")

    def _match_key(
        self, image: dict[str, str | None], pk_values: dict[str, str], key_columns: list[str], what: str, fill: bool = False
    ) -> None:
        """Cross-check pkkey with the image (``fill``: an empty image takes the pkkey values)."""
        if fill and not image:
            image.update(pk_values)
        for k, v in pk_values.items():
            if image.get(k) is not None and image[k] != v:
                raise DecodeError(f"key column {k}: pkkey says {v!r}, eventrow.{what} says {image[k]!r}")
        self._require_key(image, key_columns, what)

    # -- driver side: split segments -----------------------------------------
    def needs_driver(self, msg: RawMessage) -> bool:
        if "segmentindex" not in msg.text and ("splittotalcnt" not in msg.text or _NOT_SPLIT.search(msg.text)):
            return False  # fast path: every message is checked, most are not split
        try:
            seg = segment_of(parse_envelope(msg))
        except DecodeError:
            return False  # decode() quarantines it
        return seg is not None and seg.is_split

    def absorb(self, messages: list[RawMessage]) -> list[Outcome]:
        """Group split segments by (source, logicalid) and reassemble complete groups."""
        results: dict[int, list[Outcome]] = {}
        groups: dict[tuple[str, str], list[tuple[int, RawMessage, dict[str, Any], Segment]]] = {}
        for i, msg in enumerate(messages):
            try:
                env = parse_envelope(msg)
                seg = segment_of(env)
                if seg is None or not seg.is_split:
                    results[i] = self.decode(msg)
                    continue
                source = _str_attr(env, "source")
                logicalid = _str_attr(env, "logicalid")
                _str_attr(env, "id")
                if not isinstance(env.get("data"), str):
                    raise DecodeError("split segment without string data")
            except DecodeError as exc:
                results[i] = [quarantine(msg, exc)]
                continue
            groups.setdefault((source, logicalid), []).append((i, msg, env, seg))
        for (source, logicalid), members in groups.items():
            if (source, logicalid) in self._applied_splits:
                results.update(
                    {
                        i: [
                            Skipped(
                                "duplicate-segment",
                                msg.file,
                                msg.line,
                                detail=f"{logicalid} segment {seg.index}: its message was reassembled in an earlier batch",
                            )
                        ]
                        for i, msg, _, seg in members
                    }
                )
                continue
            resolved = self._reassemble(logicalid, members)
            if not any(isinstance(o, Held) for outs in resolved.values() for o in outs):
                self._remember_split(source, logicalid)
            results.update(resolved)
        return [o for i in sorted(results) for o in results[i]]

    def _reassemble(self, logicalid: str, members: list[tuple[int, RawMessage, dict[str, Any], Segment]]) -> dict[int, list[Outcome]]:
        out: dict[int, list[Outcome]] = {}
        ids: set[str] = set()
        by_index: dict[int, tuple[int, RawMessage, dict[str, Any], Segment]] = {}
        for i, msg, env, seg in members:
            if env["id"] in ids:
                out[i] = [Skipped("duplicate-id", msg.file, msg.line, detail=env["id"])]
                continue
            ids.add(env["id"])
            if seg.index in by_index:
                first = by_index[seg.index]
                if first[2]["data"] != env["data"]:
                    return self._quarantine_group(
                        members, f"split group {logicalid}: segment {seg.index} arrived twice with different data"
                    )
                out[i] = [Skipped("duplicate-segment", msg.file, msg.line, detail=f"{logicalid} segment {seg.index}")]
                continue
            by_index[seg.index] = (i, msg, env, seg)
        kept = [by_index[k] for k in sorted(by_index)]
        try:
            complete = self._complete(kept)
        except DecodeError as exc:
            return self._quarantine_group(members, f"split group {logicalid}: {exc}")
        if not complete:
            for i, msg, _, _ in kept:
                out[i] = [Held("incomplete-split", msg.file, msg.line, group=logicalid)]
            return out
        i0, msg0, env0, _ = kept[0]
        data_text = "".join(m[2]["data"] for m in kept)
        try:
            outcomes = self.decode_event(env0, data_text, msg0)
        except (DecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            reason = f"split group {logicalid}: {type(exc).__name__}: {exc}"
            return self._quarantine_group(members, reason)
        out[i0] = outcomes
        for i, msg, _, seg in kept[1:]:
            out[i] = [
                Skipped(
                    "split-segment", msg.file, msg.line, detail=f"{logicalid} segment {seg.index}, reassembled at {msg0.file}:{msg0.line}"
                )
            ]
        return out

    @staticmethod
    def _complete(kept: list[tuple[int, RawMessage, dict[str, Any], Segment]]) -> bool:
        """True when every segment is there; DecodeError when the group is inconsistent."""
        first_env, first_seg = kept[0][2], kept[0][3]
        for _, _, env, seg in kept[1:]:
            for attr in ("operation", "type", "specversion"):
                if env.get(attr) != first_env.get(attr):
                    raise DecodeError(f"segments disagree on {attr}")
            if seg.style != first_seg.style:
                raise DecodeError("segments mix splitindex and segmentindex attributes")
        indices = [seg.index for _, _, _, seg in kept]
        if first_seg.style == "split":
            totals = {seg.total for _, _, _, seg in kept}
            if len(totals) != 1:
                raise DecodeError(f"segments disagree on splittotalcnt: {sorted(totals, key=str)}")
            n = totals.pop() or 0
            if 0 in indices and n in indices:
                raise DecodeError(f"segment indices {indices} mix 0-based and 1-based numbering of {n}")
            return len(indices) == n
        finals = [seg.index for _, _, _, seg in kept if seg.final]
        if len(finals) > 1:
            raise DecodeError(f"several final segments: {finals}")
        if finals and max(indices) > finals[0]:
            raise DecodeError(f"segment {max(indices)} after the final segment {finals[0]}")
        return bool(finals) and indices == list(range(finals[0] + 1))

    @staticmethod
    def _quarantine_group(members: list[tuple[int, RawMessage, dict[str, Any], Segment]], reason: str) -> dict[int, list[Outcome]]:
        return {i: [Quarantined(reason, msg.text, msg.file, msg.line)] for i, msg, _, _ in members}


# --------------------------------------------------------------------------
# Duplicate CloudEvent ids across a decode run


def dedupe_ids(outcomes: Iterable[Outcome]) -> list[Outcome]:
    """2nd and later *messages* with one CloudEvent id -> one Skipped('duplicate-id') each.

    Events of one message (a primary-key change yields two) share its id and
    (file, line) and are kept together; order is otherwise preserved.
    """
    items = list(outcomes)
    first: dict[str, tuple[str, int]] = {}
    for o in items:
        if isinstance(o, ChangeEvent) and o.message_id is not None:
            first.setdefault(o.message_id, (o.file, o.line))
    out: list[Outcome] = []
    reported: set[tuple[str, int]] = set()
    for o in items:
        if isinstance(o, ChangeEvent) and o.message_id is not None and first[o.message_id] != (o.file, o.line):
            if (o.file, o.line) not in reported:
                reported.add((o.file, o.line))
                out.append(Skipped("duplicate-id", o.file, o.line, detail=o.message_id, position=o.position))
            continue
        out.append(o)
    return out


def decode_all_deduped(decoder: Decoder, messages: Iterable[RawMessage]) -> list[Outcome]:
    """``decode_all`` followed by ``dedupe_ids``: the plain-Python reference."""
    return dedupe_ids(decode_all(decoder, messages))


__all__ = ["SqlServerCesDecoder", "cast_value", "decode_all_deduped", "dedupe_ids", "normalise_lsn", "spark_type"]
