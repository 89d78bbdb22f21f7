"""Per-node linear trainer on Spark: samples fan out to the nodes they reach; a node's
one-vs-rest classifiers are trained either in one task (small nodes) or across the partitions
holding its rows (big nodes).

**Small nodes** (at most ``train.max_node_rows`` training rows): the dual coordinate descent kernel
(:func:`..model.train_group`) in ``applyInArrow`` groups of *training units*: a node above the cut
depth (:func:`unit_depth`: the shallowest with :data:`UNITS_PER_SLOT` nodes per unit of Spark's
default parallelism in a full tree) is a unit of its own, or, where their work fits in a task slot's
share and no node is big, the nodes above the cut are one unit per tree (:func:`merged_top`); below
it, a unit is the subtree of a node at the cut, whose nodes the task trains in turn, or, where that
node is big, the subtree of the shallowest node on the way down that is not (:func:`training_units`:
a big node's unit is its own, trained apart). Each sample travels to a unit once
(:func:`_pack_units`: one packed record per input batch and unit), not once per node it reaches, so
the shuffle no longer grows with the tree's depth. A unit's rows are its top node's rows, within the
bound since that node is not big, beside one (row, node) pair per node of the unit a row reaches
(~44-68 bytes each while the unit is unpacked: a merged top unit holds every row with its ~6 pairs
at 500K samples, ~0.3-0.45 KB a row beyond the ~2.7 KB a row the bound models, inside
:data:`MEMORY_FRACTION`'s margin).

**Big nodes** (more rows than the bound; the root has every sample): the same problem,
min_w 0.5 ||w||^2 + sum_i C_i max(0, 1 - y_i w^T x_i)^2 per classifier, solved in the primal
by trust-region Newton (:mod:`..kernels.tron`) with the rows left spread over the partitions.
The big nodes' rows (of every level) are fanned out once, tagged with their node and their
positive classifiers, range-partitioned by (node, row hash) over as many partitions as Spark
runs tasks at once (more where a partition would exceed :data:`PART_BOUNDS` bounds:
:func:`big_row_partitions`; a node's rows fill consecutive partitions, so a partition holds one
or a few nodes), packed into CSR blocks of at most the bound's rows in binary columns
(:func:`_pack_rows`) and persisted. The solver's queries merge those partitions into at most
as many tasks as Spark runs at once (:func:`.shared_vectors.query_tasks`) and read them one
packed block per Arrow batch (:class:`_solver_session`), so a task's Python worker holds one
block of at most the bound's rows at a time, whatever its partitions' sizes. Then
one TRON loop runs on the driver for all big nodes' classifiers at once, out of step: every data
pass gives each running classifier its next operation (a Hessian-vector product inside its CG,
the gradient at its trial point after it) and is one Spark query over the persisted rows
(``mapInArrow``: per-task partial sums, cut into blocks of
:data:`BLOCK` doubles -> ``groupBy(block).applyInArrow(sum)`` -> collect), so the driver
receives one summed vector per query, of size (features + 1) x (classifiers still running),
and never a row. W and the CG direction travel to the tasks inside the query's closure (no
``SparkContext``: also Spark Connect). A classifier stops at ||g|| <= eps_k ||g(0)|| with
eps_k = ``train.tron_eps`` x max(min(#pos, #neg), 1) / #rows (LIBLINEAR's scaling: unscaled,
classifiers with few positives stop far from the optimum) or after ``train.tron_max_iter``
trust-region steps. Passes: 1 + the largest classifier's own count of CG and trust-region steps,
for all big nodes together. Weights are pruned by
``train.threshold`` as the kernel prunes them and become rows of the returned DataFrame (same
schema as the grouped path's).

**Streamed big nodes** (``train.big_node_solver``: ``streamed``, and ``auto`` in local mode:
:func:`big_node_solver`): the same rows, packed the same way, are not shuffled but fanned out,
packed and written as block files by the tasks that read the samples, and one task per big node
runs the grouped path's dual coordinate descent over them, a few blocks at a time, with no Spark
job per pass (:mod:`.streamed_nodes`).

**The solver's vectors.** Up to ``train.tron_driver_mb`` (one d x K_big float64 vector) they
live on the driver as above: each query ships W and the direction to the tasks and collects one
summed vector. Above it, the same loop (:func:`..kernels.tron.tron_space`) runs over
:class:`.shared_vectors.SharedSpace`: the vectors are files under the run's scratch folder,
written and read by the tasks; each query's tasks read their nodes' W and direction from the
files, the summed pieces are written back by the reduce tasks, the CG updates ride along with
the next query, and the driver receives only per-classifier inner products and losses. The weights are
pruned and emitted by tasks reading W's files.

**The bound.** ``train.max_node_rows``: an integer, ``off`` (never distribute) or ``auto``
(default)::

    auto = floor(MEMORY_FRACTION * memory / (concurrent tasks * bytes per row))
    bytes per row = ROW_BYTES + BYTES_PER_NNZ * (mean non-zeros of a training row + 1)

with ``memory`` = ``spark.executor.memory`` (in local mode the machine's RAM: the Python workers
are processes of their own), concurrent tasks = ``spark.executor.cores`` / ``spark.task.cpus``
(local[N]: N), :data:`MEMORY_FRACTION` = 0.5, :data:`BYTES_PER_NNZ` = 80 (the grouped kernel
holds a node's rows about five times: Arrow input, sorted copy, CSR with the bias, float64/int64
local copy, solver state) and :data:`ROW_BYTES` = 1 KiB (sample id, weight, label list, the dual
variables of up to ~100 classifiers). The mean is one aggregation over the training rows, run
only when there are more rows than the bound for rows holding every feature (no row is heavier,
so nothing can be big below that). The synthetic sets (~20 non-zeros a row) get ~2.7 KiB a row: on this 24 GiB
machine with local[2] about 2.3M rows; rows of ~200 non-zeros (16 KiB) give ~380,000 rows.

**Where big nodes are streamed** (:func:`big_node_solver`: ``streamed``, or ``auto`` in local
mode with the scratch folder on local disk; a scratch folder at all) ``auto`` is at most
:data:`STREAMED_NODE_ROWS` (262,144 rows), so no Python worker holds more rows than that, however
many samples; the streamed nodes' rows are written by the tasks that read the samples, with no
shuffle. What that costs in time: README, thirteenth session. Every set up to 262,144 samples
(bibtex, delicious, the 200K and 250K synthetic sets) still trains grouped.

**Under a Python memory cap** (``spark.executor.pyspark.memory``) Spark limits each Python
worker's address space (``RLIMIT_AS``) to cap / ``spark.executor.cores`` (1 unless set, also in
local mode), and ``auto`` = floor(MEMORY_FRACTION * (that - :data:`WORKER_BYTES`) / bytes per
row), where :data:`WORKER_BYTES` = 768 MiB is what a worker maps before it holds a row (Python,
pyarrow, numpy, scipy, numba and the kernels: ~700 MiB measured), never above the uncapped
bound in local mode. A cap leaving less than a quarter of that for rows is refused by name, and
so is one under which a big-node solver's task cannot hold its widest big node's vectors
(:func:`check_solver_memory`). The session gives the workers Arrow's system allocator under a
cap (:func:`..session.capped_python_conf`): mimalloc, pyarrow's default, reserves a 1 GiB arena
of address space at its first allocation.
"""
from __future__ import annotations

import heapq
import logging
import os
import re
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp
from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import (
    binary_segments,
    binary_values,
    csr_from_table,
    csr_rows_to_arrays,
    grouped_apply,
    list_array,
    list_offsets_values,
    local_frame,
    to_arrow,
)
from ..compat import (
    conf_value,
    default_parallelism,
    never_broadcast,
    partition_keys,
    scratch_root,
    session_settings,
    share,
    shuffle_partitions,
    small_result,
    task_slots,
)
from ..kernels import tron
from ..kernels.sparse import append_bias, csr_from_lists
from ..kernels.tree import (
    Forest,
    TreeIndex,
    ancestor_at,
    decode_keys,
    encode_keys,
    find_keys,
    node_depth,
    tree_list,
)
from ..model import add_pairs, train_group
from ..params import ConfigError, TrainParams
from ..progress import worker_progress
from ..schemas import TABLES, WEIGHTS_SCHEMA, ddl
from ..storage import is_local_path
from .shared_vectors import SharedSpace, _parallel, query_tasks, solver_tasks
from .streamed_nodes import state_bytes, train_streamed

log = logging.getLogger("xmc_spark.train")
GROUPED_SCHEMA = ("group long, rows int, sample_id binary, weight binary, x_len binary, x_idx binary, "
                  "x_val binary, y_len binary, y_idx binary, pair_row binary, pair_group binary")
