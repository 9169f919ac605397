"""A group of records that arrives already written as JSONL lines.

The built-in JSONL exporter only needs the lines, so for it the builder writes them
straight from the wire items (``traceml_records._codec.encode_items``) instead of
building typed records first. Such a group is still a sequence of records: indexing
it parses the line back (strictly), so any code that walks it sees typed records.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from traceml_records import loads_line


class EncodedLines(Sequence[Any]):
    """Records of one stream, held as their lines: ``data`` is ``line_count`` whole lines."""

    __slots__ = ("data", "line_count", "stream")

    def __init__(self, stream: str, data: bytes, count: int) -> None:
        self.stream = stream
        self.data = data
        self.line_count = count

    def __len__(self) -> int:
        return self.line_count

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        # JSON escapes newlines inside strings, so every b"\n" ends a line.
        lines = self.data.splitlines(keepends=True)
        if isinstance(index, slice):
            return [loads_line(line) for line in lines[index]]
        return loads_line(lines[index])

    def __iter__(self) -> Iterator[Any]:
        # One split for the whole walk (indexing splits the data each time).
        for line in self.data.splitlines(keepends=True):
            yield loads_line(line)

    def __repr__(self) -> str:
        return f"EncodedLines(stream={self.stream!r}, count={self.line_count})"
