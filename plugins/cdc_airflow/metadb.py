"""Connection arguments for Airflow's embedded SQLite metadata database.

The scheduler, the dag-processor, the api-server and CLI commands such as
``airflow backfill create`` all write to the same SQLite file.  Python's
sqlite3 gives up after 5 s on a locked database, which a busy 2-core machine
exceeds while Spark runs beside them ("database is locked").  Waiting longer
is the whole fix: SQLite serialises writers anyway.  Airflow reads these by
import path from ``[database] sql_alchemy_connect_args`` (and ``…_async``);
a Postgres metadata database (docker-compose) does not use them.
"""

SQLITE_LOCK_TIMEOUT_S = 60.0

SQLITE_CONNECT_ARGS = {"timeout": SQLITE_LOCK_TIMEOUT_S}
SQLITE_CONNECT_ARGS_ASYNC = {"timeout": SQLITE_LOCK_TIMEOUT_S}
