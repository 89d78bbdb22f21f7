"""The distributed solver's vectors in shared files: every method of the file-backed space
(gradient, Hessian-vector product, combination, inner products; all classifiers and a subset)
equals the in-memory space on the big nodes of the stage tests' problem. That the stage trains
the same weights with its vectors in files as on the driver, leaving no file behind, is
tests/stages/test_node_training.py's big-nodes test (both equal local TRON's iterates)."""
import os

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp
from pyspark import StorageLevel

from tests.stages.conftest import D, L
from xmc_spark.arrow_utils import to_arrow
from xmc_spark.compat import share
from xmc_spark.kernels import tron
from xmc_spark.kernels.label_embedding import pifa
from xmc_spark.kernels.tree import TreeIndex, build_tree
from xmc_spark.params import TrainParams
from xmc_spark.stages import node_training
from xmc_spark.stages.shared_vectors import SharedSpace, query_tasks

BOUND = 60      # of the 150 samples: the root and the nodes near it are big


@pytest.fixture(scope="module")
def index(problem):
    _, Xl, Yl = problem
    return TreeIndex(np.arange(L), build_tree(pifa(Xl, Yl), 4, 2, 20, 0), L, 2)


def _big(index, Y):
    rows, groups = index.groups_of_samples(Y.indptr, Y.indices)
    g, c = np.unique(groups, return_counts=True)
    assert (c > BOUND).sum() >= 3
    return g[c > BOUND]


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def _packed(problem, index):
    """The big nodes' rows packed as the stage packs them (persisted), the same rows as one
    in-memory block, the nodes' classifier offsets, d and K."""
    samples, _, Yl = problem
    tp = TrainParams(C=1.5, bias=0.5)
    big = _big(index, Yl)
    kids = [index.node_problem(int(g), np.zeros(1, np.int64), np.zeros(0, np.int64))[0] for g in big]
    node_ptr = np.concatenate([[0], np.cumsum([len(k) for k in kids])]).astype(np.int64)
    d, K = D + 1, int(node_ptr[-1])
    packed = (node_training._big_rows(samples, share(samples, index), big, node_ptr).repartition(3)
              .sortWithinPartitions("node")
              .mapInArrow(node_training._pack_rows(D, K, tp.bias, tp.C, max_rows=16), node_training.PACK_SCHEMA)
              .persist(StorageLevel.MEMORY_ONLY))
    blocks = [rb for b in to_arrow(packed).to_batches() for rb in node_training._unpack(b, d, K)]
    whole = tron.RowBlock(sp.vstack([b.X for b in blocks], format="csr"), np.concatenate([b.node for b in blocks]),
                          np.concatenate([b.cost for b in blocks]), sp.vstack([b.pos for b in blocks], format="csr"))
    return packed, whole, node_ptr, d, K


