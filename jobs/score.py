"""spark-submit entry point: score a file or table with a saved model (``xmc-spark predict``);
the pipeline's predict stage is jobs/predict.py."""
import sys

from xmc_spark.cli import main

if __name__ == "__main__":
    sys.exit(main(["predict", *sys.argv[1:]]))
