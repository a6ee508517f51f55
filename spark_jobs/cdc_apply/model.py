"""The canonical change model: the one shape every decoder produces and the
ordering / merge code consumes. No format-specific branch exists after decode.

A decoder turns one archived message (a line of a JSON-lines file) into zero or
more *outcomes*:

* ``ChangeEvent``  – a row change (or a table truncate) to apply;
* ``Skipped``      – a message that is by rule not a row change (Kafka tombstone,
                      transaction marker, schema-change message, resolved
                      watermark, logical message, duplicate delivery id, ...);
* ``Held``         – a message that cannot be decoded *yet* (a split CloudEvent
                      whose other segments have not arrived); its file is not
                      marked applied, so the next batch reads it again;
* ``Quarantined``  – a message that cannot be decoded (malformed JSON, missing
                      key, unknown op, a value that does not fit its type).

Every message read is accounted for: events + skipped + held + quarantined.

Row values travel as *canonical text* (see ``canonical_value``) in a
``dict[column -> str | None]``.  A column that is absent from the dict is
**not present** (Qlik columnMask, Debezium's unavailable-value placeholder):
the apply keeps the stored value.  A column present with ``None`` sets NULL.
The typed value is produced in Spark by casting the text to the column's
Spark SQL type, which is exact for decimals and timestamps.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Op(StrEnum):
    INSERT = "c"
    UPDATE = "u"
    DELETE = "d"
    READ = "r"  # snapshot read / full-load refresh: an upsert at its position
    TRUNCATE = "t"  # all rows of the table disappear at this position


class Format(StrEnum):
    DEBEZIUM_SQLSERVER = "debezium_sqlserver"
    DEBEZIUM_POSTGRES = "debezium_postgres"
    SQLSERVER_CES = "sqlserver_ces"
    QLIK = "qlik"
    COCKROACHDB = "cockroachdb"


@dataclass(frozen=True)
class Column:
    """A source column as the message declares it.

    ``type`` is a Spark SQL type name: boolean, tinyint, smallint, int, bigint,
    float, double, decimal(p,s), string, binary, date, timestamp (an instant,
    UTC), timestamp_ntz (a wall-clock value without zone).  Time-of-day values
    and unknown source types map to ``string`` (unknown ones are listed in
    ``ChangeEvent.notes``).
    """

    name: str
    type: str
    nullable: bool = True


@dataclass
class ChangeEvent:
    format: str
    database: str | None
    schema: str | None
    table: str
    op: Op
    key_columns: list[str]
    after: dict[str, str | None]
    position: str
    """Totally ordered *within one source*: fixed-width text whose string order
    is the source log order (each decoder documents its layout)."""
    before: dict[str, str | None] | None = None
    columns: list[Column] | None = None
    tx_id: str | None = None
    commit_ts_us: int | None = None
    """Commit time of the change at the source, microseconds since the epoch (UTC)."""
    file: str = ""
    line: int = 0
    message_id: str | None = None
    notes: list[str] = field(default_factory=list)
    change_id: str | None = None
    """Identifies the source row change: equal for the two halves of a
    primary-key update (a delete of the old key and an insert of the new key
    that the format emits for one source change, possibly in different
    files), distinct otherwise; None where the format has no such pairing.
    The insert half inherits the old key's columns it does not carry."""
    tx_group: str | None = None
    """The source transaction as the format reports its completeness (Debezium
    ``transaction.id``, Qlik ``transactionId``); None without transaction
    metadata.  With ``tx_order`` (the event's place in it) and ``tx_total``
    (how many events it has, given by the message that says so) it lets
    ``apply/transactions.py`` hold a transaction until all of it is read."""
    tx_order: int | None = None
    tx_total: int | None = None


@dataclass
class Skipped:
    reason: str
    file: str = ""
    line: int = 0
    detail: str | None = None
    position: str | None = None  # e.g. a resolved watermark
    tx_group: str | None = None  # a transaction marker's, or a data message's that is no row change (ChangeEvent.tx_group)
    tx_order: int | None = None
    tx_total: int | None = None  # a Debezium END marker's event_count


