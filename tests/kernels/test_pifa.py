"""PIFA label embeddings (kernels/label_embedding.py) by hand; block sums equal the whole."""
import numpy as np
import scipy.sparse as sp

from xmc_spark.kernels.label_embedding import label_sums, label_weights, pifa, pifa_partial
from xmc_spark.kernels.sparse import l2_normalize_rows


def test_pifa_by_hand():
    X = sp.csr_matrix(np.array([[1.0, 0, 0], [0, 3, 4], [0, 0, 2]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 1], [1, 0], [0, 0]], np.float32))        # label 1 only on row 0
    # rows of Y normalized: row 0 -> (1/sqrt2, 1/sqrt2); label 0 = x0/sqrt2 + x1 = (0.707, 3, 4)
    r2 = 1 / np.sqrt(2)
    np.testing.assert_allclose(label_weights(Y).toarray(), [[r2, r2], [1, 0], [0, 0]], rtol=1e-6)
    z0 = np.array([r2, 3, 4]) / np.linalg.norm([r2, 3, 4])
    np.testing.assert_allclose(pifa(X, Y).toarray(), [z0, [1, 0, 0]], rtol=1e-6)
    # without normalizing Y: label 0 = x0 + x1 = (1, 3, 4)
    np.testing.assert_allclose(pifa(X, Y, normalize_y=False).toarray()[0], np.array([1, 3, 4]) / np.sqrt(26),
                               rtol=1e-6)


def test_partial_sums_over_blocks_equal_pifa():
    rng = np.random.default_rng(0)
    X = sp.random(40, 12, density=0.3, random_state=1, format="csr", dtype=np.float32)
    Y = sp.csr_matrix((rng.random((40, 6)) < 0.3).astype(np.float32))
    parts = sum(pifa_partial(X[a:a + 13], Y[a:a + 13]) for a in range(0, 40, 13))
    whole = pifa(X, Y).toarray()
    norms = np.linalg.norm(parts.toarray(), axis=1, keepdims=True)
    np.testing.assert_allclose(parts.toarray() / np.maximum(norms, 1e-12), whole, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(whole, axis=1)[Y.getnnz(axis=0) > 0], 1.0, rtol=1e-5)


def test_label_sums_by_hand():
    """Rows of labels 4, 1, 4, 7, 7 (columns unordered): label 1 = 2 e1 -> e1; label 4 = 3 e0 + 4 e2
    - 3 e0 -> its zero sum dropped, e2; label 7 = 5 e1 - 5 e1 cancels: an empty row."""
    labels = np.array([4, 1, 4, 7, 7])
    ptr = np.array([0, 2, 3, 4, 5, 6])
    idx = np.array([2, 0, 1, 0, 1, 1])
    val = np.array([4, 3, 2, -3, 5, -5], np.float32)
    uniq, p, i, v = label_sums(labels, ptr, idx, val, 3)
    np.testing.assert_array_equal(uniq, [1, 4, 7])
    np.testing.assert_array_equal(p, [0, 1, 2, 2])
    np.testing.assert_array_equal(i, [1, 2])
    np.testing.assert_array_equal(v, [1.0, 1.0])


def test_label_sums_are_the_normalized_product_bit_for_bit():
    """Against l2_normalize_rows(S @ M) (S: label-by-row 0/1): the same labels, columns and float32
    bits on rows in any column order, with sums that cancel to zero and values over 60 decades."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        d, R = int(rng.integers(1, 60)), int(rng.integers(1, 80))
        A = sp.random(R, d, density=rng.random(), format="csr", random_state=trial, dtype=np.float32)
        if trial % 3 == 0:
            A.data = np.round(A.data * 4 - 2).astype(np.float32)
        if trial % 5 == 0:
            A.data = (rng.standard_normal(A.nnz) * 10.0 ** rng.integers(-30, 30, A.nnz)).astype(np.float32)
        idx, val = A.indices.copy(), A.data.copy()
        for r in range(R):                                   # each row's columns shuffled
            a, b = A.indptr[r], A.indptr[r + 1]
            p = rng.permutation(b - a)
            idx[a:b], val[a:b] = idx[a:b][p], val[a:b][p]
        labels = rng.integers(0, R // 3 + 2, R).astype(np.int32)
        uniq, inv = np.unique(labels, return_inverse=True)
        S = sp.csr_matrix((np.ones(R, np.float32), (inv, np.arange(R))), shape=(len(uniq), R))
        Z = l2_normalize_rows((S @ sp.csr_matrix((val, idx, A.indptr), shape=(R, d))).tocsr())
        u, p, i, v = label_sums(labels, A.indptr, idx, val, d)
        np.testing.assert_array_equal(u, uniq)
        np.testing.assert_array_equal(p, Z.indptr)
        np.testing.assert_array_equal(i, Z.indices)
        np.testing.assert_array_equal(v.view(np.int32), Z.data.view(np.int32))
