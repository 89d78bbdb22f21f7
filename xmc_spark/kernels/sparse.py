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


def normalize_lists(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` with each list (``values[offsets[i] - offsets[0]:offsets[i + 1] - offsets[0]]``, a CSR
    row or an Arrow list) divided by its L2 norm, summed in float64; all-zero lists stay zero.
    Returns a new array of ``values``' dtype (float64 for integer values)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    values = np.asarray(values)
    dtype = values.dtype if np.issubdtype(values.dtype, np.floating) else np.float64
    n = len(offsets) - 1
    rows = np.repeat(np.arange(n), np.diff(offsets))
    norms = np.sqrt(np.bincount(rows, weights=values.astype(np.float64) ** 2, minlength=n))
    norms[norms == 0] = 1.0
    return (values / norms[rows]).astype(dtype, copy=False)


def l2_normalize_rows(m: sp.csr_matrix, dtype=np.float32) -> sp.csr_matrix:
    """Each row scaled to unit L2 norm (all-zero rows stay zero), as a new ``dtype`` CSR matrix
    with repeated indices summed first."""
    m = sp.csr_matrix(m, dtype=dtype, copy=True)
    m.sum_duplicates()
    m.data = normalize_lists(m.indptr, m.data)
    return m


def append_bias(X: sp.csr_matrix, bias: float) -> sp.csr_matrix:
    """Append a constant column ``bias`` (liblinear/PECOS style bias term)."""
    if bias <= 0:
        return X.tocsr()
    col = sp.csr_matrix(np.full((X.shape[0], 1), bias, dtype=np.float32))
    return sp.hstack([X, col], format="csr", dtype=np.float32)
