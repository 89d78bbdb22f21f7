"""Declared tables: check_table names the table and the column at fault, looks at the schema
only, and every declared schema is what the pipeline really writes."""
import numpy as np
import pytest
import scipy.sparse as sp
from pyspark.sql import types as T

from tests.conftest import random_problem, write_xc
from xmc_spark.schemas import SAMPLES_SCHEMA, TABLES, SchemaError, check_samples_columns, check_table, ddl, is_optional

ALL_TABLES = {"train", "test", "input", "label_embeddings", "tree", "weights", "slots", "matcher", "clusters",
              "predictions", "metrics", "stage_info", "eagle_embeddings", "negatives", "prime", "tree_predictions",
              "eagle_tree"}


def _empty(spark, schema):
    return spark.createDataFrame([], schema)


def test_every_table_is_declared():
    assert set(TABLES) == ALL_TABLES
    assert [f.name for f in TABLES["train"].fields] == [f.name for f in SAMPLES_SCHEMA.fields] + ["label_weight"]
    assert [f.name for f in TABLES["train"].fields if is_optional(f)] == ["label_weight"]


@pytest.mark.parametrize("name", sorted(ALL_TABLES))
def test_declared_schema_passes_and_ddl_parses(spark, name):
    df = _empty(spark, TABLES[name])
    assert check_table(df, name) is df
    required = T.StructType([f for f in TABLES[name].fields if not is_optional(f)])
    parsed = _empty(spark, ddl(name)).schema
    assert [(f.name, f.dataType.simpleString()) for f in parsed.fields] == \
        [(f.name, f.dataType.simpleString()) for f in required.fields]


def test_missing_column_names_table_and_column(spark):
    df = _empty(spark, "label_idx int, emb_idx array<int>")
    with pytest.raises(SchemaError, match=r"table 'label_embeddings': missing column 'emb_val' \(array<float>\)"):
        check_table(df, "label_embeddings")


def test_wrong_type_names_table_column_and_types(spark):
    df = _empty(spark, "label_idx int, node string")
    with pytest.raises(SchemaError, match="table 'tree': column 'node' has type string, expected bigint"):
        check_table(df, "tree")
    # an int where a long is declared is a different table, not a castable one
    with pytest.raises(SchemaError, match="table 'matcher': column 'leaf' has type int, expected bigint"):
        check_table(_empty(spark, "sample_id long, leaf int, score float"), "matcher")
    # element types of arrays count too
    with pytest.raises(SchemaError, match="column 'w_val' has type array<double>, expected array<float>"):
        check_table(_empty(spark, "is_leaf boolean, key long, w_idx array<int>, w_val array<double>"), "weights")


def test_every_problem_is_reported(spark):
    with pytest.raises(SchemaError) as e:
        check_table(_empty(spark, "stage int, seconds double"), "stage_info")
    msg = str(e.value)
    assert "column 'stage' has type int, expected string" in msg and "missing column 'info'" in msg
    assert "(found: stage int, seconds double)" in msg


def test_extra_columns_and_optional_columns(spark):
    base = "sample_id long, feature_idx array<int>, feature_val array<float>, label_idx array<int>, weight float"
    check_table(_empty(spark, base), "train")                                    # label_weight may be absent
    check_table(_empty(spark, base + ", label_weight array<float>, run_key string"), "train")
    with pytest.raises(SchemaError, match="table 'test': column 'label_weight' has type array<double>"):
        check_table(_empty(spark, base + ", label_weight array<double>"), "test")  # present: type checked
    with pytest.raises(SchemaError, match="table 'input': missing column 'weight'"):
        check_table(_empty(spark, base.rsplit(",", 1)[0]), "input")


def test_nullability_is_not_checked(spark):
    strict = T.StructType([T.StructField("metric", T.StringType(), False),
                           T.StructField("value", T.DoubleType(), False)])
    check_table(_empty(spark, strict), "metrics")


def test_unknown_table_is_a_bug_not_a_schema_error(spark):
    with pytest.raises(KeyError, match="not declared"):
        check_table(_empty(spark, "x int"), "nosuch")


