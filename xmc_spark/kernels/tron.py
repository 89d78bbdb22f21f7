"""Trust-region Newton (TRON) for many L2-regularized squared-hinge classifiers at once.

Each classifier k solves the per-node kernel's problem (:func:`.squared_hinge.train_node`)
in the primal::

    f_k(w) = 0.5 ||w||^2 + sum_i C_ik max(0, 1 - y_ik w^T x_i)^2
    C_ik   = C * weight_i * (label weight of i for k if i is a positive of k, else 1)

over the rows x_i of its node (the bias is an appended feature, regularized like the rest).
With the active set I = {i : 1 - y_ik w^T x_i > 0} (Lin, Weng and Keerthi 2008; LIBLINEAR's
``L2R_L2LOSS_SVC`` primal solver)::

    grad f_k(w)     = w + 2 X_I^T (C_I (X_I w - y_I))
    H_k(w) v        = v + 2 X_I^T (C_I (X_I v))          (generalized Hessian)

:func:`tron_space` is the driver loop, vectorized across the K classifiers (W is d x K): every
classifier keeps its own iterate, trust region and conjugate-gradient state, and each data pass
gives every classifier still running its next operation (a Hessian-vector product inside its CG,
the gradient at its trial point once the CG ended), so one pass serves all of them and none
waits for the others. The oracle is two callables,

- ``fun_grad(W, cols) -> (f, G)``: objective (len(cols),) and gradient (d x len(cols)) of the
  classifiers ``cols`` at W (d x len(cols)); ``fun_grad(W, cols, True)`` also returns the loss
  part of the Hessian's diagonal (the optional preconditioner's);
- ``hess_vec(W, V, cols) -> HV``: generalized Hessian at W times V for those classifiers,

so the same loop runs with a local oracle (:func:`local_oracle`, the tests) and with the Spark
one of :mod:`..stages.node_training`, which sums the per-partition partial sums of
:func:`partial_fun_grad` / :func:`partial_hess_vec` over the partitions holding the rows. The
loop reaches its vectors only through a vector space (:class:`NumpySpace`: the oracle and the
vectors in memory, what :func:`tron` uses), so a space that keeps them elsewhere
(:class:`..stages.shared_vectors.SharedSpace`) runs the same loop with only per-classifier
scalars coming back.

The partial sums are one numba loop (:func:`_pass_rows`): one pass over a node's rows computes
x W (and x V), the active set and the scatter x^T coef, for the gradient's classifiers and the
Hessian products' at once, with no n x K temporaries and no copy of the rows, so a task's
memory is its rows plus d x K.

Rows of several nodes are mixed: each row belongs to one node (``RowBlock.node``) and only
that node's classifiers (columns ``node_ptr[j]:node_ptr[j + 1]``) see it. The partial sums
hold the loss part only; :func:`regularized` adds 0.5 ||w||^2 and w (once, on the driver).

Stopping, per classifier: ||grad f_k(w)|| <= eps_k ||grad f_k(0)|| (eps_k as LIBLINEAR scales
it, :func:`liblinear_eps`, or one eps for all) or ``max_iter`` trust-region
steps (accepted or not, so the number of oracle calls is bounded), or the degenerate cases
LIBLINEAR stops on (no predicted reduction, reductions below 1e-12 |f|).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Sequence, Tuple

import numpy as np
import scipy.sparse as sp

from .jit import njit

# trust-region constants (Lin and More 1999, as LIBLINEAR's tron.cpp)
ETA0, ETA1, ETA2 = 1e-4, 0.25, 0.75
SIGMA1, SIGMA2, SIGMA3 = 0.25, 0.5, 4.0

FunGrad = Callable[[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]
HessVec = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass
class RowBlock:
    """Training rows of one or more nodes.

    ``X`` (n x d CSR, bias column included), ``node`` (n,) the node index of each row (into the
    caller's ``node_ptr``), ``cost`` (n,) C * sample weight, ``pos`` (n x K CSR) the positives:
    entry (i, k) present when row i is a positive of classifier k, its value the positive's
    label weight (cost multiplier). Classifier k must belong to the node of row i.
    """

    X: sp.csr_matrix
    node: np.ndarray
    cost: np.ndarray
    pos: sp.csr_matrix

    def __post_init__(self):
        n = self.X.shape[0]
        if not (len(self.node) == len(self.cost) == self.pos.shape[0] == n):
            raise ValueError(f"RowBlock: X has {n} rows, node {len(self.node)}, cost {len(self.cost)}, "
                             f"pos {self.pos.shape[0]}")


def _node_parts(rows: RowBlock, node_ptr: np.ndarray, cf: np.ndarray, ch: np.ndarray):
    """For every node with rows and a requested classifier (of either request): (row ids, the
    node's global classifier ids in ``cf`` and their positions there, the same for ``ch``)."""
    node_ptr = np.asarray(node_ptr, np.int64)
    cf, ch = np.asarray(cf, np.int64), np.asarray(ch, np.int64)
    nf, nh = np.searchsorted(node_ptr, cf, side="right") - 1, np.searchsorted(node_ptr, ch, side="right") - 1
    order = np.argsort(rows.node, kind="stable")
    nodes_sorted = np.asarray(rows.node)[order]
    for j in np.unique(np.concatenate([nf, nh])):
        lo, hi = np.searchsorted(nodes_sorted, [j, j + 1])
        if hi == lo:
            continue
        pf, ph = np.flatnonzero(nf == j), np.flatnonzero(nh == j)
        yield order[lo:hi], cf[pf], pf, ch[ph], ph


@njit()
def _row_labels(i, pos_ptr, pos_idx, pos_val, slot, cost_i, y, cm):
    """Row i's signs and costs for the requested classifiers (``slot[k]`` = position in the
    request or -1): -1 and C_i everywhere, +1 and C_i x label weight at its positives."""
    y[:] = -1.0
    cm[:] = cost_i
    for jj in range(pos_ptr[i], pos_ptr[i + 1]):
        q = slot[pos_idx[jj]]
        if q >= 0:
            y[q] = 1.0
            cm[q] = cost_i * max(float(pos_val[jj]), 1e-12)       # as train_node


@njit()
def _pass_rows(rows, x_ptr, x_idx, x_val, cost, pos_ptr, pos_idx, pos_val, slot_f, W, loss, G, Dg, diag,
               slot_h, Wh, Vh, HV):
    """One pass over ``rows`` for two sets of classifiers (either may be empty):

    - the first (``slot_f``, W: d x kf): z = x W, the squared-hinge loss and 2 C (z - y) on the
      active set, scattered back as x^T coef; ``loss`` and ``G`` (d x kf) are added to in place,
      and with ``diag`` the loss part of the Hessian's diagonal, sum over the active set of
      2 C x_j^2, to ``Dg`` (d x kf);
    - the second (``slot_h``, Wh, Vh: d x kh): z = x Wh and u = x Vh, then x^T (D u) with D = 2 C
      on the active set (y z < 1), added to ``HV`` (d x kh) in place.

    Each row's features are read once for both (the out-of-step loop's pass)."""
    kf, kh = W.shape[1], Wh.shape[1]
    z, y, cm, h = np.empty(kf), np.empty(kf), np.empty(kf), np.empty(kf)
    zh, u, yh, cmh = np.empty(kh), np.empty(kh), np.empty(kh), np.empty(kh)
    for i in rows:
        z[:] = 0.0
        zh[:] = 0.0
        u[:] = 0.0
        lo, hi = np.uint64(x_ptr[i]), np.uint64(x_ptr[i + 1])     # unsigned positions: no negative-index
        for jj in range(lo, hi):                                  # fix-ups in the loops (same sums)
            f, v = np.uint64(x_idx[jj]), x_val[jj]
            for q in range(kf):
                z[q] += v * W[f, q]
            for q in range(kh):
                zh[q] += v * Wh[f, q]
                u[q] += v * Vh[f, q]
        if kf:
            _row_labels(i, pos_ptr, pos_idx, pos_val, slot_f, cost[i], y, cm)
            for q in range(kf):
                m = 1.0 - y[q] * z[q]
                if m > 0.0:
                    loss[q] += cm[q] * m * m
                    z[q] = 2.0 * cm[q] * (z[q] - y[q])
                    h[q] = 2.0 * cm[q]
                else:
                    z[q] = 0.0
                    h[q] = 0.0
        if kh:
            _row_labels(i, pos_ptr, pos_idx, pos_val, slot_h, cost[i], yh, cmh)
            for q in range(kh):
                u[q] = 2.0 * cmh[q] * u[q] if yh[q] * zh[q] < 1.0 else 0.0
        for jj in range(lo, hi):
            f, v = np.uint64(x_idx[jj]), x_val[jj]
            for q in range(kf):
                G[f, q] += v * z[q]
            if diag:
                vv = np.float64(v) * np.float64(v)
                for q in range(kf):
                    Dg[f, q] += vv * h[q]
            for q in range(kh):
                HV[f, q] += v * u[q]


def _slot(rows: RowBlock, c: np.ndarray) -> np.ndarray:
    """classifier -> position in the request ``c`` (-1: not requested)."""
    slot = np.full(rows.pos.shape[1], -1, np.int64)
    slot[c] = np.arange(len(c))
    return slot


def partial_pass(rows: RowBlock, node_ptr, W: np.ndarray, cf, Wh: np.ndarray, Vh: np.ndarray, ch,
                 out_f=None, out_h=None, diag: bool = False) -> Tuple:
    """Both partial sums below in one pass over ``rows``: :func:`partial_fun_grad` of the
    classifiers ``cf`` at W and :func:`partial_hess_vec` of ``ch`` at Wh times Vh (disjoint, or
    either empty); returns (its ``out_f``, its ``out_h``), allocated when not given."""
    cf, ch = np.asarray(cf, np.int64), np.asarray(ch, np.int64)
    X, P, d = rows.X, rows.pos, rows.X.shape[1]
    if out_f is None:
        out_f = (np.zeros(len(cf)), np.zeros((d, len(cf)))) + ((np.zeros((d, len(cf))),) if diag else ())
    if out_h is None:
        out_h = np.zeros((d, len(ch)))
    for r, c, p, c2, p2 in _node_parts(rows, node_ptr, cf, ch):
        lp, Gp, Hp = np.zeros(len(p)), np.zeros((d, len(p))), np.zeros((d, len(p2)))
        Dp = np.zeros((d, len(p)) if diag else (1, 1))
        _pass_rows(np.asarray(r, np.int64), X.indptr, X.indices, X.data, np.asarray(rows.cost, np.float64),
                   P.indptr, P.indices, P.data, _slot(rows, c), np.ascontiguousarray(W[:, p], np.float64),
                   lp, Gp, Dp, diag, _slot(rows, c2), np.ascontiguousarray(Wh[:, p2], np.float64),
                   np.ascontiguousarray(Vh[:, p2], np.float64), Hp)
        if len(p):
            out_f[0][p] += lp
            out_f[1][:, p] += Gp
            if diag:
                out_f[2][:, p] += Dp
        if len(p2):
            out_h[:, p2] += Hp
    return out_f, out_h


def partial_fun_grad(rows: RowBlock, node_ptr, W: np.ndarray, cols, out=None, diag: bool = False) -> Tuple:
    """Loss part of f and of its gradient over ``rows`` for classifiers ``cols`` at W (d x len(cols)):
    (sum_i C_ik max(0, 1 - y_ik z_ik)^2 per classifier, 2 X_I^T (C_I (z_I - y_I))), and with
    ``diag`` a third part, the loss part of the generalized Hessian's diagonal, sum_{i in I}
    2 C_ik x_ij^2 (d x len(cols)): what the diagonal preconditioner needs.

    ``out`` = (loss, G) or (loss, G, diag part), when given, is added to in place (only the
    columns of the nodes with rows here are touched) and returned: a caller summing many row
    blocks of few nodes each pays for those nodes' columns, not for a d x len(cols) matrix per
    block."""
    d = rows.X.shape[1]
    none = np.zeros((d, 0))
    return partial_pass(rows, node_ptr, W, cols, none, none, [], out_f=out, diag=diag)[0]


def partial_hess_vec(rows: RowBlock, node_ptr, W: np.ndarray, V: np.ndarray, cols, out=None) -> np.ndarray:
    """Loss part of the generalized Hessian at W times V over ``rows``: 2 X_I^T (C_I (X_I V));
    added to ``out`` (d x len(cols)) in place when given, as :func:`partial_fun_grad`."""
    d = rows.X.shape[1]
    return partial_pass(rows, node_ptr, np.zeros((d, 0)), [], W, V, cols, out_h=out)[1]


def regularized(loss: np.ndarray, G: np.ndarray, W: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Add the regularizer to summed loss parts: (loss + 0.5 ||w_k||^2, G + W)."""
    return loss + 0.5 * np.einsum("ij,ij->j", W, W), G + W


def local_oracle(rows: RowBlock, node_ptr) -> Tuple[FunGrad, HessVec]:
    """(fun_grad, hess_vec) over rows held in memory."""
    def fun_grad(W, cols, diag=False):
        parts = partial_fun_grad(rows, node_ptr, W, cols, diag=diag)
        return regularized(*parts[:2], W) + parts[2:]

    def hess_vec(W, V, cols):
        return V + partial_hess_vec(rows, node_ptr, W, V, cols)

    return fun_grad, hess_vec


def node_rows(X: sp.csr_matrix, Y: sp.csr_matrix, C: float = 1.0, weights=None) -> RowBlock:
    """One node's problem as a RowBlock: X (bias included), Y (n x K, non-zero = positive, value
    the label weight) and the per-sample weights, as :func:`.squared_hinge.train_node` takes them."""
    X = sp.csr_matrix(X)
    n = X.shape[0]
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    return RowBlock(X, np.zeros(n, np.int64), float(C) * w, sp.csr_matrix(Y))


def liblinear_eps(eps: float, positives, rows) -> np.ndarray:
    """Per-classifier tolerance as LIBLINEAR's primal solver sets it:
    eps * max(min(#positives, #negatives), 1) / #rows.

    ||grad f(0)|| is dominated by the larger class, so an unscaled relative test stops a
    classifier with few positives (most classifiers at the leaves) long before its optimum (on
    bibtex leaves, objectives several times the optimum at eps = 0.01); the scaling makes the
    test relative to the smaller class.
    """
    positives = np.asarray(positives, np.float64)
    rows = np.maximum(np.asarray(rows, np.float64), 1.0)
    return float(eps) * np.maximum(np.minimum(positives, rows - positives), 1.0) / rows


def _divide(a, b):
    """a / b, 0 where b = 0 (a vector never written: a term with coefficient 0 reads it)."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape), where=b != 0)


_OPS = (("/", _divide), ("*", np.multiply))


def components(name: str) -> list:
    """The plain vector names a space name reads: [A, B] for ``"A/B"`` or ``"A*B"``, else [name]."""
    for op, _ in _OPS:
        if op in name:
            return name.split(op)
    return [name]


def elementwise(name: str, get: Callable[[str], np.ndarray]) -> np.ndarray:
    """The value of a vector name of a space: ``get(name)``, or for ``"A/B"`` / ``"A*B"``
    get(A) divided (0 where get(B) is 0) / multiplied elementwise by get(B)."""
    for op, f in _OPS:
        if op in name:
            a, b = name.split(op)
            return f(get(a), get(b))
    return get(name)


def _col_dot(A, B):
    return np.einsum("ij,ij->j", A, B)


Terms = Sequence[Tuple[object, str]]


class NumpySpace:
    """The d x K vectors TRON works on (named: W, G, S, R, D, HD, Gn; M, Mn), held in memory,
    with the oracle ``fun_grad(W, cols) -> (f, G)`` / ``hess_vec(W, V, cols) -> HV`` of the module
    docstring. :func:`tron_space` talks to its vectors only through the methods below, so a
    space whose vectors live elsewhere (:class:`..stages.shared_vectors.SharedSpace`: files on
    storage every Spark task sees) runs the same loop with only scalars reaching the caller.

    Every method acts on the classifiers ``cols``; a vector never written is zero. ``terms`` are
    [(coefficient, name)], a coefficient a scalar or one value per entry of ``cols``; ``dots`` are
    [(name, name)] pairs whose column-wise inner products are returned (one row per pair) *after*
    the call's writes. A name in a term or a dot may be ``"A/B"`` or ``"A*B"``: vector A divided
    or multiplied elementwise by vector B (the diagonal preconditioner's M^-1 r and s^T M s)."""

    def __init__(self, fun_grad: FunGrad, hess_vec: HessVec, d: int, K: int, mixed=None):
        self._fg, self._hv, self.d, self.K, self._mixed = fun_grad, hess_vec, d, K, mixed
        self.v: dict = {}

    def _get(self, name: str, cols) -> np.ndarray:
        return elementwise(name, lambda n: self.v[n][:, cols] if n in self.v else np.zeros((self.d, len(cols))))

    def _eval(self, terms: Terms, cols) -> np.ndarray:
        out = np.zeros((self.d, len(cols)))
        for coef, name in terms:
            out += np.asarray(coef, np.float64) * self._get(name, cols)
        return out

    def _set(self, name: str, cols, value: np.ndarray) -> None:
        self.v.setdefault(name, np.zeros((self.d, self.K)))[:, cols] = value

    def _dots(self, dots, cols) -> np.ndarray:
        out = [_col_dot(self._get(a, cols), self._get(b, cols)) for a, b in dots]
        return np.array(out).reshape(len(dots), len(cols))

    def fun_grad(self, w: Terms, out: str, cols, dots=(), precond=None) -> Tuple[np.ndarray, np.ndarray]:
        """(f at w = sum of ``w``'s terms, dots); ``out`` := the gradient there. ``precond`` =
        (name, a): also name := 1 + a x (loss part of the Hessian's diagonal) there, i.e.
        (1 - a) I + a diag(H) (LIBLINEAR's diagonal preconditioner)."""
        if precond is None:
            f, G = self._fg(self._eval(w, cols), cols)
        else:
            f, G, L = self._fg(self._eval(w, cols), cols, True)
            self._set(precond[0], cols, 1.0 + precond[1] * L)
        self._set(out, cols, G)
        return np.asarray(f, np.float64), self._dots(dots, cols)

    def hess_vec(self, w: str, v: str, out: str, cols, dots=()) -> np.ndarray:
        """``out`` := H(w) v; returns the dots."""
        self._set(out, cols, self._hv(self._get(w, cols), self._get(v, cols), cols))
        return self._dots(dots, cols)

    def step(self, hv, fg):
        """One data pass for two sets of classifiers: ``hv`` = (w, v, out, cols, dots) as
        :meth:`hess_vec`, ``fg`` = (w, out, cols, dots, precond) as :meth:`fun_grad`, either None;
        returns (hv's dots, fg's (f, dots)). With the ``mixed`` oracle, ``mixed(W_fg, cols_fg,
        diag, W_hv, V_hv, cols_hv) -> ((f, G[, L]), HV)``, both are one call (one Spark query)."""
        if hv is None or fg is None or self._mixed is None:
            return (None if hv is None else self.hess_vec(*hv[:4], dots=hv[4]),
                    None if fg is None else self.fun_grad(*fg[:3], dots=fg[3], precond=fg[4]))
        (w, v, out, hc, hd), (wt, fout, fc, fd, pre) = hv, fg
        fgr, HV = self._mixed(self._eval(wt, fc), fc, pre is not None, self._get(w, hc), self._get(v, hc), hc)
        if pre is not None:
            self._set(pre[0], fc, 1.0 + pre[1] * fgr[2])
        self._set(fout, fc, fgr[1])
        self._set(out, hc, HV)
        return self._dots(hd, hc), (np.asarray(fgr[0], np.float64), self._dots(fd, fc))

    def combine(self, updates: Dict[str, Terms], cols, dots=()) -> np.ndarray:
        """Every ``out: terms`` of ``updates`` at once (all terms read before any write)."""
        new = {name: self._eval(terms, cols) for name, terms in updates.items()}
        for name, value in new.items():
            self._set(name, cols, value)
        return self._dots(dots, cols)

    def result(self) -> np.ndarray:
        return self._get("W", np.arange(self.K))


def _boundary_step(sd, ss, dd, delta):
    """tau >= 0 with ||s + tau d|| = delta, from s.d, s.s, d.d (LIBLINEAR's trcg)."""
    dsq = delta ** 2
    rad = np.sqrt(sd * sd + dd * np.maximum(dsq - ss, 0.0))
    return np.where(sd >= 0, (dsq - ss) / np.where(sd + rad > 0, sd + rad, 1.0), (rad - sd) / np.where(dd > 0, dd, 1.0))


def _mi(pc: bool):
    return (lambda a: f"{a}/M") if pc else (lambda a: a)         # M^-1 a


def _cg_dots(pc: bool):
    """The inner products one CG step needs, returned with its Hessian-vector product."""
    mi, mm = _mi(pc), ((lambda a: f"{a}*M") if pc else (lambda a: a))
    return [("D", "HD"), ("S", mm("S")), ("S", mm("D")), ("D", mm("D")), ("R", mi("HD")), ("HD", mi("HD")),
            ("R", mi("R"))]


def _fg_dots(pc: bool):
    """The inner products the trust-region update needs, returned with the gradient at w + s."""
    return [("G", "S"), ("S", "R"), ("S", "S*M" if pc else "S"), ("Gn", "Gn")] + ([("Gn", "Gn/Mn")] if pc else [])


def _cg_step(dots, delta, cgtol, n, max_cg_iter, pc: bool):
    """One (preconditioned) Steihaug CG step of some classifiers from the inner products of
    :func:`_cg_dots`: (updates of S, R, D, reached the boundary, keep going).

    The update asks for no inner product: ||s + alpha d||_M^2 and the new r^T M^-1 r come from
    those the product returns (s.s + 2 alpha s.d + alpha^2 d.d, and r.r - 2 alpha r.Hd + alpha^2
    Hd.Hd, M-weighted), so that r, s and d are updated in one pass, which a space may defer into
    its next call (:class:`..stages.shared_vectors.SharedSpace` does). The exact r^T M^-1 r,
    returned with the next product, is the one alpha uses; the expansion decides only the stop
    and beta."""
    dhd, ss, sd, dd, rhd, hh, r0 = dots
    alpha = r0 / dhd
    out = np.sqrt(np.maximum(ss + 2 * alpha * sd + alpha * alpha * dd, 0.0)) > delta
    a = np.where(out, _boundary_step(sd, ss, dd, delta), alpha)
    rnew = np.maximum(r0 - 2 * a * rhd + a * a * hh, 0.0)
    beta = np.where(out, 0.0, rnew / r0)
    mi = _mi(pc)
    upd = {"S": [(1.0, "S"), (a, "D")], "R": [(1.0, "R"), (-a, "HD")],
           "D": [(1.0, mi("R")), (-a, mi("HD")), (beta, "D")]}
    return upd, out, ~out & (np.sqrt(rnew) > cgtol) & (n < max_cg_iter)


def _restart(acc, pc: bool):
    """The updates that end a trust-region step and start the next CG: w += s where accepted (g,
    M := those at w + s), then s = 0, r = -g, d = -M^-1 g (all terms read before any write)."""
    acc = np.asarray(acc, np.float64)
    new = {"W": [(1.0, "W"), (acc, "S")], "G": [(1.0 - acc, "G"), (acc, "Gn")], "S": [],
           "R": [(acc - 1.0, "G"), (-acc, "Gn")]}
    if pc:
        new |= {"M": [(1.0 - acc, "M"), (acc, "Mn")], "D": [(acc - 1.0, "G/M"), (-acc, "Gn/Mn")]}
    else:
        new["D"] = [(acc - 1.0, "G"), (-acc, "Gn")]
    return new


def _merge(parts):
    """One combination over the disjoint classifier sets of ``parts`` = [(cols, updates)]: a
    vector one part does not update keeps its value on that part's classifiers."""
    cols = np.concatenate([c for c, _ in parts])
    names = sorted({n for _, u in parts for n in u})
    off = np.cumsum([0] + [len(c) for c, _ in parts])
    out = {}
    for name in names:
        coefs: Dict[str, np.ndarray] = {}
        for (_, upd), lo, hi in zip(parts, off[:-1], off[1:]):
            for coef, v in upd.get(name, [(1.0, name)]):
                coefs.setdefault(v, np.zeros(len(cols)))[lo:hi] += coef
        out[name] = [(coef, v) for v, coef in coefs.items() if np.any(coef != 0)]   # unread: maybe never written
    return out, cols


def _trcg(space, c, rtr, delta, eps_cg, max_cg_iter, pc: bool = False):
    """Steihaug CG alone on the classifiers ``c`` (``rtr`` = g^T M^-1 g; M = I without ``pc``):
    leaves S ~ argmin_s g^T s + 0.5 s^T H s with ||s||_M <= delta and R = -G - H S in the space;
    returns (reached boundary, CG steps). :func:`tron_space` interleaves the same steps with other
    classifiers' gradients."""
    space.combine(*_merge([(c, _restart(np.zeros(len(c)), pc))]))
    cgtol = eps_cg * np.sqrt(rtr)
    boundary, steps = np.zeros(len(c), bool), np.zeros(len(c), np.int64)
    run = np.sqrt(rtr) > cgtol
    while run.any():
        loc = np.flatnonzero(run)
        dots, _ = space.step(("W", "D", "HD", c[loc], _cg_dots(pc)), None)
        steps[loc] += 1
        upd, out, run[loc] = _cg_step(dots, delta[loc], cgtol[loc], steps[loc], max_cg_iter, pc)
        boundary[loc[out]] = True
        space.combine(upd, c[loc])
    return boundary, steps


@dataclass
class TronInfo:
    """Per classifier: trust-region steps taken, CG steps, final f and ||grad||, ||grad at 0||;
    the tolerance; the number of oracle calls (fun_grad, hess_vec) the whole run made and of data
    passes (a pass serves one call of each kind)."""

    steps: np.ndarray
    cg_steps: np.ndarray
    f: np.ndarray
    gnorm: np.ndarray
    gnorm0: np.ndarray
    eps: np.ndarray
    fun_grad_calls: int = 0
    hess_vec_calls: int = 0
    passes: int = 0

    @property
    def converged(self) -> np.ndarray:
        """Classifiers that met the gradient test (the others stopped on max_iter or a degenerate step)."""
        return self.gnorm <= self.gnorm0 * self.eps


def tron(fun_grad: FunGrad, hess_vec: HessVec, d: int, K: int, eps=0.01, max_iter: int = 50,
         eps_cg: float = 0.1, max_cg_iter: int | None = None, log=None,
         pcg: float = 0.0, mixed=None) -> Tuple[np.ndarray, TronInfo]:
    """Minimize K independent objectives from w = 0 (see the module docstring); W is d x K.
    :func:`tron_space` on a :class:`NumpySpace` over the oracle (``mixed``: see there); returns (W, info)."""
    space = NumpySpace(fun_grad, hess_vec, d, K, mixed)
    info = tron_space(space, d, K, eps, max_iter, eps_cg, max_cg_iter, log, pcg)
    return space.result(), info


def tron_space(space, d: int, K: int, eps=0.01, max_iter: int = 50, eps_cg: float = 0.1,
               max_cg_iter: int | None = None, log=None, pcg: float = 0.0) -> TronInfo:
    """The trust-region loop over a vector space (:class:`NumpySpace` or one of the same
    methods); the solution is the space's ``W``.

    Every classifier runs LIBLINEAR's TRON on its own (its own iterate, trust region, CG state),
    and the classifiers are not kept in step: each data pass (one ``space.step``) serves every
    classifier still running with its next operation, a Hessian-vector product for those inside
    their CG, the gradient at w + s for those whose CG has ended. So the passes number about the
    largest classifier's own count of CG steps plus trust-region steps, not the sum over rounds
    of the slowest classifier's CG steps; each classifier's iterates are those of the plain loop.

    ``eps``: one tolerance or one per classifier (:func:`liblinear_eps` scales it as LIBLINEAR).
    ``max_cg_iter`` bounds the CG steps of one trust-region step (default max(d, 5), as
    LIBLINEAR). ``log(msg)``, when given, receives one line per pass that ends trust-region steps.
    ``pcg`` = a in (0, 1]: preconditioned CG with M = (1 - a) I + a diag(H(w)) (the trust-region
    PCG of LIBLINEAR 2.20-2.30, which uses a = 0.01; Hsia, Chiang and Lin 2018; later versions
    replaced TRON by a line-search Newton), M recomputed at every
    accepted iterate by the same data pass as the gradient, the trust region in the M-norm
    (delta_0 = sqrt(g^T M g), as LIBLINEAR); 0 = plain CG. The stopping test is ||grad|| either way.
    """
    eps = np.broadcast_to(np.asarray(eps, np.float64), (K,))
    if np.any(~(eps > 0)) or max_iter < 1 or not 0.0 <= pcg <= 1.0:
        raise ValueError(f"tron: eps must be > 0, max_iter >= 1 and 0 <= pcg <= 1 (got eps min "
                         f"{eps.min(initial=1)}, max_iter {max_iter}, pcg {pcg})")
    max_cg_iter = max(d, 5) if max_cg_iter is None else int(max_cg_iter)
    pc = pcg > 0
    allc = np.arange(K)
    f, dts = space.fun_grad([], "G", allc, dots=[("G", "G")] + ([("G", "G*M"), ("G", "G/M")] if pc else []),
                            precond=("M", pcg) if pc else None)          # at w = 0
    f = np.array(f, np.float64)
    calls = {"fg": 1, "hv": 0, "passes": 1}
    gnorm0 = np.sqrt(dts[0])
    gnorm = gnorm0.copy()
    delta = np.sqrt(dts[1]) if pc else gnorm0.copy()
    zr = (dts[2] if pc else dts[0]).copy()            # g^T M^-1 g: CG's first r^T z
    adjusted = np.zeros(K, bool)
    steps = np.zeros(K, np.int64)
    cg_steps = np.zeros(K, np.int64)
    live = gnorm0 > 0
    cg_n = np.zeros(K, np.int64)                      # CG steps of the current trust-region step
    cgtol = np.zeros(K)
    boundary = np.zeros(K, bool)
    in_cg = np.zeros(K, bool)                         # inside CG: a Hessian-vector product next
    to_eval = np.zeros(K, bool)                       # CG ended: the gradient at w + s next

    def begin(c):
        cgtol[c] = eps_cg * np.sqrt(zr[c])
        cg_n[c] = 0
        boundary[c] = False
        in_cg[c] = np.sqrt(zr[c]) > cgtol[c]
        to_eval[c] = ~in_cg[c]

    c = np.flatnonzero(live)
    space.combine(*_merge([(c, _restart(np.zeros(len(c)), pc))]))
    begin(c)
    while live.any():
        H, E = np.flatnonzero(in_cg), np.flatnonzero(to_eval)
        hv, fg = space.step(("W", "D", "HD", H, _cg_dots(pc)) if len(H) else None,
                            ([(1.0, "W"), (1.0, "S")], "Gn", E, _fg_dots(pc), ("Mn", pcg) if pc else None)
                            if len(E) else None)
        calls["passes"] += 1
        parts = []
        if len(H):
            calls["hv"] += 1
            cg_n[H] += 1
            cg_steps[H] += 1
            upd, out, run = _cg_step(hv, delta[H], cgtol[H], cg_n[H], max_cg_iter, pc)
            boundary[H[out]] = True
            in_cg[H] = run
            to_eval[H[~run]] = True                   # after this combination: s and r are final
            parts.append((H, upd))
        if len(E):
            calls["fg"] += 1
            fn, (gs, sr, ss, gn2, *zn) = fg
            fc = f[E]
            prered = -0.5 * (gs - sr)
            actred = fc - fn
            snorm = np.sqrt(ss)
            dl = delta[E]
            dl = np.where(~adjusted[E], np.minimum(dl, snorm), dl)
            adjusted[E] = True
            curv = fn - fc - gs
            alpha = np.where(curv <= 0, SIGMA3, np.maximum(SIGMA1, -0.5 * gs / np.where(curv > 0, curv, 1.0)))
            delta[E] = np.select(
                [actred < ETA0 * prered, actred < ETA1 * prered, actred < ETA2 * prered, boundary[E]],
                [np.minimum(alpha * snorm, SIGMA2 * dl),
                 np.maximum(SIGMA1 * dl, np.minimum(alpha * snorm, SIGMA2 * dl)),
                 np.maximum(SIGMA1 * dl, np.minimum(alpha * snorm, SIGMA3 * dl)),
                 SIGMA3 * dl],
                np.maximum(dl, np.minimum(alpha * snorm, SIGMA3 * dl)))
            acc = actred > ETA0 * prered
            ca = E[acc]
            f[ca] = fn[acc]
            gnorm[ca] = np.sqrt(gn2[acc])
            zr[ca] = (zn[0] if pc else gn2)[acc]
            steps[E] += 1
            tiny = (np.abs(actred) <= 1e-12 * np.abs(f[E])) & (np.abs(prered) <= 1e-12 * np.abs(f[E]))
            done = (gnorm[E] <= eps[E] * gnorm0[E]) | (steps[E] >= max_iter) | (prered <= 0) | tiny
            live[E[done]] = False
            to_eval[E] = False
            parts.append((E, _restart(acc, pc)))
            begin(E[~done])
            if log is not None:
                log(f"tron pass {calls['passes']}: {len(E)} trust-region steps ended ({int(acc.sum())} accepted), "
                    f"{len(H)} CG steps, {int(live.sum())} classifiers still running, "
                    f"max |g|/|g0| {float(np.max(gnorm[E] / gnorm0[E])):.2e}")
        space.combine(*_merge(parts))
    return TronInfo(steps, cg_steps, f, gnorm, gnorm0, eps, calls["fg"], calls["hv"], calls["passes"])


def prune(W: np.ndarray, threshold: float) -> sp.csc_matrix:
    """Weights with |w| < threshold dropped (all zeros dropped at threshold 0), float32 values,
    as :func:`.squared_hinge.train_node` returns them."""
    keep = np.abs(W) >= threshold if threshold > 0 else W != 0
    M = sp.csc_matrix(np.where(keep, W, 0.0))
    M.eliminate_zeros()
    return sp.csc_matrix((M.data.astype(np.float32), M.indices.astype(np.int32), M.indptr), shape=W.shape)
