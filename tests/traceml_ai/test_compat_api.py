"""TraceML 0.5.0's Python API, in-process: names and signatures, init's modes and
config, the wrap_* helpers, host-to-device timing (fake CUDA backend), a raising
step, TRACEML_DISABLED, notices, and summary()/final_summary()."""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import torch

import traceml_ai as traceml
from tests.rank_helpers import ENV_VARS, make_loader, make_model, step_items
from traceml_ai.rank._patches import phase_hooks, wrappers
from traceml_ai.rank._runtime import sdk
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda

FWD, BWD, OPT, DL, STEP, H2D = (
    "_traceml_internal:forward_time",
    "_traceml_internal:backward_time",
    "_traceml_internal:optimizer_step",
    "_traceml_internal:dataloader_next",
    "_traceml_internal:step_time",
    "_traceml_internal:h2d_time",
)

# 0.5.0's public names (traceml_ai.__all__ of the published package).
NAMES_050 = (
    "__version__",
    "trace_step",
    "summary",
    "final_summary",
    "start",
    "init",
    "wrap_dataloader_fetch",
    "wrap_forward",
    "wrap_backward",
    "wrap_optimizer",
    "wrap_h2d",
)
INIT_050 = (
    ("mode", "auto"),
    ("patch_dataloader", None),
    ("patch_forward", None),
    ("patch_backward", None),
    ("patch_h2d", None),
    ("disabled", None),
    ("ui_mode", None),
    ("interval", None),
    ("logs_dir", None),
    ("enable_logging", None),
    ("session_id", None),
    ("aggregator_host", None),
    ("aggregator_port", None),
    ("connect_timeout_sec", 10.0),
    ("connect_retry_interval_sec", 0.25),
    ("on_missing_aggregator", None),
)
SUMMARY_050 = (
    ("timeout_sec", 30.0),
    ("poll_interval_sec", 0.1),
    ("print_text", False),
    ("rank0_only", True),
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (
        *ENV_VARS,
        "TRACEML_DISABLED",
        "TRACEML_ON_MISSING_AGGREGATOR",
        "TRACEML_TRACE_MAX_STEPS",
        "TRACEML_SUMMARY_STEP_TIME_FILE",
        "TRACEML_AGGREGATOR_UNAVAILABLE",
    ):
        monkeypatch.delenv(name, raising=False)
    sdk.reset_for_tests()
    yield
    sdk.reset_for_tests()


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, traceml.TraceMLWarning)]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


# -- names and signatures ----------------------------------------------------------


def test_every_050_name_is_public_with_its_signature() -> None:
    for name in NAMES_050:
        assert name in traceml.__all__ and hasattr(traceml, name), name
    assert isinstance(traceml.__version__, str) and traceml.__version__
    for fn in (traceml.init, traceml.start):
        params = inspect.signature(fn).parameters
        for name, default in INIT_050:
            assert name in params and params[name].default == default, (fn, name)
            if name != "mode":
                assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    for summary_fn in (traceml.summary, traceml.final_summary):
        params = inspect.signature(summary_fn).parameters
        assert [(n, p.default) for n, p in params.items()] == list(SUMMARY_050)
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    # 0.5.0's one parameter, and this project's keyword-only ``tokens``.
    step_params = inspect.signature(traceml.trace_step).parameters
    assert list(step_params) == ["model", "tokens"]
    assert step_params["tokens"].kind is inspect.Parameter.KEYWORD_ONLY
    for name in NAMES_050[6:]:
        assert len(inspect.signature(getattr(traceml, name)).parameters) == 1


# -- init's modes and config --------------------------------------------------------


