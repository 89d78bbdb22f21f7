"""The per-node training stage equals the numpy trainer, with and without sample and label weights."""
import numpy as np
import pytest
import scipy.sparse as sp

from tests.stages.conftest import D, L, samples_frame
from xmc_spark.kernels.label_embedding import pifa
from xmc_spark.kernels.sparse import append_bias
from xmc_spark.kernels.tree import TreeIndex, build_tree
from xmc_spark.model import train_all_groups
from xmc_spark.params import TrainParams
from xmc_spark.schemas import check_table
from xmc_spark.stages import node_training


def _assert_weights(weights, ref_nodes, ref_slots):
    """The stage's weights table holds exactly the reference classifiers (node ids, slot ids)."""
    got = {(r["is_leaf"], r["key"]): (np.asarray(r["w_idx"]), np.asarray(r["w_val"]))
           for r in check_table(weights, "weights").collect()}
    ref = {**{(False, k): v for k, v in ref_nodes.items()}, **{(True, k): v for k, v in ref_slots.items()}}
    assert sorted(got) == sorted(ref)
    assert ref_nodes and ref_slots
    for key, (idx, val) in ref.items():
        np.testing.assert_array_equal(got[key][0], idx, err_msg=str(key))
        np.testing.assert_allclose(got[key][1], val, rtol=1e-6, err_msg=str(key))


@pytest.fixture(scope="module")
def index(problem):
    _, Xl, Yl = problem
    return TreeIndex(np.arange(L), build_tree(pifa(Xl, Yl), 4, 2, 20, 0), L, 2)


def test_training_stage_equals_kernel(problem, index):
    samples, Xl, Yl = problem
    tp = TrainParams()
    ref_nodes, ref_slots = train_all_groups(index, append_bias(Xl, tp.bias), Yl, tp)
    _assert_weights(node_training.run(samples, index, D, tp), ref_nodes, ref_slots)


def test_sample_and_label_weights_equal_kernel(problem, index, spark):
    _, Xl, Yl = problem
    rng = np.random.default_rng(0)
    Yw = sp.csr_matrix(Yl, dtype=np.float32, copy=True)
    Yw.data = rng.uniform(0.1, 1.0, Yw.nnz).astype(np.float32)        # EAGLE's soft label weights
    sw = rng.uniform(0.5, 2.0, Xl.shape[0]).astype(np.float32)
    tp = TrainParams(bias=0.5, threshold=0.05)
    samples = samples_frame(spark, Xl, Yw, label_weights=True, weights=sw)
    ref_nodes, ref_slots = train_all_groups(index, append_bias(Xl, tp.bias), Yw, tp, sw)
    plain_nodes, _ = train_all_groups(index, append_bias(Xl, tp.bias), Yl, tp)
    def dense(cols, k):
        v = np.zeros(D + 1)
        v[cols[k][0]] = cols[k][1]
        return v

    assert any(not np.allclose(dense(ref_nodes, k), dense(plain_nodes, k)) for k in ref_nodes)   # weights matter
    _assert_weights(node_training.run(samples, index, D, tp), ref_nodes, ref_slots)
