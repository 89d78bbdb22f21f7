from math import comb

import numpy as np
import pytest
import scipy.sparse as sp

from tests.oracles import exhaustive_scores, grlr_reference
from xmc_spark.kernels.eagle import (
    Triples,
    assign,
    dedup_max,
    drift,
    expected_carriers,
    grlr_block,
    grlr_sums,
    grlr_update,
    joint_weights,
    label_prevalence,
    path_scores,
    refine_assign,
    segment_carriers,
    segment_softmax,
    top_members,
)
from xmc_spark.kernels.sparse import append_bias
from xmc_spark.model import XMCModel


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


def _head_path_steps(tr, X, T, eta):
    """GRLR by the sparse step functions the stage's head path runs one Spark job per step."""
    E = grlr_update(None, grlr_sums(tr, X, None)[0], eta)
    objs = []
    for _ in range(T):
        Gt, obj = grlr_sums(tr, X, E)
        objs.append(obj)
        E = grlr_update(E, Gt, eta)
    objs.append(grlr_sums(tr, X, E)[1])
    return E, np.vstack(objs)


def _global_ids(tr, ids):
    """``tr`` with its label positions standing for the global ids ``ids`` (ties use those)."""
    return Triples(tr.lab, tr.grp, tr.row, tr.sample_id, tr.n_lab, label_ids=ids)


@pytest.mark.parametrize("seed", range(3))
def test_grlr_block_equals_the_head_paths_steps(seed):
    # the fused per-label kernel against the head path's sparse step functions, exactly (unit
    # rows of binary features, as ingest gives bibtex's and delicious's, sum exactly in float64):
    # members shared by groups, duplicate rows, an all-zero member, x / -x groups (every member
    # tied at e_0 = 0: Figure 1), ties broken by global label ids other than the positions
    rng = np.random.default_rng(seed)
    n, d, L, G = 90, 40, 10, 40
    X = (sp.random(n, d, density=0.15, random_state=seed, format="csr") > 0).astype(np.float32)
    X = sp.vstack([X[:n - 6], X[:5], sp.csr_matrix((1, d)), -X[:3]], format="csr")   # duplicates, a zero row, negations
    norms = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
    X = sp.csr_matrix(sp.diags(1 / np.maximum(norms, 1e-12)) @ X, dtype=np.float32)
    groups = {g: sorted(rng.choice(n, int(rng.integers(1, 6)), replace=False).tolist()) for g in range(G)}
    glabels = {g: sorted(set(rng.choice(L - 2, int(rng.integers(1, 4))).tolist())) for g in range(G)}
    for i in range(5):                  # a row and its duplicate in one group: tied at every step
        groups[G + i] = [i, n - 6 + i]
        glabels[G + i] = [1, 3, 5]
    for i in range(3):                  # rows x and -x: e_0 = 0, every member tied (Figure 1)
        groups[G + 5 + i] = [i, n + i]
        glabels[G + 5 + i] = [L - 2, L - 1]
    tr = _global_ids(_triples(groups, glabels, L + 2), 7 * np.arange(L + 2) + 3)   # two labels without groups
    T, eta = 9, 0.3
    E, objs = _head_path_steps(tr, X, T, eta)
    got, got_obj = grlr_block(tr, X, T=T, eta=eta)
    assert got.shape == E.shape and got.dtype == np.float64
    assert abs(got - E).max() == 0.0
    np.testing.assert_array_equal(got_obj, objs)
    assert got[L].nnz == 0 and got[L + 1].nnz == 0
    # the x / -x labels (ids 59 and 66) take opposite members
    assert np.allclose(got[L - 2].toarray(), -got[L - 1].toarray())


