"""The PRIME stage on Spark agrees with the numpy kernel (kernels.prime) on a tiny synth set:
retrieval = kernels.prime.retrieve, re-ranking = kernels.prime.rerank, weight 1 = the tree's
order; the head survives the ``prime`` table; mode off leaves the stage a no-op."""
import dataclasses
import re

import numpy as np
import pytest
import scipy.sparse as sp

from tests.stages.conftest import samples_frame, synth_rows
from xmc_spark import prime_model
from xmc_spark.kernels import prime as PR
from xmc_spark.model import XMCModel
from xmc_spark.params import PipelineParams, PrimeParams, TreeParams
from xmc_spark.stages import prediction
from xmc_spark.stages import prime as stage

N_TRAIN, N_TEST, L, D = 400, 120, 30, 150


def _synth(start, count):
    return synth_rows(start, count, L, D, seed=3)


@pytest.fixture(scope="module")
def trained(spark):
    """A tree, the samples frames and a PRIME head trained by the stage (2 epochs, dim 8)."""
    X, Y = _synth(0, N_TRAIN)
    Xt, Yt = _synth(N_TRAIN, N_TEST)
    samples, test = samples_frame(spark, X, Y, partitions=2), samples_frame(spark, Xt, Yt, partitions=2)
    tree = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4))
    prm = PrimeParams(mode="rerank", K=12, hard_k=5, epochs=2, dim=8, ffn=16, batch_size=64, val_frac=0.2)
    counts = np.asarray((Y > 0).sum(axis=0)).ravel()
    seen = {}

    def val_tree_fit(train_df):         # the weight's tree: trained without the held-out rows
        seen["ids"] = {r["sample_id"] for r in train_df.select("sample_id").collect()}
        return tree

    head, facts = stage.run(samples, tree, counts, prm, N_TRAIN, D, L, beam_size=3, val_tree_fit=val_tree_fit)
    held = {r["sample_id"] for r in samples.filter(stage.is_held_out(stage.val_fraction(prm, N_TRAIN), prm.seed))
            .collect()}
    assert facts["prime.val_tree"] and len(held) == facts["prime.n_held_out"]
    assert not seen["ids"] & held and seen["ids"] | held == set(range(N_TRAIN))
    return tree, head, facts, test, Xt, prm


def _collect(df):
    rows = sorted(df.collect(), key=lambda r: r["sample_id"])
    return [list(r["pred_labels"]) for r in rows], [list(r["pred_scores"]) for r in rows]


def test_stage_trains_streaming_and_chooses_on_held_out_training_rows(trained):
    tree, head, facts, _, _, prm = trained
    assert len(facts["prime.loss"]) == prm.epochs and np.isfinite(facts["prime.loss"]).all()
    assert len(facts["prime.val_retrieve_mean_p"]) == prm.epochs + 1          # epoch 0 = the PIFA start
    assert 0 <= facts["prime.epoch"] <= prm.epochs
    assert 0.1 * N_TRAIN < facts["prime.n_held_out"] < 0.3 * N_TRAIN         # val_frac 0.2 by a hash
    assert facts["prime.val_rerank_mean_p"] >= facts["prime.val_tree_mean_p"]  # the grid holds weight 1
    assert 0.0 <= head.weight <= 1.0 and head.weight == facts["prime.weight"]
    assert head.weights["E"].shape == (D, 8) and head.weights["Z"].shape == (L, 8)
    np.testing.assert_allclose(np.linalg.norm(head.weights["Z"], axis=1), 1.0, rtol=1e-5)


def test_patience_stops_when_no_epoch_beats_the_best(spark):
    # lr ~0 and no centroids: every epoch's model retrieves like the PIFA start, none is better
    X, Y = _synth(0, N_TRAIN)
    tree = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4))
    counts = np.asarray((Y > 0).sum(axis=0)).ravel()
    kw = dict(mode="retrieve", hard_k=5, epochs=6, dim=8, ffn=16, batch_size=128, val_frac=0.2, lr=1e-12,
              use_centroids=False)
    samples = samples_frame(spark, X, Y, partitions=2)
    for patience, runs in ((2, 2), (0, 6)):
        _, facts = stage.run(samples, tree, counts, PrimeParams(patience=patience, **kw), N_TRAIN, D, L, beam_size=3)
        assert facts["prime.epochs_run"] == runs and len(facts["prime.loss"]) == runs
        assert facts["prime.epoch"] == 0 and len(set(facts["prime.val_retrieve_mean_p"])) == 1


