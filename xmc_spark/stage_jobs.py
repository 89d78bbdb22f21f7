"""The pipeline as separate stage jobs over run-keyed Delta tables (one spark-submit each).

``xmc-spark stage NAME --run-key KEY`` (``jobs/<NAME>.py`` under spark-submit) runs one stage
of the pipeline for one run key (the Airflow logical date, say) under ``paths.root``:

==========  ==========================================  ===========================================
stage       reads                                       writes (partition ``run_key = KEY``)
==========  ==========================================  ===========================================
ingest      --train, --test (files, tables, folders)    ``train`` (plain input), ``test``
eagle       the aggregated --train folder                ``train`` (+ ``eagle_embeddings``);
                                                        plain input: nothing to do
tree        ``train``                                   ``label_embeddings``, ``tree``
train       ``train``, ``tree``                         ``weights``, ``slots`` (+ ``matcher``,
                                                        ``clusters``); the MLflow pyfunc model
predict     ``test``, ``slots``, ``weights``            ``predictions``
evaluate    ``predictions``, ``test``, ``train``        ``metrics``
==========  ==========================================  ===========================================

Every stage also writes its row of ``stage_info`` (sizes, facts, seconds) that later stages
read. A rerun of a stage for the same key replaces its own partitions in one Delta commit
each; a stage that fails leaves the tables as they were. All stages of one key log into one
MLflow run (tag ``xmc_spark.run_key``), with the Delta version of every table they read (tags
``table_version.<stage>.<table>``).
``stage all`` runs the six in order in one process.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional

from pyspark.sql import functions as F

from . import pipeline
from .params import ConfigError, PipelineParams
from .stages import aggregated, evaluation, label_clusters
from .storage import StageOrderError, Tables, is_local_path
from .tracking import Tracker

log = logging.getLogger("xmc_spark.stage")

STAGES = ("ingest", "eagle", "tree", "train", "predict", "evaluate")
# the config sections each stage depends on (logged as that stage's MLflow params)
# the tables each stage writes (partition run_key = KEY)
OUTPUTS = {"ingest": ("train", "test"), "eagle": ("train", "eagle_embeddings"), "tree": ("label_embeddings", "tree"),
           "train": ("weights", "slots", "matcher", "clusters"), "predict": ("predictions",),
           "evaluate": ("metrics",)}
SECTIONS = {"ingest": ("ingest",), "eagle": ("eagle",), "tree": ("embedding", "tree"),
            "train": ("train", "clusters", "predict"), "predict": ("predict",), "evaluate": ("eval",)}


class StageRun:
    """One stage for one run key: its tables (inputs pinned to the versions the upstream stages
    recorded), the facts it records, its MLflow run."""

    def __init__(self, spark, name: str, run_key: str, params: PipelineParams, root: Optional[str] = None):
        if name not in STAGES:
            raise ConfigError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
        self.spark, self.name, self.run_key, self.params = spark, name, run_key, params
        self.root = (root or params.paths.root).rstrip("/")
        self.tables = Tables(spark, f"{self.root}/tables", run_key)
        self.timer = pipeline.StageTimer(params.spark.progress_seconds)
        self._infos: Dict[str, Dict] = {}
        if self.tables.exists("stage_info"):
            for r in self.tables.read("stage_info").select("stage", "info").collect():
                self._infos[r["stage"]] = json.loads(r["info"])
        for upstream in STAGES[:STAGES.index(name)]:          # later producers win (eagle's train)
            self.tables.pins.update(self._infos.get(upstream, {}).get("tables", {}))
        self.tables.reads.clear()
        self._before = {t: self._version(t) for t in OUTPUTS[name]}

    def _version(self, table: str) -> Optional[int]:
        return self.tables.version(table) if self.tables.exists(table) else None

    def info(self, stage: str) -> Dict:
        """Facts stage ``stage`` recorded for this run key (raises if it has not run)."""
        if stage not in self._infos:
            raise StageOrderError(f"stage '{self.name}' needs the output of stage '{stage}' for run key "
                                  f"{self.run_key} under {self.root}: run `xmc-spark stage {stage}` first")
        return self._infos[stage]

    def record(self, info: Dict) -> None:
        """The stage's commit point: its facts and the versions of the tables it wrote, in one
        Delta commit that also drops the records of the stages after it (they must rerun on the
        new output). Until this commit, readers see the previous run's versions."""
        written = {t: v for t in OUTPUTS[self.name] if (v := self._version(t)) is not None and v != self._before[t]}
        info = {**info, "tables": written}
        row = self.spark.createDataFrame(
            [(self.name, json.dumps(info), float(self.timer.total()["total"]))],
            "stage string, info string, seconds double")
        later = ", ".join(f"'{s}'" for s in STAGES[STAGES.index(self.name):])
        self.tables.write("stage_info", row, where=f"stage IN ({later})")


def run_stage(spark, name: str, run_key: str, params: PipelineParams, train: Optional[str] = None,
              test: Optional[str] = None, root: Optional[str] = None, config_path: Optional[str] = None) -> Dict:
    """Run stage ``name`` for ``run_key``; returns the facts it recorded."""
    st = StageRun(spark, name, run_key, params, root)
    log.info("stage %s for run key %s under %s", name, run_key, st.root)
    tracker = Tracker(params.mlflow)
    logged = {k: v for k, v in params.flat().items() if k.split(".")[0] in SECTIONS[name]}
    if name == "ingest":
        logged.update({"input.train": train or "", "input.test": test or ""})
    with tracker.run_for_key(run_key, st.root, logged):
        info = _STAGE_FUNCS[name](st, train, test, tracker)
        st.record(info)
        seconds = {k: v for k, v in st.timer.total().items() if k != "total"}
        tracker.log_metrics({**seconds, name: st.timer.total()["total"]}, prefix="seconds.")
        # tags, not params: a rerun of the stage reads newer versions into the same MLflow run
        tracker.set_tags({f"table_version.{name}.{t}": str(v) for t, v in st.tables.reads.items()})
        tracker.log_configs(config_path)
    info["seconds"] = st.timer.total()["total"]
    if tracker.run_id:
        info["mlflow_run_id"] = tracker.run_id
    log.info("stage %s for run key %s: done in %.1fs", name, run_key, info["seconds"])
    return info


