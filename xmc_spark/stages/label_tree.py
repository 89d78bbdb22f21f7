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
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_from_binary, grouped_apply, pack_rows
from ..compat import share, task_slots
from ..kernels.tree import TREE_SHIFT, split_node, tree_from_params
from ..params import TreeParams
from ..schemas import TREE_SCHEMA

log = logging.getLogger("xmc_spark.tree")


def split_level(embeddings: DataFrame, assign: DataFrame, big_nodes, n_features: int, params: TreeParams,
                freqs, local: int) -> DataFrame:
    """New (label_idx, node) for the labels of ``big_nodes``, one kernel call per node.

    ``freqs`` is a broadcast of (f, f_tilde) when the split is interpolated (lambda > 0).
    A node of at most ``local`` labels (:func:`local_size`) grows its subtree.
    """
    def split(t: pa.Table) -> pa.Table:
        order = np.argsort(t.column("label_idx").to_numpy(), kind="mergesort")
        labels = t.column("label_idx").take(pa.array(order))
        node = int(t.column("node")[0].as_py())
        tree = int(t.column("tree")[0].as_py())
        tp = params.for_tree(tree)
        Z = csr_from_binary(t, "emb_idx", "emb_val", n_features)
        if (np.diff(order) < 0).any():           # rows not in label order: sort them (a copy)
            Z = Z[order]
        f = ft = None
        if freqs is not None:
            lab = labels.to_numpy().astype(np.int64)
            f, ft = freqs.value[0][lab], freqs.value[1][lab]
        if t.num_rows <= local:                   # small enough: the whole subtree here
            child = tree_from_params(Z, tp, f, ft, root=node)
        else:
            child = split_node(Z, node, tp.nr_splits, tp.max_iter, tp.seed, tp.effective_lambda, f, ft, tp.gamma,
                               tp.balanced_below_depth)
        return pa.table({"label_idx": labels, "node": pa.array(child, pa.int64()),
                         "tree": pa.array(np.full(t.num_rows, tree, np.int32))})

    todo = assign.filter(_key().isin([int(k) for k in big_nodes])).join(embeddings, "label_idx")
    return grouped_apply(todo, ["tree", "node"], split, TREE_SCHEMA)


PACKED_SCHEMA = "label_idx int, emb_idx binary, emb_val binary"
PACK_NNZ = 1 << 26          # non-zeros of one packed batch (256 MiB of indices: below a binary array's 2 GiB)


def _packed(batches, pack_nnz: int = PACK_NNZ):
    """(label_idx, emb_idx, emb_val) batches with the two lists packed (:func:`~..arrow_utils.pack_rows`),
    an input batch cut where the running count of non-zeros passes a multiple of ``pack_nnz``: a
    packed batch holds under 2 x ``pack_nnz`` of them, or a single longer row (a row is never cut)."""
    for b in batches:
        t = pa.Table.from_batches([b])
        ends = np.cumsum(pc.list_value_length(t.column("emb_idx")).fill_null(0).to_numpy(zero_copy_only=False))
        cuts = np.unique(np.concatenate([[0], np.searchsorted(ends, np.arange(pack_nnz, ends[-1] if len(ends) else 0,
                                                                              pack_nnz), side="right"), [len(ends)]]))
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            part = t.slice(lo, hi - lo)
            idx, val = pack_rows(part, "emb_idx", "emb_val")
            yield pa.RecordBatch.from_arrays([part.column("label_idx").combine_chunks(), idx, val],
                                             ["label_idx", "emb_idx", "emb_val"])


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
    all_labels = spark.range(n_labels).select(F.col("id").cast("int").alias("label_idx"))
    # the rows' non-zeros packed as bytes where the table is read (its tasks in parallel), so that
    # a split task receives them whole: Spark hands list columns to Python number by number, and
    # the root's task (every label's row; 500K set, 50K labels) took 6.0 s, its split ~1 s of it
    emb = all_labels.join(embeddings.mapInArrow(_packed, PACKED_SCHEMA), "label_idx", "left").select(
        "label_idx",
        F.coalesce("emb_idx", F.lit(b"")).alias("emb_idx"),
        F.coalesce("emb_val", F.lit(b"")).alias("emb_val")).cache()

    # Each level's output is checkpointed: the plan of the next level starts from it, so plans
    # do not grow with depth (a union of every earlier level would double the plan per level).
    trees = spark.range(params.n_trees()).select(F.col("id").cast("int").alias("tree"))
    active = all_labels.crossJoin(trees).withColumn("node", F.lit(0).cast("long")).select(
        "label_idx", "node", "tree")
    sizes = {t << TREE_SHIFT: n_labels for t in range(params.n_trees())}
    finished = []
    depth = 0
    local = local_size(params, n_labels, task_slots(spark))
    while True:
        big = sorted(n for n, c in sizes.items() if c > params.max_leaf_size)
        if not big:
            break
        new = split_level(emb, active, big, n_features, params, freqs, local).localCheckpoint()
        # the children's sizes come back in a second, small job over the checkpointed level
        grown = {int(r["key"]): int(r["count"]) for r in new.groupBy(_key().alias("key"), "node").count()
                 .select("key", "node", "count").collect() if _fits(r["node"], params)}
        sizes = {n: c for n, c in grown.items()}
        big_next = [n for n, c in grown.items() if c > params.max_leaf_size]
        finished.append(new.filter(~_key().isin(big_next)) if big_next else new)
        active = new.filter(_key().isin(big_next))
        depth += 1
        log.info("tree level %d: split %d nodes into %d nodes (%d labels now in leaves)", depth, len(big),
                 len(grown), sum(c for c in grown.values() if c <= params.max_leaf_size))
    if not finished:
        finished = [active]
    assign = finished[0]
    for part in finished[1:]:
        assign = assign.unionByName(part)
    assign = assign.localCheckpoint()
    emb.unpersist()
    if freqs is not None:
        freqs.unpersist()
    return assign
