"""CockroachDB changefeed messages (JSON format, every envelope).

Shapes recognised, per archived line (``decode_message``):

* **archive wrapper** ``{"key": K, "value": V, "table"/"topic": ...}`` (the
  sinkless / Kafka form; K and V are JSON *text* or JSON).  An empty or null V
  with a key is a ``key_only`` message, or an ``envelope=row`` delete when the
  source sets ``envelope: row`` (see below).
* **webhook batch** ``{"payload": [m1, m2, ...], "length": n}``: ONE message
  carrying n changefeed messages.  It yields one outcome per element (element
  ``i``'s quarantine reason starts with ``payload[i]:``), so a file's outcome
  count can exceed its message count; an empty batch yields one
  ``Skipped('empty-webhook-batch')`` so that no message is left unaccounted.
* **resolved** ``{"resolved": hlc}`` or ``{"__crdb__": {"resolved": hlc}}``:
  a watermark, ``Skipped('resolved-watermark', position=...)``.
* **enriched** (v25.2+) ``{"payload": {...}, "schema": {...}}`` or the payload
  alone: explicit ``op`` (c/u/d, r accepted), ``source`` with database /
  schema / table / ``primary_keys`` and timestamps, optional Kafka-Connect
  style ``schema`` that types every column exactly.
* **wrapped** (default) ``{"after", "before"?, "key"?, "topic"?, "updated"?,
  "mvcc_timestamp"?}``.
* **bare** ``{"__crdb__": {key, topic, updated, mvcc_timestamp}, <columns>}``.
* **row** / bare CDC-query rows without ``__crdb__``: just the columns.
* **key_only**: a bare JSON array (the Kafka key printed alone) or a wrapper
  with a key and an empty value.

Table: from the message (``topic``, ``__crdb__.topic``, enriched ``source``),
the archive wrapper, or the cloud-storage sink's file name
``[date/[hour/]]<33-digit ts>-<uniquer>-<topic>-<schema id>.ndjson[.gz|.zst]``
(``cloud_storage_table``); all that are given must agree.

Position (source option ``ordering: log``, the default): an HLC ``"<wall ns>.<10-digit logical>"`` (a trailing ``?`` marks a
synthetic timestamp and is dropped) rendered as ``<wall, 20 digits>.<logical,
10 digits>`` so that string order == (wall, logical) order; wall and logical
are parsed as integers, never as floats.  Taken from, in preference,
``mvcc_timestamp`` (the version's own MVCC time, also during scans),
``source.ts_hlc``, ``updated``, and for enriched messages ``source.ts_ns``
(logical 0).  The enriched top-level ``ts_ns`` is *processing* time and is
never used.  A message without any of them cannot be ordered against
duplicates and re-emissions: it is refused (``ConfigRefused``: enable
``mvcc_timestamp`` or ``updated`` on the changefeed, or choose arrival order).
``commit_ts_us`` is the wall time.  With ``ordering: arrival`` every message's
position is ``arrival_position``: archive file path, line, webhook batch
element (README says when that order is wrong).

Op: enriched messages say it.  Wrapped: ``after: null`` is a delete; with
``diff`` (a ``before`` field) a null ``before`` is an insert, otherwise an
update; without ``diff`` the message is an *upsert* and is labelled
``Op.UPDATE`` (c/u/r are all upserts to the apply; the label only shows up in
accounting).  ``updated`` later than ``mvcc_timestamp`` marks an initial scan
or backfill emission: ``Op.READ``.  Bare and row messages are upserts
(``Op.UPDATE``): those envelopes cannot express a delete unambiguously (a
``row`` delete is an empty Kafka value — indistinguishable from ``key_only`` —
and a ``bare`` delete is the key with no or null columns), which the event's
notes say.

Key: values come from the wrapped ``key`` array, ``__crdb__.key``, the
archive wrapper's key (array, or object ``{"col": value}`` in enriched feeds)
or the row itself; names from ``source.primary_keys``, a key object, a
``key`` struct in the enriched schema, or ``DecodeContext.configured_key``.
Key values without names are quarantined ("configure primary key columns for
table X"); a message with neither yields ``key_columns == []`` (the job then
asks for a configured key).  A key that disagrees with the row is quarantined.

Types: with the enriched ``schema`` every column is typed from it
(``int64`` -> bigint, ``float64`` -> double, decimal with precision/scale ->
``decimal(p,s)``, ``timestamp`` -> timestamp (zone-less TIMESTAMP values are
read as UTC, the changefeed's rendering zone), ``date`` -> date, ``time`` ->
string, ``bytes`` -> binary, ``json``/arrays/geo -> JSON text).  An
unconstrained DECIMAL (precision 0) or one wider than 38 digits is carried as
exact decimal text (type string) with a note.  Without a schema types are
inferred per value: int -> bigint, a number with a fraction -> exact
``decimal(38, <its scale>)`` (never through float; CockroachDB renders a
DECIMAL(p,s) value with exactly s places, so the type is stable per column,
while a FLOAT column whose values vary in scale fails table resolution loudly
instead of being rounded), str -> string, bool -> boolean, object/array ->
JSON text; JSON nulls declare no column.  Prefer the enriched schema.

``key_only`` messages carry no row image: they are refused (never silently
skipped, never applied); such a changefeed must be recreated with
``envelope=wrapped`` or ``enriched``.

Configuration problems (no HLC under log ordering, no table, key values
without key names, ``key_only``) raise ``ConfigRefused``: the job fails the
batch once with a ``ConfigError`` per distinct reason instead of quarantining
messages one by one; their reasons carry no message values so that they group.

A changefeed writes its table and HLC fields on every message or on none
(they are changefeed options), so a message without them is a configuration
mismatch only when its file has them nowhere; so is the envelope (a bare key
array, as only a key_only changefeed writes, among object messages is
damaged).  ``decode_file`` judges each such message by the rest of its file (or piece of a file): when another
message of the file names its table, or another message of the same table
(of the file, for a message without a table) has an HLC, the message is
damaged and quarantined (``damaged message: ...``, its file and line), and
the batch goes on.  The refusals wait for that evidence in a bounded buffer
(``PENDING_LIMIT``); a file that fills it is judged to lack the fields.
"""

