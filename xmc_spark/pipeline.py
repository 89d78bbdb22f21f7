"""The pipeline's stages and the commands built on them.

Each ``*_stage(ctx) -> StageResult`` function is one stage of :mod:`.registry`, run by
:class:`.runner.Runner`: ``xmc-spark run`` (:func:`run`: every stage over ``OUT/tables``, then
:func:`write_run_outputs`, the one writer of ``OUT/metrics.json``), ``xmc-spark sweep``
(:func:`sweep`: ingest and EAGLE once, then the later stages per value) and ``xmc-spark stage``
(:func:`.runner.run_keyed`: one run key's partitions) all go through them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import scipy.sparse as sp
from pyspark.sql import functions as F

from . import prime_model
from .arrow_utils import list_offsets_values, local_frame, to_arrow, to_pandas
from .compat import shuffle_partitions
from .config import dump_params
from .kernels.tree import Forest, TreeIndex, tree_list
from .model import EnsembleModel, ModelTrainParams, XMCModel, is_chunked, split_columns
from .params import ConfigError, PipelineParams, PredictParams
from .registry import ORDER
from .runner import Runner, StageContext, StageResult, StageTimer
from .schemas import EMBEDDING_SCHEMA, TREE_SCHEMA, IngestError
from .stages import (
    aggregated,
    eagle,
    evaluation,
    ingest,
    knn,
    label_clusters,
    label_embedding,
    label_frequencies,
    label_tree,
    node_training,
    prediction,
    prime,
    sharded,
    split_across,
)
from .storage import Tables, is_local_path
from .tracking import Tracker

log = logging.getLogger("xmc_spark.pipeline")


def weights_to_columns(t: pa.Table, n_cols: int):
    """Weights table (as Arrow) -> (node KeyedColumns, slot KeyedColumns), no per-row Python."""
    is_leaf = np.asarray(t.column("is_leaf").to_numpy(zero_copy_only=False), dtype=bool)
    keys = np.asarray(t.column("key").to_numpy(zero_copy_only=False), dtype=np.int64)
    off, idx = list_offsets_values(t, "w_idx")
    _, val = list_offsets_values(t, "w_val")
    W = sp.csc_matrix((np.array(val, np.float32), np.array(idx, np.int32), off), shape=(n_cols, len(keys)))
    return split_columns(is_leaf, keys, W)


def grow_tree(samples, tables: Tables, n_features: int, n_labels: int, params: PipelineParams, timer: StageTimer,
              label_counts=None, row_nnz: Optional[float] = None, label_nnz: Optional[int] = None):
    """PIFA label embeddings, label frequencies (interpolated splits only) and the label tree;
    writes ``tree`` (and ``label_embeddings`` with ``embedding.write_table``); returns (TreeIndex,
    frequency facts). ``label_counts`` (training label frequencies), when given, spare the
    frequency stage a pass; with ``row_nnz`` (mean non-zeros of a training row, from ingest's
    count) they size ``tree.max_split_labels = auto`` without a job; ``label_nnz`` (ingest's sum
    over the rows of labels x non-zeros), else those two, size the embedding's combine."""
    spark = samples.sparkSession
    # the combine's tasks sized by ingest's bound on the partials' non-zeros (else its estimate)
    emb = label_embedding.run(samples, params.embedding, n_features=n_features, n_labels=n_labels,
                              n_buckets=shuffle_partitions(spark), packed=True,
                              partials_nnz=label_embedding.partials_nnz(label_counts, row_nnz, label_nnz))
    # Without the table the embedding is part of the tree's plan (the chained levels read it once;
    # the level-by-level path caches its own join). With it, the rows are packed and kept (the
    # write's job fills the cache): the tree grows from the rows just written, without reading the
    # table back (a Delta snapshot, a file filter and a pass that packs its lists again); the
    # table's lists are unpacked from the bytes in the write's tasks. A block lost from the cache
    # is recomputed: its sums may then differ in the last bits (the shuffle's order of a label's
    # partials), as a rerun of the stage's embedding would
    keep = params.embedding.write_table
    if keep:
        emb = emb.persist()
    try:
        if keep:
            with timer.stage("embedding"):
                write_embeddings(tables, emb, params)
                tables.note_read("label_embeddings")
        else:
            write_embeddings(tables, emb, params)        # an earlier run's rows removed, if any
        f = ft = None
        facts: Dict = {}
        if params.tree.effective_lambda > 0:
            with timer.stage("frequencies"):
                f, ft, finfo = label_frequencies.run(samples, n_labels, params.tree, label_counts)
                facts = {f"frequencies.{k}": v for k, v in finfo.items()}
        with timer.stage("tree"):
            bound = split_across.split_bound(samples, params.tree, n_features, n_labels, label_counts, row_nnz,
                                             scratch=tables.scratch)
            tree = label_tree.run(emb, params.tree, n_features=n_features, n_labels=n_labels, f=f, f_tilde=ft,
                                  split_bound=bound, scratch=tables.scratch)
            index = commit_tree(tables, tree, n_labels, params)
    finally:
        if keep:
            emb.unpersist()
    return index, facts


def write_embeddings(tables: Tables, emb, params: PipelineParams) -> None:
    """The ``label_embeddings`` table: the PIFA rows ``emb`` (packed, :func:`.label_embedding.run`)
    with ``embedding.write_table``. Without it, rows an earlier run left there (this run key's, or
    the root's) would describe another tree: they are removed, one commit of no rows, and only
    when the table exists."""
    if params.embedding.write_table:
        tables.write("label_embeddings", label_embedding.unpacked(emb))
    elif tables.exists("label_embeddings"):
        tables.write("label_embeddings", emb.sparkSession.createDataFrame([], EMBEDDING_SCHEMA))


def commit_tree(tables: Tables, tree, n_labels: int, params: PipelineParams):
    """Write the ``tree`` table and return the TreeIndex of what was committed (O(labels) rows).
    ``tree`` is materialized (the label tree stage's checkpoint, or a pinned table), so its rows
    are the committed ones: they are collected from it, without reading the new table back (the
    read's Delta snapshot and file-filtering jobs: ~0.6 s at 200K, ~2.4 s at 500K in one event log
    each); its version is recorded as read (a listing of its log, no Spark job)."""
    tables.write("tree", tree)
    tables.note_read("tree")
    index = tree_index(to_pandas(tree), n_labels, params)   # O(labels)
    log.info("tree: %d leaves, depth %d", len(index.leaves), index.depth)
    return index


