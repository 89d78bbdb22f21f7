"""Overlapping label clusters on Spark: matcher table M, Y^T M as a join + aggregate, and the
top-``copies`` projection (the paper's lambda) per label partition with a pandas UDF."""
from __future__ import annotations

import logging
from typing import Dict

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..compat import never_broadcast
from ..kernels.topk_projection import topk_projection
from ..kernels.tree import TREE_SHIFT, decode_keys
from ..model import XMCModel
from ..schemas import MATCHER_SCHEMA, TREE_SCHEMA
from .prediction import map_with_model

log = logging.getLogger("xmc_spark.clusters")


def matcher(samples: DataFrame, model: XMCModel, beam_size: int) -> DataFrame:
    """M as a table: (sample_id, leaf, score), the b leaf clusters each sample is matched to
    (a sharded model's beam runs layer by layer, without a broadcast)."""
    from . import sharded
    if isinstance(model, sharded.SHARDED):
        return sharded.matcher(samples, model, beam_size)
    def match(m, t, X):
        leaves, scores = m.match_leaves(X, beam_size)
        ok = leaves >= 0
        ids = t.column("sample_id").to_numpy()
        return pa.RecordBatch.from_arrays(
            [pa.array(np.repeat(ids, ok.sum(axis=1))), pa.array(leaves[ok]),
             pa.array(scores[ok].astype(np.float32))], names=["sample_id", "leaf", "score"])

    return map_with_model(samples, model, match, MATCHER_SCHEMA, kind="matcher")


def project(samples: DataFrame, matched: DataFrame, current: DataFrame, copies: int, n_buckets: int = 8,
            ensemble: bool = False) -> DataFrame:
    """New (label_idx, node, tree) slots: top-``copies`` leaves of each label's row of Y^T M.

    ``current`` holds the present (label_idx, node[, tree]) slots: used for ties and for labels
    none of whose samples were matched anywhere (they keep their cluster). In an ensemble the
    matched leaves are ensemble keys (:func:`~xmc_spark.kernels.tree.encode_keys`, ``ensemble``
    True) and each tree's clusters are projected on their own: a label gets up to ``copies``
    leaves per tree. A single tree's leaf ids are taken as they are.
    """
    ytm = (samples.select("sample_id", F.explode("label_idx").alias("label_idx"))
           .join(never_broadcast(matched.select("sample_id", "leaf")), "sample_id")
           .groupBy("label_idx", "leaf").agg(F.count(F.lit(1)).cast("double").alias("value")))
    tree = F.col("tree").cast("long") if "tree" in current.columns else F.lit(0).cast("long")
    key = F.shiftleft(F.coalesce(tree, F.lit(0).cast("long")), TREE_SHIFT).bitwiseOR(F.col("node"))
    rows = (ytm.withColumn("kind", F.lit(0))
            .unionByName(current.select("label_idx", key.alias("leaf"), F.lit(0.0).alias("value"),
                                        F.lit(1).alias("kind")))
            .withColumn("bucket", F.pmod(F.col("label_idx"), F.lit(n_buckets))))

    def proj(pdf: pd.DataFrame) -> pd.DataFrame:
        ent = pdf[pdf["kind"] == 0]
        cur = pdf[pdf["kind"] == 1]
        keep = decode_keys if ensemble else (lambda k: (np.zeros(len(k), np.int64), np.asarray(k, np.int64)))
        et, el = keep(ent["leaf"].to_numpy())
        ct, cl = keep(cur["leaf"].to_numpy())
        out = []
        for t in np.unique(ct):
            lab, leaf = topk_projection(ent["label_idx"].to_numpy()[et == t], el[et == t],
                                        ent["value"].to_numpy()[et == t], copies,
                                        cur["label_idx"].to_numpy()[ct == t], cl[ct == t])
            out.append(pd.DataFrame({"label_idx": lab.astype(np.int32), "node": leaf.astype(np.int64),
                                     "tree": np.full(len(lab), t, np.int32)}))
        return pd.concat(out, ignore_index=True) if out else pd.DataFrame(
            {"label_idx": np.zeros(0, np.int32), "node": np.zeros(0, np.int64), "tree": np.zeros(0, np.int32)})

    return rows.groupBy("bucket").applyInPandas(proj, TREE_SCHEMA)


def cluster_stats(slot_label: np.ndarray, slot_leaf: np.ndarray) -> Dict[str, float]:
    """Labels per leaf and copies per label (for MLflow and metrics.json)."""
    _, per_leaf = np.unique(slot_leaf, return_counts=True)
    _, copies = np.unique(slot_label, return_counts=True)
    return {"n_slots": float(len(slot_label)), "labels_per_leaf_mean": float(per_leaf.mean()),
            "labels_per_leaf_max": float(per_leaf.max()), "copies_per_label_mean": float(copies.mean()),
            "copies_per_label_max": float(copies.max()), "labels_with_copies": float((copies > 1).sum())}
