"""EAGLE on Spark: GRLR label embeddings from group labels, then per-sample labels.

Work is keyed by label. The (label, group, member) triples, each with its member's features,
are the join group_labels x groups x samples. Labels carried by at most ``eagle.head_groups``
groups are placed on tasks longest first by their number of groups and run GRLR to the end
inside one task each (:func:`~xmc_spark.kernels.eagle.grlr_block`), then assign their groups'
labels there too.
A head label (more groups than that) would put too much on one task, so its (label, group)
segments are spread over tasks and each GRLR iteration is one Spark job: every task sums its
arg-max members per label (:func:`~xmc_spark.kernels.eagle.grlr_sums`), the driver adds the
parts and updates the head embeddings (O(heads x features)), broadcast to the next iteration.
Both paths compute the kernel's numbers on the whole data (identical where the float64 sums
of member rows are exact, as for unit rows of binary features; otherwise up to the order in
which a label's rows are added).

Modes (``eagle.mode``): ``baseline`` (every member gets all its group's labels), ``eagle0``
(T = 0), ``eagle`` (T = ``eagle.T``), ``soft`` (every member keeps the labels with weight
min(1, weight_scale * g * softmax(tau <x, e>))), ``joint`` (the same scores <x, e>, but all
labels of a group assigned at once: :func:`~xmc_spark.kernels.eagle.joint_weights`, in a second
job keyed by group, since the label-keyed tasks hold a label's groups, not a group's labels);
with counts, hard modes give a (group, label) of count c to its top-c members.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import pyarrow as pa
import scipy.sparse as sp
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_from_table, csr_rows_to_arrays, local_frame
from ..compat import default_parallelism, never_broadcast, partition_keys, share
from ..kernels.eagle import (
    Triples,
    assign,
    dedup_max,
    drift,
    grlr_block,
    grlr_sums,
    grlr_update,
    joint_weights,
    label_prevalence,
    path_scores,
    refine_assign,
    segment_carriers,
    segment_softmax,
)
from ..kernels.sparse import append_bias
from ..params import EagleParams
from ..progress import worker_progress
from ..schemas import EMBEDDING_SCHEMA
from .aggregated import AggregatedInput
from .evaluation import rows_per_label
from .node_training import lpt_ranks

log = logging.getLogger("xmc_spark.eagle")

OUT_SCHEMA = ("kind int, sample_id long, label_idx int, weight double, iter int, value double, "
              "emb_idx array<int>, emb_val array<float>, group_id long, count int")
SUMS_SCHEMA = "label_pos int, feature int, value double"
ASSIGN_KIND, OBJ_KIND, EMB_KIND, PROB_KIND = 0, 1, 2, 3
SCORE_KIND = 5          # joint mode: a (group, label, member) triple's score <x, e>, for the group job
# the re-assignment job: in, one row per (group, label, member) triple (no features) or per
# (group, member) (features, label null); out, assignments, triples with their p, task stats
REFINE_SCHEMA = ("kind int, group_id long, sample_id long, label_idx int, count int, p0 double, p double, "
                 "weight double, stats array<double>")
STAT_KIND = 4
_REFINE_ARROW = pa.schema([("kind", pa.int32()), ("group_id", pa.int64()), ("sample_id", pa.int64()),
                           ("label_idx", pa.int32()), ("count", pa.int32()), ("p0", pa.float64()),
                           ("p", pa.float64()), ("weight", pa.float64()), ("stats", pa.list_(pa.float64()))])


def _counts(t: pa.Table) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(the ``count`` column as int64 with nulls as 1, the mask of rows that had one), or
    (None, None) when no row has a count."""
    cc = t.column("count")
    if cc.null_count == t.num_rows:
        return None, None
    return cc.fill_null(1).to_numpy().astype(np.int64), cc.is_valid().to_numpy(zero_copy_only=False)


def _count_array(tr: Triples) -> Optional[pa.Array]:
    """The triples' counts (sorted order) as an int32 column, null where none was given, so that
    a later job tells counted (group, label)s from uncounted ones (``eagle.estimate_counts``)."""
    return None if tr.count is None else pa.array(tr.count.astype(np.int32), pa.int32(), mask=~tr.given)


