"""What a run leaves in a state folder, read with pyiceberg (no JVM): every
table's rows (tombstones too) with the CDC columns that do not depend on the
run, which batches recorded each file, refs other than main, the batch rows
and the quarantine rows.  ``invariants`` are what must hold after any trial;
``differences`` compares a trial with the clean run."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

RUN_DEPENDENT = ("_cdc_batch_id", "_cdc_applied_at")


def _catalog(home: str):
    from pyiceberg.catalog import load_catalog

    return load_catalog("lake", **{"type": "sql", "uri": f"sqlite:///{home}/catalog.db", "warehouse": f"file://{home}/warehouse"})


def _rows(table) -> list[str]:
    if table.current_snapshot() is None:
        return []
    data = table.scan().to_arrow()
    keep = [c for c in data.column_names if c not in RUN_DEPENDENT]
    return sorted(json.dumps({c: r[c] for c in keep}, default=str, sort_keys=True) for r in data.select(keep).to_pylist())


def _file_batches(table) -> dict[str, list[str]]:
    """file path -> the batch ids whose commits on main's ancestry list it."""
    from pyiceberg.table.snapshots import ancestors_of

    out: dict[str, set[str]] = {}
    current = table.current_snapshot()
    for snap in ancestors_of(current, table.metadata) if current else []:
        props = dict(snap.summary.additional_properties) if snap.summary else {}
        for f in json.loads(props.get("cdc.files", "[]")):
            out.setdefault(f["path"], set()).add(props.get("cdc.batch-id", "?"))
    return {p: sorted(b) for p, b in sorted(out.items())}


def read_state(home: str, namespace: str) -> dict[str, Any]:
    """The state of ``namespace`` and the audit tables under CDC_HOME ``home``."""
    catalog = _catalog(home)
    state: dict[str, Any] = {"tables": {}, "files": {}, "refs": {}, "batches": [], "quarantine": []}
    try:
        idents = sorted(".".join(t) for t in catalog.list_tables(namespace))
    except Exception:  # no namespace: nothing applied
        idents = []
    for ident in idents:
        table = catalog.load_table(ident)
        state["tables"][ident] = _rows(table)
        state["files"][ident] = _file_batches(table)
        # branches only: every publish also tags its snapshot cdc_<batch> (as-of), which is no leftover
        state["refs"][ident] = sorted(n for n, r in table.metadata.refs.items() if n != "main" and r.snapshot_ref_type == "branch")
        if "cdc.changelog-of" in table.properties:
            state.setdefault("changelogs", []).append(ident)
        if "cdc.history-of" in table.properties:
            state.setdefault("histories", []).append(ident)
    try:
        batches = (
            catalog.load_table("cdc_audit.batches")
            .scan(selected_fields=("batch_id", "table_name", "status", "files"))
            .to_arrow()
            .to_pylist()
        )
        quarantine = (
            catalog.load_table("cdc_audit.quarantine").scan(selected_fields=("batch_id", "file", "line", "reason")).to_arrow().to_pylist()
        )
    except Exception:
        batches, quarantine = [], []
    state["batches"] = sorted(
        [r["batch_id"], r["status"], sorted(f["path"] for f in r["files"] or [])] for r in batches if r["table_name"] == "*"
    )
    state["quarantine"] = sorted([r["batch_id"], r["file"], r["line"], r["reason"]] for r in quarantine)
    return state


def invariants(state: dict[str, Any]) -> list[str]:
    """What must hold after any trial, whatever was killed: no file applied
    twice (by two batches) in a table, no audit or maintenance branch left,
    no batch recorded complete twice, no file in two complete batches, no
    quarantine row doubled, no table row doubled (a change logged twice, a
    history version stored twice)."""
    bad = []
    for ident, files in state["files"].items():
        bad += [f"{ident}: file {p} applied by {len(b)} batches {b}" for p, b in files.items() if len(b) != 1]
    bad += [f"{ident}: branches left {refs}" for ident, refs in state["refs"].items() if refs]
    done = [b for b in state["batches"] if b[1] in ("complete", "skipped")]
    bad += [f"batch {bid} recorded complete {n} times" for bid, n in Counter(b[0] for b in done).items() if n > 1]
    bad += [f"file {p} in {n} complete batches" for p, n in Counter(p for b in done for p in b[2]).items() if n > 1]
    bad += [f"quarantine row doubled: {q}" for q, n in Counter(map(tuple, state["quarantine"])).items() if n > 1]
    changelogs, histories = set(state.get("changelogs", [])), set(state.get("histories", []))
    for ident, rows in state["tables"].items():
        if ident in histories:  # one row per version: each (key, valid from) once
            versions = Counter((d.get("id"), d.get("_cdc_valid_from")) for d in map(json.loads, rows))
            bad += [f"{ident}: version {k} stored {n} times" for k, n in versions.items() if n > 1]
            continue
        if ident in changelogs:  # one row per change: each (file, line) logged once
            lines = Counter((d.get("file"), d.get("line"), d.get("position")) for d in map(json.loads, rows))
            bad += [f"{ident}: change {k} logged {n} times" for k, n in lines.items() if n > 1]
            continue
        keys = Counter(json.loads(r).get("id") for r in rows)
        bad += [f"{ident}: key {k} has {n} rows" for k, n in keys.items() if n > 1]
    return bad


def differences(expected: dict[str, Any], got: dict[str, Any], *, batches: bool = True) -> list[str]:
    """How ``got`` differs from the clean run (rows, files, quarantine, and
    with ``batches`` the completed batch rows), at most a few lines each."""
    out = invariants(got)
    for ident in sorted(set(expected["tables"]) | set(got["tables"])):
        want, have = Counter(expected["tables"].get(ident, [])), Counter(got["tables"].get(ident, []))
        lost, extra = list((want - have).elements()), list((have - want).elements())
        out += [f"{ident}: row lost {r}" for r in lost[:3]] + [f"{ident}: row extra {r}" for r in extra[:3]]
        if expected["files"].get(ident, {}).keys() != got["files"].get(ident, {}).keys():
            out.append(f"{ident}: applied files differ: {sorted(set(expected['files'].get(ident, {})) ^ set(got['files'].get(ident, {})))}")
    if batches:  # those that applied a file: a rerun that only read held lines again (still torn) changes no table
        want = sorted(b for b in expected["batches"] if b[1] == "complete" and b[2])
        have = sorted(b for b in got["batches"] if b[1] == "complete" and b[2])
        if want != have:
            out.append(f"complete batches differ: expected {[b[0] for b in want]}, got {[b[0] for b in have]}")
    if Counter(map(tuple, expected["quarantine"])) != Counter(map(tuple, got["quarantine"])):
        out.append(f"quarantine differs: {len(expected['quarantine'])} expected rows, {len(got['quarantine'])} got")
    return out
