"""`cdc` — operate the CDC apply without Airflow.

  cdc apply  --source S [--dir D] [--since ISO] [--until ISO] [--table-filter RE] [--max-files N] [--dry-run]
             [--override force|skip --override-reason TEXT]
  cdc status [--source S] [--table NS.T]
  cdc pending --source S [--until ISO]
  cdc as-of  --source S --table T (--position P | --time ISO)   the snapshot and SQL of T as of a source position
  cdc rebuild --source S [--table T]   replay the source's applied files into <ns>_rebuild and compare with the live tables
  cdc connect-server [--host H] [--port P]   a long-lived driver; jobs attach with CDC_SPARK_REMOTE=sc://H:P
  cdc warm-driver status|stop [--now]   this home's local driver shared by the DAG's jobs (CDC_SPARK_REMOTE=local)

Exit codes: 0 success / nothing to do, 2 terminal failure (data or config:
do not retry), 1 other failure (may be transient).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

from cdc_apply.config import Settings, get_source, load_sources
from cdc_apply.errors import CdcError, TerminalError
from cdc_apply.results import BatchResult
from cdc_apply.status import Status

EXIT_TERMINAL = 2


def _ts(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def _emit(result: BatchResult, result_file: str | None, next_status: str | None = None, *, gated: bool = False) -> int:
    """Exit 0 while some table can go on to the next stage (``next_status``),
    so one table's failure does not stop the others; the last stage reports it.
    ``gated``: a table that failed the gate goes on too (its validate task
    reports the verdict)."""
    from cdc_apply.results import save_result

    print(
        result.to_json() if sys.stdout.isatty() else json.dumps(json.loads(result.to_json()), separators=(",", ":"))
    )  # one line in a task log
    if result_file:
        save_result(result_file, result)
    goes_on = bool(next_status and result.pending(next_status)) or (gated and any(t.gate for t in result.tables))
    if result.status == Status.FAILED and not goes_on:
        return EXIT_TERMINAL if result.terminal else 1
    return 0


def _emit_table(result: BatchResult, result_file: str, table: str) -> int:
    """A per-table stage (the DAG maps them): its own file, its own exit code."""
    from cdc_apply.results import ids_as_strings, save_table_result

    tr = result.table(table)
    print(json.dumps({"batch_id": result.batch_id, **ids_as_strings(tr.__dict__)}, default=str, indent=2 if sys.stdout.isatty() else None))
    save_table_result(result_file, tr)
    if tr.status == Status.FAILED:
        return EXIT_TERMINAL if tr.terminal else 1
    return 0


def cmd_apply(args: argparse.Namespace, settings: Settings) -> int:
    from cdc_apply.batch import (
        finish_batch,
        pending_files,
        publish_batch,
        run_batch,
        validate_batch,
    )
    from cdc_apply.results import Override, load_result

    if args.stage in ("validate", "publish", "finish"):
        if not args.result_file:
            print(f"error: --stage {args.stage} needs --result-file of the write stage", file=sys.stderr)
            return EXIT_TERMINAL
        result = load_result(args.result_file)
        if args.stage == "validate":
            validate_batch(settings, result, table=args.table)
        elif args.stage == "publish":
            publish_batch(settings, result, table=args.table)
        if args.table:
            return _emit_table(result, args.result_file, args.table)
        if args.stage in ("publish", "finish"):
            finish_batch(settings, result)
        return _emit(result, args.result_file, Status.VALIDATED if args.stage == "validate" else None)
    if not args.source:
        print("error: --source is required", file=sys.stderr)
        return EXIT_TERMINAL
    source = get_source(settings, args.source)
    override = Override.parse(args.override, args.override_reason, args.override_operator)
    if args.files_from:
        from cdc_apply.archive.files import read_manifest

        files = read_manifest(args.files_from)
    else:  # --dir: the same rules as the source's own archive folder
        files = pending_files(settings, source, root=Path(args.dir) if args.dir else None, since=_ts(args.since), until=_ts(args.until))
    stages = {"all": ("write", "validate", "publish"), "write+validate": ("write", "validate")}.get(args.stage, ("write",))
    result = run_batch(
        settings,
        source.name,
        files,
        dry_run=args.dry_run,
        table_filter=args.table_filter,
        max_files=args.max_files,
        stages=stages,
        override=override,
    )
    if args.stage == "write+validate":  # each table's verdict is its validate task's to report
        return _emit(result, args.result_file, Status.WRITTEN, gated=True)
    return _emit(result, args.result_file, Status.WRITTEN if args.stage == "write" else None)


def cmd_pending(args: argparse.Namespace, settings: Settings) -> int:
    """Files not yet applied, oldest first, each line ending with its path; a
    file an earlier batch applied in part says before it how many of its
    messages are held, and since when."""
    from cdc_apply import ledger
    from cdc_apply.apply import held
    from cdc_apply.batch import pending_files

    source = get_source(settings, args.source)
    led = ledger.Ledger(settings)
    rows = led.batch_rows(source.name)  # read once: the held files and the applied ones
    holding = led.latest_decoder_state(source.name, rows).get(held.HELD_KEY) or {}
    records = ledger.applied_file_records_of(rows)
    for f in pending_files(settings, source, since=_ts(args.since), until=_ts(args.until), records=records):
        rec = holding.get(f.path)
        note = f"(applied but for {held.messages(rec)} held message(s), since {rec.get(held.HELD_SINCE, '?')})  " if rec else ""
        print(f"{f.hour:%Y-%m-%dT%H}  {f.size:>10}  {note}{f.path}")  # the path last, as scripts read it
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    """Per table: last batch, last position, live rows, tombstones, snapshot;
    and its source's held messages (``held.summary``)."""
    from cdc_apply import ledger
    from cdc_apply.apply import held
    from cdc_apply.archive.listing import archive_file_exists

    led = ledger.Ledger(settings)
    catalog = led.catalog
    sources = [get_source(settings, args.source)] if args.source else list(load_sources(settings).values())
    out = []
    for src in sources:
        try:
            idents = [f"{src.namespace}.{name}" for _, name in catalog.list_tables(src.namespace)]
        except Exception:
            idents = []
        if args.table:
            idents = [i for i in idents if i == args.table or i.endswith("." + args.table)]
        rows = led.batch_rows(src.name)  # read once: the state and the applied files both come from them
        holding = held.summary(led.latest_decoder_state(src.name, rows), ledger.applied_file_records_of(rows), archive_file_exists)
        for ident in sorted(idents):
            tled = led.table_ledger(ident)
            table = catalog.load_table(ident)
            if ledger.DERIVED_PROPERTIES & table.properties.keys():  # a change log or history: no rows to count as live
                continue
            deleted = table.scan(selected_fields=("_cdc_deleted",)).to_arrow().column("_cdc_deleted").to_pylist()
            out.append(
                {
                    "source": src.name,
                    "table": ident,
                    "rows": sum(1 for d in deleted if not d),
                    "tombstones": sum(1 for d in deleted if d),
                    "last_batch": tled.last_batch if tled else None,
                    "last_position": tled.last_position if tled else None,
                    "last_applied_at": tled.last_applied_at if tled else None,
                    "batches": len(tled.batches) if tled else 0,
                    "snapshot_id": str(tled.snapshot_id)
                    if tled and tled.snapshot_id is not None
                    else None,  # 64-bit: a string (JSON readers round numbers)
                    **holding,
                }
            )
    print(json.dumps(out, indent=2, default=str))
    return 0