def _triples_from_arrow(t: pa.Table, n_features: int, use_counts: bool, heads: Optional[np.ndarray] = None):
    """(Triples, X) of one task's rows: labels as local positions (or positions in ``heads``)."""
    lab = t.column("label_idx").to_numpy().astype(np.int64)
    if heads is None:
        ulab, lpos = np.unique(lab, return_inverse=True)
    else:
        ulab, lpos = heads, np.searchsorted(heads, lab)
    sid = t.column("sample_id").to_numpy().astype(np.int64)
    usid, first, rpos = np.unique(sid, return_index=True, return_inverse=True)
    X = csr_from_table(t.take(pa.array(first)), "feature_idx", "feature_val", n_features)
    cnt, given = _counts(t) if use_counts else (None, None)
    tr = Triples(lpos, t.column("group_id").to_numpy(), rpos, sid, len(ulab), label_ids=ulab, count=cnt, given=given)
    return tr, X, ulab


def _rows(kind, sample_id=None, label_idx=None, weight=None, it=None, value=None, emb=None, group_id=None,
          count=None) -> pa.Table:
    n = next(len(a) for a in (sample_id, label_idx, it) if a is not None)
    def col(a, typ):
        return pa.array(a, typ) if a is not None else pa.nulls(n, typ)
    emb_idx, emb_val = emb if emb is not None else (pa.nulls(n, pa.list_(pa.int32())),
                                                    pa.nulls(n, pa.list_(pa.float32())))
    return pa.table({"kind": pa.array(np.full(n, kind, np.int32)), "sample_id": col(sample_id, pa.int64()),
                     "label_idx": col(label_idx, pa.int32()), "weight": col(weight, pa.float64()),
                     "iter": col(it, pa.int32()), "value": col(value, pa.float64()),
                     "emb_idx": emb_idx, "emb_val": emb_val, "group_id": col(group_id, pa.int64()),
                     "count": col(count, pa.int32())})


def _assign_rows(tr, X, E, ulab, params: EagleParams) -> pa.Table:
    cnt = _count_array(tr)
    if params.mode == "joint":              # assigned per group by _joint_path
        return _rows(SCORE_KIND, sample_id=tr.sample_id, label_idx=ulab[tr.lab].astype(np.int32),
                     value=tr.scores(E, X), group_id=tr.grp, count=cnt)
    sid, lab, w = assign(tr, X, E, soft=params.mode == "soft", tau=params.tau, weight_scale=params.weight_scale)
    keep = w >= params.min_weight
    out = _rows(ASSIGN_KIND, sample_id=sid[keep], label_idx=ulab[lab[keep]].astype(np.int32), weight=w[keep])
    if params.refine_rounds == 0:
        return out
    # the first assignment's distribution over each (group, label)'s members: the refinement's anchor
    p0 = segment_softmax(tr.seg, tr.scores(E, X), params.tau)[0]
    return pa.concat_tables([out, _rows(PROB_KIND, sample_id=tr.sample_id, label_idx=ulab[tr.lab].astype(np.int32),
                                        value=p0, group_id=tr.grp, count=cnt)])


def _iterations(params: EagleParams) -> int:
    return 0 if params.mode == "eagle0" else params.T


def _label_buckets(spark, carried: np.ndarray, heads: np.ndarray, n_parts: int) -> DataFrame:
    """(label_idx, _bucket) for the labels of the block path (carried by a group, not heads):
    spread longest first (:func:`~xmc_spark.stages.node_training.lpt_ranks`) by their number
    of groups over ``n_parts`` partitions, with keys that ``repartition(n_parts, "_bucket")``
    sends to those partitions. A hash of the label put the 200K R-4 set's 8 buckets into 4
    coalesced tasks of 171K-807K triples (the largest ran 7.0 of the job's 11.9 s on 2 cores).
    O(labels) on the driver."""
    labels = np.setdiff1d(np.flatnonzero(carried), heads)
    keys = partition_keys(n_parts)[lpt_ranks(carried[labels], n_parts)] if len(labels) else labels
    return local_frame(spark, {"label_idx": pa.array(labels.astype(np.int32)),
                               "_bucket": pa.array(np.asarray(keys, np.int32))})


def _block_path(rows: DataFrame, n_features: int, params: EagleParams, buckets: DataFrame, n_buckets: int) -> DataFrame:
    """GRLR and the first assignment of the labels of ``buckets`` (:func:`_label_buckets`), one
    task per bucket."""
    T, eta = _iterations(params), params.eta

    def run_block(t: pa.Table) -> pa.Table:
        tr, X, ulab = _triples_from_arrow(t, n_features, params.use_counts)
        E, obj = grlr_block(tr, X, T, eta)
        idx, val = csr_rows_to_arrays(E)
        parts = [_assign_rows(tr, X, E, ulab, params),
                 _rows(OBJ_KIND, it=np.arange(T + 1, dtype=np.int32), value=obj.sum(axis=1)),
                 _rows(EMB_KIND, label_idx=ulab.astype(np.int32), emb=(idx, val))]
        worker_progress("eagle", labels=len(ulab), group_label_member_triples=t.num_rows)
        return pa.concat_tables(parts)

    # partition_keys: each bucket key is sent to a partition of its own, so a partition is a bucket
    return _by_key(rows.join(F.broadcast(buckets), "label_idx"), "_bucket", n_buckets, run_block, OUT_SCHEMA)


