"""A model kept as a weights DataFrame predicts, matches and saves like the broadcast model."""
import dataclasses
import re
import shutil

import numpy as np
import pytest

from tests.conftest import executed_plan, stage_tasks
from tests.stages.conftest import as_sharded, ensemble_frame, weights_frame
from xmc_spark.model import ModelTrainParams, XMCModel, is_chunked
from xmc_spark.params import ClustersParams, TreeParams
from xmc_spark.schemas import check_table
from xmc_spark.stages import sharded


def layer_mb(model: XMCModel, n: int) -> float:
    """The first n layers' bytes (8 a non-zero) in MiB: a bound that broadcasts exactly those."""
    layers, _ = model.layers()
    return 8 * sum(W.nnz for _, W, _ in layers[:n]) / 2 ** 20


@pytest.fixture(scope="module")
def models(problem):
    _, Xl, Yl = problem
    plain = XMCModel.train_local(Xl, Yl, tree=TreeParams(max_leaf_size=3))
    overlap = XMCModel.train_local(Xl, Yl, ModelTrainParams(tree=TreeParams(max_leaf_size=3),
                                                            clusters=ClustersParams(copies=2, beam_size=3)))
    assert plain.index.depth >= 2 and len(overlap.index.slot_label) > Yl.shape[1]
    return {"plain": plain, "overlap": overlap}


def _rows(df, key="sample_id"):
    return sorted(df.collect(), key=lambda r: r[key])


@pytest.mark.parametrize("kind", ["plain", "overlap"])
# group_rows 7: the root's rows split over many salted tasks; top: the layers searched with their
# weights shared (0: none, "default": all but the label layer)
@pytest.mark.parametrize("group_rows,top", [(20000, 0), (7, 0), (7, 1), (20000, "default"), (7, "default")])
def test_sharded_prediction_equals_broadcast(spark, problem, models, kind, group_rows, top):
    samples, Xl, _ = problem
    model = models[kind]
    labels, scores = model.predict(Xl, beam_size=3, topk=4)
    sm = as_sharded(spark, model, "default" if top == "default" else layer_mb(model, top))
    n_layers = len(model.layers()[0])
    assert sharded.top_layers(sm, n_layers - 1, sharded.broadcast_bound(spark, sm.pred_params)) == \
        (n_layers - 1 if top == "default" else top)
    got = sharded.predict(samples, sm, beam_size=3, topk=4, group_rows=group_rows)
    rows = _rows(check_table(got, "predictions"))
    assert [r["sample_id"] for r in rows] == list(range(Xl.shape[0]))
    for r, lab, sc in zip(rows, labels, scores):
        assert r["pred_labels"] == [int(x) for x in lab if x >= 0]
        np.testing.assert_allclose(r["pred_scores"], sc[lab >= 0], rtol=1e-5)