def test_check_table_runs_no_spark_job(spark, tmp_path):
    path = str(tmp_path / "tree")
    spark.createDataFrame([(0, 1), (1, 2)], "label_idx int, node long").write.format("delta").save(path)
    df = spark.read.format("delta").load(path)
    sc = spark.sparkContext
    sc.setJobGroup("xmc-schema-check", "check_table must not run a job")
    try:
        check_table(df, "tree")
        with pytest.raises(SchemaError):
            check_table(df, "weights")
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert list(sc.statusTracker().getJobIdsForGroup("xmc-schema-check")) == []
    sc.setJobGroup("xmc-schema-probe", "a real job: the probe does see jobs")
    try:
        df.count()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert list(sc.statusTracker().getJobIdsForGroup("xmc-schema-probe"))


def test_input_files_keep_their_castable_check(spark):
    df = spark.createDataFrame([(1, [3], [1], [0])], "sample_id int, feature_idx array<long>, "
                                                    "feature_val array<int>, label_idx array<int>")
    out = check_samples_columns(df, "in.parquet")          # castable types are cast
    assert out.schema.simpleString() == ("struct<sample_id:bigint,feature_idx:array<int>,feature_val:array<float>,"
                                         "label_idx:array<int>>")
    with pytest.raises(SchemaError, match="in.parquet: wrong schema: missing column 'label_idx'"):
        check_samples_columns(df.drop("label_idx"), "in.parquet")


# ---- the declared schemas are what the pipeline writes ----------------------------------------

@pytest.fixture(scope="module")
def written(tmp_path_factory, spark):
    """Every table, written by the command line on a tiny aggregated input (EAGLE with a round that
    keeps its tree and its PIFA table, overlapping clusters, matcher-aware negatives, PRIME re-ranking, stage jobs with
    a run key) and by `predict`."""
    from xmc_spark.cli import main
    from xmc_spark.storage import RUN_KEY

    d = tmp_path_factory.mktemp("written")
    X, Y = random_problem(n=120, d=24, L=8, seed=5)
    keep = np.flatnonzero(X.getnnz(axis=1) > 0)[:96]     # samples.txt has no labels: no blank lines
    X, Y = X[keep], Y[keep]
    agg = d / "agg"
    agg.mkdir()
    write_xc(agg / "samples.txt", X[:72], sp.csr_matrix((72, 8)))
    Yd = Y[:72].toarray() > 0
    lines = []
    for g in range(0, 72, 3):
        labs = np.flatnonzero(Yd[g:g + 3].any(axis=0)).tolist() or [0]
        lines.append(",".join(map(str, labs)) + " " + " ".join(map(str, range(g, g + 3))))
    (agg / "groups.txt").write_text("\n".join(lines) + "\n")
    write_xc(d / "test.txt", X[72:], Y[72:])
    # PRIME's h_l from label features (the XC repository's 'rows cols' sparse file): label i has feature i
    (d / "lbl_X_Xf.txt").write_text("8 24\n" + "".join(f"{i}:1 {i + 8}:0.5\n" for i in range(8)))
    common = ["--set", "mlflow.enabled=false", "--set", "tree.max_leaf_size=3", "--set", "eagle.T=2"]
    root = d / "root"
    assert main(["stage", "all", "--run-key", "k1", "--train", str(agg), "--test", str(d / "test.txt"),
                 "--root", str(root), "--set", "eagle.refine_rounds=1", "--set", "clusters.copies=2",
                 "--set", "embedding.write_table=true",
                 "--set", "clusters.beam_size=2",
                 "--set", "train.negatives=tfn+man", "--set", "prime.mode=rerank", "--set", "prime.epochs=1",
                 "--set", f"prime.label_features={d / 'lbl_X_Xf.txt'}", "--set", "prime.dim=4",
                 "--set", "prime.ffn=8", "--set", "prime.K=4", *common]) == 0
    assert main(["predict", "--model", str(root / "models" / "k1"), "--data", str(d / "test.txt"),
                 "--out", str(d / "pred"), *common]) == 0
    tables = {p.name: p for p in (root / "tables").iterdir()}
    tables["input"] = d / "pred" / "tables" / "input"
    return {name: spark.read.format("delta").load(str(p)).drop(RUN_KEY) for name, p in tables.items()}


def test_written_tables_match_their_declarations(written):
    assert set(written) == ALL_TABLES
    for name, df in written.items():
        check_table(df, name)
        # no undeclared column either: the declaration is the whole table
        assert [f.name for f in df.schema.fields] == \
            [f.name for f in TABLES[name].fields if f.name in df.columns], name
    assert "label_weight" in written["train"].columns          # EAGLE's training table carries it
    info = {r["stage"]: r["info"] for r in written["stage_info"].collect()}
    assert '"prime.h_l_input": "label_features"' in info["prime"]  # prime.label_features reached the stage