def test_grlr_block_equals_the_head_paths_steps_up_to_rounding():
    # real-valued rows: the kernel adds a label's rows in triple order, the sparse product in row
    # order, so the float64 sums may round differently; the result agrees to rounding
    rng = np.random.default_rng(5)
    n, d, L, G = 200, 50, 12, 80
    X = sp.random(n, d, density=0.2, random_state=5, format="csr", data_rvs=lambda k: rng.lognormal(0, 2, k))
    norms = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
    X = sp.csr_matrix(sp.diags(1 / np.maximum(norms, 1e-12)) @ X, dtype=np.float32)
    groups = {g: sorted(rng.choice(n, 4, replace=False).tolist()) for g in range(G)}
    glabels = {g: sorted(set(rng.choice(L, 3).tolist())) for g in range(G)}
    tr = _triples(groups, glabels, L)
    E, objs = _head_path_steps(tr, X, 12, 0.1)
    got, got_obj = grlr_block(tr, X, T=12, eta=0.1)
    np.testing.assert_allclose(got.toarray(), E.toarray(), atol=1e-12)
    np.testing.assert_allclose(got_obj, objs, rtol=1e-12)


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


def test_count_one_takes_the_same_member_with_or_without_counts():
    # one group of 4, labels 3 and 6, members 0 and 1 tied on top for both: without counts the
    # arg-max takes tied position (label mod 2); a count of 1 must take the same member, so a
    # (group, label)'s member does not depend on whether other triples of its task had counts
    groups = {0: [0, 1, 2, 3]}
    bare = _triples(groups, {0: [3, 6]}, 7)
    counted = _triples(groups, {0: [3, 6]}, 7, counts={(0, 3): 1, (0, 6): 1})
    s = np.where(bare.row < 2, 1.0, 0.5)
    ref = top_members(bare, s)
    assert bare.row[ref].tolist() == [1, 0]            # label 3 -> 3 mod 2 = 1, label 6 -> 0
    np.testing.assert_array_equal(top_members(counted, s), ref)
    # a count of 2 keeps both tied members
    two = _triples(groups, {0: [3, 6]}, 7, counts={(0, 3): 2, (0, 6): 1})
    keep = top_members(two, s)
    assert sorted(two.row[keep & (two.lab == 3)].tolist()) == [0, 1]
    assert two.row[keep & (two.lab == 6)].tolist() == [0]


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


# ---- joint assignment (eagle.mode joint) -------------------------------------------------------

def _dense_sinkhorn(K, c, iters):
    """Reference: the textbook Sinkhorn-Knopp loop on one group's dense member x label matrix."""
    W = K.copy()
    r = np.full(K.shape[0], c.sum() / K.shape[0])
    W *= c / W.sum(axis=0)
    for _ in range(iters):
        W *= (r / W.sum(axis=1))[:, None]
        W *= c / W.sum(axis=0)
    return W


def _random_groups(seed):
    """Two groups (sizes 3 and 4, one shared member) with counts, and random scores."""
    rng = np.random.default_rng(seed)
    groups = {0: [0, 1, 2], 1: [2, 3, 4, 5]}
    glabels = {0: [0, 2, 3], 1: [1, 2, 4, 5, 6]}
    counts = {(g, k): int(rng.integers(1, len(groups[g]) + 1)) for g in glabels for k in glabels[g]}
    tr = _triples(groups, glabels, 7, counts=counts)
    return groups, glabels, counts, tr, rng.uniform(-1, 1, len(tr.lab))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joint_weights_equal_dense_sinkhorn_per_group(seed):
    groups, glabels, counts, tr, s = _random_groups(seed)
    tau, iters = 3.0, 7
    p, w = joint_weights(tr, s, tau, iters, weight_scale=0.8)
    for g, mem in groups.items():
        labs = glabels[g]
        K = np.zeros((len(mem), len(labs)))
        pos = {}
        for t in range(len(s)):
            if tr.grp[t] == g:
                i, j = mem.index(int(tr.row[t])), labs.index(int(tr.lab[t]))
                K[i, j] = np.exp(tau * s[t])
                pos[i, j] = t
        c = np.array([counts[g, k] for k in labs], float)
        W = _dense_sinkhorn(K, c, iters)
        for (i, j), t in pos.items():
            assert p[t] == pytest.approx(W[i, j] / c[j], rel=1e-9)
            assert w[t] == pytest.approx(min(1.0, 0.8 * W[i, j]), rel=1e-9)


