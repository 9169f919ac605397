"""traceml_ai._fork: the one registry of what a fork's child resets."""

from __future__ import annotations

import os
import sys

import pytest

from traceml_ai import _fork


class _Tracked:
    def __init__(self) -> None:
        self.reset = False

    def after_fork_in_child(self) -> None:
        self.reset = True


@pytest.mark.skipif(sys.platform == "win32", reason="no fork")
def test_a_fork_child_runs_every_registered_reset_and_the_parent_none() -> None:
    calls: list[str] = []
    _fork.on_fork_in_child(lambda: calls.append("fn"))
    live, closed = _Tracked(), _Tracked()
    _fork.track(live)
    _fork.track(closed)
    _fork.untrack(closed)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what ran, then leave at once
        os.write(write, f"{calls}|{live.reset}|{closed.reset}".encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    reported = os.read(read, 1000).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reported == "['fn']|True|False"
    assert calls == [] and live.reset is False  # the parent is untouched
    _fork._functions.pop()
    _fork.untrack(live)


def test_every_module_registers_through_the_registry() -> None:
    """No second os.register_at_fork anywhere in the package."""
    import pathlib

    src = pathlib.Path(_fork.__file__).parent
    users = [
        p.relative_to(src).as_posix()
        for p in src.rglob("*.py")
        if "os.register_at_fork(" in p.read_text(encoding="utf-8")
    ]
    assert users == ["_fork.py"]
