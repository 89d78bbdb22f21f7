"""Ingest on tiny inputs, against hand-computed rows: repeated feature indices, blank lines."""
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from xmc_spark.params import IngestParams
from xmc_spark.schemas import IngestError
from xmc_spark.stages import ingest


def _rows(df):
    return sorted((r.sample_id, list(r.feature_idx), list(r.feature_val), list(r.label_idx)) for r in df.collect())


@pytest.mark.connect
@pytest.mark.parametrize("count_labels", [False, True])     # the check job's two forms of result
def test_repeated_feature_indices_are_sorted_and_summed(spark, tmp_path, caplog, count_labels):
    f = tmp_path / "dup.txt"
    f.write_text("3 5 4\n1,0 4:3\n0 3:1 1:2 3:2\n1 2:1 2:-1 0:1\n")
    with caplog.at_level(logging.WARNING, logger="xmc_spark.ingest"):
        df, info = ingest.read_samples(spark, str(f), IngestParams(), count_labels=count_labels)
        rows = _rows(df)
    if count_labels:
        np.testing.assert_array_equal(info.label_counts, [2, 2, 0, 0])
    assert info.n_rows_merged_features == 2
    assert info.n_nonzeros == 7                  # the entries as written (the tree's auto split bound)
    assert info.n_label_nonzeros == 2 * 1 + 1 * 3 + 1 * 3   # labels x entries, as written (the PIFA bound)
    assert [r[:2] for r in rows] == [(0, [4]), (1, [1, 3]), (2, [0, 2])]
    np.testing.assert_allclose(rows[1][2], np.array([2, 3]) / np.sqrt(13), rtol=1e-6)   # 3:1 + 3:2 = 3:3
    np.testing.assert_allclose(rows[2][2], [1, 0], rtol=1e-6)                          # 2:1 + 2:-1 = 2:0
    assert rows[0][3] == [0, 1]
    assert f"{f}:3: 2 line(s) list a feature index more than once" in caplog.text


def test_repeated_feature_indices_in_a_table(spark, tmp_path, caplog):
    p = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"sample_id": pa.array([9, 7], pa.int64()), "feature_idx": [[1], [2, 0, 2]],
                             "feature_val": [[5.0], [1.0, 4.0, 2.0]], "label_idx": [[0], [1]]}), p)
    with caplog.at_level(logging.WARNING, logger="xmc_spark.ingest"):
        df, info = ingest.read_samples(spark, str(p), IngestParams(normalize=False))
        rows = _rows(df)
    assert info.n_rows_merged_features == 1 and info.n_nonzeros == 4 and info.n_label_nonzeros == 4
    assert rows == [(7, [0, 2], [4.0, 3.0], [1]), (9, [1], [5.0], [0])]
    assert f"{p}: 1 row(s) list a feature index more than once (the first: sample_id 7)" in caplog.text


def test_clean_input_merges_nothing(spark, tmp_path, caplog, monkeypatch):
    f = tmp_path / "ok.txt"
    f.write_text("2 5 4\n0,2 1:1 3:2\n1 0:1\n")
    with caplog.at_level(logging.WARNING, logger="xmc_spark.ingest"):
        _, info = ingest.read_samples(spark, str(f), IngestParams())
    assert info.n_rows_merged_features == 0 and "more than once" not in caplog.text
    assert info.n_nonzeros == 3 and info.n_label_nonzeros == 2 * 2 + 1 * 1

    def sql_path(*a, **k):        # the numba parser declines: the SQL checks and parser read the file
        seen.append(1)

    seen = []
    monkeypatch.setattr(ingest, "_fast_lines", sql_path)
    info = ingest.read_samples(spark, str(f), IngestParams())[1]
    assert (info.n_nonzeros, info.n_label_nonzeros) == (3, 5) and seen