@pytest.mark.parametrize("shared", ["files", "broadcast", "unusable", "unshared"])
def test_top_layers_reach_the_tasks_through_files_not_the_driver(spark, problem, models, tmp_path, monkeypatch,
                                                                  caplog, shared):
    """The top layers' weights are written by the tasks that hold them into a folder under the
    model's scratch folder, read there by the search's tasks and removed after the search: the
    driver collects none of them. Without a scratch folder (a cluster given none), with one the
    tasks cannot write (here: below a file), or one whose files the search's tasks do not find
    (here: removed before the search, as on a folder the executors do not share), they are
    collected and broadcast, with a warning. All four answer as the broadcast model."""
    samples, Xl, _ = problem
    model = models["plain"]
    labels, scores = model.predict(Xl, beam_size=3, topk=4)
    scratch = tmp_path / "scratch"
    if shared == "unusable":
        scratch.write_text("a file, not a folder")
        scratch = scratch / "below"
    sm = dataclasses.replace(as_sharded(spark, model, "default"), scratch=str(scratch))
    collected, removed = [], []
    real_to_arrow, real_remove = sharded.to_arrow, sharded._TopFiles.remove
    monkeypatch.setattr(sharded, "to_arrow", lambda df: collected.append(df.columns) or real_to_arrow(df))

    def remove(self):
        folder = scratch / self.folder.rsplit("/", 1)[-1]
        removed.append(sorted(p.name for p in folder.iterdir()) if folder.is_dir() else None)
        real_remove(self)
    monkeypatch.setattr(sharded._TopFiles, "remove", remove)
    if shared == "broadcast":
        monkeypatch.setattr(sharded, "scratch_root", lambda spark, scratch: None)
    if shared == "unshared":
        real_expect = sharded._TopFiles.expect

        def expect(self, reports):
            real_expect(self, reports)
            assert self.parts
            shutil.rmtree(scratch / self.folder.rsplit("/", 1)[-1])
        monkeypatch.setattr(sharded._TopFiles, "expect", expect)
    with caplog.at_level("WARNING", logger="xmc_spark.predict"):
        rows = _rows(sharded.predict(samples, sm, beam_size=3, topk=4))
    for r, lab, sc in zip(rows, labels, scores):
        assert r["pred_labels"] == [int(x) for x in lab if x >= 0]
        np.testing.assert_allclose(r["pred_scores"], sc[lab >= 0], rtol=1e-5)
    assert len(rows) == Xl.shape[0]
    if shared == "files":
        assert collected == [], collected
        assert len(removed) == 1 and removed[0] and all(re.fullmatch(r"part-\d{5}\.arrow", n) for n in removed[0])
        assert list(scratch.iterdir()) == []          # the search's folder is gone
        assert "collected and broadcast" not in caplog.text
    else:
        assert collected == [["layer", "pos", "w_idx", "w_val"]]
        assert removed == ([] if shared == "broadcast" else [None])
        assert "collected and broadcast" in caplog.text
        assert ("could not be shared through" in caplog.text) == (shared != "broadcast")
        if shared == "unshared":
            assert "cannot be read" in caplog.text


def test_top_layer_files_are_checked_against_what_their_tasks_wrote(tmp_path):
    """A search task reads exactly the files the writing tasks reported, with their row counts: a
    missing or short file (a scratch folder the tasks do not share) is an error, not an empty layer."""
    import pyarrow as pa

    from xmc_spark.storage import StorageError
    files = sharded._TopFiles(str(tmp_path / "top"), [], 3)
    files.expect([{"part": 0, "n": 0}])
    assert files.value == []                          # no rows anywhere: nothing to read
    files = sharded._TopFiles(str(tmp_path / "top2"), [], 3)
    files.expect([{"part": 3, "n": 2}, {"part": 5, "n": 0}])
    with pytest.raises(StorageError, match=r"part-00003\.arrow: the search's top layers cannot be read"):
        _ = files.value
    (tmp_path / "top2").mkdir()
    one = pa.table({"layer": pa.array([0], pa.int32()), "pos": pa.array([0], pa.int64()),
                    "w_idx": pa.array([[0]], pa.list_(pa.int32())), "w_val": pa.array([[1.0]], pa.list_(pa.float32()))})
    with pa.OSFile(str(tmp_path / "top2" / "part-00003.arrow"), "wb") as f, pa.ipc.new_file(f, sharded.TOP_ROWS) as w:
        w.write_table(one.cast(sharded.TOP_ROWS))
    with pytest.raises(StorageError, match=r"1 rows where its task wrote 2"):
        _ = files.value
    files.remove()
    assert not (tmp_path / "top2").exists()
    files.remove()                                    # gone already: no error


def test_sharded_prediction_joins_rows_without_a_broadcast(spark, problem, models, tmp_path):
    """The rows' features rejoin each layer's beam by a shuffle, never a broadcast: a small input
    table (here every table is small) would otherwise be broadcast, its rows passing through the
    driver once per layer. The top layers' weights are shared (the default bound), the rest
    cogrouped. The input and the placed weights are read once and kept on the executors: the
    layers' plans scan those copies, not the input's or the weights' files."""
    samples, _, _ = problem
    samples.write.parquet(str(tmp_path / "rows"))
    sm = as_sharded(spark, models["plain"], "default")
    sm.weights.write.parquet(str(tmp_path / "weights"))
    sm = dataclasses.replace(sm, weights=spark.read.parquet(str(tmp_path / "weights")))
    got = sharded.predict(spark.read.parquet(str(tmp_path / "rows")), sm, beam_size=3, topk=4)
    got.collect()                             # the adaptive plan as it ran
    plan = executed_plan(got)
    assert "isFinalPlan=true" in plan
    joins = re.findall(r"(\w+Join) \[(\w+)#", plan)
    assert models["plain"].index.depth >= 2 and ("ShuffledHashJoin", "sample_id") in joins, joins
    assert not [j for j in joins if j[0].startswith("Broadcast")], joins
    assert "FileScan" not in plan and "Scan ExistingRDD" in plan
    # the placed weights (the tree's (is_leaf, key) -> place table looked up in the tasks) were
    # computed once, when they were kept
    assert "Scan ExistingRDD" in executed_plan(sm.placed)


