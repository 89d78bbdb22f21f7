"""Sparse-matrix helpers shared by the kernels and the Spark stages."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def csr_from_lists(offsets: np.ndarray, indices: np.ndarray, values, n_cols: int) -> sp.csr_matrix:
    """CSR matrix from list offsets (as in an Arrow ListArray) and flat indices/values.

    Duplicate indices inside a row are summed; rows need not be sorted.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    indices = np.array(indices, dtype=np.int32)
    if values is None:
        values = np.ones(len(indices), dtype=np.float32)
    m = sp.csr_matrix((np.array(values, dtype=np.float32), indices, offsets),
                      shape=(len(offsets) - 1, n_cols))
    m.sum_duplicates()
    return m


def l2_normalize_rows(m: sp.csr_matrix) -> sp.csr_matrix:
    """Scale each row to unit L2 norm (all-zero rows stay zero)."""
    m = m.tocsr(copy=True).astype(np.float32)
    sq = np.asarray(m.multiply(m).sum(axis=1)).ravel()
    norms = np.sqrt(sq)
    norms[norms == 0] = 1.0
    m.data /= np.repeat(norms, np.diff(m.indptr)).astype(np.float32)
    return m


def append_bias(X: sp.csr_matrix, bias: float) -> sp.csr_matrix:
    """Append a constant column ``bias`` (liblinear/PECOS style bias term)."""
    if bias <= 0:
        return X.tocsr()
    col = sp.csr_matrix(np.full((X.shape[0], 1), bias, dtype=np.float32))
    return sp.hstack([X, col], format="csr", dtype=np.float32)