SPREAD = 2                      # training units get up to this many times the shuffle partitions
UNITS_PER_SLOT = 4              # training units (subtrees) per task slot at the cut depth
TOP_WEIGHT = 3.0                # a top node's time per row and classifier over a leaf's (merged_top)
PIECE_NNZ = 1 << 26             # most feature non-zeros in one packed record batch of the fan-out
BIG_SCHEMA = ("node int, feature_idx array<int>, feature_val array<float>, weight float, "
              "pos array<int>, pos_w array<float>")
PACK_SCHEMA = ("node int, rows int, x_ptr binary, x_idx binary, x_val binary, cost binary, "
               "p_ptr binary, p_idx binary, p_val binary")
PARTIAL_SCHEMA = "block int, part int, vals array<double>"
ROUTED_SCHEMA = ddl("negatives")
BLOCK = 1 << 16                 # doubles per reduced block (512 KiB)
PACK_ROWS = 1 << 15             # rows per packed block of one node
PENDING_BLOCKS = 16             # blocks of rows a packing task holds back for nodes still filling theirs
MEMORY_FRACTION = 0.5
WORKER_BYTES = 768 * 2**20      # address space a Python worker maps before any row (~700 MiB measured)
SOLVER_VECTORS = 16             # features x classifiers float64 arrays a solver task may hold for a node
STREAMED_VECTORS = 6            # ... a streamed task: the weights, their pruned copy, its COO and CSC forms
RANGE_FILL = 0.9                # big-node partitions hold this share of their rows' bound on average
PART_BOUNDS = 4                 # a big-node partition holds up to this many bounds of rows (streamed)
BYTES_PER_NNZ = 80
ROW_BYTES = 1024
STREAMED_NODE_ROWS = 1 << 18    # the auto bound's most where big nodes are streamed (module docstring)


def run(samples: DataFrame, index: TreeIndex, n_features: int, params: TrainParams,
        n_samples: Optional[int] = None, scratch: Optional[str] = None, label_counts=None,
        row_nnz: Optional[float] = None) -> DataFrame:
    """(is_leaf, key, w_idx, w_val): one row per classifier (key = node id, or slot id at leaves).

    A ``label_weight`` column (array<float> aligned with ``label_idx``, e.g. EAGLE's soft
    assignment) weights each positive; without it every positive weighs 1. ``n_samples`` (the
    number of rows of ``samples``, when the caller knows it) saves a count; nodes are only
    counted when it exceeds the bound. Big nodes are trained here (Spark jobs run before this
    returns); the small nodes' training runs when the result is computed. ``scratch``: a folder
    every task sees, for the solver's vectors above ``train.tron_driver_mb`` (:func:`scratch_root`).
    ``label_counts`` (rows per label, when known) sharpen the estimate of each training unit's
    work by which the units are spread over the tasks (:func:`unit_placement`); without them
    (e.g. PRIME's validation tree) every label counts one row, which places by label numbers alone.
    ``row_nnz`` (the mean non-zeros of a row of ``samples``, when known: ingest counts them)
    spares the ``auto`` bound its aggregation (:func:`node_row_bound`).
    """
    bindex = share(samples, index, name="the tree index")
    weighted = "label_weight" in samples.columns

    def expand(batches):
        for t, off, labels, rows, groups in _fan_out(bindex, batches):
            units = training_units(bindex.value, groups, cuts, top, big)
            for b in _pack_units(t, off, labels, rows, groups, units, weighted):
                part = unit_parts(b.column("group").to_numpy(), unit_ids, unit_keys)
                yield pa.RecordBatch.from_arrays([*b.columns, pa.array(part, pa.int32())], [*b.schema.names, "part"])

    def train(t: pa.Table) -> pa.Table:
        ix = bindex.value
        X, yoff, labels, weights, lw, prow, pgroup = _unpack_unit(t, n_features, weighted)
        X = append_bias(X, params.bias)
        out = []
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(pgroup)) + 1, [len(pgroup)]])
        for lo, hi in zip(bounds[:-1], bounds[1:]):            # each node of the unit, in turn
            r = prow[lo:hi]
            sub, at = _gather(yoff, r)
            is_leaf, children, W = train_group(ix, int(pgroup[lo]), X[r], sub, labels[at], params, weights[r],
                                               None if lw is None else lw[at])
            idx, val = csr_rows_to_arrays(W.T.tocsr())
            worker_progress("train", nodes=1, classifiers=len(children), node_samples=hi - lo)
            out.append(_weights_table(is_leaf, children, idx, val))
        return pa.concat_tables(out)

    if n_samples is None and params.node_row_bound() != 0:
        n_samples = samples.count()
    spark = samples.sparkSession
    streamed = streams_big_nodes(spark, params, scratch)
    bound = node_row_bound(spark, params, samples, n_samples, n_features, row_nnz, streamed)
    big, big_rows = big_nodes(samples, bindex, bound, n_samples,
                              sum(len(t.nodes) for t in tree_list(index)))
    par = default_parallelism(spark)
    cuts = unit_cuts(index, par)
    top = merged_top(index, cuts, big, task_slots(spark, par), label_counts, n_samples)
    unit_ids, unit_keys, n_parts = unit_placement(index, cuts, big, shuffle_partitions(spark), label_counts,
                                                  n_samples, top)
    grouped = samples.mapInArrow(expand, GROUPED_SCHEMA + (", y_w binary" if weighted else "") + ", part int")
    if not len(big):
        return _train_units(grouped, n_parts, train)
    small = grouped.where(~F.col("group").isin([int(g) for g in big]))
    parts = big_row_partitions(spark, int(big_rows.sum()), bound)
    big_weights = train_big_nodes(samples, index, bindex, big, big_rows, n_features, params, parts, scratch,
                                  bound, streamed)
    return _train_units(small, n_parts, train).unionByName(big_weights)


def _train_units(grouped: DataFrame, n_parts: int, train) -> DataFrame:
    """``train`` on each unit's records, the units placed by their ``part`` key
    (:func:`unit_placement`): one shuffle (the grouping by (part, group) reuses the hash
    partitioning on part), ``n_parts`` tasks, the heaviest first."""
    return grouped_apply(grouped.repartition(n_parts, "part"), ["part", "group"], train, WEIGHTS_SCHEMA)


