"""Static checks of the deployment stack (docker-compose.yml, .env.example, Dockerfile).

No Docker engine runs where the tests run, so the stack is checked as data:
each ``check_*`` function returns a list of problems (empty: fine).  The real
files must have none; the mutation tests break a copy and expect the check to
complain, so every check is known to be able to fail.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE_FILE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
CODE_DIRS = ("spark_jobs", "plugins", "dags")

AIRFLOW_SERVICES = ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
REQUIRED_SERVICES = ("postgres", *AIRFLOW_SERVICES, "spark-master", "spark-worker", "minio", "iceberg-rest")
AIRFLOW_REQUIRED_ENV = (
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__API_AUTH__JWT_SECRET",
    "AIRFLOW_CONN_SPARK_DEFAULT",
)
# Environment variables the code reads that the stack may leave unset: name -> why.
OPTIONAL_ENV: dict[str, str] = {
    "CDC_SPARK_REMOTE": "the cdc CLI's Spark Connect server; the DAG's tasks take it from the spark_default connection (type spark_connect)",
    "CDC_OPERATOR": "who an override is recorded for; unset, the DAG owner (AIRFLOW_CTX_DAG_OWNER) is recorded",
    "CDC_LOG_VERBOSE": "1 brings back library chatter (GX, py4j, Spark start-up INFO, JVM CDS warnings) in the task logs; unset, it is off",
    "CDC_WARM_DRIVER_IDLE_SECONDS": "the embedded default's warm driver, for a spark_default on a local master; the stack's is a "
    "cluster master or its spark-connect service, which never start one",
}
# Names the scanner must find, or the scanner itself is broken.
KNOWN_CODE_ENV = {
    "CDC_HOME",
    "CDC_ARCHIVE_DIR",
    "CDC_WAREHOUSE",
    "CDC_CATALOG_TYPE",
    "CDC_CATALOG_URI",
    "CDC_S3_ENDPOINT",
    "AWS_SECRET_ACCESS_KEY",
}

SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|FERNET|PRIVATE|CREDENTIAL|ACCESS_KEY|_KEY$", re.IGNORECASE)
NOT_A_SECRET = re.compile(r"_(FILE|PATH|DIR)$")  # where a secret lives, not the secret
PURE_REF = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*(:?\?[^}]*)?\}$")  # ${VAR} or ${VAR:?msg}: no inline default
REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")

ENV_READS = (
    re.compile(r"""\b_env\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""os\.environ\.get\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""os\.environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\]"""),
    re.compile(r"""os\.environ\.setdefault\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""os\.getenv\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    # names handed around as strings, e.g. ("s3.endpoint", "CDC_S3_ENDPOINT")
    re.compile(r"""["']((?:CDC|AWS)_[A-Z0-9_]*[A-Z0-9])["']"""),
)


# -- loading -------------------------------------------------------------------


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def load_env_example(path: Path = ENV_EXAMPLE_FILE) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f"{path.name}: not NAME=value: {line!r}"
            env[name.strip()] = value.strip()
    return env


def code_env_names(roots: list[Path]) -> dict[str, str]:
    """CDC_*/AWS_* environment variables read by the project's code: name -> first file."""
    found: dict[str, str] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if ".egg-info" in str(path) or "__pycache__" in path.parts:
                continue
            text = path.read_text()
            for pattern in ENV_READS:
                for name in pattern.findall(text):
                    if name.startswith(("CDC_", "AWS_")) and not name.endswith("_"):
                        found.setdefault(name, str(path.relative_to(root.parent)))
    return found


def services(compose: dict) -> dict[str, dict]:
    return compose.get("services") or {}


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose-style ${VAR}, ${VAR:-default}, $$ -> $ with the .env.example values."""

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        val = env.get(name)
        if op in (":-", "-") and (val is None or (op == ":-" and val == "")):
            return arg
        return val or ""

    return REF.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


def strings(node: Any):
    """Every string in a parsed YAML tree (keys and values)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)
    elif isinstance(node, str):
        yield node


