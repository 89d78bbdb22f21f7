"""The real CLI end to end: subprocesses (a fresh JVM each, as a user runs it) for the bibtex run,
exit codes and params; main() in this process on the test session for the longer commands."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, cwd=None, env=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "xmc_spark.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1200)


def main_in_process(*args):
    """The CLI's main() in this process, on the test session (which it leaves running): for
    tests that exercise a command's logic rather than the process (those use ``cli``)."""
    from xmc_spark.cli import main
    return main(list(args))


def test_run_and_predict_on_bibtex(bibtex, tmp_path, spark, monkeypatch, capfd, caplog):
    """`run` on bibtex, in this process (the CLI's main on the test session: a fresh process costs
    ~1-2 min of CI time here). Exit codes and stderr of a process are checked by the broken
    folders below and the bad-config runs; a successful job process by the spark-submit ingest
    job in tests/jobs/test_airflow_dag.py."""
    out = tmp_path / "run"
    conf = tmp_path / "env.yaml"          # a secret from the environment: used, never logged
    conf.write_text("spark:\n  app_name: xmc-${XMC_TEST_TOKEN}\n")
    monkeypatch.setenv("XMC_TEST_TOKEN", "tok-5ecret-77")
    monkeypatch.chdir(tmp_path)
    assert main_in_process("run", "--train", str(bibtex / "train.txt"), "--test", str(bibtex / "test.txt"),
                           "--out", str(out), "--config", str(conf),
                           "--set", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlruns/mlflow.db",
                           "--set", f"mlflow.artifact_location={tmp_path}/mlruns/artifacts") == 0
    logged = capfd.readouterr()
    assert "tok-5ecret-77" not in logged.err + logged.out + caplog.text + (out / "config.yaml").read_text()
    m = json.loads((out / "metrics.json").read_text())
    for k in ["p@1", "p@3", "p@5", "ndcg@1", "ndcg@3", "ndcg@5", "psp@1", "psp@3", "psp@5", "n_train", "n_test",
              "n_labels", "seconds"]:
        assert k in m, k
    assert m["n_train"] == 4880 and m["n_test"] == 2515 and m["n_labels"] == 159
    assert m["p@1"] >= 62.5 and m["p@3"] >= 38.0 and m["p@5"] >= 27.6   # PECOS: 63.18 / 38.53 / 28.10
    # the label embedding runs inside the tree's plan (no embedding step: embedding.write_table is off)
    assert {"ingest", "tree", "train", "predict", "evaluate", "total"} <= set(m["seconds"])
    assert "embedding" not in m["seconds"] and not (out / "tables" / "label_embeddings").exists()
    assert (out / "model" / "param.json").is_file()

    # the MLflow run holds params, metrics and the model folder
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run = mlflow.get_run(m["mlflow_run_id"])
    assert run.data.params["tree.max_leaf_size"] == "100"
    assert run.data.params["spark.app_name"] == "xmc-***"
    assert abs(run.data.metrics["p_at_1"] - m["p@1"]) < 1e-6
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"metrics.json", "config.yaml"} <= arts
    assert run.data.params["table_version.train"] == "0"

    # the pyfunc model is registered under the configured name, alias -> this run
    version = mlflow.MlflowClient().get_model_version_by_alias("xmc-spark", "candidate")
    assert version.run_id == run.info.run_id

    # predict with the saved model reproduces the run's metrics
    assert main_in_process("predict", "--model", str(out / "model"), "--data", str(bibtex / "test.txt"), "--out",
                           str(tmp_path / "pred"), "--set", "mlflow.enabled=false") == 0
    pm = json.loads((tmp_path / "pred" / "metrics.json").read_text())
    assert pm["p@1"] == pytest.approx(m["p@1"]) and pm["p@5"] == pytest.approx(m["p@5"])

    # a broken model folder: exit 2 and the file at fault, before Spark starts, no traceback
    import shutil
    for case, breaks in (("no-nodes", lambda f: (f / "weights_nodes.npz").unlink()),
                         ("truncated", lambda f: (f / "weights_slots.npz").write_bytes(
                             (f / "weights_slots.npz").read_bytes()[:100])),
                         ("no-param", lambda f: (f / "param.json").unlink())):
        broken = tmp_path / case
        shutil.copytree(out / "model", broken)
        breaks(broken)
        r = cli("predict", "--model", str(broken), "--data", str(bibtex / "test.txt"), "--out",
                str(tmp_path / f"pred-{case}"))
        assert r.returncode == 2 and "xmc-spark: error: " in r.stderr and str(broken) in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr


