"""The driver JVM's class-data archive: its key, the one-writer lock, publishing only what a JVM
wrote and exited 0 on, the JVM's own check of a bad archive, and two real Spark processes (the
first writes the archive, the second starts from it)."""
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from xmc_spark import class_sharing as cs


@pytest.fixture
def java():
    j = cs.java_binary()
    if j is None:
        pytest.skip("no java binary")
    return j


def _jars(tmp_path, n=3):
    out = []
    for i in range(n):
        p = tmp_path / f"j{i}.jar"
        p.write_bytes(b"PK" * (i + 1))
        out.append(str(p))
    return out


def test_the_key_follows_the_java_binary_and_every_jar(tmp_path, java):
    jars = _jars(tmp_path)
    k = cs.archive_key(java, jars)
    assert cs.archive_key(java, list(reversed(jars))) == k          # the class path's files, not their order
    assert cs.archive_key(java, jars[:2]) != k                       # one jar fewer
    other = tmp_path / "java"
    other.write_bytes(b"x")
    assert cs.archive_key(str(other), jars) != k                     # another JDK
    with open(jars[1], "ab") as f:                                   # a jar rebuilt with more bytes
        f.write(b"!")
    k2 = cs.archive_key(java, jars)
    assert k2 != k
    st = os.stat(jars[1])
    os.utime(jars[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # same size, newer time
    assert cs.archive_key(java, jars) != k2


def test_one_writer_then_every_process_reads(tmp_path, java):
    """No archive: the first plan writes it (lock with its pid, a temporary file named by its pid),
    a second process meanwhile starts without; a lock or temporary file of a dead process is
    removed; with the archive in place every plan reads it, checked (VerifySharedSpaces)."""
    folder, jars = tmp_path / "cds", _jars(tmp_path)
    me = f"{os.getpid()}@{socket.gethostname()}"
    w = cs.plan(folder, java, jars)
    assert w.writes and w.lock.read_text() == me and not list(folder.glob("*.lk"))
    assert f"-XX:ArchiveClassesAtExit={w.tmp}" in w.options and w.tmp.name.endswith(f".{os.getpid()}.tmp")
    assert cs.plan(folder, java, jars) is None                       # the lock's process is alive
    assert cs.plan(folder, None, jars) is None                       # no java: nothing

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    w.lock.write_text(f"{dead}@elsewhere")                           # another host's lock: kept for hours
    assert cs.plan(folder, java, jars) is None
    old = time.time() - cs.FOREIGN_LOCK_SECONDS - 60
    os.utime(w.lock, (old, old))
    assert cs.plan(folder, java, jars).writes                        # ... then taken over
    w.lock.write_text(f"{dead}@{socket.gethostname()}")              # the writer died: its lock goes
    stale, young = folder / f"x.{dead}.tmp", folder / "nopid.tmp"
    stale.write_bytes(b"half")
    young.write_bytes(b"?")                                          # no pid in its name: only after a minute
    w2 = cs.plan(folder, java, jars)
    assert w2.writes and not stale.exists() and young.exists() and w2.lock.read_text() == me
    w2.lock.write_text(f"{dead}@{socket.gethostname()}")             # finish releases only its own lock
    cs.finish(w2, None)
    assert w2.lock.exists()
    w2 = cs.plan(folder, java, jars)

    w2.tmp.write_bytes(b"archive")
    os.replace(w2.tmp, w2.archive)
    w2.lock.unlink()
    r = cs.plan(folder, java, jars)
    assert not r.writes and r.archive == w2.archive
    assert f"-XX:SharedArchiveFile={w2.archive}" in r.options and "-XX:+VerifySharedSpaces" in r.options


EXIT_WITH = textwrap.dedent("""
    public class ExitWith {
        public static void main(String[] a) throws Exception {
            while (System.in.read() != -1) { }
            System.exit(Integer.parseInt(a[0]));
        }
    }
""")


def _jvm(tmp_path, java, options, code):
    """A real JVM that, like Spark's gateway, exits when its standard input closes (with ``code``)."""
    src = tmp_path / "ExitWith.java"
    src.write_text(EXIT_WITH)
    return subprocess.Popen([java, *options.split(), str(src), str(code)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.parametrize("code", [0, 3])
def test_published_only_when_the_jvm_exits_0(tmp_path, java, code):
    """finish closes the JVM's input; the archive it wrote is published on exit code 0 only, and
    the temporary file and the lock go either way. The JVM then starts from the archive."""
    folder = tmp_path / "cds"
    p = cs.plan(folder, java, [])
    proc = _jvm(tmp_path, java, p.options, code)
    assert cs.finish(p, proc) is (code == 0)
    assert proc.returncode == code and not p.tmp.exists() and not p.lock.exists()
    assert p.archive.is_file() is (code == 0)
    if code == 0:
        r = cs.plan(folder, java, [])
        proc = _jvm(tmp_path, java, r.options + " -Xshare:on", 0)     # on: fail if the archive were not used
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]


def test_a_bad_archive_is_refused_by_the_jvm_not_fatal(tmp_path, java):
    """An archive file that is not one (truncated, or another JDK's): the JVM checks it and runs
    without it."""
    folder = tmp_path / "cds"
    folder.mkdir()
    (folder / f"{cs.archive_key(java, [])}.jsa").write_bytes(os.urandom(1 << 16))
    r = cs.plan(folder, java, [])
    assert not r.writes
    out = subprocess.run([java, *r.options.split(), "-version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_newest_archives_are_kept(tmp_path):
    for i in range(5):
        f = tmp_path / f"k{i}.jsa"
        f.write_bytes(b"a")
        os.utime(f, (1000 + i, 1000 + i))
    cs._prune(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.glob("*.jsa")) == ["k2.jsa", "k3.jsa", "k4.jsa"]


SESSION = textwrap.dedent("""
    import json, sys
    from xmc_spark.session import get_spark
    from xmc_spark.params import SparkParams
    p = SparkParams(master="local[1]", class_data_sharing=sys.argv[1] != "off")
    if sys.argv[1] == "on!":    # the JVM must use the archive (-Xshare:on) or not start
        p.conf["spark.driver.extraJavaOptions"] = "-Xshare:on"
    spark = get_spark(p)
    args = list(spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    print(json.dumps({"args": [a for a in args if "Archive" in a], "n": spark.range(5).count(), "all": args,
                      "share": next((a for a in args if a.startswith("-Xshare")), None)}))
""")


# two local Spark processes and a JVM dump, 44-65 s: on demand (-m on_demand), to keep CI under its 30
# minutes; the tests above check the key, the lock and the publishing, and start a plain JVM from an archive
# under -Xshare:on (test_published_only_when_the_jvm_exits_0), without Spark's driver
@pytest.mark.slow
@pytest.mark.on_demand
def test_two_spark_processes_write_then_read_the_archive(tmp_path):
    """The real thing: a local session with no archive writes one at its exit (published, no lock or
    temporary file left); the next process's driver starts from it, made to use it (-Xshare:on: a
    refused archive fails that start, and the retry without the options would show in its
    arguments), beside the configuration's own Java options, and runs a job. (Delta's jars are
    recorded first, as after any earlier session, so both processes have the same class path.)"""
    import json
    import shutil

    from xmc_spark.session import HOT_ONLY_JIT, delta_package, jars_cache_file
    env = {**os.environ, "XMC_SPARK_CACHE": str(tmp_path / "cache")}
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    record = jars_cache_file(delta_package())
    modes = ["on", "on!"]
    if record.is_file():
        (tmp_path / "cache" / "jars").mkdir(parents=True)
        shutil.copy(record, tmp_path / "cache" / "jars" / record.name)
    else:
        modes.insert(0, "off")                  # a session that records them, without an archive
    runs = []
    for mode in modes:
        out = subprocess.run([sys.executable, "-c", SESSION, mode], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    runs = runs[-2:]
    folder = tmp_path / "cache" / "cds"
    archives = list(folder.glob("*.jsa"))
    assert len(archives) == 1 and not list(folder.glob("*.lock")) and not list(folder.glob("*.tmp"))
    assert runs[0]["args"][0].startswith("-XX:ArchiveClassesAtExit=") and runs[0]["n"] == 5
    assert runs[1]["args"] == [f"-XX:SharedArchiveFile={archives[0]}"] and runs[1]["n"] == 5
    assert runs[1]["share"] == "-Xshare:on"
    args, i = runs[1]["all"], runs[1]["all"].index("-Xshare:on")    # the compiler's thresholds, then the configured
    assert args[i - len(HOT_ONLY_JIT):i] == list(HOT_ONLY_JIT)
