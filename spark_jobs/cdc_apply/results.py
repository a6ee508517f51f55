"""What a batch did, stage by stage, as JSON that survives between processes.

The write stage (one Spark job per source: decode once, MERGE each table onto
its audit branch) writes the batch result file.  The gate then runs *per
table* (the DAG maps validate -> publish over the written tables), and each
table's later stages write their own file next to it, so concurrent tables
never write the same file; :func:`load_result` folds them back together for
the finish stage, which records the ledger.

Also here: the operator override of a failing batch (force / skip), which is
carried in the result so that every stage sees it and the ledger records it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cdc_apply.config import operator_name
from cdc_apply.errors import CdcError, ConfigError
from cdc_apply.status import Status

OVERRIDE_ACTIONS = ("force", "skip")


@dataclass(frozen=True)
class Override:
    """An explicit, logged operator decision about a batch that fails its gate.

    * ``force``: publish even though checks failed (the quarantine share, GX
      expectations, reconciliation); the failed checks stay in the ledger.
    * ``skip``: do not apply the batch's files at all, but mark them applied
      so that later batches go on.
    """

    action: str
    reason: str
    operator: str

    @classmethod
    def parse(cls, action: str | None, reason: str | None, operator: str | None = None) -> Override | None:
        if not action or action == "none":
            return None
        if action not in OVERRIDE_ACTIONS:
            raise ConfigError(f"override {action!r} is not one of none, {', '.join(OVERRIDE_ACTIONS)}")
        if not (reason or "").strip():
            raise ConfigError(f"override {action!r} needs a reason (--override-reason / the override_reason param): it goes to the ledger")
        return cls(action=action, reason=(reason or "").strip(), operator=(operator or operator_name()).strip())

    def describe(self) -> str:
        return f"{self.action.upper()} by {self.operator}: {self.reason}"


@dataclass
class TableResult:
    table: str
    status: str  # written -> validated -> published | skipped | failed | dry-run
    counts: dict[str, int] = field(default_factory=dict)
    snapshot_id: int | None = None
    branch: str | None = None
    failed_expectations: list[str] = field(default_factory=list)
    data_docs: str | None = None
    message: str | None = None
    schema_changes: list[str] = field(default_factory=list)
    position_min: str | None = None
    position_max: str | None = None
    terminal: bool = True
    key_columns: list[str] = field(default_factory=list)
    override: str | None = None  # set when an operator forced this table past failed checks
    branch_snapshot: int | None = None  # the audit branch head this attempt wrote: validated and published only if still the head
    changelog: str | None = None  # the table's change log written on the same audit branch (apply/changelog.py)
    changelog_snapshot: int | None = None  # its branch head, published before the table
    history: str | None = None  # the table's SCD2 history written on the same audit branch (apply/history.py)
    history_snapshot: int | None = None  # its branch head, published after the change log, before the table
    gate: str | None = None
    """The gate's verdict once it ran (``passed`` / ``failed`` / ``forced``): the
    write job may run it (``--stage write+validate``), and the DAG's validate
    task then reports it instead of starting Spark again."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds of this table's phases (change log, label, merge, reconcile, gate, ...): where a slow batch went."""

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to ``seconds[phase]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = round(self.seconds.get(phase, 0.0) + time.perf_counter() - t0, 3)

    def describe_seconds(self) -> str:
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())

    @property
    def audit_branch(self) -> str:
        """The audit branch of a written table (every stage after ``write``)."""
        if self.branch is None:
            raise CdcError(f"{self.table}: status {self.status} but no audit branch in the result (a result file from another version?)")
        return self.branch


