"""PySpark's Python worker daemon for local masters, importing pyspark from its installed package.

Spark puts ``SPARK_HOME/python/lib/pyspark.zip`` and py4j's source zip first on the Python
workers' ``PYTHONPATH``. A pip-installed pyspark is its own ``SPARK_HOME`` and ships those
zips inside the package, without bytecode, and Python never caches bytecode for modules it
imports from a zip. So the daemon, and every worker it forks (a worker imports ``pyspark.worker``
only after the fork, by design: nothing may start threads in the daemon), compiles pyspark's
modules from source again: about a second of every worker's start (:func:`~.session.get_spark`
sets ``spark.python.daemon.module`` to this module for local masters, :func:`~.session.local_conf`).

This module drops such a zip from ``sys.path`` when the same files are importable without it: the
pyspark zip when it lies inside the ``pyspark`` package found on the rest of the path, py4j's when
the ``py4j`` package found there is installed with the zip's version. Then it runs pyspark's own
daemon. It imports only the standard library: no thread may run in the daemon when it forks, and
should anything here fail, the path stays as Spark set it.

It changes one thing in the forked workers: the garbage collection between tasks. A reused worker
runs ``gc.collect()`` after every task, a full pass over every object the worker holds: pyspark,
pandas, pyarrow, scipy, numba and its compiled kernels, 0.1-0.2 M objects and 50-150 ms a task
(on a 200K-sample run, 9.7 s of the workers' CPU, py-spy). :func:`freezing` collects the task's own
garbage and then freezes what survived (``gc.freeze``: the imports, the kernels, the caches), so
the next pass walks only what a task creates; every :data:`FULL_EVERY` tasks a full pass frees
anything frozen that died in a reference cycle since (such an object, e.g. a broadcast value a
later task drops, lives up to that many tasks longer than before).
"""
from __future__ import annotations

import gc
import os
import re
import sys
from importlib.machinery import PathFinder
from typing import Callable, List, Optional, Sequence


def _package_dir(name: str, path: Sequence[str]) -> Optional[str]:
    """The folder of package ``name`` on ``path`` (entries that are not zips), or None."""
    spec = PathFinder.find_spec(name, [p for p in path if not p.endswith(".zip")])
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def _version_beside(package_dir: str, dist: str) -> Optional[str]:
    """The version of distribution ``dist`` whose metadata lies beside ``package_dir`` (the copy
    that is imported), or None."""
    from importlib.metadata import distributions
    for d in distributions(path=[os.path.dirname(package_dir)]):
        if (d.metadata["Name"] or "").lower() == dist:
            return d.version
    return None


def _real(path: str) -> str:
    """``path`` with its folder resolved (a file symlinked into a cache keeps its place)."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def redundant_zips(path: Sequence[str]) -> List[str]:
    """The entries of ``path`` that are pyspark's or py4j's zip while the same files are
    importable from the rest of ``path``."""
    out = []
    pyspark_dir = _package_dir("pyspark", path)
    py4j_version = None
    for p in path:
        base = os.path.basename(p)
        if base == "pyspark.zip":
            if pyspark_dir is not None and _real(p).startswith(pyspark_dir + os.sep):   # the same wheel
                out.append(p)
            continue
        m = re.fullmatch(r"py4j-(.+)-src\.zip", base)
        if m:
            if py4j_version is None:
                py4j_dir = _package_dir("py4j", path)
                py4j_version = (_version_beside(py4j_dir, "py4j") if py4j_dir else None) or ""
            if py4j_version == m.group(1):
                out.append(p)
    return out


FULL_EVERY = 64        # tasks between a worker's full collections (frozen objects included)


def freezing(worker: Callable, full_every: int = FULL_EVERY, reuse: Optional[bool] = None) -> Callable:
    """pyspark.daemon's ``worker(sock, authenticated)`` (one task of a forked worker) followed, when
    the worker goes on to another task (``reuse``: ``SPARK_REUSE_WORKER`` set, as the daemon reads
    it; and the task's code 0), by a collection of the objects not frozen and a ``gc.freeze()`` of
    the survivors; every ``full_every`` tasks the frozen objects are collected too. The daemon's
    own ``gc.collect()`` after the task then has nothing left to walk. A worker about to exit (no
    reuse, a failed task or login) is left as the daemon leaves it."""
    reuse = bool(os.environ.get("SPARK_REUSE_WORKER")) if reuse is None else reuse
    full_every = max(1, int(full_every))
    done = [0]

    def run(*args, **kwargs):
        code = worker(*args, **kwargs)
        if reuse and not code:
            done[0] += 1
            if done[0] % full_every == 0:
                gc.unfreeze()
            gc.collect()
            gc.freeze()
        return code
    return run


def main() -> None:
    try:
        drop = set(redundant_zips(sys.path))
    except Exception:       # noqa: BLE001 - never stop the workers over a speed-up
        drop = set()
    sys.path[:] = [p for p in sys.path if p not in drop]
    from pyspark import daemon
    daemon.worker = freezing(daemon.worker)          # manager() calls it by its module-global name
    daemon.manager()


if __name__ == "__main__":
    main()
