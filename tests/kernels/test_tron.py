"""Trust-region Newton over many classifiers: its oracle pieces against brute-force numpy, its
optimum against the dual coordinate descent kernel's."""
import numpy as np
import pytest
import scipy.sparse as sp

from xmc_spark.kernels import tron
from xmc_spark.kernels.sparse import append_bias
from xmc_spark.kernels.squared_hinge import train_node


def weighted_problem(n=300, d=50, K=4, seed=0, bias=0.7):
    """(X with bias column, Y with label weights as values, per-sample weights)."""
    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.15, random_state=seed, format="csr", dtype=np.float32)
    # labels tied to a few features each, so the classifiers learn something
    owner = rng.integers(0, K, d)
    score = np.asarray(X @ np.eye(K)[owner]) + rng.normal(0, 0.05, (n, K))
    pos = score > np.quantile(score, 0.8, axis=0)
    Y = sp.csr_matrix(pos * rng.uniform(0.2, 1.0, (n, K)), dtype=np.float32)
    return append_bias(X, bias), Y, rng.uniform(0.3, 2.0, n)


def brute_costs(Y, weights, C):
    """(signs n x K, costs n x K) written out entry by entry."""
    Yd = Y.toarray()
    n, K = Yd.shape
    S, Cm = -np.ones((n, K)), np.zeros((n, K))
    for i in range(n):
        for k in range(K):
            Cm[i, k] = C * weights[i]
            if Yd[i, k] != 0:
                S[i, k] = 1.0
                Cm[i, k] *= Yd[i, k]
    return S, Cm


def brute_objective(X, S, Cm, W):
    Xd = X.toarray().astype(np.float64)
    f = np.zeros(W.shape[1])
    for k in range(W.shape[1]):
        f[k] = 0.5 * W[:, k] @ W[:, k]
        for i in range(Xd.shape[0]):
            f[k] += Cm[i, k] * max(0.0, 1.0 - S[i, k] * (Xd[i] @ W[:, k])) ** 2
    return f


def brute_hessian(X, S, Cm, w, k):
    Xd = X.toarray().astype(np.float64)
    H = np.eye(Xd.shape[1])
    for i in range(Xd.shape[0]):
        if 1.0 - S[i, k] * (Xd[i] @ w) > 0:
            H += 2.0 * Cm[i, k] * np.outer(Xd[i], Xd[i])
    return H


@pytest.fixture(scope="module")
def prob():
    X, Y, sw = weighted_problem()
    return X, Y, sw, 1.3


def test_objective_gradient_hessian_against_brute_force(prob):
    X, Y, sw, C = prob
    d, K = X.shape[1], Y.shape[1]
    fun_grad, hess_vec = tron.local_oracle(tron.node_rows(X, Y, C, sw), [0, K])
    S, Cm = brute_costs(Y, sw, C)
    rng = np.random.default_rng(1)
    W = rng.normal(0, 0.5, (d, K))
    cols = np.arange(K)
    f, G = fun_grad(W, cols)
    np.testing.assert_allclose(f, brute_objective(X, S, Cm, W), rtol=1e-10)
    h = 1e-6
    for j in rng.choice(d, 8, replace=False):        # central differences of the brute objective
        E = np.zeros_like(W)
        E[j] = h
        fd = (brute_objective(X, S, Cm, W + E) - brute_objective(X, S, Cm, W - E)) / (2 * h)
        np.testing.assert_allclose(G[j], fd, rtol=1e-5, atol=1e-6)
    V = rng.normal(0, 1, (d, K))
    HV = hess_vec(W, V, cols)
    for k in range(K):
        np.testing.assert_allclose(HV[:, k], brute_hessian(X, S, Cm, W[:, k], k) @ V[:, k], rtol=1e-10)
    # the generalized Hessian is the gradient's derivative wherever the active set does not change
    t = 1e-7
    Gp, Gm = fun_grad(W + t * V, cols)[1], fun_grad(W - t * V, cols)[1]
    np.testing.assert_allclose((Gp - Gm) / (2 * t), HV, rtol=1e-4, atol=1e-4)
    # the loss part of the Hessian's diagonal (the preconditioner's), from the same pass
    f3, G3, L = fun_grad(W, cols, True)
    np.testing.assert_array_equal(f3, f)
    np.testing.assert_array_equal(G3, G)
    for k in range(K):
        np.testing.assert_allclose(L[:, k], np.diag(brute_hessian(X, S, Cm, W[:, k], k)) - 1.0, rtol=1e-10)
    # a subset of classifiers gives those columns
    sub = np.array([2, 0])
    f2, G2 = fun_grad(W[:, sub], sub)
    np.testing.assert_allclose(f2, f[sub])
    np.testing.assert_allclose(G2, G[:, sub])
    np.testing.assert_allclose(hess_vec(W[:, sub], V[:, sub], sub), HV[:, sub])