@pytest.mark.connect
@pytest.mark.parametrize("fmt,text", [("xc", "2 5 4\n0 1:1\n1 2:1"), ("svmlight", "0 2:1\n1 3:1")])
def test_a_final_newline_is_not_a_blank_line(spark, tmp_path, fmt, text):
    got = []
    for name, body in (("without.txt", text), ("with.txt", text + "\n")):
        f = tmp_path / name
        f.write_text(body)
        df, info = ingest.read_samples(spark, str(f), IngestParams(), fmt=fmt)
        got.append((info.n_samples, _rows(df)))
    assert got[0] == got[1] and got[0][0] == 2


def _partitions(df):
    """Input partitions holding rows (no RDD on Spark Connect)."""
    return df.select("_pid").distinct().count()


@pytest.fixture
def small_splits(spark):
    """Text inputs split into input partitions of 256 bytes (line numbers must run across them)."""
    old = spark.conf.get("spark.sql.files.maxPartitionBytes")
    spark.conf.set("spark.sql.files.maxPartitionBytes", "256")
    yield
    spark.conf.set("spark.sql.files.maxPartitionBytes", old)


@pytest.mark.connect
def test_line_numbers_and_sample_ids_across_input_partitions(spark, tmp_path, small_splits):
    lines = [f"{i % 3} {i % 7}:{i + 1}" for i in range(200)]
    f = tmp_path / "many.txt"
    f.write_text("200 7 3\n" + "\n".join(lines) + "\n")
    assert _partitions(ingest.text_lines(spark, str(f))) > 4
    df, info = ingest.read_samples(spark, str(f), IngestParams(normalize=False))
    assert info.n_samples == 200
    assert _rows(df) == [(i, [i % 7], [float(i + 1)], [i % 3]) for i in range(200)]
    lines[150] = "x 1:1"
    f.write_text("200 7 3\n" + "\n".join(lines) + "\n")
    with pytest.raises(IngestError, match=f"^{f}:152: label id is not an integer in 'x'$"):
        ingest.read_samples(spark, str(f), IngestParams())


@pytest.mark.connect
def test_lines_checks_a_wrong_one_split_hint(spark, tmp_path, small_splits):
    f = tmp_path / "many.txt"
    f.write_text("".join(f"line {i}\n" for i in range(100)))
    df = ingest.text_lines(spark, str(f), "value LIKE 'line 7%' AS seven")
    assert not ingest.one_split(spark, str(f)) and _partitions(df) > 1
    lines = ingest.Lines(df, True, first7=ingest.first_where("seven", "value"))   # told one split, wrongly
    assert lines.n == 100 and lines.first("first7") == (8, "line 7")
    got = sorted((r.value, r.line) for r in df.withColumn("line", lines.line()).collect())
    assert got == sorted((f"line {i}", i + 1) for i in range(100))


def test_the_quick_screen_passes_only_lines_the_full_checks_accept(spark, tmp_path):
    """Every line passes through ``_text_ok`` (compiled array functions) and only the rejected
    ones through the full, lambda-based checks: a line the screen passes must be one the full
    checks find nothing in, and ordinary good lines must pass it (else the screen saves nothing)."""
    good = ["0,2 1:0.5 3:1", "1 0:1e-3", "4", "2 3:-2.5 qid:7", "  1:1 2:2", "3\t0:1  1:2 ", "0 1:+1 2:.5 3:1E2"]
    bad = ["", " ", "x 1:1", "1 1:", "1 :1", "1 1:2:3", "1 1", "1,,2 1:1", "1 a:1", "1 1:b", "-1 1:1", "9 1:1",
           "1 -1:1", "1 99:1", "1 1:NaN", "1 1:inf", "1 1:-Infinity", "1 1:1e39", "1:1 2:1:1", "1 2147483648:1",
           " 1 1:1", "1 1:1 qid", "1\u00a02:1", "1 1:1\u000b2:2"]
    f = tmp_path / "lines.txt"
    f.write_text("\n".join(good + bad) + "\n")
    d, L = 5, 5
    err = ingest._error_sql(d, L, first=ingest._token_error_sql(False))
    df = ingest.text_lines(spark, str(f), *ingest._text_columns(False)).selectExpr(
        "value", f"{ingest._text_ok(d, L)} AS ok", f"{err} AS err")
    rows = {r["value"]: (r["ok"], r["err"]) for r in df.collect()}
    for line, (ok, err) in rows.items():
        assert not (ok and err is not None), (line, err)
    for line in good:
        assert rows[line] == (True, None), line
    assert sum(err is not None for _, err in rows.values()) >= len(bad) - 1    # "" is a line of its own


