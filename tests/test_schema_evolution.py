"""Schema evolution: new columns are added, safe widenings applied, an
incompatible change stops that table's batch (terminal, naming the column)
while other tables go on."""

from __future__ import annotations

import itertools

import pytest

from cdc_apply.model import Column
from tests.apply_harness import apply_events, event

pytestmark = pytest.mark.spark
_ns = itertools.count()
BASE = [Column("id", "int", False), Column("name", "string"), Column("qty", "int")]


def test_add_widen_refuse(spark, settings):
    ns = f"evo_{next(_ns)}"
    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "qty": "1"}, pos=1, columns=BASE)])
    assert r.status == "complete", r.message

    wider = [
        Column("id", "int", False),
        Column("name", "string"),
        Column("qty", "bigint"),
        Column("email", "string"),
        Column("price", "decimal(12,2)"),
    ]
    r = apply_events(
        spark, settings, ns, [event("u", 2, {"name": "b", "qty": str(2**40), "email": "b@x", "price": "1.25"}, pos=2, columns=wider)]
    )
    assert r.status == "complete", r.message
    changes = r.tables[0].schema_changes
    assert "widened column qty int -> bigint" in changes and "added column email string" in changes
    rows = {r["id"]: r.asDict() for r in spark.table(f"{settings.catalog_name}.{ns}.items").collect()}
    assert rows[1]["email"] is None and rows[1]["qty"] == 1  # old rows read NULL in the new column
    assert rows[2]["qty"] == 2**40 and str(rows[2]["price"]) == "1.25"
    assert dict(spark.table(f"{settings.catalog_name}.{ns}.items").dtypes)["qty"] == "bigint"

    # a partial update that does not carry the new columns keeps them
    r = apply_events(spark, settings, ns, [event("u", 2, {"name": "b2"}, pos=3, columns=BASE)])
    row = spark.sql(f"SELECT * FROM {settings.catalog_name}.{ns}.items WHERE id = 2").collect()[0]
    assert (row["name"], row["email"]) == ("b2", "b@x")

    # precision up is safe; a type change is not: that table stops, the other goes on
    narrow = [Column("id", "int", False), Column("name", "int")]
    other = [Column("id", "int", False), Column("name", "string")]
    batch = [
        event("u", 1, {"name": "7"}, pos=4, columns=narrow),
        event("c", 1, {"name": "fine"}, pos=4, columns=other, table="others"),
    ]
    r = apply_events(spark, settings, ns, batch)
    by_table = {t.table.split(".")[-1]: t for t in r.tables}
    assert by_table["items"].status == "failed" and by_table["items"].terminal
    assert "SchemaIncompatible" in by_table["items"].message and "'name'" in by_table["items"].message
    assert by_table["others"].status == "published"
    assert r.status == "failed"  # the batch is not complete: the files will be offered again
