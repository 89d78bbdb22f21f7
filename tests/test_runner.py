"""The stage runner: dependency checks from the records, validation before the first write, the
unkeyed and keyed paths giving the same model, concurrent run keys."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from tests.conftest import random_problem, write_split, write_xc
from xmc_spark import pipeline
from xmc_spark import runner as runner_module
from xmc_spark.params import ConfigError, PipelineParams
from xmc_spark.registry import STAGES
from xmc_spark.runner import check_ready, run_keyed, run_stage
from xmc_spark.schemas import IngestError
from xmc_spark.storage import StageOrderError, Tables, is_delta, read_delta

ROOT = Path(__file__).resolve().parents[1]
KA, KB = "2026-01-01", "2026-01-02"


def _params(d):
    return PipelineParams().set_dotted("tree.max_leaf_size", 4).set_dotted("mlflow.enabled", False) \
        .set_dotted("paths.root", str(d / "root"))


@pytest.fixture(scope="module")
def env(tmp_path_factory, spark):
    d = tmp_path_factory.mktemp("runner")
    write_split(d, 120, n=160, d=40, L=12, seed=3)
    params = _params(d)
    res = run_keyed(spark, ["all"], KA, params, str(d / "train.txt"), str(d / "test.txt"))
    return d, params, res


def _weights(spark, path, key=None):
    return sorted((r["is_leaf"], r["key"], tuple(r["w_idx"]), tuple(r["w_val"]))
                  for r in read_delta(spark, path, key).collect())


def _run_stages(spark, d, params, key, stages):
    """``stages`` in order for run key ``key``, a Runner each (no memo between them); ingest
    reads d/train.txt and d/test.txt."""
    for s in stages:
        run_stage(spark, s, key, params, str(d / "train.txt") if s == "ingest" else None,
                  str(d / "test.txt") if s == "ingest" else None)


def _counting_reads(monkeypatch) -> list:
    """The names of the tables read (``Tables.read``) from now until ``monkeypatch.undo()``."""
    reads, read = [], Tables.read

    def counted(self, name):
        reads.append(name)
        return read(self, name)

    monkeypatch.setattr(Tables, "read", counted)
    return reads


SEPARATE = "2026-01-05"


@pytest.fixture(scope="module")
def separate(env, spark):
    """Ingest to train for run key :data:`SEPARATE`, a Runner each: a train stage that reads the
    tree table (the weights the one-process runs below are compared with)."""
    d, params, _ = env
    _run_stages(spark, d, params, SEPARATE, ("ingest", "eagle", "tree", "train"))
    return SEPARATE


@pytest.fixture(scope="module")
def unkeyed(env, spark):
    """`xmc-spark run` on the same data: OUT = d/run."""
    d, params, _ = env
    return pipeline.run(spark, str(d / "train.txt"), str(d / "test.txt"), str(d / "run"), params)


def test_run_and_stage_all_give_identical_weights_and_metrics(env, unkeyed, spark):
    d, params, res = env
    m = unkeyed
    assert _weights(spark, str(d / "run" / "tables" / "weights")) == \
        _weights(spark, str(d / "root" / "tables" / "weights"), KA)
    for k in ("p@1", "p@3", "p@5", "psp@5", "ndcg@5", "depth@1"):
        assert m[k] == res["evaluate"][k], k
    assert m["n_train"] == 120 and m["n_test"] == 40 and m["tree_depth"] == res["train"]["tree_depth"]
    on_disk = json.loads((d / "run" / "metrics.json").read_text())
    assert on_disk["p@1"] == m["p@1"] and on_disk["table_versions"] == {"train": 0, "test": 0}


def test_overlapping_clusters_equal_the_reference_trainer(env, spark, monkeypatch):
    """train_local covers the whole model: tree, classifiers, overlapping clusters, retraining.
    Both trainings size the auto node bound from ingest's count of non-zeros (no aggregation)."""
    from xmc_spark.local_io import read_xc
    from xmc_spark.model import XMCModel
    from xmc_spark.stages import node_training
    d, params, _ = env
    p2 = params.set_dotted("clusters.copies", 2).set_dotted("clusters.beam_size", 2)
    given, bound = [], node_training.node_row_bound
    monkeypatch.setattr(node_training, "node_row_bound",
                        lambda *a, **k: given.append(a[5]) or bound(*a, **k))      # a[5]: row_nnz
    m = pipeline.run(spark, str(d / "train.txt"), str(d / "test.txt"), str(d / "copies2"), p2)
    assert given == [m["n_train_nonzeros"] / m["n_train"]] * 2
    assert m["copies_per_label_max"] == 2
    assert m["n_labels"] < m["n_slots"] <= 2 * m["n_labels"]
    Xtr, Ytr = read_xc(str(d / "train.txt"))
    Xt, _ = read_xc(str(d / "test.txt"))
    ref = XMCModel.train_local(Xtr, Ytr, XMCModel.TrainParams.from_pipeline(p2), p2.predict)
    got = XMCModel.load(str(d / "copies2" / "model"))
    np.testing.assert_array_equal(got.index.slot_label, ref.index.slot_label)
    np.testing.assert_array_equal(got.index.slot_leaf, ref.index.slot_leaf)
    assert m["n_slots"] == len(got.index.slot_label)
    (gl, gs), (rl, rs) = got.predict(Xt), ref.predict(Xt)
    np.testing.assert_array_equal(gl, rl)
    np.testing.assert_allclose(gs, rs, rtol=1e-5)


