"""The nemesis in CI (issue 18): a small sample of every kind, so the harness
cannot rot.  The long run is one command: ``python -m tests.nemesis --help``
(README, "Reliability").  Each trial compares what a real run left with a
clean run (``tests/nemesis/state.py``)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _environment_restored():
    """The in-process kinds point CDC_SOURCES_FILE at their own work folders:
    the tests after these must read the project's sources file again."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _ok(trial) -> None:
    print(trial.line())
    assert trial.passed, trial.line()


# -- kill -9 and races: real `cdc apply` processes on a state folder of their own ------------------


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The workload applied once cleanly, as one batch (two in the long run)."""
    from tests.nemesis.baseline import prepare

    return prepare(tmp_path_factory.mktemp("nemesis"), seed=18, split=False)


def test_the_clean_run_ends_holding_the_transaction_that_never_ends(baseline):
    """The workload's last transaction has no END marker: the clean run, and so
    every trial that must equal it, ends with a file whose lines are held (in
    no table's applied files), so kills and races reach the held files' paths."""
    archive = {str(p) for p in baseline.folder.archive.rglob("part-*")}
    applied = set().union(*(files.keys() for files in baseline.expected["files"].values()))
    assert applied < archive, (sorted(archive), sorted(applied))


@pytest.mark.full  # CI's sample: the DAG's publish killed below, and test_probe_apply.py's kills at fixed points
def test_kill_9_of_the_cli_at_a_random_instant_then_rerun_equals_the_clean_run(baseline):
    from tests.nemesis import kills

    delay = random.Random(18).uniform(0.3, 0.9) * baseline.seconds["all"]
    _ok(kills.cli_trial(baseline, "all", delay=delay))


def test_kill_9_of_the_dags_publish_after_its_fast_forward_then_retry_equals_the_clean_run(baseline):
    """The DAG's staged path (write, validate, publish, finish as processes); the
    publish task is killed right after its fast-forward commit and retried."""
    from tests.nemesis import kills

    trial = kills.staged_trial(baseline, "all", "publish", point="fast-forwarded", per_table=False)
    _ok(trial)
    assert trial.figures["killed"] == 1, trial.line()


@pytest.mark.full  # CI's sample: test_probe_concurrency.py's two applies of one batch at once
def test_two_applies_of_one_batch_at_once_converge(baseline):
    from tests.nemesis import races

    _ok(races.race_trial(baseline, "two-applies", "all"))


def test_hostile_messages_of_every_format_are_accounted_for(spark, settings, tmp_path):
    from tests.nemesis import hostile

    rnd = random.Random(18)
    for fmt in hostile.FORMATS:
        # CockroachDB too: a mutated message that lost its table or HLC is quarantined as damaged
        # (the other messages of its file carry them), no longer a refusal of the whole batch
        _ok(hostile.format_trial(spark, tmp_path, fmt, rnd.randrange(2**31), mutations=60))


def test_hostile_identifiers_are_refused_or_stored_exactly_and_inject_nothing(spark, settings, tmp_path):
    from tests.nemesis import identifiers

    # a CI sample (one batch per name and role, ~30 s each): injection, a quote and a dot;
    # the long run (`python -m tests.nemesis --kinds identifiers`) tries every hostile name
    names = ["x; DROP TABLE {victim}", "a`b", "a.b"]
    trial = identifiers.identifier_trial(spark, settings, tmp_path, seed=18, names=names)
    _ok(trial)
    assert trial.figures["identifiers"] == len(names) * len(identifiers.ROLES)


@pytest.mark.parametrize(
    "fault",
    # CI's sample: the redelivery (the one whose failure would double rows); the long run tries every kind
    [
        pytest.param("rewrite-new-size", marks=pytest.mark.full),
        "redelivered",
        pytest.param("catalog-locked", marks=pytest.mark.full),
        pytest.param("held-deleted", marks=pytest.mark.full),  # CI: test_transactions.py's held file gone
        pytest.param("held-rewritten", marks=pytest.mark.full),
    ],
)
def test_file_faults_are_refused_loudly_or_idempotent(spark, settings, tmp_path, fault):
    from tests.nemesis import faults

    _ok(faults.fault_trial(spark, settings, tmp_path, fault))


# -- the quoting of every identifier that reaches SQL (hypothesis) ------------------------------

NAMES = st.one_of(
    st.sampled_from(["a'b", 'a"b', "a`b", "``", "x;y", "a.b", "a b", "ключ", "x" * 300, "x; DROP TABLE t", "a\\b", "'); DROP TABLE t; --"]),
    st.text(alphabet=st.sampled_from(list("'\"`;.,\\ ()[]{}=-*/aé漢\u2028\u202e")), min_size=1, max_size=60),
    st.text(min_size=1, max_size=40),
)


@hsettings(max_examples=80, deadline=None)
@given(NAMES)
def test_every_identifier_that_reaches_sql_is_quoted_or_refused(spark, name):
    """A column name validate_column accepts is, through compact.quote, read
    back by Spark as exactly itself; a string through tables.sql_string too;
    config.validate_identifier accepts only plain names (letters, digits, _)."""
    import re

    from cdc_apply.apply.compact import quote
    from cdc_apply.apply.tables import sql_string, validate_column
    from cdc_apply.config import validate_identifier
    from cdc_apply.errors import ConfigError

    assert spark.sql(f"SELECT {sql_string(name)} AS v").collect()[0]["v"] == name
    try:
        validate_column(name, "t")
    except ConfigError:
        pass
    else:
        assert spark.sql(f"SELECT 1 AS {quote(name)}").columns == [name]
    try:
        validate_identifier(name, "table")
    except ConfigError:
        pass
    else:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", name), name


def test_a_kill_that_never_landed_is_void_not_a_pass():
    """A kill trial whose armed run ended before its kill point tested
    nothing: reported VOID and not counted among the kills that passed."""
    from tests.nemesis.trial import Trial

    void = Trial("kill", "publish@fast-forwarded", figures={"killed": 0})
    landed = Trial("kill", "publish@fast-forwarded", figures={"killed": 1})
    assert void.void and void.line().startswith("VOID")
    assert not landed.void and landed.line().startswith("PASS")
    assert Trial("kill", "x", problems=["differs"], figures={"killed": 0}).line().startswith("FAIL")