def _screened(spark, tmp_path, rows, types, d, L):
    """Rows (feature_idx, feature_val, label_idx[, weight], ...) written as an input table with
    the given list/value ``types`` (None: no such column); {sample_id: (the screen, the full
    checks)} of it."""
    data = {"sample_id": pa.array(range(len(rows)), pa.int64())}
    for k, (name, t) in enumerate(zip(("feature_idx", "feature_val", "label_idx", "weight"), types)):
        if t is not None:
            data[name] = pa.array([r[k] for r in rows], t)
    path = tmp_path / f"screen{len(list(tmp_path.iterdir()))}.parquet"
    pq.write_table(pa.table(data), path)
    raw = spark.read.parquet(str(path))
    err = ingest._error_sql(d, L, first=ingest._table_errors(raw.columns))
    return {r["sample_id"]: (r["ok"], r["err"]) for r in raw.selectExpr(
        "sample_id", f"{ingest._table_ok(raw.columns, d, L)} AS ok", f"{err} AS err").collect()}


def _check_screen(rows, got):
    """rows: (..., good) with good True (screen TRUE, no error), None (no error, the screen NULL
    or TRUE: whole NULL arrays, whose size() is NULL or -1 by the ANSI setting) or False (an
    error); a row the screen passes must have no error."""
    for i, (*_, good) in enumerate(rows):
        ok, e = got[i]
        assert not (ok and e is not None), (rows[i], e)
        if good is None:
            assert ok in (None, True) and e is None, (rows[i], ok, e)
        else:
            assert (ok, e) == (True, None) if good else e is not None, (rows[i], ok, e)


def test_the_table_screen_passes_only_rows_the_full_checks_accept(spark, tmp_path):
    """Input tables get the same split as text: ``_table_ok`` screens every row with compiled
    array functions (and one lambda pass per array, ``array_compact``) and only the rows it does
    not pass go through the lambda-based checks. A row the screen passes must be one the full
    checks find nothing in, and ordinary good rows must pass it; on the column types the input
    schema allows (integer values and weights, float32 values, int32 ids)."""
    inf, nan, f32max = float("inf"), float("nan"), float(np.finfo(np.float32).max)
    rows = [  # (feature_idx, feature_val, label_idx, weight, good)
        ([0, 3], [0.5, 1.0], [1], 1.0, True), ([], [], [], 0.0, True), ([4], [-3.4e38], [0, 4], 2.5, True),
        ([1], [1e-45], [2], 1e30, True), (None, None, [1], 1.0, None),
        ([0, 1], [1.0], [1], 1.0, False), ([0, None], [1.0, 2.0], [1], 1.0, False),
        ([0], [None], [1], 1.0, False), ([0], [1.0], [None], 1.0, False), ([-1], [1.0], [1], 1.0, False),
        ([5], [1.0], [1], 1.0, False), ([0], [1.0], [-2], 1.0, False), ([0], [1.0], [5], 1.0, False),
        ([0], [nan], [1], 1.0, False), ([0, 1], [1.0, nan], [1], 1.0, False), ([0], [inf], [1], 1.0, False),
        ([0], [-inf], [1], 1.0, False), ([0], [1e39], [1], 1.0, False), ([0], [-1e39], [1], 1.0, False),
        ([0], [1.0], [1], nan, False), ([0], [1.0], [1], -1.0, False), ([0], [1.0], [1], inf, False),
        ([0], [1.0], [1], None, False),
    ]
    i64, f64, i32 = pa.list_(pa.int64()), pa.list_(pa.float64()), pa.list_(pa.int32())
    _check_screen(rows, _screened(spark, tmp_path, rows, (i64, f64, i64, pa.float64()), 5, 5))

    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max      # integer values: no overflow in abs
    ints = [([0], [lo], [1], 1, True), ([1], [hi], [2], 0, True), ([0], [lo], [None], 1, False),
            ([0], [1], [1], lo, False), ([0, 1], [lo, 1], [1], 2, True)]
    got = _screened(spark, tmp_path, ints, (i32, i64, i32, pa.int64()), None, None)
    _check_screen(ints, got)
    assert got[2][1] == "label_idx holds a null" and got[3][1] == f"weight is {lo} (must be >= 0 and finite)"

    f32 = [([0], [f32max], [1], True), ([0], [-f32max], [1], True), ([0], [inf], [1], False),
           ([0, 1], [1.0, nan], [1], False)]
    _check_screen(f32, _screened(spark, tmp_path, f32, (i32, pa.list_(pa.float32()), i32, None), 5, 5))


