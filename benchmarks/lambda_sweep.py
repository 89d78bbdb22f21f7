"""Interpolated label trees: precision vs expected depth over lambda', and what depth buys
at prediction time.

Run on demand:

    python benchmarks/lambda_sweep.py --data ../shared/data/delicious --leaf 10
    python benchmarks/lambda_sweep.py --data ../shared/data/bibtex --leaf 10

Step 1 runs the real CLI: ``xmc-spark sweep`` over tree.lambda_prime (one model per value,
nested MLflow runs, OUT/sweep.png). Step 2 loads each saved model in this process and times
prediction of the test set (one thread, numba warm) with the three search modes: layered
(padded beam), tree (leaves score at their own depth) and adaptive (tree + pruning of
branches that cannot change the top k), reporting P@k and classifiers evaluated per row.
Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VALUES = "0,0.5,1,2,6,30,1000"


def time_search(model_dir: Path, X, Y, beam: int, topk: int = 5):
    from xmc_spark.kernels import metrics as M
    from xmc_spark.model import XMCModel

    model = XMCModel.load(str(model_dir))
    inv = M.propensities(model.label_counts, int(model.meta["n_train"]))
    out = {}
    for search in ("layered", "tree", "adaptive"):
        model.predict(X[:50], beam_size=beam, topk=topk, search=search)          # compile / warm
        best = np.inf
        for _ in range(3):
            t = time.perf_counter()
            res = model.predict(X, beam_size=beam, topk=topk, search=search, return_work=search != "layered")
            best = min(best, time.perf_counter() - t)
        m = M.evaluate(res[0], Y, inv, (1, 3, 5))
        out[search] = {"seconds": best, "p@1": m["p@1"], "p@5": m["p@5"],
                       "work": float(np.mean(res[2])) if len(res) == 3 else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with train.txt and test.txt (XC format)")
    ap.add_argument("--leaf", type=int, default=10, help="tree.max_leaf_size")
    ap.add_argument("--values", default=VALUES, help="lambda' values")
    ap.add_argument("--f-tilde", default="marginal", choices=["marginal", "greedy"])
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--work", default="/tmp/xmc-lambda-sweep")
    ap.add_argument("--skip-sweep", action="store_true", help="reuse the models of an earlier sweep in --work")
    args = ap.parse_args()
    data = Path(args.data)
    out = Path(args.work) / f"{data.name}_leaf{args.leaf}_{args.f_tilde}"
    if not args.skip_sweep:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "xmc_spark.cli", "sweep", "--train", str(data / "train.txt"), "--test",
               str(data / "test.txt"), "--out", str(out), "--values", args.values,
               "--set", f"tree.max_leaf_size={args.leaf}", "--set", f"tree.f_tilde={args.f_tilde}",
               "--set", f"predict.beam_size={args.beam}"]
        subprocess.run(cmd, check=True, env=env, cwd=args.work if Path(args.work).is_dir() else None)
    results = json.loads((out / "sweep.json").read_text())

    from xmc_spark.local_io import read_xc
    Xs, Ys = read_xc(str(data / "test.txt"))
    print(f"\n{data.name}, max_leaf_size={args.leaf}, f_tilde={args.f_tilde}, beam={args.beam}; "
          f"plot: {out / 'sweep.png'}\n")
    print("| lambda' | lambda | P@1 | P@3 | P@5 | depth@1 | depth@3 | depth@5 | tree depth | "
          "predict s layered / tree / adaptive | classifiers per row tree / adaptive | adaptive P@1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for r in results:
        lp = float(r["value"])
        lam = 2 * lp / (1 + lp)
        t = time_search(out / f"lambda_prime={r['value']}" / "model", Xs, Ys, args.beam)
        if base is None:
            base = r
        print(f"| {r['value']} | {lam:.3f} | {r['p@1']:.2f} | {r['p@3']:.2f} | {r['p@5']:.2f} | "
              f"{r['depth@1']:.2f} | {r['depth@3']:.2f} | {r['depth@5']:.2f} | {r['tree_depth']} | "
              f"{t['layered']['seconds']:.3f} / {t['tree']['seconds']:.3f} / {t['adaptive']['seconds']:.3f} | "
              f"{t['tree']['work']:.0f} / {t['adaptive']['work']:.0f} | {t['adaptive']['p@1']:.2f} |", flush=True)
    print("\nGoal: some lambda > 0 with depth@1 at least 10% below lambda = 0 and P@1 within 0.5 of it.")
    for r in results[1:]:
        d = 100 * (1 - r["depth@1"] / base["depth@1"])
        ok = d >= 10 and r["p@1"] >= base["p@1"] - 0.5
        print(f"  lambda'={r['value']}: depth@1 {d:+.1f}% below, P@1 {r['p@1'] - base['p@1']:+.2f} -> "
              f"{'MET' if ok else 'not met'}")


if __name__ == "__main__":
    main()
