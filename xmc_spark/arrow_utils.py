"""Arrow <-> CSR conversions and grouped-apply helpers used inside Spark tasks.

List columns arrive as Arrow ListArrays whose offsets and flat values are exactly a CSR
matrix's indptr and indices/data, so no per-row Python work is needed.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import scipy.sparse as sp

from .compat import is_connect, session_settings
from .kernels.jit import njit
from .kernels.sparse import csr_from_lists


def _list_parts(col) -> tuple:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if isinstance(col, pa.ChunkedArray):  # zero chunks
        return np.zeros(1, np.int64), np.zeros(0)
    if col.null_count:
        col = pa.compute.fill_null(col, pa.scalar([], type=col.type))
    offsets = np.asarray(col.offsets, dtype=np.int64)
    values = col.values.to_numpy(zero_copy_only=False)
    values = values[offsets[0]:offsets[-1]]
    return offsets - offsets[0], values


def list_offsets_values(table: pa.Table, name: str):
    return _list_parts(table.column(name))


def csr_from_table(table: pa.Table, idx_col: str, val_col: Optional[str], n_cols: int) -> sp.csr_matrix:
    off, idx = list_offsets_values(table, idx_col)
    val = None if val_col is None else list_offsets_values(table, val_col)[1]
    return csr_from_lists(off, idx, val, n_cols)


def padded(table: pa.Table, column: str, k: int, fill, dtype) -> np.ndarray:
    """List column -> n x k array, each row's first k values, padded with ``fill``."""
    off, val = list_offsets_values(table, column)
    n = len(off) - 1
    cnt = np.minimum(np.diff(off), k)
    out = np.full((n, k), fill, dtype)
    rows = np.repeat(np.arange(n), cnt)
    cols = np.arange(cnt.sum()) - np.repeat(np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)
    out[rows, cols] = val[np.repeat(off[:-1], cnt) + cols]
    return out


def list_array(offsets: np.ndarray, values: np.ndarray, typ: pa.DataType) -> pa.ListArray:
    """A ListArray of int32 offsets: refuses offsets past 2^31 - 1 (a batch that large must be cut)."""
    offsets = np.asarray(offsets)
    if len(offsets) and offsets[-1] >= 1 << 31:
        raise ValueError(f"{int(offsets[-1])} list values do not fit one list array (< 2^31): cut the rows smaller")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=typ))


def csr_rows_to_arrays(M: sp.csr_matrix):
    """(indices ListArray<int32>, values ListArray<float32>) of the rows of M."""
    M = sp.csr_matrix(M)
    return (list_array(M.indptr, M.indices.astype(np.int32), pa.int32()),
            list_array(M.indptr, M.data.astype(np.float32), pa.float32()))


def binary_segments(values: np.ndarray, starts: np.ndarray, dtype) -> pa.BinaryArray:
    """One binary value per segment ``values[starts[k]:starts[k + 1]]`` (as ``dtype``): packed
    records that Spark shuffles as bytes, not as lists of numbers."""
    data = np.ascontiguousarray(values, dtype=dtype)
    offs = np.asarray(starts, np.int64) * data.itemsize
    if len(offs) and offs[-1] >= 1 << 31:
        raise ValueError(f"{offs[-1]} bytes of segments do not fit one binary array (< 2 GiB): cut them smaller")
    return pa.BinaryArray.from_buffers(pa.binary(), len(starts) - 1,
                                       [None, pa.py_buffer(offs.astype(np.int32)), pa.py_buffer(data)])


def _binary_offsets(col) -> np.ndarray:
    """The byte offsets of one binary (or large_binary) array, its slice's own."""
    wide = pa.types.is_large_binary(col.type)
    return np.frombuffer(col.buffers()[1], np.int64 if wide else np.int32)[col.offset:col.offset + len(col) + 1]