def tree_index(rows: pd.DataFrame, n_labels: int, params: PipelineParams):
    """The :class:`TreeIndex` of (label_idx, node[, tree]) rows, a :class:`Forest` for an
    ensemble (``tree.ensemble`` > 1 or ``tree.ensemble_splits``)."""
    T = params.tree.n_trees()
    tree = rows["tree"].fillna(0).to_numpy() if "tree" in rows else np.zeros(len(rows), np.int64)
    found = np.unique(tree)
    if found.tolist() != list(range(T)):
        raise ConfigError(f"the tree table holds {len(found)} tree(s), the configuration {T} (tree.ensemble, "
                          "tree.ensemble_splits): rerun the tree stage with this configuration")
    trees = [TreeIndex(rows["label_idx"].to_numpy()[tree == t], rows["node"].to_numpy()[tree == t], n_labels,
                       params.tree.for_tree(t).nr_splits) for t in range(T)]
    return trees[0] if T == 1 else Forest(trees)


def slots_index(slots: pd.DataFrame, like):
    """The tree (or forest) of (label_idx, node, tree) slots, with the branching of ``like``."""
    trees = tree_list(like)
    t = slots["tree"].to_numpy() if "tree" in slots else np.zeros(len(slots), np.int64)
    new = [TreeIndex(slots["label_idx"].to_numpy()[t == k], slots["node"].to_numpy()[t == k], ix.n_labels, ix.B)
           for k, ix in enumerate(trees)]
    return Forest(new) if isinstance(like, Forest) else new[0]


def slots_frame(index) -> pd.DataFrame:
    """(label_idx, node, tree) rows of a tree's or forest's label slots (the ``slots`` table)."""
    trees = tree_list(index)
    return pd.concat([pd.DataFrame({"label_idx": ix.slot_label.astype(np.int32), "node": ix.slot_leaf.astype(np.int64),
                                    "tree": np.full(len(ix.slot_label), t, np.int32)})
                      for t, ix in enumerate(trees)], ignore_index=True)


def train_classifiers(samples, index: TreeIndex, tables: Tables, n_features: int, tp: ModelTrainParams,
                      pred: PredictParams, timer: StageTimer, n_samples: Optional[int] = None,
                      label_counts=None, row_nnz: Optional[float] = None) -> XMCModel:
    """Node classifiers for ``index``, then ``clusters.rounds`` of overlapping clusters + retraining
    (the Spark rendering of :meth:`XMCModel.train_local`, same parameters); writes ``weights``
    and ``slots`` (the label -> leaf assignment the final weights belong to). ``label_counts``
    (rows per label, when known) help spread the training units over the tasks; ``row_nnz``
    (mean non-zeros of a row, when known) spares every training its own aggregation of it."""
    spark = samples.sparkSession
    copies = tp.clusters.copies
    with timer.stage("train"):
        model = train_weights(samples, index, tables, n_features, tp, pred, n_samples, label_counts, row_nnz)
    for r in range(tp.cluster_rounds):
        with timer.stage("clusters" if r == 0 else f"clusters_{r + 1}"):
            tables.write("matcher", label_clusters.matcher(samples, model, tp.clusters.beam_size))
            current = spark.createDataFrame(slots_frame(index))
            slots = label_clusters.project(samples, tables.read("matcher"), current, copies,
                                           ensemble=isinstance(index, Forest)).toPandas()
            tables.write("clusters", spark.createDataFrame(slots))
            index = slots_index(slots, index)
            for ix in getattr(index, "trees", [index]):
                log.info("overlapping clusters (%d copies): %s", copies,
                         label_clusters.cluster_stats(ix.slot_label, ix.slot_leaf))
        with timer.stage("retrain" if r == 0 else f"retrain_{r + 1}"):
            model = train_weights(samples, index, tables, n_features, tp, pred, n_samples, label_counts, row_nnz)
    if tp.train.negatives == "tfn+man":
        with timer.stage("negatives"):       # the samples the trained matcher routes to each node
            tables.write("negatives", node_training.routed_nodes(samples, model, pred.beam_size))
        with timer.stage("retrain_man"):
            model = train_weights(node_training.with_routed(samples, tables.read("negatives")), index, tables,
                                  n_features, tp, pred, n_samples, label_counts, row_nnz)
    tables.write("slots", spark.createDataFrame(slots_frame(index)))
    return model


def train_weights(samples, index: TreeIndex, tables: Tables, n_features: int, tp: ModelTrainParams,
                  pred: PredictParams, n_samples: Optional[int] = None, label_counts=None,
                  row_nnz: Optional[float] = None) -> XMCModel:
    """Train every node's classifiers for ``index``; write the weights table; build the model.
    ``n_samples`` (the rows of ``samples``, when known) spares the trainer a count, ``row_nnz``
    (their mean non-zeros) the auto node bound's aggregation."""
    w = node_training.run(samples, index, n_features, tp.train, n_samples=n_samples, scratch=tables.scratch,
                          label_counts=label_counts, row_nnz=row_nnz)
    # trained in the write's own tasks (no cache: the frame is used once); a write retried after a
    # concurrent commit (run-keyed tables, storage.write_delta) trains the grouped nodes again,
    # while the distributed solver's weights are already checkpointed
    tables.write("weights", w)
    return model_from_weights(tables.read("weights"), index, n_features, tp, pred, tables.scratch)


def model_from_weights(weights, index: TreeIndex, n_features: int, tp: ModelTrainParams,
                       pred: PredictParams, scratch: Optional[str] = None):
    """The model of a weights table: an :class:`XMCModel` (collected to the driver, broadcast
    to predict) when its weights fit ``predict.max_broadcast_mb``, else a
    :class:`~.stages.sharded.ShardedModel` (of an ensemble, a :class:`~.stages.sharded.ShardedEnsemble`)
    whose weights never leave the executors."""
    tree_bytes = sharded.tree_nbytes(weights)
    nbytes = sum(tree_bytes.values())
    if nbytes > sharded.broadcast_bound(weights, pred):
        log.info("model weights %.1f MB > the broadcast bound %.1f MB: kept sharded on the executors",
                 nbytes / 2 ** 20, sharded.broadcast_bound(weights, pred) / 2 ** 20)
        return sharded.sharded_model(index, weights, n_features, tp.train.bias, tp.normalize, pred, tree_bytes,
                                     scratch)
    n_cols = n_features + (1 if tp.train.bias > 0 else 0)
    node_w, slot_w = weights_to_columns(to_arrow(weights), n_cols)
    if isinstance(index, Forest):
        return EnsembleModel.from_columns(index, node_w, slot_w, n_features, bias=tp.train.bias,
                                          normalize=tp.normalize, pred_params=pred)
    return XMCModel(index, node_w, slot_w, n_features, bias=tp.train.bias, normalize=tp.normalize, pred_params=pred)