def _records(n_features=40, n_labels=12, test="t.txt"):
    chain = {"ingest": {"n_train": 120, "n_features": n_features, "n_labels": n_labels, "n_test": 40, "test": test,
                        "train": "x", "aggregated": False}, "eagle": {"skipped": True}, "tree": {}, "train": {},
             "prime": {"prime.mode": "off"}, "knn": {"knn.mode": "off"}}
    out, prev = {}, None
    for name, facts in chain.items():
        out[name] = {**facts, "commit": name, "tables": {}, "basis": {prev: prev} if prev else {}}
        prev = name
    return out


@pytest.mark.parametrize("stage,table,bad", [
    ("tree", "train", "sample_id long, feature_idx array<int>, label_idx array<int>, weight float"),
    ("train", "tree", "label_idx int, node string"),
    ("predict", "weights", "is_leaf boolean, key long, w_idx array<long>, w_val array<float>"),
])
def test_a_wrong_schema_table_stops_the_stage_naming_table_and_column(env, unkeyed, spark, tmp_path, stage, table,
                                                                     bad):
    from xmc_spark.runner import Runner
    from xmc_spark.schemas import SchemaError
    d, params, _ = env
    good = d / "run" / "tables"
    spark.createDataFrame([], bad).write.format("delta").save(str(tmp_path / "bad"))
    links = {t: str(good / t) for t in ("train", "test", "tree", "slots", "weights")}
    links[table] = str(tmp_path / "bad")
    upto = {"tree": "eagle", "train": "tree", "predict": "knn"}[stage]
    recs = {k: v for k, v in _records().items() if list(_records()).index(k) <= list(_records()).index(upto)}
    runner = Runner(spark, params, str(tmp_path / "root"), links=links, records=recs)
    with pytest.raises(SchemaError, match=f"table '{table}': "):
        runner.run(stage)
    bad_col = {"tree": "missing column 'feature_val'", "train": "column 'node' has type string",
               "predict": "column 'w_idx' has type array<bigint>"}[stage]
    with pytest.raises(SchemaError, match=bad_col):
        runner.run(stage)


def test_re_rankers_check_the_run_keys_records_before_any_work(env, unkeyed, spark, tmp_path):
    """A keyed knn stage stacked on the key's PRIME with another held-out split, a keyed predict
    stage whose knn record and prime record disagree on stacking, or a re-ranker whose held-out
    model would be trained with other settings than the train stage's, stops naming the reason."""
    from xmc_spark.runner import Runner
    d, params, _ = env
    good = d / "run" / "tables"
    links = {t: str(good / t) for t in ("train", "test", "tree", "slots", "weights")}
    recs = {k: v for k, v in _records().items() if k != "knn"}
    recs["prime"] = {**recs["prime"], "prime.mode": "rerank", "prime.val_frac": 0.3}
    runner = Runner(spark, params.set_dotted("knn.mode", "rerank"), str(tmp_path / "a"), links=links, records=recs)
    with pytest.raises(ConfigError, match="prime.val_frac is 0.1, the prime stage of this run used 0.3"):
        runner.run("knn")
    recs = _records()
    recs["knn"] = {**recs["knn"], "knn.mode": "rerank", "knn.K": 10, "knn.on_prime": True}
    with pytest.raises(ConfigError, match="the knn stage of this run key was stacked on PRIME, and the prime stage's "
                                          "record says prime.mode=off"):
        Runner(spark, params, str(tmp_path / "p"), links=links, records=recs).run("predict")
    recs = {k: v for k, v in _records().items() if k != "knn"}
    recs["train"] = {**recs["train"], "model_config": pipeline.model_config(params)}
    changed = params.set_dotted("knn.mode", "rerank").set_dotted("train.C", 0.5)
    with pytest.raises(ConfigError, match="differ from those the train stage of this run used"):
        Runner(spark, changed, str(tmp_path / "b"), links=links, records=recs).run("knn")
    recs = {k: v for k, v in _records().items() if k not in ("prime", "knn")}
    recs["train"] = {**recs["train"], "model_config": pipeline.model_config(params)}
    with pytest.raises(ConfigError, match="differ from those the train stage of this run used"):
        Runner(spark, changed.set_dotted("knn.mode", "off").set_dotted("prime.mode", "rerank"), str(tmp_path / "c"),
               links=links, records=recs).run("prime")


