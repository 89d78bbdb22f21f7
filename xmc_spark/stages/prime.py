"""The PRIME stage (issue #13): label prototypes trained after node training, as a retriever or
a re-ranker of the tree (``prime.mode``), around the numpy core :mod:`xmc_spark.kernels.prime`.

Where each part runs and what it holds:

* **Shortlist** (Spark, Arrow batches): the tree model's beam search over every training row
  (:func:`~.prediction.map_with_model`, the model broadcast as for prediction; a sharded model's
  layered join, :func:`.sharded.predict`, no weights broadcast) gives the top ``prime.hard_k``
  labels of every fitting row (PRIME's hard negatives), and a second search, by the held-out
  model when re-ranking, the top ``prime.K`` of the held-out rows with their scores (the
  candidates the mixing weight is chosen on).
* **Split**: a training row is held out when a hash of its ``sample_id`` falls below
  ``min(prime.val_frac, prime.val_max_rows / n)``; the held-out (validation) rows choose the
  epoch and the re-rank weight, never the test set, and are not trained on. They (at most about
  ``val_max_rows``) and their candidates are collected to the driver.
* **Optimizer** (one process, the driver's Python): the other training rows, joined with their
  shortlist and put in an order of the data alone (hashed by ``sample_id`` into
  :func:`pack_partitions` partitions, sorted in each, so that a broadcast and a sharded tree's
  shortlists train the same model), are packed by a Spark job into Arrow IPC blobs of at most
  ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows (one binary value per batch, no per-row
  Python), checkpointed on the executors, and streamed with ``toLocalIterator`` once per epoch;
  each blob's rows are permuted (or, ``prime.batching = clustered``, grouped into NGAME's clusters
  of similar queries: :func:`~xmc_spark.kernels.prime.batch_order`) and cut into mini-batches of
  ``prime.batch_size`` for
  :func:`~xmc_spark.kernels.prime.train_step` (AdamW). The process holds the parameters and
  their Adam moments (O(features x dim + labels x dim + the LPN's dim x ffn)), the label-side
  state (centroids, free vectors: O(labels x dim)), the PIFA label features (of the rows not
  held out, the encoder's input for h_l, or the user's ``prime.label_features``:
  :func:`read_label_features`; O(their nnz)), the held-out rows and one blob,
  never all training rows. One process rather than local steps per partition with averaging:
  the Adam moments and the centroids (Eq. 4) are sequential state that averaging per epoch
  would blur, and on 2 cores a second replica buys nothing.
* **Inference** (Spark, Arrow batches): only the encoder and the prototypes Z (the LPN applied
  once to every label, dropout off) are kept (:class:`~xmc_spark.prime_model.PrimeHead`); the
  predict stage broadcasts them with the tree and scores every batch (exact inner product over
  all prototypes, or the tree's top K re-ranked); with a sharded tree the head alone is shared and
  the tree's top K come from the layered join (:func:`predict_sharded`).

The head is written to the ``prime`` table (one row per matrix row; the stage record holds
mode, K and weight) for the predict stage, and to the model folder's ``prime/``.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from typing import Dict, Iterator, Optional, Tuple

import numpy as np
import pandas as pd
import pyarrow as pa
import scipy.sparse as sp
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_from_table, list_offsets_values, padded, to_arrow
from ..compat import never_broadcast, shuffle_partitions
from ..kernels import metrics as M
from ..kernels import prime as PR
from ..params import ConfigError, EmbeddingParams, IngestParams, PrimeParams
from ..prime_model import PrimeHead
from ..schemas import PREDICTIONS_SCHEMA, IngestError
from . import ingest, label_embedding
from .prediction import arrow_batch_rows, balanced, candidates, label_batch, map_with_model

log = logging.getLogger("xmc_spark.stages.prime")

KS = (1, 3, 5)
HASH_BUCKETS = 100_000
SHORTLIST_SCHEMA = "sample_id long, cand array<int>, cand_scores array<float>"


def val_fraction(prm: PrimeParams, n_rows: int) -> float:
    """The held-out share of the training rows: ``val_frac``, capped at ``val_max_rows`` rows."""
    return min(prm.val_frac, prm.val_max_rows / max(n_rows, 1))


def is_held_out(frac: float, seed: int):
    """Column: the row is held out (a hash of ``sample_id`` and the seed below ``frac``)."""
    bucket = F.pmod(F.xxhash64(F.col("sample_id"), F.lit(int(seed))), F.lit(HASH_BUCKETS))
    return bucket < F.lit(int(round(frac * HASH_BUCKETS)))


def shortlist(samples: DataFrame, model, beam_size: int, k: int) -> DataFrame:
    """(sample_id, cand, cand_scores): the tree's top ``k`` labels of every row (beam search,
    best first, fewer when the beam reaches fewer); a sharded model's by its layered join
    (:func:`.sharded.predict`: no weights broadcast), a whole one's broadcast."""
    from . import sharded
    if isinstance(model, sharded.SHARDED):
        return candidates(samples, model, beam_size, k)

    def score(m, t, X):
        return label_batch(t, *m.predict(X, beam_size=beam_size, topk=k), names=("cand", "cand_scores"))

    return map_with_model(samples, model, score, SHORTLIST_SCHEMA, kind="prime shortlist")


