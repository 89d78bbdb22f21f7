import numpy as np
import scipy.sparse as sp

from tests.oracles import exhaustive_scores
from xmc_spark.kernels.tree import TreeIndex
from xmc_spark.model import KeyedColumns, XMCModel


def _random_model(seed=0, L=20, d=15, leaf_size=3, overlap=False):
    rng = np.random.default_rng(seed)
    from xmc_spark.kernels.tree import build_tree
    Z = sp.random(L, d, density=0.5, random_state=seed, format="csr")
    leaf = build_tree(Z, max_leaf_size=leaf_size, nr_splits=2, seed=seed)
    labels = np.arange(L)
    if overlap:  # a few labels also live in a second leaf
        extra = rng.choice(L, 5, replace=False)
        other = rng.choice(np.unique(leaf), 5)
        keep = other != leaf[extra]
        labels = np.concatenate([labels, extra[keep]])
        leaf = np.concatenate([leaf, other[keep]])
    index = TreeIndex(labels, leaf, L, 2)
    node_cols = {int(n): (np.arange(d + 1), rng.normal(0, 1, d + 1)) for n in index.nodes if n != 0}
    slot_cols = {s: (np.arange(d + 1), rng.normal(0, 1, d + 1)) for s in range(len(index.slot_label))}
    m = XMCModel(index, KeyedColumns.from_dict(node_cols, d + 1), KeyedColumns.from_dict(slot_cols, d + 1), d)
    X = sp.random(30, d, density=0.5, random_state=seed + 1, format="csr", dtype=np.float32)
    return m, X


