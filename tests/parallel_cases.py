"""Synthetic export folders of a tp x dp x pp run, with known answers.

``generate(run, ...)`` simulates a pipeline-parallel run with data-parallel replicas
and tensor-parallel groups, and writes what TraceML's exporter would write in
``run/aggregator/export``: ``step_time.jsonl`` (with ``tokens`` when asked),
``runtime_environment.jsonl`` (with ``parallel`` and ``parallel_source:
"declared"``) and ``collectives.jsonl`` (with ``group``, ``peer_rank``,
``peer_stage`` and ``bytes``), each ended by its closing line. It returns a
``GroundTruth``: what was injected and the step time with it and without it (the
same simulation, same seed and jitter, with the cause removed).

Layout (Megatron's default order ``tp-cp-ep-dp-pp`` with cp = ep = 1: the first
dimension varies fastest)::

    tp = g % TP,  dp = (g // TP) % DP,  pp = g // (TP * DP)

declared as ``tp=TP,dp=DP,pp=PP``. A *cell* is the tensor-parallel group of one
(dp, pp) position; a *replica* is the pipeline of the cells of one dp coordinate.

Timing model (ms), per step:

- Every rank starts the step after its own ``between_ms`` and ``dataloader_ms``
  (the DataLoader wait is reported as ``dataloader_next`` but lies before the step,
  as in ``simulate()`` of tests/traceml_ai/analysis/test_straggler.py).
- Compute: each microbatch's forward on stage s takes ``forward_ms[s]``, its backward
  ``backward_ms[s]``, each spread over ``tp_layers`` layers. ``stage_extra_ms[s]`` is
  added per microbatch on every replica, split between forward and backward in the
  ratio of the base times. ``slow_rank[r]`` adds ms once per step, to the first
  layer of rank r's first microbatch forward. ``seq_len=(lo, hi)``: each step, each
  replica draws a length (the same on all its ranks) and its compute scales with
  length / ((lo + hi) / 2). Each layer gets its own jitter, uniform in
  [0, jitter_ms / tp_layers].
- Tensor parallel: the ranks of a cell all-reduce after every layer, forward and
  backward (inside the module's call, so inside forward_time / backward_time); each
  layer ends for all of them when the slowest ends, and the others wait the
  difference (plus ``tp_allreduce_ms``). The first layer also absorbs their different
  step starts.
- Pipeline: GPipe (all forwards, then all backwards in microbatch order 0..M-1) or
  1F1B. Stage s receives microbatch m's activation from s-1 before its forward, sends
  its own to s+1 after; gradients go the other way. Blocking sends (``dist.send``;
  GPipe's default) complete when the peer posted its recv, then the transfer
  (``p2p_ms``); asynchronous ones (``isend``; 1F1B's default) never block the sender,
  and the receiver gets the data ``p2p_ms`` after the send was posted. A recv waits
  from when it is posted until the data is there.
- Data parallel: once its backwards are done, each rank all-reduces its gradients with
  the ranks of its (pp, tp) position across replicas: all leave when the last arrives,
  plus ``dp_allreduce_ms``; the others wait the difference. Then ``optimizer_ms``.

Where the communication is reported (``phase`` of the collectives lines): the real
recorder, under a hand-written GPipe and a script's own ``all_reduce`` after the
schedule (tests/scripts/parallel_train.py --pipeline manual), puts the sends, recvs
and the dp all-reduce in ``_traceml_internal:step_time`` (inside the step, outside its
timed phases), which is the default here. ``p2p_phase="phases"`` puts forward
sends/recvs in forward_time and backward ones in backward_time (their waits then
count in those phases' durations); ``dp_phase`` may be ``"backward"`` (as DDP's
buckets) or ``"optimizer"`` likewise.

Pure Python: no torch.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

P = "_traceml_internal:"
STEP = P + "step_time"
FORWARD = P + "forward_time"
BACKWARD = P + "backward_time"
OPTIMIZER = P + "optimizer_step"
DATALOADER = P + "dataloader_next"
PHASE_OF = {"step": STEP, "forward": FORWARD, "backward": BACKWARD, "optimizer": OPTIMIZER}

T0_NS = 1_800_000_000_000_000_000
"""The run's clock origin (a Unix time in ns)."""
OBSERVED_DELAY_NS = 3_000_000
"""How long after a line's timestamp the aggregator received it."""


