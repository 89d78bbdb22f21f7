"""Balanced spherical k-means split of one tree node (Parabel / PECOS style).

For two children: alternate (a) centroids = normalized sums of each half and (b) sort the
labels by v^T (mu+ - mu-) (one sparse-dense product with the difference of the centroids)
and give the top half to child 0, until the halves stop changing.
For B > 2 children, (b) becomes a greedy balanced assignment of labels to the centroids.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .jit import njit


def _centroids(Z: sp.csr_matrix, assign: np.ndarray, k: int) -> np.ndarray:
    """Normalized centroid per cluster, dense (k x d): one node's d-vector per child."""
    return normalized(_cluster_sums(Z.indptr, Z.indices, Z.data, np.asarray(assign, np.int64), k, Z.shape[1]))


@njit()
def _cluster_sums(ptr, idx, val, assign, k, d):
    """Sum of each cluster's rows (float32, rows added in order: the same sums as the sparse
    product of the membership matrix with Z, without building it or a sparse result)."""
    C = np.zeros((k, d), np.float32)
    _add_cluster_sums(C, ptr, idx, val, assign)
    return C


@njit()
def _add_cluster_sums(C, ptr, idx, val, assign):
    """Adds each row to its cluster's row of the float32 sums ``C``, rows in order (so sums
    carried over consecutive blocks of rows are those of :func:`_cluster_sums` over all)."""
    for i in range(len(ptr) - 1):
        c = assign[i]
        for p in range(np.uint64(ptr[i]), np.uint64(ptr[i + 1])):
            C[c, np.uint64(idx[p])] += val[p]


@njit()
def _similarities(ptr, idx, val, C):
    """Z @ C.T for a float32 CSR Z and dense float64 C (k x d), each row's sum taken in the
    order of its non-zeros (as scipy's CSR x dense product)."""
    m, k = len(ptr) - 1, C.shape[0]
    Ct = np.ascontiguousarray(C.T)          # d x k: a feature's k centroid values side by side
    S = np.zeros((m, k))
    for i in range(m):
        for p in range(np.uint64(ptr[i]), np.uint64(ptr[i + 1])):
            a = np.float64(val[p])
            j = np.uint64(idx[p])
            for c in range(k):
                S[i, c] += a * Ct[j, c]
    return S


@njit()
def _projection(ptr, idx, val, v):
    """Z @ v for a float32 CSR Z and a dense float64 d-vector, each row's sum taken in the order
    of its non-zeros (as scipy's CSR x vector product). For two children the split needs only
    the difference of the two similarities: one gather per non-zero, not two. It rounds
    differently from z^T c0 - z^T c1, so rows that tie (or nearly) at the cut may land on the
    other side than with the two products (binary rows; real-valued embeddings did not differ)."""
    m = len(ptr) - 1
    s = np.zeros(m)
    for i in range(m):
        a = 0.0
        for p in range(np.uint64(ptr[i]), np.uint64(ptr[i + 1])):
            a += np.float64(val[p]) * v[np.uint64(idx[p])]
        s[i] = a
    return s


@njit()
def _greedy_balanced(scores, caps):
    """Assign rows to columns by descending score, each column taking at most caps[j] rows."""
    m, k = scores.shape
    flat = np.argsort(-scores.ravel(), kind="mergesort")
    assign = -np.ones(m, dtype=np.int64)
    load = np.zeros(k, dtype=np.int64)
    left = m
    for f in flat:
        i = f // k
        j = f % k
        if assign[i] >= 0 or load[j] >= caps[j]:
            continue
        assign[i] = j
        load[j] += 1
        left -= 1
        if left == 0:
            break
    return assign


def split_caps(m: int, nr_splits: int) -> np.ndarray:
    """Child sizes of a balanced split of m rows: ceil or floor of m / k (k = min(B, m)), the
    larger parts first."""
    k = min(int(nr_splits), int(m))
    base, extra = divmod(int(m), k)
    caps = np.full(k, base, dtype=np.int64)
    caps[:extra] += 1
    return caps


def initial_rows(m: int, k: int, seed: int) -> np.ndarray:
    """The k distinct rows (of m, in label order) whose normalized embeddings start the split."""
    return np.random.default_rng(seed).choice(m, size=k, replace=False)


