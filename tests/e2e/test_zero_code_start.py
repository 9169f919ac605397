"""``traceml run X`` starts X exactly as ``python X`` does, and says what happened when a
rank sent nothing.

Each case runs ``python X`` and ``traceml run X`` as real processes on real files and
compares what the script sees (``type(__builtins__)``, ``sys.path[0]``, ``__file__``,
``__name__``, ``sys.argv``, its ``__main__`` globals), its output and the exit code.
The scripts do not import torch, so each run takes a second or two.
"""

from __future__ import annotations

import os
import py_compile
import signal
import subprocess
import sysconfig
import time
import zipapp
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import traceml_ai
from tests.e2e_helpers import PY, clean_env, run_cli, start_cli

PROBE = """\
import sys
print("BUILTINS", type(__builtins__).__name__)
print("PATH0", sys.path[0])
print("FILE", __file__)
print("NAME", __name__)
print("ARGV", sys.argv)
print("PACKAGE", repr(__package__))
print("SPEC", getattr(__spec__, "origin", None))
print("LOADER", type(__loader__).__name__)
print("GLOBALS", sorted(k for k in globals() if k.startswith("__")))
print("MAIN", sys.modules["__main__"].__dict__ is globals())
raise SystemExit(int(sys.argv[1]))
"""

RAISES = """\
print("before", flush=True)

def train():
    raise ValueError("boom")

train()
"""