def test_joint_weights_converge_to_the_margins():
    groups, glabels, counts, tr, s = _random_groups(3)
    p, _ = joint_weights(tr, s, tau=2.0, iters=400)
    c = np.array([counts[int(tr.grp[a]), int(tr.lab[a])] for a in tr.seg[:-1]], float)
    W = p * np.repeat(c, np.diff(tr.seg))
    np.testing.assert_allclose(np.add.reduceat(W, tr.seg[:-1]), c)        # each label: its count
    for g, mem in groups.items():                                        # each member: an equal share
        share = sum(counts[g, k] for k in glabels[g]) / len(mem)
        for i in mem:
            np.testing.assert_allclose(W[(tr.grp == g) & (tr.row == i)].sum(), share, rtol=1e-8)
    # tau = 0: W = c / g for every member (closed form), any number of rounds
    p0, w0 = joint_weights(tr, s, tau=0.0, iters=5)
    g = np.repeat(np.diff(tr.seg), np.diff(tr.seg))
    np.testing.assert_allclose(p0, 1.0 / g)
    np.testing.assert_allclose(w0, np.minimum(1.0, np.repeat(c, np.diff(tr.seg)) / g))


def test_joint_weights_keep_groups_apart_at_any_group_id():
    # the same members in two groups: ids 0 / 1 and 0 / 2**62 give the same weights (member keys
    # are built from dense group positions, not from the ids)
    # (2**62 x 4 members wraps to 0 in int64: a key grp * (max row + 1) + row would merge them)
    s = np.random.default_rng(5).uniform(0, 1, 16)
    mem = [0, 1, 2, 3]
    ref = joint_weights(_triples({0: mem, 1: mem}, {0: [0, 1], 1: [0, 1]}, 2), s, 10.0, 20)[0]
    big = 2 ** 62
    got = joint_weights(_triples({0: mem, big: mem}, {0: [0, 1], big: [0, 1]}, 2), s, 10.0, 20)[0]
    np.testing.assert_allclose(got, ref)


@pytest.mark.parametrize("seed", range(5))
def test_joint_assignment_at_large_tau_is_the_best_total_score(seed):
    # one group, 4 members, 4 labels of count 1: the joint top member of each label is the
    # permutation of largest total score (brute force over all 24)
    import itertools
    rng = np.random.default_rng(seed)
    S = rng.uniform(0, 1, (4, 4))                                     # S[member, label]
    tr = _triples({0: [0, 1, 2, 3]}, {0: [0, 1, 2, 3]}, 4)
    s = S[tr.row, tr.lab]
    best = max(itertools.permutations(range(4)), key=lambda pi: sum(S[pi[k], k] for k in range(4)))
    p, w = joint_weights(tr, s, tau=200.0, iters=2000)
    top = [int(tr.row[tr.seg[k] + np.argmax(p[tr.seg[k]:tr.seg[k + 1]])]) for k in range(4)]
    assert top == list(best)


def test_joint_lets_labels_compete_for_members():
    # member 0 fits both labels best, but label 1 more clearly: per-label softmax gives both to
    # member 0; the joint assignment gives label 0 to member 1 (total 0.8 + 0.5 > 0.9 + 0.1)
    X = sp.csr_matrix(np.eye(2))
    tr = _triples({0: [0, 1]}, {0: [0, 1]}, 2)
    S = np.array([[0.9, 0.8], [0.5, 0.1]])                            # S[member, label]
    s = S[tr.row, tr.lab]
    E = sp.csr_matrix(S.T)                                           # <x_i, e_k> = S[i, k]
    np.testing.assert_allclose(tr.scores(E, X), s)
    soft = segment_softmax(tr.seg, s, 30.0)[0]
    assert soft[0] > 0.99 and soft[2] > 0.99                         # (label 0, member 0), (label 1, member 0)
    p, _ = joint_weights(tr, s, 30.0, 50)
    assert p[1] > 0.9 and p[2] > 0.9                                  # label 0 -> member 1, label 1 -> member 0
    sid, lab, w = assign(tr, X, E, joint=True, tau=30.0, joint_iters=50)
    np.testing.assert_allclose(dict(zip(zip(sid.tolist(), lab.tolist()), w))[(1, 0)], p[1])


