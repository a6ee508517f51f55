"""A fast path for Debezium PostgreSQL lines ``{"schema":S,"payload":P}``.

Nearly every line of a ``schemas.enable=true`` archive repeats its table's
Connect schema S (~3 KB of a ~4 KB line) and carries an ordinary row change.
For such a line this module parses only P, with msgspec Structs generated
from S (cached by S's exact bytes), straight from the file's read buffer (no
``bytes`` or ``str`` object per line), and builds the outcome rows' Arrow
columns itself, a batch at a time.

It never decides anything the exact decoder (``DebeziumPostgresDecoder``)
would decide differently: every value goes through the exact decoder's own
``fast_converter`` (or is refused), the Structs are strict (every field of
S typed, unknown fields refused, so every string's UTF-8 and every number is
checked), and anything unusual — a schema not seen before, a placeholder,
a note, a truncate, an error of any kind, a ``\\r``, a BOM, a blank line —
sends *that line* to the exact decoder, whose outcome (and quarantine
reason) is then the line's outcome.  ``tests/decode/test_fast_debezium.py``
pins both paths to the same outcome rows on generated messages.
"""

from __future__ import annotations

import binascii
from binascii import a2b_base64
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.archive.lines import CHUNK_BYTES, GZIP_MAGIC, Piece, Source, iter_lines, line_message
from cdc_apply.decode.base import Decoder, check_identifier, has_float
from cdc_apply.decode.debezium_common import (
    PLACEHOLDER,
    PLACEHOLDER_B64,
    SLOW,
    DebeziumDecoder,
    FieldSpec,
    RowShape,
    _scaled_text,
    fast_converter,
    json_text,
)
from cdc_apply.decode.debezium_postgres import SNAPSHOT_PHASES, DebeziumPostgresDecoder, parse_sequence, pg_transaction_group
from cdc_apply.model import INT_RANGES, TIMESTAMP_MICROS, TRANSACTION_COUNTS, DecodeError, Outcome, Quarantined, RawMessage

HEAD, PAYLOAD_KEY = b'{"schema":', b',"payload":'
FAST_OPS = frozenset({"c", "u", "d", "r"})  # 't' and 'm' are the exact decoder's
BATCH_ROWS = 4096  # lines parsed before their columns are built (their read buffers are held until then)
_COLUMN = pa.struct([("name", pa.string()), ("type", pa.string()), ("nullable", pa.bool_())])
_CONNECT_TYPES: dict[str, Any] = {"string": str, "bytes": str, "boolean": bool, "int8": int, "int16": int, "int32": int, "int64": int}


class Unusable(Exception):
    """A schema the fast path does not take (every line of it goes the exact way)."""


def _struct_of(name: str, fields: list[tuple[str, Any]], *, row: bool = False) -> type:
    """A strict Struct of JSON field names (renamed from f0.., so any column
    name works); an absent field is None (as ``dict.get`` reads it), in a
    row ``UNSET`` (an absent column is *not present*, not NULL)."""
    absent = msgspec.UNSET if row else None
    return msgspec.defstruct(
        name,
        [(f"f{i}", (t | None | msgspec.UnsetType) if row else (t | None), absent) for i, (_, t) in enumerate(fields)],
        rename={f"f{i}": n for i, (n, _) in enumerate(fields)},
        forbid_unknown_fields=True,
    )


def _connect_struct(name: str, schema: Any) -> tuple[type, list[str]]:
    """A Struct typing every field of a Connect struct schema by its literal
    type (nested structs too); floats, arrays and maps are not taken."""
    if not isinstance(schema, dict) or schema.get("type") != "struct" or not isinstance(schema.get("fields"), list):
        raise Unusable(f"{name} is not a struct schema")
    fields: list[tuple[str, Any]] = []
    for f in schema["fields"]:
        if not isinstance(f, dict) or not isinstance(f.get("field"), str):
            raise Unusable(f"{name}: field without a name")
        literal = f.get("type")
        if literal == "struct":
            fields.append((f["field"], _connect_struct(f"{name}_{len(fields)}", f)[0]))
        elif literal in _CONNECT_TYPES:
            fields.append((f["field"], _CONNECT_TYPES[literal]))
        else:
            raise Unusable(f"{name}.{f['field']}: Connect type {literal!r}")
    names = [n for n, _ in fields]
    if len(set(names)) != len(names):
        raise Unusable(f"{name}: duplicate field names")
    return _struct_of(name, fields), names


