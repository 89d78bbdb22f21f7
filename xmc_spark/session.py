"""The only place that builds a SparkSession."""
from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import List, Optional
from urllib.parse import unquote, urlparse

from .compat import is_connect
from .errors import XmcError
from .params import SparkParams


class SparkStartError(XmcError):
    """The Spark session could not start (no cluster configuration, no Java, ...)."""

log = logging.getLogger("xmc_spark")

DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # pandas <-> Spark through Arrow (Spark 3.5's default is off; its row path rejects numpy
    # scalars inside list columns)
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}


ARROW_POOL_ENV = "spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL"
DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"

# HotSpot's C2 compiles a method once it ran about 5,000 times (or 15,000 calls and loop
# iterations, or 40,000 iterations of one loop; simplified: the counts also scale with C2's queue).
# A local run of xmc-spark passes those counts in many methods of Spark, Delta, Parquet, Arrow and
# each query's generated classes: its C2 thread spent 30-32 s of CPU in 64-68 s runs on 2 cores
# (200K set), a quarter of the machine. Ten times those counts leave C2 the hottest methods:
# C2's CPU 30-32 -> 18-20 s, the whole process 1.7-3.9 s faster (median 2.8) in each of three
# alternated pairs (README). For a driver JVM that xmc-spark launches on a local master only
# (spark.jit_hot_only); a cluster's executors run long enough to repay C2.
HOT_ONLY_JIT = ("-XX:Tier4InvocationThreshold=50000", "-XX:Tier4MinInvocationThreshold=6000",
                "-XX:Tier4CompileThreshold=150000", "-XX:Tier4BackEdgeThreshold=400000")


def capped_python_conf(conf: dict) -> dict:
    """Settings that ``spark.executor.pyspark.memory`` needs: Spark applies it as each Python
    worker's address-space limit (``RLIMIT_AS``), and pyarrow's default allocator (mimalloc)
    reserves a 1 GiB arena of address space at its first allocation whenever the limit leaves
    room for one (measured: a worker's virtual size 0.55 -> 1.6 GiB after one Arrow array under a
    1.8 GiB cap, with 0.2 GiB resident), so the kernels' numpy arrays fail long before the
    memory is used. With the cap set the workers' Arrow buffers use the system allocator, unless
    the configuration chooses one (``spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL``). Under
    spark-submit, or a cap from the cluster's defaults, :func:`get_spark` warns instead, naming
    the setting to add; a ``spark.remote`` session's workers are the server's."""
    return {ARROW_POOL_ENV: "system"} if conf.get("spark.executor.pyspark.memory") else {}


