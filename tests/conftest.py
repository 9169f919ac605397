"""Shared test setup: the lanes, hypothesis profiles, the encoder fixtures, one MLflow
server and one browser for the session.

Lanes (docs/testing.md): every test is in exactly one of ``e2e`` (tests/e2e: the
product through its commands), ``slow`` (marked in its module: real training runs,
subprocesses, real receivers) and ``unit`` (everything else, given here), so that
``bash scripts/test.sh --fast`` (``-m unit``) runs every unit test (and does not import
tests/e2e nor the modules marked slow as a whole).

Hypothesis: ``ci`` (few examples) is loaded when the ``CI`` or ``FAST`` environment
variable is set; otherwise ``thorough``. ``HYPOTHESIS_PROFILE`` picks one explicitly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings

import traceml_records

if TYPE_CHECKING:
    from tests.receivers.mlflow_server import MlflowServer

settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_default = "ci" if os.environ.get("CI") or os.environ.get("FAST") else "thorough"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))


# -- lanes ---------------------------------------------------------------------------

LANES = ("unit", "e2e", "slow")
_E2E = os.path.join("tests", "e2e", "")


# A module whose every test is slow says so in one line at its top level.
_SLOW_MODULE = re.compile(rb"^pytestmark\s*=.*\bpytest\.mark\.slow\b", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m unit`` alone, tests/e2e and the modules marked slow as a whole are not
    imported at all: they would only be deselected, and importing them (Lightning,
    Accelerate, Ray, their assertion rewriting) is about half of the lane's collection.
    Any other selection collects everything."""
    if config.getoption("markexpr", "") != "unit":
        return None
    path = os.path.relpath(str(collection_path), str(config.rootpath))
    if path == _E2E.rstrip(os.sep) or path.startswith(_E2E):
        return True
    name = collection_path.name
    if name.startswith("test_") and name.endswith(".py") and collection_path.is_file():
        return _SLOW_MODULE.search(collection_path.read_bytes()) is not None or None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = os.path.relpath(str(item.path), str(config.rootpath))
        if path.startswith(_E2E):
            item.add_marker(pytest.mark.e2e)
        elif item.get_closest_marker("slow") is None and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.unit)


# -- both encoders -------------------------------------------------------------------


@pytest.fixture(params=["c", "python"])
def encoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the C encoder (``_speedups``) and again with the pure-Python one.

    The pure-Python run is what ``TRACEML_PURE_PYTHON=1`` gives at import: no C
    ``dumps_line``, no item encoder (so builders asked for encoded lines build records),
    no step encoder (a rank builds its steps' items as dicts),
    patched wherever a module took the names at import. A suite opts in with
    ``pytestmark = pytest.mark.usefixtures("encoder")``; the parity files keep only the
    C encoder's own edge cases.
    """
    from traceml_ai.export import _builder, _jsonl
    from traceml_ai.rank._timing import step_timer
    from traceml_ai.testing import _capture
    from traceml_records import _codec

    if request.param == "c":
        if not _codec.SPEEDUPS:
            pytest.skip("traceml_records._speedups is not built")
        return "c"
    pure = _codec._py_dumps_line
    monkeypatch.setattr(_codec, "_c_dumps_line", None)
    monkeypatch.setattr(_codec, "encode_items", None)
    monkeypatch.setattr(_codec, "encode_batch", None)
    monkeypatch.setattr(_codec, "split_batch", None)
    monkeypatch.setattr(_codec, "SPEEDUPS", False)
    monkeypatch.setattr(_builder, "encode_items", None)
    monkeypatch.setattr(_builder, "encode_batch", None)
    monkeypatch.setattr(_builder, "split_batch", None)
    monkeypatch.setattr(step_timer, "_encode_host_step", None)
    monkeypatch.setattr(step_timer, "_encode_host_steps", None)
    for module in (_codec, traceml_records, _jsonl, _capture):
        if hasattr(module, "dumps_line"):
            monkeypatch.setattr(module, "dumps_line", pure)
    return "python"


@pytest.fixture(params=["c", "python"])
def socket_calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the rank sender's socket calls in C (``_nowait``: they keep the
    interpreter's lock) and again with Python's, what ``TRACEML_PURE_PYTHON=1`` gives.
    Opt in with ``pytest.mark.usefixtures("socket_calls")``."""
    from traceml_ai.transport import sender

    if request.param == "c":
        if sender._NOWAIT is None:
            pytest.skip("traceml_ai.transport._nowait is not built")
        return "c"
    monkeypatch.setattr(sender, "_NOWAIT", None)
    return "python"


@pytest.fixture(params=["records", "lines"])
def builder_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with every ``RecordBuilder`` in record mode, and again in line mode.

    Line mode (``encode_lines=True``, what the JSONL exporter asks for) hands step_time
    groups over as ``EncodedLines``: a sequence of the same records, read back from the
    lines the C encoder wrote. A suite written against records therefore holds in both
    modes; with the pure-Python encoder line mode builds records. Opt in with
    ``pytest.mark.usefixtures("builder_mode")``.
    """
    from traceml_ai.export import _builder

    if request.param == "lines":
        plain_init = _builder.RecordBuilder.__init__

        def init_in_line_mode(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("encode_lines", True)
            plain_init(self, *args, **kwargs)

        monkeypatch.setattr(_builder.RecordBuilder, "__init__", init_in_line_mode)
    return str(request.param)


# --------------------------------------------------------------------------- the page

CHROMIUM = "/usr/bin/chromium"
"""Debian's chromium, driven by Playwright (never ``playwright install``)."""


@pytest.fixture(scope="module")
def browser() -> Any:
    """The system Chromium, one per module of the tests that look at the dashboard page."""
    from playwright.sync_api import sync_playwright  # only the page's tests pay for it

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any) -> Any:
    """A fresh page (its own context) of :func:`browser`, 1400 x 1500."""
    context = browser.new_context(viewport={"width": 1400, "height": 1500})
    try:
        yield context.new_page()
    finally:
        context.close()


# ------------------------------------------------------------------ one MLflow server

_MLFLOW_MODULES = pytest.StashKey[set[str]]()


@pytest.fixture(scope="session")
def mlflow_started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One real ``mlflow server`` (tests/receivers/mlflow_server.py) for every test of the
    session that asks for :func:`mlflow`, started but maybe not ready yet: its start
    (about 7 s) is paid once, not once per module or test. Tests share it through
    experiments of their own (named after their ``tmp_path``)."""
    from tests.receivers.mlflow_server import start_mlflow_server

    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server
    finally:
        # Nothing reads its store after the session: killed outright, not the graceful
        # stop (which waits seconds for uvicorn to wind down).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(10)


@pytest.fixture(scope="module", autouse=True)
def _mlflow_early(request: pytest.FixtureRequest) -> None:
    """Start the session's MLflow server when the first module with a test that uses it
    starts, so that its slow start overlaps the tests before that test."""
    modules = request.session.stash.get(_MLFLOW_MODULES, None)
    if modules is None:
        modules = {
            str(item.path)
            for item in request.session.items
            if "mlflow" in getattr(item, "fixturenames", ())
        }
        request.session.stash[_MLFLOW_MODULES] = modules
    if str(request.path) in modules:
        request.getfixturevalue("mlflow_started")


@pytest.fixture
def mlflow(mlflow_started: MlflowServer) -> MlflowServer:
    """The session's MLflow server, ready (``/health`` answers)."""
    mlflow_started.wait_ready()
    return mlflow_started
