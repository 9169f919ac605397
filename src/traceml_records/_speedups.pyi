from collections.abc import Callable, Mapping
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
    /,
) -> tuple[bytes, int] | None: ...