@pytest.mark.parametrize("fmt", ["xc", "svmlight"])
def test_the_numba_path_gives_the_rows_of_the_sql_path(spark, tmp_path, monkeypatch, fmt):
    """A file in the plain forms goes through the numba parser (check and parse); the same file
    through the SQL checks and parse (the path of files with unusual forms) gives identical rows
    and sizes, floats bit for bit."""
    rng = np.random.default_rng(5)
    lines = [] if fmt == "svmlight" else ["300 50 9"]
    shift = 1 if fmt == "svmlight" else 0
    for _ in range(300):
        labels = ",".join(map(str, rng.choice(9, rng.integers(0, 3), replace=False)))
        feats = " ".join(f"{j + shift}:{v:.6g}" for j, v in zip(rng.integers(0, 50, 6), rng.normal(size=6) * 10))
        lines.append(f"{labels} {feats}" if labels else f" {feats}")
    f = tmp_path / f"data.{'txt' if fmt == 'xc' else 'svm'}"
    f.write_text("\n".join(lines) + "\n")
    calls = []
    fast = ingest._fast_lines
    monkeypatch.setattr(ingest, "_fast_lines", lambda *a: calls.append(fast(*a)) or calls[-1])
    df, info = ingest.read_samples(spark, str(f), IngestParams())
    assert calls and calls[0] is not None
    got = _rows(df)
    monkeypatch.setattr(ingest, "_fast_lines", lambda *a: None)
    df2, info2 = ingest.read_samples(spark, str(f), IngestParams())
    assert got == _rows(df2) and info == info2
    assert info.n_samples == 300 and info.n_rows_merged_features > 0


