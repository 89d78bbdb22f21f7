"""EAGLE on Spark agrees with the numpy kernels; aggregated input is validated."""
import dataclasses
import json

import numpy as np
import pytest
import scipy.sparse as sp

from tests.conftest import random_problem, write_xc
from xmc_spark.kernels.eagle import Triples, assign, grlr_block, label_prevalence
from xmc_spark.local_io import read_xc
from xmc_spark.params import EagleParams, IngestParams
from xmc_spark.schemas import IngestError
from xmc_spark.stages import aggregated, eagle


@pytest.fixture(scope="module")
def agg_dir(tmp_path_factory):
    """Random groups of 3 over a small labelled set, written as samples.txt + groups.txt.

    Label 0 is put on every group (a head label), label 1 on most."""
    d = tmp_path_factory.mktemp("agg")
    X, Y = random_problem(n=90, d=30, L=10, seed=3)
    write_xc(d / "samples.txt", X, sp.csr_matrix((90, 10)))
    rng = np.random.default_rng(0)
    perm = rng.permutation(90)
    groups = [sorted(perm[i:i + 3].tolist()) for i in range(0, 90, 3)]
    Yd = Y.toarray() > 0
    lines = []
    glabels = []
    for j, mem in enumerate(groups):
        labs = set(np.flatnonzero(Yd[mem].any(axis=0)).tolist()) | {0}
        if j % 5:
            labs.add(1)
        glabels.append(sorted(labs))
        lines.append(",".join(map(str, sorted(labs))) + " " + " ".join(map(str, mem)))
    (d / "groups.txt").write_text("\n".join(lines) + "\n")
    return d, groups, glabels


def _reference(d, groups, glabels, T, mode="eagle", tau=30.0, n_labels=10, counts=False, prevalence=None):
    """The kernels on the whole set; ``glabels`` entries are label lists, or {label: count}
    dicts whose counts are used with ``counts``; ``prevalence``: joint with estimated carriers."""
    Xl, _ = read_xc(str(d / "samples.txt"))
    lab, grp, row, cnt = [], [], [], []
    for j, (mem, labs) in enumerate(zip(groups, glabels)):
        for k in labs:
            for i in mem:
                lab.append(k), grp.append(j), row.append(i), cnt.append(labs[k] if counts else 1)
    tr = Triples(lab, grp, row, row, n_labels, count=cnt if counts else None)
    E, obj = grlr_block(tr, Xl, T=T)
    sid, lb, w = assign(tr, Xl, E, soft=mode == "soft", tau=tau, joint=mode == "joint", prevalence=prevalence)
    return E, obj, sid, lb, w


@pytest.mark.parametrize("mode,head_groups", [pytest.param("eagle", 1000, marks=pytest.mark.connect), ("soft", 12),
                                              ("joint", 12)])
def test_spark_grlr_and_assignment_equal_kernel(spark, agg_dir, head_groups, mode):
    d, groups, glabels = agg_dir
    agg = aggregated.read(spark, str(d), IngestParams())
    assert agg.stats["n_groups"] == 30 and agg.stats["n_samples_without_group"] == 0
    params = EagleParams(mode=mode, T=6, head_groups=head_groups, min_weight=0.0, joint_tau=30.0)
    train, info, emb, assigned = eagle.run(agg, params, n_buckets=3)
    T = 0 if mode == "eagle0" else 6
    E, obj, sid, lb, w = _reference(d, groups, glabels, T, mode)
    if head_groups == 12:
        assert info["eagle.head_labels"] >= 2          # labels 0 and 1 go the split path
    got = {int(r["label_idx"]): (np.asarray(r["emb_idx"]), np.asarray(r["emb_val"])) for r in emb.collect()}
    for k in range(10):
        ref = E[k].toarray().ravel()
        row = np.zeros(30)
        if k in got:
            row[got[k][0]] = got[k][1]
        np.testing.assert_allclose(row, ref, atol=1e-6)
    np.testing.assert_allclose(info["eagle.objective"], obj.sum(axis=1), atol=1e-5)
    rows = train.collect()
    pairs = {(r["sample_id"], int(k)): float(x) for r in rows for k, x in zip(r["label_idx"], r["label_weight"])}
    ref_pairs = {(int(s), int(k)): float(x) for s, k, x in zip(sid, lb, w)}
    assert set(pairs) == set(ref_pairs)
    for key, x in ref_pairs.items():
        assert pairs[key] == pytest.approx(x, abs=1e-5)
    assert len(rows) == 90
    # one assigned row per (sample, label), head labels' chunks merged: its rows per label are the
    # training table's (what a re-assignment round gives its model's trainer)
    from xmc_spark.stages.evaluation import label_counts, rows_per_label
    assert np.array_equal(rows_per_label(assigned, 10), label_counts(train, 10))


