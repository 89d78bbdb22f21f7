"""Arrow list columns <-> CSR: offsets and values, sliced, chunked and null lists; round trips
against scipy; the Spark helpers on a tiny frame."""
import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

from xmc_spark.arrow_utils import (
    binary_lengths,
    binary_segments,
    binary_values,
    csr_batches,
    csr_from_binary,
    csr_from_table,
    csr_rows_to_arrays,
    grouped_apply,
    list_array,
    list_offsets_values,
    local_frame,
    pack_rows,
    to_arrow,
    unpack_rows,
)


def _parts(col):
    off, val = list_offsets_values(pa.table({"c": col}), "c")
    return off.tolist(), val.tolist()


@pytest.mark.parametrize("col,offsets,values", [
    (pa.array([[1, 2], [], [3]], pa.list_(pa.int32())), [0, 2, 2, 3], [1, 2, 3]),
    (pa.array([[1, 2], [], [3]], pa.list_(pa.int32())).slice(1), [0, 0, 1], [3]),          # offsets from 2
    (pa.array([[5], [1, 2], [], [3]], pa.list_(pa.int32())).slice(1, 2), [0, 2, 2], [1, 2]),  # values cut too
    (pa.chunked_array([[[1], [2, 3]], [[4]]], pa.list_(pa.int64())), [0, 1, 3, 4], [1, 2, 3, 4]),
    (pa.array([[1], None, [2, 3]], pa.list_(pa.int32())), [0, 1, 1, 3], [1, 2, 3]),         # null = empty
    (pa.array([], pa.list_(pa.int32())), [0], []),
    (pa.chunked_array([], pa.list_(pa.int32())), [0], []),
])
def test_offsets_and_values(col, offsets, values):
    assert _parts(col) == (offsets, values)


