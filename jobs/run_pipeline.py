"""spark-submit entry point for the whole pipeline.

    spark-submit --py-files xmc_spark-0.1.0-py3-none-any.whl jobs/run_pipeline.py \
        --train /data/train.txt --test /data/test.txt --out /data/runs/2026-11-25 --config conf/emr.yaml

All arguments are those of ``xmc-spark run`` (spark-submit's --master and --packages win over the
config's); no algorithm code lives here. The per-stage jobs are jobs/<stage>.py.
"""
import sys

from xmc_spark.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