def _joint_path(scored: DataFrame, params: EagleParams, n_buckets: int, prevalence=None) -> DataFrame:
    """The joint assignment: the (group, label, member) scores grouped by a hash of the group
    into ``n_buckets`` tasks, each running :func:`~xmc_spark.kernels.eagle.joint_weights` on its
    whole groups. Rows as ``OUT_SCHEMA``: assignments (unique per (sample, label) within a
    task; a sample in groups of several tasks is deduplicated by the caller) and, with
    re-assignment rounds, each triple's p (the rounds' anchor p0). ``prevalence`` (shared, over
    the labels: ``eagle.estimate_counts``): a (group, label) without a count sums to its
    :func:`~xmc_spark.kernels.eagle.expected_carriers`, not 1."""
    def run_groups(t: pa.Table) -> pa.Table:
        lab = t.column("label_idx").to_numpy().astype(np.int64)
        ulab, lpos = np.unique(lab, return_inverse=True)
        sid = t.column("sample_id").to_numpy().astype(np.int64)
        _, rpos = np.unique(sid, return_inverse=True)
        cnt, given = _counts(t)
        tr = Triples(lpos, t.column("group_id").to_numpy(), rpos, sid, len(ulab), label_ids=ulab, count=cnt,
                     given=given)
        carriers = None if prevalence is None else segment_carriers(tr, prevalence.value)
        p, w = joint_weights(tr, t.column("value").to_numpy()[tr.order], params.joint_tau, params.joint_iters,
                             params.weight_scale, carriers)
        asid, alab, aw = dedup_max(tr.sample_id, tr.lab, w)
        keep = aw >= params.min_weight
        parts = [_rows(ASSIGN_KIND, sample_id=asid[keep], label_idx=ulab[alab[keep]].astype(np.int32),
                       weight=aw[keep])]
        if params.refine_rounds > 0:
            parts.append(_rows(PROB_KIND, sample_id=tr.sample_id, label_idx=ulab[tr.lab].astype(np.int32), value=p,
                               group_id=tr.grp, count=_count_array(tr)))
        worker_progress("eagle_joint", group_label_member_triples=t.num_rows)
        return pa.concat_tables(parts)

    return _by_key(scored.select("group_id", "sample_id", "label_idx", "count", "value"), "group_id", n_buckets,
                   run_groups, OUT_SCHEMA)


def _partition_table(batches) -> Optional[pa.Table]:
    """A whole partition as one Arrow table (segments must not be cut at batch ends)."""
    bl = [b for b in batches if b.num_rows]
    return pa.Table.from_batches(bl) if bl else None


def _by_key(rows: DataFrame, key: str, n_parts: int, func: Callable[[pa.Table], pa.Table], schema: str) -> DataFrame:
    """``func`` on each of ``n_parts`` hash partitions of ``rows`` by ``key``, as one Arrow table
    (every row of a key value in one): exactly ``n_parts`` tasks, which adaptive execution does
    not coalesce into fewer, uneven ones (grouping 8 hashed buckets gave 4 tasks of 109K-319K
    triples in delicious R-4's re-assignment), and no sort by the key."""
    def run(batches):
        t = _partition_table(batches)
        if t is not None:
            yield from func(t).to_batches()

    return rows.repartition(n_parts, key).mapInArrow(run, schema)


