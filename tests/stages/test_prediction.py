"""Batched beam search on Spark equals the model's numpy prediction."""
import numpy as np
import pytest
from chispa import assert_df_equality

from tests.stages.conftest import N
from xmc_spark.kernels import metrics as M
from xmc_spark.model import XMCModel
from xmc_spark.params import EvalParams, TreeParams
from xmc_spark.schemas import check_table, ddl
from xmc_spark.stages import evaluation, prediction


@pytest.fixture(scope="module")
def predicted(problem):
    samples, Xl, Yl = problem
    model = XMCModel.train_local(Xl, Yl, tree=TreeParams(max_leaf_size=4))
    return model, prediction.run(samples, model, beam_size=3, topk=4).cache()


def test_prediction_stage_equals_kernel(problem, predicted, spark):
    _, Xl, _ = problem
    model, preds = predicted
    labels, scores = model.predict(Xl, beam_size=3, topk=4)
    assert (labels >= 0).all(axis=1).any() and model.index.depth >= 2
    rows = sorted(check_table(preds, "predictions").collect(), key=lambda r: r["sample_id"])
    for r, sc, lab in zip(rows, scores, labels):
        np.testing.assert_allclose(r["pred_scores"], sc[lab >= 0], rtol=1e-5)
    expected = spark.createDataFrame([(i, [int(x) for x in lab if x >= 0]) for i, lab in enumerate(labels)],
                                     "sample_id long, pred_labels array<int>")
    assert_df_equality(preds.select("sample_id", "pred_labels"), expected, ignore_row_order=True,
                       ignore_nullable=True)
    assert ddl("predictions").startswith("sample_id bigint, pred_labels array<int>")


def test_evaluation_of_stage_predictions_equals_kernel(problem, predicted):
    samples, Xl, Yl = problem
    model, preds = predicted
    labels, _ = model.predict(Xl, beam_size=3, topk=4)
    counts = np.asarray(Yl.sum(axis=0)).ravel()
    got = evaluation.run(preds, samples, counts, N, EvalParams(), label_depth=model.label_depth())
    ref = M.evaluate(labels, Yl, 1 / M.propensities(counts, N), (1, 3, 5))
    assert ref
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, abs=1e-9), k


def test_samples_in_fewer_partitions_than_slots_are_balanced(problem, spark):
    """One or two input files would be scored by as many tasks: the rows are spread round-robin
    over twice the default parallelism (every row once), and input already that wide is left as is."""
    samples, _, _ = problem
    parts = 2 * spark.sparkContext.defaultParallelism
    one = samples.coalesce(1)
    spread = prediction.balanced(one)
    assert spread.rdd.getNumPartitions() == parts
    sizes = spread.rdd.glom().map(len).collect()
    assert sum(sizes) == N and max(sizes) <= 1.1 * N / parts
    assert sorted(r["sample_id"] for r in spread.select("sample_id").collect()) == list(range(N))
    wide = samples.repartition(parts + 1)
    assert prediction.balanced(wide) is wide


def test_too_few_rows_to_share_are_not_shuffled(problem, spark):
    """Given the row count, fewer rows than one Arrow batch per target partition stay where they are."""
    samples, _, _ = problem
    one = samples.coalesce(1)
    batch = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000"))
    parts = 2 * spark.sparkContext.defaultParallelism
    assert N < parts * batch and prediction.balanced(one, n_rows=N) is one
    assert prediction.balanced(one, n_rows=parts * batch).rdd.getNumPartitions() == parts
