"""numba's ``njit`` with the on-disk cache when the code lives in real files.

Imported from a zip or wheel (``spark-submit --py-files xmc_spark-*.whl``) numba has nowhere
to write its cache, so functions are compiled per process instead.
"""
from __future__ import annotations

import os

from numba import njit as _njit

CACHE = os.path.isfile(__file__)


def njit(*args, **kwargs):
    kwargs.setdefault("cache", CACHE)
    return _njit(*args, **kwargs)
