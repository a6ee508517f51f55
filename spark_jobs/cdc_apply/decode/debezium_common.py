"""Logic shared by the Debezium decoders (PostgreSQL, SQL Server).

An archived line is one Kafka record produced by Kafka Connect's JsonConverter,
in one of three shapes:

* ``{"schema": {...}, "payload": {...}}``  (``schemas.enable=true``);
* ``{...payload...}``                      (``schemas.enable=false``);
* a Kafka-record wrapper ``{"key": K, "value": V}`` (optionally with topic,
  partition, offset, timestamp, headers) where K and V are either of the two
  shapes above, as JSON or as a string holding JSON.  ``V = null`` is a Kafka
  tombstone (log-compaction marker after a delete), never a row change.

A tombstone archived on its own (``tombstones.on.delete=true``, the default,
follows every delete with one) is the line ``null`` or
``{"schema":null,"payload":null}``: skipped as ``kafka-tombstone``.

The key record, when present, is the authority on the primary key: its fields
are the key columns.  Without it the configured key is used, else ``[]`` (the
apply layer refuses keyless tables; we never guess).

Typing (``schemas.enable=true``): every field schema is mapped to a Spark SQL
type by its semantic (logical) name first, then by its literal Connect type;
see ``field_spec``.  Decimals are decoded from base64 two's-complement bytes to
an exact ``decimal.Decimal`` — never through float.  JSON numbers with a
fraction (``decimal.format=NUMERIC``, or schemaless payloads) are re-parsed with
``decimal.Decimal`` so they stay exact as well.

Without a schema the decoder cannot know column types: values are mapped to
canonical text by their JSON type (int -> bigint text, fraction -> exact
number text, str -> as is, bool -> 'true'/'false', object/array -> compact
JSON) and ``ChangeEvent.columns`` is ``None`` (inferred columns would lie:
a JSON null has no type and a base64 decimal looks like a string).  A note
says so.

``VariableScaleDecimal`` (PostgreSQL ``numeric`` without precision) carries a
scale per value, so no single ``decimal(p,s)`` fits every row: it is typed
``string`` holding the exact plain decimal text (no exponent) plus a note; the
SQL layer may cast it when the table declares a decimal.

The unavailable-value placeholder (``__debezium_unavailable_value``; for
``bytes`` fields its base64 form) marks a column whose value the connector
does not have (unchanged TOAST value in PostgreSQL, unchanged
``varchar(max)``/``varbinary(max)`` in SQL Server): the column is left out of
the row dict, i.e. *not present*, and the stored value is kept.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import decimal
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from cdc_apply.decode.base import Decoder, check_identifier, check_json_type, has_float, json_int
from cdc_apply.model import (
    DATE_NAMES,
    INT_RANGES,
    SEMANTIC_TYPES,
    TIME_UNITS,
    TIMESTAMP_UNITS,
    ChangeEvent,
    Column,
    DecodeError,
    Op,
    Outcome,
    RawMessage,
    Skipped,
    canonical_value,
    commit_micros,
    decimal_type,
    timestamp_text,
    transaction_count,
)

PLACEHOLDER = "__debezium_unavailable_value"
PLACEHOLDER_B64 = base64.b64encode(PLACEHOLDER.encode()).decode("ascii")  # 'X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ=='

_WRAPPER_KEYS = frozenset({"key", "value", "topic", "partition", "offset", "timestamp", "timestampType", "timestamp_type", "headers"})
_EPOCH = dt.datetime(1970, 1, 1)


class _NotPresent:
    """Sentinel: the value is the unavailable-value placeholder."""

    def __repr__(self) -> str:  # pragma: no cover - debug aid
        return "NOT_PRESENT"


NOT_PRESENT = _NotPresent()


# --------------------------------------------------------------------------
# JSON


def load_json(text: str | bytes, what: str = "message") -> Any:
    """orjson first (fast); if the document holds any number with a fraction or
    exponent, parse it again with ``decimal.Decimal`` numbers so decimals and
    schemaless numbers stay exact (orjson only yields binary floats)."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"malformed JSON in {what}: {exc}") from exc
    # With schemas enabled, only the payload's numbers become values (the
    # Connect schema's are never read as data): skip walking the big schema.
    values = obj["payload"] if type(obj) is dict and "schema" in obj and "payload" in obj else obj
    if has_float(values):
        obj = json.loads(text, parse_float=decimal.Decimal)
    return obj


# --------------------------------------------------------------------------
# Identifiers and small scalars


def transaction_of(payload: dict[str, Any]) -> tuple[str | None, int | None]:
    """The data message's transaction (``transaction.id``) and its place in it
    (``total_order``), both or neither: what the END marker's ``event_count``
    is checked against (apply/transactions.py)."""
    tx = payload.get("transaction")
    if not isinstance(tx, dict) or tx.get("id") is None or tx.get("total_order") is None:
        return None, None
    return str(tx["id"]), transaction_count(as_int(tx["total_order"], "transaction.total_order"), "transaction.total_order")


def as_int(value: Any, what: str) -> int:
    """A JSON integer or a string of decimal digits (Debezium writes some int64
    source fields as strings); anything else is an error."""
    if isinstance(value, bool):
        raise DecodeError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, decimal.Decimal) and value == value.to_integral_value():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value.strip())
    raise DecodeError(f"{what} must be an integer, got {value!r}")


