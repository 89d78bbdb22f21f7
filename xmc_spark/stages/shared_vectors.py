"""TRON's vectors in shared storage: the distributed solver of the big nodes with only scalars
reaching the driver.

:func:`..kernels.tron.tron_space` runs the trust-region loop against a vector space of named
d x K vectors (W, G, S, R, D, HD, Gn, and M, Mn with the preconditioner: d = features + bias,
K = the big nodes' classifiers).
:class:`SharedSpace` keeps those vectors in files under a scratch folder that every task and the
driver see (the run's folder: local disk in local mode, a ``/Volumes`` or ``/dbfs`` mount, or
``s3://``/``gs://``/``abfss://`` through pyarrow), one file per (vector, node, block of
:data:`BLOCK` doubles of feature rows), in a folder per (vector, node, job that wrote it); the
driver holds which job wrote each (vector, node) last and the per-classifier scalars of the
loop, O(nodes x vectors + classifiers).

Jobs:

- ``fun_grad`` / ``hess_vec`` / ``step`` (both at once, for two sets of classifiers: the
  out-of-step loop's data pass): the tasks over the persisted big-node rows (as
  :class:`..stages.node_training.SparkOracle`'s) read the current W (and the direction) of the
  nodes they hold from the files, add up their rows' partial sums per node, and emit them cut
  into the same (node, block) pieces; ``groupBy(node, block).applyInArrow`` sums each piece,
  adds the regularizer, writes it as the new vector's block and returns only that block's
  share of the loss and of the inner products the loop asked for;
- ``combine``: the linear combinations (per-classifier coefficients) of the CG step and the
  trust-region step ask for no inner product, so they are deferred into the next job (a vector
  only on the classifiers whose update is not the vector itself): its
  tasks read an updated vector through its terms, its reduce tasks (and one task per block of a
  node it would not otherwise touch) write it. One Spark job per data pass. A combination that
  asks for inner products, or meets one already deferred, is a job of its own over the
  (node, block) keys.

So a task holds its rows plus one node's d x K_node vectors, the reduce and combine tasks one
block of each vector, and the driver receives one row per node per job (the node's losses and
inner products, summed over its blocks by a grouped task), whatever the number of samples or
features. A job writes its vectors' blocks into new folders;
the versions they replace are deleted after the job (so the folder holds each vector once), the
whole scratch folder at the end. A retried task rewrites the same files.
"""
from __future__ import annotations

import logging
import uuid
from typing import Callable, Dict, Iterable, NamedTuple, Optional

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..arrow_utils import grouped_apply, list_array, list_offsets_values, to_arrow
from ..compat import default_parallelism, task_slots
from ..kernels import tron
from ..storage import client_fs, write_whole

log = logging.getLogger("xmc_spark.train")
BLOCK = 1 << 16                 # doubles per file (512 KiB)
PIECE_SCHEMA = "g int, fb int, part int, seq int, loss array<double>, vals array<double>"
SCALAR_SCHEMA = "g int, fb int, loss array<double>, dots array<double>"


def _scalars(g, fb, loss, dots) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({
        "g": pa.array([int(g)], pa.int32()), "fb": pa.array([int(fb)], pa.int32()),
        "loss": list_array(np.array([0, len(loss)]), np.asarray(loss, np.float64), pa.float64()),
        "dots": list_array(np.array([0, len(dots)]), np.asarray(dots, np.float64), pa.float64())})