def predict_sharded(samples: DataFrame, model, beam_size: int, topk: int, cand: Optional[DataFrame] = None,
                    n_rows: Optional[int] = None) -> DataFrame:
    """(sample_id, pred_labels, pred_scores) of a :class:`~xmc_spark.prime_model.PrimedModel`
    whose tree is sharded: the tree's top ``max(K, topk)`` (``cand``, :func:`shortlist` of the
    layered join, no weights broadcast, when not given) left-joined back to the rows (a row the
    join gives no candidate keeps its place, with none), then the head (encoder E and prototypes
    Z: (features + labels) x dim floats, shared like a model) re-ranks them in Arrow batches, as
    :meth:`~xmc_spark.prime_model.PrimeHead.predict` does with a broadcast tree; ``retrieve``
    needs no tree, and scores the ``n_rows`` rows spread as :func:`.prediction.run` does. The
    tree's scores come as float32 from the join (the broadcast search mixes them as float64), so
    near-equal mixed scores may order differently in the last bits."""
    head = model.head
    Kc = max(head.K, topk)
    rows, columns = samples.select("sample_id", "feature_idx", "feature_val"), ()
    if head.mode == "rerank":
        cand = cand if cand is not None else shortlist(samples, model.tree, beam_size, Kc)
        rows = rows.join(never_broadcast(cand), "sample_id", "left")
        columns = ("cand", "cand_scores")
    else:
        rows = balanced(rows, n_rows)
    nbytes = sum(a.nbytes for a in head.weights.values())
    log.info("prime: the head (%.1f MB: encoder and prototypes) shared with the tasks, the tree kept sharded",
             nbytes / 2 ** 20)

    def score(h, t, X):
        if h.mode == "retrieve":
            return label_batch(t, *h.scored(X, topk))
        return label_batch(t, *h.scored(X, topk, padded(t, "cand", Kc, -1, np.int64),
                                        padded(t, "cand_scores", Kc, -np.inf, np.float64)))

    return map_with_model(rows, head, score, PREDICTIONS_SCHEMA, columns=columns, name="the PRIME head")


def with_tree(samples: DataFrame, model, beam_size: int, topk: int, tree_topk: Optional[int] = None,
              n_rows: Optional[int] = None) -> Tuple[DataFrame, DataFrame]:
    """(predictions, tree_predictions) of a :class:`~xmc_spark.prime_model.PrimedModel`: its top
    ``topk`` and its tree's own top ``tree_topk`` (default ``topk``). A sharded tree re-ranked
    searches once: the tree's top ``max(K, topk, tree_topk)`` are kept on the executors and give
    both (the beam does not depend on k: the first k of a longer list are the top k). A broadcast
    tree searches twice (two broadcast jobs, cheaper than keeping the list)."""
    from .prediction import run
    from .sharded import SHARDED
    tree_topk = tree_topk or topk
    if not (isinstance(model.tree, SHARDED) and model.head.mode == "rerank"):
        return run(samples, model, beam_size, topk, n_rows), run(samples, model.tree, beam_size, tree_topk, n_rows)
    cand = shortlist(samples, model.tree, beam_size, max(model.head.K, topk, tree_topk)).localCheckpoint()
    tree = cand.select("sample_id", F.slice("cand", 1, tree_topk).alias("pred_labels"),
                       F.slice("cand_scores", 1, tree_topk).alias("pred_scores"))
    return predict_sharded(samples, model, beam_size, topk, cand), tree