# ~2 min (the whole bibtex pipeline twice): on demand, to keep CI under its 30 minutes;
# CI checks `run` = `stage all` on a toy set (tests/test_runner.py)
@pytest.mark.on_demand
def test_stage_all_equals_run_on_bibtex(bibtex, tmp_path, spark):
    out = tmp_path / "run"
    assert main_in_process("run", "--train", str(bibtex / "train.txt"), "--test", str(bibtex / "test.txt"),
                           "--out", str(out), "--set", "mlflow.enabled=false") == 0
    m = json.loads((out / "metrics.json").read_text())
    # `stage all` (run-keyed tables) goes through the same stages: byte-identical weights, same metrics
    key = "2026-11-26"
    assert main_in_process("stage", "all", "--run-key", key, "--train", str(bibtex / "train.txt"), "--test",
                           str(bibtex / "test.txt"), "--root", str(tmp_path / "root"), "--set",
                           "mlflow.enabled=false") == 0
    from xmc_spark.storage import read_delta

    def weights(path, k=None):
        return sorted((r["is_leaf"], r["key"], bytes(np.asarray(r["w_idx"], np.int32)),
                       bytes(np.asarray(r["w_val"], np.float32))) for r in read_delta(spark, path, k).collect())

    assert weights(str(out / "tables" / "weights")) == weights(str(tmp_path / "root" / "tables" / "weights"), key)
    staged = {r["metric"]: r["value"] for r in read_delta(spark, str(tmp_path / "root" / "tables" / "metrics"),
                                                          key).collect()}
    for k in ("p@1", "p@3", "p@5", "psp@5", "ndcg@5"):
        assert staged[k] == m[k], k


