"""Each Spark stage agrees with its numpy kernel on tiny inputs."""
import numpy as np
import pytest
import scipy.sparse as sp

from tests.conftest import random_problem, write_xc
from xmc_spark.arrow_utils import to_arrow
from xmc_spark.kernels import metrics as M
from xmc_spark.kernels.label_embedding import pifa
from xmc_spark.kernels.sparse import append_bias
from xmc_spark.kernels import frequencies as FQ
from xmc_spark.kernels.tree import TreeIndex, build_tree, tree_from_params
from xmc_spark.local_io import read_xc
from xmc_spark.model import XMCModel, train_all_groups
from xmc_spark.params import EmbeddingParams, EvalParams, IngestParams, TrainParams, TreeParams
from xmc_spark.pipeline import weights_to_columns
from xmc_spark.stages import (evaluation, ingest, label_embedding, label_frequencies, label_tree, node_training,
                               prediction)
from xmc_spark.storage import read_delta


def _to_csr(rows, idx, val, n_cols, id_col="sample_id"):
    rows = sorted(rows, key=lambda r: r[id_col])
    data = [np.asarray(r[val], np.float32) if val else np.ones(len(r[idx]), np.float32) for r in rows]
    ind = [np.asarray(r[idx], np.int32) for r in rows]
    ptr = np.concatenate([[0], np.cumsum([len(i) for i in ind])])
    m = sp.csr_matrix((np.concatenate(data), np.concatenate(ind), ptr), shape=(len(rows), n_cols))
    m.sort_indices()
    return m


@pytest.fixture(scope="module")
def problem(tmp_path_factory, spark):
    d = tmp_path_factory.mktemp("stages")
    X, Y = random_problem(n=150, d=40, L=14, seed=7)
    write_xc(d / "train.txt", X, Y)
    info = ingest.run(spark, str(d / "train.txt"), str(d / "train_tbl"), IngestParams())
    Xl, Yl = read_xc(str(d / "train.txt"))
    return d, info, Xl, Yl


def test_ingest_equals_local_reader(problem, spark):
    d, info, Xl, Yl = problem
    assert (info.n_samples, info.n_features, info.n_labels) == (150, 40, 14)
    rows = read_delta(spark, str(d / "train_tbl")).collect()
    X = _to_csr(rows, "feature_idx", "feature_val", 40)
    Y = _to_csr(rows, "label_idx", None, 14)
    np.testing.assert_allclose(X.toarray(), Xl.toarray(), rtol=1e-6)
    np.testing.assert_array_equal(Y.toarray(), Yl.toarray())
    assert [r["sample_id"] for r in sorted(rows, key=lambda r: r["sample_id"])] == list(range(150))


