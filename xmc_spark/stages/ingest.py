"""Ingest: XC-repository text, svmlight/libsvm multi-label, Parquet or Delta -> samples table.

Every input is checked in full before anything is written: the first bad line (or row) raises
:class:`IngestError` naming the file, the line and the problem, and no table is written.

Text goes one of two ways, each a check job then a write job, never Python per line:

- **fast** (:func:`_fast_lines`): each Arrow batch of lines is parsed by the numba kernel
  :func:`~..kernels.text_parse.parse_lines`, which reads the plain forms of ids and values only.
  When every data line is in those forms and every id in range, the file is written through
  the same kernel (:func:`_fast_finish`).
- **SQL** (otherwise): Spark SQL expressions parse the lines, a compiled screen
  (:func:`_text_ok`) passes the good ones, and the lambda-based checks name the first problem
  of the others; a file whose unusual forms are all valid (``+1``, ``1f``, hex floats, ...) is
  parsed by the same SQL.

Parquet and Delta tables are checked in one job the same way (:func:`read_table`): a cheap
screen (:func:`_table_ok`) passes the good rows, and the lambda-based checks name the first problem
of the others.
"""
from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from ..arrow_utils import list_array, list_offsets_values, to_arrow
from ..compat import is_connect, session_settings, sized_partitions, small_result
from ..kernels.sparse import csr_from_lists, normalize_lists
from ..params import IngestParams
from ..progress import worker_progress
from ..schemas import SAMPLES_SCHEMA, IngestError, check_samples_columns
from ..storage import StorageError, file_size, hadoop_fs, is_delta, list_names, path_kind, write_delta

log = logging.getLogger("xmc_spark.ingest")


@dataclass
class DatasetInfo:
    path: str
    fmt: str
    n_samples: int
    n_features: int
    n_labels: int
    n_rows_merged_features: int = 0   # rows listing a feature index twice (their values were summed)
    # per label, the rows carrying it (n_labels long), when the check job counted them (count_labels;
    # with seen_labels alone, of the labels outside them only, 0 for the others)
    label_counts: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    rows_with_unseen: Optional[int] = None   # rows with a label outside seen_labels, when given
    n_nonzeros: Optional[int] = None   # feature entries of all rows as written (a repeated index counted twice)
    # sum over the rows of labels x feature entries, as written: the most non-zeros the PIFA partials hold
    n_label_nonzeros: Optional[int] = None


def _detect(spark: SparkSession, path: str):
    """(format, first line of a text file or None): the first line is read once, here."""
    if is_delta(spark, path):
        return "delta", None
    if path.rstrip("/").endswith(".parquet") or _has_parquet_parts(spark, path):
        return "parquet", None
    if not _exists(spark, path):
        raise IngestError(f"{path}: no such file or directory")
    first = _first_line(spark, path)
    if first is None:
        raise IngestError(f"{path}: the file is empty")
    if path.rstrip("/").endswith((".svm", ".svmlight", ".libsvm")):
        return "svmlight", first
    # an XC header holds only integers; an svmlight line always has index:value tokens
    toks = first.split()
    if ":" not in first and all(t.lstrip("-").isdigit() for t in toks):
        return "xc", first
    return "svmlight", first


def _has_parquet_parts(spark: SparkSession, path: str) -> bool:
    return any(n.endswith(".parquet") for n in list_names(spark, path))


def _exists(spark: SparkSession, path: str) -> bool:
    return path_kind(spark, path) is not None


def _first_line(spark: SparkSession, path: str) -> Optional[str]:
    """The first line of a text input, None when it is empty. A single file is read through
    Hadoop's FileSystem (decompressed by its codec) with no Spark job; a folder, or any input on
    Spark Connect (no Hadoop file system in the client), by Spark (the server's view of the path)."""
    fs = hadoop_fs(spark, path)
    if fs is None or fs[0].getFileStatus(fs[1]).isDirectory():
        with _read_errors(path):
            row = spark.read.text(path).first()
        return None if row is None else row[0]
    fs, hpath = fs
    jvm = spark.sparkContext._jvm
    stream = fs.open(hpath)
    try:
        codec = jvm.org.apache.hadoop.io.compress.CompressionCodecFactory(
            spark.sparkContext._jsc.hadoopConfiguration()).getCodec(hpath)
        if codec is not None:
            stream = codec.createInputStream(stream)
        return jvm.java.io.BufferedReader(jvm.java.io.InputStreamReader(stream, "UTF-8")).readLine()
    finally:
        stream.close()


# JVM errors that mean the input itself cannot be read (corrupt, truncated, gone, or no Parquet in it)
_READ_FAILURES = ("FAILED_READ_FILE", "org.apache.parquet.", "java.io.EOFException", "java.util.zip.ZipException",
                  "UNABLE_TO_INFER_SCHEMA", "PATH_NOT_FOUND")


@contextmanager
def _read_errors(path: str):
    """Turn a Spark failure to read ``path`` (a corrupt or truncated Parquet file, a broken
    compressed text file) into an :class:`IngestError` naming the file and the deepest cause."""
    try:
        yield
    except (Py4JJavaError, PySparkException) as e:
        text = str(e)
        if not any(m in text for m in _READ_FAILURES):
            raise
        causes = re.findall(r"(?:Caused by: |^: )([\w.$]+(?:Exception|Error)): ([^\n]*)", text, re.M)
        cls, msg = causes[-1] if causes else ("", text.strip().splitlines()[0])
        raise IngestError(f"{path}: cannot read the input ({cls.rsplit('.', 1)[-1]}: {msg.strip()[:200]})") from None


