"""The drops the aggregator hands on to the export (closing lines, the warning) as
``finished`` and ``relay`` messages come: the running sum against its definition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from traceml_ai.aggregator import Aggregator, AggregatorConfig
from traceml_ai.settings import ExportSettings
from traceml_ai.testing import make_identity
from traceml_ai.transport.wire import make_finished_message, make_relay_message

TOKEN = "drop-sums-token"


_DROP_MESSAGES = st.lists(
    st.one_of(
        st.tuples(
            st.just("finished"),
            st.integers(0, 3),
            st.integers(0, 50),
            st.none()
            | st.dictionaries(st.sampled_from(["step_time", "process"]), st.integers(0, 30)),
        ),
        st.tuples(
            st.just("relay"),
            st.sampled_from(["a", "b"]),
            st.integers(0, 3),
            st.dictionaries(st.sampled_from(["step_time", "process"]), st.integers(0, 30)),
        ),
    ),
    max_size=12,
)


@given(_DROP_MESSAGES)
def test_the_drops_handed_on_are_the_selected_drops_of_every_message_so_far(
    messages: list[tuple[Any, ...]],
) -> None:
    """The sum each ``finished`` and ``relay`` message hands on (kept as they come) is
    the definition's, counted from every message so far: per rank the largest count of
    each selected stream (an unsplit report: its largest total), per relay, rank and
    stream the largest count of a selected one."""
    agg = Aggregator(
        AggregatorConfig(
            run_dir=Path("unused"),
            settings=ExportSettings("jsonl", "step_time", False),
            token=TOKEN,
            expected_world_size=4,
        )
    )
    totals: dict[int, int] = {}
    by_stream: dict[int, dict[str, int]] = {}
    unsplit: set[int] = set()
    relays: dict[tuple[str, int, str], int] = {}
    for kind, who, count, streams in messages:
        if kind == "finished":
            agg._on_finished(
                make_finished_message(TOKEN, make_identity(who, world_size=4), 0, count, streams)
            )
            totals[who] = max(totals.get(who, 0), count)
            if streams is None:
                unsplit.add(who)
            for stream, n in streams.items() if streams else ():
                mine = by_stream.setdefault(who, {})
                mine[stream] = max(mine.get(stream, 0), n)
        else:
            agg._on_relay(make_relay_message(TOKEN, who, {count % 4: streams}))
            for stream, n in streams.items():
                key = (who, count % 4, stream)
                relays[key] = max(relays.get(key, 0), n)
        expected = sum(
            totals[r] if r in unsplit else by_stream.get(r, {}).get("step_time", 0) for r in totals
        ) + sum(n for (_, _, stream), n in relays.items() if stream == "step_time")
        with agg._lock:
            assert agg._rank_dropped_batches() == expected
