"""PRIME numerical core (xmc_spark/kernels/prime.py) against the paper's equations, finite
differences and brute force."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from tests.conftest import random_problem
from xmc_spark.kernels import prime as P
from xmc_spark.kernels.metrics import evaluate

GMIN, GMAX = 0.1, 0.3


# ---- the paper's equations, written out per region --------------------------------------------
def clip(x):
    return min(max(x, GMIN), GMAX)


def paper_value(s_ap, s_an, variant):
    """Eq. 13 first line (triplet), Eq. 3 (inverted), Eq. 2 with m = gamma_min (fixed)."""
    if variant == "fixed":
        return max(s_an - s_ap + GMIN, 0.0)
    if s_ap <= s_an:                                     # C_n
        return (s_an - s_ap) + clip(s_an - s_ap)
    if variant == "triplet":                             # max(Delta^{n-p} + clip(Delta^{p-n}), 0)
        return max(s_an - s_ap + clip(s_ap - s_an), 0.0)
    return 0.0 if s_ap - s_an >= GMIN else (s_ap - s_an) + GMIN      # Eq. 3


def paper_grad(s_ap, s_an, variant):
    """(dL/ds_ap, dL/ds_an): Eq. 14 for the inverted variant, Eq. 9 with m = gamma_min otherwise."""
    if variant == "inverted":
        if s_ap <= s_an:
            return (-1.0, 1.0)
        return (1.0, -1.0) if s_ap - s_an < GMIN else (0.0, 0.0)
    return (-1.0, 1.0) if s_ap - s_an < GMIN else (0.0, 0.0)


# (s_ap, s_an) in every region: hard with clip at gamma_min / inside / at gamma_max, the band, beyond
POINTS = [(0.30, 0.35), (0.10, 0.30), (0.00, 0.60), (-0.2, -0.2), (0.50, 0.45), (0.52, 0.43), (0.50, 0.35),
          (0.9, -0.5), (0.4, 0.3)]


@pytest.mark.parametrize("variant", P.MARGIN_VARIANTS)
def test_margin_loss_each_region_matches_the_paper(variant):
    s_ap = np.array([p[0] for p in POINTS])
    s_an = np.array([p[1] for p in POINTS])
    val, g = P.margin_loss(s_an - s_ap, GMIN, GMAX, variant)
    for i, (a, n) in enumerate(POINTS):
        assert val[i] == pytest.approx(paper_value(a, n, variant), abs=1e-12), (a, n)
        assert (-g[i], g[i]) == paper_grad(a, n, variant), (a, n)
    # spot values: hard case with the clip inside its range, the band, beyond the margin
    dyn = variant != "fixed"
    assert val[1] == pytest.approx(0.4 if dyn else 0.3)          # d = 0.2: d + clip(d) = 0.4
    assert val[2] == pytest.approx(0.9 if dyn else 0.7)          # d = 0.6: 0.6 + gamma_max
    assert val[4] == pytest.approx(0.15 if variant == "inverted" else 0.05)     # d = -0.05
    assert val[6] == 0.0 and g[6] == 0.0                         # d = -0.15


def test_triplet_variant_gradient_is_the_detached_margin_derivative():
    """Away from the kinks, the triplet variant's gradient equals the finite difference of
    max(d + clip(|d|)_frozen, 0) with the margin frozen at the base point."""
    rng = np.random.default_rng(0)
    d = rng.uniform(-0.4, 0.8, 200)
    # away from the kinks; on -gamma_max <= d <= -gamma_min the frozen form sits exactly on its
    # kink (d + clip(-d) = 0), where Eq. 14 takes the zero gradient (tested above)
    d = d[(np.abs(np.abs(d) - GMIN) > 1e-3) & ((d < -GMAX - 1e-3) | (d > -GMIN + 1e-3))]
    _, g = P.margin_loss(d, GMIN, GMAX, "triplet")
    frozen = np.clip(np.abs(d), GMIN, GMAX)
    f = lambda x: np.maximum(x + frozen, 0.0)  # noqa: E731
    fd = (f(d + 1e-7) - f(d - 1e-7)) / 2e-7
    np.testing.assert_allclose(g, fd, atol=1e-6)


# ---- a float64 model on a tiny problem -----------------------------------------------------------
def tiny(variant="triplet", residual=True, gmin=GMIN, gmax=GMAX, dropout=0.0, **kw):
    X, Y = random_problem(n=40, d=15, L=9, seed=3)
    prm = P.PrimeParams(dim=6, ffn=10, dropout=dropout, residual=residual, margin_variant=variant,
                        gamma_min=gmin, gamma_max=gmax, n_free=4, lambda_r=0.3, r_margin=0.05, **kw)
    model = P.init_model(X, Y, prm, dtype=np.float64)
    rng = np.random.default_rng(5)
    for w in model.weights.values():      # move off the symmetric init (zero residual, LN 1/0)
        w += rng.normal(0, 0.3, w.shape)
    model.centroids += rng.normal(0, 0.3, model.centroids.shape)
    rows = np.flatnonzero(np.diff(Y.indptr) > 0)[:8]
    Xq, Yq = X[rows].astype(np.float64), Y[rows]
    pos = P.sample_positives(Yq, np.ones(9), 2, rng)
    short = rng.integers(-1, 9, (len(rows), 5))
    neg, valid = P.sample_negatives(Yq, 9, 3, 2, rng, short)
    return model, Xq, Yq, pos, neg, valid


@pytest.mark.parametrize("variant,dropout,hinge", [("triplet", 0.0, False), ("inverted", 0.0, False),
                                                   ("fixed", 0.0, False), ("triplet", 0.3, True)])
def test_whole_backward_pass_matches_finite_differences(variant, dropout, hinge):
    # gamma_min = gamma_max: the detached margin is then a constant, so the finite difference of
    # the loss value is the true derivative (with a moving clip it would also differentiate the
    # margin, which Eq. 14 detaches; that case is the test above)
    model, Xq, Yq, pos, neg, valid = tiny(variant, gmin=0.2, gmax=0.2, dropout=dropout, r_hinge=hinge)
    seed = 11

    def loss():
        rng = np.random.default_rng(seed) if dropout else None    # the same dropout masks every call
        return P.batch_loss(model, Xq, Yq, pos, neg, valid, rng)

    base, grads, _, parts = loss()
    assert set(grads) == set(model.weights)
    assert all(parts[k] != 0 for k in ("qz", "ql", "lq"))
    rng = np.random.default_rng(1)
    eps = 1e-6
    for name, w in model.weights.items():
        flat = w.reshape(-1)
        gflat = grads[name].reshape(-1)
        for j in rng.choice(flat.size, size=min(6, flat.size), replace=False):
            old = flat[j]
            flat[j] = old + eps
            up = loss()[0]
            flat[j] = old - eps
            down = loss()[0]
            flat[j] = old
            fd = (up - down) / (2 * eps)
            assert gflat[j] == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, j)
    assert np.linalg.norm(grads["V"]) > 0 and np.linalg.norm(grads["E"]) > 0


@pytest.mark.parametrize("hinge", [False, True])
def test_batch_loss_terms_are_eq5_to_7_by_brute_force(hinge):
    model, Xq, Yq, pos, neg, valid = tiny("triplet", r_hinge=hinge)
    loss, _, hq, parts = P.batch_loss(model, Xq, Yq, pos, neg, valid)
    W = model.weights
    L = model.n_labels
    hl = P.encode_forward(W, model.label_features.astype(np.float64), True)[0]
    z = P.l2n(P.lpn_forward(W, P._tokens(model, hl, np.arange(L)))[0])[0]
    f = lambda anchor, s_ap, s_an: paper_value(s_ap, s_an, "triplet")  # noqa: E731
    qz, ql, rp, rn = [], [], [], []
    Yd = Yq.toarray() > 0
    for i in range(len(pos)):
        for p in pos[i]:
            rp.append(hq[i] @ hl[p] - hq[i] @ z[p] + 0.05)
            for n, ok in zip(neg[i], valid[i]):
                if ok:
                    qz.append(f(hq[i], hq[i] @ z[p], hq[i] @ z[n]))
                    ql.append(f(hq[i], hq[i] @ hl[p], hq[i] @ hl[n]))
        for n, ok in zip(neg[i], valid[i]):
            if ok:
                rn.append(hq[i] @ z[n] - hq[i] @ hl[n] + 0.05)
    lq = [f(hl[p], hl[p] @ hq[i], hl[p] @ hq[j]) for i in range(len(pos)) for p in pos[i]
          for j in range(len(pos)) if not Yd[j, p]]
    assert parts["qz"] == pytest.approx(np.mean(qz))
    assert parts["ql"] == pytest.approx(np.mean(ql))
    assert parts["lq"] == pytest.approx(np.mean(lq))
    if hinge:
        assert min(rp + rn) < 0 < max(rp + rn)          # the hinge cuts something off
        rp, rn = np.maximum(rp, 0), np.maximum(rn, 0)
    assert parts["R"] == pytest.approx(0.5 * (np.mean(rp) + np.mean(rn)))
    assert loss == pytest.approx(np.mean(qz) + np.mean(ql) + np.mean(lq) + 0.3 * parts["R"])


def test_centroids_follow_eq4():
    rng = np.random.default_rng(0)
    C0 = rng.normal(size=(5, 4))
    hq = rng.normal(size=(3, 4))
    Yq = sp.csr_matrix(np.array([[1, 1, 0, 0, 0], [0, 1, 0, 1, 0], [0, 1, 0, 0, 0]], np.float32))
    C = P.update_centroids(C0.copy(), Yq, hq, 0.95)
    a = 0.95
    np.testing.assert_array_equal(C[0], a * C0[0] + (1 - a) * hq[0])       # one query: Eq. 4 as written
    np.testing.assert_array_equal(C[3], a * C0[3] + (1 - a) * hq[1])
    np.testing.assert_allclose(C[1], a * C0[1] + (1 - a) * hq.mean(0), rtol=1e-14)   # three: their mean
    np.testing.assert_array_equal(C[[2, 4]], C0[[2, 4]])                     # labels not in the batch


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fused_gelu_equals_erf_gelu_and_its_derivative(dtype):
    x = np.random.default_rng(0).normal(0, 3, (5, 3, 7)).astype(dtype)
    g, dg = P.gelu_and_grad(x)
    assert g.dtype == dg.dtype == dtype and g.shape == x.shape
    tol = 1e-12 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(g, P.gelu(x.astype(np.float64)), rtol=tol, atol=tol)
    np.testing.assert_allclose(dg, P.gelu_grad(x.astype(np.float64)), rtol=tol, atol=tol)
    x64, h = x.astype(np.float64), 1e-6         # and the derivative is the value's
    np.testing.assert_allclose(P.gelu_and_grad(x64)[1], (P.gelu(x64 + h) - P.gelu(x64 - h)) / (2 * h),
                               rtol=1e-5, atol=1e-6)


def test_permuting_the_three_tokens_leaves_the_prototype_unchanged():
    model = tiny()[0]
    T = np.random.default_rng(2).normal(size=(7, 3, 6))
    base = P.lpn_forward(model.weights, T)[0]
    for perm in ([1, 0, 2], [2, 1, 0], [1, 2, 0]):
        np.testing.assert_allclose(P.lpn_forward(model.weights, T[:, perm])[0], base, rtol=1e-12, atol=1e-13)
    assert not np.allclose(P.lpn_forward(model.weights, T[:, [0, 0, 1]])[0], base)


def test_one_adamw_step_by_hand():
    prm = P.PrimeParams(lr=0.01, weight_decay=0.1)
    rng = np.random.default_rng(0)
    w0 = {"Wq": rng.normal(size=(3, 3)), "bq": rng.normal(size=3), "V": rng.normal(size=(2, 3)),
          "ln1_g": rng.normal(size=3)}
    g1 = {k: rng.normal(size=v.shape) for k, v in w0.items()}
    g2 = {k: rng.normal(size=v.shape) for k, v in w0.items()}
    W = {k: v.copy() for k, v in w0.items()}
    state = {}
    P.adamw_step(W, g1, state, 1, prm)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for k in w0:
        decay = 1 - 0.01 * 0.1 if k == "Wq" else 1.0
        # step 1: bias-corrected moments are g and g^2
        w1 = w0[k] * decay - 0.01 * g1[k] / (np.abs(g1[k]) + eps)
        np.testing.assert_allclose(W[k], w1, rtol=1e-13)
    P.adamw_step(W, g2, state, 2, prm)
    for k in w0:
        decay = 1 - 0.01 * 0.1 if k == "Wq" else 1.0
        w1 = w0[k] * decay - 0.01 * g1[k] / (np.abs(g1[k]) + eps)
        m = (b1 * (1 - b1) * g1[k] + (1 - b1) * g2[k]) / (1 - b1 ** 2)
        v = (b2 * (1 - b2) * g1[k] ** 2 + (1 - b2) * g2[k] ** 2) / (1 - b2 ** 2)
        np.testing.assert_allclose(W[k], w1 * decay - 0.01 * m / (np.sqrt(v) + eps), rtol=1e-12)


def test_retrieval_equals_brute_force_argsort():
    rng = np.random.default_rng(0)
    hq, Z = rng.normal(size=(23, 5)), rng.normal(size=(40, 5))
    lab, sc = P.retrieve(hq, Z, 7, chunk=4)
    S = hq @ Z.T
    ref = np.argsort(-S, axis=1)[:, :7]
    np.testing.assert_array_equal(lab, ref)
    np.testing.assert_allclose(sc, np.take_along_axis(S, ref, 1))
    np.testing.assert_array_equal(P.retrieve(hq, Z, 99)[0], np.argsort(-S, axis=1))     # k > L: all


def test_rerank_weight_one_keeps_the_tree_order_and_zero_sorts_by_prime():
    rng = np.random.default_rng(0)
    cand = np.array([[4, 1, 7, 2, -1], [3, 0, 5, 6, 8]])
    tree = np.array([[0.9, 0.5, 0.5, 0.1, 0.0], [0.8, 0.8, 0.8, 0.3, 0.2]])      # tree order, with ties
    prime = rng.normal(size=cand.shape)
    np.testing.assert_array_equal(P.rerank(cand, tree, prime, 1.0)[0], cand)
    lab = P.rerank(cand, tree, prime, 0.0)[0]
    for i in range(2):
        ok = cand[i] >= 0
        np.testing.assert_array_equal(lab[i][: ok.sum()], cand[i][ok][np.argsort(-prime[i][ok])])
    assert lab[0, -1] == -1


def test_choose_weight_uses_the_given_rows_and_prefers_the_better_ranker():
    cand = np.array([[0, 1, 2], [3, 4, 5]])
    tree = np.array([[0.9, 0.5, 0.1], [0.9, 0.5, 0.1]])
    Y = sp.csr_matrix((np.ones(2), ([0, 1], [2, 5])), shape=(2, 6))           # the tree's last is right
    prime = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    w, table = P.choose_weight(cand, tree, prime, Y)
    # prime's top label wins while 0.1 w + (1 - w) > 0.9 w, i.e. w < 5/9: the largest such grid point
    assert w == 0.55 and table[w] > table[1.0] and table[0.6] == table[1.0]
    w, _ = P.choose_weight(cand, tree, -prime, Y)                             # prime never helps
    assert w == 1.0


def test_positives_follow_inverse_propensity_and_negatives_skip_true_labels():
    Yq = sp.csr_matrix(np.array([[1, 0, 1, 1, 0], [0, 1, 0, 0, 0]], np.float32))
    inv = np.array([1.0, 5.0, 2.0, 7.0, 3.0])
    pos = P.sample_positives(Yq, inv, 20000, np.random.default_rng(0))
    assert set(pos[1]) == {1}
    freq = np.bincount(pos[0], minlength=5) / pos.shape[1]
    np.testing.assert_allclose(freq, [0.1, 0, 0.2, 0.7, 0], atol=0.01)
    short = np.array([[0, 4, -1, 1], [1, 2, 3, 4]])
    neg, valid = P.sample_negatives(Yq, 5, 50, 50, np.random.default_rng(1), short)
    assert set(neg[0, :50]) <= {0, 4, -1, 1} and set(neg[1, :50]) <= {1, 2, 3, 4}
    truth = [{0, 2, 3}, {1}]
    ref = np.array([[n >= 0 and n not in truth[i] for n in row] for i, row in enumerate(neg)])
    np.testing.assert_array_equal(valid, ref)
    assert valid[0, :50].any() and valid[0, 50:].any()


def test_free_vector_clusters_group_about_two_labels():
    X, Y = random_problem(n=200, d=30, L=40, seed=0)
    from xmc_spark.kernels.label_embedding import pifa
    cl = P.free_vector_clusters(pifa(X, Y), 0)
    n = cl.max() + 1
    assert 20 <= n <= 40 and np.bincount(cl).max() <= 2


def test_in_batch_negatives_are_drawn_from_the_pool_and_skip_true_labels():
    Yq = sp.csr_matrix(np.array([[1, 0, 1, 1, 0], [0, 1, 0, 0, 0]], np.float32))
    pool = np.array([0, 0, 0, 4, 1, 1, 1, 1])               # the batch's sampled positives
    short = np.array([[2, 4], [3, 4]])
    neg, valid = P.sample_negatives(Yq, 5, 2, 20000, np.random.default_rng(2), short, pool)
    assert set(neg[:, 2:].ravel()) == {0, 1, 4}               # never a label outside the pool
    freq = np.bincount(neg[:, 2:].ravel(), minlength=5) / neg[:, 2:].size
    np.testing.assert_allclose(freq, [3 / 8, 4 / 8, 0, 0, 1 / 8], atol=0.01)
    truth = [{0, 2, 3}, {1}]
    np.testing.assert_array_equal(valid, [[n not in truth[i] for n in row] for i, row in enumerate(neg)])


def _grouped_rows(groups=4, size=16, seed=0):
    """``groups`` x ``size`` rows in shuffled order: the rows of group g are equal (feature g, label
    g), so h_q is one point per group; returns X, Y and each row's group."""
    g = np.random.default_rng(seed).permutation(np.repeat(np.arange(groups), size))
    X = sp.csr_matrix((np.ones(len(g), np.float32), (np.arange(len(g)), g)), shape=(len(g), groups))
    return X, X.copy(), g