def model_from_tables(tables: Tables, n_features: int, n_labels: int, params: PipelineParams) -> XMCModel:
    """The model a train stage left in ``tables`` (``slots`` + ``weights``)."""
    index = tree_index(to_pandas(tables.read("slots")), n_labels, params)
    return model_from_weights(tables.read("weights"), index, n_features, ModelTrainParams.from_pipeline(params),
                              params.predict, tables.scratch)


# ---- the stages (see registry.STAGES) -------------------------------------------------------

def ingest_stage(ctx: StageContext) -> StageResult:
    """Validate --train and --test in full, then (only then) write ``train`` and ``test``. An
    aggregated --train (group-level labels, :mod:`.stages.aggregated`) is validated here and
    turned into ``train`` by the eagle stage."""
    if not ctx.train:
        raise ConfigError("stage ingest needs --train")
    spark, p, tables = ctx.spark, ctx.params, ctx.tables
    with ctx.timer.stage("ingest"):
        agg = train_df = test_df = tinfo = carried = None
        if aggregated.is_aggregated(spark, ctx.train):
            agg = aggregated.read(spark, ctx.train, p.ingest)
            info = agg.info
            if ctx.test:        # a test label no group carries can never be assigned (EAGLE reuses the counts)
                carried = eagle.groups_per_label(agg)
        else:
            train_df, info = ingest.read_samples(spark, ctx.train, p.ingest, count_labels=True)
        if ctx.test:
            counts = carried if agg is not None else info.label_counts
            seen = counts > 0 if counts is not None else None
            test_df, tinfo = ingest.read_samples(spark, ctx.test, p.ingest, expect_features=info.n_features,
                                                 expect_labels=info.n_labels, seen_labels=seen)
        if train_df is not None:                 # every input is valid: write
            tables.write("train", train_df)
        if test_df is not None:
            tables.write("test", test_df)
    facts = {"train": ctx.train, "test": ctx.test, "aggregated": agg is not None, "n_train": info.n_samples,
             "n_features": info.n_features, "n_labels": info.n_labels, "n_train_nonzeros": info.n_nonzeros,
             "n_train_label_nonzeros": info.n_label_nonzeros,
             "n_test": tinfo.n_samples if tinfo else None, **(agg.stats if agg is not None else {})}
    if agg is not None:
        ctx.memo["aggregated"] = agg
        if carried is not None:
            ctx.memo["groups_per_label"] = carried
    elif info.label_counts is not None:       # the tree stage's label frequencies, in this process
        ctx.memo["label_counts"] = info.label_counts
    if test_df is not None:
        facts.update(_unseen(ctx, info.n_labels, carried if agg is not None else info.label_counts, tinfo,
                             per_sample=agg is None))
    return StageResult(facts)


def _unseen(ctx: StageContext, n_labels: int, counts=None, tinfo=None, per_sample: bool = True) -> Dict[str, int]:
    """Counts of test labels that never occur in the training labels (reported, never fatal),
    from the training label counts, which the tree stage then reuses (``ctx.memo``, O(labels)).
    Text inputs had both counted by ingest's check jobs (``counts``, and ``tinfo`` the test's
    DatasetInfo: no further job); otherwise they are counted from the written tables. Group-level
    input (``per_sample`` False): ``counts`` are the groups carrying each label, so a test label
    is unseen when no group carries it; every EAGLE mode gives each (group, label) at least one
    member (weight >= 1 / group size, above ``eagle.min_weight`` for groups under 1000 members),
    so these are the labels the training table will lack."""
    if counts is None:
        counts = evaluation.label_counts(ctx.tables.read("train"), n_labels)
    if per_sample:
        ctx.memo["label_counts"] = counts
    if tinfo is not None and tinfo.label_counts is not None and tinfo.rows_with_unseen is not None:
        unseen = evaluation.unseen_from_counts(counts, tinfo.label_counts, tinfo.rows_with_unseen)
    else:
        unseen = evaluation.unseen_labels(counts, ctx.tables.read("test"))
    if unseen["test_unseen_labels"]:
        log.warning("%d test labels never occur in training (%d positives in %d test rows): they count as "
                    "misses in every metric", unseen["test_unseen_labels"], unseen["test_unseen_positives"],
                    unseen["test_rows_with_unseen"])
    return unseen


def eagle_stage(ctx: StageContext) -> StageResult:
    """EAGLE on an aggregated --train: writes the per-sample ``train`` (and ``eagle_embeddings``;
    with rounds that keep their tree, ``eagle_tree``, and with ``embedding.write_table`` the PIFA it
    was grown from as ``label_embeddings``)."""
    ing = ctx.dataset
    if not ing.aggregated:
        log.info("stage eagle: the training input %s has per-sample labels: nothing to do", ing.train)
        return StageResult({"skipped": True})
    spark, tables = ctx.spark, ctx.tables
    agg = ctx.memo.pop("aggregated", None) or aggregated.read(spark, ing.train, ctx.params.ingest)
    changed = [f"{k} {was} -> {now}" for k, was, now in (
        ("samples", ing.n_train, agg.info.n_samples), ("features", ing.n_features, agg.info.n_features),
        ("labels", ing.n_labels, agg.info.n_labels)) if was != now]
    if changed:         # read again in another process: later stages size their work by ingest's record
        raise IngestError(f"{ing.train}: the aggregated input (or the ingest settings it is read with) changed "
                          f"since stage ingest validated it ({', '.join(changed)}): run stage ingest again")
    with ctx.timer.stage("eagle"):
        fit = eagle_model_trainer(ctx.params, agg.info, tables.scratch, eps=ctx.params.eagle.refine_eps or None)
        carried = ctx.memo.pop("groups_per_label", None)
        train_df, facts, emb, assigned = eagle.run(agg, ctx.params.eagle, n_buckets=shuffle_partitions(spark),
                                                   train_model=fit, carried=carried)
        if emb is not None:
            tables.write("eagle_embeddings", emb)
        tables.write("train", train_df)
        if fit.last is not None and keeps_eagle_tree(ctx.params):
            # the last round model's tree (and PIFA, with embedding.write_table): the tree stage keeps
            # it for the final model (the tree O(labels) rows; the embeddings were checkpointed when
            # the model was trained)
            emb_r, tree_r = fit.last
            write_embeddings(tables, emb_r, ctx.params)
            tables.write("eagle_tree", local_frame(spark, pa.Table.from_pandas(tree_r, preserve_index=False),
                                                   TREE_SCHEMA))
            facts[KEPT_TREE] = tree_config(ctx.params)
    if agg.truth is not None:       # evaluation of the assignment, not part of EAGLE's cost
        with ctx.timer.stage("eagle_diagnostics"):
            facts.update(eagle.diagnostics(assigned, agg.truth))
    agg.samples.unpersist()
    # the training table's label counts (the tree stage's frequencies): from the assigned pairs,
    # one per (sample, label); the test's unseen labels were counted by ingest, against the groups
    counts = evaluation.rows_per_label(assigned, ing.n_labels)
    ctx.memo["label_counts"] = counts
    if ing.test:
        carried = carried if carried is not None else eagle.groups_per_label(agg)
        lost = int(np.count_nonzero((carried > 0) & (counts == 0)))
        if lost:        # e.g. eagle.min_weight above a big group's best weight: count them again
            log.warning("%d labels that groups carry got no training pair (below eagle.min_weight): the "
                        "test's unseen labels are counted against the training table", lost)
            facts["eagle.carried_labels_unassigned"] = lost
            facts.update(_unseen(ctx, ing.n_labels, counts, per_sample=False))
    series = {k: v for k, v in facts.items()
              if k == "eagle.objective" or (k.startswith("eagle.refine.") and isinstance(v, list))}
    return StageResult(facts, series=series)


