"""Property test: the Spark apply equals the reference model, row for row,
over random workloads, random batch splits, duplicates and reorderings.

Default example count is CI-sized; `HYPOTHESIS_EXAMPLES=200 ./dev test
tests/test_apply_property.py` runs a larger search.

Delivery rules exercised (see docs/apply-semantics.md, "Partial rows and late
events"): full row images and partial rows alike may arrive in any batch in
any order, and any event may be delivered again later.  The insert half of a
primary-key change that leaves columns out inherits them from the old key:
in log order across batches, and in any order and split as long as the old
key takes no event after its change (rule 3's documented limit).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cdc_apply.apply import tables
from cdc_apply.model import ChangeEvent, Column, Op
from tests.apply_harness import apply_events, live_rows, state_read
from tests.reference_model import apply_model

pytestmark = [pytest.mark.spark, pytest.mark.slow]
EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "6"))
COLS = {"id": "int", "name": "string", "amount": "decimal(10,2)"}
COLUMNS = [Column("id", "int", False), Column("name", "string"), Column("amount", "decimal(10,2)")]
_ns = itertools.count()

some_names = st.sampled_from(["a", "b", "ü", "x y", ""])
some_amounts = st.decimals(min_value=-99999999, max_value=99999999, places=2, allow_nan=False, allow_infinity=False).map(
    lambda d: f"{d:.2f}"
)
names = st.one_of(st.none(), some_names)
amounts = st.one_of(st.none(), some_amounts)


@st.composite
def workloads(draw, partial: bool, partial_moves: bool = False, retire_moved: bool = False):
    """``retire_moved``: the old key of a key change takes no event after it
    (the documented limit of rule 3 for out-of-order delivery: a late event
    of an old key used again after its change does not reach the new key).

    A key change's new key is never live at the change, as in every real
    source (the new key of ``UPDATE ... SET id`` cannot exist): the one
    history where the two disagree is pinned by its own test below."""
    n = draw(st.integers(min_value=1, max_value=14))
    events: list[ChangeEvent] = []
    keys = list(range(1, 7 if retire_moved else 4))
    live: set[int] = set()  # in log order: the keys a key change cannot move onto
    for seq in range(1, n + 1):
        kind = draw(st.sampled_from(["c", "u", "u", "d", "r", "pk", "t"] if partial else ["c", "u", "d", "r", "pk", "t"]))
        if len(keys) < 2:
            break
        key = draw(st.sampled_from(keys))
        pos = f"{seq * 10:020d}"
        if kind == "t":
            live.clear()
            events.append(ChangeEvent("x", "db", "public", "items", Op.TRUNCATE, [], {}, pos, columns=COLUMNS))
            continue
        if kind == "d":
            live.discard(key)
            events.append(ChangeEvent("x", "db", "public", "items", Op.DELETE, ["id"], {}, pos, before={"id": str(key)}, columns=COLUMNS))
            continue
        if kind == "pk":
            free = [k for k in keys if k != key and k not in live]
            if not free:
                continue
            new_key = draw(st.sampled_from(free))
            live.discard(key)
            live.add(new_key)
            if retire_moved:
                keys.remove(key)
            events.append(
                ChangeEvent(
                    "x", "db", "public", "items", Op.DELETE, ["id"], {}, pos, before={"id": str(key)}, columns=COLUMNS, change_id=pos
                )
            )
            after = {"id": str(new_key), "name": draw(names), "amount": draw(amounts)}
            if partial_moves:  # unchanged columns left out (a TOAST placeholder, a Qlik mask)
                for col in draw(st.sets(st.sampled_from(["name", "amount"]))):
                    after.pop(col)
            events.append(ChangeEvent("x", "db", "public", "items", Op.INSERT, ["id"], after, pos, columns=COLUMNS, change_id=pos))
            continue
        live.add(key)
        after = {"id": str(key), "name": draw(names), "amount": draw(amounts)}
        if partial and kind == "u":
            for col in draw(st.sets(st.sampled_from(["name", "amount"]))):
                after.pop(col)
        events.append(ChangeEvent("x", "db", "public", "items", Op(kind), ["id"], after, pos, columns=COLUMNS))
    seed = draw(st.integers(min_value=0, max_value=2**32))
    nbatches = draw(st.integers(min_value=1, max_value=3))
    return events, seed, nbatches


def deliver(events: list[ChangeEvent], seed: int, nbatches: int, log_order: bool) -> list[list[ChangeEvent]]:
    """Split into batches, duplicate some events, shuffle arrival order."""
    rnd = random.Random(seed)
    if log_order:  # contiguous position ranges per batch; the halves of a key change stay together
        inside_pair = {i for i in range(1, len(events)) if events[i].position == events[i - 1].position}
        allowed = [i for i in range(1, len(events)) if i not in inside_pair]
        cuts = sorted(rnd.sample(allowed, min(nbatches - 1, len(allowed))))
        batches = [events[a:b] for a, b in zip([0] + cuts, cuts + [len(events)])]
    else:
        batches = [[] for _ in range(nbatches)]
        for e in events:
            batches[rnd.randrange(nbatches)].append(e)
    out = []
    for i, batch in enumerate(batches):
        batch = list(batch)
        earlier = [e for b in batches[: i + 1] for e in b]
        for _ in range(rnd.randint(0, 2)):
            if earlier:
                batch.append(rnd.choice(earlier))  # a duplicate delivery
        rnd.shuffle(batch)
        out.append(batch)
    return out


def _applied_rows(spark, settings, ns: str) -> dict[tuple, dict]:
    """The applied table's live rows by key, every column's canonical text."""
    return {k: {c: v.get(c) for c in COLS} for k, v in live_rows(spark, settings, ns, "items", ["id"], COLS).items()}


def _model_rows(events: list[ChangeEvent]) -> dict[tuple, dict]:
    """The reference model's rows, keyed as ``_applied_rows``."""
    return {tuple(k): v for k, v in apply_model(events, ["id"], list(COLS)).items()}