def cmd_as_of(args: argparse.Namespace, settings: Settings) -> int:
    """The snapshot of a table as of a source position or commit time, and the SQL to read it."""
    from cdc_apply.asof import as_of

    found = as_of(settings, args.source, args.table, position=args.position, time=args.time)
    if found is None:
        print(f"error: {args.table} has no publish at or before {args.position or args.time}", file=sys.stderr)
        return EXIT_TERMINAL
    out = {
        "table": found.table,
        "snapshot_id": str(found.snapshot_id),  # 64-bit: a string (JSON readers round numbers)
        "batch_id": found.batch_id,
        "watermark": found.watermark,
        "commit_ts_max": found.commit_ts_max,
        "next_watermark": found.next_watermark,
        "sql": found.sql,
    }
    print(json.dumps(out, indent=2))
    return 0


def cmd_rebuild(args: argparse.Namespace, settings: Settings) -> int:
    """Replay the source from zero beside the live tables and compare; exit 2 when a table differs."""
    from cdc_apply.rebuild import rebuild
    from cdc_apply.runtime.session import get_spark

    reports = rebuild(get_spark(settings, app_name="cdc-rebuild"), settings, get_source(settings, args.source), args.table)
    print(json.dumps(reports, indent=2, default=str))
    return 0 if reports and all(r["equal"] for r in reports) else EXIT_TERMINAL


