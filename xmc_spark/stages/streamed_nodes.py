"""Big nodes trained one task each, their rows streamed from files one packed block at a time.

The distributed solver (:func:`.node_training.train_big_nodes`, ``train.big_node_solver`` =
``distributed``) spreads every big node's rows over the partitions and makes each of TRON's data
passes a Spark job: its passes (1 + the slowest classifier's CG and Newton steps: 95 on the 200K
set's four top nodes at a bound of 100,000 rows) each pay a job's latency and move the solver's
vectors through a shuffle and files. This path (``streamed``) runs the *same* solver, the same
problem and tolerance (:func:`..kernels.tron.tron` over :func:`..kernels.tron.partial_pass`),
inside one task per big node, with no Spark job per pass:

1. the big nodes' rows, fanned out, tagged and packed exactly as for the distributed solver
   (:func:`.node_training._pack_rows`: CSR blocks of at most the bound's rows, capped at
   :data:`.node_training.PACK_ROWS`, bias appended, costs and positives), are written by the
   tasks that pack them as Arrow IPC files, one per block, under the run's scratch folder
   (``<scratch>/streamed-<id>/n<node>/<partition>-<block>.arrow``; one Spark job after the range
   partitioning's sampling job, whose driver side receives one row per big node);
2. one task per big node (a wide node's classifiers cut into runs, one task each:
   :func:`work_units`), the most work first, runs TRON with its vectors (features x its
   classifiers) in memory and every data pass a read of the node's block files, one block at a
   time (:func:`node_oracle`);
3. the tasks emit the node's pruned weights (:data:`..schemas.WEIGHTS_SCHEMA` rows), which are
   checkpointed before the files are deleted.

So a task holds one block of rows plus the node's TRON vectors (about eight arrays of features x
the node's classifiers), whatever the node's size: a task's memory does not grow with the
samples, as on the distributed path; what it does not share is the node's time, which one task
spends (the distributed path splits it over the partitions). The block files are read once per
pass (from the page cache in local mode; from the scratch folder's storage on a cluster).

A retried or speculative write task writes the same files (each whole, :func:`..storage.write_whole`):
a partition's rows are sorted by (node, a hash of the whole row), so its blocks and their names do
not depend on the shuffle's order (rows that tie are equal, so either order writes the same
bytes). The training tasks only read.
"""
from __future__ import annotations

import logging
import uuid
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import csr_rows_to_arrays, to_arrow
from ..compat import default_parallelism, task_slots
from ..kernels import tron
from ..params import TrainParams
from ..progress import worker_log, worker_progress
from ..schemas import WEIGHTS_SCHEMA
from ..storage import client_fs, write_whole

log = logging.getLogger("xmc_spark.train")
WRITTEN_SCHEMA = "node int, blocks long, rows long"


def write_blocks(rows: DataFrame, pack: Callable, uri: str) -> pa.Table:
    """Pack ``rows`` (:data:`.node_training.BIG_SCHEMA`, sorted by node within each partition)
    with ``pack`` (a :func:`.node_training._pack_rows` function) and write every packed block as
    an Arrow IPC file under ``uri``/n<node>/; returns (node, blocks, rows) per big node with rows."""
    def run(batches):
        from pyspark import TaskContext
        fs, root = client_fs(uri)
        tc = TaskContext.get()
        pid = tc.partitionId() if tc else 0
        made = set()
        for seq, b in enumerate(pack(batches)):
            g = int(b.column("node")[0].as_py())
            folder = f"{root}/n{g}"
            if g not in made:
                fs.create_dir(folder, recursive=True)
                made.add(g)

            def write(f, b=b):
                with pa.ipc.new_file(f, b.schema) as out:
                    out.write_batch(b)
            write_whole(fs, f"{folder}/{pid:05d}-{seq:06d}.arrow", write)
            n = int(b.column("rows")[0].as_py())
            worker_progress("train (streamed: writing the big nodes' rows)", rows=n)
            yield pa.RecordBatch.from_pydict({"node": pa.array([g], pa.int32()), "blocks": pa.array([1], pa.int64()),
                                              "rows": pa.array([n], pa.int64())})

    return to_arrow(rows.mapInArrow(run, WRITTEN_SCHEMA).groupBy("node")
                    .agg(F.sum("blocks").alias("blocks"), F.sum("rows").alias("rows")))


def block_reader(fs, folder: str, unpack: Callable[[pa.RecordBatch], Iterable[tron.RowBlock]]):
    """A function returning, at each call, an iterator over the :class:`..kernels.tron.RowBlock`
    of every block file under ``folder`` (in name order), each read whole when reached and
    dropped after (no memory map: a worker's address-space cap counts mapped files)."""
    import pyarrow.fs as pafs
    paths = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
                   if i.path.endswith(".arrow"))

    def blocks():
        for p in paths:
            with fs.open_input_file(p) as f:
                batch = pa.ipc.open_file(f).get_batch(0)
            yield from unpack(batch)
    return blocks


