"""The MLflow tracker: a run of TraceML's own, through ``MlflowClient`` (the
``mlflow`` extra, ``mlflow-skinny``: the tracking client without the server).

The run is chosen by MLflow's standard variables, as a training script's
``mlflow.start_run()`` would: the tracking server ``MLFLOW_TRACKING_URI``, the
experiment ``MLFLOW_EXPERIMENT_ID`` or ``MLFLOW_EXPERIMENT_NAME`` (made when it does
not exist; MLflow's default experiment without either). The run is named after the
TraceML run, tagged with its folder, and ended (FINISHED) at the end.

MLflow's HTTP client retries a failed request for minutes by default, and ending a
run prints its URL to stdout (the training terminal); unless the user set them, the
aggregator makes the first a short wait and switches the second off
(:data:`CLIENT_DEFAULTS`): a tracker that is down costs counted points, not the end
of the run, and the terminal holds TraceML's lines only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traceml_ai.monitor._service import RunInfo

__all__ = ["CLIENT_DEFAULTS", "RUN_DIR_TAG", "MlflowTracker", "open_mlflow"]

CLIENT_DEFAULTS: Mapping[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
"""MLflow's client settings the aggregator sets when the user has not."""

RUN_DIR_TAG = "traceml.run_dir"
"""The tag that names the TraceML run folder of an MLflow run."""


class MlflowTracker:
    """One MLflow run TraceML logs into."""

    def __init__(self, run: RunInfo) -> None:
        for key, value in CLIENT_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient()
        experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or self._experiment(
            os.environ.get("MLFLOW_EXPERIMENT_NAME")
        )
        created = self._client.create_run(
            experiment_id, run_name=run.run_name, tags={RUN_DIR_TAG: str(run.run_dir)}
        )
        self.run_id: str = created.info.run_id

    def _experiment(self, name: str | None) -> str:
        if not name:
            return "0"  # MLflow's default experiment
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        return str(self._client.create_experiment(name))

    def log(self, figures: Mapping[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self._metric(k, v, now_ms, step) for k, v in figures.items()]
        self._client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def open_mlflow(run: RunInfo) -> MlflowTracker:
    return MlflowTracker(run)
