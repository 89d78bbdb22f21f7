"""kNN votes: blocked top-k + merge + votes against a brute-force sort of every similarity."""
import numpy as np
import scipy.sparse as sp

from xmc_spark.kernels import knn
from xmc_spark.kernels.prime import rerank


def _data(seed=0, n=40, m=60, d=12, L=9):
    rng = np.random.default_rng(seed)
    Xa = sp.random(m, d, density=0.3, random_state=rng, format="lil")
    Xa[5] = Xa[3]                                   # duplicate rows: equal similarities, ties by id
    Xa[17] = Xa[3] * 2.0
    Xq = sp.random(n, d, density=0.3, random_state=rng, format="csr")
    Ya = sp.random(m, L, density=0.3, random_state=rng, format="csr")
    Ya.data[:] = 1.0
    return Xq.tocsr(), Xa.tocsr(), Ya.tocsr()


def _blocked_votes(Xq, Xa, Ya, kmax, k, power, cand, cut=(0, 23, 41, 60)):
    """Top-kmax per block of labelled training rows (as the stage passes them), merged by
    (similarity desc, id asc), then votes."""
    r, i, s = [], [], []
    labelled = np.asarray(Ya.sum(axis=1)).ravel() > 0
    for a, b in zip(cut[:-1], cut[1:]):
        ids = np.arange(a, b)[labelled[a:b]]
        rr, ii, ss = knn.block_topk(Xq, Xa[ids], ids, kmax)
        r.append(rr), i.append(ii), s.append(ss)
    r, i, s = np.concatenate(r), np.concatenate(i), np.concatenate(s)
    pos = knn.ranked(r, s.astype(np.float64), i, kmax)
    S, Yn = knn.neighbour_arrays(r[pos], knn.rank_in_row(r[pos]), s[pos], Ya[i[pos]], Xq.shape[0], kmax)
    return knn.votes(S, Yn, cand, k, power)


def test_blocked_votes_equal_brute_force_on_every_label():
    Xq, Xa, Ya = _data()
    assert (np.asarray(Ya.sum(axis=1)).ravel() == 0).any()         # unlabelled rows: not neighbours
    cand = np.tile(np.arange(Ya.shape[1]), (Xq.shape[0], 1))
    for k, power in ((1, 1.0), (5, 1.0), (5, 4.0), (50, 2.0)):
        got = _blocked_votes(Xq, Xa, Ya, 50, k, power, cand)
        want = knn.brute_force_votes(Xq, Xa, Ya, k, power)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_one_neighbour_votes_its_labels_and_padding_votes_zero():
    Xa = sp.csr_matrix(np.array([[1.0, 0, 0], [0, 1.0, 0], [0.9, 0.1, 0]]))
    Ya = sp.csr_matrix(np.array([[1.0, 0, 1], [0, 1, 0], [0, 1, 1]]))
    Xq = sp.csr_matrix(np.array([[1.0, 0.05, 0], [0, 0, 1.0]]))   # the second shares no feature
    cand = np.array([[0, 1, 2, -1], [0, 1, 2, -1]])
    v = _blocked_votes(Xq, Xa, Ya, 2, 1, 1.0, cand, cut=(0, 3))
    np.testing.assert_allclose(v, [[1, 0, 1, 0], [0, 0, 0, 0]])
    # two neighbours with similarities s0 > s1: label 2 (both) votes 1, label 0 s0^p / (s0^p + s1^p)
    s = (Xq[0] @ Xa.T).toarray().ravel() / np.linalg.norm(Xq[0].toarray()) / np.linalg.norm(Xa.toarray(), axis=1)
    v = _blocked_votes(Xq, Xa, Ya, 2, 2, 2.0, cand, cut=(0, 3))
    np.testing.assert_allclose(v[0, :3], [s[0] ** 2 / (s[0] ** 2 + s[2] ** 2), s[2] ** 2 / (s[0] ** 2 + s[2] ** 2), 1],
                               rtol=1e-5)


def test_ties_go_to_the_smaller_id_whatever_the_blocks():
    Xa = sp.csr_matrix(np.array([[1.0, 0], [1.0, 0], [2.0, 0], [0, 1.0]]))
    Xq = sp.csr_matrix(np.array([[1.0, 0]]))
    for cut in ((0, 4), (0, 1, 4), (0, 2, 3, 4)):
        r, i, s = [], [], []
        for a, b in zip(cut[:-1], cut[1:]):
            rr, ii, ss = knn.block_topk(Xq, Xa[a:b], np.arange(a, b), 2)
            r.append(rr), i.append(ii), s.append(ss)
        r, i, s = np.concatenate(r), np.concatenate(i), np.concatenate(s)
        pos = knn.ranked(r, s.astype(np.float64), i, 2)
        assert i[pos].tolist() == [0, 1]


def test_rerank_with_votes_at_weight_one_keeps_the_tree_order():
    cand = np.array([[3, 1, 2]])
    lab, _ = rerank(cand, np.array([[0.9, 0.5, 0.1]]), np.array([[0.0, 1.0, 1.0]]), 1.0)
    assert lab.tolist() == [[3, 1, 2]]
    lab, _ = rerank(cand, np.array([[0.9, 0.5, 0.1]]), np.array([[0.0, 1.0, 1.0]]), 0.0)
    assert lab.tolist() == [[1, 2, 3]]
