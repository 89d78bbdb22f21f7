"""Synthetic XMC data on Spark: power-law label frequencies, sparse features tied to labels.

Every label has a few prototype features; a sample draws 1 + Poisson(1.5) labels from a Zipf
law and takes most of its labels' prototype features plus uniform noise features, so the
problem is learnable and head labels are much more frequent than tail ones. Rows are made
per partition with vectorized numpy (no per-sample Python), so 1M x 100K x 100K fits one
laptop. Optionally writes an aggregated copy of the training set to OUT/aggregated: random
groups of samples carrying the union of their labels (EAGLE's R-G input, see
:mod:`xmc_spark.stages.aggregated`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict

import numpy as np
import pyarrow as pa
import scipy.sparse as sp
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from .arrow_utils import csr_from_table, list_array
from .compat import share
from .kernels.sparse import l2_normalize_rows
from .schemas import SAMPLES_SCHEMA
from .storage import write_delta

log = logging.getLogger("xmc_spark.synth")

PROTO = 8          # prototype features per label
KEEP = 5           # of which a sample keeps this many per label
NOISE = 10         # uniform noise features per sample
ZIPF_A = 1.0


def label_model(n_labels: int, n_features: int, seed: int):
    """(label probabilities, prototype feature ids L x PROTO): small, broadcast to tasks."""
    rng = np.random.default_rng([seed, 1])
    p = 1.0 / np.arange(1, n_labels + 1) ** ZIPF_A
    p = p[rng.permutation(n_labels)]
    p /= p.sum()
    proto = rng.integers(0, n_features, size=(n_labels, PROTO), dtype=np.int64)
    return p, proto


def make_rows(start: int, count: int, p: np.ndarray, proto: np.ndarray, n_features: int, seed: int) -> pa.Table:
    """``count`` samples with ids start.. (vectorized); deterministic in (seed, start)."""
    rng = np.random.default_rng([seed, 2, start])
    L = len(p)
    k = 1 + rng.poisson(1.5, size=count)
    rows = np.repeat(np.arange(count), k)
    labels = rng.choice(L, size=len(rows), p=p)
    key = np.unique(rows.astype(np.int64) * L + labels)
    lrows, labels = key // L, key % L
    loff = np.concatenate([[0], np.cumsum(np.bincount(lrows, minlength=count))])
    # features: KEEP of each label's prototypes + NOISE uniform ones
    pick = rng.integers(0, PROTO, size=(len(labels), KEEP))
    f_lab = proto[labels[:, None], pick].ravel()
    r_lab = np.repeat(lrows, KEEP)
    f_noise = rng.integers(0, n_features, size=count * NOISE)
    r_noise = np.repeat(np.arange(count), NOISE)
    r = np.concatenate([r_lab, r_noise])
    f = np.concatenate([f_lab, f_noise])
    v = np.concatenate([rng.uniform(0.5, 1.5, len(f_lab)), rng.uniform(0.05, 0.5, len(f_noise))])
    key = r.astype(np.int64) * n_features + f
    uk, inv = np.unique(key, return_inverse=True)
    vals = np.bincount(inv, weights=v)
    fr, fi = uk // n_features, uk % n_features
    foff = np.concatenate([[0], np.cumsum(np.bincount(fr, minlength=count))])
    vals = vals.astype(np.float32)
    return pa.table({
        "sample_id": pa.array(np.arange(start, start + count, dtype=np.int64)),
        "feature_idx": list_array(foff, fi.astype(np.int32), pa.int32()),
        "feature_val": list_array(foff, vals, pa.float32()),
        "label_idx": list_array(loff, labels.astype(np.int32), pa.int32()),
        "weight": pa.array(np.ones(count, np.float32)),
    })


def matrices(start: int, count: int, n_labels: int, n_features: int, seed: int):
    """(X, Y) of rows ``start`` .. ``start + count`` of the model as float32 CSR, X L2-normalized
    as ingest leaves it: one learnable problem in process, without Spark (tests, benchmarks)."""
    p, proto = label_model(n_labels, n_features, seed)
    t = make_rows(start, count, p, proto, n_features, seed)
    X = sp.csr_matrix(l2_normalize_rows(csr_from_table(t, "feature_idx", "feature_val", n_features)), dtype=np.float32)
    return X, sp.csr_matrix(csr_from_table(t, "label_idx", None, n_labels), dtype=np.float32)


def generate(spark: SparkSession, n: int, n_labels: int, n_features: int, seed: int, id_offset: int = 0,
             rows_per_task: int = 50000):
    p, proto = label_model(n_labels, n_features, seed)
    b = share(spark, (p, proto), name="the label model")
    n_tasks = max(1, -(-n // rows_per_task))

    def gen(batches):
        pp, pr = b.value
        for batch in batches:
            for t in batch.column(0).to_numpy():
                start = int(t) * rows_per_task
                count = min(rows_per_task, n - start)
                if count > 0:
                    yield from make_rows(id_offset + start, count, pp, pr, n_features, seed).to_batches()

    return spark.range(0, n_tasks, 1, n_tasks).mapInArrow(gen, SAMPLES_SCHEMA)


def _write_xc(df, path: Path, n: int, n_features: int, n_labels: int) -> None:
    """Small sets only: XC text through the driver, rows in sample order."""
    with open(path, "w") as f:
        f.write(f"{n} {n_features} {n_labels}\n")
        for r in df.orderBy("sample_id").toLocalIterator():
            labs = ",".join(str(x) for x in r["label_idx"])
            feats = " ".join(f"{i}:{v:.6g}" for i, v in zip(r["feature_idx"], r["feature_val"]))
            f.write(f"{labs} {feats or ('0:0' if not labs else '')}\n")   # never a blank line


def run(spark: SparkSession, out: str, n_train: int, n_test: int, n_labels: int, n_features: int,
        fmt: str = "delta", group_size: int = 0, seed: int = 0) -> Dict:
    out_p = Path(out)
    out_p.mkdir(parents=True, exist_ok=True)
    info = {"n_labels": n_labels, "n_features": n_features}
    for name, n, off in (("train", n_train, 0), ("test", n_test, n_train)):
        df = generate(spark, n, n_labels, n_features, seed, id_offset=off)
        if fmt == "xc":
            if n > 500_000:
                raise ValueError("--format xc goes through the driver; use delta for more than 500K rows")
            df = df.withColumn("sample_id", F.col("sample_id") - off)
            _write_xc(df, out_p / f"{name}.txt", n, n_features, n_labels)
            info[name] = str(out_p / f"{name}.txt")
        else:
            write_delta(df, str(out_p / name))
            info[name] = str(out_p / name)
        log.info("synth %s: %d samples -> %s", name, n, info[name])
    if group_size > 0:
        # random groups of group_size samples (EAGLE's R-G), as an aggregated folder
        from .stages import aggregated, ingest
        train = spark.read.format("delta").load(info["train"]) if fmt == "delta" else generate(
            spark, n_train, n_labels, n_features, seed)
        dinfo = ingest.DatasetInfo("synth", "delta", n_train, n_features, n_labels)
        meta = aggregated.write_groups(train, dinfo, str(out_p / "aggregated"), "random", group_size, 0, seed, "set",
                                       source="synth")
        info["aggregated"] = str(out_p / "aggregated")
        info["n_groups"] = meta["n_groups"]
    return info
