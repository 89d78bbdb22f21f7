"""Big tree nodes split across tasks (tree.max_split_labels) take the kernel's balanced k-means
steps: the same children as balanced_split, the same trees as the tree kernel, and the bound's
resolution."""
import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

from xmc_spark.arrow_utils import csr_batches, local_frame
from xmc_spark.kernels.balanced_kmeans import balanced_split
from xmc_spark.kernels.tree import build_tree, split_seed
from xmc_spark.params import TreeParams
from xmc_spark.stages import label_tree, split_across
from xmc_spark.stages.label_embedding import PACKED_ARROW

M, DIM = 300, 40


@pytest.fixture(scope="module")
def Z():
    return Z_fixture()


def Z_fixture():
    """Label embeddings (PIFA-like: non-negative, unit rows) of M labels, some without a row."""
    Z = sp.random(M, DIM, density=0.2, random_state=3, format="csr", dtype=np.float32)
    Z = sp.csr_matrix(Z.multiply(1 / np.maximum(1e-12, sp.linalg.norm(Z, axis=1))[:, None]), dtype=np.float32)
    Z = sp.csr_matrix(Z.multiply((np.arange(M) % 37 != 5)[:, None]), dtype=np.float32)   # labels without
    Z.eliminate_zeros()                                                                # a sample: empty rows
    return Z


def packed_frame(spark, Z, labels=None, partitions=3):
    """The packed (label_idx, emb_idx, emb_val) rows of Z's non-empty rows (the tree stage's input)."""
    labels = np.arange(Z.shape[0]) if labels is None else labels
    keep = np.flatnonzero(np.diff(Z.indptr) > 0)
    sub = Z[keep]
    t = pa.Table.from_batches(csr_batches({"label_idx": pa.array(labels[keep].astype(np.int32))}, sub, 1 << 20),
                              PACKED_ARROW)
    return local_frame(spark, t).repartition(partitions)


def every_label(spark, Z):
    return label_tree._every_label(packed_frame(spark, Z), Z.shape[0])


@pytest.fixture
def across(monkeypatch):
    """The levels of each split_across call the tree made (a test of the tree's path fails if
    the big nodes were split in their tasks after all)."""
    calls, real = [], split_across.split_across

    def recorded(*a, **k):
        calls.append(k.get("levels"))
        return real(*a, **k)

    monkeypatch.setattr(split_across, "split_across", recorded)
    return calls


SOLVERS = ["distributed", "streamed"]


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("B,node", [(2, 0), (3, 0), (2, 5), (16, 1)])
def test_a_node_split_across_tasks_is_the_kernels_split(spark, Z, B, node, solver):
    """One node's labels split across tasks: the children of balanced_split with the node's seed."""
    params = TreeParams(nr_splits=B, seed=7, max_leaf_size=10, big_split_solver=solver)
    labels = np.arange(0, M, 2)                       # the node's labels: every other one
    got = split_across.split_across(every_label(spark, Z), labels, np.zeros(len(labels)),
                                    np.full(len(labels), node), params, DIM, levels=1)
    want = node * B + 1 + balanced_split(Z[labels], B, params.max_iter, split_seed(params.seed, node))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("solver", SOLVERS)
