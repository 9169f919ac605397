"""Every collected test is in exactly one lane, and the e2e tests never in the fast one
(tests/conftest.py gives the lanes; docs/testing.md says what each holds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LANES

REPO = Path(__file__).resolve().parents[1]


def test_every_test_has_exactly_one_lane(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    assert request.node in items
    wrong = []
    for item in items:
        lanes = [lane for lane in LANES if item.get_closest_marker(lane) is not None]
        e2e_path = os.path.relpath(str(item.path), str(request.config.rootpath)).startswith(
            os.path.join("tests", "e2e", "")
        )
        if len(lanes) != 1 or (e2e_path and lanes != ["e2e"]):
            wrong.append(f"{item.nodeid}: {lanes}")
    assert wrong == []


def test_the_fast_lane_leaves_out_what_is_marked_slow(tmp_path: Path) -> None:
    """The lane rule itself, on a throwaway suite laid out as this one: an unmarked
    test is in ``-m unit``; one marked slow in its module and one under tests/e2e are
    not, and ``-m unit`` alone does not even import them (any other selection does)."""
    suite = tmp_path / "tests"
    (suite / "e2e").mkdir(parents=True)
    (suite / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
        "from tests.conftest import pytest_ignore_collect  # noqa: F401\n"
    )
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    unit: u\n    e2e: e\n    slow: s\naddopts = --strict-markers\n"
    )
    imported = tmp_path / "imported"
    touch = f"open({str(imported)!r}, 'a').write(__name__ + ' ')\n"
    (suite / "test_quick.py").write_text("def test_quick():\n    pass\n")
    (suite / "test_heavy.py").write_text(
        "import pytest\n" + touch + "pytestmark = [pytest.mark.slow]\ndef test_heavy():\n    pass\n"
    )
    (suite / "e2e" / "test_cli.py").write_text(touch + "def test_cli():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src")])}

    def run(*selection: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", *selection, "-p", "no:cacheprovider"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.stdout + done.stderr

    out = run("-m", "unit", "tests")
    assert "1 passed" in out and "deselected" not in out, out
    assert not imported.exists(), out
    out = run("-m", "slow or e2e", "tests")
    assert "2 passed, 1 deselected" in out, out
    assert sorted(imported.read_text().split()) == ["test_cli", "test_heavy"], out