def run_all(spark, run_key: str, params: PipelineParams, train: str, test: Optional[str] = None,
            root: Optional[str] = None, config_path: Optional[str] = None) -> Dict:
    out: Dict = {}
    for name in STAGES:
        if name in ("predict", "evaluate") and not test:
            continue
        out[name] = run_stage(spark, name, run_key, params, train, test, root, config_path)
    return out


# ---- the stages --------------------------------------------------------------------------

def _ingest(st: StageRun, train, test, tracker) -> Dict:
    if not train:
        raise ConfigError("stage ingest needs --train")
    with st.timer.stage("ingest"):
        info, agg_stats = pipeline.ingest_train(st.spark, st.tables, train, st.params)
        tinfo = pipeline.ingest_test(st.spark, st.tables, test, info, st.params) if test else None
    out = {"train": train, "test": test, "aggregated": agg_stats is not None, "n_train": info.n_samples,
           "n_features": info.n_features, "n_labels": info.n_labels,
           "n_test": tinfo.n_samples if tinfo else None, **(agg_stats or {})}
    tracker.log_metrics({k: v for k, v in out.items() if k.startswith("n_") and v is not None})
    return out


def _eagle(st: StageRun, train, test, tracker) -> Dict:
    ing = st.info("ingest")
    if not ing["aggregated"]:
        log.info("stage eagle: the training input %s has per-sample labels: nothing to do", ing["train"])
        return {"skipped": True}
    agg = aggregated.read(st.spark, ing["train"], st.params.ingest)
    pipeline.run_eagle(st.spark, st.tables, agg, st.params, st.timer)
    info = dict(st.timer.info)
    tracker.log_metrics({k: v for k, v in info.items() if not isinstance(v, (list, dict))})
    if "eagle.objective" in info:
        tracker.log_series("eagle.objective", info["eagle.objective"])
    return info


def _tree(st: StageRun, train, test, tracker) -> Dict:
    ing = st.info("ingest")
    samples = st.tables.read("train")
    counts = evaluation.label_counts(samples, ing["n_labels"])
    index = pipeline.build_tree(samples, st.tables, ing["n_features"], ing["n_labels"], st.params, st.timer, counts)
    info = {"tree_depth": int(index.depth), "n_leaves": int(len(index.leaves)), **st.timer.info}
    tracker.log_metrics(info)
    return info


def _train(st: StageRun, train, test, tracker) -> Dict:
    ing = st.info("ingest")
    samples = st.tables.read("train")
    index = pipeline.tree_index(st.tables.read("tree").toPandas(), ing["n_labels"], st.params)
    model = pipeline.train_classifiers(samples, index, st.tables, ing["n_features"], st.params, st.timer)
    model.meta.update({"train": ing["train"], "n_train": ing["n_train"], "run_key": st.run_key})
    model.label_counts = evaluation.label_counts(samples, ing["n_labels"])
    info = {"tree_depth": int(model.index.depth), "n_leaves": int(len(model.index.leaves)),
            **label_clusters.cluster_stats(model.index.slot_label, model.index.slot_leaf)}
    tracker.log_metrics(info)
    # the model folder: ROOT/models/KEY on a local root (for `xmc-spark predict --model`), else a
    # temporary folder that only feeds the MLflow model
    tmp = None if is_local_path(st.root) else Path(tempfile.mkdtemp(prefix="xmc-model-"))
    folder = Path(st.root) / "models" / st.run_key if tmp is None else tmp / "model"
    try:
        model.save(str(folder))
        if tmp is None:
            info["model_dir"] = str(folder)
        if st.params.mlflow.log_model:
            tracker.log_model(str(folder))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return info


def _predict(st: StageRun, train, test, tracker) -> Dict:
    ing = st.info("ingest")
    if not ing["test"]:
        raise ConfigError(f"stage predict: run key {st.run_key} was ingested without --test")
    model = pipeline.model_from_tables(st.tables, ing["n_features"], ing["n_labels"], st.params)
    with st.timer.stage("predict"):
        pipeline.predict_table(st.tables, model, st.params)
    return {"n_test": ing["n_test"]}


def _evaluate(st: StageRun, train, test, tracker) -> Dict:
    ing = st.info("ingest")
    index = pipeline.tree_index(st.tables.read("slots").toPandas(), ing["n_labels"], st.params)   # no weights
    counts = evaluation.label_counts(st.tables.read("train"), ing["n_labels"])
    with st.timer.stage("evaluate"):
        metrics = pipeline.evaluate_table(st.tables, counts, index.label_depth(), ing["n_train"], st.params)
    rows = st.spark.createDataFrame(sorted(metrics.items()), "metric string, value double")
    st.tables.write("metrics", rows)
    tracker.log_metrics(metrics)
    log.info("metrics: %s", {k: v for k, v in metrics.items() if k.startswith(("p@", "ndcg@", "depth@"))})
    return metrics


_STAGE_FUNCS = {"ingest": _ingest, "eagle": _eagle, "tree": _tree, "train": _train, "predict": _predict,
                "evaluate": _evaluate}
