import numpy as np
import pytest

from tests.conftest import random_problem
from xmc_spark.model import ModelFormatError, XMCModel
from xmc_spark.params import TrainParams, TreeParams


def test_save_load_round_trip(tmp_path):
    X, Y = random_problem()
    m = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4))
    m.label_counts = np.asarray(Y.sum(axis=0)).ravel()
    m.save(str(tmp_path / "model"))
    m2 = XMCModel.load(str(tmp_path / "model"))
    a, sa = m.predict(X)
    b, sb = m2.predict(X)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sa, sb)
    np.testing.assert_array_equal(m2.label_counts, m.label_counts)
    m.save(str(tmp_path / "model"))  # overwrite in place is fine
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [
        "param.json", "tree.npz", "weights_nodes.npz", "weights_slots.npz"]


def test_load_rejects_other_folders(tmp_path):
    with pytest.raises(ModelFormatError):
        XMCModel.load(str(tmp_path))
    (tmp_path / "param.json").write_text('{"model": "Other"}')
    with pytest.raises(ModelFormatError, match="Other"):
        XMCModel.load(str(tmp_path))


def test_reference_trainer_learns_a_learnable_problem():
    X, Y = random_problem(n=300, seed=3)
    m = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4), train=TrainParams(threshold=0.0))
    labels, _ = m.predict(X, topk=1)
    Yd = np.asarray(Y.todense())
    has = Yd.sum(axis=1) > 0
    p1 = Yd[np.arange(len(labels)), labels[:, 0]][has].mean()
    assert p1 > 0.8


def test_overlapping_slots_train_and_predict_without_duplicates(tmp_path):
    from xmc_spark.kernels.sparse import append_bias
    from xmc_spark.kernels.tree import TreeIndex
    from xmc_spark.model import KeyedColumns, train_all_groups

    X, Y = random_problem(n=200, seed=5)
    base = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4))
    ix = base.index
    # put label 0 into a second leaf as well
    other = [l for l in ix.leaves if l != ix.slot_leaf[ix.slot_label == 0][0]][0]
    index = TreeIndex(np.append(ix.slot_label, 0), np.append(ix.slot_leaf, other), ix.n_labels, 2)
    tp = TrainParams()
    nodes, slots = train_all_groups(index, append_bias(X, 1.0), Y, tp)
    assert sum(1 for s in slots if index.slot_label[s] == 0) == 2   # two weight vectors for label 0
    m = XMCModel(index, KeyedColumns.from_dict(nodes, X.shape[1] + 1), KeyedColumns.from_dict(slots, X.shape[1] + 1),
                 X.shape[1])
    labels, _ = m.predict(X, beam_size=10, topk=12)
    assert all(len(set(r[r >= 0])) == (r >= 0).sum() for r in labels)
    m.save(str(tmp_path / "m"))
    np.testing.assert_array_equal(XMCModel.load(str(tmp_path / "m")).predict(X)[0], m.predict(X)[0])
