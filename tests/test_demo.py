"""The README's demo must not rot: run it twice on a fresh CDC_HOME."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def run_demo(home: Path) -> str:
    env = {**os.environ, "CDC_HOME": str(home), "CDC_JARS_DIR": os.environ.get("CDC_JARS_DIR", str(ROOT / ".cdc" / "jars"))}
    env.pop("CDC_SOURCES_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "cdc_apply.demo"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return proc.stdout


def test_demo_prints_the_table_and_is_idempotent(tmp_path):
    out = run_demo(tmp_path)
    assert ": complete in" in out and "published" in out
    assert "1 | Anne-Marie | Doe1 | c1@example.com | 12.34 |" in out
    table, history = out.split("customers_history")
    assert "tombstones (deleted keys" in table and "  id 3: d at " in table and "\n3 | " not in table
    versions = [line.split(" | ") for line in history.splitlines() if line[:2] in ("1 ", "3 ")]
    assert [(v[0], v[1], v[5], v[6], v[7]) for v in versions] == [
        ("1", "Anne", "r", "u", "False"),
        ("1", "Anne Marie", "u", "u", "False"),
        ("1", "Anne-Marie", "u", "None", "True"),
        ("3", "Cid", "r", "d", "False"),  # the deleted key's last version, closed by its delete
    ]
    again = run_demo(tmp_path)
    assert "nothing-to-do" in again
    assert again.split("snapshot summary:")[1] == out.split("snapshot summary:")[1]