@pytest.mark.parametrize("topk", [1, 2])
def test_sharded_prediction_keeps_each_leafs_top_k(spark, problem, models, topk):
    """One tree without overlap: each leaf task keeps only its rows' top k (here fewer than a
    leaf's labels, ties to the smaller label), which hold every row's top k: the broadcast answer."""
    samples, Xl, _ = problem
    model = models["plain"]
    child_ptr = model.layers()[0][-1][0]
    assert np.diff(child_ptr).max() > topk                  # leaves with more labels than k: pruned
    labels, scores = model.predict(Xl, beam_size=3, topk=topk)
    rows = _rows(sharded.predict(samples, as_sharded(spark, model, "default"), beam_size=3, topk=topk))
    assert [r["pred_labels"] for r in rows] == [[int(x) for x in lab if x >= 0] for lab in labels]
    np.testing.assert_allclose(np.concatenate([r["pred_scores"] for r in rows]), scores[labels >= 0], rtol=1e-5)


def test_layer_bytes_and_top_layers(spark, models):
    """Each layer's bytes from one aggregate (8 a non-zero, as the broadcast model's layers hold
    them); the top layers are the longest prefix within the bound."""
    model = models["overlap"]
    sm = as_sharded(spark, model)
    layers, _ = model.layers()
    np.testing.assert_array_equal(sharded.layer_nbytes(sm), [8 * W.nnz for _, W, _ in layers])
    sizes = np.cumsum(sharded.layer_nbytes(sm))
    assert sharded.top_layers(sm, len(layers), 0) == 0
    assert sharded.top_layers(sm, len(layers), sizes[0] - 1) == 0
    assert sharded.top_layers(sm, len(layers), sizes[1]) == 2
    assert sharded.top_layers(sm, 1, sizes[-1]) == 1
    assert sharded.top_layers(sm, len(layers), sizes[-1] + 1) == len(layers)
    # the placed weights and layer sizes are caches of these weights: a copy of the model with
    # other weights starts without them (they are not init fields, so replace does not copy them)
    assert sm.placed is not None and sm.layer_bytes is not None
    empty = dataclasses.replace(sm, weights=sm.weights.limit(0))
    assert empty.placed is None and empty.layer_bytes is None
    np.testing.assert_array_equal(sharded.layer_nbytes(empty), np.zeros(len(layers)))


def test_the_size_aggregates_end_in_one_task(spark, models):
    """tree_nbytes and layer_nbytes gather O(trees) and O(layers) rows: with 64 shuffle partitions
    and no adaptive coalescing their aggregates still end in one task, not 64 (each task returns
    its metrics to the driver)."""
    model = models["overlap"]
    old = {key: spark.conf.get(key) for key in ("spark.sql.shuffle.partitions",
                                                "spark.sql.adaptive.coalescePartitions.enabled")}
    try:
        spark.conf.set("spark.sql.shuffle.partitions", "64")
        spark.conf.set("spark.sql.adaptive.coalescePartitions.enabled", "false")

        def sizes():
            sm = as_sharded(spark, model)
            return sharded.layer_nbytes(sm), sharded.tree_nbytes(sm.weights)
        nbytes, tasks = stage_tasks(spark, sizes, "xmc-size-aggregates")
    finally:
        for key, value in old.items():
            spark.conf.set(key, value)
    layers, _ = model.layers()
    np.testing.assert_array_equal(nbytes[0], [8 * W.nnz for _, W, _ in layers])
    assert nbytes[1] == {0: int(sum(nbytes[0]))}
    tasks = sorted(tasks)
    # the checkpoint's and the aggregates' input stages, and each aggregate's end in one task
    assert len(tasks) >= 4 and tasks.count(1) >= 2 and tasks[-1] < 64, tasks


