"""PySpark's Python worker daemon for local masters, importing pyspark from its installed package.

Spark puts ``SPARK_HOME/python/lib/pyspark.zip`` and py4j's source zip first on the Python
workers' ``PYTHONPATH``. A pip-installed pyspark is its own ``SPARK_HOME`` and ships those
zips inside the package, without bytecode, and Python never caches bytecode for modules it
imports from a zip. So the daemon, and every worker it forks (a worker imports ``pyspark.worker``
only after the fork, by design: nothing may start threads in the daemon), compiles pyspark's
modules from source again: about a second of every worker's start (:func:`~.session.get_spark`
sets ``spark.python.daemon.module`` to this module for local masters).

This module drops such a zip from ``sys.path`` when the same files are importable without it: the
pyspark zip when it lies inside the ``pyspark`` package found on the rest of the path, py4j's when
the installed ``py4j`` has the zip's version. Then it runs pyspark's own daemon unchanged. It
imports nothing else: no thread may run in the daemon when it forks.
"""
from __future__ import annotations

import os
import re
import sys
from importlib.machinery import PathFinder
from typing import List, Sequence


def _package_dir(name: str, path: Sequence[str]):
    """The folder of package ``name`` on ``path`` (entries that are not zips), or None."""
    spec = PathFinder.find_spec(name, [p for p in path if not p.endswith(".zip")])
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def _installed_version(dist: str):
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:           # no metadata: keep the zip
        return None


def redundant_zips(path: Sequence[str]) -> List[str]:
    """The entries of ``path`` that are pyspark's or py4j's zip while the same files are
    importable from the rest of ``path``."""
    out = []
    pyspark_dir = _package_dir("pyspark", path)
    for p in path:
        base = os.path.basename(p)
        if base == "pyspark.zip" and pyspark_dir is not None:
            if os.path.realpath(p).startswith(pyspark_dir + os.sep):       # inside the package: the same wheel
                out.append(p)
        else:
            m = re.fullmatch(r"py4j-(.+)-src\.zip", base)
            if m and _package_dir("py4j", path) is not None and _installed_version("py4j") == m.group(1):
                out.append(p)
    return out


def main() -> None:
    drop = set(redundant_zips(sys.path))
    sys.path[:] = [p for p in sys.path if p not in drop]
    from pyspark import daemon
    daemon.manager()


if __name__ == "__main__":
    main()