def test_stage_trains_with_ngame_clustered_batches(trained, spark, monkeypatch):
    """prime.batching = clustered reaches the optimizer: every streamed blob's rows are clustered
    (by the tree kernel, counted) and the training differs from random batches'; a bad value
    stops before any work."""
    from xmc_spark.kernels import prime as kernel
    from xmc_spark.params import ConfigError
    tree, _, facts, _, _, prm = trained
    X, Y = _synth(0, N_TRAIN)
    counts = np.asarray((Y > 0).sum(axis=0)).ravel()
    samples = samples_frame(spark, X, Y, partitions=2)
    clustered = dataclasses.replace(prm, batching="clustered", cluster_size=8)
    calls, real = [], kernel.build_tree
    monkeypatch.setattr(kernel, "build_tree", lambda Z, **kw: calls.append((Z.shape, kw)) or real(Z, **kw))
    _, got = stage.run(samples, tree, counts, clustered, N_TRAIN, D, L, beam_size=3, val_tree_fit=lambda df: tree)
    n_fit = N_TRAIN - facts["prime.n_held_out"]
    queries = [(shape, kw) for shape, kw in calls if shape[1] == prm.dim]     # the others: free-vector clusters
    assert sum(shape[0] for shape, _ in queries) == prm.epochs * n_fit        # every fitting row, every epoch
    assert all(kw["max_leaf_size"] == 8 for _, kw in queries) and len(calls) - len(queries) == 1
    assert np.isfinite(got["prime.loss"]).all() and len(got["prime.loss"]) == prm.epochs
    assert got["prime.loss"] != facts["prime.loss"] and got["prime.n_held_out"] == facts["prime.n_held_out"]
    with pytest.raises(ConfigError, match="prime.batching"):
        dataclasses.replace(prm, batching="ngame").validate("prime.")


def test_rows_are_packed_in_partitions_of_a_blob_or_more():
    # (training rows, Arrow batch rows, shuffle partitions) -> partitions: a blob or more each, <= the shuffle's
    assert stage.pack_partitions(4880, 4096, 8) == 1          # bibtex: one partition, batches of 1024 rows
    assert stage.pack_partitions(12920, 4096, 8) == 3
    assert stage.pack_partitions(200000, 4096, 8) == 8
    assert stage.pack_partitions(100, 4096, 8) == 1 and stage.pack_partitions(10**6, 0, 4) == 4


def test_held_out_share_is_capped(spark):
    df = spark.range(0, 2000).withColumnRenamed("id", "sample_id")
    frac = stage.val_fraction(PrimeParams(val_frac=0.5, val_max_rows=100), 2000)
    assert frac == pytest.approx(0.05)
    n = df.filter(stage.is_held_out(frac, 0)).count()
    assert 60 < n < 140
    assert df.filter(stage.is_held_out(frac, 0)).count() == n            # deterministic


def test_spark_retrieval_equals_kernel_retrieve(trained):
    tree, head, _, test, Xt, _ = trained
    ret = dataclasses.replace(head, mode="retrieve")
    labels, scores = _collect(prediction.run(test, prime_model.PrimedModel(tree, ret), 3, 5))
    want, want_sc = PR.retrieve(ret.encode(Xt), ret.weights["Z"], 5)
    assert labels == want.tolist()
    np.testing.assert_allclose(np.array(scores), want_sc, rtol=1e-5, atol=1e-6)


def test_spark_rerank_equals_kernel_rerank_and_weight_one_is_the_tree(trained):
    tree, head, _, test, Xt, _ = trained
    for w in (0.3, 1.0):
        h = dataclasses.replace(head, weight=w)
        labels, _ = _collect(prediction.run(test, prime_model.PrimedModel(tree, h), 3, 5))
        cand, ts = tree.predict(Xt, beam_size=3, topk=h.K)
        want, _ = PR.rerank(cand, ts, PR.candidate_scores(h.encode(Xt), h.weights["Z"], cand), w)
        assert labels == [[int(x) for x in r if x >= 0] for r in want[:, :5]]
        if w == 1.0:
            tlab, _ = tree.predict(Xt, beam_size=3, topk=5)
            assert labels == [[int(x) for x in r if x >= 0] for r in tlab]
        else:   # mixing changes some order on this set (else the test could not tell)
            tlab, _ = tree.predict(Xt, beam_size=3, topk=5)
            assert labels != [[int(x) for x in r if x >= 0] for r in tlab]


