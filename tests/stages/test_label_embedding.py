"""The PIFA stage equals the numpy kernel."""
import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

from tests.stages.conftest import D, L, samples_frame, to_csr
from xmc_spark.arrow_utils import binary_values
from xmc_spark.kernels.label_embedding import pifa
from xmc_spark.params import EmbeddingParams
from xmc_spark.schemas import check_table
from xmc_spark.stages import label_embedding


@pytest.mark.parametrize("pack_nnz", [label_embedding.PACK_NNZ, 1, 7])
def test_pifa_stage_equals_kernel(problem, pack_nnz):
    """One packed partial record per bucket and task, a record per label row (1), or a few rows a
    record (7): the kernel's embeddings."""
    samples, Xl, Yl = problem
    emb = check_table(label_embedding.run(samples, EmbeddingParams(), n_features=D, n_labels=L, n_buckets=3,
                                          pack_nnz=pack_nnz), "label_embeddings")
    Z = to_csr(emb.collect(), "emb_idx", "emb_val", D, id_col="label_idx")
    np.testing.assert_allclose(Z.toarray(), pifa(Xl, Yl).toarray(), rtol=1e-5, atol=1e-6)


def test_packed_records_hold_the_partial_rows():
    """_pack cuts a partial's rows into records of at most pack_nnz non-zeros (a longer row alone),
    and the records give back its rows as float32."""
    acc = sp.random(40, 25, density=0.3, format="csr", random_state=1)
    rows = np.flatnonzero(np.diff(acc.indptr))[::2]
    for pack_nnz in (1, 9, 10 ** 6):
        batches = list(label_embedding._pack(2, rows, acc, pack_nnz))
        t = pa.Table.from_batches(batches)
        nnz = [len(b.column("emb_idx")[0].as_py()) // 4 for b in batches]
        n_rows = [len(b.column("labels")[0].as_py()) // 4 for b in batches]
        assert all(n <= pack_nnz or r == 1 for n, r in zip(nnz, n_rows))
        # greedy: a record's next row would not have fitted it
        row_nnz = np.diff(acc[rows].indptr)
        starts = np.cumsum([0] + n_rows)
        assert all(nnz[k] + row_nnz[starts[k + 1]] > pack_nnz for k in range(len(batches) - 1))
        assert set(t.column("bucket").to_pylist()) == {2} and sum(nnz) == acc[rows].nnz
        labels = binary_values(t.column("labels"), np.int32)
        ptr = np.concatenate([[0], np.cumsum(binary_values(t.column("row_len"), np.int32))])
        M = sp.csr_matrix((binary_values(t.column("emb_val"), np.float32), binary_values(t.column("emb_idx"), np.int32),
                           ptr), shape=(len(labels), 25))
        np.testing.assert_array_equal(labels, rows)
        assert abs(M - acc[rows].astype(np.float32)).max() == 0
    assert len(list(label_embedding._pack(0, rows, acc, 10 ** 6))) == 1
    assert len(list(label_embedding._pack(0, rows, acc, 1))) == len(rows)
    assert not list(label_embedding._pack(0, rows[:0], acc, 1))


def test_labels_without_samples_are_omitted_and_y_unnormalized(problem, spark):
    _, Xl, Yl = problem
    Y = sp.csr_matrix(Yl.multiply(np.arange(L) != 5))           # label 5 never occurs
    Y.eliminate_zeros()
    emb = label_embedding.run(samples_frame(spark, Xl, Y), EmbeddingParams(normalize_y=False), n_features=D,
                              n_labels=L, n_buckets=2)
    rows = emb.collect()
    assert sorted(r["label_idx"] for r in rows) == [k for k in range(L) if k != 5]
    ref = pifa(Xl, Y, normalize_y=False).toarray()
    assert not np.allclose(ref, pifa(Xl, Y).toarray())          # the flag matters on this data
    got = np.zeros((L, D))
    for r in rows:
        got[r["label_idx"], r["emb_idx"]] = r["emb_val"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_blocks_of_batches_sum_to_the_kernel(problem, spark):
    """Batches of 8 rows (about 7 a task): one block per batch (block_bytes=1) or a few batches a
    block give the kernel's embeddings (one block a task: the test above)."""
    samples, Xl, Yl = problem
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    old = spark.conf.get(key)
    spark.conf.set(key, "8")
    try:
        sizes = samples.mapInArrow(lambda bs: ([pa.RecordBatch.from_pydict({"n": [b.num_rows]}) for b in bs]),
                                   "n long").collect()
        assert max(r["n"] for r in sizes) == 8 and len(sizes) >= 3 * 4      # several batches a task
        for block in (1, 3000):
            emb = label_embedding.run(samples, EmbeddingParams(), n_features=D, n_labels=L, n_buckets=3,
                                      block_bytes=block)
            Z = to_csr(emb.collect(), "emb_idx", "emb_val", D, id_col="label_idx")
            np.testing.assert_allclose(Z.toarray(), pifa(Xl, Yl).toarray(), rtol=1e-5, atol=1e-6)
    finally:
        spark.conf.set(key, old)


def test_each_bucket_gets_a_partition_of_its_own(problem, spark):
    """With as many buckets as shuffle partitions, the combine's partition of a label depends on
    its bucket (label mod n) alone, and no two buckets share one (the buckets' own ids 0-3 would
    send three of the four to partition 3); the embeddings are the kernel's."""
    from pyspark.sql import functions as F
    samples, Xl, Yl = problem
    keys = {"spark.sql.shuffle.partitions": "4", "spark.sql.adaptive.coalescePartitions.enabled": "false"}
    old = {k: spark.conf.get(k) for k in keys}
    for k, v in keys.items():
        spark.conf.set(k, v)
    try:
        emb = label_embedding.run(samples, EmbeddingParams(), n_features=D, n_labels=L, n_buckets=4)
        rows = emb.withColumn("pid", F.spark_partition_id()).collect()
    finally:
        for k, v in old.items():
            spark.conf.set(k, v)
    where = {}
    for r in rows:
        where.setdefault(r["label_idx"] % 4, set()).add(r["pid"])
    assert len(where) == 4 and all(len(p) == 1 for p in where.values())
    assert len(set.union(*where.values())) == 4
    Z = to_csr(rows, "emb_idx", "emb_val", D, id_col="label_idx")
    np.testing.assert_allclose(Z.toarray(), pifa(Xl, Yl).toarray(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combines", [1, 3])
def test_estimated_partials_size_the_combine(problem, spark, combines):
    """With 64 shuffle partitions and no adaptive coalescing, partials estimated at ``combines``
    tasks' worth of non-zeros are summed in that many tasks (at least the default parallelism),
    each bucket in a partition of its own, not in 64; the embeddings stay the kernel's."""
    from pyspark.sql import functions as F

    from tests.conftest import stage_tasks
    from xmc_spark.compat import session_settings
    samples, Xl, Yl = problem
    keys = {"spark.sql.shuffle.partitions": "64", "spark.sql.adaptive.coalescePartitions.enabled": "false"}
    with session_settings(spark, keys, "the test"):
        emb = label_embedding.run(samples, EmbeddingParams(), n_features=D, n_labels=L, n_buckets=64,
                                  partials_nnz=combines * label_embedding.COMBINE_NNZ)
        rows, tasks = stage_tasks(spark, lambda: emb.withColumn("pid", F.spark_partition_id()).collect())
    want = max(combines, spark.sparkContext.defaultParallelism)
    assert tasks and max(tasks) <= max(want, samples.rdd.getNumPartitions()) < 64, tasks
    where = {}
    for r in rows:
        where.setdefault(r["label_idx"] % want, set()).add(r["pid"])
    assert len(where) == want and all(len(p) == 1 for p in where.values())
    assert len(set.union(*where.values())) == want
    Z = to_csr(rows, "emb_idx", "emb_val", D, id_col="label_idx")
    np.testing.assert_allclose(Z.toarray(), pifa(Xl, Yl).toarray(), rtol=1e-5, atol=1e-6)


def test_with_adaptive_coalescing_the_estimate_is_not_used(problem, spark):
    """Where adaptive execution coalesces the grouping's shuffle by its real sizes, an estimate
    changes nothing: the same tasks as without one (an explicit partition count would forbid the
    coalescing), and the kernel's embeddings."""
    from tests.conftest import stage_tasks
    from xmc_spark.compat import coalescing, session_settings
    samples, Xl, Yl = problem
    keys = {"spark.sql.shuffle.partitions": "64", "spark.sql.adaptive.enabled": "true",
            "spark.sql.adaptive.coalescePartitions.enabled": "true"}
    with session_settings(spark, keys, "the test"):
        assert coalescing(spark)
        runs = [stage_tasks(spark, lambda nnz=nnz: label_embedding.run(
            samples, EmbeddingParams(), n_features=D, n_labels=L, n_buckets=64, partials_nnz=nnz).collect())
            for nnz in (None, 7 * label_embedding.COMBINE_NNZ)]
    # (used, the estimate would make a stage of 7 tasks: one per bucket)
    assert max(runs[1][1]) == max(runs[0][1]) < 7, (runs[0][1], runs[1][1])
    Z = to_csr(runs[1][0], "emb_idx", "emb_val", D, id_col="label_idx")
    np.testing.assert_allclose(Z.toarray(), pifa(Xl, Yl).toarray(), rtol=1e-5, atol=1e-6)


def test_the_partials_estimate_is_memberships_times_row_non_zeros():
    """Ingest's sum of labels x non-zeros when it has one, else the memberships times a row's mean."""
    assert label_embedding.partials_nnz(np.array([3, 0, 2]), 4.5, 40) == 40.0
    assert label_embedding.partials_nnz(None, None, 40) == 40.0
    assert label_embedding.partials_nnz(np.array([3, 0, 2]), 4.5) == 22.5
    assert label_embedding.partials_nnz(None, 4.5) is None
    assert label_embedding.partials_nnz(np.array([1]), None) is None


def test_packed_embeddings_are_the_rows_of_the_table(problem, spark):
    """packed=True gives the same rows with their lists as bytes, in batches cut by non-zeros:
    unpacked, the rows of the list output (up to the order of the shuffle's partials: float32
    sums); the label tree grown from the packed rows is the one grown from their unpacked lists."""
    from xmc_spark.params import TreeParams
    from xmc_spark.stages import label_tree
    samples, _, _ = problem
    kw = dict(n_features=D, n_labels=L, n_buckets=3)
    lists = label_embedding.run(samples, EmbeddingParams(), **kw)
    Z = to_csr(lists.collect(), "emb_idx", "emb_val", D, id_col="label_idx")
    for batch_nnz in (label_embedding.PACKED_BATCH_NNZ, 1, 7):     # one batch a task, a row a batch, a few
        packed = label_embedding.run(samples, EmbeddingParams(), packed=True, batch_nnz=batch_nnz,
                                     **kw).localCheckpoint()
        assert dict(packed.dtypes)["emb_idx"] == "binary" and label_tree.is_packed(packed)
        table = check_table(label_embedding.unpacked(packed), "label_embeddings")
        assert not label_tree.is_packed(table)
        np.testing.assert_allclose(to_csr(table.collect(), "emb_idx", "emb_val", D, id_col="label_idx").toarray(),
                                   Z.toarray(), rtol=1e-6, atol=1e-7)
        params = TreeParams(max_leaf_size=3, seed=4)
        grown = [sorted(label_tree.run(e, params, n_features=D, n_labels=L).collect()) for e in (table, packed)]
        assert grown[0] == grown[1]
