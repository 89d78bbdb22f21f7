"""PRIME at inference, without Spark: what a model folder's ``prime/`` holds and how it is applied.

The prime stage (:mod:`.stages.prime`) trains PRIME and keeps only what inference needs: the
query encoder (``E``, features x dim, and with ``residual`` ``W_res`` / ``b_res``) and the label
prototypes ``Z`` (labels x dim, unit rows, computed once by the Label Prototype Network with
dropout off), plus ``mode``, ``K`` and the mixing ``weight``. A :class:`PrimedModel` wraps the
tree model (an :class:`~.model.XMCModel` or :class:`~.model.EnsembleModel`) and answers
``predict(X, beam_size, topk)`` like it, so the Spark prediction job (Arrow batches,
:func:`.stages.prediction.run`), ``xmc-spark predict`` and the MLflow pyfunc apply the mode
the same way:

* ``retrieve``: exact maximum inner product of h_q over all prototypes
  (:func:`~.kernels.prime.retrieve`); the tree is not consulted.
* ``rerank``: the tree's top ``K`` (beam search), re-ordered by ``weight * tree score +
  (1 - weight) * h_q . z_l`` (:func:`~.kernels.prime.rerank`); weight 1 keeps the tree's order.

Folder layout: ``prime/prime.json`` (mode, K, weight, dim, residual, n_labels, n_features and
what the stage measured) and ``prime/weights.npz``. A model folder without ``prime/`` loads as
the tree model alone (:func:`load`), exactly as before.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import scipy.sparse as sp

from .errors import XmcError
from .kernels import prime as PR

MODES = ("retrieve", "rerank")
ARRAYS = ("E", "Z", "W_res", "b_res")


class PrimeFormatError(XmcError, ValueError):
    """A model folder's ``prime/`` that is incomplete or inconsistent with the tree model."""


@dataclass
class PrimeHead:
    """What PRIME needs at inference (see the module docstring)."""

    mode: str
    K: int
    weight: float
    weights: Dict[str, np.ndarray]           # E, Z (+ W_res, b_res with residual)
    residual: bool = False
    info: Dict = field(default_factory=dict)  # facts of the stage that trained it (json-safe)

    @property
    def n_features(self) -> int:
        return self.weights["E"].shape[0]

    @property
    def n_labels(self) -> int:
        return self.weights["Z"].shape[0]

    def encode(self, X: sp.csr_matrix, chunk: int = 8192) -> np.ndarray:
        """h_q (n x dim, unit rows) of ingested rows X, in chunks (:func:`~.kernels.prime.encode_forward`)."""
        E = self.weights["E"]
        X = sp.csr_matrix(X, dtype=E.dtype)
        if X.shape[1] != E.shape[0]:
            X = sp.csr_matrix((X.data, X.indices, X.indptr), shape=(X.shape[0], E.shape[0]))
        out = [PR.encode_forward(self.weights, X[s:s + chunk], self.residual)[0] for s in range(0, X.shape[0], chunk)]
        return np.concatenate(out) if out else np.zeros((0, E.shape[1]), E.dtype)

    def scored(self, X: sp.csr_matrix, topk: int, cand: Optional[np.ndarray] = None,
               tree_scores: Optional[np.ndarray] = None):
        """(labels n x topk, -1 padded; scores) of ingested rows X under this head's mode, given
        the tree's candidates (n x K, -1 padded, best first) and their scores when re-ranking:
        the step a broadcast tree (:meth:`predict`) and a sharded one (its candidates from
        :func:`~.stages.sharded.predict`, :func:`~.stages.prime.predict_sharded`) share."""
        if self.mode == "retrieve":
            lab, sc = PR.retrieve(self.encode(X), self.weights["Z"], topk)
        else:
            ps = PR.candidate_scores(self.encode(X), self.weights["Z"], cand)
            lab, sc = PR.rerank(cand, tree_scores, ps, self.weight)
        lab, sc = lab[:, :topk], np.asarray(sc[:, :topk], np.float64)
        if lab.shape[1] < topk:                  # fewer labels than topk: pad as beam search does
            pad = topk - lab.shape[1]
            lab = np.pad(lab, ((0, 0), (0, pad)), constant_values=-1)
            sc = np.pad(sc, ((0, 0), (0, pad)), constant_values=-np.inf)
        return lab, sc

    def predict(self, tree, X: sp.csr_matrix, beam_size: Optional[int] = None, topk: Optional[int] = None):
        """(labels n x topk, -1 padded; scores) of ingested rows X under this head's mode; re-ranking
        takes the tree's top ``max(K, topk)`` by beam search."""
        topk = topk or tree.pred_params.topk
        if self.mode == "retrieve":
            return self.scored(X, topk)
        cand, tree_scores = tree.predict(X, beam_size=beam_size, topk=max(self.K, topk))
        return self.scored(X, topk, cand, tree_scores)

    # ---- persistence ------------------------------------------------------------------------
    def save(self, model_folder) -> None:
        """Write ``model_folder/prime/`` (replacing an old one)."""
        d = Path(model_folder) / "prime"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        np.savez(d / "weights.npz", **self.weights)
        meta = {"mode": self.mode, "K": int(self.K), "weight": float(self.weight), "residual": bool(self.residual),
                "dim": int(self.weights["E"].shape[1]), "n_features": self.n_features, "n_labels": self.n_labels,
                "info": self.info}
        (d / "prime.json").write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, model_folder) -> Optional[PrimeHead]:
        """The head of ``model_folder/prime/``, None when the folder has none; checked."""
        d = Path(model_folder) / "prime"
        if not d.exists():
            return None
        try:
            meta = json.loads((d / "prime.json").read_text())
            with np.load(d / "weights.npz") as z:
                weights = {k: z[k] for k in z.files}
        except (OSError, ValueError, KeyError) as e:
            raise PrimeFormatError(f"{d}: unreadable or incomplete PRIME parameters ({e})") from None
        need = ("E", "Z") + (("W_res", "b_res") if meta.get("residual") else ())
        missing = [k for k in need if k not in weights]
        if missing or meta.get("mode") not in MODES:
            raise PrimeFormatError(f"{d}: mode {meta.get('mode')!r} (expected one of {MODES}), missing arrays "
                                   f"{missing or 'none'}")
        if weights["E"].shape[1] != weights["Z"].shape[1]:
            raise PrimeFormatError(f"{d}: encoder dim {weights['E'].shape[1]} != prototype dim {weights['Z'].shape[1]}")
        return cls(meta["mode"], int(meta["K"]), float(meta["weight"]), weights, bool(meta.get("residual")),
                   meta.get("info", {}))

    @staticmethod
    def remove(model_folder) -> None:
        """Drop ``model_folder/prime/`` (prime.mode = off after a run that had it)."""
        shutil.rmtree(Path(model_folder) / "prime", ignore_errors=True)


