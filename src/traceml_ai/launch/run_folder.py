"""The run folder ``<logs-dir>/<run-name>``: one check of the name, one way to create it.

``traceml run``, ``traceml serve`` and the Ray integration all name a folder under a
logs folder from user input (``--run-name``, ``TraceMLRayConfig.session_id``). The
name must stay one plain folder name inside the logs folder: a separator or ``..``
would write elsewhere, an absolute name would ignore the logs folder, and a name the
file system cannot hold would fail half-way through the launch. Everything here is
checked before anything is created or launched, and every failure is one line.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = [
    "NAME_MAX_BYTES",
    "RunFolderError",
    "check_logs_dir",
    "check_run_name",
    "create_run_folder",
    "existing_folder_message",
    "run_name_problem",
]

NAME_MAX_BYTES = 255
"""The longest folder name (in UTF-8 bytes) common file systems hold (Linux NAME_MAX)."""


class RunFolderError(ValueError):
    """A run name or logs folder that cannot be used; the message is one line."""


def _shown(name: str) -> str:
    # repr() shows control characters and quotes escaped, so the message stays one line.
    shown = name if len(name) <= 60 else name[:57] + "..."
    return repr(shown)


def run_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a run folder, or None when it can."""
    if name == "":
        return "is empty"
    if name in (".", ".."):
        return f"{_shown(name)} is not a folder name"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        return f"{_shown(name)} contains a control character"
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if any(s in name for s in separators) or os.path.isabs(name):
        return (
            f"{_shown(name)} is a path; give a plain folder name (no '/', '\\' or '..'), "
            "the folder is created under the logs folder"
        )
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{_shown(name)} is not valid UTF-8 text"
    if size > NAME_MAX_BYTES:
        return f"is {size} bytes long; the file system allows at most {NAME_MAX_BYTES}"
    return None


def check_run_name(name: str, *, what: str = "--run-name") -> str:
    """Return ``name`` when it can name a run folder, else raise ``RunFolderError``."""
    problem = run_name_problem(name)
    if problem is not None:
        raise RunFolderError(f"{what} {problem}")
    return name


def _first_existing(path: Path) -> Path:
    current = path
    while not os.path.lexists(current) and current != current.parent:
        current = current.parent
    return current


def check_logs_dir(logs_dir: Path, *, what: str = "--logs-dir") -> None:
    """Raise ``RunFolderError`` when a run folder could not be created under ``logs_dir``.

    Creates nothing. Checks that the logs folder (or the nearest part of its path
    that exists) is a folder we can write in. ``os.access`` reports a read-only
    mount even to root, for whom permission bits do not stop writes.
    """
    existing = _first_existing(logs_dir.absolute())
    if existing == logs_dir.absolute() or os.path.lexists(logs_dir):
        if not logs_dir.is_dir():
            raise RunFolderError(f"{what} {logs_dir} is not a folder")
    elif not existing.is_dir():
        raise RunFolderError(f"{what} {logs_dir} cannot be created: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == logs_dir.absolute() else f" ({existing} is where it would go)"
        raise RunFolderError(f"{what} {logs_dir} is not writable{where}")


def _describe_os_error(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or str(exc)


def create_run_folder(
    logs_dir: Path,
    name: str,
    *,
    exist_ok: bool,
    what: str = "--logs-dir",
    name_what: str = "--run-name",
) -> Path:
    """Create ``<logs_dir>/<name>`` (and the logs folder when needed); return its path.

    With ``exist_ok`` false the run folder itself is created exclusively, so two
    launches with one name cannot share it. Raises ``RunFolderError`` with one line.
    """
    check_run_name(name, what=name_what)
    run_dir = logs_dir / name
    try:
        logs_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunFolderError(f"{what} {logs_dir} is not a folder") from None
    except OSError as exc:
        raise RunFolderError(
            f"{what} {logs_dir} cannot be created: {_describe_os_error(exc)}"
        ) from None
    try:
        run_dir.mkdir(exist_ok=exist_ok)
    except FileExistsError:
        raise RunFolderError(existing_folder_message(run_dir, name_what)) from None
    except OSError as exc:
        raise RunFolderError(
            f"cannot create run folder {run_dir}: {_describe_os_error(exc)}"
        ) from None
    if not run_dir.is_dir():
        raise RunFolderError(f"run folder {run_dir} exists and is not a folder")
    return run_dir


def existing_folder_message(run_dir: Path, name_what: str = "--run-name") -> str:
    """The one line for a run folder that already exists (whatever it holds)."""
    return (
        f"run folder {run_dir} already exists; TraceML never reuses a run folder, "
        f"pick a new {name_what} (e.g. {run_dir.name}-2) or remove the folder"
    )
