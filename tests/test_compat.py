"""compat: one API over classic Spark (broadcasts, SparkContext) and Spark Connect (values in
the closure, no SparkContext). Tests taking ``connect_spark`` run in tests/test_connect_suite.py's
Spark Connect process; the others run on the classic session."""
import pickle

import numpy as np
import pandas as pd
import pytest
from pyspark import cloudpickle

from xmc_spark import compat


def _sum_in_tasks(spark, shared):
    """Every task reads ``shared.value`` (an array) and adds its sum to its row ids."""
    def add(batches):
        for b in batches:
            yield pd.DataFrame({"x": b["id"] + int(shared.value.sum())})
    return sorted(r["x"] for r in spark.range(0, 6, numPartitions=3).mapInPandas(add, "x long").collect())


def test_captured_ships_the_pickled_bytes_and_loads_once():
    value = (np.arange(1000), {"k": lambda x: x + 1})
    c = compat.Captured(value)
    assert c.value is value and c.nbytes > 8000
    back = pickle.loads(cloudpickle.dumps(lambda: c))()        # what a task's closure holds
    assert not back._loaded and back.value[1]["k"](1) == 2
    assert np.array_equal(back.value[0], value[0]) and back.value is back.value   # unpickled once
    back.unpersist()
    back.destroy()


def test_is_connect_of_classic_session_and_frame(spark):
    assert not compat.is_connect(spark) and not compat.is_connect(spark.range(1))
    assert not compat.is_connect(object())


@pytest.mark.connect
def test_share_in_tasks(spark):
    got = _sum_in_tasks(spark, compat.share(spark, np.arange(10)))
    assert got == [45 + i for i in range(6)]
    kind = compat.Captured if compat.is_connect(spark) else type(spark.sparkContext.broadcast(0))
    assert isinstance(compat.share(spark.range(1), 1), kind)      # a DataFrame names its session too


@pytest.mark.connect
def test_default_parallelism(spark):
    # the test session sets spark.default.parallelism = 2 (tests/conftest.py)
    assert compat.default_parallelism(spark) == 2


def test_default_parallelism_is_the_context_s_on_classic(spark):
    assert compat.default_parallelism(spark) == spark.sparkContext.defaultParallelism


@pytest.mark.connect
def test_task_slots_of_a_local_master_else_the_default_parallelism(spark):
    """The tests' session runs local[2,2] with a default parallelism of 2; the parse of local masters."""
    import os

    from xmc_spark.compat import local_slots, task_slots
    assert task_slots(spark) == 2
    assert [local_slots(m) for m in ("local[3]", "local[4,2]", "yarn", "spark://h:7077", "local-cluster[2,1,1024]")] \
        == [3, 4, None, None, None]
    assert local_slots("local[*]") == local_slots("local") == max(1, os.cpu_count() or 1)


def test_connect_share_is_captured_and_size_capped(connect_spark):
    spark = connect_spark
    c = compat.share(spark, np.arange(10))
    assert isinstance(c, compat.Captured) and compat.is_connect(spark.range(1))
    with pytest.raises(compat.ShareTooLargeError, match=r"the big table is 1\.\d MiB.*limit 1 MiB"):
        compat.share(spark, np.zeros(200_000), max_mb=1, name="the big table")


@pytest.mark.connect
def test_range_partitions_is_the_leaf_parallelism(spark):
    # what default_parallelism falls back to on Connect without the settings
    assert compat.range_partitions(spark) == 2
    if not compat.is_connect(spark):
        return              # classic PySpark's range takes sparkContext.defaultParallelism itself
    spark.conf.set("spark.sql.leafNodeDefaultParallelism", "3")
    try:
        assert compat.range_partitions(spark) == 3
        assert compat.default_parallelism(spark) == 2     # spark.default.parallelism comes first
    finally:
        spark.conf.unset("spark.sql.leafNodeDefaultParallelism")


def test_never_broadcast_joins_shuffled(spark, tmp_path):
    """A side small enough to be broadcast is shuffled instead (a shuffled hash join)."""
    from tests.conftest import executed_plan
    spark.range(3).write.parquet(str(tmp_path / "a"))
    a = spark.read.parquet(str(tmp_path / "a"))
    assert "BroadcastExchange" in executed_plan(spark.range(10).join(a, "id"))
    plan = executed_plan(spark.range(10).join(compat.never_broadcast(a), "id"))
    assert "ShuffledHashJoin" in plan and "BroadcastExchange" not in plan


def test_spark_hash_and_partition_keys_match_spark(spark):
    """spark_hash_int is Spark SQL's hash() of an int, and repartition(n, part) sends each of
    partition_keys(n) to its own partition r."""
    ids = np.concatenate([np.arange(-300, 300), [2**31 - 1, -2**31, 123456789]])
    got = spark.createDataFrame([(int(i),) for i in ids], "v int").selectExpr("v", "hash(v) AS h").collect()
    np.testing.assert_array_equal(compat.spark_hash_int([r["v"] for r in got]), [r["h"] for r in got])
    for n in (1, 7, 64):
        keys = compat.partition_keys(n)
        parts = spark.createDataFrame([(int(k),) for k in keys], "part int").repartition(n, "part") \
            .rdd.glom().map(lambda rows: [r["part"] for r in rows]).collect()
        assert parts == [[int(k)] for k in keys]


