"""k-nearest-neighbour label votes, the numpy core of the kNN re-ranker (issue #14).

A row's vote for label l is the share of its k most cosine-similar training rows' similarity
that carries l, each neighbour weighted by its similarity to the power p:

    vote(q, l) = sum_{j in N_k(q)} s_qj^p y_jl / sum_{j in N_k(q)} s_qj^p

Neighbours are the training rows with a label and similarity > 0, best first, ties to the
smaller row id (so the answer does not depend on how the rows are blocked); the stage passes
only labelled rows to :func:`block_topk`. The re-ranker mixes the vote
into the tree's scores of its top K candidates: ``w * tree + (1 - w) * vote``
(:func:`xmc_spark.kernels.prime.rerank`, the same mix as PRIME's).

Everything here is vectorized over rows; the Spark stage (:mod:`xmc_spark.stages.knn`) calls
:func:`block_topk` on one (query block, training block) pair per task and :func:`votes` on the
merged neighbour lists.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import scipy.sparse as sp

from .sparse import l2_normalize_rows

# dense similarity cells computed at once in block_topk (rows x training rows of a chunk)
CHUNK_CELLS = 1 << 22


def ranked(rows: np.ndarray, sims: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """Positions of the entries that are among their row's k best by (similarity desc, id asc),
    as an array of positions ordered by (row, rank)."""
    order = np.lexsort((ids, -sims, rows))
    return order[rank_in_row(rows[order]) < k]


def block_topk(Xq: sp.csr_matrix, Xa: sp.csr_matrix, a_ids: np.ndarray, k: int
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k most cosine-similar rows of ``Xa`` (global ids ``a_ids``) for each row of ``Xq``,
    similarity > 0 only: (query row, neighbour id, similarity) triples ordered by (query row,
    similarity desc, id asc). Memory: one chunk of at most :data:`CHUNK_CELLS` dense cells."""
    Q, A = l2_normalize_rows(Xq), l2_normalize_rows(Xa).T.tocsc()
    a_ids = np.asarray(a_ids, np.int64)
    out_r, out_i, out_s = [], [], []
    step = max(1, CHUNK_CELLS // max(1, Xa.shape[0]))
    for s in range(0, Q.shape[0], step):
        S = (Q[s:s + step] @ A).toarray() if A.shape[1] else np.zeros((min(step, Q.shape[0] - s), 0), np.float32)
        keep = S > 0
        if S.shape[1] > k:                                # the k-th best value of each row, ties kept
            keep &= S >= -np.partition(-S, k - 1, axis=1)[:, k - 1:k]
        r, c = np.nonzero(keep)
        sim = S[r, c]
        pos = ranked(r, sim, a_ids[c], k)
        out_r.append(r[pos] + s)
        out_i.append(a_ids[c[pos]])
        out_s.append(sim[pos].astype(np.float32))
    if not out_r:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(out_r).astype(np.int64), np.concatenate(out_i), np.concatenate(out_s)


def neighbour_arrays(rows: np.ndarray, rank: np.ndarray, sims: np.ndarray, labels: sp.csr_matrix, n: int,
                     kmax: int) -> Tuple[np.ndarray, sp.csr_matrix]:
    """(S, Yn) for :func:`votes` from neighbour triples: query row, rank (0 = best, < kmax),
    similarity, and the neighbours' label vectors (``labels``, one row per triple)."""
    rows, rank = np.asarray(rows, np.int64), np.asarray(rank, np.int64)
    slot = rows * kmax + rank
    S = np.zeros(n * kmax, np.float64)
    S[slot] = sims
    place = sp.csr_matrix((np.ones(len(slot)), (slot, np.arange(len(slot)))), shape=(n * kmax, len(slot)))
    return S.reshape(n, kmax), (place @ sp.csr_matrix(labels, dtype=np.float64)).tocsr()


def rank_in_row(rows: np.ndarray) -> np.ndarray:
    """Each entry's position within its row of entries ordered by row (0, 1, ... per row)."""
    rows = np.asarray(rows, np.int64)
    return np.arange(len(rows)) - np.searchsorted(rows, rows, side="left")


def votes(S: np.ndarray, Yn: sp.csr_matrix, cand: np.ndarray, k: int, power: float) -> np.ndarray:
    """n x K votes of each row's candidate labels (``cand``, -1 padded: vote 0).

    ``S`` (n x kmax): the rows' neighbour similarities best first, 0 where a row has fewer;
    ``Yn`` (n * kmax x labels): the label vectors of those neighbours, row ``q * kmax + r``
    for the r-th neighbour of row q. Only the first ``k`` <= kmax neighbours vote."""
    n, kmax = S.shape
    if k > kmax:
        raise ValueError(f"k = {k} neighbours asked, {kmax} computed")
    W = np.where(np.arange(kmax)[None, :] < k, np.power(np.maximum(S, 0.0), power), 0.0)
    W[S <= 0] = 0.0
    total = W.sum(axis=1)
    M = sp.csr_matrix((W.ravel(), np.arange(n * kmax), np.arange(0, n * kmax + 1, kmax)), shape=(n, n * kmax))
    V = (M @ sp.csr_matrix(Yn, dtype=np.float64)).tocsr()
    rows = np.repeat(np.arange(n), cand.shape[1])
    got = np.asarray(V[rows, np.maximum(cand, 0).ravel()]).reshape(cand.shape) if cand.size else \
        np.zeros(cand.shape)
    out = got / np.maximum(total, 1e-300)[:, None]
    return np.where((cand >= 0) & (total[:, None] > 0), out, 0.0)


def brute_force_votes(Xq: sp.csr_matrix, Xa: sp.csr_matrix, Ya: sp.csr_matrix, k: int, power: float) -> np.ndarray:
    """rows x labels votes by a full sort of every row's similarities (reference for tests);
    training rows without a label do not vote (they are not neighbours)."""
    S = (l2_normalize_rows(Xq, np.float64) @ l2_normalize_rows(Xa, np.float64).T).toarray()
    Ya = sp.csr_matrix(Ya, dtype=np.float64).toarray()
    labelled = Ya.sum(axis=1) > 0
    out = np.zeros((S.shape[0], Ya.shape[1]))
    for q in range(S.shape[0]):
        order = sorted((j for j in range(S.shape[1]) if S[q, j] > 0 and labelled[j]), key=lambda j: (-S[q, j], j))[:k]
        w = np.array([S[q, j] ** power for j in order])
        if len(order) and w.sum() > 0:
            out[q] = w @ Ya[order] / w.sum()
    return out
