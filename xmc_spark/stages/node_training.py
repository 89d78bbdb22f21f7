"""Per-node linear trainer on Spark: samples fan out to the nodes they reach, one kernel call
per node trains all of that node's one-vs-rest classifiers."""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame

from ..arrow_utils import csr_from_table, csr_rows_to_arrays, grouped_apply, list_offsets_values
from ..kernels.sparse import append_bias
from ..kernels.tree import TreeIndex
from ..model import train_group
from ..params import TrainParams
from ..progress import worker_progress
from ..schemas import WEIGHTS_SCHEMA

log = logging.getLogger("xmc_spark.train")
GROUPED_SCHEMA = ("group long, sample_id long, feature_idx array<int>, feature_val array<float>, "
                  "label_idx array<int>, weight float")


def run(samples: DataFrame, index: TreeIndex, n_features: int, params: TrainParams) -> DataFrame:
    """(is_leaf, key, w_idx, w_val): one row per classifier (key = node id, or slot id at leaves).

    A ``label_weight`` column (array<float> aligned with ``label_idx``, e.g. EAGLE's soft
    assignment) weights each positive; without it every positive weighs 1.
    """
    sc = samples.sparkSession.sparkContext
    bindex = sc.broadcast(index)
    weighted = "label_weight" in samples.columns
    cols = ["group", "sample_id", "feature_idx", "feature_val", "label_idx", "weight"] + (
        ["label_weight"] if weighted else [])
    schema = GROUPED_SCHEMA + (", label_weight array<float>" if weighted else "")

    def expand(batches):
        ix = bindex.value
        for b in batches:
            t = pa.Table.from_batches([b])
            off, labels = list_offsets_values(t, "label_idx")
            rows, groups = ix.groups_of_samples(off, labels)
            out = t.take(pa.array(rows))
            out = out.add_column(0, "group", pa.array(groups, pa.int64()))
            yield from out.select(cols).to_batches()

    def train(t: pa.Table) -> pa.Table:
        ix = bindex.value
        order = np.argsort(t.column("sample_id").to_numpy(), kind="mergesort")
        t = t.take(pa.array(order))
        group = int(t.column("group")[0].as_py())
        X = append_bias(csr_from_table(t, "feature_idx", "feature_val", n_features), params.bias)
        off, labels = list_offsets_values(t, "label_idx")
        weights = t.column("weight").to_numpy().astype(np.float64)
        lw = list_offsets_values(t, "label_weight")[1] if weighted else None
        is_leaf, children, W = train_group(ix, group, X, off, labels, params, weights, lw)
        idx, val = csr_rows_to_arrays(W.T.tocsr())
        worker_progress("train", nodes=1, classifiers=len(children), node_samples=X.shape[0])
        return pa.table({"is_leaf": pa.array(np.full(len(children), is_leaf)),
                         "key": pa.array(np.asarray(children, np.int64)), "w_idx": idx, "w_val": val})

    grouped = samples.mapInArrow(expand, schema)
    return grouped_apply(grouped, ["group"], train, WEIGHTS_SCHEMA)
