"""Label frequencies (CIKM 2021, Appendix B): f, marginal and greedy f-tilde by hand, greedy
by rounds (what the Spark stage runs) equal to the direct greedy."""
import numpy as np
import pytest
import scipy.sparse as sp

from tests.oracles import f_tilde_greedy_rounds
from xmc_spark.kernels import frequencies as FQ

# contexts (rows) x labels:
#   0: {0, 1}   1: {0, 2}   2: {1}   3: {1, 2}   4: {3}   5: {0, 1, 3}
TOY = [[0, 1], [0, 2], [1], [1, 2], [3], [0, 1, 3]]


def _csr(rows):
    off = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    return off, np.concatenate([np.array(r, np.int64) for r in rows])


def test_toy_frequencies_by_hand():
    off, lab = _csr(TOY)
    f = FQ.marginal(off, lab, 5)
    np.testing.assert_array_equal(f, [3, 4, 2, 2, 0])
    # marginal f-tilde: each row to its most frequent label (1 > 0 > 2 = 3, ties to smaller id)
    #   rows 0, 2, 3, 5 -> 1; row 1 -> 0; row 4 -> 3
    np.testing.assert_array_equal(FQ.f_tilde_marginal(off, lab, f), [1, 4, 0, 1, 0])
    # greedy: label 1 covers 4 rows {0,2,3,5}; left {1: {0,2}, 4: {3}}: label 0 and 2 tie at 1
    #   -> 0 (smaller id) takes row 1; then 3 takes row 4
    np.testing.assert_array_equal(FQ.f_tilde_greedy(off, lab, 5), [1, 4, 0, 1, 0])
    p = np.array([1.0, 5.0, 1.0, 1.0, 1.0, 1.0])       # context frequencies
    # Y^T p: [7, 4, 6, 2]; greedy: 0 covers rows {0,1,5} = 7; left rows 2,3,4: 1 -> {2,3} = 2,
    #   2 -> {3} = 1, 3 -> {4} = 1: label 1 (2), then 3 (1; 2 lost row 3)
    np.testing.assert_array_equal(FQ.f_tilde_greedy(off, lab, 5, p), [7, 2, 0, 1, 0])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 12])
def test_greedy_rounds_equal_greedy(seed, k):
    rng = np.random.default_rng(seed)
    n, L = 300, 40
    Y = (rng.random((n, L)) < rng.pareto(1.0, L)[None, :] / 40).astype(int)
    Y[rng.integers(0, n, 20)] = 0                           # some unlabelled rows
    Ys = sp.csr_matrix(Y)
    p = rng.integers(1, 4, n).astype(float) if seed % 2 else None
    ref = FQ.f_tilde_greedy(Ys.indptr, Ys.indices, L, p)
    got, rounds = f_tilde_greedy_rounds(Ys.indptr, Ys.indices, L, p, k=k)
    np.testing.assert_allclose(got, ref)
    assert rounds <= (ref > 0).sum() + 1
    total = Ys.shape[0] if p is None else p.sum()
    covered = (np.asarray(Ys.sum(axis=1)).ravel() > 0)
    np.testing.assert_allclose(ref.sum(), covered.sum() if p is None else p[covered].sum())
    assert ref.sum() <= total


def test_one_round_by_hand():
    off, lab = _csr(TOY)
    selected = np.array([False, False, False, True, False])      # label 3 picked: rows 4 and 5 gone
    cand_bit = np.array([2, 1, 0, 0, 0])                         # candidates: label 1 (bit 1), label 0 (bit 2)
    m, lb, w = FQ.mask_counts(off, lab, None, selected, cand_bit)
    # row 0 {0,1} mask 3, row 1 {0,2} mask 2, rows 2 {1} and 3 {1,2} mask 1
    assert list(zip(m.tolist(), lb.tolist(), w.tolist())) == [(1, 1, 2.0), (1, 2, 1.0), (2, 0, 1.0), (2, 2, 1.0),
                                                              (3, 0, 1.0), (3, 1, 1.0)]
    out = np.zeros(5)
    done, counts = FQ.replay_round(m, lb, w, np.array([1, 0]), 5, out, selected)
    # label 1 takes rows 0, 2, 3 (3); then only row 1 is left: labels 0 and 2 tie, 0 wins; nothing left
    assert done and out.tolist() == [1, 3, 0, 0, 0] and selected.tolist() == [True, True, False, True, False]
    assert FQ.top_candidates(np.array([0.0, 2.0, 5.0, 2.0, -1.0]), 2).tolist() == [2, 1]


def test_label_frequencies_dispatch():
    off, lab = _csr(TOY)
    f, ft = FQ.label_frequencies(off, lab, 5, "greedy")
    assert f.tolist() == [3, 4, 2, 2, 0] and ft.tolist() == [1, 4, 0, 1, 0]
    with pytest.raises(ValueError, match="f_tilde must be"):
        FQ.label_frequencies(off, lab, 5, "fano")
