"""A model too big to broadcast: its weights stay in a DataFrame, prediction runs level by level.

When the ``weights`` table exceeds ``predict.max_broadcast_mb``, the pipeline never collects it:
a :class:`ShardedModel` holds the tree (O(labels), on the driver) and the weights as a
DataFrame ``(is_leaf, key, w_idx, w_val)``.

Beam search (:func:`predict`, :func:`matcher`) first takes the top layers whose weights fit
the broadcast bound together (:func:`top_layers`) in one pass over the rows, those layers' weights
shared with the tasks (:func:`_top_beam`, the broadcast kernel; written to files under a scratch
folder by the tasks that hold them, so that none pass through the driver), then runs one tree
layer per step,
with the arithmetic of :func:`~xmc_spark.kernels.beam_search.beam_search`:

1. each (sample, beam node) row is grouped with the weights of that node's children — a
   cogroup keyed by the parent's position in the layer (and a salt: a parent reached by many
   rows, like the root, is split over ``ceil(rows / group_rows)`` tasks, each getting its own
   copy of that node's few classifiers), so a task holds some rows plus one node's children;
2. the task scores the children (:func:`~xmc_spark.kernels.beam_search.score_children`);
3. the candidates are merged per sample (top ``beam_size`` by score, ties by position; at the
   label layer, a label reached through several leaves gets the mean of its scores, then the
   top ``topk``), checkpointed on the executors in the partitions of the rows' features
   (:func:`merge_partitions`), and joined back to those features, where they are, for the next
   layer.

The answer equals the broadcast beam search (same candidates, same products of the same
factors; only the summation order of a dot product differs). It costs three shuffles per
layer (the rows, their nodes' weights, the merge; four where the merge takes more partitions
than the features'), so the pipeline takes it only above the bound. ``search = tree |
adaptive`` is a broadcast-path option; the sharded path is always ``layered``.

The saved model of a sharded model is chunked (:func:`save`, format version 2): the driver
writes ``param.json`` and ``tree.npz`` (O(labels)); Spark tasks write ``weights/part-*.npz``,
one per range of keys, each at most about :data:`PART_BYTES`. The folder must be on storage
the driver and the executors share (local mode, a Databricks ``/Volumes`` or ``/dbfs`` path).
:meth:`XMCModel.load` reads both layouts whole; :func:`load` gives a :class:`ShardedModel`
whose weights DataFrame the tasks read part by part.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import pandas as pd
import pyarrow as pa
import scipy.sparse as sp
from py4j.protocol import Py4JJavaError
from pyarrow.fs import FileType
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import (
    cogrouped_apply,
    csr_from_table,
    csr_rows_to_arrays,
    list_offsets_values,
    local_frame,
    to_arrow,
)
from ..compat import (
    CONNECT_MAX_MB,
    default_parallelism,
    is_connect,
    kept_checkpoint,
    never_broadcast,
    partitioned_checkpoint,
    scratch_root,
    share,
    shuffle_partitions_set,
    sized_partitions,
)
from ..kernels.beam_search import beam_layers, score_children
from ..kernels.sparse import append_bias
from ..kernels.tree import TREE_SHIFT, Forest, TreeIndex, encode_keys, find_keys
from ..model import (
    CHUNKED_VERSION,
    ENSEMBLE_VERSION,
    ModelFormatError,
    atomic_folder,
    load_part,
    read_header,
    save_part,
    tree_layers,
    write_ensemble_header,
    write_header,
)
from ..params import PredictParams
from ..progress import worker_progress
from ..schemas import TABLES, WEIGHTS_SCHEMA
from ..storage import StorageError, client_fs, write_whole

log = logging.getLogger("xmc_spark.predict")

GROUP_ROWS = 20000               # rows of one (parent, salt) group: bounds a task's share of a layer
SEARCH_TASK_ROWS = 1 << 16       # rows (sample x candidate) a task of the search's own shuffles reads
# candidate rows (sample, position, score) a task of a layer's merge reads at most: two for each
# row a task of the search's own shuffles reads, so that a binary layer's merge fits the features'
# partitions
MERGE_TASK_ROWS = 2 * SEARCH_TASK_ROWS
PART_BYTES = 64 << 20            # a saved part file holds about this many bytes of weights
BYTES_PER_NNZ = 8                # int32 index + float32 value


@dataclass
class ShardedModel:
    """Tree + params on the driver, weights in a DataFrame ``(is_leaf, key, w_idx, w_val)``."""

    index: TreeIndex
    weights: DataFrame
    n_features: int
    bias: float = 1.0
    normalize: bool = True
    pred_params: PredictParams = field(default_factory=PredictParams)
    meta: dict = field(default_factory=dict)
    label_counts: Optional[np.ndarray] = None
    nbytes: int = 0
    scratch: Optional[str] = None      # a folder every task sees, for the search's shared files (compat.scratch_root)
    # caches of the weights above, built on first use; not init fields, so that
    # ``dataclasses.replace(model, weights=...)`` starts without them
    layer_bytes: Optional[np.ndarray] = field(default=None, repr=False, init=False)   # per layer
    placed: Optional[DataFrame] = field(default=None, repr=False, init=False)         # :func:`_placed`

    @property
    def n_labels(self) -> int:
        return self.index.n_labels

    def label_depth(self) -> np.ndarray:
        return self.index.label_depth()

    def save(self, folder: str) -> None:
        save(self, folder)


@dataclass
class ShardedEnsemble:
    """An ensemble (``tree.ensemble``) too big to broadcast: one :class:`ShardedModel` per tree,
    each over its tree's rows of the weights (keys back to the tree's own ids). Prediction runs
    every tree's layered beam and combines the labels they reach as :class:`~..model.EnsembleModel`
    does (the mean over the trees, a tree that does not reach a label adding 0)."""

    members: list
    meta: dict = field(default_factory=dict)
    label_counts: Optional[np.ndarray] = None

    @property
    def n_features(self) -> int:
        return self.members[0].n_features

    @property
    def n_labels(self) -> int:
        return self.members[0].n_labels

    @property
    def bias(self) -> float:
        return self.members[0].bias

    @property
    def normalize(self) -> bool:
        return self.members[0].normalize

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)

    @property
    def pred_params(self) -> PredictParams:
        return self.members[0].pred_params

    @pred_params.setter
    def pred_params(self, value: PredictParams) -> None:
        for m in self.members:
            m.pred_params = value

    @property
    def index(self) -> Forest:
        return Forest([m.index for m in self.members])

    def label_depth(self) -> np.ndarray:
        return self.index.label_depth()

    def save(self, folder: str) -> None:
        save(self, folder)


SHARDED = (ShardedModel, ShardedEnsemble)      # the model types whose weights stay on the executors


def tree_weights(weights: DataFrame, t: int) -> DataFrame:
    """Tree t's rows of an ensemble's weights (keys ``t << TREE_SHIFT | id``), keyed by the id."""
    return (weights.where(F.shiftright("key", TREE_SHIFT) == t)
            .withColumn("key", F.col("key").bitwiseAND(F.lit((1 << TREE_SHIFT) - 1))))


def sharded_model(index, weights: DataFrame, n_features: int, bias: float, normalize: bool,
                  pred_params: PredictParams, tree_bytes: Dict[int, int], scratch: Optional[str] = None):
    """A :class:`ShardedModel` of a tree, or a :class:`ShardedEnsemble` of a forest (its
    weights split by tree with no job: each member filters the same DataFrame); ``tree_bytes``:
    :func:`tree_nbytes` of ``weights``; ``scratch``: see :attr:`ShardedModel.scratch`."""
    if not isinstance(index, Forest):
        return ShardedModel(index, weights, n_features, bias, normalize, pred_params, nbytes=sum(tree_bytes.values()),
                            scratch=scratch)
    return ShardedEnsemble([ShardedModel(ix, tree_weights(weights, t), n_features, bias, normalize, pred_params,
                                         nbytes=tree_bytes.get(t, 0), scratch=scratch)
                            for t, ix in enumerate(index.trees)])


def use_scratch(model, scratch: str) -> None:
    """Give a sharded model (every member of a sharded ensemble) without a scratch folder this one
    (:attr:`ShardedModel.scratch`: a loaded model predicting into a run folder); other models
    are left as they are."""
    if isinstance(model, (ShardedModel, ShardedEnsemble)):
        for _, m in members(model):
            m.scratch = m.scratch or scratch


def members(model) -> list:
    """(tree, ShardedModel) of a sharded model or ensemble."""
    return list(enumerate(model.members)) if isinstance(model, ShardedEnsemble) else [(0, model)]


def _keyed(model, t: int, ids) -> np.ndarray:
    """Node or leaf ids of tree t as the model's keys: ensemble keys of an ensemble, else the ids."""
    return encode_keys(t, ids) if isinstance(model, ShardedEnsemble) else np.asarray(ids, np.int64)


