"""The one line scanner of the export files: what a line, a partial last line, a
closing line and a bad line are, for every reader.

A file is read in blocks (it may still be growing); :class:`LineSplitter` turns them
into complete lines, numbered from 1, and holds back what follows the last newline:
that is a line the exporter is still writing, never a line to read or to count.
:func:`classify` says what one complete line is: a data line (a JSON object), a
closing line (an object with ``"closing": true``) or a bad line (anything else: broken
JSON, NaN or Infinity, which orjson does not parse, an array, a blank line). What a
reader does with each is its own: ``read_jsonl`` raises on a bad line, the run summary
counts it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any, BinaryIO

import orjson

BLOCK_BYTES = 16 << 20
"""Bytes read at a time: the per-block work is nothing, and a big file never sits in
memory twice."""


class LineKind(enum.Enum):
    DATA = "data"
    CLOSING = "closing"
    BAD = "bad"


class LineSplitter:
    """Complete, numbered lines from successive blocks of one file."""

    __slots__ = ("number", "pending")

    def __init__(self) -> None:
        self.pending = b""
        """Bytes after the last newline so far: a line still being written."""
        self.number = 0
        """Number of the last complete line returned."""

    def feed(self, block: bytes) -> list[bytes]:
        """The lines that ``block`` completes (numbers: ``number - len + 1`` onward)."""
        lines = (self.pending + block if self.pending else block).split(b"\n")
        self.pending = lines.pop()  # b"" after a final newline
        self.number += len(lines)
        return lines

    @property
    def partial_last_line(self) -> bool:
        """Whether the data so far ends inside a line (the exporter is writing it)."""
        return bool(self.pending)


def is_closing(obj: object) -> bool:
    """The one closing-line rule: a JSON object whose ``closing`` is ``true``."""
    return type(obj) is dict and obj.get("closing") is True


CLOSING_KEY = b'"closing"'
"""Bytes every closing line holds: a line without them is no closing line, unparsed. (A
string value holding the word has it escaped, so only a key or a bare ``"closing"``
value matches, and :func:`closing_of` then parses the line.)"""


def closing_of(raw: bytes) -> dict[str, Any] | None:
    """The closing line's object when the complete line ``raw`` is one, else None."""
    if CLOSING_KEY not in raw:
        return None
    kind, obj = classify(raw)
    return obj if kind is LineKind.CLOSING else None


def classify(raw: bytes) -> tuple[LineKind, dict[str, Any] | None]:
    """What one complete line is, and its object when it is one."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return LineKind.BAD, None
    if type(obj) is not dict:
        return LineKind.BAD, None
    if is_closing(obj):
        return LineKind.CLOSING, obj
    return LineKind.DATA, obj


def scan(fh: BinaryIO, splitter: LineSplitter | None = None) -> Iterator[tuple[int, bytes]]:
    """Every complete line of ``fh`` from where it stands, with its number; the
    partial last line stays in ``splitter`` (pass one to see it afterwards)."""
    splitter = splitter if splitter is not None else LineSplitter()
    while block := fh.read(BLOCK_BYTES):
        first = splitter.number + 1
        yield from enumerate(splitter.feed(block), first)
