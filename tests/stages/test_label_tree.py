"""The tree stage (balanced levels chained in one plan, interpolated ones level by level) equals the
numpy tree kernel (2-means and interpolated splits)."""
import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
from chispa import assert_df_equality

from tests.stages.conftest import D, L
from xmc_spark.kernels import frequencies as FQ
from xmc_spark.kernels.balanced_kmeans import balanced_split
from xmc_spark.kernels.label_embedding import pifa
from xmc_spark.kernels.tree import build_tree, split_seed, tree_from_params
from xmc_spark.params import EmbeddingParams, TreeParams
from xmc_spark.schemas import check_table, ddl
from xmc_spark.stages import label_embedding, label_tree


@pytest.fixture(scope="module")
def emb(problem):
    samples, _, _ = problem
    return label_embedding.run(samples, EmbeddingParams(), n_features=D, n_labels=L, n_buckets=2).cache()


def _assert_tree(spark, tree, leaf):
    """The stage's (label_idx, node) table is the kernel's leaf of every label."""
    expected = spark.createDataFrame([(k, int(n), 0) for k, n in enumerate(leaf)], ddl("tree") + ", tree int")
    assert_df_equality(check_table(tree, "tree"), expected, ignore_row_order=True, ignore_nullable=True)


@pytest.mark.connect
@pytest.mark.parametrize("local", [0, 6])
def test_tree_stage_equals_kernel(problem, emb, spark, local):
    _, Xl, Yl = problem
    params = TreeParams(max_leaf_size=3, nr_splits=2, seed=4, local_subtree_size=local)
    _assert_tree(spark, label_tree.run(emb, params, n_features=D, n_labels=L),
                 build_tree(pifa(Xl, Yl), params.max_leaf_size, params.nr_splits, params.max_iter, params.seed))
    params3 = TreeParams(max_leaf_size=2, nr_splits=3, seed=1, local_subtree_size=local)
    _assert_tree(spark, label_tree.run(emb, params3, n_features=D, n_labels=L),
                 build_tree(pifa(Xl, Yl), 2, 3, params3.max_iter, 1))


@pytest.mark.parametrize("local", [4096, 0])
def test_labels_without_embedding_are_placed(problem, emb, spark, local):
    """Labels 1, 5, 9, 13 without a row, and a row of a label past n_labels (ignored): the tree of
    their empty rows, with the subtrees grown at the root (4096) or over two chained levels (0)."""
    _, Xl, Yl = problem
    params = TreeParams(max_leaf_size=4, seed=2, local_subtree_size=local)
    Z = sp.csr_matrix(pifa(Xl, Yl).multiply((np.arange(L) % 4 != 1)[:, None]))
    beyond = emb.filter("label_idx = 0").selectExpr(f"{L} AS label_idx", "emb_idx", "emb_val")
    _assert_tree(spark, label_tree.run(emb.filter("label_idx % 4 != 1").unionByName(beyond), params, n_features=D,
                                       n_labels=L), tree_from_params(Z, params))


def test_no_embedding_at_all_is_the_tree_of_empty_rows(emb, spark):
    """No label has a row: every label is placed, as the kernel places L empty rows."""
    params = TreeParams(max_leaf_size=4, seed=2, local_subtree_size=0)
    _assert_tree(spark, label_tree.run(emb.filter("false"), params, n_features=D, n_labels=L),
                 tree_from_params(sp.csr_matrix((L, D), dtype=np.float32), params))


def test_a_chained_level_hands_on_its_rows_in_batches_cut_by_non_zeros(monkeypatch):
    """A chained level's output: rows in label order with their embeddings repacked (the same CSR),
    batches cut at the running count of non-zeros, the split's children, and each child's
    partition key of the next level."""
    import pyarrow as pa

    from xmc_spark.arrow_utils import csr_from_binary, pack_rows
    rng = np.random.default_rng(1)
    M = sp.random(9, 12, density=0.4, format="csr", random_state=rng, dtype=np.float32)
    perm = rng.permutation(9)
    idx, val = pack_rows(pa.table({"emb_idx": pa.array([M[i].indices.tolist() for i in perm], pa.list_(pa.int32())),
                                   "emb_val": pa.array([M[i].data.tolist() for i in perm], pa.list_(pa.float32()))}),
                         "emb_idx", "emb_val")
    t = pa.table({"label_idx": pa.array(perm, pa.int32()), "node": pa.array(np.zeros(9, np.int64)),
                  "tree": pa.array(np.zeros(9, np.int32)), "part": pa.array(np.zeros(9, np.int32)),
                  "emb_idx": idx, "emb_val": val})
    params = TreeParams(max_leaf_size=2, seed=3)
    nxt = label_tree._level_parts(1, 2, 1, 8)
    monkeypatch.setattr(label_tree, "PACK_NNZ", 5)
    out = label_tree._level_step(params, 12, 9, 2, 0, nxt)(t)
    assert out.column("label_idx").to_pylist() == list(range(9))
    assert len(out.to_batches()) > 1 and all(b.num_rows for b in out.to_batches())
    assert (csr_from_binary(out, "emb_idx", "emb_val", 12) != M).nnz == 0
    child = out.column("node").to_numpy()           # the root's split: children 1 and 2
    np.testing.assert_array_equal(child, 1 + balanced_split(M, 2, params.max_iter, split_seed(3, 0)))
    np.testing.assert_array_equal(out.column("part").to_numpy(), nxt[1][child - 1])