def test_joint_with_estimated_counts_equals_kernel(spark, agg_dir):
    """eagle.estimate_counts: the stage estimates each label's prevalence from the groups
    (label_prevalence of its labelled groups, 30 groups of 3 here) and its joint weights equal
    the kernel's with those carriers; they differ from the one-carrier weights."""
    d, groups, glabels = agg_dir
    agg = aggregated.read(spark, str(d), IngestParams())
    params = EagleParams(mode="joint", T=6, head_groups=12, min_weight=0.0, joint_tau=30.0, estimate_counts=True)
    train, info, _, _ = eagle.run(agg, params, n_buckets=3)
    carried = np.bincount([k for labs in glabels for k in labs], minlength=10)
    prevalence = label_prevalence(carried, len(groups), 3.0)
    assert info["eagle.estimated_prevalence_max"] == pytest.approx(prevalence.max(), abs=1e-6)
    assert prevalence[0] > 0.5                          # label 0 is on every group
    sid, lb, w = _reference(d, groups, glabels, 6, "joint", prevalence=prevalence)[2:]
    ref = {(int(s), int(k)): float(x) for s, k, x in zip(sid, lb, w)}
    one = {(int(s), int(k)): float(x) for s, k, x in zip(*_reference(d, groups, glabels, 6, "joint")[2:])}
    assert sum(ref.values()) > sum(one.values()) + 5                   # more than one carrier per label
    got = _pairs(train)
    assert got.keys() == ref.keys()
    for key, x in ref.items():
        assert got[key] == pytest.approx(x, abs=1e-5)


def _groups_of_4_and_3(d, seed, rng_seed, n_extra, density=0.2):
    """60 random samples (8 labels) written to ``d/samples.txt`` without labels; groups of 4 over
    all of them plus ``n_extra`` groups of 3 that reuse samples. Returns (groups, Y as bool)."""
    X, Y = random_problem(n=60, d=25, L=8, seed=seed, density=density)
    write_xc(d / "samples.txt", X, sp.csr_matrix((60, 8)))
    rng = np.random.default_rng(rng_seed)
    perm = rng.permutation(60)
    groups = [sorted(perm[i:i + 4].tolist()) for i in range(0, 60, 4)]
    groups += [sorted(rng.choice(60, 3, replace=False).tolist()) for _ in range(n_extra)]
    return groups, Y.toarray() > 0


@pytest.fixture(scope="module")
def agg_mixed_dir(tmp_path_factory):
    """Groups of 4 and 3 (some members in two groups), even labels with counts (``k:c``), odd
    labels without, and one group with no labels (a line starting with a space)."""
    d = tmp_path_factory.mktemp("aggm")
    groups, Yd = _groups_of_4_and_3(d, seed=7, rng_seed=2, n_extra=6, density=0.3)
    lines, glabels = [], []
    for j, mem in enumerate(groups):
        labs = {} if j == 3 else {int(k): (int(Yd[mem, k].sum()) if k % 2 == 0 else None)
                                  for k in np.flatnonzero(Yd[mem].any(axis=0))}
        glabels.append(labs)
        items = ",".join(f"{k}:{c}" if c is not None else str(k) for k, c in sorted(labs.items()))
        lines.append(items + " " + " ".join(map(str, mem)))
    (d / "groups.txt").write_text("\n".join(lines) + "\n")
    return d, groups, glabels