def under_spark_submit() -> bool:
    """True in a Python driver started by spark-submit (its JVM is already running)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def delta_package() -> str:
    """The Maven coordinate of the Delta jars matching the installed delta-spark and pyspark
    (what ``delta_from_maven`` adds; pass it to ``spark-submit --packages``)."""
    from delta import configure_spark_with_delta_pip
    from pyspark.sql import SparkSession
    return configure_spark_with_delta_pip(SparkSession.builder)._options["spark.jars.packages"]


JARS_CACHE_ENV = "XMC_SPARK_CACHE"


def jars_cache_file(coordinates: str) -> Path:
    """Where the jar files Spark resolved for the Maven ``coordinates`` are listed: under
    ``$XMC_SPARK_CACHE``, else ``$XDG_CACHE_HOME/xmc-spark``, else ``~/.cache/xmc-spark``."""
    return Path(cache_root(), "jars", re.sub(r"[^\w.-]", "_", coordinates) + ".txt")


def cache_root() -> str:
    """``$XMC_SPARK_CACHE``, else ``$XDG_CACHE_HOME/xmc-spark``, else ``~/.cache/xmc-spark``: the jar
    record (:func:`jars_cache_file`) and the class-data archive (:mod:`.class_sharing`)."""
    return os.environ.get(JARS_CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "xmc-spark")


def _local_path(jar: str) -> str:
    return unquote(urlparse(jar).path) if jar.startswith("file:") else jar


def cached_jars(coordinates: str) -> Optional[List[str]]:
    """The jar files an earlier session resolved for ``coordinates`` (:func:`remember_jars`),
    None when none is recorded or one of them is gone (an emptied Ivy cache)."""
    try:
        jars = [j.strip() for j in jars_cache_file(coordinates).read_text().splitlines() if j.strip()]
    except OSError:
        return None
    if not jars or not all(os.path.isfile(_local_path(j)) for j in jars):
        return None
    return jars


def remember_jars(coordinates: str, jars: str) -> None:
    """Record the jar files Spark resolved for ``coordinates`` (its ``spark.jars`` after
    ``spark.jars.packages``) for :func:`cached_jars`; written whole or not at all (a temporary file
    renamed, readable by all), and a cache that cannot be written is only logged. A
    list without the jar of each coordinate (Ivy's ``<org>_<artifact>-<version>.jar``: not what
    the packages resolved) is not recorded."""
    listed = [j for j in jars.split(",") if j.strip()]
    names = {os.path.basename(_local_path(j)) for j in listed}
    wanted = [resolved_jar_name(c) for c in coordinates.split(",") if c.strip()]
    if not wanted or not all(w in names for w in wanted):
        log.info("spark.jars does not hold %s: Delta's resolved jars not recorded", ", ".join(wanted))
        return
    f = jars_cache_file(coordinates)
    tmp = None
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=f.parent, prefix=f.name + ".", suffix=".tmp",
                                         delete=False) as out:
            tmp = out.name
            out.write("\n".join(listed) + "\n")
        os.chmod(tmp, 0o644)        # readable by all, as a plain write under umask 022 (a shared cache)
        os.replace(tmp, f)
        tmp = None
    except OSError as e:
        log.info("could not record Delta's jar files in %s (%s): the next local session resolves them again",
                 f, e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def resolved_jar_name(coordinate: str) -> str:
    """The file Ivy resolves a Maven ``org:artifact:version`` to: ``org_artifact-version.jar``."""
    org, artifact, version = (coordinate.strip().split(":") + ["", ""])[:3]
    return f"{org}_{artifact}-{version}.jar"


def _submit_args_name_jars() -> bool:
    """Whether ``PYSPARK_SUBMIT_ARGS`` adds jars itself (``--jars``, ``--packages``, ``spark.jars*``):
    then the launcher's choice stands and no cached list is passed beside it."""
    args = os.environ.get("PYSPARK_SUBMIT_ARGS", "")
    return any(flag in args for flag in ("--jars", "--packages", "spark.jars"))


def _delta_jars(builder, params: SparkParams):
    """Delta's jars for a builder: ``spark.jars.packages`` (Ivy resolves them from Maven Central,
    then from its cache), or on a local master, once an earlier session has resolved them, the
    same files as ``spark.jars`` (:func:`cached_jars`). That skips Ivy's resolution (about 1.5 s)
    and keeps the 33 jars off the Python path: PySpark adds every jar of ``--packages`` to the
    driver's ``sys.path`` and to each Python worker's (copied into the session's temporary
    folder), ahead of site-packages, so every process scanned them at its first imports (about
    1.7 s less to start the session and 1.3 s less for the first ingest, measured on 2 cores).
    Returns (builder, coordinates to record after start-up, or None). A configuration that sets
    any ``spark.jars*`` key itself, or ``PYSPARK_SUBMIT_ARGS`` with ``--jars``, ``--packages`` or
    ``spark.jars``, resolves as it says."""
    from delta import configure_spark_with_delta_pip

    coords = delta_package()
    if (not params.master.startswith("local") or any(k.startswith("spark.jars") for k in params.conf)
            or _submit_args_name_jars()):
        return configure_spark_with_delta_pip(builder), None
    jars = cached_jars(coords)
    if jars is None:
        return configure_spark_with_delta_pip(builder), coords
    return builder.config("spark.jars", ",".join(jars)), None


def _active_context() -> bool:
    from pyspark import SparkContext
    return SparkContext._active_spark_context is not None


