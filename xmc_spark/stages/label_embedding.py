"""PIFA label embeddings on Spark: per-partition partial Y^T X, summed per label bucket.

The partials travel packed: one record per (bucket, slice of at most :data:`PACK_NNZ`
non-zeros) with the labels, row lengths, indices and values as bytes
(:func:`~..arrow_utils.binary_segments`), so that Spark shuffles a few large binary values
rather than a list row per label (at 500K samples x 50K labels, ~4.7M non-zeros per partition
of ~128K rows, each converted between Arrow and Spark rows on both sides of the shuffle). The
values are the float32 the lists carried, so the sums are those of the list path (up to the
order in which the shuffle delivers a label's partials, as before). Measured at 500K (2 cores,
event log): the partial and combine jobs 2.7 + 3.6 s against 2.8-3.2 + 3.9-4.0 s with lists.

The combine's output is the table's rows, or (``packed``) the same rows with their lists as bytes,
what the label tree reads (:func:`unpacked` turns them into the table's rows)."""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import pyarrow as pa
import scipy.sparse as sp
from pyspark.sql import DataFrame

from ..arrow_utils import (
    binary_segments,
    binary_values,
    csr_batches,
    csr_from_table,
    csr_rows_to_arrays,
    grouped_apply,
    unpack_rows,
)
from ..compat import coalescing, is_connect, partition_keys, sized_partitions
from ..kernels.label_embedding import label_sums, pifa_partial
from ..params import EmbeddingParams
from ..schemas import EMBEDDING_SCHEMA

log = logging.getLogger("xmc_spark.embedding")
BLOCK_BYTES = 32 << 20
PARTIAL_SCHEMA = "bucket int, labels binary, row_len binary, emb_idx binary, emb_val binary"
PACK_NNZ = 4 << 20          # non-zeros of a packed partial record (32 MB of indices and values)
# The embeddings with each row's non-zeros packed as bytes (arrow_utils.pack_rows), what the label
# tree's tasks read: Spark hands list columns to Python number by number, bytes whole
PACKED_SCHEMA = "label_idx int, emb_idx binary, emb_val binary"
PACKED_BATCH_NNZ = 1 << 26  # non-zeros of one packed batch (256 MiB of indices: below a binary array's 2 GiB)
# partial non-zeros a combine task is sized for, when their count is bounded (run's partials_nnz)
COMBINE_NNZ = 1 << 22
PACKED_ARROW = pa.schema([("label_idx", pa.int32()), ("emb_idx", pa.binary()), ("emb_val", pa.binary())])


def _sparse_rows_table(row_ids: np.ndarray, M: sp.csr_matrix, extra: dict | None = None) -> pa.Table:
    idx, val = csr_rows_to_arrays(M)
    cols = dict(extra or {})
    cols.update({"label_idx": pa.array(row_ids.astype(np.int32)), "emb_idx": idx, "emb_val": val})
    return pa.table(cols)


def _pack(bucket: int, rows: np.ndarray, acc: sp.csr_matrix, pack_nnz: int):
    """Record batches of :data:`PARTIAL_SCHEMA`: the rows ``rows`` of the partial ``acc``, cut
    into records of at most ``pack_nnz`` non-zeros (a row is never cut; one row may exceed it),
    one record per batch. A row's columns keep the partial's order (the combine sorts each label's
    sum once, :func:`~..kernels.label_embedding.label_sums`, which needs no column twice in a row:
    ``acc`` is a scipy product or sum of products, whose rows never repeat a column)."""
    if not len(rows):
        return
    sub = acc[rows]
    cum = sub.indptr[1:]
    cuts, lo = [0], 0
    while lo < len(rows):                    # each record: rows up to pack_nnz non-zeros past its start
        hi = max(int(np.searchsorted(cum, sub.indptr[lo] + pack_nnz, side="right")), lo + 1)
        cuts.append(hi)
        lo = hi
    for lo, hi in zip(cuts[:-1], cuts[1:]):   # a batch per record: no binary column past 2 GiB
        span = np.array([0, hi - lo])
        nz = np.array([0, sub.indptr[hi] - sub.indptr[lo]])
        a, z = sub.indptr[lo], sub.indptr[hi]
        yield pa.RecordBatch.from_pydict({
            "bucket": pa.array([bucket], pa.int32()),
            "labels": binary_segments(rows[lo:hi], span, np.int32),
            "row_len": binary_segments(np.diff(sub.indptr[lo:hi + 1]), span, np.int32),
            "emb_idx": binary_segments(sub.indices[a:z], nz, np.int32),
            "emb_val": binary_segments(sub.data[a:z], nz, np.float32)})