def test_head_round_trips_through_the_prime_table_and_the_folder(trained, spark, tmp_path):
    _, head, facts, _, Xt, _ = trained
    back = stage.head_from_table(spark.createDataFrame(stage.head_frame(head)), facts)
    assert (back.mode, back.K, back.weight) == (head.mode, head.K, head.weight)
    for k in ("E", "Z"):
        np.testing.assert_array_equal(back.weights[k], head.weights[k])
    head.save(tmp_path)
    loaded = prime_model.PrimeHead.load(tmp_path)
    np.testing.assert_array_equal(loaded.encode(Xt), head.encode(Xt))
    assert prime_model.PrimeHead.load(tmp_path / "nothing") is None


def test_mode_off_only_records_itself_and_predicts_with_the_tree(trained, spark, tmp_path):
    from xmc_spark.pipeline import prime_head, prime_stage
    from xmc_spark.registry import STAGES
    from xmc_spark.runner import StageContext, StageTimer
    from xmc_spark.tracking import Tracker
    tree, head, _, _, _, _ = trained
    head.save(tmp_path)                                  # a prime/ left by an earlier run
    params = PipelineParams()
    assert params.prime.mode == "off"
    ctx = StageContext(spark, STAGES["prime"], params, None, {}, StageTimer(0), Tracker(params.mlflow, enabled=False),
                       model_dir=str(tmp_path))
    assert prime_stage(ctx).facts == {"prime.mode": "off"}
    assert not (tmp_path / "prime").exists()
    ctx.records["prime"] = {"prime.mode": "off"}
    assert prime_head(ctx) is None
    assert prime_model.with_head(tree, prime_head(ctx)) is tree        # predict runs the tree alone


# ---- PRIME over a sharded tree (a model above predict.max_broadcast_mb) ------------------------

def _no_weights_shipped(monkeypatch):
    """The values broadcast from now on (a list filled as Spark broadcasts them)."""
    from pyspark import SparkContext
    shipped, real = [], SparkContext.broadcast
    monkeypatch.setattr(SparkContext, "broadcast", lambda self, v: shipped.append(v) or real(self, v))
    return shipped


def _weights_in(shipped):
    from xmc_spark.model import KeyedColumns
    return [v for v in shipped if isinstance(v, (XMCModel, KeyedColumns, prime_model.PrimedModel))]


def test_prime_over_a_sharded_tree_equals_the_broadcast_tree_and_ships_no_weights(trained, spark, monkeypatch):
    from tests.stages.conftest import as_sharded
    tree, head, _, test, _, _ = trained
    sm = as_sharded(spark, tree)
    for h in (dataclasses.replace(head, weight=0.3), dataclasses.replace(head, mode="retrieve")):
        want, want_sc = _collect(prediction.run(test, prime_model.PrimedModel(tree, h), 3, 5))
        shipped = _no_weights_shipped(monkeypatch)
        got, got_sc = _collect(prediction.run(test, prime_model.PrimedModel(sm, h), 3, 5))
        assert got == want and len(got) == N_TEST
        np.testing.assert_allclose(np.concatenate(got_sc), np.concatenate(want_sc), rtol=1e-5, atol=1e-6)
        assert not _weights_in(shipped) and any(isinstance(v, prime_model.PrimeHead) for v in shipped)
        monkeypatch.undo()


def test_stage_shortlists_and_trains_on_a_sharded_tree(trained, spark, monkeypatch):
    from tests.stages.conftest import as_sharded
    tree, _, _, _, _, prm = trained
    X, Y = _synth(0, N_TRAIN)
    samples = samples_frame(spark, X, Y, partitions=2)
    sm = as_sharded(spark, tree)
    whole = sorted((r["sample_id"], list(r["cand"])) for r in stage.shortlist(samples, tree, 3, 7).collect())
    got = sorted((r["sample_id"], list(r["cand"])) for r in stage.shortlist(samples, sm, 3, 7).collect())
    assert got == whole and len(got) == N_TRAIN
    counts = np.asarray((Y > 0).sum(axis=0)).ravel()
    # the whole tree on rows in other partitions: the order they stream in must not depend on it
    want, want_facts = stage.run(samples.repartition(5), tree, counts, prm, N_TRAIN, D, L, beam_size=3,
                                 val_tree_fit=lambda df: tree)
    shipped = _no_weights_shipped(monkeypatch)
    head, facts = stage.run(samples, sm, counts, prm, N_TRAIN, D, L, beam_size=3, val_tree_fit=lambda df: sm)
    assert not _weights_in(shipped)
    # the same model: the rows stream in an order of the data, not of the plan or the layout
    np.testing.assert_allclose(facts["prime.loss"], want_facts["prime.loss"], rtol=1e-5)
    assert (facts["prime.epoch"], facts["prime.val_retrieve_mean_p"]) == (want_facts["prime.epoch"],
                                                                         want_facts["prime.val_retrieve_mean_p"])
    np.testing.assert_allclose(head.weights["Z"], want.weights["Z"], atol=1e-5)
    assert head.weight == want.weight and facts["prime.n_held_out"] == want_facts["prime.n_held_out"]


