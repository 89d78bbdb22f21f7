"""Aggregated (group-level) labelled input: reading, validation, and ``make-groups``.

An aggregated data set is a folder:

- ``samples``: the samples (features; any labels in it are ignored for training), as a
  Delta/Parquet table, or ``samples.txt`` in XC/svmlight text format;
- ``groups`` + ``group_labels`` tables: membership (``group_id``, ``sample_id``; a sample may
  be in several groups) and the labels of each group (``group_id``, ``label_idx``, optional
  ``count`` = how many members carry the label, when the source merged lists, not sets);
  or one text file ``groups.txt``: line i (from 0) is group i, written
  ``LABELS MEMBERS`` with LABELS a comma list of ``label`` or ``label:count`` (empty for a
  group without labels: the line starts with a space) and MEMBERS the space-separated
  sample ids (the 0-based data line of ``samples.txt``), e.g. ``3,17:2 0 5 9``;
- optional ``truth`` table (``sample_id``, ``label_idx``): the true per-sample labels, for
  the assignment diagnostics only; optional ``info.json`` (``n_labels``, ``n_features``).

Handling: a group with labels but no members, a member id that is not a sample, a negative
or out-of-range label, a count < 1, a malformed line, or a duplicate (group, sample) row stop
with an error naming the file or table and the line or group; nothing is written. A group
with members but no labels, and a sample in no group, are kept and counted
(``n_groups_without_labels``, ``n_samples_without_group`` in metrics.json): such samples are
unlabelled training samples (negatives at the root).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from ..arrow_utils import local_frame
from ..params import IngestParams
from ..schemas import IngestError
from ..storage import list_names, path_kind, write_delta
from . import ingest

log = logging.getLogger("xmc_spark.aggregated")


@dataclass
class AggregatedInput:
    samples: DataFrame           # samples schema; label_idx emptied
    groups: DataFrame            # group_id long, sample_id long
    group_labels: DataFrame      # group_id long, label_idx int, count int (null = no count)
    truth: Optional[DataFrame]   # sample_id long, label_idx array<int>
    info: ingest.DatasetInfo
    stats: dict


def _table(spark: SparkSession, path: str) -> Optional[DataFrame]:
    names = list_names(spark, path)
    if "_delta_log" in names:
        return spark.read.format("delta").load(str(path))
    if any(n.endswith(".parquet") for n in names):
        return spark.read.parquet(str(path))
    return None


def is_aggregated(spark: SparkSession, path: str) -> bool:
    """A folder holding ``groups.txt`` or a ``groups`` table (local or remote: Hadoop's file system)."""
    names = list_names(spark, path)
    return "groups.txt" in names or ("groups" in names and path_kind(spark, f"{path.rstrip('/')}/groups") == "dir")


def read_groups_text(spark: SparkSession, path: str):
    """(groups, group_labels) from a ``groups.txt`` file; errors name the line."""
    raw = ingest.text_lines(spark, path)
    toks = raw.withColumn("_t", F.split(F.col("value"), " "))
    toks = toks.withColumn("_lab", F.col("_t")[0]).withColumn(
        "_mem", F.filter(F.slice(F.col("_t"), 2, 1 << 30), lambda x: x != ""))
    lab_items = F.filter(F.split("_lab", ","), lambda x: x != "")
    isint = lambda c: c.rlike(r"^[0-9]+$")  # noqa: E731
    err = (F.when(F.size("_mem") == 0, F.lit("empty group: no member sample ids"))
           .when(~F.forall("_mem", isint), F.concat(F.lit("member id is not a non-negative integer: "),
                                                   F.element_at(F.filter("_mem", lambda x: ~isint(x)), 1)))
           .when(~F.forall(lab_items, lambda x: x.rlike(r"^[0-9]+(:[0-9]+)?$")),
                 F.concat(F.lit("label is not 'label' or 'label:count' with non-negative integers: "),
                          F.element_at(F.filter(lab_items, lambda x: ~x.rlike(r"^[0-9]+(:[0-9]+)?$")), 1)))
           .when(F.exists(lab_items, lambda x: x.rlike(r":0+$")), F.lit("label count must be >= 1")))
    checked = toks.withColumn("_err", err).withColumn("_items", lab_items)
    lines = ingest.Lines(checked, ingest.one_split(spark, path), err=ingest.first_where("_err IS NOT NULL", "_err"))
    bad = lines.first("err")
    if bad is not None:
        raise IngestError(f"{path}:{bad[0]}: {bad[1]}")
    if lines.n == 0:
        raise IngestError(f"{path}: no groups (the file is empty)")
    gid = (lines.line() - 1).cast("long").alias("group_id")
    groups = checked.select(gid, F.explode("_mem").alias("m")).select(
        "group_id", F.col("m").cast("long").alias("sample_id"))
    labels = checked.select(gid, F.explode("_items").alias("it")).select(
        "group_id", F.split("it", ":")[0].cast("int").alias("label_idx"),
        F.when(F.size(F.split("it", ":")) > 1, F.element_at(F.split("it", ":"), 2)).cast("int").alias("count"))
    return groups, labels


def _check_tables(groups: DataFrame, group_labels: DataFrame, where: str):
    gf = {f.name for f in groups.schema.fields}
    lf = {f.name for f in group_labels.schema.fields}
    if not {"group_id", "sample_id"} <= gf:
        raise IngestError(f"{where}/groups: wrong schema: need columns group_id, sample_id (found {sorted(gf)})")
    if not {"group_id", "label_idx"} <= lf:
        raise IngestError(f"{where}/group_labels: wrong schema: need columns group_id, label_idx[, count] "
                          f"(found {sorted(lf)})")
    groups = groups.select(F.col("group_id").cast("long"), F.col("sample_id").cast("long"))
    count = F.col("count").cast("int") if "count" in lf else F.lit(None).cast("int")
    group_labels = group_labels.select(F.col("group_id").cast("long"), F.col("label_idx").cast("int"),
                                       count.alias("count"))
    return groups, group_labels


def read(spark: SparkSession, path: str, params: IngestParams) -> AggregatedInput:
    """Read and validate an aggregated folder (see the module docstring)."""
    p = path.rstrip("/")
    names = set(list_names(spark, p))
    meta = {}
    if "info.json" in names:          # any file system: read through Spark (a small file)
        meta = json.loads("\n".join(r[0] for r in spark.read.text(f"{p}/info.json").collect()))
    if "groups.txt" in names:
        sfile = next((f"{p}/{n}" for n in ("samples.txt", "samples.svm", "samples") if n in names), None)
        if sfile is None:
            raise IngestError(f"{p}: aggregated input without samples (samples.txt or a samples table)")
        groups, group_labels = read_groups_text(spark, f"{p}/groups.txt")
        where_g = where_l = f"{p}/groups.txt"
    else:
        g, gl = _table(spark, f"{p}/groups"), _table(spark, f"{p}/group_labels")
        if g is None or gl is None:
            raise IngestError(f"{p}: aggregated input needs both 'groups' and 'group_labels' tables")
        groups, group_labels = _check_tables(g, gl, p)
        sfile = f"{p}/samples"
        where_g, where_l = f"{p}/groups", f"{p}/group_labels"
    iparams = IngestParams(**{**params.to_dict(), "num_labels": params.num_labels or int(meta.get("n_labels", 0)),
                              "num_features": params.num_features or int(meta.get("n_features", 0))})
    samples, info = ingest.read_samples(spark, sfile, iparams)
    samples = samples.cache()
    truth_t = _table(spark, f"{p}/truth") if "truth" in names else None
    truth = None if truth_t is None else truth_t.select(F.col("sample_id").cast("long"),
                                                        F.col("label_idx").cast("array<int>"))

    # one job over the labels: range, counts, groups with labels but no members
    members = groups.groupBy("group_id").agg(F.count(F.lit(1)).alias("m"))
    lab_stats = group_labels.join(members, "group_id", "left").agg(
        F.max("label_idx").alias("max_label"),
        F.min(F.when(F.col("label_idx") < 0, F.struct("group_id", "label_idx"))).alias("neg"),
        F.min(F.when(F.col("count") < 1, F.struct("group_id", "label_idx", "count"))).alias("badcount"),
        F.min(F.when(F.col("m").isNull(), F.col("group_id"))).alias("empty"),
        F.countDistinct("group_id", "label_idx").alias("n_distinct"),
        F.count(F.lit(1)).alias("n_pairs")).first()
    if lab_stats["neg"] is not None:
        raise IngestError(f"{where_l}: group_id {lab_stats['neg']['group_id']}: negative label "
                          f"{lab_stats['neg']['label_idx']}")
    if lab_stats["badcount"] is not None:
        b = lab_stats["badcount"]
        raise IngestError(f"{where_l}: group_id {b['group_id']}, label {b['label_idx']}: count {b['count']} < 1")
    if lab_stats["empty"] is not None:
        raise IngestError(f"{where_l}: group_id {lab_stats['empty']} has labels but no members in {where_g}")
    if lab_stats["n_distinct"] != lab_stats["n_pairs"]:
        d = group_labels.groupBy("group_id", "label_idx").count().filter("count > 1").orderBy(
            "group_id", "label_idx").first()
        raise IngestError(f"{where_l}: group_id {d['group_id']}: label {d['label_idx']} listed {d['count']} times "
                          "(give it once, with a count)")
    L = info.n_labels
    max_label = lab_stats["max_label"]
    if max_label is not None and max_label >= L:
        if params.num_labels or meta.get("n_labels"):
            bad = group_labels.filter(F.col("label_idx") >= L).orderBy("group_id").first()
            raise IngestError(f"{where_l}: group_id {bad['group_id']}: label {bad['label_idx']} out of range [0, {L})")
        L = int(max_label) + 1
    # membership: unknown samples, duplicates
    mem_stats = groups.join(samples.select("sample_id", F.lit(True).alias("_known")), "sample_id", "left").agg(
        F.min(F.when(F.col("_known").isNull(), F.struct("group_id", "sample_id"))).alias("unknown"),
        F.count(F.lit(1)).alias("n_rows"),
        F.countDistinct("group_id", "sample_id").alias("n_distinct"),
        F.countDistinct("group_id").alias("n_groups"),
        F.countDistinct("sample_id").alias("n_in_groups")).first()
    if mem_stats["unknown"] is not None:
        u = mem_stats["unknown"]
        raise IngestError(f"{where_g}: group_id {u['group_id']}: sample_id {u['sample_id']} is not in the samples "
                          f"({sfile})")
    if mem_stats["n_distinct"] != mem_stats["n_rows"]:
        d = groups.groupBy("group_id", "sample_id").count().filter("count > 1").orderBy("group_id").first()
        raise IngestError(f"{where_g}: group_id {d['group_id']}: sample_id {d['sample_id']} listed {d['count']} times")
    labelled = group_labels.select("group_id").distinct().count()
    stats = {"n_groups": int(mem_stats["n_groups"]), "n_group_label_pairs": int(lab_stats["n_pairs"]),
             "n_groups_without_labels": int(mem_stats["n_groups"]) - int(labelled),
             "n_samples_without_group": int(info.n_samples) - int(mem_stats["n_in_groups"])}
    log.info("aggregated input %s: %d samples, %d groups, %s", path, info.n_samples, stats["n_groups"], stats)
    info = dataclasses.replace(info, path=path, fmt="aggregated/" + info.fmt, n_labels=L)
    samples = samples.withColumn("label_idx", F.array().cast("array<int>"))
    return AggregatedInput(samples, groups, group_labels, truth, info, stats)


# ---- make-groups -------------------------------------------------------------------------------
def random_groups(samples: DataFrame, group_size: int, seed: int) -> DataFrame:
    """(group_id, sample_id): samples ranked by a seeded hash, cut into runs of ``group_size``
    (the last group holds the remainder). Every sample is in exactly one group."""
    ranked = samples.select("sample_id").orderBy(F.xxhash64("sample_id", F.lit(seed)), "sample_id")
    indexed = with_row_index(ranked, "_i")
    return indexed.select(F.floor(F.col("_i") / group_size).cast("long").alias("group_id"),
                          F.col("sample_id").cast("long"))


def with_row_index(df: DataFrame, name: str) -> DataFrame:
    """``df`` with column ``name`` = 0..n-1 in the frame's order (partition by partition, rows
    in order): the DataFrame equivalent of ``RDD.zipWithIndex`` (no RDD: Spark Connect has none).

    One job counts the rows of each partition (O(partitions) rows to the driver); the index is
    then the partition's offset plus the row's place in it, the low 33 bits of
    ``monotonically_increasing_id`` (its documented layout). The tagged rows are checkpointed
    on the executors (``localCheckpoint``: O(rows) there, not on the driver), so count and
    index come from one evaluation of ``df``."""
    # materialized once: the count and the index must see the same partitions (adaptive query
    # execution may cut a shuffle's output differently in two queries)
    tagged = df.select("*", F.spark_partition_id().alias("_zpid"),
                       F.monotonically_increasing_id().alias("_zmid")).localCheckpoint()
    counts = sorted((r["_zpid"], r["count"]) for r in tagged.groupBy("_zpid").count().collect())
    offsets, acc = [], 0
    for pid, n in counts:
        offsets.append((pid, acc))
        acc += n
    spark = df.sparkSession
    offsets = offsets or [(0, 0)]
    off = local_frame(spark, {"_zpid": pa.array([p for p, _ in offsets], pa.int32()),
                              "_zoff": pa.array([o for _, o in offsets], pa.int64())})
    low = F.col("_zmid").bitwiseAND(F.lit((1 << 33) - 1))
    return (tagged.join(F.broadcast(off), "_zpid").withColumn(name, F.col("_zoff") + low)
            .drop("_zpid", "_zmid", "_zoff"))


def kmeans_groups(samples: DataFrame, n_samples: int, n_features: int, depth: int, seed: int) -> DataFrame:
    """(group_id, sample_id): hierarchical balanced spherical 2-means on the features to
    ``depth`` levels (2^depth groups of equal size up to one), built with the label-tree stage
    on the samples as points."""
    from ..params import TreeParams
    from . import label_tree
    leaf = max(1, -(-n_samples // (2 ** depth)))
    # dense point ids 0..n-1 (sample ids need not be contiguous)
    dense = with_row_index(samples.select("sample_id"), "label_idx").select(
        F.col("sample_id").cast("long"), F.col("label_idx").cast("int"))
    pts = samples.drop("label_idx").join(dense, "sample_id").select("label_idx", F.col("feature_idx").alias("emb_idx"),
                                                  F.col("feature_val").alias("emb_val"))
    tree = label_tree.run(pts, TreeParams(max_leaf_size=leaf, seed=seed), n_features=n_features, n_labels=n_samples)
    first = 2 ** depth - 1                        # heap id of the first node at that depth
    back = dense.select(F.col("label_idx").alias("_pt"), F.col("sample_id").alias("_sid"))
    nodes = tree.join(back, tree["label_idx"] == back["_pt"]).select(F.col("_sid").alias("sample_id"), "node")
    ids = sorted(r["node"] for r in nodes.select("node").distinct().collect())
    remap = local_frame(samples.sparkSession, {"node": pa.array(ids, pa.int64()),
                                               "group_id": pa.array(np.arange(len(ids)), pa.int64())})
    log.info("k-means groups: %d groups (depth %d, nodes %d..%d)", len(ids), depth, ids[0], ids[-1])
    if ids[0] < first:
        log.warning("some groups are shallower than depth %d (too few samples)", depth)
    return nodes.join(F.broadcast(remap), "node").select("group_id", "sample_id")


def make_groups(spark: SparkSession, train: str, out: str, strategy: str, group_size: int, depth: int,
                seed: int, merge: str, params: IngestParams) -> dict:
    """Turn a labelled set into an aggregated one (the EAGLE paper's R-G or C grouping):
    OUT/{samples, groups, group_labels, truth} Delta tables and OUT/info.json."""
    if strategy not in ("random", "kmeans"):
        raise IngestError(f"--strategy must be random or kmeans, got {strategy!r}")
    if strategy == "random" and group_size < 1:
        raise IngestError(f"--group-size must be >= 1, got {group_size}")
    if strategy == "kmeans" and not 0 <= depth <= 24:
        raise IngestError(f"--depth must be in [0, 24], got {depth}")
    samples, info = ingest.read_samples(spark, train, params)
    return write_groups(samples, info, out, strategy, group_size, depth, seed, merge, source=train)


def write_groups(samples: DataFrame, info, out: str, strategy: str, group_size: int, depth: int, seed: int,
                 merge: str, source: str = "") -> dict:
    """Group the labelled ``samples`` and write the aggregated folder OUT (see make_groups)."""
    train = source
    samples = samples.cache()
    groups = (random_groups(samples, group_size, seed) if strategy == "random"
              else kmeans_groups(samples, info.n_samples, info.n_features, depth, seed)).cache()
    pairs = groups.join(samples.select("sample_id", F.explode("label_idx").alias("label_idx")), "sample_id")
    group_labels = pairs.groupBy("group_id", "label_idx").agg(F.count(F.lit(1)).cast("int").alias("count"))
    if merge == "set":
        group_labels = group_labels.withColumn("count", F.lit(None).cast("int"))
    o = Path(out)
    write_delta(samples.withColumn("label_idx", F.array().cast("array<int>")), str(o / "samples"))
    write_delta(groups, str(o / "groups"))
    write_delta(group_labels, str(o / "group_labels"))
    write_delta(samples.select("sample_id", "label_idx"), str(o / "truth"))
    sizes = groups.groupBy("group_id").count().agg(F.min("count"), F.max("count"), F.count(F.lit(1))).first()
    meta = {"source": train, "strategy": strategy, "group_size": group_size if strategy == "random" else None,
            "depth": depth if strategy == "kmeans" else None, "seed": seed, "merge": merge,
            "n_samples": info.n_samples, "n_features": info.n_features, "n_labels": info.n_labels,
            "n_groups": int(sizes[2]), "group_size_min": int(sizes[0]), "group_size_max": int(sizes[1])}
    (o / "info.json").write_text(json.dumps(meta, indent=2))
    groups.unpersist()
    samples.unpersist()
    return meta
