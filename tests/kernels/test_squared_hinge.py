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