def binary_values(column, dtype) -> np.ndarray:
    """The values of a binary column (:func:`binary_segments`) end to end, as one ``dtype`` array,
    read chunk by chunk (no 2 GiB concatenation)."""
    parts = []
    for col in getattr(column, "chunks", [column]):
        offs = _binary_offsets(col)
        data = col.buffers()[2]
        if data is not None and len(offs) and offs[-1] > offs[0]:
            parts.append(np.frombuffer(data, np.uint8)[offs[0]:offs[-1]].view(dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def binary_lengths(column, itemsize: int) -> np.ndarray:
    """Each value's length in items of ``itemsize`` bytes, of a binary column of
    :func:`binary_segments` (chunk by chunk; a null counts its slot's bytes, 0 as Arrow writes them)."""
    parts = [np.diff(_binary_offsets(col).astype(np.int64)) for col in getattr(column, "chunks", [column])]
    nbytes = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if (nbytes % itemsize).any() or (nbytes < 0).any():
        raise ValueError(f"a binary value of {int(nbytes[(nbytes % itemsize != 0) | (nbytes < 0)][0])} bytes does "
                         f"not hold whole values of {itemsize} bytes")
    return nbytes // itemsize


def pack_rows(table: pa.Table, idx_col: str, val_col: str) -> tuple:
    """The list columns ``idx_col`` (int32) and ``val_col`` (float32) of a table as two binary
    columns of one value per row (:func:`binary_segments`): a row's non-zeros travel through
    Spark as two byte strings, which the JVM copies whole where it converts lists number by number."""
    off, idx = list_offsets_values(table, idx_col)
    voff, val = list_offsets_values(table, val_col)
    if not np.array_equal(off, voff):
        raise ValueError(f"{idx_col} and {val_col} have different lengths in a row")
    return binary_segments(idx, off, np.int32), binary_segments(val, off, np.float32)


def unpack_rows(table: pa.Table, idx_col: str, val_col: str) -> tuple:
    """The inverse of :func:`pack_rows`: the binary columns ``idx_col`` and ``val_col`` as list
    columns (int32, float32) of the same rows."""
    n = binary_lengths(table.column(idx_col), 4)
    if not np.array_equal(n, binary_lengths(table.column(val_col), 4)):
        raise ValueError(f"{idx_col} and {val_col} have different lengths in a row")
    off = np.concatenate([[0], np.cumsum(n)])
    return (list_array(off, binary_values(table.column(idx_col), np.int32), pa.int32()),
            list_array(off, binary_values(table.column(val_col), np.float32), pa.float32()))


def nnz_cuts(ends: np.ndarray, pack_nnz: int):
    """(lo, hi) row ranges cut where the running count of non-zeros (``ends``: cumulative per row)
    passes a multiple of ``pack_nnz``: a range holds fewer than ``pack_nnz`` plus its longest row's
    non-zeros (a row is never cut)."""
    total = int(ends[-1]) if len(ends) else 0
    cuts = np.unique(np.concatenate([[0], np.searchsorted(ends, np.arange(pack_nnz, total, pack_nnz), side="right"),
                                     [len(ends)]]))
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def csr_batches(cols: dict, M: sp.csr_matrix, pack_nnz: int, idx_col: str = "emb_idx",
                val_col: str = "emb_val") -> list:
    """Record batches of the rows of ``M`` packed (:func:`pack_rows`: ``idx_col``, ``val_col``)
    beside the per-row Arrow arrays ``cols``, cut by :func:`nnz_cuts` (no binary array near 2 GiB)."""
    batches = []
    for lo, hi in nnz_cuts(M.indptr[1:] - M.indptr[0], pack_nnz):
        a, z = M.indptr[lo], M.indptr[hi]
        ptr = M.indptr[lo:hi + 1] - a
        part = {k: v.slice(lo, hi - lo) for k, v in cols.items()}
        part.update({idx_col: binary_segments(M.indices[a:z], ptr, np.int32),
                     val_col: binary_segments(M.data[a:z], ptr, np.float32)})
        batches.append(pa.RecordBatch.from_pydict(part))
    return batches


def csr_from_binary(table: pa.Table, idx_col: str, val_col: str, n_cols: int,
                    order: Optional[np.ndarray] = None) -> sp.csr_matrix:
    """:func:`csr_from_table` of the rows :func:`pack_rows` packed, in ``order`` (row k of the
    result is the table's row ``order[k]``) when given. Each column's values are copied once,
    from the chunks' buffers straight to their rows' places (a concatenation, a CSR copy and a
    row gather would each copy them again: at a big node's split, ~120 MB a copy)."""
    lengths = binary_lengths(table.column(idx_col), 4)
    if not np.array_equal(lengths, binary_lengths(table.column(val_col), 4)):
        raise ValueError(f"{idx_col} and {val_col} have different lengths in a row")
    m = len(lengths)
    ptr = np.zeros(m + 1, np.int64)
    if order is None:
        np.cumsum(lengths, out=ptr[1:])
        dest = ptr[:-1]
    else:
        order = np.asarray(order, np.int64)
        if len(order) != m or not np.array_equal(np.sort(order), np.arange(m)):
            raise ValueError(f"the row order is not a permutation of the {m} rows")
        np.cumsum(lengths[order], out=ptr[1:])
        dest = np.empty(m, np.int64)
        dest[order] = ptr[:-1]
    idx = _gather_binary(table.column(idx_col), np.int32, dest, int(ptr[-1]))
    val = _gather_binary(table.column(val_col), np.float32, dest, int(ptr[-1]))
    Z = sp.csr_matrix((val, idx, ptr), shape=(m, n_cols))
    Z.sum_duplicates()
    return Z


@njit()
def _copy_segments(src, starts, lengths, dest, out):
    """``out[dest[k]:dest[k] + lengths[k]] = src[starts[k]:starts[k] + lengths[k]]`` for every k:
    rows of a flat buffer moved to their places in another, one pass, no index array."""
    for k in range(len(starts)):
        s, d = starts[k], dest[k]
        for j in range(lengths[k]):
            out[d + j] = src[s + j]


def _gather_binary(column, dtype, dest: np.ndarray, nnz: int) -> np.ndarray:
    """The values of a binary column (:func:`binary_segments`), row r's at ``dest[r]`` of one new
    ``dtype`` array of ``nnz`` values; each chunk's buffer is read in place."""
    out = np.empty(nnz, dtype)
    size, row = np.dtype(dtype).itemsize, 0
    for col in getattr(column, "chunks", [column]):
        offs = _binary_offsets(col).astype(np.int64)
        data = col.buffers()[2]
        if data is not None and len(offs) and offs[-1] > offs[0]:
            src = np.frombuffer(data, np.uint8)[offs[0]:offs[-1]].view(dtype)
            _copy_segments(src, (offs[:-1] - offs[0]) // size, np.diff(offs) // size, dest[row:row + len(col)], out)
        row += len(col)
    return out


def grouped_apply(df, keys, func: Callable[[pa.Table], pa.Table], schema: str):
    """``df.groupBy(keys)`` then ``func`` on each group as an Arrow table.

    Uses ``applyInArrow`` (Spark >= 4.0); on Spark 3.5 falls back to ``applyInPandas``
    with an Arrow round trip, so kernels always see Arrow.
    """
    g = df.groupBy(*keys)
    if hasattr(g, "applyInArrow"):
        return g.applyInArrow(func, schema)

    def pandas_func(pdf):  # pragma: no cover - Spark 3.5 path
        return func(pa.Table.from_pandas(pdf, preserve_index=False)).to_pandas()

    return g.applyInPandas(pandas_func, schema)


def cogrouped_apply(left, right, keys, func: Callable[[pa.Table, pa.Table], pa.Table], schema: str):
    """``left.groupBy(keys).cogroup(right.groupBy(keys))`` then ``func`` on each cogroup (both
    sides as Arrow tables, either may be empty): ``applyInArrow`` on Spark >= 4.0,
    ``applyInPandas`` with an Arrow round trip in each side's own schema on Spark 3.5 (an empty
    pandas side would otherwise come back with untyped columns)."""
    cogrouped = left.groupBy(*keys).cogroup(right.groupBy(*keys))
    if hasattr(cogrouped, "applyInArrow"):
        return cogrouped.applyInArrow(func, schema)
    from pyspark.sql.pandas.types import to_arrow_schema  # pragma: no cover - Spark 3.5 path
    ls, rs = to_arrow_schema(left.schema), to_arrow_schema(right.schema)

    def pandas_func(lp, rp):  # pragma: no cover - Spark 3.5 path
        return func(pa.Table.from_pandas(lp, schema=ls, preserve_index=False),
                    pa.Table.from_pandas(rp, schema=rs, preserve_index=False)).to_pandas()

    return cogrouped.applyInPandas(pandas_func, schema)


ARROW_CODEC = "spark.sql.execution.arrow.compression.codec"    # Spark >= 4.2 (an unknown key before: no effect)


def to_arrow(df, compress: bool = False) -> pa.Table:
    """Collect a DataFrame as one Arrow table (``toArrow`` on Spark >= 4, else via pandas).
    ``compress`` (classic Spark): the tasks send their Arrow batches compressed (zstd; pyarrow
    reads them as they are), set for this query only, for a result of O(labels) rows from a query
    with no Python UDF: Spark compresses the input of the query's Python UDFs under the same
    setting. Measured at 1M (the jobs' task results): a label count 1.52 -> 0.35 MB, the tree 1.65 -> 0.43 MB."""
    if hasattr(df, "toArrow"):
        if not compress or is_connect(df):
            return df.toArrow()
        with session_settings(df.sparkSession, {ARROW_CODEC: "zstd"}, "a compressed collect"):
            return df.toArrow()
    return pa.Table.from_pandas(df.toPandas(), preserve_index=False)  # pragma: no cover - Spark 3.5


def to_pandas(df):
    """Collect a DataFrame of O(labels) rows read from a table or a checkpoint (a tree, its
    slots) as pandas, compressed on the way (:func:`to_arrow`)."""
    return to_arrow(df, compress=True).to_pandas()


def local_frame(spark, columns, schema: Optional[str] = None):
    """A DataFrame of driver-side data, sent to Spark as one Arrow table: ``columns`` is a
    ``pa.Table`` or name -> ``pa.Array`` with its Spark type's Arrow type (int32 for int, int64
    for long, float64 for double, string, list<int64> for array<long>); ``schema`` (DDL) when the
    table's own types are not the wanted ones. ``spark.createDataFrame`` of a Python list goes
    through a Python RDD instead, whose tasks start Python workers of their own (a second worker
    daemon: the RDD's environment is not SQL's), about a second of a local run for a one-row table.
    Spark 3.5 takes no Arrow table: it gets the table through pandas, which the session's
    ``spark.sql.execution.arrow.pyspark.enabled`` sends as Arrow too."""
    import pyspark
    table = columns if isinstance(columns, pa.Table) else pa.table(columns)
    if int(pyspark.__version__.split(".")[0]) >= 4:
        return spark.createDataFrame(table, schema=schema)
    from pyspark.sql.pandas.types import from_arrow_schema  # pragma: no cover - Spark 3.5
    return spark.createDataFrame(table.to_pandas(), schema=schema or from_arrow_schema(table.schema))