def search_bounds(spark) -> Tuple[int, Optional[int]]:
    """(least, most) partitions of the search's own shuffles: the default parallelism and
    ``spark.sql.shuffle.partitions`` (no most when the platform sets it to ``auto``); read once
    a search (on Spark Connect each read is a call to the server)."""
    return max(1, int(default_parallelism(spark))), shuffle_partitions_set(spark)


def search_partitions(spark, rows: float, bounds: Optional[Tuple[int, Optional[int]]] = None) -> int:
    """Partitions of one of the sharded search's own shuffles (a layer's cogroup; the rows'
    features, checkpointed) that carries about ``rows`` rows: ``SEARCH_TASK_ROWS`` a task, between the
    default parallelism and ``spark.sql.shuffle.partitions`` (:func:`search_bounds`,
    :func:`~..compat.sized_partitions`): each task of a layer also starts a Python worker pass."""
    return sized_partitions(spark, rows, SEARCH_TASK_ROWS, bounds if bounds is not None else search_bounds(spark))


def merge_partitions(spark, rows: float, feats_parts: int, bounds: Optional[Tuple[int, Optional[int]]] = None) -> int:
    """Partitions of a layer's merge of its candidates by sample (``rows`` rows of a sample, a
    candidate and its score: a few dozen bytes each, against a scored row's features): the
    ``feats_parts`` partitions the rows' features were checkpointed in, so that the merged beam
    already sits where the next layer's rejoin needs it (no shuffle of it) and the predictions
    take that many tasks (each task returns its metrics to the driver, 8-12 KB), unless that
    leaves more than :data:`MERGE_TASK_ROWS` rows a task: then that many a task, up to
    ``spark.sql.shuffle.partitions`` as every sized shuffle (:func:`~..compat.sized_partitions`;
    the rows are an estimate from the layer's mean fan-out)."""
    bounds = bounds if bounds is not None else search_bounds(spark)
    return max(int(feats_parts), sized_partitions(spark, rows, MERGE_TASK_ROWS, bounds))


def _mean_fan(child_ptr: np.ndarray) -> float:
    """Children a parent of a layer has on average (at least 1): a layer's candidates per row
    reaching it."""
    return max(1.0, float(child_ptr[-1]) / max(len(child_ptr) - 1, 1))


def _row_count(samples: DataFrame):
    """max(1, rows of ``samples``), counted once, on first use (every tree's beam salts by it)."""
    return functools.cache(lambda: max(samples.count(), 1))


def tree_nbytes(weights: DataFrame) -> Dict[int, int]:
    """Size of a weights table's classifiers per tree (keys ``tree << TREE_SHIFT | id``; one tree:
    tree 0), 8 bytes a non-zero: one aggregate, O(trees) rows to the driver, its last step one
    task whatever ``spark.sql.shuffle.partitions`` is (each task returns its metrics to the driver)."""
    rows = weights.groupBy(F.shiftright("key", TREE_SHIFT).alias("t")).agg(F.sum(F.size("w_idx")).alias("nnz"))
    return {int(r["t"]): int(r["nnz"] or 0) * BYTES_PER_NNZ for r in rows.coalesce(1).collect()}