def test_space_methods_equal_the_in_memory_space(problem, index, tmp_path):
    packed, whole, node_ptr, d, K = _packed(problem, index)
    ref = tron.NumpySpace(*tron.local_oracle(whole, node_ptr), d, K)
    got = SharedSpace(packed, lambda b: node_training._unpack(b, d, K), node_ptr, d, str(tmp_path))
    allc, sub = np.arange(K), np.arange(K)[1::2]          # the subset leaves classifiers of every node out
    assert len(np.unique(np.searchsorted(node_ptr, sub, side="right"))) > 1

    def both(method, *args, **kw):
        a, b = getattr(ref, method)(*args, **kw), getattr(got, method)(*args, **kw)
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert np.shape(x) == np.shape(y), method
            np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-12, err_msg=method)

    both("fun_grad", [], "G", allc, dots=[("G", "G")])
    both("hess_vec", "W", "G", "HD", allc, dots=[("G", "HD"), ("HD", "HD")])
    both("combine", {"W": [(0.3, "G"), (-0.01 * np.arange(K), "HD")], "D": [(1.0, "G")]}, allc,
         dots=[("W", "W"), ("W", "D")])
    both("fun_grad", [(1.0, "W"), (0.5, "D")], "Gn", sub, dots=[("Gn", "Gn"), ("W", "Gn")])
    both("hess_vec", "W", "D", "HD", sub, dots=[("D", "HD"), ("Gn", "HD")])
    both("combine", {"W": [(1.0, "HD"), (np.arange(len(sub)), "W")], "S": []}, sub,
         dots=[("W", "W"), ("S", "S"), ("W", "Gn")])

    # deferred combinations (no inner products asked): applied by the next job, also to a node
    # that job does not otherwise touch, and by weights()
    both("combine", {"D": [(1.0, "W"), (0.2, "HD")], "S": [(1.0, "D")]}, allc)
    rest = np.arange(node_ptr[1], K)                     # node 0 left out
    both("hess_vec", "W", "D", "HD", rest, dots=[("D", "HD"), ("S", "S"), ("S", "D")])
    both("combine", {"S": [(2.0, "S")], "R": [(1.0, "D"), (-1.0, "S")]}, sub)
    both("fun_grad", [(1.0, "W"), (1.0, "S")], "Gn", allc, dots=[("G", "S"), ("S", "S"), ("R", "R"), ("D", "D")])
    # a combination meeting a deferred one (which runs first, as a job of its own), then a product
    # over a few classifiers of nodes whose other, deferred classifiers it must still write
    both("combine", {"S": [(0.5, "D")]}, sub)
    both("combine", {"D": [(1.0, "S"), (1.0, "R")], "R": [(-0.3, "D")]}, allc)
    both("hess_vec", "W", "D", "HD", allc[::3], dots=[("D", "HD"), ("R", "D")])
    both("fun_grad", [(1.0, "W")], "Gn", allc, dots=[("D", "D"), ("R", "R"), ("S", "S")])
    both("combine", {"W": [(1.0, "W"), (0.5, "S")]}, sub)
    # the preconditioner: M from the gradient's pass, elementwise "A/M", "A*M" in terms and dots,
    # also through a deferred combination and a product that just wrote one of the factors
    both("fun_grad", [(1.0, "W")], "G", allc, dots=[("G", "G"), ("G", "G*M"), ("G", "G/M")], precond=("M", 0.3))
    both("combine", {"D": [(-1.0, "G/M")], "R": [(-1.0, "G")]}, allc, dots=[("D", "D*M"), ("R", "D")])
    both("hess_vec", "W", "D", "HD", allc, dots=[("D", "HD"), ("R", "HD/M"), ("HD", "HD/M"), ("S", "D*M")])
    both("combine", {"S": [(1.0, "S"), (0.1, "D")], "R": [(1.0, "R"), (-0.1, "HD")],
                     "D": [(1.0, "R/M"), (-0.1, "HD/M"), (0.5, "D")]}, allc)
    both("hess_vec", "W", "D", "HD", allc, dots=[("D", "HD"), ("R", "R/M"), ("S", "S*M")])
    both("fun_grad", [(1.0, "W"), (1.0, "S")], "Gn", sub, dots=[("Gn", "Gn/Mn"), ("S", "S*M")],
         precond=("Mn", 0.01))
    both("combine", {"M": [(1.0, "Mn")], "G": [(1.0, "Gn")]}, sub, dots=[("G", "G/M")])
    # one pass (one Spark job) serving two sets of classifiers: Hessian products for some, gradients
    # with the preconditioner for the others, after a deferred combination over both; then each alone
    H, E = allc[::2], allc[1::2]

    def step(hv, fg):
        def flat(res):          # (hv's dots or None, fg's (f, dots) or None) -> the arrays
            return ([] if res[0] is None else [res[0]]) + ([] if res[1] is None else list(res[1]))
        jobs = got.jobs
        a, b = flat(ref.step(hv, fg)), flat(got.step(hv, fg))
        assert got.jobs == jobs + 1 and len(a) == len(b) == (hv is not None) + 2 * (fg is not None)
        for u, w in zip(a, b):
            np.testing.assert_allclose(w, u, rtol=1e-9, atol=1e-12)
    both("combine", {"S": [(1.0, "S"), (0.3, "D")], "D": [(1.0, "R/M"), (0.5, "D")]}, allc)
    step(("W", "D", "HD", H, [("D", "HD")]), None)
    # a deferred combination that leaves some vectors as they are on some classifiers (W on H) or
    # on all (G): only the rest are rewritten, and what reads them still sees the update
    HE = np.r_[H, E]
    both("combine", {"W": [(1.0, "W"), (np.r_[np.zeros(len(H)), np.full(len(E), 0.5)], "S")], "G": [(1.0, "G")],
                     "R": [(-1.0, "G")]}, HE)
    assert set(got.pending[0]) == {"W", "R"} and not got.pending[1]["W"][H].any() and got.pending[1]["W"][E].all()
    step(("W", "D", "HD", H, [("D", "HD"), ("R", "HD/M"), ("S", "S*M")]),
         ([(1.0, "W"), (1.0, "S")], "Gn", E, [("G", "S"), ("Gn", "Gn"), ("Gn", "Gn/Mn")], ("Mn", 0.2)))
    step(("W", "D", "HD", sub, [("D", "HD")]), None)
    step(None, ([(1.0, "W")], "Gn", rest, [("Gn", "Gn")], None))

    def emit(g, Wg):
        return pa.table({"col": pa.array(node_ptr[g] + np.arange(Wg.shape[1])),
                         "w": pa.array(list(Wg.T), pa.list_(pa.float64()))})
    W = ref.result()
    out = {r["col"]: np.asarray(r["w"]) for r in got.weights(emit, "col long, w array<double>").collect()}
    assert sorted(out) == list(range(K))
    for j in range(K):
        np.testing.assert_allclose(out[j], W[:, j], rtol=1e-9, atol=1e-12)
    assert got.driver_bytes < 64 * 1024          # scalars only: a few doubles per node and block
    got.close()
    packed.unpersist()
    assert not os.listdir(tmp_path)


