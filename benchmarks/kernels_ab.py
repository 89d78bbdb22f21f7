"""The numba kernels of another commit against this checkout's, input by input in one process:
time (after / before) and whether the results are the same bit for bit.

Run on demand, e.g. for the kernels' unsigned indices (2026-12-03):

    python benchmarks/kernels_ab.py --before 73d94ab --data /tmp/xmc-bench/synth_200000_20000_50000

The kernel modules of ``--before`` (``git show REV:xmc_spark/kernels/<name>.py``) are imported
from a temporary folder beside this checkout's. Every input runs through both, the order
alternating from input to input (this VM's speed drifts by tens of percent within minutes, so
the two sides must share every stretch of it). Inputs, from the XC set ``--data``:

- solver: ``--groups`` random training groups of the set's own PIFA tree (teacher-forced rows of
  each node, as ``XMCModel.train_local`` trains them), ``squared_hinge.train_node`` (the whole
  call: what changed outside the compiled solver counts too);
- 2-means: the set's PIFA embeddings, the root and ten random subsets of 600-10,000 labels,
  ``balanced_kmeans.balanced_split`` into two (its cluster sums and projection; the similarities
  of more than two children are not timed);
- beam search: a model folder (``--model``, e.g. ``xmc-spark run``'s OUT/model; skipped without
  it) over the set's test rows in batches of 2,000, ``beam_search.beam_search``;
- distributed solver's pass: a random block (``--pass-rows`` rows x 20,000 features, one node of 2,
  8 and 40 classifiers), ``tron.partial_pass``.

Prints a markdown table.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def old_kernel(rev: str, name: str, folder: Path):
    """xmc_spark/kernels/<name>.py at ``rev``, imported as module ``<name>_before`` from ``folder``
    (its relative imports made absolute: the helpers it imports are this checkout's; its kernels
    compiled with numba's own ``njit``, without a disk cache)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:xmc_spark/kernels/{name}.py"],
                         capture_output=True, text=True, check=True).stdout
    src = re.sub(r"^from \.jit import (.*)$", r"from xmc_spark.kernels.jit import \1\nfrom numba import njit",
                 src, flags=re.M)                                    # numba's own njit: no disk cache
    src = re.sub(r"^from \.(\w*) import", r"from xmc_spark.kernels.\1 import", src, flags=re.M)
    path = folder / f"{name}_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod            # numba's cache finds its functions by module
    spec.loader.exec_module(mod)
    return mod


def interleaved(calls_new, calls_old, same) -> tuple:
    """(seconds new, seconds old, inputs whose results differ): each input's two calls in
    alternating order, after one warm-up call of each."""
    calls_new[0](), calls_old[0]()
    t_new = t_old = 0.0
    differ = 0
    for j, (new, old) in enumerate(zip(calls_new, calls_old)):
        out = {}
        for side, f in ((("new", new), ("old", old)) if j % 2 == 0 else (("old", old), ("new", new))):
            t = time.perf_counter()
            out[side] = f()
            dt = time.perf_counter() - t
            if side == "new":
                t_new += dt
            else:
                t_old += dt
        differ += not same(out["new"], out["old"])
    return t_new, t_old, differ


