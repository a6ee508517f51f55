# syntax=docker/dockerfile:1
#
# One image for the Airflow services (api-server, scheduler, dag-processor,
# triggerer, init) and for the Spark worker: Python 3.11 + a JDK 17 (Debian
# package) + the pinned requirements (Airflow 3.3.2, PySpark 4.1.3, which ships
# the Spark runtime itself: spark-submit, spark-class, jars) + the Iceberg jars.
#
# The worker uses this image, not apache/spark, on purpose: PySpark executors
# must run the driver's Python minor version (3.11; apache/spark 4.1 images
# ship Ubuntu's 3.10) with the same packages (pyarrow, orjson for the decode
# stage), and spark.pyspark.python points at the same interpreter path.
#
# Build: docker compose build   (or: docker build -t cdc-apply:local .)

# bookworm: the Debian release that packages OpenJDK 17 (trixie has 21 only).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- jars: fetched by Maven coordinates from Maven's default repository ------
FROM ${PYTHON_IMAGE} AS jars
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jdk-headless maven; \
    rm -rf /var/lib/apt/lists/*
# Keep in step with JARS in spark_jobs/cdc_apply/config.py (checked by
# tests/test_compose_static.py): they go to CDC_JARS_DIR and are passed to
# spark-submit with --jars.
ARG CDC_JARS="org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:1.11.0 org.xerial:sqlite-jdbc:3.50.3.0"
# S3FileIO's AWS SDK (s3:// warehouse): goes on Spark's own class path
# (pyspark/jars), so the driver and every executor of this image have it.
ARG SPARK_CLASSPATH_JARS="org.apache.iceberg:iceberg-aws-bundle:1.11.0"
RUN set -eux; \
    mkdir -p /jars/cdc /jars/spark; \
    for c in $CDC_JARS; do mvn -q -B dependency:copy -Dartifact="$c" -DoutputDirectory=/jars/cdc; done; \
    for c in $SPARK_CLASSPATH_JARS; do mvn -q -B dependency:copy -Dartifact="$c" -DoutputDirectory=/jars/spark; done; \
    ls -l /jars/cdc /jars/spark

# --- runtime -----------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jdk-headless curl procps tini; \
    rm -rf /var/lib/apt/lists/*; \
    ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v javac)")")")" /opt/java; \
    /opt/java/bin/java -version
ENV JAVA_HOME=/opt/java

# Python packages: the project's pins (pyspark == pyspark-client, see the stack
# notes) plus the PostgreSQL driver for Airflow's metadata database.
COPY requirements.txt /opt/cdc/requirements.txt
RUN set -eux; \
    python -m pip install --upgrade pip; \
    python -m pip install -r /opt/cdc/requirements.txt "psycopg2-binary>=2.9.10,<3"; \
    python -c "from importlib.metadata import version as v; import pyspark.sql; \
assert v('pyspark') == v('pyspark-client'), (v('pyspark'), v('pyspark-client')); print('pyspark', v('pyspark'))"

COPY --from=jars /jars/spark/ /tmp/spark-jars/
RUN set -eux; \
    cp /tmp/spark-jars/*.jar "$(python -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')/"; \
    rm -rf /tmp/spark-jars
COPY --from=jars /jars/cdc/ /opt/cdc/jars/

# The project (docker-compose.yml mounts dags/ plugins/ include/ spark_jobs/
# over these copies, so edits need no rebuild). The editable install gives the
# `cdc` CLI and resolves cdc_apply from /opt/cdc/spark_jobs, mounted or not.
WORKDIR /opt/cdc
COPY pyproject.toml /opt/cdc/
COPY spark_jobs/ /opt/cdc/spark_jobs/
COPY dags/ /opt/cdc/dags/
COPY plugins/ /opt/cdc/plugins/
COPY include/ /opt/cdc/include/
RUN python -m pip install --no-deps -e /opt/cdc

# Non-root user; the folders below are the mount points of the named volumes
# (a new named volume takes the ownership of its mount point in the image).
RUN set -eux; \
    useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow airflow; \
    mkdir -p /opt/airflow/logs /opt/airflow/auth /var/lib/cdc /data/archive /tmp/spark-work; \
    chown -R airflow:0 /opt/airflow /var/lib/cdc /data/archive /tmp/spark-work
ENV AIRFLOW_HOME=/opt/airflow \
    CDC_JARS_DIR=/opt/cdc/jars \
    PYTHONPATH=/opt/cdc/spark_jobs
USER airflow
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["airflow", "version"]
