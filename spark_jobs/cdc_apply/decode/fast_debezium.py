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

from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable, Iterator

import msgspec
import orjson
import pyarrow as pa

from cdc_apply.archive.lines import CHUNK_BYTES, GZIP_MAGIC, Piece, Source, iter_lines, line_message
from cdc_apply.decode.base import Decoder, check_identifier, has_float
from cdc_apply.decode.debezium_common import SLOW, DebeziumDecoder, RowShape, json_text
from cdc_apply.decode.debezium_postgres import SNAPSHOT_PHASES, DebeziumPostgresDecoder, parse_sequence
from cdc_apply.model import INT_RANGES, DecodeError, Outcome, Quarantined, RawMessage

HEAD, PAYLOAD_KEY = b'{"schema":', b',"payload":'
FAST_OPS = frozenset({"c", "u", "d", "r"})  # 't' and 'm' are the exact decoder's
BATCH_ROWS = 10_000
_MAP = pa.map_(pa.string(), pa.string())
_COLUMN = pa.struct([("name", pa.string()), ("type", pa.string()), ("nullable", pa.bool_())])
_CONNECT_TYPES: dict[str, Any] = {"string": str, "bytes": str, "boolean": bool, "int8": int, "int16": int, "int32": int, "int64": int}


class Unusable(Exception):
    """A schema the fast path does not take (every line of it goes the exact way)."""


def _optional(t: Any) -> Any:
    return t | None | msgspec.UnsetType


def _struct_of(name: str, fields: list[tuple[str, Any]], *, forbid: bool = True) -> type:
    """A strict Struct of JSON field names (renamed from f0.., so any column
    name works); absent fields are ``UNSET``."""
    return msgspec.defstruct(
        name,
        [(f"f{i}", _optional(t), msgspec.UNSET) for i, (_, t) in enumerate(fields)],
        rename={f"f{i}": n for i, (n, _) in enumerate(fields)},
        forbid_unknown_fields=forbid,
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


def _value_type(spec: Any) -> Any:
    """The JSON type of a row column the fast path converts: what its
    ``fast_converter`` accepts (anything else is the exact decoder's)."""
    if spec.kind == "plain" and spec.spark_type == "string" and spec.literal == "string":
        return str
    if spec.kind == "plain" and spec.spark_type in INT_RANGES:
        lo, hi = INT_RANGES[spec.spark_type]
        return Annotated[int, msgspec.Meta(ge=lo, le=hi)]
    if spec.kind == "plain" and spec.spark_type == "boolean":
        return bool
    if spec.kind == "decimal" and spec.precision:
        return str
    if spec.kind == "timestamp" and spec.units in (1_000, 1_000_000):
        return int
    if spec.kind == "zoned":
        return str
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
    convert: tuple[Callable[[Any], Any], ...]
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
    row = _struct_of("Row", [(s.name, _value_type(s)) for s in specs])
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
        convert=tuple(shape.fast[s.name] for s in specs),
        nullable=tuple(s.nullable for s in specs),
        shape=shape,
        column_tuples=[(c.name, c.type, c.nullable) for c in shape.columns],
    )


def _get(obj: Any, index: dict[str, int], name: str) -> Any:
    """A Struct's field by JSON name; None when absent, null or not declared."""
    i = index.get(name)
    if i is None:
        return None
    v = getattr(obj, f"f{i}")
    return None if v is msgspec.UNSET else v


class Slow(Exception):
    """This line is the exact decoder's."""


class Columns:
    """Outcome rows of fast lines, gathered column by column (the outcome
    schema of ``decode.stage``), then built into Arrow arrays at once."""

    def __init__(self) -> None:
        self.rows = 0
        self.file: list[str] = []
        self.line: list[int] = []
        self.database: list[str | None] = []
        self.schema_name: list[str | None] = []
        self.table_name: list[str] = []
        self.op: list[str] = []
        self.key_columns: list[list[str]] = []
        self.after: tuple[list[int], list[str], list[str | None], list[bool]] = ([0], [], [], [])  # offsets, keys, values, null
        self.before: tuple[list[int], list[str], list[str | None], list[bool]] = ([0], [], [], [])
        self.columns: list[list[tuple[str, str, bool]] | None] = []
        self.position: list[str] = []
        self.tx_id: list[str | None] = []
        self.commit_ts: list[int | None] = []
        self.change_id: list[str] = []
        self._declared: set = set()

    def declare(self, table: tuple, plan: Plan) -> list[tuple[str, str, bool]] | None:
        """A table's columns on its first row in the batch (as ``outcome_row``)."""
        key = (*table, id(plan.shape))
        if key in self._declared:
            return None
        self._declared.add(key)
        return plan.column_tuples

    def arrays(self) -> dict[str, pa.Array]:
        n = self.rows

        def as_map(parts: tuple) -> pa.Array:
            offsets, keys, values, nulls = parts
            mask = pa.array(nulls, pa.bool_()) if any(nulls) else None
            return pa.MapArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(keys, pa.string()), pa.array(values, pa.string()), mask=mask)

        return {
            "status": pa.array(["event"] * n, pa.string()),
            "file": pa.array(self.file, pa.string()),
            "line": pa.array(self.line, pa.int64()),
            "database": pa.array(self.database, pa.string()),
            "schema_name": pa.array(self.schema_name, pa.string()),
            "table_name": pa.array(self.table_name, pa.string()),
            "op": pa.array(self.op, pa.string()),
            "key_columns": pa.array(self.key_columns, pa.list_(pa.string())),
            "after": as_map(self.after),
            "before": as_map(self.before),
            "columns": pa.array(self.columns, pa.list_(_COLUMN)),
            "position": pa.array(self.position, pa.string()),
            "tx_id": pa.array(self.tx_id, pa.string()),
            "commit_ts": pa.array(self.commit_ts, pa.timestamp("us", tz="UTC")),
            "change_id": pa.array(self.change_id, pa.string()),
        }