def unpack(table: pa.Table, n_features: int, n_labels: int, hard_k: int):
    """(X, Y, shortlist n x hard_k, -1 padded) of a table of training rows with ``cand``."""
    X = csr_from_table(table, "feature_idx", "feature_val", n_features)
    Y = csr_from_table(table, "label_idx", None, n_labels)
    S = padded(table, "cand", hard_k, -1, np.int64) if hard_k else None
    return X, Y, S


def pack(df: DataFrame) -> DataFrame:
    """One binary row (an Arrow IPC stream) per Arrow batch of ``df``: what the optimizer streams."""
    def fn(batches):
        for b in batches:
            if b.num_rows:
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, b.schema) as w:
                    w.write_batch(b)
                yield pa.RecordBatch.from_arrays([pa.array([sink.getvalue().to_pybytes()], pa.binary())],
                                                 names=["blob"])
    return df.mapInArrow(fn, "blob binary")


def stream(packed: DataFrame) -> Iterator[pa.Table]:
    """The packed batches, one at a time, on the driver."""
    for row in packed.toLocalIterator():
        yield pa.ipc.open_stream(row["blob"]).read_all()


def rows_by_id(t: pa.Table, id_col: str, idx_col: str, val_col: str, n_rows: int, n_cols: int) -> sp.csr_matrix:
    """Rows of ``t`` (ids in ``id_col``, each at most once, in [0, n_rows)) as an n_rows x n_cols
    CSR, row i the one whose id is i; ids absent from ``t`` are empty rows. One copy of the
    non-zeros beside the table's."""
    ids = np.asarray(t.column(id_col).to_numpy(zero_copy_only=False), np.int64)
    part = csr_from_table(t, idx_col, val_col, n_cols)
    perm = np.argsort(ids, kind="stable")
    cnt = np.zeros(n_rows, np.int64)
    cnt[ids] = np.diff(part.indptr)
    indptr = np.concatenate([[0], np.cumsum(cnt)])
    lengths = np.diff(part.indptr)[perm]
    # the source position of every non-zero, taken row by row in id order
    src = np.repeat(part.indptr[:-1][perm] - (indptr[1:] - cnt)[ids[perm]], lengths) + np.arange(int(lengths.sum()))
    return sp.csr_matrix((part.data[src], part.indices[src], indptr), shape=(n_rows, n_cols))


def label_features(emb: DataFrame, n_labels: int, n_features: int) -> sp.csr_matrix:
    """The ``label_embeddings`` table (PIFA rows) as labels x features CSR; absent labels are empty."""
    return rows_by_id(to_arrow(emb.select("label_idx", "emb_idx", "emb_val")), "label_idx", "emb_idx", "emb_val",
                      n_labels, n_features)


def read_label_features(spark, path: str, n_labels: int, n_features: int, params: IngestParams) -> sp.csr_matrix:
    """``prime.label_features``: the user's label features (labels x features CSR, h_l's input
    instead of the PIFA rows), from any input ``xmc-spark ingest`` reads, row i (line i after an
    XC header, or ``sample_id`` i of a Parquet/Delta table) holding label i's features in the
    training set's feature space; labels on the rows are ignored. An XC file may have the XC
    repository's sparse-matrix header ``num_rows num_features`` (the LF-* sets' label feature
    files). Rows are normalized as ``ingest.normalize`` says, like the samples. Checked in full,
    as ingest checks its input: a feature id outside the training set's features (the file and
    line, or the row), a row id that is not a label, a label without a row, are
    :class:`~xmc_spark.schemas.IngestError`. Collected to the driver: O(nnz), like PIFA's rows."""
    try:
        df, info = ingest.read_samples(spark, path, dataclasses.replace(params, num_features=n_features, num_labels=0),
                                       expect_features=n_features, features_only=True)
    except IngestError as e:
        if "feature index" not in str(e):
            raise
        raise IngestError(f"{e} (label features are in the training set's {n_features} features)") from None
    t = to_arrow(df.select("sample_id", "feature_idx", "feature_val"))
    ids = np.asarray(t.column("sample_id").to_numpy(zero_copy_only=False), np.int64)
    text = info.fmt in ("xc", "svmlight")

    def where(i: int) -> str:                # a text row's line, a table row's sample_id
        return f"line {i + (2 if info.fmt == 'xc' else 1)}" if text else f"the row with sample_id {i}"

    bad = ids[(ids < 0) | (ids >= n_labels)]
    if bad.size:
        raise IngestError(f"{path}: {where(int(bad.min()))} is not a label's ({bad.size} row(s) beyond the "
                          f"{n_labels} labels of the training set; row i holds label i's features)")
    if ids.size != n_labels:
        missing = np.setdiff1d(np.arange(n_labels), ids)
        more = f" and {missing.size - 1} more" if missing.size > 1 else ""
        raise IngestError(f"{path}: {ids.size} rows of label features for {n_labels} labels: no row for label "
                          f"{int(missing[0])}{more} (row i holds label i's features)")
    lf = rows_by_id(t, "sample_id", "feature_idx", "feature_val", n_labels, n_features)
    log.info("prime: label features of %d labels from %s (%s%s, %d non-zeros)", n_labels, path, info.fmt,
             f", ids from {int(params.svmlight_one_based)}" if info.fmt == "svmlight" else "", lf.nnz)
    return lf


