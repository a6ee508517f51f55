"""Qlik Replicate decoder: Microsoft Azure Event Hubs target, JSON messages.

Spec: ``/work/shared/formats/qlik-replicate-eventhubs-messages.txt`` (field
tables only, no JSON examples).  Two kinds of messages share one stream:

* **metadata** ``{schemaId, lineage{server, task, schema, table, tableVersion,
  timestamp}, tableStructure{tableColumns{<col>: {ordinal, type, length,
  precision, scale, primaryKeyPosition}}}, dataSchema}`` - one per table and
  table version (a DDL bumps ``tableVersion`` and produces a new one);
* **data** ``{schema, table, data{...}, beforeData{...}|null, headers{operation,
  changeSequence, timestamp, streamPosition, transactionId, changeMask,
  columnMask, externalSchemaId?, transactionEventCounter,
  transactionLastEvent}}``.

A message may also arrive wrapped in the Replicate envelope that Qlik's Kafka
family of targets uses, ``{"magic": "atMSG", "type": "MD"|"DT", "headers",
"messageSchemaId", "messageSchema", "message": {...}}``; the envelope is
validated and unwrapped.  Without an envelope a message is metadata when it has
``tableStructure`` and data when it has ``headers``.

Metadata messages are **driver-side** (``needs_driver``): ``absorb`` records the
columns of each (schema, table, tableVersion) in ``ctx.state['qlik']`` (JSON,
persisted across batches by ``export_state``) and skips the message as
``table-metadata``.  A data message is decoded against:

1. the version whose ``schemaId`` equals ``headers.externalSchemaId``, when the
   header is present and that schema id is known;
2. otherwise the *latest* known ``tableVersion`` of its (schema, table) whose
   column names equal the names in the message's ``data``/``beforeData``; else
   the latest version whose columns include them (the missing ones are then
   "not present"). Column-name matching keeps a batch that holds version-1 data
   after the version-2 metadata (all metadata of a batch is absorbed first)
   decoding with the right ordinals;
3. no known metadata for the table (or none covering its columns) ->
   ``Held('missing-table-metadata')``: the file is read again next batch, by
   which time the metadata message (possibly in another file / partition) has
   usually been archived.

Types (Replicate data types -> Spark): INT1 tinyint, INT2 smallint, INT4 int,
INT8 bigint, UINT1 smallint, UINT2 int, UINT4 bigint, UINT8 decimal(20,0),
NUMERIC(p,s) decimal(p,s) (p > 38 or unknown precision -> string + note, text
kept exact), REAL4 float, REAL8 double, STRING/WSTRING/CLOB/NCLOB string,
BYTES/BLOB binary (JSON carries hex digits; canonical text is base64), BOOLEAN
boolean, DATE date, TIME string, DATETIME/TIMESTAMP timestamp_ntz; anything else
-> string + note.

Masks (``columnMask``/``changeMask``): hex digits of a bitmask in little-endian
*byte* order: the first two hex digits are bits 0-7, the next two bits 8-15, ...;
within a byte bit 0 is the least significant (0x01).  Bit ``i`` is the column of
ordinal ``i + 1`` (the spec: mask ``0B`` = 1011b -> ordinals 1, 2 and 4). An
odd number of hex digits or a bit beyond the last ordinal quarantines the
message. A column whose columnMask bit is 0 is *not present* (left out of the
row image: the apply keeps the stored value), which differs from a present
NULL; no columnMask -> every column is present. The columnMask is applied to
``beforeData`` as well. ``changeMask`` is validated but not otherwise used (the
data image holds every present column anyway).

Position (fixed width, string order == log order)::

    <changeSequence, 35 digits>|<transactionEventCounter, 20 digits>|<k>

``changeSequence`` must be exactly 35 ASCII digits (16-digit timestamp + 19-digit
counter) or the message is quarantined.  ``k`` is ``0`` for the DELETE half of a
primary-key change and ``1`` otherwise, so that delete sorts just before the
insert of the new key at the same change.  REFRESH (full load) rows carry no
change sequence: they get 35 zeros, which sorts before every CDC change of the
task. Known limitation: rows of a table *reloaded* during CDC get the same
zero position and so lose to CDC changes already applied to the same key.

``transactionEventCounter`` is the tie-breaker of two changes at one
``changeSequence``.  ``change_id`` is the ``changeSequence`` (one per source
change; None for REFRESH rows, which have none and are never key changes).

UPDATE whose ``beforeData`` key differs from its ``data`` key (a primary-key
change) becomes a DELETE of the old key (``before`` = beforeData) plus an INSERT
(upsert) of the new key, both with the UPDATE's ``change_id``; the new key's
row carries only the columns the columnMask marks present.  DELETE carries its key in ``before`` (from beforeData,
else from data) and an empty ``after``.  Key columns come from
``primaryKeyPosition`` (ordered by it), else from the configured key.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
from decimal import Decimal
from typing import Any, Literal, overload

import orjson

from cdc_apply.decode.base import DecodeContext, Decoder, check_identifier, has_float
from cdc_apply.model import (
    ChangeEvent,
    Column,
    DecodeError,
    Format,
    Held,
    Op,
    Outcome,
    RawMessage,
    Skipped,
    canonical_value,
    decimal_type,
    epoch_micros,
    pad_decimal,
    parse_iso_datetime,
    transaction_count,
)

MAGIC = "atMSG"
STATE_KEY = "qlik"
SEQ_WIDTH = 35
REFRESH_SEQUENCE = "0" * SEQ_WIDTH
_SEQ = re.compile(r"^[0-9]{35}$")
_HEX = re.compile(r"^[0-9A-Fa-f]*$")
_NUMERIC_TEXT = re.compile(r"^NUMERIC\s*\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)$")

OPS = {"REFRESH": Op.READ, "INSERT": Op.INSERT, "UPDATE": Op.UPDATE, "DELETE": Op.DELETE}

SIMPLE_TYPES = {
    "INT1": "tinyint",
    "INT2": "smallint",
    "INT4": "int",
    "INT8": "bigint",
    "UINT1": "smallint",
    "UINT2": "int",
    "UINT4": "bigint",
    "UINT8": "decimal(20,0)",
    "REAL4": "float",
    "REAL8": "double",
    "STRING": "string",
    "WSTRING": "string",
    "CLOB": "string",
    "NCLOB": "string",
    "BYTES": "binary",
    "BLOB": "binary",
    "BOOLEAN": "boolean",
    "DATE": "date",
    "TIME": "string",
    "DATETIME": "timestamp_ntz",
    "TIMESTAMP": "timestamp_ntz",
}


# --------------------------------------------------------------------------
# Small validators


@overload
def _int(value: Any, what: str, *, minimum: int = 0, optional: Literal[False] = False) -> int: ...
@overload
def _int(value: Any, what: str, *, minimum: int = 0, optional: bool) -> int | None: ...
def _int(value: Any, what: str, *, minimum: int = 0, optional: bool = False) -> int | None:
    """A JSON integer or a string of decimal digits; bools and fractions refused."""
    if value is None or value == "":
        if optional:
            return None
        raise DecodeError(f"{what} is missing")
    if isinstance(value, bool):
        raise DecodeError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        n = int(value.strip())
    else:
        raise DecodeError(f"{what} must be an integer, got {value!r}")
    if n < minimum:
        raise DecodeError(f"{what} must be >= {minimum}, got {n}")
    return n


def _opt_bool(value: Any, what: str) -> bool | None:
    """Optional boolean header: a JSON boolean or "true" / "false" in any case."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise DecodeError(f"{what} must be a boolean, got {value!r}")


