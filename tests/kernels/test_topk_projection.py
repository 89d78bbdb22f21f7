import itertools

import numpy as np
import scipy.sparse as sp

from tests.oracles import coverage, projection_dense
from xmc_spark.kernels.topk_projection import topk_projection


def _instance(seed, n=12, L=4, K=3, b=1):
    rng = np.random.default_rng(seed)
    Y = sp.csr_matrix((rng.random((n, L)) < 0.4).astype(float))
    M = np.zeros((n, K))
    for i in range(n):
        M[i, rng.choice(K, b, replace=False)] = 1
    return Y, sp.csr_matrix(M), rng.integers(0, K, L)


def test_top_lambda_maximizes_linear_objective_brute_force():
    for seed in range(20):
        Y, M, cur = _instance(seed)
        A = np.asarray((Y.T @ M).todense())
        for lam in (1, 2):
            C = projection_dense(A, lam, cur)
            best = 0.0
            L, K = A.shape
            rows = [c for r in range(1, lam + 1) for c in itertools.combinations(range(K), r)]
            for choice in itertools.product(rows, repeat=L):
                val = sum(A[k, list(s)].sum() for k, s in enumerate(choice))
                best = max(best, val)
            assert np.isclose((A * C).sum(), best)
            assert (C.sum(axis=1) <= lam).all() and (C.sum(axis=1) >= 1).all()


def test_theorem3_not_worse_than_original_partition():
    for seed in range(30):
        for b in (1, 2):
            Y, M, cur = _instance(seed, n=20, L=6, K=4, b=b)
            A = np.asarray((Y.T @ M).todense())
            C0 = np.zeros_like(A, dtype=np.int64)
            C0[np.arange(len(cur)), cur] = 1
            for lam in (1, 2, 3):
                assert coverage(Y, M, projection_dense(A, lam, cur)) >= coverage(Y, M, C0)


def test_ties_prefer_current_then_smaller_id_and_empty_rows_keep_cluster():
    label = np.array([0, 0, 0, 1])
    leaf = np.array([5, 3, 7, 2])
    value = np.array([2.0, 2.0, 2.0, 0.0])
    lab, lf = topk_projection(label, leaf, value, 2, np.array([0, 1, 2]), np.array([7, 4, 9]))
    assert list(zip(lab, lf)) == [(0, 3), (0, 7), (1, 4), (2, 9)]
