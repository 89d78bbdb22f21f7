"""Evaluation on Spark: per-partition metric sums (numpy kernel), added up on the driver."""
from __future__ import annotations

import json
from typing import Dict, Optional

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import list_offsets_values, to_arrow
from ..compat import never_broadcast, share, small_result
from ..kernels import metrics as M
from ..kernels.sparse import csr_from_lists
from ..params import EvalParams


def label_counts(samples: DataFrame, n_labels: int) -> np.ndarray:
    """Rows of ``samples`` carrying each label (n_labels ints)."""
    return rows_per_label(samples.select(F.explode("label_idx").alias("label_idx")), n_labels)


def rows_per_label(rows: DataFrame, n_labels: int) -> np.ndarray:
    """Rows per ``label_idx`` value (n_labels ints), from one small job: O(labels) rows to the
    driver, as one compressed Arrow table, from the tasks that O(labels) rows need
    (:func:`~..compat.small_result`)."""
    per = to_arrow(small_result(rows.groupBy("label_idx").count(), n_labels), compress=True)
    counts = np.zeros(n_labels, dtype=np.int64)
    if per.num_rows:
        counts[per.column("label_idx").to_numpy().astype(np.int64)] = per.column("count").to_numpy()
    return counts


def unseen_labels(train_counts: np.ndarray, test: DataFrame) -> Dict[str, int]:
    """Test labels never seen in training (``train_counts``: :func:`label_counts` of the training
    table; they can only be misses), as three counts: ``test_unseen_labels`` (distinct labels),
    ``test_unseen_positives`` (their occurrences) and ``test_rows_with_unseen`` (test rows having
    one). One pass over the test table with the counts shared: each batch reports its unseen
    labels with their occurrences and its rows having one, summed per label (O(labels) rows)."""
    seen = share(test, np.asarray(train_counts) > 0, name="the training labels seen")

    def unseen(batches):
        known = seen.value
        for b in batches:
            off, labels = list_offsets_values(pa.Table.from_batches([b]), "label_idx")
            miss, rows = M.unseen(off, labels, known)
            u, c = np.unique(np.asarray(labels, np.int64)[miss], return_counts=True)
            yield pa.RecordBatch.from_pydict({"label": pa.array(np.concatenate([u, [-1]]), pa.int64()),
                                              "n": pa.array(np.concatenate([c, [rows]]), pa.int64())})

    per = to_arrow(small_result(test.select("label_idx").mapInArrow(unseen, "label long, n long")
                                .groupBy("label").agg(F.sum("n").alias("n")), len(train_counts)))
    seen.unpersist()
    label, n = (per.column(c).to_numpy().astype(np.int64) for c in ("label", "n"))
    labels = label >= 0                          # the label -1 counts the rows having an unseen label
    return {"test_unseen_labels": int(np.count_nonzero(labels)), "test_unseen_positives": int(n[labels].sum()),
            "test_rows_with_unseen": int(n[~labels].sum())}


def unseen_from_counts(train_counts: np.ndarray, test_counts: np.ndarray, rows_with_unseen: int) -> Dict[str, int]:
    """:func:`unseen_labels` from the test table's label counts and its rows having an unseen label
    (both counted by ingest's check job: ``DatasetInfo``), on the driver, O(labels)."""
    train_counts, test_counts = np.asarray(train_counts), np.asarray(test_counts)
    seen = np.zeros(len(test_counts), np.bool_)
    m = min(len(seen), len(train_counts))
    seen[:m] = train_counts[:m] > 0
    miss = (test_counts > 0) & ~seen
    return {"test_unseen_labels": int(np.count_nonzero(miss)),
            "test_unseen_positives": int(test_counts[miss].sum()), "test_rows_with_unseen": int(rows_with_unseen)}


def with_predictions(test: DataFrame, predictions: DataFrame, n_rows: Optional[int] = None) -> DataFrame:
    """(sample_id, label_idx, pred_labels) of every test row, [] where it has no prediction; the
    predictions are shuffled to the join, never broadcast (:func:`~..compat.never_broadcast`).
    ``n_rows`` (the test rows, when known): the join's partitions are read by the tasks that many
    rows need (:func:`~..compat.small_result`; a coalesce: a repartition of both sides would be
    raised back to ``spark.sql.shuffle.partitions`` by the planner)."""
    joined = test.select("sample_id", "label_idx").join(
        never_broadcast(predictions.select("sample_id", "pred_labels")), "sample_id", "left")
    if n_rows is not None:
        joined = small_result(joined, n_rows)
    return joined.withColumn("pred_labels", F.coalesce("pred_labels", F.array().cast("array<int>")))


def run(predictions: DataFrame, test: DataFrame, train_label_counts: np.ndarray, n_train: int,
        params: EvalParams, label_depth: np.ndarray | None = None, n_rows: Optional[int] = None) -> Dict[str, float]:
    """P@k, nDCG@k, PSP@k, recall@k (percent) and, given leaf depths, expected depth@k;
    ``n_rows``: the test rows, when known (see :func:`with_predictions`).

    The label space is max(len(train_label_counts), largest test label + 1) (found per batch):
    a test label never seen in training has count 0 (see :func:`~..kernels.metrics.propensities`)
    and can only be a miss.
    """
    ks = list(params.ks)
    A, B = params.propensity_a, params.propensity_b
    L = len(train_label_counts)
    kmax = max(ks)
    b_counts = share(predictions, np.asarray(train_label_counts), name="the training label counts")
    b_depth = share(predictions, label_depth, name="the label depths")

    def sums(batches):
        total: Dict[str, float] = {}
        inv_prop = np.zeros(0)
        for b in batches:
            t = pa.Table.from_batches([b])
            yoff, ylab = list_offsets_values(t, "label_idx")
            Lb = max(L, int(ylab.max()) + 1 if len(ylab) else 0)
            if len(inv_prop) < Lb:        # once per task, again only for a batch with unseen labels
                inv_prop = 1.0 / M.propensities(b_counts.value, n_train, A, B, n_labels=Lb)
            Y = csr_from_lists(yoff, ylab, None, Lb)
            off, lab = list_offsets_values(t, "pred_labels")
            n = len(off) - 1
            pred = -np.ones((n, kmax), dtype=np.int64)
            pos = np.arange(len(lab)) - np.repeat(off[:-1], np.diff(off))
            ok = pos < kmax
            pred[np.repeat(np.arange(n), np.diff(off))[ok], pos[ok]] = lab[ok]
            s = M.per_sample_sums(pred, Y, inv_prop, ks)
            if b_depth.value is not None:
                s.update(M.depth_sums(pred, b_depth.value, ks))
            total = M.add_sums(total, s)
        yield pa.RecordBatch.from_arrays([pa.array([json.dumps(total)])], names=["sums"])

    parts = with_predictions(test, predictions, n_rows).mapInArrow(sums, "sums string").collect()
    total: Dict[str, float] = {}
    for r in parts:
        total = M.add_sums(total, json.loads(r["sums"]))
    out = M.finalize(total, ks)
    if label_depth is not None:
        out.update(M.finalize_depth(total, ks))
    return out