def test_a_root_within_the_leaf_size_holds_every_label(emb, spark):
    """max_leaf_size >= labels: no split, every label (with an embedding or not) in node 0 of
    each tree."""
    got = check_table(label_tree.run(emb.filter("label_idx % 4 != 1"), TreeParams(max_leaf_size=L, ensemble=2),
                                     n_features=D, n_labels=L), "tree").toPandas()
    assert sorted(zip(got["tree"], got["label_idx"])) == [(t, k) for t in (0, 1) for k in range(L)]
    assert (got["node"] == 0).all()


@pytest.mark.connect
@pytest.mark.parametrize("lam", [0.5, 2.0])
def test_interpolated_tree_stage_equals_kernel(problem, emb, spark, lam):
    _, Xl, Yl = problem
    Yl = sp.csr_matrix(Yl)
    params = TreeParams(max_leaf_size=2, lam=lam, seed=2, local_subtree_size=0 if lam < 2 else 5)
    f, ft = FQ.label_frequencies(Yl.indptr, Yl.indices, L, "marginal")
    _assert_tree(spark, label_tree.run(emb, params, n_features=D, n_labels=L, f=f, f_tilde=ft),
                 tree_from_params(pifa(Xl, Yl), params, f, ft))
    with pytest.raises(ValueError, match="frequencies"):
        label_tree.run(emb, params, n_features=D, n_labels=L)


def test_a_failed_level_leaves_nothing_cached(problem, emb, spark, monkeypatch):
    """The level-by-level tree caches the embeddings joined to every label and shares the label
    frequencies: a level that fails releases both, as a finished tree does."""
    from pyspark import StorageLevel
    _, Xl, Yl = problem
    Yl = sp.csr_matrix(Yl)
    params = TreeParams(max_leaf_size=2, lam=0.5, seed=2, local_subtree_size=0)
    f, ft = FQ.label_frequencies(Yl.indptr, Yl.indices, L, "marginal")
    seen, released, split, share = [], [], label_tree.split_level, label_tree.share

    def recorded_share(*a, **k):
        shared = share(*a, **k)
        unpersist = shared.unpersist

        def release(*ua, **uk):
            released.append(shared)
            return unpersist(*ua, **uk)

        shared.unpersist = release
        return shared

    def second_level_fails(emb_, active, big, n_features, params_, freqs, local):
        seen.append((emb_, freqs))
        if fail and len(seen) == 2:
            raise RuntimeError("level 2 failed")
        return split(emb_, active, big, n_features, params_, freqs, local)

    monkeypatch.setattr(label_tree, "share", recorded_share)
    monkeypatch.setattr(label_tree, "split_level", second_level_fails)
    for fail in (False, True):
        seen.clear()
        released.clear()
        if fail:
            with pytest.raises(RuntimeError, match="level 2 failed"):
                label_tree.run(emb, params, n_features=D, n_labels=L, f=f, f_tilde=ft)
        else:
            label_tree.run(emb, params, n_features=D, n_labels=L, f=f, f_tilde=ft)
        assert len(seen) >= 2 and seen[0][0].storageLevel == StorageLevel.NONE, fail     # the cache released
        assert released == [seen[0][1]], fail                                            # the share too


@pytest.mark.parametrize("ensemble", [dict(ensemble_splits=[2, 3]), dict(ensemble=2, nr_splits=3)])
def test_ensemble_trees_grow_in_the_same_jobs(problem, emb, spark, ensemble):
    """tree.ensemble_splits = 2,3 (level by level) or tree.ensemble = 2 of one branching (chained):
    tree t is the kernel's tree with its nr_splits and seed + t."""
    _, Xl, Yl = problem
    params = TreeParams(max_leaf_size=3, seed=4, local_subtree_size=6, **ensemble)
    assert label_tree._chainable(params) == ("ensemble" in ensemble)
    got = check_table(label_tree.run(emb, params, n_features=D, n_labels=L), "tree").toPandas()
    assert sorted(got["tree"].unique()) == [0, 1]
    for t in (0, 1):
        B = params.for_tree(t).nr_splits
        part = got[got["tree"] == t].sort_values("label_idx")
        np.testing.assert_array_equal(part["label_idx"], np.arange(L))
        np.testing.assert_array_equal(part["node"], build_tree(pifa(Xl, Yl), 3, B, params.max_iter, 4 + t))