@dataclass(frozen=True)
class Layout:
    """tp x dp x pp, Megatron order (tp fastest, then dp, then pp)."""

    tp: int = 1
    dp: int = 2
    pp: int = 2

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def declared(self) -> str:
        """The ``parallel`` setting that declares this layout."""
        return f"tp={self.tp},dp={self.dp},pp={self.pp}"

    def coords(self, g: int) -> dict[str, int]:
        return {
            "tp": g % self.tp,
            "dp": (g // self.tp) % self.dp,
            "pp": g // (self.tp * self.dp),
        }

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)


@dataclass(frozen=True)
class GroundTruth:
    """What a generated run holds, for the tests to check a verdict against."""

    folder: Path
    layout: Layout
    declared: str
    """The ``parallel`` setting of the layout, e.g. ``tp=1,dp=2,pp=2``."""
    coords: dict[int, dict[str, int]]
    """Global rank -> {"tp": .., "dp": .., "pp": ..}."""
    slow_stages: tuple[int, ...]
    """Stages given extra work (on every replica), largest extra first."""
    slow_ranks: tuple[int, ...]
    """Ranks given extra ms per step, largest first."""
    data_imbalance: bool
    slowest_replica: tuple[int, ...]
    """Per step (index 0 = step 1): the dp coordinate whose length was longest (with
    ``seq_len``); the replica that does most compute, else all 0."""
    step_ms: float
    """Mean step_time duration written, over every rank and step (steps after an early
    exit are not written and not counted)."""
    step_ms_without_cause: float
    """The same with every injected cause removed (extra stage work, slow ranks, and
    the replicas' lengths replaced by that step's mean length), same seed and jitter."""
    step_ms_without: dict[str, float] = field(default_factory=dict)
    """Per cause present (``stage_extra``, ``slow_rank``, ``seq_len``): the step time
    with only that cause removed."""
    step_ms_median: float = 0.0
    """Median step_time duration written, over every rank and step written."""
    step_ms_median_without_cause: float = 0.0
    per_step_ms: tuple[float, ...] = ()
    """Per step: the longest step_time duration of any rank."""
    per_step_ms_without_cause: tuple[float, ...] = ()
    exit_after: dict[int, int] = field(default_factory=dict)

    @property
    def slowdown(self) -> float:
        """How much longer a step is with the causes: step_ms / step_ms_without_cause."""
        return self.step_ms / self.step_ms_without_cause

    @property
    def slow_stage(self) -> int | None:
        return self.slow_stages[0] if self.slow_stages else None

    @property
    def slow_rank(self) -> int | None:
        return self.slow_ranks[0] if self.slow_ranks else None


# ------------------------------------------------------------------ simulation


@dataclass
class _Comm:
    """One collectives line in the making: (phase, op, group, peer) of one rank and step."""

    n: int = 0
    wait: float = 0.0
    first: float = 0.0
    last: float = 0.0
    nbytes: int = 0

    def add(self, arrival: float, wait: float, nbytes: int) -> None:
        if self.n == 0:
            self.first = arrival
        self.n += 1
        self.wait += wait
        self.last = arrival
        self.nbytes += nbytes


@dataclass
class _RankStep:
    """One rank's step: absolute times (ms) and what it reports."""

    start: float = 0.0
    end: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    dataloader: float = 0.0
    n_forward: int = 0
    n_backward: int = 0
    tokens: int = 0
    comms: dict[tuple[str, str, str, int | None], _Comm] = field(default_factory=dict)

    def comm(
        self,
        phase: str,
        op: str,
        group: str,
        peer: int | None,
        arrival: float,
        wait: float,
        nb: int,
    ) -> None:
        key = (phase, op, group, peer)
        entry = self.comms.get(key)
        if entry is None:
            entry = self.comms[key] = _Comm()
        entry.add(arrival - self.start, wait, nb)


