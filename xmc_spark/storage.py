"""Readers and writers of Delta tables (atomic overwrite) and output folders.

A table is either a whole Delta table (one run per output folder, ``xmc-spark run``) or, with a
*run key* (the stage jobs: ``xmc-spark stage NAME --run-key 2026-11-25``), the partition
``run_key = KEY`` of a table shared by all runs. A run-keyed write replaces only that partition,
in one Delta commit (``replaceWhere``): a rerun for the same key is idempotent, other keys are
untouched, and a write that fails leaves the previous version of the table intact.
"""
from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple
from urllib.parse import unquote

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .compat import conf_value, is_connect, session_settings
from .errors import XmcError
from .schemas import SchemaError, check_table

log = logging.getLogger("xmc_spark.storage")

RUN_KEY = "run_key"
_RUN_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}$")


class ConcurrentWriteError(XmcError, RuntimeError):
    """Another run kept committing to the same table partition."""


# Delta's optimistic-concurrency conflicts: the other writer committed first, nothing of ours did
_CONFLICTS = ("ProtocolChangedException", "MetadataChangedException", "ConcurrentAppendException",
              "ConcurrentWriteException", "ConcurrentDeleteReadException", "ConcurrentDeleteDeleteException",
              "ConcurrentTransactionException", "DELTA_PROTOCOL_CHANGED", "DELTA_METADATA_CHANGED",
              "DELTA_CONCURRENT_", "FileAlreadyExistsException")
WRITE_ATTEMPTS = 6
# Parquet's per-value dictionary lookups took about a third of a table's write: the tables' list
# columns of feature and label ids fit a dictionary (at most ~100K distinct ids), so parquet-mr kept
# one. Written plain (and in zstd, spark.conf's default codec) the 500K set's weights table took
# 1.3-1.7 s against 2.5-4.0 s, 76.7 MB against 82.6 MB (README). A Hadoop setting: Delta's writer
# ignores it as a write option, so it is the session's for the write (:func:`_plain_parquet`)
PLAIN_PARQUET = {"parquet.enable.dictionary": "false"}
_REFUSED: set = set()           # keys a session refused once (a managed Connect server): not asked again
_PLAIN_LOCK = threading.Lock()
_PLAIN_OPEN: Dict[int, list] = {}   # id(session) -> [table writes running, their session_settings]


class RunKeyError(XmcError, ValueError):
    """A run key that cannot name a partition."""


class StageOrderError(XmcError, RuntimeError):
    """A stage ran before the stage whose output it reads."""


def check_run_key(key: str) -> str:
    if not isinstance(key, str) or not _RUN_KEY_RE.match(key):
        raise RunKeyError(f"run key {key!r} must be 1-64 characters of letters, digits and _ . : + - "
                          "(e.g. the logical date 2026-11-25)")
    return key


def is_local_path(path: str) -> bool:
    """A path on this machine's file system (not s3://, abfss://, dbfs:, ...)."""
    return "://" not in path and not path.startswith("dbfs:")


def hadoop_fs(spark: SparkSession, path: str):
    """(FileSystem, Path) of Hadoop's view of ``path`` (local, s3://, abfss://, dbfs:, ...), or
    None on Spark Connect (no JVM access from the client): see :func:`client_fs`."""
    if is_connect(spark):
        return None
    try:
        jvm = spark.sparkContext._jvm
        hpath = jvm.org.apache.hadoop.fs.Path(path)
        return hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hpath
    except Exception:  # noqa: BLE001 - no classic SparkContext
        return None


class StorageError(XmcError, OSError):
    """A path the Spark Connect client cannot look at."""


