"""The kNN re-ranker (issue #14): the tree's top K of a row re-ordered by
``w * tree + (1 - w) * vote``, the vote being its k most cosine-similar training rows' labels
(:mod:`xmc_spark.kernels.knn`). What linear node classifiers cannot carry on sets such as
delicious is local: the labels of a row's nearest neighbours.

Where each part runs and what it holds:

* **Neighbours** (:func:`neighbours`, Spark): a blocked similarity join. Query rows are hashed
  into ``ceil(queries / knn.block_rows)`` blocks, training rows into ``ceil(rows / block_rows)``
  blocks; each query row is copied to every training block and each training row to every query
  block, and one cogrouped task per (query block, training block) pair computes that block of
  similarities (:func:`~xmc_spark.kernels.knn.block_topk`, in chunks of at most
  :data:`~xmc_spark.kernels.knn.CHUNK_CELLS` dense cells) and keeps each query's k best. A
  window over (similarity desc, training row id) merges the blocks' lists. A task holds one block
  of each side; no process holds all rows. The work is every query against every training row,
  O(queries x training rows): meant for the small and mid-size sets where the vote pays (README).
* **Choice** of k (``knn.ks``), the similarity power (``knn.powers``) and the weight, on held-out
  *training* rows (a hash of ``sample_id``, as PRIME's split: ``knn.val_frac``, at most
  ``knn.val_max_rows`` rows): a second tree trained without them gives their top K, their
  neighbours come from the other training rows only, and the best mean P@1/3/5 chooses (ties:
  the smaller k, the smaller power, the weight nearer the tree). The held-out rows and their
  neighbour lists (at most ``val_max_rows`` x max(ks)) are collected to the driver.
* **Model folder**: ``knn/knn.json`` holds the choice and where the neighbours' rows are: the
  ``train`` Delta table's (absolute) path and run key, with their row count and a fingerprint
  (:func:`fingerprint`). ``xmc-spark predict`` on the folder reads the table's latest rows for
  that key, checks count and fingerprint (a rewritten, moved or vacuumed table stops it with the
  reason, before anything is written) and re-ranks as the pipeline does. The MLflow pyfunc
  (:func:`xmc_spark.prime_model.load`) scores with the tree alone, with a warning: it carries no
  training rows.
* **Stacked on PRIME** (``prime.mode`` on as well): the kNN re-ranker re-orders PRIME's output
  rather than the tree's (tree -> PRIME -> kNN). PRIME's weight is chosen first, by its stage; k,
  power and weight are then chosen on PRIME's held-out rows (``prime.val_frac``,
  ``prime.val_max_rows``, ``prime.seed``: the rows PRIME was not trained on), whose candidates
  are PRIME's re-ranked top K of the held-out model (greedy: PRIME's weight is not revisited).
  ``knn.json`` then records PRIME's mode, K, weight and a digest of its arrays
  (:func:`prime_digest`), and ``xmc-spark predict`` stops when the folder's ``prime/`` differs.
* **Cost guard**: a similarity join of more than ``knn.max_pairs`` (query, training row) pairs
  stops with the counts before it runs.
* **Prediction** (:func:`rerank`, Spark): the tree's (stacked: PRIME's) top K of each test row
  (:func:`~.prediction.run`, broadcast or sharded), its neighbours among all training rows, and
  one Arrow pass per batch that votes and mixes (:func:`~xmc_spark.kernels.knn.votes`,
  :func:`~xmc_spark.kernels.prime.rerank`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from ..arrow_utils import cogrouped_apply, csr_from_table, padded, to_arrow
from ..compat import never_broadcast
from ..kernels import knn as K
from ..kernels import prime as PR
from ..kernels.sparse import csr_from_lists
from ..params import KnnParams
from ..prime_model import PrimedModel, with_head
from ..schemas import PREDICTIONS_SCHEMA
from . import prediction
from .prediction import candidates
from .prime import is_held_out, val_fraction, with_tree

log = logging.getLogger("xmc_spark.stages.knn")

NEIGHBOUR_SCHEMA = "sample_id long, nb_id long, sim float"


def index_rows(train: DataFrame) -> DataFrame:
    """The training rows that vote: those with a label."""
    return train.filter(F.size("label_idx") > 0).select("sample_id", "feature_idx", "feature_val", "label_idx")


def check_pairs(n_queries: int, n_index: int, prm: KnnParams, kind: str) -> None:
    """Stop before a similarity join of more than ``knn.max_pairs`` (query, training row) pairs."""
    from ..params import ConfigError
    if n_queries * n_index > prm.max_pairs:
        raise ConfigError(f"the kNN re-ranker would compare {n_queries:,} {kind} rows with {n_index:,} training rows "
                          f"({n_queries * n_index:.3g} pairs > knn.max_pairs {prm.max_pairs:.3g}): its work is "
                          "O(queries x training rows); raise knn.max_pairs or set knn.mode=off")


def fingerprint(index: DataFrame) -> Tuple[int, int]:
    """(rows, a sum of row hashes) of the voting rows: what a saved re-ranker checks its rows by."""
    h = F.pmod(F.xxhash64("sample_id", "feature_idx", "feature_val", "label_idx"), F.lit(1 << 31))
    r = index.agg(F.count(F.lit(1)).alias("n"), F.sum(h).alias("h")).collect()[0]
    return int(r["n"]), int(r["h"] or 0)


def blocks(n_rows: int, block_rows: int) -> int:
    return max(1, -(-int(n_rows) // max(1, int(block_rows))))


def neighbours(queries: DataFrame, index: DataFrame, k: int, n_features: int, block_rows: int,
               n_queries: Optional[int] = None, n_index: Optional[int] = None) -> DataFrame:
    """(sample_id, nb_id, sim, rank): each query row's k most cosine-similar rows of ``index``
    (similarity > 0; rank 0 the best; ties to the smaller ``nb_id``), from one cogrouped task per
    (query block, index block)."""
    nq = n_queries if n_queries is not None else queries.count()
    na = n_index if n_index is not None else index.count()
    bq, ba = blocks(nq, block_rows), blocks(na, block_rows)
    q = (queries.select("sample_id", "feature_idx", "feature_val")
         .withColumn("qb", F.pmod(F.xxhash64("sample_id", F.lit(11)), F.lit(bq)).cast("int"))
         .withColumn("ab", F.explode(F.sequence(F.lit(0), F.lit(ba - 1)))))
    a = (index.select(F.col("sample_id").alias("nb_id"), "feature_idx", "feature_val")
         .withColumn("ab", F.pmod(F.xxhash64("nb_id", F.lit(13)), F.lit(ba)).cast("int"))
         .withColumn("qb", F.explode(F.sequence(F.lit(0), F.lit(bq - 1)))))

    def fn(left: pa.Table, right: pa.Table) -> pa.Table:
        if not left.num_rows or not right.num_rows:
            return pa.table({"sample_id": pa.array([], pa.int64()), "nb_id": pa.array([], pa.int64()),
                             "sim": pa.array([], pa.float32())})
        Xq = csr_from_table(left, "feature_idx", "feature_val", n_features)
        Xa = csr_from_table(right, "feature_idx", "feature_val", n_features)
        r, i, s = K.block_topk(Xq, Xa, right.column("nb_id").to_numpy(), k)
        ids = np.asarray(left.column("sample_id").to_numpy(), np.int64)
        return pa.table({"sample_id": pa.array(ids[r], pa.int64()), "nb_id": pa.array(i, pa.int64()),
                         "sim": pa.array(s, pa.float32())})

    found = cogrouped_apply(q, a, ["qb", "ab"], fn, NEIGHBOUR_SCHEMA)
    order = Window.partitionBy("sample_id").orderBy(F.desc("sim"), F.asc("nb_id"))
    return found.withColumn("rank", (F.row_number().over(order) - 1).cast("int")).filter(F.col("rank") < k)


def with_labels(nb: DataFrame, index: DataFrame) -> DataFrame:
    """The neighbour rows with each neighbour's ``label_idx``."""
    return nb.join(never_broadcast(index.select(F.col("sample_id").alias("nb_id"), "label_idx")), "nb_id")


