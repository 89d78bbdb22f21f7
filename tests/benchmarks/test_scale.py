"""benchmarks/scale.py's event-log reading (no Spark: hand-written event logs) and its reading of
the Python workers' memory."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from scale import read_event_log, table  # noqa: E402


def job(jid, t, stages, tag=None):
    tags = f"spark-session-x-thread-1-xmc-stage-{tag}" if tag else "spark-session-x-execution-root-id-3"
    return {"Event": "SparkListenerJobStart", "Job ID": jid, "Submission Time": t, "Stage IDs": stages,
            "Properties": {"spark.job.tags": tags}}


def task(sid, rows, nbytes, rss=0):
    return {"Event": "SparkListenerTaskEnd", "Stage ID": sid,
            "Task Metrics": {"Result Size": nbytes, "Shuffle Read Metrics": {"Total Records Read": rows}},
            "Task Executor Metrics": {"ProcessTreePythonRSSMemory": rss}}


def test_untagged_jobs_go_to_the_stage_running_then_and_stages_count_once(tmp_path):
    """Jobs run off the tagging thread (an Arrow collection) belong to the stage whose first tagged
    job came last before them; a stage listed again by a later job (skipped) counts once; the
    rolling files are read in index order (events_10 after events_2), whatever the names' order."""
    d = tmp_path / "log"
    d.mkdir()
    first = [job(0, 100, [0], "ingest"), task(0, 5, 1000), job(1, 200, [1], "train"), task(1, 70, 2000, rss=3 << 20)]
    second = [job(2, 250, [2]), task(2, 900, 50, rss=5 << 20),        # untagged, inside train
              job(3, 300, [3], "predict"), task(3, 40, 700),
              job(4, 310, [3, 4]), task(4, 10, 30),                   # stage 3 again (skipped): once
              job(5, 50, [5]), task(5, 1, 1)]                         # before any tagged job
    (d / "events_2_app").write_text("\n".join(json.dumps(e) for e in first) + "\n")
    (d / "events_10_app").write_text("\n".join(json.dumps(e) for e in second) + "\n{truncated")
    (d / "appstatus_app").write_text("")
    r = read_event_log(d)
    assert r["max_task_shuffle_rows"] == {"ingest": 5, "train": 900, "predict": 40, "untagged": 1, "all": 900}
    assert r["result_bytes"] == {"ingest": 1000, "train": 2050, "predict": 730, "untagged": 1, "all": 3781}
    assert r["peak_python_rss"] == 5 << 20
    assert r["peak_python_rss_by_stage"] == {"ingest": 0, "train": 5 << 20, "predict": 0, "untagged": 0}


def test_the_table_counts_the_embedding_once():
    """The pipeline's tree stage holds the embedding's seconds: the embedding+tree column is the
    tree stage's seconds, not their sum with the embedding's."""
    row = {"n": 1000, "labels": 10, "features": 20, "model_layout": "whole", "process_seconds": 50.0,
           "seconds": {"ingest": 3.0, "embedding": 4.0, "tree": 10.0, "train": 20.0, "predict": 5.0},
           "max_task_rows_over_n": {"train": 0.5, "all": 0.5}, "result_bytes": {"all": 2 ** 20},
           "weights_bytes": 2 ** 21, "peak_python_rss_mb": 100.0, "p@1": 90.0, "p@3": 60.0, "p@5": 40.0}
    cells = [c.strip() for c in table([row]).splitlines()[2].split("|")[1:-1]]
    assert cells[4:8] == ["3", "10", "20", "5"] and cells[11] == "50.0%" and cells[12] == "100.0"
    row["peak_python_rss_mb_by_stage"] = {"ingest": 40.0, "train": 90.0, "predict": 60.0}
    assert table([row]).splitlines()[2].split("|")[13].strip() == "100.0 (train 90.0)"
    row["peak_python_rss_mb_by_stage"] = {"ingest": 0.0, "train": 0.0}       # none measured
    assert table([row]).splitlines()[2].split("|")[13].strip() == "100.0"
    row["peak_worker_rss_mb"], row["peak_worker_rss_mb_by_stage"] = 70.0, {"ingest": 30.0, "train": 70.0}
    assert table([row]).splitlines()[2].split("|")[14].strip() == "70.0 (train 70.0)"


def test_worker_rss_is_attributed_to_the_stage_running_then():
    """Each sample goes to the stage whose first tagged job came last at or before it."""
    from scale import WorkerRSS
    rss = WorkerRSS(0)
    rss.samples = [(50, 1), (100, 5), (150, 7), (200, 3), (260, 9), (300, 2)]
    assert rss.peaks([(100, "ingest"), (200, "train"), (300, "predict")]) == {
        "untagged": 1, "ingest": 7, "train": 9, "predict": 2, "all": 9}


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc (Linux)")
def test_worker_rss_reads_the_python_processes_under_the_jvm(tmp_path):
    """A process named ``java`` (Python under that name) starts a Python child holding 200 MB:
    its RSS is read; the ``java`` process itself and processes outside it are not."""
    java = tmp_path / "java"
    java.symlink_to(sys.executable)
    child = ("import os, sys, numpy as np; a = np.ones(200 << 17); print(os.getpid(), flush=True); "
             "sys.stdin.read()")
    parent = f"import subprocess, sys; subprocess.run([sys.argv[1], '-c', {child!r}], stdin=sys.stdin)"
    import subprocess
    jvm = subprocess.Popen([str(java), "-c", parent, sys.executable], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    try:
        pid = int(jvm.stdout.readline())
        from scale import WorkerRSS
        with WorkerRSS(os.getpid(), every=0.05) as rss:
            time.sleep(0.5)
        assert rss._workers() == [pid]             # not the "java" process, nor this one
        assert rss.samples and 200 << 20 <= rss.peaks([])["all"] < 400 << 20
    finally:
        jvm.communicate("")