def test_local_subtree_bound_follows_the_task_slots():
    """A node grows its subtree in its task from max(local_subtree_size, labels / slots) labels
    down; 0 keeps every level a Spark job."""
    assert label_tree.local_size(TreeParams(local_subtree_size=4096), 20000, 2) == 10000
    assert label_tree.local_size(TreeParams(local_subtree_size=4096), 20001, 2) == 10001
    assert label_tree.local_size(TreeParams(local_subtree_size=4096), 20000, 64) == 4096
    assert label_tree.local_size(TreeParams(local_subtree_size=0), 20000, 2) == 0


def test_chained_levels_are_the_kernels_depth():
    """A balanced tree's chained levels from the sizes alone: with no local subtrees, the depth of
    the kernel's deepest leaf (random rows; labels, branching and leaf sizes around the edges);
    with them, one level more than the splits down to the first depth within the local bound."""
    from xmc_spark.kernels.tree import node_depth
    rng = np.random.default_rng(0)
    for n in (1, 7, 100, 101, 2000):
        Z = sp.random(n, 20, density=0.3, format="csr", random_state=rng, dtype=np.float32)
        for B in (2, 3):
            for leaf in (1, 3, 100):
                P = TreeParams(max_leaf_size=leaf, nr_splits=B, max_iter=3)
                depth = int(node_depth(build_tree(Z, leaf, B, 3), B).max())
                assert label_tree.chained_levels(P, n, 0) == depth, (n, B, leaf)
                assert not label_tree._chainable(dataclasses.replace(P, lam=0.5))
    P = TreeParams(max_leaf_size=100, nr_splits=2)
    assert label_tree.chained_levels(P, 20000, 10000) == 2      # the root's split, then subtrees of 10000
    assert label_tree.chained_levels(P, 20001, 10000) == 3      # 10001 > 10000: one more split (5001, 5000)
    assert label_tree.chained_levels(P, 20000, 50) == 8         # within the leaf size first: the same as 0


def test_a_levels_groups_have_partitions_of_their_own(spark):
    """The (tree, node) groups of a level are numbered 0..n-1, and Spark's repartition by their
    keys sends group g to partition g mod min(n, cap) (so up to the cap, no two share a task)."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    from xmc_spark.arrow_utils import local_frame
    for T, B, level, cap in [(1, 2, 0, 8), (1, 2, 1, 8), (2, 3, 2, 64), (1, 2, 4, 8), (3, 2, 3, 5)]:
        n, first = T * B ** level, (B ** level - 1) // (B - 1)
        tree = np.repeat(np.arange(T), B ** level)
        node = np.tile(np.arange(first, first + B ** level), T)
        g = label_tree._group_index(B, level, tree, node)
        assert sorted(g.tolist()) == list(range(n))
        parts, keys = label_tree._level_parts(T, B, level, cap)
        assert parts == min(n, cap)
        got = (local_frame(spark, {"g": pa.array(g), "part": pa.array(keys[g % parts])}).repartition(parts, "part")
               .select("g", F.spark_partition_id().alias("p")).toPandas().sort_values("g"))
        np.testing.assert_array_equal(got["p"], np.sort(g) % parts)


def test_packed_batches_hold_the_rows_and_are_cut_by_non_zeros():
    """The tree stage's packing of an embeddings batch: the same rows (labels, CSR), cut where the
    running count of non-zeros passes a multiple of pack_nnz, a row never cut (rows of 2, 0, 4, 1, 2)."""
    import pyarrow as pa

    from xmc_spark.arrow_utils import csr_from_binary, csr_from_table, csr_rows_to_arrays
    M = sp.csr_matrix(np.array([[1, 0, 2, 0], [0, 0, 0, 0], [3, 4, 5, 6], [0, 7, 0, 0], [8, 0, 0, 9]], np.float32))
    idx, val = csr_rows_to_arrays(M)
    b = pa.RecordBatch.from_pydict({"label_idx": pa.array([4, 0, 3, 1, 2], pa.int32()), "emb_idx": idx, "emb_val": val})
    for pack_nnz, sizes in [(100, [5]), (3, [2, 1, 2]), (1, [2, 1, 1, 1])]:
        out = list(label_tree._packed(iter([b]), pack_nnz=pack_nnz))
        assert [o.num_rows for o in out] == sizes, pack_nnz
        t = pa.Table.from_batches(out)
        assert t.column("label_idx").to_pylist() == [4, 0, 3, 1, 2]
        assert (csr_from_binary(t, "emb_idx", "emb_val", 4) != csr_from_table(pa.Table.from_batches([b]),
                                                                               "emb_idx", "emb_val", 4)).nnz == 0