def broadcast_bound(spark_or_df, pred: PredictParams) -> float:
    """Bytes of weights that may be shared whole with the tasks: ``predict.max_broadcast_mb``,
    on Spark Connect at most what a query plan can carry. A model above it stays sharded, and at
    most this much of it (its top layers) is broadcast."""
    # on Connect the model travels pickled in the plan: its weights once (the search layers are
    # rebuilt in the tasks, XMCModel.__getstate__) and the tree; half the plan's limit leaves room
    mb = min(pred.max_broadcast_mb, CONNECT_MAX_MB / 2) if is_connect(spark_or_df) else pred.max_broadcast_mb
    return mb * 2 ** 20


def weights_nbytes(weights: DataFrame) -> int:
    """Size of a weights table's classifiers (8 bytes a non-zero)."""
    return sum(tree_nbytes(weights).values())


def _place_table(index: TreeIndex):
    """The tree's (is_leaf, key) -> (layer, ppos, pos) table as arrays, O(nodes + slots): the
    internal nodes' keys sorted with their layer, parent position and own position, then each
    slot's (the slot is the key) position and parent position, and the slots' layer."""
    shape = tree_layers(index)
    ids, layer, pos, parent = [], [], [], []
    for t, (keys, child_ptr, _) in enumerate(shape.layers[:-1]):
        ids.append(keys)
        layer.append(np.full(len(keys), t, np.int32))
        pos.append(np.arange(len(keys)))
        parent.append(np.repeat(np.arange(len(child_ptr) - 1), np.diff(child_ptr)))
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    order = np.argsort(ids, kind="mergesort")
    node = (ids[order], np.concatenate(layer)[order] if layer else np.zeros(0, np.int32),
            np.concatenate(pos)[order] if pos else np.zeros(0, np.int64),
            np.concatenate(parent)[order] if parent else np.zeros(0, np.int64))
    slots, slot_ptr, _ = shape.layers[-1]
    slot_pos = np.empty(len(slots), np.int64)
    slot_pos[slots] = np.arange(len(slots))
    slot_parent = np.repeat(np.arange(len(slot_ptr) - 1), np.diff(slot_ptr))
    return node, (slot_pos, slot_parent[slot_pos]), len(shape.layers) - 1


def place_of(table, is_leaf: np.ndarray, key: np.ndarray):
    """(layer, ppos, pos) of each weight row (:func:`_place_table`'s ``table``); a key the tree
    does not have gets layer -1."""
    (nid, nlayer, npos, nparent), (slot_pos, slot_ppos), slot_layer = table
    is_leaf, key = np.asarray(is_leaf, bool), np.asarray(key, np.int64)
    layer, ppos, pos = np.full(len(key), -1, np.int32), np.zeros(len(key), np.int64), np.zeros(len(key), np.int64)
    if len(nid):
        at, hit = find_keys(nid, key)
        inner = ~is_leaf & hit
        layer[inner], ppos[inner], pos[inner] = nlayer[at[inner]], nparent[at[inner]], npos[at[inner]]
    slot = is_leaf & (key >= 0) & (key < len(slot_pos))
    layer[slot], ppos[slot], pos[slot] = slot_layer, slot_ppos[key[slot]], slot_pos[key[slot]]
    return layer, ppos, pos


def _placed(weights: DataFrame, index: TreeIndex):
    """(placed, share): the weights rows with their layer, parent position (the cogroup key) and
    own position, looked up from the tree's (is_leaf, key) -> place table, O(nodes + slots),
    shared with the tasks (:func:`~..compat.share`) by a vectorized UDF that sees only the two key
    columns (the weights' arrays never pass through Python); the share, to release once the rows
    are computed (None on Spark Connect). A join with the table broadcast would send it to the
    tasks and back (Spark's broadcast collects its side through the driver: 0.25 MB at 20K
    labels, 1.26 MB at 100K); it stays for Spark Connect, where a shared table would travel
    inside the plan. A key the tree does not have gets a null layer (see :func:`layer_nbytes`,
    which rejects it)."""
    table = _place_table(index)
    if is_connect(weights):
        return _placed_by_join(weights, table), None
    shared = share(weights, table, name="the tree's placement")

    @F.pandas_udf("layer int, ppos long, pos long")
    def place(is_leaf: pd.Series, key: pd.Series) -> pd.DataFrame:
        known = (is_leaf.notna() & key.notna()).to_numpy()       # a null is no key of the tree
        layer, ppos, pos = place_of(shared.value, is_leaf.fillna(False).to_numpy(bool),
                                    key.fillna(-1).to_numpy(np.int64))
        layer[~known] = -1
        return pd.DataFrame({"layer": layer, "ppos": ppos, "pos": pos})

    known = F.col("p.layer") >= 0
    return weights.select("key", place("is_leaf", "key").alias("p"), "w_idx", "w_val").select(
        "key", *[F.when(known, F.col("p." + c)).alias(c) for c in ("layer", "ppos", "pos")], "w_idx",
        "w_val"), shared


def _placed_by_join(weights: DataFrame, table) -> DataFrame:
    """:func:`_placed` by a join with the place table broadcast (Spark Connect)."""
    (nid, nlayer, npos, nparent), (slot_pos, slot_ppos), slot_layer = table
    place = pd.DataFrame({
        "is_leaf": np.concatenate([np.zeros(len(nid), bool), np.ones(len(slot_pos), bool)]),
        "key": np.concatenate([nid, np.arange(len(slot_pos))]).astype(np.int64),
        "layer": np.concatenate([nlayer, np.full(len(slot_pos), slot_layer)]).astype(np.int32),
        "ppos": np.concatenate([nparent, slot_ppos]).astype(np.int64),
        "pos": np.concatenate([npos, slot_pos]).astype(np.int64)})
    place = weights.sparkSession.createDataFrame(place, "is_leaf boolean, key long, layer int, ppos long, pos long")
    return weights.join(F.broadcast(place), ["is_leaf", "key"], "left").select(
        "key", "layer", "ppos", "pos", "w_idx", "w_val")


