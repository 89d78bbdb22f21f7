"""L2-regularized squared-hinge (L2-loss SVM) one-vs-rest classifiers for one tree node.

Solves  min_w 0.5 ||w||^2 + sum_i C_i max(0, 1 - y_i w^T x_i)^2   with C_i = C * weight_i
by dual coordinate descent with shrinking (Hsieh et al. 2008, liblinear's
L2R_L2LOSS_SVC_DUAL, the solver PECOS uses), compiled with numba. A weight of 1 for every
sample gives the unweighted problem exactly.

A node's labels are solved in one compiled call (:func:`_train_labels`): the rows' squared
norms are computed once for all of them, the solver reads float32 values as they come (every
product in float64, so the solution is that of the float64 copy) with node-local column ids, and
no Python runs between classifiers. On leaves of the 200K synthetic set this is ~15% faster
than a solver call per label over float64 copies.

The solver indexes with unsigned integers (row pointers uint64, local column ids uint32, the
row order uint64): numba wraps a signed index that may be negative, a few instructions per
access that in the sparse loops cost more than the multiply-add itself; unsigned, the loops
compile to loads, a multiply and an add, and the arithmetic (so every weight) is unchanged.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .jit import UONE, njit


@njit()
def _shuffle(index, active, state):
    """Fisher-Yates over index[:active] with a 64-bit LCG (the draw: its top 31 bits modulo
    active - i; a multiply-shift draw saves ~3% of the solver's time but changes every
    solution at the solver's tolerance, and with it the documented P@k)."""
    for i in range(active):
        state = state * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
        j = i + int((state >> np.uint64(33)) % np.uint64(active - i))
        t = index[i]
        index[i] = index[j]
        index[j] = t
    return state


@njit()
def _row_norms(indptr, data):
    """x_i^T x_i of every row, accumulated in float64 (data may be float32)."""
    n = indptr.shape[0] - 1
    out = np.zeros(n, dtype=np.float64)
    for i in range(n):
        s = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            v = np.float64(data[p])
            s += v * v
        out[i] = s
    return out


@njit(inline="always")
def _epoch(indptr, indices, data, QD, diag, y, w, alpha, index, active, pg_max_old, state):
    """One pass of dual coordinate descent over the rows ``index[:active]`` (shuffled first with
    the LCG ``state``), updating ``alpha`` and ``w``; a row with alpha 0 whose gradient is over
    ``pg_max_old`` is shrunk (swapped past the active ones). Returns (the largest and the smallest
    projected gradient seen, the active count, the LCG state). ``QD`` = ``diag`` + x_i^T x_i,
    ``diag`` = 0.5 / C_i. :func:`_dcd` is a loop of these over one node's rows; the streamed
    big nodes (:mod:`..stages.streamed_nodes`) run them over blocks of rows read from files."""
    pg_max_new = -np.inf
    pg_min_new = np.inf
    state = _shuffle(index, active, state)
    s = 0
    while s < active:
        i = index[s]
        yi = y[i]
        g = 0.0
        for p in range(indptr[i], indptr[i + UONE]):
            g += w[indices[p]] * np.float64(data[p])
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
            for p in range(indptr[i], indptr[i + UONE]):
                w[indices[p]] += d * np.float64(data[p])
        s += 1
    return pg_max_new, pg_min_new, active, state


@njit()
def _dcd(indptr, indices, data, xx, y, Ci, w, eps, max_iter, seed):
    """Dual coordinate descent for one classifier; ``w`` (zeros on entry) receives the primal
    weights. ``xx`` holds the rows' squared norms (:func:`_row_norms`), shared by a node's
    classifiers. Products with ``data`` are taken in float64 whatever its type. Any integer
    types work; uint64 ``indptr`` and uint32 ``indices`` compile to the fastest loops."""
    n = y.shape[0]
    alpha = np.zeros(n, dtype=np.float64)
    diag = 0.5 / Ci
    QD = diag + xx
    index = np.arange(n).astype(np.uint64)
    active = n
    pg_max_old = np.inf  # no upper bound on alpha for the L2 loss: only this side shrinks
    state = np.uint64(seed * 2654435761 + 12345)
    for _ in range(max_iter):
        pg_max_new, pg_min_new, active, state = _epoch(indptr, indices, data, QD, diag, y, w, alpha, index, active,
                                                       pg_max_old, state)
        if pg_max_new - pg_min_new <= eps:
            if active == n:
                break
            active = n
            pg_max_old = np.inf
            continue
        pg_max_old = pg_max_new if pg_max_new > 0 else np.inf


@njit()
def _train_labels(indptr, indices, data, Ci, y_ptr, y_idx, y_val, weighted, n_cols, eps, max_iter, seed,
                  threshold):
    """Every label (column of Y in CSC form: ``y_ptr``, ``y_idx``, ``y_val``) of a node against
    the node's rows: (out_ptr, out_idx, out_val) of the pruned weights (|w| >= threshold, or
    w != 0 with threshold 0), columns local to the node. One call per node: the rows' norms
    are computed once, and no Python runs between classifiers."""
    n = Ci.shape[0]
    K = y_ptr.shape[0] - 1
    xx = _row_norms(indptr, data)
    w = np.zeros(n_cols, dtype=np.float64)
    y = np.empty(n, dtype=np.float64)
    Ck = Ci.copy()
    out_ptr = np.zeros(K + 1, dtype=np.int64)
    cap = max(16, n_cols)
    out_idx = np.empty(cap, dtype=np.int64)
    out_val = np.empty(cap, dtype=np.float32)
    m = 0
    for k in range(K):
        y[:] = -1.0
        for p in range(y_ptr[k], y_ptr[k + 1]):
            y[y_idx[p]] = 1.0
            if weighted:                  # a positive's cost scaled by its label weight
                Ck[y_idx[p]] = Ci[y_idx[p]] * max(y_val[p], 1e-12)
        w[:] = 0.0
        _dcd(indptr, indices, data, xx, y, Ck if weighted else Ci, w, eps, max_iter, seed + k)
        if weighted:
            for p in range(y_ptr[k], y_ptr[k + 1]):
                Ck[y_idx[p]] = Ci[y_idx[p]]
        if m + n_cols > cap:
            cap = max(2 * cap, m + n_cols)
            grown_idx = np.empty(cap, dtype=np.int64)
            grown_val = np.empty(cap, dtype=np.float32)
            grown_idx[:m] = out_idx[:m]
            grown_val[:m] = out_val[:m]
            out_idx, out_val = grown_idx, grown_val
        for j in range(n_cols):
            if (abs(w[j]) >= threshold) if threshold > 0 else (w[j] != 0.0):
                out_idx[m] = j
                out_val[m] = np.float32(w[j])
                m += 1
        out_ptr[k + 1] = m
    return out_ptr, out_idx[:m].copy(), out_val[:m].copy()     # not views that keep the grown buffers


def _used_columns(indices: np.ndarray, d: int):
    """(the sorted distinct column ids, each entry's position among them as uint32), as
    ``np.unique(indices, return_inverse=True)``: by a mark over the d columns when d is at most
    8x the entries (no sort), else by the sort."""
    if d > 8 * len(indices):
        cols, pos = np.unique(indices, return_inverse=True)
        return cols, pos.astype(np.uint32)
    present = np.zeros(d, dtype=bool)
    present[indices] = True
    cols = np.flatnonzero(present)
    pos = np.empty(d, dtype=np.uint32)
    pos[cols] = np.arange(len(cols), dtype=np.uint32)
    return cols, pos[indices]


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
    if len(keep) == 0:
        return sp.csc_matrix((d, K), dtype=np.float32)
    if len(keep) < n:
        X, Y, Ci = X[keep], sp.csc_matrix(Y[keep]), Ci[keep]
    cols, local = _used_columns(X.indices, d)
    # float32 values are solved as they are (every product is taken in float64); others as float64
    data = X.data if X.data.dtype == np.float32 else X.data.astype(np.float64)
    weighted = Y.nnz > 0 and not np.all(Y.data == 1)
    out_ptr, out_idx, val = _train_labels(
        X.indptr.astype(np.uint64), local, data, Ci, Y.indptr.astype(np.int64),
        Y.indices.astype(np.int64), Y.data.astype(np.float64), weighted, len(cols), float(eps), int(max_iter),
        int(seed), float(threshold))
    idx = cols[out_idx].astype(np.int32)
    return sp.csc_matrix((val, idx, out_ptr), shape=(d, K))

