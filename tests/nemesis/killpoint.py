"""Run the ``cdc`` CLI and SIGKILL its own process group (the Python driver
and its Spark JVM) at a named point: right after (or before) the n-th call of
one function of the job.  Nothing in the job knows about it: the function is
wrapped from outside, so the kill lands exactly where a crash could.

  python -m tests.nemesis.killpoint POINT[@N] -- apply --source S ...
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

# point -> (module, function, when); the stages each one lands in are in ``STAGE_POINTS``
POINTS = {
    "decoded": ("cdc_apply.batch", "decode_batch", "after"),
    "quarantine-written": ("cdc_apply.batch", "_record_quarantine", "after"),
    "table-created": ("cdc_apply.apply.tables", "create_table", "after"),
    "merge-committed": ("cdc_apply.apply.merge", "merge_changes", "after"),
    "ledger-committed": ("cdc_apply.apply.branches", "ledger_commit", "after"),
    "gate-run": ("cdc_apply.apply.gate", "run_gx", "after"),
    "fast-forwarded": ("cdc_apply.ledger", "Ledger.fast_forward", "after"),
    "before-ledger-append": ("cdc_apply.ledger", "Ledger.record_batch", "before"),
    "ledger-appended": ("cdc_apply.ledger", "Ledger._append", "after"),
    "result-saved": ("cdc_apply.results", "save_result", "before"),
    "table-result-saved": ("cdc_apply.results", "save_table_result", "before"),
}
STAGE_POINTS = {
    "all": [
        "decoded",
        "quarantine-written",
        "table-created",
        "merge-committed",
        "ledger-committed",
        "gate-run",
        "fast-forwarded",
        "before-ledger-append",
        "ledger-appended",
    ],
    "write": ["decoded", "quarantine-written", "merge-committed", "ledger-committed", "result-saved"],
    "validate": ["gate-run", "table-result-saved"],
    "publish": ["fast-forwarded", "table-result-saved"],
    "finish": ["before-ledger-append", "ledger-appended", "result-saved"],
}


def die() -> None:
    sys.stdout.flush()
    os.killpg(os.getpgid(0), signal.SIGKILL)


def arm(point: str) -> None:
    name, _, nth = point.partition("@")
    module, attr, when = POINTS[name]
    mod = importlib.import_module(module)
    owner_name, _, attr = attr.rpartition(".")
    owner = getattr(mod, owner_name) if owner_name else mod  # a module function, or a method of a class
    real = getattr(owner, attr)
    calls = {"n": 0}
    target = int(nth or 1)

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if when == "before" and calls["n"] == target:
            die()
        out = real(*args, **kwargs)
        if when == "after" and calls["n"] == target:
            die()
        return out

    setattr(owner, attr, wrapped)
    if owner_name:
        return
    # modules that imported the function by name get the wrapped one too
    for other in list(sys.modules.values()):
        if getattr(other, "__name__", "").startswith("cdc_apply") and getattr(other, attr, None) is real:
            setattr(other, attr, wrapped)


def main(argv: list[str]) -> int:
    point, sep, *rest = argv
    if sep != "--":
        raise SystemExit(__doc__)
    import cdc_apply.batch  # noqa: F401  (load the job's modules, so every importer of the function is found)
    import cdc_apply.cli as cli
    from cdc_apply.runtime.session import one_command_process

    arm(point)
    one_command_process()  # as the `cdc` command it stands for
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
