"""The one at-fork registry: what TraceML resets in the child of a ``fork``.

A forked child (a DataLoader worker, a user's ``multiprocessing`` pool) inherits the
parent's objects but none of its threads: queues, sockets and locks that a thread of
the parent owned must be made inert or fresh there, or the child would send the
parent's data twice or wait forever on a lock nobody will release. Each subsystem
registers here; the registry installs a single ``os.register_at_fork`` hook.

Two kinds of entries: a function (module state), and live objects held weakly that
have an ``after_fork_in_child()`` method (every sender, every export worker).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Protocol, TypeVar


class ResetsAfterFork(Protocol):
    """An object that makes itself safe in a fork's child."""

    def after_fork_in_child(self) -> None: ...


_F = TypeVar("_F", bound=Callable[[], None])

_functions: list[Callable[[], None]] = []
_objects: weakref.WeakSet[ResetsAfterFork] = weakref.WeakSet()


def on_fork_in_child(fn: _F) -> _F:
    """Call ``fn`` in every fork child (in registration order); usable as a decorator."""
    _functions.append(fn)
    return fn


def track(obj: ResetsAfterFork) -> None:
    """Call ``obj.after_fork_in_child()`` in every fork child while ``obj`` lives."""
    _objects.add(obj)


def untrack(obj: ResetsAfterFork) -> None:
    """Stop resetting ``obj`` (it closed: nothing of it is left to reset)."""
    _objects.discard(obj)


def _run_in_child() -> None:
    for fn in list(_functions):
        fn()
    for obj in list(_objects):
        obj.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_run_in_child)
