"""worker_daemon: the Python workers of a local master import pyspark from its installed package,
not from the bytecode-less pyspark.zip Spark puts first on their path."""
import os
import sys
import zipfile
from importlib.metadata import version

import pyarrow as pa
import pytest

from xmc_spark.session import LOCAL_CONF, local_conf
from xmc_spark.worker_daemon import redundant_zips


def _package(root, name):
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    return root / name


def _zip(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pyspark/__init__.py", "")
    return str(path)


def test_only_zips_of_the_installed_packages_are_dropped(tmp_path):
    site = tmp_path / "site"
    pkg = _package(site, "pyspark")
    own = _zip(pkg / "python" / "lib" / "pyspark.zip")             # a pip install's own SPARK_HOME
    other = _zip(tmp_path / "spark-3.5" / "python" / "lib" / "pyspark.zip")   # another Spark's
    py4j = version("py4j")
    same = _zip(pkg / "python" / "lib" / f"py4j-{py4j}-src.zip")
    older = _zip(pkg / "python" / "lib" / "py4j-0.0.1-src.zip")
    # the installed py4j (this environment's) is found on the rest of the path
    py4j_dir = os.path.dirname(os.path.dirname(__import__("py4j").__file__))
    path = [own, same, older, other, str(site), py4j_dir]
    assert redundant_zips(path) == [own, same]
    # without an installed pyspark on the path nothing of pyspark's is dropped
    assert redundant_zips([own, other, py4j_dir]) == []
    # another Spark's zip first and no package copy of it: kept
    assert other not in redundant_zips([other, str(site), py4j_dir])


def test_local_conf_only_for_local_masters_running_this_python(monkeypatch):
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    assert local_conf("local[2]") == LOCAL_CONF
    assert local_conf("yarn") == {}
    assert local_conf("") == {}
    monkeypatch.setenv("PYSPARK_PYTHON", "/some/other/python")      # xmc_spark may not be installed there
    assert local_conf("local[2]") == {}


def test_the_workers_import_pyspark_from_the_package(spark):
    from xmc_spark.compat import is_connect
    if is_connect(spark):
        pytest.skip("the daemon module is a local master's setting")
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
