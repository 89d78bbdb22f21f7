"""The Airflow DAG, loaded by the real Airflow (its own environment, .venv-airflow), and its
spark-submit command for the ingest task run with the real spark-submit binary on tiny data."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import random_problem, write_xc

ROOT = Path(__file__).resolve().parents[2]
AIRFLOW_PY = ROOT / ".venv-airflow" / "bin" / "python"
DS = "2026-11-25"


def inspect_dag(tmp_path, env_extra=None, overrides=None):
    assert AIRFLOW_PY.exists(), "no .venv-airflow: scripts/test.sh sets it up (scripts/_airflow_venv.sh)"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "AIRFLOW_HOME": str(tmp_path / "airflow"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}), **(env_extra or {})}
    r = subprocess.run([str(AIRFLOW_PY), str(ROOT / "tests" / "jobs" / "airflow_inspect.py"),
                        str(ROOT / "airflow_dags"), DS, json.dumps(overrides or {})],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The package as users ship it: `python -m build --wheel`."""
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    whl = next(out.glob("xmc_spark-*.whl"))
    import zipfile
    meta = zipfile.ZipFile(whl).read(next(n for n in zipfile.ZipFile(whl).namelist() if n.endswith("METADATA")))
    hard = [ln for ln in meta.decode().splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert not any("pyspark" in ln or "delta-spark" in ln for ln in hard), hard   # the platform provides Spark
    return whl


def test_dag_loads_with_one_spark_submit_task_per_stage(tmp_path):
    out = inspect_dag(tmp_path, {"XMC_SPARK_WHEEL": "/opt/xmc/xmc_spark-0.1.0-py3-none-any.whl"},
                      {"max_leaf_size": 16, "environment": "databricks"})
    assert out["airflow"].startswith("3.")                 # Airflow 3 (Task SDK imports)
    assert out["import_errors"] == {} and out["dag_ids"] == ["xmc_spark_pipeline"]
    assert out["heavy_modules"] == []                    # light top-level code
    from xmc_spark.registry import STAGES
    assert set(out["tasks"]) == set(STAGES)             # the registry's stages and dependencies
    for name in STAGES:
        assert out["tasks"][name]["downstream"] == sorted(s for s, spec in STAGES.items() if name in spec.needs)
        assert (ROOT / "jobs" / f"{name}.py").is_file()
        assert out["tasks"][name]["operator"] == "SparkSubmitOperator" and out["tasks"][name]["retries"] == 1
    assert out["schedule"] == "@daily"
    # the JSON schema of every Param rejects a bad value
    assert all(out["rejected"].values()), out["rejected"]
    assert "less than the minimum of 2" in out["rejected"]["max_leaf_size"]
    # the logical date is the run key; params become --set overrides; the wheel goes with --py-files
    cmd = out["commands"]["tree"]
    assert cmd[0] == "spark-submit" and cmd[cmd.index("--master") + 1] == "local[2]"
    assert cmd[cmd.index("--py-files") + 1].endswith(".whl")
    assert cmd[cmd.index("--run-key") + 1] == DS and cmd[-1] != DS
    assert str(ROOT / "jobs" / "tree.py") in cmd and str(ROOT / "conf" / "databricks.yaml") in cmd
    assert "tree.max_leaf_size=16" in cmd and "--train" not in cmd
    assert "prime.mode=off" in cmd and "prime.mode=off" in out["commands"]["prime"]     # PRIME's default
    assert "knn.mode=off" in cmd and "knn.mode=off" in out["commands"]["knn"]           # kNN's default
    assert "--train" in out["commands"]["ingest"]


def test_airflow_built_spark_submit_runs_the_ingest_job_from_the_wheel(tmp_path, wheel, spark):
    from xmc_spark.session import delta_package
    X, Y = random_problem(n=30, d=12, L=5, seed=1)
    write_xc(tmp_path / "train.txt", X, Y)
    write_xc(tmp_path / "test.txt", X[:10], Y[:10])
    out = inspect_dag(tmp_path, {"XMC_SPARK_WHEEL": str(wheel), "XMC_SPARK_PACKAGES": delta_package()},
                      {"train": str(tmp_path / "train.txt"), "test": str(tmp_path / "test.txt"),
                       "environment": "local"})
    cmd = out["commands"]["ingest"]
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "spark-submit"), *cmd[1:], "--set", "mlflow.enabled=false",
           "--set", "spark.conf={\"spark.sql.shuffle.partitions\": \"2\", \"spark.ui.showConsoleProgress\": \"false\"}"]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    log = r.stdout + r.stderr                            # spark-submit merges the driver's stderr into stdout
    assert f"({wheel})" in log                           # the code ran from the wheel
    assert "launched by spark-submit" in log
    info = json.loads(r.stdout[r.stdout.index("\n{\n"):])
    assert info["n_train"] == 30 and info["n_test"] == 10 and info["n_labels"] == 5
    # the run date's partition of the Delta table, read back by this process's Spark
    from xmc_spark.storage import read_delta
    assert read_delta(spark, str(tmp_path / "runs" / "pipeline" / "tables" / "train"), DS).count() == 30
    assert read_delta(spark, str(tmp_path / "runs" / "pipeline" / "tables" / "test"), DS).count() == 10