class PrimedModel:
    """A tree model with a :class:`PrimeHead`: ``predict`` applies the head's mode, everything
    else (sizes, ``layers``, ``label_depth``, ``pred_params``, ``meta``, ...) is the tree's."""

    def __init__(self, tree, head: PrimeHead):
        if head.n_labels != tree.n_labels or head.n_features != tree.n_features:
            raise PrimeFormatError(f"PRIME has {head.n_labels} labels x {head.n_features} features, the tree model "
                                   f"{tree.n_labels} x {tree.n_features}")
        self.tree, self.head = tree, head

    def __getattr__(self, name):            # only called for what PrimedModel itself lacks
        if name in ("tree", "head"):
            raise AttributeError(name)
        return getattr(self.tree, name)

    @property
    def pred_params(self):
        return self.tree.pred_params

    @pred_params.setter
    def pred_params(self, value) -> None:
        self.tree.pred_params = value

    def predict(self, X: sp.csr_matrix, beam_size: Optional[int] = None, topk: Optional[int] = None, **kw):
        X = sp.csr_matrix(X, dtype=np.float32)
        if X.shape[1] > self.tree.n_features:
            raise ValueError(f"input has {X.shape[1]} features; the model was trained on {self.tree.n_features}")
        return self.head.predict(self.tree, X, beam_size=beam_size, topk=topk)

    def save(self, folder, **kw) -> None:
        """The tree's folder (``kw``: its ``save``'s, e.g. ``parts`` of a whole model) and ``prime/``."""
        self.tree.save(folder, **kw)
        self.head.save(folder)


def with_head(tree, head: Optional[PrimeHead]):
    """``tree`` wrapped with ``head`` (the tree itself when there is none)."""
    return tree if head is None else PrimedModel(tree, head)


def load(folder):
    """A saved model folder: the tree model (:meth:`XMCModel.load`), wrapped in a
    :class:`PrimedModel` when the folder has ``prime/``. A kNN re-ranker (``knn/``) is not
    applied here (it votes with the training rows, through Spark: ``xmc-spark predict``), which is
    logged as a warning: the model scores with the tree (and PRIME, stacked) alone."""
    from .model import XMCModel
    if (Path(folder) / "knn" / "knn.json").is_file():
        logging.getLogger("xmc_spark.model").warning(
            "%s has a kNN re-ranker (knn/), which needs the training rows and Spark: `xmc-spark predict` applies "
            "it; this model scores without it (the tree, with PRIME when the folder has prime/)", folder)
    return with_head(XMCModel.load(folder), PrimeHead.load(folder))