def test_bad_input_and_bad_config_exit_2(tmp_path, spark, capfd, caplog):
    bad = tmp_path / "bad.txt"
    bad.write_text("2 5 4\n0 1:1\n1 2:1 7:1\n")
    # found by Spark's tasks (in this process: the exit code and message paths are the ones the
    # two processes below take)
    assert main_in_process("run", "--train", str(bad), "--out", str(tmp_path / "o"),
                           "--set", "mlflow.enabled=false") == 2
    err = capfd.readouterr().err                     # Python's and the JVM's stderr
    assert f"{bad}:3: feature index 7 out of range [0, 5)" in err
    assert "Traceback" not in err + caplog.text
    assert not (tmp_path / "o" / "tables" / "train").exists()
    r = cli("run", "--train", str(bad), "--out", str(tmp_path / "o"), "--set", "tree.max_leaf_size=abc")
    assert r.returncode == 2 and "tree.max_leaf_size" in r.stderr and "integer" in r.stderr
    env = {k: "" for k in ("HADOOP_CONF_DIR", "YARN_CONF_DIR")}
    r = cli("run", "--train", str(bad), "--out", str(tmp_path / "o"), "--set", "spark.master=yarn", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "spark.master=yarn needs HADOOP_CONF_DIR or YARN_CONF_DIR" in r.stderr


def test_params_skeleton_round_trips(tmp_path):
    r = cli("params")
    assert r.returncode == 0
    f = tmp_path / "c.yaml"
    f.write_text(r.stdout)
    r2 = cli("params", "--config", str(f), "--set", "tree.max_leaf_size=7")
    assert r2.returncode == 0 and "max_leaf_size: 7" in r2.stdout


# on demand, to keep CI under its 30 minutes: the plain variant (25-45 s) because `run` with overlapping
# clusters is also run by the ensemble test below (clusters.copies=2, checked against the reference), by
# tests/test_runner.py (against the reference trainer) and by tests/test_schemas.py (stage all); the
# distributed-solver variant (~90 s, TRON's Spark jobs in both trainings) because
# tests/stages/test_node_training.py checks the solver's vectors in files
@pytest.mark.on_demand
@pytest.mark.parametrize("big_nodes", [False, True])
def test_run_with_overlapping_clusters(tmp_path, spark, big_nodes):
    """Overlapping clusters; with ``big_nodes`` the root is over train.max_node_rows and the
    distributed solver's vectors are in files (train.tron_driver_mb=0) in both trainings, and the
    run's scratch folder is left empty."""
    from tests.conftest import random_problem, write_xc

    X, Y = random_problem(n=300, d=60, L=30, seed=11)
    write_xc(tmp_path / "train.txt", X[:240], Y[:240])
    write_xc(tmp_path / "test.txt", X[240:], Y[240:])
    out = tmp_path / "run"
    assert main_in_process("run", "--train", str(tmp_path / "train.txt"), "--test", str(tmp_path / "test.txt"),
                           "--out", str(out), "--set", "mlflow.enabled=false", "--set", "tree.max_leaf_size=4",
                           "--set", "clusters.lam=2", "--set", "clusters.beam_size=2",
                           *(("--set", "train.max_node_rows=200", "--set", "train.big_node_solver=distributed",
                              "--set", "train.tron_driver_mb=0",
                              "--set", "train.tron_max_iter=1") if big_nodes else ())) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert {"clusters", "retrain"} <= set(m["seconds"])
    assert m["n_labels"] <= m["n_slots"] <= 2 * m["n_labels"] and m["copies_per_label_max"] <= 2
    assert m["p@1"] > 50
    assert (out / "tables" / "clusters" / "_delta_log").is_dir()
    scratch = out / "tables" / "_scratch"
    if big_nodes:
        assert scratch.is_dir() and not [f for _, _, fs in os.walk(scratch) for f in fs]


def _predict_from_folder_as_the_run(spark, tmp_path, data, out, m, fast, head: str):
    """`predict` on the run's model folder gives the run's predictions and P@k (the tree's beside);
    on a copy without ``head`` (prime/ or knn/) the run's tree_predictions and the tree's P@k."""
    import shutil

    from xmc_spark.storage import read_delta

    def preds(path):
        return sorted((r["sample_id"], list(r["pred_labels"])) for r in read_delta(spark, str(path)).collect())

    assert main_in_process("predict", "--model", str(out / "model"), "--data", str(data / "test.txt"), "--out",
                           str(tmp_path / "pred"), *fast) == 0
    assert preds(tmp_path / "pred" / "tables" / "predictions") == preds(out / "tables" / "predictions")
    pm = json.loads((tmp_path / "pred" / "metrics.json").read_text())
    assert pm["p@1"] == pytest.approx(m["p@1"]) and pm["tree_p@1"] == pytest.approx(m["tree_p@1"])
    shutil.copytree(out / "model", tmp_path / "tree_only", ignore=shutil.ignore_patterns(head))
    assert main_in_process("predict", "--model", str(tmp_path / "tree_only"), "--data", str(data / "test.txt"),
                           "--out", str(tmp_path / "pred_tree"), *fast) == 0
    assert preds(tmp_path / "pred_tree" / "tables" / "predictions") == preds(out / "tables" / "tree_predictions")
    tm = json.loads((tmp_path / "pred_tree" / "metrics.json").read_text())
    assert tm["p@1"] == pytest.approx(m["tree_p@1"]) and "tree_p@1" not in tm


def test_run_with_prime_rerank_then_predict_from_the_folder(tmp_path, spark):
    """`run --set prime.mode=rerank` on a tiny synth set: the tree's own P@k beside the final
    ones, prime/ in the model folder; `predict` on the folder gives the run's predictions, and
    on a copy without prime/ the tree's (the run's tree_predictions)."""

    assert main_in_process("synth", "--out", str(tmp_path / "data"), "--n-train", "300", "--n-test", "80",
                           "--labels", "24", "--features", "120", "--format", "xc", "--seed", "2") == 0
    data, out = tmp_path / "data", tmp_path / "run"
    fast = ["--set", "mlflow.enabled=false", "--set", "tree.max_leaf_size=4"]
    assert main_in_process("run", "--train", str(data / "train.txt"), "--test", str(data / "test.txt"), "--out",
                           str(out), *fast, "--set", "prime.mode=rerank", "--set", "prime.epochs=1", "--set",
                           "prime.dim=8", "--set", "prime.ffn=16", "--set", "prime.K=10", "--set",
                           "prime.batch_size=64") == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["prime.mode"] == "rerank" and 0 <= m["prime.weight"] <= 1 and m["prime.n_held_out"] > 0
    assert {"p@1", "tree_p@1", "tree_p@5", "tree_psp@5"} <= set(m) and {"prime", "train"} <= set(m["seconds"])
    assert json.loads((out / "model" / "prime" / "prime.json").read_text())["weight"] == m["prime.weight"]
    _predict_from_folder_as_the_run(spark, tmp_path, data, out, m, fast, "prime")


def test_run_with_knn_rerank_then_predict_from_the_folder(tmp_path, spark, capfd, caplog):
    """`run --set knn.mode=rerank` on a tiny synth set: the choice on held-out training rows in
    metrics.json and knn/knn.json, the tree's own P@k beside the final ones; `predict` on the
    folder re-ranks as the run did (the training table's version it names), on a copy without
    knn/ it gives the tree's (the run's tree_predictions); once the training rows change it stops
    before writing; with PRIME also on, kNN re-ranks PRIME's output (stacked), `predict` on that
    folder does the same and stops when its prime/ is not the head the choice was made on."""
    import shutil

    from xmc_spark.prime_model import PrimeHead
    from xmc_spark.stages.knn import prime_digest
    from xmc_spark.storage import read_delta, write_delta

    def preds(path):
        return sorted((r["sample_id"], list(r["pred_labels"])) for r in read_delta(spark, str(path)).collect())
    assert main_in_process("synth", "--out", str(tmp_path / "data"), "--n-train", "300", "--n-test", "80",
                           "--labels", "24", "--features", "120", "--format", "xc", "--seed", "4") == 0
    data, out = tmp_path / "data", tmp_path / "run"
    fast = ["--set", "mlflow.enabled=false", "--set", "tree.max_leaf_size=4"]
    knn = ["--set", "knn.mode=rerank", "--set", "knn.K=10", "--set", "knn.ks=3,8", "--set", "knn.block_rows=64"]
    assert main_in_process("run", "--train", str(data / "train.txt"), "--test", str(data / "test.txt"), "--out",
                           str(out), *fast, *knn) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["knn.mode"] == "rerank" and 0 <= m["knn.weight"] <= 1 and m["knn.n_held_out"] > 0
    assert m["knn.k"] in (3, 8) and m["knn.power"] in (1.0, 2.0, 4.0)
    assert {"p@1", "tree_p@1", "tree_p@5", "tree_psp@5"} <= set(m) and {"knn", "knn_val_tree"} <= set(m["seconds"])
    info = json.loads((out / "model" / "knn" / "knn.json").read_text())
    assert (info["k"], info["power"], info["weight"]) == (m["knn.k"], m["knn.power"], m["knn.weight"])
    assert info["table"] == str((out / "tables" / "train").resolve()) and info["rows"] == 300
    _predict_from_folder_as_the_run(spark, tmp_path, data, out, m, fast, "knn")
    # the training rows it was chosen on change: predict stops before writing anything, naming them
    write_delta(read_delta(spark, str(out / "tables" / "train")).limit(200).localCheckpoint(),
                str(out / "tables" / "train"))
    capfd.readouterr()
    assert main_in_process("predict", "--model", str(out / "model"), "--data", str(data / "test.txt"), "--out",
                           str(tmp_path / "pred2"), *fast) == 2
    err = capfd.readouterr().err
    assert "was chosen on 300 training rows" in err and "now holds 200 rows" in err
    assert not (tmp_path / "pred2" / "tables").exists()
    # stacked on PRIME: kNN re-ranks PRIME's output; tree_predictions stay the tree's own
    both = tmp_path / "both"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xmc_spark.pipeline"):
        assert main_in_process("run", "--train", str(data / "train.txt"), "--test", str(data / "test.txt"), "--out",
                               str(both), *fast, *knn, "--set", "prime.mode=rerank", "--set", "prime.epochs=1",
                               "--set", "prime.dim=8", "--set", "prime.ffn=16", "--set", "prime.K=10") == 0
    mb = json.loads((both / "metrics.json").read_text())
    assert mb["knn.on_prime"] is True and mb["knn.n_held_out"] == mb["prime.n_held_out"] > 0
    assert mb["tree_p@1"] == pytest.approx(m["tree_p@1"])
    assert "the held-out model of the prime stage, reused" in caplog.text     # trained once, by the prime stage
    assert preds(both / "tables" / "tree_predictions") == preds(out / "tables" / "tree_predictions")
    info = json.loads((both / "model" / "knn" / "knn.json").read_text())
    assert info["prime"] == prime_digest(PrimeHead.load(both / "model"))
    assert main_in_process("predict", "--model", str(both / "model"), "--data", str(data / "test.txt"), "--out",
                           str(tmp_path / "pred3"), *fast) == 0
    assert preds(tmp_path / "pred3" / "tables" / "predictions") == preds(both / "tables" / "predictions")
    pm = json.loads((tmp_path / "pred3" / "metrics.json").read_text())
    assert pm["p@1"] == pytest.approx(mb["p@1"]) and pm["tree_p@1"] == pytest.approx(mb["tree_p@1"])
    # a folder whose prime/ is not the head the choice was made on, or has none: stops before Spark
    meta = json.loads((both / "model" / "prime" / "prime.json").read_text())
    (both / "model" / "prime" / "prime.json").write_text(json.dumps({**meta, "weight": meta["weight"] / 2 + 0.01}))
    shutil.copytree(both / "model", tmp_path / "no_prime", ignore=shutil.ignore_patterns("prime"))
    for folder, msg in ((both / "model", "was chosen on another PRIME head"), (tmp_path / "no_prime", "has no prime/")):
        capfd.readouterr()
        assert main_in_process("predict", "--model", str(folder), "--data", str(data / "test.txt"), "--out",
                               str(tmp_path / "pred4"), *fast) == 2
        assert msg in capfd.readouterr().err and not (tmp_path / "pred4" / "tables").exists()


@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.on_demand)])
def test_run_ensemble_with_matcher_negatives_equals_the_reference_then_predicts(tmp_path, spark, sharded):
    """tree.ensemble_splits + overlapping clusters + train.negatives = tfn+man through `run` (one
    set of Spark jobs for both trees), the model folder equal to the numpy reference, and
    `predict` from the folder. ``sharded``: predict.max_broadcast_mb below the model's weights,
    so the matcher, the routed negatives, prediction, the saved folder (an ensemble of chunked
    members) and `predict` all take the sharded ensemble's layered path (on demand, ~65 s: its
    parts are tested in tests/stages/test_sharded.py)."""
    from tests.conftest import random_problem, write_xc
    from xmc_spark.local_io import read_xc
    from xmc_spark.model import EnsembleModel, ModelTrainParams, XMCModel, is_chunked
    from xmc_spark.params import ClustersParams, TrainParams, TreeParams

    X, Y = random_problem(n=300, d=60, L=30, seed=12)
    write_xc(tmp_path / "train.txt", X[:240], Y[:240])
    write_xc(tmp_path / "test.txt", X[240:], Y[240:])
    out = tmp_path / "run"
    conf = ["--set", "mlflow.enabled=false", "--set", "tree.max_leaf_size=4", "--set", "tree.ensemble_splits=2,3",
            "--set", "train.negatives=tfn+man", "--set", "predict.beam_size=3", "--set", "clusters.copies=2",
            "--set", "clusters.beam_size=2"] + (["--set", "predict.max_broadcast_mb=0.001"] if sharded else [])
    assert main_in_process("run", "--train", str(tmp_path / "train.txt"), "--test", str(tmp_path / "test.txt"),
                           "--out", str(out), *conf) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["n_trees"] == 2 and {"train", "clusters", "retrain", "negatives", "retrain_man"} <= set(m["seconds"])
    assert m["model_layout"] == ("sharded" if sharded else "whole")
    assert is_chunked(str(out / "model")) == sharded
    model = XMCModel.load(str(out / "model"))
    assert isinstance(model, EnsembleModel) and [t.index.B for t in model.models] == [2, 3]
    Xtr, Ytr = read_xc(str(tmp_path / "train.txt"))
    Xte, _ = read_xc(str(tmp_path / "test.txt"))
    ref = EnsembleModel.train_local(Xtr, Ytr, ModelTrainParams(TreeParams(max_leaf_size=4, ensemble_splits=[2, 3]),
                                                               TrainParams(negatives="tfn+man"),
                                                               ClustersParams(copies=2, beam_size=2)),
                                    model.pred_params)
    assert all(len(t.index.slot_label) > 30 for t in model.models)        # labels with a second leaf
    for got, want in zip(model.models, ref.models):
        np.testing.assert_array_equal(got.index.slot_leaf, want.index.slot_leaf)
        np.testing.assert_allclose(got.slot_w.W.toarray(), want.slot_w.W.toarray(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(model.predict(Xte)[0], ref.predict(Xte)[0])
    assert main_in_process("predict", "--model", str(out / "model"), "--data", str(tmp_path / "test.txt"),
                           "--out", str(tmp_path / "pred"), *conf) == 0
    pm = json.loads((tmp_path / "pred" / "metrics.json").read_text())
    assert pm["p@1"] == pytest.approx(m["p@1"], abs=1e-3) and m["p@1"] > 50


def test_sweep_over_lambda_with_nested_mlflow_runs(tmp_path, spark):
    from tests.conftest import random_problem, write_xc

    X, Y = random_problem(n=300, d=60, L=40, seed=5)
    write_xc(tmp_path / "train.txt", X[:240], Y[:240])
    write_xc(tmp_path / "test.txt", X[240:], Y[240:])
    out = tmp_path / "sweep"
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    assert main_in_process("sweep", "--train", str(tmp_path / "train.txt"), "--test", str(tmp_path / "test.txt"),
                           "--out", str(out), "--values", "0,1000", "--set", "tree.max_leaf_size=3",
                           "--set", "tree.f_tilde=greedy", "--set", "predict.search=adaptive",
                           "--set", f"mlflow.tracking_uri={uri}", "--set", "mlflow.log_model=false",
                           "--set", f"mlflow.artifact_location={tmp_path}/mlruns/artifacts") == 0
    res = json.loads((out / "sweep.json").read_text())
    assert [x["value"] for x in res] == ["0", "1000"]
    balanced, fano = res
    assert balanced["depth@1"] == balanced["depth@5"] == balanced["tree_depth"]    # every leaf equally deep
    assert fano["tree_depth"] > balanced["tree_depth"]                            # lambda ~ 2: unbalanced
    assert fano["frequencies.greedy_rounds"] >= 1
    assert (out / "sweep.png").stat().st_size > 1000
    for name in ("lambda_prime=0", "lambda_prime=1000"):
        assert (out / name / "model" / "param.json").is_file()
        assert (out / name / "tables" / "predictions" / "_delta_log").is_dir()

    import mlflow
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["xmc-spark"], output_format="list")
    parent = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert len(parent) == 1 and len(children) == 2
    assert sorted(c.data.params["tree.lambda_prime"] for c in children) == ["0.0", "1000.0"]
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(parent[0].info.run_id)}
    assert {"sweep.json", "sweep.png"} <= arts


