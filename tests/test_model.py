import json
import os
import re
import shutil
import stat

import numpy as np
import pytest

from tests.conftest import random_problem
from xmc_spark.kernels.squared_hinge import train_node
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
    other = [leaf for leaf in ix.leaves if leaf != ix.slot_leaf[ix.slot_label == 0][0]][0]
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


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    X, Y = random_problem(n=60, seed=2)
    m = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4))
    folder = tmp_path_factory.mktemp("saved") / "model"
    m.save(str(folder))
    return m, folder


@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o027, 0o750)])
def test_saved_folder_honours_the_umask(saved, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        saved[0].save(str(tmp_path / "m"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "m" / "param.json").stat().st_mode) == mode & 0o666
    assert [p.name for p in tmp_path.iterdir()] == ["m"]          # no temp folder left behind


def _copy(saved, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(saved[1], dst)
    return dst


def test_load_rejects_an_unknown_format_version(saved, tmp_path):
    m = _copy(saved, tmp_path)
    param = json.loads((m / "param.json").read_text())
    for version in (4, None):
        param["format_version"] = version
        (m / "param.json").write_text(json.dumps(param))
        with pytest.raises(ModelFormatError, match=re.escape(f"{m}: model format version {version!r}")):
            XMCModel.load(str(m))


@pytest.mark.parametrize("damage", ["missing", "truncated", "empty", "not_zip"])
@pytest.mark.parametrize("name", ["tree.npz", "weights_nodes.npz", "weights_slots.npz"])
def test_load_names_a_missing_or_damaged_npz(saved, tmp_path, name, damage):
    m = _copy(saved, tmp_path)
    f = m / name
    data = f.read_bytes()
    if damage == "missing":
        f.unlink()
    else:
        f.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "not_zip": b"x" * 100}[damage])
    with pytest.raises(ModelFormatError, match=re.escape(str(f))):
        XMCModel.load(str(m))


def test_load_names_a_npz_without_its_arrays(saved, tmp_path):
    m = _copy(saved, tmp_path)
    np.savez(m / "weights_nodes.npz", keys=np.zeros(1))
    with pytest.raises(ModelFormatError, match=re.escape(f"{m / 'weights_nodes.npz'}: missing array(s) indptr")):
        XMCModel.load(str(m))


@pytest.mark.parametrize("text,match", [
    ('{"model": "XMCModel", "format_ver', "not valid JSON"),
    ("\xff\xfe garbage", "not valid JSON"),
    ("[1, 2]", "model class is \\[1, 2\\]"),
    ('{"model": "XMCModel", "format_version": 1, "n_labels": 3}', "missing key\\(s\\) n_features, bias"),
])
def test_load_names_a_garbled_param_json(saved, tmp_path, text, match):
    m = _copy(saved, tmp_path)
    (m / "param.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ModelFormatError, match=re.escape(str(m / "param.json")) + ": " + match):
        XMCModel.load(str(m))


def test_chunked_folder_is_checked_part_by_part(tmp_path):
    from xmc_spark.kernels.sparse import l2_normalize_rows
    from xmc_spark.model import is_chunked, read_header
    X, Y = random_problem(n=80, seed=2)
    model = XMCModel.train_local(l2_normalize_rows(X), Y, tree=TreeParams(max_leaf_size=4))
    m = tmp_path / "m"
    model.save(str(m), parts=3)
    assert is_chunked(m) and not is_chunked(tmp_path)
    param, index, _ = read_header(m)
    assert param["weights"]["nbytes"] == 8 * (model.node_w.W.nnz + model.slot_w.W.nnz)
    part = m / param["weights"]["parts"][1]
    part.write_bytes(part.read_bytes()[:40])                        # truncated
    with pytest.raises(ModelFormatError, match=re.escape(f"{part}: unreadable, truncated")):
        read_header(m)
    with pytest.raises(ModelFormatError, match=re.escape(str(part))):
        XMCModel.load(str(m))
    part.unlink()
    with pytest.raises(ModelFormatError, match=re.escape(f"{part}: missing")):
        read_header(m)


# ---- ensembles and matcher-aware negatives --------------------------------------------------

def _ensemble(splits=(2, 3), **train):
    from xmc_spark.model import EnsembleModel, ModelTrainParams
    X, Y = random_problem(n=200, seed=11)
    tp = ModelTrainParams(TreeParams(max_leaf_size=3, ensemble_splits=list(splits)), TrainParams(**train))
    return EnsembleModel.train_local(X, Y, tp), X, Y


def test_ensemble_of_one_tree_is_the_tree():
    from xmc_spark.model import EnsembleModel
    X, Y = random_problem(n=200, seed=11)
    m = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=3))
    for b, k in ((10, 5), (2, 3), (1, 1)):
        a, sa = m.predict(X, beam_size=b, topk=k)
        e, se = EnsembleModel([m]).predict(X, beam_size=b, topk=k)
        np.testing.assert_array_equal(a, e)
        np.testing.assert_allclose(sa, se, rtol=1e-12)


