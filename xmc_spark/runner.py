"""The stage runner behind ``xmc-spark run``, ``sweep`` and ``stage``.

One :class:`Runner` runs the stages of :mod:`.registry` over one table root: unkeyed (``xmc-spark
run``: ``OUT/tables/<name>`` whole tables, records kept in memory) or for one run key
(``xmc-spark stage``: partition ``run_key = KEY`` of ``ROOT/tables/<name>``, records in the
``stage_info`` table). For every stage it

1. checks, from the records, that each stage it needs ran for this key on the current output
   of its own needs (:func:`check_ready`), and pins the tables those records wrote (Delta time
   travel), so a stage reads exactly what its upstream stages committed;
2. calls the stage's function with a :class:`StageContext` and gets a :class:`StageResult`;
3. commits the stage's record (its facts and the versions of the tables it wrote), dropping
   the records of every stage downstream of it in the same Delta commit, and logs the result
   to MLflow (:func:`log_result`).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from .params import ConfigError, PipelineParams
from .progress import spark_progress
from .registry import ORDER, STAGES, StageSpec, downstream, stage_sections, upstream
from .storage import StageOrderError, Tables, is_local_path
from .tracking import Tracker

log = logging.getLogger("xmc_spark.runner")


class StageTimer:
    """Seconds per named step; each step also reports Spark progress while it runs."""

    def __init__(self, progress_seconds: float = 15.0):
        self.progress_seconds = progress_seconds
        self.seconds: Dict[str, float] = {}
        self._t0 = time.perf_counter()

    @contextmanager
    def stage(self, name: str):
        t = time.perf_counter()
        log.info("stage %s: start", name)
        with spark_progress(name, self.progress_seconds):
            yield
        self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t, 3)
        log.info("stage %s: done in %.1fs", name, self.seconds[name])

    def elapsed(self) -> float:
        return round(time.perf_counter() - self._t0, 3)


@dataclass
class StageResult:
    """What a stage hands on: ``facts`` are recorded (later stages read them, ``metrics.json``
    and MLflow show them); ``metrics`` are quality metrics; ``series`` per-iteration values."""

    facts: Dict[str, Any] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    series: Dict[str, List[float]] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)      # filled by the runner
    mlflow_run_id: Optional[str] = None                          # filled by the runner

    def summary(self) -> Dict[str, Any]:
        """Facts, metrics, the stage's seconds and MLflow run id (what ``xmc-spark stage`` prints)."""
        out = {**self.facts, **self.metrics, "seconds": max(self.seconds.values(), default=0.0)}
        if self.mlflow_run_id:
            out["mlflow_run_id"] = self.mlflow_run_id
        return out


@dataclass
class StageContext:
    """Everything a stage function may use."""

    spark: Any
    spec: StageSpec
    params: PipelineParams
    tables: Tables
    records: Dict[str, Dict]          # upstream stages' facts, by stage name
    timer: StageTimer
    tracker: Tracker
    train: Optional[str] = None       # --train / --test (the ingest stage)
    test: Optional[str] = None
    model_dir: Optional[str] = None   # where the train stage saves the model folder (None: not kept)
    run_key: Optional[str] = None
    memo: Dict[str, Any] = field(default_factory=dict)   # in-process hand-offs (e.g. the trained model)

    @property
    def dataset(self) -> Dataset:
        """The ingest stage's facts: input paths and sizes."""
        return Dataset.from_record(self.records["ingest"])


@dataclass(frozen=True)
class Dataset:
    """What the ingest stage recorded about the run's input; every later stage reads its sizes
    from here (no loose integers)."""

    train: str
    test: Optional[str]
    aggregated: bool
    n_train: int
    n_features: int
    n_labels: int                  # training label space (a test set may name more: unseen labels)
    n_test: Optional[int] = None
    n_train_nonzeros: Optional[int] = None   # feature entries of the training rows, when ingest counted them
    # sum over the training rows of labels x feature entries (the PIFA partials' bound), when counted
    n_train_label_nonzeros: Optional[int] = None

    @classmethod
    def from_record(cls, rec: Dict[str, Any]) -> Dataset:
        return cls(**{f: rec.get(f) for f in cls.__dataclass_fields__})