from __future__ import annotations

import decimal
import functools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from cdc_apply.decode.base import DecodeContext, Decoder, check_json_type, has_float
from cdc_apply.decode.debezium_common import (
    as_int,
    canonical,
    check_identifier,
    json_text,
)
from cdc_apply.model import (
    CONFIG_REFUSED_PREFIX,
    ChangeEvent,
    Column,
    ConfigRefused,
    DecodeError,
    Format,
    Op,
    Outcome,
    Quarantined,
    RawMessage,
    Skipped,
    decimal_type,
    pad_decimal,
)

KEY_ONLY_REASON = (
    "a key without a value: envelope=key_only carries no row image and cannot be applied (recreate the changefeed "
    "with envelope=wrapped or envelope=enriched); if the changefeed uses envelope=row, this is a delete: set "
    "`envelope: row` on the source in the sources file"
)
KEY_ONLY_ARRAY_REASON = (
    "a bare key array: envelope=key_only carries no row image and cannot be applied; recreate the changefeed with "
    "envelope=wrapped or envelope=enriched"
)
NO_POSITION_HINT = (
    "add the changefeed option mvcc_timestamp (or updated) so that changes can be ordered, or set `ordering: arrival` "
    "on the source in the sources file to apply them in archive order (file, then line; see README)"
)
PENDING_LIMIT = 10_000
"""Refusals for a missing table or HLC one file holds while its later messages
are read (``decode_file``); past it the file is judged to lack them."""
DAMAGED_REASON = (
    "DecodeError: damaged message: {subject} has no {what}, while other messages of this file carry them (a changefeed "
    "writes them on every message or on none, so this line is damaged, not the changefeed misconfigured); the rest "
    "of the file is applied: repair the line and replay it if its change matters"
)
MISSING_WHAT = {
    "table": "table (topic, __crdb__.topic, source.table_name or the archive wrapper's topic/table)",
    "HLC": "HLC (mvcc_timestamp, updated or source.ts_hlc/ts_ns)",
    "row image": "row image (it is a bare JSON array, as only a key_only changefeed writes)",
    "value": "value (a key with an empty value, as only a key_only changefeed or an envelope=row delete writes)",
}
INFERRED_NOTE = "no schema: column types inferred from JSON values"
NO_DELETE_NOTE = "{env} envelope: deletes cannot be told from upserts; prefer envelope=wrapped or enriched"

_HLC = re.compile(r"^(\d{1,20})(?:\.(\d{10}))?\??$")
_WRAPPER_KEYS = frozenset(
    {"key", "value", "table", "topic", "partition", "offset", "timestamp", "timestampType", "timestamp_type", "headers"}
)
_WRAPPED_KEYS = frozenset({"after", "before", "key", "topic", "updated", "mvcc_timestamp"})
_ENRICHED_KEYS = frozenset({"after", "before", "op", "source", "ts_ns", "key", "updated", "mvcc_timestamp", "topic"})
_CRDB_META_KEYS = frozenset({"key", "topic", "updated", "mvcc_timestamp", "resolved"})
_OPS = {"c": Op.INSERT, "u": Op.UPDATE, "d": Op.DELETE, "r": Op.READ}
_INT_TYPES = {"int8": "tinyint", "int16": "smallint", "int32": "int", "int64": "bigint"}


# --------------------------------------------------------------------------
# JSON and HLC timestamps


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str, what: str = "message") -> Any:
    """Exact JSON: numbers with a fraction become ``Decimal`` (orjson alone
    would round them to binary floats; it also refuses integers wider than 64
    bits, which DECIMAL values can be), so the slow parser re-reads those."""
    try:
        obj = orjson.loads(text)
        if not has_float(obj):
            return obj
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(text, parse_float=decimal.Decimal, parse_constant=_reject_constant)
    except ValueError as exc:
        raise DecodeError(f"malformed JSON in {what}: {exc}") from exc
    except RecursionError:  # orjson refused it for its depth (> 1024); the stdlib parser recursed out
        raise DecodeError(f"malformed JSON in {what}: nested deeper than the JSON reader allows (depth limit exceeded)") from None


def parse_hlc(value: Any, what: str = "timestamp") -> tuple[int, int]:
    """``"<wall ns>.<10-digit logical>"`` (optional trailing '?') -> (wall, logical).

    The logical part must have exactly 10 digits, as CockroachDB renders it:
    anything else is ambiguous (decimal fraction or integer?) and refused, as
    are JSON numbers (CockroachDB writes strings; a number may have been
    rounded through a float on its way to the archive)."""
    if not isinstance(value, str):  # a JSON number may already have been through a float
        raise DecodeError(f"{what} {value!r} is not an HLC timestamp string")
    m = _HLC.match(value.strip())
    if not m:
        raise DecodeError(f"{what} {value!r} is not an HLC timestamp '<wall ns>.<10-digit logical>'")
    wall, logical = int(m.group(1)), int(m.group(2) or 0)
    if wall == 0:
        raise DecodeError(f"{what} {value!r} is the zero timestamp")
    return wall, logical


def hlc_position(wall: int, logical: int) -> str:
    """Fixed-width position text: string order == (wall, logical) order."""
    return f"{pad_decimal(wall, 20)}.{pad_decimal(logical, 10)}"


def hlc_text(value: Any, what: str = "timestamp") -> str:
    return hlc_position(*parse_hlc(value, what))


# --------------------------------------------------------------------------
# Column typing


@dataclass(frozen=True)
class FieldSpec:
    """One column as the enriched schema declares it."""

    name: str
    spark_type: str
    nullable: bool
    kind: str = "plain"  # plain | json (JSON text) | dectext (exact decimal text)
    note: str | None = None

    def column(self) -> Column:
        return Column(self.name, self.spark_type, self.nullable)