def test_make_groups_then_run_eagle(tmp_path, spark):
    from tests.conftest import random_problem, write_xc

    X, Y = random_problem(n=400, d=60, L=12, seed=9)
    Ytr = Y[:320].tolil()
    Ytr[:, 11] = 0                       # label 11: in the test set only, so no group carries it
    write_xc(tmp_path / "train.txt", X[:320], Ytr.tocsr())
    write_xc(tmp_path / "test.txt", X[320:], Y[320:])
    assert main_in_process("make-groups", "--train", str(tmp_path / "train.txt"), "--strategy", "random",
                           "--group-size", "4", "--out", str(tmp_path / "r4")) == 0
    info = json.loads((tmp_path / "r4" / "info.json").read_text())
    assert info["n_groups"] == 80 and info["group_size_min"] == info["group_size_max"] == 4
    out = tmp_path / "run"
    assert main_in_process("run", "--train", str(tmp_path / "r4"), "--test", str(tmp_path / "test.txt"),
                           "--out", str(out), "--set", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlruns/mlflow.db",
                           "--set", f"mlflow.artifact_location={tmp_path}/mlruns/artifacts",
                           "--set", "mlflow.log_model=false", "--set", "tree.max_leaf_size=4") == 0
    m = json.loads((out / "metrics.json").read_text())
    assert {"ingest", "eagle", "train"} <= set(m["seconds"])
    assert m["n_train"] == 320 and m["n_groups"] == 80 and m["eagle.mode"] == "joint"      # the default
    assert len(m["eagle.objective"]) == 21 and all(v > 0 for v in m["eagle.objective"])
    assert 0 < m["eagle.pair_precision"] <= 100 and 0 < m["eagle.pair_recall"] <= 100
    assert m["p@1"] > 40
    # counted by ingest against the labels the groups carry
    n11 = int(Y[320:, 11].sum())
    unseen = (m["test_unseen_labels"], m["test_unseen_positives"], m["test_rows_with_unseen"])
    assert n11 > 0 and unseen == (1, n11, n11)
    assert (out / "tables" / "eagle_embeddings" / "_delta_log").is_dir()
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    client = mlflow.MlflowClient()
    hist = client.get_metric_history(m["mlflow_run_id"], "eagle.objective")
    assert [h.step for h in hist] == list(range(21))
    assert client.get_run(m["mlflow_run_id"]).data.metrics["eagle.pair_precision"] == m["eagle.pair_precision"]
