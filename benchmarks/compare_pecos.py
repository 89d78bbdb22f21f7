"""xmc-spark vs PECOS XR-Linear on the same data and cores: P@k and wall seconds per stage.

Run on demand (needs the bench extra: ``pip install -e .[local,bench]``):

    python benchmarks/compare_pecos.py --data ../shared/data/bibtex
    python benchmarks/compare_pecos.py --data ../shared/data/delicious
    python benchmarks/compare_pecos.py --synth 200000,20000,50000 --work /tmp/xmc-bench
    python benchmarks/compare_pecos.py --synth 500000,50000,100000 --repeat 3

With ``--repeat N`` the two run N times each, alternating (PECOS first in odd pairs, xmc-spark
first in even ones), so that the drift of a machine whose speed changes from hour to hour (a
shared VM) is spread over both sides rather than falling on one (it does not cancel): the table is
each pair's, and the summary the median and range of the pairs' process ratios.

xmc-spark runs through its real CLI in a subprocess, so its total includes JVM and Spark
start-up; PECOS runs in a subprocess too, with the same number of threads. Both read the
same XC text files with the same defaults (rows L2-normalized, PIFA, binary balanced
2-means with leaves <= 100, C = 1, threshold 0.1, beam 10).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PECOS_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from pecos.utils import smat_util
from pecos.xmc import Indexer, LabelEmbeddingFactory
from pecos.xmc.xlinear.model import XLinearModel
sys.path.insert(0, sys.argv[4])
from xmc_spark.local_io import read_xc
threads = int(sys.argv[3])
sec = {}
t = time.perf_counter(); Xt, Yt = read_xc(sys.argv[1]); Xs, Ys = read_xc(sys.argv[2]); sec["ingest"] = time.perf_counter() - t
t = time.perf_counter(); Z = LabelEmbeddingFactory.create(Yt, Xt, method="pifa", threads=threads); sec["embedding"] = time.perf_counter() - t
t = time.perf_counter(); C = Indexer.gen(Z, indexer_type="hierarchicalkmeans", max_leaf_size=100, nr_splits=2, seed=0, threads=threads); sec["tree"] = time.perf_counter() - t
t = time.perf_counter(); m = XLinearModel.train(Xt, Yt, C=C, threshold=0.1, threads=threads); sec["train"] = time.perf_counter() - t
t = time.perf_counter(); P = m.predict(Xs, beam_size=10, only_topk=5, threads=threads); sec["predict"] = time.perf_counter() - t
t = time.perf_counter(); met = smat_util.Metrics.generate(Ys, P, topk=5); sec["evaluate"] = time.perf_counter() - t
sec["total"] = time.perf_counter() - t0
print(json.dumps({"p@1": float(met.prec[0]) * 100, "p@3": float(met.prec[2]) * 100, "p@5": float(met.prec[4]) * 100, "seconds": sec}))
"""

STAGES = ["ingest", "embedding", "tree", "train", "predict", "evaluate", "total"]


