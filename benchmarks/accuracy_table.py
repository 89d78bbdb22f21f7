"""Accuracy past one tree: ensembles, wide shallow trees, matcher-aware negatives, overlapping
clusters; P@1/3/5 and PSP@1/3/5 on the standard test split, train and predict seconds relative
to the single tree. Run on demand:

    python benchmarks/accuracy_table.py --data ../shared/data/bibtex
    python benchmarks/accuracy_table.py --data ../shared/data/delicious

**Choosing on validation, never on the test set.** Every configuration is first trained by the
numpy reference (:meth:`XMCModel.train_local` / :meth:`EnsembleModel.train_local`, the same
model the pipeline trains: tests/jobs/test_cli.py checks it) on 80% of the TRAINING rows (a
seeded permutation, seed 0) and scored on the other 20%; the configuration with the best mean
of P@1, P@3 and P@5 there is the "chosen" one. Then every configuration runs through the real
pipeline (``pipeline.run``, one Spark session, MLflow off) on the whole training file and is
scored on the test file. Seconds are the pipeline's stage seconds: train = tree + train (+
negatives, retrain and clusters stages), predict = the predict stage; 2 cores, local[*], after
one unrecorded warm-up run of the single tree.

Prints a markdown table and writes WORK/accuracy_<set>.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xmc_spark import pipeline  # noqa: E402
from xmc_spark.kernels import metrics as M  # noqa: E402
from xmc_spark.local_io import read_xc  # noqa: E402
from xmc_spark.model import EnsembleModel, ModelTrainParams, XMCModel  # noqa: E402
from xmc_spark.params import PipelineParams  # noqa: E402

CONFIGS = {
    "single tree": {},
    "3 trees": {"tree.ensemble": 3},
    "3 trees 2/8/32": {"tree.ensemble_splits": "2,8,32"},
    "16-way tree": {"tree.nr_splits": 16},
    "100-way tree": {"tree.nr_splits": 100},
    "tfn+man": {"train.negatives": "tfn+man"},
    "3 trees 2/8/32 + tfn+man": {"tree.ensemble_splits": "2,8,32", "train.negatives": "tfn+man"},
    "clusters (2 copies)": {"clusters.copies": 2},
    "clusters (2 copies) + tfn+man": {"clusters.copies": 2, "train.negatives": "tfn+man"},
    # the solver's C and the score combination, with the levers above
    "C 0.5 + l2-hinge": {"train.C": 0.5, "predict.post_processor": "l2-hinge"},
    "C 0.5 + l2-hinge + 3 trees 2/8/32": {"train.C": 0.5, "predict.post_processor": "l2-hinge",
                                          "tree.ensemble_splits": "2,8,32"},
    "C 0.5 + l2-hinge + 3 trees 2/8/32 + clusters (2 copies)": {
        "train.C": 0.5, "predict.post_processor": "l2-hinge", "tree.ensemble_splits": "2,8,32", "clusters.copies": 2},
    "C 0.5 + l2-hinge + tfn+man": {"train.C": 0.5, "predict.post_processor": "l2-hinge", "train.negatives": "tfn+man"},
    "C 0.5 + l2-hinge + 3 trees 2/8/32 + tfn+man": {
        "train.C": 0.5, "predict.post_processor": "l2-hinge", "tree.ensemble_splits": "2,8,32",
        "train.negatives": "tfn+man"},
    # the search, the pruning and the leaf size (validated on delicious, 2026-11-27; README)
    "C 0.5 + l2-hinge + beam 20": {"train.C": 0.5, "predict.post_processor": "l2-hinge", "predict.beam_size": 20},
    "C 0.5 + l2-hinge + no pruning": {"train.C": 0.5, "predict.post_processor": "l2-hinge", "train.threshold": 0.0},
    "C 0.5 + l2-hinge + leaves of 200": {"train.C": 0.5, "predict.post_processor": "l2-hinge",
                                         "tree.max_leaf_size": 200},
    # leaves of 1000: one leaf on bibtex and delicious, i.e. flat one-vs-rest with the same solver
    "C 0.5 + l2-hinge + leaves of 1000": {"train.C": 0.5, "predict.post_processor": "l2-hinge",
                                          "tree.max_leaf_size": 1000},
}
# the pipeline's tree and train stages: their seconds hold their steps' (embedding, frequencies;
# clusters, retrain, negatives, retrain_man), which earlier versions of this table added again
TRAIN_STAGES = ("tree", "train")


def params_for(base: PipelineParams, overrides) -> PipelineParams:
    p = base
    for k, v in overrides.items():
        p = p.set_dotted(k, v)
    return p


def scores(pred: np.ndarray, Y: sp.csr_matrix, counts: np.ndarray, n_train: int):
    inv = 1.0 / M.propensities(counts, n_train)
    r = M.evaluate(pred, Y, inv)
    return {k: round(v, 2) for k, v in r.items() if k.split("@")[0] in ("p", "psp")}


def validate(p: PipelineParams, X, Y, seed: int = 0):
    """P@k / PSP@k of the numpy reference trained on 80% of the training rows, scored on 20%."""
    perm = np.random.default_rng(seed).permutation(X.shape[0])
    nv = X.shape[0] // 5
    va, tr = np.sort(perm[:nv]), np.sort(perm[nv:])
    tp = ModelTrainParams.from_pipeline(p)
    cls = EnsembleModel if p.tree.n_trees() > 1 else XMCModel
    t = time.perf_counter()
    model = cls.train_local(X[tr], Y[tr], tp, p.predict)
    seconds = time.perf_counter() - t
    labels, _ = model.predict(X[va], topk=5)
    counts = np.asarray((Y[tr] > 0).sum(axis=0)).ravel()
    return {**scores(labels, Y[va], counts, len(tr)), "seconds_numpy": round(seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of configuration names")
    ap.add_argument("--work", default="/tmp/xmc-accuracy-bench")
    ap.add_argument("--validation-only", action="store_true", help="the numpy validation runs only (no Spark)")
    ap.add_argument("--test-only", action="store_true", help="the pipeline runs only (validation from WORK)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    data = Path(args.data)
    work = Path(args.work) / data.name
    work.mkdir(parents=True, exist_ok=True)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    base = PipelineParams().set_dotted("mlflow.enabled", False)
    X, Y = read_xc(str(data / "train.txt"))
    out_json = Path(args.work) / f"accuracy_{data.name}.json"
    results = json.loads(out_json.read_text()) if out_json.is_file() else {}
    for name in [] if args.test_only else names:
        results.setdefault(name, {})["validation"] = validate(params_for(base, CONFIGS[name]), X, Y)
        print(f"{name}: validation {results[name]['validation']}", flush=True)
        out_json.write_text(json.dumps(results, indent=2))
    if args.validation_only:
        return
    from xmc_spark.session import get_spark
    spark = get_spark(base.spark)
    # a warm-up run (not recorded): the first pipeline run of a session pays JVM and Python
    # worker start-up, numba compilation and Delta's first commits
    pipeline.run(spark, str(data / "train.txt"), str(data / "test.txt"), str(work / "warm-up"), base)
    for name in names:
        p = params_for(base, CONFIGS[name])
        results.setdefault(name, {})
        folder = work / name.replace(" ", "_").replace("/", "-").replace("(", "").replace(")", "").replace(",", "")
        t = time.perf_counter()
        m = pipeline.run(spark, str(data / "train.txt"), str(data / "test.txt"), str(folder), p)
        sec = m["seconds"]
        results[name]["test"] = {k: m[k] for k in m if k.split("@")[0] in ("p", "psp")}
        results[name]["train_s"] = round(sum(v for k, v in sec.items() if k in TRAIN_STAGES), 1)
        results[name]["predict_s"] = round(sec.get("predict", 0.0), 1)
        results[name]["tree_s"] = round(sec.get("tree", 0.0), 1)        # the k-means levels (B-way cost)
        results[name]["wall_s"] = round(time.perf_counter() - t, 1)
        print(f"{name}: test {results[name]['test']}, train {results[name]['train_s']} s", flush=True)
        out_json.write_text(json.dumps(results, indent=2))
    table(data.name, results)


def table(name: str, results) -> None:
    def mean_p(r):
        return np.mean([r[f"p@{k}"] for k in (1, 3, 5)])
    done = {k: v for k, v in results.items() if "validation" in v and "test" in v}
    chosen = max(done, key=lambda k: mean_p(done[k]["validation"]))
    single = done.get("single tree")
    print(f"\n{name}: validation = 20% of the training rows (seed 0); chosen = best mean P@1/3/5 there\n")
    print("| configuration | validation P@1 / P@3 / P@5 | test P@1 / P@3 / P@5 | test PSP@1 / PSP@3 / PSP@5 | "
          "train s (x single) | of which tree s | predict s (x single) |")
    print("|---|---|---|---|---|---|---|")
    for k, r in done.items():
        v, t = r["validation"], r["test"]
        rel = (lambda a, b: f"{a:.1f} ({a / b:.1f}x)" if b else f"{a:.1f}")  # noqa: E731
        mark = " **(chosen)**" if k == chosen else ""
        print(f"| {k}{mark} | {v['p@1']:.2f} / {v['p@3']:.2f} / {v['p@5']:.2f} | "
              f"{t['p@1']:.2f} / {t['p@3']:.2f} / {t['p@5']:.2f} | "
              f"{t['psp@1']:.2f} / {t['psp@3']:.2f} / {t['psp@5']:.2f} | "
              f"{rel(r['train_s'], single['train_s'] if single else 0)} | {r['tree_s']:.1f} | "
              f"{rel(r['predict_s'], single['predict_s'] if single else 0)} |")


if __name__ == "__main__":
    main()
