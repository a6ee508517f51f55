"""The Debezium PostgreSQL fast path (``decode/fast_debezium.py``) gives the
same outcome rows as the exact decoder on the same file, line for line:
generated messages with edge values in every field it reads, unusual lines
(placeholders, notes, truncates, unknown columns, bad UTF-8, ``\\r``, BOM,
blank lines, garbage), and the bench's own workload, where it must also
actually take the lines (a fast path that always stepped aside would pass
the equality trivially)."""

from __future__ import annotations

import base64
import functools
import json
import random
from pathlib import Path

import orjson
import pyarrow as pa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cdc_apply.decode import DecodeContext, fast_debezium, make_decoder
from cdc_apply.decode.debezium_common import PLACEHOLDER, PLACEHOLDER_B64
from cdc_apply.decode.stage import decode_file_contents, fast_batch, outcomes_batch

CONNECT = {
    "int8": {"type": "int8"},
    "int16": {"type": "int16"},
    "int32": {"type": "int32"},
    "int64": {"type": "int64"},
    "bool": {"type": "boolean"},
    "text": {"type": "string"},
    "uuid": {"type": "string", "name": "io.debezium.data.Uuid"},
    "dec": {
        "type": "bytes",
        "name": "org.apache.kafka.connect.data.Decimal",
        "parameters": {"scale": "2", "connect.decimal.precision": "6"},
    },
    "dec0": {
        "type": "bytes",
        "name": "org.apache.kafka.connect.data.Decimal",
        "parameters": {"scale": "0", "connect.decimal.precision": "18"},
    },
    "dec38": {
        "type": "bytes",
        "name": "org.apache.kafka.connect.data.Decimal",
        "parameters": {"scale": "4", "connect.decimal.precision": "38"},
    },
    "ms": {"type": "int64", "name": "io.debezium.time.Timestamp"},
    "us": {"type": "int64", "name": "io.debezium.time.MicroTimestamp"},
    "zoned": {"type": "string", "name": "io.debezium.time.ZonedTimestamp"},
    # kinds the fast path does not take: a schema holding one is the exact decoder's
    "dbl": {"type": "float64"},
    "day": {"type": "int32", "name": "io.debezium.time.Date"},
    "vs": {
        "type": "struct",
        "name": "io.debezium.data.VariableScaleDecimal",
        "fields": [{"type": "int32", "field": "scale"}, {"type": "bytes", "field": "value"}],
    },
}
TAKEN = [k for k in CONNECT if k not in ("dbl", "day", "vs")]


