"""The end-to-end job: ingest -> PIFA -> tree -> node training -> prediction -> evaluation.

Each stage reads and writes Delta tables under ``OUT/tables``; ``main()``-style wiring only.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import scipy.sparse as sp
from pyspark.sql import functions as F

from .arrow_utils import list_offsets_values, to_arrow
from .config import dump_params
from .kernels.tree import TreeIndex
from .model import KeyedColumns, XMCModel
from .params import PipelineParams
from .progress import spark_progress
from .stages import (aggregated, eagle, evaluation, ingest, label_clusters, label_embedding, label_frequencies,
                     label_tree, node_training, prediction)
from .storage import Tables
from .tracking import Tracker

log = logging.getLogger("xmc_spark.pipeline")


class StageTimer:
    def __init__(self, progress_seconds: float = 15.0):
        self.progress_seconds = progress_seconds
        self.seconds: Dict[str, float] = {}
        self.info: Dict[str, object] = {}     # stage facts for metrics.json (e.g. greedy rounds)
        self._t0 = time.perf_counter()

    @contextmanager
    def stage(self, name: str):
        t = time.perf_counter()
        log.info("stage %s: start", name)
        with spark_progress(name, self.progress_seconds):
            yield
        self.seconds[name] = round(time.perf_counter() - t, 3)
        log.info("stage %s: done in %.1fs", name, self.seconds[name])

    def total(self) -> Dict[str, float]:
        return {**self.seconds, "total": round(time.perf_counter() - self._t0, 3)}


def shuffle_partitions(spark) -> int:
    """Task count for our own bucketing: spark.sql.shuffle.partitions, or the default
    parallelism when the platform sets it to ``auto`` (Databricks)."""
    v = str(spark.conf.get("spark.sql.shuffle.partitions", "auto"))
    return int(v) if v.isdigit() else int(spark.sparkContext.defaultParallelism)


def weights_to_columns(t: pa.Table, n_cols: int):
    """Weights table (as Arrow) -> (node KeyedColumns, slot KeyedColumns), no per-row Python."""
    is_leaf = np.asarray(t.column("is_leaf").to_numpy(zero_copy_only=False), dtype=bool)
    keys = np.asarray(t.column("key").to_numpy(zero_copy_only=False), dtype=np.int64)
    off, idx = list_offsets_values(t, "w_idx")
    _, val = list_offsets_values(t, "w_val")
    W = sp.csc_matrix((np.array(val, np.float32), np.array(idx, np.int32), off), shape=(n_cols, len(keys)))
    out = []
    for mask in (~is_leaf, is_leaf):
        cols = np.flatnonzero(mask)
        order = cols[np.argsort(keys[cols], kind="mergesort")]
        out.append(KeyedColumns(keys[order], W[:, order].tocsc()))
    return out[0], out[1]


def build_tree(samples, tables: Tables, n_features: int, n_labels: int, params: PipelineParams, timer: StageTimer,
               label_counts=None) -> TreeIndex:
    """PIFA label embeddings, label frequencies (interpolated splits only) and the label tree;
    writes ``label_embeddings`` and ``tree``. ``label_counts`` (training label frequencies),
    when given, spare the frequency stage a pass."""
    spark = samples.sparkSession
    with timer.stage("embedding"):
        emb = label_embedding.run(samples, n_features, n_labels, params.embedding,
                                  n_buckets=shuffle_partitions(spark))
        tables.write("label_embeddings", emb)
    f = ft = None
    if params.tree.effective_lambda > 0:
        with timer.stage("frequencies"):
            f, ft, finfo = label_frequencies.run(samples, n_labels, params.tree, label_counts)
            timer.info.update({f"frequencies.{k}": v for k, v in finfo.items()})
    with timer.stage("tree"):
        tree = label_tree.run(tables.read("label_embeddings"), n_labels, n_features, params.tree, f, ft)
        tables.write("tree", tree)
        index = tree_index(tables.read("tree").toPandas(), n_labels, params)   # O(labels)
        log.info("tree: %d leaves, depth %d", len(index.leaves), index.depth)
    return index


def tree_index(rows: pd.DataFrame, n_labels: int, params: PipelineParams) -> TreeIndex:
    return TreeIndex(rows["label_idx"].to_numpy(), rows["node"].to_numpy(), n_labels, params.tree.nr_splits)


def train_classifiers(samples, index: TreeIndex, tables: Tables, n_features: int, params: PipelineParams,
                      timer: StageTimer) -> XMCModel:
    """Node classifiers for ``index``, then ``clusters.rounds`` of overlapping clusters + retraining;
    writes ``weights`` and ``slots`` (the label -> leaf assignment the final weights belong to)."""
    spark = samples.sparkSession
    with timer.stage("train"):
        model = train_weights(samples, index, tables, n_features, params)
    rounds = params.clusters.rounds if params.clusters.lam > 1 else 0
    for r in range(rounds):
        with timer.stage("clusters" if r == 0 else f"clusters_{r + 1}"):
            tables.write("matcher", label_clusters.matcher(samples, model, params.clusters.beam_size))
            current = spark.createDataFrame(
                pd.DataFrame({"label_idx": index.slot_label.astype(np.int32), "node": index.slot_leaf}))
            slots = label_clusters.project(samples, tables.read("matcher"), current, params.clusters.lam).toPandas()
            tables.write("clusters", spark.createDataFrame(slots))
            index = TreeIndex(slots["label_idx"].to_numpy(), slots["node"].to_numpy(), index.n_labels,
                              params.tree.nr_splits)
            log.info("overlapping clusters (lambda=%d): %s", params.clusters.lam,
                     label_clusters.cluster_stats(index.slot_label, index.slot_leaf))
        with timer.stage("retrain" if r == 0 else f"retrain_{r + 1}"):
            model = train_weights(samples, index, tables, n_features, params)
    tables.write("slots", spark.createDataFrame(pd.DataFrame(
        {"label_idx": index.slot_label.astype(np.int32), "node": index.slot_leaf.astype(np.int64)})))
    return model


def train_model(samples, tables: Tables, n_features: int, n_labels: int, params: PipelineParams,
                timer: StageTimer, label_counts=None) -> XMCModel:
    """PIFA, tree and node training from a samples DataFrame; writes their tables."""
    index = build_tree(samples, tables, n_features, n_labels, params, timer, label_counts)
    return train_classifiers(samples, index, tables, n_features, params, timer)


def train_weights(samples, index: TreeIndex, tables: Tables, n_features: int, params: PipelineParams) -> XMCModel:
    """Train every node's classifiers for ``index``; write the weights table; build the model."""
    w = node_training.run(samples, index, n_features, params.train).cache()
    tables.write("weights", w)
    w.unpersist()
    return model_from_weights(tables.read("weights"), index, n_features, params)