def test_nodes_of_several_trees_split_in_the_same_rounds(spark, Z, monkeypatch, solver):
    """Groups of two trees (their own seeds and branchings) in one round, and in rounds of one
    group (the centroids' budget below one node's; streamed: one round whatever it is): each the
    kernel's split."""
    params = TreeParams(max_leaf_size=10, seed=1, ensemble_splits=[2, 4], max_iter=6, big_split_solver=solver)
    labels = np.concatenate([np.arange(M), np.arange(M)])
    trees = np.repeat([0, 1], M)
    nodes = np.where(np.arange(2 * M) % 2 == 0, 1, 2)      # per tree two nodes: odd and even labels
    want = np.empty(2 * M, np.int64)
    for t in (0, 1):
        tp = params.for_tree(t)
        for n in (1, 2):
            sel = (trees == t) & (nodes == n)
            want[sel] = n * tp.nr_splits + 1 + balanced_split(Z[labels[sel]], tp.nr_splits, tp.max_iter,
                                                              split_seed(tp.seed, n))
    emb = every_label(spark, Z)
    np.testing.assert_array_equal(split_across.split_across(emb, labels, trees, nodes, params, DIM, levels=1), want)
    monkeypatch.setattr(split_across, "CENTROID_MB", 1e-6)
    np.testing.assert_array_equal(split_across.split_across(emb, labels, trees, nodes, params, DIM, levels=1), want)


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("local", [0, 4096])
@pytest.mark.parametrize("B", [2, 3])
def test_a_tree_with_big_levels_is_the_kernels_tree(spark, Z, local, B, across, solver):
    """The balanced tree with its levels over the bound split across tasks, the rest chained:
    the kernel's tree (the labels without a row placed as empty rows)."""
    params = TreeParams(max_leaf_size=12, nr_splits=B, seed=2, local_subtree_size=local, max_iter=6,
                        big_split_solver=solver)
    assert split_across.big_depths(M, B, 60, 12) == (3 if B == 2 else 2)
    tree = label_tree.run(packed_frame(spark, Z), params, n_features=DIM, n_labels=M, split_bound=60)
    assert across == [3 if B == 2 else 2]
    got = {r["label_idx"]: r["node"] for r in tree.collect()}
    want = build_tree(Z, 12, B, params.max_iter, 2)
    assert [got[k] for k in range(M)] == want.tolist()


def test_the_rows_of_every_label_take_the_splits_task_count_not_the_shuffle_partitions(spark, Z, monkeypatch):
    """Every pass over the labels' rows is a job of as many tasks as they have partitions, each
    task reporting its metrics to the driver: the split's own task count, whatever
    spark.sql.shuffle.partitions is (no broadcast: the tiny test's join would be one, whose
    rows keep the label range's partitions)."""
    from xmc_spark.compat import session_settings
    from xmc_spark.stages.shared_vectors import solver_tasks
    seen, real = [], split_across.split_across

    def recorded(emb, *a, **k):
        seen.append(emb.rdd.getNumPartitions())
        return real(emb, *a, **k)

    monkeypatch.setattr(split_across, "split_across", recorded)
    with session_settings(spark, {"spark.sql.shuffle.partitions": "64", "spark.sql.autoBroadcastJoinThreshold": "-1",
                                  "spark.sql.adaptive.coalescePartitions.enabled": "false"}, "a test"):
        label_tree.run(packed_frame(spark, Z), TreeParams(max_leaf_size=12, max_iter=3), n_features=DIM,
                       n_labels=M, split_bound=100).count()
    assert seen == [solver_tasks(spark)] and solver_tasks(spark) < 64


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("ensemble", [dict(ensemble_splits=[2, 3]), dict(ensemble=2)])
def test_ensemble_trees_split_their_big_nodes_across_tasks(spark, Z, ensemble, across, solver):
    """Trees of different branchings (level by level) or of one (chained): each tree's big nodes
    split across tasks, every tree the kernel's."""
    params = TreeParams(max_leaf_size=12, seed=4, max_iter=6, big_split_solver=solver, **ensemble)
    tree = label_tree.run(packed_frame(spark, Z), params, n_features=DIM, n_labels=M, split_bound=50)
    # chained: the levels of 300, 150 and 75 labels at once; level by level: one call a level over the bound
    assert across == ([3] if "ensemble" in ensemble else [1, 1, 1])
    for t in (0, 1):
        tp = params.for_tree(t)
        got = {r["label_idx"]: r["node"] for r in tree.filter(f"tree = {t}").collect()}
        want = build_tree(Z, 12, tp.nr_splits, tp.max_iter, tp.seed)
        assert [got[k] for k in range(M)] == want.tolist(), t


