"""Delta tables: run-keyed partitions, pinned reads, links, schema checks on read, conflicts."""
import pytest
from pyspark.sql import functions as F

from xmc_spark.schemas import SchemaError
from xmc_spark.storage import (
    RunKeyError,
    Tables,
    check_run_key,
    has_delta_log,
    is_conflict,
    is_local_path,
    list_names,
    path_kind,
    read_delta,
    table_version,
    write_delta,
)


def test_run_keys_and_paths():
    assert check_run_key("2026-11-25") == "2026-11-25"
    for bad in ("", "a b", "x' OR '1'='1", "-lead", "k" * 65):
        with pytest.raises(RunKeyError, match="run key"):
            check_run_key(bad)
    assert is_local_path("/tmp/x") and is_local_path("rel/x")
    assert not any(is_local_path(p) for p in ("s3://b/x", "abfss://c@a.dfs.core.windows.net/x", "dbfs:/x"))


@pytest.mark.connect
def test_keyed_writes_replace_one_partition_and_pins_read_old_versions(spark, tmp_path):
    t1, t2 = Tables(spark, tmp_path, "k1"), Tables(spark, tmp_path, "k2")
    rows = "metric string, value double"
    t1.write("metrics", spark.createDataFrame([("p@1", 1.0)], rows))
    t2.write("metrics", spark.createDataFrame([("p@1", 2.0)], rows))
    v = t1.version("metrics")
    t1.write("metrics", spark.createDataFrame([("p@1", 3.0), ("p@3", 4.0)], rows))
    assert sorted(tuple(r) for r in t1.read("metrics").collect()) == [("p@1", 3.0), ("p@3", 4.0)]
    assert [tuple(r) for r in t2.read("metrics").collect()] == [("p@1", 2.0)]
    assert t1.reads["metrics"] == table_version(spark, t1.path("metrics")) == v + 1
    pinned = Tables(spark, tmp_path, "k1", pins={"metrics": v})
    assert [tuple(r) for r in pinned.read("metrics").collect()] == [("p@1", 1.0)]
    assert pinned.reads == {"metrics": v}
    # `where` narrows the replaced rows inside the key
    t1.write("metrics", spark.createDataFrame([("p@3", 5.0)], rows), where="metric = 'p@3'")
    assert sorted(tuple(r) for r in t1.read("metrics").collect()) == [("p@1", 3.0), ("p@3", 5.0)]


def test_links_and_schema_checked_on_read(spark, tmp_path):
    write_delta(spark.createDataFrame([(1, "x")], "metric long, value string"), str(tmp_path / "elsewhere"))
    t = Tables(spark, tmp_path / "root", links={"metrics": str(tmp_path / "elsewhere")})
    assert t.path("metrics") == str(tmp_path / "elsewhere") and t.path("tree") == f"{tmp_path}/root/tree"
    with pytest.raises(SchemaError, match=r"elsewhere: table 'metrics': column 'metric' has type bigint, "
                                          r"expected string"):
        t.read("metrics")
    assert read_delta(spark, str(tmp_path / "elsewhere")).count() == 1     # the raw reader does not check


