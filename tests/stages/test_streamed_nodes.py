"""Big nodes trained one task each over rows streamed from block files: the streamed dual CD
against the kernel's optimum, the block files against the rows written, and the files' removal
after a failure. The stage's weights against the kernel's optimum and the bibtex CLI run are in
test_node_training.py, beside the distributed solver's."""
import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

from xmc_spark.arrow_utils import list_array
from xmc_spark.compat import session_settings
from xmc_spark.kernels import tron
from xmc_spark.kernels.sparse import append_bias
from xmc_spark.kernels.squared_hinge import train_node
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


def only(rows: tron.RowBlock, g: int) -> tron.RowBlock:
    r = np.flatnonzero(rows.node == g)
    return tron.RowBlock(rows.X[r], rows.node[r], rows.cost[r], rows.pos[r])


def write_node_files(rows: tron.RowBlock, g: int, size: int, folder, C: float = 1.0, pieces: int = 1):
    """Node g's rows packed as the stage packs them (node_training._pack_rows, blocks of ``size``
    rows, cost = C x weight) and written one block file each, without Spark: (fs, paths, unpack).
    ``pieces``: the rows cut in that many parts packed on their own, as write tasks would (each
    leaves a short last block)."""
    mine = only(rows, g)
    X, P = mine.X[:, :-1].tocsr(), mine.pos
    bias = float(mine.X[0, -1])
    table = pa.Table.from_pydict({
        "node": pa.array(np.full(X.shape[0], g, np.int32)),
        "feature_idx": list_array(X.indptr, X.indices.astype(np.int32), pa.int32()),
        "feature_val": list_array(X.indptr, X.data.astype(np.float32), pa.float32()),
        "weight": pa.array((mine.cost / C).astype(np.float32)),
        "pos": list_array(P.indptr, P.indices.astype(np.int32), pa.int32()),
        "pos_w": list_array(P.indptr, P.data.astype(np.float32), pa.float32())})
    pack = node_training._pack_rows(X.shape[1], P.shape[1], bias, C, max_rows=size)
    folder.mkdir(parents=True, exist_ok=True)
    cuts = np.linspace(0, table.num_rows, pieces + 1).astype(int)
    for part, (a, e) in enumerate(zip(cuts[:-1], cuts[1:])):
        for seq, b in enumerate(pack(iter(table.slice(a, e - a).to_batches(max_chunksize=25)))):
            name = f"p{part}-{seq:06d}-{b.column('rows')[0].as_py()}.arrow"
            with pa.OSFile(str(folder / name), "wb") as f, pa.ipc.new_file(f, b.schema) as w:
                w.write_batch(b)
    fs, root = client_fs(str(folder))
    return fs, streamed_nodes.block_files(fs, root), lambda b: node_training._unpack(b, X.shape[1] + 1, P.shape[1])


def optimum(rows: tron.RowBlock, lo: int, hi: int):
    """(the objective over the node's rows as a function of W, the optimum's W, its objective) of
    classifiers lo..hi-1: the dual kernel at eps 1e-9 on the rows in memory."""
    Y = rows.pos[:, lo:hi]
    keep = rows.cost > 0
    opt = train_node(rows.X[keep], Y[keep], C=1.0, weights=rows.cost[keep], threshold=0, eps=1e-9,
                     max_iter=1000000).toarray()
    fun_grad, _ = tron.local_oracle(tron.RowBlock(rows.X, np.zeros(len(rows.cost), np.int64), rows.cost,
                                                  sp.csr_matrix(Y)), [0, hi - lo])
    f = lambda W: fun_grad(W, np.arange(hi - lo))[0]           # noqa: E731
    return f, opt, f(opt)


@pytest.mark.parametrize("g,lo,hi,mix,pieces", [(0, 0, 3, 2, 1), (1, 3, 5, 2, 1), (0, 1, 3, 3, 1), (0, 0, 3, 1, 1),
                                                (0, 0, 3, 2, 5)])
