"""The driver JVM's class-data archive (HotSpot AppCDS): Spark's classes loaded from a file.

A local Spark driver spends most of its start (about 8 s of ``getOrCreate`` and 3.5 s of the
first job on 2 cores) loading, verifying and linking the same ~20,000 classes every run. The JVM
can write the classes it loaded into an archive when it exits (``-XX:ArchiveClassesAtExit``) and
map them from that archive at the next start (``-XX:SharedArchiveFile``): start-up 8.0 -> 5.1 s
and the first job 3.5 -> 2.0 s (Spark 4.2, Java 17).

- **Once per environment.** The archive is named by a key over the JDK (``bin/java``, its class
  image, JVM library and base archive) and the driver's jars (Spark's ``jars`` folder and the
  ``spark.jars`` files: path, size, time): another JDK or any changed jar makes a new one.
  Writing it costs the first run about 15 s at its exit (the archive is ~150-200 MB); the three
  newest archives are kept.
- **Validated.** The JVM writes a temporary file; at the Python process's exit the active
  SparkContext is stopped, the JVM's standard input closed (it exits, with code 0) and the
  process waits for it (up to EXIT_WAIT_SECONDS), renaming the file only then, so a crash or a
  kill leaves no archive (its temporary file is removed by a later run). At use the JVM checks
  the archive against the JDK and every jar (size and time) and its CRC
  (``-XX:+VerifySharedSpaces``), and runs without it if anything differs.
- **One writer at a time.** A lock file holding the writer's ``pid@host`` (written whole, then
  hard-linked to its name, which fails if it exists) lets one process make the archive; others
  start without one meanwhile. The lock or temporary file of a process of this host that no
  longer runs is removed; another host's lock (a shared cache) after six hours.
- **Only where xmc-spark starts the JVM**: a local master's driver, launched by PySpark, once
  Delta's jars are recorded (the first run resolves them through Ivy: its class path is not the
  later runs'); not under spark-submit (its driver is already running), not when
  ``PYSPARK_SUBMIT_ARGS`` or a ``spark-defaults.conf`` sets driver Java options or class path,
  not on Spark Connect, not from a folder with white space in its path (Spark's launcher splits
  Java options at it). ``spark.class_data_sharing: false`` turns it off. The archive lives under
  the jar record's cache root (``$XMC_SPARK_CACHE``, else ``$XDG_CACHE_HOME/xmc-spark``, else
  ``~/.cache/xmc-spark``), in ``cds/``.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from .tracking import pid_alive

log = logging.getLogger("xmc_spark.cds")

KEEP = 3                    # archives kept in the folder (the newest), for a few environments side by side
EXIT_WAIT_SECONDS = 180     # how long the Python process waits for the JVM to write the archive
# Quiet: the JVM's notes on classes it leaves out (signed jars, unlinked classes) are not the user's business.
_COMMON = ("-Xlog:cds=off", "-Xlog:cds+dynamic=off")
FOREIGN_LOCK_SECONDS = 6 * 3600   # a lock of another host (a shared cache) is stale after this long


def java_binary() -> Optional[str]:
    """The java that Spark's launcher runs: ``$JAVA_HOME/bin/java``, else ``java`` on PATH."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(java) if java and os.path.isfile(java) else None


def spark_jars() -> List[str]:
    """The jar files of the driver's class path: the Spark distribution's ``jars`` folder."""
    from pyspark.find_spark_home import _find_spark_home
    folder = Path(_find_spark_home(), "jars")
    return sorted(str(p) for p in folder.glob("*.jar")) if folder.is_dir() else []


def _jdk_files(java: str) -> List[str]:
    """The JDK's own files an archive depends on beside ``bin/java``: its class image, the JVM
    library and the JDK's base archive."""
    home = Path(java).parent.parent
    found = [home / "lib" / "modules", *(home / "lib").glob("*/libjvm.*"), *(home / "lib").glob("*/classes*.jsa")]
    return [str(f) for f in found if f.is_file()]


def archive_key(java: str, jars: Iterable[str]) -> str:
    """A name for the archive of this JVM and these jars: any change of the java binary, the JDK's
    class image, JVM library or base archive, or of a jar (path, size, modification time) gives
    another key."""
    h = hashlib.sha256()
    for f in [java, *_jdk_files(java), *sorted(jars)]:
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _owner() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def _stale(path: Path) -> bool:
    """Whether a lock (text ``pid@host``) or a temporary file (``<key>.<pid>.tmp`` / ``.lk``) belongs
    to a process that no longer runs: a dead pid of this host, another host's lock (or one that
    names no host) after FOREIGN_LOCK_SECONDS, a name without a pid after a minute."""
    try:
        age = time.time() - path.stat().st_mtime
        text = path.read_text().strip() if path.suffix == ".lock" else ""
    except OSError:
        return False
    if path.suffix == ".lock":
        pid, _, host = text.partition("@")
        if host != socket.gethostname():
            return age > FOREIGN_LOCK_SECONDS
    else:
        parts = path.name.split(".")
        pid = parts[-2] if len(parts) >= 3 else ""
    if not pid.isdigit():
        return age > 60
    return not pid_alive(int(pid))


