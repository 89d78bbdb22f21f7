"""Probe for issue #14: how much would a k-nearest-neighbour vote add to the tree's scores?

Not a pipeline feature (xmc-spark has no kNN stage): the numpy reference model only, to decide
whether building one is worth it. For a configuration of ``benchmarks/accuracy_table.py``:

1. train it on 80% of the TRAINING rows (accuracy_table's seeded split) and take the top 100
   labels (and scores) of the other 20%;
2. kNN vote of a row = sum over its k most cosine-similar fitting rows of similarity x their
   label vector, divided by the similarities' sum; re-rank the 100 by
   ``w * tree score + (1 - w) * vote``; choose k in {10, 25, 50} and w in {0, 0.05, ..., 1}
   by the mean P@1/3/5 on the 20% (ties: the first, small k and w = 0 first);
3. train on all training rows, apply the chosen (k, w) on the test split, neighbours from all
   training rows. The test set chooses nothing.

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

from xmc_spark.kernels.sparse import l2_normalize_rows  # noqa: E402
from xmc_spark.local_io import read_xc  # noqa: E402
from xmc_spark.model import EnsembleModel, ModelTrainParams, XMCModel  # noqa: E402
from xmc_spark.params import PipelineParams  # noqa: E402

KS = (1, 3, 5)


def knn_votes(Xq: sp.csr_matrix, Xa: sp.csr_matrix, Ya: sp.csr_matrix, k: int) -> np.ndarray:
    """rows of Xq x labels: similarity-weighted label votes of the k most similar rows of Xa."""
    S = np.asarray((l2_normalize_rows(Xq) @ l2_normalize_rows(Xa).T).todense())
    idx = np.argpartition(-S, k, axis=1)[:, :k]
    sims = np.take_along_axis(S, idx, 1)
    W = sp.csr_matrix((sims.ravel(), idx.ravel(), np.arange(0, idx.size + 1, k)), shape=(S.shape[0], Xa.shape[0]))
    return np.asarray((W @ Ya).todense()) / np.maximum(sims.sum(1, keepdims=True), 1e-12)


def rerank(lab: np.ndarray, sc: np.ndarray, votes: np.ndarray, w: float) -> np.ndarray:
    s = w * sc + (1 - w) * np.take_along_axis(votes, np.maximum(lab, 0), 1)
    s = np.where(lab >= 0, s, -np.inf)
    return np.take_along_axis(lab, np.argsort(-s, axis=1, kind="stable"), 1)


def precision(lab: np.ndarray, Y: sp.csr_matrix) -> list:
    Yd = np.asarray(Y.todense()) > 0
    hit = Yd[np.arange(Yd.shape[0])[:, None], np.maximum(lab, 0)] & (lab >= 0)
    return [float(hit[:, :k].mean()) * 100 for k in KS]


def rounded(r: list) -> list:
    return [round(v, 2) for v in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with train.txt and test.txt (XC format)")
    ap.add_argument("--config", default="single tree", help=f"one of {list(CONFIGS)}")
    ap.add_argument("--ks", default="10,25,50")
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
    for k in [int(v) for v in args.ks.split(",")]:
        votes = knn_votes(X[va], X[tr], Y[tr], k)
        for w in np.round(np.linspace(0, 1, 21), 2):
            r = precision(rerank(lab, sc, votes, float(w)), Y[va])
            if best is None or np.mean(r) > np.mean(best[2]) + 1e-9:
                best = (k, float(w), r)
    k, w, val = best
    t = time.perf_counter()
    model = fit(X, Y)
    fit_s = time.perf_counter() - t
    lab, sc = model.predict(Xt, topk=args.topk)
    t = time.perf_counter()
    votes = knn_votes(Xt, X, Y, k)
    knn_s = time.perf_counter() - t
    out = {"data": Path(args.data).name, "config": args.config, "k": k, "w": w,
           "validation": {"tree": rounded(val_tree), "re-ranked": rounded(val)},
           "test": {"tree": rounded(precision(lab, Yt)),
                    "re-ranked": rounded(precision(rerank(lab, sc, votes, w), Yt))},
           "seconds": {"fit": round(fit_s, 1), "knn_test": round(knn_s, 1)}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
