"""The label-frequency stage (f and f-tilde, marginal or greedy by rounds) equals the kernel."""
import numpy as np
import pytest
import scipy.sparse as sp

from tests.stages.conftest import L
from xmc_spark.kernels import frequencies as FQ
from xmc_spark.params import TreeParams
from xmc_spark.stages import label_frequencies


@pytest.mark.connect
@pytest.mark.parametrize("method", ["marginal", "greedy"])
def test_frequency_stage_equals_kernel(problem, method):
    samples, _, Yl = problem
    Yl = sp.csr_matrix(Yl)
    f, ft, finfo = label_frequencies.run(samples, L, TreeParams(f_tilde=method, greedy_candidates=2))
    rf, rft = FQ.label_frequencies(Yl.indptr, Yl.indices, L, method)
    np.testing.assert_allclose(f, rf)
    np.testing.assert_allclose(ft, rft)
    assert ft.sum() == (np.diff(Yl.indptr) > 0).sum()          # every labelled sample's mass, once
    assert finfo["f_tilde"] == method and finfo["f_tilde_support"] == int((rft > 0).sum())
    if method == "greedy":
        assert finfo["greedy_rounds"] >= 2                        # 2 candidates a round cannot cover 14 labels


def test_given_counts_are_used_as_f(problem):
    samples, _, Yl = problem
    Yl = sp.csr_matrix(Yl)
    f = np.asarray(Yl.sum(axis=0)).ravel()
    f[[0, 1]] = f[[1, 0]] + 1000                          # not the data's counts: the stage must use them
    got_f, ft, _ = label_frequencies.run(samples, L, TreeParams(), f)
    np.testing.assert_array_equal(got_f, f)
    np.testing.assert_allclose(ft, FQ.f_tilde_marginal(Yl.indptr, Yl.indices, f))
