"""The parsers of the settings: the text of a flag, a variable or a YAML scalar -> a
checked value, and the one typed value of ``export_streams``."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Literal

import attrs

from traceml_records import parse_export_streams

EXPORTER_FORMS = "'' (off), 'jsonl', or 'module.path:factory'"
BOOL_FORMS = "one of 1/0, true/false, yes/no, on/off"

TRACKER_NAMES: tuple[str, ...] = ("tensorboard", "mlflow", "wandb")
"""The experiment trackers the aggregator can log to (docs/trackers.md); each has its
backend in ``traceml_ai.monitor.trackers``."""
TRACKERS_FORMS = "tracker names, comma-separated, from " + ", ".join(TRACKER_NAMES)
PARALLEL_FORMS = (
    "'' (none) or comma-separated name=size, e.g. 'tp=4,cp=1,dp=8,pp=4' (first varies "
    "fastest; sizes whole numbers of at least 1)"
)
MAX_PARALLEL_SIZE = 1 << 20
"""The largest size one dimension of a declared layout may have (and their product)."""
_DIM_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})

ExporterKind = Literal["off", "jsonl", "custom"]
Command = Literal["run", "serve"]


class SettingsError(ValueError):
    """A setting has an invalid value; the message names where the value came from."""


def parse_exporter_value(text: str) -> str:
    """Validate and normalize an exporter value.

    Accepts ``""`` (off), ``jsonl``, or ``module.path:factory`` where the module path is
    one or more dot-separated Python identifiers and the factory one identifier, with
    exactly one colon. ``off``, ``false``, ``no`` and ``0`` (any case) also mean off
    and normalize to ``""``: YAML reads ``exporter: off`` as the boolean false, and
    a user who writes it means off. Surrounding whitespace is trimmed. Raises
    ``ValueError`` otherwise.
    """
    value = text.strip()
    if value in ("", "jsonl"):
        return value
    if value.lower() in _FALSE_WORDS:
        return ""
    module, sep, factory = value.partition(":")
    if sep and factory.isidentifier() and all(part.isidentifier() for part in module.split(".")):
        return value
    raise ValueError(f"expected {EXPORTER_FORMS}, got {text!r}")


def exporter_kind(value: str) -> ExporterKind:
    """Classify an exporter value; raises ``ValueError`` if it is malformed."""
    normalized = parse_exporter_value(value)
    if normalized == "":
        return "off"
    if normalized == "jsonl":
        return "jsonl"
    return "custom"


def parse_bool_value(text: str) -> bool:
    """Parse 1/0, true/false, yes/no, on/off (any case, trimmed); else ``ValueError``."""
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"expected {BOOL_FORMS}, got {text!r}")


@attrs.frozen(slots=True)
class ExportStreams:
    """The ``export_streams`` setting, parsed once: the text as written (trimmed) and
    the file streams it selects, in registry order.

    Made only by :meth:`parse` (or :meth:`of`), so a value always holds a valid
    selection; two values that select the same streams are equal. It crosses the
    aggregator protocol as its text and is parsed again, by :meth:`parse`, on the
    other side.
    """

    text: str = attrs.field(eq=False)
    selected: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> ExportStreams:
        """The value of ``text``; ``ValueError`` naming the problem and the supported
        names (``traceml_records.parse_export_streams``'s rules)."""
        selected = parse_export_streams(text)  # refuses a value that is no string too
        return cls(text.strip(), selected)

    @classmethod
    def of(cls, value: str | ExportStreams) -> ExportStreams:
        """``value`` itself, or the text parsed (code may hand either)."""
        return value if isinstance(value, ExportStreams) else cls.parse(value)

    def __str__(self) -> str:
        return self.text


def parse_trackers(text: str) -> tuple[str, ...]:
    """Tracker names, comma-separated (trimmed, any case, each once, in order);
    ``""``/``off`` is none."""
    value = text.strip().lower()
    if value in _FALSE_WORDS:
        return ()
    names: list[str] = []
    for part in value.split(","):
        name = part.strip()
        if not name:
            continue
        if name not in TRACKER_NAMES:
            raise ValueError(f"expected {TRACKERS_FORMS}, got {text!r} (unknown {name!r})")
        if name not in names:
            names.append(name)
    return tuple(names)


MAX_SECONDS = 365 * 24 * 3600
"""The most seconds any setting takes (a year): a timer or a wait past it overflows the
clocks and the wait calls it reaches."""
MAX_COUNT = 2**31 - 1
"""The most any count or bound setting takes: every one fits the 64-bit integers of the
JSON the launcher hands its processes, and no count means more."""


class OutOfBounds(ValueError):
    """A value a bounded setting refuses; ``expected`` says what it takes (the message
    adds the value given: its text, or the value given in code)."""

    def __init__(self, expected: str, given: object) -> None:
        super().__init__(f"expected {expected}, got {given!r}")
        self.expected = expected


@attrs.frozen
class Bounds:
    """The range a number setting takes, written in its table entry and checked by
    :meth:`check` only.

    A ``whole`` range takes integers from ``low`` to ``high``; otherwise the setting is
    a number of seconds, more than ``low`` (0) and at most ``high``. ``note`` follows
    what the messages say a value must be (``0 picks a free port``).
    """

    low: int
    high: int = MAX_COUNT
    whole: bool = True
    note: str = ""

    @property
    def expected(self) -> str:
        """What the setting takes, as the docs and a malformed value's message say it."""
        if not self.whole:
            text = "a positive number of seconds"
        elif self.high == MAX_COUNT:
            text = f"a whole number of at least {self.low}"
        else:
            text = f"an integer in [{self.low}, {self.high}]"
        return f"{text} ({self.note})" if self.note else text

    @property
    def expected_in_full(self) -> str:
        """What the setting takes, naming the top of the range too (said for a value
        above it)."""
        if not self.whole:
            text = f"a positive number of seconds up to a year ({self.high})"
        elif self.high == MAX_COUNT:
            text = f"a whole number from {self.low} to {self.high}"
        else:
            return self.expected
        return f"{text} ({self.note})" if self.note else text

    def check(self, value: float, given: object) -> None:
        """Refuse ``value`` (``given`` is how the message shows it) outside the range:
        :class:`OutOfBounds` naming the top when it is above, else what is expected."""
        if not math.isfinite(value) or value < self.low or (value == self.low and not self.whole):
            raise OutOfBounds(self.expected, given)
        if value > self.high:
            raise OutOfBounds(self.expected_in_full, given)


def parse_whole(text: str) -> int:
    """A whole number (trimmed); its setting's :class:`Bounds` check the range."""
    return int(text.strip())


def parse_number(text: str) -> float:
    """A number (trimmed); its setting's :class:`Bounds` check the range."""
    return float(text.strip())


def parse_host(text: str) -> str:
    """A host name or an IP address (trimmed; no space inside)."""
    value = text.strip()
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"expected a host name or an IP address, got {text!r}")
    return value


