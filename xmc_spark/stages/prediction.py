"""Batched beam-search prediction with the model shared with the executors (a broadcast on
classic Spark, the task closure on Spark Connect: :func:`~xmc_spark.compat.share`)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_from_table, list_array
from ..compat import default_parallelism, is_connect, share
from ..progress import worker_progress
from ..schemas import PREDICTIONS_SCHEMA


def label_batch(t: pa.Table, labels: np.ndarray, scores: np.ndarray,
                names=("pred_labels", "pred_scores")) -> pa.RecordBatch:
    """(sample_id of ``t``, labels, scores) as list columns ``names``: each row's labels >= 0 (-1
    pads a row that has fewer) and their scores, in the given order."""
    keep = labels >= 0
    off = np.concatenate([[0], np.cumsum(keep.sum(axis=1))])
    return pa.RecordBatch.from_arrays(
        [t.column("sample_id").combine_chunks(), list_array(off, labels[keep].astype(np.int32), pa.int32()),
         list_array(off, scores[keep].astype(np.float32), pa.float32())], names=["sample_id", *names])


def map_with_model(samples: DataFrame, model, score, schema: str, kind: str = "predict",
                   columns=(), name: str = "the model") -> DataFrame:
    """Broadcast ``model`` (a whole tree model, with or without a PRIME head, or a head alone)
    once and call ``score(model, table, X)`` on every Arrow batch of the rows' ``sample_id``,
    features and ``columns``."""
    from . import sharded
    if isinstance(getattr(model, "tree", model), sharded.SHARDED):
        raise TypeError("a sharded model's weights stay on the executors: score it with prediction.run")
    bmodel = share(samples, model, name=name)
    n_features = model.n_features

    def fn(batches):
        m = bmodel.value
        for b in batches:
            t = pa.Table.from_batches([b])
            yield score(m, t, csr_from_table(t, "feature_idx", "feature_val", n_features))
            worker_progress(kind, rows_scored=t.num_rows)

    return samples.select("sample_id", "feature_idx", "feature_val", *columns).mapInArrow(fn, schema)


def balanced(samples: DataFrame, n_rows: Optional[int] = None) -> DataFrame:
    """``samples`` spread round-robin over more partitions when they come in fewer than the task
    slots can share. A samples table is read one partition per file, and a test set of a few
    unequal files (the text's input splits: 14K and 6K rows at 200K samples) was scored by as many
    tasks, the largest one alone at the end (9.2 s against 4.4 s).

    The target (:func:`_spread_parts`) is twice Spark's default parallelism ``p``; with
    ``n_rows`` known, input of at most one Arrow batch
    (``spark.sql.execution.arrow.maxRecordsPerBatch`` rows) is left as it is, since the shuffle
    would cost more than it shares (bibtex's 2.5K test rows: predict 2.6 -> 3.2 s), and input of
    at most ``p`` batches goes to ``p`` partitions. Input already in as many partitions is left
    as it is.

    Left as it is too: on Spark Connect (counting the partitions would cost a job), and a plan
    that holds an exchange (its partition count is known only by running the shuffle, which
    adaptive execution would do here, eagerly; such input comes out of a shuffle over
    ``spark.sql.shuffle.partitions`` partitions anyway). A cached table counts as read from its
    cache: counting fills a cache not filled yet, work the scoring then reuses."""
    if is_connect(samples):
        return samples
    parts = _spread_parts(default_parallelism(samples), arrow_batch_rows(samples), n_rows)
    if parts <= 1 or _has_exchange(samples):
        return samples
    return samples if samples.rdd.getNumPartitions() >= parts else samples.repartition(parts)


def _spread_parts(par: int, batch: int, n_rows: Optional[int]) -> int:
    """Partitions to spread ``n_rows`` rows over: 1 (leave as is) for at most one Arrow batch of
    ``batch`` rows, ``par`` for at most ``par`` batches, else (and for an unknown count) ``2 * par``."""
    if n_rows is None:
        return 2 * par
    if n_rows <= batch:
        return 1
    return par if -(-n_rows // batch) <= par else 2 * par


EXCHANGES = "org.apache.spark.sql.execution.exchange."     # shuffle, broadcast and reused exchanges


def _has_exchange(df: DataFrame) -> bool:
    """Whether computing ``df`` runs an exchange (a shuffle or broadcast). Planning only, nothing
    runs. An adaptive plan is walked as first planned (its ``initialPlan``, exchanges already in
    place); a cached table's own plan is not walked (:func:`balanced`)."""
    todo = [df._jdf.queryExecution().executedPlan()]
    while todo:
        node = todo.pop()
        if node.getClass().getName().startswith(EXCHANGES):
            return True
        if node.nodeName() == "AdaptiveSparkPlan":
            todo.append(node.initialPlan())
            continue
        kids = node.children()
        todo.extend(kids.apply(i) for i in range(kids.size()))
    return False


def arrow_batch_rows(samples: DataFrame) -> int:
    v = str(samples.sparkSession.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000"))
    return int(v) if v.strip().isdigit() and int(v) > 0 else 10000


def candidates(samples: DataFrame, model, beam_size: int, k: int, n_rows: Optional[int] = None) -> DataFrame:
    """(sample_id, cand, cand_scores): :func:`run`'s top ``k`` (broadcast or sharded, a PRIME head
    applied when ``model`` carries one) under the names the re-rankers read."""
    return run(samples, model, beam_size, k, n_rows).select(
        "sample_id", F.col("pred_labels").alias("cand"), F.col("pred_scores").alias("cand_scores"))


def run(samples: DataFrame, model, beam_size: int, topk: int, n_rows: Optional[int] = None) -> DataFrame:
    """(sample_id, pred_labels, pred_scores), top-k per sample, best first; a
    :class:`~.sharded.ShardedModel` is scored layer by layer without a broadcast (which reads
    the samples once per layer, so they are not spread first), and so is the tree of a
    :class:`~xmc_spark.prime_model.PrimedModel` over one (:func:`.prime.predict_sharded`). A broadcast model scores the
    samples (``n_rows`` of them, when known) :func:`balanced` over the task slots."""
    from ..prime_model import PrimedModel
    from . import sharded
    if isinstance(model, sharded.SHARDED):
        return sharded.predict(samples, model, beam_size, topk)
    if isinstance(model, PrimedModel) and isinstance(model.tree, sharded.SHARDED):
        from .prime import predict_sharded
        return predict_sharded(samples, model, beam_size, topk, n_rows=n_rows)
    samples = balanced(samples, n_rows)
    def score(m, t, X):
        return label_batch(t, *m.predict(X, beam_size=beam_size, topk=topk))

    return map_with_model(samples, model, score, PREDICTIONS_SCHEMA)
