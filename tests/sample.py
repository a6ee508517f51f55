"""How much of the longest tests a run takes: CI's sample (the default) or
everything (``CDC_TEST_FULL=1 ./dev test``).

CI has to finish on a 2-core machine whose speed varies by ~2x from day to
day (the same suite took 45 and 100 minutes), so the few tests that repeat
what another test already proves run whole only when asked: the DAG on a
third way of reaching Spark, the benchmark's sections that only time things
(their code runs in CI through the sections kept), the reconciliation
property test's examples past the first 12."""

from __future__ import annotations

import os

FULL = os.environ.get("CDC_TEST_FULL", "") == "1"
