"""Every Delta table one stage hands to the next, declared once: :data:`TABLES` (name ->
StructType) and :func:`check_table`, the schema check a reader runs on each table it reads
(a :class:`SchemaError` naming the table and the column). Input files are checked by
:func:`check_samples_columns` instead, which also accepts castable types.

A column whose StructField metadata has ``optional: True`` may be absent (``label_weight``:
only EAGLE's training table carries it). Nullability is not checked (Delta reports every
column as nullable), nor are extra columns (the partition column ``run_key``).
"""
from __future__ import annotations

from typing import Dict, List

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .errors import XmcError


class IngestError(XmcError, ValueError):
    """Bad input: the message names the file (or table), the line (or row) and the problem."""


class SchemaError(IngestError):
    """A table handed from one stage to the next lacks a column or has the wrong type."""


OPTIONAL = "optional"   # StructField metadata key: the column may be absent


def _col(name: str, typ: T.DataType, optional: bool = False) -> T.StructField:
    return T.StructField(name, typ, True, {OPTIONAL: True} if optional else {})


_INTS = T.ArrayType(T.IntegerType())
_FLOATS = T.ArrayType(T.FloatType())

# what ingest writes (and input files are cast to): one row per sample, rows L2-normalized
SAMPLES_SCHEMA = T.StructType([
    T.StructField("sample_id", T.LongType(), False),
    T.StructField("feature_idx", _INTS, False),
    T.StructField("feature_val", _FLOATS, False),
    T.StructField("label_idx", _INTS, False),
    T.StructField("weight", T.FloatType(), False),
])
# a samples table as stages read it: EAGLE's training table adds each positive's weight
# (aligned with label_idx); the node trainer uses it when present
_SAMPLES_TABLE = T.StructType([*SAMPLES_SCHEMA.fields, _col("label_weight", _FLOATS, optional=True)])
_EMBEDDINGS = T.StructType([_col("label_idx", T.IntegerType()), _col("emb_idx", _INTS), _col("emb_val", _FLOATS)])
# label -> leaf; ``tree``: which tree of an ensemble (absent or 0: the one tree)
_SLOTS = T.StructType([_col("label_idx", T.IntegerType()), _col("node", T.LongType()),
                       _col("tree", T.IntegerType(), optional=True)])

TABLES: Dict[str, T.StructType] = {
    "train": _SAMPLES_TABLE,
    "test": _SAMPLES_TABLE,
    "input": _SAMPLES_TABLE,                 # `xmc-spark predict --data`
    "label_embeddings": _EMBEDDINGS,         # PIFA rows, L2-normalized; labels without samples absent
    "eagle_embeddings": _EMBEDDINGS,         # GRLR label embeddings
    "tree": _SLOTS,                          # the leaf of each label
    "eagle_tree": _SLOTS,                    # the last EAGLE round model's tree (eagle.refine_keep_tree)
    "clusters": _SLOTS,                      # overlapping clusters: a label may sit in several leaves
    "slots": _SLOTS,                         # the label -> leaf slots the final weights belong to
    # key: node id, or slot id at leaves; in an ensemble tree << 52 | id (kernels.tree.encode_keys)
    "weights": T.StructType([_col("is_leaf", T.BooleanType()), _col("key", T.LongType()),
                             _col("w_idx", _INTS), _col("w_val", _FLOATS)]),
    # train.negatives = tfn+man: the nodes (ensemble keys) the matcher's beam sends each sample to
    "negatives": T.StructType([_col("sample_id", T.LongType()), _col("man", T.ArrayType(T.LongType()))]),
    "matcher": T.StructType([_col("sample_id", T.LongType()), _col("leaf", T.LongType()),
                             _col("score", T.FloatType())]),
    "predictions": T.StructType([_col("sample_id", T.LongType()), _col("pred_labels", _INTS),
                                 _col("pred_scores", _FLOATS)]),
    # prime.mode = retrieve | rerank: the tree's own top-k, evaluated beside the final predictions
    "tree_predictions": T.StructType([_col("sample_id", T.LongType()), _col("pred_labels", _INTS),
                                      _col("pred_scores", _FLOATS)]),
    # PRIME's inference weights, one row per matrix row: name E (features x dim), Z (labels x
    # dim), W_res (dim x dim) / b_res (one row) with prime.residual
    "prime": T.StructType([_col("name", T.StringType()), _col("row", T.LongType()), _col("vec", _FLOATS)]),
    "metrics": T.StructType([_col("metric", T.StringType()), _col("value", T.DoubleType())]),
    "stage_info": T.StructType([_col("stage", T.StringType()), _col("info", T.StringType()),
                                _col("seconds", T.DoubleType())]),
}


def is_optional(field: T.StructField) -> bool:
    return bool(field.metadata.get(OPTIONAL))


def ddl(name: str) -> str:
    """The required columns of table ``name`` as a DDL string (for ``mapInArrow`` and friends)."""
    return ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in TABLES[name].fields if not is_optional(f))


EMBEDDING_SCHEMA = ddl("label_embeddings")
TREE_SCHEMA = ddl("tree") + ", tree int"
WEIGHTS_SCHEMA = ddl("weights")
MATCHER_SCHEMA = ddl("matcher")
PREDICTIONS_SCHEMA = ddl("predictions")


def schema_problems(schema: T.StructType, expected: T.StructType) -> List[str]:
    """What keeps ``schema`` from holding ``expected``: missing (non-optional) columns and
    columns of another type. Types compare without nullability; extra columns are fine."""
    found = {f.name: f.dataType for f in schema.fields}
    problems = []
    for f in expected.fields:
        want = f.dataType.simpleString()
        if f.name not in found:
            if not is_optional(f):
                problems.append(f"missing column '{f.name}' ({want})")
        elif found[f.name].simpleString() != want:
            problems.append(f"column '{f.name}' has type {found[f.name].simpleString()}, expected {want}")
    return problems


def check_table(df: DataFrame, name: str) -> DataFrame:
    """``df`` unchanged if it has table ``name``'s columns and types, else :class:`SchemaError`
    naming the table and the columns at fault. Looks at the schema only (no Spark job)."""
    if name not in TABLES:
        raise KeyError(f"table {name!r} is not declared in xmc_spark.schemas.TABLES "
                       f"(declared: {', '.join(sorted(TABLES))})")
    problems = schema_problems(df.schema, TABLES[name])
    if problems:
        found = ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in df.schema.fields)
        raise SchemaError(f"table '{name}': " + "; ".join(problems) + f" (found: {found})")
    return df


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
