"""Scale-out measurements from Spark's event log, on `xmc-spark synth` sets of growing size.

Run on demand (minutes to an hour, depending on the sizes):

    python benchmarks/scale.py --sizes 250000,500000,1000000 --work /tmp/xmc-scale
    python benchmarks/scale.py --sizes 1000000 --cap-python-memory 600m     # a capped Python worker

Each size n gets a synthetic XC set (labels and features growing with n: 20K x 50K at 250K
samples, 50K x 100K at 500K, 100K x 200K from 1M; ``--labels`` / ``--features`` override)
and one real CLI run with Spark's event log on, ``spark.sql.shuffle.partitions=64`` and
partition coalescing off, ``train.max_node_rows = n / 8`` (``--node-rows-fraction``; 0 keeps
the configured bound), ``predict.max_broadcast_mb``
(default 4: above it the model stays sharded) and ``train.tron_driver_mb`` (default 0, as the
pipeline's: the distributed solver's vectors in files). The big nodes' solver is the configured
one (``train.big_node_solver``: ``auto``, streamed in local mode; ``--set
train.big_node_solver=distributed`` for the distributed one): a streamed node's task reads the
node's rows from block files, not from a shuffle, so the shuffle-read rows below do not count
them (such a task reads all of its node's rows, the root's n). Reported per run:

- wall seconds per pipeline stage (metrics.json) and of the whole process;
- the largest task's shuffle-read rows divided by n, per pipeline stage (jobs are tagged
  ``xmc-stage-<name>`` by the runner) and overall;
- the bytes all tasks returned to the driver (sum of the tasks' result sizes), against the size
  of the ``weights`` table (8 bytes a non-zero);
- the peak RSS of the Python workers (Spark's ``ProcessTreePythonRSSMemory`` executor metric,
  sampled every 100 ms: the sum over the workers alive at once, ``local[2]`` runs at most two),
  overall and per pipeline stage (the peak while that stage's tasks ran; an idle worker keeps the
  memory an earlier stage left in it);
- the peak RSS of one Python worker (the issue's measure): each Python process under the run's
  JVM (the workers and their daemon) read from ``/proc`` every 100 ms by this script
  (:class:`WorkerRSS`; Linux only), its largest value overall and per pipeline stage (the samples
  from the stage's first tagged job to the next stage's; an idle worker keeps what an earlier
  task left in it);
- P@1/3/5;
- and over all sizes, the growth exponent of wall time in n (least squares of log-log).

The table goes to stdout (markdown) and ``WORK/scale.json``.
"""
from __future__ import annotations

import argparse
import bisect
import glob
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_pecos import make_synth  # noqa: E402  (benchmarks/ is not a package)

SHAPES = {250000: (20000, 50000), 500000: (50000, 100000)}
# the executor samples the Python workers' RSS this often: without it, at each heartbeat (10 s), so
# the "peak" is where a sample fell (README: 1,513 against 1,071 MB for one predict stage)
RSS_POLL = "100ms"


def shape_of(n: int, labels=None, features=None):
    L, d = SHAPES.get(n, (20000, 50000) if n < 250000 else (100000, 200000))
    return labels or L, features or d


