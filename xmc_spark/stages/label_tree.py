"""Label tree on Spark, level by level: one job splits every oversized node of a level.

A node with at most ``tree.local_subtree_size`` labels grows its whole subtree inside its
task (same node ids and per-node seeds as level by level, so the tree is identical); the
levels above stay one Spark job each.
"""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_from_table, grouped_apply
from ..compat import share
from ..kernels.tree import split_node, tree_from_params
from ..params import TreeParams
from ..schemas import TREE_SCHEMA

log = logging.getLogger("xmc_spark.tree")


def split_level(embeddings: DataFrame, assign: DataFrame, big_nodes, n_features: int, params: TreeParams,
                freqs=None) -> DataFrame:
    """New (label_idx, node) for the labels of ``big_nodes``, one kernel call per node.

    ``freqs`` is a broadcast of (f, f_tilde) when the split is interpolated (lambda > 0).
    """
    B, it, seed = params.nr_splits, params.max_iter, params.seed
    lam, gamma, deep = params.effective_lambda, params.gamma, params.balanced_below_depth

    def split(t: pa.Table) -> pa.Table:
        order = np.argsort(t.column("label_idx").to_numpy(), kind="mergesort")
        t = t.take(pa.array(order))
        node = int(t.column("node")[0].as_py())
        Z = csr_from_table(t, "emb_idx", "emb_val", n_features)
        f = ft = None
        if freqs is not None:
            lab = t.column("label_idx").to_numpy().astype(np.int64)
            f, ft = freqs.value[0][lab], freqs.value[1][lab]
        if t.num_rows <= params.local_subtree_size:   # small enough: the whole subtree here
            child = tree_from_params(Z, params, f, ft, root=node)
        else:
            child = split_node(Z, node, B, it, seed, lam, f, ft, gamma, deep)
        return pa.table({"label_idx": t.column("label_idx"), "node": pa.array(child, pa.int64())})

    todo = assign.filter(F.col("node").isin(list(big_nodes))).join(embeddings, "label_idx")
    return grouped_apply(todo, ["node"], split, TREE_SCHEMA)


def run(embeddings: DataFrame, params: TreeParams, *, n_features: int, n_labels: int, f=None,
        f_tilde=None) -> DataFrame:
    """(label_idx, node): the leaf of each label. Labels without an embedding (no training
    sample) are still placed: they join the tree with an empty embedding.

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
    emb = all_labels.join(embeddings, "label_idx", "left").select(
        "label_idx",
        F.coalesce("emb_idx", F.array().cast("array<int>")).alias("emb_idx"),
        F.coalesce("emb_val", F.array().cast("array<float>")).alias("emb_val")).cache()

    # Each level's output is checkpointed: the plan of the next level starts from it, so plans
    # do not grow with depth (a union of every earlier level would double the plan per level).
    active = all_labels.withColumn("node", F.lit(0).cast("long"))
    sizes = {0: n_labels}
    finished = []
    depth = 0
    while True:
        big = sorted(n for n, c in sizes.items() if c > params.max_leaf_size)
        if not big:
            break
        new = split_level(emb, active, big, n_features, params, freqs).localCheckpoint()
        # the children's sizes come back in a second, small job over the checkpointed level
        grown = {int(r["node"]): int(r["count"]) for r in new.groupBy("node").count().collect()}
        sizes = {n: c for n, c in grown.items()}
        big_next = [n for n, c in grown.items() if c > params.max_leaf_size]
        finished.append(new.filter(~F.col("node").isin(big_next)) if big_next else new)
        active = new.filter(F.col("node").isin(big_next))
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