def client_fs(path: str):
    """(pyarrow FileSystem, path inside it): the Spark Connect fallback of :func:`hadoop_fs`.

    On Spark Connect the driver is a client without the server's Hadoop file system, so folder
    probes and listings (what kind of input, which tables, the Delta log's versions) go through
    pyarrow from the client: local paths and ``file:`` (a local Connect server, Databricks'
    ``/Volumes/...`` FUSE mounts), ``dbfs:/x`` as the ``/dbfs/x`` mount, ``s3://``/``s3a://``,
    ``gs://``, ``abfs(s)://`` and ``hdfs://`` with the client's own credentials (environment,
    instance profile). A client that cannot see the server's paths (a remote ``sc://`` server
    with local paths) must use paths both can read, or a classic session.
    """
    import pyarrow.fs as pafs
    if is_local_path(path) or path.startswith("file:"):
        local = path[len("file://"):] if path.startswith("file://") else \
            path[len("file:"):] if path.startswith("file:") else path
        return pafs.LocalFileSystem(), str(Path(local).absolute())
    if path.startswith("dbfs:"):
        return pafs.LocalFileSystem(), "/dbfs/" + path[len("dbfs:"):].lstrip("/")
    uri = "s3://" + path[len("s3a://"):] if path.startswith("s3a://") else path
    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as e:  # noqa: BLE001 - unknown scheme, no credentials, no network
        raise StorageError(f"{path}: a Spark Connect client cannot look at this path through pyarrow "
                           f"({_first_line(e)}); use a path the client can read too (a /Volumes/... "
                           "volume, s3:// / gs:// / abfss:// with credentials here) or a classic session "
                           "(spark.remote: \"\")") from None


def path_kind(spark: SparkSession, path: str) -> Optional[str]:
    """'file', 'dir' or None (nothing there), through Hadoop's file system for any scheme
    (classic) or pyarrow from a Spark Connect client (:func:`client_fs`)."""
    fs = hadoop_fs(spark, path)
    if fs is None:
        import pyarrow.fs as pafs
        afs, apath = client_fs(path)
        t = afs.get_file_info(apath).type
        return "dir" if t == pafs.FileType.Directory else None if t == pafs.FileType.NotFound else "file"
    fs, hpath = fs
    if not fs.exists(hpath):
        return None
    return "dir" if fs.getFileStatus(hpath).isDirectory() else "file"


def list_names(spark: SparkSession, path: str) -> List[str]:
    """Names of the entries of folder ``path`` (empty when it is not a folder), any scheme."""
    if path_kind(spark, path) != "dir":
        return []
    fs = hadoop_fs(spark, path)
    if fs is None:
        import pyarrow.fs as pafs
        afs, apath = client_fs(path)
        return sorted(i.base_name for i in afs.get_file_info(pafs.FileSelector(apath)))
    fs, hpath = fs
    return sorted(st.getPath().getName() for st in fs.listStatus(hpath))


def file_size(spark: SparkSession, path: str) -> Optional[int]:
    """Bytes of file ``path`` (None for a folder or nothing), any scheme."""
    fs = hadoop_fs(spark, path)
    if fs is None:
        import pyarrow.fs as pafs
        afs, apath = client_fs(path)
        info = afs.get_file_info(apath)
        return info.size if info.type == pafs.FileType.File else None
    fs, hpath = fs
    if not fs.exists(hpath):
        return None
    st = fs.getFileStatus(hpath)
    return None if st.isDirectory() else int(st.getLen())


def is_delta(spark: SparkSession, path: str) -> bool:
    try:
        from delta.tables import DeltaTable
        return DeltaTable.isDeltaTable(spark, path)
    except Exception:  # noqa: BLE001 - non-existing paths, no Delta on the classpath
        return False


@contextmanager
def _plain_parquet(spark):
    """Context: the session's settings for table writes, :data:`PLAIN_PARQUET`'s keys the session
    has no value for (one the configuration or the caller set is kept), restored when the last of
    the writes running at once in the session ends (threads writing tables together share them).
    A key the session refuses is logged once (:class:`~.compat.session_settings`) and skipped
    from then on."""
    with _PLAIN_LOCK:
        entry = _PLAIN_OPEN.get(id(spark))
        if entry is None:
            todo = {k: v for k, v in PLAIN_PARQUET.items() if k not in _REFUSED and conf_value(spark, k) is None}
            ctx = session_settings(spark, todo, "the tables' Parquet encoding").__enter__()
            _REFUSED.update(k for k in todo if k not in ctx.old)
            entry = _PLAIN_OPEN[id(spark)] = [0, ctx]
        entry[0] += 1
    try:
        yield
    finally:
        with _PLAIN_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _PLAIN_OPEN[id(spark)]
                entry[1].__exit__(None, None, None)