def field_spec(entry: Any) -> FieldSpec:
    """Map a CockroachDB Kafka-Connect-JSON field schema to a Spark type."""
    if not isinstance(entry, dict):
        raise DecodeError(f"field schema is not an object: {entry!r}")
    col = check_identifier(entry.get("field"), "column")
    typ = str(entry.get("type", "")).lower()
    logical = entry.get("name")
    optional = entry.get("optional", True)
    nullable = optional.strip().lower() != "false" if isinstance(optional, str) else bool(optional)
    params = entry.get("parameters") or {}
    if not isinstance(params, dict):
        raise DecodeError(f"column {col}: schema parameters is not an object")
    if logical == "decimal":
        precision = as_int(params.get("precision", 0), f"column {col} decimal precision")
        scale = as_int(params.get("scale", 0), f"column {col} decimal scale")
        if precision == 0 or precision > 38:
            what = "unconstrained DECIMAL" if precision == 0 else f"DECIMAL({precision},{scale})"
            return FieldSpec(col, "string", nullable, "dectext", f"{col}: {what} carried as exact decimal text (type string)")
        return FieldSpec(col, decimal_type(precision, scale), nullable)
    if logical == "timestamp":
        return FieldSpec(col, "timestamp", nullable)
    if logical == "date":
        return FieldSpec(col, "date", nullable)
    if logical == "time":
        return FieldSpec(col, "string", nullable)
    if logical in ("geometry", "geography"):
        return FieldSpec(col, "string", nullable, "json", f"{col}: {logical} carried as GeoJSON text")
    if typ in _INT_TYPES:
        return FieldSpec(col, _INT_TYPES[typ], nullable)
    if typ == "float32":
        return FieldSpec(col, "float", nullable)
    if typ == "float64":
        return FieldSpec(col, "double", nullable)
    if typ == "boolean":
        return FieldSpec(col, "boolean", nullable)
    if typ == "string":
        return FieldSpec(col, "string", nullable)
    if typ == "bytes":
        return FieldSpec(col, "binary", nullable)
    if typ == "json":
        return FieldSpec(col, "string", nullable, "json")
    if typ == "array":
        return FieldSpec(col, "string", nullable, "json", f"{col}: array carried as JSON text")
    what = typ or "?"
    return FieldSpec(col, "string", nullable, "json", f"{col}: unsupported schema type {what!r} carried as JSON text")


def struct_specs(schema: Any, what: str) -> dict[str, FieldSpec]:
    if not isinstance(schema, dict) or not isinstance(schema.get("fields"), list):
        raise DecodeError(f"{what} schema is not a struct with fields")
    specs = [field_spec(f) for f in schema["fields"]]
    out = {s.name: s for s in specs}
    if len(out) != len(specs):
        raise DecodeError(f"{what} schema has duplicate field names: {[s.name for s in specs]}")
    return out


def _envelope_field(schema: dict[str, Any], name: str) -> Any:
    for f in schema.get("fields") or []:
        if isinstance(f, dict) and f.get("field") == name:
            return f
    return None


def infer_type(value: Any) -> str | None:
    """Spark type of a schemaless JSON value (None for JSON null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return "bigint"
        return "decimal(38,0)" if len(str(abs(value))) <= 38 else "string"
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            return "string"
        _sign, digits, exponent = value.as_tuple()
        scale = max(0, -int(exponent))
        int_digits = max(len(digits) + int(exponent), 0)
        if scale > 38 or int_digits + scale > 38:
            return "string"
        return f"decimal(38,{scale})"
    return "string"


def convert(spec: FieldSpec | None, value: Any) -> str | None:
    """Canonical text of one value, typed by ``spec`` or inferred (spec None)."""
    if value is None:
        return None
    if spec is None:
        typ = infer_type(value) or "string"
        if typ == "string" and isinstance(value, decimal.Decimal):
            return format(value, "f")
        if typ == "string" and isinstance(value, int):
            return str(value)
        return canonical(typ, value)
    if spec.kind == "json":
        return json_text(value)
    if spec.kind == "dectext":
        if isinstance(value, bool) or not isinstance(value, (int, str, decimal.Decimal)):
            raise DecodeError(f"column {spec.name}: {value!r} is not a decimal")
        try:
            d = decimal.Decimal(str(value).strip())
        except decimal.InvalidOperation as exc:
            raise DecodeError(f"column {spec.name}: {value!r} is not a decimal") from exc
        return format(d, "f") if d.is_finite() else str(value).strip()
    check_json_type(spec.spark_type, value, spec.name)
    try:
        return canonical(spec.spark_type, value)
    except DecodeError as exc:
        raise DecodeError(f"column {spec.name}: {exc}") from exc


# --------------------------------------------------------------------------
# Table names


@dataclass(frozen=True)
class TableRef:
    database: str | None
    schema: str | None
    table: str
    origin: str

    @property
    def qualified(self) -> str:
        return ".".join(p for p in (self.database, self.schema, self.table) if p)


def table_from_topic(name: Any, origin: str) -> TableRef:
    """A topic / table field: ``table`` or ``db.schema.table`` (full_table_name).

    Two or four+ parts are refused: ``table.family`` (column families) and
    prefixed topics cannot be told apart from schema-qualified names."""
    if not isinstance(name, str) or not name.strip():
        raise DecodeError(f"{origin} {name!r} is not a table name")
    parts = name.split(".")
    if len(parts) == 1:
        return TableRef(None, None, check_identifier(parts[0], "table"), origin)
    if len(parts) == 3:
        db, sch, tbl = (check_identifier(p, "table name part") for p in parts)
        return TableRef(db, sch, tbl, origin)
    raise DecodeError(
        f"{origin} {name!r}: expected 'table' or 'database.schema.table' (column-family topics "
        "'table.family' and topic prefixes are not supported)"
    )


# --------------------------------------------------------------------------
# Message pieces


@dataclass
class Hints:
    """What an archive wrapper says about the message inside it."""

    table: TableRef | None = None
    key: Any = None  # parsed key: list of values, or {name: value}
    index: int = 0  # the element's index in a webhook batch (arrival order within a line)
    stream: str | None = None  # the Kafka topic partition a wrapper names: its resolved timestamps cover it alone


class MissingFields(ConfigRefused):
    """A message without its table and / or HLC, or a bare key array (no row
    image): a configuration refusal, unless other messages of its file carry
    them (``CockroachDbDecoder.decode_file``)."""

    def __init__(self, text: str, missing: tuple[str, ...], table: TableRef | None) -> None:
        super().__init__(text)
        self.missing = missing
        self.table = table


@dataclass
class _Refusal:
    """A message's (or webhook element's) refusal for missing fields, while its file is read."""

    outcome: Quarantined
    missing: tuple[str, ...]
    table: str | None
    index: int | None

    def damaged(self) -> Quarantined:
        subject = "the message" if self.index is None else f"element payload[{self.index}] of the webhook batch"
        what = " and ".join(MISSING_WHAT[m] for m in self.missing)
        o = self.outcome
        return Quarantined(DAMAGED_REASON.format(subject=subject, what=what), o.raw, o.file, o.line)


@dataclass
class _Evidence:
    """What the messages of one file read so far carry: a row image (an object
    envelope), a table of their own, and the tables (None: any) with an HLC."""

    rows: bool = False
    table: bool = False
    hlc_tables: set[str | None] = field(default_factory=set)
    enveloped: set[str] = field(default_factory=set)
    """tables with a wrapped, enriched or bare message (a changefeed whose deletes are never an empty value)"""
    version: int = 0

    def saw(self, table: TableRef | None, hlc: bool, envelope: str) -> None:
        before = (self.rows, self.table, len(self.hlc_tables), len(self.enveloped))
        self.rows = True  # only a message with an object envelope is looked at
        self.table = self.table or table is not None
        if hlc:
            self.hlc_tables.update({None} if table is None else {None, table.table})
        if table is not None and envelope != "row":
            self.enveloped.add(table.table)
        if (self.rows, self.table, len(self.hlc_tables), len(self.enveloped)) != before:
            self.version += 1

    def covers(self, r: _Refusal) -> bool:
        if ("table" in r.missing and not self.table) or ("row image" in r.missing and not self.rows):
            return False
        if "value" in r.missing and (r.table is None or r.table not in self.enveloped):
            return False
        return "HLC" not in r.missing or r.table in self.hlc_tables


@dataclass
class Parts:
    """One row change, normalised from any envelope before typing."""

    envelope: str
    op: Op | None  # None: derive from images
    after: dict[str, Any] | None
    before: dict[str, Any] | None
    has_before: bool
    stamps: dict[str, Any] = field(default_factory=dict)
    keys: list[tuple[str, Any]] = field(default_factory=list)  # (origin, raw key)
    key_names: list[tuple[str, list[str]]] = field(default_factory=list)  # (origin, names)
    tables: list[TableRef] = field(default_factory=list)
    specs_after: dict[str, FieldSpec] | None = None
    specs_before: dict[str, FieldSpec] | None = None
    notes: list[str] = field(default_factory=list)


def _parse_text(value: Any, what: str) -> Any:
    """A wrapper field holding JSON text (or already JSON); '' and null are None."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        return load_json(value, what)
    return value