@pytest.mark.parametrize("top", [0, "default"])          # default: every inner layer shared, no cogroup
def test_sharded_matcher_equals_match_leaves(spark, problem, models, top):
    samples, Xl, _ = problem
    model = models["plain"]
    leaves, scores = model.match_leaves(Xl, beam_size=3)
    got = check_table(sharded.matcher(samples, as_sharded(spark, model, top), beam_size=3, group_rows=11), "matcher")
    found = {}
    for r in got.collect():
        found.setdefault(r["sample_id"], {})[r["leaf"]] = r["score"]
    for i in range(Xl.shape[0]):
        ref = {int(leaf): s for leaf, s in zip(leaves[i], scores[i]) if leaf >= 0}
        assert sorted(found[i]) == sorted(ref)
        np.testing.assert_allclose([found[i][k] for k in sorted(ref)], [ref[k] for k in sorted(ref)], rtol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "overlap"])
def test_sharded_routing_equals_beam_nodes(spark, problem, models, kind):
    """tfn+man's routed nodes from the layer-by-layer beam: every (sample, node) pair of the
    broadcast model's beam_nodes, nothing else; through node_training.routed_nodes, as the
    pipeline calls it."""
    from xmc_spark.stages import node_training
    samples, Xl, _ = problem
    model = models[kind]
    rows, nodes = model.beam_nodes(Xl, beam_size=3)
    got = check_table(node_training.routed_nodes(samples, as_sharded(spark, model), beam_size=3), "negatives")
    found = {r["sample_id"]: r["man"] for r in got.collect()}
    for i in range(Xl.shape[0]):
        assert found.get(i, []) == sorted(int(g) for g in nodes[rows == i]), i
    assert len(nodes) > Xl.shape[0] * model.index.depth      # beams wider than one node a depth


def test_single_leaf_tree(spark, problem):
    samples, Xl, Yl = problem
    model = XMCModel.train_local(Xl, Yl, tree=TreeParams(max_leaf_size=1000))
    assert model.index.depth == 0
    labels, scores = model.predict(Xl, beam_size=2, topk=3)
    rows = _rows(sharded.predict(samples, as_sharded(spark, model), beam_size=2, topk=3))
    assert [r["pred_labels"] for r in rows] == [[int(x) for x in lab if x >= 0] for lab in labels]
    m = sharded.matcher(samples, as_sharded(spark, model), beam_size=2)
    assert {(r["leaf"], r["score"]) for r in m.collect()} == {(0, 1.0)}