def command_words(service: dict) -> list[str]:
    words = []
    for key in ("entrypoint", "command"):
        value = service.get(key) or []
        words += value.split() if isinstance(value, str) else [str(v) for v in value]
    return words


def is_one_shot(service: dict) -> bool:
    return service.get("restart") == "no"


def mounts(service: dict) -> list[tuple[str, str, str]]:
    """(type, source, target) of every volume entry."""
    out = []
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            out.append((v.get("type", "volume"), str(v.get("source", "")), str(v.get("target", ""))))
        else:
            parts = str(v).split(":")
            source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
            kind = "bind" if source.startswith((".", "/", "~", "$")) else "volume"
            out.append((kind, source, target))
    return out


# -- checks --------------------------------------------------------------------


def check_required_services(compose: dict) -> list[str]:
    return [f"missing service {name}" for name in REQUIRED_SERVICES if name not in services(compose)]


def check_image_or_build(compose: dict) -> list[str]:
    return [f"{name}: neither image nor build" for name, s in services(compose).items() if not (s.get("image") or s.get("build"))]


def check_healthchecks(compose: dict) -> list[str]:
    problems = []
    for name, s in services(compose).items():
        hc = s.get("healthcheck") or {}
        test = hc.get("test")
        usable = bool(test) and not hc.get("disable") and test not in (["NONE"], "NONE")
        if not usable and not is_one_shot(s):
            problems.append(f'{name}: no healthcheck (only one-shot jobs with restart: "no" may skip it)')
        if "restart" in s and not isinstance(s["restart"], str):
            problems.append(f"{name}: restart must be a quoted string (YAML reads bare no as false)")
    return problems