def eagle_model_trainer(params: PipelineParams, info, scratch: Optional[str] = None, eps: Optional[float] = None,
                        whole_ensemble: bool = False):
    """train_df -> model, for EAGLE's re-assignment rounds and the re-rankers' held-out rows: PIFA,
    tree and node classifiers of the training table as the tree and train stages build them
    (without overlapping clusters or matcher-aware negatives; of an ensemble, its first tree only
    unless ``whole_ensemble``: the re-rankers' weights mix the scores of the model they re-rank),
    from in-memory DataFrames; writes no table. ``eps``, when given, replaces ``train.eps`` (the
    node solver's tolerance, grouped and streamed big nodes alike: a round model only ranks a
    group's members, ``eagle.refine_eps``; big nodes of the distributed solver keep ``tron_eps``)."""
    if not whole_ensemble:
        params = dataclasses.replace(params, tree=params.tree.for_tree(0))
    if eps is not None:
        params = dataclasses.replace(params, train=dataclasses.replace(params.train, eps=eps))
    tp = ModelTrainParams.from_pipeline(params)

    def fit(train_df, label_counts=None, n_samples: Optional[int] = None):
        # label_counts (rows per label) place the node trainer's units on its tasks; n_samples, when
        # given, must be train_df's exact row count: it spares a count and also decides the auto row
        # bound and whether any node is big (an undercount could skip the distributed solver)
        spark = train_df.sparkSession
        emb = label_embedding.run(train_df, params.embedding, n_features=info.n_features, n_labels=info.n_labels,
                                  n_buckets=shuffle_partitions(spark), packed=True)
        if params.embedding.write_table and keeps_eagle_tree(params):     # kept for the eagle stage's write
            emb = emb.localCheckpoint()
        f = ft = None
        if params.tree.effective_lambda > 0:
            f, ft, _ = label_frequencies.run(train_df, info.n_labels, params.tree, label_counts)
        bound = split_across.split_bound(train_df, params.tree, info.n_features, info.n_labels, label_counts,
                                         row_nnz=_row_nnz(info), scratch=scratch)
        tree = to_pandas(label_tree.run(emb, params.tree, n_features=info.n_features, n_labels=info.n_labels, f=f,
                                        f_tilde=ft, split_bound=bound, scratch=scratch))
        index = tree_index(tree, info.n_labels, params)
        w = node_training.run(train_df, index, info.n_features, params.train, scratch=scratch,
                              n_samples=n_samples, label_counts=label_counts,
                              row_nnz=_row_nnz(info)).localCheckpoint()
        fit.last = (emb, tree)          # the latest model's PIFA (packed) and tree (eagle.refine_keep_tree)
        return model_from_weights(w, index, info.n_features, tp, params.predict, scratch)
    fit.last = None
    return fit


def _row_nnz(info) -> Optional[float]:
    """Mean non-zeros of a training row from ingest's count (the run's Dataset, or an input's
    DatasetInfo), None when it made none (an aggregated input: its rows' features are counted by
    the split bound's own aggregation if it needs them)."""
    nnz = getattr(info, "n_train_nonzeros", getattr(info, "n_nonzeros", None))
    n = getattr(info, "n_train", getattr(info, "n_samples", None))
    return nnz / max(1, n) if nnz is not None and n else None


def held_out_trainer(ctx: StageContext, split, keep: bool = False):
    """train_df -> model for a re-ranker's held-out rows (:func:`eagle_model_trainer`, the whole
    ensemble). PRIME and the kNN re-ranker stacked in one run hold out the same rows and train that
    model once: the prime stage's is kept in ``ctx.memo`` (``keep``) under its held-out split
    (``split``'s fraction of the training rows and seed) and model settings, and the knn stage
    takes it from there (and drops it: the driver holds it no longer than needed)."""
    from .stages.prime import val_fraction
    key = ("held_out_model", val_fraction(split, ctx.dataset.n_train), split.seed, model_config(ctx.params))
    fit = eagle_model_trainer(ctx.params, ctx.dataset, ctx.tables.scratch, whole_ensemble=True)

    def cached(train_df):
        model = ctx.memo.pop(key, None)
        if model is not None:
            log.info("the held-out model of the prime stage, reused (held-out fraction %.4g, seed %d)", key[1],
                     split.seed)
        else:
            model = fit(train_df)
        if keep:
            ctx.memo[key] = model
        return model
    return cached


def tree_stage(ctx: StageContext) -> StageResult:
    ing = ctx.dataset
    samples = ctx.tables.read("train")
    counts = ctx.memo.get("label_counts")       # ingest's or eagle's, in the same process (same train table)
    if counts is None or len(counts) != ing.n_labels:
        counts = evaluation.label_counts(samples, ing.n_labels)
    kept = ctx.records.get("eagle", {}).get(KEPT_TREE)
    if fits_kept_tree(kept, ctx.params) and "eagle_tree" in ctx.tables.pins:
        index, facts = kept_tree(ctx.tables, ing.n_labels, ctx.params, ctx.timer)
    else:
        if kept is not None:
            log.info("tree: EAGLE's round model kept a tree grown with other tree/embedding settings (or "
                     "eagle.refine_keep_tree is off now): growing one")
        index, facts = grow_tree(samples, ctx.tables, ing.n_features, ing.n_labels, ctx.params, ctx.timer, counts,
                                 row_nnz=_row_nnz(ing), label_nnz=ing.n_train_label_nonzeros)
    ctx.memo["label_counts"] = counts
    # the index of the tree table's version just committed: the train stage of this process takes it
    ctx.memo["tree_index"] = (ctx.tables.reads.get("tree"), index)
    return StageResult({"tree_depth": int(index.depth), "n_leaves": int(len(index.leaves)), **facts})