def _same_arrays(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def _same_csc(a, b) -> bool:
    return _same_arrays((a.indptr, a.indices, a.data), (b.indptr, b.indices, b.data))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit whose kernels are compared (git rev)")
    ap.add_argument("--data", required=True, help="XC set folder (train.txt, test.txt)")
    ap.add_argument("--model", help="a model folder of that set, for the beam search")
    ap.add_argument("--groups", type=int, default=60, help="training groups for the solver")
    ap.add_argument("--pass-rows", type=int, default=60000, help="rows of the distributed pass's block")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from xmc_spark.kernels import balanced_kmeans, beam_search, squared_hinge, tron
    from xmc_spark.kernels.label_embedding import pifa
    from xmc_spark.kernels.sparse import append_bias
    from xmc_spark.kernels.tree import tree_from_params
    from xmc_spark.local_io import read_xc
    from xmc_spark.model import TreeIndex, XMCModel
    from xmc_spark.params import TrainParams, TreeParams

    rng = np.random.default_rng(args.seed)
    X, Y = read_xc(str(Path(args.data) / "train.txt"))
    X, Y = sp.csr_matrix(X, dtype=np.float32), sp.csr_matrix(Y)
    Z = sp.csr_matrix(pifa(X, Y, normalize_y=True), dtype=np.float32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = {n: old_kernel(args.before, n, Path(tmp))
               for n in ("squared_hinge", "balanced_kmeans", "beam_search", "tron")}

        tp, tr = TreeParams(), TrainParams()
        index = TreeIndex(np.arange(Y.shape[1]), tree_from_params(Z, tp), Y.shape[1], tp.nr_splits)
        Xb = append_bias(X, tr.bias)
        r_all, g_all = index.groups_of_samples(Y.indptr, Y.indices)
        groups = np.unique(g_all)
        pick = np.sort(rng.choice(groups, size=min(args.groups, len(groups)), replace=False))
        problems = []
        for g in pick:
            r = np.sort(r_all[g_all == g])
            Yr = Y[r]
            problems.append((int(g), Xb[r], index.node_problem(int(g), Yr.indptr, Yr.indices, Yr.data)[1]))
        kw = dict(C=tr.C, threshold=tr.threshold, eps=tr.eps, max_iter=tr.max_iter)
        new_c = [lambda p=p, m=squared_hinge: m.train_node(p[1], p[2], seed=tr.seed + p[0], **kw) for p in problems]
        old_c = [lambda p=p, m=old["squared_hinge"]: m.train_node(p[1], p[2], seed=tr.seed + p[0], **kw)
                 for p in problems]
        n_rows = sum(p[1].shape[0] for p in problems)
        rows.append(("solver (`train_node`)", f"{len(pick)} training groups, {n_rows:,} rows",
                     *interleaved(new_c, old_c, _same_csc)))

        subsets = [np.arange(Z.shape[0])] + [np.sort(rng.choice(Z.shape[0], min(s, Z.shape[0]), replace=False))
                                             for s in (10000, 5000, 2500, 1200, 600) for _ in range(2)]
        mats = [Z[s] for s in subsets]
        rows.append(("2-means split (`balanced_split`)", f"the root and ten subsets of {Z.shape[0]:,} labels",
                     *interleaved([lambda M=M: balanced_kmeans.balanced_split(M, 2) for M in mats],
                                  [lambda M=M: old["balanced_kmeans"].balanced_split(M, 2) for M in mats],
                                  np.array_equal)))

        if args.model:
            model = XMCModel.load(args.model)
            Xt, _ = read_xc(str(Path(args.data) / "test.txt"))
            Xt = sp.csr_matrix(Xt, dtype=np.float32)
            Xt = sp.csr_matrix((Xt.data, Xt.indices, Xt.indptr), shape=(Xt.shape[0], model.n_features))
            Xt = append_bias(Xt, model.bias)
            layers, order = model.layers()
            labels = model.index.slot_label[order]
            chunks = [Xt[i:i + 2000] for i in range(0, Xt.shape[0], 2000)]
            rows.append(("beam search (`beam_search`)", f"{Xt.shape[0]:,} test rows, batches of 2,000",
                         *interleaved([lambda c=c: beam_search.beam_search(c, layers, labels) for c in chunks],
                                      [lambda c=c: old["beam_search"].beam_search(c, layers, labels) for c in chunks],
                                      _same_arrays)))

        n, d = args.pass_rows, 20001
        Xr = sp.random(n, d - 1, density=20 / d, format="csr", dtype=np.float32, random_state=args.seed)
        Xr = sp.hstack([Xr, np.ones((n, 1), np.float32)], format="csr")
        for K in (2, 8, 40):
            pos = sp.csr_matrix((rng.random((n, K)) < 0.05).astype(np.float32))
            W, V = rng.normal(scale=0.1, size=(d, K)), rng.normal(size=(d, K))
            blocks = {m: m.RowBlock(Xr, np.zeros(n, int), np.ones(n), pos) for m in (tron, old["tron"])}

            def call(m, blocks=blocks, K=K, W=W, V=V):
                f, h = m.partial_pass(blocks[m], np.array([0, K]), W, np.arange(K // 2), W, V, np.arange(K // 2, K),
                                      diag=True)
                return (*f, h)
            rows.append(("distributed pass (`partial_pass`)", f"{n:,} x {d - 1:,}, {K} classifiers, 16 passes",
                         *interleaved([lambda: call(tron)] * 16, [lambda: call(old["tron"])] * 16, _same_arrays)))

    print(f"| kernel | inputs | after s | before ({args.before}) s | after / before | inputs differing |")
    print("|---|---|---|---|---|---|")
    for name, inputs, t_new, t_old, differ in rows:
        print(f"| {name} | {inputs} | {t_new:.3f} | {t_old:.3f} | {t_new / t_old:.2f} | {differ} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
