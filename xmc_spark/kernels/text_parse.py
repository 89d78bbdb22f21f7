"""XC / svmlight text lines -> label and feature lists, one pass over the bytes (numba).

A fast path for ingest, not a validator: it parses only the plain forms (labels and feature
indices as unsigned decimal integers of at most 18 digits, values as ``[+-]digits[.digits]
[e[+-]digits]`` with at most 15 significant digits and a decimal exponent within +-22, so that
the double ``m * 10^e`` is correctly rounded, and not exactly halfway between two float32,
where its cast to float32 could round the other way than Java's ``Float.parseFloat``, which
Spark uses) and marks every other line as not parsed. Ingest hands files with such lines to its
Spark SQL checks, which name the problem, so a line parsed here is one those checks accept,
with the same ids and values.

Tokens are split on Java's ``\\s`` (space, \\t, \\n, \\x0b, \\f, \\r), as Spark's
``split(value, '\\\\s+')``. The first token is the label list (comma separated) when the line
does not start with whitespace and the token has no ':'; tokens starting with ``qid:`` are
skipped (svmlight); every other token is ``index:value``.
"""
from __future__ import annotations

import math

import numpy as np

from .jit import njit

POW10 = np.array([10.0 ** i for i in range(23)])     # exact doubles
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@njit
def _space(c) -> bool:
    return c == 32 or (9 <= c <= 13)


@njit
def _uint(buf, a, b) -> int:
    """The unsigned decimal buf[a:b] (1-18 digits), else -1."""
    if b <= a or b - a > 18:
        return -1
    v = 0
    for i in range(a, b):
        c = buf[i]
        if c < 48 or c > 57:
            return -1
        v = v * 10 + (c - 48)
    return v


@njit
def _float(buf, a, b, pow10):
    """(parsed, value) of the plain decimal buf[a:b] as float32 (see the module docstring)."""
    i, neg = a, False
    if i < b and (buf[i] == 43 or buf[i] == 45):
        neg = buf[i] == 45
        i += 1
    m, sig, seen, e = 0, 0, 0, 0
    frac = False
    while i < b:
        c = buf[i]
        if c == 46 and not frac:
            frac = True
            i += 1
            continue
        if c < 48 or c > 57:
            break
        seen += 1
        if m != 0 or c != 48:
            if sig >= 15:
                return False, np.float32(0)
            m = m * 10 + (c - 48)
            sig += 1
        if frac:
            e -= 1
        i += 1
    if seen == 0:
        return False, np.float32(0)
    if i < b and (buf[i] == 101 or buf[i] == 69):
        i += 1
        eneg = False
        if i < b and (buf[i] == 43 or buf[i] == 45):
            eneg = buf[i] == 45
            i += 1
        x, ed = 0, 0
        while i < b and 48 <= buf[i] <= 57:
            if ed >= 4:
                return False, np.float32(0)
            x = x * 10 + (buf[i] - 48)
            ed += 1
            i += 1
        if ed == 0:
            return False, np.float32(0)
        e += -x if eneg else x
    if i != b:
        return False, np.float32(0)
    if m == 0:
        return True, np.float32(-0.0 if neg else 0.0)
    if e < -22 or e > 22:
        return False, np.float32(0)
    v = m * pow10[e] if e >= 0 else m / pow10[-e]
    if v > _FLOAT32_MAX:
        return False, np.float32(0)
    # a double exactly halfway between two float32 (25 significant bits, the last one set) may
    # be a rounded decimal: its second rounding could go the other way than Java's single one
    mant, _ = math.frexp(v)
    x = mant * 33554432.0                  # 2^25
    if x == math.floor(x) and int(x) & 1:
        return False, np.float32(0)
    f = np.float32(-v if neg else v)
    if np.isinf(f):
        return False, np.float32(0)
    return True, f


@njit
def parse_lines(buf, offs, data, one_based):
    """Lines ``buf[offs[k]:offs[k+1]]`` (those with ``data[k]``) -> (parsed, repeated, label
    offsets, labels, feature offsets, feature indices, values). A line not parsed (or not data)
    has no labels and no features; ``repeated`` marks a parsed line listing a feature index twice."""
    n = len(offs) - 1
    cap_l, cap_f = n, 0
    for i in range(offs[0], offs[n]):
        if buf[i] == 44:
            cap_l += 1
        elif buf[i] == 58:
            cap_f += 1
    lab = np.empty(cap_l, np.int64)
    fidx = np.empty(cap_f, np.int64)
    fval = np.empty(cap_f, np.float32)
    lp = np.zeros(n + 1, np.int64)
    fp = np.zeros(n + 1, np.int64)
    parsed = np.zeros(n, np.bool_)
    repeated = np.zeros(n, np.bool_)
    nl, nf = 0, 0
    for k in range(n):
        a, b = offs[k], offs[k + 1]
        if data[k]:
            good, ntok, nl0, nf0, i = True, 0, nl, nf, a
            while good:
                while i < b and _space(buf[i]):
                    i += 1
                if i >= b:
                    break
                t0, colon, ncolon = i, -1, 0
                while i < b and not _space(buf[i]):
                    if buf[i] == 58:
                        ncolon += 1
                        if colon < 0:
                            colon = i
                    i += 1
                ntok += 1
                if ntok == 1 and t0 == a and ncolon == 0:          # the label list
                    s = t0
                    for j in range(t0, i + 1):
                        if j == i or buf[j] == 44:
                            v = _uint(buf, s, j)
                            if v < 0:
                                good = False
                                break
                            lab[nl] = v
                            nl += 1
                            s = j + 1
                elif i - t0 >= 4 and buf[t0] == 113 and buf[t0 + 1] == 105 and buf[t0 + 2] == 100 \
                        and buf[t0 + 3] == 58:                          # qid:...
                    continue
                else:
                    v = _uint(buf, t0, colon) - one_based if ncolon == 1 else -1
                    ok, x = _float(buf, colon + 1, i, POW10)
                    if v < 0 or not ok:
                        good = False
                        break
                    fidx[nf] = v
                    fval[nf] = x
                    nf += 1
            if good and ntok > 0:
                parsed[k] = True
                if nf - nf0 > 1:
                    s_idx = np.sort(fidx[nf0:nf])
                    repeated[k] = np.any(s_idx[1:] == s_idx[:-1])
            else:
                nl, nf = nl0, nf0
        lp[k + 1] = nl
        fp[k + 1] = nf
    return parsed, repeated, lp, lab[:nl], fp, fidx[:nf], fval[:nf]
