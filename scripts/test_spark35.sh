#!/usr/bin/env bash
# The test suite on Spark 3.5 (EMR 7.x, Databricks 16.4 LTS): a separate .venv-spark35 with
# pyspark 3.5 + delta-spark 3.3, then pytest (on demand; CI runs scripts/test.sh on Spark 4.2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-spark35/bin/python ]; then
    "$PY" -m venv .venv-spark35
    .venv-spark35/bin/python -m pip install -q --upgrade pip
    .venv-spark35/bin/python -m pip install -q "pyspark==3.5.*" "delta-spark==3.3.*"
fi
.venv-spark35/bin/python -m pip install -q -e ".[test]"
source scripts/_airflow_venv.sh
exec .venv-spark35/bin/python -m pytest -q --durations=15 "$@"