def write_delta(df: DataFrame, path: str, run_key: Optional[str] = None, where: Optional[str] = None) -> None:
    """Create a Delta table, or overwrite it in one commit: a failed write leaves the previous
    version intact (a table with no ``_delta_log`` yet is created: :func:`_write_delta`).

    With ``run_key`` the table is partitioned by ``run_key`` and only that key's rows are
    replaced (further narrowed by the SQL predicate ``where``, e.g. ``stage = 'tree'``).
    The files are written without Parquet dictionaries unless the session chose
    (:data:`PLAIN_PARQUET`).
    """
    with _plain_parquet(df.sparkSession):
        _write_delta(df, path, run_key, where)


def _write_delta(df: DataFrame, path: str, run_key: Optional[str], where: Optional[str]) -> None:
    if run_key is None:
        if not has_delta_log(df.sparkSession, path):
            # a new table is created, not overwritten: an overwrite first lists the files of the
            # table it replaces (one Spark query over the empty log, ~0.2 s a write in a warm
            # JVM); if another writer's table appears meanwhile, this write fails (the mode's own
            # check, DELTA_PATH_EXISTS, or Delta's commit of version 0, DELTA_PROTOCOL_CHANGED)
            df.write.format("delta").mode("errorifexists").save(path)
            return
        df.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(path)
        return
    check_run_key(run_key)
    cond = f"{RUN_KEY} = '{run_key}'" + (f" AND ({where})" if where else "")
    writer = (df.withColumn(RUN_KEY, F.lit(run_key)).write.format("delta").mode("overwrite")
              .partitionBy(RUN_KEY).option("replaceWhere", cond).option("mergeSchema", "true"))
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            writer.save(path)
            break
        except Exception as e:  # noqa: BLE001 - Delta's conflicts reach Python as Py4J/Spark errors
            if not is_conflict(e):
                raise
            if attempt == WRITE_ATTEMPTS:
                raise ConcurrentWriteError(
                    f"{path}: another run kept committing to this table while run key {run_key} was being "
                    f"written ({WRITE_ATTEMPTS} attempts; last conflict: {_first_line(e)}); rerun the stage "
                    "once the other run has finished") from None
            pause = min(8.0, 0.5 * 2 ** attempt) * (0.5 + random.random())
            log.warning("%s: concurrent commit (%s); retrying in %.1fs", path, _first_line(e), pause)
            time.sleep(pause)
    log.info("wrote %s [%s]", path, cond)


def is_conflict(e: Exception) -> bool:
    """Is ``e`` a Delta optimistic-concurrency conflict (another writer committed first)?"""
    return any(c in str(e) or c in e.__class__.__name__ for c in _CONFLICTS)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else e.__class__.__name__


def read_delta(spark: SparkSession, path: str, run_key: Optional[str] = None,
               version: Optional[int] = None, listed: Optional[int] = None) -> DataFrame:
    """A Delta table (at ``version``, Delta time travel, when given), one run key's rows.
    ``listed``: without ``version``, the latest version as the caller listed it, whose log is read
    as a given version's (through Delta it is the latest, whatever was listed).

    A given version whose log says which Parquet files make it, and how to read them
    (:func:`version_files`: version 0's own entry, a later version's checksum file), is read as
    those files, when they are at most Spark's threshold for listing files in a job
    (``spark.sql.sources.parallelPartitionDiscovery.threshold``, 32; each file is also checked to
    exist): the same files a Delta read of that version scans, without Delta's state
    reconstruction, which computes every new version's file list in Spark jobs (three small jobs
    and their planning: 0.3-3 s per table a run writes and then reads, ~7 s of a fresh 200K run)."""
    at = version if version is not None else listed
    if at is not None:
        state = version_files(spark, path, int(at), run_key)
        if state is not None:
            return read_files(spark, state)
    return _through_delta(spark, path, run_key, version)


