"""worker_daemon: the Python workers of a local master import pyspark from its installed package,
not from the bytecode-less pyspark.zip Spark puts first on their path."""
import os
import subprocess
import sys
import zipfile

import pyarrow as pa
import pytest

from xmc_spark.session import LOCAL_CONF, local_conf
from xmc_spark.worker_daemon import redundant_zips


def _package(site, name, version=None):
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("")
    if version:                     # installed metadata beside the package, as pip writes it
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site / name


def _zip(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pyspark/__init__.py", "")
    return str(path)


def test_only_zips_of_the_installed_packages_are_dropped(tmp_path):
    site = tmp_path / "site"
    pkg = _package(site, "pyspark")
    _package(site, "py4j", "0.10.9.9")
    lib = pkg / "python" / "lib"
    own = _zip(lib / "pyspark.zip")                                  # a pip install's own SPARK_HOME
    other = _zip(tmp_path / "spark-3.5" / "python" / "lib" / "pyspark.zip")   # another Spark's
    same = _zip(lib / "py4j-0.10.9.9-src.zip")
    older = _zip(lib / "py4j-0.10.9.7-src.zip")
    assert redundant_zips([own, same, older, other, str(site)]) == [own, same]
    # no installed pyspark or py4j on the rest of the path: every zip stays
    bare = tmp_path / "bare"
    bare.mkdir()
    assert redundant_zips([own, same, other, str(bare)]) == []
    # a py4j package without metadata: its version is unknown, so its zip stays
    site2 = tmp_path / "site2"
    _package(site2, "py4j")
    assert redundant_zips([same, str(site2)]) == []
    # an install that links its files from a cache (uv's symlink mode): the zip is still the package's
    site3 = tmp_path / "site3"
    pkg3 = _package(site3, "pyspark")
    (pkg3 / "python" / "lib").mkdir(parents=True)
    linked = pkg3 / "python" / "lib" / "pyspark.zip"
    linked.symlink_to(_zip(tmp_path / "cache" / "0f3a"))
    assert redundant_zips([str(linked), str(site3)]) == [str(linked)]


def test_the_daemon_module_starts_no_thread_and_imports_nothing_heavy():
    """pyspark's daemon forks its workers: no thread may run in it (pyarrow, numpy's BLAS and
    pandas start threads), so importing this module and choosing the zips must not load them."""
    code = ("import sys, threading, xmc_spark.worker_daemon as w; w.redundant_zips(sys.path); "
            "heavy = {'numpy', 'pyarrow', 'pandas', 'scipy', 'numba'} & {m.split('.')[0] for m in sys.modules}; "
            "print(threading.active_count(), sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "[]"], out


def test_local_conf_only_for_local_masters_running_this_python(monkeypatch):
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    assert local_conf("local[2]") == LOCAL_CONF
    assert local_conf("yarn") == {}
    assert local_conf("") == {}
    monkeypatch.setenv("PYSPARK_PYTHON", "/some/other/python")      # xmc_spark may not be installed there
    assert local_conf("local[2]") == {}


def _skip_without_the_daemon_module(spark):
    """Skip where the session's workers do not run :mod:`xmc_spark.worker_daemon`."""
    from xmc_spark.compat import is_connect
    if is_connect(spark):
        pytest.skip("the daemon module is a local master's setting")
    if os.environ.get("PYSPARK_PYTHON") != sys.executable:
        pytest.skip("the workers run another interpreter: local_conf leaves pyspark's own daemon")


def test_the_workers_import_pyspark_from_the_package(spark):
    _skip_without_the_daemon_module(spark)
    assert spark.sparkContext.getConf().get("spark.python.daemon.module") == "xmc_spark.worker_daemon"

    def where(batches):
        import pyspark
        import pyspark.worker
        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"pyspark": [pyspark.__file__], "worker": [pyspark.worker.__file__]})

    rows = spark.range(0, 2, 1, 2).mapInArrow(where, "pyspark string, worker string").collect()
    assert len(rows) == 2
    for r in rows:
        assert ".zip" not in r["pyspark"] and ".zip" not in r["worker"], r
        assert os.path.isfile(r["worker"])


class _Cycle:
    def __init__(self):
        self.me = self


def test_freezing_collects_each_tasks_cycles_and_the_frozen_ones_every_full_pass():
    """A task's garbage cycles are freed when it ends; what survives is frozen (the daemon's own
    collection then walks nothing); an object frozen alive that dies in a cycle later is freed
    at the next full pass (every ``full_every`` tasks), not before. A worker about to exit (no
    reuse, or a task's non-zero code) gets no pass."""
    import gc
    import weakref

    from xmc_spark.worker_daemon import freezing
    kept, refs = {}, {}

    def task(sock, authenticated):
        c = _Cycle()                       # garbage in a cycle when the task returns
        refs[sock] = weakref.ref(c)
        kept[sock] = _Cycle()              # survives the task, then dropped by a later one
        kept.pop(sock - 1, None)
        return 0

    try:
        gc.collect()
        frozen = gc.get_freeze_count()
        assert freezing(task, reuse=False)(0, False) == 0 and gc.get_freeze_count() == frozen
        assert freezing(lambda *a: 1, reuse=True)(0, False) == 1 and gc.get_freeze_count() == frozen
        run = freezing(task, full_every=3, reuse=True)
        assert run(1, False) == 0
        assert refs[1]() is None           # the task's cycle was collected
        assert gc.get_freeze_count() > 0 and sum(gc.get_count()) < 10
        survivor = weakref.ref(kept[1])
        run(2, False)                      # drops task 1's survivor: a frozen cycle now
        assert refs[2]() is None and survivor() is not None
        gc.collect()                       # as the daemon does: frozen objects are not walked
        assert survivor() is not None
        run(3, False)                      # the third task: a full pass
        assert survivor() is None
    finally:
        gc.unfreeze()


def test_the_workers_freeze_what_a_task_leaves(spark):
    """The local master's workers run :func:`freezing`: a reused worker holds frozen objects (its
    imports) after a task."""
    _skip_without_the_daemon_module(spark)

    def frozen(batches):
        import builtins
        import gc
        ran = getattr(builtins, "_xmc_test_tasks", 0)       # this worker's tasks of this test before
        builtins._xmc_test_tasks = ran + 1
        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"ran": [ran], "frozen": [gc.get_freeze_count()]})

    rows = []
    for _ in range(6):                            # until a worker runs this function a second time
        rows += [r for r in spark.range(0, 2, 1, 2).mapInArrow(frozen, "ran long, frozen long").collect()
                 if r["ran"] > 0]
        if rows:
            break
    assert rows and all(r["frozen"] > 10_000 for r in rows), rows