def node_costs(index, label_counts=None, n_samples: Optional[int] = None):
    """(node ids, or ensemble keys; an estimate of each node's training work): its rows times
    its classifiers (children holding labels, or a leaf's slots). A node's rows are estimated as
    the sum of its labels' counts (``label_counts``; 1 each without them, or when they do not
    cover the tree's labels), at most ``n_samples`` and at least 1: exact at the root and for
    labels that share no row, an overestimate where they do. The estimate only places work on
    tasks; a wrong one costs balance, never a result."""
    trees = tree_list(index)
    top = max((int(ix.slot_label.max(initial=-1)) for ix in trees), default=-1)
    if label_counts is not None and len(label_counts) <= top:
        log.warning("%d label counts for a tree of label ids up to %d: training units placed by label "
                    "numbers alone", len(label_counts), top)
        label_counts = None
    ids, costs = [], []
    for t, ix in enumerate(trees):
        w = np.ones(len(ix.slot_label)) if label_counts is None else \
            np.asarray(label_counts, np.float64)[ix.slot_label]
        nodes, rows = ix.node_sums(w)
        if n_samples:
            rows = np.minimum(rows, float(n_samples))
        rows = np.maximum(rows, 1.0)            # a node of unseen labels still trains: not free
        kids = np.bincount(np.searchsorted(nodes, (nodes[nodes > 0] - 1) // ix.B),     # every parent is a node
                           minlength=len(nodes)).astype(np.float64)
        leaf = np.isin(nodes, ix.leaves)
        kids[leaf] = (ix.leaf_end - ix.leaf_start)[np.searchsorted(ix.leaves, nodes[leaf])]
        ids.append(encode_keys(t, nodes) if isinstance(index, Forest) else nodes)
        costs.append(rows * kids)
    return np.concatenate(ids), np.concatenate(costs)


def lpt_ranks(costs: np.ndarray, n_parts: int) -> np.ndarray:
    """Longest processing time first: each cost, largest first, goes to the least loaded of
    ``n_parts`` bins; returns each cost's bin, bins numbered by decreasing load. Spark starts a
    stage's tasks in partition order, so the heaviest partitions run first and the last wave
    holds the light ones (the critical path of a few units with most of the work)."""
    order = np.argsort(-np.asarray(costs, np.float64), kind="stable")
    heap = [(0.0, b) for b in range(n_parts)]
    load, where = np.zeros(n_parts), np.empty(len(order), np.int64)
    for i in order:
        lo, b = heapq.heappop(heap)
        where[i] = b
        load[b] = lo + float(costs[i])
        heapq.heappush(heap, (load[b], b))
    rank = np.empty(n_parts, np.int64)
    rank[np.argsort(-load, kind="stable")] = np.arange(n_parts)
    return rank[where]


def unit_placement(index, cuts, big: np.ndarray, n_parts: int, label_counts=None, n_samples: Optional[int] = None,
                   top: bool = False):
    """(training units sorted, the ``part`` key of each, the number of partitions): units spread by
    :func:`lpt_ranks` of their summed :func:`node_costs` over one partition per unit with work, up
    to :data:`SPREAD` x ``n_parts`` (none left empty by the count: fewer units than ``n_parts`` get
    fewer partitions, as an explicit repartition's empty tasks are not coalesced and each returns
    its metrics to the driver; a unit no sample reaches, counted a row by the estimate, still takes
    one, and with every unit big one partition stays), keyed by :func:`partition_keys` so that
    ``repartition(partitions, "part")`` puts each where it was placed. The estimate (rows x
    classifiers) underrates the top nodes' classifiers, which take ~3x the time per row and
    classifier of a leaf's on the 500K synthetic set: with 8 partitions for its 31 units a partition
    the estimate put last ran 22 s, from 71 s into a 93 s job. Finer partitions leave the estimate
    less to get wrong; each costs a task (~0.1-0.3 s measured), hence the cap. Big nodes (units of
    their own, at or above the cut or under other big nodes: trained across partitions, their
    records dropped before the grouping) weigh nothing and take no partition. ``top``: the nodes
    above the cut are one unit per tree (:func:`merged_top`), their costs weighted by
    :data:`TOP_WEIGHT` as there (that unit is the job's longest). O(nodes) on the driver."""
    nodes, cost = node_costs(index, label_counts, n_samples)
    is_big = np.isin(nodes, np.asarray(big, np.int64))
    cost = np.where(is_big, 0.0, cost)
    if top:
        cost = np.where(_above_cut(index, nodes, cuts), TOP_WEIGHT * cost, cost)
    units, inv = np.unique(training_units(index, nodes, cuts, top, big), return_inverse=True)
    unit_cost = np.bincount(inv, weights=cost, minlength=len(units))
    n_parts = max(1, min(np.setdiff1d(units, nodes[is_big]).size, SPREAD * n_parts))
    return units, partition_keys(n_parts)[lpt_ranks(unit_cost, n_parts)].astype(np.int32), n_parts


def unit_parts(units: np.ndarray, unit_ids: np.ndarray, unit_keys: np.ndarray) -> np.ndarray:
    """The ``part`` key of each unit id (:func:`unit_placement`)."""
    units = np.asarray(units, np.int64)
    if not len(units):
        return np.zeros(0, np.int32)
    at, found = find_keys(unit_ids, units)
    missing = ~found
    if missing.any():
        raise ValueError(f"training unit {int(units[missing][0])} is not a node of the tree")
    return unit_keys[at]


def _fan_out(bindex, batches):
    """Per Arrow batch of samples: (table, label offsets, labels, sample rows, group nodes), one
    (row, group) pair for every node whose classifiers see the sample: teacher-forced, plus the
    nodes of a ``man`` column (``train.negatives = tfn+man``: :func:`routed_nodes`)."""
    ix = bindex.value
    for b in batches:
        t = pa.Table.from_batches([b])
        off, labels = list_offsets_values(t, "label_idx")
        rows, groups = ix.groups_of_samples(off, labels)
        if "man" in t.column_names:
            moff, man = list_offsets_values(t, "man")
            rows, groups = add_pairs(rows, groups, (np.repeat(np.arange(t.num_rows), np.diff(moff)),
                                                    np.asarray(man, np.int64)))
        yield t, off, labels, rows, groups


def unit_depth(B: int, slots: int) -> int:
    """Depth from which a subtree is one training unit: the shallowest with at least
    :data:`UNITS_PER_SLOT` x ``slots`` nodes in a full B-ary tree."""
    c = 0
    while B ** c < UNITS_PER_SLOT * max(1, slots):
        c += 1
    return c


def unit_cuts(index, slots: int):
    """The cut depth of each tree (one for a single tree) for :func:`training_units`."""
    cuts = [unit_depth(ix.B, slots) for ix in tree_list(index)]
    return cuts if isinstance(index, Forest) else cuts[0]


def merged_top(index, cuts, big: np.ndarray, slots: int, label_counts=None, n_samples: Optional[int] = None) -> bool:
    """Whether the nodes above the cut depth train as one unit per tree (:func:`training_units`'
    ``top``): when no node is big and each tree's top nodes, their :func:`node_costs` weighted by
    :data:`TOP_WEIGHT`, take at most a task slot's share of all the work (``slots`` tasks at
    once), so that the unit is no longer than what LPT placement gives a slot anyway. Each sample
    then travels to its tree's top once, where it travelled to every top node it reaches (at 500K
    samples x 50K labels on 2 slots: 15 top nodes, ~5 of a sample's ~9 copies in the fan-out's
    shuffle). With many slots the top nodes stay units of their own, trained side by side."""
    if len(big) or slots < 1:
        return False
    nodes, cost = node_costs(index, label_counts, n_samples)
    above = _above_cut(index, nodes, cuts)
    if not above.any():
        return False
    top_cost = TOP_WEIGHT * cost[above]
    per_tree = np.bincount(_tree_of(index, nodes)[above], weights=top_cost)
    return float(per_tree.max()) <= float(cost[~above].sum() + top_cost.sum()) / slots


def _tree_of(index, groups: np.ndarray) -> np.ndarray:
    """The tree of each group (node id, or ensemble key): 0 for a single tree."""
    groups = np.asarray(groups, np.int64)
    return decode_keys(groups)[0] if isinstance(index, Forest) else np.zeros(len(groups), np.int64)


def _above_cut(index, groups: np.ndarray, cuts) -> np.ndarray:
    """Whether each group (node id, or ensemble key) lies above its tree's cut depth."""
    groups = np.asarray(groups, np.int64)
    if not isinstance(index, Forest):
        return node_depth(groups, index.B) < int(cuts)
    tree, ids = decode_keys(groups)
    out = np.zeros(len(groups), bool)
    for t, ix in enumerate(index.trees):
        m = tree == t
        out[m] = node_depth(ids[m], ix.B) < int(cuts[t])
    return out


def training_units(index, groups: np.ndarray, cuts, top: bool = False, big=()) -> np.ndarray:
    """The training unit of each group (node id, or ensemble key): the group itself above its
    tree's cut depth (``cuts``: one depth, or one per tree of a forest), or with ``top`` the
    tree's root (:func:`merged_top`: the nodes above the cut in one unit), else its ancestor at
    that depth, whose subtree's nodes are all trained in one task. Where that ancestor is one of
    the ``big`` nodes (ids, or ensemble keys: trained apart, :func:`train_big_nodes`), the unit is
    the shallowest node between it and the group that is not big (a big node is its own unit):
    the subtrees right under the big nodes, however deep those go, rather than a cut below the
    deepest of them for the whole tree (at 1M samples a big node at depth 7 cut the tree into 511
    units; under its 17 big nodes there are 28)."""
    def cut(ids, B, c, big_ids):
        depth = node_depth(ids, B)
        unit = ancestor_at(ids, depth, int(c), B)
        if len(big_ids):
            for target in range(int(c) + 1, int(depth.max(initial=0)) + 1):
                m = (depth >= target) & np.isin(unit, big_ids)
                if not m.any():
                    break
                unit[m] = ancestor_at(ids[m], depth[m], target, B)
            # a big node is its own unit, whatever its ancestors (its records are dropped by unit id)
            unit = np.where(np.isin(ids, big_ids), ids, unit)
        return np.where(depth < int(c), 0, unit) if top else unit

    groups = np.asarray(groups, np.int64)
    big = np.asarray(big, np.int64)
    if not isinstance(index, Forest):
        return cut(groups, index.B, cuts, big)
    tree, ids = decode_keys(groups)
    big_tree, big_ids = decode_keys(big) if len(big) else (big, big)
    out = np.empty_like(groups)
    for t, ix in enumerate(index.trees):
        m = tree == t
        if m.any():
            out[m] = encode_keys(t, cut(ids[m], ix.B, cuts[t], big_ids[big_tree == t]))
    return out


def _pack_units(t: pa.Table, off: np.ndarray, labels: np.ndarray, rows: np.ndarray, groups: np.ndarray,
                units: np.ndarray, weighted: bool):
    """The (row, group) pairs of one batch of samples as :data:`GROUPED_SCHEMA` record batches,
    one record per training unit (``units``: each pair's, :func:`training_units`): the unit's
    distinct rows (sample ids, weights, features and labels as flat arrays in binary columns:
    lengths per row, then the concatenated indices and values) and its pairs (row within the
    record, group). The shuffle to the trainer then moves each sample once per unit it reaches,
    not once per node (a subtree of depth k holds k or more of a sample's nodes), in a few large
    binary values, not as rows of lists that Spark converts element by element. Records of at
    most :data:`PIECE_NNZ` feature non-zeros per batch keep the binary offsets within 32 bits."""
    order = np.lexsort((groups, rows, units))
    u, r, g = units[order], rows[order], groups[order]
    new_unit = np.ones(len(u), bool)
    new_unit[1:] = u[1:] != u[:-1]
    new_row = new_unit.copy()
    new_row[1:] |= r[1:] != r[:-1]
    first = np.flatnonzero(new_row)                       # distinct (unit, row), in unit order
    urow = r[first]
    starts = np.concatenate([np.flatnonzero(new_unit[first]), [len(first)]])    # records, in distinct rows
    pstarts = np.concatenate([np.flatnonzero(new_unit), [len(u)]])             # records, in pairs
    local = np.cumsum(new_row) - 1                        # each pair's distinct row ...
    local = local - np.repeat(starts[:-1], np.diff(pstarts))                  # ... within its record
    foff, fidx = list_offsets_values(t, "feature_idx")
    fval = list_offsets_values(t, "feature_val")[1]
    xsub, xat = _gather(foff, urow)
    ysub, yat = _gather(off, urow)
    lw = list_offsets_values(t, "label_weight")[1][yat] if weighted else None
    sid = t.column("sample_id").to_numpy()[urow]
    weight = t.column("weight").to_numpy()[urow]
    lo = 0
    while lo < len(starts) - 1:          # batches of whole records under PIECE_NNZ (at least one)
        hi = max(lo + 1, int(np.searchsorted(xsub[starts], xsub[starts[lo]] + PIECE_NNZ, side="right")) - 1)
        hi = min(hi, len(starts) - 1)
        r0, r1, p0, p1 = starts[lo], starts[hi], pstarts[lo], pstarts[hi]
        rs, ps = starts[lo:hi + 1] - r0, pstarts[lo:hi + 1] - p0
        xs, ys = xsub[starts[lo:hi + 1]] - xsub[r0], ysub[starts[lo:hi + 1]] - ysub[r0]
        cols = {"group": pa.array(u[pstarts[lo:hi]], pa.int64()), "rows": pa.array(np.diff(rs), pa.int32()),
                "sample_id": binary_segments(sid[r0:r1], rs, np.int64),
                "weight": binary_segments(weight[r0:r1], rs, np.float32),
                "x_len": binary_segments(np.diff(xsub[r0:r1 + 1]), rs, np.int32),
                "x_idx": binary_segments(fidx[xat[xsub[r0]:xsub[r1]]], xs, np.int32),
                "x_val": binary_segments(fval[xat[xsub[r0]:xsub[r1]]], xs, np.float32),
                "y_len": binary_segments(np.diff(ysub[r0:r1 + 1]), rs, np.int32),
                "y_idx": binary_segments(labels[yat[ysub[r0]:ysub[r1]]], ys, np.int32),
                "pair_row": binary_segments(local[p0:p1], ps, np.int32),
                "pair_group": binary_segments(g[p0:p1], ps, np.int64)}
        if weighted:
            cols["y_w"] = binary_segments(lw[ysub[r0]:ysub[r1]], ys, np.float32)
        yield pa.RecordBatch.from_pydict(cols)
        lo = hi


def _unpack_unit(t: pa.Table, n_features: int, weighted: bool):
    """One unit's records of :func:`_pack_units` -> (X, label offsets, labels, weights, label
    weights or None, pair rows, pair groups): rows in sample-id order (so the result does not
    depend on the shuffle), pairs sorted by group then row."""
    def flat(name, dtype):
        return binary_values(t.column(name), dtype)

    sid = flat("sample_id", np.int64)
    order = np.argsort(sid, kind="mergesort")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    n_rec = t.column("rows").to_numpy()
    rec_rows = np.concatenate([[0], np.cumsum(n_rec)])[:-1]
    pcount = pc.binary_length(t.column("pair_row")).to_numpy() // 4
    prow = rank[flat("pair_row", np.int32) + np.repeat(rec_rows, pcount)]
    pgroup = flat("pair_group", np.int64)
    by = np.lexsort((prow, pgroup))
    xptr = np.concatenate([[0], np.cumsum(flat("x_len", np.int32), dtype=np.int64)])
    yptr = np.concatenate([[0], np.cumsum(flat("y_len", np.int32), dtype=np.int64)])
    xsub, xat = _gather(xptr, order)
    ysub, yat = _gather(yptr, order)
    X = csr_from_lists(xsub, flat("x_idx", np.int32)[xat], flat("x_val", np.float32)[xat], n_features)
    lw = flat("y_w", np.float32)[yat] if weighted else None
    return (X, ysub, flat("y_idx", np.int32)[yat], flat("weight", np.float32)[order].astype(np.float64), lw,
            prow[by], pgroup[by])


def routed_nodes(samples: DataFrame, model, beam_size: int) -> DataFrame:
    """(sample_id, man): the nodes (ensemble keys for an ensemble) whose group the trained
    matcher's beam of width ``beam_size`` sends each sample to, at every depth
    (:meth:`~xmc_spark.model.XMCModel.beam_nodes`); one pass over the samples with the model
    shared as for prediction (a sharded model: its layer-by-layer beam, :func:`.sharded.routed`).
    Joined to the samples, the trainer adds them as negatives."""
    from . import sharded
    from .prediction import map_with_model
    if isinstance(model, sharded.SHARDED):
        return sharded.routed(samples, model, beam_size).to(TABLES["negatives"])

    def route(m, t, X):
        rows, nodes = m.beam_nodes(X, beam_size)              # sorted by row
        off = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=t.num_rows))])
        return pa.RecordBatch.from_arrays([t.column("sample_id").combine_chunks(), list_array(off, nodes, pa.int64())],
                                          names=["sample_id", "man"])

    return map_with_model(samples, model, route, ROUTED_SCHEMA, kind="negatives")


