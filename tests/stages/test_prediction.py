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
    """Given the row count: one Arrow batch or less stays where it is; up to p batches are spread
    over the default parallelism p, more over 2p."""
    samples, _, _ = problem
    one = samples.coalesce(1)
    batch = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000"))
    par = spark.sparkContext.defaultParallelism
    assert N <= batch and prediction.balanced(one, n_rows=N) is one
    assert prediction.balanced(one, n_rows=batch).rdd.getNumPartitions() == 1
    assert prediction.balanced(one, n_rows=batch + 1).rdd.getNumPartitions() == par
    assert prediction.balanced(one, n_rows=2 * par * batch).rdd.getNumPartitions() == 2 * par
    assert prediction.balanced(one, n_rows=100 * par * batch).rdd.getNumPartitions() == 2 * par


@pytest.mark.parametrize("n_rows, parts", [
    (None, 8), (0, 1), (4096, 1), (4097, 4), (20_000, 8), (4 * 4096, 4), (4 * 4096 + 1, 8), (10**7, 8)])
def test_spread_parts_closed_form(n_rows, parts):
    """p = 4, batch 4096: the 200K test set's 20K rows (5 batches) go to 2p = 8 partitions."""
    assert prediction._spread_parts(4, 4096, n_rows) == parts


def test_shuffled_input_is_left_as_it_is(problem, spark):
    """A plan with an exchange is not counted (adaptive execution would run its shuffle here);
    a cached shuffle's output is counted."""
    samples, _, _ = problem
    shuffled = samples.repartition(1, "sample_id")
    assert prediction._has_exchange(shuffled) and not prediction._has_exchange(samples.coalesce(1))
    assert prediction.balanced(shuffled) is shuffled
    # exchanges the planner adds (an aggregation, a join) count as well as a repartition
    assert samples.rdd.getNumPartitions() > 1
    assert prediction._has_exchange(samples.dropDuplicates(["sample_id"]))
    assert prediction._has_exchange(samples.join(samples.select("sample_id"), "sample_id"))
    cached = samples.repartition(1, "sample_id").cache()      # reading the cache shuffles nothing
    assert not prediction._has_exchange(cached) and prediction.balanced(cached).rdd.getNumPartitions() > 1
    cached.unpersist()
