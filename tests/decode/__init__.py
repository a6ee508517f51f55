"""Decoder tests: golden outcomes of every format's spec examples and cases."""

from __future__ import annotations

import dataclasses
from typing import Any

from cdc_apply.model import ChangeEvent

TX_FIELDS = ("tx_group", "tx_order", "tx_total")


def outcome_dict(outcome: Any, drop: tuple[str, ...] = ("file", "line", "raw")) -> dict[str, Any]:
    """An outcome as plain JSON data for a golden file, without ``drop``
    (checked apart) and without transaction fields the message has none of
    (the goldens name them only where a message carries them)."""
    d = {"kind": type(outcome).__name__, **dataclasses.asdict(outcome)}
    for k in drop:
        d.pop(k, None)
    for k in TX_FIELDS:
        if d.get(k) is None:
            d.pop(k, None)
    if isinstance(outcome, ChangeEvent):
        d["op"] = outcome.op.value
    return d
