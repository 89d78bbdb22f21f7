"""The pipeline as six spark-submit jobs (as the Airflow DAG runs it), timed per job.

    python benchmarks/stage_jobs.py --data ../shared/data/bibtex [--run-key 2026-11-25] [--out runs/stage_bench]

Builds the wheel, then runs jobs/<stage>.py for ingest .. evaluate with the real spark-submit
(--py-files wheel, --packages Delta) on local[2], and prints each job's wall seconds
(JVM start-up included) and the evaluate stage's metrics.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from xmc_spark.registry import ORDER as STAGES  # noqa: E402 - the one list of stages


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with train.txt and test.txt")
    ap.add_argument("--run-key", default="2026-11-25")
    ap.add_argument("--out", default="runs/stage_bench")
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out / "dist"), str(ROOT)],
                   check=True, capture_output=True)
    wheel = next((out / "dist").glob("xmc_spark-*.whl"))
    from xmc_spark.session import delta_package
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    seconds, last = {}, None
    for stage in STAGES:
        cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", args.master, "--packages",
               delta_package(), "--py-files", str(wheel), str(ROOT / "jobs" / f"{stage}.py"),
               "--run-key", args.run_key, "--set", f"paths.root={out / 'root'}",
               "--set", f"mlflow.tracking_uri=sqlite:///{out / 'mlflow.db'}",
               "--set", f"mlflow.artifact_location={out / 'artifacts'}"]
        if stage == "ingest":
            cmd += ["--train", str(Path(args.data) / "train.txt"), "--test", str(Path(args.data) / "test.txt")]
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out)
        seconds[stage] = round(time.perf_counter() - t, 1)
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
            return r.returncode
        last = json.loads(r.stdout[r.stdout.index("\n{\n"):])
        print(f"{stage}: {seconds[stage]} s (stage work {last.get('seconds')} s)", flush=True)
    print(json.dumps({"seconds": seconds, "total": round(sum(seconds.values()), 1),
                      "metrics": {k: last[k] for k in ("p@1", "p@3", "p@5") if k in last}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
