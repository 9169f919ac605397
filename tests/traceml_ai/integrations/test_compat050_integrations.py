"""TraceML 0.5.0's integration names (docs/compat-0.5.md): ``huggingface.init()``,
``huggingface.TraceMLTrainer``, ``lightning.init()``, every field of 0.5.0's
``TraceMLRayConfig``, and ``wrap_forward`` given a class.

The framework checks run tests/scripts/compat050_frameworks.py under a real ``traceml
run`` (two processes at once: they are mostly imports) and read the export files: an
explicit callback together with the zero-code attach (and ``TraceMLTrainer``, and a
second explicit callback) counts each optimizer update once.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import REPO, assert_valid, clean_env, export_dir
from tests.integration_helpers import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    calls,
    describe,
    steps_by_rank,
    traceml_run,
)
from traceml_ai.rank import _init_config

pytestmark = pytest.mark.slow  # real runs, subprocesses or receivers (docs/testing.md)

SCRIPT = REPO / "tests" / "scripts" / "compat050_frameworks.py"

RUNS = {
    # name: the script's arguments
    "hf_lightning": ("hf", "lightning"),
    "lightning_selective": ("lightning-selective",),
}


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[Path, subprocess.CompletedProcess[str]]]]:
    def one(name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
        folder = tmp_path_factory.mktemp(name)
        return folder, traceml_run(folder, SCRIPT, *RUNS[name])

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(one, name) for name in RUNS}
        yield {name: future.result() for name, future in futures.items()}


def _lines(folder: Path, res: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert res.returncode == 0, describe(res)
    assert "Traceback" not in res.stderr, describe(res)
    assert "DONE" in res.stdout, describe(res)
    assert "integration failed" not in res.stderr, describe(res)
    (lines,) = steps_by_rank(folder).values()
    return lines


@pytest.mark.timeout(600)
def test_hf_init_trainer_and_lightning_init_count_each_update_once(
    runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    folder, res = runs["hf_lightning"]
    lines = _lines(folder, res)
    assert "CONFIG hf auto disabled=False" in res.stdout, describe(res)
    assert "CONFIG lightning auto disabled=False" in res.stdout, describe(res)
    # HF: TraceMLTrainer + explicit callback + traceml run: 3; traceml_enabled=False: 0;
    # two explicit callbacks: 2. Lightning: one callback: 3; two callbacks: 2.
    assert [line["step"] for line in lines] == list(range(1, 11)), describe(res)
    for line in lines:
        assert calls(line, FORWARD) == 1, line
        assert calls(line, BACKWARD) == 1, line
        assert calls(line, OPTIMIZER) == 1, line
    # Starting TraceML again from the callbacks says nothing.
    assert "is ignored" not in res.stderr, describe(res)
    assert_valid(export_dir(folder / "logs", "run"), folder)


@pytest.mark.timeout(600)
def test_the_lightning_callback_times_backward_and_the_update_under_selective_init(
    runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    # 0.5.0's lightning.init() asks for mode="selective" with DataLoader and H2D
    # patches only, and its callback times the rest: so does this one.
    folder, res = runs["lightning_selective"]
    lines = _lines(folder, res)
    assert "CONFIG lightning selective disabled=False" in res.stdout, describe(res)
    assert [line["step"] for line in lines] == [1, 2, 3], describe(res)
    for line in lines:
        assert calls(line, FORWARD) == 1, line
        assert calls(line, BACKWARD) == 1, line
        assert calls(line, OPTIMIZER) == 1, line


# -- TraceMLRayConfig (never imports Ray) ----------------------------------------------------

FIELDS_050: dict[str, Any] = {
    "mode": "summary",
    "profile": "run",
    "init_mode": "selective",
    "patch_dataloader": True,
    "patch_forward": False,
    "patch_backward": None,
    "patch_h2d": True,
    "logs_dir": "./logs",
    "session_id": "",
    "sampler_interval_sec": 2.0,
    "summary_window_rows": 400,
    "history_retention": "30m",
    "bind_host": "0.0.0.0",
    "port": 0,
    "stop_timeout_sec": 5.0,
}


def _ray_config(**kwargs: Any) -> Any:
    from traceml_ai.integrations._ray_config import TraceMLRayConfig

    return TraceMLRayConfig(**kwargs)


def test_ray_config_accepts_every_050_field() -> None:
    _init_config.forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _ray_config(**FIELDS_050)
        _ray_config(**FIELDS_050)  # the notices are one-time
    for name, value in FIELDS_050.items():
        assert getattr(config, name) == value
    # mode="summary": export on (jsonl; step_time), as `traceml run --mode summary`.
    assert config.export_enabled
    assert config.export_settings.exporter_kind == "jsonl"
    assert config.init_patches() == {
        "patch_dataloader": True,
        "patch_forward": False,
        "patch_backward": None,
        "patch_h2d": True,
    }
    assert type(config).from_mapping(config.to_mapping()) == config
    notices = [
        str(w.message) for w in caught if issubclass(w.category, _init_config.TraceMLWarning)
    ]
    assert notices == [
        "traceml: TraceMLRayConfig(summary_window_rows=400) has no effect here: the summary "
        "covers every step written",
        "traceml: TraceMLRayConfig(history_retention='30m') has no effect here: there is no "
        "history database; the export files keep every line",
    ]
    assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]


def test_ray_config_050_modes_and_defaults() -> None:
    _init_config.forget_warnings()
    default = _ray_config()
    assert (default.mode, default.profile, default.init_mode) == (None, None, "auto")
    assert not default.export_enabled
    with pytest.warns(_init_config.TraceMLWarning, match=r"mode='cli'\) has no effect"):
        assert not _ray_config(mode="cli").export_enabled
    # mode="dashboard" serves the live page and, like "summary", switches jsonl on.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dashboard = _ray_config(mode="dashboard", dashboard_port=0)
    assert dashboard.export_enabled and dashboard.export_settings.exporter == "jsonl"
    monitor = dashboard.monitor_settings
    assert (monitor.dashboard, monitor.dashboard_port, monitor.dashboard_bind_host) == (
        True,
        0,
        "127.0.0.1",
    )
    with pytest.warns(_init_config.TraceMLWarning, match=r"profile='watch'\) has no effect"):
        _ray_config(profile="watch")
    # An exporter given wins over mode="summary"'s jsonl.
    custom = _ray_config(mode="summary", exporter="jsonl", export_streams="all")
    assert (
        custom.export_settings
        == _ray_config(exporter="jsonl", export_streams="all").export_settings
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_mode": "auto", "patch_h2d": True}, "TraceMLRayConfig.init_mode: patch_dataloader"),
        ({"init_mode": "turbo"}, "TraceMLRayConfig.init_mode: mode must be one of"),
        ({"mode": "tui"}, "TraceMLRayConfig.mode: expected one of 'summary'"),
        ({"profile": "deep"}, "TraceMLRayConfig.profile: expected one of 'run'"),
        ({"patch_forward": "yes"}, "TraceMLRayConfig.patch_forward: expected True, False"),
        ({"summary_window_rows": 0}, "TraceMLRayConfig.summary_window_rows: expected a positive"),
        ({"history_retention": [1]}, "TraceMLRayConfig.history_retention: expected seconds"),
    ],
)
def test_ray_config_rejects_bad_050_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        _ray_config(**kwargs)
    assert str(info.value).startswith(message), str(info.value)


# -- wrap_forward(SomeModuleClass) ------------------------------------------------------------


def test_wrap_forward_of_a_class_returns_it_unpatched_with_one_warning() -> None:
    import torch

    import traceml_ai as traceml

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    forward = Net.forward
    _init_config.forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert traceml.wrap_forward(Net) is Net
        assert traceml.wrap_forward(Net) is Net
        assert traceml.wrap_optimizer(torch.optim.SGD) is torch.optim.SGD
    assert Net.forward is forward
    assert "_traceml_wrapped_forward" not in vars(Net)
    assert "_traceml_wrapped_step" not in vars(torch.optim.SGD)
    messages = [str(w.message) for w in caught]
    assert messages == [
        "traceml: wrap_forward() expects a module instance (model = MyModel(); "
        "wrap_forward(model)), got the class Net; it is returned unchanged and not timed",
        "traceml: wrap_optimizer() expects an optimizer instance, got the class SGD; "
        "it is returned unchanged and not timed",
    ]
    # An instance is still wrapped.
    net = Net()
    assert traceml.wrap_forward(net) is net
    assert getattr(net, "_traceml_wrapped_forward", False)


def test_monai_and_rfdetr_names_import_and_say_once_what_they_do(tmp_path: Path) -> None:
    """0.5.0 scripts that import these adapters run: init() starts TraceML, the
    handler attaches nothing, each says so in one traceml: warning."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "from traceml_ai.integrations import monai, rfdetr\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    config = monai.init()\n"
        "    handler = monai.TraceMLHandler()\n"
        "    handler.attach(object())\n"
        "    rfdetr.init()\n"
        "print(type(config).__name__, isinstance(monai.IS_MONAI_AVAILABLE, bool))\n"
        "for w in seen: print(w.message)\n"
    )
    env = {"TRACEML_ON_MISSING_AGGREGATOR": "warn"}
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "TraceMLInitConfig True"
    notices = [line for line in lines[1:] if "integration of TraceML 0.5.0" in line]
    assert len(notices) == 2, res.stdout
    assert all(line.startswith("traceml: ") for line in notices)