def check_depends_on(compose: dict) -> list[str]:
    svcs = services(compose)
    problems = []
    for name, s in svcs.items():
        deps = s.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            cond = (spec or {}).get("condition", "service_started")
            if dep not in svcs:
                problems.append(f"{name}: depends on unknown service {dep}")
            elif cond == "service_healthy" and not (svcs[dep].get("healthcheck") or {}).get("test"):
                problems.append(f"{name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
            elif cond == "service_completed_successfully" and not is_one_shot(svcs[dep]):
                problems.append(f"{name}: waits for {dep} to complete, but {dep} is not a one-shot job")
    needs_healthy = {
        **{svc: ("postgres",) for svc in AIRFLOW_SERVICES},
        "airflow-scheduler": ("postgres", "airflow-api-server", "spark-master", "iceberg-rest"),
        "spark-worker": ("spark-master",),
        "iceberg-rest": ("minio",),
    }
    for name, deps in needs_healthy.items():
        have = (svcs.get(name) or {}).get("depends_on") or {}
        for dep in deps:
            if not isinstance(have, dict) or (have.get(dep) or {}).get("condition") != "service_healthy":
                problems.append(f"{name}: must depend on {dep} with condition: service_healthy")
    return problems


def check_airflow_env(compose: dict, required: dict[str, str]) -> list[str]:
    problems = []
    svcs = services(compose)
    for name in AIRFLOW_SERVICES:
        env = environment(svcs.get(name) or {})
        for var in AIRFLOW_REQUIRED_ENV:
            if var not in env:
                problems.append(f"{name}: {var} not set")
        for var, where in sorted(required.items()):
            if var not in env and var not in OPTIONAL_ENV:
                problems.append(f"{name}: {var} (read in {where}) not set; set it or list it in OPTIONAL_ENV with a reason")
        if env.get("CDC_CATALOG_TYPE") != "rest":
            problems.append(f"{name}: CDC_CATALOG_TYPE must be rest in the stack")
        for var, port in (("CDC_CATALOG_URI", 8181), ("CDC_S3_ENDPOINT", 9000), ("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", 8080)):
            url = urlsplit(env.get(var, ""))
            if url.scheme not in ("http", "https") or url.hostname not in svcs or url.port != port:
                problems.append(f"{name}: {var}={env.get(var)!r} must be http://<a service>:{port}")
        if not env.get("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "").startswith("http://airflow-api-server:8080/execution"):
            problems.append(f"{name}: AIRFLOW__CORE__EXECUTION_API_SERVER_URL must point at the api-server's /execution/")
        db = urlsplit(env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", ""))
        if not db.scheme.startswith("postgresql") or db.hostname != "postgres":
            problems.append(f"{name}: AIRFLOW__DATABASE__SQL_ALCHEMY_CONN must use the postgres service")
        catalog = env.get("CDC_CATALOG_NAME", "lake")
        for var in env:
            m = re.match(r"CDC_SPARK_CONF_spark__sql__catalog__([A-Za-z0-9_]+?)__", var)
            if m and m.group(1) != catalog:
                problems.append(f"{name}: {var} configures catalog {m.group(1)!r}, CDC_CATALOG_NAME is {catalog!r}")
    return problems


def check_no_literal_secrets(compose: dict, env_example: dict[str, str]) -> list[str]:
    problems = []
    for name, s in services(compose).items():
        for var, value in environment(s).items():
            if SECRET_NAME.search(var) and not NOT_A_SECRET.search(var) and value and not PURE_REF.match(value):
                problems.append(f"{name}: {var} must be a ${{VAR}} reference to .env (no literal, no inline default)")
            if "://" in value and "@" in value:
                password = urlsplit(value).password
                if password and not PURE_REF.match(password):
                    problems.append(f"{name}: {var} has a literal password in its URL")
    text = "\n".join(strings(compose))
    for var, value in env_example.items():
        if SECRET_NAME.search(var) and len(value) >= 6 and value in text:
            problems.append(f"the value of {var} from .env.example is written literally in docker-compose.yml")
    return problems


def check_bind_mounts(compose: dict, root: Path = ROOT) -> list[str]:
    problems = []
    declared = set((compose.get("volumes") or {}).keys())
    for name, s in services(compose).items():
        for kind, source, _target in mounts(s):
            if kind == "bind":
                if not source.startswith("."):
                    problems.append(f"{name}: bind mount {source} is not a path of the repository")
                elif not (root / source).resolve().exists():
                    problems.append(f"{name}: bind mount {source} does not exist in the repository")
            elif source and source not in declared:
                problems.append(f"{name}: volume {source} is not declared under volumes:")
    return problems


def check_env_refs_defined(compose: dict, env_example: dict[str, str]) -> list[str]:
    problems = []
    for value in strings(compose):
        for m in REF.finditer(value.replace("$$", "")):
            var = m.group(1) or m.group(4)
            if var not in env_example:
                problems.append(f"${{{var}}} is used in docker-compose.yml but not defined in .env.example")
    return sorted(set(problems))


def master_of(compose: dict, host: str) -> tuple[str, int] | None:
    """(service, port) if ``host`` is a service running the Spark standalone master."""
    s = services(compose).get(host)
    if not s:
        return None
    words = command_words(s)
    if "org.apache.spark.deploy.master.Master" not in words:
        return None
    port = int(words[words.index("--port") + 1]) if "--port" in words else 7077
    return host, port


def check_spark_master_url(compose: dict, env_example: dict[str, str]) -> list[str]:
    problems = []
    svcs = services(compose)
    urls = set()
    for name in AIRFLOW_SERVICES:
        env = environment(svcs.get(name) or {})
        conn = spark_default(svcs.get(name) or {}, env_example)
        if conn is None:
            problems.append(f"{name}: AIRFLOW_CONN_SPARK_DEFAULT is not JSON")
            continue
        if conn.get("conn_type") == "spark_connect":  # the tasks are clients of the spark-connect service
            problems += connect_connection_problems(name, conn, svcs)
            urls.add(env.get("CDC_SPARK_MASTER", ""))  # the server's master
            continue
        host = str(conn.get("host", ""))
        if conn.get("conn_type") != "spark" or not host.startswith("spark://"):
            problems.append(f"{name}: AIRFLOW_CONN_SPARK_DEFAULT must be a spark connection to spark://<host>")
            continue
        hostname = host.removeprefix("spark://")
        master = master_of(compose, hostname)
        if master is None:
            problems.append(f"{name}: Spark master {hostname!r} is not a service running the standalone Master")
        elif conn.get("port") != master[1]:
            problems.append(f"{name}: spark_default port {conn.get('port')} != the master's port {master[1]}")
        urls.add(f"{host}:{conn.get('port')}")
        if env.get("CDC_SPARK_MASTER") and env["CDC_SPARK_MASTER"] != f"{host}:{conn.get('port')}":
            problems.append(f"{name}: CDC_SPARK_MASTER differs from spark_default")
    worker = command_words(svcs.get("spark-worker") or {})
    if "org.apache.spark.deploy.worker.Worker" not in worker or not urls & set(worker):
        problems.append(f"spark-worker must run the Worker against {sorted(urls)}")
    return problems


def connect_connection_problems(name: str, conn: dict, svcs: dict[str, dict]) -> list[str]:
    """A spark_connect spark_default must name a service running `cdc connect-server` on its port."""
    server = svcs.get(str(conn.get("host", "")))
    words = command_words(server or {})
    if "connect-server" not in words:
        return [f"{name}: spark_default (spark_connect) host {conn.get('host')!r} is not a service running `cdc connect-server`"]
    port = int(words[words.index("--port") + 1]) if "--port" in words[:-1] else 15002
    if conn.get("port") != port:
        return [f"{name}: spark_default port {conn.get('port')} != the Spark Connect server's port {port}"]
    return []


def spark_default(service: dict, env_example: dict[str, str]) -> dict | None:
    """A service's spark_default connection (None: not JSON)."""
    try:
        return json.loads(interpolate(environment(service).get("AIRFLOW_CONN_SPARK_DEFAULT", ""), env_example))
    except json.JSONDecodeError:
        return None


def spark_default_types(compose: dict, env_example: dict[str, str]) -> set[str]:
    conns = (spark_default(services(compose).get(name) or {}, env_example) for name in AIRFLOW_SERVICES)
    return {str(conn.get("conn_type")) for conn in conns if conn is not None}


def check_spark_connect(compose: dict, env_example: dict[str, str]) -> list[str]:
    """The Spark Connect server: started by default, and waited for by the
    scheduler, while spark_default is a spark_connect connection (the
    default); opt-in by its profile once the tasks spark-submit (it would
    hold the worker's cores; docs/deploy.md); bound
    beyond localhost so the Airflow containers reach it, on the cluster, and
    wired to the same catalog and settings as the tasks that attach to it."""
    svcs = services(compose)
    s = svcs.get("spark-connect")
    if s is None:
        return ["missing service spark-connect"]
    problems = []
    gated = "connect" in (s.get("profiles") or [])
    waits = ((svcs.get("airflow-scheduler") or {}).get("depends_on") or {}).get("spark-connect")
    if "spark_connect" in spark_default_types(compose, env_example):
        if gated:
            problems.append(
                "spark-connect: spark_default is a spark_connect connection, so the server must start by default (remove its profile)"
            )
        if (waits or {}).get("condition") != "service_healthy":
            problems.append("airflow-scheduler: must depend on spark-connect with condition: service_healthy (its tasks are its clients)")
    else:
        if not gated:
            problems.append("spark-connect: must be opt-in (profiles: [connect]) while spark_default spark-submits")
        if waits is not None:
            problems.append("airflow-scheduler: must not depend on the opt-in spark-connect (compose would refuse to start it)")
    words = command_words(s)
    host = words[words.index("--host") + 1] if "--host" in words[:-1] else None
    if "connect-server" not in words or host != "0.0.0.0":
        problems.append("spark-connect: must run `cdc connect-server --host 0.0.0.0`")
    cdc = {k: v for k, v in environment(s).items() if k.startswith(("CDC_", "AWS_"))}
    tasks = {k: v for k, v in environment(svcs.get("airflow-scheduler") or {}).items() if k.startswith(("CDC_", "AWS_"))}
    differ = sorted(k for k in set(cdc) | set(tasks) if cdc.get(k) != tasks.get(k))
    if differ:
        problems.append(f"spark-connect: settings differ from the tasks' (the jobs would refuse it): {differ}")
    if ((s.get("depends_on") or {}).get("spark-master") or {}).get("condition") != "service_healthy":
        problems.append("spark-connect: must depend on spark-master with condition: service_healthy")
    return problems


def check_shared_archive_and_credentials(compose: dict) -> list[str]:
    """Executors (spark-worker) read the archive files by path and write to S3."""
    problems = []
    svcs = services(compose)
    scheduler, worker = svcs.get("airflow-scheduler") or {}, svcs.get("spark-worker") or {}
    archive = environment(scheduler).get("CDC_ARCHIVE_DIR", "")
    sched = {t: src for kind, src, t in mounts(scheduler)}
    work = {t: src for kind, src, t in mounts(worker)}
    if archive not in sched:
        problems.append(f"airflow-scheduler: CDC_ARCHIVE_DIR {archive!r} is not a mounted volume")
    elif work.get(archive) != sched[archive]:
        problems.append(f"spark-worker must mount {sched[archive]!r} at {archive!r} like airflow-scheduler")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        if var not in environment(worker):
            problems.append(f"spark-worker: {var} not set (executors write with S3FileIO)")
    return problems


def check_warehouse(compose: dict, env_example: dict[str, str]) -> list[str]:
    problems = []
    svcs = services(compose)
    env = {k: interpolate(v, env_example) for k, v in environment(svcs.get("airflow-scheduler") or {}).items()}
    rest = {k: interpolate(v, env_example) for k, v in environment(svcs.get("iceberg-rest") or {}).items()}
    mc = {k: interpolate(v, env_example) for k, v in environment(svcs.get("minio-init") or {}).items()}
    warehouse = urlsplit(env.get("CDC_WAREHOUSE", ""))
    if warehouse.scheme != "s3" or not warehouse.netloc:
        problems.append(f"CDC_WAREHOUSE={env.get('CDC_WAREHOUSE')!r}: S3FileIO's scheme is s3://<bucket>/")
    if rest.get("CATALOG_WAREHOUSE") != env.get("CDC_WAREHOUSE"):
        problems.append("iceberg-rest CATALOG_WAREHOUSE differs from CDC_WAREHOUSE")
    if rest.get("CATALOG_IO__IMPL") != "org.apache.iceberg.aws.s3.S3FileIO":
        problems.append("iceberg-rest must use S3FileIO (CATALOG_IO__IMPL)")
    if rest.get("CATALOG_S3_ENDPOINT") != env.get("CDC_S3_ENDPOINT"):
        problems.append("iceberg-rest CATALOG_S3_ENDPOINT differs from CDC_S3_ENDPOINT")
    if str(rest.get("CATALOG_S3_PATH__STYLE__ACCESS", "")).lower() != "true":
        problems.append("iceberg-rest needs path-style access for MinIO (CATALOG_S3_PATH__STYLE__ACCESS)")
    if warehouse.netloc and warehouse.netloc != mc.get("WAREHOUSE_BUCKET"):
        problems.append(f"minio-init creates bucket {mc.get('WAREHOUSE_BUCKET')!r}, the warehouse is in {warehouse.netloc!r}")
    return problems


def check_dockerfile(text: str, jars: tuple[str, ...]) -> list[str]:
    problems = []
    if not re.search(r"^FROM\s+\S*python:3\.11", text, re.MULTILINE) and "python:3.11" not in text:
        problems.append("Dockerfile must build on python:3.11")
    if "openjdk-17" not in text:
        problems.append("Dockerfile must install a JDK 17 Debian package")
    if "-r /opt/cdc/requirements.txt" not in text:
        problems.append("Dockerfile must pip install -r requirements.txt")
    for coord in jars:
        if coord not in text:
            problems.append(f"Dockerfile does not fetch {coord} (cdc_apply.config.JARS)")
    iceberg = [c for c in jars if ":iceberg-spark-runtime" in c]
    if iceberg and f"org.apache.iceberg:iceberg-aws-bundle:{iceberg[0].rsplit(':', 1)[1]}" not in text:
        problems.append("Dockerfile must fetch iceberg-aws-bundle of the runtime's Iceberg version")
    if re.search(r"https?://", text):
        problems.append("Dockerfile must not name a download host: fetch jars by Maven coordinates")
    return problems


# -- the real files --------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return load_env_example()


@pytest.fixture(scope="module")
def code_env() -> dict[str, str]:
    return code_env_names([ROOT / d for d in CODE_DIRS])


def test_scanner_finds_the_settings(code_env):
    assert set(code_env) >= KNOWN_CODE_ENV, f"scanner missed {KNOWN_CODE_ENV - set(code_env)}"


def test_required_services(compose):
    assert check_required_services(compose) == []


def test_every_service_has_image_or_build(compose):
    assert check_image_or_build(compose) == []


def test_every_service_has_a_healthcheck(compose):
    assert check_healthchecks(compose) == []


def test_depends_on(compose):
    assert check_depends_on(compose) == []


def test_airflow_services_set_every_env_var_the_code_reads(compose, code_env):
    assert check_airflow_env(compose, code_env) == []


def test_no_literal_secrets(compose, env_example):
    assert check_no_literal_secrets(compose, env_example) == []


def test_bind_mounts_exist_and_volumes_are_declared(compose):
    assert check_bind_mounts(compose) == []


def test_every_variable_is_in_env_example(compose, env_example):
    assert check_env_refs_defined(compose, env_example) == []


def test_spark_connection_matches_the_master(compose, env_example):
    assert check_spark_master_url(compose, env_example) == []


def test_spark_connect_server(compose, env_example):
    assert check_spark_connect(compose, env_example) == []


CONNECT_DEFAULT = '{"conn_type": "spark_connect", "host": "spark-connect", "port": 15002}'
SUBMIT_DEFAULT = '{"conn_type": "spark", "host": "spark://spark-master", "port": 7077}'


def _submit_by_default(c: dict) -> None:
    """docs/deploy.md's switch to a driver per task, step 1: spark_default spark-submits to the master."""
    for name in AIRFLOW_SERVICES:
        c["services"][name]["environment"]["AIRFLOW_CONN_SPARK_DEFAULT"] = SUBMIT_DEFAULT


def test_the_documented_switch_to_spark_submit_passes(compose, env_example):
    """The connection of docs/deploy.md, with the server opt-in again (its
    profile back) and the scheduler no longer waiting for it, passes every
    check of the connection and the server."""
    switched = copy.deepcopy(compose)
    _unshare_env(switched)
    _submit_by_default(switched)
    switched["services"]["spark-connect"]["profiles"] = ["connect"]
    switched["services"]["airflow-scheduler"]["depends_on"].pop("spark-connect")
    assert check_spark_master_url(switched, env_example) == []
    assert check_spark_connect(switched, env_example) == []
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert SUBMIT_DEFAULT in deploy and 'profiles: ["connect"]' in deploy


def test_worker_shares_archive_and_credentials(compose):
    assert check_shared_archive_and_credentials(compose) == []


def test_warehouse_is_one_bucket_everywhere(compose, env_example):
    assert check_warehouse(compose, env_example) == []


def test_dockerfile():
    from cdc_apply.config import JARS

    assert check_dockerfile(DOCKERFILE.read_text(), tuple(JARS)) == []


def test_env_example_values_are_placeholders(env_example):
    secrets = {k: v for k, v in env_example.items() if SECRET_NAME.search(k) and v}
    assert secrets, "no secret placeholders found"
    for name, value in secrets.items():
        assert "change-me" in value, f".env.example: {name} should be an obvious placeholder"


# -- the checks can fail ---------------------------------------------------------


def _set_env(service: str, var: str, value: str | None) -> Callable[[dict], None]:
    def mutate(c: dict) -> None:
        env = c["services"][service].setdefault("environment", {})
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value

    return mutate


def _del(path: list[str]) -> Callable[[dict], None]:
    def mutate(c: dict) -> None:
        node = c
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1], None)

    return mutate


def _unshare_env(c: dict) -> None:
    # YAML anchors make services share one environment dict: give each its own copy first
    for s in c["services"].values():
        if "environment" in s:
            s["environment"] = dict(s["environment"])


MUTATIONS = {
    "service removed": (_del(["services", "airflow-triggerer"]), "required_services", "airflow-triggerer"),
    "no image nor build": (
        lambda c: [c["services"]["spark-master"].pop(k, None) for k in ("image", "build")],
        "image_or_build",
        "spark-master",
    ),
    "healthcheck removed": (_del(["services", "minio", "healthcheck"]), "healthchecks", "minio"),
    "one-shot job that restarts": (lambda c: c["services"]["minio-init"].update(restart="on-failure"), "healthchecks", "minio-init"),
    "bare no for restart": (lambda c: c["services"]["airflow-init"].update(restart=False), "healthchecks", "airflow-init"),
    "waits for health without healthcheck": (_del(["services", "spark-master", "healthcheck"]), "depends_on", "spark-master"),
    "started instead of healthy": (
        lambda c: c["services"]["iceberg-rest"]["depends_on"].update(minio={"condition": "service_started"}),
        "depends_on",
        "iceberg-rest",
    ),
    "setting missing": (_set_env("airflow-scheduler", "CDC_WAREHOUSE", None), "airflow_env", "CDC_WAREHOUSE"),
    "execution api missing": (
        _set_env("airflow-triggerer", "AIRFLOW__CORE__EXECUTION_API_SERVER_URL", None),
        "airflow_env",
        "EXECUTION_API",
    ),
    "catalog uri not a service": (
        _set_env("airflow-api-server", "CDC_CATALOG_URI", "http://localhost:8181"),
        "airflow_env",
        "CDC_CATALOG_URI",
    ),
    "literal secret": (_set_env("iceberg-rest", "AWS_SECRET_ACCESS_KEY", "hunter2hunter2"), "no_literal_secrets", "AWS_SECRET_ACCESS_KEY"),
    "secret with inline default": (
        _set_env("minio", "MINIO_ROOT_PASSWORD", "${AWS_SECRET_ACCESS_KEY:-minio123}"),
        "no_literal_secrets",
        "MINIO_ROOT_PASSWORD",
    ),
    "password in a URL": (
        _set_env("airflow-scheduler", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql+psycopg2://airflow:airflow@postgres/airflow"),
        "no_literal_secrets",
        "URL",
    ),
    "bind mount outside the repo": (
        lambda c: c["services"]["spark-worker"]["volumes"].append("./no-such-dir:/x"),
        "bind_mounts",
        "no-such-dir",
    ),
    "undeclared volume": (lambda c: c["services"]["spark-worker"]["volumes"].append("scratch:/scratch"), "bind_mounts", "scratch"),
    "variable not in .env.example": (
        _set_env("postgres", "POSTGRES_DB", "${NOT_IN_ENV_EXAMPLE}"),
        "env_refs_defined",
        "NOT_IN_ENV_EXAMPLE",
    ),
    "wrong master port": (
        _set_env("airflow-scheduler", "AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark", "host": "spark://spark-master", "port": 7078}'),
        "spark_master_url",
        "7078",
    ),
    "wrong master host": (
        _set_env(
            "airflow-dag-processor", "AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark", "host": "spark://spark-mastr", "port": 7077}'
        ),
        "spark_master_url",
        "spark-mastr",
    ),
    "worker without the archive": (lambda c: c["services"]["spark-worker"].update(volumes=[]), "shared_archive_and_credentials", "mount"),
    "worker without credentials": (
        _set_env("spark-worker", "AWS_SECRET_ACCESS_KEY", None),
        "shared_archive_and_credentials",
        "AWS_SECRET_ACCESS_KEY",
    ),
    "warehouse with s3a": (_set_env("airflow-scheduler", "CDC_WAREHOUSE", "s3a://${CDC_WAREHOUSE_BUCKET}/"), "warehouse", "s3://"),
    "rest without path style": (_set_env("iceberg-rest", "CATALOG_S3_PATH__STYLE__ACCESS", None), "warehouse", "path-style"),
    "bucket mismatch": (_set_env("minio-init", "WAREHOUSE_BUCKET", "other"), "warehouse", "bucket"),
    "connect server on another catalog": (
        _set_env("spark-connect", "CDC_CATALOG_URI", "http://other:8181"),
        "spark_connect",
        "CDC_CATALOG_URI",
    ),
    "spark-submit default, connect server still on": (_submit_by_default, "spark_connect", "opt-in"),
    "connect default, server opt-in": (
        lambda c: c["services"]["spark-connect"].update(profiles=["connect"]),
        "spark_connect",
        "remove its profile",
    ),
    "connect default, scheduler not waiting for the server": (
        lambda c: c["services"]["airflow-scheduler"]["depends_on"].pop("spark-connect"),
        "spark_connect",
        "airflow-scheduler: must depend on spark-connect",
    ),
    "spark-submit default, scheduler waiting for an opt-in server": (
        lambda c: [_submit_by_default(c), c["services"]["spark-connect"].update(profiles=["connect"])],
        "spark_connect",
        "must not depend on the opt-in spark-connect",
    ),
    "connect default on another port": (
        _set_env("airflow-scheduler", "AIRFLOW_CONN_SPARK_DEFAULT", CONNECT_DEFAULT.replace("15002", "15003")),
        "spark_master_url",
        "Spark Connect server's port 15002",
    ),
    "connect server on localhost": (
        lambda c: c["services"]["spark-connect"].update(command=["cdc", "connect-server", "--host", "127.0.0.1"]),
        "spark_connect",
        "--host 0.0.0.0",
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_is_caught(name, compose, env_example, code_env):
    mutate, check, expected = MUTATIONS[name]
    broken = copy.deepcopy(compose)
    _unshare_env(broken)
    mutate(broken)
    run = {
        "required_services": lambda c: check_required_services(c),
        "image_or_build": lambda c: check_image_or_build(c),
        "healthchecks": lambda c: check_healthchecks(c),
        "depends_on": lambda c: check_depends_on(c),
        "airflow_env": lambda c: check_airflow_env(c, code_env),
        "no_literal_secrets": lambda c: check_no_literal_secrets(c, env_example),
        "bind_mounts": lambda c: check_bind_mounts(c),
        "env_refs_defined": lambda c: check_env_refs_defined(c, env_example),
        "spark_master_url": lambda c: check_spark_master_url(c, env_example),
        "shared_archive_and_credentials": lambda c: check_shared_archive_and_credentials(c),
        "spark_connect": lambda c: check_spark_connect(c, env_example),
        "warehouse": lambda c: check_warehouse(c, env_example),
    }[check]
    assert run(compose) == [], "the unmutated file must pass"
    problems = run(broken)
    assert problems and any(expected in p for p in problems), problems


def test_mutation_only_touches_the_copy(compose):
    assert "airflow-triggerer" in services(compose)
    assert environment(services(compose)["airflow-scheduler"]).get("CDC_WAREHOUSE")


def test_new_setting_in_code_is_caught(tmp_path, compose):
    pkg = tmp_path / "spark_jobs"
    pkg.mkdir()
    (pkg / "extra.py").write_text('import os\nLIMIT = os.environ.get("CDC_NEW_LIMIT", "5")\nX = _env("CDC_OTHER", "")\n')
    found = code_env_names([pkg])
    assert set(found) == {"CDC_NEW_LIMIT", "CDC_OTHER"}
    problems = check_airflow_env(compose, found)
    assert any("CDC_NEW_LIMIT" in p for p in problems) and any("CDC_OTHER" in p for p in problems)


def test_env_example_missing_a_variable_is_caught(compose, env_example):
    partial = {k: v for k, v in env_example.items() if k != "AWS_REGION"}
    assert any("AWS_REGION" in p for p in check_env_refs_defined(compose, partial))


def test_dockerfile_checks_can_fail():
    from cdc_apply.config import JARS

    text = DOCKERFILE.read_text()
    assert check_dockerfile(text.replace("1.11.0", "1.10.0"), tuple(JARS))
    assert check_dockerfile(text + "\nRUN curl -o x.jar https://example.invalid/x.jar\n", tuple(JARS))
