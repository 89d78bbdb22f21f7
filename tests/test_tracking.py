"""The MLflow wrapper: runs tagged with their process, orphans of dead processes failed, one
run per run key, the sqlite store's lock."""
import contextlib
import subprocess
import sys

import pytest

from xmc_spark.params import PipelineParams
from xmc_spark.tracking import Tracker, _sqlite_lock


@pytest.fixture()
def params(tmp_path):
    return PipelineParams().set_dotted("mlflow.tracking_uri", f"sqlite:///{tmp_path}/db/mlflow.db") \
        .set_dotted("mlflow.artifact_location", str(tmp_path / "artifacts")).mlflow


def test_a_run_left_running_by_a_dead_process_is_marked_failed(params):
    import mlflow
    t = Tracker(params)
    with t.run(run_name="alive") as r:
        alive = r.run_id
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(params.experiment)
    import socket
    orphan = client.create_run(exp.experiment_id, tags={"xmc_spark.host": socket.gethostname(),
                                                        "xmc_spark.pid": dead_pid}).info.run_id
    other_host = client.create_run(exp.experiment_id, tags={"xmc_spark.host": "elsewhere",
                                                            "xmc_spark.pid": dead_pid}).info.run_id
    assert client.get_run(orphan).info.status == "RUNNING"
    with Tracker(params).run(run_name="next") as r2:
        assert client.get_run(r2.run_id).data.tags["xmc_spark.pid"].isdigit()
    assert client.get_run(orphan).info.status == "FAILED"
    assert client.get_run(other_host).info.status == "RUNNING"      # not ours to judge
    assert client.get_run(alive).info.status == "FINISHED"


def test_stages_of_one_key_share_a_run_unless_params_differ(params):
    a = Tracker(params)
    with a.run_for_key("k1", "/root", {"tree.max_leaf_size": 4}):
        first = a.run_id
    b = Tracker(params)
    with b.run_for_key("k1", "/root", {"train.C": 1.0}):
        assert b.run_id == first                   # new params join the run
    c = Tracker(params)
    with c.run_for_key("k1", "/root", {"tree.max_leaf_size": 8}):
        assert c.run_id != first                   # a conflicting value: a new run
    d = Tracker(params)
    with d.run_for_key("k2", "/root", {"tree.max_leaf_size": 4}):
        assert d.run_id not in (first, c.run_id)


def test_metrics_names_and_disabled_tracking(params):
    import mlflow
    t = Tracker(params)
    with t.run():
        t.log_metrics({"p@1": 50.0, "flag": True, "name": "x"}, prefix="m.")
        t.log_series("obj", [3.0, 2.0])
    run = mlflow.get_run(t.run_id)
    assert run.data.metrics == {"m.p_at_1": 50.0, "m.flag": 1.0, "obj": 2.0}
    off = Tracker(params, enabled=False)
    with off.run():
        off.log_metrics({"x": 1.0})
    assert off.run_id is None


def test_sqlite_lock_is_exclusive(tmp_path):
    uri = f"sqlite:///{tmp_path}/sub/m.db"
    code = ("import fcntl,sys; f=open(sys.argv[1],'a')\n"
            "try:\n fcntl.flock(f, fcntl.LOCK_EX|fcntl.LOCK_NB); print('free')\n"
            "except BlockingIOError:\n print('held')")
    with _sqlite_lock(uri):
        assert (tmp_path / "sub").is_dir()
        held = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sub" / "m.db.lock")],
                              capture_output=True, text=True).stdout.strip()
    free = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sub" / "m.db.lock")],
                          capture_output=True, text=True).stdout.strip()
    assert (held, free) == ("held", "free")


def test_prepare_sets_the_store_up_before_the_first_tracker(params, monkeypatch):
    """The CLI's background preparation: it sets the store up, and the first Tracker of that store
    waits for it before its own setup (one at a time, for stores without the sqlite lock too)."""
    import threading
    import time

    import mlflow

    from xmc_spark import tracking
    calls = []
    real = Tracker._setup_locked

    def counted(self, ml, uri):
        background = threading.current_thread().name == "xmc-spark-prepare"
        if background:
            time.sleep(1.0)                 # slower than the caller: it must wait, not race
        calls.append(("background" if background else "caller", time.monotonic()))
        return real(self, ml, uri)

    monkeypatch.setattr(Tracker, "_setup_locked", counted)
    monkeypatch.setattr(tracking, "_sqlite_lock", lambda uri: contextlib.nullcontext())   # as a server store
    tracking.prepare(params)
    with Tracker(params).run(run_name="after") as r:
        assert mlflow.get_run(r.run_id).info.status == "RUNNING"
    assert [c[0] for c in calls] == ["background", "caller"]
    assert tracking._store_key(params) not in tracking._prepared         # waited for and forgotten


def test_prepare_without_tracking_only_imports(params):
    from xmc_spark import tracking
    off = params.__class__(**{**params.to_dict(), "enabled": False})
    tracking.prepare(off, imports=("xmc_spark.pipeline",))
    assert tracking._store_key(off) not in tracking._prepared           # nothing will wait for it
    tracking.settle()
    assert not tracking._started


def test_a_store_that_fails_in_the_background_fails_in_the_trackers_thread(params, tmp_path):
    from xmc_spark import tracking
    (tmp_path / "file").write_text("")
    bad = params.__class__(**{**params.to_dict(), "tracking_uri": f"sqlite:///{tmp_path}/file/sub/db"})
    tracking.prepare(bad)                                # logs at debug, raises nothing there
    thread = tracking._prepared[tracking._store_key(bad)]
    with pytest.raises(NotADirectoryError):             # the store's folder lies under a file
        with Tracker(bad).run(run_name="x"):
            pass
    assert not thread.is_alive() and tracking._store_key(bad) not in tracking._prepared
