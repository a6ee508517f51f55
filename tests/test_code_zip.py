"""The code zip that Python workers import cdc_apply from: DAG tasks of several
sources start at once on one host (docker-compose runs them all in the
scheduler's container) and build it into the same folder."""

from __future__ import annotations

import multiprocessing
import zipfile
from pathlib import Path

from cdc_apply.runtime.code_zip import build_code_zip

WRITERS = 8


def _build(barrier, dest: str, results) -> None:
    barrier.wait()
    try:
        results.put(("ok", build_code_zip(Path(dest))))
    except BaseException as e:  # reported to the test, which names it
        results.put(("error", repr(e)))


def test_tasks_starting_at_once_all_get_a_whole_zip(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(WRITERS), ctx.Queue()
    procs = [ctx.Process(target=_build, args=(barrier, str(tmp_path), results)) for _ in range(WRITERS)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [o for o in outcomes if o[0] != "ok"] == []
    paths = {o[1] for o in outcomes}
    assert len(paths) == 1
    with zipfile.ZipFile(paths.pop()) as z:
        assert z.testzip() is None
        assert "cdc_apply/runtime/code_zip.py" in z.namelist()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".zip"]  # no temporary file left behind
