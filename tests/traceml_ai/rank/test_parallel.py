"""The parallel layout on the rank: where each rank is (DeviceMesh, declared layout,
Megatron and DeepSpeed stand-ins), which dimension a collective ran over, point-to-point
peers and bytes, and tokens on the step line. Multi-rank cases run real gloo process
groups on CPU, one subprocess per rank (``_parallel_worker.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import free_port
from tests.traceml_ai.rank.conftest import once
from traceml_ai.rank._collectives import parallel_layout
from traceml_ai.rank._init_config import forget_warnings
from traceml_ai.rank._patches import layout_hooks
from traceml_ai.settings import SettingsError, parse_parallel, resolve_launch_settings

WORKER = Path(__file__).with_name("_parallel_worker.py")
ROOT = Path(__file__).resolve().parents[3]


def _run_ranks(
    scenario: str, world: int, tmp_path: Path, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    base.update(env or {})
    base["PYTHONPATH"] = str(ROOT)
    base["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(r), str(world), port, str(tmp_path)],
            env=base,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]


def _by_group(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["group"]: item for item in items if item["op"] == "all_reduce"}


@pytest.mark.slow  # real gloo ranks in subprocesses
@once  # ranks in children
@pytest.mark.timeout(300)
def test_a_device_mesh_gives_coordinates_and_group_names(tmp_path: Path) -> None:
    ranks = _run_ranks("mesh", 4, tmp_path)
    for r, got in enumerate(ranks):
        envs = got["runtime_environment"]
        # The first item came before the mesh; the mesh made later is sent again.
        assert envs[0]["parallel"] is None and envs[0]["parallel_source"] is None
        last = envs[-1]
        assert last["parallel_source"] == "device_mesh"
        assert last["parallel"] == {
            "dp": {"rank": r // 2, "size": 2},
            "tp": {"rank": r % 2, "size": 2},
        }
        groups = _by_group(got["collectives"])
        assert set(groups) == {"tp", "dp", "world"}
        assert groups["tp"]["bytes"] == 32 and groups["dp"]["bytes"] == 16
        assert groups["world"]["n_calls"] == 2 and groups["world"]["bytes"] == 16
        for item in got["collectives"]:
            assert item["peer_rank"] is None and item["peer_stage"] is None
        steps = got["step_time"]
        assert steps[0]["tokens"] == 7 and steps[1]["tokens"] == 11


@pytest.mark.slow  # real gloo ranks in subprocesses
@once  # ranks in children
@pytest.mark.timeout(300)
def test_megatron_core_parallel_state_gives_coordinates_and_groups(tmp_path: Path) -> None:
    """The real Megatron-Core (its parallel_state on gloo, CPU): each rank's place and
    its data- and pipeline-parallel groups, without any setting."""
    ranks = _run_ranks("megatron", 4, tmp_path)
    for r, got in enumerate(ranks):
        last = got["runtime_environment"][-1]
        assert last["parallel_source"] == "megatron"
        coords = last["parallel"]
        assert coords["dp"] == {"rank": r % 2, "size": 2}
        assert coords["pp"] == {"rank": r // 2, "size": 2}
        assert coords["tp"] == {"rank": 0, "size": 1}
        assert set(_by_group(got["collectives"])) == {"dp", "pp"}


@pytest.mark.slow  # real gloo ranks in subprocesses
@once  # ranks in children
@pytest.mark.timeout(300)
def test_send_recv_between_pipeline_stages(tmp_path: Path) -> None:
    ranks = _run_ranks("pipeline", 2, tmp_path, {"TRACEML_PARALLEL": "pp=2"})
    for r, got in enumerate(ranks):
        env = got["runtime_environment"][-1]
        assert env["parallel"] == {"pp": {"rank": r, "size": 2}}
        assert env["parallel_source"] == "declared"
        p2p = [i for i in got["collectives"] if i["op"] in ("send", "recv")]
        op = "send" if r == 0 else "recv"
        assert {i["op"] for i in p2p} == {op}
        assert sum(i["n_calls"] for i in p2p) == 2
        assert sum(i["bytes"] for i in p2p) == (10 + 6) * 4
        for item in p2p:
            assert item["peer_rank"] == 1 - r and item["peer_stage"] == 1 - r
            # On the default group, a send or receive runs over the dimension in which
            # the two ranks differ: the pipeline's.
            assert item["group"] == "pp"
        assert all("tokens" not in s for s in got["step_time"])


@pytest.mark.slow  # real gloo ranks in subprocesses
@once  # ranks in children
@pytest.mark.timeout(300)
def test_a_declared_layout_that_is_not_the_world_is_unknown(tmp_path: Path) -> None:
    ranks = _run_ranks("declared", 2, tmp_path, {"TRACEML_PARALLEL": "tp=4"})
    for got in ranks:
        assert got["runtime_environment"][-1]["parallel"] is None
        assert got["collectives"][0]["group"] == "world"


def test_declared_layout_coordinates_follow_megatrons_order() -> None:
    world = 4 * 1 * 8 * 4
    seen = set()
    for g in range(world):
        layout = parallel_layout.parse_declared("tp=4,cp=1,dp=8,pp=4", world, g)
        assert layout is not None
        c = layout.item()
        assert c["tp"]["rank"] == g % 4 and c["cp"]["rank"] == 0
        assert c["dp"]["rank"] == (g // 4) % 8 and c["pp"]["rank"] == g // 32
        assert [c[d]["size"] for d in ("tp", "cp", "dp", "pp")] == [4, 1, 8, 4]
        seen.add((c["tp"]["rank"], c["dp"]["rank"], c["pp"]["rank"]))
    assert len(seen) == world
    layout = parallel_layout.parse_declared("tp=2,dp=2", 4, 0)
    assert layout is not None
    assert layout.dim_spanned([0, 1]) == "tp" and layout.dim_spanned([1, 3]) == "dp"
    assert layout.dim_spanned([0, 3]) is None
    with pytest.raises(ValueError, match="describes 4 ranks"):
        parallel_layout.parse_declared("tp=2,dp=2", 8, 0)


@pytest.mark.parametrize(
    "text",
    ["tp", "tp=0", "tp=2,tp=2", "tp=two", "tp=99999999999", "TP=2", "tp=2,,dp=2", "tp=-1",
     "tp=1048576,dp=2"],
)  # fmt: skip
def test_a_malformed_layout_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_parallel(text)


def test_the_setting_resolves_from_each_layer(tmp_path: Path) -> None:
    cli = resolve_launch_settings(
        "run", {"parallel": " tp=2 , dp=4 "}, environ={}, yaml_path=tmp_path / "none.yaml"
    )
    assert cli.parallel == "tp=2,dp=4"
    env = resolve_launch_settings(
        "serve", {}, environ={"TRACEML_PARALLEL": "pp=2"}, yaml_path=tmp_path / "n.yaml"
    )
    assert env.parallel == "pp=2"
    (tmp_path / "traceml.yaml").write_text("parallel: dp=8\n")
    yml = resolve_launch_settings("run", {}, environ={}, yaml_path=tmp_path / "traceml.yaml")
    assert yml.parallel == "dp=8"
    with pytest.raises(SettingsError, match=r"^TRACEML_PARALLEL: expected"):
        resolve_launch_settings(
            "run", {}, environ={"TRACEML_PARALLEL": "tp=0"}, yaml_path=tmp_path / "n.yaml"
        )


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("value", ["tp=0", "tp=2,tp=2", "tp=x", "tp=123456789012", "tp:2"])
@once  # the CLI in a child
def test_the_cli_stops_on_a_malformed_layout_with_one_line(
    command: str, value: str, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    args = [sys.executable, "-m", "traceml_ai", command, "--parallel", value]
    if command == "run":
        args.append(str(script))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    res = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("traceml: error: --parallel"), res.stderr
    assert "Traceback" not in res.stderr and "ran" not in res.stdout


def test_the_ray_config_checks_the_layout() -> None:
    from traceml_ai.integrations._ray_config import TraceMLRayConfig

    assert TraceMLRayConfig(parallel="tp=2, dp=2").parallel == "tp=2, dp=2"
    assert TraceMLRayConfig().parallel == ""
    with pytest.raises(ValueError, match=r"^TraceMLRayConfig\.parallel: expected"):
        TraceMLRayConfig(parallel="tp=0")
    with pytest.raises(ValueError, match=r"^TraceMLRayConfig\.parallel: expected"):
        TraceMLRayConfig(parallel=4)  # type: ignore[arg-type]


# -- Megatron and DeepSpeed: stand-ins -------------------------------------------------
# Neither library can be installed here. These stand-in modules, put in sys.modules,
# have the same function and attribute names as the real ones
# (megatron.core.parallel_state's get_*_parallel_rank/world_size/group and
# model_parallel_is_initialized; deepspeed.runtime.pipe.topology's
# PipelineParallelGrid with its ProcessTopology ``_topo``).


@pytest.fixture
def clean_layout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TRACEML_PARALLEL", raising=False)
    parallel_layout.reset()
    forget_warnings()
    yield
    parallel_layout.reset()


def _megatron_stand_in(tp: int, cp: int, dp: int, pp: int, g: int) -> types.ModuleType:
    ps = types.ModuleType("megatron.core.parallel_state")
    values = {
        "tensor_model": (g % tp, tp), "context": ((g // tp) % cp, cp),
        "data": ((g // (tp * cp)) % dp, dp), "pipeline_model": (g // (tp * cp * dp), pp),
        "expert_model": (0, 1),
    }  # fmt: skip
    for stem, (rank, size) in values.items():
        setattr(ps, f"get_{stem}_parallel_rank", lambda r=rank: r)
        setattr(ps, f"get_{stem}_parallel_world_size", lambda s=size: s)
        setattr(ps, f"get_{stem}_parallel_group", lambda n=stem: f"group:{n}")
    ps.model_parallel_is_initialized = lambda: True  # type: ignore[attr-defined]
    return ps


def test_megatron_parallel_state(monkeypatch: pytest.MonkeyPatch, clean_layout: None) -> None:
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("TRACEML_PARALLEL", "dp=16")  # the library's layout wins
    monkeypatch.setitem(
        sys.modules, "megatron.core.parallel_state", _megatron_stand_in(2, 1, 4, 2, 13)
    )
    layout = parallel_layout.find_layout()
    assert layout is not None and layout.source == "megatron"
    assert layout.item() == {
        "cp": {"rank": 0, "size": 1}, "dp": {"rank": 2, "size": 4},
        "pp": {"rank": 1, "size": 2}, "tp": {"rank": 1, "size": 2},
    }  # fmt: skip
    assert layout.groups["group:tensor_model"] == "tp"
    assert layout.coordinate(3, "pp") == 0 and layout.coordinate(8, "pp") == 1


class _Topology:
    """deepspeed.runtime.pipe.topology.ProcessTopology's names: the last axis fastest."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        self.axes, self.dims = axes, dims
        self.coord = types.SimpleNamespace

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)]

    def get_coord(self, rank: int) -> Any:
        out = {}
        for axis, size in reversed(list(zip(self.axes, self.dims, strict=True))):
            out[axis] = rank % size
            rank //= size
        return types.SimpleNamespace(**out)