def test_predict_from_a_chunked_folder_with_prime_keeps_the_tree_sharded(trained, spark, tmp_path, monkeypatch):
    """`xmc-spark predict` of a folder whose weights exceed predict.max_broadcast_mb and that holds
    prime/: the tree sharded, PRIME applied, the same predictions as the whole model; the pyfunc's
    loader (no Spark) reads the same folder whole."""
    from tests.conftest import write_xc
    from xmc_spark import pipeline
    from xmc_spark.stages import sharded
    tree, head, _, _, Xt, _ = trained
    Yt = _synth(N_TRAIN, N_TEST)[1]
    h = dataclasses.replace(head, weight=0.3)
    folder = tmp_path / "m"
    tree.save(str(folder), parts=2)
    h.save(folder)
    write_xc(tmp_path / "test.txt", Xt * 2.0, Yt)                 # raw rows: ingest normalizes
    params = PipelineParams()
    tight = dataclasses.replace(params, predict=dataclasses.replace(params.predict, max_broadcast_mb=1e-4))
    loaded = pipeline.load_model(spark, str(folder), tight)
    assert isinstance(loaded, prime_model.PrimedModel) and isinstance(loaded.tree, sharded.ShardedModel)
    shipped = _no_weights_shipped(monkeypatch)
    out = pipeline.predict(spark, str(folder), str(tmp_path / "test.txt"), str(tmp_path / "out"), tight)
    assert not _weights_in(shipped)
    beam, topk = params.predict.beam_size, params.predict.topk
    for table, model in (("predictions", prime_model.PrimedModel(tree, h)), ("tree_predictions", tree)):
        labels, _ = model.predict(Xt, beam_size=beam, topk=topk)
        rows = sorted(spark.read.format("delta").load(str(tmp_path / "out" / "tables" / table)).collect(),
                      key=lambda r: r["sample_id"])
        assert [list(r["pred_labels"]) for r in rows] == [[int(x) for x in r if x >= 0] for r in labels]
    assert out["p@1"] != out["tree_p@1"] or out["p@3"] != out["tree_p@3"]
    pyfunc = prime_model.load(folder)
    np.testing.assert_array_equal(pyfunc.predict(Xt, beam_size=beam, topk=topk)[0],
                                  prime_model.PrimedModel(tree, h).predict(Xt, beam_size=beam, topk=topk)[0])


def test_prime_over_a_sharded_ensemble_equals_the_broadcast_ensemble(trained, spark, monkeypatch):
    """Two trees (branching 2 and 3) kept sharded, PRIME re-ranking their mean scores: the same as
    the broadcast ensemble with the same head; with_tree gives the ensemble's own top k beside."""
    from tests.stages.conftest import ensemble_frame
    from xmc_spark.model import EnsembleModel, ModelTrainParams
    from xmc_spark.stages import sharded
    _, head, _, test, Xt, _ = trained
    X, Y = _synth(0, N_TRAIN)
    e = EnsembleModel.train_local(X, Y, ModelTrainParams(tree=TreeParams(max_leaf_size=4, ensemble_splits=[2, 3])))
    frame = ensemble_frame(spark, e)
    se = sharded.sharded_model(e.index, frame, e.n_features, e.bias, e.normalize, e.pred_params,
                               sharded.tree_nbytes(frame))
    assert isinstance(se, sharded.ShardedEnsemble)
    h = dataclasses.replace(head, weight=0.3)
    shipped = _no_weights_shipped(monkeypatch)
    preds, tree_preds = stage.with_tree(test, prime_model.PrimedModel(se, h), 3, 5)
    got, got_sc = _collect(preds)
    assert not _weights_in(shipped) and not [v for v in shipped if isinstance(v, EnsembleModel)]
    want, want_sc = prime_model.PrimedModel(e, h).predict(Xt, beam_size=3, topk=5)
    assert got == [[int(x) for x in r if x >= 0] for r in want]
    np.testing.assert_allclose(np.concatenate(got_sc), want_sc[want >= 0], rtol=1e-5, atol=1e-6)
    tl, _ = e.predict(Xt, beam_size=3, topk=5)
    assert _collect(tree_preds)[0] == [[int(x) for x in r if x >= 0] for r in tl]