def test_random_batches_are_a_permutation_cut_in_batch_size():
    X, Y, _ = _grouped_rows()
    model = P.init_model(X, Y, P.PrimeParams(dim=4, ffn=8, batch_size=24))
    got = P.batch_order(model, X, np.random.default_rng(5))
    perm = np.random.default_rng(5).permutation(64)
    assert [b.tolist() for b in got] == [sorted(perm[s:s + 24]) for s in (0, 24, 48)]


@pytest.mark.parametrize("batch_size", [16, 32])
def test_clustered_batches_are_whole_groups_of_similar_queries(batch_size):
    """NGAME's batches: with four groups of 16 equal queries and clusters of at most 16, every batch
    is one group (batch 16) or two whole groups (batch 32), brute force over the rows' groups;
    the batches cover every row once and change order with the generator."""
    X, Y, g = _grouped_rows()
    model = P.init_model(X, Y, P.PrimeParams(dim=4, ffn=8, batch_size=batch_size, batching="clustered",
                                             cluster_size=16))
    hq = P.encode(model, X)
    assert np.linalg.norm(hq[g == 0][0] - hq[g == 1][0]) > 0.1      # the groups are distinct points
    orders = []
    for seed in (0, 1, 2):
        batches = P.batch_order(model, X, np.random.default_rng(seed))
        assert sorted(np.concatenate(batches).tolist()) == list(range(64))
        for b in batches:
            assert len(b) == batch_size and np.bincount(g[b], minlength=4).tolist().count(16) == batch_size // 16
        orders.append([int(g[b[0]]) for b in batches])
    assert len({tuple(o) for o in orders}) > 1                         # the clusters are shuffled


