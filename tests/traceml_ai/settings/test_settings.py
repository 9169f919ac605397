"""Tests for export settings resolution (CLI > env > traceml.yaml > default)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from traceml_ai import settings
from traceml_ai.settings import (
    ExportSettings,
    ExportStreams,
    SettingsError,
    exporter_kind,
    load_yaml_config,
    parse_bool_value,
    parse_exporter_value,
    resolve_export_settings,
    settings_from_values,
)
from traceml_records import STREAMS

SUPPORTED = "supported: step_time, step_memory, process, system, collectives, all"


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "traceml.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def yaml_source(path: Path) -> str:
    return f"traceml.yaml ({path.absolute()})"


def resolve(
    tmp_path: Path,
    *,
    cli_exporter: str | None = None,
    cli_export_streams: str | None = None,
    cli_exporter_hostname: bool | None = None,
    environ: dict[str, str] | None = None,
    yaml_text: str | None = None,
) -> settings.ResolvedExportSettings:
    """Resolve with an explicit env and a YAML file in tmp_path (absent when None)."""
    path = tmp_path / "traceml.yaml"
    if yaml_text is not None:
        path.write_text(yaml_text, encoding="utf-8")
    return resolve_export_settings(
        cli_exporter=cli_exporter,
        cli_export_streams=cli_export_streams,
        cli_exporter_hostname=cli_exporter_hostname,
        environ={} if environ is None else environ,
        yaml_path=path,
    )


# --- precedence ---------------------------------------------------------------------


class Layers(NamedTuple):
    """One setting's CLI kwarg, flag, env var and the value each layer supplies."""

    kwarg: str
    flag: str
    env_name: str
    cli_value: object
    env_text: str
    yaml_text: str
    cli_expected: object
    env_expected: object
    yaml_expected: object
    default: object


PRECEDENCE_CASES = {
    "exporter": Layers(
        "cli_exporter",
        "--exporter",
        "TRACEML_EXPORTER",
        "jsonl",
        "env_pkg.mod:make",
        "yaml_pkg:factory",
        "jsonl",
        "env_pkg.mod:make",
        "yaml_pkg:factory",
        "",
    ),
    "export_streams": Layers(
        "cli_export_streams",
        "--export-streams",
        "TRACEML_EXPORT_STREAMS",
        "step_memory",
        "process",
        "step_time,step_memory",
        "step_memory",
        "process",
        "step_time,step_memory",
        "step_time",
    ),
    "exporter_hostname": Layers(
        "cli_exporter_hostname",
        "--exporter-hostname",
        "TRACEML_EXPORTER_HOSTNAME",
        True,
        "off",
        "yes",
        True,
        False,
        True,
        False,
    ),
}


@pytest.mark.parametrize("setting", sorted(PRECEDENCE_CASES))
@pytest.mark.parametrize(
    ("use_cli", "use_env", "use_yaml"), list(itertools.product([False, True], repeat=3))
)
def test_precedence_matrix(
    tmp_path: Path, setting: str, use_cli: bool, use_env: bool, use_yaml: bool
) -> None:
    case = PRECEDENCE_CASES[setting]
    path = write_yaml(tmp_path, f"{setting}: {case.yaml_text}\n" if use_yaml else "{}\n")
    cli: dict[str, object] = {
        "cli_exporter": None,
        "cli_export_streams": None,
        "cli_exporter_hostname": None,
    }
    if use_cli:
        cli[case.kwarg] = case.cli_value
    environ = {case.env_name: case.env_text} if use_env else {}

    resolved = resolve_export_settings(
        environ=environ,
        yaml_path=path,
        **cli,  # type: ignore[arg-type]
    )

    want_value: object
    if use_cli:
        want_value, want_source = case.cli_expected, case.flag
    elif use_env:
        want_value, want_source = case.env_expected, case.env_name
    elif use_yaml:
        want_value, want_source = case.yaml_expected, yaml_source(path)
    else:
        want_value, want_source = case.default, "default"
    value = getattr(resolved.settings, setting)
    if isinstance(value, ExportStreams):  # the typed value keeps the text as written
        value = value.text
    assert value == want_value
    assert getattr(resolved.sources, setting) == want_source
    # The other two settings are untouched by this one's layers.
    for other in PRECEDENCE_CASES:
        if other != setting:
            assert getattr(resolved.sources, other) == "default"
    assert resolved.warnings == ()


