"""PRIME (prototypical XMC with a dynamic-margin triplet loss), numerical core on one process.

Pure numpy with hand-written gradients (issue #13; paper ``shared/papers/prime-prototypical-xmc.txt``).
A Spark stage can call every function here on numpy / scipy arrays; nothing reads files.

Model
-----
* **Encoder** f_theta: ``h = L2n(u)``, ``u = x @ E`` (an embedding bag over the row's feature ids
  weighted by its values; ``E`` is features x dim) and, with ``residual``, ``u = e + GELU(e @ W_res
  + b_res)`` (``W_res``, ``b_res`` start at zero, so training starts from the plain bag).
  ``E`` is initialized with the top ``dim`` right singular vectors of the PIFA label embeddings
  (labels x features), so at step 0 ``h_q . h_l`` is the cosine of query and label in PIFA's
  principal subspace; columns beyond the rank of PIFA get N(0, 1e-3) noise.
* **Label side**: ``h_l`` is the label's feature row (PIFA by default, or user label features)
  through the same encoder. Centroids ``c_l`` (labels x dim, no gradient) follow Eq. 4 after
  every step; several queries of one label in a batch are combined by their *mean*, and Eq. 4
  is applied once with it: ``c <- alpha c + (1 - alpha) mean_i h_q^i`` (order independent,
  identical to Eq. 4 when the label has one query in the batch). All true labels of a batch
  row count as its labels here, not only the sampled positives. Centroids start at ``h_l``.
  Free vectors ``v`` (n_free x dim) are shared by clusters of similar labels: the leaves of
  our balanced 2-means tree (``tree.build_tree``) over PIFA with leaf size ceil(L / n_free)
  (n_free = 0 means ceil(L / 2)); balanced halving gives between n_free and 2 n_free leaves.
  A free vector starts as the normalized mean of its labels' initial ``h_l``.
* **Label Prototype Network** g_phi: one post-LN transformer encoder layer (PyTorch
  ``TransformerEncoderLayer`` with ``norm_first=False``, ``activation="gelu"``: dropout on the
  attention weights, on the attention output and inside / after the FFN), one head, over the
  tokens (h_l, c_l, v_l) without position encodings, mean pooled; ``z_l = L2n(pool)``.
  ``use_centroids`` / ``use_free`` drop a token (the paper's ablations).
* **Loss** Eq. 5: ``L_T(h_q, z) + L_T(h_q, h_l) + L_T(h_l, h_q) + lambda R``, each triplet term
  the mean over the batch's valid (anchor, positive, negative) triplets of
  :func:`margin_loss`. R averages its terms over the batch's positive and valid negative pairs;
  by default (``r_hinge``) each term is ``max(s_qp - b_qp + m', 0)`` / ``max(b_qn - s_qn + m', 0)``:
  as written (``r_hinge=False``, linear) m' only shifts the value and R_n keeps pulling the
  negatives' *label* embeddings toward the query without bound, against L_T(h_q, h_l); the
  hinge stops once the prototype beats the label embedding by m'.
  Query->label terms use the row's sampled positives and its negatives (hard from the given
  shortlist, plus random); the label->query term anchors each sampled positive label and takes
  the other batch rows that do not carry that label as negatives (in-batch).
* **Margin variants** (``margin_variant``), d = s_an - s_ap:

  ``"triplet"`` (default) ``max(d + clip(|d|)_detached, 0)`` as in the first line of Eq. 13 and
  the authors' code: d >= 0 gives ``d + clip(d)``, -gamma_min < d < 0 gives ``d + gamma_min``,
  both with gradient +1 in d; zero beyond. The default because it is the formula the paper
  writes as a max and the authors run, it is continuous, and its gradient separates positive
  from negative up to the margin. ``"inverted"`` (Eq. 3 / 14) gives ``-d + gamma_min`` with
  gradient -1 in the band -gamma_min < d < 0: it drives every triplet of the band back to d = 0
  where the hard-case gradient pushes it out again, so no triplet can ever settle with a margin
  (a loss jump of 2 gamma_min at d = -gamma_min, an attractor at d = 0); on bibtex it never
  got above the PIFA initialization on held-out training rows (benchmarks/prime_table.py
  --ablations). ``"fixed"`` is Eq. 2
  with m = gamma_min (the "no dynamic margin" ablation). Because the dynamic margin is
  detached, "triplet" and "fixed" have the *same gradient*; only the loss value differs.
* **Optimizer** AdamW (PyTorch form: decoupled decay ``w -= lr wd w`` first), decay 0.01 on
  weight matrices and E, none on biases, LayerNorm or free vectors.

Memory: label-side state is O(labels x dim) (centroids, free vectors and their Adam moments);
a step touches only the batch's rows and the labels it samples; inference streams labels and
rows in chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import scipy.sparse as sp
from numba import prange
from scipy.special import erf

from .jit import njit
from .label_embedding import pifa
from .metrics import evaluate, hits_matrix, propensities
from .tree import build_tree

MARGIN_VARIANTS = ("triplet", "inverted", "fixed")
BATCHINGS = ("random", "clustered")
NO_DECAY = frozenset({"b_res", "bq", "bk", "bv", "bo", "bf1", "bf2", "ln1_g", "ln1_b", "ln2_g", "ln2_b", "V"})
LN_EPS = 1e-5


@dataclass(frozen=True)
class PrimeParams:
    """Everything that shapes a PRIME model and its training (paper defaults where it gives one)."""

    dim: int = 128                 # embedding dimension of queries, labels and prototypes
    residual: bool = False         # encoder: + GELU(e W + b) residual layer
    ffn: int = 1024                # LPN feed-forward width
    dropout: float = 0.1           # LPN dropout (attention weights, attention out, FFN)
    lr: float = 1e-3                # the paper's (Table 10) is 3e-4, with batches of 256
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    epochs: int = 15
    batch_size: int = 1024         # a step runs the LPN on its batch's labels: ~all of them on delicious
    n_pos: int = 1                 # positives sampled per row (inverse propensity, Appendix I)
    n_hard: int = 8                # negatives per row drawn from its shortlist
    n_random: int = 8              # random negatives per row (all negatives when no shortlist)
    lambda_r: float = 0.1          # weight of R (Eq. 5)
    r_margin: float = 0.0          # m' of Eq. 6-7
    r_hinge: bool = True           # R's terms as max(., 0) (so m' matters); False: Eq. 6-7 as written
    gamma_min: float = 0.1
    gamma_max: float = 0.3
    alpha: float = 0.95            # centroid momentum (Eq. 4)
    n_free: int = 0                # free vectors; 0 = ceil(L / 2)
    margin_variant: str = "triplet"
    use_centroids: bool = True
    use_free: bool = True
    propensity_positives: bool = True   # False: positives drawn uniformly from the row's labels
    batching: str = "random"       # "clustered": NGAME's batches of similar queries (batch_order)
    cluster_size: int = 16         # clustered: at most this many queries a cluster
    propensity_a: float = 0.55
    propensity_b: float = 1.5
    seed: int = 0

    def __post_init__(self):
        if self.margin_variant not in MARGIN_VARIANTS:
            raise ValueError(f"margin_variant must be one of {MARGIN_VARIANTS}, got {self.margin_variant!r}")
        if not 0 < self.gamma_min <= self.gamma_max:
            raise ValueError(f"need 0 < gamma_min <= gamma_max, got {self.gamma_min}, {self.gamma_max}")
        if not 0 <= self.dropout < 1 or not 0 <= self.alpha < 1:
            raise ValueError("dropout and alpha must lie in [0, 1)")
        if min(self.dim, self.ffn, self.epochs, self.batch_size, self.n_pos) < 1:
            raise ValueError("dim, ffn, epochs, batch_size and n_pos must be >= 1")
        if self.n_hard + self.n_random < 1 or min(self.n_hard, self.n_random, self.n_free) < 0:
            raise ValueError("need n_hard, n_random, n_free >= 0 and at least one negative per row")
        if self.batching not in BATCHINGS or self.cluster_size < 2:
            raise ValueError(f"batching must be one of {BATCHINGS} and cluster_size >= 2, got {self.batching!r}, "
                             f"{self.cluster_size}")


@dataclass
class PrimeModel:
    """Trainable weights (``weights``) and label-side state of a PRIME model."""

    params: PrimeParams
    weights: Dict[str, np.ndarray]
    centroids: np.ndarray              # L x dim, updated by Eq. 4 (no gradient)
    free_of_label: np.ndarray          # L, index into weights["V"]
    label_features: sp.csr_matrix      # L x n_features, the encoder's input for h_l
    history: List[float] = field(default_factory=list)

    @property
    def n_labels(self) -> int:
        return self.centroids.shape[0]


# ---- elementwise pieces -----------------------------------------------------------------------
def gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, PyTorch's default."""
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_grad(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@njit(parallel=True)
def _gelu_and_grad(x, g, dg):
    xf, gf, df = x.ravel(), g.ravel(), dg.ravel()
    for i in prange(xf.size):
        v = xf[i]
        p = 0.5 * (1.0 + math.erf(v / _SQRT2))
        gf[i] = v * p
        df[i] = p + v * math.exp(-0.5 * v * v) * _INV_SQRT_2PI


def gelu_and_grad(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(gelu(x), gelu'(x)) in one numba pass over x (threads over the elements): the LPN's FFN
    activation is the largest elementwise array of a step (labels x 3 x ffn), and erf twice
    (value now, derivative in the backward pass) cost more than the FFN's products."""
    x = np.ascontiguousarray(x)
    g, dg = np.empty_like(x), np.empty_like(x)
    _gelu_and_grad(x, g, dg)
    return g, dg


def l2n(u: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(u / ||u||, ||u||) along the last axis; an all-zero row stays zero."""
    n = np.linalg.norm(u, axis=-1, keepdims=True)
    n = np.maximum(n, np.finfo(u.dtype).tiny)
    return u / n, n


def l2n_backward(dh: np.ndarray, h: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The gradient of :func:`l2n` (``n`` its clamped norms). An all-zero row (norm clamped to
    ``tiny``) gets none: its output stays zero, and dividing by ``tiny`` would overflow (e.g. the
    prototype of a label without training rows, whose three tokens are all zero)."""
    g = dh - h * np.sum(dh * h, axis=-1, keepdims=True)
    ok = n > np.finfo(n.dtype).tiny
    return np.where(ok, g / np.where(ok, n, 1), 0).astype(g.dtype, copy=False)


def layer_norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + LN_EPS)
    xhat = xc * rstd
    return xhat * g + b, (xhat, rstd, g)


def layer_norm_backward(dy, cache):
    xhat, rstd, g = cache
    axes = tuple(range(dy.ndim - 1))
    dg = (dy * xhat).sum(axes)
    db = dy.sum(axes)
    dxh = dy * g
    dx = rstd * (dxh - dxh.mean(-1, keepdims=True) - xhat * (dxh * xhat).mean(-1, keepdims=True))
    return dx, dg, db


def _dropout_mask(shape, p: float, rng, dtype):
    if p <= 0 or rng is None:
        return None
    return (rng.random(shape) >= p).astype(dtype) / (1.0 - p)


def _drop(x, mask):
    return x if mask is None else x * mask


def margin_loss(d: np.ndarray, gamma_min: float, gamma_max: float, variant: str = "triplet"):
    """(loss, dloss/dd) of the clipped dynamic-margin triplet loss, d = s_an - s_ap elementwise.

    The margin ``clip(|d|, gamma_min, gamma_max)`` is detached (Eq. 13-14): it enters the value,
    never the gradient. See the module docstring for the three variants.
    """
    d = np.asarray(d)
    hard = d >= 0
    if variant == "fixed":
        act = d + gamma_min > 0
        return np.where(act, d + gamma_min, 0.0), act.astype(d.dtype)
    clip = np.clip(np.abs(d), gamma_min, gamma_max)
    band = ~hard & (d > -gamma_min)
    if variant == "triplet":
        val = np.where(hard, d + clip, np.where(band, d + gamma_min, 0.0))
        grad = (hard | band).astype(d.dtype)
    elif variant == "inverted":
        val = np.where(hard, d + clip, np.where(band, -d + gamma_min, 0.0))
        grad = hard.astype(d.dtype) - band.astype(d.dtype)
    else:
        raise ValueError(f"margin_variant must be one of {MARGIN_VARIANTS}, got {variant!r}")
    return val, grad


def _segment_sum(idx: np.ndarray, coef: np.ndarray, rows: np.ndarray, vecs: np.ndarray, n: int) -> np.ndarray:
    """out[k] = sum over j with idx[j] == k of coef[j] * vecs[rows[j]] (n x dim), via one sparse product."""
    M = sp.csr_matrix((np.asarray(coef, vecs.dtype).ravel(), (idx.ravel(), rows.ravel())), shape=(n, vecs.shape[0]))
    return np.asarray(M @ vecs)


def _mm(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """x (..., a) @ W (a, b) as one 2-D BLAS product."""
    return (x.reshape(-1, x.shape[-1]) @ W).reshape(*x.shape[:-1], W.shape[1])


# ---- encoder ----------------------------------------------------------------------------------
def encode_forward(W: Dict[str, np.ndarray], X: sp.csr_matrix, residual: bool):
    """h (n x dim, unit rows) of the sparse rows X, and the cache for :func:`encode_backward`."""
    e = np.asarray(X @ W["E"])
    a = None
    if residual:
        a = e @ W["W_res"] + W["b_res"]
        u = e + gelu(a)
    else:
        u = e
    h, n = l2n(u)
    return h, (X, e, a, h, n)


def encode_backward(W, dh, cache, grads):
    X, e, a, h, n = cache
    du = l2n_backward(dh, h, n)
    de = du
    if a is not None:
        da = du * gelu_grad(a)
        grads["W_res"] = grads.get("W_res", 0) + e.T @ da
        grads["b_res"] = grads.get("b_res", 0) + da.sum(0)
        de = du + da @ W["W_res"].T
    grads["E"] = grads.get("E", 0) + np.asarray(X.T @ de)


# ---- Label Prototype Network ------------------------------------------------------------------
def lpn_forward(W: Dict[str, np.ndarray], T: np.ndarray, dropout: float = 0.0, rng=None):
    """Pooled output (m x dim) of one post-LN transformer encoder layer over tokens T (m x t x dim),
    before the final L2 normalization; dropout is active only when ``rng`` is given."""
    m, t, D = T.shape
    dt = T.dtype
    Q = _mm(T, W["Wq"]) + W["bq"]
    K = _mm(T, W["Wk"]) + W["bk"]
    Vv = _mm(T, W["Wv"]) + W["bv"]
    S = Q @ K.transpose(0, 2, 1) / math.sqrt(D)
    S = S - S.max(-1, keepdims=True)
    A = np.exp(S)
    A /= A.sum(-1, keepdims=True)
    mA = _dropout_mask(A.shape, dropout, rng, dt)
    Ad = _drop(A, mA)
    Oh = Ad @ Vv
    att = _mm(Oh, W["Wo"]) + W["bo"]
    m1 = _dropout_mask(att.shape, dropout, rng, dt)
    x1, c1 = layer_norm(T + _drop(att, m1), W["ln1_g"], W["ln1_b"])
    a = _mm(x1, W["Wf1"]) + W["bf1"]
    g, dg = gelu_and_grad(a)
    m2 = _dropout_mask(g.shape, dropout, rng, dt)
    gd = _drop(g, m2)
    f = _mm(gd, W["Wf2"]) + W["bf2"]
    m3 = _dropout_mask(f.shape, dropout, rng, dt)
    y, c2 = layer_norm(x1 + _drop(f, m3), W["ln2_g"], W["ln2_b"])
    return y.mean(1), (T, Q, K, Vv, A, mA, Ad, Oh, m1, x1, c1, dg, m2, gd, m3, c2)


def lpn_backward(W, dpool: np.ndarray, cache, grads):
    """Adds the weight gradients to ``grads``; returns d tokens (m x t x dim)."""
    T, Q, K, Vv, A, mA, Ad, Oh, m1, x1, c1, dg, m2, gd, m3, c2 = cache
    m, t, D = T.shape
    dy = np.repeat(dpool[:, None, :] / t, t, axis=1)
    dr2, grads["ln2_g"], grads["ln2_b"] = layer_norm_backward(dy, c2)
    df = _drop(dr2, m3)
    grads["Wf2"] = gd.reshape(-1, gd.shape[-1]).T @ df.reshape(-1, D)
    grads["bf2"] = df.sum((0, 1))
    da = _drop(_mm(df, W["Wf2"].T), m2) * dg
    grads["Wf1"] = x1.reshape(-1, D).T @ da.reshape(-1, da.shape[-1])
    grads["bf1"] = da.sum((0, 1))
    dx1 = dr2 + _mm(da, W["Wf1"].T)
    dr1, grads["ln1_g"], grads["ln1_b"] = layer_norm_backward(dx1, c1)
    datt = _drop(dr1, m1)
    grads["Wo"] = Oh.reshape(-1, D).T @ datt.reshape(-1, D)
    grads["bo"] = datt.sum((0, 1))
    dO = _mm(datt, W["Wo"].T)
    dVv = Ad.transpose(0, 2, 1) @ dO
    dA = _drop(dO @ Vv.transpose(0, 2, 1), mA)
    dS = A * (dA - (dA * A).sum(-1, keepdims=True)) / math.sqrt(D)
    dQ = dS @ K
    dK = dS.transpose(0, 2, 1) @ Q
    Tf = T.reshape(-1, D)
    dT = dr1.copy()
    for name, dP in (("q", dQ), ("k", dK), ("v", dVv)):
        grads["W" + name] = Tf.T @ dP.reshape(-1, D)
        grads["b" + name] = dP.sum((0, 1))
        dT += _mm(dP, W["W" + name].T)
    return dT


# ---- model construction -----------------------------------------------------------------------
def pifa_svd_basis(Z: sp.csr_matrix, dim: int, rng, dtype=np.float32) -> np.ndarray:
    """features x dim: the top right singular vectors of PIFA (labels x features), padded with
    N(0, 1e-3) columns beyond its rank."""
    Z = sp.csr_matrix(Z, dtype=np.float64)
    L, d = Z.shape
    k = min(dim, L, d)
    if L * d <= 2e7:
        _, _, vt = np.linalg.svd(Z.toarray(), full_matrices=False)
        vt = vt[:k]
    else:
        from scipy.sparse.linalg import svds
        k = min(k, min(L, d) - 1)
        _, s, vt = svds(Z, k=k, random_state=0)
        vt = vt[np.argsort(-s)]
    E = rng.normal(0.0, 1e-3, size=(d, dim))
    E[:, :k] = vt.T
    return E.astype(dtype)


def free_vector_clusters(Z: sp.csr_matrix, n_free: int = 0, seed: int = 0) -> np.ndarray:
    """Cluster id (0..c-1) of every label: leaves of the balanced 2-means tree over its rows
    with leaf size ceil(L / n_free) (n_free = 0: ceil(L / 2))."""
    L = Z.shape[0]
    n_free = n_free or math.ceil(L / 2)
    size = max(1, math.ceil(L / n_free))
    if size == 1:
        return np.arange(L, dtype=np.int64)
    leaf = build_tree(Z, max_leaf_size=size, nr_splits=2, seed=seed)
    return np.unique(leaf, return_inverse=True)[1].astype(np.int64)


def init_lpn(dim: int, ffn: int, rng, dtype=np.float32) -> Dict[str, np.ndarray]:
    """PyTorch-like init: Xavier-uniform projections, U(+-1/sqrt(fan_in)) FFN, zero biases, LN (1, 0)."""
    def xavier(a, b):
        lim = math.sqrt(6.0 / (a + b))
        return rng.uniform(-lim, lim, (a, b)).astype(dtype)

    def lin(a, b):
        lim = 1.0 / math.sqrt(a)
        return rng.uniform(-lim, lim, (a, b)).astype(dtype)

    W = {n: xavier(dim, dim) for n in ("Wq", "Wk", "Wv")}
    W["Wo"] = lin(dim, dim)
    W["Wf1"] = lin(dim, ffn)
    W["Wf2"] = lin(ffn, dim)
    for n in ("bq", "bk", "bv", "bo", "bf2", "ln1_b", "ln2_b"):
        W[n] = np.zeros(dim, dtype)
    W["bf1"] = np.zeros(ffn, dtype)
    W["ln1_g"] = np.ones(dim, dtype)
    W["ln2_g"] = np.ones(dim, dtype)
    return W


def init_model(X: sp.csr_matrix, Y: sp.csr_matrix, prm: PrimeParams, label_features=None,
               dtype=np.float32) -> PrimeModel:
    """:func:`init_from_pifa` with the PIFA embeddings of (X, Y)."""
    return init_from_pifa(pifa(sp.csr_matrix(X), sp.csr_matrix(Y)), prm, label_features, dtype)


def init_from_pifa(Z: sp.csr_matrix, prm: PrimeParams, label_features=None, dtype=np.float32) -> PrimeModel:
    """Encoder from the singular vectors of PIFA ``Z`` (labels x features, e.g. the pipeline's
    label-embedding stage), centroids = initial h_l, free vectors = their clusters' mean h_l."""
    rng = np.random.default_rng(prm.seed)
    Z = sp.csr_matrix(Z, dtype=np.float32)
    F = Z if label_features is None else sp.csr_matrix(label_features, dtype=np.float32)
    if F.shape != Z.shape:
        raise ValueError(f"label features are {F.shape}, expected labels x features {Z.shape}")
    W = {"E": pifa_svd_basis(Z, prm.dim, rng, dtype)}
    if prm.residual:
        W["W_res"] = np.zeros((prm.dim, prm.dim), dtype)
        W["b_res"] = np.zeros(prm.dim, dtype)
    W.update(init_lpn(prm.dim, prm.ffn, rng, dtype))
    h, _ = encode_forward(W, F, prm.residual)
    cl = free_vector_clusters(Z, prm.n_free, prm.seed)
    n_cl = int(cl.max()) + 1 if len(cl) else 0
    V = _segment_sum(cl, np.ones(len(cl)), np.arange(len(cl)), h, n_cl)
    W["V"] = l2n(V.astype(dtype))[0]
    return PrimeModel(prm, W, h.astype(dtype), cl, F)


# ---- one mini-batch ---------------------------------------------------------------------------
def _tokens(model: PrimeModel, hU, U):
    toks = [hU]
    if model.params.use_centroids:
        toks.append(model.centroids[U].astype(hU.dtype))
    if model.params.use_free:
        toks.append(model.weights["V"][model.free_of_label[U]])
    return np.stack(toks, axis=1)


def _triplets(sp_, sn, valid, prm):
    """Mean dynamic-margin loss over (i, p, n) with sp_ B x P, sn B x M; grads for sp_ and sn."""
    d = sn[:, None, :] - sp_[:, :, None]
    val, g = margin_loss(d, prm.gamma_min, prm.gamma_max, prm.margin_variant)
    w = np.broadcast_to(valid[:, None, :], d.shape)
    cnt = max(int(w.sum()), 1)
    g = g * w / cnt
    return float((val * w).sum() / cnt), -g.sum(2), g.sum(1)


def batch_loss(model: PrimeModel, Xq: sp.csr_matrix, Yq: sp.csr_matrix, pos: np.ndarray, neg: np.ndarray,
               valid: np.ndarray, rng=None):
    """Loss of Eq. 5 on one batch and its gradient for every weight.

    ``pos`` B x P positive label ids (true labels of each row), ``neg`` B x M negative label
    ids with ``valid`` B x M (invalid ones are ignored), ``rng`` enables dropout.
    Returns (loss, grads, h_q, parts) where parts holds the four terms.
    """
    prm = model.params
    W = model.weights
    B, P = pos.shape
    neg = np.where(valid, neg, pos[:, :1])
    U, inv = np.unique(np.concatenate([pos.ravel(), neg.ravel()]), return_inverse=True)
    pu, nu = inv[:pos.size].reshape(pos.shape), inv[pos.size:].reshape(neg.shape)
    nU = len(U)
    h, enc = encode_forward(W, sp.vstack([sp.csr_matrix(Xq), model.label_features[U]]).tocsr(), prm.residual)
    hq, hU = h[:B], h[B:]
    pool, lcache = lpn_forward(W, _tokens(model, hU, U), prm.dropout, rng)
    z, zn = l2n(pool)

    # query -> prototype and query -> label
    bzp = np.einsum("bd,bpd->bp", hq, z[pu])
    bzn = np.einsum("bd,bmd->bm", hq, z[nu])
    slp = np.einsum("bd,bpd->bp", hq, hU[pu])
    sln = np.einsum("bd,bmd->bm", hq, hU[nu])
    l_qz, d_bzp, d_bzn = _triplets(bzp, bzn, valid, prm)
    l_ql, d_slp, d_sln = _triplets(slp, sln, valid, prm)

    # label -> query: anchor = each sampled positive, positive = its row, negatives = batch rows
    # that do not carry the label
    rows = np.repeat(np.arange(B), P)
    Hp = hU[pu.ravel()]
    S = Hp @ hq.T
    lq_valid = ~np.asarray(Yq[:, pos.ravel()].toarray() != 0).T
    d = S - S[np.arange(len(rows)), rows][:, None]
    val, g = margin_loss(d, prm.gamma_min, prm.gamma_max, prm.margin_variant)
    cnt = max(int(lq_valid.sum()), 1)
    l_lq = float((val * lq_valid).sum() / cnt)
    dS = g * lq_valid / cnt
    dS[np.arange(len(rows)), rows] -= dS.sum(1)

    # R = (R_p + R_n) / 2, Eq. 6-7
    lam = prm.lambda_r
    nv = max(int(valid.sum()), 1)
    t_p = slp - bzp + prm.r_margin
    t_n = bzn - sln + prm.r_margin
    a_p = (t_p > 0) if prm.r_hinge else np.ones(t_p.shape, bool)
    a_n = ((t_n > 0) if prm.r_hinge else np.ones(t_n.shape, bool)) & valid
    r_p = float((t_p * a_p).sum() / pos.size)
    r_n = float((t_n * a_n).sum() / nv)
    reg = 0.5 * (r_p + r_n)
    d_slp = d_slp + 0.5 * lam * a_p / pos.size
    d_bzp = d_bzp - 0.5 * lam * a_p / pos.size
    d_bzn = d_bzn + 0.5 * lam * a_n / nv
    d_sln = d_sln - 0.5 * lam * a_n / nv

    loss = l_qz + l_ql + l_lq + lam * reg
    # back to h_q, z_U, h_U
    dhq = (np.einsum("bp,bpd->bd", d_bzp, z[pu]) + np.einsum("bm,bmd->bd", d_bzn, z[nu])
           + np.einsum("bp,bpd->bd", d_slp, hU[pu]) + np.einsum("bm,bmd->bd", d_sln, hU[nu]) + dS.T @ Hp)
    brow_p = np.broadcast_to(np.arange(B)[:, None], pu.shape)
    brow_n = np.broadcast_to(np.arange(B)[:, None], nu.shape)
    idx = np.concatenate([pu.ravel(), nu.ravel()])
    brow = np.concatenate([brow_p.ravel(), brow_n.ravel()])
    dz = _segment_sum(idx, np.concatenate([d_bzp.ravel(), d_bzn.ravel()]), brow, hq, nU)
    dhU = _segment_sum(idx, np.concatenate([d_slp.ravel(), d_sln.ravel()]), brow, hq, nU)
    dhU += _segment_sum(pu.ravel(), np.ones(pu.size), np.arange(pu.size), dS @ hq, nU)

    grads: Dict[str, np.ndarray] = {}
    dt = h.dtype
    dhq, dz, dhU = dhq.astype(dt, copy=False), dz.astype(dt, copy=False), dhU.astype(dt, copy=False)
    dT = lpn_backward(W, l2n_backward(dz, z, zn), lcache, grads)
    dhU += dT[:, 0]
    if prm.use_free:
        cl = model.free_of_label[U]
        grads["V"] = _segment_sum(cl, np.ones(nU), np.arange(nU), dT[:, -1], W["V"].shape[0])
    encode_backward(W, np.concatenate([dhq, dhU]), enc, grads)
    grads = {k: np.asarray(v, dtype=W[k].dtype) for k, v in grads.items()}
    parts = {"qz": l_qz, "ql": l_ql, "lq": l_lq, "R": reg}
    return loss, grads, hq, parts


# ---- optimizer and centroids ------------------------------------------------------------------
def adamw_step(W: Dict[str, np.ndarray], grads: Dict[str, np.ndarray], state: Dict[str, np.ndarray], t: int,
               prm: PrimeParams) -> None:
    """One AdamW step in place (PyTorch's order: decoupled decay, then the bias-corrected Adam
    update); ``state`` holds the moments ("m:name", "v:name"); ``t`` counts from 1."""
    c1 = 1.0 - prm.beta1 ** t
    c2 = 1.0 - prm.beta2 ** t
    for k, g in grads.items():
        w = W[k]
        m = state.setdefault("m:" + k, np.zeros_like(w))
        v = state.setdefault("v:" + k, np.zeros_like(w))
        if k not in NO_DECAY:
            w *= 1.0 - prm.lr * prm.weight_decay
        m *= prm.beta1
        m += (1.0 - prm.beta1) * g
        v *= prm.beta2
        v += (1.0 - prm.beta2) * g * g
        w -= prm.lr * (m / c1) / (np.sqrt(v / c2) + prm.adam_eps)


def update_centroids(C: np.ndarray, Yq: sp.csr_matrix, hq: np.ndarray, alpha: float) -> np.ndarray:
    """Eq. 4 in place for every label of the batch: c <- alpha c + (1 - alpha) mean of h_q over
    the batch rows carrying the label (see the module docstring); returns C."""
    Yb = sp.csr_matrix(Yq, copy=True)
    Yb.data[:] = 1.0
    M = Yb.T.tocsr()
    cnt = np.diff(M.indptr)
    lab = np.flatnonzero(cnt)
    mean = np.asarray(M[lab] @ hq) / cnt[lab, None]
    C[lab] = alpha * C[lab] + (1.0 - alpha) * mean
    return C


# ---- sampling ---------------------------------------------------------------------------------
def sample_positives(Yq: sp.csr_matrix, inv_prop: np.ndarray, n_pos: int, rng) -> np.ndarray:
    """B x n_pos labels of each row (rows need a label), drawn with replacement with
    probability gamma_l / sum over the row's labels (Appendix I), gamma = inverse propensity."""
    Yq = sp.csr_matrix(Yq)
    cnt = np.diff(Yq.indptr)
    if (cnt == 0).any():
        raise ValueError("every training row needs at least one label")
    w = np.asarray(inv_prop, np.float64)[Yq.indices]
    cum = np.cumsum(w)
    start = np.concatenate([[0.0], cum])[Yq.indptr[:-1]]
    tot = cum[Yq.indptr[1:] - 1] - start
    u = rng.random((Yq.shape[0], n_pos))
    j = np.searchsorted(cum, start[:, None] + u * tot[:, None], side="right")
    j = np.clip(j, Yq.indptr[:-1, None], Yq.indptr[1:, None] - 1)
    return Yq.indices[j].astype(np.int64)


def sample_negatives(Yq: sp.csr_matrix, n_labels: int, n_hard: int, n_random: int, rng,
                     shortlist: Optional[np.ndarray] = None,
                     pool: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(neg B x M, valid B x M): n_hard uniform draws from each row's shortlist (B x K label
    ids, -1 padded) and n_random uniform labels (all M random without a shortlist), or, with
    ``pool`` (the batch's sampled positives: NGAME's in-batch negatives), n_random uniform draws
    from it; negatives that are true labels of the row or -1 are invalid."""
    B = Yq.shape[0]
    if shortlist is None or shortlist.shape[1] == 0:
        n_random, n_hard = n_random + n_hard, 0
    pool = None if pool is None or not len(pool) else np.asarray(pool, np.int64)
    parts = [rng.integers(0, n_labels, (B, n_random)) if pool is None
             else pool[rng.integers(0, len(pool), (B, n_random))]]
    if n_hard:
        cols = rng.integers(0, shortlist.shape[1], (B, n_hard))
        parts.insert(0, np.asarray(shortlist)[np.arange(B)[:, None], cols])
    neg = np.concatenate(parts, axis=1).astype(np.int64)
    return neg, (neg >= 0) & ~hits_matrix(neg, Yq)


def batch_order(model: PrimeModel, X: sp.csr_matrix, rng) -> List[np.ndarray]:
    """One pass's mini-batches over the rows of X (row indices, each batch sorted).

    ``random``: a permutation cut into ``batch_size`` rows. ``clustered`` (NGAME's mini-batching,
    Dahiya et al. 2023, as the paper adopts it): the rows' h_q under the current encoder are split by
    our balanced 2-means tree (:func:`~.tree.build_tree`, the label tree's kernel) into clusters of
    at most ``cluster_size`` rows (and more than half as many: the splits are balanced), the
    clusters shuffled and laid end to end, then cut into ``batch_size`` rows: a batch is mostly
    whole groups of similar queries (a cluster may straddle two batches), whose sampled positives
    are the pool of in-batch negatives (:func:`train_step`; a row's own cluster gives about
    cluster_size / batch_size of it). NGAME clusters all training queries and refreshes the
    clusters every few epochs; the stage passes one streamed blob, so its clusters are the blob's,
    recomputed at every pass, and no process holds more than a blob's h_q (:func:`train`, the
    numpy reference, passes all its rows). At most ``cluster_size`` rows are only permuted (in-batch
    negatives still apply)."""
    prm = model.params
    n = X.shape[0]
    if prm.batching != "clustered" or n <= prm.cluster_size:
        order = rng.permutation(n)
    else:
        hq = encode(model, X)
        leaf = build_tree(sp.csr_matrix(hq), max_leaf_size=prm.cluster_size, seed=int(rng.integers(2 ** 31 - 1)))
        _, inv = np.unique(leaf, return_inverse=True)
        cluster_rank = rng.permutation(int(inv.max()) + 1)[inv]
        order = np.lexsort((rng.random(n), cluster_rank))         # clusters in shuffled order, rows shuffled
    return [np.sort(order[s:s + prm.batch_size]) for s in range(0, n, prm.batch_size)]


# ---- training ---------------------------------------------------------------------------------
@dataclass
class Optimizer:
    """AdamW moments (O(weights), so O(labels x dim) on the label side) and the step count."""

    state: Dict[str, np.ndarray] = field(default_factory=dict)
    t: int = 0


def inverse_propensities(label_counts: np.ndarray, n_rows: int, prm: PrimeParams) -> np.ndarray:
    """gamma_l = 1 / p_l (Jain et al. 2016) from the training label counts, for positive sampling."""
    return 1.0 / propensities(label_counts, max(n_rows, 3), prm.propensity_a, prm.propensity_b,
                              n_labels=len(label_counts))


def train_step(model: PrimeModel, opt: Optimizer, Xq: sp.csr_matrix, Yq: sp.csr_matrix, inv_prop: np.ndarray,
               rng, shortlist: Optional[np.ndarray] = None) -> float:
    """One mini-batch (rows with at least one label): sample positives and negatives, Eq. 5 and
    its gradient, one AdamW step, Eq. 4 for the batch's labels. Returns the batch loss.
    A caller that streams batches itself (e.g. from Spark partitions) loops over this."""
    prm = model.params
    pos = sample_positives(Yq, inv_prop if prm.propensity_positives else np.ones(model.n_labels), prm.n_pos, rng)
    neg, valid = sample_negatives(Yq, model.n_labels, prm.n_hard, prm.n_random, rng, shortlist,
                                  pos.ravel() if prm.batching == "clustered" else None)
    loss, grads, hq, _ = batch_loss(model, Xq, Yq, pos, neg, valid, rng if prm.dropout > 0 else None)
    opt.t += 1
    adamw_step(model.weights, grads, opt.state, opt.t, prm)
    update_centroids(model.centroids, Yq, hq, prm.alpha)
    return loss


def train(X: sp.csr_matrix, Y: sp.csr_matrix, prm: PrimeParams, shortlist: Optional[np.ndarray] = None,
          label_features=None, on_epoch: Optional[Callable[[int, PrimeModel], None]] = None) -> PrimeModel:
    """Train on the rows of X (n x features, L2-normalized as ingest gives them) with labels Y
    (n x L); ``shortlist`` n x K label ids (-1 padded) gives the hard negatives (e.g. the tree's
    beam search over the training rows). Rows without labels are skipped. Clustered batches are
    built over all the rows at once (the stage builds them per streamed blob). One process, the
    rows streamed in mini-batches; float32. ``on_epoch(epoch, model)`` runs after every epoch
    (``model.history`` holds the mean batch loss of each epoch so far)."""
    X = sp.csr_matrix(X, dtype=np.float32)
    Y = sp.csr_matrix(Y)
    n, L = Y.shape
    model = init_model(X, Y, prm, label_features)
    rows = np.flatnonzero(np.diff(Y.indptr) > 0)
    inv_prop = inverse_propensities(np.bincount(Y.indices, minlength=L), n, prm)
    rng = np.random.default_rng(prm.seed + 1)
    opt = Optimizer()
    for ep in range(prm.epochs):
        total, nb = 0.0, 0
        for b in batch_order(model, X[rows], rng):
            b = rows[b]
            total += train_step(model, opt, X[b], Y[b], inv_prop, rng, None if shortlist is None else shortlist[b])
            nb += 1
        model.history.append(total / max(nb, 1))
        if on_epoch is not None:
            on_epoch(ep, model)
    return model


# ---- inference --------------------------------------------------------------------------------
def encode(model: PrimeModel, X: sp.csr_matrix, chunk: int = 8192) -> np.ndarray:
    """h_q (n x dim) of rows X, in chunks."""
    X = sp.csr_matrix(X, dtype=model.weights["E"].dtype)
    d = model.weights["E"].shape[0]
    if X.shape[1] != d:
        X = sp.csr_matrix((X.data, X.indices, X.indptr), shape=(X.shape[0], d))
    out = [encode_forward(model.weights, X[s:s + chunk], model.params.residual)[0]
           for s in range(0, X.shape[0], chunk)]
    return np.concatenate(out) if out else np.zeros((0, model.params.dim), model.weights["E"].dtype)


def prototypes(model: PrimeModel, chunk: int = 4096) -> np.ndarray:
    """z (L x dim, unit rows) of every label, dropout off, in chunks of labels."""
    out = []
    for s in range(0, model.n_labels, chunk):
        U = np.arange(s, min(s + chunk, model.n_labels))
        hU = encode_forward(model.weights, model.label_features[U], model.params.residual)[0]
        out.append(l2n(lpn_forward(model.weights, _tokens(model, hU, U))[0])[0])
    return np.concatenate(out)


def _top_rows(S: np.ndarray, k: int, ids: Optional[np.ndarray] = None):
    """Top k of each row of S by score (ties by lower id), as (ids, scores)."""
    n, m = S.shape
    k = min(k, m)
    ids = np.broadcast_to(np.arange(m), S.shape) if ids is None else ids
    if k < m:
        part = np.argpartition(-S, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(m), (n, m))
    sc = np.take_along_axis(S, part, 1)
    lab = np.take_along_axis(ids, part, 1)
    order = np.lexsort((lab, -sc), axis=1) if n else np.zeros((0, k), np.int64)
    return np.take_along_axis(lab, order, 1), np.take_along_axis(sc, order, 1)


def retrieve(hq: np.ndarray, Z: np.ndarray, k: int, chunk: int = 2048) -> Tuple[np.ndarray, np.ndarray]:
    """Exact maximum inner product search: top-k labels (n x k) of h_q over all prototypes Z."""
    labs, scs = [], []
    for s in range(0, hq.shape[0], chunk):
        lab, sc = _top_rows(hq[s:s + chunk] @ Z.T, k)
        labs.append(lab)
        scs.append(sc)
    k = min(k, Z.shape[0])
    if not labs:
        return np.zeros((0, k), np.int64), np.zeros((0, k), Z.dtype)
    return np.concatenate(labs).astype(np.int64), np.concatenate(scs)


def candidate_scores(hq: np.ndarray, Z: np.ndarray, cand: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """h_q . z_l for each row's candidate labels (n x K; -1 candidates get -inf)."""
    out = np.empty(cand.shape, dtype=np.float64)
    for s in range(0, cand.shape[0], chunk):
        c = cand[s:s + chunk]
        out[s:s + chunk] = np.einsum("nd,nkd->nk", hq[s:s + chunk], Z[np.maximum(c, 0)])
    return np.where(cand >= 0, out, -np.inf)


def rerank(cand: np.ndarray, tree_scores: np.ndarray, prime_scores: np.ndarray, weight: float):
    """Re-rank each row's candidates by ``weight * tree + (1 - weight) * prime`` (a stable sort,
    so weight 1 keeps the tree's order); -1 candidates stay last. Returns (labels, scores)."""
    ok = cand >= 0                       # -1 candidates may carry -inf: keep them out of the sum
    final = weight * np.where(ok, tree_scores, 0.0) + (1.0 - weight) * np.where(ok, prime_scores, 0.0)
    final = np.where(ok, final, -np.inf)
    order = np.argsort(-final, axis=1, kind="stable")
    return np.take_along_axis(cand, order, 1), np.take_along_axis(final, order, 1)


def choose_weight(cand: np.ndarray, tree_scores: np.ndarray, prime_scores: np.ndarray, Y: sp.csr_matrix,
                  grid: Sequence[float] = tuple(np.round(np.linspace(0, 1, 21), 2)),
                  ks: Sequence[int] = (1, 3, 5)) -> Tuple[float, Dict[float, float]]:
    """The mixing weight with the best mean P@k on rows whose truth is Y (held-out *training*
    rows, never the test set); ties go to the larger weight (closer to the tree)."""
    Y = sp.csr_matrix(Y)
    ones = np.ones(max(Y.shape[1], int(cand.max()) + 1 if cand.size else 0))
    table = {}
    for w in grid:
        lab, _ = rerank(cand, tree_scores, prime_scores, float(w))
        m = evaluate(lab[:, :max(ks)], Y, ones, ks)
        table[float(w)] = float(np.mean([m[f"p@{k}"] for k in ks]))
    best = max(table, key=lambda w: (table[w], w))
    return best, table
