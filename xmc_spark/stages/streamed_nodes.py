"""Big nodes trained one task each by the per-node kernel's dual coordinate descent, their rows
streamed from files a few packed blocks at a time.

The distributed solver (:func:`.node_training.train_big_nodes`, ``train.big_node_solver`` =
``distributed``) spreads every big node's rows over the partitions and makes each of TRON's data
passes a Spark job: its passes (1 + the slowest classifier's CG and Newton steps: 95 on the 200K
set's four top nodes at a bound of 100,000 rows) each pay a job's latency and move the solver's
vectors through a shuffle and files. This path (``streamed``) solves the same problem inside one
task per big node, with no Spark job per pass, by the grouped path's own solver (dual coordinate
descent with shrinking, :func:`..kernels.squared_hinge._epoch`; its tolerance ``train.eps`` and
``train.max_iter``), so a big node's weights are as close to the optimum as a grouped node's:

1. the big nodes' rows, fanned out, tagged and packed as for the distributed solver
   (:func:`.node_training._pack_rows`: CSR blocks of at most the bound's rows, capped at
   :data:`.node_training.PACK_ROWS`, bias appended, costs and positives), are written as Arrow
   IPC files, one per block, under the run's scratch folder
   (``<scratch>/streamed-<id>/n<node>/p<partition>-t<task attempt>/<block>-<rows>.arrow``) by
   the tasks that read the samples: one Spark job with no shuffle of the rows (the fan-out and
   the packing run in the same Python worker, so the rows never pass through Spark's own rows),
   whose driver side receives a row per big node and write task; a task packs a node's rows in
   full blocks as long as all nodes' waiting rows fit :data:`.node_training.PENDING_BLOCKS`
   blocks, then the node with the most waiting in a short one (:func:`.node_training._pack_rows`);
2. one task per big node (a wide node's classifiers cut into runs, one task each:
   :func:`work_units`), the most work first, runs the dual CD of its classifiers (:func:`dcd_node`),
   each pass over the node's block files :data:`MIX_BLOCKS` at a time, paired anew at every pass,
   with each block's dual variables kept in a file of the task's own between passes;
3. the tasks emit the node's pruned weights (:data:`..schemas.WEIGHTS_SCHEMA` rows), which are
   checkpointed before the files are deleted.

So a task holds :data:`MIX_BLOCKS` blocks of rows and their stacked copy, their dual state
(:func:`state_bytes`), and the weights (features x its classifiers), whatever the node's size: a
task's memory does not grow with the samples, as on the distributed path; what it does not share
is the node's time, which one task spends (the distributed path splits it over the partitions).
The block files are read once per pass (from the page cache in local mode; from the scratch
folder's storage on a cluster), and each block's dual state is read and written once per pass on
the task's local disk (a temporary folder, removed when the task's node is done).

A retried or speculative write task writes folders of its own (each file whole,
:func:`..storage.write_whole`), and the training tasks read only the folders of the attempts whose
output Spark kept: an attempt whose input came in another order (after a shuffle upstream) packs
other blocks, but never beside another attempt's. A training task only reads them; its dual state
is its own (a local temporary folder).
"""
from __future__ import annotations

import logging
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
import scipy.sparse as sp
from pyspark.sql import DataFrame

from ..arrow_utils import csr_rows_to_arrays, to_arrow
from ..compat import default_parallelism, task_slots
from ..kernels import tron
from ..kernels.squared_hinge import _epoch, _row_norms
from ..params import TrainParams
from ..progress import worker_log, worker_progress
from ..schemas import WEIGHTS_SCHEMA
from ..storage import client_fs, write_whole

log = logging.getLogger("xmc_spark.train")
WRITTEN_SCHEMA = "node int, folder string, blocks long, rows long"


