# Sourced by test.sh and test_spark35.sh: Airflow lives in its own environment (.venv-airflow): its pins clash with
# MLflow's, and a scheduler never imports xmc_spark anyway. Set up once; remade when it holds
# another Airflow version than the one pinned here.
PY=${PYTHON:-python3}
AIRFLOW_VERSION=3.1.8
AIRFLOW_SPARK_PROVIDER=6.3.4
if ! .venv-airflow/bin/python -c "import airflow, sys; sys.exit(airflow.__version__ != '$AIRFLOW_VERSION')" \
        2>/dev/null; then
    rm -rf .venv-airflow
    "$PY" -m venv .venv-airflow
    # through uv: .venv's (scripts/_venv.sh installs it), else one installed into .venv-airflow
    UV=(.venv/bin/python -m uv)
    if ! "${UV[@]}" --version >/dev/null 2>&1; then
        .venv-airflow/bin/python -m pip install -q "uv>=0.5"
        UV=(.venv-airflow/bin/python -m uv)
    fi
    "${UV[@]}" pip install -q --compile-bytecode --python .venv-airflow/bin/python -c scripts/airflow-constraints.txt \
        "apache-airflow==$AIRFLOW_VERSION" "apache-airflow-providers-apache-spark==$AIRFLOW_SPARK_PROVIDER"
fi
