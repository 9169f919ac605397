"""Custom exporters (``module:factory``): loading, one clear message per failure, the run goes on."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from tests.custom_exporters import (
    CLOSE_FILE,
    CUSTOM_DIR,
    RECORDS_FILE,
    batch,
    process_item,
    step_memory_item,
    step_time_item,
    system_item,
)
from tests.e2e_helpers import REPO
from traceml_ai.export import (
    ExportContext,
    ExporterStartFailure,
    InMemoryExporter,
    capture_export,
    create_exporter,
    load_exporter_factory,
    start_export,
)
from traceml_ai.export._custom import ExporterLoadError
from traceml_ai.settings import ExportSettings
from traceml_records import ExportLoss, ProcessRecord, StepTimeRecord


@pytest.fixture
def context(tmp_path: Path) -> ExportContext:
    return ExportContext(
        run_dir=tmp_path,
        export_dir=tmp_path / "aggregator" / "export",
        streams=("step_time",),
        include_hostname=False,
    )


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on sys.path holding the user's modules, written by each test."""
    folder = tmp_path / "user_modules"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def _write_module(folder: Path, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    sys.modules.pop(name, None)


def _failure(value: str, context: ExportContext) -> tuple[str, list[str]]:
    reported: list[str] = []
    made = create_exporter(value, context, report=reported.append)
    assert isinstance(made, ExporterStartFailure)
    assert made.value == value
    assert reported == [made.message], "exactly one message, reported once"
    assert value in made.message
    return made.message, reported


# -- each broken value gives one clear message -------------------------------------------


def test_module_missing_is_a_one_line_message(context: ExportContext) -> None:
    value = "no_such_module_xyz.sub:make"
    message, _ = _failure(value, context)
    assert len(message.splitlines()) == 1
    assert "cannot import module 'no_such_module_xyz.sub'" in message
    assert "No module named 'no_such_module_xyz'" in message
    assert "Traceback" not in message
    assert message.endswith("; export is off for this run and its records count as failed")


def test_error_inside_the_module_is_one_line_with_its_location(
    context: ExportContext, user_modules: Path
) -> None:
    _write_module(
        user_modules,
        "broken_exporter_mod",
        """
        def helper():
            raise RuntimeError("boom while importing")

        helper()
        """,
    )
    message, _ = _failure("broken_exporter_mod:make", context)
    assert "importing module 'broken_exporter_mod' raised" in message
    assert len(message.splitlines()) == 1 and "Traceback" not in message
    assert "broken_exporter_mod.py:3, in helper" in message
    assert "RuntimeError: boom while importing" in message
    assert "importlib" not in message, "importlib's own frames are noise for the user"


def test_missing_dependency_inside_the_module_names_it(
    context: ExportContext, user_modules: Path
) -> None:
    _write_module(user_modules, "needs_dep_mod", "import not_installed_dependency_xyz\n")
    message, _ = _failure("needs_dep_mod:make", context)
    assert "Traceback" not in message and "needs_dep_mod.py:1" in message
    assert "No module named 'not_installed_dependency_xyz'" in message


def test_module_calling_sys_exit_does_not_end_the_aggregator(
    context: ExportContext, user_modules: Path
) -> None:
    _write_module(user_modules, "exits_mod", "import sys\nsys.exit(3)\n")
    message, _ = _failure("exits_mod:make", context)
    assert "SystemExit: 3" in message


def test_attribute_missing(context: ExportContext) -> None:
    message, _ = _failure("tests.custom_exporters:no_such_factory", context)
    assert "module 'tests.custom_exporters' has no attribute 'no_such_factory'" in message


def test_not_callable(context: ExportContext) -> None:
    message, _ = _failure("tests.custom_exporters:NOT_CALLABLE", context)
    assert "tests.custom_exporters.NOT_CALLABLE is not callable (it is int)" in message


def test_factory_raises_is_one_line_with_its_location(context: ExportContext) -> None:
    message, _ = _failure("tests.custom_exporters:raising_factory", context)
    assert "the factory raised" in message and len(message.splitlines()) == 1
    assert "custom_exporters.py:" in message and "in raising_factory" in message
    assert "RuntimeError: factory exploded on purpose" in message


def test_factory_returns_object_without_methods(context: ExportContext) -> None:
    message, _ = _failure("tests.custom_exporters:factory_without_methods", context)
    assert "returned object, which has no callable export() or close()" in message
    message, _ = _failure("tests.custom_exporters:factory_without_close", context)
    assert "returned _ExportOnly, which has no callable close()" in message


@pytest.mark.parametrize("value", ["no_colon", "a:b:c", "1mod:make", "mod:", ":make"])
def test_malformed_value(value: str, context: ExportContext) -> None:
    message, _ = _failure(value, context)
    assert "expected 'module.path:factory'" in message


def test_load_exporter_factory_raises_load_error() -> None:
    with pytest.raises(ExporterLoadError, match="has no attribute 'nope'"):
        load_exporter_factory("tests.custom_exporters:nope")
    factory = load_exporter_factory("tests.custom_exporters:make_memory_exporter")
    assert callable(factory)


def test_module_in_the_working_directory_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, context: ExportContext
) -> None:
    """Console scripts do not put the working directory on sys.path; the loader does."""
    project = tmp_path / "project"
    (project / "my_pkg").mkdir(parents=True)
    (project / "my_pkg" / "__init__.py").write_text("")
    (project / "my_pkg" / "exporters.py").write_text(
        "from traceml_ai.export import InMemoryExporter\n"
        "def make(context):\n"
        "    return InMemoryExporter(context)\n"
    )
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(project))])
    for name in ("my_pkg", "my_pkg.exporters"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    made = create_exporter("my_pkg.exporters:make", context, report=None)
    assert isinstance(made, InMemoryExporter) and made.context == context


# -- the run goes on: failed pipeline ---------------------------------------------------------

BROKEN_VALUES = [
    "no_such_module_xyz:make",
    "tests.custom_exporters:no_such_factory",
    "tests.custom_exporters:NOT_CALLABLE",
    "tests.custom_exporters:raising_factory",
    "tests.custom_exporters:factory_without_methods",
]


@pytest.mark.parametrize("value", BROKEN_VALUES)
def test_broken_custom_exporter_counts_selected_records_as_failed(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = ExportSettings(exporter=value, export_streams="step_time,process")
    pipeline = start_export(settings, tmp_path)  # default report: stderr
    assert pipeline is not None and pipeline.failure is not None
    err = capsys.readouterr().err
    assert err.count(value) >= 1 and err.startswith("traceml: exporter ")
    assert err.count("export is off for this run") == 1, "one message, once"
    assert len(err.splitlines()) == 1, err
    pipeline.submit(batch("step_time", [step_time_item(seq=0), step_time_item(seq=1)]))
    pipeline.submit(batch("process", [process_item(seq=0), {"bad": 1}]))
    pipeline.submit(batch("step_memory", [step_memory_item()]))  # not selected: not counted
    stats = pipeline.finalize(timeout=5.0)
    assert stats.exporter_failed
    assert stats.failed_records == {"step_time": 2, "process": 1}
    assert stats.written_total == 0 and stats.skipped_items == 1
    assert pipeline.loss() == ExportLoss(
        written_records=0,
        dropped_batches=0,
        failed_records=3,
        skipped_items=1,
        exporter_failed=True,
    )
    assert capsys.readouterr().err == "", "no further message per batch"


# -- a good factory ---------------------------------------------------------------------------


def test_good_factory_receives_typed_records_of_selected_streams_only(tmp_path: Path) -> None:
    settings = ExportSettings(
        exporter="tests.custom_exporters:make_memory_exporter", export_streams="process,step_time"
    )
    pipeline = start_export(settings, tmp_path)
    assert pipeline is not None and pipeline.failure is None
    pipeline.submit(batch("step_time", [step_time_item(seq=0), step_time_item(seq=1)]))
    pipeline.submit(batch("process", [process_item(seq=5)]))
    pipeline.submit(batch("step_memory", [step_memory_item()]))
    pipeline.submit(batch("system", [system_item()]))
    stats = pipeline.finalize(timeout=5.0)
    exporter = pipeline.worker._exporter
    assert isinstance(exporter, InMemoryExporter)
    records = exporter.records
    assert set(records) == {"step_time", "process"}
    assert all(type(r) is StepTimeRecord for r in records["step_time"])
    assert [type(r) for r in records["process"]] == [ProcessRecord]
    assert exporter.context is not None and exporter.context.streams == ("step_time", "process")
    assert exporter.closed_with is not None
    assert exporter.closed_with.written_records == {"step_time": 2, "process": 1}
    assert exporter.close_calls == 1
    assert stats.to_loss() is None


def test_file_recording_factory_by_its_dotted_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tests.custom_exporters:make_exporter`` is what CLI tests pass to ``--exporter``."""
    monkeypatch.syspath_prepend(str(REPO))
    settings = ExportSettings(
        exporter="tests.custom_exporters:make_exporter",
        export_streams="step_time",
        exporter_hostname=True,
    )
    pipeline = start_export(settings, tmp_path)
    assert pipeline is not None and pipeline.failure is None
    pipeline.submit(batch("step_time", [step_time_item(seq=0), step_time_item(seq=1)]))
    pipeline.submit(batch("process", [process_item()]))
    pipeline.finalize(timeout=5.0)
    lines = [
        orjson.loads(x) for x in (tmp_path / CUSTOM_DIR / RECORDS_FILE).read_bytes().splitlines()
    ]
    assert [(d["stream"], d["class"], d["record"]["seq"]) for d in lines] == [
        ("step_time", "StepTimeRecord", 0),
        ("step_time", "StepTimeRecord", 1),
    ]
    assert lines[0]["record"]["hostname"] == "host-a"
    closed = orjson.loads((tmp_path / CUSTOM_DIR / CLOSE_FILE).read_bytes())
    assert closed["written_records"] == {"step_time": 2} and closed["dropped_batches"] == 0
    assert closed["include_hostname"] is True


def test_capture_export_collects_in_memory_exporters(tmp_path: Path) -> None:
    settings = ExportSettings(exporter="traceml_ai.export:make_in_memory_exporter")
    with capture_export() as outer:
        first = start_export(settings, tmp_path / "a")
        with capture_export() as inner:
            second = start_export(settings, tmp_path / "b")
    assert first is not None and second is not None
    assert len(outer) == 1 and len(inner) == 1 and outer[0] is not inner[0]
    second.submit(batch("step_time", [step_time_item()]))
    first.finalize(timeout=5.0)
    second.finalize(timeout=5.0)
    assert len(inner[0].records_of("step_time")) == 1 and outer[0].records == {}
    assert outer[0].closed_with is not None and outer[0].closed_with.written_records == {
        "step_time": 0
    }


def test_unused_capture_leaves_nothing_behind(tmp_path: Path) -> None:
    with capture_export() as exporters:
        pass
    pipeline = start_export(
        ExportSettings(exporter="traceml_ai.export:make_in_memory_exporter"), tmp_path
    )
    assert pipeline is not None
    pipeline.finalize(timeout=5.0)
    assert exporters == []