@pytest.mark.parametrize("solver", SOLVERS)
def test_interpolated_splits_stay_in_their_task_and_balanced_ones_go_across(spark, Z, caplog, across, solver):
    """lambda > 0: the interpolated splits (above balanced_below_depth) run in one task each,
    with a warning when over the bound; the balanced ones below go across tasks; the tree is the
    kernel's."""
    from xmc_spark.kernels import frequencies as FQ
    Y = sp.random(500, M, density=0.02, random_state=1, format="csr")
    f, ft = FQ.label_frequencies(Y.indptr, Y.indices, M, "marginal")
    params = TreeParams(max_leaf_size=12, seed=3, lam=0.5, balanced_below_depth=1, max_iter=6,
                        big_split_solver=solver)
    with caplog.at_level("WARNING", logger="xmc_spark.tree"):
        tree = label_tree.run(packed_frame(spark, Z), params, n_features=DIM, n_labels=M, f=f, f_tilde=ft,
                              split_bound=60)
    assert "the interpolated split (lambda > 0) is not distributed" in caplog.text
    assert across and set(across) == {1}         # the balanced levels below the root
    got = {r["label_idx"]: r["node"] for r in tree.collect()}
    want = build_tree(Z, 12, 2, params.max_iter, 3, 0.5, f, ft, params.gamma, 1)
    assert [got[k] for k in range(M)] == want.tolist()


def test_the_split_leaves_nothing_persisted_or_written(spark, Z, monkeypatch, tmp_path):
    """The rounds' rows are released and their scratch folders deleted, also when a step fails."""
    from pyspark import StorageLevel
    emb, labels = every_label(spark, Z), np.arange(M)
    params = TreeParams(max_leaf_size=10, max_iter=3, big_split_solver="distributed")
    frames, persist = [], type(emb).persist

    def recorded_persist(self, *a, **k):
        frames.append(self)
        return persist(self, *a, **k)

    monkeypatch.setattr(type(emb), "persist", recorded_persist)
    seen, assign = [], split_across._assign

    def inspected(rows, files, step, active, caps, latest, par):
        """Before each step: the round's folder holds this step's sums and each group's last
        assignment, nothing older."""
        base = tmp_path / files.base.rsplit("/", 1)[-1]
        assert sorted(p.name for p in base.iterdir() if p.name.startswith("c")) == [f"c{step}"]
        kept = [p for p in base.rglob("*") if p.is_file() and p.parent.name.startswith("a")]
        assert len(kept) == int((latest >= 0).sum())
        seen.append(step)
        return assign(rows, files, step, active, caps, latest, par)

    monkeypatch.setattr(split_across, "_assign", inspected)
    split_across.split_across(emb, labels, np.zeros(M), np.zeros(M), params, DIM, levels=2, scratch=str(tmp_path))
    assert len(frames) == 2 and all(f.storageLevel == StorageLevel.NONE for f in frames)    # a round a level
    assert list(tmp_path.iterdir()) == [] and max(seen) == 2 and seen.count(0) == 2
    monkeypatch.setattr(split_across, "_assign", assign)
    frames.clear()
    steps, sums = [], split_across._sums

    def failing(*a, **k):
        steps.append(1)
        if len(steps) == 2:
            assert [p.name[:6] for p in tmp_path.iterdir()] == ["split-"]      # the round's folder, in use
            raise RuntimeError("step failed")
        return sums(*a, **k)

    monkeypatch.setattr(split_across, "_sums", failing)
    with pytest.raises(RuntimeError, match="step failed"):
        split_across.split_across(emb, labels, np.zeros(M), np.zeros(M), params, DIM, levels=1,
                                  scratch=str(tmp_path))
    assert len(frames) == 1 and frames[0].storageLevel == StorageLevel.NONE
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("B", [2, 3])
def test_centroid_sums_in_many_blocks_give_the_kernels_split(spark, Z, monkeypatch, B):
    """Sums cut into blocks of 7 doubles (blocks over two children and over two nodes, the second
    node's sums starting inside a block, a short last one, blocks of features no label has: never
    written, read as zero) give the kernel's splits."""
    monkeypatch.setattr(split_across, "BLOCK", 7)
    params = TreeParams(max_leaf_size=10, nr_splits=B, big_split_solver="distributed")
    nodes = np.where(np.arange(M) % 2 == 0, 1, 2)
    got = split_across.split_across(every_label(spark, Z), np.arange(M), np.zeros(M), nodes, params, DIM + 31,
                                    levels=1)
    for node in (1, 2):
        mine = np.flatnonzero(nodes == node)
        np.testing.assert_array_equal(got[mine], node * B + 1 + balanced_split(
            Z[mine], B, params.max_iter, split_seed(params.seed, node)))