def neighbour_lists(nb: DataFrame) -> DataFrame:
    """(sample_id, nbs): each query's neighbours as one list of (rank, sim, label_idx), by rank."""
    return nb.groupBy("sample_id").agg(
        F.sort_array(F.collect_list(F.struct("rank", "sim", "label_idx"))).alias("nbs"))


def neighbour_parts(t: pa.Table, n_labels: int):
    """(rows, rank, sim, labels CSR) of the neighbours in ``t``'s ``nbs`` column (null or empty
    lists: none), one entry per (row of ``t``, neighbour); None when there is none at all."""
    col = t.column("nbs").combine_chunks()
    counts = np.asarray(col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), np.int64)
    if not counts.sum():
        return None
    flat = col.flatten()                                    # skips null lists, honours offsets
    rank = np.asarray(flat.field("rank").to_numpy(zero_copy_only=False), np.int64)
    sim = np.asarray(flat.field("sim").to_numpy(zero_copy_only=False), np.float64)
    lab = flat.field("label_idx")
    lens = np.asarray(lab.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), np.int64)
    Y = csr_from_lists(np.concatenate([[0], np.cumsum(lens)]),
                       np.asarray(lab.flatten().to_numpy(zero_copy_only=False), np.int64), None, n_labels)
    return np.repeat(np.arange(t.num_rows), counts), rank, sim, Y


