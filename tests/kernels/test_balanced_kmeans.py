import numpy as np
import pytest
import scipy.sparse as sp

from xmc_spark.kernels.balanced_kmeans import balanced_split, balanced_split_streamed
from xmc_spark.kernels.tree import build_tree, node_depth


@pytest.mark.parametrize("m,B", [(2, 2), (7, 2), (100, 2), (101, 2), (10, 3), (50, 4), (3, 4), (1601, 16), (1037, 100)])
def test_split_sizes_differ_by_at_most_one(m, B):
    Z = sp.random(m, 30, density=0.3, random_state=m, format="csr")
    a = balanced_split(Z, nr_splits=B, seed=1)
    sizes = np.bincount(a, minlength=min(B, m))
    assert sizes.sum() == m
    assert sizes.max() - sizes.min() <= 1


def test_split_separates_two_clear_clusters():
    rng = np.random.default_rng(0)
    a = np.hstack([rng.uniform(0.8, 1, (20, 5)), rng.uniform(0, 0.05, (20, 5))])
    b = np.hstack([rng.uniform(0, 0.05, (20, 5)), rng.uniform(0.8, 1, (20, 5))])
    Z = sp.csr_matrix(np.vstack([a, b]))
    assign = balanced_split(Z, seed=3)
    assert len(set(assign[:20])) == 1 and len(set(assign[20:])) == 1 and assign[0] != assign[20]


def test_split_deterministic_for_seed():
    Z = sp.random(64, 20, density=0.3, random_state=0, format="csr")
    np.testing.assert_array_equal(balanced_split(Z, seed=5), balanced_split(Z, seed=5))


def test_build_tree_leaf_sizes_and_depth():
    Z = sp.random(983, 50, density=0.2, random_state=0, format="csr")
    leaf = build_tree(Z, max_leaf_size=100, nr_splits=2)
    _, counts = np.unique(leaf, return_counts=True)
    assert counts.max() <= 100
    assert set(node_depth(leaf, 2)) == {4}  # 983 -> 492 -> 246 -> 123 -> 62: 16 leaves at depth 4
    assert len(counts) == 16


def test_centroids_and_similarities_equal_the_sparse_products():
    """The compiled cluster sums and similarities give exactly (bit for bit) the scipy products
    they replace: membership matrix x Z in float32, Z x C^T in float64."""
    from xmc_spark.kernels.balanced_kmeans import _centroids, _similarities
    rng = np.random.default_rng(1)
    for seed in range(5):
        m, d, k = 200 + seed, 90, (2, 3, 16, 2, 8)[seed]
        Z = sp.random(m, d, density=0.2, format="csr", random_state=seed, dtype=np.float32)
        a = rng.integers(0, k, m)
        A = sp.csr_matrix((np.ones(m, np.float32), (a, np.arange(m))), shape=(k, m))
        C = np.asarray((A @ Z).todense(), dtype=np.float64)
        n = np.linalg.norm(C, axis=1, keepdims=True)
        n[n == 0] = 1.0
        np.testing.assert_array_equal(_centroids(Z, a, k), C / n)
        np.testing.assert_array_equal(_similarities(Z.indptr, Z.indices, Z.data, C / n),
                                      np.asarray(Z @ (C / n).T, dtype=np.float64))


def _reference_split(Z, k, max_iter, seed):
    """The balanced split written with scipy products on all d columns: centroids as the
    membership matrix times Z, similarities Z @ C^T, two children sorted by S0 - S1."""
    Z = sp.csr_matrix(Z, dtype=np.float32)
    m = Z.shape[0]
    rng = np.random.default_rng(seed)
    base, extra = divmod(m, k)
    caps = np.full(k, base)
    caps[:extra] += 1
    C = np.asarray(Z[rng.choice(m, size=k, replace=False)].todense(), dtype=np.float64)
    assign = None
    for _ in range(max_iter):
        n = np.linalg.norm(C, axis=1, keepdims=True)
        n[n == 0] = 1.0
        S = np.asarray(Z @ (C / n).T, dtype=np.float64)
        if k == 2:
            new = np.ones(m, dtype=np.int64)
            new[np.argsort(-(S[:, 0] - S[:, 1]), kind="mergesort")[: caps[0]]] = 0
        else:                                   # greedy: best (row, child) pairs first, children capped
            new = -np.ones(m, dtype=np.int64)
            load = np.zeros(k, dtype=np.int64)
            for f in np.argsort(-S.ravel(), kind="mergesort"):
                i, j = divmod(int(f), k)
                if new[i] < 0 and load[j] < caps[j]:
                    new[i] = j
                    load[j] += 1
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        A = sp.csr_matrix((np.ones(m, np.float32), (assign, np.arange(m))), shape=(k, m))
        C = np.asarray((A @ Z).todense(), dtype=np.float64)
    return assign


