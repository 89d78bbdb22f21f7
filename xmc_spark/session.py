"""The only place that builds a SparkSession."""
from __future__ import annotations

import logging
import os
import sys

from .errors import XmcError
from .params import SparkParams


class SparkStartError(XmcError):
    """The Spark session could not start (no cluster configuration, no Java, ...)."""

log = logging.getLogger("xmc_spark")

DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # pandas <-> Spark through Arrow (Spark 3.5's default is off; its row path rejects numpy
    # scalars inside list columns)
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}


def under_spark_submit() -> bool:
    """True in a Python driver started by spark-submit (its JVM is already running)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def delta_package() -> str:
    """The Maven coordinate of the Delta jars matching the installed delta-spark and pyspark
    (what ``delta_from_maven`` adds; pass it to ``spark-submit --packages``)."""
    from delta import configure_spark_with_delta_pip
    from pyspark.sql import SparkSession
    return configure_spark_with_delta_pip(SparkSession.builder)._options["spark.jars.packages"]


def get_spark(params: SparkParams | None = None):
    """SparkSession with Delta Lake configured.

    Locally (``spark.master`` set) the Python workers use this interpreter and Delta's jars come
    from Maven Central through ``spark.jars.packages`` (cached after the first run). Under
    spark-submit on a cluster set ``spark.master: ""`` and ``delta_from_maven: false`` when the
    platform already ships Delta (Databricks).
    """
    from pyspark.sql import SparkSession

    params = params or SparkParams()
    if under_spark_submit():
        # spark-submit already chose the master and resolved --packages/--jars: its flags win
        log.info("launched by spark-submit: master and packages come from its command line")
        params = SparkParams(**{**params.to_dict(), "master": "", "delta_from_maven": False})
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
    if params.master.startswith("yarn") and not (os.environ.get("HADOOP_CONF_DIR") or
                                                 os.environ.get("YARN_CONF_DIR")):
        raise SparkStartError(f"spark.master={params.master} needs HADOOP_CONF_DIR or YARN_CONF_DIR set to the "
                              "cluster's Hadoop configuration folder (or run under spark-submit on the cluster)")
    try:
        spark = builder.getOrCreate()
    except Exception as e:  # noqa: BLE001 - PySparkRuntimeError [JAVA_GATEWAY_EXITED] and kin
        if "JAVA_GATEWAY_EXITED" not in str(e) and "Java gateway" not in str(e):
            raise
        raise SparkStartError(f"Spark could not start (master={params.master or 'from spark-submit'}): the JVM "
                              f"exited; its own message is printed above this line. Check Java 17 is on PATH "
                              f"(JAVA_HOME) and the spark.* settings. ({e.__class__.__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    spark.sparkContext.setLogLevel(params.log_level)
    log.info("Spark %s session ready (master=%s)", spark.version, spark.sparkContext.master)
    return spark
