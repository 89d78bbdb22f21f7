"""PIFA label embeddings: each label's normalized sum of its positive samples' features."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .jit import UONE, njit
from .sparse import l2_normalize_rows


def label_weights(Y: sp.csr_matrix, normalize_y: bool = True) -> sp.csr_matrix:
    """Y with each row scaled to unit L2 norm (PECOS ``normalized_Y``), or Y as float."""
    Y = Y.tocsr().astype(np.float32)
    return l2_normalize_rows(Y) if normalize_y else Y


def pifa_partial(X: sp.csr_matrix, Y: sp.csr_matrix, normalize_y: bool = True) -> sp.csr_matrix:
    """Un-normalized Y^T X for one block of samples (sums over blocks give the full product)."""
    return (label_weights(Y, normalize_y).T.tocsr() @ X.tocsr()).tocsr()


def pifa(X: sp.csr_matrix, Y: sp.csr_matrix, normalize_y: bool = True) -> sp.csr_matrix:
    """L2-row-normalized Y^T X (labels x features); memory grows with non-zeros only."""
    return l2_normalize_rows(pifa_partial(X, Y, normalize_y))


def label_sums(labels: np.ndarray, ptr: np.ndarray, idx: np.ndarray, val: np.ndarray, n_features: int):
    """The L2-normalized sum of each label's rows: rows ``ptr[r]:ptr[r + 1]`` of (``idx``, ``val``)
    (no column twice in a row, any order) belong to label ``labels[r]``; returns (labels ascending,
    indptr, indices, float32 values), each row's columns ascending and its zero sums dropped.

    Bit for bit ``l2_normalize_rows(S @ M)`` with S the label-by-row 0/1 matrix (what PIFA's
    combine computed): each column is summed in float32 in the rows' order, the norm in float64 in
    column order; without scipy's product the rows need no sort afterwards (a sort of every row
    took most of the combine's time)."""
    labels = np.asarray(labels)
    order = np.argsort(labels, kind="stable")
    uniq, starts = np.unique(labels[order], return_index=True)
    starts = np.append(starts, len(labels)).astype(np.int64)
    out_ptr, out_idx, out_val = _label_sums(order.astype(np.int64), starts, np.asarray(ptr, np.int64),
                                            np.asarray(idx, np.int32), np.asarray(val, np.float32), int(n_features))
    return uniq, out_ptr, out_idx, out_val


@njit()
def _label_sums(order, starts, ptr, idx, val, n_features):
    """:func:`label_sums` of the rows ``order[starts[g]:starts[g + 1]]`` for group g."""
    G = len(starts) - 1
    acc = np.zeros(n_features, np.float32)
    seen = np.full(n_features, -1, np.int64)
    out_ptr = np.zeros(G + 1, np.int64)
    out_idx = np.empty(len(idx), np.int32)
    out_val = np.empty(len(idx), np.float32)
    nnz = np.uint64(0)
    for g in range(G):
        lo = nnz
        for q in range(np.uint64(starts[g]), np.uint64(starts[g + 1])):
            r = np.uint64(order[q])
            for p in range(np.uint64(ptr[r]), np.uint64(ptr[r + UONE])):
                c = np.uint64(idx[p])
                if seen[c] != g:                     # the group's first value of column c
                    seen[c] = g
                    acc[c] = val[p]
                    out_idx[nnz] = c
                    nnz += UONE
                else:
                    acc[c] += val[p]
        out_idx[lo:nnz].sort()
        k = lo
        sq = 0.0
        for p in range(lo, nnz):                     # columns ascending; exact zeros dropped
            c = np.uint64(out_idx[p])
            v = acc[c]
            if v != 0:
                out_idx[k] = out_idx[p]
                out_val[k] = v
                k += UONE
                sq += np.float64(v) * np.float64(v)
        norm = np.sqrt(sq)
        if norm == 0:
            norm = 1.0
        for p in range(lo, k):
            out_val[p] = np.float32(np.float64(out_val[p]) / norm)
        nnz = k
        out_ptr[g + 1] = nnz
    return out_ptr, out_idx[:nnz], out_val[:nnz]
