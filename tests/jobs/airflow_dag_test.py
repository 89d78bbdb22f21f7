"""Run the Airflow DAG end to end with ``dag.test()`` (Airflow 3) and print a JSON summary.

Run by the Airflow environment's Python (.venv-airflow), not a test module:

    .venv-airflow/bin/python tests/jobs/airflow_dag_test.py --home /tmp/af --logical-date 2026-11-25 \
        --train train.txt --test test.txt --spark-python .venv/bin/python \
        --packages io.delta:delta-spark_4.2_2.13:4.4.0 [--master local[2]] [--no-retries] \
        [--param max_leaf_size=2]

It makes a throw-away Airflow home under ``--home`` (sqlite metadata DB from ``airflow db
migrate``, DAG folder ``airflow_dags/``), a conf folder there whose ``local.yaml`` puts
``paths.root`` under ``--home`` with small Spark settings and MLflow off, then runs one DAG run
with ``dag.test(logical_date=..., run_conf=params)``: every task's real ``spark-submit`` (the
one next to ``--spark-python``) with the connection ``spark_default`` = ``--master``. The last
line printed is the summary: DAG run state, each task's state, try number and seconds, the root,
and the rows of the ``metrics`` table's run-key partition (read from the Delta log with pyarrow).

``read_delta_partition`` (stdlib + pyarrow, no Airflow, no Spark) is also used by the test.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]


def read_delta_partition(table: str | os.PathLike, column: str, value: str) -> list:
    """Rows (dicts) of a Delta table's partition ``column = value``, from the current snapshot:
    the add/remove actions of ``_delta_log/*.json`` replayed in order, live files read with
    pyarrow. Tables with checkpoints or deletion vectors are refused, not misread."""
    import pyarrow.parquet as pq

    log = Path(table) / "_delta_log"
    if not log.is_dir():
        raise FileNotFoundError(f"{log}: no Delta log")
    if list(log.glob("*.checkpoint*.parquet")):
        raise ValueError(f"{log}: has a checkpoint; this reader replays JSON commits only")
    live = {}
    for commit in sorted(log.glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line) if line.strip() else {}
            if "add" in action:
                live[action["add"]["path"]] = action["add"]
            elif "remove" in action:
                live.pop(action["remove"]["path"], None)
    rows = []
    for path, add in sorted(live.items()):
        if add.get("deletionVector"):
            raise ValueError(f"{table}: {path} has a deletion vector")
        if add.get("partitionValues", {}).get(column) != value:
            continue
        for row in pq.read_table(Path(table) / unquote(path)).to_pylist():
            rows.append({**row, column: value})
    return rows


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", required=True, help="folder for AIRFLOW_HOME, the conf folder and the run root")
    p.add_argument("--logical-date", required=True, help="YYYY-MM-DD: the run key")
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--spark-python", required=True, help="python of the Spark venv; its bin has spark-submit")
    p.add_argument("--packages", default="", help="XMC_SPARK_PACKAGES (the Delta jars)")
    p.add_argument("--wheel", default="", help="XMC_SPARK_WHEEL (empty: the package installed on --spark-python)")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--shuffle-partitions", type=int, default=2)
    p.add_argument("--no-retries", action="store_true", help="retries=0 on every task: a failure ends the "
                   "run at once instead of after the DAG's 5-minute retry delay")
    p.add_argument("--param", action="append", default=[], metavar="KEY=JSON",
                   help="another DAG param in run_conf, e.g. max_leaf_size=2")
    p.add_argument("--summary", help="also write the summary JSON here")
    return p.parse_args()


def _environment(a, home: Path, conf_dir: Path) -> None:
    """Everything the DAG file, Airflow and the spark-submit child read, set before Airflow is imported."""
    spark_bin = str(Path(a.spark_python).parent)
    os.environ.update({
        "AIRFLOW_HOME": str(home / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "airflow_dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow' / 'airflow.db'}",
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": a.master}),
        "XMC_SPARK_CONF_DIR": str(conf_dir),
        "XMC_SPARK_PACKAGES": a.packages,
        "XMC_SPARK_WHEEL": a.wheel,
        # the hook runs `spark-submit` from PATH; its driver and Python workers use the Spark venv
        "PATH": spark_bin + os.pathsep + os.environ.get("PATH", ""),
        "PYSPARK_PYTHON": a.spark_python,
        "PYSPARK_DRIVER_PYTHON": a.spark_python,
    })
    for var in ("PYTHONPATH", "SPARK_HOME", "XMC_SPARK_CONN_ID"):
        os.environ.pop(var, None)


def main() -> int:
    a = _parse()
    home = Path(a.home).resolve()
    root = home / "runs"
    conf_dir = home / "conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    # merged over the embedded defaults (conf/local.yaml's values) by --config conf_dir/local.yaml
    p = a.shuffle_partitions
    (conf_dir / "local.yaml").write_text(json.dumps({
        "paths": {"root": str(root)},
        "spark": {"conf": {"spark.sql.shuffle.partitions": str(p), "spark.default.parallelism": str(p),
                           "spark.ui.showConsoleProgress": "false", "spark.ui.enabled": "false"}},
        "mlflow": {"enabled": False},
    }, indent=1))                                    # JSON is YAML
    _environment(a, home, conf_dir)

    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        return 2
    migrate_s = time.perf_counter() - t0

    from datetime import datetime, timezone

    try:
        from airflow.dag_processing.dagbag import DagBag  # Airflow >= 3.1
    except ImportError:
        from airflow.models import DagBag
    bag = DagBag(dag_folder=str(ROOT / "airflow_dags"), include_examples=False)
    if bag.import_errors:
        sys.stderr.write(json.dumps({k: str(v) for k, v in bag.import_errors.items()}) + "\n")
        return 2
    dag = bag.dags["xmc_spark_pipeline"]
    if a.no_retries:
        for task in dag.tasks:
            task.retries = 0
    logical = datetime.strptime(a.logical_date, "%Y-%m-%d").replace(tzinfo=timezone.utc)
    conf = {"train": str(Path(a.train).resolve()), "test": str(Path(a.test).resolve()), "environment": "local"}
    conf.update({k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.param)})

    t1 = time.perf_counter()
    dr = dag.test(logical_date=logical, run_conf=conf)
    run_s = time.perf_counter() - t1

    tasks = {}
    for ti in dr.get_task_instances():
        seconds = (ti.end_date - ti.start_date).total_seconds() if ti.end_date and ti.start_date else None
        tasks[ti.task_id] = {"state": str(ti.state), "try_number": ti.try_number, "seconds": seconds}
    metrics_table = root / "tables" / "metrics"
    try:
        metrics = read_delta_partition(metrics_table, "run_key", a.logical_date)
    except (OSError, ValueError) as e:
        metrics = {"error": f"{type(e).__name__}: {e}"}
    import airflow
    summary = {"airflow": airflow.__version__, "dag_run_state": str(dr.state), "run_id": dr.run_id,
               "logical_date": dr.logical_date.isoformat() if dr.logical_date else None,
               "tasks": tasks, "root": str(root), "metrics": metrics,
               "migrate_seconds": round(migrate_s, 1), "dag_test_seconds": round(run_s, 1)}
    text = json.dumps(summary)
    if a.summary:
        Path(a.summary).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
