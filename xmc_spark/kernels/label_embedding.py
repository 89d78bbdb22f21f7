"""PIFA label embeddings: each label's normalized sum of its positive samples' features."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

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