def test_a_streamed_node_reaches_the_kernels_optimum(tmp_path, g, lo, hi, mix, pieces):
    """dcd_node over a node's rows in blocks of 16 (several files; with ``pieces`` 5, as five write
    tasks leave them, with short blocks), on its classifiers or a run of
    them, with sample and label weights: every classifier meets the dual CD's test at eps 0.1
    within max_iter and ends within a relative objective gap of 1e-3 of the optimum, with its
    signs where the optimum's weight is over 0.05; the same seed gives the same weights, bit for
    bit, and the task's dual state is one file a block under its own folder. ``mix`` 1 (a block
    at a time) is allowed; on this small problem it converges too."""
    rows = mixed_rows(n=300, seed=1)
    d = rows.X.shape[1]
    mine = only(rows, g)
    fs, paths, unpack = write_node_files(rows, g, 16, tmp_path / "blocks", pieces=pieces)
    assert len(paths) >= 4 and (pieces == 1 or sum(streamed_nodes.block_rows(p) < 16 for p in paths) == pieces)
    params = TrainParams()
    W, info = streamed_nodes.dcd_node(fs, paths, unpack, lo, hi, d, params, 7, str(tmp_path / "state"), mix=mix)
    assert W.shape == (d, hi - lo) and info.converged.all() and np.all(info.passes < params.max_iter)
    f, opt, f_opt = optimum(mine, lo, hi)
    assert np.all((f(W) - f_opt) / f_opt <= 1e-3), (f(W) - f_opt) / f_opt
    sure = np.abs(opt) > 0.05
    np.testing.assert_array_equal(np.sign(W[sure]), np.sign(opt[sure]))
    again, _ = streamed_nodes.dcd_node(fs, paths, unpack, lo, hi, d, params, 7, str(tmp_path / "state2"), mix=mix)
    np.testing.assert_array_equal(again, W)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [f"{i:06d}.state" for i in range(len(paths))]


def test_a_tight_tolerance_reaches_the_optimum(tmp_path):
    """At eps 1e-6 (many passes, rows shrunk and brought back more than once) the streamed dual CD
    ends within a relative objective gap of 1e-6 of the optimum (4e-8 here; 1e-4 to 1e-3 at the
    default 0.1): the shrinking over the block pairs stops at the optimum, not where a wrongly
    shrunk row left it."""
    rows = mixed_rows(n=300, seed=3)
    d = rows.X.shape[1]
    fs, paths, unpack = write_node_files(rows, 0, 16, tmp_path / "blocks")
    params = TrainParams(eps=1e-6, max_iter=100000)
    W, info = streamed_nodes.dcd_node(fs, paths, unpack, 0, 3, d, params, 0, str(tmp_path / "state"))
    f, _, f_opt = optimum(only(rows, 0), 0, 3)
    assert info.converged.all() and np.all(info.passes > 20)
    assert np.all(np.abs(f(W) - f_opt) / f_opt <= 1e-6), (f(W) - f_opt) / f_opt


def test_rows_of_zero_cost_are_left_out(tmp_path):
    """Rows whose sample weight is 0 (cost 0) leave the optimum as the kernel's, which drops them;
    a node whose rows all cost 0 trains to w = 0."""
    rows = mixed_rows(n=300, seed=6)
    rows.cost[::3] = 0.0
    d = rows.X.shape[1]
    fs, paths, unpack = write_node_files(rows, 0, 16, tmp_path / "blocks")
    W, info = streamed_nodes.dcd_node(fs, paths, unpack, 0, 3, d, TrainParams(), 0, str(tmp_path / "state"))
    f, opt, f_opt = optimum(only(rows, 0), 0, 3)
    assert info.converged.all() and np.all((f(W) - f_opt) / f_opt <= 1e-3)
    rows.cost[:] = 0.0
    fs, paths, unpack = write_node_files(rows, 1, 16, tmp_path / "zero")
    W, info = streamed_nodes.dcd_node(fs, paths, unpack, 3, 5, d, TrainParams(), 0, str(tmp_path / "state0"))
    assert info.converged.all() and not W.any()


def big_frame(spark, rows: tron.RowBlock, d: int):
    """The rows as the big nodes' DataFrame (node_training.BIG_SCHEMA), features without the bias."""
    X = rows.X[:, :d].tocsr()
    data = [(int(rows.node[i]), X.indices[X.indptr[i]:X.indptr[i + 1]].tolist(),
             X.data[X.indptr[i]:X.indptr[i + 1]].tolist(), float(rows.cost[i]),
             rows.pos.indices[rows.pos.indptr[i]:rows.pos.indptr[i + 1]].tolist(),
             rows.pos.data[rows.pos.indptr[i]:rows.pos.indptr[i + 1]].tolist()) for i in range(X.shape[0])]
    return spark.createDataFrame(data, node_training.BIG_SCHEMA)


def node_blocks(fs, root: str, written: pa.Table, g: int, d: int) -> list:
    """The blocks of node g in the folders ``written`` reports for it, read back."""
    folders = [f for n, f in zip(written.column("node").to_pylist(), written.column("folder").to_pylist()) if n == g]
    return [streamed_nodes.read_block(fs, p, lambda b: node_training._unpack(b, d + 1, 5))
            for f in folders for p in streamed_nodes.block_files(fs, f"{root}/{f}")]


