"""Debezium PostgreSQL connector messages -> canonical change events.

Position layout (43 characters)::

    <source.lsn, 20 digits>|<0 snapshot, 1 streamed>|<last committed LSN, 20 digits>
    00000000000024023128|1|00000000000024023119

The change's own WAL LSN decides (zero-padded: string order == numeric
order).  Events are emitted in commit order, so LSNs are not monotonic across
rows, but for one row the row lock makes change LSNs increase with commit
order — exactly the per-key order the apply needs.  A TRUNCATE holds an
ACCESS EXCLUSIVE lock, so every change to the table committed before it has a
lower LSN and every change after it a higher one.

Equal LSNs happen: a primary-key update (delete of the old key + create of the
new key: different keys), the rows of a snapshot (one LSN for the whole
snapshot), COPY / multi-row statements, and a streamed change at the very LSN
a snapshot was taken at.  For one key the tie-breakers are the format's own:
a snapshot event (``source.snapshot`` true/first/last/...) comes before a
streamed one at its LSN (the stream starts where the snapshot was taken), then
``source.sequence``'s first element, the LSN of the last transaction committed
before the event (``["<last committed LSN>", "<current LSN>"]``, unpadded
decimal strings or nulls, null/absent -> 0), which grows in the order the
connector emits.  A disagreement between the sequence's current LSN and
``source.lsn`` is noted on the event.  Positions written before this layout
(the 20-digit LSN alone) are prefixes of it, so they still compare right.

``change_id`` is ``<lsn>|<txId>``: the delete and create halves of a
primary-key update share both; a snapshot read adds its key (rows of one
snapshot share LSN and transaction).  Rows of one COPY may share it too, but
they are all inserts, never a delete + create pair.

Ops: c/u/d/r are row changes; ``t`` is a table truncate
(``ChangeEvent(op=TRUNCATE, key_columns=[], after={})``); ``m`` (logical
decoding message, ``pg_logical_emit_message``) is ``Skipped('logical-message')``.
Transaction ids come from ``source.txId``; commit time from
``source.ts_ns``/``ts_us``/``ts_ms``.
"""

from __future__ import annotations

from typing import Any

import orjson

from cdc_apply.decode.debezium_common import (
    DebeziumDecoder,
    Record,
    as_int,
    commit_ts_us,
    snapshot_change_id,
    sniff_connector,
)
from cdc_apply.model import (
    ChangeEvent,
    DecodeError,
    Format,
    Op,
    Outcome,
    RawMessage,
    Skipped,
    pad_decimal,
)

SNAPSHOT_PHASES = frozenset({"true", "first", "first_in_data_collection", "last_in_data_collection", "last"})
"""``source.snapshot`` values of a blocking (initial) snapshot; 'incremental'
reads are emitted from the stream, in its order."""


def parse_sequence(value: Any) -> tuple[int | None, int | None] | None:
    """``source.sequence``: a JSON *string* holding a 2-element array of
    unpadded decimal strings or nulls.  Compared as integers, never as text."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise DecodeError(f"source.sequence must be a JSON string, got {value!r}")
    try:
        items = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"source.sequence is not JSON: {value!r}") from exc
    if not isinstance(items, list) or len(items) != 2:
        raise DecodeError(f"source.sequence must be a 2-element array: {value!r}")
    out: list[int | None] = []
    for item in items:
        if item is None:
            out.append(None)
        elif isinstance(item, str) and item.isascii() and item.isdigit():
            out.append(int(item))
        elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out.append(item)
        else:
            raise DecodeError(f"source.sequence element {item!r} is not a decimal LSN")
    return out[0], out[1]


def lsn_position(source: dict[str, Any]) -> str:
    if source.get("lsn") is None:
        raise DecodeError("source.lsn is missing")
    lsn = as_int(source["lsn"], "source.lsn")
    if lsn < 0:
        raise DecodeError(f"source.lsn is negative: {lsn}")
    position = pad_decimal(lsn, 20)
    if lsn >= 1 << 64:  # a PostgreSQL LSN is an unsigned 64-bit WAL offset
        raise DecodeError(f"source.lsn {lsn} does not fit 64 bits: not a PostgreSQL LSN")
    return position


def pg_transaction_group(transaction_id: str) -> str:
    """The txId of a Debezium PostgreSQL ``transaction.id`` (``<txId>:<LSN>``)."""
    return transaction_id.split(":", 1)[0]


class DebeziumPostgresDecoder(DebeziumDecoder):
    format = Format.DEBEZIUM_POSTGRES
    connector = "postgresql"
    ops = frozenset({"c", "u", "d", "r", "t", "m"})

    @classmethod
    def sniff(cls, text: str) -> bool:
        return sniff_connector(text, "postgresql") or "io.debezium.connector.postgresql" in text

    def position(self, source: dict[str, Any], payload: dict[str, Any], notes: list[str]) -> str:
        lsn = lsn_position(source)
        seq = parse_sequence(source.get("sequence"))
        if seq is not None and seq[1] is not None and seq[1] != int(lsn):
            notes.append(f"source.sequence current LSN {seq[1]} differs from source.lsn {int(lsn)}")
        snapshot = str(source.get("snapshot")).lower() in SNAPSHOT_PHASES
        last_commit = seq[0] if seq is not None and seq[0] is not None else 0
        return f"{lsn}|{0 if snapshot else 1}|{pad_decimal(last_commit, 20)}"

    def change_id(self, source: dict[str, Any], op: str, key: dict[str, str | None]) -> str | None:
        lsn = int(lsn_position(source))
        tx = as_int(source["txId"], "source.txId") if source.get("txId") is not None else ""
        return snapshot_change_id(f"{lsn}|{tx}", key) if op == "r" else f"{lsn}|{tx}"

    def tx_id(self, source: dict[str, Any], payload: dict[str, Any]) -> str | None:
        if source.get("txId") is not None:
            return str(as_int(source["txId"], "source.txId"))
        return super().tx_id(source, payload)

    def transaction_group(self, transaction_id: str) -> str:
        """``<txId>:<LSN>``, whose LSN differs between a transaction's changes and
        its END marker (seen with Debezium 3 and pgoutput: changes
        ``757:26472928``, END ``757:26473112``): the txId alone is the group."""
        return pg_transaction_group(transaction_id)

    def special(self, op: str, rec: Record, source: dict[str, Any], msg: RawMessage) -> list[Outcome] | None:
        payload = rec.payload
        if op == "m":
            message = payload.get("message")
            prefix = message.get("prefix") if isinstance(message, dict) else None
            return [Skipped("logical-message", msg.file, msg.line, detail=f"prefix={prefix}")]
        if op == "t":
            notes: list[str] = []
            database, schema, table = self.table_name(source)
            position = self.position(source, payload, notes)
            return [
                ChangeEvent(
                    format=str(self.format),
                    database=database,
                    schema=schema,
                    table=table,
                    op=Op.TRUNCATE,
                    key_columns=[],
                    after={},
                    position=position,
                    tx_id=self.tx_id(source, payload),
                    commit_ts_us=commit_ts_us(source),
                    file=msg.file,
                    line=msg.line,
                    notes=notes,
                    change_id=self.change_id(source, op, {}),
                )
            ]
        return None
