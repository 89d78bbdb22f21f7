"""Big tree nodes split across tasks: the balanced k-means of a node whose labels' embeddings
would not fit one task, with the rows left spread over the partitions.

A node of the label tree is split in one task (:mod:`.label_tree`): the task receives every
label's packed embedding row of the node, so the root's task holds the whole PIFA matrix,
O(labels x non-zeros a label), whatever the cluster. A node with more labels than
``tree.max_split_labels`` (an integer, ``off``, or ``auto`` derived from the executors' memory,
the default: :func:`label_bound`) is split here instead, by the *same* steps as the kernel
(:func:`~..kernels.balanced_kmeans.balanced_split`: its seed's initial rows, the projection on
the centroids' difference or the similarities, the balanced assignment, the normalized sums),
with the driver holding which node each label is in and the steps' scalars, and the tasks the
rest:

- the embeddings of the level's big nodes' labels are tagged with each label's position and node
  (:func:`placed_rows`: a lookup in a broadcast, not a join with a table that would travel
  through the driver) and spread over the solver's task count of partitions
  (:func:`~.shared_vectors.solver_tasks`), a node's labels consecutive (partition keys computed on
  the driver: no sampling job), and persisted;
- each step is two Spark jobs over those rows (one at a group's last step), which share the
  step's state through files in a folder of the round's under the scratch folder
  (:class:`_RoundFiles`: the run folder's ``_scratch`` in the pipeline, the machine's temp folder
  in local mode by default):

  - *assignment*: the tasks read their nodes' centroid sums, normalize them and score their
    rows (the kernel's projection on the centroids' difference, or the k similarities); the
    scores are grouped by node, and one call per node (in the tasks of a shuffle: a task may
    take several nodes, one after another) makes the kernel's balanced assignment from all of
    the node's scores, compares it with the node's last one and writes it if it moved (that
    call holds O(the node's labels x k) numbers: ~70 bytes a label for two children, ~32 x k
    bytes for k; the in-task split it replaces held the node's embeddings); the driver
    receives one row per node (moved or not);
  - *sums*: the tasks read their rows' children from the assignments' files and add up their
    rows per child (float32 per batch and node, as the kernel, then float64); the partial sums
    are summed by blocks (:data:`~.node_training.BLOCK` doubles), whose tasks write them as the
    next step's centroid sums; the driver receives one row per block written;
- a node stops when its assignment repeats, all at ``tree.max_iter`` steps at most; the driver
  then reads each node's final assignment file (4 bytes a label) and deletes the folder.

Step 0's sums are each node's k seeded rows (child j its j-th seed), summed by the sums' job. So
no score, sum or embedding row reaches the driver (until 2026-12-05 it collected one score per
label and k x features sums per node at every step: ~246 MB for the 1M set under a 2g Python cap).

The children that are still over the bound are split the same way at the next level; the
others go on through the tree's usual path (the chained levels or the level-by-level loop). The
centroids' sums are float64 over partitions where the kernel adds float32 in label order, so a
label whose score ties its neighbour's at the cut to the last bits may land on the other side
than in the kernel; the children's sizes are exact. Interpolated splits (lambda > 0, above
``tree.balanced_below_depth``) are not distributed: such a node is split in one task, with a
warning when it is over the bound.

The nodes of a level are taken in rounds of at most :data:`CENTROID_MB` of centroids (k x
features doubles per node: a task's partial sums are as large), one node a round when a node's
own centroids are larger.

**Streamed splits** (``tree.big_split_solver``: ``streamed``, and ``auto`` in local mode with the
scratch folder on local disk, as ``train.big_node_solver``: :func:`streams_splits`): each step
above costs two Spark jobs (~1.2-1.5 s a step in local mode, where the tasks share one machine
and spreading a node's labels over them saves no time). Instead, the round's rows, shuffled and
ordered as above, are written once as Arrow files by the tasks that shuffled them (blocks of one
node's rows within a Spark batch), and one task per node runs the kernel's steps itself
(:func:`~..kernels.balanced_kmeans.balanced_split_streamed`), reading the node's files a block at
a time at each pass (two passes a step: scores, then sums): it holds one block, the node's scores
and its centroids in memory, never its rows (a copy of them stays on disk while it runs), and its
children are the kernel's bit for bit (:func:`_split_streamed`).
There ``auto``'s bound is also at most :data:`STREAMED_SPLIT_NNZ` (2^24) estimated non-zeros in a
split in one task (:func:`label_bound`), 640 MiB at :data:`BYTES_PER_NNZ`: about what a training
unit holds at the streamed row bound (:data:`~.node_training.STREAMED_NODE_ROWS`), so that the
tree's workers hold no more than the train stage's (the root's split of the 2M synthetic set
held 1.6 GB in one Python worker; 2^25 left 827 MB at 1M). A streamed split's block files hold at
most :data:`SPLIT_BLOCK_NNZ` non-zeros each; its task reads them once, keeps their CSR arrays in
a temporary folder of its own and maps them at every later pass (:class:`_MappedBlocks`).
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
import uuid
from typing import Dict, List, Optional, Tuple

import numpy as np
import pandas as pd
import pyarrow as pa
import scipy.sparse as sp
from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import (
    binary_lengths,
    binary_segments,
    binary_values,
    csr_from_binary,
    grouped_apply,
    list_offsets_values,
    local_frame,
    to_arrow,
)
from ..compat import is_connect, partition_keys, scratch_root, session_settings, share
from ..kernels.balanced_kmeans import (
    _cluster_sums,
    _projection,
    _similarities,
    assignment,
    balanced_split_streamed,
    initial_rows,
    normalized,
    split_caps,
)
from ..kernels.tree import TREE_SHIFT, find_keys, split_seed
from ..params import ConfigError, TreeParams
from ..progress import worker_progress
from ..storage import client_fs, is_local_path, write_whole
from .node_training import (
    BLOCK,
    PARTIAL_SCHEMA,
    _sum_blocks,
    mean_row_nnz,
    partial_blocks,
    row_bound_for,
    session_conf,
    streams,
)
from .shared_vectors import _parallel, solver_tasks
from .streamed_nodes import block_files, write_blocks

log = logging.getLogger("xmc_spark.tree")

CENTROID_MB = 64            # a round's centroids (nodes x k x features doubles) at most: what a scoring task
                            # may read, and each task's partial sums
BYTES_PER_NNZ = 40          # a split task holds a node's rows about five times (Arrow input, sorted
                            # CSR, the packed rows handed on, Spark's Arrow buffers)
LABEL_BYTES = 256           # a label's id, node, order and scores besides its row
STREAMED_SPLIT_NNZ = 1 << 24    # auto's bound where splits are streamed: at most this many estimated
                                # non-zeros in a split inside a task (module docstring)
SPLIT_BLOCK_NNZ = 1 << 21       # a streamed split's block file: at most this many non-zeros (or one row)
SCORES_SCHEMA = "g int, pos long, scores binary"     # a label's k scores as float64 bytes
# the steps' queries (over the cached rows) shuffle into partitions they set themselves (one a
# node's scores, one a block of sums, up to the solver's task count): adaptive execution has
# nothing to re-plan there and would run each shuffle's map side as a job of its own
STEP_SETTINGS = {"spark.sql.adaptive.enabled": "false"}


def label_bound(spark, params: TreeParams, n_features: int, label_counts=None,
                row_nnz: Optional[float] = None, streamed: bool = False) -> int:
    """Labels above which a node is split across tasks; 0 = never. ``auto`` sizes a label's row
    from the training label counts and the mean non-zeros of a training row (``row_nnz``): a
    PIFA row has at most min(features, count x row_nnz) non-zeros, and the bound is the share of
    a task's memory :func:`~.node_training.row_bound_for` gives rows of :data:`BYTES_PER_NNZ`
    bytes a non-zero (the mean over labels of that estimate, + :data:`LABEL_BYTES`). Without
    counts or ``row_nnz``, rows holding every feature. ``streamed`` (big splits would be streamed:
    :func:`streams_splits`) with counts and ``row_nnz``: also at most :data:`STREAMED_SPLIT_NNZ`
    estimated non-zeros a split (without them that cap would take rows holding every feature and
    put nearly every node over it: left out)."""
    v = params.split_label_bound()
    if v is not None:
        return v
    d = max(1, int(n_features))
    counted = label_counts is not None and row_nnz is not None and len(label_counts) > 0
    if not counted:
        per_label = d
    else:
        per_label = float(np.minimum(d, np.asarray(label_counts, np.float64) * float(row_nnz)).mean())
    bound = row_bound_for(session_conf(spark), int(LABEL_BYTES + BYTES_PER_NNZ * (per_label + 1)))
    return min(bound, max(2, int(STREAMED_SPLIT_NNZ // max(per_label, 1.0)))) if streamed and counted else bound


def streams_splits(spark, params: TreeParams, scratch: Optional[str] = None) -> bool:
    """Whether nodes over the bound are split by :func:`_split_streamed` (``tree.big_split_solver``
    resolved for the session's master and scratch folder by :func:`~.node_training.streams`),
    else across tasks step by step (:func:`_split_round`)."""
    streamed, root = streams(spark, params.big_split_solver, scratch)
    return streamed and root is not None


def split_bound(samples: DataFrame, params: TreeParams, n_features: int, n_labels: int, label_counts=None,
                row_nnz: Optional[float] = None, scratch: Optional[str] = None) -> int:
    """:func:`label_bound` for a tree of ``n_labels`` labels grown from the training rows
    ``samples``: without ``row_nnz`` (the ingest stage's count of non-zeros / rows, when it
    made one) their mean non-zeros come from one aggregation, run only when the bound for rows
    holding every feature is below ``n_labels`` (else no node can be over the bound) and
    ``label_counts`` are given (without them the bound is that of rows holding every feature).
    ``scratch``: the tree stage's scratch folder (whether its splits are streamed:
    :func:`streams_splits`; then the count is also taken when ``n_labels`` rows of every feature
    would hold more than :data:`STREAMED_SPLIT_NNZ` non-zeros, the cap's own bound)."""
    spark = samples.sparkSession
    if params.split_label_bound() is not None:
        return label_bound(spark, params, n_features)
    streamed = streams_splits(spark, params, scratch)
    least = label_bound(spark, params, n_features)
    capped = streamed and int(n_labels) * max(1, int(n_features)) > STREAMED_SPLIT_NNZ
    if (int(n_labels) <= least and not capped) or label_counts is None:
        return least
    if row_nnz is None:
        row_nnz = mean_row_nnz(samples)
    bound = label_bound(spark, params, n_features, label_counts, row_nnz, streamed=streamed)
    log.info("tree: auto split bound %d labels (%.1f features a training row%s)", bound, row_nnz,
             ", splits streamed" if streamed else "")
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
                 n_features: int, bound: int = 0, levels: Optional[int] = None,
                 scratch: Optional[str] = None) -> np.ndarray:
    """The nodes of the entries (``labels[i]`` in tree ``trees[i]``, at node ``nodes[i]``) after
    their nodes are split across tasks: level after level, the nodes with more than ``bound``
    labels, until every node is within it; with ``levels``, every node for that many levels
    (the balanced tree's levels whose largest nodes are over the bound: :func:`big_depths`).
    A node within its tree's ``max_leaf_size`` is a leaf and stays. ``emb`` holds one packed
    row (label_idx, emb_idx, emb_val) per label, empty for a label without a sample. ``scratch``:
    a folder the driver and every task see, for the steps' files (:class:`_RoundFiles`; default
    :func:`~..compat.scratch_root`: in local mode the machine's temp folder)."""
    labels, trees = np.asarray(labels, np.int64), np.asarray(trees, np.int64)
    nodes = np.asarray(nodes, np.int64).copy()
    d = max(1, int(n_features))
    par = solver_tasks(emb.sparkSession)
    root = scratch_root(emb.sparkSession, scratch)
    if root is None:
        raise ConfigError("tree.max_split_labels: a node split across tasks keeps its steps' centroids and "
                          "assignments in files every task sees, and this cluster session has no scratch folder: "
                          "run it through the pipeline (its run folder's _scratch) or pass scratch")
    streamed = streams_splits(emb.sparkSession, params, root)
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
        # a streamed node's centroids are its own task's alone
        per_round = len(big) if streamed else max(1, int(CENTROID_MB * 2 ** 20 // (8 * d * B)))
        for r in range(0, len(big), per_round):
            chunk = big[r:r + per_round]
            ck = np.array([t << TREE_SHIFT | n for t, n in chunk], np.int64)
            idx = np.flatnonzero(np.isin(trees << TREE_SHIFT | nodes, ck))
            lvl = _Level(labels[idx], trees[idx], nodes[idx], chunk)
            split = _split_streamed if streamed else _split_round
            nodes[idx[lvl.order]] = split(emb, lvl, params, d, par, root)
            sizes = np.diff(lvl.ptr)
            log.info("tree: %d node(s) of %d-%d labels split across tasks%s", len(chunk), sizes.min(), sizes.max(),
                     " (streamed: a task a node)" if streamed else "")
    return nodes


def placed_rows(emb: DataFrame, labels: np.ndarray, trees: np.ndarray, columns: Dict[str, Tuple[np.ndarray, str]],
                name: str):
    """(rows, shared): the row of ``emb`` (``label_idx`` and its embedding) once for each entry
    (``labels[i]``, ``trees[i]``; no entry twice), with its ``tree`` (int) and the entry's
    ``columns`` (name -> (a value an entry, Spark type ``int`` or ``long``)); a label of no entry
    gets no row. On classic Spark the entries are shared with the tasks (a broadcast of their
    sorted (tree, label) codes and columns, O(entries)) and a vectorized UDF that sees only the
    rows' label and tree looks them up: a join with the entries as a local table broadcasts them
    as well, but Spark's broadcast of a table collects it through the driver first (1.4 MB at the
    1M set's 100K labels). ``shared``: to unpersist once the rows are computed (a task that
    computes them again fetches it again), None on Spark Connect, where the join stays (a shared
    value would travel inside the query plan)."""
    labels, trees = np.asarray(labels, np.int64), np.asarray(trees, np.int64)
    spark = emb.sparkSession
    present = [int(t) for t in np.unique(trees)] or [0]
    emb = emb.withColumn("tree", F.lit(present[0]) if len(present) == 1 else      # a row a tree of the entries
                         F.explode(F.array(*[F.lit(t) for t in present])))
    types = {"int": np.int32, "long": np.int64}
    names = list(columns)
    if is_connect(emb):
        table = {"label_idx": pa.array(labels.astype(np.int32)), "tree": pa.array(trees.astype(np.int32)),
                 **{c: pa.array(np.asarray(v).astype(types[t])) for c, (v, t) in columns.items()}}
        return emb.join(local_frame(spark, table), ["label_idx", "tree"]).select(*emb.columns, *names), None
    L = int(labels.max()) + 1 if len(labels) else 1
    codes = trees * L + labels
    order = np.argsort(codes)
    # the columns in code order, each with one more value at its end: what no entry (-1) picks, filtered out
    vals = [np.append(np.asarray(v).astype(types[t])[order], types[t](0)) for v, t in columns.values()]
    shared = share(spark, (L, codes[order], vals), name=name)

    @F.pandas_udf(", ".join(["_at long"] + [f"{c} {t}" for c, (_, t) in columns.items()]))
    def look(label: pd.Series, tree: pd.Series) -> pd.DataFrame:
        L, codes, vals = shared.value
        lab, tr = label.to_numpy(np.int64), tree.to_numpy(np.int64)
        code = tr * L + lab
        k, hit = find_keys(codes, code)
        i = np.where(hit & (lab >= 0) & (lab < L), k, -1)
        return pd.DataFrame({"_at": i, **{c: v[i] for c, v in zip(names, vals)}})

    # not deterministic for the optimizer, so that it does not copy the call into the filter (twice the work)
    e = look.asNondeterministic()("label_idx", "tree")
    rows = emb.select("*", e.alias("_e")).filter(F.col("_e._at") >= 0)
    return rows.select(*emb.columns, *[F.col("_e." + c).alias(c) for c in names]), shared


def _split_round(emb: DataFrame, lvl: _Level, params: TreeParams, d: int, par: int, root: str) -> np.ndarray:
    """Child node of every entry of ``lvl`` (in its order): each group's balanced k-means, as
    :func:`~..kernels.balanced_kmeans.balanced_split` steps, two Spark jobs a step over the
    round's persisted rows, the centroid sums and the assignments in files under ``root``
    (:class:`_RoundFiles`)."""
    spark = emb.sparkSession
    G = len(lvl.keys)
    tps = [params.for_tree(t) for t, _ in lvl.keys]
    m = np.diff(lvl.ptr)
    k = np.array([min(tp.nr_splits, int(mg)) for tp, mg in zip(tps, m)], np.int64)
    caps = [split_caps(int(mg), int(kg)) for mg, kg in zip(m, k)]
    files = _RoundFiles(root, lvl.ptr, k, d)         # the folder first: a scratch it cannot write fails here
    rows = shared = None
    try:
        rows, shared = _round_rows(emb, lvl, par)
        rows = rows.persist(StorageLevel.MEMORY_AND_DISK)
        # step 0's sums: each group's k seeded rows (initial_rows of its seed for the node, over its
        # labels in order), child j the j-th: their float32 values, as the kernel's initial centroids
        seeds = np.concatenate([lvl.ptr[g] + initial_rows(int(m[g]), int(k[g]), split_seed(tps[g].seed, key[1]))
                                for g, key in enumerate(lvl.keys)]).astype(np.int64)
        latest = np.full(G, -1, np.int64)           # the step whose file holds each group's assignment
        _sums(rows, files, 0, list(range(G)), latest, par, seeds)      # also fills the rows' cache
        active = list(range(G))                     # each active group's centroids: the sums of this step
        with session_settings(spark, STEP_SETTINGS, "the tree's split across tasks"):
            for step in range(max(tp.max_iter for tp in tps)):
                moved = _assign(rows, files, step, active, caps, latest, par)
                for g in moved:
                    if latest[g] >= 0:
                        files.forget_assignment(int(latest[g]), g)
                    latest[g] = step
                active = [g for g in moved if step + 1 < tps[g].max_iter]    # the kernel's loop, per group
                if not active:
                    break
                _sums(rows, files, step + 1, active, latest, par)
                files.forget_sums(step)
        return _children(files, lvl, tps, latest)
    finally:
        _release(files, shared, rows)


def _children(files: _RoundFiles, lvl: _Level, tps, steps) -> np.ndarray:
    """Child node of every entry of ``lvl``: its group's assignment that step ``steps[g]`` wrote."""
    child = np.empty(len(lvl.labels), np.int64)
    fs = files.filesystem()
    for g, (_, node) in enumerate(lvl.keys):
        child[lvl.ptr[g]:lvl.ptr[g + 1]] = node * tps[g].nr_splits + 1 + files.assignment(fs, int(steps[g]), g)
    return child


def _release(files: _RoundFiles, shared, rows: Optional[DataFrame] = None) -> None:
    """A round's cached rows, shared entries and folder released, each whatever the others do."""
    try:
        if rows is not None:
            rows.unpersist()
    finally:
        try:
            if shared is not None:
                shared.unpersist()
        finally:
            files.delete()


def _round_rows(emb: DataFrame, lvl: _Level, par: int):
    """(rows, shared): the round's rows (g, pos, label_idx, emb_idx, emb_val; ``pos`` an entry's
    place in ``lvl``'s order) in at most ``par`` partitions, each a run of consecutive positions
    (a group's labels together, the partitions in position order) sorted by position, so that
    sums taken in row order do not depend on the shuffle; ``shared`` as :func:`placed_rows`. The
    partition keys are computed here (no sampling job as for a range shuffle)."""
    n = len(lvl.labels)
    parts = max(1, min(par, n))
    pos = np.arange(n, dtype=np.int64)
    placed, shared = placed_rows(emb, lvl.labels, np.array([t for t, _ in lvl.keys], np.int64)[lvl.g],
                                 {"pos": (pos, "long"), "g": (lvl.g, "int"),
                                  "_p": (partition_keys(parts)[(pos * parts) // n], "int")},
                                 "the split's labels")
    return placed.repartition(parts, "_p").sortWithinPartitions("pos").drop("_p", "tree"), shared


def _split_streamed(emb: DataFrame, lvl: _Level, params: TreeParams, d: int, par: int, root: str) -> np.ndarray:
    """Child node of every entry of ``lvl`` (in its order), each group split in one task of its
    own by the kernel's steps over its labels' rows streamed from files
    (:func:`~..kernels.balanced_kmeans.balanced_split_streamed`): the round's rows
    (:func:`_round_rows`) written as Arrow files (:func:`_group_blocks`) by the tasks
    that shuffled them (:func:`~.streamed_nodes.write_blocks`: a folder per write attempt, the
    job's result naming those kept), then one job of a task a group (the most labels first), each
    writing its assignment to the round's folder, which the driver reads (4 bytes a label) and
    deletes. A task holds one block, the group's scores (m x k) and its centroids (k x d) in
    memory, never the group's rows (its copy of them is on disk: :class:`_MappedBlocks`). With
    the blocks in position order the children are the kernel's, bit for bit (the float32 sums
    carried from block to block)."""
    spark = emb.sparkSession
    G = len(lvl.keys)
    tps = [params.for_tree(t) for t, _ in lvl.keys]
    m = np.diff(lvl.ptr)
    k = np.array([min(tp.nr_splits, int(mg)) for tp, mg in zip(tps, m)], np.int64)
    files = _RoundFiles(root, lvl.ptr, k, d)
    shared = None
    try:
        rows, shared = _round_rows(emb, lvl, par)
        uri = f"{files.uri}/rows"
        written = write_blocks(rows.select("g", "pos", "emb_idx", "emb_val"),
                               functools.partial(_group_blocks, cap=SPLIT_BLOCK_NNZ), uri,
                               "tree (streamed split: writing the labels' rows)")
        at = written.column("node").to_numpy().astype(np.int64)
        got = np.bincount(at, weights=written.column("rows").to_numpy(), minlength=G).astype(np.int64)
        if not np.array_equal(got, m):
            bad = int(np.flatnonzero(got != m)[0])
            raise RuntimeError(f"tree split: group {bad} wrote {got[bad]} rows for its {m[bad]} labels")
        folders = [[] for _ in range(G)]
        for g, f in sorted(zip(at.tolist(), written.column("folder").to_pylist())):    # partition order
            folders[g].append(f)
        order = np.argsort(-m, kind="stable")
        seeds = [split_seed(tp.seed, node) for tp, (_, node) in zip(tps, lvl.keys)]
        ptr = lvl.ptr
        files.make_assign_dir(0)
        local_dir = files.make_local_dir()

        def run(batches):
            rfs, rbase = client_fs(uri)
            fs = files.filesystem()
            for b in batches:
                for i in b.column("id").to_pylist():
                    g = int(order[i])
                    paths = [p for f in folders[g] for p in block_files(rfs, f"{rbase}/{f}")]
                    # this attempt's own copies, in the round's folder when the scratch is on this disk
                    # (the driver's delete removes them whatever becomes of the task), else the temp folder
                    with tempfile.TemporaryDirectory(prefix="t-", dir=local_dir) as local:
                        blocks = _MappedBlocks(rfs, paths, int(ptr[g]), d, local)
                        a = balanced_split_streamed(blocks, int(m[g]), d, tps[g].nr_splits, tps[g].max_iter,
                                                    seeds[g])
                    files.write_assignment(fs, 0, g, a)
                    worker_progress("tree (streamed split)", labels=int(m[g]))
                    yield pa.RecordBatch.from_pydict({"g": pa.array([g], pa.int32())})

        done = to_arrow(spark.range(0, G, numPartitions=G).mapInArrow(run, "g int")).column("g").to_pylist()
        if sorted(done) != list(range(G)):
            raise RuntimeError(f"tree split: {len(done)} of {G} groups were split")
        return _children(files, lvl, tps, np.zeros(G, np.int64))
    finally:
        _release(files, shared)


class _MappedBlocks:
    """``blocks()`` of a streamed split (:func:`~..kernels.balanced_kmeans.balanced_split_streamed`):
    the first call reads the block files ``paths`` (positions made relative to ``lo``) and keeps
    each block's CSR arrays as ``.npy`` files in the task's own folder ``local``; the
    later calls map those files (``np.load`` with ``mmap_mode``), so a pass copies and converts
    nothing, and holds the pages of the block it is at (a block's arrays are unmapped when the
    next one is taken)."""

    def __init__(self, fs, paths, lo: int, d: int, local: str):
        self.fs, self.paths, self.lo, self.d, self.local = fs, list(paths), int(lo), int(d), local
        self.kept = False

    def _name(self, i: int, part: str) -> str:
        return os.path.join(self.local, f"{i}.{part}.npy")

    def __call__(self):
        if not self.kept:
            return self._first()
        return self._mapped()

    def _first(self):
        for i, p in enumerate(self.paths):
            with self.fs.open_input_file(p) as f:
                t = pa.ipc.open_file(f).read_all()
            pos = t.column("pos").to_numpy() - self.lo
            Z = csr_from_binary(t, "emb_idx", "emb_val", self.d)
            del t
            ptr = Z.indptr.astype(np.int32 if Z.nnz < 2 ** 31 else np.int64)
            for part, a in (("pos", pos), ("ptr", ptr), ("idx", Z.indices.astype(ptr.dtype)), ("val", Z.data)):
                np.save(self._name(i, part), a)
            yield pos, Z
        self.kept = True

    def _mapped(self):
        for i in range(len(self.paths)):
            pos, ptr, idx, val = (np.asarray(np.load(self._name(i, part), mmap_mode="r"))
                                  for part in ("pos", "ptr", "idx", "val"))
            yield pos, sp.csr_matrix((val, idx, ptr), shape=(len(ptr) - 1, self.d))


def _group_blocks(batches, cap: int):
    """The round's rows (position order) as blocks for :func:`~.streamed_nodes.write_blocks`:
    each batch's runs of a group's rows of at most ``cap`` non-zeros (or one row; the driver
    passes :data:`SPLIT_BLOCK_NNZ`), with the group as ``node`` and the block's row count as
    ``rows``."""
    for b in batches:
        if not b.num_rows:
            continue
        g = b.column("g").to_numpy()
        ends = np.cumsum(binary_lengths(b.column("emb_idx"), 4))
        starts = np.concatenate([[0], np.flatnonzero(np.diff(g)) + 1])
        cuts = [0]
        for a, z in zip(starts, np.append(starts[1:], len(g))):
            base = ends[a - 1] if a else 0
            while a < z:                        # a greedy cut: as many rows as fit the block's non-zeros
                a = max(a + 1, min(int(z), int(np.searchsorted(ends, base + cap, "right"))))
                cuts.append(a)
                base = ends[a - 1]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            part = b.slice(int(lo), int(hi - lo))
            yield pa.RecordBatch.from_arrays(
                [pa.array(np.full(hi - lo, g[lo], np.int32)), pa.array(np.full(hi - lo, hi - lo, np.int64)),
                 part.column("pos"), part.column("emb_idx"), part.column("emb_val")],
                ["node", "rows", "pos", "emb_idx", "emb_val"])


class _RoundFiles:
    """What the tasks of one round share, in a folder of its own under the scratch root: the
    centroid sums of step s (``c<s>/<block>``: the groups' k x d sums laid end to end, float64, cut
    into blocks of ``block`` doubles (:data:`~.node_training.BLOCK`), a block no row touched absent
    and zero; ``present`` names those written) and the assignment a step made (``a<s>/<group>``: a
    child a label, int32, in the group's label order). The driver makes a job's folder before the
    job (a task never makes one: a stray attempt after the folder's delete fails instead of
    leaving it behind; the streamed split's write tasks are the exception, making their attempt's
    folders under ``rows`` as :func:`~.streamed_nodes.write_blocks` does for the train stage), and
    every read checks its length. Pickled into the closures."""

    def __init__(self, root: str, ptr: np.ndarray, k: np.ndarray, d: int):
        self.uri = f"{root.rstrip('/')}/split-{uuid.uuid4().hex}"
        fs, self.base = client_fs(self.uri)
        fs.create_dir(self.base, recursive=True)
        self.ptr, self.k, self.d = np.asarray(ptr, np.int64), np.asarray(k, np.int64), int(d)
        self.off = np.concatenate([[0], np.cumsum(self.k * self.d)])
        self.block = BLOCK
        self.present: Dict[int, frozenset] = {}

    def filesystem(self):
        return client_fs(self.uri)[0]

    def make_sums_dir(self, step: int) -> None:
        self.filesystem().create_dir(f"{self.base}/c{step}", recursive=True)

    def make_assign_dir(self, step: int) -> None:
        self.filesystem().create_dir(f"{self.base}/a{step}", recursive=True)

    def make_local_dir(self) -> Optional[str]:
        """The folder for the streamed split tasks' own copies of their blocks
        (:class:`_MappedBlocks`): ``local`` in the round's folder when the scratch root is a path
        of this machine's file system (each task makes a folder of its own inside), else None
        (the task's temp folder)."""
        if not is_local_path(self.uri):
            return None
        self.filesystem().create_dir(f"{self.base}/local", recursive=True)
        return f"{self.base}/local"

    def block_size(self, b: int) -> int:
        return min(self.block, int(self.off[-1]) - b * self.block)

    def _sums_path(self, step: int, block: int) -> str:
        return f"{self.base}/c{step}/{block}"

    def assign_path(self, step: int, g: int) -> str:
        return f"{self.base}/a{step}/{g}"

    def centroids(self, fs, step: int, g: int) -> np.ndarray:
        """Group g's k x d centroids: its sums of ``step``, normalized (as the kernel's)."""
        lo, hi = int(self.off[g]), int(self.off[g + 1])
        out = np.zeros(hi - lo)
        have, B = self.present[step], self.block
        for b in range(lo // B, -(-hi // B)):
            if b in have:
                with fs.open_input_stream(self._sums_path(step, b)) as f:
                    vals = _exact(np.frombuffer(f.read(), np.float64), self.block_size(b), self._sums_path(step, b))
                a, z = max(lo, b * B), min(hi, (b + 1) * B)
                out[a - lo:z - lo] = vals[a - b * B:z - b * B]
        return normalized(out.reshape(int(self.k[g]), self.d))

    def write_sums(self, fs, step: int, block: int, vals: np.ndarray) -> None:
        _write_array(fs, self._sums_path(step, block), vals, np.float64)

    def assignment(self, fs, step: int, g: int, lo: int = 0, hi: Optional[int] = None, f=None) -> np.ndarray:
        """Entries [lo, hi) (positions within group g) of the assignment ``step`` wrote (from the
        open file ``f`` when given)."""
        hi = int(self.ptr[g + 1] - self.ptr[g]) if hi is None else int(hi)
        path = self.assign_path(step, g)
        if f is None:
            with fs.open_input_file(path) as f:
                return self.assignment(fs, step, g, lo, hi, f)
        return _exact(np.frombuffer(f.read_at(4 * (hi - int(lo)), 4 * int(lo)), np.int32), hi - int(lo),
                      path).astype(np.int64)

    def write_assignment(self, fs, step: int, g: int, a: np.ndarray) -> None:
        _write_array(fs, self.assign_path(step, g), a, np.int32)

    def forget_assignment(self, step: int, g: int) -> None:
        self.filesystem().delete_file(self.assign_path(step, g))

    def forget_sums(self, step: int) -> None:
        if self.present.pop(step, None) is not None:
            self.filesystem().delete_dir(f"{self.base}/c{step}")

    def delete(self) -> None:
        """The round's folder, whatever it holds; a failed delete only warns (it never hides the
        round's own error)."""
        try:
            fs, base = client_fs(self.uri)
            fs.delete_dir(base)
        except Exception as e:  # noqa: BLE001 - cleanup after the work: report, go on
            log.warning("tree: could not delete the split's scratch folder %s: %s", self.uri, e)


def _write_array(fs, path: str, a: np.ndarray, dtype) -> None:
    """``a`` as ``dtype`` bytes in ``path``, whole or not at all (:func:`~..storage.write_whole`)."""
    data = np.ascontiguousarray(a, dtype).tobytes()
    write_whole(fs, path, lambda f: f.write(data))


def _exact(vals: np.ndarray, n: int, path: str) -> np.ndarray:
    if len(vals) != n:
        raise RuntimeError(f"tree split: {path} holds {len(vals)} values where {n} were written")
    return vals


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


def _assign(rows: DataFrame, files: _RoundFiles, step: int, active: List[int], caps, latest: np.ndarray,
            par: int) -> List[int]:
    """Step ``step``'s assignment of every active group (their centroids: the sums of ``step``);
    returns the groups whose assignment moved (their new one written as ``a<step>``). One job: the
    tasks score their rows against the centroids read from the files (z^T (c0 - c1) for a 2-way
    group, the kernel's projection; the k similarities otherwise), the scores are grouped by
    group, and each group's call makes the kernel's assignment from all of them, compares it
    with the group's last, and returns one row."""
    on = np.zeros(len(files.k), bool)
    on[active] = True
    d, k, ptr, last = files.d, files.k, files.ptr, latest.copy()
    files.make_assign_dir(step)

    def score(batches):
        fs, V = files.filesystem(), {}
        for b in batches:
            for pos, Z, g in _batch_groups(b, lambda p, g: on[g], d):
                if g not in V:
                    C = files.centroids(fs, step, g)
                    V[g] = C[0] - C[1] if k[g] == 2 else C
                v = V[g]
                s = _projection(Z.indptr, Z.indices, Z.data, v) if v.ndim == 1 else \
                    _similarities(Z.indptr, Z.indices, Z.data, v)
                yield pa.RecordBatch.from_arrays(
                    [pa.array(np.full(len(pos), g, np.int32)), pa.array(pos, pa.int64()),
                     binary_segments(s.ravel(), np.arange(len(pos) + 1) * (s.size // max(1, len(pos))), np.float64)],
                    ["g", "pos", "scores"])
                worker_progress("tree (split across tasks)", rows=len(pos))

    def decide(t: pa.Table) -> pa.Table:
        g = int(t.column("g")[0].as_py())
        m = int(ptr[g + 1] - ptr[g])
        at = t.column("pos").to_numpy() - ptr[g]
        order = np.argsort(at)                      # sorted, each of the group's positions exactly once
        if len(at) != m or not np.array_equal(at[order], np.arange(m)):
            raise RuntimeError(f"tree split: group {g} got {len(at)} scores for {m} labels")
        S = binary_values(t.column("scores"), np.float64).reshape(m, -1)[order]
        new = assignment(S[:, 0] if k[g] == 2 else S, caps[g])
        fs = files.filesystem()
        moved = bool(last[g] < 0 or not np.array_equal(new, files.assignment(fs, int(last[g]), g)))
        if moved:
            files.write_assignment(fs, step, g, new)
        return pa.table({"g": pa.array([g], pa.int32()), "moved": pa.array([moved])})

    scored = rows.mapInArrow(score, SCORES_SCHEMA)
    got = to_arrow(grouped_apply(scored.repartition(_parallel(par, len(active)), "g"), ["g"], decide,
                                 "g int, moved boolean"))
    return sorted(int(g) for g, mv in zip(got.column("g").to_pylist(), got.column("moved").to_pylist()) if mv)


def _sums(rows: DataFrame, files: _RoundFiles, out: int, active: List[int], latest: np.ndarray, par: int,
          seeds: Optional[np.ndarray] = None) -> None:
    """Each active group's per-child sums of its rows (k x d) by its latest assignment, written
    as step ``out``'s sums; with ``seeds`` (positions, each group's k in child order) the sums of
    those rows alone, child j of a group its j-th. One job: the tasks' partial sums (float32 per
    batch and group, as the kernel's, added in float64), summed by blocks whose tasks write them;
    the driver receives one row per block written."""
    on = np.zeros(len(files.k), bool)
    on[active] = True
    d, k, ptr, off, last = files.d, files.k, files.ptr, files.off, latest.copy()
    if seeds is not None:
        child = np.arange(len(seeds)) - np.repeat(np.cumsum(k) - k, k)     # j-th seed of its group: child j
        by_pos = np.argsort(seeds)
        seed_pos, seed_child = seeds[by_pos], child[by_pos]
    files.make_sums_dir(out)

    def keep(p, g):
        return on[g] if seeds is None else on[g] & np.isin(p, seed_pos)

    def part(batches):
        fs, opened = files.filesystem(), {}
        acc = np.zeros(int(off[-1]))
        try:
            for b in batches:
                for pos, Z, g in _batch_groups(b, keep, d):
                    if seeds is not None:
                        a = seed_child[np.searchsorted(seed_pos, pos)]
                    else:
                        if g not in opened:         # a group's file opened once a task, read by ranges
                            opened[g] = fs.open_input_file(files.assign_path(int(last[g]), g))
                        lo = int(pos.min() - ptr[g])
                        a = files.assignment(fs, int(last[g]), g, lo, int(pos.max() - ptr[g]) + 1,
                                             opened[g])[pos - ptr[g] - lo]
                    acc[off[g]:off[g + 1]] += _cluster_sums(Z.indptr, Z.indices, Z.data, a, int(k[g]), d).ravel()
                    worker_progress("tree (split across tasks)", rows=len(pos))
        finally:
            for f in opened.values():
                f.close()
        yield from partial_blocks(acc, files.block)

    def write(t: pa.Table) -> pa.Table:
        total = _sum_blocks(t)
        block = int(total.column("block")[0].as_py())
        files.write_sums(files.filesystem(), out, block, list_offsets_values(total, "vals")[1])
        return pa.table({"block": pa.array([block], pa.int32())})

    partials = rows.mapInArrow(part, PARTIAL_SCHEMA)
    got = to_arrow(grouped_apply(partials.repartition(_parallel(par, -(-int(off[-1]) // files.block)), "block"),
                                 ["block"], write, "block int"))
    files.present[out] = frozenset(int(b) for b in got.column("block").to_pylist())