# ---- line numbers of text input ----------------------------------------------------------------
def text_lines(spark: SparkSession, path: str, *columns: str, blank_as: Optional[str] = None) -> DataFrame:
    """The lines (``value``) of a text input with ``_pid`` (input partition) and ``_mid``
    (``monotonically_increasing_id``), which :class:`Lines` turns into line numbers, and
    ``columns`` (SQL over these and each other), all in one projection. ``blank_as``: a blank
    line reads as this text (features-only input, where a blank line is a row without features)."""
    lines = spark.read.text(path)
    if blank_as is not None:
        lines = lines.select(F.when(F.trim("value") == "", F.lit(blank_as)).otherwise(F.col("value")).alias("value"))
    return lines.selectExpr("value", "spark_partition_id() AS _pid", "monotonically_increasing_id() AS _mid", *columns)


def one_split(spark: SparkSession, path: str) -> bool:
    """True when Spark reads the input ``path`` as one partition for sure: a single file no
    larger than both spark.sql.files.maxPartitionBytes and openCostInBytes (a size hint: small
    inputs are validated by one task, without a shuffle)."""
    try:
        size = file_size(spark, path)
    except StorageError:            # a Spark Connect client that cannot see the path: no hint
        return False
    if size is None:
        return False
    limit = min(_conf_bytes(spark, "spark.sql.files.maxPartitionBytes", 128 << 20),
                _conf_bytes(spark, "spark.sql.files.openCostInBytes", 4 << 20))
    return size <= limit


def _conf_bytes(spark: SparkSession, key: str, default: int) -> int:
    """A byte-size SQL setting ("134217728", "128MB", "4m") as bytes (classic and Connect)."""
    v = spark.conf.get(key, None)
    if v is None:
        return default
    m = re.fullmatch(r"\s*(\d+)\s*([kmgtp]?)i?b?\s*", str(v).lower())
    if not m:
        return default
    return int(m.group(1)) << (10 * " kmgtp".index(m.group(2) or " "))


def first_where(cond: str, value: str) -> str:
    """An aggregate (SQL) for :class:`Lines`: the first row (in file order) where ``cond``
    holds, with its ``value``; read it with :meth:`Lines.first`."""
    return f"min(CASE WHEN {cond} THEN struct(_mid AS mid, {value} AS value) END)"


class Lines:
    """Line numbers of a :func:`text_lines` frame, from one Spark job that counts the rows of
    each input partition and computes the SQL aggregates ``aggs`` per partition. With
    ``one_split`` (see :func:`one_split`) that job is one task with no shuffle (a global
    aggregate over ``coalesce(1)``), checked to have seen one partition, else redone by partition.
    With ``by_label`` the job also counts the rows of each label, and ``parts`` are dicts decoded
    from JSON (longs, booleans, strings and structs of them, the aggregates used here, come back
    unchanged), else Rows; ``n_labels`` (when every counted label is known to be below it) sizes
    that job's reduce side on classic Spark: its input, at most a row per label of each input
    partition (the map side's partial sums), is read by the tasks that many rows need
    (:func:`~..compat.small_result`), not by ``spark.sql.shuffle.partitions`` tasks, nearly all
    empty where adaptive execution does not coalesce them, each reporting its metrics; each
    task's label rows come back packed (:func:`_packed_counts`)."""

    def __init__(self, df: DataFrame, one_split: bool = False, count: str = "count(1)", by_label: bool = False,
                 n_labels: Optional[int] = None, **aggs: str):
        exprs = [f"{count} AS _n", "min(_mid) AS _m0", *[f"{c} AS {k}" for k, c in aggs.items()]]
        parts = None
        # with by_label: the labels of the rows whose _label is set, and their counts
        self._label_ids = self._label_n = np.zeros(0, np.int64)
        if one_split and not by_label:
            r = df.coalesce(1).agg(*[F.expr(e) for e in ("min(_pid) AS _pid", "max(_pid) AS _last_pid",
                                                         *exprs)]).collect()[0]
            if r["_pid"] == r["_last_pid"]:
                parts = [r] if r["_n"] else []
        if parts is None and by_label:
            # one job: rows with _label null give the partitions' aggregates, rows with _pid null
            # the labels' counts (O(partitions + labels) rows), collected as one Arrow table: as
            # Python Rows they cost 16-26 us a label (1.3 s for 50K labels, 16-23 s for 1M), as
            # columns a copy
            agg = df.groupBy("_pid", "_label").agg(*[F.expr(e) for e in exprs])
            if n_labels and not is_connect(df):
                # the map side's partial sums leave at most a row per label of each input partition
                agg = small_result(agg, n_labels * df.rdd.getNumPartitions())
            names = [c for c in agg.columns if c != "_label"]
            # narrow rows: a label's id and count, a partition's aggregates as one JSON string;
            # each task's labels and counts then packed into one row (_packed_counts)
            rows = to_arrow(agg.select(F.col("_label").cast("int").alias("_label"), "_n", F.when(
                F.col("_label").isNull(), F.to_json(F.struct(*names), {"ignoreNullFields": "false"})).alias("_part"))
                .mapInArrow(_packed_counts, PACKED_COUNTS_SCHEMA))
            parts = [json.loads(p) for p in rows.column("_part").drop_null().to_pylist()]
            self._label_ids, self._label_n = unpacked_counts(rows)
        elif parts is None:
            parts = df.groupBy("_pid").agg(*[F.expr(e) for e in exprs]).collect()
        self.parts = sorted(parts, key=lambda r: r["_pid"])
        self._base, acc = {}, 0
        for r in self.parts:
            self._base[r["_pid"]] = acc - r["_m0"]          # line = base of the partition + _mid + 1
            acc += r["_n"]
        self.n = acc                                         # lines in all

    def label_counts(self, n_labels: int) -> np.ndarray:
        """The ``by_label`` counts as a vector of ``n_labels`` (every counted label is below it: the
        range check passed)."""
        counts = np.zeros(n_labels, np.int64)
        counts[self._label_ids] = self._label_n
        return counts

    def values(self, name: str) -> list:
        """The non-null per-partition values of aggregate ``name``."""
        return [r[name] for r in self.parts if r[name] is not None]

    def first(self, name: str) -> Optional[Tuple[int, Any]]:
        """(line, value) of the first row found by the :func:`first_where` aggregate ``name``."""
        hits = [(self._base[r["_pid"]] + r[name]["mid"] + 1, r[name]["value"])
                for r in self.parts if r[name] is not None]
        return min(hits, key=lambda h: h[0]) if hits else None

    def line(self) -> Column:
        """Each row's 1-based line number (no Spark job: a literal array indexed by ``_pid``)."""
        if not self.parts:
            return F.lit(None).cast("long")
        base = [0] * (self.parts[-1]["_pid"] + 1)
        for pid, b in self._base.items():
            base[pid] = b
        return F.expr(f"element_at(array({', '.join(f'CAST({b} AS BIGINT)' for b in base)}), _pid + 1) + _mid + 1")