def write_blocks(rows: DataFrame, pack: Callable, uri: str,
                 kind: str = "train (streamed: writing the big nodes' rows)") -> pa.Table:
    """Pack ``rows`` (:data:`.node_training.BIG_SCHEMA`, nodes in any order) with ``pack`` (a
    :func:`.node_training._pack_rows` function; the tree's streamed splits pass their own rows and
    packer, :func:`.split_across._group_blocks`, and their progress ``kind``: any packer whose
    blocks carry ``node`` and ``rows`` columns) and write every packed block as an Arrow IPC file
    ``<seq>-<rows>.arrow`` under ``uri``/n<node>/p<partition>-t<task attempt>/, in the tasks that
    read the rows (no shuffle of the rows); returns (node, folder relative to ``uri``, blocks,
    rows) per big node and write task. Each attempt writes a folder of its own and the write is
    the job's result stage, whose result holds one attempt per partition, so a retried or
    speculative attempt, whose input may come in another order, never adds its blocks to
    another's."""
    def run(batches):
        from pyspark import TaskContext
        fs, root = client_fs(uri)
        tc = TaskContext.get()
        part = f"p{tc.partitionId() if tc else 0:05d}-t{tc.taskAttemptId() if tc else 0}"
        made = {}                               # node -> [blocks, rows]
        for seq, b in enumerate(pack(batches)):
            g = int(b.column("node")[0].as_py())
            n = int(b.column("rows")[0].as_py())
            folder = f"{root}/n{g}/{part}"
            if g not in made:
                fs.create_dir(folder, recursive=True)
                made[g] = [0, 0]

            def write(f, b=b):
                with pa.ipc.new_file(f, b.schema) as out:
                    out.write_batch(b)
            write_whole(fs, f"{folder}/{seq:06d}-{n}.arrow", write)
            made[g][0] += 1
            made[g][1] += n
            worker_progress(kind, rows=n)
        if made:
            nodes = sorted(made)
            yield pa.RecordBatch.from_pydict({
                "node": pa.array(nodes, pa.int32()), "folder": pa.array([f"n{g}/{part}" for g in nodes]),
                "blocks": pa.array([made[g][0] for g in nodes], pa.int64()),
                "rows": pa.array([made[g][1] for g in nodes], pa.int64())})

    # collected from the write tasks themselves: a row per node they wrote (no shuffle, which could
    # mix two attempts' rows of one task when Spark reruns a map task; no coalesce, which would
    # shrink the write's parallelism)
    return to_arrow(rows.mapInArrow(run, WRITTEN_SCHEMA))


MIX_BLOCKS = 2          # block files a dual CD pass takes together (paired anew at every pass)


def block_files(fs, folder: str) -> list:
    """The block files under ``folder``, in name order."""
    import pyarrow.fs as pafs
    return sorted(i.path for i in fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
                  if i.path.endswith(".arrow"))