def test_joint_with_estimated_and_given_counts_equals_kernel(spark, agg_mixed_dir):
    """Given counts are kept and only the uncounted (group, label)s are estimated, whichever
    task a label's triples land in (2 or 5 buckets, a head label split across tasks); the
    prevalence counts labelled groups only, and their mean size in membership rows (shared
    members count in each group); a re-assignment round with mix 1 keeps the weights (its
    carriers are the first assignment's)."""
    d, groups, glabels = agg_mixed_dir
    agg = aggregated.read(spark, str(d), IngestParams())
    assert agg.stats["n_groups_without_labels"] == 1
    labelled = [j for j, labs in enumerate(glabels) if labs]
    carried = np.bincount([k for j in labelled for k in glabels[j]], minlength=8)
    mean_size = sum(len(groups[j]) for j in labelled) / len(labelled)
    assert mean_size != pytest.approx(len({i for j in labelled for i in groups[j]}) / len(labelled))
    prevalence = label_prevalence(carried, len(labelled), mean_size)
    Xl, _ = read_xc(str(d / "samples.txt"))
    lab, grp, row, cnt, given = [], [], [], [], []
    for j in labelled:
        for k, c in glabels[j].items():
            for i in groups[j]:
                lab.append(k), grp.append(j), row.append(i), cnt.append(c or 1), given.append(c is not None)
    tr = Triples(lab, grp, row, row, 8, count=cnt, given=given)
    assert 0 < tr.given.sum() < len(lab)
    E, _ = grlr_block(tr, Xl, T=6)

    def ref_pairs(prev):
        sid, lb, w = assign(tr, Xl, E, tau=30.0, joint=True, prevalence=prev)
        return {(int(s), int(k)): float(x) for s, k, x in zip(sid, lb, w)}
    ref = ref_pairs(prevalence)
    assert max(abs(x - ref_pairs(None).get(key, 0.0)) for key, x in ref.items()) > 0.05
    params = EagleParams(mode="joint", T=6, head_groups=6, min_weight=0.0, joint_tau=30.0, estimate_counts=True)
    for n_buckets in (2, 5):
        train, info, _, _ = eagle.run(agg, params, n_buckets=n_buckets)
        assert info["eagle.head_labels"] >= 1
        assert info["eagle.estimated_prevalence_max"] == pytest.approx(prevalence.max(), abs=1e-6)
        got = _pairs(train)
        assert got.keys() == ref.keys()
        for key, x in ref.items():
            assert got[key] == pytest.approx(x, abs=1e-5)
    rounds = EagleParams(**{**params.to_dict(), "refine_rounds": 1, "refine_mix": 1.0, "refine_min_weight": 0.0})
    got = _pairs(eagle.run(agg, rounds, n_buckets=2, train_model=_tiny_trainer(agg))[0])
    assert got.keys() == ref.keys()
    for key, x in ref.items():
        assert got[key] == pytest.approx(x, abs=1e-5)


@pytest.fixture(scope="module")
def agg_counts_dir(tmp_path_factory):
    """Groups of 4 over 60 samples plus 8 groups of 3 that reuse samples (a sample in two
    groups), labels with counts 1-3; as samples.txt + groups.txt (``label:count``)."""
    d = tmp_path_factory.mktemp("aggc")
    groups, Yd = _groups_of_4_and_3(d, seed=5, rng_seed=1, n_extra=8)
    lines, glabels = [], []
    for mem in groups:
        labs = {int(k): int(min(Yd[mem, k].sum(), 3)) for k in np.flatnonzero(Yd[mem].any(axis=0))}
        labs.setdefault(0, 1)                          # a head label on every group
        glabels.append(labs)
        lines.append(",".join(f"{k}:{c}" for k, c in sorted(labs.items())) + " " + " ".join(map(str, mem)))
    (d / "groups.txt").write_text("\n".join(lines) + "\n")
    return d, groups, glabels


def test_light_pairs_of_shared_members_do_not_depend_on_the_task_split(spark, agg_counts_dir):
    """Members in two groups, weights all below refine_min_weight (only best members stay): one
    task or three give the same pairs and weights. (The case where merging first would differ,
    a sample best in one group and a heavier extra member of another, is built by hand in
    tests/kernels/test_eagle.py::test_refine_bound_keeps_each_best_member_before_pairs_merge.)"""
    d, _, _ = agg_counts_dir
    agg = aggregated.read(spark, str(d), IngestParams())
    params = EagleParams(mode="soft", T=4, tau=30.0, min_weight=0.0, weight_scale=0.1, refine_rounds=1,
                         refine_mix=0.3, refine_min_weight=0.3)
    fit = _tiny_trainer(agg)
    one, three = (_pairs(eagle.run(agg, params, n_buckets=n, train_model=fit)[0]) for n in (1, 3))
    assert one.keys() == three.keys() and len(one) > 0
    for key, x in one.items():
        assert three[key] == pytest.approx(x, abs=1e-6)


