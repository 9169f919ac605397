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
PORT_FORMS = "an integer in [0, 65535] (0 picks a free port)"

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


def parse_seconds(text: str) -> float:
    """A positive, finite number of seconds, at most :data:`MAX_SECONDS`."""
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a positive number of seconds, got {text!r}")
    if value > MAX_SECONDS:
        raise ValueError(
            f"expected a positive number of seconds up to a year ({MAX_SECONDS}), got {text!r}"
        )
    return value


def _parse_int(text: str, low: int, high: int | None, forms: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"expected {forms}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"expected {forms}, got {text!r}")
    if value > MAX_COUNT:
        raise ValueError(f"expected a whole number from {low} to {MAX_COUNT}, got {text!r}")
    return value


def parse_port(text: str) -> int:
    """A TCP port; 0 picks a free one."""
    return _parse_int(text, 0, 65535, PORT_FORMS)


def parse_count(text: str) -> int:
    """A whole number of at least 1."""
    return _parse_int(text, 1, None, "a whole number of at least 1")


def parse_bound(text: str) -> int:
    """A whole number of at least 0 (a bound where 0 means none)."""
    return _parse_int(text, 0, None, "a whole number of at least 0")


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