def block_rows(path: str) -> int:
    """The rows of a block file, from its name (``<seq>-<rows>.arrow``, :func:`write_blocks`)."""
    name = path.rsplit("/", 1)[-1]
    try:
        return int(name[:-len(".arrow")].rsplit("-", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(f"{path}: not a block file name (<seq>-<rows>.arrow)") from None


def mix_groups(order: np.ndarray, rows: np.ndarray, mix: int, block: int = 0) -> list:
    """The blocks ``order`` (indices into ``rows``, each block's rows) cut into groups a dual CD
    pass takes together: consecutive blocks until a group holds more rows than ``mix`` - 1 full
    blocks (``block`` rows, the packing's most; 0: the largest of ``rows``), so ``mix`` full
    blocks, or more of the short blocks the write tasks leave; at most ``mix`` full blocks' rows."""
    order = np.asarray(order, np.int64)
    if not len(order):
        return []
    need = (max(1, int(mix)) - 1) * max(int(block), int(np.max(rows)))
    groups, start, held = [], 0, 0
    for i, b in enumerate(order):
        held += int(rows[b])
        if held > need:
            groups.append(order[start:i + 1])
            start, held = i + 1, 0
    if start < len(order):
        groups.append(order[start:])
    return groups


def read_block(fs, path: str, unpack: Callable[[pa.RecordBatch], Iterable[tron.RowBlock]]) -> tron.RowBlock:
    """The rows of one block file, read whole (no memory map: a worker's address-space cap counts
    mapped files)."""
    with fs.open_input_file(path) as f:
        batch = pa.ipc.open_file(f).get_batch(0)
    return _stacked(list(unpack(batch)))


def _stacked(parts: list) -> tron.RowBlock:
    if len(parts) == 1:
        return parts[0]
    return tron.RowBlock(sp.vstack([p.X for p in parts], format="csr"), np.concatenate([p.node for p in parts]),
                         np.concatenate([p.cost for p in parts]), sp.vstack([p.pos for p in parts], format="csr"))


@dataclass
class DcdInfo:
    """Per classifier: passes over the node's rows run (``passes``) and whether the dual CD
    stopping test was met (``converged``; else it stopped at ``train.max_iter`` passes)."""

    passes: np.ndarray
    converged: np.ndarray


class _BlockState:
    """The dual CD state of one block's rows for K classifiers (the squared norms x_i^T x_i, the
    dual variables alpha (K x rows) and the active flags of the shrinking), kept in a file on the
    task's local disk between passes, so a task holds the state of the blocks in hand only."""

    def __init__(self, path: str):
        self.path = path

    def load(self, rows: int, K: int):
        """(xx, alpha, act) as read-only views of the file's bytes."""
        with open(self.path, "rb") as f:
            raw = f.read()
        return (np.frombuffer(raw, np.float64, rows),
                np.frombuffer(raw, np.float64, rows * K, 8 * rows).reshape(K, rows),
                np.frombuffer(raw, np.bool_, rows * K, 8 * rows * (K + 1)).reshape(K, rows))

    def save(self, xx: np.ndarray, alpha: np.ndarray, act: np.ndarray) -> None:
        with open(self.path, "wb") as f:
            for a in (xx, alpha, act):
                f.write(np.ascontiguousarray(a).tobytes())


def state_bytes(block_rows: int, classifiers: int, mix: int = 0) -> int:
    """Bytes of the dual state a streamed task holds at once for ``classifiers`` over ``mix``
    (:data:`MIX_BLOCKS`) blocks of ``block_rows``: 17 bytes a row and classifier plus 8 a row (the
    stacked state, and the files' bytes while they are read or written)."""
    return 2 * (mix or MIX_BLOCKS) * int(block_rows) * (17 * int(classifiers) + 8)


def _unsigned(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` (non-negative integers) as ``dtype``: a view when the widths match, else a copy."""
    a = np.ascontiguousarray(a)
    return a.view(dtype) if a.dtype.itemsize == np.dtype(dtype).itemsize else a.astype(dtype)


def _lcg_seed(seed: int) -> np.uint64:
    """The dual CD's shuffling state for ``seed``, as :func:`..kernels.squared_hinge._dcd` seeds it."""
    return np.uint64((int(seed) * 2654435761 + 12345) % 2 ** 64)


def dcd_node(fs, paths: list, unpack: Callable[[pa.RecordBatch], Iterable[tron.RowBlock]], lo: int, hi: int,
             d: int, params: TrainParams, seed: int, state_dir: str, mix: int = MIX_BLOCKS, block: int = 0):
    """The per-node kernel's dual coordinate descent (:func:`..kernels.squared_hinge._epoch`: the
    same problem, tolerance ``train.eps``, at most ``train.max_iter`` passes, shrinking) for the
    classifiers ``lo`` .. ``hi - 1`` (global ids, all of one node) over the node's rows in the
    block files ``paths`` (named with their rows, :func:`write_blocks`), read ``mix`` at a time:
    each pass takes the blocks in a new random order, in groups of ``mix`` (more where blocks are
    short: :func:`mix_groups`, full blocks being ``block`` rows) whose rows it shuffles together.
    (Blocks taken one at a time converge far more slowly: after 40 passes a relative objective
    gap of 7e-4 to 7e-3, against 6e-9 to 9e-9 with the rows in one piece, on bibtex and delicious
    root-like problems cut into 4 or 16 blocks; paired anew at every pass, 5e-9 to 2e-6. README,
    2026-12-05, ninth session.)
    The dual variables and active flags of each block wait in a file under ``state_dir`` (a local
    folder) between passes. Returns (W: d x (hi - lo) float64, :class:`DcdInfo`)."""
    K, mix = int(hi - lo), max(1, int(mix))
    W = np.zeros((K, d))
    lcg = [_lcg_seed(seed + k) for k in range(K)]
    pg_max_old = np.full(K, np.inf)
    live, reset = np.ones(K, bool), np.zeros(K, bool)
    passes = np.zeros(K, np.int64)
    states = [_BlockState(os.path.join(state_dir, f"{i:06d}.state")) for i in range(len(paths))]
    rows_of = np.array([block_rows(p) for p in paths], np.int64)
    rng = np.random.default_rng(int(seed) % 2 ** 63)
    os.makedirs(state_dir, exist_ok=True)
    for it in range(int(params.max_iter)):
        if not live.any():
            break
        run = np.flatnonzero(live)
        pmax, pmin = np.full(K, -np.inf), np.full(K, np.inf)
        shrunk = np.zeros(K, np.int64)
        for ids in mix_groups(rng.permutation(len(paths)), rows_of, mix, block):
            blocks = [read_block(fs, paths[i], unpack) for i in ids]
            if [b.X.shape[0] for b in blocks] != rows_of[ids].tolist():
                raise ValueError(f"{paths[ids[0]]} ...: block files whose rows differ from their names")
            cuts = np.concatenate([[0], np.cumsum(rows_of[ids])])
            rb = _stacked(blocks)
            del blocks
            X = rb.X
            n = X.shape[0]
            usable = rb.cost > 0
            if it == 0:
                xx = _row_norms(X.indptr, X.data)
                alpha = np.zeros((K, n))
                act = np.repeat(usable[None, :], K, axis=0)
            else:
                xx, alpha, act = (np.concatenate(parts, axis=-1) for parts in      # copies: written in place
                                  zip(*(states[i].load(int(rows_of[i]), K) for i in ids)))
            P = rb.pos[:, lo:hi].tocsc()
            indptr, indices = _unsigned(X.indptr, np.uint64), _unsigned(X.indices, np.uint32)
            for k in run:
                if reset[k]:
                    act[k] = usable
                y = np.full(n, -1.0)
                r = P.indices[P.indptr[k]:P.indptr[k + 1]]
                y[r] = 1.0
                Ci = rb.cost.copy()
                Ci[r] *= np.maximum(P.data[P.indptr[k]:P.indptr[k + 1]].astype(np.float64), 1e-12)
                with np.errstate(divide="ignore"):
                    diag = 0.5 / Ci
                index = np.flatnonzero(act[k]).astype(np.uint64)
                M, m, a, lcg[k] = _epoch(indptr, indices, X.data, diag + xx, diag, y, W[k], alpha[k], index,
                                         len(index), pg_max_old[k], lcg[k])
                lcg[k] = np.uint64(lcg[k])
                act[k, index[a:].astype(np.int64)] = False
                pmax[k], pmin[k] = max(pmax[k], M), min(pmin[k], m)
                shrunk[k] += int(np.count_nonzero(usable & ~act[k]))
            for j, i in enumerate(ids):
                b = slice(int(cuts[j]), int(cuts[j + 1]))
                states[i].save(xx[b], alpha[:, b], act[:, b])
            del rb, X, P, indptr, indices, xx, alpha, act          # before the next group's blocks are read
        passes[run] += 1
        reset[:] = False
        for k in run:
            if pmax[k] - pmin[k] <= params.eps:
                if shrunk[k] == 0:
                    live[k] = False
                else:
                    reset[k] = True
                    pg_max_old[k] = np.inf
            else:
                pg_max_old[k] = pmax[k] if pmax[k] > 0 else np.inf
    return W.T, DcdInfo(passes, ~live)


def work_units(n_rows: np.ndarray, node_ptr: np.ndarray, slots: int) -> np.ndarray:
    """The training tasks (node, first classifier, end) over the big nodes (``n_rows`` each), the
    most work first: a pass costs a node's rows x its classifiers, and a node whose cost is over
    1 / (2 x ``slots``) of all is cut into that many runs of its classifiers (at most one a
    classifier; each run reads the node's rows on its own), so that a wide node (a leaf of many
    labels) does not hold one core while the others idle."""
    K = np.diff(node_ptr)
    cost = np.asarray(n_rows, np.float64) * K
    share = max(cost.sum() / (2 * max(1, int(slots))), 1.0)
    units = []
    for g in range(len(K)):
        parts = int(min(K[g], max(1, np.ceil(cost[g] / share))))
        cuts = node_ptr[g] + (np.arange(parts + 1) * K[g]) // parts
        units += [(g, int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
    units = np.array(units, np.int64).reshape(-1, 3)
    work = np.asarray(n_rows, np.float64)[units[:, 0]] * (units[:, 2] - units[:, 1])
    return units[np.argsort(-work, kind="stable")]


def train_streamed(spark, rows: DataFrame, pack: Callable, unpack: Callable, big: np.ndarray, kids: list,
                   node_ptr: np.ndarray, d: int, is_leaf: np.ndarray, params: TrainParams, root: str,
                   emit_table: Callable, block: int = 0) -> DataFrame:
    """The big nodes' weights rows (:data:`..schemas.WEIGHTS_SCHEMA`), checkpointed: their rows
    written as block files under ``root`` (:func:`write_blocks`), then one task per
    :func:`work_units` unit (a node, or a run of a wide node's classifiers; the most work first)
    training it with :func:`dcd_node` and emitting ``emit_table(is_leaf, keys, idx, val)`` of
    its pruned weights (``big[g]``'s children ``kids[g]``); the files are deleted at the end
    (also after an error)."""
    uri = f"{root.rstrip('/')}/streamed-{uuid.uuid4().hex}"
    fs, base = client_fs(uri)
    fs.create_dir(base, recursive=True)
    try:
        written = write_blocks(rows, pack, uri)
        at = written.column("node").to_numpy()
        n_rows = np.bincount(at, weights=written.column("rows").to_numpy(), minlength=len(big)).astype(np.int64)
        folders = [[] for _ in big]                     # a big node always has rows; none would train to w = 0
        for g, f in sorted(zip(at.tolist(), written.column("folder").to_pylist())):
            folders[g].append(f)
        units = work_units(n_rows, node_ptr, task_slots(spark, default_parallelism(spark)))
        log.info("train: %d big nodes, %d classifiers, %d rows in %d block files: %d tasks (a node or a run of its "
                 "classifiers each), dual CD over the node's rows streamed from the files, %d blocks at a time "
                 "(eps %g, at most %d passes)", len(big), int(node_ptr[-1]), int(n_rows.sum()),
                 int(written.column("blocks").to_numpy().sum()), len(units), MIX_BLOCKS, params.eps, params.max_iter)
        threshold = params.threshold

        def run(batches):
            rfs, rbase = client_fs(uri)
            for b in batches:
                for i in b.column("id").to_pylist():
                    g, lo, hi = (int(v) for v in units[i])
                    with tempfile.TemporaryDirectory(prefix="xmc-dual-state-") as state:    # this attempt's own
                        paths = [p for f in folders[g] for p in block_files(rfs, f"{rbase}/{f}")]
                        W, info = dcd_node(rfs, paths, unpack, lo, hi, d, params,
                                           params.seed + int(big[g]) + lo - int(node_ptr[g]), state, block=block)
                    worker_log().info(
                        "train (streamed): node %d, classifiers %d-%d of %d: dual CD passes %d-%d, %d of %d met the "
                        "tolerance", int(big[g]), lo - node_ptr[g], hi - node_ptr[g] - 1, node_ptr[g + 1] - node_ptr[g],
                        info.passes.min(), info.passes.max(), int(info.converged.sum()), hi - lo)
                    worker_progress("train (streamed)", classifiers=hi - lo)
                    idx, val = csr_rows_to_arrays(tron.prune(W, threshold).T.tocsr())
                    keys = kids[g][lo - node_ptr[g]:hi - node_ptr[g]]
                    yield from emit_table(np.full(hi - lo, is_leaf[g]), keys, idx, val).to_batches()

        out = spark.range(0, len(units), numPartitions=max(1, len(units))).mapInArrow(run, WEIGHTS_SCHEMA)
        return out.localCheckpoint()
    finally:
        try:
            fs.delete_dir(base)
        except OSError as e:        # never hide the run's own error; the folder is under the run's scratch
            log.warning("train: could not delete the streamed rows' folder %s: %s", uri, e)
