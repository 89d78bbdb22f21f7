"""A thin MLflow wrapper: one run per invocation; does nothing when tracking is off."""
from __future__ import annotations

import logging
import os
import socket
import threading
from contextlib import contextmanager
from typing import Any, Dict, Optional

from .params import MlflowParams
from .secrets import redact

log = logging.getLogger("xmc_spark.tracking")

_prepared: Dict[tuple, threading.Thread] = {}
_started: list = []


def _store_key(params: MlflowParams) -> tuple:
    return (params.tracking_uri, params.registry_uri, params.experiment, params.artifact_location)


def prepare(params: MlflowParams, imports=()) -> None:
    """Import ``imports`` (module names) and set MLflow's store up in a background thread, so that
    the ~5 s of importing mlflow and the store's first connection (seconds more when it creates
    its tables) overlap with what the caller does meanwhile (the CLI: starting the JVM). The first
    :class:`Tracker` of the same store waits for it; a failure there is left to that Tracker,
    which raises it in the caller's thread."""
    def work():
        try:
            import importlib
            for name in imports:
                importlib.import_module(name)
            if params.enabled:
                Tracker(params)._setup()
        except Exception as e:  # noqa: BLE001 - raised again, where it belongs, by the caller's Tracker
            log.debug("preparing MLflow in the background failed (the run's tracker will retry): %s", e)

    t = threading.Thread(target=work, name="xmc-spark-prepare", daemon=True)
    if params.enabled:                  # the store's first Tracker waits for it (and forgets it)
        _prepared[_store_key(params)] = t
    _started.append(t)
    t.start()


def settle(timeout: float = 120.0) -> None:
    """Wait (at most ``timeout`` seconds each) for the background preparations started so far:
    called before the CLI returns, so that an early exit (Spark failed to start) does not kill one
    half-way through creating the store."""
    while _started:
        _started.pop().join(timeout)


class Tracker:
    def __init__(self, params: MlflowParams, enabled: Optional[bool] = None):
        self.params = params
        self.enabled = params.enabled if enabled is None else enabled
        self.run_id: Optional[str] = None
        self._mlflow = None

    @contextmanager
    def run(self, run_name: str = "", nested: bool = False, tags: Optional[Dict[str, str]] = None):
        if not self.enabled:
            yield self
            return
        mlflow = self._setup()
        with mlflow.start_run(run_name=run_name or self.params.run_name or None, nested=nested,
                              tags={**(tags or {}), **_owner_tags()}) as r:
            self.run_id = r.info.run_id
            log.info("MLflow run %s (%s)", r.info.run_id, redact(self.params.tracking_uri))
            yield self

    def _setup(self):
        pending = _prepared.get(_store_key(self.params))
        if pending is not None and pending is not threading.current_thread():
            pending.join()
            _prepared.pop(_store_key(self.params), None)
        import mlflow

        self._mlflow = mlflow
        uri = self.params.tracking_uri
        with _sqlite_lock(uri):      # two jobs starting at once must not both create the store
            return self._setup_locked(mlflow, uri)

    def _setup_locked(self, mlflow, uri: str):
        mlflow.set_tracking_uri(uri)
        if self.params.registry_uri:
            mlflow.set_registry_uri(self.params.registry_uri)
        if mlflow.get_experiment_by_name(self.params.experiment) is None:
            loc = self.params.artifact_location
            if loc and "://" not in loc:
                loc = os.path.abspath(loc)
            mlflow.create_experiment(self.params.experiment, artifact_location=loc or None)
        mlflow.set_experiment(self.params.experiment)
        self._fail_orphans()
        return mlflow

    def _fail_orphans(self) -> None:
        """Mark as FAILED the runs this machine left RUNNING from a process that is gone (a killed
        job): each run carries its process's host and pid as tags."""
        exp = self._mlflow.get_experiment_by_name(self.params.experiment)
        host = socket.gethostname().replace("'", "")
        try:
            runs = self._mlflow.search_runs(
                experiment_ids=[exp.experiment_id], output_format="list",
                filter_string=f"attributes.status = 'RUNNING' and tags.`xmc_spark.host` = '{host}'")
        except Exception as e:  # noqa: BLE001 - a store without search support: nothing to clean
            log.debug("no orphan-run check: %s", e)
            return
        from mlflow.tracking import MlflowClient
        for r in runs:
            pid = r.data.tags.get("xmc_spark.pid", "")
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                log.warning("MLflow run %s was left RUNNING by process %s, which is gone: marking it FAILED",
                            r.info.run_id, pid)
                MlflowClient().set_terminated(r.info.run_id, "FAILED")

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
            mlflow.set_tags(_owner_tags())
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


@contextmanager
def _sqlite_lock(uri: str):
    """An exclusive lock file beside a local sqlite store (creating its folder), else nothing."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl
    db = uri[len("sqlite:///"):]
    os.makedirs(os.path.dirname(db) or ".", exist_ok=True)
    with open(db + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _owner_tags() -> Dict[str, str]:
    return {"xmc_spark.host": socket.gethostname(), "xmc_spark.pid": str(os.getpid())}


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