def test_check_ready_from_records():
    ok = {"ingest": {"commit": "i1", "basis": {}, "test": "t.txt"},
          "eagle": {"commit": "e1", "basis": {"ingest": "i1"}},
          "tree": {"commit": "t1", "basis": {"eagle": "e1"}},
          "train": {"commit": "m1", "basis": {"tree": "t1"}},
          "prime": {"commit": "p1", "basis": {"train": "m1"}},
          "knn": {"commit": "k1", "basis": {"prime": "p1"}}}
    check_ready(STAGES["predict"], ok, "here")
    with pytest.raises(StageOrderError, match="stage 'predict' needs the output of stage 'knn' for here"):
        check_ready(STAGES["predict"], {k: v for k, v in ok.items() if k != "knn"}, "here")
    with pytest.raises(StageOrderError, match="stage 'predict' needs the output of stage 'prime' for here"):
        check_ready(STAGES["predict"], {k: v for k, v in ok.items() if k != "prime"}, "here")
    with pytest.raises(StageOrderError, match="needs the output of stage 'tree' for here"):
        check_ready(STAGES["train"], {k: ok[k] for k in ("ingest", "eagle")}, "here")
    stale = {**ok, "tree": {"commit": "t2", "basis": {"eagle": "e1"}}}      # tree reran after train
    with pytest.raises(StageOrderError, match="stage 'train' for here predates the last run of stage 'tree'"):
        check_ready(STAGES["predict"], stale, "here")
    with pytest.raises(ConfigError, match="ingested without --test"):
        check_ready(STAGES["predict"], {**ok, "ingest": {**ok["ingest"], "test": None}}, "here")


def test_predict_and_evaluate_need_train_for_their_own_key(env, spark):
    d, params, _ = env
    run_stage(spark, "ingest", KB, params, str(d / "train.txt"), str(d / "test.txt"))   # KA is trained
    run_stage(spark, "eagle", KB, params)
    for stage in ("predict", "evaluate"):
        with pytest.raises(StageOrderError, match=f"stage '{stage}' needs the output of stage 'tree' for run key "
                                                  f"{KB}"):
            run_stage(spark, stage, KB, params)
    assert read_delta(spark, str(d / "root" / "tables" / "predictions"), KB).count() == 0


def test_one_process_never_reads_the_tree_table_back(env, separate, spark, monkeypatch, tmp_path):
    """In one process the tree stage collects its index from the rows it committed (its
    checkpoint) and the train stage takes that index (ctx.memo): neither reads the tree table, and
    both record the tree's version as read (the MLflow tags table_version.tree.tree and
    table_version.train.tree); the weights equal those of stages run in a Runner each, whose
    train stage reads the table. Nor is the label_embeddings table read back (its version recorded)
    when ``embedding.write_table`` asks for it; by default (the separate stages) it is not written,
    and the tree is the same."""
    d, params, _ = env
    logged, log_result = {}, runner_module.log_result

    def kept(tracker, name, result, stage_reads):
        logged[name] = dict(stage_reads)
        return log_result(tracker, name, result, stage_reads)

    reads = _counting_reads(monkeypatch)
    monkeypatch.setattr(runner_module, "log_result", kept)
    pipeline.run(spark, str(d / "train.txt"), str(d / "test.txt"), str(tmp_path / "run"),
                 params.set_dotted("embedding.write_table", True))
    monkeypatch.undo()
    assert reads.count("tree") == 0
    assert logged["train"]["tree"] == logged["tree"]["tree"] == 0
    # the tree grows from the PIFA rows the stage kept, not from the table it wrote (version recorded)
    assert reads.count("label_embeddings") == 0 and logged["tree"]["label_embeddings"] == 0
    train = read_delta(spark, str(tmp_path / "run" / "tables" / "train"))
    assert read_delta(spark, str(tmp_path / "run" / "tables" / "label_embeddings")).count() == \
        train.selectExpr("explode(label_idx)").distinct().count()          # a row per label with samples
    assert _weights(spark, str(tmp_path / "run" / "tables" / "weights")) == \
        _weights(spark, str(d / "root" / "tables" / "weights"), separate)
    # the separate stages ran with the default: no table, and the same tree
    assert not is_delta(spark, str(d / "root" / "tables" / "label_embeddings"))
    assert sorted(map(tuple, read_delta(spark, str(tmp_path / "run" / "tables" / "tree")).collect())) == \
        sorted(map(tuple, read_delta(spark, str(d / "root" / "tables" / "tree"), separate).collect()))
    # the tree grown again there without the table: the rows left by the run above would describe
    # another tree, so they are removed
    tables = Tables(spark, str(tmp_path / "run" / "tables"))
    pipeline.grow_tree(tables.read("train"), tables, 40, 12, params, runner_module.StageTimer())
    assert read_delta(spark, str(tmp_path / "run" / "tables" / "label_embeddings")).count() == 0


