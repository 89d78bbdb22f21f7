"""Label tree on Spark, level by level: one Spark stage splits every oversized node of a level.

A node with at most max(``tree.local_subtree_size``, labels / task slots) labels
grows its whole subtree inside its task (same node ids and per-node seeds as level by level, so
the tree is identical); the levels above are split one Spark stage each. The second term stops the
levels as soon as there are about as many nodes as task slots (:func:`~..compat.task_slots`: N of
``local[N]``, else the default parallelism): a level costs a shuffle of the embeddings and some
scheduling, while a subtree grown in its task costs only its splits, and the task already holds no
more than its share of the embeddings (the root's split holds them all; ``local_subtree_size`` = 0
keeps every level a Spark stage).

Balanced splits (lambda = 0, the default) give each node of a depth ceil(labels / B^depth) labels
or one less, so the levels are known beforehand and run as one plan (:func:`_chained`): each
level's tasks hand their rows, embeddings included, to the next level's groups, without a job,
a checkpoint or a count on the driver between levels. Interpolated splits (lambda > 0), whose
sizes depend on the data, and ensembles of different branchings run one level at a time, the
driver counting each level's nodes. An ensemble (``tree.ensemble`` > 1 or
``tree.ensemble_splits``) grows all its trees in the same jobs: groups are (tree, node), tree
t splitting with :meth:`~xmc_spark.params.TreeParams.for_tree` (its own seed and branching).

A node with more labels than ``split_bound`` (``tree.max_split_labels``) is not split in one
task: :mod:`.split_across` splits it with its labels' rows spread over the partitions (the
balanced levels over the bound first, then the chained plan from the depth below them; in the
level-by-level loop, each level's balanced big nodes).
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp
from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_batches, csr_from_binary, grouped_apply, local_frame, nnz_cuts, pack_rows, to_arrow
from ..compat import partition_keys, session_settings, share, shuffle_partitions, task_slots
from ..kernels.tree import TREE_SHIFT, split_node, splits_balanced, tree_from_params
from ..params import TreeParams
from ..schemas import TREE_SCHEMA
from . import split_across
from .label_embedding import PACKED_BATCH_NNZ, PACKED_SCHEMA
from .shared_vectors import solver_tasks

log = logging.getLogger("xmc_spark.tree")


def _splitter(params: TreeParams, freqs, n_features: int, grow):
    """The kernel call of one (tree, node) group of (label_idx, node, tree, emb_idx, emb_val[, part])
    rows: t -> (row order by label, labels in that order, child node id of each, tree, the rows'
    CSR in that order or None if not built). ``grow(n)`` says whether a node of n labels grows its
    whole subtree here (else it is split one level); a node within ``max_leaf_size`` keeps its id
    (the last chained level's leaves: no CSR built)."""
    def split(t: pa.Table):
        order = np.argsort(t.column("label_idx").to_numpy(), kind="mergesort")
        labels = t.column("label_idx").take(pa.array(order)).combine_chunks()
        node = int(t.column("node")[0].as_py())
        tree = int(t.column("tree")[0].as_py())
        tp = params.for_tree(tree)
        if t.num_rows <= tp.max_leaf_size:
            return order, labels, np.full(t.num_rows, node, np.int64), tree, None
        Z = _sorted_csr(t, order, n_features)
        f = ft = None
        if freqs is not None:
            lab = labels.to_numpy().astype(np.int64)
            f, ft = freqs.value[0][lab], freqs.value[1][lab]
        if grow(t.num_rows):                      # small enough: the whole subtree here
            child = tree_from_params(Z, tp, f, ft, root=node)
        else:
            child = split_node(Z, node, tp.nr_splits, tp.max_iter, tp.seed, tp.effective_lambda, f, ft, tp.gamma,
                               tp.balanced_below_depth)
        return order, labels, child, tree, Z
    return split


def _sorted_csr(t: pa.Table, order: np.ndarray, n_features: int) -> sp.csr_matrix:
    """The packed rows of ``t`` as a CSR matrix in ``order`` (:func:`~..arrow_utils.csr_from_binary`)."""
    return csr_from_binary(t, "emb_idx", "emb_val", n_features, order if (np.diff(order) < 0).any() else None)


def _tree_rows(labels, child, tree: int) -> dict:
    return {"label_idx": labels, "node": pa.array(child, pa.int64()),
            "tree": pa.array(np.full(len(child), tree, np.int32))}


def split_level(embeddings: DataFrame, assign: DataFrame, big_nodes, n_features: int, params: TreeParams,
                freqs, local: int) -> DataFrame:
    """New (label_idx, node) for the labels of ``big_nodes``, one kernel call per node.

    ``freqs`` is a broadcast of (f, f_tilde) when the split is interpolated (lambda > 0).
    A node of at most ``local`` labels (:func:`local_size`) grows its subtree.
    """
    kernel = _splitter(params, freqs, n_features, lambda n: n <= local)

    def split(t: pa.Table) -> pa.Table:
        _, labels, child, tree, _ = kernel(t)
        return pa.table(_tree_rows(labels, child, tree))

    todo = assign.filter(_key().isin([int(k) for k in big_nodes])).join(embeddings, "label_idx")
    return grouped_apply(todo, ["tree", "node"], split, TREE_SCHEMA)


LEVEL_SCHEMA = "label_idx int, node long, tree int, part int, emb_idx binary, emb_val binary"
LEVEL_ARROW = pa.schema([("label_idx", pa.int32()), ("node", pa.int64()), ("tree", pa.int32()), ("part", pa.int32()),
                         ("emb_idx", pa.binary()), ("emb_val", pa.binary())])


def chained_levels(params: TreeParams, n_labels: int, local: int) -> int:
    """Levels of a balanced tree (lambda = 0) that are Spark stages, from the node sizes alone: the
    nodes at depth i hold ceil(labels / B^i) labels or one less, so the levels split while that is
    above ``local`` (and above ``max_leaf_size``); the first level within ``local`` grows every
    node's subtree in its task (0: the root is a leaf)."""
    B, size, level = params.nr_splits, int(n_labels), 0
    while size > params.max_leaf_size:
        if local > 0 and size <= local:
            return level + 1
        size, level = -(-size // B), level + 1
    return level


def _level_parts(n_trees: int, B: int, level: int, cap: int):
    """(partitions, key per partition) of the groups at ``level``: the (tree, node) groups there,
    up to ``cap``; group g (tree t, j-th node of the depth) is sent to partition g mod partitions
    by its key (:func:`~..compat.partition_keys`), so that no two groups share a task while there
    are tasks to spare (a hash of (tree, node) may send both children of the root to one task)."""
    n = n_trees * B ** level
    parts = int(min(n, max(1, cap)))
    return parts, partition_keys(parts).astype(np.int32)


def _group_index(B: int, level: int, tree, node) -> np.ndarray:
    """Index of (tree, node) among the (tree, node) groups at ``level`` (nodes of that depth)."""
    first = (B ** level - 1) // (B - 1)            # heap id of the first node at that depth
    return np.asarray(tree, np.int64) * np.int64(B ** level) + (np.asarray(node, np.int64) - np.int64(first))


def _chained(packed: DataFrame, params: TreeParams, n_features: int, n_labels: int, levels: int,
             cap: int, start: int = 0, placed: Optional[DataFrame] = None) -> DataFrame:
    """A balanced tree's levels as one Spark plan: each level's tasks split (or, the last, grow the
    subtrees of) its (tree, node) groups and hand their rows on, embeddings included, to the next
    level's groups through one shuffle into the partitions of :func:`_level_parts`. No level waits
    for the driver: the sizes are known beforehand (:func:`chained_levels`). The root's group
    places the labels without an embedding (no training sample) with an empty one. With
    ``start`` > 0 the plan begins at that depth from ``placed`` rows (label_idx, node, tree,
    part, emb_idx, emb_val: every label, its node there and the partition key of its group),
    the levels above having been split across tasks (:mod:`.split_across`)."""
    T, B = params.n_trees(), params.for_tree(0).nr_splits
    if placed is not None:
        rows = placed
    else:
        parts0, keys0 = _level_parts(T, B, 0, cap)
        trees = packed.sparkSession.range(T).select(
            F.col("id").cast("int").alias("tree"),
            F.element_at(F.array(*[F.lit(int(k)) for k in keys0]), (F.col("id") % parts0 + 1).cast("int"))
            .alias("part"))
        cols = ["label_idx", F.lit(0).cast("long").alias("node"), "tree", "part", "emb_idx", "emb_val"]
        # a placeholder row (label -1) per tree: its root's group exists even when no label has an embedding
        none = trees.select(F.lit(-1).alias("label_idx"), "tree", "part", F.lit(b"").alias("emb_idx"),
                            F.lit(b"").alias("emb_val"))
        rows = packed.crossJoin(F.broadcast(trees)).select(*cols).unionByName(none.select(*cols))
    for level in range(start, levels):
        last = level == levels - 1
        parts, _ = _level_parts(T, B, level, cap)
        step = _level_step(params, n_features, n_labels, B, level, None if last else _level_parts(T, B, level + 1, cap))
        rows = grouped_apply(rows.repartition(parts, "part"), ["part", "tree", "node"], step,
                             TREE_SCHEMA if last else LEVEL_SCHEMA)
    return rows


def _level_step(params: TreeParams, n_features: int, n_labels: int, B: int, level: int, nxt):
    """One chained level's group function: split (the last level, ``nxt`` None: grow the subtrees
    of) the group's node; hand on the rows with their embeddings and the next level's partition
    key (``nxt``: that level's :func:`_level_parts`)."""
    kernel = _splitter(params, None, n_features, lambda n: nxt is None)

    def step(t: pa.Table) -> pa.Table:
        if level == 0:
            t = _root_rows(t, n_labels)
        order, labels, child, tree, Z = kernel(t)
        out = _tree_rows(labels, child, tree)
        if nxt is None:
            return pa.table(out)
        if Z is None:
            Z = _sorted_csr(t, order, n_features)
        out["part"] = pa.array(nxt[1][np.mod(_group_index(B, level + 1, tree, child), nxt[0])], pa.int32())
        batches = csr_batches(out, Z, PACK_NNZ)     # the rows' embeddings packed from Z, cut by non-zeros
        return pa.Table.from_batches(batches, LEVEL_ARROW) if batches else LEVEL_ARROW.empty_table()
    return step


def _root_rows(t: pa.Table, n_labels: int) -> pa.Table:
    """A root group's rows: those of a label in [0, n_labels) (the placeholder row of label -1
    that makes the group exist dropped), and a row with an empty embedding for each label of that
    range it lacks (no training sample)."""
    tree, part = t.column("tree")[0].as_py(), t.column("part")[0].as_py()
    lab = t.column("label_idx").to_numpy()
    keep = (lab >= 0) & (lab < n_labels)
    if not keep.all():
        t, lab = t.filter(pa.array(keep)), lab[keep]
    missing = np.setdiff1d(np.arange(n_labels, dtype=np.int64), lab)
    if not len(missing):
        return t
    k = len(missing)
    fill = pa.table({"label_idx": pa.array(missing.astype(np.int32)), "node": pa.array(np.zeros(k, np.int64)),
                     "tree": pa.array(np.full(k, tree, np.int32)),
                     "emb_idx": pa.array([b""] * k, pa.binary()), "emb_val": pa.array([b""] * k, pa.binary()),
                     "part": pa.array(np.full(k, part, np.int32))})
    return pa.concat_tables([t.select(fill.column_names).cast(fill.schema), fill])


PACK_NNZ = PACKED_BATCH_NNZ    # non-zeros of one packed batch of a level's rows


def _packed(batches, pack_nnz: int = PACK_NNZ):
    """(label_idx, emb_idx, emb_val) batches with the two lists packed (:func:`~..arrow_utils.pack_rows`),
    an input batch cut where the running count of non-zeros passes a multiple of ``pack_nnz``
    (:func:`~..arrow_utils.nnz_cuts`: a packed batch holds fewer than ``pack_nnz`` plus its longest row's)."""
    for b in batches:
        t = pa.Table.from_batches([b])
        ends = np.cumsum(pc.list_value_length(t.column("emb_idx")).fill_null(0).to_numpy(zero_copy_only=False))
        for lo, hi in nnz_cuts(ends, pack_nnz):
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


def _chainable(params: TreeParams) -> bool:
    """Whether the node sizes are known beforehand (:func:`chained_levels`): balanced splits
    (lambda = 0) with one branching for every tree."""
    return params.effective_lambda == 0 and len({params.for_tree(t).nr_splits for t in range(params.n_trees())}) == 1


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


def is_packed(embeddings: DataFrame) -> bool:
    """Whether ``embeddings`` carry their rows packed (binary ``emb_idx``), not as lists."""
    return dict(embeddings.dtypes).get("emb_idx") == "binary"


def run(embeddings: DataFrame, params: TreeParams, *, n_features: int, n_labels: int, f=None,
        f_tilde=None, split_bound: int = 0, scratch: Optional[str] = None) -> DataFrame:
    """(label_idx, node, tree): the leaf of each label in each tree (tree = 0 for one tree).
    Labels without an embedding (no training sample) are still placed: they join the tree
    with an empty embedding. ``embeddings`` are rows of the ``label_embeddings`` table, or those
    rows packed (:data:`~.label_embedding.PACKED_SCHEMA`, :func:`~.label_embedding.run` with
    ``packed``).

    ``f`` and ``f_tilde`` (label frequencies, :mod:`.label_frequencies`) are required when
    the tree is interpolated (lambda > 0). A balanced split of a node with more than
    ``split_bound`` labels (0: none) runs across tasks (:mod:`.split_across`;
    :func:`.split_across.label_bound` resolves ``tree.max_split_labels``), its steps' files under
    ``scratch`` (a folder every task sees; default :func:`..compat.scratch_root`)."""
    spark = embeddings.sparkSession
    if params.effective_lambda > 0 and (f is None or f_tilde is None):
        raise ValueError("an interpolated tree (lambda > 0) needs label frequencies f and f_tilde")
    trees = spark.range(params.n_trees()).select(F.col("id").cast("int").alias("tree"))
    all_labels = spark.range(n_labels).select(F.col("id").cast("int").alias("label_idx"))
    if n_labels <= params.max_leaf_size:       # every root is a leaf
        return all_labels.crossJoin(trees).select("label_idx", F.lit(0).cast("long").alias("node"),
                                                  "tree").localCheckpoint()
    # the rows' non-zeros packed as bytes (list rows: packed where they are read, in parallel), so
    # that a split task receives them whole: Spark hands list columns to Python number by number,
    # and the root's task (every label's row; 500K set, 50K labels) took 6.0 s, its split ~1 s of it
    packed = embeddings if is_packed(embeddings) else embeddings.mapInArrow(_packed, PACKED_SCHEMA)
    local = local_size(params, n_labels, task_slots(spark))
    if split_bound > 0 and local > split_bound:     # no node over the split bound grows in a task
        local = split_bound
    levels = chained_levels(params.for_tree(0), n_labels, local) if _chainable(params) else 0
    if levels:
        B = params.for_tree(0).nr_splits
        deepest = chained_levels(params.for_tree(0), n_labels, 0)          # the leaves' depth
        _fits((B ** (deepest + 1) - 1) // (B - 1) - 1, params)              # the last id of that depth
        across = split_across.big_depths(n_labels, B, split_bound, params.for_tree(0).max_leaf_size)
        if across:
            return _chained_after_split(packed, params, n_features, n_labels, max(levels, across + 1), across,
                                        split_bound, shuffle_partitions(spark), scratch)
        log.info("tree: %d level(s) chained in one plan (%d labels, subtrees grown from %d labels)", levels,
                 n_labels, local)
        return _chained(packed, params, n_features, n_labels, levels, shuffle_partitions(spark)).localCheckpoint()

    # Otherwise (interpolated splits, or an ensemble of different branchings) level by level, the
    # driver counting each level's nodes; the frequencies' share and the embeddings' cache are
    # released however the levels end
    freqs = emb = None
    try:
        if params.effective_lambda > 0:
            freqs = share(spark, (np.asarray(f, np.float64), np.asarray(f_tilde, np.float64)),
                          name="the label frequencies (f, f_tilde)")
        emb = _every_label(packed, n_labels).cache()

        # Each level's output is checkpointed: the plan of the next level starts from it, so plans
        # do not grow with depth (a union of every earlier level would double the plan per level).
        active = all_labels.crossJoin(trees).withColumn("node", F.lit(0).cast("long")).select(
            "label_idx", "node", "tree")
        sizes = {t << TREE_SHIFT: n_labels for t in range(params.n_trees())}
        finished = []
        depth = 0
        while True:
            big = sorted(n for n, c in sizes.items() if c > params.max_leaf_size)
            if not big:
                break
            new = _split_big(emb, active, big, sizes, n_features, params, freqs, local, split_bound, scratch)
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
        assign = finished[0]
        for part in finished[1:]:
            assign = assign.unionByName(part)
        return assign.localCheckpoint()
    finally:
        if emb is not None:
            emb.unpersist()
        if freqs is not None:
            freqs.unpersist()


def _every_label(packed: DataFrame, n_labels: int) -> DataFrame:
    """A packed row for every label in [0, n_labels): its embedding, or an empty one (no sample)."""
    all_labels = packed.sparkSession.range(n_labels).select(F.col("id").cast("int").alias("label_idx"))
    return all_labels.join(packed, "label_idx", "left").select(
        "label_idx", F.coalesce("emb_idx", F.lit(b"")).alias("emb_idx"),
        F.coalesce("emb_val", F.lit(b"")).alias("emb_val"))


def _chained_after_split(packed: DataFrame, params: TreeParams, n_features: int, n_labels: int, levels: int,
                         across: int, bound: int, cap: int, scratch: Optional[str] = None) -> DataFrame:
    """The balanced tree whose first ``across`` levels hold nodes over ``bound`` labels: those
    levels split across tasks (:func:`.split_across.split_across`, the driver keeping each
    label's node), then the chained plan from that depth (:func:`_chained`). The rows of every
    label are persisted meanwhile (the split's queries and the plan read them) in the split's task
    count of partitions (:func:`~.shared_vectors.solver_tasks`), not the shuffle partitions: each
    pass over them is a job of that many tasks, and every task reports its metrics to the driver."""
    T, B = params.n_trees(), params.for_tree(0).nr_splits
    spark = packed.sparkSession
    # the join's shuffles planned with that many partitions (persist plans the cached query now)
    with session_settings(spark, {"spark.sql.shuffle.partitions": str(solver_tasks(spark))}, "the labels' rows"):
        emb = _every_label(packed, n_labels).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        labels = np.tile(np.arange(n_labels, dtype=np.int64), T)
        trees = np.repeat(np.arange(T, dtype=np.int64), n_labels)
        nodes = split_across.split_across(emb, labels, trees, np.zeros(len(labels), np.int64), params, n_features,
                                          bound, levels=across, scratch=scratch)
        parts, keys = _level_parts(T, B, across, cap)
        placed, shared = split_across.placed_rows(
            emb, labels, trees, {"node": (nodes, "long"),
                                 "part": (keys[np.mod(_group_index(B, across, trees, nodes), parts)], "int")},
            "the labels' nodes")
        try:
            log.info("tree: %d level(s) split across tasks (nodes over %d labels), then %d chained in one plan "
                     "(%d labels)", across, bound, levels - across, n_labels)
            rows = placed.select("label_idx", "node", "tree", "part", "emb_idx", "emb_val")
            return _chained(packed, params, n_features, n_labels, levels, cap, start=across,
                            placed=rows).localCheckpoint()
        finally:
            if shared is not None:
                shared.unpersist()
    finally:
        emb.unpersist()


def _balanced_at(key: int, params: TreeParams) -> bool:
    """Whether the (tree, node) ``key``'s split is the balanced k-means (lambda = 0, or a node at
    ``balanced_below_depth`` or deeper): the split :mod:`.split_across` distributes."""
    tp = params.for_tree(int(key) >> TREE_SHIFT) if params.n_trees() > 1 else params
    node = int(key) & ((1 << TREE_SHIFT) - 1) if params.n_trees() > 1 else int(key)
    return splits_balanced(node, tp.nr_splits, tp.effective_lambda, tp.balanced_below_depth)


def _split_big(emb: DataFrame, active: DataFrame, big, sizes: dict, n_features: int, params: TreeParams, freqs,
               local: int, bound: int, scratch: Optional[str] = None) -> DataFrame:
    """One level of the level-by-level tree, checkpointed: the balanced splits of nodes over
    ``bound`` labels across tasks (:func:`.split_across.split_across`, one level), the other
    nodes of ``big`` in a task each (:func:`split_level`)."""
    across = [k for k in big if bound and sizes[k] > bound and _balanced_at(k, params)]
    inside = [k for k in big if k not in set(across)]
    over = [k for k in inside if bound and sizes[k] > bound]
    if over:
        log.warning("tree: %d node(s) over tree.max_split_labels = %d labels (up to %d) split in one task each: "
                    "the interpolated split (lambda > 0) is not distributed", len(over), bound,
                    max(sizes[k] for k in over))
    pieces = []
    if across:
        got = to_arrow(active.filter(_key().isin([int(k) for k in across])))
        labels = got.column("label_idx").to_numpy().astype(np.int64)
        trees = got.column("tree").to_numpy().astype(np.int64)
        nodes = split_across.split_across(emb, labels, trees, got.column("node").to_numpy().astype(np.int64),
                                          params, n_features, bound, levels=1, scratch=scratch)
        pieces.append(local_frame(emb.sparkSession, {"label_idx": pa.array(labels.astype(np.int32)),
                                                     "node": pa.array(nodes),
                                                     "tree": pa.array(trees.astype(np.int32))}))
    if inside:
        pieces.append(split_level(emb, active, inside, n_features, params, freqs, local))
    new = pieces[0]
    for p in pieces[1:]:
        new = new.unionByName(p)
    return new.localCheckpoint()