def with_routed(samples: DataFrame, routed: DataFrame) -> DataFrame:
    """``samples`` with the ``man`` column of :func:`routed_nodes` (empty where a sample has none)."""
    return samples.join(never_broadcast(routed), "sample_id", "left").withColumn(
        "man", F.coalesce(F.col("man"), F.array().cast("array<long>")))


def _weights_table(is_leaf, keys, idx: pa.Array, val: pa.Array) -> pa.Table:
    """Weights rows: ``is_leaf`` one flag for all keys or one per key."""
    flags = np.broadcast_to(np.asarray(is_leaf, bool), (len(keys),))
    return pa.table({"is_leaf": pa.array(flags), "key": pa.array(np.asarray(keys, np.int64)),
                     "w_idx": idx, "w_val": val})


# ---- the bound -------------------------------------------------------------------------------

_UNITS = {"": 2**20, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30,
          "t": 2**40, "tb": 2**40, "p": 2**50, "pb": 2**50}


def memory_bytes(text: str) -> int:
    """Spark's memory strings ("6g", "512m", "2048" = MiB as for spark.*.memory) in bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a Spark memory size: {text!r} (e.g. 6g, 512m)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def physical_memory() -> str:
    """This machine's RAM as a Spark memory string: in local mode the Python workers are
    processes of their own, bounded by the machine, not by the driver's JVM heap."""
    try:
        return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 2 ** 20}m"
    except (ValueError, OSError, AttributeError):    # not POSIX: assume the driver's heap
        return "6g"


def row_bytes(mean_nnz: float) -> int:
    """Memory of one training row in the grouped kernel (module docstring)."""
    return int(ROW_BYTES + BYTES_PER_NNZ * (float(mean_nnz) + 1))


CONF_KEYS = ("spark.master", "spark.executor.cores", "spark.task.cpus", "spark.executor.memory",
             "spark.executor.pyspark.memory")


def session_conf(spark) -> dict:
    """The settings of :data:`CONF_KEYS` in this session (None where unset)."""
    return {k: conf_value(spark, k) for k in CONF_KEYS}


def _executor_cores(conf: dict) -> int:
    return max(1, int(conf.get("spark.executor.cores") or 1))


def auto_row_bound(spark, bytes_per_row: int) -> int:
    """``auto`` value of ``train.max_node_rows`` for this session and rows of ``bytes_per_row``."""
    return row_bound_for(session_conf(spark), bytes_per_row)


