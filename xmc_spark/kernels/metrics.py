"""Ranking metrics for XMC: P@k, nDCG@k, PSP@k (Jain et al. 2016), recall@k.

``per_sample_sums`` returns additive per-batch sums so that Spark can compute them per
partition and add them up; ``finalize`` turns the sums into percentages.
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
import scipy.sparse as sp


def propensities(label_counts: np.ndarray, n_samples: int, A: float = 0.55, B: float = 1.5,
                 n_labels: int = 0) -> np.ndarray:
    """p_l = 1 / (1 + C exp(-A log(N_l + B))), C = (log N - 1)(B + 1)^A, for the labels
    0..max(len(label_counts), n_labels) - 1: labels beyond the counts (never seen in training)
    have N_l = 0, so p_l = 1 / (1 + C B^-A), finite for B > 0 and N >= 2."""
    counts = np.zeros(max(len(label_counts), n_labels), dtype=np.float64)
    counts[:len(label_counts)] = label_counts
    C = (np.log(n_samples) - 1.0) * (B + 1.0) ** A
    return 1.0 / (1.0 + C * np.exp(-A * np.log(counts + B)))


def unseen(offsets: np.ndarray, labels: np.ndarray, seen: np.ndarray):
    """(mask of the ``labels`` outside ``seen`` (a boolean vector over label ids; ids past it are
    unseen too), number of rows having one); ``offsets`` cut ``labels`` into rows."""
    labels = np.asarray(labels, np.int64)
    miss = labels >= len(seen)
    miss[~miss] = ~seen[labels[~miss]]
    cum = np.concatenate([[0], np.cumsum(miss)])
    offsets = np.asarray(offsets, np.int64)
    return miss, int(np.count_nonzero(cum[offsets[1:]] - cum[offsets[:-1]]))


def hits_matrix(pred: np.ndarray, Y: sp.csr_matrix) -> np.ndarray:
    """Boolean (n x k): is pred[i, j] a true label of row i (pred -1 = empty slot)."""
    Y = sp.csr_matrix(Y)
    n, k = pred.shape
    L = max(Y.shape[1], int(pred.max()) + 1 if pred.size else 0)   # keys row * L + label stay unique
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(Y.indptr))
    truth = np.sort(rows * L + Y.indices.astype(np.int64))
    keys = np.arange(n, dtype=np.int64)[:, None] * L + pred.astype(np.int64)
    pos = np.searchsorted(truth, keys.ravel())
    pos = np.minimum(pos, max(len(truth) - 1, 0))
    hit = (truth[pos] == keys.ravel()) if len(truth) else np.zeros(keys.size, bool)
    return hit.reshape(n, k) & (pred >= 0)


def per_sample_sums(pred: np.ndarray, Y: sp.csr_matrix, inv_prop: np.ndarray, ks: Sequence[int]) -> Dict[str, float]:
    """Additive sums over the rows of one batch; see :func:`finalize`. ``inv_prop`` covers
    every label of Y and of pred (size it with ``propensities(..., n_labels=...)``)."""
    Y = sp.csr_matrix(Y)
    if Y.shape[1] > len(inv_prop) or (pred.size and pred.max() >= len(inv_prop)):
        raise ValueError(f"inv_prop has {len(inv_prop)} labels, Y has {Y.shape[1]} and pred labels up to "
                         f"{pred.max()}: pad the counts with propensities(..., n_labels=...)")
    kmax = max(ks)
    n = pred.shape[0]
    if pred.shape[1] < kmax:
        pred = np.hstack([pred, -np.ones((n, kmax - pred.shape[1]), dtype=pred.dtype)])
    pred = pred[:, :kmax]
    hit = hits_matrix(pred, Y)
    n_true = np.diff(Y.indptr)
    disc = 1.0 / np.log2(np.arange(2, kmax + 2))
    w = np.where(pred >= 0, inv_prop[np.maximum(pred, 0)], 0.0) * hit
    # ideal propensity-scored gain: the true labels' inverse propensities, largest first
    rows = np.repeat(np.arange(n), n_true)
    tv = inv_prop[Y.indices]
    order = np.lexsort((-tv, rows))
    tv, rows = tv[order], rows[order]
    rank = np.arange(len(rows)) - np.repeat(Y.indptr[:-1], n_true)
    out = {"n": float(n)}
    for k in ks:
        h = hit[:, :k]
        out[f"p@{k}"] = float(h.sum() / k)
        dcg = (h * disc[:k]).sum(axis=1)
        idcg = np.cumsum(disc)[np.minimum(n_true, k) - 1]
        out[f"ndcg@{k}"] = float(np.sum(np.where(n_true > 0, dcg / np.where(n_true > 0, idcg, 1), 0.0)))
        out[f"recall@{k}"] = float(np.sum(np.where(n_true > 0, h.sum(axis=1) / np.maximum(n_true, 1), 0.0)))
        out[f"psp_num@{k}"] = float(w[:, :k].sum())
        out[f"psp_den@{k}"] = float(tv[rank < k].sum())
    return out


def finalize(sums: Dict[str, float], ks: Sequence[int]) -> Dict[str, float]:
    """Percentages: P@k, nDCG@k and recall@k averaged over all rows; PSP@k normalized."""
    n = max(sums["n"], 1.0)
    out = {}
    for k in ks:
        out[f"p@{k}"] = 100.0 * sums[f"p@{k}"] / n
        out[f"ndcg@{k}"] = 100.0 * sums[f"ndcg@{k}"] / n
        out[f"recall@{k}"] = 100.0 * sums[f"recall@{k}"] / n
        den = sums[f"psp_den@{k}"]
        out[f"psp@{k}"] = 100.0 * sums[f"psp_num@{k}"] / den if den > 0 else 0.0
    return out


def add_sums(a: Dict[str, float], b: Dict[str, float]) -> Dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in set(a) | set(b)}


def evaluate(pred: np.ndarray, Y: sp.csr_matrix, inv_prop: np.ndarray, ks: Sequence[int] = (1, 3, 5)):
    return finalize(per_sample_sums(pred, Y, inv_prop, ks), ks)


def depth_sums(pred: np.ndarray, label_depth: np.ndarray, ks: Sequence[int]) -> Dict[str, float]:
    """Sums for expected depth@k: the depth of the deepest leaf among each row's top k labels."""
    d = np.where(pred >= 0, np.asarray(label_depth)[np.maximum(pred, 0)], -1)
    out = {}
    for k in ks:
        m = d[:, :k].max(axis=1) if d.shape[1] else np.full(d.shape[0], -1)
        out[f"depth_sum@{k}"] = float(m[m >= 0].sum())
        out[f"depth_n@{k}"] = float((m >= 0).sum())
    return out


def finalize_depth(sums: Dict[str, float], ks: Sequence[int]) -> Dict[str, float]:
    return {f"depth@{k}": sums[f"depth_sum@{k}"] / max(sums[f"depth_n@{k}"], 1.0) for k in ks}
