"""spark-submit entry point: `spark-submit spark_jobs/apply_batch.py apply --source S ...`.

Same arguments as the `cdc` CLI; the code ships to executors as a zip via
--py-files (see plugins/cdc_airflow/spark.py), so nothing depends on the
driver's local Python path.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cdc_apply.cli import main

if __name__ == "__main__":
    sys.exit(main())