def node_oracle(blocks: Callable[[], Iterable[tron.RowBlock]], node_ptr: np.ndarray, first: int, d: int):
    """(fun_grad, hess_vec, mixed) of classifiers of one node (local ids 0, 1, ...: the global ids
    ``first`` + those) over that node's rows, which ``blocks()`` yields: each call one pass over
    the blocks, :func:`..kernels.tron.partial_pass` on each (``mixed``: both kinds in one pass)."""
    first = int(first)
    none = np.zeros((d, 0))

    def mixed(Wf, cf, diag, Wh, Vh, ch):
        cf, ch = np.asarray(cf, np.int64), np.asarray(ch, np.int64)
        out_f = (np.zeros(len(cf)), np.zeros((d, len(cf)))) + ((np.zeros((d, len(cf))),) if diag else ())
        out_h = np.zeros((d, len(ch)))
        for rb in blocks():
            tron.partial_pass(rb, node_ptr, Wf, first + cf, Wh, Vh, first + ch, out_f=out_f, out_h=out_h, diag=diag)
        return tron.regularized(out_f[0], out_f[1], Wf) + out_f[2:], Vh + out_h

    def fun_grad(W, cols, diag=False):
        return mixed(W, cols, diag, none, none, [])[0]

    def hess_vec(W, V, cols):
        return mixed(none, [], False, W, V, cols)[1]

    return fun_grad, hess_vec, mixed


def node_counts(blocks: Callable[[], Iterable[tron.RowBlock]], lo: int, hi: int):
    """(rows, positives of each classifier ``lo`` .. ``hi - 1``) of one node: one pass over its blocks."""
    rows, pos = 0, np.zeros(hi - lo, np.int64)
    for rb in blocks():
        rows += rb.X.shape[0]
        idx = rb.pos.indices
        pos += np.bincount(idx[(idx >= lo) & (idx < hi)] - lo, minlength=hi - lo)
    return rows, pos


def train_node(blocks: Callable[[], Iterable[tron.RowBlock]], node_ptr: np.ndarray, lo: int, hi: int, d: int,
               params: TrainParams):
    """TRON on the classifiers ``lo`` .. ``hi - 1`` (global ids, all of one node) over the node's
    streamed rows (the distributed solver's tolerance: ``train.tron_eps`` scaled per classifier as
    LIBLINEAR, ``tron_max_iter``, ``tron_pcg``): (W: d x (hi - lo) float64,
    :class:`..kernels.tron.TronInfo`)."""
    rows, pos = node_counts(blocks, lo, hi)
    K = int(hi - lo)
    fun_grad, hess_vec, mixed = node_oracle(blocks, node_ptr, lo, d)
    eps = tron.liblinear_eps(params.tron_eps, pos, np.full(K, rows))
    return tron.tron(fun_grad, hess_vec, d, K, eps=eps, max_iter=params.tron_max_iter, pcg=params.tron_pcg,
                     mixed=mixed)


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
                   emit_table: Callable) -> DataFrame:
    """The big nodes' weights rows (:data:`..schemas.WEIGHTS_SCHEMA`), checkpointed: their rows
    written as block files under ``root`` (:func:`write_blocks`), then one task per
    :func:`work_units` unit (a node, or a run of a wide node's classifiers; the most work first)
    training it with :func:`train_node` and emitting ``emit_table(is_leaf, keys, idx, val)`` of
    its pruned weights (``big[g]``'s children ``kids[g]``); the files are deleted at the end
    (also after an error)."""
    uri = f"{root.rstrip('/')}/streamed-{uuid.uuid4().hex}"
    fs, base = client_fs(uri)
    fs.create_dir(base, recursive=True)
    try:
        written = write_blocks(rows, pack, uri)
        n_rows = np.zeros(len(big), np.int64)          # a big node always has rows; 0 would train to w = 0
        n_rows[written.column("node").to_numpy()] = written.column("rows").to_numpy()
        units = work_units(n_rows, node_ptr, task_slots(spark, default_parallelism(spark)))
        log.info("train: %d big nodes, %d classifiers, %d rows in %d block files: %d tasks (a node or a run of its "
                 "classifiers each), TRON over the node's rows streamed from the files (eps %g, at most %d steps)",
                 len(big), int(node_ptr[-1]), int(n_rows.sum()), int(written.column("blocks").to_numpy().sum()),
                 len(units), params.tron_eps, params.tron_max_iter)
        threshold = params.threshold

        def run(batches):
            rfs, rbase = client_fs(uri)
            for b in batches:
                for i in b.column("id").to_pylist():
                    g, lo, hi = (int(v) for v in units[i])
                    blocks = block_reader(rfs, f"{rbase}/n{g}", unpack)
                    W, info = train_node(blocks, node_ptr, lo, hi, d, params)
                    worker_log().info(
                        "train (streamed): node %d, classifiers %d-%d of %d: %d passes, Newton steps %d-%d, CG steps "
                        "%d-%d, %d of %d met the tolerance", int(big[g]), lo - node_ptr[g], hi - node_ptr[g] - 1,
                        node_ptr[g + 1] - node_ptr[g], info.passes, info.steps.min(), info.steps.max(),
                        info.cg_steps.min(), info.cg_steps.max(), int(info.converged.sum()), hi - lo)
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