# ---- estimated carriers (eagle.estimate_counts) -----------------------------------------------

def test_label_prevalence_inverts_the_group_rate():
    # q = 1 - (1 - p)^g exactly (as counts over 10^6 groups): the estimate gives p back
    p = np.array([0.0, 1e-4, 0.02, 0.3, 0.9])
    G, g = 10 ** 6, 4.0
    q = 1 - (1 - p) ** g
    np.testing.assert_allclose(label_prevalence(q * G, G, g), p, rtol=1e-9, atol=1e-15)
    # a label in every group: q capped at 1 - 1/(2G), so the estimate stays below 1
    top = label_prevalence(np.array([10.0]), 10, 4.0)[0]
    assert top == pytest.approx(1 - 0.05 ** 0.25)


@pytest.mark.parametrize("size", [1, 2, 4, 10])
def test_expected_carriers_equal_the_binomial_mean(size):
    for p in (0.0, 0.01, 0.3, 0.7, 1.0):
        pmf = np.array([comb(size, k) * p ** k * (1 - p) ** (size - k) for k in range(size + 1)])
        ref = (np.arange(1, size + 1) * pmf[1:]).sum() / pmf[1:].sum() if p > 0 else 1.0
        assert expected_carriers(np.array([p]), np.array([size]))[0] == pytest.approx(ref, rel=1e-9)


def test_prevalence_recovers_the_rate_of_simulated_random_groups():
    # samples carry label k with probability p_k independently; random groups of 5: the
    # estimate from the groups alone is within 4 standard errors of p_k (delta method on the
    # share of groups q_k), and the simulated mean carriers of a carried label within 4
    # standard errors (the binomial's, given at least one) of expected_carriers(p_k)
    rng = np.random.default_rng(0)
    n, g, p = 50_000, 5, np.array([0.005, 0.05, 0.2, 0.5])
    G = n // g
    Y = rng.random((n, len(p))) < p
    per_group = Y.reshape(G, g, len(p)).sum(axis=1)
    carried = (per_group > 0).sum(axis=0)
    est = label_prevalence(carried, G, g)
    q = 1 - (1 - p) ** g
    se_p = np.sqrt(q * (1 - q) / G) * (1 - q) ** (1 / g - 1) / g
    assert np.all(np.abs(est - p) < 4 * se_p)
    c = expected_carriers(p, np.full(len(p), g))
    for k in range(len(p)):
        hit = per_group[per_group[:, k] > 0, k]
        pmf = np.array([comb(g, j) * p[k] ** j * (1 - p[k]) ** (g - j) for j in range(1, g + 1)])
        j = np.arange(1, g + 1)
        sd = np.sqrt((j ** 2 * pmf).sum() / pmf.sum() - c[k] ** 2)       # of carriers | carried
        assert abs(hit.mean() - c[k]) < 4 * sd / np.sqrt(len(hit))


def test_joint_weights_sum_to_the_given_carriers():
    # columns sum to the (fractional) carriers, members share their sum equally
    groups, glabels, counts, tr, s = _random_groups(4)
    rng = np.random.default_rng(9)
    size = np.diff(tr.seg)
    c = 1 + rng.random(len(size)) * (size - 1)
    p, w = joint_weights(tr, s, tau=2.0, iters=400, carriers=c)
    W = p * np.repeat(c, size)
    np.testing.assert_allclose(np.add.reduceat(W, tr.seg[:-1]), c)
    for g, mem in groups.items():
        share = c[tr.grp[tr.seg[:-1]] == g].sum() / len(mem)
        for i in mem:
            np.testing.assert_allclose(W[(tr.grp == g) & (tr.row == i)].sum(), share, rtol=1e-8)