MERGE_MODES = st.sampled_from(["auto", "merge-on-read"])
"""Each example's write mode: both MERGEs (rows rewritten, or position deletes) against the model."""
EXECUTIONS = st.sampled_from(["interpreted", "generated code"])
"""How Spark runs each example's batches: these small batches run interpreted
(``spark_conf.SMALL_BATCH_CONF``); a batch past 10k messages, or into a table
past 250k rows, runs generated code.  Both against the model."""


STATE_READS = st.sampled_from(["whole", "key spans"])
"""How each example's labelling reads the stored state: whole (these small
tables), or as a batch small next to a large table does (``table.PRUNE_STATE_*``,
``table.KEY_SPANS_MIN_ROWS``): the stored rows of the batch's key spans,
semi-joined with its keys.  Both against the model."""


def executed(settings, execution: str):
    """``settings`` for a batch run ``execution``'s way: generated code as the
    user's own keys, which a small batch leaves as they are."""
    if execution == "interpreted":
        return settings
    from cdc_apply.runtime import spark_conf

    return dataclasses.replace(settings, extra_spark_conf={**settings.extra_spark_conf, **spark_conf.CODEGEN_CONF})


def stamp(batches: list[list[ChangeEvent]], ns: str) -> list[list[ChangeEvent]]:
    """Give every delivery its own lineage (file, line), as an archive would."""
    import copy

    stamped = []
    for b, batch in enumerate(batches):
        rows = []
        for line, e in enumerate(batch, start=1):
            c = copy.deepcopy(e)
            c.file, c.line = f"/virtual/{ns}/batch{b}.jsonl", line
            rows.append(c)
        stamped.append(rows)
    return stamped


def check(spark, settings, events, seed, nbatches, log_order, merge_mode="auto", state="whole"):
    """``merge_mode``: the source's (``auto`` picks copy-on-write for tables
    this small; ``merge-on-read`` writes the MERGEs as position deletes);
    ``state``: how the labelling reads the stored state (``STATE_READS``)."""
    ns = f"prop_{next(_ns)}"
    batches = stamp(deliver(events, seed, nbatches, log_order), ns)
    for batch in batches:
        with state_read(state):
            result = apply_events(spark, settings, ns, batch, merge_mode=merge_mode)
        assert result.status in ("complete",), result.message
    got = _applied_rows(spark, settings, ns)
    assert got == _model_rows([e for b in batches for e in b])
    if merge_mode != "auto" and got:
        assert tables.merge_mode(spark, f"{settings.catalog_name}.{ns}.items") == merge_mode


@hsettings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads(partial=False), MERGE_MODES, EXECUTIONS, STATE_READS)
def test_full_rows_any_delivery_order(spark, settings, w, merge_mode, execution, state):
    check(spark, executed(settings, execution), *w, log_order=False, merge_mode=merge_mode, state=state)


@hsettings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads(partial=True), MERGE_MODES, EXECUTIONS, STATE_READS)
def test_partial_rows_any_delivery_order(spark, settings, w, merge_mode, execution, state):
    """A late event fills the columns later partial events left out: the
    result is the same for every delivery order and batch split."""
    check(spark, executed(settings, execution), *w, log_order=False, merge_mode=merge_mode, state=state)