def model_from_weights(weights, index: TreeIndex, n_features: int, params: PipelineParams) -> XMCModel:
    n_cols = n_features + (1 if params.train.bias > 0 else 0)
    node_w, slot_w = weights_to_columns(to_arrow(weights), n_cols)
    return XMCModel(index, node_w, slot_w, n_features, bias=params.train.bias, normalize=params.ingest.normalize,
                    pred_params=params.predict)


def model_from_tables(tables: Tables, n_features: int, n_labels: int, params: PipelineParams) -> XMCModel:
    """The model a train stage left in ``tables`` (``slots`` + ``weights``)."""
    index = tree_index(tables.read("slots").toPandas(), n_labels, params)
    return model_from_weights(tables.read("weights"), index, n_features, params)


def ingest_train(spark, tables: Tables, train: str, params: PipelineParams):
    """Validate TRAIN and write ``train``; an aggregated TRAIN (group-level labels, see
    :mod:`.stages.aggregated`) is validated only (the EAGLE stage writes ``train``).
    Returns (DatasetInfo, aggregated stats or None)."""
    if aggregated.is_aggregated(train):
        agg = aggregated.read(spark, train, params.ingest)
        agg.samples.unpersist()
        return agg.info, agg.stats
    return ingest.run(spark, train, tables.path("train"), params.ingest, run_key=tables.run_key), None


def run_eagle(spark, tables: Tables, agg, params: PipelineParams, timer: StageTimer) -> None:
    """EAGLE on validated aggregated input: writes ``train`` (and ``eagle_embeddings``)."""
    with timer.stage("eagle"):
        n_buckets = shuffle_partitions(spark)
        train_df, einfo, emb, assigned = eagle.run(agg, params.eagle, n_buckets=n_buckets)
        if emb is not None:
            tables.write("eagle_embeddings", emb)
        tables.write("train", train_df)
        timer.info.update(einfo)
    if agg.truth is not None:       # evaluation of the assignment, not part of EAGLE's cost
        with timer.stage("eagle_diagnostics"):
            timer.info.update(eagle.diagnostics(assigned, agg.truth))
    agg.samples.unpersist()


def ingest_test(spark, tables: Tables, test: str, info, params: PipelineParams):
    return ingest.run(spark, test, tables.path("test"), params.ingest, expect_features=info.n_features,
                      expect_labels=info.n_labels, run_key=tables.run_key)