def mean_precision(labels: np.ndarray, Y: sp.csr_matrix) -> float:
    m = M.evaluate(labels[:, :max(KS)], Y, np.ones(Y.shape[1]), KS)
    return float(np.mean([m[f"p@{k}"] for k in KS]))


def pack_partitions(n_rows: int, batch_rows: int, partitions: int) -> int:
    """Partitions the optimizer's rows are hashed into before they are packed: about one Arrow
    batch (``batch_rows`` rows, a blob) a partition or more, at most ``partitions`` (the shuffle
    partitions), at least 1. A blob's rows are cut into the mini-batches, so partitions of fewer
    rows than ``prime.batch_size`` would shrink them (bibtex's 4.4K fitting rows over 8
    partitions: batches of ~550 rows instead of 1024)."""
    return max(1, min(int(partitions), int(n_rows) // max(int(batch_rows), 1)))


def train(fit: DataFrame, val: Tuple, Z_pifa: sp.csr_matrix, label_counts: np.ndarray, n_rows: int,
          prm: PrimeParams, n_features: int, eval_params=None,
          label_feats: Optional[sp.csr_matrix] = None) -> Tuple[PR.PrimeModel, Dict]:
    """Train PRIME streaming the rows of ``fit`` (training rows with ``cand``), one process.
    The encoder starts from the PIFA rows ``Z_pifa``'s singular vectors; h_l encodes
    ``label_feats`` (the user's label features) when given, else ``Z_pifa``.

    ``val`` = (X, Y) of the held-out rows: after every epoch the standalone retrieval's mean
    P@1/3/5 on them is measured and, with ``prime.select_epoch``, the best epoch's state kept;
    with ``prime.patience`` P > 0 the epochs stop once P in a row have not beaten the best.
    Returns the model and facts (losses per epoch, held-out scores, the chosen epoch)."""
    kp = prm.kernel(*((eval_params.propensity_a, eval_params.propensity_b) if eval_params else ()))
    model = PR.init_from_pifa(Z_pifa, kp, label_feats)
    del Z_pifa                                   # with label features, only the model's copy is needed
    n_labels = model.n_labels
    inv_prop = PR.inverse_propensities(np.asarray(label_counts), n_rows, kp)
    rng = np.random.default_rng(prm.seed + 1)
    opt = PR.Optimizer()
    Xv, Yv = val
    # the rows' order is the data's (hashed by sample_id into pack_partitions, sorted in each;
    # blobs of maxRecordsPerBatch rows), not the plan's: a sharded tree's shortlist joins in other
    # partitions than a broadcast one's, and the mini-batches, hence the model, would follow
    spark = fit.sparkSession
    parts = pack_partitions(n_rows, arrow_batch_rows(fit), shuffle_partitions(spark))
    ordered = fit.repartition(parts, "sample_id").sortWithinPartitions("sample_id")
    packed = pack(ordered.select("feature_idx", "feature_val", "label_idx", "cand")).localCheckpoint()
    fit.unpersist()

    def held_out() -> float:
        return mean_precision(PR.retrieve(PR.encode(model, Xv), PR.prototypes(model), max(KS))[0], Yv) \
            if Xv.shape[0] else float("nan")

    scores = [held_out()]                        # epoch 0: the PIFA-initialized model
    best = {"score": scores[0], "epoch": 0, "weights": copy.deepcopy(model.weights),
            "centroids": model.centroids.copy()}
    for ep in range(prm.epochs):
        total, nb = 0.0, 0
        for t in stream(packed):
            X, Y, S = unpack(t, n_features, n_labels, prm.hard_k)
            for b in PR.batch_order(model, X, rng):      # a permutation, or NGAME's clusters of the blob
                total += PR.train_step(model, opt, X[b], Y[b], inv_prop, rng, None if S is None else S[b])
                nb += 1
        model.history.append(total / max(nb, 1))
        scores.append(held_out())
        log.info("prime epoch %d: loss %.4f, held-out mean P@1/3/5 %.2f", ep + 1, model.history[-1], scores[-1])
        if not prm.select_epoch or not scores[-1] <= best["score"]:
            best = {"score": scores[-1], "epoch": ep + 1, "weights": copy.deepcopy(model.weights),
                    "centroids": model.centroids.copy()}
        elif prm.patience and ep + 1 - best["epoch"] >= prm.patience:
            log.info("prime: no better held-out epoch since epoch %d, stopping after epoch %d", best["epoch"], ep + 1)
            break
    packed.unpersist()
    model.weights, model.centroids = best["weights"], best["centroids"]
    model.epoch = best["epoch"]
    return model, {"prime.loss": [round(v, 6) for v in model.history],
                   "prime.val_retrieve_mean_p": [round(v, 4) for v in scores], "prime.epoch": best["epoch"],
                   "prime.epochs_run": len(model.history)}


def run(samples: DataFrame, tree, label_counts: np.ndarray, prm: PrimeParams, n_rows: int, n_features: int,
        n_labels: int, beam_size: int, eval_params=None, timer=None, val_tree_fit=None,
        embedding_params: Optional[EmbeddingParams] = None,
        label_feats: Optional[sp.csr_matrix] = None) -> Tuple[PrimeHead, Dict]:
    """Shortlist, split, train, choose the re-rank weight: the :class:`PrimeHead` and the facts.

    PRIME's label features (h_l's input, and the encoder's SVD initialization) are the PIFA
    embeddings of the rows that are not held out (:func:`.label_embedding.run`), not the tree
    stage's ``label_embeddings``: a held-out row is part of its labels' PIFA rows, so PRIME would
    score it like a training row (bibtex: held-out mean P@1/3/5 58 for the re-rank, 43 on test,
    weight 0.05 chosen). ``label_feats`` (:func:`read_label_features`), when given, replace the
    PIFA rows as h_l's input; the encoder still starts from PIFA's singular vectors.

    ``val_tree_fit(train_df) -> model`` (with ``prime.val_tree``, re-rank only) trains a tree
    on the training rows that are not held out; its top K of the held-out rows are the
    candidates the weight is chosen on. The pipeline's own tree has been trained on the
    held-out rows, so on them its scores are those of training rows and no mix beats it
    (bibtex: weight 1 chosen; on the test set 0.5 gains 1.5 points P@1). ``timer`` (a
    :class:`~xmc_spark.runner.StageTimer`) times the steps ``prime_shortlist``, ``prime_val_tree``,
    ``prime_train`` (the epochs, with their held-out evaluations) and ``prime_weight``."""
    step = timer.stage if timer is not None else (lambda name: contextlib.nullcontext())
    frac = val_fraction(prm, n_rows)
    held = is_held_out(frac, prm.seed)
    rows = samples.filter(F.size("label_idx") > 0).select("sample_id", "feature_idx", "feature_val", "label_idx")
    fit, val = rows.filter(~held), rows.filter(held)
    with step("prime_shortlist"):           # one beam search over the fitting rows, kept on the executors
        if prm.hard_k:
            fit = fit.join(never_broadcast(shortlist(fit, tree, beam_size, prm.hard_k)), "sample_id", "left")
        else:
            fit = fit.withColumn("cand", F.array().cast("array<int>"))
        fit = fit.localCheckpoint()
    vtree = tree
    own = prm.mode == "rerank" and prm.val_tree and val_tree_fit is not None
    if own:
        with step("prime_val_tree"):
            vtree = val_tree_fit(samples.filter(~held))
    with step("prime_weight"):           # re-rank: the held-out rows' candidates, to choose the weight on
        if prm.mode == "rerank":
            val = val.join(never_broadcast(shortlist(val, vtree, beam_size, prm.K)), "sample_id", "left")
        vt = to_arrow(val.orderBy("sample_id"))
    Xv = csr_from_table(vt, "feature_idx", "feature_val", n_features)
    Yv = csr_from_table(vt, "label_idx", None, n_labels)
    log.info("prime: %d held-out training rows (%.1f%%) choose the epoch and the re-rank weight", Xv.shape[0],
             100 * frac)
    with step("prime_train"):
        emb = label_embedding.run(samples.filter(~held), embedding_params or EmbeddingParams(), n_features=n_features,
                                  n_labels=n_labels, n_buckets=shuffle_partitions(samples.sparkSession))
        model, facts = train(fit, (Xv, Yv), label_features(emb, n_labels, n_features), label_counts,
                             n_rows, prm, n_features, eval_params, label_feats)       # (train releases fit)
    with step("prime_weight"):
        head, more = finish(model, prm, vt, Xv, Yv)
    facts.update(more)
    facts["prime.val_tree"] = own
    facts["prime.h_l_input"] = "pifa" if label_feats is None else "label_features"
    head.info.update({k: facts[k] for k in ("prime.val_tree", "prime.h_l_input")})   # the saved head's too
    return head, facts


def finish(model: PR.PrimeModel, prm: PrimeParams, vt: pa.Table, Xv: sp.csr_matrix, Yv: sp.csr_matrix):
    """The head of a trained model (encoder + prototypes) and, on the held-out rows ``vt``, the
    re-rank weight (:func:`~xmc_spark.kernels.prime.choose_weight`); (head, facts)."""
    facts: Dict = {}
    Z = PR.prototypes(model)
    weights = {"E": model.weights["E"], "Z": Z.astype(np.float32)}
    if prm.residual:
        weights.update(W_res=model.weights["W_res"], b_res=model.weights["b_res"])
    head = PrimeHead(prm.mode, prm.K, 1.0, weights, prm.residual)
    facts.update({"prime.mode": prm.mode, "prime.K": prm.K, "prime.n_held_out": int(Xv.shape[0]),
                  "prime.epoch": model.epoch, "prime.val_frac": prm.val_frac, "prime.val_max_rows": prm.val_max_rows,
                  "prime.seed": prm.seed})
    if Xv.shape[0] and prm.mode == "rerank":
        cand = padded(vt, "cand", prm.K, -1, np.int64)
        tree_sc = padded(vt, "cand_scores", prm.K, -np.inf, np.float64)
        prime_sc = PR.candidate_scores(head.encode(Xv), Z, cand)
        w, table = PR.choose_weight(cand, tree_sc, prime_sc, Yv)
        facts.update({"prime.val_tree_mean_p": round(table[1.0], 4), "prime.val_rerank_mean_p": round(table[w], 4)})
        head.weight = w
    elif prm.mode == "rerank":
        log.warning("prime: no held-out training rows (prime.val_frac x rows < 1): re-rank weight 1 (the tree)")
    facts["prime.weight"] = head.weight
    head.info = dict(facts)
    return head, facts


# ---- the head as a table (the predict stage of another process reads it) --------------------
def head_frame(head: PrimeHead) -> pd.DataFrame:
    parts = []
    for name in ("E", "Z", "W_res", "b_res"):
        if name in head.weights:
            a = np.atleast_2d(head.weights[name]).astype(np.float32)
            parts.append(pd.DataFrame({"name": name, "row": np.arange(a.shape[0], dtype=np.int64), "vec": list(a)}))
    return pd.concat(parts, ignore_index=True)


def head_from_table(df: DataFrame, facts: Dict) -> PrimeHead:
    """The head the prime stage wrote (table ``prime``) with the mode, K and weight of its record."""
    t = to_arrow(df.select("name", "row", "vec"))
    names = np.asarray(t.column("name").to_pylist())
    rows = np.asarray(t.column("row").to_numpy(zero_copy_only=False))
    off, val = list_offsets_values(t, "vec")
    weights = {}
    for name in np.unique(names):
        sel = np.flatnonzero(names == name)
        sel = sel[np.argsort(rows[sel])]
        dim = int(off[sel[0] + 1] - off[sel[0]])
        a = val[off[sel][:, None] + np.arange(dim)]           # every row of one matrix has its width
        weights[str(name)] = a.astype(np.float32).ravel() if name == "b_res" else a.astype(np.float32)
    if "E" not in weights or "Z" not in weights:
        raise ConfigError("the prime table lacks the encoder or the prototypes: rerun `xmc-spark stage prime`")
    return PrimeHead(facts["prime.mode"], int(facts["prime.K"]), float(facts["prime.weight"]), weights,
                     "W_res" in weights, {k: v for k, v in facts.items() if k.startswith("prime.")})

