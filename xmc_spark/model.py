"""The tree model: save/load without Spark, numpy prediction, and a numpy reference trainer.

A saved model is a folder: ``param.json`` (class name, sizes, params), ``tree.npz`` (the label
slots) and ``weights_nodes.npz`` / ``weights_slots.npz`` (sparse classifier weights, one column
per tree node or label slot). ``XMCModel.train_local`` runs the same kernels as the Spark
stages on one machine; the Spark pipeline must produce the same model.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import scipy.sparse as sp

from .errors import XmcError
from .kernels.beam_search import beam_search, inner_beams, top_k_rows, tree_search
from .kernels.frequencies import label_frequencies
from .kernels.label_embedding import pifa
from .kernels.sparse import append_bias
from .kernels.squared_hinge import train_node
from .kernels.topk_projection import topk_projection
from .kernels.tree import (
    Forest,
    TreeIndex,
    ancestor_at,
    decode_keys,
    encode_keys,
    find_keys,
    keyed_pairs,
    node_depth,
    tree_from_params,
    unique_pairs,
)
from .params import ClustersParams, PipelineParams, PredictParams, TrainParams, TreeParams

FORMAT_VERSION = 1          # one file per weight kind, written by the driver (XMCModel.save)
CHUNKED_VERSION = 2         # weights in part files written by Spark tasks (stages.sharded.save)
ENSEMBLE_VERSION = 3        # an ensemble: param.json naming member folders, each a model folder


class ModelFormatError(XmcError, ValueError):
    pass


@dataclass
class KeyedColumns:
    """Sparse columns keyed by an id: column j of ``W`` belongs to ``keys[j]``."""

    keys: np.ndarray
    W: sp.csc_matrix

    @classmethod
    def from_dict(cls, cols: Dict[int, tuple], n_rows: int) -> KeyedColumns:
        keys = np.array(sorted(cols), dtype=np.int64)
        ptr = [0]
        idx, val = [], []
        for k in keys:
            i, v = cols[int(k)]
            idx.append(np.asarray(i, np.int32))
            val.append(np.asarray(v, np.float32))
            ptr.append(ptr[-1] + len(i))
        W = sp.csc_matrix((np.concatenate(val) if val else np.zeros(0, np.float32),
                           np.concatenate(idx) if idx else np.zeros(0, np.int32), np.array(ptr)),
                          shape=(n_rows, len(keys)))
        return cls(keys, W)

    def select(self, keys: np.ndarray) -> sp.csc_matrix:
        """Columns for ``keys`` in that order; a key with no stored column gets an empty one.
        When the stored ones are a run of consecutive columns (a tree's layer or its label slots
        in key order: all of them, some keys without a column), the result is a view of that
        run's weights, not a copy (read only)."""
        keys = np.asarray(keys, dtype=np.int64)
        if len(self.keys) == 0:
            return sp.csc_matrix((self.W.shape[0], len(keys)), dtype=np.float32)
        pos, found = find_keys(self.keys, keys)
        run = pos[found]
        if len(run) and (np.diff(run) == 1).all():
            return _column_run(self.W, found, int(run[0]), int(run[-1]) + 1)
        W = self.W[:, pos].tocsc()
        if not found.all():
            W = (W @ sp.diags(found.astype(np.float32))).tocsc()
            W.eliminate_zeros()
        return W

    def save(self, path: Path) -> None:
        W = self.W.tocsc()
        np.savez(path, keys=self.keys, indptr=W.indptr, indices=W.indices, data=W.data,
                 shape=np.array(W.shape))

    @classmethod
    def load(cls, path: Path) -> KeyedColumns:
        z = load_npz(path, ("keys", "indptr", "indices", "data", "shape"))
        try:
            W = sp.csc_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
        except (ValueError, TypeError) as e:
            raise ModelFormatError(f"{path}: not a sparse weight matrix ({e})") from None
        return cls(z["keys"], W)


def _column_run(W: sp.csc_matrix, found: np.ndarray, a: int, b: int) -> sp.csc_matrix:
    """Columns ``a:b`` of the CSC matrix ``W`` at the places ``found`` marks, empty columns at
    the others, sharing W's index and value arrays (a view)."""
    s, e = W.indptr[a], W.indptr[b]
    counts = np.zeros(len(found), W.indices.dtype)
    counts[found] = np.diff(W.indptr[a:b + 1])
    indptr = np.zeros(len(found) + 1, W.indices.dtype)    # in the index type of W's indices
    np.cumsum(counts, out=indptr[1:])
    M = sp.csc_matrix((W.data[s:e], W.indices[s:e], indptr), shape=(W.shape[0], len(found)))
    # the same arrays as views: scipy copies a small part of a large array and may narrow the index type
    M.data, M.indices, M.indptr = W.data[s:e], W.indices[s:e], indptr
    return M


