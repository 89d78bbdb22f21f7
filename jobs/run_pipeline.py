"""spark-submit entry point for the whole pipeline.

    spark-submit --py-files xmc_spark.zip jobs/run_pipeline.py \
        --train s3://bucket/train.txt --test s3://bucket/test.txt --out s3://bucket/runs/2026-11-25 \
        --config conf/local.yaml --set spark.master=

All arguments are those of ``xmc-spark run``; no algorithm code lives here.
"""
import sys

from xmc_spark.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
