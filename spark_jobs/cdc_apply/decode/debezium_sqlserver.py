"""Debezium SQL Server connector messages -> canonical change events.

Position layout (fixed width, 56 characters)::

    <commit_lsn>|<change_lsn>|<event_serial_no>
    0000002a:00000358:0003|0000002a:00000358:0002|0000000002

Each LSN is SQL Server's ``VLF:block:slot`` as 8:8:4 hex digits, validated
and lower-cased (Debezium writes lowercase, SQL Server's own tools uppercase;
one case makes string order == numeric order).  Snapshot events have a null
``change_lsn`` (-> ``00000000:00000000:0000``) and their ``commit_lsn`` is the
database's max LSN at snapshot start, so they sort before every streamed
change committed after it.  ``event_serial_no`` (JSON int or digit string;
null -> 0) separates events sharing both LSNs — an update is serial 2, a
primary-key update is a delete (1) then a create (2) — and is zero-padded to
10 digits.  This is the order Debezium itself streams in (commit LSN, change
LSN) plus the serial it uses to resume.

``change_id`` is ``commit_lsn|change_lsn`` (the two halves of a primary-key
update share it); a snapshot read adds its key (``|snapshot|{key}``).

``tx_id`` is ``payload.transaction.id`` when transaction metadata is enabled,
else the commit LSN of a streamed change (every change of a SQL Server
transaction shares it); snapshot rows (null ``change_lsn``) get none, since
their shared commit LSN is a snapshot marker, not a transaction.

Non-row messages: schema-change topic messages -> ``Skipped('schema-change')``,
transaction BEGIN/END -> ``Skipped('transaction-marker')``, Kafka tombstones
-> ``Skipped('kafka-tombstone')``, heartbeats -> ``Skipped('heartbeat')``.  The
connector emits no truncate or logical-message ops; any op other than c/u/d/r
is quarantined.
"""

from __future__ import annotations

import re
from typing import Any

from cdc_apply.decode.debezium_common import (
    DebeziumDecoder,
    as_int,
    snapshot_change_id,
    sniff_connector,
)
from cdc_apply.model import DecodeError, Format, pad_decimal

_LSN = re.compile(r"^[0-9A-Fa-f]{8}:[0-9A-Fa-f]{8}:[0-9A-Fa-f]{4}$")
ZERO_LSN = "00000000:00000000:0000"


def normalise_lsn(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _LSN.match(value):
        raise DecodeError(f"{what} {value!r} is not an LSN of the form vvvvvvvv:bbbbbbbb:ssss")
    return value.lower()


def sqlserver_position(source: dict[str, Any]) -> str:
    if source.get("commit_lsn") is None:
        raise DecodeError("source.commit_lsn is missing")
    commit = normalise_lsn(source["commit_lsn"], "source.commit_lsn")
    change = source.get("change_lsn")
    change = ZERO_LSN if change is None else normalise_lsn(change, "source.change_lsn")
    serial_raw = source.get("event_serial_no")
    serial = 0 if serial_raw is None else as_int(serial_raw, "source.event_serial_no")
    return f"{commit}|{change}|{pad_decimal(serial, 10)}"


class DebeziumSqlServerDecoder(DebeziumDecoder):
    format = Format.DEBEZIUM_SQLSERVER
    connector = "sqlserver"

    @classmethod
    def sniff(cls, text: str) -> bool:
        return sniff_connector(text, "sqlserver") or "io.debezium.connector.sqlserver" in text

    def position(self, source: dict[str, Any], payload: dict[str, Any], notes: list[str]) -> str:
        return sqlserver_position(source)

    def change_id(self, source: dict[str, Any], op: str, key: dict[str, str | None]) -> str | None:
        """``commit_lsn|change_lsn``: both halves of a primary-key update (serial
        1 and 2) share them, every other row change has its own change LSN."""
        commit = normalise_lsn(source["commit_lsn"], "source.commit_lsn")
        if source.get("change_lsn") is None:
            return snapshot_change_id(commit, key)
        return f"{commit}|{normalise_lsn(source['change_lsn'], 'source.change_lsn')}"

    def tx_id(self, source: dict[str, Any], payload: dict[str, Any]) -> str | None:
        tx = super().tx_id(source, payload)
        if tx is not None:
            return tx
        if source.get("change_lsn") is None:
            return None
        return normalise_lsn(source["commit_lsn"], "source.commit_lsn")