def test_two_keys_written_at_once_into_a_fresh_table(spark, tmp_path):
    """Two writers (threads: two Delta transactions of one session) create and fill one fresh
    keyed table at once, three times over: both commits land (when they collide, the second
    retries), each key holds its own rows. tests/test_runner.py (on demand) does it with two
    processes."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    rows = "metric string, value double"
    for round_ in range(3):
        path, start = str(tmp_path / f"t{round_}"), threading.Barrier(2)

        def write(key, value, path=path, start=start):
            df = spark.createDataFrame([("p@1", value), ("p@3", value)], rows)
            start.wait(timeout=60)                       # both transactions start together
            write_delta(df, path, key)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(write, ["ka", "kb"], [1.0, 2.0]))
        got = sorted(tuple(r) for r in read_delta(spark, path).select("run_key", "metric", "value").collect())
        assert got == [("ka", "p@1", 1.0), ("ka", "p@3", 1.0), ("kb", "p@1", 2.0), ("kb", "p@3", 2.0)]


def test_conflicts_are_told_from_other_errors():
    assert is_conflict(RuntimeError("[DELTA_PROTOCOL_CHANGED] The protocol version of the Delta table ..."))
    assert is_conflict(Exception("io.delta.exceptions.ConcurrentAppendException: Files were added ..."))
    assert not is_conflict(ValueError("[DELTA_MISSING_DELTA_TABLE] x is not a Delta table"))


@pytest.mark.connect
def test_path_probing_through_hadoop(spark, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("x")
    (tmp_path / "d" / "a").mkdir()
    assert path_kind(spark, str(tmp_path / "d")) == "dir"
    assert path_kind(spark, str(tmp_path / "d" / "b.txt")) == "file"
    assert path_kind(spark, f"file://{tmp_path}/d/b.txt") == "file"          # a scheme, as s3:// would be
    assert path_kind(spark, str(tmp_path / "nope")) is None
    assert list_names(spark, str(tmp_path / "d")) == ["a", "b.txt"]
    assert list_names(spark, str(tmp_path / "d" / "b.txt")) == []


def _encodings(path):
    """{(file, column): (compression, encodings)} of every column chunk of a table's data files."""
    import pyarrow.parquet as pq
    out = {}
    for f in path.glob("*.parquet"):
        md = pq.ParquetFile(f).metadata
        for g in range(md.num_row_groups):
            for c in range(md.num_columns):
                col = md.row_group(g).column(c)
                out[f.name, col.path_in_schema] = (col.compression, col.encodings)
    assert out
    return out


@pytest.mark.connect
def test_tables_are_zstd_parquet_without_dictionaries(spark, tmp_path):
    """spark.conf's default codec is zstd, and write_delta writes without Parquet dictionaries (a
    list column of 7 distinct ids, which Parquet would dictionary-encode) unless the session
    chose; the session's setting is as before after the write."""
    from xmc_spark.compat import conf_value
    ids = F.array((F.col("id") % 7).cast("int"), (F.col("id") % 5).cast("int"))
    df = spark.range(5000).select("id", ids.alias("ids"))
    assert conf_value(spark, "parquet.enable.dictionary") is None
    write_delta(df, str(tmp_path / "t"))
    assert conf_value(spark, "parquet.enable.dictionary") is None
    for key, (codec, enc) in _encodings(tmp_path / "t").items():
        assert codec == "ZSTD", key
        assert not any("DICTIONARY" in e for e in enc), (key, enc)
    spark.conf.set("parquet.enable.dictionary", "true")         # the session's choice wins
    try:
        write_delta(df, str(tmp_path / "u"), run_key="r1")
        assert spark.conf.get("parquet.enable.dictionary") == "true"
    finally:
        spark.conf.unset("parquet.enable.dictionary")
    enc = _encodings(tmp_path / "u" / "run_key=r1")
    assert any("DICTIONARY" in e for key, (_, es) in enc.items() if key[1] == "ids.list.element" for e in es)


