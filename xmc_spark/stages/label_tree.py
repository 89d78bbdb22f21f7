"""Label tree on Spark, level by level: one job splits every oversized node of a level.

A node with at most max(``tree.local_subtree_size``, labels / task slots) labels
grows its whole subtree inside its task (same node ids and per-node seeds as level by level, so
the tree is identical); the levels above stay one Spark job each. The second term stops the
levels as soon as there are about as many nodes as task slots (:func:`~..compat.task_slots`: N of
``local[N]``, else the default parallelism): a level job costs about a second
of Spark's scheduling and checkpointing, while a subtree grown in its task costs only its
splits, and the task already holds no more than its share of the embeddings (the root's split
holds them all; ``local_subtree_size`` = 0 keeps every level a Spark job). An ensemble (``tree.ensemble`` > 1 or
``tree.ensemble_splits``) grows all its trees in the same jobs: groups are (tree, node), tree
t splitting with :meth:`~xmc_spark.params.TreeParams.for_tree` (its own seed and branching).
"""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import scipy.sparse as sp
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_from_table, grouped_apply, list_array
from ..compat import share, task_slots
from ..kernels.tree import TREE_SHIFT, split_node, tree_from_params
from ..params import TreeParams
from ..schemas import TREE_SCHEMA

log = logging.getLogger("xmc_spark.tree")
LEVEL_SCHEMA = TREE_SCHEMA + ", emb_idx array<int>, emb_val array<float>"


def split_level(active: DataFrame, big_nodes, n_features: int, params: TreeParams, freqs, local: int) -> DataFrame:
    """New (label_idx, node, tree, emb_idx, emb_val) for the labels of ``big_nodes``, one kernel
    call per node: rows of ``active`` (label_idx, node, tree, emb_idx, emb_val, real) carry their
    embeddings, so no level joins the embeddings again. A row keeps its embedding only where its
    new node still has more than ``max_leaf_size`` labels (the next level's input); elsewhere
    (leaves, subtrees grown here) the arrays are empty.

    At the root a label may come twice: its embedding (``real``) and a placeholder with empty
    arrays, so that a label without an embedding (no training sample) is still placed; the task
    keeps the embedding where there is one. ``freqs`` is a broadcast of (f, f_tilde) when the
    split is interpolated (lambda > 0). A node of at most ``local`` labels (:func:`local_size`)
    grows its subtree.
    """
    max_leaf = int(params.max_leaf_size)

    def split(t: pa.Table) -> pa.Table:
        lab = t.column("label_idx").to_numpy()
        order = np.lexsort((~t.column("real").to_numpy(zero_copy_only=False), lab))   # by label, embeddings first
        first = np.ones(len(order), bool)
        first[1:] = lab[order][1:] != lab[order][:-1]
        t = t.take(pa.array(order[first]))
        node = int(t.column("node")[0].as_py())
        tree = int(t.column("tree")[0].as_py())
        tp = params.for_tree(tree)
        Z = csr_from_table(t, "emb_idx", "emb_val", n_features)
        f = ft = None
        if freqs is not None:
            labels = t.column("label_idx").to_numpy().astype(np.int64)
            f, ft = freqs.value[0][labels], freqs.value[1][labels]
        if t.num_rows <= local:                   # small enough: the whole subtree here
            child = tree_from_params(Z, tp, f, ft, root=node)
        else:
            child = split_node(Z, node, tp.nr_splits, tp.max_iter, tp.seed, tp.effective_lambda, f, ft, tp.gamma,
                               tp.balanced_below_depth)
        kids, size = np.unique(child, return_counts=True)
        keep = np.isin(child, kids[size > max_leaf]) if t.num_rows > local else np.zeros(len(child), bool)
        idx, val = _rows_where(Z, keep)
        return pa.table({"label_idx": t.column("label_idx"), "node": pa.array(child, pa.int64()),
                         "tree": pa.array(np.full(t.num_rows, tree, np.int32)), "emb_idx": idx, "emb_val": val})

    todo = active.filter(_key().isin([int(k) for k in big_nodes]))
    return grouped_apply(todo, ["tree", "node"], split, LEVEL_SCHEMA)


def _rows_where(Z: sp.csr_matrix, keep: np.ndarray):
    """(indices, values) list arrays of Z's rows where ``keep``, empty lists elsewhere."""
    lens = np.diff(Z.indptr)
    ptr = np.concatenate([[0], np.cumsum(np.where(keep, lens, 0))])
    nz = np.repeat(keep, lens)
    return (list_array(ptr, Z.indices[nz].astype(np.int32), pa.int32()),
            list_array(ptr, Z.data[nz].astype(np.float32), pa.float32()))


