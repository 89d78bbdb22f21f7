"""Readers and writers of Delta tables (atomic overwrite) and output folders."""
from __future__ import annotations

import logging

from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("xmc_spark.storage")


def is_delta(spark: SparkSession, path: str) -> bool:
    try:
        from delta.tables import DeltaTable
        return DeltaTable.isDeltaTable(spark, path)
    except Exception:  # noqa: BLE001 - non-existing paths, no Delta on the classpath
        return False


def write_delta(df: DataFrame, path: str, replace_where: str | None = None) -> None:
    """Overwrite a Delta table in one commit: a failed write leaves the previous version intact.

    With ``replace_where`` only the matching rows (e.g. one run date) are replaced.
    """
    w = df.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
    if replace_where:
        w = w.option("replaceWhere", replace_where)
    w.save(path)


def read_delta(spark: SparkSession, path: str) -> DataFrame:
    return spark.read.format("delta").load(path)


def table_version(spark: SparkSession, path: str) -> int:
    from delta.tables import DeltaTable
    return int(DeltaTable.forPath(spark, path).history(1).select("version").first()[0])
