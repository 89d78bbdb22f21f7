"""The bad-input catalogue: each input through the ingest stage job (run key K): the error names
the input and the line or row and the problem, and no partition of the ``train``/``test`` tables
is written. ``pytest -s`` prints every message (``CATALOGUE name: message``)."""
import re

import pytest

from tests.conftest import random_problem, write_xc
from xmc_spark.config import load_params
from xmc_spark.params import ConfigError, PipelineParams
from xmc_spark.runner import run_stage
from xmc_spark.schemas import IngestError
from xmc_spark.storage import RunKeyError, StageOrderError, is_delta, read_delta

K = "2026-11-25"
COLS = "sample_id long, feature_idx array<int>, feature_val array<double>, label_idx array<int>"


def _xc(text):
    def make(spark, d):
        (d / "in.txt").write_text(text)
        return str(d / "in.txt")
    return make


def _table(rows, schema, fmt):
    def make(spark, d):
        p = str(d / f"in.{fmt}")
        spark.createDataFrame(rows, schema).write.format(fmt).save(p)
        return p
    return make


def _aggregated(groups_txt):
    def make(spark, d):
        X, Y = random_problem(n=6, d=5, L=4, seed=1)
        keep = (X.getnnz(axis=1) + Y.getnnz(axis=1)) > 0    # a row with neither would be a blank line
        X, Y = X[keep], Y[keep]
        agg = d / "agg"
        agg.mkdir()
        write_xc(agg / "samples.txt", X, Y)
        (agg / "groups.txt").write_text(groups_txt)
        return str(agg)
    return make


# name -> (input maker, regex the error must match; FILE stands for the input's path)
CATALOGUE = {
    "xc_malformed_header": (_xc("3 5\n0 1:1\n"), r"FILE:1: malformed header"),
    "xc_malformed_line": (_xc("2 5 4\n0,1 0:1\n2 1:1 3\n"), r"FILE:3: malformed feature token .*'3'"),
    "label_out_of_range": (_xc("2 5 4\n0 0:1\n7 1:1\n"), r"FILE:3: label id 7 out of range \[0, 4\)"),
    "feature_out_of_range": (_xc("2 5 4\n0 0:1\n1 9:1\n"), r"FILE:3: feature index 9 out of range \[0, 5\)"),
    "negative_label": (_xc("2 5 4\n-2 1:1\n1 2:1\n"), r"FILE:2: negative label id -2"),
    "negative_feature": (_xc("2 5 4\n0 -1:1\n1 2:1\n"), r"FILE:2: negative feature index -1"),
    "nan_value": (_xc("2 5 4\n0 1:nan\n1 2:1\n"), r"FILE:2: feature value is NaN or infinite"),
    "inf_value": (_xc("2 5 4\n0 1:1\n1 2:-inf\n"), r"FILE:3: feature value is NaN or infinite"),
    "empty_file": (_xc(""), r"FILE: the file is empty"),
    "missing_path": (lambda spark, d: str(d / "nope.txt"), r"FILE: no such file or directory"),
    "duplicate_sample_ids": (_table([(1, [0], [1.0], [0]), (1, [1], [1.0], [1])], COLS, "parquet"),
                             r"FILE: duplicate sample_id 1 \(2 rows\)"),
    "parquet_wrong_schema": (_table([(1, "x")], "sample_id long, features string", "parquet"),
                             r"FILE.*missing column 'feature_idx'"),
    "delta_wrong_column_type": (_table([(1, "0", [1.0], [0])], "sample_id long, feature_idx string, "
                                "feature_val array<double>, label_idx array<int>", "delta"),
                                r"FILE.*'feature_idx'"),
    "delta_nan_row": (_table([(3, [0], [1.0], [0]), (4, [1], [float("nan")], [1])], COLS, "delta"),
                      r"FILE: row with sample_id 4: feature value is NaN or infinite"),
    "group_without_members": (_aggregated("1,2 0 1\n3 \n"), r"FILE/groups.txt:2: empty group"),
    "group_unknown_sample": (_aggregated("1 0 1\n2 0 77\n"),
                             r"FILE/groups.txt: group_id 1: sample_id 77 is not in the samples"),
}


@pytest.fixture(scope="module")
def params(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalogue_root")
    return PipelineParams().set_dotted("mlflow.enabled", False).set_dotted("paths.root", str(root))


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_bad_input(spark, tmp_path, params, name):
    make, pattern = CATALOGUE[name]
    path = make(spark, tmp_path)
    with pytest.raises(IngestError) as e:
        run_stage(spark, "ingest", K, params, train=path)
    msg = str(e.value)
    print(f"CATALOGUE {name}: xmc-spark: error: {msg}")
    assert re.search(pattern.replace("FILE", re.escape(path)), msg), msg
    root = params.paths.root + "/tables"
    for table in ("train", "test", "stage_info"):     # nothing written for this run key
        p = f"{root}/{table}"
        assert not is_delta(spark, p) or read_delta(spark, p, K).count() == 0, table


@pytest.mark.parametrize("overrides,pattern", [
    (["tree.max_leafsize=3"], r"unknown config key 'tree.max_leafsize'"),
    (["train.C=abc"], r"config key 'train.C' expects a number, got 'abc'"),
    (["predict.beam_size=0"], r"config key 'predict.beam_size' must be >= 1"),
])
def test_bad_config(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        load_params(None, overrides)
    print(f"CATALOGUE config {overrides[0]}: xmc-spark: config error: {e.value}")


def test_bad_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tree:\n  max_leaf_size: [3]\n")
    with pytest.raises(ConfigError, match="config key 'tree.max_leaf_size' expects an integer, got \\[3\\]") as e:
        load_params(str(f))
    print(f"CATALOGUE config file: xmc-spark: config error: {e.value}")


def test_bad_run_key_and_stage_order(spark, params, tmp_path):
    with pytest.raises(RunKeyError, match="run key 'a b' must be") as e:
        run_stage(spark, "ingest", "a b", params, train="x")
    print(f"CATALOGUE run key: xmc-spark: error: {e.value}")
    with pytest.raises(StageOrderError, match="stage 'train' needs the output of stage 'ingest' for run key "
                                              "1999-01-01") as e:
        run_stage(spark, "train", "1999-01-01", params)
    print(f"CATALOGUE stage order: xmc-spark: error: {e.value}")

