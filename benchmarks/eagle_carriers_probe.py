"""How well do estimated carriers (``eagle.estimate_counts``) fit random groups? A numpy probe of
the EAGLE kernels on a labelled XC training set, no Spark:

    python benchmarks/eagle_carriers_probe.py --data ../shared/data/delicious --group-size 4

Random groups of ``--group-size`` over the training rows (numpy seed 0, not the Spark grouping of
``xmc-spark make-groups``), every member given all its group's labels; GRLR (T = 20) on the
whole set; then the joint assignment at each ``--taus`` with one carrier per (group, label),
with the carriers estimated from the label's prevalence over the groups, and with the true
number of carriers. The truth (the rows' own labels, training split only) is used to score the
assignments, never to make them: weighted recall and precision of the (member, label) weights.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xmc_spark.kernels.eagle import (  # noqa: E402
    Triples,
    expected_carriers,
    grlr_block,
    joint_weights,
    label_prevalence,
)
from xmc_spark.local_io import read_xc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a folder with train.txt (XC format)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--taus", default="10,30,100")
    args = ap.parse_args()
    X, Y = read_xc(str(Path(args.data) / "train.txt"))
    Y = Y.tocsr()
    n, L = Y.shape
    g = args.group_size
    grp_of = np.empty(n, np.int64)
    grp_of[np.random.default_rng(0).permutation(n)] = np.arange(n) // g
    # group x label carrier counts (sparse), then one triple per (group, label, member)
    G = int(grp_of.max()) + 1
    M = sp.csr_matrix((np.ones(Y.nnz), (np.repeat(grp_of, np.diff(Y.indptr)), Y.indices)), shape=(G, L))
    M.sum_duplicates()
    by_group = np.argsort(grp_of, kind="stable")
    mptr = np.concatenate([[0], np.cumsum(np.bincount(grp_of, minlength=G))])
    gi = np.repeat(np.arange(G), np.diff(M.indptr))
    ki = M.indices
    size_of = np.diff(mptr)[gi]
    lab = np.repeat(ki, size_of)
    grp = np.repeat(gi, size_of)
    first = np.repeat(np.cumsum(size_of) - size_of, size_of)           # each segment's first triple
    row = by_group[np.repeat(mptr[gi], size_of) + np.arange(len(lab)) - first]
    tr = Triples(lab, grp, row, row, L)
    E, _ = grlr_block(tr, X, 20, 0.1)
    s = tr.scores(E, X)
    labelled = np.diff(M.indptr) > 0
    size = np.diff(tr.seg)
    p = label_prevalence(np.bincount(ki, minlength=L), int(labelled.sum()), np.diff(mptr)[labelled].mean())
    est = expected_carriers(p[tr.lab[tr.seg[:-1]]], size)
    true_c = np.asarray(M[tr.grp[tr.seg[:-1]], tr.lab[tr.seg[:-1]]]).ravel()
    y = np.asarray(Y[tr.row, tr.lab]).ravel() > 0
    print(f"{Path(args.data).name}, random groups of {g}: {G} groups, {len(size)} (group, label)s, "
          f"{len(s)} triples; carriers per (group, label): estimated {est.mean():.3f}, true {true_c.mean():.3f} "
          f"(correlation {np.corrcoef(est, true_c)[0, 1]:.2f}); {100 * np.mean(true_c > 1):.1f}% of the (group, "
          f"label)s have several carriers, holding {100 * true_c[true_c > 1].sum() / true_c.sum():.1f}% "
          "of the true pairs")
    print("| joint_tau | carriers | weight | weighted recall | weighted precision |")
    print("|---|---|---|---|---|")
    for tau in (float(t) for t in args.taus.split(",")):
        for name, c in (("one", None), ("estimated", est), ("true", true_c)):
            w = joint_weights(tr, s, tau, carriers=c)[1]
            print(f"| {tau:g} | {name} | {w.sum():.0f} | {100 * (w * y).sum() / y.sum():.1f} | "
                  f"{100 * (w * y).sum() / w.sum():.1f} |")


if __name__ == "__main__":
    main()