PACKED_COUNTS_SCHEMA = "_part string, _k int, _ids binary, _ns binary"


def _packed_counts(batches):
    """The reduce side of :class:`Lines`' label counts, in each task: a partition's aggregates
    (``_part``) pass as they are; the task's (label, count) rows become one row of ``_k`` labels
    in two zstd-compressed buffers, the labels sorted as int32 gaps and their int64 counts. As
    Arrow columns they were 12-17 bytes a label (~0.85 MB to the driver for 50K labels); packed,
    a byte or two."""
    ids, ns = [], []
    for b in batches:
        label = b.column("_label")
        part = pc.is_null(label)
        if pc.any(part).as_py():
            p = pc.filter(b.column("_part"), part).cast(pa.string())    # (a large_string with large var types)
            yield pa.RecordBatch.from_arrays([p, pa.nulls(len(p), pa.int32()), pa.nulls(len(p), pa.binary()),
                                              pa.nulls(len(p), pa.binary())], names=["_part", "_k", "_ids", "_ns"])
        keep = pc.invert(part)
        ids.append(pc.filter(label, keep).to_numpy(zero_copy_only=False).astype(np.int64))
        ns.append(pc.filter(b.column("_n"), keep).to_numpy(zero_copy_only=False).astype(np.int64))
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if len(ids):
        order = np.argsort(ids, kind="stable")
        gaps = np.diff(ids[order], prepend=0).astype(np.int32)
        codec = pa.Codec("zstd")
        yield pa.RecordBatch.from_arrays([
            pa.nulls(1, pa.string()), pa.array([len(ids)], pa.int32()),
            pa.array([codec.compress(gaps.tobytes(), asbytes=True)], pa.binary()),
            pa.array([codec.compress(np.concatenate(ns)[order].tobytes(), asbytes=True)], pa.binary())],
            names=["_part", "_k", "_ids", "_ns"])


def unpacked_counts(rows: pa.Table) -> Tuple[np.ndarray, np.ndarray]:
    """(label ids, their counts), int64, of the packed rows of :func:`_packed_counts`."""
    codec = pa.Codec("zstd")
    ids, ns = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for k, i, n in zip(*(rows.column(c).to_pylist() for c in ("_k", "_ids", "_ns"))):
        if k is not None:
            ids.append(np.cumsum(np.frombuffer(codec.decompress(i, 4 * k, asbytes=True), np.int32), dtype=np.int64))
            ns.append(np.frombuffer(codec.decompress(n, 8 * k, asbytes=True), np.int64))
    return np.concatenate(ids), np.concatenate(ns)


# ---- parsing and validation: Spark SQL, one projection and one aggregation job ----------------
ID_END = 2 ** 31 - 1            # ids and their count (max id + 1) must fit an int


def _id_end(n: Optional[int]) -> int:
    """The exclusive upper bound of ids given a declared count ``n`` (None: only the int limit)."""
    return min(n or ID_END, ID_END)
_FLOAT_MAX = 3.4028234663852886e38
_BAD_TOKEN = "t -> size(split(t, ':')) != 2"


def _token_sql(one_based: bool):
    """SQL over a token ``t`` = 'index:value': (its 0-based index, its value), NULL if unreadable."""
    return (f"try_subtract(try_cast(substring_index(t, ':', 1) AS BIGINT), {int(one_based)})",
            "try_cast(substring_index(t, ':', -1) AS FLOAT)")