def test_settings_resolve_independently(tmp_path: Path) -> None:
    resolved = resolve(
        tmp_path,
        cli_exporter="jsonl",
        environ={"TRACEML_EXPORT_STREAMS": " step_time , process "},
        yaml_text="exporter: my.mod:f\nexport_streams: all\nexporter_hostname: true\n",
    )
    assert resolved.settings == ExportSettings("jsonl", "step_time , process", True)
    assert resolved.sources.exporter == "--exporter"
    assert resolved.sources.export_streams == "TRACEML_EXPORT_STREAMS"
    assert resolved.sources.exporter_hostname == yaml_source(tmp_path / "traceml.yaml")
    assert resolved.selected_streams == ("step_time", "process")


def test_defaults_without_file(tmp_path: Path) -> None:
    resolved = resolve(tmp_path)
    assert resolved.settings == ExportSettings("", "step_time", False)
    assert resolved.settings.exporter_kind == "off"
    assert resolved.selected_streams == ("step_time",)
    assert resolved.sources == settings.SettingSources("default", "default", "default")
    assert resolved.warnings == ()


def test_yaml_looked_up_in_cwd_and_env_from_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_yaml(tmp_path, "exporter: jsonl\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRACEML_EXPORT_STREAMS", "system")
    monkeypatch.delenv("TRACEML_EXPORTER", raising=False)
    monkeypatch.delenv("TRACEML_EXPORTER_HOSTNAME", raising=False)
    resolved = resolve_export_settings(
        cli_exporter=None, cli_export_streams=None, cli_exporter_hostname=None
    )
    assert resolved.settings.exporter == "jsonl"
    assert resolved.sources.exporter == f"traceml.yaml ({tmp_path.resolve() / 'traceml.yaml'})"
    assert resolved.sources.export_streams == "TRACEML_EXPORT_STREAMS"
    assert resolved.selected_streams == ("system", "system_gpu")


def test_empty_env_exporter_is_explicit_off(tmp_path: Path) -> None:
    resolved = resolve(tmp_path, environ={"TRACEML_EXPORTER": ""}, yaml_text="exporter: jsonl\n")
    assert resolved.settings.exporter == ""
    assert resolved.sources.exporter == "TRACEML_EXPORTER"


def test_cli_empty_exporter_turns_off_env(tmp_path: Path) -> None:
    resolved = resolve(tmp_path, cli_exporter="", environ={"TRACEML_EXPORTER": "jsonl"})
    assert resolved.settings.exporter == ""
    assert resolved.sources.exporter == "--exporter"


def test_yaml_null_counts_as_not_set(tmp_path: Path) -> None:
    resolved = resolve(
        tmp_path, yaml_text="exporter: null\nexport_streams: ~\nexporter_hostname:\n"
    )
    assert resolved.settings == ExportSettings()
    assert resolved.sources == settings.SettingSources("default", "default", "default")


def test_bad_value_in_shadowed_layer_is_ignored(tmp_path: Path) -> None:
    resolved = resolve(
        tmp_path,
        cli_exporter="jsonl",
        cli_export_streams="process",
        cli_exporter_hostname=False,
        environ={"TRACEML_EXPORTER": "nope", "TRACEML_EXPORTER_HOSTNAME": "maybe"},
        yaml_text="export_streams: bogus\n",
    )
    assert resolved.settings == ExportSettings("jsonl", "process", False)


def test_all_selects_every_stream(tmp_path: Path) -> None:
    resolved = resolve(tmp_path, cli_export_streams="all")
    assert resolved.selected_streams == tuple(s.name for s in STREAMS)
    assert set(resolved.selected_streams) >= {"runtime_environment", "stdout_stderr"}


