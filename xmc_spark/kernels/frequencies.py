"""Label frequencies for interpolated trees (CIKM 2021, Appendix B).

- marginal f = Y^T p (p = context frequencies, 1 per sample by default);
- f-tilde, ``marginal`` (Algorithm 2): each context's mass goes to its most frequent label
  (under f; ties to the smaller label id);
- f-tilde, ``greedy`` (Algorithm 1): repeatedly take the label covering the most remaining
  mass (ties to the smaller label id), give it that mass, remove the contexts that carry it.

Label lists come CSR-style: ``offsets`` (n + 1) and ``labels`` (the concatenated lists).

The greedy loop is run in rounds that need one aggregation over the data each (the Spark
stage runs :func:`mask_counts` per partition and sums). A round takes the K labels with the
most remaining mass as candidates and aggregates, over the remaining contexts, the mass per
(label, mask), where mask records which candidates the context carries. From that table the
driver replays the greedy exactly (:func:`replay_round`) for as long as it picks candidates:
the remaining mass of ANY label after removing the contexts of the picked candidates is a
sum over the masks that avoid them. The first non-candidate pick ends the round (its
contexts are filtered out by the next round). The table has at most min(nnz, L * 2^K) rows,
so driver memory grows with labels, not samples.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np


def _rows(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))


def marginal(offsets, labels, n_labels: int, p=None) -> np.ndarray:
    """f = Y^T p."""
    offsets = np.asarray(offsets, np.int64)
    labels = np.asarray(labels, np.int64)
    w = np.ones(len(labels)) if p is None else np.asarray(p, np.float64)[_rows(offsets)]
    return np.bincount(labels, weights=w, minlength=n_labels).astype(np.float64)


def f_tilde_marginal(offsets, labels, f: np.ndarray, p=None) -> np.ndarray:
    """Algorithm 2: each context's mass to the label of highest f it carries (ties: smaller id).

    Additive over samples, so Spark sums it per partition.
    """
    offsets = np.asarray(offsets, np.int64)
    labels = np.asarray(labels, np.int64)
    n = len(offsets) - 1
    out = np.zeros(len(f), dtype=np.float64)
    if len(labels) == 0:
        return out
    rows = _rows(offsets)
    order = np.lexsort((labels, -np.asarray(f, np.float64)[labels], rows))
    has = np.diff(offsets) > 0
    first = offsets[:-1][has]                     # sorted by row, the first entry is the winner
    winner = labels[order][first]
    pm = np.ones(n) if p is None else np.asarray(p, np.float64)
    np.add.at(out, winner, pm[has])
    return out


def f_tilde_greedy(offsets, labels, n_labels: int, p=None) -> np.ndarray:
    """Algorithm 1, direct numpy rendering (the reference for the round-based version)."""
    offsets = np.asarray(offsets, np.int64)
    labels = np.asarray(labels, np.int64)
    n = len(offsets) - 1
    rows = _rows(offsets)
    pm = np.ones(n) if p is None else np.asarray(p, np.float64).copy()
    counts = np.bincount(labels, weights=pm[rows], minlength=n_labels).astype(np.float64)
    # label -> rows carrying it (CSC of Y)
    by_label = np.argsort(labels, kind="mergesort")
    lptr = np.concatenate([[0], np.cumsum(np.bincount(labels, minlength=n_labels))])
    alive = pm > 0
    out = np.zeros(n_labels)
    while True:
        i = int(np.argmax(counts))                # first maximum: smaller id wins ties
        if counts[i] <= 0:
            return out
        out[i] = counts[i]
        r = rows[by_label[lptr[i]:lptr[i + 1]]]
        r = r[alive[r]]
        alive[r] = False
        for row in r:                             # each row is removed once: O(nnz) in total
            counts[labels[offsets[row]:offsets[row + 1]]] -= pm[row]
        counts[i] = 0.0
        np.maximum(counts, 0.0, out=counts)


def mask_counts(offsets, labels, p, selected: np.ndarray,
                cand_bit: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over the contexts that carry no ``selected`` label: mass per (mask, label), where a
    context's mask ORs ``cand_bit`` (1 << j for candidate j, else 0) over its labels.

    Returns (mask, label, mass) with unique (mask, label) pairs.
    """
    offsets = np.asarray(offsets, np.int64)
    labels = np.asarray(labels, np.int64)
    n = len(offsets) - 1
    if len(labels) == 0:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0)
    rows = _rows(offsets)
    pm = np.ones(n) if p is None else np.asarray(p, np.float64)
    hit = np.bincount(rows, weights=selected[labels].astype(np.float64), minlength=n)
    bits = cand_bit[labels]
    mask = np.zeros(n, dtype=np.int64)
    np.bitwise_or.at(mask, rows, bits)
    keep = (hit[rows] == 0) & (pm[rows] > 0)
    m, lab, w = mask[rows][keep], labels[keep], pm[rows][keep]
    key = m * (int(labels.max()) + 1) + lab
    uk, inv = np.unique(key, return_inverse=True)
    mass = np.bincount(inv, weights=w)
    L1 = int(labels.max()) + 1
    return uk // L1, uk % L1, mass