def _is_wrapper(obj: dict[str, Any]) -> bool:
    return (
        "value" in obj
        and set(obj) <= _WRAPPER_KEYS
        and bool({"key", "table", "topic"} & set(obj))
        and (obj["value"] is None or isinstance(obj["value"], (str, dict)))
    )


def _is_batch(obj: dict[str, Any]) -> bool:
    return isinstance(obj.get("payload"), list) and set(obj) <= {"payload", "length"}


def _resolved_of(obj: dict[str, Any]) -> Any:
    """The resolved timestamp if ``obj`` is a resolved message, else None."""
    if set(obj) == {"resolved"}:
        return obj["resolved"]
    meta = obj.get("__crdb__")
    if set(obj) == {"__crdb__"} and isinstance(meta, dict) and "resolved" in meta:
        return meta["resolved"]
    if set(obj) <= {"payload", "schema"} and isinstance(obj.get("payload"), dict) and set(obj["payload"]) == {"resolved"}:
        return obj["payload"]["resolved"]
    return None


def is_key_only(text: str) -> bool:
    """True when the line is a key_only changefeed message (a key, no value).

    The job uses it to fail the table with a configuration error instead of
    quarantining its messages one by one."""
    try:
        obj = load_json(text)
    except DecodeError:
        return False
    if isinstance(obj, list):
        return True
    if isinstance(obj, dict) and _is_wrapper(obj):
        try:
            key = _parse_text(obj.get("key"), "archive wrapper key")
            value = _parse_text(obj["value"], "archive wrapper value")
        except DecodeError:
            return False
        return value is None and key is not None
    return False


# --------------------------------------------------------------------------
# The decoder


