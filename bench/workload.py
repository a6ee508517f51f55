"""Deterministic workload: Debezium PostgreSQL change files and base tables.

Change files
------------
``Workload(seed, base_rows, ...)`` writes JSON-lines archive files of
Debezium PostgreSQL messages *with* their Connect schema (``schemas.enable=true``,
the heavy, realistic shape) for one table, ``public.orders``, 11 columns:
bigint key, bigint, two short texts, two decimals (base64 precise decimals),
int, a free text of 20..160 characters, boolean, a ``MicroTimestamp`` and a
``ZonedTimestamp``.

Mix per event (by count): ~50 % updates, ~30 % inserts, ~10 % deletes, ~10 %
primary-key changes (a delete of the old key and a create of the new key at
the same LSN, as Debezium emits them).  Updates hit a hot set (the first
0.1 % of the keys) 30 % of the time, otherwise a uniformly chosen live key;
deletes pick a uniformly chosen live key; inserts take fresh keys above
``insert_base`` (far above any base key, so the same file set means the same
thing against a 1M-row and a 10M-row table).  LSNs grow monotonically, events
are grouped in transactions of 1..5 events.  Everything is derived from the
seed: the same arguments write byte-identical files.

A ``Workload`` object keeps its state (live/deleted keys, next LSN, next
insert key) so a later batch (the hourly one) continues the same history.

Base tables
-----------
``base_rows_frame`` generates rows ``[start, end)`` directly in Spark (no
JSON), typed exactly as the project's decoder types the columns; the
contenders add their own metadata columns and append them to their target.
Base rows sit at LSN ``BASE_LSN`` (a snapshot read, before every event).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

TABLE = "orders"
SCHEMA_NAME = "public"
DATABASE = "benchdb"
KEY = "id"
BASE_LSN = 1_000_000
FIRST_EVENT_LSN = 10_000_000_000
INSERT_BASE = 1_000_000_000_000  # fresh keys of a workload: INSERT_BASE * k + n
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
_EPOCH_US_START = int(START.timestamp()) * 1_000_000

# name -> (Connect field schema, Spark type as the project's decoder types it)
_DEC = "org.apache.kafka.connect.data.Decimal"
COLUMNS: list[tuple[dict, str]] = [
    ({"type": "int64", "optional": False, "field": "id"}, "bigint"),
    ({"type": "int64", "optional": True, "field": "customer_id"}, "bigint"),
    ({"type": "string", "optional": True, "field": "status"}, "string"),
    ({"type": "string", "optional": True, "field": "region"}, "string"),
    (
        {
            "type": "bytes",
            "optional": True,
            "name": _DEC,
            "version": 1,
            "parameters": {"scale": "2", "connect.decimal.precision": "12"},
            "field": "amount",
        },
        "decimal(12,2)",
    ),
    (
        {
            "type": "bytes",
            "optional": True,
            "name": _DEC,
            "version": 1,
            "parameters": {"scale": "4", "connect.decimal.precision": "6"},
            "field": "tax_rate",
        },
        "decimal(6,4)",
    ),
    ({"type": "int32", "optional": True, "field": "quantity"}, "int"),
    ({"type": "string", "optional": True, "field": "note"}, "string"),
    ({"type": "boolean", "optional": True, "field": "is_priority"}, "boolean"),
    ({"type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp", "version": 1, "field": "created_at"}, "timestamp_ntz"),
    ({"type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp", "version": 1, "field": "updated_at"}, "timestamp"),
]
SPARK_TYPES: dict[str, str] = {f["field"]: t for f, t in COLUMNS}
_FIELDS = [f for f, _ in COLUMNS]
_SOURCE_FIELDS = [
    {"type": "string", "optional": False, "field": "version"},
    {"type": "string", "optional": False, "field": "connector"},
    {"type": "string", "optional": False, "field": "name"},
    {"type": "int64", "optional": False, "field": "ts_ms"},
    {
        "type": "string",
        "optional": True,
        "name": "io.debezium.data.Enum",
        "version": 1,
        "parameters": {"allowed": "true,last,false,incremental"},
        "default": "false",
        "field": "snapshot",
    },
    {"type": "string", "optional": False, "field": "db"},
    {"type": "string", "optional": True, "field": "sequence"},
    {"type": "string", "optional": False, "field": "schema"},
    {"type": "string", "optional": False, "field": "table"},
    {"type": "int64", "optional": True, "field": "txId"},
    {"type": "int64", "optional": True, "field": "lsn"},
    {"type": "int64", "optional": True, "field": "xmin"},
]
SCHEMA = {
    "type": "struct",
    "name": f"bench.{SCHEMA_NAME}.{TABLE}.Envelope",
    "optional": False,
    "version": 1,
    "fields": [
        {"type": "struct", "fields": _FIELDS, "optional": True, "name": f"bench.{SCHEMA_NAME}.{TABLE}.Value", "field": "before"},
        {"type": "struct", "fields": _FIELDS, "optional": True, "name": f"bench.{SCHEMA_NAME}.{TABLE}.Value", "field": "after"},
        {
            "type": "struct",
            "fields": _SOURCE_FIELDS,
            "optional": False,
            "name": "io.debezium.connector.postgresql.Source",
            "field": "source",
        },
        {"type": "string", "optional": False, "field": "op"},
        {"type": "int64", "optional": True, "field": "ts_ms"},
        {
            "type": "struct",
            "fields": [
                {"type": "string", "optional": False, "field": "id"},
                {"type": "int64", "optional": False, "field": "total_order"},
                {"type": "int64", "optional": False, "field": "data_collection_order"},
            ],
            "optional": True,
            "name": "event.block",
            "version": 1,
            "field": "transaction",
        },
    ],
}
_PREFIX = b'{"schema":' + orjson.dumps(SCHEMA) + b',"payload":'
_SUFFIX = b"}"

_STATUSES = ["new", "paid", "packed", "shipped", "delivered", "cancelled", "returned"]
_REGIONS = ["eu-west", "eu-central", "us-east", "us-west", "ap-south", "ap-northeast", "sa-east", "af-south"]
_WORDS = [
    "please",
    "deliver",
    "to",
    "the",
    "back",
    "door",
    "customer",
    "asked",
    "for",
    "gift",
    "wrapping",
    "fragile",
    "handle",
    "with",
    "care",
    "call",
    "before",
    "delivery",
    "leave",
    "at",
    "reception",
    "invoice",
    "attached",
    "express",
    "shipping",
    "requested",
    "partial",
    "refund",
    "issued",
    "address",
    "corrected",
    "by",
    "support",
    "warehouse",
    "note",
    "priority",
    "lane",
]


def encode_decimal(unscaled: int) -> str:
    """Debezium's precise decimal: base64 of the big-endian two's-complement unscaled value."""
    length = max(1, (unscaled.bit_length() + 8) // 8)
    return base64.b64encode(unscaled.to_bytes(length, "big", signed=True)).decode()


def _iso_z(micros: int) -> str:
    return (START + dt.timedelta(microseconds=micros - _EPOCH_US_START)).isoformat().replace("+00:00", "Z")


@dataclass
class WorkloadFiles:
    """What one ``Workload.write`` produced."""

    root: str
    paths: list[str]
    events: int
    bytes: int
    ops: dict[str, int]
    pk_changes: int
    lsn_first: int
    lsn_last: int

    def as_dict(self) -> dict:
        d = asdict(self)
        d["files"] = len(d.pop("paths"))
        return d


@dataclass
class Workload:
    """A deterministic change history of ``public.orders`` against a base table
    holding keys ``1..base_rows``."""

    seed: int
    base_rows: int
    insert_slot: int = 1
    """Fresh keys are ``INSERT_BASE * insert_slot + n``: give workloads that
    target the same table the same ``Workload`` object, different tables any slot."""
    lsn: int = FIRST_EVENT_LSN
    hot_share: float = 0.3
    inserted: int = 0
    deleted: set[int] = field(default_factory=set)
    tx: int = 5_000_000
    clock_us: int = _EPOCH_US_START + 3600 * 1_000_000

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.hot = max(10, self.base_rows // 1000)

    # -- keys ------------------------------------------------------------------
    def _uniform_key(self) -> int:
        total = self.base_rows + self.inserted
        for _ in range(64):
            r = self.rng.randrange(total)
            key = r + 1 if r < self.base_rows else INSERT_BASE * self.insert_slot + (r - self.base_rows) + 1
            if key not in self.deleted:
                return key
        raise RuntimeError("could not find a live key: the workload deleted almost everything")

    def _update_key(self) -> int:
        if self.rng.random() < self.hot_share:
            key = self.rng.randint(1, min(self.hot, self.base_rows))
            if key not in self.deleted:
                return key
        return self._uniform_key()

    def _new_key(self) -> int:
        self.inserted += 1
        return INSERT_BASE * self.insert_slot + self.inserted

    # -- rows and messages -----------------------------------------------------
    def _row(self, key: int) -> dict:
        rng = self.rng
        words = rng.randint(3, 24)
        return {
            "id": key,
            "customer_id": rng.randrange(1, 200_000),
            "status": rng.choice(_STATUSES),
            "region": rng.choice(_REGIONS),
            "amount": encode_decimal(rng.randrange(0, 10**9)),
            "tax_rate": encode_decimal(rng.randrange(0, 2500)),
            "quantity": rng.randint(1, 50),
            "note": " ".join(rng.choice(_WORDS) for _ in range(words)),
            "is_priority": rng.random() < 0.07,
            "created_at": self.clock_us - rng.randrange(0, 86_400_000_000),
            "updated_at": _iso_z(self.clock_us),
        }

    def _message(self, op: str, lsn: int, before: dict | None, after: dict | None, order: int) -> bytes:
        ts_ms = self.clock_us // 1000
        payload = {
            "before": before,
            "after": after,
            "source": {
                "version": "2.7.0.Final",
                "connector": "postgresql",
                "name": "bench",
                "ts_ms": ts_ms,
                "snapshot": "false",
                "db": DATABASE,
                "sequence": f'["{lsn - 8}","{lsn}"]',
                "schema": SCHEMA_NAME,
                "table": TABLE,
                "txId": self.tx,
                "lsn": lsn,
                "xmin": None,
            },
            "op": op,
            "ts_ms": ts_ms + 7,
            "transaction": {"id": f"{self.tx}:{lsn}", "total_order": order, "data_collection_order": order},
        }
        return _PREFIX + orjson.dumps(payload) + _SUFFIX

    def events(self, n: int, counts: dict[str, int] | None = None):
        """Yield ``n`` message lines (bytes, no newline); a primary-key change
        is two events and may end the batch one event late."""
        counts = counts if counts is not None else {}
        rng = self.rng
        made = 0
        tx_left = 0
        order = 0
        while made < n:
            if tx_left == 0:
                self.tx += 1
                tx_left = rng.randint(1, 5)
                order = 0
                self.clock_us += rng.randrange(200, 5_000)
            tx_left -= 1
            self.lsn += rng.randrange(40, 400)
            order += 1
            r = rng.random()
            if r < 0.526:
                key = self._update_key()
                yield self._message("u", self.lsn, None, self._row(key), order)
                counts["u"] = counts.get("u", 0) + 1
                made += 1
            elif r < 0.842:
                key = self._new_key()
                yield self._message("c", self.lsn, None, self._row(key), order)
                counts["c"] = counts.get("c", 0) + 1
                made += 1
            elif r < 0.947:
                key = self._uniform_key()
                self.deleted.add(key)
                yield self._message("d", self.lsn, {"id": key}, None, order)
                counts["d"] = counts.get("d", 0) + 1
                made += 1
            else:  # primary-key change: delete old key + create new key, same LSN
                old = self._uniform_key()
                self.deleted.add(old)
                new = self._new_key()
                yield self._message("d", self.lsn, {"id": old}, None, order)
                yield self._message("c", self.lsn, None, self._row(new), order)
                counts["d"] = counts.get("d", 0) + 1
                counts["c"] = counts.get("c", 0) + 1
                counts["pk_change"] = counts.get("pk_change", 0) + 1
                made += 2

    def write(self, root: Path, n_events: int, events_per_file: int, *, name: str = "orders") -> WorkloadFiles:
        """Write ``n_events`` into files of ``events_per_file`` lines under
        ``root/YYYY/MM/DD/HH/`` (one hour folder per file, in order)."""
        root = Path(root)
        counts: dict[str, int] = {}
        paths: list[str] = []
        total_bytes = 0
        lsn_first = self.lsn + 1
        buf: list[bytes] = []

        def flush() -> None:
            nonlocal total_bytes, buf
            if not buf:
                return
            hour = START + dt.timedelta(hours=len(paths))
            path = root / f"{hour:%Y/%m/%d/%H}" / f"{name}-{len(paths):05d}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            data = b"\n".join(buf) + b"\n"
            path.write_bytes(data)
            total_bytes += len(data)
            paths.append(str(path.resolve()))
            buf = []

        for line in self.events(n_events, counts):
            buf.append(line)
            if len(buf) >= events_per_file:
                flush()
        flush()
        made = sum(v for k, v in counts.items() if k != "pk_change")
        return WorkloadFiles(
            root=str(root),
            paths=paths,
            events=made,
            bytes=total_bytes,
            ops={k: v for k, v in counts.items() if k != "pk_change"},
            pk_changes=counts.get("pk_change", 0),
            lsn_first=lsn_first,
            lsn_last=self.lsn,
        )


def seed_message() -> bytes:
    """One snapshot-read event for key 1 at ``BASE_LSN``: applied through each
    contender's own path, it creates its target table (with the project: the
    exact schema, CDC columns and properties the project gives a table)."""
    w = Workload(seed=0, base_rows=1)
    w.clock_us = _EPOCH_US_START
    row = base_row_python(1)
    payload = {
        "before": None,
        "after": row,
        "source": {
            "version": "2.7.0.Final",
            "connector": "postgresql",
            "name": "bench",
            "ts_ms": _EPOCH_US_START // 1000,
            "snapshot": "true",
            "db": DATABASE,
            "sequence": f'[null,"{BASE_LSN}"]',
            "schema": SCHEMA_NAME,
            "table": TABLE,
            "txId": 1,
            "lsn": BASE_LSN,
            "xmin": None,
        },
        "op": "r",
        "ts_ms": _EPOCH_US_START // 1000,
        "transaction": None,
    }
    return _PREFIX + orjson.dumps(payload) + _SUFFIX


def write_seed(root: Path) -> Path:
    path = Path(root) / f"{START:%Y/%m/%d/%H}" / "seed-00000.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(seed_message() + b"\n")
    return path.resolve()


# -- base rows -------------------------------------------------------------------
# The same values in Python (seed row) and in Spark SQL (bulk rows).


def base_row_python(i: int) -> dict:
    return {
        "id": i,
        "customer_id": (i * 7919) % 200_000 + 1,
        "status": _STATUSES[i % len(_STATUSES)],
        "region": _REGIONS[(i * 31) % len(_REGIONS)],
        "amount": encode_decimal((i * 104_729) % 10**9),
        "tax_rate": encode_decimal((i * 13) % 2500),
        "quantity": i % 50 + 1,
        "note": f"base row {i} " + "x" * (i % 60),
        "is_priority": i % 17 == 0,
        "created_at": _EPOCH_US_START - 86_400_000_000 + i * 1000,
        "updated_at": _iso_z(_EPOCH_US_START + i * 1000),
    }


def base_sql_columns() -> dict[str, str]:
    """Spark SQL expressions over ``id`` (from ``spark.range``), typed as the
    project types the columns; same values as ``base_row_python``."""
    st = ", ".join(f"'{s}'" for s in _STATUSES)
    rg = ", ".join(f"'{r}'" for r in _REGIONS)
    return {
        "id": "CAST(id AS bigint)",
        "customer_id": "CAST(pmod(id * 7919, 200000) + 1 AS bigint)",
        "status": f"element_at(array({st}), CAST(pmod(id, {len(_STATUSES)}) + 1 AS int))",
        "region": f"element_at(array({rg}), CAST(pmod(id * 31, {len(_REGIONS)}) + 1 AS int))",
        "amount": "CAST(pmod(id * 104729, 1000000000) / 100 AS decimal(12,2))",
        "tax_rate": "CAST(pmod(id * 13, 2500) / 10000 AS decimal(6,4))",
        "quantity": "CAST(pmod(id, 50) + 1 AS int)",
        "note": "concat('base row ', CAST(id AS string), ' ', repeat('x', CAST(pmod(id, 60) AS int)))",
        "is_priority": "pmod(id, 17) = 0",
        "created_at": f"CAST(timestamp_micros({_EPOCH_US_START - 86_400_000_000} + id * 1000) AS timestamp_ntz)",
        "updated_at": f"timestamp_micros({_EPOCH_US_START} + id * 1000)",
    }


def base_rows_frame(spark, start: int, end: int, *, rows_per_partition: int = 500_000):
    """Rows with keys ``[start, end)`` in key order, typed like the project's
    decoder types them.  One partition (≈ one data file) per 500k rows."""
    parts = max(1, -(-(end - start) // rows_per_partition))
    df = spark.range(start, end, 1, parts)
    return df.selectExpr(*[f"{expr} AS `{name}`" for name, expr in base_sql_columns().items()])


def base_position() -> str:
    return str(BASE_LSN).zfill(20)


def manifest_entries(paths: list[str]) -> list[dict]:
    """The ``--files-from`` manifest the DAG's discover task writes."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spark_jobs"))
    from cdc_apply.archive.listing import fingerprint

    return [fingerprint(Path(p)).manifest_entry() for p in paths]


if __name__ == "__main__":  # quick look: python -m bench.workload /tmp/wl 1000
    import sys
    import time

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench_workload")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    t = time.time()
    res = Workload(seed=42, base_rows=10_000).write(out, n, 20_000)
    print(json.dumps(res.as_dict(), indent=1), f"{time.time() - t:.1f}s")