@dataclass
class BatchResult:
    batch_id: str | None
    source: str
    status: str  # complete | nothing-to-do | failed | dry-run | skipped
    files: list[dict] = field(default_factory=list)
    messages: dict[str, int] = field(default_factory=dict)
    tables: list[TableResult] = field(default_factory=list)
    message: str | None = None
    seconds: float = 0.0
    stage: str | None = None
    held_files: list[str] = field(default_factory=list)
    source_state: dict[str, Any] = field(default_factory=dict)
    started_at: str | None = None
    failed_checks: list[str] = field(default_factory=list)  # batch-wide checks (quarantine share)
    override: dict | None = None  # Override as a dict
    publish_groups: list[list[str]] = field(default_factory=list)
    """Tables that shared source transactions in the batch (``publish: transactions``): each group publishes whole."""

    @property
    def terminal(self) -> bool:
        return all(t.terminal for t in self.tables if t.status == Status.FAILED)

    def get_override(self) -> Override | None:
        return Override(**self.override) if self.override else None

    @property
    def id(self) -> str:
        """The batch id of a result with files (only nothing-to-do has none)."""
        if self.batch_id is None:
            raise CdcError(f"a {self.status} result of source {self.source} has no batch id")
        return self.batch_id

    def describe_override(self) -> str:
        override = self.get_override()
        return override.describe() if override else "no override"

    def table(self, name: str) -> TableResult:
        for t in self.tables:
            if t.table == name:
                return t
        raise ConfigError(f"batch {self.batch_id} has no table {name!r}; its tables: {[t.table for t in self.tables]}")

    def to_json(self) -> str:
        data = asdict(self)
        data["tables"] = [ids_as_strings(t) for t in data["tables"]]
        return json.dumps(data, default=str, indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> BatchResult:
        data = json.loads(text)
        data["tables"] = [table_from_dict(t) for t in data.get("tables", [])]
        return cls(**data)

    def pending(self, status: str) -> bool:
        """Some table waits for the next stage (the others' failures do not stop it)."""
        return any(t.status == status for t in self.tables)

    def fail_if_any(self) -> None:
        failed = [t for t in self.tables if t.status == Status.FAILED]
        if failed:
            self.status = Status.FAILED
            self.message = "; ".join(f"{t.table}: {t.message}" for t in failed)


_EXCEPTION_PREFIX = re.compile(r"^\s*(?:[A-Za-z_][A-Za-z0-9_.]*(?:Error|Exception)\s*:\s*)+")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|\([^)]*\)|\[[^\]]*\]|\{[^}]*\}")


def reason_class(reason: str | None) -> str:
    """A short, stable class of a quarantine (skip, hold) reason for the
    batch result's ``messages`` keys, e.g. ``invalid-json``: the text before
    its first ':' without exception names, quoted values, brackets and
    numbers.  The full reason stays in the quarantine row: keyed by the
    detail, one batch gave ~925 distinct keys (offsets, values)."""
    text = _EXCEPTION_PREFIX.sub("", reason or "")
    head = _QUOTED.sub(" ", text.split(":", 1)[0])
    words = re.findall(r"[a-z][a-z0-9_-]*", re.sub(r"\d+", " ", head.lower()).replace("utf- ", "utf-8 "))
    if not words:  # e.g. "KeyError: 'op'": the exception's name is the class
        words = re.findall(r"[a-z][a-z0-9_]*", (reason or "").split(":", 1)[0].lower())
    return "-".join(words[:8])[:60] or "other"


# -- files ----------------------------------------------------------------------

ID_FIELDS = ("snapshot_id", "branch_snapshot", "changelog_snapshot", "history_snapshot")
"""64-bit Iceberg ids: written as strings (a browser's JSON, e.g. Airflow's UI,
rounds numbers above 2**53 to an id that does not exist), read back as int."""


def ids_as_strings(table: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if k in ID_FIELDS and v is not None else v) for k, v in table.items()}


def table_from_dict(data: dict[str, Any]) -> TableResult:
    fields: dict[str, Any] = {k: (int(v) if k in ID_FIELDS and v is not None else v) for k, v in data.items()}
    return TableResult(**fields)


def table_result_path(result_file: str | Path, table: str) -> Path:
    """``result.json`` -> ``result.<table>.json`` (one writer per table)."""
    path = Path(result_file)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", table)
    return path.with_name(f"{path.stem}.{safe}{path.suffix or '.json'}")


def save_result(result_file: str | Path, result: BatchResult) -> None:
    path = Path(result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(result.to_json())
    tmp.replace(path)


def save_table_result(result_file: str | Path, table: TableResult) -> None:
    path = table_result_path(result_file, table.table)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ids_as_strings(asdict(table)), default=str, indent=2))
    tmp.replace(path)


def load_result(result_file: str | Path) -> BatchResult:
    """The write stage's result with every table's later stages folded in."""
    path = Path(result_file)
    if not path.exists():
        raise ConfigError(f"no batch result at {path}: run the write stage first")
    result = BatchResult.from_json(path.read_text())
    for i, t in enumerate(result.tables):
        per_table = table_result_path(path, t.table)
        if per_table.exists():
            result.tables[i] = table_from_dict(json.loads(per_table.read_text()))
    return result
