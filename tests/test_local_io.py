"""The single-process XC reader: a hand-written file, and the same rows as the ingest stage's table."""
import numpy as np

from tests.conftest import random_problem, write_xc
from xmc_spark.local_io import read_xc


def test_read_xc_by_hand(tmp_path):
    f = tmp_path / "tiny.txt"
    # header n d L; a row without labels; a repeated label; a repeated feature (summed)
    f.write_text("3 4 3\n2,0 0:3 3:4\n 1:1\n1,1 2:1 2:1\n")
    X, Y = read_xc(str(f))
    np.testing.assert_allclose(X.toarray(), [[0.6, 0, 0, 0.8], [0, 1, 0, 0], [0, 0, 1, 0]], rtol=1e-6)
    np.testing.assert_array_equal(Y.toarray(), [[1, 0, 1], [0, 0, 0], [0, 1, 0]])
    Xr, _ = read_xc(str(f), normalize=False)
    np.testing.assert_allclose(Xr.toarray()[[0, 2]], [[3, 0, 0, 4], [0, 0, 2, 0]])
    assert X.dtype == np.float32 and X.shape == (3, 4) and Y.shape == (3, 3)


def test_ingest_table_equals_local_reader(tmp_path, spark):
    from xmc_spark.params import IngestParams
    from xmc_spark.stages import ingest
    from xmc_spark.storage import read_delta

    X, Y = random_problem(n=150, d=40, L=14, seed=7)
    keep = X.getnnz(axis=1) > 0                  # a row without features or labels would be a blank line
    X, Y = X[keep], Y[keep]
    n = X.shape[0]
    write_xc(tmp_path / "train.txt", X, Y)
    info = ingest.run(spark, str(tmp_path / "train.txt"), str(tmp_path / "train_tbl"), IngestParams())
    assert (info.n_samples, info.n_features, info.n_labels) == (n, 40, 14)
    Xl, Yl = read_xc(str(tmp_path / "train.txt"))
    rows = sorted(read_delta(spark, str(tmp_path / "train_tbl")).collect(), key=lambda r: r["sample_id"])
    assert [r["sample_id"] for r in rows] == list(range(n))
    Xd, Yd = np.zeros((n, 40)), np.zeros((n, 14))
    for i, r in enumerate(rows):
        Xd[i, r["feature_idx"]] = r["feature_val"]
        Yd[i, r["label_idx"]] = 1
    np.testing.assert_allclose(Xd, Xl.toarray(), rtol=1e-6)
    np.testing.assert_array_equal(Yd, Yl.toarray())


def test_the_reader_needs_neither_numba_nor_spark():
    """benchmarks/compare_pecos.py reads the data with this module in PECOS's own venv (numpy < 2,
    no numba, no pyspark): importing it must not import either."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['numba'] = None; sys.modules['pyspark'] = None\n"
            "import xmc_spark.local_io")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
