"""Faults: a task that fails on its first attempt is retried by Spark and the result is the same;
a write whose tasks keep failing leaves the previous table version intact.

The test session runs on ``local[2,2]``: every task may be attempted twice (spark.task.maxFailures).
"""
import sys

import numpy as np
import pytest
from pyspark import TaskContext, cloudpickle

from tests.conftest import write_split
from xmc_spark import pipeline
from xmc_spark.model import ModelTrainParams
from xmc_spark.params import PipelineParams
from xmc_spark.runner import StageTimer
from xmc_spark.stages import evaluation, ingest, node_training, prediction
from xmc_spark.storage import Tables, read_delta, table_version

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the injected functions travel to the workers


def _first_attempt_fails(fn, marker):
    def flaky(*args, **kwargs):
        tc = TaskContext.get()
        if tc is not None and tc.attemptNumber() == 0 and tc.partitionId() == 0:
            with open(marker, "a") as f:
                f.write(f"{tc.stageId()}:{tc.partitionId()}\n")
            raise RuntimeError("injected failure on the first attempt")
        return fn(*args, **kwargs)
    return flaky


@pytest.fixture(scope="module")
def data(tmp_path_factory, spark):
    d = tmp_path_factory.mktemp("faults")
    write_split(d, 120, n=160, d=40, L=12, seed=5)
    params = PipelineParams().set_dotted("tree.max_leaf_size", 4)
    info = ingest.run(spark, str(d / "train.txt"), str(d / "train_tbl"), params.ingest)
    ingest.run(spark, str(d / "test.txt"), str(d / "test_tbl"), params.ingest, expect_features=info.n_features,
               expect_labels=info.n_labels)
    samples = read_delta(spark, str(d / "train_tbl")).cache()
    index, _ = pipeline.grow_tree(samples, Tables(spark, d / "tables"), info.n_features, info.n_labels, params,
                                  StageTimer(0))
    return d, params, info, samples, index


def _train_and_score(spark, data):
    """Node training and beam-search prediction as Spark jobs; (weights, metrics)."""
    d, params, info, samples, index = data
    w = node_training.run(samples, index, info.n_features, params.train).cache()
    weights = sorted((r["is_leaf"], r["key"], tuple(r["w_idx"]), tuple(np.round(r["w_val"], 6))) for r in w.collect())
    model = pipeline.model_from_weights(w, index, info.n_features, ModelTrainParams.from_pipeline(params),
                                        params.predict)
    w.unpersist()
    test = read_delta(spark, str(d / "test_tbl"))
    preds = prediction.run(test, model, params.predict.beam_size, params.predict.topk)
    counts = evaluation.label_counts(samples, info.n_labels)
    metrics = evaluation.run(preds, test, counts, info.n_samples, params.eval, label_depth=model.label_depth())
    return weights, metrics


def test_retried_tasks_give_the_same_model_and_metrics(spark, data, tmp_path, monkeypatch):
    assert spark.sparkContext.master == "local[2,2]"
    clean_w, clean_m = _train_and_score(spark, data)
    marker = tmp_path / "failures.txt"
    # node training and beam-search prediction each lose their first task attempt
    monkeypatch.setattr(node_training, "train_group", _first_attempt_fails(node_training.train_group, marker))
    monkeypatch.setattr(prediction, "worker_progress", _first_attempt_fails(prediction.worker_progress, marker))
    faulty_w, faulty_m = _train_and_score(spark, data)
    failures = marker.read_text().splitlines()
    assert len({f.split(":")[0] for f in failures}) >= 2, failures   # the faults did happen, in two Spark stages
    assert faulty_w == clean_w and len(clean_w) > 0
    assert faulty_m == clean_m and clean_m["p@1"] > 0


def test_a_write_whose_tasks_keep_failing_leaves_the_table(spark, data, tmp_path, monkeypatch):
    from xmc_spark.params import IngestParams
    d = data[0]
    out = str(tmp_path / "tbl")
    ingest.run(spark, str(d / "train.txt"), out, IngestParams())
    v, before = table_version(spark, out), sorted(read_delta(spark, out).collect())

    def always(*a, **k):
        raise RuntimeError("injected failure on every attempt")

    monkeypatch.setattr(ingest, "finish_batch", always)
    with pytest.raises(Exception, match="injected failure on every attempt"):
        ingest.run(spark, str(d / "test.txt"), out, IngestParams())
    assert table_version(spark, out) == v
    assert sorted(read_delta(spark, out).collect()) == before
