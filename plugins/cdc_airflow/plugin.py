"""The project's Airflow plugin: the CDC pages (ui.py) mounted at ``/cdc`` and
linked from the UI's navigation, and the run-note listener (notes.py)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from cdc_airflow import notes


def _app():
    from cdc_airflow.ui import app

    return app


class CdcPlugin(AirflowPlugin):
    name = "cdc_apply"
    fastapi_apps = [{"app": _app(), "url_prefix": "/cdc", "name": "CDC apply"}]
    external_views = [
        {"name": "CDC tables", "href": "cdc/status", "url_route": "cdc-status", "destination": "nav", "icon": None},
        {"name": "CDC Data Docs", "href": "cdc/docs/", "url_route": "cdc-data-docs", "destination": "nav"},
    ]
    listeners = [notes]
