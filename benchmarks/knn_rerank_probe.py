"""Probe for issue #14: how much would a k-nearest-neighbour vote add to the tree's scores?

The numpy reference model only: the probe that decided to build the pipeline's ``knn`` stage
(:mod:`xmc_spark.stages.knn`, which chooses on its own held-out rows). For a configuration of
``benchmarks/accuracy_table.py``:

1. train it on 80% of the TRAINING rows (accuracy_table's seeded split) and take the top 100
   labels (and scores) of the other 20%;
2. kNN vote of a row = sum over its k most cosine-similar fitting rows of similarity x their
   label vector, divided by the similarities' sum; re-rank the 100 by
   ``w * tree score + (1 - w) * vote`` (``kernels.prime.rerank``, as PRIME's re-ranking); choose
   k in {10, 25, 50} and w in {0, 0.05, ..., 1} by the mean P@1/3/5 on the 20%
   (``kernels.prime.choose_weight``: weight ties go to the tree; k ties to the smaller k);
3. train on all training rows, apply the chosen (k, w) on the test split, neighbours from all
   training rows. The test set chooses nothing.

``--vote centroid`` replaces the kNN vote by the cosine of the row with each label's sum of
positive rows divided by count^a (a chosen in ``--as`` as k is): a label-level vote with
no training rows at prediction time.

    python benchmarks/knn_rerank_probe.py --data ../shared/data/delicious \\
        --config "C 0.5 + l2-hinge + 3 trees 2/8/32"

The vote needs every test row's similarity to every training row (dense here: fine for these
sizes, a blocked Spark join at scale) and the training labels at prediction time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from accuracy_table import CONFIGS, params_for  # noqa: E402

from xmc_spark.kernels import metrics as M  # noqa: E402
from xmc_spark.kernels import prime as PR  # noqa: E402
from xmc_spark.kernels.sparse import l2_normalize_rows  # noqa: E402
from xmc_spark.local_io import read_xc  # noqa: E402
from xmc_spark.model import EnsembleModel, ModelTrainParams, XMCModel  # noqa: E402
from xmc_spark.params import PipelineParams  # noqa: E402

KS = (1, 3, 5)


def knn_votes(Xq: sp.csr_matrix, Xa: sp.csr_matrix, Ya: sp.csr_matrix, k: int, power: float = 1.0) -> np.ndarray:
    """rows of Xq x labels: similarity^power-weighted label votes of the k most similar rows of Xa."""
    S = np.asarray((l2_normalize_rows(Xq) @ l2_normalize_rows(Xa).T).todense())
    idx = np.argpartition(-S, k, axis=1)[:, :k]
    sims = np.maximum(np.take_along_axis(S, idx, 1), 0) ** power
    W = sp.csr_matrix((sims.ravel(), idx.ravel(), np.arange(0, idx.size + 1, k)), shape=(S.shape[0], Xa.shape[0]))
    return np.asarray((W @ Ya).todense()) / np.maximum(sims.sum(1, keepdims=True), 1e-12)


def centroid_votes(Xq: sp.csr_matrix, Xa: sp.csr_matrix, Ya: sp.csr_matrix, a: float) -> np.ndarray:
    """rows of Xq x labels: cosine rows against each label's sum of (unit) positive rows, divided by
    its count^a (a = 1: the mean, a label centroid; a = 0: a kNN vote over all rows with a linear
    kernel). O(labels x features) at prediction time, unlike the kNN vote."""
    S = (Ya.T @ l2_normalize_rows(Xa)).tocsr()
    cnt = np.asarray(Ya.sum(axis=0)).ravel()
    return np.asarray((l2_normalize_rows(Xq) @ S.T).todense()) / np.maximum(cnt, 1) ** a


def candidate_votes(kind: str, Xq, Xa, Ya, param: float, lab: np.ndarray, power: float = 1.0) -> np.ndarray:
    """The vote of each of a row's candidate labels (``lab``): kNN (``param`` = k, neighbours
    weighted by similarity^``power``) or centroid (``param`` = a); centroid votes are scaled by
    the row's largest, as the kNN vote is a weighted share in [0, 1]."""
    if kind == "knn":
        return np.take_along_axis(knn_votes(Xq, Xa, Ya, int(param), power), np.maximum(lab, 0), 1)
    v = np.take_along_axis(centroid_votes(Xq, Xa, Ya, param), np.maximum(lab, 0), 1)
    return v / np.maximum(v.max(axis=1, keepdims=True), 1e-12)


