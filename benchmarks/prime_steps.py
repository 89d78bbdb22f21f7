"""PRIME's step cost with NGAME's clustered batches against random ones (issue #13), numpy, one
process, no Spark: what a step of the prime stage's optimizer costs where the labels are many.

    nice -n 10 .venv/bin/python benchmarks/prime_steps.py                      # the 200K set's model
    nice -n 10 .venv/bin/python benchmarks/prime_steps.py --rows 20000 --labels 5000 --features 20000

Rows of ``xmc-spark synth``'s model (``--labels`` x ``--features``, seed 0; the defaults are the
200K synthetic set's, of which ``--rows`` rows), the tree's top 20 over them as hard negatives
(``XMCModel.train_local``, default parameters), PRIME initialized from their PIFA; the rows are
cut into blobs of ``--blob`` rows as the stage streams them, and each variant runs the first
``--steps`` full batches of ``kernels.prime.train_step`` from the same start:

* ``random``: permuted rows, ``n_random`` negatives uniform over the labels (the default);
* ``random + in-batch``: permuted rows, ``n_random`` negatives drawn from the batch's positives;
* ``clustered``: NGAME's batches (``kernels.prime.batch_order``) with in-batch negatives
  (``prime.batching=clustered``).

Reported per variant: the median and mean seconds of a step, the median count of distinct labels
a step runs the Label Prototype Network on, and the seconds spent building the batches. The
second variant separates what the in-batch draws save from what the clustering saves.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from xmc_spark import synth
from xmc_spark.kernels import prime as P
from xmc_spark.model import XMCModel

VARIANTS = ("random", "random + in-batch", "clustered")


def rows(n: int, L: int, d: int):
    """(X, Y) of n rows of synth's model (every synth row carries a label)."""
    return synth.matrices(0, n, L, d, seed=0)


def measure(X, Y, S, prm: P.PrimeParams, variant: str, blob: int, steps: int) -> dict:
    """Seconds per step, distinct labels per step and batch-building seconds of one variant."""
    clustered = variant == "clustered"
    prm = replace(prm, batching="random" if variant == "random" else "clustered")
    model = P.init_model(X, Y, prm)
    L = Y.shape[1]
    inv = P.inverse_propensities(np.bincount(Y.indices, minlength=L), X.shape[0], prm)
    rng, opt = np.random.default_rng(1), P.Optimizer()
    secs, labels, order_s = [], [], 0.0
    for s in range(0, X.shape[0], blob):
        Xb, Yb, Sb = X[s:s + blob], Y[s:s + blob], S[s:s + blob]
        t0 = time.perf_counter()
        batches = (P.batch_order(model, Xb, rng) if clustered else
                   [np.sort(b) for b in np.array_split(rng.permutation(Xb.shape[0]),
                                                       range(prm.batch_size, Xb.shape[0], prm.batch_size))])
        order_s += time.perf_counter() - t0
        for b in batches:
            if len(b) < prm.batch_size or len(secs) >= steps:
                continue
            probe = np.random.default_rng(len(secs))       # the step's draws, counted apart from its rng
            pos = P.sample_positives(Yb[b], inv, prm.n_pos, probe)
            neg, valid = P.sample_negatives(Yb[b], L, prm.n_hard, prm.n_random, probe, Sb[b],
                                            None if variant == "random" else pos.ravel())
            labels.append(len(np.unique(np.concatenate([pos.ravel(), neg[valid]]))))
            t0 = time.perf_counter()
            P.train_step(model, opt, Xb[b], Yb[b], inv, rng, Sb[b])
            secs.append(time.perf_counter() - t0)
        if len(secs) >= steps:
            break
    return {"variant": variant, "steps": len(secs), "median_s": float(np.median(secs)) if secs else float("nan"),
            "mean_s": float(np.mean(secs)) if secs else float("nan"),
            "labels_per_step": int(np.median(labels)) if labels else 0, "batching_s": order_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=60000)
    ap.add_argument("--labels", type=int, default=20000)
    ap.add_argument("--features", type=int, default=50000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--blob", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--cluster-size", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args(argv)
    X, Y = rows(a.rows, a.labels, a.features)
    t0 = time.perf_counter()
    S, _ = XMCModel.train_local(X, Y).predict(X, beam_size=10, topk=20)
    print(f"{X.shape[0]} rows, {a.labels} labels, {a.features} features; tree + shortlist "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    prm = P.PrimeParams(batch_size=a.batch_size, cluster_size=a.cluster_size)
    print("| batches | steps | s/step (median) | s/step (mean) | labels/step (median) | batching s |")
    print("|---|---|---|---|---|---|")
    for v in a.variants.split(","):
        r = measure(X, Y, S, prm, v.strip(), a.blob, a.steps)
        print(f"| {r['variant']} | {r['steps']} | {r['median_s']:.2f} | {r['mean_s']:.2f} | {r['labels_per_step']:,} "
              f"| {r['batching_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
