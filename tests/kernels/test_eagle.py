import numpy as np
import pytest
import scipy.sparse as sp

from tests.oracles import grlr_reference
from xmc_spark.kernels.eagle import Triples, assign, grlr_block


def _triples(groups, group_labels, n_labels, counts=None):
    """Triples from {group: [rows]} and {group: [labels]} (row = sample id here)."""
    lab, grp, row = [], [], []
    cnt = []
    for g, labels in group_labels.items():
        for k in labels:
            for i in groups[g]:
                lab.append(k)
                grp.append(g)
                row.append(i)
                cnt.append((counts or {}).get((g, k), 1))
    return Triples(lab, grp, row, row, n_labels, count=cnt if counts else None)


def test_figure1_toy_example():
    # groups {s1, s2}, {s3, s4}, {s5, s6}; odd samples x, even samples -x; both labels on every group
    x = np.array([0.6, 0.8, 0.0])
    X = sp.csr_matrix(np.array([x, -x, x, -x, x, -x]))
    groups = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    glabels = {g: [0, 1] for g in groups}
    tr = _triples(groups, glabels, 2)
    # baseline / Parabel embedding (EAGLE-0's e_0): the sum over the groups is zero
    E0, _ = grlr_block(tr, X, T=0)
    assert E0.nnz == 0 or np.allclose(E0.toarray(), 0)
    E, obj = grlr_block(tr, X, T=20)
    e = E.toarray()
    np.testing.assert_allclose(np.abs(e @ x), 1.0, atol=1e-12)         # +-x
    np.testing.assert_allclose(e[0], -e[1], atol=1e-12)                # and opposite for the two labels
    sid, lab, w = assign(tr, X, E)
    got = {(int(s), int(k)) for s, k in zip(sid, lab)}
    pos = 0 if e[0] @ x > 0 else 1                                      # the label that took +x
    assert got == {(i, pos) for i in (0, 2, 4)} | {(i, 1 - pos) for i in (1, 3, 5)}
    assert obj[-1].sum() == pytest.approx(6.0)                          # every group matched perfectly


@pytest.mark.parametrize("seed", range(4))
def test_grlr_block_equals_algorithm1(seed):
    rng = np.random.default_rng(seed)
    n, d, L, G = 120, 30, 12, 30
    X = sp.random(n, d, density=0.25, random_state=seed, format="csr")
    X = sp.csr_matrix(X.multiply(1 / np.maximum(np.sqrt(X.multiply(X).sum(axis=1)), 1e-12)))
    perm = rng.permutation(n)
    groups = {g: sorted(perm[g * 4:(g + 1) * 4].tolist()) for g in range(G)}
    # skewed labels: label 0 on every group, label 1 on most, the rest rare
    glabels = {g: sorted({0} | ({1} if rng.random() < 0.8 else set()) | set(rng.choice(L, 2).tolist()))
               for g in range(G)}
    tr = _triples(groups, glabels, L)
    E, obj = grlr_block(tr, X, T=7, eta=0.1)
    label_groups = {k: [g for g in range(G) if k in glabels[g]] for k in range(L)}
    Xd = X.toarray()
    for k in range(L):
        if not label_groups[k]:
            assert E[k].nnz == 0
            continue
        ref = grlr_reference(Xd, groups, label_groups, k, T=7, eta=0.1)
        np.testing.assert_allclose(E[k].toarray().ravel(), ref, atol=1e-9)
    assert obj.shape == (8, L)


def test_hard_assignment_and_counts():
    # group 0 = rows {0, 1, 2}; label embeddings point at row 2 (label 0) and row 0 (label 1)
    X = sp.csr_matrix(np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [0.8, 0.6, 0]]))
    E = sp.csr_matrix(np.array([[0, 0.1, 0.9], [0.9, 0.3, 0.0]]))
    groups = {0: [0, 1, 2], 1: [1, 3]}
    glabels = {0: [0, 1], 1: [1]}
    tr = _triples(groups, glabels, 2)
    sid, lab, w = assign(tr, X, E)
    assert sorted(zip(sid.tolist(), lab.tolist())) == [(0, 1), (2, 0), (3, 1)]
    # a count of 2 for (group 0, label 0): its two best members, rows 2 then 1
    tr = _triples(groups, glabels, 2, counts={(0, 0): 2})
    sid, lab, w = assign(tr, X, E)
    assert sorted(zip(sid.tolist(), lab.tolist())) == [(0, 1), (1, 0), (2, 0), (3, 1)]


def test_soft_assignment_weights():
    X = sp.csr_matrix(np.array([[1.0, 0], [0, 1.0]]))
    E = sp.csr_matrix(np.array([[1.0, 0.0]]))
    tr = _triples({0: [0, 1]}, {0: [0]}, 1)
    # tau = 0: softmax uniform, g * 1/g = 1 -> every member keeps the label with weight 1 (baseline)
    sid, lab, w = assign(tr, X, E, soft=True, tau=0.0)
    np.testing.assert_allclose(w, [1.0, 1.0])
    # tau = 2: scores 1 and 0 -> weights min(1, 2 e^2 / (e^2 + 1)) = 1 and 2 / (e^2 + 1)
    sid, lab, w = assign(tr, X, E, soft=True, tau=2.0)
    np.testing.assert_allclose(w, [1.0, 2 / (np.exp(2) + 1)])
    # weight_scale 0.5 halves them before the cap
    sid, lab, w = assign(tr, X, E, soft=True, tau=2.0, weight_scale=0.5)
    np.testing.assert_allclose(w, [min(1, np.exp(2) / (np.exp(2) + 1)), 1 / (np.exp(2) + 1)])
    # large tau approaches the hard assignment
    sid, lab, w = assign(tr, X, E, soft=True, tau=200.0)
    np.testing.assert_allclose(w, [1.0, 0.0], atol=1e-12)


def test_sample_in_two_groups_keeps_largest_weight():
    X = sp.csr_matrix(np.array([[1.0, 0], [0, 1.0], [0.6, 0.8]]))
    E = sp.csr_matrix(np.array([[1.0, 0.0]]))
    tr = _triples({0: [0, 1], 1: [1, 2]}, {0: [0], 1: [0]}, 1)
    sid, lab, w = assign(tr, X, E, soft=True, tau=1.0)
    assert sid.tolist() == [0, 1, 2]                       # row 1 once, although in both groups
    s_g1 = np.exp(np.array([0.0, 0.6]))
    np.testing.assert_allclose(w[1], max(2 * np.exp(0) / (np.exp(1) + 1), 2 * s_g1[0] / s_g1.sum()))
