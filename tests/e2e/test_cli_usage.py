"""The ``traceml`` command as a person types it: real processes, no training.

Most runs use a probe script that needs neither torch nor ``traceml.init()``: it
prints, as one JSON line, its arguments, the sampler interval the launcher handed it
and the configuration of the aggregator process the launcher started (found through
the launcher's children), so each setting's resolved value can be checked without
training anything.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e_helpers import REPO, clean_env, free_port, run_cli
from traceml_ai.settings import KNOWN_YAML_KEYS

PROBE = r"""
import json, os, sys
import psutil

config = {}
for child in psutil.Process().parent().children():
    try:
        cmd = child.cmdline()
    except psutil.Error:  # a sibling rank that just exited
        continue
    if "traceml_ai.aggregator" in cmd:
        config = json.loads(cmd[-1])
line = "PROBE " + json.dumps({
    "argv": sys.argv[1:],
    "interval": os.environ.get("TRACEML_SAMPLER_INTERVAL"),
    "world_size": os.environ.get("WORLD_SIZE"),
    "config": config,
}) + "\n"
# One write of a short line to a pipe is atomic: two ranks' lines never interleave.
os.write(1, line.encode())
print("SCRIPT-STDERR", file=sys.stderr, flush=True)
"""

UNKNOWN_KEY_HINT = "known keys: " + ", ".join(sorted(KNOWN_YAML_KEYS))


def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE, encoding="utf-8")
    return path


def probes(res: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """Every PROBE line the script (or each of its ranks) printed."""
    out = []
    for line in res.stdout.splitlines():
        if line.startswith("PROBE "):
            value = orjson.loads(line.removeprefix("PROBE "))
            assert isinstance(value, dict)
            out.append(value)
    return out


def one_probe(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert res.returncode == 0, res.stderr
    found = probes(res)
    assert len(found) == 1, res.stdout + res.stderr
    return found[0]


def launcher_lines(res: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr without the probe's own line."""
    return [line for line in res.stderr.splitlines() if line != "SCRIPT-STDERR"]


