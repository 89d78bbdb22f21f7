#!/usr/bin/env bash
# Set up and run the main job on example data the project generates itself:
# a synthetic XMC set (power-law labels) -> xmc-spark run -> runs/demo/metrics.json, model, MLflow run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh "local"
.venv/bin/xmc-spark synth --out data/example --n-train 20000 --n-test 4000 --labels 2000 --features 5000 \
    --format xc --set mlflow.enabled=false
.venv/bin/xmc-spark run --train data/example/train.txt --test data/example/test.txt --out runs/demo \
    --config conf/local.yaml
echo "metrics: runs/demo/metrics.json   model: runs/demo/model   MLflow: .venv/bin/mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db"
