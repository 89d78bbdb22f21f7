import numpy as np
import scipy.sparse as sp
from scipy.optimize import minimize

from tests.oracles import primal_objective, train_binary
from xmc_spark.kernels.squared_hinge import train_node


def _problem(seed=0, n=60, d=10):
    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.4, random_state=seed, format="csr", dtype=np.float64)
    y = np.where(rng.random(n) < 0.4, 1.0, -1.0)
    return X, y


def test_matches_generic_optimizer():
    X, y = _problem()
    w = train_binary(X, y, C=1.0, eps=1e-8, max_iter=10000)
    ref = minimize(lambda v: primal_objective(v, X, y), np.zeros(X.shape[1]), method="L-BFGS-B",
                   options={"gtol": 1e-10, "maxiter": 10000})
    assert primal_objective(w, X, y) <= ref.fun + 1e-6
    np.testing.assert_allclose(w, ref.x, atol=1e-3)


def test_weight_two_equals_duplicated_sample():
    X, y = _problem(1)
    wts = np.ones(X.shape[0])
    wts[:10] = 2.0
    w_weighted = train_binary(X, y, weights=wts, eps=1e-9, max_iter=20000)
    Xd = sp.vstack([X, X[:10]]).tocsr()
    yd = np.concatenate([y, y[:10]])
    w_dup = train_binary(Xd, yd, eps=1e-9, max_iter=20000)
    np.testing.assert_allclose(w_weighted, w_dup, atol=1e-4)


def test_unit_weights_reproduce_unweighted_model_exactly():
    X, y = _problem(2)
    a = train_binary(X, y)
    b = train_binary(X, y, weights=np.ones(X.shape[0]))
    np.testing.assert_array_equal(a, b)


def test_zero_weight_removes_sample():
    X, y = _problem(3)
    wts = np.ones(X.shape[0])
    wts[5] = 0
    a = train_binary(X, y, weights=wts, eps=1e-9, max_iter=20000)
    keep = np.arange(X.shape[0]) != 5
    b = train_binary(X[keep], y[keep], eps=1e-9, max_iter=20000)
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_train_node_prunes_and_matches_binary():
    X, y = _problem(4)
    Y = sp.csr_matrix(np.stack([y > 0, y < 0], axis=1).astype(np.float32))
    W = train_node(X, Y, threshold=0.0, eps=1e-8, max_iter=10000)
    w0 = np.asarray(W[:, 0].todense()).ravel()
    ref = train_binary(X, np.where(y > 0, 1.0, -1.0), eps=1e-8, max_iter=10000)
    np.testing.assert_allclose(w0, ref, atol=1e-4)
    Wt = train_node(X, Y, threshold=0.3, eps=1e-8, max_iter=10000)
    assert np.all(np.abs(Wt.data) >= 0.3)
    dense = np.asarray(W.todense())
    assert Wt.nnz == int((np.abs(dense) >= 0.3).sum())


def test_label_weights_scale_only_the_positives():
    from xmc_spark.kernels.squared_hinge import train_node
    rng = np.random.default_rng(3)
    X = sp.random(80, 12, density=0.4, random_state=3, format="csr")
    y = rng.random(80) < 0.3
    w = rng.uniform(0.1, 1.0, 80)
    Yw = sp.csr_matrix((w[y], (np.flatnonzero(y), np.zeros(y.sum(), int))), shape=(80, 1))
    per_sample = np.where(y, w, 1.0)                 # the same costs given as sample weights
    a = train_node(X, Yw, threshold=0, eps=1e-6, max_iter=2000).toarray()
    b = train_node(X, sp.csr_matrix(Yw > 0, dtype=np.float32), weights=per_sample, threshold=0, eps=1e-6,
                   max_iter=2000).toarray()
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_node_of_weighted_labels_equals_each_label_alone():
    """train_node solves a node's labels in one compiled loop (row norms shared, each
    positive's cost set and restored per label): each column must equal that label solved
    alone with its costs as sample weights, bit for bit, and threshold 0 keeps every non-zero
    (the output grows past its first allocation)."""
    rng = np.random.default_rng(7)
    n, d, K = 90, 14, 5
    X = sp.random(n, d, density=0.35, random_state=7, format="csr", dtype=np.float64)
    Y = sp.random(n, K, density=0.3, random_state=8, format="csc", dtype=np.float64)
    Y.data = rng.uniform(0.2, 1.5, Y.nnz)
    sw = rng.uniform(0.5, 2.0, n)
    sw[3] = 0.0                                      # a dropped sample
    W = train_node(X, Y, C=0.7, weights=sw, threshold=0.0, eps=0.01, max_iter=500, seed=11).toarray()
    for k in range(K):
        pos = Y[:, k].toarray().ravel()
        y = np.where(pos > 0, 1.0, -1.0)
        cost = sw * np.where(pos > 0, pos, 1.0)
        ref = train_binary(X, y, C=0.7, weights=cost, eps=0.01, max_iter=500, seed=11 + k)
        np.testing.assert_array_equal(W[:, k], ref.astype(np.float32))
    assert np.count_nonzero(W) > d                   # more than the first allocation


def test_float32_values_give_the_float64_solution():
    X, y = _problem(5)
    Y = sp.csr_matrix(np.stack([y > 0, y < 0], axis=1).astype(np.float32))
    X32 = X.astype(np.float32)
    a = train_node(X32, Y, threshold=0.0).toarray()
    b = train_node(X32.astype(np.float64), Y, threshold=0.0).toarray()
    np.testing.assert_array_equal(a, b)


def test_shuffle_is_a_uniform_permutation():
    from xmc_spark.kernels.squared_hinge import _shuffle
    n, trials = 6, 12000
    counts = np.zeros((n, n))
    state = np.uint64(12345)
    for _ in range(trials):
        index = np.arange(n)
        state = np.uint64(_shuffle(index, n, state))     # a Python int back from numba
        assert sorted(index) == list(range(n))
        counts[np.arange(n), index] += 1
    expected = trials / n                            # each value equally likely at each position
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 70                                 # 25 degrees of freedom: p < 1e-5 beyond 70
    index = np.arange(n)
    _shuffle(index, 3, np.uint64(1))
    assert list(index[3:]) == [3, 4, 5]              # only the active part moves


def test_used_columns_equal_unique_on_both_paths():
    from xmc_spark.kernels.squared_hinge import _used_columns
    rng = np.random.default_rng(0)
    for d, nnz in ((50, 400), (50, 3), (10**6, 200), (1, 5)):       # mark path, sort path, both ends
        idx = rng.integers(0, d, nnz).astype(np.int32)
        cols, local = _used_columns(idx, d)
        ref_cols, ref_local = np.unique(idx, return_inverse=True)
        np.testing.assert_array_equal(cols, ref_cols)
        np.testing.assert_array_equal(local, ref_local)
