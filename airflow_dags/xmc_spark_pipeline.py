"""Airflow DAG: the xmc-spark pipeline, one spark-submit task per stage, keyed by the logical date.

    ingest >> eagle >> tree >> train >> prime >> knn >> predict >> evaluate

Each task runs ``jobs/<stage>.py --run-key {{ ds }}``: its Delta tables are the run date's
partitions under ``paths.root``, so a retried or cleared task replaces only its own output.
Deployment (environment variables of the scheduler/workers, read when the file is parsed):

- ``XMC_SPARK_JOBS_DIR``: folder with ``jobs/*.py`` (default: the repository's ``jobs/``);
- ``XMC_SPARK_WHEEL``: the wheel from ``python -m build``, shipped with ``--py-files``
  (empty: the package is installed on the cluster's Python);
- ``XMC_SPARK_PACKAGES``: ``--packages`` (e.g. the Delta jars off Databricks/EMR, see
  ``xmc_spark.session.delta_package``);
- ``XMC_SPARK_REGISTRY``: xmc-spark's ``xmc_spark/registry.py`` (default: the repository's), the
  one list of stages and their dependencies, read as a plain file;
- ``XMC_SPARK_CONF_DIR``: folder with ``databricks.yaml`` / ``emr.yaml`` / ``local.yaml``;
- the Spark connection ``spark_default`` (or ``XMC_SPARK_CONN_ID``): master, deploy mode, queue.

Top-level code only builds the DAG: no Spark, no import of the xmc_spark package (one stdlib-only
file read), no other I/O.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from datetime import datetime, timedelta

try:                                        # Airflow 3: the Task SDK
    from airflow.sdk import DAG, Param
except ImportError:                         # Airflow 2.10 / 2.11
    from airflow import DAG
    from airflow.models.param import Param
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS_DIR = os.environ.get("XMC_SPARK_JOBS_DIR", os.path.join(_REPO, "jobs"))
CONF_DIR = os.environ.get("XMC_SPARK_CONF_DIR", os.path.join(_REPO, "conf"))
WHEEL = os.environ.get("XMC_SPARK_WHEEL") or None
PACKAGES = os.environ.get("XMC_SPARK_PACKAGES") or None
CONN_ID = os.environ.get("XMC_SPARK_CONN_ID", "spark_default")
# The stages and their dependencies come from xmc-spark's one stage registry, a stdlib-only file
# loaded by path (the scheduler needs neither Spark nor the package's dependencies).
REGISTRY = os.environ.get("XMC_SPARK_REGISTRY", os.path.join(_REPO, "xmc_spark", "registry.py"))


def _load_registry(path: str):
    spec = importlib.util.spec_from_file_location("xmc_spark_registry", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


STAGES = _load_registry(REGISTRY).STAGES

PARAMS = {
    "train": Param("s3://my-bucket/xc/train.txt", type="string", minLength=1,
                   description="training input: XC text, svmlight, Parquet/Delta, or an aggregated folder"),
    "test": Param("s3://my-bucket/xc/test.txt", type="string", minLength=1, description="test input"),
    "environment": Param("emr", type="string", enum=["local", "databricks", "emr"],
                         description="conf/<environment>.yaml: Spark settings, paths, MLflow"),
    "max_leaf_size": Param(100, type="integer", minimum=2, description="tree.max_leaf_size"),
    "tree_lambda": Param(0.0, type="number", minimum=0, maximum=2,
                         description="tree.lambda: 0 balanced 2-means ... 2 Fano coding"),
    "eagle_mode": Param("joint", type="string", enum=["baseline", "eagle0", "eagle", "soft", "joint"],
                        description="eagle.mode (aggregated input only)"),
    "beam_size": Param(10, type="integer", minimum=1, maximum=1000, description="predict.beam_size"),
    "prime_mode": Param("off", type="string", enum=["off", "retrieve", "rerank"],
                        description="prime.mode: PRIME label prototypes off, as the retriever, or re-ranking the tree"),
    "knn_mode": Param("off", type="string", enum=["off", "rerank"],
                      description="knn.mode: the kNN re-ranker off or on (with prime_mode on: PRIME's output)"),
}


def _args(stage: str) -> list:
    args = ["--run-key", "{{ ds }}", "--config", CONF_DIR + "/{{ params.environment }}.yaml",
            "--set", "tree.max_leaf_size={{ params.max_leaf_size }}",
            "--set", "tree.lambda={{ params.tree_lambda }}",
            "--set", "eagle.mode={{ params.eagle_mode }}",
            "--set", "predict.beam_size={{ params.beam_size }}",
            "--set", "prime.mode={{ params.prime_mode }}",
            "--set", "knn.mode={{ params.knn_mode }}"]
    if stage == "ingest":
        args += ["--train", "{{ params.train }}", "--test", "{{ params.test }}"]
    return args


with DAG(
    dag_id="xmc_spark_pipeline",
    description="xmc-spark: ingest, EAGLE, label tree, node training, PRIME, kNN, prediction, evaluation",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    params=PARAMS,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=5), "owner": "xmc-spark"},
    tags=["xmc-spark", "spark"],
    doc_md=__doc__,
) as dag:
    tasks = {}
    for stage, spec in STAGES.items():
        tasks[stage] = SparkSubmitOperator(
            task_id=stage,
            application=os.path.join(JOBS_DIR, f"{stage}.py"),
            py_files=WHEEL,
            packages=PACKAGES,
            conn_id=CONN_ID,
            name=f"xmc-spark-{stage}-{{{{ ds }}}}",
            application_args=_args(stage),
        )
        for need in spec.needs:
            tasks[need] >> tasks[stage]