# --- bad values name their source ---------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"cli_exporter": "jsonl:"},
            "--exporter: expected '' (off), 'jsonl', or 'module.path:factory', got 'jsonl:'",
        ),
        (
            {"environ": {"TRACEML_EXPORTER": "JSONL"}},
            "TRACEML_EXPORTER: expected '' (off), 'jsonl', or 'module.path:factory', got 'JSONL'",
        ),
        (
            {"yaml_text": "exporter: a-b:c\n"},
            "{yaml}: exporter: expected '' (off), 'jsonl', or 'module.path:factory', got 'a-b:c'",
        ),
        (
            {"cli_export_streams": "stepp_time"},
            f"--export-streams: unknown stream 'stepp_time'; {SUPPORTED}",
        ),
        (
            {"environ": {"TRACEML_EXPORT_STREAMS": "stepp_time"}},
            f"TRACEML_EXPORT_STREAMS: unknown stream 'stepp_time'; {SUPPORTED}",
        ),
        (
            {"yaml_text": "export_streams: step_time,stepp_time\n"},
            f"{{yaml}}: export_streams: unknown stream 'stepp_time'; {SUPPORTED}",
        ),
        (
            {"environ": {"TRACEML_EXPORTER_HOSTNAME": "maybe"}},
            "TRACEML_EXPORTER_HOSTNAME: expected one of 1/0, true/false, yes/no, on/off, "
            "got 'maybe'",
        ),
        (
            {"yaml_text": "exporter_hostname: 'maybe'\n"},
            "{yaml}: exporter_hostname: expected one of 1/0, true/false, yes/no, on/off, "
            "got 'maybe'",
        ),
    ],
)
def test_bad_value_messages_name_source(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message.format(yaml=yaml_source(tmp_path / "traceml.yaml"))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "prefix"),
    [
        ({"environ": {"TRACEML_EXPORT_STREAMS": ""}}, "TRACEML_EXPORT_STREAMS: "),
        ({"cli_export_streams": ""}, "--export-streams: "),
        ({"cli_export_streams": "step_time,,process"}, "--export-streams: "),
        ({"yaml_text": "export_streams: ''\n"}, "traceml.yaml ("),
        ({"environ": {"TRACEML_EXPORTER_HOSTNAME": ""}}, "TRACEML_EXPORTER_HOSTNAME: "),
    ],
)
def test_empty_values_are_errors(tmp_path: Path, kwargs: dict[str, object], prefix: str) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith(prefix)
    assert "supported" in str(info.value) or "expected" in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cli_export_streams": "nope"},
        {"environ": {"TRACEML_EXPORTER": "", "TRACEML_EXPORT_STREAMS": "nope"}},
        {"cli_exporter": "", "yaml_text": "export_streams: nope\n"},
        {"yaml_text": "exporter: ''\nexport_streams: nope\n"},
    ],
)
def test_export_streams_checked_while_exporter_off(
    tmp_path: Path, kwargs: dict[str, object]
) -> None:
    with pytest.raises(SettingsError, match="unknown stream 'nope'"):
        resolve(tmp_path, **kwargs)  # type: ignore[arg-type]


# --- booleans -----------------------------------------------------------------------

TRUE_WORDS = ["1", "true", "yes", "on"]
FALSE_WORDS = ["0", "false", "no", "off"]


def case_variants(word: str) -> list[str]:
    return [word, word.upper(), word.capitalize(), f"  {word.swapcase()}\t"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [(v, True) for w in TRUE_WORDS for v in case_variants(w)]
    + [(v, False) for w in FALSE_WORDS for v in case_variants(w)],
)
def test_bool_forms(tmp_path: Path, text: str, expected: bool) -> None:
    assert parse_bool_value(text) is expected
    from_env = resolve(tmp_path, environ={"TRACEML_EXPORTER_HOSTNAME": text})
    assert from_env.settings.exporter_hostname is expected
    from_yaml = resolve(tmp_path, yaml_text=f"exporter_hostname: {text.strip()!r}\n")
    assert from_yaml.settings.exporter_hostname is expected


@pytest.mark.parametrize("text", ["maybe", "", " ", "2", "y", "n", "tru", "enable", "1.0"])
def test_bool_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"got {text!r}")):
        parse_bool_value(text)


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("on", True), ("no", False)])
def test_yaml_native_booleans(tmp_path: Path, text: str, expected: bool) -> None:
    resolved = resolve(tmp_path, yaml_text=f"exporter_hostname: {text}\n")
    assert resolved.settings.exporter_hostname is expected


# --- YAML file handling -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("exporter: jsonl\nexport_streams: [step_time\n", 3),
        ("exporter: jsonl\n bad: x: y\n", 2),
        ("exporter: jsonl\n\texporter_hostname: 1\n", 2),
    ],
)
def test_yaml_syntax_error_names_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path, yaml_text=text)
    message = str(info.value)
    assert message.startswith(f"{yaml_source(tmp_path / 'traceml.yaml')}: invalid YAML at ")
    assert f"line {line}, column " in message


def test_yaml_syntax_error_raised_even_when_cli_sets_everything(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="invalid YAML at line 1"):
        resolve(
            tmp_path,
            cli_exporter="jsonl",
            cli_export_streams="all",
            cli_exporter_hostname=True,
            yaml_text="exporter: a: b\n",
        )


