"""A real MLflow tracking server for the tests: ``mlflow server`` on sqlite.

The server lives in ``bench/mlflow_server.py``, so that the benchmarks
(``python -m bench.trackers``) and ``scripts/tracker_screenshots.py`` start the same
one without importing the tests; the tests import it from here.
"""

from __future__ import annotations

from bench.mlflow_server import MlflowServer, mlflow_server, server_env, start_mlflow_server

__all__ = ["MlflowServer", "mlflow_server", "server_env", "start_mlflow_server"]