@dataclass(frozen=True)
class _Params:
    layout: Layout
    steps: int
    microbatches: int
    schedule: str
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    optimizer_ms: float
    dataloader_ms: float
    between_ms: float
    tp_layers: int
    tp_allreduce_ms: float
    p2p_ms: float
    dp_allreduce_ms: float
    blocking_send: bool
    stage_extra_ms: dict[int, float]
    slow_rank: dict[int, float]
    seq_len: tuple[int, int] | None
    balance_seq: bool
    """Replace each replica's length by the step's mean over replicas (the cause removed)."""
    samples_per_microbatch: int
    hidden: int
    stage_param_bytes: int
    jitter_ms: float
    seed: int
    p2p_phase: str
    dp_phase: str


def _program(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, str, int]]:
    """The ops of one stage's step, in order: (kind, direction, microbatch) with kind
    compute/recv/send and direction f (activations, forward) or b (gradients)."""
    ops: list[tuple[str, str, int]] = []

    def fwd(i: int) -> None:
        if stage > 0:
            ops.append(("recv", "f", i))
        ops.append(("compute", "f", i))
        if stage < stages - 1:
            ops.append(("send", "f", i))

    def bwd(i: int) -> None:
        if stage < stages - 1:
            ops.append(("recv", "b", i))
        ops.append(("compute", "b", i))
        if stage > 0:
            ops.append(("send", "b", i))

    if schedule == "gpipe":
        for i in range(m):
            fwd(i)
        for i in range(m):
            bwd(i)
    elif schedule == "1f1b":
        warmup = min(stages - stage - 1, m)
        for i in range(warmup):
            fwd(i)
        for i in range(m - warmup):
            fwd(warmup + i)
            bwd(i)
        for i in range(m - warmup, m):
            bwd(i)
    else:
        raise ValueError(f"schedule must be gpipe or 1f1b; got {schedule!r}")
    return ops


def _draws(p: _Params) -> tuple[list[list[float]], list[list[int]]]:
    """Per step and replica: the compute scale and the length (drawn whatever the case,
    so that every variant of a run consumes the same random numbers)."""
    rng = random.Random(f"{p.seed}/seq")
    lo, hi = p.seq_len if p.seq_len is not None else (128, 128)
    ref = (lo + hi) / 2
    scales: list[list[float]] = []
    lengths: list[list[int]] = []
    for _ in range(p.steps):
        drawn = [rng.randint(lo, hi) for _ in range(p.layout.dp)]
        if p.seq_len is None:
            drawn = [int(ref)] * p.layout.dp
        if p.balance_seq:
            mean = sum(drawn) / len(drawn)
            scales.append([mean / ref] * len(drawn))
        else:
            scales.append([d / ref for d in drawn])
        lengths.append(drawn)
    return scales, lengths


def _simulate(p: _Params) -> list[list[_RankStep]]:
    """Every rank's steps (index: step - 1, then global rank)."""
    lay = p.layout
    world = lay.world
    rng = random.Random(f"{p.seed}/jitter")
    scales, lengths = _draws(p)
    m = p.microbatches
    clock = [0.0] * world
    out: list[list[_RankStep]] = []
    for step in range(p.steps):
        rows = [_RankStep() for _ in range(world)]
        # Every rank's own start and every layer's own duration, drawn in a fixed order
        # whatever the causes (so a run without them sees the same jitter).
        for r in range(world):
            between = p.between_ms + rng.uniform(0, p.jitter_ms)
            loader = p.dataloader_ms + rng.uniform(0, p.jitter_ms)
            rows[r].start = clock[r] + between + loader
            rows[r].dataloader = loader
        own: dict[tuple[int, str, int, int], float] = {}
        for r in range(world):
            c = lay.coords(r)
            s, d = c["pp"], c["dp"]
            base_f, base_b = p.forward_ms[s], p.backward_ms[s]
            extra = p.stage_extra_ms.get(s, 0.0)
            extra_f = extra * base_f / (base_f + base_b) if base_f + base_b > 0 else extra / 2
            extra_b = extra - extra_f
            scale = scales[step][d]
            for i in range(m):
                for direction, total in (("f", base_f + extra_f), ("b", base_b + extra_b)):
                    for layer in range(p.tp_layers):
                        ms = total * scale / p.tp_layers + rng.uniform(0, p.jitter_ms / p.tp_layers)
                        if direction == "f" and i == 0 and layer == 0:
                            ms += p.slow_rank.get(r, 0.0)
                        own[(r, direction, i, layer)] = ms
            rows[r].tokens = p.samples_per_microbatch * m * lengths[step][d]
            rows[r].n_forward = rows[r].n_backward = m
        for d in range(lay.dp):
            act_bytes = p.samples_per_microbatch * lengths[step][d] * p.hidden * 2
            _pipeline(p, rows, own, d, act_bytes)
        _data_parallel(p, rows)
        for r in range(world):
            opt = p.optimizer_ms + rng.uniform(0, p.jitter_ms)
            rows[r].optimizer += opt
            rows[r].end += opt
            clock[r] = rows[r].end
        out.append(rows)
    return out