@pytest.mark.parametrize(
    ("text", "kind"),
    [("- exporter\n", "a list"), ("jsonl\n", "a string"), ("3\n", "an integer")],
)
def test_yaml_top_level_must_be_mapping(tmp_path: Path, text: str, kind: str) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path, yaml_text=text)
    assert str(info.value) == (
        f"{yaml_source(tmp_path / 'traceml.yaml')}: expected a mapping of setting names to "
        f"values at the top level, got {kind}"
    )


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_empty_yaml_file_is_fine(tmp_path: Path, text: str) -> None:
    assert resolve(tmp_path, yaml_text=text).settings == ExportSettings()


KNOWN_KEYS = "known keys: " + ", ".join(sorted(settings.KNOWN_YAML_KEYS))


def test_unknown_yaml_key_is_an_error_listing_known_keys(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path, yaml_text="exporter: jsonl\nexport_stream: all\nlogs_dir: /tmp\n7: x\n")
    source = yaml_source(tmp_path / "traceml.yaml")
    assert str(info.value) == (
        f"{source}: unknown keys 'export_stream' at $.export_stream (did you mean 'export_streams'?), "
        f"7 at $[7]; {KNOWN_KEYS}"
    )


def test_one_unknown_yaml_key(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path, yaml_text="logsdir: /tmp\n")
    source = yaml_source(tmp_path / "traceml.yaml")
    assert str(info.value) == (
        f"{source}: unknown key 'logsdir' at $.logsdir (did you mean 'logs_dir'?); {KNOWN_KEYS}"
    )


def test_known_yaml_keys_can_be_extended(tmp_path: Path) -> None:
    # The documented way: add to the one set (the resolution reads that same set).
    settings.KNOWN_YAML_KEYS.add("my_feature")
    try:
        resolved = resolve(tmp_path, yaml_text="my_feature: 1\nexporter: jsonl\n")
    finally:
        settings.KNOWN_YAML_KEYS.discard("my_feature")
    assert resolved.warnings == ()
    assert resolved.settings.exporter == "jsonl"


def test_known_yaml_keys_are_the_table() -> None:
    assert {s.yaml_key for s in settings.SETTINGS} == settings.KNOWN_YAML_KEYS


STREAM_FORMS = (
    "comma-separated stream names from step_time, step_memory, process, system, collectives, all"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "exporter: on\n",
            "exporter: expected '' (off), 'jsonl', or 'module.path:factory', got a boolean True",
        ),
        (
            "exporter: 3\n",
            "exporter: expected '' (off), 'jsonl', or 'module.path:factory', got an integer 3",
        ),
        (
            "export_streams: [step_time, process]\n",
            f"export_streams: expected {STREAM_FORMS}, got a list ['step_time', 'process']",
        ),
        (
            "export_streams: 1.5\n",
            f"export_streams: expected {STREAM_FORMS}, got a number 1.5",
        ),
        (
            "exporter_hostname: 2\n",
            "exporter_hostname: expected one of 1/0, true/false, yes/no, on/off, got an integer 2",
        ),
        (
            "exporter_hostname: {a: 1}\n",
            "exporter_hostname: expected one of 1/0, true/false, yes/no, on/off, "
            "got a mapping {'a': 1}",
        ),
    ],
)
def test_yaml_wrong_types_name_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path, yaml_text=text)
    assert str(info.value) == f"{yaml_source(tmp_path / 'traceml.yaml')}: {message}"


def test_unreadable_yaml_names_path(tmp_path: Path) -> None:
    path = tmp_path / "traceml.yaml"
    path.mkdir()
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path)
    assert str(info.value).startswith(f"{yaml_source(path)}: cannot read file: ")


def test_non_utf8_yaml_names_path(tmp_path: Path) -> None:
    path = tmp_path / "traceml.yaml"
    path.write_bytes(b"exporter: \xff\xfe\n")
    with pytest.raises(SettingsError) as info:
        resolve(tmp_path)
    assert str(info.value).startswith(f"{yaml_source(path)}: not valid UTF-8")


def test_load_yaml_config_missing_file(tmp_path: Path) -> None:
    assert load_yaml_config(tmp_path / "absent" / "traceml.yaml") is None
    config = load_yaml_config(write_yaml(tmp_path, "exporter: jsonl\nother: 1\n"))
    assert config is not None
    assert dict(config.data) == {"exporter": "jsonl", "other": 1}