def test_segment_carriers_keep_given_counts_and_estimate_the_rest():
    groups, glabels, counts, tr, s = _random_groups(5)
    prevalence = np.linspace(0.05, 0.6, 7)
    size = np.diff(tr.seg)
    est = expected_carriers(prevalence[tr.lab[tr.seg[:-1]]], size)
    # label 2's triples had a count, the others did not (given: a mask in input order)
    inp = [(g, k, i) for g, labels in glabels.items() for k in labels for i in groups[g]]
    mixed = Triples([k for _, k, _ in inp], [g for g, _, _ in inp], [i for _, _, i in inp], [i for _, _, i in inp],
                    7, count=[counts[g, k] if k == 2 else 1 for g, k, _ in inp], given=[k == 2 for _, k, _ in inp])
    c = segment_carriers(mixed, prevalence)
    seg_lab = mixed.lab[mixed.seg[:-1]]
    given_c = np.array([counts[int(mixed.grp[a]), int(mixed.lab[a])] for a in mixed.seg[:-1]], float)
    np.testing.assert_allclose(c, np.where(seg_lab == 2, np.clip(given_c, 1, size), est))
    assert np.all((c >= 1) & (c <= size))
    # counts without a mask are all given; no counts: every segment estimated
    np.testing.assert_allclose(segment_carriers(tr, prevalence), np.clip(
        np.array([counts[int(tr.grp[a]), int(tr.lab[a])] for a in tr.seg[:-1]], float), 1, size))
    X = sp.csr_matrix(np.random.default_rng(1).normal(size=(6, 3)))
    E = sp.csr_matrix(np.random.default_rng(2).normal(size=(7, 3)))
    bare = _triples(groups, glabels, 7)
    np.testing.assert_allclose(segment_carriers(bare, prevalence), est)
    sid, lab, w = assign(bare, X, E, joint=True, tau=3.0, prevalence=prevalence)
    ref = dedup_max(bare.sample_id, bare.lab, joint_weights(bare, bare.scores(E, X), 3.0, 20, 1.0, est)[1])[2]
    np.testing.assert_allclose(w, ref)
    # assign() on the mixed triples: the carriers of segment_carriers
    sid, lab, w = assign(mixed, X, E, joint=True, tau=3.0, prevalence=prevalence)
    ref = dedup_max(mixed.sample_id, mixed.lab, joint_weights(mixed, mixed.scores(E, X), 3.0, 20, 1.0, c)[1])[2]
    np.testing.assert_allclose(w, ref)


# ---- model-guided re-assignment (eagle.refine_rounds) -----------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_path_scores_equal_exhaustive_scoring(overlap):
    from tests.kernels.test_beam_search import _random_model
    m, X = _random_model(2, overlap=overlap)
    layers, order = m.layers()
    Xb = append_bias(sp.csr_matrix(X, dtype=np.float64), m.bias)
    E = exhaustive_scores(Xb, layers, m.index.slot_label[order], m.n_labels)
    rng = np.random.default_rng(0)
    rows, labels = rng.integers(0, X.shape[0], 300), rng.integers(0, m.n_labels, 300)
    s = path_scores(m.tree_arrays(), Xb, rows, labels)
    np.testing.assert_allclose(s, E[rows, labels], rtol=1e-4, atol=1e-30)   # the oracle is float32
    # node by node, and every node at once from the feature-major weights: the same to the bit
    by_node = path_scores(m.tree_arrays(), Xb, rows, labels, mode=1)
    every = path_scores(m.tree_arrays(), Xb, rows, labels, mode=2)
    np.testing.assert_array_equal(by_node, every)
    np.testing.assert_array_equal(s, by_node)