def _pipeline(
    p: _Params,
    rows: list[_RankStep],
    own: dict[tuple[int, str, int, int], float],
    d: int,
    nbytes: int,
) -> None:
    """Run replica ``d``'s schedule; set each of its ranks' ``end`` to its last op's end.

    The cells move op by op; inside a cell each tp rank has its own time ``at``. Point
    to point goes between the ranks of the same tp coordinate of neighbouring stages.
    """
    lay = p.layout
    cells = [[lay.rank(t, d, s) for t in range(lay.tp)] for s in range(lay.pp)]
    programs = [_program(p.schedule, s, lay.pp, p.microbatches) for s in range(lay.pp)]
    pos = [0] * lay.pp
    at = {r: rows[r].start for cell in cells for r in cell}
    # Post times, per (direction, microbatch, sending or receiving stage, tp coordinate).
    sends: dict[tuple[str, int, int, int], float] = {}
    recvs: dict[tuple[str, int, int, int], float] = {}
    inside = p.p2p_phase == "phases"
    while any(pos[s] < len(programs[s]) for s in range(lay.pp)):
        progressed = False
        for s in range(lay.pp):
            cell = cells[s]
            while pos[s] < len(programs[s]):
                kind, direction, i = programs[s][pos[s]]
                phase = (FORWARD if direction == "f" else BACKWARD) if inside else STEP
                if kind == "compute":
                    _compute(p, rows, own, cell, direction, i, at)
                else:
                    sender = s if kind == "send" else (s - 1 if direction == "f" else s + 1)
                    peer_stage = (
                        (s + 1 if direction == "f" else s - 1) if kind == "send" else sender
                    )
                    mine = sends if kind == "send" else recvs
                    other = recvs if kind == "send" else sends
                    for t, r in enumerate(cell):
                        mine.setdefault((direction, i, sender, t), at[r])
                    need_peer = kind == "recv" or p.blocking_send
                    if need_peer and any(
                        (direction, i, sender, t) not in other for t in range(lay.tp)
                    ):
                        break  # the peer stage has not reached the matching op yet
                    for t, r in enumerate(cell):
                        post = mine[(direction, i, sender, t)]
                        if kind == "send" and not p.blocking_send:
                            done = post + 0.01
                        elif p.blocking_send:
                            done = max(post, other[(direction, i, sender, t)]) + p.p2p_ms
                        else:
                            done = max(post, other[(direction, i, sender, t)] + p.p2p_ms)
                        peer = cells[peer_stage][t]
                        rows[r].comm(phase, kind, "pp", peer, post, done - post, nbytes)
                        if inside:
                            _add_phase(rows[r], direction, done - post)
                        at[r] = done
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the pipeline schedule deadlocks (blocking sends under 1F1B?)")
    for r, t_end in at.items():
        rows[r].end = t_end


def _add_phase(row: _RankStep, direction: str, ms: float) -> None:
    if direction == "f":
        row.forward += ms
    else:
        row.backward += ms


def _compute(
    p: _Params,
    rows: list[_RankStep],
    own: dict[tuple[int, str, int, int], float],
    cell: Sequence[int],
    direction: str,
    i: int,
    at: dict[int, float],
) -> None:
    """One microbatch's forward or backward on a cell, layer by layer; with tp > 1 the
    cell's ranks all-reduce after each layer and leave it together."""
    phase = FORWARD if direction == "f" else BACKWARD
    before = {r: at[r] for r in cell}
    nb = p.samples_per_microbatch * p.hidden * 2 * 128
    for layer in range(p.tp_layers):
        ends = {r: at[r] + own[(r, direction, i, layer)] for r in cell}
        if len(cell) > 1:
            leave = max(ends.values()) + p.tp_allreduce_ms
            for r in cell:
                rows[r].comm(phase, "all_reduce", "tp", None, ends[r], leave - ends[r], nb)
                at[r] = leave
        else:
            at.update(ends)
    for r in cell:
        _add_phase(rows[r], direction, at[r] - before[r])