def test_a_new_table_is_created_then_overwritten(spark, tmp_path, monkeypatch):
    """A table that is not there is created (Delta's mode ErrorIfExists: no listing of an empty
    table's files to remove), also in a folder of stray files without a log; one that is there, or
    a log without a commit, is overwritten (mode Overwrite, its schema too); a create whose table
    appeared after the check fails and leaves that table as it was."""
    from delta.tables import DeltaTable

    from xmc_spark import storage
    path = str(tmp_path / "t")
    assert not has_delta_log(spark, path)
    write_delta(spark.createDataFrame([(1, "a")], "id long, v string"), path)
    assert has_delta_log(spark, path)
    write_delta(spark.createDataFrame([(2.5,)], "x double"), path)          # another schema
    assert [tuple(r) for r in read_delta(spark, path).collect()] == [(2.5,)]
    modes = [r["operationParameters"]["mode"]
             for r in DeltaTable.forPath(spark, path).history().orderBy("version").collect()]
    assert modes == ["ErrorIfExists", "Overwrite"]
    stray = tmp_path / "stray"                   # files but no log (a failed first write's): created
    stray.mkdir()
    (stray / "part-0.parquet").write_bytes(b"not read")
    write_delta(spark.createDataFrame([(7,)], "id long"), str(stray))
    assert [tuple(r) for r in read_delta(spark, str(stray)).collect()] == [(7,)]
    (tmp_path / "empty" / "_delta_log").mkdir(parents=True)       # a log with no commit: overwritten
    write_delta(spark.createDataFrame([(8,)], "id long"), str(tmp_path / "empty"))
    assert [r["operationParameters"]["mode"] for r in DeltaTable.forPath(spark, str(tmp_path / "empty")).history()
            .collect()] == ["Overwrite"]
    monkeypatch.setattr(storage, "has_delta_log", lambda spark, path: False)   # the table appears in between
    with pytest.raises(Exception, match="already exist"):       # DELTA_PATH_EXISTS
        write_delta(spark.createDataFrame([(9.0,)], "x double"), path)
    assert [tuple(r) for r in read_delta(spark, path).collect()] == [(2.5,)] and table_version(spark, path) == 1


def test_write_whole_leaves_the_file_whole_or_absent(tmp_path):
    """On a local file system the file appears only complete (a renamed temporary file); a write
    that fails leaves no file under the name."""
    import pyarrow.fs as pafs

    from xmc_spark.storage import write_whole
    fs = pafs.LocalFileSystem()
    write_whole(fs, str(tmp_path / "a"), lambda f: f.write(b"abc"))
    assert (tmp_path / "a").read_bytes() == b"abc"

    def fail(f):
        f.write(b"half")
        raise RuntimeError("stop")
    with pytest.raises(RuntimeError, match="stop"):
        write_whole(fs, str(tmp_path / "b"), fail)
    assert not (tmp_path / "b").exists()
    # only the temporary file is left (a run folder's scratch is removed whole)
    assert [p.name.startswith("b.tmp-") for p in tmp_path.iterdir() if p.name.startswith("b")] == [True]


def test_a_tables_first_version_is_read_from_its_log_entry(spark, tmp_path, monkeypatch):
    """Version 0 of a table is read as the Parquet files its log entry adds (of a run key's table,
    that key's): the rows and column types of Delta's own read, no Delta file index in the plan,
    stray files in the folder not read; too many files, or an entry too big, go through Delta."""
    from tests.conftest import executed_plan
    from xmc_spark import storage
    from xmc_spark.storage import version_files
    path = str(tmp_path / "t")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "part-stray.parquet").write_bytes(b"not a table's file")
    df = spark.range(1000).select("id", F.array((F.col("id") % 7).cast("int")).alias("ids"),
                                  (F.col("id") / 3).cast("float").alias("x"))
    write_delta(df.repartition(3), path)
    schema, files = version_files(spark, path, 0)
    assert len(files) == 3 and all(f.startswith(path + "/part-") and "stray" not in f for f in files)
    fast = read_delta(spark, path, version=0)
    delta = spark.read.format("delta").option("versionAsOf", 0).load(path)
    plan = executed_plan(fast)
    assert "InMemoryFileIndex" in plan and "DeltaFileIndex" not in plan and "Tahoe" not in plan, plan
    assert [(f.name, f.dataType) for f in fast.schema] == [(f.name, f.dataType) for f in delta.schema]
    assert sorted(map(tuple, fast.collect())) == sorted(map(tuple, delta.collect()))
    keyed = str(tmp_path / "k")
    write_delta(df, keyed, run_key="r1")           # partitioned by run key: read as that key's files
    assert version_files(spark, keyed, 0) is None and read_delta(spark, keyed, "r1", version=0).count() == 1000
    assert "InMemoryFileIndex" in executed_plan(read_delta(spark, keyed, "r1", version=0))
    assert version_files(spark, str(tmp_path / "none"), 0) is None   # no log
    monkeypatch.setattr(storage, "ENTRY_BYTES", 100)                  # an entry too big to read
    assert version_files(spark, path, 0) is None
    monkeypatch.undo()
    spark.conf.set("spark.sql.sources.parallelPartitionDiscovery.threshold", "2")
    try:                                 # more files than Spark lists without a job: Delta's read
        assert version_files(spark, path, 0) is None
    finally:
        spark.conf.unset("spark.sql.sources.parallelPartitionDiscovery.threshold")
    t = Tables(spark, tmp_path / "root")                             # a run's own new table, unpinned
    t.write("metrics", spark.createDataFrame([("p@1", 1.0)], "metric string, value double"))
    assert "InMemoryFileIndex" in executed_plan(t.read("metrics")) and t.reads == {"metrics": 0}
    assert [tuple(r) for r in t.read("metrics").collect()] == [("p@1", 1.0)]
    k = Tables(spark, tmp_path / "keyed_root", "r1")                # a run key's table, unpinned
    k.write("metrics", spark.createDataFrame([("p@1", 2.0)], "metric string, value double"))
    assert "InMemoryFileIndex" in executed_plan(k.read("metrics")) and k.reads == {"metrics": 0}
    assert [tuple(r) for r in k.read("metrics").collect()] == [("p@1", 2.0)]


