"""Shared by the stage tests: one small learnable problem as a samples DataFrame, and the same
problem as the numpy matrices the kernels take; a whole model as the weights table and the
sharded model the pipeline keeps above ``predict.max_broadcast_mb``."""
import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

from tests.conftest import random_problem
from xmc_spark.arrow_utils import csr_rows_to_arrays
from xmc_spark.kernels.sparse import l2_normalize_rows
from xmc_spark.schemas import SAMPLES_SCHEMA, TABLES

N, D, L = 150, 40, 14


def samples_frame(spark, X, Y, label_weights=False, weights=None, partitions=3):
    """A samples table (the ingest stage's schema) holding rows X and labels Y; the values of Y
    become the ``label_weight`` column when ``label_weights``; ``weights``: per-sample weights."""
    X, Y = sp.csr_matrix(X), sp.csr_matrix(Y)
    rows = []
    for i in range(X.shape[0]):
        xs, ys = slice(X.indptr[i], X.indptr[i + 1]), slice(Y.indptr[i], Y.indptr[i + 1])
        w = 1.0 if weights is None else float(weights[i])
        row = (i, X.indices[xs].tolist(), X.data[xs].tolist(), Y.indices[ys].tolist(), w)
        rows.append(row + ((Y.data[ys].tolist(),) if label_weights else ()))
    return spark.createDataFrame(rows, TABLES["train"] if label_weights else SAMPLES_SCHEMA).repartition(partitions)


def to_csr(rows, idx, val, n_cols, id_col="sample_id"):
    """Collected rows with list columns -> CSR, rows ordered by ``id_col``."""
    rows = sorted(rows, key=lambda r: r[id_col])
    data = [np.asarray(r[val], np.float32) if val else np.ones(len(r[idx]), np.float32) for r in rows]
    ind = [np.asarray(r[idx], np.int32) for r in rows]
    ptr = np.concatenate([[0], np.cumsum([len(i) for i in ind])])
    m = sp.csr_matrix((np.concatenate(data), np.concatenate(ind), ptr), shape=(len(rows), n_cols))
    m.sort_indices()
    return m


@pytest.fixture(scope="session")
def problem(spark):
    """(samples DataFrame, X, Y): rows L2-normalized as ingest leaves them, float32 as in the tables."""
    X, Y = random_problem(n=N, d=D, L=L, seed=7)
    Xl, Yl = l2_normalize_rows(X), sp.csr_matrix(Y, dtype=np.float32)
    return samples_frame(spark, Xl, Yl).cache(), Xl, Yl


def synth_rows(start, count, n_labels, n_features, seed):
    """Rows ``start`` .. ``start + count`` of ``xmc_spark.synth``'s model (L2-normalized X, Y) as
    float32 CSR: a train and a test split of one learnable problem."""
    from xmc_spark import synth
    return synth.matrices(start, count, n_labels, n_features, seed)


def weights_frame(spark, model):
    """The weights table of ``model`` (what the training stage writes)."""
    parts = []
    for is_leaf, kc in ((False, model.node_w), (True, model.slot_w)):
        idx, val = csr_rows_to_arrays(kc.W.T.tocsr())
        parts.append(pa.table({"is_leaf": pa.array(np.full(len(kc.keys), is_leaf)), "key": pa.array(kc.keys),
                               "w_idx": idx, "w_val": val}))
    return spark.createDataFrame(pa.concat_tables(parts).to_pandas(), TABLES["weights"]).repartition(3)


def as_sharded(spark, model, top_mb=0.0):
    """``model`` sharded; ``top_mb``: its predict.max_broadcast_mb, which bounds the top layers
    searched with their weights shared (0: every layer by the cogroup; "default": the default bound)."""
    from xmc_spark.stages import sharded
    pred = model.pred_params if top_mb == "default" else dataclasses.replace(model.pred_params, max_broadcast_mb=top_mb)
    return sharded.ShardedModel(model.index, weights_frame(spark, model), model.n_features, model.bias,
                                model.normalize, pred, dict(model.meta), model.label_counts)


def ensemble_frame(spark, e):
    """The weights table the trainer writes for an ensemble: keys tree << 52 | id."""
    from xmc_spark.kernels.tree import encode_keys
    parts = []
    for t, m in enumerate(e.models):
        for is_leaf, kc in ((False, m.node_w), (True, m.slot_w)):
            idx, val = csr_rows_to_arrays(kc.W.T.tocsr())
            parts.append(pa.table({"is_leaf": pa.array(np.full(len(kc.keys), is_leaf)),
                                   "key": pa.array(encode_keys(t, kc.keys)), "w_idx": idx, "w_val": val}))
    return spark.createDataFrame(pa.concat_tables(parts).to_pandas(), TABLES["weights"]).repartition(3)
