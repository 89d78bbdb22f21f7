"""The trained model as an MLflow pyfunc model: it loads and scores without Spark.

Input: a pandas DataFrame with ``feature_idx`` (list of 0-based feature ids) and
``feature_val`` (list of values) per row, raw (rows are L2-normalized here when the model was
trained on normalized rows, as ingest does); any other column (e.g. ``sample_id``) is passed
through. Output: the same rows with ``labels`` (top-k label ids, best first) and ``scores``.
Optional inference params: ``topk``, ``beam_size``. A model folder with ``prime/`` (the prime
stage's head, :mod:`.prime_model`) scores with PRIME's mode (retrieval or re-ranking).

``log_model`` logs a model folder (:meth:`XMCModel.save`) as ``<run>/model`` with the
``xmc_spark`` package as code, and registers it with an alias when asked.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import pyarrow as pa
import scipy
import scipy.sparse as sp

from .kernels.sparse import csr_from_lists, normalize_lists

log = logging.getLogger("xmc_spark.mlflow_model")

INPUT_COLUMNS = ("feature_idx", "feature_val")


def frame_to_csr(frame: pd.DataFrame, n_features: int, normalize: bool) -> sp.csr_matrix:
    """Rows of list columns -> CSR through Arrow offsets (no per-row Python); checked."""
    missing = [c for c in INPUT_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"input frame lacks column(s) {missing}; expected {list(INPUT_COLUMNS)} (lists per row)")
    idx = pa.array(frame["feature_idx"], type=pa.list_(pa.int64()), from_pandas=True)
    val = pa.array(frame["feature_val"], type=pa.list_(pa.float64()), from_pandas=True)
    idx = idx.fill_null(pa.scalar([], type=idx.type)) if idx.null_count else idx
    val = val.fill_null(pa.scalar([], type=val.type)) if val.null_count else val
    ioff, voff = np.asarray(idx.offsets), np.asarray(val.offsets)
    if not np.array_equal(np.diff(ioff), np.diff(voff)):
        row = int(np.flatnonzero(np.diff(ioff) != np.diff(voff))[0])
        raise ValueError(f"input row {row}: feature_idx and feature_val have different lengths")
    cols = idx.values.to_numpy(zero_copy_only=False)[ioff[0]:ioff[-1]]
    data = val.values.to_numpy(zero_copy_only=False)[voff[0]:voff[-1]]
    rows = np.repeat(np.arange(len(frame)), np.diff(ioff))
    for bad, what in (((cols < 0) | (cols >= n_features), f"feature id out of range [0, {n_features})"),
                      (~np.isfinite(data), "feature value is NaN or infinite")):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"input row {int(rows[i])}: {what}: feature_idx {int(cols[i])}, value {data[i]}")
    X = csr_from_lists(ioff, cols, data, n_features)        # repeated indices summed, as ingest does
    if normalize:
        X.data = normalize_lists(X.indptr, X.data)
    return X


def score_frame(model, frame: pd.DataFrame, topk: Optional[int] = None, beam_size: Optional[int] = None):
    X = frame_to_csr(frame, model.n_features, model.normalize)
    labels, scores = model.predict(X, beam_size=beam_size, topk=topk)
    keep = labels >= 0
    counts = keep.sum(axis=1)
    out = frame.drop(columns=[c for c in INPUT_COLUMNS if c in frame.columns]).reset_index(drop=True).copy()
    out["labels"] = np.split(labels[keep].astype(np.int64), np.cumsum(counts)[:-1]) if len(frame) else []
    out["scores"] = np.split(scores[keep].astype(np.float64), np.cumsum(counts)[:-1]) if len(frame) else []
    return out


def package_source(module_file: str, tmp: str) -> str:
    """The folder of the xmc_spark package, for MLflow's ``code_paths``. Imported from a wheel
    or zip (``spark-submit --py-files``) the package is not a folder: its files are extracted
    into ``tmp`` first."""
    pkg = Path(module_file).parent
    if pkg.is_dir():
        return str(pkg.resolve())
    archive = next((p for p in pkg.parents if p.is_file()), None)
    if archive is None or not zipfile.is_zipfile(archive):
        raise FileNotFoundError(f"cannot find the xmc_spark package files at {pkg}")
    inner = pkg.relative_to(archive).as_posix().rstrip("/") + "/"
    with zipfile.ZipFile(archive) as z:
        members = [n for n in z.namelist() if n.startswith(inner) and not n.endswith("/")]
        for n in members:
            dest = Path(tmp) / "xmc_spark" / n[len(inner):]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(n))
    return str(Path(tmp) / "xmc_spark")


def _python_model_class():
    import mlflow.pyfunc

    class XMCPyfuncModel(mlflow.pyfunc.PythonModel):
        """Beam search of an xmc-spark model over a pandas frame of sparse rows."""

        def load_context(self, context):
            from xmc_spark.prime_model import load
            self.model = load(context.artifacts["xmc_model"])     # with PRIME when the folder has prime/

        def predict(self, context, model_input, params=None):
            params = params or {}
            return score_frame(self.model, model_input, topk=params.get("topk"), beam_size=params.get("beam_size"))

    return XMCPyfuncModel


def log_model(model_dir: str, registered_model: str = "", alias: str = "", name: str = "model"):
    """Log ``model_dir`` as a pyfunc model in the active run; register it (+ alias) if named.
    Returns (model uri, registered version or None)."""
    import mlflow
    from mlflow.models import ModelSignature, infer_signature
    from mlflow.types.schema import ColSpec, Schema

    from .model import read_header
    from .params import PredictParams

    param, _, _ = read_header(model_dir)        # the header only: a chunked model may not fit here
    n_features, pred = int(param["n_features"]), PredictParams.from_dict(param["pred_params"])
    rng = np.random.default_rng(0)
    k = min(3, n_features)
    example = pd.DataFrame({"sample_id": [0],
                            "feature_idx": [np.sort(rng.choice(n_features, k, replace=False)).tolist()],
                            "feature_val": [[1.0] * k]})
    output = pd.DataFrame({"sample_id": [0], "labels": [np.zeros(1, np.int64)], "scores": [np.ones(1)]})
    signature = infer_signature(example, output, params={"topk": pred.topk, "beam_size": pred.beam_size})
    signature = ModelSignature(    # sample_id is optional: it (like any extra column) passes through
        inputs=Schema([ColSpec(c.type, c.name, required=c.name != "sample_id") for c in signature.inputs.inputs]),
        outputs=signature.outputs, params=signature.params)
    tmp = tempfile.mkdtemp(prefix="xmc-code-")
    pkg = package_source(__file__, tmp)
    import inspect
    where = {"name": name} if "name" in inspect.signature(mlflow.pyfunc.log_model).parameters \
        else {"artifact_path": name}                      # MLflow 2.x
    info = mlflow.pyfunc.log_model(
        **where, python_model=_python_model_class()(), artifacts={"xmc_model": model_dir}, code_paths=[pkg],
        signature=signature, input_example=example,
        pip_requirements=[f"numpy=={np.__version__}", f"scipy=={scipy.__version__}",
                          f"pandas=={pd.__version__}", f"pyarrow=={pa.__version__}",
                          f"numba=={__import__('numba').__version__}", f"pyyaml=={__import__('yaml').__version__}",
                          f"mlflow=={mlflow.__version__}"])
    shutil.rmtree(tmp, ignore_errors=True)
    version = None
    if registered_model:
        mv = mlflow.register_model(info.model_uri, registered_model)
        version = int(mv.version)
        if alias:
            mlflow.MlflowClient().set_registered_model_alias(registered_model, alias, mv.version)
        log.info("registered %s version %s%s", registered_model, mv.version, f" as @{alias}" if alias else "")
    return info.model_uri, version
