"""EAGLE results table: P@1/3/5 of oracle, baseline, eagle0, eagle, soft, joint, joint_est and refined on aggregated
versions of XC data sets (R-4, R-10 random groups; C = hierarchical k-means groups), seed 0.

Run on demand (one Spark session, MLflow off):

    python benchmarks/eagle_table.py --data ../shared/data/bibtex --depth 8
    python benchmarks/eagle_table.py --data ../shared/data/delicious --depth 9

``joint_est`` is joint with ``eagle.estimate_counts`` (each (group, label) sums to its expected
carriers, from the label's prevalence over the groups, not to 1).

For ``soft``, ``joint`` and ``joint_est`` (each on its own) the temperature tau is chosen on a validation
split of the TRAINING GROUPS (one group in five held out, by a seeded hash): a model is trained
on the other groups for each candidate tau and scored at group level on the held-out groups,
by ``--val-metric``:

- ``precision`` (the default): a group's score for a label is the best score over its members;
  mean of P@1, P@3, P@5 of that ranking against the group's labels. It saturates when groups
  carry many labels (delicious: ~66 at R-4, where every candidate scored ~83-90; 69-99 over
  the delicious settings).
- ``coverage`` (tried 2026-11-28, see README): each member's top k labels (k = 1, 3, 5); the
  share of the group's labels found in the union of its members' top k, out of
  min(|group labels|, members x k); mean over k and over the groups with labels. A model that predicts the same
  popular labels for every member covers little; one that predicts each member's own labels
  covers more, which is what a good assignment should teach. For joint it rewards sharper
  assignments: it chose the grid's largest tau in 5 of 6 settings, several of them worse on test.

Both are computed and recorded for every tau candidate (refined records the chosen one). The
pick (``--select``): ``best``, the highest mean (ties to the smaller tau); or ``keep-default``,
the column's default tau (``eagle.tau`` 30 for soft, ``eagle.joint_tau`` 100 for the joint
columns) unless a candidate's per-group precision beats it by a paired z > 1.96 over the
held-out groups (recorded as ``paired_z_<column>``). The test set is never used for the choice.
``refined`` is soft with that tau plus ``eagle.refine_rounds`` of model-guided re-assignment
(``refined_joint``: the same on joint with its tau);
the rounds (1..--refine-rounds) and ``eagle.refine_mix`` are chosen on the same held-out groups
(see :func:`refined`). Prints a markdown table and writes OUT/eagle_<set>.json (after every
setting).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xmc_spark import pipeline  # noqa: E402
from xmc_spark.params import PipelineParams  # noqa: E402
from xmc_spark.session import get_spark  # noqa: E402
from xmc_spark.stages import aggregated  # noqa: E402

REUSE = False
# the columns whose temperature is chosen on the held-out groups: (eagle.mode, its tau key, other settings)
VALIDATED = {"soft": ("soft", "tau", {}), "joint": ("joint", "joint_tau", {}),
             "joint_est": ("joint", "joint_tau", {"eagle__estimate_counts": True})}


def run(spark, train, test, out, base: PipelineParams, reuse: bool = True, **overrides):
    if reuse and REUSE and (Path(out) / "metrics.json").is_file():        # --reuse: keep an earlier run's result
        import yaml
        m = json.loads((Path(out) / "metrics.json").read_text())
        conf = yaml.safe_load((Path(out) / "config.yaml").read_text())

        def get(key):
            node = conf
            for part in key.split("__"):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            return node
        if all(str(get(k)) == str(v) or (isinstance(v, float) and get(k) == v) for k, v in overrides.items()):
            return m
    p = base
    for k, v in overrides.items():
        p = p.set_dotted(k.replace("__", "."), v)
    t = time.perf_counter()
    m = pipeline.run(spark, str(train), str(test) if test else None, str(out), p)
    m["wall"] = time.perf_counter() - t
    return m


def validation_split(spark, agg_dir: Path, out: Path, seed: int = 0):
    """OUT/{samples,groups,group_labels,info.json} with 4/5 of the groups; returns the held-out
    groups as {group: (member sample ids, label set)}."""
    from pyspark.sql import functions as F

    from xmc_spark.storage import write_delta
    r = lambda n: spark.read.format("delta").load(str(agg_dir / n))  # noqa: E731
    groups, labels, samples = r("groups"), r("group_labels"), r("samples")
    held = F.pmod(F.xxhash64("group_id", F.lit(seed + 7)), F.lit(5)) == 0
    tg = groups.filter(~held)
    write_delta(tg, str(out / "groups"))
    write_delta(labels.join(tg.select("group_id").distinct(), "group_id"), str(out / "group_labels"))
    write_delta(samples.join(tg.select("sample_id").distinct(), "sample_id"), str(out / "samples"))
    shutil.copy(agg_dir / "info.json", out / "info.json")
    hg = groups.filter(held).toPandas()
    hl = labels.join(groups.filter(held).select("group_id").distinct(), "group_id").toPandas()
    val = {}
    for g, mem in hg.groupby("group_id")["sample_id"]:
        val[int(g)] = (mem.to_numpy(), set(hl.loc[hl["group_id"] == g, "label_idx"].astype(int)))
    X = samples.filter(F.col("sample_id").isin([int(s) for m, _ in val.values() for s in m])).toPandas()
    return val, X


def saved_model_metrics(model_dir: Path, val, Xdf, n_features: int) -> dict:
    """:func:`group_score` of a saved model."""
    from xmc_spark.model import XMCModel
    return group_score(XMCModel.load(str(model_dir)), val, Xdf, n_features)


def group_score(model, val, Xdf, n_features: int) -> dict:
    """Both validation metrics of a model on the held-out groups (see the module's docstring):
    {"precision": ..., "coverage": ...}, in percent."""
    import scipy.sparse as sp
    Xdf = Xdf.sort_values("sample_id")
    ids = Xdf["sample_id"].to_numpy()
    ind = [np.asarray(a, np.int32) for a in Xdf["feature_idx"]]
    dat = [np.asarray(a, np.float32) for a in Xdf["feature_val"]]
    ptr = np.concatenate([[0], np.cumsum([len(a) for a in ind])])
    X = sp.csr_matrix((np.concatenate(dat), np.concatenate(ind), ptr), shape=(len(ids), n_features))
    lab, sc = model.predict(X, topk=5)           # each row's labels by descending score
    return group_metrics(lab, sc, ids, val)


def group_metrics(lab, sc, ids, val) -> dict:
    """Both metrics of predictions (``lab``, ``sc``: rows x k, by descending score, -1 = none;
    row i is sample ``ids[i]``) on the held-out groups ``val`` = {group: (members, label set)},
    and ``per_group``: each group's precision (in ``val``'s order, for the paired rule of
    :func:`choose`)."""
    pos = {int(s): i for i, s in enumerate(ids)}
    precision = coverage = 0.0
    n_cov = 0
    per_group = []
    for mem, labels in val.values():
        rows = [pos[int(s)] for s in mem]
        best = {}
        for i in rows:
            for k, v in zip(lab[i], sc[i]):
                if k >= 0 and v > best.get(int(k), -np.inf):
                    best[int(k)] = v
        ranked = [k for k, _ in sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))]
        per_group.append(100.0 * np.mean([sum(k in labels for k in ranked[:c]) / c for c in (1, 3, 5)]))
        precision += per_group[-1] / 100.0
        if labels:                                  # coverage: out of the groups with labels
            n_cov += 1
            coverage += np.mean([len({int(k) for i in rows for k in lab[i][:c] if k >= 0} & labels)
                                 / min(len(labels), len(rows) * c) for c in (1, 3, 5)])
    return {"precision": 100.0 * precision / max(len(val), 1), "coverage": 100.0 * coverage / max(n_cov, 1),
            "per_group": per_group}


def choose(both: dict, metric: str, select: str, default: float):
    """The tau picked from ``both`` = {tau: group_metrics}. ``best``: the highest mean ``metric``
    (ties to the smaller tau). ``keep-default``: ``default`` unless some candidate's per-group
    precision beats it by more than 1.96 standard errors of the paired differences over the
    held-out groups; then the best of those by mean (a candidate whose differences have no
    spread, or a single group, gets z 0). Returns (tau, {tau: paired z against the default} or
    None)."""
    if select == "best":
        return max(both, key=lambda t: (both[t][metric], -t)), None
    base = np.asarray(both[default]["per_group"])
    z = {}
    for t, m in both.items():
        d = np.asarray(m["per_group"]) - base
        se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else 0.0
        # no spread (or one group): no evidence either way, so never "significantly better"
        z[t] = float(d.mean() / se) if se > 0 else 0.0
    better = [t for t in both if z[t] > 1.96]
    return (max(better, key=lambda t: (both[t]["precision"], -t)) if better else default), z


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--depth", type=int, required=True, help="k-means grouping depth (C setting)")
    ap.add_argument("--settings", default="R-4,R-10,C")
    ap.add_argument("--taus", default="10,30,100,300")
    ap.add_argument("--modes", default="baseline,eagle0,eagle,soft,joint,refined",
                    help="columns to run, of baseline, eagle0, eagle, soft, joint, joint_est, refined, refined_joint "
                         "(baseline is always run: the gap needs it; soft too when refined is asked for, joint when "
                         "refined_joint is)")
    ap.add_argument("--refine-rounds", type=int, default=2, help="refined: the most rounds validated")
    ap.add_argument("--refine-mixes", default="0,0.5", help="refined: mixing weights validated")
    ap.add_argument("--refine-taus", default="10", help="refined: softmax temperatures validated")
    ap.add_argument("--refine-weights", default="softmax,ratio", help="refined: weightings validated")
    ap.add_argument("--refine-min-weights", default="0.02",
                    help="refined: eagle.refine_min_weight values validated (pairs below are dropped; the "
                         "default is eagle's, chosen from 0,0.01,0.02,0.05,0.1 on 2026-12-01)")
    ap.add_argument("--refine-eps", default="0",
                    help="refined: eagle.refine_eps values validated (the round models' node-solver tolerance; "
                         "0 = train.eps, the default; picked per set by the best score, ties to the looser; "
                         "the 2026-12-01 default was chosen by hand over both sets' means, README)")
    ap.add_argument("--val-metric", choices=("precision", "coverage"), default="precision",
                    help="the held-out groups' metric that chooses tau (and refined's rounds, weights, mix)")
    ap.add_argument("--select", choices=("best", "keep-default"), default="best",
                    help="how the held-out groups choose tau: the best mean (default), or the column's default "
                         "tau (soft 30, joint 100) unless a candidate's per-group precision beats it by paired "
                         "z > 1.96 (precision metric only)")
    ap.add_argument("--reuse", action="store_true", help="keep results of earlier runs found in --work")
    ap.add_argument("--work", default="/tmp/xmc-eagle-bench")
    ap.add_argument("--leaf", type=int, default=100)
    args = ap.parse_args()
    global REUSE
    REUSE = args.reuse
    logging.basicConfig(level=logging.WARNING)
    data = Path(args.data)
    work = Path(args.work) / data.name
    work.mkdir(parents=True, exist_ok=True)
    base = PipelineParams().set_dotted("mlflow.enabled", False).set_dotted("tree.max_leaf_size", args.leaf)
    taus = [float(t) for t in args.taus.split(",")]
    asked = set(args.modes.split(","))
    unknown = asked - {"baseline", "eagle0", "eagle", "refined", "refined_joint", *VALIDATED}
    if unknown:
        ap.error(f"--modes: unknown column(s) {', '.join(sorted(unknown))}")
    modes = asked | {"baseline"} | ({"soft"} if "refined" in asked else set()) | (
        {"joint"} if "refined_joint" in asked else set())
    if args.select == "keep-default":
        if args.val_metric != "precision":
            ap.error("--select keep-default compares per-group precision: use --val-metric precision")
        for m in modes & set(VALIDATED):
            d = float(getattr(base.eagle, VALIDATED[m][1]))
            if d not in taus:
                ap.error(f"--select keep-default: {m}'s default {VALIDATED[m][1]} {d:g} is not among --taus")
    spark = get_spark(base.spark)
    train, test = data / "train.txt", data / "test.txt"
    results = {"oracle": run(spark, train, test, work / "oracle", base)}
    print(f"oracle: {results['oracle']['p@1']:.2f}", flush=True)
    for setting in args.settings.split(","):
        d = work / setting
        if setting.startswith("R-"):
            meta = aggregated.make_groups(spark, str(train), str(d / "data"), "random", int(setting[2:]), 0, 0, "set",
                                          base.ingest)
        else:
            meta = aggregated.make_groups(spark, str(train), str(d / "data"), "kmeans", 0, args.depth, 0, "set",
                                          base.ingest)
        res = {"groups": meta}
        for mode in [m for m in ["baseline", "eagle0", "eagle"] if m in modes]:
            res[mode] = run(spark, d / "data", test, d / mode, base, eagle__mode=mode)
            print(f"{setting} {mode}: {res[mode]['p@1']:.2f}", flush=True)
        # tau on a validation split of the training groups, for soft, joint and joint_est
        if modes & (set(VALIDATED) | {"refined", "refined_joint"}):
            val, Xv = validation_split(spark, d / "data", d / "val_data")
        for mode in [m for m in VALIDATED if m in modes]:
            eagle_mode, key, extra = VALIDATED[mode]
            both = {}
            for t in taus:
                vdir = d / (f"val_tau{t:g}" if mode == "soft" else f"val_{mode}_tau{t:g}")
                run(spark, d / "val_data", None, vdir, base, eagle__mode=eagle_mode, **extra, **{f"eagle__{key}": t})
                both[t] = saved_model_metrics(vdir / "model", val, Xv, meta["n_features"])
                print(f"{setting} {mode} tau={t:g}: validation group precision {both[t]['precision']:.2f}, "
                      f"coverage {both[t]['coverage']:.2f}", flush=True)
            scores = {t: v[args.val_metric] for t, v in both.items()}
            default = float(getattr(base.eagle, key))
            best_tau, z = choose(both, args.val_metric, args.select, default)
            if z is not None:
                res[f"paired_z_{mode}"] = {str(k): v for k, v in z.items()}
                print(f"{setting} {mode}: paired z against {key} {default:g}: "
                      + ", ".join(f"{k:g}: {v:+.2f}" for k, v in z.items()), flush=True)
            res[mode] = run(spark, d / "data", test, d / mode, base, eagle__mode=eagle_mode, **extra,
                            **{f"eagle__{key}": best_tau})
            res[mode]["tau"] = best_tau
            res[mode]["val_metric"] = args.val_metric
            res[mode]["select"] = args.select
            suffix = "" if mode == "soft" else f"_{mode}"
            res["validation" + suffix] = {str(k): v for k, v in scores.items()}
            for metric in ("precision", "coverage"):
                res[f"validation_{metric}{suffix}"] = {str(k): v[metric] for k, v in both.items()}
            print(f"{setting} {mode} (tau={best_tau:g}): {res[mode]['p@1']:.2f}", flush=True)
        if "refined" in modes:
            res["refined"] = refined(spark, d, test, base, res["soft"]["tau"], val, Xv, meta["n_features"], args,
                                     setting)
        if "refined_joint" in modes:
            res["refined_joint"] = refined(spark, d, test, base, res["joint"]["tau"], val, Xv, meta["n_features"],
                                           args, setting, mode="joint")
        results[setting] = res
        (Path(args.work) / f"eagle_{data.name}.json").write_text(json.dumps(results, indent=2, default=str))
    (Path(args.work) / f"eagle_{data.name}.json").write_text(json.dumps(results, indent=2, default=str))

    o = results["oracle"]
    print(f"\n{data.name} (oracle {o['p@1']:.2f} / {o['p@3']:.2f} / {o['p@5']:.2f}), P@1 / P@3 / P@5:\n")
    print("| setting | groups | baseline | eagle0 | eagle | soft (tau) | joint (tau) | joint_est (tau) | "
          "refined (rounds, weights, mix, tau) | best vs baseline | gap closed | eagle s / train s (best) | "
          "pair precision / recall / weighted (best) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for setting in args.settings.split(","):
        r = results[setting]

        def f(m, r=r):
            return f"{r[m]['p@1']:.2f} / {r[m]['p@3']:.2f} / {r[m]['p@5']:.2f}" if m in r else "-"
        best = max([m for m in ("eagle0", "eagle", "soft", "joint", "joint_est", "refined", "refined_joint")
                    if m in r],
                   key=lambda m: r[m]["p@1"], default="baseline")
        b = r["baseline"]["p@1"]
        gap = o["p@1"] - b
        closed = 100 * (r[best]["p@1"] - b) / gap if gap > 0 else float("nan")
        e = r[best]
        rr = r.get("refined", {})
        ref = (f"{f('refined')} ({rr['rounds']}, {rr['weights']}, {rr['mix']:g}, {rr['refine_tau']:g})"
               if rr else "-")
        print(f"| {setting} | {r['groups']['n_groups']} | {f('baseline')} | {f('eagle0')} | {f('eagle')} | "
              f"{f('soft')} ({r.get('soft', {}).get('tau', '-')}) | "
              f"{f('joint')} ({r.get('joint', {}).get('tau', '-')}) | "
              f"{f('joint_est')} ({r.get('joint_est', {}).get('tau', '-')}) | "
              f"{ref} | {best} {r[best]['p@1'] - b:+.2f} | {closed:.0f}% | "
              f"{e['seconds'].get('eagle', 0):.1f} / {e['seconds']['train']:.1f} | "
              f"{e.get('eagle.pair_precision', 0):.1f} / {e.get('eagle.pair_recall', 0):.1f} / "
              f"{e.get('eagle.pair_weighted_precision', 0):.1f} |")
    for setting in args.settings.split(","):
        rj = results[setting].get("refined_joint")
        if rj:
            print(f"refined_joint at {setting}: {rj['p@1']:.2f} / {rj['p@3']:.2f} / {rj['p@5']:.2f} "
                  f"(rounds {rj['rounds']}, {rj['weights']}, mix {rj['mix']:g}, refine_tau {rj['refine_tau']:g}, "
                  f"refine_min_weight {rj.get('refine_min_weight', 0):g}, refine_eps {rj.get('refine_eps', 0):g}; "
                  f"joint_tau {results[setting]['joint']['tau']:g})")


def refined(spark, d: Path, test, base: PipelineParams, tau: float, val, Xv, n_features: int, args, setting,
            mode: str = "soft"):
    """The refined column: ``mode`` (soft, or joint for ``refined_joint``; tau as chosen for it)
    + model-guided re-assignment. Rounds (1..R), the weighting, the mixing weight, ``refine_tau``
    and ``refine_min_weight`` (the grids of --refine-*) are chosen on the held-out training
    groups: one validation run per grid point with R rounds, the model of every round scored
    there (the stage's hook gives the models trained inside it; the run's own model is round
    R's). The test set is not used."""
    from xmc_spark.stages import eagle as eagle_stage
    R = args.refine_rounds
    scores, drifts = {}, {}
    metric = args.val_metric
    # round scores of earlier runs, for --reuse (precision: the file's name before coverage existed)
    prefix = "" if mode == "soft" else f"{mode}_"
    key = "tau" if mode == "soft" else "joint_tau"
    cache_file = d / (f"refine_{prefix}validation.json" if metric == "precision"
                      else f"refine_{prefix}validation_{metric}.json")
    cache = json.loads(cache_file.read_text()) if REUSE and cache_file.is_file() else {}
    grid = [(rt, wts, mix, mw, ep) for rt in [float(t) for t in args.refine_taus.split(",")]
            for wts in args.refine_weights.split(",") for mix in [float(m) for m in args.refine_mixes.split(",")]
            for mw in [float(w) for w in args.refine_min_weights.split(",")]
            for ep in [float(e) for e in args.refine_eps.split(",")]]
    for rt, wts, mix, mw, ep in grid:
        name = (f"{wts}_mix{mix:g}" + ("" if rt == 10 else f"_rt{rt:g}") + ("" if mw == 0 else f"_mw{mw:g}")
                + ("" if ep == 0 else f"_eps{ep:g}"))
        got = {}
        eagle_stage.ROUND_MODEL_HOOK = lambda r, model, got=got: got.update(
            {r: group_score(model, val, Xv, n_features)[metric]})
        try:
            out = d / f"val_refine_{prefix}{name}"
            # a reused run fires no hook: reuse it only when its rounds' scores are cached
            m = run(spark, d / "val_data", None, out, base, reuse=name in cache, eagle__mode=mode,
                    **{f"eagle__{key}": tau}, eagle__refine_rounds=R, eagle__refine_mix=mix,
                    eagle__refine_tau=rt, eagle__refine_weights=wts, eagle__refine_min_weight=mw,
                    eagle__refine_eps=ep)
        finally:
            eagle_stage.ROUND_MODEL_HOOK = None
        if not got and name in cache:         # a reused run: its rounds' scores as recorded
            got = {int(r): v for r, v in cache[name].items()}
        got[R] = saved_model_metrics(out / "model", val, Xv, n_features)[metric]
        cache[name] = got
        cache_file.write_text(json.dumps(cache, indent=1))
        scores.update({(r, wts, mix, rt, mw, ep): v for r, v in got.items()})
        drifts[name] = {k: m.get(k) for k in ("eagle.refine.drift_tv", "eagle.refine.change_tv",
                                              "eagle.refine.seconds")}
        print(f"{setting} refined{'_' + mode if prefix else ''} {name}: validation group {metric} by round "
              f"{[round(float(got[r]), 2) for r in sorted(got)]}; drift TV {m.get('eagle.refine.drift_tv')}",
              flush=True)
    # the best validation score over rounds >= 1; ties: fewer rounds, more weight on GRLR, the
    # smaller min weight (fewer pairs dropped), then the looser round-model tolerance (cheaper)
    best = max((k for k in scores if k[0] >= 1), key=lambda k: (scores[k], -k[0], k[2], -k[4], k[5]))
    rounds, wts, mix, rt, mw, ep = best
    res = run(spark, d / "data", test, d / f"refined{'_' + mode if prefix else ''}", base, eagle__mode=mode,
              **{f"eagle__{key}": tau}, eagle__refine_rounds=rounds, eagle__refine_mix=mix, eagle__refine_tau=rt,
              eagle__refine_weights=wts, eagle__refine_min_weight=mw, eagle__refine_eps=ep)
    res.update({"rounds": rounds, "mix": mix, "weights": wts, "refine_tau": rt, "refine_min_weight": mw,
                # round 0's model is the round model, trained at refine_eps: a no-round run's when ep = 0
                "refine_eps": ep, "val_metric": metric, "validation_round0": scores[(0, *best[1:])],
                "validation": {f"r{r}_{w}_mix{x:g}_rt{t:g}" + ("" if v_mw == 0 else f"_mw{v_mw:g}")
                               + ("" if v_ep == 0 else f"_eps{v_ep:g}"): v
                               for (r, w, x, t, v_mw, v_ep), v in sorted(scores.items())},
                "validation_drift": drifts})
    print(f"{setting} refined{'_' + mode if prefix else ''} (rounds={rounds}, {wts}, mix={mix:g}, "
          f"refine_tau={rt:g}, refine_min_weight={mw:g}, refine_eps={ep:g}): {res['p@1']:.2f} "
          f"(validation {scores[best]:.2f}, its round model {scores[(0, *best[1:])]:.2f})", flush=True)
    return res


if __name__ == "__main__":
    main()