@pytest.mark.parametrize("batching", P.BATCHINGS)
def test_loss_falls_and_retrieval_learns_on_a_toy(batching):
    X, Y = random_problem(n=300, d=60, L=20, seed=1)
    prm = P.PrimeParams(dim=16, ffn=32, epochs=12, batch_size=32, n_hard=3, n_random=4, lr=3e-3, seed=0,
                        batching=batching, cluster_size=8)
    short = np.argsort(-(X @ np.random.default_rng(0).normal(size=(60, 20))), axis=1)[:, :6]
    model = P.train(X, Y, prm, shortlist=short)
    assert len(model.history) == 12
    assert model.history[-1] < 0.5 * model.history[0]
    lab, _ = P.retrieve(P.encode(model, X), P.prototypes(model), 5)
    assert evaluate(lab, Y, np.ones(20))["p@1"] > 80


def test_encoder_starts_from_the_top_singular_vectors_of_pifa():
    X, Y = random_problem(n=200, d=30, L=12, seed=2)
    from xmc_spark.kernels.label_embedding import pifa
    Z = pifa(X, Y).toarray().astype(np.float64)
    E = P.pifa_svd_basis(sp.csr_matrix(Z), 16, np.random.default_rng(0), np.float64)
    k = 12                                                   # rank of PIFA (L = 12 < dim)
    np.testing.assert_allclose(E[:, :k].T @ E[:, :k], np.eye(k), atol=1e-10)
    s = np.linalg.svd(Z, compute_uv=False)
    np.testing.assert_allclose(np.linalg.norm(Z @ E[:, :5]) ** 2, np.sum(s[:5] ** 2), rtol=1e-10)
    assert np.abs(E[:, k:]).max() < 1e-2                     # beyond the rank: small noise only
    model = P.init_model(X, Y, P.PrimeParams(dim=16, ffn=8), dtype=np.float64)
    np.testing.assert_allclose(model.centroids, P.encode(model, sp.csr_matrix(Z)), atol=1e-6)