def cmd_maintain(args: argparse.Namespace, settings: Settings) -> int:
    from cdc_apply.maintenance import Retention, maintain_audit, maintain_source
    from cdc_apply.runtime.session import get_spark

    spark = get_spark(settings, app_name="cdc-maintenance")
    retention = Retention.from_env(args.snapshot_retention_days, args.tombstone_retention_days)
    sources = [get_source(settings, args.source)] if args.source else list(load_sources(settings).values())
    out = [r for src in sources for r in maintain_source(spark, settings, src, retention)]
    out += maintain_audit(spark, settings, retention)
    print(json.dumps(out, indent=2, default=str))
    return 0


def cmd_connect_server(args: argparse.Namespace, settings: Settings) -> int:
    """Run a Spark Connect server in the foreground (exec of spark-submit):
    the long-lived driver that jobs attach to with CDC_SPARK_REMOTE."""
    from cdc_apply.runtime.submit import connect_server_command, connect_server_env

    cmd = connect_server_command(settings, host=args.host, port=args.port)
    print(
        f"Spark Connect server on {args.host}:{args.port} (master {settings.spark_master}); "
        f"jobs attach with CDC_SPARK_REMOTE=sc://{args.host}:{args.port}",
        file=sys.stderr,
    )
    os.execvpe(cmd[0], cmd, connect_server_env())
    return 0  # not reached


def cmd_warm_driver(args: argparse.Namespace, settings: Settings) -> int:
    """The warm driver (runtime/warm_driver.py): what runs, or stop it.
    ``stop`` lets running jobs finish unless ``--now``."""
    from cdc_apply.runtime import warm_driver

    if args.action == "stop":
        left = warm_driver.stop(settings, now=args.now, timeout=args.timeout)
        if left:
            print(
                f"error: {len(left)} warm driver(s) still finishing their jobs after {args.timeout:g}s; `--now` ends them", file=sys.stderr
            )
            return 1
        print("no warm driver runs", file=sys.stderr)
        return 0
    running = warm_driver.status(settings)
    print(json.dumps(running, indent=2))
    if not running:
        print(f"no warm driver runs under {warm_driver.state_dir(settings)}; the next job starts one", file=sys.stderr)
    return 0


