import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import linprog

from xmc_spark.kernels.balanced_kmeans import balanced_split
from xmc_spark.kernels.interpolated_split import (
    interpolated_split,
    lambda_from_prime,
    lemma1_alpha,
    node_frequencies,
    objective,
)
from xmc_spark.kernels.tree import build_tree, node_depth


def _Z(m, d=20, seed=0):
    return sp.random(m, d, density=0.4, random_state=seed, format="csr")


@pytest.mark.parametrize("m", [2, 3, 7, 50, 101])
def test_lambda0_is_balanced_and_equals_balanced_kmeans(m):
    Z = _Z(m, seed=m)
    f = np.random.default_rng(m).pareto(1.0, m) + 0.01       # frequencies must not matter at lambda 0
    pos = interpolated_split(Z, f, f[::-1], 0.0, gamma=0.1, seed=3)
    sizes = np.bincount(pos, minlength=2)
    assert sizes.sum() == m and abs(sizes[0] - sizes[1]) <= 1
    np.testing.assert_array_equal(pos, balanced_split(Z, 2, seed=3))


def _fano(freq):
    """Fano split: sort by frequency (descending, ties to the smaller index), the left side
    takes labels until its mass reaches one half (the crossing label included)."""
    order = np.lexsort((np.arange(len(freq)), -freq))
    cum = np.cumsum(freq[order]) / freq.sum()
    cut = int(np.flatnonzero(cum >= 0.5 - 1e-12)[0]) + 1
    cut = min(cut, len(freq) - 1)
    pos = np.ones(len(freq), np.int64)
    pos[order[:cut]] = 0
    return pos


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("gamma", [0.0, 0.1])
def test_lambda2_is_fano_on_f_tilde(seed, gamma):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(2, 40))
    ft = np.floor(rng.pareto(1.0, m) * 10)                   # integer counts: ties happen
    f = rng.uniform(0, 1, m)                                 # marginal f plays no role at lambda 2
    pos = interpolated_split(_Z(m, seed=seed), f, ft, 2.0, gamma=gamma, seed=seed)
    smoothed = ft / ft.sum() + gamma / m if ft.sum() > 0 else np.full(m, 1.0 / m) + gamma / m
    np.testing.assert_array_equal(pos, _fano(smoothed))


def test_fano_hand_example():
    # masses .4 .3 .2 .1: .4 < .5, .4 + .3 crosses -> left {0, 1}
    pos = interpolated_split(_Z(4), np.ones(4), np.array([4.0, 3, 2, 1]), 2.0, gamma=0.0)
    np.testing.assert_array_equal(pos, [0, 0, 1, 1])
    # one label with most of the mass is a side of its own
    pos = interpolated_split(_Z(4), np.ones(4), np.array([1.0, 8, 1, 1]), 2.0, gamma=0.0)
    np.testing.assert_array_equal(pos, [1, 0, 1, 1])


@pytest.mark.parametrize("seed", range(25))
def test_lemma1_matches_linprog(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(2, 12))
    fl = rng.uniform(0.05, 1.0, L)
    fl /= fl.sum()
    beta = rng.normal(size=L)
    alpha, _, _ = lemma1_alpha(beta / fl, fl)
    assert abs(alpha @ fl) < 1e-9 and np.all(np.abs(alpha) <= 1 + 1e-12)
    res = linprog(-beta, A_eq=fl[None, :], b_eq=[0.0], bounds=[(-1, 1)] * L, method="highs")
    assert res.status == 0
    np.testing.assert_allclose(alpha @ beta, -res.fun, rtol=1e-9, atol=1e-9)


def test_node_frequencies_endpoints():
    f = np.array([6.0, 3.0, 1.0])
    ft = np.array([8.0, 0.0, 2.0])
    np.testing.assert_allclose(node_frequencies(f, ft, 0.0, 0.1), np.full(3, 1 / 3))
    np.testing.assert_allclose(node_frequencies(f, ft, 1.0, 0.0), f / f.sum())
    np.testing.assert_allclose(node_frequencies(f, ft, 2.0, 0.0), ft / ft.sum())
    # lambda in (0, 1): f^lambda, smoothed
    lam, g = 0.5, 0.1
    fn = f / f.sum()
    num = 1.5 * fn ** lam + g / 3
    np.testing.assert_allclose(node_frequencies(f, ft, lam, g), num / num.sum())
    assert lambda_from_prime(1.0) == 1.0 and lambda_from_prime(0) == 0.0 and lambda_from_prime(np.inf) == 2.0


def test_weighted_split_puts_frequent_label_in_smaller_side():
    # lambda = 1: a label with half the mass balances all the others
    m = 21
    Z = _Z(m, seed=1)
    f = np.ones(m)
    f[5] = 20.0
    pos = interpolated_split(Z, f, f, 1.0, gamma=0.0, seed=0)
    side = pos[5]
    assert np.sum(pos == side) <= 2       # label 5 (+ at most the fractional one) vs the rest


def test_objective_does_not_decrease_from_first_iterate():
    Z = _Z(60, seed=4)
    f = np.random.default_rng(4).pareto(1.0, 60) + 0.1
    for lam in (0.5, 1.0, 1.5):
        fl = node_frequencies(f, f, lam, 0.1)
        best = interpolated_split(Z, f, f, lam, seed=2, max_iter=20)
        first = interpolated_split(Z, f, f, lam, seed=2, max_iter=1)
        from xmc_spark.kernels.interpolated_split import _centroids
        ob = objective(Z, best, _centroids(sp.csr_matrix(Z, dtype=np.float64), best, fl), fl, lam)
        of = objective(Z, first, _centroids(sp.csr_matrix(Z, dtype=np.float64), first, fl), fl, lam)
        assert ob >= of - 1e-12


def test_interpolated_tree_shortens_frequent_labels():
    rng = np.random.default_rng(0)
    L = 400
    Z = _Z(L, d=30, seed=7)
    f = np.sort(rng.pareto(1.0, L))[::-1] + 0.01
    d0 = node_depth(build_tree(Z, 10, lam=0.0, f=f, f_tilde=f), 2)
    d2 = node_depth(build_tree(Z, 10, lam=2.0, f=f, f_tilde=f), 2)
    w = f / f.sum()
    assert (w * d2).sum() < (w * d0).sum()            # expected depth under f drops
    assert d2[:5].max() < d0[:5].min()                  # the head labels sit higher


def test_deep_nodes_fall_back_to_balanced():
    L = 300
    Z = _Z(L, seed=3)
    f = 2.0 ** -np.arange(L)                            # a Fano chain: one label per level
    leaf = build_tree(Z, 4, lam=2.0, f=f, f_tilde=f, gamma=0.0, balanced_below_depth=6)
    assert node_depth(leaf, 2).max() <= 6 + int(np.ceil(np.log2(L / 4))) + 1
    _, counts = np.unique(leaf, return_counts=True)
    assert counts.max() <= 4

