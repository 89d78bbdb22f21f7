"""Big tree nodes split across tasks: the balanced k-means of a node whose labels' embeddings
would not fit one task, with the rows left spread over the partitions.

A node of the label tree is split in one task (:mod:`.label_tree`): the task receives every
label's packed embedding row of the node, so the root's task holds the whole PIFA matrix,
O(labels x non-zeros a label), whatever the cluster. A node with more labels than
``tree.max_split_labels`` (an integer, ``off``, or ``auto`` derived from the executors' memory,
the default: :func:`label_bound`) is split here instead, by the *same* steps as the kernel
(:func:`~..kernels.balanced_kmeans.balanced_split`: its seed's initial rows, the projection on
the centroids' difference or the similarities, the balanced assignment, the normalized sums),
with the driver holding O(labels) numbers and the centroids:

- the labels of the level's big nodes are joined to their embeddings and spread over the
  solver's task count of partitions (:func:`~.shared_vectors.solver_tasks`), a node's labels
  consecutive (partition keys computed on the driver: no sampling job), and persisted;
- each step is two Spark queries over those rows: the tasks score their rows against the
  broadcast centroids and the driver collects one score per (label, tree) (k for k > 2) and
  assigns the children as the kernel does; then the tasks sum their rows per child and the sums
  come back summed by blocks (:func:`~.node_training.summed_blocks`), k x features per node;
- a node stops when its assignment repeats, all at ``tree.max_iter`` steps at most.

The children that are still over the bound are split the same way at the next level; the
others go on through the tree's usual path (the chained levels or the level-by-level loop). The
centroids' sums are float64 over partitions where the kernel adds float32 in label order, so a
label whose score ties its neighbour's at the cut to the last bits may land on the other side
than in the kernel; the children's sizes are exact. Interpolated splits (lambda > 0, above
``tree.balanced_below_depth``) are not distributed: such a node is split in one task, with a
warning when it is over the bound.

A level's centroids (k x features doubles per node) are broadcast to the tasks; the nodes of a
level are taken in rounds of at most :data:`CENTROID_MB` of them (a task's partial sums are as large),
one node a round when a node's own centroids are larger.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_from_binary, list_array, list_offsets_values, local_frame, to_arrow
from ..compat import partition_keys, share
from ..kernels.balanced_kmeans import (
    _cluster_sums,
    _projection,
    _similarities,
    assignment,
    initial_rows,
    normalized,
    split_caps,
)
from ..kernels.tree import TREE_SHIFT, split_seed
from ..params import TreeParams
from ..progress import worker_progress
from .node_training import PARTIAL_SCHEMA, mean_row_nnz, partial_blocks, row_bound_for, session_conf, summed_blocks
from .shared_vectors import solver_tasks

log = logging.getLogger("xmc_spark.tree")

CENTROID_MB = 64            # a round's centroids (nodes x k x features doubles) at most: broadcast, and
                            # each task's partial sums
BYTES_PER_NNZ = 40          # a split task holds a node's rows about five times (Arrow input, sorted
                            # CSR, the packed rows handed on, Spark's Arrow buffers)
LABEL_BYTES = 256           # a label's id, node, order and scores besides its row
SCORES_SCHEMA = "pos long, scores array<double>"


def label_bound(spark, params: TreeParams, n_features: int, label_counts=None,
                row_nnz: Optional[float] = None) -> int:
    """Labels above which a node is split across tasks; 0 = never. ``auto`` sizes a label's row
    from the training label counts and the mean non-zeros of a training row (``row_nnz``): a
    PIFA row has at most min(features, count x row_nnz) non-zeros, and the bound is the share of
    a task's memory :func:`~.node_training.row_bound_for` gives rows of :data:`BYTES_PER_NNZ`
    bytes a non-zero (the mean over labels of that estimate, + :data:`LABEL_BYTES`). Without
    counts or ``row_nnz``, rows holding every feature."""
    v = params.split_label_bound()
    if v is not None:
        return v
    d = max(1, int(n_features))
    if label_counts is None or row_nnz is None or len(label_counts) == 0:
        per_label = d
    else:
        per_label = float(np.minimum(d, np.asarray(label_counts, np.float64) * float(row_nnz)).mean())
    return row_bound_for(session_conf(spark), int(LABEL_BYTES + BYTES_PER_NNZ * (per_label + 1)))


def split_bound(samples: DataFrame, params: TreeParams, n_features: int, n_labels: int, label_counts=None,
                row_nnz: Optional[float] = None) -> int:
    """:func:`label_bound` for a tree of ``n_labels`` labels grown from the training rows
    ``samples``: without ``row_nnz`` (the ingest stage's count of non-zeros / rows, when it
    made one) their mean non-zeros come from one aggregation, run only when the bound for rows
    holding every feature is below ``n_labels`` (else no node can be over the bound) and
    ``label_counts`` are given (without them the bound is that of rows holding every feature)."""
    spark = samples.sparkSession
    if params.split_label_bound() is not None:
        return label_bound(spark, params, n_features)
    least = label_bound(spark, params, n_features)
    if int(n_labels) <= least or label_counts is None:
        return least
    if row_nnz is None:
        row_nnz = mean_row_nnz(samples)
    bound = label_bound(spark, params, n_features, label_counts, row_nnz)
    log.info("tree: auto split bound %d labels (%.1f features a training row)", bound, row_nnz)
    return bound


def big_depths(n_labels: int, B: int, bound: int, max_leaf_size: int) -> int:
    """Levels of a balanced tree (nodes at depth i hold ceil(labels / B^i) labels or one less)
    whose nodes are over ``bound`` (and over ``max_leaf_size``): the depths split across tasks
    before the chained levels go on (0 when ``bound`` is 0, never)."""
    if bound <= 0:
        return 0
    size, depth = int(n_labels), 0
    while size > max(bound, max_leaf_size):
        size, depth = -(-size // B), depth + 1
    return depth


class _Level:
    """One round's entries (label, tree), sorted by (group, label) (``order`` takes the given
    entries to that order): the driver's side of the split, the groups ((tree, node) ``keys``)
    holding entries ``ptr[g]:ptr[g + 1]``."""

    def __init__(self, labels: np.ndarray, trees: np.ndarray, nodes: np.ndarray, keys: List[Tuple[int, int]]):
        codes = np.array([t << TREE_SHIFT | n for t, n in keys], np.int64)     # an ensemble's keys
        by_code = np.argsort(codes)
        g = by_code[np.searchsorted(codes[by_code], trees << TREE_SHIFT | nodes)]
        self.order = np.lexsort((labels, g))
        self.labels, self.g = labels[self.order], g[self.order]
        self.keys = keys
        self.ptr = np.searchsorted(self.g, np.arange(len(keys) + 1))


def split_across(emb: DataFrame, labels: np.ndarray, trees: np.ndarray, nodes: np.ndarray, params: TreeParams,
                 n_features: int, bound: int = 0, levels: Optional[int] = None) -> np.ndarray:
    """The nodes of the entries (``labels[i]`` in tree ``trees[i]``, at node ``nodes[i]``) after
    their nodes are split across tasks: level after level, the nodes with more than ``bound``
    labels, until every node is within it; with ``levels``, every node for that many levels
    (the balanced tree's levels whose largest nodes are over the bound: :func:`big_depths`).
    A node within its tree's ``max_leaf_size`` is a leaf and stays. ``emb`` holds one packed
    row (label_idx, emb_idx, emb_val) per label, empty for a label without a sample."""
    labels, trees = np.asarray(labels, np.int64), np.asarray(trees, np.int64)
    nodes = np.asarray(nodes, np.int64).copy()
    d = max(1, int(n_features))
    par = solver_tasks(emb.sparkSession)
    depth = 0
    while len(labels) and (levels is None or depth < levels):
        depth += 1
        keys, counts = np.unique(np.stack([trees, nodes]), axis=1, return_counts=True)
        over = 0 if levels is not None else bound
        big = [(int(t), int(n)) for (t, n), c in zip(keys.T, counts)
               if c > max(over, params.for_tree(int(t)).max_leaf_size)]
        if not big:
            break
        B = max(params.for_tree(t).nr_splits for t, _ in big)
        per_round = max(1, int(CENTROID_MB * 2 ** 20 // (8 * d * B)))
        for r in range(0, len(big), per_round):
            chunk = big[r:r + per_round]
            ck = np.array([t << TREE_SHIFT | n for t, n in chunk], np.int64)
            idx = np.flatnonzero(np.isin(trees << TREE_SHIFT | nodes, ck))
            lvl = _Level(labels[idx], trees[idx], nodes[idx], chunk)
            nodes[idx[lvl.order]] = _split_round(emb, lvl, params, d, par)
            sizes = np.diff(lvl.ptr)
            log.info("tree: %d node(s) of %d-%d labels split across tasks", len(chunk), sizes.min(), sizes.max())
    return nodes


def _split_round(emb: DataFrame, lvl: _Level, params: TreeParams, d: int, par: int) -> np.ndarray:
    """Child node of every entry of ``lvl`` (in its order): each group's balanced k-means, as
    :func:`~..kernels.balanced_kmeans.balanced_split` steps, two Spark queries a step over the
    round's persisted rows."""
    spark = emb.sparkSession
    G, n = len(lvl.keys), len(lvl.labels)
    tps = [params.for_tree(t) for t, _ in lvl.keys]
    m = np.diff(lvl.ptr)
    k = np.array([min(tp.nr_splits, int(mg)) for tp, mg in zip(tps, m)], np.int64)
    caps = [split_caps(int(mg), int(kg)) for mg, kg in zip(m, k)]
    # the entries cut into consecutive runs, one a partition (a group's labels together), by
    # partition keys computed here (no sampling job as for a range shuffle)
    parts = max(1, min(par, n))
    place = local_frame(spark, {"label_idx": pa.array(lvl.labels.astype(np.int32)),
                                "pos": pa.array(np.arange(n, dtype=np.int64)),
                                "g": pa.array(lvl.g.astype(np.int32)),
                                "_p": pa.array(partition_keys(parts).astype(np.int32)[
                                    (np.arange(n, dtype=np.int64) * parts) // n])})
    # rows in position order within a partition: the float32 partial sums do not depend on the shuffle
    rows = (emb.join(place, "label_idx").repartition(parts, "_p").sortWithinPartitions("pos").drop("_p")
            .persist(StorageLevel.MEMORY_AND_DISK))
    try:
        C = _initial_centroids(emb, lvl, tps, m, k, d)
        assign: List[Optional[np.ndarray]] = [None] * G
        active = list(range(G))
        for step in range(max(tp.max_iter for tp in tps)):
            S = _scores(rows, lvl, active, k, C, d)
            moved = []
            for g in active:
                s = S[lvl.ptr[g]:lvl.ptr[g + 1]]
                new = assignment(s[:, 0] if k[g] == 2 else s[:, :k[g]], caps[g])
                if assign[g] is None or not np.array_equal(new, assign[g]):
                    assign[g] = new
                    moved.append(g)
            active = [g for g in moved if step + 1 < tps[g].max_iter]    # the kernel's loop, per group
            if not active:
                break
            for g, Sg in _sums(rows, lvl, active, k, assign, d, par).items():
                C[g] = normalized(Sg)
    finally:
        rows.unpersist()
    child = np.empty(n, np.int64)
    for g, (_, node) in enumerate(lvl.keys):
        child[lvl.ptr[g]:lvl.ptr[g + 1]] = node * tps[g].nr_splits + 1 + assign[g]
    return child


def _initial_centroids(emb: DataFrame, lvl: _Level, tps, m, k, d: int) -> Dict[int, np.ndarray]:
    """Each group's k seeded rows (:func:`~..kernels.balanced_kmeans.initial_rows` of its seed
    for the node, over its labels in order), normalized: one query fetching those labels' rows."""
    picks = {g: lvl.labels[lvl.ptr[g] + initial_rows(int(m[g]), int(k[g]), split_seed(tps[g].seed, lvl.keys[g][1]))]
             for g in range(len(lvl.keys))}
    want = np.unique(np.concatenate(list(picks.values())))
    got = to_arrow(emb.where(F.col("label_idx").isin([int(x) for x in want])))
    Z = csr_from_binary(got, "emb_idx", "emb_val", d)
    row = np.full(int(want.max()) + 1, -1, np.int64)
    row[got.column("label_idx").to_numpy()] = np.arange(got.num_rows)
    out = {}
    for g, labs in picks.items():
        C = np.zeros((len(labs), d), np.float32)
        have = row[labs] >= 0
        C[have] = Z[row[labs][have]].toarray()
        out[g] = normalized(C)
    return out


def _batch_groups(b: pa.RecordBatch, keep, d: int):
    """(positions, CSR rows, group) per group of batch ``b`` whose rows ``keep(pos, g)`` selects."""
    t = pa.Table.from_batches([b])
    pos, g = t.column("pos").to_numpy(), t.column("g").to_numpy()
    sel = keep(pos, g)
    if not sel.any():
        return
    if not sel.all():
        t, pos, g = t.filter(pa.array(sel)), pos[sel], g[sel]
    Z = csr_from_binary(t, "emb_idx", "emb_val", d)
    for gg in np.unique(g):
        r = np.flatnonzero(g == gg)
        yield pos[r], Z[r], int(gg)


def _scores(rows: DataFrame, lvl: _Level, active: List[int], k, C: Dict[int, np.ndarray], d: int) -> np.ndarray:
    """Every active entry's scores (n x max k, by position): z^T (c0 - c1) for a 2-way group
    (the kernel's projection), the k similarities otherwise; one query."""
    spark = rows.sparkSession
    vec = share(spark, {g: C[g][0] - C[g][1] if k[g] == 2 else C[g] for g in active}, name="the centroids")
    on = np.zeros(len(lvl.keys), bool)
    on[active] = True

    def score(batches):
        V = vec.value
        for b in batches:
            for pos, Z, g in _batch_groups(b, lambda p, g: on[g], d):
                v = V[g]
                s = _projection(Z.indptr, Z.indices, Z.data, v)[:, None] if v.ndim == 1 else \
                    _similarities(Z.indptr, Z.indices, Z.data, v)
                yield pa.RecordBatch.from_pydict({
                    "pos": pa.array(pos, pa.int64()),
                    "scores": list_array(np.arange(0, s.size + 1, s.shape[1]), s.ravel(), pa.float64())})
                worker_progress("tree (split across tasks)", rows=len(pos))

    try:
        got = to_arrow(rows.mapInArrow(score, SCORES_SCHEMA))
    finally:
        vec.unpersist()             # each step's broadcasts go as soon as its query is done
    off, vals = list_offsets_values(got, "scores")
    width = int(k.max())
    S = np.zeros((len(lvl.labels), width))
    pos = got.column("pos").to_numpy()
    lens = np.diff(off)
    for w in np.unique(lens):
        r = np.flatnonzero(lens == w)
        S[pos[r], :w] = vals[(off[r][:, None] + np.arange(w)).ravel()].reshape(len(r), w)
    return S


def _sums(rows: DataFrame, lvl: _Level, active: List[int], k, assign, d: int, par: int) -> Dict[int, np.ndarray]:
    """Each active group's per-child sums of its rows (k x d), one query: the tasks' partial
    sums (float32 per batch and group, as the kernel's, added in float64) summed by blocks."""
    spark = rows.sparkSession
    child = np.full(len(lvl.labels), -1, np.int64)
    off = np.full(len(lvl.keys), -1, np.int64)
    size = 0
    for g in active:
        child[lvl.ptr[g]:lvl.ptr[g + 1]] = assign[g]
        off[g], size = size, size + int(k[g]) * d
    sh = share(spark, child, name="the children of the labels")

    def part(batches):
        a = sh.value
        acc = np.zeros(size)
        for b in batches:
            for pos, Z, g in _batch_groups(b, lambda p, g: a[p] >= 0, d):
                acc[off[g]:off[g] + k[g] * d] += _cluster_sums(Z.indptr, Z.indices, Z.data, a[pos], int(k[g]),
                                                               d).ravel()
                worker_progress("tree (split across tasks)", rows=len(pos))
        yield from partial_blocks(acc)

    try:
        flat = summed_blocks(rows.mapInArrow(part, PARTIAL_SCHEMA), size, par)
    finally:
        sh.unpersist()
    return {g: flat[off[g]:off[g] + k[g] * d].reshape(int(k[g]), d) for g in active}