def test_ensemble_score_is_the_mean_of_each_trees_scores():
    e, X, Y = _ensemble()
    assert [m.index.B for m in e.models] == [2, 3]
    assert len({tuple(m.index.slot_leaf) for m in e.models}) == 2     # different trees
    L = Y.shape[1]
    for b in (1, 3):
        per_tree = []
        for m in e.models:                       # each tree alone, every label its beam reaches
            lab, sc = m.predict(X, beam_size=b, topk=L)
            dense = np.zeros((X.shape[0], L))
            ok = lab >= 0
            dense[np.nonzero(ok)[0], lab[ok]] = sc[ok]
            per_tree.append(dense)
        mean = np.mean(per_tree, axis=0)
        np.testing.assert_allclose(e.label_scores(X, beam_size=b).toarray(), mean, rtol=1e-12)
        labels, scores = e.predict(X, beam_size=b, topk=4)
        for i in range(X.shape[0]):
            nz = np.flatnonzero(mean[i])
            want = nz[np.lexsort((nz, -mean[i, nz]))][:4]
            np.testing.assert_array_equal(labels[i, :len(want)], want)
            np.testing.assert_allclose(scores[i, :len(want)], mean[i, want], rtol=1e-12)


def test_ensemble_save_load_round_trip_and_checks(tmp_path):
    e, X, Y = _ensemble()
    e.label_counts = np.asarray(Y.sum(axis=0)).ravel()
    e.save(str(tmp_path / "m"))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["param.json", "tree-0", "tree-1"]
    e2 = XMCModel.load(str(tmp_path / "m"))
    assert type(e2).__name__ == "EnsembleModel"
    for (a, sa), (b, sb) in zip([e.predict(X)], [e2.predict(X)]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(sa, sb)
    np.testing.assert_array_equal(e2.label_counts, e.label_counts)
    shutil.rmtree(tmp_path / "m" / "tree-1")
    with pytest.raises(ModelFormatError, match="tree-1"):
        XMCModel.load(str(tmp_path / "m"))


def test_tfn_man_adds_exactly_the_matchers_routed_samples():
    from xmc_spark.kernels.sparse import append_bias
    from xmc_spark.kernels.tree import TreeIndex
    from xmc_spark.model import KeyedColumns, train_all_groups
    # hand-made tree: root -> 1 (labels 0, 1), 2 (label 2); two features + bias
    ix = TreeIndex([0, 1, 2], [1, 1, 2], 3, 2)
    X = sp_rows([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.7, 0.7]])
    Y = sp_rows([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 1], [0, 0, 0]])
    tp = TrainParams(threshold=0.0)
    Xb = append_bias(X, tp.bias)
    # groups: teacher forcing sends rows 0, 1 to node 1 and rows 2, 3 to node 2
    rows, groups = ix.groups_of_samples(Y.indptr, Y.indices)
    assert set(zip(rows.tolist(), groups.tolist())) == {(r, 0) for r in range(5)} | {(0, 1), (1, 1), (2, 2), (3, 2)}
    nodes, slots = train_all_groups(ix, Xb, Y, tp)
    m = XMCModel(ix, KeyedColumns.from_dict(nodes, 3), KeyedColumns.from_dict(slots, 3), 2)
    r, g = m.beam_nodes(X, beam_size=1)               # the one node each row's beam of 1 keeps
    routed = dict(zip(r.tolist(), g.tolist()))
    assert routed == {0: 1, 1: 1, 2: 2, 3: 2, 4: routed[4]} and routed[4] in (1, 2)
    nodes2, slots2 = train_all_groups(ix, Xb, Y, tp, extra=(r, g))
    # only the leaf that row 4 reached changes: row 4 is a new negative of its slots
    changed = 0 if routed[4] == 1 else 2
    for s in range(3):
        same = np.allclose(slots[s][1], slots2[s][1]) and np.array_equal(slots[s][0], slots2[s][0])
        assert same == (ix.slot_leaf[s] != ix.leaves[changed // 2]), s
    only = Y[[0, 1, 4] if routed[4] == 1 else [2, 3, 4]]
    kids, Yg = ix.node_problem(routed[4], only.indptr, only.indices)
    W = train_node(Xb[[0, 1, 4] if routed[4] == 1 else [2, 3, 4]], Yg, C=tp.C, threshold=0.0, eps=tp.eps,
                   max_iter=tp.max_iter, seed=tp.seed + routed[4])
    for j, s in enumerate(kids):
        np.testing.assert_allclose(slots2[int(s)][1], W[:, j].toarray().ravel()[slots2[int(s)][0]], rtol=1e-6)
    # the reference trainer with train.negatives = tfn+man is exactly this
    from xmc_spark.model import ModelTrainParams
    local = XMCModel.train_local(X, Y, ModelTrainParams(TreeParams(max_leaf_size=2), TrainParams(negatives="tfn+man")))
    base = XMCModel.train_local(X, Y, ModelTrainParams(TreeParams(max_leaf_size=2), TrainParams()))
    n2, s2 = train_all_groups(base.index, append_bias(X, 1.0), Y, TrainParams(), extra=base.beam_nodes(X, 10))
    np.testing.assert_allclose(local.slot_w.W.toarray(), KeyedColumns.from_dict(s2, 3).W.toarray())


def sp_rows(rows):
    import scipy.sparse as sp
    return sp.csr_matrix(np.asarray(rows, dtype=np.float32))


def test_ensemble_beam_nodes_are_each_trees_sorted_by_row():
    from xmc_spark.kernels.tree import decode_keys
    e, X, _ = _ensemble()
    rows, keys = e.beam_nodes(X, beam_size=2)
    assert np.all(np.diff(rows) >= 0)
    tree, ids = decode_keys(keys)
    for t, m in enumerate(e.models):
        r, g = m.beam_nodes(X, beam_size=2)
        assert set(zip(rows[tree == t].tolist(), ids[tree == t].tolist())) == set(zip(r.tolist(), g.tolist()))


# ---- the weights held once: column runs as views, a pickle without the derived layers ----------

def test_select_of_consecutive_keys_is_a_view_equal_to_the_copy():
    import scipy.sparse as sp

    from xmc_spark.model import KeyedColumns
    W = sp.random(6, 5, density=0.6, format="csc", dtype=np.float32, random_state=1)
    dense = W.toarray()
    kc = KeyedColumns(np.array([2, 5, 7, 9, 11]), W)
    run = kc.select(np.array([5, 7, 9]))
    assert np.shares_memory(run.data, W.data) and np.shares_memory(run.indices, W.indices)
    np.testing.assert_array_equal(run.toarray(), dense[:, 1:4])
    for keys, cols in (([9, 5], [3, 1]), ([5, 9], [1, 3])):
        got = kc.select(np.array(keys))
        assert not np.shares_memory(got.data, W.data)
        np.testing.assert_array_equal(got.toarray(), dense[:, cols])
    for keys, cols in (([5, 6, 7], [1, None, 2]), ([1, 5, 6, 7, 8], [None, 1, None, 2, None]),
                       ([4, 11, 12], [None, 4, None])):   # keys without a column: empty ones in a view
        got = kc.select(np.array(keys))
        assert np.shares_memory(got.data, W.data)
        want = np.stack([dense[:, c] if c is not None else np.zeros(6) for c in cols], 1)
        np.testing.assert_array_equal(got.toarray(), want)
    wide = KeyedColumns(kc.keys, sp.csc_matrix(W))
    wide.W.indices, wide.W.indptr = W.indices.astype(np.int64), W.indptr.astype(np.int64)
    got = wide.select(np.array([1, 5, 7]))       # int64 indices: a view in W's own index type
    assert np.shares_memory(got.indices, wide.W.indices) and got.indptr.dtype == np.int64
    np.testing.assert_array_equal(got.toarray(), np.stack([np.zeros(6), dense[:, 1], dense[:, 2]], 1))
    got = kc.select(np.array([5, 6, 9]))          # 7 skipped: not a run, a copy
    assert not np.shares_memory(got.data, W.data)
    np.testing.assert_array_equal(got.toarray(), np.stack([dense[:, 1], np.zeros(6), dense[:, 3]], 1))


def test_a_pickled_model_carries_its_weights_once_and_predicts_the_same():
    import pickle
    X, Y = random_problem(n=300, seed=3)
    m = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4))
    bare = len(pickle.dumps(m))
    a, sa = m.predict(X)                           # builds the search layers
    layers, _ = m.layers()
    views = [np.shares_memory(W.data, m.node_w.W.data) for _, W, through in layers[:-1] if not through.any()]
    assert views and all(views)                    # a balanced layer is a run of the node columns
    blob = pickle.dumps(m)
    assert len(blob) <= bare + 64                  # the layers are not shipped beside the weights
    m2 = pickle.loads(blob)
    assert m2._layers is None
    b, sb = m2.predict(X)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sa, sb)
    np.testing.assert_array_equal(m2.match_leaves(X)[0], m.match_leaves(X)[0])


@pytest.mark.parametrize("leaf", [4, 3])          # all leaves at one depth; leaves at two depths (padded)
def test_searches_leave_the_stored_weights_as_they_were(leaf):
    """The layers are views of the stored weights where they can be: no search may change them."""
    X, Y = random_problem(n=300, seed=3)
    m = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=leaf))
    before = [(w.W.data.copy(), w.W.indices.copy(), w.W.indptr.copy()) for w in (m.node_w, m.slot_w)]
    m.predict(X)
    m.predict(X, search="tree")
    m.predict(X, search="adaptive")
    m.match_leaves(X)
    m.beam_nodes(X)
    for w, (d, i, p) in zip((m.node_w, m.slot_w), before):
        np.testing.assert_array_equal(w.W.data, d)
        np.testing.assert_array_equal(w.W.indices, i)
        np.testing.assert_array_equal(w.W.indptr, p)
