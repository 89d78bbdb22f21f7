"""aggregated's DataFrame row index (RDD.zipWithIndex's stand-in, which Spark Connect lacks)
and the random groups of make-groups built on it."""
import pytest
from pyspark.sql import functions as F

from xmc_spark.compat import is_connect
from xmc_spark.stages import aggregated


@pytest.mark.connect
def test_row_index_follows_partition_then_row_order(spark):
    # partitions [0 1] [2 3 4] [5 6 7] [8 9]; the filter leaves the third one empty
    df = spark.range(0, 10, numPartitions=4).filter("id < 3 OR id > 7")
    got = sorted((r["_i"], r["id"]) for r in aggregated.with_row_index(df, "_i").collect())
    assert got == [(0, 0), (1, 1), (2, 2), (3, 8), (4, 9)]
    assert aggregated.with_row_index(df.filter("id < 0"), "_i").count() == 0


@pytest.mark.connect
def test_row_index_of_a_sorted_frame_equals_zip_with_index(spark):
    ranked = (spark.range(0, 500, numPartitions=5).withColumnRenamed("id", "sample_id")
              .orderBy(F.xxhash64("sample_id", F.lit(3)), "sample_id"))
    want = [(i, r["sample_id"]) for i, r in enumerate(ranked.collect())]          # the sort order
    got = sorted((r["_i"], r["sample_id"]) for r in aggregated.with_row_index(ranked, "_i").collect())
    assert got == want
    if not is_connect(spark):                       # and what the RDD API gave before
        assert got == [(int(i), int(r[0])) for r, i in ranked.rdd.zipWithIndex().collect()]
    groups = aggregated.random_groups(ranked, 7, 3).collect()
    assert sorted((r["sample_id"], r["group_id"]) for r in groups) == sorted((s, i // 7) for i, s in want)