# --- exporter values ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "kind"),
    [
        ("", "", "off"),
        ("   ", "", "off"),
        ("jsonl", "jsonl", "jsonl"),
        (" jsonl\n", "jsonl", "jsonl"),
        ("a:b", "a:b", "custom"),
        ("my_pkg.my_mod:make_exporter", "my_pkg.my_mod:make_exporter", "custom"),
        ("  _p.q2.r:_Factory ", "_p.q2.r:_Factory", "custom"),
        ("jsonl:make", "jsonl:make", "custom"),
    ],
)
def test_exporter_valid_forms(tmp_path: Path, text: str, expected: str, kind: str) -> None:
    assert parse_exporter_value(text) == expected
    assert exporter_kind(text) == kind
    resolved = resolve(tmp_path, environ={"TRACEML_EXPORTER": text})
    assert resolved.settings.exporter == expected
    assert resolved.settings.exporter_kind == kind


@pytest.mark.parametrize(
    "text",
    [
        "a",
        "a:",
        ":b",
        "a:b:c",
        "1a:b",
        "a-b:c",
        "a.:b",
        ".a:b",
        "a..b:c",
        "a:b.c",
        "a:1b",
        "a :b",
        "a: b",
        "JSONL",
        "json",
        "offf",
        "a/b:c",
    ],
)
def test_exporter_invalid_forms(text: str) -> None:
    expected = f"expected '' (off), 'jsonl', or 'module.path:factory', got {text!r}"
    with pytest.raises(ValueError) as info:
        parse_exporter_value(text)
    assert str(info.value) == expected
    with pytest.raises(ValueError, match=re.escape(expected)):
        exporter_kind(text)


identifier = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)


@given(module=st.lists(identifier, min_size=1, max_size=4), factory=identifier)
def test_exporter_any_dotted_module_and_factory_accepted(module: list[str], factory: str) -> None:
    value = f"{'.'.join(module)}:{factory}"
    assert parse_exporter_value(f" {value} ") == value
    assert exporter_kind(value) == "custom"


@given(text=st.text(max_size=20))
def test_exporter_parse_accepts_only_documented_forms(text: str) -> None:
    try:
        value = parse_exporter_value(text)
    except ValueError as exc:
        assert str(exc).startswith("expected '' (off), 'jsonl', or 'module.path:factory'")
        return
    if text.strip().lower() in ("off", "false", "no", "0"):
        assert value == ""
        return
    assert value == text.strip()
    assert value in ("", "jsonl") or value.count(":") == 1


# --- programmatic values (Ray) and round trip ---------------------------------------


def test_settings_from_values_ok() -> None:
    resolved = settings_from_values(
        exporter=" jsonl ",
        export_streams="step_time,system",
        exporter_hostname=True,
        source="TraceMLRayConfig",
    )
    assert resolved.settings == ExportSettings("jsonl", "step_time,system", True)
    assert resolved.selected_streams == ("step_time", "system", "system_gpu")
    assert resolved.sources == settings.SettingSources(*["TraceMLRayConfig"] * 3)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"exporter": "a:b:c"},
            "TraceMLRayConfig.exporter: expected '' (off), 'jsonl', or 'module.path:factory', "
            "got 'a:b:c'",
        ),
        (
            {"export_streams": "stepp_time"},
            f"TraceMLRayConfig.export_streams: unknown stream 'stepp_time'; {SUPPORTED}",
        ),
        (
            {"exporter_hostname": "yes"},
            "TraceMLRayConfig.exporter_hostname: expected a boolean, got a string 'yes'",
        ),
        (
            {"exporter": None},
            "TraceMLRayConfig.exporter: expected a string, '' (off), 'jsonl', or "
            "'module.path:factory'; got None",
        ),
    ],
)
def test_settings_from_values_errors(values: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "exporter": "",
        "export_streams": "step_time",
        "exporter_hostname": False,
        **values,
    }
    with pytest.raises(SettingsError) as info:
        settings_from_values(source="TraceMLRayConfig", **args)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "value",
    [
        ExportSettings(),
        ExportSettings("jsonl", "all", True),
        ExportSettings("pkg.mod:make", "step_memory,process", False),
    ],
)
def test_as_environ_round_trips(tmp_path: Path, value: ExportSettings) -> None:
    resolved = resolve(tmp_path, environ=value.as_environ(), yaml_text="exporter: jsonl\n")
    assert resolved.settings == value
    assert resolved.sources == settings.SettingSources(
        "TRACEML_EXPORTER", "TRACEML_EXPORT_STREAMS", "TRACEML_EXPORTER_HOSTNAME"
    )


