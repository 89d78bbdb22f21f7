"""Parameter dataclasses: every default is set once here and round-trips through JSON/YAML.

Each stage has its own section; ``PipelineParams`` nests them. ``set_dotted`` applies a
``section.key=value`` override with the type of the field it replaces, and any unknown key
or ill-typed value raises :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import XmcError

log = logging.getLogger("xmc_spark.params")


class ConfigError(XmcError, ValueError):
    """A configuration key that does not exist or a value of the wrong type."""


def _coerce(value: Any, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin is typing.Union and type(None) in args:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _coerce(value, inner, key)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"config key '{key}' expects a boolean, got {value!r}")
    if typ is int or typ is float:
        word = "an integer" if typ is int else "a number"
        if isinstance(value, str):
            try:
                value = typ(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if typ is float:
                return float(value)
            if isinstance(value, int) or value.is_integer():
                return int(value)
        raise ConfigError(f"config key '{key}' expects {word}, got {value!r}")
    if typ is str:
        if isinstance(value, bool):     # YAML 1.1 reads an unquoted off / on (no / yes) as a boolean
            return "on" if value else "off"
        if isinstance(value, (str, int, float)):
            return str(value)
        raise ConfigError(f"config key '{key}' expects a string, got {value!r}")
    if origin in (dict, Dict):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ConfigError(f"config key '{key}' expects a mapping, got {value!r}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' expects a mapping, got {value!r}")
        return {str(k): v for k, v in value.items()}
    if origin in (list, List):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    return value


@dataclass
class BaseParams:
    """Dataclass params with ``from_dict``/``to_dict`` and dotted overrides."""

    # config keys that are not field names, per section:
    # (class attributes without annotations: not dataclass fields)
    _aliases = {}      # other spellings (``lambda``, a Python keyword) -> field name: silent
    _renamed = {}      # old name -> new name: accepted with a deprecation warning
    _removed = {}      # old name -> why: accepted with a deprecation warning, ignored

    @classmethod
    def _field_name(cls, key: str, prefix: str = "") -> Optional[str]:
        """The field config key ``key`` sets (None: a removed key, to ignore); warns on old keys."""
        if key in cls._aliases:
            return cls._aliases[key]
        if key in cls._renamed:
            _deprecated(f"config key '{prefix}{key}' is deprecated: use '{prefix}{cls._renamed[key]}'")
            return cls._renamed[key]
        if key in cls._removed:
            _deprecated(f"config key '{prefix}{key}' is deprecated and ignored: {cls._removed[key]}")
            return None
        return key

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]] = None, prefix: str = ""):
        given: Dict[str, str] = {}      # field name -> the key it was given as
        resolved = {}
        for key, val in (d or {}).items():
            name = cls._field_name(key, prefix)
            if name is None:
                continue
            if name in resolved:
                raise ConfigError(f"config keys '{prefix}{given[name]}' and '{prefix}{key}' are the same: set one")
            given[name] = key
            resolved[name] = val
        d = resolved
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            val = d.pop(f.name)
            typ = hints[f.name]
            key = f"{prefix}{f.name}"
            if isinstance(typ, type) and issubclass(typ, BaseParams):
                if not isinstance(val, dict):
                    raise ConfigError(f"config key '{key}' expects a section (mapping), got {val!r}")
                kwargs[f.name] = typ.from_dict(val, prefix=key + ".")
            else:
                kwargs[f.name] = _coerce(val, typ, key)
        if d:
            unknown = ", ".join(f"'{prefix}{k}'" for k in sorted(d))
            valid = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"unknown config key(s) {unknown}; valid keys here: {valid}")
        obj = cls(**kwargs)
        obj.validate(prefix)
        return obj

    def to_dict(self) -> Dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, BaseParams) else v
        return out

    def validate(self, prefix: str = "") -> None:
        """Range checks; subclasses extend."""

    def set_dotted(self, key: str, value: Any):
        """Return a copy with ``a.b.c=value`` applied (type-checked)."""
        d = self.to_dict()
        parts = key.split(".")
        node, section, prefix = d, type(self), ""
        for i, part in enumerate(parts):
            name = section._field_name(part, prefix) if section is not None else part
            if name is None:                  # a removed key: accepted (with a warning), ignored
                return type(self).from_dict(d)
            if name not in node or (i < len(parts) - 1 and not isinstance(node[name], dict)):
                raise ConfigError(f"unknown config key '{key}'")
            if i == len(parts) - 1:
                break
            sub = typing.get_type_hints(section)[name] if section is not None else None
            if typing.get_origin(sub) in (dict, Dict):     # a mapping field (spark.conf): the rest is one key
                sub_key = ".".join(parts[i + 1:])
                if name == "conf" and section is SparkParams and not sub_key.startswith("spark."):
                    raise ConfigError(f"unknown config key '{key}': Spark settings under spark.conf start "
                                      f"with 'spark.' (e.g. spark.conf.spark.executor.memory=4g)")
                node[name] = {**node[name], sub_key: value}
                return type(self).from_dict(d)
            section = sub if isinstance(sub, type) and issubclass(sub, BaseParams) else None
            node, prefix = node[name], f"{prefix}{name}."
        if isinstance(node[name], dict) and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        node[name] = value
        return type(self).from_dict(d)

    def flat(self, prefix: str = "") -> Dict[str, Any]:
        out = {}
        for k, v in self.to_dict().items():
            if isinstance(v, dict):
                for k2, v2 in _flatten(v, f"{prefix}{k}.").items():
                    out[k2] = v2
            else:
                out[f"{prefix}{k}"] = v
        return out


def _deprecated(msg: str) -> None:
    """An old config key: a DeprecationWarning (for code and tests) and a log line (for users)."""
    warnings.warn(msg, DeprecationWarning, stacklevel=4)
    log.warning("%s", msg)


def _flatten(d: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}' {msg}")


@dataclass
class SparkParams(BaseParams):
    """Spark resources: kept apart from the algorithm params."""

    master: str = "local[*]"
    app_name: str = "xmc-spark"
    delta_from_maven: bool = True   # add Delta's jars: spark.jars.packages, then the recorded files (session.py)
    log_level: str = "WARN"
    progress_seconds: float = 15.0  # log running Spark stages' task counts this often (0 = off)
    remote: str = ""                # Spark Connect: "sc://host:15002" or "local[2]" (a local server); "" = classic
    class_data_sharing: bool = True  # a local driver JVM maps Spark's classes from an archive (class_sharing.py)
    jit_hot_only: bool = True       # a local driver JVM compiles only its hottest methods with C2 (session.py)
    conf: Dict[str, Any] = field(default_factory=lambda: {
        "spark.sql.shuffle.partitions": "8",
        "spark.default.parallelism": "4",
        "spark.driver.memory": "6g",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "4096",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.adaptive.enabled": "true",
        # small local tables: Delta's log replay need not fan out to 50 tasks
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.sql.sources.parallelPartitionDiscovery.parallelism": "2",
        # the tables' Parquet files in zstd (storage.write_delta also writes them without
        # dictionaries): 500K set, in one session, the weights table written in 2.5-4.0 s
        # -> 1.3-1.7 s, 82.6 -> 76.7 MB, read in 1.0-1.7 -> 0.7-0.8 s (README)
        "spark.sql.parquet.compression.codec": "zstd",
    })


@dataclass
class IngestParams(BaseParams):
    normalize: bool = True            # L2-normalize each sample's feature vector
    svmlight_one_based: bool = True   # svmlight feature ids start at 1 (libsvm convention)
    num_features: int = 0             # 0: from the header (XC) or the data (others)
    num_labels: int = 0

    def validate(self, prefix=""):
        _check(self.num_features >= 0, prefix + "num_features", "must be >= 0")
        _check(self.num_labels >= 0, prefix + "num_labels", "must be >= 0")


@dataclass
class EmbeddingParams(BaseParams):
    """PIFA label embeddings (the only kind: the old ``embedding.method`` key is ignored)."""

    _removed = {"method": "PIFA is the only label embedding"}

    normalize_y: bool = True          # as PECOS: rows of Y L2-normalized before Y^T X
    # keep the PIFA rows as the ``label_embeddings`` table (the tree stage; the eagle stage's kept
    # tree). No stage reads them back (the tree grows from them in the same plan, PRIME computes its
    # own), so by default they are not written (the write and its cache took ~10 s of the 500K
    # synthetic set's tree stage: README, "the label embeddings stay in the tree's plan")
    write_table: bool = False


@dataclass
class TreeParams(BaseParams):
    """Label tree. ``lam`` (config key ``tree.lambda`` or ``tree.lam``) interpolates the 2-way
    split from balanced spherical 2-means (0) via frequency-weighted 2-means (1) to Fano
    coding (2); ``lambda_prime`` (>= 0) sets it as lambda = 2 l' / (1 + l') instead."""

    _aliases = {"lambda": "lam"}

    max_leaf_size: int = 100
    nr_splits: int = 2
    max_iter: int = 20
    seed: int = 0
    lam: float = 0.0
    lambda_prime: Optional[float] = None
    gamma: float = 0.1                 # additive smoothing of f(lambda)
    f_tilde: str = "marginal"          # greedy | marginal (Appendix B, Algorithms 1 / 2)
    greedy_candidates: int = 12        # K labels replayed per aggregation round of greedy f-tilde
    balanced_below_depth: int = 32     # nodes this deep split balanced (bounds the heap ids)
    local_subtree_size: int = 4096     # a node with at most this many labels grows its whole
                                       # subtree in one task (0: every level is a Spark job)
    ensemble: int = 1                  # trees, grown and trained in the same Spark jobs; tree t
                                       # uses seed + t; prediction averages their label scores
    ensemble_splits: List[int] = field(default_factory=list)   # per-tree nr_splits (e.g. 2,8,32)
    # a node with more labels than this is split across tasks (its labels' embeddings spread over
    # the partitions, the same balanced k-means steps); "auto" derives it from executor memory,
    # "off" splits every node in one task, an integer sets it
    max_split_labels: str = "auto"
    # how a node over max_split_labels is split: "distributed" (its labels' rows spread over the
    # partitions, each k-means step two Spark jobs), "streamed" (one task a node, the kernel's steps
    # over its labels' rows written once as files under the run's scratch folder, a block at a time) or
    # "auto" (default): streamed in local mode with the scratch folder on local disk (where auto's
    # bound is also at most 2^24 estimated non-zeros a split), else distributed
    big_split_solver: str = "auto"

    def split_label_bound(self) -> Optional[int]:
        """The integer bound, None for "auto" (resolved against Spark's memory by the tree
        stage), 0 for "off"."""
        v = str(self.max_split_labels).strip().lower()
        return None if v == "auto" else 0 if v == "off" else int(v)

    def n_trees(self) -> int:
        return max(self.ensemble, len(self.ensemble_splits))

    def for_tree(self, t: int) -> TreeParams:
        """The parameters of tree ``t`` of the ensemble (tree 0 of one tree: these)."""
        if self.n_trees() == 1 and not self.ensemble_splits:
            return self
        splits = self.ensemble_splits[t] if self.ensemble_splits else self.nr_splits
        return dataclasses.replace(self, nr_splits=int(splits), seed=self.seed + t, ensemble=1, ensemble_splits=[])

    @property
    def effective_lambda(self) -> float:
        if self.lambda_prime is not None:
            from .kernels.interpolated_split import lambda_from_prime
            return lambda_from_prime(self.lambda_prime)
        return float(self.lam)

    def validate(self, prefix=""):
        _check(self.max_leaf_size >= 1, prefix + "max_leaf_size", "must be >= 1")
        _check(self.nr_splits >= 2, prefix + "nr_splits", "must be >= 2")
        _check(self.max_iter >= 1, prefix + "max_iter", "must be >= 1")
        _check(0.0 <= self.lam <= 2.0, prefix + "lambda", f"must be in [0, 2], got {self.lam}")
        _check(self.lambda_prime is None or self.lambda_prime >= 0, prefix + "lambda_prime",
               f"must be >= 0, got {self.lambda_prime}")
        _check(self.lambda_prime is None or self.lam == 0.0, prefix + "lambda",
               "and lambda_prime are exclusive: set one")
        _check(self.effective_lambda == 0.0 or self.nr_splits == 2, prefix + "nr_splits",
               "must be 2 when lambda > 0 (the interpolated split is 2-way)")
        _check(self.gamma >= 0, prefix + "gamma", "must be >= 0")
        _check(self.f_tilde in ("greedy", "marginal"), prefix + "f_tilde",
               f"must be 'greedy' or 'marginal', got {self.f_tilde!r}")
        _check(1 <= self.greedy_candidates <= 30, prefix + "greedy_candidates", "must be in [1, 30]")
        _check(1 <= self.balanced_below_depth <= 40, prefix + "balanced_below_depth", "must be in [1, 40]")
        _check(self.local_subtree_size >= 0, prefix + "local_subtree_size", "must be >= 0")
        v = str(self.max_split_labels).strip().lower()
        _check(v in ("auto", "off") or (v.isdigit() and int(v) >= 2), prefix + "max_split_labels",
               f"must be auto, off or an integer >= 2, got {self.max_split_labels!r}")
        _check(self.big_split_solver in ("auto", "distributed", "streamed"), prefix + "big_split_solver",
               f"must be auto, distributed or streamed, got {self.big_split_solver!r}")
        _check(1 <= self.ensemble <= 64, prefix + "ensemble", f"must be in [1, 64], got {self.ensemble}")
        _check(not self.ensemble_splits or self.ensemble in (1, len(self.ensemble_splits)),
               prefix + "ensemble_splits", f"has {len(self.ensemble_splits)} values for tree.ensemble = "
               f"{self.ensemble} (give one per tree, or leave tree.ensemble at 1)")
        _check(all(2 <= int(b) <= 1024 for b in self.ensemble_splits), prefix + "ensemble_splits",
               f"values must be in [2, 1024], got {self.ensemble_splits}")
        _check(self.effective_lambda == 0.0 or all(int(b) == 2 for b in self.ensemble_splits),
               prefix + "ensemble_splits", "must all be 2 when lambda > 0 (the interpolated split is 2-way)")


@dataclass
class ClustersParams(BaseParams):
    """Overlapping clusters: each label may live in up to ``copies`` leaves (1 = plain tree).
    ``copies`` was ``clusters.lam`` (still accepted, with a deprecation warning)."""

    _renamed = {"lam": "copies"}

    copies: int = 1          # the paper's lambda: leaves (weight vectors) a label may have
    rounds: int = 1          # alternations: matcher -> clusters -> retrain
    beam_size: int = 10      # b, leaves matched per training sample

    @property
    def lam(self) -> int:
        """Deprecated, read-only: ``copies``. Kept until every caller reads ``copies``."""
        warnings.warn("ClustersParams.lam is deprecated: use ClustersParams.copies", DeprecationWarning,
                      stacklevel=2)
        return self.copies

    def validate(self, prefix=""):
        _check(self.copies >= 1, prefix + "copies", "must be >= 1")
        _check(self.rounds >= 0, prefix + "rounds", "must be >= 0")
        _check(self.beam_size >= 1, prefix + "beam_size", "must be >= 1")


@dataclass
class TrainParams(BaseParams):
    C: float = 1.0
    threshold: float = 0.1
    bias: float = 1.0
    max_iter: int = 100
    eps: float = 0.1
    seed: int = 0
    # a node with more training rows than this is trained apart from the grouped nodes (same
    # problem; how: big_node_solver); "auto" derives it from executor memory (at most 262,144 rows
    # where big nodes are streamed), "off" never distributes, an integer sets it
    max_node_rows: str = "auto"
    # how a node over max_node_rows is trained: "distributed" (trust-region Newton, its rows spread
    # over the partitions, every data pass a Spark job), "streamed" (one task a node, the grouped
    # path's dual CD, eps and max_iter, over its rows read a few blocks at a time from files under
    # the run's scratch folder) or "auto" (default): streamed in local mode with the scratch
    # folder on local disk, else distributed
    big_node_solver: str = "auto"
    tron_eps: float = 0.01          # distributed TRON: stop at ||grad|| <= tron_eps * ||grad at 0||
    tron_max_iter: int = 50         # distributed TRON: Newton steps at most
    # distributed TRON: diagonal preconditioner M = (1 - a) I + a diag(H) for its CG (LIBLINEAR
    # uses a = 0.01); 0 = plain CG, the default (bibtex at n/4: 44 passes plain, 51 at a = 0.01)
    tron_pcg: float = 0.0
    # distributed solver: its vectors (features x big-node classifiers, float64) stay on the
    # driver up to this size; above, in files under the run folder's _scratch, read and written by
    # the tasks, with only per-classifier scalars reaching the driver. 0 (default): always in
    # files; a size > 0 where the executors cannot write the run folder through pyarrow
    tron_driver_mb: float = 0.0
    # tfn: a node's classifiers see the samples with a label below it (teacher forcing);
    # tfn+man: also the samples the trained matcher's beam (predict.beam_size) sends to it,
    # then the model is trained again (PECOS's neg_mining_chain)
    negatives: str = "tfn"

    def node_row_bound(self) -> Optional[int]:
        """The integer bound, None for "auto" (resolved against Spark's memory by the trainer),
        0 for "off"."""
        v = str(self.max_node_rows).strip().lower()
        return None if v == "auto" else 0 if v == "off" else int(v)

    def validate(self, prefix=""):
        v = str(self.max_node_rows).strip().lower()
        _check(v in ("auto", "off") or (v.isdigit() and int(v) >= 1), prefix + "max_node_rows",
               f"must be auto, off or an integer >= 1, got {self.max_node_rows!r}")
        _check(self.big_node_solver in ("auto", "distributed", "streamed"), prefix + "big_node_solver",
               f"must be auto, distributed or streamed, got {self.big_node_solver!r}")
        _check(self.tron_eps > 0, prefix + "tron_eps", "must be > 0")
        _check(self.negatives in ("tfn", "tfn+man"), prefix + "negatives",
               f"must be tfn or tfn+man, got {self.negatives!r}")
        _check(self.tron_max_iter >= 1, prefix + "tron_max_iter", "must be >= 1")
        _check(0 <= self.tron_pcg <= 1, prefix + "tron_pcg", "must be in [0, 1]")
        _check(self.tron_driver_mb >= 0, prefix + "tron_driver_mb", "must be >= 0")
        _check(self.C > 0, prefix + "C", "must be > 0")
        _check(self.threshold >= 0, prefix + "threshold", "must be >= 0")
        _check(self.bias >= 0, prefix + "bias", "must be >= 0")
        _check(self.max_iter >= 1, prefix + "max_iter", "must be >= 1")
        _check(self.eps > 0, prefix + "eps", "must be > 0")


@dataclass
class PredictParams(BaseParams):
    """``search``: ``layered`` (every layer one sparse block, shallow leaves padded down),
    ``tree`` (each leaf scores its labels at its own depth), ``adaptive`` (``tree`` that also
    drops a branch once it can no longer change the top k)."""

    beam_size: int = 10
    topk: int = 5
    post_processor: str = "l3-hinge"
    search: str = "layered"
    # a model whose weights exceed this is not collected or broadcast: it stays sharded on the
    # executors and beam search runs layer by layer, each task getting only one node's children
    max_broadcast_mb: float = 256.0

    def validate(self, prefix=""):
        _check(self.beam_size >= 1, prefix + "beam_size", "must be >= 1")
        _check(self.topk >= 1, prefix + "topk", "must be >= 1")
        _check(self.max_broadcast_mb >= 0, prefix + "max_broadcast_mb", "must be >= 0")
        _check(self.post_processor in ("l3-hinge", "l2-hinge", "sigmoid"), prefix + "post_processor",
               "must be one of l3-hinge, l2-hinge, sigmoid")
        _check(self.search in ("layered", "tree", "adaptive"), prefix + "search",
               f"must be one of layered, tree, adaptive, got {self.search!r}")


@dataclass
class PrimeParams(BaseParams):
    """PRIME (issue #13) after node training: ``mode`` off (default: the stage only records
    itself), ``retrieve`` (exact inner product over all label prototypes replaces the tree) or
    ``rerank`` (the tree's top ``K`` re-ordered by ``weight * tree + (1 - weight) * PRIME``, the
    weight chosen on held-out *training* rows). The other keys are
    :class:`xmc_spark.kernels.prime.PrimeParams`' (same names, same defaults)."""

    mode: str = "off"
    K: int = 100                    # rerank: the tree's candidates per row
    hard_k: int = 20                # hard negatives: the tree's top hard_k over each training row
    val_frac: float = 0.1           # training rows held out (by a hash of sample_id) to choose
    val_max_rows: int = 20000       # the epoch and the rerank weight; at most this many
    select_epoch: bool = True       # keep the epoch with the best held-out P@1/3/5 (else the last)
    patience: int = 3               # with select_epoch: stop after this many epochs without a better one (0: never)
    val_tree: bool = True           # rerank: a second tree without the held-out rows scores them
    dim: int = 128
    residual: bool = False
    ffn: int = 1024
    dropout: float = 0.1
    lr: float = 1e-3
    weight_decay: float = 0.01
    epochs: int = 15
    batch_size: int = 1024
    n_pos: int = 1
    n_hard: int = 8
    n_random: int = 8
    lambda_r: float = 0.1
    r_margin: float = 0.0
    r_hinge: bool = True
    gamma_min: float = 0.1
    gamma_max: float = 0.3
    alpha: float = 0.95
    n_free: int = 0
    margin_variant: str = "triplet"
    use_centroids: bool = True
    use_free: bool = True
    propensity_positives: bool = True
    batching: str = "random"        # "clustered": NGAME's batches of similar queries (README, PRIME)
    cluster_size: int = 16          # clustered: at most this many queries a cluster
    seed: int = 0
    # h_l's input: None -> the labels' PIFA rows; a path -> the user's label features (any input
    # ingest reads, row i = label i, in the training set's feature space: stages.prime.read_label_features)
    label_features: Optional[str] = None

    STAGE_KEYS = ("mode", "K", "hard_k", "val_frac", "val_max_rows", "select_epoch", "patience", "val_tree",
                  "label_features")

    def kernel(self, propensity_a: float = 0.55, propensity_b: float = 1.5):
        """The kernel's parameters (:class:`xmc_spark.kernels.prime.PrimeParams`)."""
        from .kernels.prime import PrimeParams as KernelParams
        kw = {k: v for k, v in self.to_dict().items() if k not in self.STAGE_KEYS}
        return KernelParams(**kw, propensity_a=propensity_a, propensity_b=propensity_b)

    def validate(self, prefix=""):
        _check(self.mode in ("off", "retrieve", "rerank"), prefix + "mode",
               f"must be off, retrieve or rerank, got {self.mode!r}")
        _check(self.K >= 1, prefix + "K", "must be >= 1")
        _check(self.hard_k >= 0, prefix + "hard_k", "must be >= 0 (0: random negatives only)")
        _check(0 < self.val_frac < 1, prefix + "val_frac", f"must be in (0, 1), got {self.val_frac}")
        _check(self.val_max_rows >= 1, prefix + "val_max_rows", "must be >= 1")
        _check(self.patience >= 0, prefix + "patience", "must be >= 0 (0: run every epoch)")
        for key in ("dim", "ffn", "epochs", "batch_size", "n_pos"):
            _check(getattr(self, key) >= 1, prefix + key, "must be >= 1")
        for key in ("n_hard", "n_random", "n_free"):
            _check(getattr(self, key) >= 0, prefix + key, "must be >= 0")
        _check(self.n_hard + self.n_random >= 1, prefix + "n_random", "and n_hard: at least one negative per row")
        _check(0 <= self.dropout < 1, prefix + "dropout", "must be in [0, 1)")
        _check(0 <= self.alpha < 1, prefix + "alpha", "must be in [0, 1)")
        _check(self.lr > 0, prefix + "lr", "must be > 0")
        _check(self.weight_decay >= 0, prefix + "weight_decay", "must be >= 0")
        _check(self.lambda_r >= 0, prefix + "lambda_r", "must be >= 0")
        _check(0 < self.gamma_min <= self.gamma_max, prefix + "gamma_min",
               f"and gamma_max: need 0 < gamma_min <= gamma_max, got {self.gamma_min}, {self.gamma_max}")
        _check(self.margin_variant in ("triplet", "inverted", "fixed"), prefix + "margin_variant",
               f"must be triplet, inverted or fixed, got {self.margin_variant!r}")
        _check(self.label_features is None or (isinstance(self.label_features, str) and self.label_features.strip()),
               prefix + "label_features", f"must be a path or null, got {self.label_features!r}")
        _check(self.batching in ("random", "clustered"), prefix + "batching",
               f"must be random or clustered, got {self.batching!r}")
        _check(self.cluster_size >= 2, prefix + "cluster_size", "must be >= 2")


@dataclass
class EvalParams(BaseParams):
    ks: List[int] = field(default_factory=lambda: [1, 3, 5])
    propensity_a: float = 0.55
    propensity_b: float = 1.5


@dataclass
class MlflowParams(BaseParams):
    enabled: bool = True
    tracking_uri: str = "sqlite:///mlruns/mlflow.db"
    registry_uri: str = ""          # model registry ("" = the tracking store; Databricks UC: databricks-uc)
    artifact_location: str = "mlruns/artifacts"
    experiment: str = "xmc-spark"
    run_name: str = ""
    log_model: bool = True          # the model as an MLflow pyfunc model (loads without Spark)
    registered_model: str = "xmc-spark"   # register the logged model under this name ("" = do not)
    alias: str = "candidate"        # and point this alias at the new version ("" = none)


@dataclass
class EagleParams(BaseParams):
    """EAGLE, used when the training input is aggregated (group-level labels)."""

    mode: str = "joint"          # baseline | eagle0 | eagle | soft | joint (default: best on validation, 6 of 6)
    T: int = 20                  # GRLR iterations (eagle, soft); eagle0 uses 0
    eta: float = 0.1             # GRLR step
    tau: float = 30.0            # soft: softmax temperature (0 = baseline with weights)
    weight_scale: float = 1.0    # soft: weight = min(1, weight_scale * g * softmax); joint: min(1, weight_scale * W)
    min_weight: float = 1e-3     # soft, joint: pairs below this weight are dropped
    joint_tau: float = 100.0     # joint: temperature of exp(tau <x, e>) (validation's most frequent pick: 3 of 6)
    joint_iters: int = 20        # joint: Sinkhorn rounds (columns to the labels' counts, rows to equal shares)
    use_counts: bool = True      # a (group, label) with count c goes to its top-c members (joint: W's column sums c)
    estimate_counts: bool = False  # joint: a (group, label) without a count sums to its expected number of
                                   # carriers, from the label's prevalence over the groups (not 1); off: it
                                   # lost to one carrier on test in 6 of 6 settings (README, EAGLE)
    head_groups: int = 0         # labels in more groups than this: GRLR split across tasks
                                 # (0: auto, the (group, label) pairs over the task count)
    refine_rounds: int = 0       # model-guided re-assignment: train on the assignment, score
                                 # every member on its group's labels, re-assign; this many times
    refine_tau: float = 10.0     # softmax temperature over a (group, label)'s members' path scores
    refine_mix: float = 0.5      # weight of the first (GRLR) assignment's distribution in the mix
    refine_weights: str = "softmax"  # softmax over a (group, label)'s members, or ratio: score / best
    refine_min_weight: float = 0.02  # re-assignment: pairs below this weight or min_weight are dropped, but
                                     # never a (group, label)'s best member (validated on bibtex and
                                     # delicious R-4, 2026-12-01: README, EAGLE)
    refine_keep_tree: bool = True    # with rounds: the final model keeps the last round model's label
                                     # tree (and its PIFA) instead of growing another
    refine_eps: float = 0.0          # the round models' node-solver tolerance (train.eps of the models
                                     # that only score the members; the final model keeps train.eps);
                                     # 0 = train.eps (validated against 0.3, 1, 3: README, EAGLE)

    def validate(self, prefix=""):
        _check(self.mode in ("baseline", "eagle0", "eagle", "soft", "joint"), prefix + "mode",
               f"must be one of baseline, eagle0, eagle, soft, joint, got {self.mode!r}")
        _check(self.joint_iters >= 0, prefix + "joint_iters", "must be >= 0")
        _check(self.joint_tau >= 0, prefix + "joint_tau", "must be >= 0")
        _check(self.T >= 0, prefix + "T", "must be >= 0")
        _check(self.eta > 0, prefix + "eta", "must be > 0")
        _check(self.tau >= 0, prefix + "tau", "must be >= 0")
        _check(self.weight_scale > 0, prefix + "weight_scale", "must be > 0")
        _check(0 <= self.min_weight < 1, prefix + "min_weight", "must be in [0, 1)")
        _check(self.head_groups >= 0, prefix + "head_groups", "must be >= 0 (0 = auto)")
        _check(self.refine_rounds >= 0, prefix + "refine_rounds", "must be >= 0")
        _check(self.refine_tau >= 0, prefix + "refine_tau", "must be >= 0")
        _check(0 <= self.refine_mix <= 1, prefix + "refine_mix", "must be in [0, 1]")
        _check(0 <= self.refine_min_weight < 1, prefix + "refine_min_weight", "must be in [0, 1)")
        _check(self.refine_eps >= 0, prefix + "refine_eps", "must be >= 0 (0 = train.eps)")
        _check(self.refine_weights in ("softmax", "ratio"), prefix + "refine_weights",
               f"must be softmax or ratio, got {self.refine_weights!r}")


@dataclass
class PathsParams(BaseParams):
    """Where the stage jobs keep their Delta tables (ROOT/tables/<name>, partitioned by run key)
    and model folders (ROOT/models/<run key>, local roots only). Per environment (conf/)."""

    root: str = "runs/pipeline"

    def validate(self, prefix=""):
        _check(bool(self.root.strip()), prefix + "root", "must not be empty")


@dataclass
class KnnParams(BaseParams):
    """The kNN re-ranker (issue #14, :mod:`xmc_spark.stages.knn`): ``mode`` off (default: the
    stage only records itself) or ``rerank`` (the tree's top ``K`` re-ordered by
    ``weight * tree + (1 - weight) * vote``, the vote being the similarity^power-weighted labels
    of a row's k most cosine-similar training rows). k (among ``ks``), power (among ``powers``)
    and the weight are chosen on held-out *training* rows (``val_frac`` of them by a hash of
    sample_id, at most ``val_max_rows``), scored by a model trained without them. ``block_rows``:
    rows per block of the blocked similarity join (a task holds one block of queries and one of
    training rows); ``max_pairs``: the largest join (queries x training rows) it may run.
    With ``prime.mode`` on as well the two are stacked: the kNN re-ranker re-orders PRIME's output,
    ``K`` at most ``prime.K``, chosen on PRIME's held-out rows (``val_frac``, ``val_max_rows`` and
    ``seed`` here are then not used)."""

    mode: str = "off"
    K: int = 100
    ks: List[int] = field(default_factory=lambda: [10, 25, 50])
    powers: List[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])
    val_frac: float = 0.2
    val_max_rows: int = 20000
    block_rows: int = 8192
    max_pairs: float = 2e10
    seed: int = 0

    def validate(self, prefix=""):
        _check(self.max_pairs > 0, prefix + "max_pairs", f"must be > 0, got {self.max_pairs}")
        _check(self.mode in ("off", "rerank"), prefix + "mode", f"must be off or rerank, got {self.mode!r}")
        _check(self.K >= 1, prefix + "K", "must be >= 1")
        _check(len(self.ks) > 0 and all(int(k) >= 1 for k in self.ks), prefix + "ks",
               f"must be a non-empty list of neighbour counts >= 1, got {self.ks}")
        _check(len(self.powers) > 0 and all(float(p) >= 0 for p in self.powers), prefix + "powers",
               f"must be a non-empty list of similarity powers >= 0, got {self.powers}")
        _check(0 < self.val_frac < 1, prefix + "val_frac", f"must be in (0, 1), got {self.val_frac}")
        _check(self.val_max_rows >= 1, prefix + "val_max_rows", "must be >= 1")
        _check(self.block_rows >= 1, prefix + "block_rows", "must be >= 1")