def commit_ts_us(source: dict[str, Any]) -> int | None:
    """Commit time in micros from the most precise of source.ts_ns/ts_us/ts_ms."""
    if source.get("ts_ns") is not None:
        return commit_micros(as_int(source["ts_ns"], "source.ts_ns") // 1000, "source.ts_ns")
    if source.get("ts_us") is not None:
        return commit_micros(as_int(source["ts_us"], "source.ts_us"), "source.ts_us")
    if source.get("ts_ms") is not None:
        return commit_micros(as_int(source["ts_ms"], "source.ts_ms") * 1000, "source.ts_ms")
    return None


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() == "true"
    return bool(v)


# --------------------------------------------------------------------------
# Field schemas -> Spark types and value converters

_LITERAL_TYPES = {
    "int8": "tinyint",
    "int16": "smallint",
    "int32": "int",
    "int64": "bigint",
    "float32": "float",
    "float64": "double",
    "boolean": "boolean",
    "string": "string",
    "bytes": "binary",
}
_DECIMAL_NAMES = {"org.apache.kafka.connect.data.Decimal", "io.debezium.data.Decimal"}
# Semantic types that are text in JSON and stay text: no note needed.
_TEXT_NAMES = {
    "io.debezium.data.Json",
    "io.debezium.data.Uuid",
    "io.debezium.data.Xml",
    "io.debezium.data.Enum",
    "io.debezium.data.EnumSet",
    "io.debezium.time.ZonedTime",
}
# Semantic types whose literal mapping is already right.
_LITERAL_OK_NAMES = {"io.debezium.time.Year"}


@dataclass(frozen=True)
class FieldSpec:
    """One column of a row struct: its Spark type and how to read its JSON value."""

    name: str
    spark_type: str
    nullable: bool
    kind: str  # 'plain', 'decimal', 'vsdecimal', 'date', 'time', 'timestamp', 'zoned', 'json'
    literal: str
    scale: int = 0
    precision: int = 0  # of a decimal(p, scale) column with scale >= 0 (0: not such a column)
    units: int = 1
    note: str | None = None

    def column(self) -> Column:
        return Column(self.name, self.spark_type, self.nullable)


def field_spec(entry: dict[str, Any]) -> FieldSpec:
    """Map one Connect field schema to a ``FieldSpec``.  Long because it is
    one table of Connect types and semantic names, read top to bottom.

    Accepts the JsonConverter form ``{"type", "optional", "field", "name",
    "parameters"}`` and the nested form some docs show
    (``{"name": col, "schema": {"type": ...}}``); type names are case-insensitive
    and ``optional`` may be a string.
    """
    if not isinstance(entry, dict):
        raise DecodeError(f"field schema is not an object: {entry!r}")
    if "field" in entry:
        col, sch = entry["field"], entry
    elif isinstance(entry.get("schema"), dict):
        col, sch = entry.get("name"), entry["schema"]
    else:
        raise DecodeError(f"field schema without a field name: {entry!r}")
    col = check_identifier(col, "column")
    literal = str(sch.get("type", "")).lower()
    logical = sch.get("name")
    nullable = _truthy(sch.get("optional", True))
    params = sch.get("parameters") or {}
    if not isinstance(params, dict):
        raise DecodeError(f"column {col}: schema parameters is not an object")

    if logical in _DECIMAL_NAMES:
        if "scale" not in params:
            raise DecodeError(f"column {col}: decimal schema without a scale parameter")
        scale = as_int(params["scale"], f"column {col} decimal scale")
        precision = params.get("connect.decimal.precision")
        if scale < 0:
            # PostgreSQL 15 allows numeric(p,-s): values are integers with up to p-s digits.
            p = as_int(precision, "precision") - scale if precision is not None else 38
            return FieldSpec(col, decimal_type(min(p, 38), 0), nullable, "decimal", literal, scale=scale)
        p = as_int(precision, f"column {col} decimal precision") if precision is not None else 38
        return FieldSpec(col, decimal_type(p, scale), nullable, "decimal", literal, scale=scale, precision=p)
    if logical == "io.debezium.data.VariableScaleDecimal":
        return FieldSpec(
            col,
            "string",
            nullable,
            "vsdecimal",
            literal,
            note=f"{col}: VariableScaleDecimal carried as exact decimal text (type string)",
        )
    if logical in DATE_NAMES:
        return FieldSpec(col, "date", nullable, "date", literal)
    if logical in TIME_UNITS:
        return FieldSpec(col, "string", nullable, "time", literal, units=TIME_UNITS[logical])
    if logical in TIMESTAMP_UNITS:
        return FieldSpec(col, "timestamp_ntz", nullable, "timestamp", literal, units=TIMESTAMP_UNITS[logical])
    if logical == "io.debezium.time.ZonedTimestamp":
        return FieldSpec(col, "timestamp", nullable, "zoned", literal)
    if logical in _TEXT_NAMES:
        return FieldSpec(col, "string", nullable, "json" if literal in ("struct", "array", "map") else "plain", literal)
    if literal in _LITERAL_TYPES and (logical is None or logical in _LITERAL_OK_NAMES):
        return FieldSpec(col, _LITERAL_TYPES[literal], nullable, "plain", literal)
    what = f"{literal or '?'}" + (f" ({logical})" if logical else "")
    return FieldSpec(
        col,
        "string",
        nullable,
        "json" if literal in ("struct", "array", "map") else "plain",
        literal,
        note=f"{col}: unsupported type {what} carried as text",
    )


def struct_fields(schema: Any, what: str) -> list[FieldSpec]:
    if not isinstance(schema, dict) or not isinstance(schema.get("fields"), list):
        raise DecodeError(f"{what} schema is not a struct with fields")
    specs = [field_spec(f) for f in schema["fields"]]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise DecodeError(f"{what} schema has duplicate field names: {names}")
    return specs


@dataclass(frozen=True)
class RowShape:
    """What a row schema tells every message that carries it (shared, read-only)."""

    specs: dict[str, FieldSpec]
    notes: tuple[str, ...]
    columns: tuple[Column, ...]
    fast: dict[str, Callable[[Any], Any]]
    """per column, ``fast_converter(spec)``"""

    @classmethod
    def of(cls, specs: list[FieldSpec]) -> RowShape:
        return cls(
            {s.name: s for s in specs},
            tuple(s.note for s in specs if s.note),
            tuple(s.column() for s in specs),
            {s.name: fast_converter(s) for s in specs},
        )


@functools.lru_cache(maxsize=512)
def _row_shape_cached(sub_json: bytes) -> RowShape:
    """Every message of a table repeats the same row schema: map it once."""
    return RowShape.of(struct_fields(orjson.loads(sub_json), "row"))


# --------------------------------------------------------------------------
# Messages without a schema: types from the stored table or the configuration

UNTYPED_NOTE = "no schema: values typed from JSON, columns unknown"
"""The note on an event decoded without any known column types: the job
refuses to create a table from such events (tables' own check)."""
DECLARED_NOTE = "no schema: values typed by the table's stored or declared column types"


def declared_spec(col: str, type_name: str) -> FieldSpec:
    """The FieldSpec of a column known by a Spark type or a semantic name.

    A ``timestamp_ntz`` / ``timestamp`` known only by its Spark type reads ISO
    text; its epoch numbers are refused (``units=0``: ms, µs or ns is the
    semantic type's to say)."""
    if type_name in SEMANTIC_TYPES:
        spark_type, kind, units = SEMANTIC_TYPES[type_name]
        return FieldSpec(col, spark_type, True, kind, "", units=units)
    from cdc_apply.model import is_supported_type

    if not is_supported_type(type_name):
        raise DecodeError(f"column {col}: unsupported declared type {type_name!r}")
    m = re.match(r"^decimal\((\d+),(\d+)\)$", type_name)
    if m:
        return FieldSpec(col, type_name, True, "decimal", "bytes", scale=int(m.group(2)), precision=int(m.group(1)))
    if type_name == "date":
        return FieldSpec(col, "date", True, "date", "")
    if type_name in ("timestamp", "timestamp_ntz"):
        return FieldSpec(col, type_name, True, "timestamp", "", units=0)
    literal = {"binary": "bytes", "string": "string"}.get(type_name, "")
    return FieldSpec(col, type_name, True, "plain", literal)


def convert_declared(spec: FieldSpec, raw: Any, notes: list[str]) -> Any:
    """``convert_value`` for a value of a message without a schema, by its
    column's known type: the JSON forms Debezium's converters write for it
    (base64, ``decimal.handling.mode`` string or double for decimals; epoch
    days or ISO text for dates; epoch numbers in the semantic type's unit or
    ISO text for timestamps; ``{scale, value}`` for variable-scale decimals).
    Anything that is not one of them is a ``DecodeError`` (quarantine)."""
    col, kind = spec.name, spec.kind
    if raw is None or _is_placeholder(spec, raw):
        return convert_value(spec, raw, notes)
    if kind == "decimal" and isinstance(raw, str) and not _is_base64(raw):
        return canonical(spec.spark_type, raw.strip())  # decimal.handling.mode=string
    if kind == "date" and isinstance(raw, str):
        return canonical("date", raw)
    if kind == "timestamp":
        if isinstance(raw, str):
            return canonical(spec.spark_type, raw)
        if not spec.units:
            raise DecodeError(
                f"column {col}: epoch number {raw!r} for a {spec.spark_type} column of a message without a schema: "
                f"its unit is unknown; declare it, e.g. columns: {{{col}: io.debezium.time.MicroTimestamp}}"
            )
        return convert_value(spec, raw, notes)
    if kind == "plain" and spec.spark_type == "string" and not isinstance(raw, str):
        if isinstance(raw, dict) and set(raw) == {"scale", "value"}:
            return convert_value(dataclasses.replace(spec, kind="vsdecimal"), raw, notes)
        if isinstance(raw, (dict, list)):
            return canonical("string", raw)
        raise DecodeError(
            f"column {col} is text in the table but the message holds {raw!r} (a time of day? declare it, "
            f"e.g. columns: {{{col}: io.debezium.time.MicroTime}})"
        )
    if kind == "plain" and type(raw) is str:
        raw = _spec_digits(spec, raw)
    return convert_value(spec, raw, notes)


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        return False
    return bool(text)


def envelope_field(schema: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """The sub-schema of envelope field ``name`` (e.g. 'after'), if any."""
    if not isinstance(schema, dict):
        return None
    for f in schema.get("fields") or []:
        if isinstance(f, dict) and f.get("field") == name:
            return f
    return None


def _is_placeholder(spec: FieldSpec | None, raw: Any) -> bool:
    if raw == PLACEHOLDER:
        return True
    if raw == PLACEHOLDER_B64 and (spec is None or spec.literal == "bytes"):
        return True
    # PostgreSQL arrays of toastable types: ["__debezium_unavailable_value"]
    return isinstance(raw, list) and len(raw) == 1 and raw[0] == PLACEHOLDER


def _json_default(obj: Any) -> Any:
    if isinstance(obj, decimal.Decimal):  # from the exact re-parse: keep the number text
        return orjson.Fragment(str(obj))
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def json_text(value: Any) -> str:
    """Compact, key-sorted JSON (as ``canonical_value('string', ...)``), Decimal-aware."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=_json_default).decode()


def canonical(spark_type: str, value: Any) -> str | None:
    """``canonical_value``, with short cuts for the values most columns hold
    (text into string, in-range int into an integer type, bool into boolean:
    the same text ``canonical_value`` gives) and decimals under a wide decimal
    context: the default 28-digit one would round 29..38-digit decimals while
    checking their range."""
    t = type(value)
    if t is str and spark_type == "string":
        return value
    if t is int:
        bounds = INT_RANGES.get(spark_type)
        if bounds is not None and bounds[0] <= value <= bounds[1]:
            return str(value)
    elif t is bool and spark_type == "boolean":
        return "true" if value else "false"
    elif (t is dict or t is list) and spark_type == "string":
        return json_text(value)
    if not spark_type.startswith("decimal"):
        return canonical_value(spark_type, value)
    with decimal.localcontext() as ctx:
        ctx.prec = 100
        return canonical_value(spark_type, value)


def _decimal_from_bytes(raw: Any, scale: int, col: str) -> decimal.Decimal:
    if not isinstance(raw, str):
        if isinstance(raw, (int, decimal.Decimal)):  # decimal.format=NUMERIC
            return decimal.Decimal(raw)
        raise DecodeError(f"column {col}: decimal must be base64 text, got {raw!r}")
    return decimal.Decimal(_unscaled(raw, col)).scaleb(-scale, context=decimal.Context(prec=1000))


def _unscaled(raw: str, col: str) -> int:
    """The unscaled integer of a Connect decimal: big-endian two's complement, base64."""
    try:
        data = base64.b64decode(raw, validate=True)
    except (ValueError, TypeError) as exc:
        raise DecodeError(f"column {col}: invalid base64 decimal {raw!r}") from exc
    if not data:
        raise DecodeError(f"column {col}: empty decimal bytes")
    return int.from_bytes(data, "big", signed=True)


def _scaled_text(unscaled: int, scale: int) -> str:
    """``f"{Decimal(unscaled).scaleb(-scale):f}"`` for scale >= 0, without Decimal."""
    digits = str(abs(unscaled))
    sign = "-" if unscaled < 0 else ""
    if scale == 0:
        return sign + digits
    digits = digits.rjust(scale + 1, "0")
    return f"{sign}{digits[:-scale]}.{digits[-scale:]}"


def _time_text(n: int, units: int, col: str) -> str:
    if not 0 <= n <= 86_400 * units:  # PostgreSQL allows 24:00:00
        raise DecodeError(f"column {col}: time of day {n} out of range")
    secs, frac = divmod(n, units)
    hh, rem = divmod(secs, 3600)
    mm, ss = divmod(rem, 60)
    digits = len(str(units)) - 1
    frac_text = str(frac).zfill(digits).ljust(6, "0")
    if frac_text[6:].strip("0") == "":
        frac_text = frac_text[:6]
    # else: keep all 9 digits — sub-microsecond precision is data, not noise
    return f"{hh:02d}:{mm:02d}:{ss:02d}.{frac_text}"


def convert_value(spec: FieldSpec | None, raw: Any, notes: list[str]) -> Any:
    """Canonical text of one JSON value (``NOT_PRESENT`` for the placeholder)."""
    if raw is None:
        return None
    if _is_placeholder(spec, raw):
        return NOT_PRESENT
    if spec is None:  # schemaless
        if isinstance(raw, decimal.Decimal):
            return format(raw, "f")
        if isinstance(raw, bool):
            return canonical("boolean", raw)
        if isinstance(raw, int):
            return str(raw)  # no declared width to check against
        return canonical("string", raw)
    col = spec.name
    if spec.kind == "decimal":
        if spec.precision and type(raw) is str:  # the usual case: no Decimal arithmetic needed
            unscaled = _unscaled(raw, col)
            if -(10**spec.precision) < unscaled < 10**spec.precision:
                return _scaled_text(unscaled, spec.scale)
        d = _decimal_from_bytes(raw, spec.scale, col)
        return canonical(spec.spark_type, d)
    if spec.kind == "vsdecimal":
        if not isinstance(raw, dict) or "scale" not in raw or "value" not in raw:
            raise DecodeError(f"column {col}: VariableScaleDecimal must be {{scale, value}}, got {raw!r}")
        d = _decimal_from_bytes(raw["value"], as_int(raw["scale"], f"column {col} scale"), col)
        return format(d, "f")
    if spec.kind == "date":
        days = json_int(raw, f"column {col} (date)")
        try:
            return (_EPOCH + dt.timedelta(days=days)).date().isoformat()
        except OverflowError as exc:
            raise DecodeError(f"column {col}: date {days} days out of range") from exc
    if spec.kind == "time":
        return _time_text(json_int(raw, f"column {col} (time)"), spec.units, col)
    if spec.kind == "timestamp":
        n = json_int(raw, f"column {col} (timestamp)")
        micros, sub = divmod(n * 1_000_000, spec.units)
        if sub:
            notes.append(f"{col}: sub-microsecond digits truncated")
        try:
            value = _EPOCH + dt.timedelta(microseconds=micros)
        except OverflowError as exc:
            raise DecodeError(f"column {col}: timestamp {n} out of range") from exc
        return canonical("timestamp_ntz", value)
    if spec.kind == "zoned":
        if not isinstance(raw, str):
            raise DecodeError(f"column {col}: ZonedTimestamp must be text, got {raw!r}")
        return canonical("timestamp", raw)
    if spec.kind == "json":
        return canonical("string", raw)
    if spec.spark_type == "string" and not isinstance(raw, str) and spec.literal == "string":
        raise DecodeError(f"column {col}: string expected, got {raw!r}")
    if spec.spark_type in ("float", "double") and isinstance(raw, str) and raw not in ("NaN", "Infinity", "-Infinity"):
        raise DecodeError(f"column {col}: number expected, got {raw!r}")
    check_json_type(spec.spark_type, raw, col)
    return canonical(spec.spark_type, raw)


_UTC_ISO = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?Z\Z", re.ASCII)
SLOW = object()
"""What a fast converter returns for a value it leaves to ``convert_value``."""


def fast_converter(spec: FieldSpec) -> Callable[[Any], Any]:
    """``convert_value`` for the values nearly every column holds (text into a
    string, an in-range int into an integer type, a bool, a base64 decimal
    that fits, epoch micros into a timestamp), without its dispatch on the
    kind: a decode spends most of its time here.  Anything else — None,
    placeholders, values that need a note, any error — returns ``SLOW`` so
    ``convert_value`` decides, with its own messages: the result is
    ``convert_value``'s whenever it is not ``SLOW`` (tests/decode check it).

    Long because it is the decode's hot loop: one closure per kind, with
    no call or dispatch per value."""
    t, kind, lit = spec.spark_type, spec.kind, spec.literal
    if kind == "plain" and t == "string":

        def conv(raw: Any) -> Any:
            if type(raw) is str and raw != PLACEHOLDER and (lit != "bytes" or raw != PLACEHOLDER_B64):
                return raw
            return SLOW

        return conv
    if kind == "plain" and t in INT_RANGES:
        lo, hi = INT_RANGES[t]

        def conv(raw: Any) -> Any:
            return str(raw) if type(raw) is int and lo <= raw <= hi else SLOW

        return conv
    if kind == "plain" and t == "boolean":

        def conv(raw: Any) -> Any:
            if type(raw) is bool:
                return "true" if raw else "false"
            return SLOW

        return conv
    if kind == "decimal" and spec.precision:
        limit, scale, col = 10**spec.precision, spec.scale, spec.name

        def conv(raw: Any) -> Any:
            if type(raw) is not str or raw in (PLACEHOLDER, PLACEHOLDER_B64):
                return SLOW
            try:
                unscaled = _unscaled(raw, col)
            except DecodeError:
                return SLOW
            return _scaled_text(unscaled, scale) if -limit < unscaled < limit else SLOW

        return conv
    if kind == "timestamp":
        units = spec.units

        def conv(raw: Any) -> Any:
            if type(raw) is not int:
                return SLOW
            micros, sub = divmod(raw * 1_000_000, units)
            if sub:
                return SLOW  # convert_value notes the truncated digits
            try:
                return timestamp_text(_EPOCH + dt.timedelta(microseconds=micros))
            except OverflowError:
                return SLOW

        return conv
    if kind == "zoned":

        def conv(raw: Any) -> Any:
            # the form Debezium writes: UTC, 'T', 'Z', up to 6 fraction digits
            if type(raw) is not str or not _UTC_ISO.match(raw):
                return SLOW
            try:
                return timestamp_text(dt.datetime.fromisoformat(raw))
            except ValueError:
                return SLOW

        return conv
    return _always_slow


def _always_slow(raw: Any) -> Any:
    return SLOW


def convert_row(
    row: Any,
    specs: dict[str, FieldSpec] | None,
    notes: list[str],
    what: str,
    fast: dict[str, Callable[[Any], Any]] | None = None,
    convert: Callable[[Any, Any, list[str]], Any] = convert_value,
) -> dict[str, str | None] | None:
    """Canonical row dict; placeholder columns are left out (not present).
    ``fast`` (``RowShape.fast``) takes the common values off the slow path."""
    if row is None:
        return None
    if not isinstance(row, dict):
        raise DecodeError(f"{what} is not an object")
    out: dict[str, str | None] = {}
    for col, raw in row.items():
        spec = None
        if specs is not None:
            spec = specs.get(col)
            if spec is None:
                check_identifier(col, "column")
                raise DecodeError(f"{what}.{col} is not declared in the schema")
            # a declared name passed check_identifier when its schema was read
            if fast is not None:
                value = fast[col](raw)
                if value is not SLOW:
                    out[col] = value
                    continue
        else:
            check_identifier(col, "column")
        try:
            value = convert(spec, raw, notes)
        except DecodeError as exc:
            msg = str(exc)
            raise DecodeError(msg if msg.startswith("column ") else f"column {col}: {msg}") from exc
        if value is not NOT_PRESENT:
            out[col] = value
    if what == "after" and specs is not None:  # a NOT NULL column the after image gives as null: garbage, never stored as NULL
        for col, value in out.items():
            if value is None and not specs[col].nullable:
                raise DecodeError(f"column {col}: null in a non-optional column (the message's own schema says it cannot be null)")
    return out


# --------------------------------------------------------------------------
# Records


@dataclass
class Record:
    """One Kafka record, unwrapped: the value's payload and schema, the key."""

    payload: Any  # None = tombstone
    schema: dict[str, Any] | None
    key_payload: Any = None
    key_schema: dict[str, Any] | None = None
    has_key: bool = False
    topic: str | None = None
    tombstone: bool = False


def _split_envelope(obj: Any) -> tuple[Any, dict[str, Any] | None]:
    """(payload, schema) of a JsonConverter document with or without schema."""
    if isinstance(obj, dict) and "payload" in obj and set(obj) <= {"schema", "payload"}:
        schema = obj.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise DecodeError("envelope 'schema' is neither an object nor null")
        return obj["payload"], schema
    return obj, None


def _maybe_json_text(v: Any, what: str) -> Any:
    if isinstance(v, (str, bytes)):
        return load_json(v, what)
    return v


_ENVELOPE_HEAD, _PAYLOAD_KEY = '{"schema":', ',"payload":'
_KNOWN_SCHEMAS: dict[str, dict[str, Any]] = {}  # a schema's exact text -> the schema (without floats)
_UNUSABLE_SCHEMAS: set[str] = set()  # texts that can never be used: not checked again on every line
_KNOWN_SCHEMAS_MAX = 256
_SHAPE_OF_KNOWN: dict[int, tuple[dict[str, Any], RowShape | None]] = {}
"""id of each schema object in ``_KNOWN_SCHEMAS`` -> (it, its RowShape once
mapped): the lines that reuse a known schema text share one schema object,
so its shape is found without serialising the schema again for the cache
key.  The entry keeps its schema object alive, so its id cannot be reused
while it is here; the identity check makes a hit exact."""


def _schema_text(text: str) -> tuple[str, int] | None:
    """(S, where ',"payload":' starts) of a line starting ``{"schema":S,"payload":``."""
    if not text.startswith(_ENVELOPE_HEAD):
        return None
    cut = text.find(_PAYLOAD_KEY, len(_ENVELOPE_HEAD))
    return None if cut < 0 else (text[len(_ENVELOPE_HEAD) : cut], cut)


def _payload_only(text: str, cut: int, schema: dict[str, Any]) -> Record | None:
    """Parse only P of ``{"schema":S,"payload":P}`` whose S is a schema text met
    before (a schema is ~80 % of such a line and the same on every line of a
    table).  None whenever the line is not exactly of that shape or P is not
    a JSON value by itself: the caller then parses the whole line."""
    body = text.rstrip()
    if not body.endswith("}"):
        return None
    payload_text = body[cut + len(_PAYLOAD_KEY) : -1]
    try:
        payload = orjson.loads(payload_text)
    except orjson.JSONDecodeError:
        return None
    if has_float(payload):
        payload = json.loads(payload_text, parse_float=decimal.Decimal)
    return Record(payload=payload, schema=schema)


def _remember_schema(schema_text: str, schema: Any) -> None:
    """Keep S when it parses to the very schema of the line (so the first
    ',"payload":' is not inside S).  A text that can never be used — not a
    JSON object by itself, or holding floats (which the full path parses
    exactly with Decimal) — is remembered as such, so it is checked once."""
    if len(_KNOWN_SCHEMAS) + len(_UNUSABLE_SCHEMAS) >= _KNOWN_SCHEMAS_MAX:
        return
    try:
        parsed = orjson.loads(schema_text)
    except orjson.JSONDecodeError:
        parsed = None
    if type(parsed) is not dict or has_float(parsed):
        _UNUSABLE_SCHEMAS.add(schema_text)
    elif parsed == schema:
        _KNOWN_SCHEMAS[schema_text] = schema
        _SHAPE_OF_KNOWN[id(schema)] = (schema, None)


_last_known: tuple[str, dict[str, Any]] = ("\0", {})
"""('{"schema":S,"payload":', schema) of the known schema S last met: the next
line of the table starts with it.  A known S never holds ',"payload":' (it is
found as the text before its first occurrence) and ends with '}', so a line
starting with that prefix has exactly S as its ``_schema_text``; testing the
prefix spares finding the cut and hashing the ~3 KB S on every line."""


def parse_record(text: str) -> Record:
    global _last_known
    if text.startswith(_last_known[0]):
        known = _payload_only(text, len(_last_known[0]) - len(_PAYLOAD_KEY), _last_known[1])
        if known is not None:
            return known
    head = _schema_text(text)
    if head is not None and head[0] in _KNOWN_SCHEMAS:
        known_schema = _KNOWN_SCHEMAS[head[0]]
        _last_known = (text[: head[1] + len(_PAYLOAD_KEY)], known_schema)
        known = _payload_only(text, head[1], known_schema)
        if known is not None:
            return known
    obj = load_json(text)
    fresh = head is not None and head[0] not in _KNOWN_SCHEMAS and head[0] not in _UNUSABLE_SCHEMAS
    if head is not None and fresh and type(obj) is dict and obj.keys() == {"schema", "payload"}:
        _remember_schema(head[0], obj["schema"])
    if obj is None:  # a Kafka tombstone (null value) archived as the line `null`
        return Record(payload=None, schema=None, tombstone=True)
    if not isinstance(obj, dict):
        raise DecodeError(f"message is not a JSON object but {type(obj).__name__}")
    if "value" in obj and "payload" not in obj and set(obj) <= _WRAPPER_KEYS:
        topic = obj.get("topic")
        value = _maybe_json_text(obj["value"], "Kafka value")
        rec = Record(payload=None, schema=None, topic=topic if isinstance(topic, str) else None)
        if "key" in obj and obj["key"] is not None:
            key = _maybe_json_text(obj["key"], "Kafka key")
            rec.key_payload, rec.key_schema = _split_envelope(key)
            rec.has_key = rec.key_payload is not None
        if value is None:
            rec.tombstone = True
            return rec
        rec.payload, rec.schema = _split_envelope(value)
        return rec
    payload, schema = _split_envelope(obj)
    if payload is None and schema is None:  # a tombstone through JsonConverter: {"schema":null,"payload":null}
        return Record(payload=None, schema=None, tombstone=True)
    return Record(payload=payload, schema=schema)


def classify(rec: Record) -> str:
    """'change', 'tombstone', 'transaction-marker', 'schema-change', 'heartbeat'
    or 'key-record' (a key archived without its value)."""
    if rec.tombstone:
        return "tombstone"
    p = rec.payload
    if not isinstance(p, dict):
        raise DecodeError(f"payload is not an object: {p!r:.80}")
    schema_name = (rec.schema or {}).get("name") or ""
    if "op" in p:
        return "change"
    if schema_name.endswith("TransactionMetadataValue") or (p.get("status") in ("BEGIN", "END") and "id" in p):
        return "transaction-marker"
    if "SchemaChange" in schema_name or "tableChanges" in p or ("databaseName" in p and "ddl" in p):
        return "schema-change"
    if schema_name.endswith(".Heartbeat") or (rec.topic or "").startswith("__debezium-heartbeat") or set(p) == {"ts_ms"}:
        return "heartbeat"
    if schema_name.endswith(".Key"):
        return "key-record"
    raise DecodeError(f"not a Debezium change event: payload has no 'op' (fields: {sorted(p)[:10]})")


# --------------------------------------------------------------------------
# The shared decoder


class DebeziumDecoder(Decoder):
    """Common pipeline; subclasses give the connector name, the accepted ops,
    the position layout and special ops (truncate, logical message)."""

    connector: ClassVar[str]
    ops: ClassVar[frozenset[str]] = frozenset({"c", "u", "d", "r"})

    # -- hooks ---------------------------------------------------------------
    def position(self, source: dict[str, Any], payload: dict[str, Any], notes: list[str]) -> str:
        raise NotImplementedError

    def tx_id(self, source: dict[str, Any], payload: dict[str, Any]) -> str | None:
        tx = payload.get("transaction")
        if isinstance(tx, dict) and tx.get("id") is not None:
            return str(tx["id"])
        return None

    def special(self, op: str, rec: Record, source: dict[str, Any], msg: RawMessage) -> list[Outcome] | None:
        """Outcomes for ops that are not row changes (None = a row change)."""
        return None

    def transaction_group(self, transaction_id: str) -> str:
        """The part of a ``transaction.id`` (a change's, a BEGIN / END marker's)
        that is the same on every message of one transaction."""
        return transaction_id

    def change_id(self, source: dict[str, Any], op: str, key: dict[str, str | None]) -> str | None:
        """``ChangeEvent.change_id``: the source's id of the row change (equal
        for the delete + create halves of a primary-key update)."""
        return None

    # -- pipeline ------------------------------------------------------------
    def decode_message(self, msg: RawMessage) -> list[Outcome]:
        """One Debezium record to its outcomes.  Long because it dispatches on
        the record's kind (tombstone, transaction marker, schema change, heartbeat,
        row change) in the order the spec gives them, one short branch each."""
        rec = parse_record(msg.text)
        kind = classify(rec)
        if kind == "tombstone":
            return [Skipped("kafka-tombstone", msg.file, msg.line)]
        if kind == "transaction-marker":
            p = rec.payload
            end = p.get("status") == "END" and p.get("event_count") is not None
            return [
                Skipped(
                    "transaction-marker",
                    msg.file,
                    msg.line,
                    detail=f"{p.get('status')} {p.get('id')}",
                    tx_group=None if p.get("id") is None else self.transaction_group(str(p["id"])),
                    tx_total=transaction_count(as_int(p["event_count"], "event_count"), "event_count") if end else None,
                )
            ]
        if kind == "schema-change":
            detail = "schema-change key record" if "SchemaChangeKey" in ((rec.schema or {}).get("name") or "") else None
            return [Skipped("schema-change", msg.file, msg.line, detail=detail)]
        if kind == "heartbeat":
            return [Skipped("heartbeat", msg.file, msg.line)]
        if kind == "key-record":
            raise DecodeError("a Debezium key record archived without its value: not a change event")

        payload = rec.payload
        op = payload["op"]
        if not isinstance(op, str):  # a list or object is not hashable: name the field, not a TypeError
            raise DecodeError(f"field 'op' is a {type(op).__name__}, not a string: {str(op)[:100]}")
        if op not in self.ops:
            raise DecodeError(f"unknown op {op!r} for {self.connector}")
        source = payload.get("source")
        if not isinstance(source, dict):
            raise DecodeError("payload.source is missing or not an object")
        connector = source.get("connector")
        if connector is not None and connector != self.connector:
            raise DecodeError(f"source.connector is {connector!r}, expected {self.connector!r}")
        tx_id, tx_order = transaction_of(payload)
        tx_group = None if tx_id is None else self.transaction_group(tx_id)
        special = self.special(op, rec, source, msg)
        if special is not None:
            for o in special:
                if isinstance(o, ChangeEvent | Skipped):
                    o.tx_group, o.tx_order = tx_group, tx_order
            return special

        notes: list[str] = []
        database, schema, table = self.table_name(source)
        position = self.position(source, payload, notes)
        shape = self.row_shape(rec.schema)
        convert: Callable[[Any, Any, list[str]], Any] = convert_value
        if shape is None:
            shape = self.declared_shape(database, schema, table)
            if shape is not None:
                convert = convert_declared
                notes.append(DECLARED_NOTE)
                self.check_declared(shape, payload, table)
        specs = shape.specs if shape is not None else None
        if shape is None:
            notes.append(UNTYPED_NOTE)
        else:
            notes.extend(shape.notes)

        fast = shape.fast if shape is not None and convert is convert_value else None
        after = convert_row(payload.get("after"), specs, notes, "after", fast, convert)
        before = convert_row(payload.get("before"), specs, notes, "before", fast, convert)
        if op == "d":
            if before is None and not rec.has_key:
                raise DecodeError("delete without a before image or a key")
            image = dict(before or {})
        else:
            if after is None:
                raise DecodeError(f"op {op!r} without an after image")
            image = after

        key_columns, image = self.resolve_key(rec, specs, image, database, schema, table, notes)
        if op == "d":
            before, after = image, {}
        else:
            after = image

        return [
            ChangeEvent(
                format=str(self.format),
                database=database,
                schema=schema,
                table=table,
                op=Op(op),
                key_columns=key_columns,
                after=after,
                position=position,
                before=before,
                columns=list(shape.columns) if shape is not None else None,
                tx_id=self.tx_id(source, payload),
                commit_ts_us=commit_ts_us(source),
                file=msg.file,
                line=msg.line,
                notes=list(dict.fromkeys(notes)),
                change_id=self.change_id(source, op, {k: image.get(k) for k in key_columns}),
                tx_group=tx_group,
                tx_order=tx_order,
            )
        ]

    # -- pieces --------------------------------------------------------------
    def table_name(self, source: dict[str, Any]) -> tuple[str | None, str | None, str]:
        if source.get("table") is None:
            raise DecodeError("source.table is missing")
        table = check_identifier(source["table"], "table")
        schema = check_identifier(source["schema"], "schema") if source.get("schema") is not None else None
        database = check_identifier(source["db"], "database") if source.get("db") is not None else None
        return database, schema, table

    def declared_shape(self, database: str | None, schema: str | None, table: str) -> RowShape | None:
        """The row shape of a message without a schema, from the table's known
        column types (``DecodeContext.known_types``); None when none is known.
        Built once per table and decoder."""
        cache = self.__dict__.setdefault("_declared_shapes", {})
        name = (database, schema, table)
        if name not in cache:
            types = self.ctx.known_types(database, schema, table)
            cache[name] = None if types is None else RowShape.of([declared_spec(c, t) for c, t in types.items()])
        return cache[name]

    @staticmethod
    def check_declared(shape: RowShape, payload: dict[str, Any], table: str) -> None:
        for what in ("after", "before"):
            row = payload.get(what)
            unknown = sorted(set(row) - set(shape.specs)) if isinstance(row, dict) else []
            if unknown:
                raise DecodeError(
                    f"message without a schema: column(s) {unknown} of {table} are neither in the table "
                    "nor declared (sources.yaml columns:), so their type is unknown"
                )

    @staticmethod
    def row_shape(schema: dict[str, Any] | None) -> RowShape | None:
        """Field specs of the row struct (the envelope's 'after', else 'before')."""
        if schema is None:
            return None
        known = _SHAPE_OF_KNOWN.get(id(schema))
        if known is None or known[0] is not schema:  # not a known schema's object
            return DebeziumDecoder._row_shape(schema)
        if known[1] is None:
            _SHAPE_OF_KNOWN[id(schema)] = known = (schema, DebeziumDecoder._row_shape(schema))
        return known[1]

    @staticmethod
    def _row_shape(schema: dict[str, Any]) -> RowShape:
        sub = envelope_field(schema, "after") or envelope_field(schema, "before")
        if sub is None:
            raise DecodeError("envelope schema has neither an 'after' nor a 'before' field")
        try:
            key = orjson.dumps(sub, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # e.g. Decimal defaults: not worth caching
            return RowShape.of(struct_fields(sub, "row"))
        return _row_shape_cached(key)

    def resolve_key(
        self,
        rec: Record,
        specs: dict[str, FieldSpec] | None,
        image: dict[str, str | None],
        database: str | None,
        schema: str | None,
        table: str,
        notes: list[str],
    ) -> tuple[list[str], dict[str, str | None]]:
        """Key columns, and the row image completed with the key values.

        The Kafka key wins; its values must agree with the row image (a
        mismatch means a corrupt or mis-assembled record)."""
        image = dict(image)
        if rec.has_key:
            if not isinstance(rec.key_payload, dict) or not rec.key_payload:
                raise DecodeError(f"Kafka key payload is not a non-empty object: {rec.key_payload!r:.80}")
            key_specs: dict[str, FieldSpec] | None
            if rec.key_schema is not None:
                key_specs = {s.name: s for s in struct_fields(rec.key_schema, "key")}
            else:
                key_specs = specs
            columns = [check_identifier(c, "key column") for c in rec.key_payload]
            for col in columns:
                spec = key_specs.get(col) if key_specs is not None else None
                if key_specs is not None and spec is None:
                    raise DecodeError(f"key column {col} is not declared in the key schema")
                value = convert_value(spec, _spec_digits(spec, rec.key_payload[col]), notes)
                if value is NOT_PRESENT or value is None:
                    raise DecodeError(f"key column {col} has no value")
                if col in image and image[col] != value:
                    raise DecodeError(f"key column {col}: key says {value!r}, row says {image[col]!r}")
                image[col] = value
            return columns, image
        configured = self.ctx.configured_key(database, schema, table)
        if configured:
            for col in configured:
                if image.get(col) is None:
                    raise DecodeError(f"configured key column {col} has no value in the row image")
            return list(configured), image
        return [], image


def _spec_digits(spec: FieldSpec | None, raw: Any) -> Any:
    """An integer given as digit text where the connector specs show it so
    (the PostgreSQL spec's Kafka key example writes an INT32 key as ``"1"``,
    the SQL Server spec's schemaless payloads ``"pk": "1"``) is read as the
    integer; in a value typed by its own schema it must be a JSON integer
    (``check_json_type``)."""
    if (
        type(raw) is str
        and spec is not None
        and spec.kind == "plain"
        and spec.spark_type in INT_RANGES
        and re.fullmatch(r"[+-]?[0-9]+", raw)
    ):
        return int(raw)
    return raw


def snapshot_change_id(prefix: str, key: dict[str, str | None]) -> str:
    """A snapshot read's change id: its position is shared by every row of the
    snapshot, so its key makes it distinct (a snapshot has no key changes)."""
    return f"{prefix}|snapshot|{json_text(key)}"


def sniff_connector(text: str, connector: str) -> bool:
    return re.search(r'"connector"\s*:\s*"' + re.escape(connector) + '"', text) is not None


__all__ = [
    "NOT_PRESENT",
    "PLACEHOLDER",
    "PLACEHOLDER_B64",
    "DebeziumDecoder",
    "FieldSpec",
    "Record",
    "as_int",
    "check_identifier",
    "classify",
    "commit_ts_us",
    "convert_row",
    "convert_value",
    "field_spec",
    "load_json",
    "parse_record",
    "sniff_connector",
]