# --- the launcher's other settings (one table) -----------------------------------------

LAUNCH_CASES: dict[str, tuple[str, str, str, object, object, object, object]] = {
    # name: (cli text, env text, yaml text, cli value, env value, yaml value, default)
    "logs_dir": ("c", "e", "y", Path("c"), Path("e"), Path("y"), Path("logs")),
    "run_name": ("c", "e", "'2024'", "c", "e", "2024", None),
    "interval": ("0.5", "1", "3", 0.5, 1.0, 3.0, 2.0),
    "finalize_timeout_sec": ("1", "2.5", "7.5", 1.0, 2.5, 7.5, 10.0),
    "aggregator_host": ("h1", "h2", "h3", "h1", "h2", "h3", None),
    "aggregator_port": ("0", "29601", "29602", 0, 29601, 29602, None),
    "aggregator_bind_host": ("0.0.0.0", "::", "10.0.0.1", "0.0.0.0", "::", "10.0.0.1", "127.0.0.1"),
    "nnodes": ("2", "3", "4", 2, 3, 4, None),
    "nproc_per_node": ("8", "4", "2", 8, 4, 2, None),
}


@pytest.mark.parametrize("name", sorted(LAUNCH_CASES))
@pytest.mark.parametrize(
    ("use_cli", "use_env", "use_yaml"), list(itertools.product([False, True], repeat=3))
)
def test_launch_precedence_matrix(
    tmp_path: Path, name: str, use_cli: bool, use_env: bool, use_yaml: bool
) -> None:
    cli_text, env_text, yaml_text, cli_v, env_v, yaml_v, default = LAUNCH_CASES[name]
    setting = next(s for s in settings.SETTINGS if s.name == name)
    command = setting.commands[0]
    path = write_yaml(tmp_path, f"{name}: {yaml_text}\n" if use_yaml else "{}\n")
    launch = settings.resolve_launch_settings(
        command,
        {name: cli_text} if use_cli else {},
        environ={setting.env: env_text} if use_env else {},
        yaml_path=path,
    )
    if use_cli:
        want, source = cli_v, setting.flag
    elif use_env:
        want, source = env_v, setting.env
    elif use_yaml:
        want, source = yaml_v, yaml_source(path)
    else:
        want, source = default, "default"
    assert getattr(launch, name) == want
    assert launch.sources[name] == source


def test_settings_of_another_command_are_not_read(tmp_path: Path) -> None:
    environ = {"TRACEML_AGGREGATOR_BIND_HOST": "0.0.0.0", "TRACEML_INTERVAL": "nonsense"}
    launch = settings.resolve_launch_settings(
        "serve", {}, environ=environ, yaml_path=tmp_path / "absent.yaml"
    )
    assert launch.aggregator_bind_host == "0.0.0.0"
    assert launch.interval == 2.0 and launch.sources["interval"] == "default"
    run = settings.resolve_launch_settings(
        "run", {}, environ={"TRACEML_AGGREGATOR_BIND_HOST": "x y"}, yaml_path=tmp_path / "a"
    )
    assert run.aggregator_bind_host == "127.0.0.1"
    assert run.warnings == ()


def test_run_warns_about_serve_world_size_settings(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "nproc_per_node: 4\n")
    launch = settings.resolve_launch_settings(
        "run", {}, environ={"TRACEML_NNODES": "2"}, yaml_path=path
    )
    assert launch.nnodes is None and launch.nproc_per_node is None
    assert launch.warnings == (
        "TRACEML_NNODES is read by `traceml serve` only; "
        "`traceml run` takes --nnodes on its command line, as torchrun does",
        f"{yaml_source(path)}: nproc_per_node is read by `traceml serve` only; "
        "`traceml run` takes --nproc-per-node on its command line, as torchrun does",
    )
    serve = settings.resolve_launch_settings("serve", {}, environ={}, yaml_path=path)
    assert serve.nproc_per_node == 4 and serve.warnings == ()


