"""Nemesis finding (issue 18): a message nested 10,000 levels deep made the
CockroachDB decoder's exact JSON re-read (the stdlib parser, after orjson
refuses depth > 1024) raise RecursionError, and the whole batch died with a
traceback.  Every decoder quarantines it, naming the depth, on the executor
path and the driver path alike."""

from __future__ import annotations

import importlib

import pytest

from cdc_apply.decode import make_decoder
from cdc_apply.decode.base import DecodeContext, decode_all
from cdc_apply.model import Quarantined, RawMessage
from tests.decode.test_probe_op_types import FORMATS, T0
from tests.formats.synthetic import SyntheticChange

DEPTH = 10_000


def _deep_lines(fmt: str, kwargs: dict) -> list[str]:
    writer = importlib.import_module(f"tests.formats.write_{fmt}")
    change = SyntheticChange(
        op="c", key={"id": 1}, after={"id": 1, "name": "a", "amount": None, "updated_at": None}, before=None, seq=1, tx=1, commit_ts=T0
    )
    good = writer.write_messages([change], **kwargs)[-1]
    nested = "[" * DEPTH + "]" * DEPTH
    inside = good[:-1] + ',"deep":' + nested + "}"  # a valid message with a deep extra field
    return [nested, "[" * DEPTH + good + "]" * DEPTH, inside, '{"a":' * DEPTH + "1" + "}" * DEPTH]


@pytest.mark.parametrize("fmt, kwargs", FORMATS, ids=[f for f, _ in FORMATS])
def test_deep_nesting_is_quarantined_not_a_traceback(fmt, kwargs):
    writer = importlib.import_module(f"tests.formats.write_{fmt}")
    head = [writer.metadata_message()] if fmt == "qlik" else []
    lines = head + _deep_lines(fmt, kwargs)
    dec = make_decoder(fmt, DecodeContext(source="s", primary_keys={"items": ["id"]}, options=kwargs))
    outcomes = list(decode_all(dec, [RawMessage("f", i, t) for i, t in enumerate(lines, 1)]))
    deep = [o for o in outcomes if o.line > len(head)]
    assert len(deep) >= len(lines) - len(head), outcomes
    for o in deep:
        if isinstance(o, Quarantined):
            assert "Recursion" not in o.reason, o.reason
    assert any(isinstance(o, Quarantined) and ("nested" in o.reason or "depth" in o.reason) for o in deep), [
        getattr(o, "reason", o) for o in deep
    ]