def row_bound_for(conf: dict, bytes_per_row: int, ram: Optional[str] = None) -> int:
    """``auto`` bound for Spark settings ``conf`` (:data:`CONF_KEYS`; missing = Spark's default)
    and a machine of ``ram`` (default: this one's; local mode only): a share of the memory the
    concurrent tasks' Python workers share, or, when ``spark.executor.pyspark.memory`` caps each
    worker's address space, of one worker's cap less what a worker maps before it holds a row."""
    master = str(conf.get("spark.master") or "")
    local = master.startswith("local")
    cores = _executor_cores(conf)
    if local:
        m = re.match(r"local\[(\*|\d+)", master)
        tasks = 1 if not m else (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
    else:
        tasks = cores // max(1, int(conf.get("spark.task.cpus") or 1))
    tasks, per_row = max(tasks, 1), max(1, int(bytes_per_row))
    ram = ram or physical_memory()
    cap = conf.get("spark.executor.pyspark.memory")
    if not cap:
        mem = ram if local else (conf.get("spark.executor.memory") or "1g")
        return max(1, int(MEMORY_FRACTION * memory_bytes(mem) / (tasks * per_row)))
    # Spark gives each Python worker cap / spark.executor.cores (1 unless set, also in local mode)
    # as its address-space limit (RLIMIT_AS), which counts what the worker maps before any row
    # (module docstring, "Under a Python memory cap").
    worker = memory_bytes(cap) // cores
    room = worker - WORKER_BYTES
    if room < WORKER_BYTES // 4:
        raise ConfigError(
            f"spark.executor.pyspark.memory={cap} gives each Python worker {worker / 2**20:.0f} MiB of address "
            f"space; a worker maps about {WORKER_BYTES / 2**20:.0f} MiB (Python, pyarrow, numpy, scipy, numba and "
            f"the kernels) before it holds any row, which leaves too little for training: set it to at least "
            f"{_mib_up((WORKER_BYTES + WORKER_BYTES // 4) * cores)}, or leave it unset")
    bound = MEMORY_FRACTION * room / per_row
    if local:                                   # the workers still share the machine
        bound = min(bound, MEMORY_FRACTION * memory_bytes(ram) / (tasks * per_row))
    return max(1, int(bound))


def check_solver_memory(conf: dict, d: int, node: int, classifiers: int, vectors: int = 0,
                        state_bytes: int = 0) -> None:
    """Refuse, by name, a memory cap under which one task of the big nodes' solver cannot hold
    the vectors it works on: ``vectors`` arrays (default :data:`SOLVER_VECTORS`, the distributed
    solver's: W, the CG direction, the accumulated gradient and Hessian product, their per-block
    copies; the streamed one holds :data:`STREAMED_VECTORS`) of d (features, + 1 with a bias) x
    ``classifiers`` doubles besides the worker's own :data:`WORKER_BYTES` (and ``state_bytes``: a
    streamed task's dual state, :func:`.streamed_nodes.state_bytes`). With the vectors in
    shared files, or streamed, a task holds one node's (``node``: the one with the most
    classifiers); on the driver path every task gets all big nodes' (``node`` -1). Without
    ``spark.executor.pyspark.memory`` nothing is checked: the workers then share the machine."""
    cap = conf.get("spark.executor.pyspark.memory")
    if not cap:
        return
    cores = _executor_cores(conf)
    worker = memory_bytes(cap) // cores
    need = WORKER_BYTES + (vectors or SOLVER_VECTORS) * 8 * int(d) * int(classifiers) + int(state_bytes)
    if need > worker:
        what = f"node {node}'s" if node >= 0 else "the big nodes'"
        raise ConfigError(
            f"spark.executor.pyspark.memory={cap} gives each Python worker {worker / 2**20:.0f} MiB of address "
            f"space, but a task of the big nodes' solver holding {what} vectors ({classifiers} classifiers x "
            f"{d:,} weights) needs about {need / 2**20:.0f} MiB: set it to at least {_mib_up(need * cores)}, "
            "or leave it unset")


def _mib_up(nbytes: int) -> str:
    """A Spark memory setting of at least ``nbytes`` (whole MiB: Spark refuses fractions)."""
    return f"{-(-int(nbytes) // 2**20)}m"


def node_row_bound(spark, params: TrainParams, samples: Optional[DataFrame] = None,
                   n_samples: Optional[int] = None, n_features: Optional[int] = None,
                   row_nnz: Optional[float] = None, streamed: bool = False) -> int:
    """Rows above which a node is trained across tasks; 0 = never. ``auto`` sizes a row from the
    mean non-zeros of ``samples`` (``row_nnz`` when the caller knows it, else one aggregation,
    :func:`mean_row_nnz`; neither when ``n_samples`` is within the bound for rows holding all
    ``n_features`` features: no row is heavier, so nothing can be big); without ``samples``, rows
    of 16 KiB (~200 non-zeros). ``streamed`` (big nodes would be streamed, :func:`big_node_solver`):
    ``auto`` is at most :data:`STREAMED_NODE_ROWS`."""
    b = params.node_row_bound()
    if b is not None:
        return b
    cap = STREAMED_NODE_ROWS if streamed else None
    if samples is None:
        return _capped(auto_row_bound(spark, 16 * 1024), cap)
    n = samples.count() if n_samples is None else int(n_samples)
    if n_features is not None:
        least = auto_row_bound(spark, row_bytes(n_features))
        if n <= _capped(least, cap):
            return _capped(least, cap)
        if cap is not None and least >= cap:            # no row makes it lower: the mean changes nothing
            log.info("train: auto node bound %d rows (at least %d by memory, at most %d with big nodes streamed)",
                     cap, least, cap)
            return cap
    mean = mean_row_nnz(samples) if row_nnz is None else float(row_nnz)
    memory = auto_row_bound(spark, row_bytes(mean))
    bound = _capped(memory, cap)
    log.info("train: auto node bound %d rows (%.1f features a row%s)", bound, mean,
             f"; {memory} by memory, at most {cap} with big nodes streamed" if bound < memory else "")
    return bound


def _capped(bound: int, cap: Optional[int]) -> int:
    return bound if cap is None else min(bound, cap)


def mean_row_nnz(samples: DataFrame) -> float:
    """The mean feature non-zeros of a row of ``samples``: one aggregation, a number to the driver
    (0 for no rows)."""
    return float(samples.select(F.avg(F.size("feature_idx"))).first()[0] or 0.0)


def big_nodes(samples: DataFrame, bindex, bound: int, n_samples: Optional[int] = None, n_nodes: int = 1):
    """(nodes with more than ``bound`` training rows (sorted), their rows). No node has more
    rows than there are samples (the root has them all), so nodes are counted only when the
    samples exceed the bound: one aggregation over the label lists, O(nodes) rows to the driver,
    collected from the tasks ``n_nodes`` (the tree's nodes, the most the counts can have) rows
    need (:func:`~..compat.small_result`)."""
    none = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    if bound <= 0:
        return none
    n = samples.count() if n_samples is None else int(n_samples)
    if n <= bound:
        return none

    def count(batches):
        for *_, groups in _fan_out(bindex, batches):
            g, c = np.unique(groups, return_counts=True)
            yield pa.RecordBatch.from_pydict({"group": pa.array(g, pa.int64()), "rows": pa.array(c, pa.int64())})

    routed = ["man"] if "man" in samples.columns else []     # tfn+man: the matcher's rows count too
    counts = to_arrow(small_result(samples.select("label_idx", *routed).mapInArrow(count, "group long, rows long")
                                   .groupBy("group").agg(F.sum("rows").alias("rows")), n_nodes))
    g, c = counts.column("group").to_numpy(), counts.column("rows").to_numpy()
    order = np.argsort(g)
    g, c = g[order], c[order]
    big = c > bound
    log.info("train: %d of %d nodes have more than %d rows (largest %d): trained across tasks",
             int(big.sum()), len(g), bound, int(c.max(initial=0)))
    return g[big], c[big]


# ---- big nodes: distributed TRON ---------------------------------------------------------------

def _gather(offsets: np.ndarray, rows: np.ndarray):
    """(offsets of the selected lists, positions of their elements) for list rows ``rows``."""
    cnt = np.diff(offsets)[rows]
    sub = np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64)
    pos = np.repeat(offsets[rows] - sub[:-1], cnt) + np.arange(sub[-1])
    return sub, pos


def _big_rows(samples: DataFrame, bindex, big: np.ndarray, node_ptr: np.ndarray) -> DataFrame:
    """The big nodes' rows: (node = index into ``big``, features, weight, positives as global
    classifier ids ``pos`` with their label weights ``pos_w``)."""
    return samples.mapInArrow(_tagger(bindex, big, node_ptr, "label_weight" in samples.columns), BIG_SCHEMA)