def test_the_train_stage_reads_the_tree_table_when_the_memo_is_of_another_version(env, separate, spark,
                                                                                     monkeypatch, tmp_path):
    """The tree stage's index in ``ctx.memo`` is used only for the tree table's version the train
    stage pins: an index recorded for another version is left, and the table is read."""
    d, params, _ = env

    class Stale:
        """An index that must not be used."""
        def __getattr__(self, name):
            raise AssertionError(f"the train stage used a memo index of another tree version (.{name})")

    tree_stage = pipeline.tree_stage

    def stale_memo(ctx):
        result = tree_stage(ctx)
        version, _ = ctx.memo["tree_index"]
        ctx.memo["tree_index"] = (version + 1, Stale())
        return result

    reads = _counting_reads(monkeypatch)
    monkeypatch.setattr(pipeline, "tree_stage", stale_memo)
    pipeline.run(spark, str(d / "train.txt"), str(d / "test.txt"), str(tmp_path / "run"), params)
    monkeypatch.undo()
    assert reads.count("tree") == 1                          # the train stage's
    assert _weights(spark, str(tmp_path / "run" / "tables" / "weights")) == \
        _weights(spark, str(d / "root" / "tables" / "weights"), separate)


def test_a_rerun_upstream_invalidates_the_stages_after_it(env, spark, monkeypatch):
    d, params, _ = env
    key = "2026-01-03"
    _run_stages(spark, d, params, key, ("ingest", "eagle", "tree", "train", "prime", "knn", "predict"))
    run_stage(spark, "tree", key, params)
    with pytest.raises(StageOrderError, match="stage 'predict' needs the output of stage 'train'"):
        run_stage(spark, "predict", key, params)
    with pytest.raises(StageOrderError, match="stage 'evaluate' needs the output of stage 'train'"):
        run_stage(spark, "evaluate", key, params)
    # a first train killed after its weights: predict asks for train, no Delta traceback
    write = Tables.write

    def killed(self, name, df, where=None):
        if name == "slots":
            raise KeyboardInterrupt("killed")
        return write(self, name, df, where)

    key2 = "2026-01-04"
    _run_stages(spark, d, params, key2, ("ingest", "eagle", "tree"))
    monkeypatch.setattr(Tables, "write", killed)
    with pytest.raises(KeyboardInterrupt):
        run_stage(spark, "train", key2, params)
    monkeypatch.undo()
    with pytest.raises(StageOrderError, match="stage 'predict' needs the output of stage 'train' for run key "
                                              f"{key2}"):
        run_stage(spark, "predict", key2, params)


def test_bad_test_input_writes_no_table(tmp_path, spark):
    d = tmp_path
    write_split(d, 120, n=160, d=40, L=12, seed=3)
    params = _params(d)
    (d / "header_only.txt").write_text("3 40 12\n")
    (d / "bad_label.txt").write_text("1 40 12\n13 1:1\n")
    for bad, msg in (("header_only.txt", "no samples"), ("bad_label.txt", ":2: label id 13 out of range")):
        with pytest.raises(IngestError, match=msg):
            run_stage(spark, "ingest", KA, params, str(d / "train.txt"), str(d / bad))
        for table in ("train", "test", "stage_info"):
            assert not is_delta(spark, str(d / "root" / "tables" / table)), (bad, table)
    (d / "empty.txt").write_text("")
    with pytest.raises(IngestError, match="the file is empty"):
        pipeline.run(spark, str(d / "train.txt"), str(d / "empty.txt"), str(d / "out"), params)
    assert not (d / "out" / "tables" / "train").exists()


