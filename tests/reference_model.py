"""The reference model of the apply semantics: apply canonical events one at a
time, in (position, file, line) order, to a dict.  Deliberately naive: this is
the definition the Spark apply is checked against."""

from __future__ import annotations

from cdc_apply.model import ChangeEvent, Op


def event_key(e: ChangeEvent, key_cols: list[str]) -> tuple:
    image = (e.before or {}) if e.op == Op.DELETE else (e.after or {})
    other = (e.after or {}) if e.op == Op.DELETE else (e.before or {})
    return tuple(image.get(k, other.get(k)) for k in key_cols)


def apply_model(events: list[ChangeEvent], key_cols: list[str], columns: list[str]) -> dict[tuple, dict[str, str | None]]:
    """Live rows by key, values as canonical text (None = NULL)."""
    rows: dict[tuple, dict[str, str | None]] = {}
    seen: set[tuple] = set()
    for e in sorted(events, key=lambda e: (e.position, e.file, e.line)):
        if e.op == Op.TRUNCATE:
            rows.clear()
            continue
        k = event_key(e, key_cols)
        if (k, e.position) in seen:  # the same event delivered again
            continue
        seen.add((k, e.position))
        if e.op == Op.DELETE:
            rows.pop(k, None)
            continue
        row = dict(rows.get(k) or dict.fromkeys(columns))
        row.update(e.after or {})  # columns not present keep the row's value
        rows[k] = row
    return rows