def _ingest(spark, train: str, test: Optional[str], tables: Tables, params: PipelineParams, timer: StageTimer):
    """Ingest TRAIN (and TEST) into ``tables``; returns (info, test info or None, table versions).

    An aggregated TRAIN goes through EAGLE here: ``tables/train`` is then its filtered,
    weighted per-sample training table.
    """
    with timer.stage("ingest"):
        if aggregated.is_aggregated(train):
            agg = aggregated.read(spark, train, params.ingest)
            timer.info.update(agg.stats)
        else:
            agg = None
            info, _ = ingest_train(spark, tables, train, params)
    if agg is not None:
        run_eagle(spark, tables, agg, params, timer)
        info = agg.info
    tinfo = None
    if test:
        with timer.stage("ingest" if agg is None else "ingest_test"):
            t0 = timer.seconds.get("ingest", 0.0) if agg is None else 0.0
            tinfo = ingest_test(spark, tables, test, info, params)
        if agg is None:   # one "ingest" figure for train + test, as before
            timer.seconds["ingest"] = round(timer.seconds["ingest"] + t0, 3)
    versions = {"train": tables.version("train")}
    if test:
        versions["test"] = tables.version("test")
    return info, tinfo, versions


def predict_table(tables: Tables, model: XMCModel, params: PipelineParams, source: str = "test") -> None:
    """Beam search over ``source``: writes ``predictions``."""
    tables.write("predictions", prediction.run(tables.read(source), model, params.predict.beam_size,
                                               params.predict.topk))


def evaluate_table(tables: Tables, label_counts, label_depth, n_train: int, params: PipelineParams,
                   source: str = "test") -> Dict[str, float]:
    m = evaluation.run(tables.read("predictions"), tables.read(source), label_counts, n_train, params.eval,
                       label_depth=label_depth)
    return {k: round(v, 4) for k, v in m.items()}