def test_list_array_round_trip():
    arr = list_array(np.array([0, 2, 2, 5]), np.array([0.5, 1, 2, 3, 4], np.float32), pa.float32())
    assert arr.type == pa.list_(pa.float32())
    assert arr.to_pylist() == [[0.5, 1.0], [], [2.0, 3.0, 4.0]]
    assert _parts(arr) == ([0, 2, 2, 5], [0.5, 1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="do not fit one list array"):       # int32 offsets would wrap
        list_array(np.array([0, 1 << 31]), np.zeros(1, np.float32), pa.float32())


@pytest.mark.parametrize("seed", range(3))
def test_csr_round_trip_against_scipy(seed):
    dense = sp.random(7, 9, density=0.3, random_state=seed, dtype=np.float32).toarray()
    dense[3] = 0                                          # an empty row
    M = sp.csr_matrix(dense)
    idx, val = csr_rows_to_arrays(M)
    assert idx.type == pa.list_(pa.int32()) and val.type == pa.list_(pa.float32())
    assert idx.to_pylist()[1] == M.indices[M.indptr[1]:M.indptr[2]].tolist() and idx.to_pylist()[3] == []
    t = pa.table({"i": idx, "v": val})
    np.testing.assert_array_equal(csr_from_table(t, "i", "v", 9).toarray(), M.toarray())
    np.testing.assert_array_equal(csr_from_table(t, "i", None, 9).toarray(), (M.toarray() != 0).astype(np.float32))
    # the same rows in two chunks, and a slice: the row ranges line up with scipy's
    two = pa.concat_tables([t.slice(0, 4), t.slice(4)])
    assert two.column("i").num_chunks == 2
    np.testing.assert_array_equal(csr_from_table(two, "i", "v", 9).toarray(), M.toarray())
    np.testing.assert_array_equal(csr_from_table(t.slice(2, 3), "i", "v", 9).toarray(), M[2:5].toarray())
    # wider than the data: trailing empty columns
    assert csr_from_table(t, "i", "v", 12).shape == (7, 12)


def test_csr_from_table_sums_duplicates_in_a_row():
    t = pa.table({"i": pa.array([[2, 0, 2]], pa.list_(pa.int32())),
                  "v": pa.array([[1.0, 0.5, 2.0]], pa.list_(pa.float32()))})
    np.testing.assert_array_equal(csr_from_table(t, "i", "v", 3).toarray(), [[0.5, 0, 3.0]])


def test_grouped_apply_and_to_arrow(spark):
    df = spark.createDataFrame([(0, [1, 2]), (1, [3]), (0, [4]), (2, [])], "g int, xs array<int>")

    def total(t: pa.Table) -> pa.Table:
        _, vals = list_offsets_values(t, "xs")
        return pa.table({"g": pa.array([t.column("g")[0].as_py()], pa.int32()),
                         "n": pa.array([t.num_rows], pa.int64()), "s": pa.array([int(vals.sum())], pa.int64())})

    out = to_arrow(grouped_apply(df, ["g"], total, "g int, n long, s long"))
    assert isinstance(out, pa.Table)
    assert sorted(zip(*(out.column(c).to_pylist() for c in ("g", "n", "s")))) == [(0, 2, 7), (1, 1, 3), (2, 1, 0)]


def test_binary_segments_round_trip_by_chunks():
    """binary_segments packs segments of an array as bytes; binary_values gives the values back
    end to end, over chunks, sliced arrays, large_binary and empty segments."""
    v = np.arange(10, dtype=np.int64) * 3
    seg = binary_segments(v, np.array([0, 3, 3, 10]), np.int32)
    assert [len(x.as_py()) for x in seg] == [12, 0, 28]
    np.testing.assert_array_equal(binary_values(seg, np.int32), v.astype(np.int32))
    chunked = pa.chunked_array([seg.slice(1), binary_segments(v[:2], np.array([0, 2]), np.int32)])
    np.testing.assert_array_equal(binary_values(chunked, np.int32), np.r_[v[3:], v[:2]].astype(np.int32))
    np.testing.assert_array_equal(binary_values(seg.cast(pa.large_binary()), np.int32), v.astype(np.int32))
    assert binary_values(seg.slice(1, 1), np.float32).size == 0
    with pytest.raises(ValueError, match="2 GiB"):
        binary_segments(np.zeros(4, np.int8), np.array([0, 1 << 31]), np.int8)


def test_packed_rows_give_the_lists_csr():
    """pack_rows turns each row's (indices, values) lists into two byte strings; csr_from_binary
    reads them back as the CSR matrix csr_from_table builds from the lists, also over chunks, a
    sliced chunk and empty rows (duplicates summed alike), in a given row order; refuses a row
    whose values and indices differ in length, an order that is not a permutation of the rows, and
    a value that does not hold whole numbers."""
    rng = np.random.default_rng(3)
    M = sp.random(9, 40, density=0.2, format="csr", random_state=rng, dtype=np.float32)
    M = sp.diags(np.r_[1, 1, 0, 1, 1, 0, 1, 1, 1].astype(np.float32)) @ M     # rows 2 and 5 empty
    M.eliminate_zeros()
    assert np.diff(M.indptr)[[2, 5]].tolist() == [0, 0] and M.nnz > 20
    idx, val = csr_rows_to_arrays(M)
    t = pa.table({"i": idx, "v": val})
    t = pa.concat_tables([t.slice(0, 4), t.slice(4)])               # two chunks
    pi, pv = pack_rows(t, "i", "v")
    np.testing.assert_array_equal(binary_lengths(pi, 4), np.diff(M.indptr))
    packed = pa.table({"i": pa.chunked_array([pi.slice(0, 3), pi.slice(3)]),
                       "v": pa.chunked_array([pv.slice(0, 3), pv.slice(3)])})
    got = csr_from_binary(packed, "i", "v", 40)
    want = csr_from_table(t, "i", "v", 40)
    assert (got != want).nnz == 0 and (got != M).nnz == 0
    dup = pa.table({"i": pa.array([[1, 1, 0]], pa.list_(pa.int32())),
                    "v": pa.array([[1.0, 2.0, 4.0]], pa.list_(pa.float32()))})
    np.testing.assert_array_equal(csr_from_binary(pa.table(dict(zip("iv", pack_rows(dup, "i", "v")))), "i", "v", 3)
                                  .toarray(), [[4.0, 3.0, 0.0]])
    wide = pa.table({"i": pi.cast(pa.large_binary()), "v": pv.cast(pa.large_binary())})
    assert (csr_from_binary(wide, "i", "v", 40) != M).nnz == 0
    with pytest.raises(ValueError, match="different lengths"):
        pack_rows(pa.table({"i": pa.array([[1, 2]], pa.list_(pa.int32())),
                            "v": pa.array([[1.0]], pa.list_(pa.float32()))}), "i", "v")
    # rows in a given order: row k is the table's row order[k] (the idx column chunked otherwise than v)
    order = rng.permutation(9)
    uneven = pa.table({"i": pa.chunked_array([pi.slice(0, 5), pi.slice(5)]), "v": packed.column("v")})
    assert (csr_from_binary(uneven, "i", "v", 40, order) != M[order]).nnz == 0
    vals = [pv[k].as_py() for k in range(9)]
    vals[7] = vals[7][:-4]                     # row 7: one value fewer than indices
    short = pa.table({"i": pi, "v": pa.array(vals, pa.binary())})
    with pytest.raises(ValueError, match="different lengths"):
        csr_from_binary(short, "i", "v", 40)
    with pytest.raises(ValueError, match="not a permutation"):        # a row twice, one never
        csr_from_binary(packed, "i", "v", 40, np.r_[order[:-1], order[0]])
    vals[7] = vals[7] + b"\x00"                   # row 7: a byte past its last whole value
    with pytest.raises(ValueError, match="whole values"):
        csr_from_binary(pa.table({"i": pi, "v": pa.array(vals, pa.binary())}), "i", "v", 40)


def _lineage(df) -> str:
    return df._jdf.queryExecution().toRdd().toDebugString()


def test_unpacked_rows_are_the_packed_lists():
    """unpack_rows gives back the lists pack_rows packed (empty rows, two chunks, a sliced chunk),
    and refuses rows whose indices and values differ in length."""
    idx = pa.array([[3, 1], [], [7], [0, 2, 5]], pa.list_(pa.int32()))
    val = pa.array([[0.5, -1.0], [], [2.0], [1.0, 3.0, 4.0]], pa.list_(pa.float32()))
    pi, pv = pack_rows(pa.table({"i": idx, "v": val}), "i", "v")
    chunked = pa.table({"i": pa.chunked_array([pi.slice(0, 1), pi.slice(1)]),
                        "v": pa.chunked_array([pv.slice(0, 3), pv.slice(3)])})
    for packed in (pa.table({"i": pi, "v": pv}), chunked):
        ui, uv = unpack_rows(packed, "i", "v")
        assert ui.equals(idx) and uv.equals(val)
    with pytest.raises(ValueError, match="different lengths"):
        unpack_rows(pa.table({"i": pi, "v": pv.take([1, 0, 2, 3])}), "i", "v")


def test_csr_batches_cut_rows_by_non_zeros():
    """csr_batches packs a CSR matrix's rows beside per-row columns, a batch ending where the
    running non-zeros pass a multiple of pack_nnz (rows of 2, 0, 4, 1, 2 non-zeros), no row cut."""
    M = sp.csr_matrix(np.array([[1, 0, 2, 0], [0, 0, 0, 0], [3, 4, 5, 6], [0, 7, 0, 0], [8, 0, 0, 9]], np.float32))
    for pack_nnz, sizes in [(100, [5]), (3, [2, 1, 2]), (1, [2, 1, 1, 1])]:
        out = csr_batches({"k": pa.array([4, 0, 3, 1, 2], pa.int32())}, M, pack_nnz)
        assert [b.num_rows for b in out] == sizes, pack_nnz
        t = pa.Table.from_batches(out)
        assert t.column("k").to_pylist() == [4, 0, 3, 1, 2]
        assert (csr_from_binary(t, "emb_idx", "emb_val", 4) != M).nnz == 0
    assert csr_batches({}, sp.csr_matrix((0, 4), dtype=np.float32), 3) == []


def test_local_frame_needs_no_python_worker(spark):
    """The same rows and types as createDataFrame of a list with a DDL schema, but from an Arrow
    table: no Python RDD in the lineage (the list's frame has one: its tasks start Python workers)."""
    from xmc_spark.compat import is_connect
    rows = [("a", 1, 2, 0.5, [3, 4]), ("b", -1, 2 ** 40, None, [])]
    ddl = "name string, i int, l long, v double, ids array<long>"
    df = local_frame(spark, {"name": pa.array(["a", "b"]), "i": pa.array([1, -1], pa.int32()),
                             "l": pa.array([2, 2 ** 40], pa.int64()), "v": pa.array([0.5, None], pa.float64()),
                             "ids": pa.array([[3, 4], []], pa.list_(pa.int64()))})
    ref = spark.createDataFrame(rows, ddl)
    assert df.schema.simpleString() == ref.schema.simpleString()
    assert sorted(map(tuple, df.collect())) == sorted(map(tuple, ref.collect()))
    if not is_connect(spark):
        assert "PythonRDD" in _lineage(ref)
        assert "PythonRDD" not in _lineage(df)
    empty = local_frame(spark, {"sample_id": pa.array([], pa.int64())})
    assert empty.schema.simpleString() == "struct<sample_id:bigint>" and empty.count() == 0


def test_copy_segments_moves_each_row_to_its_place():
    """Segments of a flat buffer copied to given places (rows reversed, an empty one), against slicing."""
    from xmc_spark.arrow_utils import _copy_segments
    src = np.arange(10, dtype=np.float32)
    starts, lengths = np.array([0, 3, 3, 7]), np.array([3, 0, 4, 3])
    dest = np.array([7, 7, 3, 0])              # reversed: rows 3, 2, 1 (empty), 0
    out = np.full(10, -1, np.float32)
    _copy_segments(src, starts, lengths, dest, out)
    want = np.concatenate([src[7:10], src[3:7], src[0:3]])
    np.testing.assert_array_equal(out, want)


def test_a_compressed_collect_gives_the_same_table_and_restores_the_setting(spark, monkeypatch):
    """to_arrow(compress=True) runs its query under Spark's zstd Arrow codec and restores the
    setting after; the table is the uncompressed one's."""
    from pyspark.sql import functions as F

    from xmc_spark.arrow_utils import ARROW_CODEC, to_arrow, to_pandas
    df = spark.range(0, 5000, numPartitions=3).select((F.col("id") % 97).cast("int").alias("label_idx"),
                                                      (F.col("id") * 3).alias("n"))
    before = spark.conf.get(ARROW_CODEC, "none")
    seen, real = [], type(df).toArrow
    monkeypatch.setattr(type(df), "toArrow",
                        lambda self: seen.append(spark.conf.get(ARROW_CODEC, "none")) or real(self))
    plain, packed = to_arrow(df), to_arrow(df, compress=True)
    assert seen == [before, "zstd"] and before != "zstd"
    assert packed.equals(plain) and packed.num_rows == 5000
    assert spark.conf.get(ARROW_CODEC, "none") == before
    assert to_pandas(df).equals(df.toPandas()) and seen[-1] == "zstd"
