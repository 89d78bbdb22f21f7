"""Test oracles: slow, direct renderings of what the kernels compute, for tiny inputs only.

No library code calls these; tests compare the kernels (and through them the Spark stages)
with them. Import as ``from tests.oracles import ...``.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from xmc_spark.kernels import frequencies as FQ
from xmc_spark.kernels.squared_hinge import _dcd, _row_norms
from xmc_spark.kernels.topk_projection import topk_projection

# ---- beam search ------------------------------------------------------------------------------

_POST = {
    "l3-hinge": lambda v: np.exp(-np.maximum(0.0, 1.0 - v) ** 3),
    "l2-hinge": lambda v: np.exp(-np.maximum(0.0, 1.0 - v) ** 2),
    "sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
}


def exhaustive_scores(X: sp.csr_matrix, layers, slot_label: np.ndarray, n_labels: int,
                      post_processor: str = "l3-hinge") -> np.ndarray:
    """Dense (n x n_labels) path scores of every label: what beam search approximates.

    ``layers`` as :meth:`XMCModel.layers` gives them; a label in several leaves gets the mean
    of its path scores. Memory n x labels.
    """
    X = sp.csr_matrix(X)
    post = _POST[post_processor]
    S = np.ones((X.shape[0], 1))
    for child_ptr, W, passthrough in layers:
        parent = np.repeat(np.arange(len(child_ptr) - 1), np.diff(child_ptr))
        raw = np.asarray((X @ sp.csc_matrix(W)).todense())
        T = np.where(np.asarray(passthrough)[None, :], 1.0, post(raw))
        S = S[:, parent] * T
    out = np.zeros((X.shape[0], n_labels))
    cnt = np.zeros(n_labels)
    np.add.at(cnt, slot_label, 1)
    for k, lab in enumerate(slot_label):
        out[:, lab] += S[:, k]
    return out / np.maximum(cnt, 1)[None, :]


# ---- squared-hinge SVM ------------------------------------------------------------------------

def train_binary(X: sp.csr_matrix, y: np.ndarray, C: float = 1.0, weights=None, eps: float = 0.1,
                 max_iter: int = 100, seed: int = 0) -> np.ndarray:
    """Dense weight vector of one squared-hinge classifier (y in {-1, +1}) over every feature:
    the dual solver called directly, without train_node's feature compaction and pruning."""
    X = sp.csr_matrix(X, dtype=np.float64)
    Ci = np.full(X.shape[0], float(C)) if weights is None else float(C) * np.asarray(weights, dtype=np.float64)
    keep = Ci > 0
    if not keep.all():
        X, y, Ci = X[keep], np.asarray(y)[keep], Ci[keep]
    indptr, indices = X.indptr.astype(np.int64), X.indices.astype(np.int64)
    w = np.zeros(X.shape[1])
    _dcd(indptr, indices, X.data, _row_norms(indptr, X.data), np.asarray(y, dtype=np.float64), Ci, w, float(eps),
         int(max_iter), int(seed))
    return w


def primal_objective(w: np.ndarray, X, y, C: float = 1.0, weights=None) -> float:
    """0.5 ||w||^2 + sum_i C_i max(0, 1 - y_i w.x_i)^2."""
    Ci = np.full(X.shape[0], float(C)) if weights is None else float(C) * np.asarray(weights)
    margin = np.maximum(0.0, 1.0 - y * (X @ w))
    return float(0.5 * w @ w + np.sum(Ci * margin ** 2))


# ---- overlapping clusters ---------------------------------------------------------------------

def projection_dense(A: np.ndarray, copies: int, current: np.ndarray) -> np.ndarray:
    """Binary C (L x K) with the top-``copies`` positive entries of each row of A."""
    L, K = A.shape
    r, c = np.nonzero(A)
    lab, lf = topk_projection(r, c, A[r, c], copies, np.arange(L), current)
    C = np.zeros((L, K), dtype=np.int64)
    C[lab, lf] = 1
    return C


def coverage(Y: sp.csr_matrix, M: sp.csr_matrix, C: np.ndarray) -> float:
    """Tr(Y^T Binary(M C^T)): positive (sample, label) pairs whose label sits in a matched cluster."""
    hit = (sp.csr_matrix(M) @ sp.csr_matrix(C).T)
    hit.data[:] = 1
    return float(sp.csr_matrix(Y).multiply(hit).sum())


# ---- label frequencies ------------------------------------------------------------------------

def f_tilde_greedy_rounds(offsets, labels, n_labels: int, p=None, k: int = 12):
    """Greedy f-tilde by rounds on in-memory data: what the Spark stage does, minus Spark."""
    return FQ.greedy_by_rounds(n_labels, FQ.marginal(offsets, labels, n_labels, p), k,
                               lambda sel, bits: FQ.mask_counts(offsets, labels, p, sel, bits))


# ---- EAGLE ------------------------------------------------------------------------------------

def grlr_reference(X: np.ndarray, groups: dict, label_groups: dict, label: int, T: int = 20,
                   eta: float = 0.1) -> np.ndarray:
    """Algorithm 1 (GRLR) for one label, dense and loop by loop: ``groups`` maps group -> list of
    member rows (in sample-id order), ``label_groups`` label -> list of its groups."""
    def proj(v):
        n = np.linalg.norm(v)
        return v / n if n > 0 else v

    Mk = label_groups[label]
    e = proj(sum(X[i] for j in Mk for i in groups[j]))
    for _ in range(T):
        acc = np.zeros(X.shape[1])
        for j in Mk:
            sc = np.array([X[i] @ e for i in groups[j]])
            tied = np.flatnonzero(sc == sc.max())
            acc += X[groups[j][tied[label % len(tied)]]]
        e = proj(e + eta * proj(acc))
    return e


# ---- the reference pipeline -------------------------------------------------------------------

def reference_run(folder, **train_kw):
    """The single-process reference trainer (:meth:`XMCModel.train_local`) on ``folder``'s
    train.txt, its predictions for test.txt and their P@k / nDCG@k / PSP@k by the numpy metrics
    kernel: (model, test features, predictions, metrics)."""
    from xmc_spark.kernels import metrics as M
    from xmc_spark.local_io import read_xc
    from xmc_spark.model import XMCModel
    Xtr, Ytr = read_xc(str(folder / "train.txt"))
    Xt, Yt = read_xc(str(folder / "test.txt"))
    model = XMCModel.train_local(Xtr, Ytr, **train_kw)
    pred, _ = model.predict(Xt)
    counts = np.asarray(Ytr.sum(axis=0)).ravel()
    return model, Xt, pred, M.evaluate(pred, Yt, 1 / M.propensities(counts, Xtr.shape[0]), (1, 3, 5))