@pytest.mark.connect
@pytest.mark.parametrize("fmt,splits", [("xc", "one"), ("xc", "many"), ("svmlight", "many")])
def test_the_check_job_counts_labels_as_the_written_table_has_them(spark, tmp_path, fmt, splits):
    """count_labels / seen_labels: the check job's per-label row counts and rows with an unseen
    label equal evaluation's jobs over the parsed rows (a label repeated in a line counts once,
    a row without labels counts nowhere, lines spread over input partitions or in one)."""
    from xmc_spark.stages import evaluation

    rng = np.random.default_rng(3)
    lines = [] if fmt == "svmlight" else ["120 30 12"]
    for i in range(120):
        labels = list(rng.choice(12, rng.integers(0, 4)))
        if i % 10 == 0 and labels:
            labels.append(labels[0])                        # a repeated label
        lines.append(f"{','.join(map(str, labels))} {i % 30 + (fmt == 'svmlight')}:1")
    f = tmp_path / "data.txt"
    f.write_text("\n".join(lines) + "\n")
    old = spark.conf.get("spark.sql.files.maxPartitionBytes")
    if splits == "many":
        spark.conf.set("spark.sql.files.maxPartitionBytes", "256")
    try:
        assert (_partitions(ingest.text_lines(spark, str(f))) > 1) == (splits == "many")
        p = IngestParams(num_labels=12) if fmt == "svmlight" else IngestParams()
        df, info = ingest.read_samples(spark, str(f), p, count_labels=True)
        assert _rows(df) == _rows(ingest.read_samples(spark, str(f), p)[0])   # the same sample ids
        want = evaluation.label_counts(df, 12)
        assert want.sum() > 0 and info.rows_with_unseen is None
        np.testing.assert_array_equal(info.label_counts, want)
        seen = np.arange(10) % 3 != 0                       # labels 0, 3, 6, 9 and 10, 11 (past it) unseen
        df2, info2 = ingest.read_samples(spark, str(f), p, seen_labels=seen)
        unseen = np.ones(12, np.bool_)
        unseen[:10] = ~seen
        np.testing.assert_array_equal(info2.label_counts, np.where(unseen, want, 0))   # the unseen ones only
        _, info3 = ingest.read_samples(spark, str(f), p, count_labels=True, seen_labels=seen)
        np.testing.assert_array_equal(info3.label_counts, want)                           # asked: all of them
        assert info3.rows_with_unseen == info2.rows_with_unseen
        expect = evaluation.unseen_labels(seen.astype(np.int64), df2)
        assert expect["test_rows_with_unseen"] > 0
        assert evaluation.unseen_from_counts(seen.astype(np.int64), info2.label_counts,
                                             info2.rows_with_unseen) == expect
    finally:
        spark.conf.set("spark.sql.files.maxPartitionBytes", old)
    _, info3 = ingest.read_samples(spark, str(f), p)            # not asked: no counts, no extra work
    assert info3.label_counts is None and info3.rows_with_unseen is None


@pytest.mark.parametrize("label", ["4294967297", "3000000000", "4"])
def test_counting_labels_keeps_the_range_check(spark, tmp_path, label):
    """A label id past the declared count, also one past the int range (which would wrap to a
    small id in an int32 array), is still named as out of range when the check job counts labels."""
    f = tmp_path / "bad.txt"
    f.write_text(f"2 5 4\n0 1:1\n{label} 1:1\n")
    for kw in ({"count_labels": True}, {"seen_labels": np.ones(4, np.bool_)}):
        with pytest.raises(IngestError, match=rf":3: label id {label} out of range \[0, 4\)"):
            ingest.read_samples(spark, str(f), IngestParams(), **kw)


@pytest.mark.parametrize("ask", ["count_labels", "seen_labels"])
def test_the_label_counts_run_the_reduce_tasks_their_labels_need(spark, tmp_path, ask):
    """With 64 shuffle partitions and no adaptive coalescing, the check job that counts a text
    file's labels (its declared 12) reads them in as many tasks as the input's splits or the
    default parallelism, not in 64 nearly empty ones, and its counts stay those of the rows."""
    from tests.conftest import stage_tasks
    from xmc_spark.stages import evaluation

    f = tmp_path / "data.txt"
    f.write_text("\n".join(["90 30 12"] + [f"{i % 12},{(i + 5) % 12} {i % 30}:1" for i in range(90)]) + "\n")
    from xmc_spark.compat import session_settings
    keys = {"spark.sql.shuffle.partitions": "64", "spark.sql.adaptive.coalescePartitions.enabled": "false",
            "spark.sql.files.maxPartitionBytes": "256"}
    with session_settings(spark, keys, "the test"):
        splits = _partitions(ingest.text_lines(spark, str(f)))
        want = max(spark.sparkContext.defaultParallelism, splits)
        kw = {"count_labels": True} if ask == "count_labels" else {"seen_labels": np.ones(6, np.bool_)}
        (df, info), tasks = stage_tasks(spark, lambda: ingest.read_samples(spark, str(f), IngestParams(), **kw))
        assert splits > 1 and tasks and max(tasks) <= want < 64, (splits, tasks)
        counts = evaluation.label_counts(df, 12)
        if ask == "count_labels":
            np.testing.assert_array_equal(info.label_counts, counts)
        else:                                   # labels 6-11 are unseen: only theirs are counted
            np.testing.assert_array_equal(info.label_counts, np.r_[np.zeros(6, np.int64), counts[6:]])
        assert counts.sum() == 180 and info.label_counts[6:].sum() > 0