@hsettings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads(partial=True, partial_moves=True), MERGE_MODES, EXECUTIONS)
def test_key_changes_inherit_what_they_leave_out(spark, settings, w, merge_mode, execution):
    check(spark, executed(settings, execution), *w, log_order=True, merge_mode=merge_mode)


@hsettings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads(partial=True, partial_moves=True, retire_moved=True), MERGE_MODES, EXECUTIONS, STATE_READS)
def test_key_changes_inherit_in_any_delivery_order(spark, settings, w, merge_mode, execution, state):
    """The halves of a key change in different batches, either first, and the
    old key's earlier events arriving after the change: the new key still
    ends with the old key's values as of just before the change."""
    check(spark, executed(settings, execution), *w, log_order=False, merge_mode=merge_mode, state=state)


def _ev(op: str, key: int, pos: int, after: dict | None = None, *, moved: bool = False) -> ChangeEvent:
    p = f"{pos:020d}"
    if op == "t":
        return ChangeEvent("x", "db", "public", "items", Op.TRUNCATE, [], {}, p, columns=COLUMNS)
    before = {"id": str(key)} if op == "d" else None
    body = {} if op == "d" else {"id": str(key), **(after or {})}
    return ChangeEvent(
        "x", "db", "public", "items", Op(op), ["id"], body, p, before=before, columns=COLUMNS, change_id=p if moved else None
    )


def test_a_late_truncate_unsets_what_a_key_change_s_old_key_fills_later(spark, settings):
    """Hypothesis found this history (seed 20000, two batches, any order):
    key 6 lives at 60, everything is truncated at 100, key 4 is inserted at
    110 and moves to 6 at 120 with an insert half that carries nothing.
    The first batch holds 6's insert at 60 and the key change, the second
    the truncate and 4's insert.  The truncate must leave 6's columns from
    60 unset, not NULL at 100, so that 4's late insert fills them through
    the key change (``merge.apply_truncate``, ``refresh_inherited``):
    6 ends as 4 was at 120."""
    events = [
        _ev("d", 1, 10),
        _ev("u", 1, 20, {"name": "a", "amount": None}),
        _ev("t", 0, 30),
        *[_ev("c", 1, p, {"name": None, "amount": None}) for p in (40, 50)],
        _ev("c", 6, 60, {"name": None, "amount": None}),
        *[_ev("c", 1, p, {"name": None, "amount": None}) for p in (70, 80, 90)],
        _ev("t", 0, 100),
        _ev("c", 4, 110, {"name": "", "amount": "8.59"}),
        _ev("d", 4, 120, moved=True),
        _ev("c", 6, 120, {}, moved=True),
        _ev("u", 2, 130, {"amount": None}),
    ]
    check(spark, settings, events, 20000, 2, log_order=False)
    assert _model_rows(events)[("6",)] == {"id": "6", "name": "", "amount": "8.59"}


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)], ids=["insert half last", "truncate last"])
def test_a_late_truncate_unsets_the_state_a_tombstone_passes_to_a_new_key(spark, settings, order):
    """Key 4 lives at 60 and is truncated at 100; an update at 110 sets its
    name, and at 120 it moves to 6 with an insert half that carries
    nothing.  Its tombstone then keeps the amount of 60, from before the
    truncate: that must be unset by the truncate like a live row's, or key
    6 takes 4's amount back from it, whether the insert half comes after the
    truncate or the truncate comes last (its batch refreshes 6 from the
    tombstone it changed, ``merge.apply_truncate``)."""
    history = [
        [_ev("c", 4, 60, {"name": "a", "amount": "1.00"}), _ev("u", 4, 110, {"name": "b"}), _ev("d", 4, 120, moved=True)],
        [_ev("t", 0, 100)],
        [_ev("c", 6, 120, {}, moved=True)],
    ]
    ns = f"prop_{next(_ns)}"
    batches = stamp([history[i] for i in order], ns)
    for batch in batches:
        assert apply_events(spark, settings, ns, batch).status == "complete"
    assert (
        _applied_rows(spark, settings, ns)
        == _model_rows([e for b in batches for e in b])
        == {("6",): {"id": "6", "name": "b", "amount": None}}
    )