def _placed_of(model: ShardedModel) -> DataFrame:
    """:func:`_placed` of the model's weights, computed once and kept on the executors (memory
    and disk, ``localCheckpoint``): every layer of a search, and every search of the model, reads
    its layer from there instead of scanning the whole weights table again."""
    if model.placed is None:
        placed, shared = _placed(model.weights, model.index)
        try:
            model.placed = placed.localCheckpoint()
        finally:
            if shared is not None:
                shared.unpersist()
    return model.placed


def layer_nbytes(model: ShardedModel) -> np.ndarray:
    """Bytes of each layer's classifiers (8 a non-zero): one aggregate ending in one task (as
    :func:`tree_nbytes`), O(layers) rows to the driver, kept on the model; a weight key the tree
    does not have stops here."""
    if model.layer_bytes is None:
        out = np.zeros(len(tree_layers(model.index).layers), np.int64)
        for r in (_placed_of(model).groupBy("layer")
                  .agg(F.sum(F.size("w_idx")).alias("nnz"), F.min("key").alias("key")).coalesce(1).collect()):
            if r["layer"] is None:
                raise ModelFormatError(f"the weights hold key {int(r['key'])}, which is not in the tree")
            out[int(r["layer"])] = int(r["nnz"] or 0) * BYTES_PER_NNZ
        model.layer_bytes = out
    return model.layer_bytes


def top_layers(model: ShardedModel, n_layers: int, budget: float) -> int:
    """How many of the first ``n_layers`` layers fit ``budget`` bytes together (the top of the
    tree, broadcast and searched in one pass over the rows)."""
    if budget <= 0 or n_layers <= 0:
        return 0
    return int(np.searchsorted(np.cumsum(layer_nbytes(model)[:n_layers]), budget, side="right"))


def _top_columns(rows: pa.Table, layers: list, n_cols: int) -> list:
    """The broadcast kernel's layers (child_ptr, d x keys weights, through) of the top layers'
    weights rows (layer, pos, w_idx, w_val); ``layers``: :func:`~..model.tree_layers`' first ones."""
    layer = rows.column("layer").to_numpy()
    out = []
    for t, (keys, child_ptr, through) in enumerate(layers):
        part = rows.filter(pa.array(layer == t))
        off, idx = list_offsets_values(part, "w_idx")
        _, val = list_offsets_values(part, "w_val")
        out.append((child_ptr, _columns(off, idx, val, part.column("pos").to_numpy(), len(keys), n_cols), through))
    return out


TOP_ROWS = pa.schema([("layer", pa.int32()), ("pos", pa.int64()), ("w_idx", pa.list_(pa.int32())),
                      ("w_val", pa.list_(pa.float32()))])
# a Python worker's top layers, of the last search it served: dropped when the next layer's cogroup
# runs in that worker (:func:`_scorer`) or the next search replaces them; a matcher whose inner
# layers all fit the bound keeps them there until then (at most the broadcast bound)
_TOP_CACHE: Dict[str, list] = {}
_UNREADABLE = "the search's top layers cannot be read"


class _TopFiles:
    """The top layers' weights in Arrow files that the tasks holding them wrote under a scratch
    folder every task sees (one per input partition with rows, ``part-<partition>.arrow``);
    ``.value``, as a broadcast's, gives the broadcast kernel's layers, read once per Python worker
    and checked against what the writing tasks reported (:meth:`expect`)."""

    def __init__(self, folder: str, layers: list, n_cols: int):
        self.folder, self.layers, self.n_cols = folder, layers, n_cols
        self.parts: Dict[int, int] = {}          # partition -> rows its file holds

    def write(self, batches):
        """A task's share of the rows as one file, named by its partition (a retried attempt
        writes the same file; on a local file system through a renamed temporary file, on an
        object store as one object, so that a reader never sees half of it)."""
        from pyspark import TaskContext
        batches = [b for b in batches if b.num_rows]
        t = pa.Table.from_batches(batches).cast(TOP_ROWS) if batches else TOP_ROWS.empty_table()
        part = TaskContext.get().partitionId()
        if t.num_rows:
            fs, root = client_fs(self.folder)
            fs.create_dir(root, recursive=True)

            def arrow_file(f):
                with pa.ipc.new_file(f, TOP_ROWS) as w:
                    w.write_table(t)
            write_whole(fs, self._path(root, part), arrow_file)
        yield pa.RecordBatch.from_pydict({"part": pa.array([part], pa.int32()),
                                          "n": pa.array([t.num_rows], pa.int64())})

    def expect(self, reports) -> None:
        """The writing job's (part, n) rows: the files :attr:`value` must find, with those rows."""
        self.parts = {int(r["part"]): int(r["n"]) for r in reports if r["n"]}

    @staticmethod
    def _path(root: str, part: int) -> str:
        return f"{root}/part-{part:05d}.arrow"

    @property
    def value(self) -> list:
        if self.folder not in _TOP_CACHE:
            fs, root = client_fs(self.folder)
            tables = []
            for part, n in sorted(self.parts.items()):
                path = self._path(root, part)
                try:
                    with fs.open_input_file(path) as f:
                        t = pa.ipc.open_file(f).read_all()
                except (OSError, pa.ArrowInvalid) as e:
                    raise StorageError(f"{path}: {_UNREADABLE} here ({e}): the scratch "
                                       "folder must be one the driver and every executor share") from None
                if t.num_rows != n:
                    raise StorageError(f"{path}: {_UNREADABLE}: {t.num_rows} rows where its task wrote {n}: the "
                                       "scratch folder must be one the driver and every executor share")
                tables.append(t)
            rows = pa.concat_tables(tables) if tables else TOP_ROWS.empty_table()
            _TOP_CACHE.clear()                 # one search's layers at a time
            _TOP_CACHE[self.folder] = _top_columns(rows, self.layers, self.n_cols)
        return _TOP_CACHE[self.folder]

    def remove(self) -> None:
        try:
            fs, root = client_fs(self.folder)
            if fs.get_file_info(root).type != FileType.NotFound:
                fs.delete_dir(root)
        except (OSError, StorageError) as e:   # a store refusing the delete
            log.warning("could not remove the search's top layers at %s: %s", self.folder, e)


