"""What differs between a classic Spark session and a Spark Connect one, in one place.

Spark Connect (Databricks serverless and standard-access clusters, ``spark.remote`` here) runs
the Python driver as a thin client: no ``SparkContext``, no RDDs, no ``sc.broadcast``, no status
tracker, no ``_jvm``. Stages use these three functions instead of the ``SparkContext``:

- :func:`is_connect` (``spark`` or a DataFrame): is this a Spark Connect session?
- :func:`share` (``spark``, value) -> an object with ``.value`` to read inside tasks (UDFs,
  ``mapInArrow``/``mapInPandas``/``applyInPandas`` functions):

  * classic: ``sparkContext.broadcast(value)`` (sent once per executor, kept in its block store);
  * Connect: the value pickled *once* on the driver and captured in the task function's closure.
    **Size caveat**: the closure travels inside every query plan that uses it (one gRPC message,
    the server's ``spark.connect.grpc.maxInboundMessageSize``, 128 MiB by default) and is
    unpickled once per task, not once per executor. Keep shared values small (counts per label,
    a tree index, a few embedding rows); :func:`share` refuses a value over ``max_mb``
    (default :data:`CONNECT_MAX_MB`) with :class:`ShareTooLargeError` instead of failing deep
    in gRPC. Larger data belongs in a table joined to the rows.

  Both kinds answer ``.unpersist()`` and ``.destroy()`` (no-ops on Connect), so callers that
  release broadcasts need no branch.
- :func:`default_parallelism` (``spark``): ``sparkContext.defaultParallelism`` on classic; on
  Connect ``spark.default.parallelism`` / ``spark.sql.leafNodeDefaultParallelism`` when set, else
  the number of partitions Spark gives ``spark.range`` (one tiny job).

Beside them, the session's partitioning facts (:func:`task_slots`, :func:`shuffle_partitions`)
and Spark's hash partitioning of int keys (:func:`spark_hash_int`, :func:`partition_keys`: keys
that ``repartition(n, col)`` or a ``groupBy`` over n shuffle partitions sends to a partition each).
"""
from __future__ import annotations

import logging
import math
import os
import pickle
from typing import Any, Generic, Optional, Tuple, TypeVar

import numpy as np

from .errors import XmcError

log = logging.getLogger("xmc_spark.compat")

T = TypeVar("T")

CONNECT_MAX_MB = 100.0   # below the Connect server's default 128 MiB gRPC message limit


class ShareTooLargeError(XmcError, ValueError):
    """A value too large to travel in a Spark Connect query plan."""


def is_connect(spark_or_df: Any) -> bool:
    """True for a Spark Connect session (or a DataFrame of one), False for a classic one."""
    spark = getattr(spark_or_df, "sparkSession", spark_or_df)
    return type(spark).__module__.startswith("pyspark.sql.connect")


class Captured(Generic[T]):
    """A value shipped to tasks inside the closure that references it (Spark Connect's stand-in
    for a broadcast). Pickled once on the driver; unpickled on first ``.value`` in each task."""

    __slots__ = ("_blob", "_value", "_loaded")

    def __init__(self, value: T):
        from pyspark import cloudpickle  # what Spark pickles closures with (lambdas, local classes)
        self._blob = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        self._value = value
        self._loaded = True

    @property
    def value(self) -> T:
        if not self._loaded:
            self._value = pickle.loads(self._blob)
            self._loaded = True
        return self._value

    @property
    def nbytes(self) -> int:
        """Size of the pickled value (what every plan using it carries)."""
        return len(self._blob)

    def unpersist(self, blocking: bool = False) -> None:
        """Nothing to release (the value lives in the closures); for Broadcast compatibility."""

    def destroy(self, blocking: bool = False) -> None:
        """Nothing to release (the value lives in the closures); for Broadcast compatibility."""

    # what a closure carries: the bytes only (the driver's unpickled copy stays home)
    def __getstate__(self):
        return self._blob

    def __setstate__(self, blob):
        self._blob, self._value, self._loaded = blob, None, False