class Records:
    """The stage records of one run: per stage its facts, the Delta versions of the tables it
    wrote (``tables``), a commit id and the commit ids of the records it was made on
    (``basis``). Kept in the ``stage_info`` table for a run key, else in memory."""

    def __init__(self, tables: Tables, initial: Optional[Dict[str, Dict]] = None):
        self.tables = tables
        self.keyed = tables.run_key is not None
        self.by_stage: Dict[str, Dict] = dict(initial or {})
        if self.keyed and tables.exists("stage_info"):
            for r in tables.read("stage_info").select("stage", "info").collect():
                self.by_stage[r["stage"]] = json.loads(r["info"])
        tables.reads.pop("stage_info", None)

    def commit(self, name: str, info: Dict, seconds: float) -> None:
        """Record stage ``name``; drop the records of the stages downstream of it (one commit)."""
        dropped = downstream(name)
        if self.keyed:
            import pyarrow as pa

            from .arrow_utils import local_frame
            row = local_frame(self.tables.spark, {"stage": pa.array([name], pa.string()),
                                                  "info": pa.array([json.dumps(info)], pa.string()),
                                                  "seconds": pa.array([float(seconds)], pa.float64())})
            names = ", ".join(f"'{s}'" for s in [name, *dropped])
            self.tables.write("stage_info", row, where=f"stage IN ({names})")
        for s in dropped:
            self.by_stage.pop(s, None)
        self.by_stage[name] = info


def check_ready(spec: StageSpec, records: Dict[str, Dict], where: str) -> None:
    """Raise :class:`StageOrderError` unless every stage ``spec`` needs has a current record."""
    for dep in upstream(spec.name):
        rec = records.get(dep)
        if rec is None:
            raise StageOrderError(f"stage '{spec.name}' needs the output of stage '{dep}' for {where}: "
                                  f"run `xmc-spark stage {dep}` first")
        for d2 in STAGES[dep].needs:
            if rec.get("basis", {}).get(d2) != records.get(d2, {}).get("commit"):
                raise StageOrderError(
                    f"stage '{spec.name}': the output of stage '{dep}' for {where} predates the last run of "
                    f"stage '{d2}': rerun `xmc-spark stage {dep}` and the stages after it")
    if spec.needs_test and not records["ingest"].get("test"):
        raise ConfigError(f"stage {spec.name}: {where} was ingested without --test")


