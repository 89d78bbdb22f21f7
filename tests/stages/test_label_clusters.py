"""Overlapping clusters on Spark: the matcher table equals the model's leaf matching, the
top-copies projection of Y^T M equals the kernel on the same counts."""
import numpy as np
import pytest
import scipy.sparse as sp
from chispa import assert_df_equality

from tests.stages.conftest import L, N
from xmc_spark.kernels.topk_projection import topk_projection
from xmc_spark.model import XMCModel
from xmc_spark.params import TreeParams
from xmc_spark.schemas import check_table, ddl
from xmc_spark.stages import label_clusters


@pytest.fixture(scope="module")
def matched(problem):
    samples, Xl, Yl = problem
    model = XMCModel.train_local(Xl, Yl, tree=TreeParams(max_leaf_size=3))
    return model, check_table(label_clusters.matcher(samples, model, beam_size=2), "matcher").cache()


def test_matcher_equals_model_leaf_matching(problem, matched, spark):
    _, Xl, _ = problem
    model, got = matched
    leaves, scores = model.match_leaves(Xl, beam_size=2)
    ok = leaves >= 0
    assert ok.all() and len(np.unique(leaves)) > 2
    rows = [(i, int(lf), float(s)) for i in range(N) for lf, s in zip(leaves[i], scores[i])]
    expected = spark.createDataFrame(rows, ddl("matcher"))
    assert_df_equality(got.select("sample_id", "leaf"), expected.select("sample_id", "leaf"),
                       ignore_row_order=True, ignore_nullable=True)
    by_pair = {(r["sample_id"], r["leaf"]): r["score"] for r in got.collect()}
    np.testing.assert_allclose([by_pair[(i, lf)] for i, lf, _ in rows], [s for _, _, s in rows], rtol=1e-6)


@pytest.mark.parametrize("copies", [1, 2])
def test_projection_equals_kernel(problem, matched, spark, copies):
    samples, _, Yl = problem
    model, got_matched = matched
    pairs = [(r["sample_id"], r["leaf"]) for r in got_matched.collect()]
    ix = model.index
    current = spark.createDataFrame([(int(a), int(b)) for a, b in zip(ix.slot_label, ix.slot_leaf)], ddl("slots"))
    got = label_clusters.project(samples, got_matched, current, copies, n_buckets=3)
    Mm = sp.csr_matrix((np.ones(len(pairs)), ([i for i, _ in pairs], [lf for _, lf in pairs])),
                       shape=(N, max(lf for _, lf in pairs) + 1))
    YtM = (Yl.T @ Mm).tocoo()
    lab, leaf = topk_projection(YtM.row, YtM.col, YtM.data, copies, ix.slot_label, ix.slot_leaf)
    expected = spark.createDataFrame([(int(a), int(b), 0) for a, b in zip(lab, leaf)], ddl("clusters") + ", tree int")
    assert_df_equality(check_table(got, "clusters"), expected, ignore_row_order=True, ignore_nullable=True)
    per_label = np.bincount(lab, minlength=L)
    assert set(lab.tolist()) == set(range(L)) and per_label.max() == copies