def normalized(C: np.ndarray) -> np.ndarray:
    """Rows of C scaled to unit L2 norm (a zero row stays zero), as float64."""
    C = np.asarray(C, dtype=np.float64)
    n = np.linalg.norm(C, axis=1, keepdims=True)
    n[n == 0] = 1.0
    return C / n


def assignment(scores: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """One step's child of every row from its scores: for two children ``scores`` is the vector
    z^T (c0 - c1) and the top caps[0] rows (ties in row order) go to child 0; for more, the
    m x k similarities and the greedy balanced assignment."""
    if len(caps) == 2 and scores.ndim == 1:
        order = np.argsort(-scores, kind="mergesort")
        new = np.ones(len(scores), dtype=np.int64)
        new[order[: caps[0]]] = 0
        return new
    return _greedy_balanced(scores, caps)


def balanced_split(Z: sp.csr_matrix, nr_splits: int = 2, max_iter: int = 20, seed: int = 0) -> np.ndarray:
    """Split the rows of Z (label embeddings of one node) into ``nr_splits`` balanced parts.

    Returns an int array of child positions in [0, nr_splits); part sizes differ by at most 1
    (child j gets ceil or floor of m / B, the larger parts first). Deterministic for a seed.
    The steps (:func:`initial_rows`, :func:`assignment`, :func:`normalized` sums) are those the
    split across tasks (:mod:`..stages.split_across`) takes with the rows spread over partitions.
    """
    Z = sp.csr_matrix(Z, dtype=np.float32)
    m = Z.shape[0]
    return balanced_split_streamed(lambda: iter([(np.arange(m), Z)]), m, Z.shape[1], nr_splits, max_iter, seed)


def balanced_split_streamed(blocks, m: int, d: int, nr_splits: int = 2, max_iter: int = 20,
                            seed: int = 0) -> np.ndarray:
    """:func:`balanced_split` (which is this over one block) of m rows that need not be held
    together: ``blocks()`` yields them anew at every call as (positions, float32 CSR rows with d
    columns), each position in [0, m) once. Each step is two passes (the scores of every row,
    then the sums of each child's rows) and holds O(m x k + k x d) numbers besides one block.
    With the blocks in position order (positions rising within and across blocks) the steps are
    the kernel's to the last bit: the float32 sums are carried from block to block
    (:func:`_add_cluster_sums`), each row's score is its own, and the seeded rows, the
    assignment and the stop are the same."""
    k = min(int(nr_splits), int(m))
    if m <= 1 or k <= 1:
        return np.zeros(m, dtype=np.int64)
    caps = split_caps(m, k)
    seeds = initial_rows(m, k, seed)
    by_pos = np.argsort(seeds)
    sorted_seeds = seeds[by_pos]
    C32 = np.zeros((k, d), np.float32)
    seen = np.zeros(m, np.int64)
    for pos, Z in blocks():                     # the seeded rows, and a check that each row comes once
        np.add.at(seen, pos, 1)
        at = np.minimum(np.searchsorted(sorted_seeds, pos), k - 1)
        hit = np.flatnonzero(sorted_seeds[at] == pos)
        C32[by_pos[at[hit]]] = Z[hit].toarray()
    if not np.all(seen == 1):
        bad = int(np.flatnonzero(seen != 1)[0])
        raise RuntimeError(f"balanced split: the blocks hold row {bad} of {m} {int(seen[bad])} times, not once")
    C = normalized(C32)
    assign = None
    for _ in range(max_iter):
        S = np.empty(m) if k == 2 else np.empty((m, k))
        v = C[0] - C[1] if k == 2 else C      # z^T (c0 - c1) = z^T c0 - z^T c1 up to rounding
        for pos, Z in blocks():
            S[pos] = _projection(Z.indptr, Z.indices, Z.data, v) if k == 2 else \
                _similarities(Z.indptr, Z.indices, Z.data, v)
        new = assignment(S, caps)
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        C32[:] = 0
        for pos, Z in blocks():
            _add_cluster_sums(C32, Z.indptr, Z.indices, Z.data, assign[pos])
        C = normalized(C32)
    return assign
