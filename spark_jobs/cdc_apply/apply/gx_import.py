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

It also keeps the Data Docs' compiled page templates for the process
(``share_compiled_templates``).
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
_shared_templates: list[Any] = []
"""the process's one cache of compiled Data Docs templates, once made"""


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

    share_compiled_templates()
    return great_expectations


def share_compiled_templates() -> None:
    """Every Data Docs page view of the process shares one cache of compiled
    templates (a Jinja bytecode cache, Jinja's own extension point).

    GX gives each page view a Jinja environment of its own, and each
    environment compiles the ~50 templates of a page again: ~0.4-0.7 s of a
    small batch's gate, every batch (bench/README, issue 20 step 40).  The
    cache keeps the compiled code by template name and source checksum, so a
    changed template compiles anew; the views' filters are their own, looked
    up as each page renders."""
    import jinja2
    from great_expectations.render.view.view import DefaultJinjaView

    class CompiledTemplates(jinja2.BytecodeCache):
        def __init__(self) -> None:
            self.code: dict[str, bytes] = {}

        def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
            code = self.code.get(bucket.key)
            if code is not None:
                bucket.bytecode_from_string(code)  # checks the source checksum: a stale one is not used

        def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
            self.code[bucket.key] = bucket.bytecode_to_string()

    with _lock:
        if _shared_templates:
            return
        cache = CompiledTemplates()
        own_init = DefaultJinjaView.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            own_init(self, *args, **kwargs)
            self.env.bytecode_cache = cache

        DefaultJinjaView.__init__ = init  # type: ignore[method-assign]
        _shared_templates.append(cache)


def load_deferred() -> None:
    """Load the deferred libraries now, one thread at a time (a lazy module
    loads on its first attribute access)."""
    with _lock:
        for name in DEFERRED:
            _ = importlib.import_module(name).__name__  # the first attribute read loads it