def _clean(folder: Path) -> None:
    """Remove the locks and temporary files of processes that no longer run."""
    for p in [*folder.glob("*.lock"), *folder.glob("*.tmp"), *folder.glob("*.lk")]:
        if _stale(p):
            p.unlink(missing_ok=True)


def _take(lock: Path) -> bool:
    """Create ``lock`` holding this process's ``pid@host``, whole or not at all (a file written
    first, then hard-linked to the lock's name, which fails if the lock exists)."""
    mine = lock.with_name(f"{lock.stem}.{os.getpid()}.lk")
    mine.write_text(_owner())
    try:
        os.link(mine, lock)
        return True
    except FileExistsError:
        return False
    finally:
        mine.unlink(missing_ok=True)


def _release(lock: Path) -> None:
    """Remove ``lock`` if this process holds it."""
    try:
        if lock.read_text().strip() == _owner():
            lock.unlink()
    except OSError:
        pass


@dataclass
class Plan:
    """What the driver JVM gets: its options, and for a writer the files to finish at exit."""
    options: str
    archive: Path
    tmp: Optional[Path] = None      # set when this process writes the archive
    lock: Optional[Path] = None

    @property
    def writes(self) -> bool:
        """Whether this process writes the archive (at its JVM's exit)."""
        return self.tmp is not None


def plan(folder: Path, java: Optional[str], jars: Iterable[str]) -> Optional[Plan]:
    """Use the archive for ``java`` + ``jars`` in ``folder`` if there is one, else write it (when no
    other live process is writing it); None when there is no java binary or nothing to do."""
    if java is None:
        return None
    if any(c.isspace() for c in str(folder)):    # Spark's launcher splits Java options at white space
        log.info("class-data archive skipped: its folder %s has white space in its path", folder)
        return None
    jars = list(jars)
    try:
        key = archive_key(java, jars)
        archive = folder / f"{key}.jsa"
        if archive.is_file():
            return Plan(" ".join((f"-XX:SharedArchiveFile={archive}", "-XX:+VerifySharedSpaces", *_COMMON)),
                        archive)
        folder.mkdir(parents=True, exist_ok=True)
        _clean(folder)
        lock = folder / f"{key}.lock"
        if not _take(lock):
            log.info("class-data archive %s is being written by another process: starting without it", archive)
            return None
    except OSError as e:
        log.info("class-data archive skipped: %s", e)
        return None
    tmp = folder / f"{key}.{os.getpid()}.tmp"
    return Plan(" ".join((f"-XX:ArchiveClassesAtExit={tmp}", *_COMMON)), archive, tmp, lock)


def finish(p: Plan, proc, wait: float = EXIT_WAIT_SECONDS) -> bool:
    """After this process's Spark work: close the JVM's standard input (it exits, writing the
    archive), wait for it, and publish the archive if the JVM exited with 0 and wrote it. The lock
    goes either way. True when the archive was published."""
    done = False
    try:
        if proc is not None and proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        rc = proc.wait(timeout=wait) if proc is not None else None
        if rc == 0 and p.tmp.is_file() and p.tmp.stat().st_size > 0:
            os.replace(p.tmp, p.archive)
            done = True
            _prune(p.archive.parent)
            log.info("class-data archive written: %s (%.0f MB)", p.archive, p.archive.stat().st_size / 2**20)
        else:
            log.info("class-data archive not written (JVM exit code %s)", rc)
    except BaseException as e:  # noqa: BLE001 - at exit (Ctrl-C too): never fail the run for a cache
        log.info("class-data archive not written: %r", e)
    finally:
        if p.tmp is not None and not done:
            p.tmp.unlink(missing_ok=True)
        if p.lock is not None:
            _release(p.lock)
    return done


def _prune(folder: Path, keep: int = KEEP) -> None:
    """Keep the ``keep`` newest archives."""
    old = sorted(folder.glob("*.jsa"), key=lambda q: q.stat().st_mtime, reverse=True)[keep:]
    for q in old:
        q.unlink(missing_ok=True)


def finish_at_exit(p: Plan) -> None:
    """Register :func:`finish` for the gateway JVM PySpark launched (``SparkContext._gateway.proc``)."""
    from pyspark import SparkContext
    proc = getattr(SparkContext._gateway, "proc", None)
    if proc is None:
        finish(p, None)
        return

    def at_exit():
        if SparkContext._active_spark_context is not None:
            try:
                SparkContext._active_spark_context.stop()
            except Exception:  # noqa: BLE001 - the JVM may be gone already
                pass
        log.info("writing the class-data archive at the JVM's exit (once per environment, ~15 s)")
        finish(p, proc)

    atexit.register(at_exit)