def _text_columns(one_based: bool) -> list:
    """SQL for ``value`` lines -> tokens, labels and features (bigint ids: an id beyond int is
    caught by the range checks). One projection over lateral aliases; no Python per line."""
    idx, val = _token_sql(one_based)
    return [
        r"filter(split(value, '\\s+'), t -> t != '') AS _toks",
        # the label list is the first field: a line that starts with whitespace has none
        r"CASE WHEN NOT value RLIKE '^\\s' AND NOT contains(get(_toks, 0), ':') THEN get(_toks, 0) END AS _lab",
        # svmlight files may carry qid:N tokens; they are not features
        "filter(_toks, (t, i) -> (i > 0 OR _lab IS NULL) AND NOT startswith(t, 'qid:')) AS _ft",
        "transform(coalesce(split(_lab, ','), CAST(array() AS array<string>)), x -> try_cast(x AS BIGINT))"
        " AS label_idx",
        f"transform(_ft, t -> {idx}) AS feature_idx",
        f"transform(_ft, t -> {val}) AS feature_val",
    ]


def _token_error_sql(one_based: bool) -> str:
    """SQL over the columns of :func:`_text_columns`: the first token-level problem of a line
    (NULL if none); an expression, not a column, so that only the lines :func:`_text_ok`
    rejects evaluate it. A quote inside a literal is written \\' (Spark 3.5 reads '' as two adjacent
    literals, which drops the quote)."""
    idx, val = _token_sql(one_based)
    return f"""(CASE WHEN size(_toks) = 0 THEN 'empty line'
            WHEN exists(_ft, {_BAD_TOKEN}) THEN concat('malformed feature token (expected index:value): \\'',
                get(filter(_ft, {_BAD_TOKEN}), 0), '\\'')
            WHEN exists(label_idx, x -> x IS NULL) THEN concat('label id is not an integer in \\'', _lab, '\\'')
            WHEN exists(feature_idx, x -> x IS NULL) THEN concat('feature index is not an integer: \\'',
                get(filter(_ft, t -> {idx} IS NULL), 0), '\\'')
            WHEN exists(feature_val, x -> x IS NULL) THEN concat('feature value is not a number: \\'',
                get(filter(_ft, t -> {val} IS NULL), 0), '\\'')
            END)"""


def _error_sql(d: Optional[int], L: Optional[int], first: Optional[str] = None) -> str:
    """SQL: the first problem of a row as a message, NULL when the row is fine; ``first`` (a
    message or NULL) goes before the range and value checks."""
    def first_of(col, pred):
        return f"CAST(get(filter({col}, x -> {pred}), 0) AS STRING)"

    checks = [] if first is None else [(f"{first} IS NOT NULL", first)]
    for col, what, end in (("label_idx", "label id", L), ("feature_idx", "feature index", d)):
        end = _id_end(end)
        checks += [(f"exists({col}, x -> x < 0)", f"concat('negative {what} ', {first_of(col, 'x < 0')})"),
                   (f"exists({col}, x -> x >= {end})",
                    f"concat('{what} ', {first_of(col, f'x >= {end}')}, ' out of range [0, {end})')")]
    # abs of a double: an integer feature_val (allowed) at its type's minimum would overflow (ANSI)
    checks += [("exists(feature_val, x -> isnan(x) OR abs(CAST(x AS DOUBLE)) = double('inf'))",
                "'feature value is NaN or infinite'"),
               (f"exists(feature_val, x -> abs(CAST(x AS DOUBLE)) > {_FLOAT_MAX!r})",
                f"concat('feature value ', {first_of('feature_val', f'abs(CAST(x AS DOUBLE)) > {_FLOAT_MAX!r}')}, "
                "' does not fit a float')")]
    return "CASE " + " ".join(f"WHEN {c} THEN {m}" for c, m in checks) + " END"


_REPEATED = "size(array_distinct(feature_idx)) != size(feature_idx)"    # a feature index listed twice

# A line whose label field (if any) has no ':' and whose every other token has exactly one ':'
# (Java regex, as Spark's split): no token-format error is possible on it.
_WELL_FORMED = r"^(?:[^\\s:]+|[^\\s:]*:[^\\s:]*)?(?:\\s+[^\\s:]*:[^\\s:]*)*\\s*$"


def _no_nulls(col: str) -> str:
    return f"size(array_compact({col})) = size({col})"


def _quick_ok(d: Optional[int], L: Optional[int]) -> str:
    """SQL: a sufficient condition for :func:`_error_sql` to find nothing in a row's parsed
    arrays (ranges, NaN/infinite/too large values), from array_min/array_max only: Spark compiles
    these, while the lambdas of :func:`_error_sql` are interpreted element by element, so every
    row is screened by this and only a row that fails it is described by the full checks."""
    conds = []
    for col, end in (("label_idx", L), ("feature_idx", d)):
        end = _id_end(end)
        conds += [f"coalesce(array_min({col}), 0) >= 0", f"coalesce(array_max({col}), 0) < {end}"]
    # NaN sorts above every number in Spark, so a NaN is the array's max
    conds += [f"coalesce(array_max(feature_val), 0) <= {_FLOAT_MAX!r}",
              f"coalesce(array_min(feature_val), 0) >= {-_FLOAT_MAX!r}"]
    return " AND ".join(conds)


def _text_ok(d: Optional[int], L: Optional[int]) -> str:
    """SQL: a sufficient condition for a parsed text line to have no problem at all
    (:func:`_token_error_sql` and :func:`_error_sql` both NULL), with one lambda pass per array
    (``array_compact``) instead of the full checks' (see :func:`_quick_ok`)."""
    return " AND ".join([f"value RLIKE '{_WELL_FORMED}'", "size(_toks) > 0", _no_nulls("label_idx"),
                         _no_nulls("feature_idx"), _no_nulls("feature_val"), _quick_ok(d, L)])