class WorkerRSS:
    """The RSS of the Python processes under the JVM of the run ``pid`` (the driver's process:
    driver -> JVM -> pyspark daemon -> its forked workers), read from ``/proc`` every ``every``
    seconds by a thread; ``samples`` holds (epoch ms, the largest one process's RSS in bytes) a
    read. Outside Linux (no ``/proc``) it measures nothing."""

    def __init__(self, pid: int, every: float = 0.1):
        self.pid, self.every, self.samples = pid, every, []
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if os.path.isdir("/proc/self"):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @staticmethod
    def _stat(pid: str):
        """(command name, parent pid) of a process, None if it is gone."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
        except OSError:
            return None
        name = text[text.index("(") + 1:text.rindex(")")]
        return name, int(text[text.rindex(")") + 2:].split()[1])

    def _workers(self):
        procs = {p: st for p in os.listdir("/proc") if p.isdigit() for st in [self._stat(p)] if st is not None}
        kids = defaultdict(list)
        for p, (_, ppid) in procs.items():
            kids[ppid].append(int(p))
        out, todo = [], [k for k in kids.get(self.pid, []) if procs[str(k)][0] == "java"]
        while todo:                         # the JVM's descendants that are Python
            q = todo.pop()
            for k in kids.get(q, []):
                todo.append(k)
                if procs[str(k)][0].startswith("python"):
                    out.append(k)
        return out

    def _run(self):
        while not self._stop.wait(self.every):
            most = 0
            for w in self._workers():
                try:
                    with open(f"/proc/{w}/statm") as f:
                        most = max(most, int(f.read().split()[1]) * self.page)
                except OSError:
                    continue
            if most:
                self.samples.append((time.time() * 1000, most))

    def peaks(self, starts) -> dict:
        """The largest sample overall ("all") and per pipeline stage: ``starts`` are (epoch ms of
        the stage's first tagged job, stage name) in time order (:func:`read_event_log`)."""
        out = defaultdict(int)
        for t, rss in self.samples:
            name = stage_at(starts, t)
            out[name] = max(out[name], rss)
            out["all"] = max(out["all"], rss)
        return dict(out)


def stage_at(starts, t) -> str:
    """The pipeline stage running at epoch ms ``t``: the one whose first tagged job (``starts``:
    (epoch ms, stage name) in time order) came last at or before it; "untagged" before any."""
    i = bisect.bisect_right([s for s, _ in starts], t) - 1
    return starts[i][1] if i >= 0 else "untagged"


def open_log(path: str):
    """An event log file as text lines (Spark 4 writes zstd-compressed rolling files)."""
    import io
    if path.endswith(".zstd"):
        import zstandard
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_event_log(folder: Path) -> dict:
    """Per pipeline stage and overall: max shuffle-read rows of one task, summed result bytes,
    peak Python RSS (of the tasks' executor metrics: the workers' sum while a task of that stage
    ran; the overall peak also takes the heartbeats and stage peaks).

    A job is attributed to the pipeline stage of its ``xmc-stage-<name>`` tag. Jobs that Spark
    runs outside the tagging thread (an Arrow collection, ``toPandas``/``to_arrow``, runs its job
    from a JVM server thread, which does not carry the session's tags) are attributed by time: to
    the stage with the latest first tagged submission at or before theirs (stages run one after
    another); "untagged" is a job before any tagged one."""
    def rolling_index(path):                   # events_<i>_<app>: in order of i, not of the name
        base = os.path.basename(path).split("_")
        return (int(base[1]) if len(base) > 1 and base[1].isdigit() else 0, path)

    files = sorted((f for f in glob.glob(str(folder / "**" / "*"), recursive=True)
                    if os.path.isfile(f) and not os.path.basename(f).startswith((".", "appstatus"))), key=rolling_index)
    if not files:
        raise SystemExit(f"no event log under {folder}")
    jobs = {}                                  # job id -> [tag name or None, submitted, stage ids]
    per_stage = defaultdict(lambda: [0, 0, 0])  # spark stage id -> [max task shuffle rows, result bytes, peak RSS]
    peak_py = 0
    for f in files:
        with open_log(f) as fh:
            for line in fh:
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:      # the last line of a log still being written
                    continue
                kind = e.get("Event")
                if kind == "SparkListenerJobStart":
                    tags = str((e.get("Properties") or {}).get("spark.job.tags", ""))
                    # session tags reach the event log prefixed: spark-session-<id>-thread-<id>-xmc-stage-<name>
                    name = next((t.split("xmc-stage-", 1)[1] for t in tags.split(",") if "xmc-stage-" in t), None)
                    jobs[e["Job ID"]] = [name, e.get("Submission Time", 0), e.get("Stage IDs", [])]
                elif kind == "SparkListenerTaskEnd":
                    m = e.get("Task Metrics") or {}
                    acc = per_stage[e.get("Stage ID")]
                    acc[0] = max(acc[0], int((m.get("Shuffle Read Metrics") or {}).get("Total Records Read", 0)))
                    acc[1] += int(m.get("Result Size", 0))
                    rss = int((e.get("Task Executor Metrics") or {}).get("ProcessTreePythonRSSMemory", 0))
                    acc[2] = max(acc[2], rss)
                    peak_py = max(peak_py, rss)
                elif kind in ("SparkListenerStageExecutorMetrics", "SparkListenerExecutorMetricsUpdate"):
                    em = e.get("Executor Metrics") or {}
                    peak_py = max(peak_py, int(em.get("ProcessTreePythonRSSMemory", 0)))
    firsts = {}                                # stage name -> its first tagged submission
    for name, start, _ in jobs.values():
        if name is not None:
            firsts[name] = min(firsts.get(name, start), start)
    starts = sorted((t, name) for name, t in firsts.items())
    max_rows, result_bytes, peak_rss, seen = defaultdict(int), defaultdict(int), defaultdict(int), set()
    for _, (name, start, stages) in sorted(jobs.items()):
        if name is None:
            name = stage_at(starts, start)
        for sid in stages:
            if sid in seen:                    # a stage a later job lists again (skipped: its tasks ran once)
                continue
            seen.add(sid)
            rows, nbytes, rss = per_stage.get(sid, (0, 0, 0))
            for k in (name, "all"):
                max_rows[k] = max(max_rows[k], rows)
                result_bytes[k] += nbytes
                peak_rss[k] = max(peak_rss[k], rss)
    return {"max_task_shuffle_rows": dict(max_rows), "result_bytes": dict(result_bytes), "peak_python_rss": peak_py,
            "peak_python_rss_by_stage": {k: v for k, v in peak_rss.items() if k != "all"}, "stage_starts": starts}


def synth_set(n: int, L: int, d: int, work: Path, cores: int) -> Path:
    """The folder of the synthetic set: XC text up to 500K training rows (the sets compare_pecos
    uses), Delta tables ``train`` and ``test`` above (`xmc-spark synth` writes XC through the
    driver, so only up to 500K rows)."""
    if n <= 500_000:
        return Path(make_synth(f"{n},{L},{d}", work, cores)[0]).parent
    data = work / f"synth_{n}_{L}_{d}_delta"
    if not (data / "test" / "_delta_log").is_dir():
        subprocess.run([sys.executable, "-m", "xmc_spark.cli", "synth", "--out", str(data), "--n-train", str(n),
                        "--n-test", str(max(n // 10, 1000)), "--labels", str(L), "--features", str(d),
                        "--format", "delta", "--set", f"spark.master=local[{cores}]", "--set", "mlflow.enabled=false"],
                       check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True)
    return data


def run_one(n: int, data: Path, work: Path, cores: int, extra, tag: str, node_fraction=None) -> dict:
    out = work / f"run_{tag}_{n}"
    evlog = work / f"eventlog_{tag}_{n}"
    for p in (out, evlog):
        subprocess.run(["rm", "-rf", str(p)], check=True)
    evlog.mkdir(parents=True)
    train, test = ((data / "train.txt", data / "test.txt") if (data / "train.txt").exists()
                   else (data / "train", data / "test"))             # XC text, or Delta tables above 500K rows
    cmd = [sys.executable, "-m", "xmc_spark.cli", "run", "--train", str(train),
           "--test", str(test), "--out", str(out),
           "--set", f"spark.master=local[{cores}]", "--set", "mlflow.enabled=false",
           "--set", "spark.conf.spark.eventLog.enabled=true", "--set", f"spark.conf.spark.eventLog.dir={evlog}",
           "--set", "spark.conf.spark.executor.processTreeMetrics.enabled=true",
           "--set", f"spark.conf.spark.executor.metrics.pollingInterval={RSS_POLL}",
           "--set", "spark.conf.spark.sql.shuffle.partitions=64",
           "--set", "spark.conf.spark.sql.adaptive.coalescePartitions.enabled=false",
           *([] if node_fraction is None else ["--set", f"train.max_node_rows={max(1, n // node_fraction)}"]), *extra]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    with WorkerRSS(proc.pid) as rss:
        _, err = proc.communicate()
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"xmc-spark failed on n={n}:\n{err[-4000:]}")
    m = json.loads((out / "metrics.json").read_text())
    ev = read_event_log(evlog)
    worker = rss.peaks(ev["stage_starts"])
    weights_bytes = weights_table_bytes(out)
    return {"n": n, "labels": m["n_labels"], "features": m["n_features"], "process_seconds": round(wall, 1),
            "seconds": m["seconds"], "p@1": m["p@1"], "p@3": m["p@3"], "p@5": m["p@5"],
            "model_layout": m.get("model_layout"), "weights_bytes": weights_bytes,
            "max_task_rows_over_n": {k: round(v / n, 3) for k, v in ev["max_task_shuffle_rows"].items()},
            "result_bytes": ev["result_bytes"], "peak_python_rss_mb": round(ev["peak_python_rss"] / 2 ** 20, 1),
            "peak_python_rss_mb_by_stage": {k: round(v / 2 ** 20, 1)
                                            for k, v in ev["peak_python_rss_by_stage"].items()},
            "peak_worker_rss_mb": round(worker.get("all", 0) / 2 ** 20, 1),
            "peak_worker_rss_mb_by_stage": {k: round(v / 2 ** 20, 1) for k, v in worker.items() if k != "all"}}


def weights_table_bytes(out: Path) -> int:
    """8 bytes a non-zero of the run's weights table (read with pyarrow: no Spark needed)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    path = out / "tables" / "weights"
    files = [str(p) for p in path.rglob("*.parquet")]
    live = live_files(path)
    t = ds.dataset([f for f in files if os.path.relpath(f, path) in live] or files, format="parquet").to_table(
        columns=["w_idx"])
    return int(pc.sum(pc.list_value_length(t.column("w_idx"))).as_py() or 0) * 8


def live_files(table: Path) -> set:
    """The data files of a Delta table's latest version (replaying its JSON log)."""
    live = set()
    for f in sorted((table / "_delta_log").glob("*.json")):
        for line in f.read_text().splitlines():
            a = json.loads(line)
            if "add" in a:
                live.add(a["add"]["path"])
            elif "remove" in a:
                live.discard(a["remove"]["path"])
    return live


def growth_exponent(rows) -> float:
    xs = [math.log(r["n"]) for r in rows]
    ys = [math.log(r["process_seconds"]) for r in rows]
    if len(xs) < 2:
        return float("nan")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _peak_stage(r, key: str = "peak_python_rss_mb_by_stage") -> str:
    """The pipeline stage whose tasks saw the highest Python RSS and that peak, as " (stage MB)";
    "" for rows without per-stage peaks or with none measured. (The overall peak before it also
    takes the samples between tasks, so it may be higher.)"""
    by = r.get(key) or {}
    top = max(by, key=by.get) if by else None
    return f" ({top} {by[top]})" if top is not None and by[top] > 0 else ""


def table(rows) -> str:
    """The markdown table of the runs. The pipeline's ``tree`` stage runs the label embedding
    inside it, so its seconds are the "embedding+tree" column (until 2026-12-01 this column added
    the embedding's seconds to them a second time)."""
    head = ("| n | labels x features | layout | process s | ingest | embedding+tree | train | predict | "
            "max task rows / n (train, all) | bytes to driver (all) | weights table | driver/weights | "
            "peak Python RSS MB, all workers (stage) | one worker (stage) | P@1 | P@3 | P@5 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s = r["seconds"]
        rb = r["result_bytes"].get("all", 0)
        mt = r["max_task_rows_over_n"]
        lines.append(
            f"| {r['n']:,} | {r['labels']:,} x {r['features']:,} | {r['model_layout']} | {r['process_seconds']} | "
            f"{s.get('ingest', 0):.0f} | {s.get('tree', 0):.0f} | {s.get('train', 0):.0f} | "
            f"{s.get('predict', 0):.0f} | {mt.get('train', 0)}, {mt.get('all', 0)} | {rb / 2 ** 20:.1f} MB | "
            f"{r['weights_bytes'] / 2 ** 20:.1f} MB | {rb / max(r['weights_bytes'], 1):.1%} | "
            f"{r['peak_python_rss_mb']}{_peak_stage(r)} | "
            f"{r.get('peak_worker_rss_mb', '-')}{_peak_stage(r, 'peak_worker_rss_mb_by_stage')} | "
            f"{r['p@1']:.2f} | {r['p@3']:.2f} | {r['p@5']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="250000,500000,1000000,2000000")
    ap.add_argument("--labels", type=int)
    ap.add_argument("--features", type=int)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--work", default="/tmp/xmc-scale")
    ap.add_argument("--max-broadcast-mb", type=float, default=4.0)
    ap.add_argument("--tron-driver-mb", type=float, default=0.0,
                    help="train.tron_driver_mb (0, the default: the big nodes' solver keeps its vectors in files)")
    ap.add_argument("--node-rows-fraction", type=int, default=8,
                    help="train.max_node_rows = n / this (0: the configured bound, auto by default)")
    ap.add_argument("--cap-python-memory", help="spark.executor.pyspark.memory for one extra capped run per size")
    ap.add_argument("--set", action="append", default=[], help="extra xmc-spark --set overrides")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    extra = [x for s in args.set for x in ("--set", s)] + ["--set", f"predict.max_broadcast_mb={args.max_broadcast_mb}",
                                                          "--set", f"train.tron_driver_mb={args.tron_driver_mb}"]
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        L, d = shape_of(n, args.labels, args.features)
        data = synth_set(n, L, d, work, args.cores)
        frac = args.node_rows_fraction or None
        rows.append(run_one(n, data, work, args.cores, extra, "default", frac))
        print(json.dumps(rows[-1]), flush=True)
        if args.cap_python_memory:
            capped = run_one(n, data, work, args.cores,
                             extra + ["--set", f"spark.conf.spark.executor.pyspark.memory={args.cap_python_memory}"],
                             "capped", frac)
            capped["capped"] = args.cap_python_memory
            rows.append(capped)
            print(json.dumps(capped), flush=True)
    plain = [r for r in rows if "capped" not in r]
    result = {"rows": rows, "growth_exponent": round(growth_exponent(plain), 3)}
    (work / "scale.json").write_text(json.dumps(result, indent=2))
    print(table(rows))
    print(f"growth exponent of process seconds in n: {result['growth_exponent']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