def get_spark(params: SparkParams | None = None):
    """SparkSession with Delta Lake configured.

    Locally (``spark.master`` set) the Python workers use this interpreter and Delta's jars come
    from Maven Central through ``spark.jars.packages`` the first time; the files it resolved are
    recorded (:func:`remember_jars`) and later local sessions pass them as ``spark.jars``
    (:func:`_delta_jars`). Under
    spark-submit on a cluster set ``spark.master: ""`` and ``delta_from_maven: false`` when the
    platform already ships Delta (Databricks).

    ``spark.remote`` selects Spark Connect (see :func:`connect_session`). A platform whose own
    session is already a Spark Connect one (Databricks serverless jobs) returns it from the
    classic builder too: both kinds are handled after start-up (:mod:`.compat`).
    """
    from pyspark.sql import SparkSession

    params = params or SparkParams()
    if params.remote:
        return connect_session(params)
    if under_spark_submit():
        # spark-submit already chose the master and resolved --packages/--jars: its flags win
        log.info("launched by spark-submit: master and packages come from its command line")
        params = SparkParams(**{**params.to_dict(), "master": "", "delta_from_maven": False})
    if params.master.startswith("local"):
        _local_python()
    builder = SparkSession.builder.appName(params.app_name)
    if params.master:
        builder = builder.master(params.master)
    # under spark-submit its --conf may already choose the pool: only the warning below then
    capped = {} if under_spark_submit() else capped_python_conf(params.conf)
    local = local_conf(params.master)
    for k, v in {**DELTA_CONF, **local, **capped, **params.conf}.items():
        builder = builder.config(k, str(v))
    record = None
    if params.delta_from_maven:
        builder, record = _delta_jars(builder, params)
    if params.master.startswith("yarn") and not (os.environ.get("HADOOP_CONF_DIR") or
                                                 os.environ.get("YARN_CONF_DIR")):
        raise SparkStartError(f"spark.master={params.master} needs HADOOP_CONF_DIR or YARN_CONF_DIR set to the "
                              "cluster's Hadoop configuration folder (or run under spark-submit on the cluster)")
    if record is not None and _active_context():
        record = None   # the builder hands back the running session: its jars are not these packages'
    where = f"master={params.master or 'from spark-submit'}"
    # the first run resolves Delta's packages through Ivy: its class path is not the later runs'
    cds = None if record is not None else _class_sharing(builder, params)
    base = _driver_java_options(params)
    if base:
        builder = builder.config(DRIVER_JAVA_OPTIONS, base)
    if cds is None:
        spark = _start(builder, where)
    else:
        from .class_sharing import finish, finish_at_exit
        try:
            spark = _start(builder.config(DRIVER_JAVA_OPTIONS, _driver_java_options(params, cds.options)), where)
        except SparkStartError:
            if cds.writes:
                finish(cds, None)               # releases the lock
            log.warning("Spark did not start with the class-data archive's options (%s): trying once more "
                        "without them", cds.options)
            builder = builder.config(DRIVER_JAVA_OPTIONS, base) if base else _without(builder, DRIVER_JAVA_OPTIONS)
            spark = _start(builder, where)
        except BaseException:
            if cds.writes:
                finish(cds, None)
            raise
        else:
            if cds.writes:
                finish_at_exit(cds)
    if is_connect(spark):       # the platform's session is Spark Connect (Databricks serverless)
        log.info("Spark %s: the platform's session is Spark Connect", spark.version)
        return spark
    spark.sparkContext.setLogLevel(params.log_level)
    log.info("Spark %s session ready (master=%s)", spark.version, spark.sparkContext.master)
    if record is not None:
        remember_jars(record, spark.sparkContext.getConf().get("spark.jars", ""))
    live = spark.sparkContext.getConf()
    if live.get("spark.executor.pyspark.memory") and not live.get(ARROW_POOL_ENV):
        log.warning("spark.executor.pyspark.memory=%s caps each Python worker's address space, and pyarrow's "
                    "default allocator reserves 1 GiB of it at its first allocation: add --conf %s=system "
                    "(xmc-spark sets it itself when the cap is in its own configuration)",
                    live.get("spark.executor.pyspark.memory"), ARROW_POOL_ENV)
    return spark


def outside_driver_options() -> bool:
    """Whether something outside xmc-spark's configuration sets the driver's Java options or class
    path: spark-submit (its driver already runs), ``PYSPARK_SUBMIT_ARGS`` or a ``spark-defaults.conf``
    (xmc-spark's ``--conf`` would replace their options; their class path is not in the archive's key)."""
    args = os.environ.get("PYSPARK_SUBMIT_ARGS", "")
    return (under_spark_submit() or _defaults_set_driver_options()
            or any(flag in args for flag in ("--driver-java-options", "--driver-class-path", "spark.driver.extra",
                                             "spark.driver.defaultJavaOptions")))


