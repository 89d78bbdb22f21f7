import pytest

from xmc_spark.config import load_params
from xmc_spark.params import ConfigError, PipelineParams


def test_defaults_round_trip():
    p = PipelineParams()
    assert PipelineParams.from_dict(p.to_dict()) == p
    assert p.tree.max_leaf_size == 100 and p.train.C == 1.0 and p.predict.beam_size == 10


def test_dotted_override_is_typed():
    p = load_params(None, ["tree.max_leaf_size=10", "train.C=0.5", "mlflow.enabled=false"])
    assert p.tree.max_leaf_size == 10 and p.train.C == 0.5 and p.mlflow.enabled is False


@pytest.mark.parametrize("item,msg", [
    ("tree.max_leafsize=3", "unknown config key 'tree.max_leafsize'"),
    ("tree.max_leaf_size=ten", "expects an integer"),
    ("train.C=-1", "must be > 0"),
    ("nosuch=1", "unknown config key"),
    ("tree.max_leaf_size", "key=value"),
    ("tree.lambda=2.5", "must be in \\[0, 2\\]"),
    ("tree.lambda_prime=-1", "must be >= 0"),
    ("tree.f_tilde=fano", "greedy' or 'marginal"),
    ("predict.search=dfs", "layered, tree, adaptive"),
])
def test_bad_overrides(item, msg):
    with pytest.raises(ConfigError, match=msg):
        load_params(None, [item])


def test_config_file_unknown_section(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tree:\n  max_leaf_size: 8\ntrian:\n  C: 2\n")
    with pytest.raises(ConfigError, match="'trian'"):
        load_params(str(f))


def test_config_env_substitution(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("mlflow:\n  tracking_uri: ${XMC_TEST_URI}\n")
    monkeypatch.setenv("XMC_TEST_URI", "sqlite:///x.db")
    assert load_params(str(f)).mlflow.tracking_uri == "sqlite:///x.db"
    monkeypatch.delenv("XMC_TEST_URI")
    with pytest.raises(ConfigError, match="XMC_TEST_URI"):
        load_params(str(f))


def test_shipped_confs_load():
    from pathlib import Path
    for f in sorted((Path(__file__).resolve().parents[1] / "conf").glob("*.yaml")):
        load_params(str(f))


def test_tree_lambda_key_and_lambda_prime(tmp_path):
    p = load_params(None, ["tree.lambda=1.5"])
    assert p.tree.lam == 1.5 and p.tree.effective_lambda == 1.5
    p = load_params(None, ["tree.lambda_prime=1"])
    assert p.tree.effective_lambda == 1.0
    f = tmp_path / "c.yaml"
    f.write_text("tree:\n  lambda: 0.5\n  f_tilde: greedy\n")
    assert load_params(str(f)).tree.lam == 0.5
    with pytest.raises(ConfigError, match="exclusive"):
        load_params(None, ["tree.lambda=1", "tree.lambda_prime=2"])
    with pytest.raises(ConfigError, match="must be 2 when lambda > 0"):
        load_params(None, ["tree.lambda=1", "tree.nr_splits=4"])
    f.write_text("tree:\n  lambda: 0.5\n  lam: 0.5\n")
    with pytest.raises(ConfigError, match="are the same"):
        load_params(str(f))


def test_sweep_rejects_keys_it_cannot_vary():
    from xmc_spark.cli import main
    assert main(["sweep", "--train", "x", "--out", "y", "--key", "eagle.tau", "--values", "1,2"]) == 2