@pytest.mark.parametrize("k", [2, 3, 8])
def test_split_equals_the_scipy_reference_and_ignores_unused_columns(k):
    """The compiled split (the difference projection for two children) gives the assignment of
    the plain scipy iteration, and empty columns added anywhere change nothing. Real-valued rows:
    with ties at the cut (binary rows) the two roundings of z^T c0 - z^T c1 may order tied rows
    differently (see ``_projection``)."""
    for seed in range(4):
        m, d = 300 + 17 * seed, 60
        Z = sp.random(m, d, density=0.15, format="csr", random_state=seed, dtype=np.float32)
        a = balanced_split(Z, nr_splits=k, max_iter=20, seed=seed)
        np.testing.assert_array_equal(a, _reference_split(Z, k, 20, seed))
        Z64 = Z.copy()
        Z64.indices, Z64.indptr = Z.indices.astype(np.int64), Z.indptr.astype(np.int64)
        np.testing.assert_array_equal(balanced_split(Z64, nr_splits=k, max_iter=20, seed=seed), a)
        wide = sp.hstack([sp.csr_matrix((m, 5)), Z[:, :30], sp.csr_matrix((m, 40)), Z[:, 30:]], format="csr")
        np.testing.assert_array_equal(balanced_split(wide, nr_splits=k, max_iter=20, seed=seed), a)


def test_projection_equals_the_sparse_product():
    from xmc_spark.kernels.balanced_kmeans import _projection
    Z = sp.random(150, 70, density=0.2, format="csr", random_state=3, dtype=np.float32)
    v = np.random.default_rng(0).standard_normal(70)
    np.testing.assert_array_equal(_projection(Z.indptr, Z.indices, Z.data, v), Z @ v)


def _blocks(Z, cuts, order=None):
    """A blocks() callable over Z's rows cut at ``cuts`` (positions rising), the blocks in ``order``."""
    bounds = [0, *cuts, Z.shape[0]]
    spans = list(zip(bounds[:-1], bounds[1:]))
    spans = [spans[i] for i in (order if order is not None else range(len(spans)))]
    return lambda: ((np.arange(a, b), Z[a:b]) for a, b in spans)


@pytest.mark.parametrize("k", [2, 3, 8])
@pytest.mark.parametrize("m", [1, 2, 9, 200, 997])
def test_a_streamed_split_is_the_kernels_to_the_bit(m, k):
    """Rows given a block at a time, in position order (blocks of one row, empty blocks, one block):
    the kernel's children exactly; in another block order, still a balanced split."""
    rng = np.random.default_rng(m * 10 + k)
    Z = sp.random(m, 300, density=0.05, random_state=rng, format="csr", dtype=np.float32)
    Z.data = rng.random(len(Z.data)).astype(np.float32)
    want = balanced_split(Z, k, 20, 7)
    for cuts in ([], sorted(rng.choice(np.arange(1, m), size=min(4, m - 1), replace=False).tolist()) if m > 1 else [],
                 list(range(1, m)), [0, 0, m] if m > 1 else []):
        np.testing.assert_array_equal(balanced_split_streamed(_blocks(Z, cuts), m, 300, k, 20, 7), want)
    if m > 2:
        got = balanced_split_streamed(_blocks(Z, [m // 3, 2 * m // 3], [2, 0, 1]), m, 300, k, 20, 7)
        assert sorted(np.bincount(got, minlength=min(k, m))) == sorted(np.bincount(want, minlength=min(k, m)))


def test_a_streamed_split_refuses_rows_missing_or_given_twice():
    Z = sp.random(20, 10, density=0.5, random_state=1, format="csr", dtype=np.float32)
    with pytest.raises(RuntimeError, match="row 5 of 20 2 times"):
        balanced_split_streamed(lambda: iter([(np.arange(20), Z), (np.array([5]), Z[5:6])]), 20, 10)
    with pytest.raises(RuntimeError, match="row 10 of 20 0 times"):
        balanced_split_streamed(lambda: iter([(np.arange(10), Z[:10])]), 20, 10)