def _files_of(df) -> list:
    """The files a read scans, as local paths: Spark's index gives URIs (``file:///x%253A``), Delta's
    Hadoop paths (``file:/x%3A``, a folder's escaped run key ``x:`` as it is on disk)."""
    import os
    from urllib.parse import unquote, urlparse
    return sorted(next(p for p in (urlparse(f).path, unquote(urlparse(f).path)) if os.path.exists(p))
                  for f in df.inputFiles())


def test_later_versions_are_read_from_their_checksum_files(spark, tmp_path):
    """A later version (an overwrite, a run key's partition replaced beside another key's) is read
    as the files its checksum file lists: the files, rows and column types of Delta's read of that
    version, no Delta file index in the plan; a version whose checksum file is gone, or lists no
    files, goes through Delta with the same rows."""
    from tests.conftest import executed_plan
    from xmc_spark.storage import version_files

    def delta_at(path, version, key=None):
        df = spark.read.format("delta").option("versionAsOf", version).load(path)
        return df if key is None else df.filter(F.col("run_key") == key).drop("run_key")

    def same(fast, delta):
        assert "InMemoryFileIndex" in executed_plan(fast), executed_plan(fast)
        assert [(f.name, f.dataType) for f in fast.schema] == [(f.name, f.dataType) for f in delta.schema]
        assert _files_of(fast) == _files_of(delta)
        assert sorted(map(tuple, fast.collect())) == sorted(map(tuple, delta.collect()))

    df = spark.range(300).select("id", F.array((F.col("id") % 7).cast("int")).alias("ids"),
                                 (F.col("id") / 3).cast("float").alias("x"))
    path = str(tmp_path / "t")
    write_delta(df.repartition(3), path)
    write_delta(df.where("id < 40").repartition(2), path)            # version 1: an overwrite
    assert len(version_files(spark, path, 1)[1]) == 2
    same(read_delta(spark, path, version=1), delta_at(path, 1))
    same(read_delta(spark, path, version=0), delta_at(path, 0))      # the first version, as it was
    keyed = str(tmp_path / "k")
    write_delta(df.where("id < 100"), keyed, run_key="a")            # 0
    write_delta(df.where("id >= 100").repartition(2), keyed, run_key="b")   # 1
    write_delta(df.where("id < 10"), keyed, run_key="a")             # 2: a's rows replaced
    for key, version in (("a", 2), ("b", 2), ("a", 1), ("a", 0), ("b", 1)):
        same(read_delta(spark, keyed, key, version), delta_at(keyed, version, key))
    assert read_delta(spark, keyed, "a", 2).count() == 10 and read_delta(spark, keyed, "a", 1).count() == 100
    write_delta(df.where("id < 3"), keyed, run_key="a", where="id < 5")   # 3: part of a's rows replaced
    same(read_delta(spark, keyed, "a", 3), delta_at(keyed, 3, "a"))
    assert read_delta(spark, keyed, "a", 3).count() == 8
    for key in ("2026-11-25T10:00", "a+b.c"):      # keys whose folder names Hive escapes, or not
        write_delta(df.where("id < 20"), keyed, run_key=key)
        version = table_version(spark, keyed)
        same(read_delta(spark, keyed, key, version), delta_at(keyed, version, key))
    rows = "metric string, value double"                            # unpinned: the listed latest version
    ta, tb = Tables(spark, tmp_path / "root", "a"), Tables(spark, tmp_path / "root", "b")
    ta.write("metrics", spark.createDataFrame([("p@1", 1.0)], rows))
    tb.write("metrics", spark.createDataFrame([("p@1", 2.0)], rows))
    ta.write("metrics", spark.createDataFrame([("p@1", 3.0)], rows))
    assert "InMemoryFileIndex" in executed_plan(tb.read("metrics")) and tb.reads == {"metrics": 2}
    assert [tuple(r) for r in tb.read("metrics").collect()] == [("p@1", 2.0)]
    assert [tuple(r) for r in ta.read("metrics").collect()] == [("p@1", 3.0)]
    pinned = Tables(spark, tmp_path / "root", "a", pins={"metrics": 1})     # a pinned later version
    assert [tuple(r) for r in pinned.read("metrics").collect()] == [("p@1", 1.0)] and pinned.reads == {"metrics": 1}
    assert "InMemoryFileIndex" in executed_plan(pinned.read("metrics"))
    empty = read_delta(spark, keyed, "c", 2)                          # a key with no rows: none, no job
    assert version_files(spark, keyed, 2, "c")[1] == [] and empty.count() == 0
    assert [(f.name, f.dataType) for f in empty.schema] == [
        (f.name, f.dataType) for f in delta_at(keyed, 2, "c").schema]
    evolved = str(tmp_path / "e")                      # a key's write adds a column (mergeSchema)
    write_delta(df.where("id < 50"), evolved, run_key="a")
    write_delta(df.where("id < 30").withColumn("y", F.lit(2.5)), evolved, run_key="b")
    write_delta(df.where("id < 10").withColumn("y", F.lit(1.5)), evolved, run_key="c")
    for version in (1, 2):
        for key in ("a", "b", "c"):
            got = read_delta(spark, evolved, key, version)
            assert sorted(map(tuple, got.collect())) == sorted(map(tuple, delta_at(evolved, version, key).collect()))
            assert got.columns == delta_at(evolved, version, key).columns
    (tmp_path / "k" / "_delta_log" / f"{1:020d}.crc").write_text('{"numFiles": ')   # a file we cannot parse
    assert version_files(spark, keyed, 1, "a") is None and read_delta(spark, keyed, "a", 1).count() == 100
    (tmp_path / "k" / "_delta_log" / f"{2:020d}.crc").unlink()       # no checksum file: Delta's read
    assert version_files(spark, keyed, 2, "a") is None
    assert "InMemoryFileIndex" not in executed_plan(read_delta(spark, keyed, "a", 2))
    assert sorted(map(tuple, read_delta(spark, keyed, "a", 2).collect())) == sorted(
        map(tuple, delta_at(keyed, 2, "a").collect()))
    spark.conf.set("spark.databricks.delta.allFilesInCrc.enabled", "false")
    try:                                                             # a checksum without the files
        write_delta(df.where("id < 5"), path)
    finally:
        spark.conf.unset("spark.databricks.delta.allFilesInCrc.enabled")
    assert version_files(spark, path, 2) is None and read_delta(spark, path, version=2).count() == 5
    write_delta(df.repartition(3), path)                             # 3: more files than listed in the driver
    spark.conf.set("spark.sql.sources.parallelPartitionDiscovery.threshold", "2")
    try:
        assert version_files(spark, path, 3) is None and read_delta(spark, path, version=3).count() == 300
    finally:
        spark.conf.unset("spark.sql.sources.parallelPartitionDiscovery.threshold")
    assert len(version_files(spark, path, 3)[1]) == 3


