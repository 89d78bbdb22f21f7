"""Progress reporting: the driver logs running Spark stages' task counts; workers log totals."""
import logging
import time

import pytest

from xmc_spark import progress


def test_driver_logs_task_progress_of_a_running_stage(spark, caplog):
    def slow(batches):
        for b in batches:
            time.sleep(1.0)
            yield b

    caplog.set_level(logging.INFO, logger="xmc_spark.progress")
    with progress.spark_progress("demo", 0.25):
        n = spark.range(0, 8, numPartitions=4).mapInArrow(slow, "id long").count()
    assert n == 8
    msgs = [r.getMessage() for r in caplog.records if r.name == "xmc_spark.progress"]
    assert any(m.startswith("demo: Spark stage ") and "/4 tasks done" in m for m in msgs), msgs
    # the poller stops with the block
    caplog.clear()
    time.sleep(0.6)
    assert not [r for r in caplog.records if r.name == "xmc_spark.progress"]


def test_worker_progress_totals_first_call_then_throttled(capfd, monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "3600")
    progress._totals.clear()
    progress._last.clear()
    progress.worker_progress("predict", rows_scored=100)
    progress.worker_progress("predict", rows_scored=50)       # within the interval: counted, not logged
    err = capfd.readouterr().err
    assert "predict: 100 rows_scored so far in worker" in err and "150 rows_scored" not in err
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")
    progress.worker_progress("predict", rows_scored=1)
    assert "predict: 151 rows_scored so far" in capfd.readouterr().err


@pytest.mark.connect
def test_connect_progress_comes_from_the_progress_handler(connect_spark, caplog):
    spark = connect_spark

    def slow(batches):
        for b in batches:
            time.sleep(1.0)
            yield b

    spark.conf.set("spark.connect.progress.reportInterval", "200ms")
    caplog.set_level(logging.INFO, logger="xmc_spark.progress")
    with progress.spark_progress("demo", 0.25):          # the active Connect session's progress
        n = spark.range(0, 8, numPartitions=4).mapInArrow(slow, "id long").count()
    assert n == 8
    msgs = [r.getMessage() for r in caplog.records if r.name == "xmc_spark.progress"]
    assert any(m.startswith("demo: Spark stage ") and "/4 tasks done" in m for m in msgs), msgs
    caplog.clear()
    spark.range(0, 4, numPartitions=4).mapInArrow(slow, "id long").count()      # handler removed
    assert not [r for r in caplog.records if r.name == "xmc_spark.progress"]


def test_no_context_no_crash(caplog, monkeypatch):
    # no SparkContext and no Connect session: the block runs, one line says progress is unavailable
    from pyspark import SparkContext
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    monkeypatch.setattr(progress, "_active_connect_session", lambda: None)
    monkeypatch.setattr(progress, "_said_unavailable", False)
    caplog.set_level(logging.INFO, logger="xmc_spark.progress")
    with progress.spark_progress("demo", 0.1):
        ran = True
    assert ran and any("progress is unavailable" in r.getMessage() for r in caplog.records)