def _value_type(spec: FieldSpec) -> tuple[Any, str]:
    """The JSON type of a row column the fast path converts, and its
    converter's name: what its ``fast_converter`` takes without a note
    (anything else is the exact decoder's)."""
    if spec.kind == "plain" and spec.spark_type == "string" and spec.literal == "string":
        return str, "string"
    if spec.kind == "plain" and spec.spark_type in INT_RANGES:
        lo, hi = INT_RANGES[spec.spark_type]
        return Annotated[int, msgspec.Meta(ge=lo, le=hi)], "int"
    if spec.kind == "plain" and spec.spark_type == "boolean":
        return bool, "bool"
    if spec.kind == "decimal" and spec.precision:
        return str, "decimal"
    if spec.kind == "timestamp" and spec.units in (1_000, 1_000_000):
        lo, hi = INT_RANGES["bigint"]
        return Annotated[int, msgspec.Meta(ge=lo, le=hi)], "timestamp"
    if spec.kind == "zoned":
        return str, "zoned"
    raise Unusable(f"column {spec.name}: kind {spec.kind} ({spec.spark_type})")


@dataclass(frozen=True)
class Plan:
    """What one schema text tells the fast path: the payload's Struct, the
    row's column names and converters, and the exact decoder's RowShape."""

    payload: msgspec.json.Decoder
    envelope: dict[str, int]  # payload field -> index in the payload Struct
    source: dict[str, int]  # source field -> index in the source Struct
    tx_fields: dict[str, int]  # transaction field -> index, {} without one
    names: tuple[str, ...]
    kinds: tuple[str, ...]  # per column, its converter in ``_CONVERT``
    specs: tuple[FieldSpec, ...]
    nullable: tuple[bool, ...]
    shape: RowShape
    column_tuples: list[tuple[str, str, bool]]


def make_plan(schema: dict[str, Any]) -> Plan:
    """The Plan of an envelope schema, or ``Unusable``.  Long because it
    reads the envelope's fields one by one: before/after (the row), source,
    transaction and the scalars, each checked to be what the fast path
    expects."""
    shape = DebeziumDecoder.row_shape(schema)
    if shape is None or shape.notes:
        raise Unusable("a row shape with notes")
    specs = list(shape.specs.values())
    typed = [_value_type(s) for s in specs]
    row = _struct_of("Row", [(s.name, t) for s, (t, _) in zip(specs, typed, strict=True)], row=True)
    if not isinstance(schema.get("fields"), list):
        raise Unusable("envelope without fields")
    fields: list[tuple[str, Any]] = []
    source_names: list[str] = []
    tx_names: list[str] = []
    for f in schema["fields"]:
        name = f.get("field") if isinstance(f, dict) else None
        if name in ("before", "after"):
            fields.append((name, row))
        elif name == "source":
            src, source_names = _connect_struct("Source", f)
            fields.append((name, src))
        elif name == "transaction":
            tx, tx_names = _connect_struct("Transaction", f)
            fields.append((name, tx))
        elif isinstance(name, str) and f.get("type") in _CONNECT_TYPES and f.get("type") != "bytes":
            fields.append((name, _CONNECT_TYPES[f["type"]]))
        else:
            raise Unusable(f"envelope field {name!r}")
    names = [n for n, _ in fields]
    if "source" not in names or "op" not in names or len(set(names)) != len(names):
        raise Unusable("envelope without source or op")
    if not {"lsn", "table"} <= set(source_names):
        raise Unusable("source without lsn or table")
    payload = _struct_of("Payload", fields)
    return Plan(
        payload=msgspec.json.Decoder(payload),
        envelope={n: i for i, n in enumerate(names)},
        source={n: i for i, n in enumerate(source_names)},
        tx_fields={n: i for i, n in enumerate(tx_names)},
        names=tuple(s.name for s in specs),
        kinds=tuple(k for _, k in typed),
        specs=tuple(specs),
        nullable=tuple(s.nullable for s in specs),
        shape=shape,
        column_tuples=[(c.name, c.type, c.nullable) for c in shape.columns],
    )