def test_the_block_files_hold_the_rows(spark, tmp_path, monkeypatch):
    """write_blocks over 3 partitions whose rows come in no order of their nodes (blocks of at most
    7 rows), its counts collected from the write tasks: per node the rows and block counts it
    reports, one folder a node and write task, and
    read_block reads back exactly the node's rows (bias appended, cost = C x weight, positives
    with their label weights), one file a block named with its rows; a node without rows has no
    folder."""
    rows = mixed_rows(n=60, seed=2)
    d = rows.X.shape[1] - 1
    df = big_frame(spark, rows, d).repartition(3)
    pack = node_training._pack_rows(d, 5, 0.5, 2.0, max_rows=7)
    uri = str(tmp_path / "blocks")
    tasks, real = [], streamed_nodes.to_arrow
    monkeypatch.setattr(streamed_nodes, "to_arrow", lambda df: tasks.append(df.rdd.getNumPartitions()) or real(df))
    with session_settings(spark, {"spark.sql.shuffle.partitions": "64",
                                  "spark.sql.adaptive.coalescePartitions.enabled": "false"}, "a test"):
        written = streamed_nodes.write_blocks(df.localCheckpoint(), pack, uri)
    assert tasks == [3]             # collected from the 3 write tasks: no shuffle, not 64 reduce tasks (their metrics)
    counts = np.bincount(rows.node, minlength=2)
    nodes = written.column("node").to_numpy()
    assert sorted(set(nodes.tolist())) == [0, 1] and len(written) == len(set(written.column("folder").to_pylist()))
    assert np.bincount(nodes, weights=written.column("rows").to_numpy()).tolist() == counts.tolist()
    assert all(f.startswith(f"n{g}/p") for g, f in zip(nodes, written.column("folder").to_pylist()))
    fs, root = client_fs(uri)
    for g in (0, 1):
        got = node_blocks(fs, root, written, g, d)
        assert len(got) == written.column("blocks").to_numpy()[nodes == g].sum() >= counts[g] / 7
        assert all(b.X.shape[0] <= 7 and (b.node == g).all() for b in got)
        names = [p for f in written.column("folder").to_pylist() if f.startswith(f"n{g}/")
                 for p in streamed_nodes.block_files(fs, f"{root}/{f}")]
        assert [streamed_nodes.block_rows(p) for p in names] == [b.X.shape[0] for b in got]
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
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == ["n0", "n1"]


def test_packing_holds_back_a_bounded_number_of_rows():
    """_pack_rows over batches of rows of 40 nodes in no order (and an empty batch): every row lands
    in exactly one block of its node, with its features, each node's rows in input order; no
    block over max_rows; the rows read but not yet packed stay within PENDING_BLOCKS blocks and a
    batch (so some blocks are packed short). Rows sorted by node: blocks of exactly max_rows, each
    node's last aside, and ``ordered`` packs that last block before the next node's, so the blocks
    come in runs of one node (the distributed solver's partitions), the same blocks."""
    rng = np.random.default_rng(0)
    n, d, size, chunk, nodes = 2000, 6, 8, 37, 40
    X = sp.random(n, d, density=0.5, random_state=1, format="csr", dtype=np.float32)
    empty = list_array(np.zeros(n + 1, np.int64), np.zeros(0, np.int32), pa.int32())

    def blocks(node, ordered=False):
        pack = node_training._pack_rows(d, 1, 1.0, 1.0, max_rows=size, ordered=ordered)
        t = pa.Table.from_pydict({
            "node": pa.array(node.astype(np.int32)),
            "feature_idx": list_array(X.indptr, X.indices.astype(np.int32), pa.int32()),
            "feature_val": list_array(X.indptr, X.data.astype(np.float32), pa.float32()),
            "weight": pa.array(np.arange(n, dtype=np.float32) + 1.0),          # a row's id + 1, as its weight
            "pos": empty, "pos_w": empty.cast(pa.list_(pa.float32()))})
        batches = t.to_batches(max_chunksize=chunk)
        batches.insert(2, pa.RecordBatch.from_pylist([], schema=t.schema))
        read = [0]

        def counted():
            for b in batches:
                read[0] += b.num_rows
                yield b
        out, packed = [], 0
        for b in pack(counted()):
            blk = next(node_training._unpack(b, d + 1, 1))
            packed += blk.X.shape[0]
            assert read[0] - packed <= node_training.PENDING_BLOCKS * size + chunk
            out.append((int(b.column("node")[0].as_py()), blk))
        return out

    def check(node, got):
        for g in range(nodes):
            mine = [blk for h, blk in got if h == g]
            ids = np.concatenate([blk.cost for blk in mine]).astype(np.int64) - 1
            np.testing.assert_array_equal(ids, np.flatnonzero(node == g))
            np.testing.assert_array_equal(sp.vstack([blk.X for blk in mine])[:, :d].toarray(), X[ids].toarray())
        assert max(blk.X.shape[0] for _, blk in got) <= size

    node = rng.integers(0, nodes, n)
    got = blocks(node)
    check(node, got)
    assert sum(blk.X.shape[0] < size for _, blk in got) > 2 * nodes      # more short blocks than a node's last
    srt = np.sort(node)
    for ordered in (False, True):
        got = blocks(srt, ordered)
        check(srt, got)
        for g in range(nodes):
            lens = [blk.X.shape[0] for h, blk in got if h == g]
            assert lens[:-1] == [size] * (len(lens) - 1) and 0 < lens[-1] <= size
        runs = [h for h, _ in got]
        assert (runs == sorted(runs)) == ordered


