"""PIFA label embeddings (kernels/label_embedding.py) by hand; block sums equal the whole."""
import numpy as np
import scipy.sparse as sp

from xmc_spark.kernels.label_embedding import label_weights, pifa, pifa_partial


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
