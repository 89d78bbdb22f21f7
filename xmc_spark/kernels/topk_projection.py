"""Overlapping label clusters: the closed form C* = top-lambda of each row of Y^T M (lambda =
``copies``, config key ``clusters.copies``).

Y^T M counts, for each label and leaf cluster, the label's positive training samples that
the matcher sends to that cluster (M: n x K, b ones per row). Keeping the lambda largest
entries of each row maximizes Tr(Y^T M C^T) under "at most lambda clusters per label"
(Theorem 2 of the label-disentanglement paper). Ties go to the label's current cluster,
then to the smaller cluster id; a label with an empty row keeps its current cluster.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np


def topk_projection(label: np.ndarray, leaf: np.ndarray, value: np.ndarray, copies: int,
                    current_label: np.ndarray, current_leaf: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Sparse (label, leaf, value) entries of Y^T M -> new (label, leaf) assignments.

    ``current_label``/``current_leaf`` give every label's present cluster(s): used for ties
    and for labels with no positive entry. Output is sorted by (label, leaf).
    """
    label = np.asarray(label, dtype=np.int64)
    leaf = np.asarray(leaf, dtype=np.int64)
    value = np.asarray(value, dtype=np.float64)
    cur_key = np.unique(np.asarray(current_label, np.int64) * (2 ** 40) + np.asarray(current_leaf, np.int64))
    ok = value > 0
    label, leaf, value = label[ok], leaf[ok], value[ok]
    key = label * (2 ** 40) + leaf
    is_cur = np.isin(key, cur_key)
    order = np.lexsort((leaf, ~is_cur, -value, label))
    label, leaf = label[order], leaf[order]
    start = np.searchsorted(label, label, side="left")
    rank = np.arange(len(label)) - start
    keep = rank < copies
    out_label, out_leaf = label[keep], leaf[keep]
    # labels with no positive entry keep their current cluster(s)
    missing = ~np.isin(np.asarray(current_label, np.int64), out_label)
    out_label = np.concatenate([out_label, np.asarray(current_label, np.int64)[missing]])
    out_leaf = np.concatenate([out_leaf, np.asarray(current_leaf, np.int64)[missing]])
    o = np.lexsort((out_leaf, out_label))
    return out_label[o], out_leaf[o]