@dataclass
class Held:
    reason: str
    file: str = ""
    line: int = 0
    group: str | None = None


@dataclass
class Quarantined:
    reason: str
    raw: str
    file: str = ""
    line: int = 0


Outcome = ChangeEvent | Skipped | Held | Quarantined


class DecodeError(ValueError):
    """A message cannot be decoded; the message is quarantined with this text."""


class ConfigRefused(DecodeError):
    """A message cannot be decoded under the source's *configuration* (e.g. a
    changefeed without timestamps, a table with no key names): fixing the
    configuration, not the message, is the remedy.  A decoder raises it per
    message; its quarantine reason starts with ``CONFIG_REFUSED_PREFIX`` and
    the job fails the batch once with a ``ConfigError`` naming each distinct
    reason, instead of quarantining the messages one by one."""


CONFIG_REFUSED_PREFIX = "ConfigRefused: "


@dataclass(frozen=True)
class RawMessage:
    file: str
    line: int  # 1-based line number in the (decompressed) file
    text: str


# --------------------------------------------------------------------------
# Canonical value text, shared by every decoder.

_DECIMAL_TYPE = re.compile(r"^decimal\((\d+),(\d+)\)$")
INT_RANGES = {
    "tinyint": (-(2**7), 2**7 - 1),
    "smallint": (-(2**15), 2**15 - 1),
    "int": (-(2**31), 2**31 - 1),
    "bigint": (-(2**63), 2**63 - 1),
}
SPARK_TYPES = frozenset({"boolean", "float", "double", "string", "binary", "date", "timestamp", "timestamp_ntz"} | set(INT_RANGES))


def is_supported_type(spark_type: str) -> bool:
    return spark_type in SPARK_TYPES or bool(_DECIMAL_TYPE.match(spark_type))


def decimal_type(precision: int, scale: int) -> str:
    """Spark caps decimals at 38 digits; a wider source decimal is refused at decode."""
    if not 0 < precision <= 38 or not 0 <= scale <= precision:
        raise DecodeError(f"decimal({precision},{scale}) does not fit a Spark decimal")
    return f"decimal({precision},{scale})"


_INT_TEXT = re.compile(r"^[+-]?[0-9]+$")


