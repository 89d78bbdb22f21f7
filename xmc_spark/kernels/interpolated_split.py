"""Interpolated label-tree split (Bremer et al., CIKM 2021, objective (4)).

One knob lambda in [0, 2] moves a node's 2-way split from balanced spherical 2-means
(lambda = 0) through frequency-weighted 2-means (1) to Fano coding (2):

    max  sum_l f_l(lam) (2 - lam) ((1 + a_l)/2 v_l.mu+ + (1 - a_l)/2 v_l.mu-) + a_l (lam - 1)+ f_l(lam)^2
    over ||mu+-|| = 1, a in [-1, 1]^L, a . f(lam) = 0

    f_l(lam) = ((2 - lam) f_l^(lam ^ 1) + (lam - 1)+ ft_l + gamma / L) / (normalizer)

with f the node's marginal label frequencies and ft (f-tilde) the depth-oriented
frequencies (:mod:`.frequencies`), both renormalized over the node's labels.

Alternating maximization: mu+- are the f(lam)-weighted centroids of the two sides; alpha is
the LP optimum of Lemma 1 (sort by beta_l / f_l(lam), +1 from the top until a . f(lam) >= 0,
the last one fractional), then rounded: the fractional label goes to the +1 side (the
paper's Fano rule: the label whose mass crosses one half joins the left child). Iterations
stop when the rounded assignment repeats or the objective stops rising (the best assignment
seen is kept), or after ``max_iter``.

Side +1 becomes child position 0 (the left child), side -1 position 1.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def lambda_from_prime(lambda_prime: float) -> float:
    """The paper's reparametrization lambda = 2 l' / (1 + l') (l' in [0, inf) -> [0, 2))."""
    lp = float(lambda_prime)
    if np.isinf(lp):
        return 2.0
    return 2.0 * lp / (1.0 + lp)


def _normalized(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    s = x.sum()
    if s <= 0:
        return np.full(len(x), 1.0 / max(len(x), 1))
    return x / s


def node_frequencies(f: np.ndarray, f_tilde: np.ndarray, lam: float, gamma: float) -> np.ndarray:
    """f(lam) of the paper over one node's labels (sums to 1).

    f and f_tilde are first renormalized over the node's labels (a node whose labels have no
    mass gets uniform ones). The normalizer is the sum of the numerators, which equals the
    paper's when f_tilde sums to one.
    """
    L = len(f)
    fn = _normalized(f)
    ftn = _normalized(f_tilde)
    lo = min(lam, 1.0)
    hi = max(lam - 1.0, 0.0)
    with np.errstate(divide="ignore"):
        powered = np.power(fn, lo) if lo > 0 else np.ones(L)
    num = (2.0 - lam) * powered + hi * ftn + gamma / L
    s = num.sum()
    return num / s if s > 0 else np.full(L, 1.0 / L)


def lemma1_alpha(key: np.ndarray, fl: np.ndarray):
    """Optimal alpha of LP (5) given key = beta / f(lam) and f(lam) > 0 summing to 1.

    Returns (alpha, order, cut): ``order`` sorts the labels by key, descending (stable, so
    ties go to the smaller position first); labels order[:cut] are +1, order[cut - 1] may be
    fractional, the rest are -1.
    """
    L = len(fl)
    order = np.argsort(-np.asarray(key, dtype=np.float64), kind="mergesort")
    before = -1.0 + 2.0 * np.concatenate([[0.0], np.cumsum(fl[order])[:-1]])  # a.f before label t
    after = before + 2.0 * fl[order]
    hit = np.flatnonzero(after >= -1e-12)
    cut = int(hit[0]) + 1 if len(hit) else L
    alpha = -np.ones(L)
    alpha[order[: cut - 1]] = 1.0
    last = order[cut - 1]
    alpha[last] = float(np.clip(-before[cut - 1] / fl[last] - 1.0, -1.0, 1.0))
    return alpha, order, cut


def _round(order: np.ndarray, cut: int) -> np.ndarray:
    """Rounded sides as child positions (0 = +1 side): order[:cut] left, the rest right; both
    sides kept non-empty."""
    L = len(order)
    cut = min(max(cut, 1), L - 1)
    pos = np.ones(L, dtype=np.int64)
    pos[order[:cut]] = 0
    return pos


def _centroids(Z: sp.csr_matrix, pos: np.ndarray, fl: np.ndarray) -> np.ndarray:
    """f(lam)-weighted, L2-normalized centroid of each side: 2 x d dense."""
    L = Z.shape[0]
    A = sp.csr_matrix((fl, (pos, np.arange(L))), shape=(2, L))
    C = np.asarray((A @ Z).todense(), dtype=np.float64)
    n = np.linalg.norm(C, axis=1, keepdims=True)
    n[n == 0] = 1.0
    return C / n


def objective(Z: sp.csr_matrix, pos: np.ndarray, C: np.ndarray, fl: np.ndarray, lam: float) -> float:
    """Objective (4) at a rounded assignment (pos 0 -> alpha +1) and centroids C (2 x d)."""
    S = np.asarray(Z @ C.T, dtype=np.float64)
    alpha = np.where(pos == 0, 1.0, -1.0)
    match = np.where(pos == 0, S[:, 0], S[:, 1])
    return float(np.sum(fl * (2.0 - lam) * match + alpha * max(lam - 1.0, 0.0) * fl * fl))


def interpolated_split(Z: sp.csr_matrix, f: np.ndarray, f_tilde: np.ndarray, lam: float,
                       gamma: float = 0.1, max_iter: int = 20, seed: int = 0) -> np.ndarray:
    """Child positions (0 or 1) of the rows of Z (one node's label embeddings).

    ``f`` and ``f_tilde`` are the labels' marginal and f-tilde frequencies (any scale).
    lam = 0 gives balanced spherical 2-means (sides of ceil(L/2) and floor(L/2) labels),
    lam = 2 a Fano split on f_tilde (smoothed by gamma).
    """
    if not 0.0 <= lam <= 2.0:
        raise ValueError(f"lambda must be in [0, 2], got {lam}")
    Z = sp.csr_matrix(Z, dtype=np.float64)
    L = Z.shape[0]
    if L <= 1:
        return np.zeros(L, dtype=np.int64)
    fl = node_frequencies(np.asarray(f, np.float64), np.asarray(f_tilde, np.float64), lam, gamma)
    hi = max(lam - 1.0, 0.0)
    rng = np.random.default_rng(seed)
    init = rng.choice(L, size=2, replace=False)
    C = np.asarray(Z[init].todense(), dtype=np.float64)
    n = np.linalg.norm(C, axis=1, keepdims=True)
    n[n == 0] = 1.0
    C /= n
    best_pos, best_obj, pos = None, -np.inf, None
    for _ in range(max_iter):
        S = np.asarray(Z @ C.T, dtype=np.float64)
        # beta_l / f_l(lam), written without the division so lam = 0 sorts exactly by S+ - S-
        key = (2.0 - lam) / 2.0 * (S[:, 0] - S[:, 1]) + hi * fl
        _, order, cut = lemma1_alpha(key, fl)
        new = _round(order, cut)
        if pos is not None and np.array_equal(new, pos):
            break
        pos = new
        C = _centroids(Z, pos, fl)
        obj = objective(Z, pos, C, fl, lam)
        if best_pos is not None and obj <= best_obj + 1e-12 * max(1.0, abs(best_obj)):
            break
        best_pos, best_obj = pos, obj
    return best_pos
