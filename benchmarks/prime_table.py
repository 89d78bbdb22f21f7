"""PRIME table (issue #13): tree alone, PRIME standalone and tree + PRIME re-ranking of the
tree's top K, on one XC data set, one process, no Spark.

Run on demand (a few minutes on bibtex; use nice on a shared machine):

    nice -n 10 .venv/bin/python benchmarks/prime_table.py --data ../shared/data/bibtex
    nice -n 10 .venv/bin/python benchmarks/prime_table.py --data ../shared/data/bibtex --ablations

Protocol. A seeded ``--val-frac`` of the TRAINING rows is held out; the tree
(``XMCModel.train_local``, default parameters) and PRIME are trained on the rest. The tree's
top ``--hard-k`` labels of every fitting row (its beam search over its own training rows) are
PRIME's hard negatives. The re-rank mixing weight w (final = w tree + (1 - w) PRIME, over the
grid 0, 0.05, ..., 1) is chosen per K on the held-out training rows by the mean of P@1/3/5;
the test set is only scored, never used for a choice. PRIME trains ``--epochs`` epochs and keeps
the state of the epoch with the best mean P@1/3/5 of its standalone retrieval on the same
held-out rows (train seconds exclude those evaluations). PSP@k uses the propensities of the
fitting rows (A = 0.55, B = 1.5). Seconds are wall time of this process (numba warm for the
tree's prediction). Prints a markdown table; ``--out`` writes the numbers as JSON.

``--pipeline`` runs the real pipeline instead: one ``xmc-spark run`` (a subprocess, local[2],
MLflow off) per PRIME mode, ``prime.mode=rerank`` with each ``--rerank-k`` and
``prime.mode=retrieve``, on the standard split (the stage holds out ``prime.val_frac`` of the
training rows by a hash of sample_id itself), and reports each run's metrics.json: P@k and
PSP@k of the final predictions and of the tree alone (``tree_p@k``, the same run's tree), the
chosen weight and epoch, and the prime stage's seconds against the train stage's:

    nice -n 10 .venv/bin/python benchmarks/prime_table.py --data ../shared/data/bibtex --pipeline
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xmc_spark.kernels import metrics as M  # noqa: E402
from xmc_spark.kernels import prime as PR  # noqa: E402
from xmc_spark.local_io import read_xc  # noqa: E402
from xmc_spark.model import XMCModel  # noqa: E402

KS = (1, 3, 5)
ABLATIONS = {"no dynamic margin": {"margin_variant": "fixed"}, "no c_l": {"use_centroids": False},
             "no v_l": {"use_free": False}, "no R": {"lambda_r": 0.0}, "inverted band (Eq. 3/14)":
             {"margin_variant": "inverted"}}


def metrics(pred, Y, inv):
    m = M.evaluate(pred[:, :max(KS)], Y, inv, KS)
    return {k: round(m[k], 2) for k in [f"p@{k}" for k in KS] + [f"psp@{k}" for k in KS]}


def timed(f, *a, **kw):
    t = time.perf_counter()
    out = f(*a, **kw)
    return out, time.perf_counter() - t


def prime_rows(prm, data, tree_top, inv, rerank_ks, log):
    """Train PRIME with ``prm``; its standalone and re-rank rows of the table."""
    Xf, Yf, Xv, Yv, Xt, Yt = data
    best = {"score": -1.0}
    t_eval = [0.0]

    def on_epoch(e, model):
        # held-out training rows: mean P@1/3/5 of PRIME standalone; keep the best epoch's state
        t0 = time.perf_counter()
        m = metrics(PR.retrieve(PR.encode(model, Xv), PR.prototypes(model), max(KS))[0], Yv, inv)
        score = float(np.mean([m[f"p@{k}"] for k in KS]))
        if score > best["score"]:
            best.update(score=score, epoch=e + 1, weights=copy.deepcopy(model.weights),
                        centroids=model.centroids.copy())
        t_eval[0] += time.perf_counter() - t0
        loss = f"{model.history[-1]:.4f}" if model.history else "-"
        log(f"  epoch {e + 1}: loss {loss}, held-out mean P@1/3/5 {score:.2f}")

    on_epoch(-1, PR.init_model(Xf, Yf, prm))          # epoch 0: the PIFA-initialized model
    model, t_train = timed(PR.train, Xf, Yf, prm, shortlist=tree_top["fit"][0], on_epoch=on_epoch)
    t_train -= t_eval[0]
    model.weights, model.centroids = best["weights"], best["centroids"]
    t0 = time.perf_counter()
    Z = PR.prototypes(model)
    hv, ht = PR.encode(model, Xv), PR.encode(model, Xt)
    t_enc = time.perf_counter() - t0
    (lab, _), t_ret = timed(PR.retrieve, ht, Z, max(KS))
    val_p = metrics(PR.retrieve(hv, Z, max(KS))[0], Yv, inv)
    rows = {"PRIME standalone": {**metrics(lab, Yt, inv), "train_s": round(t_train, 1),
                                 "predict_s": round(t_enc + t_ret, 2), "val": val_p, "epoch": best["epoch"]}}
    for K in rerank_ks:
        cv, sv = tree_top["val"][0][:, :K], tree_top["val"][1][:, :K]
        w, table = PR.choose_weight(cv, sv, PR.candidate_scores(hv, Z, cv), Yv)
        ct, st = tree_top["test"][0][:, :K], tree_top["test"][1][:, :K]
        t0 = time.perf_counter()
        lab, _ = PR.rerank(ct, st, PR.candidate_scores(ht, Z, ct), w)
        t_rr = time.perf_counter() - t0
        rows[f"tree + PRIME re-rank K={K}"] = {
            **metrics(lab, Yt, inv), "w": w, "epoch": best["epoch"], "train_s": round(t_train, 1),
            "predict_s": round(tree_top["test_s"] + t_enc + t_rr, 2),
            "val_mean_p": {"tree": round(table[1.0], 2), "chosen": round(table[w], 2)}}
    return rows, model


def pipeline_runs(args, log) -> dict:
    """One ``xmc-spark run`` per PRIME mode; {row name: metrics} from each metrics.json."""
    import subprocess
    import tempfile
    data = Path(args.data)
    out_root = Path(args.out_dir or tempfile.mkdtemp(prefix="prime-pipeline-"))
    runs = [(f"tree + PRIME re-rank K={k}", ["prime.mode=rerank", f"prime.K={k}"]) for k in
            [int(x) for x in args.rerank_k.split(",")]] + ([] if args.no_standalone else
                                                          [("PRIME standalone", ["prime.mode=retrieve"])])
    common = [f"prime.epochs={args.epochs}", f"prime.dim={args.dim}", f"prime.lr={args.lr}",
              f"prime.batch_size={args.batch}", f"prime.hard_k={args.hard_k}", f"prime.val_frac={args.val_frac}",
              f"prime.seed={args.seed}", f"prime.residual={args.residual}", f"prime.patience={args.patience}",
              "mlflow.enabled=false",
              "spark.master=local[2]"]
    results = {}
    for name, sets in runs:
        out = out_root / name.replace(" ", "_").replace("+", "").replace("=", "")
        cmd = [sys.executable, "-m", "xmc_spark.cli", "run", "--train", str(data / "train.txt"), "--test",
               str(data / "test.txt"), "--out", str(out)]
        for kv in sets + common:
            cmd += ["--set", kv]
        log(" ".join(cmd))
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{name}: exit {r.returncode}\n{r.stderr[-3000:]}")
        m = json.loads((out / "metrics.json").read_text())
        sec = m["seconds"]
        results[name] = {**{k: m[k] for k in [f"{p}@{k}" for p in ("p", "psp") for k in KS]},
                         **{f"tree_{k}": m[f"tree_{k}"] for k in [f"{p}@{k}" for p in ("p", "psp") for k in KS]},
                         "w": m.get("prime.weight"), "epoch": m.get("prime.epoch"),
                         "epochs_run": m.get("prime.epochs_run"),
                         "val_mean_p": {"tree": m.get("prime.val_tree_mean_p"),
                                        "rerank": m.get("prime.val_rerank_mean_p")},
                         "prime_s": sec["prime"], "train_s": sec["train"], "predict_s": sec["predict"],
                         "run_s": round(time.perf_counter() - t0, 1), "out": str(out)}
        log(f"{name}: {json.dumps(results[name])}")
    return results


def print_pipeline(results, args) -> None:
    print(f"\n{Path(args.data).name}, pipeline (xmc-spark run, local[2]): PRIME dim {args.dim}, {args.epochs} epochs, "
          f"batch {args.batch}, lr {args.lr}, hard negatives from the tree's top {args.hard_k}, "
          f"{args.val_frac:.0%} of the training rows held out\n")
    print("| run | P@1 | P@3 | P@5 | PSP@1 | PSP@3 | PSP@5 | tree P@1 / P@3 / P@5 | w | epoch | prime s | train s "
          "| prime / train |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['p@1']:.2f} | {r['p@3']:.2f} | {r['p@5']:.2f} | {r['psp@1']:.2f} | {r['psp@3']:.2f} | "
              f"{r['psp@5']:.2f} | {r['tree_p@1']:.2f} / {r['tree_p@3']:.2f} / {r['tree_p@5']:.2f} | "
              f"{r['w'] if name.startswith('tree') else ''} | {r['epoch']} | {r['prime_s']:.1f} | {r['train_s']:.1f} | "
              f"{r['prime_s'] / r['train_s']:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with train.txt and test.txt (XC format)")
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--hard-k", type=int, default=20, help="shortlist size for PRIME's hard negatives")
    ap.add_argument("--rerank-k", default="20,100")
    ap.add_argument("--epochs", type=int, default=PR.PrimeParams.epochs)
    ap.add_argument("--dim", type=int, default=PR.PrimeParams.dim)
    ap.add_argument("--lr", type=float, default=PR.PrimeParams.lr)
    ap.add_argument("--batch", type=int, default=PR.PrimeParams.batch_size)
    ap.add_argument("--residual", action="store_true")
    ap.add_argument("--linear-r", action="store_true", help="R as written in Eq. 6-7 (no hinge)")
    ap.add_argument("--uniform-positives", action="store_true", help="not by inverse propensity")
    ap.add_argument("--batching", default=PR.PrimeParams.batching, choices=PR.BATCHINGS,
                    help="clustered: NGAME's batches with in-batch negatives")
    ap.add_argument("--r-margin", type=float, default=PR.PrimeParams.r_margin)
    ap.add_argument("--dropout", type=float, default=PR.PrimeParams.dropout)
    ap.add_argument("--weight-decay", type=float, default=PR.PrimeParams.weight_decay)
    ap.add_argument("--ablations", action="store_true", help="also the paper's ablations (one PRIME each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--pipeline", action="store_true", help="run the real pipeline (xmc-spark run) per PRIME mode")
    ap.add_argument("--no-standalone", action="store_true", help="--pipeline: only the re-rank runs")
    ap.add_argument("--patience", type=int, default=3, help="--pipeline: prime.patience (0: every epoch)")
    ap.add_argument("--out-dir", default="", help="--pipeline: where the runs go (default: a temp folder)")
    args = ap.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.pipeline:
        results = pipeline_runs(args, log)
        print_pipeline(results, args)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
        return
    data = Path(args.data)
    X, Y = read_xc(str(data / "train.txt"))
    Xt, Yt = read_xc(str(data / "test.txt"))
    rng = np.random.default_rng(args.seed)
    val = np.zeros(X.shape[0], bool)
    val[rng.choice(X.shape[0], int(round(args.val_frac * X.shape[0])), replace=False)] = True
    Xf, Yf, Xv, Yv = X[~val], Y[~val], X[val], Y[val]
    L = Y.shape[1]
    inv = 1.0 / M.propensities(np.bincount(Yf.indices, minlength=L), Xf.shape[0], n_labels=L)
    ks = [int(k) for k in args.rerank_k.split(",")]
    top = max(ks + [args.hard_k])

    tree, t_tree = timed(XMCModel.train_local, Xf, Yf)
    tree.predict(Xt[:20], beam_size=args.beam, topk=top)                     # numba warm
    tree_top = {}
    for name, Xs in (("fit", Xf), ("val", Xv), ("test", Xt)):
        (lab, sc), t = timed(tree.predict, Xs, beam_size=args.beam, topk=top)
        tree_top[name] = (lab, sc)
        tree_top[f"{name}_s"] = t
    tree_top["fit"] = (tree_top["fit"][0][:, :args.hard_k], None)
    results = {"tree alone": {**metrics(tree_top["test"][0], Yt, inv), "train_s": round(t_tree, 1),
                              "predict_s": round(tree_top["test_s"], 2)}}
    log(f"tree: {results['tree alone']}")
    prm = PR.PrimeParams(dim=args.dim, epochs=args.epochs, lr=args.lr, batch_size=args.batch,
                         residual=args.residual, r_hinge=not args.linear_r, r_margin=args.r_margin,
                         dropout=args.dropout, weight_decay=args.weight_decay, seed=args.seed,
                         propensity_positives=not args.uniform_positives, batching=args.batching)
    d = (Xf, Yf, Xv, Yv, Xt, Yt)
    rows, model = prime_rows(prm, d, tree_top, inv, ks, log)
    results.update(rows)
    log(json.dumps(rows))
    if args.ablations:
        for name, change in ABLATIONS.items():
            r, _ = prime_rows(replace(prm, **change), d, tree_top, inv, ks, log)
            for k, v in r.items():
                results[f"{k}, {name}"] = v
            log(f"{name}: {json.dumps(r)}")

    n_free = int(model.free_of_label.max()) + 1
    print(f"\n{data.name}: {Xf.shape[0]} fitting / {Xv.shape[0]} held-out training rows, {Xt.shape[0]} test rows, "
          f"{L} labels; PRIME dim {prm.dim}, {prm.epochs} epochs, batch {prm.batch_size}, lr {prm.lr}, "
          f"{n_free} free vectors, hard negatives from the tree's top {args.hard_k}\n")
    print("| method | P@1 | P@3 | P@5 | PSP@1 | PSP@3 | PSP@5 | w | epoch | train s | predict s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['p@1']:.2f} | {r['p@3']:.2f} | {r['p@5']:.2f} | {r['psp@1']:.2f} | {r['psp@3']:.2f} | "
              f"{r['psp@5']:.2f} | {r.get('w', '')} | {r.get('epoch', '')} | {r['train_s']} | {r['predict_s']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"params": asdict(prm), "args": vars(args), "results": results},
                                             indent=2))


if __name__ == "__main__":
    main()