def share(spark: Any, value: T, max_mb: float = CONNECT_MAX_MB, name: str = "value") -> Any:
    """``value`` readable in tasks as ``.value``: a broadcast on classic Spark, a closure-captured
    copy on Spark Connect (see the module docstring for the size caveat; ``name`` labels the
    error). ``spark`` may also be a DataFrame of the session."""
    spark = getattr(spark, "sparkSession", spark)
    if not is_connect(spark):
        return spark.sparkContext.broadcast(value)
    c = Captured(value)
    mb = c.nbytes / 2**20
    if mb > max_mb:
        raise ShareTooLargeError(
            f"{name} is {mb:.1f} MiB pickled: too large to ship inside a Spark Connect query plan "
            f"(limit {max_mb:g} MiB; the server's spark.connect.grpc.maxInboundMessageSize caps "
            "every plan). Use a classic session (spark.remote: \"\") or keep the data in a table "
            "joined to the rows")
    if mb > 8:
        log.info("sharing %s (%.1f MiB) through the query plan (Spark Connect: no broadcast)", name, mb)
    return c


def default_parallelism(spark: Any) -> int:
    """``sparkContext.defaultParallelism`` on classic Spark; on Spark Connect the configured
    ``spark.default.parallelism`` or ``spark.sql.leafNodeDefaultParallelism``, else the number of
    partitions of ``spark.range`` (what Spark itself defaults to: one small job)."""
    spark = getattr(spark, "sparkSession", spark)
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    for key in ("spark.default.parallelism", "spark.sql.leafNodeDefaultParallelism"):
        try:
            v = spark.conf.get(key, None)
        except Exception:  # noqa: BLE001 - a key the server does not expose
            v = None
        if v is not None and str(v).strip().isdigit() and int(v) > 0:
            return int(v)
    return range_partitions(spark)


def task_slots(spark: Any, default: Optional[int] = None) -> int:
    """Tasks that run at once: N of a classic ``local[N]`` / ``local[N,F]`` master (the machine's
    processors for ``local`` / ``local[*]``), else :func:`default_parallelism` (on a cluster Spark
    sets it to the executors' cores unless the configuration overrides it), or ``default`` when
    the caller has read it already (on Spark Connect reading it may cost a job)."""
    spark = getattr(spark, "sparkSession", spark)
    n = None if is_connect(spark) else local_slots(spark.sparkContext.master or "")
    if n is not None:
        return n
    return int(default) if default is not None else default_parallelism(spark)


def local_slots(master: str) -> Optional[int]:
    """The task slots of a local master string, None for any other master."""
    import re
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master)
    if not m:
        return None
    return int(m.group(1)) if m.group(1) and m.group(1).isdigit() else max(1, os.cpu_count() or 1)


def range_partitions(spark: Any) -> int:
    """The number of partitions Spark gives ``spark.range`` without a count (the default
    parallelism of a leaf): 2^20 rows spread over them, every one holds rows (one small job)."""
    from pyspark.sql import functions as F
    r = spark.range(0, 1 << 20).select(F.spark_partition_id().alias("p")).agg(F.max("p").alias("p")).first()
    return int(r["p"]) + 1


def shuffle_partitions_set(spark) -> Optional[int]:
    """``spark.sql.shuffle.partitions`` as a number, None when the platform sets it to ``auto``
    (Databricks) or a Spark Connect server does not expose it."""
    try:     # unset: Spark's own default (a fallback of "auto" is rejected by Spark 4.2's typed conf)
        v = str(spark.conf.get("spark.sql.shuffle.partitions"))
    except Exception:  # noqa: BLE001 - a key a Spark Connect server does not expose
        v = "auto"
    return int(v) if v.isdigit() else None


