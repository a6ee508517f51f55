"""Every format, through the whole job (files -> decode in Spark -> apply ->
publish), equals the reference model over the same messages.

Random synthetic workloads are rendered by each format's writer, split into
archive files (each applied as its own batch, in log order, with duplicate
deliveries of earlier lines and shuffled lines within a file), applied with
``run_batch``; the live rows must equal the model applied to the decoded
events, row for row. ``HYPOTHESIS_EXAMPLES`` raises the example count.
"""

from __future__ import annotations

import datetime as dt
import importlib
import itertools
import os
import random
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cdc_apply.archive.files import write_jsonl
from cdc_apply.batch import run_batch
from cdc_apply.decode import DecodeContext, decode_all, make_decoder
from cdc_apply.model import ChangeEvent, RawMessage
from tests.apply_harness import live_rows
from tests.formats.synthetic import SyntheticChange
from tests.reference_model import apply_model

pytestmark = [pytest.mark.spark, pytest.mark.slow]
EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "2"))
UTC = dt.UTC
_n = itertools.count()

# format -> (writer module, supports partial rows, supports truncate, supports snapshot reads)
FORMATS = {
    "debezium_postgres": ("write_debezium_postgres", True, True, True),
    "debezium_sqlserver": ("write_debezium_sqlserver", False, False, True),
    "sqlserver_ces": ("write_sqlserver_ces", False, False, False),
    "qlik": ("write_qlik", True, False, True),
    "cockroachdb": ("write_cockroachdb", False, False, True),
}


DECODES = st.sampled_from(["here", "spark tasks"])
"""Where each example's batches are decoded: these small ones in the
driver's Python (``stage.decode_here``), a batch past
``stage.LOCAL_DECODE_BYTES`` by Spark's Python tasks.  Both against the model."""


def writer(fmt):
    try:
        return importlib.import_module(f"tests.formats.{FORMATS[fmt][0]}")
    except ModuleNotFoundError:
        pytest.skip(f"no writer for {fmt} yet")


@st.composite
def workload(draw, fmt: str):
    _, partial, truncate, reads = FORMATS[fmt]
    kinds = ["c", "u", "u", "d", "pk"] + (["r"] if reads else []) + (["t"] if truncate else [])
    n = draw(st.integers(min_value=1, max_value=10))
    changes, seq = [], 0
    t0 = dt.datetime(2026, 3, 1, 12, tzinfo=UTC)
    for _i in range(n):
        kind = draw(st.sampled_from(kinds))
        key = draw(st.integers(min_value=1, max_value=3))
        seq += 1
        ts = t0 + dt.timedelta(seconds=seq)
        row = {
            "id": key,
            "name": draw(st.one_of(st.none(), st.sampled_from(["a", "b", "ü x"]))),
            "amount": draw(st.one_of(st.none(), st.integers(-99999, 99999).map(lambda v: Decimal(v).scaleb(-2)))),
            "updated_at": ts.replace(microsecond=draw(st.integers(0, 999999))),
        }
        if kind == "t":
            changes.append(SyntheticChange("t", {}, None, None, seq, seq, ts))
        elif kind == "d":
            changes.append(SyntheticChange("d", {"id": key}, None, {"id": key}, seq, seq, ts))
        elif kind == "pk":
            new = draw(st.integers(min_value=1, max_value=3).filter(lambda k, old=key: k != old))
            changes.append(SyntheticChange("d", {"id": key}, None, {"id": key}, seq, seq, ts))
            seq += 1
            changes.append(SyntheticChange("c", {"id": new}, {**row, "id": new}, None, seq, seq - 1, ts))
        else:
            if kind == "u" and partial and draw(st.booleans()):
                row.pop("name")  # not present in the message
            changes.append(SyntheticChange(kind, {"id": key}, row, {"id": key} if kind == "u" else None, seq, seq, ts))
    return changes, draw(st.integers(0, 2**32)), draw(st.integers(1, 3))


def deliver(lines: list[str], seed: int, nfiles: int, keep_first: int) -> list[list[str]]:
    """Contiguous chunks in log order; duplicates of earlier lines; shuffled within a file.
    The first ``keep_first`` lines (e.g. Qlik metadata) stay at the head of file 1."""
    rnd = random.Random(seed)
    head, body = lines[:keep_first], lines[keep_first:]
    nfiles = max(1, min(nfiles, len(body)))
    cuts = sorted(rnd.sample(range(1, len(body)), nfiles - 1)) if nfiles > 1 else []
    files = [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])]
    out = []
    for i, chunk in enumerate(files):
        chunk = list(chunk)
        earlier = [line for f in files[: i + 1] for line in f]
        chunk += [rnd.choice(earlier) for _ in range(rnd.randint(0, 2))]
        rnd.shuffle(chunk)
        out.append((head if i == 0 else []) + chunk)
    return out


def run_format(fmt: str, spark, settings, changes, seed, nfiles, tmp_root: Path):
    w = writer(fmt)
    try:
        lines = w.write_messages(changes)
    except NotImplementedError as exc:
        pytest.skip(str(exc))
    source = f"{fmt}_{next(_n)}"
    sources_file = tmp_root / f"{source}.yaml"
    sources_file.write_text(
        yaml.safe_dump(
            {
                "sources": {
                    source: {"format": fmt, "namespace": source, "tables": {"items": {"primary_key": ["id"]}}, "quarantine_max_share": 0.0}
                }
            }
        )
    )
    keep = 1 if fmt == "qlik" else 0
    old = os.environ.get("CDC_SOURCES_FILE")
    os.environ["CDC_SOURCES_FILE"] = str(sources_file)
    try:
        from cdc_apply.config import Settings

        s = Settings.from_env()
        paths = []
        for i, chunk in enumerate(deliver(lines, seed, nfiles, keep)):
            path = write_jsonl(Path(s.archive_dir) / source / f"2026/03/01/{i:02d}" / "part-0.jsonl", chunk)
            paths.append(path)
            result = run_batch(s, source, spark=spark)
            assert result.status in ("complete", "nothing-to-do"), result.to_json()
        # the model: every delivered message decoded, applied one by one in position order
        dec = make_decoder(fmt, DecodeContext(source=source, primary_keys={"items": ["id"]}))
        msgs = [
            RawMessage(str(p.resolve()), n, text) for p in paths for n, text in enumerate(p.read_text().splitlines(), 1) if text.strip()
        ]
        events = [o for o in decode_all(dec, msgs) if isinstance(o, ChangeEvent)]
        columns = {}
        for e in events:
            for c in e.columns or []:
                columns[c.name] = c.type
        model = apply_model(events, ["id"], list(columns))
        got = live_rows(spark, s, source, "items", ["id"], columns)
        # compare on the declared columns (a schemaless JSON null declares no column)
        assert {k: {c: v.get(c) for c in columns} for k, v in got.items()} == {
            tuple(k): {c: v.get(c) for c in columns} for k, v in model.items()
        }
    finally:
        if old is None:
            os.environ.pop("CDC_SOURCES_FILE", None)
        else:
            os.environ["CDC_SOURCES_FILE"] = old


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_applies_like_the_model(fmt, spark, settings, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"src_{fmt}")

    @hsettings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(workload(fmt), DECODES)
    def check(w, decode):
        from cdc_apply.decode import stage

        old = stage.LOCAL_DECODE_BYTES
        stage.LOCAL_DECODE_BYTES = old if decode == "here" else -1
        try:
            run_format(fmt, spark, settings, *w, tmp_root=root)
        finally:
            stage.LOCAL_DECODE_BYTES = old

    check()
