"""This rank's place in the job's parallel layout, and which dimension a process
group spans.

Sources, the first found wins:

1. a torch ``DeviceMesh`` the script made (``init_device_mesh``, DTensor, FSDP2, TP):
   noted as it is made (``note_mesh``, from ``rank._patches.layout_hooks``); the
   largest one is the job's. Its dims keep their names (HSDP's
   ``dp_replicate``/``dp_shard``); ``mesh.mesh`` gives every global rank's place;
2. ``torch.distributed.pipelining`` stages (``PipelineStage``): ``pp`` is the rank's
   place in the stage's group; ``dp`` follows from the pp group's ranks when the layout
   is plain (pp groups strided by the world over pp, or contiguous);
3. Megatron-Core's ``megatron.core.parallel_state`` (imported by the script and
   initialized): tp, cp, dp, pp (and ep when above 1), Megatron's rank order;
4. DeepSpeed's pipeline grid (``deepspeed.runtime.pipe.topology.PipelineParallelGrid``,
   noted as it is made): its topology's axes (pipe -> pp, data -> dp, model -> tp);
5. the declared ``parallel`` setting (``TRACEML_PARALLEL``), Megatron's order: the
   first dimension varies fastest with the global rank.

Nothing here raises into training: a failure costs one warning line and the layout is
unknown.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from traceml_ai import _environ
from traceml_ai.rank._init_config import warn_once
from traceml_ai.settings import parse_parallel_layout

__all__ = [
    "GROUP_LABELS",
    "Layout",
    "current_layout",
    "group_label",
    "layout_changed",
    "note_grid",
    "note_mesh",
    "note_stage",
    "parse_declared",
    "reset",
]

GROUP_LABELS = ("dp", "pp", "tp", "cp", "ep", "world", "other")
"""What a collective's ``group`` may be (the contract's enum)."""
_LABELLED = frozenset(("dp", "pp", "tp", "cp", "ep"))

SOURCE_DEVICE_MESH = "device_mesh"
SOURCE_PIPELINING = "pipelining"
SOURCE_MEGATRON = "megatron"
SOURCE_DEEPSPEED = "deepspeed"
SOURCE_DECLARED = "declared"

_DEEPSPEED_AXES = {"pipe": "pp", "data": "dp", "model": "tp", "tensor": "tp"}
_MEGATRON_ORDER = ("tp", "cp", "dp", "pp")
"""Megatron-Core's default rank order (``tp-cp-ep-dp-pp``, expert parallelism inside
data parallelism), fastest first."""
_POLL_S = 1.0
"""How often a layout that a library may have set up since is looked for again."""


def label_of_dim(name: str) -> str:
    """The collectives' ``group`` of a dimension: dp/pp/tp/cp/ep, ``dp`` for any
    ``dp_*`` (HSDP's ``dp_replicate``/``dp_shard``), else ``other``."""
    if name in _LABELLED:
        return name
    if name.startswith("dp_"):
        return "dp"
    return "other"


class Layout:
    """A parallel layout: its dimensions (names, sizes), this rank's coordinates, a way
    to tell any global rank's, and the process groups known to span one dimension."""

    __slots__ = ("_coords_of", "coords", "dims", "groups", "sizes", "source")

    def __init__(
        self,
        *,
        dims: Sequence[str],
        sizes: Sequence[int],
        coords: Sequence[int],
        source: str,
        coords_of: Callable[[int], tuple[int, ...] | None],
        groups: Mapping[Any, str] | None = None,
    ) -> None:
        self.dims = tuple(dims)
        self.sizes = tuple(sizes)
        self.coords = tuple(coords)
        self.source = source
        self._coords_of = coords_of
        # A process group object -> the dimension it is known to span (the library's).
        self.groups: dict[Any, str] = dict(groups or {})

    def coords_of(self, global_rank: int) -> tuple[int, ...] | None:
        """Global rank ``global_rank``'s coordinates (None: not known)."""
        try:
            return self._coords_of(global_rank)
        except Exception:
            return None

    def coordinate(self, global_rank: int, dim: str) -> int | None:
        """Global rank ``global_rank``'s coordinate in ``dim`` (None: not known)."""
        if dim not in self.dims:
            return None
        coords = self.coords_of(global_rank)
        return None if coords is None else coords[self.dims.index(dim)]

    def item(self) -> dict[str, Any]:
        """The ``parallel`` value of a ``runtime_environment`` item (names sorted)."""
        by_name: dict[str, Any] = {
            d: {"rank": c, "size": s}
            for d, s, c in zip(self.dims, self.sizes, self.coords, strict=True)
        }
        return {name: by_name[name] for name in sorted(by_name)}

    def dim_spanned(self, ranks: Sequence[int]) -> str | None:
        """The one dimension whose coordinate differs among ``ranks`` (all the others
        equal), or None."""
        places = [self.coords_of(r) for r in ranks]
        if not places or any(p is None for p in places):
            return None
        first = places[0]
        assert first is not None
        differ = [
            i
            for i in range(len(self.dims))
            if any(p is not None and p[i] != first[i] for p in places)
        ]
        if len(differ) != 1:
            return None
        return self.dims[differ[0]]


# --------------------------------------------------------------------------- sources


def grid_layout(
    dims: Sequence[str],
    sizes: Sequence[int],
    rank: int,
    source: str,
    groups: Mapping[Any, str] | None = None,
) -> Layout:
    """A regular grid, the first dimension varying fastest with the global rank."""
    dims_t, sizes_t = tuple(dims), tuple(sizes)
    world = 1
    for s in sizes_t:
        world *= s

    def coords_of(g: int) -> tuple[int, ...] | None:
        if not 0 <= g < world:
            return None
        out = []
        for s in sizes_t:
            out.append(g % s)
            g //= s
        return tuple(out)

    coords = coords_of(rank)
    if coords is None:
        raise ValueError(f"rank {rank} is outside a layout of {world} ranks")
    return Layout(
        dims=dims_t, sizes=sizes_t, coords=coords, source=source, coords_of=coords_of, groups=groups
    )


def parse_declared(text: str, world_size: int, rank: int) -> Layout | None:
    """The declared layout (``tp=4,dp=8``) for ``rank`` of ``world_size``; None when
    ``text`` is empty. ``ValueError`` when malformed or not ``world_size`` ranks."""
    dims = parse_parallel_layout(text)
    if not dims:
        return None
    product = 1
    for _, size in dims:
        product *= size
    if product != world_size:
        raise ValueError(
            f"the declared layout {text!r} (--parallel, {_environ.PARALLEL}) describes "
            f"{product} ranks; the job has {world_size}"
        )
    return grid_layout([d for d, _ in dims], [s for _, s in dims], rank, SOURCE_DECLARED)


def _dist() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
    except Exception:
        return None
    return dist


def _world_and_rank(dist: Any) -> tuple[int, int]:
    if dist is not None:
        return int(dist.get_world_size()), int(dist.get_rank())
    return int(os.environ.get("WORLD_SIZE", "1") or 1), int(os.environ.get("RANK", "0") or 0)


_meshes: list[weakref.ref[Any]] = []
_stages: list[weakref.ref[Any]] = []
_grids: list[weakref.ref[Any]] = []
_lock = threading.Lock()
_generation = 0
"""Bumped when a mesh, a stage or a grid is noted: the layout is looked for again."""


def _note(where: list[weakref.ref[Any]], obj: object) -> None:
    global _generation
    try:
        ref = weakref.ref(obj)
    except TypeError:
        return
    with _lock:
        where.append(ref)
        del where[:-64]  # the newest; a script that makes thousands keeps memory flat
        _generation += 1


def note_mesh(mesh: object) -> None:
    """A torch ``DeviceMesh`` the script made."""
    _note(_meshes, mesh)


def note_stage(stage: object) -> None:
    """A ``torch.distributed.pipelining`` stage the script made."""
    _note(_stages, stage)


def note_grid(grid: object) -> None:
    """A DeepSpeed ``PipelineParallelGrid`` the script made."""
    _note(_grids, grid)


def _alive(where: list[weakref.ref[Any]]) -> list[Any]:
    with _lock:
        refs = list(where)
    return [obj for obj in (r() for r in refs) if obj is not None]


def _from_mesh(dist: Any) -> Layout | None:
    meshes = _alive(_meshes)
    module = sys.modules.get("torch.distributed.device_mesh")
    resources = getattr(module, "_mesh_resources", None)
    # Meshes made before TraceML's hook went in: those the script entered (``with mesh``).
    meshes += list(getattr(resources, "mesh_stack", None) or ())
    if not meshes:
        return None
    _, rank = _world_and_rank(dist)
    best = None
    best_key = (0, 0)
    for mesh in meshes:
        tensor = getattr(mesh, "mesh", None)
        if tensor is None:
            continue
        key = (int(tensor.numel()), int(tensor.dim()))
        if key > best_key:
            best, best_key = mesh, key
    if best is None:
        return None
    tensor = best.mesh
    shape = tuple(int(s) for s in tensor.shape)
    names = tuple(best.mesh_dim_names or ()) or tuple(f"dim{i}" for i in range(len(shape)))
    places: dict[int, tuple[int, ...]] = {}
    flat = [int(r) for r in tensor.flatten().tolist()]
    for index, g in enumerate(flat):
        coords = []
        rest = index
        for size in reversed(shape):
            coords.append(rest % size)
            rest //= size
        places[g] = tuple(reversed(coords))
    if rank not in places:
        return None
    groups: dict[Any, str] = {}
    for i, name in enumerate(names):
        try:
            groups[best.get_group(i)] = name
        except Exception:
            continue
    return Layout(
        dims=names,
        sizes=shape,
        coords=places[rank],
        source=SOURCE_DEVICE_MESH,
        coords_of=places.get,
        groups=groups,
    )


def _from_pipelining(dist: Any) -> Layout | None:
    stages = _alive(_stages)
    if not stages or dist is None:
        return None
    stage = stages[-1]
    group = getattr(stage, "group", None)
    world, rank = _world_and_rank(dist)
    ranks = (
        [int(r) for r in dist.get_process_group_ranks(group)]
        if group is not None
        else list(range(world))
    )
    pp = len(ranks)
    if rank not in ranks or pp < 1:
        return None
    groups: dict[Any, str] = {} if group is None else {group: "pp"}
    if pp == world:
        return grid_layout(("pp",), (pp,), rank, SOURCE_PIPELINING, groups)
    dp = world // pp
    if pp * dp == world:
        steps = {b - a for a, b in itertools.pairwise(ranks)}
        if steps == {dp}:  # pp slowest: the pp group holds ranks dp apart
            return grid_layout(("dp", "pp"), (dp, pp), rank, SOURCE_PIPELINING, groups)
        if steps == {1} and ranks[0] % pp == 0:  # pp fastest: contiguous pp groups
            return grid_layout(("pp", "dp"), (pp, dp), rank, SOURCE_PIPELINING, groups)
    places = {g: (i,) for i, g in enumerate(ranks)}
    return Layout(
        dims=("pp",),
        sizes=(pp,),
        coords=places[rank],
        source=SOURCE_PIPELINING,
        coords_of=places.get,
        groups=groups,
    )


def _from_megatron(dist: Any) -> Layout | None:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None
    initialized = getattr(ps, "model_parallel_is_initialized", None)
    if initialized is None or not initialized():
        return None
    names = {"tp": "tensor_model", "cp": "context", "dp": "data", "pp": "pipeline_model"}
    sizes: dict[str, int] = {}
    coords: dict[str, int] = {}
    groups: dict[Any, str] = {}
    for dim, stem in names.items():
        size_fn = getattr(ps, f"get_{stem}_parallel_world_size", None)
        rank_fn = getattr(ps, f"get_{stem}_parallel_rank", None)
        if size_fn is None or rank_fn is None:
            if dim in ("tp", "pp", "dp"):
                return None
            continue
        sizes[dim], coords[dim] = int(size_fn()), int(rank_fn())
        group_fn = getattr(ps, f"get_{stem}_parallel_group", None)
        if group_fn is not None:
            with contextlib.suppress(Exception):
                groups[group_fn()] = dim
    dims = [d for d in _MEGATRON_ORDER if d in sizes]
    world, rank = _world_and_rank(dist)
    layout = grid_layout(dims, [sizes[d] for d in dims], rank, SOURCE_MEGATRON, groups)
    if layout.coords != tuple(coords[d] for d in dims):
        # Another order than Megatron's default: this rank's own place, others unknown.
        mine = tuple(coords[d] for d in dims)
        layout = Layout(
            dims=dims, sizes=[sizes[d] for d in dims], coords=mine, source=SOURCE_MEGATRON,
            coords_of=lambda g: mine if g == rank else None, groups=groups,
        )  # fmt: skip
    ep_size_fn = getattr(ps, "get_expert_model_parallel_world_size", None)
    ep_rank_fn = getattr(ps, "get_expert_model_parallel_rank", None)
    if ep_size_fn is not None and ep_rank_fn is not None:
        ep = int(ep_size_fn())
        if ep > 1:
            base = layout
            ep_rank = int(ep_rank_fn())
            layout = Layout(
                dims=(*base.dims, "ep"), sizes=(*base.sizes, ep), coords=(*base.coords, ep_rank),
                source=SOURCE_MEGATRON, coords_of=lambda g: None, groups=base.groups,
            )  # fmt: skip
            group_fn = getattr(ps, "get_expert_model_parallel_group", None)
            if group_fn is not None:
                layout.groups[group_fn()] = "ep"
    del world
    return layout


def _from_deepspeed(dist: Any) -> Layout | None:
    grids = _alive(_grids)
    if not grids:
        return None
    grid = grids[-1]
    topo = getattr(grid, "_topo", None)
    if topo is None:
        return None
    world, rank = _world_and_rank(dist)
    axes = list(topo.get_axis_names())
    names = [_DEEPSPEED_AXES.get(a, a) for a in axes]
    sizes = [int(topo.get_dim(a)) for a in axes]

    def coords_of(g: int) -> tuple[int, ...] | None:
        coord = topo.get_coord(g)
        return tuple(int(getattr(coord, a)) for a in axes)

    mine = coords_of(rank)
    if mine is None:
        return None
    groups: dict[Any, str] = {}
    for method, dim in (
        ("get_pipe_parallel_group", "pp"),
        ("get_data_parallel_group", "dp"),
        ("get_slice_parallel_group", "tp"),
        ("get_model_parallel_group", "tp"),
    ):
        fn = getattr(grid, method, None)
        if fn is None:
            continue
        try:
            group = fn()
        except Exception:
            continue
        if group is not None and group not in groups:
            groups[group] = dim
    del world
    return Layout(
        dims=names,
        sizes=sizes,
        coords=mine,
        source=SOURCE_DEEPSPEED,
        coords_of=coords_of,
        groups=groups,
    )


def _from_declared(dist: Any) -> Layout | None:
    text = os.environ.get(_environ.PARALLEL, "")
    if not text.strip():
        return None
    world, rank = _world_and_rank(dist)
    return parse_declared(text, world, rank)


_SOURCES: tuple[tuple[str, Callable[[Any], Layout | None]], ...] = (
    (SOURCE_DEVICE_MESH, _from_mesh),
    (SOURCE_PIPELINING, _from_pipelining),
    (SOURCE_MEGATRON, _from_megatron),
    (SOURCE_DEEPSPEED, _from_deepspeed),
    (SOURCE_DECLARED, _from_declared),
)


def find_layout() -> Layout | None:
    """The layout now, from the first source that has one; None when none has.

    A source that fails costs one warning line (per source) and is passed over."""
    dist = _dist()
    for name, source in _SOURCES:
        try:
            layout = source(dist)
        except Exception as exc:
            warn_once(
                f"parallel:{name}",
                f"traceml: the parallel layout could not be read from {name} ({exc}); "
                "it is unknown to TraceML (training is unaffected)",
            )
            continue
        if layout is not None:
            return layout
    return None


# --------------------------------------------------------------------------- the cache

_cached: Layout | None = None
_cached_generation = -1
_cached_at = 0.0
_labels: dict[Any, str] = {}


def current_layout() -> Layout | None:
    """The layout, found again when a mesh, a stage or a grid was noted since, or
    (at most once a second) while a library's state may have been set up since."""
    global _cached, _cached_generation, _cached_at
    now = time.monotonic()
    generation = _generation
    stale = generation != _cached_generation
    if not stale and now - _cached_at >= _POLL_S:
        cached = _cached
        # Megatron's state has no hook: looked for again while it may come.
        stale = (cached is None or cached.source == SOURCE_DECLARED) and (
            "megatron.core.parallel_state" in sys.modules or cached is None
        )
    if stale:
        layout = find_layout()
        if _same(layout, _cached):
            layout = _cached
        else:
            _labels.clear()
        _cached, _cached_generation, _cached_at = layout, generation, now
    return _cached


def _same(a: Layout | None, b: Layout | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.dims, a.sizes, a.coords, a.source) == (b.dims, b.sizes, b.coords, b.source)


def layout_changed() -> int:
    """A number that changes when a mesh, a stage or a grid is noted."""
    return _generation


def group_label(group: Any, layout: Layout | None) -> str:
    """The collectives' ``group`` of a call over ``group`` (None: the default group):
    ``world`` for the whole job, the dimension the group's ranks differ in (dp/pp/tp/
    cp/ep), else ``other``. Cached per group object (until the layout changes)."""
    if group is None:
        return "world"
    label = _labels.get(group)
    if label is not None:
        return label
    label = _classify(group, layout)
    with contextlib.suppress(TypeError):
        _labels[group] = label
    return label


def pair_label(layout: Layout | None, peer: int) -> str:
    """The group of a point-to-point call on the whole job's group: the dimension in
    which this rank and ``peer`` differ alone, else ``world``."""
    if layout is None:
        return "world"
    mine = layout.coords
    theirs = layout.coords_of(peer)
    if theirs is None or len(theirs) != len(mine):
        return "world"
    differ = [i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
    if len(differ) != 1:
        return "world"
    return label_of_dim(layout.dims[differ[0]])


def _classify(group: Any, layout: Layout | None) -> str:
    try:
        import torch.distributed as dist

        if group is dist.GroupMember.WORLD:
            return "world"
        ranks = [int(r) for r in dist.get_process_group_ranks(group)]
        if len(ranks) == dist.get_world_size():
            return "world"
    except Exception:
        return "other"
    if layout is None:
        return "other"
    known = layout.groups.get(group)
    if known is not None:
        return label_of_dim(known)
    dim = layout.dim_spanned(ranks)
    return "other" if dim is None else label_of_dim(dim)


def reset() -> None:
    """Forget every noted mesh, stage and grid, and the cache (tests)."""
    global _cached, _cached_generation, _generation
    with _lock:
        _meshes.clear()
        _stages.clear()
        _grids.clear()
        _generation += 1
    _cached, _cached_generation = None, -1
    _labels.clear()
