"""Which steps become OTLP traces and how a sampled step is drawn: the sampler (every
N-th step per rank, plus slow steps), the phases laid out in step order, and the
finished ``ReadableSpan`` objects handed to the span exporter."""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Iterable, Mapping

import attrs
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import AttributeValue

from traceml_ai.analysis import BUILT_IN_PHASES
from traceml_ai.monitor._state import OTHER_PHASE, StepSeen

__all__ = ["PhaseSpan", "SpanBuilder", "StepSampler", "layout_phases", "span_count"]


SLOW_WINDOW = 32
"""Recent step times of each rank the slow-step rule compares against."""
SLOW_MIN_SEEN = 8
"""Steps of a rank seen before the slow-step rule applies."""
SLOW_FACTOR = 2.0
"""A step slower than this many times its rank's recent median is always traced."""

STEP_SPAN = "traceml.step"
PERIODIC = "periodic"
SLOW = "slow"

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


# -- sampling ----------------------------------------------------------------------


class StepSampler:
    """Which steps become traces: per rank, steps 1, N+1, 2N+1 ... (the same steps on
    every rank, so that one step can be compared across ranks), plus every step slower
    than ``SLOW_FACTOR`` times the median of its rank's previous ``SLOW_WINDOW`` steps
    (sampled or not), once ``SLOW_MIN_SEEN`` of them have been seen.

    Runs on the feed thread; the cost per step is a modulo and the window kept in
    order (a bisection in, one out), whose median is then two reads.
    """

    def __init__(self, every: int) -> None:
        self.every = max(1, every)
        self._recent: dict[int, tuple[deque[float], list[float]]] = {}
        """rank -> its last ``SLOW_WINDOW`` step times as they came, and in order."""

    def pick(self, steps: Iterable[StepSeen]) -> list[tuple[StepSeen, str]]:
        """The steps to trace, each with why (``periodic`` or ``slow``)."""
        picked: list[tuple[StepSeen, str]] = []
        every = self.every
        insort, bisect_left = bisect.insort, bisect.bisect_left
        rank = -1
        recent: deque[float] = deque()
        ordered: list[float] = []
        for step in steps:
            if step.rank != rank:  # a batch's steps are one rank's: one lookup
                rank = step.rank
                window = self._recent.get(rank)
                if window is None:
                    window = self._recent[rank] = (deque(), [])
                recent, ordered = window
            ms = step.step_ms
            if every == 1 or (step.step - 1) % every == 0:
                picked.append((step, PERIODIC))
            elif len(ordered) >= SLOW_MIN_SEEN:
                n = len(ordered)
                median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
                if ms > SLOW_FACTOR * median:
                    picked.append((step, SLOW))
            if len(recent) == SLOW_WINDOW:
                del ordered[bisect_left(ordered, recent.popleft())]
            recent.append(ms)
            insort(ordered, ms)
        return picked


# -- spans -------------------------------------------------------------------------


@attrs.frozen(slots=True)
class PhaseSpan:
    """Where one phase is drawn in its step's trace (Unix ns)."""

    name: str
    start_ns: int
    end_ns: int


def _phase_order(phases: Mapping[str, float]) -> list[str]:
    built_in = [name for name in BUILT_IN_PHASES if name in phases]
    user = sorted(name for name in phases if name not in BUILT_IN_PHASES and name != OTHER_PHASE)
    tail = [OTHER_PHASE] if OTHER_PHASE in phases else []
    return built_in + user + tail


def layout_phases(step: StepSeen) -> list[PhaseSpan]:
    """The step's phases laid end to end in step order from the step's start.

    The step occupies ``[end_ns - step_ms, end_ns]``. Phases are measured as
    durations only, so their positions are a layout: dataloader_wait, h2d, forward,
    backward, optimizer, the user phases (by name), other. When the built-in phases
    add up to more than the step, the batch was fetched before the step opened, so
    dataloader_wait is drawn just before the step's start instead.
    """
    step_ns = round(step.step_ms * 1e6)
    start = step.end_ns - step_ns
    phases = step.phases
    built_in_ms = sum(phases[name] for name in BUILT_IN_PHASES if name in phases)
    before = "dataloader_wait" in phases and built_in_ms > step.step_ms
    out: list[PhaseSpan] = []
    cursor = start
    for name in _phase_order(phases):
        ns = round(phases[name] * 1e6)
        if before and name == "dataloader_wait":
            out.append(PhaseSpan(name, start - ns, start))
            continue
        out.append(PhaseSpan(name, cursor, cursor + ns))
        cursor += ns
    return out


class SpanBuilder:
    """Finished spans of sampled steps, with random ids."""

    def __init__(self, scope: InstrumentationScope) -> None:
        self._scope = scope
        self._rng = random.Random()

    def _id(self, bits: int) -> int:
        while True:
            value = self._rng.getrandbits(bits)
            if value:
                return value

    def spans(self, step: StepSeen, reason: str, resource: Resource) -> list[ReadableSpan]:
        trace_id = self._id(128)
        root = SpanContext(trace_id, self._id(64), is_remote=False, trace_flags=_SAMPLED)
        start = step.end_ns - round(step.step_ms * 1e6)
        root_attributes: dict[str, AttributeValue] = {
            "traceml.rank": step.rank,
            "traceml.node": step.node,
            "traceml.step": step.step,
            "traceml.sample_reason": reason,
        }
        out = [
            ReadableSpan(
                name=STEP_SPAN,
                context=root,
                parent=None,
                resource=resource,
                attributes=root_attributes,
                kind=SpanKind.INTERNAL,
                start_time=start,
                end_time=step.end_ns,
                instrumentation_scope=self._scope,
            )
        ]
        for phase in layout_phases(step):
            context = SpanContext(trace_id, self._id(64), is_remote=False, trace_flags=_SAMPLED)
            out.append(
                ReadableSpan(
                    name=phase.name,
                    context=context,
                    parent=root,
                    resource=resource,
                    attributes={"traceml.phase": phase.name},
                    kind=SpanKind.INTERNAL,
                    start_time=phase.start_ns,
                    end_time=phase.end_ns,
                    instrumentation_scope=self._scope,
                )
            )
        return out


def span_count(step: StepSeen) -> int:
    return 1 + len(step.phases)