def run(samples: DataFrame, params: EmbeddingParams, *, n_features: int, n_labels: int,
        n_buckets: int = 8, block_bytes: int = BLOCK_BYTES, pack_nnz: int = PACK_NNZ,
        packed: bool = False, batch_nnz: int = PACKED_BATCH_NNZ, partials_nnz: Optional[float] = None) -> DataFrame:
    """(label_idx, emb_idx, emb_val): L2-normalized Y^T X rows, labels with no sample omitted;
    with ``packed``, each row's two lists packed as bytes (:data:`PACKED_SCHEMA`, what the label
    tree reads; :func:`unpacked` gives the table's rows), in batches cut at ``batch_nnz`` non-zeros.

    Each task multiplies blocks of its Arrow batches (``block_bytes`` of Arrow buffers, about
    ``block_bytes / 8`` feature non-zeros, then the next block) and sums the blocks' products.
    A product and a sum per batch made the sums (each the size of the growing partial) cost ~6x
    the products (500K set: 2.4 s against 0.4 s a partition). A task holds one block (copied about
    twice while it becomes CSR) beside its partial.

    Labels go to buckets round robin (label mod ``n_buckets``), and bucket b's records carry the
    key :func:`~..compat.partition_keys` gives b: with ``n_buckets`` shuffle partitions (what the
    pipeline passes, :func:`~..compat.shuffle_partitions`) each bucket gets a partition of its own,
    where the buckets' own ids collided (three of four in one partition at n = 4), so no combine
    task holds several buckets unless adaptive execution merges adjacent partitions.

    ``partials_nnz`` (the most non-zeros the partials hold, or an estimate: :func:`partials_nnz`), on classic
    Spark with adaptive execution not coalescing partitions (:func:`~..compat.coalescing`): the
    buckets are as many as that many non-zeros need at :data:`COMBINE_NNZ` a task
    (:func:`~..compat.sized_partitions`: at least the default parallelism, at most ``n_buckets``
    and the shuffle partitions), each shuffled into a partition of its own. A small set's combine
    then runs a few tasks, not the shuffle partitions' nearly empty ones each reporting its
    metrics to the driver, and a combine task's share of the partials stays bounded as the set
    grows. Where adaptive execution coalesces, it sizes the grouping's shuffle by its real bytes,
    which an explicit partition count would forbid: ``partials_nnz`` is not used."""
    normalize_y = params.normalize_y
    sized = partials_nnz is not None and not is_connect(samples) and not coalescing(samples.sparkSession)
    if sized:
        n_buckets = min(n_buckets, sized_partitions(samples.sparkSession, partials_nnz, COMBINE_NNZ))
    keys = partition_keys(n_buckets)

    def partial(batches):
        acc, block, held = None, [], 0

        def add(acc, block):
            t = pa.Table.from_batches(block)
            P = pifa_partial(csr_from_table(t, "feature_idx", "feature_val", n_features),
                             csr_from_table(t, "label_idx", None, n_labels), normalize_y)
            return P if acc is None else acc + P

        for b in batches:
            block.append(b)
            held += b.get_total_buffer_size()
            if held >= block_bytes:
                acc, block, held = add(acc, block), [], 0
        if block:
            acc = add(acc, block)
        if acc is None:
            return
        acc = acc.tocsr()
        rows = np.flatnonzero(np.diff(acc.indptr))
        bucket = rows % n_buckets
        order = np.argsort(bucket, kind="stable")             # the rows of each bucket, in label order
        ends = np.searchsorted(bucket[order], np.arange(n_buckets + 1))
        for b in range(n_buckets):
            yield from _pack(int(keys[b]), rows[order[ends[b]:ends[b + 1]]], acc, pack_nnz)

    def combine(t: pa.Table) -> pa.Table:
        ptr = np.concatenate([[0], np.cumsum(binary_values(t.column("row_len"), np.int32), dtype=np.int64)])
        uniq, zptr, zidx, zval = label_sums(binary_values(t.column("labels"), np.int32), ptr,
                                            binary_values(t.column("emb_idx"), np.int32),
                                            binary_values(t.column("emb_val"), np.float32), n_features)
        Z = sp.csr_matrix((zval, zidx, zptr), shape=(len(uniq), n_features))
        if not packed:
            return _sparse_rows_table(uniq, Z)
        batches = csr_batches({"label_idx": pa.array(uniq.astype(np.int32))}, Z, batch_nnz)
        return pa.Table.from_batches(batches, PACKED_ARROW) if batches else PACKED_ARROW.empty_table()

    parts = samples.select("feature_idx", "feature_val", "label_idx").mapInArrow(partial, PARTIAL_SCHEMA)
    if sized:               # (the grouping keeps this partitioning: no second shuffle)
        parts = parts.repartition(n_buckets, "bucket")
    return grouped_apply(parts, ["bucket"], combine, PACKED_SCHEMA if packed else EMBEDDING_SCHEMA)


def partials_nnz(label_counts, row_nnz: Optional[float], label_nnz: Optional[int] = None) -> Optional[float]:
    """The most non-zeros the PIFA partials hold, from ingest's counts: the sum over the rows of
    labels x non-zeros (``label_nnz``, reached when no two rows of a task share a label and a
    feature); without it, estimated as the rows' label memberships (``label_counts``' sum) times
    the mean non-zeros of a row ``row_nnz``, which is that sum when a row's labels and non-zeros
    are not correlated (and less when longer rows carry more labels); None without any."""
    if label_nnz is not None:
        return float(label_nnz)
    if label_counts is None or row_nnz is None:
        return None
    return float(np.sum(label_counts)) * float(row_nnz)


def _unpack(batches):
    for b in batches:
        idx, val = unpack_rows(pa.Table.from_batches([b]), "emb_idx", "emb_val")
        yield pa.RecordBatch.from_arrays([b.column("label_idx"), idx, val], ["label_idx", "emb_idx", "emb_val"])


def unpacked(packed: DataFrame) -> DataFrame:
    """The ``label_embeddings`` rows of packed embeddings (:func:`run` with ``packed``): each row's
    bytes as lists again, in the task (the tree reads the packed rows; the table keeps its lists)."""
    return packed.mapInArrow(_unpack, EMBEDDING_SCHEMA)
