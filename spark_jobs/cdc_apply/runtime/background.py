"""Spark work on a thread of its own, beside the batch's main line.

A batch is a chain of small Spark statements, each leaving cores idle while
the driver plans the next; two independent ones (the change log's append and
the table's labelling) overlap on two threads of one session.  The thread is
PySpark's ``InheritableThread``: it carries the session's local properties
(classic) or tags (Spark Connect) and releases its JVM thread when done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from pyspark.sql import SparkSession
from pyspark.util import InheritableThread

T = TypeVar("T")


class Background(Generic[T]):
    """``fn()`` started now on its own thread; ``result()`` waits for it and
    returns its value or raises its error, as if it had run there."""

    def __init__(self, spark: SparkSession, fn: Callable[[], T], name: str) -> None:
        self._fn = fn
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = InheritableThread(self._run, session=spark, name=name)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # handed to result()'s caller
            self._error = exc

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def wait(self) -> None:
        """Wait for it to end, whatever its outcome (a caller already failing
        must not leave it writing)."""
        self._thread.join()
