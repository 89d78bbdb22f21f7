"""The one list of pipeline stages: name, implementation, dependencies, tables, config sections.

Everything that needs the stages reads them from here: the runner (:mod:`.runner`, behind
``xmc-spark run``, ``sweep`` and ``stage``), the command line's choices, the spark-submit
entry points, the Airflow DAG's test and the benchmarks. Importing this module needs neither
Spark nor numpy; each stage's implementation (``"module:function"``, called as
``function(ctx) -> StageResult``) is imported when the stage runs.

==========  ===========  ==========================================  ====================================
stage       needs        reads                                       writes (one partition per run key)
==========  ===========  ==========================================  ====================================
ingest      -            --train, --test (files, tables, folders)    ``train`` (per-sample input), ``test``
eagle       ingest       the aggregated --train folder                ``train``, ``eagle_embeddings``
                                                                     (rounds that keep their tree:
                                                                     ``eagle_tree``, ``label_embeddings``
                                                                     with ``embedding.write_table``)
tree        eagle        ``train`` (``eagle_tree``)                  ``tree`` (``label_embeddings`` with
                                                                     ``embedding.write_table``)
train       tree         ``train``, ``tree``                         ``weights``, ``slots`` (+ ``matcher``,
                                                                     ``clusters``, ``negatives``), the
                                                                     model folder
prime       train        ``train``, ``slots``, ``weights``           ``prime`` (encoder rows and label
                                                                     prototypes; mode off: nothing), the
                                                                     model folder's ``prime/``
knn         prime        ``train``, ``slots``, ``weights``           nothing (its record holds k, power and
                         (+ ``prime``: stacked on PRIME)             weight; mode off: nothing to do), the
                                                                     model folder's ``knn/``
predict     knn          ``test``, ``slots``, ``weights``,           ``predictions`` (+ ``tree_predictions``
                         ``prime`` (kNN: ``train``)                  when PRIME or kNN is on)
evaluate    predict      ``predictions``, ``test``, ``train``,       ``metrics`` (+ ``tree_p@k``...)
                         ``slots`` (+ ``tree_predictions``)
==========  ===========  ==========================================  ====================================

A stage may run only when every stage it needs (directly or through others) has a record for
the run key, made on the current records of *its* own needs: a rerun of a stage invalidates
every stage downstream of it until they rerun.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple


@dataclass(frozen=True)
class StageSpec:
    name: str
    impl: str                          # "module:function", function(ctx) -> StageResult
    needs: Tuple[str, ...]             # stages whose output this one reads (direct)
    reads: Tuple[str, ...]             # tables read
    writes: Tuple[str, ...]            # tables written
    sections: Tuple[str, ...]          # config sections it depends on (its MLflow params; see stage_sections)
    needs_test: bool = False           # only meaningful when a test set was ingested
    help: str = ""

    def function(self) -> Callable:
        module, func = self.impl.split(":")
        return getattr(importlib.import_module(module), func)


_P = "xmc_spark.pipeline"
STAGES: Dict[str, StageSpec] = {s.name: s for s in (
    StageSpec("ingest", f"{_P}:ingest_stage", (), (), ("train", "test"), ("ingest",),
              help="validate --train/--test and write the train and test tables"),
    StageSpec("eagle", f"{_P}:eagle_stage", ("ingest",), (),
              ("train", "eagle_embeddings", "eagle_tree", "label_embeddings"), ("eagle",),
              help="group-level labels -> per-sample training table (nothing to do for per-sample input)"),
    StageSpec("tree", f"{_P}:tree_stage", ("eagle",), ("train", "eagle_tree"), ("label_embeddings", "tree"),
              ("embedding", "tree"), help="PIFA label embeddings and the label tree (or EAGLE's kept tree)"),
    StageSpec("train", f"{_P}:train_stage", ("tree",), ("train", "tree"),
              ("weights", "slots", "matcher", "clusters", "negatives"), ("train", "clusters", "predict"),
              help="node classifiers (and overlapping clusters); the model folder"),
    StageSpec("prime", f"{_P}:prime_stage", ("train",), ("train", "slots", "weights"),
              ("prime",), ("prime", "embedding"), help="PRIME label prototypes: a retriever or a re-ranker of the tree "
              "(prime.mode; off: nothing to do)"),
    StageSpec("knn", f"{_P}:knn_stage", ("prime",), ("train", "slots", "weights", "prime"), (), ("knn",),
              help="kNN re-ranker of the tree (of PRIME's output when PRIME is on): k, power and weight chosen "
              "on held-out training rows (knn.mode; off: nothing to do)"),
    StageSpec("predict", f"{_P}:predict_stage", ("knn",), ("test", "slots", "weights", "prime", "train"),
              ("predictions", "tree_predictions"), ("predict",), needs_test=True,
              help="beam search over the test table (and PRIME or kNN, when on)"),
    StageSpec("evaluate", f"{_P}:evaluate_stage", ("predict",),
              ("predictions", "test", "train", "slots", "tree_predictions"),
              ("metrics",), ("eval",), needs_test=True, help="P@k, nDCG@k, PSP@k, recall@k, depth@k"),
)}
ORDER: Tuple[str, ...] = tuple(STAGES)


def upstream(name: str) -> List[str]:
    """Every stage ``name`` depends on, directly or not, in pipeline order."""
    seen = set()
    todo = list(STAGES[name].needs)
    while todo:
        s = todo.pop()
        if s not in seen:
            seen.add(s)
            todo.extend(STAGES[s].needs)
    return [s for s in ORDER if s in seen]


def downstream(name: str) -> List[str]:
    """Every stage that depends on ``name``, directly or not, in pipeline order."""
    return [s for s in ORDER if name in upstream(s)]


# the settings EAGLE's re-assignment rounds train and score their model with (pipeline.eagle_model_trainer)
ROUND_MODEL_SECTIONS: Tuple[str, ...] = ("embedding", "tree", "train", "predict")


def stage_sections(name: str, params) -> Tuple[str, ...]:
    """The config sections stage ``name``'s output depends on under ``params`` (a
    :class:`~.params.PipelineParams`): its :attr:`StageSpec.sections`, and for the eagle stage
    with ``eagle.refine_rounds`` > 0 also those of the round model it trains
    (:data:`ROUND_MODEL_SECTIONS`), for the knn stage with ``prime.mode`` on also ``prime``
    (stacked: it re-ranks PRIME's output, on PRIME's held-out rows). A keyed stage run logs them as
    its MLflow params, and resumes the key's MLflow run only when none of them holds another value
    there."""
    spec = STAGES[name]
    if name == "eagle" and params.eagle.refine_rounds > 0:
        return spec.sections + tuple(s for s in ROUND_MODEL_SECTIONS if s not in spec.sections)
    if name == "knn" and params.knn.mode != "off" and params.prime.mode != "off":
        return spec.sections + ("prime",)
    return spec.sections
