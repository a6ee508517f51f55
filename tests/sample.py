"""How much of the longest tests a run takes: CI's sample (the default) or
everything (``CDC_TEST_FULL=1 ./dev test``).

CI has to finish on a 2-core machine whose speed varies by ~2x from day to
day (the same suite took 45 and 100 minutes), so the few tests that repeat
what another test already proves run whole only when asked.  A test or
variant of the full suite carries the ``full`` marker (``tests/conftest.py``
skips it in the sample): the DAG on two more ways of reaching Spark, two of
the nemesis's three file faults.  Others take ``FULL`` for their size: the
benchmark's sections that only time things (their code runs in CI through
the sections kept), the reconciliation property test's examples past the
first 12."""

from __future__ import annotations

import os

FULL = os.environ.get("CDC_TEST_FULL", "") == "1"
