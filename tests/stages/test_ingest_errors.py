"""Bad inputs: a clear error naming the file and line (or row), and no table written."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from xmc_spark.params import IngestParams
from xmc_spark.schemas import IngestError, SchemaError
from xmc_spark.stages import ingest

GOOD = "3 5 4\n0,1 0:1 3:0.5\n2 1:1\n 4:2\n"


@pytest.mark.parametrize("text,match", [
    ("3 5\n0 1:1\n", r":1: malformed header"),
    ("2 5 4\n0,1 0:1\n2 1:1 3\n", r":3: malformed feature token .*'3'"),
    ("2 5 4\n0,x 0:1\n2 1:1\n", r":2: label id is not an integer in '0,x'"),
    ("2 5 4\n0 0:1\n7 1:1\n", r":3: label id 7 out of range \[0, 4\)"),
    ("2 5 4\n0 0:1\n1 9:1\n", r":3: feature index 9 out of range \[0, 5\)"),
    ("2 5 4\n0 -1:1\n1 2:1\n", r":2: negative feature index -1"),
    ("2 5 4\n-2 1:1\n1 2:1\n", r":2: negative label id -2"),
    ("2 5 4\n0 1:nan\n1 2:1\n", r":2: feature value is NaN or infinite"),
    ("2 5 4\n0 1:1\n1 2:inf\n", r":3: feature value is NaN or infinite"),
    ("2 5 4\n0 1:abc\n1 2:1\n", r":2: feature value is not a number"),
    ("3 5 4\n0 1:1\n1 2:1\n", r":1: header declares 3 samples but the file has 2"),
    ("3 5 4\n0 1:1\n\n1 2:1\n", r":3: empty line"),              # header count matches the blank line
    ("2 5 4\n0 1:1\n\n1 2:1\n", r":3: empty line"),              # ... or not: still the blank line
    ("2 5 4\n0 1:1\n \t \n1 2:1\n", r":3: empty line"),
    ("2 5 4\n0 1:1\n1 2:1\n\n", r":4: empty line"),
    ("2 5 4\n0 1:1\n 3\n", r":3: malformed feature token .*'3'"),   # a leading blank: no label list
    ("2 5 4\n0 1:1\n99999999999 1:1\n", r":3: label id 99999999999 out of range \[0, 4\)"),
    ("2 9999999999 4\n0 1:1\n1 3000000000:1\n", r":3: feature index 3000000000 out of range \[0, 2147483647\)"),
    ("2 5 4\n0 1:1\n1 1:1e39\n", r":3: feature value is (not a number: '1:1e39'|NaN or infinite)"),
    ("2 5 4\n0 1:1\n1 :1\n", r":3: feature index is not an integer: ':1'"),
    ("", r"the file is empty"),
    ("2 5 4\n", r"no samples"),
])
def test_bad_xc_file(spark, tmp_path, text, match):
    f = tmp_path / "bad.txt"
    f.write_text(text)
    out = tmp_path / "tbl"
    with pytest.raises(IngestError, match=match) as e:
        ingest.run(spark, str(f), str(out), IngestParams())
    assert str(f) in str(e.value)
    assert not out.exists()


def test_missing_path(spark, tmp_path):
    with pytest.raises(IngestError, match="no such file"):
        ingest.run(spark, str(tmp_path / "nope.txt"), str(tmp_path / "tbl"), IngestParams())
    for fmt in ("xc", "parquet"):               # a format given: still this error, not Spark's
        with pytest.raises(IngestError, match=f"^{tmp_path / 'nope'}: no such file"):
            ingest.read_samples(spark, str(tmp_path / "nope"), IngestParams(), fmt=fmt)
    (tmp_path / "empty.parquet").mkdir()
    with pytest.raises(IngestError, match=f"^{tmp_path / 'empty.parquet'}: cannot read the input"):
        ingest.read_samples(spark, str(tmp_path / "empty.parquet"), IngestParams())


def test_good_file_with_unlabelled_line(spark, tmp_path):
    f = tmp_path / "good.txt"
    f.write_text(GOOD)
    info = ingest.run(spark, str(f), str(tmp_path / "tbl"), IngestParams())
    assert (info.n_samples, info.n_features, info.n_labels) == (3, 5, 4)
    rows = sorted(spark.read.format("delta").load(str(tmp_path / "tbl")).collect(), key=lambda r: r.sample_id)
    assert [list(r.label_idx) for r in rows] == [[0, 1], [2], []]
    np.testing.assert_allclose(rows[0].feature_val, np.array([1, 0.5]) / np.sqrt(1.25), rtol=1e-6)
    # rerun is idempotent: same table content, a new version
    ingest.run(spark, str(f), str(tmp_path / "tbl"), IngestParams())
    assert spark.read.format("delta").load(str(tmp_path / "tbl")).count() == 3


def test_failed_rerun_keeps_previous_table(spark, tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text(GOOD)
    bad.write_text("2 5 4\n0 1:1\n9 2:1\n")
    ingest.run(spark, str(good), str(tmp_path / "tbl"), IngestParams())
    with pytest.raises(IngestError):
        ingest.run(spark, str(bad), str(tmp_path / "tbl"), IngestParams())
    assert spark.read.format("delta").load(str(tmp_path / "tbl")).count() == 3


def test_svmlight_one_based(spark, tmp_path):
    f = tmp_path / "a.svm"
    f.write_text("0,2 1:1 4:2\n1 qid:3 2:1\n")
    info = ingest.run(spark, str(f), str(tmp_path / "tbl"), IngestParams(normalize=False))
    assert (info.fmt, info.n_samples, info.n_features, info.n_labels) == ("svmlight", 2, 4, 3)
    rows = sorted(spark.read.format("delta").load(str(tmp_path / "tbl")).collect(), key=lambda r: r.sample_id)
    assert list(rows[0].feature_idx) == [0, 3] and list(rows[1].feature_idx) == [1]


def test_svmlight_ids_beyond_int(spark, tmp_path):
    f = tmp_path / "a.svm"
    f.write_text("0 2147483648:1\n")              # one-based: index 2^31 - 1, one more than an int count allows
    with pytest.raises(IngestError, match=f"^{f}:1: feature index 2147483647 out of range \\[0, 2147483647\\)$"):
        ingest.read_samples(spark, str(f), IngestParams())


@pytest.mark.parametrize("rows,types,match", [
    ([(1, [0, None], [1.0, 2.0], [0])], {}, r"row with sample_id 1: feature_idx holds a null"),
    ([(1, [0], [1.0], [0]), (2, [2 ** 31], [1.0], [0])], {},
     r"row with sample_id 2: feature index 2147483648 out of range"),
    ([(1, [0], [1e39], [0])], {}, r"row with sample_id 1: feature value 1.0E39 does not fit a float"),
    ([(1, [0], [1.0], [0]), (None, [1], [1.0], [0])], {}, r": 1 row\(s\) with a null sample_id"),
    ([(1, [0], [1.0], [0], float("nan"))], {"weight": pa.float64()}, r"row with sample_id 1: weight is NaN"),
])
def test_bad_table_values(spark, tmp_path, rows, types, match):
    cols = ["sample_id", "feature_idx", "feature_val", "label_idx", "weight"][:len(rows[0])]
    schema = {"sample_id": pa.int64(), "feature_idx": pa.list_(pa.int64()), "feature_val": pa.list_(pa.float64()),
              "label_idx": pa.list_(pa.int64()), **types}
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({c: pa.array([r[i] for r in rows], schema[c]) for i, c in enumerate(cols)}), p)
    with pytest.raises(IngestError, match=f"^{p}{match}" if match.startswith(":") else f"^{p}: {match}"):
        ingest.read_samples(spark, str(p), IngestParams())


def test_corrupt_parquet(spark, tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"sample_id": [1, 2], "feature_idx": [[0], [1]], "feature_val": [[1.0], [2.0]],
                             "label_idx": [[0], [1]]}), p, write_page_checksum=True)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])           # truncated: no footer
    with pytest.raises(IngestError, match=f"^{p}: cannot read the input"):
        ingest.read_samples(spark, str(p), IngestParams())


def test_svmlight_blank_line(spark, tmp_path):
    f = tmp_path / "a.svm"
    f.write_text("0 1:1\n   \n1 2:1\n")
    with pytest.raises(IngestError, match=f"^{f}:2: empty line$"):
        ingest.read_samples(spark, str(f), IngestParams())


def test_parquet_wrong_schema_and_duplicates(spark, tmp_path):
    p = str(tmp_path / "wrong.parquet")
    spark.createDataFrame([(1, "x")], "sample_id long, features string").write.parquet(p)
    with pytest.raises(SchemaError, match=r"missing column 'feature_idx'"):
        ingest.run(spark, p, str(tmp_path / "tbl"), IngestParams())
    p2 = str(tmp_path / "dup.parquet")
    spark.createDataFrame([(1, [0], [1.0], [0]), (1, [1], [1.0], [1])],
                          "sample_id long, feature_idx array<int>, feature_val array<double>, label_idx array<int>"
                          ).write.parquet(p2)
    with pytest.raises(IngestError, match="duplicate sample_id 1"):
        ingest.run(spark, p2, str(tmp_path / "tbl"), IngestParams())
    p3 = str(tmp_path / "ok.parquet")
    spark.createDataFrame([(5, [0, 2], [3.0, 4.0], [1]), (6, [1], [1.0], [])],
                          "sample_id long, feature_idx array<int>, feature_val array<double>, label_idx array<int>"
                          ).write.parquet(p3)
    info = ingest.run(spark, p3, str(tmp_path / "tbl"), IngestParams())
    assert (info.fmt, info.n_samples, info.n_features, info.n_labels) == ("parquet", 2, 3, 2)
    r = spark.read.format("delta").load(str(tmp_path / "tbl")).filter("sample_id = 5").first()
    np.testing.assert_allclose(r.feature_val, [0.6, 0.8], rtol=1e-6)