def parts_votes(parts, n: int, cand: np.ndarray, k: int, power: float) -> np.ndarray:
    """Votes of the candidates ``cand`` (n x K) from :func:`neighbour_parts`' arrays; lists of
    max(ks) neighbours vote with their first k."""
    if parts is None:
        return np.zeros(cand.shape)
    rows, rank, sim, Y = parts
    near = rank < k
    S, Yn = K.neighbour_arrays(rows[near], rank[near], sim[near], Y[near], n, k)
    return K.votes(S, Yn, cand, k, power)


def list_votes(t: pa.Table, cand: np.ndarray, k: int, power: float, n_labels: int) -> np.ndarray:
    """Votes of the candidates ``cand`` (rows of ``t`` x K) from ``t``'s ``nbs`` column (null or
    empty: no neighbour, vote 0)."""
    return parts_votes(neighbour_parts(t, n_labels), t.num_rows, cand, k, power)


def rerank(samples: DataFrame, index: DataFrame, model, prm: KnnParams, choice: Dict, beam_size: int, topk: int,
           n_features: int, n_labels: int, n_rows: Optional[int] = None, n_index: Optional[int] = None
           ) -> Tuple[DataFrame, DataFrame]:
    """(predictions, tree_predictions) of ``samples``: ``model``'s top ``knn.K`` re-ranked with the
    votes of their ``choice["knn.k"]`` nearest rows of ``index`` (power and weight of ``choice``),
    top ``topk`` kept; and the tree's own top ``topk``: ``model``'s candidates, or stacked (a
    :class:`~xmc_spark.prime_model.PrimedModel`) a beam search of its tree alone."""
    k, power, w = int(choice["knn.k"]), float(choice["knn.power"]), float(choice["knn.weight"])
    if w < 1.0:                       # checked before the beam search
        n_rows = n_rows if n_rows is not None else samples.count()
        n_index = n_index if n_index is not None else index.count()
        check_pairs(n_rows, n_index, prm, "query")
    tree = None
    if isinstance(model, PrimedModel):  # stacked: the candidates are PRIME's, tree_predictions the tree's
        primed, tree = with_tree(samples, model, beam_size, max(prm.K, topk), topk, n_rows)
        cand = primed.withColumnsRenamed({"pred_labels": "cand", "pred_scores": "cand_scores"}).localCheckpoint()
    else:
        cand = candidates(samples, model, beam_size, max(prm.K, topk), n_rows).localCheckpoint()
    base = cand.select("sample_id", F.slice("cand", 1, topk).alias("pred_labels"),
                       F.slice("cand_scores", 1, topk).alias("pred_scores"))
    tree = base if tree is None else tree
    if w >= 1.0:                      # the base's order (a stable sort): no neighbours needed
        return base, tree
    nb = neighbour_lists(with_labels(neighbours(samples, index, k, n_features, prm.block_rows, n_rows, n_index),
                                     index))
    rows = cand.join(nb, "sample_id", "left")
    Kc = max(prm.K, topk)

    def fn(batches):
        for b in batches:
            t = pa.Table.from_batches([b])
            c = padded(t, "cand", Kc, -1, np.int64)
            sc = padded(t, "cand_scores", Kc, -np.inf, np.float64)
            lab, fin = PR.rerank(c, sc, list_votes(t, c, k, power, n_labels), w)
            yield prediction.label_batch(t, lab[:, :topk], fin[:, :topk])

    return rows.mapInArrow(fn, PREDICTIONS_SCHEMA), tree