def test_a_row_the_sharded_search_gives_no_candidate_keeps_its_place(trained, spark):
    """The candidates come by a join: a row without any (the ensemble's mean of exactly 0, say)
    is still predicted (with nothing to re-rank), as the broadcast path writes it."""
    from tests.stages.conftest import as_sharded
    tree, head, _, test, _, _ = trained
    h = dataclasses.replace(head, weight=0.3)
    sm = as_sharded(spark, tree)
    cand = stage.shortlist(test, sm, 3, h.K).filter("sample_id != 0")
    labels, _ = _collect(stage.predict_sharded(test, prime_model.PrimedModel(sm, h), 3, 5, cand))
    full, _ = _collect(prediction.run(test, prime_model.PrimedModel(tree, h), 3, 5))
    assert len(labels) == N_TEST and labels[0] == [] and labels[1:] == full[1:]



# ---- prime.label_features: h_l from the user's label features --------------------------------
def _label_feats(seed=11):
    """L x D label features with every row non-empty (a text row without features is a blank line)."""
    F = sp.random(L, D, density=0.05, random_state=seed, format="csr", dtype=np.float64)
    F = F + sp.csr_matrix((np.ones(L), (np.arange(L), np.arange(L) % D)), shape=(L, D))
    F.data = np.round(F.data, 4) + 0.5
    return F.tocsr()


def _sparse_lines(F, base=0):
    """F's rows as 'index:value' lines (ids from ``base``; an empty row is an empty line)."""
    return [" ".join(f"{j + base}:{v:.6g}" for j, v in zip(F[i].indices, F[i].data)) for i in range(F.shape[0])]


def _write_sparse(path, F, header, extra=None):
    """An XC sparse-matrix file of F; ``extra`` = (row, token): that token appended to the row's line."""
    rows = _sparse_lines(F)
    if extra is not None:
        rows[extra[0]] += " " + extra[1]
    with open(path, "w") as f:
        f.write("\n".join([header] + rows) + "\n")


def _write_table(spark, path, F, ids):
    """F's rows as a Parquet table without label_idx, row i with sample_id ids[i]."""
    spark.createDataFrame([(int(ids[i]), F[i].indices.tolist(), F[i].data.tolist()) for i in range(F.shape[0])],
                          "sample_id long, feature_idx array<int>, feature_val array<double>").write.parquet(path)