def test_a_cluster_session_without_a_scratch_folder_is_refused(spark, Z, monkeypatch):
    from xmc_spark.params import ConfigError
    monkeypatch.setattr(split_across, "scratch_root", lambda spark, scratch: None)
    with pytest.raises(ConfigError, match="no scratch folder"):
        split_across.split_across(every_label(spark, Z), np.arange(M), np.zeros(M), np.zeros(M),
                                  TreeParams(max_leaf_size=10), DIM, levels=1)


@pytest.mark.parametrize("B", [2, 3])
def test_the_driver_receives_a_row_per_node_and_step_not_a_score_per_label(spark, Z, monkeypatch, B):
    """The steps' seeds, scores, assignments and centroid sums stay with the tasks and their
    files: the driver collects one row per node of each step's assignment and one per block of
    each step's sums (here one node, one block), never a row per label."""
    collected, real = [], split_across.to_arrow

    def recorded(df):
        t = real(df)
        collected.append(t.num_rows)
        return t

    monkeypatch.setattr(split_across, "to_arrow", recorded)
    params = TreeParams(max_leaf_size=10, nr_splits=B, big_split_solver="distributed")
    got = split_across.split_across(every_label(spark, Z), np.arange(M), np.zeros(M), np.zeros(M), params, DIM,
                                    levels=1)
    np.testing.assert_array_equal(got, 1 + balanced_split(Z, B, params.max_iter, split_seed(params.seed, 0)))
    assert len(collected) >= 3 and max(collected) == 1