class _Files:
    """What a task needs to read and write blocks: the scratch root, the block layout and which
    job wrote each (vector, node) last (absent: the zero vector). Pickled into the closures."""

    def __init__(self, uri: str, base: str, d: int, node_ptr: np.ndarray, where: Dict, pending=None):
        self.uri, self.base, self.d, self.node_ptr, self.where = uri, base, d, node_ptr, dict(where)
        self.pending = pending              # a deferred combine: ({name: terms}, {name: mask of its classifiers})
        self.k = np.diff(node_ptr)
        self.fb_rows = np.maximum(1, BLOCK // np.maximum(self.k, 1))
        self._cache_key, self._cache = None, {}     # the blocks of one (node, block) read so far

    def blocks(self, g: int) -> int:
        return -(-self.d // int(self.fb_rows[g]))

    def span(self, g: int, fb: int):
        lo = fb * int(self.fb_rows[g])
        return lo, min(self.d, lo + int(self.fb_rows[g]))

    def path(self, job: int, name: str, g: int, fb: int) -> str:
        return f"{version_dir(self.base, name, g, job)}/{fb}"

    def load(self, fs, name: str, g: int, fb: int) -> np.ndarray:
        """Block fb of vector ``name`` of node g: (rows, K_g), all of the node's classifiers (read
        once per task while it works on that block: a job reads only the versions ``where``
        names, never one it writes, so a repeated read returns the same values)."""
        if self._cache_key != (g, fb):
            self._cache_key, self._cache = (g, fb), {}
        if name not in self._cache:
            lo, hi = self.span(g, fb)
            job = self.where.get((name, g))
            if job is None:
                self._cache[name] = np.zeros((hi - lo, int(self.k[g])))
            else:
                with fs.open_input_stream(self.path(job, name, g, fb)) as f:
                    self._cache[name] = np.frombuffer(f.read(), np.float64).reshape(hi - lo, int(self.k[g]))
        return self._cache[name]

    def save(self, fs, job: int, name: str, g: int, fb: int, block: np.ndarray) -> None:
        """Write a block whole or not at all (:func:`~..storage.write_whole`: a speculative or
        retried attempt never leaves a half-written block to a reader)."""
        fs.create_dir(version_dir(self.base, name, g, job), recursive=True)
        data = np.ascontiguousarray(block, np.float64).tobytes()
        write_whole(fs, self.path(job, name, g, fb), lambda f: f.write(data))

    def stored(self, fs, terms, g: int, fb: int, sub: np.ndarray) -> np.ndarray:
        """sum coef x block of the node's classifiers ``sub`` (coefficients per global
        classifier), as the files hold the vectors (a name may be ``"A/B"`` or ``"A*B"``:
        :func:`..kernels.tron.elementwise`)."""
        lo, hi = self.span(g, fb)
        out = np.zeros((hi - lo, len(sub)))
        for coef, name in terms:
            c = coef[self.node_ptr[g] + sub]
            if c.any() and all((n, g) in self.where for n in tron.components(name)):
                out += c * tron.elementwise(name, lambda n: self.load(fs, n, g, fb)[:, sub])
        return out

    def terms(self, fs, terms, g: int, fb: int, sub: np.ndarray) -> np.ndarray:
        """:meth:`stored` with the deferred combine applied: a vector it updates is its terms on
        the classifiers it covers."""
        if self.pending is None:
            return self.stored(fs, terms, g, fb, sub)
        upd, masks = self.pending
        cols = self.node_ptr[g] + sub
        lo, hi = self.span(g, fb)
        out = np.zeros((hi - lo, len(sub)))

        def current(name):
            value = self.stored(fs, [(np.ones(self.node_ptr[-1]), name)], g, fb, sub)
            if name in upd and masks[name][cols].any():
                value = np.where(masks[name][cols], self.stored(fs, upd[name], g, fb, sub), value)
            return value
        for coef, name in terms:
            out += coef[cols] * tron.elementwise(name, current)
        return out

    def apply_pending(self, fs, job: int, g: int, fb: int) -> None:
        """Write block fb of node g of every vector the deferred combine updates there."""
        upd, masks = self.pending
        new = {}
        for name, terms in upd.items():
            psub = np.flatnonzero(masks[name][self.node_ptr[g]:self.node_ptr[g + 1]])
            if len(psub):
                new[name] = (psub, self.stored(fs, terms, g, fb, psub))
        for name, (psub, block) in new.items():          # all read before any write
            self.write(fs, job, name, g, fb, psub, block)

    def whole(self, fs, terms, g: int, sub: np.ndarray) -> np.ndarray:
        """The d x len(sub) matrix of ``terms`` of node g (all its blocks)."""
        return self.wholes(fs, [(terms, sub)], g)[0]

    def wholes(self, fs, wanted, g: int) -> list:
        """:meth:`whole` of each (terms, sub) of ``wanted``, block by block (a block is read
        once for all of them)."""
        parts = [[] for _ in wanted]
        for fb in range(self.blocks(g)):
            for out, (terms, sub) in zip(parts, wanted):
                out.append(self.terms(fs, terms, g, fb, sub))
        return [np.vstack(p) for p in parts]

    def write(self, fs, job: int, name: str, g: int, fb: int, sub: np.ndarray, block: np.ndarray) -> None:
        """Set the classifiers ``sub`` of block fb of ``name`` (the others keep their values)."""
        if len(sub) < self.k[g]:
            full = self.load(fs, name, g, fb).copy()
            full[:, sub] = block
            block = full
        self.save(fs, job, name, g, fb, block)


def _sum_per_node(t: pa.Table) -> pa.Table:
    """One node's per-block scalar rows summed (the data loss sits on block 0, each block adds
    its share of the regularizer; a block the
    job only wrote for a deferred combination has none)."""
    def total(col):
        off, v = list_offsets_values(t, col)
        rows = [v[off[i]:off[i + 1]] for i in range(t.num_rows) if off[i + 1] > off[i]]
        return np.sum(rows, axis=0) if rows else np.zeros(0)
    return pa.Table.from_batches([_scalars(int(t.column("g")[0].as_py()), 0, total("loss"), total("dots"))])


def _parallel(par: int, n: int) -> int:
    """Tasks for ``n`` (node, block) keys: at most ``par`` (:func:`solver_tasks`). Every job
    of the loop pays each task's fixed cost (~0.1 s on a 2-core machine), and a key's work is
    reading and writing a few blocks of 512 KiB, so more tasks only add overhead."""
    return max(1, min(int(n), int(par)))


def query_tasks(rows: DataFrame, par: int) -> DataFrame:
    """The persisted big-node rows as a query of the distributed solver reads them: their
    partitions merged (``coalesce``, no shuffle) into at most ``par`` tasks (the solver passes
    :func:`solver_tasks`: the larger of Spark's default parallelism and its task slots).
    :func:`.node_training.big_row_partitions` may cut the rows finer than that (a partition of
    the range shuffle holds at most :data:`.node_training.PART_BOUNDS` bounds of rows); a
    query's task streams its partitions one packed block at a time
    (:class:`.node_training._solver_session`), so merging them raises no task's memory, while
    every task pays a fixed cost per query and returns its metadata to the driver (200K rows at
    n/8 on local[2]: 23 map tasks a pass -> 4, the pass 4.0 -> 3.3 s, the map tasks' results 168
    -> 29 KB). A task may receive a node's rows in several runs (Spark's coalescing groups
    partitions by their cached blocks' locations, not by node): each run reads the node's
    vectors and emits its pieces, which the reduce sums. The grouping is deterministic for given
    block locations."""
    return rows.coalesce(max(1, int(par)))


def solver_tasks(spark) -> int:
    """The most tasks of a solver job: the larger of Spark's default parallelism and the task
    slots (``local[N]``'s N; a cluster's default parallelism is its executors' cores), so that a
    configured ``spark.default.parallelism`` below the cores leaves no core idle, and no more,
    since every task pays a fixed cost per job."""
    par = int(default_parallelism(spark))           # on Spark Connect it may cost a job: read once
    return max(par, task_slots(spark, par))


def version_dir(base: str, name: str, g: int, job: int) -> str:
    """The folder of vector ``name`` of node g as job ``job`` wrote it (one file per block)."""
    return f"{base}/{name}-{g}/j{job}"


def _dots(blocks: Dict[str, np.ndarray], files: _Files, fs, dots, g, fb, sub) -> np.ndarray:
    """Column-wise inner products of block fb of the ``dots`` pairs (``blocks``: values this job
    just computed; the rest read from the files; ``"A/B"``, ``"A*B"`` of either)."""
    def get(name):
        if name not in blocks:
            blocks[name] = files.terms(fs, [(np.ones(files.node_ptr[-1]), name)], g, fb, sub)
        return blocks[name]
    return (np.concatenate([np.einsum("ij,ij->j", tron.elementwise(a, get), tron.elementwise(b, get))
                            for a, b in dots]) if dots else np.zeros(0))


class _Op(NamedTuple):
    """One operation of a data pass (:meth:`SharedSpace._oracle`): ``sub`` node -> its classifiers
    in it (positions within the node), ``w`` / ``v`` terms, ``pre`` = (name, a) or None."""
    kind: str
    sub: Dict[int, np.ndarray]
    w: list
    v: list
    out: str
    dots: list
    pre: Optional[tuple]

    @property
    def n_out(self) -> int:
        return 1 + (self.kind == "fg" and self.pre is not None)


def _pass_args(plan, vecs, accs, first: int, d: int, g: int) -> dict:
    """:func:`..kernels.tron.partial_pass`'s arguments for node g (its first classifier ``first``)
    from its operations' vectors and accumulators (at most one operation of each kind)."""
    none = np.zeros((d, 0))
    kw = dict(W=none, cf=[], Wh=none, Vh=none, ch=[], out_f=None, out_h=None, diag=False)
    for op, vec, acc in zip(plan, vecs, accs):
        if acc is not None and op.kind == "fg":
            kw.update(W=vec[0], cf=first + op.sub[g], out_f=acc, diag=op.pre is not None)
        elif acc is not None:
            kw.update(Wh=vec[0], Vh=vec[1], ch=first + op.sub[g], out_h=acc[1])
    return kw


class SharedSpace:
    """The vector space of :func:`..kernels.tron.tron_space` with its vectors in files under
    ``root`` (see the module docstring). ``rows``: the persisted packed rows (column ``node`` =
    index of the big node), ``unpack(batch)``: their :class:`..kernels.tron.RowBlock` s (one node
    each), ``node_ptr``: classifiers of node g = ``node_ptr[g]:node_ptr[g + 1]``; ``par``: the
    most tasks of a job (a data pass's map and reduce tasks, a combination's tasks; default
    :func:`solver_tasks`)."""

    def __init__(self, rows: DataFrame, unpack: Callable[[pa.RecordBatch], Iterable[tron.RowBlock]],
                 node_ptr: np.ndarray, d: int, root: str, par: Optional[int] = None):
        self.rows, self.unpack = rows, unpack
        self.node_ptr = np.asarray(node_ptr, np.int64)
        self.d, self.K = int(d), int(self.node_ptr[-1])
        self.root = f"{root.rstrip('/')}/tron-{uuid.uuid4().hex}"
        self.fs, self.fs_root = client_fs(self.root)
        self.fs.create_dir(self.fs_root, recursive=True)
        self.where: Dict = {}
        self.pending = None                 # (updates with per-classifier coefficients, {name: classifier mask})
        self.jobs = 0
        self.driver_bytes = 0               # bytes of the scalar rows collected so far
        self.col_node = np.repeat(np.arange(len(self.node_ptr) - 1), np.diff(self.node_ptr))
        # read once (on Spark Connect it may cost a job); the caller may pass what it already read
        self.par = solver_tasks(rows.sparkSession) if par is None else int(par)

    # ---- the five methods tron_space calls -------------------------------------------------------

    def fun_grad(self, w, out: str, cols, dots=(), precond=None):
        return self._oracle([("fg", cols, self._coefs(w, cols), None, out, dots, precond)])[0]

    def hess_vec(self, w: str, v: str, out: str, cols, dots=()):
        return self._oracle([("hv", cols, [(self._full(1.0, cols), w)], v, out, dots, None)])[0][1]

    def step(self, hv, fg):
        """Both of :class:`..kernels.tron.NumpySpace`'s ``step`` operations in one Spark job."""
        ops = ([] if hv is None else [("hv", hv[3], [(self._full(1.0, hv[3]), hv[0])], hv[1], hv[2], hv[4], None)]) \
            + ([] if fg is None else [("fg", fg[2], self._coefs(fg[0], fg[2]), None, fg[1], fg[3], fg[4])])
        res = self._oracle(ops)
        return (None if hv is None else res[0][1]), (None if fg is None else res[-1])

    def combine(self, updates, cols, dots=()):
        """Without ``dots`` the combination is deferred into the next call's job (its tasks read
        the updated vectors through their terms, its reduce tasks write them): the CG update and
        the next Hessian-vector product are one Spark job."""
        cols = np.asarray(cols, np.int64)
        upd = {name: self._coefs(terms, cols) for name, terms in updates.items()}
        self.flush()
        if not len(dots):
            mask = np.zeros(self.K, bool)
            mask[cols] = True
            # a vector is rewritten only where its update is not itself (coefficient 1 on it, 0 on
            # the rest): the trust-region loop sets W, G, M only for classifiers ending a step
            masks = {}
            for name, terms in upd.items():
                same = np.ones(self.K, bool)
                for coef, v in terms:
                    same &= coef == (1.0 if v == name else 0.0)
                if not any(v == name for _, v in terms):
                    same[:] = False
                if (mask & ~same).any():
                    masks[name] = mask & ~same
            if masks:
                self.pending = ({n: upd[n] for n in masks}, masks)
            return np.zeros((0, len(cols)))
        return self._combine_job(upd, cols, dots)

    def flush(self) -> None:
        """Run the deferred combination as a job of its own."""
        if self.pending is not None:
            (upd, masks), self.pending = self.pending, None
            self._combine_job(upd, np.flatnonzero(np.any(list(masks.values()), axis=0)), ())

    def _combine_job(self, upd, cols, dots):
        files, job, subs = self._files(), self._next_job(), self._subs(cols)
        keys = [(int(g), fb) for g in subs for fb in range(files.blocks(g))]

        def run(batches):
            fs, _ = client_fs(files.uri)
            for b in batches:
                for g, fb in (keys[i] for i in b.column("id").to_pylist()):
                    sub = subs[g]
                    new = {name: files.terms(fs, terms, g, fb, sub) for name, terms in upd.items()}
                    for name, block in new.items():
                        files.write(fs, job, name, g, fb, sub, block)
                    yield _scalars(g, fb, [], _dots(new, files, fs, dots, g, fb, sub))

        return self._finish(self._tasks(len(keys)).mapInArrow(run, SCALAR_SCHEMA), job,
                            {g: list(upd) for g in subs}, [("combine", cols, dots)])[0][1]

    # ---- the final weights -----------------------------------------------------------------------

    def weights(self, emit: Callable[[int, np.ndarray], pa.Table], schema: str) -> DataFrame:
        """``emit(g, W_g)`` of every node (W_g: d x K_g from the files) as a DataFrame, computed
        and checkpointed here (the files are deleted by :meth:`close`)."""
        self.flush()
        files = self._files()
        nodes = len(self.node_ptr) - 1

        def run(batches):
            fs, _ = client_fs(files.uri)
            for b in batches:
                for g in b.column("id").to_pylist():
                    W = files.whole(fs, [(np.ones(files.node_ptr[-1]), "W")], g, np.arange(files.k[g]))
                    yield from emit(g, W).to_batches()

        return self._tasks(nodes).mapInArrow(run, schema).localCheckpoint()

    def close(self) -> None:
        self.fs.delete_dir(self.fs_root)

    # ---- internals -------------------------------------------------------------------------------

    def _tasks(self, n: int) -> DataFrame:
        """ids 0..n-1 (a (node, block) key or a node each) over at most as many tasks as Spark runs
        at once (no shuffle): a task's fixed cost is paid once per job (:func:`_parallel`)."""
        return self.rows.sparkSession.range(0, n, numPartitions=_parallel(self.par, n))

    def _full(self, coef, cols) -> np.ndarray:
        full = np.zeros(self.K)
        full[np.asarray(cols, np.int64)] = coef
        return full

    def _coefs(self, terms, cols):
        return [(self._full(c, cols), name) for c, name in terms]

    def _subs(self, cols) -> Dict[int, np.ndarray]:
        """node -> its requested classifiers, as positions within the node."""
        cols = np.asarray(cols, np.int64)
        g = self.col_node[cols]
        return {int(n): np.sort(cols[g == n] - self.node_ptr[n]) for n in np.unique(g)}

    def _files(self) -> _Files:
        return _Files(self.root, self.fs_root, self.d, self.node_ptr, self.where, self.pending)

    def _next_job(self) -> int:
        self.jobs += 1
        return self.jobs

    def _oracle(self, ops):
        """One data pass for the operations ``ops`` = [(kind, cols, w, v, out, dots, precond)] on
        disjoint classifiers: ``out`` := the gradient at w (``fg``; ``precond`` = (name, a) also
        name := 1 + a x the loss part of diag H at w) or H(w) v (``hv``). Returns [(loss, dots)] per
        operation (``fg``: f, the regularizer included)."""
        ops = [(kind, np.asarray(cols, np.int64), w, v, out, dots, pre) for kind, cols, w, v, out, dots, pre in ops]
        outs = [o for op in ops for o in [op[4]] + ([op[6][0]] if op[6] else [])]
        if len(set(outs)) < len(outs):
            raise ValueError(f"SharedSpace: one data pass writes each vector once (got {outs})")
        if self.pending is not None and any(o in self.pending[0] for o in outs):
            self.flush()
        files, job, unpack, node_ptr = self._files(), self._next_job(), self.unpack, self.node_ptr
        subs = [self._subs(op[1]) for op in ops]
        nodes = sorted({g for s in subs for g in s})
        pnodes = [] if self.pending is None else sorted({int(g) for m in self.pending[1].values()
                                                          for g in np.unique(self.col_node[m])})
        extra = [(g, fb) for g in pnodes if g not in nodes for fb in range(files.blocks(g))]
        plan = [_Op(kind, sub, w, [(np.ones(self.K), v)] if v else [], out, dots, pre)
                for (kind, _, w, v, out, dots, pre), sub in zip(ops, subs)]

        def node_pieces(g, accs, part, seq):
            """(g, fb) rows: vals = every operation's block (the gradient, then diag H's part), in
            order; loss = the ``fg`` operations' losses, on block 0."""
            lv = np.concatenate([a[0] for op, a in zip(plan, accs) if a is not None and op.kind == "fg"]
                                + [np.zeros(0)])
            for fb in range(files.blocks(g)):
                lo, hi = files.span(g, fb)
                vals = np.concatenate([M[lo:hi].ravel() for a in accs if a is not None for M in a[1:]])
                lf = lv if fb == 0 else np.zeros(0)
                yield pa.RecordBatch.from_pydict({
                    "g": pa.array([g], pa.int32()), "fb": pa.array([fb], pa.int32()),
                    "part": pa.array([part], pa.int32()), "seq": pa.array([seq], pa.int32()),
                    "loss": list_array(np.array([0, len(lf)]), lf, pa.float64()),
                    "vals": list_array(np.array([0, len(vals)]), vals, pa.float64())})

        def partial(batches):
            """A task's partitions come in runs of one node's blocks (each partition sorted by
            node; :func:`query_tasks` may merge several): a node's vectors are read when a run
            begins and its pieces emitted (and dropped) when the run ends, so a task holds one
            node's d x K_node vectors at a time. A node in several runs of a task emits pieces for
            each (``seq``: the run's index), which the reduce sums."""
            from pyspark import TaskContext
            fs, _ = client_fs(files.uri)
            part = TaskContext.get().partitionId() if TaskContext.get() else 0
            cur, vecs, accs, seq = None, None, None, -1
            for b in batches:
                for rb in unpack(b):
                    g = int(rb.node[0])
                    if g not in nodes:
                        continue
                    if g != cur:
                        if cur is not None:
                            yield from node_pieces(cur, accs, part, seq)
                        cur, vecs, accs, seq = g, [], [], seq + 1
                        wanted = []
                        for op in plan:
                            if g in op.sub:
                                wanted += [(op.w, op.sub[g])] + ([(op.v, op.sub[g])] if op.v else [])
                        got = iter(files.wholes(fs, wanted, g))
                        for op in plan:
                            sub = op.sub.get(g)
                            vecs.append(None if sub is None else (next(got), next(got) if op.v else None))
                            accs.append(None if sub is None else (np.zeros(len(sub)),) + tuple(
                                np.zeros((files.d, len(sub))) for _ in range(op.n_out)))
                        call = _pass_args(plan, vecs, accs, node_ptr[g], files.d, g)
                    tron.partial_pass(rb, node_ptr, **call)       # one pass over the rows for both kinds
            if cur is not None:
                yield from node_pieces(cur, accs, part, seq)

        def reduce(t: pa.Table) -> pa.Table:
            fs, _ = client_fs(files.uri)
            # the pieces in (task, run) order, whatever order the shuffle delivered: sums are deterministic
            t = t.take(pa.array(np.lexsort((t.column("seq").to_numpy(), t.column("part").to_numpy()))))
            g, fb = int(t.column("g")[0].as_py()), int(t.column("fb")[0].as_py())
            if files.pending is not None:
                files.apply_pending(fs, job, g, fb)
            if g not in nodes:                     # a block only the deferred combine writes
                return pa.Table.from_batches([_scalars(g, fb, [], [])])
            lo, hi = files.span(g, fb)
            _, vals = list_offsets_values(t, "vals")
            summed = vals.reshape(t.num_rows, -1).sum(axis=0)
            _, lv = list_offsets_values(t, "loss")
            lsum = lv.reshape(t.num_rows, -1).sum(axis=0) if len(lv) else None     # on block 0 only
            at, lat, losses, dvals = 0, 0, [], []
            for op in plan:
                if g not in op.sub:
                    continue
                sub = op.sub[g]
                size = op.n_out * (hi - lo) * len(sub)
                blocks = summed[at:at + size].reshape(op.n_out, hi - lo, len(sub))
                at += size
                block, new = blocks[0], {}
                if op.kind == "fg":                # + w and 0.5 ||w||^2 (this block's share)
                    wb = files.terms(fs, op.w, g, fb, sub)
                    block = block + wb
                    loss = 0.5 * np.einsum("ij,ij->j", wb, wb)
                    if lsum is not None:
                        loss = loss + lsum[lat:lat + len(sub)]
                    lat += len(sub)
                    losses.append(loss)
                    if op.pre is not None:         # M = 1 + a x (loss part of diag H)
                        new[op.pre[0]] = 1.0 + op.pre[1] * blocks[1]
                        files.write(fs, job, op.pre[0], g, fb, sub, new[op.pre[0]])
                else:                              # + v
                    block = block + files.terms(fs, op.v, g, fb, sub)
                files.write(fs, job, op.out, g, fb, sub, block)
                new[op.out] = block
                dvals.append(_dots(new, files, fs, op.dots, g, fb, sub))
            return pa.Table.from_batches([_scalars(g, fb, np.concatenate(losses + [np.zeros(0)]),
                                                   np.concatenate(dvals + [np.zeros(0)]))])

        n_keys = sum(files.blocks(g) for g in nodes)
        df = self.rows if len(nodes) == len(self.node_ptr) - 1 else self.rows.where(F.col("node").isin(nodes))
        df = query_tasks(df, self.par)          # at most par map tasks, whatever the row partitions
        reducers = _parallel(self.par, n_keys)
        pieces = df.mapInArrow(partial, PIECE_SCHEMA)
        if extra:
            def empty(batches):
                for b in batches:
                    for g, fb in (extra[i] for i in b.column("id").to_pylist()):
                        yield pa.RecordBatch.from_pydict({
                            "g": pa.array([g], pa.int32()), "fb": pa.array([fb], pa.int32()),
                            "part": pa.array([-1], pa.int32()), "seq": pa.array([0], pa.int32()),
                            "loss": pa.array([[]], pa.list_(pa.float64())),
                            "vals": pa.array([[]], pa.list_(pa.float64()))})
            pieces = pieces.unionByName(self._tasks(len(extra)).mapInArrow(empty, PIECE_SCHEMA))
        writes: Dict[int, list] = {}
        for op in plan:
            for g in op.sub:
                writes.setdefault(g, []).extend([op.out] + ([op.pre[0]] if op.pre else []))
        for g in pnodes:
            writes[g] = writes.get(g, []) + [n for n, m in self.pending[1].items()
                                             if m[self.node_ptr[g]:self.node_ptr[g + 1]].any()]
        self.pending = None
        scalars = grouped_apply(pieces.repartition(reducers, "g", "fb"), ["g", "fb"], reduce, SCALAR_SCHEMA)
        return self._finish(scalars, job, writes, [(kind, cols, dots) for kind, cols, _, _, _, dots, _ in ops])

    def _finish(self, scalars: DataFrame, job: int, writes: Dict[int, list], ops):
        """Collect the scalars, summed over a node's blocks by the tasks (one row per node
        reaches the driver, whatever the number of features); return [(loss, dots)] per
        operation of ``ops`` = [(kind, cols, dots)] in its ``cols``' order (a node's row holds the
        ``fg`` operations' losses, then every operation's dots, each over the node's classifiers
        in it); record the job's vectors (``writes``: node -> the vectors it wrote), delete the
        versions they replace."""
        # at most par (solver_tasks) tasks, whatever spark.sql.shuffle.partitions is (64
        # without coalescing made this step alone 2.5-3.6 s a query at 250K); the groupBy reuses it
        nodes = len(writes) if writes else 1
        t = to_arrow(grouped_apply(scalars.repartition(_parallel(self.par, nodes), "g"), ["g"], _sum_per_node,
                                   SCALAR_SCHEMA))
        self.driver_bytes += t.nbytes
        subs, res, pos = [], [], []
        for _, cols, dots in ops:
            subs.append(self._subs(cols))
            res.append((np.zeros(len(cols)), np.zeros((len(dots), len(cols)))))
            p = np.full(self.K, -1, np.int64)
            p[np.asarray(cols, np.int64)] = np.arange(len(cols))
            pos.append(p)
        loff, lv = list_offsets_values(t, "loss")
        doff, dv = list_offsets_values(t, "dots")
        for r, g in enumerate(t.column("g").to_numpy()):
            g = int(g)
            la, da = loff[r], doff[r]
            for (kind, _, dots), s, (loss, D), p in zip(ops, subs, res, pos):
                if g not in s:
                    continue
                at = p[self.node_ptr[g] + s[g]]
                if kind == "fg" and loff[r + 1] > loff[r]:
                    loss[at] += lv[la:la + len(at)]
                    la += len(at)
                if len(dots):
                    D[:, at] += dv[da:da + len(dots) * len(at)].reshape(len(dots), len(at))
                    da += len(dots) * len(at)
        for g, names in writes.items():
            for name in names:
                old = self.where.get((name, g))
                self.where[(name, g)] = job
                if old is not None and old != job:      # the version this job replaced
                    self.fs.delete_dir(version_dir(self.fs_root, name, g, old))
        return res