@pytest.mark.parametrize(
    ("cli", "environ", "yaml_text", "message"),
    [
        ({"interval": "0"}, {}, None, "--interval: expected a positive number of seconds, got '0'"),
        # Past what a clock or a wait takes, and past a 64-bit integer: one line each,
        # never a traceback (in the launcher or, later, in the aggregator).
        (
            {"finalize_timeout_sec": "1e300"},
            {},
            None,
            "--finalize-timeout-sec: expected a positive number of seconds up to a year "
            "(31536000), got '1e300'",
        ),
        (
            {"tracker_every_steps": "99999999999999999999999"},
            {},
            None,
            "--tracker-every-steps: expected a whole number from 1 to 2147483647, "
            "got '99999999999999999999999'",
        ),
        (
            {},
            {"TRACEML_TRACKER_EVERY_STEPS": "99999999999999999999999"},
            None,
            "TRACEML_TRACKER_EVERY_STEPS: expected a whole number from 1 to 2147483647, "
            "got '99999999999999999999999'",
        ),
        (
            {},
            {"TRACEML_INTERVAL": "nan"},
            None,
            "TRACEML_INTERVAL: expected a positive number of seconds, got 'nan'",
        ),
        (
            {},
            {},
            "interval: true\n",
            "{yaml}: interval: expected a positive number of seconds, got a boolean True",
        ),
        (
            {},
            {},
            "tracker_every_steps: 99999999999999999999999\n",
            "{yaml}: tracker_every_steps: expected a whole number from 1 to 2147483647, "
            "got an integer 99999999999999999999999",
        ),
        (
            {},
            {},
            "finalize_timeout_sec: 1.0e+300\n",
            "{yaml}: finalize_timeout_sec: expected a positive number of seconds up to a year "
            "(31536000), got a number 1e+300",
        ),
        (
            {},
            {},
            "finalize_timeout_sec: .inf\n",
            "{yaml}: finalize_timeout_sec: expected a positive number of seconds, got a number inf",
        ),
        (
            {"aggregator_port": "-1"},
            {},
            None,
            "--aggregator-port: expected an integer in [0, 65535] (0 picks a free port), got '-1'",
        ),
        (
            {},
            {},
            "aggregator_port: 1.5\n",
            "{yaml}: aggregator_port: expected an integer in [0, 65535] (0 picks a free port), "
            "got a number 1.5",
        ),
        (
            {},
            {"TRACEML_AGGREGATOR_HOST": ""},
            None,
            "TRACEML_AGGREGATOR_HOST: expected a host name or an IP address, got ''",
        ),
        ({}, {"TRACEML_RUN_NAME": ""}, None, "TRACEML_RUN_NAME: expected a folder name, got ''"),
        (
            {},
            {},
            "logs_dir: [a, b]\n",
            "{yaml}: logs_dir: expected a folder path, got a list ['a', 'b']",
        ),
    ],
)
def test_launch_bad_values_name_setting_and_layer(
    tmp_path: Path,
    cli: dict[str, object],
    environ: dict[str, str],
    yaml_text: str | None,
    message: str,
) -> None:
    path = tmp_path / "traceml.yaml"
    if yaml_text is not None:
        path.write_text(yaml_text, encoding="utf-8")
    with pytest.raises(SettingsError) as info:
        settings.resolve_launch_settings("run", cli, environ=environ, yaml_path=path)
    assert str(info.value) == message.format(yaml=yaml_source(path))


def test_serve_count_settings_reject_zero(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"^TRACEML_NPROC_PER_NODE: expected a whole number"):
        settings.resolve_launch_settings(
            "serve", {}, environ={"TRACEML_NPROC_PER_NODE": "0"}, yaml_path=tmp_path / "a"
        )


@pytest.mark.parametrize("word", ["off", "false", "no", "0", "OFF", " Off "])
def test_off_words_switch_export_off_in_every_layer(tmp_path: Path, word: str) -> None:
    assert parse_exporter_value(word) == ""
    assert resolve(tmp_path, cli_exporter=word, environ={"TRACEML_EXPORTER": "jsonl"}).settings == (
        ExportSettings()
    )
    assert resolve(tmp_path, environ={"TRACEML_EXPORTER": word}).settings.exporter == ""


@pytest.mark.parametrize(("text", "expected"), [("off", ""), ("false", ""), ("no", "")])
def test_yaml_exporter_boolean_false_is_off(tmp_path: Path, text: str, expected: str) -> None:
    resolved = resolve(tmp_path, yaml_text=f"exporter: {text}\n")
    assert resolved.settings.exporter == expected
    assert resolved.sources.exporter == yaml_source(tmp_path / "traceml.yaml")


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("0", False)])
def test_yaml_exporter_hostname_digits(tmp_path: Path, text: str, expected: bool) -> None:
    resolved = resolve(tmp_path, yaml_text=f"exporter_hostname: {text}\n")
    assert resolved.settings.exporter_hostname is expected