class Pending:
    """The lines of one plan parsed so far: their payload Structs, and where
    each line is, for the exact decoder if a check refuses it."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.payloads: list[Any] = []
        self.where: list[tuple[str, int, bytes | str, int, int]] = []  # file, line, buffer, start, end


def _exact_outside(values: list[Any], bounds: tuple[int, int], bad: np.ndarray, fill: Any = None) -> list[Any]:
    """Lines whose value lies outside ``bounds`` (inclusive) are the exact
    decoder's, which refuses them naming the field: marked in ``bad`` (in
    place), their value replaced by ``fill`` so the column still builds."""
    lo, hi = bounds
    outside = [v is not None and not lo <= v <= hi for v in values]
    if not any(outside):
        return values
    bad |= np.array(outside)
    return [fill if o else v for v, o in zip(values, outside, strict=True)]


def _field(objs: list[Any], index: dict[str, int], name: str) -> list[Any]:
    """One field of every Struct, by JSON name (None where the schema has none)."""
    i = index.get(name)
    if i is None:
        return [None] * len(objs)
    return list(map(attrgetter(f"f{i}"), objs))


def _strings(values: list[Any]) -> pa.Array:
    return pa.array(values, pa.string())


def _join(*parts: Any) -> pa.Array:
    return pc.binary_join_element_wise(*parts, "")


def _lpad_int(arr: pa.Array, width: int) -> pa.Array:
    return pc.utf8_lpad(arr.cast(pa.string()), width, "0")


class Image:
    """The row images of some rows (after, or before), converted column by
    column: per column its canonical texts, where it is present (not
    ``UNSET``) and which rows the fast path refuses (``bad``)."""

    def __init__(self, plan: Plan, rows: list[Any], after: bool) -> None:
        m = len(rows)
        self.bad = np.zeros(m, dtype=bool)
        self.present = np.ones((len(plan.names), m), dtype=bool)
        self.values: list[pa.Array] = []
        for j, kind in enumerate(plan.kinds):
            vals = list(map(attrgetter(f"f{j}"), rows))
            if msgspec.UNSET in vals:
                absent = np.fromiter((v is msgspec.UNSET for v in vals), dtype=bool, count=m)
                self.present[j] = ~absent
                vals = [None if v is msgspec.UNSET else v for v in vals]
            texts, bad = _CONVERT[kind](vals, plan.specs[j])
            if bad is not None:
                self.bad |= bad
            if after and not plan.nullable[j] and None in vals:
                self.bad |= np.fromiter((v is None for v in vals), dtype=bool, count=m) & self.present[j]
            self.values.append(texts)

    def maps(self, rows: int, at: np.ndarray, names: pa.Array) -> pa.Array:
        """A map per row (``rows`` of them): image ``i`` at row ``at[i]``,
        empty maps elsewhere."""
        k, m = self.present.shape
        counts = np.zeros(rows, dtype=np.int64)
        counts[at] = self.present.sum(axis=0)
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        order = np.arange(k * m, dtype=np.int64).reshape(k, m).T.ravel()  # row-major over the column-major concat
        keep = self.present.T.ravel()
        picks = pa.array(order[keep])
        values = pa.concat_arrays(self.values).take(picks) if k else pa.array([], pa.string())
        keys = names.take(pa.array(np.tile(np.arange(k, dtype=np.int64), m)[keep]))
        return pa.MapArray.from_arrays(pa.array(offsets), keys, values)

    def column(self, j: int) -> tuple[pa.Array, np.ndarray]:
        return self.values[j], self.present[j]


def _conv_string(vals: list[Any], spec: Any) -> tuple[pa.Array, np.ndarray | None]:
    bad = None
    if PLACEHOLDER in vals:
        bad = np.fromiter((v == PLACEHOLDER for v in vals), dtype=bool, count=len(vals))
    return _strings(vals), bad


def _conv_int(vals: list[Any], spec: Any) -> tuple[pa.Array, np.ndarray | None]:
    return pa.array(vals, pa.int64()).cast(pa.string()), None


def _conv_bool(vals: list[Any], spec: Any) -> tuple[pa.Array, np.ndarray | None]:
    return pa.array(vals, pa.bool_()).cast(pa.string()), None


def _unscaled(v: str | None) -> int | None:
    """The unscaled integer of a base64 decimal, or -1 << 200 when the fast
    path refuses it (placeholder, not strict base64, no bytes)."""
    if v is None:
        return None
    if v == PLACEHOLDER_B64:
        return _REFUSED
    try:
        data = a2b_base64(v, strict_mode=True)
    except (binascii.Error, ValueError):
        return _REFUSED
    return int.from_bytes(data, "big", signed=True) if data else _REFUSED


_REFUSED = -(1 << 200)


def _conv_decimal(vals: list[Any], spec: Any) -> tuple[pa.Array, np.ndarray | None]:
    """Base64 two's complement to plain decimal text, as ``_scaled_text``:
    the bytes in Python, the text in Arrow (int64 values), else in Python."""
    unscaled = list(map(_unscaled, vals))
    limit = 10**spec.precision
    bad = np.fromiter((u is not None and not -limit < u < limit for u in unscaled), dtype=bool, count=len(unscaled))
    if bad.any():
        unscaled = [0 if b else u for u, b in zip(unscaled, bad, strict=True)]
    scale = spec.scale
    if spec.precision > 18:
        return _strings([None if u is None else _scaled_text(u, scale) for u in unscaled]), bad
    arr = pa.array(unscaled, pa.int64())
    digits = pc.abs(arr).cast(pa.string())
    if scale:
        padded = pc.utf8_lpad(digits, scale + 1, "0")
        digits = pc.binary_join_element_wise(pc.utf8_slice_codeunits(padded, 0, -scale), pc.utf8_slice_codeunits(padded, -scale), ".")
    text = pc.if_else(pc.less(arr, 0), _join("-", digits), digits)
    return text, bad


_MIN_US, _MAX_US = TIMESTAMP_MICROS  # datetime's 0001-01-01 .. 9999-12-31


def _conv_timestamp(vals: list[Any], spec: Any) -> tuple[pa.Array, np.ndarray | None]:
    """Epoch numbers (ms or µs) to 'YYYY-MM-DD HH:MM:SS.ffffff' in Arrow;
    beyond Python's datetime range the exact decoder decides."""
    arr = pa.array(vals, pa.int64())
    per_us = 1_000_000 // spec.units  # 1 or 1000
    bad = pc.or_(pc.less(arr, _MIN_US // per_us), pc.greater(arr, _MAX_US // per_us)).fill_null(False).to_numpy(zero_copy_only=False)
    if bad.any():
        arr = pc.if_else(pa.array(bad), 0, arr)
    if per_us != 1:
        arr = pc.multiply(arr, per_us)
    return arr.cast(pa.timestamp("us")).cast(pa.string()), bad


_ZONED = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z$"


def _conv_zoned(vals: list[Any], spec: Any) -> tuple[pa.Array, np.ndarray | None]:
    """Debezium's UTC form ('T', 'Z', up to 6 fraction digits) parsed and
    printed by Arrow; a batch with an invalid date is done value by value by
    the exact decoder's converter."""
    arr = _strings(vals)
    bad = pc.invert(pc.match_substring_regex(arr, _ZONED)).fill_null(False).to_numpy(zero_copy_only=False)
    good = pc.if_else(pa.array(bad), "1970-01-01T00:00:00Z", arr) if bad.any() else arr
    try:
        return good.cast(pa.timestamp("us", "UTC")).cast(pa.timestamp("us")).cast(pa.string()), bad
    except pa.ArrowInvalid:
        conv = fast_converter(spec)
        out = [None if v is None else conv(v) for v in vals]
        bad = bad | np.fromiter((o is SLOW for o in out), dtype=bool, count=len(out))
        return _strings([None if o is SLOW else o for o in out]), bad


_CONVERT = {
    "string": _conv_string,
    "int": _conv_int,
    "bool": _conv_bool,
    "decimal": _conv_decimal,
    "timestamp": _conv_timestamp,
    "zoned": _conv_zoned,
}


def _sequence(seqs: list[Any], lsn: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(last committed LSN, refused) from ``source.sequence``: the usual
    '["<digits>","<digits>"]' in Arrow, anything else by ``parse_sequence``;
    a current LSN other than ``source.lsn`` is refused (the exact decoder
    notes it)."""
    arr = _strings(seqs)
    parts = pc.extract_regex(arr, r'^\["(?P<a>[0-9]{1,19})","(?P<b>[0-9]{1,19})"\]$')
    last = pc.struct_field(parts, "a").cast(pa.uint64())  # (the child alone keeps "" where the struct is null)
    current = pc.struct_field(parts, "b").cast(pa.uint64())
    bad = pc.not_equal(current, lsn.cast(pa.uint64())).fill_null(False).to_numpy(zero_copy_only=False)
    odd = pc.and_(arr.is_valid(), parts.is_null()).to_numpy(zero_copy_only=False)
    if odd.any():
        last_list = last.to_pylist()
        for i in np.flatnonzero(odd):
            try:
                seq = parse_sequence(seqs[i])
            except DecodeError:
                bad[i] = True
                continue
            if seq is None:  # pragma: no cover - odd rows hold text
                continue
            if seq[1] is not None and seq[1] != lsn[i].as_py():
                bad[i] = True
            # carried as uint64: a larger one (20 digits reach 10^20) is the exact decoder's
            last_list[i] = seq[0] if seq[0] is not None and seq[0] < 1 << 64 else 0
            bad[i] |= seq[0] is not None and seq[0] >= 1 << 64
        last = pa.array(last_list, pa.uint64())
    return last.fill_null(0), bad


class Slow(Exception):
    """This line is the exact decoder's."""


def _out_rows(fast: FastPostgres, pend: Pending) -> tuple[dict[str, pa.Array] | None, list[int]]:
    """The outcome columns of a plan's pending lines, and the lines the
    checks refuse (for the exact decoder).  Long because it is
    ``DebeziumDecoder.decode_message`` for the one shape taken here, every
    step over the whole batch, in the same order."""
    plan, ps = pend.plan, pend.payloads
    n = len(ps)
    if not n:
        return None, []
    env = plan.envelope
    ops = _field(ps, env, "op")
    srcs = _field(ps, env, "source")
    bad = np.fromiter((o not in FAST_OPS or s is None for o, s in zip(ops, srcs, strict=True)), dtype=bool, count=n)
    if bad.any():  # Structs a later step cannot read: refused, and left out from here on
        keep = np.flatnonzero(~bad)
        rows, refused = _out_rows(fast, _subset(pend, keep))
        return rows, [int(i) for i in np.flatnonzero(bad)] + [int(keep[i]) for i in refused]
    s = plan.source
    connectors = _field(srcs, s, "connector")
    if not set(connectors) <= {"postgresql", None}:
        bad |= np.fromiter((c not in ("postgresql", None) for c in connectors), dtype=bool, count=n)
    dbs, schemas, tables = _field(srcs, s, "db"), _field(srcs, s, "schema"), _field(srcs, s, "table")
    keys_of: dict[tuple, list[str] | None] = {}
    for name in set(zip(dbs, schemas, tables, strict=True)):
        try:
            keys_of[name] = fast.names_ok(name)
        except (Slow, DecodeError):
            keys_of[name] = None
            bad |= np.fromiter((t == name for t in zip(dbs, schemas, tables, strict=True)), dtype=bool, count=n)
    lsns = _field(srcs, s, "lsn")
    if None in lsns:
        bad |= np.fromiter((v is None for v in lsns), dtype=bool, count=n)
        lsns = [0 if v is None else v for v in lsns]
    if min(lsns) < 0 or max(lsns) >= 1 << 64:
        bad |= np.fromiter((not 0 <= v < 1 << 64 for v in lsns), dtype=bool, count=n)
        lsns = [v if 0 <= v < 1 << 64 else 0 for v in lsns]
    lsn = pa.array(lsns, pa.uint64())
    last, seq_bad = _sequence(_field(srcs, s, "sequence"), lsn)
    bad |= seq_bad
    snaps = _field(srcs, s, "snapshot")
    phase = {v: ("0" if str(v).lower() in SNAPSHOT_PHASES else "1") for v in set(snaps)}
    position = pc.binary_join_element_wise(_lpad_int(lsn, 20), _strings([phase[v] for v in snaps]), _lpad_int(last, 20), "|")

    afters, befores = _field(ps, env, "after"), _field(ps, env, "before")
    is_delete = np.fromiter((o == "d" for o in ops), dtype=bool, count=n)
    has_after = np.fromiter((a is not None for a in afters), dtype=bool, count=n)
    has_before = np.fromiter((b is not None for b in befores), dtype=bool, count=n)
    bad |= (is_delete & (has_after | ~has_before)) | (~is_delete & ~has_after)
    after_at = np.flatnonzero(has_after & ~is_delete)
    before_at = np.flatnonzero(has_before)
    after_img = Image(plan, [afters[i] for i in after_at], True)
    before_img = Image(plan, [befores[i] for i in before_at], False)
    bad[after_at] |= after_img.bad
    bad[before_at] |= before_img.bad

    # key columns: configured per table; each must have a value in the image
    key_cols = [keys_of.get(t) or [] for t in zip(dbs, schemas, tables, strict=True)]
    image_of = np.full(n, -1, dtype=np.int64)  # row -> its image's index, in after_img (c/u/r) or before_img (d)
    image_of[after_at] = np.arange(len(after_at))
    image_of[before_at[is_delete[before_at]]] = np.flatnonzero(is_delete[before_at])
    for col in {c for cols in key_cols for c in cols}:
        j = plan.names.index(col) if col in plan.names else -1
        needs = np.fromiter((col in cols for cols in key_cols), dtype=bool, count=n)
        if j < 0:
            bad |= needs
            continue
        for img, side in ((after_img, ~is_delete), (before_img, is_delete)):
            vals, present = img.column(j)
            has = present & vals.is_valid().to_numpy(zero_copy_only=False) if len(vals) else present
            at = np.flatnonzero(needs & side & (image_of >= 0))
            bad[at] |= ~has[image_of[at]]

    txs = _field(srcs, s, "txId")
    txs = _exact_outside(txs, INT_RANGES["bigint"], bad, fill=0)  # beyond int64 (Arrow's)
    tx_text = pa.array(txs, pa.int64()).cast(pa.string())
    change_id = pc.binary_join_element_wise(lsn.cast(pa.string()), tx_text.fill_null(""), "|")
    if "r" in ops:
        change_id = _snapshot_ids(change_id, ops, key_cols, plan, after_img, image_of)
    transactions = _field(ps, env, "transaction")
    id_at, order_at = plan.tx_fields.get("id"), plan.tx_fields.get("total_order")
    tx_ids = [None if t is None or id_at is None else getattr(t, f"f{id_at}") for t in transactions]
    if None in txs:
        tx_text = pc.coalesce(tx_text, _strings([None if t is None else str(t) for t in tx_ids]))
    # the transaction and the event's place in it, both or neither (debezium_common.transaction_of)
    tx_orders = [None if t is None or order_at is None else getattr(t, f"f{order_at}") for t in transactions]
    tx_group = [None if i is None or o is None else pg_transaction_group(str(i)) for i, o in zip(tx_ids, tx_orders, strict=True)]
    tx_order = [None if g is None else o for g, o in zip(tx_group, tx_orders, strict=True)]
    tx_order = _exact_outside(tx_order, TRANSACTION_COUNTS, bad)  # model.transaction_count
    ts_ns, ts_us, ts_ms = (_field(srcs, s, f) for f in ("ts_ns", "ts_us", "ts_ms"))
    commit = [
        ns // 1000 if ns is not None else us if us is not None else ms * 1000 if ms is not None else None
        for ns, us, ms in zip(ts_ns, ts_us, ts_ms, strict=True)
    ]
    commit = _exact_outside(commit, TIMESTAMP_MICROS, bad)  # model.commit_micros

    names = pa.array(plan.names, pa.string())
    before_map = before_img.maps(n, before_at, names)
    before_map = pa.MapArray.from_arrays(before_map.offsets, before_map.keys, before_map.items, mask=pa.array(~has_before))
    columns: list[Any] = [None] * n
    seen: set = set()
    for i, t in enumerate(zip(dbs, schemas, tables, strict=True)):
        if t not in seen:
            seen.add(t)
            columns[i] = plan.column_tuples
    rows = {
        "status": pa.array(["event"] * n, pa.string()),
        "file": _strings([w[0] for w in pend.where]),
        "line": pa.array([w[1] for w in pend.where], pa.int64()),
        "database": _strings(dbs),
        "schema_name": _strings(schemas),
        "table_name": _strings(tables),
        "op": _strings(ops),
        "key_columns": pa.array(key_cols, pa.list_(pa.string())),
        "after": after_img.maps(n, after_at, names),
        "before": before_map,
        "columns": pa.array(columns, pa.list_(_COLUMN)),
        "position": position,
        "tx_id": tx_text,
        "commit_ts": pa.array(commit, pa.int64()).cast(pa.timestamp("us", tz="UTC")),  # pa.array(..., timestamp) imports pandas
        "change_id": change_id,
        "tx_group": _strings(tx_group),
        "tx_order": pa.array(tx_order, pa.int64()),
    }
    refused = [int(i) for i in np.flatnonzero(bad)]
    if refused:
        mask = pa.array(~bad)
        rows = {k: v.filter(mask) for k, v in rows.items()}
        first = set()  # a table's columns again on its first kept row
        cols = rows["columns"].to_pylist()
        for i, t in enumerate(zip(*(rows[c].to_pylist() for c in ("database", "schema_name", "table_name")), strict=True)):
            cols[i] = None if t in first else plan.column_tuples
            first.add(t)
        rows["columns"] = pa.array(cols, pa.list_(_COLUMN))
    return (rows if len(rows["status"]) else None), refused


def _snapshot_ids(change_id: pa.Array, ops: list[str], key_cols: list[list[str]], plan: Plan, img: Image, image_of: np.ndarray) -> pa.Array:
    """A snapshot read's change id adds its key (``snapshot_change_id``)."""
    ids = change_id.to_pylist()
    for i, op in enumerate(ops):
        if op != "r" or image_of[i] < 0:
            continue
        key: dict[str, Any] = {}
        for col in key_cols[i]:
            key[col] = None
            if col in plan.names:
                vals, present = img.column(plan.names.index(col))
                if present[image_of[i]]:
                    key[col] = vals[int(image_of[i])].as_py()
        ids[i] = f"{ids[i]}|snapshot|{json_text(key)}"
    return _strings(ids)


def _subset(pend: Pending, keep: np.ndarray) -> Pending:
    out = Pending(pend.plan)
    out.payloads = [pend.payloads[i] for i in keep]
    out.where = [pend.where[i] for i in keep]
    return out


class FastPostgres:
    """The fast path of one decode task: its known schema prefixes and
    plans, the lines parsed and not yet built, the batches built, and the
    exact decoder's outcomes for the other lines."""

    def __init__(self, decoder: DebeziumPostgresDecoder) -> None:
        self.decoder = decoder
        self.plans: dict[bytes, Plan | None] = {}  # schema bytes -> plan (None: unusable)
        self.last: tuple[bytes, Plan, str] | None = None  # (b'{"schema":S,"payload":', plan, as text) last used
        self.tables: dict[tuple, list[str] | None] = {}  # checked (db, schema, table) -> configured key
        self.pending: dict[int, Pending] = {}  # id(plan) -> its lines parsed so far
        self.parsed = 0
        self.built: list[dict[str, pa.Array]] = []
        self.slow: list[Outcome] = []

    def line(self, file: str, number: int, buf: bytes | str, start: int, end: int) -> None:
        """Take the line ``buf[start:end]`` (without its newline)."""
        plan, cut = self._plan_of(buf, start, end)
        if plan is not None and buf[end - 1] in (125, "}"):  # '}'
            try:
                payload = plan.payload.decode(memoryview(buf)[cut : end - 1] if isinstance(buf, bytes) else buf[cut : end - 1])
            except (msgspec.DecodeError, UnicodeDecodeError, ValueError):
                payload = None
            if payload is not None:
                pend = self.pending.get(id(plan))
                if pend is None:
                    pend = self.pending[id(plan)] = Pending(plan)
                pend.payloads.append(payload)
                pend.where.append((file, number, buf, start, end))
                self.parsed += 1
                return
        self._exact(file, number, buf, start, end)

    def _plan_of(self, buf: Any, start: int, end: int) -> tuple[Plan | None, int]:
        """(plan, where the payload starts) of a line whose schema text is
        known; ``buf`` is bytes (a read buffer) or str (a gzip file's line)."""
        last = self.last
        if last is not None:
            prefix = last[0] if isinstance(buf, bytes) else last[2]
            if buf.startswith(prefix, start, end):
                return last[1], start + len(prefix)
        head = HEAD if isinstance(buf, bytes) else HEAD.decode()
        key = PAYLOAD_KEY if isinstance(buf, bytes) else PAYLOAD_KEY.decode()
        if not buf.startswith(head, start, end):
            return None, 0
        cut = buf.find(key, start + len(head), end)
        if cut < 0:
            return None, 0
        text = buf[start + len(head) : cut]
        schema_bytes = text.encode() if isinstance(text, str) else bytes(text)
        plan = self.plans.get(schema_bytes)
        if plan is None:
            return None, 0
        whole = HEAD + schema_bytes + PAYLOAD_KEY
        self.last = (whole, plan, whole.decode())
        return plan, cut + len(key)

    def _exact(self, file: str, number: int, buf: bytes | str, start: int, end: int) -> None:
        """The exact decoder's outcome for the line; a schema text met for
        the first time is learnt (its plan made) from it."""
        if isinstance(buf, str):
            item: Any = RawMessage(file, number, buf[start:end])
        else:
            item = line_message(file, number, buf[start:end])
        if item is None:
            return
        if not isinstance(item, RawMessage):
            line, raw, reason = item
            self.slow.append(Quarantined(reason=reason, raw=raw, file=file, line=line))
            return
        self.slow.extend(self.decoder.decode(item))
        self._learn(item.text)

    def _learn(self, text: str) -> None:
        head, key = HEAD.decode(), PAYLOAD_KEY.decode()
        if not text.startswith(head) or len(self.plans) >= 256:
            return
        cut = text.find(key, len(head))
        schema_bytes = text[len(head) : cut].encode()
        if cut < 0 or schema_bytes in self.plans:
            return
        self.plans[schema_bytes] = None
        try:
            schema = orjson.loads(schema_bytes)
            whole = orjson.loads(text)
        except orjson.JSONDecodeError:
            return
        if type(schema) is not dict or has_float(schema) or type(whole) is not dict or whole.get("schema") != schema:
            return  # the first ',"payload":' is inside S, or S is not exact with orjson
        try:
            self.plans[schema_bytes] = make_plan(schema)
        except (Unusable, DecodeError):
            pass

    def names_ok(self, table: tuple) -> list[str] | None:
        """The configured key of a (db, schema, table) whose names pass
        ``check_identifier`` (else ``DecodeError`` / ``Slow``)."""
        if table not in self.tables:
            db, schema, name = table
            if name is None:
                raise Slow
            check_identifier(name, "table")
            if schema is not None:
                check_identifier(schema, "schema")
            if db is not None:
                check_identifier(db, "database")
            self.tables[table] = self.decoder.ctx.configured_key(db, schema, name)
        return self.tables[table]

    def build(self) -> None:
        """Build the pending lines' columns; refused lines go the exact way."""
        pending, self.pending, self.parsed = self.pending, {}, 0
        for pend in pending.values():
            rows, refused = _out_rows(self, pend)
            if rows is not None:
                self.built.append(rows)
            for i in refused:
                self._exact(*pend.where[i])

    def take(self) -> Iterator[dict[str, pa.Array] | list[Outcome]]:
        built, self.built = self.built, []
        yield from built
        slow, self.slow = self.slow, []
        if slow:
            yield slow


def spans(path: str, source: Source, piece: Piece | None) -> Iterator[tuple[Any, ...]]:
    """``(buffer, line number, start, end)`` of every line of a file (or
    piece): for a plain file the read buffer itself (a chunk and the end of
    the line before it), no object per line; a gzip file's lines come from
    ``iter_lines`` (as text), its damage as a one-line quarantine."""
    open_stream = source if callable(source) else None
    if open_stream is None or _is_gzip(open_stream):
        for item in iter_lines(path, source, piece=piece):
            if isinstance(item, RawMessage):
                yield item.text, item.line, 0, len(item.text)
            else:
                yield item  # (line, raw, reason): damage
        return
    number = piece.first_line - 1 if piece is not None else 0
    left = piece.end - piece.start if piece is not None else -1
    carry = b""
    with open_stream() as stream:
        if piece is not None:
            stream.seek(piece.start)
        while left:
            chunk = stream.read(CHUNK_BYTES if left < 0 else min(CHUNK_BYTES, left))
            if not chunk:
                break
            left = left - len(chunk) if left > 0 else left
            buf = carry + chunk if carry else chunk
            last = buf.rfind(b"\n")
            if last < 0:
                carry = buf
                continue
            pos = 0
            while pos <= last:
                nl = buf.index(b"\n", pos)
                number += 1
                yield buf, number, pos, nl
                pos = nl + 1
            carry = buf[last + 1 :]
    if carry:
        yield carry, number + 1, 0, len(carry)


def _is_gzip(open_stream: Callable[[], Any]) -> bool:
    with open_stream() as stream:
        return stream.read(2) == GZIP_MAGIC


def decode_files(decoder: Decoder, files: Iterable[tuple[str, Source, Piece | None]]) -> Iterator[dict[str, pa.Array] | list[Outcome]]:
    """Decode files (or pieces) into batches: column arrays of fast lines
    and lists of the exact decoder's outcomes for the rest."""
    assert isinstance(decoder, DebeziumPostgresDecoder)
    fast = FastPostgres(decoder)
    for path, source, piece in files:
        for item in spans(path, source, piece):
            if len(item) == 3:
                line, raw, reason = item
                fast.slow.append(Quarantined(reason=reason, raw=raw, file=path, line=line))
            else:
                buf, number, start, end = item
                fast.line(path, number, buf, start, end)
            if fast.parsed >= BATCH_ROWS or len(fast.slow) >= BATCH_ROWS:
                fast.build()
                yield from fast.take()
    fast.build()
    yield from fast.take()


def supports(decoder: Decoder) -> bool:
    """The fast path is for the PostgreSQL decoder itself (not a subclass),
    unless the context asks for the exact path (``options["decode"] ==
    "exact"``: the benchmark's decode figure times both on the same files)."""
    return type(decoder) is DebeziumPostgresDecoder and decoder.ctx.options.get("decode") != "exact"
