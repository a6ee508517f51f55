"""The decoder contract every format implements.

Most messages decode on their own, in parallel on Spark executors
(``Decoder.decode``).  A few formats need to see some messages *before* the
rest: Qlik metadata messages define the columns of later data messages, and a
split SQL Server CES CloudEvent must be reassembled from all of its segments.
Those messages are flagged by ``needs_driver``; the job collects them (they are
few and small) and hands them to ``absorb`` on the driver, which updates the
decoder's state and returns their outcomes.  The updated state is then shipped
to the executors, which decode the remaining messages with ``decode``.

``decode_all`` runs exactly that sequence in plain Python; tests and the Spark
job therefore share one semantics.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from cdc_apply.model import INT_RANGES, DecodeError, Format, Outcome, Quarantined, RawMessage


def check_json_type(spark_type: str, value: Any, column: str) -> None:
    """For formats whose JSON carries numbers and booleans natively (Kafka
    Connect's JsonConverter under Debezium, CockroachDB's changefeed JSON):
    an integer column takes only a JSON integer, a boolean column only JSON
    true / false.  Text (``"42"``, ``"t"``) or a fraction (``5.0``) there is
    not what the source writes: refused, never coerced (apply-semantics §10).
    Formats that send every value as text (SQL Server CES, Qlik) do not
    call this."""
    if spark_type in INT_RANGES:
        if type(value) is not int:
            raise DecodeError(f"column {column}: {spark_type} must be a JSON integer, got {value!r:.80}")
    elif spark_type == "boolean" and type(value) is not bool:
        raise DecodeError(f"column {column}: boolean must be JSON true or false, got {value!r:.80}")


def json_int(value: Any, what: str) -> int:
    """A JSON integer (a Connect INT32 / INT64 value: days, micros, ...); text is refused."""
    if type(value) is not int:
        raise DecodeError(f"{what} must be a JSON integer, got {value!r:.80}")
    return value


@dataclass
class DecodeContext:
    """What a decoder may know besides the message itself."""

    source: str = "default"
    primary_keys: dict[str, list[str]] = field(default_factory=dict)
    """Configured primary keys by table name: 'table', 'schema.table' or
    'db.schema.table' (the most specific match wins). Used when the message
    itself does not say which columns form the key."""
    state: dict[str, Any] = field(default_factory=dict)
    """Decoder state carried across batches (JSON-serialisable), e.g. Qlik
    table metadata by table version."""
    options: dict[str, str] = field(default_factory=dict)
    """Per-source decoder options from the sources file (CockroachDB:
    ``ordering`` log|arrival, ``envelope`` row)."""
    declared_types: dict[str, dict[str, str]] = field(default_factory=dict)
    """Column types the source's configuration declares (``columns:`` next to
    ``primary_key``), by table name as ``primary_keys``: Spark type names or
    Debezium semantic type names.  Types messages without a schema."""
    stored_types: dict[str, dict[str, str]] = field(default_factory=dict)
    """Spark types of the tables already in the lake, by target table name
    (lower case), read once per batch on the driver.  Types messages without
    a schema."""

    def configured_key(self, database: str | None, schema: str | None, table: str) -> list[str] | None:
        for name in (f"{database}.{schema}.{table}", f"{schema}.{table}", table):
            if name in self.primary_keys:
                return list(self.primary_keys[name])
        return None

    def known_types(self, database: str | None, schema: str | None, table: str) -> dict[str, str] | None:
        """Column types for a message without a schema: the stored table's,
        overridden per column by the configured declaration; None if neither."""
        stored = self.stored_types.get(table.lower())
        declared = next(
            (self.declared_types[n] for n in (f"{database}.{schema}.{table}", f"{schema}.{table}", table) if n in self.declared_types), None
        )
        if stored is None and declared is None:
            return None
        return {**(stored or {}), **(declared or {})}


class Decoder:
    """Base class: subclasses set ``format`` and implement ``decode_message``."""

    format: ClassVar[Format]

    def __init__(self, ctx: DecodeContext | None = None) -> None:
        self.ctx = ctx or DecodeContext()

    @classmethod
    def sniff(cls, text: str) -> bool:
        """True when a raw message looks like this format (auto-detection only)."""
        return False

    # -- executor side -------------------------------------------------------
    def decode(self, msg: RawMessage) -> list[Outcome]:
        """Decode one message; any DecodeError / parse error becomes a quarantine."""
        try:
            return self.decode_message(msg)
        except (DecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            return [quarantine(msg, exc)]
        except RecursionError:  # a document nested deeper than a recursive step of a decoder can walk
            return [quarantine(msg, "DecodeError: the message is nested deeper than the decoder can read (depth limit exceeded)")]

    def decode_message(self, msg: RawMessage) -> list[Outcome]:
        raise NotImplementedError

    def decode_file(self, items: Iterable[RawMessage | Quarantined]) -> Iterator[Outcome]:
        """Decode one file's (or one piece of a file's) messages in line order;
        a line the reader could not read arrives already quarantined.  A
        decoder overrides it to judge a message by the rest of its file
        (CockroachDB: a message without the table or HLC its file's other
        messages carry is damaged, not a configuration mismatch)."""
        for item in items:
            if isinstance(item, Quarantined):
                yield item
            else:
                yield from self.decode(item)

    # -- driver side (optional) ----------------------------------------------
    def needs_driver(self, msg: RawMessage) -> bool:
        """True for messages that must be absorbed on the driver before the rest."""
        return False

    def absorb(self, messages: list[RawMessage]) -> list[Outcome]:
        """Consume the driver-side messages (in file, line order)."""
        return []

    def export_state(self) -> dict[str, Any]:
        """State to persist for the next batch (merged into ``ctx.state``)."""
        return dict(self.ctx.state)


_BAD_IDENT = re.compile(r"[\x00-\x1f\x7f\u2028\u2029`]")
_CHECKED_NAMES: set[str] = set()
MAX_IDENTIFIER = 128
"""Longest name accepted (SQL Server's limit; Iceberg columns are checked to it too)."""


def check_identifier(name: Any, what: str) -> str:
    """The one check of a name taken from a message, in every decoder, before
    it goes anywhere near SQL (where it is then quoted): refuse non-strings,
    empty names, control characters, backticks and names over 128 characters
    (a DecodeError: the message is quarantined, naming the field)."""
    if type(name) is str and name in _CHECKED_NAMES:
        return name
    if not isinstance(name, str):
        raise DecodeError(f"{what} name must be a string, got {name!r}")
    if not name.strip():
        raise DecodeError(f"{what} name is empty")
    if len(name) > MAX_IDENTIFIER:
        raise DecodeError(f"{what} name longer than {MAX_IDENTIFIER} characters: {name[:40]!r}...")
    if _BAD_IDENT.search(name):
        raise DecodeError(f"{what} name contains a control character or a backtick: {name!r}")
    if len(_CHECKED_NAMES) < 10_000:  # the same few names recur in every message
        _CHECKED_NAMES.add(name)
    return name


def quarantine(msg: RawMessage, exc: BaseException | str) -> Quarantined:
    reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return Quarantined(reason=reason, raw=msg.text, file=msg.file, line=msg.line)


def has_float(obj: Any) -> bool:
    """Whether orjson turned any number of a parsed document into a binary
    float, so the caller re-parses it exactly with ``Decimal``.  Iterative
    (the recursive walk it replaced cost more than orjson's parse), and one
    C-level pass over the value types of each object or array: a message's
    walk visits its few containers, not its every value."""
    stack = [obj]
    while stack:
        o = stack.pop()
        t = type(o)
        if t is dict:
            vals: Any = o.values()
        elif t is list:
            vals = o
        else:
            if t is float:
                return True
            continue
        kinds = set(map(type, vals))
        if float in kinds:
            return True
        if dict in kinds or list in kinds:
            stack.extend(v for v in vals if type(v) is dict or type(v) is list)
    return False


def parse_json(msg: RawMessage) -> Any:
    try:
        return orjson.loads(msg.text)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"malformed JSON: {exc}") from exc


def decode_all(decoder: Decoder, messages: Iterable[RawMessage]) -> Iterator[Outcome]:
    """Reference driver: absorb driver-side messages first, then decode the rest.

    Blank lines are not messages and yield nothing.
    """
    msgs = [m for m in messages if m.text.strip()]
    driver_side = [m for m in msgs if decoder.needs_driver(m)]
    yield from decoder.absorb(driver_side)
    flagged = {(m.file, m.line) for m in driver_side}
    rest = (m for m in msgs if (m.file, m.line) not in flagged)
    for _, one_file in itertools.groupby(rest, key=lambda m: m.file):
        yield from decoder.decode_file(one_file)