def parse_folder(text: str) -> Path:
    """A folder path; whether it can be created is checked where it is created."""
    if not text or "\x00" in text:
        raise ValueError(f"expected a folder path, got {text!r}")
    return Path(text)


def parse_run_name(text: str) -> str:
    """A run folder's name; what a folder name may hold is checked with the folder."""
    if not text:
        raise ValueError(f"expected a folder name, got {text!r}")
    return text


def parse_parallel_layout(text: str) -> tuple[tuple[str, int], ...]:
    """A declared parallel layout: ``name=size`` pairs, comma-separated, in Megatron's
    order (the first dimension varies fastest with the global rank); ``""`` is none.

    Names match ``^[a-z][a-z0-9_]*$`` (at most 32 characters) and appear once; sizes
    are whole numbers in ``[1, MAX_PARALLEL_SIZE]`` and so is their product.
    ``ValueError`` naming the problem otherwise. Whether the product is the world
    size is checked on the rank, which knows it.
    """
    value = text.strip()
    if not value:
        return ()
    dims: list[tuple[str, int]] = []
    product = 1
    for part in value.split(","):
        name, sep, size_text = part.strip().partition("=")
        name, size_text = name.strip(), size_text.strip()
        if not sep or not _DIM_NAME.fullmatch(name):
            raise ValueError(f"expected {PARALLEL_FORMS}, got {text!r} (bad entry {part!r})")
        if any(name == seen for seen, _ in dims):
            raise ValueError(f"expected {PARALLEL_FORMS}, got {text!r} ({name!r} repeated)")
        if not size_text.isdigit() or len(size_text) > 8:
            raise ValueError(
                f"expected {PARALLEL_FORMS}, got {text!r} ({name}: {size_text!r} is not a "
                f"whole number in [1, {MAX_PARALLEL_SIZE}])"
            )
        size = int(size_text)
        if not 1 <= size <= MAX_PARALLEL_SIZE:
            raise ValueError(
                f"expected {PARALLEL_FORMS}, got {text!r} ({name}: {size} is not in "
                f"[1, {MAX_PARALLEL_SIZE}])"
            )
        product *= size
        if product > MAX_PARALLEL_SIZE:
            raise ValueError(
                f"expected {PARALLEL_FORMS}, got {text!r} (the sizes multiply to more than "
                f"{MAX_PARALLEL_SIZE} ranks)"
            )
        dims.append((name, size))
    return tuple(dims)


def parse_parallel(text: str) -> str:
    """The ``parallel`` setting: its layout checked (:func:`parse_parallel_layout`) and
    written back in one form (``tp=4,dp=8``; ``""`` for none), as the ranks read it."""
    return ",".join(f"{name}={size}" for name, size in parse_parallel_layout(text))