def _opt_str(value: Any, what: str) -> str | None:
    """Optional string header: null and '' mean absent."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise DecodeError(f"{what} must be a string, got {value!r}")
    return value


def mask_bits(mask: str, what: str = "mask") -> set[int]:
    """Set bit indices of a Qlik hex mask (little-endian byte order, see module doc).

    ``'0B'`` -> {0, 1, 3}; ``'0001'`` -> {8}; ``'FF0C'`` -> {0..7, 10, 11}.
    """
    if not isinstance(mask, str):
        raise DecodeError(f"{what} must be a hex string, got {mask!r}")
    text = mask.strip()
    if not _HEX.match(text):
        raise DecodeError(f"{what} {mask!r} is not hexadecimal")
    if len(text) % 2:
        raise DecodeError(f"{what} {mask!r} has an odd number of hex digits (expected whole bytes)")
    bits: set[int] = set()
    for i, byte in enumerate(bytes.fromhex(text)):
        for b in range(8):
            if byte >> b & 1:
                bits.add(8 * i + b)
    return bits


def qlik_type(qtype: Any, precision: Any, scale: Any) -> tuple[str, str | None]:
    """Replicate data type -> (Spark type, note or None)."""
    if not isinstance(qtype, str) or not qtype.strip():
        raise DecodeError(f"column type must be a non-empty string, got {qtype!r}")
    name = qtype.strip().upper()
    m = _NUMERIC_TEXT.match(name)
    if m:
        name, precision, scale = "NUMERIC", int(m.group(1)), int(m.group(2) or 0)
    if name in ("NUMERIC", "DECIMAL"):
        p = _int(precision, "NUMERIC precision", optional=True)
        s = _int(scale, "NUMERIC scale", optional=True) or 0
        if not p:
            return "string", f"{qtype} without a precision kept as exact text (string)"
        if p > 38:
            return "string", f"NUMERIC({p},{s}) wider than a Spark decimal kept as exact text (string)"
        return decimal_type(p, s), None
    if name in SIMPLE_TYPES:
        return SIMPLE_TYPES[name], None
    return "string", f"unknown Qlik type {qtype!r} mapped to string"


# --------------------------------------------------------------------------
# Message shapes


def _load(text: str) -> Any:
    """orjson, then again with Decimal numbers when a fraction/exponent occurs
    (NUMERIC is text in Qlik JSON, but a number must never lose digits)."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"malformed JSON: {exc}") from exc
    if has_float(obj):
        obj = json.loads(text, parse_float=Decimal)
    return obj


