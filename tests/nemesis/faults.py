"""File faults on a source that applied the workload: an applied file
rewritten (same size, new size), deleted, re-delivered under a new name, a
file that cannot be read (a dangling link), the SQLite catalog locked by
another process during a batch; and a file with held lines (a transaction
torn across the hour) rewritten or deleted before its lines are released.
Each ends in a loud refusal naming the file or in a correct idempotent
result — never a silent double apply or loss."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path

from tests.nemesis.trial import Trial
from tests.nemesis.workload import sources_yaml, write_workload

FAULTS = (
    "rewrite-same-size",
    "rewrite-new-size",
    "deleted",
    "redelivered",
    "dangling-link",
    "catalog-locked",
    "held-rewritten",
    "held-deleted",
)
HELD_FAULTS = ("held-rewritten", "held-deleted")
"""On the workload with transaction metadata: the first batch holds a torn transaction's lines (workload.py)."""


def _rows(spark, settings, ns: str) -> dict[str, list[str]]:
    out = {}
    for t in ("items", "orders"):
        ident = f"{settings.catalog_name}.{ns}.{t}"
        if spark.catalog.tableExists(ident):
            out[t] = sorted(map(str, spark.sql(f"SELECT * EXCEPT (_cdc_batch_id, _cdc_applied_at) FROM {ident}").collect()))
    return out


def _source(work: Path, name: str, seed: int, hours: int = 2, *, transactions: bool = False):
    from cdc_apply.config import Settings

    work.mkdir(parents=True, exist_ok=True)
    write_workload(work / "archive" / name, seed, hours=hours, per_hour=10, transactions=transactions)
    (work / "sources.yaml").write_text(sources_yaml(name, name))
    os.environ["CDC_SOURCES_FILE"] = str(work / "sources.yaml")
    return Settings.from_env()


def _apply(spark, settings, name: str, root: Path):
    """One batch of what is pending under ``root``, as the CLI's --dir does."""
    from cdc_apply.batch import pending_files, run_batch
    from cdc_apply.config import get_source

    return run_batch(settings, name, pending_files(settings, get_source(settings, name), root=root), spark=spark)


def fault_trial(spark, settings, work: Path, fault: str, seed: int = 5) -> Trial:
    from cdc_apply.errors import CdcError

    trial = Trial("faults", fault)
    t0 = time.time()
    name = f"fault_{fault.replace('-', '_')}_{seed}"
    transactions = fault in HELD_FAULTS
    settings = _source(work, name, seed, transactions=transactions)
    root = work / "archive" / name
    hours = sorted(p for p in root.glob("2026/01/01/*"))
    later = hours[-1]
    held_back = work / "later"
    shutil.move(str(later), held_back)  # the later hour arrives after the fault
    first = _apply(spark, settings, name, root)
    if first.status != "complete":
        trial.problems.append(f"the first batch did not complete: {first.message}")
    applied = sorted(root.rglob("part-0.jsonl"))[0]
    shutil.move(str(held_back), later)

    def attempt(label: str, s=settings):
        try:
            return _apply(spark, s, name, root), None
        except CdcError as exc:
            return None, exc
        except Exception as exc:  # not a named refusal: a defect
            trial.problems.append(f"{label}: a raw {type(exc).__name__}: {str(exc)[:800]}")
            return None, exc

    if fault in ("rewrite-same-size", "rewrite-new-size"):
        original = applied.read_bytes()
        text = original.decode()
        # same size: one letter of the Connect schema (every line has it), so the file surely changed
        applied.write_text(text.replace('"struct"', '"strucT"', 1) if fault == "rewrite-same-size" else text + text.splitlines()[0] + "\n")
        if applied.read_bytes() == original or (fault == "rewrite-same-size" and len(applied.read_bytes()) != len(original)):
            trial.problems.append("the harness did not rewrite the file as asked")
        modes = ["sha256"] if fault == "rewrite-same-size" else ["size", "sha256"]
        for mode in modes:
            res, exc = attempt(f"verify {mode}", dataclasses.replace(settings, verify_applied=mode))
            if exc is None or str(applied) not in str(exc):
                trial.problems.append(f"verify {mode}: a rewritten applied file was not refused naming it: {res and res.status} {exc}")
            trial.figures["refused"] = trial.figures.get("refused", 0) + int(exc is not None)
        if fault == "rewrite-same-size":  # the default (size) check does not read it again: documented, sha256 catches it
            res, exc = attempt("verify size")
            trial.notes.append(f"verify size: {res.status if res else exc} (the file is not read again)")
        applied.write_bytes(original)
    elif fault == "deleted":
        applied.unlink()
        res, exc = attempt("deleted")
        if exc is not None or res.status != "complete":
            trial.problems.append(f"a deleted applied file stopped the next batch: {exc or res.message}")
    elif fault == "redelivered":
        shutil.copy(applied, later / "redelivered.jsonl")
        res, exc = attempt("redelivered")
        if exc is not None or res.status != "complete":
            trial.problems.append(f"the re-delivered file failed the batch: {exc or res.message}")
    elif fault == "dangling-link":
        os.symlink("/nonexistent/nemesis", later / "dangling.jsonl")
        res, exc = attempt("dangling")
        if exc is None or "dangling.jsonl" not in str(exc):
            trial.problems.append(f"an unreadable file was not refused naming it: {res and res.status} {exc}")
        trial.figures["refused"] = 1
        (later / "dangling.jsonl").unlink()
    elif fault == "catalog-locked":
        _locked(spark, settings, trial, attempt)
    elif fault in HELD_FAULTS:
        _held_fault(fault, first.held_files, trial, attempt)
    _converges(spark, settings, work, name, root, fault, trial, attempt, seed=seed, transactions=transactions)
    trial.seconds = time.time() - t0
    return trial