def write_header(folder: Path, model, version: int, **extra_param) -> None:
    """``param.json`` and ``tree.npz`` of a model folder (an :class:`XMCModel` or a sharded
    model: anything with index, sizes, bias, normalize, pred_params, meta, label_counts)."""
    param = {
        "model": "XMCModel", "format_version": version,
        "n_features": model.n_features, "n_labels": model.n_labels, "bias": model.bias,
        "normalize": model.normalize, "nr_splits": model.index.B,
        "pred_params": model.pred_params.to_dict(), "meta": model.meta, **extra_param,
    }
    (folder / "param.json").write_text(json.dumps(param, indent=2))
    extra = {} if model.label_counts is None else {"label_counts": np.asarray(model.label_counts)}
    np.savez(folder / "tree.npz", **model.index.to_arrays(), **extra)


def write_ensemble_header(folder: Path, model, members) -> None:
    """``param.json`` of an ensemble folder (format 3) naming its member folders (an
    :class:`EnsembleModel` or a sharded ensemble: sizes, bias, normalize, pred_params, meta)."""
    param = {"model": "XMCModel", "format_version": ENSEMBLE_VERSION, "n_features": model.n_features,
             "n_labels": model.n_labels, "bias": model.bias, "normalize": model.normalize,
             "pred_params": model.pred_params.to_dict(), "meta": model.meta, "members": list(members)}
    (folder / "param.json").write_text(json.dumps(param, indent=2))