@pytest.mark.parametrize("mode", ["joint", "soft"])
def test_counts_and_shared_members_equal_kernel(spark, agg_counts_dir, mode):
    """Joint and soft modes with counts (they change the weights) and members in two groups (a
    (sample, label) pair keeps its largest weight, once, also where the head label's groups are
    split across tasks): the Spark stage's pairs and weights equal the kernel's."""
    d, groups, glabels = agg_counts_dir
    agg = aggregated.read(spark, str(d), IngestParams())
    assert agg.stats["n_groups"] == 23
    params = EagleParams(mode=mode, T=6, head_groups=10, min_weight=0.0, joint_tau=30.0)
    train, info, emb, _ = eagle.run(agg, params, n_buckets=3)
    assert info["eagle.head_labels"] >= 1

    def reference(counts):
        sid, lb, w = _reference(d, groups, glabels, 6, mode, n_labels=8, counts=counts)[2:]
        return {(int(s), int(k)): float(x) for s, k, x in zip(sid, lb, w)}
    ref, uncounted = reference(True), reference(False)
    if mode == "joint":
        assert max(abs(x - uncounted.get(key, 0.0)) for key, x in ref.items()) > 0.1   # the counts matter
    n_triples = sum(len(mem) * len(labs) for mem, labs in zip(groups, glabels))
    assert len(ref) < n_triples                     # shared members: (sample, label) pairs merged
    rows = train.collect()
    assert all(len(set(r["label_idx"])) == len(r["label_idx"]) for r in rows)    # each label once
    assert info["eagle.assigned_pairs"] == len(ref)
    got = {(r["sample_id"], int(k)): float(x) for r in rows for k, x in zip(r["label_idx"], r["label_weight"])}
    assert set(got) == set(ref)
    for key, x in ref.items():
        assert got[key] == pytest.approx(x, abs=1e-5)


def test_baseline_gives_every_member_all_group_labels(spark, agg_dir):
    d, groups, glabels = agg_dir
    agg = aggregated.read(spark, str(d), IngestParams())
    train, info, emb, _ = eagle.run(agg, EagleParams(mode="baseline"), n_buckets=2)
    assert emb is None
    got = {r["sample_id"]: sorted(r["label_idx"]) for r in train.collect()}
    for mem, labs in zip(groups, glabels):
        for i in mem:
            assert got[i] == labs


def test_label_buckets_spread_the_block_labels_longest_first(spark):
    # the block path's labels (carried, not heads) go to the partitions LPT places them in, one
    # bucket a partition; heads and labels without a group get no bucket
    from pyspark.sql import functions as F

    carried = np.array([0, 9, 1, 7, 3, 3, 2, 40, 5, 1, 4, 6, 2, 8])
    heads = np.array([7])
    b = eagle._label_buckets(spark, carried, heads, 4)
    rows = b.repartition(4, "_bucket").withColumn("_part", F.spark_partition_id()).collect()
    assert sorted(r["label_idx"] for r in rows) == [k for k in range(len(carried)) if carried[k] and k != 7]
    load = np.zeros(4)
    for r in rows:
        load[r["_part"]] += carried[r["label_idx"]]
    # LPT by hand: 9 8 7 6 5 4 3 3 2 2 1 1, each to the least loaded bin -> 13 13 13 12, and
    # lpt_ranks numbers the bins by decreasing load (Spark starts the heaviest first)
    assert load.tolist() == [13, 13, 13, 12]
    assert len({r["_bucket"] for r in rows}) == 4


def test_diagnostics_against_truth(spark):
    a = spark.createDataFrame([(0, 1, 1.0), (0, 2, 0.5), (1, 1, 1.0)], "sample_id long, label_idx int, weight double")
    t = spark.createDataFrame([(0, [1]), (1, [3]), (2, [4])], "sample_id long, label_idx array<int>")
    m = eagle.diagnostics(a, t)
    assert m["eagle.pair_precision"] == pytest.approx(100 / 3, abs=1e-3)       # (0,1) of 3 pairs
    assert m["eagle.pair_recall"] == pytest.approx(100 / 3, abs=1e-3)          # of 3 true pairs
    assert m["eagle.pair_weighted_precision"] == pytest.approx(100 * 1 / 2.5, abs=1e-3)


