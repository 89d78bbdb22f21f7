"""Ingest: XC-repository text, svmlight/libsvm multi-label, Parquet or Delta -> samples table.

Parsing and validation are Spark SQL expressions (no Python per line). Every input is
checked in full before anything is written: the first bad line (or row) raises
:class:`IngestError` naming the file, the line and the problem, and no table is written.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from ..arrow_utils import list_array, list_offsets_values
from ..kernels.sparse import csr_from_lists, normalize_lists
from ..params import IngestParams
from ..progress import worker_progress
from ..schemas import SAMPLES_SCHEMA, IngestError, check_samples_columns
from ..storage import is_delta, write_delta

log = logging.getLogger("xmc_spark.ingest")


@dataclass
class DatasetInfo:
    path: str
    fmt: str
    n_samples: int
    n_features: int
    n_labels: int
    n_rows_merged_features: int = 0   # rows listing a feature index twice (their values were summed)


def _detect(spark: SparkSession, path: str):
    """(format, first line of a text file or None): the first line is read once, here."""
    if is_delta(spark, path):
        return "delta", None
    if path.rstrip("/").endswith(".parquet") or _has_parquet_parts(path):
        return "parquet", None
    if not _exists(spark, path):
        raise IngestError(f"{path}: no such file or directory")
    first = spark.read.text(path).first()
    if first is None:
        raise IngestError(f"{path}: the file is empty")
    if path.rstrip("/").endswith((".svm", ".svmlight", ".libsvm")):
        return "svmlight", first[0]
    # an XC header holds only integers; an svmlight line always has index:value tokens
    toks = first[0].split()
    if ":" not in first[0] and all(t.lstrip("-").isdigit() for t in toks):
        return "xc", first[0]
    return "svmlight", first[0]


def _has_parquet_parts(path: str) -> bool:
    return os.path.isdir(path) and any(f.endswith(".parquet") for f in os.listdir(path))


def _exists(spark: SparkSession, path: str) -> bool:
    jvm = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return fs.exists(hpath)


# ---- line numbers of text input ----------------------------------------------------------------
def text_lines(spark: SparkSession, path: str) -> DataFrame:
    """The lines (``value``) of a text input with ``_pid`` (input partition) and ``_mid``
    (``monotonically_increasing_id``), which :class:`Lines` turns into line numbers."""
    return (spark.read.text(path)
            .withColumn("_pid", F.spark_partition_id())
            .withColumn("_mid", F.monotonically_increasing_id()))


def first_where(cond: Column, value: Column) -> Column:
    """An aggregate for :class:`Lines`: the first row (in file order) where ``cond`` holds,
    with its ``value``; read it with :meth:`Lines.first`."""
    return F.min(F.when(cond, F.struct(F.col("_mid").alias("mid"), value.alias("value"))))


class Lines:
    """Line numbers of a :func:`text_lines` frame, from one Spark job that counts the rows of
    each input partition and computes the aggregates ``aggs`` (Columns) per partition."""

    def __init__(self, df: DataFrame, **aggs: Column):
        parts = df.groupBy("_pid").agg(F.count(F.lit(1)).alias("_n"), F.min("_mid").alias("_m0"),
                                       *[c.alias(k) for k, c in aggs.items()]).collect()
        self.parts = sorted(parts, key=lambda r: r["_pid"])
        self._base, acc = {}, 0
        for r in self.parts:
            self._base[r["_pid"]] = acc - r["_m0"]          # line = base of the partition + _mid + 1
            acc += r["_n"]
        self.n = acc                                         # lines in all

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


# ---- parsing and validation -------------------------------------------------------------------
def _parse_tokens(df: DataFrame, one_based: bool) -> DataFrame:
    """Split 'l1,l2 f:v f:v' lines into typed arrays plus checks, with SQL expressions."""
    toks = F.filter(F.split(F.trim(F.col("value")), r"\s+"), lambda t: t != "")
    df = df.withColumn("_toks", toks)
    has_labels = (F.size("_toks") > 0) & ~F.col("_toks")[0].contains(":")
    df = df.withColumn("_lab", F.when(has_labels, F.col("_toks")[0]))
    df = df.withColumn("_ft", F.filter(F.col("_toks"), lambda t, i: (i > 0) | ~has_labels))
    # svmlight files may carry qid:N tokens; they are not features
    df = df.withColumn("_ft", F.filter(F.col("_ft"), lambda t: ~t.startswith("qid:")))
    lab = F.when(F.col("_lab").isNull(), F.array().cast("array<string>")).otherwise(F.split("_lab", ","))
    shift = 1 if one_based else 0
    return (df
            .withColumn("_labs", lab)
            # SQL try_cast (Spark >= 3.2; Column.try_cast is 4.x-only): NULL for a non-number
            .withColumn("label_idx", F.expr("transform(_labs, x -> try_cast(x AS INT))"))
            .withColumn("_badtok", F.exists("_ft", lambda t: F.size(F.split(t, ":")) != 2))
            .withColumn("feature_idx",
                        F.expr(f"transform(_ft, t -> try_cast(substring_index(t, ':', 1) AS INT) - {shift})"))
            .withColumn("feature_val", F.expr("transform(_ft, t -> try_cast(substring_index(t, ':', -1) AS FLOAT))")))


def _error_column(n_features: Optional[int], n_labels: Optional[int]):
    """First problem of a row as a message, or NULL when the row is fine."""
    def first_bad(col, cond):
        return F.filter(col, cond)[0].cast("string")

    checks = [
        (F.col("_badtok"), F.concat(F.lit("malformed feature token (expected index:value): '"),
                                    F.filter("_ft", lambda t: F.size(F.split(t, ":")) != 2)[0], F.lit("'"))),
        (F.exists("label_idx", lambda x: x.isNull()),
         F.concat(F.lit("label id is not an integer in '"), F.col("_lab"), F.lit("'"))),
        (F.exists("feature_idx", lambda x: x.isNull()), F.lit("feature index is not an integer")),
        (F.exists("feature_val", lambda x: x.isNull()), F.lit("feature value is not a number")),
        (F.exists("label_idx", lambda x: x < 0),
         F.concat(F.lit("negative label id "), first_bad("label_idx", lambda x: x < 0))),
        (F.exists("feature_idx", lambda x: x < 0),
         F.concat(F.lit("negative feature index "), first_bad("feature_idx", lambda x: x < 0))),
        (F.exists("feature_val", lambda x: F.isnan(x) | (F.abs(x) == F.lit(float("inf")))),
         F.lit("feature value is NaN or infinite")),
    ]
    if n_labels:
        checks.append((F.exists("label_idx", lambda x: x >= n_labels),
                       F.concat(F.lit("label id "), first_bad("label_idx", lambda x: x >= n_labels),
                                F.lit(f" out of range [0, {n_labels})"))))
    if n_features:
        checks.append((F.exists("feature_idx", lambda x: x >= n_features),
                       F.concat(F.lit("feature index "), first_bad("feature_idx", lambda x: x >= n_features),
                                F.lit(f" out of range [0, {n_features})"))))
    expr = None
    for cond, msg in reversed(checks):
        expr = F.when(cond, msg) if expr is None else F.when(cond, msg).otherwise(expr)
    return expr


def _finish(df: DataFrame, normalize: bool) -> DataFrame:
    """Sorted distinct labels and (optionally) unit-norm rows, vectorized per Arrow batch."""
    def fix(batches):
        for b in batches:
            t = pa.Table.from_batches([b])
            yield from finish_batch(t, normalize).to_batches()
            worker_progress("ingest", rows=t.num_rows)

    if "weight" not in df.columns:
        df = df.withColumn("weight", F.lit(1.0).cast("float"))
    cols = [F.col(f.name).cast(f.dataType) for f in SAMPLES_SCHEMA.fields]
    return df.select(*cols).mapInArrow(fix, SAMPLES_SCHEMA)


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


def _repeated_features():
    """True for a row that lists some feature index more than once."""
    return F.size(F.array_distinct("feature_idx")) != F.size("feature_idx")


def read_text(spark: SparkSession, path: str, fmt: str, params: IngestParams,
              expect_features: Optional[int] = None, expect_labels: Optional[int] = None,
              header: Optional[str] = None):
    """Parse and validate an XC or svmlight text file; returns (DataFrame, DatasetInfo).

    One Spark job validates every line and counts the lines of each input partition; line
    numbers (for errors) and sample ids (line order) follow from those counts.
    """
    raw = text_lines(spark, path)
    header_n = None
    d = params.num_features or expect_features
    L = params.num_labels or expect_labels
    if fmt == "xc":
        if header is None:                         # the first line of the first split
            row = raw.select("value").first()
            header = row[0] if row else ""
        toks = header.split()
        if len(toks) != 3 or not all(t.isdigit() for t in toks):
            raise IngestError(f"{path}:1: malformed header {header!r} "
                              "(expected 'num_samples num_features num_labels')")
        header_n, hd, hL = (int(t) for t in toks)
        if expect_features and hd != expect_features:
            log.warning("%s declares %d features, the model/training set has %d", path, hd, expect_features)
        d = params.num_features or max(hd, expect_features or 0)
        L = params.num_labels or max(hL, expect_labels or 0)
        one_based = False
    else:
        one_based = params.svmlight_one_based
    parsed = _parse_tokens(raw, one_based)
    # a blank line is an error, not an empty sample (a final newline makes no line at all)
    parsed = parsed.withColumn("_err", F.when(F.size("_toks") == 0, F.lit("empty line"))
                               .otherwise(_error_column(d, L)))
    is_data = F.col("_mid") != 0 if fmt == "xc" else F.lit(True)
    rep = is_data & _repeated_features()
    lines = Lines(parsed, err=first_where(F.col("_err").isNotNull() & is_data, F.col("_err")),
                  max_label=F.max(F.when(is_data, F.array_max("label_idx"))),
                  max_feature=F.max(F.when(is_data, F.array_max("feature_idx"))),
                  n_rep=F.count(F.when(rep, 1)), rep=first_where(rep, F.lit(True)))
    bad = lines.first("err")
    if bad is not None:
        raise IngestError(f"{path}:{bad[0]}: {bad[1]}")
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
    data = parsed.filter(is_data).withColumn("sample_id", (lines.line() - 1 - skip).cast("long"))
    return _finish(data, params.normalize), DatasetInfo(path, fmt, n, int(d), int(L), int(n_rep))


def read_table(spark: SparkSession, path: str, fmt: str, params: IngestParams,
               expect_features: Optional[int] = None, expect_labels: Optional[int] = None):
    """Validate a Parquet/Delta samples table (schema, ranges, unique ids)."""
    df = spark.read.format(fmt).load(path)
    df = check_samples_columns(df, path)
    d = params.num_features or expect_features
    L = params.num_labels or expect_labels
    checked = df.withColumn("_ft", F.lit(None).cast("array<string>")).withColumn("_badtok", F.lit(False)) \
        .withColumn("_lab", F.array_join(F.transform("label_idx", lambda x: x.cast("string")), ",")) \
        .withColumn("_err", _error_column(d, L))
    checked = checked.withColumn("_err", F.when(
        F.size("feature_idx") != F.size("feature_val"),
        F.lit("feature_idx and feature_val have different lengths")).otherwise(F.col("_err")))
    stats = checked.agg(
        F.count(F.lit(1)).alias("n"), F.countDistinct("sample_id").alias("n_ids"),
        F.min(F.when(F.col("_err").isNotNull(), F.struct("sample_id", "_err"))).alias("err"),
        F.max(F.array_max("label_idx")).alias("max_label"),
        F.max(F.array_max("feature_idx")).alias("max_feature"),
        F.count(F.when(_repeated_features(), 1)).alias("n_rep"),
        F.min(F.when(_repeated_features(), F.col("sample_id"))).alias("rep"),
    ).first()
    if stats["err"] is not None:
        raise IngestError(f"{path}: row with sample_id {stats['err']['sample_id']}: {stats['err']['_err']}")
    if stats["n"] == 0:
        raise IngestError(f"{path}: the table has no rows")
    if stats["n_ids"] != stats["n"]:
        dup = df.groupBy("sample_id").count().filter("count > 1").orderBy("sample_id").first()
        raise IngestError(f"{path}: duplicate sample_id {dup['sample_id']} ({dup['count']} rows)")
    d = d or (stats["max_feature"] or 0) + 1
    L = L or (stats["max_label"] or 0) + 1
    if stats["n_rep"]:
        log.warning("%s: %d row(s) list a feature index more than once (the first: sample_id %d); "
                    "their values are summed", path, stats["n_rep"], stats["rep"])
    return (_finish(df, params.normalize),
            DatasetInfo(path, fmt, int(stats["n"]), int(d), int(L), int(stats["n_rep"])))


def read_samples(spark: SparkSession, path: str, params: IngestParams, fmt: Optional[str] = None,
                 expect_features: Optional[int] = None, expect_labels: Optional[int] = None):
    """Any supported input as a validated samples DataFrame plus its sizes."""
    first = None
    if fmt is None:
        fmt, first = _detect(spark, path)
    if fmt in ("xc", "svmlight"):
        return read_text(spark, path, fmt, params, expect_features, expect_labels, header=first)
    if fmt in ("parquet", "delta"):
        return read_table(spark, path, fmt, params, expect_features, expect_labels)
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
