"""spark-submit entry point of the pipeline's knn stage (see xmc_spark.registry and xmc_spark.runner).

    spark-submit --py-files xmc_spark-0.1.0-py3-none-any.whl jobs/knn.py --run-key 2026-11-25 \
        --config conf/emr.yaml [--train ... --test ...] [--set key=value ...]

Arguments are those of `xmc-spark stage knn`; no algorithm code lives here.
"""
import sys

from xmc_spark.cli import main

if __name__ == "__main__":
    sys.exit(main(["stage", "knn", *sys.argv[1:]]))