def _finish(df: DataFrame, normalize: bool) -> DataFrame:
    """Sorted distinct labels and (optionally) unit-norm rows, vectorized per Arrow batch."""
    def fix(batches):
        for b in batches:
            t = pa.Table.from_batches([b])
            yield from finish_batch(t, normalize).to_batches()
            worker_progress("ingest", rows=t.num_rows)

    weight = {"weight": "weight" if "weight" in df.columns else "1.0"}
    return df.selectExpr(*[f"CAST({weight.get(f.name, f.name)} AS {f.dataType.simpleString()}) AS {f.name}"
                           for f in SAMPLES_SCHEMA.fields]).mapInArrow(fix, SAMPLES_SCHEMA)


def finish_batch(t: pa.Table, normalize: bool) -> pa.Table:
    """Each row's labels sorted and distinct, its features sorted by index with the values of a
    repeated index summed, then (optionally) scaled to unit L2 norm."""
    off, lab = list_offsets_values(t, "label_idx")
    Y = csr_from_lists(off, lab, None, int(lab.max()) + 1 if len(lab) else 1)
    foff, fidx = list_offsets_values(t, "feature_idx")
    _, fval = list_offsets_values(t, "feature_val")
    X = csr_from_lists(foff, fidx, fval, int(fidx.max()) + 1 if len(fidx) else 1)
    if normalize:
        X.data = normalize_lists(X.indptr, X.data)
    return pa.table({
        "sample_id": t.column("sample_id"),
        "feature_idx": list_array(X.indptr, X.indices.astype(np.int32), pa.int32()),
        "feature_val": list_array(X.indptr, X.data, pa.float32()),
        "label_idx": list_array(Y.indptr, Y.indices.astype(np.int32), pa.int32()),
        "weight": t.column("weight"),
    })


def read_text(spark: SparkSession, path: str, fmt: str, params: IngestParams,
              expect_features: Optional[int] = None, expect_labels: Optional[int] = None,
              header: Optional[str] = None, count_labels: bool = False, seen_labels=None,
              features_only: bool = False):
    """Parse and validate an XC or svmlight text file; returns (DataFrame, DatasetInfo).

    One Spark job validates every line and counts the lines of each input partition; line
    numbers (for errors) and sample ids (line order) follow from those counts. On the fast path
    the same job gives ``info.label_counts`` (``count_labels``) and ``info.rows_with_unseen``
    (``seen_labels``: a boolean vector over labels); see :func:`read_samples`.
    """
    header_n = None
    d = params.num_features or expect_features
    L = params.num_labels or expect_labels
    if fmt == "xc":
        if header is None:
            header = _first_line(spark, path) or ""
        toks = header.split()
        # a features-only file may have the XC repository's sparse-matrix header 'num_rows num_columns'
        if not (len(toks) == 3 or (features_only and len(toks) == 2)) or not all(t.isdigit() for t in toks):
            also = " or 'num_rows num_features'" if features_only else ""
            raise IngestError(f"{path}:1: malformed header {header!r} "
                              f"(expected 'num_samples num_features num_labels'{also})")
        header_n, hd, hL = (int(t) for t in (toks + ["0"])[:3])
        if expect_features and hd != expect_features:
            log.warning("%s declares %d features, the model/training set has %d", path, hd, expect_features)
        d = params.num_features or max(hd, expect_features or 0)
        L = params.num_labels or max(hL, expect_labels or 0)
        one_based = False
    else:
        one_based = params.svmlight_one_based
    is_data = "_mid != 0" if fmt == "xc" else "true"     # the XC header is the first line of the first split
    # features-only input (the XC sparse-matrix format): a blank line is a row without features,
    # read as one explicit zero (no labels: it starts with a space)
    blank = f" {int(one_based)}:0" if features_only else None
    with _read_errors(path):
        lines = _fast_lines(spark, path, is_data, one_based, d, L, count_labels, seen_labels, blank)
    if lines is not None:          # every line in the plain forms: parsed by the numba kernel
        data = text_lines(spark, path, blank_as=blank).where(is_data).select(
            "value", (lines.line() - 1 - (1 if fmt == "xc" else 0)).alias("sample_id"))
        info = _info(path, fmt, lines, header_n, d, L)
        if count_labels or seen_labels is not None:
            info.label_counts = lines.label_counts(info.n_labels)
        if seen_labels is not None:
            info.rows_with_unseen = int(sum(lines.values("unseen")))
        return _fast_finish(data, path, one_based, params.normalize), info
    # a blank line is an error, not an empty sample (a final newline makes no line at all)
    # the full checks run only on the lines the compiled screen rejects
    err = _error_sql(d, L, first=_token_error_sql(one_based))
    parsed = text_lines(spark, path, *_text_columns(one_based),
                        f"CASE WHEN {is_data} AND NOT coalesce({_text_ok(d, L)}, false) THEN {err} END AS _err",
                        blank_as=blank)
    rep = f"{is_data} AND {_REPEATED}"
    with _read_errors(path):
        lines = Lines(parsed, one_split(spark, path), err=first_where("_err IS NOT NULL", "_err"),
                      max_label=f"max(CASE WHEN {is_data} THEN array_max(label_idx) END)",
                      max_feature=f"max(CASE WHEN {is_data} THEN array_max(feature_idx) END)",
                      n_rep=f"count(CASE WHEN {rep} THEN 1 END)", rep=first_where(rep, "true"),
                      nnz=f"sum(CASE WHEN {is_data} THEN size(feature_idx) END)",
                      lnz=f"sum(CASE WHEN {is_data} THEN CAST(size(label_idx) AS BIGINT) * size(feature_idx) END)")
    bad = lines.first("err")
    if bad is not None:
        raise IngestError(f"{path}:{bad[0]}: {bad[1]}")
    info = _info(path, fmt, lines, header_n, d, L)
    data = parsed.where(is_data).withColumn("sample_id", lines.line() - 1 - (1 if fmt == "xc" else 0))
    return _finish(data, params.normalize), info