KEPT_TREE = "eagle.kept_tree"          # the eagle stage's fact: tree_config of the tree it kept


def keeps_eagle_tree(params: PipelineParams) -> bool:
    """EAGLE's rounds hand their last model's tree to the final model (``eagle.refine_keep_tree``,
    one tree: an ensemble grows its trees)."""
    return params.eagle.refine_keep_tree and params.tree.n_trees() == 1


def fits_kept_tree(kept: Optional[str], params: PipelineParams) -> bool:
    """Whether the eagle stage's :data:`KEPT_TREE` fact ``kept`` (None: no tree kept) is the tree
    ``params`` would use: the same :func:`tree_config`."""
    return kept is not None and kept == tree_config(params)


def tree_config(params: PipelineParams) -> str:
    """What a kept EAGLE tree depends on besides the training table: the first tree's settings,
    the embedding's, and that a tree is kept at all (``eagle.refine_keep_tree``, one tree). The
    tree stage keeps EAGLE's tree only when its own configuration gives the same string (a
    ``stage tree --set tree...`` rerun or a sweep of ``tree.*`` grows its own)."""
    text = json.dumps({"keep": keeps_eagle_tree(params), "tree": params.tree.for_tree(0).to_dict(),
                       "embedding": _model_inputs(params.embedding.to_dict())}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kept_tree(tables: Tables, n_labels: int, params: PipelineParams, timer: StageTimer):
    """The tree of EAGLE's last round model (``eagle.refine_keep_tree``, one tree only; the eagle
    stage wrote it, and the PIFA it was grown from with ``embedding.write_table``) as the ``tree``
    table. It was grown on the assignment before the last re-assignment, which moves few pairs'
    weight (README, EAGLE), so growing another costs a second PIFA and tree for about the same
    clusters. Returns (TreeIndex, facts) as :func:`grow_tree`."""
    with timer.stage("tree"):
        log.info("tree: EAGLE's round model's tree (eagle.refine_keep_tree)")
        index = commit_tree(tables, tables.read("eagle_tree"), n_labels, params)
    return index, {"tree.from_eagle": 1}


def train_stage(ctx: StageContext) -> StageResult:
    """Node classifiers (and overlapping clusters); the model folder, logged to MLflow when
    ``mlflow.log_model`` (a non-local root keeps the folder only for MLflow)."""
    ing, tables, params = ctx.dataset, ctx.tables, ctx.params
    samples = tables.read("train")
    version, index = ctx.memo.pop("tree_index", (None, None))   # the tree stage's, in this process
    if version is not None and version == tables.pins.get("tree"):
        tables.note_read("tree")                  # the version it pins, recorded as read (MLflow tags)
    else:
        index = tree_index(to_pandas(tables.read("tree")), ing.n_labels, params)
    counts = ctx.memo.get("label_counts")
    counts = counts if counts is not None else evaluation.label_counts(samples, ing.n_labels)
    model = train_classifiers(samples, index, tables, ing.n_features, ModelTrainParams.from_pipeline(params),
                              params.predict, ctx.timer, n_samples=ing.n_train,
                              label_counts=counts, row_nnz=_row_nnz(ing))
    model.meta.update({"train": ing.train, "n_train": ing.n_train,
                       **({"run_key": ctx.run_key} if ctx.run_key else {})})
    model.label_counts = counts
    index = model.index
    facts = {"tree_depth": int(index.depth), "n_leaves": int(len(index.leaves)),
             "model_config": model_config(params),
             "model_layout": "sharded" if isinstance(model, sharded.SHARDED) else "whole",
             **({"n_trees": len(index)} if isinstance(index, Forest) else
                label_clusters.cluster_stats(index.slot_label, index.slot_leaf))}
    keep_model_folder(ctx, model.save)
    if ctx.model_dir:
        facts["model_dir"] = ctx.model_dir
    ctx.memo["model"] = model
    return StageResult(facts)


def keep_model_folder(ctx: StageContext, write) -> None:
    """``write(folder)`` into the run's model folder, or a temporary one when the root keeps none
    (non-local roots: the folder is then only for MLflow), and log it to MLflow when
    ``mlflow.log_model``."""
    tmp = None if ctx.model_dir else Path(tempfile.mkdtemp(prefix="xmc-model-"))
    folder = ctx.model_dir or str(tmp / "model")
    try:
        write(folder)
        if ctx.params.mlflow.log_model:
            ctx.tracker.log_model(folder)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_predictions(tables: Tables, model: XMCModel, params: PipelineParams, source: str,
                      n_rows: Optional[int] = None) -> None:
    """Beam search over table ``source`` (``n_rows`` rows, when known) and PRIME when ``model``
    carries it: writes ``predictions``; with PRIME also ``tree_predictions``, the tree's own top-k."""
    if not isinstance(model, prime_model.PrimedModel):
        tables.write("predictions", prediction.run(tables.read(source), model, params.predict.beam_size,
                                                   params.predict.topk, n_rows))
        return
    preds, tree = prime.with_tree(tables.read(source), model, params.predict.beam_size, params.predict.topk,
                                  n_rows=n_rows)
    tables.write("predictions", preds)
    tables.write("tree_predictions", tree)


def prime_stage(ctx: StageContext) -> StageResult:
    """PRIME after node training (:mod:`.stages.prime`): with ``prime.mode`` off it only
    records itself (and drops a ``prime/`` an earlier run left in the model folder); else the
    ``prime`` table, ``prime/`` in the model folder and, with ``mlflow.log_model``, the model
    logged again with PRIME."""
    p, tables = ctx.params, ctx.tables
    if p.prime.mode == "off":
        if p.prime.label_features:
            log.warning("prime.label_features=%s is not used: prime.mode is off", p.prime.label_features)
        if ctx.model_dir:
            prime_model.PrimeHead.remove(ctx.model_dir)
        return StageResult({"prime.mode": "off"})
    if p.prime.mode == "rerank" and p.prime.val_tree:
        check_held_out_model(ctx, "prime")
    ing = ctx.dataset
    label_feats = None
    if p.prime.label_features:          # checked before any training, like an input
        label_feats = prime.read_label_features(ctx.spark, p.prime.label_features, ing.n_labels, ing.n_features,
                                                p.ingest)
    model = ctx.memo.get("model")
    if model is None:
        model = model_from_tables(tables, ing.n_features, ing.n_labels, p)
    else:
        for t in ("slots", "weights"):
            tables.note_read(t)
    samples = tables.read("train")
    counts = getattr(model, "label_counts", None)
    counts = counts if counts is not None else evaluation.label_counts(samples, ing.n_labels)
    head, facts = prime.run(samples, model, counts, p.prime, ing.n_train, ing.n_features, ing.n_labels,
                            p.predict.beam_size, p.eval, ctx.timer,
                            val_tree_fit=held_out_trainer(ctx, p.prime, keep=p.knn.mode != "off"),
                            embedding_params=p.embedding, label_feats=label_feats)
    with ctx.timer.stage("prime_write"):
        tables.write("prime", ctx.spark.createDataFrame(prime.head_frame(head)))

    def write(folder):                 # the train stage's folder gets prime/; a fresh one the tree too
        if not Path(folder, "param.json").is_file():
            model.save(folder)
        head.save(folder)

    keep_model_folder(ctx, write)
    ctx.memo["prime"] = head
    return StageResult({k: v for k, v in facts.items() if not isinstance(v, list)},
                       series={k: v for k, v in facts.items() if isinstance(v, list)})


def prime_head(ctx: StageContext):
    """The PRIME head of this run (None when ``prime.mode`` was off): the prime stage's, or
    read back from the ``prime`` table and the stage's record."""
    rec = ctx.records.get("prime", {})
    if rec.get("prime.mode", "off") == "off":
        return None
    if ctx.memo.get("prime") is not None:      # this process's head: the table recorded as read
        ctx.tables.note_read("prime")
        return ctx.memo["prime"]
    return prime.head_from_table(ctx.tables.read("prime"), rec)


MODEL_SECTIONS = ("embedding", "tree", "train", "predict")


def model_config(params: PipelineParams) -> str:
    """A hash of the settings the trained model was built with (:data:`MODEL_SECTIONS`), which a
    re-ranker's held-out model is trained with again."""
    text = json.dumps({k: _model_inputs(getattr(params, k).to_dict()) for k in MODEL_SECTIONS}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_inputs(section: Dict) -> Dict:
    """A config section's settings without ``write_table`` (an output, not the model's input: the
    hashes of records written before it existed stay valid)."""
    return {k: v for k, v in section.items() if k != "write_table"}


def check_held_out_model(ctx: StageContext, stage: str) -> None:
    """A re-ranker's weight is chosen on a model trained like the one it re-ranks: stop when this
    stage run's embedding/tree/train/predict settings differ from the train stage's."""
    made = ctx.records.get("train", {}).get("model_config")
    if made is not None and made != model_config(ctx.params):
        raise ConfigError(f"stage {stage} trains its held-out model with the {', '.join(MODEL_SECTIONS)} settings, "
                          f"which differ from those the train stage of this run used: run it with the same settings "
                          f"(or rerun the stages from tree with the new ones)")


def knn_stage(ctx: StageContext) -> StageResult:
    """The kNN re-ranker's k, power and weight, chosen on held-out training rows
    (:mod:`.stages.knn`); with ``knn.mode`` off it only records itself. Writes no table: the
    predict stage reads the record and the ``train`` table (the neighbours' rows)."""
    p = ctx.params
    if p.knn.mode == "off":
        if ctx.model_dir:
            knn.remove_folder(ctx.model_dir)
        return StageResult({"knn.mode": "off"})
    check_held_out_model(ctx, "knn")
    ing = ctx.dataset
    if ing.n_test:                       # the test set's join, checked before anything runs
        knn.check_pairs(ing.n_test, ing.n_train, p.knn, "test")
    rec = ctx.records.get("prime", {})
    for key in ("val_frac", "val_max_rows", "seed"):     # stacked: checked before any work (records since 2026-12)
        if rec.get("prime.mode", "off") != "off" and rec.get(f"prime.{key}", getattr(p.prime, key)) != getattr(
                p.prime, key):
            raise ConfigError(f"the knn stage, stacked on PRIME, chooses on PRIME's held-out rows: prime.{key} is "
                              f"{getattr(p.prime, key)}, the prime stage of this run used {rec[f'prime.{key}']}: run "
                              "it with the prime stage's settings")
    for t in ("slots", "weights"):
        ctx.tables.note_read(t)
    head = prime_head(ctx)               # stacked on PRIME when its stage ran with it on
    if head is not None and head.mode == "rerank" and p.knn.K > head.K:
        raise ConfigError(f"knn.K ({p.knn.K}) must be <= the prime stage's K ({head.K}) when the kNN re-ranker "
                          "re-ranks PRIME's output (both on)")
    if head is not None and any(getattr(p.knn, k) != getattr(p.prime, k) for k in ("val_frac", "val_max_rows", "seed")):
        log.warning("knn: stacked on PRIME, k, power and weight are chosen on PRIME's held-out rows (prime.val_frac "
                    "%g, val_max_rows %d, seed %d); knn.val_frac / val_max_rows / seed are not used", p.prime.val_frac,
                    p.prime.val_max_rows, p.prime.seed)
    split = p.prime if head is not None else p.knn      # stacked: PRIME's held-out rows
    samples = ctx.tables.read("train")
    choice = knn.choose(samples, p.knn, ing.n_train, ing.n_features, ing.n_labels, p.predict.beam_size,
                        held_out_trainer(ctx, split), ctx.timer, head=head, split=split)
    n_prime = rec.get("prime.n_held_out")
    if head is not None and n_prime is not None and int(n_prime) != choice["knn.n_held_out"]:
        raise ConfigError(f"the knn stage, stacked on PRIME, held out {choice['knn.n_held_out']:,} training rows by "
                          f"prime.val_frac / val_max_rows / seed, the prime stage of this run {int(n_prime):,}: run "
                          "it with the prime stage's settings")
    rows, fp = knn.fingerprint(knn.index_rows(samples))     # the voting rows: the predict stage's join size
    facts = {"knn.mode": p.knn.mode, "knn.K": p.knn.K, "knn.on_prime": head is not None, "knn.rows": rows, **choice}
    table = ctx.tables.path("train")
    local = is_local_path(table) and not table.startswith("file:")
    info = {**{k.split(".", 1)[1]: v for k, v in facts.items()}, "fingerprint": fp,
            "table": str(Path(table).resolve()) if local else table, "run_key": ctx.run_key,
            "prime": knn.prime_digest(head)}

    def write(folder):                 # the train stage's folder gets knn/; a fresh one the tree too
        if not Path(folder, "param.json").is_file():
            (ctx.memo.get("model") or model_from_tables(ctx.tables, ing.n_features, ing.n_labels, p)).save(folder)
        knn.save_info(folder, info)

    keep_model_folder(ctx, write)
    return StageResult(facts)


def predict_stage(ctx: StageContext) -> StageResult:
    ing = ctx.dataset
    rec, prime_mode = ctx.records.get("knn", {}), ctx.records.get("prime", {}).get("prime.mode", "off")
    if rec.get("knn.mode", "off") != "off" and bool(rec.get("knn.on_prime")) != (prime_mode != "off"):
        raise ConfigError("the knn stage of this run key was " + ("" if rec.get("knn.on_prime") else "not ")
                          + f"stacked on PRIME, and the prime stage's record says prime.mode={prime_mode}: "
                          "rerun `stage knn`")
    model = ctx.memo.get("model")
    if model is None:
        model = model_from_tables(ctx.tables, ing.n_features, ing.n_labels, ctx.params)
    else:                                   # the train stage's model, as its tables hold it
        for t in ("slots", "weights"):
            ctx.tables.note_read(t)
    head = prime_head(ctx)
    if rec.get("knn.mode", "off") != "off":
        p = ctx.params
        with ctx.timer.stage("predict"):          # K as the weight was chosen with
            kp = dataclasses.replace(p.knn, K=int(rec["knn.K"]))
            preds, tree = knn.rerank(ctx.tables.read("test"), knn.index_rows(ctx.tables.read("train")),
                                     prime_model.with_head(model, head), kp, rec, p.predict.beam_size, p.predict.topk,
                                     ing.n_features, ing.n_labels, ing.n_test, rec.get("knn.rows"))
            ctx.tables.write("predictions", preds)
            ctx.tables.write("tree_predictions", tree)
        return StageResult({"n_test": ing.n_test})
    with ctx.timer.stage("predict"):
        write_predictions(ctx.tables, prime_model.with_head(model, head), ctx.params, "test", ing.n_test)
    return StageResult({"n_test": ing.n_test})


def evaluate_stage(ctx: StageContext) -> StageResult:
    ing, tables = ctx.dataset, ctx.tables
    model = ctx.memo.get("model")
    if model is None:                              # the slots, not the weights
        depth = tree_index(to_pandas(tables.read("slots")), ing.n_labels, ctx.params).label_depth()
        counts = evaluation.label_counts(tables.read("train"), ing.n_labels)
    else:
        depth, counts = model.label_depth(), model.label_counts
        tables.note_read("slots")
    with ctx.timer.stage("evaluate"):
        m = evaluation.run(tables.read("predictions"), tables.read("test"), counts, ing.n_train,
                           ctx.params.eval, label_depth=depth, n_rows=ing.n_test)
        if reranked(ctx.records):                                             # the tree's own, beside
            m.update(tree_metrics(tables.read("tree_predictions"), tables.read("test"), counts, ing.n_train,
                                  ctx.params, depth, ing.n_test))
        metrics = {k: round(v, 4) for k, v in m.items()}
        names, values = zip(*sorted(metrics.items())) if metrics else ((), ())
        tables.write("metrics", local_frame(ctx.spark, {"metric": pa.array(names, pa.string()),
                                                       "value": pa.array(values, pa.float64())}))
    log.info("metrics: %s", {k: v for k, v in metrics.items() if k.startswith(("p@", "ndcg@", "depth@", "tree_p@"))})
    return StageResult(metrics=metrics)


def reranked(records) -> bool:
    """Whether PRIME or the kNN re-ranker was on (the predict stage then wrote ``tree_predictions``)."""
    return (records.get("prime", {}).get("prime.mode", "off") != "off"
            or records.get("knn", {}).get("knn.mode", "off") != "off")


def tree_metrics(tree_predictions, test, counts, n_train: int, params: PipelineParams, depth,
                 n_rows: Optional[int] = None) -> Dict[str, float]:
    """P@k, nDCG@k, PSP@k, recall@k and depth@k of the tree alone, as ``tree_<metric>``."""
    m = evaluation.run(tree_predictions, test, counts, n_train, params.eval, label_depth=depth, n_rows=n_rows)
    return {f"tree_{k}": v for k, v in m.items()}


# ---- commands -------------------------------------------------------------------------------

_BOOKKEEPING = ("train", "test", "tables", "commit", "basis", "skipped", "model_dir")


def write_run_outputs(runner: Runner, out_p: Path, params: PipelineParams, tracker: Tracker,
                      config_path=None) -> Dict:
    """OUT/metrics.json (sizes, every stage's facts and metrics, seconds, table versions) and
    OUT/config.yaml, logged to the current MLflow run."""
    metrics: Dict = {}
    versions: Dict[str, int] = {}
    for name in ORDER:
        rec = runner.records.by_stage.get(name)
        if rec is None:
            continue
        metrics.update({k: v for k, v in rec.items() if k not in _BOOKKEEPING and v is not None})
        versions.update({t: v for t, v in rec.get("tables", {}).items() if t in ("train", "test")})
    metrics["seconds"] = runner.seconds()
    metrics["table_versions"] = versions
    if tracker.run_id:
        metrics["mlflow_run_id"] = tracker.run_id
    out_p.mkdir(parents=True, exist_ok=True)
    (out_p / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (out_p / "config.yaml").write_text(dump_params(params))
    tracker.log_metrics({"total": metrics["seconds"]["total"]}, prefix="seconds.")
    tracker.log_params({f"table_version.{k}": v for k, v in versions.items()})
    tracker.log_artifact(str(out_p / "metrics.json"))
    tracker.log_artifact(str(out_p / "config.yaml"))
    tracker.log_configs(config_path)
    return metrics


def run(spark, train: str, test: Optional[str], out: str, params: PipelineParams,
        config_path: Optional[str] = None) -> Dict:
    """Every stage over OUT/tables; OUT/metrics.json, OUT/model; one MLflow run."""
    out_p = Path(out)
    tracker = Tracker(params.mlflow)
    with tracker.run(run_name=params.mlflow.run_name or out_p.name):
        tracker.log_params(params.flat())
        tracker.log_params({"input.train": train, "input.test": test or ""})
        runner = Runner(spark, params, out, train=train, test=test, tracker=tracker)
        runner.run_all()
        return write_run_outputs(runner, out_p, params, tracker, config_path)


_INPUT_STAGES = ("ingest", "eagle")


def sweep(spark, train: str, test: Optional[str], out: str, params: PipelineParams, key: str, values: Iterable,
          config_path: Optional[str] = None) -> Dict:
    """Train and score one model per value of config ``key`` (e.g. ``tree.lambda_prime``).

    Ingest and EAGLE run once (OUT/tables); each value gets OUT/<key>=<value>/ (model, tables,
    metrics.json) from the later stages and a nested MLflow run; the parent run gets the results
    table (sweep.json) and, with a test set, a precision-vs-expected-depth plot (sweep.png).
    """
    if key.split(".")[0] in ("ingest", "eagle", "spark", "mlflow"):
        raise ConfigError(f"sweep runs ingest (and EAGLE) once, so it cannot sweep '{key}': "
                          "use one `xmc-spark run` per value")
    out_p = Path(out)
    tracker = Tracker(params.mlflow)
    results = []
    with tracker.run(run_name=params.mlflow.run_name or out_p.name, tags={"xmc_spark.sweep": key}):
        tracker.log_params({"sweep.key": key, "sweep.values": ",".join(map(str, values)),
                            "input.train": train, "input.test": test or ""})
        base = Runner(spark, params, out, train=train, test=test, tracker=tracker)
        base.run_all(_INPUT_STAGES)
        for v in values:
            child_params = params.set_dotted(key, v)
            name = f"{key.split('.')[-1]}={v}"
            child = Tracker(params.mlflow)
            with child.run(run_name=name, nested=True, tags={"xmc_spark.sweep": key}):
                child.log_params(child_params.flat())
                # EAGLE's kept tree and its PIFA (eagle.refine_keep_tree; the PIFA table with
                # embedding.write_table) are its output as train is,
                # for a value the tree stage keeps them with (another grows and writes its own)
                kept = base.records.by_stage.get("eagle", {}).get(KEPT_TREE)
                shared = ("train", "test") + (("eagle_tree", "label_embeddings")
                                              if fits_kept_tree(kept, child_params) else ())
                runner = Runner(spark, child_params, str(out_p / name), tracker=child,
                                links={t: base.tables.path(t) for t in shared},
                                records={s: base.records.by_stage[s] for s in _INPUT_STAGES})
                runner.results.update({s: base.results[s] for s in _INPUT_STAGES})
                runner.run_all([s for s in ORDER if s not in _INPUT_STAGES])
                m = write_run_outputs(runner, out_p / name, child_params, child, config_path)
            results.append({"key": key, "value": v, **{k: x for k, x in m.items() if not isinstance(x, dict)},
                            "seconds": m["seconds"]})
        (out_p / "sweep.json").write_text(json.dumps(results, indent=2))
        tracker.log_artifact(str(out_p / "sweep.json"))
        if test:
            plot_sweep(results, str(out_p / "sweep.png"), params.eval.ks)
            tracker.log_artifact(str(out_p / "sweep.png"))
    return {"key": key, "results": results, "out": str(out_p)}


def plot_sweep(results, path: str, ks) -> None:
    """P@k against expected depth@k, one curve per k, points labelled by the swept value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [k for k in ks if f"p@{k}" in results[0] and f"depth@{k}" in results[0]]
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.8), squeeze=False)
    for ax, k in zip(axes[0], ks):
        x = [r[f"depth@{k}"] for r in results]
        y = [r[f"p@{k}"] for r in results]
        ax.plot(x, y, "o-")
        for r, xi, yi in zip(results, x, y):
            ax.annotate(str(r["value"]), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(f"expected depth@{k}")
        ax.set_ylabel(f"P@{k} (%)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"precision vs expected depth, sweep over {results[0]['key']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_model(spark, folder, params: PipelineParams):
    """A saved model folder: whole in memory, or sharded (weights read by the tasks) when it is
    chunked and bigger than ``predict.max_broadcast_mb``; with the folder's PRIME head (``prime/``)
    around either."""
    head = prime_model.PrimeHead.load(folder)
    if is_chunked(folder):
        model = sharded.load(spark, str(folder))
        if model.nbytes > sharded.broadcast_bound(spark, params.predict):
            return prime_model.with_head(model, head)
    return prime_model.with_head(XMCModel.load(folder), head)


def predict(spark, model, data: str, out: str, params: PipelineParams, knn_info: Optional[Dict] = None) -> Dict:
    """Score a file or table with a saved model (an :class:`XMCModel`, a sharded model or a
    folder); writes predictions (Delta) and, when the input has labels, metrics.json. A folder's
    kNN re-ranker (``knn/``; or ``knn_info``, read from it, with a model already loaded) re-ranks
    the tree's candidates with the training rows it names."""
    if isinstance(model, (str, Path)) and knn_info is None:
        knn_info = knn.load_info(model)
    model = load_model(spark, model, params) if isinstance(model, (str, Path)) else model
    index = None
    if knn_info is not None:            # checked before anything is written
        knn.check_prime(knn_info, getattr(model, "head", None), "the model")
        index = knn.saved_index(spark, knn_info)
    model.pred_params = dataclasses.replace(model.pred_params, search=params.predict.search)
    tables = Tables(spark, Path(out) / "tables")
    sharded.use_scratch(model.tree if isinstance(model, prime_model.PrimedModel) else model, tables.scratch)
    ing = dataclasses.replace(params.ingest, normalize=model.normalize)   # rows as the model was trained
    info = ingest.run(spark, data, tables.path("input"), ing, expect_features=model.n_features,
                      expect_labels=model.n_labels)
    df = tables.read("input")
    if knn_info is not None:            # the saved kNN re-ranker, over the rows it was chosen with
        kp = dataclasses.replace(params.knn, K=int(knn_info["K"]))
        choice = {f"knn.{k}": knn_info[k] for k in ("k", "power", "weight")}
        preds, tree = knn.rerank(df, index, model, kp, choice, params.predict.beam_size, params.predict.topk,
                                 model.n_features, model.n_labels, info.n_samples, int(knn_info["rows"]))
        tables.write("predictions", preds)
        tables.write("tree_predictions", tree)
    else:
        write_predictions(tables, model, params, "input", info.n_samples)
    result = {"n_samples": info.n_samples, "predictions": tables.path("predictions")}
    has_labels = df.filter(F.size("label_idx") > 0).limit(1).count() > 0
    if has_labels:
        n_train = int(model.meta.get("n_train", info.n_samples))
        counts = model.label_counts if model.label_counts is not None else evaluation.label_counts(df, model.n_labels)
        m = evaluation.run(tables.read("predictions"), df, counts, n_train, params.eval,
                           label_depth=model.label_depth(), n_rows=info.n_samples)
        if isinstance(model, prime_model.PrimedModel) or knn_info is not None:
            m.update(tree_metrics(tables.read("tree_predictions"), df, counts, n_train, params, model.label_depth(),
                                  info.n_samples))
        result.update({k: round(v, 4) for k, v in m.items()})
    (Path(out) / "metrics.json").write_text(json.dumps(result, indent=2))
    return result