def choose(samples: DataFrame, prm: KnnParams, n_rows: int, n_features: int, n_labels: int, beam_size: int,
           val_tree_fit, timer=None, head=None, split=None) -> Dict:
    """k, power and weight chosen on held-out training rows (module docstring); the facts.

    With a PRIME ``head`` (stacked: tree -> PRIME -> kNN) the candidates are the held-out model
    with that head (:func:`~xmc_spark.prime_model.with_head`): PRIME's re-ranked top K, as the
    predict stage gives them; PRIME's weight stays as its stage chose it. ``split`` (PRIME's
    parameters when stacked) gives the held-out rows (``val_frac``, ``val_max_rows``, ``seed``;
    default ``prm``'s): PRIME was trained without its held-out rows, so the kNN weight is chosen
    on those same rows, where PRIME's scores are not those of training rows."""
    step = timer.stage if timer is not None else (lambda name: contextlib.nullcontext())
    split = split if split is not None else prm
    frac = val_fraction(split, n_rows)
    held = is_held_out(frac, split.seed)
    rows = index_rows(samples)
    fit, val = rows.filter(~held), rows.filter(held)
    kmax = max(prm.ks)
    val = val.localCheckpoint()
    n_val = val.count()
    check_pairs(n_val, n_rows - n_val, prm, "held-out")
    with step("knn_val_tree"):
        vtree = with_head(val_tree_fit(samples.filter(~held)), head)
    with step("knn_choose"):
        vt = to_arrow(val.join(never_broadcast(candidates(val, vtree, beam_size, prm.K)), "sample_id")
                      .join(neighbour_lists(with_labels(neighbours(val, fit, kmax, n_features, prm.block_rows, n_val),
                                                        fit)), "sample_id", "left")
                      .orderBy("sample_id"))
        facts: Dict = {"knn.n_held_out": vt.num_rows}
        if not vt.num_rows:
            log.warning("knn: no held-out training rows (val_frac x rows < 1): weight 1 (the base's order)")
            return {**facts, "knn.k": kmax, "knn.power": 1.0, "knn.weight": 1.0}
        Yv = csr_from_table(vt, "label_idx", None, n_labels)
        cand = padded(vt, "cand", prm.K, -1, np.int64)
        sc = padded(vt, "cand_scores", prm.K, -np.inf, np.float64)
        best, parts = None, neighbour_parts(vt, n_labels)         # parsed once for the whole grid
        for k in sorted(prm.ks):
            for power in sorted(prm.powers):
                w, table = PR.choose_weight(cand, sc, parts_votes(parts, vt.num_rows, cand, k, power), Yv)
                if best is None or table[w] > best[3]:
                    best = (k, power, w, table[w], table[1.0])
    k, power, w, score, tree_score = best
    log.info("knn: %d held-out training rows choose k %d, power %g, weight %g (mean P@1/3/5 %.2f, %s alone %.2f)",
             vt.num_rows, k, power, w, score, "the tree" if head is None else "PRIME", tree_score)
    return {**facts, "knn.k": int(k), "knn.power": float(power), "knn.weight": float(w),
            "knn.val_tree_mean_p": round(tree_score, 4), "knn.val_rerank_mean_p": round(score, 4)}


# ---- the model folder's knn/ ------------------------------------------------------------------
FOLDER = "knn"
INFO = "knn.json"