def one_error(res: subprocess.CompletedProcess[str]) -> str:
    """The single ``traceml: error:`` line of a run refused before launch (exit 2)."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("traceml: error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "traceml.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# --- item 9: options before the script, the script's arguments after it -----------------


def test_unknown_option_is_an_error_with_did_you_mean(tmp_path: Path) -> None:
    script = probe(tmp_path)
    res = run_cli(["run", "--exportr", "jsonl", script], cwd=tmp_path, timeout=60)
    assert one_error(res) == "traceml: error: no such option --exportr (did you mean --exporter?)"
    assert not probes(res)
    assert not (tmp_path / "logs").exists()


def test_everything_after_the_script_reaches_it_verbatim(tmp_path: Path) -> None:
    script = probe(tmp_path)
    args = ["--lr", "0.1", "--help", "-h", "--exportr", "x", "--", "--exporter=jsonl", "a b"]
    res = run_cli(["run", "--exporter", "jsonl", script, *args], cwd=tmp_path, timeout=60)
    found = one_probe(res)
    assert found["argv"] == args
    assert found["config"]["export"]["exporter"] == "jsonl"
    # Without the script, the same unknown option is refused.
    res = run_cli(["run", "--exportr", "x", "--lr", "0.1", script], cwd=tmp_path, timeout=60)
    assert "no such option --exportr" in one_error(res)


@pytest.mark.parametrize("form", ["space", "equals"])
def test_torchrun_underscore_spellings(tmp_path: Path, form: str) -> None:
    script = probe(tmp_path)
    values = {
        "--nproc_per_node": "2",
        "--nnodes": "1",
        "--node_rank": "0",
        "--master_addr": "127.0.0.1",
        "--master_port": str(free_port()),
    }
    options: list[str] = []
    for name, value in values.items():
        options += [name, value] if form == "space" else [f"{name}={value}"]
    res = run_cli(["run", *options, script, "--x"], cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr
    found = probes(res)
    assert len(found) == 2, res.stdout + res.stderr
    assert {p["world_size"] for p in found} == {"2"}
    assert all(p["argv"] == ["--x"] for p in found)


# --- item 13: switches, YAML forms, messages, version, help ------------------------------


def test_no_exporter_hostname_beats_env_and_yaml(tmp_path: Path) -> None:
    script = probe(tmp_path)
    write_yaml(tmp_path, "exporter_hostname: true\n")
    env = {"TRACEML_EXPORTER": "jsonl", "TRACEML_EXPORTER_HOSTNAME": "1"}
    res = run_cli(["run", "--no-exporter-hostname", script], cwd=tmp_path, env=env, timeout=60)
    assert one_probe(res)["config"]["export"]["exporter_hostname"] is False
    res = run_cli(["run", script], cwd=tmp_path, env=env, timeout=60)
    assert one_probe(res)["config"]["export"]["exporter_hostname"] is True


@pytest.mark.parametrize("word", ["off", "false", "no", "Off"])
def test_yaml_exporter_off_means_off(tmp_path: Path, word: str) -> None:
    script = probe(tmp_path)
    write_yaml(tmp_path, f"exporter: {word}\n")
    res = run_cli(["run", "--run-name", "r", script], cwd=tmp_path, timeout=60)
    assert one_probe(res)["config"]["export"]["exporter"] == ""
    assert not (tmp_path / "logs" / "r" / "aggregator" / "export").exists()


def test_env_exporter_off_means_off(tmp_path: Path) -> None:
    script = probe(tmp_path)
    write_yaml(tmp_path, "exporter: jsonl\n")
    res = run_cli(["run", script], cwd=tmp_path, env={"TRACEML_EXPORTER": "off"}, timeout=60)
    assert one_probe(res)["config"]["export"]["exporter"] == ""


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("0", False)])
def test_yaml_exporter_hostname_digits(tmp_path: Path, text: str, expected: bool) -> None:
    script = probe(tmp_path)
    write_yaml(tmp_path, f"exporter: jsonl\nexporter_hostname: {text}\n")
    res = run_cli(["run", script], cwd=tmp_path, timeout=60)
    assert one_probe(res)["config"]["export"]["exporter_hostname"] is expected


def test_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    res = run_cli(["--version"], cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"traceml {version('traceml-ai')}\n"


def test_validate_help_has_no_raw_markup(tmp_path: Path) -> None:
    res = run_cli(["validate", "--help"], cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "``" not in res.stdout
    assert "FILE:LINE: JSON-POINTER: MESSAGE" in res.stdout
    # The exit codes stay one per line (click's \b block), not re-wrapped into a paragraph.
    assert re.search(r"^\s+2\s+a usage error$", res.stdout, re.MULTILINE), res.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run"], "traceml: error: missing argument 'SCRIPT'"),
        (
            ["run", "--nproc-per-node", "two", "x.py"],
            "traceml: error: invalid value for '--nproc-per-node' / '--nproc_per_node': "
            "'two' is not a valid integer",
        ),
        (["rn", "x.py"], "traceml: error: no such command rn (did you mean run?)"),
        (["serve", "--bogus"], "traceml: error: no such option --bogus"),
        (["validate"], "traceml: error: missing argument 'PATHS...'"),
    ],
)
def test_usage_errors_are_one_prefixed_line(tmp_path: Path, args: list[str], expected: str) -> None:
    res = run_cli(args, cwd=tmp_path, timeout=60)
    assert one_error(res) == expected
    assert res.stdout == ""


def test_bare_traceml_prints_the_usage(tmp_path: Path) -> None:
    """A guard for the one-line error wrapper: asking for nothing is not an error."""
    res = run_cli([], cwd=tmp_path, timeout=60)
    assert "Usage: traceml [OPTIONS] COMMAND" in res.stdout + res.stderr
    assert "traceml: error" not in res.stderr


def test_every_launcher_line_has_the_prefix(tmp_path: Path) -> None:
    script = probe(tmp_path)
    res = run_cli(
        ["run", "--exporter", "jsonl", "--export-streams", "all", script],
        cwd=tmp_path,
        env={"TRACEML_NNODES": "2"},
        timeout=60,
    )
    one_probe(res)
    lines = launcher_lines(res)
    assert lines, res.stderr
    for line in lines:
        assert line.startswith("traceml: "), res.stderr
    # serve's env var does nothing for run: said once, as a warning.
    assert any(
        line.startswith("traceml: warning: TRACEML_NNODES is read by `traceml serve` only")
        for line in lines
    ), res.stderr


def test_custom_exporter_last_line_names_no_missing_folder(tmp_path: Path) -> None:
    script = probe(tmp_path)
    exporter = "tests.custom_exporters:make_memory_exporter"
    res = run_cli(
        ["run", "--run-name", "c", "--exporter", exporter, script], cwd=tmp_path, timeout=60
    )
    one_probe(res)
    run_dir = tmp_path / "logs" / "c"
    assert not (run_dir / "aggregator" / "export").exists()
    assert "aggregator/export" not in res.stderr
    export_lines = [x for x in res.stderr.splitlines() if x.startswith("traceml: export: ")]
    assert export_lines == ["traceml: export: 0 records passed to the custom exporter"], res.stderr


# --- item 14: every setting from one table: CLI > env > traceml.yaml > default ----------


class Case:
    """One setting: three distinct values (CLI, env, YAML) and how to read it back."""

    def __init__(self, name: str, cli: str, env: str, yaml: str, default: object) -> None:
        self.name = name
        self.cli, self.env, self.yaml, self.default = cli, env, yaml, default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def observed(name: str, found: dict[str, Any], cwd: Path) -> object:
    config = found["config"]
    run_dir = Path(config["run_dir"])
    if run_dir.is_absolute():
        run_dir = run_dir.relative_to(cwd)
    if name == "logs_dir":
        return str(run_dir.parent)
    if name == "run_name":
        return run_dir.name
    if name == "interval":
        return float(found["interval"])
    assert name == "finalize_timeout_sec"
    return float(config["finalize_timeout_sec"])


PRECEDENCE = [
    Case("logs_dir", "from-cli", "from-env", "from-yaml", "logs"),
    Case("run_name", "cli-run", "env-run", "yaml-run", None),
    Case("interval", "0.25", "0.5", "0.75", 2.0),
    Case("finalize_timeout_sec", "3", "4.5", "6", 10.0),
]


def _expected(case: Case, text: str) -> object:
    return text if case.name in ("logs_dir", "run_name") else float(text)


@pytest.mark.parametrize("case", PRECEDENCE, ids=lambda c: c.name)
def test_setting_precedence_cli_env_yaml_default(tmp_path: Path, case: Case) -> None:
    script = probe(tmp_path)
    env_name = "TRACEML_" + case.name.upper()
    layers = [
        ("cli", [case.flag, case.cli], {env_name: case.env}, True, _expected(case, case.cli)),
        ("env", [], {env_name: case.env}, True, _expected(case, case.env)),
        ("yaml", [], {}, True, _expected(case, case.yaml)),
        ("default", [], {}, False, case.default),
    ]
    for layer, flags, env, with_yaml, want in layers:
        work = tmp_path / layer
        work.mkdir()
        if with_yaml:
            write_yaml(work, f"{case.name}: {case.yaml}\n")
        res = run_cli(["run", *flags, script], cwd=work, env=env, timeout=60)
        got = observed(case.name, one_probe(res), work)
        if want is None:  # a generated run name
            assert isinstance(got, str) and re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", got), got
        else:
            assert got == want, (layer, res.stderr)


@pytest.mark.parametrize(
    ("commands", "env", "yaml_text", "expected"),
    [
        (
            ("run",),
            {"TRACEML_INTERVAL": "fast"},
            None,
            "traceml: error: TRACEML_INTERVAL: expected a positive number of seconds, got 'fast'",
        ),
        (
            ("run", "serve"),
            {},
            "finalize_timeout_sec: -1\n",
            "traceml: error: traceml.yaml ({yaml}): finalize_timeout_sec: expected a positive "
            "number of seconds, got an integer -1",
        ),
        (
            ("run", "serve"),
            {"TRACEML_AGGREGATOR_PORT": "70000"},
            None,
            "traceml: error: TRACEML_AGGREGATOR_PORT: expected an integer in [0, 65535] "
            "(0 picks a free port), got '70000'",
        ),
        (
            ("run", "serve"),
            {"TRACEML_LOGS_DIR": ""},
            None,
            "traceml: error: TRACEML_LOGS_DIR: expected a folder path, got ''",
        ),
    ],
)
def test_malformed_setting_names_setting_and_layer(
    tmp_path: Path,
    commands: tuple[str, ...],
    env: dict[str, str],
    yaml_text: str | None,
    expected: str,
) -> None:
    script = probe(tmp_path)
    if yaml_text is not None:
        write_yaml(tmp_path, yaml_text)
    for command in commands:
        args = ["run", script] if command == "run" else ["serve"]
        res = run_cli(args, cwd=tmp_path, env=env, timeout=60)
        assert one_error(res) == expected.format(yaml=tmp_path / "traceml.yaml")
        assert not probes(res)
        assert not (tmp_path / "logs").exists()


def test_unknown_yaml_key_lists_the_known_keys(tmp_path: Path) -> None:
    script = probe(tmp_path)
    write_yaml(tmp_path, "exporter: jsonl\nlogsdir: elsewhere\n")
    res = run_cli(["run", script], cwd=tmp_path, timeout=60)
    path = tmp_path / "traceml.yaml"
    assert one_error(res) == (
        f"traceml: error: traceml.yaml ({path}): unknown key 'logsdir' at $.logsdir "
        f"(did you mean 'logs_dir'?); {UNKNOWN_KEY_HINT}"
    )
    assert not probes(res)


def test_serve_reads_its_settings_from_env_and_yaml(tmp_path: Path) -> None:
    """serve resolves like run: env beats traceml.yaml for its own settings."""
    write_yaml(tmp_path, "aggregator_port: 1\nrun_name: from-yaml\nlogs_dir: yaml-logs\n")
    env = {"TRACEML_AGGREGATOR_PORT": "0", "TRACEML_NPROC_PER_NODE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_ai", "serve"],
        cwd=tmp_path,
        env=clean_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        # Port 0 (from env, not 1 from YAML) picked a free port; YAML named the folder.
        assert line.startswith("export TRACEML_AGGREGATOR_ADDR=127.0.0.1:"), line
        assert not line.split("TRACEML_AGGREGATOR_ADDR=127.0.0.1:")[1].startswith("1 ")
        assert (tmp_path / "yaml-logs" / "from-yaml").is_dir()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    for text in err.splitlines():
        assert text.startswith("traceml: "), err


def test_serve_prints_an_environment_line_a_shell_can_run(tmp_path: Path) -> None:
    """A run token set by hand may hold any character: the printed line still sets it."""
    import shlex

    token = 'it\'s a "token" $HOME'
    env = {
        "TRACEML_AGGREGATOR_PORT": "0",
        "TRACEML_NPROC_PER_NODE": "1",
        "TRACEML_RUN_TOKEN": token,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_ai", "serve", "--logs-dir", tmp_path / "logs"],
        cwd=tmp_path,
        env=clean_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    words = shlex.split(line)
    assert words[0] == "export" and words[2] == f"TRACEML_RUN_TOKEN={token}", line
    assert words[1].startswith("TRACEML_AGGREGATOR_ADDR=127.0.0.1:"), line


# --- the docs list every setting -------------------------------------------------------


def test_docs_settings_table_is_generated_from_the_table() -> None:
    """Regenerate with ``python -m traceml_ai.settings`` (it rewrites the table between
    the markers in docs/live-export.md)."""
    from traceml_ai.settings import settings_table_markdown

    text = (REPO / "docs" / "live-export.md").read_text(encoding="utf-8")
    start = text.index("<!-- settings-table:start -->\n") + len("<!-- settings-table:start -->\n")
    end = text.index("<!-- settings-table:end -->")
    assert text[start:end] == settings_table_markdown()