@pytest.mark.slow
@pytest.mark.on_demand      # ~2 min; the wheel under spark-submit is checked in CI by the ingest-job test above
def test_spark_submit_runs_the_whole_pipeline_from_the_wheel(tmp_path, wheel):
    """jobs/run_pipeline.py under spark-submit --py-files wheel: every stage, and the pyfunc
    model logged from code that lives inside the wheel."""
    from xmc_spark.session import delta_package
    X, Y = random_problem(n=90, d=20, L=6, seed=2)
    write_xc(tmp_path / "train.txt", X[:70], Y[:70])
    write_xc(tmp_path / "test.txt", X[70:], Y[70:])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[2]", "--packages", delta_package(),
           "--py-files", str(wheel), str(ROOT / "jobs" / "run_pipeline.py"),
           "--train", str(tmp_path / "train.txt"), "--test", str(tmp_path / "test.txt"), "--out", str(tmp_path / "out"),
           "--set", "tree.max_leaf_size=3", "--set", f"mlflow.tracking_uri={uri}",
           "--set", f"mlflow.artifact_location={tmp_path}/artifacts",
           "--set", "spark.conf={\"spark.sql.shuffle.partitions\": \"2\", \"spark.ui.showConsoleProgress\": \"false\"}"]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"({wheel})" in r.stdout + r.stderr
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["n_train"] == 70 and m["n_test"] == 20 and m["p@1"] > 0
    import mlflow
    mlflow.set_tracking_uri(uri)
    assert mlflow.MlflowClient().get_model_version_by_alias("xmc-spark", "candidate").run_id == m["mlflow_run_id"]


@pytest.mark.slow
@pytest.mark.airflow_e2e
def test_dag_test_runs_every_stage_through_spark_submit(tmp_path):
    """dag.test() on Airflow 3: one DAG run, the six tasks each a real spark-submit job (the
    package installed in this venv, no wheel), then the run key's partition of the metrics table."""
    from tests.jobs.airflow_dag_test import read_delta_partition
    from xmc_spark.registry import STAGES
    from xmc_spark.session import delta_package
    X, Y = random_problem(n=40, d=16, L=6, seed=3)
    write_xc(tmp_path / "train.txt", X[:30], Y[:30])
    write_xc(tmp_path / "test.txt", X[30:], Y[30:])
    summary = tmp_path / "summary.json"
    cmd = [str(AIRFLOW_PY), str(ROOT / "tests" / "jobs" / "airflow_dag_test.py"), "--home", str(tmp_path / "af"),
           "--logical-date", DS, "--train", str(tmp_path / "train.txt"), "--test", str(tmp_path / "test.txt"),
           "--spark-python", sys.executable, "--packages", delta_package(), "--no-retries",
           "--master", os.environ.get("XMC_TEST_AIRFLOW_MASTER", "local[2]"), "--param", "max_leaf_size=2",
           "--summary", str(summary)]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0 and summary.exists(), (r.stdout + r.stderr)[-4000:]
    out = json.loads(summary.read_text())
    assert out["airflow"].startswith("3.") and out["logical_date"].startswith(DS)
    states = {t: v["state"] for t, v in out["tasks"].items()}
    assert states == {s: "success" for s in STAGES}, (states, (r.stdout + r.stderr)[-4000:])
    assert out["dag_run_state"] == "success"
    # the run key's partitions, read here from the Delta logs (no Spark): the run_conf's data
    # reached ingest, and evaluate wrote the metrics
    tables = Path(out["root"]) / "tables"
    assert tables.parent == (tmp_path / "af" / "runs").resolve()
    assert len(read_delta_partition(tables / "train", "run_key", DS)) == 30
    assert len(read_delta_partition(tables / "test", "run_key", DS)) == 10
    metrics = {row["metric"]: row["value"] for row in read_delta_partition(tables / "metrics", "run_key", DS)}
    assert {"p@1", "p@3", "p@5", "ndcg@5"} <= set(metrics), metrics
    assert 0 < metrics["p@1"] <= 100 and all(0 <= metrics[f"p@{k}"] <= 100 for k in (1, 3, 5))   # percent
    assert read_delta_partition(tables / "metrics", "run_key", "2026-11-24") == []
    assert out["metrics"] and len(out["metrics"]) == len(metrics)   # the script's own read agrees
