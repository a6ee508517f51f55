"""The reference model of the apply semantics: apply canonical events one at a
time, in (position, file, line) order, to a dict.  Deliberately naive: this is
the definition the Spark apply is checked against, whatever order and batch
split the events were delivered in.

Rules it states (docs/apply-semantics.md):
* same key and position, same content: one event delivered twice (once);
* an insert that shares its ``change_id`` with a delete of another key is the
  new half of a primary-key change: the columns it does not carry are the
  old key's values just before the change.
"""

from __future__ import annotations

from cdc_apply.model import ChangeEvent, Op


def event_key(e: ChangeEvent, key_cols: list[str]) -> tuple:
    image = (e.before or {}) if e.op == Op.DELETE else (e.after or {})
    other = (e.after or {}) if e.op == Op.DELETE else (e.before or {})
    return tuple(image.get(k, other.get(k)) for k in key_cols)


def apply_model(events: list[ChangeEvent], key_cols: list[str], columns: list[str]) -> dict[tuple, dict[str, str | None]]:
    """Live rows by key, values as canonical text (None = NULL)."""
    return _replay(events, key_cols, columns, [])


def history_model(events: list[ChangeEvent], key_cols: list[str], columns: list[str]) -> list[dict]:
    """SCD type 2 history: every version of every key, in the order opened:
    ``key``, ``values`` (the row), ``valid_from`` / ``valid_to`` (positions;
    ``valid_to`` None while current), ``op`` (that opened it), ``closed_by``
    (the op that closed it: a newer version's, ``d`` or ``t``; None while current)."""
    versions: list[dict] = []
    _replay(events, key_cols, columns, versions)
    return versions


def _replay(events: list[ChangeEvent], key_cols: list[str], columns: list[str], versions: list[dict]) -> dict[tuple, dict[str, str | None]]:
    rows: dict[tuple, dict[str, str | None]] = {}
    current: dict[tuple, dict] = {}  # key -> its open version

    def close(k: tuple, e: ChangeEvent) -> None:
        if k in current:
            current.pop(k).update(valid_to=e.position, closed_by=e.op.value)

    seen: set[tuple] = set()
    old_key_of = {e.change_id: event_key(e, key_cols) for e in events if e.op == Op.DELETE and e.change_id is not None}
    before_move: dict[str, dict[str, str | None] | None] = {}
    for e in sorted(events, key=lambda e: (e.position, e.file, e.line)):
        if e.op == Op.TRUNCATE:
            rows.clear()
            for k in list(current):
                close(k, e)
            continue
        k = event_key(e, key_cols)
        if (k, e.position) in seen:  # the same event delivered again
            continue
        seen.add((k, e.position))
        if e.op == Op.DELETE:
            if e.change_id is not None:
                before_move[e.change_id] = rows.get(k)
            rows.pop(k, None)
            close(k, e)
            continue
        row = dict(rows.get(k) or dict.fromkeys(columns))
        old = old_key_of.get(e.change_id) if e.change_id is not None else None
        if old is not None and old != k:  # the new half of a primary-key change
            moved = before_move[e.change_id] if e.change_id in before_move else rows.get(old)
            row.update({c: v for c, v in (moved or {}).items() if c not in key_cols})
        row.update(e.after or {})  # columns not present keep the row's value
        rows[k] = row
        close(k, e)
        current[k] = {"key": k, "values": dict(row), "valid_from": e.position, "valid_to": None, "op": e.op.value, "closed_by": None}
        versions.append(current[k])
    return rows