@pytest.mark.parametrize("groups_txt,msg", [
    ("1,2 0 1\n3 \n", "groups.txt:2: empty group"),
    ("1,2 0 x1\n", "groups.txt:1: member id is not a non-negative integer: x1"),
    ("1,a 0 1\n", "groups.txt:1: label is not 'label' or 'label:count'"),
    ("1:0 0 1\n", "groups.txt:1: label count must be >= 1"),
    ("1 0 1\n2 0 77\n", "group_id 1: sample_id 77 is not in the samples"),
    ("1 0 1 1\n", "group_id 0: sample_id 1 listed 2 times"),
    ("1,3,1:2 0 1\n", "group_id 0: label 1 listed 2 times"),
    ("", "no groups"),
])
def test_bad_groups_text(spark, tmp_path, groups_txt, msg):
    X, Y = random_problem(n=6, d=5, L=4, seed=1)
    write_xc(tmp_path / "samples.txt", X, Y)
    (tmp_path / "groups.txt").write_text(groups_txt)
    with pytest.raises(IngestError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        aggregated.read(spark, str(tmp_path), IngestParams())


def test_group_tables_errors_and_counts(spark, tmp_path):
    from xmc_spark.storage import write_delta
    X, Y = random_problem(n=6, d=5, L=4, seed=1)
    write_xc(tmp_path / "s.txt", X, Y)
    from xmc_spark.stages import ingest
    ingest.run(spark, str(tmp_path / "s.txt"), str(tmp_path / "samples"), IngestParams())
    write_delta(spark.createDataFrame([(0, 0), (0, 1), (1, 2), (2, 3)], "group_id long, sample_id long"),
                str(tmp_path / "groups"))
    write_delta(spark.createDataFrame([(0, 1), (9, 2)], "group_id long, label_idx int"), str(tmp_path / "group_labels"))
    with pytest.raises(IngestError, match="group_id 9 has labels but no members"):
        aggregated.read(spark, str(tmp_path), IngestParams())
    write_delta(spark.createDataFrame([(0, 1), (1, -2)], "group_id long, label_idx int"),
                str(tmp_path / "group_labels"))
    with pytest.raises(IngestError, match="group_id 1: negative label -2"):
        aggregated.read(spark, str(tmp_path), IngestParams())
    write_delta(spark.createDataFrame([(0, "a")], "group_id long, label string"), str(tmp_path / "group_labels"))
    with pytest.raises(IngestError, match="group_labels: wrong schema"):
        aggregated.read(spark, str(tmp_path), IngestParams())
    write_delta(spark.createDataFrame([(0, 1), (1, 3)], "group_id long, label_idx int"), str(tmp_path / "group_labels"))
    agg = aggregated.read(spark, str(tmp_path), IngestParams())
    # group 2 has no labels, samples 4 and 5 are in no group: kept and counted
    assert agg.stats == {"n_groups": 3, "n_group_label_pairs": 2, "n_groups_without_labels": 1,
                         "n_samples_without_group": 2}


@pytest.mark.connect
def test_make_groups_random_and_kmeans(spark, tmp_path):
    X, Y = random_problem(n=103, d=20, L=8, seed=2)
    write_xc(tmp_path / "train.txt", X, Y)
    meta = aggregated.make_groups(spark, str(tmp_path / "train.txt"), str(tmp_path / "r4"), "random", 4, 0, 0,
                                  "list", IngestParams())
    assert meta["n_groups"] == 26 and meta["group_size_max"] == 4 and meta["group_size_min"] == 3
    g = spark.read.format("delta").load(str(tmp_path / "r4" / "groups")).toPandas()
    assert sorted(g["sample_id"]) == list(range(103))                     # every sample exactly once
    sizes = g.groupby("group_id").size()
    assert (sizes == 4).sum() == 25 and (sizes == 3).sum() == 1
    gl = spark.read.format("delta").load(str(tmp_path / "r4" / "group_labels")).toPandas()
    Yd = Y.toarray() > 0
    for gid, mem in g.groupby("group_id")["sample_id"]:
        want = Yd[mem.to_numpy()].sum(axis=0)
        got = gl[gl["group_id"] == gid].set_index("label_idx")["count"]
        assert {int(k): int(v) for k, v in got.items()} == {int(k): int(want[k]) for k in np.flatnonzero(want)}
    assert json.loads((tmp_path / "r4" / "info.json").read_text())["n_labels"] == 8
    meta = aggregated.make_groups(spark, str(tmp_path / "train.txt"), str(tmp_path / "c"), "kmeans", 0, 3, 0,
                                  "set", IngestParams())
    g = spark.read.format("delta").load(str(tmp_path / "c" / "groups")).toPandas()
    sizes = g.groupby("group_id").size()
    assert meta["n_groups"] == 8 and sizes.max() - sizes.min() <= 1 and sorted(g["sample_id"]) == list(range(103))
    agg = aggregated.read(spark, str(tmp_path / "c"), IngestParams())
    assert agg.truth is not None and agg.info.n_labels == 8


# ---- model-guided re-assignment (eagle.refine_rounds) -----------------------------------------

def _tiny_trainer(agg):
    from xmc_spark import pipeline
    from xmc_spark.params import PipelineParams
    params = PipelineParams().set_dotted("tree.max_leaf_size", 3).set_dotted("train.threshold", 0.0)
    return pipeline.eagle_model_trainer(params, agg.info)


def _pairs(train):
    return {(r["sample_id"], int(k)): float(x) for r in train.collect()
            for k, x in zip(r["label_idx"], r["label_weight"])}


# joint (the default) in CI; the other two modes (11-13 s each) on demand, to keep CI under its 30
# minutes: test_refine_round_on_spark_equals_kernel checks a soft round's mix against the kernels, and
# tests/kernels/test_eagle.py the hard (eagle-mode) re-assignment kernel
@pytest.mark.parametrize("mode", [pytest.param("eagle", marks=pytest.mark.on_demand),
                                  pytest.param("soft", marks=pytest.mark.on_demand), "joint"])
def test_refine_with_full_mix_equals_zero_rounds(spark, agg_dir, mode):
    # mix 1 keeps the first assignment's distribution: one round changes nothing
    d, _, _ = agg_dir
    agg = aggregated.read(spark, str(d), IngestParams())
    base = EagleParams(mode=mode, T=6, min_weight=0.0)
    train0, info0, _, _ = eagle.run(agg, base, n_buckets=3)
    train1, info1, _, _ = eagle.run(agg, EagleParams(mode=mode, T=6, min_weight=0.0, refine_rounds=1, refine_mix=1.0,
                                                     refine_min_weight=0.0),
                                    n_buckets=3, train_model=_tiny_trainer(agg))
    assert "eagle.refine.seconds" not in info0
    p0, p1 = _pairs(train0), _pairs(train1)
    assert set(p0) == set(p1)
    for key, x in p0.items():
        assert p1[key] == pytest.approx(x, abs=1e-6)
    assert info1["eagle.refine.drift_tv"] == [pytest.approx(0.0, abs=1e-9)]
    assert info1["eagle.refine.drift_top_changed"] == [0.0]


@pytest.mark.parametrize("refine_min_weight,weight_scale", [(0.0, 1.0), (0.3, 1.0), (0.3, 0.1)])
def test_refine_round_on_spark_equals_kernel(spark, agg_dir, monkeypatch, refine_min_weight, weight_scale):
    """Two soft rounds through the stage (models from the pipeline's trainer, caught by the
    hook) against the kernels on the whole data: GRLR, softmax anchor, path scores, mix; with
    ``refine_min_weight`` the rounds' pairs below it are dropped (the triples' p are kept) but
    for each (group, label)'s best member (``weight_scale`` 0.1 puts the best ones below it)."""
    from xmc_spark.kernels.eagle import drift, path_scores, refine_assign, segment_softmax
    from xmc_spark.kernels.sparse import append_bias
    d, groups, glabels = agg_dir
    agg = aggregated.read(spark, str(d), IngestParams())
    models = []
    monkeypatch.setattr(eagle, "ROUND_MODEL_HOOK", lambda r, m: models.append(m))
    params = EagleParams(mode="soft", T=6, tau=30.0, min_weight=0.0, refine_rounds=2, refine_tau=10.0,
                         refine_mix=0.3, head_groups=12, refine_min_weight=refine_min_weight,
                         weight_scale=weight_scale)
    train, info, _, _ = eagle.run(agg, params, n_buckets=3, train_model=_tiny_trainer(agg))
    assert len(models) == 2 and models[0].index.depth >= 2
    E, _, sid, lb, w = _reference(d, groups, glabels, 6, "soft")
    Xl, _ = read_xc(str(d / "samples.txt"))
    lab, grp, row = zip(*[(k, j, i) for j, (mem, labs) in enumerate(zip(groups, glabels)) for k in labs for i in mem])
    tr = Triples(lab, grp, row, row, 10)
    p0 = segment_softmax(tr.seg, tr.scores(E, Xl), 30.0)[0]
    prev = p0
    for r, m in enumerate(models):
        s = path_scores(m.tree_arrays(), append_bias(Xl, m.bias), tr.row, tr.lab)
        (sid, lb, w), p = refine_assign(tr, s, p0, 10.0, 0.3, True, weight_scale)
        n_seg = len(tr.seg) - 1
        assert info["eagle.refine.drift_tv"][r] == pytest.approx(drift(tr, p, p0)[0] / n_seg, abs=1e-5)
        assert info["eagle.refine.change_tv"][r] == pytest.approx(drift(tr, p, prev)[0] / n_seg, abs=1e-5)
        prev = p
    got = _pairs(train)
    # per triple (soft: min(1, weight_scale g p)): below the bound only a (group, label)'s best
    # member stays, whatever its weight; then the largest weight per (sample, label)
    size = np.diff(tr.seg)
    wt = np.minimum(1.0, weight_scale * np.repeat(size, size) * p)
    best = np.zeros(len(wt), bool)
    best[tr.argmax(p)[0]] = True
    ref = {}
    for s_, k, x, b in zip(tr.sample_id.tolist(), tr.lab.tolist(), wt.tolist(), best.tolist()):
        if x >= refine_min_weight or b:
            ref[(s_, k)] = max(ref.get((s_, k), 0.0), x)
    assert len(ref) < len(sid) if refine_min_weight else len(ref) == len(sid)
    assert bool(np.any(best & (wt < refine_min_weight))) == (weight_scale < 1)   # the rule acts in the 0.1 case
    assert set(got) == set(ref)
    for key, x in ref.items():
        assert got[key] == pytest.approx(x, abs=1e-5)
    assert len(info["eagle.refine.seconds"]) == 2 and info["eagle.assigned_pairs"] == len(ref)


@pytest.mark.parametrize("keep", [True, False])
def test_final_model_keeps_the_round_models_tree(spark, agg_dir, tmp_path, monkeypatch, keep):
    """``eagle.refine_keep_tree``: the pipeline's final model trains on the last round model's
    tree (the ``tree`` table is that model's label -> leaf, and ``label_embeddings`` its PIFA, run
    here with ``embedding.write_table``); off, the tree stage grows the tree the trainer grows on
    the final training table (run with the default: no ``label_embeddings`` table). The round
    model's node solver runs at ``eagle.refine_eps``, the final model's at ``train.eps``."""
    from xmc_spark import pipeline
    from xmc_spark.params import PipelineParams
    from xmc_spark.stages import node_training
    from xmc_spark.storage import read_delta
    d, _, _ = agg_dir
    models, eps, kws = [], [], []
    monkeypatch.setattr(eagle, "ROUND_MODEL_HOOK", lambda r, m: models.append(m))
    real_train = node_training.run

    def train_spy(samples, index, n_features, tp, **kw):      # the real trainer, its tolerance recorded
        eps.append(tp.eps)
        kws.append(kw)
        return real_train(samples, index, n_features, tp, **kw)
    monkeypatch.setattr(node_training, "run", train_spy)
    params = (PipelineParams().set_dotted("tree.max_leaf_size", 3).set_dotted("train.threshold", 0.0)
              .set_dotted("mlflow.enabled", False).set_dotted("eagle.T", 6).set_dotted("eagle.refine_rounds", 1)
              .set_dotted("eagle.refine_mix", 0.0).set_dotted("eagle.refine_keep_tree", keep)
              .set_dotted("eagle.refine_eps", 0.7).set_dotted("embedding.write_table", keep))
    m = pipeline.run(spark, str(d), None, str(tmp_path / "run"), params)
    # the round model, then the final model (and its retraining after overlapping clusters, if any)
    assert eps[0] == 0.7 and len(eps) >= 2 and set(eps[1:]) == {params.train.eps}, eps
    # the final model's trainer is told the sample count (the eagle stage's table holds every input
    # sample, so ingest's count is exact), as on per-sample input: no count job of its own
    assert kws[1]["n_samples"] == read_delta(spark, str(tmp_path / "run" / "tables" / "train")).count() \
        == aggregated.read(spark, str(d), IngestParams()).info.n_samples
    assert PipelineParams().eagle.refine_eps == 0      # the default: the round models at train.eps
    monkeypatch.setattr(node_training, "run", real_train)
    tables = tmp_path / "run" / "tables"

    def leaves(rows):
        return dict(zip(rows["label_idx"].astype(int), rows["node"].astype(int)))
    final = leaves(read_delta(spark, str(tables / "tree")).toPandas())
    assert len(models) == 1 and len(final) == 10
    if keep:
        ix = models[0].index
        assert final == dict(zip(ix.slot_label.tolist(), ix.slot_leaf.tolist()))
        assert m["tree.from_eagle"] == 1 and "embedding" not in m["seconds"]
        assert (tables / "eagle_tree" / "_delta_log").is_dir()
    else:
        train = read_delta(spark, str(tables / "train"))
        fit = pipeline.eagle_model_trainer(params, aggregated.read(spark, str(d), IngestParams()).info)
        fit(train)
        assert final == leaves(fit.last[1])
        # the PIFA rows went into the tree's plan: no table, no embedding step of their own
        assert "tree.from_eagle" not in m and "embedding" not in m["seconds"]
        assert not (tables / "eagle_tree").exists() and not (tables / "label_embeddings").exists()
    if keep:     # the round model's PIFA: that of the first (joint) assignment's training table
        emb = read_delta(spark, str(tables / "label_embeddings")).toPandas()
        from xmc_spark.stages import label_embedding
        agg = aggregated.read(spark, str(d), IngestParams())
        first = eagle.run(agg, dataclasses.replace(params.eagle, refine_rounds=0), n_buckets=3)[0]
        ref = label_embedding.run(first, params.embedding, n_features=agg.info.n_features,
                                  n_labels=agg.info.n_labels).toPandas()
        assert _pairs(first) != _pairs(read_delta(spark, str(tables / "train")))   # the round moved pairs
        # the round model's units were placed by the rows per label of the table it trained on
        from xmc_spark.stages.evaluation import label_counts
        assert np.array_equal(kws[0]["label_counts"], label_counts(first, agg.info.n_labels))
        assert kws[0]["n_samples"] == first.count() == agg.info.n_samples
        emb, ref = (e.sort_values("label_idx").reset_index(drop=True) for e in (emb, ref))
        assert emb["label_idx"].tolist() == ref["label_idx"].tolist()
        for a, b, c, e in zip(emb["emb_idx"], ref["emb_idx"], emb["emb_val"], ref["emb_val"]):
            assert list(a) == list(b) and np.allclose(c, e, atol=1e-6)
        assert len(emb) >= 8 and all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in emb["emb_val"])
    slots = leaves(read_delta(spark, str(tables / "slots")).toPandas())
    assert slots == final                              # the final model's classifiers sit on that tree