def run_pecos(train: str, test: str, cores: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(cores))
    r = subprocess.run([sys.executable, "-c", PECOS_SCRIPT, train, test, str(cores), str(ROOT)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"PECOS failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_xmc(train: str, test: str, out: Path, cores: int, extra, python: str = sys.executable) -> dict:
    """One ``xmc-spark run`` into a fresh output folder (``out/run``, an earlier run's removed
    first), as PECOS's model is made afresh: a run into an old folder overwrites its tables, a
    different job (before 2026-12-04's sixth session this script measured that one)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "run", ignore_errors=True)
    cmd = [python, "-m", "xmc_spark.cli", "run", "--train", train, "--test", test, "--out", str(out / "run"),
           "--set", f"spark.master=local[{cores}]", "--set", "mlflow.enabled=false", *extra]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"xmc-spark failed:\n{r.stderr[-3000:]}")
    m = json.loads((out / "run" / "metrics.json").read_text())
    m["seconds"]["process"] = wall  # includes Python, JVM and Spark start-up
    # the pipeline's "tree" stage runs the label embedding inside it (its seconds include the
    # embedding's); with embedding.write_table its write is timed apart as "embedding", and the
    # tree row here is then the tree alone (see same_stages for the default)
    if "tree" in m["seconds"] and "embedding" in m["seconds"]:
        m["seconds"]["tree"] = round(m["seconds"]["tree"] - m["seconds"]["embedding"], 3)
    return m


def same_stages(xm: dict, pe: dict) -> dict:
    """PECOS's result with the rows xmc-spark's ``xm`` has: by default the label embedding runs
    inside xmc-spark's tree plan (no "embedding" row), so PECOS's embedding is counted in its tree."""
    sec = dict(pe["seconds"])
    if "embedding" not in xm["seconds"] and "embedding" in sec:
        sec["tree"] = round(sec.get("tree", 0.0) + sec.pop("embedding"), 3)
    return {**pe, "seconds": sec}


def make_synth(spec: str, work: Path, cores: int, python: str = sys.executable) -> tuple:
    """XC files of ``xmc-spark synth`` (n_train,n_labels,n_features), made once under ``work``
    by ``python`` (the interpreter with xmc-spark installed: ``--xmc-python`` when this script
    runs in PECOS's own venv)."""
    n, L, d = (int(x) for x in spec.split(","))
    data = work / f"synth_{n}_{L}_{d}"
    if not (data / "test.txt").exists():
        cmd = [python, "-m", "xmc_spark.cli", "synth", "--out", str(data), "--n-train", str(n),
               "--n-test", str(max(n // 10, 1000)), "--labels", str(L), "--features", str(d), "--format", "xc",
               "--set", f"spark.master=local[{cores}]", "--set", "mlflow.enabled=false"]
        subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True)
    return str(data / "train.txt"), str(data / "test.txt"), data.name


def pair_ratios(pairs) -> dict:
    """Per pair (xmc-spark, PECOS) of result dicts: the process seconds' ratio; with their median
    and range, and the median seconds of each side."""
    xs = [x["seconds"]["process"] for x, _ in pairs]
    ps = [p["seconds"]["total"] for _, p in pairs]
    ratios = [x / max(p, 1e-9) for x, p in zip(xs, ps)]
    return {"ratios": [round(r, 3) for r in ratios], "median_ratio": round(statistics.median(ratios), 3),
            "min_ratio": round(min(ratios), 3), "max_ratio": round(max(ratios), 3),
            "median_xmc_s": round(statistics.median(xs), 1), "median_pecos_s": round(statistics.median(ps), 1)}


def print_pair(name: str, xm: dict, pe: dict) -> None:
    print(f"data: {name}  n_train={xm['n_train']} n_test={xm['n_test']} labels={xm['n_labels']}")
    print(f"{'':>14} {'xmc-spark':>10} {'PECOS':>10} {'diff/ratio':>10}")
    for k in ["p@1", "p@3", "p@5"]:
        print(f"{k:>14} {xm[k]:>10.2f} {pe[k]:>10.2f} {xm[k] - pe[k]:>+10.2f}")
    for s in STAGES + ["process"]:
        a = xm["seconds"].get(s)
        b = pe["seconds"].get(s if s != "process" else "total")
        if a is None or b is None:
            continue
        print(f"{'sec ' + s:>14} {a:>10.2f} {b:>10.2f} {a / max(b, 1e-9):>9.1f}x")
    print(json.dumps({"data": name, "xmc_spark": {k: xm[k] for k in ["p@1", "p@3", "p@5", "seconds"]}, "pecos": pe}),
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="folder with train.txt and test.txt (XC format)")
    ap.add_argument("--synth", help="n_train,n_labels,n_features: generate XC files with `xmc-spark synth`")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--work", default="/tmp/xmc-bench")
    ap.add_argument("--set", action="append", default=[], help="extra xmc-spark --set overrides")
    ap.add_argument("--repeat", type=int, default=1, help="pairs of runs, alternating which side goes first")
    ap.add_argument("--xmc-python", default=sys.executable,
                    help="the Python that runs xmc-spark (default: this one); e.g. the project's .venv/bin/python "
                         "when this one is a PECOS venv (numpy < 2), so that xmc-spark runs as installed, with its "
                         "numba cache")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    work = Path(args.work)
    if args.synth:
        train, test, name = make_synth(args.synth, work, args.cores, args.xmc_python)
    else:
        train, test, name = str(Path(args.data) / "train.txt"), str(Path(args.data) / "test.txt"), Path(args.data).name
    extra = [x for s in args.set for x in ("--set", s)]
    print(f"cores: {args.cores}", flush=True)
    pairs = []
    for i in range(args.repeat):
        if i % 2 == 0:
            pe = run_pecos(train, test, args.cores)
            xm = run_xmc(train, test, work / name, args.cores, extra, args.xmc_python)
        else:
            xm = run_xmc(train, test, work / name, args.cores, extra, args.xmc_python)
            pe = run_pecos(train, test, args.cores)
        pairs.append((xm, pe))
        print_pair(f"{name} (pair {i + 1} of {args.repeat})" if args.repeat > 1 else name, xm, same_stages(xm, pe))
    if args.repeat > 1:
        summary = pair_ratios(pairs)
        print(f"process ratio xmc-spark / PECOS over {args.repeat} pairs: median {summary['median_ratio']:.2f}x "
              f"(range {summary['min_ratio']:.2f}-{summary['max_ratio']:.2f}x; median seconds "
              f"{summary['median_xmc_s']} / {summary['median_pecos_s']})")
        print(json.dumps({"data": name, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