@pytest.mark.parametrize("where", ["writing", "training"])
def test_a_failed_run_leaves_no_files(spark, tmp_path, where):
    """A task failing while the blocks are written, or while a node trains over them: the error
    reaches the caller and the run's block folder is gone."""
    rows = mixed_rows(n=30, seed=4)
    d = rows.X.shape[1] - 1
    df = big_frame(spark, rows, d).repartition(2)
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
    """A second write of the same partitions (as a retried or speculative attempt makes them) writes
    the same blocks, byte for byte, in folders of its own (named by its task attempts), and reports
    the same counts; the folders a result names hold its own attempts' blocks only, so a reader
    of one result never sees a row twice."""
    rows = mixed_rows(n=50, seed=5)
    d = rows.X.shape[1] - 1
    df = big_frame(spark, rows, d).repartition(3).localCheckpoint()
    pack = node_training._pack_rows(d, 5, 0.5, 1.0, max_rows=6)
    uri = str(tmp_path / "blocks")
    fs, root = client_fs(uri)

    def files(written):
        out = {}
        for f in sorted(written.column("folder").to_pylist()):
            node, part = f.split("/")
            for p in streamed_nodes.block_files(fs, f"{root}/{f}"):
                out[(node, part.split("-t")[0], p.rsplit("/", 1)[1])] = open(p, "rb").read()
        return out
    first = streamed_nodes.write_blocks(df, pack, uri)
    before = files(first)
    again = streamed_nodes.write_blocks(df, pack, uri)
    assert set(again.column("folder").to_pylist()).isdisjoint(first.column("folder").to_pylist())
    assert again.drop(["folder"]).sort_by([("node", "ascending"), ("rows", "ascending")]).equals(
        first.drop(["folder"]).sort_by([("node", "ascending"), ("rows", "ascending")]))
    assert files(again) == before and len(before) == sum(first.column("blocks").to_pylist())
    assert sum(b.X.shape[0] for g in (0, 1) for b in node_blocks(fs, root, again, g, d)) == 50
    assert not [p for p in (tmp_path / "blocks").rglob("*") if p.is_file() and p.suffix != ".arrow"]


def test_mix_groups_take_blocks_by_rows():
    """Blocks of equal size go ``mix`` a group (the last group may hold fewer); short blocks join
    until a group holds more than ``mix`` - 1 of the largest; every block in exactly one group, in
    the order given; a file name gives its block's rows."""
    order = np.array([4, 0, 3, 1, 2])
    assert [g.tolist() for g in streamed_nodes.mix_groups(order, np.full(5, 16), 2)] == [[4, 0], [3, 1], [2]]
    assert [g.tolist() for g in streamed_nodes.mix_groups(order, np.full(5, 16), 1)] == [[4], [0], [3], [1], [2]]
    rows = np.array([16, 3, 5, 16, 2])
    assert [g.tolist() for g in streamed_nodes.mix_groups(order, rows, 2)] == [[4, 0], [3, 1], [2]]
    assert [g.tolist() for g in streamed_nodes.mix_groups(np.array([1, 2, 4, 0, 3]), rows, 2)] == [[1, 2, 4, 0],
                                                                                                 [3]]
    assert [g.tolist() for g in streamed_nodes.mix_groups(order, rows, 3)] == [[4, 0, 3], [1, 2]]
    assert streamed_nodes.mix_groups(np.zeros(0, np.int64), np.zeros(0), 2) == []
    assert streamed_nodes.block_rows("/x/n3/p00001-t7/000002-32768.arrow") == 32768
    with pytest.raises(ValueError, match="not a block file name"):
        streamed_nodes.block_rows("/x/n3/000002.arrow")


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
