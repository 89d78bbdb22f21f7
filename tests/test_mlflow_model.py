"""The MLflow pyfunc model: logged, registered with an alias, loaded in a process without Spark."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from tests.conftest import random_problem
from xmc_spark.mlflow_model import frame_to_csr, score_frame
from xmc_spark.model import XMCModel
from xmc_spark.params import TreeParams

ROOT = Path(__file__).resolve().parents[1]


def _frame(X):
    X = sp.csr_matrix(X)
    return pd.DataFrame({"sample_id": np.arange(X.shape[0]) + 100,
                         "feature_idx": [X.indices[X.indptr[i]:X.indptr[i + 1]].tolist() for i in range(X.shape[0])],
                         "feature_val": [X.data[X.indptr[i]:X.indptr[i + 1]].tolist() for i in range(X.shape[0])]})


def test_frame_to_csr_normalizes_and_names_bad_rows():
    f = pd.DataFrame({"feature_idx": [[0, 2], [], [1]], "feature_val": [[3.0, 4.0], [], [2.0]]})
    X = frame_to_csr(f, 3, normalize=True)
    np.testing.assert_allclose(X.toarray(), [[0.6, 0, 0.8], [0, 0, 0], [0, 1, 0]], rtol=1e-6)
    np.testing.assert_allclose(frame_to_csr(f, 3, normalize=False).toarray()[0], [3, 0, 4])
    with pytest.raises(ValueError, match=r"input row 1: feature id out of range \[0, 3\): feature_idx 3"):
        frame_to_csr(pd.DataFrame({"feature_idx": [[0], [3]], "feature_val": [[1.0], [1.0]]}), 3, True)
    with pytest.raises(ValueError, match="input row 0: feature value is NaN"):
        frame_to_csr(pd.DataFrame({"feature_idx": [[0]], "feature_val": [[float("nan")]]}), 3, True)
    with pytest.raises(ValueError, match="input row 1: feature_idx and feature_val have different lengths"):
        frame_to_csr(pd.DataFrame({"feature_idx": [[0], [1, 2]], "feature_val": [[1.0], [1.0]]}), 3, True)
    with pytest.raises(ValueError, match="lacks column"):
        frame_to_csr(pd.DataFrame({"x": [1]}), 3, True)


# folder kinds: (parts of the chunked weights, trees)
FOLDERS = {"whole": (0, 1), "chunked": (3, 1), "ensemble": (0, 2)}


def test_pyfunc_logged_registered_and_loaded_without_spark(tmp_path):
    """A whole, a chunked and an ensemble folder, each logged and registered (alias champion) in
    one store, then loaded by alias and scored in one fresh process where Spark cannot be imported."""
    import mlflow

    from xmc_spark.kernels.sparse import l2_normalize_rows
    from xmc_spark.mlflow_model import log_model
    from xmc_spark.model import EnsembleModel, ModelTrainParams
    X, Y = random_problem(n=150, seed=4)
    X = sp.csr_matrix(l2_normalize_rows(X), dtype=np.float32)   # ingested rows
    frame = _frame(X[:40] * 3.0)                      # raw rows: the pyfunc normalizes like ingest
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("t")
    wants = {}
    for kind, (parts, trees) in FOLDERS.items():
        folder = tmp_path / kind
        tree = TreeParams(max_leaf_size=4, ensemble=trees)
        model = (XMCModel if trees == 1 else EnsembleModel).train_local(X, Y, ModelTrainParams(tree=tree))
        model.save(str(folder), parts=parts)
        assert (folder / "weights").is_dir() == bool(parts), kind
        assert (folder / "tree-1").is_dir() == (trees == 2), kind
        want = score_frame(model, frame, topk=3)
        labels, _ = model.predict(X[:40], topk=3)         # X is already normalized
        assert [list(r) for r in want["labels"]] == [[int(v) for v in r if v >= 0] for r in labels], kind
        with mlflow.start_run() as run:
            _, version = log_model(str(folder), f"xmc-{kind}", "champion")
        assert version == 1
        assert mlflow.MlflowClient().get_model_version_by_alias(f"xmc-{kind}", "champion").run_id == run.info.run_id
        wants[f"models:/xmc-{kind}@champion"] = want
    got = _score_without_spark(tmp_path, uri, list(wants), frame)
    for model_uri, want in wants.items():
        assert got[model_uri]["ids"] == list(range(100, 140))
        assert got[model_uri]["labels"] == [list(map(int, x)) for x in want["labels"]], model_uri
        np.testing.assert_allclose(np.concatenate(got[model_uri]["scores"]), np.concatenate(want["scores"]),
                                   rtol=1e-6)


def _score_without_spark(tmp_path, uri, model_uris, frame, topk=3):
    """Load each of ``model_uris`` in one fresh process where Spark cannot be imported; per URI
    its top-k of ``frame``."""
    frame.to_json(tmp_path / "frame.json", orient="records")
    check = f"""
