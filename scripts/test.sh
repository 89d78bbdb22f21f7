#!/usr/bin/env bash
# Set up (a .venv with the package, local Spark + Delta, test tools; .venv-airflow with Airflow for the
# DAG test) and run the test suite.
# Needs Python >= 3.10 and Java 17 on PATH. Real data tests read ../shared/data beside the clone.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh "local,test"
source scripts/_airflow_venv.sh
.venv/bin/ruff check .            # lint (pyproject's [tool.ruff]); a finding fails the run
# on demand, to keep CI under 30 minutes: the Airflow dag.test() run (six spark-submit jobs,
# ~6-11 min; -m airflow_e2e) and end-to-end runs whose parts other tests cover (-m on_demand)
exec .venv/bin/python -m pytest -q --durations=15 -m "not airflow_e2e and not on_demand" "$@"