def shuffle_partitions(spark) -> int:
    """Task count for our own bucketing: ``spark.sql.shuffle.partitions``, or the default
    parallelism when the platform sets it to ``auto`` (Databricks)."""
    n = shuffle_partitions_set(spark)
    return n if n is not None else int(default_parallelism(spark))


TASK_ROWS = 1 << 16      # rows a task of a small shuffle sized by :func:`sized_partitions` reads


def sized_partitions(spark, rows: float, per_task: int = TASK_ROWS,
                     bounds: Optional[Tuple[int, Optional[int]]] = None) -> int:
    """Partitions for a shuffle of about ``rows`` rows: ``per_task`` a task, at least the default
    parallelism, at most ``spark.sql.shuffle.partitions`` (no most when the platform sets it to
    ``auto``); ``bounds``: those two, read once by a caller sizing many shuffles. Every task
    reports its metrics to the driver (5-10 KB each), so a shuffle whose rows are few (a count
    per label, a test set's join) runs the tasks its rows need, not the shuffle partitions
    (which adaptive execution would coalesce, and not when that is off), while a task's rows
    stay bounded as the input grows (up to that cap)."""
    lo, hi = bounds if bounds is not None else (max(1, int(default_parallelism(spark))), shuffle_partitions_set(spark))
    k = max(lo, math.ceil(max(rows, 1) / per_task))
    return max(1, k if hi is None else min(hi, k))


def coalescing(spark) -> bool:
    """Whether adaptive execution coalesces small shuffle partitions (``spark.sql.adaptive.enabled``
    and ``spark.sql.adaptive.coalescePartitions.enabled``, both on by default): a shuffle sized
    by its own partition count (``repartition(n, ...)``) is then left as it is."""
    return all(str(conf_value(spark, k, "true")).strip().lower() == "true"
               for k in ("spark.sql.adaptive.enabled", "spark.sql.adaptive.coalescePartitions.enabled"))


def small_result(df, rows: float):
    """``df`` (a shuffle's output of about ``rows`` rows: a count per label, a test set's join) read
    by the tasks that many rows need (:func:`sized_partitions`; a coalesce of the shuffle's
    partitions, each still aggregated or joined on its own), on classic Spark; on Spark Connect as
    it is (sizing it could cost a job of its own there, :func:`default_parallelism`)."""
    if is_connect(df):
        return df
    return df.coalesce(sized_partitions(df.sparkSession, rows))


def spark_hash_int(values) -> np.ndarray:
    """Spark SQL's ``hash()`` of int values (Murmur3 x86_32, seed 42), the hash
    ``repartition(n, col)`` takes modulo n (``pmod``) to choose an int column's partition."""
    k = np.asarray(values, np.int64).astype(np.uint32)
    with np.errstate(over="ignore"):
        k = k * np.uint32(0xcc9e2d51)
        k = (k << np.uint32(15)) | (k >> np.uint32(17))
        k = k * np.uint32(0x1b873593)
        h = np.uint32(42) ^ k
        h = (h << np.uint32(13)) | (h >> np.uint32(19))
        h = h * np.uint32(5) + np.uint32(0xe6546b64)
        h ^= np.uint32(4)
        h ^= h >> np.uint32(16)
        h = h * np.uint32(0x85ebca6b)
        h ^= h >> np.uint32(13)
        h = h * np.uint32(0xc2b2ae35)
        h ^= h >> np.uint32(16)
    return h.view(np.int32)


def partition_keys(n_parts: int) -> np.ndarray:
    """For each partition r < ``n_parts``, the smallest non-negative int that
    ``repartition(n_parts, col)`` sends to partition r."""
    keys = np.full(n_parts, -1, np.int64)
    lo, step = 0, 16 * n_parts
    while (keys < 0).any():
        cand = np.arange(lo, lo + step, dtype=np.int64)
        part = spark_hash_int(cand).astype(np.int64) % n_parts
        first, at = np.unique(part, return_index=True)          # the first candidate of each partition
        new = keys[first] < 0
        keys[first[new]] = cand[at[new]]
        lo += step
    return keys