def test_kept_tree_only_for_the_tree_settings_it_was_grown_with(spark, agg_dir, tmp_path):
    """A sweep shares EAGLE's output: a value with the eagle stage's tree settings keeps its
    tree (linked like train), another grows its own; the key is :func:`pipeline.tree_config`."""
    from xmc_spark import pipeline
    from xmc_spark.params import PipelineParams
    from xmc_spark.storage import table_version
    base = PipelineParams().set_dotted("tree.max_leaf_size", 3).set_dotted("mlflow.enabled", False) \
        .set_dotted("embedding.write_table", True)
    key = pipeline.tree_config
    assert key(base) == key(base.set_dotted("train.C", 4.0)) == key(base.set_dotted("eagle.refine_rounds", 2)) \
        == key(base.set_dotted("embedding.write_table", False))       # an output, not the tree's input
    for other in (("tree.max_leaf_size", 4), ("tree.nr_splits", 4), ("embedding.normalize_y", False),
                  ("tree.ensemble", 2), ("eagle.refine_keep_tree", False)):
        assert key(base.set_dotted(*other)) != key(base), other
    d, _, _ = agg_dir
    params = base.set_dotted("eagle.T", 6).set_dotted("eagle.refine_rounds", 1)
    res = pipeline.sweep(spark, str(d), None, str(tmp_path / "sw"), params, "tree.max_leaf_size", [3, 4])
    got = {r["value"]: r for r in res["results"]}
    # the value that grows its tree writes its own PIFA, not a new version of the base run's
    assert table_version(spark, str(tmp_path / "sw" / "tables" / "label_embeddings")) == 0
    assert (tmp_path / "sw" / "max_leaf_size=4" / "tables" / "label_embeddings" / "_delta_log").is_dir()
    assert got[3].get("tree.from_eagle") == 1 and "embedding" not in got[3]["seconds"]
    assert "tree.from_eagle" not in got[4] and "embedding" in got[4]["seconds"]