import sys, json
sys.modules["pyspark"] = None            # importing Spark would fail
import mlflow, pandas as pd
mlflow.set_tracking_uri("{uri}")
frame = pd.read_json("{tmp_path / 'frame.json'}", orient="records")
got = {{}}
for model_uri in {json.dumps(list(model_uris))}:
    out = mlflow.pyfunc.load_model(model_uri).predict(frame, params={{"topk": {topk}}})
    got[model_uri] = {{"ids": out["sample_id"].tolist(), "labels": [list(map(int, x)) for x in out["labels"]],
                      "scores": [list(map(float, x)) for x in out["scores"]]}}
print(json.dumps(got))
"""
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_pyfunc_applies_prime_from_the_model_folder(tmp_path):
    """A folder with prime/ scores with PRIME's mode (here re-ranking by a head of random unit
    vectors, weight 0.4, so labels move), without Spark (retrieval: tests/stages/test_prime_stage.py)."""
    import mlflow

    from xmc_spark.kernels.sparse import l2_normalize_rows
    from xmc_spark.mlflow_model import log_model
    from xmc_spark.prime_model import PrimedModel, PrimeHead
    X, Y = random_problem(n=150, seed=4)
    X = sp.csr_matrix(l2_normalize_rows(X), dtype=np.float32)
    tree = XMCModel.train_local(X, Y, tree=TreeParams(max_leaf_size=4))
    rng = np.random.default_rng(0)
    unit = lambda a: (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)  # noqa: E731
    head = PrimeHead("rerank", 8, 0.4, {"E": rng.normal(size=(X.shape[1], 6)).astype(np.float32),
                                    "Z": unit(rng.normal(size=(tree.n_labels, 6)))})
    PrimedModel(tree, head).save(str(tmp_path / "model"))
    frame = _frame(X[:40] * 2.0)
    want = score_frame(PrimedModel(tree, head), frame, topk=3)
    tree_only = score_frame(tree, frame, topk=3)
    assert [list(r) for r in want["labels"]] != [list(r) for r in tree_only["labels"]]   # PRIME changes the answer
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("t")
    with mlflow.start_run():
        model_uri, _ = log_model(str(tmp_path / "model"))
    got = _score_without_spark(tmp_path, uri, [model_uri], frame)[model_uri]
    assert got["labels"] == [list(map(int, x)) for x in want["labels"]]
    np.testing.assert_allclose(np.concatenate(got["scores"]), np.concatenate(want["scores"]), rtol=1e-5)


def test_package_source_from_a_folder_and_from_a_wheel(tmp_path):
    import zipfile

    import xmc_spark
    from xmc_spark.mlflow_model import package_source
    here = Path(xmc_spark.__file__).parent
    assert package_source(str(here / "mlflow_model.py"), str(tmp_path)) == str(here.resolve())
    whl = tmp_path / "xmc_spark-0.1.0-py3-none-any.whl"       # as under spark-submit --py-files
    with zipfile.ZipFile(whl, "w") as z:
        for f in here.rglob("*.py"):
            z.write(f, "xmc_spark/" + f.relative_to(here).as_posix())
    out = Path(package_source(str(whl / "xmc_spark" / "mlflow_model.py"), str(tmp_path / "x")))
    assert out == tmp_path / "x" / "xmc_spark"
    assert (out / "mlflow_model.py").read_bytes() == (here / "mlflow_model.py").read_bytes()
    assert (out / "kernels" / "beam_search.py").is_file()