def test_deepspeed_pipeline_grid(monkeypatch: pytest.MonkeyPatch, clean_layout: None) -> None:
    topology = types.ModuleType("deepspeed.runtime.pipe.topology")

    class PipelineParallelGrid:
        def __init__(self, topology: Any) -> None:
            self._topo = topology

        def get_pipe_parallel_group(self) -> str:
            return "pipe-group"

        def get_data_parallel_group(self) -> str:
            return "data-group"

    topology.PipelineParallelGrid = PipelineParallelGrid  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.pipe.topology", topology)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    layout_hooks._on_deepspeed_topology(topology)
    grid = PipelineParallelGrid(_Topology(["pipe", "data", "model"], [2, 2, 2]))
    layout = parallel_layout.find_layout()
    assert layout is not None and layout.source == "deepspeed"
    assert layout.item() == {
        "dp": {"rank": 0, "size": 2}, "pp": {"rank": 1, "size": 2}, "tp": {"rank": 1, "size": 2},
    }  # fmt: skip
    assert layout.groups == {"pipe-group": "pp", "data-group": "dp"}
    assert layout.coordinate(2, "pp") == 0
    del grid


def test_a_broken_source_costs_one_warning_and_no_layout(
    monkeypatch: pytest.MonkeyPatch, clean_layout: None
) -> None:
    ps = _megatron_stand_in(2, 1, 1, 1, 0)

    def broken() -> int:
        raise RuntimeError("boom")

    ps.get_tensor_model_parallel_world_size = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    with pytest.warns(Warning, match="could not be read from megatron"):
        assert parallel_layout.find_layout() is None


def test_group_labels() -> None:
    assert (
        parallel_layout.label_of_dim("dp_shard") == "dp"
        and parallel_layout.label_of_dim("dp_replicate") == "dp"
    )
    assert (
        parallel_layout.label_of_dim("tp") == "tp"
        and parallel_layout.label_of_dim("dim0") == "other"
    )
    assert parallel_layout.group_label(None, None) == "world"
