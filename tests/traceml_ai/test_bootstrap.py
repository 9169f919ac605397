"""``traceml run`` starts each rank through ``python -m traceml_ai._bootstrap SCRIPT``:
the script must see exactly what ``python SCRIPT`` shows it, and nothing is patched
that the script does not import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.e2e_helpers import PY, clean_env, run_cli
from traceml_ai._bootstrap import zero_code_enabled
from traceml_ai._launch import BOOTSTRAP_MODULE

SCRIPT = """
import os, pickle, sys

class Point:
    def __init__(self, x):
        self.x = x

if __name__ == "__main__":
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
    assert sys.modules.get("traceml_ai._bootstrap") is not None
