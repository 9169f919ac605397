from collections.abc import Callable
from typing import Any

def step_line(
    obj: dict[str, Any],
    checks: tuple[tuple[str, int, float, float, bool, bool], ...],
    step_event: str,
    name_of: Callable[[str], str | None],
    cache: dict[str, str | None],
    ranks: dict[int, Any],
    worlds: set[int],
    /,
) -> tuple[int, int, int, int, dict[str, float]] | int | None: ...