def b64(n: int) -> str:
    return base64.b64encode(n.to_bytes(max(1, (n.bit_length() + 8) // 8), "big", signed=True)).decode()


def edge_values(kind: str) -> st.SearchStrategy:
    common = st.sampled_from([None, PLACEHOLDER, True, 1.5, "", [PLACEHOLDER]])
    if kind.startswith("int"):
        bits = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}[kind]
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return st.one_of(st.integers(lo, hi), st.sampled_from([lo - 1, hi + 1, lo, hi, 0, "12", 2**70]), common)
    if kind == "bool":
        return st.one_of(st.booleans(), st.sampled_from([0, 1, "true"]), common)
    if kind in ("text", "uuid"):
        return st.one_of(st.text(max_size=20), st.sampled_from(["é\u2028x", "\x00", "`", PLACEHOLDER_B64]), common)
    if kind.startswith("dec"):
        digits = {"dec": 6, "dec0": 18, "dec38": 38}[kind]
        return st.one_of(
            st.integers(-(10**digits) + 1, 10**digits - 1).map(b64),
            st.sampled_from(
                [b64(10**digits), b64(-(10**digits)), b64(0), b64(-1), PLACEHOLDER_B64, "AA=", "A===", "not base64", "", "AAAA\n"]
            ),
            st.integers(-(10**40), 10**40).map(b64),
            common,
        )
    if kind in ("ms", "us"):
        unit = 1_000 if kind == "ms" else 1_000_000
        return st.one_of(
            st.integers(-62_135_596_800 * unit, 253_402_300_799 * unit),
            st.sampled_from([-62_135_596_800 * unit - 1, 253_402_300_800 * unit, 0, -1, 2**63 - 1, -(2**63), 2**63]),
            common,
        )
    if kind == "zoned":
        return st.one_of(
            st.datetimes().map(
                lambda d: (
                    d.strftime("%Y-%m-%dT%H:%M:%S")
                    + random.Random(d.microsecond).choice(["Z", ".5Z", ".123456Z", ".1234567Z", "+02:00", ""])
                )
            ),
            st.sampled_from(
                ["2026-02-30T10:00:00Z", "2026-11-24T24:00:00Z", "2026-11-24T23:59:60Z", "0999-01-01T00:00:00Z", "2026-1-1T00:00:00Z"]
            ),
            common,
        )
    return st.one_of(st.integers(), st.floats(allow_nan=False), common)


@st.composite
def tables(draw):
    kinds = draw(st.lists(st.sampled_from(list(CONNECT)), min_size=1, max_size=6, unique=True))
    if draw(st.integers(0, 9)) > 1:  # mostly schemas the fast path takes
        kinds = [k for k in kinds if k in TAKEN] or ["int64"]
    columns = [(f"c_{k}", k, draw(st.booleans())) for k in kinds]
    key = draw(st.sampled_from([None] + [c[0] for c in columns]))
    return columns, key


def envelope(columns: list, extra_source: list | None = None) -> dict:
    row = {
        "type": "struct",
        "optional": True,
        "name": "srv.public.t.Value",
        "fields": [{"field": name, "optional": optional, **CONNECT[kind]} for name, kind, optional in columns],
    }
    source_fields = [
        {"type": "string", "optional": False, "field": "connector"},
        {"type": "string", "optional": True, "field": "db"},
        {"type": "string", "optional": True, "field": "schema"},
        {"type": "string", "optional": False, "field": "table"},
        {"type": "int64", "optional": True, "field": "lsn"},
        {"type": "string", "optional": True, "field": "sequence"},
        {"type": "string", "optional": True, "field": "snapshot", "name": "io.debezium.data.Enum"},
        {"type": "int64", "optional": True, "field": "txId"},
        {"type": "int64", "optional": False, "field": "ts_ms"},
        {"type": "int64", "optional": True, "field": "ts_us"},
        {"type": "int64", "optional": True, "field": "ts_ns"},
        *(extra_source or []),
    ]
    return {
        "type": "struct",
        "optional": False,
        "name": "srv.public.t.Envelope",
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            {
                "type": "struct",
                "optional": False,
                "name": "io.debezium.connector.postgresql.Source",
                "field": "source",
                "fields": source_fields,
            },
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
            {
                "type": "struct",
                "optional": True,
                "field": "transaction",
                "fields": [
                    {"type": "string", "optional": False, "field": "id"},
                    {"type": "int64", "optional": False, "field": "total_order"},
                ],
            },
        ],
    }


@st.composite
def messages(draw, columns):
    def image():
        if draw(st.integers(0, 5)) == 0:
            return None
        row = {}
        for name, kind, _ in columns:
            if draw(st.integers(0, 7)) == 0:
                continue  # absent: not present
            row[name] = draw(edge_values(kind))
        if draw(st.integers(0, 30)) == 0:
            row["c_unknown"] = 1
        return row

    lsn = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([-1, 2**64, "123", None, 0])))
    current = lsn if draw(st.integers(0, 5)) else draw(st.integers(0, 10**21))
    sequence = draw(
        st.sampled_from(
            [
                None,
                f'["{draw(st.integers(0, 10**21))}","{current}"]',
                f'[null,"{current}"]',
                '["5",null]',
                "[1,2]",
                "not json",
                '["a","b"]',
                f'[ "7" , "{current}" ]',
                f'["٣","{current}"]',
            ]
        )
    )
    source = {
        "connector": draw(st.sampled_from(["postgresql"] * 8 + ["sqlserver", None])),
        "db": draw(st.sampled_from(["inventory", None, "bad`name"])),
        "schema": draw(st.sampled_from(["public", None])),
        "table": draw(st.sampled_from(["t"] * 6 + ["u", None, "x\ny"])),
        "lsn": lsn,
        "sequence": sequence,
        "snapshot": draw(st.sampled_from([None, "false", "true", "last", "incremental", "LAST"])),
        "txId": draw(st.sampled_from([None, 7, 2**40, "9", 2**63, -(2**63) - 1, 2**64 - 1])),
        "ts_ms": draw(st.sampled_from([1_700_000_000_000, -5, None])),
    }
    if draw(st.booleans()):
        source["ts_us"] = draw(st.sampled_from([1_700_000_000_000_123, None]))
    if draw(st.integers(0, 3)) == 0:
        source["ts_ns"] = draw(st.sampled_from([1_700_000_000_000_123_456, -1_999, None]))
    payload = {
        "before": image(),
        "after": image(),
        "source": source,
        "op": draw(st.sampled_from(["c", "u", "d", "r"] * 4 + ["t", "m", "x", None])),
        "ts_ms": 1,
        "transaction": draw(st.sampled_from([None, {"id": "tx-1", "total_order": 1}, {"id": "tx-2", "total_order": 2}])),
    }
    return payload