def _launches_local_jvm(params: SparkParams) -> bool:
    """Whether this call launches a local driver JVM whose Java options xmc-spark may set: a local
    master, no JVM running in this process yet, nothing outside the configuration setting the
    driver's options (:func:`outside_driver_options`)."""
    from pyspark import SparkContext
    return params.master.startswith("local") and SparkContext._gateway is None and not outside_driver_options()


def _hot_only_jit(params: SparkParams) -> bool:
    """:data:`HOT_ONLY_JIT` goes to the driver: ``spark.jit_hot_only`` on, a local JVM this call
    launches, and no compiler threshold set where it would come before ours and lose
    (``spark.driver.defaultJavaOptions``, ``JAVA_TOOL_OPTIONS``, ``JDK_JAVA_OPTIONS``)."""
    early = [str(params.conf.get("spark.driver.defaultJavaOptions", "")),
             os.environ.get("JAVA_TOOL_OPTIONS", ""), os.environ.get("JDK_JAVA_OPTIONS", "")]
    return params.jit_hot_only and _launches_local_jvm(params) and not any("-XX:Tier" in o for o in early)


def _driver_java_options(params: SparkParams, *after: str) -> str:
    """The driver's Java options: :data:`HOT_ONLY_JIT` first (:func:`_hot_only_jit`), then the
    configuration's ``spark.driver.extraJavaOptions`` (HotSpot takes the last value of a flag
    given twice, so a threshold configured there wins), then ``after``."""
    parts = list(HOT_ONLY_JIT) if _hot_only_jit(params) else []
    return " ".join(parts + [o for o in (str(params.conf.get(DRIVER_JAVA_OPTIONS, "")).strip(), *after) if o])


def _class_sharing(builder, params: SparkParams):
    """The class-data archive plan (:mod:`.class_sharing`) when this call launches a local driver
    JVM (:func:`_launches_local_jvm`) whose class path the configuration leaves alone (no
    ``spark.driver.extraClassPath``), not with ``spark.class_data_sharing`` false."""
    from . import class_sharing
    if (not params.class_data_sharing or "spark.driver.extraClassPath" in params.conf
            or not _launches_local_jvm(params)):
        return None
    extra = [_local_path(j) for j in str(builder._options.get("spark.jars", "")).split(",") if j.strip()]
    jars = class_sharing.spark_jars() + [j for j in extra if os.path.isfile(j)]
    return class_sharing.plan(Path(cache_root(), "cds"), class_sharing.java_binary(), jars)


def _defaults_set_driver_options() -> bool:
    """Whether a ``spark-defaults.conf`` Spark reads sets driver Java options or class path (our
    ``--conf`` would replace its options; its class path is not in the archive's key)."""
    from pyspark.find_spark_home import _find_spark_home
    conf_dir = os.environ.get("SPARK_CONF_DIR") or os.path.join(_find_spark_home(), "conf")
    try:
        text = Path(conf_dir, "spark-defaults.conf").read_text()
    except OSError:
        return False
    return any(k in text for k in (DRIVER_JAVA_OPTIONS, "spark.driver.extraClassPath",
                                   "spark.driver.defaultJavaOptions"))


def _without(builder, key: str):
    """``builder`` without the option ``key``."""
    builder._options.pop(key, None)
    return builder


