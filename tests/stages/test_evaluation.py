"""The evaluation stage on tiny frames, against hand-computed metrics: test labels never seen in
training (beyond the training label space) count as misses, with the propensity of count 0."""
import numpy as np
import pytest

from tests.conftest import executed_plan, stage_tasks
from xmc_spark.params import EvalParams
from xmc_spark.stages import evaluation

TEST = "sample_id long, label_idx array<int>"
PRED = "sample_id long, pred_labels array<int>"


@pytest.mark.connect
def test_unseen_test_labels_are_misses(spark):
    counts = np.array([3, 1])                      # training has labels 0 and 1 only, n_train = 10
    test = spark.createDataFrame([(0, [0, 3]), (1, [3]), (2, [1])], TEST)
    preds = spark.createDataFrame([(0, [0, 1]), (1, [1, 0]), (2, [1])], PRED)
    m = evaluation.run(preds, test, counts, 10, EvalParams(ks=[1, 2]), label_depth=np.array([1, 2]))
    # inverse propensity 1 + C (N_l + B)^-A, C = (ln 10 - 1)(B + 1)^A; label 3 has N_l = 0
    C = (np.log(10) - 1) * 2.5 ** 0.55
    inv0, inv1, inv3 = (1 + C * (n + 1.5) ** -0.55 for n in (3, 1, 0))
    assert m["p@1"] == pytest.approx(100 * 2 / 3)                 # rows 0 and 2 hit at rank 1
    assert m["p@2"] == pytest.approx(100 * (1 / 2 + 0 + 1 / 2) / 3)
    assert m["recall@2"] == pytest.approx(100 * (1 / 2 + 0 + 1) / 3)
    assert m["ndcg@2"] == pytest.approx(100 * (1 / (1 + 1 / np.log2(3)) + 0 + 1) / 3)
    assert m["psp@1"] == pytest.approx(100 * (inv0 + inv1) / (inv3 + inv3 + inv1))
    assert m["psp@2"] == pytest.approx(100 * (inv0 + inv1) / ((inv3 + inv0) + inv3 + inv1))
    assert m["depth@1"] == pytest.approx((1 + 2 + 2) / 3)


@pytest.mark.connect
def test_unseen_labels_counts(spark):
    train = spark.createDataFrame([(0, [0, 1]), (1, [2]), (2, [])], TEST)
    test = spark.createDataFrame([(10, [0, 5]), (11, [5, 7]), (12, [1]), (13, [])], TEST)   # an empty row last
    counts = evaluation.label_counts(train, 8)
    assert evaluation.unseen_labels(counts, test) == {
        "test_unseen_labels": 2, "test_unseen_positives": 3, "test_rows_with_unseen": 2}
    assert evaluation.unseen_labels(np.array([1, 1]), test) == {     # labels past the counts
        "test_unseen_labels": 2, "test_unseen_positives": 3, "test_rows_with_unseen": 2}
    assert evaluation.unseen_labels(np.array([1, 0, 1]), test) == {
        "test_unseen_labels": 3, "test_unseen_positives": 4, "test_rows_with_unseen": 3}
    assert evaluation.unseen_labels(counts, train) == {
        "test_unseen_labels": 0, "test_unseen_positives": 0, "test_rows_with_unseen": 0}
    # the same from the test's label counts and its rows having an unseen label (ingest counts both)
    test_counts = evaluation.label_counts(test, 8)
    for train_counts, rows in ((counts, 2), (np.array([1, 1]), 2), (np.array([1, 0, 1]), 3)):
        assert evaluation.unseen_from_counts(train_counts, test_counts, rows) == \
            evaluation.unseen_labels(train_counts, test)


def test_predictions_are_joined_shuffled_never_broadcast(spark, tmp_path):
    """A predictions table small on disk goes through a shuffled hash join, not a broadcast (its
    rows would pass through the driver); the same join without the hint is broadcast here."""
    spark.createDataFrame([(0, [0]), (1, [1]), (2, [2])], TEST).write.parquet(str(tmp_path / "t"))
    spark.createDataFrame([(0, [0, 1]), (2, [1])], PRED).write.parquet(str(tmp_path / "p"))
    test, preds = spark.read.parquet(str(tmp_path / "t")), spark.read.parquet(str(tmp_path / "p"))
    joined = evaluation.with_predictions(test, preds)
    plan = executed_plan(joined)
    assert "ShuffledHashJoin" in plan and "BroadcastExchange" not in plan
    assert "BroadcastExchange" in executed_plan(test.join(preds, "sample_id", "left"))
    assert sorted((r["sample_id"], r["pred_labels"]) for r in joined.collect()) == [(0, [0, 1]), (1, []), (2, [1])]


def test_small_shuffles_take_the_tasks_their_rows_need(spark, tmp_path):
    """With 64 shuffle partitions and no adaptive coalescing, the join of a test set whose rows
    are known goes into the partitions that many rows need (here the default parallelism), and
    the label counts' reduce runs in as few tasks: each task reports its metrics to the driver.
    The answers are those of the unsized join and a brute-force count."""
    import re

    from pyspark.sql import functions as F
    spark.createDataFrame([(i, [i % 3]) for i in range(20)], TEST).write.parquet(str(tmp_path / "t"))
    spark.createDataFrame([(i, [i % 3, 4]) for i in range(0, 20, 2)], PRED).write.parquet(str(tmp_path / "p"))
    test, preds = spark.read.parquet(str(tmp_path / "t")), spark.read.parquet(str(tmp_path / "p"))
    k = spark.sparkContext.defaultParallelism
    keys = ("spark.sql.shuffle.partitions", "spark.sql.adaptive.coalescePartitions.enabled")
    old = {key: spark.conf.get(key) for key in keys}
    try:
        spark.conf.set("spark.sql.shuffle.partitions", "64")
        spark.conf.set("spark.sql.adaptive.coalescePartitions.enabled", "false")
        sized = evaluation.with_predictions(test, preds, n_rows=20)
        got = sorted(map(tuple, sized.collect()))
        assert re.search(rf"Coalesce {k}\b", executed_plan(sized)) and sized.rdd.getNumPartitions() == k
        assert got == sorted(map(tuple, evaluation.with_predictions(test, preds).collect()))
        assert got[:2] == [(0, [0], [0, 4]), (1, [1], [])]
        counts, tasks = stage_tasks(spark, lambda: evaluation.rows_per_label(
            test.select(F.explode("label_idx").alias("label_idx")), 5), "label-counts")
        assert tasks and max(tasks) <= k, tasks
        assert counts.tolist() == [7, 7, 6, 0, 0]
    finally:
        for key, value in old.items():
            spark.conf.set(key, value)
