"""Where a batch, or one table of it, stands.

A ``StrEnum``: result files, ledger rows and XComs keep the plain text
(``"complete"``), and text read back from them compares equal to a member."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    # a batch
    COMPLETE = "complete"
    """every table published (or skipped): the batch's files are applied"""
    NOTHING_TO_DO = "nothing-to-do"
    DRY_RUN = "dry-run"
    SKIPPED = "skipped"
    """an operator's skip (a batch), or nothing left to apply (a table)"""
    FAILED = "failed"
    # a table, stage by stage
    WRITTEN = "written"
    """MERGEd onto its audit branch"""
    VALIDATED = "validated"
    """passed the gate (or forced through it)"""
    PUBLISHED = "published"
    """main fast-forwarded to the audit branch"""
    REFUSED = "refused"
    """no valid target: its messages quarantined"""
    FORCED = "forced"
    """(ledger rows) published by an operator's force"""
