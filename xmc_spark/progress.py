"""Progress of long stages, in the driver's log and the executors' logs.

- Driver: while a pipeline stage runs, a daemon thread polls Spark's status tracker every
  ``spark.progress_seconds`` and logs the running Spark stages' task counts
  ("train: Spark stage 41: 5/8 tasks done, 2 running"), so a terminal, the spark-submit
  driver log and the Airflow task log all show that work is moving. On Spark Connect (no
  status tracker) a progress handler logs the same from the progress the server streams.
- Executors: kernels call :func:`worker_progress` with counts (rows scored, labels trained);
  each Python worker logs its running totals to its stderr (the executor log; the terminal in
  local mode) on the first call and then at most every 30 s (executor environment variable
  ``XMC_SPARK_PROGRESS_SECONDS``, e.g. ``spark.executorEnv.XMC_SPARK_PROGRESS_SECONDS``).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict

from .compat import is_connect

log = logging.getLogger("xmc_spark.progress")

INTERVAL_ENV = "XMC_SPARK_PROGRESS_SECONDS"


@contextmanager
def spark_progress(label: str, interval: float, spark=None):
    """Log the task progress of running Spark stages every ``interval`` s while the block runs.

    Classic Spark: a thread polls the status tracker. Spark Connect (``spark``, else the active
    Connect session): no status tracker, so a progress handler takes the stage progress the
    server streams with each query's results (``spark.connect.progress.reportInterval``); where
    neither is available the block runs unreported and one log line says so (never an error).
    """
    if interval <= 0:
        yield
        return
    from pyspark import SparkContext
    session = spark if spark is not None else _active_connect_session()
    if session is not None and is_connect(session):
        with _connect_progress(session, label, interval):
            yield
        return
    sc = SparkContext._active_spark_context
    if sc is None:
        _unavailable("no SparkContext in this process")
        yield
        return
    stop = threading.Event()

    def poll():
        tracker = sc.statusTracker()
        while not stop.wait(interval):
            try:
                for sid in sorted(tracker.getActiveStageIds()):
                    info = tracker.getStageInfo(sid)
                    if info is not None and info.numTasks:
                        log.info("%s: Spark stage %d: %d/%d tasks done, %d running", label, sid,
                                 info.numCompletedTasks, info.numTasks, info.numActiveTasks)
            except Exception:   # noqa: BLE001 - the context is stopping: reporting is best effort
                return

    t = threading.Thread(target=poll, name=f"xmc-progress-{label}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)


_said_unavailable = False


def _unavailable(why: str) -> None:
    global _said_unavailable
    if not _said_unavailable:
        _said_unavailable = True
        log.info("Spark stage progress is unavailable (%s): stages run without progress lines", why)


def _active_connect_session():
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
        return ConnectSession.getActiveSession()
    except Exception:  # noqa: BLE001 - no Connect client libraries: no Connect session either
        return None


class _ConnectProgressLog:
    """A Spark Connect progress handler: the running stages' task counts, at most every ``interval`` s."""

    def __init__(self, label: str, interval: float):
        self.label, self.interval, self.last = label, interval, time.monotonic()

    def __call__(self, stages, inflight_tasks, operation_id, done, **_):
        now = time.monotonic()
        if done or now - self.last < self.interval:
            return
        self.last = now
        for st in sorted(stages or [], key=lambda st: st.stage_id):
            if not st.done and st.num_tasks:
                log.info("%s: Spark stage %d: %d/%d tasks done, %d running (all stages)", self.label,
                         st.stage_id, st.num_completed_tasks, st.num_tasks, inflight_tasks)


@contextmanager
def _connect_progress(session, label: str, interval: float):
    handler = _ConnectProgressLog(label, interval)
    try:
        session.registerProgressHandler(handler)
    except Exception as e:  # noqa: BLE001 - an older client or server without progress reports
        _unavailable(f"Spark Connect session without progress handlers: {e.__class__.__name__}")
        yield
        return
    try:
        yield
    finally:
        try:
            session.removeProgressHandler(handler)
        except Exception:  # noqa: BLE001 - the session is stopping: nothing left to report
            pass


_totals: Dict[str, Dict[str, int]] = {}
_last: Dict[str, float] = {}
_worker_log = None


def worker_log() -> logging.Logger:
    """The ``xmc_spark.task`` logger of a Python worker (to stderr, INFO), for a task's own lines."""
    global _worker_log
    if _worker_log is None:
        _worker_log = logging.getLogger("xmc_spark.task")
        if not _worker_log.handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            _worker_log.addHandler(h)
            _worker_log.setLevel(logging.INFO)
            _worker_log.propagate = False
    return _worker_log


def worker_progress(kind: str, **counts: int) -> None:
    """Add ``counts`` to this worker's totals for ``kind``; log them on the first call and then
    at most once per interval (``XMC_SPARK_PROGRESS_SECONDS``, default 30)."""
    tot = _totals.setdefault(kind, {})
    for k, v in counts.items():
        tot[k] = tot.get(k, 0) + int(v)
    now = time.monotonic()
    interval = float(os.environ.get(INTERVAL_ENV, "30"))
    if kind not in _last or now - _last[kind] >= interval:
        _last[kind] = now
        try:
            from pyspark import TaskContext
            tc = TaskContext.get()
            where = f" (partition {tc.partitionId()}, attempt {tc.attemptNumber()})" if tc else ""
        except Exception:  # noqa: BLE001
            where = ""
        worker_log().info("%s: %s so far in worker %d%s", kind,
                          ", ".join(f"{v} {k}" for k, v in tot.items()), os.getpid(), where)