def test_path_scores_node_by_node_and_every_node_at_once_match_brute_force():
    # a binary tree of 64 leaves (one label each; label 64 has no slot: score 0), node columns
    # dense over 400 features, sparse leaf-level columns; rows of ~3 features (where every node at
    # once is less work), of ~200 (node by node), and an empty one
    rng = np.random.default_rng(3)
    d, L = 400, 64
    M = 2 * L - 1
    child_ptr = 1 + np.concatenate([[0], np.cumsum(np.where(np.arange(M) < L - 1, 2, 0))])  # heap order
    W = sp.csc_matrix(rng.normal(size=(d + 1, M - 1)) * 0.3)
    slot_ptr = np.concatenate([np.zeros(L, np.int64), np.arange(1, L + 1)])
    SW = sp.random(d + 1, L, density=0.02, format="csc", random_state=5, data_rvs=rng.standard_normal)
    tree = (child_ptr, W, slot_ptr, SW, np.arange(L), L + 1)
    X = sp.vstack([sp.random(40, d, density=3 / d, random_state=4), sp.random(9, d, density=0.5, random_state=6),
                   sp.csr_matrix((1, d))]).tocsr()
    Xb = append_bias(X, 1.0)
    rows = np.repeat(np.arange(50), 10)
    labels = rng.integers(0, L + 1, len(rows))
    ref = path_scores(tree, Xb, rows, labels, mode=1)
    # brute force: the product of post(w^T x) from the leaf's slot up to the root's children
    margins = (Xb @ W).toarray()

    def post(m):                                               # l3-hinge
        return np.exp(-np.maximum(0.0, 1.0 - m) ** 3)

    for t in range(len(rows)):
        i, k = rows[t], labels[t]
        if k == L:
            assert ref[t] == 0.0
            continue
        v = post((Xb[i] @ SW[:, k]).toarray()[0, 0])
        node = L - 1 + k
        while node > 0:
            v *= post(margins[i, node - 1])
            node = (node - 1) // 2
        np.testing.assert_allclose(ref[t], v, rtol=1e-12)
    np.testing.assert_array_equal(path_scores(tree, Xb, rows, labels), ref)
    np.testing.assert_array_equal(path_scores(tree, Xb, rows, labels, mode=2), ref)
    # float32 weights as the model stores them: the products are taken in float64 either way
    tree32 = (child_ptr, W.astype(np.float32), slot_ptr, SW.astype(np.float32), np.arange(L), L + 1)
    ref32 = path_scores(tree32, Xb, rows, labels, mode=1)
    np.testing.assert_array_equal(path_scores(tree32, Xb, rows, labels, mode=2), ref32)
    np.testing.assert_array_equal(path_scores(tree32, Xb, rows, labels), ref32)
    with pytest.raises(ValueError, match="columns"):
        path_scores(tree, X, rows, labels)                    # the bias column missing


def _figure1():
    x = np.array([0.6, 0.8, 0.0])
    X = sp.csr_matrix(np.array([x, -x, x, -x, x, -x]))
    groups = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    return X, _triples(groups, {g: [0, 1] for g in groups}, 2)


@pytest.mark.parametrize("soft,mix", [(False, 0.0), (False, 0.5), (True, 0.0), (True, 0.5)])
def test_one_round_on_figure1_keeps_the_correct_assignment(soft, mix):
    X, tr = _figure1()
    E, _ = grlr_block(tr, X, T=20)
    sid, lab, _ = assign(tr, X, E)
    truth = set(zip(sid.tolist(), lab.tolist()))               # each label on one side (test above)
    model = XMCModel.train_local(X, sp.csr_matrix((np.ones(len(sid)), (sid, lab)), shape=(6, 2)))
    s = path_scores(model.tree_arrays(), append_bias(X, model.bias), tr.row, tr.lab)
    p0 = segment_softmax(tr.seg, tr.scores(E, X), 30.0)[0]
    (sid2, lab2, w2), p = refine_assign(tr, s, p0, tau=10.0, mix=mix, soft=soft)
    if soft:
        assert {(i, k) for i, k, w in zip(sid2.tolist(), lab2.tolist(), w2) if w > 0.5} == truth
        np.testing.assert_allclose(w2[w2 > 0.5], 1.0)
    else:
        assert set(zip(sid2.tolist(), lab2.tolist())) == truth
    tv, changed = drift(tr, p, p0)
    assert changed == 0 and tv < 0.05 * 6                           # 6 (group, label)s, none moved