def local_size(params: TreeParams, n_labels: int, slots: int) -> int:
    """Labels up to which a node grows its whole subtree in its task: max(local_subtree_size,
    ceil(labels / task slots)), or 0 (every level a job) when local_subtree_size is 0."""
    if params.local_subtree_size <= 0:
        return 0
    return max(int(params.local_subtree_size), -(-int(n_labels) // max(1, int(slots))))


def _fits(node: int, params: TreeParams) -> bool:
    """Whether ``node`` can be an ensemble key's id (< 2^TREE_SHIFT); a deeper node of an
    ensemble stops the stage with the reason (a single tree's ids are not encoded)."""
    if params.n_trees() > 1 and int(node) >= 1 << TREE_SHIFT:
        from ..params import ConfigError
        raise ConfigError(f"tree node id {int(node)} does not fit an ensemble key (< 2^{TREE_SHIFT}): the "
                         "tree is too deep for tree.ensemble > 1 (lower tree.balanced_below_depth or lambda)")
    return True


def _key():
    """(tree, node) as one long: :func:`~xmc_spark.kernels.tree.encode_keys`."""
    return F.shiftleft(F.col("tree").cast("long"), TREE_SHIFT).bitwiseOR(F.col("node"))


def run(embeddings: DataFrame, params: TreeParams, *, n_features: int, n_labels: int, f=None,
        f_tilde=None) -> DataFrame:
    """(label_idx, node, tree): the leaf of each label in each tree (tree = 0 for one tree).
    Labels without an embedding (no training sample) are still placed: they join the tree
    with an empty embedding.

    ``f`` and ``f_tilde`` (label frequencies, :mod:`.label_frequencies`) are required when
    the tree is interpolated (lambda > 0)."""
    spark = embeddings.sparkSession
    freqs = None
    if params.effective_lambda > 0:
        if f is None or f_tilde is None:
            raise ValueError("an interpolated tree (lambda > 0) needs label frequencies f and f_tilde")
        freqs = share(spark, (np.asarray(f, np.float64), np.asarray(f_tilde, np.float64)),
                      name="the label frequencies (f, f_tilde)")
    # The root's input: every embedding, plus a placeholder row per label (empty arrays, real =
    # false) that places the labels without one; a union, not a join, so the embeddings go
    # through one shuffle (the grouping by node) per level and are never cached or joined.
    empty_idx, empty_val = F.array().cast("array<int>"), F.array().cast("array<float>")
    placeholders = spark.range(n_labels).select(F.col("id").cast("int").alias("label_idx"),
                                                empty_idx.alias("emb_idx"), empty_val.alias("emb_val"),
                                                F.lit(False).alias("real"))
    rows = embeddings.select("label_idx", F.coalesce("emb_idx", empty_idx).alias("emb_idx"),
                             F.coalesce("emb_val", empty_val).alias("emb_val"),
                             F.lit(True).alias("real")).unionByName(placeholders)
    # Each level's output is checkpointed: the plan of the next level starts from it, so plans
    # do not grow with depth (a union of every earlier level would double the plan per level).
    trees = spark.range(params.n_trees()).select(F.col("id").cast("int").alias("tree"))
    active = rows.crossJoin(trees).withColumn("node", F.lit(0).cast("long"))
    sizes = {t << TREE_SHIFT: n_labels for t in range(params.n_trees())}
    finished = []
    depth = 0
    local = local_size(params, n_labels, task_slots(spark))
    while True:
        big = sorted(n for n, c in sizes.items() if c > params.max_leaf_size)
        if not big:
            break
        new = split_level(active, big, n_features, params, freqs, local).localCheckpoint()
        # the children's sizes come back in a second, small job over the checkpointed level
        grown = {int(r["key"]): int(r["count"]) for r in new.groupBy(_key().alias("key"), "node").count()
                 .select("key", "node", "count").collect() if _fits(r["node"], params)}
        sizes = {n: c for n, c in grown.items()}
        big_next = [n for n, c in grown.items() if c > params.max_leaf_size]
        done = new.filter(~_key().isin(big_next)) if big_next else new
        finished.append(done.select("label_idx", "node", "tree"))
        active = new.filter(_key().isin(big_next)).withColumn("real", F.lit(True))
        depth += 1
        log.info("tree level %d: split %d nodes into %d nodes (%d labels now in leaves)", depth, len(big),
                 len(grown), sum(c for c in grown.values() if c <= params.max_leaf_size))
    if not finished:                          # the root is a leaf: every label in node 0
        finished = [spark.range(n_labels).select(F.col("id").cast("int").alias("label_idx"))
                    .crossJoin(trees).select("label_idx", F.lit(0).cast("long").alias("node"), "tree")]
    assign = finished[0]
    for part in finished[1:]:
        assign = assign.unionByName(part)
    assign = assign.localCheckpoint()
    if freqs is not None:
        freqs.unpersist()
    return assign