def test_pifa_stage_equals_kernel(problem, spark):
    d, info, Xl, Yl = problem
    emb = label_embedding.run(read_delta(spark, str(d / "train_tbl")), 40, 14, EmbeddingParams(), n_buckets=3)
    Z = _to_csr(emb.collect(), "emb_idx", "emb_val", 40, id_col="label_idx")
    np.testing.assert_allclose(Z.toarray(), pifa(Xl, Yl).toarray(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("local", [0, 6])
def test_tree_stage_equals_kernel(problem, spark, local):
    d, info, Xl, Yl = problem
    params = TreeParams(max_leaf_size=3, nr_splits=2, seed=4, local_subtree_size=local)
    emb = label_embedding.run(read_delta(spark, str(d / "train_tbl")), 40, 14, EmbeddingParams(), n_buckets=2)
    tree = label_tree.run(emb, 14, 40, params).toPandas().sort_values("label_idx")
    ref = build_tree(pifa(Xl, Yl), params.max_leaf_size, params.nr_splits, params.max_iter, params.seed)
    np.testing.assert_array_equal(tree["node"].to_numpy(), ref)
    params3 = TreeParams(max_leaf_size=2, nr_splits=3, seed=1, local_subtree_size=local)
    tree3 = label_tree.run(emb, 14, 40, params3).toPandas().sort_values("label_idx")
    ref3 = build_tree(pifa(Xl, Yl), 2, 3, params3.max_iter, 1)
    np.testing.assert_array_equal(tree3["node"].to_numpy(), ref3)


@pytest.mark.parametrize("method", ["marginal", "greedy"])
def test_frequency_stage_equals_kernel(problem, spark, method):
    d, info, Xl, Yl = problem
    Yl = sp.csr_matrix(Yl)
    f, ft, finfo = label_frequencies.run(read_delta(spark, str(d / "train_tbl")).repartition(3), 14,
                                         TreeParams(f_tilde=method, greedy_candidates=2))
    rf, rft = FQ.label_frequencies(Yl.indptr, Yl.indices, 14, method)
    np.testing.assert_allclose(f, rf)
    np.testing.assert_allclose(ft, rft)
    assert ft.sum() == (np.diff(Yl.indptr) > 0).sum()
    if method == "greedy":
        assert finfo["greedy_rounds"] >= 1


@pytest.mark.parametrize("lam", [0.5, 2.0])
def test_interpolated_tree_stage_equals_kernel(problem, spark, lam):
    d, info, Xl, Yl = problem
    Yl = sp.csr_matrix(Yl)
    params = TreeParams(max_leaf_size=2, lam=lam, seed=2, local_subtree_size=0 if lam < 2 else 5)
    emb = label_embedding.run(read_delta(spark, str(d / "train_tbl")), 40, 14, EmbeddingParams(), n_buckets=2)
    f, ft = FQ.label_frequencies(Yl.indptr, Yl.indices, 14, "marginal")
    tree = label_tree.run(emb, 14, 40, params, f, ft).toPandas().sort_values("label_idx")
    ref = tree_from_params(pifa(Xl, Yl), params, f, ft)
    np.testing.assert_array_equal(tree["node"].to_numpy(), ref)
    with pytest.raises(ValueError, match="frequencies"):
        label_tree.run(emb, 14, 40, params)


def test_training_stage_equals_kernel(problem, spark):
    d, info, Xl, Yl = problem
    leaf = build_tree(pifa(Xl, Yl), 4, 2, 20, 0)
    index = TreeIndex(np.arange(14), leaf, 14, 2)
    tp = TrainParams()
    w = node_training.run(read_delta(spark, str(d / "train_tbl")), index, 40, tp)
    node_w, slot_w = weights_to_columns(to_arrow(w), 41)
    ref_nodes, ref_slots = train_all_groups(index, append_bias(Xl, tp.bias), Yl, tp)
    assert sorted(ref_nodes) == list(node_w.keys) and sorted(ref_slots) == list(slot_w.keys)
    for k, (i, v) in ref_slots.items():
        col = slot_w.select([k])
        np.testing.assert_array_equal(col.indices, i)
        np.testing.assert_allclose(col.data, v, rtol=1e-6)


def test_prediction_and_evaluation_stages_equal_kernels(problem, spark):
    d, info, Xl, Yl = problem
    model = XMCModel.train_local(Xl, Yl, tree=TreeParams(max_leaf_size=4))
    test = read_delta(spark, str(d / "train_tbl"))
    preds = prediction.run(test, model, beam_size=3, topk=4)
    rows = sorted(preds.collect(), key=lambda r: r["sample_id"])
    labels, scores = model.predict(Xl, beam_size=3, topk=4)
    for r, lab, sc in zip(rows, labels, scores):
        assert list(r["pred_labels"]) == [int(x) for x in lab if x >= 0]
        np.testing.assert_allclose(r["pred_scores"], sc[lab >= 0], rtol=1e-5)
    counts = np.asarray(Yl.sum(axis=0)).ravel()
    got = evaluation.run(preds, test, counts, 150, EvalParams(), label_depth=model.label_depth())
    inv = 1 / M.propensities(counts, 150)
    ref = M.evaluate(labels, Yl, inv, (1, 3, 5))
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, abs=1e-9), k


def test_overlap_projection_stage_equals_kernel(problem, spark):
    from xmc_spark.kernels.topk_projection import topk_projection
    from xmc_spark.stages import label_clusters

    d, info, Xl, Yl = problem
    model = XMCModel.train_local(Xl, Yl, tree=TreeParams(max_leaf_size=3))
    samples = read_delta(spark, str(d / "train_tbl"))
    matched = label_clusters.matcher(samples, model, beam_size=2).toPandas().sort_values(["sample_id", "leaf"])
    leaves, _ = model.match_leaves(Xl, beam_size=2)
    ref = sorted((i, int(l)) for i, row in enumerate(leaves) for l in row if l >= 0)
    assert sorted(zip(matched["sample_id"], matched["leaf"])) == ref
    ix = model.index
    current = spark.createDataFrame([(int(a), int(b)) for a, b in zip(ix.slot_label, ix.slot_leaf)],
                                    "label_idx int, node long")
    for lam in (1, 2):
        got = label_clusters.project(samples, spark.createDataFrame(matched), current, lam, n_buckets=3).toPandas()
        M = sp.csr_matrix((np.ones(len(ref)), ([r for r, _ in ref], [l for _, l in ref])),
                          shape=(150, int(max(l for _, l in ref)) + 1))
        YtM = (Yl.T @ M).tocoo()
        lab, leaf = topk_projection(YtM.row, YtM.col, YtM.data, lam, ix.slot_label, ix.slot_leaf)
        assert sorted(zip(got["label_idx"], got["node"])) == sorted(zip(lab.tolist(), leaf.tolist()))
        assert set(got["label_idx"]) == set(range(14))