def _data_parallel(p: _Params, rows: list[_RankStep]) -> None:
    """Each (pp, tp) position's replicas all-reduce their gradients; move ``end``."""
    lay = p.layout
    phase = PHASE_OF[p.dp_phase]
    if lay.dp < 2:
        return
    for s in range(lay.pp):
        for t in range(lay.tp):
            group = [lay.rank(t, d, s) for d in range(lay.dp)]
            leave = max(rows[r].end for r in group) + p.dp_allreduce_ms
            for r in group:
                wait = leave - rows[r].end
                rows[r].comm(
                    phase, "all_reduce", "dp", None, rows[r].end, wait, p.stage_param_bytes
                )
                if phase == BACKWARD:
                    rows[r].backward += wait
                elif phase == OPTIMIZER:
                    rows[r].optimizer += wait
                rows[r].end = leave


# ------------------------------------------------------------------ writing


def _timing(ms: float, n: int = 1) -> dict[str, Any]:
    ms = round(ms, 6)
    return {"cpu": {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": n}}


def _identity(stream: str, g: int, world: int, per_node: int, ts_ns: int) -> dict[str, Any]:
    return {
        "stream": stream,
        "schema_version": 1,
        "observed_timestamp_unix_ns": ts_ns + OBSERVED_DELAY_NS,
        "rank": g,
        "global_rank": g,
        "local_rank": g % per_node,
        "world_size": world,
        "local_world_size": per_node,
        "node_rank": g // per_node,
    }


def _write(path: Path, stream: str, lines: list[dict[str, Any]]) -> None:
    lines.sort(key=lambda o: (o["observed_timestamp_unix_ns"], o["global_rank"], o["seq"]))
    closing = {
        "stream": stream,
        "closing": True,
        "schema_version": 1,
        "written_records": len(lines),
        "dropped_batches": 0,
    }
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in [*lines, closing]))


def _ns(ms: float) -> int:
    return T0_NS + round(ms * 1e6)


