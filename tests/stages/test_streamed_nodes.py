"""Big nodes trained one task each over rows streamed from block files: the streamed oracle
against the in-memory one, the trainer against local TRON, the block files against the rows
written, and the files' removal after a failure. The stage's weights against local TRON and the
bibtex CLI run are in test_node_training.py, beside the distributed solver's."""
import numpy as np
import pyarrow.fs as pafs
import pytest
import scipy.sparse as sp

from xmc_spark.kernels import tron
from xmc_spark.kernels.sparse import append_bias
from xmc_spark.params import TrainParams
from xmc_spark.stages import node_training, streamed_nodes
from xmc_spark.storage import client_fs

NODE_PTR = np.array([0, 3, 5])          # node 0: classifiers 0-2, node 1: classifiers 3-4


def mixed_rows(n=240, d=30, seed=0, bias=0.5):
    """Rows of two nodes mixed (with sample and label weights), as the packed blocks hold them:
    positives among their own node's classifiers only."""
    rng = np.random.default_rng(seed)
    X = append_bias(sp.random(n, d, density=0.2, random_state=seed, format="csr", dtype=np.float32), bias)
    node = rng.integers(0, 2, n)
    owner = rng.integers(0, 5, d + 1)
    score = np.asarray(X @ np.eye(5)[owner]) + rng.normal(0, 0.05, (n, 5))
    own = (np.arange(5)[None, :] >= NODE_PTR[node][:, None]) & (np.arange(5)[None, :] < NODE_PTR[node + 1][:, None])
    pos = own & (score > np.quantile(score, 0.7, axis=0))
    P = sp.csr_matrix(pos * rng.uniform(0.2, 1.0, (n, 5)), dtype=np.float32)
    return tron.RowBlock(X, node, 1.3 * rng.uniform(0.3, 2.0, n), P)


def node_blocks(rows: tron.RowBlock, g: int, size: int):
    """Node g's rows cut into RowBlocks of ``size`` rows, as block_reader yields them."""
    r = np.flatnonzero(rows.node == g)
    out = [tron.RowBlock(rows.X[r[lo:lo + size]], np.full(len(r[lo:lo + size]), g), rows.cost[r[lo:lo + size]],
                         rows.pos[r[lo:lo + size]]) for lo in range(0, len(r), size)]
    return lambda: iter(out)


def only(rows: tron.RowBlock, g: int) -> tron.RowBlock:
    r = np.flatnonzero(rows.node == g)
    return tron.RowBlock(rows.X[r], rows.node[r], rows.cost[r], rows.pos[r])