def precision(lab: np.ndarray, Y: sp.csr_matrix) -> list:
    m = M.evaluate(lab[:, :max(KS)], Y, np.ones(Y.shape[1]), KS)
    return [round(m[f"p@{k}"], 2) for k in KS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with train.txt and test.txt (XC format)")
    ap.add_argument("--config", default="single tree", help=f"one of {list(CONFIGS)}")
    ap.add_argument("--vote", choices=("knn", "centroid"), default="knn",
                    help="knn: the k nearest training rows; centroid: each label's sum of positive rows / count^a")
    ap.add_argument("--ks", default="10,25,50", help="knn: the k grid")
    ap.add_argument("--powers", default="1", help="knn: the grid of similarity powers (1: the vote as first probed; "
                    "the pipeline's knn stage searches 1,2,4)")
    ap.add_argument("--as", dest="a_grid", default="0,0.25,0.5,0.75,1", help="centroid: the a grid")
    ap.add_argument("--topk", type=int, default=100, help="tree candidates re-ranked")
    args = ap.parse_args()
    X, Y = read_xc(str(Path(args.data) / "train.txt"))
    Xt, Yt = read_xc(str(Path(args.data) / "test.txt"))
    p = params_for(PipelineParams(), CONFIGS[args.config])
    cls = EnsembleModel if p.tree.n_trees() > 1 else XMCModel

    def fit(Xa, Ya):
        return cls.train_local(Xa, Ya, ModelTrainParams.from_pipeline(p), p.predict)

    perm = np.random.default_rng(0).permutation(X.shape[0])          # accuracy_table.validate's split
    nv = X.shape[0] // 5
    va, tr = np.sort(perm[:nv]), np.sort(perm[nv:])
    lab, sc = fit(X[tr], Y[tr]).predict(X[va], topk=args.topk)
    val_tree = precision(lab, Y[va])
    best = None
    grid = [float(v) for v in (args.ks if args.vote == "knn" else args.a_grid).split(",")]
    powers = [float(v) for v in args.powers.split(",")] if args.vote == "knn" else [1.0]
    for k, power in [(k, p) for k in grid for p in powers]:    # the mixing weight: PRIME's own chooser
        votes = candidate_votes(args.vote, X[va], X[tr], Y[tr], k, lab, power)
        w, table = PR.choose_weight(lab, sc, votes, Y[va], ks=KS)
        if best is None or table[w] > best[2]:
            best = (k, w, table[w], precision(PR.rerank(lab, sc, votes, w)[0], Y[va]), power)
    k, w, _, val, power = best
    t = time.perf_counter()
    model = fit(X, Y)
    fit_s = time.perf_counter() - t
    lab, sc = model.predict(Xt, topk=args.topk)
    t = time.perf_counter()
    votes = candidate_votes(args.vote, Xt, X, Y, k, lab, power)
    knn_s = time.perf_counter() - t
    out = {"data": Path(args.data).name, "config": args.config, "vote": args.vote,
           "k" if args.vote == "knn" else "a": k, "w": w, **({"power": power} if args.vote == "knn" else {}),
           "validation": {"tree": val_tree, "re-ranked": val},
           "test": {"tree": precision(lab, Yt), "re-ranked": precision(PR.rerank(lab, sc, votes, w)[0], Yt)},
           "seconds": {"fit": round(fit_s, 1), "knn_test": round(knn_s, 1)}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
