import numpy as np
import pytest
import scipy.sparse as sp

from xmc_spark.kernels.label_embedding import pifa
from xmc_spark.kernels.tree import TreeIndex, ancestor_at, build_tree, node_depth, splits_balanced, unique_pairs


def test_pifa_matches_dense_formula():
    rng = np.random.default_rng(0)
    X = sp.csr_matrix(rng.random((30, 8)) * (rng.random((30, 8)) < 0.5))
    Y = sp.csr_matrix((rng.random((30, 5)) < 0.3).astype(float))
    Yd = np.asarray(Y.todense())
    Yn = Yd / np.maximum(np.linalg.norm(Yd, axis=1, keepdims=True), 1e-12)
    Z = Yn.T @ np.asarray(X.todense())
    Z = Z / np.maximum(np.linalg.norm(Z, axis=1, keepdims=True), 1e-12)
    np.testing.assert_allclose(np.asarray(pifa(X, Y).todense()), Z, rtol=1e-5, atol=1e-6)


def test_heap_numbering():
    assert list(node_depth([0, 1, 2, 3, 6, 7], 2)) == [0, 1, 1, 2, 2, 3]
    assert list(ancestor_at([7, 8, 4], [3, 3, 2], 1, 2)) == [1, 1, 1]
    assert list(ancestor_at([7, 13], [2, 2], 1, 3)) == [2, 4]


def _ancestors(node: int, B: int) -> list:
    """``node`` and every node above it, by the heap numbering's parent (node - 1) // B."""
    out = [node]
    while node > 0:
        node = (node - 1) // B
        out.append(node)
    return out