def test_a_pass_runs_in_at_most_the_given_tasks(problem, index, tmp_path):
    """With par = 1 a data pass merges the 3 row partitions into one task (query_tasks), where
    every node's rows arrive in several runs (the partitions are round-robin): each run emits its
    pieces and the reduce sums them, the same vectors and inner products as in memory."""
    packed, whole, node_ptr, d, K = _packed(problem, index)
    assert packed.rdd.getNumPartitions() == 3
    nodes = to_arrow(query_tasks(packed, 1).select("node")).column("node").to_numpy()
    runs = np.concatenate([[True], nodes[1:] != nodes[:-1]])
    assert np.bincount(nodes[runs]).max() > 1                     # a node in several runs of the task
    ref = tron.NumpySpace(*tron.local_oracle(whole, node_ptr), d, K)
    got = SharedSpace(packed, lambda b: node_training._unpack(b, d, K), node_ptr, d, str(tmp_path), par=1)
    sc = packed.sparkSession.sparkContext
    sc.setJobGroup("one-task-passes", "test")
    try:
        allc = np.arange(K)
        for method, args, kw in [("fun_grad", ([], "G", allc), {"dots": [("G", "G")]}),
                                 ("hess_vec", ("W", "G", "HD", allc), {"dots": [("G", "HD"), ("HD", "HD")]})]:
            a, b = getattr(ref, method)(*args, **kw), getattr(got, method)(*args, **kw)
            for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-12, err_msg=method)
    finally:
        for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
            sc.setLocalProperty(key, None)
    sc._jsc.sc().listenerBus().waitUntilEmpty()        # the tracker has every task's end (else a stage
    st = sc.statusTracker()                             # still ending would look skipped below)
    jobs = [st.getJobInfo(j) for j in st.getJobIdsForGroup("one-task-passes")]
    ran = [st.getStageInfo(s) for j in jobs if j is not None for s in j.stageIds]
    ran = [(i.name, i.numTasks) for i in ran if i is not None and i.numCompletedTasks > 0]   # not the skipped packing
    assert len(ran) >= 4 and max(n for _, n in ran) == 1, ran
    got.close()
    packed.unpersist()


# ~25 s with its packing: on demand (-m on_demand), to keep CI under its 30 minutes; the
# preconditioner is off by default (train.tron_pcg = 0), the test above checks every method it
# uses on the files (M, Mn, "A/M", "A*M" in terms and dots, shared passes), and
# tests/stages/test_node_training.py runs the stage's loop with its vectors in files (no preconditioner)
# and with the preconditioner (vectors on the driver), both against local TRON
@pytest.mark.on_demand
def test_the_preconditioned_loop_in_files_equals_the_in_memory_loop(problem, index, tmp_path):
    """The whole loop with the preconditioner (restarts, masks, M and Mn) on the file-backed
    space: the same iterates, steps and passes (one Spark job each) as in memory."""
    packed, whole, node_ptr, d, K = _packed(problem, index)
    fg_, hv_ = tron.local_oracle(whole, node_ptr)
    loop = SharedSpace(packed, lambda b: node_training._unpack(b, d, K), node_ptr, d, str(tmp_path))
    mem = tron.NumpySpace(fg_, hv_, d, K)
    a = tron.tron_space(mem, d, K, eps=1e-3, max_iter=4, pcg=0.5)
    b = tron.tron_space(loop, d, K, eps=1e-3, max_iter=4, pcg=0.5)
    assert (a.steps == b.steps).all() and (a.cg_steps == b.cg_steps).all() and a.passes == b.passes == loop.jobs
    assert a.steps.max() > 1 and a.passes < a.fun_grad_calls + a.hess_vec_calls     # kinds shared passes
    np.testing.assert_allclose(b.f, a.f, rtol=1e-9)
    loop.flush()
    files = loop._files()
    for g in range(len(node_ptr) - 1):
        Wg = files.whole(loop.fs, [(np.ones(K), "W")], g, np.arange(node_ptr[g + 1] - node_ptr[g]))
        np.testing.assert_allclose(Wg, mem.result()[:, node_ptr[g]:node_ptr[g + 1]], rtol=1e-8, atol=1e-11)
    loop.close()
    packed.unpersist()
    assert not os.listdir(tmp_path)
