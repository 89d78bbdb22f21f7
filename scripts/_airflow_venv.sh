# Sourced by test.sh: Airflow lives in its own environment (.venv-airflow): its pins (SQLAlchemy 1.4,
# Flask 2) clash with MLflow 3's, and a scheduler never imports xmc_spark anyway. Set up once.
PY=${PYTHON:-python3}
if [ ! -x .venv-airflow/bin/airflow ]; then
    "$PY" -m venv .venv-airflow
    .venv-airflow/bin/python -m pip install -q --upgrade pip
    .venv-airflow/bin/python -m pip install -q -c scripts/airflow-constraints.txt \
        "apache-airflow==2.10.5" "apache-airflow-providers-apache-spark==5.3.4"
fi