def _tagger(bindex, big: np.ndarray, node_ptr: np.ndarray, weighted: bool):
    """The function of :func:`_big_rows`: Arrow batches of samples -> :data:`BIG_SCHEMA` batches."""
    n_cls = int(node_ptr[-1])

    def tag(batches):
        ix = bindex.value
        for t, off, labels, rows, groups in _fan_out(bindex, batches):
            j, keep = find_keys(big, groups)
            rows, j = rows[keep], j[keep]
            if not len(rows):
                continue
            lw = list_offsets_values(t, "label_weight")[1] if weighted else None
            pr, pc, pv = [], [], []
            for k in np.unique(j):
                q = np.flatnonzero(j == k)
                sub, at = _gather(off, rows[q])
                _, Y = ix.node_problem(int(big[k]), sub, labels[at], None if lw is None else lw[at])
                Y = Y.tocoo()
                pr.append(q[Y.row])
                pc.append(node_ptr[k] + Y.col)
                pv.append(Y.data)
            P = sp.csr_matrix((np.concatenate(pv), (np.concatenate(pr), np.concatenate(pc))),
                              shape=(len(rows), n_cls))
            P.sort_indices()
            pos, pos_w = csr_rows_to_arrays(P)
            out = t.select(["feature_idx", "feature_val", "weight"]).take(pa.array(rows))
            yield from pa.table({"node": pa.array(j, pa.int32()), "feature_idx": out.column("feature_idx"),
                                 "feature_val": out.column("feature_val"), "weight": out.column("weight"),
                                 "pos": pos, "pos_w": pos_w}).to_batches()
    return tag