def _info(path: str, fmt: str, lines: Lines, header_n: Optional[int], d: Optional[int],
          L: Optional[int]) -> DatasetInfo:
    """The sizes of a validated text input (line counts against the XC header), with the
    warning about repeated feature indices."""
    skip = 1 if fmt == "xc" else 0
    n = lines.n - skip
    if n <= 0:
        raise IngestError(f"{path}: no samples (the file is empty{' after the header' if fmt == 'xc' else ''})")
    if header_n is not None and header_n != n:
        raise IngestError(f"{path}:1: header declares {header_n} samples but the file has {n} data lines")
    d = d or max(lines.values("max_feature"), default=-1) + 1
    L = L or max(lines.values("max_label"), default=-1) + 1
    n_rep = sum(lines.values("n_rep"))
    if n_rep:
        log.warning("%s:%d: %d line(s) list a feature index more than once (the first here); "
                    "their values are summed", path, lines.first("rep")[0], n_rep)
    return DatasetInfo(path, fmt, n, int(d), int(L), int(n_rep), n_nonzeros=int(sum(lines.values("nnz"))),
                       n_label_nonzeros=int(sum(lines.values("lnz"))))


# ---- the fast path: numba over each Arrow batch of lines ----------------------------------------
FAST_SCHEMA = ("_pid int, _mid long, n long, bad long, max_label long, max_feature long, n_rep long, "
               "rep long, unseen long, nnz long, lnz long, _label long")


def _line_bytes(col: pa.Array):
    """(bytes, offsets) of an Arrow string column, as numpy views."""
    col = col.cast(pa.large_string()) if not pa.types.is_large_string(col.type) else col
    off = np.frombuffer(col.buffers()[1], np.int64)[col.offset:col.offset + len(col) + 1]
    return np.frombuffer(col.buffers()[2], np.uint8) if len(col) else np.zeros(0, np.uint8), off


def _fast_lines(spark: SparkSession, path: str, is_data: str, one_based: bool, d: Optional[int],
                L: Optional[int], count_labels: bool = False, seen=None,
                blank_as: Optional[str] = None) -> Optional[Lines]:
    """:class:`Lines` of a text input whose every data line :func:`~..kernels.text_parse.parse_lines`
    parses (one Spark job, a summary row per Arrow batch), with ids in range; None otherwise (the
    SQL checks then find and name the problem, or accept the unusual forms).

    ``count_labels``: the same job counts the rows carrying each label (a row's labels counted
    once, as the samples table keeps them: :meth:`Lines.label_counts`); ``seen`` (a boolean
    vector over labels) also counts the rows with a label it does not hold (``unseen``), and
    without ``count_labels`` counts the rows of those labels only (all that the unseen labels'
    report needs: the other labels' counts would come to the driver for nothing)."""
    from ..compat import share
    from ..kernels.metrics import unseen as unseen_rows
    from ..kernels.text_parse import parse_lines
    by_label = count_labels or seen is not None
    shared = None

    def screen(batches):
        known = shared.value if shared is not None else None
        for b in batches:
            if not b.num_rows:
                continue
            buf, off = _line_bytes(b.column("value"))
            data = b.column("_data").to_numpy(zero_copy_only=False)
            mid = b.column("_mid").to_numpy()
            ok, rep, lp, lab, fp, fidx, _ = parse_lines(buf, off, data, int(one_based))
            max_label = int(lab.max()) if len(lab) else -1    # of the ids as written: the range check's
            unseen = u = None
            if by_label and 0 <= max_label < ID_END:          # (ids past the int range are rejected anyway)
                Y = csr_from_lists(lp, lab, None, max_label + 1)     # each row's labels, distinct
                u, c = np.unique(Y.indices, return_counts=True)
                if known is not None:
                    unseen = unseen_rows(Y.indptr, Y.indices, known)[1]
                    if not count_labels:                      # only the unseen labels' counts are asked
                        new = u >= len(known)
                        new[~new] = ~known[u[~new]]
                        u, c = u[new], c[new]
            pid = b.column("_pid")[0].as_py()
            yield pa.RecordBatch.from_pydict({
                "_pid": pa.array([pid], pa.int32()),
                "_mid": pa.array([int(mid.min())], pa.int64()), "n": pa.array([b.num_rows], pa.int64()),
                "bad": pa.array([int(np.count_nonzero(data & ~ok))], pa.int64()),
                "max_label": pa.array([max_label], pa.int64()),
                "max_feature": pa.array([int(fidx.max()) if len(fidx) else -1], pa.int64()),
                "n_rep": pa.array([int(np.count_nonzero(rep))], pa.int64()),
                "rep": pa.array([int(mid[rep].min()) if rep.any() else None], pa.int64()),
                "unseen": pa.array([unseen], pa.int64()),
                "nnz": pa.array([int(fp[-1])], pa.int64()),
                "lnz": pa.array([int(np.diff(lp).astype(np.int64) @ np.diff(fp).astype(np.int64))], pa.int64()),
                "_label": pa.array([None], pa.int64())})
            if u is not None and len(u):
                none = pa.nulls(len(u), pa.int64())
                yield pa.RecordBatch.from_pydict({
                    "_pid": pa.nulls(len(u), pa.int32()), "_mid": none, "n": pa.array(c, pa.int64()),
                    "bad": none, "max_label": none, "max_feature": none, "n_rep": none, "rep": none,
                    "unseen": none, "nnz": none, "lnz": none, "_label": pa.array(u, pa.int64())})
            worker_progress("ingest (check)", rows=b.num_rows)

    try:
        if seen is not None:
            shared = share(spark, np.asarray(seen, np.bool_), name="the seen labels")
        summary = text_lines(spark, path, f"{is_data} AS _data", blank_as=blank_as) \
            .select("value", "_pid", "_mid", "_data") \
            .mapInArrow(screen, FAST_SCHEMA)
        # the counted labels are below L, else the range check rejects the fast path's result
        lines = Lines(summary, one_split(spark, path), count="sum(n)", by_label=by_label, n_labels=L,
                      bad="sum(bad)",
                      max_label="max(max_label)", max_feature="max(max_feature)", n_rep="sum(n_rep)",
                      unseen="sum(unseen)", nnz="sum(nnz)", lnz="sum(lnz)",
                      rep="min(CASE WHEN rep IS NOT NULL THEN struct(rep AS mid, true AS value) END)")
    finally:
        if shared is not None:
            shared.unpersist()
    if (sum(lines.values("bad")) or max(lines.values("max_label"), default=-1) >= _id_end(L)
            or max(lines.values("max_feature"), default=-1) >= _id_end(d)):
        return None
    return lines


