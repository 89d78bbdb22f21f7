"""Label frequencies for interpolated trees on Spark: f, and f-tilde (marginal or greedy).

Every pass is a vectorized kernel per Arrow batch (:mod:`xmc_spark.kernels.frequencies`)
whose partial sums Spark adds up; the driver holds O(labels) arrays only. The greedy f-tilde
runs in rounds of one aggregation each (see the kernel module for why the replay is exact).
"""
from __future__ import annotations

import logging
from typing import Tuple

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import list_offsets_values, to_arrow
from ..compat import share, small_result
from ..kernels import frequencies as K
from ..params import TreeParams

log = logging.getLogger("xmc_spark.frequencies")

_VEC_SCHEMA = "label_idx long, mass double"
_MASK_SCHEMA = "mask long, label_idx long, mass double"


def _sum_vector(labels: DataFrame, n_labels: int, fn) -> np.ndarray:
    """Sum over Arrow batches of ``fn(offsets, labels) -> dense vector``, as a dense vector."""
    def part(batches):
        acc = np.zeros(n_labels)
        for b in batches:
            off, val = list_offsets_values(pa.Table.from_batches([b]), "label_idx")
            acc += fn(off, val.astype(np.int64))
        nz = np.flatnonzero(acc)
        yield pa.RecordBatch.from_pydict({"label_idx": pa.array(nz, pa.int64()), "mass": pa.array(acc[nz])})

    t = to_arrow(small_result(labels.mapInArrow(part, _VEC_SCHEMA).groupBy("label_idx")
                              .agg(F.sum("mass").alias("mass")), n_labels))
    out = np.zeros(n_labels)
    out[t.column("label_idx").to_numpy().astype(np.int64)] = t.column("mass").to_numpy()
    return out


def _greedy(labels: DataFrame, n_labels: int, f: np.ndarray, k: int) -> Tuple[np.ndarray, int]:
    def mask_table(selected, cand_bit):
        """One round: (mask, label, mass) summed over the remaining contexts by Spark."""
        b = share(labels, (selected, cand_bit), name="the greedy f-tilde selection")

        def part(batches):
            sel, bits = b.value
            for batch in batches:
                off, val = list_offsets_values(pa.Table.from_batches([batch]), "label_idx")
                m, lab, w = K.mask_counts(off, val.astype(np.int64), None, sel, bits)
                yield pa.RecordBatch.from_pydict({"mask": pa.array(m, pa.int64()),
                                                  "label_idx": pa.array(lab, pa.int64()),
                                                  "mass": pa.array(w, pa.float64())})

        t = (labels.mapInArrow(part, _MASK_SCHEMA).groupBy("mask", "label_idx")
             .agg(F.sum("mass").alias("mass")).toPandas())
        b.unpersist()
        return (t["mask"].to_numpy(np.int64), t["label_idx"].to_numpy(np.int64), t["mass"].to_numpy(np.float64))

    def progress(rounds, selected, out):
        log.info("greedy f-tilde round %d: %d labels picked, %.0f mass assigned", rounds, int(selected.sum()),
                 out.sum())

    return K.greedy_by_rounds(n_labels, f, k, mask_table, progress)


def run(samples: DataFrame, n_labels: int, params: TreeParams, f=None) -> Tuple[np.ndarray, np.ndarray, dict]:
    """(f, f_tilde, info) from the training samples' label lists (context frequency 1 each).

    ``f``, the label counts, may be passed in when the caller already has them."""
    labels = samples.select("label_idx").cache()
    try:
        if f is None:
            f = _sum_vector(labels, n_labels, lambda off, val: np.bincount(val, minlength=n_labels).astype(np.float64))
        f = np.asarray(f, np.float64)
        info = {"f_tilde": params.f_tilde}
        if params.f_tilde == "marginal":
            bf = share(labels, f, name="the label counts f")
            ft = _sum_vector(labels, n_labels, lambda off, val: K.f_tilde_marginal(off, val, bf.value))
            bf.unpersist()
        else:
            ft, rounds = _greedy(labels, n_labels, f, params.greedy_candidates)
            info["greedy_rounds"] = rounds
        info["f_tilde_support"] = int((ft > 0).sum())
        log.info("label frequencies: %d labels with mass, f-tilde (%s) on %d labels", int((f > 0).sum()),
                 params.f_tilde, info["f_tilde_support"])
        return f, ft, info
    finally:
        labels.unpersist()