def connect_session(params: SparkParams):
    """A Spark Connect session for ``spark.remote``.

    - ``local[N]`` (or ``local[*]``): PySpark starts a Spark Connect server in a JVM of this
      process with every ``spark.conf`` key, Delta's SQL extension and catalog and (with
      ``delta_from_maven``) Delta's jars; the client then keeps only the runtime SQL settings.
      Only one session kind can live in a process: a classic session already started here
      makes this fail (``SESSION_OR_CONTEXT_EXISTS``).
    - ``sc://host:port[/;token=...]``: an existing server (``sbin/start-connect-server.sh``,
      Databricks Connect). Its static settings (Delta's extension and jars, memory) are the
      server's: only ``spark.sql.*`` runtime keys of ``spark.conf`` are applied, the others are
      listed in the log and skipped.

    Needs the Connect client libraries (``pip install "pyspark[connect]"``: grpcio,
    grpcio-status, googleapis-common-protos, zstandard).
    """
    from pyspark.sql import SparkSession

    remote = params.remote
    local = remote.startswith("local")
    if not local and not remote.startswith("sc://"):
        raise SparkStartError(f"spark.remote={remote!r}: expected sc://host:port or local[N] (\"\" = classic Spark)")
    try:
        from pyspark.sql.connect.utils import check_dependencies
        check_dependencies()
    except ImportError as e:
        raise SparkStartError(f"spark.remote needs the Spark Connect client libraries: pip install "
                              f"'pyspark[connect]' ({e})") from None
    conf = {**DELTA_CONF, **params.conf}
    if local:
        builder = SparkSession.builder.remote(remote).appName(params.app_name)
    else:       # the Connect client's own builder: PySpark's would refuse next to a classic session
        from pyspark.sql.connect.session import SparkSession as ConnectSession
        builder = ConnectSession.builder.remote(remote).appName(params.app_name)
    if local:
        _local_python()
        for k, v in conf.items():
            builder = builder.config(k, str(v))
        if params.delta_from_maven:
            from delta import configure_spark_with_delta_pip
            builder = configure_spark_with_delta_pip(builder)
    else:
        skipped = sorted(k for k in conf if not k.startswith("spark.sql.") or k in DELTA_STATIC)
        for k, v in conf.items():
            if k not in skipped:
                builder = builder.config(k, str(v))
        if skipped:
            log.info("Spark Connect server %s: static settings are the server's, not set here: %s",
                     redact_remote(remote), ", ".join(skipped))
    with warnings.catch_warnings():
        # the client re-applies every builder option to the session; the local server already
        # started with the static ones, which it then refuses to change (a warning per key)
        warnings.filterwarnings("ignore", message=r"Failed to set .*CANNOT_MODIFY", category=UserWarning)
        spark = _start(builder, f"remote={redact_remote(remote)}")
    try:
        version = spark.version                 # the first round trip: is the server there?
    except Exception as e:  # noqa: BLE001 - gRPC UNAVAILABLE and kin
        try:
            spark.stop()                        # no half-made session left as the active one
        except Exception:  # noqa: BLE001
            pass
        raise SparkStartError(f"cannot reach the Spark Connect server {redact_remote(remote)}: "
                              f"{_first_line(e)}") from None
    if local:
        # the local server's JVM lives in this process: its log level is ours to set
        from pyspark import SparkContext
        if SparkContext._active_spark_context is not None:
            SparkContext._active_spark_context.setLogLevel(params.log_level)
    log.info("Spark %s Spark Connect session ready (remote=%s)", version, redact_remote(remote))
    return spark


# SQL settings a Connect client cannot change (the server was started with them)
DELTA_STATIC = ("spark.sql.extensions", "spark.sql.catalog.spark_catalog", "spark.sql.warehouse.dir")


# Local masters: the Python workers import pyspark from its installed package, not from the
# pyspark.zip Spark puts first on their path (no bytecode cache: see worker_daemon.py)
LOCAL_CONF = {"spark.python.daemon.module": "xmc_spark.worker_daemon"}


def local_conf(master: str) -> dict:
    """:data:`LOCAL_CONF` for a local master whose Python workers run this interpreter (where
    xmc_spark is installed); nothing otherwise (a configured ``spark.conf`` value wins either way)."""
    if master.startswith("local") and os.environ.get("PYSPARK_PYTHON") == sys.executable:
        return dict(LOCAL_CONF)
    return {}


def redact_remote(remote: str) -> str:
    """A Spark Connect URL with its token (``;token=...``) masked, for logs and errors."""
    return re.sub(r"(?i)(;\s*token\s*=)[^;]*", r"\1***", remote)


def _local_python() -> None:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else e.__class__.__name__


def _start(builder, where: str):
    try:
        return builder.getOrCreate()
    except Exception as e:  # noqa: BLE001 - PySparkRuntimeError [JAVA_GATEWAY_EXITED] and kin
        if "SESSION_OR_CONTEXT_EXISTS" in str(e) or "SESSION_ALREADY_EXIST" in str(e):
            raise SparkStartError(f"Spark could not start ({where}): a classic Spark session already runs in this "
                                  "process, and a local Spark Connect server needs its own (one session kind "
                                  "per process)") from None
        if "JAVA_GATEWAY_EXITED" not in str(e) and "Java gateway" not in str(e):
            raise
        raise SparkStartError(f"Spark could not start ({where}): the JVM "
                              f"exited; its own message is printed above this line. Check Java 17 is on PATH "
                              f"(JAVA_HOME) and the spark.* settings. ({e.__class__.__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