def _top_beam(feats: DataFrame, model: ShardedModel, t0: int, beam_size: int) -> DataFrame:
    """(sample_id, beam) after the first ``t0`` layers, as :func:`_beam`'s merge keeps it (top
    ``beam_size`` of struct(neg score, prank, pos), ties by parent rank then position), computed
    here (checkpointed). Each batch of rows is searched by the broadcast kernel
    (:func:`~..kernels.beam_search.beam_layers`) with those layers' weights (at most the broadcast
    bound) shared with the tasks: written into files by the tasks that hold them, under a scratch
    folder every task sees (:func:`~..compat.scratch_root`; the model's ``scratch``), and removed
    after the search, so that no weights pass through the driver. Without such a folder (a
    cluster given none), or when the tasks cannot use it (a job fails), collected and broadcast."""
    layers = list(tree_layers(model.index).layers[:t0])
    n_cols = model.n_features + (1 if model.bias > 0 else 0)
    rows = _placed_of(model).where(F.col("layer") < t0).select("layer", "pos", "w_idx", "w_val")   # TOP_ROWS
    n_features, bias, post = model.n_features, model.bias, model.pred_params.post_processor

    def searched(shared) -> DataFrame:
        def search(batches):
            for b in batches:
                if not b.num_rows:
                    continue
                t = pa.Table.from_batches([b])
                X = append_bias(csr_from_table(t, "feature_idx", "feature_val", n_features), bias)
                nodes, scores = beam_layers(X, shared.value, beam_size, post)
                ok = nodes >= 0
                entries = pa.StructArray.from_arrays(
                    [pa.array(-scores[ok]), pa.array(np.zeros(int(ok.sum()), np.int32)), pa.array(nodes[ok])],
                    names=["neg", "prank", "pos"])
                off = np.concatenate([[0], np.cumsum(ok.sum(axis=1))]).astype(np.int32)
                yield pa.RecordBatch.from_arrays([t.column("sample_id").combine_chunks(),
                                                  pa.ListArray.from_arrays(pa.array(off), entries)],
                                                 names=["sample_id", "beam"])
                worker_progress("predict (top layers)", rows=b.num_rows)

        # the function is pickled here, with what ``shared`` holds by then
        return feats.mapInArrow(search, "sample_id long, beam array<struct<neg: double, prank: int, pos: long>>"
                                ).localCheckpoint()

    root = scratch_root(feats.sparkSession, model.scratch)
    if root is None:
        log.warning("predict: no scratch folder that every executor sees (the model's scratch): the top layers "
                    "(%d layers) are collected and broadcast", t0)
    else:
        files, written = _TopFiles(f"{root}/top-layers-{uuid.uuid4().hex}", layers, n_cols), False
        try:
            files.expect(rows.mapInArrow(files.write, "part int, n long").collect())   # O(partitions) rows
            written = True
            return searched(files)
        except (Py4JJavaError, PySparkException) as e:
            # the tasks could not write the files, or not read them: any other failure is the search's own
            if written and _UNREADABLE not in str(e):
                raise
            log.warning("predict: the top layers could not be shared through %s (%s); collected and broadcast "
                        "instead", root, _cause(e))
        finally:
            files.remove()
    return searched(share(feats, _top_columns(to_arrow(rows), layers, n_cols),   # <= the bound
                          name="the top layers of the model"))


