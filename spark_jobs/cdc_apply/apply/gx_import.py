"""Great Expectations' import, without the two libraries the gate rarely uses.

Importing GX imports every core expectation, and one of them (the KL
divergence) imports ``altair`` and ``scipy.stats`` at module level: ~0.8 s of
the ~2.4 s import, paid by every batch, for charts and statistics only that
expectation (and GX's KS-test metrics) use.  ``import_great_expectations``
imports GX with those two libraries deferred (``importlib.util.LazyLoader``):
each is loaded on first use of one of its attributes.  Python 3.11's lazy
module is not safe to load from two threads at once, so the gate loads them
itself, under a lock, before it runs a user suite (``load_deferred``); the
generated suites never touch them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

DEFERRED = ("altair", "scipy.stats")
_lock = threading.Lock()


class _DeferredFinder(importlib.abc.MetaPathFinder):
    """Finds the ``DEFERRED`` modules through the other finders and hands
    them back with a lazy loader."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in DEFERRED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = importlib.util.LazyLoader(spec.loader)
                return spec
        return None


def import_great_expectations() -> Any:
    """``great_expectations`` with its expectation registry loaded; the
    ``DEFERRED`` libraries, when not imported yet, are left until used."""
    with _lock:
        if not any(isinstance(f, _DeferredFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _DeferredFinder())
    import great_expectations
    from great_expectations.expectations import registry  # noqa: F401

    return great_expectations


def load_deferred() -> None:
    """Load the deferred libraries now, one thread at a time (a lazy module
    loads on its first attribute access)."""
    with _lock:
        for name in DEFERRED:
            _ = importlib.import_module(name).__name__  # the first attribute read loads it