def _history_parsers(sub: Any) -> None:
    """``as-of`` and ``rebuild``: the table's history (README, "History")."""
    h = sub.add_parser("as-of", help="the snapshot id and SQL of a table as of a source position (or source commit time)")
    h.add_argument("--source", required=True)
    h.add_argument("--table", required=True, help="the table's name in the source's namespace")
    when = h.add_mutually_exclusive_group(required=True)
    when.add_argument("--position", help="a source position, as the table's _cdc_position writes it")
    when.add_argument("--time", help="a source commit time (ISO; naive is UTC)")
    h.set_defaults(func=cmd_as_of)
    r = sub.add_parser("rebuild", help="replay every applied archive file of a source into <ns>_rebuild and compare with the live tables")
    r.add_argument("--source", required=True)
    r.add_argument("--table", help="only this source table (its name at the source)")
    r.set_defaults(func=cmd_rebuild)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cdc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("apply", help="apply pending archive files of a source")
    a.add_argument("--source")
    a.add_argument(
        "--stage",
        choices=["all", "write", "write+validate", "validate", "publish", "finish"],
        default="all",
        help="write: decode and MERGE onto audit branches; write+validate: then the gate, in the same Spark job (as the DAG "
        "runs it); validate: the gate; publish: fast-forward main; finish: record the ledger (publish without --table "
        "finishes too); default: all",
    )
    a.add_argument("--table", help="validate / publish only this table (catalog.namespace.table), as the DAG's mapped tasks do")
    a.add_argument("--dir", help="apply the files of this directory instead of the source's archive folder")
    a.add_argument("--since", help="only files of hours >= this (ISO, UTC)")
    a.add_argument("--until", help="only files of hours < this (ISO, UTC)")
    a.add_argument("--table-filter", help="regular expression on source table names")
    a.add_argument("--max-files", type=int)
    a.add_argument("--files-from", help="JSON list of files chosen by discovery (the DAG passes this)")
    a.add_argument("--dry-run", action="store_true", help="decode and count, write nothing")
    a.add_argument("--result-file", help="also write the JSON result here")
    a.add_argument(
        "--override",
        choices=["none", "force", "skip"],
        default="none",
        help="operator override of a batch that fails its gate: force = publish despite failed checks; "
        "skip = mark its files applied without applying them (both logged to the ledger)",
    )
    a.add_argument("--override-reason", help="why (required with --override); recorded in the ledger with the operator")
    a.add_argument("--override-operator", help="who decided (default: $CDC_OPERATOR, else the user); the DAG passes the triggering user")
    a.set_defaults(func=cmd_apply)
    s = sub.add_parser("status", help="print tables' last batch, position and row counts")
    s.add_argument("--source")
    s.add_argument("--table")
    s.set_defaults(func=cmd_status)
    q = sub.add_parser("pending", help="list files not yet applied")
    q.add_argument("--source", required=True)
    q.add_argument("--since")
    q.add_argument("--until")
    q.set_defaults(func=cmd_pending)
    m = sub.add_parser("maintain", help="compact, rewrite deletes, expire snapshots, remove orphans, purge tombstones")
    m.add_argument("--source")
    m.add_argument("--snapshot-retention-days", type=float)
    m.add_argument("--tombstone-retention-days", type=float)
    m.set_defaults(func=cmd_maintain)
    _history_parsers(sub)
    c = sub.add_parser(
        "connect-server",
        help="run a Spark Connect server with this project's catalog, jars and conf (jobs attach with CDC_SPARK_REMOTE)",
    )
    c.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; Spark Connect has no authentication)")
    c.add_argument("--port", type=int, default=15002)
    c.set_defaults(func=cmd_connect_server)
    w = sub.add_parser("warm-driver", help="this home's local Spark Connect server shared by the DAG's jobs: status, or stop it")
    w.add_argument("action", choices=["status", "stop"])
    w.add_argument("--now", action="store_true", help="stop: end running jobs too (they fail, and are retried)")
    w.add_argument("--timeout", type=float, default=300.0, help="stop: seconds to wait for running jobs (default 300)")
    w.set_defaults(func=cmd_warm_driver)
    return p


def main(argv: list[str] | None = None, settings: Settings | None = None) -> int:
    """Run one command; ``settings`` default to the environment's (the Airflow
    operator passes its own, e.g. with the Spark Connect server's URL)."""
    from cdc_apply.runtime.logs import configure as configure_logging

    configure_logging()  # project INFO, library chatter off (CDC_LOG_VERBOSE=1 brings it back)
    args = build_parser().parse_args(argv)
    try:
        settings = settings or Settings.from_env()
        if settings.log_verbose:
            configure_logging(verbose=True)
        return args.func(args, settings)
    except TerminalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_TERMINAL
    except CdcError as exc:  # transient: the caller may retry
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception:
        from cdc_apply.runtime import warm_driver

        lost = warm_driver.lost()  # the job's warm driver ended under it: transient, what failed is secondary
        if lost is None:
            raise
        print(f"error: {lost}", file=sys.stderr)
        return 1
    finally:
        if settings is not None and settings.spark_remote:
            from cdc_apply.runtime.session import stop_remote_session

            stop_remote_session()


def run() -> int:
    """The ``cdc`` command: one command in a process of its own."""
    from cdc_apply.runtime.session import one_command_process

    one_command_process()
    return main()


if __name__ == "__main__":
    sys.exit(run())
