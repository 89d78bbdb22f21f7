"""Single-process readers for the XC text format (tests, benchmarks and the reference path).

The Spark ingest stage (``stages/ingest.py``) is the production reader; this one exists so
kernels can be checked against it and benchmarks can feed PECOS the very same matrices.
"""
from __future__ import annotations

from typing import Tuple

import scipy.sparse as sp

from .kernels.sparse import csr_from_lists, l2_normalize_rows


def read_xc(path: str, normalize: bool = True) -> Tuple[sp.csr_matrix, sp.csr_matrix]:
    """(X n x d float32, Y n x L) from an XC-repository text file."""
    with open(path) as f:
        header = f.readline().split()
        n, d, L = (int(v) for v in header)
        lab_ptr, lab_idx, ft_ptr, ft_idx, ft_val = [0], [], [0], [], []
        for line in f:
            toks = line.split()
            if toks and ":" not in toks[0]:
                lab_idx.extend(int(v) for v in toks[0].split(",") if v)
                toks = toks[1:]
            for t in toks:
                a, b = t.split(":")
                ft_idx.append(int(a))
                ft_val.append(float(b))
            lab_ptr.append(len(lab_idx))
            ft_ptr.append(len(ft_idx))
    X = csr_from_lists(ft_ptr, ft_idx, ft_val, d)           # repeated indices summed, as ingest does
    Y = csr_from_lists(lab_ptr, lab_idx, None, L)
    Y.data[:] = 1.0
    return (l2_normalize_rows(X) if normalize else X), Y
