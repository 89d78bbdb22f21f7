"""Evaluation on Spark: per-partition metric sums (numpy kernel), added up on the driver."""
from __future__ import annotations

import json
from typing import Dict

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_from_table, list_offsets_values
from ..kernels import metrics as M
from ..params import EvalParams


def label_counts(samples: DataFrame, n_labels: int) -> np.ndarray:
    rows = samples.select(F.explode("label_idx").alias("l")).groupBy("l").count().collect()
    counts = np.zeros(n_labels, dtype=np.int64)
    if rows:
        counts[np.array([r["l"] for r in rows])] = np.array([r["count"] for r in rows])
    return counts


def run(predictions: DataFrame, test: DataFrame, train_label_counts: np.ndarray, n_train: int,
        params: EvalParams, label_depth: np.ndarray | None = None) -> Dict[str, float]:
    """P@k, nDCG@k, PSP@k, recall@k (percent) and, given leaf depths, expected depth@k."""
    ks = list(params.ks)
    inv_prop = 1.0 / M.propensities(train_label_counts, n_train, params.propensity_a, params.propensity_b)
    L = len(train_label_counts)
    kmax = max(ks)
    sc = predictions.sparkSession.sparkContext
    b_inv = sc.broadcast(inv_prop)
    b_depth = sc.broadcast(label_depth)

    def sums(batches):
        total: Dict[str, float] = {}
        for b in batches:
            t = pa.Table.from_batches([b])
            Y = csr_from_table(t, "label_idx", None, L)
            off, lab = list_offsets_values(t, "pred_labels")
            n = len(off) - 1
            pred = -np.ones((n, kmax), dtype=np.int64)
            pos = np.arange(len(lab)) - np.repeat(off[:-1], np.diff(off))
            ok = pos < kmax
            pred[np.repeat(np.arange(n), np.diff(off))[ok], pos[ok]] = lab[ok]
            s = M.per_sample_sums(pred, Y, b_inv.value, ks)
            if b_depth.value is not None:
                s.update(M.depth_sums(pred, b_depth.value, ks))
            total = M.add_sums(total, s)
        yield pa.RecordBatch.from_arrays([pa.array([json.dumps(total)])], names=["sums"])

    joined = test.select("sample_id", "label_idx").join(
        predictions.select("sample_id", "pred_labels"), "sample_id", "left")
    joined = joined.withColumn("pred_labels", F.coalesce("pred_labels", F.array().cast("array<int>")))
    parts = joined.mapInArrow(sums, "sums string").collect()
    total: Dict[str, float] = {}
    for r in parts:
        total = M.add_sums(total, json.loads(r["sums"]))
    out = M.finalize(total, ks)
    if label_depth is not None:
        out.update(M.finalize_depth(total, ks))
    return out