def test_full_beam_equals_exhaustive_scoring():
    m, X = _random_model()
    layers, order = m.layers()
    Xb = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")
    E = exhaustive_scores(Xb, layers, m.index.slot_label[order], m.n_labels)
    labels, scores = m.predict(X, beam_size=1000, topk=5)
    top = np.argsort(-E, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(labels, top)
    np.testing.assert_allclose(scores, np.take_along_axis(E, top, axis=1), rtol=1e-5)


def test_narrow_beam_scores_are_true_path_scores():
    m, X = _random_model(1)
    layers, order = m.layers()
    Xb = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")
    E = exhaustive_scores(Xb, layers, m.index.slot_label[order], m.n_labels)
    labels, scores = m.predict(X, beam_size=1, topk=3)
    ok = labels >= 0
    np.testing.assert_allclose(scores[ok], np.take_along_axis(E, np.maximum(labels, 0), axis=1)[ok], rtol=1e-5)
    assert np.all(np.diff(scores, axis=1)[ok[:, 1:]] <= 1e-12)


def test_overlapping_label_scores_are_averaged():
    m, X = _random_model(2, overlap=True)
    layers, order = m.layers()
    Xb = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")
    E = exhaustive_scores(Xb, layers, m.index.slot_label[order], m.n_labels)
    labels, scores = m.predict(X, beam_size=1000, topk=m.n_labels)
    assert all(len(set(r[r >= 0])) == (r >= 0).sum() for r in labels)  # no duplicates
    np.testing.assert_allclose(scores, np.take_along_axis(E, labels, axis=1), rtol=1e-5)


def test_hand_built_two_level_tree():
    # root -> nodes 1, 2; node 1 holds labels 0, 1; node 2 holds label 2. One feature + bias.
    index = TreeIndex([0, 1, 2], [1, 1, 2], 3, 2)
    node = KeyedColumns.from_dict({1: ([0], [2.0]), 2: ([0], [-2.0])}, 2)
    slot = KeyedColumns.from_dict({0: ([0], [1.0]), 1: ([1], [0.5]), 2: ([0], [3.0])}, 2)
    m = XMCModel(index, node, slot, 1, bias=1.0)
    X = sp.csr_matrix(np.array([[1.0]], dtype=np.float32))
    labels, scores = m.predict(X, beam_size=2, topk=3)
    f = lambda v: np.exp(-max(0.0, 1 - v) ** 3)  # noqa: E731
    expect = {0: f(2) * f(1), 1: f(2) * f(0.5), 2: f(-2) * f(3)}
    order = sorted(expect, key=lambda k: -expect[k])
    np.testing.assert_array_equal(labels[0], order)
    np.testing.assert_allclose(scores[0], [expect[k] for k in order])


def test_match_leaves_equals_leaf_level_exhaustive_scores():
    m, X = _random_model(3)
    layers, order = m.layers()
    leaves, scores = m.match_leaves(X, beam_size=1000)
    Xb = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")
    inner = layers[:-1]
    E = exhaustive_scores(Xb, inner, np.arange(inner[-1][1].shape[1]), inner[-1][1].shape[1])
    best = np.argmax(E, axis=1)
    assert np.all(leaves[:, 0] == m._last_leaf[best])
    assert set(np.unique(leaves[leaves >= 0])) <= set(m.index.leaves)


def test_dense_weights_sparse_inputs_use_the_search_path_correctly():
    # weight columns with ~400 non-zeros against rows with a handful: the binary-search dot product
    m, _ = _random_model(4, L=12, d=400)
    X = sp.random(40, 400, density=0.01, random_state=9, format="csr", dtype=np.float32)
    layers, order = m.layers()
    Xb = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")
    E = exhaustive_scores(Xb, layers, m.index.slot_label[order], m.n_labels)
    labels, scores = m.predict(X, beam_size=1000, topk=4)
    np.testing.assert_allclose(scores, np.sort(E, axis=1)[:, ::-1][:, :4], rtol=1e-5)


def _unbalanced_model(seed=0, L=40, d=12):
    """A Fano-like tree: leaves at many depths."""
    from xmc_spark.kernels.tree import build_tree
    rng = np.random.default_rng(seed)
    Z = sp.random(L, d, density=0.5, random_state=seed, format="csr")
    f = np.sort(rng.pareto(1.0, L))[::-1] + 0.01
    leaf = build_tree(Z, max_leaf_size=3, lam=1.6, f=f, f_tilde=f, seed=seed)
    index = TreeIndex(np.arange(L), leaf, L, 2)
    node_cols = {int(n): (np.arange(d + 1), rng.normal(0, 1, d + 1)) for n in index.nodes if n != 0}
    slot_cols = {s: (np.arange(d + 1), rng.normal(0, 1, d + 1)) for s in range(L)}
    m = XMCModel(index, KeyedColumns.from_dict(node_cols, d + 1), KeyedColumns.from_dict(slot_cols, d + 1), d)
    X = sp.random(40, d, density=0.5, random_state=seed + 1, format="csr", dtype=np.float32)
    return m, X


def test_tree_search_equals_layered_on_balanced_tree():
    for seed in range(3):
        m, X = _random_model(seed, L=32, leaf_size=4)      # 32 labels / 4 = 8 leaves, all at depth 3
        for b in (1, 2, 4):
            a = m.predict(X, beam_size=b, topk=3)
            t = m.predict(X, beam_size=b, topk=3, search="tree")
            np.testing.assert_array_equal(a[0], t[0])
            np.testing.assert_allclose(a[1], t[1], rtol=1e-9)


def test_adaptive_search_is_exact_and_does_less_work():
    for seed in range(4):
        m, X = _unbalanced_model(seed)
        assert len(set(m.index.slot_depth)) > 2
        layers, order = m.layers()
        Xb = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")
        E = exhaustive_scores(Xb, layers, m.index.slot_label[order], m.n_labels)
        top = np.argsort(-E, axis=1, kind="stable")[:, :3]
        full = m.predict(X, beam_size=1000, topk=3, search="tree", return_work=True)
        ada = m.predict(X, beam_size=1000, topk=3, search="adaptive", return_work=True)
        for lab, sc, _ in (full, ada):
            np.testing.assert_array_equal(lab, top)
            np.testing.assert_allclose(sc, np.take_along_axis(E, top, axis=1), rtol=1e-9)
        n_classifiers = len(m.index.nodes) - 1 + m.n_labels
        assert np.all(full[2] == n_classifiers)
        assert np.all(ada[2] <= full[2]) and ada[2].sum() < full[2].sum()
        # a narrow beam: pruning never removes a label the same beam without pruning keeps
        t = m.predict(X, beam_size=2, topk=3, search="tree")
        a = m.predict(X, beam_size=2, topk=3, search="adaptive")
        assert np.all(a[1][:, 0] >= t[1][:, 0] - 1e-12)


def test_tree_search_with_overlapping_slots_and_single_leaf():
    m, X = _random_model(2, overlap=True)
    lab, sc = m.predict(X, beam_size=1000, topk=m.n_labels, search="tree")
    ref = m.predict(X, beam_size=1000, topk=m.n_labels)
    np.testing.assert_array_equal(lab, ref[0])
    np.testing.assert_allclose(sc, ref[1], rtol=1e-9)
    m1, X1 = _random_model(3, L=4, leaf_size=10)            # the root is the only leaf
    assert m1.index.depth == 0
    np.testing.assert_array_equal(m1.predict(X1, topk=2, search="adaptive")[0], m1.predict(X1, topk=2)[0])


def _brute_beam_nodes(m, X, b):
    """Every (row, node) of the beam at every depth, by a plain Python beam over dense scores."""
    layers, _ = m.layers()
    Xb = np.hstack([X.toarray(), np.ones((X.shape[0], 1))])
    pairs = set()
    for i in range(X.shape[0]):
        beam = [(0, 1.0)]
        for t, (child_ptr, W, through) in enumerate(layers[:-1]):
            Wd = W.toarray()
            cand = []
            for p, s in beam:
                for c in range(child_ptr[p], child_ptr[p + 1]):
                    f = 1.0 if through[c] else np.exp(-max(0.0, 1.0 - float(Xb[i] @ Wd[:, c])) ** 3)
                    cand.append((c, s * f))
            cand.sort(key=lambda z: -z[1])            # stable: ties keep the candidates' order
            beam = cand[:b]
            ids, _, pad = m._shape.layers[t]
            pairs |= {(i, int(ids[c])) for c, _ in beam if not pad[c]}
    return pairs


def test_beam_nodes_are_the_beam_at_every_depth():
    for seed, b in ((5, 1), (6, 2), (7, 3)):
        m, X = _random_model(seed, L=24, leaf_size=2)
        rows, nodes = m.beam_nodes(X, beam_size=b)
        assert set(zip(rows.tolist(), nodes.tolist())) == _brute_beam_nodes(m, X, b)
        assert set(nodes.tolist()) <= set(m.index.nodes.tolist()) and 0 not in set(nodes.tolist())


def test_top_k_rows_equals_sorting_each_row():
    from xmc_spark.kernels.beam_search import top_k_rows
    rng = np.random.default_rng(0)
    S = sp.random(40, 30, density=0.2, random_state=1, format="csr")
    S.data = rng.choice([0.1, 0.5, 0.9], S.nnz)                   # many ties: the smaller label first
    labels, scores = top_k_rows(S, 4)
    D = S.toarray()
    for i in range(40):
        nz = np.flatnonzero(D[i])
        want = nz[np.lexsort((nz, -D[i, nz]))][:4]
        np.testing.assert_array_equal(labels[i, :len(want)], want)
        assert (labels[i, len(want):] == -1).all()
        np.testing.assert_allclose(scores[i, :len(want)], D[i, want])


def test_layer_blocks_give_every_childs_dot_product_to_the_last_bit():
    """The layered search scores a node's children from its feature-major block
    (layer_blocks + _children_margins); each margin must equal the column-wise dot product
    (_dot, which the tree search uses) bit for bit, for wide and narrow columns, parents
    without any weight, a single child, and float32 as well as float64 weights."""
    import gc

    from xmc_spark.kernels import beam_search as bs
    rng = np.random.default_rng(3)
    d = 300
    sizes = np.array([1, 5, 0, 3, 7, 2])                   # children per parent; one parent has none
    child_ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    K = int(child_ptr[-1])
    dens = rng.choice([0.005, 0.05, 0.8], K)               # columns far sparser and far denser than x
    cols = [sp.random(d, 1, density=float(p), random_state=int(s), format="csc")
            for s, p in zip(rng.integers(0, 10**6, K), dens)]
    cols[3] = sp.csc_matrix((d, 1))                         # an all-zero column
    X = sp.random(50, d, density=0.06, random_state=4, format="csr", dtype=np.float32)
    for dtype in (np.float32, np.float64):
        W = sp.hstack(cols, format="csc").astype(dtype)
        W.sort_indices()
        blocks = bs.layer_blocks(W, child_ptr)
        assert bs.layer_blocks(W, child_ptr) is blocks     # built once per matrix
        dense = np.zeros(d)
        acc = np.zeros(int(sizes.max()))
        for i in range(X.shape[0]):
            dense[X.indices[X.indptr[i]:X.indptr[i + 1]]] = X.data[X.indptr[i]:X.indptr[i + 1]]
            for p in range(len(sizes)):
                bs._children_margins(X.indptr.astype(np.int64), X.indices, X.data, i, blocks[0][p], blocks[0][p + 1],
                                     *blocks[1:], acc, sizes[p])
                for t in range(sizes[p]):
                    ref = bs._dot(X.indptr.astype(np.int64), X.indices, X.data, i, dense, W.indptr.astype(np.int64),
                                  W.indices, W.data, child_ptr[p] + t)
                    assert acc[t] == ref, (dtype, i, p, t)
            dense[:] = 0.0
        key = id(W)
        del W, blocks
        gc.collect()
        assert key not in bs._BLOCKS                        # dropped with its matrix


def test_unsorted_repeated_input_features_are_summed_first():
    """Rows whose features are out of order or listed twice are searched as their canonical
    form (sorted, summed), by the layered and the tree search alike."""
    m, X = _random_model(5)
    rows, cols, vals = [], [], []
    for i in range(X.shape[0]):
        idx, val = X.indices[X.indptr[i]:X.indptr[i + 1]], X.data[X.indptr[i]:X.indptr[i + 1]]
        idx, val = idx[::-1], val[::-1]                       # descending order
        if len(idx):                                          # the first feature again, split in two
            idx, val = np.append(idx, idx[0]), np.append(val, val[0] / 2)
            val[0] /= 2
        rows += [i] * len(idx)
        cols += list(idx)
        vals += list(val)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=X.shape[0]))])
    Xu = sp.csr_matrix((np.array(vals, np.float32), np.array(cols), indptr), shape=X.shape)
    assert not Xu.has_canonical_format
    for search in ("layered", "tree"):
        a = m.predict(Xu, beam_size=4, topk=3, search=search)
        b = m.predict(X, beam_size=4, topk=3, search=search)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_allclose(a[1], b[1], rtol=1e-6)     # halves summed: equal up to rounding