def test_test_labels_unseen_in_training_are_counted_misses(env, unkeyed, spark):
    from xmc_spark.local_io import read_xc
    d, params, _ = env
    X, Y = read_xc(str(d / "test.txt"))
    lines = (d / "test.txt").read_text().splitlines()
    lines[0] = f"{X.shape[0]} 40 200"                       # the header declares 200 labels
    lines[1] = "170," + lines[1] if not lines[1].startswith(" ") else "170" + lines[1]
    (d / "test200.txt").write_text("\n".join(lines) + "\n")
    m = pipeline.run(spark, str(d / "train.txt"), str(d / "test200.txt"), str(d / "out200"), params)
    assert (m["test_unseen_labels"], m["test_unseen_positives"], m["test_rows_with_unseen"]) == (1, 1, 1)
    base = unkeyed
    # the one extra positive is a miss: P@k unchanged, recall of that row lower
    for k in ("p@1", "p@3", "p@5"):
        assert m[k] == base[k], k
    assert m["recall@5"] < base["recall@5"] and base["test_unseen_labels"] == 0
    assert json.loads((d / "out200" / "metrics.json").read_text())["test_unseen_labels"] == 1


def test_eagle_stops_when_its_aggregated_input_changed_since_ingest(tmp_path, spark):
    # stage jobs in separate processes read the aggregated folder again; the later stages size
    # their work by ingest's record (e.g. the trainer's sample count), so a grown input must stop
    # the eagle stage, before it writes anything
    X, _ = random_problem(n=40, d=20, L=6, seed=4)
    X = X[np.flatnonzero(X.getnnz(axis=1) > 0)[:31]]                   # no blank sample line
    agg = tmp_path / "agg"
    agg.mkdir()
    write_xc(agg / "samples.txt", X[:30], sp.csr_matrix((30, 6)))
    (agg / "groups.txt").write_text("".join(f"{g % 6} {3 * g} {3 * g + 1} {3 * g + 2}\n" for g in range(10)))
    params = _params(tmp_path).set_dotted("eagle.T", 2)
    run_stage(spark, "ingest", KA, params, str(agg))
    write_xc(agg / "samples.txt", X, sp.csr_matrix((31, 6)))          # one more sample, in no group
    with pytest.raises(IngestError, match=r"agg: the aggregated input \(or the ingest settings it is read with\) "
                                          r"changed since stage ingest validated it \(samples 30 -> 31\): "
                                          r"run stage ingest again"):
        run_stage(spark, "eagle", KA, params)
    assert not is_delta(spark, str(tmp_path / "root" / "tables" / "train"))
    write_xc(agg / "samples.txt", X[:30], sp.csr_matrix((30, 6)))      # as ingest saw it
    with pytest.raises(IngestError, match=r"\(features 20 -> 30\)"):      # but read with other settings
        run_stage(spark, "eagle", KA, params.set_dotted("ingest.num_features", 30))
    assert run_stage(spark, "eagle", KA, params)["eagle.assigned_pairs"] >= 10


# ~2.5 min (two ingest processes, each a JVM, on 2 cores): on demand, to keep CI under its 30
# minutes; CI runs two writers at once on one fresh table in tests/test_storage.py
@pytest.mark.slow
@pytest.mark.on_demand
def test_two_keys_ingest_at_once_into_a_fresh_root(tmp_path, spark):
    write_split(tmp_path, 120, n=160, d=40, L=12, seed=3)
    root = tmp_path / "root"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "xmc_spark.cli", "stage", "ingest", "--run-key", key, "--train",
         str(tmp_path / "train.txt"), "--test", str(tmp_path / "test.txt"), "--root", str(root),
         "--set", "spark.master=local[1]", "--set", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
         "--set", f"mlflow.artifact_location={tmp_path}/artifacts"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for key in (KA, KB)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    for table, n in (("train", 120), ("test", 40)):
        counts = {r["run_key"]: r["count"] for r in
                  read_delta(spark, str(root / "tables" / table)).groupBy("run_key").count().collect()}
        assert counts == {KA: n, KB: n}, table
    stages = {(r["run_key"], r["stage"]) for r in read_delta(spark, str(root / "tables" / "stage_info")).collect()}
    assert stages == {(KA, "ingest"), (KB, "ingest")}