def test_init_returns_a_frozen_config_for_each_mode() -> None:
    cfg = traceml.init(sink=RecordingSink(), sampler_interval=60)
    assert isinstance(cfg, traceml.TraceMLInitConfig) and attrs.has(type(cfg))
    assert (cfg.mode, cfg.patch_forward, cfg.patch_h2d, cfg.disabled) == ("auto", True, True, False)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.mode = "manual"  # type: ignore[misc]
    # Same config again: the running one; a different one: one notice, still the running one.
    assert traceml.init() is cfg
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert traceml.init(mode="manual") is cfg
        assert traceml.init(mode="manual") is cfg
    assert ours(caught) == [
        "traceml: init(mode='manual') is ignored: TraceML is already running in this "
        "process with mode='auto'"
    ]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mode": "manual"}, ("manual", False, False, False, False)),
        ({"mode": "selective", "patch_forward": True}, ("selective", False, True, False, False)),
        ({"mode": "custom", "patch_h2d": True}, ("selective", False, False, False, True)),
    ],
)
def test_manual_and_selective_modes(kwargs: dict[str, Any], expected: tuple[Any, ...]) -> None:
    cfg = traceml.init(sink=RecordingSink(), sampler_interval=60, **kwargs)
    got = (cfg.mode, cfg.patch_dataloader, cfg.patch_forward, cfg.patch_backward, cfg.patch_h2d)
    assert got == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "auto", "patch_forward": True},
        {"mode": "selective"},
        {"mode": "selective", "patch_forward": False},
        {"mode": "sometimes"},
        {"on_missing_aggregator": "ignore"},
    ],
)
def test_bad_mode_or_patch_choice_is_a_value_error_as_in_050(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        traceml.init(**kwargs)


def test_manual_mode_times_only_what_is_wrapped() -> None:
    sink = RecordingSink()
    traceml.init(mode="manual", sink=sink, sampler_interval=60)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, _ in make_loader(2):
        with traceml.trace_step(model):
            train_step(model, opt, x)
    traceml.wrap_forward(model)
    traceml.wrap_optimizer(opt)
    for x, _ in traceml.wrap_dataloader_fetch(make_loader(2)):
        with traceml.trace_step(model):
            opt.zero_grad()
            traceml.wrap_backward(model(x).sum()).backward()
            opt.step()
    traceml.shutdown()
    items = step_items(sink)
    assert [set(i["events"]) for i in items[:2]] == [{STEP}, {STEP}]
    # The first wrapped fetch came before step 3 began, so step 3 has it too.
    for item in items[2:]:
        assert set(item["events"]) == {STEP, FWD, BWD, OPT, DL}
        for name in (FWD, BWD, OPT, DL):
            assert item["events"][name]["cpu"]["n_calls"] == 1
    assert len(model._forward_pre_hooks) == 0


def test_selective_mode_times_only_the_chosen_phases() -> None:
    sink = RecordingSink()
    traceml.init(mode="selective", patch_forward=True, sink=sink, sampler_interval=60)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with traceml.trace_step(model):
        train_step(model, opt, torch.randn(2, 8))
    traceml.shutdown()
    (item,) = step_items(sink)
    assert set(item["events"]) == {STEP, FWD}


def test_wrappers_in_auto_mode_count_each_call_once() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = traceml.wrap_forward(make_model())
    opt = traceml.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # rebinds opt.step
    for x, _ in traceml.wrap_dataloader_fetch(make_loader(2)):
        with traceml.trace_step(model):
            opt.zero_grad()
            traceml.wrap_backward(model(x).sum()).backward()
            opt.step()
        sched.step()
    traceml.shutdown()
    for item in step_items(sink):
        for name in (FWD, BWD, OPT, DL):
            assert item["events"][name]["cpu"]["n_calls"] == 1, name
    assert sched.get_last_lr()[0] < 0.01


def test_a_bad_wrapper_argument_is_one_notice_and_returned_unchanged() -> None:
    traceml.init(sink=RecordingSink(), sampler_interval=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert traceml.wrap_forward(3) == 3
            assert traceml.wrap_h2d("x") == "x"
    assert ours(caught) == [
        "traceml: wrap_forward() expects a module with a callable forward, got int; "
        "it is returned unchanged and not timed",
        "traceml: wrap_h2d() expects an object with a callable .to(), got str; "
        "it is returned unchanged and not timed",
    ]


# -- host to device -----------------------------------------------------------------


def test_h2d_copies_in_a_step_are_timed_with_gpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # No accelerator in CI: "meta" stands in for one, CUDA events come from the fake.
    monkeypatch.setattr(wrappers, "_ACCELERATORS", frozenset({"meta"}))
    sink = RecordingSink()
    traceml.init(
        sink=sink, sampler_interval=60, cuda_backend=FakeCuda(model_device=0, auto_complete=True)
    )
    model = make_model()
    x = torch.randn(2, 8)
    x.to("meta")  # outside a step: not counted
    with traceml.trace_step(model):
        moved = x.to("meta", non_blocking=True)
        x.to(device=torch.device("meta"))
        x.to(torch.device("meta"))
        x.to(torch.device("cpu"))  # the step's own device: no copy to an accelerator
        x.to(torch.float64)  # a dtype cast is no copy to a device
        model(x)
    with traceml.trace_step(model):
        model(x)
    traceml.shutdown()
    assert moved.device.type == "meta"
    first, second = step_items(sink)
    h2d = first["events"][H2D]["cuda:0"]
    assert h2d["n_calls"] == 3 and h2d["is_gpu"] and h2d["gpu_ms"] == h2d["duration_ms"]
    assert H2D not in second["events"]


def test_wrap_h2d_times_the_copy_in_manual_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wrappers, "_ACCELERATORS", frozenset({"meta"}))
    sink = RecordingSink()
    traceml.init(mode="manual", sink=sink, sampler_interval=60)
    model = make_model()
    with traceml.trace_step(model):
        x = traceml.wrap_h2d(torch.randn(2, 8))
        assert x.shape == (2, 8)
        y = x.to("meta")
        torch.randn(2).to("meta")  # not wrapped, no automatic timing: not counted
    traceml.shutdown()
    assert isinstance(y, torch.Tensor) and y.device.type == "meta"
    (item,) = step_items(sink)
    assert item["events"][H2D]["cpu"]["n_calls"] == 1


@pytest.mark.parametrize("installed", [False, True])
def test_h2d_rules(installed: bool) -> None:
    """The same answers before the patch knows torch's classes and after (its fast
    path for a ``torch.device`` or ``torch.dtype`` target)."""
    if installed:
        wrappers.install_h2d_patch(torch)
        assert wrappers._device_class is torch.device
    else:
        assert wrappers._device_class in (None, torch.device)
    x, p = torch.randn(2), torch.nn.Parameter(torch.randn(2))
    assert wrappers.copies_to_accelerator(x, (torch.device("cuda", 1),), {})
    assert not wrappers.copies_to_accelerator(x, (torch.device("cpu"),), {})
    assert not wrappers.copies_to_accelerator(p, (torch.device("cuda"),), {})
    assert not wrappers.copies_to_accelerator(x, (torch.device("cpu"), torch.float16), {})
    assert wrappers.copies_to_accelerator(x, ("cuda:1",), {})
    assert wrappers.copies_to_accelerator(x, (0,), {})
    assert wrappers.copies_to_accelerator(x, (), {"device": torch.device("cuda")})
    assert not wrappers.copies_to_accelerator(x, ("cpu",), {})
    assert not wrappers.copies_to_accelerator(x, (torch.float16,), {})
    assert not wrappers.copies_to_accelerator(p, ("cuda",), {})


# -- a step that raises -------------------------------------------------------------


def test_a_raising_step_is_discarded_and_numbers_stay_consecutive() -> None:
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    for i in range(4):
        expect = pytest.raises(RuntimeError) if i == 1 else contextlib.nullcontext()
        with expect, traceml.trace_step(model):
            model(torch.randn(2, 8))
            if i == 1:
                raise RuntimeError("skip this batch")
    traceml.shutdown()
    assert [i["step"] for i in step_items(sink)] == [1, 2, 3]
    assert [m["step"] for m in sink.items("step_memory")] == [1, 2, 3]


# -- off, notices, missing aggregator ----------------------------------------------


def test_traceml_disabled_turns_everything_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEML_DISABLED", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = traceml.init(mode="sometimes", sink=RecordingSink())  # not even checked
        model = make_model()
        assert traceml.wrap_forward(model) is model
        with traceml.trace_step(model):
            model(torch.randn(2, 8))
        assert traceml.final_summary() is None
    assert cfg.disabled and not cfg.patch_forward
    assert sdk._runtime is None and phase_hooks.active() is None
    assert len(model._forward_pre_hooks) == 0
    assert ours(caught) == [
        "traceml: summary(): TraceML is disabled (disabled=True or TRACEML_DISABLED=1); "
        "there is no summary"
    ]


def test_keywords_without_a_feature_here_are_one_notice_each() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            traceml.init(
                sink=RecordingSink(),
                ui_mode="dashboard",
                logs_dir="somewhere",
                enable_logging=True,
                session_id="s1",
                interval=30.0,
                connect_timeout_sec=1.0,
                connect_retry_interval_sec=0.1,
            )
    assert ours(caught) == [
        "traceml: init(ui_mode='dashboard') is ignored: the live dashboard is served by the "
        "aggregator; start the run with `traceml run --mode dashboard`",
        "traceml: init(logs_dir='somewhere') is ignored: the run folder is set by "
        "`traceml run --logs-dir`",
        "traceml: init(enable_logging=True) is ignored: TraceML writes no log files; "
        "its messages go to stderr",
        "traceml: init(session_id='s1') is ignored: the run name is set by "
        "`traceml run --run-name` (or --session-id)",
    ]
    runtime = sdk._runtime
    assert runtime is not None and runtime.interval == 30.0


def test_on_missing_aggregator(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="not launched by `traceml run`"):
        traceml.init(on_missing_aggregator="raise")
    sdk.reset_for_tests()
    monkeypatch.setenv("TRACEML_ON_MISSING_AGGREGATOR", "raise")
    with pytest.raises(RuntimeError):
        traceml.start()
    sdk.reset_for_tests()
    with pytest.warns(traceml.TraceMLWarning, match="not launched"):
        cfg = traceml.init(on_missing_aggregator="warn")
    assert cfg.disabled


def test_aggregator_host_and_port_name_a_traceml_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACEML_RUN_TOKEN", raising=False)
    with pytest.warns(traceml.TraceMLWarning, match="TRACEML_RUN_TOKEN is not set"):
        cfg = traceml.init(aggregator_host="127.0.0.1", aggregator_port=1)
    assert cfg.disabled
    sdk.reset_for_tests()
    monkeypatch.setenv("TRACEML_RUN_TOKEN", "t")
    cfg = traceml.init(aggregator_host="127.0.0.1", aggregator_port=1, sampler_interval=60)
    assert not cfg.disabled and sdk._runtime is not None
    traceml.shutdown()


# -- summaries ----------------------------------------------------------------------


def test_summary_with_export_off_is_this_ranks_own_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    traceml.init(sink=RecordingSink(), sampler_interval=60)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, _ in make_loader(5):
        with traceml.trace_step(model):
            train_step(model, opt, x)
    full = traceml.final_summary(print_text=True)
    assert full is not None
    assert full["source"] == "in_process" and full["ranks"] == [0]
    assert full["step_time"]["0"]["steps"] == 5
    assert set(full["phases"]["0"]) >= {"dataloader_wait", "forward", "backward", "optimizer"}
    assert "figures are rank 0's own last 5 of 5 steps" in full["notes"][0]
    out = capsys.readouterr().out
    assert (
        out.startswith("traceml: summary from this rank's own steps") and "rank 0: 5 steps" in out
    )
    flat = traceml.summary()
    assert flat is not None and flat["traceml/steps"] == 5
    for key in ("step_time_ms", "forward_ms", "backward_ms", "optimizer_ms", "input_wait_ms"):
        assert isinstance(flat[f"traceml/step_time/{key}"], float), key
    traceml.shutdown()
    after = traceml.final_summary()  # after shutdown the record is still there
    assert after is not None and after["complete"] is True


def test_summary_is_none_on_other_ranks_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    traceml.init(sink=RecordingSink(), sampler_interval=60)
    model = make_model()
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
    assert traceml.summary() is None
    mine = traceml.final_summary(rank0_only=False)
    assert mine is not None and mine["ranks"] == [1]


def step_line(rank: int, step: int, ms: float) -> bytes:
    timing = {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    # A whole line, as the exporter writes it (the summary leaves out incomplete ones).
    line = {
        "stream": "step_time",
        "schema_version": 1,
        "observed_timestamp_unix_ns": 10**18 + step,
        "rank": rank,
        "global_rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "local_world_size": 2,
        "node_rank": 0,
        "timestamp_unix_ns": 10**18 + step,
        "seq": step - 1,
        "step": step,
        "events": {
            STEP: {"cpu": timing},
            FWD: {"cpu": dict(timing, cpu_ms=ms / 2, duration_ms=ms / 2)},
        },
    }
    return orjson.dumps(line) + b"\n"


def test_summary_waits_for_its_last_step_in_the_export_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(step_line(1, 1, 4.0))
    monkeypatch.setenv("TRACEML_SUMMARY_STEP_TIME_FILE", str(path))
    traceml.init(sink=RecordingSink(), sampler_interval=60)
    model = make_model()
    for _ in range(2):
        with traceml.trace_step(model):
            model(torch.randn(2, 8))

    def aggregator() -> None:
        # Rank 0's lines arrive later, the last one in two writes.
        time.sleep(0.3)
        with open(path, "ab") as fh:
            fh.write(step_line(0, 1, 2.0))
            last = step_line(0, 2, 2.0)
            fh.write(last[:10])
            fh.flush()
            time.sleep(0.2)
            fh.write(last[10:])

    thread = threading.Thread(target=aggregator)
    thread.start()
    full = traceml.final_summary(timeout_sec=20, poll_interval_sec=0.05)
    thread.join()
    assert full is not None and full["source"] == "export" and full["complete"] is False
    assert full["ranks"] == [0, 1]
    assert full["step_time"]["0"]["steps"] == 2 and full["step_time"]["1"]["steps"] == 1
    assert full["phases"]["0"]["forward"]["mean_ms"] == 1.0
    # The figures come from the file: the rank kept no events of its own.
    recorder = sdk._history
    assert recorder is not None and not recorder.keep_events
    assert recorder.snapshot() == ([], 2) and recorder.last_step == 2


def test_summary_times_out_with_one_notice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEML_SUMMARY_STEP_TIME_FILE", str(tmp_path / "never.jsonl"))
    traceml.init(sink=RecordingSink(), sampler_interval=60)
    model = make_model()
    with traceml.trace_step(model):
        model(torch.randn(2, 8))
    with pytest.warns(
        traceml.TraceMLWarning, match="traceml: summary\\(\\): timed out after 0.2 s"
    ):
        full = traceml.final_summary(timeout_sec=0.2)
    assert full is not None and full["step_time"] is None and not full["complete"]


def test_trace_max_steps_sends_only_the_first_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEML_TRACE_MAX_STEPS", "2")
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    for _ in range(4):
        with traceml.trace_step(model):
            model(torch.randn(2, 8))
    traceml.shutdown()
    assert [i["step"] for i in step_items(sink)] == [1, 2]
    assert [m["step"] for m in sink.items("step_memory")] == [1, 2]


def test_summary_stays_a_function_after_every_module_is_imported() -> None:
    # A submodule named like a package attribute replaces it on import: a module
    # traceml_ai/summary.py made `traceml.summary()` a module after its first use.
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(traceml.__path__, "traceml_ai."):
        if info.name.startswith(("traceml_ai.integrations.", "traceml_ai.__main__")):
            continue  # optional frameworks; the entry point runs the CLI
        importlib.import_module(info.name)
    for name in ("summary", "final_summary", "init", "start", "trace_step", "shutdown"):
        assert callable(getattr(traceml, name)) and inspect.isfunction(getattr(traceml, name))


def test_final_summary_phases_are_figured_as_traceml_summary_figures_them() -> None:
    from traceml_ai.analysis import _phases as _step_phases
    from traceml_ai.analysis import in_process

    def timing(ms: float) -> dict[str, dict[str, object]]:
        return {
            "cpu": {"duration_ms": ms, "cpu_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
        }

    # The batch fetched before the step opened (3 ms), then a 1 ms step.
    events = {
        "_traceml_internal:step_time": timing(1.0),
        "_traceml_internal:dataloader_next": timing(3.0),
        "_traceml_internal:forward_time": timing(0.4),
        "_traceml_internal:backward_time": timing(0.5),
        "loss": timing(0.05),
    }
    summary = in_process.build_summary({0: {1: events, 2: events}}, source="x", complete=True)
    phases = summary["phases"]["0"]
    assert summary["phase_names"] == [
        "dataloader_wait", "forward", "backward", "optimizer", "user:loss", "rest",
    ]  # fmt: skip
    # Shares of the 4 ms iteration, not of the 1 ms step: built-in phases and the
    # rest add up to 100 % once, as in `traceml summary`.
    assert phases["dataloader_wait"]["share"] == 0.75
    assert abs(phases["rest"]["mean_ms"] - 0.05) < 1e-9
    built_in = ("dataloader_wait", "forward", "backward", "optimizer")
    assert (
        abs(sum(phases[n]["share"] for n in built_in) + 0.0125 + phases["rest"]["share"] - 1) < 1e-3
    )
    # The same steps read from an export file give the same breakdown.
    row = _step_phases.step_row(events)
    assert row is not None
    assert phases == _step_phases.phase_breakdown([row, row], summary["phase_names"])
