"""The stage jobs: run-keyed Delta tables, idempotent reruns, failed stages, one MLflow run a key."""
import json

import numpy as np
import pytest

from tests.conftest import write_split, write_xc
from xmc_spark.params import PipelineParams
from xmc_spark.registry import ORDER
from xmc_spark.runner import run_keyed, run_stage
from xmc_spark.schemas import IngestError
from xmc_spark.storage import RunKeyError, StageOrderError, Tables, read_delta, table_version

K1, K2 = "2026-11-24", "2026-11-25"


@pytest.fixture(scope="module")
def env(tmp_path_factory, spark):
    d = tmp_path_factory.mktemp("stagejobs")
    X, Y = write_split(d, 120, n=160, d=40, L=12, seed=11)
    write_xc(d / "train_small.txt", X[:90], Y[:90])
    params = PipelineParams().set_dotted("tree.max_leaf_size", 4) \
        .set_dotted("mlflow.tracking_uri", f"sqlite:///{d}/mlflow.db") \
        .set_dotted("mlflow.artifact_location", str(d / "artifacts")) \
        .set_dotted("mlflow.registered_model", "") \
        .set_dotted("paths.root", str(d / "root"))
    res = run_keyed(spark, ["all"], K1, params, str(d / "train.txt"), str(d / "test.txt"))
    return d, params, res


def test_stages_in_order_equal_the_reference_model(env, spark):
    d, params, res = env
    assert list(res) == list(ORDER)
    assert res["eagle"]["skipped"] is True
    # the stage jobs' model = the single-process reference trainer's; metrics = the numpy kernel's
    from tests.oracles import reference_run
    from xmc_spark.model import XMCModel
    ref, Xt, want, kernel = reference_run(d, tree=params.tree, train=params.train)
    got, _ = XMCModel.load(res["train"]["model_dir"]).predict(Xt)
    np.testing.assert_array_equal(got, want)
    tables = Tables(spark, d / "root" / "tables", K1)
    stored = {r["metric"]: r["value"] for r in tables.read("metrics").collect()}
    for k in ("p@1", "p@3", "p@5", "ndcg@3", "psp@5"):
        assert res["evaluate"][k] == pytest.approx(kernel[k], abs=1e-3), k
        assert stored[k] == res["evaluate"][k]
    assert res["evaluate"]["depth@1"] == pytest.approx(float(ref.label_depth().max()))


def test_all_stages_share_one_mlflow_run_with_table_versions(env):
    d, params, res = env
    ids = {r["mlflow_run_id"] for r in res.values()}
    assert len(ids) == 1
    import mlflow
    mlflow.set_tracking_uri(params.mlflow.tracking_uri)
    run = mlflow.get_run(ids.pop())
    assert run.data.tags["xmc_spark.run_key"] == K1
    assert run.data.params["tree.max_leaf_size"] == "4" and run.data.params["input.train"].endswith("train.txt")
    assert {"table_version.tree.train", "table_version.train.tree", "table_version.predict.weights",
            "table_version.evaluate.predictions"} <= set(run.data.tags)
    assert run.data.metrics["p_at_1"] == pytest.approx(res["evaluate"]["p@1"])
    assert {"seconds.ingest", "seconds.tree", "seconds.train", "seconds.evaluate"} <= set(run.data.metrics)


def test_a_stage_failing_half_way_leaves_later_stages_on_the_last_good_output(env, spark, monkeypatch):
    d, params, res = env
    tables = Tables(spark, d / "root" / "tables", K1)
    before = sorted(tables.read("predictions").collect())
    weights_v = tables.version("weights")
    write = Tables.write

    def crash_before_slots(self, name, df, where=None):
        if name == "slots":
            raise RuntimeError("crash after the weights, before the slots")
        return write(self, name, df, where)

    monkeypatch.setattr(Tables, "write", crash_before_slots)
    with pytest.raises(RuntimeError, match="crash after the weights"):
        run_stage(spark, "train", K1, params.set_dotted("train.C", 0.01))   # different weights
    monkeypatch.undo()
    assert tables.version("weights") > weights_v          # the failed run did overwrite the weights partition
    # predict reads the weights at the version the last successful train stage recorded
    info = run_stage(spark, "predict", K1, params)
    assert sorted(tables.read("predictions").collect()) == before
    import mlflow
    mlflow.set_tracking_uri(params.mlflow.tracking_uri)
    assert mlflow.get_run(info["mlflow_run_id"]).data.tags["table_version.predict.weights"] == str(weights_v)


def test_rerun_replaces_only_its_key_and_a_failed_stage_leaves_the_table(env, spark):
    d, params, res = env
    path = str(d / "root" / "tables" / "train")
    # a second key beside K1
    run_stage(spark, "ingest", K2, params, str(d / "train_small.txt"))
    counts = {r["run_key"]: r["count"] for r in read_delta(spark, path).groupBy("run_key").count().collect()}
    assert counts == {K1: 120, K2: 90}
    before = sorted(read_delta(spark, path, K1).collect())
    v = table_version(spark, path)
    # rerun K1: same rows, one new version, K2 untouched
    run_stage(spark, "ingest", K1, params, str(d / "train.txt"), str(d / "test.txt"))
    assert table_version(spark, path) > v
    assert sorted(read_delta(spark, path, K1).collect()) == before
    assert read_delta(spark, path, K2).count() == 90
    # a failing rerun (bad input) writes nothing: same version, same rows
    bad = d / "bad.txt"
    bad.write_text("2 40 12\n1 3:1\n2 5:nan\n")
    v = table_version(spark, path)
    with pytest.raises(IngestError, match=r"bad.txt:3: feature value is NaN"):
        run_stage(spark, "ingest", K1, params, str(bad))
    assert table_version(spark, path) == v
    assert sorted(read_delta(spark, path, K1).collect()) == before
    # the stage's facts for K1 are still those of the good run
    info = Tables(spark, d / "root" / "tables", K1).read("stage_info").filter("stage = 'ingest'").first()
    assert json.loads(info["info"])["n_train"] == 120


def test_stage_order_and_run_key_errors(env, spark):
    d, params, _ = env
    with pytest.raises(StageOrderError, match="needs the output of stage 'ingest' for run key 2026-01-01"):
        run_stage(spark, "tree", "2026-01-01", params)
    with pytest.raises(RunKeyError, match="run key"):
        run_stage(spark, "ingest", "x' OR '1'='1", params, str(d / "train.txt"))