def unwrap(obj: Any) -> tuple[str, dict[str, Any]]:
    """('MD' | 'DT', message body); the atMSG envelope is optional."""
    if not isinstance(obj, dict):
        raise DecodeError(f"message is a JSON {type(obj).__name__}, not an object")
    if "magic" in obj:
        if obj["magic"] != MAGIC:
            raise DecodeError(f"envelope magic {obj['magic']!r} is not {MAGIC!r}")
        kind = obj.get("type")
        if kind not in ("MD", "DT"):
            raise DecodeError(f"envelope type {kind!r} is neither 'MD' nor 'DT'")
        body = obj.get("message")
        if isinstance(body, str):
            body = _load(body)
        if not isinstance(body, dict):
            raise DecodeError("envelope message is not a JSON object")
        if kind == "MD" and "tableStructure" not in body:
            raise DecodeError("envelope type 'MD' but the message has no tableStructure")
        if kind == "DT" and "headers" not in body:
            raise DecodeError("envelope type 'DT' but the message has no headers")
        return kind, body
    has_structure, has_headers = "tableStructure" in obj, "headers" in obj
    if has_structure and not has_headers:
        return "MD", obj
    if has_headers and not has_structure:
        return "DT", obj
    raise DecodeError("neither a metadata message (tableStructure) nor a data message (headers)")


def table_key(schema: str | None, table: str) -> str:
    return orjson.dumps([schema, table]).decode()


def parse_metadata(body: dict[str, Any]) -> tuple[str | None, str, int, dict[str, Any]]:
    """Validate a metadata message -> (schema, table, version, state record)."""
    lineage = body.get("lineage")
    if not isinstance(lineage, dict):
        raise DecodeError("metadata message without a lineage object")
    schema = None if lineage.get("schema") in (None, "") else check_identifier(lineage["schema"], "schema")
    table = check_identifier(lineage.get("table"), "table")
    version = _int(lineage.get("tableVersion"), "lineage.tableVersion")
    structure = body.get("tableStructure")
    cols = structure.get("tableColumns") if isinstance(structure, dict) else None
    if not isinstance(cols, dict) or not cols:
        raise DecodeError("tableStructure.tableColumns must be a non-empty object")
    columns, notes = [], []
    ordinals: set[int] = set()
    pk_positions: set[int] = set()
    for name, spec in cols.items():
        check_identifier(name, "column")
        if not isinstance(spec, dict):
            raise DecodeError(f"column {name!r}: properties must be an object")
        ordinal = _int(spec.get("ordinal"), f"column {name!r} ordinal", minimum=1)
        if ordinal in ordinals:
            raise DecodeError(f"column {name!r}: ordinal {ordinal} used twice")
        ordinals.add(ordinal)
        pk = _int(spec.get("primaryKeyPosition"), f"column {name!r} primaryKeyPosition", optional=True) or 0
        if pk and pk in pk_positions:
            raise DecodeError(f"column {name!r}: primaryKeyPosition {pk} used twice")
        if pk:
            pk_positions.add(pk)
        try:
            spark, note = qlik_type(spec.get("type"), spec.get("precision"), spec.get("scale"))
        except DecodeError as exc:
            raise DecodeError(f"column {name!r}: {exc}") from exc
        if note:
            notes.append(f"column {name}: {note}")
        columns.append({"name": name, "qlik_type": spec.get("type"), "type": spark, "ordinal": ordinal, "pk": pk})
    columns.sort(key=lambda c: c["ordinal"])
    schema_id = body.get("schemaId")
    record = {
        "schema_id": schema_id if isinstance(schema_id, str) and schema_id else None,
        "timestamp": lineage.get("timestamp") if isinstance(lineage.get("timestamp"), str) else None,
        "columns": columns,
        "notes": notes,
    }
    return schema, table, version, record


