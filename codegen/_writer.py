"""A tiny indentation-aware text builder for generated Python source."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class CodeWriter:
    """Collects lines of code, tracking the current indentation."""

    def __init__(self, indent: str = "    ") -> None:
        self._indent_unit = indent
        self._level = 0
        self._lines: list[str] = []

    def line(self, text: str = "") -> None:
        """Append one line at the current indentation (blank lines stay empty)."""
        self._lines.append(f"{self._indent_unit * self._level}{text}" if text else "")

    def lines(self, *texts: str) -> None:
        """Append several lines at the current indentation."""
        for text in texts:
            self.line(text)

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        """Write ``header`` and indent what is written inside the ``with``."""
        self.line(header)
        self._level += 1
        try:
            yield
        finally:
            self._level -= 1

    def render(self) -> str:
        """The collected text with exactly one trailing newline."""
        return "\n".join(self._lines).rstrip("\n") + "\n"
