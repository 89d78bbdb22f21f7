"""Column names and StructTypes of each stage's tables, plus validators with named errors."""
from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T


class IngestError(ValueError):
    """Bad input: the message names the file (or table), the line (or row) and the problem."""


class SchemaError(IngestError):
    """A table handed from one stage to the next lacks a column or has the wrong type."""


SAMPLES_SCHEMA = T.StructType([
    T.StructField("sample_id", T.LongType(), False),
    T.StructField("feature_idx", T.ArrayType(T.IntegerType()), False),
    T.StructField("feature_val", T.ArrayType(T.FloatType()), False),
    T.StructField("label_idx", T.ArrayType(T.IntegerType()), False),
    T.StructField("weight", T.FloatType(), False),
])

EMBEDDING_SCHEMA = "label_idx int, emb_idx array<int>, emb_val array<float>"
TREE_SCHEMA = "label_idx int, node long"
WEIGHTS_SCHEMA = "is_leaf boolean, key long, w_idx array<int>, w_val array<float>"
PREDICTIONS_SCHEMA = "sample_id long, pred_labels array<int>, pred_scores array<float>"

_NUMERIC_ARRAY = (T.IntegerType, T.LongType, T.ShortType, T.ByteType)
_FLOAT_ARRAY = (T.FloatType, T.DoubleType, T.IntegerType, T.LongType)


def check_samples_columns(df: DataFrame, where: str) -> DataFrame:
    """Check an input table has the samples columns (castable types); cast to the fixed schema."""
    fields = {f.name: f.dataType for f in df.schema.fields}
    problems = []
    wanted = {
        "sample_id": lambda t: isinstance(t, _NUMERIC_ARRAY),
        "feature_idx": lambda t: isinstance(t, T.ArrayType) and isinstance(t.elementType, _NUMERIC_ARRAY),
        "feature_val": lambda t: isinstance(t, T.ArrayType) and isinstance(t.elementType, _FLOAT_ARRAY),
        "label_idx": lambda t: isinstance(t, T.ArrayType) and isinstance(t.elementType, _NUMERIC_ARRAY),
    }
    for name, ok in wanted.items():
        if name not in fields:
            problems.append(f"missing column '{name}'")
        elif not ok(fields[name]):
            problems.append(f"column '{name}' has type {fields[name].simpleString()}, "
                            f"expected {SAMPLES_SCHEMA[name].dataType.simpleString()}")
    if "weight" in fields and not isinstance(fields["weight"], _FLOAT_ARRAY):
        problems.append(f"column 'weight' has type {fields['weight'].simpleString()}, expected float")
    if problems:
        raise SchemaError(f"{where}: wrong schema: " + "; ".join(problems) +
                          f" (found: {', '.join(f'{k} {v.simpleString()}' for k, v in fields.items())})")
    out = df.select(
        F.col("sample_id").cast("long"),
        F.coalesce(F.col("feature_idx").cast("array<int>"), F.array().cast("array<int>")).alias("feature_idx"),
        F.coalesce(F.col("feature_val").cast("array<float>"), F.array().cast("array<float>")).alias("feature_val"),
        F.coalesce(F.col("label_idx").cast("array<int>"), F.array().cast("array<int>")).alias("label_idx"),
        *([F.col("weight").cast("float")] if "weight" in fields else []),
    )
    return out
