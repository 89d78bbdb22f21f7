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
MLflow run (tag ``xmc_spark.run_key``), with the Delta version of every table they read.
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
from .stages import aggregated, evaluation
from .storage import StageOrderError, Tables
from .tracking import Tracker

log = logging.getLogger("xmc_spark.stage")

STAGES = ("ingest", "eagle", "tree", "train", "predict", "evaluate")
# the config sections each stage depends on (logged as that stage's MLflow params)
SECTIONS = {"ingest": ("ingest",), "eagle": ("eagle",), "tree": ("embedding", "tree"),
            "train": ("train", "clusters", "predict"), "predict": ("predict",), "evaluate": ("eval",)}


def _is_local(root: str) -> bool:
    return "://" not in root and not root.startswith("dbfs:")


class StageRun:
    """One stage for one run key: its tables, recorded facts and MLflow run."""

    def __init__(self, spark, name: str, run_key: str, params: PipelineParams, root: Optional[str] = None):
        if name not in STAGES:
            raise ConfigError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
        self.spark, self.name, self.run_key, self.params = spark, name, run_key, params
        self.root = (root or params.paths.root).rstrip("/")
        self.tables = Tables(spark, f"{self.root}/tables", run_key)
        self.timer = pipeline.StageTimer(params.spark.progress_seconds)
        self.read_versions: Dict[str, int] = {}

    def info(self, stage: str) -> Dict:
        """Facts stage ``stage`` recorded for this run key (raises if it has not run)."""
        rows = []
        if self.tables.exists("stage_info"):
            rows = self.tables.read("stage_info").filter(F.col("stage") == stage).select("info").collect()
        if not rows:
            raise StageOrderError(f"stage '{self.name}' needs the output of stage '{stage}' for run key "
                                  f"{self.run_key} under {self.root}: run `xmc-spark stage {stage}` first")
        return json.loads(rows[0]["info"])

    def read(self, name: str):
        """A table of this run key, recording the Delta version read (for reproducibility)."""
        self.read_versions[name] = self.tables.version(name)
        return self.tables.read(name)

    def record(self, info: Dict) -> None:
        row = self.spark.createDataFrame(
            [(self.name, json.dumps(info), float(self.timer.total()["total"]))],
            "stage string, info string, seconds double")
        self.tables.write("stage_info", row, where=f"stage = '{self.name}'")


def run_stage(spark, name: str, run_key: str, params: PipelineParams, train: Optional[str] = None,
              test: Optional[str] = None, root: Optional[str] = None, config_path: Optional[str] = None) -> Dict:
    """Run stage ``name`` for ``run_key``; returns the facts it recorded."""
    st = StageRun(spark, name, run_key, params, root)
    log.info("stage %s for run key %s under %s", name, run_key, st.root)
    tracker = Tracker(params.mlflow)
    logged = {k: v for k, v in params.flat().items() if k.split(".")[0] in SECTIONS[name]}
    with tracker.run_for_key(run_key, st.root, logged):
        info = _STAGE_FUNCS[name](st, train, test, tracker)
        st.record(info)
        seconds = {k: v for k, v in st.timer.total().items() if k != "total"}
        tracker.log_metrics({**seconds, name: st.timer.total()["total"]}, prefix="seconds.")
        tracker.log_params({f"table_version.{name}.{t}": v for t, v in st.read_versions.items()})
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
    tracker.log_params({"input.train": train, "input.test": test or ""})
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
    samples = st.read("train")
    counts = evaluation.label_counts(samples, ing["n_labels"])
    index = pipeline.build_tree(samples, st.tables, ing["n_features"], ing["n_labels"], st.params, st.timer, counts)
    info = {"tree_depth": int(index.depth), "n_leaves": int(len(index.leaves)), **st.timer.info}
    tracker.log_metrics(info)
    return info


def _train(st: StageRun, train, test, tracker) -> Dict:
    ing = st.info("ingest")
    samples = st.read("train")
    index = pipeline.tree_index(st.read("tree").toPandas(), ing["n_labels"], st.params)
    model = pipeline.train_classifiers(samples, index, st.tables, ing["n_features"], st.params, st.timer)
    model.meta.update({"train": ing["train"], "n_train": ing["n_train"], "run_key": st.run_key})
    model.label_counts = evaluation.label_counts(samples, ing["n_labels"])
    info = {"tree_depth": int(model.index.depth), "n_leaves": int(len(model.index.leaves)),
            **pipeline.label_clusters.cluster_stats(model.index.slot_label, model.index.slot_leaf)}
    tracker.log_metrics(info)
    tmp = Path(tempfile.mkdtemp(prefix="xmc-model-"))
    try:
        model.save(str(tmp / "model"))
        if _is_local(st.root):                   # also a model folder for `xmc-spark predict --model`
            dest = Path(st.root) / "models" / st.run_key
            model.save(str(dest))
            info["model_dir"] = str(dest)
        if st.params.mlflow.log_model:
            tracker.log_model(str(tmp / "model"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _model(st: StageRun, ing: Dict):
    model = pipeline.model_from_tables(st.tables, ing["n_features"], ing["n_labels"], st.params)
    st.read_versions.update({"slots": st.tables.version("slots"), "weights": st.tables.version("weights")})
    return model


def _predict(st: StageRun, train, test, tracker) -> Dict:
    ing = st.info("ingest")
    if not ing["test"]:
        raise ConfigError(f"stage predict: run key {st.run_key} was ingested without --test")
    model = _model(st, ing)
    with st.timer.stage("predict"):
        st.read_versions["test"] = st.tables.version("test")
        pipeline.predict_table(st.tables, model, st.params)
    return {"n_test": ing["n_test"]}


def _evaluate(st: StageRun, train, test, tracker) -> Dict:
    ing = st.info("ingest")
    model = _model(st, ing)
    model.label_counts = evaluation.label_counts(st.read("train"), ing["n_labels"])
    with st.timer.stage("evaluate"):
        st.read_versions.update({t: st.tables.version(t) for t in ("predictions", "test")})
        metrics = pipeline.evaluate_table(st.tables, model, ing["n_train"], st.params)
    rows = st.spark.createDataFrame(sorted(metrics.items()), "metric string, value double")
    st.tables.write("metrics", rows)
    tracker.log_metrics(metrics)
    log.info("metrics: %s", {k: v for k, v in metrics.items() if k.startswith(("p@", "ndcg@", "depth@"))})
    return metrics


_STAGE_FUNCS = {"ingest": _ingest, "eagle": _eagle, "tree": _tree, "train": _train, "predict": _predict,
                "evaluate": _evaluate}