def log_result(tracker: Tracker, name: str, result: StageResult, reads: Dict[str, int]) -> None:
    """One stage's result in the current MLflow run: numeric facts and metrics, series, seconds
    (``seconds.<step>`` and ``seconds.<stage>``) and the versions of the tables it read (tags
    ``table_version.<stage>.<table>``: a rerun of the stage reads newer versions)."""
    numeric = {k: v for k, v in {**result.facts, **result.metrics}.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    tracker.log_metrics(numeric)
    for k, values in result.series.items():
        tracker.log_series(k, values)
    tracker.log_metrics(result.seconds, prefix="seconds.")
    tracker.set_tags({f"table_version.{name}.{t}": str(v) for t, v in reads.items()})


@contextmanager
def spark_tag(spark, tag: str):
    """Tag the Spark jobs started inside (``SparkSession.addTag``, classic and Connect alike):
    the stage's jobs carry it in the UI, the event log (``spark.job.tags``) and
    ``interruptTag``."""
    add = getattr(spark, "addTag", None)
    if add is not None:
        try:
            add(tag)
        except RuntimeError:         # Spark 3.5 classic: session tags are Spark Connect's only
            add = None
    if add is None:
        yield
        return
    try:
        yield
    finally:
        spark.removeTag(tag)


class Runner:
    """Runs stages over ``ROOT/tables`` (one run key's partitions, or whole tables)."""

    def __init__(self, spark, params: PipelineParams, root: str, run_key: Optional[str] = None,
                 train: Optional[str] = None, test: Optional[str] = None, tracker: Optional[Tracker] = None,
                 links: Optional[Dict[str, str]] = None, records: Optional[Dict[str, Dict]] = None,
                 config_path=None):
        self.spark, self.params, self.run_key = spark, params, run_key
        self.root = str(root).rstrip("/")
        self.tables = Tables(spark, f"{self.root}/tables", run_key, links=links)
        self.records = Records(self.tables, records)
        self.train, self.test = train, test
        self.tracker = tracker            # unkeyed: the caller's MLflow run; keyed: one per key
        self.config_path = config_path
        self.memo: Dict[str, Any] = {}
        self.results: Dict[str, StageResult] = {}
        self._t0 = time.perf_counter()

    @property
    def model_dir(self) -> Optional[str]:
        if not is_local_path(self.root):
            return None
        return str(Path(self.root) / ("models" if self.run_key else "") / (self.run_key or "model"))

    def seconds(self) -> Dict[str, float]:
        """Seconds of every step of the stages run so far, and the total wall time."""
        out: Dict[str, float] = {}
        for r in self.results.values():
            out.update({k: v for k, v in r.seconds.items()})
        out["total"] = round(time.perf_counter() - self._t0, 3)
        return out

    def run_all(self, names: Iterable[str] = ORDER) -> Dict[str, StageResult]:
        """The given stages in order (predict and evaluate only with a test set)."""
        for name in names:
            if STAGES[name].needs_test and not self.records.by_stage.get("ingest", {}).get("test"):
                continue
            self.run(name)
        return self.results

    def run(self, name: str) -> StageResult:
        if name not in STAGES:
            raise ConfigError(f"unknown stage {name!r}; stages: {', '.join(ORDER)}")
        spec = STAGES[name]
        recs = self.records.by_stage
        check_ready(spec, recs, f"run key {self.run_key} under {self.root}" if self.run_key else self.root)
        self.tables.pins = {}
        for up in upstream(name):            # in pipeline order: later producers win (eagle's train)
            self.tables.pins.update(recs[up].get("tables", {}))
        self.tables.reads.clear()
        before = {t: self._version(t) for t in spec.writes}
        timer = StageTimer(self.params.spark.progress_seconds)
        log.info("stage %s%s", name, f" for run key {self.run_key} under {self.root}" if self.run_key else "")
        with self._tracking(spec) as tracker:
            ctx = StageContext(self.spark, spec, self.params, self.tables, recs, timer, tracker, self.train,
                               self.test, self.model_dir, self.run_key, self.memo)
            with spark_tag(self.spark, f"xmc-stage-{name}"):
                result = spec.function()(ctx)
            result.seconds = {**timer.seconds, name: timer.elapsed()}
            written = {t: v for t in spec.writes if (v := self._version(t)) is not None and v != before[t]}
            info = {**result.facts, **result.metrics, "tables": written, "commit": uuid.uuid4().hex,
                    "basis": {d: recs[d]["commit"] for d in spec.needs}}
            self.records.commit(name, info, result.seconds[name])
            log_result(tracker, name, result, dict(self.tables.reads))
            if self.run_key:
                tracker.log_configs(self.config_path)
            result.mlflow_run_id = tracker.run_id
        self.results[name] = result
        log.info("stage %s: done in %.1fs", name, result.seconds[name])
        return result

    def _version(self, table: str) -> Optional[int]:
        return self.tables.version(table) if self.tables.exists(table) else None

    @contextmanager
    def _tracking(self, spec: StageSpec):
        if not self.run_key:                  # the caller's run (or tracking off)
            yield self.tracker or Tracker(self.params.mlflow, enabled=False)
            return
        tracker = Tracker(self.params.mlflow)
        sections = stage_sections(spec.name, self.params)
        logged = {k: v for k, v in self.params.flat().items() if k.split(".")[0] in sections}
        if spec.name == "ingest":
            logged.update({"input.train": self.train or "", "input.test": self.test or ""})
        with tracker.run_for_key(self.run_key, self.root, logged):
            yield tracker


def run_keyed(spark, names: Iterable[str], run_key: str, params: PipelineParams, train: Optional[str] = None,
              test: Optional[str] = None, root: Optional[str] = None, config_path=None) -> Dict[str, Dict]:
    """``xmc-spark stage``: stages ``names`` (``["all"]``: every stage) for ``run_key`` under
    ``root`` (default ``paths.root``); returns each stage's :meth:`StageResult.summary`."""
    runner = Runner(spark, params, root or params.paths.root, run_key, train, test, config_path=config_path)
    names = list(names)
    if names == ["all"]:
        runner.run_all()
    else:
        for name in names:
            runner.run(name)
    return {name: r.summary() for name, r in runner.results.items()}


def run_stage(spark, name: str, run_key: str, params: PipelineParams, train: Optional[str] = None,
              test: Optional[str] = None, root: Optional[str] = None, config_path=None) -> Dict:
    """One stage for ``run_key`` (:func:`run_keyed` with one name); its summary."""
    return run_keyed(spark, [name], run_key, params, train, test, root, config_path)[name]