def task_count(spark, n_pairs: int, n_buckets: int) -> int:
    """The tasks of EAGLE's label- and group-keyed jobs: ``n_buckets`` (the shuffle partitions),
    fewer where the (group, label) pairs would leave a task under ~25K of them (these jobs are
    never coalesced by adaptive execution), but never under the default parallelism."""
    par = default_parallelism(spark)
    return int(max(1, min(n_buckets, max(par, -(-n_pairs // 25_000)))))


def _head_path(rows: DataFrame, heads: np.ndarray, n_features: int, params: EagleParams,
               n_chunks: int) -> Tuple[DataFrame, np.ndarray, sp.csr_matrix]:
    """GRLR for head labels with one Spark job per iteration; returns (assignment/objective
    rows, objective per iteration, E)."""
    spark = rows.sparkSession
    T, eta = _iterations(params), params.eta
    # every (label, group) segment whole in one partition; partitions materialized once
    parts = (rows.withColumn("_chunk", F.pmod(F.xxhash64("label_idx", "group_id"), F.lit(n_chunks)))
             .repartition(n_chunks, "_chunk").drop("_chunk").localCheckpoint())
    bheads = share(spark, heads, name="the head labels")
    E = None
    objs = []
    for t in range(T + 1):
        bE = share(spark, E, name="the head label embeddings E")

        def sums(batches, bE=bE):
            tb = _partition_table(batches)
            if tb is None:
                return
            tr, X, _ = _triples_from_arrow(tb, n_features, False, bheads.value)
            G, obj = grlr_sums(tr, X, bE.value)
            G = G.tocoo()
            lp = np.concatenate([G.row, np.arange(len(obj))]).astype(np.int32)
            ft = np.concatenate([G.col, np.full(len(obj), -1)]).astype(np.int32)
            yield pa.RecordBatch.from_pydict({"label_pos": lp, "feature": ft,
                                              "value": np.concatenate([G.data, obj]).astype(np.float64)})

        agg = (parts.mapInArrow(sums, SUMS_SCHEMA).groupBy("label_pos", "feature")
               .agg(F.sum("value").alias("value")).toPandas())
        bE.unpersist()
        g = agg[agg["feature"] >= 0]
        G = sp.csr_matrix((g["value"].to_numpy(), (g["label_pos"].to_numpy(), g["feature"].to_numpy())),
                          shape=(len(heads), n_features))
        if t > 0:
            o = agg[agg["feature"] < 0]
            objs.append(float(o["value"].sum()))
        E = grlr_update(E, G, eta)
        log.info("EAGLE head labels: iteration %d/%d done (%d labels)", t, T, len(heads))
    bE = share(spark, E, name="the head label embeddings E")

    def final(batches, bE=bE):
        tb = _partition_table(batches)
        if tb is None:
            return
        tr, X, ulab = _triples_from_arrow(tb, n_features, params.use_counts, bheads.value)
        _, obj = grlr_sums(tr, X, bE.value)
        out = pa.concat_tables([_assign_rows(tr, X, bE.value, ulab, params),
                                _rows(OBJ_KIND, it=np.array([T], np.int32), value=np.array([obj.sum()]))])
        yield from out.to_batches()

    return parts.mapInArrow(final, OUT_SCHEMA), np.array(objs), E


def run(agg: AggregatedInput, params: EagleParams, n_buckets: int = 8, train_model=None,
        carried: Optional[np.ndarray] = None):
    """(training table, info, label embeddings table or None, assigned pairs) from aggregated
    input; the assigned (sample_id, label_idx, weight) pairs are checkpointed, for
    :func:`diagnostics`.

    The training table has the samples schema plus ``label_weight`` (array<float> aligned with
    ``label_idx``); every input sample is in it (those that got no label with empty lists).
    ``carried``: :func:`groups_per_label`, when the caller has it.
    """
    spark = agg.samples.sparkSession
    n_features = agg.info.n_features
    triples = agg.group_labels.join(agg.groups, "group_id")
    info: Dict = {"eagle.mode": params.mode}
    n_tasks = task_count(spark, agg.stats["n_group_label_pairs"], n_buckets)
    emb_df = prev = None
    recount = params.mode in ("baseline", "joint")     # pairs merged after the GRLR tasks: count them again
    if params.estimate_counts and params.mode != "joint":
        log.warning("eagle.estimate_counts applies to eagle.mode=joint only; ignored with mode %s", params.mode)
    if params.mode == "baseline":
        assigned = triples.select("sample_id", "label_idx", F.lit(1.0).alias("weight")).distinct()
    else:
        feats = agg.samples.select("sample_id", "feature_idx", "feature_val")
        # auto: a label with more groups than one task's share of the pairs (the tasks the block path runs)
        head_groups = params.head_groups or max(1, -(-agg.stats["n_group_label_pairs"] // n_tasks))
        if carried is None:                         # O(labels): the head labels, and the prevalence
            carried = groups_per_label(agg)
        heads = np.flatnonzero(carried > head_groups).astype(np.int64)
        info["eagle.head_groups"] = int(head_groups)
        info["eagle.head_labels"] = len(heads)
        T = _iterations(params)
        if len(heads):
            hl = local_frame(spark, {"label_idx": pa.array(heads.astype(np.int32))})
            # split the narrow triples first, so each feature join runs once on its part
            body = triples.join(F.broadcast(hl), "label_idx", "left_anti").join(feats, "sample_id")
            head_rows = triples.join(F.broadcast(hl), "label_idx").join(feats, "sample_id")
            n_chunks = max(n_tasks, int(np.ceil(carried[heads].sum() / head_groups)))
            hout, hobj, E = _head_path(head_rows, heads, n_features, params, n_chunks)
            idx, val = csr_rows_to_arrays(E)
            head_emb = spark.createDataFrame(
                pa.table({"label_idx": pa.array(heads.astype(np.int32)), "emb_idx": idx, "emb_val": val}).to_pandas(),
                EMBEDDING_SCHEMA)
        else:
            body, hout, hobj, head_emb = triples.join(feats, "sample_id"), None, np.zeros(T), None
        out = _block_path(body, n_features, params, _label_buckets(spark, carried, heads, n_tasks), n_tasks)
        if hout is not None:
            out = out.unionByName(hout)
        out = out.localCheckpoint()                     # one evaluation of every GRLR
        # one small job: the objective per iteration and the assignment counts
        summary = out.filter(F.col("kind").isin(ASSIGN_KIND, OBJ_KIND)).groupBy("kind", "iter").agg(
            F.count(F.lit(1)).alias("n"), F.sum("weight").alias("w"), F.sum("value").alias("v")).collect()
        trace = np.zeros(T + 1)
        for r in summary:
            if r["kind"] == OBJ_KIND:
                trace[int(r["iter"])] += float(r["v"])
            else:
                info["eagle.assigned_pairs"] = int(r["n"])
                info["eagle.assigned_weight"] = round(float(r["w"] or 0.0), 4)
        trace[:T] += hobj[:T]
        info["eagle.objective"] = [round(float(v), 6) for v in trace]
        assigned = out.filter(F.col("kind") == ASSIGN_KIND).select("sample_id", "label_idx", "weight")
        if len(heads):      # a head label's chunks split its groups: a sample in two of them, in two chunks
            assigned = assigned.groupBy("sample_id", "label_idx").agg(F.max("weight").alias("weight"))
            recount = True
        probs = out
        if params.mode == "joint":
            if params.estimate_counts:
                p_lab = _prevalence(agg, carried)
                info["eagle.estimated_prevalence_max"] = round(float(p_lab.max(initial=0.0)), 6)
                prev = share(spark, p_lab, name="the labels' estimated prevalence")
            probs = _joint_path(out.filter(F.col("kind") == SCORE_KIND), params, n_tasks, prev).localCheckpoint()
            assigned = (probs.filter(F.col("kind") == ASSIGN_KIND).groupBy("sample_id", "label_idx")
                        .agg(F.max("weight").alias("weight")))
        emb_df = out.filter(F.col("kind") == EMB_KIND).select(
            "label_idx", F.col("emb_idx"), F.col("emb_val"))
        if head_emb is not None:
            emb_df = emb_df.unionByName(head_emb)
        log.info("EAGLE (%s, T=%d): objective %s", params.mode, T, info["eagle.objective"])
    if recount:
        assigned = assigned.localCheckpoint()
        s = assigned.agg(F.count(F.lit(1)).alias("n"), F.sum("weight").alias("w")).first()
        info.update({"eagle.assigned_pairs": int(s["n"]), "eagle.assigned_weight": round(float(s["w"] or 0.0), 4)})
    if params.refine_rounds > 0:
        if train_model is None:
            raise ValueError("eagle.refine_rounds > 0 needs a train_model function")
        if params.mode == "baseline":        # the anchor: every member equally likely
            size = agg.groups.groupBy("group_id").agg(F.count(F.lit(1)).alias("_g"))
            anchor = triples.join(size, "group_id").select(
                "group_id", "sample_id", "label_idx", F.col("count").cast("int").alias("count"),
                (1.0 / F.col("_g")).alias("p0"))
        else:
            anchor = probs.filter(F.col("kind") == PROB_KIND).select(
                "group_id", "sample_id", "label_idx", "count", F.col("value").alias("p0"))
        if not params.use_counts:
            anchor = anchor.withColumn("count", F.lit(None).cast("int"))
        assigned = refine(agg, anchor, assigned, params, train_model, n_tasks, info, prev)
    if prev is not None:               # every job that reads it has run (the assignments are checkpointed)
        prev.unpersist()
    return training_table(agg.samples, assigned), info, emb_df, assigned


def groups_per_label(agg: AggregatedInput) -> np.ndarray:
    """The number of groups carrying each label ((group, label) pairs are unique)."""
    return rows_per_label(agg.group_labels, agg.info.n_labels)


def _prevalence(agg: AggregatedInput, carried: np.ndarray) -> np.ndarray:
    """:func:`~xmc_spark.kernels.eagle.label_prevalence` of every label (n_labels floats) from
    ``carried`` (:func:`groups_per_label`), the labelled groups' number (``agg.stats``) and one
    more small job: their total size in membership rows (a sample in two groups counts in both)."""
    n_groups = agg.stats["n_groups"] - agg.stats["n_groups_without_labels"]
    members = agg.groups.join(agg.group_labels.select("group_id").distinct(), "group_id").count()
    return label_prevalence(carried, n_groups, members / max(n_groups, 1))


def training_table(samples: DataFrame, assigned: DataFrame) -> DataFrame:
    """The samples with their assigned (label, weight) pairs as ``label_idx`` / ``label_weight``
    (sorted by label); samples without a pair get empty lists."""
    per_sample = assigned.groupBy("sample_id").agg(
        F.sort_array(F.collect_list(F.struct("label_idx", "weight"))).alias("_lw"))
    return samples.join(never_broadcast(per_sample), "sample_id", "left").select(
        "sample_id", "feature_idx", "feature_val",
        F.coalesce(F.transform("_lw", lambda x: x["label_idx"]), F.array().cast("array<int>")).alias("label_idx"),
        "weight",
        F.coalesce(F.transform("_lw", lambda x: x["weight"].cast("float")),
                   F.array().cast("array<float>")).alias("label_weight"))


# called with (round, model) for every model trained inside the stage (round r's model is
# trained on the assignment after r re-assignments): lets a benchmark score each round's model
# on held-out groups without a run per round count. None in the pipeline.
ROUND_MODEL_HOOK: Optional[Callable] = None


def _refine_block(t: pa.Table, bmodel, params: EagleParams, prevalence=None, keep_probs: bool = True) -> pa.Table:
    """One task of a re-assignment: whole groups, their triples and their members' features
    (``prevalence``: the joint mode's estimated carriers, as in :func:`_joint_path`); the
    triples' p rows only with ``keep_probs`` (the last round has no next one to anchor)."""
    tree, bias, post, n_features = bmodel.value
    is_mem = t.column("label_idx").is_null().to_numpy(zero_copy_only=False)
    mem = t.filter(pa.array(is_mem))
    tri = t.filter(pa.array(~is_mem))
    if tri.num_rows == 0:
        return _REFINE_ARROW.empty_table()
    msid = mem.column("sample_id").to_numpy()
    usid, first = np.unique(msid, return_index=True)
    X = csr_from_table(mem.take(pa.array(first)), "feature_idx", "feature_val", n_features)
    sid = tri.column("sample_id").to_numpy().astype(np.int64)
    lab = tri.column("label_idx").to_numpy().astype(np.int64)
    ulab, lpos = np.unique(lab, return_inverse=True)
    cnt, given = _counts(tri)
    tr = Triples(lpos, tri.column("group_id").to_numpy(), np.searchsorted(usid, sid), sid, len(ulab),
                 label_ids=ulab, count=cnt, given=given)
    p0 = tri.column("p0").to_numpy()[tr.order]
    prev = tri.column("p_prev")
    p_prev = p0 if prev.null_count == tri.num_rows else prev.to_numpy(zero_copy_only=False)[tr.order]
    s = path_scores(tree, append_bias(X, bias), tr.row, ulab[tr.lab], post)
    joint = params.mode == "joint"
    carriers = None if prevalence is None or not joint else segment_carriers(tr, prevalence.value)
    # refine_min_weight drops a (group, label)'s light extra members, never its best one (a joint
    # weight min(1, c p) can fall below it for every member of a large group); min_weight applies to all
    (asid, alab, w), p = refine_assign(tr, s, p0, params.refine_tau, params.refine_mix,
                                       params.mode in ("soft", "joint"), params.weight_scale, params.refine_weights,
                                       joint_iters=params.joint_iters if joint else None, carriers=carriers,
                                       bound=max(params.min_weight, params.refine_min_weight),
                                       floor=params.min_weight)
    tv0, ch0 = drift(tr, p, p0)
    tv1, ch1 = drift(tr, p, p_prev)
    stats = [float(len(tr.seg) - 1), tv0, float(ch0), tv1, float(ch1)]
    worker_progress("eagle_refine", group_label_member_triples=tri.num_rows)
    n_a = len(w)
    tp = slice(None) if keep_probs else slice(0, 0)     # the last round: no triples' p for a next one
    n_t = len(p[tp])
    i32, i64 = pa.int32(), pa.int64()
    cnt_t = pa.nulls(n_t, i32) if cnt is None else _count_array(tr)[tp]
    return pa.table({
        "kind": pa.array(np.concatenate([np.full(n_a, ASSIGN_KIND), np.full(n_t, PROB_KIND), [STAT_KIND]]), i32),
        "group_id": pa.concat_arrays([pa.nulls(n_a, i64), pa.array(tr.grp[tp], i64), pa.nulls(1, i64)]),
        "sample_id": pa.array(np.concatenate([asid, tr.sample_id[tp], [0]]), i64),
        "label_idx": pa.array(np.concatenate([ulab[alab], ulab[tr.lab][tp], [0]]), i32),
        "count": pa.concat_arrays([pa.nulls(n_a, i32), cnt_t, pa.nulls(1, i32)]),
        "p0": pa.concat_arrays([pa.nulls(n_a, pa.float64()), pa.array(p0[tp], pa.float64()),
                                pa.nulls(1, pa.float64())]),
        "p": pa.concat_arrays([pa.nulls(n_a, pa.float64()), pa.array(p[tp], pa.float64()), pa.nulls(1, pa.float64())]),
        "weight": pa.array(np.concatenate([w, np.full(n_t + 1, np.nan)]), pa.float64()),
        "stats": pa.array([None] * (n_a + n_t) + [stats], pa.list_(pa.float64())),
    })


def score_round(agg: AggregatedInput, anchor: DataFrame, model, params: EagleParams, n_buckets: int,
                prevalence=None, keep_probs: bool = True) -> DataFrame:
    """One re-assignment as a Spark job: ``anchor`` (group_id, sample_id, label_idx, count, p0,
    optional p_prev) and each labelled group's members' features, grouped by a hash of the
    group into ``n_buckets`` tasks; each task scores its triples with the model's path
    scores (:func:`~xmc_spark.kernels.eagle.path_scores`) and re-assigns
    (:func:`~xmc_spark.kernels.eagle.refine_assign`). Rows as ``REFINE_SCHEMA``; the triples'
    p (the next round's anchor) only with ``keep_probs``."""
    if not hasattr(model, "tree_arrays"):
        from ..params import ConfigError
        raise ConfigError("eagle.refine_rounds needs a model whose weights fit predict.max_broadcast_mb "
                          "(the re-assignment shares the whole model with the tasks)")
    bmodel = share(anchor, (model.tree_arrays(), model.bias, model.pred_params.post_processor, model.n_features),
                   name="the EAGLE refinement model")
    if "p_prev" not in anchor.columns:
        anchor = anchor.withColumn("p_prev", F.lit(None).cast("double"))
    labelled = anchor.select("group_id").distinct()
    members = agg.groups.join(labelled, "group_id").join(
        agg.samples.select("sample_id", "feature_idx", "feature_val"), "sample_id")
    nulls = {"label_idx": "int", "count": "int", "p0": "double", "p_prev": "double"}
    # the triples' feature columns are empty arrays, not nulls: Spark's Arrow transfer of a null
    # array column to Python took ~10 us a row (delicious R-4: ~1 s of each 1.5 s task; empty: ~0.1 s)
    rows = anchor.select("group_id", "sample_id", "label_idx", "count", "p0", "p_prev",
                         F.array().cast("array<int>").alias("feature_idx"),
                         F.array().cast("array<float>").alias("feature_val")).unionByName(
        members.select("group_id", "sample_id", *[F.lit(None).cast(t).alias(c) for c, t in nulls.items()],
                       "feature_idx", "feature_val"))
    return _by_key(rows, "group_id", n_buckets, lambda t: _refine_block(t, bmodel, params, prevalence, keep_probs),
                   REFINE_SCHEMA)


def refine(agg: AggregatedInput, anchor: DataFrame, assigned: DataFrame, params: EagleParams, train_model,
           n_buckets: int, info: Dict, prevalence=None) -> DataFrame:
    """``eagle.refine_rounds`` rounds of: train a model on the current assignment
    (``train_model(training table, label_counts=, n_samples=) -> model``), score every member of every group on the
    group's labels with it, re-assign (mixing with the anchor's distribution p0). Facts per
    round (lists, round 0 = the first assignment): seconds, assigned pairs and weight, drift
    (mean total variation between a (group, label)'s distribution and p0, and from the round
    before; share of (group, label)s whose top member changed) and, with truth, pair precision
    / recall / weighted precision. ``prevalence`` (shared; joint with ``eagle.estimate_counts``):
    the joint re-assignment's carriers, as the first assignment's. Returns the last assignment
    (sample_id, label_idx, weight)."""
    per_round = {k: [] for k in ("seconds", "assigned_pairs", "assigned_weight", "drift_tv", "drift_top_changed",
                                 "change_tv", "change_top_changed", "pair_precision", "pair_recall",
                                 "pair_weighted_precision")}
    diag_seconds = 0.0

    def record(assigned):
        nonlocal diag_seconds
        if agg.truth is not None:
            t0 = time.perf_counter()
            d = diagnostics(assigned, agg.truth)
            for k in ("pair_precision", "pair_recall", "pair_weighted_precision"):
                per_round[k].append(d["eagle." + k])
            diag_seconds += time.perf_counter() - t0

    record(assigned)
    for r in range(1, params.refine_rounds + 1):
        t0 = time.perf_counter()
        train_df = training_table(agg.samples, assigned).localCheckpoint()
        # the training rows per label (one pair per (sample, label): O(labels) to the driver) place
        # the trainer's units on its tasks by their work, as the train stage's counts do; without
        # them a 200K round put its heaviest unit (13 s) last, one core idle ~10 s of a 28 s job
        model = train_model(train_df, label_counts=rows_per_label(assigned, agg.info.n_labels),
                            n_samples=agg.info.n_samples)
        if ROUND_MODEL_HOOK is not None:
            ROUND_MODEL_HOOK(r - 1, model)
        t_model = time.perf_counter() - t0
        out = score_round(agg, anchor, model, params, n_buckets, prevalence,
                          keep_probs=r < params.refine_rounds).localCheckpoint()
        st = np.zeros(5)
        for row in out.filter(F.col("kind") == STAT_KIND).select("stats").collect():
            st += np.asarray(row["stats"])
        assigned = (out.filter(F.col("kind") == ASSIGN_KIND).groupBy("sample_id", "label_idx")
                    .agg(F.max("weight").alias("weight")).localCheckpoint())
        s = assigned.agg(F.count(F.lit(1)).alias("n"), F.sum("weight").alias("w")).first()
        anchor = out.filter(F.col("kind") == PROB_KIND).select(
            "group_id", "sample_id", "label_idx", "count", "p0", F.col("p").alias("p_prev"))
        n_seg = max(st[0], 1.0)
        per_round["seconds"].append(round(time.perf_counter() - t0, 3))
        per_round["assigned_pairs"].append(int(s["n"]))
        per_round["assigned_weight"].append(round(float(s["w"] or 0.0), 4))
        per_round["drift_tv"].append(round(float(st[1] / n_seg), 6))
        per_round["drift_top_changed"].append(round(float(100 * st[2] / n_seg), 4))
        per_round["change_tv"].append(round(float(st[3] / n_seg), 6))
        per_round["change_top_changed"].append(round(float(100 * st[4] / n_seg), 4))
        log.info("EAGLE re-assignment round %d/%d: %.1f s (model %.1f s), drift from the first assignment "
                 "TV %.4f (top member changed in %.2f%% of (group, label)s)", r, params.refine_rounds,
                 per_round["seconds"][-1], t_model, per_round["drift_tv"][-1], per_round["drift_top_changed"][-1])
        record(assigned)
    info.update({f"eagle.refine.{k}": v for k, v in per_round.items() if v})
    info["eagle.refine.diagnostics_seconds"] = round(diag_seconds, 3)
    info["eagle.assigned_pairs"] = per_round["assigned_pairs"][-1]
    info["eagle.assigned_weight"] = per_round["assigned_weight"][-1]
    return assigned


def diagnostics(assigned: DataFrame, truth: DataFrame) -> Dict[str, float]:
    """Precision and recall (percent) of the assigned (sample, label) pairs against the true
    per-sample labels; weighted precision counts each pair with its weight."""
    t = truth.select("sample_id", F.explode("label_idx").alias("label_idx")).withColumn("_true", F.lit(1))
    j = assigned.join(t, ["sample_id", "label_idx"], "full_outer")
    r = j.agg(
        F.sum(F.when(F.col("weight").isNotNull(), 1).otherwise(0)).alias("n_assigned"),
        F.sum(F.coalesce("weight", F.lit(0.0))).alias("w_assigned"),
        F.sum(F.when(F.col("weight").isNotNull() & F.col("_true").isNotNull(), 1).otherwise(0)).alias("n_correct"),
        F.sum(F.when(F.col("_true").isNotNull(), F.coalesce("weight", F.lit(0.0))).otherwise(0.0)).alias("w_correct"),
        F.sum(F.when(F.col("_true").isNotNull(), 1).otherwise(0)).alias("n_true")).first()
    na, nt = max(r["n_assigned"] or 0, 1), max(r["n_true"] or 0, 1)
    return {"eagle.pair_precision": round(100.0 * (r["n_correct"] or 0) / na, 4),
            "eagle.pair_recall": round(100.0 * (r["n_correct"] or 0) / nt, 4),
            "eagle.pair_weighted_precision": round(100.0 * (r["w_correct"] or 0) / max(r["w_assigned"] or 0, 1e-12), 4),
            "eagle.true_pairs": int(r["n_true"] or 0)}
