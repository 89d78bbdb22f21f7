"""A thin MLflow wrapper: one run per invocation; does nothing when tracking is off."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Dict, Optional

from .params import MlflowParams
from .secrets import redact

log = logging.getLogger("xmc_spark.tracking")


class Tracker:
    def __init__(self, params: MlflowParams):
        self.params = params
        self.enabled = params.enabled
        self.run_id: Optional[str] = None
        self._mlflow = None

    @contextmanager
    def run(self, run_name: str = "", nested: bool = False, tags: Optional[Dict[str, str]] = None):
        if not self.enabled:
            yield self
            return
        mlflow = self._setup()
        with mlflow.start_run(run_name=run_name or self.params.run_name or None, nested=nested, tags=tags) as r:
            self.run_id = r.info.run_id
            log.info("MLflow run %s (%s)", r.info.run_id, redact(self.params.tracking_uri))
            yield self

    def _setup(self):
        import mlflow

        self._mlflow = mlflow
        uri = self.params.tracking_uri
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
        mlflow.set_tracking_uri(uri)
        if self.params.registry_uri:
            mlflow.set_registry_uri(self.params.registry_uri)
        if mlflow.get_experiment_by_name(self.params.experiment) is None:
            loc = self.params.artifact_location
            if loc and "://" not in loc:
                loc = os.path.abspath(loc)
            mlflow.create_experiment(self.params.experiment, artifact_location=loc or None)
        mlflow.set_experiment(self.params.experiment)
        return mlflow

    @contextmanager
    def run_for_key(self, run_key: str, root: str, params: Dict[str, Any]):
        """The MLflow run of (run key, root), shared by that key's stage jobs: resumed when one
        exists whose params agree with ``params``, else a new one. ``params`` are logged."""
        if not self.enabled:
            yield self
            return
        mlflow = self._setup()
        esc = root.replace("'", "\\'")
        found = mlflow.search_runs(
            experiment_names=[self.params.experiment], output_format="list", order_by=["attributes.start_time DESC"],
            filter_string=f"tags.`xmc_spark.run_key` = '{run_key}' and tags.`xmc_spark.root` = '{esc}'")
        want = {k: redact(str(v))[:6000] for k, v in params.items()}
        run_id = None
        for r in found:
            if all(r.data.params.get(k, v) == v for k, v in want.items()):
                run_id = r.info.run_id
                break
        if found and run_id is None:
            log.warning("run key %s: params differ from its MLflow run %s: starting a new run", run_key,
                        found[0].info.run_id)
        tags = {"xmc_spark.run_key": run_key, "xmc_spark.root": root}
        with mlflow.start_run(run_id=run_id, run_name=None if run_id else (self.params.run_name or run_key),
                              tags=None if run_id else tags) as r:
            self.run_id = r.info.run_id
            log.info("MLflow run %s (%s) for run key %s", r.info.run_id, redact(self.params.tracking_uri), run_key)
            self.log_params({k: v for k, v in want.items() if k not in r.data.params})
            yield self

    def log_params(self, params: Dict[str, Any]) -> None:
        if self._mlflow:
            self._mlflow.log_params({k: redact(str(v))[:6000] for k, v in params.items()})

    def log_metrics(self, metrics: Dict[str, float], prefix: str = "") -> None:
        if self._mlflow:
            clean = {f"{prefix}{k}".replace("@", "_at_"): float(v) for k, v in metrics.items()
                     if isinstance(v, (int, float))}
            self._mlflow.log_metrics(clean)

    def log_series(self, name: str, values) -> None:
        """One metric with a step per value (e.g. an objective per iteration)."""
        if self._mlflow:
            for step, v in enumerate(values):
                self._mlflow.log_metric(name.replace("@", "_at_"), float(v), step=step)

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        if self._mlflow:
            if os.path.isdir(path):
                self._mlflow.log_artifacts(path, artifact_path)
            else:
                self._mlflow.log_artifact(path, artifact_path)

    def log_model(self, model_dir: str) -> None:
        """The model folder as a pyfunc model (``runs:/<id>/model``), registered if configured."""
        if self._mlflow:
            from .mlflow_model import log_model
            uri, version = log_model(model_dir, self.params.registered_model, self.params.alias)
            if version is not None:
                self._mlflow.set_tags({"xmc_spark.registered_model": self.params.registered_model,
                                       "xmc_spark.model_version": str(version)})

    def log_configs(self, paths) -> None:
        """The config files as given (``${VAR}`` unexpanded), under ``conf/``."""
        for p in [paths] if isinstance(paths, str) else (paths or []):
            self.log_artifact(p, "conf")

    def set_tags(self, tags: Dict[str, str]) -> None:
        if self._mlflow:
            self._mlflow.set_tags(tags)