def top_candidates(counts: np.ndarray, k: int) -> np.ndarray:
    """The k labels of largest positive remaining mass (ties: smaller id)."""
    pos = np.flatnonzero(counts > 0)
    order = np.lexsort((pos, -counts[pos]))
    return pos[order[:k]]


def replay_round(mask: np.ndarray, label: np.ndarray, mass: np.ndarray, candidates: np.ndarray,
                 n_labels: int, out: np.ndarray, selected: np.ndarray) -> Tuple[bool, np.ndarray]:
    """Replay greedy picks from one round's (mask, label, mass) table.

    Updates ``out`` (f-tilde) and ``selected`` in place. Returns (finished, counts): finished
    when no label has mass left; counts = remaining mass per label after this round's picks
    (exact), from which the next round's candidates come.
    """
    bit_of = {int(c): j for j, c in enumerate(candidates)}
    S = 0
    while True:
        live = (mask & S) == 0
        counts = np.bincount(label[live], weights=mass[live], minlength=n_labels)
        counts[selected] = 0.0
        i = int(np.argmax(counts))
        if counts[i] <= 0:
            return True, counts
        out[i] = counts[i]
        selected[i] = True
        if i not in bit_of:
            # its contexts are not in the masks: the next round filters them out; the counts
            # before this pick (upper bounds from now on) still make good candidates
            counts[i] = 0.0
            return False, counts
        S |= 1 << bit_of[i]


def greedy_by_rounds(n_labels: int, f: np.ndarray, k: int, mask_table, on_round=None):
    """Algorithm 1 by rounds. ``mask_table(selected, cand_bit)`` returns one round's
    (mask, label, mass) table over the remaining contexts (:func:`mask_counts` summed over
    the data, in memory or on Spark); ``f`` (the marginal counts) seeds the first candidates.

    Returns (f_tilde, number of rounds).
    """
    out = np.zeros(n_labels)
    selected = np.zeros(n_labels, dtype=bool)
    counts = np.asarray(f, np.float64).copy()
    rounds = 0
    while True:
        cand = top_candidates(counts, k)
        cand_bit = np.zeros(n_labels, dtype=np.int64)
        cand_bit[cand] = 1 << np.arange(len(cand), dtype=np.int64)
        m, lab, w = mask_table(selected.copy(), cand_bit)
        rounds += 1
        done, counts = replay_round(m, lab, w, cand, n_labels, out, selected)
        if on_round is not None:
            on_round(rounds, selected, out)
        if done:
            return out, rounds


def label_frequencies(offsets, labels, n_labels: int, f_tilde: str = "marginal", p=None):
    """(f, f_tilde) of a label matrix in memory: the numpy reference of the Spark stage."""
    f = marginal(offsets, labels, n_labels, p)
    if f_tilde == "marginal":
        return f, f_tilde_marginal(offsets, labels, f, p)
    if f_tilde == "greedy":
        return f, f_tilde_greedy(offsets, labels, n_labels, p)
    raise ValueError(f"f_tilde must be 'greedy' or 'marginal', got {f_tilde!r}")
