"""Run by the Airflow environment's Python (.venv-airflow): load the DAG folder with the real
DagBag and print, as JSON, what tests/jobs/test_airflow_dag.py checks. Not a test module."""
import copy
import json
import sys
import time

from airflow.exceptions import ParamValidationError

try:
    from airflow.dag_processing.dagbag import DagBag  # Airflow >= 3.1
except ImportError:
    from airflow.models import DagBag

folder, ds = sys.argv[1], sys.argv[2]
overrides = json.loads(sys.argv[3])
t0 = time.perf_counter()
bag = DagBag(dag_folder=folder, include_examples=False)
seconds = time.perf_counter() - t0
import airflow  # noqa: E402

out = {"airflow": airflow.__version__, "import_errors": {k: str(v) for k, v in bag.import_errors.items()},
       "dag_ids": sorted(bag.dags),
       "parse_seconds": seconds, "heavy_modules": sorted(m for m in ("pyspark", "xmc_spark", "mlflow", "numba")
                                                         if m in sys.modules)}
dag = bag.dags.get("xmc_spark_pipeline")
if dag is not None:
    out["tasks"] = {t.task_id: {"downstream": sorted(t.downstream_task_ids), "operator": type(t).__name__,
                                "retries": t.retries} for t in dag.tasks}
    out["schedule"] = str(getattr(dag, "schedule_interval", None) or dag.schedule)   # Airflow 2 / 3
    rejected = {}
    for key, bad in (("max_leaf_size", 1), ("tree_lambda", 3), ("eagle_mode", "nope"), ("environment", "gcp"),
                     ("train", ""), ("beam_size", "ten"),
                     ("prime_mode", "on")):
        p = copy.deepcopy(dag.params)
        try:
            p.update({key: bad})
            p.validate()
            rejected[key] = None
        except ParamValidationError as e:
            rejected[key] = str(e).splitlines()[0]
    out["rejected"] = rejected
    params = copy.deepcopy(dag.params)
    params.update(overrides)
    ctx = {"ds": ds, "params": params.validate()}
    commands = {}
    for t in dag.tasks:
        t.render_template_fields(ctx)
        commands[t.task_id] = t._get_hook()._build_spark_submit_command(t.application)
    out["commands"] = commands
print(json.dumps(out))