def test_every_setting_has_flag_env_and_key() -> None:
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    for s in settings.SETTINGS:
        name = s.name.removesuffix("s") if s.repeatable else s.name
        assert s.flag == "--" + name.replace("_", "-")
        assert s.env == "TRACEML_" + s.name.upper()
        assert s.yaml_key == s.name
        assert f"`{s.env}`" in settings.settings_table_markdown()


def test_launch_settings_label_names_the_layer(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "logs_dir: y\n")
    launch = settings.resolve_launch_settings(
        "run", {"interval": "1"}, environ={"TRACEML_RUN_NAME": "r"}, yaml_path=path
    )
    assert launch.label("interval") == "--interval"
    assert launch.label("run_name") == "TRACEML_RUN_NAME"
    assert launch.label("logs_dir") == f"{yaml_source(path)}: logs_dir"
    assert launch.label("finalize_timeout_sec") == "--finalize-timeout-sec"


# --- bounds: in the table, checked in one place --------------------------------------------

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("args", "env", "yaml_text", "bound"),
    [
        (["run", "--tracker-every-steps", "99999999999999999999999"], {}, None, "2147483647"),
        (["run"], {"TRACEML_TRACKER_EVERY_STEPS": "99999999999999999999999"}, None, "2147483647"),
        (["run"], {}, "tracker_every_steps: 99999999999999999999999\n", "2147483647"),
        (["run", "--finalize-timeout-sec", "1e300"], {}, None, "a year (31536000)"),
        (["serve", "--finalize-timeout-sec", "1e300"], {}, None, "a year (31536000)"),
        (["serve", "--aggregator-port", "65536"], {}, None, "[0, 65535]"),
    ],
)
def test_a_value_past_its_bound_is_one_error_line_naming_the_bound(
    tmp_path: Path, args: list[str], env: dict[str, str], yaml_text: str | None, bound: str
) -> None:
    """The real command: one ``traceml: error:`` line that names the bound, no traceback,
    and nothing started."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    if yaml_text is not None:
        (tmp_path / "traceml.yaml").write_text(yaml_text, encoding="utf-8")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    proc = subprocess.run(
        [sys.executable, "-m", "traceml_ai", *args, *([str(script)] if args[0] == "run" else [])],
        cwd=tmp_path,
        env={**clean, "PYTHONPATH": str(REPO / "src"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("traceml: error: "), lines[0]
    assert bound in lines[0], lines[0]
    assert "must not run" not in proc.stderr + proc.stdout


def test_every_number_setting_has_its_bounds_in_the_table() -> None:
    from traceml_ai.settings._parse import parse_number, parse_whole

    for setting in settings.SETTINGS:
        is_number = setting.parse in (parse_whole, parse_number)
        default = setting.default
        if isinstance(default, int | float) and not isinstance(default, bool):
            assert is_number, setting.name
        assert (setting.bounds is not None) == is_number, setting.name
        if setting.bounds is not None:
            assert setting.expected == setting.bounds.expected
            assert not setting.forms, f"{setting.name}: its bounds say what it takes"


@pytest.mark.parametrize("setting", settings.SETTINGS, ids=lambda s: s.name)
def test_a_bounded_setting_takes_its_bounds_and_nothing_past_them(
    setting: settings.Setting[object],
) -> None:
    bounds = setting.bounds
    if bounds is None:
        return
    low = bounds.low if bounds.whole else 0.001
    assert setting.read(str(low)) == low
    assert setting.read(str(bounds.high)) == bounds.high
    for text in (str(bounds.high + 1), str(bounds.low - 1), "x", "nan", "inf"):
        with pytest.raises(settings.OutOfBounds) as info:
            setting.read(text)
        named = bounds.expected_in_full if text == str(bounds.high + 1) else bounds.expected
        assert info.value.expected == named, text


def test_every_setting_is_a_field_of_one_typed_object() -> None:
    """Resolution fills each typed object from the table by field name: every setting
    has one field, in one of them."""
    from traceml_ai.settings import LaunchSettings, MonitorSettings

    names = [
        s.name
        for cls in (ExportSettings, MonitorSettings, LaunchSettings)
        for s in settings.table_settings(cls)
    ]
    assert sorted(names) == sorted(settings.SETTINGS_BY_NAME)


def test_a_typed_field_no_setting_has_is_refused_when_the_class_is_made() -> None:
    import attrs

    with pytest.raises(TypeError, match="no setting has this name"):

        @attrs.frozen(field_transformer=settings.settings_fields)
        class Typo:
            intervall: float = settings.FROM_TABLE