def conf_value(spark, key: str, default=None):
    """The session's setting ``key``, or ``default`` when unset or not exposed (a Spark Connect
    server may refuse to read some keys)."""
    try:
        return spark.conf.get(key, default)
    except Exception:  # noqa: BLE001 - a key a Spark Connect server does not expose
        return default


class session_settings:
    """Context: the session's ``settings`` (key -> value) for the queries run inside it, each
    restored (or unset) on exit, also after an error. Session settings, so they reach Spark
    Connect too; a caller's other threads sharing the session would run under them meanwhile
    (the pipeline's stages run their queries one after another). A setting the server refuses (a
    managed Connect server may allow only some keys) keeps its value, with a warning naming
    ``purpose``: callers use settings that change speed, never results."""

    def __init__(self, spark, settings: dict, purpose: str):
        self.spark, self.settings, self.purpose = spark, dict(settings), purpose

    def __enter__(self):
        self.old = {}
        for k, v in self.settings.items():
            old = conf_value(self.spark, k)
            try:
                self.spark.conf.set(k, v)
            except Exception as e:  # noqa: BLE001 - refused by the server: keep its value
                log.warning("could not set %s=%s for %s (%s); keeping %s", k, v, self.purpose, e, old)
                continue
            self.old[k] = old
        return self

    def __exit__(self, *exc):
        for k, v in self.old.items():
            try:
                if v is None:
                    self.spark.conf.unset(k)
                else:
                    self.spark.conf.set(k, v)
            except Exception as e:  # noqa: BLE001 - never hide the error that ended the block
                log.warning("could not restore %s=%s after %s (%s)", k, v, self.purpose, e)
        return False


def scratch_root(spark, scratch: Optional[str]) -> Optional[str]:
    """A folder the driver and every task see, for files the tasks share (the distributed solver's
    vectors, the search's top layers): ``scratch`` (the pipeline passes ``<run folder>/_scratch``),
    else in local mode the machine's temp folder; None on a cluster without one."""
    if scratch:
        return scratch
    if str(conf_value(spark, "spark.master", "") or "").startswith("local"):
        import tempfile
        return tempfile.gettempdir()
    return None


def partitioned_checkpoint(df, n_parts: int, *keys: str):
    """``df`` hash-partitioned on ``keys`` into ``n_parts`` partitions and checkpointed on the
    executors (``localCheckpoint``, eager), keeping that partitioning in its plan: a later join or
    grouping on ``keys`` then shuffles only its other side, into these partitions. The checkpoint
    runs without adaptive execution (:class:`session_settings`), whose plans leave a checkpoint no
    output partitioning (Spark 4.2: both sides of such a join were shuffled to
    ``spark.sql.shuffle.partitions``); where the server refuses the setting, the checkpoint is
    the same rows, and such a join shuffles both sides as before."""
    return kept_checkpoint(df.repartition(n_parts, *keys))


def kept_checkpoint(df):
    """``df`` checkpointed on the executors (``localCheckpoint``, eager) without adaptive execution
    (:class:`session_settings`), so that the checkpoint keeps the partitioning its plan ends with
    (a ``repartition`` on keys, or a grouping after one): a later join or grouping on those keys
    then shuffles nothing of it (:func:`partitioned_checkpoint`)."""
    with session_settings(df.sparkSession, {"spark.sql.adaptive.enabled": "false"},
                          "a checkpoint that keeps its partitioning"):
        return df.localCheckpoint()


def never_broadcast(df):
    """``df`` as a join side that is shuffled (a shuffled hash join), never broadcast. For a
    table of a row per sample: the planner, taking it for small from its compressed files, would
    otherwise broadcast it, every row through the driver (the 2M run's evaluation join: 65.5 MiB
    of predictions)."""
    return df.hint("shuffle_hash")
