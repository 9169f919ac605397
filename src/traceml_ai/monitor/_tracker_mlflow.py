"""The MLflow tracker, through ``MlflowClient`` (the ``mlflow`` extra,
``mlflow-skinny``: the tracking client without the server).

**The script's own run**, when rank 0 told one (its ``run_id`` and ``tracking_uri``):
TraceML's figures go into it beside the script's own metrics, tagged with the
TraceML run folder; the script ends it, not TraceML. Deleted while TraceML logs into
it (``gone``), the points from then on go to a run of TraceML's own.

**Else a run of TraceML's own**, chosen by MLflow's standard variables, as a training script's
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
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from traceml_ai.monitor.tracker_metrics import SUMMARY_ARTIFACT

if TYPE_CHECKING:
    from mlflow.entities import RunTag

    from traceml_ai.monitor._sink import RunInfo

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
    """One MLflow run TraceML logs into: the script's (``user``) or its own."""

    def __init__(self, run: RunInfo, user: Mapping[str, str] | None = None) -> None:
        for key, value in CLIENT_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.owned = user is None
        if user is not None:
            self._client = MlflowClient(tracking_uri=user.get("tracking_uri") or None)
            self.run_id: str = user["run_id"]
            # Fails here, not at the first point, when the run is not on that server.
            self._client.set_tag(self.run_id, RUN_DIR_TAG, str(run.run_dir))
            return
        self._client = MlflowClient()
        experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or self._experiment(
            os.environ.get("MLFLOW_EXPERIMENT_NAME")
        )
        created = self._client.create_run(
            experiment_id, run_name=run.run_name, tags={RUN_DIR_TAG: str(run.run_dir)}
        )
        self.run_id = created.info.run_id

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

    def log_summary(self, fields: Mapping[str, float | str], summary_json: bytes) -> None:
        # Tags: MLflow's fields of a run as a whole (metrics are series over steps).
        self._client.log_batch(
            self.run_id,
            tags=[self._tag(k, v) for k, v in fields.items()],
            synchronous=True,
        )
        with tempfile.TemporaryDirectory(prefix="traceml-") as folder:
            path = Path(folder, SUMMARY_ARTIFACT)
            path.write_bytes(summary_json)
            self._client.log_artifact(self.run_id, str(path))

    def _tag(self, key: str, value: float | str) -> RunTag:
        from mlflow.entities import RunTag

        if isinstance(value, str):
            text = value
        else:
            text = str(int(value)) if value.is_integer() else f"{value:.6g}"
        return RunTag(key, text)

    def ended_ns(self) -> int | None:
        """When the script ended its run (unix ns, its end time: the script's clock,
        the one rank 0 stamps its steps with), or None while it runs (and for
        TraceML's own run, which TraceML ends)."""
        if self.owned:
            return None
        info = self._client.get_run(self.run_id).info
        if info.status == "RUNNING" or not info.end_time:
            return None
        return int(info.end_time) * 1_000_000

    def gone(self) -> bool:
        """Whether the script's run was deleted (or is no longer on its server)."""
        from mlflow.exceptions import MlflowException

        try:
            info = self._client.get_run(self.run_id).info
        except MlflowException as exc:
            return bool(exc.error_code == "RESOURCE_DOES_NOT_EXIST")
        return bool(info.lifecycle_stage == "deleted")

    def close(self) -> None:
        if self.owned:
            self._client.set_terminated(self.run_id)


def open_mlflow(run: RunInfo, user: Mapping[str, str] | None = None) -> MlflowTracker:
    return MlflowTracker(run, user)