def test_the_sweep_up_equals_each_slots_ancestors():
    """Nodes, internal nodes, per-node sums of slot values and each sample's groups, swept up a
    depth at a time, against walking every slot's (or sample's) path to the root: random trees
    with leaves at any depth (also above other leaves), labels in several leaves, B = 2..5."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        B, L = int(rng.integers(2, 6)), int(rng.integers(1, 40))
        slot_label = rng.integers(0, L, size=int(rng.integers(1, 80)))
        slot_leaf = rng.choice(rng.integers(0, 300, size=int(rng.integers(1, 15))), size=len(slot_label))
        ix = TreeIndex(slot_label, slot_leaf, L, B)
        w = rng.integers(0, 9, size=len(ix.slot_label)).astype(np.float64)
        sums = {}
        for leaf, v in zip(ix.slot_leaf.tolist(), w):
            for a in _ancestors(leaf, B):
                sums[a] = sums.get(a, 0.0) + v
        nodes, got = ix.node_sums(w)
        assert nodes.tolist() == sorted(sums) and got.tolist() == [sums[a] for a in sorted(sums)]
        assert ix.nodes.tolist() == sorted(sums)
        assert ix.internal.tolist() == sorted({a for leaf in ix.leaves.tolist() for a in _ancestors(leaf, B)[1:]})
        cnt = rng.integers(0, 4, size=12)
        offsets = np.concatenate([[0], np.cumsum(cnt)])
        labels = rng.integers(0, L, size=int(offsets[-1]))
        want = {(i, 0) for i in range(12)}
        for i in range(12):
            for lab in labels[offsets[i]:offsets[i + 1]].tolist():
                for leaf in ix.slot_leaf[ix.slot_label == lab].tolist():
                    want |= {(i, a) for a in _ancestors(leaf, B)}
        rows, groups = ix.groups_of_samples(offsets, labels)
        assert list(zip(rows.tolist(), groups.tolist())) == sorted(want)
    empty = TreeIndex([], [], 0, 2)                              # depth 0: no slot, or the root alone
    assert empty.nodes.tolist() == empty.internal.tolist() == [] and empty.node_sums(np.zeros(0))[0].size == 0
    root = TreeIndex([0, 1], [0, 0], 2, 3)
    assert root.nodes.tolist() == [0] and root.internal.tolist() == []
    assert [a.tolist() for a in root.node_sums(np.array([2.0, 3.0]))] == [[0], [5.0]]
    rows, groups = root.groups_of_samples(np.array([0, 2, 2]), np.array([0, 1]))
    assert rows.tolist() == [0, 1] and groups.tolist() == [0, 0]
    with pytest.raises(ValueError, match="3 values for 2 slots"):
        root.node_sums(np.ones(3))


def test_groups_of_samples_brute_force():
    # leaves: label 0,1 -> node 3; label 2 -> node 4; label 3 -> node 2 (shallow leaf)
    ix = TreeIndex([0, 1, 2, 3], [3, 3, 4, 2], 4, 2)
    offsets = np.array([0, 2, 3, 3, 5])
    labels = np.array([0, 3, 2, 1, 2])
    rows, groups = ix.groups_of_samples(offsets, labels)
    got = set(zip(rows.tolist(), groups.tolist()))
    expect = {(0, 0), (0, 1), (0, 3), (0, 2),   # labels 0 (1 -> 3) and 3 (leaf 2)
              (1, 0), (1, 1), (1, 4),           # label 2
              (2, 0),                           # no label: root only
              (3, 0), (3, 1), (3, 3), (3, 4)}   # labels 1, 2
    assert got == expect
    children, Y = ix.node_problem(1, offsets, labels)
    assert list(children) == [3, 4]
    np.testing.assert_array_equal(np.asarray(Y.todense()), [[1, 0], [0, 1], [0, 0], [1, 1]])
    children, Y = ix.node_problem(3, offsets, labels)   # leaf: one classifier per label slot
    assert list(ix.slot_label[children]) == [0, 1]
    np.testing.assert_array_equal(np.asarray(Y.todense()), [[1, 0], [0, 0], [0, 0], [0, 1]])


def test_forest_keys_and_groups_are_each_trees_own():
    from xmc_spark.kernels.tree import Forest, decode_keys, encode_keys
    rng = np.random.default_rng(0)
    L = 12
    a = TreeIndex(np.arange(L), build_tree(sp.random(L, 8, density=0.5, random_state=1, format="csr"), 3, 2), L, 2)
    b = TreeIndex(np.arange(L), build_tree(sp.random(L, 8, density=0.5, random_state=2, format="csr"), 4, 3), L, 3)
    f = Forest([a, b])
    t, ids = decode_keys(encode_keys(1, b.nodes))
    assert (t == 1).all() and np.array_equal(ids, b.nodes)
    np.testing.assert_array_equal(encode_keys(0, a.nodes), a.nodes)        # tree 0 keys are its ids
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 3, 20))])
    labels = rng.integers(0, L, offsets[-1])
    rows, groups = f.groups_of_samples(offsets, labels)
    for k, ix in enumerate((a, b)):
        r, g = ix.groups_of_samples(offsets, labels)
        m = decode_keys(groups)[0] == k
        assert set(zip(rows[m].tolist(), decode_keys(groups[m])[1].tolist())) == set(zip(r.tolist(), g.tolist()))
    for g in np.unique(groups):
        k, node = decode_keys([g])
        kids, Y = f.node_problem(int(g), offsets, labels)
        kids0, Y0 = (a, b)[int(k[0])].node_problem(int(node[0]), offsets, labels)
        np.testing.assert_array_equal(decode_keys(kids)[1], kids0)
        assert (Y != Y0).nnz == 0
    np.testing.assert_allclose(f.label_depth(), (a.label_depth() + b.label_depth()) / 2)
    with pytest.raises(ValueError, match="too deep"):
        encode_keys(1, [1 << 60])


def test_unique_pairs_equal_numpy_unique_of_columns():
    """Distinct (row, group) pairs sorted by row then group, as np.unique over stacked columns,
    with ensemble-sized keys (tree << 52) too."""
    rng = np.random.default_rng(0)
    for hi in (5, 2 ** 60):
        r, g = rng.integers(0, 20, 300), rng.integers(0, hi, 300)
        g[::7] = g[0]
        r[::7] = r[0]
        ref = np.unique(np.stack([r, g]), axis=1)
        got = unique_pairs(r, g)
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])


def test_splits_balanced_by_lambda_and_depth():
    """lam = 0 splits every node balanced; lam > 0 only from balanced_below_depth down (binary
    heap: node 0 depth 0, 1-2 depth 1, 3-6 depth 2; B = 3: 1-3 depth 1, 4-12 depth 2)."""
    assert all(splits_balanced(n, 2, 0.0, 1) for n in (0, 1, 6))
    assert [splits_balanced(n, 2, 0.5, 2) for n in (0, 2, 3, 6, 7)] == [False, False, True, True, True]
    assert [splits_balanced(n, 3, 0.5, 2) for n in (3, 4, 12)] == [False, True, True]


def test_find_keys_against_brute_force():
    """Position and presence of each key in a sorted array, as a linear scan finds them; an
    empty array finds nothing (positions 0)."""
    from xmc_spark.kernels.tree import find_keys
    rng = np.random.default_rng(3)
    sorted_keys = np.unique(rng.integers(0, 50, 20))
    keys = rng.integers(-5, 60, 200)
    pos, found = find_keys(sorted_keys, keys)
    for k, p, f in zip(keys, pos, found):
        hits = np.flatnonzero(sorted_keys == k)
        assert f == bool(len(hits)) and (not f or p == hits[0])
        assert 0 <= p < len(sorted_keys)
    pos, found = find_keys(np.zeros(0, np.int64), keys)
    assert not found.any() and (pos == 0).all() and len(pos) == len(keys)
