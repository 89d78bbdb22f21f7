"""L2-regularized squared-hinge (L2-loss SVM) one-vs-rest classifiers for one tree node.

Solves  min_w 0.5 ||w||^2 + sum_i C_i max(0, 1 - y_i w^T x_i)^2   with C_i = C * weight_i
by dual coordinate descent with shrinking (Hsieh et al. 2008, liblinear's
L2R_L2LOSS_SVC_DUAL, the solver PECOS uses), compiled with numba. A weight of 1 for every
sample gives the unweighted problem exactly.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .jit import njit


@njit()
def _dcd_l2svm(indptr, indices, data, y, Ci, n_features, eps, max_iter, seed):
    n = y.shape[0]
    w = np.zeros(n_features, dtype=np.float64)
    alpha = np.zeros(n, dtype=np.float64)
    diag = 0.5 / Ci
    QD = np.empty(n, dtype=np.float64)
    for i in range(n):
        s = diag[i]
        for p in range(indptr[i], indptr[i + 1]):
            s += data[p] * data[p]
        QD[i] = s
    index = np.arange(n)
    active = n
    pg_max_old = np.inf  # no upper bound on alpha for the L2 loss: only this side shrinks
    state = np.uint64(seed * 2654435761 + 12345)
    for _ in range(max_iter):
        pg_max_new = -np.inf
        pg_min_new = np.inf
        for i in range(active):  # Fisher-Yates over the active set
            state = state * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
            j = i + int((state >> np.uint64(33)) % np.uint64(active - i))
            t = index[i]
            index[i] = index[j]
            index[j] = t
        s = 0
        while s < active:
            i = index[s]
            yi = y[i]
            g = 0.0
            for p in range(indptr[i], indptr[i + 1]):
                g += w[indices[p]] * data[p]
            g = g * yi - 1.0 + alpha[i] * diag[i]
            pg = 0.0
            if alpha[i] == 0.0:
                if g > pg_max_old:
                    active -= 1
                    t = index[s]
                    index[s] = index[active]
                    index[active] = t
                    continue
                elif g < 0.0:
                    pg = g
            else:
                pg = g
            if pg > pg_max_new:
                pg_max_new = pg
            if pg < pg_min_new:
                pg_min_new = pg
            if abs(pg) > 1e-12:
                a_old = alpha[i]
                a_new = a_old - g / QD[i]
                if a_new < 0.0:
                    a_new = 0.0
                alpha[i] = a_new
                d = (a_new - a_old) * yi
                for p in range(indptr[i], indptr[i + 1]):
                    w[indices[p]] += d * data[p]
            s += 1
        if pg_max_new - pg_min_new <= eps:
            if active == n:
                break
            active = n
            pg_max_old = np.inf
            continue
        pg_max_old = pg_max_new if pg_max_new > 0 else np.inf
    return w


def train_node(X: sp.csr_matrix, Y: sp.csr_matrix, C: float = 1.0, weights=None, threshold: float = 0.1,
               eps: float = 0.1, max_iter: int = 100, seed: int = 0) -> sp.csc_matrix:
    """One-vs-rest classifiers for the K columns of Y (n x K, non-zero = positive) over the n samples X.

    Y's values weight the positives (cost C * weights[i] * Y[i, k]); 1 everywhere is plain
    one-vs-rest. Negatives cost C * weights[i].

    Returns the pruned weights as a CSC matrix (n_features x K): entries with |w| < threshold
    are dropped. Only the features present in X are solved for, so work and memory follow the
    node's non-zeros, not the global feature count.
    """
    X = sp.csr_matrix(X)
    Y = sp.csc_matrix(Y)
    n, d = X.shape
    K = Y.shape[1]
    Ci = np.full(n, float(C)) if weights is None else float(C) * np.asarray(weights, dtype=np.float64)
    keep = np.flatnonzero(Ci > 0)
    X, Y, Ci = X[keep], Y[keep], Ci[keep]
    cols, local = np.unique(X.indices, return_inverse=True)
    Xl = sp.csr_matrix((X.data.astype(np.float64), local.astype(np.int64), X.indptr.astype(np.int64)),
                       shape=(len(keep), len(cols)))
    out_ptr = [0]
    out_idx, out_val = [], []
    weighted = Y.nnz > 0 and not np.all(Y.data == 1)
    for k in range(K):
        y = -np.ones(len(keep), dtype=np.float64)
        pos = Y.indices[Y.indptr[k]:Y.indptr[k + 1]]
        y[pos] = 1.0
        Ck = Ci
        if weighted:                      # a positive's cost scaled by its label weight
            Ck = Ci.copy()
            Ck[pos] *= np.maximum(Y.data[Y.indptr[k]:Y.indptr[k + 1]], 1e-12)
        if len(keep) == 0:
            w = np.zeros(0)
        else:
            w = _dcd_l2svm(Xl.indptr, Xl.indices, Xl.data, y, Ck, len(cols), float(eps), int(max_iter),
                           int(seed) + k)
        nz = np.flatnonzero(np.abs(w) >= threshold) if threshold > 0 else np.flatnonzero(w)
        out_idx.append(cols[nz])
        out_val.append(w[nz].astype(np.float32))
        out_ptr.append(out_ptr[-1] + len(nz))
    idx = np.concatenate(out_idx).astype(np.int32) if out_idx else np.zeros(0, np.int32)
    val = np.concatenate(out_val) if out_val else np.zeros(0, np.float32)
    return sp.csc_matrix((val, idx, np.asarray(out_ptr, dtype=np.int64)), shape=(d, K))