def test_plain_state_of_a_log_entry():
    """Which first log entries read as plain Parquet: relative, unquoted file paths under the
    table, the logical schema; partitions, column mapping, other reader features, deletion
    vectors, actions beyond a creation's, absolute paths and glob characters go through Delta."""
    import json

    from xmc_spark.storage import plain_state
    schema = json.dumps({"type": "struct", "fields": [{"name": "id", "type": "long", "nullable": True,
                                                       "metadata": {}}]})

    def entry(protocol=None, meta=None, adds=({"path": "part-0%20a.parquet", "partitionValues": {}},), extra=()):
        actions = [{"commitInfo": {"operation": "WRITE"}},
                   {"protocol": protocol or {"minReaderVersion": 1, "minWriterVersion": 2}},
                   {"metaData": {"format": {"provider": "parquet"}, "schemaString": schema,
                                 "partitionColumns": [], "configuration": {}, **(meta or {})}}]
        actions += [{"add": a} for a in adds] + list(extra)
        return "\n".join(json.dumps(a) for a in actions) + "\n"

    got = plain_state(entry(), "/r/t/")
    assert got[1] == ["/r/t/part-0 a.parquet"] and [f.name for f in got[0]] == ["id"]
    features = {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["deletionVectors"]}
    assert plain_state(entry(protocol=features), "/r/t") is not None
    assert plain_state(entry(protocol={"minReaderVersion": 2, "minWriterVersion": 5}), "/r/t") is not None
    assert plain_state(entry(adds=()), "/r/t")[1] == []                # an empty table: no files
    # of a field's metadata the read keeps what Delta's does (char/varchar, comments)
    meta = json.dumps({"type": "struct", "fields": [{"name": "id", "type": "long", "nullable": True, "metadata": {
        "comment": "c", "delta.generationExpression": "1", "__CHAR_VARCHAR_TYPE_STRING": "x"}}, {
        "name": "s", "type": {"type": "struct", "fields": [{"name": "a", "type": "long", "nullable": True,
                                                            "metadata": {"delta.identity.start": 1}}]},
        "nullable": True, "metadata": {}}]})
    fields = plain_state(entry(meta={"schemaString": meta}), "/r/t")[0].fields
    assert fields[0].metadata == {"comment": "c", "__CHAR_VARCHAR_TYPE_STRING": "x"}
    assert fields[1].dataType.fields[0].metadata == {}
    for bad in (entry(protocol={**features, "readerFeatures": ["columnMapping"]}),
                entry(protocol={"minReaderVersion": 4}),
                entry(meta={"configuration": {"delta.columnMapping.mode": "name"}}),
                entry(meta={"partitionColumns": ["run_key"]}),
                entry(adds=({"path": "k=1/p.parquet", "partitionValues": {"k": "1"}},)),
                entry(adds=({"path": "p.parquet", "deletionVector": {"storageType": "u"}},)),
                entry(adds=({"path": "s3://b/p.parquet"},)),
                entry(adds=({"path": "p[1].parquet"},)),
                entry(adds=({"path": "/abs/p.parquet"},)),
                entry(adds=({"path": "_hidden.parquet"},)),
                entry(adds=({"path": "p.parquet"}, {"path": "p.parquet"})),
                entry(meta={"format": {"provider": "parquet", "options": {"mergeSchema": "true"}}}),
                entry(meta={"configuration": {"delta.coordinatedCommits.commitCoordinator-preview": "dynamodb"}}),
                entry(protocol={**features, "writerFeatures": ["coordinatedCommits-preview"]}),
                entry(extra=({"remove": {"path": "old.parquet"}},))):
        assert plain_state(bad, "/r/t") is None, bad