def test_layer_blocks_are_rebuilt_for_another_child_ptr():
    from xmc_spark.kernels import beam_search as bs
    W = sp.random(20, 6, density=0.5, random_state=2, format="csc")
    a = bs.layer_blocks(W, np.array([0, 2, 6]))
    b = bs.layer_blocks(W, np.array([0, 4, 6]))
    assert a is not b
    np.testing.assert_array_equal(b[0], bs.layer_blocks(W, np.array([0, 4, 6]))[0])
    assert bs.layer_blocks(W, np.array([0, 4, 6])) is bs.layer_blocks(W, np.array([0, 4, 6]))


def test_tied_scores_go_to_the_smaller_label():
    """Weights and inputs on a coarse grid: many labels tie (an l3-hinge margin of 1 or more scores
    exactly 1). A full beam gives the exhaustive top k, ties in label order, with and without labels
    in two leaves (averaged)."""
    for seed, overlap in ((3, False), (4, True)):
        m, X = _random_model(seed, L=40, d=12, leaf_size=4, overlap=overlap)
        for cols in (m.node_w, m.slot_w):
            cols.W.data = np.round(cols.W.data * 2) / 2
        X.data = np.round(X.data * 2) / 2
        layers, order = m.layers()
        Xb = sp.hstack([X, np.ones((X.shape[0], 1))], format="csr")
        E = exhaustive_scores(Xb, layers, m.index.slot_label[order], m.n_labels)
        assert (np.sort(E, axis=1)[:, -5:] == np.sort(E, axis=1)[:, -6:-1]).any()      # ties in the top 5
        labels, scores = m.predict(X, beam_size=1000, topk=5)
        top = np.argsort(-E, axis=1, kind="stable")[:, :5]
        np.testing.assert_array_equal(labels, top)
        np.testing.assert_allclose(scores, np.take_along_axis(E, top, axis=1), rtol=1e-12)