@dataclass
class PipelineParams(BaseParams):
    spark: SparkParams = field(default_factory=SparkParams)
    paths: PathsParams = field(default_factory=PathsParams)
    ingest: IngestParams = field(default_factory=IngestParams)
    eagle: EagleParams = field(default_factory=EagleParams)
    embedding: EmbeddingParams = field(default_factory=EmbeddingParams)
    tree: TreeParams = field(default_factory=TreeParams)
    clusters: ClustersParams = field(default_factory=ClustersParams)
    train: TrainParams = field(default_factory=TrainParams)
    predict: PredictParams = field(default_factory=PredictParams)
    prime: PrimeParams = field(default_factory=PrimeParams)
    knn: KnnParams = field(default_factory=KnnParams)
    eval: EvalParams = field(default_factory=EvalParams)
    mlflow: MlflowParams = field(default_factory=MlflowParams)

    def check_combination(self) -> None:
        """Checks across sections, once the whole configuration is read (files and every ``--set``:
        a single override may pass through a combination that the next one mends).

        Stacked (both on): kNN re-ranks PRIME's re-ranking of the tree's top ``prime.K``, on which
        PRIME's weight was chosen; a larger ``knn.K`` would make PRIME re-rank a wider pool."""
        _check(self.prime.mode != "rerank" or self.knn.mode == "off" or self.knn.K <= self.prime.K, "knn.K",
               f"({self.knn.K}) must be <= prime.K ({self.prime.K}) when the kNN re-ranker re-ranks PRIME's output "
               "(both on)")

