"""session: spark.remote selects Spark Connect; the checks that need no server run here, the
Connect session itself in tests/test_connect_suite.py's process."""
import pytest

from xmc_spark.params import SparkParams
from xmc_spark.session import SparkStartError, capped_python_conf, get_spark, redact_remote


def test_remote_token_is_masked():
    assert redact_remote("sc://host:443/;token=abc123;x-databricks-cluster-id=9") == \
        "sc://host:443/;token=***;x-databricks-cluster-id=9"
    assert redact_remote("local[2]") == "local[2]"


def test_bad_remote_is_named():
    with pytest.raises(SparkStartError, match=r"spark.remote='yarn'.*sc://host:port or local\[N\]"):
        get_spark(SparkParams(remote="yarn"))


@pytest.mark.connect
def test_connect_session_has_delta_and_the_conf(connect_spark, tmp_path):
    spark = connect_spark
    assert spark.conf.get("spark.sql.extensions") == "io.delta.sql.DeltaSparkSessionExtension"
    assert spark.conf.get("spark.sql.shuffle.partitions") == "4"          # tests/conftest.py's conf
    path = str(tmp_path / "t")
    spark.range(3).write.format("delta").save(path)
    assert sorted(r["id"] for r in spark.read.format("delta").load(path).collect()) == [0, 1, 2]
    # in this process PySpark's builder now hands out the Connect session: get_spark takes it as is
    assert get_spark(SparkParams(master="local[1]")) is spark


def test_a_python_memory_cap_moves_arrow_to_the_system_allocator():
    """Under spark.executor.pyspark.memory (an address-space limit per worker) pyarrow's mimalloc
    would reserve a 1 GiB arena: the workers get the system allocator instead."""
    assert capped_python_conf({"spark.master": "local[2]"}) == {}
    assert capped_python_conf({"spark.executor.pyspark.memory": "2g"}) == {
        "spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL": "system"}