def test_label_features_are_read_from_xc_files_and_tables(spark, tmp_path):
    """Row i is label i's features, from the XC repository's 'rows cols' sparse file (a blank
    line: a label without features), an XC data file (rows without labels), svmlight (1-based
    ids) or a Parquet table without label_idx in any row order; normalized as ingest.normalize
    says. One text file has a value written '1.5f', which only the SQL parser reads."""
    from xmc_spark.params import IngestParams
    F = _label_feats()
    F = (sp.diags((np.arange(L) != 3).astype(float)) @ F).tocsr()     # label 3 without features
    F.eliminate_zeros()

    rows = _sparse_lines(F)
    assert rows[3] == ""
    (tmp_path / "lbl_X_Xf.txt").write_text("\n".join([f"{L} {D}"] + rows) + "\n")
    plus = list(rows)
    plus[0] = plus[0].replace(" ", "f ", 1)                            # '1.5f': only the SQL parser reads it
    (tmp_path / "sql.txt").write_text("\n".join([f"{L} {D}"] + plus) + "\n")
    (tmp_path / "xc.txt").write_text("\n".join([f"{L} {D} 0"] + [" " + r for r in rows]) + "\n")
    (tmp_path / "lf.svm").write_text("\n".join(_sparse_lines(F, base=1)) + "\n")
    perm = np.random.default_rng(0).permutation(L)
    _write_table(spark, str(tmp_path / "lf.parquet"), F[perm], perm)
    norms = np.sqrt(np.asarray(F.multiply(F).sum(axis=1)).ravel())
    unit = sp.diags(1 / np.where(norms > 0, norms, 1)) @ F
    for name in ("lbl_X_Xf.txt", "sql.txt", "xc.txt", "lf.svm", "lf.parquet"):
        for normalize, want in ((False, F), (True, unit)):
            got = stage.read_label_features(spark, str(tmp_path / name), L, D, IngestParams(normalize=normalize))
            assert got.shape == (L, D), name
            np.testing.assert_allclose(got.toarray(), want.toarray(), rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("case, pattern", [
    ("feature_out_of_range", r"FILE:3: feature index 150 out of range \[0, 150\)"),
    ("too_few_rows", r"FILE: 29 rows of label features for 30 labels: no row for label 29 \(row i holds"),
    ("too_many_lines", r"FILE: line 32 is not a label's \(1 row\(s\) beyond the 30 labels of the training set"),
    ("row_not_a_label", r"FILE: the row with sample_id 30 is not a label's \(1 row\(s\) beyond the 30 labels"),
    ("more_features_declared", r"FILE:5: feature index 150 out of range \[0, 150\) \(label features are in the "
                               r"training set's 150 features\)"),
    ("malformed_header", r"FILE:1: malformed header '30' \(expected .* or 'num_rows num_features'\)"),
])
def test_bad_label_features_name_the_file_and_the_row(spark, tmp_path, case, pattern):
    from xmc_spark.params import IngestParams
    from xmc_spark.schemas import IngestError
    F = _label_feats()
    path = str(tmp_path / ("lf.parquet" if case == "row_not_a_label" else "lf.txt"))
    if case == "feature_out_of_range":
        _write_sparse(path, F, f"{L} {D}", extra=(1, f"{D}:1"))          # the file's line 3
    elif case == "too_few_rows":
        _write_sparse(path, F[:-1], f"{L - 1} {D}")
    elif case == "too_many_lines":
        _write_sparse(path, sp.vstack([F, F[:1]]).tocsr(), f"{L + 1} {D}")
    elif case == "more_features_declared":
        _write_sparse(path, F, f"{L} {D + 5}", extra=(3, f"{D}:1"))      # the file's line 5
    elif case == "malformed_header":
        _write_sparse(path, F, f"{L}")
    else:
        _write_table(spark, path, F, np.arange(L) + 1)
    with pytest.raises(IngestError, match=pattern.replace("FILE", re.escape(path))):
        stage.read_label_features(spark, path, L, D, IngestParams())


def test_stage_encodes_h_l_from_the_label_features(trained, spark, monkeypatch):
    """With label features the encoder's h_l input is them (the SVD start still PIFA's), and
    the training differs; given the PIFA rows the stage computes itself, the same model."""
    from xmc_spark.compat import shuffle_partitions
    from xmc_spark.params import EmbeddingParams
    from xmc_spark.stages import label_embedding
    tree, head, facts, _, _, prm = trained
    X, Y = _synth(0, N_TRAIN)
    samples = samples_frame(spark, X, Y, partitions=2)
    counts = np.asarray((Y > 0).sum(axis=0)).ravel()
    fit_rows = samples.filter(~stage.is_held_out(stage.val_fraction(prm, N_TRAIN), prm.seed))
    pifa = stage.label_features(label_embedding.run(fit_rows, EmbeddingParams(), n_features=D, n_labels=L,
                                                    n_buckets=shuffle_partitions(spark)), L, D)
    seen = []
    real = PR.init_from_pifa
    monkeypatch.setattr(PR, "init_from_pifa", lambda Z, kp, lf=None, *a: seen.append((Z, lf)) or real(Z, kp, lf, *a))
    F = _label_feats()
    own, own_facts = stage.run(samples, tree, counts, prm, N_TRAIN, D, L, beam_size=3, val_tree_fit=lambda df: tree,
                               label_feats=F)
    assert seen[0][1] is F and abs(seen[0][0] - pifa).max() < 1e-6        # h_l from F, the SVD from PIFA
    assert own_facts["prime.h_l_input"] == "label_features" and facts["prime.h_l_input"] == "pifa"
    assert own.info["prime.h_l_input"] == "label_features"                    # saved with the head
    assert not np.allclose(own_facts["prime.loss"], facts["prime.loss"], rtol=1e-3)
    same, same_facts = stage.run(samples, tree, counts, prm, N_TRAIN, D, L, beam_size=3,
                                 val_tree_fit=lambda df: tree, label_feats=pifa)
    np.testing.assert_allclose(same_facts["prime.loss"], facts["prime.loss"], rtol=1e-5)
    np.testing.assert_allclose(same.weights["Z"], head.weights["Z"], atol=1e-5)
