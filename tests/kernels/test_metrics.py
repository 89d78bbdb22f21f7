import numpy as np
import pytest
import scipy.sparse as sp

from xmc_spark.kernels.metrics import depth_sums, evaluate, finalize_depth, propensities, unseen


def test_hand_computed_metrics():
    Y = sp.csr_matrix(np.array([[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=np.float32))
    pred = np.array([[0, 1, 2], [3, 1, -1], [0, 1, 2]])
    inv = np.array([1.0, 2.0, 4.0, 8.0])
    m = evaluate(pred, Y, inv, ks=(1, 3))
    assert np.isclose(m["p@1"], 100 * (1 + 0 + 0) / 3)
    assert np.isclose(m["p@3"], 100 * (2 / 3 + 1 / 3 + 0) / 3)
    # nDCG@3 row 0: hits at ranks 1,3 -> (1 + 1/2) / (1 + 1/log2 3); row 1: hit at rank 2 -> (1/log2 3) / 1
    d = 1 / np.log2(3)
    assert np.isclose(m["ndcg@3"], 100 * ((1 + 0.5) / (1 + d) + d) / 3)
    assert np.isclose(m["recall@3"], 100 * (1 + 1) / 3)
    # PSP@1: predicted gains 1 (row 0) / ideal best gains max(1,4)=4 and 2
    assert np.isclose(m["psp@1"], 100 * 1 / (4 + 2))
    assert np.isclose(m["psp@3"], 100 * (1 + 4 + 2) / (1 + 4 + 2))


def test_propensity_formula():
    p = propensities(np.array([0, 10, 1000]), 10000, A=0.55, B=1.5)
    C = (np.log(10000) - 1) * (2.5 ** 0.55)
    np.testing.assert_allclose(p, 1 / (1 + C * np.exp(-0.55 * np.log(np.array([0, 10, 1000]) + 1.5))))
    assert np.all(np.diff(p) > 0)


def test_expected_depth():
    pred = np.array([[0, 1], [2, -1]])
    depth = np.array([1, 3, 2])
    s = depth_sums(pred, depth, ks=(1, 2))
    out = finalize_depth(s, (1, 2))
    assert out["depth@1"] == (1 + 2) / 2 and out["depth@2"] == (3 + 2) / 2


def test_propensities_padded_to_the_label_space():
    p = propensities(np.array([3, 1]), 10, n_labels=4)
    C = (np.log(10) - 1) * 2.5 ** 0.55
    np.testing.assert_allclose(p, 1 / (1 + C * np.array([4.5, 2.5, 1.5, 1.5]) ** -0.55))
    assert np.all(np.isfinite(1 / p)) and np.all(p > 0)
    # a count of 0 gives a finite propensity for any training size >= 2
    for n in (2, 3, 10, 10 ** 7):
        assert np.isfinite(propensities(np.array([0]), n)[0]) and propensities(np.array([0]), n)[0] > 0


def test_label_beyond_the_truth_width_is_not_a_hit_of_the_next_row():
    # row 0 predicts label 3 (Y has 2 columns); row 1's label 1 must not be mistaken for it
    Y = sp.csr_matrix(np.array([[1, 0], [0, 1]], dtype=np.float32))
    m = evaluate(np.array([[3], [0]]), Y, np.ones(4), ks=(1,))
    assert m["p@1"] == 0.0


def test_inv_prop_must_cover_the_labels():
    Y = sp.csr_matrix(np.array([[0, 0, 1]], dtype=np.float32))
    with pytest.raises(ValueError, match="inv_prop has 2 labels"):
        evaluate(np.array([[0]]), Y, np.ones(2), ks=(1,))


def test_unseen_labels_and_rows_against_brute_force():
    rng = np.random.default_rng(2)
    rows = [list(rng.choice(9, rng.integers(0, 4), replace=False)) for _ in range(40)]
    off = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    labels = np.array([x for r in rows for x in r], np.int64)
    seen = rng.random(6) > 0.4                              # labels 6-8 lie past it: unseen
    miss, n = unseen(off, labels, seen)
    assert list(miss) == [not (x < 6 and seen[x]) for x in labels]
    assert n == sum(any(not (x < 6 and seen[x]) for x in r) for r in rows) > 0