def _through_delta(spark: SparkSession, path: str, run_key: Optional[str], version: Optional[int]) -> DataFrame:
    """:func:`read_delta` by Delta's own reader (its state reconstruction): at ``version``, else the latest."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", int(version))
    df = reader.load(path)
    if run_key is None:
        return df
    return df.filter(F.col(RUN_KEY) == check_run_key(run_key)).drop(RUN_KEY)


# the protocol's reader features that leave a table's files plain Parquet under its logical
# schema (deletion vectors only as long as no file has one: checked per file)
PLAIN_READER_FEATURES = frozenset({"deletionVectors", "timestampNtz", "v2Checkpoint", "vacuumProtocolCheck"})
_GLOB = frozenset("{}[]*?\\")
ENTRY_BYTES = 4 << 20        # a log entry or checksum file larger than this is not read into the driver


def version_files(spark: SparkSession, path: str, version: int,
                  run_key: Optional[str] = None) -> Optional[Tuple[T.StructType, List[str]]]:
    """(schema, data files) of ``version`` of the Delta table at ``path`` (of ``run_key``'s
    partition when given: its files, none when the key has no rows, the schema without the key),
    read from the log: version 0 from its own entry (``_delta_log/00000000000000000000.json``: a
    table's first version is what that entry adds, :func:`plain_state`), a later version from its
    checksum file (``_delta_log/NNN.crc``, :func:`checksum_state`: the protocol's record of the
    version's state, which Delta writes after each commit, listing every live file while the
    table has at most ``spark.databricks.delta.allFilesInCrc.thresholdNumFiles`` files, 50, all
    run keys together, and its schema did not change in that commit), checked against that
    version's own entry (what it added is listed, what it removed is not); when those files read
    as plain Parquet give the table (or the key's rows) and are at most Spark's threshold for
    listing files in a job. Else None (and on Spark Connect, when a file cannot be read or parsed,
    or when it is over :data:`ENTRY_BYTES`: the driver reads it whole), and the caller reads
    through Delta."""
    if any(c in _GLOB for c in path):
        return None
    try:
        entry = _log_text(spark, path, f"{int(version):020d}.json")
        if entry is None:
            return None
        if version == 0:
            state = plain_state(entry, path, run_key)
        else:
            crc = _log_text(spark, path, f"{int(version):020d}.crc")
            state = checksum_state(crc, path, run_key, entry) if crc is not None else None
    except Exception:  # noqa: BLE001 - a file this reader does not understand: Delta's read may
        return None
    limit = int(conf_value(spark, "spark.sql.sources.parallelPartitionDiscovery.threshold", "32") or 32)
    return state if state is not None and len(state[1]) <= limit else None


def _log_text(spark: SparkSession, path: str, name: str) -> Optional[str]:
    """The text of ``_delta_log/<name>`` of the table at ``path``, through the session's Hadoop
    file system; None on Spark Connect, when there is no such file (log cleanup, a checksum never
    written), when it is over :data:`ENTRY_BYTES`, or when the store cannot be read from here."""
    fs = hadoop_fs(spark, f"{path.rstrip('/')}/_delta_log/{name}")
    if fs is None:
        return None
    try:
        fs, hpath = fs
        if fs.getFileStatus(hpath).getLen() > ENTRY_BYTES:   # a table of many files: Delta's read
            return None
        stream = fs.open(hpath)
        try:
            return str(spark.sparkContext._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
        finally:
            stream.close()
    except Exception:  # noqa: BLE001 - no such file, a store unreachable from here
        return None


def plain_state(entry: str, path: str, run_key: Optional[str] = None) -> Optional[Tuple[T.StructType, List[str]]]:
    """:func:`version_files` of a version-0 log entry's text (newline-delimited actions): no action
    beyond a creation's (protocol, metadata, files, commit info), and the state :func:`_plain`."""
    protocol = meta = None
    adds: List[dict] = []
    for line in entry.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        if "protocol" in action:
            protocol = action["protocol"]
        elif "metaData" in action:
            meta = action["metaData"]
        elif "add" in action:
            adds.append(action["add"])
        elif "commitInfo" not in action:          # remove, cdc, txn, domainMetadata...: not plain
            return None
    return _plain(protocol, meta, adds, path, run_key)


def checksum_state(text: str, path: str, run_key: Optional[str] = None,
                   entry: Optional[str] = None) -> Optional[Tuple[T.StructType, List[str]]]:
    """:func:`version_files` of a version's checksum file (one JSON object): its protocol,
    metadata and every live file (``allFiles``, optional in the protocol), consistent with its
    own counts (``numFiles``, ``tableSizeBytes``, one metadata and one protocol) and, when given,
    with that version's log ``entry`` (every file it adds listed, none it removes), no domain
    metadata, and the state :func:`_plain`."""
    crc = json.loads(text)
    files = crc.get("allFiles") if isinstance(crc, dict) else None
    if (not isinstance(files, list) or crc.get("numFiles") != len(files) or crc.get("domainMetadata")
            or crc.get("numMetadata") != 1 or crc.get("numProtocol") != 1
            or crc.get("tableSizeBytes") != sum(int(a.get("size") or 0) for a in files)):
        return None
    if entry is not None:
        live = {unquote(a["path"]) for a in files}
        for line in entry.splitlines():
            action = json.loads(line) if line.strip() else {}
            if ("add" in action and unquote(action["add"]["path"]) not in live
                    or "remove" in action and unquote(action["remove"]["path"]) in live):
                return None
    return _plain(crc.get("protocol"), crc.get("metadata"), files, path, run_key)


def _plain(protocol, meta, adds: List[dict], path: str,
           run_key: Optional[str]) -> Optional[Tuple[T.StructType, List[str]]]:
    """(schema, files) of a version's protocol, metadata and live files (``adds``), when those
    files read as plain Parquet give the table: no partition columns (with ``run_key``: only the
    run key, and its files are the key's; the schema leaves the key out), no column mapping, no
    reader feature beyond :data:`PLAIN_READER_FEATURES`, no commit coordinator (whose later
    commits a listing may not see), no reader options, no deletion vector, file paths relative,
    distinct, not hidden from Spark's file index (``_``, ``.``) and not what Spark would take for
    a glob; the schema's fields keep of their metadata only what Delta's read keeps
    (char/varchar types and comments)."""
    if protocol is None or meta is None:
        return None
    reader = int(protocol.get("minReaderVersion", 1))
    if reader > 3 or (reader == 3 and not set(protocol.get("readerFeatures") or ()) <= PLAIN_READER_FEATURES):
        return None
    if any("coordinatedCommits" in f or "catalog" in f.lower() for f in protocol.get("writerFeatures") or ()):
        return None
    conf, fmt = meta.get("configuration") or {}, meta.get("format") or {}
    if (conf.get("delta.columnMapping.mode", "none") != "none" or any("coordinatedCommits" in k for k in conf)
            or list(meta.get("partitionColumns") or []) != ([] if run_key is None else [RUN_KEY])
            or fmt.get("provider", "parquet") != "parquet" or fmt.get("options")):
        return None
    files: List[str] = []
    for add in adds:
        parts = add.get("partitionValues") or {}
        if parts != ({} if run_key is None else {RUN_KEY: parts.get(RUN_KEY)}):
            return None
        if run_key is not None and parts[RUN_KEY] != run_key:
            continue                              # another run's file
        rel = unquote(add["path"])
        if (add.get("deletionVector") or ":" in rel or rel.startswith("/")
                or rel.rsplit("/", 1)[-1].startswith(("_", "."))):
            return None
        files.append(f"{path.rstrip('/')}/{rel}")
    if len(set(files)) < len(files) or any(c in _GLOB for f in files for c in f):
        return None
    schema = _read_metadata(json.loads(meta["schemaString"]))
    if run_key is not None:
        kept = [f for f in schema["fields"] if f["name"] != RUN_KEY]
        if len(kept) != len(schema["fields"]) - 1:
            return None
        schema = {**schema, "fields": kept}
    return T.StructType.fromJson(schema), files


_KEPT_METADATA = ("__CHAR_VARCHAR_TYPE_STRING", "comment")


def _read_metadata(t):
    """A schema's JSON with each field's metadata cut to what Delta's read keeps of it."""
    if isinstance(t, dict):
        if t.get("type") == "struct":
            return {**t, "fields": [{**f, "type": _read_metadata(f["type"]),
                                     "metadata": {k: v for k, v in (f.get("metadata") or {}).items()
                                                  if k in _KEPT_METADATA}} for f in t["fields"]]}
        if t.get("type") == "array":
            return {**t, "elementType": _read_metadata(t["elementType"])}
        if t.get("type") == "map":
            return {**t, "keyType": _read_metadata(t["keyType"]), "valueType": _read_metadata(t["valueType"])}
    return t


def read_files(spark: SparkSession, state: Tuple[T.StructType, List[str]]) -> DataFrame:
    """The rows of :func:`version_files`' (schema, files): none without files."""
    if not state[1]:
        return spark.createDataFrame([], state[0])
    return spark.read.schema(state[0]).parquet(*state[1])


def write_whole(fs, path: str, write: Callable) -> None:
    """Write ``path`` through the pyarrow file system ``fs`` whole or not at all (``write`` gets
    the output stream): on a local file system a temporary file renamed into place, so that a
    retried or speculative attempt never leaves a reader half a file; an object store makes an
    object visible only when it is complete."""
    local = fs.type_name == "local"
    target = f"{path}.tmp-{uuid.uuid4().hex}" if local else path
    with fs.open_output_stream(target) as f:
        write(f)
    if local:
        fs.move(target, path)


def has_delta_log(spark: SparkSession, path: str) -> bool:
    """Whether ``path`` holds a Delta log (a table, or the start of one), as the session's own
    Hadoop file system sees it; True when that cannot be asked (Spark Connect, whose client may
    not see the server's paths at all, or a store that fails): the caller then treats the table
    as there."""
    fs = hadoop_fs(spark, path.rstrip("/") + "/_delta_log")
    if fs is None:
        return True
    try:
        return bool(fs[0].exists(fs[1]))
    except Exception:  # noqa: BLE001 - a store Hadoop cannot reach from here
        return True


def table_version(spark: SparkSession, path: str) -> int:
    """The latest committed version of a Delta table: the highest ``_delta_log/NNN.json``, found
    with one file-system listing (no Spark job); Delta's history as the fallback."""
    try:
        names = list_names(spark, path.rstrip("/") + "/_delta_log")
        versions = [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]
        if versions:
            return max(versions)
    except Exception:  # noqa: BLE001 - a store neither Hadoop nor pyarrow can list from here
        pass
    from delta.tables import DeltaTable
    return int(DeltaTable.forPath(spark, path).history(1).select("version").first()[0])


class Tables:
    """The named Delta tables of one run: ``ROOT/<name>``, optionally one run key's partition.

    ``pins`` maps table names to the Delta version to read (the version an upstream stage
    recorded when it finished), so a stage reads its inputs as the last *successful* run of the
    stage that produced them left them, even if a later run of that stage failed half-way;
    ``reads`` records the version of every table read (for MLflow).
    """

    def __init__(self, spark: SparkSession, root, run_key: Optional[str] = None,
                 pins: Optional[Dict[str, int]] = None, links: Optional[Dict[str, str]] = None):
        self.spark = spark
        self.root = str(root).rstrip("/")
        self.links: Dict[str, str] = dict(links or {})      # tables that live elsewhere (a sweep's inputs)
        self.run_key = check_run_key(run_key) if run_key is not None else None
        self.pins: Dict[str, int] = dict(pins or {})
        self.reads: Dict[str, int] = {}
        if is_local_path(self.root):
            Path(self.root).mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> str:
        return self.links.get(name) or f"{self.root}/{name}"

    @property
    def scratch(self) -> str:
        """A folder of the run for files the tasks write and read during a stage (the distributed
        solver's vectors); each user makes a unique sub-folder and deletes it."""
        return f"{self.root}/_scratch"

    def write(self, name: str, df: DataFrame, where: Optional[str] = None) -> None:
        write_delta(df, self.path(name), self.run_key, where)
        self.pins.pop(name, None)                 # this run's own output from now on

    def read(self, name: str) -> DataFrame:
        version = self.pins.get(name)
        self.reads[name] = version if version is not None else self.version(name)
        df = read_delta(self.spark, self.path(name), self.run_key, version, listed=self.reads[name])
        try:
            return check_table(df, name)
        except SchemaError as e:
            raise SchemaError(f"{self.path(name)}: {e}") from None

    def note_read(self, name: str) -> None:
        """Record table ``name`` as read at its pinned (else latest) version without reading it:
        for a stage that uses the same data already in memory (e.g. the trained model)."""
        self.reads[name] = self.pins[name] if name in self.pins else self.version(name)

    def version(self, name: str) -> int:
        return table_version(self.spark, self.path(name))

    def exists(self, name: str) -> bool:
        return is_delta(self.spark, self.path(name))