def test_partitioned_checkpoint_keeps_its_partitioning_for_a_join(spark):
    """A join on the key of a partitioned checkpoint shuffles only the other side, into the
    checkpoint's partitions (a plain localCheckpoint under adaptive execution: both sides, into
    spark.sql.shuffle.partitions); the rows are the same, and the session's setting is restored."""
    from pyspark.sql import functions as F
    before = spark.conf.get("spark.sql.adaptive.enabled")
    rows = spark.range(200).select(F.col("id").alias("k"), (F.col("id") * 3).alias("v"))
    other = spark.range(200).select(F.col("id").alias("k"), (F.col("id") % 7).alias("w"))
    kept = compat.partitioned_checkpoint(rows, 3, "k")
    assert spark.conf.get("spark.sql.adaptive.enabled") == before and kept.rdd.getNumPartitions() == 3

    def exchanges(df):
        import re

        from tests.conftest import executed_plan
        joined = other.join(compat.never_broadcast(df), "k")
        return joined, re.findall(r"Exchange hashpartitioning\(k#\d+L, (\d+)\)", executed_plan(joined))

    joined, parts = exchanges(kept)
    assert parts == ["3"]                        # the other side only, into the checkpoint's 3 partitions
    assert sorted(joined.select("k", "v", "w").collect()) == [(k, 3 * k, k % 7) for k in range(200)]
    _, parts_plain = exchanges(rows.repartition(3, "k").localCheckpoint())   # under adaptive execution
    assert len(parts_plain) == 2
    # a grouping after the repartition keeps it too (kept_checkpoint: the sharded search's beam),
    # and a join of two such checkpoints in equal partitions shuffles neither side
    grouped = compat.kept_checkpoint(rows.repartition(3, "k").groupBy("k").agg(F.sum("v").alias("v")))
    joined = grouped.join(compat.never_broadcast(kept.withColumnRenamed("v", "v2")), "k")
    from tests.conftest import executed_plan
    assert "Exchange" not in executed_plan(joined) and joined.rdd.getNumPartitions() == 3
    assert sorted(joined.select("k", "v", "v2").collect()) == [(k, 3 * k, 3 * k) for k in range(200)]


def test_session_settings_restore_and_survive_a_refusal(spark, monkeypatch, caplog):
    """Settings hold inside the block and are restored (or unset) after it, also after an error;
    a setting the server refuses keeps its value with a warning, and a partitioned checkpoint then
    still holds the rows."""
    key, unset_key = "spark.sql.adaptive.enabled", "spark.xmc.test.unset"
    before = spark.conf.get(key)
    with pytest.raises(RuntimeError):
        with compat.session_settings(spark, {key: "false", unset_key: "1"}, "a test"):
            assert spark.conf.get(key) == "false" and spark.conf.get(unset_key) == "1"
            raise RuntimeError("inside")
    assert spark.conf.get(key) == before and spark.conf.get(unset_key, None) is None
    real_set = spark.conf.set

    def refuse(k, v):
        if k == key:
            raise ValueError("not allowed here")
        real_set(k, v)
    monkeypatch.setattr(spark.conf, "set", refuse)
    with caplog.at_level("WARNING", logger="xmc_spark.compat"):
        kept = compat.partitioned_checkpoint(spark.range(50).withColumnRenamed("id", "k"), 3, "k")
    assert "could not set spark.sql.adaptive.enabled=false" in caplog.text
    assert sorted(r["k"] for r in kept.collect()) == list(range(50)) and spark.conf.get(key) == before


@pytest.mark.parametrize("adaptive,coalesce,want", [("true", "true", True), ("false", "true", False),
                                                     ("true", "false", False), ("TRUE ", "True", True)])
def test_coalescing_needs_adaptive_execution_and_its_coalescing(spark, adaptive, coalesce, want):
    keys = {"spark.sql.adaptive.enabled": adaptive, "spark.sql.adaptive.coalescePartitions.enabled": coalesce}
    with compat.session_settings(spark, keys, "the test"):
        assert compat.coalescing(spark) is want


def test_sized_partitions_follow_the_rows_between_the_parallelism_and_the_shuffle_partitions(spark):
    """TASK_ROWS rows a task, at least the default parallelism, at most the shuffle partitions
    (none when 'auto'); the bounds read from the session by default."""
    per = compat.TASK_ROWS
    assert compat.sized_partitions(spark, 0, bounds=(2, 64)) == 2
    assert compat.sized_partitions(spark, 3 * per, bounds=(2, 64)) == 3
    assert compat.sized_partitions(spark, 3 * per + 1, bounds=(2, 64)) == 4
    assert compat.sized_partitions(spark, 1000 * per, bounds=(2, 64)) == 64
    assert compat.sized_partitions(spark, 1000 * per, bounds=(2, None)) == 1000
    assert compat.sized_partitions(spark, 10, per_task=1, bounds=(2, 64)) == 10
    dp = compat.default_parallelism(spark)
    assert compat.sized_partitions(spark, 1) == min(dp, compat.shuffle_partitions(spark))