def canonical_value(spark_type: str, value: Any) -> str | None:
    """Validate ``value`` against ``spark_type`` and return its canonical text.

    Accepted inputs are the natural Python values a JSON decoder yields plus the
    types below; anything that does not fit raises ``DecodeError``:

    * integers: int, an integral float, or ASCII decimal digit text with an
      optional sign (sources send numbers as text: Qlik, CES), range-checked
      per width; '1_000', '١٢', '1.5', booleans are refused;
    * decimal(p,s): int / Decimal / exact decimal text (never a float unless it
      is exactly representable), rescaled to ``s`` without rounding;
    * float/double: number or text ('NaN', 'Infinity', '-Infinity' allowed);
    * boolean: bool, 0/1, 'true'/'false'/'t'/'f'/'1'/'0' (any case) — what
      sources send; 'yes'/'no'/'y'/'n', 2, 1.0 are refused (garbage, not a
      source's boolean);
    * date: date or 'YYYY-MM-DD';
    * timestamp: aware datetime (converted to UTC) -> 'YYYY-MM-DD HH:MM:SS.ffffff';
    * timestamp_ntz: naive datetime or ISO text without zone;
    * binary: bytes -> base64 text (text input must already be base64);
    * string: any str; dict/list values are serialised as compact JSON.


    Long because it is one table of per-type rules, read top to bottom,
    each type's accepted inputs next to its refusals."""
    if value is None:
        return None
    try:
        if spark_type in INT_RANGES:
            if isinstance(value, bool):
                raise DecodeError(f"boolean {value!r} is not an {spark_type}")
            if isinstance(value, float):
                if not value.is_integer():
                    raise DecodeError(f"{value!r} is not an integer")
                value = int(value)
            text = str(value).strip()
            if not _INT_TEXT.match(text):  # int() would take '1_000' and non-ASCII digits
                raise DecodeError(f"{value!r} is not an integer")
            n = int(text)
            lo, hi = INT_RANGES[spark_type]
            if not lo <= n <= hi:
                raise DecodeError(f"{n} does not fit {spark_type}")
            return str(n)
        m = _DECIMAL_TYPE.match(spark_type)
        if m:
            precision, scale = int(m.group(1)), int(m.group(2))
            if isinstance(value, float):
                d = decimal.Decimal(repr(value))
            else:
                d = decimal.Decimal(str(value).strip())
            if not d.is_finite():
                raise DecodeError(f"{value!r} is not a finite decimal")
            ctx = decimal.Context(prec=100)  # the default 28 digits would round 29..38-digit values
            q = d.quantize(decimal.Decimal(1).scaleb(-scale, context=ctx), context=ctx)
            if q != d:
                raise DecodeError(f"{value!r} has more than {scale} decimal places")
            if abs(int(q.scaleb(scale, context=ctx))) >= 10**precision:
                raise DecodeError(f"{value!r} does not fit decimal({precision},{scale})")
            return f"{q:f}"
        if spark_type in ("float", "double"):
            if isinstance(value, bool):
                raise DecodeError(f"boolean {value!r} is not a {spark_type}")
            if isinstance(value, str):
                text = value.strip()
                if text in ("NaN", "Infinity", "-Infinity"):
                    return text
                return repr(float(text))
            return repr(float(value))
        if spark_type == "boolean":
            if isinstance(value, bool):
                return "true" if value else "false"
            if isinstance(value, float):
                raise DecodeError(f"{value!r} is not a boolean")
            text = str(value).strip().lower()
            if text in ("true", "1", "t"):  # JSON/SQL text, bit 1, PostgreSQL's text form
                return "true"
            if text in ("false", "0", "f"):
                return "false"
            raise DecodeError(f"{value!r} is not a boolean")
        if spark_type == "date":
            if isinstance(value, dt.datetime):
                value = value.date()
            if isinstance(value, dt.date):
                return value.isoformat()
            return dt.date.fromisoformat(str(value).strip()[:10]).isoformat()
        if spark_type == "timestamp":
            if isinstance(value, str):
                value = parse_iso_datetime(value)
            if not isinstance(value, dt.datetime):
                raise DecodeError(f"{value!r} is not a timestamp")
            if value.tzinfo is None:
                value = value.replace(tzinfo=dt.UTC)
            return timestamp_text(value.astimezone(dt.UTC))
        if spark_type == "timestamp_ntz":
            if isinstance(value, str):
                value = parse_iso_datetime(value)
            if not isinstance(value, dt.datetime):
                raise DecodeError(f"{value!r} is not a timestamp")
            return timestamp_text(value)
        if spark_type == "binary":
            if isinstance(value, (bytes, bytearray)):
                return base64.b64encode(bytes(value)).decode("ascii")
            base64.b64decode(str(value), validate=True)
            return str(value)
        if spark_type == "string":
            if isinstance(value, str):
                return value
            if isinstance(value, (dict, list)):
                import orjson

                return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
            if isinstance(value, bool):
                return "true" if value else "false"
            return str(value)
    except DecodeError:
        raise
    except (ValueError, ArithmeticError, TypeError) as exc:
        raise DecodeError(f"value {value!r} does not fit {spark_type}: {exc}") from exc
    raise DecodeError(f"unsupported canonical type {spark_type!r}")


def timestamp_text(v: dt.datetime) -> str:
    """Fixed-width 'YYYY-MM-DD HH:MM:SS.ffffff' (strftime drops the zero padding of years < 1000)."""
    return f"{v.year:04d}-{v.month:02d}-{v.day:02d} {v.hour:02d}:{v.minute:02d}:{v.second:02d}.{v.microsecond:06d}"


