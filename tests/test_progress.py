"""Progress reporting: the driver logs running Spark stages' task counts; workers log totals."""
import logging
import time

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
    assert "predict: 100 rows_scored so far in worker" in err and "150" not in err
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")
    progress.worker_progress("predict", rows_scored=1)
    assert "predict: 151 rows_scored so far" in capfd.readouterr().err