def line_of(schema_bytes: bytes, payload: dict, noise: str) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()  # orjson refuses ints beyond 64 bits
    line = b'{"schema":' + schema_bytes + b',"payload":' + body + b"}"
    if noise == "cr":
        return line + b"\r"
    if noise == "trailing":
        return line + b" "
    if noise == "garbage":
        return line[:-1] + b',"x":1}'
    if noise == "bad-utf8":
        return line.replace(b'"op":', b'"op\xff":', 1) if b'"op":' in line else line
    if noise == "bad-utf8-in-string":
        return line.replace(b'"ts_ms":1', b'"ts_ms":1,"v":"\xc3"', 1)
    if noise == "blank":
        return b"   "
    if noise == "not-json":
        return b"{oops"
    if noise == "tombstone":
        return b'{"schema":null,"payload":null}'
    return line


def normalise(batches: list[pa.RecordBatch]) -> tuple[list[dict], dict]:
    rows = pa.Table.from_batches(batches, schema=batches[0].schema).to_pylist() if batches else []
    declared: dict = {}
    for r in rows:
        cols = r.pop("columns")
        if cols is not None:
            declared.setdefault((r["database"], r["schema_name"], r["table_name"]), set()).add(tuple(tuple(c.values()) for c in cols))
        for k in ("after", "before"):
            if r[k] is not None:
                r[k] = sorted(r[k])
    return sorted(rows, key=lambda r: (r["file"], r["line"], r["status"], str(r["op"]))), declared


def _opener(path: Path):
    return functools.partial(path.open, "rb")


def both(path: Path, keys: dict) -> tuple[tuple, tuple, int]:
    """(exact rows, fast rows, lines the fast path built itself)."""
    exact_dec = make_decoder("debezium_postgres", DecodeContext(primary_keys=keys, options={"decode": "exact"}))
    exact = list(decode_file_contents(exact_dec, [(str(path), _opener(path), None)], False))
    fast_dec = make_decoder("debezium_postgres", DecodeContext(primary_keys=keys))
    assert fast_debezium.supports(fast_dec) and not fast_debezium.supports(exact_dec)
    parts = list(fast_debezium.decode_files(fast_dec, [(str(path), _opener(path), None)]))
    built = sum(len(p["status"]) for p in parts if isinstance(p, dict))
    batches = [fast_batch(p) if isinstance(p, dict) else outcomes_batch(p) for p in parts]
    return normalise([outcomes_batch(exact)] if exact else []), normalise(batches), built


@settings(
    max_examples=200,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), table=tables())
def test_fast_path_gives_the_exact_decoders_rows(tmp_path_factory, data, table):
    columns, key = table
    schema_bytes = orjson.dumps(envelope(columns))
    noises = st.sampled_from(
        ["none"] * 12 + ["cr", "trailing", "garbage", "bad-utf8", "bad-utf8-in-string", "blank", "not-json", "tombstone"]
    )
    lines = [line_of(schema_bytes, data.draw(messages(columns)), data.draw(noises)) for _ in range(data.draw(st.integers(1, 25)))]
    if data.draw(st.booleans()):  # a second schema in the same file
        other = orjson.dumps(envelope(columns, [{"type": "string", "optional": True, "field": "extra"}]))
        lines += [line_of(other, data.draw(messages(columns)), "none") for _ in range(3)]
    path = tmp_path_factory.mktemp("fast") / "f.jsonl"
    path.write_bytes(b"\n".join(lines) + data.draw(st.sampled_from([b"\n", b""])))
    exact, fast, _ = both(path, {"t": [key]} if key else {})
    assert fast == exact


def test_fast_path_takes_the_bench_workload(tmp_path):
    """The bench's messages (the shape of a real schemas.enable=true archive):
    the same rows, and every line after the first built by the fast path."""
    from bench import workload as wl

    files = wl.Workload(seed=3, base_rows=1000).write(tmp_path, 3000, 3000)
    (path,) = files.paths
    exact, fast, built = both(Path(path), {"orders": ["id"]})
    assert fast == exact
    assert len(exact[0]) == 3000 and built == 2999