def _fast_finish(data: DataFrame, path: str, one_based: bool, normalize: bool) -> DataFrame:
    """(value, sample_id) lines that :func:`_fast_lines` accepted -> samples (as :func:`_finish`)."""
    from ..kernels.text_parse import parse_lines

    def parse(batches):
        for b in batches:
            if not b.num_rows:
                continue
            buf, off = _line_bytes(b.column("value"))
            ok, _, lp, lab, fp, fidx, fval = parse_lines(buf, off, np.ones(b.num_rows, np.bool_), int(one_based))
            if not ok.all():           # the file changed between the check and this write
                raise IngestError(f"{path}: line with sample_id {b.column('sample_id')[int(np.argmin(ok))].as_py()} "
                                  "no longer reads as it did when checked (the input changed during ingest)")
            t = pa.table({"sample_id": b.column("sample_id"),
                          "feature_idx": list_array(fp, fidx.astype(np.int32), pa.int32()),
                          "feature_val": list_array(fp, fval, pa.float32()),
                          "label_idx": list_array(lp, lab.astype(np.int32), pa.int32()),
                          "weight": pa.array(np.ones(b.num_rows, np.float32))})
            yield from finish_batch(t, normalize).to_batches()
            worker_progress("ingest", rows=b.num_rows)

    return data.mapInArrow(parse, SAMPLES_SCHEMA)


# never NULL: the screen (:func:`_table_ok`) takes their negations, the full checks name them
_BAD_LENGTHS = "coalesce(size(feature_idx), 0) != coalesce(size(feature_val), 0)"
_BAD_WEIGHT = "weight IS NULL OR isnan(weight) OR weight < 0 OR abs(CAST(weight AS DOUBLE)) = double('inf')"


def _table_errors(columns) -> str:
    """SQL: the first row-level problem of an input table (before the range and value checks),
    on its own column types (the casts to the samples schema come after validation)."""
    checks = [(_BAD_LENGTHS, "'feature_idx and feature_val have different lengths'")]
    checks += [(f"exists({c}, x -> x IS NULL)", f"'{c} holds a null'") for c in ("feature_idx", "feature_val",
                                                                                  "label_idx")]
    if "weight" in columns:
        checks.append((_BAD_WEIGHT,
                       "concat('weight is ', coalesce(CAST(weight AS STRING), 'null'), ' (must be >= 0 and finite)')"))
    return "CASE " + " ".join(f"WHEN {c} THEN {m}" for c, m in checks) + " END"


def _table_ok(columns, d: Optional[int], L: Optional[int]) -> str:
    """SQL: a sufficient condition for an input table's row to have no problem at all
    (:func:`_table_errors` and :func:`_error_sql` both NULL), from compiled array functions and
    one lambda pass per array (``array_compact``, which Spark rewrites to a filter) instead of
    the full checks' up to seven (see :func:`_quick_ok`)."""
    conds = [f"NOT ({_BAD_LENGTHS})", *[_no_nulls(c) for c in ("feature_idx", "feature_val", "label_idx")]]
    if "weight" in columns:
        conds.append(f"NOT ({_BAD_WEIGHT})")
    return " AND ".join(conds + [_quick_ok(d, L)])


