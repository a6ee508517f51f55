"""The held-file record (``cdc_apply.apply.held``): pure parts, no Spark.  The
apply across batches is tested in ``tests/test_ces_qlik_apply.py``."""

from __future__ import annotations

import datetime as dt

import pytest

from cdc_apply.apply.held import HELD_KEY, carry, line_ranges, prior_in_batch
from cdc_apply.archive.files import ArchiveFile
from cdc_apply.errors import AlreadyAppliedFileChanged


def f(path: str, sha: str = "a" * 64) -> ArchiveFile:
    return ArchiveFile(hour=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), path=path, size=1, sha256=sha)


def test_line_ranges() -> None:
    assert line_ranges([]) == []
    assert line_ranges([5, 1, 2, 3, 9, 10, 3]) == [[1, 3], [5, 5], [9, 10]]


def test_carry_replaces_the_record_of_files_read_and_keeps_the_others() -> None:
    state = {HELD_KEY: {"/a": {"sha256": "x", "lines": [[2, 2]]}, "/b": {"sha256": "y", "lines": [[1, 4]]}}}
    # /a re-read and fully released, /b not in this batch, /c newly held
    out = carry(state, [f("/a"), f("/c", "c" * 64)], {"/c": [7, 8]}, now="2026-01-01T05:00:00+00:00")
    assert out == {
        "/b": {"sha256": "y", "lines": [[1, 4]]},
        "/c": {"sha256": "c" * 64, "lines": [[7, 8]], "since": "2026-01-01T05:00:00+00:00"},
    }
    assert carry({}, [f("/a")], {}) == {}
    # held again by a later batch: since when it has been held stays the first batch's
    again = carry({HELD_KEY: out}, [f("/c", "c" * 64)], {"/c": [8]}, now="2026-01-01T09:00:00+00:00")
    assert again["/c"] == {"sha256": "c" * 64, "lines": [[8, 8]], "since": "2026-01-01T05:00:00+00:00"}


def test_prior_in_batch_and_a_changed_held_file_is_refused() -> None:
    state = {HELD_KEY: {"/a": {"sha256": "a" * 64, "lines": [[2, 2]]}}}
    assert prior_in_batch(state, [f("/a"), f("/z")]) == {"/a": {"sha256": "a" * 64, "lines": [[2, 2]]}}
    assert prior_in_batch({}, [f("/a")]) == {}
    with pytest.raises(AlreadyAppliedFileChanged, match="held"):
        prior_in_batch(state, [f("/a", "b" * 64)])
