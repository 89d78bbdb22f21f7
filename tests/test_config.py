from pathlib import Path

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


CONF = Path(__file__).resolve().parents[1] / "conf"


def test_shipped_confs_load(monkeypatch):
    import yaml
    assert sorted(f.name for f in CONF.glob("*.yaml")) == ["accurate.yaml", "databricks.yaml", "emr.yaml", "local.yaml"]
    # accurate.yaml holds algorithm sections only, over the defaults
    raw = yaml.safe_load((CONF / "accurate.yaml").read_text())
    assert set(raw) <= {"tree", "train", "clusters", "predict", "embedding", "prime", "knn"}
    acc = load_params([str(CONF / "local.yaml"), str(CONF / "accurate.yaml")])
    assert acc.tree.n_trees() == 3 and [acc.tree.for_tree(t).nr_splits for t in range(3)] == [2, 8, 32]
    assert acc.knn.mode == acc.prime.mode == "rerank" and acc.prime.val_frac == acc.knn.val_frac == 0.2
    assert acc.spark == PipelineParams().spark and acc.train.C == 0.5
    # local.yaml is the embedded default, verbatim
    assert load_params(str(CONF / "local.yaml")) == PipelineParams()
    monkeypatch.setenv("XMC_BUCKET", "team-bucket")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
    for env in ("databricks", "emr"):
        raw = yaml.safe_load((CONF / f"{env}.yaml").read_text())
        # environment files hold Spark, paths and MLflow settings only: no algorithm params
        assert set(raw) == {"spark", "paths", "mlflow"}, env
        p = load_params(str(CONF / f"{env}.yaml"))
        assert p.spark.master == "" and not p.spark.delta_from_maven
        assert p.tree == PipelineParams().tree
    emr = load_params(str(CONF / "emr.yaml"))
    assert emr.paths.root == "s3://team-bucket/xmc-spark" and emr.mlflow.tracking_uri == "https://mlflow.example.com"
    dbx = load_params(str(CONF / "databricks.yaml"))
    assert dbx.paths.root == "/Volumes/main/xmc/runs" and dbx.mlflow.registered_model == "main.xmc.xmc_spark"
    monkeypatch.delenv("XMC_BUCKET")
    with pytest.raises(ConfigError, match="environment variable XMC_BUCKET is not set"):
        load_params(str(CONF / "emr.yaml"))


def test_configs_layer_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XMC_BUCKET", "b")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://m")
    exp = tmp_path / "exp.yaml"
    exp.write_text("tree:\n  max_leaf_size: 8\nspark:\n  conf:\n    spark.executor.memory: 30g\n")
    p = load_params([str(CONF / "emr.yaml"), str(exp)], ["train.C=2"])
    assert p.tree.max_leaf_size == 8 and p.train.C == 2.0 and p.paths.root == "s3://b/xmc-spark"
    # mappings merge key by key: the experiment's executor memory, the environment's other Spark conf
    assert p.spark.conf["spark.executor.memory"] == "30g" and p.spark.conf["spark.sql.shuffle.partitions"] == "200"


def test_secrets_from_the_environment_are_masked(tmp_path, monkeypatch, capsys):
    import logging

    from xmc_spark import secrets
    from xmc_spark.cli import main
    monkeypatch.setenv("XMC_S3_SECRET_KEY", "s3cr3t-value-42")
    monkeypatch.setenv("XMC_BUCKET_NAME", "plain-bucket")
    f = tmp_path / "c.yaml"
    f.write_text("spark:\n  conf:\n    spark.hadoop.fs.s3a.secret.key: ${XMC_S3_SECRET_KEY}\n"
                 "paths:\n  root: s3://${XMC_BUCKET_NAME}/x\n")
    p = load_params(str(f))
    assert p.spark.conf["spark.hadoop.fs.s3a.secret.key"] == "s3cr3t-value-42"   # Spark gets the value
    assert main(["params", "--config", str(f)]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t-value-42" not in out and "spark.hadoop.fs.s3a.secret.key: '***'" in out
    assert "plain-bucket" in out                      # not a secret-looking name: shown
    rec = logging.LogRecord("x", logging.INFO, "f", 1, "conf %s", ("token=s3cr3t-value-42",), None)
    secrets.RedactingFilter().filter(rec)
    assert rec.getMessage() == "conf token=***"


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
    # kNN stacked on PRIME's re-ranking re-ranks at most PRIME's pool
    stacked = ["prime.mode=rerank", "knn.mode=rerank", "prime.K=50"]
    with pytest.raises(ConfigError, match=r"'knn.K' \(100\) must be <= prime.K \(50\) when the kNN re-ranker"):
        load_params(None, stacked)
    assert load_params(None, [*stacked, "knn.K=50"]).knn.K == 50      # checked once every override is in
    assert load_params(None, ["prime.mode=retrieve", "knn.mode=rerank", "prime.K=50"]).knn.K == 100
    with pytest.raises(ConfigError, match="must be 2 when lambda > 0"):
        load_params(None, ["tree.lambda=1", "tree.nr_splits=4"])
    f.write_text("tree:\n  lambda: 0.5\n  lam: 0.5\n")
    with pytest.raises(ConfigError, match="are the same"):
        load_params(str(f))


def test_sweep_rejects_keys_it_cannot_vary():
    from xmc_spark.cli import main
    assert main(["sweep", "--train", "x", "--out", "y", "--key", "eagle.tau", "--values", "1,2"]) == 2


def _old_key(caplog, new_key):
    """Context: exactly one DeprecationWarning and one logged warning, both naming ``new_key``."""
    import contextlib
    import logging

    @contextlib.contextmanager
    def ctx():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="xmc_spark.params"):
            with pytest.warns(DeprecationWarning, match=new_key) as rec:
                yield
        assert len([w for w in rec if issubclass(w.category, DeprecationWarning)]) == 1
        assert [r.getMessage() for r in caplog.records] == [str(rec[0].message)]
    return ctx()


