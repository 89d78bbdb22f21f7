import numpy as np

from xmc_spark import synth


def test_synth_sizes_ranges_power_law_and_groups(spark, tmp_path):
    info = synth.run(spark, str(tmp_path / "s"), n_train=3000, n_test=500, n_labels=200, n_features=300,
                     group_size=4, seed=1)
    train = spark.read.format("delta").load(info["train"]).toPandas()
    test = spark.read.format("delta").load(info["test"]).toPandas()
    assert sorted(train.sample_id) == list(range(3000)) and sorted(test.sample_id) == list(range(3000, 3500))
    labels = np.concatenate(train.label_idx.to_numpy())
    feats = np.concatenate(train.feature_idx.to_numpy())
    assert labels.min() >= 0 and labels.max() < 200 and feats.min() >= 0 and feats.max() < 300
    counts = np.sort(np.bincount(labels, minlength=200))[::-1]
    share = counts[:10].sum() / counts.sum()                    # Zipf(1) over 200 labels: H(10)/H(200) = 0.50
    assert 0.4 < share < 0.6 and counts[0] > 20 * np.median(counts)
    assert all(len(set(labs)) == len(labs) for labs in train.label_idx)   # no duplicate labels in a row
    groups = spark.read.format("delta").load(info["aggregated"] + "/groups").toPandas()
    assert sorted(groups.sample_id) == list(range(3000))         # every sample in exactly one group
    assert set(groups.groupby("group_id").size()) == {4}
    gl = spark.read.format("delta").load(info["aggregated"] + "/group_labels").toPandas()
    merged = groups.merge(train[["sample_id", "label_idx"]], on="sample_id").explode("label_idx").dropna()
    expect = set(zip(merged.group_id, merged.label_idx.astype(int)))
    assert set(zip(gl.group_id, gl.label_idx)) == expect
    # deterministic for a seed
    again = synth.generate(spark, 3000, 200, 300, seed=1).toPandas().sort_values("sample_id")
    assert [list(x) for x in again.label_idx] == [list(x) for x in train.sort_values("sample_id").label_idx]
