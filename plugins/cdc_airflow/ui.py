"""The CDC pages of the Airflow UI, a FastAPI app the api-server mounts at
``/cdc`` (plugin.py):

* ``/cdc/status`` — per table: last batch, source position, lag and pending
  files, live rows, tombstones, last failure, its Data Docs (``.json``: the same
  as JSON);
* ``/cdc/docs/`` — every batch's GX Data Docs, served from
  ``$CDC_HOME/data_docs``.  GX renders pages that load Bootstrap, jQuery,
  bootstrap-table and Font Awesome from CDNs (and its logo with a tracking
  query): they are rewritten to the copies bundled in ``static/vendor`` and a
  Content-Security-Policy keeps the page from loading anything else, so the
  docs work without network.

Every page needs a signed-in Airflow user allowed to read the cdc_apply DAG
(the UI's session cookie or a bearer token): Data Docs show row values.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from cdc_airflow.guidance import DAG_ID

STATIC = Path(__file__).resolve().parent / "static"
CSP = "default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self' data:"

VENDOR = {  # a CDN file name in GX's pages -> the bundled copy (static/vendor/README.md)
    "jquery-3.7.1.min.js": "jquery.min.js",
    "popper.min.js": "popper.min.js",
    "bootstrap.min.js": "bootstrap.min.js",
    "bootstrap-table.min.js": "bootstrap-table.min.js",
    "bootstrap-table-filter-control.min.js": "bootstrap-table-filter-control.min.js",
    "bootstrap.min.css": "css/bootstrap.min.css",
    "bootstrap-table.min.css": "bootstrap-table.min.css",
    "bootstrap-table-filter-control.min.css": "bootstrap-table-filter-control.min.css",
    "all.min.css": "css/fontawesome.min.css",
    "bootstrap-datepicker.min.js": "bootstrap-datepicker.min.js",  # the index's run-time filter: without it the list stays empty
    "bootstrap-datepicker.min.css": "css/bootstrap-datepicker.min.css",
}
_EXTERNAL_TAG = re.compile(r"<(script|link)\b[^>]*?\b(?:src|href)=\"(https?://[^\"]+)\"[^>]*>(?:\s*</script>)?", re.I)
_EXTERNAL_IMG = re.compile(r"(<img\b[^>]*?\bsrc=\")https?://[^\"]*?/(logo-long\.png)[^\"]*(\")", re.I)


async def user_may_read(request: Request) -> None:
    """Signed in (cookie or bearer token) and allowed to read the cdc_apply DAG."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
    from airflow.api_fastapi.core_api.security import resolve_user_from_token

    auth = request.headers.get("authorization", "")
    token = auth[7:] if auth.lower().startswith("bearer ") else request.cookies.get(COOKIE_NAME_JWT_TOKEN)
    user = await resolve_user_from_token(token)
    if not get_auth_manager().is_authorized_dag(method="GET", details=DagDetails(id=DAG_ID), user=user):
        raise HTTPException(status_code=403, detail=f"not allowed to read the {DAG_ID} DAG")


def _settings():
    from cdc_apply.config import Settings

    return Settings.from_env()


def docs_root() -> Path:
    return (_settings().home / "data_docs").resolve()


def rewrite_docs_html(text: str, vendor_url: str, site_url: str) -> str:
    """GX's page with its CDN assets pointed at the bundled copies; others dropped."""

    def tag(m: re.Match) -> str:
        name = m.group(2).split("?")[0].rsplit("/", 1)[-1]
        local = VENDOR.get(name)
        if local is None:
            return f"<!-- offline: {html.escape(m.group(2))} not loaded -->"
        out = m.group(0).replace(m.group(2), f"{vendor_url}/{local}")
        return re.sub(r'\s(?:integrity|crossorigin)="[^"]*"', "", out)

    text = _EXTERNAL_TAG.sub(tag, text)
    return _EXTERNAL_IMG.sub(lambda m: f"{m.group(1)}{site_url}/static/images/{m.group(2)}{m.group(3)}", text)