def test_checksum_state_and_run_keys():
    """A checksum file reads as plain Parquet where its own counts agree with its file list and
    its protocol and metadata would let a version-0 entry (:func:`plain_state`); with a run key,
    only that key's files, under the schema without the key (a partition by run key only)."""
    import json

    from xmc_spark.storage import checksum_state, plain_state
    schema = json.dumps({"type": "struct", "fields": [
        {"name": "id", "type": "long", "nullable": True, "metadata": {}},
        {"name": "run_key", "type": "string", "nullable": True, "metadata": {}}]})
    meta = {"format": {"provider": "parquet", "options": {}}, "schemaString": schema,
            "partitionColumns": ["run_key"], "configuration": {}}
    files = [{"path": "run_key=a/p%201.parquet", "partitionValues": {"run_key": "a"}, "size": 10},
             {"path": "run_key=b/q.parquet", "partitionValues": {"run_key": "b"}, "size": 5}]

    def crc(**kw):
        c = {"tableSizeBytes": 15, "numFiles": 2, "numMetadata": 1, "numProtocol": 1, "setTransactions": [],
             "domainMetadata": [], "metadata": meta, "protocol": {"minReaderVersion": 1, "minWriterVersion": 2},
             "allFiles": files}
        return json.dumps({**c, **kw})

    got = checksum_state(crc(), "/r/t", "a")
    assert got[1] == ["/r/t/run_key=a/p 1.parquet"] and [f.name for f in got[0]] == ["id"]
    assert checksum_state(crc(), "/r/t", "b")[1] == ["/r/t/run_key=b/q.parquet"]
    assert checksum_state(crc(), "/r/t", "c")[1] == []                # no file of that key: no rows
    assert checksum_state(crc(), "/r/t") is None                       # partitioned, no key asked
    plain = [{"path": "p.parquet", "partitionValues": {}, "size": 15}]
    unkeyed = crc(allFiles=plain, numFiles=1, metadata={**meta, "partitionColumns": []})
    assert checksum_state(unkeyed, "/r/t")[1] == ["/r/t/p.parquet"]
    # the version's own entry: what it adds is listed, what it removes is not
    commit = [{"add": files[1]}, {"remove": {"path": "run_key=b/old.parquet"}}, {"commitInfo": {}}]
    assert checksum_state(crc(), "/r/t", "a", "\n".join(json.dumps(a) for a in commit)) is not None
    for bad_entry in ([{"add": {"path": "run_key=b/new.parquet"}}], [{"remove": {"path": "run_key=b/q.parquet"}}]):
        assert checksum_state(crc(), "/r/t", "a", json.dumps(bad_entry[0])) is None
    for bad in (crc(numFiles=3), crc(tableSizeBytes=14), crc(numMetadata=2), crc(allFiles=None), crc(numMetadata=None),
                crc(metadata={**meta, "configuration": {"delta.coordinatedCommits.commitCoordinator-preview": "x"}}),
                crc(allFiles=[{**files[0], "path": "file:/abs/p.parquet"}, files[1]]),
                crc(allFiles=[{**files[0], "path": "/abs/run_key=a/p.parquet"}, files[1]]),
                crc(domainMetadata=[{"domain": "delta.clustering", "configuration": "{}", "removed": False}]),
                crc(metadata={**meta, "partitionColumns": ["run_key", "day"]}),
                crc(allFiles=[{**files[0], "partitionValues": {"run_key": "a", "day": "1"}}], numFiles=1,
                    tableSizeBytes=10),
                crc(allFiles=[{**files[0], "deletionVector": {"storageType": "u"}}], numFiles=1, tableSizeBytes=10),
                crc(protocol={"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["columnMapping"]}),
                "[]"):
        assert checksum_state(bad, "/r/t", "a") is None, bad
    # a version-0 entry of a keyed table: the key's files
    entry = "\n".join(json.dumps(a) for a in [{"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}},
                                              {"metaData": meta}] + [{"add": f} for f in files])
    assert plain_state(entry, "/r/t", "b")[1] == ["/r/t/run_key=b/q.parquet"]
    assert plain_state(entry, "/r/t") is None