def test_reassignment_recovers_the_truth_from_a_carrier_scoring_model():
    # sample i's features are its true labels (one-hot, normalized); the model (one leaf, slot
    # k's weights 2 e_k) gives a carrier margin 2 / sqrt(#labels) >= 1 (factor 1), others 0 (e^-1)
    truth = {0: [0], 1: [1, 2], 2: [3], 3: [0, 3], 4: [1], 5: [1, 3]}
    L = 4
    X = sp.csr_matrix(np.array([np.isin(np.arange(L), t) / np.sqrt(len(t)) for t in truth.values()]))
    groups = {0: [0, 1, 2], 1: [3, 4, 5]}
    glabels = {g: sorted({k for i in mem for k in truth[i]}) for g, mem in groups.items()}
    counts = {(1, 1): 2, (1, 3): 2}                                  # two carriers each in group 1
    tr = _triples(groups, glabels, L, counts={**{(g, k): 1 for g in glabels for k in glabels[g]}, **counts})
    SW = sp.csc_matrix(np.vstack([2 * np.eye(L), np.zeros((1, L))]))    # + the bias row
    tree = (np.array([1, 1]), sp.csc_matrix((L + 1, 0)), np.array([0, L]), SW, np.arange(L), L)
    s = path_scores(tree, append_bias(X, 1.0), tr.row, tr.lab)
    carrier = np.array([k in truth[i] for i, k in zip(tr.row, tr.lab)])
    np.testing.assert_allclose(s, np.where(carrier, 1.0, np.exp(-1.0)))
    # an adversarial first assignment: 0.9 of each (group, label) on its first non-carrier
    size = np.diff(tr.seg)
    p0 = np.zeros(len(s))
    for j in range(len(size)):
        seg = np.arange(tr.seg[j], tr.seg[j + 1])
        wrong = seg[~carrier[seg]]
        p0[seg] = 0.1 / len(seg)
        if len(wrong):
            p0[wrong[0]] += 0.9
    true_pairs = {(i, k) for i, t in truth.items() for k in t}
    for mix in (0.0, 0.3):
        (sid, lab, w), p = refine_assign(tr, s, p0, tau=10.0, mix=mix, soft=False)
        assert set(zip(sid.tolist(), lab.tolist())) == true_pairs
        (sid, lab, w), p = refine_assign(tr, s, p0, tau=10.0, mix=mix, soft=True)
        assert {(i, k) for i, k, x in zip(sid.tolist(), lab.tolist(), w) if x == 1.0} == true_pairs
        assert w[w < 1].max() < (0.01 if mix == 0 else 0.9)
        # closed form: p = (1 - mix) softmax(tau s) + mix p0 on every segment
        for j in range(len(size)):
            seg = slice(tr.seg[j], tr.seg[j + 1])
            z = np.exp(10.0 * s[seg])
            np.testing.assert_allclose(p[seg], (1 - mix) * z / z.sum() + mix * p0[seg])
    # ratio weights: score / the segment's best score (several carriers keep the label fully)
    for mix in (0.0, 0.3):
        (sid, lab, w), p = refine_assign(tr, s, p0, tau=10.0, mix=mix, soft=False, weights="ratio")
        assert set(zip(sid.tolist(), lab.tolist())) == true_pairs
        (sid, lab, w), pr = refine_assign(tr, s, p0, tau=10.0, mix=mix, soft=True, weights="ratio")
        ref = (1 - mix) * np.where(carrier, 1.0, np.exp(-1.0)) + mix * np.minimum(1.0, np.repeat(size, size) * p0)
        got = dict(zip(zip(sid.tolist(), lab.tolist()), w))
        np.testing.assert_allclose([got[(i, k)] for i, k in zip(tr.sample_id.tolist(), tr.lab.tolist())], ref)
    # joint: the model's scores through joint_weights; mix 1 keeps the anchor, weight min(1, c p0)
    c = np.repeat(np.minimum(tr.count[tr.seg[:-1]], size), size)
    (sid, lab, w), pj = refine_assign(tr, s, p0, tau=10.0, mix=1.0, soft=True, joint_iters=20)
    np.testing.assert_allclose(pj, p0)
    got = dict(zip(zip(sid.tolist(), lab.tolist()), w))
    np.testing.assert_allclose([got[(i, k)] for i, k in zip(tr.sample_id.tolist(), tr.lab.tolist())],
                               np.minimum(1.0, c * p0))
    (sid, lab, w), pj = refine_assign(tr, s, p0, tau=10.0, mix=0.0, soft=True, joint_iters=20)
    np.testing.assert_allclose(pj, joint_weights(tr, s, 10.0, 20)[0])
    # given carriers (eagle.estimate_counts) replace the counts in the transport and the weight
    cr = np.minimum(1.0 + 0.5 * (np.arange(len(size)) % 3), size)
    (sid, lab, w), pj = refine_assign(tr, s, p0, tau=10.0, mix=0.0, soft=True, joint_iters=20, carriers=cr)
    np.testing.assert_allclose(pj, joint_weights(tr, s, 10.0, 20, carriers=cr)[0])
    got = dict(zip(zip(sid.tolist(), lab.tolist()), w))
    np.testing.assert_allclose([got[(i, k)] for i, k in zip(tr.sample_id.tolist(), tr.lab.tolist())],
                               np.minimum(1.0, np.repeat(cr, size) * pj))
    assert not np.allclose(pj, joint_weights(tr, s, 10.0, 20)[0])
    # the equal share per member (5/3 in group 1, whose members carry 2, 1 and 2 labels) pulls
    # some weight onto member 4, but the top-c members by p are still the carriers
    (sid, lab, w), _ = refine_assign(tr, s, p0, tau=10.0, mix=0.0, soft=False, joint_iters=20)
    assert set(zip(sid.tolist(), lab.tolist())) == true_pairs
    tv, changed = drift(tr, p, p0)
    moved = sum(len(np.arange(tr.seg[j], tr.seg[j + 1])[~carrier[tr.seg[j]:tr.seg[j + 1]]]) > 0
                for j in range(len(size)))
    assert changed == moved                     # every segment with a non-carrier changed its top member
    assert tv == pytest.approx(0.5 * np.abs(p - p0).sum())