def test_partial_sums_over_a_split_add_up(prob):
    X, Y, sw, C = prob
    K = Y.shape[1]
    whole = tron.node_rows(X, Y, C, sw)
    rng = np.random.default_rng(2)
    W, V = rng.normal(0, 0.5, (X.shape[1], K)), rng.normal(0, 1, (X.shape[1], K))
    cols = np.arange(K)
    part_of = rng.integers(0, 3, X.shape[0])
    parts = [tron.node_rows(X[part_of == p], Y[part_of == p], C, sw[part_of == p]) for p in range(3)]
    loss, G = tron.partial_fun_grad(whole, [0, K], W, cols)
    sums = [tron.partial_fun_grad(p, [0, K], W, cols) for p in parts]
    np.testing.assert_allclose(sum(s[0] for s in sums), loss, rtol=1e-12)
    np.testing.assert_allclose(sum(s[1] for s in sums), G, rtol=1e-10, atol=1e-12)
    Ld = tron.partial_fun_grad(whole, [0, K], W, cols, diag=True)[2]
    np.testing.assert_allclose(sum(tron.partial_fun_grad(p, [0, K], W, cols, diag=True)[2] for p in parts), Ld,
                               rtol=1e-10, atol=1e-12)
    assert np.abs(Ld).max() > 0
    HV = tron.partial_hess_vec(whole, [0, K], W, V, cols)
    np.testing.assert_allclose(sum(tron.partial_hess_vec(p, [0, K], W, V, cols) for p in parts), HV,
                               rtol=1e-10, atol=1e-12)
    assert np.abs(G).max() > 0 and np.abs(HV).max() > 0
    # accumulated in place (out=), as the Spark oracle sums its packed blocks
    acc_loss, acc_G, acc_HV = np.zeros(K), np.zeros_like(G), np.zeros_like(HV)
    for p in parts:
        assert tron.partial_fun_grad(p, [0, K], W, cols, out=(acc_loss, acc_G))[1] is acc_G
        tron.partial_hess_vec(p, [0, K], W, V, cols, out=acc_HV)
    np.testing.assert_allclose(acc_loss, loss, rtol=1e-12)
    np.testing.assert_allclose(acc_G, G, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(acc_HV, HV, rtol=1e-10, atol=1e-12)


def test_reaches_the_dual_kernels_optimum(prob):
    X, Y, sw, C = prob
    d, K = X.shape[1], Y.shape[1]
    fun_grad, hess_vec = tron.local_oracle(tron.node_rows(X, Y, C, sw), [0, K])
    ref = train_node(X, Y, C=C, weights=sw, threshold=0, eps=1e-4, max_iter=10000).toarray()
    S, Cm = brute_costs(Y, sw, C)
    f_ref = brute_objective(X, S, Cm, ref)
    # LIBLINEAR's scaling of the default 0.01 by the smaller class, a tight uniform eps
    scaled = tron.liblinear_eps(0.01, np.asarray((Y != 0).sum(axis=0)).ravel(), X.shape[0])
    for eps, gap, pcg in ((scaled, 1e-3, 0.0), (1e-6, 1e-6, 0.0), (scaled, 1e-3, 0.01), (1e-6, 1e-6, 1.0)):
        W, info = tron.tron(fun_grad, hess_vec, d, K, eps=eps, max_iter=100, pcg=pcg)
        assert info.converged.all() and (info.steps < 100).all()
        rel = (brute_objective(X, S, Cm, W) - f_ref) / f_ref
        assert np.all(rel <= gap), (eps, pcg, rel)
        assert np.all(rel >= -1e-6), (eps, pcg, rel)       # the DCD run is (near) optimal itself
    big = np.abs(ref) > 1e-3
    assert big.sum() > K * 10
    np.testing.assert_array_equal(np.sign(W[big]), np.sign(ref[big]))
    np.testing.assert_allclose(W, ref, atol=1e-3)


@pytest.mark.parametrize("pcg", [0.0, 0.01, 1.0])
def test_one_cg_solve_against_the_newton_step_and_the_boundary(prob, pcg):
    """One (preconditioned) Steihaug CG at a random w against closed forms on the brute-force
    Hessian: with a wide trust region and a tight tolerance it returns the Newton step -H^-1 g and
    R = -g - H s; with a small region, a step on its boundary, ||s||_M = delta with M = (1 - a) I
    + a diag(H) (the identity without preconditioning)."""
    X, Y, sw, C = prob
    d, K = X.shape[1], Y.shape[1]
    fun_grad, hess_vec = tron.local_oracle(tron.node_rows(X, Y, C, sw), [0, K])
    S_, Cm = brute_costs(Y, sw, C)
    W = np.random.default_rng(3).normal(0, 0.3, (d, K))
    cols = np.arange(K)
    space = tron.NumpySpace(fun_grad, hess_vec, d, K)
    space.combine({"W": []}, cols)
    space.v["W"] = W.copy()
    pre = ("M", pcg) if pcg else None
    space.fun_grad([(1.0, "W")], "G", cols, precond=pre)
    G = space.v["G"]
    H = [brute_hessian(X, S_, Cm, W[:, k], k) for k in range(K)]
    M = np.stack([(1 - pcg) + pcg * np.diag(h) for h in H], axis=1)
    if pcg:
        np.testing.assert_allclose(space.v["M"], M, rtol=1e-10)
    zr = np.einsum("ij,ij->j", G, G / M)
    boundary, steps = tron._trcg(space, cols, zr, np.full(K, 1e9), 1e-10, 500, bool(pcg))
    assert not boundary.any() and (steps > 1).all()
    for k in range(K):
        newton = -np.linalg.solve(H[k], G[:, k])
        np.testing.assert_allclose(space.v["S"][:, k], newton, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(space.v["R"][:, k], -G[:, k] - H[k] @ space.v["S"][:, k], atol=1e-6)
    delta = 0.2 * np.sqrt(np.einsum("ij,ij->j", space.v["S"], M * space.v["S"]))
    boundary, _ = tron._trcg(space, cols, zr, delta, 1e-10, 500, bool(pcg))
    assert boundary.all()
    np.testing.assert_allclose(np.sqrt(np.einsum("ij,ij->j", space.v["S"], M * space.v["S"])), delta, rtol=1e-9)


@pytest.mark.parametrize("pcg", [0.0, 0.5])
def test_classifiers_out_of_step_take_their_own_iterates(prob, pcg):
    """The loop does not keep classifiers in step (each pass gives every running classifier its
    next operation), so each must end where it ends solved alone, with the same steps, and the
    passes are 1 + the largest classifier's own count of CG and trust-region steps. With a mixed
    oracle (gradient and Hessian products in one call), the same."""
    X, Y, sw, C = prob
    d, K = X.shape[1], Y.shape[1]
    eps = tron.liblinear_eps(0.001, np.asarray((Y != 0).sum(axis=0)).ravel(), X.shape[0])
    fun_grad, hess_vec = tron.local_oracle(tron.node_rows(X, Y, C, sw), [0, K])
    calls = []

    def mixed(Wf, cf, diag, Wh, Vh, ch):
        calls.append((len(cf), len(ch)))
        return fun_grad(Wf, cf, diag), hess_vec(Wh, Vh, ch)
    W, info = tron.tron(fun_grad, hess_vec, d, K, eps=eps, pcg=pcg)
    W2, info2 = tron.tron(fun_grad, hess_vec, d, K, eps=eps, pcg=pcg, mixed=mixed)
    np.testing.assert_array_equal(W2, W)
    assert calls and info2.passes == info.passes
    assert info.passes == 1 + (info.steps + info.cg_steps).max()
    assert len(set(info.steps + info.cg_steps)) > 1               # not all alike: some waited for others
    for k in range(K):
        one = tron.local_oracle(tron.node_rows(X, Y[:, [k]], C, sw), [0, 1])
        Wk, ik = tron.tron(*one, d, 1, eps=eps[k], pcg=pcg)
        np.testing.assert_allclose(W[:, k], Wk[:, 0], rtol=1e-9, atol=1e-12)
        assert (ik.steps[0], ik.cg_steps[0]) == (info.steps[k], info.cg_steps[k])


def test_one_pass_for_both_requests_equals_each_alone():
    """Gradients of some classifiers and Hessian products of others in one pass over rows of two
    nodes interleaved (each request spanning both nodes): the same sums, to the bit, as the two
    requests made apart; brute force checks each alone (above)."""
    X1, Y1, w1 = weighted_problem(n=200, d=30, K=3, seed=3, bias=1.0)
    X2, Y2, w2 = weighted_problem(n=150, d=30, K=3, seed=4, bias=1.0)
    node_ptr = np.array([0, 3, 6])
    order = np.random.default_rng(5).permutation(350)
    rows = tron.RowBlock(sp.vstack([X1, X2], format="csr")[order], np.repeat([0, 1], [200, 150])[order],
                         np.r_[w1, w2][order], sp.block_diag([Y1, Y2], format="csr")[order])
    rng = np.random.default_rng(0)
    W, V = rng.normal(0, 0.3, (31, 6)), rng.normal(0, 1, (31, 6))
    cf, ch = np.array([0, 4, 5]), np.array([1, 2, 3])
    (loss, G, L), HV = tron.partial_pass(rows, node_ptr, W[:, cf], cf, W[:, ch], V[:, ch], ch, diag=True)
    alone = tron.partial_fun_grad(rows, node_ptr, W[:, cf], cf, diag=True)
    for a, b in zip((loss, G, L), alone):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(HV, tron.partial_hess_vec(rows, node_ptr, W[:, ch], V[:, ch], ch))
    assert np.abs(HV).sum(axis=0).min() > 0 and np.abs(G).sum(axis=0).min() > 0


def _liblinear_tron(fg, hv, d, eps, max_iter, a):
    """One classifier by LIBLINEAR 2.2x's TRON (tron.cpp: trpcg with the diagonal preconditioner
    when a > 0), written out on dense vectors: (w, trust-region steps, CG steps, rejected steps)."""
    w = np.zeros(d)
    f, g, L = fg(w)
    M = 1.0 + a * L
    gnorm0 = gnorm = np.linalg.norm(g)
    delta = np.sqrt(g @ (M * g))
    steps = cg = rejected = 0
    adjusted = False
    while True:
        s, r = np.zeros(d), -g
        z = r / M
        dv, zr = z.copy(), z @ r
        cgtol, boundary, n = 0.1 * np.sqrt(zr), False, 0
        while np.sqrt(zr) > cgtol and n < max(d, 5):
            n += 1
            Hd = hv(w, dv)
            alpha = zr / (dv @ Hd)
            if np.sqrt((s + alpha * dv) @ (M * (s + alpha * dv))) > delta:
                boundary = True
                sd, ss, dd = s @ (M * dv), s @ (M * s), dv @ (M * dv)
                rad = np.sqrt(sd * sd + dd * (delta ** 2 - ss))
                tau = (delta ** 2 - ss) / (sd + rad) if sd >= 0 else (rad - sd) / dd
                s, r = s + tau * dv, r - tau * Hd
                break
            s, r = s + alpha * dv, r - alpha * Hd
            z = r / M
            beta = (z @ r) / zr
            dv, zr = z + beta * dv, z @ r
        cg += n
        fn, gn, Ln = fg(w + s)
        gs = g @ s
        prered, actred, snorm = -0.5 * (gs - s @ r), f - fn, np.sqrt(s @ (M * s))
        if not adjusted:
            delta, adjusted = min(delta, snorm), True
        alpha = tron.SIGMA3 if fn - f - gs <= 0 else max(tron.SIGMA1, -0.5 * gs / (fn - f - gs))
        if actred < tron.ETA0 * prered:
            delta = min(alpha * snorm, tron.SIGMA2 * delta)
        elif actred < tron.ETA1 * prered:
            delta = max(tron.SIGMA1 * delta, min(alpha * snorm, tron.SIGMA2 * delta))
        elif actred < tron.ETA2 * prered:
            delta = max(tron.SIGMA1 * delta, min(alpha * snorm, tron.SIGMA3 * delta))
        else:
            delta = tron.SIGMA3 * delta if boundary else max(delta, min(alpha * snorm, tron.SIGMA3 * delta))
        steps += 1
        if actred > tron.ETA0 * prered:
            w, f, g, M = w + s, fn, gn, 1.0 + a * Ln
            gnorm = np.linalg.norm(g)
        else:
            rejected += 1
        if gnorm <= eps * gnorm0 or steps >= max_iter or prered <= 0 or (
                abs(actred) <= 1e-12 * abs(f) and abs(prered) <= 1e-12 * abs(f)):
            return w, steps, cg, rejected


@pytest.mark.parametrize("pcg", [0.0, 0.5])
def test_each_classifier_follows_liblinears_tron(pcg):
    """A steep smooth objective (quartic, so that trust-region steps get rejected and the radius
    shrinks), K classifiers in one out-of-step loop against LIBLINEAR's TRON written out for one
    classifier: the same trust-region and CG step counts and the same w."""
    rng = np.random.default_rng(7)
    n, d, K = 60, 12, 4
    X, C = rng.normal(0, 1, (n, d)), rng.uniform(1, 8, (n, K))
    B = X.T @ (np.sign(rng.normal(0, 1, (n, K))) * C)

    def one(k):
        def fg(w):
            z = X @ w
            return (0.5 * w @ w + 0.01 * C[:, k] @ z ** 4 - B[:, k] @ w, w + 0.04 * X.T @ (C[:, k] * z ** 3) - B[:, k],
                    0.12 * (X ** 2).T @ (C[:, k] * z ** 2))
        return fg, lambda w, v: v + 0.12 * X.T @ (C[:, k] * (X @ w) ** 2 * (X @ v))

    def fun_grad(W, cols, diag=False):
        out = [one(k)[0](W[:, j]) for j, k in enumerate(cols)]
        f, G, L = np.array([o[0] for o in out]), np.stack([o[1] for o in out], 1), np.stack([o[2] for o in out], 1)
        return (f, G, L) if diag else (f, G)

    def hess_vec(W, V, cols):
        return np.stack([one(k)[1](W[:, j], V[:, j]) for j, k in enumerate(cols)], 1)
    eps = np.array([1e-2, 1e-4, 1e-6, 1e-3])
    W, info = tron.tron(fun_grad, hess_vec, d, K, eps=eps, max_iter=30, pcg=pcg)
    rejected = 0
    for k in range(K):
        w, steps, cg, rej = _liblinear_tron(*one(k), d, eps[k], 30, pcg)
        rejected += rej
        assert (info.steps[k], info.cg_steps[k]) == (steps, cg), k
        np.testing.assert_allclose(W[:, k], w, rtol=1e-7, atol=1e-10)
    assert rejected > 0


def test_nodes_mixed_in_one_block_are_solved_apart():
    """Rows of two nodes interleaved: each node's classifiers see only its rows."""
    X1, Y1, w1 = weighted_problem(n=200, d=30, K=2, seed=3, bias=1.0)
    X2, Y2, w2 = weighted_problem(n=150, d=30, K=3, seed=4, bias=1.0)
    node_ptr = np.array([0, 2, 5])
    n1, n2 = X1.shape[0], X2.shape[0]
    P = sp.block_diag([Y1, Y2], format="csr")                       # node 2's labels are columns 2..4
    order = np.random.default_rng(5).permutation(n1 + n2)
    rows = tron.RowBlock(sp.vstack([X1, X2], format="csr")[order], np.r_[np.zeros(n1), np.ones(n2)][order].astype(int),
                         np.r_[w1, w2][order], P[order])
    W, info = tron.tron(*tron.local_oracle(rows, node_ptr), 31, 5, eps=1e-6, max_iter=100)
    for (X, Y, w), c in (((X1, Y1, w1), slice(0, 2)), ((X2, Y2, w2), slice(2, 5))):
        ref = train_node(X, Y, weights=w, threshold=0, eps=1e-5, max_iter=10000).toarray()
        np.testing.assert_allclose(W[:, c], ref, atol=2e-4)


def test_liblinear_eps_scales_by_the_smaller_class():
    np.testing.assert_allclose(tron.liblinear_eps(0.01, [10, 900, 0, 500], 1000), [1e-4, 1e-3, 1e-5, 5e-3])
    np.testing.assert_allclose(tron.liblinear_eps(0.1, [3, 0], [4, 0]), [0.025, 0.1])   # no rows: eps itself


def test_prune_like_the_kernel():
    W = np.array([[0.5, -0.05], [-0.1, 0.0], [0.09999, 2.0]])
    P = tron.prune(W, 0.1)
    np.testing.assert_array_equal(P.toarray(), np.array([[0.5, 0], [-0.1, 0], [0, 2.0]], np.float32))
    assert P.dtype == np.float32 and P.indices.dtype == np.int32
    assert tron.prune(W, 0.0).nnz == 5


def test_zero_gradient_and_bad_arguments():
    X = sp.csr_matrix(np.ones((3, 2), np.float32))
    fun_grad, hess_vec = tron.local_oracle(tron.node_rows(X, sp.csr_matrix((3, 1)), weights=np.zeros(3)), [0, 1])
    W, info = tron.tron(fun_grad, hess_vec, 2, 1)                   # zero cost: w = 0 is optimal
    assert not W.any() and info.fun_grad_calls == 1 and info.hess_vec_calls == 0
    with pytest.raises(ValueError, match="eps"):
        tron.tron(fun_grad, hess_vec, 2, 1, eps=0)
    with pytest.raises(ValueError, match="pcg"):
        tron.tron(fun_grad, hess_vec, 2, 1, pcg=1.5)
    with pytest.raises(ValueError, match="RowBlock"):
        tron.RowBlock(X, np.zeros(2, int), np.ones(3), sp.csr_matrix((3, 1)))