def _cause(e: Exception) -> str:
    """The last line of a Spark failure that names an error (its root cause), else its first."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if re.search(r"\w+(Error|Exception)\b", ln) and "py4j" not in ln.lower()]
    return (named[-1] if named else lines[0] if lines else type(e).__name__)[:300]


def _beam(samples: DataFrame, model: ShardedModel, beam_size: int, n_layers: int, group_rows: int, n: int,
          labels: bool = False, keep: Optional[list] = None, topk: Optional[int] = None, trees: int = 1):
    """The beam over the first ``n_layers`` layers: rows (sample_id, pos, score) of the last
    one's candidates, top ``beam_size`` per sample — or, with ``labels``, the label layer's
    (sample_id, pos = label, score) of every label the beam reaches (a label reached through
    several leaves: the mean of its scores); with ``topk`` too (a tree whose every label sits
    in one leaf), only each leaf's ``topk`` best labels per row, which hold the row's top k.
    ``keep``: a list that receives every layer's beam as (sample_id, pos) rows (each layer's
    beam is checkpointed: computed once).

    The top layers that fit the broadcast bound together (:func:`top_layers`; of one of ``trees``
    trees searched together, their share of it; not with ``keep``) are searched in one pass with
    their weights shared (:func:`_top_beam`); the label layer always goes through the cogroup."""
    shape = tree_layers(model.index)
    layer_nbytes(model)                          # one aggregate; stops on a key the tree lacks
    W = _placed_of(model)
    spark = samples.sparkSession
    bounds = search_bounds(spark)
    # the rows' features, read once and kept on the executors (memory and disk): every layer
    # rejoins its beam with them, which would otherwise read the input (a Delta table) again;
    # partitioned by sample, so that the join shuffles at most the beam, into these partitions
    feats_parts = search_partitions(spark, n * beam_size, bounds)
    feats = partitioned_checkpoint(samples.select("sample_id", "feature_idx", "feature_val"), feats_parts,
                                   "sample_id")

    def by(df: DataFrame, rows: float, *keys: str) -> DataFrame:    # the search's own shuffles
        return df.repartition(search_partitions(spark, rows, bounds), *keys)

    def rejoin(top: DataFrame) -> DataFrame:
        # a shuffled hash join on sample_id (each task hashes its share of the rows' features): a
        # small input table would otherwise be broadcast, its rows through the driver every layer.
        # The features stay where they are (:func:`~..compat.partitioned_checkpoint`); a layer's
        # beam, merged into the same partitions and checkpointed keeping them, is not shuffled
        # either (:func:`merge_partitions`); one merged into more is shuffled into theirs.
        return (top.join(never_broadcast(feats), "sample_id")
                .select("sample_id", "feature_idx", "feature_val", F.posexplode("beam").alias("rank", "e"))
                .select("sample_id", "feature_idx", "feature_val", F.col("e.pos").alias("ppos"),
                        F.col("rank").alias("prank"), (-F.col("e.neg")).alias("pscore")))

    t0 = 0 if keep is not None else top_layers(model, n_layers - (1 if labels else 0),
                                               broadcast_bound(samples, model.pred_params) / trees)
    top = None
    if t0:
        # checkpointed as every layer's beam: later plans do not carry the shared layers
        top = _top_beam(feats, model, t0, beam_size)
        cur = rejoin(top) if t0 < n_layers else None
    else:
        # prank: the parent's rank in its row's beam; ties in score are broken by it, then by the
        # child's position, as the broadcast search enumerates its candidates
        cur = feats.select("*", F.lit(0).cast("long").alias("ppos"), F.lit(0).alias("prank"),
                           F.lit(1.0).alias("pscore"))
    slot_label = model.index.slot_label
    for t in range(t0, n_layers):
        keys, child_ptr, through = shape.layers[t]
        last = labels and t == n_layers - 1
        m_prev = len(child_ptr) - 1
        rows_in = n * min(beam_size, m_prev)                        # rows reaching this layer
        salt = max(1, math.ceil(rows_in / m_prev / group_rows))
        fan = _mean_fan(child_ptr)
        rows_out = rows_in * (min(topk, fan) if last and topk else fan)   # their candidates
        parts = merge_partitions(spark, rows_out, feats_parts, bounds)     # their merge by sample

        score = _scorer(model, child_ptr, through, slot_label[keys] if last else None, topk if last else None)
        # both sides' keys must have one type: a long and an int of equal value hash apart
        left = cur.withColumn("salt", F.pmod(F.xxhash64("sample_id"), F.lit(salt)).cast("long"))
        right = (W.filter(F.col("layer") == t)
                 .withColumn("salt", F.explode(F.sequence(F.lit(0).cast("long"), F.lit(salt - 1).cast("long")))))
        cand = cogrouped_apply(by(left, rows_in, "ppos", "salt"), by(right, rows_in, "ppos", "salt"),
                               ["ppos", "salt"], score,
                               "sample_id long, prank int, pos long, score double")
        if last and topk:  # every label in one leaf: its one score
            return cand.repartition(parts, "sample_id").select("sample_id", "pos", "score")
        if last:           # (sample_id, label, mean score over the leaves that reach it)
            return cand.repartition(parts, "sample_id").groupBy("sample_id", "pos").agg(F.avg("score").alias("score"))
        best = F.slice(F.sort_array(F.collect_list(F.struct((-F.col("score")).alias("neg"), "prank", "pos"))), 1,
                       beam_size)
        # checkpointed (computed once, here): the next layer's plan starts from it, so a layer's
        # planning and its tasks' metric updates stay the size of one layer, not of all above
        # it; in the features' partitions, keeping them, so that its rejoin shuffles neither side
        # (in more partitions, a plain checkpoint: under adaptive execution it keeps no
        # partitioning and the rejoin shuffles it into the features', where a kept one would have
        # the features shuffled into its own)
        top = cand.repartition(parts, "sample_id").groupBy("sample_id").agg(best.alias("beam"))
        rejoined = t < n_layers - 1
        top = kept_checkpoint(top) if rejoined and parts == feats_parts else top.localCheckpoint()
        if keep is not None:
            keep.append(top.select("sample_id", F.explode("beam.pos").alias("pos")))
        if rejoined:
            cur = rejoin(top)
    return top.select("sample_id", F.explode("beam").alias("e")).select(
        "sample_id", F.col("e.pos").alias("pos"), (-F.col("e.neg")).alias("score"))


def _scorer(model: ShardedModel, child_ptr: np.ndarray, through: np.ndarray, labels: Optional[np.ndarray],
            topk: Optional[int] = None):
    """The cogroup function of one layer: (rows that reached parent p, weights of p's children)
    -> (sample_id, child position or, at the label layer, label, path score) per row and child;
    with ``topk``, per row only the ``topk`` best children (ties to the smaller label)."""
    n_cols = model.n_features + (1 if model.bias > 0 else 0)
    n_features, bias, post = model.n_features, model.bias, model.pred_params.post_processor

    def score(left: pa.Table, right: pa.Table) -> pa.Table:
        _TOP_CACHE.clear()          # a search's top layers, read in this worker (_TopFiles), are done with
        if left.num_rows == 0:
            return pa.table({"sample_id": pa.array([], pa.int64()), "prank": pa.array([], pa.int32()),
                             "pos": pa.array([], pa.int64()), "score": pa.array([], pa.float64())})
        p = int(left.column("ppos")[0].as_py())
        c0, c1 = int(child_ptr[p]), int(child_ptr[p + 1])
        off, idx = list_offsets_values(right, "w_idx")
        _, val = list_offsets_values(right, "w_val")
        W = _columns(off, idx, val, right.column("pos").to_numpy() - c0, c1 - c0, n_cols)
        X = append_bias(csr_from_table(left, "feature_idx", "feature_val", n_features), bias)
        S = score_children(X, left.column("pscore").to_numpy(), W, through[c0:c1], post)
        ids = left.column("sample_id").to_numpy()
        out = np.arange(c0, c1) if labels is None else labels[c0:c1]
        worker_progress("predict", rows_scored=left.num_rows)
        row = np.repeat(np.arange(len(ids)), c1 - c0)
        col = np.tile(out, len(ids))
        S = S.ravel()
        if topk is not None and c1 - c0 > topk:     # each row's best topk: by score, then label
            order = np.lexsort((col, -S, row))
            keep = order[(np.arange(len(order)) % (c1 - c0)) < topk]
            row, col, S = row[keep], col[keep], S[keep]
        return pa.table({"sample_id": pa.array(ids[row]),
                         "prank": pa.array(left.column("prank").to_numpy().astype(np.int32)[row]),
                         "pos": pa.array(col), "score": pa.array(S)})

    return score


def _columns(off, idx, val, col, K: int, n_rows: int):
    """A csc matrix (n_rows x K) whose column col[j] holds list row j (missing columns empty)."""
    counts = np.zeros(K, np.int64)
    lens = np.diff(off)
    counts[col] = lens
    order = np.argsort(col, kind="mergesort")
    starts = off[:-1][order]
    sl = lens[order]
    take = np.repeat(starts - np.cumsum(sl) + sl, sl) + np.arange(int(sl.sum()))   # rows' values, by column
    ptr = np.concatenate([[0], np.cumsum(counts)])
    # float32 as stored: the searches take each product in float64 anyway
    return sp.csc_matrix((val[take], idx[take], ptr), shape=(n_rows, K))


def predict(samples: DataFrame, model, beam_size: int, topk: int, group_rows: int = GROUP_ROWS) -> DataFrame:
    """(sample_id, pred_labels, pred_scores), top-k per sample, best first (ties: the smaller
    label), equal to the broadcast beam search of the same model; of a :class:`ShardedEnsemble`,
    the top k of the labels' mean scores over the trees, as :meth:`~..model.EnsembleModel.predict`
    (the trees' scores are added in Spark's order: with three or more trees the last bits, and so
    the order of near-equal scores, may differ from the broadcast sum)."""
    parts, n = members(model), _row_count(samples)
    scores = None
    for _, m in parts:
        # one tree whose every label sits in one leaf: each leaf task keeps its rows' top k
        prune = topk if len(parts) == 1 and len(np.unique(m.index.slot_label)) == len(m.index.slot_label) else None
        s = _beam(samples, m, beam_size, len(tree_layers(m.index).layers), group_rows, n(), labels=True, topk=prune,
                  trees=len(parts))
        scores = s if scores is None else scores.unionByName(s)
    if len(parts) > 1:      # a mean of exactly 0 is no candidate, as in EnsembleModel's sparse sum
        # each tree's label layer (never pruned in an ensemble): rows x beam x the leaves' mean size
        rows = sum(n() * beam_size * _mean_fan(tree_layers(m.index).layers[-1][1]) for _, m in parts)
        scores = (scores.repartition(search_partitions(samples.sparkSession, rows), "sample_id")
                  .groupBy("sample_id", "pos").agg((F.sum("score") / len(parts)).alias("score"))
                  .where(F.col("score") != 0))
    best = F.slice(F.sort_array(F.collect_list(F.struct((-F.col("score")).alias("neg"), "pos"))), 1, topk)
    return (scores.groupBy("sample_id").agg(best.alias("top"))
            .select("sample_id", F.col("top.pos").cast("array<int>").alias("pred_labels"),
                    F.transform("top.neg", lambda v: -v).cast("array<float>").alias("pred_scores"))
            ).to(TABLES["predictions"])


def routed(samples: DataFrame, model, beam_size: int, group_rows: int = GROUP_ROWS) -> DataFrame:
    """(sample_id, man): every node (depth >= 1, not a pad) the beam holds for a sample at every
    depth, sorted, as :meth:`XMCModel.beam_nodes` (``train.negatives = tfn+man``; of an
    ensemble, every tree's nodes as ensemble keys, as :meth:`~..model.EnsembleModel.beam_nodes`);
    samples whose beam holds none are left out (the trainer reads them as having none)."""
    spark, n = samples.sparkSession, _row_count(samples)
    found = None
    for t, m in members(model):
        shape = tree_layers(m.index)
        inner = len(shape.layers) - 1
        if inner == 0:
            continue
        beams: list = []
        _beam(samples, m, beam_size, inner, group_rows, n(), keep=beams)
        for (ids, _, through), beam in zip(shape.layers, beams):
            real = np.flatnonzero(~through)
            keys = _keyed(model, t, ids[real])
            nodes = spark.createDataFrame(pd.DataFrame({"pos": real.astype(np.int64), "node": keys}),
                                          "pos long, node long")
            part = beam.join(F.broadcast(nodes), "pos").select("sample_id", "node")
            found = part if found is None else found.unionByName(part)
    if found is None:
        return local_frame(spark, {"sample_id": pa.array([], pa.int64()), "man": pa.array([], pa.list_(pa.int64()))})
    return found.groupBy("sample_id").agg(F.array_sort(F.collect_set("node")).alias("man"))


def matcher(samples: DataFrame, model, beam_size: int, group_rows: int = GROUP_ROWS) -> DataFrame:
    """M as a table (sample_id, leaf, score): the leaves each sample's beam reaches, as
    :meth:`XMCModel.match_leaves` (the overlapping-cluster stage's matcher); of an ensemble,
    every tree's leaves as ensemble keys, as :meth:`~..model.EnsembleModel.match_leaves`."""
    out, n = None, _row_count(samples)
    for t, m in members(model):
        shape = tree_layers(m.index)
        inner = len(shape.layers) - 1
        key = _keyed(model, t, shape.last_leaf if inner else [0])
        if inner == 0:   # the root is the only leaf
            part = samples.select("sample_id", F.lit(int(key[0])).cast("long").alias("leaf"),
                                  F.lit(1.0).cast("float").alias("score"))
        else:
            beam = _beam(samples, m, beam_size, inner, group_rows, n(), trees=len(members(model)))
            leaves = samples.sparkSession.createDataFrame(
                pd.DataFrame({"pos": np.arange(len(key), dtype=np.int64), "leaf": key}), "pos long, leaf long")
            part = (beam.join(F.broadcast(leaves), "pos")
                    .select("sample_id", "leaf", F.col("score").cast("float").alias("score")))
        out = part if out is None else out.unionByName(part)
    return out.to(TABLES["matcher"])


# ---- chunked model folder ------------------------------------------------------------------

def save(model, folder: str) -> None:
    """Write ``folder`` as a chunked model (format 2): param.json and the tree from the driver,
    the weights' part files from the tasks; atomic like :meth:`XMCModel.save` (a temp folder
    renamed into place). A :class:`ShardedEnsemble`: an ensemble folder (format 3, as
    :meth:`~..model.EnsembleModel.save`) whose members ``tree-<t>`` are chunked folders."""
    if isinstance(model, ShardedEnsemble):
        def write_members(tmp: Path) -> None:
            names = []
            for t, m in enumerate(model.members):
                names.append(f"tree-{t}")
                (tmp / names[-1]).mkdir()
                m.label_counts, m.meta = model.label_counts, dict(model.meta)
                _write_chunked(m, tmp / names[-1], f"{folder}/{names[-1]}")
            write_ensemble_header(tmp, model, names)
        atomic_folder(folder, write_members)
        return
    atomic_folder(folder, lambda tmp: _write_chunked(model, tmp, folder))


def _write_chunked(model: ShardedModel, tmp: Path, folder: str) -> None:
    """A chunked model's files into ``tmp`` (``folder``: its final name, for errors)."""
    (tmp / "weights").mkdir()
    n_parts = max(1, math.ceil(model.nbytes / PART_BYTES))
    wdir = str(tmp / "weights")
    n_cols = model.n_features + (1 if model.bias > 0 else 0)

    def write(batches):
        batches = list(batches)
        if not batches or sum(b.num_rows for b in batches) == 0:
            return
        t = pa.Table.from_batches(batches)
        off, idx = list_offsets_values(t, "w_idx")
        _, val = list_offsets_values(t, "w_val")
        W = sp.csc_matrix((np.asarray(val, np.float32), np.asarray(idx, np.int32), off), shape=(n_cols, t.num_rows))
        name = f"part-{uuid.uuid4().hex}.npz"
        save_part(os.path.join(wdir, name), t.column("is_leaf").to_numpy(zero_copy_only=False),
                  t.column("key").to_numpy(), W)
        yield pa.RecordBatch.from_arrays([pa.array([f"weights/{name}"]), pa.array([t.num_rows])],
                                         names=["part", "columns"])

    parts = (model.weights.repartitionByRange(n_parts, "is_leaf", "key")
             .mapInArrow(write, "part string, columns long").collect())   # O(parts) rows
    unseen = [r["part"] for r in parts if not (tmp / r["part"]).is_file()]
    if unseen:
        raise ModelFormatError(f"{folder}: the tasks wrote {len(unseen)} weight part(s) the driver cannot see "
                               f"(e.g. {unseen[0]}): a sharded model's folder must be on storage the driver and "
                               "the executors share (local mode, /Volumes, /dbfs)")
    write_header(tmp, model, CHUNKED_VERSION, weights={"layout": "chunked", "nbytes": int(model.nbytes),
                                                       "parts": sorted(r["part"] for r in parts)})


def chunked_nbytes(folder: Path, param: dict) -> int:
    """The weights' size a chunked header declares, else the size of its part files on disk."""
    v = param["weights"].get("nbytes")
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return sum(os.path.getsize(folder / p) for p in param["weights"]["parts"])


def load(spark, folder: str):
    """A chunked model folder as a :class:`ShardedModel`: the tree on the driver, the weights
    read by tasks, one part file each (nothing of the weights passes through the driver); an
    ensemble folder of chunked members as a :class:`ShardedEnsemble` (:func:`use_scratch` gives
    them a scratch folder)."""
    folder = Path(folder)
    param, index, label_counts = read_header(folder)
    if param["format_version"] == ENSEMBLE_VERSION:     # every member chunked (each checked below)
        model = ShardedEnsemble([load(spark, folder / name) for name in param["members"]],
                                param.get("meta") or {}, label_counts)
        model.pred_params = PredictParams.from_dict(param["pred_params"])
        return model
    if param["format_version"] != CHUNKED_VERSION:
        raise ModelFormatError(f"{folder}: not a chunked model (format version {param['format_version']!r})")
    parts = [str(folder / p) for p in param["weights"]["parts"]]

    def read(batches):
        for b in batches:
            for path in b.column(0).to_pylist():
                is_leaf, keys, W = load_part(path)
                idx, val = csr_rows_to_arrays(W.T.tocsr())
                yield pa.RecordBatch.from_arrays([pa.array(is_leaf), pa.array(keys), idx, val],
                                                 names=["is_leaf", "key", "w_idx", "w_val"])

    files = local_frame(spark, {"path": pa.array(parts, pa.string())}).repartition(max(1, len(parts)))
    weights = files.mapInArrow(read, WEIGHTS_SCHEMA)
    model = ShardedModel(index, weights, param["n_features"], param["bias"], param["normalize"],
                         PredictParams.from_dict(param["pred_params"]), param.get("meta") or {},
                         label_counts, chunked_nbytes(folder, param))
    return model
