"""numba's ``njit`` with the on-disk cache when the code lives in real files, and pickled by name.

Imported from a zip or wheel (``spark-submit --py-files xmc_spark-*.whl``) numba has nowhere
to write its cache, so functions are compiled per process instead.

numba pickles a dispatcher by value (its Python function, rebuilt into a new dispatcher), and the
copy it rebuilds has no disk cache: a Spark task whose function refers to a kernel directly (not
through its module) made every Python worker compile that kernel again, seconds to tens of
seconds before its first row. So this package's kernels are pickled by reference (module and
name, as pickle does for plain functions): the worker imports the module and gets the cached
dispatcher. Other packages' dispatchers keep numba's own pickling.
"""
from __future__ import annotations

import copyreg
import importlib
import inspect
import os
import sys

import numpy as np
from numba import njit as _njit

CACHE = os.path.isfile(__file__)
# numba wraps a signed index that may be negative (a compare, an add and a select per access);
# kernels index their hot loops with unsigned integers, and u + UONE keeps a uint64 a uint64
# (u + 1 would make it a float64)
UONE = np.uint64(1)
_PACKAGE = __name__.split(".")[0] + "."


def kernel_by_name(module: str, name: str):
    """The dispatcher ``module.name`` (what a pickled kernel of this package unpickles to)."""
    return getattr(importlib.import_module(module), name)


def _reduce(disp):
    try:
        f = disp.py_func
        name = f.__module__ or ""
        mod = sys.modules.get(name)
        if name.startswith(_PACKAGE) and mod is not None and getattr(mod, f.__qualname__, None) is disp:
            return kernel_by_name, (name, f.__qualname__)
    except Exception:  # noqa: BLE001 - anything unusual (another package's dispatcher): numba's own pickling
        pass
    return disp.__reduce__()


def _by_name(disp):
    copyreg.pickle(type(disp), _reduce)     # keyed by type (CPUDispatcher): idempotent
    return disp


def njit(*args, **kwargs):
    kwargs.setdefault("cache", CACHE)
    if args and inspect.isfunction(args[0]):            # @njit
        return _by_name(_njit(*args, **kwargs))
    decorate = _njit(*args, **kwargs)                   # @njit(...)
    return lambda f: _by_name(decorate(f))