TRACED = """\
import os, sys, time
import traceml_ai as traceml

traceml.init()
for _ in range(3):
    with traceml.trace_step():
        time.sleep(0.01)
print("steps done", flush=True)
if sys.argv[1:] == ["os._exit"]:
    os._exit(0)
"""


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def _traceml(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_cli(
        ["run", "--logs-dir", cwd / "logs", "--exporter", "off", *args], cwd=cwd, env=env
    )


def _ours(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("traceml: ")]


def _not_ours(stderr: str) -> str:
    return "".join(
        line for line in stderr.splitlines(keepends=True) if not line.startswith("traceml: ")
    )


def _symlink(tmp: Path) -> list[str]:
    (tmp / "real").mkdir()
    (tmp / "real" / "train.py").write_text(PROBE)
    (tmp / "other").mkdir()
    (tmp / "other" / "link.py").symlink_to(Path("..") / "real" / "train.py")
    return ["other/link.py", "0", "--flag"]


def _zipapp(tmp: Path) -> list[str]:
    (tmp / "src").mkdir()
    (tmp / "src" / "__main__.py").write_text(PROBE)
    zipapp.create_archive(tmp / "src", tmp / "app.pyz")
    return ["app.pyz", "7"]


def _folder(tmp: Path) -> list[str]:
    (tmp / "app").mkdir()
    (tmp / "app" / "__main__.py").write_text(PROBE)
    return ["app", "5", "x"]


def _pyc(tmp: Path) -> list[str]:
    (tmp / "probe.py").write_text(PROBE)
    py_compile.compile(str(tmp / "probe.py"), cfile=str(tmp / "probe.pyc"), doraise=True)
    (tmp / "probe.py").unlink()
    return ["probe.pyc", "3"]


@pytest.mark.parametrize(
    ("make", "code"),
    [
        pytest.param(_symlink, 0, id="symlinked-script"),
        pytest.param(_zipapp, 7, id="zipapp"),
        pytest.param(_folder, 5, id="folder-with-main"),
        pytest.param(_pyc, 3, id="pyc"),
    ],
)
def test_started_as_python_starts_it(
    tmp_path: Path, make: Callable[[Path], list[str]], code: int
) -> None:
    args = make(tmp_path)
    plain = _python(args, tmp_path)
    traced = _traceml(args, tmp_path)
    assert plain.returncode == code, plain.stderr
    assert "BUILTINS module" in plain.stdout
    assert traced.returncode == code, traced.stderr
    assert traced.stdout == plain.stdout, traced.stderr
    assert _not_ours(traced.stderr) == plain.stderr == ""
    if code != 0:
        # It ran and ended on its own: said so, not a guess at a missing traceml.init().
        assert f"the training script exited with code {code}" in _ours(traced.stderr)[-1]


def test_symlinked_script_gets_its_real_folder(tmp_path: Path) -> None:
    res = _traceml(_symlink(tmp_path), tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"PATH0 {tmp_path.resolve() / 'real'}\n" in res.stdout
    assert f"FILE {tmp_path / 'other' / 'link.py'}\n" in res.stdout


def test_disable_traceml_runs_a_folder(tmp_path: Path) -> None:
    args = _folder(tmp_path)
    res = run_cli(["run", "--disable-traceml", *args], cwd=tmp_path)
    assert res.returncode == 5, res.stderr
    assert res.stdout == _python(args, tmp_path).stdout


def test_uncaught_error_reads_as_under_python(tmp_path: Path) -> None:
    (tmp_path / "raises.py").write_text(RAISES)
    plain = _python(["raises.py"], tmp_path)
    traced = _traceml(["raises.py"], tmp_path)
    assert plain.returncode == traced.returncode == 1, traced.stderr
    assert traced.stdout == plain.stdout == "before\n"
    # The same traceback, none of TraceML's frames in it.
    assert _not_ours(traced.stderr) == plain.stderr
    assert "ValueError: boom" in plain.stderr
    last = _ours(traced.stderr)[-1]
    assert "the training script exited with code 1" in last
    assert "traceml.init()" not in last


def test_traceml_disabled_is_named(tmp_path: Path) -> None:
    (tmp_path / "traced.py").write_text(TRACED)
    res = _traceml(["traced.py"], tmp_path, env={"TRACEML_DISABLED": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout == "steps done\n"
    last = _ours(res.stderr)[-1]
    assert "TRACEML_DISABLED=1 is set, so TraceML was off in the ranks" in last
    assert "may not call traceml.init()" not in last


def test_os_exit_after_first_steps_is_named(tmp_path: Path) -> None:
    (tmp_path / "traced.py").write_text(TRACED)
    res = _traceml(["traced.py", "os._exit"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "steps done\n"
    last = _ours(res.stderr)[-1]
    assert "rank 0 ended without shutting down TraceML" in last
    assert "os._exit()" in last
    assert "may not call traceml.init()" not in last


# ------------------------------------------------------------------ adversarial starts


def test_what_python_cannot_run_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for script, needle in (
        ("empty", "empty is a folder without __main__.py"),
        ("missing.py", "training script not found: missing.py"),
    ):
        res = _traceml([script], tmp_path)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("traceml: error: "), res.stderr
        assert needle in lines[0]
        assert not (tmp_path / "logs").exists()
        assert _python([script], tmp_path).returncode != 0  # python cannot run it either


def test_non_zip_file_named_zip_runs_as_python_runs_it(tmp_path: Path) -> None:
    (tmp_path / "fake.zip").write_bytes(b"not a zip file\x00\x01\n")
    plain = _python(["fake.zip"], tmp_path)
    traced = _traceml(["fake.zip"], tmp_path)
    assert plain.returncode == traced.returncode == 1, traced.stderr
    assert "null bytes" in plain.stderr  # python read it as a script
    assert _not_ours(traced.stderr) == plain.stderr
    assert "Traceback" not in traced.stderr
    last = _ours(traced.stderr)[-1]
    assert "fake.zip did not start" in last and "fake.zip is not a zip file" in last


def test_ctrl_c_while_the_rank_starts(tmp_path: Path) -> None:
    # Should the Ctrl-C come late (a stalled test machine), the script ends quietly too.
    (tmp_path / "wait.py").write_text(
        "import time\n"
        "try:\n"
        "    print('started', flush=True)\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    raise SystemExit(130)\n"
    )
    proc = start_cli(
        ["run", "--logs-dir", tmp_path / "logs", "--exporter", "off", "wait.py"],
        cwd=tmp_path,
        new_session=True,
    )
    try:
        launcher = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        # The moment the rank exists it is starting its interpreter and importing TraceML.
        while not any(
            "traceml_ai.launch.bootstrap" in " ".join(child.cmdline())
            for child in launcher.children()
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "no rank started"
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal's Ctrl-C does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    if "started" not in out:  # the script's first line never ran (the usual case)
        assert "interrupted (SIGINT) before the training script started" in err
    assert "may not call traceml.init()" not in err


def test_a_sigint_the_process_ignores_stays_ignored_while_the_cli_imports(
    tmp_path: Path,
) -> None:
    """The CLI holds SIGINT while it imports; a background job, which ignores SIGINT,
    must not be ended by one that came meanwhile."""
    script = tmp_path / "train.py"
    script.write_text("print('RAN', flush=True)\n")
    console = Path(PY).parent / "traceml"
    proc = subprocess.Popen(
        [
            str(console),
            "run",
            "--logs-dir",
            str(tmp_path / "logs"),
            "--exporter",
            "off",
            str(script),
        ],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "RAN" in out and "interrupted" not in err


@pytest.mark.parametrize("delay_s", [0.03, 0.05, 0.08, 0.15, 0.3, 0.6])
def test_ctrl_c_while_traceml_starts_has_no_traceback(tmp_path: Path, delay_s: float) -> None:
    """A Ctrl-C at any early moment of `traceml run` (the CLI still importing, the
    launcher planning, a rank starting): one line, exit 130 or the signal, no traceback."""
    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(30)\n")
    # The console script, as users start it (`python -m` adds runpy's own window).
    console = Path(PY).parent / "traceml"
    proc = start_cli(
        ["run", "--logs-dir", tmp_path / "logs", script], cwd=tmp_path, command=[str(console)]
    )
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if err.startswith("Fatal Python error: init_import_site"):
        # On a loaded machine the signal can land while the interpreter itself still
        # imports `site`, before any line of TraceML runs: CPython's own report, the same
        # under `python train.py`. Nothing of TraceML's may be in it.
        assert "traceml" not in err.lower(), err
        return
    frames = [line for line in err.splitlines() if line.strip().startswith('File "')]
    if err.startswith("Failed checking if argv[0] is an import path entry"):
        # CPython's own check of argv[0] at startup, interrupted: it says so and goes on
        # (the signal is spent), before any line of TraceML runs.
        assert all('File "<frozen ' in line for line in frames), err
        proc.wait()
        return
    package = str(Path(traceml_ai.__file__))
    if frames and not any(str(script) in line for line in frames):
        # Landed before TraceML's CLI ran its first line (`__main__` holds SIGINT from
        # there on): in the console script pip wrote, the interpreter's import machinery,
        # or the package's own `__init__` (the library users import, which must not
        # touch signals) — the same for any console script. No other module of TraceML's.
        outside = [line for line in frames if 'File "<frozen ' not in line]
        stdlib = sysconfig.get_paths()["stdlib"]
        assert all(
            line.strip().startswith((f'File "{console}"', f'File "{package}"', f'File "{stdlib}'))
            for line in outside
        ), err
        assert proc.returncode in (1, 130, -signal.SIGINT), (proc.returncode, err)
        return
    # Once the script runs, its own KeyboardInterrupt traceback is python's to print
    # (as under `python train.py`); no frame of TraceML's or of an import in progress.
    assert all(str(script) in line for line in frames), err
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)