def test_refine_bound_keeps_each_best_member_before_pairs_merge():
    """``bound`` drops light triples but a (group, label)'s best member (``floor`` and up); per
    triple, before a sample's pairs merge, so splitting the groups (as Spark's tasks do) and
    taking the largest weight per pair gives the whole set's answer. Sample 0 is group A's best
    member of label 0 at weight 0.1 * 2 * 0.55 = 0.11 and a light extra member of group B at
    0.1 * 4 * 0.3 = 0.12: it keeps 0.11 (merging first would keep 0.12 in one task, 0.11 in two)."""
    groups = {0: [0, 1], 1: [0, 2, 3, 4]}
    tr = _triples(groups, {0: [0], 1: [0]}, 1)
    want = {(0, 0): 0.55, (0, 1): 0.45, (1, 0): 0.3, (1, 2): 0.4, (1, 3): 0.2, (1, 4): 0.1}
    p0 = np.array([want[(g, i)] for g, i in zip(tr.grp.tolist(), tr.sample_id.tolist())])

    def run(t, q):
        (sid, lab, w), _ = refine_assign(t, np.zeros(len(q)), q, tau=10.0, mix=1.0, soft=True, weight_scale=0.1,
                                         bound=0.2, floor=0.0)
        return dict(zip(zip(sid.tolist(), lab.tolist()), w.tolist()))
    whole = run(tr, p0)
    assert whole == pytest.approx({(0, 0): 0.11, (2, 0): 0.16})      # the two best members, nothing else
    merged = {}
    for g in groups:                          # each group in its own task
        t = _triples({g: groups[g]}, {g: [0]}, 1)
        for key, x in run(t, np.array([want[(g, i)] for i in t.sample_id.tolist()])).items():
            merged[key] = max(merged.get(key, 0.0), x)
    assert merged == pytest.approx(whole)
    # without a bound every triple stays and a pair keeps its largest weight
    (sid, lab, w), _ = refine_assign(tr, np.zeros(len(p0)), p0, tau=10.0, mix=1.0, soft=True, weight_scale=0.1)
    assert dict(zip(zip(sid.tolist(), lab.tolist()), w.tolist()))[(0, 0)] == pytest.approx(0.12)