def parse_iso_datetime(text: str) -> dt.datetime:
    """ISO-8601 with up to 9 fractional digits (nanoseconds are truncated to
    micros only after checking they are zero-padded digits), 'Z' or offsets."""
    t = text.strip().replace("T", " ", 1)
    if t.endswith("Z") or t.endswith("z"):
        t = t[:-1] + "+00:00"
    m = re.match(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(.*)$", t)
    if not m:
        raise DecodeError(f"{text!r} is not an ISO timestamp")
    frac = (m.group(2) or "").ljust(9, "0")
    base = dt.datetime.fromisoformat(m.group(1) + "." + frac[:6] + m.group(3))
    return base


def epoch_micros(value: dt.datetime) -> int:
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


TIMESTAMP_MICROS = (-62135596800000000, 253402300799999999)
"""Microseconds since the epoch of 0001-01-01 and 9999-12-31 23:59:59.999999 UTC: Spark's timestamp range."""


def commit_micros(n: int, what: str) -> int:
    """A commit time in microseconds as the model carries it: outside
    Spark's timestamp range the message is damaged (DecodeError, naming the
    field), not a decode task that dies building its Arrow columns."""
    if not TIMESTAMP_MICROS[0] <= n <= TIMESTAMP_MICROS[1]:
        raise DecodeError(f"{what} gives a commit time outside 0001-01-01..9999-12-31 ({n} µs since the epoch)")
    return n


TRANSACTION_COUNTS = (0, INT_RANGES["bigint"][1])
"""What ``transaction_count`` accepts: the canonical model's bigint, not below zero."""


def transaction_count(n: int, what: str) -> int:
    """An event's place in its transaction, or a transaction's event count, as
    the canonical model carries them (bigint): a message's number outside
    0..2^63-1 is a damaged message (DecodeError, naming the field), not a
    batch that dies building its columns."""
    if not TRANSACTION_COUNTS[0] <= n <= TRANSACTION_COUNTS[1]:
        raise DecodeError(f"{what} {n} is out of range for a transaction count (0 to 2^63-1)")
    return n


def pad_decimal(n: int, width: int = 20) -> str:
    """Fixed-width decimal text for positions: string order == numeric order."""
    if n < 0:
        raise DecodeError(f"negative position component {n}")
    text = str(n)
    if len(text) > width:
        raise DecodeError(f"position component {n} wider than {width} digits")
    return text.zfill(width)


# -- Debezium / Kafka Connect semantic types (decoders read them; a table's
# ``columns:`` declaration may name them) --

TIME_UNITS = {  # logical name -> units per second
    "io.debezium.time.Time": 1_000,
    "org.apache.kafka.connect.data.Time": 1_000,
    "io.debezium.time.MicroTime": 1_000_000,
    "io.debezium.time.NanoTime": 1_000_000_000,
}
TIMESTAMP_UNITS = {
    "io.debezium.time.Timestamp": 1_000,
    "org.apache.kafka.connect.data.Timestamp": 1_000,
    "io.debezium.time.MicroTimestamp": 1_000_000,
    "io.debezium.time.NanoTimestamp": 1_000_000_000,
}
DATE_NAMES = {"io.debezium.time.Date", "org.apache.kafka.connect.data.Date"}
_SEMANTIC_TYPES = {  # Debezium / Connect semantic name -> (Spark type, kind, units)
    **{n: ("timestamp_ntz", "timestamp", u) for n, u in TIMESTAMP_UNITS.items()},
    **{n: ("string", "time", u) for n, u in TIME_UNITS.items()},
    **{n: ("date", "date", 1) for n in DATE_NAMES},
    "io.debezium.time.ZonedTimestamp": ("timestamp", "zoned", 1),
    "io.debezium.data.VariableScaleDecimal": ("string", "vsdecimal", 1),
}
SEMANTIC_TYPES = {**_SEMANTIC_TYPES, **{n.rsplit(".", 1)[1]: t for n, t in _SEMANTIC_TYPES.items() if n.startswith("io.debezium")}}
"""Semantic type names a ``columns:`` declaration may use (full or short,
e.g. ``io.debezium.time.MicroTimestamp`` or ``MicroTimestamp``): they say how
the value is written, which the Spark type alone does not (an epoch number's
unit, a time of day)."""
