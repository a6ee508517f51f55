"""Run notes: every finished cdc_apply run says what it did in its note (the
UI shows it on the run), so a forced publish, a nothing-to-do hour and a real
apply no longer look alike: "applied 6 change(s) to 1 table(s)", "nothing to
do: ...", "... - forced publish: <reason>", "FAILED: ...".

A listener of the scheduler (plugin.py): tasks cannot write a run's note, the
scheduler can, with its own database session, when the run finishes.  The
note is built from discover's XCom (the result file's path, or its error)
and the batch result file (guidance.headline).  A note a person wrote is
kept."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from airflow.listeners import hookimpl

from cdc_airflow.guidance import DAG_ID, headline

log = logging.getLogger(__name__)


def _xcom(dag_run, task_id: str, key: str = "return_value") -> Any:
    """A task's XCom of this run, read in the scheduler's own session."""
    import contextlib

    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy.orm import object_session

    session = object_session(dag_run)
    with contextlib.nullcontext(session) if session is not None else create_session() as s:
        row = s.scalars(XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=task_id, key=key)).first()
        return None if row is None else XComModel.deserialize_value(row)


def run_note(found: dict[str, Any] | None, error: str | None, waiting_for: str | None = None) -> str:
    if error:
        return f"FAILED in discover: {error.splitlines()[0]}"[:1000]
    if not found and waiting_for:
        return f"FAILED waiting for the source's turn (task turn): it was still held by {waiting_for}"[:1000]
    if not found:
        return "FAILED before discover finished: see its log"
    path = Path(found.get("result_file") or "")
    if not path.is_file():
        return f"FAILED: no batch result ({found.get('files')} file(s) discovered): see the apply task's log"
    from cdc_apply.results import load_result

    return headline(json.loads(load_result(path).to_json()))[:1000]


def _set_note(dag_run) -> None:
    if dag_run.dag_id != DAG_ID or dag_run.note:
        return
    try:
        found, error = _xcom(dag_run, "discover"), _xcom(dag_run, "discover", "error")
        waiting = None if found or error else _xcom(dag_run, "turn", "waiting_for")  # a run that never got its turn
        dag_run.note = run_note(found, error, waiting)
    except Exception:  # a note is a courtesy: never fail the scheduler's loop for it
        log.exception("could not write the note of %s", dag_run.run_id)


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:
    _set_note(dag_run)


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:
    _set_note(dag_run)