def _held_fault(fault: str, held_files: list[str], trial: Trial, attempt) -> None:
    """A file with held lines rewritten (a line added) or deleted before the
    next batch: refused naming it, batch after batch; then put back."""
    if not held_files:
        trial.problems.append("the first batch held nothing: the fault has no held file to act on")
        return
    path = Path(held_files[0])
    original = path.read_bytes()
    if fault == "held-rewritten":
        path.write_bytes(original + original.splitlines(keepends=True)[0])
    else:
        path.unlink()
    for i in range(2):  # every batch, not only the first after the fault
        res, exc = attempt(f"{fault} {i}")
        refused = exc is not None if fault == "held-rewritten" else res is not None and res.status == "failed"
        told = str(exc) if exc is not None else (res.message or "" if res is not None else "")
        if not refused or str(path) not in told:
            trial.problems.append(f"{fault}: the batch was not refused naming {path}: {res and res.status} {told[:300]}")
        trial.figures["refused"] = trial.figures.get("refused", 0) + int(refused)
    path.write_bytes(original)


def _locked(spark, settings, trial: Trial, attempt) -> None:
    """Hold an exclusive lock on the SQLite catalog for a few seconds while the batch runs."""
    ready, done = threading.Event(), threading.Event()

    def hold():
        con = sqlite3.connect(str(settings.sqlite_path), timeout=60)
        con.execute("BEGIN EXCLUSIVE")
        ready.set()
        done.wait(8)
        con.rollback()
        con.close()

    th = threading.Thread(target=hold, daemon=True)
    th.start()
    ready.wait(60)
    res, exc = attempt("catalog locked")
    done.set()
    th.join()
    trial.notes.append(f"while locked: {res.status if res else type(exc).__name__}")


def _converges(
    spark, settings, work: Path, name: str, root: Path, fault: str, trial: Trial, attempt, *, seed: int, transactions: bool
) -> None:
    """After the fault is gone (files back as delivered), reruns reach the
    state of a clean source that applied the same files in the same batches."""
    from cdc_apply import ledger

    for _ in range(3):
        res, exc = attempt("rerun")
        if exc is None and res.status in ("complete", "nothing-to-do"):
            break
    else:
        trial.problems.append(f"reruns do not converge: {exc or res.message}")
        return
    clean = f"{name}_clean"
    cwork = work / "clean"
    s = _source(cwork, clean, seed, transactions=transactions)
    croot = cwork / "archive" / clean
    later = sorted(croot.glob("2026/01/01/*"))[-1]
    shutil.move(str(later), cwork / "later")
    _apply(spark, s, clean, croot)
    shutil.move(str(cwork / "later"), later)
    _apply(spark, s, clean, croot)
    if _rows(spark, s, clean) != _rows(spark, s, name):
        trial.problems.append("the tables differ from a clean source's")
    rows = [r for r in ledger.Ledger(s).batch_rows(name) if r["table_name"] == "*" and r["status"] == "complete"]
    paths = [f["path"] for r in rows for f in r["files"]]
    if len(paths) != len(set(paths)):
        trial.problems.append(f"a file is in two complete batches: {sorted(paths)}")
    for ident in (f"{name}.items", f"{name}.orders"):
        led = ledger.Ledger(s).table_ledger(ident)
        if led is not None and len(led.batches) != len(set(led.batches)):
            trial.problems.append(f"{ident}: a batch applied twice {led.batches}")


def all_faults(spark, settings, work: Path, seed: int = 5) -> list[Trial]:
    return [fault_trial(spark, settings, work / f, f, seed) for f in FAULTS]