def big_row_partitions(spark, rows: int, bound: int) -> int:
    """Partitions of the big nodes' rows: as many as the tasks Spark runs at once (its default
    parallelism), more only where a partition would exceed :data:`PART_BOUNDS` x ``bound`` rows.
    A task's fixed cost is paid per query (on this 2-core machine ~0.1 s: scheduling, the Python
    worker's setup, reading the cached block; a trivial ``mapInArrow`` over 2 / 10 / 40 cached
    partitions took 0.55 / 1.0 / 2.65 s), so the queries merge the partitions into at most as
    many tasks as Spark runs at once (:func:`.shared_vectors.query_tasks`), and more partitions
    than that cost only the range shuffle's tasks, once. A partition may hold several bounds of
    rows because the queries stream it one packed block (at most ``bound`` rows) at a time
    (:class:`_solver_session`); the cap bounds the largest task's share of the rows (the range
    shuffle's) at about 3.6 bounds (0.45 n at the benchmark's n/8; at n/4 it would be 0.9 n). The rows
    are cut into equal ranges (:func:`row_partition`) by their hashes, so partitions hold about
    rows / partitions each, give or take the hashes' spread: the cap keeps :data:`RANGE_FILL` of
    it as headroom."""
    cap = max(1, int(RANGE_FILL * PART_BOUNDS * bound))
    return max(1, default_parallelism(spark), -(-int(rows) // cap))


def row_partition(node, h, rows: np.ndarray, parts: int):
    """The partition key (:func:`..compat.partition_keys`, for ``repartition(parts, key)``) of a big
    node's row: node ``node`` (index into ``rows``, the nodes' row counts) and row hash ``h`` as a
    row number, its node's first row plus ``h`` modulo the node's rows, cut into ``parts`` equal
    ranges of the rows of all nodes. So the nodes fill consecutive partitions of about
    rows / ``parts`` each, as a range partitioning by (node, hash) would, without the sampling job
    that one runs, and a row's partition depends on its content and the counts only (a retried
    task's rows go where they went)."""
    rows = np.maximum(np.asarray(rows, np.int64), 1)
    first = np.concatenate([[0], np.cumsum(rows)[:-1]])
    total, parts = int(rows.sum()), max(1, int(parts))

    def at(values, i):
        return F.element_at(F.array(*[F.lit(int(v)) for v in values]), i + 1)
    number = at(first, node).cast("long") + F.pmod(h, at(rows, node).cast("long"))
    part = F.floor(number * F.lit(parts) / F.lit(total)).cast("int")
    return at(partition_keys(parts), F.least(part, F.lit(parts - 1))).cast("int")


class _solver_session(session_settings):
    """Session settings for the distributed solver's queries, restored on exit (also after an
    error). Session settings, so they reach Spark Connect too; the stage's queries run one after
    another, so nothing else runs under them.

    - ``spark.sql.execution.arrow.maxRecordsPerBatch`` = 1: an Arrow batch to a Python worker
      holds one row, so a query's task receives one packed block (at most the bound's rows) at a
      time, not a whole partition of blocks;
    - ``spark.sql.adaptive.enabled`` = false: every shuffle of a query is partitioned explicitly
      (:func:`big_row_partitions`, reduce tasks up to :func:`.shared_vectors.solver_tasks`), so adaptive
      execution has nothing to re-plan and only adds a job and a planning round per stage
      (bibtex at n/4: 91 queries in 135-136 s with it, 109 s without).

    A setting the server refuses (a managed Connect server may allow only some keys) is skipped
    with a warning: both only change the solver's speed and its workers' batch sizes, not its
    result. If the cached rows are lost and recomputed under these settings, the packing reads
    one-row batches: correct, but slow."""
    SETTINGS = {"spark.sql.execution.arrow.maxRecordsPerBatch": "1", "spark.sql.adaptive.enabled": "false"}

    def __init__(self, spark):
        super().__init__(spark, self.SETTINGS, "the distributed solver")


def _bytes(a: np.ndarray, dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def _pack_rows(n_features: int, n_cls: int, bias: float, C: float, max_rows: int = PACK_ROWS,
               ordered: bool = False):
    """``mapInArrow`` function: :data:`BIG_SCHEMA` rows -> :data:`PACK_SCHEMA` blocks of one
    node's rows (at most ``max_rows``, in their input order): the rows as CSR arrays (bias column
    appended, cost = C x sample weight, positives as a CSR over the classifiers) in binary
    columns. A query then reads a few large binary values per task and views them as numpy
    arrays, instead of converting every row's lists from Spark's cache and rebuilding the
    matrices, and calls the kernel once per block, not per Arrow batch and node: what a query
    pays per row is the arithmetic of :func:`..kernels.tron.partial_fun_grad`.

    ``ordered`` (rows sorted by node, as the distributed solver's partitions): a node's rows are
    cut every ``max_rows`` and its last block is packed when the next node's rows begin, so the
    blocks come in runs of one node. Otherwise (the streamed write, rows in sample order) each
    node's rows wait until they fill a block; when all nodes' waiting rows exceed
    :data:`PENDING_BLOCKS` blocks, the node with the most waiting is packed as a shorter block, so
    a task holds at most that many blocks' rows (~200 bytes a row of ~20 non-zeros, packed)
    besides its input batch, however many nodes its rows reach; the rest are packed at the end, by
    node."""
    def block(parts):
        X = sp.vstack([p[0] for p in parts], format="csr")
        P = sp.vstack([p[1] for p in parts], format="csr")
        cost = np.concatenate([p[2] for p in parts])
        return pa.RecordBatch.from_pydict({
            "node": pa.array([int(parts[0][3])], pa.int32()), "rows": pa.array([X.shape[0]], pa.int32()),
            "x_ptr": [_bytes(X.indptr, np.int64)], "x_idx": [_bytes(X.indices, np.int32)],
            "x_val": [_bytes(X.data, np.float32)], "cost": [_bytes(cost, np.float64)],
            "p_ptr": [_bytes(P.indptr, np.int64)], "p_idx": [_bytes(P.indices, np.int32)],
            "p_val": [_bytes(P.data, np.float32)]}, schema=_PACK_ARROW)

    def pack(batches):
        pending, count = {}, {}                  # per node: waiting pieces, their rows
        for b in batches:
            t = pa.Table.from_batches([b])
            X = append_bias(csr_from_table(t, "feature_idx", "feature_val", n_features), bias)
            P = csr_from_table(t, "pos", "pos_w", n_cls)
            cost = C * t.column("weight").to_numpy().astype(np.float64)
            node = t.column("node").to_numpy()
            if not len(node):
                continue
            order = np.argsort(node, kind="stable")            # each node's rows, in input order
            bounds = np.concatenate([[0], np.flatnonzero(np.diff(node[order])) + 1, [len(node)]])
            for a, e in zip(bounds[:-1], bounds[1:]):
                g, r = int(node[order[a]]), order[a:e]
                if ordered:
                    for h in [h for h in pending if h != g]:       # the nodes before g: done
                        yield block(pending.pop(h))
                        del count[h]
                while len(r):
                    take = min(len(r), max_rows - count.get(g, 0))
                    q, r = r[:take], r[take:]
                    if q[-1] - q[0] + 1 == len(q):               # a run of rows (sorted input): a slice
                        q = slice(int(q[0]), int(q[-1]) + 1)
                    pending.setdefault(g, []).append((X[q], P[q], cost[q], g))
                    count[g] = count.get(g, 0) + take
                    if count[g] == max_rows:
                        yield block(pending.pop(g))
                        del count[g]
            while count and sum(count.values()) > PENDING_BLOCKS * max_rows:
                g = max(count, key=lambda h: (count[h], -h))
                yield block(pending.pop(g))
                del count[g]
        for g in sorted(pending):
            yield block(pending[g])
    return pack


_PACK_ARROW = pa.schema([("node", pa.int32()), ("rows", pa.int32())] + [
    (c, pa.binary()) for c in ("x_ptr", "x_idx", "x_val", "cost", "p_ptr", "p_idx", "p_val")])


def _unpack(b: pa.RecordBatch, d: int, n_cls: int):
    """The :class:`~..kernels.tron.RowBlock` of every row of a :data:`PACK_SCHEMA` batch (views
    of the Arrow buffers, no copy)."""
    def arr(name, r, dtype):
        v = b.column(name)[r]
        return np.frombuffer(v.as_buffer(), dtype) if v.is_valid else np.zeros(0, dtype)

    node, rows = b.column("node").to_numpy(), b.column("rows").to_numpy()
    for r in range(b.num_rows):
        n = int(rows[r])
        X = sp.csr_matrix((arr("x_val", r, np.float32), arr("x_idx", r, np.int32), arr("x_ptr", r, np.int64)),
                          shape=(n, d))
        P = sp.csr_matrix((arr("p_val", r, np.float32), arr("p_idx", r, np.int32), arr("p_ptr", r, np.int64)),
                          shape=(n, n_cls))
        yield tron.RowBlock(X, np.full(n, node[r], np.int64), arr("cost", r, np.float64), P)


class SparkOracle:
    """TRON's oracle over the persisted, packed big-node rows (:func:`_pack_rows`): each call is
    one Spark query whose tasks return their partial sums by blocks, summed per block
    by a grouped task; the driver collects the summed blocks only."""

    def __init__(self, packed: DataFrame, node_ptr: np.ndarray, n_features: int, params: TrainParams):
        self.rows, self.node_ptr = packed, np.asarray(node_ptr, np.int64)
        self.d = n_features + (1 if params.bias > 0 else 0)
        self.queries = 0
        self.par = solver_tasks(packed.sparkSession)   # once: on Spark Connect it may cost a job

    def fun_grad(self, W: np.ndarray, cols: np.ndarray, diag: bool = False):
        """(f, G) at W, and with ``diag`` the loss part of the Hessian's diagonal (d x m): one query."""
        none, no = np.zeros((self.d, 0)), np.zeros(0, np.int64)
        return self.mixed(W, np.asarray(cols, np.int64), diag, none, none, no)[0]

    def hess_vec(self, W: np.ndarray, V: np.ndarray, cols: np.ndarray):
        """H(W) V: one query."""
        return self.mixed(np.zeros((self.d, 0)), np.zeros(0, np.int64), False, W, V, np.asarray(cols, np.int64))[1]

    def mixed(self, Wf: np.ndarray, cf: np.ndarray, diag: bool, Wh: np.ndarray, Vh: np.ndarray, ch: np.ndarray):
        """:meth:`fun_grad` of classifiers ``cf`` and :meth:`hess_vec` of ``ch`` in one query:
        ((f, G[, L]), HV)."""
        m, n, d, node_ptr = len(cf), len(ch), self.d, self.node_ptr
        Wfp, Whp, Vhp = _pack(Wf), _pack(Wh), _pack(Vh)
        k = 2 if diag else 1

        def make():
            Wfl, Whl, Vhl = _unpack_matrix(Wfp), _unpack_matrix(Whp), _unpack_matrix(Vhp)

            def part(rows, acc):
                tron.partial_pass(rows, node_ptr, Wfl, cf, Whl, Vhl, ch, diag=diag, out_f=(acc[:m],) + tuple(
                    acc[m + i * d * m:m + (i + 1) * d * m].reshape(d, m) for i in range(k)),
                    out_h=acc[m + k * d * m:].reshape(d, n))
            return part

        flat = self._reduce(make, m + k * d * m + d * n, np.concatenate([cf, ch]))
        f, G = tron.regularized(flat[:m], flat[m:m + d * m].reshape(d, m), Wf)
        fg = (f, G, flat[m + d * m:m + 2 * d * m].reshape(d, m)) if diag else (f, G)
        return fg, Vh + flat[m + k * d * m:].reshape(d, n)

    def counts(self):
        """(rows per node, positives per classifier)."""
        n_nodes, n_cls = len(self.node_ptr) - 1, int(self.node_ptr[-1])

        def make():
            def part(rows, acc):
                acc[:n_nodes] += np.bincount(rows.node, minlength=n_nodes)
                acc[n_nodes:] += np.bincount(rows.pos.indices, minlength=n_cls)
            return part

        c = self._reduce(make, n_nodes + n_cls)
        return c[:n_nodes].astype(np.int64), c[n_nodes:].astype(np.int64)

    def _reduce(self, make_part, size: int, cols=None) -> np.ndarray:
        """Sum over the rows of what ``make_part()(RowBlock, acc)`` adds to ``acc`` (a flat array
        of ``size``): one query. ``make_part`` runs once per task (unpacking what the closure
        carries), its result once per packed block; only the nodes of classifiers ``cols``
        (default all) are read."""
        node_ptr, d = self.node_ptr, self.d
        n_cls = int(node_ptr[-1])

        def partial(batches):
            part = make_part()
            acc, n = np.zeros(size), 0
            for b in batches:
                for rb in _unpack(b, d, n_cls):
                    part(rb, acc)
                    n += rb.X.shape[0]
            worker_progress("train (distributed)", rows=n)
            yield from partial_blocks(acc)

        df = self.rows
        nodes = None if cols is None else np.unique(np.searchsorted(node_ptr, cols, side="right") - 1)
        if nodes is not None and len(nodes) < len(node_ptr) - 1:
            df = df.where(F.col("node").isin([int(j) for j in nodes]))
        self.queries += 1
        return summed_blocks(query_tasks(df, self.par).mapInArrow(partial, PARTIAL_SCHEMA), size, self.par)


def partial_blocks(acc: np.ndarray, block: int = BLOCK):
    """A task's partial sums ``acc`` as :data:`PARTIAL_SCHEMA` rows, one per block of ``block``
    doubles that is not all zero (none when ``acc`` is all zero)."""
    from pyspark import TaskContext
    blocks = [k for k in range(-(-len(acc) // block)) if np.any(acc[k * block:(k + 1) * block])]
    if not blocks:
        return
    segs = [acc[k * block:(k + 1) * block] for k in blocks]
    offs = np.concatenate([[0], np.cumsum([len(s) for s in segs])])
    tc = TaskContext.get()
    yield pa.RecordBatch.from_pydict({
        "block": pa.array(blocks, pa.int32()),
        "part": pa.array(np.full(len(blocks), tc.partitionId() if tc else 0), pa.int32()),
        "vals": list_array(offs, np.concatenate(segs), pa.float64())})


def summed_blocks(partials: DataFrame, size: int, par: int) -> np.ndarray:
    """The sum (a flat vector of ``size``) of the tasks' :func:`partial_blocks` rows: one reduce
    task per block up to ``par`` (each task's fixed cost is paid per query), whatever
    spark.sql.shuffle.partitions is (the groupBy reuses this hash partitioning: no second
    shuffle); the driver collects the summed blocks only."""
    summed = to_arrow(grouped_apply(partials.repartition(_parallel(par, -(-size // BLOCK)), "block"), ["block"],
                                    _sum_blocks, PARTIAL_SCHEMA))
    out = np.zeros(size)
    off, vals = list_offsets_values(summed, "vals")
    for r, k in enumerate(summed.column("block").to_numpy()):
        out[k * BLOCK:k * BLOCK + off[r + 1] - off[r]] = vals[off[r]:off[r + 1]]
    return out


def _sum_blocks(t: pa.Table) -> pa.Table:
    """One block's partial sums added in partition order (deterministic)."""
    t = t.take(pa.array(np.argsort(t.column("part").to_numpy(), kind="stable")))
    off, vals = list_offsets_values(t, "vals")
    total = vals.reshape(t.num_rows, -1).sum(axis=0)
    return pa.table({"block": pa.array([t.column("block")[0].as_py()], pa.int32()),
                     "part": pa.array([0], pa.int32()),
                     "vals": list_array(np.array([0, len(total)]), total, pa.float64())})


def _pack(M: np.ndarray):
    """A d x m matrix as (shape, non-zero rows, their values): what a task closure carries."""
    r = np.flatnonzero(np.any(M != 0, axis=1))
    return M.shape, r, np.ascontiguousarray(M[r])


def _unpack_matrix(p) -> np.ndarray:
    shape, r, v = p
    M = np.zeros(shape)
    M[r] = v
    return M


def big_node_solver(master: str, params: TrainParams, scratch: Optional[str] = None) -> str:
    """``train.big_node_solver`` resolved for Spark's ``master`` and the scratch folder the block
    files would go to (:func:`solver_for`)."""
    return solver_for(master, params.big_node_solver, scratch)


def solver_for(master: str, v: str, scratch: Optional[str] = None) -> str:
    """A big node's solver setting ``v`` (``train.big_node_solver``, ``tree.big_split_solver``)
    resolved for Spark's ``master`` and the scratch folder its block files would go to: ``auto``
    is ``streamed`` in local mode with the scratch folder on this machine's disk (the tasks share
    one machine, so spreading a node's rows over them saves no time, while every data pass of the
    distributed solver costs a Spark job: measured in README's 2026-12-05 entries), and
    ``distributed`` otherwise: on a cluster a streamed node's task spends the node's whole time
    alone, and a scratch folder on shared storage (``s3://``, ``dbfs:``, the ``/dbfs`` and
    ``/Volumes`` mounts of a single-node Databricks cluster) would be read whole at every pass."""
    if v != "auto":
        return v
    local_disk = scratch is not None and is_local_path(scratch) and not scratch.startswith(("/dbfs", "/Volumes"))
    return "streamed" if master.startswith("local") and local_disk else "distributed"


def streams(spark, v: str, scratch: Optional[str] = None):
    """(streamed, root): whether the solver setting ``v`` resolves to ``streamed`` for the session
    (:func:`solver_for`) and the folder every task sees (:func:`scratch_root`, None without one)."""
    root = scratch_root(spark, scratch)
    return solver_for(str(conf_value(spark, "spark.master", "") or ""), v, root) == "streamed", root


def streams_big_nodes(spark, params: TrainParams, scratch: Optional[str] = None) -> bool:
    """Whether big nodes are trained by the streamed solver: :func:`big_node_solver` says so and
    there is a folder every task sees for their rows (:func:`scratch_root`; without one, the
    distributed solver, with a warning when ``streamed`` was asked for)."""
    streamed, root = streams(spark, params.big_node_solver, scratch)
    if streamed and root is None:
        log.warning("train: no scratch folder the executors share was given for the streamed big nodes' rows: "
                    "they are trained by the distributed solver")
        return False
    return streamed


def train_big_nodes(samples: DataFrame, index: TreeIndex, bindex, big: np.ndarray, big_rows: np.ndarray,
                    n_features: int, params: TrainParams, parts: int, scratch: Optional[str] = None,
                    bound: int = PACK_ROWS, streamed: bool = False) -> DataFrame:
    """Weights rows of the nodes ``big`` trained by distributed TRON (all nodes in one loop),
    their rows (``big_rows`` each, as :func:`big_nodes` counts them) spread over ``parts``
    partitions (:func:`big_row_partitions`, :func:`row_partition`) in packed blocks of
    at most ``bound`` rows, read one block at a time (:class:`_solver_session`); or, with the
    streamed solver (``streamed``: :func:`streams_big_nodes`), written as block files and trained one task per
    node (:func:`.streamed_nodes.train_streamed`). The distributed solver's
    vectors (features x the nodes' classifiers, float64) stay on the driver up to
    ``train.tron_driver_mb``; above, in files under ``scratch`` (:mod:`.shared_vectors`)."""
    spark = samples.sparkSession
    kids = [index.node_problem(int(g), np.zeros(1, np.int64), np.zeros(0, np.int64))[0] for g in big]
    node_ptr = np.concatenate([[0], np.cumsum([len(k) for k in kids])]).astype(np.int64)
    d_vec, n_cls = n_features + (1 if params.bias > 0 else 0), int(node_ptr[-1])
    root = scratch_root(spark, scratch)
    wanted = d_vec * n_cls * 8 > params.tron_driver_mb * 2 ** 20        # vectors above the driver's share
    shared = wanted and root is not None                                 # ... and a folder every task sees
    widest = int(np.argmax(np.diff(node_ptr)))
    one = shared or streamed                                             # a task holds one node's vectors
    check_solver_memory(session_conf(spark), d_vec, int(big[widest]) if one else -1,
                        len(kids[widest]) if one else n_cls, STREAMED_VECTORS if streamed else SOLVER_VECTORS,
                        state_bytes(min(PACK_ROWS, int(bound)), len(kids[widest])) if streamed else 0)
    is_leaf = np.isin(big, index.leaves)
    block = max(1, min(PACK_ROWS, int(bound)))
    if streamed:
        # written by the tasks that read the samples, fanned out and packed in the same Python
        # worker: no shuffle of the rows, and no round trip of them through Spark's rows
        tag = _tagger(bindex, big, node_ptr, "label_weight" in samples.columns)
        pack = _pack_rows(n_features, n_cls, params.bias, params.C, block)
        return train_streamed(spark, samples, lambda batches: pack(tag(batches)),
                              lambda b: _unpack(b, d_vec, n_cls), big, kids, node_ptr, d_vec, is_leaf, params, root,
                              _weights_table, block)
    # partitioned by (node, row hash) ranges: a node's rows fill consecutive partitions of about
    # rows / parts each, so a partition holds one or a few nodes and a task reads only their vectors
    h = F.xxhash64("feature_idx", "feature_val", "pos", "pos_w", "weight")
    spread = _big_rows(samples, bindex, big, node_ptr).withColumn("_h", h)
    spread = spread.withColumn("_p", row_partition(F.col("node"), F.col("_h"), big_rows, parts)).repartition(
        parts, "_p").drop("_p")
    pack = _pack_rows(n_features, n_cls, params.bias, params.C, block, ordered=True)
    rows = (spread.drop("_h").sortWithinPartitions("node").mapInArrow(pack, PACK_SCHEMA)
            .persist(StorageLevel.MEMORY_AND_DISK))
    space = None
    try:
        rows.count()            # fills the cache (the packing reads Spark's usual Arrow batches)
        with _solver_session(spark):
            oracle = SparkOracle(rows, node_ptr, n_features, params)
            node_rows, positives = oracle.counts()
            d, K = d_vec, n_cls
            if wanted and root is None:
                log.warning("train: no scratch folder the executors share was given: the solver's vectors stay on "
                            "the driver (%.1f MB each)", d * K * 8 / 2 ** 20)
            log.info("train: %d big nodes, %d classifiers, %d rows over %d partitions: distributed TRON "
                     "(eps %g, at most %d steps), vectors of %.1f MB %s", len(big), K, node_rows.sum(), parts,
                     params.tron_eps, params.tron_max_iter, d * K * 8 / 2 ** 20,
                     "in shared files (only scalars to the driver)" if shared else "on the driver")
            eps = tron.liblinear_eps(params.tron_eps, positives, np.repeat(node_rows, np.diff(node_ptr)))
            if shared:
                space = SharedSpace(rows, lambda b: _unpack(b, d, K), node_ptr, d, root, oracle.par)
                info = tron.tron_space(space, d, K, eps=eps, max_iter=params.tron_max_iter, log=log.info,
                                       pcg=params.tron_pcg)
            else:
                W, info = tron.tron(oracle.fun_grad, oracle.hess_vec, d, K, eps=eps,
                                    max_iter=params.tron_max_iter, log=log.info, pcg=params.tron_pcg,
                                    mixed=oracle.mixed)
            log.info("train: distributed TRON done in %d queries (%d data passes); Newton steps per classifier "
                     "%d-%d, CG steps %d-%d, %d of %d met |g| <= eps_k |g0| (eps %g scaled per classifier)%s",
                     oracle.queries + (space.jobs if space else 0), info.passes, info.steps.min(), info.steps.max(),
                     info.cg_steps.min(), info.cg_steps.max(), int(info.converged.sum()), len(info.steps),
                     params.tron_eps, f"; {space.driver_bytes} bytes of scalars to the driver" if space else "")
            if space is not None:
                threshold = params.threshold

                def emit(g: int, Wg: np.ndarray) -> pa.Table:
                    idx, val = csr_rows_to_arrays(tron.prune(Wg, threshold).T.tocsr())
                    return _weights_table(np.full(len(kids[g]), is_leaf[g]), kids[g], idx, val)
                return space.weights(emit, WEIGHTS_SCHEMA)
    finally:
        rows.unpersist()
        if space is not None:
            space.close()
    idx, val = csr_rows_to_arrays(tron.prune(W, params.threshold).T.tocsr())
    table = _weights_table(np.repeat(is_leaf, np.diff(node_ptr)), np.concatenate(kids), idx, val)
    return local_frame(spark, table, WEIGHTS_SCHEMA)