def test_the_streamed_oracle_is_the_in_memory_one():
    """f, gradient, the Hessian's diagonal and H V of node 1's classifiers over its rows in blocks
    of 17 equal the local oracle's over the same rows in memory (global classifier ids)."""
    rows = mixed_rows()
    d = rows.X.shape[1]
    rng = np.random.default_rng(3)
    W, V = rng.normal(0, 0.3, (d, 2)), rng.normal(0, 1.0, (d, 2))
    fun_grad, hess_vec, mixed = streamed_nodes.node_oracle(node_blocks(rows, 1, 17), NODE_PTR, 3, d)
    ref_fg, ref_hv = tron.local_oracle(only(rows, 1), NODE_PTR)
    cols = np.array([0, 1])
    for got, ref in zip(fun_grad(W, cols, True), ref_fg(W, cols + 3, True)):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(hess_vec(W, V, cols), ref_hv(W, V, cols + 3), rtol=1e-10, atol=1e-12)
    # both kinds in one pass, on disjoint classifiers
    fg, hv = mixed(W[:, :1], np.array([0]), False, W[:, 1:], V[:, 1:], np.array([1]))
    ref = ref_fg(W[:, :1], np.array([3]))
    np.testing.assert_allclose(fg[0], ref[0], rtol=1e-10)
    np.testing.assert_allclose(fg[1], ref[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(hv, ref_hv(W[:, 1:], V[:, 1:], np.array([4])), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("g,lo,hi", [(0, 0, 3), (1, 3, 5), (0, 1, 3)])
def test_a_streamed_node_trains_as_local_tron(g, lo, hi):
    """train_node over blocks of 16 rows, on a node's classifiers or a run of them: the local
    TRON's weights and passes on the node's rows in memory, at the same scaled tolerance; the
    counts pass finds the node's rows and the run's positives."""
    rows = mixed_rows(seed=1)
    d = rows.X.shape[1]
    params = TrainParams(tron_eps=0.01, tron_max_iter=20)
    blocks = node_blocks(rows, g, 16)
    n, pos = streamed_nodes.node_counts(blocks, lo, hi)
    mine = only(rows, g)
    assert n == mine.X.shape[0]
    np.testing.assert_array_equal(pos, np.asarray((mine.pos[:, lo:hi] != 0).sum(axis=0)).ravel())
    W, info = streamed_nodes.train_node(blocks, NODE_PTR, lo, hi, d, params)
    fun_grad, hess_vec = tron.local_oracle(mine, NODE_PTR)
    K = hi - lo
    ref, ref_info = tron.tron(lambda w, c, diag=False: fun_grad(w, c + lo, diag),
                              lambda w, v, c: hess_vec(w, v, c + lo), d, K,
                              eps=tron.liblinear_eps(0.01, pos, np.full(K, n)), max_iter=20)
    assert info.passes == ref_info.passes and info.converged.all()
    np.testing.assert_allclose(W, ref, rtol=1e-7, atol=1e-9)


def big_frame(spark, rows: tron.RowBlock, d: int):
    """The rows as the big nodes' DataFrame (node_training.BIG_SCHEMA), features without the bias."""
    X = rows.X[:, :d].tocsr()
    data = [(int(rows.node[i]), X.indices[X.indptr[i]:X.indptr[i + 1]].tolist(),
             X.data[X.indptr[i]:X.indptr[i + 1]].tolist(), float(rows.cost[i]),
             rows.pos.indices[rows.pos.indptr[i]:rows.pos.indptr[i + 1]].tolist(),
             rows.pos.data[rows.pos.indptr[i]:rows.pos.indptr[i + 1]].tolist()) for i in range(X.shape[0])]
    return spark.createDataFrame(data, node_training.BIG_SCHEMA)


def test_the_block_files_hold_the_rows(spark, tmp_path):
    """write_blocks over 3 partitions (blocks of at most 7 rows): per node the rows and block
    counts it reports, and block_reader reads back exactly the node's rows (bias appended, cost =
    C x weight, positives with their label weights), one file a block; a node without rows reads
    as nothing."""
    rows = mixed_rows(n=60, seed=2)
    d = rows.X.shape[1] - 1
    df = big_frame(spark, rows, d).repartition(3).sortWithinPartitions("node")
    pack = node_training._pack_rows(d, 5, 0.5, 2.0, max_rows=7)
    uri = str(tmp_path / "blocks")
    written = streamed_nodes.write_blocks(df, pack, uri).sort_by("node")
    counts = np.bincount(rows.node, minlength=2)
    assert written.column("node").to_pylist() == [0, 1]
    assert written.column("rows").to_pylist() == counts.tolist()
    fs, root = client_fs(uri)
    for g in (0, 1):
        files = [f for f in fs.get_file_info(pafs.FileSelector(f"{root}/n{g}")) if f.path.endswith(".arrow")]
        assert len(files) == written.column("blocks").to_pylist()[g] >= counts[g] / 7
        got = list(streamed_nodes.block_reader(fs, f"{root}/n{g}", lambda b: node_training._unpack(b, d + 1, 5))())
        assert all(b.X.shape[0] <= 7 and (b.node == g).all() for b in got)
        X = sp.vstack([b.X for b in got]).toarray()
        P = sp.vstack([b.pos for b in got]).toarray()
        cost = np.concatenate([b.cost for b in got])
        mine = only(rows, g)
        key = lambda M, c: np.lexsort(np.column_stack([M, c]).T)           # noqa: E731 - rows as a multiset
        ref_X = mine.X.toarray()
        a, b = key(X, cost), key(ref_X, 2.0 * mine.cost)
        np.testing.assert_allclose(X[a], ref_X[b], rtol=1e-6)
        np.testing.assert_allclose(cost[a], 2.0 * mine.cost[b], rtol=1e-6)
        np.testing.assert_allclose(P[a], mine.pos.toarray()[b], rtol=1e-6)
    assert list(streamed_nodes.block_reader(fs, f"{root}/n7", lambda b: node_training._unpack(b, d + 1, 5))()) == []


@pytest.mark.parametrize("where", ["writing", "training"])
def test_a_failed_run_leaves_no_files(spark, tmp_path, where):
    """A task failing while the blocks are written, or while a node trains over them: the error
    reaches the caller and the run's block folder is gone."""
    rows = mixed_rows(n=30, seed=4)
    d = rows.X.shape[1] - 1
    df = big_frame(spark, rows, d).repartition(2).sortWithinPartitions("node")
    good = node_training._pack_rows(d, 5, 0.5, 1.0, max_rows=4)

    def bad_pack(batches):
        for i, b in enumerate(good(batches)):
            if i == 2:
                raise RuntimeError("disk gone")
            yield b

    def bad_unpack(b):
        raise RuntimeError("disk gone")
    kids = [np.arange(3), np.arange(3, 5)]
    unpack = lambda b: node_training._unpack(b, d + 1, 5)              # noqa: E731
    pack, unpack = (bad_pack, unpack) if where == "writing" else (good, bad_unpack)
    with pytest.raises(Exception, match="disk gone"):
        streamed_nodes.train_streamed(spark, df, pack, unpack, np.array([0, 1]), kids, NODE_PTR, d + 1,
                                      np.array([False, True]), TrainParams(), str(tmp_path),
                                      node_training._weights_table)
    assert not list(tmp_path.iterdir())


def test_writing_the_blocks_again_changes_nothing(spark, tmp_path):
    """A rerun of the write (a retried or speculative attempt) over the same partitions writes the
    same file names with the same bytes and reports the same counts: a reader never sees a row
    twice."""
    rows = mixed_rows(n=50, seed=5)
    d = rows.X.shape[1] - 1
    df = big_frame(spark, rows, d).repartition(3).sortWithinPartitions("node")
    pack = node_training._pack_rows(d, 5, 0.5, 1.0, max_rows=6)
    uri = str(tmp_path / "blocks")

    def files():
        return {p.relative_to(tmp_path): p.read_bytes() for p in sorted((tmp_path / "blocks").rglob("*.arrow"))}
    first = streamed_nodes.write_blocks(df, pack, uri).sort_by("node")
    before = files()
    again = streamed_nodes.write_blocks(df, pack, uri).sort_by("node")
    assert again.equals(first) and files() == before and len(before) == sum(first.column("blocks").to_pylist())
    assert not [p for p in (tmp_path / "blocks").rglob("*") if p.is_file() and p.suffix != ".arrow"]


def test_work_units_cut_wide_nodes_and_put_the_most_work_first():
    """Rows x classifiers per node: 2,000 / 8,000 / 20 / 5,000 (one classifier) on 2 slots (a
    unit's share 3,755): the wide node in 3 runs of its 80 classifiers, the others whole (a lone
    classifier is never cut); every classifier in exactly one unit, within its node, and the
    units by falling work."""
    node_ptr = np.array([0, 2, 82, 84, 85])
    n_rows = np.array([1000, 100, 10, 5000])
    units = streamed_nodes.work_units(n_rows, node_ptr, 2)
    covered = np.concatenate([np.arange(lo, hi) for _, lo, hi in units])
    np.testing.assert_array_equal(np.sort(covered), np.arange(85))
    for g, lo, hi in units:
        assert node_ptr[g] <= lo < hi <= node_ptr[g + 1]
    assert sorted(hi - lo for g, lo, hi in units if g == 1) == [26, 27, 27]
    assert [(g, lo, hi) for g, lo, hi in units if g != 1] == [(3, 84, 85), (0, 0, 2), (2, 82, 84)]
    work = n_rows[units[:, 0]] * (units[:, 2] - units[:, 1])
    assert np.all(np.diff(work) <= 0)
    # one slot: share 7,510, so the wide node is cut in two
    assert sum(1 for g, _, _ in streamed_nodes.work_units(n_rows, node_ptr, 1) if g == 1) == 2