def atomic_folder(folder, write) -> None:
    """``write(tmp)`` into a fresh sibling folder, then rename it to ``folder`` (replacing it);
    on failure nothing is left behind. The folder's mode follows the umask."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-model-{uuid.uuid4().hex}"
    tmp.mkdir()                       # not tempfile.mkdtemp: that one is always 0700
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def is_chunked(folder) -> bool:
    """Whether ``folder`` holds a chunked (format 2) model, or an ensemble (format 3) of them."""
    try:
        param = json.loads((Path(folder) / "param.json").read_text())
        if param.get("format_version") == ENSEMBLE_VERSION:
            members = param.get("members")
            return bool(members) and all(is_chunked(Path(folder) / str(m)) for m in members)
        return param.get("format_version") == CHUNKED_VERSION
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def read_header(folder) -> tuple:
    """(param dict, TreeIndex, label counts or None) of a model folder of either layout, checked:
    a missing or broken part raises :class:`ModelFormatError` naming the file. For a chunked
    folder the part files' presence is checked too, not their contents."""
    folder = Path(folder)
    pfile = folder / "param.json"
    if not pfile.is_file():
        raise ModelFormatError(f"{folder} is not an xmc-spark model folder (no param.json)")
    try:
        param = json.loads(pfile.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{pfile}: not valid JSON ({e})") from None
    if not isinstance(param, dict) or param.get("model") != "XMCModel":
        found = param.get("model") if isinstance(param, dict) else param
        raise ModelFormatError(f"{pfile}: model class is {found!r}, expected 'XMCModel'")
    version = param.get("format_version")
    if version not in (FORMAT_VERSION, CHUNKED_VERSION, ENSEMBLE_VERSION):
        raise ModelFormatError(f"{folder}: model format version {version!r}, this xmc-spark reads versions "
                               f"{FORMAT_VERSION}, {CHUNKED_VERSION} and {ENSEMBLE_VERSION} (saved by another "
                               "xmc-spark version?)")
    missing = [k for k in ("n_features", "n_labels", "bias", "normalize", "pred_params")
               + (("members",) if version == ENSEMBLE_VERSION else ("nr_splits",)) if k not in param]
    if missing:
        raise ModelFormatError(f"{pfile}: missing key(s) {', '.join(missing)}")
    if version == ENSEMBLE_VERSION:
        members = param["members"]
        if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
            raise ModelFormatError(f"{pfile}: members must be a non-empty list of member folder names")
        bad = [m for m in members if Path(m).name != m or m in (".", "..")]
        if bad:
            raise ModelFormatError(f"{pfile}: members must be folder names inside the model folder, got {bad}")
        heads = [read_header(folder / m) for m in members]
        for m, (mp, _, _) in zip(members, heads):
            if mp["format_version"] == ENSEMBLE_VERSION:
                raise ModelFormatError(f"{folder / m}: an ensemble's member cannot be an ensemble")
            keys = ("n_features", "n_labels", "bias", "normalize")
            if any(mp[k] != param[k] for k in keys):
                raise ModelFormatError(f"{folder / m}: " + ", ".join(f"{k} {mp[k]}" for k in keys) + "; the ensemble "
                                       "has " + ", ".join(f"{k} {param[k]}" for k in keys))
        return param, Forest([h[1] for h in heads]), heads[0][2]
    if version == CHUNKED_VERSION:
        parts = (param.get("weights") or {}).get("parts") if isinstance(param.get("weights"), dict) else None
        if not isinstance(parts, list):
            raise ModelFormatError(f"{pfile}: a chunked model needs weights.parts (a list of files)")
        n_cols = int(param["n_features"]) + (1 if float(param["bias"]) > 0 else 0)
        for name in parts:
            if not (folder / str(name)).is_file():
                raise ModelFormatError(f"{folder / str(name)}: missing (the model folder is incomplete)")
            shape = load_npz(folder / str(name), PART_ARRAYS, only="shape")["shape"]   # reads one small member
            if len(shape) != 2 or int(shape[0]) != n_cols:
                raise ModelFormatError(f"{folder / str(name)}: weight part of shape {tuple(shape)}, the model "
                                       f"has {n_cols} weight rows")
    t = load_npz(folder / "tree.npz", ("slot_label", "slot_leaf"))
    index = TreeIndex(t["slot_label"], t["slot_leaf"], param["n_labels"], param["nr_splits"])
    return param, index, t.get("label_counts")


def split_columns(is_leaf: np.ndarray, keys: np.ndarray, W: sp.csc_matrix):
    """Weight columns keyed (is_leaf, key) -> (node KeyedColumns, slot KeyedColumns), keys sorted."""
    out = []
    for mask in (~is_leaf, is_leaf):
        cols = np.flatnonzero(mask)
        order = cols[np.argsort(keys[cols], kind="mergesort")]
        out.append(KeyedColumns(keys[order], W[:, order].tocsc()))
    return out[0], out[1]


PART_ARRAYS = ("is_leaf", "keys", "indptr", "indices", "data", "shape")


def save_part(path, is_leaf: np.ndarray, keys: np.ndarray, W: sp.csc_matrix) -> None:
    """One part file of a chunked model: the columns ``keys`` (node ids, or slot ids where
    ``is_leaf``) of W."""
    W = sp.csc_matrix(W)
    with open(path, "wb") as fh:
        np.savez(fh, is_leaf=np.asarray(is_leaf, bool), keys=np.asarray(keys, np.int64), indptr=W.indptr,
                 indices=W.indices, data=W.data, shape=np.array(W.shape))


def load_part(path):
    """(is_leaf, keys, W csc) of a part file; a broken file raises :class:`ModelFormatError`."""
    z = load_npz(path, PART_ARRAYS)
    try:
        W = sp.csc_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    except (ValueError, TypeError) as e:
        raise ModelFormatError(f"{path}: not a sparse weight matrix ({e})") from None
    if len(z["keys"]) != W.shape[1] or len(z["is_leaf"]) != W.shape[1]:
        raise ModelFormatError(f"{path}: {len(z['keys'])} keys for {W.shape[1]} weight columns")
    return z["is_leaf"].astype(bool), z["keys"].astype(np.int64), W


def load_npz(path: Path, names, only: Optional[str] = None) -> Dict[str, np.ndarray]:
    """All arrays of an ``.npz`` file of a model folder (or just ``only``), which must hold
    ``names``; a missing, truncated or incomplete file raises :class:`ModelFormatError` naming it."""
    try:
        with np.load(path) as z:
            missing = [n for n in names if n not in z.files]
            arrays = {n: z[n] for n in z.files if only is None or n == only} if not missing else {}
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: missing (the model folder is incomplete)") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ModelFormatError(f"{path}: unreadable, truncated or not an .npz file ({type(e).__name__}: {e})") from None
    if missing:
        raise ModelFormatError(f"{path}: missing array(s) {', '.join(missing)}")
    return arrays


@dataclass(frozen=True)
class ModelTrainParams:
    """Everything that shapes a trained model, taken by the Spark trainer and
    :meth:`XMCModel.train_local` alike (as PECOS's ``XLinearModel.TrainParams``): the label tree,
    the node solver (``train``), overlapping clusters and whether rows are L2-normalized."""

    tree: TreeParams = field(default_factory=TreeParams)
    train: TrainParams = field(default_factory=TrainParams)
    clusters: ClustersParams = field(default_factory=ClustersParams)
    normalize: bool = True

    @classmethod
    def from_pipeline(cls, params: PipelineParams) -> ModelTrainParams:
        return cls(params.tree, params.train, params.clusters, params.ingest.normalize)

    @property
    def cluster_rounds(self) -> int:
        """Rounds of overlapping clusters + retraining (none with one copy per label)."""
        return self.clusters.rounds if self.clusters.copies > 1 else 0


class XMCModel:
    """Label tree + per-node classifiers; prediction by beam search."""

    TrainParams = ModelTrainParams       # PECOS-shaped: XMCModel.TrainParams / XMCModel.PredParams
    PredParams = PredictParams

    def __init__(self, index: TreeIndex, node_w: KeyedColumns, slot_w: KeyedColumns, n_features: int,
                 bias: float = 1.0, normalize: bool = True, pred_params: Optional[PredictParams] = None,
                 meta: Optional[dict] = None):
        self.index = index
        self.node_w = node_w
        self.slot_w = slot_w
        self.n_features = int(n_features)
        self.n_labels = index.n_labels
        self.bias = float(bias)
        self.normalize = bool(normalize)
        self.pred_params = pred_params or PredictParams()
        self.meta = dict(meta or {})
        self.label_counts: Optional[np.ndarray] = None   # training label frequencies (propensities)
        self._layers = None
        self._tree_arrays = None

    # The search structures are derived from the weights (layers: views of their columns where a
    # layer is a run of them, else copies): a pickled model (a broadcast) ships the weights once
    # and rebuilds them where it is used, rather than carrying both (~2x the weights' bytes). A
    # balanced tree's layers are all views; a tree with leaves at several depths copies its padded
    # layers and its slot layer (in each process that searches it, as the driver did before).
    # The views are read only: nothing may change a selected matrix in place
    _DERIVED = ("_layers", "_shape", "_slot_order", "_last_leaf", "_tree_arrays")

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in self._DERIVED:
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._layers = self._tree_arrays = None

    # ---- structure -------------------------------------------------------------------
    @property
    def n_cols(self) -> int:
        return self.n_features + (1 if self.bias > 0 else 0)

    def layers(self):
        """[(child_ptr, W csc, passthrough)] from the root down, the label-slot layer last.

        Leaves shallower than the deepest one are padded with pass-through nodes, so every
        layer is one sparse block and beam search stays vectorized.
        """
        if self._layers is not None:
            return self._layers, self._slot_order
        shape = tree_layers(self.index)
        layers = []
        for t, (ids, child_ptr, through) in enumerate(shape.layers):
            last = t == len(shape.layers) - 1
            W = self.slot_w.select(ids) if last else self.node_w.select(ids)
            if through.any():
                W = (W @ sp.diags((~through).astype(np.float32))).tocsc()
                W.eliminate_zeros()
            layers.append((child_ptr, W, through))
        self._layers = layers
        self._shape = shape
        self._slot_order = shape.slot_order
        self._last_leaf = shape.last_leaf
        return layers, shape.slot_order

    def tree_arrays(self):
        """The unpadded tree for :func:`tree_search`: (child_ptr, node W csc, slot_ptr,
        slot W csc, slot_label, n_labels) over compact nodes (0 = root, heap order)."""
        if self._tree_arrays is not None:
            return self._tree_arrays
        ix = self.index
        nodes = ix.nodes if len(ix.nodes) else np.zeros(1, np.int64)
        M = len(nodes)
        parent = _positions(nodes, (nodes[1:] - 1) // ix.B)
        child_ptr = 1 + np.concatenate([[0], np.cumsum(np.bincount(parent, minlength=M))])
        per_node = np.zeros(M, dtype=np.int64)
        per_node[np.searchsorted(nodes, ix.leaves)] = ix.leaf_end - ix.leaf_start
        slot_ptr = np.concatenate([[0], np.cumsum(per_node)])
        W = self.node_w.select(nodes[1:]) if M > 1 else sp.csc_matrix((self.n_cols, 0), dtype=np.float32)
        SW = self.slot_w.select(np.arange(len(ix.slot_label)))
        self._tree_arrays = (child_ptr, W, slot_ptr, SW, ix.slot_label, self.n_labels)
        return self._tree_arrays

    # ---- prediction ------------------------------------------------------------------
    def predict(self, X: sp.csr_matrix, beam_size: Optional[int] = None, topk: Optional[int] = None,
                search: Optional[str] = None, return_work: bool = False):
        """(labels n x topk, scores n x topk) for already-ingested (normalized) rows X.

        ``search`` overrides ``pred_params.search``; with ``return_work`` a third array gives
        the number of classifiers evaluated per row (``tree``/``adaptive`` search only).
        """
        X = sp.csr_matrix(X, dtype=np.float32)
        if X.shape[1] > self.n_features:
            raise ValueError(f"input has {X.shape[1]} features; the model was trained on {self.n_features}")
        if X.shape[1] < self.n_features:
            X = sp.csr_matrix((X.data, X.indices, X.indptr), shape=(X.shape[0], self.n_features))
        Xb = append_bias(X, self.bias)
        b = beam_size or self.pred_params.beam_size
        k = topk or self.pred_params.topk
        search = search or self.pred_params.search
        if search in ("tree", "adaptive"):
            lab, sc, work = tree_search(Xb, self.tree_arrays(), b, k, self.pred_params.post_processor,
                                        adaptive=search == "adaptive")
            return (lab, sc, work) if return_work else (lab, sc)
        if return_work:
            raise ValueError("return_work needs search='tree' or 'adaptive'")
        layers, order = self.layers()
        return beam_search(Xb, layers, self.index.slot_label[order], beam_size=b, topk=k,
                           post_processor=self.pred_params.post_processor)

    def match_leaves(self, X: sp.csr_matrix, beam_size: Optional[int] = None):
        """The matcher alone: (leaf node ids n x b, -1 padded; scores) of each row's beam."""
        X = sp.csr_matrix(X, dtype=np.float32)
        if X.shape[1] < self.n_features:
            X = sp.csr_matrix((X.data, X.indices, X.indptr), shape=(X.shape[0], self.n_features))
        layers, _ = self.layers()
        b = beam_size or self.pred_params.beam_size
        if len(layers) == 1:  # the root is the only leaf
            return np.zeros((X.shape[0], 1), np.int64), np.ones((X.shape[0], 1))
        inner = layers[:-1]
        pos, scores = beam_search(append_bias(X, self.bias), inner, np.arange(len(self._last_leaf)),
                                  beam_size=b, topk=b, post_processor=self.pred_params.post_processor)
        leaves = np.where(pos >= 0, self._last_leaf[np.maximum(pos, 0)], -1)
        return leaves, scores

    def beam_nodes(self, X: sp.csr_matrix, beam_size: Optional[int] = None):
        """(row, node) pairs: every node (internal or leaf, depth >= 1) that the beam of width
        ``beam_size`` holds for a row of X, at every depth: the samples this model's matcher
        routes to each node (``train.negatives = tfn+man``). Sorted, unique."""
        X = sp.csr_matrix(X, dtype=np.float32)
        if X.shape[1] < self.n_features:
            X = sp.csr_matrix((X.data, X.indices, X.indptr), shape=(X.shape[0], self.n_features))
        layers, _ = self.layers()
        b = beam_size or self.pred_params.beam_size
        rows, nodes = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        beams = inner_beams(append_bias(X, self.bias), layers, b, self.pred_params.post_processor)
        for (ids, _, through), pos in zip(self._shape.layers, beams):
            ok = pos >= 0
            r = np.repeat(np.arange(X.shape[0]), ok.sum(axis=1))
            p = pos[ok]
            real = ~through[p]                  # pads stand for a shallower leaf, already counted
            rows.append(r[real])
            nodes.append(ids[p[real]])
        return unique_pairs(np.concatenate(rows), np.concatenate(nodes))

    def label_depth(self) -> np.ndarray:
        """Depth of each label's deepest leaf (for expected depth@k)."""
        return self.index.label_depth()

    # ---- persistence -----------------------------------------------------------------
    def save(self, folder: str, parts: int = 0) -> None:
        """Write the model folder atomically (a temp folder renamed into place); its mode
        follows the umask like any new folder (0755 under the usual umask 022). ``parts`` > 0
        writes the chunked layout (format 2) with that many weight part files, as a sharded
        model's tasks do."""
        atomic_folder(folder, lambda tmp: self._write(tmp, parts))

    def _write(self, tmp: Path, parts: int) -> None:
        if parts <= 0:
            write_header(tmp, self, FORMAT_VERSION)
            self.node_w.save(tmp / "weights_nodes.npz")
            self.slot_w.save(tmp / "weights_slots.npz")
            return
        is_leaf = np.concatenate([np.zeros(len(self.node_w.keys), bool), np.ones(len(self.slot_w.keys), bool)])
        keys = np.concatenate([self.node_w.keys, self.slot_w.keys])
        W = sp.hstack([self.node_w.W, self.slot_w.W], format="csc")
        (tmp / "weights").mkdir()
        names = []
        for j, cols in enumerate(np.array_split(np.arange(len(keys)), parts)):
            names.append(f"weights/part-{j:05d}.npz")
            save_part(tmp / names[-1], is_leaf[cols], keys[cols], W[:, cols])
        write_header(tmp, self, CHUNKED_VERSION,
                     weights={"layout": "chunked", "parts": names, "nbytes": int(W.nnz * 8)})

    @classmethod
    def load(cls, folder: str):
        """The model of a folder: an :class:`XMCModel`, or an :class:`EnsembleModel` for an
        ensemble's folder."""
        folder = Path(folder)
        param, index, label_counts = read_header(folder)
        if param["format_version"] == ENSEMBLE_VERSION:
            return EnsembleModel.load(folder)
        version = param["format_version"]
        if version == CHUNKED_VERSION:
            node_w, slot_w = cls._load_parts(folder, param)
        else:
            node_w = KeyedColumns.load(folder / "weights_nodes.npz")
            slot_w = KeyedColumns.load(folder / "weights_slots.npz")
        model = cls(index, node_w, slot_w, param["n_features"], bias=param["bias"],
                    normalize=param["normalize"], pred_params=PredictParams.from_dict(param["pred_params"]),
                    meta=param.get("meta"))
        model.label_counts = label_counts
        return model

    @staticmethod
    def _load_parts(folder: Path, param: dict):
        """The whole weights of a chunked folder, part by part (``param["weights"]["parts"]``)."""
        parts = param["weights"]["parts"]          # checked by read_header
        n_cols = int(param["n_features"]) + (1 if float(param["bias"]) > 0 else 0)
        leaf, keys, mats = [np.zeros(0, bool)], [np.zeros(0, np.int64)], [sp.csc_matrix((n_cols, 0), dtype=np.float32)]
        for name in parts:
            is_leaf, k, W = load_part(folder / name)
            if W.shape[0] != n_cols:
                raise ModelFormatError(f"{folder / name}: {W.shape[0]} weight rows, the model has {n_cols}")
            leaf.append(is_leaf)
            keys.append(k)
            mats.append(W)
        return split_columns(np.concatenate(leaf), np.concatenate(keys), sp.hstack(mats, format="csc"))

    # ---- numpy reference trainer -----------------------------------------------------
    @classmethod
    def train_local(cls, X: sp.csr_matrix, Y: sp.csr_matrix, train_params: Optional[ModelTrainParams] = None,
                    pred_params: Optional[PredictParams] = None, *, tree: Optional[TreeParams] = None,
                    train: Optional[TrainParams] = None, weights=None, normalize_y: bool = True) -> XMCModel:
        """Single-process reference of the whole training pipeline: PIFA, tree, classifiers and
        ``clusters.rounds`` of overlapping clusters + retraining (``tree`` / ``train`` override
        those parts of ``train_params``)."""
        tp = train_params or ModelTrainParams()
        tp = ModelTrainParams(tree or tp.tree, train or tp.train, tp.clusters, tp.normalize)
        X = sp.csr_matrix(X, dtype=np.float32)
        Y = sp.csr_matrix(Y)
        Z = pifa(X, Y, normalize_y=normalize_y)
        f = ft = None
        if tp.tree.effective_lambda > 0:
            f, ft = label_frequencies(Y.indptr, Y.indices, Y.shape[1], tp.tree.f_tilde)
        leaf = tree_from_params(Z, tp.tree, f, ft)
        index = TreeIndex(np.arange(Y.shape[1]), leaf, Y.shape[1], tp.tree.nr_splits)
        Xb = append_bias(X, tp.train.bias)
        n_cols = X.shape[1] + (1 if tp.train.bias > 0 else 0)

        def fit(ix: TreeIndex, extra=None) -> XMCModel:
            node_cols, slot_cols = train_all_groups(ix, Xb, Y, tp.train, weights, extra)
            return cls(ix, KeyedColumns.from_dict(node_cols, n_cols), KeyedColumns.from_dict(slot_cols, n_cols),
                       X.shape[1], bias=tp.train.bias, normalize=tp.normalize, pred_params=pred_params)

        model = fit(index)
        for _ in range(tp.cluster_rounds):
            model = fit(model.overlapping_index(X, Y, tp.clusters.copies, tp.clusters.beam_size))
        if tp.train.negatives == "tfn+man":
            model = fit(model.index, model.beam_nodes(X, (pred_params or PredictParams()).beam_size))
        return model

    def overlapping_index(self, X: sp.csr_matrix, Y: sp.csr_matrix, copies: int, beam_size: int) -> TreeIndex:
        """Label slots from the top-``copies`` leaves of each label's row of Y^T M, M the leaves
        this model's beam matches each row of X to (numpy reference of the clusters stage)."""
        leaves, _ = self.match_leaves(X, beam_size)
        ok = leaves >= 0
        ids, col = np.unique(leaves[ok], return_inverse=True)
        M = sp.csr_matrix((np.ones(len(col)), (np.repeat(np.arange(X.shape[0]), ok.sum(axis=1)), col)),
                          shape=(X.shape[0], len(ids)))
        Yb = sp.csr_matrix((np.ones(Y.nnz), Y.indices, Y.indptr), shape=Y.shape)
        ytm = (Yb.T @ M).tocoo()
        lab, leaf = topk_projection(ytm.row, ids[ytm.col], ytm.data, copies, self.index.slot_label,
                                    self.index.slot_leaf)
        return TreeIndex(lab, leaf, self.n_labels, self.index.B)


def _reach(model: XMCModel, beam_size: int) -> int:
    """Labels a beam of ``beam_size`` can reach in ``model``: beam x the largest leaf's slots."""
    ix = model.index
    return max(1, beam_size * int((ix.leaf_end - ix.leaf_start).max(initial=1)))


class EnsembleModel:
    """Several :class:`XMCModel` over the same labels (``tree.ensemble``): each tree's beam
    search scores every label in its final beam's leaves; a label's ensemble score is the mean
    of its scores over the trees, a tree whose beam does not reach it adding 0 (Parabel's
    combination); the top k of that mean are the prediction."""

    CHUNK_ROWS = 4096          # rows scored at once, at most; and at most CHUNK_ENTRIES
    CHUNK_ENTRIES = 1 << 21    # (row, reached label) pairs per tree (~32 MB of labels and scores)

    def __init__(self, models, meta: Optional[dict] = None):
        self.models = list(models)
        if not self.models:
            raise ValueError("an ensemble needs at least one model")
        first = self.models[0]
        for m in self.models[1:]:
            if (m.n_features, m.n_labels, m.bias, m.normalize) != (first.n_features, first.n_labels, first.bias,
                                                                   first.normalize):
                raise ValueError("the models of an ensemble must share features, labels, bias and normalization")
        self.n_features, self.n_labels = first.n_features, first.n_labels
        self.bias, self.normalize = first.bias, first.normalize
        self.meta = dict(meta or first.meta)
        self.label_counts: Optional[np.ndarray] = first.label_counts

    @property
    def pred_params(self) -> PredictParams:
        return self.models[0].pred_params

    @pred_params.setter
    def pred_params(self, value: PredictParams) -> None:
        for m in self.models:
            m.pred_params = value

    @property
    def index(self) -> Forest:
        return Forest([m.index for m in self.models])

    def label_scores(self, X: sp.csr_matrix, beam_size: Optional[int] = None, search: Optional[str] = None):
        """n x labels CSR: the mean over the trees of each reached label's score."""
        b = beam_size or self.pred_params.beam_size
        S = None
        for m in self.models:
            lab, sc = m.predict(X, beam_size=b, topk=_reach(m, b), search=search)   # every label of the beam
            ok = lab >= 0
            T = sp.csr_matrix((sc[ok], (np.repeat(np.arange(lab.shape[0]), ok.sum(axis=1)), lab[ok])),
                              shape=(lab.shape[0], self.n_labels))
            S = T if S is None else S + T
        return S / len(self.models)

    def predict(self, X: sp.csr_matrix, beam_size: Optional[int] = None, topk: Optional[int] = None,
                search: Optional[str] = None, return_work: bool = False):
        """(labels n x topk, scores n x topk), as :meth:`XMCModel.predict`."""
        if return_work:
            raise ValueError("return_work is not available for an ensemble")
        X = sp.csr_matrix(X, dtype=np.float32)
        k = topk or self.pred_params.topk
        b = beam_size or self.pred_params.beam_size
        reach = max(_reach(m, b) for m in self.models)
        chunk = max(1, min(self.CHUNK_ROWS, self.CHUNK_ENTRIES // reach))   # bounds each tree's n x reach arrays
        parts = [top_k_rows(self.label_scores(X[i:i + chunk], beam_size, search), k)
                 for i in range(0, max(X.shape[0], 1), chunk)]
        return np.vstack([p[0] for p in parts]), np.vstack([p[1] for p in parts])

    def match_leaves(self, X: sp.csr_matrix, beam_size: Optional[int] = None):
        """:meth:`XMCModel.match_leaves` of every tree side by side (n x trees * b), leaves as
        ensemble keys (the overlapping-cluster matcher of an ensemble)."""
        parts = [m.match_leaves(X, beam_size) for m in self.models]
        leaves = [np.where(lv >= 0, encode_keys(t, np.maximum(lv, 0).ravel()).reshape(lv.shape), -1)
                  for t, (lv, _) in enumerate(parts)]
        return np.hstack(leaves), np.hstack([sc for _, sc in parts])

    def beam_nodes(self, X: sp.csr_matrix, beam_size: Optional[int] = None):
        """:meth:`XMCModel.beam_nodes` of every tree, nodes as ensemble keys (:func:`encode_keys`);
        sorted by row, then key."""
        rows, keys = keyed_pairs([m.beam_nodes(X, beam_size) for m in self.models])
        order = np.lexsort((keys, rows))
        return rows[order], keys[order]

    def label_depth(self) -> np.ndarray:
        return self.index.label_depth()

    @classmethod
    def train_local(cls, X: sp.csr_matrix, Y: sp.csr_matrix, train_params: Optional[ModelTrainParams] = None,
                    pred_params: Optional[PredictParams] = None, **kw) -> EnsembleModel:
        """Numpy reference of an ensemble: :meth:`XMCModel.train_local` per tree, tree t with
        ``tree.for_tree(t)`` (the Spark trainer trains all trees in the same jobs)."""
        tp = train_params or ModelTrainParams()
        return cls([XMCModel.train_local(X, Y, dataclasses.replace(tp, tree=tp.tree.for_tree(t)), pred_params, **kw)
                    for t in range(tp.tree.n_trees())])

    @classmethod
    def from_columns(cls, forest: Forest, node_w: KeyedColumns, slot_w: KeyedColumns, n_features: int, **kw):
        """The ensemble of a forest whose weight keys are ensemble keys (the trainer's output)."""
        models = []
        for t, ix in enumerate(forest.trees):
            cols = []
            for kc in (node_w, slot_w):
                tree, ids = decode_keys(kc.keys)
                m = tree == t
                cols.append(KeyedColumns(ids[m], kc.W[:, np.flatnonzero(m)].tocsc()))
            models.append(XMCModel(ix, cols[0], cols[1], n_features, **kw))
        return cls(models)

    def save(self, folder: str, parts: int = 0) -> None:
        """An ensemble folder: ``param.json`` (format 3, naming the members) and one model
        folder per tree (``tree-<t>``), written atomically as one."""
        def write(tmp: Path) -> None:
            names = []
            for t, m in enumerate(self.models):
                names.append(f"tree-{t}")
                (tmp / names[-1]).mkdir()
                m.label_counts, m.meta = self.label_counts, dict(self.meta)
                m._write(tmp / names[-1], parts)
            write_ensemble_header(tmp, self, names)
        atomic_folder(folder, write)

    @classmethod
    def load(cls, folder) -> EnsembleModel:
        folder = Path(folder)
        param, _, _ = read_header(folder)
        model = cls([XMCModel.load(folder / name) for name in param["members"]], meta=param.get("meta"))
        model.pred_params = PredictParams.from_dict(param["pred_params"])
        return model


def _positions(sorted_or_not_ids: np.ndarray, query: np.ndarray) -> np.ndarray:
    order = np.argsort(sorted_or_not_ids, kind="mergesort")
    pos = np.searchsorted(sorted_or_not_ids[order], query)
    return order[pos]


@dataclass
class TreeLayers:
    """The padded layered shape of a tree, without weights (O(nodes + slots)).

    ``layers[t] = (ids, child_ptr, through)``: the keys of layer t + 1 (node ids; for the last
    layer, slot ids), ordered by parent position then id, so the children of position p of
    the layer above are ``child_ptr[p]:child_ptr[p + 1]`` and the nodes of any subtree are
    contiguous; ``through`` marks pass-through pads under shallow leaves (no classifier).
    ``slot_order`` = the last layer's slot ids; ``last_leaf``: the real leaf id of each
    position of the deepest internal layer.
    """

    layers: list
    slot_order: np.ndarray
    last_leaf: np.ndarray


def tree_layers(ix: TreeIndex) -> TreeLayers:
    B = ix.B
    leaves = ix.leaves
    ldep = node_depth(leaves, B)
    prev_ids = np.zeros(1, dtype=np.int64)
    eff_leaf = leaves.copy()           # leaf id padded down to depth D
    layers = []
    for t in range(1, ix.depth + 1):
        deep = ldep >= t
        real = np.unique(ancestor_at(leaves[deep], ldep[deep], t, B))
        pad = eff_leaf[~deep] * B + 1  # pass-through child of a shallow leaf
        eff_leaf[~deep] = pad
        ids = np.concatenate([real, pad])
        through = np.concatenate([np.zeros(len(real), bool), np.ones(len(pad), bool)])
        ppos = _positions(prev_ids, (ids - 1) // B)
        order = np.lexsort((ids, ppos))
        ids, through, ppos = ids[order], through[order], ppos[order]
        child_ptr = np.concatenate([[0], np.cumsum(np.bincount(ppos, minlength=len(prev_ids)))])
        layers.append((ids, child_ptr, through))
        prev_ids = ids
    # label slots under the (padded) leaves
    leaf_of_slot = eff_leaf[np.searchsorted(leaves, ix.slot_leaf)]
    ppos = _positions(prev_ids, leaf_of_slot)
    order = np.lexsort((ix.slot_label, ppos))
    child_ptr = np.concatenate([[0], np.cumsum(np.bincount(ppos, minlength=len(prev_ids)))])
    layers.append((order.astype(np.int64), child_ptr, np.zeros(len(order), bool)))
    last_leaf = ix.leaves[_positions(eff_leaf, prev_ids)] if ix.depth > 0 else np.zeros(1, np.int64)
    return TreeLayers(layers, order, last_leaf)


def add_pairs(rows: np.ndarray, groups: np.ndarray, extra=None):
    """(row, group) pairs with ``extra`` = (rows, groups) added; unique, sorted by row."""
    if extra is None or not len(extra[0]):
        return rows, groups
    return unique_pairs(np.concatenate([rows, extra[0]]), np.concatenate([groups, extra[1]]))


def train_group(index: TreeIndex, group: int, Xb: sp.csr_matrix, offsets, labels, train: TrainParams,
                weights=None, label_weights=None):
    """Train the classifiers of one node on the samples that reach it (rows in sample-id order).

    ``weights`` scale each sample's cost, ``label_weights`` (aligned with ``labels``) each
    positive's. Returns (is_leaf, child keys, W csc): node ids at an internal node, slot ids
    at a leaf.
    """
    children, Yg = index.node_problem(group, offsets, labels, label_weights)
    W = train_node(Xb, Yg, C=train.C, weights=weights, threshold=train.threshold, eps=train.eps,
                   max_iter=train.max_iter, seed=train.seed + _node_of(index, group))
    is_leaf = bool(np.isin(group, index.leaves))
    return is_leaf, children, W


def _node_of(index, group: int) -> int:
    """The node id of a training group: its tree's id in an ensemble, the group itself otherwise
    (a single tree's ids are never decoded, whatever their size)."""
    return int(decode_keys([group])[1][0]) if isinstance(index, Forest) else int(group)


def train_all_groups(index: TreeIndex, Xb: sp.csr_matrix, Y: sp.csr_matrix, train: TrainParams, weights=None,
                     extra=None):
    """Numpy reference of the node-training stage: every group, samples in row order.
    Y's values are the label weights (1 for plain data). ``extra`` = (rows, groups): more
    samples per group (the matcher's routed samples, :meth:`XMCModel.beam_nodes`)."""
    Y = sp.csr_matrix(Y)
    rows, groups = add_pairs(*index.groups_of_samples(Y.indptr, Y.indices), extra)
    node_cols, slot_cols = {}, {}
    for g in np.unique(groups):
        r = np.sort(rows[groups == g])
        Yg = Y[r]
        w = None if weights is None else np.asarray(weights)[r]
        is_leaf, children, W = train_group(index, int(g), Xb[r], Yg.indptr, Yg.indices, train, w, Yg.data)
        target = slot_cols if is_leaf else node_cols
        for j, c in enumerate(children):
            target[int(c)] = (W.indices[W.indptr[j]:W.indptr[j + 1]], W.data[W.indptr[j]:W.indptr[j + 1]])
    return node_cols, slot_cols
