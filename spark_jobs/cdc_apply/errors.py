"""Domain errors. *Terminal* errors are about data or configuration: retrying
cannot help, so Airflow must not retry them. Anything else is transient."""


class CdcError(Exception):
    """Root of the project's errors."""


class SparkUnavailable(CdcError):
    """The Spark Connect server did not answer: transient (it may be
    restarting), so the task is retried."""


class TerminalError(CdcError):
    """Retrying will not help: an operator must fix data, suite or config."""


class ConfigError(TerminalError):
    """The configuration is wrong; the message says what to fix."""


class AlreadyAppliedFileChanged(TerminalError):
    """A file that was applied before has different content now."""


class GateFailed(TerminalError):
    """The batch failed its quality gate; main is untouched, the branch is kept."""

    def __init__(self, message: str, failed: list[str], branch: str) -> None:
        super().__init__(message)
        self.failed = failed
        self.branch = branch


class SchemaIncompatible(TerminalError):
    """A source schema change cannot be applied safely (narrowing, key change)."""


class ArchiveUnreadable(CdcError):
    """An archive folder or file could not be listed or read (permissions, a
    storage fault): transient, and the run fails rather than apply a shorter
    file list — a skipped folder would be a silent loss."""


class ConcurrentApply(CdcError):
    """Another run is applying the same batch (its audit branch or commit won
    the race, Iceberg's optimistic concurrency): transient, retry later."""


class UnreadableCompression(ConfigError):
    """An archive file is compressed in a way the reader does not read (not
    gzip or zstd): terminal, the sink's configuration must change."""
