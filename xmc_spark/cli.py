"""``xmc-spark`` command line: run, sweep, make-groups, predict, synth, params."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from .config import dump_params, load_params
from .errors import XmcError
from .params import ConfigError
from .registry import ORDER, STAGES

log = logging.getLogger("xmc_spark.cli")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[],
                   help="YAML config (sections as printed by `xmc-spark params`); repeatable, later files win "
                        "(e.g. --config conf/emr.yaml --config experiment.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. tree.max_leaf_size=10 (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def parse_arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="xmc-spark", description="Extreme multi-label classification on Spark")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train on TRAIN, evaluate on TEST, write OUT/metrics.json and OUT/model")
    r.add_argument("--train", required=True, help="XC text, svmlight, Parquet or Delta path")
    r.add_argument("--test", help="XC text, svmlight, Parquet or Delta path (optional)")
    r.add_argument("--out", required=True, help="output folder")
    _common(r)
    w = sub.add_parser("sweep", help="train/score one model per value of a config key (nested MLflow runs, "
                                     "precision vs expected depth plot)")
    w.add_argument("--train", required=True, help="XC text, svmlight, Parquet or Delta path")
    w.add_argument("--test", help="XC text, svmlight, Parquet or Delta path (optional)")
    w.add_argument("--out", required=True, help="output folder: one subfolder per value, sweep.json, sweep.png")
    w.add_argument("--key", default="tree.lambda_prime", help="config key to sweep (default tree.lambda_prime)")
    w.add_argument("--values", default="0,0.5,1,2,6,30,1000",
                   help="comma-separated values (default 0,0.5,1,2,6,30,1000)")
    _common(w)
    g = sub.add_parser("make-groups", help="turn a labelled set into an aggregated one (EAGLE's R-G or C "
                                           "grouping), keeping the true labels for evaluation")
    g.add_argument("--train", required=True, help="labelled XC text, svmlight, Parquet or Delta path")
    g.add_argument("--strategy", choices=["random", "kmeans"], default="random")
    g.add_argument("--group-size", type=int, default=4, help="random: samples per group (R-G)")
    g.add_argument("--depth", type=int, default=8, help="kmeans: hierarchical 2-means depth (2^depth groups)")
    g.add_argument("--merge", choices=["set", "list"], default="set",
                   help="group labels as a set, or as a list with a count per label (top-count assignment)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", required=True, help="output folder: samples, groups, group_labels, truth, info.json")
    _common(g)
    st = sub.add_parser("stage", help="run one pipeline stage (or all) for a run key over Delta tables under "
                                      "paths.root (what jobs/<stage>.py and the Airflow DAG run)")
    st.add_argument("name", choices=[*ORDER, "all"],
                    help="; ".join(f"{s.name}: {s.help}" for s in STAGES.values()) + "; all: every stage in order")
    st.add_argument("--run-key", required=True, help="the run's key, e.g. the logical date 2026-11-25")
    st.add_argument("--train", help="ingest: XC text, svmlight, Parquet, Delta or aggregated folder")
    st.add_argument("--test", help="ingest: test set (optional; predict/evaluate need it)")
    st.add_argument("--root", help="tables and models root (default: paths.root of the config)")
    _common(st)
    p = sub.add_parser("predict", help="score DATA with a saved model")
    p.add_argument("--model", required=True, help="model folder (OUT/model of a run)")
    p.add_argument("--data", required=True, help="XC text, svmlight, Parquet or Delta path")
    p.add_argument("--out", required=True, help="output folder (predictions table, metrics.json)")
    _common(p)
    s = sub.add_parser("synth", help="generate a synthetic XMC data set (Delta tables or XC text)")
    s.add_argument("--out", required=True)
    s.add_argument("--n-train", type=int, default=20000)
    s.add_argument("--n-test", type=int, default=5000)
    s.add_argument("--labels", type=int, default=2000)
    s.add_argument("--features", type=int, default=5000)
    s.add_argument("--format", choices=["delta", "xc"], default="delta")
    s.add_argument("--groups", type=int, default=0, help="also write random groups of this size (aggregated labels)")
    s.add_argument("--seed", type=int, default=0)
    _common(s)
    pr = sub.add_parser("params", help="print the default (or resolved) config as YAML")
    _common(pr)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_arguments(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("py4j", "mlflow", "alembic", "urllib3", "numba"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from .secrets import install_log_filter
    install_log_filter()
    try:
        params = load_params(args.config, args.set)
    except ConfigError as e:
        print(f"xmc-spark: config error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "params":
        print(dump_params(params), end="")
        return 0
    if args.cmd == "sweep" and args.key.split(".")[0] in ("ingest", "eagle", "spark", "mlflow"):
        print(f"xmc-spark: config error: sweep runs ingest (and EAGLE) once, so it cannot sweep '{args.key}': "
              "use one `xmc-spark run` per value", file=sys.stderr)
        return 2
    from . import __version__
    from .session import get_spark
    from .tracking import prepare, settle
    log.info("xmc-spark %s (%s): %s", __version__, __file__.rsplit("/", 2)[0], args.cmd)
    try:
        if args.cmd == "predict":            # a broken model folder stops before Spark starts
            from .model import XMCModel, is_chunked, read_header
            from .prime_model import PrimeHead, with_head
            from .stages.knn import check_prime, load_info
            knn_info = load_info(args.model)     # the kNN re-ranker's knn/knn.json, when there is one
            head = PrimeHead.load(args.model)    # prime/, when there is one (checked)
            if knn_info is not None:             # chosen on the folder's prime/ (stacked), or without one
                check_prime(knn_info, head, args.model)
            if is_chunked(args.model):
                read_header(args.model)      # checked now; the weights are read whole or by the tasks later
                model = args.model
            else:
                model = with_head(XMCModel.load(args.model), head)   # the tree model, with PRIME when it has prime/
        from pyspark.sql import SparkSession
        owner = SparkSession.getActiveSession() is None     # stop only a session this call started
        if args.cmd in ("run", "sweep", "stage"):
            # the pipeline's imports and MLflow's store, while the JVM starts (~10 s together)
            prepare(params.mlflow, imports=("xmc_spark.pipeline",))     # (it imports the runner)
        spark = get_spark(params.spark)
    except XmcError as e:
        settle()             # Spark did not start: let a store being created finish first
        print(f"xmc-spark: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        settle()
        raise
    try:
        if args.cmd == "run":
            from . import pipeline
            metrics = pipeline.run(spark, args.train, args.test, args.out, params, config_path=args.config)
            print(json.dumps({k: v for k, v in metrics.items() if k != "table_versions"}, indent=2))
        elif args.cmd == "sweep":
            from . import pipeline
            values = [v.strip() for v in args.values.split(",") if v.strip()]
            if not values:
                raise ConfigError("--values is empty")
            for v in values:                   # check every value before the first model trains
                params.set_dotted(args.key, v)
            res = pipeline.sweep(spark, args.train, args.test, args.out, params, args.key, values,
                                 config_path=args.config)
            keep = ("value", "p@1", "p@3", "p@5", "depth@1", "depth@3", "depth@5", "tree_depth", "n_leaves")
            print(json.dumps([{k: r[k] for k in keep if k in r} for r in res["results"]], indent=2))
        elif args.cmd == "make-groups":
            from .stages import aggregated
            print(json.dumps(aggregated.make_groups(spark, args.train, args.out, args.strategy, args.group_size,
                                                    args.depth, args.seed, args.merge, params.ingest), indent=2))
        elif args.cmd == "stage":
            from .runner import run_keyed
            res = run_keyed(spark, [args.name], args.run_key, params, args.train, args.test, args.root, args.config)
            print(json.dumps(res if args.name == "all" else res[args.name], indent=2, default=str))
        elif args.cmd == "predict":
            from . import pipeline
            print(json.dumps(pipeline.predict(spark, model, args.data, args.out, params, knn_info), indent=2))
        elif args.cmd == "synth":
            from . import synth
            info = synth.run(spark, args.out, n_train=args.n_train, n_test=args.n_test, n_labels=args.labels,
                             n_features=args.features, fmt=args.format, group_size=args.groups, seed=args.seed)
            print(json.dumps(info, indent=2))
    except XmcError as e:
        print(f"xmc-spark: error: {e}", file=sys.stderr)
        return 2
    finally:
        if owner:
            spark.stop()
        settle()
    return 0


if __name__ == "__main__":
    sys.exit(main())