def test_a_label_without_training_rows_has_a_zero_prototype_and_finite_gradients():
    """A label no training row carries has a zero PIFA row, so h_l, its centroid and (in a cluster of
    such labels) its free vector are zero, and so is its prototype; drawn as a negative, it must
    not make the gradient overflow (l2n_backward gives a clamped, all-zero row no gradient: 200K
    synth, 4,596 of 20,000 labels without rows in a 60K-row sample, diverged in the first batch)."""
    X, Y = random_problem(n=40, d=15, L=9, seed=3)
    Y = sp.csr_matrix(Y.toarray() * (np.arange(9) != 8))             # label 8: no training row
    Y.eliminate_zeros()
    prm = P.PrimeParams(dim=6, ffn=10, n_free=4)
    model = P.init_model(X, Y, prm)                                   # float32, as trained
    model.weights["V"][model.free_of_label[8]] = 0.0                  # its cluster's vector, as in a zero cluster
    assert not P.prototypes(model)[8].any() and P.prototypes(model)[:8].any(1).all()
    rows = np.flatnonzero(np.diff(Y.indptr) > 0)[:8]
    Xq, Yq = sp.csr_matrix(X[rows], dtype=np.float32), Y[rows]
    rng = np.random.default_rng(2)
    pos = P.sample_positives(Yq, np.ones(9), 2, rng)
    neg = np.full((len(rows), 2), 8)                                  # label 8 the negative of every row
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        loss, grads, _, _ = P.batch_loss(model, Xq, Yq, pos, neg, np.ones(neg.shape, bool), None)
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in grads.values())
    # the gradient of l2n: zero on a clamped (all-zero) row, the usual formula elsewhere
    u = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    h, n = P.l2n(u)
    dh = np.array([[1.0, 2.0], [5.0, -1.0]], np.float32)
    got = P.l2n_backward(dh, h, n)
    np.testing.assert_allclose(got[0], (dh[0] - h[0] * (dh[0] @ h[0])) / 5.0, rtol=1e-6)
    assert not got[1].any() and got.dtype == np.float32