def test_chunked_save_load_round_trip(spark, problem, models, tmp_path, monkeypatch):
    samples, Xl, _ = problem
    model = models["overlap"]
    model.label_counts = np.arange(model.n_labels)
    sm = as_sharded(spark, model)
    sm.nbytes = sharded.weights_nbytes(sm.weights)
    assert sm.nbytes == 8 * (model.node_w.W.nnz + model.slot_w.W.nnz)
    monkeypatch.setattr(sharded, "PART_BYTES", max(1, sm.nbytes // 3))      # several part files
    sm.meta = {"x": 1}
    folder = tmp_path / "m"
    sm.save(str(folder))
    parts = sorted(p.name for p in (folder / "weights").iterdir())
    assert len(parts) >= 2 and is_chunked(str(folder))
    back = XMCModel.load(str(folder))                          # whole, in memory
    np.testing.assert_array_equal(back.label_counts, model.label_counts)
    for a, b in ((back.node_w, model.node_w), (back.slot_w, model.slot_w)):
        np.testing.assert_array_equal(a.keys, b.keys)
        assert abs(a.W - b.W).max() == 0
    lab, sc = model.predict(Xl, beam_size=3, topk=4)
    lab2, sc2 = back.predict(Xl, beam_size=3, topk=4)
    np.testing.assert_array_equal(lab, lab2)
    lazy = sharded.load(spark, str(folder))                    # weights read by the tasks
    rows = _rows(sharded.predict(samples, lazy, beam_size=3, topk=4))
    assert [r["pred_labels"] for r in rows] == [[int(x) for x in r if x >= 0] for r in lab]
    assert lazy.meta == {"x": 1}
    (folder / "weights" / parts[0]).unlink()
    with pytest.raises(Exception, match="missing"):
        XMCModel.load(str(folder))


def test_pipeline_goes_sharded_above_the_bound_and_never_broadcasts_weights(spark, problem, models, tmp_path,
                                                                             monkeypatch):
    """Above predict.max_broadcast_mb: the trained weights stay a DataFrame, a saved chunked
    folder predicts with its weights read by the tasks, and no broadcast carries weights."""

    from pyspark import SparkContext

    from tests.conftest import write_xc
    from xmc_spark import pipeline
    from xmc_spark.model import KeyedColumns
    from xmc_spark.params import PipelineParams

    samples, Xl, Yl = problem
    model = models["plain"]
    shipped = []
    real = SparkContext.broadcast
    monkeypatch.setattr(SparkContext, "broadcast", lambda self, v: shipped.append(v) or real(self, v))
    params = PipelineParams()
    tight = dataclasses.replace(params, predict=dataclasses.replace(params.predict, max_broadcast_mb=1e-4))
    tp = ModelTrainParams(tree=TreeParams(max_leaf_size=3))
    weights = weights_frame(spark, model)
    got = pipeline.model_from_weights(weights, model.index, model.n_features, tp, tight.predict)
    assert isinstance(got, sharded.ShardedModel) and got.nbytes > 1e-4 * 2 ** 20
    assert isinstance(pipeline.model_from_weights(weights, model.index, model.n_features, tp, params.predict),
                      XMCModel)                                        # the default bound: whole, as before
    model.save(str(tmp_path / "m"), parts=2)
    write_xc(tmp_path / "data.txt", Xl * 2.0, Yl)                      # raw rows: ingest normalizes
    shipped.clear()
    out = pipeline.predict(spark, str(tmp_path / "m"), str(tmp_path / "data.txt"), str(tmp_path / "out"), tight)
    assert not [v for v in shipped if isinstance(v, (XMCModel, KeyedColumns))]
    labels, _ = model.predict(Xl, beam_size=params.predict.beam_size, topk=params.predict.topk)
    rows = _rows(spark.read.format("delta").load(out["predictions"]))
    assert [r["pred_labels"] for r in rows] == [[int(x) for x in lab if x >= 0] for lab in labels]
    assert out["p@1"] > 0


# ---- ensembles ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ensemble(problem):
    """Two trees of different branching (2 and 3), overlapping clusters: what tree.ensemble_splits
    with clusters.copies trains."""
    from xmc_spark.model import EnsembleModel
    _, Xl, Yl = problem
    e = EnsembleModel.train_local(Xl, Yl, ModelTrainParams(tree=TreeParams(max_leaf_size=3, ensemble_splits=[2, 3]),
                                                           clusters=ClustersParams(copies=2, beam_size=3)))
    assert [m.index.B for m in e.models] == [2, 3] and all(m.index.depth >= 1 for m in e.models)
    return e


def as_sharded_ensemble(spark, e) -> sharded.ShardedEnsemble:
    frame = ensemble_frame(spark, e)
    got = sharded.sharded_model(e.index, frame, e.n_features, e.bias, e.normalize, e.pred_params,
                                sharded.tree_nbytes(frame))
    assert isinstance(got, sharded.ShardedEnsemble)
    assert [m.nbytes for m in got.members] == [8 * (m.node_w.W.nnz + m.slot_w.W.nnz) for m in e.models]
    return got


def test_sharded_ensemble_prediction_equals_broadcast(spark, problem, ensemble, group_rows=7):
    """Every tree's layered beam, labels' scores averaged over the trees (0 where a tree does not
    reach a label): the broadcast ensemble's top k, labels and scores."""
    samples, Xl, _ = problem
    labels, scores = ensemble.predict(Xl, beam_size=2, topk=6)
    got = sharded.predict(samples, as_sharded_ensemble(spark, ensemble), beam_size=2, topk=6, group_rows=group_rows)
    rows = _rows(check_table(got, "predictions"))
    assert [r["sample_id"] for r in rows] == list(range(Xl.shape[0]))
    single = ensemble.models[0].predict(Xl, beam_size=2, topk=6)[0]
    assert (labels != single).any()                       # the second tree changes the answer
    for r, lab, sc in zip(rows, labels, scores):
        np.testing.assert_allclose(r["pred_scores"], sc[lab >= 0], rtol=1e-5)
        assert r["pred_labels"] == [int(x) for x in lab if x >= 0]


def test_sharded_ensemble_matcher_and_routing_equal_broadcast(spark, problem, ensemble):
    """The overlapping-cluster matcher and tfn+man's routed nodes of a sharded ensemble: every
    tree's leaves / nodes as ensemble keys, as EnsembleModel.match_leaves / beam_nodes."""
    from xmc_spark.stages import label_clusters, node_training
    samples, Xl, _ = problem
    se = as_sharded_ensemble(spark, ensemble)
    leaves, scores = ensemble.match_leaves(Xl, beam_size=3)
    found = {}
    for r in check_table(label_clusters.matcher(samples, se, beam_size=3), "matcher").collect():
        found.setdefault(r["sample_id"], {})[r["leaf"]] = r["score"]
    assert any(k >> 52 == 1 for f in found.values() for k in f)
    for i in range(Xl.shape[0]):
        ref = {int(leaf): s for leaf, s in zip(leaves[i], scores[i]) if leaf >= 0}
        assert sorted(found[i]) == sorted(ref)
        np.testing.assert_allclose([found[i][k] for k in sorted(ref)], [ref[k] for k in sorted(ref)], rtol=1e-5)
    rows, nodes = ensemble.beam_nodes(Xl, beam_size=3)
    got = check_table(node_training.routed_nodes(samples, se, beam_size=3), "negatives")
    man = {r["sample_id"]: r["man"] for r in got.collect()}
    for i in range(Xl.shape[0]):
        assert man.get(i, []) == sorted(int(g) for g in nodes[rows == i]), i


def test_sharded_ensemble_save_load_round_trip(spark, problem, ensemble, tmp_path, monkeypatch):
    """An ensemble folder (format 3) of chunked members: read whole it is the EnsembleModel, read
    lazily a ShardedEnsemble predicting the same."""
    from xmc_spark.model import EnsembleModel
    samples, Xl, _ = problem
    se = as_sharded_ensemble(spark, ensemble)
    monkeypatch.setattr(sharded, "PART_BYTES", max(1, se.members[0].nbytes // 2))
    se.meta, se.label_counts = {"x": 2}, np.arange(ensemble.n_labels)
    folder = tmp_path / "e"
    se.save(str(folder))
    assert is_chunked(str(folder)) and not is_chunked(str(tmp_path))
    assert all(len(list((folder / f"tree-{t}" / "weights").iterdir())) >= 2 for t in range(2))
    whole = XMCModel.load(str(folder))
    assert isinstance(whole, EnsembleModel)
    np.testing.assert_array_equal(whole.label_counts, np.arange(ensemble.n_labels))
    labels, scores = ensemble.predict(Xl, beam_size=2, topk=4)
    np.testing.assert_array_equal(whole.predict(Xl, beam_size=2, topk=4)[0], labels)
    lazy = sharded.load(spark, str(folder))
    assert isinstance(lazy, sharded.ShardedEnsemble) and lazy.meta == {"x": 2} and lazy.nbytes == se.nbytes
    rows = _rows(sharded.predict(samples, lazy, beam_size=2, topk=4))
    assert [r["pred_labels"] for r in rows] == [[int(x) for x in lab if x >= 0] for lab in labels]
    # what `xmc-spark predict` loads: sharded above predict.max_broadcast_mb, whole below
    from xmc_spark import pipeline
    from xmc_spark.params import PipelineParams
    p = PipelineParams()
    tight = dataclasses.replace(p, predict=dataclasses.replace(p.predict, max_broadcast_mb=1e-4))
    assert isinstance(pipeline.load_model(spark, str(folder), tight), sharded.ShardedEnsemble)
    assert isinstance(pipeline.load_model(spark, str(folder), p), EnsembleModel)


def test_pipeline_keeps_an_ensemble_sharded_above_the_bound(spark, ensemble):
    from xmc_spark import pipeline
    from xmc_spark.params import PipelineParams
    params = PipelineParams()
    tight = dataclasses.replace(params.predict, max_broadcast_mb=1e-4)
    tp = ModelTrainParams(tree=TreeParams(max_leaf_size=3, ensemble_splits=[2, 3]))
    got = pipeline.model_from_weights(ensemble_frame(spark, ensemble), ensemble.index, ensemble.n_features, tp, tight)
    assert isinstance(got, sharded.ShardedEnsemble) and len(got.members) == 2


@pytest.mark.slow
def test_sharded_equals_broadcast_on_bibtex(spark, bibtex):
    """A deep bibtex tree (leaves of 8 labels): the top layers searched with their weights shared,
    then the layer-by-layer search, give the broadcast search's top 5 on every test row, scores to
    1e-5."""
    from tests.stages.conftest import samples_frame
    from xmc_spark.local_io import read_xc

    X, Y = read_xc(str(bibtex / "train.txt"))
    Xt, Yt = read_xc(str(bibtex / "test.txt"))
    model = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=8))
    assert model.index.depth >= 4
    labels, scores = model.predict(Xt, beam_size=10, topk=5)
    sm = as_sharded(spark, model, layer_mb(model, 2))          # the top 2 layers shared, the rest cogrouped
    got = _rows(sharded.predict(samples_frame(spark, Xt, Yt, partitions=4), sm, 10, 5, group_rows=500))
    same = np.mean([r["pred_labels"] == [int(x) for x in lab if x >= 0] for r, lab in zip(got, labels)])
    assert same >= 0.999, same
    for r, lab, sc in zip(got, labels, scores):
        if r["pred_labels"] == [int(x) for x in lab if x >= 0]:
            np.testing.assert_allclose(r["pred_scores"], sc[lab >= 0], rtol=1e-5)


def test_weights_of_a_node_not_in_the_tree_are_rejected(spark, problem, models):
    """A weights table holding a key the tree does not have (a mismatched model folder) stops with
    the key named, before any search."""
    from pyspark.sql import functions as F

    from xmc_spark.model import ModelFormatError
    samples, _, _ = problem
    sm = as_sharded(spark, models["plain"])
    extra = sm.weights.where(~F.col("is_leaf")).limit(1).withColumn("key", F.lit(10 ** 9).cast("long"))
    sm.weights = sm.weights.unionByName(extra)
    with pytest.raises(ModelFormatError, match="key 1000000000, which is not in the tree"):
        sharded.predict(samples, sm, beam_size=3, topk=4)
    sm.layer_bytes = sm.placed = None
    with pytest.raises(ModelFormatError, match="key 1000000000, which is not in the tree"):
        sharded.routed(samples, sm, beam_size=3)             # tfn+man: no shared layers, same check


def test_search_partitions_follow_the_rows_not_the_shuffle_partitions(spark, problem, models, monkeypatch):
    """The search's own shuffles take about SEARCH_TASK_ROWS rows a task, between the default
    parallelism and the shuffle partitions: with 64 shuffle partitions and no adaptive
    coalescing, a small input's cogroups and merges run on the default parallelism's tasks, a
    large one's (here: SEARCH_TASK_ROWS made 1) on all 64, with the same answer either way. A
    layer's merge by sample takes the partitions the rows' features were checkpointed in, so the
    next layer's rejoin (a join on sample_id) shuffles neither side; a merge of more than
    MERGE_TASK_ROWS rows a task (here: made 1) takes more partitions, and its beam is shuffled
    back into the features' for the rejoin."""
    from xmc_spark.compat import default_parallelism, shuffle_partitions
    dp, sp_ = default_parallelism(spark), shuffle_partitions(spark)
    monkeypatch.setattr(sharded, "SEARCH_TASK_ROWS", 10)
    for rows, want in ((1, min(sp_, dp)), (10 * sp_ + 5, sp_), (10 * dp + 1, min(sp_, dp + 1))):
        assert sharded.search_partitions(spark, rows) == max(1, want), rows
    assert sharded.search_partitions(spark, 10 * sp_ + 5, (dp, None)) == sp_ + 1     # 'auto': no cap
    monkeypatch.setattr(sharded, "MERGE_TASK_ROWS", 100)
    assert sharded.merge_partitions(spark, 1000, 3, (2, 64)) == 10                  # the rows need more
    assert sharded.merge_partitions(spark, 1000, 12, (2, 64)) == 12                 # the features' partitions
    assert sharded.merge_partitions(spark, 10 ** 6, 12, (2, 64)) == 64              # up to the cap
    monkeypatch.undo()
    samples, _, _ = problem
    want = _rows(sharded.predict(samples, as_sharded(spark, models["plain"], 0.0), beam_size=3, topk=4))
    old = {key: spark.conf.get(key) for key in ("spark.sql.shuffle.partitions",
                                                "spark.sql.adaptive.coalescePartitions.enabled")}
    counts, joins, default_rows = {}, {}, (sharded.SEARCH_TASK_ROWS, sharded.MERGE_TASK_ROWS)
    try:
        spark.conf.set("spark.sql.shuffle.partitions", "64")
        spark.conf.set("spark.sql.adaptive.coalescePartitions.enabled", "false")
        for task_rows in (default_rows, (1, default_rows[1]), (default_rows[0], 1)):
            monkeypatch.setattr(sharded, "SEARCH_TASK_ROWS", task_rows[0])
            monkeypatch.setattr(sharded, "MERGE_TASK_ROWS", task_rows[1])
            got = sharded.predict(samples, as_sharded(spark, models["plain"], 0.0), beam_size=3, topk=4)
            assert _rows(got) == want
            # the last layer's query: the rejoin of the layer above's beam with the rows'
            # features, the cogroup's shuffles, the merge
            shuffles = re.findall(r"Exchange hashpartitioning\((.*?), (\d+)\), (\w+)", executed_plan(got))
            counts[task_rows] = {int(c) for _, c, why in shuffles if why == "REPARTITION_BY_NUM"}
            joins[task_rows] = {(keys.split("#")[0], int(c)) for keys, c, why in shuffles
                                if why == "ENSURE_REQUIREMENTS"}
    finally:
        for key, value in old.items():
            spark.conf.set(key, value)
    assert counts[default_rows] == {dp} and counts[(1, default_rows[1])] == {64}, counts
    assert counts[(default_rows[0], 1)] == {dp, 64}, counts
    # the beam merged in the features' partitions is rejoined where it is; merged in more, it
    # is shuffled back into the features' (the features themselves stay where they are)
    assert joins[default_rows] == set() and joins[(1, default_rows[1])] == set(), joins
    assert joins[(default_rows[0], 1)] == {("sample_id", dp)}, joins


def test_placed_weights_are_looked_up_without_a_broadcast(spark, models):
    """The weights' (layer, parent position, position) come from the tree's place table shared
    with a vectorized UDF: the same rows as the broadcast join (Spark Connect's path), a key the
    tree does not have null in both, and no broadcast (whose side Spark collects through the
    driver) in the plan."""
    from pyspark.sql import functions as F

    sm = as_sharded(spark, models["overlap"])
    one = sm.weights.orderBy("is_leaf", "key")
    extra = one.where(~F.col("is_leaf")).limit(1).withColumn("key", F.lit(10 ** 9).cast("long"))
    slot = one.where(F.col("is_leaf")).limit(1).withColumn("key", F.lit(-1).cast("long"))
    # a null is_leaf with a real node's key is no key of the tree either (the join leaves it null)
    null = one.where(~F.col("is_leaf")).limit(1).withColumn("is_leaf", F.lit(None).cast("boolean"))
    weights = sm.weights.unionByName(extra).unionByName(slot).unionByName(null)
    placed, shared = sharded._placed(weights, sm.index)
    assert "Broadcast" not in executed_plan(placed)
    joined = sharded._placed_by_join(weights, sharded._place_table(sm.index))
    assert placed.schema == joined.schema
    cols = ["key", "layer", "ppos", "pos"]
    got, want = (sorted((tuple(r) for r in df.select(*cols, F.size("w_idx")).collect()),
                        key=lambda r: tuple(-1 if v is None else v for v in r)) for df in (placed, joined))
    shared.unpersist()
    assert got == want and len(got) == sm.weights.count() + 3
    assert sum(r[1] is None for r in got) == 3 and len({r[1] for r in got}) == len(models["overlap"].layers()[0]) + 1
