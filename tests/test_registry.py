"""The stage registry: dependencies, implementations, and every consumer reading the same list."""
import pytest

from xmc_spark.registry import ORDER, STAGES, downstream, upstream


def test_order_and_closures():
    assert ORDER == ("ingest", "eagle", "tree", "train", "prime", "knn", "predict", "evaluate")
    assert upstream("ingest") == []
    assert upstream("evaluate") == ["ingest", "eagle", "tree", "train", "prime", "knn", "predict"]
    assert downstream("tree") == ["train", "prime", "knn", "predict", "evaluate"]
    assert STAGES["predict"].needs == ("knn",) and STAGES["knn"].needs == ("prime",)
    assert STAGES["prime"].needs == ("train",)
    assert downstream("evaluate") == []
    for name, spec in STAGES.items():       # a stage only needs stages before it
        assert all(ORDER.index(n) < ORDER.index(name) for n in spec.needs)
        assert set(upstream(name)) == set(spec.needs).union(*(upstream(n) for n in spec.needs))


@pytest.mark.parametrize("name", ORDER)
def test_every_stage_resolves_to_a_function(name):
    assert callable(STAGES[name].function())


def test_command_line_choices_come_from_the_registry():
    from xmc_spark.cli import parse_arguments
    for name in (*ORDER, "all"):
        assert parse_arguments(["stage", name, "--run-key", "k"]).name == name
    with pytest.raises(SystemExit):
        parse_arguments(["stage", "nope", "--run-key", "k"])


def test_eagle_rounds_and_stacked_knn_add_sections():
    from xmc_spark.params import PipelineParams
    from xmc_spark.registry import ROUND_MODEL_SECTIONS, stage_sections
    p = PipelineParams()
    assert p.eagle.refine_rounds == 0
    for name in ORDER:                      # without rounds: each stage's own sections
        assert stage_sections(name, p) == STAGES[name].sections
    rounds = p.set_dotted("eagle.refine_rounds", 1)
    assert stage_sections("eagle", rounds) == ("eagle", *ROUND_MODEL_SECTIONS)
    assert stage_sections("train", rounds) == STAGES["train"].sections
    # the kNN re-ranker stacked on PRIME: its output depends on the prime section as well
    stacked = p.set_dotted("knn.mode", "rerank").set_dotted("prime.mode", "rerank")
    assert stage_sections("knn", stacked) == ("knn", "prime")
    assert stage_sections("knn", p.set_dotted("knn.mode", "rerank")) == ("knn",)
    assert stage_sections("prime", stacked) == STAGES["prime"].sections


@pytest.mark.parametrize("rounds", [0, 1])
def test_a_keyed_eagle_run_logs_its_round_models_settings(spark, tmp_path, rounds):
    # a keyed stage's MLflow run (real MLflow, a local store) holds the settings its output
    # depends on: with rounds, the eagle stage's round model's train/tree/embedding/predict ones
    import mlflow

    from xmc_spark.params import PipelineParams
    from xmc_spark.runner import Runner
    params = (PipelineParams().set_dotted("eagle.refine_rounds", rounds).set_dotted("train.C", 0.25)
              .set_dotted("mlflow.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db")
              .set_dotted("mlflow.artifact_location", str(tmp_path / "artifacts")))
    runner = Runner(spark, params, str(tmp_path / "root"), run_key="k")
    with runner._tracking(STAGES["eagle"]) as tracker:
        run_id = tracker.run_id
    mlflow.set_tracking_uri(params.mlflow.tracking_uri)
    logged = mlflow.get_run(run_id).data.params
    assert logged["eagle.refine_rounds"] == str(rounds)
    sections = {k.split(".")[0] for k in logged}
    if rounds:
        assert logged["train.C"] == "0.25" and {"tree", "embedding", "predict"} <= sections
    else:
        assert sections == {"eagle"}
