"""The screenshots of docs/trackers.md: TraceML's figures in TensorBoard and in MLflow.

    python -m scripts.tracker_screenshots            # writes docs/images/trackers-*.png

Runs a small real ``traceml run --tracker tensorboard --tracker mlflow
--tracker-every-steps 10`` of ``tests/scripts/straggler_train.py`` (2 ranks, gloo on
CPU, rank 1 slowed 20 ms in its forward pass) against a real ``mlflow server`` on
sqlite (``bench/mlflow_server.py``), then serves the run folder with ``tensorboard
--logdir`` and photographs, in the system Chromium driven by Playwright, TensorBoard's
scalars dashboard filtered on ``traceml/`` and the MLflow run's metric charts (the
same server serves MLflow's UI). Everything lives in a temporary folder
(``--keep DIR`` keeps it there instead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.mlflow_server import mlflow_server, server_env

REPO = Path(__file__).resolve().parents[1]

if TYPE_CHECKING:
    from playwright.sync_api import Page, ViewportSize

CHROMIUM = "/usr/bin/chromium"
"""The system's Chromium (Playwright drives it; never ``playwright install``)."""
SCRIPT = REPO / "tests" / "scripts" / "straggler_train.py"
RUN_NAME = "straggler-demo"
EXPERIMENT = "traceml-demo"
VIEWPORT: ViewportSize = {"width": 1200, "height": 800}
PAGE_TIMEOUT_MS = 60_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    """This checkout first on the path, no TraceML settings of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")) if p
    )
    env.update(extra)
    return env


def train(logs: Path, mlflow_url: str, steps: int) -> Path:
    """The traced run; its folder."""
    mlflow_env = server_env()
    clients = ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "NO_PROXY", "no_proxy")
    env = _child_env({k: mlflow_env[k] for k in clients})
    env.update({"MLFLOW_TRACKING_URI": mlflow_url, "MLFLOW_EXPERIMENT_NAME": EXPERIMENT})
    cmd = [
        sys.executable, "-m", "traceml_ai", "run",
        "--logs-dir", str(logs), "--run-name", RUN_NAME,
        "--nproc-per-node", "2", "--master-port", str(_free_port()),
        "--exporter", "jsonl",
        "--tracker", "tensorboard", "--tracker", "mlflow", "--tracker-every-steps", "10",
        str(SCRIPT), "--where", "forward", "--slow-ranks", "1", "--sleep-ms", "20",
        "--steps", str(steps),
    ]  # fmt: skip
    print("running:", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, env=env, cwd=logs, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"traceml run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return logs / RUN_NAME


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: bytes = r.read()
        return body


def _mlflow_api(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}/api/2.0/mlflow/{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def mlflow_run_page(url: str) -> str:
    """The URL of the MLflow run's metric charts."""
    query = urllib.parse.urlencode({"experiment_name": EXPERIMENT})
    experiment = _mlflow_api(url, f"experiments/get-by-name?{query}")["experiment"]
    found = _mlflow_api(
        url,
        "runs/search",
        {
            "experiment_ids": [experiment["experiment_id"]],
            "filter": f"attributes.run_name = '{RUN_NAME}'",
        },
    )
    run_id = found["runs"][0]["info"]["run_id"]
    return f"{url}/#/experiments/{experiment['experiment_id']}/runs/{run_id}/model-metrics"


@contextlib.contextmanager
def tensorboard(logdir: Path) -> Iterator[str]:
    """``tensorboard --logdir``, up; its URL."""
    port = _free_port()
    exe = str(Path(sys.executable).with_name("tensorboard"))
    cmd = [exe, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--load_fast", "false"]
    log = logdir.parent / "tensorboard.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=_child_env({}), start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                # Up, and the run's scalars read (the backend loads in the background).
                if b"traceml/" in _get(f"{url}/data/plugin/scalars/tags"):
                    break
            except (OSError, urllib.error.URLError):
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"tensorboard did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _wait_for(page: Page, selector: str, script: str, at_least: int, what: str) -> None:
    """Until ``script`` (a function of the elements ``selector`` finds, the shadow DOM
    pierced) counts ``at_least``, then a moment for the charts' transitions."""
    deadline = time.monotonic() + PAGE_TIMEOUT_MS / 1000
    while page.locator(selector).evaluate_all(script) < at_least:
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: fewer than {at_least} charts drawn at {page.url}")
        page.wait_for_timeout(500)
    page.wait_for_timeout(2_000)


# Before MLflow's page loads: its "Model training" view, its assistant's panel closed.
_MLFLOW_UI_STATE = """
localStorage.setItem('mlflow.workflowType_v1', '"machine_learning"');
localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');
localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');
"""


def shoot(tensorboard_url: str, mlflow_page: str, out: Path) -> list[Path]:
    """Both screenshots, once each page's charts are drawn."""
    from playwright.sync_api import sync_playwright

    tb_png, ml_png = out / "trackers-tensorboard.png", out / "trackers-mlflow.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            # The scalars dashboard, its tag filter on TraceML's names, no smoothing.
            tag_filter = urllib.parse.quote("traceml/", safe="")
            page.goto(f"{tensorboard_url}/#scalars&tagFilter={tag_filter}&_smoothingWeight=0")
            # Each chart's line is an SVG path, drawn once its data came.
            _wait_for(
                page, "tf-scalar-card vz-line-chart2 path.line",
                "els => els.filter(e => (e.getAttribute('d') || '').length > 20).length",
                4, "TensorBoard",
            )  # fmt: skip
            page.screenshot(path=str(tb_png))
            page.add_init_script(_MLFLOW_UI_STATE)
            page.goto(mlflow_page)
            page.get_by_placeholder("Search metric charts").fill("step_time_ms/")
            _wait_for(
                page, ".js-plotly-plot", "els => els.filter(e => e.querySelector("
                "'.scatterlayer .trace')).length", 2, "MLflow",
            )  # fmt: skip
            page.screenshot(path=str(ml_png))
        finally:
            browser.close()
    return [tb_png, ml_png]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep it all")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tracker-shots-")))
        else:
            work = args.keep.resolve()
            work.mkdir(parents=True, exist_ok=True)
        store, logs = work / "mlflow", work / "logs"
        store.mkdir(exist_ok=True)
        logs.mkdir(exist_ok=True)
        server = stack.enter_context(mlflow_server(store))
        run_dir = train(logs, server.url, args.steps)
        page = mlflow_run_page(server.url)
        tb_url = stack.enter_context(tensorboard(run_dir))
        for png in shoot(tb_url, page, args.out):
            print(f"{png}: {png.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