def test_a_streamed_split_sends_the_driver_a_row_per_group_and_write_task_and_leaves_nothing(
        spark, Z, monkeypatch, tmp_path):
    """Streamed (a task a group): the driver collects one row per (write task, group) and one per
    group, never a row per label, and the round's folder (block files, assignments) is deleted,
    also when the round fails after the write; the rows' partitions are the split's task count."""
    from xmc_spark.stages import streamed_nodes
    from xmc_spark.stages.shared_vectors import solver_tasks
    collected, real = [], split_across.to_arrow

    def recorded(df):
        t = real(df)
        collected.append(t.num_rows)
        return t

    written, write = [], streamed_nodes.write_blocks

    def recorded_write(rows, pack, uri, kind):
        t = write(rows, pack, uri, kind)
        written.append((rows.rdd.getNumPartitions(), t.num_rows, sorted(set(t.column("node").to_pylist()))))
        # what each group's task will read: its folders in partition order, each folder's files in
        # name order, the positions rising throughout (the float32 sums' order: the kernel's)
        import pyarrow.fs as pafs
        fs, base = streamed_nodes.client_fs(uri)
        for g in (0, 1):
            folders = sorted(f for n, f in zip(t.column("node").to_pylist(), t.column("folder").to_pylist()) if n == g)
            paths = [p for f in folders for p in streamed_nodes.block_files(fs, f"{base}/{f}")]
            pos = np.concatenate([pa.ipc.open_file(fs.open_input_file(p)).read_all().column("pos").to_numpy()
                                  for p in paths])
            assert len(paths) > 10 and np.all(np.diff(pos) == 1), (g, len(paths))
        assert isinstance(fs, pafs.LocalFileSystem)
        return t

    monkeypatch.setattr(split_across, "to_arrow", recorded)
    monkeypatch.setattr(split_across, "write_blocks", recorded_write)
    params = TreeParams(max_leaf_size=10, nr_splits=3, big_split_solver="streamed", max_iter=4)
    nodes = np.where(np.arange(M) % 2 == 0, 1, 2)
    monkeypatch.setattr(split_across, "SPLIT_BLOCK_NNZ", 20)     # blocks of 2-3 rows: many files a folder
    got = split_across.split_across(every_label(spark, Z), np.arange(M), np.zeros(M), nodes, params, DIM,
                                    levels=1, scratch=str(tmp_path))
    for node in (1, 2):
        mine = np.flatnonzero(nodes == node)
        np.testing.assert_array_equal(got[mine], node * 3 + 1 + balanced_split(
            Z[mine], 3, params.max_iter, split_seed(params.seed, node)))
    parts = solver_tasks(spark)
    assert written == [(parts, written[0][1], [0, 1])] and written[0][1] <= parts + 1
    assert collected == [2]                          # the split job: a row a group
    assert list(tmp_path.iterdir()) == []

    def failing(df):
        assert [p.name[:6] for p in tmp_path.iterdir()] == ["split-"]      # the round's folder, in use
        assert any(p.suffix == ".arrow" for p in tmp_path.rglob("*"))
        assert [p.name for p in tmp_path.glob("split-*/local")] == ["local"]   # the tasks' copies go there
        raise RuntimeError("split failed")

    monkeypatch.setattr(split_across, "to_arrow", failing)
    with pytest.raises(RuntimeError, match="split failed"):
        split_across.split_across(every_label(spark, Z), np.arange(M), np.zeros(M), nodes, params, DIM,
                                  levels=1, scratch=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_splits_are_streamed_where_big_nodes_are(spark, tmp_path):
    """tree.big_split_solver resolves as train.big_node_solver: auto is streamed in local mode with
    a scratch folder on local disk; the setting wins; without a scratch folder (a cluster
    session), never streamed."""
    from xmc_spark.params import ConfigError
    assert split_across.streams_splits(spark, TreeParams(), str(tmp_path))
    assert split_across.streams_splits(spark, TreeParams(big_split_solver="streamed"), str(tmp_path))
    assert not split_across.streams_splits(spark, TreeParams(big_split_solver="distributed"), str(tmp_path))
    assert not split_across.streams_splits(spark, TreeParams(), "s3://bucket/run/_scratch")
    with pytest.raises(ConfigError, match="big_split_solver"):
        TreeParams(big_split_solver="fast").validate()


@pytest.mark.parametrize("T,connect,top", [(1, False, M + 3), (1, False, M // 2), (3, False, M + 3),
                                           (3, True, M + 3)])
def test_placed_rows_are_the_join_of_the_rows_with_their_entries(spark, Z, monkeypatch, T, connect, top):
    """Each entry (label, tree) gets its label's row and its own columns, a label of no entry
    none (also one above every entry's label: ``top`` M // 2), an entry of a label without a row
    none (labels M..M+2), no entries no rows (brute force); on classic Spark no broadcast join
    (whose table would travel through the driver), on Spark Connect the join (``is_connect``
    forced: the classic session takes that path too)."""
    monkeypatch.setattr(split_across, "is_connect", lambda df: connect)
    rng = np.random.default_rng(4)
    pairs = np.array([(lab, t) for t in range(T) for lab in range(top)], np.int64)
    pairs = pairs[rng.random(len(pairs)) < 0.6]
    if T > 1:
        pairs = pairs[(pairs[:, 1] != 1) & ((pairs[:, 1] == T - 1) | (rng.random(len(pairs)) < 0.7))]  # no tree 1
    pairs = pairs[rng.permutation(len(pairs))]
    node, part = rng.integers(0, 2 ** 40, len(pairs)), rng.integers(0, 9, len(pairs))
    emb = every_label(spark, Z)
    rows, shared = split_across.placed_rows(emb, pairs[:, 0], pairs[:, 1], {"node": (node, "long"),
                                                                            "part": (part, "int")}, "test")
    assert rows.dtypes == [("label_idx", "int"), ("emb_idx", "binary"), ("emb_val", "binary"), ("tree", "int"),
                           ("node", "bigint"), ("part", "int")]
    got, every = rows.toPandas(), emb.toPandas()

    def broadcasts(df):
        return df._jdf.queryExecution().executedPlan().toString().count("BroadcastExchange")

    if not connect:
        assert broadcasts(rows) == broadcasts(emb)       # the rows' own (the tiny test's join) and no more
        shared.unpersist()
    else:
        assert shared is None
    want = {(int(lab), int(t)): (int(n), int(p)) for (lab, t), n, p in zip(pairs, node, part) if lab < M}
    assert len(got) == len(want)
    assert {(int(r.label_idx), int(r.tree)): (int(r.node), int(r.part)) for r in got.itertuples()} == want
    row = dict(zip(every.label_idx, every.emb_idx))
    assert all(bytes(r.emb_idx) == bytes(row[r.label_idx]) for r in got.itertuples())
    none, shared = split_across.placed_rows(emb, [], [], {"node": (np.zeros(0), "long")}, "test")
    assert none.count() == 0
    if shared is not None:
        shared.unpersist()


def test_the_bound_is_the_setting_or_derived_from_memory(spark):
    """An integer or off is taken as is; auto shares a task's memory among labels of
    min(features, count x mean row non-zeros) non-zeros of 40 bytes, + 256 bytes a label."""
    from xmc_spark.stages.node_training import row_bound_for, session_conf
    assert split_across.label_bound(spark, TreeParams(max_split_labels="5000"), 100) == 5000
    assert split_across.label_bound(spark, TreeParams(max_split_labels="off"), 100) == 0
    counts = np.array([1, 10, 1000])
    per_label = np.minimum(100, counts * 20.0).mean()           # (20 + 100 + 100) / 3
    assert split_across.label_bound(spark, TreeParams(), 100, counts, 20.0) == row_bound_for(
        session_conf(spark), int(256 + 40 * (per_label + 1)))
    assert split_across.label_bound(spark, TreeParams(), 100) == row_bound_for(session_conf(spark), 256 + 40 * 101)
    # streamed splits: at most 2^24 estimated non-zeros a split in a task
    for d, c, nnz in [(10 ** 5, np.full(4, 10 ** 6), 500.0), (100, counts, 20.0)]:
        per_label = np.minimum(d, c * nnz).mean()
        assert split_across.label_bound(spark, TreeParams(), d, c, nnz, streamed=True) == min(
            int(split_across.STREAMED_SPLIT_NNZ // per_label), split_across.label_bound(spark, TreeParams(), d, c, nnz))
    assert split_across.STREAMED_SPLIT_NNZ == 2 ** 24
    assert split_across.label_bound(spark, TreeParams(), 10 ** 5, np.full(4, 10 ** 6), 500.0, streamed=True) == 167
    assert split_across.label_bound(spark, TreeParams(max_split_labels="77"), 100, streamed=True) == 77
    # without counts no cap: rows holding every feature would put nearly every node over it
    assert split_across.label_bound(spark, TreeParams(), 10 ** 5, streamed=True) == \
        split_across.label_bound(spark, TreeParams(), 10 ** 5)
    with pytest.raises(Exception, match="max_split_labels"):
        TreeParams(max_split_labels="1").validate()
    assert split_across.big_depths(1000, 2, 0, 10) == 0
    assert split_across.big_depths(1000, 2, 300, 10) == 2       # 1000 -> 500 -> 250
    assert split_across.big_depths(1000, 2, 300, 600) == 1      # the leaf size bounds the split too
    assert dataclasses.replace(TreeParams(), max_split_labels="AUTO").split_label_bound() is None


@pytest.mark.slow
def test_bibtex_with_big_splits_grows_the_reference_tree(bibtex, tmp_path, spark):
    """The real CLI on bibtex (159 labels) with leaves of at most 20 labels, at most 5 k-means
    steps a split (the test's time) and tree.max_split_labels = 40: the root and the next level
    (159, 80 labels) split across tasks, the tree is the single-process reference's (PIFA, kernel
    tree) label for label, and P@1/3/5 are within 0.3 of the reference model's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.oracles import reference_run
    from xmc_spark.storage import read_delta
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "xmc_spark.cli", "run", "--train", str(bibtex / "train.txt"), "--test",
         str(bibtex / "test.txt"), "--out", str(out), "--set", "spark.master=local[2]", "--set", "mlflow.enabled=false",
         "--set", "tree.max_leaf_size=20", "--set", "tree.max_iter=5", "--set", "tree.max_split_labels=40"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 level(s) split across tasks (nodes over 40 labels)" in r.stderr
    model, _, _, ref = reference_run(bibtex, tree=TreeParams(max_leaf_size=20, max_iter=5))
    got = {row["label_idx"]: row["node"] for row in read_delta(spark, str(out / "tables" / "tree")).collect()}
    leaf = dict(zip(model.index.slot_label.tolist(), model.index.slot_leaf.tolist()))
    assert got == leaf
    m = json.loads((out / "metrics.json").read_text())
    from xmc_spark.local_io import read_xc
    X, Y = read_xc(str(bibtex / "train.txt"))
    assert m["n_train_nonzeros"] == X.nnz     # ingest's count, a run fact
    # and the sum over the rows of labels x non-zeros (the PIFA combine's bound)
    assert m["n_train_label_nonzeros"] == int(np.diff(Y.indptr) @ np.diff(X.indptr)) > X.nnz
    for k in ("p@1", "p@3", "p@5"):
        assert abs(m[k] - ref[k]) <= 0.3, (k, m[k], ref[k])


def test_the_auto_bound_takes_ingests_count_or_one_aggregation(spark, monkeypatch):
    """split_bound: with ingest's mean non-zeros it reads no row; without, one aggregation gives
    the same bound; without label counts, or when rows holding every feature fit, none."""
    monkeypatch.setattr(split_across, "row_bound_for", lambda conf, nbytes: 10 ** 7 // nbytes)
    d, L, counts = 1000, 1000, np.ones(1000)
    unreadable = spark.range(1).selectExpr("raise_error('the rows were read') AS feature_idx")
    rows = spark.createDataFrame([([1, 2, 3],), ([4, 5, 6],)], "feature_idx array<int>")
    want = 10 ** 7 // (256 + 40 * (3 + 1))                       # each label: min(d, 1 x 3) non-zeros
    assert split_across.split_bound(unreadable, TreeParams(), d, L, counts, row_nnz=3.0) == want
    assert split_across.split_bound(rows, TreeParams(), d, L, counts) == want
    least = 10 ** 7 // (256 + 40 * (d + 1))                      # 243 < L: the count was needed
    assert split_across.split_bound(unreadable, TreeParams(), d, L) == least
    assert split_across.split_bound(unreadable, TreeParams(), d, least, counts) == least
    assert split_across.split_bound(unreadable, TreeParams(max_split_labels="77"), d, L, counts) == 77


def test_streamed_blocks_are_one_groups_rows_within_the_block_non_zeros():
    """_group_blocks cuts each batch into runs of one group's rows of at most ``cap`` non-zeros
    (a heavier row alone), the rows in order, each block's row count in ``rows``."""
    X = sp.random(9, 30, density=0.3, random_state=5, format="csr", dtype=np.float32)
    X = sp.csr_matrix(sp.vstack([X, sp.csr_matrix(np.ones((1, 30), np.float32))]))   # a row of 30 > 10
    g = np.array([0, 0, 0, 0, 1, 1, 2, 2, 2, 2], np.int32)
    t = pa.Table.from_batches(csr_batches({"g": pa.array(g), "pos": pa.array(np.arange(10, dtype=np.int64))}, X,
                                          1 << 20))
    batches = t.to_batches(max_chunksize=6)                     # two batches, group 2 across them
    blocks = list(split_across._group_blocks([batches[0], batches[0].slice(0, 0), batches[1]], cap=10))
    rows = np.concatenate([b.column("pos").to_numpy() for b in blocks])
    np.testing.assert_array_equal(rows, np.arange(10))
    for b in blocks:
        p = b.column("pos").to_numpy()
        assert len(set(g[p])) == 1 and set(b.column("node").to_pylist()) == {int(g[p[0]])}
        assert set(b.column("rows").to_pylist()) == {len(p)}
        nnz = np.diff(X.indptr)[p].sum()
        assert nnz <= 10 or len(p) == 1, (p, nnz)
        nxt = p[-1] + 1                                         # the cut is greedy: the next row of the
        if nxt < 10 and g[nxt] == g[p[0]] and nxt != 6:         # group in the batch would not fit
            assert nnz + np.diff(X.indptr)[nxt] > 10, (p, nnz)
    assert len(blocks) > 4                                      # groups and batches alone would give 4


def test_mapped_blocks_read_the_files_once_then_map_their_arrays(tmp_path):
    """The first pass reads the block files; later passes map the task's own copies: the same
    positions and rows, and the streamed split of them is the kernel's."""
    import pyarrow.fs as pafs

    from xmc_spark.kernels.balanced_kmeans import balanced_split_streamed
    paths = []
    for i, (a, b) in enumerate([(0, 100), (100, 101), (101, M)]):
        t = pa.Table.from_batches(csr_batches({"pos": pa.array(np.arange(a, b) + 1000)}, Z_fixture()[a:b], 1 << 20))
        paths.append(str(tmp_path / f"{i:06d}.arrow"))
        with pa.OSFile(paths[-1], "wb") as f, pa.ipc.new_file(f, t.schema) as w:
            w.write_table(t)
    local = tmp_path / "local"
    local.mkdir()
    blocks = split_across._MappedBlocks(pafs.LocalFileSystem(), paths, 1000, DIM, str(local))
    first = [(p.copy(), Z.toarray()) for p, Z in blocks()]
    assert blocks.kept and len(list(local.iterdir())) == 4 * len(paths)
    for p in paths:                                             # the later passes never read them
        (tmp_path / p).unlink()
    again = list(blocks())
    for (p0, z0), (p1, z1) in zip(first, again):
        np.testing.assert_array_equal(p0, p1)
        np.testing.assert_array_equal(z0, z1.toarray())
    assert isinstance(again[0][1].data.base, np.memmap) or isinstance(again[0][1].data.base.base, np.memmap)
    blocks = split_across._MappedBlocks(pafs.LocalFileSystem(), [], 1000, DIM, str(local))
    blocks.kept, blocks.paths = True, paths                     # the kept copies alone
    np.testing.assert_array_equal(balanced_split_streamed(blocks, M, DIM, 3, 20, 9),
                                  balanced_split(Z_fixture(), 3, 20, 9))


def test_the_auto_bound_is_capped_where_splits_are_streamed(spark, monkeypatch, tmp_path):
    """split_bound with the tree stage's scratch folder: streamed splits (local mode, local disk)
    cap the bound at STREAMED_SPLIT_NNZ estimated non-zeros a split; distributed ones, or no label
    counts, do not; the count is taken when n_labels rows of every feature would pass the cap,
    although they fit the memory."""
    monkeypatch.setattr(split_across, "row_bound_for", lambda conf, nbytes: 10 ** 7 // nbytes)
    monkeypatch.setattr(split_across, "STREAMED_SPLIT_NNZ", 300)
    d, L, counts = 1000, 1000, np.ones(1000)
    unreadable = spark.range(1).selectExpr("raise_error('the rows were read') AS feature_idx")
    memory = 10 ** 7 // (256 + 40 * (3 + 1))                     # 24,038 labels of 3 non-zeros
    scratch = str(tmp_path)
    assert split_across.split_bound(unreadable, TreeParams(), d, L, counts, row_nnz=3.0, scratch=scratch) == 100
    assert split_across.split_bound(unreadable, TreeParams(big_split_solver="distributed"), d, L, counts,
                                    row_nnz=3.0, scratch=scratch) == memory
    least = 10 ** 7 // (256 + 40 * (d + 1))
    assert split_across.split_bound(unreadable, TreeParams(), d, L, scratch=scratch) == least     # no counts
    # 200 labels fit the memory as rows of every feature (least = 243), but 200 x 1000 > 300: counted
    assert split_across.split_bound(unreadable, TreeParams(), d, 200, counts, row_nnz=3.0, scratch=scratch) == 100
    assert split_across.split_bound(unreadable, TreeParams(big_split_solver="distributed"), d, 200, counts,
                                    row_nnz=3.0, scratch=scratch) == least
