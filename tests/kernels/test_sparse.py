import numpy as np
import pyarrow as pa
import scipy.sparse as sp

from xmc_spark.kernels.sparse import csr_from_lists, l2_normalize_rows, normalize_lists


def test_normalize_lists_by_hand():
    got = normalize_lists([0, 2, 2, 5, 6], np.array([3, 4, 1, 2, 2, 0], np.float32))
    np.testing.assert_allclose(got, [0.6, 0.8, 1 / 3, 2 / 3, 2 / 3, 0.0], rtol=1e-7)   # empty and zero rows stay
    assert got.dtype == np.float32
    assert normalize_lists([0, 1], np.array([-2.0])).tolist() == [-1.0]                  # float64 stays float64


def test_normalize_lists_on_a_sliced_arrow_list():
    arr = pa.array([[9.0], [3.0, 4.0], [5.0, 12.0]], pa.list_(pa.float32())).slice(1)   # offsets start at 1
    off = np.asarray(arr.offsets)
    vals = arr.values.to_numpy()[off[0]:off[-1]]
    np.testing.assert_allclose(normalize_lists(off, vals), [0.6, 0.8, 5 / 13, 12 / 13], rtol=1e-7)


def test_l2_normalize_rows_sums_repeated_indices_first():
    m = sp.csr_matrix((np.array([3.0, 1.0, 3.0]), np.array([1, 0, 1]), np.array([0, 3, 3])), shape=(2, 2))
    got = l2_normalize_rows(m)                               # row 0 is (1, 6): norm sqrt(37)
    np.testing.assert_allclose(got.toarray(), [[1 / np.sqrt(37), 6 / np.sqrt(37)], [0, 0]], rtol=1e-6)
    assert got.dtype == np.float32 and l2_normalize_rows(m, np.float64).dtype == np.float64
    assert m.nnz == 3                                        # the input is left as it was


def test_csr_from_lists_sorts_and_sums():
    m = csr_from_lists(np.array([2, 5, 6]), [3, 0, 3, 1], [1.0, 2.0, 4.0, 7.0], 4)
    assert m.indptr.tolist() == [0, 2, 3] and m.indices.tolist() == [0, 3, 1]
    assert m.data.tolist() == [2.0, 5.0, 7.0]
