"""The only place that builds a SparkSession."""
from __future__ import annotations

import logging
import os
import sys

from .params import SparkParams

log = logging.getLogger("xmc_spark")

DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def get_spark(params: SparkParams | None = None):
    """SparkSession with Delta Lake configured.

    Locally (``spark.master`` set) the Python workers use this interpreter and Delta's jars come
    from Maven Central through ``spark.jars.packages`` (cached after the first run). Under
    spark-submit on a cluster set ``spark.master: ""`` and ``delta_from_maven: false`` when the
    platform already ships Delta (Databricks).
    """
    from pyspark.sql import SparkSession

    params = params or SparkParams()
    if params.master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(params.app_name)
    if params.master:
        builder = builder.master(params.master)
    for k, v in {**DELTA_CONF, **params.conf}.items():
        builder = builder.config(k, str(v))
    if params.delta_from_maven:
        from delta import configure_spark_with_delta_pip
        builder = configure_spark_with_delta_pip(builder)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(params.log_level)
    log.info("Spark %s session ready (master=%s)", spark.version, spark.sparkContext.master)
    return spark
