"""session: spark.remote selects Spark Connect; the checks that need no server run here, the
Connect session itself in tests/test_connect_suite.py's process."""
import pytest

from xmc_spark.params import SparkParams
from xmc_spark.session import HOT_ONLY_JIT, SparkStartError, capped_python_conf, get_spark, redact_remote


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


def test_delta_jars_resolved_once_are_reused_from_the_record(tmp_path, monkeypatch):
    """A local session resolves Delta's packages through Ivy once and records the files; the
    next one passes those files as spark.jars (no resolution, nothing on the Python path). A
    list without Delta's artifact is not recorded. A missing file, a cluster master, the
    configuration's own spark.jars* keys or PYSPARK_SUBMIT_ARGS' --jars mean packages."""
    from pyspark.sql import SparkSession

    from xmc_spark.session import (
        _delta_jars,
        cached_jars,
        delta_package,
        jars_cache_file,
        remember_jars,
        resolved_jar_name,
    )
    monkeypatch.setenv("XMC_SPARK_CACHE", str(tmp_path / "cache"))
    coords = delta_package()
    local = SparkParams(master="local[1]")

    b, record = _delta_jars(SparkSession.builder, local)
    assert b._options["spark.jars.packages"] == coords and "spark.jars" not in b._options
    assert record == coords                               # nothing recorded yet: resolve, then record

    (tmp_path / "a b").mkdir()
    jars = [tmp_path / "a b" / resolved_jar_name(coords), tmp_path / "c d.jar"]
    for j in jars:
        j.write_bytes(b"PK")
    listed = ",".join(["file://" + str(jars[0]).replace(" ", "%20"), str(jars[1])])     # a URI, a plain path
    other = tmp_path / "io.delta_delta-spark_2.13-0.1.jar"                # another version's jar
    other.write_bytes(b"PK")
    remember_jars(record, f"{other},{jars[1]}")           # not the coordinates' own jar: not recorded
    assert cached_jars(coords) is None and not jars_cache_file(coords).exists()
    remember_jars(record, listed)
    assert [f.name for f in jars_cache_file(coords).parent.iterdir()] == [jars_cache_file(coords).name]
    assert jars_cache_file(coords).stat().st_mode & 0o777 == 0o644
    assert jars_cache_file(coords).read_text().splitlines() == listed.split(",")
    assert cached_jars(coords) == listed.split(",")
    b, record = _delta_jars(SparkSession.builder, local)
    assert b._options["spark.jars"] == listed and "spark.jars.packages" not in b._options and record is None

    for params in (SparkParams(master="yarn"), SparkParams(master="local[1]", conf={"spark.jars.repositories": "x"})):
        b, record = _delta_jars(SparkSession.builder, params)
        assert b._options["spark.jars.packages"] == coords and record is None
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--jars /opt/x.jar pyspark-shell")   # the launcher's jars stand
    b, record = _delta_jars(SparkSession.builder, local)
    assert b._options["spark.jars.packages"] == coords and "spark.jars" not in b._options and record is None
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS")

    jars[1].unlink()                                      # an emptied Ivy cache: resolve again
    assert cached_jars(coords) is None
    b, record = _delta_jars(SparkSession.builder, local)
    assert b._options["spark.jars.packages"] == coords and record == coords


def test_resolved_jar_name():
    from xmc_spark.session import resolved_jar_name
    assert resolved_jar_name("io.delta:delta-spark_4.2_2.13:4.4.0") == "io.delta_delta-spark_4.2_2.13-4.4.0.jar"


def test_the_test_session_recorded_its_delta_jars(spark, tmp_path, monkeypatch):
    """The real thing: the tests' local session (get_spark) resolved Delta's packages or used the
    record; either way the record lists exactly its spark.jars, Delta's own jar among them, every
    file present. A get_spark beside it (same settings) hands back this session and records
    nothing, even with no record yet."""
    import os

    from tests.conftest import spark_params
    from xmc_spark.session import _local_path, cached_jars, delta_package, jars_cache_file, resolved_jar_name
    live = [j for j in spark.sparkContext.getConf().get("spark.jars", "").split(",") if j]
    assert cached_jars(delta_package()) == live
    assert resolved_jar_name(delta_package()) in {os.path.basename(_local_path(j)) for j in live}

    monkeypatch.setenv("XMC_SPARK_CACHE", str(tmp_path / "empty"))
    assert cached_jars(delta_package()) is None
    assert get_spark(spark_params(spark.conf.get("spark.sql.warehouse.dir"))) is spark
    assert not jars_cache_file(delta_package()).exists()