def read_table(spark: SparkSession, path: str, fmt: str, params: IngestParams,
               expect_features: Optional[int] = None, expect_labels: Optional[int] = None,
               features_only: bool = False):
    """Validate a Parquet/Delta samples table (schema, ranges, unique ids) in one Spark job;
    a corrupt file (Parquet page checksums are verified) is an :class:`IngestError`.
    ``features_only``: the ``label_idx`` column may be absent (read as empty)."""
    with _read_errors(path):
        raw = spark.read.format(fmt).option("parquet.page.verify-checksum.enabled", "true").load(path)
    if features_only and "label_idx" not in raw.columns:
        raw = raw.withColumn("label_idx", F.array().cast("array<int>"))
    df = check_samples_columns(raw, path)       # the schema (no job); its casts run after validation
    d = params.num_features or expect_features
    L = params.num_labels or expect_labels
    # the full checks (lambdas, interpreted element by element) run only on the rows the screen
    # does not pass, as for text inputs
    err = _error_sql(d, L, first=_table_errors(raw.columns))
    ok = _table_ok(raw.columns, d, L)
    checked = raw.selectExpr("*", f"CASE WHEN NOT coalesce({ok}, false) THEN {err} END AS _err")
    settings = {}
    if one_split(spark, path):
        checked = checked.coalesce(1)          # a small file: one task, no shuffle
    elif not is_connect(spark):
        # the ids' uniqueness (a shuffle of one row per id) in a reduce task per input split,
        # between the default parallelism and the shuffle partitions, not in all of those
        settings["spark.sql.shuffle.partitions"] = str(sized_partitions(spark, checked.rdd.getNumPartitions(), 1))
    with _read_errors(path), session_settings(spark, settings, "the ids' uniqueness check"):
        stats = checked.agg(*[F.expr(e) for e in (
            "count(1) AS n", "count(sample_id) AS n_ids", "count(DISTINCT sample_id) AS n_distinct",
            "min(CASE WHEN _err IS NOT NULL THEN struct(sample_id, _err) END) AS err",
            "max(array_max(label_idx)) AS max_label", "max(array_max(feature_idx)) AS max_feature",
            f"count(CASE WHEN {_REPEATED} THEN 1 END) AS n_rep",
            f"min(CASE WHEN {_REPEATED} THEN sample_id END) AS rep",
            "sum(size(feature_idx)) AS nnz",
            "sum(CAST(greatest(size(label_idx), 0) AS BIGINT) * size(feature_idx)) AS lnz",
        )]).first()
    if stats["n"] == 0:
        raise IngestError(f"{path}: the table has no rows")
    if stats["n_ids"] != stats["n"]:
        raise IngestError(f"{path}: {stats['n'] - stats['n_ids']} row(s) with a null sample_id")
    if stats["err"] is not None:
        raise IngestError(f"{path}: row with sample_id {stats['err']['sample_id']}: {stats['err']['_err']}")
    if stats["n_distinct"] != stats["n"]:
        dup = df.groupBy("sample_id").count().filter("count > 1").orderBy("sample_id").first()
        raise IngestError(f"{path}: duplicate sample_id {dup['sample_id']} ({dup['count']} rows)")
    d = d or (stats["max_feature"] or 0) + 1
    L = L or (stats["max_label"] or 0) + 1
    if stats["n_rep"]:
        log.warning("%s: %d row(s) list a feature index more than once (the first: sample_id %d); "
                    "their values are summed", path, stats["n_rep"], stats["rep"])
    return (_finish(df, params.normalize),
            DatasetInfo(path, fmt, int(stats["n"]), int(d), int(L), int(stats["n_rep"]),
                        n_nonzeros=int(stats["nnz"] or 0), n_label_nonzeros=int(stats["lnz"] or 0)))


def read_samples(spark: SparkSession, path: str, params: IngestParams, fmt: Optional[str] = None,
                 expect_features: Optional[int] = None, expect_labels: Optional[int] = None,
                 count_labels: bool = False, seen_labels=None, features_only: bool = False):
    """Any supported input as a validated samples DataFrame plus its sizes.

    ``features_only`` (rows whose labels are not used, e.g. PRIME's label features): an XC file
    may also have the sparse-matrix header 'num_rows num_features', a blank line of a text file is
    a row without features (not an error), a table may lack ``label_idx``.

    ``count_labels``: where the check job can (plain XC or svmlight text), it also counts the
    rows carrying each label (``info.label_counts``, as :func:`~.evaluation.label_counts` of the
    written table); ``seen_labels`` (a boolean vector over labels): likewise the rows having a
    label it does not hold (``info.rows_with_unseen``), and, without ``count_labels``,
    ``info.label_counts`` counts the rows of those unseen labels only (0 for every seen label:
    :func:`~.evaluation.unseen_from_counts` needs no more). Otherwise both stay None."""
    first = None
    if fmt is None:
        fmt, first = _detect(spark, path)
    elif not _exists(spark, path):
        raise IngestError(f"{path}: no such file or directory")
    if fmt in ("xc", "svmlight"):
        return read_text(spark, path, fmt, params, expect_features, expect_labels, header=first,
                         count_labels=count_labels, seen_labels=seen_labels, features_only=features_only)
    if fmt in ("parquet", "delta"):
        return read_table(spark, path, fmt, params, expect_features, expect_labels, features_only)
    raise IngestError(f"{path}: unknown input format {fmt!r}")


def run(spark: SparkSession, path: str, out_table: str, params: IngestParams, fmt: Optional[str] = None,
        expect_features: Optional[int] = None, expect_labels: Optional[int] = None,
        run_key: Optional[str] = None) -> DatasetInfo:
    """Validate ``path`` and (only if it is valid) overwrite the Delta table ``out_table``
    (with ``run_key``: only that key's partition)."""
    df, info = read_samples(spark, path, params, fmt, expect_features, expect_labels)
    write_delta(df, out_table, run_key=run_key)
    log.info("ingested %s (%s): %d samples, %d features, %d labels -> %s",
             path, info.fmt, info.n_samples, info.n_features, info.n_labels, out_table)
    return info