def prime_digest(head) -> Optional[Dict]:
    """What a stacked choice was made on: the PRIME head's mode, K, weight and a sha256 of its
    arrays (as float32, how the prime table and the folder keep them); None without PRIME."""
    if head is None:
        return None
    h = hashlib.sha256()
    for name in sorted(head.weights):
        a = np.ascontiguousarray(head.weights[name], dtype=np.float32)
        h.update(f"{name}{a.shape}".encode())
        h.update(a.tobytes())
    return {"mode": head.mode, "K": int(head.K), "weight": float(head.weight), "sha256": h.hexdigest()}


def check_prime(info: Dict, head, where) -> None:
    """Stop when the PRIME head beside a saved kNN re-ranker (``head``: the folder's ``prime/``,
    None without one) is not the one its k, power and weight were chosen on."""
    from ..params import ConfigError
    want, got = info.get("prime"), prime_digest(head)
    if want == got:
        return
    if want is None:
        why = "was chosen on the tree's candidates, but the folder also has PRIME (prime/)"
    elif got is None:
        why = "was chosen on PRIME's re-ranked candidates (stacked), but the folder has no prime/"
    else:
        why = (f"was chosen on another PRIME head (mode {want['mode']}, K {want['K']}, weight {want['weight']}) than "
               f"the folder's prime/ (mode {got['mode']}, K {got['K']}, weight {got['weight']}"
               f"{', other arrays' if want['sha256'] != got['sha256'] else ''})")
    raise ConfigError(f"{where}: the kNN re-ranker (knn/{INFO}) {why}: rerun the knn stage after the prime stage, "
                      "or remove knn/ (or prime/)")


def save_info(folder, info: Dict) -> None:
    """``folder/knn/knn.json``: the choice (k, power, weight, K) and the neighbours' table."""
    d = Path(folder) / FOLDER
    d.mkdir(parents=True, exist_ok=True)
    (d / INFO).write_text(json.dumps(info, indent=2, sort_keys=True))


def load_info(folder) -> Optional[Dict]:
    """The folder's ``knn/knn.json``, None when it has none."""
    f = Path(folder) / FOLDER / INFO
    if not f.is_file():
        return None
    from ..params import ConfigError
    try:
        info = json.loads(f.read_text())
        for key in ("k", "power", "weight", "K", "table", "rows", "fingerprint"):
            info[key]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{f}: not a kNN re-ranker's settings ({type(e).__name__}: {e}): rerun "
                          "`xmc-spark stage knn` or remove knn/") from None
    return info


def remove_folder(folder) -> None:
    """Drop ``folder/knn/`` (knn.mode = off after a run that had it)."""
    shutil.rmtree(Path(folder) / FOLDER, ignore_errors=True)


def saved_index(spark, info: Dict) -> DataFrame:
    """The training rows a saved re-ranker votes with: its table's rows for its run key, checked
    against the row count and fingerprint recorded when k, power and weight were chosen."""
    from ..params import ConfigError
    from ..storage import read_delta, table_version
    where = f"{info['table']}" + (f" (run key {info['run_key']})" if info.get("run_key") else "")
    try:                     # one version for the check and the join: a later commit cannot slip in
        version = table_version(spark, info["table"])
        index = index_rows(read_delta(spark, info["table"], info.get("run_key"), version))
        got = fingerprint(index)
    except Exception as e:  # noqa: BLE001 - any storage or Delta error: say which table and why
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"the model's kNN re-ranker (knn/{INFO}) votes with the training rows of {where}, which "
                          f"cannot be read ({first}): restore that table or remove knn/ to score with the tree "
                          "alone") from None
    want = (int(info["rows"]), int(info["fingerprint"]))
    if got != want:
        raise ConfigError(f"the model's kNN re-ranker (knn/{INFO}) was chosen on {want[0]:,} training rows of {where}, "
                          f"which now holds {got[0]:,} rows{' with other content' if got[0] == want[0] else ''} "
                          f"(version {version}; a stage run on a pinned older version records that version's "
                          "rows): rerun the knn stage on it, or remove knn/ to score with the tree alone")
    return index
