"""One Airflow installation for the UI tests (and the screenshot script): a
real ``airflow standalone`` (scheduler, dag processor, api-server, triggerer)
on a temporary AIRFLOW_HOME, this project's dags/ and plugins/, the demo
archive, and a headless Chromium (Debian's ``chromium`` + ``chromium-driver``)
signed in with the api-server's own token."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import requests

from tests.airflow_env import airflow, airflow_env, stop_warm_driver
from tests.test_e2e_standalone import Standalone, free_port

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromedriver")
APT_LINE = "apt-get install -y chromium chromium-driver"


def browser_missing() -> str | None:
    """Why no browser test can run here (None when one can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (requirements.txt)"
    for path in CHROMIUM:
        if not Path(path).exists() and not shutil.which(Path(path).name):
            return f"{path} missing: {APT_LINE}"
    return None


def start_browser(width: int = 1400, height: int = 900):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM[0] if Path(CHROMIUM[0]).exists() else shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={width},{height}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMIUM[1] if Path(CHROMIUM[1]).exists() else shutil.which("chromedriver")), options=opts)
    driver.set_page_load_timeout(60)
    return driver


class Ui:
    """The running installation: REST (``api``), runs (``trigger``/``wait``),
    logs, and a signed-in browser (``page``)."""

    def __init__(self, root: Path, **extra_env: str) -> None:
        self.root = root
        home = root / "airflow"
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = airflow_env(
            home,
            root / "cdc",
            AIRFLOW__API__PORT=str(self.port),
            AIRFLOW__API__BASE_URL=self.base,
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"{self.base}/execution/",
            AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL="5",
            AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
            **extra_env,
        )
        airflow(self.env, "db", "migrate")
        airflow(self.env, "dags", "reserialize")
        self.sa = Standalone(self.env, home, self.port)
        self.browser = None

    def start(self) -> Ui:
        self.sa.wait_ready()
        return self

    def api(self, method: str, path: str, attempts: int = 4, **kw) -> Any:
        """A REST call; a read that times out is tried again (on a loaded
        machine the api-server can take longer than a minute to answer)."""
        for attempt in range(attempts):
            try:
                r = requests.request(
                    method, f"{self.base}/api/v2{path}", headers={"Authorization": f"Bearer {self.sa.token}"}, timeout=90, **kw
                )
            except (requests.ConnectionError, requests.Timeout):
                if method != "GET" or attempt == attempts - 1:
                    raise
                time.sleep(5)
                continue
            assert r.ok, f"{method} {path}: {r.status_code} {r.text}"
            return r.json()

    def raw(self, path: str, token: bool = True) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.sa.token}"} if token else {}
        return requests.get(f"{self.base}{path}", headers=headers, timeout=120)

    def trigger(self, conf: dict[str, Any]) -> str:
        return self.sa.trigger(conf)["dag_run_id"]

    def wait(self, run_id: str, timeout: float = 900) -> dict[str, Any]:
        deadline = time.time() + timeout
        run = {}
        while time.time() < deadline:
            run = self.api("GET", f"/dags/cdc_apply/dagRuns/{quote(run_id, safe='')}")
            if run["state"] in ("success", "failed"):
                return run
            time.sleep(3)
        raise AssertionError(f"run {run_id} did not finish: {run}\n{self.sa.tail()}")

    def task_instances(self, run_id: str) -> dict[tuple[str, int], dict[str, Any]]:
        tis = self.api("GET", f"/dags/cdc_apply/dagRuns/{quote(run_id, safe='')}/taskInstances?limit=100")["task_instances"]
        return {(t["task_id"], t["map_index"]): t for t in tis}

    def log(self, run_id: str, task_id: str, try_number: int = 1, map_index: int = -1) -> list[dict[str, Any]]:
        """The task log as the UI gets it: structured lines (event, level, ...)."""
        path = f"/dags/cdc_apply/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/logs/{try_number}?map_index={map_index}"
        r = requests.get(
            f"{self.base}/api/v2{path}", headers={"Authorization": f"Bearer {self.sa.token}", "Accept": "application/json"}, timeout=120
        )
        if r.status_code == 404:  # a try that never started (no log)
            return []
        assert r.ok, r.text
        content = r.json()["content"]
        return [c if isinstance(c, dict) else {"event": str(c)} for c in content]

    def page(self, path: str):
        """The browser at ``path``, signed in (the UI's session cookie)."""
        if self.browser is None:
            self.browser = start_browser()
            self.browser.get(f"{self.base}/api/v2/monitor/health")
            self.browser.add_cookie({"name": "_token", "value": self.sa.token, "path": "/"})
        self.browser.get(f"{self.base}{path}")
        return self.browser

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 60, what: str = "") -> Any:
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                value = predicate()
                if value:
                    return value
            except Exception as exc:  # the page is still rendering
                last = exc
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}: {last}")

    def shot(self, name: str, folder: Path = Path("/tmp/ux-shots")) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.png"
        self.browser.save_screenshot(str(path))
        return path

    def stop(self) -> None:
        if self.browser is not None:
            self.browser.quit()
        self.sa.stop()
        stop_warm_driver(self.env)


def write_failing_suite(folder: Path) -> Path:
    """A user suite the demo's negative balance (Eve, -5.25) fails."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pg_inventory.customers.json").write_text(
        json.dumps({"expectations": [{"type": "expect_column_values_to_be_between", "kwargs": {"column": "balance", "min_value": 0}}]})
    )
    return folder
