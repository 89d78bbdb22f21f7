"""The kNN and centroid votes of benchmarks/knn_rerank_probe.py against brute force."""
import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from knn_rerank_probe import candidate_votes, centroid_votes, knn_votes  # noqa: E402


def _data(seed=0):
    rng = np.random.default_rng(seed)
    Xa = sp.random(30, 12, density=0.4, random_state=seed, format="csr") + sp.eye(30, 12, format="csr")
    Ya = sp.csr_matrix((rng.random((30, 6)) < 0.3).astype(np.float64))
    Xq = sp.random(5, 12, density=0.5, random_state=seed + 1, format="csr") + sp.eye(5, 12, format="csr")
    return sp.csr_matrix(Xq), sp.csr_matrix(Xa), Ya


def _unit(A):
    A = A.toarray()
    return A / np.maximum(np.linalg.norm(A, axis=1, keepdims=True), 1e-12)


def test_centroid_votes_equal_brute_force():
    Xq, Xa, Ya = _data()
    Q, A, Y = _unit(Xq), _unit(Xa), Ya.toarray()
    for a in (0.0, 0.5, 1.0):
        ref = np.array([[sum(Q[i] @ A[j] for j in range(len(A)) if Y[j, k]) / max(Y[:, k].sum(), 1) ** a
                         for k in range(Y.shape[1])] for i in range(len(Q))])
        np.testing.assert_allclose(centroid_votes(Xq, Xa, Ya, a), ref, rtol=1e-5, atol=1e-7)  # float32 unit rows


def test_knn_votes_equal_brute_force_and_candidates_pick_their_labels():
    Xq, Xa, Ya = _data(1)
    Q, A, Y = _unit(Xq), _unit(Xa), Ya.toarray()
    S = Q @ A.T
    for k in (1, 4):
        near = np.argsort(-S, axis=1)[:, :k]
        ref = np.array([S[i, near[i]] @ Y[near[i]] / S[i, near[i]].sum() for i in range(len(Q))])
        np.testing.assert_allclose(knn_votes(Xq, Xa, Ya, k), ref, rtol=1e-5, atol=1e-7)  # float32 unit rows
    lab = np.array([[2, 0, 5]] * len(Q))
    v = candidate_votes("centroid", Xq, Xa, Ya, 1.0, lab)
    full = centroid_votes(Xq, Xa, Ya, 1.0)[:, [2, 0, 5]]
    np.testing.assert_allclose(v, full / full.max(axis=1, keepdims=True), atol=1e-12)
    np.testing.assert_allclose(candidate_votes("knn", Xq, Xa, Ya, 4, lab), knn_votes(Xq, Xa, Ya, 4)[:, [2, 0, 5]])
