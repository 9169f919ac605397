from collections.abc import Callable, Iterable, Mapping
from typing import Any

def configure(
    plans: Mapping[type[Any], tuple[tuple[str, tuple[Any, ...], int], ...]],
    fallback: Callable[..., bytes],
    orjson_dumps: Callable[[Any], bytes],
    /,
) -> None: ...
def dumps_line(record: object, /, *, include_hostname: bool = False) -> bytes: ...
def encode_items(
    items: list[Any],
    record_class: type[Any],
    first_field: int,
    prefix: bytes,
    max_string_bytes: int,
    step_rules: tuple[frozenset[str], str, str, int, type[Any]] | None,
    conditions: tuple[Any, ...] | None,
    batch_fields: tuple[tuple[int, Any], ...] | None,
    /,
) -> tuple[bytes, int, list[tuple[int, int]]]: ...
def configure_host_step(
    phase_class: type[Any], orjson_dumps: Callable[[Any], bytes], /
) -> None: ...
def encode_host_step(
    acc: dict[str, Any], step: int, ts: int, device: str, seq_time: int, seq_mem: int, /
) -> tuple[bytes, bytes] | None: ...
def encode_host_steps(
    encode: Callable[..., tuple[bytes, bytes] | None],
    ended: Any,
    ended_at: Any,
    spare: list[Any],
    seq_time: int,
    seq_mem: int,
    /,
) -> tuple[
    list[int], list[bytes], list[bytes], int, int, tuple[int, int, str, Any] | BaseException | None
]: ...
def split_batch(body: bytes, /) -> tuple[bytes, int, int, int] | None: ...
def encode_batch(
    body: bytes,
    items_start: int,
    record_class: type[Any],
    first_field: int,
    prefix: bytes,
    max_string_bytes: int,
    step_rules: tuple[frozenset[str], str, str, int, type[Any]] | None,
    conditions: tuple[Any, ...] | None,
    batch_fields: tuple[tuple[int, Any], ...] | None,
    /,
) -> tuple[bytes, int] | None: ...

# The core of the one scan of the export files (traceml_records._scan); its pure-Python
# twin, traceml_records._scan_py, has the same classes with the same signatures.

Column = tuple[Any, bytes | Any, Any, int, int]

class KeysAndSeqs:
    """The keys and each rank's last seq of one file's lines."""

    def __init__(self, shape: str, /) -> None: ...
    def add(self, key: tuple[Any, ...], line: int, /) -> bool: ...
    def seq(self, rank: Any, seq: Any, /) -> Any: ...
    def watch(self, keys: Iterable[tuple[Any, ...]], /) -> None: ...
    def found(self) -> dict[tuple[Any, ...], int]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def keys(self) -> int: ...

class Checker:
    """One stream's scan core: the lines it can vouch for, taken."""

    def __init__(self, plan: tuple[Any, ...], layout: tuple[Any, ...] | None = ..., /) -> None: ...
    def scan(
        self, data: bytes | bytearray, pos: int, end: int, keys: KeysAndSeqs, hostname: int, /
    ) -> tuple[int, int]: ...
    def extract(
        self, data: bytes | bytearray, pos: int, end: int, keys: KeysAndSeqs, hostname: int, /
    ) -> tuple[int, int, tuple[Column, ...], tuple[Column, ...] | None]: ...
