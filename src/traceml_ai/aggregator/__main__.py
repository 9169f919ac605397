"""The aggregator process that ``traceml run`` starts: ``python -m traceml_ai.aggregator CONFIG``.

CONFIG is a JSON object (run_dir, settings, bind_host, port, expected_world_size,
finalize_timeout_s); the run token comes from ``TRACEML_RUN_TOKEN`` so it never
shows in a process listing. It prints one JSON line when it listens
(``{"event": "ready", ...}``) and one when it has finalized
(``{"event": "finalized", ...}``), and exits 0; SIGTERM or SIGINT make it finalize.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import orjson

from traceml_ai.aggregator._runner import run_until_done
from traceml_ai.aggregator._service import Aggregator, AggregatorConfig
from traceml_ai.settings import ExportSettings
from traceml_ai.wire import ENV_RUN_TOKEN


def _emit(event: dict[str, object]) -> None:
    sys.stdout.write(orjson.dumps(event).decode() + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    """Serve one run as configured by ``argv[0]`` (JSON)."""
    raw = orjson.loads(argv[0])
    config = AggregatorConfig(
        run_dir=Path(raw["run_dir"]),
        settings=ExportSettings(
            exporter=raw["exporter"],
            export_streams=raw["export_streams"],
            exporter_hostname=raw["exporter_hostname"],
        ),
        token=os.environ[ENV_RUN_TOKEN],
        bind_host=raw.get("bind_host", "127.0.0.1"),
        port=int(raw.get("port", 0)),
        expected_world_size=raw.get("expected_world_size"),
        finalize_timeout_s=float(raw.get("finalize_timeout_s", 10.0)),
    )
    aggregator = Aggregator(config)
    try:
        host, port = aggregator.start()
    except OSError as exc:
        _emit(
            {
                "event": "failed",
                "error": f"cannot listen on {config.bind_host}:{config.port}: {exc}",
            }
        )
        return 1
    _emit({"event": "ready", "host": host, "port": port, "pid": os.getpid()})
    result = run_until_done(aggregator, stop=threading.Event(), wait_for_ranks=False)
    stats = result.stats
    _emit(
        {
            "event": "finalized",
            "written_records": stats.written_total if stats else 0,
            "warning": str(result.warning_path) if result.warning_path else None,
            "missing_ranks": list(result.ranks.missing_ranks),
            "rejected_frames": result.rejected_frames,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