class CockroachDbDecoder(Decoder):
    """CockroachDB changefeed JSON, any envelope; see the module docstring."""

    format = Format.COCKROACHDB

    @classmethod
    def sniff(cls, text: str) -> bool:
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError:
            return False
        return _sniff_obj(obj, depth=0)

    def __init__(self, ctx: DecodeContext | None = None) -> None:
        super().__init__(ctx)
        self._evidence: _Evidence | None = None  # set while decode_file reads a file
        self._refusals: dict[int, _Refusal] = {}  # id(outcome) -> its refusal, for the message being decoded

    def decode_message(self, msg: RawMessage) -> list[Outcome]:
        obj = load_json(msg.text)
        if isinstance(obj, dict) and _is_batch(obj):
            return self._decode_batch(obj, msg)
        try:
            return [self._decode_one(obj, msg, Hints())]
        except MissingFields as exc:
            return [self._refused(exc, msg, None)]

    def _refused(self, exc: MissingFields, msg: RawMessage, index: int | None) -> Quarantined:
        """The configuration refusal of a message without table or HLC, noted
        for ``decode_file`` to judge by the rest of the file."""
        q = Quarantined(f"{CONFIG_REFUSED_PREFIX}{exc}", msg.text, msg.file, msg.line)
        if self._evidence is not None:
            self._refusals[id(q)] = _Refusal(q, exc.missing, exc.table.table if exc.table else None, index)
        return q

    def decode_file(self, items: Iterable[RawMessage | Quarantined]) -> Iterator[Outcome]:
        """One file's messages (module docstring): a refusal for a missing table
        or HLC waits (up to ``PENDING_LIMIT``) until the file shows whether its
        other messages carry them: then it is a damaged message, quarantined;
        at the end of the file it stays a refusal."""
        ev = self._evidence = _Evidence()
        pending: list[_Refusal] = []
        seen, full = 0, False
        try:
            for item in items:
                outs = [item] if isinstance(item, Quarantined) else self.decode(item)
                refusals, self._refusals = self._refusals, {}
                for o in outs:
                    r = refusals.get(id(o))
                    if r is None:
                        yield o
                    elif ev.covers(r):
                        yield r.damaged()
                    elif full or len(pending) >= PENDING_LIMIT:  # the file lacks them: refusals from here on
                        full = True
                        yield from (p.outcome for p in pending)
                        pending = []
                        yield o
                    else:
                        pending.append(r)
                if pending and ev.version != seen:
                    yield from (p.damaged() for p in pending if ev.covers(p))
                    pending = [p for p in pending if not ev.covers(p)]
                seen = ev.version
            yield from (p.outcome for p in pending)
        finally:
            self._evidence, self._refusals = None, {}

    # -- dispatch ------------------------------------------------------------
    def _decode_batch(self, obj: dict[str, Any], msg: RawMessage) -> list[Outcome]:
        items = obj["payload"]
        if "length" in obj and as_int(obj["length"], "webhook batch length") != len(items):
            raise DecodeError(f"webhook batch says length {obj['length']} but carries {len(items)} messages")
        if not items:
            return [Skipped("empty-webhook-batch", msg.file, msg.line)]
        out: list[Outcome] = []
        for i, item in enumerate(items):
            try:
                if isinstance(item, dict) and (_is_batch(item) or _is_wrapper(item)):
                    raise DecodeError("nested batch or archive wrapper inside a webhook batch")
                out.append(self._decode_one(item, msg, Hints(index=i)))
            except MissingFields as exc:
                out.append(self._refused(exc, msg, i))
            except ConfigRefused as exc:  # the job fails the batch on it: keep the reason groupable
                out.append(Quarantined(f"{CONFIG_REFUSED_PREFIX}{exc}", msg.text, msg.file, msg.line))
            except (DecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                out.append(Quarantined(f"payload[{i}]: {type(exc).__name__}: {exc}", msg.text, msg.file, msg.line))
        return out

    def _decode_one(self, obj: Any, msg: RawMessage, hints: Hints) -> Outcome:
        if isinstance(obj, list):  # a key_only message, or a damaged line among messages with row images
            raise MissingFields(KEY_ONLY_ARRAY_REASON, ("row image",), None)
        if not isinstance(obj, dict):
            raise DecodeError(f"message is not a JSON object: {type(obj).__name__}")
        if _is_wrapper(obj):
            return self._decode_wrapper(obj, msg)
        resolved = _resolved_of(obj)
        if resolved is not None:
            pos = hlc_text(resolved, "resolved")
            # tx_group: the stream the watermark covers (a Kafka partition; "*": the whole feed, as webhook
            # and cloud-storage sinks emit it), read by apply/transactions.py under publish: transactions
            return Skipped(
                "resolved-watermark", msg.file, msg.line, detail=f"resolved {resolved}", position=pos, tx_group=hints.stream or "*"
            )
        parts = self._parts(obj)
        if hints.table is not None:
            parts.tables.append(hints.table)
        if hints.key is not None:
            parts.keys.append(("archive wrapper key", hints.key))
        return self._event(parts, msg, hints)

    def _decode_wrapper(self, obj: dict[str, Any], msg: RawMessage) -> Outcome:
        hints = Hints()
        key = _parse_text(obj.get("key"), "archive wrapper key")
        if isinstance(key, dict) and set(key) <= {"payload", "schema"} and "payload" in key:
            key = key["payload"]  # enriched key with its own schema
        if key is not None and not isinstance(key, (list, dict)):
            raise DecodeError(f"archive wrapper key is neither an array nor an object: {key!r}")
        hints.key = key
        if obj.get("partition") is not None:
            hints.stream = f"{obj.get('topic') or obj.get('table') or ''}/{obj['partition']}"
        for name in ("table", "topic"):
            if obj.get(name) not in (None, ""):
                hints.table = table_from_topic(obj[name], f"archive wrapper {name}")
                break
        value = _parse_text(obj["value"], "archive wrapper value")
        if isinstance(value, list):
            raise DecodeError("archive wrapper value is a JSON array, not a changefeed message")
        if value is None:
            if key is not None and self.ctx.options.get("envelope") == "row":
                return self._event(_row_delete(hints), msg, hints)
            if key is not None:  # key_only, an envelope=row delete, or damaged among its table's wrapped messages
                raise MissingFields(KEY_ONLY_REASON, ("value",), hints.table)
            raise DecodeError("archive wrapper without key or value: nothing to decode")
        if isinstance(value, dict) and (_is_wrapper(value) or _is_batch(value)):
            raise DecodeError("archive wrapper value is itself a wrapper or batch")
        return self._decode_one(value, msg, hints)

    # -- envelopes -------------------------------------------------------------
    def _parts(self, obj: dict[str, Any]) -> Parts:
        if not obj:
            raise DecodeError("empty JSON object: not a changefeed message")
        if isinstance(obj.get("payload"), dict) and set(obj) <= {"payload", "schema"}:
            return self._enriched(obj["payload"], obj.get("schema"))
        if set(obj) <= {"payload", "schema"}:
            if "payload" not in obj:
                raise DecodeError("enriched schema without a payload: not a change event")
            raise DecodeError(f"enriched payload is not an object: {obj['payload']!r}")
        if "op" in obj and ("after" in obj or "before" in obj) and set(obj) <= _ENRICHED_KEYS:
            return self._enriched(obj, None)
        if "after" in obj and set(obj) <= _WRAPPED_KEYS:
            return self._wrapped(obj)
        if "__crdb__" in obj:
            return self._bare(obj)
        return self._row(obj)

    def _enriched(self, payload: dict[str, Any], schema: Any) -> Parts:
        if not isinstance(payload, dict):
            raise DecodeError("enriched payload is not an object")
        unknown = set(payload) - _ENRICHED_KEYS
        if unknown:
            raise DecodeError(f"enriched payload has unknown fields {sorted(unknown)}")
        op_text = payload.get("op")
        if not isinstance(op_text, str):  # a list or object is not hashable: name the field, not a TypeError
            raise DecodeError(f"field 'op' is a {type(op_text).__name__}, not a string: {str(op_text)[:100]}")
        if op_text not in _OPS:
            raise DecodeError(f"enriched envelope with unknown op {op_text!r}")
        after, before = _image(payload, "after"), _image(payload, "before")
        parts = Parts("enriched", _OPS[op_text], after, before, "before" in payload)
        source = payload.get("source")
        if source is not None:
            if not isinstance(source, dict):
                raise DecodeError("enriched source is not an object")
            parts.stamps.update({k: source[k] for k in ("mvcc_timestamp", "ts_hlc", "ts_ns") if source.get(k) is not None})
            if source.get("table_name") not in (None, ""):
                db, sch = source.get("database_name") or None, source.get("schema_name") or None
                parts.tables.append(
                    TableRef(
                        None if db is None else check_identifier(db, "database"),
                        None if sch is None else check_identifier(sch, "schema"),
                        check_identifier(source["table_name"], "table"),
                        "source",
                    )
                )
            pks = source.get("primary_keys")
            if pks is not None:
                if not isinstance(pks, list) or not pks:
                    raise DecodeError(f"source.primary_keys is not a non-empty array: {pks!r}")
                parts.key_names.append(("source.primary_keys", [check_identifier(k, "key column") for k in pks]))
        for k in ("mvcc_timestamp", "updated"):
            if payload.get(k) is not None:
                parts.stamps.setdefault(k, payload[k])
        if payload.get("key") is not None:
            parts.keys.append(("key", payload["key"]))
        if payload.get("topic") not in (None, ""):
            parts.tables.append(table_from_topic(payload["topic"], "topic"))
        if schema is not None:
            self._apply_schema(parts, schema)
        if parts.op is Op.DELETE and after is not None:
            raise DecodeError("enriched op 'd' with a non-null after image")
        if parts.op is not Op.DELETE and after is None:
            raise DecodeError(f"enriched op {op_text!r} without an after image")
        return parts

    def _apply_schema(self, parts: Parts, schema: Any) -> None:
        if not isinstance(schema, dict):
            raise DecodeError("enriched schema is not an object")
        after_s, before_s = _envelope_field(schema, "after"), _envelope_field(schema, "before")
        if after_s is None and before_s is None:
            raise DecodeError("enriched schema describes neither after nor before")
        parts.specs_after = struct_specs(after_s if after_s is not None else before_s, "after")
        parts.specs_before = struct_specs(before_s, "before") if before_s is not None else parts.specs_after
        key_s = _envelope_field(schema, "key")
        if isinstance(key_s, dict) and isinstance(key_s.get("fields"), list):
            parts.key_names.append(("schema key", list(struct_specs(key_s, "key"))))
        for spec in parts.specs_after.values():
            if spec.note:
                parts.notes.append(spec.note)

    def _wrapped(self, obj: dict[str, Any]) -> Parts:
        after, before = _image(obj, "after"), _image(obj, "before")
        parts = Parts("wrapped", None, after, before, "before" in obj)
        parts.stamps.update({k: obj[k] for k in ("mvcc_timestamp", "updated") if obj.get(k) is not None})
        if obj.get("key") is not None:
            parts.keys.append(("key", obj["key"]))
        if obj.get("topic") not in (None, ""):
            parts.tables.append(table_from_topic(obj["topic"], "topic"))
        return parts

    def _bare(self, obj: dict[str, Any]) -> Parts:
        meta = obj["__crdb__"]
        if not isinstance(meta, dict):
            raise DecodeError("__crdb__ is not an object")
        unknown = set(meta) - _CRDB_META_KEYS
        if unknown:
            raise DecodeError(f"__crdb__ has unknown fields {sorted(unknown)}")
        row = {k: v for k, v in obj.items() if k != "__crdb__"}
        if not row:
            raise DecodeError("bare envelope message without row columns (a delete cannot be expressed in the bare envelope)")
        parts = Parts("bare", None, row, None, False)
        parts.stamps.update({k: meta[k] for k in ("mvcc_timestamp", "updated") if meta.get(k) is not None})
        if meta.get("key") is not None:
            parts.keys.append(("__crdb__.key", meta["key"]))
        if meta.get("topic") not in (None, ""):
            parts.tables.append(table_from_topic(meta["topic"], "__crdb__.topic"))
        parts.notes.append(NO_DELETE_NOTE.format(env="bare"))
        return parts

    def _row(self, obj: dict[str, Any]) -> Parts:
        parts = Parts("row", None, dict(obj), None, False)
        parts.notes.append(NO_DELETE_NOTE.format(env="row"))
        return parts

    # -- the event -------------------------------------------------------------
    def _event(self, parts: Parts, msg: RawMessage, hints: Hints) -> ChangeEvent:
        """One change from an envelope's parts.  Long because it reads the
        envelope's fields in the spec's order, one check each, and gathers every
        problem before it refuses the message (one reason naming them all)."""
        problems: list[DecodeError] = []
        missing: list[str] = []
        table = None
        file_table = cloud_storage_table(msg.file)
        try:
            table = _resolve_table(parts.tables + ([file_table] if file_table is not None else []), msg.file)
        except ConfigRefused as exc:
            problems.append(exc)
            missing.append("table")
        except DecodeError as exc:
            problems.append(exc)
        position = commit_us = None
        ordering = self.ctx.options.get("ordering", "log")
        try:
            position, commit_us = _resolve_position(parts, ordering, msg, hints.index)
        except ConfigRefused as exc:
            problems.append(exc)
            missing.append("HLC")
        except DecodeError as exc:
            problems.append(exc)
        if self._evidence is not None:  # what this message carries, for the file's other messages
            self._evidence.saw(table if "table" not in missing else None, ordering == "log" and position is not None, parts.envelope)
        if problems:
            prefix = "" if parts.envelope != "row" else "no changefeed metadata (treated as envelope=row): "
            text = prefix + "; ".join(map(str, problems))
            if missing:  # a message that cannot be placed for lack of configuration: the batch is refused once
                raise MissingFields(text, tuple(missing), table)
            raise DecodeError(text)
        assert table is not None and position is not None

        op = parts.op or _derive_op(parts)
        notes = list(parts.notes)
        if parts.specs_after is None:
            notes.insert(0, INFERRED_NOTE)
        if op is Op.READ and parts.op is None:
            notes.append("updated is later than mvcc_timestamp: initial scan or backfill emission")

        names, values = self._key(parts, table)
        key_specs = parts.specs_after or {}
        if names is not None:
            for n in names:
                if parts.specs_after is not None and n not in key_specs:
                    raise DecodeError(f"key column {n!r} is not in the message schema")
        key_text = None
        if values is not None and names is not None:
            key_text = {n: _convert_checked(key_specs.get(n), v, parts.specs_after is not None, n) for n, v in zip(names, values)}
            if any(t is None for t in key_text.values()):
                raise DecodeError(f"key of {table.qualified} has a null value: {values!r}")

        after_spec, before_spec = parts.specs_after, parts.specs_before
        before = _convert_image(parts.before, before_spec, "before") if parts.before is not None else None
        if op is Op.DELETE:
            after: dict[str, str | None] = {}
            before = dict(before or {})
            if names is None:
                raise ConfigRefused(
                    f"delete of {table.qualified} without a key: configure primary key columns for table "
                    f"{table.qualified} (or use key_in_value / diff)"
                )
            _merge_key(before, names, key_text, "before", table)
            image_for_columns = before
            spec_for_columns = before_spec
        else:
            after = _convert_image(parts.after, after_spec, "after")
            if names is not None:
                _merge_key(after, names, key_text, "after", table)
            image_for_columns = after
            spec_for_columns = after_spec

        if spec_for_columns is not None:
            columns = [s.column() for s in spec_for_columns.values()]
            extra = set(image_for_columns) - set(spec_for_columns)
            if extra:
                raise DecodeError(f"column(s) {sorted(extra)} not in the message schema")
        else:
            raw_image = parts.after if op is not Op.DELETE else (parts.before or {})
            columns = _inferred_columns(image_for_columns, raw_image, names or [], values)
        return ChangeEvent(
            format=self.format.value,
            database=table.database,
            schema=table.schema,
            table=table.table,
            op=op,
            key_columns=list(names or []),
            after=after,
            position=position,
            before=before,
            columns=columns,
            tx_id=None,
            commit_ts_us=commit_us,
            file=msg.file,
            line=msg.line,
            notes=notes,
        )

    def _key(self, parts: Parts, table: TableRef) -> tuple[list[str] | None, list[Any] | None]:
        """Key column names and raw values, checked for agreement across sources."""
        names_candidates = list(parts.key_names)
        values: list[Any] | None = None
        values_origin = ""
        for origin, raw in parts.keys:
            if isinstance(raw, dict):
                if not raw:
                    raise DecodeError(f"{origin} is an empty object")
                names_candidates.append((origin, [check_identifier(k, "key column") for k in raw]))
                vals = list(raw.values())
            elif isinstance(raw, list):
                if not raw:
                    raise DecodeError(f"{origin} is an empty array")
                vals = raw
            else:
                raise DecodeError(f"{origin} is neither an array nor an object: {raw!r}")
            if values is None:
                values, values_origin = vals, origin
            elif [json_text(v) for v in vals] != [json_text(v) for v in values]:
                raise DecodeError(f"{origin} {vals!r} disagrees with {values_origin} {values!r}")
        names: list[str] | None = None
        names_origin = ""
        for origin, cand in names_candidates:
            if names is None:
                names, names_origin = cand, origin
            elif cand != names:
                raise DecodeError(f"key columns from {origin} {cand} disagree with {names_origin} {names}")
        if names is None:
            configured = self.ctx.configured_key(table.database, table.schema, table.table)
            if configured:
                names = [check_identifier(k, "configured key column") for k in configured]
        if values is not None:
            if names is None:
                raise ConfigRefused(
                    f"the key ({values_origin}) of table {table.qualified} has no column names: configure primary "
                    f"key columns for table {table.qualified} (tables: {{{table.table}: {{primary_key: [...]}}}})"
                )
            if len(names) != len(values):
                raise DecodeError(f"key {values!r} has {len(values)} values but the key columns are {names}")
        return names, values


# --------------------------------------------------------------------------
# Helpers of the event builder


def _image(obj: dict[str, Any], name: str) -> dict[str, Any] | None:
    img = obj.get(name)
    if img is not None and not isinstance(img, dict):
        raise DecodeError(f"{name} is neither an object nor null: {img!r}")
    return img


def _derive_op(parts: Parts) -> Op:
    if parts.envelope == "wrapped" and parts.after is None:
        return Op.DELETE
    mvcc, updated = parts.stamps.get("mvcc_timestamp"), parts.stamps.get("updated")
    if mvcc is not None and updated is not None and parse_hlc(updated, "updated") > parse_hlc(mvcc, "mvcc_timestamp"):
        return Op.READ
    if parts.has_before:
        return Op.INSERT if parts.before is None else Op.UPDATE
    return Op.UPDATE  # an upsert: without diff CockroachDB does not say which


def _resolve_hlc(parts: Parts) -> tuple[int, int] | None:
    """(wall ns, logical) of the message's own HLC, in order of preference."""
    for name in ("mvcc_timestamp", "ts_hlc", "updated"):
        value = parts.stamps.get(name)
        if value is not None:
            return parse_hlc(value, name)
    ts_ns = parts.stamps.get("ts_ns")
    if ts_ns is not None:
        n = as_int(ts_ns, "source.ts_ns")
        if n <= 0:
            raise DecodeError(f"source.ts_ns {ts_ns!r} is not a timestamp")
        return n, 0
    return None


def arrival_position(file: str, line: int, index: int = 0) -> str:
    """``ordering: arrival``: file path, NUL, line (12 digits), '.', index in a
    webhook batch (6 digits).  NUL sorts before any character of a path, so
    string order == (path, line, index) order."""
    return f"{file}\0{pad_decimal(line, 12)}.{pad_decimal(index, 6)}"


def _resolve_position(parts: Parts, ordering: str, msg: RawMessage, index: int) -> tuple[str, int | None]:
    """(position, commit time in us).  ``log``: the HLC, refused (configuration)
    when the changefeed emits none.  ``arrival``: the archive order, for every
    message of the source alike (an HLC, when present, gives only the commit time)."""
    hlc = _resolve_hlc(parts)
    commit_us = hlc[0] // 1000 if hlc is not None else None
    if ordering == "arrival":
        return arrival_position(msg.file, msg.line, index), commit_us
    if hlc is None:
        raise ConfigRefused("no position: the message has no mvcc_timestamp, updated or source.ts_hlc/ts_ns; " + NO_POSITION_HINT)
    return hlc_position(*hlc), commit_us


_CLOUD_STORAGE_NAME = re.compile(
    r"^(?P<ts>\d{33})-(?P<uniquer>[0-9a-f]+-\d+-\d+-\d+)-(?P<topic>.+)-(?P<schema_id>\d+)\.ndjson(?:\.gz|\.zst)?$"
)
_DATE_FOLDER = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@functools.lru_cache(maxsize=1024)
def cloud_storage_table(path: str) -> TableRef | None:
    """The table a cloud-storage sink file is named for, else None.

    The sink names its files ``[date]/[timestamp]-[uniquer]-[topic]-[schema-id].ndjson``
    (``.gz`` with compression=gzip): the timestamp is 33 digits
    (YYYYMMDDHHMMSS, 9 nanosecond digits, 10 logical digits), the uniquer
    ``<session hex>-<node id>-<sink id>-<file id>``, the topic the table name
    (``db.schema.table`` with full_table_name).  The folder above is the date
    (``partition_format=daily``, the default), the date and hour (``hourly``)
    or nothing (``flat``); it is not needed to name the table."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    m = _CLOUD_STORAGE_NAME.match(name)
    if m is None:
        return None
    try:
        return table_from_topic(m.group("topic"), "cloud-storage file name")
    except DecodeError as exc:
        raise ConfigRefused(f"file {name}: {exc}") from None


def _row_delete(hints: Hints) -> Parts:
    """``envelope: row`` (source option): a key without a value is a delete."""
    parts = Parts("row", Op.DELETE, None, None, False)
    parts.keys.append(("archive wrapper key", hints.key))
    if hints.table is not None:
        parts.tables.append(hints.table)
    return parts


def _resolve_table(tables: list[TableRef], file: str = "") -> TableRef:
    if not tables:
        name = file.replace("\\", "/").rsplit("/", 1)[-1]
        raise ConfigRefused(
            f"no table name: neither the message nor its file name ({name!r} is not named as the cloud-storage "
            "sink names files: [date]/<33-digit timestamp>-<uniquer>-<table>-<schema id>.ndjson) says which table "
            "it belongs to: archive Kafka / sinkless messages with their topic or table, keep the sink's file "
            "names, or enable topic_in_value / enriched_properties=source"
        )
    best = max(tables, key=lambda t: (t.database is not None) + (t.schema is not None))
    for t in tables:
        if (
            t.table != best.table
            or (t.database and best.database and t.database != best.database)
            or (t.schema and best.schema and t.schema != best.schema)
        ):
            raise DecodeError(f"{t.origin} names table {t.qualified!r} but {best.origin} names {best.qualified!r}")
    return best


def _convert_checked(spec: FieldSpec | None, value: Any, typed: bool, name: str) -> str | None:
    if typed and spec is None:
        raise DecodeError(f"column {name!r} is not in the message schema")
    return convert(spec, value)


def _convert_image(img: dict[str, Any] | None, specs: dict[str, FieldSpec] | None, what: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, value in (img or {}).items():
        check_identifier(name, "column")
        if specs is not None and name not in specs:
            raise DecodeError(f"{what} column {name!r} is not in the message schema")
        out[name] = convert(None if specs is None else specs[name], value)
    return out


def _merge_key(row: dict[str, str | None], names: list[str], key_text: dict[str, str | None] | None, what: str, table: TableRef) -> None:
    """Make sure ``row`` holds the key; a key that disagrees with the row is an error."""
    for n in names:
        if key_text is not None:
            if n in row and row[n] is not None and row[n] != key_text[n]:
                raise DecodeError(f"key {n}={key_text[n]!r} disagrees with {what}.{n}={row[n]!r}")
            row[n] = key_text[n]
        elif row.get(n) is None:
            raise DecodeError(f"{what} of {table.qualified} has no value for key column {n!r}")


def _inferred_columns(image: dict[str, str | None], raw: dict[str, Any] | None, names: list[str], values: list[Any] | None) -> list[Column]:
    raw = dict(raw or {})
    if values is not None:
        for n, v in zip(names, values):
            raw.setdefault(n, v)
    cols = []
    for name in image:
        typ = infer_type(raw.get(name))
        if typ is not None:
            cols.append(Column(name, typ, name not in names))
    return cols


def _sniff_obj(obj: Any, depth: int) -> bool:
    if not isinstance(obj, dict) or depth > 1:
        return False
    if "__crdb__" in obj or set(obj) == {"resolved"}:
        return True
    if _is_batch(obj):
        return any(_sniff_obj(i, depth + 1) for i in obj["payload"][:3])
    if _is_wrapper(obj) and isinstance(obj.get("value"), str):
        try:
            inner = orjson.loads(obj["value"]) if obj["value"].strip() else None
        except orjson.JSONDecodeError:
            return False
        return (inner is None and "table" in obj) or _sniff_obj(inner, depth + 1)
    payload = obj["payload"] if isinstance(obj.get("payload"), dict) else obj
    source = payload.get("source")
    if isinstance(source, dict) and source.get("origin") == "cockroachdb":
        return True
    schema = obj.get("schema")
    if isinstance(schema, dict) and schema.get("name") == "cockroachdb.envelope":
        return True
    return "after" in obj and set(obj) <= _WRAPPED_KEYS and bool({"key", "updated", "mvcc_timestamp", "topic"} & set(obj))