def _image(row: Any, plan: Plan, after: bool) -> tuple[list[str], list[str | None]]:
    """(present columns, canonical texts) of a row Struct, as ``convert_row``
    gives them, or ``Slow``."""
    keys: list[str] = []
    values: list[str | None] = []
    for i, (name, conv) in enumerate(zip(plan.names, plan.convert)):
        raw = getattr(row, f"f{i}")
        if raw is msgspec.UNSET:
            continue
        if raw is None:
            if after and not plan.nullable[i]:
                raise Slow
            value = None
        else:
            value = conv(raw)
            if value is SLOW:
                raise Slow
        keys.append(name)
        values.append(value)
    return keys, values


class FastPostgres:
    """The fast path of one decode task: its known schema prefixes, plans,
    the rows gathered so far and the lines left to the exact decoder."""

    def __init__(self, decoder: DebeziumPostgresDecoder) -> None:
        self.decoder = decoder
        self.plans: dict[bytes, Plan | None] = {}  # schema bytes -> plan (None: unusable)
        self.last: tuple[bytes, Plan, str] | None = None  # (b'{"schema":S,"payload":', plan, as text) last used
        self.names: dict[tuple, tuple] = {}  # checked (db, schema, table) -> configured key
        self.cols = Columns()
        self.slow: list[Outcome] = []

    # -- one line ---------------------------------------------------------------
    def line(self, file: str, number: int, buf: bytes | str, start: int, end: int) -> None:
        """Decode the line ``buf[start:end]`` (without its newline)."""
        plan, cut = self._plan_of(buf, start, end)
        if plan is not None and buf[end - 1] in (125, "}"):  # '}'
            try:  # _fast appends the row only when every check passed
                self._fast(plan, file, number, memoryview(buf)[cut:end - 1] if isinstance(buf, bytes) else buf[cut:end - 1])
                return
            except (Slow, msgspec.DecodeError, DecodeError, UnicodeDecodeError, ValueError, OverflowError):
                pass
        self._exact(file, number, buf, start, end)

    def _plan_of(self, buf: bytes | str, start: int, end: int) -> tuple[Plan | None, int]:
        last = self.last
        if last is not None and buf.startswith(last[0] if isinstance(buf, bytes) else last[2], start, end):
            return last[1], start + len(last[0] if isinstance(buf, bytes) else last[2])
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
        prefix = HEAD + schema_bytes + PAYLOAD_KEY
        self.last = (prefix, plan, prefix.decode())
        return plan, cut + len(key)

    def _exact(self, file: str, number: int, buf: bytes | str, start: int, end: int) -> None:
        """The exact decoder's outcome for the line; a schema text met for
        the first time is learnt (its plan made) when the line is a change
        of a usable schema."""
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
        outcomes = self.decoder.decode(item)
        self.slow.extend(outcomes)
        self._learn(item.text)

    def _learn(self, text: str) -> None:
        head, key = HEAD.decode(), PAYLOAD_KEY.decode()
        if not text.startswith(head) or len(self.plans) >= 256:
            return
        cut = text.find(key, len(head))
        schema_bytes = text[len(head):cut].encode()
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

    def _names(self, src: Any, plan: Plan) -> tuple:
        """((db, schema, table), configured key) of a source, names checked."""
        table = (_get(src, plan.source, "db"), _get(src, plan.source, "schema"), _get(src, plan.source, "table"))
        known = self.names.get(table)
        if known is None:
            db, schema, name = table
            if name is None:
                raise Slow
            check_identifier(name, "table")
            if schema is not None:
                check_identifier(schema, "schema")
            if db is not None:
                check_identifier(db, "database")
            known = self.names[table] = (table, self.decoder.ctx.configured_key(db, schema, name))
        return known

    def _fast(self, plan: Plan, file: str, number: int, payload_text: Any) -> None:
        """Append one line's outcome row, or raise (nothing appended that
        ``_truncate`` cannot take back).  Long because it is
        ``DebeziumDecoder.decode_message`` for the one shape taken here,
        step by step in the same order."""
        p = plan.payload.decode(payload_text)
        env = plan.envelope
        op = _get(p, env, "op")
        if op not in FAST_OPS:
            raise Slow
        src = _get(p, env, "source")
        if src is None:
            raise Slow
        s = plan.source
        connector = _get(src, s, "connector")
        if connector is not None and connector != "postgresql":
            raise Slow
        table, configured = self._names(src, plan)
        lsn = _get(src, s, "lsn")
        if lsn is None or not 0 <= lsn < 1 << 64:
            raise Slow
        seq = parse_sequence(_get(src, s, "sequence"))
        if seq is not None and seq[1] is not None and seq[1] != lsn:
            raise Slow  # the exact decoder notes it
        last_commit = seq[0] if seq is not None and seq[0] is not None else 0
        if last_commit >= 10**20:
            raise Slow
        snapshot = str(_get(src, s, "snapshot")).lower() in SNAPSHOT_PHASES
        after_row, before_row = _get(p, env, "after"), _get(p, env, "before")
        after = _image(after_row, plan, True) if after_row is not None else None
        before = _image(before_row, plan, False) if before_row is not None else None
        if op == "d":
            if before is None:
                raise Slow
            image, after, before = before, ([], []), before
        else:
            if after is None:
                raise Slow
            image = after
        if configured:
            present = dict(zip(*image))
            if any(present.get(c) is None for c in configured):
                raise Slow
        tx = _get(src, s, "txId")
        change_id = f"{lsn}|{tx if tx is not None else ''}"
        if op == "r":
            present = dict(zip(*image))
            change_id = f"{change_id}|snapshot|{json_text({k: present.get(k) for k in configured or []})}"
        if tx is not None:
            tx_id: str | None = str(tx)
        else:
            t = _get(p, env, "transaction")
            tid = _get(t, plan.tx_fields, "id") if t is not None else None
            tx_id = str(tid) if tid is not None else None
        ts_ns, ts_us, ts_ms = _get(src, s, "ts_ns"), _get(src, s, "ts_us"), _get(src, s, "ts_ms")
        commit = ts_ns // 1000 if ts_ns is not None else ts_us if ts_us is not None else ts_ms * 1000 if ts_ms is not None else None
        c = self.cols
        c.rows += 1
        c.file.append(file)
        c.line.append(number)
        c.database.append(table[0])
        c.schema_name.append(table[1])
        c.table_name.append(table[2])
        c.op.append(op)
        c.key_columns.append(list(configured or []))
        for parts, img in ((c.after, after), (c.before, before)):
            parts[3].append(img is None)
            if img is not None:
                parts[1].extend(img[0])
                parts[2].extend(img[1])
            parts[0].append(len(parts[1]))
        c.columns.append(c.declare(table, plan))
        c.position.append(f"{lsn:020d}|{0 if snapshot else 1}|{last_commit:020d}")
        c.tx_id.append(tx_id)
        c.commit_ts.append(commit)
        c.change_id.append(change_id)

    # -- batches -----------------------------------------------------------------
    def take_rows(self) -> dict[str, pa.Array] | None:
        if not self.cols.rows:
            return None
        arrays = self.cols.arrays()
        self.cols = Columns()
        return arrays

    def take_slow(self) -> list[Outcome]:
        out, self.slow = self.slow, []
        return out

    def full(self) -> bool:
        return self.cols.rows >= BATCH_ROWS or len(self.slow) >= BATCH_ROWS