def test_a_key_change_onto_a_live_key_keeps_what_neither_key_sets(spark, settings):
    """Hypothesis found this history (seed 401, one batch), which no real
    source writes: key 1 is truncated (40) and set again without ``amount``
    (70), then moves onto key 3 (120) while key 3 is still live with amount
    -184.79 (90) -- only an archive that lost key 3's delete reads so. The
    insert half leaves ``amount`` out and the old key has none to give
    (emptied by the truncate), so nothing sets it: key 3 keeps its own
    value, as any row keeps a column no event carries (rule 4). The
    reference model, written for real histories, empties it instead; the
    generator no longer moves a key onto a live one (``workloads``)."""
    events = [
        _ev("u", 1, 10, {"name": None, "amount": None}),
        _ev("d", 1, 20),
        _ev("d", 1, 30, moved=True),
        _ev("c", 2, 30, moved=True),
        _ev("t", 0, 40),
        _ev("d", 3, 50, moved=True),
        _ev("c", 2, 50, moved=True),
        _ev("d", 3, 60, moved=True),
        _ev("c", 2, 60, {"name": "x y"}, moved=True),
        _ev("u", 1, 70, {"name": None}),
        _ev("r", 3, 80, {"name": "", "amount": "-112405.45"}),
        _ev("u", 3, 90, {"name": None, "amount": "-184.79"}),
        _ev("u", 3, 100),
        _ev("u", 3, 110),
        _ev("d", 1, 120, moved=True),
        _ev("c", 3, 120, moved=True),
    ]
    ns = f"prop_{next(_ns)}"
    (batch,) = stamp([events], ns)
    assert apply_events(spark, settings, ns, batch).status == "complete"
    model = _model_rows(batch)
    assert model[("3",)]["amount"] is None
    model[("3",)]["amount"] = "-184.79"
    assert _applied_rows(spark, settings, ns) == model


@st.composite
def late_full_images(draw):
    """Histories whose full row images arrive after the partial updates that
    follow them in the log: each key begins with a full image (insert or
    snapshot read), takes partial updates (some columns left out), maybe a
    full update and a delete, maybe a new insert; the keys' events
    interleave.  Returned split by kind: the partial updates and deletes,
    and the full images, which ``test_late_full_images_fill_only_what_later_partial_events_left_out``
    delivers in a later batch than the former."""
    order: list[int] = []
    plans: dict[int, list[str]] = {}
    for key in draw(st.sets(st.integers(min_value=1, max_value=3), min_size=1)):
        plan = [draw(st.sampled_from(["c", "r"]))]
        plan += ["partial"] * draw(st.integers(min_value=1, max_value=3))
        plan += draw(st.lists(st.sampled_from(["full", "partial", "d", "c"]), max_size=3))
        plans[key] = plan
        order += [key] * len(plan)
    order = draw(st.permutations(order))  # the keys' events interleaved in the log
    partial, full = [], []
    for seq, key in enumerate(order, start=1):
        kind = plans[key].pop(0)
        if kind == "d":
            partial.append(_ev("d", key, seq * 10))
            continue
        if kind == "partial":
            after = {"name": draw(names), "amount": draw(amounts)}
            left_out = draw(st.sets(st.sampled_from(["name", "amount"]), min_size=1))
            partial.append(_ev("u", key, seq * 10, {c: v for c, v in after.items() if c not in left_out}))
        else:  # values, not NULLs: a fill shows only where a column is set
            after = {"name": draw(some_names), "amount": draw(some_amounts)}
            full.append(_ev("u" if kind == "full" else kind, key, seq * 10, after))
    return partial, full, draw(st.integers(min_value=0, max_value=2**32))


@hsettings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(late_full_images(), MERGE_MODES, EXECUTIONS)
def test_late_full_images_fill_only_what_later_partial_events_left_out(spark, settings, w, merge_mode, execution):
    """A full row image delivered after later partial updates of its key (and
    after its later deletes) sets only the columns no later event set: the
    stored row keeps each column's newest value, a deleted key stays
    deleted.  The partial events come in the first batch, the full images
    in the second, beside some of the first batch's events delivered again;
    the result must be the model's (every event in log order)."""
    partial, full, seed = w
    rnd = random.Random(seed)
    late = full + rnd.sample(partial, rnd.randint(0, min(2, len(partial))))
    rnd.shuffle(late)
    ns = f"prop_{next(_ns)}"
    batches = stamp([partial, late], ns)
    for batch in batches:
        if batch:
            result = apply_events(spark, executed(settings, execution), ns, batch, merge_mode=merge_mode)
            assert result.status == "complete", result.message
    assert _applied_rows(spark, settings, ns) == _model_rows([e for b in batches for e in b])
