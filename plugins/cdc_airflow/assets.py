"""Airflow Assets for the Iceberg tables the CDC DAG publishes.

Which tables a source carries is known only once its messages are decoded,
so the publishing task declares the alias ``cdc_tables`` as its outlet and
adds one concrete Asset per table it publishes.  A downstream DAG schedules
on a table with ``schedule=[table_asset("lake", "pg_inventory.customers")]``
(or on the alias, for every table).
"""

from __future__ import annotations

from airflow.sdk import Asset, AssetAlias

TABLES_ALIAS = AssetAlias("cdc_tables")


def table_asset(catalog: str, identifier: str) -> Asset:
    """``lake.ns.table`` (or ``ns.table`` with ``catalog``) -> Asset ``iceberg://lake/ns/table``."""
    parts = identifier.split(".")
    if len(parts) == 2:
        parts = [catalog, *parts]
    cat, namespace, table = parts
    return Asset(name=f"{cat}.{namespace}.{table}", uri=f"iceberg://{cat}/{namespace}/{table}", group="iceberg")