def test_snapshot_reads_and_line_numbers_across_chunks(tmp_path):
    """Snapshot reads (their change id carries the key) and lines that span
    the reader's 1 MiB chunks keep their numbers."""
    columns = [("c_int64", "int64", False), ("c_text", "text", True)]
    schema_bytes = orjson.dumps(envelope(columns))
    lines = []
    for i in range(700):
        payload = {
            "before": None,
            "after": {"c_int64": i, "c_text": "x" * (i % 7) * 300},
            "op": "r" if i % 3 else "c",
            "source": {
                "connector": "postgresql",
                "db": "d",
                "schema": "public",
                "table": "t",
                "lsn": 100 + i,
                "sequence": f'["{i}","{100 + i}"]',
                "snapshot": "true" if i % 3 else "false",
                "txId": 5,
                "ts_ms": 1,
            },
        }
        lines.append(line_of(schema_bytes, payload, "none"))
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert path.stat().st_size > 1 << 20  # more than one read chunk
    exact, fast, built = both(path, {"t": ["c_int64"]})
    assert fast == exact and built == 699


def test_a_transaction_id_beyond_int64_goes_the_exact_way(tmp_path):
    """Arrow holds txId as int64; a larger one (JSON allows it, the exact
    decoder keeps it as text) is the exact decoder's, not a failed task."""
    columns = [("c_int64", "int64", False)]
    schema_bytes = orjson.dumps(envelope(columns))
    source = {"connector": "postgresql", "db": "d", "schema": "public", "table": "t", "lsn": 100, "ts_ms": 1}
    lines = [
        line_of(schema_bytes, {"before": None, "after": {"c_int64": i}, "op": "c", "source": {**source, "txId": tx}}, "none")
        for i, tx in enumerate([5, 2**63, 7])
    ]
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"\n".join(lines))
    exact, fast, built = both(path, {"t": ["c_int64"]})
    assert fast == exact and built == 1


def test_a_last_lsn_beyond_uint64_in_the_sequence_goes_the_exact_way(tmp_path):
    """``source.sequence``'s last committed LSN is carried as uint64; one of
    20 digits past 2^64-1 (hypothesis found 2^64) is the exact decoder's,
    not a failed task: the bound was 10^20, which uint64 does not reach."""
    columns = [("c_int64", "int64", False)]
    schema_bytes = orjson.dumps(envelope(columns))
    source = {"connector": "postgresql", "db": "d", "schema": "public", "table": "t", "lsn": 100, "ts_ms": 1, "txId": 5}
    lasts = ["90", str(2**64), str(2**64 - 1), str(10**20 - 1), "95"]
    lines = [
        line_of(
            schema_bytes,
            {"before": None, "after": {"c_int64": i}, "op": "c", "source": {**source, "sequence": f'["{last}","100"]'}},
            "none",
        )
        for i, last in enumerate(lasts)
    ]
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"\n".join(lines))
    exact, fast, built = both(path, {"t": ["c_int64"]})
    assert fast == exact and built == 2  # the first line meets the schema: exact too; 2^64 and 10^20-1 go the exact way


def test_a_transaction_order_beyond_bigint_goes_the_exact_way(tmp_path):
    """``total_order`` is carried as bigint; a larger one (msgspec reads up to
    2^64-1) is the exact decoder's, which quarantines it naming the field,
    not a failed task (the nemesis' hostile kind)."""
    columns = [("c_int64", "int64", False)]
    schema_bytes = orjson.dumps(envelope(columns))
    source = {"connector": "postgresql", "db": "d", "schema": "public", "table": "t", "lsn": 100, "ts_ms": 1, "txId": 5}
    lines = [
        line_of(
            schema_bytes,
            {"before": None, "after": {"c_int64": i}, "op": "c", "source": source, "transaction": {"id": "5:1", "total_order": order}},
            "none",
        )
        for i, order in enumerate([1, 2**63, 2**64 - 1, 2])
    ]
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"\n".join(lines))
    exact, fast, built = both(path, {"t": ["c_int64"]})
    assert fast == exact and built == 1  # the first line meets the schema: exact too


def test_a_commit_time_beyond_the_timestamp_range_goes_the_exact_way(tmp_path):
    """A ``ts_ms`` whose micros leave Spark's timestamp range is the exact
    decoder's, which quarantines it naming the field, not a failed task."""
    columns = [("c_int64", "int64", False)]
    schema_bytes = orjson.dumps(envelope(columns))
    source = {"connector": "postgresql", "db": "d", "schema": "public", "table": "t", "lsn": 100, "txId": 5}
    lines = [
        line_of(schema_bytes, {"before": None, "after": {"c_int64": i}, "op": "c", "source": {**source, "ts_ms": ms}}, "none")
        for i, ms in enumerate([1, 2**63 - 1, 253402300800000, 2])
    ]
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"\n".join(lines))
    exact, fast, built = both(path, {"t": ["c_int64"]})
    assert fast == exact and built == 1  # the first line meets the schema: exact too