def test_packed_label_counts_round_trip():
    """A task's (label, count) rows, in any order and over batches, come back as the same pairs
    from its one packed row (labels up to the int range, counts past it); partition rows pass as
    they are; a task with no label row packs none."""
    import pyarrow as pa

    rng = np.random.default_rng(5)
    ids = rng.choice(2 ** 31 - 1, 500, replace=False)
    ids[0] = 2 ** 31 - 2
    ns = rng.integers(1, 2 ** 40, 500)

    def batch(lab, n, part):
        return pa.RecordBatch.from_arrays([pa.array(lab, pa.int32()), pa.array(n, pa.int64()),
                                           pa.array(part, pa.string())], names=["_label", "_n", "_part"])
    batches = [batch(ids[:200], ns[:200], [None] * 200), batch([None], [7], ['{"_pid": 0}']),
               batch(ids[200:], ns[200:], [None] * 300)]
    out = pa.Table.from_batches(list(ingest._packed_counts(iter(batches))))
    assert out.column("_part").drop_null().to_pylist() == ['{"_pid": 0}']
    assert out.column("_k").drop_null().to_pylist() == [500]
    got_ids, got_ns = ingest.unpacked_counts(out)
    order = np.argsort(ids)
    np.testing.assert_array_equal(got_ids, ids[order])
    np.testing.assert_array_equal(got_ns, ns[order])
    none = pa.Table.from_batches(list(ingest._packed_counts(iter([batch([None], [3], ['{"_pid": 1}'])]))))
    assert none.num_rows == 1 and [len(a) for a in ingest.unpacked_counts(none)] == [0, 0]


def test_counting_labels_of_a_file_without_samples(spark, tmp_path):
    f = tmp_path / "none.txt"
    f.write_text("0 5 4\n")
    with pytest.raises(IngestError, match="no samples"):
        ingest.read_samples(spark, str(f), IngestParams(), count_labels=True)


def test_a_table_s_id_check_runs_a_reduce_task_per_input_split(spark, tmp_path):
    """With 64 shuffle partitions and no adaptive coalescing, the uniqueness check of a
    many-file table's ids shuffles into a partition per input split (at least the default
    parallelism), not into 64, and still finds an id repeated across files."""
    from tests.conftest import stage_tasks
    schema = "sample_id long, feature_idx array<int>, feature_val array<double>, label_idx array<int>"
    ok, dup = str(tmp_path / "ok"), str(tmp_path / "dup")
    spark.createDataFrame([(i, [i % 5], [1.0], [i % 3]) for i in range(30)], schema).repartition(3).write.parquet(ok)
    spark.createDataFrame([(i % 29, [0], [1.0], [0]) for i in range(30)], schema).repartition(3).write.parquet(dup)
    keys = ("spark.sql.shuffle.partitions", "spark.sql.adaptive.coalescePartitions.enabled")
    old = {key: spark.conf.get(key) for key in keys}
    try:
        spark.conf.set("spark.sql.shuffle.partitions", "64")
        spark.conf.set("spark.sql.adaptive.coalescePartitions.enabled", "false")
        want = max(spark.sparkContext.defaultParallelism, spark.read.parquet(ok).rdd.getNumPartitions())
        (_, info), tasks = stage_tasks(spark, lambda: ingest.read_samples(spark, ok, IngestParams()))
        assert (info.n_samples, info.n_features, info.n_labels) == (30, 5, 3)
        assert tasks and max(tasks) <= want < 64, tasks
        with pytest.raises(IngestError, match=r"duplicate sample_id 0 \(2 rows\)"):
            ingest.read_samples(spark, dup, IngestParams())
        assert spark.conf.get("spark.sql.shuffle.partitions") == "64"     # restored
    finally:
        for key, value in old.items():
            spark.conf.set(key, value)
