"""EAGLE kernels (Shen et al., ICML 2020): GRLR label embeddings from group-level labels and
the assignment of each group label to the member(s) it fits.

The work unit is a list of *triples* (label, group, member row) sorted by (label, group,
sample id): the segment of one (label, group) lists that group's members. X holds the
members' feature rows (CSR, rows L2-normalized by ingest).

GRLR (Algorithm 1) for every label of a block, label by label:
    e_0 = Proj(sum of the members of all the label's groups)
    e_t = Proj(e_{t-1} + eta Proj(sum over the label's groups of its arg-max member under e_{t-1}))
Ties inside a group (e.g. a zero embedding) go to the member at position (label mod number of
tied members) in sample-id order, so different labels of a symmetric group take different
members (the paper's Figure 1 example) and the result is deterministic.

Assignment (Algorithm 2 and variants): ``hard`` gives each (group, label) to its arg-max
member (top-c members when the source gave a count c); ``soft`` keeps every member with
weight min(1, scale * g * softmax_members(tau <x_i, e_k>)), g = group size; ``joint``
(:func:`joint_weights`) assigns all the labels of a group at once, so that its labels compete
for its members (Sinkhorn scaling of exp(tau <x_i, e_k>) to the labels' counts and an equal
share per member).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import scipy.sparse as sp

from .beam_search import POST_PROCESSORS, _dot, _ids, _transform, _values
from .jit import njit
from .sparse import l2_normalize_rows


@njit()
def _triple_dots(eptr, eidx, eval_, lab, xptr, xidx, xval, row, n_cols):
    """<e_lab[t], x_row[t]> for every triple t. Triples come sorted by label: each label's
    embedding is scattered once into a dense buffer, so the cost is nnz(E) + sum of nnz(x)."""
    n = lab.shape[0]
    out = np.zeros(n, dtype=np.float64)
    dense = np.zeros(n_cols, dtype=np.float64)
    t = 0
    while t < n:
        k = lab[t]
        for p in range(eptr[k], eptr[k + 1]):
            dense[eidx[p]] = eval_[p]
        while t < n and lab[t] == k:
            r = row[t]
            v = 0.0
            for p in range(xptr[r], xptr[r + 1]):
                v += dense[xidx[p]] * xval[p]
            out[t] = v
            t += 1
        for p in range(eptr[k], eptr[k + 1]):
            dense[eidx[p]] = 0.0
    return out


@njit()
def _segment_argmax(seg_ptr, scores, lab_id):
    """Index of the chosen triple of each segment (ties: position lab_id mod #tied) and the
    sum of the segment maxima."""
    ns = seg_ptr.shape[0] - 1
    chosen = np.empty(ns, dtype=np.int64)
    total = 0.0
    for s in range(ns):
        chosen[s] = _argmax_at(scores, seg_ptr[s], seg_ptr[s + 1], lab_id[s])
        total += scores[chosen[s]]
    return chosen, total


@njit()
def _argmax_at(scores, lo, hi, lab_id):
    """The arg-max of scores[lo:hi] (non-empty); among exact ties the one at position
    lab_id mod #tied."""
    best = scores[lo]
    for t in range(lo + 1, hi):
        if scores[t] > best:
            best = scores[t]
    nt = 0
    for t in range(lo, hi):
        if scores[t] == best:
            nt += 1
    pick = lab_id % nt
    c = 0
    for t in range(lo, hi):
        if scores[t] == best:
            if c == pick:
                return t
            c += 1
    return lo


def _segments(lab: np.ndarray, grp: np.ndarray) -> np.ndarray:
    """Start offsets of the (label, group) runs of sorted triples, with the end appended."""
    n = len(lab)
    if n == 0:
        return np.zeros(1, np.int64)
    brk = np.flatnonzero((lab[1:] != lab[:-1]) | (grp[1:] != grp[:-1])) + 1
    return np.concatenate([[0], brk, [n]]).astype(np.int64)


def _sum_rows(lab: np.ndarray, row: np.ndarray, X: sp.csr_matrix, n_lab: int) -> sp.csr_matrix:
    """Per label, the sum of the X rows listed by (lab, row) pairs (repeats counted)."""
    A = sp.csr_matrix((np.ones(len(lab)), (lab, row)), shape=(n_lab, X.shape[0]))
    return sp.csr_matrix(A @ X)


class Triples:
    """Sorted (label, group, member row) triples of one block, with their segment structure.

    ``labels`` are local label positions 0..n_lab-1 (``label_ids`` gives the global ids used
    for tie-breaking); ``rows`` index X.
    """

    def __init__(self, lab, grp, row, sample_id, n_lab: int, label_ids=None, count=None, given=None):
        lab = np.asarray(lab, np.int64)
        grp = np.asarray(grp, np.int64)
        row = np.asarray(row, np.int64)
        sample_id = np.asarray(sample_id, np.int64)
        order = np.lexsort((sample_id, grp, lab))
        self.order = order                  # input position of each sorted triple
        self.lab, self.grp, self.row, self.sample_id = lab[order], grp[order], row[order], sample_id[order]
        self.count = None if count is None else np.asarray(count, np.int64)[order]
        # which triples' counts were given (the rest read as 1): all of them unless ``given`` says
        self.given = None if count is None else (
            np.ones(len(order), bool) if given is None else np.asarray(given, bool)[order])
        self.n_lab = int(n_lab)
        self.label_ids = np.arange(n_lab, dtype=np.int64) if label_ids is None else np.asarray(label_ids, np.int64)
        self.seg = _segments(self.lab, self.grp)
        self.seg_lab = self.lab[self.seg[:-1]] if len(self.lab) else np.zeros(0, np.int64)

    def scores(self, E: sp.csr_matrix, X: sp.csr_matrix) -> np.ndarray:
        E = sp.csr_matrix(E)
        X = sp.csr_matrix(X)
        i64 = np.int64
        return _triple_dots(E.indptr.astype(i64), E.indices.astype(i64), E.data.astype(np.float64), self.lab,
                            X.indptr.astype(i64), X.indices.astype(i64), X.data.astype(np.float64), self.row,
                            max(E.shape[1], X.shape[1]))

    def argmax(self, scores: np.ndarray):
        return _segment_argmax(self.seg, scores, self.label_ids[self.seg_lab])


def grlr_sums(tr: Triples, X: sp.csr_matrix, E: Optional[sp.csr_matrix]):
    """One GRLR step's additive parts: with E None, the sum of all members per label (e_0's
    direction); else the sum of each group's arg-max member under E, and the objective
    sum over the label's groups of the best member's similarity (per label).

    Additive over disjoint sets of (label, group) segments, so a head label's groups can be
    split across tasks and the parts summed.
    """
    if E is None:
        return _sum_rows(tr.lab, tr.row, X, tr.n_lab), np.zeros(tr.n_lab)
    s = tr.scores(E, X)
    chosen, _ = tr.argmax(s)
    obj = np.bincount(tr.seg_lab, weights=s[chosen], minlength=tr.n_lab)
    return _sum_rows(tr.lab[chosen], tr.row[chosen], X, tr.n_lab), obj


def grlr_update(E: Optional[sp.csr_matrix], G: sp.csr_matrix, eta: float) -> sp.csr_matrix:
    """e_0 = Proj(G) when E is None, else e_t = Proj(e_{t-1} + eta Proj(G)); Proj scales each
    row to unit norm, in float64."""
    if E is None:
        return l2_normalize_rows(G, np.float64)
    return l2_normalize_rows(E + eta * l2_normalize_rows(G, np.float64), np.float64)


@njit()
def _label_columns(xptr, xidx, lab, row, n_cols, at, sup, count):
    """Each label's support, the union of its triples' rows' columns (every e_t of the label
    lies in it: e_0 sums all the rows, later steps add chosen ones). With ``count``, counts
    them into at[k + 1]; else writes label k's columns from sup[at[k]] on (advancing at[k])."""
    mark = -np.ones(n_cols, dtype=np.int64)
    for t in range(lab.shape[0]):
        k = lab[t]
        r = row[t]
        for p in range(xptr[r], xptr[r + 1]):
            c = xidx[p]
            if mark[c] != k:
                mark[c] = k
                if count:
                    at[k + 1] += 1
                else:
                    sup[at[k]] = c
                    at[k] += 1


@njit()
def _add_row(acc, xptr, xidx, xval, r):
    for p in range(xptr[r], xptr[r + 1]):
        acc[xidx[p]] += xval[p]


@njit()
def _norm_on(v, sup, lo, hi):
    s = 0.0
    for q in range(lo, hi):
        s += v[sup[q]] * v[sup[q]]
    return np.sqrt(s)


@njit()
def _grlr_labels(xptr, xidx, xval, n_cols, lab, row, seg, seg_lab, seg_lab_id, n_lab, T, eta):
    """GRLR (Algorithm 1) label by label, each label's embedding held dense while its T steps
    run: the arithmetic of :func:`grlr_sums` / :func:`grlr_update` (float64 sums, a zero sum
    stays zero, ties as :func:`_segment_argmax`), without a sparse matrix per step. A label's
    rows are added in triple order (group, sample), where the sparse product adds them in row
    order: identical results where those float64 sums are exact (unit rows of binary features,
    as bibtex's and delicious's), else equal up to rounding. Returns (CSR offsets, column
    indices, values) of E and the objective (T+1 x n_lab)."""
    sptr = np.zeros(n_lab + 1, dtype=np.int64)
    _label_columns(xptr, xidx, lab, row, n_cols, sptr, np.empty(0, dtype=np.int64), True)
    sptr = np.cumsum(sptr)
    sup = np.empty(sptr[n_lab], dtype=np.int64)
    _label_columns(xptr, xidx, lab, row, n_cols, sptr[:-1].copy(), sup, False)
    for k in range(n_lab):
        sup[sptr[k]:sptr[k + 1]] = np.sort(sup[sptr[k]:sptr[k + 1]])
    vals = np.zeros(sptr[n_lab], dtype=np.float64)
    obj = np.zeros((T + 1, n_lab), dtype=np.float64)
    e = np.zeros(n_cols, dtype=np.float64)
    g = np.zeros(n_cols, dtype=np.float64)
    scores = np.zeros(lab.shape[0], dtype=np.float64)
    n_seg = seg.shape[0] - 1
    s0 = 0
    while s0 < n_seg:                                  # one label: its segments s0..s1-1
        k = seg_lab[s0]
        s1 = s0
        while s1 < n_seg and seg_lab[s1] == k:
            s1 += 1
        lo, hi = sptr[k], sptr[k + 1]
        for t in range(seg[s0], seg[s1]):              # e_0 = Proj(sum of every member)
            _add_row(e, xptr, xidx, xval, row[t])
        nrm = _norm_on(e, sup, lo, hi)
        if nrm > 0:
            for q in range(lo, hi):
                e[sup[q]] = e[sup[q]] / nrm
        for it in range(T + 1):
            for t in range(seg[s0], seg[s1]):
                r = row[t]
                v = 0.0
                for p in range(xptr[r], xptr[r + 1]):
                    v += e[xidx[p]] * xval[p]
                scores[t] = v
            total = 0.0
            for s in range(s0, s1):                    # arg-max member of each group
                t = _argmax_at(scores, seg[s], seg[s + 1], seg_lab_id[s])
                if it < T:
                    _add_row(g, xptr, xidx, xval, row[t])
                total += scores[t]
            obj[it, k] = total
            if it == T:
                break
            gn = _norm_on(g, sup, lo, hi)              # e = Proj(e + eta Proj(G))
            if gn > 0:
                for q in range(lo, hi):
                    e[sup[q]] = e[sup[q]] + eta * (g[sup[q]] / gn)
            nrm = _norm_on(e, sup, lo, hi)
            if nrm > 0:
                for q in range(lo, hi):
                    e[sup[q]] = e[sup[q]] / nrm
            for q in range(lo, hi):
                g[sup[q]] = 0.0
        for q in range(lo, hi):
            vals[q] = e[sup[q]]
            e[sup[q]] = 0.0
            g[sup[q]] = 0.0
        s0 = s1
    return sptr, sup, vals, obj


def grlr_block(tr: Triples, X: sp.csr_matrix, T: int = 20, eta: float = 0.1) -> Tuple[sp.csr_matrix, np.ndarray]:
    """GRLR for every label of a block. Returns (E, objective) where E is (n_lab x d) CSR and
    objective[t, k] = sum over label k's groups of max_i <e_t, x_i> for t = 0..T.

    The steps of :func:`grlr_sums` then :func:`grlr_update` (which the stage's head path runs
    one Spark job per step), fused per label (:func:`_grlr_labels`: identical where the float64
    sums of rows are exact, else up to rounding)."""
    X = sp.csr_matrix(X)
    i64 = np.int64
    n_cols = X.shape[1]
    ptr, idx, val, obj = _grlr_labels(X.indptr.astype(i64), X.indices.astype(i64), X.data.astype(np.float64),
                                      n_cols, tr.lab, tr.row, tr.seg, tr.seg_lab, tr.label_ids[tr.seg_lab],
                                      tr.n_lab, int(T), float(eta))
    E = sp.csr_matrix((val, idx, ptr), shape=(tr.n_lab, n_cols))
    E.eliminate_zeros()                                # as sparse sums drop exact zeros
    return E, obj


def assign(tr: Triples, X: sp.csr_matrix, E: sp.csr_matrix, soft: bool = False, tau: float = 30.0,
           weight_scale: float = 1.0, joint: bool = False, joint_iters: int = 20,
           prevalence: Optional[np.ndarray] = None):
    """(sample_id, label position, weight) pairs of the filtered data set, unique per
    (sample, label) (a sample reached through several groups keeps its largest weight).

    Hard: each segment's arg-max member, or its top-c members when counts are present.
    Soft: every member, weight min(1, weight_scale * g * softmax(tau * score)).
    Joint: every member, weight :func:`joint_weights` (``tr`` must hold whole groups); with
    ``prevalence`` (over global label ids) the column sums of the segments without a given
    count (``tr.given``) are their :func:`expected_carriers` (:func:`segment_carriers`).
    """
    s = tr.scores(E, X)
    if joint:
        carriers = None if prevalence is None else segment_carriers(tr, prevalence)
        w = joint_weights(tr, s, tau, joint_iters, weight_scale, carriers)[1]
        sid, lab = tr.sample_id, tr.lab
    elif soft:
        w = segment_softmax(tr.seg, s, tau, weight_scale)[1]
        sid, lab = tr.sample_id, tr.lab
    else:
        keep = top_members(tr, s)
        sid, lab, w = tr.sample_id[keep], tr.lab[keep], np.ones(int(keep.sum()))
    return dedup_max(sid, lab, w)


def segment_softmax(seg: np.ndarray, s: np.ndarray, tau: float, weight_scale: float = 1.0):
    """(p, w): p = softmax(tau * s) inside every segment seg[j]:seg[j+1] (a distribution over
    the members of one (group, label)), w = min(1, weight_scale * g * p), g the segment's size
    (p uniform: w = 1)."""
    if not len(s):
        return np.zeros(0), np.zeros(0)
    size = np.diff(seg)
    seg_of = np.repeat(np.arange(len(size)), size)
    mx = np.maximum.reduceat(s, seg[:-1])
    z = np.exp(tau * (s - mx[seg_of]))
    den = np.add.reduceat(z, seg[:-1])
    return z / den[seg_of], np.minimum(1.0, weight_scale * size[seg_of] * z / den[seg_of])


def _segment_lse(v: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """log sum exp of v over each run ptr[j]:ptr[j+1] (runs non-empty)."""
    size = np.diff(ptr)
    m = np.maximum.reduceat(v, ptr[:-1])
    return m + np.log(np.add.reduceat(np.exp(v - np.repeat(m, size)), ptr[:-1]))


def segment_counts(tr: Triples) -> np.ndarray:
    """Each (group, label) segment's count of carriers, clipped to [1, its number of members]
    (1 without counts)."""
    size = np.diff(tr.seg)
    if tr.count is None:
        return np.ones(len(size))
    return np.clip(tr.count[tr.seg[:-1]], 1, size).astype(np.float64)


def label_prevalence(groups_with_label: np.ndarray, n_groups: int, mean_size: float) -> np.ndarray:
    """Each label's estimated share of samples carrying it, from group-level labels alone.

    If every sample carries label k independently with probability p_k, a group of g members
    carries it with probability q_k = 1 - (1 - p_k)^g, so p_k = 1 - (1 - q_k)^(1/g), with q_k
    the share of the ``n_groups`` labelled groups that carry k (``groups_with_label``) and g their
    mean size. q_k is capped at 1 - 1/(2 n_groups) (a label in every group gets a finite
    estimate). A consistent estimate for random groups of equal size (with unequal sizes the
    mean size is an approximation); groups of similar samples (k-means) hold a label's carriers
    together, so there it is an underestimate.
    """
    n_groups = max(int(n_groups), 1)
    q = np.minimum(np.asarray(groups_with_label, np.float64) / n_groups, 1.0 - 0.5 / n_groups)
    return -np.expm1(np.log1p(-q) / max(float(mean_size), 1.0))


def expected_carriers(p: np.ndarray, size: np.ndarray) -> np.ndarray:
    """E[carriers | at least one] of a label of prevalence p in a group of ``size`` members:
    size p / (1 - (1 - p)^size) (binomial, conditioned on the group carrying it); in [1, size],
    1 where p = 0 (the limit)."""
    p = np.asarray(p, np.float64)
    size = np.asarray(size, np.float64)
    den = -np.expm1(size * np.log1p(-np.minimum(p, 1.0 - 1e-12)))
    c = np.where(p > 0, size * p / np.where(den > 0, den, 1.0), 1.0)
    return np.clip(c, 1.0, np.maximum(size, 1.0))


def segment_carriers(tr: Triples, prevalence: np.ndarray) -> np.ndarray:
    """Each (group, label) segment's number of carriers for :func:`joint_weights`: its count
    (:func:`segment_counts`) where the input gave one (``tr.given``), else
    :func:`expected_carriers` from the label's ``prevalence`` (indexed by global label id,
    ``tr.label_ids``) and the segment's number of members."""
    size = np.diff(tr.seg)
    est = expected_carriers(np.asarray(prevalence, np.float64)[tr.label_ids[tr.seg_lab]], size)
    if tr.count is None:
        return est
    return np.where(tr.given[tr.seg[:-1]], segment_counts(tr), est)


def joint_weights(tr: Triples, s: np.ndarray, tau: float, iters: int = 20, weight_scale: float = 1.0,
                  carriers: Optional[np.ndarray] = None):
    """Joint assignment of each group's labels to its members: (p, w) per triple.

    Per group, the member x label matrix K = exp(tau s) is scaled (Sinkhorn-Knopp, ``iters``
    rounds of column then row scaling, then a last column scaling) to W = diag(b) K diag(a)
    whose column of label k sums to its count c_k (1 without counts; at most the group size)
    and whose rows sum to an equal share sum_k c_k / g of the group's label mass (columns
    exactly, as the last step scales them; rows approximately after few rounds at large tau). This is the
    entropy-regularized optimal transport of the group's labels onto its members: a member
    that fits label A clearly is no longer also the best carrier of every other label, as it
    is under the per-label softmax of ``soft``, and at large tau the arg-max member of each
    label follows the assignment of largest total score. Returns p = W / c (a distribution
    over each (group, label)'s members, as :func:`segment_softmax` gives) and the weight
    w = min(1, weight_scale W). Computed in the log domain (no underflow at large tau).
    Triples are one row per (group, label, member); several groups may be passed at once.
    ``carriers`` (one per segment, in [1, its members]) replaces the counts as the columns'
    sums: :func:`segment_carriers` (``eagle.estimate_counts``).
    """
    s = np.asarray(s, np.float64)
    if not len(s):
        return np.zeros(0), np.zeros(0)
    seg = tr.seg
    size = np.diff(seg)
    seg_of = np.repeat(np.arange(len(size)), size)
    c = segment_counts(tr) if carriers is None else np.asarray(carriers, np.float64)
    # members: (group, row) pairs; each member's share of its group's label mass
    _, ginv = np.unique(tr.grp, return_inverse=True)           # dense group positions: no overflow
    _, mid = np.unique(ginv * (int(tr.row.max()) + 1) + tr.row, return_inverse=True)
    n_mem = int(mid.max()) + 1
    m_grp = np.zeros(n_mem, np.int64)
    m_grp[mid] = ginv
    mass = np.bincount(ginv[seg[:-1]], c)
    share = mass[m_grp] / np.bincount(m_grp)[m_grp]
    ro = np.argsort(mid, kind="stable")
    rptr = np.concatenate([[0], np.cumsum(np.bincount(mid, minlength=n_mem))])
    logk = tau * s
    log_c, log_r = np.log(c), np.log(share)
    b = np.zeros(n_mem)
    a = log_c - _segment_lse(logk + b[mid], seg)
    for _ in range(iters):
        b = log_r - _segment_lse((logk + a[seg_of])[ro], rptr)
        a = log_c - _segment_lse(logk + b[mid], seg)
    W = np.exp(logk + a[seg_of] + b[mid])
    return W / c[seg_of], np.minimum(1.0, weight_scale * W)


def top_members(tr: Triples, s: np.ndarray) -> np.ndarray:
    """Mask of each segment's top-c triples by ``s`` (c = the count, 1 without counts). A
    segment of count 1 takes :func:`_segment_argmax`'s member (ties: position label mod #tied),
    with or without counts elsewhere in ``tr``, so that its choice does not depend on which
    triples share a task; with c > 1, ties go to the members from position (label mod
    #members) onwards."""
    if tr.count is None:
        keep = np.zeros(len(s), bool)
        chosen, _ = tr.argmax(s)
        keep[chosen] = True
        return keep
    # top-c members of each segment: order by (segment, -score, tie position)
    size = np.diff(tr.seg)
    seg_of = np.repeat(np.arange(len(size)), size)
    pos = np.arange(len(s)) - tr.seg[seg_of]
    tie = (pos - tr.label_ids[tr.lab] % np.maximum(size[seg_of], 1)) % np.maximum(size[seg_of], 1)
    order = np.lexsort((tie, -s, seg_of))
    rank = np.empty(len(s), np.int64)
    rank[order] = np.arange(len(s)) - tr.seg[seg_of[order]]
    keep = rank < np.maximum(tr.count, 1)
    one = np.maximum(tr.count[tr.seg[:-1]], 1) == 1
    if one.any():
        chosen, _ = tr.argmax(s)
        keep[np.repeat(one, size)] = False
        keep[chosen[one]] = True
    return keep


# ---- model-guided re-assignment (eagle.refine_rounds) ----------------------------------------

@njit()
def _path_cost(xptr, i, k, lptr, lslots, slot_node, parent, wptr, stamp, run):
    """Work of the node classifiers on label k's paths not yet stamped for this run (stamps
    them): what :func:`_dot` scans (w's non-zeros, or x's features times a binary search)."""
    nx = xptr[i + 1] - xptr[i]
    cost = 0.0
    for q in range(lptr[k], lptr[k + 1]):
        node = slot_node[lslots[q]]
        while node > 0 and stamp[node] != run:
            stamp[node] = run
            nw = wptr[node] - wptr[node - 1]
            cost += nx * (1.0 + np.log2(1.0 + nw)) if nw > 16 * nx else nw
            node = parent[node]
    return cost


@njit()
def _path_scores(xptr, xidx, xval, n_cols, prow, plab, parent, wptr, widx, wval, slot_node, lptr, lslots,
                 sptr, sidx, sval, post, rptr, ridx, rval, mode):
    """Path score of label plab[t] for row prow[t]: per slot of the label, the product of the
    transformed margins of the slot's classifier and of every node above its leaf (root
    excluded: it has no classifier), averaged over the label's slots; 0 for a label with no
    slot. Pairs sorted by row; per run of equal rows each node's factor is computed once,
    either node by node (:func:`_dot`) or, where that is more work (upper levels' dense
    columns against a short row), all nodes at once from the feature-major copy of the node
    weights (rptr/ridx/rval: W as rows = features), adding each of x's features' entries to
    its nodes. Both sum a node's shared features in increasing order with float64 products,
    so they agree to the last bit (x's indices sorted). ``mode`` 0 chooses per row by the
    work, 1 always node by node, 2 always all nodes (for tests)."""
    n = prow.shape[0]
    out = np.zeros(n, dtype=np.float64)
    M = parent.shape[0]
    memo = np.zeros(M, dtype=np.float64)
    stamp = -np.ones(M, dtype=np.int64)
    seen = -np.ones(M, dtype=np.int64)
    acc = np.zeros(M, dtype=np.float64)
    dense = np.zeros(n_cols, dtype=np.float64)
    t0 = 0
    run = -1
    while t0 < n:
        i = prow[t0]
        t1 = t0
        while t1 < n and prow[t1] == i:
            t1 += 1
        run += 1
        for p in range(xptr[i], xptr[i + 1]):
            dense[xidx[p]] = xval[p]
        full = mode == 2
        if mode == 0:
            path = 0.0
            for t in range(t0, t1):
                path += _path_cost(xptr, i, plab[t], lptr, lslots, slot_node, parent, wptr, seen, run)
            every = 0.0
            for p in range(xptr[i], xptr[i + 1]):
                every += rptr[xidx[p] + 1] - rptr[xidx[p]]
            full = 2.0 * every < path       # the entries are added, then reset
        if full:                 # every node's margin: acc[node] = w_node . x_i
            for p in range(xptr[i], xptr[i + 1]):
                f = xidx[p]
                v = np.float64(xval[p])
                for q in range(rptr[f], rptr[f + 1]):
                    acc[ridx[q] + 1] += np.float64(rval[q]) * v
        for t in range(t0, t1):
            k = plab[t]
            tot = 0.0
            cnt = 0
            for q in range(lptr[k], lptr[k + 1]):
                s = lslots[q]
                v = _transform(_dot(xptr, xidx, xval, i, dense, sptr, sidx, sval, s), post)
                node = slot_node[s]
                while node > 0:
                    if stamp[node] != run:
                        m = acc[node] if full else _dot(xptr, xidx, xval, i, dense, wptr, widx, wval, node - 1)
                        memo[node] = _transform(m, post)
                        stamp[node] = run
                    v *= memo[node]
                    node = parent[node]
                tot += v
                cnt += 1
            if cnt > 0:
                out[t] = tot / cnt
        if full:
            for p in range(xptr[i], xptr[i + 1]):
                f = xidx[p]
                for q in range(rptr[f], rptr[f + 1]):
                    acc[ridx[q] + 1] = 0.0
        for p in range(xptr[i], xptr[i + 1]):
            dense[xidx[p]] = 0.0
        t0 = t1
    return out


def path_scores(tree, Xb: sp.csr_matrix, rows: np.ndarray, labels: np.ndarray,
                post_processor: str = "l3-hinge", mode: int = 0) -> np.ndarray:
    """The model's score of label ``labels[t]`` for row ``rows[t]`` of Xb (bias column
    appended), combined along the label's path as beam search combines it (each node's
    factor is post(w^T x), e.g. exp(-max(0, 1 - w^T x)^3) for l3-hinge; a label in several
    leaves gets the mean over them), without searching: only the classifiers on the paths to
    the asked labels are evaluated, node by node or, for a row whose paths would cost more
    that way (short rows against the upper levels' dense columns), every node at once from a
    feature-major copy of the node weights (``mode``: 0 chooses per row, 1 / 2 force one way;
    the results are identical). ``tree`` = ``XMCModel.tree_arrays()``."""
    child_ptr, W, slot_ptr, SW, slot_label, n_labels = tree
    i64 = np.int64
    child_ptr = np.asarray(child_ptr, i64)
    slot_ptr = np.asarray(slot_ptr, i64)
    M = len(child_ptr) - 1
    parent = np.repeat(np.arange(M, dtype=i64), np.diff(child_ptr))
    parent = np.concatenate([[-1], parent]).astype(i64)[:M]          # node 0 (root) has none
    slot_node = np.repeat(np.arange(M, dtype=i64), np.diff(slot_ptr))
    slot_label = np.asarray(slot_label, i64)
    lslots = np.argsort(slot_label, kind="mergesort").astype(i64)
    lptr = np.concatenate([[0], np.cumsum(np.bincount(slot_label, minlength=int(n_labels)))]).astype(i64)
    if mode not in (0, 1, 2):
        raise ValueError(f"path_scores: mode must be 0, 1 or 2, got {mode!r}")
    W = sp.csc_matrix(W)
    SW = sp.csc_matrix(SW)
    W = W if W.has_sorted_indices else W.sorted_indices()
    SW = SW if SW.has_sorted_indices else SW.sorted_indices()
    X = sp.csr_matrix(Xb)
    if X.shape[1] != W.shape[0] or X.shape[1] != SW.shape[0]:
        raise ValueError(f"path_scores: rows have {X.shape[1]} columns, the weights {W.shape[0]} / {SW.shape[0]}")
    if not X.has_canonical_format:           # sorted, no repeated feature (the two ways then agree)
        X = X.copy()
        X.sum_duplicates()
    # feature-major: row f lists the nodes that use feature f (not built when only node by node)
    Wr = W.tocsr() if mode != 1 else sp.csr_matrix((W.shape[0], W.shape[1]), dtype=W.dtype)
    rows = np.asarray(rows, i64)
    labels = np.asarray(labels, i64)
    order = np.argsort(rows, kind="mergesort")
    out = np.empty(len(rows), np.float64)
    # the weights as stored (float32 stays float32, each product is taken in float64; int32 ids stay)
    out[order] = _path_scores(X.indptr.astype(i64), X.indices.astype(i64), X.data.astype(np.float64), X.shape[1],
                              rows[order], labels[order], parent, _ids(W.indptr), _ids(W.indices),
                              _values(W.data), slot_node, lptr, lslots, _ids(SW.indptr), _ids(SW.indices),
                              _values(SW.data), POST_PROCESSORS[post_processor],
                              _ids(Wr.indptr), _ids(Wr.indices), _values(Wr.data), int(mode))
    return out


def refine_assign(tr: Triples, s_model: np.ndarray, p0: np.ndarray, tau: float, mix: float, soft: bool,
                  weight_scale: float = 1.0, weights: str = "softmax", joint_iters: Optional[int] = None,
                  carriers: Optional[np.ndarray] = None, bound: float = 0.0, floor: float = 0.0):
    """One re-assignment from model scores, mixed with the first assignment (p0: its
    distribution over each (group, label)'s members, the GRLR softmax; the guard against
    confirmation drift).

    ``softmax``: p = (1 - mix) softmax_members(tau s_model) + mix p0; soft weight
    min(1, weight_scale g p). ``ratio`` (a label may have several carriers in a group): weight
    (1 - mix) s / max_members(s) + mix min(1, weight_scale g p0), so the best-scored member
    keeps the label fully and every other member as far as the model believes it; p = the
    weights normalized over the members. Hard: the top-c members by p. With ``joint_iters``
    (the ``joint`` mode; ``tr`` holds whole groups) the model's softmax is replaced by the
    joint assignment :func:`joint_weights` of the model scores, and g by the label's count c
    (the joint mode's weight is min(1, weight_scale c p)); ``carriers`` (per segment, as
    :func:`joint_weights` takes them) replaces c. Soft: a triple below ``bound`` is dropped
    unless it is its (group, label)'s best member (the arg-max of p) and at least ``floor``,
    before the pairs are merged, so a sample in several groups gets the same weight however
    the groups are split into tasks. Returns (sample_id, label position, weight) unique per
    (sample, label) as :func:`assign`, and p per triple."""
    s_model = np.asarray(s_model, np.float64)
    p0 = np.asarray(p0, np.float64)
    size = np.diff(tr.seg)
    g = np.repeat(size, size)
    c = None
    if joint_iters is not None:
        c = segment_counts(tr) if carriers is None else np.asarray(carriers, np.float64)
        g = np.repeat(c, size)
    if weights == "ratio":
        mx = np.repeat(np.maximum.reduceat(s_model, tr.seg[:-1]), size) if len(s_model) else s_model
        w = (1.0 - mix) * s_model / np.maximum(mx, 1e-300) + mix * np.minimum(1.0, weight_scale * g * p0)
        p = w / np.maximum(np.repeat(np.add.reduceat(w, tr.seg[:-1]), size), 1e-300) if len(w) else w
    else:
        pm = segment_softmax(tr.seg, s_model, tau)[0] if joint_iters is None else \
            joint_weights(tr, s_model, tau, joint_iters, carriers=c)[0]
        p = (1.0 - mix) * pm + mix * p0
        w = np.minimum(1.0, weight_scale * g * p)
    if soft:
        keep = w >= bound
        if bound > floor and len(w):
            top = tr.argmax(p)[0]
            keep[top] |= w[top] >= floor
        sid, lab, w = tr.sample_id[keep], tr.lab[keep], w[keep]
    else:
        keep = top_members(tr, p)
        sid, lab, w = tr.sample_id[keep], tr.lab[keep], np.ones(int(keep.sum()))
    return dedup_max(sid, lab, w), p


def drift(tr: Triples, p: np.ndarray, q: np.ndarray) -> Tuple[float, float]:
    """(sum over segments of the total variation 1/2 sum |p - q|, number of segments whose
    arg-max member differs between p and q)."""
    if not len(p):
        return 0.0, 0
    tv = 0.5 * float(np.abs(np.asarray(p) - np.asarray(q)).sum())
    a, _ = tr.argmax(np.asarray(p, np.float64))
    b, _ = tr.argmax(np.asarray(q, np.float64))
    return tv, int((a != b).sum())


def dedup_max(sid, lab, w):
    """Unique (sample, label) pairs keeping the largest weight."""
    sid = np.asarray(sid, np.int64)
    lab = np.asarray(lab, np.int64)
    w = np.asarray(w, np.float64)
    if len(sid) == 0:
        return sid, lab, w
    order = np.lexsort((-w, lab, sid))
    sid, lab, w = sid[order], lab[order], w[order]
    first = np.concatenate([[True], (sid[1:] != sid[:-1]) | (lab[1:] != lab[:-1])])
    return sid[first], lab[first], w[first]