# --------------------------------------------------------------------------
# The decoder


class QlikDecoder(Decoder):
    """Qlik Replicate Event Hubs messages -> canonical change events."""

    format = Format.QLIK

    def __init__(self, ctx: DecodeContext | None = None) -> None:
        ctx = ctx or DecodeContext()
        # own copy: absorbing must not mutate the caller's (ledger's) state dict
        super().__init__(DecodeContext(source=ctx.source, primary_keys=ctx.primary_keys, state=copy.deepcopy(ctx.state)))
        st = self.ctx.state.setdefault(STATE_KEY, {})
        if not isinstance(st, dict):
            raise ValueError(f"decoder state {STATE_KEY!r} is not an object")
        st.setdefault("tables", {})
        st.setdefault("schema_ids", {})

    @property
    def _tables(self) -> dict[str, dict[str, Any]]:
        return self.ctx.state[STATE_KEY]["tables"]

    @property
    def _schema_ids(self) -> dict[str, list[Any]]:
        return self.ctx.state[STATE_KEY]["schema_ids"]

    @classmethod
    def sniff(cls, text: str) -> bool:
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict):
            return False
        if obj.get("magic") == MAGIC:
            return True
        if isinstance(obj.get("tableStructure"), dict) and isinstance(obj.get("lineage"), dict):
            return True
        headers = obj.get("headers")
        return isinstance(headers, dict) and "operation" in headers and ("changeSequence" in headers or "data" in obj)

    # -- driver side: metadata ----------------------------------------------
    def needs_driver(self, msg: RawMessage) -> bool:
        """Metadata messages (cheap substring test first, then a real parse)."""
        if "tableStructure" not in msg.text:
            return False
        try:
            return unwrap(_load(msg.text))[0] == "MD"
        except (DecodeError, ValueError, TypeError):
            return False  # decoded (and quarantined) on the normal path

    def absorb(self, messages: list[RawMessage]) -> list[Outcome]:
        return [o for m in messages for o in self.decode(m)]

    def _record_metadata(self, msg: RawMessage, body: dict[str, Any]) -> Skipped:
        schema, table, version, record = parse_metadata(body)
        key = table_key(schema, table)
        versions = self._tables.setdefault(key, {})
        previous = versions.get(str(version))
        versions[str(version)] = record
        if record["schema_id"]:
            self._schema_ids[record["schema_id"]] = [key, version]
        detail = f"{schema}.{table} version {version}: {len(record['columns'])} columns"
        if previous is not None and previous["columns"] != record["columns"]:
            detail += " (replaces different metadata of the same version)"
        return Skipped("table-metadata", file=msg.file, line=msg.line, detail=detail)

    # -- data messages -------------------------------------------------------
    def decode_message(self, msg: RawMessage) -> list[Outcome]:
        kind, body = unwrap(_load(msg.text))
        if kind == "MD":  # normally absorbed on the driver; harmless if not
            return [self._record_metadata(msg, body)]
        return self._decode_data(msg, body)

    def _resolve(self, body: dict[str, Any], headers: dict[str, Any]) -> tuple[str | None, str, int, dict[str, Any], list[str]] | None:
        """(schema, table, version, record, notes) for a data message, or None
        when its metadata is not known (yet)."""
        schema_raw, table_raw = body.get("schema"), body.get("table")
        schema = None if schema_raw in (None, "") else check_identifier(schema_raw, "schema")
        table = None if table_raw in (None, "") else check_identifier(table_raw, "table")
        ext = _opt_str(headers.get("externalSchemaId"), "headers.externalSchemaId")
        if ext is not None and ext in self._schema_ids:
            key, version = self._schema_ids[ext]
            k_schema, k_table = orjson.loads(key)
            if table is not None and (k_schema, k_table) != (schema, table):
                raise DecodeError(f"externalSchemaId {ext!r} belongs to {k_schema}.{k_table}, the message names {schema}.{table}")
            return k_schema, k_table, version, self._tables[key][str(version)], []
        if table is None:
            if ext is not None:
                return None
            raise DecodeError("data message names no table (schema/table fields) and has no externalSchemaId")
        versions = self._tables.get(table_key(schema, table))
        if not versions:
            return None
        names = set()
        for image in (body.get("data"), body.get("beforeData")):
            if isinstance(image, dict):
                names |= set(image)
        ordered = sorted(versions.items(), key=lambda kv: int(kv[0]), reverse=True)
        latest = int(ordered[0][0])
        for exact in (True, False):
            for v, rec in ordered:
                cols = {c["name"] for c in rec["columns"]}
                if (names == cols) if exact else (names <= cols):
                    notes = [] if int(v) == latest else [f"decoded with table version {v} (latest known {latest}) matching its columns"]
                    return schema, table, int(v), rec, notes
        return None

    def _decode_data(self, msg: RawMessage, body: dict[str, Any]) -> list[Outcome]:
        """A data message to its changes.  Long because it reads headers, the
        column mask and the before/after images in the order the Qlik spec
        defines them, one check each."""
        headers = body.get("headers")
        if not isinstance(headers, dict):
            raise DecodeError("data message headers must be an object")
        op_text = headers.get("operation")
        if not isinstance(op_text, str) or op_text.strip().upper() not in OPS:
            raise DecodeError(f"unknown operation {op_text!r}")
        op = OPS[op_text.strip().upper()]
        for field in ("data", "beforeData"):
            if body.get(field) is not None and not isinstance(body[field], dict):
                raise DecodeError(f"{field} must be an object or null")
        if not isinstance(body.get("data"), dict):
            raise DecodeError("data message without a data object")

        resolved = self._resolve(body, headers)
        if resolved is None:
            return [Held("missing-table-metadata", file=msg.file, line=msg.line)]
        schema, table, _version, record, notes = resolved
        notes = list(record["notes"]) + notes
        cols = record["columns"]
        max_ordinal = max(c["ordinal"] for c in cols)

        # masks
        present = {c["name"] for c in cols}
        column_mask = headers.get("columnMask")
        if column_mask not in (None, ""):
            bits = self._checked_bits(column_mask, "columnMask", max_ordinal)
            present = {c["name"] for c in cols if c["ordinal"] - 1 in bits}
        if headers.get("changeMask") not in (None, ""):
            self._checked_bits(headers["changeMask"], "changeMask", max_ordinal)

        key_columns = self._key_columns(schema, table, cols)
        after = self._image(body["data"], cols, present)
        before = None if body.get("beforeData") is None else self._image(body["beforeData"], cols, present)

        # position, transaction, time
        counter = _int(headers.get("transactionEventCounter"), "headers.transactionEventCounter", optional=True)
        if op is Op.READ:
            sequence = REFRESH_SEQUENCE
        else:
            given = headers.get("changeSequence")
            if not isinstance(given, str) or not _SEQ.match(given):
                raise DecodeError(f"changeSequence {given!r} is not a {SEQ_WIDTH}-digit string")
            sequence = given
            if counter is None:
                notes.append("no transactionEventCounter (0 used in the position)")
        base_position = f"{sequence}|{pad_decimal(counter or 0)}"
        tx_id = _opt_str(headers.get("transactionId"), "headers.transactionId")
        # the transaction's completeness (apply/transactions.py): its id, the event's counter and
        # whether it is the last, all three or none (without the last-event header nothing says when
        # a transaction ends: nothing waits); the last event's counter is the transaction's event count
        last = _opt_bool(headers.get("transactionLastEvent"), "headers.transactionLastEvent")
        whole = tx_id is not None and counter is not None and last is not None and op is not Op.READ
        tx_group = tx_id if whole else None
        if whole and counter is not None:
            transaction_count(counter, "headers.transactionEventCounter")
        tx_total = counter if whole and last else None
        ts_text = _opt_str(headers.get("timestamp"), "headers.timestamp")
        commit_ts_us = None
        if ts_text is not None:
            stamp = parse_iso_datetime(ts_text)
            if stamp.tzinfo is None:  # "the original change UTC timestamp"
                stamp = stamp.replace(tzinfo=dt.UTC)
            commit_ts_us = epoch_micros(stamp)

        columns = [Column(c["name"], c["type"]) for c in cols]

        def event(
            ev_op: Op, ev_after: dict[str, str | None], ev_before: dict[str, str | None] | None, k: str, extra: tuple[str, ...] = ()
        ) -> ChangeEvent:
            return ChangeEvent(
                format=Format.QLIK.value,
                database=None,
                schema=schema,
                table=table,
                op=ev_op,
                key_columns=list(key_columns),
                after=ev_after,
                before=ev_before,
                position=f"{base_position}|{k}",
                columns=columns,
                tx_id=tx_id,
                commit_ts_us=commit_ts_us,
                file=msg.file,
                line=msg.line,
                notes=notes + list(extra),
                change_id=None if op is Op.READ else sequence,
                tx_group=tx_group,
                tx_order=counter if tx_group is not None else None,
                tx_total=tx_total,
            )

        if op is Op.DELETE:
            image = before if before is not None else after
            self._require_key(image, key_columns, "DELETE")
            return [event(Op.DELETE, {}, image, "1")]
        self._require_key(after, key_columns, op_text.strip().upper())
        if (
            op is Op.UPDATE
            and before is not None
            and all(before.get(k) is not None for k in key_columns)
            and any(before[k] != after[k] for k in key_columns)
        ):
            note = ("primary-key change: delete of the old key + insert of the new key",)
            return [event(Op.DELETE, {}, before, "0", note), event(Op.INSERT, after, None, "1", note)]
        return [event(op, after, before, "1")]

    # -- helpers -------------------------------------------------------------
    @staticmethod
    def _checked_bits(mask: Any, what: str, max_ordinal: int) -> set[int]:
        bits = mask_bits(mask, what)
        beyond = [b + 1 for b in bits if b + 1 > max_ordinal]
        if beyond:
            raise DecodeError(f"{what} {mask!r} sets ordinal {min(beyond)} but the table's last ordinal is {max_ordinal}")
        return bits

    def _key_columns(self, schema: str | None, table: str, cols: list[dict[str, Any]]) -> list[str]:
        keyed = sorted((c for c in cols if c["pk"]), key=lambda c: c["pk"])
        if keyed:
            return [c["name"] for c in keyed]
        configured = self.ctx.configured_key(None, schema, table)
        if configured:
            names = {c["name"] for c in cols}
            missing = [k for k in configured if k not in names]
            if missing:
                raise DecodeError(f"configured key columns {missing} are not columns of {schema}.{table}")
            return configured
        raise DecodeError(f"{schema}.{table} has no primaryKeyPosition and no configured primary key")

    @staticmethod
    def _image(raw: dict[str, Any], cols: list[dict[str, Any]], present: set[str]) -> dict[str, str | None]:
        known = {c["name"] for c in cols}
        unknown = [name for name in raw if name not in known]
        if unknown:
            raise DecodeError(f"columns {sorted(unknown)} are not in the table metadata")
        out: dict[str, str | None] = {}
        for c in cols:
            name = c["name"]
            if name not in present or name not in raw:
                continue  # not present: the apply keeps the stored value
            value = raw[name]
            try:
                if c["type"] == "binary" and value is not None:
                    if not isinstance(value, str) or not _HEX.match(value) or len(value) % 2:
                        raise DecodeError(f"{value!r} is not hexadecimal bytes")
                    value = bytes.fromhex(value)
                out[name] = canonical_value(c["type"], value)
            except DecodeError as exc:
                raise DecodeError(f"column {name} ({c['qlik_type']}): {exc}") from exc
        return out

    @staticmethod
    def _require_key(image: dict[str, str | None], key_columns: list[str], what: str) -> None:
        missing = [k for k in key_columns if image.get(k) is None]
        if missing:
            raise DecodeError(f"{what} without a value for key column(s) {missing}")

    def export_state(self) -> dict[str, Any]:
        return copy.deepcopy(self.ctx.state)


__all__ = ["REFRESH_SEQUENCE", "QlikDecoder", "mask_bits", "qlik_type", "unwrap"]
