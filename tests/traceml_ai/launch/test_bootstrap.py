"""``traceml run`` starts each rank through ``python -m traceml_ai.launch.bootstrap SCRIPT``:
the script must see exactly what ``python SCRIPT`` shows it, and nothing is patched
that the script does not import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.e2e_helpers import PY, clean_env, run_cli
from traceml_ai.launch.bootstrap import ENV_RANK_STATE_DIR, ENV_SIGINT_HELD, zero_code_enabled
from traceml_ai.launch.launcher import BOOTSTRAP_MODULE, read_rank_notes

SCRIPT = """
import os, pickle, sys

class Point:
    def __init__(self, x):
        self.x = x

if __name__ == "__main__":
    print("BUILTINS", type(__builtins__).__name__)
    print("ARGV", sys.argv)
    print("FILE", __file__)
    print("PATH0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    print("PICKLE", pickle.loads(pickle.dumps(Point(3))).x)
    print("MAIN", type(sys.modules["__main__"].Point) is type)
    print("HOOKED", any(type(f).__name__ == "_Finder" for f in sys.meta_path))
    print("FRAMEWORKS", sorted(m for m in ("transformers", "lightning") if m in sys.modules))
    sys.exit(int(sys.argv[2]))
"""


def _write(folder: Path) -> Path:
    path = folder / "sub" / "script.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def test_bootstrap_runs_script_like_python(tmp_path: Path) -> None:
    script = _write(tmp_path)
    args = ["sub/script.py", "--flag", "7"]
    plain = subprocess.run(
        [PY, *args], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    booted = subprocess.run(
        [PY, "-m", BOOTSTRAP_MODULE, *args],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode == booted.returncode == 7, booted.stderr
    expected = plain.stdout.replace("HOOKED False", "HOOKED True")
    assert booted.stdout == expected, (plain.stdout, booted.stdout, booted.stderr)
    assert "ARGV ['sub/script.py', '--flag', '7']" in booted.stdout
    assert "PICKLE 3" in booted.stdout and "PATH0 True" in booted.stdout
    assert "BUILTINS module" in booted.stdout  # the module, as in python's __main__
    assert "FRAMEWORKS []" in booted.stdout  # nothing imported on the script's behalf
    assert script.is_file()


def test_traceml_run_uses_bootstrap_and_zero_code_switch(tmp_path: Path) -> None:
    _write(tmp_path)
    res = run_cli(
        ["run", "--logs-dir", tmp_path / "logs", "--exporter", "off", "sub/script.py", "x", "0"],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert "HOOKED True" in res.stdout
    off = run_cli(
        ["run", "--logs-dir", tmp_path / "logs2", "--exporter", "off", "sub/script.py", "x", "0"],
        cwd=tmp_path,
        env={"TRACEML_ZERO_CODE": "0"},
    )
    assert off.returncode == 0, off.stderr
    assert "HOOKED False" in off.stdout


def test_zero_code_switch_values() -> None:
    assert zero_code_enabled({})
    assert zero_code_enabled({"TRACEML_ZERO_CODE": "1"})
    for value in ("0", "false", "OFF", " no "):
        assert not zero_code_enabled({"TRACEML_ZERO_CODE": value})
    assert sys.modules.get("traceml_ai.launch.bootstrap") is not None


def _both(
    folder: Path, args: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cmd, cwd=folder, env=clean_env(env), capture_output=True, text=True, timeout=60
        )

    return run([PY, *args]), run([PY, "-m", BOOTSTRAP_MODULE, *args])


def test_uncaught_keyboard_interrupt_ends_as_under_python(tmp_path: Path) -> None:
    (tmp_path / "stop.py").write_text(
        "import atexit\n"
        "atexit.register(print, 'atexit ran', flush=True)\n"
        "def loop():\n"
        "    raise KeyboardInterrupt\n"
        "loop()\n"
    )
    plain, booted = _both(tmp_path, ["stop.py"])
    # The script's traceback alone, the script's atexit handlers, then death by SIGINT.
    assert plain.returncode == booted.returncode == -signal.SIGINT, booted.stderr
    assert booted.stderr == plain.stderr
    assert "_bootstrap" not in booted.stderr and "KeyboardInterrupt" in booted.stderr
    assert booted.stdout == plain.stdout == "atexit ran\n"


def test_ctrl_c_held_during_start_ends_before_the_script(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "train.py").write_text(f"open({str(marker)!r}, 'w').close()\n")

    def ctrl_c_while_starting() -> None:
        # What `traceml run` does (SIGINT blocked), plus a Ctrl-C that came meanwhile.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)

    res = subprocess.run(
        [PY, "-m", BOOTSTRAP_MODULE, "train.py"],
        cwd=tmp_path,
        env=clean_env({ENV_SIGINT_HELD: "1"}),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=ctrl_c_while_starting,
    )
    assert res.returncode == -signal.SIGINT, res.stderr
    assert res.stderr == ""
    assert not marker.exists()


def test_rank_notes_tell_a_normal_exit_from_os_exit(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    (tmp_path / "end.py").write_text(
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    sys.exit(0)  # a forked child exits normally: not this rank's exit\n"
        "os.wait()\n"
        "if sys.argv[1] == 'abrupt':\n"
        "    os._exit(0)\n"
    )
    for rank, how in (("0", "normal"), ("1", "abrupt")):
        notes.mkdir(exist_ok=True)
        res = subprocess.run(
            [PY, "-m", BOOTSTRAP_MODULE, "end.py", how],
            cwd=tmp_path,
            env=clean_env({ENV_RANK_STATE_DIR: str(notes), "RANK": rank}),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
    assert read_rank_notes(str(notes)) == (("0", "1"), ("1",))
    assert read_rank_notes(str(tmp_path / "none")) == ((), ())