def _fit_and_score(spark, data_tables: Tables, out_p: Path, info, tinfo, versions: Dict, source: str,
                   params: PipelineParams, timer: StageTimer, tracker: Tracker,
                   config_path: Optional[str] = None) -> Dict:
    """Train on ``data_tables``/train, save OUT/model, score ``data_tables``/test; write
    OUT/metrics.json and OUT/config.yaml and log them to the current MLflow run."""
    tables = Tables(spark, out_p / "tables")
    train_df = data_tables.read("train")
    counts = evaluation.label_counts(train_df, info.n_labels)
    model = train_model(train_df, tables, info.n_features, info.n_labels, params, timer, label_counts=counts)
    model.meta.update({"train": source, "n_train": info.n_samples})
    model.label_counts = counts
    model.save(str(out_p / "model"))
    metrics: Dict = {"n_train": info.n_samples, "n_labels": info.n_labels, "n_features": info.n_features,
                     "tree_depth": model.index.depth, "n_leaves": int(len(model.index.leaves)),
                     **label_clusters.cluster_stats(model.index.slot_label, model.index.slot_leaf),
                     **timer.info}
    if tinfo is not None:
        with timer.stage("predict"):
            tables.write("predictions", prediction.run(
                data_tables.read("test"), model, params.predict.beam_size, params.predict.topk))
        with timer.stage("evaluate"):
            m = evaluation.run(tables.read("predictions"), data_tables.read("test"), model.label_counts,
                               info.n_samples, params.eval, label_depth=model.label_depth())
        metrics.update({k: round(v, 4) for k, v in m.items()})
        metrics["n_test"] = tinfo.n_samples
    metrics["seconds"] = timer.total()
    metrics["table_versions"] = versions
    (out_p / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (out_p / "config.yaml").write_text(dump_params(params))
    tracker.log_metrics({k: v for k, v in metrics.items() if not isinstance(v, dict)})
    tracker.log_metrics(metrics["seconds"], prefix="seconds.")
    if "eagle.objective" in metrics:
        tracker.log_series("eagle.objective", metrics["eagle.objective"])
    tracker.log_params({f"table_version.{k}": v for k, v in versions.items()})
    tracker.log_artifact(str(out_p / "metrics.json"))
    tracker.log_artifact(str(out_p / "config.yaml"))
    tracker.log_configs(config_path)
    if params.mlflow.log_model:
        tracker.log_model(str(out_p / "model"))
    if tracker.run_id:
        metrics["mlflow_run_id"] = tracker.run_id
        (out_p / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log.info("metrics: %s", {k: v for k, v in metrics.items() if k.startswith(("p@", "ndcg@", "depth@"))})
    return metrics


def run(spark, train: str, test: Optional[str], out: str, params: PipelineParams,
        config_path: Optional[str] = None) -> Dict:
    """Run every stage; write OUT/metrics.json and OUT/model; track in MLflow."""
    out_p = Path(out)
    tables = Tables(spark, out_p / "tables")
    timer = StageTimer(params.spark.progress_seconds)
    tracker = Tracker(params.mlflow)
    with tracker.run(run_name=params.mlflow.run_name or out_p.name):
        tracker.log_params(params.flat())
        tracker.log_params({"input.train": train, "input.test": test or ""})
        info, tinfo, versions = _ingest(spark, train, test, tables, params, timer)
        return _fit_and_score(spark, tables, out_p, info, tinfo, versions, train, params, timer, tracker,
                              config_path)


def sweep(spark, train: str, test: Optional[str], out: str, params: PipelineParams, key: str, values,
          config_path: Optional[str] = None) -> Dict:
    """Train and score one model per value of config ``key`` (e.g. ``tree.lambda_prime``).

    Ingests once; each value gets OUT/<key>=<value>/ (model, tables, metrics.json) and a nested
    MLflow run; the parent run gets the results table (sweep.json) and, with a test set, a
    precision-vs-expected-depth plot (sweep.png).
    """
    if key.split(".")[0] in ("ingest", "eagle", "spark", "mlflow"):
        from .params import ConfigError
        raise ConfigError(f"sweep runs ingest (and EAGLE) once, so it cannot sweep '{key}': "
                          "use one `xmc-spark run` per value")
    out_p = Path(out)
    tables = Tables(spark, out_p / "tables")
    timer = StageTimer(params.spark.progress_seconds)
    tracker = Tracker(params.mlflow)
    results = []
    with tracker.run(run_name=params.mlflow.run_name or out_p.name, tags={"xmc_spark.sweep": key}):
        tracker.log_params({"sweep.key": key, "sweep.values": ",".join(map(str, values)),
                            "input.train": train, "input.test": test or ""})
        info, tinfo, versions = _ingest(spark, train, test, tables, params, timer)
        for v in values:
            child_params = params.set_dotted(key, v)
            name = f"{key.split('.')[-1]}={v}"
            child = Tracker(params.mlflow)
            with child.run(run_name=name, nested=True, tags={"xmc_spark.sweep": key}):
                child.log_params(child_params.flat())
                ctimer = StageTimer(params.spark.progress_seconds)
                ctimer.info.update(timer.info)      # input facts (aggregated stats, EAGLE diagnostics)
                m = _fit_and_score(spark, tables, out_p / name, info, tinfo, versions, train, child_params,
                                   ctimer, child, config_path)
            results.append({"key": key, "value": v, **{k: x for k, x in m.items() if not isinstance(x, dict)},
                            "seconds": m["seconds"]})
        (out_p / "sweep.json").write_text(json.dumps(results, indent=2))
        tracker.log_artifact(str(out_p / "sweep.json"))
        if tinfo is not None:
            plot_sweep(results, str(out_p / "sweep.png"), params.eval.ks)
            tracker.log_artifact(str(out_p / "sweep.png"))
    return {"key": key, "results": results, "out": str(out_p)}


def plot_sweep(results, path: str, ks) -> None:
    """P@k against expected depth@k, one curve per k, points labelled by the swept value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [k for k in ks if f"p@{k}" in results[0] and f"depth@{k}" in results[0]]
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.8), squeeze=False)
    for ax, k in zip(axes[0], ks):
        x = [r[f"depth@{k}"] for r in results]
        y = [r[f"p@{k}"] for r in results]
        ax.plot(x, y, "o-")
        for r, xi, yi in zip(results, x, y):
            ax.annotate(str(r["value"]), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(f"expected depth@{k}")
        ax.set_ylabel(f"P@{k} (%)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"precision vs expected depth, sweep over {results[0]['key']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def predict(spark, model_dir: str, data: str, out: str, params: PipelineParams) -> Dict:
    """Score a file or table with a saved model; writes predictions (Delta) and, when the input
    has labels, metrics.json."""
    model = XMCModel.load(model_dir)
    model.pred_params = dataclasses.replace(model.pred_params, search=params.predict.search)
    tables = Tables(spark, Path(out) / "tables")
    ing = dataclasses.replace(params.ingest, normalize=model.normalize)   # rows as the model was trained
    info = ingest.run(spark, data, tables.path("input"), ing, expect_features=model.n_features,
                      expect_labels=model.n_labels)
    df = tables.read("input")
    predict_table(tables, model, params, source="input")
    result = {"n_samples": info.n_samples, "predictions": tables.path("predictions")}
    has_labels = df.filter(F.size("label_idx") > 0).limit(1).count() > 0
    if has_labels:
        n_train = int(model.meta.get("n_train", info.n_samples))
        counts = model.label_counts if model.label_counts is not None else evaluation.label_counts(df, model.n_labels)
        m = evaluation.run(tables.read("predictions"), df, counts, n_train, params.eval,
                           label_depth=model.label_depth())
        result.update({k: round(v, 4) for k, v in m.items()})
    (Path(out) / "metrics.json").write_text(json.dumps(result, indent=2))
    return result