def _files(
    p: _Params,
    sim: list[list[_RankStep]],
    export: Path,
    *,
    tokens: bool,
    exit_after: Mapping[int, int],
    per_node: int,
) -> None:
    lay = p.layout
    world = lay.world
    export.mkdir(parents=True, exist_ok=True)
    step_lines: list[dict[str, Any]] = []
    coll_lines: list[dict[str, Any]] = []
    coll_seq = [0] * world
    for step, rows in enumerate(sim, start=1):
        for g, row in enumerate(rows):
            if step > exit_after.get(g, p.steps):
                continue
            end_ns = _ns(row.end)
            events = {
                STEP: _timing(row.end - row.start),
                FORWARD: _timing(row.forward, row.n_forward),
                BACKWARD: _timing(row.backward, row.n_backward),
                OPTIMIZER: _timing(row.optimizer),
                DATALOADER: _timing(row.dataloader),
            }
            line = _identity("step_time", g, world, per_node, end_ns)
            line.update(
                {
                    "timestamp_unix_ns": end_ns,
                    "seq": step - 1,
                    "step": step,
                    "events": dict(sorted(events.items())),
                }
            )
            if tokens:
                line["tokens"] = row.tokens
            step_lines.append(line)
            pp_of = lay.coords
            for (phase, op, group, peer), c in sorted(
                row.comms.items(), key=lambda kv: (kv[1].first, kv[0][1], kv[0][3] or 0)
            ):
                cl = _identity("collectives", g, world, per_node, end_ns)
                cl.update(
                    {
                        "timestamp_unix_ns": end_ns,
                        "seq": coll_seq[g],
                        "step": step,
                        "phase": phase,
                        "op": op,
                        "source": "torch.distributed",
                        "backend": "gloo",
                        "n_calls": c.n,
                        "wait_ms": round(c.wait, 6),
                        "wait_measure": "host",
                        "first_arrival_ms": round(max(c.first, 0.0), 6),
                        "last_arrival_ms": round(max(c.last, 0.0), 6),
                        "group": group,
                        "peer_rank": peer,
                        "peer_stage": pp_of(peer)["pp"] if peer is not None else None,
                        "bytes": c.nbytes,
                    }
                )
                coll_seq[g] += 1
                coll_lines.append(cl)
    env_lines = []
    nodes = -(-world // per_node)
    for g in range(world):
        ts = _ns(sim[0][g].start) - 50_000_000
        line = _identity("runtime_environment", g, world, per_node, ts)
        coord = lay.coords(g)
        line.update(
            {
                "timestamp_unix_ns": ts,
                "seq": 0,
                "pid": 1000 + g,
                "topology": "single_node_multi_process" if nodes == 1 else "multi_node",
                "distributed_initialized": True,
                "distributed_backend": "gloo",
                "training_strategy": "distributed_unknown",
                "strategy_source": "runtime_distributed",
                "strategy_confidence": "low",
                "torch_version": "2.13.0+cpu",
                "python_version": "3.11.7",
                "parallel": {
                    name: {"rank": coord[name], "size": getattr(lay, name)}
                    for name in sorted(coord)
                },
                "parallel_source": "declared",
            }
        )
        env_lines.append(line)
    _write(export / "step_time.jsonl", "step_time", step_lines)
    _write(export / "collectives.jsonl", "collectives", coll_lines)
    _write(export / "runtime_environment.jsonl", "runtime_environment", env_lines)


def _written_steps(
    sim: list[list[_RankStep]], exit_after: Mapping[int, int], steps: int
) -> list[float]:
    return [
        row.end - row.start
        for step, rows in enumerate(sim, start=1)
        for g, row in enumerate(rows)
        if step <= exit_after.get(g, steps)
    ]


def _mean_step(sim: list[list[_RankStep]], exit_after: Mapping[int, int], steps: int) -> float:
    values = _written_steps(sim, exit_after, steps)
    return sum(values) / len(values)


def _median_step(sim: list[list[_RankStep]], exit_after: Mapping[int, int], steps: int) -> float:
    return statistics.median(_written_steps(sim, exit_after, steps))


def _per_step(sim: list[list[_RankStep]]) -> tuple[float, ...]:
    return tuple(max(row.end - row.start for row in rows) for rows in sim)


def _stage_ms(value: float | Sequence[float], pp: int, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * pp
    out = tuple(float(v) for v in value)
    if len(out) != pp:
        raise ValueError(f"{what}: one value per stage ({pp}); got {len(out)}")
    return out


def generate(
    run: Path,
    *,
    tp: int = 1,
    dp: int = 2,
    pp: int = 2,
    steps: int = 30,
    microbatches: int = 4,
    schedule: str = "gpipe",
    forward_ms: float | Sequence[float] = 2.0,
    backward_ms: float | Sequence[float] = 4.0,
    optimizer_ms: float = 0.5,
    dataloader_ms: float = 0.2,
    between_ms: float = 0.1,
    tp_layers: int = 2,
    tp_allreduce_ms: float = 0.05,
    p2p_ms: float = 0.1,
    dp_allreduce_ms: float = 0.5,
    blocking_send: bool | None = None,
    stage_extra_ms: Mapping[int, float] | None = None,
    slow_rank: Mapping[int, float] | None = None,
    seq_len: tuple[int, int] | None = None,
    tokens: bool = False,
    exit_after: Mapping[int, int] | None = None,
    jitter_ms: float = 0.2,
    seed: int = 0,
    p2p_phase: str = "step",
    dp_phase: str = "step",
    ranks_per_node: int | None = None,
    samples_per_microbatch: int = 2,
    hidden: int = 1024,
    stage_param_bytes: int = 4_000_000,
) -> GroundTruth:
    """Write a synthetic run's export folder under ``run`` and return its ground truth.

    ``stage_extra_ms``: stage -> extra ms per microbatch, on every replica (split
    between forward and backward like the base times). ``slow_rank``: global rank ->
    extra ms once per step (in its first microbatch's forward). ``seq_len``: (lo, hi)
    lengths drawn per step and replica; compute scales with length / ((lo+hi)/2).
    ``tokens``: write ``tokens`` on the step_time lines (samples_per_microbatch x
    microbatches x the replica's length). ``exit_after``: rank -> last step it writes.
    ``blocking_send``: default True under GPipe, False under 1F1B. ``p2p_phase``:
    ``"step"`` (default, as the real recorder reports a hand-written pipeline) or
    ``"phases"`` (forward/backward). ``dp_phase``: ``"step"``, ``"backward"`` or
    ``"optimizer"``. ``ranks_per_node``: default every rank on one node.
    """
    layout = Layout(tp=tp, dp=dp, pp=pp)
    world = layout.world
    if p2p_phase not in ("step", "phases"):
        raise ValueError(f"p2p_phase must be step or phases; got {p2p_phase!r}")
    if dp_phase not in ("step", "backward", "optimizer"):
        raise ValueError(f"dp_phase must be step, backward or optimizer; got {dp_phase!r}")
    stage_extra = {int(k): float(v) for k, v in (stage_extra_ms or {}).items() if v}
    slow = {int(k): float(v) for k, v in (slow_rank or {}).items() if v}
    for r in slow:
        if not 0 <= r < world:
            raise ValueError(f"slow_rank: rank {r} outside world of {world}")
    for s in stage_extra:
        if not 0 <= s < pp:
            raise ValueError(f"stage_extra_ms: stage {s} outside {pp} stages")
    exits = dict(exit_after or {})
    per_node = ranks_per_node or world
    if blocking_send is None:
        blocking_send = schedule == "gpipe"

    def params(**changes: Any) -> _Params:
        base: dict[str, Any] = {
            "layout": layout,
            "steps": steps,
            "microbatches": microbatches,
            "schedule": schedule,
            "forward_ms": _stage_ms(forward_ms, pp, "forward_ms"),
            "backward_ms": _stage_ms(backward_ms, pp, "backward_ms"),
            "optimizer_ms": optimizer_ms,
            "dataloader_ms": dataloader_ms,
            "between_ms": between_ms,
            "tp_layers": tp_layers,
            "tp_allreduce_ms": tp_allreduce_ms,
            "p2p_ms": p2p_ms,
            "dp_allreduce_ms": dp_allreduce_ms,
            "blocking_send": blocking_send,
            "stage_extra_ms": stage_extra,
            "slow_rank": slow,
            "seq_len": seq_len,
            "balance_seq": False,
            "samples_per_microbatch": samples_per_microbatch,
            "hidden": hidden,
            "stage_param_bytes": stage_param_bytes,
            "jitter_ms": jitter_ms,
            "seed": seed,
            "p2p_phase": p2p_phase,
            "dp_phase": dp_phase,
        }
        base.update(changes)
        return _Params(**base)

    simulate = _simulate

    actual = params()
    sim = simulate(actual)
    export = run / "aggregator" / "export"
    _files(actual, sim, export, tokens=tokens, exit_after=exits, per_node=per_node)

    clean = simulate(params(stage_extra_ms={}, slow_rank={}, balance_seq=True))
    without: dict[str, float] = {}
    if stage_extra:
        without["stage_extra"] = _mean_step(simulate(params(stage_extra_ms={})), exits, steps)
    if slow:
        without["slow_rank"] = _mean_step(simulate(params(slow_rank={})), exits, steps)
    if seq_len is not None:
        without["seq_len"] = _mean_step(simulate(params(balance_seq=True)), exits, steps)

    _, lengths = _draws(actual)
    return GroundTruth(
        folder=run,
        layout=layout,
        declared=layout.declared,
        coords={g: layout.coords(g) for g in range(world)},
        slow_stages=tuple(sorted(stage_extra, key=lambda s: (-stage_extra[s], s))),
        slow_ranks=tuple(sorted(slow, key=lambda r: (-slow[r], r))),
        data_imbalance=seq_len is not None and seq_len[0] != seq_len[1],
        slowest_replica=tuple(max(range(dp), key=lambda d: (ls[d], -d)) for ls in lengths),
        step_ms=_mean_step(sim, exits, steps),
        step_ms_without_cause=_mean_step(clean, exits, steps),
        step_ms_without=without,
        step_ms_median=_median_step(sim, exits, steps),
        step_ms_median_without_cause=_median_step(clean, exits, steps),
        per_step_ms=_per_step(sim),
        per_step_ms_without_cause=_per_step(clean),
        exit_after=exits,
    )
