"""Kernels reach Spark's Python workers by name, so the workers use numba's disk cache."""
import pickle
import subprocess
import sys

import numba
import numpy as np
from pyspark import cloudpickle

from xmc_spark.kernels import jit, text_parse


def _task():
    kernel = text_parse.parse_lines          # a direct reference, as ingest's tasks held it

    def task():
        return kernel
    return task


def test_a_kernel_in_a_task_unpickles_to_the_modules_cached_dispatcher(tmp_path):
    blob = cloudpickle.dumps(_task())
    assert b"numba" not in blob              # numba's own pickling rebuilds the function by value
    path = tmp_path / "task.pkl"
    path.write_bytes(blob)
    code = ("import pickle, sys; k = pickle.load(open(sys.argv[1], 'rb'))(); "
            "import xmc_spark.kernels.text_parse as t; "
            "print(k is t.parse_lines, type(k._cache).__name__)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    # a fresh interpreter, as a Spark worker: the module's dispatcher, with the disk cache
    assert out.stdout.split() == ["True", "FunctionCache" if jit.CACHE else "NullCache"]


def test_the_unpickled_kernel_computes_the_same():
    k = pickle.loads(cloudpickle.dumps(_task()))()
    line = b"1,2 3:1.5 4:2\n"
    ok, _, lp, lab, fp, fidx, fval = k(np.frombuffer(line, np.uint8), np.array([0, len(line)]),
                                         np.ones(1, np.bool_), 0)
    assert ok.all() and list(lab) == [1, 2] and list(fidx) == [3, 4] and list(fval) == [1.5, 2.0]


def test_other_packages_dispatchers_keep_numbas_pickling():
    foreign = numba.njit(lambda x: x + 1)
    blob = cloudpickle.dumps(foreign)
    assert b"numba" in blob
    assert pickle.loads(blob)(2) == 3


def test_decorator_forms():
    @jit.njit
    def plain(x):
        return x + 1

    @jit.njit(fastmath=False)
    def called(x):
        return x * 2

    assert plain(1) == 2 and called(3) == 6
    # not module attributes: numba's pickling, which still round-trips
    assert pickle.loads(cloudpickle.dumps(called))(4) == 8


def test_a_dispatcher_without_a_module_keeps_numbas_pickling():
    ns = {}
    exec("def f(x):\n    return x + 1", ns)           # no __name__ in its globals: f.__module__ is None
    d = numba.njit(ns["f"])
    assert d.py_func.__module__ is None
    assert pickle.loads(cloudpickle.dumps(d))(1) == 2