def test_class_data_archive_only_where_this_process_starts_a_local_jvm(spark, tmp_path, monkeypatch):
    """The archive options (class_sharing.py) go to a driver JVM this call launches on a local master:
    not while a JVM runs in the process (the tests' session), not for a cluster master, not with
    spark.class_data_sharing off, not when PYSPARK_SUBMIT_ARGS sets driver Java options. With no
    JVM yet (the gateway set aside for the call) a local master gets a plan."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from xmc_spark.session import _class_sharing
    monkeypatch.setenv("XMC_SPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    local = SparkParams(master="local[1]")
    assert _class_sharing(SparkSession.builder, local) is None             # this process's JVM runs already
    monkeypatch.setattr(SparkContext, "_gateway", None)
    p = _class_sharing(SparkSession.builder, local)
    assert p is not None and p.writes and "-XX:ArchiveClassesAtExit=" in p.options
    p.lock.unlink()
    for params in (SparkParams(master="yarn"), SparkParams(master="local[1]", class_data_sharing=False)):
        assert _class_sharing(SparkSession.builder, params) is None
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--driver-java-options -Dx=1 pyspark-shell")
    assert _class_sharing(SparkSession.builder, local) is None
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "spark-defaults.conf").write_text("spark.driver.extraJavaOptions -Dy=2\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "conf"))     # our --conf would replace the file's
    assert _class_sharing(SparkSession.builder, local) is None


def test_hot_only_jit_goes_first_to_a_local_jvm_this_process_launches(spark, tmp_path, monkeypatch):
    """HOT_ONLY_JIT leads the driver's Java options of a local JVM this call launches, before the
    configuration's own and the archive's; not while a JVM runs in the process, not for a cluster
    master, not with spark.jit_hot_only off, not when PYSPARK_SUBMIT_ARGS sets driver Java options."""
    from pyspark import SparkContext

    from xmc_spark.session import _driver_java_options
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))          # no spark-defaults.conf
    own = "-XX:Tier4InvocationThreshold=7000 -Dx=1"
    local, yarn, off = (SparkParams(master=m, jit_hot_only=j) for m, j in (("local[1]", True), ("yarn", True),
                                                                            ("local[1]", False)))
    for p in (local, yarn, off):
        p.conf["spark.driver.extraJavaOptions"] = own
    assert _driver_java_options(local, "-Xshare:auto") == f"{own} -Xshare:auto"     # this process's JVM runs
    monkeypatch.setattr(SparkContext, "_gateway", None)
    assert _driver_java_options(local, "-Xshare:auto") == " ".join([*HOT_ONLY_JIT, own, "-Xshare:auto"])
    assert _driver_java_options(SparkParams(master="local[1]")) == " ".join(HOT_ONLY_JIT)
    assert _driver_java_options(yarn) == _driver_java_options(off) == own
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--driver-java-options -Dx=1 pyspark-shell")
    assert _driver_java_options(local) == own
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS")
    (tmp_path / "spark-defaults.conf").write_text("spark.driver.extraJavaOptions -Dy=2\n")
    assert _driver_java_options(local) == own            # our --conf would replace the file's options
    (tmp_path / "spark-defaults.conf").unlink()
    class_path = SparkParams(master="local[1]")
    class_path.conf["spark.driver.extraClassPath"] = "/x.jar"     # the archive's concern, not the compiler's
    assert _driver_java_options(class_path) == " ".join(HOT_ONLY_JIT)
    early = SparkParams(master="local[1]")          # a threshold placed before ours would lose: none of ours
    early.conf["spark.driver.defaultJavaOptions"] = "-XX:Tier4CompileThreshold=9000"
    assert _driver_java_options(early) == ""
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-XX:Tier4InvocationThreshold=9000")
    assert _driver_java_options(SparkParams(master="local[1]")) == ""
    monkeypatch.delenv("JAVA_TOOL_OPTIONS")
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")       # under spark-submit: its driver runs already
    assert _driver_java_options(SparkParams(master="local[1]")) == ""


def test_a_flag_given_twice_takes_its_last_value():
    """What lets a configured threshold win over HOT_ONLY_JIT (it comes later): HotSpot's own rule."""
    import shutil
    import subprocess

    from xmc_spark.class_sharing import java_binary
    java = java_binary()
    if not java or not shutil.which(java):
        pytest.skip("no java")
    name = HOT_ONLY_JIT[0][4:].split("=")[0]
    out = subprocess.run([java, *HOT_ONLY_JIT, f"-XX:{name}=7000", "-XX:+PrintFlagsFinal", "-version"],
                         capture_output=True, text=True, check=True).stdout
    assert [ln.split()[3] for ln in out.splitlines() if f" {name} " in ln] == ["7000"]


def test_the_tests_local_jvm_runs_with_hot_only_jit(spark):
    """The tests' session is a local driver JVM that get_spark launched: HotSpot reports each
    threshold of HOT_ONLY_JIT as set."""
    import os

    from xmc_spark.compat import is_connect
    from xmc_spark.session import outside_driver_options
    if is_connect(spark):
        pytest.skip("a Spark Connect session: the server's JVM")
    if outside_driver_options() or any("-XX:Tier" in os.environ.get(v, "") for v in ("JAVA_TOOL_OPTIONS",
                                                                                     "JDK_JAVA_OPTIONS")):
        pytest.skip("this environment sets the driver's Java options itself")
    jvm = spark.sparkContext._jvm
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    for flag in HOT_ONLY_JIT:
        name, value = flag[4:].split("=")
        assert bean.getVMOption(name).getValue() == value, flag