def spans(path: str, source: Source, piece: Piece | None) -> Iterator[tuple[bytes | str, int, int, int]]:
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
            carry = buf[last + 1:]
    if carry:
        yield carry, number + 1, 0, len(carry)


def _is_gzip(open_stream: Callable[[], Any]) -> bool:
    with open_stream() as stream:
        return stream.read(2) == GZIP_MAGIC


def decode_files(decoder: Decoder, files: Iterable[tuple[str, Source, Piece | None]]) -> Iterator[dict[str, pa.Array] | list[Outcome]]:
    """Decode files (or pieces) into batches: column arrays of fast lines
    and lists of the exact decoder's outcomes for the rest."""
    fast = FastPostgres(decoder)  # type: ignore[arg-type]
    for path, source, piece in files:
        for item in spans(path, source, piece):
            if len(item) == 3:
                line, raw, reason = item  # type: ignore[misc]
                fast.slow.append(Quarantined(reason=reason, raw=raw, file=path, line=line))
            else:
                buf, number, start, end = item  # type: ignore[misc]
                fast.line(path, number, buf, start, end)
            if fast.full():
                yield from _flush(fast)
    yield from _flush(fast)


def _flush(fast: FastPostgres) -> Iterator[dict[str, pa.Array] | list[Outcome]]:
    rows = fast.take_rows()
    if rows is not None:
        yield rows
    slow = fast.take_slow()
    if slow:
        yield slow


def supports(decoder: Decoder) -> bool:
    """The fast path is for the PostgreSQL decoder itself (not a subclass)."""
    return type(decoder) is DebeziumPostgresDecoder
