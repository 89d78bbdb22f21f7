"""The stage registry: dependencies, implementations, and every consumer reading the same list."""
import pytest

from xmc_spark.registry import ORDER, STAGES, downstream, upstream


def test_order_and_closures():
    assert ORDER == ("ingest", "eagle", "tree", "train", "prime", "predict", "evaluate")
    assert upstream("ingest") == []
    assert upstream("evaluate") == ["ingest", "eagle", "tree", "train", "prime", "predict"]
    assert downstream("tree") == ["train", "prime", "predict", "evaluate"]
    assert STAGES["predict"].needs == ("prime",) and STAGES["prime"].needs == ("train",)
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
