"""Issue 23 probe #11: an ``op`` (``operation``) given as a list or an object
is quarantined with a reason naming the field, in every decoder — never a
raw ``TypeError: unhashable type``."""

from __future__ import annotations

import datetime as dt
import importlib
import json

import pytest

from cdc_apply.decode import make_decoder
from cdc_apply.decode.base import DecodeContext, decode_all
from cdc_apply.model import Quarantined, RawMessage
from tests.formats.synthetic import SyntheticChange

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
FORMATS = [
    ("debezium_postgres", {}),
    ("debezium_sqlserver", {}),
    ("sqlserver_ces", {}),
    ("qlik", {}),
    ("cockroachdb", {"envelope": "enriched"}),
]
OP_FIELDS = ("op", "operation")


def _set_op(obj, bad) -> bool:
    """Replace the first op / operation field found (depth first) with ``bad``."""
    if isinstance(obj, dict):
        for k in list(obj):
            if k in OP_FIELDS and isinstance(obj[k], str):
                obj[k] = bad
                return True
        for k, v in obj.items():
            if isinstance(v, str) and v.startswith("{"):  # a JSON document inside a string (CockroachDB's value)
                inner = json.loads(v)
                if _set_op(inner, bad):
                    obj[k] = json.dumps(inner)
                    return True
            elif _set_op(v, bad):
                return True
        return False
    if isinstance(obj, list):
        return any(_set_op(v, bad) for v in obj)
    return False


@pytest.mark.parametrize("bad", [["c"], {"op": "c"}], ids=["list", "object"])
@pytest.mark.parametrize("fmt, kwargs", FORMATS, ids=[f for f, _ in FORMATS])
def test_op_of_the_wrong_json_type_is_quarantined_naming_the_field(fmt, kwargs, bad):
    writer = importlib.import_module(f"tests.formats.write_{fmt}")
    change = SyntheticChange(
        op="c", key={"id": 1}, after={"id": 1, "name": "a", "amount": None, "updated_at": None}, before=None, seq=1, tx=1, commit_ts=T0
    )
    lines = writer.write_messages([change], **kwargs)
    obj = json.loads(lines[-1])
    assert _set_op(obj, bad), f"no op field found in a {fmt} message"
    lines[-1] = json.dumps(obj)
    outcomes = list(
        decode_all(
            make_decoder(fmt, DecodeContext(source="s", primary_keys={"items": ["id"]})),
            [RawMessage("f", i, t) for i, t in enumerate(lines, 1)],
        )
    )
    bad_out = [o for o in outcomes if o.line == len(lines)]
    assert len(bad_out) == 1 and isinstance(bad_out[0], Quarantined), outcomes
    reason = bad_out[0].reason
    assert "unhashable" not in reason and ("'op'" in reason or "operation" in reason), reason