def test_clusters_copies_and_the_old_key_lam(tmp_path, caplog):
    assert PipelineParams().clusters.copies == 1
    assert load_params(None, ["clusters.copies=3"]).clusters.copies == 3
    with _old_key(caplog, "use 'clusters.copies'"):
        assert load_params(None, ["clusters.lam=2"]).clusters.copies == 2
    f = tmp_path / "c.yaml"
    f.write_text("clusters:\n  lam: 3\n  beam_size: 4\n")
    with _old_key(caplog, "config key 'clusters.lam' is deprecated: use 'clusters.copies'"):
        p = load_params(str(f))
    assert (p.clusters.copies, p.clusters.beam_size) == (3, 4)
    assert "lam" not in p.clusters.to_dict() and p.flat()["clusters.copies"] == 3
    with pytest.raises(ConfigError, match="'clusters.copies' must be >= 1"):
        load_params(None, ["clusters.copies=0"])
    f.write_text("clusters:\n  lam: 3\n  copies: 2\n")
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="are the same"):
        load_params(str(f))
    with pytest.warns(DeprecationWarning, match="use ClustersParams.copies"):
        assert p.clusters.lam == 3                       # read-only, for callers not yet switched
    with pytest.raises(AttributeError):
        p.clusters.lam = 1


def test_tree_lambda_is_not_deprecated():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_params(None, ["tree.lambda=0.5", "tree.lam=0.5"]).tree.lam == 0.5


def test_embedding_method_is_gone_and_the_old_key_ignored(tmp_path, caplog):
    assert "method" not in PipelineParams().embedding.to_dict()
    with _old_key(caplog, "'embedding.method' is deprecated and ignored"):
        p = load_params(None, ["embedding.method=pifa"])
    assert p == PipelineParams()
    f = tmp_path / "c.yaml"
    f.write_text("embedding:\n  method: pifa\n  normalize_y: false\n")
    with _old_key(caplog, "'embedding.method' is deprecated and ignored"):
        assert load_params(str(f)).embedding.normalize_y is False


def test_dotted_keys_walk_sections_and_mappings():
    with pytest.raises(ConfigError, match="unknown config key 'tree.lam.x'"):
        load_params(None, ["tree.lam.x=1"])
    with pytest.raises(ConfigError, match="unknown config key 'spark.conf.nosuch': Spark settings .* 'spark.'"):
        load_params(None, ["spark.conf.nosuch=1"])
    p = load_params(None, ['spark.conf={"spark.executor.memory": "1g"}'])
    assert p.spark.conf == {"spark.executor.memory": "1g"}
    # one Spark setting added to the defaults (its key has dots of its own)
    p = load_params(None, ["spark.conf.spark.eventLog.enabled=true", "spark.conf.spark.sql.shuffle.partitions=64"])
    assert p.spark.conf["spark.eventLog.enabled"] == "true" and p.spark.conf["spark.sql.shuffle.partitions"] == "64"
    assert p.spark.conf["spark.driver.memory"] == PipelineParams().spark.conf["spark.driver.memory"]
    # a whole section as JSON: the old key inside it is resolved (and warned about) too
    with pytest.warns(DeprecationWarning, match="clusters.copies"):
        p = load_params(None, ['clusters={"lam": 2, "rounds": 2}'])
    assert (p.clusters.copies, p.clusters.rounds) == (2, 2)


def test_prime_section_defaults_are_the_kernels_and_bad_values_name_the_key():
    from xmc_spark.kernels.prime import PrimeParams as KernelParams
    p = PipelineParams()
    assert p.prime.mode == "off" and p.prime.K == 100
    assert p.prime.kernel() == KernelParams()            # every hyper-parameter defaults as in the kernel
    q = p.set_dotted("prime.mode", "rerank").set_dotted("prime.margin_variant", "fixed")
    assert q.prime.kernel(0.6, 2.0) == KernelParams(margin_variant="fixed", propensity_a=0.6, propensity_b=2.0)
    for key, bad, msg in (("prime.mode", "on", "'prime.mode' must be off, retrieve or rerank"),
                          ("prime.K", 0, "'prime.K' must be >= 1"),
                          ("prime.val_frac", 1.0, "'prime.val_frac' must be in"),
                          ("prime.gamma_min", 0.5, "'prime.gamma_min' and gamma_max"),
                          ("prime.margin_variant", "x", "'prime.margin_variant' must be triplet"),
                          ("prime.dim", "big", "'prime.dim' expects an integer")):
        with pytest.raises(ConfigError, match=msg):
            p.set_dotted(key, bad)


def test_unquoted_off_in_yaml_is_the_word_off(tmp_path):
    """YAML 1.1 reads an unquoted ``off`` as false: a string key takes it as "off" (prime.mode,
    train.max_node_rows), and a key that does not accept "off" still names itself."""
    f = tmp_path / "c.yaml"
    f.write_text("prime:\n  mode: off\ntrain:\n  max_node_rows: off\n")
    p = load_params(str(f))
    assert p.prime.mode == "off" and p.train.max_node_rows == "off"
    f.write_text("train:\n  negatives: off\n")
    with pytest.raises(ConfigError, match="negatives"):
        load_params(str(f))