def _page(title: str, body: str, prefix: str) -> HTMLResponse:
    return HTMLResponse(
        f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<link rel="stylesheet" href="{prefix}/static/cdc.css"></head><body><h1>{html.escape(title)}</h1>{body}</body></html>""",
        headers={"Content-Security-Policy": CSP},
    )


def _cell(value: Any) -> str:
    return "<td>–</td>" if value in (None, "", []) else f"<td>{html.escape(str(value))}</td>"


def create_app() -> FastAPI:
    app = FastAPI(title="CDC apply", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/status.json", dependencies=[Depends(user_may_read)])
    def status_json() -> JSONResponse:
        from cdc_airflow.status import table_status

        return JSONResponse(table_status(_settings()))

    @app.get("/status", dependencies=[Depends(user_may_read)])
    def status(request: Request) -> HTMLResponse:
        from cdc_airflow.guidance import docs_url
        from cdc_airflow.status import table_status

        prefix = request.scope.get("root_path", "")
        settings = _settings()
        rows = table_status(settings)
        head = "".join(
            f"<th>{h}</th>"
            for h in (
                "table",
                "last batch",
                "status",
                "source position",
                "applied at",
                "lag (min)",
                "pending files",
                "held messages",
                "live rows",
                "tombstones",
                "snapshot",
                "last failure",
                "Data Docs",
            )
        )
        body = []
        for r in rows:
            fail = r["last_failure"]
            fail_cell = (
                "<td>–</td>"
                if not fail
                else (
                    f"<td class='failed'><b>{html.escape(fail['batch_id'] or '')}</b> {html.escape(fail['at'] or '')}<br>"
                    f"{html.escape(', '.join(fail['failed_expectations']))}<details><summary>message</summary>{html.escape(fail['message'])}</details></td>"
                )
            )
            url = docs_url(r["data_docs"], settings.home)
            docs = f"<td><a href='{html.escape(url)}'>open</a></td>" if url else "<td>–</td>"
            pending = (
                f"{r['pending_files']}"
                + (f" (oldest {r['oldest_pending_hour']})" if r["oldest_pending_hour"] else "")
                + (f" {r['pending_error']}" if r["pending_error"] else "")
            )
            gone = r["held_files_gone"]
            holding = (
                f"{r['held_messages']} in {r['held_files']} file(s)"
                + (f" since {r['held_since']}" if r["held_since"] else "")
                + (f" GONE from the archive: {', '.join(gone)}" if gone else "")
                if r["held_messages"]
                else "0"
            )
            body.append(
                f"<tr data-table='{html.escape(r['table'])}'>"
                + _cell(r["table"])
                + _cell(r["last_batch"])
                + _cell(r["last_status"])
                + _cell(r["last_position"])
                + _cell(r["last_applied_at"])
                + _cell(r["lag_minutes"])
                + _cell(pending)
                + _cell(holding)
                + _cell(r["live_rows"])
                + _cell(r["tombstones"])
                + _cell(r["snapshot_id"])
                + fail_cell
                + docs
                + "</tr>"
            )
        table = (
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            if body
            else "<p>No table has been applied yet.</p>"
        )
        return _page(
            "CDC tables",
            table + f"<p><a href='{prefix}/docs/'>All Data Docs</a> · JSON: <a href='{prefix}/status.json'>status.json</a></p>",
            prefix,
        )

    @app.get("/docs/", dependencies=[Depends(user_may_read)])
    def docs_index(request: Request) -> HTMLResponse:
        prefix = request.scope.get("root_path", "")
        root = docs_root()
        sites = (
            sorted(root.glob("*/*/gx/uncommitted/data_docs/local_site/index.html"), key=lambda p: p.stat().st_mtime, reverse=True)
            if root.is_dir()
            else []
        )
        items = "".join(
            f"<li><a href='{prefix}/docs/{html.escape(p.parts[-7])}/{html.escape(p.parts[-6])}/'>{html.escape(p.parts[-7])} — {html.escape(p.parts[-6])}</a></li>"
            for p in sites
        )
        return _page("CDC Data Docs", f"<ul>{items}</ul>" if items else "<p>No validation has run yet.</p>", prefix)

    @app.get("/docs/{batch}/{table}/{path:path}", dependencies=[Depends(user_may_read)])
    def docs_file(batch: str, table: str, path: str, request: Request) -> Response:
        prefix = request.scope.get("root_path", "")
        site = (docs_root() / batch / table / "gx" / "uncommitted" / "data_docs" / "local_site").resolve()
        target = (site / (path or "index.html")).resolve()
        if not target.is_relative_to(site) or not target.is_file():
            raise HTTPException(status_code=404, detail=f"no Data Docs page {batch}/{table}/{path}")
        if target.suffix == ".html":
            text = rewrite_docs_html(target.read_text(errors="replace"), f"{prefix}/static/vendor", f"{prefix}/docs/{batch}/{table}")
            return HTMLResponse(text, headers={"Content-Security-Policy": CSP})
        return FileResponse(target, headers={"Content-Security-Policy": CSP})

    return app


app = create_app()
